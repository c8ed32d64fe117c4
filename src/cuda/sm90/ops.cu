/* The sm90 (Hopper, wgmma + TMA) GEMMs in bf16: the ops table the pipeline calls. */
#include "gemm_ops.h"

#include "internal.h"

namespace {

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
