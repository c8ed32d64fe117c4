/* bf16 <-> fp32 on the host. bf16 is the top half of an IEEE fp32, so widening is a
 * shift; narrowing rounds to nearest, ties to even, as the GPU's cvt.rn.bf16.f32 does.
 * Every backend and test agrees on these bits, so they are the only conversion used. */
#include "internal.h"

#include <string.h>

float mf_bf16_to_float(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

uint16_t mf_float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    /* A NaN must not round into infinity (its payload may sit only in the low half),
     * so keep the sign and high payload and set the quiet bit. */
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
    /* Adding 0x7fff plus the lsb of the kept half rounds ties to even; a carry into
     * the exponent is the correct round-up, including finite -> infinity. */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* The backend converts every used expert's weights on each pass (millions of
 * elements), so these loops must vectorize; -O2's cost model will not vectorize a
 * loop of unknown trip count on its own, hence the simd pragmas (element-wise, so
 * vectorizing changes no result). */
void mf_bf16_to_float_n(const uint16_t *restrict in, /* [n] */
                        float *restrict out,         /* [n] */
                        int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        uint32_t u = (uint32_t)in[i] << 16;
        memcpy(&out[i], &u, sizeof u);
    }
}

void mf_float_to_bf16_n(const float *restrict in, /* [n] */
                        uint16_t *restrict out,   /* [n] */
                        int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) out[i] = mf_float_to_bf16(in[i]);
}
