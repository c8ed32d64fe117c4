"""The truth for the Python tests: the routed experts and Qwen3 routing in fp64 PyTorch,
plus the tolerance rule and random inputs. Shapes and math as in include/moefuse.h.

Tolerance rule. Each rounding to bf16 (8 significant bits, round-to-nearest-even)
adds a relative error uniform in [-2^-8, 2^-8] (RMS 2^-8 / sqrt(3)); n independent
roundings on the path of an output add up to an RMS of 2^-8 sqrt(n / 3). A result is
accepted when its norm-wise relative error against fp64 is at most twice that, plus
1e-5 for fp32 accumulation:

    ||got - ref|| / ||ref|| <= 2 * 2^-8 * sqrt(n / 3) + 1e-5

with n counted per output from the pipeline's bf16 intermediates (DESIGN.md 2):
    y     : [g; u] (act is computed from them), a, the combine row p*o, y  n = 4
    dx    : saved [g; u], da' = W2^T dy, [dg; du], dx                       n = 4
    dp    : saved [g; u], a, da'                                           n = 3
    dW13  : saved [g; u], da', [dg; du]                                    n = 3
    dW2   : saved [g; u], a, the bf16 GEMM operand p*dy                    n = 3
Inputs (x, p, W13, W2, dy) are given as bf16/fp32 values and the reference computes on
exactly those values, so they add no rounding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

ROUNDINGS = {"y": 4, "dx": 4, "dp": 3, "dw13": 3, "dw2": 3}


def tolerance(num_roundings: int) -> float:
    """Norm-wise relative error bound for n bf16 roundings (see the module docstring)."""
    return 2.0 * 2.0 ** -8 * math.sqrt(num_roundings / 3.0) + 1e-5


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in fp64 (0 when both are 0)."""
    got, ref = got.double(), ref.double()
    denom = ref.norm().item()
    diff = (got - ref).norm().item()
    return diff / denom if denom > 0 else diff


def assert_close_bf16(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Asserts the tolerance rule for the output named `what` (a key of ROUNDINGS)."""
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(got.double()).all(), f"{what}: non-finite values"
    err, tol = rel_error(got, ref), tolerance(ROUNDINGS[what])
    assert err <= tol, f"{what}: relative error {err:.3e} > tolerance {tol:.3e} (n={ROUNDINGS[what]})"


def experts_reference(x: torch.Tensor, ids: torch.Tensor, p: torch.Tensor,
                      w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """y [T, H] from x [T, H], ids [T, K] (-1 dropped), p [T, K], w13 [E, 2I, H],
    w2 [E, H, I], all float tensors computed in their own dtype (pass fp64). The
    plainest form: a loop over experts; differentiable by autograd."""
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    y = torch.zeros_like(x)
    for e in range(num_experts):
        tok, slot = torch.where(ids == e)
        if tok.numel() == 0:
            continue
        gu = x[tok] @ w13[e].T
        a = F.silu(gu[:, :inter]) * gu[:, inter:]
        o = a @ w2[e].T
        y = y.index_add(0, tok, p[tok, slot].unsqueeze(1) * o)
    return y


def experts_reference_grads(x, ids, p, w13, w2, dy):
    """fp64 (y, dx, dp, dw13, dw2) of <dy, y> at the given values (any dtypes)."""
    leaves = [t.detach().double().requires_grad_() for t in (x, p, w13, w2)]
    xd, pd, w13d, w2d = leaves
    y = experts_reference(xd, ids.long(), pd, w13d, w2d)
    if not y.requires_grad:  # every slot dropped: y = 0 does not depend on anything
        return (y.detach(), *(torch.zeros_like(t) for t in leaves))
    dx, dp, dw13, dw2 = torch.autograd.grad(y, leaves, dy.double(), materialize_grads=True)
    # Dropped slots get no gradient (d p = 0 there), as the library promises.
    return y.detach(), dx, dp, dw13, dw2


def route_reference(logits: torch.Tensor, top_k: int):
    """Qwen3 routing in fp64: select on logits (ties: lower id first), weights =
    softmax over E, top-K, renormalized. Returns (ids int64, weights fp64), weights
    differentiable in logits."""
    logits = logits.double()
    ids = torch.sort(logits.detach(), dim=-1, descending=True, stable=True).indices[:, :top_k]
    probs = torch.softmax(logits, dim=-1).gather(1, ids)
    return ids, probs / probs.sum(dim=-1, keepdim=True)


def random_routing(num_tokens: int, num_experts: int, top_k: int, generator: torch.Generator,
                   drop_fraction: float = 0.0, skew: str = "uniform") -> torch.Tensor:
    """ids [T, K] int32, distinct experts per row, -1 for dropped slots.

    skew: "uniform" (random permutations), "one_expert" (every token's first slot on
    expert 0), "zipf" (expert e drawn with weight 1 / (e + 1))."""
    if skew == "zipf":
        weights = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64)
        ids = torch.stack([torch.multinomial(weights, top_k, replacement=False, generator=generator)
                           for _ in range(num_tokens)])
    else:
        ids = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k]
                           for _ in range(num_tokens)])
        if skew == "one_expert":
            # Put expert 0 in slot 0 of every row, keeping rows distinct.
            for t in range(num_tokens):
                row = ids[t]
                where0 = (row == 0).nonzero()
                if where0.numel():
                    row[where0[0, 0]] = row[0]
                row[0] = 0
    if drop_fraction > 0:
        drop = torch.rand(ids.shape, generator=generator) < drop_fraction
        ids = ids.masked_fill(drop, -1)
    return ids.to(torch.int32)


def random_problem(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int,
                   seed: int = 0, drop_fraction: float = 0.0, skew: str = "uniform"):
    """(x bf16, ids int32, p fp32, w13 bf16, w2 bf16, dy bf16), never zeros, weights
    scaled like nn.Linear's init so activations stay O(1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g).to(torch.bfloat16)
    ids = random_routing(num_tokens, num_experts, top_k, g, drop_fraction, skew)
    p = torch.softmax(torch.randn(num_tokens, top_k, generator=g), dim=-1)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) / math.sqrt(hidden)).to(torch.bfloat16)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) / math.sqrt(inter)).to(torch.bfloat16)
    dy = torch.randn(num_tokens, hidden, generator=g).to(torch.bfloat16)
    return x, ids, p, w13, w2, dy
