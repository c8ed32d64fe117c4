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

--precision fp8 (opt-in; `--precision bf16 fp8` prints both tables) times, per case and
with the same timing, moefuse in FP8 (precision="fp8") and in bf16 against the FP8 peer,
torchao's FP8 rowwise MoE recipe on the TorchTitan-style MoE (bench/torch_moe_fp8_baseline.py):
one row each with fwd, bwd (fwd+bwd - fwd), fwd+bwd ms, TFLOP/s, % of the dense FP8 peak
(bench/fp8_peak.py's product, cold and among the samples as above), x moefuse bf16 and x the
peer (their fwd+bwd ms / the row's), moefuse FP8's fwd+bwd with its weights quantized in
the call (the peer quantizes them in every call; moefuse once per optimizer step), and the
relative L2 error of y and dx against fp64 on the model's shape at T = ERROR_TOKENS. Where
the binding refuses FP8 on CUDA (Fp8UnsupportedError) the table says so and has the peer's
and moefuse bf16's rows only.

Runs only on a CUDA device; without one it prints SKIP and the reason and exits 0.

    python bench/bench_forward.py [--reps 20] [--queue 1] [--sustained] [--models ...]
                                  [--tokens 4096 16384] [--precision bf16 fp8]
                                  [--markdown FILE]

--markdown FILE also writes the run's tables as markdown (a title line, the device and the
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

import fp8_peak  # noqa: E402
import torch_moe_baseline as baseline  # noqa: E402
import torch_moe_fp8_baseline as fp8_peer  # noqa: E402

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


def measure_cold_peak_tflops(reps: int, peak) -> float:
    """The best of COLD_PEAK_BURSTS short bursts of peak (PeakMatmul or
    fp8_peak.Fp8PeakMatmul), each after COLD_PEAK_REST_S seconds idle.

    A single burst right after other work reads low: the clocks have not recovered from
    what ran before the script (docs/decisions/0013-power-limit-timing).
    """
    best = 0.0
    for _ in range(COLD_PEAK_BURSTS):
        time.sleep(COLD_PEAK_REST_S)
        ms = time_cuda_ms(peak, 1, warmup=5, reps=max(reps, 20))
        best = max(best, peak.tflops(ms))
    return best


MARKDOWN_COLUMNS = ["model", "T", "prec", "fwd ms", "fwd TFLOP/s", "fwd %peak", "base fwd ms",
                    "fwd x base", "fwd+bwd ms", "fwd+bwd TFLOP/s", "fwd+bwd %peak",
                    "base fwd+bwd ms", "fwd+bwd x base", "peak_tf", "rel_diff_y"]


def markdown_table(title: str, notes: list[str], rows: list[list[str]],
                   columns: list[str] = MARKDOWN_COLUMNS) -> str:
    """A markdown section: '### title', the note lines, then a table of `columns`."""
    out = [f"### {title}", ""] + notes + [""]
    out.append("| " + " | ".join(columns) + " |")
    out.append("|" + "---|" * len(columns))
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


# ---- --precision fp8: moefuse FP8 and the FP8 peer ------------------------------------------

ERROR_TOKENS = 1024  # the error columns' case: the model's shape at this T
FP8_COLUMNS = ["model", "T", "impl", "fwd ms", "bwd ms", "fwd+bwd ms", "fwd TFLOP/s",
               "fwd+bwd TFLOP/s", "fwd+bwd %fp8 peak", "x moefuse bf16", "x fp8 peer",
               "fwd+bwd+wq ms", "rel_err_y", "rel_err_dx", "fp8 peak_tf"]
FP8_WIDTHS = [max(len(h), 6) for h in FP8_COLUMNS[3:]]  # the printed columns after impl


def reference_y_dx(x, ids, p, w13, w2, dy):
    """fp64 y and dx of the routed experts at the given values, one expert at a time (only
    that expert's weights in fp64 at once)."""
    y = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    dx = torch.zeros_like(y)
    for e in torch.unique(ids[ids >= 0]).tolist():
        tok, slot = torch.where(ids == e)
        xe = x[tok].double().requires_grad_()
        o = (baseline.swiglu_linear(xe, w13[e].double(), w2[e].double())
             * p[tok, slot].double().unsqueeze(1))
        dx.index_add_(0, tok, torch.autograd.grad(o, xe, dy[tok].double())[0])
        y.index_add_(0, tok, o.detach())
    return y, dx


def recipe_errors(impls: dict, shape: dict, device: torch.device) -> dict:
    """{name: (relative L2 error of y, of dx)} of each impl against fp64, on the model's
    shape at T = ERROR_TOKENS."""
    x, ids, p, w13, w2, dy = baseline.make_problem(ERROR_TOKENS, **shape, device=device,
                                                   seed=100)
    y_ref, dx_ref = reference_y_dx(*(t.detach() for t in (x, ids, p, w13, w2, dy)))

    def rel(got, ref):
        return ((got.double() - ref).norm() / ref.norm()).item()

    errors = {}
    for name, fn in impls.items():
        y = fn(x, ids, p, w13, w2)
        errors[name] = (rel(y, y_ref), rel(torch.autograd.grad(y, x, dy)[0], dx_ref))
    return errors


def fp8_impls(moefuse, fp8_runs: bool) -> dict:
    """The fp8 table's implementations, by row name: experts(x, ids, p, w13, w2)."""
    impls = {"moefuse bf16": moefuse.experts, "fp8 peer": fp8_peer.experts_fp8}
    if fp8_runs:
        impls = {"moefuse fp8": lambda *a: moefuse.experts(*a, precision="fp8"), **impls}
    return impls


def run_fp8_case(moefuse, model: str, T: int, cold_peak: float, peak, impls: dict,
                 errors: dict, args, device: torch.device
                 ) -> tuple[list[str], list[list[str]]]:
    """Times one (model, T) case of the fp8 table; returns its lines and rows (FP8_COLUMNS)."""
    shape = baseline.MODELS[model]
    inputs, w13, w2 = baseline.make_problem_sets(T, shape, device, NUM_INPUT_SETS)
    flops = 6 * T * shape["top_k"] * shape["hidden"] * shape["intermediate"]

    def fwd(fn):
        return lambda i: fn(*inputs[i][:3], w13, w2)

    def fwd_bwd(fn):  # autograd.grad, not backward (see run_case)
        def call(i):
            x, _, p, dy = inputs[i]
            torch.autograd.grad(fn(x, inputs[i][1], p, w13, w2), (x, p, w13, w2), dy)
        return call

    fns = [f for fn in impls.values() for f in (fwd(fn), fwd_bwd(fn))]
    # moefuse quantizes the weights once per optimizer step (its weight cache): the timed
    # calls reuse one quantization; this variant pays it in every call, as the peer does.
    fp8_cache = getattr(moefuse.layer_cache, "fp8", None)
    requantize = "moefuse fp8" in impls and fp8_cache is not None
    if requantize:
        fb = fwd_bwd(impls["moefuse fp8"])

        def fwd_bwd_requantized(i):
            fp8_cache.clear()
            fb(i)
        fns.append(fwd_bwd_requantized)
    fns.append(peak)
    timing = time_sustained_ms if args.sustained else time_interleaved_ms
    ms = timing(fns, NUM_INPUT_SETS, args.warmup, args.reps, args.queue)
    peak_tf = peak.tflops(ms[-1])
    best_peak = max(peak_tf, cold_peak)
    times = {name: (ms[2 * k], ms[2 * k + 1]) for k, name in enumerate(impls)}
    lines, rows = [], []
    for name, (f, fb) in times.items():
        tf, tf_fb = flops / f / 1e9, 3 * flops / fb / 1e9
        wq = f"{ms[2 * len(impls)]:.3f}" if requantize and name == "moefuse fp8" else "n/a"
        ratio = [f"{times[ref][1] / fb:.2f}" for ref in ("moefuse bf16", "fp8 peer")]
        err = errors.get(name)
        cells = [model, str(T), name, f"{f:.3f}", f"{fb - f:.3f}", f"{fb:.3f}", f"{tf:.1f}",
                 f"{tf_fb:.1f}", f"{100 * tf_fb / best_peak:.1f}", *ratio, wq,
                 *([f"{e:.2e}" for e in err] if err else ["n/a", "n/a"]), f"{peak_tf:.1f}"]
        rows.append(cells)
        lines.append(f"{model:<17} {T:<6} {name:<13} " + "  ".join(
            f"{c:>{w}}" for c, w in zip(cells[3:], FP8_WIDTHS)))
    return lines, rows


def fp8_table(moefuse, args, name: str) -> str:
    """--precision fp8: prints the table of moefuse FP8, moefuse bf16 and the FP8 peer; returns
    it as markdown ('' when the peer cannot run)."""
    device = torch.device("cuda")
    reason = fp8_peer.scaled_grouped_mm_reason(device)
    probe = baseline.make_problem(256, 256, 128, 8, 2, device=device)
    if reason is None:
        try:
            y = fp8_peer.experts_fp8(*probe[:5])
            torch.autograd.grad(y, (probe[0], probe[2], probe[3], probe[4]), probe[5])
        except RuntimeError as err:  # torch's kernel refusing this GPU, shape or layout
            reason = f"{type(err).__name__}: {err}"
    if reason is not None:
        print(f"SKIP bench_forward --precision fp8: the FP8 peer does not run: {reason}")
        return ""
    try:  # the Python binding may refuse FP8 on CUDA tensors (Fp8UnsupportedError)
        y = moefuse.experts(*probe[:5], precision="fp8")
        torch.autograd.grad(y, (probe[0], probe[2], probe[3], probe[4]), probe[5])
        moefuse.check_device_errors()
        fp8_note = "moefuse fp8: block scales (DeepSeek-V3 recipe) through the PyTorch ops"
        fp8_runs = True
    except moefuse.MoefuseError as err:
        fp8_note = (f"moefuse fp8: NOT RUN, the PyTorch binding refused precision='fp8' on "
                    f"CUDA ({type(err).__name__}: {err}); bench_precision_cuda times it "
                    f"from C; the rows below are moefuse bf16 and the FP8 peer")
        fp8_runs = False
    peak = fp8_peak.Fp8PeakMatmul()
    cold_peak = measure_cold_peak_tflops(args.reps, peak)
    impls = fp8_impls(moefuse, fp8_runs)
    timing = ("each call alone, synchronized" if args.queue == 1 else
              f"{args.queue} calls queued back to back per sample") + (
              "; each variant sustained" if args.sustained else "; samples interleaved")
    notes = [
        f"{name}; timing: {timing}, with the FP8 matmul's (fp8 peak_tf); dense FP8 peak cold "
        f"{cold_peak:.1f} TFLOP/s (torch._scaled_mm 8192^3 e4m3, bench/fp8_peak.py); %fp8 peak "
        f"against the faster of fp8 peak_tf and the cold peak; ms per call, CUDA events, "
        f"median of {args.reps}; bwd = fwd+bwd - fwd; x moefuse bf16 / x fp8 peer: their "
        f"fwd+bwd ms / the row's.",
        f"- {fp8_note}; its weights are quantized once per optimizer step (cached: the timed "
        f"calls reuse one quantization); fwd+bwd+wq: the cache cleared before each call.",
        "- fp8 peer: torchao's FP8 rowwise MoE recipe (forward, dgrad and wgrad on "
        "torch._scaled_grouped_mm, weights quantized in every call) on the TorchTitan-style "
        "MoE (bench/torch_moe_fp8_baseline.py).",
        f"- rel_err: relative L2 error of y and dx against fp64, the model's shape at "
        f"T = {ERROR_TOKENS}."]
    print("# " + "\n# ".join(notes))
    print(f"{'# model':<17} {'T':<6} {'impl':<13} " + "  ".join(
        f"{h.replace(' ', '_'):>{w}}" for h, w in zip(FP8_COLUMNS[3:], FP8_WIDTHS)))
    rows = []
    for model in args.models:
        errors = recipe_errors(impls, baseline.MODELS[model], device)
        for T in args.tokens:
            lines, cells = run_fp8_case(moefuse, model, T, cold_peak, peak, impls, errors,
                                        args, device)
            print("\n".join(lines), flush=True)
            rows += cells
            torch.cuda.empty_cache()
    title = ("bench_forward.py --precision fp8: moefuse FP8 against the FP8 peer "
             "(torchao's rowwise recipe)")
    return markdown_table(title, notes, rows, FP8_COLUMNS)


def bf16_table(moefuse, args, name: str) -> str:
    """The bf16 table (the default): prints it, returns it as markdown."""
    device = torch.device("cuda")
    bwd_reason = moefuse.backward_unsupported_reason(device)
    peak_matmul = PeakMatmul()
    cold_peak = measure_cold_peak_tflops(args.reps, peak_matmul)
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
    title = "bench_forward.py: " + ("sustained at the power limit" if args.sustained else
                                    "each call alone, synchronized" if args.queue == 1
                                    else f"{args.queue} calls queued, interleaved")
    notes = [f"{name}; timing: {timing}; bf16 matmul peak cold {cold_peak:.1f} TFLOP/s; "
             f"%peak against the faster of peak_tf and the cold peak; baseline: "
             f"{baseline_name} (TorchTitan-style); ms per call, CUDA events, median of "
             f"{args.reps}."]
    return markdown_table(title, notes, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description="moefuse forward (and backward) vs the "
                                     "PyTorch baseline, one line per case")
    parser.add_argument("--models", nargs="+", default=list(baseline.MODELS),
                        choices=list(baseline.MODELS))
    parser.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384])
    parser.add_argument("--precision", nargs="+", default=["bf16"], choices=["bf16", "fp8"],
                        help="bf16: moefuse against the TorchTitan-style MoE (the default); "
                        "fp8: moefuse FP8 and bf16 against the FP8 peer")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--queue", type=int, default=1,
                        help="calls issued back to back per timed sample (1: each call "
                        "alone and synchronized, host time included)")
    parser.add_argument("--sustained", action="store_true",
                        help=f"time each variant after {SUSTAIN_S:.0f} s of it alone, "
                        "samples back to back (default: the variants' samples interleaved)")
    parser.add_argument("--markdown", metavar="FILE",
                        help="also write the tables as markdown to FILE (for bench/RESULTS.md)")
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
    tables = {"bf16": bf16_table, "fp8": fp8_table}
    sections = [tables[p](moefuse, args, name) for p in dict.fromkeys(args.precision)]
    if args.markdown:
        pathlib.Path(args.markdown).write_text("\n".join(s for s in sections if s))


if __name__ == "__main__":
    main()
