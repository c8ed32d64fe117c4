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

/* Qwen3 routing in fp64: softmax over E, top-K (ties: lower id), renormalize. */
void mf_ref_route_forward(int num_tokens, int num_experts, int top_k,
                          const double *logits,  /* [T, E] */
                          int32_t *ids,          /* [T, K] out, decreasing weight */
                          double *weights);      /* [T, K] out */

/* d logits [T, E] from d weights [T, K], ids being the forward's output. */
void mf_ref_route_backward(int num_tokens, int num_experts, int top_k,
                           const double *logits, const int32_t *ids,
                           const double *dweights, double *dlogits);

#ifdef __cplusplus
}
#endif

#endif /* MOEFUSE_REFERENCE_H */
