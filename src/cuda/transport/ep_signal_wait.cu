/* Expert parallelism: raise a flag on every rank and/or wait for every rank's flag
 * (see mf_ep_signal_params in kernels.h). One block of 64 threads, one rank per thread
 * in the wait. And the wait for every received row of a call before an FP8 quantizer
 * reads them (mf_ep_wait_rows_params), one receive block per thread at a time.
 *
 * Raised after a previous kernel of this stream wrote to peers (gemm2's combine rows,
 * dgrad1's dx rows, the d p pushes): that kernel's writes are complete when it ends
 * (stream order), and the release store at system scope publishes them with the flag. */
#include <cuda_runtime.h>
#include <stdint.h>

#include "check.h"
#include "transport/ep_wait.cuh"
#include "kernels.h"

namespace {

constexpr int kThreads = 64;

__global__ void __launch_bounds__(kThreads)
ep_signal_wait_kernel(const __grid_constant__ mf_ep_signal_params p) {
    uint32_t *sync = p.sync;
    __shared__ uint32_t s_epoch;
    __shared__ bool s_failed;
    if (threadIdx.x == 0) {
        if (p.new_epoch) {
            sync[MF_EP_SYNC_EPOCH] += 1;
            sync[MF_EP_SYNC_COMM_FAILED] = p.state->saved_rejected ? 1 : 0;
        }
        s_epoch = sync[MF_EP_SYNC_EPOCH];
        s_failed = sync[MF_EP_SYNC_COMM_FAILED] != 0;
    }
    __syncthreads();
    const uint32_t epoch = s_epoch;
    const bool failed = s_failed;
    if (p.signal) mf::ep::raise_on_all(p.peers, p.rank, p.num_ranks, p.flag, epoch, failed);
    if (!p.wait || failed) return;
    __syncthreads();
    if (mf::ep::wait_all(sync, p.num_ranks, p.flag, epoch, p.timeout_ns, p.state, p.stage)) {
        if (threadIdx.x == 0) mf::ep::fail_call(sync, p.state, p.gemm_num_rows);
        return;
    }
    if (!p.arrival_target) return;
    const int blocks = *p.gemm_num_rows / MF_ROW_BLOCK_M;
    for (int b = threadIdx.x; b < blocks; b += kThreads) p.arrival_target[b] += MF_ROW_BLOCK_M;
}

__global__ void __launch_bounds__(kThreads)
ep_wait_rows_kernel(const __grid_constant__ mf_ep_wait_rows_params p) {
    const mf::ep::RowArrivals in = {p.rows_in.arrivals, p.rows_in.target, p.rows_in.state,
                                    p.rows_in.timeout_ns, p.rows_in.stage};
    __shared__ int s_failed;
    if (threadIdx.x == 0) s_failed = 0;
    const int blocks = *p.gemm_num_rows / MF_ROW_BLOCK_M;
    __syncthreads();
    for (int b = threadIdx.x; b < blocks; b += kThreads) {
        // once a block's wait ran out the call has failed: no thread waits any more
        if (*(volatile int *)&s_failed || !mf::ep::wait_block_rows(in, b)) {
            s_failed = 1;
            break;
        }
    }
    __syncthreads();
    if (s_failed && threadIdx.x == 0) mf::ep::fail_call(p.sync, p.rows_in.state, p.gemm_num_rows);
}

}  // namespace

extern "C" cudaError_t mf_ep_wait_rows(const mf_ep_wait_rows_params *p, cudaStream_t stream) {
    if (!p || !p->rows_in.arrivals || !p->rows_in.target || !p->rows_in.state || !p->sync ||
        !p->gemm_num_rows)
        return cudaErrorInvalidValue;
    ep_wait_rows_kernel<<<1, kThreads, 0, stream>>>(*p);
    return cudaGetLastError();
}

extern "C" cudaError_t mf_ep_signal_wait(const mf_ep_signal_params *p, cudaStream_t stream) {
    if (!p || p->num_ranks < 1 || p->rank < 0 || p->rank >= p->num_ranks || p->flag < 0 ||
        p->flag >= MF_EP_NUM_FLAGS)
        return cudaErrorInvalidValue;
    ep_signal_wait_kernel<<<1, kThreads, 0, stream>>>(*p);
    return cudaGetLastError();
}

extern "C" cudaError_t mf_ep_signal_wait_load(void) {
    return mf_load_kernels(ep_signal_wait_kernel, ep_wait_rows_kernel);
}
