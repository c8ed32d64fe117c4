"""The expert-parallel baseline a PyTorch user would pick today: a TorchTitan-style MoE
with the routed experts sharded over R ranks, forward and backward through autograd.

Rank r holds experts r*E/R .. (r+1)*E/R - 1 (E divisible by R) and its own T tokens (T
may differ per rank, may be 0). Per forward, on every rank:

    route (given ids [T, K], -1 = dropped, and p [T, K] fp32); sort the valid slots by
    global expert, which also sorts them by destination rank; count slots per rank;
    all_to_all_single of the counts (one host sync for the split sizes, as TorchTitan);
    all_to_all_single of the token rows (bf16) and, alongside, of their local expert ids
    (int32); sort the received rows by local expert, pad groups to 16 rows,
    torch._grouped_mm for gate/up, SwiGLU, torch._grouped_mm for down (the single-rank
    pieces of torch_moe_baseline.py); the reverse all_to_all_single of the output rows;
    scale by p and index_add into y [T, H] (the weighted scatter-add).

Autograd: _AllToAll is an autograd.Function around dist.all_to_all_single whose backward
is the same exchange with the split sizes swapped. Every rank runs the same two
collectives in backward, even with T = 0 or no rows received (the graph stays connected
through empty tensors), so nothing deadlocks.

Where torch._grouped_mm cannot run (grouped_mm_reason(), or fp32), the local experts run
as a per-expert loop of F.linear and rank 0 says so; --experts grouped forces
torch._grouped_mm (torch 2.11 also has a CPU implementation of it).

Importable: experts_ep(x, ids, p, w13_local, w2_local, group=None, experts="auto").
CLI (NCCL on CUDA with NCCL_NVLS_ENABLE=0, gloo on CPU):
    torchrun --nproc-per-node 8 bench/torch_moe_ep_baseline.py --model qwen3-30b-a3b \\
        --tokens 4096 --check --bench
--tokens takes one or more cases; each is T per rank, or a comma list with one T per
rank (e.g. 7,0,3,5). Without torchrun's environment it runs as one process (R = 1).
"""

from __future__ import annotations

import argparse
import itertools
import os
import pathlib
import socket
import sys
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import torch_moe_baseline as baseline  # noqa: E402

# The baseline's model shapes plus a tiny one for tests (CPU, seconds).
MODELS = dict(baseline.MODELS)
MODELS["tiny"] = dict(hidden=64, intermediate=32, num_experts=8, top_k=2)

ROUTINGS = ("uniform", "one-rank", "dropped")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


# ---------------------------------------------------------------------------------------
# The exchange.

class _AllToAll(torch.autograd.Function):
    """Rows of x [sum(in_splits), ...] to every rank: out [sum(out_splits), ...].
    Backward: the reverse exchange of the gradient (splits swapped)."""

    @staticmethod
    def forward(ctx, x, out_splits: List[int], in_splits: List[int], group):
        ctx.splits, ctx.group = (list(out_splits), list(in_splits)), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), list(out_splits), list(in_splits),
                               group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(grad_in, grad.contiguous(), in_splits, out_splits,
                               group=ctx.group)
        return grad_in, None, None, None


def all_to_all(x: torch.Tensor, out_splits: List[int], in_splits: List[int],
               group=None) -> torch.Tensor:
    """Differentiable dist.all_to_all_single along dim 0 (no grad: a plain exchange)."""
    if x.requires_grad:
        return _AllToAll.apply(x, out_splits, in_splits, group)
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


# ---------------------------------------------------------------------------------------
# The local experts on the received rows.

def experts_reason(device: torch.device, dtype: torch.dtype,
                   experts: str = "auto") -> Optional[str]:
    """None when the local experts run on torch._grouped_mm, else why the loop is used."""
    if experts == "loop":
        return "--experts loop"
    if experts == "grouped":
        return None
    reason = baseline.grouped_mm_reason(device)
    if reason is None and dtype != torch.bfloat16:
        reason = f"torch._grouped_mm is used for bf16 only, dtype is {dtype}"
    return reason


def local_experts_rows(xr: torch.Tensor, er: torch.Tensor, w13: torch.Tensor,
                       w2: torch.Tensor, grouped: bool) -> torch.Tensor:
    """out [N, H]: row n through local expert er[n] (xr [N, H], er [N] int in [0, E_loc),
    w13 [E_loc, 2I, H], w2 [E_loc, H, I]). The output always depends on xr and the
    weights in the autograd graph, also for N = 0."""
    e_loc = w13.shape[0]
    if grouped:
        row_of_slot, _, offsets, rows_cap = baseline._expert_rows(er.view(-1, 1), e_loc)
        xs = xr.new_zeros(rows_cap, xr.shape[1]).index_copy(0, row_of_slot, xr)
        return baseline.swiglu_grouped_mm(xs, offsets, w13, w2)[row_of_slot]
    # Per-expert loop: sort by expert, split into groups (empty ones too), F.linear each.
    order = torch.argsort(er.long(), stable=True)
    counts = torch.bincount(er.long(), minlength=e_loc).tolist()
    pieces = torch.split(xr[order], counts)
    out_sorted = torch.cat([baseline.swiglu_linear(xe, w13[e], w2[e])
                            for e, xe in enumerate(pieces)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return out_sorted[inverse]


def experts_ep(x: torch.Tensor, ids: torch.Tensor, p: torch.Tensor, w13_local: torch.Tensor,
               w2_local: torch.Tensor, group=None, experts: str = "auto") -> torch.Tensor:
    """y [T, H] of this rank's tokens through experts sharded over the ranks of `group`.

    x [T, H], ids [T, K] global expert ids (-1 = dropped), p [T, K] fp32, w13_local
    [E/R, 2I, H] and w2_local [E/R, H, I]: this rank's contiguous shard. Differentiable
    in x, p and the local weights; collective (every rank of the group must call it)."""
    world = dist.get_world_size(group)
    T, H = x.shape
    K = ids.shape[1]
    e_loc = w13_local.shape[0]
    num_experts = e_loc * world
    flat = ids.reshape(-1).long()
    key = torch.where(flat >= 0, flat, num_experts)  # dropped slots sort last
    order = torch.argsort(key, stable=True)  # by expert, hence by destination rank
    send_counts = torch.bincount(key // e_loc, minlength=world + 1)[:world]
    recv_counts = all_to_all(send_counts, [1] * world, [1] * world, group)
    splits = torch.stack([send_counts, recv_counts]).tolist()  # the one host sync
    send_splits, recv_splits = splits[0], splits[1]
    sent = order[:sum(send_splits)]  # valid slots, sorted by destination then expert
    token = sent // K
    # Dispatch: token rows and their local expert ids.
    recv_x = all_to_all(x[token], recv_splits, send_splits, group)
    recv_e = all_to_all((key[sent] % e_loc).to(torch.int32), recv_splits, send_splits, group)
    # The local experts, grouped by expert across all source ranks.
    grouped = experts_reason(x.device, x.dtype, experts) is None
    out = local_experts_rows(recv_x, recv_e, w13_local, w2_local, grouped)
    # Combine: rows back to their source rank, weighted, added into their tokens.
    back = all_to_all(out, send_splits, recv_splits, group)
    weight = p.reshape(-1)[sent].unsqueeze(1).to(back.dtype)
    return x.new_zeros(T, H).index_add(0, token, back * weight)


# ---------------------------------------------------------------------------------------
# Problems, check, bench.

def make_ep_problem(tokens: Sequence[int], rank: int, model: dict, routing: str,
                    dtype: torch.dtype, device: torch.device, seed: int = 0):
    """The global batch (every rank's tokens, the same on every rank from the seed) and
    this rank's part. Returns dict with global x, ids, p, w13, w2, dy and the slices
    (tok0, tok1) of this rank's tokens and (e0, e1) of its experts."""
    world = len(tokens)
    num_experts, top_k = model["num_experts"], model["top_k"]
    e_loc = num_experts // world
    total = sum(tokens)
    x, ids, p, w13, w2, dy = baseline.make_problem(total, **model, device=device, seed=seed,
                                                   requires_grad=False)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    if routing == "one-rank":  # every slot to the experts of the last rank
        scores = torch.rand(total, e_loc, device=device, generator=g)
        ids = ((world - 1) * e_loc + scores.topk(top_k, dim=-1).indices).to(torch.int32)
    elif routing == "dropped":  # about a quarter of the slots dropped (-1)
        drop = torch.rand(total, top_k, device=device, generator=g) < 0.25
        ids = torch.where(drop, -1, ids)
    tok0 = sum(tokens[:rank])
    return dict(x=x.to(dtype), ids=ids, p=p, w13=w13.to(dtype), w2=w2.to(dtype),
                dy=dy.to(dtype), tok=(tok0, tok0 + tokens[rank]),
                exp=(rank * e_loc, (rank + 1) * e_loc))


def _local_leaves(prob):
    (t0, t1), (e0, e1) = prob["tok"], prob["exp"]
    leaves = [prob["x"][t0:t1].clone(), prob["p"][t0:t1].clone(),
              prob["w13"][e0:e1].clone(), prob["w2"][e0:e1].clone()]
    for t in leaves:
        t.requires_grad_()
    return leaves, prob["ids"][t0:t1], prob["dy"][t0:t1]


def tolerance(dtype: torch.dtype, reduction: int) -> float:
    """Allowed max|out - ref| / max|ref| against the wider reference: 4 machine epsilons
    of the compute dtype for the rounded intermediates (gate/up, activation, output rows,
    weighted rows, their sum), plus 2 sqrt(n) fp32 epsilons for the accumulation of the
    longest reduction n (GEMMs accumulate in fp32 also for bf16)."""
    return (4 * torch.finfo(dtype).eps
            + 2 * reduction ** 0.5 * torch.finfo(torch.float32).eps)


def _reduction(prob) -> int:
    """The longest sum in forward or backward: H, I, or the rows of one expert (<= all
    slots) summed into its weight gradient."""
    _, inter, hidden = prob["w13"].shape
    return max(hidden, inter, prob["ids"].numel(), 1)


def check_case(prob, dtype: torch.dtype, experts: str, group=None) -> List[str]:
    """Runs experts_ep forward and backward on this rank and compares y, dx, dp, dw13 and
    dw2 (this rank's shard) with one process computing the whole global batch with
    experts_loop in a wider dtype (fp32 for bf16, fp64 for fp32). Returns (failures,
    per-tensor errors, tolerance)."""
    (x, p, w13, w2), ids, dy = _local_leaves(prob)
    y = experts_ep(x, ids, p, w13, w2, group, experts)
    torch.autograd.backward(y, dy)
    ref_dtype = torch.float64 if dtype == torch.float32 else torch.float32
    rx, rp, rw13, rw2 = (prob[k].to(ref_dtype).requires_grad_() for k in ("x", "p", "w13", "w2"))
    ry = baseline.experts_loop(rx, prob["ids"], rp, rw13, rw2)
    if ry.requires_grad:  # not when no slot is routed at all (the loop touches nothing)
        torch.autograd.backward(ry, prob["dy"].to(ref_dtype))
    rx, rp, rw13, rw2 = (t.grad if t.grad is not None else torch.zeros_like(t)
                         for t in (rx, rp, rw13, rw2))
    (t0, t1), (e0, e1) = prob["tok"], prob["exp"]
    pairs = {"y": (y, ry[t0:t1]), "dx": (x.grad, rx[t0:t1]), "dp": (p.grad, rp[t0:t1]),
             "dw13": (w13.grad, rw13[e0:e1]), "dw2": (w2.grad, rw2[e0:e1])}
    tol, failures, report = tolerance(dtype, _reduction(prob)), [], []
    for name, (got, ref) in pairs.items():
        ref = ref.detach()
        got = torch.zeros_like(ref) if got is None else got.detach().to(ref.dtype)
        if got.shape != ref.shape:
            failures.append(f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}")
            continue
        if ref.numel() == 0:
            continue
        scale = ref.abs().max().item()
        err = (got - ref).abs().max().item() / max(scale, 1e-30)
        report.append(f"{name} {err:.1e}")
        if not err <= tol:  # NaN fails too
            failures.append(f"{name}: max|err|/max|ref| = {err:.3e} > {tol:.1e}")
    return failures, report, tol


def time_case(prob, experts: str, device: torch.device, warmup: int, reps: int, group=None):
    """(forward ms, forward+backward ms): median over reps of CUDA events (perf_counter on
    the CPU), the max over ranks."""
    (x, p, w13, w2), ids, dy = _local_leaves(prob)

    def forward():
        return experts_ep(x, ids, p, w13, w2, group, experts)

    def forward_backward():
        torch.autograd.backward(forward(), dy)

    times = []
    for fn in (forward, forward_backward):
        dist.barrier(group)
        times.append(baseline._time_ms(fn, device, warmup=warmup, reps=reps))
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


# ---------------------------------------------------------------------------------------
# CLI.

def _tokens_case(text: str) -> List[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: want a token count or a comma list of counts, one per rank")
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: token counts must be >= 0")
    return values


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be >= 1")
    return value


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parses and validates argv against the launch environment (torchrun's WORLD_SIZE,
    LOCAL_WORLD_SIZE) before any process group exists; bad values exit 2 with a message."""
    parser = argparse.ArgumentParser(
        prog="torch_moe_ep_baseline.py", description=__doc__.split("\n\n")[0],
        epilog="run under torchrun --nproc-per-node R for R ranks")
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=_tokens_case, nargs="+", default=[[4096]],
                        metavar="T[,T...]", help="cases: T per rank, or one T per rank")
    parser.add_argument("--routing", choices=ROUTINGS, nargs="+", default=["uniform"],
                        help="uniform top-K, one-rank (all slots to the last rank's "
                             "experts), dropped (a quarter of the slots -1)")
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        help="cuda when a GPU is visible, else cpu, by default")
    parser.add_argument("--dtype", choices=sorted(DTYPES),
                        help="bf16 on cuda, fp32 on cpu by default")
    parser.add_argument("--experts", choices=("auto", "grouped", "loop"), default="auto",
                        help="local experts: torch._grouped_mm where it runs (auto), "
                             "always, or a per-expert loop")
    parser.add_argument("--check", action="store_true",
                        help="compare y and gradients with one process computing the "
                             "global batch")
    parser.add_argument("--bench", action="store_true",
                        help="time forward and forward+backward (default without --check)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=_positive, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    world = _env_int("WORLD_SIZE", 1)
    local_world = _env_int("LOCAL_WORLD_SIZE", world)
    model = MODELS[args.model]
    num_experts, top_k = model["num_experts"], model["top_k"]
    if args.warmup < 0:
        parser.error(f"--warmup {args.warmup}: must be >= 0")
    if num_experts % world:
        parser.error(f"--model {args.model} has E={num_experts} experts, not divisible by "
                     f"the world size {world}")
    for case in args.tokens:
        if len(case) not in (1, world):
            parser.error(f"--tokens {','.join(map(str, case))}: {len(case)} counts for "
                         f"{world} ranks (give one count, or one per rank)")
    if "one-rank" in args.routing and top_k > num_experts // world:
        parser.error(f"--routing one-rank needs top_k={top_k} <= experts per rank "
                     f"{num_experts // world}")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA GPU is visible (use --device cpu)")
        if torch.cuda.device_count() < local_world:
            parser.error(f"--device cuda: {local_world} ranks on this node need "
                         f"{local_world} GPUs, {torch.cuda.device_count()} visible")
    if os.environ.get("NCCL_NVLS_ENABLE", "0") != "0":
        parser.error("NCCL_NVLS_ENABLE is set to "
                     f"{os.environ['NCCL_NVLS_ENABLE']!r}: NVLink multicast must stay off")
    args.dtype = DTYPES[args.dtype or ("bf16" if args.device == "cuda" else "fp32")]
    args.tokens = [case * world if len(case) == 1 else case for case in args.tokens]
    if not args.check:
        args.bench = True
    return args


def _init_process_group(device_type: str) -> torch.device:
    if "RANK" not in os.environ:  # one process without torchrun
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device_type == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast
        device = torch.device("cuda", _env_int("LOCAL_RANK", 0))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    device = _init_process_group(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = MODELS[args.model]
    dtype_name = {v: k for k, v in DTYPES.items()}[args.dtype]
    reason = experts_reason(device, args.dtype, args.experts)
    if rank == 0:
        print(f"EP baseline: R={world} {device.type} {dtype_name}, local experts on "
              f"{'torch._grouped_mm' if reason is None else 'a per-expert loop (' + reason + ')'}",
              flush=True)
    failed = 0
    try:
        for tokens, routing in itertools.product(args.tokens, args.routing):
            prob = make_ep_problem(tokens, rank, model, routing, args.dtype, device, args.seed)
            spec = ",".join(map(str, tokens)) if len(set(tokens)) > 1 else str(tokens[0])
            label = f"{args.model} T/rank={spec} R={world} {routing} {dtype_name}"
            if args.check:
                failures, report, tol = check_case(prob, args.dtype, args.experts)
                for f in failures:
                    print(f"rank {rank}: CHECK FAILED {label}: {f}", flush=True)
                bad = torch.tensor([len(failures)], device=device)
                dist.all_reduce(bad)
                failed += int(bad.item())
                if rank == 0:
                    print(f"check {label}: {'ok' if not bad.item() else 'FAILED'} "
                          f"(rank 0: {', '.join(report) or 'no tokens'}; tol "
                          f"{tol:.1e})", flush=True)
            if args.bench:
                fwd, fwd_bwd = time_case(prob, args.experts, device, args.warmup, args.reps)
                flops = (6 * sum(tokens) * model["top_k"] * model["hidden"]
                         * model["intermediate"] / world)  # per rank, forward
                if rank == 0:
                    print(f"{label} fwd {fwd:.3f} ms ({flops / fwd / 1e9:.1f} TFLOP/s/rank), "
                          f"fwd+bwd {fwd_bwd:.3f} ms ({3 * flops / fwd_bwd / 1e9:.1f} "
                          f"TFLOP/s/rank)", flush=True)
            del prob
    finally:
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
