"""precision="fp8" on CPU tensors (the C library's CPU backend runs the FP8 block recipe):
the weights the binding quantizes bitwise against the recipe's quantizer, forward and
backward against the fp64 PyTorch emulation of the recipe (fp8_reference.py, with its
derived tolerances), the cache of quantized weights (reused without a weight update,
invalidated by one), torch.compile and activation checkpointing, the modules' option
and the errors: the option's, FP8 with expert parallelism (refused when the module is
made) and the library's refusals reworded (a pretended pre-sm_90 GPU, a comm). FP8 on
CUDA tensors is tested in test_fp8_cuda.py."""

from __future__ import annotations

import gc
import re

import pytest
import torch

import moefuse
from moefuse import _fp8, _lib, ops

from fp8_reference import (assert_checkpoint_equals_plain, assert_compiled_equals_eager,
                           assert_layers_interleaved_equal_alone, assert_quantized_weights,
                           assert_w13_halves_equal_packed,
                           check_against_emulation, run_fp8, special_weights)
from moe_reference import random_problem

pytestmark = pytest.mark.usefixtures("library")

# ---- the quantized weights ------------------------------------------------------------------


@pytest.mark.parametrize("pow2", [False, True])
def test_quantized_weights_bitwise_against_the_recipe(pow2):
    """moefuse_quantize_weights through the binding (one buffer, the view's eight arrays)
    against the emulation's quantizer, code for code and scale for scale, with an all-zero
    block (scale 1), blocks holding one huge or one tiny value, an fp32 subnormal beside
    normal values, short blocks (H = 200, 2I = 144); W^T's codes and scales are W's
    transposed."""
    E, H, I = 3, 200, 72
    w13, w2 = special_weights(E, H, I)
    layer = ops.layer_cache.get(H, I, E, 2, 1, torch.device("cpu"),
                                _lib.SavedMode.SAVE_ACTIVATIONS, _lib.Precision.FP8_BLOCK, pow2)
    weights = _fp8.Fp8WeightCache().get(layer, w13, w2)
    assert weights.buffer.numel() == layer.fp8_weights_bytes()
    assert_quantized_weights(weights, w13, w2, pow2)


# ---- forward and backward against the emulation ---------------------------------------------

CASES = [
    # (T, H, I, E, K), drop fraction, routing skew
    ((64, 256, 96, 8, 2), 0.0, "uniform"),
    ((300, 200, 72, 4, 2), 0.2, "uniform"),  # short tiles; > 128 rows per expert
    ((300, 128, 64, 8, 2), 0.0, "one_expert"),  # 300 rows on expert 0: 3 token tiles
    ((1, 64, 32, 8, 8), 0.0, "uniform"),  # T = 1, K = E
    ((40, 64, 48, 128, 8), 0.0, "zipf"),  # most experts empty
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[2]}-drop{c[1]}")
@pytest.mark.parametrize("pow2, recompute", [(False, False), (True, True)])
def test_fp8_matches_the_emulation(case, pow2, recompute, quantize_calls):
    shape, drop, skew = case
    problem = random_problem(*shape, seed=1, drop_fraction=drop, skew=skew)
    got = run_fp8(*problem, pow2=pow2, recompute=recompute)
    check_against_emulation(got, problem, pow2=pow2)
    assert [t.dtype for t in got] == [torch.bfloat16] * 2 + [torch.float32] + [torch.bfloat16] * 2
    assert torch.all(got[2][problem[1] < 0] == 0), "dropped slots must get d p = 0"
    assert [q.pow2 for q in quantize_calls] == [pow2]  # the forward's served the backward


def test_fp32_master_weights_get_fp32_gradients(quantize_calls):
    """fp32 weights are quantized from their fp32 values (no bf16 rounding first) and get
    fp32 gradients, those of the real weights."""
    x, ids, p, w13, w2, dy = random_problem(96, 256, 96, 8, 2, seed=3)
    g = torch.Generator().manual_seed(3)
    w13 = w13.float() + torch.randn(w13.shape, generator=g) * 1e-4  # not bf16 values
    w2 = w2.float() + torch.randn(w2.shape, generator=g) * 1e-4
    got = run_fp8(x, ids, p, w13, w2, dy)
    assert got[3].dtype == torch.float32 and got[4].dtype == torch.float32
    check_against_emulation(got, (x, ids, p, w13, w2, dy), bf16_wgrad=False)
    # the same compute as bf16 weights of the rounded values, but for the quantizer's input
    bf = run_fp8(x, ids, p, w13.bfloat16(), w2.bfloat16(), dy)
    assert not torch.equal(got[0], bf[0])


def test_fp8_is_not_bf16_and_deterministic():
    problem = random_problem(64, 128, 64, 8, 2, seed=4)
    first, second = run_fp8(*problem), run_fp8(*problem)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    x, ids, p, w13, w2, _ = problem
    assert not torch.equal(first[0], moefuse.experts(x, ids, p, w13, w2))


def test_fake_tensor_of_the_fp8_backward():
    """The backward op's fake gives the real op's dtypes with the FP8 arguments (the
    forward's fake is traced by the torch.compile test below)."""
    x, ids, p, w13, w2, dy = random_problem(20, 64, 32, 8, 2)
    mode = int(_lib.SavedMode.SAVE_ACTIVATIONS)
    fp8 = int(_lib.Precision.FP8_BLOCK)
    _, saved = torch.ops.moefuse.experts_fwd(x, ids, p, w13, w2, True, mode, fp8, True)
    torch.library.opcheck(torch.ops.moefuse.experts_bwd.default,
                          (dy, x, ids, p, w13, w2, saved, mode, fp8, True),
                          test_utils=("test_faketensor",))


# ---- the cache: once per optimizer step --------------------------------------------------------


def fp8_module(seed=5, dtype=torch.bfloat16, **kwargs):
    torch.manual_seed(seed)
    return moefuse.MoEExperts(8, 128, 64, precision="fp8", dtype=dtype, **kwargs)


def micro_batch(seed):
    x, ids, p, _, _, dy = random_problem(48, 128, 64, 8, 2, seed=seed)
    return x, ids, p, dy


def test_cache_reused_over_micro_batches(quantize_calls):
    """Two forwards and backwards without a weight update quantize once; the accumulated
    gradients are the sum of each micro-batch's."""
    module = fp8_module(dtype=torch.float32)
    grads = []
    for seed in (6, 7):
        x, ids, p, dy = micro_batch(seed)
        module(x, ids, p).backward(dy)
        grads.append(module.gate_up_proj.grad.clone())
    assert len(quantize_calls) == 1
    alone = fp8_module(dtype=torch.float32)
    x, ids, p, dy = micro_batch(7)
    alone(x, ids, p).backward(dy)
    assert torch.equal(grads[1], grads[0] + alone.gate_up_proj.grad)
    assert len(quantize_calls) == 2  # a new module: new weights
    del alone
    gc.collect()
    assert len(ops.layer_cache.fp8) == 1  # an entry dies with its weights


@pytest.mark.parametrize("update", ["sgd", "adamw_fused", "no_grad_inplace"])
def test_cache_invalidated_by_a_weight_update(update, quantize_calls):
    """An optimizer step re-quantizes: SGD bumps the version counters, fused AdamW does not
    (the optimizer-step hook sees it), an in-place update under no_grad bumps them. The
    output after the update is that of fresh weights of the new values."""
    module = fp8_module()
    x, ids, p, dy = micro_batch(8)
    module(x, ids, p).backward(dy)
    if update == "sgd":
        torch.optim.SGD(module.parameters(), lr=0.5).step()
    elif update == "adamw_fused":
        torch.optim.AdamW(module.parameters(), lr=1e-2, fused=True).step()
    else:
        with torch.no_grad():
            module.down_proj.mul_(0.5)
    with torch.no_grad():
        y_after = module(x, ids, p)
    assert len(quantize_calls) == 2
    fresh = fp8_module(seed=9)
    fresh.load_state_dict(module.state_dict())
    with torch.no_grad():
        assert torch.equal(y_after, fresh(x, ids, p))
        assert len(quantize_calls) == 3
        module(x, ids, p)  # no update since: reused
    assert len(quantize_calls) == 3


def test_inference_tensors_are_quantized_per_call(quantize_calls):
    """Inference tensors have no version counter: never cached, always right."""
    with torch.inference_mode():
        module = fp8_module()
        x, ids, p, _ = micro_batch(10)
        y1 = module(x, ids, p)
        y2 = module(x, ids, p)
    assert torch.equal(y1, y2) and len(quantize_calls) == 2 and len(ops.layer_cache.fp8) == 0


class TinyMoE(torch.nn.Module):
    """Router (moefuse.route) + FP8 experts."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.gate = torch.nn.Linear(128, 8, bias=False)
        self.experts = fp8_module(seed=11)

    def forward(self, x):
        ids, p = moefuse.route(self.gate(x.float()), 2)
        return self.experts(x, ids, p) * 2


def test_torch_compile_fullgraph_equals_eager(quantize_calls):
    """aot_eager, fullgraph: the quantization runs inside the op, bit for bit as eager, and
    the compiled step reuses the eager step's quantization (same weights)."""
    x, _, _, dy = micro_batch(12)
    assert_compiled_equals_eager(TinyMoE(), x, dy)
    assert len(quantize_calls) == 1


def test_activation_checkpointing_recomputes_the_same_bits(quantize_calls):
    module = fp8_module(seed=13)
    x, ids, p, dy = micro_batch(13)
    assert_checkpoint_equals_plain(module, x, ids, p, dy)
    assert len(quantize_calls) == 1


# ---- the modules ------------------------------------------------------------------------------


def test_modules_take_the_option():
    x, ids, p, _ = micro_batch(14)
    experts = fp8_module(seed=14, fp8_pow2_scales=True)
    assert "precision='fp8', fp8_pow2_scales=True" in repr(experts)
    y = moefuse.experts(x, ids, p, experts.w13, experts.w2, precision="fp8",
                        fp8_pow2_scales=True)
    assert torch.equal(experts(x, ids, p), y)

    torch.manual_seed(15)
    block = moefuse.MoefuseQwen3MoeBlock(128, 64, 8, 2, precision="fp8")
    assert block.experts.precision == "fp8"
    bf16 = moefuse.MoefuseQwen3MoeBlock(128, 64, 8, 2)
    bf16.load_state_dict(block.state_dict())
    assert bf16.experts.precision == "bf16"
    _, ids, p = block.route(x)
    want = moefuse.experts(x, ids, p, block.experts.w13, block.experts.w2, precision="fp8")
    assert torch.equal(block(x), want)
    assert not torch.equal(bf16(x), want)


def test_saved_inputs_default_follows_the_precision(monkeypatch):
    """save_inputs=None (every default) keeps the dispatched x rows in bf16 and not in FP8
    (docs/decisions/0012-saved-state.md); an explicit choice and recompute win."""
    both, acts = _lib.SavedMode.SAVE_ACTIVATIONS_AND_INPUTS, _lib.SavedMode.SAVE_ACTIVATIONS
    fp8 = int(_lib.Precision.FP8_BLOCK)
    assert ops.saved_mode_for(False, None) == both
    assert ops.saved_mode_for(False, None, fp8) == acts
    assert ops.saved_mode_for(False, True, fp8) == both
    assert ops.saved_mode_for(False, False) == acts
    assert ops.saved_mode_for(True, None, fp8) == _lib.SavedMode.RECOMPUTE
    modes = []
    get = ops.layer_cache.get

    def spy(*args, **kwargs):
        modes.append(_lib.SavedMode(args[6]))
        return get(*args, **kwargs)

    monkeypatch.setattr(ops.layer_cache, "get", spy)
    x, ids, p, _ = micro_batch(16)
    for precision, want in (("fp8", acts), ("bf16", both)):
        torch.manual_seed(16)
        block = moefuse.MoefuseQwen3MoeBlock(128, 64, 8, 2, precision=precision)
        assert block.experts.save_inputs is None
        modes.clear()
        block(x.clone().requires_grad_()).float().sum().backward()
        assert modes and set(modes) == {want}, (precision, modes)


def test_from_transformers_takes_the_option():
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe import modeling_qwen3_moe
    config = transformers.Qwen3MoeConfig(hidden_size=128, moe_intermediate_size=64,
                                         num_experts=8, num_experts_per_tok=2)
    torch.manual_seed(16)
    source = modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config).to(torch.bfloat16)
    with torch.no_grad():  # a block made alone holds torch.empty experts (no init)
        for param in source.parameters():
            param.normal_(0, 0.05)
    block = moefuse.MoefuseQwen3MoeBlock.from_transformers(source, precision="fp8")
    assert block.experts.precision == "fp8"
    x, _, _, _ = micro_batch(16)
    _, ids, p = block.route(x)
    want = moefuse.experts(x, ids, p, block.experts.w13, block.experts.w2, precision="fp8")
    out = block(x)
    assert torch.equal(out[0] if isinstance(out, tuple) else out, want)


# ---- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda **kw: moefuse.experts(*random_problem(4, 64, 32, 8, 2)[:5], **kw),
    lambda **kw: moefuse.MoEExperts(8, 64, 32, **kw),
    lambda **kw: moefuse.MoefuseQwen3MoeBlock(64, 32, 8, 2, **kw),
    # the option is checked before the comm (a comm needs a GPU)
    lambda **kw: moefuse.ExpertParallelExperts(128, 128, 8, 2, 64, None, 0, 1, **kw),
], ids=["experts", "MoEExperts", "MoefuseQwen3MoeBlock", "ExpertParallelExperts"])
def test_precision_option_errors(make):
    with pytest.raises(ValueError, match=re.escape("precision='fp16': expected one of 'bf16', "
                                                   "'fp8'")):
        make(precision="fp16")
    with pytest.raises(ValueError, match="fp8_pow2_scales=True applies to precision='fp8'"):
        make(fp8_pow2_scales=True)
    with pytest.raises(TypeError, match="fp8_pow2_scales must be a bool"):
        make(precision="fp8", fp8_pow2_scales=1)


def test_expert_parallel_fp8_passes_the_module_checks():
    """ExpertParallelExperts(precision="fp8") goes past the precision check to the next
    one (here comm None refuses); a bad precision is refused by name."""
    with pytest.raises(Exception) as info:
        moefuse.ExpertParallelExperts(128, 128, 8, 2, 64, None, 0, 1, precision="fp8")
    assert not isinstance(info.value, moefuse.Fp8UnsupportedError)
    assert "comm" in str(info.value)
    with pytest.raises(ValueError, match="precision='fp16'"):
        moefuse.ExpertParallelExperts(128, 128, 8, 2, 64, None, 0, 1, precision="fp16")


def _library_refusal(message: str) -> moefuse.MoefuseError:
    """A MOEFUSE_ERR_UNSUPPORTED of moefuse_layer_create, as the library raises it."""
    return moefuse.MoefuseError("moefuse_layer_create", _lib.Status.ERR_UNSUPPORTED,
                                "MOEFUSE_ERR_UNSUPPORTED", message)


def _fp8_cuda_config() -> _lib.Config:
    cfg = _lib.config_init(128, 128, 8, 2, 64)
    cfg.backend, cfg.precision = _lib.Backend.CUDA, _lib.Precision.FP8_BLOCK
    return cfg


def _pretend_gpu(monkeypatch, capability, name):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def test_library_refusals_of_fp8_are_reworded(monkeypatch):
    """What the library still refuses for FP8 on the GPU (a GPU older than sm_90) becomes Fp8UnsupportedError naming the GPU, the reason and what runs, the
    library's message at its end (the GPU pretended: no GPU needed)."""
    _pretend_gpu(monkeypatch, (8, 0), "NVIDIA A100-SXM4-80GB")
    words = ("(NVIDIA A100-SXM4-80GB, sm_80): moefuse's CUDA kernels (FP8 and BF16) are "
             "built for sm_90 (H100/H200) only")
    refusal = _library_refusal("config.backend = MOEFUSE_BACKEND_CUDA: refused (test)")
    cfg = _fp8_cuda_config()
    with pytest.raises(moefuse.Fp8UnsupportedError) as reworded:
        _fp8.raise_if_unsupported(refusal, cfg, torch.device("cuda", 0))
    err = reworded.value
    assert err.status == _lib.Status.ERR_UNSUPPORTED and err.__cause__ is refusal
    assert f"precision='fp8' on cuda:0 {words}" in str(err)
    assert "FP8 runs on CPU tensors" in str(err)
    assert str(err).endswith(f"The library said: {refusal.message}")
    # a bf16 config, or another status, is not reworded
    _fp8.raise_if_unsupported(refusal, _lib.config_init(128, 128, 8, 2, 64),
                              torch.device("cuda", 0))
    shape = moefuse.MoefuseError("moefuse_layer_create", _lib.Status.ERR_INVALID_CONFIG,
                                 "MOEFUSE_ERR_INVALID_CONFIG", "bad")
    _fp8.raise_if_unsupported(shape, cfg, torch.device("cuda", 0))


def test_refusals_on_sm90_are_not_reworded(monkeypatch):
    """On an sm_90 GPU FP8 runs, on one rank or with a comm: a refusal of an FP8 layer is
    about something else (the environment, a shape) and is raised as the library raised
    it."""
    _pretend_gpu(monkeypatch, (9, 0), "NVIDIA H200")
    refusal = _library_refusal("moefuse_layer_create: 2 virtual ranks need 6 CUDA hardware "
                               "queues (test)")
    # returns: the caller re-raises refusal
    assert _fp8.raise_if_unsupported(refusal, _fp8_cuda_config(),
                                     torch.device("cuda", 0)) is None


def test_library_refusal_without_a_gpu_is_reworded():
    """Where the library has no usable GPU (skipped where one is: there the layer is made),
    its own refusal of an FP8 CUDA layer is reworded the same way."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the FP8 CUDA layer is made there "
                    "(test_fp8_cuda.py)")
    cfg = _fp8_cuda_config()
    with pytest.raises(moefuse.MoefuseError) as info:
        _lib.Layer(cfg)
    assert info.value.status == _lib.Status.ERR_UNSUPPORTED
    with pytest.raises(moefuse.Fp8UnsupportedError) as reworded:
        _fp8.raise_if_unsupported(info.value, cfg, torch.device("cuda", 0))
    assert "precision='fp8' on cuda:0: this library does not run it" in str(reworded.value)
    assert str(reworded.value).endswith(f"The library said: {info.value.message}")


@pytest.mark.parametrize("recompute", [False, True])
def test_two_layers_interleaved_as_in_a_model(recompute):
    assert_layers_interleaved_equal_alone((256, 256, 128, 8, 4), "cpu", recompute)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_w13_halves_equal_packed(dtype, monkeypatch):
    assert_w13_halves_equal_packed(dtype, "cpu", monkeypatch)
