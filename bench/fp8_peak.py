"""The dense FP8 matmul peak of this GPU, measured: torch._scaled_mm on 8192^3 e4m3
operands with tensorwise fp32 scales, bf16 out; CUDA events, median of 20 after 5 warm-ups.
Prints the TFLOP/s (one number) for bench_precision_cuda's "% of peak" column, or nothing
where torch, CUDA or _scaled_mm is missing. Fp8PeakMatmul is the product, for
bench_forward.py to time beside its cases."""
import sys

try:
    import torch
except ImportError:
    sys.exit(0)

N = 8192


class Fp8PeakMatmul:
    """The peak's product: fn(_) runs one, tflops(ms) converts its time."""

    def __init__(self):
        self.a = torch.randn(N, N, device="cuda").to(torch.float8_e4m3fn)
        self.b = torch.randn(N, N, device="cuda").to(torch.float8_e4m3fn).t()  # column-major
        self.one = torch.ones((), device="cuda")

    def __call__(self, _=None):
        torch._scaled_mm(self.a, self.b, scale_a=self.one, scale_b=self.one,
                         out_dtype=torch.bfloat16)

    @staticmethod
    def tflops(ms: float) -> float:
        return 2 * N ** 3 / (ms * 1e-3) / 1e12


def main() -> None:
    if not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return
    peak = Fp8PeakMatmul()
    times = []
    for i in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        peak()
        end.record()
        end.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end))
    times.sort()
    ms = 0.5 * (times[9] + times[10])
    print(f"{Fp8PeakMatmul.tflops(ms):.1f}")


if __name__ == "__main__":
    main()
