/* TMA wrappers: 2D tiled loads (cp.async.bulk.tensor) completing on an mbarrier, with or
 * without an L2 eviction hint, and tensor-map prefetch; bulk shared-to-global copies
 * (cp.async.bulk) with their commit and waits, and the async-proxy fence before them;
 * also the named barrier and setmaxnreg. Inline device helpers only. */
#pragma once

#include <cuda.h>
#include <stdint.h>

#include "sm90/ptx/mbarrier.cuh"

namespace mf {
namespace ptx {

/* Pulls the 128-byte descriptor into the constant cache ahead of the first copy. */
__device__ __forceinline__ void tma_prefetch_desc(const CUtensorMap *map) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

/* Copies the box at (c0 = inner/contiguous coordinate, c1 = outer) into dst; the
 * bytes land on `bar` as completed transactions. */
__device__ __forceinline__ void tma_load_2d(void *dst, const CUtensorMap *map, uint64_t *bar,
                                            int32_t c0, int32_t c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4}], [%2];" ::"r"(smem_u32(dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
        : "memory");
}

/* Same, with an L2 eviction-priority hint (a createpolicy value). */
__device__ __forceinline__ void tma_load_2d_hint(void *dst, const CUtensorMap *map,
                                                 uint64_t *bar, int32_t c0, int32_t c1,
                                                 uint64_t policy) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        ".L2::cache_hint [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smem_u32(dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1),
        "l"(policy)
        : "memory");
}

/* A plain bulk copy global -> shared of `bytes` (a multiple of 16; both addresses 16-byte
 * aligned), counted on the mbarrier like a tensor copy (complete_tx). */
__device__ __forceinline__ void bulk_load_g2s(void *dst, const void *src, uint32_t bytes,
                                              uint64_t *bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar))
        : "memory");
}

__device__ __forceinline__ uint64_t l2_policy_evict_last() {
    uint64_t p;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
    return p;
}

/* Orders this thread's generic-proxy shared-memory accesses before later async-proxy
 * (TMA, wgmma) accesses to the same memory. */
__device__ __forceinline__ void fence_proxy_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

/* Bulk copy of `bytes` (a multiple of 16, both addresses 16-byte aligned) from shared
 * to global memory, tracked in this thread's bulk async-group. */
__device__ __forceinline__ void bulk_store_s2g(void *dst, const void *src, uint32_t bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
                 "r"(smem_u32(src)), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void bulk_commit() {
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

/* Until this thread's bulk groups have finished reading shared memory (the buffer may be
 * overwritten); the global writes may still be in flight. */
__device__ __forceinline__ void bulk_wait_read_all() {
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}

/* Until this thread's bulk groups have completed entirely. */
__device__ __forceinline__ void bulk_wait_all() {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

/* Barrier over `threads` threads (a multiple of 32) on hardware barrier `id` (1..15;
 * 0 is __syncthreads). */
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

/* Register budget of the warpgroup executing it (sm_90a); all its warps must run it. */
template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}

template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}

}  // namespace ptx
}  // namespace mf
