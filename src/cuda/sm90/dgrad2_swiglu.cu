/* dgrad of gemm2 with dp and the SwiGLU backward in the epilogue (sm_90a, bf16).
 *
 *   da'_r = bf16(dys_r W2_e)          dys [rows, H], W2_e [H, I] (I contiguous)
 *   a     = bf16(silu(g) * u)         g, u from the saved gate_up [rows, 2I]
 *   dp_partial[r, n block] = sum over the tile's columns of da' * a       (fp32)
 *   da    = p * da'                   p = row_weight[r]
 *   dh_r  = bf16([da * u * silu'(g) | da * silu(g)])      [rows, 2I], like gate_up
 *   act_p_r = bf16(p * a)             [rows, I], the A operand of dW2
 * Padding rows (row_slot -1) get zeros in all three outputs.
 * Expert parallelism: the dys rows (with their row_slot and row_weight) may still be
 * arriving from the other ranks; the producer waits for each block's rows before its
 * first load and the store warps before they read the block's weights (ep_wait.cuh), so
 * the kernel runs beside the backward's push.
 *
 * A = dys is K-major (K = H). B = W2_e is MN-major: the reduction runs over its rows,
 * its N = I index is contiguous, so each stage loads BN/64 boxes of 64 I columns x 64 W2
 * rows and the wgmma reads B transposed.
 *
 * The work is split as in the other row-block GEMMs: the consumers run the K loop and
 * round da' to bf16 into their store buffers (as dgrad1 and gemm2 round their rows), and
 * go on to the next tile; the store warps, with registers for it (ProducerRegs), run
 * the whole SwiGLU backward from that buffer while the next K loop runs. Each store warp
 * takes whole rows, two 16-byte pieces (16 columns) per lane and two rows' steps at a
 * time (FP8: four), g and u loaded into registers that many steps ahead, dh and act_p
 * stored 16 bytes per lane (evict-first), the rows' dp partials sums over the row's
 * lanes.
 * NOTE: da' is rounded to bf16 before the SwiGLU backward (one more rounding on dh's
 * path than the fp32 da' of the consumer-side epilogue this replaced; the same rounding
 * torch._grouped_mm's bf16 output has in an autograd MoE). The CPU backend rounds it too.
 * NOTE: this replaced a consumer-side epilogue (BN = 128, two accumulator sets, the math
 * in 32 pieces under the next tile's first K blocks). On qwen3-30b-a3b the three store
 * warps bound the kernel, hence two pieces per lane and two steps' math at a time (25
 * instructions per element instead of 32, SASS); see docs/decisions/0011-dgrad2-epilogue.
 *
 * FLOPs: 2 * rows * H * I. qwen3-30b-a3b at 131072 rows: 412 GFLOP, about 0.52 ms at
 * 790 TFLOP/s; outputs dh + act_p are 3 * rows * I * 2 bytes (0.6 GB) and the gate_up
 * read 0.4 GB: ~0.3 ms of HBM traffic, under the K loops. */
#include <cuda_bf16.h>

#include <type_traits>

#include "transport/ep_wait.cuh"
#include "kernels.h"
#include "sm90/common/grouped_gemm.cuh"
#include "swiglu.cuh"

namespace {

using namespace mf;
using namespace mf::sm90;

struct Dgrad2Args {
    CUtensorMap map_dys;   /* [rows_cap, H], box 128 x 64 (K-major) */
    CUtensorMap map_w2;    /* [E * H, I], box kBlockK rows x kMnBoxCols columns (MN-major B) */
    const uint16_t *gate_up;
    const int32_t *row_block_expert;
    const int32_t *num_rows;
    const int32_t *row_slot;
    const float *row_weight;
    uint16_t *dh;
    uint16_t *act_p;
    float *dp_partial;
    ep::RowArrivals rows_in;   /* EP: the blocks' dys rows arriving (arrivals null: none) */
    int rows_cap, hidden, intermediate, dp_parts;
    BlockScales scales;        /* FP8: dys's row scales, W2^T's block scales */
};

/* The two tile choices (the launcher picks one by I), as dgrad1's: BN = 256 with 3 stages
 * of 48 KB beside the 66 KB of store buffers, else BN = 128 with 5 stages of 32 KB. The
 * store warps carry the SwiGLU backward, several rows at a time (kGroup): the producer
 * warpgroup and the consumers get 168 registers each, the launch's even split. */
constexpr int kStoreWarpRegs = 168;
using Precision = Bf16;
using WideCfg = ProducerRegs<TileConfig<Precision, 256, 3, false, true, 0, 512>, kStoreWarpRegs>;
using NarrowCfg = ProducerRegs<TileConfig<Precision, 128, 5, false, true, 0, 256>, kStoreWarpRegs>;
/* FP8: B = W2^T [E * I, H] K-major (no transposes for 8-bit wgmma), BN = 128 (the
 * promotion's second accumulator set), 5 stages of 32 KB + 512 bytes of row scales.
 * NOTE: the second set needs more than 168 consumer registers (4 bytes spilled at 168,
 * ptxas CUDA 13): the store warps give 16 (152 each, 176 for the consumers). */
constexpr int kFp8StoreWarpRegs = 152;
using Fp8Cfg = ProducerRegs<TileConfig<Fp8E4m3, 128, 5, false, false, 0, 256>, kFp8StoreWarpRegs>;

/* ---- producer: A rows of the block, then BN/64 boxes of W2_e rows k.. k+63. */
template <class Cfg>
struct Dgrad2Load {
    const Dgrad2Args &args;
    int m_row, w_row, n_col;
    bool gave_up;   /* EP: a wait for a block's rows ran out (the call failed): no more */

    __device__ __forceinline__ void tile_begin(int m_block, int n_block) {
        if (args.rows_in.arrivals && !gave_up) gave_up = !ep::wait_block_rows(args.rows_in, m_block);
        const int e = args.row_block_expert[m_block];
        m_row = m_block * kBlockM;
        w_row = Cfg::kBMnMajor ? e * args.hidden : e * args.intermediate;
        n_col = n_block * Cfg::BN;
    }
    __device__ __forceinline__ void stage(int kb, uint8_t *a, uint8_t *b, uint64_t *bar) {
        const int k = kb * Cfg::kBlockK;
        /* W2_e is read again by every row block of the expert: kept in L2 before the
         * streams touched once (gate_up, dh and act_p, which the store warps load and
         * store evict-first).
         * NOTE: it pays with collapsed routing only (see
         * docs/decisions/0011-dgrad2-epilogue). */
        ptx::tma_load_2d(a, &args.map_dys, bar, k, m_row);
        if constexpr (Cfg::kBMnMajor)
            tma_load_mn_boxes_hint<Cfg, Cfg::BN / Cfg::kMnBoxCols>(b, &args.map_w2, bar, n_col,
                                                                   w_row + k,
                                                                   ptx::l2_policy_evict_last());
        else   /* W2^T: BN rows of e's [I, H] */
            ptx::tma_load_2d_hint(b, &args.map_w2, bar, k, w_row + n_col,
                                  ptx::l2_policy_evict_last());
    }
    __device__ __forceinline__ void stage(int kb, uint8_t *a, uint8_t *b, uint8_t *a_scales,
                                          uint64_t *bar) {
        stage(kb, a, b, bar);
        args.scales.load_a<Cfg>(a_scales, kb, m_row, bar);
    }
    /* Consumers (FP8): the tile's scale hook (W2^T_e rows: one or two 128-row blocks). */
    __device__ __forceinline__ auto block_scale(int m_block, int n_block, int k_blocks) const {
        const int64_t n =
            (int64_t)args.row_block_expert[m_block] * args.intermediate + n_block * Cfg::BN;
        return args.scales.tile<Cfg>(n, n + Cfg::BN / 2, args.hidden, k_blocks);
    }
};

/* ---- epilogue ------------------------------------------------------------------------ */
/* The SwiGLU backward of two adjacent columns (one bf16 pair of g, u and da' each) of a row
 * with routing weight p:
 *   a = bf16(silu(g) u)   exactly as the forward's store warps round it (swiglu.cuh),
 *   dg = p da' u silu'(g),  silu'(g) = s (1 + g (1 - s)) = s + silu (1 - s),
 *   du = p da' silu(g),     act_p = bf16(p a),  and d p's terms da' a. */
struct SwigluBwdPair {
    uint32_t dg, du, act_p;   /* bf16 pairs */
    float dp;                 /* da'_lo a_lo + da'_hi a_hi */
};

template <bool kActWeighted>
__device__ __forceinline__ SwigluBwdPair swiglu_bwd_pair(uint32_t g2, uint32_t u2, uint32_t d2,
                                                         float p) {
    const float g0 = bf16_lo(g2), g1 = bf16_hi(g2), u0 = bf16_lo(u2), u1 = bf16_hi(u2);
    const float d0 = bf16_lo(d2), d1 = bf16_hi(d2);
    const Swiglu f0 = swiglu(g0, u0), f1 = swiglu(g1, u1);
    const uint32_t a2 = pack_bf16x2_rn(f0.a, f1.a);
    const float a0 = bf16_lo(a2), a1 = bf16_hi(a2);
    const float da0 = p * d0, da1 = p * d1;
    const float ds0 = fmaf(f0.silu, 1.f - f0.s, f0.s), ds1 = fmaf(f1.silu, 1.f - f1.s, f1.s);
    return {pack_bf16x2_rn(da0 * u0 * ds0, da1 * u1 * ds1),
            pack_bf16x2_rn(da0 * f0.silu, da1 * f1.silu), kActWeighted ? pack_bf16x2_rn(p * a0, p * a1) : a2,
            fmaf(d1, a1, d0 * a0)};
}

/* The sums over kLanes lanes (a power of two, the lanes of one row) of the kN values v
 * each lane holds, in kN - 1 + log2(kLanes / kN) shuffles: each of the first log2(kN) rounds
 * halves the values, a lane keeping the half its bit of the round selects, the rest are a
 * butterfly. Value k's sum ends in the lanes whose (lane % kLanes) is lane_of(k); each
 * lane returns the sum of value index_of(lane). */
template <int kN, int kLanes>
struct GroupSum {
    static_assert(kN >= 1 && kN <= kLanes && (kN & (kN - 1)) == 0 && (kLanes & (kLanes - 1)) == 0,
                  "powers of two, no more values than lanes");
    /* The lane bit of round j (0-based): kLanes / 2 >> j. */
    static __device__ __forceinline__ int lane_of(int k) {
        int l = 0;
#pragma unroll
        for (int j = 0; (1 << j) < kN; ++j) l |= ((k >> j) & 1) * (kLanes / 2 >> j);
        return l;
    }
    static __device__ __forceinline__ int index_of(int lane) {
        int k = 0;
#pragma unroll
        for (int j = 0; (1 << j) < kN; ++j) k |= ((lane & (kLanes / 2 >> j)) ? 1 : 0) << j;
        return k;
    }
    static __device__ __forceinline__ float sum(float (&v)[kN], int lane) {
        int n = kN, o = kLanes / 2;
#pragma unroll
        for (; n > 1; n /= 2, o /= 2) {
            const bool upper = lane & o;
#pragma unroll
            for (int i = 0; i < n / 2; ++i) {
                const float send = upper ? v[2 * i] : v[2 * i + 1];
                const float keep = upper ? v[2 * i + 1] : v[2 * i];
                v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
            }
        }
        float x = v[0];
#pragma unroll
        for (; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
        return x;
    }
    /* Whether this lane stores the sum it holds (one lane per value). */
    static __device__ __forceinline__ bool stores(int lane) {
        return (lane % kLanes) == lane_of(index_of(lane));
    }
};

template <class Cfg>
struct Dgrad2Epilogue {
    /* act_p = bf16(p a) (bf16), or bf16(a) (FP8: the recipe's dW2 = (p dy)^T a) */
    static constexpr bool kActWeighted = Cfg::kAScaleBytes == 0;
    /* A row's BN columns are kLanesPerRow lanes of kPieces 16-byte pieces (8 columns each,
     * the pieces BN / kPieces columns apart, so that one row offset serves them all); a warp
     * step covers kRowsPerStep rows, and each warp takes every kStoreWarps-th step: kSteps
     * of them. The steps run kGroup at a time with no branch in the math, so that their
     * chains interleave (one warp per scheduler issues this code: its latencies bound it),
     * each step's g and u registers loaded with the step kGroup later once its math has
     * read them. The steps left over form a last group, whose rows past 64 (the last step
     * of some warps) compute row 63 again and store nothing.
     * NOTE: the last full group also loads g and u for steps past the last one (row 63
     * again: kGroup - kLastGroup steps' loads per drain) where the group loop runs more
     * than once (bf16's 256-wide tile: one step's); skipping them with a predicate spilled
     * at 168 registers (ptxas, CUDA 13, 2026-12-04). FP8's drain has one full group, whose
     * extra loads fill registers the last group never reads: ptxas drops them (its SASS: 16
     * 16-byte g and u loads before the group, 8 in it, and the same with a predicate). */
    static constexpr int kPieces = 2;
    static constexpr int kLanesPerRow = Cfg::BN / 8 / kPieces;
    static constexpr int kPieceCols = Cfg::BN / kPieces;
    static constexpr int kRowsPerStep = 32 / kLanesPerRow;
    static constexpr int kRowStride = kStoreWarps * kRowsPerStep;   /* rows between a warp's steps */
    static constexpr int kSteps = (64 + kRowStride - 1) / kRowStride;
    static constexpr int kFullSteps = 64 / kRowStride;   /* rows below 64 in every warp */
    /* FP8 (BN = 128, no p a): 4 steps' g and u in flight, which its 152 registers hold;
     * the drain waits on those loads (dgrad2 772 -> 708 us on an H100, qwen3-30b-a3b
     * T = 16384, against 2). bf16 keeps 2: its 128-wide form spilled at 4. See
     * docs/decisions/0011-dgrad2-epilogue. */
    static constexpr int kGroup = kActWeighted ? 2 : 4;
    static constexpr int kGroupedSteps = kFullSteps / kGroup * kGroup;
    static constexpr int kLastGroup = kSteps - kGroupedSteps;
    static_assert(kLastGroup <= kGroup, "the last group fits the group's registers");
    static_assert((kGroup & (kGroup - 1)) == 0 && (kLastGroup & (kLastGroup - 1)) == 0,
                  "a group's dp sums are one GroupSum (powers of two)");
    static_assert(Cfg::kStoreRowBytes == Cfg::BN * 2 && Cfg::kStoreWarps,
                  "the consumers hand da' over as bf16 rows of the tile's width");
    const Dgrad2Args &args;
    Ring<Cfg> ring;
    StoreHandoff handoff;

    /* Consumers: da' rounded to bf16 into the warpgroup's buffer. */
    __device__ __forceinline__ void operator()(int, int, float (&acc)[Cfg::kAccRegs],
                                               uint8_t *buf) {
        handoff.stage<false>(ring, buf, [&](uint8_t *b) { epi_write_acc_bf16<Cfg>(b, acc); });
    }

    /* Store warps: the SwiGLU backward of warpgroup wg's 64 rows. */
    __device__ __forceinline__ void drain(int m_block, int n_block, int wg, const uint8_t *buf) {
        /* EP: this block's row_slot and row_weight come with its rows (once the call
         * failed, no more waits); warpgroup 1's drain of a tile follows warpgroup 0's. */
        if (wg == 0 && args.rows_in.arrivals &&
            !*reinterpret_cast<volatile int32_t *>(&args.rows_in.state->call_failed))
            ep::wait_block_rows(args.rows_in, m_block);
        const int I = args.intermediate;
        const int64_t row0 = (int64_t)m_block * kBlockM + wg * 64;
        const int lane = threadIdx.x % 32, sw = threadIdx.x / 32 - kFirstStoreWarp;
        const int col = n_block * Cfg::BN + 8 * (lane % kLanesPerRow);
        /* Rows lane and lane + 32: slot (padding: -1) and weight, passed by shuffles. */
        const int slot_a = args.row_slot[row0 + lane], slot_b = args.row_slot[row0 + lane + 32];
        const float w_a = args.row_weight[row0 + lane], w_b = args.row_weight[row0 + lane + 32];
        /* This lane's row of step s: first + s kRowStride; the pointers of its row 0, to
         * which a row adds 32-bit offsets. */
        const int first = sw * kRowsPerStep + lane / kLanesPerRow;
        const uint16_t *const gu_base = args.gate_up + row0 * 2 * I + col;
        uint16_t *const dh_base = args.dh + row0 * 2 * I + col;
        uint16_t *const ap_base = args.act_p + row0 * I + col;
        float *const dp_base = args.dp_partial + row0 * args.dp_parts + n_block;
        const uint8_t *const d_base = buf + 16 * (lane % kLanesPerRow);
        auto row_of = [&](int s) { return first + s * kRowStride; };

        /* g and u of the steps in flight: [step in the group][piece]. */
        uint4 g[kGroup][kPieces], u[kGroup][kPieces];
        /* Step s's g and u (a row past 64 loads row 63's), streamed. */
        auto load = [&](int s, uint4 (&gs)[kPieces], uint4 (&us)[kPieces]) {
            const uint16_t *p = gu_base + min(row_of(s), 63) * 2 * I;
#pragma unroll
            for (int j = 0; j < kPieces; ++j) {
                gs[j] = __ldcs(reinterpret_cast<const uint4 *>(p + j * kPieceCols));
                us[j] = __ldcs(reinterpret_cast<const uint4 *>(p + I + j * kPieceCols));
            }
        };
        /* kN steps from s0: math, stores and the dp sums. kLast: the last group (rows may
         * run past 64; no loads after it). */
        auto group = [&](int s0, auto n, auto last) {
            constexpr int kN = decltype(n)::value;
            constexpr bool kLast = decltype(last)::value;
            float dp[kN];
            unsigned ok_bits = 0;
#pragma unroll
            for (int k = 0; k < kN; ++k) {
                const int r = kLast ? min(row_of(s0 + k), 63) : row_of(s0 + k);
                /* Row r's weight and padding flag (the rows of a step are all below 32 or
                 * all not). */
                const bool hi_half = r >= 32;
                const bool ok = __shfl_sync(0xffffffffu, hi_half ? slot_b : slot_a, r % 32) >= 0;
                const float p = __shfl_sync(0xffffffffu, hi_half ? w_b : w_a, r % 32);
                uint4 dg[kPieces], du[kPieces], ap[kPieces];
                float dps = 0.f;
#pragma unroll
                for (int j = 0; j < kPieces; ++j) {
                    const uint4 d = *reinterpret_cast<const uint4 *>(
                        d_base + r * Cfg::kEpiRowBytes + j * kPieceCols * 2);
                    const SwigluBwdPair o0 = swiglu_bwd_pair<kActWeighted>(g[k][j].x, u[k][j].x, d.x, p);
                    const SwigluBwdPair o1 = swiglu_bwd_pair<kActWeighted>(g[k][j].y, u[k][j].y, d.y, p);
                    const SwigluBwdPair o2 = swiglu_bwd_pair<kActWeighted>(g[k][j].z, u[k][j].z, d.z, p);
                    const SwigluBwdPair o3 = swiglu_bwd_pair<kActWeighted>(g[k][j].w, u[k][j].w, d.w, p);
                    dg[j] = make_uint4(o0.dg, o1.dg, o2.dg, o3.dg);
                    du[j] = make_uint4(o0.du, o1.du, o2.du, o3.du);
                    ap[j] = make_uint4(o0.act_p, o1.act_p, o2.act_p, o3.act_p);
                    dps += (o0.dp + o1.dp) + (o2.dp + o3.dp);
                }
                if (!kLast) load(s0 + kGroup + k, g[k], u[k]);
                dp[k] = dps;
                ok_bits |= (unsigned)ok << k;
                /* Zeros for a padding row; nothing past row 63. */
                if (!kLast || row_of(s0 + k) < 64) {
                    uint16_t *dh = dh_base + r * 2 * I;
                    uint16_t *a = ap_base + r * I;
                    const uint4 zero = make_uint4(0, 0, 0, 0);
#pragma unroll
                    for (int j = 0; j < kPieces; ++j) {
                        uint4 *dgp = reinterpret_cast<uint4 *>(dh + j * kPieceCols);
                        uint4 *dup = reinterpret_cast<uint4 *>(dh + I + j * kPieceCols);
                        uint4 *app = reinterpret_cast<uint4 *>(a + j * kPieceCols);
                        if (ok) {
                            __stcs(dgp, dg[j]);
                            __stcs(dup, du[j]);
                            __stcs(app, ap[j]);
                        } else {
                            __stcs(dgp, zero);
                            __stcs(dup, zero);
                            __stcs(app, zero);
                        }
                    }
                }
            }
            using Sum = GroupSum<kN, kLanesPerRow>;
            const float sum = Sum::sum(dp, lane);
            const int k = Sum::index_of(lane);
            if (Sum::stores(lane) && (!kLast || row_of(s0 + k) < 64))
                dp_base[row_of(s0 + k) * args.dp_parts] = (ok_bits >> k) & 1 ? sum : 0.f;
        };

#pragma unroll
        for (int k = 0; k < kGroup; ++k) load(k, g[k], u[k]);
#pragma unroll 1
        for (int s0 = 0; s0 < kGroupedSteps; s0 += kGroup)
            group(s0, std::integral_constant<int, kGroup>(), std::false_type());
        if constexpr (kLastGroup > 0)
            group(kGroupedSteps, std::integral_constant<int, kLastGroup>(), std::true_type());
    }
};

template <class Cfg>
__global__ void __launch_bounds__(kThreads, 1)
    sm90_gemm2_dgrad_swiglu_bwd_kernel(const __grid_constant__ Dgrad2Args args) {
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    Dgrad2Load<Cfg> load{args, 0, 0, 0, false};
    Dgrad2Epilogue<Cfg> epi{args, ring_from_smem<Cfg>(smem_raw), {}};
    run_grouped_gemm<Cfg>(smem_raw, &args.map_dys, &args.map_w2, args.num_rows, args.rows_cap,
                          args.intermediate / Cfg::BN, args.hidden / Cfg::kBlockK, load, epi);
}

template <class Cfg>
cudaError_t launch(const mf_dgrad2_params *p, cudaStream_t stream) {
    Dgrad2Args args;
    cudaError_t err;
    using P = typename Cfg::Precision;
    if ((err = tensor_map_2d<P>(&args.map_dys, p->dys.data, (uint64_t)p->rows.rows_cap,
                                p->hidden, p->hidden, kBlockM, Cfg::kBlockK)) != cudaSuccess)
        return err;
    if (Cfg::kBMnMajor)
        err = tensor_map_2d<P>(&args.map_w2, p->w2.data,
                               (uint64_t)p->rows.num_local_experts * p->hidden, p->intermediate,
                               p->intermediate, Cfg::kBlockK, Cfg::kMnBoxCols);
    else   /* W2^T [E * I, H] */
        err = tensor_map_2d<P>(&args.map_w2, p->w2.data,
                               (uint64_t)p->rows.num_local_experts * p->intermediate, p->hidden,
                               p->hidden, Cfg::BN, Cfg::kBlockK);
    if (err != cudaSuccess) return err;
    args.gate_up = p->gate_up;
    args.row_block_expert = p->rows.row_block_expert;
    args.num_rows = p->rows.num_rows;
    args.row_slot = p->row_slot;
    args.row_weight = p->row_weight;
    args.dh = p->dh;
    args.act_p = p->act_p;
    args.dp_partial = p->dp_partial;
    const mf_arrivals &w = p->rows_in;
    args.rows_in = {w.arrivals, w.target, w.state, w.timeout_ns, w.stage};
    args.rows_cap = p->rows.rows_cap;
    args.hidden = p->hidden;
    args.intermediate = p->intermediate;
    args.dp_parts = p->intermediate / Cfg::BN;   /* = mf_dgrad2_dp_parts (FP8: _fp8) */
    args.scales = block_scales_of(p->dys, p->w2, p->rows.rows_cap);

    return launch_persistent(sm90_gemm2_dgrad_swiglu_bwd_kernel<Cfg>, Cfg::kSmemBytes,
                             p->num_sms, args, stream);
}

}  // namespace

/* Tile choice, and so the dp partials per row: BN = 256 when I allows it, else 128.
 * 0 when I is not supported. */
extern "C" int mf_dgrad2_dp_parts(int intermediate) {
    if (intermediate <= 0 || intermediate % NarrowCfg::BN) return 0;
    if (intermediate % WideCfg::BN == 0) return intermediate / WideCfg::BN;
    return intermediate / NarrowCfg::BN;
}

/* What the dgrad2 kernels of precision P take; dp_parts: the tile width's partials. */
template <class P>
static bool dgrad2_params_ok(const mf_dgrad2_params *p, int dp_parts) {
    if (!p || !operand_ok<P>(p->dys, MF_SCALES_1X128) || !operand_ok<P>(p->w2, MF_SCALES_128X128) ||
        !p->gate_up || !row_blocks_ok(p->rows) || !p->row_slot || !p->row_weight || !p->dh ||
        !p->act_p || !p->dp_partial || !arrivals_ok(p->rows_in))
        return false;
    if (p->hidden <= 0 || p->hidden % P::kBlockK || dp_parts == 0 || p->num_sms <= 0)
        return false;
    /* TMA sources and the 16-byte loads and stores of the store warps. */
    return !misaligned16(p->dys.data, p->w2.data, p->gate_up, p->dh, p->act_p, p->dys.scales) &&
           !(reinterpret_cast<uintptr_t>(p->dp_partial) & 3u);
}

extern "C" cudaError_t mf_sm90_gemm2_dgrad_swiglu_bwd_bf16(const mf_dgrad2_params *p,
                                                           cudaStream_t stream) {
    if (!dgrad2_params_ok<Precision>(p, p ? mf_dgrad2_dp_parts(p->intermediate) : 0))
        return cudaErrorInvalidValue;
    if (p->rows.rows_cap == 0) return cudaSuccess;
    if (p->intermediate % WideCfg::BN == 0) return launch<WideCfg>(p, stream);
    return launch<NarrowCfg>(p, stream);
}

extern "C" int mf_dgrad2_dp_parts_fp8(int intermediate) {
    return intermediate > 0 && intermediate % Fp8Cfg::BN == 0 ? intermediate / Fp8Cfg::BN : 0;
}

extern "C" cudaError_t mf_sm90_gemm2_dgrad_swiglu_bwd_fp8(const mf_dgrad2_params *p,
                                                          cudaStream_t stream) {
    if (!dgrad2_params_ok<Fp8E4m3>(p, p ? mf_dgrad2_dp_parts_fp8(p->intermediate) : 0))
        return cudaErrorInvalidValue;
    if (p->rows.rows_cap == 0) return cudaSuccess;
    return launch<Fp8Cfg>(p, stream);
}

extern "C" cudaError_t mf_sm90_gemm2_dgrad_swiglu_load(void) {
    return mf_load_kernels(sm90_gemm2_dgrad_swiglu_bwd_kernel<WideCfg>,
                           sm90_gemm2_dgrad_swiglu_bwd_kernel<NarrowCfg>,
                           sm90_gemm2_dgrad_swiglu_bwd_kernel<Fp8Cfg>);
}
