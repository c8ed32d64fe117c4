/* The FP8 block recipe's quantizers (fp8_recipe.cuh; bit for bit src/cpu/fp8.c):
 *
 *   rows     bf16 [rows, cols] -> codes [rows, cols] + scales [cols / 128, scale_ld]:
 *            1 x 128 tiles along each row, the A operands of the row GEMMs (x, a, dy,
 *            [dg; du]); the scales MN-major so a GEMM tile's 128 row scales of one K
 *            block are one contiguous TMA load.
 *   tokens   bf16 [rows, cols] (times each row's p) -> codes^T [cols, rows] + scales
 *            [rows / 128, cols]: tiles of 128 tokens per column, transposed, the operands
 *            of the weight-gradient GEMMs, whose K is the tokens.
 *   weights  bf16 or fp32 [E, rows, cols] -> codes [E, rows, cols] and codes^T [E, cols,
 *            rows], scales [E, rows / 128, cols / 128] and their transpose: 128 x 128
 *            blocks (W^T's codes are W's transposed: the same blocks and scales).
 *
 * Floors (H200, ~4 TB/s read + write): rows and tokens move 2 + 1 + 4/128 bytes per
 * element (bf16 in, code and scale out): qwen3-30b-a3b's x rows at T = 16384 (139k rows
 * x 2048) 0.86 GB, ~0.21 ms. Rows: 16 lanes per 1 x 128 tile, 16 bytes each, its amax by
 * shuffles, 8 codes per lane written as one 8-byte word. Tokens: a CTA
 * per 128 rows x 64 columns, staged in shared memory as fp32 (the product with p formed
 * once), column amax by 4 threads per column, codes written transposed, 4 tokens per
 * word. Weights run once per optimizer step: a CTA per block reads it twice (amax, then
 * codes), the transposed codes through shared memory. */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "check.h"
#include "fp8_recipe.cuh"
#include "kernels.h"

namespace {

using namespace mf::fp8;

__device__ __forceinline__ float bf16_bits(uint32_t w, int hi) {
    return __uint_as_float(hi ? (w & 0xffff0000u) : (w << 16));
}


/* ---- rows: 1 x 128 ------------------------------------------------------------------ */

constexpr int kRowsWarps = 8;
constexpr int kTilesPerWarp = 2;   /* a tile is 16 lanes of 8 values (one 16-byte load) */

/* The 8 bf16 of a 16-byte piece as floats. */
__device__ __forceinline__ void unpack8(const uint4 v, float (&x)[8]) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = bf16_bits(w[j / 2], j % 2);
}

__global__ void __launch_bounds__(kRowsWarps * 32)
    fp8_quantize_rows_kernel(const mf_quantize_fp8_rows_params p) {
    const int tiles = p.cols / 128;
    const int rows = p.num_rows ? *p.num_rows : p.rows_cap;
    const int lane = threadIdx.x % 32, half = lane / 16, l16 = lane % 16;
    const int64_t total = (int64_t)rows * tiles;
    const int64_t stride = (int64_t)gridDim.x * kRowsWarps * kTilesPerWarp;
    for (int64_t w = ((int64_t)blockIdx.x * kRowsWarps + threadIdx.x / 32) * kTilesPerWarp + half;
         w < total; w += stride) {
        const int64_t r = w / tiles;
        const int b = (int)(w % tiles);
        float x[8];
        unpack8(*reinterpret_cast<const uint4 *>(p.in + r * p.ld + b * 128 + 8 * l16), x);
        float m = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) m = amax_fold(m, x[j]);
        const unsigned tile_lanes = half ? 0xffff0000u : 0x0000ffffu;   /* this tile's 16 */
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) m = amax_fold(m, __shfl_xor_sync(tile_lanes, m, o));
        const float scale = tile_scale(m, p.pow2);
        *reinterpret_cast<uint2 *>(p.codes + r * p.cols + b * 128 + 8 * l16) =
            make_uint2(quantize4(x[0], x[1], x[2], x[3], scale),
                       quantize4(x[4], x[5], x[6], x[7], scale));
        if (l16 == 0) p.scales[(int64_t)b * p.scale_ld + r] = scale;
    }
}

/* ---- tokens: 128 rows per column, transposed ----------------------------------------- */

constexpr int kTokCols = 64;
constexpr int kTokThreads = 256;

__global__ void __launch_bounds__(kTokThreads)
    fp8_quantize_tokens_kernel(const mf_quantize_fp8_tokens_params p) {
    __shared__ float tile[128][kTokCols + 1];
    __shared__ float col_scale[kTokCols];
    const int col_blocks = (p.cols + kTokCols - 1) / kTokCols;
    const int row_block = blockIdx.x / col_blocks;
    const int c0 = (blockIdx.x % col_blocks) * kTokCols;
    const int rows = p.num_rows ? *p.num_rows : p.rows_cap;
    if (row_block * 128 >= rows) return;
    const int64_t r0 = (int64_t)row_block * 128;
    /* 128 rows x 64 columns of bf16: 8 pieces of 16 bytes per row */
    for (int i = threadIdx.x; i < 128 * (kTokCols / 8); i += kTokThreads) {
        const int r = i / (kTokCols / 8), piece = i % (kTokCols / 8);
        const int c = c0 + piece * 8;
        float x[8];
        if (c < p.cols) {
            unpack8(*reinterpret_cast<const uint4 *>(p.in + (r0 + r) * p.ld + c), x);
            if (p.row_weight) {
                const float pw = p.row_weight[r0 + r];
#pragma unroll
                for (int j = 0; j < 8; ++j) x[j] = __fmul_rn(pw, x[j]);
            }
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) x[j] = 0.0f;
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) tile[r][piece * 8 + j] = x[j];
    }
    __syncthreads();
    /* column amax: 4 threads per column, 32 rows each, lanes 4c .. 4c+3 */
    {
        const int c = threadIdx.x / 4, part = threadIdx.x % 4;
        float m = 0.0f;
        for (int r = part * 32; r < part * 32 + 32; ++r) m = amax_fold(m, tile[r][c]);
        m = amax_fold(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = amax_fold(m, __shfl_xor_sync(0xffffffffu, m, 2));
        if (part == 0) {
            const float s = tile_scale(m, p.pow2);
            col_scale[c] = s;
            if (c0 + c < p.cols) p.scales[(int64_t)row_block * p.cols + c0 + c] = s;
        }
    }
    __syncthreads();
    /* codes^T: column c's 128 tokens, 32 words of 4 */
    for (int i = threadIdx.x; i < kTokCols * 32; i += kTokThreads) {
        const int c = i / 32, t = (i % 32) * 4;
        if (c0 + c >= p.cols) continue;
        const float s = col_scale[c];
        *reinterpret_cast<uint32_t *>(p.codes_t + (int64_t)(c0 + c) * p.rows_cap + r0 + t) =
            quantize4(tile[t][c], tile[t + 1][c], tile[t + 2][c], tile[t + 3][c], s);
    }
}

/* ---- weights: 128 x 128 blocks, W and W^T ------------------------------------------- */

constexpr int kWThreads = 256;

template <class T>
__device__ __forceinline__ float weight_value(const T *w, int64_t i);
template <>
__device__ __forceinline__ float weight_value<float>(const float *w, int64_t i) {
    return w[i];
}
template <>
__device__ __forceinline__ float weight_value<uint16_t>(const uint16_t *w, int64_t i) {
    return __uint_as_float((uint32_t)w[i] << 16);
}

template <class T>
__global__ void __launch_bounds__(kWThreads)
    fp8_quantize_weights_kernel(const mf_quantize_fp8_weights_params p, const T *w) {
    __shared__ uint8_t codes_t[128][128 + 4];
    __shared__ float red[kWThreads / 32];
    const int nbr = p.rows / 128, nbc = p.cols / 128;
    const int e = blockIdx.x / (nbr * nbc);
    const int br = (blockIdx.x / nbc) % nbr, bc = blockIdx.x % nbc;
    const int64_t base = (int64_t)e * p.rows * p.cols + (int64_t)br * 128 * p.cols + bc * 128;
    float m = 0.0f;
    for (int i = threadIdx.x; i < 128 * 128; i += kWThreads)
        m = amax_fold(m, weight_value<T>(w, base + (int64_t)(i / 128) * p.cols + i % 128));
    m = warp_amax(m);
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = m;
    __syncthreads();
    m = 0.0f;
#pragma unroll
    for (int i = 0; i < kWThreads / 32; ++i) m = amax_fold(m, red[i]);
    const float s = tile_scale(m, p.pow2);
    for (int i = threadIdx.x; i < 128 * 128; i += kWThreads) {
        const int r = i / 128, c = i % 128;
        const uint8_t q = quantize(weight_value<T>(w, base + (int64_t)r * p.cols + c), s);
        p.codes[base + (int64_t)r * p.cols + c] = q;
        codes_t[c][r] = q;
    }
    if (threadIdx.x == 0) {
        p.scale[((int64_t)e * nbr + br) * nbc + bc] = s;
        p.scale_t[((int64_t)e * nbc + bc) * nbr + br] = s;
    }
    __syncthreads();
    const int64_t base_t = (int64_t)e * p.rows * p.cols + (int64_t)bc * 128 * p.rows + br * 128;
    for (int i = threadIdx.x; i < 128 * 128; i += kWThreads) {
        const int c = i / 128, r = i % 128;
        p.codes_t[base_t + (int64_t)c * p.rows + r] = codes_t[c][r];
    }
}

int grid_for(int64_t work, int per_cta) {
    int64_t g = (work + per_cta - 1) / per_cta;
    return (int)(g < 1 ? 1 : g > 65535 * 16 ? 65535 * 16 : g);
}

}  // namespace

extern "C" cudaError_t mf_quantize_fp8_rows(const mf_quantize_fp8_rows_params *p,
                                            cudaStream_t stream) {
    if (!p || !p->in || !p->codes || !p->scales || p->cols <= 0 || p->cols % 128 ||
        p->rows_cap < 0 || p->scale_ld < p->rows_cap || p->scale_ld % 4 || p->ld < p->cols ||
        p->ld % 8)
        return cudaErrorInvalidValue;
    if (p->rows_cap == 0) return cudaSuccess;
    const int64_t tiles = (int64_t)p->rows_cap * (p->cols / 128);
    fp8_quantize_rows_kernel<<<grid_for(tiles, kRowsWarps * kTilesPerWarp), kRowsWarps * 32, 0,
                               stream>>>(*p);
    return cudaGetLastError();
}

extern "C" cudaError_t mf_quantize_fp8_tokens(const mf_quantize_fp8_tokens_params *p,
                                              cudaStream_t stream) {
    if (!p || !p->in || !p->codes_t || !p->scales || p->cols <= 0 || p->cols % 8 ||
        p->rows_cap < 0 || p->rows_cap % 128 || p->ld < p->cols || p->ld % 8)
        return cudaErrorInvalidValue;
    if (p->rows_cap == 0) return cudaSuccess;
    const int64_t ctas = (int64_t)(p->rows_cap / 128) * ((p->cols + kTokCols - 1) / kTokCols);
    if (ctas > INT32_MAX) return cudaErrorInvalidValue;
    fp8_quantize_tokens_kernel<<<(unsigned)ctas, kTokThreads, 0, stream>>>(*p);
    return cudaGetLastError();
}

extern "C" cudaError_t mf_quantize_fp8_weights(const mf_quantize_fp8_weights_params *p,
                                               cudaStream_t stream) {
    if (!p || !p->w || !p->codes || !p->codes_t || !p->scale || !p->scale_t ||
        p->num_experts <= 0 || p->rows <= 0 || p->cols <= 0 || p->rows % 128 || p->cols % 128)
        return cudaErrorInvalidValue;
    const int64_t ctas = (int64_t)p->num_experts * (p->rows / 128) * (p->cols / 128);
    if (ctas > INT32_MAX) return cudaErrorInvalidValue;
    if (p->fp32)
        fp8_quantize_weights_kernel<float>
            <<<(unsigned)ctas, kWThreads, 0, stream>>>(*p, (const float *)p->w);
    else
        fp8_quantize_weights_kernel<uint16_t>
            <<<(unsigned)ctas, kWThreads, 0, stream>>>(*p, (const uint16_t *)p->w);
    return cudaGetLastError();
}

extern "C" cudaError_t mf_quantize_fp8_load(void) {
    return mf_load_kernels(fp8_quantize_rows_kernel, fp8_quantize_tokens_kernel,
                           fp8_quantize_weights_kernel<float>,
                           fp8_quantize_weights_kernel<uint16_t>);
}
