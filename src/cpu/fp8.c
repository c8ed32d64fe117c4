/* The FP8 block recipe (fp8.h): E4M3 codes, tile scales, quantizers. The reference,
 * the CPU backend and moefuse_quantize_weights all quantize through these functions,
 * and the GPU's quantizers are tested bitwise against them. */
#include "fp8.h"

#include <float.h>
#include <math.h>
#include <string.h>

/* Integer rounding on the fp32 bits, so the result does not depend on the floating-point
 * environment (rounding mode, flush-to-zero). */
uint8_t mf_e4m3_encode(float v) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return MF_E4M3_NAN;
    /* >= 448, infinity included: satfinite. Below 448 nothing rounds past it (the next
     * E4M3 step would be 480; the midpoint 464 is above). */
    if (a >= 0x43e00000u) return (uint8_t)(sign | 0x7e);
    if (a >= 0x3c800000u) { /* >= 2^-6: a normal E4M3, 3 of fp32's 23 mantissa bits kept */
        uint32_t r = (a + 0x7ffffu + ((a >> 20) & 1u)) >> 20; /* carry = next binade */
        return (uint8_t)(sign | (r - ((127u - 7u) << 3)));
    }
    /* Subnormal E4M3, multiples of 2^-9: q = rne(|v| 2^9) from fp32's integer mantissa
     * (|v| = mant 2^(exp - 150)); q = 8 is 2^-6, whose code 0x08 follows 0x07. */
    const uint32_t exp = a >> 23;
    const uint32_t mant = exp ? (a & 0x7fffffu) | 0x800000u : a;
    const uint32_t shift = exp ? 141u - exp : 140u;
    if (shift >= 25) return sign; /* below 2^-10 (mant < 2^24 <= half a step) */
    uint32_t q = (mant + (1u << (shift - 1)) - 1u + ((mant >> shift) & 1u)) >> shift;
    return (uint8_t)(sign | q);
}

float mf_e4m3_decode(uint8_t code) {
    const uint32_t e = (code >> 3) & 15u, m = code & 7u;
    float v;
    if (e == 15 && m == 7) return NAN;
    if (e) {
        uint32_t u = ((e + 120u) << 23) | (m << 20);
        memcpy(&v, &u, sizeof v);
    } else {
        v = (float)m * 0x1p-9f;
    }
    return code & 0x80 ? -v : v;
}

float mf_fp8_scale(float amax, int pow2) {
    if (!(amax <= FLT_MAX)) return NAN; /* NaN or infinity in the tile */
    if (amax == 0.0f) return 1.0f;
    float s = amax / MF_E4M3_MAX;
    if (s < FLT_MIN) s = FLT_MIN;
    if (pow2) {
        int ex;
        float m = frexpf(s, &ex); /* s = m 2^ex, 0.5 <= m < 1 */
        s = ldexpf(1.0f, m == 0.5f ? ex - 1 : ex);
    }
    return s;
}

float mf_fp8_amax(const float *v, int64_t n, int64_t stride) {
    float m = 0.0f;
    int nan = 0;
    for (int64_t i = 0; i < n; i++) {
        float a = fabsf(v[i * stride]);
        nan |= a != a;
        m = a > m ? a : m;
    }
    return nan ? NAN : m;
}

float mf_fp8_quantize_tile(const float *v, int64_t n, int64_t v_stride, int pow2, uint8_t *q,
                           int64_t q_stride) {
    const float s = mf_fp8_scale(mf_fp8_amax(v, n, v_stride), pow2);
    for (int64_t i = 0; i < n; i++) q[i * q_stride] = mf_e4m3_encode(v[i * v_stride] / s);
    return s;
}

static int64_t tiles(int64_t n) { return (n + MF_FP8_TILE - 1) / MF_FP8_TILE; }
static int64_t tile_len(int64_t n, int64_t b) {
    int64_t left = n - b * MF_FP8_TILE;
    return left < MF_FP8_TILE ? left : MF_FP8_TILE;
}

void mf_fp8_quantize_rows(const float *v, int64_t rows, int64_t cols, int64_t ld, int pow2,
                          uint8_t *codes, float *scale, int64_t scale_row_stride,
                          int64_t scale_tile_stride) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < tiles(cols); b++) {
            int64_t c0 = b * MF_FP8_TILE;
            scale[b * scale_tile_stride + r * scale_row_stride] = mf_fp8_quantize_tile(
                v + r * ld + c0, tile_len(cols, b), 1, pow2, codes + r * cols + c0, 1);
        }
}

void mf_fp8_quantize_blocks(const float *v, int64_t rows, int64_t cols, int64_t ld, int pow2,
                            uint8_t *codes, float *scale, uint8_t *codes_t, float *scale_t) {
    for (int64_t bi = 0; bi < tiles(rows); bi++)
        for (int64_t bj = 0; bj < tiles(cols); bj++) {
            const int64_t r0 = bi * MF_FP8_TILE, c0 = bj * MF_FP8_TILE;
            const int64_t nr = tile_len(rows, bi), nc = tile_len(cols, bj);
            float amax = 0.0f;
            for (int64_t r = 0; r < nr; r++) {
                float a = mf_fp8_amax(v + (r0 + r) * ld + c0, nc, 1);
                amax = a != a || a > amax ? a : amax;
                if (amax != amax) break;
            }
            const float s = mf_fp8_scale(amax, pow2);
            if (scale) scale[bi * tiles(cols) + bj] = s;
            if (scale_t) scale_t[bj * tiles(rows) + bi] = s;
            for (int64_t r = r0; r < r0 + nr; r++)
                for (int64_t c = c0; c < c0 + nc; c++) {
                    uint8_t q = mf_e4m3_encode(v[r * ld + c] / s);
                    if (codes) codes[r * cols + c] = q;
                    if (codes_t) codes_t[c * rows + r] = q;
                }
        }
}

void mf_fp8_fake_quant_rows(float *v, int64_t rows, int64_t cols, int64_t ld, int pow2) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < tiles(cols); b++) {
            float *t = v + r * ld + b * MF_FP8_TILE; /* [tile_len] */
            const int64_t n = tile_len(cols, b);
            const float s = mf_fp8_scale(mf_fp8_amax(t, n, 1), pow2);
            for (int64_t i = 0; i < n; i++) t[i] = mf_e4m3_decode(mf_e4m3_encode(t[i] / s)) * s;
        }
}

void mf_fp8_fake_quant_cols(float *v, int64_t rows, int64_t cols, int64_t ld, int pow2,
                            float *amax) {
    for (int64_t c = 0; c < cols; c++) amax[c] = 0.0f;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            float a = fabsf(v[r * ld + c]);
            amax[c] = a != a || amax[c] != amax[c] ? NAN : (a > amax[c] ? a : amax[c]);
        }
    for (int64_t c = 0; c < cols; c++) amax[c] = mf_fp8_scale(amax[c], pow2);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            float *x = &v[r * ld + c];
            *x = mf_e4m3_decode(mf_e4m3_encode(*x / amax[c])) * amax[c];
        }
}

void mf_fp8_dequant_block_rows(const uint8_t *codes, const float *scale, int64_t cols,
                               int64_t row0, int64_t n, float *out) {
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *q = codes + (row0 + r) * cols;                     /* [cols] */
        const float *s = scale + (row0 + r) / MF_FP8_TILE * tiles(cols);  /* [tiles] */
        float *o = out + r * cols;                                       /* [cols] */
        for (int64_t c = 0; c < cols; c++) o[c] = mf_e4m3_decode(q[c]) * s[c / MF_FP8_TILE];
    }
}
