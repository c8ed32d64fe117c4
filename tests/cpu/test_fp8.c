/* The FP8 recipe's building blocks (src/cpu/fp8.c) against independent definitions:
 * E4M3 decoding by its formula, encoding as the nearest of all 254 finite codes (ties to
 * the even code), saturation, denormals, zeros, NaN; tile scales (all-zero tiles, pow2,
 * the fp32 floor) and the quantizers' layouts. */
#include "fp8.h"
#include "harness.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* (-1)^s 2^(e-7) (1 + m/8), subnormal 2^-6 (m/8); e = 15, m = 7 is NaN. */
static double e4m3_formula(int code) {
    int s = code >> 7, e = (code >> 3) & 15, m = code & 7;
    if (e == 15 && m == 7) return NAN;
    double v = e ? ldexp(1.0 + m / 8.0, e - 7) : ldexp(m / 8.0, -6);
    return s ? -v : v;
}

/* Nearest finite E4M3 by search, ties to the code with an even mantissa (its last bit 0),
 * beyond +-448 saturated; the sign of a result 0 is v's sign. */
static int e4m3_nearest(double v) {
    if (isnan(v)) return 0x7f;
    int sign = signbit(v) ? 0x80 : 0;
    double a = fabs(v);
    if (a >= 448.0) return sign | 0x7e;
    int best = 0;
    for (int c = 1; c <= 0x7e; c++) {
        double d = fabs(e4m3_formula(c) - a), db = fabs(e4m3_formula(best) - a);
        if (d < db || (d == db && (c & 1) == 0)) best = c;
    }
    return sign | best;
}

static void decode_all_codes(void) {
    int bad = 0;
    for (int c = 0; c < 256; c++) {
        double want = e4m3_formula(c);
        float got = mf_e4m3_decode((uint8_t)c);
        if (isnan(want)) bad += !isnan(got);
        else bad += (double)got != want || !signbit(got) != !signbit(want);
    }
    CHECK(bad == 0, "%d codes decode to other values than the E4M3 formula", bad);
    CHECK(mf_e4m3_decode(0x7e) == 448.0f && mf_e4m3_decode(0xfe) == -448.0f, "max is not 448");
    CHECK(mf_e4m3_decode(0x01) == 0x1p-9f && mf_e4m3_decode(0x08) == 0x1p-6f,
          "smallest subnormal / normal wrong");
}

/* decode then encode gives the code back for all 254 non-NaN codes (-0 included); both
 * NaN codes encode back to 0x7f. */
static void round_trip_all_codes(void) {
    int bad = 0;
    for (int c = 0; c < 256; c++) {
        uint8_t back = mf_e4m3_encode(mf_e4m3_decode((uint8_t)c));
        int want = (c & 0x7f) == 0x7f ? 0x7f : c;
        if (back != want) {
            if (bad++ < 5) printf("  code 0x%02x -> 0x%02x\n", c, back);
        }
    }
    CHECK(bad == 0, "%d codes do not survive decode + encode", bad);
}

/* Every midpoint between neighbouring codes (ties: to the even code) and the fp32
 * neighbours on both sides of it, in both signs; zeros, the subnormal range and the
 * saturation range included. */
static void encode_ties_and_neighbours(void) {
    int bad = 0, n = 0;
    for (int c = 0; c < 0x7e; c++) {
        double mid = 0.5 * (e4m3_formula(c) + e4m3_formula(c + 1)); /* exact in fp32 */
        float m = (float)mid;
        float pts[3] = {nextafterf(m, 0.0f), m, nextafterf(m, INFINITY)};
        for (int i = 0; i < 3; i++)
            for (int s = 0; s < 2; s++) {
                float v = s ? -pts[i] : pts[i];
                int want = e4m3_nearest(v), got = mf_e4m3_encode(v);
                n++;
                if (got != want && bad++ < 5)
                    printf("  encode(%a) = 0x%02x, expected 0x%02x\n", (double)v, got, want);
            }
        /* the tie itself goes to the even code */
        bad += mf_e4m3_encode(m) != ((c & 1) ? c + 1 : c);
    }
    CHECK(bad == 0, "%d of %d values near the midpoints encoded wrongly", bad, n);
}

/* Fresh random fp32 values over the whole exponent range of E4M3 and beyond, and every
 * fp32 value of one binade in the subnormal range (step 2^-32 there). */
static void encode_random_and_subnormal_binade(void) {
    int bad = 0;
    for (int i = 0; i < 200000; i++) {
        float v = (float)ldexp(th_uniform() * 2.0 - 1.0, th_rand_int(-14, 11));
        bad += mf_e4m3_encode(v) != e4m3_nearest(v);
    }
    for (float v = 0x1p-8f; v < 0x1p-7f; v += 0x1p-25f) bad += mf_e4m3_encode(v) != e4m3_nearest(v);
    CHECK(bad == 0, "%d random values encoded wrongly", bad);
}

static void encode_special_values(void) {
    CHECK(mf_e4m3_encode(0.0f) == 0x00 && mf_e4m3_encode(-0.0f) == 0x80, "zeros keep their sign");
    CHECK(mf_e4m3_encode(448.0f) == 0x7e && mf_e4m3_encode(463.99f) == 0x7e &&
          mf_e4m3_encode(464.0f) == 0x7e && mf_e4m3_encode(1e30f) == 0x7e &&
          mf_e4m3_encode(INFINITY) == 0x7e && mf_e4m3_encode(-INFINITY) == 0xfe &&
          mf_e4m3_encode(-1e9f) == 0xfe, "beyond +-448 must saturate to +-448");
    CHECK(mf_e4m3_encode(NAN) == 0x7f && mf_e4m3_encode(-NAN) == 0x7f, "NaN must encode to 0x7f");
    CHECK(mf_e4m3_encode(0x1p-10f) == 0x00 && mf_e4m3_encode(nextafterf(0x1p-10f, 1.0f)) == 0x01 &&
          mf_e4m3_encode(-0x1p-10f) == 0x80 && mf_e4m3_encode(3 * 0x1p-10f) == 0x02 &&
          mf_e4m3_encode(FLT_TRUE_MIN) == 0x00 && mf_e4m3_encode(-FLT_MIN) == 0x80,
          "denormal rounding: 2^-10 ties to 0, 3 * 2^-10 to 2 * 2^-9");
    CHECK(mf_e4m3_encode(15.5f * 0x1p-10f) == 0x08, "the top subnormal rounds into 2^-6");
}

static void scales(void) {
    CHECK(mf_fp8_scale(0.0f, 0) == 1.0f && mf_fp8_scale(0.0f, 1) == 1.0f, "all-zero tile: 1");
    CHECK(mf_fp8_scale(448.0f, 0) == 1.0f && mf_fp8_scale(448.0f, 1) == 1.0f, "448 -> 1");
    CHECK(mf_fp8_scale(3.0f, 0) == 3.0f / 448.0f, "scale = fp32(amax / 448)");
    CHECK(mf_fp8_scale(3.0f, 1) == 0x1p-7f, "pow2: 3/448 = 2^-7.22 rounds up to 2^-7");
    CHECK(mf_fp8_scale(224.0f, 1) == 0.5f && mf_fp8_scale(225.0f, 1) == 1.0f,
          "pow2: an exact power of two stays, anything above rounds up");
    CHECK(mf_fp8_scale(1e-40f, 0) == FLT_MIN && mf_fp8_scale(1e-40f, 1) == FLT_MIN,
          "tiny amax: scale floored at 2^-126");
    CHECK(isnan(mf_fp8_scale(NAN, 0)) && isnan(mf_fp8_scale(INFINITY, 1)), "non-finite -> NaN");
    /* pow2 scales of random amax: a power of two, >= amax/448, < 2 amax/448 */
    int bad = 0;
    for (int i = 0; i < 10000; i++) {
        float amax = (float)ldexp(0.5 + th_uniform(), th_rand_int(-100, 100));
        float s = mf_fp8_scale(amax, 1), s0 = mf_fp8_scale(amax, 0);
        int ex;
        bad += frexpf(s, &ex) != 0.5f || s < s0 || s >= 2 * s0;
    }
    CHECK(bad == 0, "%d pow2 scales wrong", bad);
}

/* Tiles: all-zero (scale 1, codes 0), with a NaN (scale NaN, codes 0x7f), with an inf,
 * with denormal-sized values beside large ones; the largest element encodes to +-448
 * (or, with pow2, to the largest code below its bound). */
static void tiles(void) {
    float v[MF_FP8_TILE];
    uint8_t q[MF_FP8_TILE];
    memset(v, 0, sizeof v);
    v[5] = -0.0f;
    float s = mf_fp8_quantize_tile(v, MF_FP8_TILE, 1, 0, q, 1);
    CHECK(s == 1.0f && q[0] == 0 && q[5] == 0x80, "all-zero tile: scale 1, codes +-0");
    for (int i = 0; i < MF_FP8_TILE; i++) v[i] = (float)th_normal();
    v[17] = -9.0f;
    s = mf_fp8_quantize_tile(v, MF_FP8_TILE, 1, 0, q, 1);
    CHECK(q[17] == 0xfe && s == 9.0f / 448.0f, "amax element must encode to -448");
    s = mf_fp8_quantize_tile(v, MF_FP8_TILE, 1, 1, q, 1);
    CHECK(s == 0x1p-5f && mf_e4m3_decode(q[17]) * s == -9.0f, "pow2: exact rescaling of -9");
    v[3] = 1e-30f; /* far below amax / 448 * 2^-9: encodes to 0 */
    mf_fp8_quantize_tile(v, MF_FP8_TILE, 1, 0, q, 1);
    CHECK(q[3] == 0, "a value 2^-100 of the amax encodes to 0");
    v[40] = NAN;
    s = mf_fp8_quantize_tile(v, MF_FP8_TILE, 1, 0, q, 1);
    int nan_codes = 0;
    for (int i = 0; i < MF_FP8_TILE; i++) nan_codes += q[i] == 0x7f;
    CHECK(isnan(s) && nan_codes == MF_FP8_TILE, "a NaN makes the whole tile NaN");
    v[40] = INFINITY;
    s = mf_fp8_quantize_tile(v, MF_FP8_TILE, 1, 1, q, 1);
    CHECK(isnan(s) && q[0] == 0x7f, "an infinity makes the whole tile NaN");
}

/* quantize_rows: short last tile, scale layout with the tile index slowest ([tiles, rows],
 * the MN-major activation layout); fake_quant_rows gives decode(code) * scale of it. */
static void rows_and_blocks(void) {
    enum { R = 5, C = 300, NT = 3 };
    float v[R * C], f[R * C], sc[NT * R], sb[2 * NT], sbt[NT * 2];
    uint8_t q[R * C], qb[R * C], qbt[C * R];
    for (int i = 0; i < R * C; i++) f[i] = v[i] = (float)(th_normal() * ldexp(1.0, th_rand_int(-3, 3)));
    mf_fp8_quantize_rows(v, R, C, C, 0, q, sc, 1, R);
    mf_fp8_fake_quant_rows(f, R, C, C, 0);
    int bad = 0;
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float s = sc[(c / 128) * R + r];
            float amax = mf_fp8_amax(v + r * C + (c / 128) * 128, c / 128 == 2 ? C - 256 : 128, 1);
            bad += s != mf_fp8_scale(amax, 0) || q[r * C + c] != mf_e4m3_encode(v[r * C + c] / s);
            bad += f[r * C + c] != mf_e4m3_decode(q[r * C + c]) * s;
        }
    CHECK(bad == 0, "%d elements of quantize_rows / fake_quant_rows wrong", bad);
    /* blocks of [5, 300]: 1 x 3 blocks of up to 128 x 128; the transpose is exact */
    mf_fp8_quantize_blocks(v, R, C, C, 1, qb, sb, qbt, sbt);
    bad = 0;
    for (int b = 0; b < NT; b++) {
        float amax = 0.0f;
        for (int r = 0; r < R; r++) {
            float a = mf_fp8_amax(v + r * C + b * 128, b == 2 ? C - 256 : 128, 1);
            amax = a > amax ? a : amax;
        }
        bad += sb[b] != mf_fp8_scale(amax, 1) || sbt[b] != sb[b];
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            bad += qb[r * C + c] != mf_e4m3_encode(v[r * C + c] / sb[c / 128]) ||
                   qbt[c * R + r] != qb[r * C + c];
    CHECK(bad == 0, "%d elements of quantize_blocks wrong", bad);
    /* fake_quant_cols: each column one tile */
    float amax_scratch[C];
    memcpy(f, v, sizeof f);
    mf_fp8_fake_quant_cols(f, R, C, C, 1, amax_scratch);
    bad = 0;
    for (int c = 0; c < C; c++) {
        float s = mf_fp8_scale(mf_fp8_amax(v + c, R, C), 1);
        for (int r = 0; r < R; r++)
            bad += f[r * C + c] != mf_e4m3_decode(mf_e4m3_encode(v[r * C + c] / s)) * s;
    }
    CHECK(bad == 0, "%d elements of fake_quant_cols wrong", bad);
}

/* The GPU quantizers' division-free quotient (src/cuda/fp8_recipe.cuh quotient_fast), in
 * C: q1 = rn(x inv), r = fma(q1, s, -x), q = fma(r, -inv, q1). fma(-r, inv, q1) would be
 * the same value, but gcc -mfma folds it into fma(fma(-q1, s, x), inv, q1), which loses
 * x = -0's sign. */
static float quotient_fast(float x, float s, float inv) {
    const float q = x * inv;
    const float r = fmaf(q, s, -x);
    return fmaf(r, -inv, q);
}

/* fp8_recipe.cuh quotients, one value: under a scale below 2^-89, x, s and inv times 2^64,
 * 2^64 and 2^-64 first (exact). Its codes are those of encode(rn(x / s)) for every bf16 x
 * with |x| <= amax under the scale of every 64th positive finite bf16 amax, and for fp32 x
 * at every e4m3 rounding point (midpoints of normal and subnormal codes) times random
 * scales, +-8 ulp. (Run over every bf16 amax, both scale rules, and 1.9 G random and
 * near-midpoint fp32 pairs, plain and with -mfma, while it was written: 0 differ.) */
static float quotient(float x, float s, float inv) {
    if (s >= 0x1p-89f) return quotient_fast(x, s, inv);
    return quotient_fast(x * 0x1p64f, s * 0x1p64f, inv * 0x1p-64f);
}

/* 1 when the codes of x / s and quotient differ. */
static int quotients_differ(float x, float s, float inv) {
    return mf_e4m3_encode(quotient(x, s, inv)) != mf_e4m3_encode(x / s);
}

static void division_free_quotient(void) {
    long n = 0, bad = 0;
    for (uint32_t ab = 0x0001; ab < 0x7f80; ab += 64) {
        float amax;
        const uint32_t abits = ab << 16;
        memcpy(&amax, &abits, 4);
        const float s = mf_fp8_scale(amax, 0), inv = 1.0f / s;
        for (uint32_t xb = 0; xb < 0x10000; xb++) {
            const uint32_t xbits = xb << 16;
            float x;
            memcpy(&x, &xbits, 4);
            if (!(fabsf(x) <= amax)) continue;   /* a tile's values are within its amax */
            n++;
            if (quotients_differ(x, s, inv) && bad++ < 3) printf("    bf16 x %a, scale %a\n", x, s);
        }
    }
    for (int i = 0; i < 400; i++) {
        const float s = mf_fp8_scale((float)ldexp(0.5 + th_uniform(), (int)(th_uniform() * 200) - 100), 0);
        const float inv = 1.0f / s;
        for (int c = 0; c < 126; c++) {   /* the point between codes c and c + 1 */
            const float mid = (float)((e4m3_formula(c) + e4m3_formula(c + 1)) / 2.0) * s;
            uint32_t mb;
            memcpy(&mb, &mid, 4);
            for (int k = -8; k <= 8; k++) {
                const uint32_t vb = mb + (uint32_t)k;
                float v;
                memcpy(&v, &vb, 4);
                for (int sign = 0; sign < 2; sign++, v = -v) {
                    n++;
                    if (quotients_differ(v, s, inv) && bad++ < 3)
                        printf("    fp32 x %a, scale %a\n", v, s);
                }
            }
        }
    }
    CHECK(bad == 0, "%ld of %ld values encode differently from encode(x / s)", bad, n);
}

int main(void) {
    th_seed_from_env_or_clock();
    th_run("E4M3 decode: all 256 codes", decode_all_codes);
    th_run("E4M3 decode + encode round trip: all 256 codes", round_trip_all_codes);
    th_run("E4M3 encode: every midpoint (ties to even) and its neighbours", encode_ties_and_neighbours);
    th_run("E4M3 encode: random values, a subnormal binade", encode_random_and_subnormal_binade);
    th_run("E4M3 encode: zeros, saturation, NaN, denormals", encode_special_values);
    th_run("tile scales: zero, pow2, floor, non-finite", scales);
    th_run("tiles: all-zero, amax, pow2, NaN, inf", tiles);
    th_run("1x128 rows, 128x128 blocks and transposes, token columns", rows_and_blocks);
    th_run("the GPU's division-free quotient = encode(x / s): bf16 x, fp32 near rounding points",
           division_free_quotient);
    return th_finish();
}
