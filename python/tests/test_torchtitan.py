"""moefuse.torchtitan on CPU: TorchTitan's Qwen3 MoE model (its debugmodel_moe
configuration, shrunk) with its routed experts swapped for moefuse, against the same
model run by TorchTitan itself.

How close is close enough. Both models compute in bf16 and neither is the truth, so each
is compared with an fp64 copy of the model whose routers are pinned to the selection the
bf16 models made (a near tie resolved the other way would be a different function, not an
error). The rule is FlashAttention's, as in test_modules.py: moefuse's norm-wise relative
error against fp64 at most twice TorchTitan's plus 1e-5, for the output and for the
gradient of every parameter; and, for the MoE layer alone, moefuse within the bf16
tolerance of moe_reference.py. The routers are TorchTitan's code in both models, so with
equal inputs the selections are equal bit for bit; the test asserts it.

Activation checkpointing and FSDP2 are tested in test_torchtitan_ac_fsdp.py, expert
parallelism in test_torchtitan_ep.py; the shared model and fp64 reference are in
torchtitan_helpers.py, the CPU histc fixture and the one-rank gloo mesh in conftest.py.

CPU notes: TorchTitan 0.2.2's router counts tokens with torch.histc on int64 ids, which
PyTorch implements on CUDA only; conftest.py's cpu_histc routes integer histc through
float on CPU (exact for these counts) in both models. TorchTitan's grouped-mm experts need Triton
(generate_permute_indices), so the native model runs TorchTitan's for-loop experts
(use_grouped_mm=False): the same math in the same bf16 precision.
"""

from __future__ import annotations

import copy

import pytest
import torch

torchtitan = pytest.importorskip(
    "torchtitan", reason="TorchTitan is not installed (tools/install_deps.sh installs it)")

from torchtitan.models.moe import MoE, MoEArgs  # noqa: E402
from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter  # noqa: E402

import moefuse  # noqa: E402
import moefuse.torchtitan as mtt  # noqa: E402

from moe_reference import assert_close_bf16, rel_error, tolerance  # noqa: E402
from torchtitan_helpers import (BS, SLEN, assert_flash_rule, compare_three,  # noqa: E402
                                pin_selection, record_selection, swapped_and_reference,
                                tiny_args, tiny_model, tiny_moe)

pytestmark = pytest.mark.usefixtures("library", "cpu_histc")


# ---- the model --------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["bf16", "fp32_autocast"])
@pytest.mark.parametrize("moe_overrides", [
    {},  # debugmodel_moe's routing
    # the other knobs of TorchTitan's MoE: sigmoid scores, no renormalization, a scale,
    # one shared expert.
    {"score_func": "sigmoid", "route_norm": False, "route_scale": 2.5, "num_shared_experts": 1},
], ids=["qwen3", "sigmoid_scaled_shared"])
def test_model_matches_torchtitan(moe_overrides, precision):
    """bf16: a bf16 model (as FSDP's bf16 parameters give it). fp32_autocast: fp32
    parameters under autocast to bf16, as TorchTitan trains on one GPU."""
    args = tiny_args(**moe_overrides)
    autocast = precision == "fp32_autocast"
    native = tiny_model(args, dtype=torch.float32 if autocast else torch.bfloat16)
    swapped, reference = swapped_and_reference(native)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab_size, (BS, SLEN), generator=g)
    dy = torch.randn(BS, SLEN, args.vocab_size, generator=g).bfloat16()
    errors = compare_three(native, swapped, reference, tokens, dy, autocast)
    expected = {"output"} | {n for n, _ in native.named_parameters()}
    assert set(errors) == expected
    assert any(".moe.experts.w1" in n for n in errors)
    assert_flash_rule(errors)
    # The load-balancing counts TorchTitan's hook reads are the same.
    for (name, a), (_, b) in zip(native.named_buffers(), swapped.named_buffers()):
        assert torch.equal(a, b), name


def test_moe_layer_within_bf16_tolerance():
    """One MoE layer with bf16 tokens: moefuse's output and the gradients of x, the router,
    the routed and shared experts against fp64, within moe_reference's tolerance (plus one
    rounding for the router's bf16 logits where the path crosses it)."""
    torch.manual_seed(3)
    args = MoEArgs(num_experts=16, num_shared_experts=1, score_func="softmax", route_norm=True,
                   top_k=4, score_before_experts=False, use_grouped_mm=False)
    native = MoE(args, dim=64, hidden_dim=32)
    with torch.no_grad():
        native.init_weights(0.02, torch.device("cpu"))
        native.expert_bias.copy_(0.01 * torch.randn(16))
    native = native.bfloat16()
    swapped, reference = swapped_and_reference(native)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(BS, SLEN, 64, generator=g).bfloat16()
    dy = torch.randn(BS, SLEN, 64, generator=g).bfloat16()

    grads = {}
    selection = record_selection(native)  # filled by the first forward, pinned in the third
    for what, m, xin, d in (("native", native, x, dy), ("moefuse", swapped, x, dy),
                            ("fp64", reference, x.double(), dy.double())):
        if what == "fp64":
            pin_selection(m, selection)
        xin = xin.clone().requires_grad_()
        out = m(xin)
        out.backward(d)
        grads[what] = {"y": out.detach(), "dx": xin.grad,
                       **{n: p.grad for n, p in m.named_parameters()}}
    ref = grads["fp64"]
    errors = {k: (rel_error(grads["moefuse"][k], ref[k]), rel_error(grads["native"][k], ref[k]))
              for k in ref}
    assert_flash_rule(errors)
    # n bf16 roundings per output as moe_reference.py counts them; dx adds the router's
    # bf16 logits (+1) and the shared experts' FeedForward (+2: its h and its dx), the
    # router's weight gradient the bf16 logits' gradient (+1) to dp's n = 3.
    assert_close_bf16(grads["moefuse"]["y"], ref["y"], "y")
    assert_close_bf16(grads["moefuse"]["experts.w1"], ref["experts.w1"], "dw13")
    assert_close_bf16(grads["moefuse"]["experts.w3"], ref["experts.w3"], "dw13")
    assert_close_bf16(grads["moefuse"]["experts.w2"], ref["experts.w2"], "dw2")
    assert errors["dx"][0] <= tolerance(4 + 1 + 2), errors["dx"]
    assert errors["router.gate.weight"][0] <= tolerance(3 + 1), errors["router.gate.weight"]
    for n in ("shared_experts.w1.weight", "shared_experts.w2.weight", "shared_experts.w3.weight"):
        assert errors[n][0] <= tolerance(3), (n, errors[n])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_routed_experts_halves_equal_concatenation(dtype):
    """routed_experts hands w1 and w3 to the library as W13's two halves: y and the
    gradients of x, the scores, w1, w3 and w2 are bit for bit those of the concatenated
    W13 = [w1; w3] through moefuse.experts (what the adapter did before), in the
    parameters' dtype."""
    g = torch.Generator().manual_seed(7)
    T, D, F, E, K = 96, 64, 32, 8, 2
    x = torch.randn(T, D, generator=g).bfloat16()
    scores = torch.rand(T, K, generator=g)
    ids = torch.rand(T, E, generator=g).topk(K, dim=-1).indices
    w1, w3 = (torch.randn(E, F, D, generator=g) * D ** -0.5 for _ in range(2))
    w2 = torch.randn(E, D, F, generator=g) * F ** -0.5
    dy = torch.randn(T, D, generator=g).bfloat16()
    grads = []
    for halves in (True, False):
        leaves = [t.detach().clone().to(dt).requires_grad_() for t, dt in
                  ((x, torch.bfloat16), (scores, torch.float32), (w1, dtype), (w3, dtype),
                   (w2, dtype))]
        xs, ss, a, b, c = leaves
        if halves:
            y = mtt.routed_experts(xs, ss, ids, a, b, c)
        else:
            w13 = torch.cat([a.bfloat16(), b.bfloat16()], dim=1)
            y = mtt.ops.experts(xs, ids, ss, w13, c.bfloat16())
        y.backward(dy)
        grads.append([y.detach()] + [t.grad for t in leaves])
    for what, h, c in zip(("y", "x", "scores", "w1", "w3", "w2"), *grads):
        assert h.dtype == c.dtype and torch.equal(h, c), what


def test_moe_compiles_fullgraph():
    """The swapped MoE traces into one graph (moefuse's op is a custom op with a fake)."""
    moe = tiny_moe(5, dim=64, hidden_dim=32, num_shared_experts=1).bfloat16()
    mtt.apply(moe)
    x = torch.randn(BS, SLEN, 64).bfloat16()
    eager = moe(x)
    compiled = torch.compile(moe, fullgraph=True, backend="aot_eager")
    xg = x.clone().requires_grad_()
    out = compiled(xg)
    out.sum().backward()
    assert torch.equal(out, eager)
    assert xg.grad is not None and moe.experts.w1.grad is not None


# ---- checkpoints ------------------------------------------------------------------------------


def test_state_dict_round_trip_both_ways():
    args = tiny_args(num_shared_experts=1)
    native = tiny_model(args)
    swapped = copy.deepcopy(native)
    mtt.apply(swapped)
    sd_native, sd_swapped = native.state_dict(), swapped.state_dict()
    assert list(sd_native) == list(sd_swapped)
    assert list(dict(native.named_buffers())) == list(dict(swapped.named_buffers()))

    # native -> swapped
    other = tiny_model(args, seed=7)
    mtt.apply(other)
    missing, unexpected = other.load_state_dict(sd_native, strict=True)
    assert not missing and not unexpected
    for k, v in other.state_dict().items():
        assert torch.equal(v, sd_native[k]), k
    # swapped -> native
    fresh = tiny_model(args, seed=8)
    fresh.load_state_dict(other.state_dict(), strict=True)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, sd_native[k]), k

    # TorchTitan's HF adapter sees the same tensors under the same names.
    adapter = Qwen3StateDictAdapter(args, None)
    hf_native, hf_swapped = adapter.to_hf(sd_native), adapter.to_hf(other.state_dict())
    assert list(hf_native) == list(hf_swapped)
    assert all(torch.equal(hf_native[k], hf_swapped[k]) for k in hf_native)
    back = adapter.from_hf(hf_swapped)
    fresh.load_state_dict(back, strict=False)
    for k in back:
        assert torch.equal(fresh.state_dict()[k], sd_native[k]), k


def test_restore_and_refusals():
    args = tiny_args()
    model = tiny_model(args)
    names = mtt.apply(model)
    assert all(type(model.get_submodule(n)) is mtt.MoefuseMoE for n in names)
    assert mtt.apply(model) == names  # idempotent
    assert mtt.restore(model) == names
    assert all(type(model.get_submodule(n)) is MoE for n in names)

    scaled_before = tiny_model(tiny_args(score_before_experts=True))
    with pytest.raises(ValueError, match="score_before_experts=True"):
        mtt.apply(scaled_before)
    assert not any(isinstance(m, mtt.MoefuseMoE) for m in scaled_before.modules())


def test_fp8_option_is_moefuse_experts_in_fp8():
    """apply(precision="fp8"): the routed experts are moefuse.experts(precision="fp8") on
    TorchTitan's routing and weights, bit for bit; restore() forgets the option; a bad
    precision is refused before anything changes."""
    moe = tiny_moe(9, dim=128, hidden_dim=64).bfloat16()
    selection = record_selection(moe)
    mtt.apply(moe, precision="fp8")
    assert moe.moefuse_precision == "fp8"
    x = torch.randn(BS, SLEN, 128).bfloat16()
    y = moe(x)
    scores = {}
    moe.router.register_forward_hook(lambda m, i, out: scores.__setitem__("p", out[0]))
    moe(x)
    e = moe.experts
    want = moefuse.experts(x.view(-1, 128), selection["router"].int(), scores["p"].float(),
                           torch.cat([e.w1, e.w3], dim=1), e.w2, precision="fp8")
    assert torch.equal(y.view(-1, 128), want)
    bf16 = moefuse.experts(x.view(-1, 128), selection["router"].int(), scores["p"].float(),
                           torch.cat([e.w1, e.w3], dim=1), e.w2)
    assert not torch.equal(want, bf16)
    mtt.restore(moe)
    assert "moefuse_precision" not in moe.__dict__

    with pytest.raises(ValueError, match="precision='fp16'"):
        mtt.apply(moe, precision="fp16")
    assert type(moe) is MoE


def test_fp8_quantizes_fp32_masters_once_per_optimizer_step(quantize_calls):
    """apply(precision="fp8") on fp32 parameters: w1, w3 and w2 reach the FP8 weight cache
    as themselves (quantized from their fp32 values, once until an optimizer step: two
    forwards, one quantization), and their gradients are fp32, those of
    moefuse.experts(precision="fp8") on the fp32 weights."""
    moe = tiny_moe(10, dim=128, hidden_dim=128)
    selection = record_selection(moe)
    mtt.apply(moe, precision="fp8")
    x = torch.randn(BS, SLEN, 128)
    dy = torch.randn(BS, SLEN, 128)
    scores = {}
    moe.router.register_forward_hook(lambda m, i, out: scores.__setitem__("p", out[0]))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        moe(x)
        y = moe(x)
    # one quantization for two forwards, without pow2 scales, from w1 and w3 as halves
    assert quantize_calls == [(False, True)], quantize_calls
    y.float().backward(dy)
    e = moe.experts
    assert e.w1.grad.dtype == e.w3.grad.dtype == e.w2.grad.dtype == torch.float32
    w13 = torch.cat([e.w1, e.w3], dim=1).detach().requires_grad_()
    w2 = e.w2.detach().clone().requires_grad_()
    want = moefuse.experts(x.view(-1, 128).bfloat16(), selection["router"].int(),
                           scores["p"].detach().float(), w13, w2, precision="fp8")
    assert torch.equal(y.view(-1, 128), want.to(y.dtype))
    want.backward(dy.view(-1, 128).bfloat16())
    half = e.w1.shape[1]
    assert torch.equal(e.w1.grad, w13.grad[:, :half]) and torch.equal(e.w3.grad, w13.grad[:, half:])
    assert torch.equal(e.w2.grad, w2.grad)
    before = len(quantize_calls)  # the adapter's one and the packed reference's
    torch.optim.SGD(moe.parameters(), lr=0.1).step()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        moe(x)
        moe(x)
    assert len(quantize_calls) == before + 1, "quantized again after the optimizer step"
