/* dgrad2 (dgrad of gemm2, d p and the SwiGLU backward; the math is in
 * sm90_gemm2_dgrad_swiglu_bwd_bf16.cu) as a ping-pong kernel (sm_90a, bf16).
 *
 * EXPERIMENTAL: written without a GPU (session 11) and not run yet. It is used only when
 * the environment sets MOEFUSE_EXPERIMENTAL_DGRAD2_PINGPONG=1; the tests of the default
 * kernel (test_gemm_sm90_bwd dgrad, test_cuda_backward) run it with that set.
 *
 * Why: in the default kernel both consumer warpgroups work on one 128 x 128 tile and run
 * its SwiGLU epilogue in pieces between the wgmma issues of the next tile's first 8 K
 * blocks. Those 8 blocks take about 3x as long as the others, and spreading the pieces
 * wider was slower still (bench/NOTES.md v13). Here each warpgroup owns whole tiles,
 * alternately: CTA tile i (in the scheduler's order) goes to warpgroup i % 2, which runs
 * its K loop (two m64n128 wgmmas per k16 step, 128 accumulators per thread) and then its
 * epilogue (64 pieces, no wgmma between them) while the other warpgroup's K loop has the
 * tensor cores.
 *
 * Shared memory is the default kernel's: the ring of 5 stages, loaded in tile order by the
 * same producer (Dgrad2Load), so a warpgroup's ring position skips the other's K blocks;
 * and one 64 KB gate_up tile, loaded with the tile's last K stage. One is enough: the two
 * warpgroups' epilogues follow each other (tile i's epilogue runs under tile i + 1's K
 * loop), and the store warps give the tile back to the producer after draining dg and du.
 *
 * Barriers: a ring stage is read by one warpgroup, so its empty barrier counts 4 arrivals
 * (one per warp). The gate_up tile lands on gu_full[i % 2] for CTA tile i, two barriers
 * after the ring's own (kSmemBytes + 16), so that warpgroup w waits on its own barrier for
 * its k-th tile with parity k & 1: with one barrier for both, a warpgroup that came to
 * its wait before the other's tile had landed would read that phase's parity as done.
 * Handoff w to the store warps carries warpgroup w's tiles, the k-th with parity k & 1.
 *
 * The K loops take turns (named barriers kKLoopIssued + w): a warpgroup starts waiting on
 * the ring for its tile only after the other has waited on every stage of the tile before.
 * The ring's full barriers are waited by parity, which is right only for a waiter at most
 * one phase ahead; a warpgroup that skipped ahead by a whole tile (6 rounds of the ring at
 * H = 2048) read an earlier round's completion as its own (the first GPU run hung). */
#include "kernels.h"
#include "ptx/named_barrier.cuh"
#include "sm90_gemm2_dgrad_swiglu.cuh"

namespace {

using namespace mf;
using namespace mf::sm90;
using namespace mf::sm90::dgrad2;

using Cfg = Dgrad2Cfg;
constexpr int kHalfRows = 64;   /* rows of one m64 wgmma: a tile is two halves */
constexpr int kSmemBytes = Cfg::kSmemBytes + kConsumerWarpgroups * 8;   /* + gu_full[2] */
/* Named barrier kKLoopIssued + w: warpgroup w has waited on every ring stage of its tile
 * (its 128 threads arrive, the other warpgroup's 128 wait). */
constexpr uint32_t kKLoopIssued = 1;
static_assert(kSmemBytes <= 227 * 1024, "shared memory");

/* The two gate_up full barriers, after the ring's. */
__device__ __forceinline__ uint64_t *gu_full(const Ring<Cfg> &r) {
    return r.epi_empty + kConsumerWarpgroups;
}

/* The ring's barriers with one warpgroup's 4 warps reading each stage, and the two
 * gate_up full barriers (ring_init's fence covers them). */
__device__ __forceinline__ void pingpong_ring_init(const Ring<Cfg> &r) {
    for (int wg = 0; wg < kConsumerWarpgroups; ++wg) ptx::mbar_init(&gu_full(r)[wg], 1);
    ring_init<Cfg>(r, 4);
}

/* ---- consumer warpgroup: its tiles' K loops and epilogues ---------------------------- */
struct PingPongConsumer {
    const Dgrad2Args &args;
    Ring<Cfg> ring;
    float acc[2][Cfg::kAccRegs];   /* rows 0-63 and 64-127 of the tile */
    float w[2][2];                 /* this lane's rows' p (half, h), 0 for a padding row */
    bool valid[2][2];
    float dp[2][2];

    /* Row (half, h) of this lane: 64 half + 16 warp + lane / 4 + 8 h, as in m64nN. */
    __device__ __forceinline__ int64_t row(int m_block, int half, int h) const {
        const int t = threadIdx.x % 128;
        return (int64_t)m_block * kBlockM + half * kHalfRows + (t / 32) * 16 + (t % 32) / 4 + 8 * h;
    }

    __device__ __forceinline__ void load_weights(int m_block) {
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int64_t r = row(m_block, half, h);
                const int slot = args.row_slot[r];
                valid[half][h] = slot >= 0;
                w[half][h] = !valid[half][h]       ? 0.f
                             : args.row_weight ? args.row_weight[r]
                                               : args.slot_weight[slot];
            }
    }

    /* The tile's K loop: per K block, the four k16 steps of both row halves as one group;
     * one group stays in flight, and the stage before goes back to the producer. After the
     * last stage's wait the other warpgroup may start on its tile. */
    __device__ __forceinline__ void k_loop(RingPos<Cfg> &pos, int num_k_blocks) {
        using DescA = OperandDesc<Cfg::kAMnMajor, Cfg::kMnBoxBytes>;
        using DescB = OperandDesc<Cfg::kBMnMajor, Cfg::kMnBoxBytes>;
        int prev_stage = 0;
        for (int kb = 0; kb < num_k_blocks; ++kb) {
            ptx::mbar_wait(&ring.full[pos.stage], pos.phase);
            const uint64_t db = DescB::make(ring.b(pos.stage));
            ptx::wgmma_fence_operand(acc[0]);
            ptx::wgmma_fence_operand(acc[1]);
            ptx::wgmma_fence();
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                /* K-major A: the half's 64 rows are 8 KB into the stage. */
                const uint64_t da = DescA::make(ring.a(pos.stage) + half * kHalfRows * kBlockK * 2);
#pragma unroll
                for (int k = 0; k < kBlockK / 16; ++k)
                    mma_m64<Cfg>(acc[half], da + DescA::kStepK16 * k, db + DescB::kStepK16 * k,
                                 (kb > 0 || k > 0) ? 1 : 0);
            }
            ptx::wgmma_commit();
            ptx::wgmma_wait<1>();
            ptx::wgmma_fence_operand(acc[0]);
            ptx::wgmma_fence_operand(acc[1]);
            if (kb > 0 && threadIdx.x % 32 == 0) ptx::mbar_arrive(&ring.empty[prev_stage]);
            prev_stage = pos.stage;
            pos.advance();
        }
        ptx::bar_arrive(kKLoopIssued + threadIdx.x / 128, 256);
        ptx::wgmma_wait<0>();
        ptx::wgmma_fence_operand(acc[0]);
        ptx::wgmma_fence_operand(acc[1]);
        if (num_k_blocks > 0 && threadIdx.x % 32 == 0) ptx::mbar_arrive(&ring.empty[prev_stage]);
    }

    /* The SwiGLU backward of this warpgroup's k-th tile, once its gate_up has landed and
     * the store warps are done with the warpgroup's tile before: act_p from the
     * registers, dg and du in place of g and u for the store warps, then the rows'
     * partial d p. */
    __device__ __forceinline__ void epilogue(int m_block, int n_block, uint32_t k) {
        const int t = threadIdx.x % 128, wg = threadIdx.x / 128;
        const int lane = t % 32, warp = t / 32;
        ptx::mbar_wait(&gu_full(ring)[wg], k & 1u);
        ptx::mbar_wait(&ring.epi_empty[wg], (k & 1u) ^ 1u);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            dp[half][0] = dp[half][1] = 0.f;
            uint32_t *act_p_row = reinterpret_cast<uint32_t *>(
                args.act_p + row(m_block, half, 0) * args.intermediate + n_block * Cfg::BN +
                2 * (t % 4));
#pragma unroll
            for (int c = 0; c < Cfg::BN / 8; ++c)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    /* box c / 8, row R = 64 half + 16 warp + lane / 4 + 8 h, 16-byte piece
                     * (c % 8) ^ (R % 8) with R % 8 = lane / 4, word lane % 4 */
                    const int off = (c / 8) * kGuBoxBytes +
                                    (half * kHalfRows + warp * 16 + lane / 4 + 8 * h) * 128 +
                                    (((c % 8) ^ (lane / 4)) << 4) + 4 * (lane % 4);
                    uint32_t *g2 = reinterpret_cast<uint32_t *>(ring.extra + off);
                    uint32_t *u2 = reinterpret_cast<uint32_t *>(ring.extra + kGuBytes / 2 + off);
                    swiglu_bwd_word(g2, u2, acc[half][4 * c + 2 * h], acc[half][4 * c + 2 * h + 1],
                                    w[half][h], valid[half][h], dp[half][h], act_p_row,
                                    (8 * h * args.intermediate + 8 * c) / 2);
                }
        }
        /* The gate_up tile is next written by TMA (async proxy): order these generic writes
         * before it; the store warps give it back after reading dg and du out. */
        ptx::fence_proxy_async_smem();
        ptx::mbar_arrive(&ring.epi_full[wg]);
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float sum = dp[half][h];
                sum += __shfl_xor_sync(0xffffffffu, sum, 1);
                sum += __shfl_xor_sync(0xffffffffu, sum, 2);
                if (lane % 4 == 0)
                    args.dp_partial[row(m_block, half, h) * args.dp_parts + n_block] =
                        valid[half][h] ? sum : 0.f;
            }
    }

    /* Warpgroup wg's tiles: CTA tiles wg, wg + 2, ...; the others' K blocks are skipped in
     * the ring. At each of the other warpgroup's tiles this one waits until that tile's K
     * loop has waited on all its stages, so every arrival has its wait (the last tile's
     * too) and this warpgroup's next K loop comes after the other's. */
    __device__ __forceinline__ void run(TileScheduler sched) {
        const uint32_t wg = threadIdx.x / 128;
        const int num_k_blocks = args.hidden / kBlockK;
        RingPos<Cfg> pos;
        int m_block, n_block;
        uint32_t own = 0;
        for (uint32_t tile = 0; sched.next_tile(m_block, n_block); ++tile) {
            if ((tile & 1u) != wg) {
                ptx::bar_sync(kKLoopIssued + (wg ^ 1u), 256);
                for (int kb = 0; kb < num_k_blocks; ++kb) pos.advance();
                continue;
            }
            load_weights(m_block);   /* in flight during the K loop */
            k_loop(pos, num_k_blocks);
            epilogue(m_block, n_block, own++);
        }
    }
};

/* ---- store warps: each CTA tile's 128 dg and du rows, from the warpgroup that owns the
 * tile; then the gate_up tile goes back to the producer. */
__device__ __forceinline__ void pingpong_store(const Dgrad2Args &args, const Ring<Cfg> &ring,
                                               TileScheduler sched) {
    int m_block, n_block;
    for (uint32_t tile = 0; sched.next_tile(m_block, n_block); ++tile) {
        const uint32_t wg = tile & 1u;
        ptx::mbar_wait(&ring.epi_full[wg], (tile >> 1) & 1u);
        store_dg_du_rows<kBlockM>(args, ring.extra, 0, (int64_t)m_block * kBlockM, n_block);
        ptx::mbar_arrive(&ring.epi_empty[wg]);
        ptx::mbar_arrive(ring.extra_empty);
    }
}

__global__ void __launch_bounds__(kThreads, 1)
    sm90_gemm2_dgrad_swiglu_pingpong_bwd_bf16_kernel(const __grid_constant__ Dgrad2Args args) {
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    if (ptx::smem_u32(smem_raw) & 1023u) __trap();
    const Ring<Cfg> ring = ring_from_smem<Cfg>(smem_raw);
    const TileScheduler sched(args.num_rows, args.rows_cap, args.intermediate / Cfg::BN,
                              args.hidden / kBlockK);
    if (threadIdx.x == kConsumerWarpgroups * 128) {
        pingpong_ring_init(ring);
        ptx::tma_prefetch_desc(&args.map_dys);
        ptx::tma_prefetch_desc(&args.map_w2);
    }
    __syncthreads();

    if (threadIdx.x / 128 == kConsumerWarpgroups) {
        ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
        if (threadIdx.x == kConsumerWarpgroups * 128) {
            Dgrad2Load<Cfg, 2> load{args, ring, 0, 0, 0, 0u, gu_full(ring)};
            producer_role<Cfg>(ring, sched, load);
        }
        if (threadIdx.x / 32 >= kFirstStoreWarp) pingpong_store(args, ring, sched);
    } else {
        ptx::setmaxnreg_inc<Cfg::kConsumerRegs>();
        PingPongConsumer consumer{args, ring, {}, {}, {}, {}};
        consumer.run(sched);
    }
}

}  // namespace

/* Called by mf_sm90_gemm2_dgrad_swiglu_bwd_bf16 with checked parameters. */
extern "C" cudaError_t mf_sm90_gemm2_dgrad_swiglu_pingpong_bwd_bf16(const mf_dgrad2_params *p,
                                                                    cudaStream_t stream) {
    Dgrad2Args args;
    const cudaError_t err = dgrad2_args(p, &args);
    if (err != cudaSuccess) return err;
    return launch_persistent(sm90_gemm2_dgrad_swiglu_pingpong_bwd_bf16_kernel, kSmemBytes,
                             p->num_sms, args, stream);
}

extern "C" cudaError_t mf_sm90_gemm2_dgrad_swiglu_pingpong_load(void) {
    return mf_load_kernels(sm90_gemm2_dgrad_swiglu_pingpong_bwd_bf16_kernel);
}
