/* A small test harness: suites of named cases, checks that record file:line, a
 * deterministic-per-run RNG (seeded from the clock unless MOEFUSE_TEST_SEED is set,
 * and printed, so every run draws fresh inputs and a failure can be replayed), and
 * the closing line "N passed, N failed, N skipped". */
#ifndef MOEFUSE_TEST_HARNESS_H
#define MOEFUSE_TEST_HARNESS_H

#include <stdint.h>

/* Runs one case; it passes when no CHECK in it failed and it did not SKIP. */
void th_run(const char *name, void (*fn)(void));
/* Marks the running case skipped, with the reason printed. */
void th_skip(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void th_check(int ok, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
#define CHECK(cond, ...) th_check(!!(cond), __FILE__, __LINE__, __VA_ARGS__)

/* Prints the closing line; returns the process exit code (0 when nothing failed). */
int th_finish(void);

/* RNG (xoshiro256**), seeded by th_seed_from_env_or_clock() in main. */
void th_seed_from_env_or_clock(void);
uint64_t th_rand_u64(void);
double th_uniform(void);              /* [0, 1) */
double th_normal(void);               /* N(0, 1) */
int th_rand_int(int lo, int hi);      /* [lo, hi] */

/* bf16 buffers of random normal values * scale, and the exact doubles they hold. */
void th_fill_bf16_normal(uint16_t *out, double *out_exact, int64_t n, double scale);

/* Relative error in the 2-norm, ||a - b|| / ||b|| (0 when both are zero), and the
 * largest |a - b|. NaN in a makes both NaN, which fails any tolerance check. */
double th_rel_l2(const double *a, const double *b, int64_t n);
double th_max_abs_diff(const double *a, const double *b, int64_t n);

/* bf16 unit roundoff 2^-8 and the tolerance rule (see tests/README): a result that
 * went through `roundings` bf16 roundings, each an independent relative error of
 * rms u/sqrt(3), has a norm-wise error near u*sqrt(roundings/3); we allow twice
 * that plus fp32 accumulation noise. */
#define TH_BF16_U (1.0 / 256.0)
double th_bf16_tolerance(int roundings);

#endif
