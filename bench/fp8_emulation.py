"""The FP8 block recipe (docs/decisions/0018-fp8-block-recipe.md) emulated in PyTorch, one
GEMM at a time: the parity run's ablation (which GEMM's quantization costs the loss).

Each of the six expert GEMMs either runs FP8 (its two operands encoded to E4M3 with the
recipe's tiles and scale rule, decoded to fp32) or reads bf16 operands as the bf16 pipeline
does; both then multiply in fp32 (TF32 off): the products of two E4M3 or two bf16 values are
exact in fp32, so what differs from the library is the order of the fp32 sums, not the
recipe. The rounding points are the recipe's (and the fp64 reference's): g, u, a, da' and
[dg; du] rounded to bf16; p dy one fp32 product; d p = <da', a> on the bf16 a; y and dx
summed in fp32 and rounded once.

    gemm1   [g; u] = x W13^T        x rows 1 x 128 along H,      W13 128 x 128 blocks
    gemm2   o = a W2^T              a rows 1 x 128 along I,      W2 blocks
    dgrad2  da' = dy W2             dy rows along H,             W2^T (W2's blocks)
    dgrad1  dx = [dg; du] W13       [dg; du] rows along 2I,      W13^T (W13's blocks)
    dw2     dW2 = (p dy)^T a        both 128 tokens per column, counted from the expert's
    dw13    dW13 = [dg; du]^T x     first row

Fp8EmulatedExperts replaces a MoEExperts (the same parameters, so the same state dict);
`fp8_gemms` names the GEMMs that run FP8: all six is the recipe, none is the bf16 layer.
The weights are quantized in every call, from their fp32 (or bf16) values, as the library
quantizes them once per optimizer step: the same codes. Per-expert fp32 matmuls: slower
than the library by an order of magnitude; for experiments, not for training.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

GEMMS = ("gemm1", "gemm2", "dgrad2", "dgrad1", "dw2", "dw13")
E4M3_MAX = 448.0
TILE = 128
_BF16 = torch.bfloat16


def parse_gemms(spec: str) -> frozenset:
    """'all', 'none', 'all-<gemm>' (every GEMM but one in FP8) or a comma list of GEMMs."""
    if spec == "all":
        return frozenset(GEMMS)
    if spec == "none":
        return frozenset()
    if spec.startswith("all-") and spec[4:] in GEMMS:
        return frozenset(GEMMS) - {spec[4:]}
    names = spec.split(",")
    unknown = [n for n in names if n not in GEMMS]
    if unknown or not spec:
        raise ValueError(f"FP8 GEMMs {spec!r}: expected all, none, all-<gemm> or a comma list "
                         f"of {', '.join(GEMMS)}")
    return frozenset(names)


def _scale(amax: torch.Tensor) -> torch.Tensor:
    """The recipe's scale of a tile from its fp32 amax: amax / 448, at least 2^-126; 1 for
    an all-zero tile."""
    s = torch.clamp(amax / E4M3_MAX, min=2.0 ** -126)
    return torch.where(amax == 0, torch.ones_like(s), s)


def _fake_quant(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """encode(v / scale) decoded and scaled back, in fp32 (E4M3, nearest even, saturating)."""
    q = (v / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.to(torch.float32) * scale


def quant_rows(a: torch.Tensor) -> torch.Tensor:
    """a [n, k] fp32, 1 x 128 tiles along k (a short last tile where k is no multiple)."""
    n, k = a.shape
    nb = -(-k // TILE)
    padded = torch.nn.functional.pad(a, (0, nb * TILE - k)).view(n, nb, TILE)
    scale = _scale(padded.abs().amax(dim=2, keepdim=True))
    return _fake_quant(padded, scale).view(n, nb * TILE)[:, :k]


def quant_tokens(a: torch.Tensor, tile_of_row: torch.Tensor, tiles: int) -> torch.Tensor:
    """a [rows, c] fp32 in expert order, 128 rows per column per tile (tile_of_row: each
    row's tile, tiles counted from each expert's first row)."""
    index = tile_of_row[:, None].expand_as(a)
    amax = torch.zeros(tiles, a.shape[1], dtype=a.dtype, device=a.device)
    amax.scatter_reduce_(0, index, a.abs(), "amax")
    return _fake_quant(a, _scale(amax)[tile_of_row])


def quant_blocks(w: torch.Tensor) -> torch.Tensor:
    """w [E, r, c] fp32 in 128 x 128 blocks."""
    e, r, c = w.shape
    rb, cb = -(-r // TILE), -(-c // TILE)
    padded = torch.nn.functional.pad(w, (0, cb * TILE - c, 0, rb * TILE - r))
    blocks = padded.view(e, rb, TILE, cb, TILE)
    scale = _scale(blocks.abs().amax(dim=(2, 4), keepdim=True))
    return _fake_quant(blocks, scale).view(e, rb * TILE, cb * TILE)[:, :r, :c]


def _bf16(v: torch.Tensor) -> torch.Tensor:
    return v.to(_BF16).to(torch.float32)


@contextlib.contextmanager
def _exact_fp32(device: torch.device):
    """No autocast and no TF32 inside: the emulation's matmuls are fp32."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.autocast(device.type, enabled=False):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _per_expert(a: torch.Tensor, counts: list, fn) -> torch.Tensor:
    """fn(e, a_e) over the expert segments of a, concatenated."""
    outs = [fn(e, part) for e, part in enumerate(torch.split(a, counts)) if part.shape[0]]
    return torch.cat(outs) if outs else a.new_zeros((0,) + a.shape[1:])


class _Plan:
    """The slots in expert order: token of each, its (t, k) index, per-expert counts and
    each row's weight-gradient tile."""

    def __init__(self, ids: torch.Tensor, num_experts: int):
        flat = ids.reshape(-1).long()
        keyed = torch.where(flat >= 0, flat, torch.full_like(flat, num_experts))
        order = torch.argsort(keyed, stable=True)
        self.slot = order[: int((flat >= 0).sum())]
        self.token = self.slot // ids.shape[1]
        expert = flat[self.slot]
        counts = torch.bincount(expert, minlength=num_experts)
        self.counts = counts.tolist()
        first = torch.cumsum(counts, 0) - counts
        row_in_expert = torch.arange(len(self.slot), device=ids.device) - first[expert]
        tiles = (counts + TILE - 1) // TILE
        first_tile = torch.cumsum(tiles, 0) - tiles
        self.tile_of_row = first_tile[expert] + row_in_expert // TILE
        self.tiles = int(tiles.sum())


def _weight(w: torch.Tensor, fp8: bool) -> torch.Tensor:
    """A GEMM's weight operand in fp32: its FP8 blocks decoded, or rounded to bf16."""
    return quant_blocks(w.float()) if fp8 else _bf16(w)


class _EmulatedExperts(torch.autograd.Function):
    """Saves g, u, a in bf16 (their values are bf16) and quantizes the weights again in the
    backward (the same codes): the memory of the library's saved state, about."""

    @staticmethod
    def forward(ctx, x, ids, p, w13, w2, fp8_gemms):
        with _exact_fp32(x.device):
            plan = _Plan(ids, w13.shape[0])
            ps = p.reshape(-1)[plan.slot].to(torch.float32)
            xs = _bf16(x[plan.token])
            fp8 = "gemm1" in fp8_gemms
            w = _weight(w13, fp8)
            gu = _bf16(_per_expert(quant_rows(xs) if fp8 else xs, plan.counts,
                                   lambda e, a: a @ w[e].T))
            inter = w2.shape[2]
            g, u = gu[:, :inter], gu[:, inter:]
            a = _bf16(torch.nn.functional.silu(g) * u)
            fp8 = "gemm2" in fp8_gemms
            w = _weight(w2, fp8)
            o = _per_expert(quant_rows(a) if fp8 else a, plan.counts, lambda e, v: v @ w[e].T)
            y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            y.index_add_(0, plan.token, ps[:, None] * o)
        ctx.save_for_backward(x, p, w13, w2, gu.to(_BF16), a.to(_BF16), ps)
        ctx.plan, ctx.fp8_gemms = plan, fp8_gemms
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, p, w13, w2, gu, a, ps = ctx.saved_tensors
        plan, fp8_gemms = ctx.plan, ctx.fp8_gemms
        with _exact_fp32(x.device):
            gu, a = gu.float(), a.float()
            g, u = gu[:, :w2.shape[2]], gu[:, w2.shape[2]:]
            dys = _bf16(dy[plan.token])
            fp8 = "dgrad2" in fp8_gemms
            w = _weight(w2, fp8)
            da_ = _bf16(_per_expert(quant_rows(dys) if fp8 else dys, plan.counts,
                                    lambda e, v: v @ w[e]))
            dp = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
            dp[plan.slot] = (da_ * a).sum(dim=1)
            da = ps[:, None] * da_
            sig = torch.sigmoid(g)
            dgu = _bf16(torch.cat([da * u * sig * (1 + g * (1 - sig)), da * g * sig], dim=1))
            fp8 = "dgrad1" in fp8_gemms
            w = _weight(w13, fp8)
            dxs = _per_expert(quant_rows(dgu) if fp8 else dgu, plan.counts,
                              lambda e, v: v @ w[e])
            dx = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            dx.index_add_(0, plan.token, dxs)

            def wgrad(name, lhs, rhs, shape):
                if name in fp8_gemms:
                    lhs = quant_tokens(lhs, plan.tile_of_row, plan.tiles)
                    rhs = quant_tokens(rhs, plan.tile_of_row, plan.tiles)
                out = torch.zeros(shape, dtype=torch.float32, device=x.device)
                starts = [0]
                for c in plan.counts:
                    starts.append(starts[-1] + c)
                for e, c in enumerate(plan.counts):
                    if c:
                        out[e] = lhs[starts[e]:starts[e + 1]].T @ rhs[starts[e]:starts[e + 1]]
                return out

            dw2 = wgrad("dw2", ps[:, None] * dys, a, w2.shape)
            dw13 = wgrad("dw13", dgu, _bf16(x[plan.token]), w13.shape)
        return (dx.to(x.dtype), None, dp.view_as(p).to(p.dtype), dw13.to(w13.dtype),
                dw2.to(w2.dtype), None)


class Fp8EmulatedExperts(nn.Module):
    """A MoEExperts' forward through the emulation, on the same parameters (gate_up_proj,
    down_proj); fp8_gemms: the GEMMs that run FP8 (parse_gemms)."""

    def __init__(self, experts: nn.Module, fp8_gemms: frozenset):
        super().__init__()
        self.gate_up_proj, self.down_proj = experts.gate_up_proj, experts.down_proj
        self.fp8_gemms = frozenset(fp8_gemms)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        y = _EmulatedExperts.apply(x.to(_BF16), ids, p.to(torch.float32), self.gate_up_proj,
                                   self.down_proj, self.fp8_gemms)
        return y.to(in_dtype)

    def extra_repr(self) -> str:
        return f"fp8_gemms={sorted(self.fp8_gemms, key=GEMMS.index)}"
