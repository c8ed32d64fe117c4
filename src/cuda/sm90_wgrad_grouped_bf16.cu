/* K-grouped weight gradient (sm_90a, bf16 in, fp32 or bf16 out): for every local expert
 * e, over its padded rows [expert_offsets[e], expert_offsets[e+1]),
 *
 *   dw_e [M, N] = (accumulate ? dw_e : 0) + sum_r lhs[r, :]^T rhs[r, :]
 *
 * dW2: lhs = dys (M = H), rhs = act_p (N = I). dW13: lhs = dh (M = 2I), rhs = xs (N = H).
 * Padding rows are zero in both operands, so they add nothing.
 *
 * Both operands are MN-major: the reduction (K) runs over rows and the M / N indices are
 * contiguous. A stage is 64 rows: A = 2 boxes of 64 M columns x 64 rows, B = BN/64 boxes
 * of 64 N columns x 64 rows, read by wgmma with both transpose immediates set.
 *
 * Tiles are (expert, 128-row m block, BN n block), n fastest, the experts in a given
 * order (the scheduler below); one CTA owns each output tile and runs the expert's whole
 * K loop (no split-K, no atomics: deterministic, whichever CTA runs it). The K
 * loop may be empty (an expert without rows): the tile is then written as zeros (with
 * bf16 out and an order, by the store warps beside the GEMM tiles), or left as it is in
 * accumulate mode.
 *
 * Epilogue: fp32 straight from the accumulators, 8-byte stores (4 lanes cover 32
 * contiguous bytes of a row, whole sectors); accumulate mode loads, adds once, stores.
 * bf16 output (write mode): rounded to nearest even into the epilogue buffer, and stored
 * by the store warps (whole 16-byte row pieces, half the bytes of fp32) while the
 * consumers run the next tile's K loop: a separate instantiation (TileConfig with
 * STORE_ROW_BYTES), since its buffers take a stage's shared memory.
 *
 * FLOPs: 2 * rows * M * N. qwen3-30b-a3b at 131072 rows: dW2 412 GFLOP, dW13 825 GFLOP;
 * the fp32 outputs are E * M * N * 4 bytes (0.8 GB / 1.6 GB, written once, read once more
 * when accumulating). */
#include "kernels.h"
#include "sm90_grouped_gemm.cuh"
#include "tensor_map.h"

namespace {

using namespace mf;
using namespace mf::sm90;

struct WgradArgs {
    CUtensorMap map_lhs;   /* [rows_cap, M], box 64 rows x 64 columns */
    CUtensorMap map_rhs;   /* [rows_cap, N], box 64 rows x 64 columns */
    const int32_t *expert_offsets;
    const int32_t *expert_order;   /* [E_local + 1] mf_expert_order's; NULL: 0, 1, ... */
    float *dw;
    uint16_t *dw_bf16;
    int m, n, m_blocks, n_blocks, num_experts, accumulate;
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

/* ---- scheduler: (expert, m block, n block) tiles, n fastest; K = the expert's rows -------
 * The experts come in args.expert_order (expert_order.cu: the heavy ones first, most rows
 * first; identity when NULL), so tile i belongs to the (i / tiles_per_expert)-th of them.
 * Wave w hands tiles w*G .. w*G + G-1 to the G CTAs forwards when w is even and
 * backwards when it is odd (a snake): the CTA that got one of a wave's costliest tiles
 * gets one of the next wave's cheapest, so the heavy experts' tiles spread evenly.
 * With store warps (bf16 out) and an order, the tiles of experts without rows are left
 * out here: they are zeros, written by the store warps beside the GEMM tiles
 * (WgradEpilogue::idle_work), instead of a tail of pure stores after them.
 * m_block below is the combined index e * m_blocks + m block. */
struct WgradScheduler {
    const int32_t *offsets, *order;
    int m_blocks, n_blocks, tiles_per_expert, total, wave;

    __device__ __forceinline__ WgradScheduler(const WgradArgs &a, bool store_warps_zero_empty)
        : offsets(a.expert_offsets), order(a.expert_order), m_blocks(a.m_blocks),
          n_blocks(a.n_blocks), tiles_per_expert(a.m_blocks * a.n_blocks),
          total(gemm_experts(a, store_warps_zero_empty) * a.m_blocks * a.n_blocks), wave(0) {}
    /* The experts whose tiles run the GEMM: those with rows come first in the order. */
    static __device__ __forceinline__ int gemm_experts(const WgradArgs &a, bool skip_empty) {
        return skip_empty && a.expert_order ? __ldg(a.expert_order + a.num_experts)
                                            : a.num_experts;
    }
    __device__ __forceinline__ bool next_tile(int &m_block, int &n_block) {
        const int cta = (wave & 1) ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x;
        const int i = wave * (int)gridDim.x + cta;
        if (i >= total) return false;   /* later waves hold only larger i */
        ++wave;
        wgrad_tile(order, m_blocks, n_blocks, i, m_block, n_block);
        return true;
    }
    __device__ __forceinline__ int num_k_blocks(int m_block, int) const {
        const int e = m_block / m_blocks;
        const int rows = offsets[e + 1] - offsets[e];
        return rows > 0 ? rows / kBlockK : 0;
    }
};

/* ---- producer: 2 boxes of lhs (128 M columns), BN/64 boxes of rhs, 64 rows each ------- */
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
        const int row = row0 + kb * kBlockK;
#pragma unroll
        for (int j = 0; j < kBlockM / 64; ++j)
            ptx::tma_load_2d(a + j * Cfg::kMnBoxBytes, &args.map_lhs, bar, m_col + 64 * j, row);
#pragma unroll
        for (int j = 0; j < Cfg::BN / 64; ++j)
            ptx::tma_load_2d(b + j * Cfg::kMnBoxBytes, &args.map_rhs, bar, n_col + 64 * j, row);
    }
};

/* ---- epilogue: rows of dw_e, fp32 written or accumulated by the consumers, or bf16 by
 * the store warps (Cfg::kStoreRowBytes > 0).
 * Accumulator layout of m64nN (per warpgroup): register 4c + 2h + {0,1} of lane l in warp
 * w holds row 16w + l/4 + 8h, columns 8c + 2(l%4) + {0,1}. */
constexpr int kZeroRows = 16;   /* rows of a zero tile per idle_work piece */

template <class Cfg>
struct WgradEpilogue {
    const WgradArgs &args;
    Ring<Cfg> ring;
    StoreHandoff handoff;
    int zero_tile, zero_end, zero_row;   /* store warps: this warp's zero tiles (idle_work) */

    __device__ __forceinline__ WgradEpilogue(const WgradArgs &a, const Ring<Cfg> &r,
                                             const WgradScheduler &sched)
        : args(a), ring(r), zero_end(sched.tiles_per_expert * a.num_experts), zero_row(0) {
        /* Tiles past sched.total (none when it covers every expert): CTA c takes every G-th
         * from total + c, its store warp sw every kStoreWarps-th of those. */
        const int sw = (int)threadIdx.x / 32 - kFirstStoreWarp;
        zero_tile = sched.total + (int)blockIdx.x + sw * (int)gridDim.x;
    }

    /* The first dw row of warpgroup wg's 64 rows of the tile (E * M rows in all). */
    /* m = m_blocks * 128 (the launcher checks), so expert e's row block j is m_block
     * e * m_blocks + j and its rows start at m_block * 128. */
    __device__ __forceinline__ int64_t first_row(int m_block, int wg) const {
        return (int64_t)m_block * kBlockM + wg * 64;
    }

    __device__ __forceinline__ void operator()(int m_block, int n_block,
                                               float (&acc)[Cfg::kAccRegs], uint8_t *buf) {
        if constexpr (Cfg::kStoreRowBytes > 0) {
            handoff.stage(ring, buf, [&](uint8_t *b) { epi_write_acc_bf16<Cfg>(b, acc); });
        } else {
            store_fp32(m_block, n_block, acc);
        }
    }

    /* Store warps (bf16): warpgroup wg's rows of the tile. */
    __device__ __forceinline__ void drain(int m_block, int n_block, int wg, const uint8_t *buf) {
        const int64_t row0 = first_row(m_block, wg);
        drain_rows_bf16<Cfg>(buf, [&](int r) -> uint16_t * {
            return args.dw_bf16 + (row0 + r) * args.n + n_block * Cfg::BN;
        });
    }

    /* Store warps (bf16), between drains: kZeroRows rows of this warp's next zero tile (an
     * expert without rows: its gradient is 0); false when none is left. A piece is 8 KB
     * at BN = 256, so a consumer whose buffer is ready waits at most that long. */
    __device__ __forceinline__ bool idle_work() {
        if (zero_tile >= zero_end) return false;
        int m_block, n_block;
        wgrad_tile(args.expert_order, args.m_blocks, args.n_blocks, zero_tile, m_block, n_block);
        uint16_t *tile =
            args.dw_bf16 + (first_row(m_block, 0) + zero_row) * args.n + n_block * Cfg::BN;
        constexpr int kVecs = Cfg::BN * 2 / 16, kRowsPerStep = 32 / kVecs;
        const int lane = threadIdx.x % 32;
        uint4 *piece =
            reinterpret_cast<uint4 *>(tile + (int64_t)(lane / kVecs) * args.n) + lane % kVecs;
        const int64_t step = (int64_t)kRowsPerStep * args.n / 8;   /* in uint4 */
#pragma unroll 1
        for (int r = 0; r < kZeroRows; r += kRowsPerStep, piece += step)
            *piece = make_uint4(0, 0, 0, 0);
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
        const int64_t row = first_row(m_block, threadIdx.x / 128) + warp * 16 + lane / 4;
        float *base = args.dw + row * args.n + n_block * Cfg::BN + 2 * (lane % 4);
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

template <class Cfg>
__global__ void __launch_bounds__(kThreads, 1)
    sm90_wgrad_grouped_bf16_kernel(const __grid_constant__ WgradArgs args) {
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    WgradLoad<Cfg> load{args, 0, 0, 0};
    const WgradScheduler sched(args, Cfg::kStoreWarps);
    WgradEpilogue<Cfg> epi(args, ring_from_smem<Cfg>(smem_raw), sched);
    run_grouped_gemm_sched<Cfg>(smem_raw, &args.map_lhs, &args.map_rhs, sched, load, epi);
}

/* The tile choices (see the launcher): output width BN, bf16 or fp32 out. */
using WideBf16Cfg = TileConfig<256, 3, true, true, 0, 512>;
/* 48 registers for the store warps: the drain of 128-wide rows and the zero tiles do not
 * fit 40 (the consumers keep 224, three times their 64 accumulators). */
using NarrowBf16Cfg = ProducerRegs<TileConfig<128, 6, true, true, 0, 256>, 48>;
using WideF32Cfg = TileConfig<256, 4, true, true>;
using NarrowF32Cfg = TileConfig<128, 6, true, true>;

template <class Cfg>
cudaError_t launch(const mf_wgrad_params *p, cudaStream_t stream) {
    WgradArgs args;
    cudaError_t err;
    if ((err = mf_tensor_map_bf16_2d(&args.map_lhs, p->lhs, (uint64_t)p->rows_cap, p->m, p->m,
                                     kBlockK, 64)) != cudaSuccess)
        return err;
    if ((err = mf_tensor_map_bf16_2d(&args.map_rhs, p->rhs, (uint64_t)p->rows_cap, p->n, p->n,
                                     kBlockK, 64)) != cudaSuccess)
        return err;
    args.expert_offsets = p->expert_offsets;
    args.expert_order = p->expert_order;
    args.dw = p->dw;
    args.dw_bf16 = p->dw_bf16;
    args.m = p->m;
    args.n = p->n;
    args.m_blocks = p->m / kBlockM;
    args.n_blocks = p->n / Cfg::BN;
    args.num_experts = p->num_local_experts;
    args.accumulate = p->accumulate;

    return launch_persistent(sm90_wgrad_grouped_bf16_kernel<Cfg>, Cfg::kSmemBytes, p->num_sms, args, stream);
}

}  // namespace

/* Tile choice: BN = 256 when N allows it, else BN = 128. fp32 out: 4 stages of 48 KB or
 * 6 of 32 KB; bf16 out, with the store warps' buffers: 3 of 48 KB or 6 of 32 KB. */
extern "C" cudaError_t mf_sm90_wgrad_grouped_bf16(const mf_wgrad_params *p,
                                                  cudaStream_t stream) {
    if (!p || !p->lhs || !p->rhs || !p->expert_offsets || !p->dw == !p->dw_bf16 ||
        (p->dw_bf16 && p->accumulate))
        return cudaErrorInvalidValue;
    if (p->rows_cap < 0 || p->rows_cap % kBlockM || p->m <= 0 || p->m % kBlockM || p->n <= 0 ||
        p->n % 128 || p->num_local_experts <= 0 || p->num_sms <= 0)
        return cudaErrorInvalidValue;
    if (misaligned16(p->lhs, p->rhs, p->dw, p->dw_bf16)) return cudaErrorInvalidValue;
    if (p->rows_cap == 0) {
        if (p->accumulate) return cudaSuccess;
        const size_t elems = (size_t)p->num_local_experts * p->m * p->n;
        return p->dw ? cudaMemsetAsync(p->dw, 0, elems * 4, stream)
                     : cudaMemsetAsync(p->dw_bf16, 0, elems * 2, stream);
    }
    if (p->dw_bf16) return p->n % 256 == 0 ? launch<WideBf16Cfg>(p, stream)
                                           : launch<NarrowBf16Cfg>(p, stream);
    return p->n % 256 == 0 ? launch<WideF32Cfg>(p, stream) : launch<NarrowF32Cfg>(p, stream);
}

extern "C" cudaError_t mf_sm90_wgrad_grouped_load(void) {
    return mf_load_kernels(
        sm90_wgrad_grouped_bf16_kernel<WideBf16Cfg>, sm90_wgrad_grouped_bf16_kernel<NarrowBf16Cfg>,
        sm90_wgrad_grouped_bf16_kernel<WideF32Cfg>, sm90_wgrad_grouped_bf16_kernel<NarrowF32Cfg>);
}
