"""The FP8 peer of moefuse's FP8 experts: what a TorchTitan user trains with on Hopper today,
torchao's FP8 rowwise recipe for MoE training (torchao.prototype.moe_training,
MoEScalingType.FP8_ROWWISE: each torch._grouped_mm of the experts becomes a grouped GEMM on
dynamically quantized e4m3 operands), on the TorchTitan-style MoE of torch_moe_baseline.py
(the same routing plan, padding of each expert's rows to 16, dispatch, SwiGLU and combine).

Each grouped GEMM out = a w^T (a [M, K] bf16, rows sorted by expert; w [G, N, K], [out, in]
as nn.Linear) is an autograd.Function whose three GEMMs all run in FP8 on
torch._scaled_grouped_mm (none falls back to bf16):

    forward  out = a w^T      a rowwise along K (a scale per row), w along K (a scale per
                              expert and output column): 2d x 3d
    dgrad    da = dout w      dout rowwise along N, w^T along N (a scale per expert and
                              column of K): 2d x 3d
    wgrad    dw_g = dout_g^T a_g   the reduction runs over the tokens, so both operands are
                              quantized along them: a scale per expert and column: 2d x 2d,
                              the groups on the contraction

Quantization as torchao's: multiplier 448 / amax (amax clamped to 1e-12) rounded down to a
power of two, e4m3(clamp(x * multiplier, +-448)); the GEMM takes the reciprocals (amax / 448
rounded up to a power of two), with use_fast_accum=True as torchao passes it (no fp32
promotion inside the K loop). The weights are quantized in every call, forward and backward
(torchao's dynamic recipe; nothing is kept between micro-batches); bf16 a and w are saved
for the backward, as by torchao. Two differences: each quantization here is eager torch ops
(an amax pass, then a multiply and a cast) where torchao's backward has fused Triton
kernels (and a compiled TorchTitan model fuses its forward's), so the peer's quantization
is somewhat slower than torchao's; gate and up are one GEMM on W13 (TorchTitan's experts
run two, each quantizing x), which saves the peer a quantization of x.

torch._scaled_grouped_mm needs CUDA and sm_90+; `gemm=` takes any function of its
arguments (emulated_scaled_grouped_mm computes them in fp32 on any device, for tests).

Importable: experts_fp8(x, ids, p, w13, w2, gemm=None), quantize_rows,
quantize_columns_per_group, emulated_scaled_grouped_mm, scaled_grouped_mm_reason(device).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

import torch_moe_baseline as baseline

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
AMAX_EPS = 1e-12  # torchao's clamp of amax (an all-zero row: scale 2^48, codes 0)
FAST_ACCUM = True  # torchao's _Float8GroupedMM passes use_fast_accum=True to every GEMM


def scaled_grouped_mm_reason(device: torch.device) -> Optional[str]:
    """None when torch._scaled_grouped_mm can run on `device`, else why not."""
    return baseline.grouped_mm_reason(device, "_scaled_grouped_mm")


# ---- quantization ---------------------------------------------------------------------------


def _multiplier(amax: torch.Tensor) -> torch.Tensor:
    """torchao's scale: fp32(448 / max(amax, eps)) (in fp64), rounded down to a power of 2."""
    s = (E4M3_MAX / amax.double().clamp(min=AMAX_EPS)).float()
    return torch.exp2(torch.floor(torch.log2(s)))


def _cast(x: torch.Tensor, multiplier: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """e4m3(clamp(x * multiplier, +-448)) into out (any layout: the copy transposes).
    NOTE: the multipliers are powers of two, so x * multiplier is exact in x's own dtype,
    and at most 448 (1 + 2^-24) in magnitude, which the cast rounds to 448 (it gives NaN
    only from 464 on): torchao's fp32 product and clamp give the same codes in fewer
    passes."""
    return out.copy_(x * multiplier.to(x.dtype))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] along its last dim -> (e4m3 [..., n] contiguous, fp32 [...] the
    GEMM's scale: 1 / multiplier)."""
    amax = torch.linalg.vector_norm(x, ord=float("inf"), dim=-1, dtype=torch.float32)
    s = _multiplier(amax)
    q = torch.empty(x.shape, dtype=E4M3, device=x.device)
    return _cast(x, s.unsqueeze(-1), q), s.reciprocal()


def quantize_columns_per_group(x: torch.Tensor, offs: torch.Tensor,
                               rows_align: int = baseline.GROUP_ALIGN_M
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, n] whose rows form groups (group g: rows offs[g-1] .. offs[g]-1, multiples of
    rows_align; rows from offs[-1] on belong to none) along the rows, a scale per group and
    column -> (e4m3 [M, n] column-major, fp32 [G * n]: group 0's n scales, then group 1's).
    Rows outside every group keep their values (multiplier 1); the GEMM does not read them."""
    M, n = x.shape
    G = offs.numel()
    chunks = x.view(M // rows_align, rows_align, n)
    chunk_amax = torch.linalg.vector_norm(chunks, ord=float("inf"), dim=1, dtype=torch.float32)
    starts = torch.arange(0, M, rows_align, device=x.device, dtype=offs.dtype)
    group = torch.searchsorted(offs, starts, right=True)  # G: after the last group
    amax = chunk_amax.new_zeros(G + 1, n).scatter_reduce_(
        0, group.unsqueeze(1).expand(-1, n), chunk_amax, "amax")
    s = _multiplier(amax)
    s[G] = 1.0
    q_t = torch.empty(n, M, dtype=E4M3, device=x.device)
    _cast(chunks, s[group].unsqueeze(1), q_t.t().view(M // rows_align, rows_align, n))
    return q_t.t(), s[:G].reciprocal().reshape(-1)


# ---- the GEMMs ------------------------------------------------------------------------------


def scaled_grouped_mm(a, b, scale_a, scale_b, offs):
    """torch._scaled_grouped_mm as torchao calls it: bf16 out, fast accumulation."""
    return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs,
                                    out_dtype=torch.bfloat16, use_fast_accum=FAST_ACCUM)


def emulated_scaled_grouped_mm(a, b, scale_a, scale_b, offs):
    """scaled_grouped_mm's math in fp32 on any device, a loop over the groups: 2d x 3d
    (a [M, K], b [G, K, N], scales [M] and [G, N]: out [M, N], rows outside the groups 0) or
    2d x 2d (a [M, Kt], b [Kt, N] grouped along Kt, scales [G * M] and [G * N]: [G, M, N])."""
    a32, b32 = a.float(), b.float()
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    if b.dim() == 3:
        out = a32.new_zeros(a.shape[0], b.shape[2])
        for g, (s, e) in enumerate(zip(starts, ends)):
            out[s:e] = (a32[s:e] * scale_a[s:e, None]) @ (b32[g] * scale_b[g])
    else:
        M, N = a.shape[0], b.shape[1]
        out = a32.new_zeros(len(ends), M, N)
        for g, (s, e) in enumerate(zip(starts, ends)):
            out[g] = ((a32[:, s:e] * scale_a[g * M:(g + 1) * M, None])
                      @ (b32[s:e] * scale_b[g * N:(g + 1) * N]))
    return out.to(torch.bfloat16)


class Fp8GroupedMM(torch.autograd.Function):
    """out [M, N] = a [M, K] w[g]^T per group of a's rows (offs: int32 cumulative group
    ends), every GEMM on rowwise-quantized e4m3 operands (module docstring)."""

    @staticmethod
    def forward(ctx, a, w, offs, gemm):
        qa, sa = quantize_rows(a)
        qw, sw = quantize_rows(w)  # [G, N, K]: along K
        ctx.save_for_backward(a, w, offs)
        ctx.gemm = gemm
        return gemm(qa, qw.transpose(-2, -1), sa, sw, offs)

    @staticmethod
    def backward(ctx, dout):
        a, w, offs = ctx.saved_tensors
        dout = dout.contiguous()
        da = dw = None
        if ctx.needs_input_grad[0]:
            qd, sd = quantize_rows(dout)
            qwt, swt = quantize_rows(w.transpose(-2, -1))  # [G, K, N]: along N
            da = ctx.gemm(qd, qwt.transpose(-2, -1), sd, swt, offs)
        if ctx.needs_input_grad[1]:
            qdc, sdc = quantize_columns_per_group(dout, offs)  # [M, N] column-major
            qac, sac = quantize_columns_per_group(a, offs)     # [M, K] column-major
            dw = ctx.gemm(qdc.t(), qac, sdc, sac, offs)        # [G, N, K]
        return da, dw, None, None


def swiglu_fp8(xs, offsets, w13, w2, gemm=scaled_grouped_mm):
    """swiglu_grouped_mm of torch_moe_baseline.py with both grouped GEMMs in FP8."""
    inter = w13.shape[1] // 2
    gate_up = Fp8GroupedMM.apply(xs, w13, offsets, gemm)  # [rows, 2I]
    act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    return Fp8GroupedMM.apply(act, w2, offsets, gemm)     # [rows, H]


def experts_fp8(x, ids, p, w13, w2, gemm=None) -> torch.Tensor:
    """y [T, H] bf16 of the TorchTitan-style MoE with torchao's FP8 rowwise grouped GEMMs.
    x [T, H] bf16, ids [T, K] int32 (-1 dropped), p [T, K] fp32, w13 [E, 2I, H] bf16,
    w2 [E, H, I] bf16. Differentiable. gemm: scaled_grouped_mm (default) or a stand-in."""
    ffn = functools.partial(swiglu_fp8, gemm=gemm or scaled_grouped_mm)
    return baseline.experts_grouped_mm(x, ids, p, w13, w2, ffn=ffn)
