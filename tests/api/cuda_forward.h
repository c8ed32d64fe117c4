/* The fixture of the CUDA forward tests (test_cuda_forward.c against the reference,
 * test_cuda_forward_bitwise.c): the layer and weights of one model on the device with
 * fp64 copies, fresh inputs of one call, and the checks of y, saved and expert_counts.
 * The constants and the tolerance are explained at the top of test_cuda_forward.c. */
#ifndef MOEFUSE_TESTS_CUDA_FORWARD_H
#define MOEFUSE_TESTS_CUDA_FORWARD_H

#include <cuda_runtime.h>
#include <stdint.h>

#include "fixture_cuda.h"
#include "moefuse.h"

#define BF16_NAN 0xffffu
#define kCheckTokens 64
#define kMaxTokens 4096

extern char g_skip[512];  /* non-empty: why every case skips */

typedef struct fixture {
    const model *m;
    moefuse_layer *layer;
    uint16_t *w13_d, *w2_d;   /* device, [E, 2I, H] and [E, H, I] */
    double *w13_ref, *w2_ref; /* host fp64 copies of the same bf16 values */
    cudaStream_t stream;
} fixture;

extern fixture F;

double bf16_to_double(uint16_t v);
/* SKIP without an sm_90 device; a fixture that failed on one is a failure. */
int ready(void);

typedef struct inputs {
    int T, K, H;
    int64_t x_stride, y_stride;
    uint16_t *x;   /* host [T, x_stride] */
    int32_t *ids;  /* host [T, K] */
    float *p;      /* host [T, K] */
    /* device copies, and outputs */
    uint16_t *x_d, *y_d;
    int32_t *ids_d, *counts_d;
    float *p_d;
    void *saved_d;
    size_t saved_bytes;
} inputs;

/* Host inputs and device buffers; outputs poisoned. 0 on failure (recorded). */
int inputs_make(inputs *in, int T, routing r, int64_t x_pad, int64_t y_pad);
void inputs_free(inputs *in);
moefuse_fwd_args fwd_args(const inputs *in, int with_saved, int with_counts);

/* y against the fp64 reference on a subset of tokens; every element of y written. */
void check_y(const inputs *in, const uint16_t *y);
/* The plan in `saved` (layout of src/cuda/pipeline/workspace.cu) against the host plan, and the
 * padding rows of gate_up exactly 0. */
void check_saved(const inputs *in, const uint8_t *saved);
void check_counts(const inputs *in, const int32_t *counts);

/* Runs `cases` on each model (argv: [model-substring [case-substring]]) and returns the
 * exit status. */
int forward_main(int argc, char **argv, const named_case *cases, int n);

#endif
