/* gemm1 of the routed experts with SwiGLU in the epilogue (sm_90a, bf16).
 *
 *   [g | u] = bf16(xs W13_e^T)  xs [rows, H], W13_e [2I, H] (gate rows 0..I-1, up I..2I-1)
 *   act     = bf16(silu(g) * u) [rows, I]; gate_up = [g | u] [rows, 2I], optional
 *
 * A tile of BN columns covers BN/2 gate columns j.. and the matching BN/2 up columns
 * I+j..: the producer loads W13_e rows j.. into the first half of the B tile and rows
 * I+j.. into the second, so one m64nBN wgmma leaves g and u of the same column in the
 * same thread (accumulator registers i and i + BN/4), and the SwiGLU needs no exchange.
 *
 * FLOPs: 2 * rows * H * 2I. qwen3-30b-a3b at 16384 tokens (131072 rows): 825 GFLOP, about
 * 1.0 ms at 790 TFLOP/s, against about 1.4 GB of DRAM traffic (0.3 ms): matrix-bound. */
#include <cuda_bf16.h>

#include "ep_wait.cuh"
#include "kernels.h"
#include "sm90_grouped_gemm.cuh"
#include "swiglu.cuh"
#include "tensor_map.h"

namespace {

using namespace mf;
using namespace mf::sm90;

struct Gemm1Args {
    CUtensorMap map_xs;    /* [rows_cap, H], box 128 x 64 */
    CUtensorMap map_w13;   /* [E * 2I, H], box BN/2 x 64 */
    const int32_t *row_block_expert;
    const int32_t *num_rows;
    __nv_bfloat16 *act;
    __nv_bfloat16 *gate_up;
    const uint32_t *arrivals;        /* EP: rows in of each block, or null */
    const uint32_t *arrival_target;
    mf_plan_state *state;
    int64_t timeout_ns;
    int rows_cap, hidden, intermediate;
};

/* ---- producer: A rows of the block, then the gate and up halves of B ---------------- */
template <class Cfg>
struct Gemm1Load {
    const Gemm1Args &args;
    int m_row, w_gate_row, w_up_row;
    bool gave_up;   /* a wait ran out: the call failed, wait no more */

    /* Expert parallelism: the block's rows are still arriving from the other ranks. The
     * generic-proxy acquire, then a proxy fence, orders the TMA reads after the rows. */
    __device__ __forceinline__ void wait_rows(int m_block) {
        if (!args.arrivals || gave_up) return;
        const uint32_t want = args.arrival_target[m_block];
        const uint32_t *count = args.arrivals + m_block;
        uint32_t seen = ptx::ld_acquire_sys(count);
        if ((int32_t)(seen - want) < 0) {
            const uint64_t t0 = ptx::globaltimer_ns();
            while ((int32_t)((seen = ptx::ld_acquire_sys(count)) - want) < 0) {
                if ((int64_t)(ptx::globaltimer_ns() - t0) > args.timeout_ns) {
                    ep::record_failure(args.state, MOEFUSE_ERR_TIMEOUT, -1 - m_block,
                                       MF_EP_STAGE_ROWS, seen, want);
                    args.state->call_failed = 1;
                    gave_up = true;
                    break;
                }
                __nanosleep(64);
            }
        }
        asm volatile("fence.proxy.async.global;" ::: "memory");
    }

    __device__ __forceinline__ void tile_begin(int m_block, int n_block) {
        wait_rows(m_block);
        const int e = args.row_block_expert[m_block];
        m_row = m_block * kBlockM;
        w_gate_row = e * 2 * args.intermediate + n_block * (Cfg::BN / 2);
        w_up_row = w_gate_row + args.intermediate;
    }
    __device__ __forceinline__ void stage(int kb, uint8_t *a, uint8_t *b, uint64_t *bar) {
        const int k = kb * kBlockK;
        ptx::tma_load_2d(a, &args.map_xs, bar, k, m_row);
        ptx::tma_load_2d(b, &args.map_w13, bar, k, w_gate_row);
        ptx::tma_load_2d(b + Cfg::kBBytes / 2, &args.map_w13, bar, k, w_up_row);
    }
};

/* ---- epilogue: [g | u] rounded to bf16, then act = silu(g) * u from those ------------
 * The consumers write their 64 rows of [g | u] (bf16) into their buffer and go on with
 * the next tile's K loop; the store warps compute act from the buffer (swiglu.cuh: the
 * same expression as the backward's, and the CPU backend's rounding path) and store act,
 * and g and u when gate_up is asked for.
 * NOTE: act used to be computed from fp32 g and u in the consumers, which stored the
 * three outputs themselves with the tensor cores idle. Measured on an H200 (131072 rows,
 * same-call A/B), the store warps took qwen3-235b-a22b from 5.55 to 5.31 ms and left
 * qwen3-30b-a3b within noise (1.25-1.31 ms): 3 stages instead of 4 give back part of
 * the overlap. bench/NOTES.md v8. */
template <class Cfg>
struct Gemm1Epilogue {
    const Gemm1Args &args;
    Ring<Cfg> ring;
    StoreHandoff handoff;

    /* Buffer row: BN/2 gate columns then the BN/2 matching up columns (the accumulator's
     * own column order). */
    __device__ __forceinline__ void operator()(int, int, float (&acc)[Cfg::kAccRegs],
                                               uint8_t *buf) {
        const int wg = threadIdx.x / 128;
        handoff.acquire(ring, wg);
        epi_write_bf16<Cfg>(buf, [&](int c, int h) {
            return pack_bf16x2_rn(acc[4 * c + 2 * h], acc[4 * c + 2 * h + 1]);
        });
        handoff.release(ring, wg);
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

template <class Cfg>
__global__ void __launch_bounds__(kThreads, 1)
    sm90_gemm1_swiglu_fwd_bf16_kernel(const __grid_constant__ Gemm1Args args) {
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    Gemm1Load<Cfg> load{args, 0, 0, 0, false};
    Gemm1Epilogue<Cfg> epi{args, ring_from_smem<Cfg>(smem_raw), {}};
    run_grouped_gemm<Cfg>(smem_raw, &args.map_xs, &args.map_w13, args.num_rows, args.rows_cap,
                          (2 * args.intermediate) / Cfg::BN, args.hidden / kBlockK, load, epi);
}

template <class Cfg>
cudaError_t launch(const mf_gemm1_params *p, cudaStream_t stream) {
    Gemm1Args args;
    cudaError_t err;
    if ((err = mf_tensor_map_bf16_2d(&args.map_xs, p->xs, (uint64_t)p->rows_cap, p->hidden,
                                     p->hidden, kBlockM, kBlockK)) != cudaSuccess)
        return err;
    if ((err = mf_tensor_map_bf16_2d(&args.map_w13, p->w13,
                                     (uint64_t)p->num_local_experts * 2 * p->intermediate,
                                     p->hidden, p->hidden, Cfg::BN / 2, kBlockK)) != cudaSuccess)
        return err;
    args.row_block_expert = p->row_block_expert;
    args.num_rows = p->num_rows;
    args.act = reinterpret_cast<__nv_bfloat16 *>(p->act);
    args.gate_up = reinterpret_cast<__nv_bfloat16 *>(p->gate_up);
    args.arrivals = p->arrivals;
    args.arrival_target = p->arrival_target;
    args.state = p->state;
    args.timeout_ns = p->timeout_ns;
    args.rows_cap = p->rows_cap;
    args.hidden = p->hidden;
    args.intermediate = p->intermediate;

    return launch_persistent(sm90_gemm1_swiglu_fwd_bf16_kernel<Cfg>, Cfg::kSmemBytes, p->num_sms, args, stream);
}

}  // namespace

/* Tile choice: BN = 256 (128 gate + 128 up columns; 3 stages of 48 KB beside the 66 KB of
 * [g | u] buffers) when I allows it, else BN = 128 (6 stages of 32 KB, 34 KB of buffers). */
extern "C" cudaError_t mf_sm90_gemm1_swiglu_fwd_bf16(const mf_gemm1_params *p,
                                                     cudaStream_t stream) {
    if (!p || !p->xs || !p->w13 || !p->row_block_expert || !p->num_rows || !p->act ||
        (p->arrivals && (!p->arrival_target || !p->state)))
        return cudaErrorInvalidValue;
    if (p->rows_cap < 0 || p->rows_cap % kBlockM || p->hidden <= 0 || p->hidden % kBlockK ||
        p->intermediate <= 0 || p->intermediate % 64 || p->num_local_experts <= 0 ||
        p->num_sms <= 0)
        return cudaErrorInvalidValue;
    /* TMA sources and the 16-byte epilogue stores need 16-byte aligned bases. */
    if (misaligned16(p->xs, p->w13, p->act, p->gate_up)) return cudaErrorInvalidValue;
    if (p->rows_cap == 0) return cudaSuccess;
    if (p->intermediate % 128 == 0) return launch<TileConfig<256, 3, false, false, 0, 512>>(p, stream);
    return launch<TileConfig<128, 6, false, false, 0, 256>>(p, stream);
}
