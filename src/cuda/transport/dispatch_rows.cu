/* Dispatch on one GPU: copy token rows into the expert-sorted buffer, for one or two
 * tensors of token rows at once (the backward moves dy and x with the same plan), or
 * (FP8) quantize one tensor's rows as they are copied.
 *
 *   xs[slot_row[t*K + k]] = x[t]   for every slot with slot_row >= 0
 *   xs[r] = 0                      for padding rows (row_slot[r] = -1), r < num_rows
 * and, when asked, each row's routing weight: row_weight[slot_row[s]] = weights[s], 0 for
 * padding rows. gemm2 and dgrad2 read it before a tile's K loop; reading
 * weights[row_slot[r]] there instead is two dependent loads that stall the consumers at
 * every tile (see docs/decisions/0005-token-major-dispatch).
 *
 * Padding rows are zeroed although gemm rows are independent (a garbage padding row
 * would only produce a garbage act row that gemm2 skips): zeros make the padding
 * rows of act and gate_up exactly 0 and finite, so the backward's weight-gradient
 * GEMMs may run over whole 128-row segments without masking. NOTE: the padding is at
 * most 127 rows per expert, about 6% of the rows at T = 16384, E = 128, K = 8, and
 * zeros are writes only: ~3% more bytes than the copy itself.
 * Rows past num_rows are not touched.
 *
 * Token-major: one warp per token reads its row once and writes its K copies (16-byte
 * vectors, 4 per lane in flight), so the kernel moves T * H * 2 bytes in and
 * T * K * H * 2 out. FP8 (codes set): each 1 x 128 tile of the token's row is quantized
 * once, by a half-warp (fp8_recipe.cuh, row_tile_codes: the rows quantizer's code), and
 * its K copies are codes and scales: T * K * H * (1 + 4/128) bytes out, and no bf16 rows
 * written for a quantizer to read again (qwen3-30b-a3b, T = 16384: 0.28 GB out instead
 * of 0.54 GB out, 0.54 GB in and 0.28 GB out). NOTE: the first version gathered row by row (one read per row) and
 * read each token K times, more than L2 holds: 2.1 GB at qwen3-235b-a22b, T = 16384;
 * token-major moves 1.2 GB. Folding the copy into gemm1's producer (DESIGN 3) was tried
 * with cp.async (sm_90 TMA has no row gather): bitwise right, but gemm1 slowed by more
 * than this kernel costs, and so did the weight gradient's; see
 * docs/decisions/0005-token-major-dispatch. */
#include <cuda_runtime.h>
#include <stdint.h>

#include "check.h"
#include "fp8_recipe.cuh"
#include "kernels.h"
#include "transport/row_copy.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kVecsInFlight = 4;   /* 16-byte vectors per lane per pass */

/* The lane's kVecsInFlight pieces of a token row from vector v0, loads issued together. */
__device__ __forceinline__ void load_pieces(const int4 *src, int v0, int vecs, int lane,
                                            int4 (&part)[kVecsInFlight]) {
#pragma unroll
    for (int i = 0; i < kVecsInFlight; ++i) {
        const int v = v0 + i * 32 + lane;
        if (v < vecs) part[i] = __ldcs(src + v);
    }
}

/* One token's row of one tensor to the rows of its live slots (slot_row[0..K-1]). */
__device__ __forceinline__ void copy_token(const int4 *src, uint16_t *xs, const int32_t *slot_row,
                                           int K, int vecs, int lane) {
    for (int v0 = 0; v0 < vecs; v0 += 32 * kVecsInFlight) {
        int4 part[kVecsInFlight];
        load_pieces(src, v0, vecs, lane, part);
        for (int k = 0; k < K; ++k) {
            const int row = __ldg(slot_row + k);
            if (row < 0) continue;
            int4 *dst = reinterpret_cast<int4 *>(xs + (int64_t)row * (vecs * 8));
#pragma unroll
            for (int i = 0; i < kVecsInFlight; ++i) {
                const int v = v0 + i * 32 + lane;
                if (v < vecs) dst[v] = part[i];
            }
        }
    }
}

/* One token's row quantized, 1 x 128 tiles by half-warps (vecs % 16 == 0, so a tile's 16
 * pieces are present or absent together), its codes and scales to the rows of its live
 * slots. */
__device__ __forceinline__ void quantize_token(const int4 *src, const mf_dispatch_params &p,
                                               const int32_t *slot_row, int K, int vecs,
                                               int lane) {
    const unsigned half_lanes = lane < 16 ? 0x0000ffffu : 0xffff0000u;
    for (int v0 = 0; v0 < vecs; v0 += 32 * kVecsInFlight) {
        int4 part[kVecsInFlight];
        load_pieces(src, v0, vecs, lane, part);
#pragma unroll
        for (int i = 0; i < kVecsInFlight; ++i) {
            const int v = v0 + i * 32 + lane;
            if (v >= vecs) continue;   /* uniform per half-warp */
            float scale;
            const uint2 codes = mf::fp8::row_tile_codes(
                make_uint4((uint32_t)part[i].x, (uint32_t)part[i].y, (uint32_t)part[i].z,
                           (uint32_t)part[i].w),
                half_lanes, p.pow2, &scale);
            for (int k = 0; k < K; ++k) {
                const int row = __ldg(slot_row + k);
                if (row < 0) continue;
                *reinterpret_cast<uint2 *>(p.codes + (int64_t)row * p.hidden + 8 * v) = codes;
                if ((lane & 15) == 0) p.scales[(int64_t)(v / 16) * p.scale_ld + row] = scale;
            }
        }
    }
}

template <bool kFp8>
__global__ void __launch_bounds__(kThreads)
dispatch_rows_kernel(const __grid_constant__ mf_dispatch_params p) {
    if (*p.call_failed) return;
    const int vecs = p.hidden / 8;   /* 16-byte vectors per row */
    const int lane = threadIdx.x & 31, K = p.top_k;
    const int warp = blockIdx.x * kWarps + (threadIdx.x >> 5), warps = gridDim.x * kWarps;
    for (int t = warp; t < p.num_tokens; t += warps) {
        if constexpr (kFp8) {
            quantize_token(reinterpret_cast<const int4 *>(p.x[0] + t * p.x_stride[0]), p,
                           p.slot_row + (int64_t)t * K, K, vecs, lane);
        } else {
            for (int j = 0; j < p.num_tensors; ++j)
                copy_token(reinterpret_cast<const int4 *>(p.x[j] + t * p.x_stride[j]), p.xs[j],
                           p.slot_row + (int64_t)t * K, K, vecs, lane);
        }
        if (!p.row_weight) continue;
        for (int k = lane; k < K; k += 32) {
            const int64_t s = (int64_t)t * K + k;
            const int row = __ldg(p.slot_row + s);
            if (row >= 0) p.row_weight[row] = __ldg(p.weights + s);
        }
    }
    /* Padding rows: 32 rows per warp step, one lane reads each row's slot. */
    const int num_rows = *p.num_rows;
    for (int r0 = warp * 32; r0 < num_rows; r0 += warps * 32) {
        const int r = r0 + lane;
        unsigned pad = __ballot_sync(~0u, r < num_rows && __ldg(p.row_slot + r) < 0);
        while (pad) {
            const int row = r0 + __ffs(pad) - 1;
            pad &= pad - 1;
            if constexpr (kFp8) {
                mf::warp_zero_codes_row(p.codes, p.scales, p.scale_ld, row, p.hidden, lane);
            } else {
                for (int j = 0; j < p.num_tensors; ++j)
                    mf::warp_zero_row(reinterpret_cast<int4 *>(p.xs[j] + (int64_t)row * p.hidden),
                                      vecs, lane);
            }
            if (p.row_weight && lane == 0) p.row_weight[row] = 0.f;
        }
    }
}

}  // namespace

extern "C" cudaError_t mf_dispatch_rows_bf16(const mf_dispatch_params *p, cudaStream_t stream) {
    if (!p || p->hidden <= 0 || p->hidden % 8 != 0 || p->top_k < 1 || p->num_tokens < 0 ||
        p->rows_cap < 0 || !p->slot_row || !p->row_slot ||
        p->num_sms < 1 || p->num_tensors < 0 || p->num_tensors > 2 ||
        (p->row_weight && !p->weights))
        return cudaErrorInvalidValue;
    const bool fp8 = p->codes != NULL;
    if (fp8 && (p->num_tensors != 1 || !p->scales || p->hidden % 128 != 0 ||
                p->scale_ld < p->rows_cap || p->scale_ld % 4 != 0))
        return cudaErrorInvalidValue;
    for (int j = 0; j < p->num_tensors; ++j)
        if (!p->x[j] || (!fp8 && !p->xs[j]) || p->x_stride[j] % 8 != 0)
            return cudaErrorInvalidValue;
    if (p->rows_cap == 0) return cudaSuccess;
    const int64_t work = p->num_tokens > p->rows_cap / 32 ? p->num_tokens : p->rows_cap / 32;
    const int64_t need = (work + kWarps - 1) / kWarps;
    const int blocks = need < p->num_sms * 8 ? (int)(need > 0 ? need : 1) : p->num_sms * 8;
    if (fp8)
        dispatch_rows_kernel<true><<<blocks, kThreads, 0, stream>>>(*p);
    else
        dispatch_rows_kernel<false><<<blocks, kThreads, 0, stream>>>(*p);
    return cudaGetLastError();
}

extern "C" cudaError_t mf_dispatch_rows_load(void) {
    return mf_load_kernels(dispatch_rows_kernel<false>, dispatch_rows_kernel<true>);
}
