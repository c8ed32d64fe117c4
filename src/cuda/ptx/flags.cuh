/* Flags between ranks (expert parallelism): release stores and acquire loads at
 * system scope, so a peer that sees the flag also sees the data written before it, over
 * NVLink as on one GPU (and at GPU scope, between the blocks of one kernel); and the
 * global nanosecond timer that bounds every wait.
 * Inline device helpers only. */
#pragma once

#include <stdint.h>

namespace mf {
namespace ptx {

__device__ __forceinline__ void st_release_sys(uint32_t *p, uint32_t v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t *p) {
    uint32_t v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

/* GPU scope: flags between the blocks of one kernel (the fused forward's row blocks). */
__device__ __forceinline__ uint32_t ld_acquire_gpu(const uint32_t *p) {
    uint32_t v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void red_release_gpu_add(uint32_t *p, uint32_t v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

/* A count whose meaning needs no ordering of this thread's own memory accesses (the
 * fused backward's "operands read": the reads were TMA's, complete once their mbarrier
 * was seen). red.release compiles to a GPU-wide MEMBAR before the add; this does not. */
__device__ __forceinline__ void red_relaxed_gpu_add(uint32_t *p, uint32_t v) {
    asm volatile("red.relaxed.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

/* Orders this thread's earlier writes (to peers included) before its later ones at
 * system scope. */
__device__ __forceinline__ void fence_sys() { asm volatile("fence.sc.sys;" ::: "memory"); }

__device__ __forceinline__ uint64_t globaltimer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

}  // namespace ptx
}  // namespace mf
