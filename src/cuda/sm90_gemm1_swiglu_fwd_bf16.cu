/* gemm1 of the routed experts with SwiGLU in the epilogue (sm_90a, bf16).
 *
 *   [g | u] = xs W13_e^T        xs [rows, H], W13_e [2I, H] (gate rows 0..I-1, up I..2I-1)
 *   act     = silu(g) * u       [rows, I] bf16; gate_up = [g | u] [rows, 2I] bf16, optional
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

/* ---- epilogue: act = silu(g) * u in fp32, one bf16 rounding ---------------------------
 * Accumulator layout of m64nN (per warpgroup): register 4c + 2h + {0,1} of lane l in warp
 * w holds row 16w + l/4 + 8h, columns 8c + 2(l%4) + {0,1}. */
/* g sigmoid(g) with one approximate reciprocal (MUFU.RCP, within 1 ulp for 1 + e^-g in
 * [1, inf]) instead of an IEEE division: about 10 instructions fewer per element. */
__device__ __forceinline__ float silu(float g) { return g * __fdividef(1.f, 1.f + __expf(-g)); }

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t *>(&v);
}

template <class Cfg>
struct Gemm1Epilogue {
    const Gemm1Args &args;

    __device__ __forceinline__ void operator()(int m_block, int n_block,
                                               float (&acc)[Cfg::kAccRegs], uint8_t *buf) {
        constexpr int kHalf = Cfg::kAccRegs / 2;   /* registers of the gate half */
        constexpr int kCols = Cfg::BN / 2;         /* output columns of this tile */
        const int I = args.intermediate;
        const int64_t row0 = (int64_t)m_block * kBlockM + (threadIdx.x / 128) * 64;
        const int col0 = n_block * kCols;
        epi_store_chunk<kCols>(
            buf,
            [&](int c, int h) {
                const float g0 = acc[4 * c + 2 * h], g1 = acc[4 * c + 2 * h + 1];
                const float u0 = acc[kHalf + 4 * c + 2 * h], u1 = acc[kHalf + 4 * c + 2 * h + 1];
                return pack_bf16x2(silu(g0) * u0, silu(g1) * u1);
            },
            [&](int r) -> void * { return args.act + (row0 + r) * I + col0; });
        if (args.gate_up) {
            epi_store_chunk<kCols>(
                buf,
                [&](int c, int h) { return pack_bf16x2(acc[4 * c + 2 * h], acc[4 * c + 2 * h + 1]); },
                [&](int r) -> void * { return args.gate_up + (row0 + r) * 2 * I + col0; });
            epi_store_chunk<kCols>(
                buf,
                [&](int c, int h) {
                    return pack_bf16x2(acc[kHalf + 4 * c + 2 * h], acc[kHalf + 4 * c + 2 * h + 1]);
                },
                [&](int r) -> void * { return args.gate_up + (row0 + r) * 2 * I + I + col0; });
        }
    }
};

template <class Cfg>
__global__ void __launch_bounds__(kThreads, 1)
    sm90_gemm1_swiglu_fwd_bf16_kernel(const __grid_constant__ Gemm1Args args) {
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    Gemm1Load<Cfg> load{args, 0, 0, 0, false};
    Gemm1Epilogue<Cfg> epi{args};
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

/* Tile choice: BN = 256 (128 gate + 128 up columns, 4 stages of 48 KB) when I allows it,
 * else BN = 128 (6 stages of 32 KB). */
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
    if (p->intermediate % 128 == 0) return launch<TileConfig<256, 4>>(p, stream);
    return launch<TileConfig<128, 6>>(p, stream);
}
