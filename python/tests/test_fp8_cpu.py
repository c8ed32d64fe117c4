"""precision="fp8" on CPU tensors (the C library's CPU backend runs the FP8 block recipe):
the weights the binding quantizes bitwise against the recipe's quantizer, forward and
backward against the fp64 PyTorch emulation of the recipe (fp8_reference.py, with its
derived tolerances), the cache of quantized weights (reused without a weight update,
invalidated by one), torch.compile and activation checkpointing, the modules' option
and the errors."""

from __future__ import annotations

import gc
import re

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import moefuse
from moefuse import _fp8, _lib, ops

from fp8_reference import fp8_experts_emulation, fp8_tolerances, quantize_blocks
from moe_reference import random_problem, rel_error

pytestmark = pytest.mark.usefixtures("library")

OUTPUTS = ("y", "dx", "dp", "dw13", "dw2")


@pytest.fixture
def quantize_calls(monkeypatch):
    """Counts moefuse_quantize_weights calls; starts from an empty cache."""
    ops.layer_cache.fp8.clear()
    calls = []
    quantize = _lib.Layer.quantize_weights

    def counting(self, *args, **kwargs):
        calls.append(self.cfg.fp8_pow2_scales)
        return quantize(self, *args, **kwargs)

    monkeypatch.setattr(_lib.Layer, "quantize_weights", counting)
    return calls


def run_fp8(x, ids, p, w13, w2, dy, pow2=False, recompute=False):
    """(y, dx, dp, dw13, dw2) from moefuse.experts(precision="fp8") with autograd."""
    x, p, w13, w2 = (t.detach().clone().requires_grad_() for t in (x, p, w13, w2))
    y = moefuse.experts(x, ids, p, w13, w2, recompute=recompute, precision="fp8",
                        fp8_pow2_scales=pow2)
    y.backward(dy)
    return y.detach(), x.grad, p.grad, w13.grad, w2.grad


def most_rows(ids: torch.Tensor, num_experts: int) -> int:
    return max(1, max(int((ids == e).sum()) for e in range(num_experts)))


# ---- the quantized weights ------------------------------------------------------------------


def _array(buffer: torch.Tensor, address: int, shape, dtype) -> torch.Tensor:
    offset = address - buffer.data_ptr()
    numel = torch.Size(shape).numel()
    item = torch.empty((), dtype=dtype).element_size()
    return buffer[offset:offset + numel * item].view(dtype).view(shape)


@pytest.mark.parametrize("pow2", [False, True])
def test_quantized_weights_bitwise_against_the_recipe(pow2):
    """moefuse_quantize_weights through the binding (one buffer, the view's eight arrays)
    against the emulation's quantizer, code for code and scale for scale, with an all-zero
    block (scale 1), blocks holding one huge or one tiny value, an fp32 subnormal beside
    normal values, short blocks (H = 200, 2I = 144); W^T's codes and scales are W's
    transposed."""
    E, H, I = 3, 200, 72
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, generator=g) * 0.05
    w2 = torch.randn(E, H, I, generator=g) * 0.05
    w13[1, :128, :128] = 0  # an all-zero block
    w13[2, 5, 7], w2[0, 3, 4] = 1e30, -1e-30  # the block's scale: huge, tiny
    w2[1, 150, 10] = 3e-41  # an fp32 subnormal beside normal values
    layer = ops.layer_cache.get(H, I, E, 2, 1, torch.device("cpu"),
                                _lib.SavedMode.SAVE_ACTIVATIONS, _lib.Precision.FP8_BLOCK, pow2)
    weights = _fp8.Fp8WeightCache().get(layer, w13, w2)
    assert (weights.hidden, weights.intermediate, weights.num_local_experts,
            weights.pow2_scales) == (H, I, E, int(pow2))
    buffer = weights.buffer
    assert buffer.numel() == layer.fp8_weights_bytes() and buffer.data_ptr() % 256 == 0
    nb = lambda n: (n + 127) // 128  # noqa: E731
    for w, name, rows, cols in ((w13, "w13", 2 * I, H), (w2, "w2", H, I)):
        codes = _array(buffer, getattr(weights, name), (E, rows, cols), torch.uint8)
        scale = _array(buffer, getattr(weights, name + "_scale"), (E, nb(rows), nb(cols)),
                       torch.float32)
        codes_t = _array(buffer, getattr(weights, name + "t"), (E, cols, rows), torch.uint8)
        scale_t = _array(buffer, getattr(weights, name + "t_scale"), (E, nb(cols), nb(rows)),
                         torch.float32)
        for e in range(E):
            want_codes, want_scale = quantize_blocks(w[e], pow2)
            assert torch.equal(codes[e], want_codes.view(torch.uint8)), f"{name}[{e}] codes"
            assert torch.equal(scale[e], want_scale), f"{name}[{e}] scales"
            assert torch.equal(codes_t[e], codes[e].T) and torch.equal(scale_t[e], scale[e].T)
    assert _array(buffer, weights.w13_scale, (E, 2, 2), torch.float32)[1, 0, 0] == 1.0
    if pow2:
        assert torch.equal(torch.frexp(scale).mantissa, torch.full_like(scale, 0.5))


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
    x, ids, p, w13, w2, dy = random_problem(*shape, seed=1, drop_fraction=drop, skew=skew)
    got = run_fp8(x, ids, p, w13, w2, dy, pow2=pow2, recompute=recompute)
    ref = fp8_experts_emulation(x, ids, p, w13, w2, dy, pow2=pow2)
    tol = fp8_tolerances(shape[1], shape[2], most_rows(ids, shape[3]), bf16_wgrad=True)
    for name, g, r in zip(OUTPUTS, got, ref):
        assert torch.isfinite(g).all(), name
        err = rel_error(g, r)
        assert err <= tol[name], f"{name}: relative error {err:.3e} > tolerance {tol[name]:.3e}"
    assert [t.dtype for t in got] == [torch.bfloat16] * 2 + [torch.float32] + [torch.bfloat16] * 2
    assert torch.all(got[2][ids < 0] == 0), "dropped slots must get d p = 0"
    assert quantize_calls == [int(pow2)]  # the forward's quantization served the backward


def test_fp32_master_weights_get_fp32_gradients(quantize_calls):
    """fp32 weights are quantized from their fp32 values (no bf16 rounding first) and get
    fp32 gradients, those of the real weights."""
    x, ids, p, w13, w2, dy = random_problem(96, 256, 96, 8, 2, seed=3)
    g = torch.Generator().manual_seed(3)
    w13 = w13.float() + torch.randn(w13.shape, generator=g) * 1e-4  # not bf16 values
    w2 = w2.float() + torch.randn(w2.shape, generator=g) * 1e-4
    got = run_fp8(x, ids, p, w13, w2, dy)
    assert got[3].dtype == torch.float32 and got[4].dtype == torch.float32
    ref = fp8_experts_emulation(x, ids, p, w13, w2, dy)
    tol = fp8_tolerances(256, 96, most_rows(ids, 8))
    for name, g_, r in zip(OUTPUTS, got, ref):
        assert rel_error(g_, r) <= tol[name], name
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
    torch._dynamo.reset()
    x, _, _, dy = micro_batch(12)
    model = TinyMoE()
    results = []
    for fn in (model, torch.compile(model, fullgraph=True, backend="aot_eager")):
        model.zero_grad()
        xl = x.clone().requires_grad_()
        y = fn(xl)
        y.backward(dy)
        results.append((y.detach(), xl.grad, model.gate.weight.grad,
                        model.experts.gate_up_proj.grad, model.experts.down_proj.grad))
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)
    assert len(quantize_calls) == 1


def test_activation_checkpointing_recomputes_the_same_bits(quantize_calls):
    module = fp8_module(seed=13)
    x, ids, p, dy = micro_batch(13)
    results = []
    for checkpointed in (False, True):
        module.zero_grad()
        xl = x.clone().requires_grad_()
        y = (checkpoint(module, xl, ids, p, use_reentrant=False) if checkpointed
             else module(xl, ids, p))
        y.backward(dy)
        results.append((y.detach(), xl.grad, module.gate_up_proj.grad, module.down_proj.grad))
    for plain, recomputed in zip(*results):
        assert torch.equal(plain, recomputed)
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


def test_from_transformers_takes_the_option():
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe import modeling_qwen3_moe
    config = transformers.Qwen3MoeConfig(hidden_size=128, moe_intermediate_size=64,
                                         num_experts=8, num_experts_per_tok=2)
    torch.manual_seed(16)
    source = modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config).to(torch.bfloat16)
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


def test_library_refusal_of_fp8_on_cuda_is_reworded():
    """No GPU needed: the library refuses an FP8 CUDA config when checking it, and the
    binding turns MOEFUSE_ERR_UNSUPPORTED into Fp8UnsupportedError saying what runs."""
    cfg = _lib.config_init(128, 128, 8, 2, 64)
    cfg.backend, cfg.precision = _lib.Backend.CUDA, _lib.Precision.FP8_BLOCK
    with pytest.raises(moefuse.MoefuseError) as info:
        _lib.Layer(cfg)
    assert info.value.status == _lib.Status.ERR_UNSUPPORTED
    with pytest.raises(moefuse.Fp8UnsupportedError) as reworded:
        _fp8.raise_if_unsupported(info.value, cfg, torch.device("cuda", 0))
    err = reworded.value
    assert err.status == _lib.Status.ERR_UNSUPPORTED and err.__cause__ is info.value
    assert "precision='fp8' on cuda:0" in str(err)
    assert "FP8 kernels are not built for the GPU yet" in str(err) or "sm_90" in str(err)
    assert info.value.message in str(err)
    _fp8.raise_if_unsupported(info.value, _lib.config_init(128, 128, 8, 2, 64),
                              torch.device("cuda", 0))  # a bf16 config: not reworded


def _needs_gpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine: FP8 on CUDA tensors is refused where "
                    "one is")


def test_fp8_on_cuda_tensors_raises_clearly():
    _needs_gpu()
    x, ids, p, w13, w2, _ = (t.cuda() for t in random_problem(64, 128, 128, 8, 2))
    with pytest.raises(moefuse.Fp8UnsupportedError,
                       match="not built for the GPU yet|needs an sm_90"):
        moefuse.experts(x, ids, p, w13, w2, precision="fp8")


def test_expert_parallel_fp8_raises_clearly():
    _needs_gpu()
    with moefuse.virtual_comm(1) as comm:
        with pytest.raises(moefuse.Fp8UnsupportedError,
                           match="not built for the GPU yet|needs an sm_90"):
            moefuse.ExpertParallelExperts(128, 128, 8, 2, 64, comm, 0, 1, device="cuda",
                                          precision="fp8")


def test_w13_halves_equal_packed():
    """precision="fp8" with W13 as (gate, up): the halves joined once for the weights'
    quantization, dW13 written in halves by the library; the packed call's bits."""
    x, ids, p, w13, w2, dy = random_problem(100, 128, 128, 8, 2, seed=5)
    I = w13.shape[1] // 2
    outs = []
    for halves in (False, True):
        xs, ps, w2s = (t.detach().clone().requires_grad_() for t in (x, p, w2))
        if halves:
            ws = [w13[:, :I].clone().requires_grad_(), w13[:, I:].clone().requires_grad_()]
            arg = tuple(ws)
        else:
            ws = [w13.detach().clone().requires_grad_()]
            arg = ws[0]
        y = moefuse.experts(xs, ids, ps, arg, w2s, precision="fp8")
        y.backward(dy)
        dw13 = torch.cat([w.grad for w in ws], dim=1) if halves else ws[0].grad
        outs.append((y.detach(), xs.grad, ps.grad, dw13, w2s.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
