"""moefuse with expert parallelism (moefuse.ExpertParallelExperts over an NCCL comm) vs
the TorchTitan-style EP baseline (bench/torch_moe_ep_baseline.py), in the same torchrun
job, one process per GPU.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 8 bench/bench_ep.py \\
        --models qwen3-30b-a3b qwen3-235b-a22b --tokens 4096 16384 --check --bench
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 1 bench/bench_ep.py --tokens 1024 --check
        (smoke test: R = 1 over a one-rank NCCL comm)

Problem (the baseline's make_ep_problem, bf16): the global weights and the global batch
are drawn from --seed on every rank, so every rank has the same weights and takes its
own tokens and routing (T per rank from --tokens; one count per rank for uneven T,
e.g. 4096,0,2048,4096). Rank r holds experts r*E/R .. (r+1)*E/R - 1 on both sides.

--check: y, dx, d p, dW13, dW2 of moefuse against the baseline on the same inputs,
max|moefuse - baseline| / max|baseline| per tensor, the max over ranks. Limit: twice the
baseline script's own tolerance (its --check holds each side within it of a wider
reference, so two correct sides differ by at most twice it). Exit 1 on a failure.

--bench (default without --check): forward, backward and forward+backward, median ms
of CUDA events over --reps calls after --warmup, the max over ranks, moefuse and the
baseline in the same run; backward alone is timed after an untimed forward. Inputs
rotate over NUM_INPUT_SETS token sets; both sides time the training forward (inputs
require grad). One line per case: model, T per rank, R, then ms and x baseline
(baseline ms / moefuse ms) for each of fwd, bwd, fwd+bwd, and moefuse's TFLOP/s per
rank (6*T*K*H*I summed over ranks / R for the forward, 3x for fwd+bwd).

Options of the baseline script are taken as they are (--tokens, --routing, --experts,
--check, --bench, --warmup, --reps, --seed); without CUDA, or with a libmoefuse built
without NCCL, it prints SKIP and the reason and exits 0.
"""

from __future__ import annotations

import argparse
import itertools
import os
import pathlib
import statistics
import sys
from typing import Optional, Sequence

import torch
import torch.distributed as dist

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "python"))  # the checkout's package, when not installed

import torch_moe_baseline as baseline  # noqa: E402
import torch_moe_ep_baseline as ep  # noqa: E402
from bench_forward import time_cuda_ms  # noqa: E402

NUM_INPUT_SETS = 4
NAMES = ("y", "dx", "dp", "dw13", "dw2")
SAVED_MODES = {"activations": "SAVE_ACTIVATIONS", "recompute": "RECOMPUTE"}


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def skip(reason: str) -> None:
    if _rank0():
        print(f"SKIP bench_ep: {reason}", flush=True)
    sys.exit(0)


def parse_args(argv: Optional[Sequence[str]] = None):
    """(this script's options, [(model, the baseline's parsed options for it)]). The
    baseline's parser checks the rest against the launch (world size, GPUs, E % R,
    NCCL_NVLS_ENABLE) and exits 2 on a bad value."""
    parser = argparse.ArgumentParser(
        prog="bench_ep.py", description=__doc__.split("\n\n")[0],
        epilog="Also: --tokens T[,T...] ..., --routing, --experts, --check, --bench, "
               "--warmup, --reps, --seed as torch_moe_ep_baseline.py takes them.")
    parser.add_argument("--models", nargs="+", choices=list(baseline.MODELS),
                        default=list(baseline.MODELS))
    parser.add_argument("--saved-mode", choices=sorted(SAVED_MODES), default="activations",
                        help="what moefuse's forward keeps for the backward")
    parser.add_argument("--timeout-ms", type=ep._positive, default=30000,
                        help="bound on every wait for a peer in moefuse's kernels")
    args, rest = parser.parse_known_args(argv)
    if not torch.cuda.is_available():
        skip("no CUDA device (torch.cuda.is_available() is False)")
    runs = [(model, ep.parse_args(list(rest) + ["--model", model, "--device", "cuda",
                                                "--dtype", "bf16"]))
            for model in args.models]
    return args, runs


def _label(model: str, tokens, world: int, routing: str) -> str:
    spec = ",".join(map(str, tokens)) if len(set(tokens)) > 1 else str(tokens[0])
    return f"{model:<16} T/rank={spec:<6} R={world} {routing}"


def _relative(got: Optional[torch.Tensor], ref: Optional[torch.Tensor]) -> float:
    """max|got - ref| / max|ref| (absent gradients count as zeros); 0 for empty tensors."""
    if ref is None and got is None:
        return 0.0
    ref = torch.zeros_like(got) if ref is None else ref
    got = torch.zeros_like(ref) if got is None else got
    if ref.numel() == 0:
        return 0.0
    ref, got = ref.detach().float(), got.detach().float()
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def check_case(module, prob, experts: str):
    """Errors of moefuse against the baseline on this rank (dict name -> relative error)
    and the limit."""
    (x, p, w13, w2), ids, dy = ep._local_leaves(prob)
    y_b = ep.experts_ep(x, ids, p, w13, w2, None, experts)
    base = (y_b,) + torch.autograd.grad(y_b, (x, p, w13, w2), dy, allow_unused=True)
    y_m = module(x, ids, p)
    mine = (y_m,) + torch.autograd.grad(y_m, (x, p, module.w13, module.w2), dy,
                                        allow_unused=True)
    module.check()
    errors = {name: _relative(a, b) for name, a, b in zip(NAMES, mine, base)}
    return errors, 2 * ep.tolerance(torch.bfloat16, ep._reduction(prob))


def time_backward_ms(forward, backward, num_sets: int, warmup: int, reps: int) -> float:
    """Median ms of backward(i, forward(i)) over reps calls, only the backward bracketed
    by CUDA events."""
    for i in range(warmup):
        backward(i % num_sets, forward(i % num_sets))
    times = []
    for i in range(reps):
        out = forward(i % num_sets)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        backward(i % num_sets, out)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_side(forward, weights, inputs, warmup: int, reps: int) -> list:
    """[fwd, bwd, fwd+bwd] median ms of one implementation; forward(i) runs input set i
    (x, p, ids, dy) through it."""

    # autograd.grad, not backward: accumulating into .grad would add a pass over every
    # weight gradient to each timed call.
    def backward(i, y):
        x, p, _, dy = inputs[i]
        torch.autograd.grad(y, (x, p) + weights, dy, allow_unused=True)

    def forward_backward(i):
        backward(i, forward(i))

    n, row = len(inputs), []
    for measure in (lambda: time_cuda_ms(forward, n, warmup, reps),
                    lambda: time_backward_ms(forward, backward, n, warmup, reps),
                    lambda: time_cuda_ms(forward_backward, n, warmup, reps)):
        dist.barrier()  # every rank starts each measurement together
        row.append(measure())
    return row


def bench_case(module, prob, inputs, experts: str, warmup: int, reps: int):
    """[[fwd, bwd, fwd+bwd] ms of moefuse, the same of the baseline], max over ranks."""
    (_, _, w13, w2), _, _ = ep._local_leaves(prob)

    def moefuse_fwd(i):
        x, p, ids, _ = inputs[i]
        return module(x, ids, p)

    def baseline_fwd(i):
        x, p, ids, _ = inputs[i]
        return ep.experts_ep(x, ids, p, w13, w2, None, experts)

    times = [time_side(moefuse_fwd, (module.w13, module.w2), inputs, warmup, reps),
             time_side(baseline_fwd, (w13, w2), inputs, warmup, reps)]
    module.check()
    t = torch.tensor(times, dtype=torch.float64, device=w13.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def run_case(comm, device: torch.device, model: str, tokens, routing: str, args, opts) -> int:
    """Checks and/or times one case on this rank; returns the failures over all ranks."""
    import moefuse

    rank, world = dist.get_rank(), dist.get_world_size()
    shape = baseline.MODELS[model]
    # The weights of the first set; this rank's tokens (x, p, ids, dy) of every set.
    prob, inputs = None, []
    for s in range(NUM_INPUT_SETS if opts.bench else 1):
        drawn = ep.make_ep_problem(tokens, rank, shape, routing, torch.bfloat16, device,
                                   opts.seed + 1000 * s)
        (x, p, _, _), ids, dy = ep._local_leaves(drawn)
        inputs.append((x, p, ids, dy))
        if prob is None:
            prob = drawn
    del drawn
    module = moefuse.ExpertParallelExperts(
        shape["hidden"], shape["intermediate"], shape["num_experts"], shape["top_k"],
        max(1, max(tokens)), comm, rank, world,
        saved_mode=moefuse.SavedMode[SAVED_MODES[args.saved_mode]], device=device)
    module.load_global_experts(prob["w13"], prob["w2"])
    label = _label(model, tokens, world, routing)
    failed = 0
    try:
        if opts.check:
            errors, limit = check_case(module, prob, opts.experts)
            bad = [f"{n} {e:.3e} > {limit:.1e}" for n, e in errors.items() if not e <= limit]
            for b in bad:
                print(f"rank {rank}: CHECK FAILED {label}: {b}", flush=True)
            summary = torch.tensor([errors[n] for n in NAMES] + [len(bad)],
                                   dtype=torch.float64, device=device)
            dist.all_reduce(summary, op=dist.ReduceOp.MAX)
            failed = int(summary[-1].item())
            if rank == 0:
                report = ", ".join(f"{n} {e:.1e}" for n, e in zip(NAMES, summary.tolist()))
                print(f"check {label}: {'ok' if not failed else 'FAILED'} (max over ranks of "
                      f"max|moefuse - baseline|/max|baseline|: {report}; limit {limit:.1e})",
                      flush=True)
        if opts.bench:
            (m_f, m_b, m_fb), (b_f, b_b, b_fb) = bench_case(
                module, prob, inputs, opts.experts, opts.warmup, opts.reps)
            flops = (6 * sum(tokens) * shape["top_k"] * shape["hidden"]
                     * shape["intermediate"] / world)
            if rank == 0:
                print(f"{label:<40} {m_f:9.3f} {b_f:9.3f} {b_f / m_f:6.2f} | "
                      f"{m_b:9.3f} {b_b:9.3f} {b_b / m_b:6.2f} | "
                      f"{m_fb:9.3f} {b_fb:9.3f} {b_fb / m_fb:6.2f} | "
                      f"{flops / m_f / 1e9:7.1f} {3 * flops / m_fb / 1e9:7.1f}", flush=True)
    finally:
        module.close()
    return failed


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, runs = parse_args(argv)
    import moefuse
    from moefuse import distributed

    if not moefuse.is_available():
        skip("libmoefuse not loadable (build it with `make lib`, or set MOEFUSE_LIB)")
    reason = distributed.nccl_unsupported_reason()
    if reason is not None:
        skip(f"libmoefuse was built without NCCL ({reason})")
    device = ep._init_process_group("cuda")
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = distributed.nccl_comm_from_group(timeout_ms=args.timeout_ms)
    failed = 0
    try:
        if rank == 0:
            gm = ep.experts_reason(device, torch.bfloat16, runs[0][1].experts)
            print(f"# {torch.cuda.get_device_name(device)} x {world} (R={world}), bf16, moefuse "
                  f"{args.saved_mode}, library {moefuse.library_path()}; baseline local experts: "
                  f"{'torch._grouped_mm' if gm is None else 'per-expert loop (' + gm + ')'}",
                  flush=True)
            if any(opts.bench for _, opts in runs):
                print(f"# {'model, T per rank, R, routing':<38} {'fwd ms':>9} {'base':>9} "
                      f"{'x base':>6} | {'bwd ms':>9} {'base':>9} {'x base':>6} | "
                      f"{'f+b ms':>9} {'base':>9} {'x base':>6} | TFLOP/s/rank fwd f+b",
                      flush=True)
        for model, opts in runs:
            for tokens, routing in itertools.product(opts.tokens, opts.routing):
                failed += run_case(comm, device, model, tokens, routing, args, opts)
                torch.cuda.empty_cache()
    finally:
        comm.close()
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
