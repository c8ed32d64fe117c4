/* The GEMM operations of one (architecture, precision): what the pipeline launches for
 * each expert GEMM, picked once when a layer is created (mf_gemm_ops_find). The
 * pipeline builds the params of gemm_params.h and calls through a table, so a precision or
 * an architecture is a second table, not a second pipeline. */
#ifndef MOEFUSE_CUDA_GEMM_OPS_H
#define MOEFUSE_CUDA_GEMM_OPS_H

#include <cuda_runtime.h>

#include "kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One file's kernels, loaded at create (check.h, mf_load_kernels); `what` names the file
 * in an error. */
typedef struct mf_kernel_loader {
    cudaError_t (*load)(void);
    const char *what;
} mf_kernel_loader;

typedef struct mf_gemm_ops {
    const char *name;             /* e.g. "sm90 bf16", for errors */
    int arch;                     /* compute capability major * 10 + minor it runs on */
    int precision;                /* moefuse_precision */
    /* Rows of a GEMM row tile: the plan's row block (MF_ROW_BLOCK_M), which sizes the
     * saved buffer's row_block_expert and every padded expert segment. */
    int block_m;
    /* H and I must be multiples of it (the tiles' column blocks over H, I and 2I). */
    int dim_multiple;
    /* d p partial sums per row that dgrad2 writes (its column blocks over I); < 1: dgrad2
     * takes no such I. */
    int (*dp_parts)(int intermediate);
    /* nonzero when the fused kernels take these shapes (else the layer runs staged, and
     * fused_forward / fused_backward may be NULL) */
    int (*fused_forward_takes)(int hidden, int intermediate);
    int (*fused_backward_takes)(int hidden, int intermediate);

    cudaError_t (*gemm1)(const mf_gemm1_params *p, cudaStream_t stream);
    cudaError_t (*gemm2)(const mf_gemm2_params *p, cudaStream_t stream);
    cudaError_t (*fused_forward)(const mf_moe_fused_fwd_params *p, cudaStream_t stream);
    cudaError_t (*dgrad2)(const mf_dgrad2_params *p, cudaStream_t stream);
    cudaError_t (*dgrad1)(const mf_dgrad1_params *p, cudaStream_t stream);
    cudaError_t (*wgrad)(const mf_wgrad_params *p, cudaStream_t stream);
    cudaError_t (*fused_backward)(const mf_moe_fused_bwd_params *p, cudaStream_t stream);

    const mf_kernel_loader *loaders;  /* the table's kernel files */
    int num_loaders;
} mf_gemm_ops;

extern const mf_gemm_ops mf_sm90_bf16_ops;  /* src/cuda/sm90/ops.cu */
extern const mf_gemm_ops mf_sm90_fp8_ops;   /* the same, FP8 block scales (no fused kernels) */

/* The table of (arch, precision) (gemm_ops.cu), arch < 0: of any architecture; NULL
 * when there is none. */
const mf_gemm_ops *mf_gemm_ops_find(int arch, int precision);

#ifdef __cplusplus
}
#endif

#endif /* MOEFUSE_CUDA_GEMM_OPS_H */
