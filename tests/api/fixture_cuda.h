/* The device part of the API tests' fixture (built only with CUDA): what the CUDA
 * backend tests (test_cuda_*.c) share: the model shapes, the check macros, the sm_90
 * device check, random weight rows and random routing. Plain C11; the bodies are in
 * fixture_cuda.c. */
#ifndef MOEFUSE_TESTS_FIXTURE_CUDA_H
#define MOEFUSE_TESTS_FIXTURE_CUDA_H

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "harness.h"
#include "moefuse.h"

typedef struct model {
    const char *name;
    int H, I, E, K;
} model;

/* One case of a suite: its function and the words of its name. */
typedef struct named_case {
    void (*fn)(void);
    const char *what;
} named_case;

/* Runs a suite over models: for each model whose name contains argv[1] (when given),
 * begin(m), every case whose words contain argv[2] (when given), named
 * "<suite> <model> <words>", then end(). Returns th_finish(). */
int ct_run_models(int argc, char **argv, const char *suite, const model *models, int n_models,
                  void (*begin)(const model *m), void (*end)(void), const named_case *cases,
                  int n_cases);

/* Record a failed CUDA / moefuse call and jump to the caller's `done:` label. */
#define CUDA_OK(call)                                                                      \
    do {                                                                                   \
        cudaError_t e_ = (call);                                                           \
        CHECK(e_ == cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_));                 \
        if (e_ != cudaSuccess) goto done;                                                  \
    } while (0)

#define MF_OK(call)                                                                        \
    do {                                                                                   \
        moefuse_status s_ = (call);                                                        \
        CHECK(s_ == MOEFUSE_OK, "%s: %s: %s", #call, moefuse_status_string(s_),            \
              moefuse_last_error());                                                       \
        if (s_ != MOEFUSE_OK) goto done;                                                   \
    } while (0)

/* 1 when device 0 is sm_90 (its properties in *prop); else 0 with the reason to skip
 * written to skip[skip_size]. */
int ct_detect_sm90(char *skip, size_t skip_size, struct cudaDeviceProp *prop);

/* rows x cols bf16 of N(0, scale^2): windows at random offsets of one pool of normals,
 * so every row differs (a wrong expert or row shows) at a fraction of the cost of
 * drawing 2.4 G normals for the larger model. */
void ct_fill_rows(uint16_t *out, int64_t rows, int cols, double scale);

/* The weights of model m: w13 [E, 2I, H] rows of N(0, 1/H), w2 [E, H, I] rows of
 * N(0, 1/I), and fp64 copies of the same bf16 values in w13_ref / w2_ref. */
void ct_fill_weights(const model *m, uint16_t *w13, uint16_t *w2, double *w13_ref,
                     double *w2_ref);

typedef enum routing {
    ROUTE_RANDOM,      /* K distinct uniform experts per token */
    ROUTE_ONE_EXPERT,  /* every token: one expert (the same for all) at a random k, rest -1 */
    ROUTE_FEW_EXPERTS, /* every token: experts from a set of 3, rest -1: most experts empty */
    ROUTE_DROPPED,     /* random, 30% of slots -1, every 5th token and the first/last fully */
    ROUTE_ZIPF,        /* K distinct experts drawn by popularity 1/rank^1.2 */
} routing;

/* ids [T, K] of E <= 1024 experts under routing r. */
void ct_draw_ids(int T, int K, int E, routing r, int32_t *ids);

/* p [T, K]: per token, positive weights summing to 1. */
void ct_draw_weights(int T, int K, float *p);

/* W13 packed [E, 2I, H] <-> its gate and up halves [E, I, H] each, half_bytes = I H times
 * the element's bytes (to_halves 1: packed -> halves), queued on stream. */
cudaError_t ct_w13_halves_copy(void *packed, void *gate, void *up, size_t half_bytes, int E,
                               int to_halves, cudaStream_t stream);

#endif
