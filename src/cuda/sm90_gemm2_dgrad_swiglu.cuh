/* dgrad2's pieces apart from its kernel (sm_90a, bf16): the arguments, the gate_up tile's
 * layout, the producer, the SwiGLU backward of one element and the store warps' copy of
 * dg and du. The math and the layouts are described in sm90_gemm2_dgrad_swiglu_bwd_bf16.cu. */
#pragma once

#include <cuda_bf16.h>

#include "kernels.h"
#include "sm90_grouped_gemm.cuh"
#include "swiglu.cuh"
#include "tensor_map.h"

namespace mf {
namespace sm90 {
namespace dgrad2 {

struct Dgrad2Args {
    CUtensorMap map_dys;   /* [rows_cap, H], box 128 x 64 (K-major) */
    CUtensorMap map_w2;    /* [E * H, I], box 64 rows x 64 columns (MN-major B) */
    CUtensorMap map_gu;    /* [rows_cap, 2I], box 128 rows x 64 columns */
    const int32_t *row_block_expert;
    const int32_t *num_rows;
    const int32_t *row_slot;
    const float *slot_weight;
    const float *row_weight;
    uint16_t *dh;
    uint16_t *act_p;
    float *dp_partial;
    int rows_cap, hidden, intermediate, dp_parts;
};

/* The gate_up tile in shared memory: g then u, each BN/64 boxes of 128 rows x 64 columns
 * (16 KB, 128-byte swizzle). */
constexpr int kGuBoxBytes = kBlockM * 64 * 2;
constexpr int kTileN = 128;                           /* BN */
constexpr int kGuBytes = 2 * (kTileN / 64) * kGuBoxBytes;
/* 5 stages of 32 KB beside the 64 KB gate_up tile: act_p goes from the consumers'
 * registers straight to global memory, so no store buffers; the store warps copy dg and du
 * out of the gate_up tile.
 * NOTE: measured on an H200 (ncu stall sampling, bench/NOTES.md v10): with 4 stages and
 * act_p staged through 34 KB of buffers, the consumers waited for their operands about
 * 30% of the time (a stage feeds 0.28 us of wgmma at BN = 128). */
using Dgrad2Cfg = TileConfig<kTileN, 5, false, true, kGuBytes, 0, true>;

/* ---- producer: A rows of the block, then BN/64 boxes of W2_e rows k.. k+63; after the
 * last K stage, the tile's gate_up (once the epilogue of the tile before let go of it). */
template <class Cfg>
struct Dgrad2Load {
    const Dgrad2Args &args;
    Ring<Cfg> ring;
    int m_row, w_row, n_col;
    uint32_t gu_phase;

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
        if (k + kBlockK < args.hidden) return;
        ptx::mbar_wait(ring.extra_empty, gu_phase ^ 1u);
        uint64_t *const full = ring.extra_full;
        ptx::mbar_arrive_expect_tx(full, Cfg::kExtraBytes);
#pragma unroll
        for (int j = 0; j < Cfg::BN / 64; ++j) {
            ptx::tma_load_2d(ring.extra + j * kGuBoxBytes, &args.map_gu, full,
                             n_col + 64 * j, m_row);
            ptx::tma_load_2d(ring.extra + (Cfg::BN / 64 + j) * kGuBoxBytes, &args.map_gu,
                             full, args.intermediate + n_col + 64 * j, m_row);
        }
        gu_phase ^= 1u;
    }
};


struct SwigluBwd {
    float act, dg, du;   /* bf16-rounded a, and p da' u silu'(g), p da' silu(g) */
};

/* silu'(g) = s (1 + g (1 - s)); a as the forward's store warps compute it (swiglu.cuh). */
__device__ __forceinline__ SwigluBwd swiglu_bwd(float g, float u, float da) {
    const Swiglu f = swiglu(g, u);
    return {__bfloat162float(__float2bfloat16_rn(f.a)), da * u * (f.s * (1.f + g * (1.f - f.s))),
            da * f.silu};
}

/* Store warps: dg and du of kRows rows of the gate_up tile from tile row `first` on, to
 * dh rows row0, row0 + 1, ... (one row per warp step: lanes 0-15 its 16 pieces of dg,
 * lanes 16-31 those of du). */
template <int kRows>
__device__ __forceinline__ void store_dg_du_rows(const Dgrad2Args &args, const uint8_t *extra,
                                                 int first, int64_t row0, int n_block) {
    const int I = args.intermediate;
    const int col0 = n_block * kTileN;
    const int sw = threadIdx.x / 32 - kFirstStoreWarp, lane = threadIdx.x % 32;
    const int v = lane % 16, half = lane / 16;
    const uint8_t *tile = extra + half * (kGuBytes / 2) + first * 128;
#pragma unroll 1   /* the store warps have 40 registers (kProducerRegs) */
    for (int r = sw; r < kRows; r += kStoreWarps) {
        const int off = (v / 8) * kGuBoxBytes + r * 128 + (((v % 8) ^ (r % 8)) << 4);
        uint4 *dst = reinterpret_cast<uint4 *>(args.dh + (row0 + r) * 2 * I + half * I + col0);
        dst[v] = *reinterpret_cast<const uint4 *>(tile + off);
    }
}

/* The kernel arguments from checked parameters (the caller checks them). */
inline cudaError_t dgrad2_args(const mf_dgrad2_params *p, Dgrad2Args *args) {
    cudaError_t err;
    if ((err = mf_tensor_map_bf16_2d(&args->map_dys, p->dys, (uint64_t)p->rows_cap, p->hidden,
                                     p->hidden, kBlockM, kBlockK)) != cudaSuccess)
        return err;
    if ((err = mf_tensor_map_bf16_2d(&args->map_w2, p->w2,
                                     (uint64_t)p->num_local_experts * p->hidden,
                                     p->intermediate, p->intermediate, kBlockK, 64)) !=
        cudaSuccess)
        return err;
    if ((err = mf_tensor_map_bf16_2d(&args->map_gu, p->gate_up, (uint64_t)p->rows_cap,
                                     2 * (uint64_t)p->intermediate, 2 * (uint64_t)p->intermediate,
                                     kBlockM, 64)) != cudaSuccess)
        return err;
    args->row_block_expert = p->row_block_expert;
    args->num_rows = p->num_rows;
    args->row_slot = p->row_slot;
    args->slot_weight = p->slot_weight;
    args->row_weight = p->row_weight;
    args->dh = p->dh;
    args->act_p = p->act_p;
    args->dp_partial = p->dp_partial;
    args->rows_cap = p->rows_cap;
    args->hidden = p->hidden;
    args->intermediate = p->intermediate;
    args->dp_parts = p->intermediate / kTileN;   /* = mf_dgrad2_dp_parts */

    return cudaSuccess;
}

}  // namespace dgrad2
}  // namespace sm90
}  // namespace mf
