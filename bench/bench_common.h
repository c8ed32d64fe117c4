/* What the C benchmarks share (bench_forward_cuda.c, bench_precision_cuda.c): exiting
 * on a failed CUDA or moefuse call, a model's shape, a xorshift generator for their
 * inputs and the uniform routing they time. */
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

/* A routing on the device: each token's K experts distinct and uniform over E, p = 1/K;
 * *ids [T, K] and *p [T, K] are new device buffers (cudaFree them). */
static inline void device_uniform_routing(uint64_t *rng, int T, int K, int E, int32_t **ids,
                                          float **p) {
    int32_t *hid = (int32_t *)malloc((size_t)T * K * 4 + 4);
    float *hp = (float *)malloc((size_t)T * K * 4 + 4);
    if (!hid || !hp) {
        fprintf(stderr, "device_uniform_routing: out of host memory\n");
        exit(1);
    }
    for (int t = 0; t < T; t++) {
        for (int k = 0; k < K; k++) {
            int e, dup;
            do {
                e = (int)(xorshift64(rng) % (uint64_t)E);
                dup = 0;
                for (int j = 0; j < k; j++) dup |= hid[t * K + j] == e;
            } while (dup);
            hid[t * K + k] = e;
            hp[t * K + k] = 1.0f / K;
        }
    }
    TRYC(cudaMalloc((void **)ids, (size_t)T * K * 4));
    TRYC(cudaMalloc((void **)p, (size_t)T * K * 4));
    TRYC(cudaMemcpy(*ids, hid, (size_t)T * K * 4, cudaMemcpyHostToDevice));
    TRYC(cudaMemcpy(*p, hp, (size_t)T * K * 4, cudaMemcpyHostToDevice));
    free(hid);
    free(hp);
}

#endif
