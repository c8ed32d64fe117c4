/* The tiles of the backward's GEMMs after dgrad2, shared by the kernels that run them:
 * the stage-by-stage kernels (src/cuda/sm90/wgrad_grouped.cu, src/cuda/sm90/dgrad1.cu)
 * and the fused backward (src/cuda/sm90/fused_backward.cu), so that both paths compute every
 * tile with the same code and agree bit for bit.
 *
 *   wgrad:  dw_e [M, N] = (accumulate ? dw_e : 0) + sum over e's rows of lhs[r]^T rhs[r]
 *   dgrad1: combine[row_slot[r]] = bf16(dh_r W13_e)
 *
 * Per GEMM: its kernel arguments and how a launcher fills them from the C params (with
 * the checks every launcher makes), the producer's loads of one tile, and (wgrad) the
 * epilogue; dgrad1's epilogue is ScatterRowsEpilogue (src/cuda/sm90/common/grouped_gemm.cuh). */
#pragma once

#include "kernels.h"
#include "sm90/common/grouped_gemm.cuh"

namespace mf {
namespace sm90 {

/* ---- wgrad (K-grouped: the reduction runs over each expert's rows) ------------------ */

struct WgradArgs {
    CUtensorMap map_lhs;   /* [rows_cap, M], box 64 rows x 64 columns */
    CUtensorMap map_rhs;   /* [rows_cap, N], box 64 rows x 64 columns */
    const int32_t *expert_offsets;
    const int32_t *expert_order;   /* [E_local + 1] mf_expert_order's; NULL: 0, 1, ... */
    float *dw;
    uint16_t *dw_bf16;
    /* The output in two halves (gemm_params.h): rows up_first.. of an expert's m go to
     * dw_up (dw_bf16_up) from its row 0, the expert's rows expert_rows apart in either.
     * One array: up_first = expert_rows = m. */
    float *dw_up;
    uint16_t *dw_bf16_up;
    int expert_rows, up_first;
    int m, n, m_blocks, n_blocks, num_experts, accumulate;
    /* FP8: lhs^T [M, rows_cap] and rhs^T [N, rows_cap] codes (K-major), their scales
     * [rows_cap / 128, M] and [rows_cap / 128, N] */
    const float *lhs_scales, *rhs_scales;
};

/* Tile i of the order: the ((i / (m_blocks n_blocks))-th expert of it, n fastest. */
__device__ __forceinline__ void wgrad_tile(const int32_t *order, int m_blocks, int n_blocks,
                                           int i, int &m_block, int &n_block) {
    const int per_expert = m_blocks * n_blocks;
    const int rank = i / per_expert, t = i - rank * per_expert;
    const int e = order ? __ldg(order + rank) : rank;
    m_block = e * m_blocks + t / n_blocks;
    n_block = t % n_blocks;
}

/* What the wgrad kernels of precision P take of any shape (the tile width is picked after
 * this). */
template <class P>
inline bool wgrad_params_ok(const mf_wgrad_params *p) {
    if (!p || !operand_ok<P>(p->lhs, MF_SCALES_TOKENS_128) ||
        !operand_ok<P>(p->rhs, MF_SCALES_TOKENS_128) || !p->rows.expert_offsets ||
        !p->dw == !p->dw_bf16 || (p->dw_bf16 && p->accumulate))
        return false;
    /* the up half beside the array of its type, and no 128-row tile across the halves */
    const bool halves = p->dw_up || p->dw_bf16_up;
    if ((p->dw_up && !p->dw) || (p->dw_bf16_up && !p->dw_bf16) ||
        (halves && p->m % (2 * kBlockM)))
        return false;
    const mf_rows &r = p->rows;
    if (r.rows_cap < 0 || r.rows_cap % kBlockM || p->m <= 0 || p->m % kBlockM || p->n <= 0 ||
        p->n % 128 || r.num_local_experts <= 0 || p->num_sms <= 0)
        return false;
    return !misaligned16(p->lhs.data, p->rhs.data, p->dw, p->dw_bf16, p->dw_up, p->dw_bf16_up,
                         p->lhs.scales, p->rhs.scales);
}

template <class Cfg>
cudaError_t wgrad_args_from(const mf_wgrad_params *p, WgradArgs *args) {
    cudaError_t err;
    using P = typename Cfg::Precision;
    const uint64_t rows = (uint64_t)p->rows.rows_cap;
    if (Cfg::kAMnMajor) {   /* bf16: the row-major operands, MN-major */
        if ((err = tensor_map_2d<P>(&args->map_lhs, p->lhs.data, rows, p->m, p->m,
                                    Cfg::kBlockK, Cfg::kMnBoxCols)) != cudaSuccess ||
            (err = tensor_map_2d<P>(&args->map_rhs, p->rhs.data, rows, p->n, p->n,
                                    Cfg::kBlockK, Cfg::kMnBoxCols)) != cudaSuccess)
            return err;
    } else {                /* FP8: the transposed copies, K-major */
        if ((err = tensor_map_2d<P>(&args->map_lhs, p->lhs.data, p->m, rows, rows, kBlockM,
                                    Cfg::kBlockK)) != cudaSuccess ||
            (err = tensor_map_2d<P>(&args->map_rhs, p->rhs.data, p->n, rows, rows, Cfg::BN,
                                    Cfg::kBlockK)) != cudaSuccess)
            return err;
    }
    args->lhs_scales = p->lhs.scales;
    args->rhs_scales = p->rhs.scales;
    args->expert_offsets = p->rows.expert_offsets;
    args->expert_order = p->expert_order;
    args->dw = p->dw;
    args->dw_bf16 = p->dw_bf16;
    args->dw_up = p->dw_up;
    args->dw_bf16_up = p->dw_bf16_up;
    args->expert_rows = p->dw_up || p->dw_bf16_up ? p->m / 2 : p->m;
    args->up_first = args->expert_rows;
    args->m = p->m;
    args->n = p->n;
    args->m_blocks = p->m / kBlockM;
    args->n_blocks = p->n / Cfg::BN;
    args->num_experts = p->rows.num_local_experts;
    args->accumulate = p->accumulate;
    return cudaSuccess;
}

/* All the tiles of a wgrad, every expert's (m_blocks x n_blocks each). */
__device__ __forceinline__ int wgrad_tiles(const WgradArgs &a) {
    return a.num_experts * a.m_blocks * a.n_blocks;
}

/* The tiles at the head of a wgrad's order that run the GEMM. With skip_empty (store
 * warps, which write the output) and an order: those of the experts with rows, which the
 * order puts first and counts in expert_order[E] (expert_order.cu); the others' tiles
 * are zeros, written by the store warps between drains (WgradEpilogue::idle_work).
 * Else every tile: an expert without rows runs a K loop of length 0. */
__device__ __forceinline__ int wgrad_gemm_tiles(const WgradArgs &a, bool skip_empty) {
    const int experts =
        skip_empty && a.expert_order ? __ldg(a.expert_order + a.num_experts) : a.num_experts;
    return experts * a.m_blocks * a.n_blocks;
}

/* K blocks of a wgrad tile: the expert's rows (a multiple of 128, maybe 0) in blocks of
 * kBlockK rows; m_block is the combined index e * m_blocks + m block. */
template <int kBlockK>
__device__ __forceinline__ int wgrad_k_blocks(const int32_t *offsets, int m_blocks, int m_block) {
    static_assert(kBlockM % kBlockK == 0, "an expert's rows (128-row blocks) are whole K blocks");
    const int e = m_block / m_blocks;
    const int rows = offsets[e + 1] - offsets[e];
    return rows > 0 ? rows / kBlockK : 0;
}

/* ---- producer: 2 boxes of lhs (128 M columns), BN/64 boxes of rhs, kBlockK rows each (bf16:
 * boxes of 64 columns x 64 rows) -------------------------------------------------------- */
template <class Cfg>
struct WgradLoad {
    const WgradArgs &args;
    int row0, m_col, n_col;

    __device__ __forceinline__ void tile_begin(int m_block, int n_block) {
        const int e = m_block / args.m_blocks;
        row0 = args.expert_offsets[e];
        m_col = (m_block - e * args.m_blocks) * kBlockM;
        n_col = n_block * Cfg::BN;
    }
    __device__ __forceinline__ void stage(int kb, uint8_t *a, uint8_t *b, uint64_t *bar) {
        const int row = row0 + kb * Cfg::kBlockK;
        if constexpr (Cfg::kAMnMajor) {
            tma_load_mn_boxes<Cfg, kBlockM / Cfg::kMnBoxCols>(a, &args.map_lhs, bar, m_col, row);
            tma_load_mn_boxes<Cfg, Cfg::BN / Cfg::kMnBoxCols>(b, &args.map_rhs, bar, n_col, row);
        } else {
            ptx::tma_load_2d(a, &args.map_lhs, bar, row, m_col);
            ptx::tma_load_2d(b, &args.map_rhs, bar, row, n_col);
        }
    }
    /* FP8: the token block's scales of the tile's 128 lhs rows, then of its BN rhs rows. */
    __device__ __forceinline__ void stage(int kb, uint8_t *a, uint8_t *b, uint8_t *scales,
                                          uint64_t *bar) {
        static_assert(Cfg::kAScaleBytes == (kBlockM + Cfg::BN) * 4, "both operands' row scales");
        stage(kb, a, b, bar);
        const int64_t t = (row0 + kb * Cfg::kBlockK) / 128;
        ptx::bulk_load_g2s(scales, args.lhs_scales + t * args.m + m_col, kBlockM * 4, bar);
        ptx::bulk_load_g2s(scales + kBlockM * 4, args.rhs_scales + t * args.n + n_col,
                           Cfg::BN * 4, bar);
    }
    __device__ __forceinline__ PromoteRowScales<Cfg::kAccRegs> block_scale(int, int, int) const {
        return {};
    }
};

/* ---- epilogue: rows of dw_e, fp32 written or accumulated by the consumers, or written
 * by the store warps (Cfg::kStoreRowBytes > 0: bf16, or fp32 where kStoreRowBytes is BN
 * fp32; write mode only).
 * Accumulator layout of m64nN (per warpgroup): register 4c + 2h + {0,1} of lane l in warp
 * w holds row 16w + l/4 + 8h, columns 8c + 2(l%4) + {0,1}. */
constexpr int kZeroRows = 16;   /* rows of a zero tile per idle_work piece */

template <class Cfg>
struct WgradEpilogue {
    /* the store warps' output: fp32 (rows of BN * 4 bytes; epi_write_acc_fp32 also asks
     * EPI_ROW_PAD = 32, so a bf16 config cannot turn fp32 by its row bytes alone), fp32 in
     * two column halves (rows of BN * 2 bytes with EPI_ROW_PAD = 32: two handoffs a tile)
     * or bf16 */
    static constexpr bool kStoresF32Halves =
        Cfg::kStoreRowBytes == Cfg::BN * 2 && Cfg::kEpiRowBytes % 128 == 32;
    static constexpr bool kStoresF32 = Cfg::kStoreRowBytes == Cfg::BN * 4 || kStoresF32Halves;
    static constexpr int kHandoffsPerTile = kStoresF32Halves ? 2 : 1;
    using Out = typename std::conditional<kStoresF32, float, uint16_t>::type;
    const WgradArgs &args;
    Ring<Cfg> ring;
    StoreHandoff handoff;
    int zero_tile, zero_end, zero_row;   /* store warps: this warp's zero tiles (idle_work) */

    /* gemm_tiles: the tiles of the order that run the GEMM; those past it (none when it
     * covers every expert) are zero tiles: CTA c takes every G-th from gemm_tiles + c, its
     * store warp sw every kStoreWarps-th of those. */
    __device__ __forceinline__ WgradEpilogue(const WgradArgs &a, const Ring<Cfg> &r, int gemm_tiles)
        : args(a), ring(r), zero_end(wgrad_tiles(a)), zero_row(0) {
        const int sw = (int)threadIdx.x / 32 - kFirstStoreWarp;
        zero_tile = gemm_tiles + (int)blockIdx.x + sw * (int)gridDim.x;
    }

    /* The first output row of warpgroup wg's 64 rows of the tile, in dw (dw_bf16) or, the
     * up half's, in dw_up (dw_bf16_up): lo or hi. m = m_blocks * 128 (the launcher
     * checks), so expert e's row block j is m_block e * m_blocks + j: row j * 128 of the
     * expert's m, in one half (up_first is a multiple of 128). */
    template <class T>
    __device__ __forceinline__ T *first_row(T *lo, T *hi, int m_block, int wg) const {
        const int e = m_block / args.m_blocks;
        int r = (m_block - e * args.m_blocks) * kBlockM + wg * 64;
        const bool up = r >= args.up_first;
        if (up) r -= args.up_first;
        return (up ? hi : lo) + ((int64_t)e * args.expert_rows + r) * args.n;
    }

    __device__ __forceinline__ void operator()(int m_block, int n_block,
                                               float (&acc)[Cfg::kAccRegs], uint8_t *buf) {
        if constexpr (kStoresF32Halves) {
#pragma unroll
            for (int half = 0; half < 2; ++half)
                handoff.stage(ring, buf,
                              [&](uint8_t *b) { epi_write_acc_fp32_half<Cfg>(b, acc, half); });
        } else if constexpr (kStoresF32) {
            handoff.stage(ring, buf, [&](uint8_t *b) { epi_write_acc_fp32<Cfg>(b, acc); });
        } else if constexpr (Cfg::kStoreRowBytes > 0) {
            handoff.stage(ring, buf, [&](uint8_t *b) { epi_write_acc_bf16<Cfg>(b, acc); });
        } else {
            store_fp32(m_block, n_block, acc);
        }
    }

    /* The output the store warps write: dw (fp32) or dw_bf16, and its up half. */
    __device__ __forceinline__ Out *out_lo() const {
        if constexpr (kStoresF32) return args.dw; else return args.dw_bf16;
    }
    __device__ __forceinline__ Out *out_hi() const {
        if constexpr (kStoresF32) return args.dw_up; else return args.dw_bf16_up;
    }

    /* Store warps: warpgroup wg's rows of the tile (of its column half `half`). */
    __device__ __forceinline__ void drain(int m_block, int n_block, int wg, const uint8_t *buf,
                                          int half = 0) {
        Out *row0 = first_row(out_lo(), out_hi(), m_block, wg) + n_block * Cfg::BN +
                    half * (Cfg::kStoreRowBytes / (int)sizeof(Out));
        drain_rows<Cfg>(buf, [&](int r) -> Out * { return row0 + (int64_t)r * args.n; });
    }

    /* Store warps, between drains: kZeroRows rows of this warp's next zero tile (an
     * expert without rows: its gradient is 0); false when none is left. A piece is
     * kZeroRows rows (8 KB of 512-byte rows), so a consumer whose buffer is ready waits at
     * most that long. */
    __device__ __forceinline__ bool idle_work() {
        if (zero_tile >= zero_end) return false;
        int m_block, n_block;
        wgrad_tile(args.expert_order, args.m_blocks, args.n_blocks, zero_tile, m_block, n_block);
        Out *tile = first_row(out_lo(), out_hi(), m_block, 0) + (int64_t)zero_row * args.n +
                    n_block * Cfg::BN;
        /* a row's 16-byte pieces, a lane's (more than 32: several) and the rows a step */
        constexpr int kVecs = Cfg::BN * (int)sizeof(Out) / 16;
        constexpr int kLanesPerRow = kVecs < 32 ? kVecs : 32;
        constexpr int kRowsPerStep = 32 / kLanesPerRow;
        const int lane = threadIdx.x % 32;
        uint4 *piece = reinterpret_cast<uint4 *>(tile + (int64_t)(lane / kLanesPerRow) * args.n) +
                       lane % kLanesPerRow;
        /* in uint4 */
        const int64_t step = (int64_t)kRowsPerStep * args.n * (int64_t)sizeof(Out) / 16;
#pragma unroll 1
        for (int r = 0; r < kZeroRows; r += kRowsPerStep, piece += step)
#pragma unroll
            for (int v = 0; v < kVecs; v += kLanesPerRow) piece[v] = make_uint4(0, 0, 0, 0);
        zero_row += kZeroRows;
        if (zero_row == kBlockM) {
            zero_row = 0;
            zero_tile += kStoreWarps * (int)gridDim.x;
        }
        return true;
    }

    __device__ __forceinline__ void store_fp32(int m_block, int n_block,
                                               float (&acc)[Cfg::kAccRegs]) {
        const int e = m_block / args.m_blocks;
        const int t = threadIdx.x % 128;
        const int lane = t % 32, warp = t / 32;
        float *base = first_row(args.dw, args.dw_up, m_block, threadIdx.x / 128) +
                      (int64_t)(warp * 16 + lane / 4) * args.n + n_block * Cfg::BN + 2 * (lane % 4);
        if (args.accumulate) {
            /* Nothing to add for an expert without rows: leave its tile as it is. */
            if (args.expert_offsets[e + 1] <= args.expert_offsets[e]) return;
#pragma unroll
            for (int c = 0; c < Cfg::BN / 8; ++c)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float2 *p = reinterpret_cast<float2 *>(base + (int64_t)8 * h * args.n + 8 * c);
                    float2 v = *p;
                    v.x += acc[4 * c + 2 * h];
                    v.y += acc[4 * c + 2 * h + 1];
                    *p = v;
                }
        } else {
#pragma unroll
            for (int c = 0; c < Cfg::BN / 8; ++c)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    *reinterpret_cast<float2 *>(base + (int64_t)8 * h * args.n + 8 * c) =
                        make_float2(acc[4 * c + 2 * h], acc[4 * c + 2 * h + 1]);
        }
    }
};

/* ---- dgrad1 ---------------------------------------------------------------------- */

struct Dgrad1Args {
    CUtensorMap map_dh;    /* [rows_cap, 2I], box 128 x 64 (K-major) */
    /* bf16: W13's gate and up rows, box 64 rows x 64 columns (MN-major B); FP8: map_gate
     * is W13^T [E * H, 2I] (K-major), map_up unused */
    W13Halves w13;
    const int32_t *row_block_expert;
    const int32_t *num_rows;
    ScatterTarget to;
    int rows_cap, hidden, intermediate;
    BlockScales scales;    /* FP8: dh's row scales, W13^T's block scales */
};

/* ---- producer: A rows of the block, then BN/64 boxes of W13_e rows k.. k+63 (K < I:
 * gate rows, else up rows k - I..; FP8: BN rows of W13^T_e [H, 2I], K-major, and the A
 * rows' scales) ------------------------------------------------------------------------ */
template <class Cfg>
struct Dgrad1Load {
    const Dgrad1Args &args;
    int m_row, w_row, n_col;
    int up_row;   /* bf16: the up map's row of K = 0 (its row of K = I, less I) */

    __device__ __forceinline__ void tile_begin(int m_block, int n_block) {
        const int e = args.row_block_expert[m_block];
        m_row = m_block * kBlockM;
        w_row = Cfg::kBMnMajor ? args.w13.gate_row(e, 0) : e * args.hidden;
        up_row = args.w13.up_row(e, 0) - args.intermediate;
        n_col = n_block * Cfg::BN;
    }
    __device__ __forceinline__ void stage(int kb, uint8_t *a, uint8_t *b, uint64_t *bar) {
        const int k = kb * Cfg::kBlockK;
        ptx::tma_load_2d(a, &args.map_dh, bar, k, m_row);
        if constexpr (Cfg::kBMnMajor) {
            const bool up = k >= args.intermediate;   /* a K block lies in one half */
            tma_load_mn_boxes<Cfg, Cfg::BN / Cfg::kMnBoxCols>(
                b, up ? &args.w13.map_up : &args.w13.map_gate, bar, n_col, (up ? up_row : w_row) + k);
        } else {
            ptx::tma_load_2d(b, &args.w13.map_gate, bar, k, w_row + n_col);
        }
    }
    __device__ __forceinline__ void stage(int kb, uint8_t *a, uint8_t *b, uint8_t *a_scales,
                                          uint64_t *bar) {
        stage(kb, a, b, bar);
        args.scales.load_a<Cfg>(a_scales, kb, m_row, bar);
    }
    /* Consumers (FP8): the tile's scale hook (W13^T_e rows: one or two 128-row blocks). */
    __device__ __forceinline__ auto block_scale(int m_block, int n_block, int k_blocks) const {
        const int64_t n = (int64_t)args.row_block_expert[m_block] * args.hidden + n_block * Cfg::BN;
        return args.scales.tile<Cfg>(n, n + Cfg::BN / 2, 2 * args.intermediate, k_blocks);
    }
};

/* What the dgrad1 kernels of precision P take of any shape (the tile width is picked
 * after this). */
template <class P>
inline bool dgrad1_params_ok(const mf_dgrad1_params *p) {
    if (!p || !operand_ok<P>(p->dh, MF_SCALES_1X128) || !operand_ok<P>(p->w13, MF_SCALES_128X128) ||
        !w13_halves_ok<P>(p->w13_up, p->intermediate) || !row_blocks_ok(p->rows) ||
        !scatter_ok(p->to))
        return false;
    const int i_multiple = P::kAScaleBytes ? 64 : 32;   /* K = 2I: whole K blocks */
    if (p->hidden <= 0 || p->hidden % 128 || p->intermediate <= 0 ||
        p->intermediate % i_multiple || p->num_sms <= 0)
        return false;
    /* TMA sources and the 16-byte epilogue stores need 16-byte aligned bases. */
    return !misaligned16(p->dh.data, p->w13.data, p->w13_up, p->to.combine, p->dh.scales);
}

template <class Cfg>
cudaError_t dgrad1_args_from(const mf_dgrad1_params *p, Dgrad1Args *args) {
    cudaError_t err;
    const int two_i = 2 * p->intermediate;
    using P = typename Cfg::Precision;
    if ((err = tensor_map_2d<P>(&args->map_dh, p->dh.data, (uint64_t)p->rows.rows_cap, two_i,
                                two_i, kBlockM, Cfg::kBlockK)) != cudaSuccess)
        return err;
    if (Cfg::kBMnMajor) {
        err = w13_halves_from<P>(&args->w13, p->w13.data, p->w13_up, p->rows.num_local_experts,
                                 p->intermediate, p->hidden, Cfg::kBlockK, Cfg::kMnBoxCols);
    } else {   /* W13^T [E * H, 2I] */
        err = tensor_map_2d<P>(&args->w13.map_gate, p->w13.data,
                               (uint64_t)p->rows.num_local_experts * p->hidden, two_i, two_i,
                               Cfg::BN, Cfg::kBlockK);
        args->w13.map_up = args->w13.map_gate;
        args->w13.expert_rows = 2 * p->intermediate;
        args->w13.up_first = p->intermediate;
    }
    if (err != cudaSuccess) return err;
    args->row_block_expert = p->rows.row_block_expert;
    args->num_rows = p->rows.num_rows;
    args->to = ScatterTarget{p->to.row_slot, nullptr, p->to.combine, p->to.combine_peers,
                             p->to.num_ranks, p->hidden};
    args->rows_cap = p->rows.rows_cap;
    args->hidden = p->hidden;
    args->intermediate = p->intermediate;
    args->scales = block_scales_of(p->dh, p->w13, p->rows.rows_cap);
    return cudaSuccess;
}

}  // namespace sm90
}  // namespace mf
