"""Per-kernel GPU time of moefuse's forward + backward, cool and at the power limit.

One Qwen3 MoE layer (bench/torch_moe_baseline.py's shapes and random inputs, four input
sets in turn), the training call of the Python op: moefuse.experts(x, ids, p, w13, w2,
precision=--precision) and torch.autograd.grad over x, p, w13 and w2 (FP8: the weights are
quantized at the first call and cached, as within one optimizer step). torch.profiler
records the CUDA kernels of --calls calls twice:
  cool       after 2 s idle (the SM clock at its maximum);
  sustained  after --sustain-s seconds of back-to-back calls (the clock lowered by the
             power limit, as in bench_forward.py --sustained).
Each prints the time per call between two CUDA events around the calls, the kernels' sum,
and each kernel's time per call, largest first. Watch the clocks beside it with
`nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader -lms 200`.
docs/decisions/0017-ruled-out has its reading of the step's kernels at the power limit.

    python bench/profile_step.py [--model qwen3-30b-a3b] [--tokens 16384] [--calls 12]
                                 [--sustain-s 4] [--precision bf16|fp8]
                                 [--weights bf16|fp32]
                                 [--saved inputs|activations|recompute]

Runs only on a CUDA device; without one it prints SKIP and the reason and exits 0.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import sys
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "python"))  # the checkout's package, when not installed

import torch_moe_baseline as baseline  # noqa: E402

NUM_INPUT_SETS = 4


def kernel_times(fwd_bwd, calls: int) -> tuple[float, dict[str, float]]:
    """torch.profiler over `calls` calls of fwd_bwd(i): (ms per call between two CUDA
    events around them, {kernel name: us per call})."""
    from torch.profiler import ProfilerActivity, profile

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for i in range(calls):
            fwd_bwd(i)
        end.record()
        torch.cuda.synchronize()
    per_kernel = collections.defaultdict(float)   # us over all calls
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            # without the common prefixes, so a template's instances stay apart
            name = ev.name.removeprefix("void ").replace("(anonymous namespace)::", "")
            per_kernel[name[:72]] += ev.device_time_total
    return start.elapsed_time(end) / calls, {k: us / calls for k, us in per_kernel.items()}


def profile_calls(fwd_bwd, label: str, calls: int) -> None:
    event_ms, per_kernel = kernel_times(fwd_bwd, calls)
    print(f"== {label}: {event_ms:.3f} ms per fwd+bwd (events), "
          f"kernels sum {sum(per_kernel.values()) / 1000:.3f} ms")
    for name, us in sorted(per_kernel.items(), key=lambda kv: -kv[1]):
        print(f"  {us:9.1f} us  {name}")


def layer_call(model: str, tokens: int, precision: str, weights: str = "bf16",
               saved: str | None = None):
    """fwd_bwd(i): one training call of the layer on input set i % NUM_INPUT_SETS (the
    weights shared; FP8 quantizes them at the first call and caches them, as within one
    optimizer step), after 8 warm-up calls."""
    import moefuse

    shape = baseline.MODELS[model]
    inputs, w13, w2 = baseline.make_problem_sets(tokens, shape, torch.device("cuda"),
                                                 NUM_INPUT_SETS)
    if weights == "fp32":
        w13, w2 = (w.detach().float().requires_grad_() for w in (w13, w2))

    def fwd_bwd(i: int) -> None:
        x, ids, p, dy = inputs[i % NUM_INPUT_SETS]
        y = moefuse.experts(x, ids, p, w13, w2, precision=precision,
                            save_inputs=None if saved is None else saved == "inputs",
                            recompute=saved == "recompute")
        torch.autograd.grad(y, (x, p, w13, w2), dy)

    for i in range(8):   # warm-up: loading, allocation
        fwd_bwd(i)
    torch.cuda.synchronize()
    return fwd_bwd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(baseline.MODELS))
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--calls", type=int, default=12)
    parser.add_argument("--sustain-s", type=float, default=4.0)
    parser.add_argument("--precision", choices=("bf16", "fp8"), default="bf16")
    parser.add_argument("--weights", choices=("bf16", "fp32"), default="bf16",
                        help="the weights' dtype: bf16 (their gradients written in bf16 by "
                             "the store warps) or fp32 master weights (fp32 gradients: "
                             "drained by the store warps in bf16 precision, stored by the "
                             "consumers in FP8)")
    parser.add_argument("--saved", choices=("inputs", "activations", "recompute"),
                        default=None,
                        help="what the forward keeps: activations and the dispatched inputs "
                             "(save_inputs=True), activations only (FP8: then the dispatch "
                             "quantizes x), or nothing (recompute); by default the op's "
                             "choice for the precision (inputs for bf16, activations for fp8)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("SKIP profile_step: no CUDA device (torch.cuda.is_available() is False)")
        return

    fwd_bwd = layer_call(args.model, args.tokens, args.precision, args.weights, args.saved)
    print(f"# {torch.cuda.get_device_name()}; {args.model}, T = {args.tokens}, "
          f"{args.precision}, {args.weights} weights, saved {args.saved or 'the default'}, "
          f"{args.calls} calls per profile")
    time.sleep(2.0)
    profile_calls(fwd_bwd, "cool (after 2 s idle)", args.calls)
    t0, i = time.monotonic(), 0
    while time.monotonic() - t0 < args.sustain_s:
        fwd_bwd(i)
        i += 1
        if i % 8 == 0:
            torch.cuda.synchronize()   # bounds the host's lead over the GPU
    profile_calls(fwd_bwd, f"sustained (after {args.sustain_s:g} s)", args.calls)


if __name__ == "__main__":
    main()
