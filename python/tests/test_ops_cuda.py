"""moefuse on CUDA tensors (the C library's CUDA backend) against the fp64 reference, and
the drop-in block inside a transformers Qwen3MoeForCausalLM.

    forward   : y against fp64, same shapes / routing edge cases / tolerance rule as the
                CPU tests (moe_reference.py), both saved modes, no_grad and training.
    backward  : dx, dp, dW13, dW2 against fp64 gradients. The library's CUDA backward
                is tried once on a small problem; if moefuse_backward answers
                MOEFUSE_ERR_UNSUPPORTED every gradient test is SKIPPED with that
                reason (any other error is a failure).
    model     : Qwen3MoeForCausalLM from a Qwen3-30B-A3B-like config (2 layers, random
                init, small vocab, H=2048, I=768, E=128, K=8) with every
                Qwen3MoeSparseMoeBlock swapped for moefuse.MoefuseQwen3MoeBlock, against
                the unmodified model (see test_causal_lm_matches_transformers).

Everything skips with its reason without a CUDA device, and the model test without
transformers.
"""

from __future__ import annotations

import copy
import functools
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

import moefuse
from moefuse import _lib

from moe_reference import (assert_close_bf16, experts_reference, experts_reference_grads,
                           random_problem, rel_error)

pytestmark = [
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="no CUDA device on this machine (torch.cuda.is_available() is False): the "
               "CUDA backend is tested where one is"),
    pytest.mark.usefixtures("library"),
]

DEV = torch.device("cuda")
NAMES = ("y", "dx", "dp", "dw13", "dw2")




@functools.lru_cache(maxsize=None)
def cuda_backward_unsupported() -> Optional[str]:
    """None when the library's CUDA backward runs, else the reason it answered
    MOEFUSE_ERR_UNSUPPORTED. Found by trying (a small problem), never assumed."""
    return moefuse.backward_unsupported_reason(DEV)


def require_backward() -> None:
    reason = cuda_backward_unsupported()
    if reason is not None:
        pytest.skip(f"the library's CUDA backward is not available: moefuse_backward "
                    f"returned {reason}")


def on_device(*tensors):
    return tuple(t.to(DEV) for t in tensors)


def run_op(x, ids, p, w13, w2, dy, recompute=False, save_inputs=True):
    """(y, dx, dp, dw13, dw2) on CUDA from the op with autograd, as CPU tensors."""
    x, p, w13, w2 = (t.detach().to(DEV).clone().requires_grad_() for t in (x, p, w13, w2))
    y = moefuse.experts(x, ids.to(DEV), p, w13, w2, recompute=recompute,
                        save_inputs=save_inputs)
    y.backward(dy.to(DEV))
    moefuse.check_device_errors()
    return tuple(t.cpu() for t in (y.detach(), x.grad, p.grad, w13.grad, w2.grad))


def reference(x, ids, p, w13, w2, dy):
    """fp64 (y, dx, dp, dw13, dw2), computed on the GPU (fp64 there is exact enough and
    fast), returned on the CPU."""
    return tuple(t.cpu() for t in experts_reference_grads(*on_device(x, ids, p, w13, w2, dy)))


def reference_y(x, ids, p, w13, w2):
    x, ids, p, w13, w2 = on_device(x, ids, p, w13, w2)
    return experts_reference(x.double(), ids.long(), p.double(), w13.double(),
                             w2.double()).cpu()


def forward(x, ids, p, w13, w2, grad: bool, recompute=False):
    """y of the op on CUDA; grad=True runs the training forward (writes the saved buffer)."""
    x, ids, p, w13, w2 = on_device(x, ids, p, w13, w2)
    if grad:
        x.requires_grad_()
        y = moefuse.experts(x, ids, p, w13, w2, recompute=recompute)
    else:
        with torch.no_grad():
            y = moefuse.experts(x, ids, p, w13, w2, recompute=recompute)
    moefuse.check_device_errors()
    return y.detach().cpu()


# ---- forward ---------------------------------------------------------------------------------

# The CUDA backend takes H and I in multiples of 128 (its GEMM tiles; layer creation
# refuses other sizes with MOEFUSE_ERR_UNSUPPORTED).
SHAPES = [
    # T, H, I, E, K
    (64, 128, 128, 8, 2),
    (200, 256, 384, 16, 4),    # I not a power of two
    (1, 128, 128, 8, 8),       # T = 1, K = E
    (37, 128, 128, 128, 8),    # E = 128 like Qwen3, most experts empty
    (512, 2048, 768, 128, 8),  # qwen3-30b-a3b
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "train"])
def test_forward_matches_reference(shape, recompute, grad):
    x, ids, p, w13, w2, _ = random_problem(*shape, seed=1)
    y = forward(x, ids, p, w13, w2, grad, recompute)
    assert y.dtype == torch.bfloat16
    assert_close_bf16(y, reference_y(x, ids, p, w13, w2), "y")


@pytest.mark.parametrize("skew, drop", [("one_expert", 0.0), ("zipf", 0.0), ("uniform", 0.3),
                                        ("uniform", 1.0)])
def test_forward_routing_edge_cases(skew, drop):
    x, ids, p, w13, w2, _ = random_problem(96, 128, 128, 16, 4, seed=2, drop_fraction=drop,
                                           skew=skew)
    y = forward(x, ids, p, w13, w2, grad=True)
    if drop == 1.0:
        assert torch.count_nonzero(y) == 0, "y not zero with every slot dropped"
        return
    assert_close_bf16(y, reference_y(x, ids, p, w13, w2), "y")


def test_forward_deterministic_and_strided():
    x, ids, p, w13, w2, _ = random_problem(256, 256, 128, 16, 4, seed=4)
    first = forward(x, ids, p, w13, w2, grad=False)
    for _ in range(3):
        assert torch.equal(first, forward(x, ids, p, w13, w2, grad=False))
    wide = torch.zeros(256, 320, dtype=torch.bfloat16)
    wide[:, 32:288] = x  # row stride 320 elements (640 bytes, 16-byte aligned): no copy
    with torch.no_grad():
        y_strided = moefuse.experts(wide.to(DEV)[:, 32:288], *on_device(ids, p, w13, w2))
        y_int64 = moefuse.experts(*on_device(x, ids.long(), p, w13, w2))
    assert torch.equal(first, y_strided.cpu())
    assert torch.equal(first, y_int64.cpu())


def test_fp32_master_weights_forward():
    x, ids, p, w13, w2, _ = random_problem(64, 128, 128, 8, 2, seed=3)
    y = forward(x, ids, p, w13.float(), w2.float(), grad=False)
    assert torch.equal(y, forward(x, ids, p, w13, w2, grad=False))


def test_bad_expert_id_is_reported_by_check_device_errors():
    """On CUDA ids are checked on the device; check_device_errors() raises the first bad
    id. A config no other test uses (E = 9), so its layer holds only this record."""
    x, ids, p, w13, w2, _ = random_problem(16, 128, 128, 9, 2, seed=5)
    ids = ids.clone()
    ids[5, 1] = 9
    with torch.no_grad():
        moefuse.experts(*on_device(x, ids, p, w13, w2))
    with pytest.raises(moefuse.MoefuseError) as info:
        moefuse.check_device_errors()
    assert info.value.status == _lib.Status.ERR_EXPERT_ID, info.value
    moefuse.check_device_errors()  # reported once, then cleared


def test_int64_ids_outside_int32_are_reported_not_wrapped():
    """Narrowed as they are, 2^32 + 3 would run as expert 3; the op saturates it to
    2^31 - 1, which the device check reports. A config no other test uses (E = 10)."""
    x, ids, p, w13, w2, _ = random_problem(16, 128, 128, 10, 2, seed=6)
    ids = ids.to(torch.int64)
    ids[5, 1] = 2**32 + 3
    with torch.no_grad():
        moefuse.experts(*on_device(x, ids, p, w13, w2))
    with pytest.raises(moefuse.MoefuseError) as info:
        moefuse.check_device_errors()
    assert info.value.status == _lib.Status.ERR_EXPERT_ID, info.value


# ---- backward --------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("recompute", [False, True])
def test_backward_matches_reference(shape, recompute):
    require_backward()
    x, ids, p, w13, w2, dy = random_problem(*shape, seed=1)
    got = run_op(x, ids, p, w13, w2, dy, recompute=recompute)
    ref = reference(x, ids, p, w13, w2, dy)
    for name, g, r in zip(NAMES, got, ref):
        assert_close_bf16(g, r, name)
    assert got[1].dtype == torch.bfloat16 and got[2].dtype == torch.float32
    assert got[3].dtype == torch.bfloat16 and got[4].dtype == torch.bfloat16


@pytest.mark.parametrize("skew, drop", [("one_expert", 0.0), ("zipf", 0.0), ("uniform", 0.3),
                                        ("uniform", 1.0)])
def test_backward_routing_edge_cases(skew, drop):
    require_backward()
    x, ids, p, w13, w2, dy = random_problem(96, 128, 128, 16, 4, seed=2, drop_fraction=drop,
                                            skew=skew)
    got = run_op(x, ids, p, w13, w2, dy)
    if drop == 1.0:
        for name, g in zip(NAMES, got):
            assert torch.count_nonzero(g) == 0, f"{name} not zero with every slot dropped"
        return
    for name, g, r in zip(NAMES, got, reference(x, ids, p, w13, w2, dy)):
        assert_close_bf16(g, r, name)
    assert torch.all(got[2][ids < 0] == 0), "dropped slots must get d p = 0"


def test_backward_fp32_master_weights_and_recompute_equal():
    require_backward()
    x, ids, p, w13, w2, dy = random_problem(128, 128, 128, 8, 2, seed=3)
    y, dx, dp, dw13, dw2 = run_op(x, ids, p, w13.float(), w2.float(), dy)
    assert dw13.dtype == torch.float32 and dw2.dtype == torch.float32
    for name, g, r in zip(NAMES, (y, dx, dp, dw13, dw2), reference(x, ids, p, w13, w2, dy)):
        assert_close_bf16(g, r, name)
    bf16 = run_op(x, ids, p, w13, w2, dy)
    assert torch.equal(y, bf16[0]) and torch.equal(dw13.to(torch.bfloat16), bf16[3])
    # Saved activations (with or without the input rows) and recompute run the same
    # GEMMs on the same rows: same bits.
    for a, b, c in zip(bf16, run_op(x, ids, p, w13, w2, dy, recompute=True),
                       run_op(x, ids, p, w13, w2, dy, save_inputs=False)):
        assert torch.equal(a, b) and torch.equal(a, c)
    # The input rows: [rows_cap, H] bf16, rows_cap = the T*K slots and each expert's
    # padding rows, rounded to the 128-row tiles (the saved layout of src/cuda/pipeline/workspace.cu).
    H, K = x.shape[1], ids.shape[1]
    extra = (moefuse.saved_bytes(128, H, 128, 8, K, DEV)
             - moefuse.saved_bytes(128, H, 128, 8, K, DEV, save_inputs=False))
    rows_cap = (128 * K + 127 * min(8, 128 * K) + 127) // 128 * 128
    assert extra == rows_cap * H * 2


def test_backward_deterministic():
    require_backward()
    problem = random_problem(512, 256, 128, 16, 4, seed=4)
    first = run_op(*problem)
    for _ in range(3):
        for a, b in zip(first, run_op(*problem)):
            assert torch.equal(a, b)


def test_two_forwards_before_backward():
    require_backward()
    x1, ids1, p1, w13, w2, dy1 = random_problem(64, 128, 128, 8, 2, seed=6)
    x2, ids2, p2, _, _, dy2 = random_problem(80, 128, 128, 8, 2, seed=7)
    w13_l, w2_l = (t.to(DEV).requires_grad_() for t in (w13, w2))
    x1_l, x2_l = (t.to(DEV).requires_grad_() for t in (x1, x2))
    y1 = moefuse.experts(x1_l, ids1.to(DEV), p1.to(DEV), w13_l.float(), w2_l.float())
    y2 = moefuse.experts(x2_l, ids2.to(DEV), p2.to(DEV), w13_l.float(), w2_l.float())
    torch.autograd.backward([y2, y1], [dy2.to(DEV), dy1.to(DEV)])
    r1 = reference(x1, ids1, p1, w13, w2, dy1)
    r2 = reference(x2, ids2, p2, w13, w2, dy2)
    assert_close_bf16(x1_l.grad.cpu(), r1[1], "dx")
    assert_close_bf16(x2_l.grad.cpu(), r2[1], "dx")
    assert_close_bf16(w13_l.grad.cpu(), r1[3] + r2[3], "dw13")
    assert_close_bf16(w2_l.grad.cpu(), r2[4] + r1[4], "dw2")


# ---- the drop-in block inside transformers' Qwen3MoeForCausalLM ----------------------------

# Qwen3-30B-A3B (config.json of Qwen/Qwen3-30B-A3B) with 2 layers and a small vocabulary.
QWEN3_30B_A3B_SMALL = dict(
    vocab_size=1024, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
    mlp_only_layers=[], hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1e6,
    max_position_embeddings=40960, initializer_range=0.02, tie_word_embeddings=False,
    attention_bias=False, attention_dropout=0.0, output_router_logits=False)


def _pin_transformers_router(router, pinned: list) -> None:
    """router (a Qwen3MoeTopKRouter) selects pinned.pop(0) instead of its own top-K,
    computing everything else in the router's dtype (fp64 for the reference)."""
    def forward(hidden_states):
        x = hidden_states.reshape(-1, router.hidden_dim)
        logits = F.linear(x, router.weight)
        ids = pinned.pop(0)
        p = torch.softmax(logits, dim=-1).gather(1, ids)
        if router.norm_topk_prob:
            p = p / p.sum(dim=-1, keepdim=True)
        return logits, p, ids
    router.forward = forward


def _pin_moefuse_block(block, pinned: list, natural: list) -> None:
    """block.route as MoefuseQwen3MoeBlock.route(router='torch') computes it, except that
    the top-K selection is pinned.pop(0); the block's own selection goes to natural."""
    def route(x):
        logits = block.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        natural.append(torch.topk(probs, block.top_k, dim=-1).indices)
        ids = pinned.pop(0)
        p = probs.gather(1, ids)
        if block.norm_topk_prob:
            p = p / p.sum(dim=-1, keepdim=True)
        return logits, ids.to(torch.int32), p
    block.route = route


def compare_causal_lm(device, config_kwargs: dict, batch: int = 2, seq: int = 64,
                      seed: int = 0, backward: bool = True) -> dict:
    """Builds Qwen3MoeForCausalLM(config) (random init, bf16) = the unmodified model,
    a copy with every MoE block replaced by MoefuseQwen3MoeBlock.from_transformers, and
    the fp64 truth (the unmodified model's bf16 values held in fp64, eager experts).
    Runs the same tokens through all three and back-propagates the same d logits.

    Selection. top-K is discontinuous: bf16 noise in a layer's input flips near-tied
    8th/9th experts (for this init ~10% of tokens per layer), and one flipped slot
    changes that token's output by ~p_8 |o|, far above bf16 rounding. So the fp64 truth
    and the moefuse model use the experts the unmodified model selected in each layer;
    in layer 0, whose input is bit-identical in both bf16 models, the moefuse block's
    own selection must equal transformers' exactly.

    Returns {name: (err_moefuse, err_transformers)} of the norm-wise relative errors
    against fp64 of the logits and (backward=True) of every parameter's gradient, plus
    'layer0_ids_equal' and 'selection_mismatch' (per layer, the fraction of tokens
    whose own selection in the moefuse model differed from transformers').
    """
    import transformers

    config = transformers.Qwen3MoeConfig(**config_kwargs)
    torch.manual_seed(seed)
    with torch.device(device):
        hf = transformers.Qwen3MoeForCausalLM(config)
    hf = hf.to(torch.bfloat16)
    ours = copy.deepcopy(hf)
    truth = copy.deepcopy(hf).to(torch.float64)
    truth.set_experts_implementation("eager")  # grouped_mm is bf16 only
    for layer in ours.model.layers:
        layer.mlp = moefuse.MoefuseQwen3MoeBlock.from_transformers(layer.mlp)
        assert isinstance(layer.mlp, moefuse.MoefuseQwen3MoeBlock)

    g = torch.Generator(device=device).manual_seed(seed + 1)
    input_ids = torch.randint(0, config.vocab_size, (batch, seq), device=device, generator=g)
    dlogits = torch.randn(batch, seq, config.vocab_size, device=device, generator=g)

    # The unmodified model, recording its selection per layer.
    selected, hooks = [], []
    for layer in hf.model.layers:
        hooks.append(layer.mlp.gate.register_forward_hook(
            lambda _m, _i, out: selected.append(out[2].detach())))
    with torch.set_grad_enabled(backward):
        logits_hf = hf(input_ids=input_ids).logits
        if backward:
            logits_hf.float().backward(dlogits)
        for h in hooks:
            h.remove()
        assert len(selected) == config.num_hidden_layers

        pinned, natural = list(selected), []
        for layer in ours.model.layers:
            _pin_moefuse_block(layer.mlp, pinned, natural)
        logits_ours = ours(input_ids=input_ids).logits
        if backward:
            logits_ours.float().backward(dlogits)
        if device.type == "cuda":
            moefuse.check_device_errors()

        pinned = list(selected)
        for layer in truth.model.layers:
            _pin_transformers_router(layer.mlp.gate, pinned)
        logits_truth = truth(input_ids=input_ids).logits
        if backward:
            logits_truth.backward(dlogits.double())

    result = {"logits": (rel_error(logits_ours.detach(), logits_truth.detach()),
                         rel_error(logits_hf.detach(), logits_truth.detach()))}
    if backward:
        params_hf = dict(hf.named_parameters())
        params_truth = dict(truth.named_parameters())
        for name, param in ours.named_parameters():
            ref = params_truth[name].grad
            result[name] = (rel_error(param.grad, ref), rel_error(params_hf[name].grad, ref))
    result["layer0_ids_equal"] = torch.equal(natural[0], selected[0])
    result["selection_mismatch"] = [
        (nat.sort(-1).values != sel.sort(-1).values).any(-1).float().mean().item()
        for nat, sel in zip(natural, selected)]
    return result


def check_causal_lm(result: dict) -> list[str]:
    """The FlashAttention rule, as test_modules.py uses against transformers' block:
    against fp64, moefuse's error is at most 2x that of the unmodified bf16 model plus
    1e-5, for the logits and every parameter's gradient. Returns the violations."""
    bad = []
    for name, value in result.items():
        if name in ("layer0_ids_equal", "selection_mismatch"):
            continue
        ours, theirs = value
        if not ours <= 2 * theirs + 1e-5:
            bad.append(f"{name}: moefuse {ours:.3e} vs transformers {theirs:.3e}")
    if not result["layer0_ids_equal"]:
        bad.append("layer 0: the moefuse block selected other experts than transformers' "
                   "router from the same bf16 input")
    return bad


def test_causal_lm_matches_transformers():
    """Logits and all gradients of Qwen3MoeForCausalLM with moefuse blocks against the
    unmodified model (Qwen3-30B-A3B shapes, 2 layers, 128 tokens): see compare_causal_lm."""
    pytest.importorskip("transformers", reason="transformers not installed: `pip install "
                        "transformers` to test the block inside Qwen3MoeForCausalLM")
    require_backward()
    result = compare_causal_lm(DEV, QWEN3_30B_A3B_SMALL)
    report = "\n".join(f"  {k}: {v}" for k, v in result.items())
    bad = check_causal_lm(result)
    assert not bad, "\n".join(bad) + "\nall:\n" + report
    print(report)


def test_causal_lm_forward_matches_transformers():
    """The forward alone (runs without the library's CUDA backward): the logits of the
    moefuse model against the unmodified model's, both against fp64."""
    pytest.importorskip("transformers", reason="transformers not installed: `pip install "
                        "transformers` to test the block inside Qwen3MoeForCausalLM")
    result = compare_causal_lm(DEV, QWEN3_30B_A3B_SMALL, backward=False)
    bad = check_causal_lm(result)
    assert not bad, "\n".join(bad) + f"\nall: {result}"
