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

/* ---- the layer and its backends (src/host/layer.c) ------------------------------ */

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
    /* moefuse_quantize_weights of weights in the backend's memory (args validated);
     * NULL: the host quantizes them (src/host/fp8_weights.c). */
    moefuse_status (*quantize_weights)(const moefuse_layer *layer, moefuse_dtype dtype,
                                       const void *w13, const void *w2,
                                       const moefuse_fp8_weights *out, void *stream);
} mf_backend_ops;

struct moefuse_layer {
    moefuse_config cfg;
    int num_local_experts;    /* E / R */
    int expert_begin;         /* rank * E / R */
    const mf_backend_ops *ops;
    void *backend;            /* the backend's own state */
    moefuse_comm *comm;       /* NULL for R = 1 */
};

/* ---- expert parallelism: the comm (src/comm/comm.c) -------------------------------
 * Each rank's layer owns "windows": buffers its peers write into (received rows,
 * combine slots, flags). The comm keeps every rank's window base pointers, so a
 * backend can build the table of peer pointers its kernels use. Virtual ranks: the
 * windows are plain allocations of one GPU. NCCL: symmetric windows registered with the
 * caller's communicator, one rank (layer) per process (src/comm/nccl_comm.cu). */
enum {
    MF_WIN_XS = 0,       /* received x rows        [rows_cap, H] bf16 */
    MF_WIN_DYS,          /* received dy rows       [rows_cap, H] bf16 */
    MF_WIN_ROW_SLOT,     /* received rows' source  [rows_cap] int32: slot * R + rank */
    MF_WIN_ROW_WEIGHT,   /* received rows' p       [rows_cap] fp32 */
    MF_WIN_COMBINE,      /* slot rows of y or dx   [max_tokens * K, H] bf16 */
    MF_WIN_DP,           /* d p of each slot       [max_tokens * K] fp32 */
    MF_WIN_SYNC,         /* epoch, flags, count matrix (see src/cuda/transport/ep_sync.h) */
    MF_WIN_COUNT
};

enum { MF_COMM_VIRTUAL = 1, MF_COMM_NCCL = 2 };
#define MF_MAX_RANKS 64

struct moefuse_comm {
    int kind;                           /* MF_COMM_VIRTUAL or MF_COMM_NCCL */
    int num_ranks;
    int timeout_ms;
    int num_attached;                   /* layers of this process on the comm */
    void *nccl_comm;                    /* NCCL: the caller's ncclComm_t */
    int nccl_rank;                      /* NCCL: this process's rank */
    void *nccl_dev_comm;                /* NCCL: ncclDevComm (host copy) */
    moefuse_layer *layers[MF_MAX_RANKS];               /* NULL: rank not created */
    void *windows[MF_MAX_RANKS][MF_WIN_COUNT];         /* each rank's window bases */
    size_t sync_bytes[MF_MAX_RANKS];                   /* size of each MF_WIN_SYNC */
    void *peer_table[MF_MAX_RANKS];   /* each rank's device table [MF_WIN_COUNT][R] */
};

/* Records rank's layer and windows (virtual ranks: one layer per rank; NCCL: counts the
 * layers); the caller (a backend) then refreshes the peer tables when mf_comm_complete
 * says every rank is in. mf_comm_detach undoes one attach. */
moefuse_status mf_comm_attach(moefuse_comm *comm, int rank, moefuse_layer *layer,
                              void *const windows[MF_WIN_COUNT], size_t sync_bytes,
                              void *peer_table);
void mf_comm_detach(moefuse_comm *comm, int rank);
/* Every rank's layer is in: all R for virtual ranks; always for NCCL (the other
 * ranks' layers are in their processes, created collectively with this one). */
int mf_comm_complete(const moefuse_comm *comm);
/* MOEFUSE_OK when every rank's layer exists; else names the first missing rank. */
moefuse_status mf_comm_check_ready(const moefuse_comm *comm, const char *call);

/* NCCL comms (src/comm/nccl_comm.cu, built when NCCL's device API headers and libnccl
 * are found): windows, their peer table, and the comm's own release. */
void mf_nccl_comm_release(moefuse_comm *comm);
moefuse_status mf_nccl_window_alloc(moefuse_comm *comm, size_t bytes, void **ptr,
                                    void **handle);
void mf_nccl_window_free(moefuse_comm *comm, void *ptr, void *handle);
moefuse_status mf_nccl_peer_table(moefuse_comm *comm, void *const handles[MF_WIN_COUNT],
                                  void **device_table);

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
