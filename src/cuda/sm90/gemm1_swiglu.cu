/* gemm1 of the routed experts with SwiGLU in the epilogue (sm_90a, bf16).
 *
 *   [g | u] = bf16(xs W13_e^T)  xs [rows, H], W13_e [2I, H] (gate rows 0..I-1, up I..2I-1)
 *   act     = bf16(silu(g) * u) [rows, I]; gate_up = [g | u] [rows, 2I], optional
 *
 * The tile code (loads, epilogue) is in src/cuda/sm90/moe_fwd_tiles.cuh, shared with the fused
 * forward (src/cuda/sm90/fused_forward.cu).
 *
 * FLOPs: 2 * rows * H * 2I. qwen3-30b-a3b at 16384 tokens (131072 rows): 825 GFLOP, about
 * 1.0 ms at 790 TFLOP/s, against about 1.4 GB of DRAM traffic (0.3 ms): matrix-bound. */
#include "sm90/moe_fwd_tiles.cuh"

namespace {

using namespace mf;
using namespace mf::sm90;

template <class Cfg>
__global__ void __launch_bounds__(kThreads, 1)
    sm90_gemm1_swiglu_fwd_kernel(const __grid_constant__ Gemm1Args args) {
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    Gemm1Load<Cfg> load{args, 0, 0, 0, false};
    Gemm1Epilogue<Cfg> epi{args, ring_from_smem<Cfg>(smem_raw), {}};
    run_grouped_gemm<Cfg>(smem_raw, &args.map_xs, &args.w13.map_gate, args.num_rows, args.rows_cap,
                          (2 * args.intermediate) / Cfg::BN, args.hidden / Cfg::kBlockK, load, epi);
}

/* The two tile choices (the launcher picks one by the output width; tile_config.cuh). */
using Precision = Bf16;
using WideCfg = RowGemmTiles<Precision>::Wide;
using NarrowCfg = RowGemmTiles<Precision>::Narrow;
/* FP8 takes I % 128 == 0 (gemm1_params_ok): the wide tile only */
using Fp8WideCfg = RowGemmTiles<Fp8E4m3>::Wide;

template <class Cfg>
cudaError_t launch(const mf_gemm1_params *p, cudaStream_t stream) {
    Gemm1Args args;
    const cudaError_t err = gemm1_args_from<Cfg>(p, &args);
    if (err != cudaSuccess) return err;
    return launch_persistent(sm90_gemm1_swiglu_fwd_kernel<Cfg>, Cfg::kSmemBytes, p->num_sms, args, stream);
}

}  // namespace

/* Tile choice: BN = 256 (128 gate + 128 up columns; 3 stages of 48 KB beside the 66 KB of
 * [g | u] buffers) when I allows it, else BN = 128 (6 stages of 32 KB, 34 KB of buffers). */
extern "C" cudaError_t mf_sm90_gemm1_swiglu_fwd_bf16(const mf_gemm1_params *p,
                                                     cudaStream_t stream) {
    if (!gemm1_params_ok<Precision>(p)) return cudaErrorInvalidValue;
    if (p->rows.rows_cap == 0) return cudaSuccess;
    if (p->intermediate % 128 == 0) return launch<WideCfg>(p, stream);
    return launch<NarrowCfg>(p, stream);
}

extern "C" cudaError_t mf_sm90_gemm1_swiglu_fwd_fp8(const mf_gemm1_params *p, cudaStream_t stream) {
    if (!gemm1_params_ok<Fp8E4m3>(p)) return cudaErrorInvalidValue;
    if (p->rows.rows_cap == 0) return cudaSuccess;
    return launch<Fp8WideCfg>(p, stream);
}

extern "C" cudaError_t mf_sm90_gemm1_swiglu_fwd_load(void) {
    return mf_load_kernels(sm90_gemm1_swiglu_fwd_kernel<WideCfg>, sm90_gemm1_swiglu_fwd_kernel<NarrowCfg>,
                           sm90_gemm1_swiglu_fwd_kernel<Fp8WideCfg>);
}
