/* The FP8 block recipe's quantizers (fp8_recipe.cuh; bit for bit src/cpu/fp8.c):
 *
 *   rows     bf16 [rows, cols] -> codes [rows, cols] + scales [cols / 128, scale_ld]:
 *            1 x 128 tiles along each row, the A operands of the row GEMMs (x, a, dy,
 *            [dg; du]); the scales MN-major so a GEMM tile's 128 row scales of one K
 *            block are one contiguous TMA load.
 *   tokens   bf16 [rows, cols] (times each row's p) -> codes^T [cols, rows] + scales
 *            [rows / 128, cols]: tiles of 128 tokens per column, transposed, the operands
 *            of the weight-gradient GEMMs, whose K is the tokens.
 *   (the weights' 128 x 128 blocks: simt/fp8_quant_weights.cu)
 *
 *   rows + tokens  both of the above from one read ([dg; du], and dy where the backward's
 *            dispatch does not quantize it: whose two forms the backward needs one GEMM
 *            apart).
 * Rows and tokens read the expert-sorted rows, or gather them (row_slot): the caller's x
 * and dy on one GPU, whose bf16 rows the backward then does not dispatch.
 *
 * Floors (H200, ~4 TB/s read + write): rows and tokens move 2 + 1 + 4/128 bytes per
 * element (bf16 in, code and scale out), rows + tokens 2 + 2 (1 + 4/128): qwen3-30b-a3b's
 * x rows at T = 16384 (139k rows x 2048) 0.86 GB, ~0.21 ms; the table of every pass is
 * docs/decisions/0023-fp8-quantizer-bandwidth.md. Rows: 16 lanes per 1 x 128 tile, 16
 * bytes each, 4 tiles' loads in flight per lane, the amax by shuffles, 8 codes per lane as
 * one 8-byte word. Tokens: a CTA per 128 rows x 128 columns, each thread 8 rows x 8
 * columns in registers, the column amax by registers, a shuffle and shared memory, the
 * codes^T through shared memory as swizzled bytes, written 16 bytes per lane. Codes come
 * from the tile's reciprocal and an fma correction, with the division's bits (quotients()). */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "check.h"
#include "fp8_recipe.cuh"
#include "kernels.h"

namespace {

using namespace mf::fp8;


/* Element j (0..7) of a 16-byte piece of bf16. */
__device__ __forceinline__ float bf16_at(const uint4 &v, int j) {
    const uint32_t w = j < 2 ? v.x : j < 4 ? v.y : j < 6 ? v.z : v.w;
    return bf16_bits(w, j % 2);
}

/* 16 bytes read once (streamed: the quantizers read each input once). */
__device__ __forceinline__ uint4 load_stream(const uint16_t *p) {
    return __ldcs(reinterpret_cast<const uint4 *>(p));
}

/* 8 values of row r from column col: in + r * ld; gathered (row_slot set), the token row
 * of r's slot, zeros for a padding row, read through the cache (each token row serves
 * its K rows). */
__device__ __forceinline__ uint4 load_row_piece(const uint16_t *in, int64_t ld,
                                                const int32_t *row_slot, int top_k, int64_t r,
                                                int64_t col) {
    if (!row_slot) return load_stream(in + r * ld + col);
    const int slot = __ldg(row_slot + r);
    if (slot < 0) return make_uint4(0, 0, 0, 0);
    return __ldg(reinterpret_cast<const uint4 *>(in + (int64_t)(slot / top_k) * ld + col));
}

/* ---- rows: 1 x 128 ------------------------------------------------------------------ */

/* A tile is 16 lanes of 8 values (one 16-byte load each); a half-warp takes kRowsUnroll
 * tiles, its loads issued together (64 bytes in flight per lane, 16 KB per CTA). A CTA
 * takes 16 * kRowsUnroll consecutive tiles (row-major: a warp reads 512 contiguous bytes). */
constexpr int kRowsThreads = 256;
constexpr int kRowsUnroll = 4;
constexpr int kRowsTilesPerCta = kRowsThreads / 16 * kRowsUnroll;

__global__ void __launch_bounds__(kRowsThreads, 4)
    fp8_quantize_rows_kernel(const mf_quantize_fp8_rows_params p) {
    const uint32_t tiles = (uint32_t)(p.cols / 128);
    const uint32_t rows = (uint32_t)(p.num_rows ? min(*p.num_rows, p.rows_cap) : p.rows_cap);
    const uint32_t total = rows * tiles;   /* < 2^31: the launcher's check */
    const int l16 = threadIdx.x % 16;
    const uint32_t first = blockIdx.x * kRowsTilesPerCta + threadIdx.x / 16;
    if (blockIdx.x * kRowsTilesPerCta >= total) return;
    /* loads first */
    uint4 v[kRowsUnroll];
    uint32_t r[kRowsUnroll], b[kRowsUnroll];
#pragma unroll
    for (int u = 0; u < kRowsUnroll; ++u) {
        const uint32_t w = first + u * (kRowsThreads / 16);
        r[u] = w / tiles;
        b[u] = w - r[u] * tiles;
        v[u] = w < total ? load_row_piece(p.in, p.ld, p.row_slot, p.top_k, r[u],
                                          b[u] * 128 + 8 * l16)
                         : make_uint4(0, 0, 0, 0);
    }
    const unsigned half_lanes = (threadIdx.x % 32) < 16 ? 0x0000ffffu : 0xffff0000u;
#pragma unroll
    for (int u = 0; u < kRowsUnroll; ++u) {
        if (first + u * (kRowsThreads / 16) >= total) break;   /* uniform per half-warp */
        float scale;
        *reinterpret_cast<uint2 *>(p.codes + (int64_t)r[u] * p.cols + b[u] * 128 + 8 * l16) =
            row_tile_codes(v[u], half_lanes, p.pow2, &scale);
        if (l16 == 0) p.scales[(int64_t)b[u] * p.scale_ld + r[u]] = scale;
    }
}

/* ---- tokens (and rows with them): a CTA per 128 rows x 128 columns -------------------- */

/* Thread (piece, group): columns 8 piece .. +7 of rows 8 group .. +7, eight 16-byte loads
 * issued together (32 KB per CTA). Column amax: each thread's 8 rows, the warp's two groups
 * by a shuffle, the 8 warps through shared memory. Codes^T are staged in shared memory as
 * bytes, [column][128 tokens], each thread writing its 8 tokens of a column as one 8-byte
 * word; the 8-byte unit of a column is swizzled (unit ^ piece) so that the 16 lanes of a
 * half-warp (16 pieces, one group) hit 16 different bank pairs, and read back as 16-byte
 * chunks (8 lanes = one column's 128 bytes, conflict-free) written to global memory whole.
 * With kRows the same registers also give each row's 1 x 128 tile (the block's 128 columns
 * are one tile; its amax by shuffles over the half-warp): one read of the input for both
 * the row GEMM's and the weight gradient's operands. */
constexpr int kTokThreads = 256;
constexpr int kTokCols = 128;

struct tokens_block_params {
    mf_quantize_fp8_tokens_params t;
    /* with kRows: the 1 x 128 row codes and their MN-major scales */
    uint8_t *row_codes;
    float *row_scales;
    int scale_ld;
};

/* The shared memory of one block's codes (beside its rows' values, in registers). */
struct TokensSmem {
    uint2 codes_t[kTokCols][16];          /* [column][8-byte unit ^ piece] */
    float red[kTokThreads / 32][kTokCols];
    float col_scale[kTokCols];
};

/* Column j's amax over this thread's 8 rows v, cm[j], of the values times the rows'
 * weights pw (kWeighted) or of the values themselves (two columns an instruction). */
template <bool kWeighted>
__device__ __forceinline__ void column_amax8(const uint4 (&v)[8], const float (&pw)[8],
                                             float (&cm)[8]) {
    if constexpr (!kWeighted) {
        uint32_t m[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            m[0] = amax_bf16x2(m[0], v[i].x);
            m[1] = amax_bf16x2(m[1], v[i].y);
            m[2] = amax_bf16x2(m[2], v[i].z);
            m[3] = amax_bf16x2(m[3], v[i].w);
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) cm[j] = bf16_bits(m[j / 2], j % 2);
    } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) cm[j] = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            float x[8];
            unpack8(v[i], x);
#pragma unroll
            for (int j = 0; j < 8; ++j) cm[j] = amax_nan(cm[j], __fmul_rn(pw[i], x[j]));
        }
    }
}

/* One 128 x 128 block's codes from this thread's 8 rows x 8 columns v (rows 8 group ..,
 * columns c0 + 8 piece ..) and the rows' weights pw (kWeighted; without, the values
 * themselves): with kRows each row's 1 x 128 codes, then the columns' scales and
 * codes^T. */
template <bool kRows, bool kWeighted>
__device__ __forceinline__ void tokens_block_codes(const tokens_block_params &bp, int row_block,
                                                   int c0, const uint4 (&v)[8],
                                                   const float (&pw)[8], TokensSmem &sm) {
    const mf_quantize_fp8_tokens_params &p = bp.t;
    const int64_t r0 = (int64_t)row_block * 128;
    const int piece = threadIdx.x % 16, group = threadIdx.x / 16;
    const int c = c0 + 8 * piece;

    /* ---- rows: each row's tile of 128 columns (kRows: cols % 128 == 0) ---- */
    if constexpr (kRows) {
        float *row_scales = bp.row_scales + (int64_t)(c0 / 128) * bp.scale_ld;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            float x[8];
            unpack8(v[i], x);
            float m = piece_amax<true>(v[i], x);
#pragma unroll
            for (int o = 8; o > 0; o >>= 1) m = amax_nan(m, __shfl_xor_sync(0xffffffffu, m, o));
            const float s = tile_scale(m, p.pow2);
            const int64_t r = r0 + 8 * group + i;
            *reinterpret_cast<uint2 *>(bp.row_codes + r * p.cols + c) =
                quantize8(x, s, __frcp_rn(s));
            if (piece == 0) row_scales[r] = s;
        }
    }

    /* ---- column amax: 8 rows here, the other group of the warp, then the 8 warps ---- */
    float cm[8];
    column_amax8<kWeighted>(v, pw, cm);
#pragma unroll
    for (int j = 0; j < 8; ++j) cm[j] = amax_nan(cm[j], __shfl_xor_sync(0xffffffffu, cm[j], 16));
    if ((threadIdx.x % 32) < 16) {
        float4 *d = reinterpret_cast<float4 *>(&sm.red[threadIdx.x / 32][8 * piece]);
        d[0] = make_float4(cm[0], cm[1], cm[2], cm[3]);
        d[1] = make_float4(cm[4], cm[5], cm[6], cm[7]);
    }
    __syncthreads();
    if (threadIdx.x < kTokCols) {
        float m = 0.0f;
#pragma unroll
        for (int w = 0; w < kTokThreads / 32; ++w) m = amax_nan(m, sm.red[w][threadIdx.x]);
        const float s = tile_scale(m, p.pow2);
        sm.col_scale[threadIdx.x] = s;
        if (c0 + (int)threadIdx.x < p.cols) p.scales[(int64_t)row_block * p.cols + c0 + threadIdx.x] = s;
    }
    __syncthreads();

    /* ---- codes: column j of this piece, this group's 8 tokens -> one 8-byte unit ---- */
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float s = sm.col_scale[8 * piece + j];
        float x[8];
#pragma unroll
        for (int i = 0; i < 8; ++i)
            x[i] = kWeighted ? __fmul_rn(pw[i], bf16_at(v[i], j)) : bf16_at(v[i], j);
        sm.codes_t[8 * piece + j][group ^ piece] = quantize8(x, s, __frcp_rn(s));
    }
    __syncthreads();

    /* ---- codes^T out: 8 lanes per column, 16 bytes each ---- */
#pragma unroll
    for (int k = 0; k < kTokCols * 8 / kTokThreads; ++k) {
        const int i = threadIdx.x + k * kTokThreads;
        const int col = i / 8, chunk = i % 8;   /* tokens 16 chunk .. +15 */
        if (c0 + col >= p.cols) continue;
        const int sw = (col / 8) % 16;          /* the piece that wrote the column */
        /* units 2 chunk and 2 chunk + 1 sit at (2 chunk) ^ sw and (2 chunk + 1) ^ sw: one
         * 16-byte pair, swapped when sw is odd */
        const uint4 q = *reinterpret_cast<const uint4 *>(&sm.codes_t[col][((2 * chunk) ^ sw) & ~1]);
        const uint4 out = (sw & 1) ? make_uint4(q.z, q.w, q.x, q.y) : q;
        *reinterpret_cast<uint4 *>(p.codes_t + (int64_t)(c0 + col) * p.rows_cap + r0 + 16 * chunk) =
            out;
    }
}

/* kGather: the rows read through row_slot; kWeighted: each row times its p (dy's token
 * codes). A CTA per block: its loads first, eight 16-byte ones per thread (32 KB a CTA).
 * The weighted rows + tokens kernels hold 2 CTAs an SM (104-108 registers; at 3 they spill
 * 8 bytes, ptxas CUDA 13), the weighted tokens kernels 3 (79), the others 4 (64): more
 * loads in flight an SM (rows + tokens [dg; du] 0.40 -> 0.33 ms at 4 CTAs, not 2, on an
 * H100, docs/decisions/0023-fp8-quantizer-bandwidth.md). */
template <bool kRows, bool kGather, bool kWeighted>
__global__ void __launch_bounds__(kTokThreads, !kWeighted ? 4 : kRows ? 2 : 3)
    fp8_quantize_tokens_kernel(const tokens_block_params bp) {
    const mf_quantize_fp8_tokens_params &p = bp.t;
    __shared__ __align__(16) TokensSmem sm;
    /* Sorted rows, a row block's column blocks one after another; gathered, one column
     * slab's row blocks: a token row's K reads of the slab (T x 128 columns, 4 MB at
     * T = 16384) come while the slab is in L2, not K times from HBM */
    const int col_blocks = (p.cols + kTokCols - 1) / kTokCols, row_blocks = p.rows_cap / 128;
    const int row_block = kGather ? blockIdx.x % row_blocks : blockIdx.x / col_blocks;
    const int c0 = (kGather ? blockIdx.x / row_blocks : blockIdx.x % col_blocks) * kTokCols;
    const int rows = p.num_rows ? *p.num_rows : p.rows_cap;
    if (row_block * 128 >= rows) return;
    const int64_t r0 = (int64_t)row_block * 128;
    const int piece = threadIdx.x % 16, group = threadIdx.x / 16;
    const int c = c0 + 8 * piece;
    const bool has_cols = c < p.cols;   /* cols % 8 == 0: a piece is whole or absent */
    uint4 v[8];
    float pw[8];   /* the rows' weights (1 without) */
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int64_t r = r0 + 8 * group + i;
        if constexpr (kGather)
            v[i] = has_cols ? load_row_piece(p.in, p.ld, p.row_slot, p.top_k, r, c)
                            : make_uint4(0, 0, 0, 0);
        else
            v[i] = has_cols ? load_stream(p.in + r * p.ld + c) : make_uint4(0, 0, 0, 0);
        pw[i] = kWeighted ? p.row_weight[r] : 1.0f;
    }
    tokens_block_codes<kRows, kWeighted>(bp, row_block, c0, v, pw, sm);
}

/* Launches the tokens kernel of kRows / row_slot / row_weight: one CTA per block. */
template <bool kRows, bool kGather>
cudaError_t launch_tokens(const tokens_block_params &bp, int64_t ctas, cudaStream_t stream) {
    if (bp.t.row_weight)
        fp8_quantize_tokens_kernel<kRows, kGather, true><<<(unsigned)ctas, kTokThreads, 0, stream>>>(bp);
    else
        fp8_quantize_tokens_kernel<kRows, kGather, false><<<(unsigned)ctas, kTokThreads, 0, stream>>>(bp);
    return cudaGetLastError();
}

template <bool kRows>
cudaError_t launch_tokens(const tokens_block_params &bp, int64_t ctas, cudaStream_t stream) {
    return bp.t.row_slot ? launch_tokens<kRows, true>(bp, ctas, stream)
                         : launch_tokens<kRows, false>(bp, ctas, stream);
}

}  // namespace

extern "C" cudaError_t mf_quantize_fp8_rows(const mf_quantize_fp8_rows_params *p,
                                            cudaStream_t stream) {
    if (!p || !p->in || !p->codes || !p->scales || p->cols <= 0 || p->cols % 128 ||
        p->rows_cap < 0 || p->scale_ld < p->rows_cap || p->scale_ld % 4 || p->ld < p->cols ||
        p->ld % 8 || (p->row_slot && p->top_k < 1))
        return cudaErrorInvalidValue;
    if (p->rows_cap == 0) return cudaSuccess;
    const int64_t tiles = (int64_t)p->rows_cap * (p->cols / 128);
    if (tiles > INT32_MAX - kRowsTilesPerCta) return cudaErrorInvalidValue;
    const unsigned ctas = (unsigned)((tiles + kRowsTilesPerCta - 1) / kRowsTilesPerCta);
    fp8_quantize_rows_kernel<<<ctas, kRowsThreads, 0, stream>>>(*p);
    return cudaGetLastError();
}

namespace {

bool tokens_params_ok(const mf_quantize_fp8_tokens_params *p) {
    return p && p->in && p->codes_t && p->scales && p->cols > 0 && p->cols % 8 == 0 &&
           p->rows_cap >= 0 && p->rows_cap % 128 == 0 && p->ld >= p->cols && p->ld % 8 == 0 &&
           (!p->row_slot || p->top_k >= 1);
}

int64_t tokens_ctas(const mf_quantize_fp8_tokens_params *p) {
    return (int64_t)(p->rows_cap / 128) * ((p->cols + kTokCols - 1) / kTokCols);
}

}  // namespace

extern "C" cudaError_t mf_quantize_fp8_tokens(const mf_quantize_fp8_tokens_params *p,
                                              cudaStream_t stream) {
    if (!tokens_params_ok(p)) return cudaErrorInvalidValue;
    if (p->rows_cap == 0) return cudaSuccess;
    const int64_t ctas = tokens_ctas(p);
    if (ctas > INT32_MAX) return cudaErrorInvalidValue;
    const tokens_block_params bp = {*p, nullptr, nullptr, 0};
    return launch_tokens<false>(bp, ctas, stream);
}

extern "C" cudaError_t mf_quantize_fp8_rows_tokens(const mf_quantize_fp8_rows_params *r,
                                                   const mf_quantize_fp8_tokens_params *t,
                                                   cudaStream_t stream) {
    if (!r || !tokens_params_ok(t) || !r->codes || !r->scales || r->in != t->in ||
        r->ld != t->ld || r->rows_cap != t->rows_cap || r->num_rows != t->num_rows ||
        r->cols != t->cols || r->pow2 != t->pow2 || r->row_slot != t->row_slot ||
        r->top_k != t->top_k || t->cols % 128 || r->scale_ld < r->rows_cap || r->scale_ld % 4)
        return cudaErrorInvalidValue;
    if (t->rows_cap == 0) return cudaSuccess;
    const int64_t ctas = tokens_ctas(t);
    if (ctas > INT32_MAX) return cudaErrorInvalidValue;
    const tokens_block_params bp = {*t, r->codes, r->scales, r->scale_ld};
    return launch_tokens<true>(bp, ctas, stream);
}

extern "C" cudaError_t mf_quantize_fp8_load(void) {
    return mf_load_kernels(
        fp8_quantize_rows_kernel, fp8_quantize_tokens_kernel<false, false, false>,
        fp8_quantize_tokens_kernel<false, false, true>, fp8_quantize_tokens_kernel<false, true, false>,
        fp8_quantize_tokens_kernel<false, true, true>, fp8_quantize_tokens_kernel<true, false, false>,
        fp8_quantize_tokens_kernel<true, false, true>, fp8_quantize_tokens_kernel<true, true, false>,
        fp8_quantize_tokens_kernel<true, true, true>);
}
