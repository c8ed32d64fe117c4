/* What the CUDA backend's two files share: backend.cu (layer state, one rank, the
 * saved-buffer check, moefuse_layer_check) and backend_ep.cu (expert parallelism).
 * The saved-buffer layout and the workspaces are described in backend.cu. */
#ifndef MOEFUSE_CUDA_BACKEND_H
#define MOEFUSE_CUDA_BACKEND_H

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "internal.h"
#include "kernels.h"

namespace mf {
namespace backend {

enum {
    kHeaderMagic = 0,        /* kSavedMagic */
    kHeaderVersion = 1,
    kHeaderTokens = 2,
    kHeaderTopK = 3,
    kHeaderLocalExperts = 4,
    kHeaderHidden = 5,
    kHeaderIntermediate = 6,
    kHeaderRowsCap = 7,
    kHeaderSavedMode = 8,
    kHeaderNumRows = 9,      /* written by the plan on the device */
    kHeaderSendFailed = 10,  /* EP: this rank's ids were bad (it sent no rows) */
    kHeaderWords = 16,
};
constexpr int32_t kSavedMagic = 0x5653464d;  /* "MFSV" */
constexpr int32_t kSavedVersion = 2;

struct saved_layout {
    size_t header, counts, offsets, row_block_expert, slot_row, row_slot, gate_up, xs, total;
    int rows_cap;
};

struct cuda_state {
    int device;
    int num_sms;                /* the GEMMs' persistent grid: SMs, or SMs / R for virtual ranks */
    int num_ranks, rank;
    uint16_t *xs;               /* [rows_cap, H]; EP: window MF_WIN_XS */
    uint16_t *act;              /* [rows_cap, I] */
    uint16_t *combine;          /* R = 1: [rows_cap, H] (also dys); EP: [max_tokens*K, H] window */
    float *row_weight;          /* [rows_cap] each row's p: R = 1 the dispatch's; EP: window */
    int32_t *slot_rank;         /* [max_tokens * K] */
    int32_t *chunk_base;        /* [chunks(max_tokens), E_local] (EP: E) */
    mf_plan_state *plan_state;  /* error record and per-call flags */
    int32_t *gemm_num_rows;     /* device scalar */
    void *plan_ws;              /* layout_for(max_tokens, RECOMPUTE): the plan when saved = NULL */
    uint32_t *act_ready;        /* [rows_cap / 128 + 1] fused forward: gemm1 tiles done per
                                 * row block, and the tile counter; NULL when staged */
    /* backward */
    int dp_parts;               /* mf_dgrad2_dp_parts(I) */
    uint16_t *dh;               /* [rows_cap, 2I] */
    float *dp_partial;          /* [rows_cap, dp_parts] */
    uint16_t *gate_up;          /* [rows_cap, 2I], MOEFUSE_RECOMPUTE only */
    int32_t *bwd_offsets;       /* [E_local + 1]: the checked expert_offsets, 0s on failure */
    int32_t *expert_order;      /* [E_local + 1]: the wgrad tiles' expert order (order_experts) */
    /* expert parallelism (R > 1), see backend_ep.cu */
    uint16_t *dys;              /* window [rows_cap, H] */
    int32_t *row_slot;          /* window [rows_cap] */
    float *dp_slot;             /* window [max_tokens * K] */
    uint32_t *sync;             /* window, mf_ep_sync_bytes */
    void *win_handle[MF_WIN_COUNT]; /* NCCL: each window's ncclWindow_t */
    bool attached;              /* mf_comm_attach succeeded */
    int push_sms;               /* forward: SMs of the row push, beside gemm1's */
    cudaStream_t side;          /* forward: the row push runs here, beside gemm1 */
    cudaEvent_t fork, join;     /* caller's stream -> side -> caller's stream */
    void **peers;               /* device [MF_WIN_COUNT * R] */
    int32_t *send_counts;       /* [E] the plan over all experts (this rank's sends) */
    int32_t *send_offsets;      /* [E + 1] */
    int32_t *send_rbe;          /* [send_rows_cap / 128] */
    int32_t *send_slot_row;     /* [max_tokens * K] */
    int32_t *send_row_slot;     /* [send_rows_cap] */
    int32_t *send_scalars;      /* [2]: num_rows, gemm rows of the send plan */
    int32_t *dest_base;         /* [E] */
};

inline cuda_state *state_of(const moefuse_layer *layer) { return (cuda_state *)layer->backend; }

/* Rows of the expert-sorted buffers of a call with T tokens: without a comm, its T*K
 * slots and each local expert's padding; with a comm (expert parallelism, R >= 1), the
 * receive capacity R * max_tokens * K plus padding, whatever T is (the rows come from
 * every rank). */
int rows_cap_for(const moefuse_layer *layer, int num_tokens);
/* mode: what the forward keeps (cfg.saved_mode), MOEFUSE_RECOMPUTE for the plan only. */
saved_layout layout_for(const moefuse_layer *layer, int num_tokens, moefuse_saved_mode mode);
/* The mode a forward with this saved buffer writes: the layer's, or the plan only
 * (MOEFUSE_RECOMPUTE) when saved is NULL. */
moefuse_saved_mode saved_mode_of(const moefuse_layer *layer, const void *saved);
/* Where the forward's gemm1 writes [g; u]: saved's section, or NULL when mode keeps none. */
uint16_t *saved_gate_up(void *saved, const saved_layout &lay, moefuse_saved_mode mode);

/* cudaMalloc with a clear error (MOEFUSE_ERR_NO_MEMORY / _CUDA naming `what`). */
moefuse_status alloc(void **p, size_t bytes, const char *what);

/* s->field = alloc(bytes), or return its status from the enclosing function. */
#define MF_ALLOC_FIELD(s, field, bytes)                                                    \
    do {                                                                                   \
        const moefuse_status st_ = alloc((void **)&(s)->field, (size_t)(bytes), #field);   \
        if (st_ != MOEFUSE_OK) return st_;                                                 \
    } while (0)

/* The saved header a forward writes (words 0 .. kHeaderSavedMode; the rest 0). */
void header_words(const moefuse_layer *layer, int num_tokens, int rows_cap,
                  moefuse_saved_mode mode, int32_t words[kHeaderWords]);

/* The params of the stages both pipelines run, on the layer's workspaces (xs, act, dh,
 * dp_partial, combine, gemm_num_rows, num_sms); the caller sets what differs:
 *   gemm2:  row_weight (one rank: written by the dispatch; EP: pushed with the rows)
 *           + combine (one rank) or combine_peers (EP)
 *   dgrad2: row_weight;  dgrad1: combine or combine_peers
 *   wgrad:  lhs, rhs, dw, m, n */
mf_gemm1_params gemm1_params(const moefuse_layer *layer, const uint16_t *xs,
                             const uint16_t *w13, const int32_t *rbe, uint16_t *gate_up,
                             int rows_cap);
mf_gemm2_params gemm2_params(const moefuse_layer *layer, const uint16_t *w2, const int32_t *rbe,
                             const int32_t *row_slot, int rows_cap);
mf_dgrad2_params dgrad2_params(const moefuse_layer *layer, const uint16_t *dys,
                               const uint16_t *w2, const uint16_t *gate_up, const int32_t *rbe,
                               const int32_t *row_slot, int rows_cap);
mf_dgrad1_params dgrad1_params(const moefuse_layer *layer, const uint16_t *w13,
                               const int32_t *rbe, const int32_t *row_slot, int rows_cap);
/* dW2 = dys^T act_p and dW13 = dh^T xs of the call, into its fp32 or bf16 buffers; dW2
 * reads dys from where the call dispatched dy, dW13 xs from the workspace or the saved
 * buffer. rows_cap 0: the gradients are written as zeros (accumulating: left as they
 * are). */
mf_wgrad_params dw2_params(const moefuse_layer *layer, const moefuse_bwd_args *a, int rows_cap,
                           const uint16_t *dys);
mf_wgrad_params dw13_params(const moefuse_layer *layer, const moefuse_bwd_args *a,
                            int rows_cap, const uint16_t *xs);
mf_reduce_params reduce_params(const moefuse_layer *layer, const int32_t *ids, int num_tokens,
                               uint16_t *out, int64_t out_stride);
/* expert_order for both weight gradients: the local experts by their rows in the checked
 * bwd_offsets, heavy ones first (expert_order.cu); after check_saved, before dW2. */
moefuse_status order_experts(moefuse_layer *layer, cudaStream_t stream);

/* The backward's GEMMs after dgrad2: with the fused pipeline (act_ready set, a shape it
 * takes) dW2, dgrad1 and dW13 in one kernel (*fused true); else dW2 then dgrad1, and the
 * caller launches dW13 where its pipeline wants it (*fused false). */
moefuse_status backward_gemms(const moefuse_layer *layer, const mf_wgrad_params &dw2,
                              const mf_dgrad1_params &d1, const mf_wgrad_params &dw13,
                              cudaStream_t stream, bool *fused);

/* The backward's device check of the saved buffer (backend.cu): fails the call
 * (call_failed, gemm_num_rows 0, bwd_offsets 0) and records MOEFUSE_ERR_SAVED_STATE
 * when the buffer does not match a forward of this layer with these T and ids. */
moefuse_status check_saved(moefuse_layer *layer, const moefuse_bwd_args *a,
                           const saved_layout &lay, cudaStream_t stream);

/* Expert parallelism (backend_ep.cu): every layer made with a comm, R = 1 included
 * (a one-rank comm runs the expert-parallel kernels: the one-rank path's bits).
 * ep_destroy also undoes a partial ep_create (NCCL windows are freed there; the rest
 * by free_state). */
moefuse_status ep_create(moefuse_layer *layer, cuda_state *s);
void ep_destroy(moefuse_layer *layer, cuda_state *s);
moefuse_status ep_forward(moefuse_layer *layer, const moefuse_fwd_args *a, cudaStream_t stream);
moefuse_status ep_backward(moefuse_layer *layer, const moefuse_bwd_args *a, cudaStream_t stream);

}  // namespace backend
}  // namespace mf

#endif /* MOEFUSE_CUDA_BACKEND_H */
