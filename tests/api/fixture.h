/* The API tests' shared fixture (tests/cpu/ uses it too; its device part is
 * fixture_cuda.h): model shapes, random problems (x, dy, routing, weights)
 * on fresh draws, poisoned outputs, the library calls, and the comparison with the fp64
 * reference (bf16 math or the FP8 recipe's emulation). */
#ifndef MOEFUSE_TESTS_FIXTURE_H
#define MOEFUSE_TESTS_FIXTURE_H

#include "harness.h"
#include "moefuse.h"

#include <stdint.h>

typedef struct shape {
    const char *name;
    int H, I, E, K;
} shape;

extern const shape QWEN3_30B, QWEN3_235B, QWEN3_235B_E16, QWEN3_30B_E16, SMALL, ODD;

/* ---- problems ---------------------------------------------------------------------- */

typedef enum routing {
    ROUTE_RANDOM,      /* K distinct experts per token, uniform over E */
    ROUTE_FEW,         /* from a random pool of min(E, K + 2) experts: most experts empty */
    ROUTE_ONE_EXPERT,  /* every token has expert 0 in some slot */
    ROUTE_DROPPED,     /* random, each slot dropped with probability 0.3, token 0 all */
    ROUTE_ZIPF,        /* K distinct experts per token, expert of popularity rank j (a random
                          order) drawn with probability ~ 1 / (j + 1): a few hot experts */
} routing;

typedef struct problem {
    shape s;
    int T;
    int64_t stride;    /* row stride of x, y, dy, dx (elements, >= H) */
    uint16_t *x;       /* [T, stride] */
    uint16_t *dy;      /* [T, stride] */
    int32_t *ids;      /* [T, K] */
    float *p;          /* [T, K] */
    uint16_t *w13;     /* [E, 2I, H]; experts without slots hold bf16 NaN (0xFFFF) */
    uint16_t *w2;      /* [E, H, I] */
    int32_t *counts;   /* [E] routed slots per expert */
    const moefuse_fp8_weights *fp8; /* FP8_BLOCK layers: the quantized w13, w2; else NULL */
} problem;

problem problem_make(shape s, int T, int64_t stride, routing r);
void problem_free(problem *pb);
/* Frees the per-run pool of weight values (at the end of main). */
void problem_pool_free(void);
double bf16_value(uint16_t v);

/* ---- outputs ----------------------------------------------------------------------- */

typedef struct outputs {
    int64_t n_y, n_dp, n_dw13, n_dw2;
    uint16_t *y;       /* [T, stride] */
    uint16_t *dx;      /* [T, stride] */
    float *dp;         /* [T, K] */
    float *dw13;       /* [E, 2I, H] */
    float *dw2;        /* [E, H, I] */
    int32_t *counts;   /* [E] */
} outputs;

outputs outputs_make(const problem *pb);
/* Every output byte 0xff: bf16 and fp32 NaN, expert count -1; the backend writes
 * none of these for finite inputs, so a survivor is an element never written. */
void outputs_poison(outputs *o, int32_t num_experts);
void outputs_free(outputs *o);
int outputs_equal(const outputs *a, const outputs *b);
int64_t count_poison32(const float *a, int64_t n);
/* Every element of y and dx inside [0, H) written, the stride gap untouched; every
 * dp, dW and expert count written. */
void check_written(const problem *pb, const outputs *o);

/* ---- the library ---- */
moefuse_layer *make_layer(shape s, int max_tokens, moefuse_saved_mode mode, int num_threads);
moefuse_layer *make_layer_precision(shape s, int max_tokens, moefuse_saved_mode mode,
                                    int num_threads, moefuse_precision precision, int pow2);
/* A saved buffer for T tokens, 256-byte aligned, filled with junk. */
void *saved_make(const moefuse_layer *layer, int T);
/* moefuse_saved_bytes(T): what the backward is told saved_make's buffer holds. */
size_t saved_size(const moefuse_layer *layer, int T);
moefuse_status forward(moefuse_layer *layer, const problem *pb, outputs *o, void *saved);
moefuse_status backward(moefuse_layer *layer, const problem *pb, outputs *o,
                        const void *saved, int accumulate);
/* Poisoned outputs, forward, backward (write mode). */
void run_pair(moefuse_layer *layer, const problem *pb, outputs *o);
#define CHECK_OK(expr)                                                                   \
    do {                                                                                 \
        moefuse_status st_ = (expr);                                                     \
        CHECK(st_ == MOEFUSE_OK, "%s: %s (%s)", #expr, moefuse_status_string(st_),       \
              moefuse_last_error());                                                     \
    } while (0)

/* ---- W13 in two halves (moefuse.h) ------------------------------------------------
 * Packed [E, 2I, H] elements of elem bytes <-> gate and up halves [E, I, H] each
 * (to_halves 1: packed -> halves, else halves -> packed). */
void w13_repack(void *packed, void *gate, void *up, int64_t E, int64_t I, int64_t H,
                size_t elem, int to_halves);
typedef enum wgrad_mode { WGRAD_WRITE, WGRAD_ACCUMULATE, WGRAD_BF16 } wgrad_mode;
/* forward and backward as run_pair but with dW13 in two halves, packed back into o->dw13
 * afterwards (WGRAD_ACCUMULATE: onto o->dw13 and o->dw2 as they are; WGRAD_BF16: the bf16
 * gradients into dw13_bf16 [E, 2I, H] and dw2_bf16 [E, H, I], o->dw13, o->dw2 untouched);
 * W13 in two halves too when weights_in_halves (FP8 layers read neither). Outputs are not
 * poisoned here. */
void run_pair_halves(moefuse_layer *layer, const problem *pb, outputs *o, wgrad_mode mode,
                     uint16_t *dw13_bf16, uint16_t *dw2_bf16, int weights_in_halves);

/* ---- the reference ------------------------------------------------------------------
 * Run on the used experts only (renumbered 0..Eu-1): the fp64 copies of all 128
 * qwen3 experts would not fit in memory, and an expert without slots contributes
 * nothing but zero gradients, which are checked exactly. */

typedef struct err_acc { double num, den; } err_acc; /* sum (a-b)^2, sum b^2 */

void err_add(err_acc *e, double got, double want);
double err_rel(const err_acc *e);

/* Errors pooled over one or more problems: the norm-wise rule is a statistic, and
 * dp = <da', a> has only T*K values. Its error is a sum over I of independent
 * rounding errors, as is dp itself, so ||d dp|| / ||dp|| behaves like the rms
 * rounding error times sqrt(F(n, n)) for n values: at n = 4 (T = 1, K = 4) the 2x
 * margin is exceeded in a few percent of draws, at n >= 32 practically never. Cases
 * with few slots therefore pool several fresh problems rather than widen anything. */
typedef struct errs { err_acc y, dx, dp, dw13, dw2; } errs;

/* The reference of compare_with_reference: the fp64 math, or the FP8 recipe's emulation
 * with scales as they are or powers of two. */
enum { REF_BF16 = -1, REF_FP8 = 0, REF_FP8_POW2 = 1 };
/* Adds this problem's errors against the reference to `e`; checks exactly what is
 * exact (zero gradients of experts without slots, dp of dropped slots, y and dx of
 * tokens with every slot dropped). */
void compare_with_reference(const problem *pb, const outputs *o, errs *er, int ref);

/* Tolerances of the FP8 recipe's outputs against its emulation (REF_FP8): each output's
 * chain of rounding points (harness.h, th_gemm ...), rows = the most rows of one expert
 * (the weight-gradient GEMMs' K), acc = the accumulation error of one GEMM
 * (th_acc_fp32: the CPU backend; th_acc_wgmma_fp8_rms: Hopper's FP8 tensor cores). */
typedef struct fp8_tols { double y, dx, dp, dw13, dw2; } fp8_tols;
fp8_tols fp8_tolerances(shape s, int64_t rows, double (*acc)(int64_t));

#endif
