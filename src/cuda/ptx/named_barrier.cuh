/* Named barriers (bar.sync / bar.arrive with an id and a thread count): one group of
 * warps signals another inside a CTA without stopping itself. Barrier 0 is
 * __syncthreads'; kernels that use these name their ids. Inline device helpers only. */
#pragma once

#include <stdint.h>

namespace mf {
namespace ptx {

/* Waits until `threads` threads (a multiple of 32, this warp's included) have reached
 * barrier `id` by bar_sync or bar_arrive. */
__device__ __forceinline__ void bar_sync(uint32_t id, uint32_t threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

/* Counts this warp towards barrier `id` and goes on. */
__device__ __forceinline__ void bar_arrive(uint32_t id, uint32_t threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace ptx
}  // namespace mf
