/* What the CUDA pipeline's files share: the layer state, the execution plan resolved at
 * create, the saved layout (described in workspace.cu), the params builders of the
 * stages (stages.cu), and the transport interface that the forward (forward.cu) and the
 * backward (backward.cu) call where moving rows differs:
 *   local  (transport/local.cu)  no comm, R = 1: a plan over the local experts and the
 *          token-major dispatch of x (and of dy and x in one pass in the backward);
 *   peers  (transport/peers.cu)  a comm (virtual ranks or NCCL): a send plan, the count
 *          exchange, rows pushed beside the GEMMs (which wait for their arrival),
 *          combine rows written into the source ranks' windows, signals; the windows and
 *          the scratch sized by the receive capacity are its rank's pool on the comm,
 *          shared with the rank's other layers (transport/ep_pool.cu). */
#ifndef MOEFUSE_CUDA_PIPELINE_STATE_H
#define MOEFUSE_CUDA_PIPELINE_STATE_H

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "gemm_ops.h"
#include "internal.h"
#include "kernels.h"

namespace mf {
namespace pipeline {

struct cuda_state;
struct transport;
struct operand_prep;

/* Every setting of a layer's calls, fixed at create; the pipeline reads these, never
 * whether a buffer was allocated. */
struct exec_plan {
    const mf_gemm_ops *gemm;    /* the GEMMs of (architecture, precision) */
    const transport *net;       /* local (no comm) or peers */
    const operand_prep *operands; /* what the GEMMs read: bf16 as is, or quantized to FP8 */
    /* peers: a rank's rows come from every rank, so the row buffers and the saved state
     * are sized by the receive capacity (config.recv_capacity_factor), a call with T = 0
     * still serves the others, and the rows' sources are sent again by the backward
     * instead of being saved */
    bool rows_from_peers;
    bool fused_forward;         /* MOEFUSE_PIPELINE_FUSED and a shape the fused forward takes */
    /* MOEFUSE_PIPELINE_FUSED and a shape the fused backward takes (its scratch is
     * act_ready too) */
    bool fused_backward;
    /* staged dW13 before the wait for the other ranks' dx rows (peers: it fills that
     * wait), else after the reduces (local: they read dgrad1's slot rows right after it) */
    bool dw13_before_wait;
    /* FP8: the forward's dispatch (local: the gather, peers: the push) quantizes x as it
     * moves it (no bf16 rows for a quantizer to read again) unless the forward saves x's
     * rows */
    bool dispatch_quantizes_x;
    /* FP8 on the local transport: the backward's quantizers read dy and x where the caller
     * has them (gathered through row_slot), so its dispatch writes no bf16 rows of them */
    bool quantizers_gather;
    moefuse_saved_mode saved_mode;
    int block_m;                /* the GEMMs' row tile = the plan's row block */
    int dp_parts;               /* d p partial sums per row (dgrad2's column blocks) */
    int num_sms;                /* the GEMMs' persistent grid: SMs, or SMs / R for virtual ranks */
    int push_sms;               /* peers: SMs of the row push */
    int beside_push_sms;        /* peers: the GEMMs' grid while the push runs beside them */
    int plan_experts;           /* experts the plan sorts into: E_local, or E (peers' sends) */
};

/* Saved buffer sections (byte offsets), each at a 256-byte boundary (src/host/sizing.c). */
typedef mf_saved_layout saved_layout;
static_assert(MF_ROWS_BLOCK == MF_ROW_BLOCK_M, "the host sizes pad to the GEMMs' row block");

struct cuda_state {
    exec_plan plan;
    mf_sizes sizes;             /* every buffer's bytes, from the config (src/host/sizing.c) */
    int device;
    int num_ranks, rank;
    /* Peers: the fields marked "pool" point into the rank's pool on the comm, set by the
     * transport's bind at the start of every call (a later layer's create may have grown
     * the pool); the layer owns the rest. */
    uint16_t *xs;               /* [rows_cap, H]; peers: window MF_WIN_XS (pool); FP8 on one
                                   GPU: none (x's codes from the dispatch, the backward's
                                   quantizers gather x) */
    uint16_t *act;              /* [rows_cap, I]; peers: pool */
    uint16_t *combine;          /* local: [rows_cap, H] (also dys, but for FP8); peers: [max_tokens*K, H] window (pool) */
    float *row_weight;          /* [rows_cap] each row's p: local the dispatch's; peers: window (pool) */
    int32_t *slot_rank;         /* [max_tokens * K] */
    int32_t *chunk_base;        /* [chunks(max_tokens), plan_experts] */
    mf_plan_state *plan_state;  /* error record and per-call flags */
    int32_t *gemm_num_rows;     /* device scalar */
    void *plan_ws;              /* layout_for(max_tokens, RECOMPUTE): the plan when saved = NULL */
    uint32_t *act_ready;        /* [rows_cap / block_m + 1] the fused kernels' scratch
                                 * (forward: gemm1 tiles done per row block, and the tile
                                 * counter; backward: mf_moe_fused_bwd_params.scratch) */
    /* backward */
    uint16_t *dh;               /* [rows_cap, 2I]; peers: pool */
    float *dp_partial;          /* [rows_cap, dp_parts]; peers: pool */
    uint16_t *gate_up;          /* [rows_cap, 2I], MOEFUSE_RECOMPUTE only; peers: pool */
    int32_t *bwd_offsets;       /* [E_local + 1]: the checked expert_offsets, 0s on failure */
    int32_t *expert_order;      /* [E_local + 1]: the wgrad tiles' expert order */
    /* peers (transport/peers.cu) */
    uint16_t *dys;              /* window [rows_cap, H] (pool) */
    int32_t *row_slot;          /* window [rows_cap] (pool) */
    float *dp_slot;             /* window [max_tokens * K] (pool) */
    uint32_t *sync;             /* window, mf_ep_sync_bytes (pool) */
    uint32_t *targets;          /* in sync: the arrival targets, placed by the blocks of
                                 * the pool's largest layer (pool) */
    void **peers;               /* device [MF_WIN_COUNT * R] (pool) */
    void *grow[MF_POOL_COUNT];  /* create: this layer's larger buffers for the pool */
    void *grow_table;           /* create: the pool's first peer table */
    bool joined;                /* counted in its rank's pool */
    cudaStream_t side;          /* the row push runs here, beside the GEMMs */
    cudaEvent_t fork, join;     /* caller's stream -> side -> caller's stream */
    int32_t *send_counts;       /* [E] the plan over all experts (this rank's sends) */
    int32_t *send_offsets;      /* [E + 1] */
    int32_t *send_rbe;          /* [send_rows_cap / block_m] */
    int32_t *send_slot_row;     /* [max_tokens * K] */
    int32_t *send_row_slot;     /* [send_rows_cap] */
    int32_t *send_scalars;      /* [2]: num_rows, gemm rows of the send plan */
    int32_t *dest_base;         /* [E] */
    /* FP8 (pipeline/operands.cu) */
    uint8_t *fp8_rows;          /* [rows_cap, max(H, 2I)] a row GEMM's A, 1 x 128 codes */
    float *fp8_row_scales;      /* [max(H, 2I) / 128, rows_cap rounded up to 4] */
    uint8_t *fp8_lhs_t;         /* [max(H, 2I), rows_cap] a weight gradient's lhs^T */
    float *fp8_lhs_scales;      /* [rows_cap / 128, max(H, 2I)] */
    uint8_t *fp8_rhs_t;         /* [max(H, I), rows_cap] its rhs^T */
    float *fp8_rhs_scales;      /* [rows_cap / 128, max(H, I)] */
};

inline cuda_state *state_of(const moefuse_layer *layer) { return (cuda_state *)layer->backend; }

/* mode: what the forward keeps (cfg.saved_mode), MOEFUSE_RECOMPUTE for the plan only.
 * Rows of the expert-sorted buffers of a call with T tokens (lay.rows_cap): local, its
 * T*K slots and each local expert's padding; peers, the receive capacity plus padding,
 * whatever T is. */
saved_layout layout_for(const moefuse_layer *layer, int num_tokens, moefuse_saved_mode mode);
/* The saved header a forward writes (words 0 .. MF_SAVED_MODE; the rest 0). */
void header_words(const moefuse_layer *layer, int num_tokens, int rows_cap,
                  moefuse_saved_mode mode, int32_t words[MF_SAVED_HEADER_WORDS]);

/* cudaMalloc with a clear error (MOEFUSE_ERR_NO_MEMORY / _CUDA naming `what`). */
moefuse_status alloc(void **p, size_t bytes, const char *what);

/* s->field = alloc(bytes), or return its status from the enclosing function. */
#define MF_ALLOC_FIELD(s, field, bytes)                                                    \
    do {                                                                                   \
        const moefuse_status st_ = alloc((void **)&(s)->field, (size_t)(bytes), #field);   \
        if (st_ != MOEFUSE_OK) return st_;                                                 \
    } while (0)

/* return the status of a call that failed */
#define MF_TRY(expr)                                                                       \
    do {                                                                                   \
        const moefuse_status st_ = (expr);                                                 \
        if (st_ != MOEFUSE_OK) return st_;                                                 \
    } while (0)

/* ---- one call ---------------------------------------------------------------------- */

/* A call's buffers: its plan area (the caller's saved buffer, or the layer's plan_ws
 * for a forward without one) and where its expert-sorted rows live (the transport's
 * locate_rows). */
struct call_bufs {
    int num_tokens;
    moefuse_saved_mode mode;    /* what the plan area holds */
    saved_layout lay;
    char *base;                 /* the plan area */
    const int32_t *rbe;         /* base + lay.row_block_expert */
    uint16_t *xs;               /* x rows */
    uint16_t *dys;              /* dy rows (backward) */
    const int32_t *row_slot;    /* each row's slot (peers: slot * R + source rank) */
    /* forward, exec_plan.dispatch_quantizes_x, x's rows not saved: the dispatch writes x's
     * FP8 row codes and scales (fp8_row_codes_out) instead of bf16 rows into xs, and
     * gemm1's hook takes them as they are */
    bool x_codes;
    /* backward, exec_plan.quantizers_gather: dy's (and, unless the forward saved them,
     * x's) token-major rows where the caller has them; the dispatch moves neither as bf16
     * rows and the FP8 token quantizers read them through row_slot (NULL: from dys / xs).
     * With dy_tokens set the dispatch writes dy's FP8 row codes as the forward's writes
     * x's (a recomputed gemm1 reads x's codes from the same workspace first: backward.cu
     * dispatches them before it), and dgrad2's hook makes only p dy's token codes */
    const uint16_t *dy_tokens, *x_tokens;
    int64_t dy_tokens_stride, x_tokens_stride;
};

/* The token-major rows a dispatch moves: x (forward), dy and x (backward). */
struct token_rows {
    const int32_t *ids;
    const float *weights;
    const uint16_t *x;
    int64_t x_stride;
    const uint16_t *dy;         /* backward, else NULL */
    int64_t dy_stride;
};

/* How a GEMM beside the dispatch waits for its rows, on how many SMs: rows_in.arrivals
 * NULL, they are all there (the params stay as the builders left them). */
struct row_arrivals {
    mf_arrivals rows_in;
    int num_sms;
};

/* The points of a call where the transports differ beyond the dispatch. */
enum sync_point {
    kForwardCombined,    /* after gemm2: every rank's combine rows are in */
    kBackwardStart,      /* after the saved check: every rank has started the call */
    kBackwardRowsIn,     /* after dgrad2: every rank's dy and x rows are in */
    kBackwardSentBack,   /* after dgrad1 (and the fused dW): d p sent, DONE raised */
    kBackwardCombined,   /* before the reduces: every rank's dx rows are in */
};

struct transport {
    const char *name;
    /* its own buffers and streams, and what it needs of shared ones: local work only */
    moefuse_status (*create)(moefuse_layer *layer, cuda_state *s);
    /* then, whatever `created` (the outcome of the create so far): peers, the ranks agree
     * that every rank's create succeeded (NCCL: an all-reduce; no rank registers a window
     * unless all can), then the layer joins its rank's pool (grown where it needs more,
     * windows registered) and the peer tables are written. Returns the create's status. */
    moefuse_status (*connect)(moefuse_layer *layer, cuda_state *s, moefuse_status created);
    /* frees what create made and leaves the pool; also undoes a partial create */
    void (*destroy)(moefuse_layer *layer, cuda_state *s);
    /* at the start of every call: the state's pointers to shared buffers (peers: its
     * rank's pool) */
    void (*bind)(moefuse_layer *layer, cuda_state *s);
    /* c->xs, c->dys, c->row_slot of a call whose lay, base and mode are set */
    void (*locate_rows)(const moefuse_layer *layer, call_bufs *c);
    /* forward: the plan (ids checked), this rank's receive layout and the saved header,
     * into the plan area */
    moefuse_status (*plan)(moefuse_layer *layer, const moefuse_fwd_args *a,
                           const call_bufs &c, cudaStream_t stream);
    /* the rows (and each row's p) into c's expert-sorted buffers */
    moefuse_status (*dispatch)(moefuse_layer *layer, const token_rows &rows,
                               const call_bufs &c, cudaStream_t stream);
    row_arrivals (*arrivals)(const moefuse_layer *layer, const call_bufs &c, bool backward);
    /* where gemm2 and dgrad1 write each of c's rows: its slot row of this rank's combine
     * workspace, or of its source rank's combine window */
    mf_scatter (*scatter)(const moefuse_layer *layer, const call_bufs &c);
    moefuse_status (*sync)(moefuse_layer *layer, sync_point at, const call_bufs &c,
                           cudaStream_t stream);
    /* where the reduce of d p reads: dp_partial, parts, slot_row, ids */
    void (*dp_sums)(const moefuse_layer *layer, const call_bufs &c, const int32_t *ids,
                    mf_reduce_dp_params *rd);
};

extern const transport kLocal;   /* transport/local.cu */
extern const transport kPeers;   /* transport/peers.cu */

/* ---- a rank's pool on a comm (transport/ep_pool.cu) ---------------------------------- */

/* Local, before any collective: layer->pool_need, and s->grow of each pool buffer this
 * layer needs larger than the pool holds (windows zeroed), and the pool's peer table
 * when it has none. */
moefuse_status pool_prepare(moefuse_layer *layer, cuda_state *s);
/* Once every rank's create succeeded: the grown buffers replace the pool's (NCCL: the
 * old windows deregistered, the new registered, collectively), the layer counted, and
 * the peer tables rewritten where a window changed (virtual ranks: every rank's table,
 * and every rank's sync window zeroed). */
moefuse_status pool_join(moefuse_layer *layer, cuda_state *s);
/* Frees s->grow; the rank's last layer frees the pool (NCCL: collectively). */
void pool_leave(moefuse_layer *layer, cuda_state *s);
/* The state's pool fields from the pool. */
void pool_bind(const moefuse_layer *layer, cuda_state *s);

/* A call's plan area and rows. */
call_bufs call_for(const moefuse_layer *layer, int num_tokens, moefuse_saved_mode mode,
                   const void *saved);

/* The backend's entry points (mf_backend_ops): forward.cu, backward.cu, errors.cu. */
moefuse_status forward(moefuse_layer *layer, const moefuse_fwd_args *a, void *stream);
moefuse_status backward(moefuse_layer *layer, const moefuse_bwd_args *a, void *stream);
moefuse_status check(moefuse_layer *layer, void *stream);

/* ---- operands ------------------------------------------------------------------------
 * The layer's precision between the params builders (stages.cu) and each launch
 * (pipeline/operands.cu): create allocates its workspaces; each hook makes the params'
 * operands what the GEMM reads (bf16: unchanged; FP8: the quantized rows and weights,
 * `w` the caller's quantized weights, NULL with bf16). */
struct operand_prep {
    moefuse_status (*create)(moefuse_layer *layer, cuda_state *s);
    moefuse_status (*gemm1)(const moefuse_layer *layer, const call_bufs &c,
                            const moefuse_fp8_weights *w, mf_gemm1_params *p, cudaStream_t stream);
    moefuse_status (*gemm2)(const moefuse_layer *layer, const call_bufs &c,
                            const moefuse_fp8_weights *w, mf_gemm2_params *p, cudaStream_t stream);
    moefuse_status (*dgrad2)(const moefuse_layer *layer, const call_bufs &c,
                             const moefuse_fp8_weights *w, mf_dgrad2_params *p,
                             cudaStream_t stream);
    moefuse_status (*dgrad1)(const moefuse_layer *layer, const call_bufs &c,
                             const moefuse_fp8_weights *w, mf_dgrad1_params *p,
                             cudaStream_t stream);
    moefuse_status (*dw2)(const moefuse_layer *layer, const call_bufs &c,
                          const moefuse_fp8_weights *w, mf_wgrad_params *p, cudaStream_t stream);
    moefuse_status (*dw13)(const moefuse_layer *layer, const call_bufs &c,
                           const moefuse_fp8_weights *w, mf_wgrad_params *p, cudaStream_t stream);
};

/* FP8 (operands.cu): where a dispatch writes the row codes and scales of its rows
 * (mf_dispatch_params.codes, scales, scale_ld, pow2), the layer's row-code workspace. */
void fp8_row_codes_out(const moefuse_layer *layer, const call_bufs &c, mf_dispatch_params *dp);

extern const operand_prep kBf16Operands;   /* pipeline/operands.cu */
extern const operand_prep kFp8Operands;

/* ---- the stages' params (stages.cu), on the layer's workspaces ----------------------
 * The caller sets what differs by direction and transport:
 *   gemm2:  row_weight, the scatter target (to);  dgrad2: row_weight;  dgrad1: the
 *   scatter target; gemm1, dgrad2: the row arrivals (with_arrivals)
 * w13, w13_up: the caller's bf16 W13, packed (w13_up NULL) or in two halves; an FP8
 * layer's operand hooks replace them by its packed quantized weights. */
mf_gemm1_params gemm1_params(const moefuse_layer *layer, const call_bufs &c,
                             const uint16_t *w13, const uint16_t *w13_up, uint16_t *gate_up);
mf_gemm2_params gemm2_params(const moefuse_layer *layer, const call_bufs &c, const uint16_t *w2);
mf_dgrad2_params dgrad2_params(const moefuse_layer *layer, const call_bufs &c,
                               const uint16_t *w2, const uint16_t *gate_up);
mf_dgrad1_params dgrad1_params(const moefuse_layer *layer, const call_bufs &c,
                               const uint16_t *w13, const uint16_t *w13_up);
/* dW2 = dys^T act_p and dW13 = dh^T xs of the call, into its fp32 or bf16 buffers (dW13:
 * in two halves when the args give dw13_up / dw13_up_bf16).
 * rows_cap 0: the gradients are written as zeros (accumulating: left as they are). */
mf_wgrad_params dw2_params(const moefuse_layer *layer, const moefuse_bwd_args *a, int rows_cap,
                           const uint16_t *dys);
mf_wgrad_params dw13_params(const moefuse_layer *layer, const moefuse_bwd_args *a,
                            int rows_cap, const uint16_t *xs);
mf_reduce_params reduce_params(const moefuse_layer *layer, const int32_t *ids, int num_tokens,
                               uint16_t *out, int64_t out_stride);

template <class GemmParams>
void with_arrivals(GemmParams *p, const row_arrivals &w) {
    if (!w.rows_in.arrivals) return;
    p->rows_in = w.rows_in;
    p->num_sms = w.num_sms;
}

}  // namespace pipeline
}  // namespace mf

#endif /* MOEFUSE_CUDA_PIPELINE_STATE_H */
