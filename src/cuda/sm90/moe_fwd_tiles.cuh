/* The tiles of the forward's two GEMMs, shared by the kernels that run them: the
 * stage-by-stage kernels (src/cuda/sm90/gemm1_swiglu.cu, src/cuda/sm90/gemm2_combine.cu)
 * and the fused forward (src/cuda/sm90/fused_forward.cu), so that both paths compute every
 * tile with the same code and agree bit for bit.
 *
 *   gemm1: [g | u] = bf16(xs W13_e^T), act = bf16(silu(g) * u)      xs [rows, H]
 *   gemm2: combine[row_slot[r]] = bf16(p * (act_r W2_e^T))           act [rows, I]
 *
 * Per GEMM: its kernel arguments and how the launcher fills them from the C params
 * (with the checks every launcher makes), the producer's loads of one tile, and (gemm1)
 * the epilogue; gemm2's epilogue is ScatterRowsEpilogue (src/cuda/sm90/common/grouped_gemm.cuh).
 *
 * A tile of gemm1 covers BN/2 gate columns j.. and the matching BN/2 up columns I+j..:
 * the producer loads W13_e rows j.. into the first half of the B tile and rows I+j..
 * into the second, so one m64nBN wgmma leaves g and u of the same column in the same
 * thread (accumulator registers i and i + BN/4), and the SwiGLU needs no exchange.
 * The two halves come through two tensor maps (W13Halves), so W13 packed or in two
 * separate arrays (gemm_params.h) loads the same boxes into the same places. */
#pragma once

#include <cuda_bf16.h>

#include "transport/ep_wait.cuh"
#include "kernels.h"
#include "sm90/common/grouped_gemm.cuh"
#include "swiglu.cuh"

namespace mf {
namespace sm90 {

/* ---- gemm1 -------------------------------------------------------------------------- */

struct Gemm1Args {
    CUtensorMap map_xs;    /* [rows_cap, H], box 128 x 64 */
    W13Halves w13;         /* the gate and up rows, box BN/2 x 64 */
    const int32_t *row_block_expert;
    const int32_t *num_rows;
    __nv_bfloat16 *act;
    __nv_bfloat16 *gate_up;
    ep::RowArrivals rows_in;         /* EP: the blocks' rows arriving (arrivals null: none) */
    int rows_cap, hidden, intermediate;
    BlockScales scales;              /* FP8: xs's row scales, W13's block scales */
};

/* What the gemm1 kernels of precision P take of any shape (the tile width is picked
 * after this). FP8: whole 128-blocks of H and I (a tile's gate and up halves each within
 * one weight block). */
template <class P>
inline bool gemm1_params_ok(const mf_gemm1_params *p) {
    if (!p || !operand_ok<P>(p->xs, MF_SCALES_1X128) || !operand_ok<P>(p->w13, MF_SCALES_128X128) ||
        !w13_halves_ok<P>(p->w13_up, p->intermediate) || !row_blocks_ok(p->rows) || !p->act ||
        !arrivals_ok(p->rows_in))
        return false;
    const int i_multiple = P::kAScaleBytes ? 128 : 64;
    if (p->hidden <= 0 || p->hidden % P::kBlockK || p->intermediate <= 0 ||
        p->intermediate % i_multiple || p->num_sms <= 0)
        return false;
    /* TMA sources and the 16-byte epilogue stores need 16-byte aligned bases. */
    return !misaligned16(p->xs.data, p->w13.data, p->w13_up, p->act, p->gate_up, p->xs.scales);
}

template <class Cfg>
cudaError_t gemm1_args_from(const mf_gemm1_params *p, Gemm1Args *args) {
    cudaError_t err;
    using P = typename Cfg::Precision;
    if ((err = tensor_map_2d<P>(&args->map_xs, p->xs.data, (uint64_t)p->rows.rows_cap,
                                p->hidden, p->hidden, kBlockM, Cfg::kBlockK)) != cudaSuccess)
        return err;
    if ((err = w13_halves_from<P>(&args->w13, p->w13.data, p->w13_up, p->rows.num_local_experts,
                                  p->intermediate, p->hidden, Cfg::BN / 2, Cfg::kBlockK)) !=
        cudaSuccess)
        return err;
    args->row_block_expert = p->rows.row_block_expert;
    args->num_rows = p->rows.num_rows;
    args->act = reinterpret_cast<__nv_bfloat16 *>(p->act);
    args->gate_up = reinterpret_cast<__nv_bfloat16 *>(p->gate_up);
    const mf_arrivals &w = p->rows_in;
    args->rows_in = {w.arrivals, w.target, w.state, w.timeout_ns, w.stage};
    args->rows_cap = p->rows.rows_cap;
    args->hidden = p->hidden;
    args->intermediate = p->intermediate;
    args->scales = block_scales_of(p->xs, p->w13, p->rows.rows_cap);
    return cudaSuccess;
}

/* Producer: A rows of the block (and their scales), then the gate and up halves of B. */
template <class Cfg>
struct Gemm1Load {
    const Gemm1Args &args;
    int m_row, w_gate_row, w_up_row;
    bool gave_up;   /* a wait ran out: the call failed, wait no more */

    /* Expert parallelism: the block's rows may still be arriving from the other ranks. */
    __device__ __forceinline__ void wait_rows(int m_block) {
        if (args.rows_in.arrivals && !gave_up) gave_up = !ep::wait_block_rows(args.rows_in, m_block);
    }

    __device__ __forceinline__ void tile_begin(int m_block, int n_block) {
        wait_rows(m_block);
        const int e = args.row_block_expert[m_block];
        m_row = m_block * kBlockM;
        w_gate_row = args.w13.gate_row(e, n_block * (Cfg::BN / 2));
        w_up_row = args.w13.up_row(e, n_block * (Cfg::BN / 2));
    }
    __device__ __forceinline__ void stage(int kb, uint8_t *a, uint8_t *b, uint64_t *bar) {
        const int k = kb * Cfg::kBlockK;
        ptx::tma_load_2d(a, &args.map_xs, bar, k, m_row);
        ptx::tma_load_2d(b, &args.w13.map_gate, bar, k, w_gate_row);
        ptx::tma_load_2d(b + Cfg::kBBytes / 2, &args.w13.map_up, bar, k, w_up_row);
    }
    __device__ __forceinline__ void stage(int kb, uint8_t *a, uint8_t *b, uint8_t *a_scales,
                                          uint64_t *bar) {
        stage(kb, a, b, bar);
        args.scales.load_a<Cfg>(a_scales, kb, m_row, bar);
    }
    /* Consumers (FP8): the tile's scale hook (B's gate and up halves: two weight blocks;
     * FP8 weights are packed). */
    __device__ __forceinline__ auto block_scale(int m_block, int n_block, int k_blocks) const {
        const int64_t gate = (int64_t)args.row_block_expert[m_block] * 2 * args.intermediate +
                             n_block * (Cfg::BN / 2);
        return args.scales.tile<Cfg>(gate, gate + args.intermediate, args.hidden, k_blocks);
    }
};

/* Epilogue: [g | u] rounded to bf16, then act = silu(g) * u from those.
 * The consumers write their 64 rows of [g | u] (bf16) into their buffer and go on with
 * the next tile's K loop; the store warps compute act from the buffer (swiglu.cuh: the
 * same expression as the backward's, and the CPU backend's rounding path) and store act,
 * and g and u when gate_up is asked for.
 * NOTE: act used to be computed from fp32 g and u in the consumers, which stored the
 * three outputs themselves with the tensor cores idle; the store warps' buffers cost a
 * stage (3 instead of 4), which gives back part of the overlap (see
 * docs/decisions/0004-store-warps). */
template <class Cfg>
struct Gemm1Epilogue {
    const Gemm1Args &args;
    Ring<Cfg> ring;
    StoreHandoff handoff;

    /* Buffer row: BN/2 gate columns then the BN/2 matching up columns (the accumulator's
     * own column order). The caller holds the buffer (StoreHandoff). */
    __device__ __forceinline__ void write_rows(float (&acc)[Cfg::kAccRegs], uint8_t *buf) {
        epi_write_acc_bf16<Cfg>(buf, acc);
    }
    __device__ __forceinline__ void operator()(int, int, float (&acc)[Cfg::kAccRegs],
                                               uint8_t *buf) {
        handoff.stage<false>(ring, buf, [&](uint8_t *b) { write_rows(acc, b); });
    }

    /* Store warps: each lane takes 4 columns of a row (8 bytes of g, 8 of u, 8 of act),
     * so a warp covers 32 / (BN/8) rows per step and every store is a whole row piece. */
    __device__ __forceinline__ void drain(int m_block, int n_block, int wg, const uint8_t *buf) {
        constexpr int kCols = Cfg::BN / 2;             /* act columns of the tile */
        constexpr int kLanesPerRow = kCols / 4;
        constexpr int kRowsPerStep = 32 / kLanesPerRow;
        static_assert(32 % kLanesPerRow == 0, "a warp step covers whole rows");
        const int I = args.intermediate;
        const int sw = threadIdx.x / 32 - kFirstStoreWarp, lane = threadIdx.x % 32;
        const int v = lane % kLanesPerRow;
        const int64_t row0 = (int64_t)m_block * kBlockM + wg * 64;
        const int col = n_block * kCols + 4 * v;
        for (int r = sw * kRowsPerStep + lane / kLanesPerRow; r < 64;
             r += kStoreWarps * kRowsPerStep) {
            const uint8_t *src = buf + r * Cfg::kEpiRowBytes + 8 * v;
            const uint2 g = *reinterpret_cast<const uint2 *>(src);
            const uint2 u = *reinterpret_cast<const uint2 *>(src + kCols * 2);
            const float a0 = swiglu(bf16_lo(g.x), bf16_lo(u.x)).a;
            const float a1 = swiglu(bf16_hi(g.x), bf16_hi(u.x)).a;
            const float a2 = swiglu(bf16_lo(g.y), bf16_lo(u.y)).a;
            const float a3 = swiglu(bf16_hi(g.y), bf16_hi(u.y)).a;
            const int64_t row = row0 + r;
            *reinterpret_cast<uint2 *>(args.act + row * I + col) =
                make_uint2(pack_bf16x2_rn(a0, a1), pack_bf16x2_rn(a2, a3));
            if (args.gate_up) {
                __nv_bfloat16 *gu_row = args.gate_up + row * 2 * I + col;
                *reinterpret_cast<uint2 *>(gu_row) = g;
                *reinterpret_cast<uint2 *>(gu_row + I) = u;
            }
        }
    }
};

/* ---- gemm2 -------------------------------------------------------------------------- */

struct Gemm2Args {
    CUtensorMap map_act;   /* [rows_cap, I], box 128 x 64 */
    CUtensorMap map_w2;    /* [E * H, I], box BN x 64 */
    const int32_t *row_block_expert;
    const int32_t *num_rows;
    ScatterTarget to;
    int rows_cap, hidden, intermediate;
    BlockScales scales;    /* FP8: act's row scales, W2's block scales */
};

/* What the gemm2 kernels of precision P take of any shape (the tile width is picked
 * after this). */
template <class P>
inline bool gemm2_params_ok(const mf_gemm2_params *p) {
    if (!p || !operand_ok<P>(p->act, MF_SCALES_1X128) || !operand_ok<P>(p->w2, MF_SCALES_128X128) ||
        !row_blocks_ok(p->rows) || !p->row_weight || !scatter_ok(p->to))
        return false;
    if (p->hidden <= 0 || p->hidden % 128 || p->intermediate <= 0 ||
        p->intermediate % P::kBlockK || p->num_sms <= 0)
        return false;
    /* TMA sources and the 16-byte epilogue stores need 16-byte aligned bases. */
    return !misaligned16(p->act.data, p->w2.data, p->to.combine, p->act.scales);
}

template <class Cfg>
cudaError_t gemm2_args_from(const mf_gemm2_params *p, Gemm2Args *args) {
    cudaError_t err;
    using P = typename Cfg::Precision;
    if ((err = tensor_map_2d<P>(&args->map_act, p->act.data, (uint64_t)p->rows.rows_cap,
                                p->intermediate, p->intermediate, kBlockM, Cfg::kBlockK)) !=
        cudaSuccess)
        return err;
    if ((err = tensor_map_2d<P>(&args->map_w2, p->w2.data,
                                (uint64_t)p->rows.num_local_experts * p->hidden,
                                p->intermediate, p->intermediate, Cfg::BN, Cfg::kBlockK)) !=
        cudaSuccess)
        return err;
    args->row_block_expert = p->rows.row_block_expert;
    args->num_rows = p->rows.num_rows;
    args->to = ScatterTarget{p->to.row_slot, p->row_weight, p->to.combine,
                             p->to.combine_peers, p->to.num_ranks, p->hidden};
    args->rows_cap = p->rows.rows_cap;
    args->hidden = p->hidden;
    args->intermediate = p->intermediate;
    args->scales = block_scales_of(p->act, p->w2, p->rows.rows_cap);
    return cudaSuccess;
}

/* Producer: A rows of the block (and their scales), BN rows of W2_e. */
template <class Cfg>
struct Gemm2Load {
    const Gemm2Args &args;
    int m_row, w_row;

    __device__ __forceinline__ void tile_begin(int m_block, int n_block) {
        const int e = args.row_block_expert[m_block];
        m_row = m_block * kBlockM;
        w_row = e * args.hidden + n_block * Cfg::BN;
    }
    __device__ __forceinline__ void stage(int kb, uint8_t *a, uint8_t *b, uint64_t *bar) {
        const int k = kb * Cfg::kBlockK;
        ptx::tma_load_2d(a, &args.map_act, bar, k, m_row);
        ptx::tma_load_2d(b, &args.map_w2, bar, k, w_row);
    }
    __device__ __forceinline__ void stage(int kb, uint8_t *a, uint8_t *b, uint8_t *a_scales,
                                          uint64_t *bar) {
        stage(kb, a, b, bar);
        args.scales.load_a<Cfg>(a_scales, kb, m_row, bar);
    }
    /* Consumers (FP8): the tile's scale hook (its columns are W2_e rows: one or two 128-row
     * blocks). */
    __device__ __forceinline__ auto block_scale(int m_block, int n_block, int k_blocks) const {
        const int64_t n = (int64_t)args.row_block_expert[m_block] * args.hidden + n_block * Cfg::BN;
        return args.scales.tile<Cfg>(n, n + Cfg::BN / 2, args.intermediate, k_blocks);
    }
};

}  // namespace sm90
}  // namespace mf
