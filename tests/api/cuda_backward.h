/* The fixture of the CUDA backward tests (test_cuda_backward.c against the reference,
 * test_cuda_backward_modes.c bitwise): the layer, weights and weight-gradient buffers of
 * one model, fresh inputs on the device, the forward + backward call, the reference
 * checks of dx, d p and dW (cuda_backward_ref.c) and the copies the bitwise cases compare.
 * The constants and tolerances are explained at the top of test_cuda_backward.c. */
#ifndef MOEFUSE_TESTS_CUDA_BACKWARD_H
#define MOEFUSE_TESTS_CUDA_BACKWARD_H

#include <cuda_runtime.h>
#include <stdint.h>

#include "fixture_cuda.h"
#include "moefuse.h"

#define kMaxTokens 4096
#define kCheckTokens 16
#define kMaskExperts 3
#define kMaskSlots 256
#define kGroupSlots 32

extern char g_skip[512];

/* ---- fixture: layer, weights, weight-gradient buffers ------------------------------- */

typedef struct fixture {
    const model *m;
    moefuse_layer *layer;     /* MOEFUSE_SAVE_ACTIVATIONS */
    moefuse_pipeline pipeline;/* the layer's: staged unless MOEFUSE_TEST_PIPELINE=fused */
    uint16_t *w13_d, *w2_d;   /* [E, 2I, H], [E, H, I] */
    float *dw13_d, *dw2_d;    /* [E, 2I, H], [E, H, I] fp32 */
    double *w13_ref, *w2_ref; /* fp64 copies */
    float *dw13_h, *dw2_h;    /* host copies of the gradients */
    cudaStream_t stream;
} fixture;

extern fixture F;

double bf(uint16_t v);
int64_t n13(void);
int64_t n2(void);
moefuse_layer *make_layer(moefuse_saved_mode mode, moefuse_pipeline pipeline, int max_tokens);
/* 1 when the case can run; else a SKIP (no device) or a failure (no fixture). */
int ready(void);

typedef struct inputs {
    int T, K, H;
    int64_t x_stride, dy_stride, dx_stride;
    uint16_t *x, *dy;  /* host [T, stride] */
    int32_t *ids;      /* host [T, K] */
    float *p;          /* host [T, K] */
    uint16_t *x_d, *dy_d, *dx_d, *y_d;
    int32_t *ids_d;
    float *p_d, *dp_d;
    void *saved_d;
    size_t saved_bytes;
} inputs;

int inputs_make(inputs *in, int T, routing r, int64_t pad);
void inputs_free(inputs *in);
moefuse_bwd_args bwd_args(const inputs *in, int accumulate);
/* Poison (write mode: also dW), forward, backward on `layer`. */
moefuse_status run_fwd_bwd(moefuse_layer *layer, const inputs *in, int poison_dw);
/* W13 and dW13 in two halves (moefuse.h, w13_up): device arrays [E, I, H] each. */
typedef struct w13_halves {
    const uint16_t *w13, *w13_up;
    float *dw13, *dw13_up;
} w13_halves;
/* run_fwd_bwd with W13 and dW13 in the halves h (NULL: the fixture's packed ones). */
moefuse_status run_fwd_bwd_halves(moefuse_layer *layer, const inputs *in, int poison_dw,
                                  const w13_halves *h);
/* Packed [E, 2I, H] elements of elem bytes <-> halves [E, I, H] (to_halves 1: packed ->
 * halves), on F.stream. */
cudaError_t w13_halves_copy(void *packed, void *gate, void *up, size_t elem, int to_halves);
/* The write-mode backward of `in` into the bf16 weight gradients d13 / d2 (no fp32 ones),
 * synchronized. */
moefuse_status backward_dw_bf16_on(moefuse_layer *layer, const inputs *in, uint16_t *d13,
                                   uint16_t *d2);
moefuse_status backward_dw_bf16(const inputs *in, uint16_t *d13, uint16_t *d2);

/* The reference checks (cuda_backward_ref.c): dx and d p of a random subset of tokens;
 * dW on a second call with masked ids (see test_cuda_backward.c). */
void check_dx_dp(const inputs *in, const uint16_t *dx, const float *dp);
void check_dw_masked(inputs *in);

typedef struct outputs {
    uint16_t *dx;
    float *dp, *dw13, *dw2;
    size_t dx_bytes, dp_bytes;
} outputs;

/* Copies dx, d p and the fp32 dW of the last call (after synchronizing). */
int outputs_get(outputs *o, const inputs *in);
int outputs_equal(const outputs *a, const outputs *b);
void outputs_free(outputs *o);

/* Runs `cases` on each model (argv: [model-substring [case-substring]]) and returns the
 * exit status. */
int backward_main(int argc, char **argv, const named_case *cases, int n);

#endif
