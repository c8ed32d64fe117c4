/* Shared pieces of the sm_90a grouped (per-expert) GEMM kernels: tile shapes, the
 * shared-memory ring, the persistent tile scheduler, the TMA producer role and the
 * wgmma consumer role. gemm1 and gemm2 differ only in which boxes they load and in the
 * epilogue, passed in as functors.
 *
 * Shape of the work: C[rows, N] = A[rows, K] * B_e[N, K]^T, where the rows are sorted
 * by expert and each 128-row block belongs to one expert (row_block_expert). Both A and
 * B are K-major (K contiguous), the natural wgmma "TN" layout, loaded by TMA with the
 * 128-byte swizzle in 64-element K slices.
 *
 * Threads: 3 warpgroups. Warpgroups 0 and 1 are consumers, each owning 64 rows of the
 * 128 x BN tile (accumulators in registers, BN/2 floats per thread); warpgroup 2 is the
 * producer, of which one thread issues all TMA copies.
 * NOTE: 384 threads at one CTA per SM leave 168 registers per thread at entry; setmaxnreg
 * moves them to the consumers: 2 x 128 x 232 + 128 x 40 = 64512 <= 65536.
 *
 * Epilogue: each consumer warpgroup writes its 64 output rows, in chunks of up to 128
 * bf16 columns, into its own shared-memory buffer, then reads them back as whole rows,
 * 16 bytes per thread, and stores each row with fully coalesced 16-byte stores to where
 * it goes (rows can be scattered, as the combine needs). The stores drain while the
 * warpgroup runs the next tile's K loop.
 * NOTE: measured on an H200 against storing straight from the accumulator registers
 * (4-byte stores, 16-byte pieces of 8 rows per warp instruction): qwen3-30b-a3b gemm2
 * 0.98 -> 0.81-0.87 ms, gemm1 with gate_up 1.69 -> 1.35-1.46 ms, gemm1 act-only equal
 * within noise. Per-row bulk copies (cp.async.bulk) were the other option; in SASS their
 * issue is a loop over the lanes through uniform registers. */
#pragma once

#include <cuda.h>
#include <stdint.h>

#include "ptx/mbarrier.cuh"
#include "ptx/tma.cuh"
#include "ptx/wgmma.cuh"

namespace mf {
namespace sm90 {

constexpr int kBlockM = 128;
constexpr int kBlockK = 64;             /* one 128-byte swizzle row of bf16 */
constexpr int kConsumerWarpgroups = 2;
constexpr int kThreads = (kConsumerWarpgroups + 1) * 128;
constexpr int kProducerRegs = 40;
constexpr int kEpiMaxCols = 128;                      /* bf16 columns per epilogue chunk */
constexpr int kEpiRowBytes = kEpiMaxCols * 2 + 16;    /* +16: conflict-free 4-byte stores */
constexpr int kEpiBytes = 64 * kEpiRowBytes;          /* per consumer warpgroup */
constexpr int kConsumerRegs = 232;

static_assert(kConsumerWarpgroups * 64 == kBlockM, "each consumer warpgroup owns 64 rows");
static_assert(kConsumerWarpgroups * 128 * kConsumerRegs + 128 * kProducerRegs <= 65536,
              "register budget after setmaxnreg exceeds the register file");

/* ---- tile configuration ------------------------------------------------------------ */
template <int BN_, int STAGES_>
struct TileConfig {
    static constexpr int BN = BN_;
    static constexpr int kStages = STAGES_;
    static constexpr int kAccRegs = BN / 2;   /* fp32 accumulators per consumer thread */
    static constexpr int kABytes = kBlockM * kBlockK * 2;
    static constexpr int kBBytes = BN * kBlockK * 2;
    static constexpr int kStageBytes = kABytes + kBBytes;
    /* ring | epilogue buffers | barriers; the base is 1024-aligned (checked at entry). */
    static constexpr int kSmemBytes =
        kStages * kStageBytes + kConsumerWarpgroups * kEpiBytes + 2 * kStages * 8;

    static_assert(BN == 128 || BN == 256, "wgmma wrappers exist for N = 128 and 256");
    static_assert(kABytes % 1024 == 0 && kBBytes % 1024 == 0,
                  "every operand tile must start on a 1024-byte swizzle atom");
    static_assert(kSmemBytes <= 227 * 1024, "shared-memory ring exceeds the 227 KB limit");
};

/* ---- shared-memory ring ------------------------------------------------------------- */
template <class Cfg>
struct Ring {
    uint8_t *base;      /* 1024-aligned: stage s at base + s * kStageBytes, A then B */
    uint8_t *epi;       /* [kConsumerWarpgroups][64][kEpiRowBytes] epilogue staging */
    uint64_t *full;     /* [kStages] TMA bytes landed */
    uint64_t *empty;    /* [kStages] consumers done reading */

    __device__ __forceinline__ uint8_t *epi_buf(int wg) const { return epi + wg * kEpiBytes; }
    __device__ __forceinline__ uint8_t *a(int s) const { return base + s * Cfg::kStageBytes; }
    __device__ __forceinline__ uint8_t *b(int s) const {
        return base + s * Cfg::kStageBytes + Cfg::kABytes;
    }
};

template <class Cfg>
__device__ __forceinline__ Ring<Cfg> ring_from_smem(uint8_t *raw) {
    Ring<Cfg> r;
    r.base = raw;
    r.epi = raw + Cfg::kStages * Cfg::kStageBytes;
    r.full = reinterpret_cast<uint64_t *>(r.epi + kConsumerWarpgroups * kEpiBytes);
    r.empty = r.full + Cfg::kStages;
    return r;
}

/* One thread initialises; the caller syncs the CTA afterwards. */
template <class Cfg>
__device__ __forceinline__ void ring_init(const Ring<Cfg> &r) {
    for (int s = 0; s < Cfg::kStages; ++s) {
        ptx::mbar_init(&r.full[s], 1);                          /* producer's expect_tx */
        ptx::mbar_init(&r.empty[s], kConsumerWarpgroups * 4);   /* one per consumer warp */
    }
    ptx::mbar_fence_init();
}

/* Position in the ring, advanced identically by producer and consumers. */
template <class Cfg>
struct RingPos {
    int stage = 0;
    uint32_t phase = 0;
    __device__ __forceinline__ void advance() {
        if (++stage == Cfg::kStages) {
            stage = 0;
            phase ^= 1u;
        }
    }
};

/* ---- persistent tile scheduler ------------------------------------------------------
 * Tiles are (128-row block, n block), n fastest: the CTAs running at the same time cover
 * a few consecutive row blocks (mostly one expert) and all of its n blocks, so each A
 * block is read from DRAM about once and the expert's weights stay in L2 while its row
 * blocks pass. The row count lives in device memory (written by the plan kernel). */
struct TileScheduler {
    int num_n_blocks;
    int total;
    int next;

    __device__ __forceinline__ TileScheduler(const int32_t *num_rows, int rows_cap,
                                             int n_blocks) {
        int rows = *num_rows;
        rows = rows < 0 ? 0 : (rows > rows_cap ? rows_cap : rows);
        num_n_blocks = n_blocks;
        total = (rows / kBlockM) * n_blocks;
        next = blockIdx.x;
    }
    __device__ __forceinline__ bool next_tile(int &m_block, int &n_block) {
        if (next >= total) return false;
        m_block = next / num_n_blocks;
        n_block = next - m_block * num_n_blocks;
        next += gridDim.x;
        return true;
    }
};

/* ---- producer role ------------------------------------------------------------------
 * One thread. load(m_block, n_block, k_block, smem_a, smem_b, full_bar) issues the TMA
 * copies of one stage, kStageBytes in total; load_tile_begin(m_block) runs once per tile
 * (e.g. to read the expert of the row block). */
template <class Cfg, class Load>
__device__ __forceinline__ void producer_role(const Ring<Cfg> &ring, TileScheduler sched,
                                              int num_k_blocks, Load &load) {
    RingPos<Cfg> pos;
    int m_block, n_block;
    while (sched.next_tile(m_block, n_block)) {
        load.tile_begin(m_block, n_block);
        for (int kb = 0; kb < num_k_blocks; ++kb) {
            /* A fresh barrier counts as having completed the phase before phase 0. */
            ptx::mbar_wait(&ring.empty[pos.stage], pos.phase ^ 1u);
            ptx::mbar_arrive_expect_tx(&ring.full[pos.stage], Cfg::kStageBytes);
            load.stage(kb, ring.a(pos.stage), ring.b(pos.stage), &ring.full[pos.stage]);
            pos.advance();
        }
    }
}

/* ---- consumer role ------------------------------------------------------------------
 * Each consumer warpgroup multiplies its 64-row slice of A by the whole BN-row B tile.
 * One wgmma group per K block stays in flight: after issuing block kb we wait for
 * block kb-1 and hand its stage back to the producer. epi(m_block, n_block, acc, buf)
 * runs with the finished accumulators and the warpgroup's epilogue buffer. */
template <class Cfg>
__device__ __forceinline__ void mma_m64(float (&acc)[Cfg::kAccRegs], uint64_t da, uint64_t db,
                                        int scale_d) {
    if constexpr (Cfg::BN == 256)
        ptx::wgmma_m64n256k16_bf16_ss(acc, da, db, scale_d);
    else
        ptx::wgmma_m64n128k16_bf16_ss(acc, da, db, scale_d);
}

template <class Cfg, class Epi>
__device__ __forceinline__ void consumer_role(const Ring<Cfg> &ring, TileScheduler sched,
                                              int num_k_blocks, Epi &epi) {
    const int wg = threadIdx.x / 128;
    const int lane = threadIdx.x % 32;
    float acc[Cfg::kAccRegs];
#pragma unroll
    for (int i = 0; i < Cfg::kAccRegs; ++i) acc[i] = 0.f;

    RingPos<Cfg> pos;
    int m_block, n_block;
    while (sched.next_tile(m_block, n_block)) {
        int prev_stage = 0;
        for (int kb = 0; kb < num_k_blocks; ++kb) {
            ptx::mbar_wait(&ring.full[pos.stage], pos.phase);
            /* NOTE: +32 bytes per k16 step inside the swizzle atom; 64 rows x 128 B per
             * consumer warpgroup in A. */
            const uint64_t da =
                ptx::make_desc_kmajor_sw128(ring.a(pos.stage) + wg * 64 * kBlockK * 2);
            const uint64_t db = ptx::make_desc_kmajor_sw128(ring.b(pos.stage));
            ptx::wgmma_fence_operand(acc);
            ptx::wgmma_fence();
#pragma unroll
            for (int k = 0; k < kBlockK / 16; ++k)
                mma_m64<Cfg>(acc, da + 2 * k, db + 2 * k, (kb > 0 || k > 0) ? 1 : 0);
            ptx::wgmma_commit();
            ptx::wgmma_wait<1>();
            ptx::wgmma_fence_operand(acc);
            if (kb > 0 && lane == 0) ptx::mbar_arrive(&ring.empty[prev_stage]);
            prev_stage = pos.stage;
            pos.advance();
        }
        ptx::wgmma_wait<0>();
        ptx::wgmma_fence_operand(acc);
        if (num_k_blocks > 0 && lane == 0) ptx::mbar_arrive(&ring.empty[prev_stage]);
        epi(m_block, n_block, acc, ring.epi_buf(wg));
    }
}

/* ---- staged epilogue ----------------------------------------------------------------
 * Called by all 128 threads of a consumer warpgroup. pack(c, h) gives the two bf16 of
 * column group c (columns 8c + 2(lane%4) + {0,1}) of row 16*warp + lane/4 + 8h, as in the
 * m64nN accumulator layout; dst(r) gives where row r (0..63) of the chunk goes (16-byte
 * aligned), or nullptr to drop it. */
template <int kCols, class Pack, class Dst>
__device__ __forceinline__ void epi_store_chunk(uint8_t *buf, Pack &&pack, Dst &&dst) {
    static_assert(kCols % 8 == 0 && kCols <= kEpiMaxCols, "chunk must fit the buffer rows");
    constexpr int kVecs = kCols * 2 / 16;        /* 16-byte pieces per row */
    constexpr int kRowsPerPass = 128 / kVecs;
    static_assert(128 % kVecs == 0 && 64 % kRowsPerPass == 0, "rows must split evenly");
    const int t = threadIdx.x % 128, wg = threadIdx.x / 128;
    const int warp = t / 32, lane = t % 32;
    const uint32_t bar_id = 1 + wg;

    /* Everyone is done reading the buffer (previous chunk) before it is overwritten. */
    ptx::named_barrier_sync(bar_id, 128);
    /* NOTE: rows are 272 bytes apart (68 words), so the 8 rows of one warp store land on
     * 8 distinct groups of 4 banks. */
    uint8_t *my_row = buf + (warp * 16 + lane / 4) * kEpiRowBytes + (lane % 4) * 4;
#pragma unroll
    for (int c = 0; c < kCols / 8; ++c)
#pragma unroll
        for (int h = 0; h < 2; ++h)
            *reinterpret_cast<uint32_t *>(my_row + h * 8 * kEpiRowBytes + c * 16) = pack(c, h);
    ptx::named_barrier_sync(bar_id, 128);

    const int v = t % kVecs;
#pragma unroll
    for (int r0 = 0; r0 < 64; r0 += kRowsPerPass) {
        const int r = r0 + t / kVecs;
        uint4 *d = reinterpret_cast<uint4 *>(dst(r));
        if (d) d[v] = *reinterpret_cast<const uint4 *>(buf + r * kEpiRowBytes + v * 16);
    }
}

/* ---- kernel skeleton ----------------------------------------------------------------
 * Role split shared by both kernels: barrier setup, setmaxnreg, then one role per
 * warpgroup. Must be called from a __launch_bounds__(kThreads, 1) kernel. */
template <class Cfg, class Load, class Epi>
__device__ __forceinline__ void run_grouped_gemm(uint8_t *smem_raw, const CUtensorMap *map_a,
                                                 const CUtensorMap *map_b,
                                                 const int32_t *num_rows, int rows_cap,
                                                 int n_blocks, int num_k_blocks, Load &load,
                                                 Epi &epi) {
    /* NOTE: the swizzled TMA tiles need 1024-byte alignment; a dynamic buffer declared
     * __align__(1024) with no static shared memory starts there, and we check. */
    if (ptx::smem_u32(smem_raw) & 1023u) __trap();
    const Ring<Cfg> ring = ring_from_smem<Cfg>(smem_raw);
    const int wg = threadIdx.x / 128;
    if (threadIdx.x == kConsumerWarpgroups * 128) {
        ring_init<Cfg>(ring);
        ptx::tma_prefetch_desc(map_a);
        ptx::tma_prefetch_desc(map_b);
    }
    __syncthreads();

    const TileScheduler sched(num_rows, rows_cap, n_blocks);
    if (wg == kConsumerWarpgroups) {
        ptx::setmaxnreg_dec<kProducerRegs>();
        if (threadIdx.x == kConsumerWarpgroups * 128) producer_role<Cfg>(ring, sched, num_k_blocks, load);
    } else {
        ptx::setmaxnreg_inc<kConsumerRegs>();
        consumer_role<Cfg>(ring, sched, num_k_blocks, epi);
    }
}

}  // namespace sm90
}  // namespace mf
