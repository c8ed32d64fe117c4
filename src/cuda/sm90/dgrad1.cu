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
#include "sm90/moe_bwd_tiles.cuh"

namespace {

using namespace mf;
using namespace mf::sm90;

template <class Cfg>
__global__ void __launch_bounds__(kThreads, 1)
    sm90_gemm1_dgrad_bwd_kernel(const __grid_constant__ Dgrad1Args args) {
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    Dgrad1Load<Cfg> load{args, 0, 0, 0, 0};
    ScatterRowsEpilogue<Cfg> epi{args.to, ring_from_smem<Cfg>(smem_raw), {}, {0.f, 0.f}};
    run_grouped_gemm<Cfg>(smem_raw, &args.map_dh, &args.w13.map_gate, args.num_rows, args.rows_cap,
                          args.hidden / Cfg::BN, (2 * args.intermediate) / Cfg::kBlockK, load, epi);
}

/* The two tile choices (the launcher picks one by the output width; tile_config.cuh):
 * bf16 reads W13 [E * 2I, H] MN-major; FP8 reads B = W13^T [E * H, 2I] K-major. */
using WideCfg = RowGemmTiles<Bf16, true>::Wide;
using NarrowCfg = RowGemmTiles<Bf16, true>::Narrow;
using Fp8WideCfg = RowGemmTiles<Fp8E4m3>::Wide;
using Fp8NarrowCfg = RowGemmTiles<Fp8E4m3>::Narrow;

template <class Cfg>
cudaError_t launch(const mf_dgrad1_params *p, cudaStream_t stream) {
    Dgrad1Args args;
    const cudaError_t err = dgrad1_args_from<Cfg>(p, &args);
    if (err != cudaSuccess) return err;
    return launch_persistent(sm90_gemm1_dgrad_bwd_kernel<Cfg>, Cfg::kSmemBytes, p->num_sms, args, stream);
}

}  // namespace

/* Tile choice: BN = 256 when H allows it, else BN = 128; the store warps store the rows
 * (BN = 256: 3 stages of 48 KB beside the 66 KB of epilogue buffers; BN = 128: 6 stages
 * of 32 KB). */
extern "C" cudaError_t mf_sm90_gemm1_dgrad_bwd_bf16(const mf_dgrad1_params *p,
                                                    cudaStream_t stream) {
    if (!dgrad1_params_ok<Bf16>(p)) return cudaErrorInvalidValue;
    if (p->rows.rows_cap == 0) return cudaSuccess;
    if (p->hidden % 256 == 0) return launch<WideCfg>(p, stream);
    return launch<NarrowCfg>(p, stream);
}

extern "C" cudaError_t mf_sm90_gemm1_dgrad_bwd_fp8(const mf_dgrad1_params *p,
                                                   cudaStream_t stream) {
    if (!dgrad1_params_ok<Fp8E4m3>(p)) return cudaErrorInvalidValue;
    if (p->rows.rows_cap == 0) return cudaSuccess;
    if (p->hidden % 256 == 0) return launch<Fp8WideCfg>(p, stream);
    return launch<Fp8NarrowCfg>(p, stream);
}

extern "C" cudaError_t mf_sm90_gemm1_dgrad_bwd_load(void) {
    return mf_load_kernels(sm90_gemm1_dgrad_bwd_kernel<WideCfg>, sm90_gemm1_dgrad_bwd_kernel<NarrowCfg>,
                           sm90_gemm1_dgrad_bwd_kernel<Fp8WideCfg>,
                           sm90_gemm1_dgrad_bwd_kernel<Fp8NarrowCfg>);
}
