/* The order in which the weight-gradient kernel (sm90_wgrad_grouped_bf16.cu) hands out
 * the local experts' tiles: by rows(e) = expert_offsets[e + 1] - expert_offsets[e], most
 * first, ties by lower expert,
 *
 *   order[rank(e)] = e,   rank(e) = #{f : rows(f) > rows(e) or (rows(f) = rows(e), f < e)}
 *
 * and order[E] = how many experts have rows (they come first).
 *
 * A wgrad tile costs its expert's rows. Handed out most rows first (the scheduler's
 * snake), the costliest tiles spread evenly over the CTAs, and the tiles of experts
 * without rows (zeros) come last, where the store warps write them beside the GEMM
 * tiles. NOTE: at moderate skew (busiest expert 2-5x the mean) this order cost 0-20% per
 * kernel against the id order; sorting only the experts with more than 1/16 of the rows
 * is the candidate fix, written but not GPU-run (bench/NOTES.md v11).
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
constexpr int kChunk = 2048;   /* experts' rows staged in shared memory at a time */

__global__ void __launch_bounds__(kThreads)
expert_order_kernel(const int32_t *offsets, int num_experts, int32_t *order) {
    __shared__ int32_t rows[kChunk];
    int busy = 0;
    for (int e0 = 0; e0 < num_experts; e0 += kThreads) {
        const int e = e0 + threadIdx.x;
        const int32_t mine = e < num_experts ? offsets[e + 1] - offsets[e] : 0;
        busy += __syncthreads_count(mine > 0);
        int rank = 0;
        for (int f0 = 0; f0 < num_experts; f0 += kChunk) {
            const int n = min(kChunk, num_experts - f0);
            __syncthreads();   /* the previous chunk is read by every thread */
            for (int f = threadIdx.x; f < n; f += kThreads)
                rows[f] = offsets[f0 + f + 1] - offsets[f0 + f];
            __syncthreads();
            if (e < num_experts)
                for (int f = 0; f < n; ++f)
                    rank += rows[f] > mine || (rows[f] == mine && f0 + f < e);
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
