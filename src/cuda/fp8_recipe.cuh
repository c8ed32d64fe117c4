/* The FP8 block recipe on the device (docs/decisions/0018-fp8-block-recipe.md), bit for
 * bit what src/cpu/fp8.c computes: E4M3 encoding rounded on the fp32 bits (nearest, ties
 * to even, saturating at +-448, NaN -> 0x7f), the scale of a tile from its amax, and
 * quantization as encode(x / scale) with an IEEE fp32 division (its result computed here
 * without one: quotients()). Two encoders: the CPU's integer algorithm (e4m3_encode) and the
 * hardware's conversion of two values at once (e4m3x2_encode), which the quantizers use:
 * a test compares them on every fp32 input.
 * NOTE: with the integer encoder the row quantizer ran at under 0.9 TB/s (ncu, H200):
 * bound by its instructions, not by memory. Shared by the quantizer kernels
 * (simt/fp8_quant.cu), the dispatch that quantizes the rows it copies
 * (transport/dispatch_rows.cu) and any epilogue that quantizes the tile it holds. */
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

/* rn(x / scale) without a division, from inv = rn(1 / scale) of the tile, for a scale of
 * at least kFastQuotientScale: q1 = rn(x inv) is within about 1.5 ulp of the quotient,
 * r = rn(q1 scale - x) is the exact negated residual (one fma, no underflow for x of at
 * least 2^-100), and fma(r, -inv, q1) corrects q1 (Markstein's step; his theorem asks q1
 * within 1 ulp, so the claim rests on checks, not on it). Where the residual is 0,
 * r (-inv) is -0 and q1 + -0 is q1, its sign too (x = -0: q1 = -0, r = +0). A tiny x
 * (below 2^-100, its residual perhaps inexact) has |x / scale| < 2^-11 under such a
 * scale, under half of e4m3's least subnormal: a zero's code whatever the last bits.
 * Where the quotient is an fp32 subnormal the last bits may differ from div.rn's, far
 * below e4m3's least code (2^-9): the codes agree. NaN scales (a non-finite tile) give
 * NaN, code 0x7f; power-of-two scales the product (r = 0).
 * Checked against the codes of encode(div.rn): every bf16 x under every bf16 amax with
 * such a scale, both scale rules (2.06 G pairs), 600 M random fp32 pairs, 1.3 G pairs
 * near every e4m3 midpoint under 40,000 random scales, built plain and with -mfma; and,
 * with the tiny-x scaling this form replaced, every bf16 x under every bf16 amax (1.07 G
 * pairs), 3.6 G random and near-midpoint fp32 pairs and 33.5 G pairs over every
 * significand of x in two binades against 2000 scale significands: 0 differ.
 * tests/cpu/test_fp8.c and tests/kernels/test_fp8_quant.cu (the device's) keep subsets.
 * Precondition: x / scale finite (a tile's values are within 448 scales); beyond, q1
 * overflows and the result is NaN where the division saturates.
 * NOTE: why not the product where it provably encodes as the quotient and div.rn
 * otherwise: bf16 values land on or near e4m3 rounding points (x / amax a ratio of 8-bit
 * significands), so most warps took the divisions; the figures are in
 * docs/decisions/0023-fp8-quantizer-bandwidth.md. */
__device__ __forceinline__ float quotient_fast(float x, float scale, float inv) {
    const float q = __fmul_rn(x, inv);
    const float r = __fmaf_rn(q, scale, -x);
    return __fmaf_rn(r, -inv, q);   /* not -r: -fma(q, s, -x) may be folded into fma(-q, s, x),
                                     * which loses -0 (gcc -mfma does) */
}

/* The smallest scale quotient_fast takes (see there). A NaN scale fails the test. */
constexpr float kFastQuotientScale = 0x1p-89f;

/* The quotients of N values of one tile (scale, inv = rn(1 / scale)), 3 instructions a
 * value. A tile whose scale is below kFastQuotientScale (an amax under about 2^-80) has
 * its values and scale taken times 2^64 first: exact (powers of two; |x| <= 448 scale, so
 * no overflow, and a nonzero x times 2^64 is at least 2^-85), the same real quotients, and
 * a scale of at least 2^-62 (scales are at least 2^-126), whose reciprocal is inv 2^-64
 * (rn(1 / s) is at most 2^126, rn(2^-64 / s) at least 2^25: both normal). This replaced
 * an 8-instruction form that rescaled tiny x one by one (its registers counted where the
 * code is inlined, though tiles that small are rare: docs/decisions/0023-fp8-quantizer-
 * bandwidth.md). */
template <int N>
__device__ __forceinline__ void quotients(const float (&x)[N], float scale, float inv,
                                          float (&q)[N]) {
    if (scale >= kFastQuotientScale) {
#pragma unroll
        for (int j = 0; j < N; ++j) q[j] = quotient_fast(x[j], scale, inv);
        return;
    }
    const float s = __fmul_rn(scale, 0x1p64f), s_inv = __fmul_rn(inv, 0x1p-64f);
#pragma unroll
    for (int j = 0; j < N; ++j) q[j] = quotient_fast(__fmul_rn(x[j], 0x1p64f), s, s_inv);
}

/* Two values encoded by the hardware (cvt.rn.satfinite.e4m3x2.f32: nearest even, +-448 at
 * most, NaN -> 0x7f), lo in the low byte; the same codes as e4m3_encode for every fp32
 * input (tests/kernels/test_fp8_quant.cu checks all 2^32). */
__device__ __forceinline__ uint16_t e4m3x2_encode(float lo, float hi) {
    uint16_t r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

/* ---- 1 x 128 row tiles held by a half-warp, without a division per element -------------- */

/* bf16 (the high or low half of a 32-bit word) as a float. */
__device__ __forceinline__ float bf16_bits(uint32_t w, int hi) {
    return __uint_as_float(hi ? (w & 0xffff0000u) : (w << 16));
}

/* 4 values' codes, element j in byte j. */
__device__ __forceinline__ uint32_t encode4(float q0, float q1, float q2, float q3) {
    return (uint32_t)e4m3x2_encode(q0, q1) | ((uint32_t)e4m3x2_encode(q2, q3) << 16);
}

__device__ __forceinline__ uint2 encode8(const float (&q)[8]) {
    return make_uint2(encode4(q[0], q[1], q[2], q[3]), encode4(q[4], q[5], q[6], q[7]));
}

/* 8 values' codes under a scale and its reciprocal, element j in byte j of the pair. */
__device__ __forceinline__ uint2 quantize8(const float (&x)[8], float scale, float inv) {
    float q[8];
    quotients(x, scale, inv, q);
    return encode8(q);
}

/* |v| folded into a running amax, NaN-propagating (max.NaN: a NaN in either is NaN; the
 * scale of a NaN amax is NaN whatever its bits, as amax_fold's). */
__device__ __forceinline__ float amax_nan(float m, float v) {
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(m), "f"(fabsf(v)));
    return r;
}

/* The magnitudes of a word's two bf16 folded into m's two (max.NaN.bf16x2 on the values
 * with their sign bits cleared): amax_nan's maxima, exactly (a max of bf16 values is one
 * of them, a NaN stays a NaN). */
__device__ __forceinline__ uint32_t amax_bf16x2(uint32_t m, uint32_t w) {
    uint32_t r;
    asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(m), "r"(w & 0x7fff7fffu));
    return r;
}

/* The 8 bf16 of a 16-byte piece as floats. */
__device__ __forceinline__ void unpack8(const uint4 v, float (&x)[8]) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = bf16_bits(w[j / 2], j % 2);
}

/* The largest magnitude of a 16-byte piece's 8 bf16 (x, the same values unpacked), from
 * the packed piece (kPacked: 4 instructions, and the piece's registers live beside x's)
 * or from x. */
template <bool kPacked>
__device__ __forceinline__ float piece_amax(const uint4 &v, const float (&x)[8]) {
    if constexpr (kPacked) {
        const uint32_t m = amax_bf16x2(amax_bf16x2(amax_bf16x2(v.x & 0x7fff7fffu, v.y), v.z), v.w);
        return amax_nan(bf16_bits(m, 0), bf16_bits(m, 1));
    } else {
        float m = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) m = amax_nan(m, x[j]);
        return m;
    }
}

/* A 1 x 128 tile of bf16 held by the 16 lanes of a half-warp (half_lanes, all present),
 * 8 values (one 16-byte piece) each: the tile's scale (in every lane) and this lane's 8
 * codes, element j in byte j. The rows quantizer's and the dispatch's: the same codes. */
__device__ __forceinline__ uint2 row_tile_codes(const uint4 piece, unsigned half_lanes, int pow2,
                                                float *scale) {
    float x[8];
    unpack8(piece, x);
    float m = piece_amax<false>(piece, x);   /* packed, the EP push spilled (48 registers) */
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) m = amax_nan(m, __shfl_xor_sync(half_lanes, m, o));
    const float s = tile_scale(m, pow2);
    *scale = s;
    return quantize8(x, s, __frcp_rn(s));
}

}  // namespace fp8
}  // namespace mf
