/* The sm90 (Hopper, wgmma + TMA) GEMMs: the ops tables the pipeline calls, bf16 and FP8
 * (E4M3 with block scales: staged only, the fused kernels are bf16's). Each kernel file
 * instantiates both precisions, so both tables load the same files. */
#include "gemm_ops.h"

#include "internal.h"

namespace {

int none_fused(int, int) { return 0; }

const mf_kernel_loader kLoaders[] = {
    {mf_sm90_gemm1_swiglu_fwd_load, "gemm1"},
    {mf_sm90_gemm2_combine_fwd_load, "gemm2"},
    {mf_sm90_moe_fused_fwd_load, "fused forward"},
    {mf_sm90_gemm2_dgrad_swiglu_load, "dgrad2"},
    {mf_sm90_gemm1_dgrad_bwd_load, "dgrad1"},
    {mf_sm90_wgrad_grouped_load, "wgrad"},
    {mf_sm90_moe_fused_bwd_load, "fused backward"},
};

}  // namespace

extern "C" const mf_gemm_ops mf_sm90_bf16_ops = {
    "sm90 bf16",
    90,
    MOEFUSE_PRECISION_BF16,
    MF_SM90_BLOCK_M,
    /* 128-row output blocks over H and 2I in the weight gradients, 128-column blocks
     * over H and I in the dgrads (the launchers refuse the rest) */
    128,
    mf_dgrad2_dp_parts,
    mf_sm90_moe_fused_fwd_takes,
    mf_sm90_moe_fused_bwd_takes,
    mf_sm90_gemm1_swiglu_fwd_bf16,
    mf_sm90_gemm2_combine_fwd_bf16,
    mf_sm90_moe_fused_fwd_bf16,
    mf_sm90_gemm2_dgrad_swiglu_bwd_bf16,
    mf_sm90_gemm1_dgrad_bwd_bf16,
    mf_sm90_wgrad_grouped_bf16,
    mf_sm90_moe_fused_bwd_bf16,
    kLoaders,
    (int)(sizeof kLoaders / sizeof kLoaders[0]),
};

extern "C" const mf_gemm_ops mf_sm90_fp8_ops = {
    "sm90 fp8 block",
    90,
    MOEFUSE_PRECISION_FP8_BLOCK,
    MF_SM90_BLOCK_M,
    /* whole 128-blocks of K and of the weights' scale blocks everywhere */
    128,
    mf_dgrad2_dp_parts_fp8,
    none_fused,
    none_fused,
    mf_sm90_gemm1_swiglu_fwd_fp8,
    mf_sm90_gemm2_combine_fwd_fp8,
    NULL,
    mf_sm90_gemm2_dgrad_swiglu_bwd_fp8,
    mf_sm90_gemm1_dgrad_bwd_fp8,
    mf_sm90_wgrad_grouped_fp8,
    NULL,
    kLoaders,
    (int)(sizeof kLoaders / sizeof kLoaders[0]),
};
