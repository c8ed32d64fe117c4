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

/* ---- FP8 block recipe: an implementation against its fp64 emulation ------------------
 * (docs/decisions/0018-fp8-block-recipe.md, "Tolerances"). Both quantize at the same points
 * with the same rule, so their only difference is the GEMMs' accumulation (`acc`:
 * th_acc_fp32 for fp32 math, th_acc_wgmma_fp8 for Hopper's FP8 tensor cores). A later
 * rounding turns a small difference d into a few whole steps: a value lies within |d|
 * of a rounding boundary with probability |d| / step. So a difference is tracked as
 * (m1, rms): mean |d| and root-mean-square d, both relative to the rms of the values,
 * and carried through the chain of each output:
 *   GEMM              rms' = rms + acc, m1' = rms'  (a sum of many terms is dense)
 *   elementwise (c)   m1' = c m1, rms' = c rms       (c: sensitivity, 2 for SwiGLU)
 *   rounding (step s) m1' = m1, rms' = sqrt(rms^2 + s m1)
 *                     (a value moves by s|x| with probability |d| / (s|x|): the mean
 *                     difference stays, its square becomes s |d| |x|; the old rms is
 *                     kept beside it, to spare)
 *   FP8 quantization  a rounding with s = 2^-3 of d plus the scale's shift: the amax
 *                     element's difference, one typical difference more
 * The tolerance is twice the rms at the end (plus the bf16 rounding of y and dx, which
 * the emulation does not round). The layer chains take the accumulation's rms
 * (th_acc_fp32, th_acc_wgmma_fp8_rms); th_acc_wgmma_fp8 bounds one GEMM. Measured on an
 * H100 (docs/decisions/0018): the GPU's outputs 1.3e-3 (dp) to 6.6e-3 (y) from the
 * emulation, 3 to 5 times under these tolerances. */
typedef struct th_diff { double m1, rms; } th_diff;
th_diff th_gemm(th_diff d, double acc);
th_diff th_elementwise(th_diff d, double c);
th_diff th_round(th_diff d, double step);
th_diff th_quant_fp8(th_diff d);
th_diff th_sum(th_diff a, th_diff b);
/* Norm-wise relative error of a GEMM of reduction length k: fp32 operands (dequantized
 * values rounded once) and fp32 accumulation, u32 (2 + sqrt(k)); Hopper's FP8 wgmma,
 * whose accumulator keeps ~14 bits inside each 128-block (4 k32 steps, truncating:
 * 4 * 2^-13) and adds the scaled block sums in fp32 (ceil(k/128) * 2^-24). */
double th_acc_fp32(int64_t k);
double th_acc_wgmma_fp8(int64_t k);
/* The rms of that accumulator's difference, which the layer chains carry: 2^-13 inside
 * each 128-block (the truncating accumulator's model in tests/cpu/test_fp8_accumulator.c
 * gives 1.1-1.2e-4 at K = 2048 and 4096) and the same fp32 block sums. */
double th_acc_wgmma_fp8_rms(int64_t k);
#define TH_BF16_STEP (1.0 / 128.0)
#define TH_E4M3_STEP (1.0 / 8.0)

#endif
