/* The sm_90a mainloop: the producer's TMA loads of MN-major stages, the producer role
 * (one thread filling the ring) and the consumer role (two warpgroups running the wgmma
 * K loop, with the precision's per-K-block scale hook, and the kernel's epilogue). The
 * same for every kernel: which boxes a stage holds is the kernel's Load, what leaves a
 * tile its Epilogue. */
#pragma once

#include <cuda.h>
#include <stdint.h>

#include <type_traits>
#include <utility>

#include "sm90/common/tile_config.cuh"
#include "sm90/ptx/mbarrier.cuh"
#include "sm90/ptx/tma.cuh"
#include "sm90/ptx/wgmma.cuh"

namespace mf {
namespace sm90 {

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

/* The K loop of a promoting scale hook (FP8; kGroupsInFlight 0): each K block's wgmmas
 * run into the hook's part registers, kParts pieces of the tile's columns one after the
 * other (BN = 256: two halves of m64n128, so that acc and part fit the registers: 128 +
 * 64; A read once per K block into registers for both halves' RS wgmmas), each waited
 * for and promoted into acc (scale.promote(acc, scales, kb, piece)); the stage goes back
 * to the producer as soon as its last piece is promoted. The other consumer warpgroup's
 * wgmmas keep the tensor cores busy meanwhile. */
template <class Cfg, class Scale>
__device__ __forceinline__ void k_loop_promoted(const Ring<Cfg> &ring, RingPos<Cfg> &pos,
                                                float (&acc)[Cfg::kAccRegs], int num_k_blocks,
                                                Scale &scale) {
    using P = typename Cfg::Precision;
    using DescA = OperandDesc<P, false, Cfg::kMnBoxBytes>;
    using DescB = OperandDesc<P, false, Cfg::kMnBoxBytes>;
    constexpr int kPieceN = Cfg::BN / Scale::kParts;
    static_assert(!Cfg::kAMnMajor && !Cfg::kBMnMajor, "promoted K loops take K-major operands");
    static_assert(kPieceN / 2 == Scale::kPartRegs, "a piece is one m64 wgmma of the part's width");
    const int wg = threadIdx.x / 128;
#pragma unroll
    for (int i = 0; i < Cfg::kAccRegs; ++i) acc[i] = 0.f;   /* the promotions add to it */
    for (int kb = 0; kb < num_k_blocks; ++kb) {
        ptx::mbar_wait(&ring.full[pos.stage], pos.phase);
        const uint8_t *a_rows = ring.a(pos.stage) + wg * Cfg::kAWarpgroupBytes;
        const uint64_t da = DescA::make(a_rows);
        const uint64_t db = DescB::make(ring.b(pos.stage));
        constexpr int kSteps = Cfg::kBlockK / P::kInstrK;
        /* with two pieces A is read once into registers (ldmatrix) for both pieces' RS
         * wgmmas (gemm1 984 -> 966 us under ncu on an H100); with one piece A is read once
         * either way, and the RS form would only add the loads */
        constexpr bool kAFromRegisters = Scale::kParts > 1;
        [[maybe_unused]] uint32_t a_regs[kSteps][4];
        if constexpr (kAFromRegisters) {
            static_assert(kPieceN == 128 && P::kElementBytes == 1, "the RS wgmma wrapper's");
#pragma unroll
            for (int k = 0; k < kSteps; ++k)
                ptx::ldmatrix_a_e4m3(a_rows, k * P::kInstrK, a_regs[k]);
        }
#pragma unroll
        for (int piece = 0; piece < Scale::kParts; ++piece) {
            ptx::wgmma_fence_operand(scale.part);
            ptx::wgmma_fence();
#pragma unroll
            for (int k = 0; k < kSteps; ++k) {
                const uint64_t b = db + ((piece * kPieceN * Cfg::kRowBytes) >> 4) +
                                   DescB::kStepK * k;
                if constexpr (kAFromRegisters)
                    ptx::wgmma_m64n128k32_e4m3_rs(scale.part, a_regs[k], b, k > 0 ? 1 : 0);
                else
                    P::template mma<kPieceN, 0, 0>(scale.part, da + DescA::kStepK * k, b,
                                                   k > 0 ? 1 : 0);
            }
            ptx::wgmma_commit();
            ptx::wgmma_wait<0>();
            ptx::wgmma_fence_operand(scale.part);
            if constexpr (kAFromRegisters)
#pragma unroll
                for (int k = 0; k < kSteps; ++k) ptx::wgmma_fence_a(a_regs[k]);
            scale.promote(acc, ring.a_scales(pos.stage), kb, piece);
        }
        /* The promotions read the stage's scales with generic loads, and the producer's
         * next TMA into the slot (the async proxy) follows this warp's arrival: without
         * the fence the arrival went out with those loads still in flight, and now and
         * then a warp read the next fill's scales (its 16 rows of a dgrad2 tile wrong in
         * about one backward in two at T = 16384; see
         * docs/decisions/0028-fp8-stage-scale-fence). */
        ptx::fence_proxy_async_smem();
        if (threadIdx.x % 32 == 0) ptx::mbar_arrive(&ring.empty[pos.stage]);
        pos.advance();
    }
}

/* A tile's whole K loop from ring position pos (advanced past it) into acc, with the
 * precision's per-K-block scale hook (a scaled precision's kernel passes its own, which
 * loaded the tile's B scales first). */
template <class Cfg, class Scale>
__device__ __forceinline__ void k_loop(const Ring<Cfg> &ring, RingPos<Cfg> &pos,
                                       float (&acc)[Cfg::kAccRegs], int num_k_blocks,
                                       Scale &scale) {
    if constexpr (Scale::kGroupsInFlight == 0) {
        k_loop_promoted<Cfg>(ring, pos, acc, num_k_blocks, scale);
    } else {
        int prev_stage = 0;
        for (int kb = 0; kb < num_k_blocks; ++kb) {
            issue_k_block<Cfg>(ring, pos, acc, kb, scale);
            retire_k_block<Cfg>(ring, pos, acc, kb, prev_stage, scale);
        }
        end_k_loop<Cfg>(ring, acc, num_k_blocks, prev_stage);
    }
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

}  // namespace sm90
}  // namespace mf
