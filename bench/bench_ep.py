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
import pathlib
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

from ep_checks import (check_iterations, check_r1_case, one_rank_bytes,  # noqa: E402
                       report_check, run_iterations, slot_row_bytes)
from ep_common import _over_ranks, _print0  # noqa: E402
from ep_timing import report_bench  # noqa: E402

# The modes live in ep_checks.py (--check, --check-r1, --iterations) and ep_timing.py
# (--bench); their helpers that the tests use stay importable from here.
_REEXPORTED = (check_iterations, one_rank_bytes, slot_row_bytes)

NUM_INPUT_SETS = 4
SAVED_MODES = {"activations": "SAVE_ACTIVATIONS", "recompute": "RECOMPUTE"}
TIMEOUT_TEST_MS = 500


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


def make_module(comm, shape: dict, tokens, saved_mode: str, device, prob, routing: str):
    """This rank's ExpertParallelExperts over comm (max_tokens: the largest T of any
    rank) with prob's experts. Collective. The one-rank routing sends a rank R times the
    balanced load: its receive capacity is then R (the worst case), else the default."""
    import moefuse

    world = dist.get_world_size()
    module = moefuse.ExpertParallelExperts(
        shape["hidden"], shape["intermediate"], shape["num_experts"], shape["top_k"],
        max(1, max(tokens)), comm, dist.get_rank(), world,
        saved_mode=moefuse.SavedMode[SAVED_MODES[saved_mode]], device=device,
        recv_capacity_factor=world if routing == "one-rank" else 0.0)
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
                                        prob, routing)) as module:
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
def module_on_new_comm(timeout_ms: int, shape: dict, tokens, saved_mode: str, device, prob,
                       routing: str):
    """make_module over a new NCCL comm of the world; on exit closes the module, then the
    comm (collective, as making them was)."""
    from moefuse import distributed

    with contextlib.closing(distributed.nccl_comm_from_group(timeout_ms=timeout_ms)) as comm:
        with contextlib.closing(make_module(comm, shape, tokens, saved_mode, device,
                                            prob, routing)) as module:
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
        return module_on_new_comm(timeout_ms, shape, tokens, args.saved_mode, device, prob,
                                  routing)

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
