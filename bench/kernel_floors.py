"""Where the layer's time goes: each kernel of one forward + backward against its floor.

For each model at --tokens, the training call of bench/profile_step.py (moefuse.experts and
torch.autograd.grad, FP8 weights cached as within an optimizer step) is profiled in bf16
and in FP8, cool (after 2 s idle), --calls calls each. Every kernel is named by its role
and given a floor: the larger of its FLOPs' time at the dense matmul peak of its precision
(torch.matmul bf16, torch._scaled_mm e4m3, 8192^3, the best of short bursts after rest)
and its bytes' time at the copy rate of HBM (torch copy_ of 1 GiB, read + write counted),
both measured in the same run. The bytes count each operand read or written once: a
gathered pass reads each token's row once, though it reaches it K times; a GEMM's
operands once, though its tiles re-read them through L2.
Routed rows = T K (the padding of each expert's rows to 128 left out); FP8 rows and
token tiles are 1 byte an element plus one fp32 scale per 128. Kernels outside the roles
below (the plan, checks) are listed with their time and no floor. `floor / time` is the
fraction of its floor's rate a kernel reaches.

    python bench/kernel_floors.py [--models qwen3-30b-a3b qwen3-235b-a22b] [--tokens 16384]
                                  [--calls 12] [--markdown FILE]

Runs only on a CUDA device; without one it prints SKIP and the reason and exits 0.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch_moe_baseline as baseline  # noqa: E402

FP8_ROW_BYTES = 1 + 4 / 128   # an e4m3 code and its share of the fp32 scale per 128


def roles(shape: dict, tokens: int, precision: str):
    """[(kernel name regex, role, FLOPs, bytes)] of one forward + backward call with the
    profile's defaults (bf16 weights and weight gradients; bf16 saves the dispatched x
    rows and [g | u], FP8 [g | u] only)."""
    t, h, i, k, e = (tokens, shape["hidden"], shape["intermediate"], shape["top_k"],
                     shape["num_experts"])
    r = t * k
    fp8 = precision == "fp8"
    row = FP8_ROW_BYTES if fp8 else 2           # a GEMM's row or token-tile operand
    w = 1 + 4 / (128 * 128) if fp8 else 2       # a weight and its block scale
    q = FP8_ROW_BYTES
    return [
        # x rows and W13 in, act and the saved [g | u] out (bf16)
        (r"^sm90_gemm1_swiglu_fwd", "gemm1 (x W13, SwiGLU)", 4 * r * h * i,
         r * h * row + e * 2 * i * h * w + r * i * 2 + r * 2 * i * 2),
        # act rows and W2 in, y's slot rows out
        (r"^sm90_gemm2_combine_fwd", "gemm2 (a W2)", 2 * r * i * h,
         r * i * row + e * h * i * w + r * h * 2),
        # dy rows, W2^T and [g | u] in; [dg | du] and a (FP8) or p a (bf16) out
        (r"^sm90_gemm2_dgrad_swiglu_bwd", "dgrad2 (dy W2^T, SwiGLU backward)", 2 * r * h * i,
         r * h * row + e * h * i * w + r * 2 * i * 2 + r * 2 * i * 2 + r * i * 2),
        # [dg | du] rows and W13^T in, dx's slot rows out
        (r"^sm90_gemm1_dgrad_bwd", "dgrad1 ([dg; du] W13^T)", 4 * r * i * h,
         r * 2 * i * row + e * 2 * i * h * w + r * h * 2),
        # the four token operands in, dW2 and dW13 out (bf16)
        (r"^sm90_wgrad_grouped", "dW2 + dW13", 6 * r * h * i,
         r * (h + i + 2 * i + h) * row + e * 3 * h * i * 2),
        # x forward, dy backward: each token read once, written to its K rows
        (r"^dispatch_rows_kernel", "dispatch x, dy (2)", 0, 2 * (t * h * 2 + r * h * row)),
        # y forward, dx backward: the K rows read, the token written
        (r"^reduce_slots_kernel", "reduce y, dx (2)", 0, 2 * (r * h * 2 + t * h * 2)),
        # FP8: fp8_quantize_tokens_kernel<rows beside, gathered, weighted by p>
        (r"^fp8_quantize_rows_kernel", "a rows (gemm2)", 0, r * i * (2 + q)),
        (r"^fp8_quantize_tokens_kernel<false, false, false>", "a tokens (dW2)", 0,
         r * i * (2 + q)),
        (r"^fp8_quantize_tokens_kernel<true, false, false>", "[dg; du] rows + tokens", 0,
         r * 2 * i * (2 + 2 * q)),
        (r"^fp8_quantize_tokens_kernel<false, true, true>", "p dy tokens, gathered (dW2)", 0,
         t * h * 2 + r * h * q),
        (r"^fp8_quantize_tokens_kernel<false, true, false>", "x tokens, gathered (dW13)", 0,
         t * h * 2 + r * h * q),
    ]


def hbm_copy_tb_s() -> float:
    """torch copy_ of 1 GiB, read + write counted: the best of 12, TB/s."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return 2 * src.numel() / (best * 1e-3) / 1e12


def floor_table(model: str, tokens: int, calls: int, peaks: dict, hbm: float) -> str:
    import bench_forward
    import profile_step

    shape = baseline.MODELS[model]
    measured = {}
    for precision in ("bf16", "fp8"):
        fwd_bwd = profile_step.layer_call(model, tokens, precision)
        time.sleep(2.0)
        measured[precision] = profile_step.kernel_times(fwd_bwd, calls)
        del fwd_bwd
        torch.cuda.empty_cache()

    def floor_us(flop: float, nbytes: float, precision: str) -> tuple[float, str]:
        """The larger of the FLOPs' and the bytes' time, and which it is."""
        flop_us = flop / (peaks[precision] * 1e12) * 1e6
        bytes_us = nbytes / (hbm * 1e12) * 1e6
        return (flop_us, "FLOPs") if flop_us >= bytes_us else (bytes_us, "bytes")

    work = {p: {pat: (f, b) for pat, _, f, b in roles(shape, tokens, p)} for p in measured}
    rows, totals = [], {p: [0.0, 0.0] for p in measured}
    named = {p: set() for p in measured}
    for pattern, role, _, _ in roles(shape, tokens, "bf16"):
        cells = [role]
        for precision in ("bf16", "fp8"):
            flop, nbytes = work[precision][pattern]
            kernels = [n for n in measured[precision][1] if re.search(pattern, n)]
            named[precision].update(kernels)
            if not kernels:
                cells += ["-", "-", "-"]
                continue
            us = sum(measured[precision][1][n] for n in kernels)
            fl, bound = floor_us(flop, nbytes, precision)
            totals[precision][0] += us
            totals[precision][1] += fl
            cells += [f"{us:.1f}", f"{fl:.1f} ({bound})", f"{fl / us:.2f}"]
        flop, nbytes = work["fp8"][pattern]
        cells.append((f"{flop / 1e12:.3f} TFLOP, " if flop else "") + f"{nbytes / 1e9:.3f} GB")
        rows.append(cells)
    others = {}
    for precision in ("bf16", "fp8"):
        for name, us in measured[precision][1].items():
            if name not in named[precision]:
                others.setdefault(name, {})[precision] = us
                totals[precision][0] += us
    for name, times in sorted(others.items(), key=lambda kv: -max(kv[1].values())):
        cells = [f"other: `{name[:48]}`"]
        for precision in ("bf16", "fp8"):
            cells += [f"{times[precision]:.1f}" if precision in times else "-", "-", "-"]
        rows.append(cells + ["no floor"])
    sums = ["kernels summed"]
    for precision in ("bf16", "fp8"):
        us, fl = totals[precision]
        sums += [f"{us:.1f}", f"{fl:.1f}", f"{fl / us:.2f}"]
    rows.append(sums + [f"events: bf16 {measured['bf16'][0]:.3f} ms, "
                        f"fp8 {measured['fp8'][0]:.3f} ms per call"])
    columns = ["kernel", "bf16 us", "bf16 floor us", "bf16 floor/time", "fp8 us",
               "fp8 floor us", "fp8 floor/time", "FP8 work"]
    notes = [f"{torch.cuda.get_device_name()}; {model}, T = {tokens}, forward + backward, "
             f"cool, {calls} calls; floors at bf16 {peaks['bf16']:.1f} and FP8 "
             f"{peaks['fp8']:.1f} TFLOP/s (dense 8192^3, measured in this run) and HBM "
             f"{hbm:.2f} TB/s (copy_, read + write); bench/kernel_floors.py says what each "
             "floor counts."]
    return bench_forward.markdown_table(
        f"kernel_floors.py: where the time goes, {model}, T = {tokens}", notes, rows,
        columns)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=sorted(baseline.MODELS),
                        choices=sorted(baseline.MODELS))
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--calls", type=int, default=12)
    parser.add_argument("--markdown", type=pathlib.Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("SKIP kernel_floors: no CUDA device (torch.cuda.is_available() is False)")
        return

    import bench_forward
    import fp8_peak

    peaks = {"bf16": bench_forward.measure_cold_peak_tflops(20, bench_forward.PeakMatmul()),
             "fp8": bench_forward.measure_cold_peak_tflops(20, fp8_peak.Fp8PeakMatmul())}
    hbm = hbm_copy_tb_s()
    tables = [floor_table(model, args.tokens, args.calls, peaks, hbm) for model in args.models]
    text = "\n".join(tables)
    print(text)
    if args.markdown:
        args.markdown.write_text(text)


if __name__ == "__main__":
    main()
