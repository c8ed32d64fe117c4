/* The sm_90a tile code's shapes and shared memory: the CTA's roles and registers, the
 * tile configuration (TileConfig: precision, tile width, stages, operand layouts, extra
 * and store-buffer bytes), the operand descriptors, and the shared-memory ring with its
 * barriers and position.
 *
 * Threads: 3 warpgroups. Warpgroups 0 and 1 are consumers, each owning 64 rows of the
 * 128 x BN tile (accumulators in registers, BN/2 floats per thread); warpgroup 2 is the
 * producer, of which one thread issues all TMA copies.
 * NOTE: 384 threads at one CTA per SM leave 168 registers per thread at entry, 64512 in
 * all, and setmaxnreg only moves those: 2 x 128 x 232 + 128 x 40 = 64512. (A split
 * asking for more, 2 x 128 x 208 + 128 x 96 = 65536, cannot launch: see
 * docs/decisions/0002-warp-roles-and-register-split.) A TileConfig may pick another split
 * (ProducerRegs).
 * NOTE: ptxas (CUDA 13) allocates the code after setmaxnreg.inc within the new count:
 * the BN = 256 gemm2 and dgrad1 consumers use registers up to R211 (cuobjdump -sass,
 * 2026-12-03; an earlier note here said nothing passed R165). The producer's 40 binds
 * the store warps; dgrad2's, which run its SwiGLU backward, take 168 (ProducerRegs). */
#pragma once

#include <cuda.h>
#include <stdint.h>

#include "gemm_params.h"
#include "sm90/ptx/mbarrier.cuh"
#include "sm90/precision.cuh"

namespace mf {
namespace sm90 {

constexpr int kBlockM = 128;
static_assert(kBlockM == MF_ROW_BLOCK_M,
              "a GEMM row tile is one of the plan's row blocks (each within one expert)");
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
 * that many bytes (+EPI_ROW_PAD: 16 for the consumers' 4-byte writes, 32 for 8-byte ones,
 * so that the rows a warp writes at once fall on distinct banks). */
template <class P, int BN_, int STAGES_, bool A_MN_MAJOR = false, bool B_MN_MAJOR = false,
          int EXTRA_BYTES = 0, int STORE_ROW_BYTES = 0, int EPI_ROW_PAD = 16>
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
     * layout (8 rows x 4 words per warp) hit 32 distinct banks; +32: rows 8 banks apart,
     * so each half-warp's 8-byte stores (4 rows x 4 pairs) do. */
    static constexpr int kEpiRowBytes = STORE_ROW_BYTES ? STORE_ROW_BYTES + EPI_ROW_PAD : 0;
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
    static_assert(EPI_ROW_PAD == 16 || EPI_ROW_PAD == 32, "rows 4 or 8 banks apart");
};

/* The tiles of the row GEMMs (gemm1, gemm2, dgrad1; the launcher picks one by the output
 * width): BN = 256 with 3 stages, or BN = 128 with 6 (bf16) or 5 (FP8), the store warps'
 * rows 512 or 256 bytes. FP8 keeps bf16's widths (the promotion runs per 128-wide half:
 * 64 part registers beside acc's 128): a stage 48 KB or 32 KB, each with the row scales.
 * B_MN_MAJOR: B read MN-major (bf16 dgrad1 reads W13 as it is; FP8's B is always
 * K-major, W^T). */
template <class P, bool B_MN_MAJOR = false>
struct RowGemmTiles {
    using Wide = TileConfig<P, 256, 3, false, B_MN_MAJOR, 0, 512>;
    using Narrow = TileConfig<P, 128, P::kElementBytes == 1 ? 5 : 6, false, B_MN_MAJOR, 0, 256>;
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
    static_assert(kMnMajor ? (P::kInstrK * kSwizzleBytes) % 1024 == 0
                           : (P::kInstrK * P::kElementBytes) % 16 == 0,
                  "a K step moves whole swizzle atoms (MN-major: the base-offset field stays "
                  "0) or whole 16-byte units inside the row (K-major)");
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

}  // namespace sm90
}  // namespace mf
