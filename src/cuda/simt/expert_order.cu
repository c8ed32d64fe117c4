/* The order in which the weight-gradient kernel (src/cuda/sm90/wgrad_grouped.cu) hands out
 * the local experts' tiles, by rows(e) = expert_offsets[e + 1] - expert_offsets[e]:
 *
 *   1. heavy experts, 16 rows(e) > all rows: most rows first;
 *   2. the other experts with rows, lower id first;
 *   3. the experts without rows, lower id first;
 *
 * and order[E] = how many experts have rows (classes 1 and 2).
 *
 * A wgrad tile costs its expert's rows. An expert with more than 1/16 of all rows has
 * tiles worth 2-17% of a CTA's share at the Qwen3 shapes, so where its tiles land
 * decides the balance: handed out first and largest first (the scheduler's snake), they
 * spread evenly. The rest keep the id order: at moderate skew (busiest expert 2-5x the
 * mean) no expert is heavy, and the order is the unordered schedule but for the empty
 * experts. (Sorting them all looked slower there only when the variants were timed one
 * after the other under the GPU's power limit: see docs/decisions/0010-wgrad-expert-order
 * and 0013-power-limit-timing.) Tiles of
 * experts without rows are zeros, which the store warps write beside the GEMM tiles.
 *
 * The rank is a strict total order over the experts, so order[0..E-1] is a permutation of
 * 0..E-1 whatever the offsets hold (the wgrad kernel relies on it: every tile is run
 * once). One block: each thread ranks one expert against the others, read in chunks
 * through shared memory. E^2 comparisons: 16 K at E = 128, a few microseconds. */
#include <cuda_runtime.h>
#include <stdint.h>

#include "check.h"
#include "kernels.h"

namespace {

constexpr int kThreads = 1024;
constexpr int kChunk = 2048;   /* experts' keys staged in shared memory at a time */

/* The sort key: rows for heavy experts (>= 128 > 1), 1 for the other experts with
 * rows, 0 for those without. */
__device__ __forceinline__ int32_t order_key(int32_t rows, int32_t all_rows) {
    return (int64_t)16 * rows > all_rows ? rows : rows > 0;
}

__global__ void __launch_bounds__(kThreads)
expert_order_kernel(const int32_t *offsets, int num_experts, int32_t *order) {
    __shared__ int32_t keys[kChunk];
    const int32_t all_rows = offsets[num_experts] - offsets[0];
    int busy = 0;
    for (int e0 = 0; e0 < num_experts; e0 += kThreads) {
        const int e = e0 + threadIdx.x;
        const int32_t rows = e < num_experts ? offsets[e + 1] - offsets[e] : 0;
        busy += __syncthreads_count(rows > 0);
        const int32_t mine = order_key(rows, all_rows);
        int rank = 0;
        for (int f0 = 0; f0 < num_experts; f0 += kChunk) {
            const int n = min(kChunk, num_experts - f0);
            __syncthreads();   /* the previous chunk is read by every thread */
            for (int f = threadIdx.x; f < n; f += kThreads)
                keys[f] = order_key(offsets[f0 + f + 1] - offsets[f0 + f], all_rows);
            __syncthreads();
            if (e < num_experts)
                for (int f = 0; f < n; ++f)
                    rank += keys[f] > mine || (keys[f] == mine && f0 + f < e);
        }
        if (e < num_experts) order[rank] = e;
    }
    if (threadIdx.x == 0) order[num_experts] = busy;
}

}  // namespace

extern "C" cudaError_t mf_expert_order(const int32_t *expert_offsets, int num_experts,
                                       int32_t *order, cudaStream_t stream) {
    if (!expert_offsets || !order || num_experts <= 0) return cudaErrorInvalidValue;
    expert_order_kernel<<<1, kThreads, 0, stream>>>(expert_offsets, num_experts, order);
    return cudaGetLastError();
}

extern "C" cudaError_t mf_expert_order_load(void) { return mf_load_kernels(expert_order_kernel); }
