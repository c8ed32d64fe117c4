#include "harness.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int n_passed, n_failed, n_skipped;
static int case_failed, case_skipped;
static const char *case_name = "";

void th_run(const char *name, void (*fn)(void)) {
    case_name = name;
    case_failed = 0;
    case_skipped = 0;
    fn();
    if (case_failed) {
        n_failed++;
        printf("FAIL %s\n", name);
    } else if (case_skipped) {
        n_skipped++;
    } else {
        n_passed++;
        printf("ok   %s\n", name);
    }
    fflush(stdout);
}

void th_skip(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    printf("SKIP %s: ", case_name);
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    case_skipped = 1;
}

void th_check(int ok, const char *file, int line, const char *fmt, ...) {
    if (ok) return;
    va_list ap;
    va_start(ap, fmt);
    printf("  %s:%d: [%s] ", file, line, case_name);
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    case_failed = 1;
}

int th_finish(void) {
    printf("%d passed, %d failed, %d skipped\n", n_passed, n_failed, n_skipped);
    return n_failed ? 1 : 0;
}

/* ---- RNG: xoshiro256** seeded through splitmix64 ---- */
static uint64_t rng_state[4];

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void th_seed_from_env_or_clock(void) {
    const char *env = getenv("MOEFUSE_TEST_SEED");
    uint64_t seed;
    if (env && *env) {
        seed = strtoull(env, NULL, 0);
    } else {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        seed = (uint64_t)ts.tv_sec * 1000000007ull ^ (uint64_t)ts.tv_nsec;
    }
    printf("seed %llu (replay with MOEFUSE_TEST_SEED=%llu)\n", (unsigned long long)seed,
           (unsigned long long)seed);
    uint64_t s = seed;
    for (int i = 0; i < 4; i++) rng_state[i] = splitmix64(&s);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t th_rand_u64(void) {
    uint64_t *s = rng_state;
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

double th_uniform(void) { return (double)(th_rand_u64() >> 11) * 0x1.0p-53; }

double th_normal(void) {
    double u1 = th_uniform(), u2 = th_uniform();
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
}

int th_rand_int(int lo, int hi) {
    return lo + (int)(th_rand_u64() % (uint64_t)(hi - lo + 1));
}

/* Local RNE conversion so the harness does not depend on the library under test. */
static uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static double from_bf16(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

void th_fill_bf16_normal(uint16_t *out, double *out_exact, int64_t n, double scale) {
    for (int64_t i = 0; i < n; i++) {
        uint16_t b = to_bf16((float)(th_normal() * scale));
        out[i] = b;
        if (out_exact) out_exact[i] = from_bf16(b);
    }
}

double th_rel_l2(const double *a, const double *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = a[i] - b[i];
        num += d * d;
        den += b[i] * b[i];
    }
    if (num != num) return NAN;
    if (den == 0) return num == 0 ? 0 : INFINITY;
    return sqrt(num / den);
}

double th_max_abs_diff(const double *a, const double *b, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs(a[i] - b[i]);
        if (d != d) return NAN;
        if (d > m) m = d;
    }
    return m;
}

double th_bf16_tolerance(int roundings) {
    return 2.0 * TH_BF16_U * sqrt((double)roundings / 3.0) + 1e-5;
}

th_diff th_gemm(th_diff d, double acc) {
    th_diff r = {d.rms + acc, d.rms + acc};
    return r;
}

th_diff th_elementwise(th_diff d, double c) {
    th_diff r = {c * d.m1, c * d.rms};
    return r;
}

th_diff th_round(th_diff d, double step) {
    th_diff r = {d.m1, sqrt(d.rms * d.rms + step * d.m1)};
    return r;
}

th_diff th_sum(th_diff a, th_diff b) {
    th_diff r = {a.m1 + b.m1, a.rms + b.rms};
    return r;
}

th_diff th_quant_fp8(th_diff d) {
    return th_round(th_sum(d, d), TH_E4M3_STEP);
}

double th_acc_fp32(int64_t k) { return 0x1p-24 * (2.0 + sqrt((double)k)); }

double th_acc_wgmma_fp8(int64_t k) { return 4.0 * 0x1p-13 + (double)((k + 127) / 128) * 0x1p-24; }

double th_acc_wgmma_fp8_rms(int64_t k) { return 0x1p-13 + (double)((k + 127) / 128) * 0x1p-24; }
