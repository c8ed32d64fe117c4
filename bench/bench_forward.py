"""moefuse vs the PyTorch baseline (bench/torch_moe_baseline.py), timed in the same run.

One line per case (qwen3-30b-a3b and qwen3-235b-a22b, T in {4096, 16384}, bf16):

    model, T, precision, moefuse fwd ms, TFLOP/s (6*T*K*H*I), % of the bf16 matmul
    peak, baseline fwd ms, x baseline (baseline ms / moefuse ms), then the same for
    forward+backward (3x the FLOPs) where the library has a backward on this device,
    'n/a' where it does not (never a made-up number), the matmul's rate among the case's
    samples, and the relative difference of moefuse's y from the baseline's.

Timing: CUDA events around each call, warm-up first, median of --reps (>= 20) calls,
inputs rotating over several random sets (never zeros) so no call reads the previous
call's tokens from L2. With --queue N (default 1) each sample is N calls issued back to
back between the two events, and the time per call is the sample / N: the host then
runs ahead of the GPU as in a training loop, so the Python and launch time of a call
(about 0.3 ms for moefuse's forward, more for the baseline's many small ops) overlaps
the previous call's kernels instead of showing as idle GPU time. --queue 1 measures
what one isolated, synchronized call costs, host included. Both sides time the training
forward (inputs require grad, so moefuse writes its saved buffer and the baseline
records its graph).

The clocks. Under seconds of this load an H200 reaches its power limit (~700 W) and
lowers its SM clock from 1980 MHz to 1300-1500 MHz, so when and after what a variant
runs moves its time by 10-20% (docs/decisions/0013-power-limit-timing). Two ways to
time, both fair:
  default      the case's samples take turns (moefuse fwd, baseline fwd, baseline
               fwd+bwd, the peak's matmul, moefuse fwd+bwd, and again): no variant runs
               systematically later, or hotter, than another;
  --sustained  each variant runs alone for SUSTAIN_S seconds before its samples, which
               follow back to back: the rate of a long run at the power limit. Dense
               code pays most there: moefuse's fwd+bwd ran ~10% slower than interleaved,
               the baseline's about the same.

The peak: torch.matmul of two random 8192 x 8192 bf16 matrices, median of CUDA-event
timings, 2 * 8192^3 FLOPs, timed cold before the first case (the header's figure: the
best of three bursts, each after a second idle, so that what ran before the script does
not lower it) and
with each case's samples (peak_tf: interleaved, or sustained like them). %peak is
against the faster of the two, so a matmul slowed by the power limit never flatters a
case.

Runs only on a CUDA device; without one it prints SKIP and the reason and exits 0.

    python bench/bench_forward.py [--reps 20] [--queue 1] [--sustained] [--models ...]
                                  [--tokens 4096 16384] [--markdown FILE]

--markdown FILE also writes the run's table as markdown (a title line, the device and the
peak, one row per case) to FILE; tools/run_bench.sh assembles bench/RESULTS.md from them.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "python"))  # the checkout's package, when not installed

import torch_moe_baseline as baseline  # noqa: E402

NUM_INPUT_SETS = 4  # x of qwen3-235b at T=16384 is 128 MiB; four sets pass L2 many times over
SUSTAIN_S = 3.0     # --sustained: seconds of a variant alone before its samples
COLD_PEAK_BURSTS = 3    # the cold peak: the best of this many bursts ...
COLD_PEAK_REST_S = 1.0  # ... each after this long idle


def skip(reason: str) -> None:
    print(f"SKIP bench_forward: {reason}")
    sys.exit(0)


def time_cuda_ms(fn, num_sets: int, warmup: int, reps: int, queue: int = 1) -> float:
    """Median ms per call of fn(i % num_sets) over reps samples, each `queue` calls issued
    back to back between two CUDA events (the sample's time / queue)."""
    return time_interleaved_ms([fn], num_sets, warmup, reps, queue)[0]


def time_interleaved_ms(fns, num_sets: int, warmup: int, reps: int,
                        queue: int = 1) -> list[float]:
    """Median ms per call of each fn, as time_cuda_ms, their samples taken in turn (one
    sample of fn 0, one of fn 1, ..., reps rounds): no fn runs systematically later, at
    lower clocks, than another."""
    for fn in fns:
        for i in range(warmup):
            fn(i % num_sets)
    torch.cuda.synchronize()
    times = [[] for _ in fns]
    call = 0
    for _ in range(reps):
        for fn, samples in zip(fns, times):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for q in range(queue):
                fn((call + q) % num_sets)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / queue)
        call += queue
    return [statistics.median(t) for t in times]


def time_sustained_ms(fns, num_sets: int, warmup: int, reps: int,
                      queue: int = 1) -> list[float]:
    """time_cuda_ms of each fn after SUSTAIN_S seconds of it alone (the clocks settled
    at the power limit); those seconds are its warm-up, so `warmup` is not used."""
    out = []
    for fn in fns:
        t0, i = time.monotonic(), 0
        while time.monotonic() - t0 < SUSTAIN_S:
            fn(i % num_sets)
            i += 1
            if i % 8 == 0:
                torch.cuda.synchronize()   # bounds the host's lead over the GPU
        out.append(time_cuda_ms(fn, num_sets, 0, reps, queue))
    return out


PEAK_N = 8192


class PeakMatmul:
    """The peak's product: fn(_) runs one, tflops(ms) converts its time."""

    def __init__(self):
        self.a = torch.randn(PEAK_N, PEAK_N, device="cuda", dtype=torch.bfloat16)
        self.b = torch.randn(PEAK_N, PEAK_N, device="cuda", dtype=torch.bfloat16)

    def __call__(self, _):
        torch.matmul(self.a, self.b)

    @staticmethod
    def tflops(ms: float) -> float:
        return 2 * PEAK_N ** 3 / ms / 1e9


def measure_bf16_peak_tflops(reps: int, peak: PeakMatmul) -> float:
    """The best of COLD_PEAK_BURSTS short bursts, each after COLD_PEAK_REST_S seconds idle.

    A single burst right after other work reads low: the clocks have not recovered from
    what ran before the script (docs/decisions/0013-power-limit-timing).
    """
    best = 0.0
    for _ in range(COLD_PEAK_BURSTS):
        time.sleep(COLD_PEAK_REST_S)
        ms = time_cuda_ms(peak, 1, warmup=5, reps=max(reps, 20))
        best = max(best, PeakMatmul.tflops(ms))
    return best


MARKDOWN_COLUMNS = ["model", "T", "prec", "fwd ms", "fwd TFLOP/s", "fwd %peak", "base fwd ms",
                    "fwd x base", "fwd+bwd ms", "fwd+bwd TFLOP/s", "fwd+bwd %peak",
                    "base fwd+bwd ms", "fwd+bwd x base", "peak_tf", "rel_diff_y"]


def markdown_table(title: str, notes: list[str], rows: list[list[str]]) -> str:
    """A markdown section: '### title', the note lines, then a table of MARKDOWN_COLUMNS."""
    out = [f"### {title}", ""] + notes + [""]
    out.append("| " + " | ".join(MARKDOWN_COLUMNS) + " |")
    out.append("|" + "---|" * len(MARKDOWN_COLUMNS))
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(out) + "\n"


def run_case(moefuse, model: str, T: int, cold_peak: float, peak_matmul: PeakMatmul,
             has_backward: bool, args) -> tuple[str, list[str]]:
    """Times one (model, T) case; returns its line and its cells (MARKDOWN_COLUMNS)."""
    shape = baseline.MODELS[model]
    device = torch.device("cuda")
    inputs, w13, w2 = baseline.make_problem_sets(T, shape, device, NUM_INPUT_SETS)
    flops = 6 * T * shape["top_k"] * shape["hidden"] * shape["intermediate"]

    def moefuse_fwd(i):
        x, ids, p, _ = inputs[i]
        return moefuse.experts(x, ids, p, w13, w2)

    def baseline_fwd(i):
        x, ids, p, _ = inputs[i]
        return baseline.experts_torch(x, ids, p, w13, w2)

    # torch.autograd.grad, not backward: accumulating into .grad would add a
    # pass over every weight gradient (GBs) to each timed call.
    def moefuse_fwd_bwd(i):
        x, _, p, dy = inputs[i]
        torch.autograd.grad(moefuse_fwd(i), (x, p, w13, w2), dy)

    def baseline_fwd_bwd(i):
        x, _, p, dy = inputs[i]
        torch.autograd.grad(baseline_fwd(i), (x, p, w13, w2), dy)

    y_m = moefuse_fwd(0)
    moefuse.check_device_errors()
    y_b = baseline_fwd(0)
    rel_diff = ((y_m.float() - y_b.float()).norm() / y_b.float().norm()).item()
    del y_m, y_b

    fns = [moefuse_fwd, baseline_fwd, baseline_fwd_bwd, peak_matmul]
    if has_backward:
        fns.append(moefuse_fwd_bwd)
    timing = time_sustained_ms if args.sustained else time_interleaved_ms
    ms = timing(fns, NUM_INPUT_SETS, args.warmup, args.reps, args.queue)
    m_fwd, b_fwd, b_fb, peak = ms[0], ms[1], ms[2], PeakMatmul.tflops(ms[3])

    best_peak = max(peak, cold_peak)

    def percent(tflops):
        return f"{100 * tflops / best_peak:5.1f}"

    tflops = flops / m_fwd / 1e9
    line = (f"{model:<17} {T:<6} bf16  {m_fwd:14.3f}  {tflops:7.1f}  {percent(tflops)}  "
            f"{b_fwd:11.3f}  {b_fwd / m_fwd:6.2f} | ")
    cells = [model, str(T), "bf16", f"{m_fwd:.3f}", f"{tflops:.1f}", percent(tflops).strip(),
             f"{b_fwd:.3f}", f"{b_fwd / m_fwd:.2f}"]
    if has_backward:
        m_fb = ms[4]
        tf_fb = 3 * flops / m_fb / 1e9
        line += (f"{m_fb:17.3f}  {tf_fb:7.1f}  {percent(tf_fb)}  "
                 f"{b_fb:14.3f}  {b_fb / m_fb:6.2f} | ")
        cells += [f"{m_fb:.3f}", f"{tf_fb:.1f}", percent(tf_fb).strip(), f"{b_fb:.3f}",
                  f"{b_fb / m_fb:.2f}"]
    else:
        line += f"{'n/a':>17}  {'n/a':>7}  {'n/a':>5}  {b_fb:14.3f}  {'n/a':>6} | "
        cells += ["n/a", "n/a", "n/a", f"{b_fb:.3f}", "n/a"]
    line += f"{peak:6.1f} | "
    line += f"{rel_diff:.2e}"
    cells += [f"{peak:.1f}", f"{rel_diff:.2e}"]
    return line, cells


def main() -> None:
    parser = argparse.ArgumentParser(description="moefuse forward (and backward) vs the "
                                     "PyTorch baseline, one line per case")
    parser.add_argument("--models", nargs="+", default=list(baseline.MODELS),
                        choices=list(baseline.MODELS))
    parser.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--queue", type=int, default=1,
                        help="calls issued back to back per timed sample (1: each call "
                        "alone and synchronized, host time included)")
    parser.add_argument("--sustained", action="store_true",
                        help=f"time each variant after {SUSTAIN_S:.0f} s of it alone, "
                        "samples back to back (default: the variants' samples interleaved)")
    parser.add_argument("--markdown", metavar="FILE",
                        help="also write the table as markdown to FILE (for bench/RESULTS.md)")
    args = parser.parse_args()
    if args.reps < 20:
        parser.error("--reps must be >= 20 (medians of fewer calls are noise)")
    if args.queue < 1:
        parser.error("--queue must be >= 1")

    if not torch.cuda.is_available():
        skip("no CUDA device (torch.cuda.is_available() is False)")
    import moefuse

    try:
        moefuse._lib.load()
    except moefuse.LibraryNotFoundError as err:
        skip(f"libmoefuse not loadable: {err}")
    device = torch.device("cuda")
    try:
        probe = baseline.make_problem(64, 256, 128, 8, 2, device=device, requires_grad=False)
        moefuse.experts(*probe[:5])
        moefuse.check_device_errors()
    except moefuse.MoefuseError as err:
        skip(f"the library's CUDA forward does not run here: {err}")

    name = torch.cuda.get_device_name(device)
    bwd_reason = moefuse.backward_unsupported_reason(device)
    peak_matmul = PeakMatmul()
    cold_peak = measure_bf16_peak_tflops(args.reps, peak_matmul)
    gm = baseline.grouped_mm_reason(device)
    timing = (("each call alone, synchronized" if args.queue == 1 else
               f"{args.queue} calls queued back to back per sample") +
              ("; each variant sustained (%.0f s alone first), peak_tf likewise" % SUSTAIN_S
               if args.sustained else "; samples interleaved with the matmul's (peak_tf)"))
    baseline_name = "torch._grouped_mm" if gm is None else "per-expert loop: " + gm
    print(f"# device {name}; bf16 matmul peak cold {cold_peak:.1f} TFLOP/s (8192^3, best of "
          f"{COLD_PEAK_BURSTS} medians of {max(args.reps, 20)}, each after "
          f"{COLD_PEAK_REST_S:.0f} s idle); library {moefuse.library_path()}")
    print(f"# baseline: {baseline_name}; "
          f"moefuse backward: {'yes' if bwd_reason is None else 'n/a (' + bwd_reason + ')'}; "
          f"timing: " + timing + "; %peak against the faster of peak_tf and the cold peak")
    print("# model            T      prec  moefuse_fwd_ms  TFLOP/s  %peak  base_fwd_ms  "
          "x_base | moefuse_fwdbwd_ms  TFLOP/s  %peak  base_fwdbwd_ms  x_base | "
          "peak_tf | rel_diff_y")

    rows = []
    for model in args.models:
        for T in args.tokens:
            line, cells = run_case(moefuse, model, T, cold_peak, peak_matmul,
                                   bwd_reason is None, args)
            print(line, flush=True)
            rows.append(cells)
            torch.cuda.empty_cache()
    if args.markdown:
        title = "bench_forward.py: " + ("sustained at the power limit" if args.sustained else
                                        "each call alone, synchronized" if args.queue == 1
                                        else f"{args.queue} calls queued, interleaved")
        notes = [f"{name}; timing: {timing}; bf16 matmul peak cold {cold_peak:.1f} TFLOP/s; "
                 f"%peak against the faster of peak_tf and the cold peak; baseline: "
                 f"{baseline_name} (TorchTitan-style); ms per call, CUDA events, median of "
                 f"{args.reps}."]
        pathlib.Path(args.markdown).write_text(markdown_table(title, notes, rows))


if __name__ == "__main__":
    main()
