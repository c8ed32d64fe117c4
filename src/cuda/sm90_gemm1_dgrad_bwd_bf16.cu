/* dgrad of gemm1 (sm_90a, bf16): the input gradient of each routed row, scattered to its
 * slot of the combine buffer (the reduce kernel then sums a token's K slots, as in the
 * forward).
 *
 *   dx_r = dh_r W13_e          dh [rows, 2I] ([dg | du]), W13_e [2I, H] (H contiguous)
 *   combine[row_slot[r], :] = bf16(dx_r)       rows with row_slot -1 skipped
 *   (expert parallelism: into the source rank's combine, see ScatterTarget)
 *
 * A = dh is K-major (K = 2I). B = W13_e is MN-major: the reduction runs over its rows,
 * its N = H index is contiguous, so each stage loads BN/64 boxes of 64 H columns x 64
 * W13 rows and the wgmma reads B transposed. The epilogue is the forward gemm2's row
 * scatter with weight 1 (ScatterRowsEpilogue).
 *
 * FLOPs: 2 * rows * 2I * H. qwen3-30b-a3b at 131072 rows: 825 GFLOP, about 1.0 ms at
 * 790 TFLOP/s: matrix-bound. */
#include "kernels.h"
#include "sm90_grouped_gemm.cuh"
#include "tensor_map.h"

namespace {

using namespace mf;
using namespace mf::sm90;

struct Dgrad1Args {
    CUtensorMap map_dh;    /* [rows_cap, 2I], box 128 x 64 (K-major) */
    CUtensorMap map_w13;   /* [E * 2I, H], box 64 rows x 64 columns (MN-major B) */
    const int32_t *row_block_expert;
    const int32_t *num_rows;
    ScatterTarget to;
    int rows_cap, hidden, intermediate;
};

/* ---- producer: A rows of the block, then BN/64 boxes of W13_e rows k.. k+63 ---------- */
template <class Cfg>
struct Dgrad1Load {
    const Dgrad1Args &args;
    int m_row, w_row, n_col;

    __device__ __forceinline__ void tile_begin(int m_block, int n_block) {
        const int e = args.row_block_expert[m_block];
        m_row = m_block * kBlockM;
        w_row = e * 2 * args.intermediate;
        n_col = n_block * Cfg::BN;
    }
    __device__ __forceinline__ void stage(int kb, uint8_t *a, uint8_t *b, uint64_t *bar) {
        const int k = kb * kBlockK;
        ptx::tma_load_2d(a, &args.map_dh, bar, k, m_row);
#pragma unroll
        for (int j = 0; j < Cfg::BN / 64; ++j)
            ptx::tma_load_2d(b + j * Cfg::kMnBoxBytes, &args.map_w13, bar, n_col + 64 * j,
                             w_row + k);
    }
};

template <class Cfg>
__global__ void __launch_bounds__(kThreads, 1)
    sm90_gemm1_dgrad_bwd_bf16_kernel(const __grid_constant__ Dgrad1Args args) {
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    Dgrad1Load<Cfg> load{args, 0, 0, 0};
    ScatterRowsEpilogue<Cfg> epi{args.to, ring_from_smem<Cfg>(smem_raw), {}, {0.f, 0.f}};
    run_grouped_gemm<Cfg>(smem_raw, &args.map_dh, &args.map_w13, args.num_rows, args.rows_cap,
                          args.hidden / Cfg::BN, (2 * args.intermediate) / kBlockK, load, epi);
}

/* The two tile choices (the launcher picks one by the output width). */
using WideCfg = TileConfig<256, 3, false, true, 0, 512>;
using NarrowCfg = TileConfig<128, 6, false, true, 0, 256>;

template <class Cfg>
cudaError_t launch(const mf_dgrad1_params *p, cudaStream_t stream) {
    Dgrad1Args args;
    cudaError_t err;
    const int two_i = 2 * p->intermediate;
    if ((err = mf_tensor_map_bf16_2d(&args.map_dh, p->dh, (uint64_t)p->rows_cap, two_i, two_i,
                                     kBlockM, kBlockK)) != cudaSuccess)
        return err;
    if ((err = mf_tensor_map_bf16_2d(&args.map_w13, p->w13,
                                     (uint64_t)p->num_local_experts * two_i, p->hidden,
                                     p->hidden, kBlockK, 64)) != cudaSuccess)
        return err;
    args.row_block_expert = p->row_block_expert;
    args.num_rows = p->num_rows;
    args.to = ScatterTarget{p->row_slot, nullptr, nullptr, p->combine, p->combine_peers,
                            p->num_ranks, p->hidden};
    args.rows_cap = p->rows_cap;
    args.hidden = p->hidden;
    args.intermediate = p->intermediate;

    return launch_persistent(sm90_gemm1_dgrad_bwd_bf16_kernel<Cfg>, Cfg::kSmemBytes, p->num_sms, args, stream);
}

}  // namespace

/* Tile choice: BN = 256 when H allows it, else BN = 128; the store warps store the rows
 * (BN = 256: 3 stages of 48 KB beside the 66 KB of epilogue buffers; BN = 128: 6 stages
 * of 32 KB). */
extern "C" cudaError_t mf_sm90_gemm1_dgrad_bwd_bf16(const mf_dgrad1_params *p,
                                                    cudaStream_t stream) {
    if (!p || !p->dh || !p->w13 || !p->row_block_expert || !p->num_rows || !p->row_slot ||
        (!p->combine && !p->combine_peers) || (p->combine_peers && p->num_ranks < 1))
        return cudaErrorInvalidValue;
    if (p->rows_cap < 0 || p->rows_cap % kBlockM || p->hidden <= 0 || p->hidden % 128 ||
        p->intermediate <= 0 || p->intermediate % 32 || p->num_local_experts <= 0 ||
        p->num_sms <= 0)
        return cudaErrorInvalidValue;
    /* TMA sources and the 16-byte epilogue stores need 16-byte aligned bases. */
    if (misaligned16(p->dh, p->w13, p->combine)) return cudaErrorInvalidValue;
    if (p->rows_cap == 0) return cudaSuccess;
    if (p->hidden % 256 == 0) return launch<WideCfg>(p, stream);
    return launch<NarrowCfg>(p, stream);
}

extern "C" cudaError_t mf_sm90_gemm1_dgrad_bwd_load(void) {
    return mf_load_kernels(sm90_gemm1_dgrad_bwd_bf16_kernel<WideCfg>, sm90_gemm1_dgrad_bwd_bf16_kernel<NarrowCfg>);
}
