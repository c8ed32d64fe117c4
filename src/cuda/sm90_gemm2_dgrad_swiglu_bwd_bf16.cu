/* dgrad of gemm2 with dp and the SwiGLU backward in the epilogue (sm_90a, bf16).
 *
 *   da'_r = dys_r W2_e                dys [rows, H], W2_e [H, I] (I contiguous), fp32
 *   a     = bf16(silu(g) * u)         g, u from the saved gate_up [rows, 2I]
 *   dp_partial[r, n block] = sum over the tile's columns of da' * a       (fp32)
 *   da    = p * da'                   p = row_weight[r]
 *   dh_r  = bf16([da * u * silu'(g) | da * silu(g)])      [rows, 2I], like gate_up
 *   act_p_r = bf16(p * a)             [rows, I], the A operand of dW2
 * Padding rows (row_slot -1) get zeros in all three outputs.
 * Expert parallelism: the dys rows (with their row_slot and row_weight) may still be
 * arriving from the other ranks; the producer waits for each block's rows before its
 * first load (ep_wait.cuh), so the kernel runs beside the backward's push.
 *
 * A = dys is K-major (K = H). B = W2_e is MN-major: the reduction runs over its rows,
 * its N = I index is contiguous, so each stage loads BN/64 boxes of 64 I columns x 64 W2
 * rows and the wgmma reads B transposed.
 *
 * The gate_up tile (g: 128 rows x BN columns, u: the same I columns on) comes into
 * shared memory by TMA, issued by the producer after the tile's last K stage, so it lands
 * while the K loop runs; the epilogue reads it from there (conflict-free: the 128-byte
 * swizzle puts the 8 rows of a warp's read in distinct banks) and writes dg and du back
 * in place of g and u.
 * NOTE: measured on an H200 (qwen3-30b-a3b, 131072 rows): reading g/u straight from
 * global memory in three passes (act_p, dg, du; 4-byte loads) ran at 178 TFLOP/s,
 * 2.32 ms; the smem tile with the same three passes 1.54 ms.
 *
 * FLOPs: 2 * rows * H * I. qwen3-30b-a3b at 131072 rows: 412 GFLOP, about 0.52 ms at
 * 790 TFLOP/s; outputs dh + act_p are 3 * rows * I * 2 bytes (0.6 GB) and the gate_up
 * read 0.4 GB: the epilogue's share is large. */
#include <cuda_bf16.h>

#include "ep_wait.cuh"
#include "kernels.h"
#include "sm90_grouped_gemm.cuh"
#include "swiglu.cuh"
#include "tensor_map.h"

namespace {

using namespace mf;
using namespace mf::sm90;

struct Dgrad2Args {
    CUtensorMap map_dys;   /* [rows_cap, H], box 128 x 64 (K-major) */
    CUtensorMap map_w2;    /* [E * H, I], box 64 rows x 64 columns (MN-major B) */
    CUtensorMap map_gu;    /* [rows_cap, 2I], box 128 rows x 64 columns */
    const int32_t *row_block_expert;
    const int32_t *num_rows;
    const int32_t *row_slot;
    const float *row_weight;
    uint16_t *dh;
    uint16_t *act_p;
    float *dp_partial;
    ep::RowArrivals rows_in;   /* EP: the blocks' dys rows arriving (arrivals null: none) */
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
    bool gave_up;   /* EP: a wait for a block's rows ran out (the call failed): no more */

    __device__ __forceinline__ void tile_begin(int m_block, int n_block) {
        if (args.rows_in.arrivals && !gave_up) gave_up = !ep::wait_block_rows(args.rows_in, m_block);
        const int e = args.row_block_expert[m_block];
        m_row = m_block * kBlockM;
        w_row = e * args.hidden;
        n_col = n_block * Cfg::BN;
    }
    __device__ __forceinline__ void stage(int kb, uint8_t *a, uint8_t *b, uint64_t *bar) {
        const int k = kb * kBlockK;
        /* L2 priorities: W2_e, read again by every row block of the expert, is kept
         * before the streams touched once (the tile's gate_up, and the dh and act_p
         * stores, which the weight gradients read only after the whole kernel).
         * NOTE: measured on an H200 (qwen3-30b-a3b, 131072 rows, five rounds against the
         * tree without hints, bench/NOTES.md v21): collapsed routing 0.891 -> 0.841 ms;
         * moderate, heavy and nearly collapsed routing and qwen3-235b-a22b unchanged
         * within 2%. */
        ptx::tma_load_2d(a, &args.map_dys, bar, k, m_row);
        tma_load_mn_boxes_hint<Cfg, Cfg::BN / 64>(b, &args.map_w2, bar, n_col, w_row + k,
                                                  ptx::l2_policy_evict_last());
        if (k + kBlockK < args.hidden) return;
        const uint64_t once = ptx::l2_policy_evict_first();
        ptx::mbar_wait(ring.extra_empty, gu_phase ^ 1u);
        ptx::mbar_arrive_expect_tx(ring.extra_full, Cfg::kExtraBytes);
#pragma unroll
        for (int j = 0; j < Cfg::BN / 64; ++j) {
            ptx::tma_load_2d_hint(ring.extra + j * kGuBoxBytes, &args.map_gu, ring.extra_full,
                                  n_col + 64 * j, m_row, once);
            ptx::tma_load_2d_hint(ring.extra + (Cfg::BN / 64 + j) * kGuBoxBytes, &args.map_gu,
                                  ring.extra_full, args.intermediate + n_col + 64 * j, m_row,
                                  once);
        }
        gu_phase ^= 1u;
    }
};


/* ---- epilogue ----------------------------------------------------------------------------
 * One pass over the accumulators: each element's exp, silu and sigmoid are computed once.
 * act_p goes from the registers to global memory (4-byte stores: a warp's store is 8
 * rows x 16 bytes, which L2 merges with the neighbouring pieces); dg and du overwrite the
 * g and u words they were computed from in the gate_up tile (each word is read and
 * written by one thread only), and the store warps copy them out as whole rows
 * (sm90_grouped_gemm.cuh, "store warps"). The math itself runs in 32 pieces between the
 * wgmma issues of the next tile's first 8 K blocks, four per block
 * (consumer_role_overlapped), on the second accumulator set.
 * Accumulator layout of m64nN (per warpgroup): register 4c + 2h + {0,1} of lane l in warp
 * w holds row 16w + l/4 + 8h, columns 8c + 2(l%4) + {0,1}. Those two g (or u) values are
 * one 4-byte word of the swizzled gate_up tile: box c/8, row R, 16-byte piece
 * (c%8) ^ (R%8), word l%4; R%8 = l/4 for every row this lane holds. */
struct SwigluBwd {
    float act, dg, du;   /* bf16-rounded a, and p da' u silu'(g), p da' silu(g) */
};

/* silu'(g) = s (1 + g (1 - s)); a as the forward's store warps compute it (swiglu.cuh). */
__device__ __forceinline__ SwigluBwd swiglu_bwd(float g, float u, float da) {
    const Swiglu f = swiglu(g, u);
    return {__bfloat162float(__float2bfloat16_rn(f.a)), da * u * (f.s * (1.f + g * (1.f - f.s))),
            da * f.silu};
}

template <class Cfg, bool kOverlap>
struct Dgrad2Epilogue {
    /* Pieces: one per (column group c, row half h) of the accumulator layout, run under
     * the next tile's first 8 K blocks (sm90_grouped_gemm.cuh, consumer_role_overlapped)
     * when H has that many, else after the tile's K loop (operator()). */
    static constexpr bool kOverlapNextTile = kOverlap;
    static constexpr int kPieces = 2 * (Cfg::BN / 8);
    /* NOTE: measured on an H200 (131072 rows), 4 per K block against 2 (over 16 blocks):
     * qwen3-30b-a3b 0.908 -> 0.854 ms, qwen3-235b-a22b 2.906 -> 2.94 ms. Finishing early
     * leaves the store warps' drain and the next gate_up load more of the K loop.
     * With the gate_up tile in two halves (each reloaded as soon as its pieces are done,
     * so spreading costs no reload slack) it was still slower: qwen3-30b-a3b 0.823 ms
     * here, 0.86 at 4 and 2 per block, 1.02 at 1 (bench/NOTES.md v13). A ping-pong
     * kernel (each warpgroup whole tiles, its epilogue under the other's K loop) was
     * no faster either: 0.871 ms (v14). Denser, 8 per K block (over the first 4), was
     * slower: qwen3-30b-a3b 0.837-0.847 -> 0.857-0.866 ms, qwen3-235b-a22b 2.83-2.88 ->
     * 2.89-2.95 ms (v21). */
    static constexpr int kPiecesPerKBlock = 4;
    static_assert(kPieces % kPiecesPerKBlock == 0, "whole K blocks of pieces");
    const Dgrad2Args &args;
    Ring<Cfg> ring;
    uint32_t gu_phase;
    StoreHandoff handoff;
    float w[2];          /* this lane's two rows' p, or 0 for a padding row */
    bool valid[2];
    float dp[2];         /* their partial d p */
    uint32_t *act_p_row; /* this lane's first row of act_p, at its first column of the tile */

    static_assert(Cfg::BN == kTileN && Cfg::kExtraBytes == kGuBytes && Cfg::kStoreWarps &&
                      Cfg::kStoreRowBytes == 0,
                  "the gate_up tile's layout is kTileN columns of g and of u; act_p is stored "
                  "from the registers, dg and du by the store warps");

    /* The routing weights of this lane's rows, for the tile after the one in its epilogue.
     * With arrivals (expert parallelism), row_weight and row_slot come with the rows, from
     * the push beside this kernel. The overlapped consumer role calls this after the
     * tile's first stages landed, which the producer loaded after its wait for the block;
     * the plain one calls it before the K loop, so it waits for the block itself (once the
     * call failed, no more). */
    __device__ __forceinline__ void prepare(int m_block, int) {
        if constexpr (!kOverlap) {
            if (args.rows_in.arrivals &&
                !*reinterpret_cast<volatile int32_t *>(&args.rows_in.state->call_failed))
                ep::wait_block_rows(args.rows_in, m_block);
        }
        const int t = threadIdx.x % 128;
        const int64_t row0 = (int64_t)m_block * kBlockM + (threadIdx.x / 128) * 64;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int64_t r = row0 + (t / 32) * 16 + (t % 32) / 4 + 8 * h;
            const int slot = args.row_slot[r];
            valid[h] = slot >= 0;
            w[h] = valid[h] ? args.row_weight[r] : 0.f;
        }
    }

    /* The tile's gate_up has landed (so the store warps are done with the tile before). */
    __device__ __forceinline__ void begin(int m_block, int n_block) {
        ptx::mbar_wait(ring.extra_full, gu_phase);
        gu_phase ^= 1u;
        handoff.acquire(ring, threadIdx.x / 128);
        dp[0] = dp[1] = 0.f;
        const int t = threadIdx.x % 128;
        const int64_t r = (int64_t)m_block * kBlockM + (threadIdx.x / 128) * 64 + (t / 32) * 16 +
                          (t % 32) / 4;
        act_p_row = reinterpret_cast<uint32_t *>(args.act_p + r * args.intermediate +
                                                 n_block * Cfg::BN + 2 * (t % 4));
    }

    /* Column group c = q / 2, row half h = q % 2: two elements of one row. dg and du
     * overwrite the g and u words they come from; act_p goes to global memory. */
    __device__ __forceinline__ void piece(int q, float (&acc)[Cfg::kAccRegs]) {
        const int c = q / 2, h = q % 2;
        const int t = threadIdx.x % 128, wg = threadIdx.x / 128;
        const int lane = t % 32, warp = t / 32;
        const int off = (c / 8) * kGuBoxBytes + (warp * 16 + lane / 4 + 8 * h) * 128 +
                        (((c % 8) ^ (lane / 4)) << 4) + 4 * (lane % 4);
        uint8_t *const g_tile = ring.extra + wg * 64 * 128;   /* this warpgroup's rows */
        uint32_t *g2 = reinterpret_cast<uint32_t *>(g_tile + off);
        uint32_t *u2 = reinterpret_cast<uint32_t *>(g_tile + kGuBytes / 2 + off);
        const float d0 = acc[4 * c + 2 * h], d1 = acc[4 * c + 2 * h + 1];
        const float p = w[h];
        const bool ok = valid[h];
        const SwigluBwd lo = swiglu_bwd(bf16_lo(*g2), bf16_lo(*u2), p * d0);
        const SwigluBwd hi = swiglu_bwd(bf16_hi(*g2), bf16_hi(*u2), p * d1);
        dp[h] = fmaf(d0, lo.act, dp[h]);
        dp[h] = fmaf(d1, hi.act, dp[h]);
        *g2 = ok ? pack_bf16x2_rn(lo.dg, hi.dg) : 0u;
        *u2 = ok ? pack_bf16x2_rn(lo.du, hi.du) : 0u;
        __stcs(&act_p_row[(8 * h * args.intermediate + 8 * c) / 2],
               ok ? pack_bf16x2_rn(p * lo.act, p * hi.act) : 0u);
    }

    /* Hand dg and du to the store warps, then the row sums of d p. */
    __device__ __forceinline__ void finish(int m_block, int n_block) {
        const int t = threadIdx.x % 128, wg = threadIdx.x / 128;
        const int lane = t % 32, warp = t / 32;
        /* The gate_up region is next written by TMA (async proxy): order these generic
         * writes before it; the store warps release it after reading dg and du out. */
        ptx::fence_proxy_async_smem();
        handoff.release(ring, wg);
        const int64_t row0 = (int64_t)m_block * kBlockM + wg * 64;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float sum = dp[h];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            if (lane % 4 == 0) {
                const int64_t r = row0 + warp * 16 + lane / 4 + 8 * h;
                args.dp_partial[r * args.dp_parts + n_block] = valid[h] ? sum : 0.f;
            }
        }
    }

    /* Without the overlap: the whole epilogue after the tile's K loop. */
    __device__ __forceinline__ void operator()(int m_block, int n_block,
                                               float (&acc)[Cfg::kAccRegs], uint8_t *) {
        begin(m_block, n_block);
#pragma unroll
        for (int q = 0; q < kPieces; ++q) piece(q, acc);
        finish(m_block, n_block);
    }

    /* Store warps: dg and du rows from the gate_up tile (one row per warp step: lanes 0-15
     * its 16 pieces of dg, lanes 16-31 those of du). After the last warpgroup's rows the
     * tile goes back to the producer. */
    __device__ __forceinline__ void drain(int m_block, int n_block, int wg, const uint8_t *) {
        const int I = args.intermediate;
        const int64_t row0 = (int64_t)m_block * kBlockM + wg * 64;
        const int col0 = n_block * Cfg::BN;
        const int sw = threadIdx.x / 32 - kFirstStoreWarp, lane = threadIdx.x % 32;
        const int v = lane % 16, half = lane / 16;
        const uint8_t *tile = ring.extra + half * (kGuBytes / 2) + wg * 64 * 128;
        for (int r = sw; r < 64; r += kStoreWarps) {
            const int off = (v / 8) * kGuBoxBytes + r * 128 + (((v % 8) ^ (r % 8)) << 4);
            uint4 *dst = reinterpret_cast<uint4 *>(args.dh + (row0 + r) * 2 * I + half * I + col0);
            __stcs(&dst[v], *reinterpret_cast<const uint4 *>(tile + off));
        }
        if (wg == kConsumerWarpgroups - 1) ptx::mbar_arrive(ring.extra_empty);
    }
};

template <class Cfg, bool kOverlap>
__global__ void __launch_bounds__(kThreads, 1)
    sm90_gemm2_dgrad_swiglu_bwd_bf16_kernel(const __grid_constant__ Dgrad2Args args) {
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    const Ring<Cfg> ring = ring_from_smem<Cfg>(smem_raw);
    Dgrad2Load<Cfg> load{args, ring, 0, 0, 0, 0u, false};
    Dgrad2Epilogue<Cfg, kOverlap> epi{args, ring, 0u, {}, {}, {}, {}};
    run_grouped_gemm<Cfg>(smem_raw, &args.map_dys, &args.map_w2, args.num_rows, args.rows_cap,
                          args.intermediate / Cfg::BN, args.hidden / kBlockK, load, epi);
}

template <class Cfg, bool kOverlap>
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
    if ((err = mf_tensor_map_bf16_2d(&args.map_gu, p->gate_up, (uint64_t)p->rows_cap,
                                     2 * (uint64_t)p->intermediate, 2 * (uint64_t)p->intermediate,
                                     kBlockM, 64)) != cudaSuccess)
        return err;
    args.row_block_expert = p->row_block_expert;
    args.num_rows = p->num_rows;
    args.row_slot = p->row_slot;
    args.row_weight = p->row_weight;
    args.dh = p->dh;
    args.act_p = p->act_p;
    args.dp_partial = p->dp_partial;
    args.rows_in = {p->arrivals, p->arrival_target, p->state, p->timeout_ns, p->arrival_stage};
    args.rows_cap = p->rows_cap;
    args.hidden = p->hidden;
    args.intermediate = p->intermediate;
    args.dp_parts = p->intermediate / Cfg::BN;   /* = mf_dgrad2_dp_parts */

    return launch_persistent(sm90_gemm2_dgrad_swiglu_bwd_bf16_kernel<Cfg, kOverlap>,
                             Cfg::kSmemBytes, p->num_sms, args, stream);
}

}  // namespace

/* Tile choice (and so the dp partials per row): BN = 128, 5 stages of 32 KB and the 64 KB
 * gate_up tile. 0 when I is not supported.
 * NOTE: BN = 256 would need a 128 KB gate_up tile beside the ring: it does not fit. */
extern "C" int mf_dgrad2_dp_parts(int intermediate) {
    if (intermediate <= 0 || intermediate % kTileN) return 0;
    return intermediate / kTileN;
}

extern "C" cudaError_t mf_sm90_gemm2_dgrad_swiglu_bwd_bf16(const mf_dgrad2_params *p,
                                                           cudaStream_t stream) {
    if (!p || !p->dys || !p->w2 || !p->gate_up || !p->row_block_expert || !p->num_rows ||
        !p->row_slot || !p->row_weight || !p->dh || !p->act_p || !p->dp_partial ||
        (p->arrivals && (!p->arrival_target || !p->state)))
        return cudaErrorInvalidValue;
    if (p->rows_cap < 0 || p->rows_cap % kBlockM || p->hidden <= 0 || p->hidden % kBlockK ||
        p->intermediate <= 0 || p->intermediate % kTileN || p->num_local_experts <= 0 ||
        p->num_sms <= 0)
        return cudaErrorInvalidValue;
    /* TMA sources and the 16-byte epilogue stores. */
    if (misaligned16(p->dys, p->w2, p->gate_up, p->dh, p->act_p) ||
        (reinterpret_cast<uintptr_t>(p->dp_partial) & 3u))
        return cudaErrorInvalidValue;
    if (p->rows_cap == 0) return cudaSuccess;
    /* The epilogue under the next tile's K loop needs 8 K blocks (H >= 512). */
    using Overlapped = Dgrad2Epilogue<Dgrad2Cfg, true>;
    if (p->hidden / kBlockK >= Overlapped::kPieces / Overlapped::kPiecesPerKBlock)
        return launch<Dgrad2Cfg, true>(p, stream);
    return launch<Dgrad2Cfg, false>(p, stream);
}

extern "C" cudaError_t mf_sm90_gemm2_dgrad_swiglu_load(void) {
    return mf_load_kernels(sm90_gemm2_dgrad_swiglu_bwd_bf16_kernel<Dgrad2Cfg, true>,
                           sm90_gemm2_dgrad_swiglu_bwd_bf16_kernel<Dgrad2Cfg, false>);
}
