/* The SwiGLU activation a = silu(g) u, one expression for the forward (gemm1's store
 * warps) and the backward (dgrad2's epilogue), both from bf16-rounded g and u, so the a
 * the backward recomputes is bitwise the a the forward wrote (the CPU backend does the
 * same, src/cpu/backend.c).
 * s = sigmoid(g) = 1 / (1 + e^-g) by one approximate reciprocal (MUFU.RCP, within 1 ulp
 * for a denominator in [1, inf]) instead of an IEEE division: about 10 instructions fewer
 * per element. NOTE: measured on an H200 (qwen3-30b-a3b, 131072 rows), dgrad2 went from
 * 1.135 to 0.933 ms with it. */
#pragma once

#include <stdint.h>

namespace mf {

struct Swiglu {
    float s;      /* sigmoid(g) */
    float silu;   /* g s */
    float a;      /* g s u, fp32 (rounded to bf16 by the caller) */
};

/* The two bf16 of a 4-byte word (low half first, as stored) as floats. */
__device__ __forceinline__ float bf16_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }

/* e^-g as __expf computes it (one MUFU.EX2 of -g log2 e), but flushing a subnormal result
 * to 0: __expf's extra scaling for subnormal results (4 instructions) buys nothing here,
 * since 1 + e^-g rounds to exactly 1 for any e^-g below 2^-24. */
__device__ __forceinline__ float exp_neg_ftz(float g) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(g * -1.44269504088896341f));
    return y;
}

__device__ __forceinline__ Swiglu swiglu(float g, float u) {
    const float s = __fdividef(1.f, 1.f + exp_neg_ftz(g));
    const float silu = g * s;
    return {s, silu, silu * u};
}

}  // namespace mf
