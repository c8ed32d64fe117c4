/* gemm2 of the routed experts with the weighted combine in the epilogue (sm_90a, bf16).
 *
 *   o_r = act_r W2_e^T                        act [rows, I], W2_e [H, I] (I contiguous)
 *   combine[row_slot[r], :] = bf16(row_weight[r] * o_r)    rows with row_slot -1 skipped
 *   (expert parallelism: the row goes to its source rank's combine; see ScatterTarget in
 *   src/cuda/sm90/common/grouped_gemm.cuh)
 *
 * Both operands are K-major (K = I). Each output row goes to its slot's row of the
 * combine buffer, so the epilogue scatters whole rows; the reduce over a token's K slots
 * happens later, in a fixed order (no atomics).
 *
 * FLOPs: 2 * rows * I * H. qwen3-30b-a3b at 16384 tokens (131072 rows): 412 GFLOP, about
 * 0.52 ms at 790 TFLOP/s, against about 1.1 GB of DRAM traffic (0.26 ms): matrix-bound,
 * but with a short K loop (I / 64 = 12 blocks) the epilogue's share matters: the store
 * warps store the rows (src/cuda/sm90/common/store_warps.cuh) while the consumers run the next tile.
 * The tile code is in src/cuda/sm90/moe_fwd_tiles.cuh, shared with the fused forward. */
#include "sm90/moe_fwd_tiles.cuh"

namespace {

using namespace mf;
using namespace mf::sm90;

template <class Cfg>
__global__ void __launch_bounds__(kThreads, 1)
    sm90_gemm2_combine_fwd_kernel(const __grid_constant__ Gemm2Args args) {
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    Gemm2Load<Cfg> load{args, 0, 0};
    ScatterRowsEpilogue<Cfg> epi{args.to, ring_from_smem<Cfg>(smem_raw), {}, {0.f, 0.f}};
    run_grouped_gemm<Cfg>(smem_raw, &args.map_act, &args.map_w2, args.num_rows, args.rows_cap,
                          args.hidden / Cfg::BN, args.intermediate / Cfg::kBlockK, load, epi);
}

/* The two tile choices (the launcher picks one by the output width; tile_config.cuh). */
using Precision = Bf16;
using WideCfg = RowGemmTiles<Precision>::Wide;
using NarrowCfg = RowGemmTiles<Precision>::Narrow;
using Fp8WideCfg = RowGemmTiles<Fp8E4m3>::Wide;
using Fp8NarrowCfg = RowGemmTiles<Fp8E4m3>::Narrow;

template <class Cfg>
cudaError_t launch(const mf_gemm2_params *p, cudaStream_t stream) {
    Gemm2Args args;
    const cudaError_t err = gemm2_args_from<Cfg>(p, &args);
    if (err != cudaSuccess) return err;
    return launch_persistent(sm90_gemm2_combine_fwd_kernel<Cfg>, Cfg::kSmemBytes, p->num_sms, args, stream);
}

}  // namespace

/* Tile choice: BN = 256 when H allows it, else BN = 128; the store warps store the rows
 * (BN = 256: 3 stages of 48 KB beside the 66 KB of epilogue buffers; BN = 128: 6 stages
 * of 32 KB). */
extern "C" cudaError_t mf_sm90_gemm2_combine_fwd_bf16(const mf_gemm2_params *p,
                                                      cudaStream_t stream) {
    if (!gemm2_params_ok<Precision>(p)) return cudaErrorInvalidValue;
    if (p->rows.rows_cap == 0) return cudaSuccess;
    if (p->hidden % 256 == 0) return launch<WideCfg>(p, stream);
    return launch<NarrowCfg>(p, stream);
}

extern "C" cudaError_t mf_sm90_gemm2_combine_fwd_fp8(const mf_gemm2_params *p, cudaStream_t stream) {
    if (!gemm2_params_ok<Fp8E4m3>(p)) return cudaErrorInvalidValue;
    if (p->rows.rows_cap == 0) return cudaSuccess;
    if (p->hidden % 256 == 0) return launch<Fp8WideCfg>(p, stream);
    return launch<Fp8NarrowCfg>(p, stream);
}

extern "C" cudaError_t mf_sm90_gemm2_combine_fwd_load(void) {
    return mf_load_kernels(sm90_gemm2_combine_fwd_kernel<WideCfg>, sm90_gemm2_combine_fwd_kernel<NarrowCfg>,
                           sm90_gemm2_combine_fwd_kernel<Fp8WideCfg>,
                           sm90_gemm2_combine_fwd_kernel<Fp8NarrowCfg>);
}
