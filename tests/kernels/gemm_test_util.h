/* What the sm_90a GEMM kernel tests (test_gemm_sm90.cu, test_gemm_sm90_bwd.cu,
 * test_gemm_sm90_bwd_time.cu) share: bf16 conversions, the device check, device copies of
 * host vectors, the expert-sorted row layout the plan would build, poison checks and the
 * hash fill of the timing runs. Bodies in gemm_test_util.cu, but for the two templates. */
#ifndef MOEFUSE_GEMM_TEST_UTIL_H
#define MOEFUSE_GEMM_TEST_UTIL_H

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include <vector>

extern "C" {
#include "harness.h"
}

/* Record a failed CUDA call and return from the (void) case. */
#define CUDA_OK(call)                                                                  \
    do {                                                                               \
        cudaError_t e_ = (call);                                                       \
        CHECK(e_ == cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_));             \
        if (e_ != cudaSuccess) return;                                                 \
    } while (0)

uint16_t f2bf(float f); /* round to nearest even; NaN stays NaN */
double bf2d(uint16_t v);

/* A GPU with compute capability 9.0, or th_skip with the reason and 0. */
int have_sm90(void);
int num_sms(void);

/* A device copy of v (16 bytes of slack past its end; nullptr when cudaMalloc fails), and
 * n elements copied back. Templates, so their bodies are here. */
template <class T>
static T *dev_upload(const std::vector<T> &v) {
    T *p = nullptr;
    if (cudaMalloc((void **)&p, v.size() * sizeof(T) + 16) != cudaSuccess) return nullptr;
    cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
    return p;
}
template <class T>
static std::vector<T> dev_download(const T *p, size_t n) {
    std::vector<T> v(n);
    cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost);
    return v;
}

/* ---- the routing layout the plan would build ------------------------------------------ */
struct Layout {
    int E, num_rows, rows_cap, num_slots;
    std::vector<int> counts;
    std::vector<int32_t> offsets;          /* [E + 1] first row of each expert (padded) */
    std::vector<int32_t> row_block_expert; /* [rows_cap / 128] */
    std::vector<int32_t> row_slot;         /* [rows_cap] */
    std::vector<int> row_expert;           /* [rows_cap], -1 for padding / unused */
};

/* Slots are a random permutation; `dropped` more slots are routed to no row here. */
Layout make_layout(const std::vector<int> &counts, int extra_rows, int dropped);

/* Each row's routing weight as the dispatch writes it: slot_weight[row_slot[r]], 0 for
 * padding rows and rows past num_rows ([rows_cap]). */
std::vector<float> row_weights(const Layout &L, const std::vector<float> &slot_weight);

/* E per-expert row counts summing to total, spread unevenly: weight ~ 0.25 + U(0,1)^2 * 3,
 * the rounding remainder on one random expert. */
std::vector<int> skewed_counts(int E, int total);
/* The same with weight ~ 0.02 + U(0,1)^4: the busiest expert ~5x the mean, some nearly
 * idle (routing skew as a training run meets it). */
std::vector<int> heavy_skew_counts(int E, int total);

/* Every element is the poison value 0xFFFF (bf16 NaN) that outputs are filled with. */
bool all_poison(const uint16_t *p, size_t n);

/* How many combine rows ([num_slots, H]) of slots no row maps to are not all poison. */
int unrouted_rows_written(const Layout &L, const uint16_t *comb, int H);

float median(std::vector<float> v);

/* Inputs of the timing runs come from a counter hash (same values on host and device)
 * so the big buffers are filled on the GPU: out[i] = bf16(hash(i, seed) * scale), and
 * hash_bf16 is the value it writes at i. */
__global__ void fill_hash_bf16(__nv_bfloat16 *out, size_t n, uint32_t seed, float scale);
double hash_bf16(size_t i, uint32_t seed, float scale);

#endif
