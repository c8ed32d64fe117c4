/* Expert parallelism, forward: the exchange of per-expert row counts and the layouts
 * that follow from it (see mf_ep_exchange_params in kernels.h).
 *
 * One block. Every rank sends its E counts to every rank (R * E words), so every rank
 * knows the whole count matrix M[source][expert] and computes the same padded layout
 * of every receiver: receiver q holds its experts' segments in expert order, each
 * padded to 128 rows, and within expert e the rows of source 0, then source 1, ...
 * each source's rows in its own slot order. That is the one-rank plan of the ranks'
 * tokens concatenated, so the GEMMs see the same rows in the same order as one rank
 * would (bitwise equal results). From M this rank takes its own receive layout and,
 * for each expert e, dest_base[e]: where its first row of e lands on e's rank; and the
 * arrival targets of its receive blocks (gemm1 starts a block when all its rows are in).
 *
 * A receiver routed more rows than its capacity (config.recv_capacity_factor) fails
 * the call on every rank alike (every rank sees the same M): no rank sends a row,
 * writes its layout, the saved header or expert_counts, and the error record says
 * MOEFUSE_ERR_CAPACITY with the receiver, its rows and the capacity (the highest such
 * receiver, on every rank). The epoch and the flags move on as in a good call, and no
 * arrival target is added, so the next call runs as usual.
 *
 * NOTE: R * E words each way and one scan: a few microseconds, mostly the flag
 * round trip. */
#include <cuda_runtime.h>
#include <stdint.h>

#include "check.h"
#include "transport/ep_wait.cuh"
#include "kernels.h"

namespace {

constexpr int kThreads = 256;

__device__ inline int pad128(int n) { return (n + 127) & ~127; }

__global__ void __launch_bounds__(kThreads)
ep_exchange_counts_kernel(const __grid_constant__ mf_ep_exchange_params p) {
    extern __shared__ int smem[];
    const int R = p.num_ranks, E = p.num_experts, EL = p.num_local_experts, me = p.rank;
    int *s_total = smem;           // [E] rows of expert e over all sources
    int *s_before = s_total + E;   // [E] rows of e from sources before me
    int *s_off = s_before + E;     // [E] first row of e on its rank
    int *s_seg_rows = s_off + E;   // [R] rows of each receiver, padded
    int *s_recv = s_seg_rows + R;  // [R] rows of each receiver
    __shared__ uint32_t s_epoch;
    __shared__ int s_overflow;     // receiver + 1 whose rows pass its capacity, 0 none

    uint32_t *sync = p.sync;
    if (threadIdx.x == 0) {
        s_epoch = sync[MF_EP_SYNC_EPOCH] + 1;
        sync[MF_EP_SYNC_EPOCH] = s_epoch;
        sync[MF_EP_SYNC_COMM_FAILED] = 0;
        s_overflow = 0;
    }
    __syncthreads();
    const uint32_t epoch = s_epoch;
    const int parity = epoch & 1;
    const bool own_failed = *(volatile int32_t *)&p.state->call_failed != 0;

    // ---- my counts to every rank, then the flag ----
    for (int i = threadIdx.x; i < R * E; i += kThreads) {
        const int q = i / E, e = i % E;
        int32_t *dst = reinterpret_cast<int32_t *>(mf::ep::sync_of(p.peers, q, R)) +
                       mf_ep_counts_word(parity, me, R, E);
        dst[e] = own_failed ? 0 : __ldg(p.send_counts + e);
    }
    mf::ep::raise_on_all(p.peers, me, R, MF_EP_FLAG_COUNTS, epoch, false);
    if (mf::ep::wait_all(sync, R, MF_EP_FLAG_COUNTS, epoch, p.timeout_ns, p.state,
                         MF_EP_STAGE_COUNTS)) {
        if (threadIdx.x == 0) mf::ep::fail_call(sync, p.state, p.gemm_num_rows);
        return;  // no layout: the rest of the call writes nothing and waits no more
    }

    // ---- the count matrix: totals, and the rows of sources before me ----
    const volatile int32_t *M = reinterpret_cast<const int32_t *>(sync) +
                                mf_ep_counts_word(parity, 0, R, E);
    for (int e = threadIdx.x; e < E; e += kThreads) {
        int total = 0, before = 0;
        for (int q = 0; q < R; q++) {
            const int v = M[(size_t)q * E + e];
            total += v;
            if (q < me) before += v;
        }
        s_total[e] = total;
        s_before[e] = before;
    }
    __syncthreads();
    // ---- every receiver's padded segment offsets (one thread per receiver) ----
    for (int q = threadIdx.x; q < R; q += kThreads) {
        int run = 0, rows = 0;
        for (int l = 0; l < EL; l++) {
            s_off[q * EL + l] = run;
            run += pad128(s_total[q * EL + l]);
            rows += s_total[q * EL + l];
        }
        s_seg_rows[q] = run;
        s_recv[q] = rows;
        // rows_cap holds the capacity and every expert's padding: run > rows_cap only
        // with rows > recv_capacity; both checked, so no layout can pass the buffers
        if (rows > p.recv_capacity || run > p.rows_cap) atomicMax(&s_overflow, q + 1);
    }
    __syncthreads();
    if (s_overflow) {
        if (threadIdx.x == 0) {
            mf::ep::record_failure(p.state, MOEFUSE_ERR_CAPACITY, s_overflow - 1,
                                   MF_EP_STAGE_COUNTS, s_recv[s_overflow - 1], p.recv_capacity);
            p.state->call_failed = 1;
            *p.gemm_num_rows = 0;
        }
        return;
    }

    // ---- where my rows go, and my receive layout ----
    for (int e = threadIdx.x; e < E; e += kThreads) p.dest_base[e] = s_off[e] + s_before[e];
    const int eb = me * EL, total = s_seg_rows[me];
    for (int l = threadIdx.x; l < EL; l += kThreads) {
        p.recv_counts[l] = s_total[eb + l];
        p.recv_offsets[l] = s_off[eb + l];
        if (p.user_counts && !own_failed) p.user_counts[l] = s_total[eb + l];
    }
    for (int j = threadIdx.x; j < p.rows_cap / MF_ROW_BLOCK_M; j += kThreads) {
        const int r0 = j * MF_ROW_BLOCK_M;
        int e = -1;
        if (r0 < total) {  // the largest l with offset <= r0 (empty experts share it)
            int lo = 0, hi = EL - 1;
            while (lo < hi) {
                const int mid = (lo + hi + 1) >> 1;
                if (s_off[eb + mid] <= r0) lo = mid; else hi = mid - 1;
            }
            e = lo;
        }
        p.row_block_expert[j] = e;
    }
    // the blocks gemm1 will wait for: 128 rows each (padding included)
    uint32_t *target = p.arrival_target;
    for (int b = threadIdx.x; b < total / MF_ROW_BLOCK_M; b += kThreads)
        target[b] += MF_ROW_BLOCK_M;
    if (threadIdx.x == 0) {
        p.recv_offsets[EL] = total;
        if (p.saved_header) {
            for (int w = 0; w < 16; w++) p.saved_header[w] = p.header_words[w];
            p.saved_header[p.header_send_failed_word] = own_failed ? 1 : 0;
        }
        *p.num_rows = total;  // may point into the header: written after it
        *p.gemm_num_rows = total;
    }
}

}  // namespace

extern "C" cudaError_t mf_ep_exchange_counts(const mf_ep_exchange_params *p,
                                             cudaStream_t stream) {
    if (!p || p->num_ranks < 1 || p->num_experts % p->num_ranks ||
        p->num_local_experts * p->num_ranks != p->num_experts || p->rank < 0 ||
        p->rank >= p->num_ranks || p->rows_cap % MF_ROW_BLOCK_M || p->recv_capacity < 0 ||
        !p->arrival_target)
        return cudaErrorInvalidValue;
    const size_t smem = sizeof(int) * (3 * (size_t)p->num_experts + 2 * (size_t)p->num_ranks);
    if (smem > 48 * 1024) {
        const cudaError_t err = cudaFuncSetAttribute(
            ep_exchange_counts_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (err != cudaSuccess) return err;
    }
    ep_exchange_counts_kernel<<<1, kThreads, smem, stream>>>(*p);
    return cudaGetLastError();
}

extern "C" cudaError_t mf_ep_exchange_counts_load(void) { return mf_load_kernels(ep_exchange_counts_kernel); }
