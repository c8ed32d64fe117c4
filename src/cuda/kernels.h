/* Launchers of the CUDA kernels (one kernel per .cu file), called by the CUDA backend
 * (src/cuda/backend.cu) and the GPU tests. extern "C", plain params structs. */
#ifndef MOEFUSE_CUDA_KERNELS_H
#define MOEFUSE_CUDA_KERNELS_H

#include <cuda_runtime.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Rows of one GEMM tile. The plan pads every expert's segment of the expert-sorted
 * buffers to a multiple of this, so a 128-row block never spans two experts. */
#define MF_SM90_BLOCK_M 128

/* gemm1: act = silu(g) * u with [g; u] = xs W13_e^T, per 128-row block of expert e.
 * Rows past *num_rows are not touched. Padding rows inside a block compute garbage
 * that nobody reads. */
typedef struct mf_gemm1_params {
    const uint16_t *xs;               /* [rows_cap, H] bf16, expert-sorted rows */
    const uint16_t *w13;              /* [E_local, 2I, H] bf16 */
    const int32_t *row_block_expert;  /* [rows_cap / 128] local expert of each block */
    const int32_t *num_rows;          /* device scalar: rows in use, multiple of 128 */
    uint16_t *act;                    /* out [rows_cap, I] bf16 */
    uint16_t *gate_up;                /* out [rows_cap, 2I] bf16 [g; u], or NULL */
    int rows_cap;                     /* multiple of 128 */
    int hidden;                       /* H */
    int intermediate;                 /* I */
    int num_local_experts;
    int num_sms;                      /* persistent grid size */
} mf_gemm1_params;

cudaError_t mf_sm90_gemm1_swiglu_fwd_bf16(const mf_gemm1_params *p, cudaStream_t stream);

/* gemm2: combine[row_slot[r]] = bf16(slot_weight[row_slot[r]] * (act_r W2_e^T)) for
 * every row r < *num_rows with row_slot[r] >= 0. */
typedef struct mf_gemm2_params {
    const uint16_t *act;              /* [rows_cap, I] bf16 */
    const uint16_t *w2;               /* [E_local, H, I] bf16 */
    const int32_t *row_block_expert;  /* [rows_cap / 128] */
    const int32_t *num_rows;          /* device scalar */
    const int32_t *row_slot;          /* [rows_cap] slot (t*K + k) of each row, -1 padding */
    const float *slot_weight;         /* [T*K] routing weight p of each slot */
    uint16_t *combine;                /* out [T*K, H] bf16, one row per slot */
    int rows_cap;
    int hidden;                       /* H */
    int intermediate;                 /* I */
    int num_local_experts;
    int num_sms;
} mf_gemm2_params;

cudaError_t mf_sm90_gemm2_combine_fwd_bf16(const mf_gemm2_params *p, cudaStream_t stream);

/* ---- backward GEMMs (issue 4) ---------------------------------------------------------
 * The backward reuses the forward's plan (saved), dispatches dy into the same
 * expert-sorted row order (dys), and needs the forward's gate_up (saved, or recomputed
 * by gemm1). Padding rows of dys and xs are zero (dispatch zeroes them), so padding
 * rows contribute nothing to the weight gradients. */

/* dgrad of gemm2 with the SwiGLU backward in the epilogue, per 128-row block of e:
 *   da'[r]  = dys[r] W2_e                       fp32, [I]   (W2_e is [H, I]: B is MN-major)
 *   g, u    = gate_up[r];  a = bf16(silu(g) * u)            (exactly the forward's a)
 *   dp_partial[r, nb] = sum over this tile's columns j of da'[j] * a[j]   (fp32)
 *   da      = p[row_slot[r]] * da'
 *   dh[r]   = bf16([da * u * silu'(g) ; da * silu(g)])      ([dg | du], like gate_up)
 *   act_p[r] = bf16(p * a)                                  (the A operand of dW2)
 * Rows with row_slot -1 (padding) get dh = 0, act_p = 0, dp_partial = 0. */
typedef struct mf_dgrad2_params {
    const uint16_t *dys;              /* [rows_cap, H] bf16 */
    const uint16_t *w2;               /* [E_local, H, I] bf16 */
    const uint16_t *gate_up;          /* [rows_cap, 2I] bf16 [g | u] */
    const int32_t *row_block_expert;  /* [rows_cap / 128] */
    const int32_t *num_rows;          /* device scalar */
    const int32_t *row_slot;          /* [rows_cap] */
    const float *slot_weight;         /* [T*K] p */
    uint16_t *dh;                     /* out [rows_cap, 2I] bf16 */
    uint16_t *act_p;                  /* out [rows_cap, I] bf16 */
    float *dp_partial;                /* out [rows_cap, mf_dgrad2_dp_parts(I)] fp32 */
    int rows_cap, hidden, intermediate, num_local_experts, num_sms;
} mf_dgrad2_params;

/* Column blocks of dgrad2 over I, i.e. the partial sums per row that make d p. */
int mf_dgrad2_dp_parts(int intermediate);
cudaError_t mf_sm90_gemm2_dgrad_swiglu_bwd_bf16(const mf_dgrad2_params *p, cudaStream_t stream);

/* dgrad of gemm1: combine[row_slot[r]] = bf16(dh[r] W13_e) for rows with row_slot >= 0
 * (W13_e is [2I, H]: B is MN-major). The reduce kernel then sums the K slots of a token
 * into dx, as in the forward. */
typedef struct mf_dgrad1_params {
    const uint16_t *dh;               /* [rows_cap, 2I] bf16 */
    const uint16_t *w13;              /* [E_local, 2I, H] bf16 */
    const int32_t *row_block_expert;  /* [rows_cap / 128] */
    const int32_t *num_rows;          /* device scalar */
    const int32_t *row_slot;          /* [rows_cap] */
    uint16_t *combine;                /* out [T*K, H] bf16 */
    int rows_cap, hidden, intermediate, num_local_experts, num_sms;
} mf_dgrad1_params;

cudaError_t mf_sm90_gemm1_dgrad_bwd_bf16(const mf_dgrad1_params *p, cudaStream_t stream);

/* K-grouped weight gradient: for every local expert e, over its padded rows
 * [expert_offsets[e], expert_offsets[e+1]):
 *     dw_e [M, N] = (accumulate ? dw_e : 0) + sum_r lhs[r, :]^T rhs[r, :]
 * in fp32, each output element owned by one CTA (no atomics: deterministic).
 * dW2:  lhs = dys [rows, H] (M = H),   rhs = act_p [rows, I] (N = I)
 * dW13: lhs = dh  [rows, 2I] (M = 2I), rhs = xs [rows, H]   (N = H)
 * Both operands are MN-major (rows are the reduction). Experts without rows get zeros
 * (write mode) or are left as they are (accumulate). */
typedef struct mf_wgrad_params {
    const uint16_t *lhs;              /* [rows_cap, M] bf16 */
    const uint16_t *rhs;              /* [rows_cap, N] bf16 */
    const int32_t *expert_offsets;    /* [E_local + 1] device, multiples of 128 */
    float *dw;                        /* [E_local, M, N] fp32 */
    int rows_cap, m, n, num_local_experts, accumulate, num_sms;
} mf_wgrad_params;

cudaError_t mf_sm90_wgrad_grouped_bf16(const mf_wgrad_params *p, cudaStream_t stream);

/* ---- plan, dispatch and reduce ------------------------------------------------------
 * Each launcher returns cudaGetLastError() of its launches. */

/* Errors found by the plan on the device. `record` is the layer's, kept over calls
 * until moefuse_layer_check reads and clears it; the rest is per call. */
typedef struct mf_plan_error {
    int32_t code;    /* 0, MOEFUSE_ERR_EXPERT_ID or MOEFUSE_ERR_DUPLICATE_EXPERT */
    int32_t token;   /* the smallest bad token of the first failed call */
    int32_t slot;    /* k of the bad id */
    int32_t value;   /* the bad id */
} mf_plan_error;

typedef struct mf_plan_state {
    mf_plan_error record;       /* first error since the last moefuse_layer_check */
    uint32_t first_bad_token;   /* per call: atomicMin over blocks; UINT32_MAX = none */
    uint32_t blocks_done;       /* per call: the last block of the count pass scans */
    int32_t call_failed;        /* per call: 1 when this call's ids were bad; every later
                                   kernel of the call reads it and writes nothing */
    int32_t pad_;
} mf_plan_state;

/* Initial contents of an mf_plan_state (the kernels restore the per-call fields). */
#define MF_PLAN_STATE_INIT {{0, 0, 0, 0}, 0xffffffffu, 0u, 0, 0}

typedef struct mf_plan_params {
    /* in */
    const int32_t *ids;           /* [T, K] */
    int num_tokens;               /* T, >= 0 */
    int top_k;                    /* K */
    int num_experts;              /* E, ids must lie in [-1, E) */
    int expert_begin;             /* first local expert */
    int num_local_experts;        /* E_local */
    int rows_cap;                 /* mf_cuda_rows_cap(T): size of row_slot */
    /* scratch (the layer's workspace) */
    int32_t *slot_rank;           /* [T*K] rank of a slot among its expert's slots in its chunk */
    int32_t *chunk_base;          /* [num_chunks, E_local] histogram, then exclusive prefix */
    mf_plan_state *state;
    int32_t *gemm_num_rows;       /* device scalar the gemms read: num_rows, or 0 on bad ids */
    /* out (written only when every id is good) */
    int32_t *expert_counts;       /* [E_local] */
    int32_t *expert_offsets;      /* [E_local + 1] */
    int32_t *row_block_expert;    /* [rows_cap / 128]; -1 past num_rows */
    int32_t *num_rows;            /* device scalar */
    int32_t *slot_row;            /* [T*K] row of each slot, -1 dropped */
    int32_t *row_slot;            /* [rows_cap] slot of each row, -1 padding */
    int32_t *user_counts;         /* optional [E] (the public expert_counts), or NULL */
    int32_t *saved_header;        /* optional: mf_cuda_saved_header to fill, or NULL */
    int32_t header_words[16];     /* what to write into saved_header on success */
} mf_plan_params;

/* Tokens of one block of the count pass: 2048 slots (rounded to whole tokens). */
int mf_plan_chunk_tokens(int top_k);
/* Dynamic shared memory of the count pass for (K, E_local); the backend raises the
 * kernel's limit to this once at create. */
size_t mf_plan_smem_bytes(int top_k, int num_local_experts);
cudaError_t mf_plan_prepare(int top_k, int num_local_experts);
cudaError_t mf_plan_build_cuda(const mf_plan_params *p, cudaStream_t stream);

/* xs[r] = x[token of row_slot[r]] for r < num_rows; padding rows (row_slot -1) get
 * zeros, so padding rows of act and gate_up are exactly 0. */
typedef struct mf_dispatch_params {
    const uint16_t *x;            /* [T, H], row stride x_stride */
    int64_t x_stride;
    const int32_t *row_slot;      /* [rows_cap] */
    const int32_t *num_rows;      /* device scalar */
    const int32_t *call_failed;   /* device flag: nonzero = write nothing */
    uint16_t *xs;                 /* out [rows_cap, H] */
    int rows_cap;
    int hidden;                   /* H, multiple of 8 */
    int top_k;
    int num_sms;
} mf_dispatch_params;

cudaError_t mf_dispatch_rows_bf16(const mf_dispatch_params *p, cudaStream_t stream);

/* y[t] = bf16(sum_{k=0..K-1, ids[t,k] >= 0} float(combine[t*K+k])), fp32, k in order. */
typedef struct mf_reduce_params {
    const uint16_t *combine;      /* [T*K, H] */
    const int32_t *ids;           /* [T, K] */
    const int32_t *call_failed;   /* device flag: nonzero = write nothing */
    uint16_t *y;                  /* out [T, H], row stride y_stride */
    int64_t y_stride;
    int num_tokens;
    int top_k;
    int hidden;                   /* multiple of 8 */
} mf_reduce_params;

cudaError_t mf_reduce_slots_bf16(const mf_reduce_params *p, cudaStream_t stream);

/* The backward's d p: dweights[s] = sum over nb = 0..parts-1, in order, of
 * dp_partial[slot_row[s], nb] in fp32; 0 where slot_row[s] = -1 (dropped). */
typedef struct mf_reduce_dp_params {
    const float *dp_partial;      /* [rows_cap, parts] (mf_sm90_gemm2_dgrad_swiglu_bwd_bf16) */
    int parts;                    /* mf_dgrad2_dp_parts(I), >= 1 */
    const int32_t *slot_row;      /* [T*K] */
    const int32_t *call_failed;   /* device flag: nonzero = write nothing */
    float *dweights;              /* out [T, K] */
    int num_tokens;
    int top_k;
} mf_reduce_dp_params;

cudaError_t mf_reduce_dp_f32(const mf_reduce_dp_params *p, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* MOEFUSE_CUDA_KERNELS_H */
