/* cp.async (LDGSTS): 16-byte copies from global to shared memory that complete in this
 * thread's cp.async groups. Inline device helpers only. */
#pragma once

#include <stdint.h>

#include "ptx/mbarrier.cuh"

namespace mf {
namespace ptx {

/* 16 bytes from src to dst (both 16-byte aligned), through L2 only (.cg). */
__device__ __forceinline__ void cp_async_16(void *dst, const void *src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(dst)), "l"(src)
                 : "memory");
}

/* Closes this thread's current group of copies (an empty group completes at once). */
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}

/* Waits until at most kPending of this thread's groups are still in flight; the copies
 * of the others are then visible to this thread. */
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

}  // namespace ptx
}  // namespace mf
