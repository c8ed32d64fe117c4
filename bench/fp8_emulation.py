"""The FP8 block recipe (docs/decisions/0018-fp8-block-recipe.md) in PyTorch, one GEMM at a
time: the oracle of the Python FP8 tests (python/tests/fp8_reference.py runs it in fp64 with
every GEMM in FP8) and the parity run's ablation (bench/train_parity.py --precisions
emul:<GEMMs> runs it in fp32 with some GEMMs in FP8, to find which one costs the loss).

    E4M3    round to nearest even, saturating at +-448 (torch.float8_e4m3fn after a clamp)
    scale   of a tile = fp32(amax / 448), at least 2^-126, 1 for an all-zero tile, NaN
            where the tile holds a NaN or an infinity; pow2: rounded up to a power of two
    code    = e4m3(x / scale), the division in fp32

    gemm1   [g; u] = x W13^T        x rows 1 x 128 along H,      W13 128 x 128 blocks
    gemm2   o = a W2^T              a rows 1 x 128 along I,      W2 blocks
    dgrad2  da' = dy W2             dy rows along H,             W2^T (W2's blocks)
    dgrad1  dx = [dg; du] W13       [dg; du] rows along 2I,      W13^T (W13's blocks)
    dw2     dW2 = (p dy)^T a        both 128 tokens per column, counted from the expert's
    dw13    dW13 = [dg; du]^T x     first row (each expert's rows in token order)

A GEMM in FP8 reads its operands decoded (code * scale) in the working dtype; one outside
`fp8_gemms` reads them rounded to bf16, as the bf16 pipeline does. In fp64 the decoded
products and their sums are exact up to fp64 rounding (the oracle); in fp32 (TF32 off) the
products of two E4M3 or two bf16 values are exact and what differs from the library is the
order of the sums. The rounding points are the recipe's: g, u, a, da' and [dg; du] rounded
to bf16 (through fp32, as a GPU epilogue rounds); p dy one fp32 product; d p = <da', a> on
the bf16 a; y and dx summed in the working dtype. Weights are quantized from their values
(bf16 or fp32 masters) in every call: the codes the library makes once per optimizer step.
Per-expert matmuls, slower than the library's layer: for tests and experiments, not for
training.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

GEMMS = ("gemm1", "gemm2", "dgrad2", "dgrad1", "dw2", "dw13")
E4M3_MAX = 448.0
TILE = 128
_BF16 = torch.bfloat16
_TINY = torch.finfo(torch.float32).tiny  # 2^-126


def parse_gemms(spec: str) -> frozenset:
    """'all', 'none', a comma list of GEMMs, or 'all-' and a comma list (every GEMM but
    those in FP8: all-gemm1,gemm2 leaves the forward in bf16)."""
    if spec == "all":
        return frozenset(GEMMS)
    if spec == "none":
        return frozenset()
    but = spec.startswith("all-")
    names = spec[4:].split(",") if but else spec.split(",")
    unknown = [n for n in names if n not in GEMMS]
    if unknown or not spec:
        raise ValueError(f"FP8 GEMMs {spec!r}: expected all, none, a comma list of "
                         f"{', '.join(GEMMS)}, or all- and such a list")
    return frozenset(GEMMS) - set(names) if but else frozenset(names)


# ---- the quantizers ---------------------------------------------------------------------


def scales(amax: torch.Tensor, pow2: bool = False) -> torch.Tensor:
    """fp32 scales of tiles with the given fp32 amax."""
    # a tensor divisor: PyTorch's CUDA kernels divide by a Python scalar as a product with
    # its reciprocal, 1 ulp off the library's fp32 division at times (and then an e4m3
    # code, where a value's quotient lies near a rounding point of two codes)
    s = torch.clamp_min(amax / torch.full_like(amax, E4M3_MAX), _TINY)
    if pow2:
        mant, exp = torch.frexp(s)  # s = mant 2^exp, 0.5 <= mant < 1
        s = torch.ldexp(torch.ones_like(s), torch.where(mant == 0.5, exp - 1, exp))
    s = torch.where(amax == 0, torch.ones_like(s), s)
    return torch.where(torch.isfinite(amax), s, torch.full_like(s, math.nan))


def e4m3(v: torch.Tensor) -> torch.Tensor:
    """fp32 values to E4M3 (round to nearest even, saturating)."""
    return v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def tiles_of(n: int) -> int:
    """ceil(n / 128): the tiles along a dimension of n."""
    return (n + TILE - 1) // TILE


def block_codes(w: torch.Tensor, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., r, c] (fp32 values) in 128 x 128 blocks -> (codes e4m3 [..., r, c], scales
    fp32 [..., nb(r), nb(c)])."""
    *lead, r, c = w.shape
    br, bc = tiles_of(r), tiles_of(c)
    blocks = F.pad(w.float(), (0, bc * TILE - c, 0, br * TILE - r))
    blocks = blocks.view(*lead, br, TILE, bc, TILE)
    s = scales(blocks.abs().amax(dim=(-3, -1)), pow2)
    codes = e4m3(blocks / s[..., :, None, :, None])
    return codes.view(*lead, br * TILE, bc * TILE)[..., :r, :c], s


def quant_blocks(w: torch.Tensor, pow2: bool = False, dtype=torch.float32) -> torch.Tensor:
    """w [..., r, c] after quantization in 128 x 128 blocks, decoded in dtype."""
    codes, s = block_codes(w, pow2)
    full = s.to(dtype).repeat_interleave(TILE, -2).repeat_interleave(TILE, -1)
    return codes.to(dtype) * full[..., :w.shape[-2], :w.shape[-1]]


def quant_rows(v: torch.Tensor, pow2: bool = False, dtype=torch.float32) -> torch.Tensor:
    """v [n, k] (fp32 values) after quantization in 1 x 128 tiles along k (a short last
    tile where k is no multiple of 128), decoded in dtype."""
    n, k = v.shape
    nb = tiles_of(k)
    tiles = F.pad(v.float(), (0, nb * TILE - k)).view(n, nb, TILE)
    s = scales(tiles.abs().amax(dim=2, keepdim=True), pow2)
    return (e4m3(tiles / s).to(dtype) * s.to(dtype)).view(n, nb * TILE)[:, :k]


def quant_tokens(v: torch.Tensor, tile_of_row: torch.Tensor, tiles: int, pow2: bool = False,
                 dtype=torch.float32) -> torch.Tensor:
    """v [rows, c] (fp32 values) in expert order after quantization in tiles of 128 rows
    per column (tile_of_row: each row's tile), decoded in dtype."""
    v = v.float()
    amax = torch.zeros(tiles, v.shape[1], dtype=torch.float32, device=v.device)
    amax.scatter_reduce_(0, tile_of_row[:, None].expand_as(v), v.abs(), "amax")
    s = scales(amax, pow2)[tile_of_row]
    return e4m3(v / s).to(dtype) * s.to(dtype)


# ---- the layer ------------------------------------------------------------------------------


class Plan:
    """The slots in expert order (each expert's rows in token order): the token and the
    (t, k) index of each, per-expert counts, each row's weight-gradient tile."""

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


class Recipe:
    """Which GEMMs run FP8, the scale rule and the working dtype; the operands of a GEMM."""

    def __init__(self, fp8_gemms, pow2: bool = False, dtype=torch.float32):
        self.fp8_gemms, self.pow2, self.dtype = frozenset(fp8_gemms), pow2, dtype

    def bf16(self, v: torch.Tensor) -> torch.Tensor:
        """v rounded to bf16 through fp32 (a GPU epilogue's rounding), in the working dtype."""
        return v.float().to(_BF16).to(self.dtype)

    def weight(self, gemm: str, w: torch.Tensor) -> torch.Tensor:
        return (quant_blocks(w, self.pow2, self.dtype) if gemm in self.fp8_gemms
                else self.bf16(w))

    def rows(self, gemm: str, v: torch.Tensor) -> torch.Tensor:
        return quant_rows(v, self.pow2, self.dtype) if gemm in self.fp8_gemms else v

    def tokens(self, gemm: str, v: torch.Tensor, plan: Plan) -> torch.Tensor:
        if gemm not in self.fp8_gemms:
            return v
        return quant_tokens(v, plan.tile_of_row, plan.tiles, self.pow2, self.dtype)


def _per_expert(a: torch.Tensor, counts: list, fn) -> torch.Tensor:
    """fn(e, a_e) over the expert segments of a, concatenated."""
    outs = [fn(e, part) for e, part in enumerate(torch.split(a, counts)) if part.shape[0]]
    return torch.cat(outs) if outs else a.new_zeros((0,) + a.shape[1:])


def _wgrad(lhs: torch.Tensor, rhs: torch.Tensor, counts: list, shape, dtype) -> torch.Tensor:
    """sum over each expert's rows of lhs_row^T rhs_row, [E, lhs cols, rhs cols]."""
    out = torch.zeros(shape, dtype=dtype, device=lhs.device)
    for e, (l, r) in enumerate(zip(torch.split(lhs, counts), torch.split(rhs, counts))):
        if l.shape[0]:
            out[e] = l.T @ r
    return out


def experts_forward(x, ids, p, w13, w2, recipe: Recipe):
    """y [T, H] in the working dtype, and what experts_backward needs: x [T, H] bf16, ids
    [T, K] (-1 dropped), p [T, K] fp32, w13 [E, 2I, H], w2 [E, H, I] (bf16 or fp32)."""
    plan = Plan(ids, w13.shape[0])
    ps = p.reshape(-1)[plan.slot].to(recipe.dtype)
    xs = x[plan.token].to(recipe.dtype)
    q13 = recipe.weight("gemm1", w13)
    gu = recipe.bf16(_per_expert(recipe.rows("gemm1", xs), plan.counts,
                                 lambda e, v: v @ q13[e].T))
    inter = w2.shape[2]
    g, u = gu[:, :inter], gu[:, inter:]
    a = recipe.bf16(F.silu(g) * u)
    q2 = recipe.weight("gemm2", w2)
    o = _per_expert(recipe.rows("gemm2", a), plan.counts, lambda e, v: v @ q2[e].T)
    y = torch.zeros(x.shape, dtype=recipe.dtype, device=x.device)
    y.index_add_(0, plan.token, ps[:, None] * o)
    return y, (plan, gu, a)


def experts_backward(dy, x, p, w13, w2, state, recipe: Recipe):
    """(dx [T, H], d p [T, K], dW13, dW2) in the working dtype for dy [T, H] bf16 and the
    forward's state."""
    plan, gu, a = state
    dtype = recipe.dtype
    ps = p.reshape(-1)[plan.slot].to(dtype)
    inter = w2.shape[2]
    g, u = gu[:, :inter], gu[:, inter:]
    dys = dy[plan.token].to(dtype)
    q2 = recipe.weight("dgrad2", w2)
    da_ = recipe.bf16(_per_expert(recipe.rows("dgrad2", dys), plan.counts,
                                  lambda e, v: v @ q2[e]))
    dp = torch.zeros(p.numel(), dtype=dtype, device=p.device)
    dp[plan.slot] = (da_ * a).sum(dim=1)
    da = ps[:, None] * da_
    sig = torch.sigmoid(g)
    dgu = recipe.bf16(torch.cat([da * u * sig * (1 + g * (1 - sig)), da * g * sig], dim=1))
    q13 = recipe.weight("dgrad1", w13)
    dxs = _per_expert(recipe.rows("dgrad1", dgu), plan.counts, lambda e, v: v @ q13[e])
    dx = torch.zeros(x.shape, dtype=dtype, device=x.device)
    dx.index_add_(0, plan.token, dxs)
    pdy = (ps.float()[:, None] * dys.float()).to(dtype)  # one fp32 product
    dw2 = _wgrad(recipe.tokens("dw2", pdy, plan), recipe.tokens("dw2", a, plan),
                 plan.counts, w2.shape, dtype)
    dw13 = _wgrad(recipe.tokens("dw13", dgu, plan), recipe.tokens("dw13", x[plan.token].to(dtype),
                                                                  plan),
                  plan.counts, w13.shape, dtype)
    return dx, dp.view(p.shape), dw13, dw2


# ---- as a module, for training -------------------------------------------------------------


@contextlib.contextmanager
def exact_fp32(device: torch.device):
    """No autocast and no TF32 inside: the emulation's matmuls are fp32."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.autocast(device.type, enabled=False):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


class _EmulatedExperts(torch.autograd.Function):
    """Saves g, u, a in bf16 (their values are bf16) and quantizes the weights again in the
    backward (the same codes): about the library's saved memory."""

    @staticmethod
    def forward(ctx, x, ids, p, w13, w2, recipe):
        with exact_fp32(x.device):
            y, (plan, gu, a) = experts_forward(x, ids, p, w13, w2, recipe)
        ctx.save_for_backward(x, p, w13, w2, gu.to(_BF16), a.to(_BF16))
        ctx.plan, ctx.recipe = plan, recipe
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, p, w13, w2, gu, a = ctx.saved_tensors
        recipe = ctx.recipe
        with exact_fp32(x.device):
            state = (ctx.plan, gu.to(recipe.dtype), a.to(recipe.dtype))
            dx, dp, dw13, dw2 = experts_backward(dy, x, p, w13, w2, state, recipe)
        return (dx.to(x.dtype), None, dp.to(p.dtype), dw13.to(w13.dtype), dw2.to(w2.dtype),
                None)


class Fp8EmulatedExperts(nn.Module):
    """A MoEExperts' forward through the emulation in fp32, on the same parameters
    (gate_up_proj, down_proj); fp8_gemms: the GEMMs that run FP8 (parse_gemms)."""

    def __init__(self, experts: nn.Module, fp8_gemms: frozenset):
        super().__init__()
        self.gate_up_proj, self.down_proj = experts.gate_up_proj, experts.down_proj
        self.recipe = Recipe(fp8_gemms)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        y = _EmulatedExperts.apply(x.to(_BF16), ids, p.to(torch.float32), self.gate_up_proj,
                                   self.down_proj, self.recipe)
        return y.to(in_dtype)

    def extra_repr(self) -> str:
        return f"fp8_gemms={sorted(self.recipe.fp8_gemms, key=GEMMS.index)}"
