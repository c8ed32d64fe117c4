/* cp.async (the per-thread 16-byte asynchronous copy, global -> shared) and the mbarrier
 * arrival that fires when a thread's earlier cp.async copies have landed. The row gather
 * of the grouped GEMMs' producer uses them where TMA has no per-row form on sm_90.
 * Inline device helpers only. */
#pragma once

#include <stdint.h>

#include "ptx/mbarrier.cuh"

namespace mf {
namespace ptx {

/* Copies 16 bytes from global src to shared dst (both 16-byte aligned), bypassing L1;
 * with src_bytes = 0 nothing is read and dst is zero-filled (src must still be a valid
 * address). */
__device__ __forceinline__ void cp_async_16_zfill(void *dst, const void *src,
                                                  uint32_t src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_u32(dst)),
                 "l"(src), "r"(src_bytes)
                 : "memory");
}

/* One arrival on bar once all of this thread's earlier cp.async copies completed. The
 * arrival counts against the barrier's expected count (.noinc): a barrier that waits for
 * N such threads is initialised with N more arrivals. */
__device__ __forceinline__ void cp_async_mbar_arrive_noinc(uint64_t *bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_u32(bar))
                 : "memory");
}

}  // namespace ptx
}  // namespace mf
