"""The routed experts as moefuse.torchtitan calls them, with TorchTitan's w1 and w3 handed
to the library as W13's two halves (moefuse_fwd_args.w13 / w13_up: no copy) against the
concatenation the adapter made before (torch.cat([w1, w3], dim=1) per call, autograd
splitting dW13 back), in the same run, interleaved (the power limit's clock changes fall
on both alike, docs/decisions/0013-power-limit-timing).

    halves  moefuse.torchtitan.routed_experts(x, scores, ids, w1, w3, w2) (without
            TorchTitan installed: the same call, moefuse.experts(x, ids, scores,
            (w1, w3), w2))
    cat     moefuse.experts(x, ids, scores, torch.cat([w1, w3], dim=1), w2)

bf16 parameters w1, w3 [E, F, D], w2 [E, D, F] (as FSDP hands them to the forward), their
gradients set to None before each step (as zero_grad does), x [T, D] and random top-K
routing (uniform, softmax scores) rotating over --inputs sets. Prints, per case, the
median ms of the forward and of forward + backward (CUDA events, after --warmup), for
both and their difference, and checks once that both give the same bits.

    python3 bench/bench_w13_halves.py                 # qwen3-30b-a3b, T = 16384
    python3 bench/bench_w13_halves.py --model qwen3-235b-a22b --tokens 8192
"""

from __future__ import annotations

import argparse
import statistics

import torch

import moefuse
from moefuse import ops

MODELS = {  # name: (D = H, F = I, E, K)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "qwen3-235b-a22b": (4096, 1536, 128, 8),
}


def halves_call():
    """routed_experts when TorchTitan is importable, else the identical op call."""
    try:
        from moefuse import torchtitan as mtt
        return "moefuse.torchtitan.routed_experts", mtt.routed_experts
    except ImportError:
        def call(x, scores, ids, w1, w3, w2):
            return ops.experts(x, ids, scores, (w1, w3), w2)
        return "moefuse.experts(..., (w1, w3), w2)", call


def cat_call(x, scores, ids, w1, w3, w2):
    return ops.experts(x, ids, scores, torch.cat([w1, w3], dim=1), w2)


def make_inputs(T, D, E, K, n, device, g):
    sets = []
    for _ in range(n):
        x = torch.randn(T, D, device=device, generator=g).bfloat16().requires_grad_()
        logits = torch.randn(T, E, device=device, generator=g)
        scores, ids = torch.softmax(logits, dim=-1).topk(K, dim=-1)
        scores = (scores / scores.sum(-1, keepdim=True)).requires_grad_()
        dy = torch.randn(T, D, device=device, generator=g).bfloat16()
        sets.append((x, scores, ids, dy))
    return sets


def timed(fn, params, inputs, backward):
    """ms of one call (and its backward) on the current stream."""
    x, scores, ids, dy = inputs
    for p in params:
        p.grad = None
    x.grad = scores.grad = None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    y = fn(x, scores, ids, *params)
    if backward:
        y.backward(dy)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--inputs", type=int, default=2, help="input sets rotated over")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("SKIP bench_w13_halves: no CUDA device")
        return 0
    device = torch.device("cuda")
    D, F, E, K = MODELS[args.model]
    T = args.tokens
    g = torch.Generator(device=device).manual_seed(0)
    params = [(torch.randn(E, F, D, device=device, generator=g) * D ** -0.5).bfloat16(),
              (torch.randn(E, F, D, device=device, generator=g) * D ** -0.5).bfloat16(),
              (torch.randn(E, D, F, device=device, generator=g) * F ** -0.5).bfloat16()]
    params = [p.requires_grad_() for p in params]
    inputs = make_inputs(T, D, E, K, args.inputs, device, g)
    name, halves = halves_call()
    impls = {"halves": halves, "cat": cat_call}

    # the same bits, once
    outs = {}
    for impl, fn in impls.items():
        x, scores, ids, dy = inputs[0]
        for p in params:
            p.grad = None
        x.grad = scores.grad = None
        y = fn(x, scores, ids, *params)
        y.backward(dy)
        outs[impl] = [y.detach(), x.grad, scores.grad] + [p.grad for p in params]
    same = all(torch.equal(a, b) for a, b in zip(outs["halves"], outs["cat"]))
    moefuse.check_device_errors()
    print(f"# {torch.cuda.get_device_name()}, halves = {name}; same bits: "
          f"{'PASS' if same else 'FAIL'}")

    for backward in (False, True):
        times = {impl: [] for impl in impls}
        for rep in range(args.warmup + args.reps):
            order = list(impls) if rep % 2 == 0 else list(impls)[::-1]  # interleaved
            for impl in order:
                ms = timed(impls[impl], params, inputs[rep % len(inputs)], backward)
                if rep >= args.warmup:
                    times[impl].append(ms)
        med = {impl: statistics.median(v) for impl, v in times.items()}
        what = "fwd+bwd" if backward else "fwd"
        print(f"{args.model:<16} T={T:<6} {what:<8} halves {med['halves']:8.3f} ms  "
              f"cat {med['cat']:8.3f} ms  saved {med['cat'] - med['halves']:7.3f} ms "
              f"({100 * (med['cat'] - med['halves']) / med['cat']:4.1f}%)")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
