/* gemm2 of the routed experts with the weighted combine in the epilogue (sm_90a, bf16).
 *
 *   o_r = act_r W2_e^T                        act [rows, I], W2_e [H, I] (I contiguous)
 *   combine[row_slot[r], :] = bf16(p[row_slot[r]] * o_r)    rows with row_slot -1 skipped
 *   (expert parallelism: the row goes to its source rank's combine, p = row_weight[r];
 *   see ScatterTarget in sm90_grouped_gemm.cuh)
 *
 * Both operands are K-major (K = I). Each output row goes to its slot's row of the
 * combine buffer, so the epilogue scatters whole rows; the reduce over a token's K slots
 * happens later, in a fixed order (no atomics).
 *
 * FLOPs: 2 * rows * I * H. qwen3-30b-a3b at 16384 tokens (131072 rows): 412 GFLOP, about
 * 0.52 ms at 790 TFLOP/s, against about 1.1 GB of DRAM traffic (0.26 ms): matrix-bound,
 * but with a short K loop (I / 64 = 12 blocks) the epilogue's share matters: the store
 * warps store the rows (sm90_grouped_gemm.cuh) while the consumers run the next tile. */
#include <cuda_bf16.h>

#include "kernels.h"
#include "sm90_grouped_gemm.cuh"
#include "tensor_map.h"

namespace {

using namespace mf;
using namespace mf::sm90;

struct Gemm2Args {
    CUtensorMap map_act;   /* [rows_cap, I], box 128 x 64 */
    CUtensorMap map_w2;    /* [E * H, I], box BN x 64 */
    const int32_t *row_block_expert;
    const int32_t *num_rows;
    ScatterTarget to;
    int rows_cap, hidden, intermediate;
};

/* ---- producer: A rows of the block, BN rows of W2_e --------------------------------- */
template <class Cfg>
struct Gemm2Load {
    const Gemm2Args &args;
    int m_row, w_row;

    __device__ __forceinline__ void tile_begin(int m_block, int n_block) {
        const int e = args.row_block_expert[m_block];
        m_row = m_block * kBlockM;
        w_row = e * args.hidden + n_block * Cfg::BN;
    }
    __device__ __forceinline__ void stage(int kb, uint8_t *a, uint8_t *b, uint64_t *bar) {
        const int k = kb * kBlockK;
        ptx::tma_load_2d(a, &args.map_act, bar, k, m_row);
        ptx::tma_load_2d(b, &args.map_w2, bar, k, w_row);
    }
};

template <class Cfg>
__global__ void __launch_bounds__(kThreads, 1)
    sm90_gemm2_combine_fwd_bf16_kernel(const __grid_constant__ Gemm2Args args) {
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    Gemm2Load<Cfg> load{args, 0, 0};
    ScatterRowsEpilogue<Cfg> epi{args.to, ring_from_smem<Cfg>(smem_raw), {}, {0.f, 0.f}};
    run_grouped_gemm<Cfg>(smem_raw, &args.map_act, &args.map_w2, args.num_rows, args.rows_cap,
                          args.hidden / Cfg::BN, args.intermediate / kBlockK, load, epi);
}

template <class Cfg>
cudaError_t launch(const mf_gemm2_params *p, cudaStream_t stream) {
    Gemm2Args args;
    cudaError_t err;
    if ((err = mf_tensor_map_bf16_2d(&args.map_act, p->act, (uint64_t)p->rows_cap,
                                     p->intermediate, p->intermediate, kBlockM, kBlockK)) !=
        cudaSuccess)
        return err;
    if ((err = mf_tensor_map_bf16_2d(&args.map_w2, p->w2,
                                     (uint64_t)p->num_local_experts * p->hidden,
                                     p->intermediate, p->intermediate, Cfg::BN, kBlockK)) !=
        cudaSuccess)
        return err;
    args.row_block_expert = p->row_block_expert;
    args.num_rows = p->num_rows;
    args.to = ScatterTarget{p->row_slot, p->slot_weight, p->row_weight, p->combine,
                            p->combine_peers, p->num_ranks, p->hidden};
    args.rows_cap = p->rows_cap;
    args.hidden = p->hidden;
    args.intermediate = p->intermediate;

    return launch_persistent(sm90_gemm2_combine_fwd_bf16_kernel<Cfg>, Cfg::kSmemBytes, p->num_sms, args, stream);
}

}  // namespace

/* Tile choice: BN = 256 when H allows it, else BN = 128; the store warps store the rows
 * (BN = 256: 3 stages of 48 KB beside the 66 KB of epilogue buffers; BN = 128: 6 stages
 * of 32 KB). */
extern "C" cudaError_t mf_sm90_gemm2_combine_fwd_bf16(const mf_gemm2_params *p,
                                                      cudaStream_t stream) {
    if (!p || !p->act || !p->w2 || !p->row_block_expert || !p->num_rows || !p->row_slot ||
        (!p->slot_weight && !p->row_weight) || (!p->combine && !p->combine_peers) ||
        (p->combine_peers && p->num_ranks < 1))
        return cudaErrorInvalidValue;
    if (p->rows_cap < 0 || p->rows_cap % kBlockM || p->hidden <= 0 || p->hidden % 128 ||
        p->intermediate <= 0 || p->intermediate % kBlockK || p->num_local_experts <= 0 ||
        p->num_sms <= 0)
        return cudaErrorInvalidValue;
    /* TMA sources and the 16-byte epilogue stores need 16-byte aligned bases. */
    if (misaligned16(p->act, p->w2, p->combine)) return cudaErrorInvalidValue;
    if (p->rows_cap == 0) return cudaSuccess;
    if (p->hidden % 256 == 0) return launch<TileConfig<256, 3, false, false, 0, 512>>(p, stream);
    return launch<TileConfig<128, 6, false, false, 0, 256>>(p, stream);
}
