/* dgrad of gemm2 with dp and the SwiGLU backward in the epilogue (sm_90a, bf16).
 *
 *   da'_r = dys_r W2_e                dys [rows, H], W2_e [H, I] (I contiguous), fp32
 *   a     = bf16(silu(g) * u)         g, u from the saved gate_up [rows, 2I]
 *   dp_partial[r, n block] = sum over the tile's columns of da' * a       (fp32)
 *   da    = p * da'                   p = slot_weight[row_slot[r]], or row_weight[r]
 *   dh_r  = bf16([da * u * silu'(g) | da * silu(g)])      [rows, 2I], like gate_up
 *   act_p_r = bf16(p * a)             [rows, I], the A operand of dW2
 * Padding rows (row_slot -1) get zeros in all three outputs.
 *
 * A = dys is K-major (K = H). B = W2_e is MN-major: the reduction runs over its rows,
 * its N = I index is contiguous, so each stage loads BN/64 boxes of 64 I columns x 64 W2
 * rows and the wgmma reads B transposed.
 *
 * Epilogue: three passes through the staged store (act_p with the dp sum, dg, du); each
 * pass reads the thread's g and u pairs straight from gate_up (4-byte loads, the second
 * and third hit L2).
 *
 * FLOPs: 2 * rows * H * I. qwen3-30b-a3b at 131072 rows: 412 GFLOP, about 0.52 ms at
 * 790 TFLOP/s; outputs dh + act_p are 3 * rows * I * 2 bytes (0.6 GB) and the gate_up
 * read 0.4 GB: the epilogue's share is large. */
#include <cuda_bf16.h>

#include "kernels.h"
#include "sm90_grouped_gemm.cuh"
#include "tensor_map.h"

namespace {

using namespace mf;
using namespace mf::sm90;

struct Dgrad2Args {
    CUtensorMap map_dys;   /* [rows_cap, H], box 128 x 64 (K-major) */
    CUtensorMap map_w2;    /* [E * H, I], box 64 rows x 64 columns (MN-major B) */
    const int32_t *row_block_expert;
    const int32_t *num_rows;
    const int32_t *row_slot;
    const float *slot_weight;
    const float *row_weight;
    const uint16_t *gate_up;
    uint16_t *dh;
    uint16_t *act_p;
    float *dp_partial;
    int rows_cap, hidden, intermediate, dp_parts;
};

/* ---- producer: A rows of the block, then BN/64 boxes of W2_e rows k.. k+63 ----------- */
template <class Cfg>
struct Dgrad2Load {
    const Dgrad2Args &args;
    int m_row, w_row, n_col;

    __device__ __forceinline__ void tile_begin(int m_block, int n_block) {
        const int e = args.row_block_expert[m_block];
        m_row = m_block * kBlockM;
        w_row = e * args.hidden;
        n_col = n_block * Cfg::BN;
    }
    __device__ __forceinline__ void stage(int kb, uint8_t *a, uint8_t *b, uint64_t *bar) {
        const int k = kb * kBlockK;
        ptx::tma_load_2d(a, &args.map_dys, bar, k, m_row);
#pragma unroll
        for (int j = 0; j < Cfg::BN / 64; ++j)
            ptx::tma_load_2d(b + j * Cfg::kMnBoxBytes, &args.map_w2, bar, n_col + 64 * j,
                             w_row + k);
    }
};

__device__ __forceinline__ float bf16_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }
__device__ __forceinline__ float sigmoid(float g) { return 1.f / (1.f + __expf(-g)); }
/* The forward's silu (sm90_gemm1_swiglu_fwd_bf16.cu), so a matches its rounding path. */
__device__ __forceinline__ float silu(float g) { return g / (1.f + __expf(-g)); }
__device__ __forceinline__ float round_bf16(float x) {
    return __bfloat162float(__float2bfloat16_rn(x));
}

/* ---- epilogue ----------------------------------------------------------------------------
 * Accumulator layout of m64nN (per warpgroup): register 4c + 2h + {0,1} of lane l in warp
 * w holds row 16w + l/4 + 8h, columns 8c + 2(l%4) + {0,1}. */
template <class Cfg>
struct Dgrad2Epilogue {
    const Dgrad2Args &args;

    __device__ __forceinline__ void operator()(int m_block, int n_block,
                                               float (&acc)[Cfg::kAccRegs], uint8_t *buf) {
        constexpr int kChunkCols = Cfg::BN < kEpiMaxCols ? Cfg::BN : kEpiMaxCols;
        constexpr int kChunks = Cfg::BN / kChunkCols;
        constexpr int kR = kChunkCols / 2;   /* accumulator registers per chunk */
        const int t = threadIdx.x % 128;
        const int lane = t % 32, warp = t / 32;
        const int I = args.intermediate;
        const int64_t row0 = (int64_t)m_block * kBlockM + (threadIdx.x / 128) * 64;
        const int col0 = n_block * Cfg::BN;

        float w[2];
        bool valid[2];
        const uint32_t *gu_row[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int64_t r = row0 + warp * 16 + lane / 4 + 8 * h;
            const int slot = args.row_slot[r];
            valid[h] = slot >= 0;
            w[h] = !valid[h] ? 0.f : args.row_weight ? args.row_weight[r] : args.slot_weight[slot];
            gu_row[h] = reinterpret_cast<const uint32_t *>(args.gate_up + r * 2 * I + col0 +
                                                           2 * (lane % 4));
        }
        /* g and u pair of accumulator registers (4c + 2h, +1) of chunk ch: word 4c of the
         * row (8 columns per c), the u half I columns on. */
        auto load_gu = [&](int ch, int c, int h, uint32_t &g2, uint32_t &u2) {
            const uint32_t *p = gu_row[h] + (ch * kChunkCols + 8 * c) / 2;
            g2 = __ldg(p);
            u2 = __ldg(p + I / 2);
        };

        /* Pass 1: act_p = bf16(p * a) and the dp partial sums over this tile's columns. */
        float dp[2] = {0.f, 0.f};
#pragma unroll
        for (int ch = 0; ch < kChunks; ++ch) {
            epi_store_chunk<kChunkCols>(
                buf,
                [&](int c, int h) {
                    uint32_t g2, u2;
                    load_gu(ch, c, h, g2, u2);
                    const float a0 = round_bf16(silu(bf16_lo(g2)) * bf16_lo(u2));
                    const float a1 = round_bf16(silu(bf16_hi(g2)) * bf16_hi(u2));
                    const float d0 = acc[ch * kR + 4 * c + 2 * h];
                    const float d1 = acc[ch * kR + 4 * c + 2 * h + 1];
                    dp[h] = fmaf(d0, a0, dp[h]);
                    dp[h] = fmaf(d1, a1, dp[h]);
                    return valid[h] ? pack_bf16x2_rn(w[h] * a0, w[h] * a1) : 0u;
                },
                [&](int r) -> void * { return args.act_p + (row0 + r) * I + col0 + ch * kChunkCols; });
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            dp[h] += __shfl_xor_sync(0xffffffffu, dp[h], 1);
            dp[h] += __shfl_xor_sync(0xffffffffu, dp[h], 2);
            if (lane % 4 == 0) {
                const int64_t r = row0 + warp * 16 + lane / 4 + 8 * h;
                args.dp_partial[r * args.dp_parts + n_block] = valid[h] ? dp[h] : 0.f;
            }
        }

        /* Pass 2: dg = p da' u silu'(g), silu'(g) = s (1 + g (1 - s)), s = sigmoid(g). */
#pragma unroll
        for (int ch = 0; ch < kChunks; ++ch) {
            epi_store_chunk<kChunkCols>(
                buf,
                [&](int c, int h) {
                    uint32_t g2, u2;
                    load_gu(ch, c, h, g2, u2);
                    const float g0 = bf16_lo(g2), g1 = bf16_hi(g2);
                    const float s0 = sigmoid(g0), s1 = sigmoid(g1);
                    const float da0 = w[h] * acc[ch * kR + 4 * c + 2 * h];
                    const float da1 = w[h] * acc[ch * kR + 4 * c + 2 * h + 1];
                    const float dg0 = da0 * bf16_lo(u2) * (s0 * (1.f + g0 * (1.f - s0)));
                    const float dg1 = da1 * bf16_hi(u2) * (s1 * (1.f + g1 * (1.f - s1)));
                    return valid[h] ? pack_bf16x2_rn(dg0, dg1) : 0u;
                },
                [&](int r) -> void * {
                    return args.dh + (row0 + r) * 2 * I + col0 + ch * kChunkCols;
                });
        }
        /* Pass 3: du = p da' silu(g). */
#pragma unroll
        for (int ch = 0; ch < kChunks; ++ch) {
            epi_store_chunk<kChunkCols>(
                buf,
                [&](int c, int h) {
                    const uint32_t g2 = __ldg(gu_row[h] + (ch * kChunkCols + 8 * c) / 2);
                    const float da0 = w[h] * acc[ch * kR + 4 * c + 2 * h];
                    const float da1 = w[h] * acc[ch * kR + 4 * c + 2 * h + 1];
                    const float du0 = da0 * silu(bf16_lo(g2));
                    const float du1 = da1 * silu(bf16_hi(g2));
                    return valid[h] ? pack_bf16x2_rn(du0, du1) : 0u;
                },
                [&](int r) -> void * {
                    return args.dh + (row0 + r) * 2 * I + I + col0 + ch * kChunkCols;
                });
        }
    }
};

template <class Cfg>
__global__ void __launch_bounds__(kThreads, 1)
    sm90_gemm2_dgrad_swiglu_bwd_bf16_kernel(const __grid_constant__ Dgrad2Args args) {
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    Dgrad2Load<Cfg> load{args, 0, 0, 0};
    Dgrad2Epilogue<Cfg> epi{args};
    run_grouped_gemm<Cfg>(smem_raw, &args.map_dys, &args.map_w2, args.num_rows, args.rows_cap,
                          args.intermediate / Cfg::BN, args.hidden / kBlockK, load, epi);
}

template <class Cfg>
cudaError_t launch(const mf_dgrad2_params *p, cudaStream_t stream) {
    Dgrad2Args args;
    cudaError_t err;
    if ((err = mf_tensor_map_bf16_2d(&args.map_dys, p->dys, (uint64_t)p->rows_cap, p->hidden,
                                     p->hidden, kBlockM, kBlockK)) != cudaSuccess)
        return err;
    if ((err = mf_tensor_map_bf16_2d(&args.map_w2, p->w2,
                                     (uint64_t)p->num_local_experts * p->hidden,
                                     p->intermediate, p->intermediate, kBlockK, 64)) !=
        cudaSuccess)
        return err;
    args.row_block_expert = p->row_block_expert;
    args.num_rows = p->num_rows;
    args.row_slot = p->row_slot;
    args.slot_weight = p->slot_weight;
    args.row_weight = p->row_weight;
    args.gate_up = p->gate_up;
    args.dh = p->dh;
    args.act_p = p->act_p;
    args.dp_partial = p->dp_partial;
    args.rows_cap = p->rows_cap;
    args.hidden = p->hidden;
    args.intermediate = p->intermediate;
    args.dp_parts = p->intermediate / Cfg::BN;   /* = mf_dgrad2_dp_parts */

    return launch_persistent(sm90_gemm2_dgrad_swiglu_bwd_bf16_kernel<Cfg>, Cfg::kSmemBytes, p->num_sms, args, stream);
}

}  // namespace

/* Tile choice (and so the dp partials per row): BN = 128, 6 stages of 32 KB. 0 when I is
 * not supported.
 * NOTE: BN = 256 spills (284 bytes) under the 168-register compile budget of the
 * 384-thread kernel: the epilogue's g/u loads get hoisted next to 128 accumulators.
 * Staging gate_up through shared memory would make BN = 256 possible. */
extern "C" int mf_dgrad2_dp_parts(int intermediate) {
    if (intermediate <= 0 || intermediate % 128) return 0;
    return intermediate / 128;
}

extern "C" cudaError_t mf_sm90_gemm2_dgrad_swiglu_bwd_bf16(const mf_dgrad2_params *p,
                                                           cudaStream_t stream) {
    if (!p || !p->dys || !p->w2 || !p->gate_up || !p->row_block_expert || !p->num_rows ||
        !p->row_slot || (!p->slot_weight && !p->row_weight) || !p->dh || !p->act_p || !p->dp_partial)
        return cudaErrorInvalidValue;
    if (p->rows_cap < 0 || p->rows_cap % kBlockM || p->hidden <= 0 || p->hidden % kBlockK ||
        p->intermediate <= 0 || p->intermediate % 128 || p->num_local_experts <= 0 ||
        p->num_sms <= 0)
        return cudaErrorInvalidValue;
    /* TMA sources, the 16-byte epilogue stores and the 4-byte gate_up loads. */
    if (misaligned16(p->dys, p->w2, p->gate_up, p->dh, p->act_p) ||
        (reinterpret_cast<uintptr_t>(p->dp_partial) & 3u))
        return cudaErrorInvalidValue;
    if (p->rows_cap == 0) return cudaSuccess;
    return launch<TileConfig<128, 6, false, true>>(p, stream);
}
