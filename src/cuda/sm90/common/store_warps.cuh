/* The sm_90a epilogue's store warps: the handoff of a consumer warpgroup's store buffer,
 * the consumers' writes into it, the store warps' drains (bulk row copies) and their
 * loop over the tiles.
 *
 * Epilogue: by the store warps (TileConfig's STORE_ROW_BYTES > 0): each consumer
 * warpgroup writes its 64 output rows into its own shared-memory buffer and hands it over;
 * the producer warpgroup's three other warps read the rows back and store them with
 * whole 16-byte (or 8-byte) row pieces to where they go (rows can be scattered, as the
 * combine needs) while the consumers run the next tile's K loop (see "store warps").
 * Without store warps (fp32 wgrad, except bf16 operands' in write mode) the consumers
 * store from their registers.
 * NOTE: measured on an H200, staging in shared memory (then by the consumers themselves)
 * against storing straight from the accumulator registers (4-byte stores, 16-byte
 * pieces of 8 rows per warp instruction): qwen3-30b-a3b gemm2
 * 0.98 -> 0.81-0.87 ms, gemm1 with gate_up 1.69 -> 1.35-1.46 ms, gemm1 act-only equal
 * within noise. Per-row bulk copies (cp.async.bulk) were the other option; in SASS their
 * issue is a loop over the lanes through uniform registers. */
#pragma once

#include <stdint.h>

#include <type_traits>
#include <utility>

#include "sm90/common/tile_config.cuh"
#include "sm90/ptx/mbarrier.cuh"
#include "sm90/ptx/tma.cuh"

namespace mf {
namespace sm90 {

/* ---- store warps ---------------------------------------------------------------------
 * The epilogue split in two so that its global stores overlap the next tile's K loop:
 *  - a consumer warpgroup waits until its buffer is empty (StoreHandoff::acquire), writes
 *    its 64 rows there (epi_write_bf16, and whatever else the kernel stages), and hands
 *    the buffer over (release: every thread arrives, ordering its shared-memory writes);
 *  - the store warps (warps 1..3 of the producer warpgroup, 40 registers) walk the same
 *    tiles, wait for each warpgroup's buffer, store it out (the epilogue's drain(m_block,
 *    n_block, wg, buf)) and release it (every store-warp thread arrives).
 * NOTE: before this existed the consumers waited for the stores and the routing-weight
 * loads before starting the next tile, with the tensor cores idle (see
 * docs/decisions/0004-store-warps). dgrad2's store warps run its whole SwiGLU backward
 * (see docs/decisions/0011-dgrad2-epilogue). */
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
     * kBulkDrain: the drain reads buf by bulk copies (drain_rows, the async proxy),
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

/* Two floats rounded to nearest even, as one bf16 pair (lo in the low half). */
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

/* Consumer side: kGroups column groups of 8 (from group `first`) of the warpgroup's 64
 * rows x BN fp32 into the buffer, rows of kGroups * 32 bytes kEpiRowBytes = 32 (mod 128)
 * apart: a half-warp's 8-byte writes, 4 rows x 32 bytes, hit 32 distinct banks. */
template <class Cfg, int kGroups>
__device__ __forceinline__ void epi_write_acc_fp32_groups(uint8_t *buf,
                                                          float (&acc)[Cfg::kAccRegs], int first) {
    static_assert(Cfg::kStoreRowBytes == kGroups * 32 && Cfg::kEpiRowBytes % 128 == 32,
                  "the buffer holds the groups' fp32 rows, 8 banks apart");
    const int t = threadIdx.x % 128;
    const int warp = t / 32, lane = t % 32;
    uint8_t *my_row = buf + (warp * 16 + lane / 4) * Cfg::kEpiRowBytes + (lane % 4) * 8;
#pragma unroll
    for (int c = 0; c < kGroups; ++c)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int a = 4 * (first + c) + 2 * h;
            *reinterpret_cast<float2 *>(my_row + h * 8 * Cfg::kEpiRowBytes + c * 32) =
                make_float2(acc[a], acc[a + 1]);
        }
}

/* The whole tile (rows of BN fp32). */
template <class Cfg>
__device__ __forceinline__ void epi_write_acc_fp32(uint8_t *buf, float (&acc)[Cfg::kAccRegs]) {
    epi_write_acc_fp32_groups<Cfg, Cfg::BN / 8>(buf, acc, 0);
}

/* One half of the tile's columns (half 0 or 1: columns half * BN / 2 ..), rows of BN / 2
 * fp32 (BN * 2 bytes: the buffers of a bf16 tile's rows), so that a 256-wide fp32 tile
 * leaves in two handoffs through buffers of bf16's size. */
template <class Cfg>
__device__ __forceinline__ void epi_write_acc_fp32_half(uint8_t *buf,
                                                        float (&acc)[Cfg::kAccRegs], int half) {
    epi_write_acc_fp32_groups<Cfg, Cfg::BN / 16>(buf, acc, half * (Cfg::BN / 16));
}

/* Store-warp side: the buffer's 64 rows (kStoreRowBytes each: BN bf16, or BN fp32), each
 * to dst(r) (16-byte aligned; nullptr drops the row). Each row leaves as one bulk copy
 * (cp.async.bulk, the TMA engine), row r issued by lane r / kStoreWarps of store warp
 * r % kStoreWarps. The thread waits until its copy has read the buffer (the caller then
 * hands the buffer back), not for the global writes: store_role waits for those before
 * the CTA ends. The consumers' writes reach the async proxy through the fence in
 * StoreHandoff::stage.
 * NOTE: ptxas loops over the lanes for the copies (UBLKCP takes uniform registers, ~9
 * instructions a row), still fewer than the 16-byte loads and stores of three warps this
 * replaced (see docs/decisions/0007-bulk-row-drains). */
template <class Cfg, class Dst>
__device__ __forceinline__ void drain_rows(const uint8_t *buf, Dst &&dst) {
    static_assert(Cfg::kStoreRowBytes == Cfg::BN * 2 || Cfg::kStoreRowBytes == Cfg::BN * 4,
                  "the buffer holds the tile's rows");
    static_assert(kStoreWarps * 32 >= 64, "a row per store-warp lane at most");
    const int sw = threadIdx.x / 32 - kFirstStoreWarp, lane = threadIdx.x % 32;
    const int r = sw + kStoreWarps * lane;
    if (r < 64) {
        void *d = dst(r);
        if (d) ptx::bulk_store_s2g(d, buf + r * Cfg::kEpiRowBytes, Cfg::kStoreRowBytes);
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

/* An epilogue that hands each warpgroup's buffer over more than once a tile
 * (`kHandoffsPerTile`; its drain then takes the handoff's index as a fifth argument). */
template <class E, class = void>
struct HandoffsPerTile {
    static constexpr int value = 1;
};
template <class E>
struct HandoffsPerTile<E, decltype(void(E::kHandoffsPerTile))> {
    static constexpr int value = E::kHandoffsPerTile;
};

/* The store warps' loop over this CTA's tiles (the same walk as the consumers'). */
template <class Cfg, class Sched, class Epi>
__device__ __forceinline__ void store_role(const Ring<Cfg> &ring, Sched sched, Epi &epi) {
    uint32_t phase = 0;
    int m_block, n_block;
    while (sched.next_tile(m_block, n_block)) {
        if constexpr (HasDrains<Epi>::value)
            if (!epi.drains(m_block, n_block)) continue;
        constexpr int kHandoffs = HandoffsPerTile<Epi>::value;
#pragma unroll 1
        for (int handoff = 0; handoff < kHandoffs; ++handoff) {
#pragma unroll 1
            for (int wg = 0; wg < kConsumerWarpgroups; ++wg) {
                if constexpr (HasIdleWork<Epi>::value)
                    while (!ptx::mbar_test_wait(&ring.epi_full[wg], phase) && epi.idle_work()) {}
                ptx::mbar_wait(&ring.epi_full[wg], phase);
                if constexpr (kHandoffs > 1)
                    epi.drain(m_block, n_block, wg, ring.epi_buf(wg), handoff);
                else
                    epi.drain(m_block, n_block, wg, ring.epi_buf(wg));
                ptx::mbar_arrive(&ring.epi_empty[wg]);
            }
            phase ^= 1u;
        }
    }
    if constexpr (HasIdleWork<Epi>::value)
        while (epi.idle_work()) {}
    ptx::bulk_wait_all();   /* drain_rows' bulk copies written out before the CTA ends */
}

}  // namespace sm90
}  // namespace mf
