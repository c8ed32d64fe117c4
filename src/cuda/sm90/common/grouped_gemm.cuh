/* Shared pieces of the sm_90a grouped (per-expert) GEMM kernels: tile shapes, the
 * shared-memory ring, the persistent tile scheduler, the TMA producer role and the
 * wgmma consumer role. gemm1 and gemm2 differ only in which boxes they load and in the
 * epilogue, passed in as functors.
 *
 * Shape of the work: C[rows, N] = A[rows, K] * B_e[N, K]^T, where the rows are sorted
 * by expert and each 128-row block belongs to one expert (row_block_expert). In the
 * forward both A and B are K-major (K contiguous), the natural wgmma "TN" layout, loaded
 * by TMA with the 128-byte swizzle in 64-element K slices.
 *
 * MN-major operands (the backward): an operand whose M or N index is contiguous in
 * memory (dgrad's B = W2_e [H, I] or W13_e [2I, H] with K = the row index; both wgrad
 * operands, whose K = the expert's rows) is loaded as boxes of 64 contiguous MN elements
 * x 64 K rows (8 KB each, the same bytes per stage as K-major) and handed to wgmma with
 * the transpose immediate set and an MN-major descriptor (ptx::make_desc_mnmajor_sw128).
 * TileConfig says which operand is which; the mainloop is the same for all kernels.
 * The K-loop length may differ per tile (wgrad: the expert's rows), even be 0.
 *
 * Threads: 3 warpgroups. Warpgroups 0 and 1 are consumers, each owning 64 rows of the
 * 128 x BN tile (accumulators in registers, BN/2 floats per thread); warpgroup 2 is the
 * producer, of which one thread issues all TMA copies.
 * NOTE: 384 threads at one CTA per SM leave 168 registers per thread at entry, 64512 in
 * all, and setmaxnreg only moves those: 2 x 128 x 232 + 128 x 40 = 64512. (A split
 * asking for more, 2 x 128 x 208 + 128 x 96 = 65536, died with "unspecified launch
 * failure" on an H200: bench/NOTES.md v9.) A TileConfig may pick another split
 * (ProducerRegs).
 * NOTE: ptxas (CUDA 13) allocates the code after setmaxnreg.inc within the new count:
 * the BN = 256 gemm2 and dgrad1 consumers use registers up to R211 (cuobjdump -sass,
 * 2026-12-03; an earlier note here said nothing passed R165). The producer's 40 binds
 * the store warps; dgrad2's, which run its SwiGLU backward, take 168 (ProducerRegs).
 *
 * Epilogue: by the store warps (TileConfig's STORE_ROW_BYTES > 0): each consumer
 * warpgroup writes its 64 output rows into its own shared-memory buffer and hands it over;
 * the producer warpgroup's three other warps read the rows back and store them with
 * whole 16-byte (or 8-byte) row pieces to where they go (rows can be scattered, as the
 * combine needs) while the consumers run the next tile's K loop (see "store warps").
 * Without store warps (fp32 wgrad) the consumers store from their registers.
 * NOTE: measured on an H200, staging in shared memory (then by the consumers themselves)
 * against storing straight from the accumulator registers (4-byte stores, 16-byte
 * pieces of 8 rows per warp instruction): qwen3-30b-a3b gemm2
 * 0.98 -> 0.81-0.87 ms, gemm1 with gate_up 1.69 -> 1.35-1.46 ms, gemm1 act-only equal
 * within noise. Per-row bulk copies (cp.async.bulk) were the other option; in SASS their
 * issue is a loop over the lanes through uniform registers. */
#pragma once

#include <cuda.h>
#include <stdint.h>

#include <type_traits>
#include <utility>

#include "check.h"
#include "sm90/ptx/mbarrier.cuh"
#include "sm90/ptx/tma.cuh"
#include "sm90/ptx/wgmma.cuh"
#include "sm90/precision.cuh"

namespace mf {
namespace sm90 {

constexpr int kBlockM = 128;
constexpr int kConsumerWarpgroups = 2;
constexpr int kThreads = (kConsumerWarpgroups + 1) * 128;
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
constexpr int kStoreWarps = 3;   /* warps 1..3 of the producer warpgroup */
constexpr int kStoreThreads = kStoreWarps * 32;
constexpr int kFirstStoreWarp = kConsumerWarpgroups * 4 + 1;

static_assert(kConsumerWarpgroups * 64 == kBlockM, "each consumer warpgroup owns 64 rows");
constexpr int kRegisterPool = kThreads * 168;   /* what a CTA holds from its launch */
static_assert(kConsumerWarpgroups * 128 * kConsumerRegs + 128 * kProducerRegs <= kRegisterPool,
              "setmaxnreg moves registers, it cannot add any");

/* ---- tile configuration ------------------------------------------------------------ */
/* P: the operands' precision (sm90/precision.cuh): a stage holds kBlockK of K, one
 * 128-byte swizzle row per row of A and B.
 * EXTRA_BYTES: shared memory of the kernel's own (a multiple of 1024, so a swizzled TMA
 * box can land there): the fused kernels' tile queue, which has its own barriers. */
/* STORE_ROW_BYTES: 0, the consumers store their rows themselves from the registers (no
 * buffers); else the store warps do, from a buffer per consumer warpgroup of 64 rows of
 * that many bytes (+16). */
template <class P, int BN_, int STAGES_, bool A_MN_MAJOR = false, bool B_MN_MAJOR = false,
          int EXTRA_BYTES = 0, int STORE_ROW_BYTES = 0>
struct TileConfig {
    using Precision = P;
    static constexpr int BN = BN_;
    static constexpr int kStages = STAGES_;
    static constexpr int kExtraBytes = EXTRA_BYTES;
    static constexpr int kStoreRowBytes = STORE_ROW_BYTES;
    static constexpr bool kStoreWarps = STORE_ROW_BYTES > 0;
    static constexpr int kProducerRegs = sm90::kProducerRegs;   /* setmaxnreg of the roles */
    static constexpr int kConsumerRegs = sm90::kConsumerRegs;
    /* +16 bytes per row: rows 4 banks apart, so the 4-byte stores of the accumulator
     * layout (8 rows x 4 words per warp) hit 32 distinct banks. */
    static constexpr int kEpiRowBytes = STORE_ROW_BYTES ? STORE_ROW_BYTES + 16 : 0;
    static constexpr int kEpiBytes = 64 * kEpiRowBytes;   /* per consumer warpgroup */
    static constexpr bool kAMnMajor = A_MN_MAJOR;   /* A stored [K, M]: M contiguous */
    static constexpr bool kBMnMajor = B_MN_MAJOR;   /* B stored [K, N]: N contiguous */
    static constexpr int kBlockK = P::kBlockK;
    static constexpr int kRowBytes = kBlockK * P::kElementBytes;   /* a K-major row's K block */
    static constexpr int kMnBoxCols = kSwizzleBytes / P::kElementBytes;   /* MN per MN-major box */
    static constexpr int kMnBoxBytes = kMnBoxCols * kBlockK * P::kElementBytes;
    static constexpr int kAccRegs = BN / 2;   /* fp32 accumulators per consumer thread */
    static constexpr int kABytes = kBlockM * kRowBytes;
    static constexpr int kBBytes = BN * kRowBytes;
    static constexpr int kAWarpgroupBytes = 64 * kRowBytes;   /* a consumer warpgroup's A rows */
    static constexpr int kStageBytes = kABytes + kBBytes;
    static constexpr int kAScaleBytes = P::kAScaleBytes;   /* per stage, after the buffers */
    static constexpr int kStageTxBytes = kStageBytes + kAScaleBytes;   /* a stage's TMA bytes */
    /* ring | extra | epilogue buffers | A scales | barriers (full, empty, epilogue full and
     * empty per consumer warpgroup); the base is 1024-aligned (checked at entry). */
    static constexpr int kSmemBytes = kStages * kStageBytes + kExtraBytes +
                                      kConsumerWarpgroups * kEpiBytes + kStages * kAScaleBytes +
                                      (2 * kStages + 2 * kConsumerWarpgroups) * 8;

    static_assert(BN == 128 || BN == 256, "wgmma wrappers exist for N = 128 and 256");
    static_assert(kRowBytes == kSwizzleBytes,
                  "a stage's K block is one 128-byte swizzle row (kBlockK * element bytes)");
    static_assert(kBlockK % P::kInstrK == 0, "a stage's K block is whole wgmma instructions");
    static_assert(P::kMnMajorOperands || !(A_MN_MAJOR || B_MN_MAJOR),
                  "this precision's wgmma takes K-major operands only (no transpose bits)");
    static_assert(!A_MN_MAJOR || kAWarpgroupBytes == kMnBoxBytes,
                  "an MN-major A's 64 rows per consumer warpgroup are one box");
    static_assert(kAScaleBytes % 128 == 0 && kEpiBytes % 128 == 0,
                  "the scale slots are TMA destinations (128-byte aligned)");
    static_assert(kExtraBytes % 1024 == 0, "the extra region starts on a swizzle atom");
    static_assert(kABytes % 1024 == 0 && kBBytes % 1024 == 0,
                  "every operand tile must start on a 1024-byte swizzle atom");
    static_assert(kSmemBytes <= 227 * 1024, "shared-memory ring exceeds the 227 KB limit");
    static_assert(kMnBoxBytes % 1024 == 0 && BN % kMnBoxCols == 0 && kBlockM % kMnBoxCols == 0,
                  "MN-major tiles are whole boxes (128 bytes of MN) of whole swizzle atoms");
    static_assert(STORE_ROW_BYTES % 128 == 0 && STORE_ROW_BYTES <= 512,
                  "store warps move rows of 8 to 32 pieces of 16 bytes");
};

/* A tile configuration whose producer warpgroup (the TMA thread and the store warps) gets
 * kRegs registers, the consumers what remains of the pool (a multiple of 8). For store
 * warps whose drain does not fit 40 (the fused forward's two drains). */
template <class Cfg, int kRegs>
struct ProducerRegs : Cfg {
    static constexpr int kProducerRegs = kRegs;
    static constexpr int kConsumerRegs = (kRegisterPool - 128 * kRegs) / (kConsumerWarpgroups * 128) / 8 * 8;
    static_assert(kRegs % 8 == 0 && kRegs >= 24 && kConsumerRegs >= 168 && kConsumerRegs <= 256,
                  "setmaxnreg takes multiples of 8 in 24..256; consumers keep their 168");
};

/* Operand descriptor of one stage and its per-instruction step (kInstrK of K) in the
 * encoded address field. K-major: +kInstrK elements inside the swizzle row (bf16: 32
 * bytes). MN-major: +kInstrK K rows of 128 bytes (bf16: 2048); the MN boxes sit
 * kMnBoxBytes apart (the descriptor's leading byte offset). `tile` is where this
 * warpgroup's rows start (A: 64 rows = kAWarpgroupBytes in both layouts). */
template <class P, bool kMnMajor, int kMnBoxBytes>
struct OperandDesc {
    static constexpr uint64_t kStepK =
        kMnMajor ? (P::kInstrK * kSwizzleBytes) >> 4 : (P::kInstrK * P::kElementBytes) >> 4;
    static __device__ __forceinline__ uint64_t make(const uint8_t *tile) {
        if constexpr (kMnMajor)
            return ptx::make_desc_mnmajor_sw128(tile, kMnBoxBytes);
        else
            return ptx::make_desc_kmajor_sw128(tile);
    }
};

/* ---- shared-memory ring ------------------------------------------------------------- */
template <class Cfg>
struct Ring {
    uint8_t *base;      /* 1024-aligned: stage s at base + s * kStageBytes, A then B */
    uint8_t *extra;     /* [kExtraBytes], 1024-aligned */
    uint8_t *epi;       /* [kConsumerWarpgroups][64][kEpiRowBytes] epilogue staging */
    uint64_t *full;     /* [kStages] TMA bytes landed */
    uint64_t *empty;    /* [kStages] consumers done reading */
    uint64_t *epi_full;      /* [kConsumerWarpgroups] buffer written (store warps only) */
    uint64_t *epi_empty;     /* [kConsumerWarpgroups] buffer stored out (store warps only) */

    __device__ __forceinline__ uint8_t *epi_buf(int wg) const {
        return epi + wg * Cfg::kEpiBytes;
    }
    __device__ __forceinline__ uint8_t *a(int s) const { return base + s * Cfg::kStageBytes; }
    __device__ __forceinline__ uint8_t *b(int s) const {
        return base + s * Cfg::kStageBytes + Cfg::kABytes;
    }
    /* Stage s's A scales (kAScaleBytes; a scaled precision's), after the epilogue buffers. */
    __device__ __forceinline__ uint8_t *a_scales(int s) const {
        return epi + kConsumerWarpgroups * Cfg::kEpiBytes + s * Cfg::kAScaleBytes;
    }
};

template <class Cfg>
__device__ __forceinline__ Ring<Cfg> ring_from_smem(uint8_t *raw) {
    Ring<Cfg> r;
    r.base = raw;
    r.extra = raw + Cfg::kStages * Cfg::kStageBytes;
    r.epi = r.extra + Cfg::kExtraBytes;
    r.full = reinterpret_cast<uint64_t *>(r.epi + kConsumerWarpgroups * Cfg::kEpiBytes +
                                          Cfg::kStages * Cfg::kAScaleBytes);
    r.empty = r.full + Cfg::kStages;
    r.epi_full = r.empty + Cfg::kStages;
    r.epi_empty = r.epi_full + kConsumerWarpgroups;
    return r;
}

/* One thread initialises; the caller syncs the CTA afterwards. */
template <class Cfg>
__device__ __forceinline__ void ring_init(const Ring<Cfg> &r) {
    for (int s = 0; s < Cfg::kStages; ++s) {
        ptx::mbar_init(&r.full[s], 1);                          /* producer's expect_tx */
        ptx::mbar_init(&r.empty[s], kConsumerWarpgroups * 4);   /* one per consumer warp */
    }
    /* Every thread that touched a buffer arrives: an arrival releases only the arriving
     * thread's own accesses (racecheck flags a lane-0 arrival after __syncwarp). */
    for (int wg = 0; wg < kConsumerWarpgroups; ++wg) {
        ptx::mbar_init(&r.epi_full[wg], 128);
        ptx::mbar_init(&r.epi_empty[wg], kStoreThreads);
    }
    ptx::mbar_fence_init();
}

/* Position in a ring of kStages stages, advanced identically by producer and consumers.
 * It depends on the stage count alone, so configurations with as many stages (the fused
 * backward's two operand layouts in one ring) share one position. */
template <int kStages>
struct RingPosition {
    int stage = 0;
    uint32_t phase = 0;
    __device__ __forceinline__ void advance() {
        if (++stage == kStages) {
            stage = 0;
            phase ^= 1u;
        }
    }
};
template <class Cfg>
using RingPos = RingPosition<Cfg::kStages>;

/* ---- persistent tile scheduler ------------------------------------------------------
 * Tiles are (128-row block, n block), n fastest: the CTAs running at the same time cover
 * a few consecutive row blocks (mostly one expert) and all of its n blocks, so each A
 * block is read from DRAM about once and the expert's weights stay in L2 while its row
 * blocks pass. The row count lives in device memory (written by the plan kernel). */
/* A scheduler gives the tiles of this CTA (next_tile) and the K-loop length of a tile
 * (num_k_blocks); producer and consumers each walk their own copy in the same order. */
struct TileScheduler {
    int num_n_blocks;
    int total;
    int next;
    int k_blocks;

    __device__ __forceinline__ TileScheduler(const int32_t *num_rows, int rows_cap,
                                             int n_blocks, int num_k_blocks) {
        int rows = *num_rows;
        rows = rows < 0 ? 0 : (rows > rows_cap ? rows_cap : rows);
        num_n_blocks = n_blocks;
        total = (rows / kBlockM) * n_blocks;
        next = blockIdx.x;
        k_blocks = num_k_blocks;
    }
    __device__ __forceinline__ int num_k_blocks(int, int) const { return k_blocks; }
    __device__ __forceinline__ bool next_tile(int &m_block, int &n_block) {
        if (next >= total) return false;
        m_block = next / num_n_blocks;
        n_block = next - m_block * num_n_blocks;
        next += gridDim.x;
        return true;
    }
};

/* The producer's load of an MN-major operand stage: kBoxes boxes of kMnBoxCols contiguous
 * MN elements (bf16: columns col, col + 64, ...) x kBlockK K rows from row, kMnBoxBytes
 * apart. */
template <class Cfg, int kBoxes>
__device__ __forceinline__ void tma_load_mn_boxes(uint8_t *dst, const CUtensorMap *map,
                                                  uint64_t *bar, int col, int row) {
#pragma unroll
    for (int j = 0; j < kBoxes; ++j)
        ptx::tma_load_2d(dst + j * Cfg::kMnBoxBytes, map, bar, col + Cfg::kMnBoxCols * j, row);
}

/* Same, each box with an L2 eviction-priority hint (ptx::l2_policy_*). */
template <class Cfg, int kBoxes>
__device__ __forceinline__ void tma_load_mn_boxes_hint(uint8_t *dst, const CUtensorMap *map,
                                                       uint64_t *bar, int col, int row,
                                                       uint64_t policy) {
#pragma unroll
    for (int j = 0; j < kBoxes; ++j)
        ptx::tma_load_2d_hint(dst + j * Cfg::kMnBoxBytes, map, bar, col + Cfg::kMnBoxCols * j,
                              row, policy);
}

/* ---- producer role ------------------------------------------------------------------
 * One thread. load.stage(k_block, smem_a, smem_b, full_bar) issues the TMA copies of one
 * stage, kStageTxBytes in total (a scaled precision's: stage(k_block, smem_a, smem_b,
 * smem_a_scales, full_bar), the A scales of the block included); load.tile_begin(m_block,
 * n_block) runs once per tile (e.g. to read the expert of the row block). */
template <class Cfg, class Sched, class Load>
__device__ __forceinline__ void producer_role(const Ring<Cfg> &ring, Sched sched, Load &load) {
    RingPos<Cfg> pos;
    int m_block, n_block;
    while (sched.next_tile(m_block, n_block)) {
        const int num_k_blocks = sched.num_k_blocks(m_block, n_block);
        load.tile_begin(m_block, n_block);
        for (int kb = 0; kb < num_k_blocks; ++kb) {
            /* A fresh barrier counts as having completed the phase before phase 0. */
            ptx::mbar_wait(&ring.empty[pos.stage], pos.phase ^ 1u);
            ptx::mbar_arrive_expect_tx(&ring.full[pos.stage], Cfg::kStageTxBytes);
            if constexpr (Cfg::kAScaleBytes > 0)
                load.stage(kb, ring.a(pos.stage), ring.b(pos.stage), ring.a_scales(pos.stage),
                           &ring.full[pos.stage]);
            else
                load.stage(kb, ring.a(pos.stage), ring.b(pos.stage), &ring.full[pos.stage]);
            pos.advance();
        }
    }
}

/* ---- consumer role ------------------------------------------------------------------
 * Each consumer warpgroup multiplies its 64-row slice of A by the whole BN-row B tile.
 * One wgmma group per K block stays in flight: after issuing block kb we wait for
 * block kb-1 and hand its stage back to the producer. epi(m_block, n_block, acc, buf)
 * runs with the finished accumulators and the warpgroup's epilogue buffer; an epilogue
 * with a prepare(m_block, n_block) gets that call before the tile's K loop, to issue the
 * global loads it will need (routing weights) while the K loop runs. */
template <class E, class = void>
struct HasPrepare {
    static constexpr bool value = false;
};
template <class E>
struct HasPrepare<E, decltype(void(std::declval<E &>().prepare(0, 0)))> {
    static constexpr bool value = true;
};

template <class Cfg>
__device__ __forceinline__ void mma_m64(float (&acc)[Cfg::kAccRegs], uint64_t da, uint64_t db,
                                        int scale_d) {
    constexpr int ta = Cfg::kAMnMajor ? 1 : 0, tb = Cfg::kBMnMajor ? 1 : 0;
    Cfg::Precision::template mma<Cfg::BN, ta, tb>(acc, da, db, scale_d);
}

/* One K block of a consumer warpgroup: wait until the stage has landed, issue its
 * kBlockK / kInstrK wgmmas (bf16: four k16) into the scale hook's accumulators (unscaled:
 * acc; kb = 0 overwrites them) and commit them as one group. */
template <class Cfg, class Scale>
__device__ __forceinline__ void issue_k_block(const Ring<Cfg> &ring, const RingPos<Cfg> &pos,
                                              float (&acc)[Cfg::kAccRegs], int kb,
                                              Scale &scale) {
    using P = typename Cfg::Precision;
    using DescA = OperandDesc<P, Cfg::kAMnMajor, Cfg::kMnBoxBytes>;
    using DescB = OperandDesc<P, Cfg::kBMnMajor, Cfg::kMnBoxBytes>;
    const int wg = threadIdx.x / 128;
    ptx::mbar_wait(&ring.full[pos.stage], pos.phase);
    /* NOTE: this warpgroup's 64 rows of A are kAWarpgroupBytes (bf16: 8 KB) into the stage
     * in both layouts (64 rows x 128 B K-major; the second 64-element box MN-major). */
    const uint64_t da = DescA::make(ring.a(pos.stage) + wg * Cfg::kAWarpgroupBytes);
    const uint64_t db = DescB::make(ring.b(pos.stage));
    float(&d)[Cfg::kAccRegs] = scale.mma_acc(acc);
    ptx::wgmma_fence_operand(d);
    ptx::wgmma_fence();
#pragma unroll
    for (int k = 0; k < Cfg::kBlockK / P::kInstrK; ++k)
        mma_m64<Cfg>(d, da + DescA::kStepK * k, db + DescB::kStepK * k, scale.accumulate(kb, k));
    ptx::wgmma_commit();
}

/* After issuing block kb: wait until kGroupsInFlight groups are pending (unscaled: block
 * kb-1 done, block kb's in flight), let the scale hook promote what completed, and hand
 * block kb-1's stage back to the producer. */
template <class Cfg, class Scale>
__device__ __forceinline__ void retire_k_block(const Ring<Cfg> &ring, RingPos<Cfg> &pos,
                                               float (&acc)[Cfg::kAccRegs], int kb,
                                               int &prev_stage, Scale &scale) {
    ptx::wgmma_wait<Scale::kGroupsInFlight>();
    ptx::wgmma_fence_operand(scale.mma_acc(acc));
    scale.after_k_block(acc, ring.a_scales(pos.stage), kb);
    if (kb > 0 && threadIdx.x % 32 == 0) ptx::mbar_arrive(&ring.empty[prev_stage]);
    prev_stage = pos.stage;
    pos.advance();
}

/* After the K loop: wait for the last block and hand its stage back; an empty K range
 * (an expert without rows) leaves C = 0. */
template <class Cfg>
__device__ __forceinline__ void end_k_loop(const Ring<Cfg> &ring, float (&acc)[Cfg::kAccRegs],
                                           int num_k_blocks, int prev_stage) {
    ptx::wgmma_wait<0>();
    ptx::wgmma_fence_operand(acc);
    if (num_k_blocks > 0 && threadIdx.x % 32 == 0) ptx::mbar_arrive(&ring.empty[prev_stage]);
    if (num_k_blocks == 0) {
#pragma unroll
        for (int i = 0; i < Cfg::kAccRegs; ++i) acc[i] = 0.f;
    }
}

/* A tile's whole K loop from ring position pos (advanced past it) into acc, with the
 * precision's per-K-block scale hook (a scaled precision's kernel passes its own, which
 * loaded the tile's B scales first). */
template <class Cfg, class Scale>
__device__ __forceinline__ void k_loop(const Ring<Cfg> &ring, RingPos<Cfg> &pos,
                                       float (&acc)[Cfg::kAccRegs], int num_k_blocks,
                                       Scale &scale) {
    int prev_stage = 0;
    for (int kb = 0; kb < num_k_blocks; ++kb) {
        issue_k_block<Cfg>(ring, pos, acc, kb, scale);
        retire_k_block<Cfg>(ring, pos, acc, kb, prev_stage, scale);
    }
    end_k_loop<Cfg>(ring, acc, num_k_blocks, prev_stage);
}

/* The same for a precision whose hook has no data (bf16: none at all). */
template <class Cfg>
__device__ __forceinline__ void k_loop(const Ring<Cfg> &ring, RingPos<Cfg> &pos,
                                       float (&acc)[Cfg::kAccRegs], int num_k_blocks) {
    typename Cfg::Precision::BlockScale scale;
    k_loop<Cfg>(ring, pos, acc, num_k_blocks, scale);
}

/* tile_k_loop(m_block, n_block, pos, acc, num_k_blocks) runs each tile's K loop: k_loop on
 * this ring, or (the fused backward) one of two operand layouts chosen per tile; a scaled
 * precision's kernel loads the tile's B scales there (its BlockScale) first. */
template <class Cfg, class Sched, class Epi, class TileKLoop>
__device__ __forceinline__ void consumer_role(const Ring<Cfg> &ring, Sched sched, Epi &epi,
                                              TileKLoop &&tile_k_loop) {
    const int wg = threadIdx.x / 128;
    float acc[Cfg::kAccRegs];
#pragma unroll
    for (int i = 0; i < Cfg::kAccRegs; ++i) acc[i] = 0.f;

    RingPos<Cfg> pos;
    int m_block, n_block;
    while (sched.next_tile(m_block, n_block)) {
        const int num_k_blocks = sched.num_k_blocks(m_block, n_block);
        if constexpr (HasPrepare<Epi>::value) epi.prepare(m_block, n_block);
        tile_k_loop(m_block, n_block, pos, acc, num_k_blocks);
        epi(m_block, n_block, acc, ring.epi_buf(wg));
    }
}

template <class Cfg, class Sched, class Epi>
__device__ __forceinline__ void consumer_role(const Ring<Cfg> &ring, Sched sched, Epi &epi) {
    consumer_role<Cfg>(ring, sched, epi,
                       [&](int, int, RingPos<Cfg> &pos, float (&acc)[Cfg::kAccRegs],
                           int k_blocks) {
                           k_loop<Cfg>(ring, pos, acc, k_blocks);
                       });
}

/* ---- store warps ---------------------------------------------------------------------
 * The epilogue split in two so that its global stores overlap the next tile's K loop:
 *  - a consumer warpgroup waits until its buffer is empty (StoreHandoff::acquire), writes
 *    its 64 rows there (epi_write_bf16, and whatever else the kernel stages), and hands
 *    the buffer over (release: every thread arrives, ordering its shared-memory writes);
 *  - the store warps (warps 1..3 of the producer warpgroup, 40 registers) walk the same
 *    tiles, wait for each warpgroup's buffer, store it out (the epilogue's drain(m_block,
 *    n_block, wg, buf)) and release it (every store-warp thread arrives).
 * NOTE: measured on an H200 (qwen3-30b-a3b, 131072 rows, before this existed): without
 * any epilogue gemm2 ran in 0.58 ms instead of 0.95 and dgrad2 in 0.66 ms instead of
 * 1.26; most of the difference was the stores and the routing-weight loads, which the
 * consumers waited for before starting the next tile. With store warps: gemm2 0.69 ms,
 * dgrad1 1.35 -> 1.17 ms, dgrad2 1.13 ms. dgrad2's store warps run its whole SwiGLU
 * backward (bench/NOTES.md v22; v7 tried it with 3x the instructions per element). */
struct StoreHandoff {
    uint32_t phase = 0;

    template <class Cfg>
    __device__ __forceinline__ void acquire(const Ring<Cfg> &ring, int wg) {
        /* A fresh barrier counts as having completed the phase before phase 0. */
        ptx::mbar_wait(&ring.epi_empty[wg], phase ^ 1u);
        phase ^= 1u;
    }
    template <class Cfg>
    __device__ __forceinline__ void release(const Ring<Cfg> &ring, int wg) {
        ptx::mbar_arrive(&ring.epi_full[wg]);
    }
    /* The consumer side in one call: wait for the buffer, write(buf), hand it over.
     * kBulkDrain: the drain reads buf by bulk copies (drain_rows_bf16, the async proxy),
     * so the writes are fenced into that proxy first; false for a drain that reads buf
     * by generic loads only (gemm1's, dgrad2's). */
    template <bool kBulkDrain = true, class Cfg, class Write>
    __device__ __forceinline__ void stage(const Ring<Cfg> &ring, uint8_t *buf, Write &&write) {
        const int wg = threadIdx.x / 128;
        acquire(ring, wg);
        write(buf);
        if constexpr (kBulkDrain) ptx::fence_proxy_async_smem();
        release(ring, wg);
    }
};

/* Consumer side: the warpgroup's 64 rows x BN bf16 into the buffer, which holds the whole
 * tile's width; epi_write_piece writes one 4-byte piece. pack(c, h) gives the two bf16 of
 * column group c (columns 8c + 2(lane%4) + {0,1}) of row 16*warp + lane/4 + 8h, as in the
 * m64nN accumulator layout.
 * NOTE: rows are kEpiRowBytes = 16 (mod 128) apart, so the 8 rows of one warp's 4-byte
 * writes land on 8 distinct groups of 4 banks. */
template <class Cfg>
__device__ __forceinline__ void epi_write_piece(uint8_t *buf, int c, int h, uint32_t bf16x2) {
    const int t = threadIdx.x % 128;
    const int warp = t / 32, lane = t % 32;
    uint8_t *my_row = buf + (warp * 16 + lane / 4) * Cfg::kEpiRowBytes + (lane % 4) * 4;
    *reinterpret_cast<uint32_t *>(my_row + h * 8 * Cfg::kEpiRowBytes + c * 16) = bf16x2;
}

template <class Cfg, class Pack>
__device__ __forceinline__ void epi_write_bf16(uint8_t *buf, Pack &&pack) {
    static_assert(Cfg::kStoreRowBytes == Cfg::BN * 2, "the buffer holds the tile's rows");
#pragma unroll
    for (int c = 0; c < Cfg::BN / 8; ++c)
#pragma unroll
        for (int h = 0; h < 2; ++h) epi_write_piece<Cfg>(buf, c, h, pack(c, h));
}

/* Store-warp side: the buffer's 64 rows of BN bf16, each to dst(r) (16-byte aligned;
 * nullptr drops the row). Each row leaves as one bulk copy (cp.async.bulk, the TMA
 * engine), row r issued by lane r / kStoreWarps of store warp r % kStoreWarps. The thread
 * waits until its copy has read the buffer (the caller then hands the buffer back), not
 * for the global writes: store_role waits for those before the CTA ends. The consumers'
 * writes reach the async proxy through the fence in StoreHandoff::stage.
 * NOTE: ptxas loops over the lanes for the copies (UBLKCP takes uniform registers, ~9
 * instructions a row), still fewer than the 16-byte loads and stores of three warps this
 * replaced; on an H200 gemm2 and the bf16 wgrad ran 1-6% faster, the sustained step 0.3%
 * (bench/NOTES.md v26). */
template <class Cfg, class Dst>
__device__ __forceinline__ void drain_rows_bf16(const uint8_t *buf, Dst &&dst) {
    static_assert(Cfg::kStoreRowBytes == Cfg::BN * 2, "the buffer holds the tile's rows");
    static_assert(kStoreWarps * 32 >= 64, "a row per store-warp lane at most");
    const int sw = threadIdx.x / 32 - kFirstStoreWarp, lane = threadIdx.x % 32;
    const int r = sw + kStoreWarps * lane;
    if (r < 64) {
        void *d = dst(r);
        if (d) ptx::bulk_store_s2g(d, buf + r * Cfg::kEpiRowBytes, Cfg::BN * 2);
    }
    ptx::bulk_commit();
    ptx::bulk_wait_read_all();
}

/* An epilogue with work of its own for the store warps (`bool idle_work()`: one small
 * piece, false when none is left), done while the consumers' next buffer is not ready
 * yet and after the last tile. */
template <class E, class = void>
struct HasIdleWork {
    static constexpr bool value = false;
};
template <class E>
struct HasIdleWork<E, decltype(void(&E::idle_work))> {
    static constexpr bool value = true;
};

/* An epilogue some of whose tiles the consumers store themselves (`bool drains(m_block,
 * n_block)`: false for those; the fused backward's fp32 weight-gradient tiles). */
template <class E, class = void>
struct HasDrains {
    static constexpr bool value = false;
};
template <class E>
struct HasDrains<E, decltype(void(std::declval<E &>().drains(0, 0)))> {
    static constexpr bool value = true;
};

/* The store warps' loop over this CTA's tiles (the same walk as the consumers'). */
template <class Cfg, class Sched, class Epi>
__device__ __forceinline__ void store_role(const Ring<Cfg> &ring, Sched sched, Epi &epi) {
    uint32_t phase = 0;
    int m_block, n_block;
    while (sched.next_tile(m_block, n_block)) {
        if constexpr (HasDrains<Epi>::value)
            if (!epi.drains(m_block, n_block)) continue;
#pragma unroll 1
        for (int wg = 0; wg < kConsumerWarpgroups; ++wg) {
            if constexpr (HasIdleWork<Epi>::value)
                while (!ptx::mbar_test_wait(&ring.epi_full[wg], phase) && epi.idle_work()) {}
            ptx::mbar_wait(&ring.epi_full[wg], phase);
            epi.drain(m_block, n_block, wg, ring.epi_buf(wg));
            ptx::mbar_arrive(&ring.epi_empty[wg]);
        }
        phase ^= 1u;
    }
    if constexpr (HasIdleWork<Epi>::value)
        while (epi.idle_work()) {}
    ptx::bulk_wait_all();   /* drain_rows_bf16's bulk copies written out before the CTA ends */
}

/* ---- kernel skeleton ----------------------------------------------------------------
 * Role split shared by all kernels: barrier setup, setmaxnreg, then one role per
 * warpgroup; the consumers run consume(ring, sched, epi). Must be called from a
 * __launch_bounds__(kThreads, 1) kernel. */
template <class Cfg, class Sched, class Load, class Epi, class Consume>
__device__ __forceinline__ void run_grouped_gemm_roles(uint8_t *smem_raw,
                                                       const CUtensorMap *map_a,
                                                       const CUtensorMap *map_b,
                                                       const Sched &sched, Load &load,
                                                       Epi &epi, Consume &&consume) {
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

    if (wg == kConsumerWarpgroups) {
        ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
        if (threadIdx.x == kConsumerWarpgroups * 128) producer_role<Cfg>(ring, sched, load);
        if constexpr (Cfg::kStoreWarps)
            if (threadIdx.x / 32 >= kFirstStoreWarp) store_role<Cfg>(ring, sched, epi);
    } else {
        ptx::setmaxnreg_inc<Cfg::kConsumerRegs>();
        consume(ring, sched, epi);
    }
}

/* The kernels with one operand layout. */
template <class Cfg, class Sched, class Load, class Epi>
__device__ __forceinline__ void run_grouped_gemm_sched(uint8_t *smem_raw,
                                                       const CUtensorMap *map_a,
                                                       const CUtensorMap *map_b,
                                                       const Sched &sched, Load &load,
                                                       Epi &epi) {
    run_grouped_gemm_roles<Cfg>(smem_raw, map_a, map_b, sched, load, epi,
                                [](const Ring<Cfg> &ring, const Sched &s, Epi &e) {
                                    consumer_role<Cfg>(ring, s, e);
                                });
}

/* Row-block GEMMs (gemm1, gemm2, dgrad1, dgrad2): tiles (128-row block, n block), a
 * fixed K loop. */
template <class Cfg, class Load, class Epi>
__device__ __forceinline__ void run_grouped_gemm(uint8_t *smem_raw, const CUtensorMap *map_a,
                                                 const CUtensorMap *map_b,
                                                 const int32_t *num_rows, int rows_cap,
                                                 int n_blocks, int num_k_blocks, Load &load,
                                                 Epi &epi) {
    const TileScheduler sched(num_rows, rows_cap, n_blocks, num_k_blocks);
    run_grouped_gemm_sched<Cfg>(smem_raw, map_a, map_b, sched, load, epi);
}

/* ---- shared epilogue: scatter rows to their slots -------------------------------------
 * Each row with row_slot[r] >= 0 goes to one slot row of a combine buffer, scaled by w:
 *   dst = combine + slot * ld                      (one rank: row_slot[r] = slot)
 *   dst = combine_peers[v % R] + (v / R) * ld      (expert parallelism, v = row_slot[r]
 *                                                  = slot * R + source rank)
 *   w   = row_weight[r], or 1 without row weights (dgrad1)
 * Rows with row_slot -1 are not written. Chunks of 128 columns. */
__device__ __forceinline__ uint32_t pack_bf16x2_rn(float lo, float hi) {
    uint32_t v;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(v) : "f"(hi), "f"(lo));
    return v;
}

/* The accumulators as they are, rounded to bf16, into a store buffer (gemm1's [g | u],
 * the bf16 weight gradients). */
template <class Cfg>
__device__ __forceinline__ void epi_write_acc_bf16(uint8_t *buf, float (&acc)[Cfg::kAccRegs]) {
    epi_write_bf16<Cfg>(buf, [&](int c, int h) {
        return pack_bf16x2_rn(acc[4 * c + 2 * h], acc[4 * c + 2 * h + 1]);
    });
}

struct ScatterTarget {
    const int32_t *row_slot;       /* [rows_cap] */
    const float *row_weight;       /* [rows_cap] or null (weight 1) */
    uint16_t *combine;             /* one rank */
    uint16_t *const *combine_peers;/* [R] or null (takes precedence) */
    int num_ranks;
    int ld;

    __device__ __forceinline__ float weight(int64_t r) const {
        return row_weight ? row_weight[r] : 1.f;
    }
    __device__ __forceinline__ uint16_t *row_ptr(int64_t r) const {
        const int v = row_slot[r];
        if (v < 0) return nullptr;
        if (!combine_peers) return combine + (int64_t)v * ld;
        return combine_peers[v % num_ranks] + (int64_t)(v / num_ranks) * ld;
    }
};

/* The epilogue of gemm2 and dgrad1: each row of the tile, scaled by its weight, to its
 * slot (ScatterTarget). The weights are loaded before the K loop; the consumers write the
 * scaled tile into their buffers and the store warps store the rows. */
template <class Cfg>
struct ScatterRowsEpilogue {
    const ScatterTarget &to;
    Ring<Cfg> ring;
    StoreHandoff handoff;
    float w[2];   /* the weights of this lane's two rows */

    __device__ __forceinline__ int64_t first_row(int m_block, int wg) const {
        return (int64_t)m_block * kBlockM + wg * 64;
    }
    /* Before the K loop: the weights of this lane's rows (16 * warp + lane / 4 + 8h). */
    __device__ __forceinline__ void prepare(int m_block, int) {
        const int t = threadIdx.x % 128;
        const int64_t row0 = first_row(m_block, threadIdx.x / 128);
#pragma unroll
        for (int h = 0; h < 2; ++h) w[h] = to.weight(row0 + (t / 32) * 16 + (t % 32) / 4 + 8 * h);
    }

    /* The scaled rows into the buffer, which the caller holds (StoreHandoff). */
    __device__ __forceinline__ void write_rows(float (&acc)[Cfg::kAccRegs], uint8_t *buf) {
        epi_write_bf16<Cfg>(buf, [&](int c, int h) {
            return pack_bf16x2_rn(w[h] * acc[4 * c + 2 * h], w[h] * acc[4 * c + 2 * h + 1]);
        });
    }
    __device__ __forceinline__ void operator()(int, int, float (&acc)[Cfg::kAccRegs],
                                               uint8_t *buf) {
        handoff.stage(ring, buf, [&](uint8_t *b) { write_rows(acc, b); });
    }

    /* Store warps: the rows of warpgroup wg to their slots. */
    __device__ __forceinline__ void drain(int m_block, int n_block, int wg, const uint8_t *buf) {
        const int64_t row0 = first_row(m_block, wg);
        drain_rows_bf16<Cfg>(buf, [&](int r) -> uint16_t * {
            uint16_t *row = to.row_ptr(row0 + r);
            return row ? row + n_block * Cfg::BN : nullptr;
        });
    }
};

/* ---- host side: what every launcher of these kernels does -------------------------- */

/* TMA sources and the 16-byte epilogue stores need 16-byte aligned bases (NULL passes). */
template <class... T>
inline bool misaligned16(const T *...ptrs) {
    return ((reinterpret_cast<uintptr_t>(ptrs) & 15u) | ...) != 0;
}

/* Raises the kernel's dynamic shared-memory limit and launches the persistent grid. */
template <class Args>
inline cudaError_t launch_persistent(void (*kernel)(Args), size_t smem_bytes, int num_ctas,
                                     const Args &args, cudaStream_t stream) {
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           (int)smem_bytes);
    if (err != cudaSuccess) return err;
    kernel<<<num_ctas, kThreads, smem_bytes, stream>>>(args);
    return cudaGetLastError();
}

}  // namespace sm90
}  // namespace mf
