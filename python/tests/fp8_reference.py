"""The FP8 block recipe's oracle in the Python tests, as moe_reference.py is of bf16, and the
tolerance of an implementation against it. The recipe itself is bench/fp8_emulation.py
(the rules of docs/decisions/0018-fp8-block-recipe.md, defined in C in src/cpu/fp8.c), run
here in fp64 with every GEMM in FP8: each quantized operand is decoded into fp64 (code *
scale, exact) and the GEMMs run in fp64, so the emulation is exact up to fp64 rounding, far
below the library's fp32.

Tolerance (the decision's "per layer output"): the CPU backend and the emulation quantize
at the same points, so they differ by the fp32 accumulation of each GEMM, acc(k) =
2^-24 (2 + sqrt(k)), carried through each output's chain as (m1, rms) = (mean |d|,
rms d): a GEMM gives rms' = rms + acc, m1' = rms'; an elementwise step of sensitivity c
multiplies both; a rounding to a grid of relative step s (2^-7 bf16, 2^-3 E4M3) gives
m1' = m1, rms' = sqrt(rms^2 + s m1) (a value within |d| of a rounding boundary moves by
a step); an FP8 quantization adds the scale's shift (one typical difference) before its
rounding. The tolerance is twice the final rms, plus one bf16 rounding for y and dx (the
library rounds them, the emulation does not) and for the bf16 gradients of bf16 weights.
tests/harness.h derives the same chains. On the GPU the accumulation is the FP8 tensor
cores' (acc_wgmma_fp8_rms: the rms of about 14 bits kept inside each 128-deep block of
K, promoted to fp32 at the block's end), as tests/api/fixture.c's fp8_tolerances takes
it (th_acc_wgmma_fp8_rms).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.utils.checkpoint

from bench_helpers import import_bench
from moe_reference import rel_error, tolerance

_recipe = import_bench("fp8_emulation")
tiles_of = _recipe.tiles_of


def quantize_blocks(w: torch.Tensor, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """w [r, c] (fp32 values) in 128 x 128 blocks -> (codes e4m3 [r, c], scales fp32
    [nb(r), nb(c)])."""
    return _recipe.block_codes(w, pow2)


def fp8_experts_emulation(x, ids, p, w13, w2, dy, pow2: bool = False):
    """fp64 (y, dx, dp, dw13, dw2) of the recipe for x [T, H] bf16, ids [T, K] (-1
    dropped), p [T, K] fp32, w13 [E, 2I, H] and w2 [E, H, I] (bf16 or fp32, quantized
    from their values), dy [T, H] bf16."""
    recipe = _recipe.Recipe(_recipe.GEMMS, pow2, torch.float64)
    y, state = _recipe.experts_forward(x, ids, p, w13, w2, recipe)
    return (y, *_recipe.experts_backward(dy, x, p, w13, w2, state, recipe))


# ---- the tolerance ---------------------------------------------------------------------------


def _gemm(d, acc):
    return (d[1] + acc, d[1] + acc)


def _elementwise(d, c):
    return (c * d[0], c * d[1])


def _round(d, step):
    return (d[0], math.sqrt(d[1] ** 2 + step * d[0]))


def _sum(a, b):
    return (a[0] + b[0], a[1] + b[1])


def _quant_fp8(d):
    return _round(_sum(d, d), 2.0 ** -3)


def acc_fp32(k: int) -> float:
    """Relative error of an fp32 accumulation over k products (the CPU backend)."""
    return 2.0 ** -24 * (2.0 + math.sqrt(k))


def acc_wgmma_fp8_rms(k: int) -> float:
    """The rms relative difference of Hopper's FP8 wgmma with fp32 promotion every 128 of
    K (the CUDA backend): about 14 bits kept inside each block (th_acc_wgmma_fp8_rms of
    tests/harness.c; th_acc_wgmma_fp8 is its bound for one GEMM)."""
    return 2.0 ** -13 + ((k + 127) // 128) * 2.0 ** -24


def fp8_tolerances(hidden: int, inter: int, rows: int, bf16_wgrad: bool = False,
                   acc=acc_fp32) -> dict[str, float]:
    """Norm-wise relative tolerance of an implementation against the emulation per
    output; rows = the most rows of one expert (the weight-gradient GEMMs' K); bf16_wgrad:
    the weight gradients are rounded to bf16 (those of bf16 weights), one rounding more;
    acc: the GEMMs' accumulation (acc_fp32 for the CPU backend, acc_wgmma_fp8_rms for the
    GPU)."""
    bf16_step, none = 2.0 ** -7, (0.0, 0.0)
    gu = _round(_gemm(none, acc(hidden)), bf16_step)
    a = _round(_elementwise(gu, 2.0), bf16_step)
    o = _gemm(_quant_fp8(a), acc(inter))
    dap = _round(_gemm(none, acc(hidden)), bf16_step)
    dgu = _round(_elementwise(_sum(dap, gu), 2.0), bf16_step)
    dxr = _gemm(_quant_fp8(dgu), acc(2 * inter))
    dp = _gemm(_sum(dap, a), acc(inter))
    dw2 = _gemm(_quant_fp8(a), acc(rows))
    dw13 = _gemm(_quant_fp8(dgu), acc(rows))
    wgrad_rounding = tolerance(1) if bf16_wgrad else 1e-6
    return {"y": 2 * o[1] + tolerance(1), "dx": 2 * dxr[1] + tolerance(1),
            "dp": 2 * dp[1] + 1e-6, "dw13": 2 * dw13[1] + wgrad_rounding,
            "dw2": 2 * dw2[1] + wgrad_rounding}


# ---- helpers of the binding's FP8 tests (test_fp8_cpu.py, test_fp8_cuda.py) -----------------


def run_fp8(x, ids, p, w13, w2, dy, pow2=False, recompute=False, save_inputs=None,
            device="cpu"):
    """(y, dx, dp, dw13, dw2) from moefuse.experts(precision="fp8") with autograd on
    `device` (fresh copies of the inputs there), returned on the CPU."""
    import moefuse

    x, p, w13, w2 = (t.detach().to(device).clone().requires_grad_() for t in (x, p, w13, w2))
    y = moefuse.experts(x, ids.to(device), p, w13, w2, recompute=recompute,
                        save_inputs=save_inputs, precision="fp8", fp8_pow2_scales=pow2)
    y.backward(dy.to(device))
    return tuple(t.cpu() for t in (y.detach(), x.grad, p.grad, w13.grad, w2.grad))


OUTPUTS = ("y", "dx", "dp", "dw13", "dw2")


def check_against_emulation(got, problem, pow2=False, bf16_wgrad=True, acc=acc_fp32) -> None:
    """got = (y, dx, dp, dw13, dw2) of problem = (x, ids, p, w13, w2, dy): finite and
    within fp8_tolerances of the emulation, each output."""
    x, ids, p, w13, w2, dy = problem
    ref = fp8_experts_emulation(x, ids, p, w13, w2, dy, pow2=pow2)
    tol = fp8_tolerances(x.shape[1], w2.shape[2], most_rows(ids, w13.shape[0]),
                         bf16_wgrad=bf16_wgrad, acc=acc)
    for name, g, r in zip(OUTPUTS, got, ref):
        assert torch.isfinite(g).all(), name
        err = rel_error(g, r)
        assert err <= tol[name], f"{name}: relative error {err:.3e} > tolerance {tol[name]:.3e}"


def _grads(module, x):
    return [x.grad] + [p.grad for p in module.parameters()]


def assert_compiled_equals_eager(model, x, dy) -> None:
    """torch.compile(model, fullgraph=True, backend="aot_eager") (a graph break raises)
    gives eager's output and gradients (of x and every parameter) bit for bit."""
    torch._dynamo.reset()
    results = []
    for fn in (model, torch.compile(model, fullgraph=True, backend="aot_eager")):
        model.zero_grad()
        xl = x.clone().requires_grad_()
        y = fn(xl)
        y.backward(dy)
        results.append([y.detach()] + _grads(model, xl))
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)


def assert_checkpoint_equals_plain(module, x, ids, p, dy) -> None:
    """module(x, ids, p) under activation checkpointing (non-reentrant) gives the bits of
    the plain call: output and gradients of x and every parameter."""
    results = []
    for checkpointed in (False, True):
        module.zero_grad()
        xl = x.clone().requires_grad_()
        y = (torch.utils.checkpoint.checkpoint(module, xl, ids, p, use_reentrant=False)
             if checkpointed else module(xl, ids, p))
        y.backward(dy)
        results.append([y.detach()] + _grads(module, xl))
    for plain, recomputed in zip(*results):
        assert torch.equal(plain, recomputed)


class WeightQuantization(NamedTuple):
    """One weight quantization through the library, as spy_weight_quantizations sees it."""
    pow2: bool     # the layer's fp8_pow2_scales
    halves: bool   # W13 came as halves (w13_up set)


def spy_weight_quantizations(monkeypatch) -> list[WeightQuantization]:
    """The FP8 weight cache emptied, and a list that then gets a WeightQuantization for
    each weight quantization through the library (Layer.quantize_weights)."""
    from moefuse import _lib, ops

    seen = []
    quantize = _lib.Layer.quantize_weights

    def spy(self, *args, **kwargs):
        seen.append(WeightQuantization(bool(self.cfg.fp8_pow2_scales),
                                       bool(kwargs.get("w13_up"))))
        return quantize(self, *args, **kwargs)

    monkeypatch.setattr(_lib.Layer, "quantize_weights", spy)
    ops.layer_cache.fp8.clear()
    return seen


def assert_w13_halves_equal_packed(dtype: torch.dtype, device, monkeypatch) -> None:
    """precision="fp8" with W13 as (gate, up), bf16 or fp32 master weights, on `device`:
    the halves quantized where they are (moefuse_quantize_weights_halves), dW13 written
    in halves by the library; the packed call's bits."""
    import moefuse
    from moe_reference import random_problem

    quantized = spy_weight_quantizations(monkeypatch)
    x, ids, p, w13, w2, dy = (t.to(device) for t in
                              random_problem(100, 128, 128, 8, 2, seed=5))
    if dtype == torch.float32:  # values between bf16s
        w13, w2 = w13.float() * (1 + 2.0 ** -12), w2.float() * (1 - 2.0 ** -13)
    inter = w13.shape[1] // 2
    outs = []
    for halves in (False, True):
        xs, ps, w2s = (t.detach().clone().requires_grad_() for t in (x, p, w2))
        if halves:
            ws = [w13[:, :inter].clone().requires_grad_(),
                  w13[:, inter:].clone().requires_grad_()]
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
    halves_read = [q.halves for q in quantized]
    assert halves_read == [False, True], halves_read  # packed, then the halves


def assert_layers_interleaved_equal_alone(shape, device, recompute=False) -> None:
    """Two layers of one shape, whose calls share one library layer and its workspaces
    (ops.layer_cache), run in FP8 as a model runs them: forward 1, forward 2, backward 2,
    backward 1. Each gets the bits of its forward + backward run alone (nothing one call
    leaves in the shared workspaces reaches the other's)."""
    import moefuse
    from moe_reference import random_problem

    problems = [random_problem(*shape, seed=seed, drop_fraction=0.05, skew="zipf")
                for seed in (51, 52)]
    alone = [run_fp8(*pb, recompute=recompute, device=device) for pb in problems]
    leaves, ys = [], []
    for x, ids, p, w13, w2, _ in problems:
        leaf = tuple(t.detach().to(device).clone().requires_grad_() for t in (x, p, w13, w2))
        ys.append(moefuse.experts(leaf[0], ids.to(device), leaf[1], leaf[2], leaf[3],
                                  recompute=recompute, precision="fp8"))
        leaves.append(leaf)
    for problem, y in reversed(list(zip(problems, ys))):
        y.backward(problem[5].to(device))
    for i, (leaf, y, want) in enumerate(zip(leaves, ys, alone)):
        got = (y.detach().cpu(), *(t.grad.cpu() for t in leaf))
        for name, a, b in zip(OUTPUTS, got, want):
            assert torch.equal(a, b), f"layer {i + 1}: {name} differs from the layer run alone"


def most_rows(ids: torch.Tensor, num_experts: int) -> int:
    """The most rows of one expert (at least 1): the weight-gradient GEMMs' K."""
    return max(1, max(int((ids == e).sum()) for e in range(num_experts)))


def _array(buffer: torch.Tensor, address: int, shape, dtype) -> torch.Tensor:
    offset = address - buffer.data_ptr()
    numel = torch.Size(shape).numel()
    item = torch.empty((), dtype=dtype).element_size()
    return buffer[offset:offset + numel * item].view(dtype).view(shape).cpu()


def assert_quantized_weights(weights, w13: torch.Tensor, w2: torch.Tensor, pow2: bool) -> None:
    """The eight arrays of a moefuse_fp8_weights (the binding's struct, holding its
    buffer) code for code and scale for scale those of quantize_blocks, W^T's the
    transposes of W's."""
    E, I2, H = w13.shape
    I = I2 // 2
    assert (weights.hidden, weights.intermediate, weights.num_local_experts,
            weights.pow2_scales) == (H, I, E, int(pow2))
    buffer = weights.buffer
    assert buffer.data_ptr() % 256 == 0
    for w, name, rows, cols in ((w13, "w13", I2, H), (w2, "w2", H, I)):
        w = w.cpu()
        codes = _array(buffer, getattr(weights, name), (E, rows, cols), torch.uint8)
        scale = _array(buffer, getattr(weights, name + "_scale"),
                       (E, tiles_of(rows), tiles_of(cols)), torch.float32)
        codes_t = _array(buffer, getattr(weights, name + "t"), (E, cols, rows), torch.uint8)
        scale_t = _array(buffer, getattr(weights, name + "t_scale"),
                         (E, tiles_of(cols), tiles_of(rows)), torch.float32)
        for e in range(E):
            want_codes, want_scale = quantize_blocks(w[e], pow2)
            assert torch.equal(codes[e], want_codes.view(torch.uint8)), f"{name}[{e}] codes"
            assert torch.equal(scale[e], want_scale), f"{name}[{e}] scales"
            assert torch.equal(codes_t[e], codes[e].T) and torch.equal(scale_t[e], scale[e].T)
        if pow2:
            assert torch.equal(torch.frexp(scale).mantissa, torch.full_like(scale, 0.5))


def special_weights(E: int, H: int, I: int, seed: int = 0):
    """(w13 [E, 2I, H], w2 [E, H, I]) fp32 with an all-zero block (w13[1]'s first), blocks
    holding one huge or one tiny value, and an fp32 subnormal beside normal values
    (E >= 3, H > 150)."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g) * 0.05
    w2 = torch.randn(E, H, I, generator=g) * 0.05
    w13[1, :128, :128] = 0  # an all-zero block
    w13[2, 5, 7], w2[0, 3, 4] = 1e30, -1e-30  # the block's scale: huge, tiny
    w2[1, 150, 10] = 3e-41  # an fp32 subnormal beside normal values
    return w13, w2
