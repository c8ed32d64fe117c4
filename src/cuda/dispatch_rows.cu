/* Dispatch on one GPU: gather token rows into the expert-sorted buffer.
 *
 *   xs[r] = x[row_slot[r] / K]   for r < num_rows with row_slot[r] >= 0
 *   xs[r] = 0                    for padding rows (row_slot[r] = -1), r < num_rows
 *
 * Padding rows are zeroed although gemm rows are independent (a garbage padding row
 * would only produce a garbage act row that gemm2 skips): zeros make the padding
 * rows of act and gate_up exactly 0 and finite, so the backward's weight-gradient
 * GEMMs may run over whole 128-row segments without masking. NOTE: the padding is at
 * most 127 rows per expert, about 6% of the rows at T = 16384, E = 128, K = 8, and
 * zeros are writes only: ~3% more bytes than the gather itself.
 * Rows past num_rows are not touched.
 *
 * One warp per row, grid-stride over rows; 16-byte loads and stores, 4 in flight
 * per lane. NOTE: the gather moves num_rows * H * 2 bytes each way (read + write):
 * 2.1 GB at qwen3-235b-a22b, T = 16384, about 0.55 ms measured. Folding it into gemm1's
 * producer (DESIGN 3) was tried with cp.async (sm_90 TMA has no row gather): bitwise
 * right, but gemm1 slowed by more than this kernel costs (bench/NOTES.md v5, the patch
 * in bench/experiments/). */
#include <cuda_runtime.h>
#include <stdint.h>

#include "check.h"
#include "kernels.h"
#include "row_copy.cuh"

namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
dispatch_rows_kernel(const __grid_constant__ mf_dispatch_params p) {
    if (*p.call_failed) return;
    const int num_rows = *p.num_rows;
    const int vecs = p.hidden / 8;  // 16-byte vectors per row
    const int lane = threadIdx.x & 31;
    const int warps = gridDim.x * (kThreads / 32);
    for (int r = blockIdx.x * (kThreads / 32) + (threadIdx.x >> 5); r < num_rows; r += warps) {
        const int slot = __ldg(p.row_slot + r);
        int4 *dst = reinterpret_cast<int4 *>(p.xs + (int64_t)r * p.hidden);
        if (slot < 0) {
            mf::warp_zero_row(dst, vecs, lane);
            continue;
        }
        const int4 *src =
            reinterpret_cast<const int4 *>(p.x + (int64_t)(slot / p.top_k) * p.x_stride);
        mf::warp_copy_row(dst, src, vecs, lane);
    }
}

}  // namespace

extern "C" cudaError_t mf_dispatch_rows_bf16(const mf_dispatch_params *p, cudaStream_t stream) {
    if (!p || p->hidden <= 0 || p->hidden % 8 != 0 || p->x_stride % 8 != 0 || p->top_k < 1 ||
        p->rows_cap < 0 || p->num_sms < 1)
        return cudaErrorInvalidValue;
    if (p->rows_cap == 0) return cudaSuccess;
    const int rows_per_block = kThreads / 32;
    const int need = (p->rows_cap + rows_per_block - 1) / rows_per_block;
    const int blocks = need < p->num_sms * 8 ? need : p->num_sms * 8;
    dispatch_rows_kernel<<<blocks, kThreads, 0, stream>>>(*p);
    return cudaGetLastError();
}
