/* K-grouped weight gradient (sm_90a, bf16 in, fp32 or bf16 out): for every local expert
 * e, over its padded rows [expert_offsets[e], expert_offsets[e+1]),
 *
 *   dw_e [M, N] = (accumulate ? dw_e : 0) + sum_r lhs[r, :]^T rhs[r, :]
 *
 * dW2: lhs = dys (M = H), rhs = act_p (N = I). dW13: lhs = dh (M = 2I), rhs = xs (N = H).
 * Padding rows are zero in both operands, so they add nothing.
 *
 * Both operands are MN-major: the reduction (K) runs over rows and the M / N indices are
 * contiguous. A stage is 64 rows: A = 2 boxes of 64 M columns x 64 rows, B = BN/64 boxes
 * of 64 N columns x 64 rows, read by wgmma with both transpose immediates set.
 *
 * Tiles are (expert, 128-row m block, BN n block), n fastest, the experts in a given
 * order (the scheduler below); one CTA owns each output tile and runs the expert's whole
 * K loop (no split-K, no atomics: deterministic, whichever CTA runs it). The K
 * loop may be empty (an expert without rows): the tile is then written as zeros (with
 * store warps and an order, by the store warps beside the GEMM tiles), or left as it is
 * in accumulate mode.
 *
 * Epilogue: fp32 straight from the accumulators, 8-byte stores (4 lanes cover 32
 * contiguous bytes of a row, whole sectors); accumulate mode loads, adds once, stores.
 * bf16 output (write mode): rounded to nearest even into the epilogue buffer, and stored
 * by the store warps (whole 16-byte row pieces, half the bytes of fp32) while the
 * consumers run the next tile's K loop: a separate instantiation (TileConfig with
 * STORE_ROW_BYTES), since its buffers take a stage's shared memory. bf16 operands' fp32
 * output in write mode goes the same way, BN = 128 (rows of 512 bytes, as bf16's at
 * 256) with 4 stages; FP8's keeps its 256-wide tile (narrower ones were slower) and hands
 * it over in two column halves of 512-byte rows, 3 stages
 * (docs/decisions/0021-fp8-gpu-kernels.md).
 *
 * FLOPs: 2 * rows * M * N. qwen3-30b-a3b at 131072 rows: dW2 412 GFLOP, dW13 825 GFLOP;
 * the fp32 outputs are E * M * N * 4 bytes (0.8 GB / 1.6 GB, written once, read once more
 * when accumulating). */
#include "sm90/moe_bwd_tiles.cuh"

namespace {

using namespace mf;
using namespace mf::sm90;

/* ---- scheduler: (expert, m block, n block) tiles, n fastest; K = the expert's rows -------
 * The experts come in args.expert_order (expert_order.cu: the heavy ones first, most rows
 * first; identity when NULL), so tile i belongs to the (i / tiles_per_expert)-th of them.
 * Wave w hands tiles w*G .. w*G + G-1 to the G CTAs forwards when w is even and
 * backwards when it is odd (a snake): the CTA that got one of a wave's costliest tiles
 * gets one of the next wave's cheapest, so the heavy experts' tiles spread evenly.
 * With store warps (bf16 out, or fp32 in write mode) and an order, the
 * tiles of experts without rows are left out here: they are zeros, written by the store
 * warps beside the GEMM tiles (WgradEpilogue::idle_work), instead of a tail of pure
 * stores after them.
 * m_block below is the combined index e * m_blocks + m block. */
template <class Cfg>
struct WgradScheduler {
    const int32_t *offsets, *order;
    int m_blocks, n_blocks, tiles_per_expert, total, wave;

    __device__ __forceinline__ WgradScheduler(const WgradArgs &a, bool store_warps_zero_empty)
        : offsets(a.expert_offsets), order(a.expert_order), m_blocks(a.m_blocks),
          n_blocks(a.n_blocks), tiles_per_expert(a.m_blocks * a.n_blocks),
          total(wgrad_gemm_tiles(a, store_warps_zero_empty)), wave(0) {}
    __device__ __forceinline__ bool next_tile(int &m_block, int &n_block) {
        const int cta = (wave & 1) ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x;
        const int i = wave * (int)gridDim.x + cta;
        if (i >= total) return false;   /* later waves hold only larger i */
        ++wave;
        wgrad_tile(order, m_blocks, n_blocks, i, m_block, n_block);
        return true;
    }
    __device__ __forceinline__ int num_k_blocks(int m_block, int) const {
        return wgrad_k_blocks<Cfg::kBlockK>(offsets, m_blocks, m_block);
    }
};

template <class Cfg>
__global__ void __launch_bounds__(kThreads, 1)
    sm90_wgrad_grouped_kernel(const __grid_constant__ WgradArgs args) {
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    WgradLoad<Cfg> load{args, 0, 0, 0};
    const WgradScheduler<Cfg> sched(args, Cfg::kStoreWarps);
    WgradEpilogue<Cfg> epi(args, ring_from_smem<Cfg>(smem_raw), sched.total);
    run_grouped_gemm_sched<Cfg>(smem_raw, &args.map_lhs, &args.map_rhs, sched, load, epi);
}

/* The tile choices (see the launcher): output width BN, bf16 or fp32 out. */
using WideBf16Cfg = TileConfig<Bf16, 256, 3, true, true, 0, 512>;
/* 48 registers for the store warps: the drain of 128-wide rows and the zero tiles do not
 * fit 40 (the consumers keep 224, three times their 64 accumulators). */
using NarrowBf16Cfg = ProducerRegs<TileConfig<Bf16, 128, 6, true, true, 0, 256>, 48>;
using WideF32Cfg = TileConfig<Bf16, 256, 4, true, true>;
using NarrowF32Cfg = TileConfig<Bf16, 128, 6, true, true>;
/* FP8: lhs^T and rhs^T K-major (no transposes for 8-bit wgmma), the widths and stage
 * counts of bf16's (the promotion runs per 128-wide half), each stage with both operands'
 * row scales (1.5 KB at BN = 256). */
using Fp8WideBf16Cfg = TileConfig<Fp8E4m3TokenScaled<256>, 256, 3, false, false, 0, 512>;
using Fp8NarrowBf16Cfg =
    ProducerRegs<TileConfig<Fp8E4m3TokenScaled<128>, 128, 5, false, false, 0, 256>, 48>;
using Fp8WideF32Cfg = TileConfig<Fp8E4m3TokenScaled<256>, 256, 4, false, false>;
/* FP8's fp32 out in write mode, by the store warps in two column halves a tile: rows of
 * 128 fp32 (bf16's 512 bytes) in bf16's buffers, 3 stages */
using Fp8WideF32HalvesCfg = TileConfig<Fp8E4m3TokenScaled<256>, 256, 3, false, false, 0, 512, 32>;
using Fp8NarrowF32Cfg = TileConfig<Fp8E4m3TokenScaled<128>, 128, 6, false, false>;
/* bf16's fp32 out in write mode, by the store warps: BN = 128, 4 stages of 32 KB beside
 * the two 34 KB buffers; 48 registers for the store warps, as bf16's narrow tile (wgrad
 * 2.53 -> 2.42 ms on an H100, qwen3-30b-a3b T = 16384; FP8's the same way lost, 2.16 ->
 * 2.31 ms: docs/decisions/0021-fp8-gpu-kernels.md). */
using F32StoredCfg = ProducerRegs<TileConfig<Bf16, 128, 4, true, true, 0, 512, 32>, 48>;

template <class Cfg>
cudaError_t launch(const mf_wgrad_params *p, cudaStream_t stream) {
    WgradArgs args;
    const cudaError_t err = wgrad_args_from<Cfg>(p, &args);
    if (err != cudaSuccess) return err;
    return launch_persistent(sm90_wgrad_grouped_kernel<Cfg>, Cfg::kSmemBytes, p->num_sms, args, stream);
}

}  // namespace

/* Tile choice: BN = 256 when N allows it, else BN = 128. fp32 out: 4 stages of 48 KB or
 * 6 of 32 KB (in write mode, with the store warps' buffers: bf16 operands BN = 128, 4 of
 * 32 KB; FP8 BN = 256 in two halves, 3 of 48 KB); bf16 out, with the store warps'
 * buffers: 3 of 48 KB or 6 of 32 KB. */
/* No rows at all: zero gradients in write mode (each half of an output in two), nothing
 * when accumulating. */
static cudaError_t wgrad_without_rows(const mf_wgrad_params *p, cudaStream_t stream) {
    if (p->accumulate) return cudaSuccess;
    void *lo = p->dw ? (void *)p->dw : (void *)p->dw_bf16;
    void *hi = p->dw ? (void *)p->dw_up : (void *)p->dw_bf16_up;
    const size_t bytes = (size_t)p->rows.num_local_experts * p->m * p->n * (p->dw ? 4 : 2);
    if (!hi) return cudaMemsetAsync(lo, 0, bytes, stream);
    const cudaError_t err = cudaMemsetAsync(lo, 0, bytes / 2, stream);
    return err != cudaSuccess ? err : cudaMemsetAsync(hi, 0, bytes / 2, stream);
}

extern "C" cudaError_t mf_sm90_wgrad_grouped_bf16(const mf_wgrad_params *p,
                                                  cudaStream_t stream) {
    if (!wgrad_params_ok<Bf16>(p)) return cudaErrorInvalidValue;
    if (p->rows.rows_cap == 0) return wgrad_without_rows(p, stream);
    if (p->dw_bf16) return p->n % 256 == 0 ? launch<WideBf16Cfg>(p, stream)
                                           : launch<NarrowBf16Cfg>(p, stream);
    if (!p->accumulate) return launch<F32StoredCfg>(p, stream);
    return p->n % 256 == 0 ? launch<WideF32Cfg>(p, stream) : launch<NarrowF32Cfg>(p, stream);
}

extern "C" cudaError_t mf_sm90_wgrad_grouped_fp8(const mf_wgrad_params *p,
                                                 cudaStream_t stream) {
    if (!wgrad_params_ok<Fp8E4m3>(p)) return cudaErrorInvalidValue;
    if (p->rows.rows_cap == 0) return wgrad_without_rows(p, stream);
    if (p->dw_bf16) return p->n % 256 == 0 ? launch<Fp8WideBf16Cfg>(p, stream)
                                           : launch<Fp8NarrowBf16Cfg>(p, stream);
    if (p->n % 256 == 0)
        return p->accumulate ? launch<Fp8WideF32Cfg>(p, stream) : launch<Fp8WideF32HalvesCfg>(p, stream);
    return launch<Fp8NarrowF32Cfg>(p, stream);
}

extern "C" cudaError_t mf_sm90_wgrad_grouped_load(void) {
    return mf_load_kernels(
        sm90_wgrad_grouped_kernel<WideBf16Cfg>, sm90_wgrad_grouped_kernel<NarrowBf16Cfg>,
        sm90_wgrad_grouped_kernel<WideF32Cfg>, sm90_wgrad_grouped_kernel<NarrowF32Cfg>,
        sm90_wgrad_grouped_kernel<Fp8WideBf16Cfg>, sm90_wgrad_grouped_kernel<Fp8NarrowBf16Cfg>,
        sm90_wgrad_grouped_kernel<Fp8WideF32Cfg>, sm90_wgrad_grouped_kernel<Fp8NarrowF32Cfg>,
        sm90_wgrad_grouped_kernel<Fp8WideF32HalvesCfg>,
        sm90_wgrad_grouped_kernel<F32StoredCfg>);
}
