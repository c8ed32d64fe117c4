/* What the C benchmarks share (bench_forward_cuda.c, bench_precision_cuda.c): exiting
 * on a failed CUDA or moefuse call, a model's shape, and a xorshift generator for their
 * inputs. */
#ifndef MOEFUSE_BENCH_COMMON_H
#define MOEFUSE_BENCH_COMMON_H

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "moefuse.h"

#define TRYC(call)                                                                         \
    do {                                                                                   \
        cudaError_t e_ = (call);                                                           \
        if (e_ != cudaSuccess) {                                                           \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,                  \
                    cudaGetErrorString(e_));                                               \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)
#define TRYM(call)                                                                         \
    do {                                                                                   \
        moefuse_status s_ = (call);                                                        \
        if (s_ != MOEFUSE_OK) {                                                            \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,                  \
                    moefuse_last_error());                                                 \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

typedef struct model {
    const char *name;
    int H, I, E, K;
} model;

/* xorshift64: the next value of *state (nonzero). */
static inline uint64_t xorshift64(uint64_t *state) {
    uint64_t x = *state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *state = x;
}

#endif
