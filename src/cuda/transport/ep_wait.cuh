/* What the expert-parallel kernels share: raising a flag on every rank, the bounded
 * wait for every rank's flag, and the error record of a failed wait. Device only. */
#pragma once

#include <stdint.h>

#include "transport/ep_sync.h"
#include "internal.h"
#include "kernels.h"
#include "ptx/flags.cuh"

namespace mf {
namespace ep {

__device__ __forceinline__ uint32_t *sync_of(void *const *peers, int rank, int num_ranks) {
    return static_cast<uint32_t *>(peers[MF_WIN_SYNC * num_ranks + rank]);
}

/* The first failure since moefuse_layer_check, kept until it reads it. */
__device__ inline void record_failure(mf_plan_state *st, int code, int peer, int stage,
                                      uint32_t seen, uint32_t want) {
    if (atomicCAS(&st->record.code, 0, -1) != 0) return;
    st->record.token = peer;
    st->record.slot = stage;
    st->record.value = (int32_t)seen;
    st->record.expected = (int32_t)want;
    __threadfence();
    atomicExch(&st->record.code, code);
}

/* Makes the calling block's earlier writes (to peers included) visible at system scope,
 * then (thread 0) raises `flag` of this rank on every rank: (epoch << 1) | failed. */
__device__ inline void raise_on_all(void *const *peers, int rank, int num_ranks, int flag,
                                    uint32_t epoch, bool failed) {
    ptx::fence_sys();
    __syncthreads();
    if (threadIdx.x != 0) return;
    ptx::fence_sys();
    const uint32_t v = (epoch << 1) | (failed ? 1u : 0u);
    for (int q = 0; q < num_ranks; q++)
        ptx::st_release_sys(sync_of(peers, q, num_ranks) + mf_ep_flag_word(flag, rank, num_ranks), v);
}

/* Waits until every rank raised `flag` here for `epoch`, at most timeout_ns per rank.
 * Returns true (in every thread) when a wait ran out or a rank raised it as failed;
 * the first such is recorded as MOEFUSE_ERR_TIMEOUT. */
__device__ inline bool wait_all(const uint32_t *sync, int num_ranks, int flag, uint32_t epoch,
                                int64_t timeout_ns, mf_plan_state *st, int stage) {
    __shared__ int s_failed;
    if (threadIdx.x == 0) s_failed = 0;
    __syncthreads();
    const uint32_t want = epoch << 1;
    for (int q = threadIdx.x; q < num_ranks; q += blockDim.x) {
        const uint32_t *f = sync + mf_ep_flag_word(flag, q, num_ranks);
        const uint64_t t0 = ptx::globaltimer_ns();
        for (;;) {
            const uint32_t seen = ptx::ld_acquire_sys(f);
            if ((int32_t)((seen & ~1u) - want) >= 0) {
                if (seen & 1u) {
                    record_failure(st, MOEFUSE_ERR_TIMEOUT, q, stage, seen, want);
                    s_failed = 1;
                }
                break;
            }
            if ((int64_t)(ptx::globaltimer_ns() - t0) > timeout_ns) {
                record_failure(st, MOEFUSE_ERR_TIMEOUT, q, stage, seen, want);
                s_failed = 1;
                break;
            }
            __nanosleep(128);
        }
    }
    __syncthreads();
    return s_failed != 0;
}

/* A GEMM producer's wait for the rows of a 128-row receive block: mf_ep_push_rows counts
 * every row it writes into block b (padding included) on arrivals[b], and the block is
 * complete when the count reaches target[b] (running sums: wrap-safe compare). The
 * generic-proxy acquire, then a proxy fence, orders the producer's TMA reads after the
 * rows. At most timeout_ns per block: a wait that runs out is recorded
 * (MOEFUSE_ERR_TIMEOUT, the block as peer -1 - b, at `stage`) and fails the call. */
struct RowArrivals {
    const uint32_t *arrivals;   /* [blocks], this rank's sync window; null: no waits */
    const uint32_t *target;     /* [blocks] */
    mf_plan_state *state;
    int64_t timeout_ns;
    int stage;                  /* mf_ep_stage of the record */
};

/* Returns false when the wait ran out: the caller then waits for no later block. */
__device__ inline bool wait_block_rows(const RowArrivals &r, int m_block) {
    const uint32_t want = r.target[m_block];
    const uint32_t *count = r.arrivals + m_block;
    uint32_t seen = ptx::ld_acquire_sys(count);
    bool in = true;
    if ((int32_t)(seen - want) < 0) {
        const uint64_t t0 = ptx::globaltimer_ns();
        while ((int32_t)((seen = ptx::ld_acquire_sys(count)) - want) < 0) {
            if ((int64_t)(ptx::globaltimer_ns() - t0) > r.timeout_ns) {
                record_failure(r.state, MOEFUSE_ERR_TIMEOUT, -1 - m_block, r.stage, seen, want);
                r.state->call_failed = 1;
                in = false;
                break;
            }
            __nanosleep(64);
        }
    }
    asm volatile("fence.proxy.async.global;" ::: "memory");
    return in;
}

/* A failed wait: this call writes no output of this rank and waits no more. */
__device__ inline void fail_call(uint32_t *sync, mf_plan_state *st, int32_t *gemm_num_rows) {
    sync[MF_EP_SYNC_COMM_FAILED] = 1;
    st->call_failed = 1;
    if (gemm_num_rows) *gemm_num_rows = 0;
}

}  // namespace ep
}  // namespace mf
