/* Params and launchers of the expert GEMM kernels (src/cuda/sm90/, one kernel per .cu
 * file): the pieces every GEMM's params share (rows, operands, arrivals, scatter), the
 * forward and backward GEMMs and the fused kernels. extern "C", plain params structs.
 * Included by kernels.h, with the plan, dispatch, reduce and transport kernels; the
 * pipeline calls the GEMMs through the ops table of gemm_ops.h. Not installed. */
#ifndef MOEFUSE_CUDA_GEMM_PARAMS_H
#define MOEFUSE_CUDA_GEMM_PARAMS_H

#include <cuda_runtime.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Rows of one block of the plan: the plan pads every expert's segment of the
 * expert-sorted buffers to a multiple of this, so a 128-row block never spans two
 * experts. The plan, dispatch and transport kernels are built for it, so every GEMM
 * table's row block (gemm_ops.h) is this height. */
#define MF_ROW_BLOCK_M 128
/* Rows of one sm90 GEMM tile: the plan's row block. */
#define MF_SM90_BLOCK_M MF_ROW_BLOCK_M

/* ---- the pieces of every expert GEMM's params --------------------------------------- */

/* A call's expert-sorted rows, each local expert's segment padded to a multiple of 128.
 * Row-block GEMMs read row_block_expert and num_rows (rows past it are not touched; padding
 * rows in a block compute garbage nobody reads), the weight gradients expert_offsets. */
typedef struct mf_rows {
    const int32_t *row_block_expert;  /* [rows_cap / 128] local expert of each block */
    const int32_t *expert_offsets;    /* [E_local + 1] segment starts, multiples of 128 */
    const int32_t *num_rows;          /* device scalar: rows in use, multiple of 128 */
    int rows_cap, num_local_experts;  /* a multiple of 128; E_local */
} mf_rows;

/* An input matrix of a GEMM, row-major as each params struct says; e4m3 values are
 * code * scale, the fp32 scales laid out as DESIGN.md's FP8 recipe says (1x128: per row
 * and 128 of K; 128x128 blocks: weights; 128 rows: the weight gradients' inputs). The
 * bf16 kernels take MF_DTYPE_BF16 without scales: a zeroed mf_operand with data set. */
typedef enum mf_dtype { MF_DTYPE_BF16 = 0, MF_DTYPE_E4M3 = 1 } mf_dtype;
typedef enum mf_scale_layout {
    MF_SCALES_NONE = 0, MF_SCALES_1X128 = 1, MF_SCALES_128X128 = 2, MF_SCALES_TOKENS_128 = 3
} mf_scale_layout;
typedef struct mf_operand {
    const void *data;
    mf_dtype dtype;
    const float *scales;              /* NULL with MF_SCALES_NONE */
    mf_scale_layout scale_layout;
} mf_operand;

/* Expert parallelism, rows still arriving (arrivals NULL: all there): before its first
 * load of 128-row block b, the producer waits until arrivals[b] reaches target[b] (rows
 * counted in by mf_ep_push_rows; wrap-safe), at most timeout_ns per block; one that runs
 * out is recorded in state (MOEFUSE_ERR_TIMEOUT), fails the call, and ends the waits. */
typedef struct mf_arrivals {
    const uint32_t *arrivals, *target; /* [rows_cap / 128] each, in this rank's sync window */
    struct mf_plan_state *state;      /* kernels.h */
    int64_t timeout_ns;
    int stage;                        /* mf_ep_stage the record names (forward or backward rows) */
} mf_arrivals;

/* Where a GEMM's output rows go: row r to combine[row_slot[r]], rows with row_slot -1
 * (padding) nowhere. Expert parallelism: row_slot[r] = slot * R + source rank, and row r
 * goes to combine_peers[source] (device table [R]) at its slot. */
typedef struct mf_scatter {
    const int32_t *row_slot;          /* [rows_cap] slot (t*K + k) of each row, -1 padding */
    uint16_t *combine;                /* out [T*K, H] bf16, one row per slot */
    uint16_t *const *combine_peers;   /* [R] replaces combine when set */
    int num_ranks;                    /* R with combine_peers, else 0 */
} mf_scatter;

/* W13 as gemm1 and dgrad1 read it (moefuse.h, "W13 in two halves"): w13_up NULL, the
 * operand is packed [E_local, 2I, H], each expert's up rows after its gate rows; else the
 * operand's data is the gate half [E_local, I, H] and w13_up the up half [E_local, I, H]
 * (bf16 only, I a multiple of 64: a K block of dgrad1 never spans both). The kernels load
 * each half from where it is, with the same tiles: the same bits either way. */

/* gemm1: act = bf16(silu(g) * u) of the bf16-rounded [g; u] = xs W13_e^T (the a dgrad2
 * recomputes, bit for bit), per 128-row block of expert e. */
typedef struct mf_gemm1_params {
    mf_rows rows;
    mf_operand xs, w13;               /* [rows_cap, H], [E_local, 2I, H] (or its gate half) */
    uint16_t *act;                    /* out [rows_cap, I] bf16 */
    uint16_t *gate_up;                /* out [rows_cap, 2I] bf16 [g; u], or NULL */
    int hidden, intermediate, num_sms; /* H, I, persistent grid size */
    mf_arrivals rows_in;
    const void *w13_up;               /* [E_local, I, H] bf16 up half, or NULL (packed) */
} mf_gemm1_params;

cudaError_t mf_sm90_gemm1_swiglu_fwd_bf16(const mf_gemm1_params *p, cudaStream_t stream);
/* The same in FP8 (H, I multiples of 128): xs e4m3 with MF_SCALES_1X128 scales
 * [H / 128, rows_cap] (row r's scale of K block b at [b * rows_cap + r]), w13 e4m3 with
 * MF_SCALES_128X128 scales [E_local, 2I / 128, H / 128]; act and gate_up bf16 as above. */
cudaError_t mf_sm90_gemm1_swiglu_fwd_fp8(const mf_gemm1_params *p, cudaStream_t stream);

/* gemm2: combine[row_slot[r]] = bf16(p_r * (act_r W2_e^T)) for every row r < *num_rows
 * with row_slot[r] >= 0, p_r = row_weight[r]. */
typedef struct mf_gemm2_params {
    mf_rows rows;
    mf_operand act, w2;               /* [rows_cap, I], [E_local, H, I] */
    /* [rows_cap] routing weight p of each row (one rank: written by the dispatch; EP:
     * pushed with the rows). NOTE: one load per row before a tile's K loop;
     * weights[row_slot[r]], two dependent loads, stall every tile (see
     * docs/decisions/0005-token-major-dispatch) */
    const float *row_weight;
    mf_scatter to;
    int hidden, intermediate, num_sms;
} mf_gemm2_params;

cudaError_t mf_sm90_gemm2_combine_fwd_bf16(const mf_gemm2_params *p, cudaStream_t stream);
/* The same in FP8: act e4m3 with MF_SCALES_1X128 scales [I / 128, rows_cap], w2 e4m3 with
 * MF_SCALES_128X128 scales [E_local, H / 128, I / 128]. */
cudaError_t mf_sm90_gemm2_combine_fwd_fp8(const mf_gemm2_params *p, cudaStream_t stream);

/* The fused forward: gemm1 and gemm2 in one persistent kernel (the same tiles as the two
 * kernels above, bit for bit). A gemm2 tile of a 128-row block starts once the gemm1
 * tiles of that block have stored their act rows: the store warps count them in
 * act_ready[block] (release), the producer waits for the count (acquire). The tiles are
 * taken in groups of row blocks, by whichever CTA is free: gemm1 of group u, then gemm2
 * of group u - 1, so a gemm2 tile seldom waits and its act rows are still in L2. Takes
 * H % 256 == 0 and I % 128 == 0 (one tile shape for both GEMMs;
 * mf_sm90_moe_fused_fwd_takes); gemm1's act and gemm2's act operand, the rows (blocks,
 * num_rows, rows_cap, E_local), the sizes and num_sms of the two params must agree. */
typedef struct mf_moe_fused_fwd_params {
    mf_gemm1_params gemm1;
    mf_gemm2_params gemm2;
    uint32_t *act_ready;              /* [rows_cap / 128 + 1] scratch (the counts, then the
                                       * next tile to take), zeroed by the launcher */
} mf_moe_fused_fwd_params;

int mf_sm90_moe_fused_fwd_takes(int hidden, int intermediate);
cudaError_t mf_sm90_moe_fused_fwd_bf16(const mf_moe_fused_fwd_params *p, cudaStream_t stream);

/* ---- backward GEMMs -------------------------------------------------------------------
 * The backward reuses the forward's plan (saved), dispatches dy into the same
 * expert-sorted row order (dys), and needs the forward's gate_up (saved, or recomputed
 * by gemm1). Padding rows of dys and xs are zero (dispatch zeroes them), so padding
 * rows contribute nothing to the weight gradients. */

/* dgrad of gemm2 with the SwiGLU backward in the epilogue, per 128-row block of e:
 *   da'[r]  = bf16(dys[r] W2_e)     fp32 sums, rounded, [I]   (W2_e is [H, I]: B is MN-major)
 *   g, u    = gate_up[r];  a = bf16(silu(g) * u)            (exactly the forward's a)
 *   dp_partial[r, nb] = sum over this tile's columns j of da'[j] * a[j]   (fp32)
 *   da      = p_r * da'     (p_r = row_weight[r])
 *   dh[r]   = bf16([da * u * silu'(g) ; da * silu(g)])      ([dg | du], like gate_up)
 *   act_p[r] = bf16(p * a)                                  (the A operand of dW2)
 * Rows with row_slot -1 (padding) get dh = 0, act_p = 0, dp_partial = 0. */
typedef struct mf_dgrad2_params {
    mf_rows rows;
    mf_operand dys, w2;               /* [rows_cap, H], [E_local, H, I] */
    const uint16_t *gate_up;          /* [rows_cap, 2I] bf16 [g | u] */
    const int32_t *row_slot;          /* [rows_cap] */
    const float *row_weight;          /* [rows_cap] p of each row (as gemm2's) */
    uint16_t *dh, *act_p;             /* out [rows_cap, 2I], [rows_cap, I] bf16 */
    float *dp_partial;                /* out [rows_cap, mf_dgrad2_dp_parts(I)] fp32 */
    int hidden, intermediate, num_sms;
    mf_arrivals rows_in;              /* dys rows, with their row_slot and row_weight */
} mf_dgrad2_params;

/* Column blocks of dgrad2 over I, i.e. the partial sums per row that make d p. */
int mf_dgrad2_dp_parts(int intermediate);
cudaError_t mf_sm90_gemm2_dgrad_swiglu_bwd_bf16(const mf_dgrad2_params *p, cudaStream_t stream);
/* The same in FP8 (H, I multiples of 128): dys e4m3 with MF_SCALES_1X128 scales
 * [H / 128, rows_cap], w2 = W2^T e4m3 [E_local, I, H] (K-major) with MF_SCALES_128X128
 * scales [E_local, I / 128, H / 128]; act_p = bf16(a), unweighted (the recipe's
 * dW2 = (p dy)^T a); mf_dgrad2_dp_parts_fp8(I) partial sums per row. */
int mf_dgrad2_dp_parts_fp8(int intermediate);
cudaError_t mf_sm90_gemm2_dgrad_swiglu_bwd_fp8(const mf_dgrad2_params *p, cudaStream_t stream);

/* dgrad of gemm1: combine[row_slot[r]] = bf16(dh[r] W13_e) for rows with row_slot >= 0
 * (W13_e is [2I, H]: B is MN-major). The reduce kernel then sums the K slots of a token
 * into dx, as in the forward. */
typedef struct mf_dgrad1_params {
    mf_rows rows;
    mf_operand dh, w13;               /* [rows_cap, 2I], [E_local, 2I, H] (or its gate half) */
    mf_scatter to;
    int hidden, intermediate, num_sms;
    const void *w13_up;               /* [E_local, I, H] bf16 up half, or NULL (packed) */
} mf_dgrad1_params;

cudaError_t mf_sm90_gemm1_dgrad_bwd_bf16(const mf_dgrad1_params *p, cudaStream_t stream);
/* The same in FP8 (H multiple of 128, I of 64): dh e4m3 with MF_SCALES_1X128 scales
 * [2I / 128, rows_cap], w13 = W13^T e4m3 [E_local, H, 2I] (K-major) with MF_SCALES_128X128
 * scales [E_local, H / 128, 2I / 128]. */
cudaError_t mf_sm90_gemm1_dgrad_bwd_fp8(const mf_dgrad1_params *p, cudaStream_t stream);

/* K-grouped weight gradient: for every local expert e, over its padded rows
 * [expert_offsets[e], expert_offsets[e+1]) (rows: expert_offsets, rows_cap, E_local):
 *     dw_e [M, N] = (accumulate ? dw_e : 0) + sum_r lhs[r, :]^T rhs[r, :]
 * in fp32, each output element owned by one CTA (no atomics: deterministic); or, into
 * dw_bf16 instead (write mode only), that fp32 sum rounded to nearest even.
 * dW2:  lhs = dys [rows, H] (M = H),   rhs = act_p [rows, I] (N = I)
 * dW13: lhs = dh  [rows, 2I] (M = 2I), rhs = xs [rows, H]   (N = H)
 * Both operands are MN-major (rows are the reduction). Experts without rows get zeros
 * (write mode) or are left as they are (accumulate). */
typedef struct mf_wgrad_params {
    mf_rows rows;
    mf_operand lhs, rhs;              /* [rows_cap, M], [rows_cap, N] */
    float *dw;                        /* [E_local, M, N] fp32, or NULL */
    uint16_t *dw_bf16;                /* [E_local, M, N] bf16, when dw is NULL */
    int m, n, accumulate, num_sms;
    /* [E_local + 1] device, from mf_expert_order: the experts (heavy first, those without
     * rows last), then how many have rows. Tiles are handed out in this order; with bf16
     * out the store warps write the zero tiles of experts without rows beside the GEMM
     * tiles. NULL: expert 0 first, every tile through the GEMM. Same bits either way. */
    const int32_t *expert_order;
    /* The output in two halves (dW13's gate and up, moefuse.h "W13 in two halves"): with
     * the one of these beside dw / dw_bf16 set, rows M/2.. of each expert go to it,
     * [E_local, M/2, N], and dw / dw_bf16 holds rows 0..M/2-1, [E_local, M/2, N]; M a
     * multiple of 256 (no 128-row tile spans both). NULL: dw / dw_bf16 holds all M rows. */
    float *dw_up;
    uint16_t *dw_bf16_up;
} mf_wgrad_params;

cudaError_t mf_sm90_wgrad_grouped_bf16(const mf_wgrad_params *p, cudaStream_t stream);
/* The same in FP8: lhs and rhs are the transposed e4m3 copies lhs^T [M, rows_cap] and
 * rhs^T [N, rows_cap] (K = rows contiguous) with MF_SCALES_TOKENS_128 scales
 * [rows_cap / 128, M] and [rows_cap / 128, N] (per 128 rows of each expert segment and per
 * column of lhs / rhs; mf_fp8_quantize_tokens writes both). */
cudaError_t mf_sm90_wgrad_grouped_fp8(const mf_wgrad_params *p, cudaStream_t stream);

/* The fused backward after dgrad2: dW2, dgrad1 and dW13 in one persistent kernel (the
 * same tiles as the kernels above, bit for bit). The tiles are taken in order, by
 * whichever CTA is free: every dW2 tile, then dW13's, then dgrad1's (with bf16 dW, the
 * empty experts' zero tiles are the store warps' work beside them, as in the wgrad
 * kernel). dgrad1 writes its dx slot rows over dys (dW2's lhs, in the same combine
 * buffer): its store warps wait until every dW2 tile has read its operands (a count,
 * relaxed add / acquire); its K loops and dW13's tiles wait for nothing. Takes
 * H % 256 == 0 and I % 256 == 0 (one 128 x 256 tile shape for all three;
 * mf_sm90_moe_fused_bwd_takes); the params must describe one layer:
 * dW2 M = H, N = I; dW13 M = 2I, N = H; rows_cap, num_local_experts, num_sms equal. */
typedef struct mf_moe_fused_bwd_params {
    mf_wgrad_params dw2;
    mf_dgrad1_params dgrad1;
    mf_wgrad_params dw13;
    uint32_t *scratch;                /* [2] (dW2 tiles read, the next tile to take),
                                       * zeroed by the launcher */
} mf_moe_fused_bwd_params;

int mf_sm90_moe_fused_bwd_takes(int hidden, int intermediate);
cudaError_t mf_sm90_moe_fused_bwd_bf16(const mf_moe_fused_bwd_params *p, cudaStream_t stream);

/* Each GEMM kernel file's kernels loaded into the current context now (check.h,
 * mf_load_kernels: CUDA's lazy loading must not load one in the middle of a call). */
cudaError_t mf_sm90_gemm1_swiglu_fwd_load(void);
cudaError_t mf_sm90_gemm2_combine_fwd_load(void);
cudaError_t mf_sm90_moe_fused_fwd_load(void);
cudaError_t mf_sm90_gemm2_dgrad_swiglu_load(void);
cudaError_t mf_sm90_gemm1_dgrad_bwd_load(void);
cudaError_t mf_sm90_wgrad_grouped_load(void);
cudaError_t mf_sm90_moe_fused_bwd_load(void);

#ifdef __cplusplus
}
#endif

#endif /* MOEFUSE_CUDA_GEMM_PARAMS_H */
