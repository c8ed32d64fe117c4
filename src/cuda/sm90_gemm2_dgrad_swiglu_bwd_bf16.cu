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
 * takes whole rows: 8 columns per lane, g and u copied into a small shared-memory ring by
 * cp.async two rows ahead, dh and act_p stored 16 bytes per lane (evict-first), the row's
 * dp partial a warp sum.
 * NOTE: da' is rounded to bf16 before the SwiGLU backward (one more rounding on dh's
 * path than the fp32 da' of the consumer-side epilogue this replaced; the same rounding
 * torch._grouped_mm's bf16 output has in an autograd MoE). The CPU backend rounds it too.
 * NOTE: measured on an H200 (131072 rows, bench/NOTES.md v22) against the consumer-side
 * epilogue it replaced (BN = 128, two accumulator sets, the math in 32 pieces under the
 * next tile's first K blocks): qwen3-30b-a3b 0.852 -> 0.812 ms (mean of four routings,
 * two rounds), qwen3-235b-a22b 2.80 -> 2.46 ms. The GEMM alone (store warps idle) takes
 * 0.54-0.59 and 2.26 ms: on 30b the three store warps (IPC ~0.3 each, ncu) still bound it. 
 *
 * FLOPs: 2 * rows * H * I. qwen3-30b-a3b at 131072 rows: 412 GFLOP, about 0.52 ms at
 * 790 TFLOP/s; outputs dh + act_p are 3 * rows * I * 2 bytes (0.6 GB) and the gate_up
 * read 0.4 GB: ~0.3 ms of HBM traffic, under the K loops. */
#include <cuda_bf16.h>

#include "ep_wait.cuh"
#include "kernels.h"
#include "ptx/cp_async.cuh"
#include "sm90_grouped_gemm.cuh"
#include "swiglu.cuh"
#include "tensor_map.h"

namespace {

using namespace mf;
using namespace mf::sm90;

struct Dgrad2Args {
    CUtensorMap map_dys;   /* [rows_cap, H], box 128 x 64 (K-major) */
    CUtensorMap map_w2;    /* [E * H, I], box 64 rows x 64 columns (MN-major B) */
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
};

/* The store warps' g and u staging: per store warp kGuSlots slots of one warp step's g
 * and u pieces (16 bytes per lane each), filled by cp.async kGuSlots - kPair steps ahead. */
constexpr int kGuSlots = 4;
constexpr int kGuSlotBytes = 32 * 16 * 2;
constexpr int kGuRingBytes = kStoreWarps * kGuSlots * kGuSlotBytes;   /* 12 KB */

/* The two tile choices (the launcher picks one by I), as dgrad1's: BN = 256 with 3 stages
 * of 48 KB beside the 66 KB of store buffers and the 12 KB g/u ring, else BN = 128 with 5
 * stages of 32 KB. The store warps carry the SwiGLU backward, so the producer warpgroup
 * gets 104 registers (the consumers 200). */
constexpr int kStoreWarpRegs = 104;
using WideCfg = ProducerRegs<TileConfig<256, 3, false, true, kGuRingBytes, 512>, kStoreWarpRegs>;
using NarrowCfg = ProducerRegs<TileConfig<128, 5, false, true, kGuRingBytes, 256>, kStoreWarpRegs>;

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
        w_row = e * args.hidden;
        n_col = n_block * Cfg::BN;
    }
    __device__ __forceinline__ void stage(int kb, uint8_t *a, uint8_t *b, uint64_t *bar) {
        const int k = kb * kBlockK;
        /* W2_e is read again by every row block of the expert: kept in L2 before the
         * streams touched once (gate_up, dh and act_p, which the store warps load and
         * store evict-first).
         * NOTE: measured on an H200 with the consumer-side epilogue (qwen3-30b-a3b, 131072
         * rows, bench/NOTES.md v21): collapsed routing 0.891 -> 0.841 ms, the other
         * routings and qwen3-235b-a22b unchanged within 2%. */
        ptx::tma_load_2d(a, &args.map_dys, bar, k, m_row);
        tma_load_mn_boxes_hint<Cfg, Cfg::BN / 64>(b, &args.map_w2, bar, n_col, w_row + k,
                                                  ptx::l2_policy_evict_last());
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
            pack_bf16x2_rn(da0 * f0.silu, da1 * f1.silu), pack_bf16x2_rn(p * a0, p * a1),
            fmaf(d1, a1, d0 * a0)};
}

template <class Cfg>
struct Dgrad2Epilogue {
    /* A row's BN columns are kLanesPerRow lanes of 8; a warp step covers kRowsPerStep rows,
     * and each warp takes every kStoreWarps-th step: kSteps of them. The first kFullSteps
     * have all their rows in every warp and run kPair at a time with no branch in the
     * math, so that the steps' chains interleave; the rest (the last one or two, whose
     * rows may run past 64) run one at a time, masked. */
    static constexpr int kLanesPerRow = Cfg::BN / 8;
    static constexpr int kRowsPerStep = 32 / kLanesPerRow;
    static constexpr int kRowStride = kStoreWarps * kRowsPerStep;   /* rows between a warp's steps */
    static constexpr int kSteps = (64 + kRowStride - 1) / kRowStride;
    static constexpr int kFullSteps = 64 / kRowStride;
    static constexpr int kPair = 2;
    static constexpr int kPairedSteps = kFullSteps / kPair * kPair;
    static constexpr int kLead = kGuSlots - kPair;   /* steps loaded ahead of a pair */
    static_assert(kLead >= 1 && Cfg::kExtraBytes == kGuRingBytes, "the g/u ring");
    static_assert(kPairedSteps + kLead >= kSteps,
                  "the pairs' loads reach every step, so the tail only waits");
    static_assert(Cfg::kStoreRowBytes == Cfg::BN * 2 && Cfg::kStoreWarps,
                  "the consumers hand da' over as bf16 rows of the tile's width");
    const Dgrad2Args &args;
    Ring<Cfg> ring;
    StoreHandoff handoff;

    /* Consumers: da' rounded to bf16 into the warpgroup's buffer. */
    __device__ __forceinline__ void operator()(int, int, float (&acc)[Cfg::kAccRegs],
                                               uint8_t *buf) {
        handoff.stage(ring, buf, [&](uint8_t *b) { epi_write_acc_bf16<Cfg>(b, acc); });
    }

    /* Store warps: the SwiGLU backward of warpgroup wg's 64 rows. */
    __device__ __forceinline__ void drain(int m_block, int n_block, int wg, const uint8_t *buf) {
        /* EP: this block's row_slot and row_weight come with its rows (once the call
         * failed, no more waits). */
        if (args.rows_in.arrivals &&
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
        const bool dp_lane = lane % kLanesPerRow == 0;

        /* Step s's g and u pieces into slot s % kGuSlots; one cp.async group per step (an
         * empty one past the last). Each lane reads back only its own pieces. A row past
         * 64 loads row 63's (never stored). */
        uint8_t *const gu_ring = ring.extra + sw * kGuSlots * kGuSlotBytes + 16 * lane;
        auto load_step = [&](int s) {
            if (s < kSteps) {
                const int r = min(first + s * kRowStride, 63);
                const uint16_t *g = gu_base + r * 2 * I;
                uint8_t *slot = gu_ring + (s % kGuSlots) * kGuSlotBytes;
                ptx::cp_async_16(slot, g);
                ptx::cp_async_16(slot + kGuSlotBytes / 2, g + I);
            }
            ptx::cp_async_commit();
        };
        /* Row r's weight and padding flag (r < 64; the rows of a step are all below 32 or
         * all not). */
        auto weight_of = [&](unsigned r, bool &ok, float &p) {
            const bool hi_half = r >= 32;
            ok = __shfl_sync(0xffffffffu, hi_half ? slot_b : slot_a, r % 32) >= 0;
            p = __shfl_sync(0xffffffffu, hi_half ? w_b : w_a, r % 32);
        };
        struct RowOut {
            uint4 dg, du, ap;
            float dp;
        };
        /* Step s's 8 columns of row r (r < 64) from the ring slot and the da' buffer. */
        auto row_math = [&](int s, int r, float p) {
            const uint8_t *slot = gu_ring + (s % kGuSlots) * kGuSlotBytes;
            const uint4 g = *reinterpret_cast<const uint4 *>(slot);
            const uint4 u = *reinterpret_cast<const uint4 *>(slot + kGuSlotBytes / 2);
            const uint4 d = *reinterpret_cast<const uint4 *>(d_base + r * Cfg::kEpiRowBytes);
            const SwigluBwdPair x = swiglu_bwd_pair(g.x, u.x, d.x, p);
            const SwigluBwdPair y = swiglu_bwd_pair(g.y, u.y, d.y, p);
            const SwigluBwdPair z = swiglu_bwd_pair(g.z, u.z, d.z, p);
            const SwigluBwdPair w = swiglu_bwd_pair(g.w, u.w, d.w, p);
            return RowOut{make_uint4(x.dg, y.dg, z.dg, w.dg), make_uint4(x.du, y.du, z.du, w.du),
                          make_uint4(x.act_p, y.act_p, z.act_p, w.act_p),
                          (x.dp + y.dp) + (z.dp + w.dp)};
        };
        /* Row r's outputs (zeros for a padding row), before its dp sum. */
        auto store_row = [&](int r, bool ok, const RowOut &o) {
            uint16_t *dh = dh_base + r * 2 * I;
            uint4 *ap = reinterpret_cast<uint4 *>(ap_base + r * I);
            if (ok) {
                __stcs(reinterpret_cast<uint4 *>(dh), o.dg);
                __stcs(reinterpret_cast<uint4 *>(dh + I), o.du);
                __stcs(ap, o.ap);
            } else {
                const uint4 zero = make_uint4(0, 0, 0, 0);
                __stcs(reinterpret_cast<uint4 *>(dh), zero);
                __stcs(reinterpret_cast<uint4 *>(dh + I), zero);
                __stcs(ap, zero);
            }
        };
        auto store_dp = [&](int r, bool ok, float dp) {
            if (dp_lane) dp_base[r * args.dp_parts] = ok ? dp : 0.f;
        };
        auto row_sum = [&](float v) {
#pragma unroll
            for (int o = kLanesPerRow / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
            return v;
        };

#pragma unroll
        for (int s = 0; s < kLead; ++s) load_step(s);
#pragma unroll 1
        for (int s0 = 0; s0 < kPairedSteps; s0 += kPair) {
            /* The slots of the pair before are read: refill them kLead steps ahead, then
             * wait for this pair's. */
#pragma unroll
            for (int k = 0; k < kPair; ++k) load_step(s0 + kLead + k);
            ptx::cp_async_wait<kLead>();
            bool ok[kPair];
            float p[kPair];
            RowOut out[kPair];
#pragma unroll
            for (int k = 0; k < kPair; ++k) weight_of(first + (s0 + k) * kRowStride, ok[k], p[k]);
#pragma unroll
            for (int k = 0; k < kPair; ++k) out[k] = row_math(s0 + k, first + (s0 + k) * kRowStride, p[k]);
#pragma unroll
            for (int k = 0; k < kPair; ++k) store_row(first + (s0 + k) * kRowStride, ok[k], out[k]);
#pragma unroll
            for (int k = 0; k < kPair; ++k)
                store_dp(first + (s0 + k) * kRowStride, ok[k], row_sum(out[k].dp));
        }
        /* The tail: every step is loaded already. */
        ptx::cp_async_wait<0>();
#pragma unroll
        for (int s = kPairedSteps; s < kSteps; ++s) {
            const int r = first + s * kRowStride;
            bool ok;
            float p;
            weight_of(min(r, 63), ok, p);
            const RowOut out = row_math(s, min(r, 63), p);
            const float dp = row_sum(out.dp);
            if (r < 64) {
                store_row(r, ok, out);
                store_dp(r, ok, dp);
            }
        }
    }
};

template <class Cfg>
__global__ void __launch_bounds__(kThreads, 1)
    sm90_gemm2_dgrad_swiglu_bwd_bf16_kernel(const __grid_constant__ Dgrad2Args args) {
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    Dgrad2Load<Cfg> load{args, 0, 0, 0, false};
    Dgrad2Epilogue<Cfg> epi{args, ring_from_smem<Cfg>(smem_raw), {}};
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
    args.gate_up = p->gate_up;
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

    return launch_persistent(sm90_gemm2_dgrad_swiglu_bwd_bf16_kernel<Cfg>, Cfg::kSmemBytes,
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

extern "C" cudaError_t mf_sm90_gemm2_dgrad_swiglu_bwd_bf16(const mf_dgrad2_params *p,
                                                           cudaStream_t stream) {
    if (!p || !p->dys || !p->w2 || !p->gate_up || !p->row_block_expert || !p->num_rows ||
        !p->row_slot || !p->row_weight || !p->dh || !p->act_p || !p->dp_partial ||
        (p->arrivals && (!p->arrival_target || !p->state)))
        return cudaErrorInvalidValue;
    if (p->rows_cap < 0 || p->rows_cap % kBlockM || p->hidden <= 0 || p->hidden % kBlockK ||
        mf_dgrad2_dp_parts(p->intermediate) == 0 || p->num_local_experts <= 0 ||
        p->num_sms <= 0)
        return cudaErrorInvalidValue;
    /* TMA sources and the 16-byte loads and stores of the store warps. */
    if (misaligned16(p->dys, p->w2, p->gate_up, p->dh, p->act_p) ||
        (reinterpret_cast<uintptr_t>(p->dp_partial) & 3u))
        return cudaErrorInvalidValue;
    if (p->rows_cap == 0) return cudaSuccess;
    if (p->intermediate % WideCfg::BN == 0) return launch<WideCfg>(p, stream);
    return launch<NarrowCfg>(p, stream);
}

extern "C" cudaError_t mf_sm90_gemm2_dgrad_swiglu_load(void) {
    return mf_load_kernels(sm90_gemm2_dgrad_swiglu_bwd_bf16_kernel<WideCfg>,
                           sm90_gemm2_dgrad_swiglu_bwd_bf16_kernel<NarrowCfg>);
}
