/* Precision traits of the sm_90a tile code: what the operands' precision decides in the
 * ring, the producer, the consumers' K loop and the host's tensor maps. The tile code
 * takes one as TileConfig's first parameter (TileConfig<Bf16, BN, STAGES, ...>): Bf16,
 * Fp8E4m3 (E4M3 with 1 x 128 / 128 x 128 fp32 scales, docs/decisions/0018 and 0021) and
 * Fp8E4m3TokenScaled<BN> (the weight gradients: both operands scaled per 128 tokens).
 *
 * A precision P provides:
 *   Element, kElementBytes   an operand element in shared memory and global memory
 *   kBlockK                  K of one ring stage: one 128-byte swizzle row of elements
 *                            (FP8: 128, one scale block)
 *   kMapType                 the TMA tensor-map data type (tensor_map_2d<P>)
 *   kInstrK                  K of one wgmma instruction (a stage issues kBlockK / kInstrK)
 *   kMnMajorOperands         whether an operand may be MN-major (wgmma's transpose bits;
 *                            8-bit types have none: dgrad reads W^T, wgrad token-major
 *                            copies)
 *   mma<N, kTransA, kTransB> the m64nN wgmma of one kInstrK step, both operands in shared
 *                            memory, fp32 accumulators (ptx/wgmma.cuh)
 *   kAScaleBytes             per stage: the scales riding with it (the kernel's Load
 *                            bulk-copies them into Ring::a_scales with the stage; 0: none)
 *   BlockScale               bf16's per-K-block hook (NoBlockScale: nothing to do)
 * A scaled precision's kernels get their hook from the Load per tile
 * (load.block_scale(m_block, n_block, k_blocks)): PromoteBlockScale (weights) or
 * PromoteRowScales (weight gradients), run by mainloop.cuh's k_loop_promoted.
 * MXFP8 (sm_100, 1x32 UE8M0 scales) would have its own mainloop behind the same ops table;
 * of these traits it would share the element and tensor-map entries. */
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "sm90/ptx/wgmma.cuh"
#include "sm90/tensor_map.h"

namespace mf {
namespace sm90 {

/* The row of a 128-byte swizzle atom: TMA's CU_TENSOR_MAP_SWIZZLE_128B and the wgmma
 * descriptors' layout type 1 (ptx/wgmma.cuh). */
constexpr int kSwizzleBytes = 128;

/* The scale hook of an unscaled precision: the tensor cores accumulate the whole K loop
 * in acc, one wgmma group stays in flight, nothing to load or promote. */
struct NoBlockScale {
    static constexpr int kGroupsInFlight = 1;   /* wgmma groups pending after a block's issue */
    template <class Acc>
    __device__ __forceinline__ Acc &mma_acc(Acc &acc) const {
        return acc;
    }
    /* Whether wgmma k of K block kb adds to its accumulators (0: overwrites them). */
    __device__ __forceinline__ int accumulate(int kb, int k) const {
        return (kb > 0 || k > 0) ? 1 : 0;
    }
    /* After K block kb's wgmmas completed, its stage (and scales) not yet handed back. */
    template <class Acc>
    __device__ __forceinline__ void after_k_block(Acc &, const uint8_t *, int) const {}
};

struct Bf16 {
    using Element = __nv_bfloat16;
    static constexpr int kElementBytes = 2;
    static constexpr int kBlockK = kSwizzleBytes / kElementBytes;
    static constexpr CUtensorMapDataType kMapType = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    static constexpr int kInstrK = 16;
    static constexpr bool kMnMajorOperands = true;
    static constexpr int kAScaleBytes = 0;
    using BlockScale = NoBlockScale;

    template <int N, int kTransA, int kTransB>
    static __device__ __forceinline__ void mma(float (&d)[N / 2], uint64_t desc_a,
                                               uint64_t desc_b, int scale_d) {
        static_assert(N == 128 || N == 256, "wgmma wrappers exist for N = 128 and 256");
        if constexpr (N == 256)
            ptx::wgmma_m64n256k16_bf16_ss<kTransA, kTransB>(d, desc_a, desc_b, scale_d);
        else
            ptx::wgmma_m64n128k16_bf16_ss<kTransA, kTransB>(d, desc_a, desc_b, scale_d);
    }
};

/* E4M3 with fp32 block scales (docs/decisions/0018-fp8-block-recipe.md): a stage is one
 * 128-wide K block, the scale block of both operands; A's 128 row scales of the block ride
 * with the stage (kAScaleBytes, bulk-copied by the kernel's Load). Its block-scale hook
 * is the kernel's (PromoteBlockScale below), which knows where B's scales are. */
struct Fp8E4m3 {
    using Element = uint8_t;
    static constexpr int kElementBytes = 1;
    static constexpr int kBlockK = kSwizzleBytes / kElementBytes;
    static constexpr CUtensorMapDataType kMapType = CU_TENSOR_MAP_DATA_TYPE_UINT8;
    static constexpr int kInstrK = 32;
    static constexpr bool kMnMajorOperands = false;
    static constexpr int kAScaleBytes = 128 * 4;   /* kBlockM row scales of one K block */

    template <int N, int kTransA, int kTransB>
    static __device__ __forceinline__ void mma(float (&d)[N / 2], uint64_t desc_a,
                                               uint64_t desc_b, int scale_d) {
        static_assert(N == 128 || N == 256, "wgmma wrappers exist for N = 128 and 256");
        static_assert(!kTransA && !kTransB, "e4m3 wgmma takes K-major operands only");
        if constexpr (N == 256)
            ptx::wgmma_m64n256k32_e4m3_ss(d, desc_a, desc_b, scale_d);
        else
            ptx::wgmma_m64n128k32_e4m3_ss(d, desc_a, desc_b, scale_d);
    }
};

/* The weight gradients' FP8 (K = tokens): both operands scaled per 128 tokens and per
 * row of the operand (A's M, B's N), so B's BN scales of a K block ride with the stage
 * too, after A's 128. */
template <int BN>
struct Fp8E4m3TokenScaled : Fp8E4m3 {
    static constexpr int kAScaleBytes = (128 + BN) * 4;   /* A's 128 rows, then B's BN */
};

/* The FP8 scale hooks (mainloop.cuh, k_loop_promoted): every K block's wgmmas start
 * from zero in `part` (the tensor cores' FP8 sums keep ~14 bits), kParts pieces of the
 * tile's columns in turn (BN = 256: two m64n128 halves, part 64 registers beside acc's
 * 128), and once a piece is done it is promoted into the fp32 accumulators:
 * acc += part * (scale_a[row] * scale_b), A's row scales from the stage's scale slot.
 * NOTE: the promotion is one fma per accumulator and block with the row x column scale
 * products formed once per piece; with a select between a first-block multiply and the
 * fma, and the products per element, it took longer than the other warpgroup's wgmmas
 * (about 200 instructions per 128 cycles of tensor work) and the FP8 GEMMs ran at half
 * their tensor rate (ncu, H200).
 * Thread t of a consumer warpgroup holds rows 16 (t / 32) + (t % 32) / 4 and + 8 of the
 * warpgroup's 64: accumulator 4c + 2h + j is row half h, column 8c + 2 (t % 4) + j; piece
 * p's part register i is accumulator p * kPartRegs + i.
 * NOTE: promoting one piece while the next one's wgmmas run (two part buffers of 64-column
 * pieces) lost 14-20% (docs/decisions/0021-fp8-gpu-kernels.md). */
template <int kAccRegs>
struct PromoteScales {
    static constexpr int kGroupsInFlight = 0;
    static constexpr int kPartRegs = kAccRegs < 64 ? kAccRegs : 64;
    static constexpr int kParts = kAccRegs / kPartRegs;
    float part[kPartRegs];

    /* This thread's two rows' scales of the K block in `slot`. */
    static __device__ __forceinline__ float2 row_scales(const uint8_t *slot) {
        const int t = threadIdx.x % 128;
        const float *sa = reinterpret_cast<const float *>(slot) + (threadIdx.x / 128) * 64 +
                          (t / 32) * 16 + (t % 32) / 4;
        return make_float2(sa[0], sa[8]);
    }
    /* acc starts at 0 (k_loop_promoted), so every block is one fma: the first gives
     * part * scale. */
    template <class Acc>
    __device__ __forceinline__ void promote_one(Acc &acc, int piece, int i, float scale) const {
        float &a = acc[piece * kPartRegs + i];
        a = fmaf(part[i], scale, a);
    }
};

/* Weights' 128 x 128 block scales: B's per K block and per half of the tile's columns (one
 * weight block each: gemm1's gate and up halves lie in two, as do a 256-wide tile's), loaded
 * from global memory one K block ahead. */
template <int kAccRegs>
struct PromoteBlockScale : PromoteScales<kAccRegs> {
    using Base = PromoteScales<kAccRegs>;
    const float *b_left, *b_right;   /* [num_k_blocks]: B's scales of the two column halves */
    int num_k_blocks;
    float left, right, next_left, next_right;

    __device__ __forceinline__ PromoteBlockScale(const float *l, const float *r, int k_blocks)
        : b_left(l), b_right(r), num_k_blocks(k_blocks) {
        next_left = k_blocks > 0 ? __ldg(l) : 0.f;
        next_right = k_blocks > 0 ? __ldg(r) : 0.f;
    }
    template <class Acc>
    __device__ __forceinline__ void promote(Acc &acc, const uint8_t *slot, int kb, int piece) {
        if (piece == 0) {   /* this block's B scales; the next block's loads issued */
            left = next_left;
            right = next_right;
            if (kb + 1 < num_k_blocks) {
                next_left = __ldg(b_left + kb + 1);
                next_right = __ldg(b_right + kb + 1);
            }
        }
        const float2 sa = Base::row_scales(slot);
        /* [column half][row half] */
        const float s[2][2] = {{sa.x * left, sa.y * left}, {sa.x * right, sa.y * right}};
#pragma unroll
        for (int i = 0; i < Base::kPartRegs; ++i)
            this->promote_one(acc, piece, i,
                              s[piece * Base::kPartRegs + i >= kAccRegs / 2][(i / 2) % 2]);
    }
};

/* Per-row scales of both operands (Fp8E4m3TokenScaled): B's column scales from the slot,
 * after A's 128. */
template <int kAccRegs>
struct PromoteRowScales : PromoteScales<kAccRegs> {
    using Base = PromoteScales<kAccRegs>;
    template <class Acc>
    __device__ __forceinline__ void promote(Acc &acc, const uint8_t *slot, int, int piece) {
        const float2 sa = Base::row_scales(slot);
        const float *sb = reinterpret_cast<const float *>(slot) + 128 +
                          piece * (Base::kPartRegs * 2) + 2 * (threadIdx.x % 4);
#pragma unroll
        for (int c = 0; c < Base::kPartRegs / 4; ++c) {
            const float2 b = *reinterpret_cast<const float2 *>(sb + 8 * c);
            this->promote_one(acc, piece, 4 * c, sa.x * b.x);
            this->promote_one(acc, piece, 4 * c + 1, sa.x * b.y);
            this->promote_one(acc, piece, 4 * c + 2, sa.y * b.x);
            this->promote_one(acc, piece, 4 * c + 3, sa.y * b.y);
        }
    }
};

/* Host: the TMA map of a row-major matrix of P's elements (sm90/tensor_map.h), copied in
 * boxes of box_rows x box_cols elements with the 128-byte swizzle. */
template <class P>
inline cudaError_t tensor_map_2d(CUtensorMap *map, const void *base, uint64_t rows,
                                 uint64_t cols, uint64_t ld, uint32_t box_rows,
                                 uint32_t box_cols) {
    return mf_tensor_map_2d(map, P::kMapType, base, rows, cols, ld, box_rows, box_cols);
}

}  // namespace sm90
}  // namespace mf
