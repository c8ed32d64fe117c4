/* Expert parallelism, backward: d p of each received row to its source rank.
 *
 *   dp[source][slot] = sum over nb = 0..parts-1, in order, of dp_partial[r, nb]
 *   for each row r < num_rows with row_slot[r] = slot * R + source >= 0
 *
 * The same sum in the same order as the one-rank reduce (reduce_dp.cu), so d p has the
 * one-rank bits; the source's reduce_dp then copies its slots' values to dweights.
 * One thread per row. NOTE: rows * (parts + 1) * 4 bytes read, 4 bytes per row
 * written over NVLink: launch-bound. */
#include <cuda_runtime.h>
#include <stdint.h>

#include "check.h"
#include "internal.h"
#include "kernels.h"

namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
ep_push_dp_kernel(const __grid_constant__ mf_ep_push_dp_params p) {
    const int num_rows = *p.num_rows;
    const int R = p.num_ranks;
    for (int r = blockIdx.x * kThreads + threadIdx.x; r < num_rows; r += gridDim.x * kThreads) {
        const int32_t v = __ldg(p.row_slot + r);
        if (v < 0) continue;
        const float *part = p.dp_partial + (int64_t)r * p.parts;
        float acc = 0.0f;
        for (int nb = 0; nb < p.parts; nb++) acc += __ldg(part + nb);
        static_cast<float *>(p.peers[MF_WIN_DP * R + v % R])[v / R] = acc;
    }
}

}  // namespace

extern "C" cudaError_t mf_ep_push_dp(const mf_ep_push_dp_params *p, cudaStream_t stream) {
    if (!p || p->parts < 1 || p->num_ranks < 1 || p->num_sms < 1) return cudaErrorInvalidValue;
    ep_push_dp_kernel<<<p->num_sms * 4, kThreads, 0, stream>>>(*p);
    return cudaGetLastError();
}

extern "C" cudaError_t mf_ep_push_dp_load(void) { return mf_load_kernels(ep_push_dp_kernel); }
