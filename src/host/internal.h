/* Internal interfaces between the host layer, the backends and the tests.
 * Not installed; include/moefuse.h is the public contract. */
#ifndef MOEFUSE_INTERNAL_H
#define MOEFUSE_INTERNAL_H

#include "moefuse.h"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- errors (src/host/status.c) ------------------------------------------------ */

/* Records a printf-style message for moefuse_last_error() and returns status. */
moefuse_status mf_fail(moefuse_status status, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* Clears the message; every public entry point calls it first. */
void mf_clear_error(void);

/* ---- the routing plan (src/host/plan.c) ----------------------------------------
 * Expert-sorted rows: the slots routed to local expert e occupy rows
 * expert_offsets[e] .. expert_offsets[e] + expert_counts[e] - 1, in increasing slot
 * order (slot = t * K + k), so the order is deterministic; each expert's segment is
 * then padded up to a multiple of row_align (padding rows have row_slot = -1). */
typedef struct mf_plan {
    int num_tokens;           /* T */
    int top_k;                /* K */
    int expert_begin;         /* first local expert (global id) */
    int num_local_experts;    /* E / R */
    int row_align;            /* segment padding, >= 1 */
    int num_rows;             /* expert_offsets[num_local_experts] */
    int32_t *expert_counts;   /* [num_local_experts] slots per local expert */
    int32_t *expert_offsets;  /* [num_local_experts + 1] first row of each expert */
    int32_t *slot_row;        /* [T * K] row of each slot, -1 when dropped / not local */
    int32_t *row_slot;        /* [mf_plan_max_rows] slot of each row, -1 for padding */
} mf_plan;

/* Upper bound on num_rows for T tokens: T*K + local experts * (row_align - 1). */
int64_t mf_plan_max_rows(int num_tokens, int top_k, int num_local_experts, int row_align);

/* Checks ids (range [-1, num_experts), no expert twice in a row) and fills the plan,
 * whose arrays the caller sized. On a bad id returns the status and touches nothing
 * but the plan. */
moefuse_status mf_plan_build(const int32_t *ids, int num_tokens, int top_k, int num_experts,
                             int expert_begin, int num_local_experts, int row_align,
                             mf_plan *plan);

/* Only the id checks of mf_plan_build. */
moefuse_status mf_check_ids(const int32_t *ids, int num_tokens, int top_k, int num_experts);

/* The buffers of a rank on a comm (see "expert parallelism" below). */
enum {
    MF_WIN_XS = 0,       /* received x rows        [rows_cap, H] bf16 */
    MF_WIN_DYS,          /* received dy rows       [rows_cap, H] bf16 */
    MF_WIN_ROW_SLOT,     /* received rows' source  [rows_cap] int32: slot * R + rank */
    MF_WIN_ROW_WEIGHT,   /* received rows' p       [rows_cap] fp32 */
    MF_WIN_COMBINE,      /* slot rows of y or dx   [max_tokens * K, H] bf16 */
    MF_WIN_DP,           /* d p of each slot       [max_tokens * K] fp32 */
    MF_WIN_SYNC,         /* epoch, flags, count matrix (see src/cuda/transport/ep_sync.h) */
    MF_WIN_COUNT,
    /* the pool's scratch, not windows: a call's intermediate rows (src/cuda/pipeline) */
    MF_POOL_ACT = MF_WIN_COUNT, /* [rows_cap, I] bf16 */
    MF_POOL_DH,          /* [rows_cap, 2I] bf16 */
    MF_POOL_DP_PARTIAL,  /* [rows_cap, dp_parts] fp32 */
    MF_POOL_GATE_UP,     /* [rows_cap, 2I] bf16, layers with MOEFUSE_RECOMPUTE only */
    MF_POOL_FP8,         /* FP8 layers only: their operands' codes and scales, the six
                            fp8_* arrays of mf_sizes one after another (mf_fp8_offsets) */
    MF_POOL_COUNT
};

/* ---- the layer and its backends (src/host/layer.c) ------------------------------ */

/* The config's own fields checked (no comm, no backend): create's first step, and the
 * memory estimate's (src/host/memory.c). */
moefuse_status mf_check_config_fields(const moefuse_config *c);

typedef struct mf_backend_ops {
    const char *name;
    moefuse_status (*create)(moefuse_layer *layer);
    void (*destroy)(moefuse_layer *layer);
    size_t (*saved_bytes)(const moefuse_layer *layer, int num_tokens);
    /* args were validated by the host layer (pointers, shapes, and ids where they
     * live in host memory); the backend computes. */
    moefuse_status (*forward)(moefuse_layer *layer, const moefuse_fwd_args *args,
                              void *stream);
    moefuse_status (*backward)(moefuse_layer *layer, const moefuse_bwd_args *args,
                               void *stream);
    /* moefuse_layer_check; NULL when the backend checks everything on the host. */
    moefuse_status (*check)(moefuse_layer *layer, void *stream);
    /* moefuse_quantize_weights(_halves) of weights in the backend's memory (args
     * validated; w13_up NULL: W13 packed); NULL: the host quantizes them
     * (src/host/fp8_weights.c). */
    moefuse_status (*quantize_weights)(const moefuse_layer *layer, moefuse_dtype dtype,
                                       const void *w13, const void *w13_up, const void *w2,
                                       const moefuse_fp8_weights *out, void *stream);
    /* moefuse_layer_memory's fields past the header; NULL: the backend has no device
     * memory (only saved_bytes is reported) */
    void (*memory)(const moefuse_layer *layer, moefuse_memory *out);
} mf_backend_ops;

struct moefuse_layer {
    moefuse_config cfg;
    int num_local_experts;    /* E / R */
    int expert_begin;         /* rank * E / R */
    const mf_backend_ops *ops;
    void *backend;            /* the backend's own state */
    moefuse_comm *comm;       /* NULL for R = 1 */
    size_t pool_need[MF_POOL_COUNT]; /* with a comm: what this layer needs of its rank's pool */
};

/* The alignment an array of `natural`-byte elements needs: 16 bytes on the CUDA backend
 * (TMA tiles and 16-byte vectors), its own on the host. */
static inline size_t mf_array_align(const moefuse_layer *layer, size_t natural) {
    return layer->cfg.backend == MOEFUSE_BACKEND_CUDA ? 16 : natural;
}

/* ---- expert parallelism: the comm (src/comm/comm.c) -------------------------------
 * Each rank owns "windows": buffers its peers write into (received rows, combine
 * slots, flags), and per-call scratch as large as its receive capacity. Both belong to
 * the comm, one pool per rank, shared by every layer of that rank on the comm: calls on
 * the comm run in stream order (moefuse.h), so one layer's call never overlaps
 * another's, and what a backward needs from its forward is in the caller's saved buffer,
 * never in the pool. A pool is sized by the largest layer created on it (a later, larger
 * layer grows it at create) and freed with the rank's last layer. Virtual ranks: the
 * windows are plain allocations of one GPU. NCCL: symmetric windows registered with the
 * caller's communicator, one rank per process (src/comm/nccl_comm.cu). */
enum { MF_COMM_VIRTUAL = 1, MF_COMM_NCCL = 2 };
#define MF_MAX_RANKS 64

/* One rank's buffers shared by its layers (allocated by src/cuda/transport/ep_pool.cu). */
typedef struct mf_pool {
    int num_layers;                     /* the rank's layers on the comm; 0: no pool */
    size_t bytes[MF_POOL_COUNT];        /* each buffer's size: the largest layer's need */
    void *buf[MF_POOL_COUNT];
    void *win_handle[MF_WIN_COUNT];     /* NCCL: each window's ncclWindow_t */
    void *peer_table;                   /* device [MF_WIN_COUNT][R]: every rank's windows */
} mf_pool;

struct moefuse_comm {
    int kind;                           /* MF_COMM_VIRTUAL or MF_COMM_NCCL */
    int num_ranks;
    int timeout_ms;
    void *nccl_comm;                    /* NCCL: the caller's ncclComm_t */
    int nccl_rank;                      /* NCCL: this process's rank */
    void *nccl_dev_comm;                /* NCCL: ncclDevComm (host copy) */
    void *nccl_vote;                    /* NCCL: device int of the create-time agreement */
    int num_experts;                    /* E of every layer on the comm (set by the first) */
    mf_pool pools[MF_MAX_RANKS];        /* virtual: every rank's; NCCL: this process's */
};

/* Layers of the comm in this process (every rank's for virtual ranks). */
int mf_comm_num_layers(const moefuse_comm *comm);
/* MOEFUSE_OK when every rank's pool holds what `layer` needs of it (virtual: every rank
 * has a layer as large; NCCL: the other ranks' were created collectively with this one);
 * else names the first rank that lacks it. */
moefuse_status mf_comm_check_ready(const moefuse_comm *comm, const moefuse_layer *layer,
                                   const char *call);

/* NCCL comms (src/comm/nccl_comm.cu, built when NCCL's device API headers and libnccl
 * are found): windows, their peer table, and the comm's own release. */
void mf_nccl_comm_release(moefuse_comm *comm);
/* A window's memory (zeroed) before any collective; its registration (collective) once
 * every rank agreed (mf_nccl_agree); both undone by mf_nccl_window_free. */
moefuse_status mf_nccl_window_alloc(moefuse_comm *comm, size_t bytes, void **ptr);
moefuse_status mf_nccl_window_register(moefuse_comm *comm, void *ptr, size_t bytes,
                                       void **handle);
void mf_nccl_window_free(moefuse_comm *comm, void *ptr, void *handle);
/* Collective: *any_failed = the largest (rank + 1) of the ranks passing failed != 0, 0
 * when none did. Every rank's layer create calls it once, whatever its own outcome, so a
 * rank that failed locally makes every rank fail instead of leaving them waiting in the
 * window registration. */
moefuse_status mf_nccl_agree(moefuse_comm *comm, int failed, int *any_failed);
moefuse_status mf_nccl_peer_table(moefuse_comm *comm, void *const handles[MF_WIN_COUNT],
                                  void **device_table);

/* ---- the CUDA backend's buffer sizes (src/host/sizing.c) ---------------------------
 * One arithmetic for what a CUDA layer allocates, what its saved buffer holds, and what
 * moefuse_layer_memory and moefuse_memory_estimate report; it needs no GPU. */
#define MF_ROWS_BLOCK 128              /* each expert's rows padded to it (the GEMM row tile) */
#define MF_RECV_CAPACITY_DEFAULT 2.0   /* config.recv_capacity_factor 0 (moefuse.h) */

/* Saved buffer sections (byte offsets), each at a 256-byte boundary (see
 * src/cuda/pipeline/workspace.cu). */
typedef struct mf_saved_layout {
    size_t header, counts, offsets, row_block_expert, slot_row, row_slot, gate_up, xs, total;
    int rows_cap;
} mf_saved_layout;

/* What the sizes take from the CUDA kernels: dgrad2's d p partials per row, the plan's
 * tokens per chunk, sizeof(mf_plan_state). A build without CUDA uses the same rules
 * (mf_cuda_tiles in layer.c). */
typedef struct mf_tiles {
    int dp_parts;
    int chunk_tokens;
    size_t plan_state_bytes;
} mf_tiles;
mf_tiles mf_cuda_tiles(int top_k, int intermediate, moefuse_precision precision);

typedef struct mf_sizes {
    int peers;                 /* a comm: rows come from every rank */
    int64_t recv_capacity;     /* rows this rank may receive per call, before padding */
    int rows_cap;              /* rows of the expert-sorted buffers: the capacity and each
                                  local expert's padding, in whole row blocks */
    int send_rows_cap;         /* peers: rows of the send plan */
    /* Buffers sized by rows_cap, indexed by MF_WIN_* / MF_POOL_*: with a comm, what this
     * layer needs of its rank's pool (shared); without, the layer's own (xs, combine,
     * row_weight and the scratch; the other windows 0) */
    size_t rows_bufs[MF_POOL_COUNT];
    /* the layer's own */
    size_t slot_rank, chunk_base, plan_state, gemm_num_rows, plan_ws, act_ready;
    size_t bwd_offsets, expert_order;
    size_t send_counts, send_offsets, send_rbe, send_slot_row, send_row_slot, send_scalars,
        dest_base;             /* peers only, else 0 */
    /* MOEFUSE_PRECISION_FP8_BLOCK, else 0: the row codes and scales (x, a, dy, [dg; du]
     * quantized 1 x 128, one at a time) and the weight gradients' token-quantized
     * operands (lhs: p dy or [dg; du]; rhs: a or x), src/cuda/pipeline/operands.cu */
    size_t fp8_rows, fp8_row_scales, fp8_lhs_t, fp8_lhs_scales, fp8_rhs_t, fp8_rhs_scales;
    size_t saved;              /* moefuse_saved_bytes(max_tokens) */
} mf_sizes;

/* The FP8 operands' six arrays (fp8_rows .. fp8_rhs_scales, in that order) in one buffer:
 * each one's offset, 256-byte aligned; returns the buffer's bytes (0 for BF16). With a
 * comm that buffer is the pool's MF_POOL_FP8 scratch, shared by the comm's layers as the
 * bf16 scratch is (they hold a call's operands only); without one each array is the
 * layer's own allocation. */
#define MF_FP8_ARRAYS 6
size_t mf_fp8_offsets(const mf_sizes *z, size_t offsets[MF_FP8_ARRAYS]);

/* Rows a rank may receive per call: without a comm T*K; with one,
 * recv_capacity_factor (0: MF_RECV_CAPACITY_DEFAULT) * max_tokens * K rounded up, at
 * most R * max_tokens * K (what every rank routing everything to it sends). */
int64_t mf_recv_capacity(const moefuse_config *c, int peers, int num_tokens);
/* Rows of an expert-sorted buffer for `slots` rows over `experts` local experts: each
 * expert's segment padded to MF_ROWS_BLOCK, the sum rounded to a whole block. */
int mf_padded_rows(int64_t slots, int experts);
mf_saved_layout mf_saved_layout_of(const moefuse_config *c, int peers, int num_tokens,
                                   moefuse_saved_mode mode);
mf_sizes mf_sizes_of(const moefuse_config *c, int peers, mf_tiles tiles);
/* The layer's own bytes of s (every field after rows_bufs but the FP8 operands', and
 * without a comm rows_bufs and the FP8 operands too). */
size_t mf_sizes_own(const mf_sizes *s);
size_t mf_sizes_sum(const size_t *bytes, int from, int to);
/* moefuse_memory's fields from the sizes of a layer and its rank's pool (pool: the
 * pool's bytes, or z->rows_bufs for a layer alone), src/host/memory.c. */
void mf_memory_from_sizes(const mf_sizes *z, const size_t *pool, int shared_layers,
                          moefuse_memory *m);

/* ---- FP8 block-scaled weights (src/host/fp8_weights.c) --------------------------
 * OK for NULL on a BF16 layer; on an FP8_BLOCK layer: shapes and scale rule the layer's,
 * every array non-NULL and aligned. name: the argument, e.g. "fwd_args.fp8_weights". */
moefuse_status mf_check_fp8_weights(const moefuse_layer *layer, const moefuse_fp8_weights *w,
                                    const char *name);

extern const mf_backend_ops mf_cpu_backend;  /* src/cpu/backend.c */
/* NULL when the library was built without nvcc. */
const mf_backend_ops *mf_cuda_backend(void);

/* ---- CPU routing helper (src/cpu/route.c) --------------------------------------- */
moefuse_status mf_cpu_route_forward(const moefuse_route_args *args);
moefuse_status mf_cpu_route_backward(const moefuse_route_bwd_args *args);

/* ---- bf16 (src/cpu/bf16.c): round-to-nearest-even, NaN stays NaN ---------------- */
float mf_bf16_to_float(uint16_t v);
uint16_t mf_float_to_bf16(float f);
void mf_bf16_to_float_n(const uint16_t *in, float *out, int64_t n);
void mf_float_to_bf16_n(const float *in, uint16_t *out, int64_t n);

#ifdef __cplusplus
}
#endif

#endif /* MOEFUSE_INTERNAL_H */
