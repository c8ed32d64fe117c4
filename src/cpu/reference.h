/* The fp64 reference: the simplest loops, the truth for every test.
 * All arrays are double (or int32 ids), contiguous, row-major, over all E experts
 * (the R = 1 view). Shapes and math as in include/moefuse.h. */
#ifndef MOEFUSE_REFERENCE_H
#define MOEFUSE_REFERENCE_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mf_ref_shape {
    int num_tokens;    /* T */
    int hidden;        /* H */
    int intermediate;  /* I */
    int num_experts;   /* E */
    int top_k;         /* K */
} mf_ref_shape;

/* y [T, H] = sum_k p[t,k] W2_e silu-glu(W13_e x_t). ids -1 = dropped. */
void mf_ref_forward(const mf_ref_shape *s,
                    const double *x,      /* [T, H] */
                    const int32_t *ids,   /* [T, K] */
                    const double *p,      /* [T, K] */
                    const double *w13,    /* [E, 2I, H] */
                    const double *w2,     /* [E, H, I] */
                    double *y);           /* [T, H] out */

/* Gradients of <dy, y> (written, not accumulated). dp is 0 for dropped slots. */
void mf_ref_backward(const mf_ref_shape *s,
                     const double *x, const int32_t *ids, const double *p,
                     const double *w13, const double *w2,
                     const double *dy,    /* [T, H] */
                     double *dx,          /* [T, H] out */
                     double *dp,          /* [T, K] out */
                     double *dw13,        /* [E, 2I, H] out */
                     double *dw2);        /* [E, H, I] out */

/* The same with W13 and dW13 as include/moefuse.h's "W13 in two halves" allows: w13 and
 * dw13 the gate halves [E, I, H], w13_up and dw13_up the up halves [E, I, H]; w13_up NULL:
 * packed, as above (dw13_up then NULL too). The same values as packed. */
void mf_ref_forward_halves(const mf_ref_shape *s, const double *x, const int32_t *ids,
                           const double *p, const double *w13, const double *w13_up,
                           const double *w2, double *y);
void mf_ref_backward_halves(const mf_ref_shape *s, const double *x, const int32_t *ids,
                            const double *p, const double *w13, const double *w13_up,
                            const double *w2, const double *dy, double *dx, double *dp,
                            double *dw13, double *dw13_up, double *dw2);

/* Qwen3 routing in fp64: softmax over E, top-K (ties: lower id), renormalize. */
void mf_ref_route_forward(int num_tokens, int num_experts, int top_k,
                          const double *logits,  /* [T, E] */
                          int32_t *ids,          /* [T, K] out, decreasing weight */
                          double *weights);      /* [T, K] out */

/* d logits [T, E] from d weights [T, K], ids being the forward's output. */
void mf_ref_route_backward(int num_tokens, int num_experts, int top_k,
                           const double *logits, const int32_t *ids,
                           const double *dweights, double *dlogits);

/* ---- the FP8 block recipe, emulated (src/cpu/reference_fp8.c) ------------------------
 * The same math with every GEMM operand quantized as docs/decisions/0018-fp8-block-recipe.md
 * says (src/cpu/fp8.h: same tiles, scale rule, rounding; pow2 = power-of-two scales),
 * and g, u, a, da', [dg; du] rounded to bf16 (through fp32) where the GPU rounds them.
 * Each GEMM is sum over 128-blocks of K of (scale_a scale_b) (sum of code products): the
 * products and the block sums are exact in fp64, the rest is fp64. x, dy and the
 * weights must hold fp32 values (bf16 inputs are); outputs are not rounded. */
void mf_ref_fp8_forward(const mf_ref_shape *s, int pow2, const double *x, const int32_t *ids,
                        const double *p, const double *w13, const double *w2, double *y);
void mf_ref_fp8_backward(const mf_ref_shape *s, int pow2, const double *x, const int32_t *ids,
                         const double *p, const double *w13, const double *w2,
                         const double *dy, double *dx, double *dp, double *dw13,
                         double *dw2);
/* The same with W13 and dW13 in two halves (as mf_ref_forward_halves; the recipe quantizes
 * each expert's packed [2I, H], so these pack the halves first and split dW13 after). */
void mf_ref_fp8_forward_halves(const mf_ref_shape *s, int pow2, const double *x,
                               const int32_t *ids, const double *p, const double *w13,
                               const double *w13_up, const double *w2, double *y);
void mf_ref_fp8_backward_halves(const mf_ref_shape *s, int pow2, const double *x,
                                const int32_t *ids, const double *p, const double *w13,
                                const double *w13_up, const double *w2, const double *dy,
                                double *dx, double *dp, double *dw13, double *dw13_up,
                                double *dw2);

/* One GEMM of the recipe, for stage-by-stage checks of a backend. A [m, k] is quantized
 * in 1 x 128 tiles along k; W in 128 x 128 blocks, given as [n, k] (w_kn = 0: C = A W^T,
 * gemm1 and gemm2) or as [k, n] (w_kn = 1: C = A W, dgrad2 and dgrad1, whose W^T blocks
 * are W's transposed). C [m, n]. */
void mf_ref_fp8_gemm(int64_t m, int64_t n, int64_t k, int pow2, const double *a,
                     const double *w, int w_kn, double *c);
/* The weight-gradient form: C [m, n] = A^T B over `rows` token rows, A [rows, m] and
 * B [rows, n] both quantized per column in tiles of 128 rows. */
void mf_ref_fp8_gemm_tokens(int64_t rows, int64_t m, int64_t n, int pow2, const double *a,
                            const double *b, double *c);

/* ---- shared by the two reference files ------------------------------------------------
 * The routed slots sorted by expert, and within an expert by slot (t * K + k):
 * rows offsets[e] .. offsets[e+1]-1 belong to expert e, row r holds slot slots[r],
 * and row_of[slot] is its row (-1 when dropped). */
typedef struct mf_ref_groups {
    int64_t *offsets;  /* [E + 1] */
    int64_t *slots;    /* [T * K], first offsets[E] used */
    int64_t *row_of;   /* [T * K] */
    int64_t num_rows;  /* offsets[E] */
} mf_ref_groups;

/* Returns 0 when an allocation failed. */
int mf_ref_groups_build(const mf_ref_shape *s, const int32_t *ids, mf_ref_groups *g);
void mf_ref_groups_free(mf_ref_groups *g);

#ifdef __cplusplus
}
#endif

#endif /* MOEFUSE_REFERENCE_H */
