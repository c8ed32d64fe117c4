/* Compile-only probe for the fused backward (bench/NOTES.md v15, Next 3): one consumer
 * loop taking tiles of two operand layouts in the same ring, dgrad1's (A K-major, B
 * MN-major) and the wgrad's (both MN-major), the layout chosen per tile by a value
 * broadcast from shared memory. The question: does ptxas serialize the wgmmas (C7518)?
 * Not a kernel to run: no producer, no epilogue.
 *
 *   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Isrc/cuda -Iinclude \
 *        -Isrc/host -Xptxas=-v -c bench/experiments/fused_bwd_two_layouts_probe.cu -o /tmp/p.o
 *   cuobjdump -sass /tmp/p.o | grep -E "HGMMA|DEPBAR"
 *
 * 2026-12-03 (CUDA 13.0): no C7518; per K block four HGMMAs (.tnspA.tnspB or .tnspB) and
 * one DEPBAR.LE 1 in each branch. */
#include "sm90/common/grouped_gemm.cuh"
using namespace mf;
using namespace mf::sm90;
using CfgD = TileConfig<256, 3, false, true, 0, 512>;
using CfgW = TileConfig<256, 3, true, true, 0, 512>;
static_assert(CfgD::kSmemBytes == CfgW::kSmemBytes, "one ring");

__global__ void __launch_bounds__(kThreads, 1) mixed_kernel(float *out, const int *kinds, int tiles) {
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    const Ring<CfgD> ringD = ring_from_smem<CfgD>(smem_raw);
    const Ring<CfgW> ringW = ring_from_smem<CfgW>(smem_raw);
    __shared__ int s_kind;
    if (threadIdx.x / 128 == 2) { ptx::setmaxnreg_dec<40>(); return; }
    ptx::setmaxnreg_inc<232>();
    float acc[128];
    RingPos<CfgD> posD;
    RingPos<CfgW> posW;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        if (threadIdx.x == 0) s_kind = kinds[t];
        asm volatile("bar.sync 1, 256;");
        const int kind = __shfl_sync(~0u, s_kind, 0);
        int prev = 0;
        if (kind == 0) {
            for (int kb = 0; kb < 16; ++kb) {
                issue_k_block<CfgD>(ringD, posD, acc, kb);
                retire_k_block<CfgD>(ringD, posD, acc, kb, prev);
            }
            end_k_loop<CfgD>(ringD, acc, 16, prev);
        } else {
            for (int kb = 0; kb < 16; ++kb) {
                issue_k_block<CfgW>(ringW, posW, acc, kb);
                retire_k_block<CfgW>(ringW, posW, acc, kb, prev);
            }
            end_k_loop<CfgW>(ringW, acc, 16, prev);
        }
        for (int i = 0; i < 128; ++i) out[(size_t)t * 128 * 256 + i * 256 + threadIdx.x] = acc[i];
    }
}
