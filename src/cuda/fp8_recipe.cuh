/* The FP8 block recipe on the device (docs/decisions/0018-fp8-block-recipe.md), bit for
 * bit what src/cpu/fp8.c computes: E4M3 encoding rounded on the fp32 bits (nearest, ties
 * to even, saturating at +-448, NaN -> 0x7f), the scale of a tile from its amax, and
 * quantization as encode(x / scale) with an IEEE fp32 division. Two encoders: the CPU's
 * integer algorithm (e4m3_encode) and the hardware's conversion of two values at once
 * (e4m3x2_encode), which the quantizers use: a test compares them on every fp32 input.
 * NOTE: with the integer encoder the row quantizer ran at under 0.9 TB/s (ncu, H200):
 * bound by its instructions, not by memory. Shared by the quantizer kernels (simt/fp8_quant.cu) and any
 * epilogue that quantizes the tile it holds. */
#pragma once

#include <stdint.h>

namespace mf {
namespace fp8 {

constexpr float kE4m3Max = 448.0f;
constexpr uint8_t kE4m3Nan = 0x7f;

__device__ __forceinline__ uint8_t e4m3_encode(float v) {
    const uint32_t u = __float_as_uint(v);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return kE4m3Nan;
    if (a >= 0x43e00000u) return (uint8_t)(sign | 0x7e);   /* >= 448: satfinite */
    if (a >= 0x3c800000u) {                                  /* >= 2^-6: normal */
        const uint32_t r = (a + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
        return (uint8_t)(sign | (r - ((127u - 7u) << 3)));
    }
    /* subnormal E4M3: multiples of 2^-9 */
    const uint32_t exp = a >> 23;
    const uint32_t mant = exp ? (a & 0x7fffffu) | 0x800000u : a;
    const uint32_t shift = exp ? 141u - exp : 140u;
    if (shift >= 25) return sign;
    const uint32_t q = (mant + (1u << (shift - 1)) - 1u + ((mant >> shift) & 1u)) >> shift;
    return (uint8_t)(sign | q);
}

/* |v| folded into a running amax; a NaN anywhere makes the amax NaN (fmaxf would drop it). */
__device__ __forceinline__ float amax_fold(float m, float v) {
    const float a = fabsf(v);
    return (a != a || m != m) ? __int_as_float(0x7fc00000) : fmaxf(m, a);
}

/* A warp's amax over each lane's partial one (every lane gets it). */
__device__ __forceinline__ float warp_amax(float m) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = amax_fold(m, __shfl_xor_sync(0xffffffffu, m, o));
    return m;
}

/* The scale of a tile whose largest magnitude is amax (src/cpu/fp8.c mf_fp8_scale). */
__device__ __forceinline__ float tile_scale(float amax, int pow2) {
    if (!(amax <= 3.402823466e38f)) return __int_as_float(0x7fc00000);   /* NaN or inf */
    if (amax == 0.0f) return 1.0f;
    float s = __fdiv_rn(amax, kE4m3Max);
    if (s < 1.175494351e-38f) s = 1.175494351e-38f;
    if (pow2) {
        /* up to a power of two: keep an exact one, else the next exponent */
        const uint32_t b = __float_as_uint(s);
        if (b & 0x7fffffu) s = __uint_as_float((b & 0x7f800000u) + 0x800000u);
    }
    return s;
}

__device__ __forceinline__ uint8_t quantize(float v, float scale) {
    return e4m3_encode(__fdiv_rn(v, scale));
}

/* Two values encoded by the hardware (cvt.rn.satfinite.e4m3x2.f32: nearest even, +-448 at
 * most, NaN -> 0x7f), lo in the low byte; the same codes as e4m3_encode for every fp32
 * input (tests/kernels/test_fp8_quant.cu checks all 2^32). */
__device__ __forceinline__ uint16_t e4m3x2_encode(float lo, float hi) {
    uint16_t r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

/* Four codes packed little-endian (element i in byte i). */
__device__ __forceinline__ uint32_t quantize4(float a, float b, float c, float d, float scale) {
    return (uint32_t)e4m3x2_encode(__fdiv_rn(a, scale), __fdiv_rn(b, scale)) |
           ((uint32_t)e4m3x2_encode(__fdiv_rn(c, scale), __fdiv_rn(d, scale)) << 16);
}

}  // namespace fp8
}  // namespace mf
