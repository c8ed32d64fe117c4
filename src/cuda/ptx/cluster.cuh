/* Thread-block cluster (sm_90) wrappers: this CTA's rank in its cluster, a barrier over
 * the whole cluster, an mbarrier arrival in another CTA's shared memory, and a TMA load
 * multicast to several CTAs of the cluster. Inline device helpers only. */
#pragma once

#include <cuda.h>
#include <stdint.h>

#include "ptx/mbarrier.cuh"

namespace mf {
namespace ptx {

__device__ __forceinline__ uint32_t cluster_ctarank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

/* Every non-exited thread of the cluster: what each did before is visible to all after.
 * (Not .aligned: the callers' warps may have diverged.) */
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
}

/* One arrival on the mbarrier at the same shared-memory offset as `bar`, in CTA `cta` of
 * the cluster (this CTA included), released at cluster scope. */
__device__ __forceinline__ void mbar_arrive_cluster(uint64_t *bar, uint32_t cta) {
    asm volatile(
        "{\n\t.reg .b32 remote;\n\t"
        "mapa.shared::cluster.u32 remote, %0, %1;\n\t"
        "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n\t}" ::"r"(
            smem_u32(bar)),
        "r"(cta)
        : "memory");
}

/* tma_load_2d into every CTA of cta_mask: the box lands at dst's offset in each, and its
 * bytes complete on the mbarrier at bar's offset in each. */
__device__ __forceinline__ void tma_load_2d_multicast(void *dst, const CUtensorMap *map,
                                                      uint64_t *bar, int32_t c0, int32_t c1,
                                                      uint16_t cta_mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        ".multicast::cluster [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smem_u32(dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1),
        "h"(cta_mask)
        : "memory");
}

}  // namespace ptx
}  // namespace mf
