/* Launchers of the CUDA kernels (one kernel per .cu file): extern "C", plain params
 * structs. The internal header of the CUDA backend: the pipeline (src/cuda/pipeline/)
 * calls the GEMMs through the ops table of gemm_ops.h and the rest directly; the kernel
 * tests (tests/kernels/) and the stage benchmark (bench/bench_forward_cuda.c) call them
 * directly too. Not installed; include/moefuse.h is the public contract.
 * The GEMMs' params and launchers are in gemm_params.h (included here); this file holds
 * the plan, dispatch, reduce and expert-parallelism transport kernels. */
#ifndef MOEFUSE_CUDA_KERNELS_H
#define MOEFUSE_CUDA_KERNELS_H

#include <cuda_runtime.h>
#include <stdint.h>

#include "gemm_params.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The experts' order the wgrad kernels take (mf_wgrad_params.expert_order):
 * order[0..E_local-1], by rows(e) = expert_offsets[e + 1] - expert_offsets[e]: experts
 * with 16 rows(e) > all rows, most rows first; the other experts with rows; those
 * without; ties by lower expert (a permutation whatever the offsets hold).
 * order[E_local]: how many experts have rows. One block. */
cudaError_t mf_expert_order(const int32_t *expert_offsets, int num_experts, int32_t *order,
                            cudaStream_t stream);

/* ---- plan, dispatch and reduce ------------------------------------------------------
 * Each launcher returns cudaGetLastError() of its launches. */

/* Errors found by the plan on the device. `record` is the layer's, kept over calls
 * until moefuse_layer_check reads and clears it; the rest is per call. */
typedef struct mf_plan_error {
    int32_t code;    /* 0, MOEFUSE_ERR_EXPERT_ID or MOEFUSE_ERR_DUPLICATE_EXPERT; EP also
                        MOEFUSE_ERR_TIMEOUT and MOEFUSE_ERR_CAPACITY */
    int32_t token;   /* the smallest bad token of the first failed call; EP: the peer */
    int32_t slot;    /* k of the bad id; EP: the stage (mf_ep_stage) */
    int32_t value;   /* the bad id; EP: the flag value seen */
    int32_t expected;/* EP: the flag value waited for */
    int32_t pad_[3];
} mf_plan_error;

typedef struct mf_plan_state {
    mf_plan_error record;       /* first error since the last moefuse_layer_check */
    uint32_t first_bad_token;   /* per call: atomicMin over blocks; UINT32_MAX = none */
    uint32_t blocks_done;       /* per call: the last block of the count pass scans */
    int32_t call_failed;        /* per call: 1 when this call's ids were bad; every later
                                   kernel of the call reads it and writes nothing */
    int32_t saved_rejected;     /* per backward call: 1 when its saved buffer failed the
                                   device check (EP: fails the call on every rank) */
} mf_plan_state;

/* Initial contents of an mf_plan_state (the kernels restore the per-call fields). */
#define MF_PLAN_STATE_INIT {{0, 0, 0, 0, 0, {0, 0, 0}}, 0xffffffffu, 0u, 0, 0}

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

/* The header of a saved buffer (int32 words): what the forward wrote it for, so that
 * the backward can refuse a buffer of another layer, T or saved mode. */
enum {
    MF_SAVED_MAGIC = 0,          /* MF_SAVED_MAGIC_VALUE */
    MF_SAVED_VERSION = 1,
    MF_SAVED_TOKENS = 2,
    MF_SAVED_TOP_K = 3,
    MF_SAVED_LOCAL_EXPERTS = 4,
    MF_SAVED_HIDDEN = 5,
    MF_SAVED_INTERMEDIATE = 6,
    MF_SAVED_ROWS_CAP = 7,
    MF_SAVED_MODE = 8,
    MF_SAVED_NUM_ROWS = 9,       /* written by the plan on the device */
    MF_SAVED_SEND_FAILED = 10,   /* rows from peers: this rank's ids were bad (it sent no rows) */
    MF_SAVED_HEADER_WORDS = 16,
};
#define MF_SAVED_MAGIC_VALUE 0x5653464d  /* "MFSV" */
#define MF_SAVED_VERSION_VALUE 2

/* The backward's device check of a saved buffer's plan (three small kernels: the plan
 * lives in device memory, and reading it on the host would need a synchronization):
 *   header  one block: header words, counts/offsets, row_block_expert; num_rows,
 *           call_failed and the offsets the weight gradients read come from here;
 *   slots   grid over slots and rows: slot_row / row_slot are inverse, every live
 *           slot sits in the segment of its ids[] expert, every local slot is routed
 *           (rows from peers: the slots only, the rows are the other ranks' sends);
 *   finish  one thread: on a failure, records MOEFUSE_ERR_SAVED_STATE, fails the call
 *           (gemm_num_rows 0, bwd_offsets 0), and restores the per-call fields.
 * So a stale or foreign buffer is reported by moefuse_layer_check instead of being
 * read out of bounds. */
typedef struct mf_saved_check_params {
    const int32_t *header;            /* [MF_SAVED_HEADER_WORDS] */
    const int32_t *counts;            /* [E_local] */
    const int32_t *offsets;           /* [E_local + 1] */
    const int32_t *row_block_expert;  /* [rows_cap / 128] */
    const int32_t *slot_row;          /* [T*K] */
    const int32_t *row_slot;          /* [rows_cap]; not read with rows from peers */
    const int32_t *ids;               /* [T, K] */
    int32_t want[MF_SAVED_NUM_ROWS];  /* header words 0..8 a matching forward wrote */
    int num_tokens, top_k, num_local_experts, expert_begin, rows_cap;
    int peers;                        /* the rows came from peers (expert parallelism) */
    struct mf_plan_state *state;
    int32_t *gemm_num_rows;
    int32_t *bwd_offsets;             /* [E_local + 1] out */
} mf_saved_check_params;

cudaError_t mf_saved_check(const mf_saved_check_params *p, cudaStream_t stream);

/* xs[slot_row[t*K + k]] = x[t] for every live slot; padding rows (row_slot -1, below
 * num_rows) get zeros, so padding rows of act and gate_up are exactly 0. Or (codes set)
 * the FP8 codes and scales of those rows. */
typedef struct mf_dispatch_params {
    /* one or two tensors of token rows moved with the same plan (the backward: dy and x) */
    const uint16_t *x[2];         /* [T, H], row stride x_stride */
    int64_t x_stride[2];
    uint16_t *xs[2];              /* out [rows_cap, H] */
    int num_tensors;              /* 0 (the rows' p only), 1 or 2 */
    const int32_t *slot_row;      /* [T*K] row of each slot, -1 when dropped */
    const int32_t *row_slot;      /* [rows_cap] slot of each row, -1 for padding */
    const int32_t *num_rows;      /* device scalar */
    const int32_t *call_failed;   /* device flag: nonzero = write nothing */
    int num_tokens;               /* T */
    int rows_cap;
    int hidden;                   /* H, multiple of 8 */
    int top_k;
    int num_sms;
    /* Optional (row_weight NULL: not written): each row's routing weight,
     * row_weight[slot_row[s]] = weights[s], 0 for padding rows below num_rows, so that
     * gemm2 and dgrad2 read it with one load instead of weights[row_slot[r]]. */
    const float *weights;         /* [T*K] p */
    float *row_weight;            /* out [rows_cap] */
    /* Optional (codes NULL: bf16 rows): tensor 0 (num_tensors 1; xs[0] not written)
     * quantized as it is copied, the FP8 recipe's 1 x 128 row tiles bit for bit as
     * mf_quantize_fp8_rows makes them from the bf16 rows: codes [rows_cap, H], scales
     * MN-major [H / 128, scale_ld], each token's tiles quantized once for its K rows;
     * padding rows get codes 0 and scales 1 (an all-zero tile's). H % 128 == 0. */
    uint8_t *codes;
    float *scales;
    int scale_ld;                 /* >= rows_cap, a multiple of 4 */
    int pow2;                     /* power-of-two scales */
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
    const int32_t *slot_row;      /* [T*K]; NULL: expert parallelism, dp_partial is [T*K]
                                     (one sum per slot, mf_ep_push_dp) and ids say which
                                     slots are routed */
    const int32_t *ids;           /* [T, K], with slot_row NULL */
    const int32_t *call_failed;   /* device flag: nonzero = write nothing */
    float *dweights;              /* out [T, K] */
    int num_tokens;
    int top_k;
} mf_reduce_dp_params;

cudaError_t mf_reduce_dp_f32(const mf_reduce_dp_params *p, cudaStream_t stream);

/* ---- expert parallelism (src/cuda/transport/ep_*.cu; layout of the sync window in ep_sync.h) ----
 * peers: the layer's device table of every rank's windows, peers[w * R + q] = window w
 * (MF_WIN_*, src/host/internal.h) of rank q. Flags carry (epoch << 1) | failed. */

/* Stages named by a timeout record. */
typedef enum mf_ep_stage {
    MF_EP_STAGE_COUNTS = 0,    /* forward: the per-expert row counts */
    MF_EP_STAGE_ROWS = 1,      /* forward: x rows */
    MF_EP_STAGE_COMBINE = 2,   /* forward: y slot rows */
    MF_EP_STAGE_READY = 3,     /* backward: every rank started the call */
    MF_EP_STAGE_BWD_ROWS = 4,  /* backward: dy and x rows */
    MF_EP_STAGE_BWD_COMBINE = 5/* backward: dx slot rows and d p */
} mf_ep_stage;

/* Forward, one block: a new epoch; this rank's send counts (its slots per expert, all E,
 * from the plan over all experts; zeros when its ids were bad) to every rank; the
 * wait for every rank's counts; then every rank's padded receive layout, from which:
 * this rank's receive layout (counts, offsets, row_block_expert, num_rows, in the
 * plan area) and dest_base[e] = the first row on e's rank of this rank's slots of e.
 * A rank receives the rows of expert e in source-rank order, each source's rows in its
 * slot order: the order of the one-rank plan on the ranks' concatenated tokens. */
typedef struct mf_ep_exchange_params {
    int rank, num_ranks, num_experts, num_local_experts;
    int rows_cap;                 /* rows of the receive buffers, multiple of 128 */
    /* also: arrival_target[b] += 128 for every receive block b of this call (the rows
     * gemm1 waits for): the sync window's targets (mf_ep_targets_word, placed by the
     * blocks of the largest layer sharing the window) */
    uint32_t *arrival_target;
    /* rows a receiver may take (config.recv_capacity_factor); more on any receiver fails
     * the call on every rank (MOEFUSE_ERR_CAPACITY: peer = the receiver, value = its
     * rows, expected = the capacity) */
    int recv_capacity;
    const int32_t *send_counts;   /* [E] */
    mf_plan_state *state;         /* call_failed in (bad ids) and out; error record */
    void *const *peers;
    uint32_t *sync;               /* this rank's sync window */
    int64_t timeout_ns;
    int32_t *recv_counts;         /* out [E_local] */
    int32_t *recv_offsets;        /* out [E_local + 1] */
    int32_t *row_block_expert;    /* out [rows_cap / 128] */
    int32_t *num_rows;            /* out */
    int32_t *gemm_num_rows;       /* out */
    int32_t *user_counts;         /* optional out [E_local] */
    int32_t *saved_header;        /* optional out: header_words, then num_rows */
    int32_t header_words[16];
    int header_send_failed_word;  /* header word that gets call_failed */
    int32_t *dest_base;           /* out [E] */
} mf_ep_exchange_params;

cudaError_t mf_ep_exchange_counts(const mf_ep_exchange_params *p, cudaStream_t stream);

/* Dispatch with expert parallelism: every routed slot's rows go to the rank of its
 * expert: x -> MF_WIN_XS (and dy -> MF_WIN_DYS in the backward), its source
 * (slot * R + rank) -> MF_WIN_ROW_SLOT and p -> MF_WIN_ROW_WEIGHT, at row
 *   forward:  dest_base[e] + plan_slot_row[s] - plan_offsets[e]   (also written to
 *             slot_row[s], which the backward reads; -1 when not routed)
 *   backward: slot_row[s]
 * This rank's own padding rows (from its receive layout) get zeros. The last block
 * raises the rows flag on every rank. Writes nothing of this rank's own slots when
 * call_failed; nothing at all when the call's comm failed. */
typedef struct mf_ep_push_params {
    int rank, num_ranks, num_experts, num_local_experts, top_k, hidden, num_tokens;
    const int32_t *ids;
    const float *weights;
    const uint16_t *x;
    int64_t x_stride;
    const uint16_t *dy;           /* backward only, else NULL */
    int64_t dy_stride;
    const int32_t *dest_base;     /* forward: [E] */
    const int32_t *plan_slot_row; /* forward: [T*K] the plan over all experts */
    const int32_t *plan_offsets;  /* forward: [E + 1] */
    int32_t *slot_row;            /* forward: out [T*K]; backward: in */
    int backward;
    const int32_t *recv_counts;   /* [E_local] this rank's receive layout */
    const int32_t *recv_offsets;  /* [E_local + 1] */
    const int32_t *gemm_num_rows; /* 0: no receive layout this call (it failed) */
    int count_arrivals;           /* forward: +1 per row written on the receiver's block
                                     counter (mf_ep_arrivals_word), own padding included */
    void *const *peers;
    uint32_t *sync;
    mf_plan_state *state;
    int num_sms;
    /* Forward, FP8 (x_codes 1; H % 128 == 0): x's rows quantized as they are pushed (the
     * recipe's 1 x 128 tiles, the rows quantizer's code, fp8_recipe.cuh) into the
     * receiver's MF_WIN_XS window: codes [rows_cap, H] from its start, scales MN-major
     * [H / 128, rows_cap] fp32 from byte MF_FP8_CODES_BYTES(rows_cap, H); own padding rows
     * get codes 0 and scales 1. rows_cap: every rank's (the same config). */
    int x_codes, pow2, rows_cap;
} mf_ep_push_params;

/* Where the scales of FP8 row codes [rows_cap, hidden] begin in a buffer holding both. */
#define MF_FP8_CODES_BYTES(rows_cap, hidden) ((int64_t)(rows_cap) * (int64_t)(hidden))

cudaError_t mf_ep_push_rows(const mf_ep_push_params *p, cudaStream_t stream);

/* One block: optionally a new epoch (the backward's first kernel), optionally raise
 * `flag` on every rank, optionally wait until every rank raised `flag` here. A wait
 * that runs out records MOEFUSE_ERR_TIMEOUT (peer, stage, values) and fails the call;
 * a flag raised by a failed peer fails the call too. Waits are skipped once the call
 * failed that way. */
typedef struct mf_ep_signal_params {
    int rank, num_ranks;
    void *const *peers;
    uint32_t *sync;
    int flag;                     /* MF_EP_FLAG_* (ep_sync.h) */
    int new_epoch, signal, wait;
    int stage;                    /* mf_ep_stage, for the record */
    mf_plan_state *state;
    int32_t *gemm_num_rows;       /* set to 0 when the call fails here */
    int64_t timeout_ns;
    /* The backward's READY (new_epoch): a saved buffer this rank's check rejected
     * (state->saved_rejected) raises the flag as failed, so that no rank pushes rows into a
     * layout nobody will read; and after a successful wait, arrival_target[b] += 128 for
     * the first *gemm_num_rows / 128 receive blocks, the rows the push will count in. */
    uint32_t *arrival_target;
} mf_ep_signal_params;

cudaError_t mf_ep_signal_wait(const mf_ep_signal_params *p, cudaStream_t stream);

/* FP8 with expert parallelism: a quantizer reads the received rows whole (its tiles are
 * not the GEMMs' row blocks), so before it the call waits, in one block, until every
 * receive block below *gemm_num_rows is counted in (rows_in: the counters and targets the
 * GEMMs' producers wait on). A wait that runs out is recorded and fails the call as the
 * producers' do, and sets *gemm_num_rows to 0: the quantizer and the GEMMs after it
 * touch no row. */
typedef struct mf_ep_wait_rows_params {
    mf_arrivals rows_in;
    uint32_t *sync;               /* this rank's sync window */
    int32_t *gemm_num_rows;       /* device scalar */
} mf_ep_wait_rows_params;

cudaError_t mf_ep_wait_rows(const mf_ep_wait_rows_params *p, cudaStream_t stream);

/* Backward: d p of every received row (the sum of its dgrad2 partials, in order) to
 * its source rank's MF_WIN_DP at its slot. */
typedef struct mf_ep_push_dp_params {
    const float *dp_partial;      /* [rows_cap, parts] */
    int parts;
    const int32_t *row_slot;      /* [rows_cap] slot * R + source */
    const int32_t *num_rows;      /* device scalar */
    int rank, num_ranks;
    void *const *peers;
    int num_sms;
} mf_ep_push_dp_params;

cudaError_t mf_ep_push_dp(const mf_ep_push_dp_params *p, cudaStream_t stream);

/* ---- FP8 block recipe quantizers (simt/fp8_quant.cu, weights simt/fp8_quant_weights.cu;
 * bit for bit src/cpu/fp8.c) ---------------------------------------------------------- */

/* 1 x 128 tiles along each row: codes [rows_cap, cols] (row stride cols), scales
 * MN-major [cols / 128, scale_ld], the scale of (row r, tile b) at scales[b * scale_ld + r].
 * Rows at or past *num_rows untouched (num_rows NULL: rows_cap). cols % 128 == 0.
 * Gathered (row_slot set, as in the tokens quantizer): row r is the token-major row
 * in[(row_slot[r] / top_k) * ld], zeros where row_slot[r] < 0 (padding). */
typedef struct mf_quantize_fp8_rows_params {
    const uint16_t *in;      /* bf16 [rows_cap, cols], row stride ld (a multiple of 8) */
    int64_t ld;
    int rows_cap;
    const int32_t *num_rows; /* device scalar, or NULL */
    int cols, pow2;          /* pow2: power-of-two scales */
    uint8_t *codes;
    float *scales;
    int scale_ld;            /* >= rows_cap, a multiple of 4 (16-byte TMA rows) */
    const int32_t *row_slot; /* [rows_cap] each row's slot t * top_k + k, -1 padding; or NULL */
    int top_k;
} mf_quantize_fp8_rows_params;

cudaError_t mf_quantize_fp8_rows(const mf_quantize_fp8_rows_params *p, cudaStream_t stream);

/* Tiles of 128 tokens per column, transposed, for the weight-gradient GEMMs (K = tokens):
 * the rows are expert-sorted, each expert's segment a multiple of 128, so every 128-row
 * block is one tile. value = in[r, c] (times row_weight[r] in fp32 when set: p dy);
 * codes_t [cols, rows_cap] (tokens contiguous), scales [rows_cap / 128, cols]. Blocks at
 * or past *num_rows untouched. rows_cap % 128 == 0, cols % 8 == 0. Gathered (row_slot
 * set): row r is the token-major row in[(row_slot[r] / top_k) * ld], zeros where
 * row_slot[r] < 0 (padding): the caller's x or dy, whose bf16 rows are not dispatched. */
typedef struct mf_quantize_fp8_tokens_params {
    const uint16_t *in;      /* bf16 [rows_cap, cols], row stride ld (a multiple of 8) */
    int64_t ld;
    int rows_cap;
    const int32_t *num_rows; /* device scalar (a multiple of 128), or NULL */
    int cols;
    const float *row_weight; /* [rows_cap], or NULL */
    int pow2;
    uint8_t *codes_t;
    float *scales;
    const int32_t *row_slot; /* [rows_cap], or NULL */
    int top_k;
} mf_quantize_fp8_tokens_params;

cudaError_t mf_quantize_fp8_tokens(const mf_quantize_fp8_tokens_params *p, cudaStream_t stream);

/* Both of the above from one read of the input: r and t describe the same rows (in, ld,
 * rows_cap, num_rows, cols, pow2, row_slot, top_k equal), cols % 128 == 0; the same codes
 * and scales as the two calls. */
#define MF_HAVE_QUANTIZE_FP8_ROWS_TOKENS 1
cudaError_t mf_quantize_fp8_rows_tokens(const mf_quantize_fp8_rows_params *r,
                                        const mf_quantize_fp8_tokens_params *t,
                                        cudaStream_t stream);

/* Weights in 128 x 128 blocks, both orientations: w [E, rows, cols] (bf16, or fp32 with
 * fp32 set) -> codes [E, rows, cols], scale [E, rows/128, cols/128], and codes_t
 * [E, cols, rows], scale_t [E, cols/128, rows/128] (the same codes transposed, the same
 * scales). rows and cols multiples of 128. With w_hi set, w is in two arrays: each
 * expert's rows below split_rows in w [E, split_rows, cols] and the others in w_hi
 * [E, rows - split_rows, cols] (W13's gate and up halves); split_rows a multiple of 128.
 * The kernel reads 16-byte pieces: w and w_hi 16-byte aligned (fp32) or 8-byte (bf16),
 * codes 4-byte, codes_t 16-byte, else cudaErrorMisalignedAddress. */
typedef struct mf_quantize_fp8_weights_params {
    const void *w, *w_hi;
    int split_rows;
    int fp32;
    int num_experts, rows, cols, pow2;
    uint8_t *codes, *codes_t;
    float *scale, *scale_t;
} mf_quantize_fp8_weights_params;

cudaError_t mf_quantize_fp8_weights(const mf_quantize_fp8_weights_params *p,
                                    cudaStream_t stream);

/* Each kernel file's kernels loaded into the current context now (check.h,
 * mf_load_kernels: CUDA's lazy loading must not load one in the middle of a call); the
 * GEMMs' in gemm_params.h. */
cudaError_t mf_plan_load(void);
cudaError_t mf_dispatch_rows_load(void);
cudaError_t mf_reduce_slots_load(void);
cudaError_t mf_reduce_dp_load(void);
cudaError_t mf_expert_order_load(void);
cudaError_t mf_saved_check_load(void);
cudaError_t mf_ep_exchange_counts_load(void);
cudaError_t mf_ep_push_rows_load(void);
cudaError_t mf_ep_push_dp_load(void);
cudaError_t mf_ep_signal_wait_load(void);
cudaError_t mf_quantize_fp8_load(void);
cudaError_t mf_quantize_fp8_weights_load(void);

#ifdef __cplusplus
}
#endif

#endif /* MOEFUSE_CUDA_KERNELS_H */
