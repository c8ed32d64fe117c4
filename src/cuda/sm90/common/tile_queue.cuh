/* Tiles taken in a global order (sm_90a): the producer thread of each CTA takes the next
 * index of the order from a counter in global memory when it starts a tile, and passes it
 * to the CTA's consumers and store warps through a queue in shared memory, so the tiles
 * start in order whichever CTA is free. Used by the fused kernels, whose tiles wait for
 * other tiles (src/cuda/sm90/fused_forward.cu, src/cuda/sm90/fused_backward.cu), with the
 * bounded wait at the end of this file.
 * NOTE: why taking in order matters: with the tiles handed out round-robin by index, as
 * the single GEMMs do, tiles of different K lengths let CTAs drift apart, and a tile
 * waited for one that a slower CTA had not reached (see
 * docs/decisions/0009-fused-tile-queue-order). */
#pragma once

#include "ptx/flags.cuh"
#include "sm90/common/grouped_gemm.cuh"

namespace mf {
namespace sm90 {

constexpr int kQueueDepth = 4;
constexpr int kQueueReaderWarps = kConsumerWarpgroups * 4 + kStoreWarps;
constexpr int kQueueWriter = kConsumerWarpgroups * 128;   /* the producer thread */

struct TileQueue {
    int32_t tile[kQueueDepth];    /* an index of the order, -1: no more tiles */
    uint64_t full[kQueueDepth];   /* written (the producer arrives) */
    uint64_t empty[kQueueDepth];  /* read (lane 0 of every reader warp arrives) */
};

/* Called by the thread that initialises the ring, before the CTA's first sync. */
__device__ __forceinline__ void tile_queue_init(TileQueue *q) {
    for (int s = 0; s < kQueueDepth; ++s) {
        ptx::mbar_init(&q->full[s], 1);
        ptx::mbar_init(&q->empty[s], kQueueReaderWarps);
    }
    ptx::mbar_fence_init();
}

/* One thread's walk through the queue (each role keeps its own copy). */
struct TileQueueCursor {
    TileQueue *queue;
    int slot;
    uint32_t phase;
    int ahead;   /* producer: the index drawn for the tile after this one (-1: none yet) */

    __device__ __forceinline__ explicit TileQueueCursor(TileQueue *q)
        : queue(q), slot(0), phase(0), ahead(-1) {}

    /* Producer thread: the next index of the order from the global counter. The index of
     * the tile after it is drawn at the end of next() (refill) and used one tile later, so
     * the atomic's round trip (about a microsecond) is not on the producer's path between
     * two tiles, where the ring would run dry by that much. No index is lost: a CTA stops
     * at an index past the end, and the one it drew ahead is larger still.
     * NOTE: this keeps the order's guarantee: a CTA works on its tiles in the order it
     * drew them, so the earliest unfinished tile is always one a CTA is working on.
     * NOTE: the refill comes after the index went to the queue so that nothing else is
     * live in the register the atomic returns into: drawn before, ptxas copied the result
     * to the loop-carried register at once (a MOV that waits for the atomic). */
    __device__ __forceinline__ int draw(int *counter) {
        const int i = ahead >= 0 ? ahead : atomicAdd(counter, 1);
        ahead = -1;
        return i;
    }

    /* The CTA's next index of the order, -1 when none is left. Called by the producer
     * thread and by whole warps of readers (the consumers, the store warps). take() runs
     * on the producer thread only: it draws indices (draw) until one is a tile of the
     * order, or returns -1 past the end. */
    template <class Take>
    __device__ __forceinline__ int next(int *counter, Take &&take) {
        TileQueue *q = queue;
        int t;
        if (threadIdx.x == kQueueWriter) {
            t = take();
            /* A fresh barrier counts as having completed the phase before phase 0. */
            ptx::mbar_wait(&q->empty[slot], phase ^ 1u);
            q->tile[slot] = t;
            ptx::mbar_arrive(&q->full[slot]);
            if (t >= 0) ahead = atomicAdd(counter, 1);   /* refill */
        } else {
            /* Lane 0 reads for its warp (every reader calls with its whole warp): 11
             * arrivals per tile instead of 352 on one barrier, at the start of the
             * consumers' tile, when the tensor cores wait. */
            if (threadIdx.x % 32 == 0) {
                ptx::mbar_wait(&q->full[slot], phase);
                t = *static_cast<volatile int32_t *>(&q->tile[slot]);
                ptx::mbar_arrive(&q->empty[slot]);
            }
            t = __shfl_sync(0xffffffffu, t, 0);
        }
        if (++slot == kQueueDepth) {
            slot = 0;
            phase ^= 1u;
        }
        return t;
    }
};

/* ---- a tile's wait for earlier tiles of the order -------------------------------------
 * A fused kernel's tile may wait for a count that earlier tiles of the order raise (the
 * fused forward's act_ready[block], the fused backward's dW2 reads). The order makes the
 * count arrive (see each kernel); a wait that runs past its bound is a bug (a lost
 * increment, a count that can never be reached, a tile out of order) and traps, as
 * ptx::mbar_wait does: the launch fails with an error the host's check reports instead of
 * hanging the job. The trap takes the count's address, the value waited for and the last
 * value seen as operands, so the trapping thread holds them in registers (cuda-gdb, or a
 * core dump with CUDA_ENABLE_COREDUMP_ON_EXCEPTION=1); no printf: a call anywhere in
 * these kernels makes ptxas serialize every wgmma.
 * bound_ns() gives the bound (kOrderWaitNs, plus what the awaited tiles may wait for
 * themselves); it is called only once a wait has polled kOrderPollsPerClock times.
 * NOTE: the fast path is one acquire load and a compare, as before the bound; a wait that
 * polls reads the global timer when it starts and then once every kOrderPollsPerClock
 * polls (two loops, so that ptxas cannot turn the read into a predicated one per poll). */
constexpr int64_t kOrderWaitNs = 10ll * 1000 * 1000 * 1000;   /* far beyond any tile's run */
constexpr uint32_t kOrderPollsPerClock = 256;

template <uint32_t kSleepNs, class Bound>
__device__ __forceinline__ void wait_order_count(const uint32_t *count, uint32_t want,
                                                 Bound &&bound_ns) {
    uint32_t seen = ptx::ld_acquire_gpu(count);
    if (seen >= want) return;
    const uint64_t t0 = ptx::globaltimer_ns();
#pragma unroll 1
    for (;;) {
#pragma unroll 1
        for (uint32_t i = 0; i < kOrderPollsPerClock; ++i) {
            __nanosleep(kSleepNs);
            if ((seen = ptx::ld_acquire_gpu(count)) >= want) return;
        }
        if ((int64_t)(ptx::globaltimer_ns() - t0) > bound_ns())
            asm volatile("trap;" ::"l"(count), "r"(want), "r"(seen) : "memory");
    }
}

}  // namespace sm90
}  // namespace mf
