/* The reduce of d p in the backward: each slot's partial sums into its weight's grad.
 *
 *   dweights[s] = sum over nb = 0..parts-1 of dp_partial[slot_row[s], nb]   (fp32)
 *   dweights[s] = 0                                    where slot_row[s] = -1 (dropped)
 *
 * With expert parallelism (slot_row NULL) the sums were made on the experts' ranks
 * (ep_push_dp.cu) and land here one per slot: dweights[s] = ids[s] >= 0 ? dp[s] : 0.
 *
 * dgrad2 leaves d p = <da', a> of each row as one partial sum per column block of I
 * (a tile owns its columns, so no atomics); this adds them in block order, so the
 * result is bitwise reproducible. Writes nothing when the call failed (call_failed).
 *
 * One thread per slot. NOTE: T*K*(parts + 2) * 4 bytes: ~1 MB at T = 4096, K = 8, a
 * few microseconds, launch-bound. */
#include <cuda_runtime.h>
#include <stdint.h>

#include "check.h"
#include "kernels.h"

namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
reduce_dp_kernel(const __grid_constant__ mf_reduce_dp_params p) {
    if (*p.call_failed) return;
    const int64_t s = blockIdx.x * (int64_t)kThreads + threadIdx.x;
    if (s >= (int64_t)p.num_tokens * p.top_k) return;
    float acc = 0.0f;
    if (!p.slot_row) {  // expert parallelism: one sum per slot, pushed by its expert's rank
        if (__ldg(p.ids + s) >= 0) acc = __ldcg(p.dp_partial + s);
        p.dweights[s] = acc;
        return;
    }
    const int32_t r = __ldg(p.slot_row + s);
    if (r >= 0) {
        const float *part = p.dp_partial + (int64_t)r * p.parts;  // [parts]
        for (int nb = 0; nb < p.parts; nb++) acc += __ldg(part + nb);
    }
    p.dweights[s] = acc;
}

}  // namespace

extern "C" cudaError_t mf_reduce_dp_f32(const mf_reduce_dp_params *p, cudaStream_t stream) {
    if (!p || p->parts < 1 || p->top_k < 1 || p->num_tokens < 0) return cudaErrorInvalidValue;
    const int64_t n = (int64_t)p->num_tokens * p->top_k;
    if (n == 0) return cudaSuccess;  // the token arrays may be NULL
    if (!p->slot_row && !p->ids) return cudaErrorInvalidValue;
    reduce_dp_kernel<<<(unsigned)((n + kThreads - 1) / kThreads), kThreads, 0, stream>>>(*p);
    return cudaGetLastError();
}

extern "C" cudaError_t mf_reduce_dp_load(void) { return mf_load_kernels(reduce_dp_kernel); }
