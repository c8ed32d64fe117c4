"""moefuse with expert parallelism (moefuse.ExpertParallelExperts over an NCCL comm) vs
the TorchTitan-style EP baseline (bench/torch_moe_ep_baseline.py), in the same torchrun
job, one process per GPU; and moefuse's expert-parallel test suite over real NCCL.

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node 8 bench/bench_ep.py \\
        --models qwen3-30b-a3b qwen3-235b-a22b --tokens 4096 16384 --check --check-r1 \\
        --iterations 1000 --timeout-test --bench
        (the 8-GPU run: every mode below)
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
reference, so two correct sides differ by at most twice it).

--check-r1: moefuse's EP results bitwise equal to its single-rank op. Every rank
all_gathers (torch.distributed) every rank's x, ids, p, dy (their T first), runs
moefuse.experts (one rank, no comm) forward and backward on the concatenated batch
(rank 0's tokens first) with the global weights, and compares its own slice of y, dx,
d p and its experts' dW13, dW2 with its EP forward and backward: torch.equal, the max
|difference| printed where not equal (the receive order of the EP kernels is the
concatenated order, so the bits are the same). The reference layer needs workspaces for
the sum of T over ranks: a case whose estimated bytes do not fit the free memory of
every GPU prints SKIP with the estimate.

--iterations N: N forward+backward calls in a row on one module, the routing re-drawn
for every call (a seed per iteration and rank; on the device, no host synchronization
in the loop but a --check-r1 comparison at iterations 0, 1, N//2 and N-1), then
module.check(); prints ms per iteration (CUDA events around each call without a
check, the mean; the max over ranks).

--timeout-test (R >= 2; SKIP with R = 1): a comm with a 500 ms timeout; every rank but
the last calls one forward and the last skips it, so the others' check() must raise
MOEFUSE_ERR_TIMEOUT (its message printed); then a barrier of the process group, every
rank closes module and comm, and a new comm and module must pass one --check-r1 case
(the first model, token case and routing).

--bench (the default when none of --check, --check-r1, --iterations, --timeout-test is
given): forward, backward and forward+backward, median ms of CUDA events over --reps
calls after --warmup, the max over ranks, moefuse and the baseline in the same run;
backward alone is timed after an untimed forward. Inputs rotate over NUM_INPUT_SETS
token sets; both sides time the training forward (inputs require grad). One line per
case: model, T per rank, R, then ms and x baseline (baseline ms / moefuse ms) for each
of fwd, bwd, fwd+bwd, and moefuse's TFLOP/s per rank (6*T*K*H*I summed over ranks / R
for the forward, 3x for fwd+bwd).

The check modes print one PASS or FAIL line per case (rank 0; a failing rank adds its
details) and the script exits 1 on any failure. Options of the baseline script are
taken as they are (--tokens, --routing, --experts, --check, --warmup, --reps, --seed);
without CUDA, or with a libmoefuse built without NCCL, it prints SKIP and the reason
and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import pathlib
import statistics
import sys
import time
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
TIMEOUT_TEST_MS = 500
ITERATION_SEED = 10_000  # --iterations draws routing from seed + this + 2 * (i * R + rank)
MEMORY_MARGIN = 1.15  # on the estimate of the --check-r1 reference, plus 1 GiB
GiB = 1 << 30


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _print0(line: str) -> None:
    if _rank0():
        print(line, flush=True)


def skip(reason: str) -> None:
    _print0(f"SKIP bench_ep: {reason}")
    sys.exit(0)


def split_args(argv: Optional[Sequence[str]] = None):
    """(this script's options, the rest for the baseline's parser). Exits 2 on a bad
    value of this script's options; needs no GPU. No abbreviations: `--check` must stay
    the baseline's, not become --check-r1."""
    parser = argparse.ArgumentParser(
        prog="bench_ep.py", description=__doc__.split("\n\n")[0], allow_abbrev=False,
        epilog="Also: --tokens T[,T...] ..., --routing, --experts, --check, "
               "--warmup, --reps, --seed as torch_moe_ep_baseline.py takes them.")
    parser.add_argument("--models", nargs="+", choices=list(baseline.MODELS),
                        default=list(baseline.MODELS))
    parser.add_argument("--saved-mode", choices=sorted(SAVED_MODES), default="activations",
                        help="what moefuse's forward keeps for the backward")
    parser.add_argument("--timeout-ms", type=ep._positive, default=30000,
                        help="bound on every wait for a peer in moefuse's kernels")
    parser.add_argument("--check-r1", action="store_true",
                        help="y and gradients bitwise equal to moefuse.experts (one rank) "
                             "on every rank's gathered tokens")
    parser.add_argument("--iterations", type=ep._positive, metavar="N",
                        help="N forward+backward calls with fresh routing each, "
                             "--check-r1 at 0, 1, N//2, N-1, check() at the end")
    parser.add_argument("--timeout-test", action="store_true",
                        help=f"the last rank skips a forward: the others' check() must "
                             f"raise MOEFUSE_ERR_TIMEOUT ({TIMEOUT_TEST_MS} ms); then a "
                             "new comm and module must work (R >= 2)")
    parser.add_argument("--bench", action="store_true",
                        help="time moefuse and the baseline (the default when no check "
                             "or test mode is given)")
    return parser.parse_known_args(argv)


def bench_wanted(args, check: bool) -> bool:
    """--bench, or nothing else asked for."""
    return args.bench or not (check or args.check_r1 or args.iterations or args.timeout_test)


def parse_args(argv: Optional[Sequence[str]] = None):
    """(this script's options, [(model, the baseline's parsed options for it)]). The
    baseline's parser checks the rest against the launch (world size, GPUs, E % R,
    NCCL_NVLS_ENABLE) and exits 2 on a bad value."""
    args, rest = split_args(argv)
    if not torch.cuda.is_available():
        skip("no CUDA device (torch.cuda.is_available() is False)")
    runs = [(model, ep.parse_args(list(rest) + ["--model", model, "--device", "cuda",
                                                "--dtype", "bf16"]))
            for model in args.models]
    for _, opts in runs:
        opts.bench = bench_wanted(args, opts.check)
    return args, runs


def _label(model: str, tokens, world: int, routing: str) -> str:
    spec = ",".join(map(str, tokens)) if len(set(tokens)) > 1 else str(tokens[0])
    return f"{model:<16} T/rank={spec:<6} R={world} {routing}"


def _over_ranks(values, op) -> list:
    """values (a list, nested allowed) reduced elementwise over the ranks with op."""
    t = torch.tensor(values, dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=op)
    return t.tolist()


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


def forward_backward(forward, x, p, ids, dy, weights) -> tuple:
    """(y, dx, dp, dW13, dW2) of y = forward(x, ids, p) and its backward from dy, where
    weights = (w13, w2) are the leaves forward uses (autograd.grad: nothing accumulates
    into .grad)."""
    y = forward(x, ids, p)
    return (y.detach(),) + torch.autograd.grad(y, (x, p) + tuple(weights), dy,
                                               allow_unused=True)


def module_error(module) -> Optional[str]:
    """None when module.check() passes, else its MoefuseError as text."""
    import moefuse

    try:
        module.check()
    except moefuse.MoefuseError as err:
        return str(err)
    return None


def ep_step(module, x, p, ids, dy) -> tuple:
    """(y, dx, dp, dW13, dW2) of one forward and backward of the EP module."""
    return forward_backward(module, x, p, ids, dy, (module.w13, module.w2))


# ---- --check: against the baseline --------------------------------------------------------


def check_case(module, prob, experts: str):
    """Errors of moefuse against the baseline on this rank (dict name -> relative error)
    and the limit."""
    (x, p, w13, w2), ids, dy = ep._local_leaves(prob)
    base = forward_backward(lambda *a: ep.experts_ep(*a, w13, w2, None, experts),
                            x, p, ids, dy, (w13, w2))
    mine = ep_step(module, x, p, ids, dy)
    module.check()
    errors = {name: _relative(a, b) for name, a, b in zip(NAMES, mine, base)}
    return errors, 2 * ep.tolerance(torch.bfloat16, ep._reduction(prob))


def report_check(module, prob, experts: str, label: str) -> int:
    """--check of one case: prints ok / FAILED; returns the failures (max over ranks)."""
    errors, limit = check_case(module, prob, experts)
    bad = [f"{n} {e:.3e} > {limit:.1e}" for n, e in errors.items() if not e <= limit]
    for b in bad:
        print(f"rank {dist.get_rank()}: CHECK FAILED {label}: {b}", flush=True)
    summary = _over_ranks([errors[n] for n in NAMES] + [len(bad)], dist.ReduceOp.MAX)
    failed = int(summary[-1])
    report = ", ".join(f"{n} {e:.1e}" for n, e in zip(NAMES, summary))
    _print0(f"check {label}: {'ok' if not failed else 'FAILED'} (max over ranks of "
            f"max|moefuse - baseline|/max|baseline|: {report}; limit {limit:.1e})")
    return failed


# ---- --check-r1: bitwise against moefuse's single-rank op ----------------------------------


def gather_counts(num_rows: int, device) -> list:
    """Every rank's num_rows, in rank order."""
    mine = torch.tensor([num_rows], dtype=torch.int64, device=device)
    out = torch.empty(dist.get_world_size(), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(out, mine)
    return out.tolist()


def gather_rows(t: torch.Tensor, counts: list) -> torch.Tensor:
    """Every rank's t [counts[r], ...] concatenated in rank order: each rank's rows padded
    to the largest count (one all_gather_into_tensor), the padding dropped."""
    rows = max(max(counts), 1)
    padded = t.new_zeros((rows,) + tuple(t.shape[1:]))
    padded[:t.shape[0]] = t
    out = t.new_empty((len(counts) * rows,) + tuple(t.shape[1:]))
    dist.all_gather_into_tensor(out, padded)
    return torch.cat([out[r * rows:r * rows + n] for r, n in enumerate(counts)])


def slot_row_bytes(hidden: int, intermediate: int, recompute: bool = False) -> int:
    """Bytes of the CUDA backend's layer workspaces per slot row (src/cuda/pipeline/workspace.cu):
    xs 2H, act 2I, combine 2H, dh 4I, dp_partial 4P (P = I / 128), slot_rank 4, and
    gate_up 4I when recomputing."""
    return (4 * hidden + 6 * intermediate + 4 * (intermediate // 128) + 4
            + (4 * intermediate if recompute else 0))


def one_rank_bytes(num_tokens: int, hidden: int, intermediate: int, num_experts: int,
                   top_k: int, recompute: bool = False) -> int:
    """Estimated GPU bytes the --check-r1 reference adds: the cached single-rank layer
    (workspaces for token_bucket(T) tokens), the saved buffer, the gathered batch (x and
    dy twice: the all_gather staging), y, dx, ids, p, dp, and the global dW13, dW2 (fp32
    from the library, then bf16)."""
    from moefuse.ops import token_bucket

    def rows(t):  # rows_cap: every slot plus each expert group's padding to 128 rows
        return t * top_k + 127 * min(num_experts, t * top_k)

    workspace = rows(token_bucket(num_tokens)) * slot_row_bytes(hidden, intermediate,
                                                                recompute)
    saved = rows(num_tokens) * (4 + (0 if recompute else 4 * intermediate))
    saved += 4 * num_tokens * top_k
    batch = num_tokens * (6 * 2 * hidden + 4 * 4 * top_k)
    weights = num_experts * 3 * intermediate * hidden * (4 + 2)
    return workspace + saved + batch + weights


def memory_shortfall(need: int) -> Optional[str]:
    """None when every rank's GPU has need bytes (with a margin) free, else why not.
    Collective."""
    free = (torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved()
            - torch.cuda.memory_allocated())
    free = _over_ranks([free], dist.ReduceOp.MIN)[0]
    if need * MEMORY_MARGIN + GiB <= free:
        return None
    return (f"the one-rank reference needs ~{need / GiB:.1f} GiB (estimate, x{MEMORY_MARGIN} "
            f"+ 1 GiB), {free / GiB:.1f} GiB free (min over ranks)")


def one_rank_results(x, p, ids, dy, w13, w2, recompute: bool) -> tuple:
    """(y, dx, dp, dW13, dW2) of moefuse.experts (one rank, no comm) on the batch with
    the global weights."""
    import moefuse

    x, p, w13, w2 = (t.detach().requires_grad_() for t in (x, p, w13, w2))
    out = forward_backward(lambda *a: moefuse.experts(*a, w13, w2, recompute=recompute),
                           x, p, ids, dy, (w13, w2))
    moefuse.check_device_errors()
    return out


def bitwise_mismatches(got, want) -> list:
    """'name: ...' for each pair of NAMES that is not torch.equal (absent gradients
    count as zeros)."""
    bad = []
    for name, a, b in zip(NAMES, got, want):
        a = torch.zeros_like(b) if a is None else a
        if (a.dtype, a.shape) != (b.dtype, b.shape):
            bad.append(f"{name}: {a.dtype} {tuple(a.shape)}, one rank {b.dtype} "
                       f"{tuple(b.shape)}")
        elif not torch.equal(a, b):
            diff = (a.double() - b.double()).abs().max().item()
            bad.append(f"{name}: not bitwise equal, max|EP - one rank| = {diff:.3e}")
    return bad


def check_r1(module, batch, ep_out, prob, recompute: bool, label: str) -> int:
    """--check-r1 of one EP forward and backward: batch = this rank's (x, p, ids, dy),
    ep_out its (y, dx, dp, dW13, dW2). Also module.check(): a call that failed on the
    device writes nothing, and its outputs' memory may still hold an earlier call's
    bits. Collective. Prints PASS / FAIL / SKIP on rank 0 and each failure on its rank;
    returns the failures over all ranks."""
    import moefuse

    rank = dist.get_rank()
    error = module_error(module)
    bad = [] if error is None else [f"check(): {error}"]
    counts = gather_counts(batch[0].shape[0], batch[0].device)
    skipped = memory_shortfall(one_rank_bytes(
        sum(counts), module.hidden_size, module.intermediate_size, module.num_experts,
        module.top_k, recompute))
    if skipped is None:
        ref = one_rank_results(*(gather_rows(t.detach(), counts) for t in batch),
                               prob["w13"], prob["w2"], recompute)
        tok = slice(sum(counts[:rank]), sum(counts[:rank + 1]))
        exp = slice(module.expert_range.start, module.expert_range.stop)
        bad += bitwise_mismatches(ep_out, [t[tok] for t in ref[:3]] + [t[exp] for t in ref[3:]])
        del ref
        moefuse.layer_cache.clear()  # the reference's workspaces, for sum(counts) tokens
    for b in bad:
        print(f"rank {rank}: FAIL check-r1 {label}: {b}", flush=True)
    failed = int(_over_ranks([len(bad)], dist.ReduceOp.SUM)[0])
    if failed:
        verdict, outcome = "FAIL", f"{failed} failure(s) over the ranks, see above"
    elif skipped:
        verdict, outcome = "SKIP", f"check() clean; not compared: {skipped}"
    else:
        verdict, outcome = "PASS", ("y, dx, dp, dw13, dw2 of every rank bitwise equal to "
                                    f"moefuse.experts on all {sum(counts)} tokens")
    _print0(f"{verdict} check-r1 {label}: {outcome}")
    return failed


def check_r1_case(module, prob, inputs, recompute: bool, label: str) -> int:
    """One EP forward and backward of inputs (x, p, ids, dy), then check_r1."""
    return check_r1(module, inputs, ep_step(module, *inputs), prob, recompute, label)


# ---- --iterations ----------------------------------------------------------------------------


def check_iterations(n: int) -> list:
    """The iterations of an --iterations N run that get a --check-r1 comparison."""
    return sorted({0, 1, n // 2, n - 1} & set(range(n)))


def draw_routing(tokens, shape: dict, routing: str, device, seed: int):
    """(ids, p) of this rank for a fresh draw of make_ep_problem's routing (any --routing),
    p a leaf that requires grad. H = I = 1: only ids and p are kept. On the device, no
    host synchronization."""
    drawn = ep.make_ep_problem(tokens, dist.get_rank(), dict(shape, hidden=1, intermediate=1),
                               routing, torch.bfloat16, device, seed)
    (_, p, _, _), ids, _ = ep._local_leaves(drawn)
    return ids, p


def run_iterations(module, prob, inputs, n: int, tokens, shape: dict, routing: str,
                   seed: int, recompute: bool, label: str) -> int:
    """n forward+backward calls on module with this rank's x and dy of inputs and fresh
    routing for each; check_r1 at check_iterations(n), module.check() at the end. Prints
    ms per iteration and PASS / FAIL; returns the failures over all ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, _, _, dy = inputs
    checked = check_iterations(n)
    failed, timed = 0, []
    for i in range(n):
        ids, p = draw_routing(tokens, shape, routing, x.device,
                              seed + ITERATION_SEED + 2 * (i * world + rank))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = ep_step(module, x, p, ids, dy)
        end.record()
        if i in checked:
            failed += check_r1(module, (x, p, ids, dy), out, prob, recompute,
                               f"{label} iteration {i}")
        else:
            timed.append((start, end))
    error = module_error(module)  # waits for the stream: the events below are done
    if error is not None:
        print(f"rank {rank}: FAIL iterations {label}: check(): {error}", flush=True)
    ms = statistics.mean(s.elapsed_time(e) for s, e in timed) if timed else 0.0
    ms, errors = _over_ranks([ms, error is not None], dist.ReduceOp.MAX)
    failed += int(errors)
    timing = (f"{ms:.3f} ms/iteration (mean of the {len(timed)} unchecked, max over ranks)"
              if timed else "every iteration checked, none timed")
    _print0(f"{'FAIL' if failed else 'PASS'} iterations {label}: {n} forward+backward, "
            f"routing re-drawn each, --check-r1 at {checked}, check() "
            f"{'failed' if errors else 'clean'}; {timing}")
    return failed


# ---- --bench ---------------------------------------------------------------------------------


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
    return _over_ranks(times, dist.ReduceOp.MAX)


def report_bench(module, prob, inputs, tokens, shape: dict, label: str, opts) -> None:
    """--bench of one case: one line of ms, x baseline and TFLOP/s on rank 0."""
    (m_f, m_b, m_fb), (b_f, b_b, b_fb) = bench_case(
        module, prob, inputs, opts.experts, opts.warmup, opts.reps)
    flops = (6 * sum(tokens) * shape["top_k"] * shape["hidden"] * shape["intermediate"]
             / dist.get_world_size())
    _print0(f"{label:<40} {m_f:9.3f} {b_f:9.3f} {b_f / m_f:6.2f} | "
            f"{m_b:9.3f} {b_b:9.3f} {b_b / m_b:6.2f} | "
            f"{m_fb:9.3f} {b_fb:9.3f} {b_fb / m_fb:6.2f} | "
            f"{flops / m_f / 1e9:7.1f} {3 * flops / m_fb / 1e9:7.1f}")


# ---- the cases -------------------------------------------------------------------------------


def draw_case(tokens, shape: dict, routing: str, device, seed: int, num_sets: int):
    """(the problem of the first set: global weights and batch, for every rank the
    same; [(x, p, ids, dy)] of this rank for each of num_sets sets, x and p leaves
    that require grad)."""
    prob, inputs = None, []
    for s in range(num_sets):
        drawn = ep.make_ep_problem(tokens, dist.get_rank(), shape, routing, torch.bfloat16,
                                   device, seed + 1000 * s)
        (x, p, _, _), ids, dy = ep._local_leaves(drawn)
        inputs.append((x, p, ids, dy))
        if prob is None:
            prob = drawn
    return prob, inputs


def make_module(comm, shape: dict, tokens, saved_mode: str, device, prob):
    """This rank's ExpertParallelExperts over comm (max_tokens: the largest T of any
    rank) with prob's experts. Collective."""
    import moefuse

    module = moefuse.ExpertParallelExperts(
        shape["hidden"], shape["intermediate"], shape["num_experts"], shape["top_k"],
        max(1, max(tokens)), comm, dist.get_rank(), dist.get_world_size(),
        saved_mode=moefuse.SavedMode[SAVED_MODES[saved_mode]], device=device)
    module.load_global_experts(prob["w13"], prob["w2"])
    return module


def wants_a_case(args, opts) -> bool:
    """Whether any per-case mode is on (--timeout-test runs once, not per case)."""
    return bool(opts.check or opts.bench or args.check_r1 or args.iterations)


def run_case(comm, device: torch.device, model: str, tokens, routing: str, args, opts) -> int:
    """Checks, tests and/or times one case on this rank; returns the failures over all
    ranks."""
    shape = baseline.MODELS[model]
    recompute = args.saved_mode == "recompute"
    # The weights of the first set; this rank's tokens (x, p, ids, dy) of every set.
    prob, inputs = draw_case(tokens, shape, routing, device, opts.seed,
                             NUM_INPUT_SETS if opts.bench else 1)
    label = _label(model, tokens, dist.get_world_size(), routing)
    failed = 0
    with contextlib.closing(make_module(comm, shape, tokens, args.saved_mode, device,
                                        prob)) as module:
        if opts.check:
            failed += report_check(module, prob, opts.experts, label)
        if args.check_r1:
            failed += check_r1_case(module, prob, inputs[0], recompute, label)
        if args.iterations:
            failed += run_iterations(module, prob, inputs[0], args.iterations, tokens, shape,
                                     routing, opts.seed, recompute, label)
        if opts.bench:
            report_bench(module, prob, inputs, tokens, shape, label, opts)
    return failed


# ---- --timeout-test --------------------------------------------------------------------------


def expect_timeout(module) -> Optional[str]:
    """None when module.check() raises MOEFUSE_ERR_TIMEOUT (printed with its message and
    how long check() waited), else what it did instead."""
    import moefuse

    start = time.perf_counter()
    try:
        module.check()
    except moefuse.MoefuseError as err:
        print(f"rank {dist.get_rank()}: {err} (after {1e3 * (time.perf_counter() - start):.0f} "
              "ms in check())", flush=True)
        if err.status == moefuse.Status.ERR_TIMEOUT:
            return None
        return f"check() raised {err.status_name}, not MOEFUSE_ERR_TIMEOUT"
    return "check() raised nothing (expected MOEFUSE_ERR_TIMEOUT)"


@contextlib.contextmanager
def module_on_new_comm(timeout_ms: int, shape: dict, tokens, saved_mode: str, device, prob):
    """make_module over a new NCCL comm of the world; on exit closes the module, then the
    comm (collective, as making them was)."""
    from moefuse import distributed

    with contextlib.closing(distributed.nccl_comm_from_group(timeout_ms=timeout_ms)) as comm:
        with contextlib.closing(make_module(comm, shape, tokens, saved_mode, device,
                                            prob)) as module:
            yield module


def timeout_test(device: torch.device, model: str, tokens, routing: str, args, opts) -> int:
    """--timeout-test on one case; returns the failures over all ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    label = _label(model, tokens, world, routing)
    if world < 2:
        _print0(f"SKIP timeout-test {label}: needs two ranks")
        return 0
    shape = baseline.MODELS[model]
    prob, (inputs,) = draw_case(tokens, shape, routing, device, opts.seed, 1)
    x, p, ids, _ = inputs

    def new_module(timeout_ms: int):
        return module_on_new_comm(timeout_ms, shape, tokens, args.saved_mode, device, prob)

    # Every rank but the last runs a forward; the last never comes, so the others' waits
    # for it run out.
    with new_module(TIMEOUT_TEST_MS) as module:
        error = None
        if rank < world - 1:
            with torch.no_grad():
                module(x, ids, p)
            error = expect_timeout(module)
        dist.barrier()  # the process group: independent of moefuse's buffers
    # (closed: the module, then the comm, on every rank together)
    if error is not None:
        print(f"rank {rank}: FAIL timeout-test {label}: {error}", flush=True)
    failed = int(_over_ranks([error is not None], dist.ReduceOp.SUM)[0])
    # A new comm and module work.
    with new_module(args.timeout_ms) as module:
        failed += check_r1_case(module, prob, inputs, args.saved_mode == "recompute",
                                f"{label} after a timeout")
    waiting = "rank 0" if world == 2 else f"ranks 0..{world - 2}"
    outcome = (f"{failed} failure(s), see above" if failed else
               f"{waiting} got MOEFUSE_ERR_TIMEOUT ({TIMEOUT_TEST_MS} ms) while rank "
               f"{world - 1} skipped the forward; then a new comm and module passed --check-r1")
    _print0(f"{'FAIL' if failed else 'PASS'} timeout-test {label}: {outcome}")
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
    world = dist.get_world_size()
    comm = distributed.nccl_comm_from_group(timeout_ms=args.timeout_ms)
    failed = 0
    try:
        gm = ep.experts_reason(device, torch.bfloat16, runs[0][1].experts)
        _print0(f"# {torch.cuda.get_device_name(device)} x {world} (R={world}), bf16, moefuse "
                f"{args.saved_mode}, library {moefuse.library_path()}; baseline local experts: "
                f"{'torch._grouped_mm' if gm is None else 'per-expert loop (' + gm + ')'}")
        if any(opts.bench for _, opts in runs):
            _print0(f"# {'model, T per rank, R, routing':<38} {'fwd ms':>9} {'base':>9} "
                    f"{'x base':>6} | {'bwd ms':>9} {'base':>9} {'x base':>6} | "
                    f"{'f+b ms':>9} {'base':>9} {'x base':>6} | TFLOP/s/rank fwd f+b")
        for model, opts in runs:
            if not wants_a_case(args, opts):
                continue
            for tokens, routing in itertools.product(opts.tokens, opts.routing):
                failed += run_case(comm, device, model, tokens, routing, args, opts)
                torch.cuda.empty_cache()
        if args.timeout_test:
            model, opts = runs[0]
            failed += timeout_test(device, model, opts.tokens[0], opts.routing[0], args, opts)
    finally:
        comm.close()
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
