"""bench_ep.py's correctness modes: --check (moefuse against the EP baseline),
--check-r1 (bitwise against moefuse's single-rank op on every rank's gathered tokens)
and --iterations (many calls with fresh routing, --check-r1 on some). The modes are
described in bench_ep.py's docstring."""

from __future__ import annotations

import statistics
from typing import Optional

import torch
import torch.distributed as dist

import torch_moe_ep_baseline as ep
from ep_common import NAMES, _over_ranks, _print0, ep_step, forward_backward, module_error

ITERATION_SEED = 10_000  # --iterations draws routing from seed + this + 2 * (i * R + rank)
MEMORY_MARGIN = 1.15  # on the estimate of the --check-r1 reference, plus 1 GiB
GiB = 1 << 30


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
