"""The dense FP8 matmul peak of this GPU, measured: torch._scaled_mm on 8192^3 e4m3
operands with tensorwise fp32 scales, bf16 out; CUDA events, median of 20 after 5 warm-ups.
Prints the TFLOP/s (one number) for bench_precision_cuda's "% of peak" column, or nothing
where torch, CUDA or _scaled_mm is missing."""
import sys

try:
    import torch
except ImportError:
    sys.exit(0)


def main() -> None:
    if not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # column-major
    one = torch.ones((), device="cuda")
    times = []
    for i in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        end.record()
        end.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end))
    times.sort()
    ms = 0.5 * (times[9] + times[10])
    print(f"{2 * n ** 3 / (ms * 1e-3) / 1e12:.1f}")


if __name__ == "__main__":
    main()
