/* mbarrier wrappers (sm_90): init, arrive, arrive with an expected transaction byte
 * count, a parity test and a bounded parity wait. Inline device helpers only. */
#pragma once

#include <stdint.h>

namespace mf {
namespace ptx {

__device__ __forceinline__ uint32_t smem_u32(const void *p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t *bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count)
                 : "memory");
}

/* Makes the inits visible to the async proxy (TMA) and to the other threads. */
__device__ __forceinline__ void mbar_fence_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t *bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

/* One arrival that also raises the transaction count the phase waits for. */
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t *bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
                 "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    return done != 0;
}

/* Whether the phase with the given parity completed, without waiting (try_wait may
 * suspend the thread a while; this returns at once). */
__device__ __forceinline__ bool mbar_test_wait(uint64_t *bar, uint32_t parity) {
    uint32_t done;
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
    return done != 0;
}

/* Waits until the phase with the given parity completed. NOTE: each try_wait already
 * suspends the thread for a hardware-chosen time, so the bound below is many seconds;
 * a wait that runs past it is a pipeline bug (lost arrival, wrong byte count), and we
 * trap (the launch then fails with an error the host check reports) instead of hanging
 * the job. No printf here: a call in the kernel makes ptxas serialize every wgmma. */
__device__ __forceinline__ void mbar_wait(uint64_t *bar, uint32_t parity) {
    const uint32_t addr = smem_u32(bar);
    if (mbar_try_wait(addr, parity)) return;
    for (uint32_t spins = 0;; ++spins) {
        if (mbar_try_wait(addr, parity)) return;
        if (spins == (1u << 27)) __trap();
    }
}

}  // namespace ptx
}  // namespace mf
