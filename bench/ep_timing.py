"""bench_ep.py's --bench: forward, backward and forward+backward of moefuse and the EP
baseline, median ms of CUDA events, the max over ranks (see bench_ep.py's docstring)."""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

import torch_moe_ep_baseline as ep
from bench_forward import time_cuda_ms
from ep_common import _over_ranks, _print0


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
