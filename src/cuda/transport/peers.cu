/* The peers transport: expert parallelism over a comm (virtual ranks on one GPU, or
 * NCCL), every layer made with one, R = 1 included (a one-rank comm runs these kernels:
 * the local transport's bits). Rank r holds experts r*E/R .. (r+1)*E/R - 1.
 *
 * Forward, on each rank's stream, no host synchronization:
 *   plan      this rank's slots over all E experts (moe_plan.cu): per-expert counts
 *             and each slot's rank among its expert's slots; then the counts to every
 *             rank, theirs waited for; receive layout, dest_base (ep_exchange_counts.cu)
 *   dispatch  on the layer's side stream, an eighth of the SMs: x rows, sources and p
 *             to the experts' ranks, each row counted on its receive block's arrival
 *             counter there; own padding rows zeroed and counted (ep_push_rows.cu)
 *   gemm1     beside the push, on the rest of the SMs: its producer starts each row
 *             block when the block's rows are counted in (the exchange set the targets)
 *   gemm2     rows scaled by p, each into its source rank's combine slot row
 *   combined  DONE on every rank, wait for every rank's DONE (ep_signal_wait.cu); the
 *             side stream joined
 * Backward: after the saved check a READY barrier (every rank has finished its previous
 * call, so its windows are free), which also adds this call's arrival targets; dy and x
 * rows pushed again on the side stream (the saved slot_row says where; no count
 * exchange), each row counted in on its receive block; beside it the recomputed gemm1
 * and dgrad2, each block once its rows are in; rows in: the join, then every rank's push
 * done (ROWS); after dgrad1 into the source ranks' combine slot rows: d p to the source
 * ranks, DONE raised; (staged dW13;) every rank's DONE waited for; the reduces.
 *
 * Windows (MF_WIN_*, written by peers): xs, dys, row_slot, row_weight, combine, dp,
 * sync. Each receiver sizes its row buffers for R * max_tokens * K rows plus padding
 * (every rank may route every slot to it). Virtual ranks: every window a cudaMalloc of
 * this GPU; the peer table of each rank is written when the last rank's layer is
 * created, and every rank's sync window zeroed then.
 *
 * Results: the receive order is the one-rank plan's order on the ranks' concatenated
 * tokens (see ep_exchange_counts.cu), so y, dx, d p and dW are the bits of one rank
 * running the concatenated batch. */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>

#include "check.h"
#include "pipeline/state.h"
#include "transport/ep_sync.h"

namespace mf {
namespace pipeline {

namespace {

/* Rows of the send plan: this rank's slots over all E experts, each padded. */
int send_rows_cap(const moefuse_layer *layer, int num_tokens) {
    const int bm = state_of(layer)->plan.block_m;
    const int64_t slots = (int64_t)num_tokens * layer->cfg.top_k;
    const int64_t experts = slots < layer->cfg.num_experts ? slots : layer->cfg.num_experts;
    const int64_t rows = slots + (int64_t)(bm - 1) * experts;
    return (int)((rows + bm - 1) / bm * bm);
}

int64_t timeout_ns(const moefuse_layer *layer) {
    return (int64_t)layer->comm->timeout_ms * 1000000;
}

/* Every rank's table of every rank's windows, and clean sync windows: once all the
 * comm's layers exist. Nothing of the comm is in flight (moefuse.h). */
moefuse_status refresh_peer_tables(moefuse_comm *comm) {
    const int R = comm->num_ranks;
    void *table[MF_WIN_COUNT * MF_MAX_RANKS];
    for (int w = 0; w < MF_WIN_COUNT; w++)
        for (int q = 0; q < R; q++) table[w * R + q] = comm->windows[q][w];
    MF_CUDA_TRY(cudaDeviceSynchronize());
    for (int q = 0; q < R; q++) {
        MF_CUDA_TRY(cudaMemcpy(comm->peer_table[q], table, sizeof(void *) * MF_WIN_COUNT * R,
                               cudaMemcpyHostToDevice));
        MF_CUDA_TRY(cudaMemset(comm->windows[q][MF_WIN_SYNC], 0, comm->sync_bytes[q]));
    }
    MF_CUDA_TRY(cudaDeviceSynchronize());
    return MOEFUSE_OK;
}

/* The windows of s, in the order every rank registers them. */
void window_fields(cuda_state *s, void **fields[MF_WIN_COUNT]) {
    fields[MF_WIN_XS] = (void **)&s->xs;
    fields[MF_WIN_DYS] = (void **)&s->dys;
    fields[MF_WIN_ROW_SLOT] = (void **)&s->row_slot;
    fields[MF_WIN_ROW_WEIGHT] = (void **)&s->row_weight;
    fields[MF_WIN_COMBINE] = (void **)&s->combine;
    fields[MF_WIN_DP] = (void **)&s->dp_slot;
    fields[MF_WIN_SYNC] = (void **)&s->sync;
}

/* ---- create, destroy ----------------------------------------------------------------- */

moefuse_status create(moefuse_layer *layer, cuda_state *s) {
    const moefuse_config *c = &layer->cfg;
    moefuse_comm *comm = layer->comm;
    const int R = c->num_ranks, E = c->num_experts, K = c->top_k, T = c->max_tokens;
    const int bm = s->plan.block_m;
    if (comm->kind == MF_COMM_VIRTUAL) {
        /* Each virtual rank's kernels wait for the others': its two streams (the caller's
         * and the push's) need hardware queues of their own, or a waiting kernel can sit
         * in front of the kernel it waits for. */
        const char *env = getenv("CUDA_DEVICE_MAX_CONNECTIONS");
        const int queues = env ? atoi(env) : 8;
        if (queues < 2 * R + 2)
            return mf_fail(MOEFUSE_ERR_UNSUPPORTED,
                           "moefuse_layer_create: %d virtual ranks need %d CUDA hardware queues "
                           "(2 streams per rank and the caller's), CUDA_DEVICE_MAX_CONNECTIONS "
                           "is %s; expected CUDA_DEVICE_MAX_CONNECTIONS=%d or more (at most 32) "
                           "in the environment before CUDA starts",
                           R, 2 * R + 2, env ? env : "not set (8)", 2 * R + 2);
    }
    const int64_t rows_cap = rows_cap_for(layer, T), send_cap = send_rows_cap(layer, T);
    size_t bytes[MF_WIN_COUNT];
    bytes[MF_WIN_XS] = (size_t)rows_cap * c->hidden * 2;
    bytes[MF_WIN_DYS] = (size_t)rows_cap * c->hidden * 2;
    bytes[MF_WIN_ROW_SLOT] = (size_t)rows_cap * 4;
    bytes[MF_WIN_ROW_WEIGHT] = (size_t)rows_cap * 4;
    bytes[MF_WIN_COMBINE] = (size_t)T * K * c->hidden * 2;  // this rank's slot rows
    bytes[MF_WIN_DP] = (size_t)T * K * 4;
    bytes[MF_WIN_SYNC] = mf_ep_sync_bytes(R, E, (int)(rows_cap / bm));
    void **fields[MF_WIN_COUNT];
    window_fields(s, fields);
    for (int w = 0; w < MF_WIN_COUNT; w++) {
        if (comm->kind == MF_COMM_NCCL) {
#ifdef MOEFUSE_HAVE_NCCL
            MF_TRY(mf_nccl_window_alloc(comm, bytes[w], fields[w], &s->win_handle[w]));
#else
            return mf_fail(MOEFUSE_ERR_UNSUPPORTED, "an NCCL comm in a build without NCCL");
#endif
        } else {
            MF_TRY(alloc(fields[w], bytes[w], "a window"));
            MF_CUDA_TRY(cudaMemset(*fields[w], 0, bytes[w]));
        }
    }
    MF_ALLOC_FIELD(s, peers, sizeof(void *) * MF_WIN_COUNT * R);
    MF_ALLOC_FIELD(s, send_counts, (int64_t)E * 4);
    MF_ALLOC_FIELD(s, send_offsets, (int64_t)(E + 1) * 4);
    MF_ALLOC_FIELD(s, send_rbe, send_cap / bm * 4);
    MF_ALLOC_FIELD(s, send_slot_row, (int64_t)T * K * 4);
    MF_ALLOC_FIELD(s, send_row_slot, send_cap * 4);
    MF_ALLOC_FIELD(s, send_scalars, 2 * 4);
    MF_ALLOC_FIELD(s, dest_base, (int64_t)E * 4);
    MF_CUDA_TRY(cudaStreamCreateWithFlags(&s->side, cudaStreamNonBlocking));
    MF_CUDA_TRY(cudaEventCreateWithFlags(&s->fork, cudaEventDisableTiming));
    MF_CUDA_TRY(cudaEventCreateWithFlags(&s->join, cudaEventDisableTiming));

    void *windows[MF_WIN_COUNT];
    for (int w = 0; w < MF_WIN_COUNT; w++) windows[w] = *fields[w];
    MF_TRY(mf_comm_attach(comm, c->rank, layer, windows, bytes[MF_WIN_SYNC], s->peers));
    s->attached = true;
    moefuse_status built = MOEFUSE_OK;
#ifdef MOEFUSE_HAVE_NCCL
    if (comm->kind == MF_COMM_NCCL) built = mf_nccl_peer_table(comm, s->win_handle, (void **)s->peers);
#endif
    if (comm->kind == MF_COMM_VIRTUAL && mf_comm_complete(comm)) built = refresh_peer_tables(comm);
    if (built != MOEFUSE_OK) {
        mf_comm_detach(comm, c->rank);
        s->attached = false;
    }
    return built;
}

/* Also undoes a partial create (NCCL windows are freed here; the rest by the
 * workspace's free_state). */
void destroy(moefuse_layer *layer, cuda_state *s) {
    moefuse_comm *comm = layer->comm;
    if (s->side) cudaStreamDestroy(s->side);
    if (s->fork) cudaEventDestroy(s->fork);
    if (s->join) cudaEventDestroy(s->join);
    s->side = NULL;
    s->fork = s->join = NULL;
    if (s->attached) mf_comm_detach(comm, layer->cfg.rank);
    s->attached = false;
    if (comm->kind != MF_COMM_NCCL) return;  // virtual windows: cudaFree in free_state
#ifdef MOEFUSE_HAVE_NCCL
    void **fields[MF_WIN_COUNT];
    window_fields(s, fields);
    for (int w = 0; w < MF_WIN_COUNT; w++) {
        mf_nccl_window_free(comm, *fields[w], s->win_handle[w]);
        *fields[w] = NULL;
        s->win_handle[w] = NULL;
    }
#endif
}

/* ---- a call ------------------------------------------------------------------------ */

/* The received rows live in this rank's windows; their sources are pushed with them. */
void locate_rows(const moefuse_layer *layer, call_bufs *c) {
    cuda_state *s = state_of(layer);
    c->xs = s->xs;
    c->dys = s->dys;
    c->row_slot = s->row_slot;
}

mf_ep_signal_params signal_params(const moefuse_layer *layer, int flag, int stage) {
    const cuda_state *s = state_of(layer);
    mf_ep_signal_params sp = {};
    sp.rank = s->rank;
    sp.num_ranks = s->num_ranks;
    sp.peers = s->peers;
    sp.sync = s->sync;
    sp.flag = flag;
    sp.stage = stage;
    sp.state = s->plan_state;
    sp.gemm_num_rows = s->gemm_num_rows;
    sp.timeout_ns = timeout_ns(layer);
    return sp;
}

moefuse_status plan(moefuse_layer *layer, const moefuse_fwd_args *a, const call_bufs &c,
                    cudaStream_t stream) {
    const cuda_state *s = state_of(layer);
    const int T = a->num_tokens, E = layer->cfg.num_experts;
    int32_t *header = (int32_t *)(c.base + c.lay.header);

    // this rank's slots over all experts (the sends); checks ids
    mf_plan_params pp = {};
    pp.ids = a->ids;
    pp.num_tokens = T;
    pp.top_k = layer->cfg.top_k;
    pp.num_experts = E;
    pp.expert_begin = 0;
    pp.num_local_experts = E;
    pp.rows_cap = send_rows_cap(layer, T);
    pp.slot_rank = s->slot_rank;
    pp.chunk_base = s->chunk_base;
    pp.state = s->plan_state;
    pp.gemm_num_rows = s->send_scalars + 1;
    pp.expert_counts = s->send_counts;
    pp.expert_offsets = s->send_offsets;
    pp.row_block_expert = s->send_rbe;
    pp.num_rows = s->send_scalars;
    pp.slot_row = s->send_slot_row;
    pp.row_slot = s->send_row_slot;
    MF_CUDA_TRY(mf_plan_build_cuda(&pp, stream));

    // counts to every rank; the receive layout and where this rank's rows go
    mf_ep_exchange_params ex = {};
    ex.rank = s->rank;
    ex.num_ranks = s->num_ranks;
    ex.num_experts = E;
    ex.num_local_experts = layer->num_local_experts;
    ex.rows_cap = c.lay.rows_cap;
    ex.send_counts = s->send_counts;
    ex.state = s->plan_state;
    ex.peers = s->peers;
    ex.sync = s->sync;
    ex.timeout_ns = timeout_ns(layer);
    ex.recv_counts = (int32_t *)(c.base + c.lay.counts);
    ex.recv_offsets = (int32_t *)(c.base + c.lay.offsets);
    ex.row_block_expert = (int32_t *)(c.base + c.lay.row_block_expert);
    ex.num_rows = header + MF_SAVED_NUM_ROWS;
    ex.gemm_num_rows = s->gemm_num_rows;
    ex.user_counts = a->expert_counts;
    ex.saved_header = header;
    header_words(layer, T, c.lay.rows_cap, c.mode, ex.header_words);
    ex.header_send_failed_word = MF_SAVED_SEND_FAILED;
    ex.dest_base = s->dest_base;
    MF_CUDA_TRY(mf_ep_exchange_counts(&ex, stream));
    return MOEFUSE_OK;
}

/* The rows to the experts' ranks on the layer's side stream, on push_sms SMs, each row
 * counted in on its receive block (the GEMMs beside it wait for the counts): forward x
 * (where the exchange said), backward dy and x again (where the saved slot_row says). */
moefuse_status dispatch(moefuse_layer *layer, const token_rows &rows, const call_bufs &c,
                        cudaStream_t stream) {
    cuda_state *s = state_of(layer);
    mf_ep_push_params pu = {};
    pu.rank = s->rank;
    pu.num_ranks = s->num_ranks;
    pu.num_experts = layer->cfg.num_experts;
    pu.num_local_experts = layer->num_local_experts;
    pu.top_k = layer->cfg.top_k;
    pu.hidden = layer->cfg.hidden;
    pu.num_tokens = c.num_tokens;
    pu.ids = rows.ids;
    pu.weights = rows.weights;
    pu.x = rows.x;
    pu.x_stride = rows.x_stride;
    pu.slot_row = (int32_t *)(c.base + c.lay.slot_row);
    pu.recv_counts = (const int32_t *)(c.base + c.lay.counts);
    pu.recv_offsets = (const int32_t *)(c.base + c.lay.offsets);
    pu.gemm_num_rows = s->gemm_num_rows;
    pu.peers = s->peers;
    pu.sync = s->sync;
    pu.state = s->plan_state;
    if (rows.dy) {
        pu.dy = rows.dy;
        pu.dy_stride = rows.dy_stride;
        pu.backward = 1;
    } else {
        pu.dest_base = s->dest_base;
        pu.plan_slot_row = s->send_slot_row;
        pu.plan_offsets = s->send_offsets;
    }
    pu.count_arrivals = 1;
    pu.num_sms = s->plan.push_sms;
    MF_CUDA_TRY(cudaEventRecord(s->fork, stream));
    MF_CUDA_TRY(cudaStreamWaitEvent(s->side, s->fork, 0));
    MF_CUDA_TRY(mf_ep_push_rows(&pu, s->side));
    MF_CUDA_TRY(cudaEventRecord(s->join, s->side));
    return MOEFUSE_OK;
}

/* A GEMM beside the push: the SMs the push leaves, and before each row block a wait
 * until its rows are counted in. */
row_arrivals arrivals(const moefuse_layer *layer, const call_bufs &c, bool backward) {
    const cuda_state *s = state_of(layer);
    const int R = s->num_ranks, E = layer->cfg.num_experts;
    row_arrivals w = {};
    w.rows_in.arrivals = s->sync + mf_ep_arrivals_word(R, E);
    w.rows_in.target = s->sync + mf_ep_targets_word(R, E, c.lay.rows_cap / s->plan.block_m);
    w.rows_in.state = s->plan_state;
    w.rows_in.timeout_ns = timeout_ns(layer);
    w.rows_in.stage = backward ? MF_EP_STAGE_BWD_ROWS : MF_EP_STAGE_ROWS;
    w.num_sms = s->plan.beside_push_sms;
    return w;
}

mf_scatter scatter(const moefuse_layer *layer, const call_bufs &c) {
    const cuda_state *s = state_of(layer);
    return mf_scatter{c.row_slot, NULL,
                      (uint16_t *const *)(s->peers + MF_WIN_COMBINE * s->num_ranks),
                      s->num_ranks};
}

moefuse_status sync(moefuse_layer *layer, sync_point at, const call_bufs &c,
                    cudaStream_t stream) {
    cuda_state *s = state_of(layer);
    mf_ep_signal_params sp;
    switch (at) {
    case kForwardCombined:
        sp = signal_params(layer, MF_EP_FLAG_DONE, MF_EP_STAGE_COMBINE);
        sp.signal = 1;
        sp.wait = 1;
        MF_CUDA_TRY(mf_ep_signal_wait(&sp, stream));
        MF_CUDA_TRY(cudaStreamWaitEvent(stream, s->join, 0));  // the push is part of the call
        return MOEFUSE_OK;
    case kBackwardStart:
        // a new epoch; the arrival targets of this call's receive blocks
        sp = signal_params(layer, MF_EP_FLAG_READY, MF_EP_STAGE_READY);
        sp.new_epoch = 1;
        sp.signal = 1;
        sp.wait = 1;
        sp.arrival_target = s->sync + mf_ep_targets_word(s->num_ranks, layer->cfg.num_experts,
                                                         c.lay.rows_cap / s->plan.block_m);
        MF_CUDA_TRY(mf_ep_signal_wait(&sp, stream));
        return MOEFUSE_OK;
    case kBackwardRowsIn:
        MF_CUDA_TRY(cudaStreamWaitEvent(stream, s->join, 0));
        sp = signal_params(layer, MF_EP_FLAG_ROWS, MF_EP_STAGE_BWD_ROWS);
        sp.wait = 1;
        MF_CUDA_TRY(mf_ep_signal_wait(&sp, stream));
        return MOEFUSE_OK;
    case kBackwardSentBack: {
        // d p of each received row to its source rank
        mf_ep_push_dp_params pd = {};
        pd.dp_partial = s->dp_partial;
        pd.parts = s->plan.dp_parts;
        pd.row_slot = s->row_slot;
        pd.num_rows = s->gemm_num_rows;
        pd.rank = s->rank;
        pd.num_ranks = s->num_ranks;
        pd.peers = s->peers;
        pd.num_sms = s->plan.num_sms;
        MF_CUDA_TRY(mf_ep_push_dp(&pd, stream));
        sp = signal_params(layer, MF_EP_FLAG_DONE, MF_EP_STAGE_BWD_COMBINE);
        sp.signal = 1;
        MF_CUDA_TRY(mf_ep_signal_wait(&sp, stream));
        return MOEFUSE_OK;
    }
    case kBackwardCombined:
        sp = signal_params(layer, MF_EP_FLAG_DONE, MF_EP_STAGE_BWD_COMBINE);
        sp.wait = 1;
        MF_CUDA_TRY(mf_ep_signal_wait(&sp, stream));
        return MOEFUSE_OK;
    }
    return MOEFUSE_OK;
}

/* d p of a slot: its sum, pushed back by the expert's rank */
void dp_sums(const moefuse_layer *layer, const call_bufs &, const int32_t *ids,
             mf_reduce_dp_params *rd) {
    rd->dp_partial = state_of(layer)->dp_slot;
    rd->parts = 1;
    rd->slot_row = NULL;
    rd->ids = ids;
}

}  // namespace

extern const transport kPeers = {
    "peers", create, destroy, locate_rows, plan, dispatch, arrivals, scatter, sync, dp_sums,
};

}  // namespace pipeline
}  // namespace mf
