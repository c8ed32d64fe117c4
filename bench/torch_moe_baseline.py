"""The baseline a PyTorch user would pick today for the routed experts: a TorchTitan-style
MoE in plain PyTorch, forward and backward through autograd.

    sort the T*K slots by expert, pad each expert's rows to a multiple of 16 (what
    TorchTitan does for torch._grouped_mm), gather token rows, torch._grouped_mm for
    gate/up, SwiGLU, torch._grouped_mm for down, scale by the routing weight,
    index_add back to the tokens (bf16, as TorchTitan's scatter_add).

Everything stays on the device (no host synchronization). torch._grouped_mm needs a
CUDA GPU of sm_90 or newer and bf16; elsewhere (the CPU) experts_torch() falls back to
a per-expert loop of F.linear calls and says so in grouped_mm_reason().

Importable:
    MODELS, experts_torch(x, ids, p, w13, w2), make_problem(...), grouped_mm_reason(device),
    swiglu_grouped_mm / swiglu_linear (the expert FFN, used by torch_moe_ep_baseline.py),
    TorchQwen3MoeBlock (a drop-in for transformers' Qwen3MoeSparseMoeBlock on experts_torch)
CLI (times forward and forward+backward of one case):
    python bench/torch_moe_baseline.py --model qwen3-30b-a3b --tokens 4096 --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Optional

import torch
import torch.nn.functional as F

# Model shapes, as in shared/DESIGN.md section 1.
MODELS = {
    "qwen3-30b-a3b": dict(hidden=2048, intermediate=768, num_experts=128, top_k=8),
    "qwen3-235b-a22b": dict(hidden=4096, intermediate=1536, num_experts=128, top_k=8),
}

GROUP_ALIGN_M = 16  # rows per expert group padded to this (TorchTitan's ALIGN_SIZE_M for bf16)


def grouped_mm_reason(device: torch.device, op: str = "_grouped_mm") -> Optional[str]:
    """None when torch.<op> (a grouped GEMM: sm_90+) can run on `device`, else why the loop
    is used."""
    if not hasattr(torch, op):
        return f"torch {torch.__version__} has no torch.{op}"
    if device.type != "cuda":
        return f"torch.{op} needs a CUDA device (sm_90+), got {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"torch.{op} needs sm_90+, device is sm_{major}{minor}"
    return None


def _expert_rows(ids: torch.Tensor, num_experts: int):
    """The routing plan, on the device.

    Returns (row_of_slot [T*K] int64, slot_valid [T*K] bool, offsets [E] int32 cumulative
    padded group ends, num_rows_cap int). Dropped slots (-1) get row 0 and valid False."""
    flat = ids.reshape(-1).long()
    valid = flat >= 0
    expert = torch.where(valid, flat, num_experts)  # dropped slots sort last
    order = torch.argsort(expert, stable=True)
    counts = torch.bincount(expert, minlength=num_experts + 1)[:num_experts]
    padded = (counts + GROUP_ALIGN_M - 1) // GROUP_ALIGN_M * GROUP_ALIGN_M
    padded_start = torch.cumsum(padded, 0) - padded
    start = torch.cumsum(counts, 0) - counts
    # Rank of each sorted slot within its expert, then its padded row.
    sorted_expert = expert[order]
    sorted_valid = sorted_expert < num_experts
    e_clamped = sorted_expert.clamp(max=num_experts - 1)
    rank = torch.arange(flat.numel(), device=ids.device) - start[e_clamped]
    sorted_row = torch.where(sorted_valid, padded_start[e_clamped] + rank, 0)
    row_of_slot = torch.empty_like(sorted_row)
    row_of_slot[order] = sorted_row
    offsets = torch.cumsum(padded, 0).to(torch.int32)
    # Whole groups of GROUP_ALIGN_M rows: the FP8 peer's weight-gradient GEMM reads the rows
    # as its contraction, whose stride must be a multiple of 16 bytes.
    rows_cap = flat.numel() + num_experts * (GROUP_ALIGN_M - 1)
    rows_cap = (rows_cap + GROUP_ALIGN_M - 1) // GROUP_ALIGN_M * GROUP_ALIGN_M
    return row_of_slot, valid, offsets, rows_cap


def swiglu_grouped_mm(xs: torch.Tensor, offsets: torch.Tensor, w13: torch.Tensor,
                      w2: torch.Tensor) -> torch.Tensor:
    """One expert FFN per group of rows via torch._grouped_mm: xs [rows, H] sorted by
    expert, offsets [E] int32 cumulative group ends, w13 [E, 2I, H], w2 [E, H, I] ->
    [rows, H] = down(silu(gate) * up). Differentiable."""
    inter = w13.shape[1] // 2
    gate_up = torch._grouped_mm(xs, w13.transpose(-2, -1), offs=offsets)  # [rows, 2I]
    act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    return torch._grouped_mm(act, w2.transpose(-2, -1), offs=offsets)  # [rows, H]


def swiglu_linear(x: torch.Tensor, w13_e: torch.Tensor, w2_e: torch.Tensor) -> torch.Tensor:
    """One expert's FFN with F.linear: x [n, H], w13_e [2I, H], w2_e [H, I] -> [n, H]."""
    inter = w13_e.shape[0] // 2
    gate_up = F.linear(x, w13_e)
    return F.linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w2_e)


def experts_grouped_mm(x: torch.Tensor, ids: torch.Tensor, p: torch.Tensor,
                       w13: torch.Tensor, w2: torch.Tensor,
                       ffn=swiglu_grouped_mm) -> torch.Tensor:
    """y [T, H] bf16 via torch._grouped_mm. x [T, H] bf16, ids [T, K] (-1 dropped),
    p [T, K] fp32, w13 [E, 2I, H] bf16, w2 [E, H, I] bf16. Differentiable. ffn: the
    expert FFN on the sorted rows (swiglu_grouped_mm's arguments; the FP8 peer passes its
    own)."""
    T, H = x.shape
    K = ids.shape[1]
    E = w13.shape[0]
    row_of_slot, valid, offsets, rows_cap = _expert_rows(ids, E)
    token_of_slot = torch.arange(T * K, device=x.device) // K
    # Dispatch: token rows into the expert-sorted, padded buffer (padding rows stay 0).
    src_rows = row_of_slot[valid]
    xs = x.new_zeros(rows_cap, H).index_copy(0, src_rows, x[token_of_slot[valid]])
    out = ffn(xs, offsets, w13, w2)  # [rows, H]
    # Combine: weighted rows of each valid slot added into its token.
    slot_out = out[src_rows] * p.reshape(-1)[valid].unsqueeze(1).to(out.dtype)
    return x.new_zeros(T, H).index_add(0, token_of_slot[valid], slot_out)


def experts_loop(x: torch.Tensor, ids: torch.Tensor, p: torch.Tensor, w13: torch.Tensor,
                 w2: torch.Tensor) -> torch.Tensor:
    """The same math as a loop over experts (F.linear per expert), for devices without
    torch._grouped_mm. Differentiable; synchronizes on the routing."""
    T, H = x.shape
    y = x.new_zeros(T, H)
    for e in torch.unique(ids[ids >= 0]).tolist():
        tok, slot = torch.where(ids == e)
        out = swiglu_linear(x[tok], w13[e], w2[e]) * p[tok, slot].unsqueeze(1).to(x.dtype)
        y = y.index_add(0, tok, out)
    return y


def experts_torch(x, ids, p, w13, w2) -> torch.Tensor:
    """The baseline: torch._grouped_mm where it runs, else the per-expert loop."""
    if grouped_mm_reason(x.device) is None:
        return experts_grouped_mm(x, ids, p, w13, w2)
    return experts_loop(x, ids, p, w13, w2)


class _TorchExperts(torch.nn.Module):
    """gate_up_proj [E, 2I, H] and down_proj [E, H, I] (transformers >= 5 names)."""

    def __init__(self, num_experts, hidden, intermediate, device=None, dtype=torch.bfloat16):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.empty(
            num_experts, 2 * intermediate, hidden, device=device, dtype=dtype))
        self.down_proj = torch.nn.Parameter(torch.empty(
            num_experts, hidden, intermediate, device=device, dtype=dtype))

    def forward(self, x, ids, p):
        return experts_torch(x, ids, p, self.gate_up_proj, self.down_proj)


class TorchQwen3MoeBlock(torch.nn.Module):
    """Qwen3 MoE block with the baseline experts: router gate (nn.Linear(H, E), no bias),
    softmax over E in fp32, top-K, renormalized (norm_topk_prob), p kept fp32 (the same
    routing code as moefuse.MoefuseQwen3MoeBlock(router="torch")), then experts_torch.
    Parameter names follow transformers >= 5 (gate.weight, experts.gate_up_proj,
    experts.down_proj); forward(hidden_states [..., H]) -> same shape."""

    def __init__(self, hidden, intermediate, num_experts, top_k, norm_topk_prob=True,
                 device=None, dtype=torch.bfloat16):
        super().__init__()
        self.hidden_size, self.top_k, self.norm_topk_prob = hidden, top_k, norm_topk_prob
        self.gate = torch.nn.Linear(hidden, num_experts, bias=False, device=device, dtype=dtype)
        self.experts = _TorchExperts(num_experts, hidden, intermediate, device, dtype)

    @classmethod
    def from_transformers(cls, block: torch.nn.Module) -> "TorchQwen3MoeBlock":
        """From a transformers >= 5 Qwen3MoeSparseMoeBlock (fused expert weights)."""
        num_experts, hidden = block.gate.weight.shape
        new = cls(hidden, block.experts.gate_up_proj.shape[1] // 2, num_experts,
                  block.gate.top_k, block.gate.norm_topk_prob,
                  device=block.gate.weight.device, dtype=block.gate.weight.dtype)
        new.load_state_dict(block.state_dict())
        return new

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, self.hidden_size)
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        p, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            p = p / p.sum(dim=-1, keepdim=True)
        return self.experts(x, ids, p).reshape(shape)


def make_problem(num_tokens: int, hidden: int, intermediate: int, num_experts: int,
                 top_k: int, device, seed: int = 0, requires_grad: bool = True):
    """Random inputs, never zeros: x [T, H] bf16, ids [T, K] int32 (distinct top-K of
    random scores, so routing is roughly uniform), p [T, K] fp32 (softmax), w13, w2
    bf16 scaled like nn.Linear's init, dy [T, H] bf16."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(num_tokens, hidden, device=device, generator=g).to(torch.bfloat16)
    scores = torch.rand(num_tokens, num_experts, device=device, generator=g)
    ids = scores.topk(top_k, dim=-1).indices.to(torch.int32)
    p = torch.softmax(torch.randn(num_tokens, top_k, device=device, generator=g), dim=-1)
    w13 = (torch.randn(num_experts, 2 * intermediate, hidden, device=device, generator=g)
           * hidden ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(num_experts, hidden, intermediate, device=device, generator=g)
          * intermediate ** -0.5).to(torch.bfloat16)
    dy = torch.randn(num_tokens, hidden, device=device, generator=g).to(torch.bfloat16)
    if requires_grad:
        for t in (x, p, w13, w2):
            t.requires_grad_()
    return x, ids, p, w13, w2, dy


def make_problem_sets(num_tokens: int, shape: dict, device, num_sets: int):
    """num_sets problems (make_problem with seeds 0 .. num_sets - 1) that share one copy of
    the weights, the first set's (GBs at the Qwen3 shapes, far larger than L2 already):
    ([(x, ids, p, dy) per set], w13, w2)."""
    sets = [make_problem(num_tokens, **shape, device=device, seed=s) for s in range(num_sets)]
    w13, w2 = sets[0][3], sets[0][4]
    return [(x, ids, p, dy) for x, ids, p, _, _, dy in sets], w13, w2


def _time_ms(fn, device: torch.device, warmup: int = 3, reps: int = 20) -> float:
    """Median milliseconds of fn() (CUDA events on CUDA, perf_counter elsewhere)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    shape = MODELS[args.model]
    reason = grouped_mm_reason(device)
    print(f"baseline: {'torch._grouped_mm' if reason is None else 'per-expert loop (' + reason + ')'}")
    x, ids, p, w13, w2, dy = make_problem(args.tokens, **shape, device=device)
    flops = 6 * args.tokens * shape["top_k"] * shape["hidden"] * shape["intermediate"]

    def forward():
        return experts_torch(x, ids, p, w13, w2)

    def forward_backward():
        torch.autograd.backward(forward(), dy)

    fwd = _time_ms(forward, device, reps=args.reps)
    fwd_bwd = _time_ms(forward_backward, device, reps=args.reps)
    print(f"{args.model} T={args.tokens} bf16 baseline fwd {fwd:.3f} ms "
          f"({flops / fwd / 1e9:.1f} TFLOP/s), fwd+bwd {fwd_bwd:.3f} ms "
          f"({3 * flops / fwd_bwd / 1e9:.1f} TFLOP/s)")


if __name__ == "__main__":
    main()
