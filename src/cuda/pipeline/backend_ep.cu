/* The CUDA backend with expert parallelism (R > 1): the one-rank pipeline of
 * backend.cu with the transport in its kernels. Rank r holds experts
 * r*E/R .. (r+1)*E/R - 1.
 *
 * Forward, on each rank's stream, no host synchronization:
 *   plan      this rank's slots over all E experts (moe_plan.cu): per-expert counts
 *             and each slot's rank among its expert's slots
 *   exchange  counts to every rank, wait for theirs; receive layout, dest_base
 *             (ep_exchange_counts.cu)
 *   push      on the layer's side stream, an eighth of the SMs: x rows, sources and p
 *             to the experts' ranks, each row counted on its receive block's arrival
 *             counter there; own padding rows zeroed and counted (ep_push_rows.cu)
 *   gemm1     beside the push, on the rest of the SMs: its producer starts each 128-row
 *             block when the block's 128 rows are counted in (the exchange set the
 *             targets), so the GEMM overlaps the dispatch; -> act (and gate_up)
 *   gemm2     rows scaled by p, each into its source rank's combine slot row
 *   signal    DONE on every rank, wait for every rank's DONE (ep_signal_wait.cu)
 *   reduce    y from this rank's combine slot rows, as with one rank, after the side
 *             stream joined
 * Backward: check the saved buffer; a READY barrier (every rank has finished its
 * previous call, so its windows are free), which also adds this call's arrival targets;
 * push dy and x rows again on the side stream (the saved slot_row says where; no count
 * exchange), each row counted in on its receive block; beside it dgrad2 (and the
 * recomputed gemm1) on the rest of the SMs, each block once its rows are in; wait ROWS
 * (every rank's push done); dW2, dgrad1 into the source ranks' combine slot rows, d p to
 * the source ranks, raise DONE, dW13, wait DONE, reduce dx and copy d p. With
 * MOEFUSE_PIPELINE_FUSED, dW2, dgrad1 and dW13 are one kernel (src/cuda/sm90/fused_backward.cu)
 * before d p and DONE.
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
#include <string.h>

#include "pipeline/backend.h"
#include "check.h"
#include "transport/ep_sync.h"
#include "internal.h"
#include "kernels.h"

namespace mf {
namespace backend {

namespace {

int send_rows_cap(const moefuse_layer *layer, int num_tokens) {
    const int64_t slots = (int64_t)num_tokens * layer->cfg.top_k;
    const int64_t experts = slots < layer->cfg.num_experts ? slots : layer->cfg.num_experts;
    const int64_t rows = slots + (int64_t)(MF_SM90_BLOCK_M - 1) * experts;
    return (int)((rows + MF_SM90_BLOCK_M - 1) / MF_SM90_BLOCK_M * MF_SM90_BLOCK_M);
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

mf_ep_push_params push_params(const moefuse_layer *layer, const saved_layout &lay,
                              const char *plan_base, int num_tokens, const int32_t *ids,
                              const float *weights, const uint16_t *x, int64_t x_stride) {
    const cuda_state *s = state_of(layer);
    mf_ep_push_params pu = {};
    pu.rank = s->rank;
    pu.num_ranks = s->num_ranks;
    pu.num_experts = layer->cfg.num_experts;
    pu.num_local_experts = layer->num_local_experts;
    pu.top_k = layer->cfg.top_k;
    pu.hidden = layer->cfg.hidden;
    pu.num_tokens = num_tokens;
    pu.ids = ids;
    pu.weights = weights;
    pu.x = x;
    pu.x_stride = x_stride;
    pu.slot_row = (int32_t *)(plan_base + lay.slot_row);
    pu.recv_counts = (const int32_t *)(plan_base + lay.counts);
    pu.recv_offsets = (const int32_t *)(plan_base + lay.offsets);
    pu.gemm_num_rows = s->gemm_num_rows;
    pu.peers = s->peers;
    pu.sync = s->sync;
    pu.state = s->plan_state;
    pu.num_sms = s->num_sms;
    return pu;
}

/* The row push on the layer's side stream, an eighth of the SMs, each row counted in on
 * its receive block (the GEMMs beside it wait for the counts). */
moefuse_status push_beside(cuda_state *s, mf_ep_push_params pu, cudaStream_t stream) {
    pu.count_arrivals = 1;
    pu.num_sms = s->push_sms;
    MF_CUDA_TRY(cudaEventRecord(s->fork, stream));
    MF_CUDA_TRY(cudaStreamWaitEvent(s->side, s->fork, 0));
    MF_CUDA_TRY(mf_ep_push_rows(&pu, s->side));
    MF_CUDA_TRY(cudaEventRecord(s->join, s->side));
    return MOEFUSE_OK;
}

/* A GEMM beside the push (mf_gemm1_params, mf_dgrad2_params): the SMs the push leaves,
 * and before each 128-row block a wait until its rows are counted in. */
template <class GemmParams>
void wait_for_rows(const moefuse_layer *layer, GemmParams *p, int rows_cap, int stage) {
    const cuda_state *s = state_of(layer);
    const int R = s->num_ranks, E = layer->cfg.num_experts;
    p->arrivals = s->sync + mf_ep_arrivals_word(R, E);
    p->arrival_target = s->sync + mf_ep_targets_word(R, E, rows_cap / MF_SM90_BLOCK_M);
    p->state = s->plan_state;
    p->timeout_ns = timeout_ns(layer);
    p->arrival_stage = stage;
    p->num_sms = s->num_sms - s->push_sms > 0 ? s->num_sms - s->push_sms : 1;
}

uint16_t *const *combine_peers(const cuda_state *s) {
    return (uint16_t *const *)(s->peers + MF_WIN_COMBINE * s->num_ranks);
}

}  // namespace

/* The windows of s, in the order every rank registers them. */
static void window_fields(cuda_state *s, void **fields[MF_WIN_COUNT]) {
    fields[MF_WIN_XS] = (void **)&s->xs;
    fields[MF_WIN_DYS] = (void **)&s->dys;
    fields[MF_WIN_ROW_SLOT] = (void **)&s->row_slot;
    fields[MF_WIN_ROW_WEIGHT] = (void **)&s->row_weight;
    fields[MF_WIN_COMBINE] = (void **)&s->combine;
    fields[MF_WIN_DP] = (void **)&s->dp_slot;
    fields[MF_WIN_SYNC] = (void **)&s->sync;
}

moefuse_status ep_create(moefuse_layer *layer, cuda_state *s) {
    const moefuse_config *c = &layer->cfg;
    moefuse_comm *comm = layer->comm;
    const int R = c->num_ranks, E = c->num_experts, K = c->top_k, T = c->max_tokens;
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
    bytes[MF_WIN_SYNC] = mf_ep_sync_bytes(R, E, (int)(rows_cap / MF_SM90_BLOCK_M));
    void **fields[MF_WIN_COUNT];
    window_fields(s, fields);
    for (int w = 0; w < MF_WIN_COUNT; w++) {
        if (comm->kind == MF_COMM_NCCL) {
#ifdef MOEFUSE_HAVE_NCCL
            const moefuse_status st = mf_nccl_window_alloc(comm, bytes[w], fields[w], &s->win_handle[w]);
            if (st != MOEFUSE_OK) return st;
#else
            return mf_fail(MOEFUSE_ERR_UNSUPPORTED, "an NCCL comm in a build without NCCL");
#endif
        } else {
            const moefuse_status st = alloc(fields[w], bytes[w], "a window");
            if (st != MOEFUSE_OK) return st;
            MF_CUDA_TRY(cudaMemset(*fields[w], 0, bytes[w]));
        }
    }
    MF_ALLOC_FIELD(s, peers, sizeof(void *) * MF_WIN_COUNT * R);
    MF_ALLOC_FIELD(s, send_counts, (int64_t)E * 4);
    MF_ALLOC_FIELD(s, send_offsets, (int64_t)(E + 1) * 4);
    MF_ALLOC_FIELD(s, send_rbe, send_cap / MF_SM90_BLOCK_M * 4);
    MF_ALLOC_FIELD(s, send_slot_row, (int64_t)T * K * 4);
    MF_ALLOC_FIELD(s, send_row_slot, send_cap * 4);
    MF_ALLOC_FIELD(s, send_scalars, 2 * 4);
    MF_ALLOC_FIELD(s, dest_base, (int64_t)E * 4);
    MF_CUDA_TRY(cudaStreamCreateWithFlags(&s->side, cudaStreamNonBlocking));
    MF_CUDA_TRY(cudaEventCreateWithFlags(&s->fork, cudaEventDisableTiming));
    MF_CUDA_TRY(cudaEventCreateWithFlags(&s->join, cudaEventDisableTiming));
    /* The push is bound by NVLink (or, with virtual ranks, by HBM): an eighth of the SMs
     * carry it, the rest run gemm1 beside it. */
    s->push_sms = s->num_sms / 8 > 0 ? s->num_sms / 8 : 1;

    void *windows[MF_WIN_COUNT];
    for (int w = 0; w < MF_WIN_COUNT; w++) windows[w] = *fields[w];
    const moefuse_status st =
        mf_comm_attach(comm, c->rank, layer, windows, bytes[MF_WIN_SYNC], s->peers);
    if (st != MOEFUSE_OK) return st;
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

void ep_destroy(moefuse_layer *layer, cuda_state *s) {
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
#else
    (void)s;
#endif
}

moefuse_status ep_forward(moefuse_layer *layer, const moefuse_fwd_args *a, cudaStream_t stream) {
    cuda_state *s = state_of(layer);
    const moefuse_config *c = &layer->cfg;
    const int T = a->num_tokens, K = c->top_k, E = c->num_experts, EL = layer->num_local_experts;
    const int R = s->num_ranks;
    const moefuse_saved_mode mode = saved_mode_of(layer, a->saved);   /* not _AND_INPUTS */
    const saved_layout lay = layout_for(layer, T, mode);
    char *plan_base = a->saved ? (char *)a->saved : (char *)s->plan_ws;
    int32_t *header = (int32_t *)(plan_base + lay.header);

    // ---- 1. plan of this rank's slots over all experts (the sends); checks ids ----
    mf_plan_params pp = {};
    pp.ids = a->ids;
    pp.num_tokens = T;
    pp.top_k = K;
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

    // ---- 2. counts to every rank; receive layout and where this rank's rows go ----
    mf_ep_exchange_params ex = {};
    ex.rank = s->rank;
    ex.num_ranks = R;
    ex.num_experts = E;
    ex.num_local_experts = EL;
    ex.rows_cap = lay.rows_cap;
    ex.send_counts = s->send_counts;
    ex.state = s->plan_state;
    ex.peers = s->peers;
    ex.sync = s->sync;
    ex.timeout_ns = timeout_ns(layer);
    ex.recv_counts = (int32_t *)(plan_base + lay.counts);
    ex.recv_offsets = (int32_t *)(plan_base + lay.offsets);
    ex.row_block_expert = (int32_t *)(plan_base + lay.row_block_expert);
    ex.num_rows = header + kHeaderNumRows;
    ex.gemm_num_rows = s->gemm_num_rows;
    ex.user_counts = a->expert_counts;
    ex.saved_header = header;
    header_words(layer, T, lay.rows_cap, mode, ex.header_words);
    ex.header_send_failed_word = kHeaderSendFailed;
    ex.dest_base = s->dest_base;
    MF_CUDA_TRY(mf_ep_exchange_counts(&ex, stream));

    // ---- 3. x rows to the experts' ranks, on the side stream; 4. gemm1 + SwiGLU beside
    // it, each 128-row block as soon as its rows are in (arrival counts) ----
    mf_ep_push_params pu = push_params(layer, lay, plan_base, T, a->ids, a->weights, a->x,
                                       a->x_stride);
    pu.dest_base = s->dest_base;
    pu.plan_slot_row = s->send_slot_row;
    pu.plan_offsets = s->send_offsets;
    const moefuse_status pushed = push_beside(s, pu, stream);
    if (pushed != MOEFUSE_OK) return pushed;

    const int32_t *rbe = (const int32_t *)(plan_base + lay.row_block_expert);
    mf_gemm1_params g1 = gemm1_params(layer, s->xs, a->w13, rbe,
                                      saved_gate_up(a->saved, lay, mode), lay.rows_cap);
    wait_for_rows(layer, &g1, lay.rows_cap, MF_EP_STAGE_ROWS);

    // ---- 6. gemm2: p-scaled rows into their source ranks' combine slot rows ----
    // MOEFUSE_PIPELINE_FUSED: gemm1 and gemm2 in one kernel, beside the push (its gemm2
    // tiles then run on the SMs the push leaves too).
    mf_gemm2_params g2 = gemm2_params(layer, a->w2, rbe, s->row_slot, lay.rows_cap);
    g2.row_weight = s->row_weight;
    g2.combine_peers = combine_peers(s);
    g2.num_ranks = R;
    if (s->act_ready) {
        g2.num_sms = g1.num_sms;
        const mf_moe_fused_fwd_params fp = {g1, g2, s->act_ready};
        MF_CUDA_TRY(mf_sm90_moe_fused_fwd_bf16(&fp, stream));
    } else {
        MF_CUDA_TRY(mf_sm90_gemm1_swiglu_fwd_bf16(&g1, stream));
        MF_CUDA_TRY(mf_sm90_gemm2_combine_fwd_bf16(&g2, stream));
    }

    // ---- 7. every rank's combine rows here; 8. the reduce, as with one rank ----
    mf_ep_signal_params sp = signal_params(layer, MF_EP_FLAG_DONE, MF_EP_STAGE_COMBINE);
    sp.signal = 1;
    sp.wait = 1;
    MF_CUDA_TRY(mf_ep_signal_wait(&sp, stream));
    MF_CUDA_TRY(cudaStreamWaitEvent(stream, s->join, 0));  // the push is part of the call
    const mf_reduce_params rp = reduce_params(layer, a->ids, T, a->y, a->y_stride);
    MF_CUDA_TRY(mf_reduce_slots_bf16(&rp, stream));
    return MOEFUSE_OK;
}

moefuse_status ep_backward(moefuse_layer *layer, const moefuse_bwd_args *a, cudaStream_t stream) {
    cuda_state *s = state_of(layer);
    const moefuse_config *c = &layer->cfg;
    const int T = a->num_tokens, K = c->top_k;
    const int R = s->num_ranks;
    const bool recompute = c->saved_mode == MOEFUSE_RECOMPUTE;
    const saved_layout lay = layout_for(layer, T, c->saved_mode);
    const char *base = (const char *)a->saved;
    const int32_t *rbe = (const int32_t *)(base + lay.row_block_expert);

    // ---- 0. the saved buffer, checked; every rank done with its previous call; the
    //      arrival targets of this call's receive blocks ----
    const moefuse_status checked = check_saved(layer, a, lay, stream);
    if (checked != MOEFUSE_OK) return checked;
    mf_ep_signal_params sp = signal_params(layer, MF_EP_FLAG_READY, MF_EP_STAGE_READY);
    sp.new_epoch = 1;
    sp.signal = 1;
    sp.wait = 1;
    sp.arrival_target =
        s->sync + mf_ep_targets_word(R, c->num_experts, lay.rows_cap / MF_SM90_BLOCK_M);
    MF_CUDA_TRY(mf_ep_signal_wait(&sp, stream));

    // ---- 1. dy and x rows to the experts' ranks again, on the side stream, each row
    //      counted in on its receive block; 2-3 beside it, each 128-row block as soon as
    //      its rows are in: the recomputed gemm1, dgrad2 ----
    mf_ep_push_params pu = push_params(layer, lay, base, T, a->ids, a->weights, a->x,
                                       a->x_stride);
    pu.dy = a->dy;
    pu.dy_stride = a->dy_stride;
    pu.backward = 1;
    const moefuse_status pushed = push_beside(s, pu, stream);
    if (pushed != MOEFUSE_OK) return pushed;

    // ---- 2. [g | u]: saved, or recomputed by the forward's gemm1 ----
    const uint16_t *gate_up = (const uint16_t *)(base + lay.gate_up);
    if (recompute) {
        mf_gemm1_params g1 = gemm1_params(layer, s->xs, a->w13, rbe, s->gate_up, lay.rows_cap);
        wait_for_rows(layer, &g1, lay.rows_cap, MF_EP_STAGE_BWD_ROWS);
        MF_CUDA_TRY(mf_sm90_gemm1_swiglu_fwd_bf16(&g1, stream));
        gate_up = s->gate_up;
    }

    // ---- 3. dgrad2 + SwiGLU backward; then every rank's push done (a failed wait fails
    //      the call: no dx rows, d p or reduce after it); 4. dW2; 5. dgrad1 into the
    //      source ranks' combine slot rows ----
    mf_dgrad2_params d2 = dgrad2_params(layer, s->dys, a->w2, gate_up, rbe, s->row_slot,
                                        lay.rows_cap);
    d2.row_weight = s->row_weight;
    wait_for_rows(layer, &d2, lay.rows_cap, MF_EP_STAGE_BWD_ROWS);
    MF_CUDA_TRY(mf_sm90_gemm2_dgrad_swiglu_bwd_bf16(&d2, stream));
    MF_CUDA_TRY(cudaStreamWaitEvent(stream, s->join, 0));
    sp = signal_params(layer, MF_EP_FLAG_ROWS, MF_EP_STAGE_BWD_ROWS);
    sp.wait = 1;
    MF_CUDA_TRY(mf_ep_signal_wait(&sp, stream));
    const moefuse_status ordered = order_experts(layer, stream);
    if (ordered != MOEFUSE_OK) return ordered;
    const mf_wgrad_params dw2 = dw2_params(layer, a, lay.rows_cap, s->dys);
    mf_dgrad1_params d1 = dgrad1_params(layer, a->w13, rbe, s->row_slot, lay.rows_cap);
    d1.combine_peers = combine_peers(s);
    d1.num_ranks = R;
    const mf_wgrad_params dw13 = dw13_params(layer, a, lay.rows_cap, s->xs);
    // MOEFUSE_PIPELINE_FUSED: 4, 5 and dW13 in one kernel (dW13's tiles fill the SMs
    // around dgrad1's), so DONE comes after dW13 here
    bool fused;
    const moefuse_status launched = backward_gemms(layer, dw2, d1, dw13, stream, &fused);
    if (launched != MOEFUSE_OK) return launched;

    // ---- d p to the source ranks ----
    mf_ep_push_dp_params pd = {};
    pd.dp_partial = s->dp_partial;
    pd.parts = s->dp_parts;
    pd.row_slot = s->row_slot;
    pd.num_rows = s->gemm_num_rows;
    pd.rank = s->rank;
    pd.num_ranks = R;
    pd.peers = s->peers;
    pd.num_sms = s->num_sms;
    MF_CUDA_TRY(mf_ep_push_dp(&pd, stream));

    // ---- 6. DONE raised; dW13 (staged) while the other ranks finish; wait for their
    //      DONE ----
    sp = signal_params(layer, MF_EP_FLAG_DONE, MF_EP_STAGE_BWD_COMBINE);
    sp.signal = 1;
    MF_CUDA_TRY(mf_ep_signal_wait(&sp, stream));
    if (!fused) MF_CUDA_TRY(mf_sm90_wgrad_grouped_bf16(&dw13, stream));
    sp.signal = 0;
    sp.wait = 1;
    MF_CUDA_TRY(mf_ep_signal_wait(&sp, stream));

    // ---- 7. dx = sum of its slot rows; d p of each slot ----
    const mf_reduce_params rp = reduce_params(layer, a->ids, T, a->dx, a->dx_stride);
    MF_CUDA_TRY(mf_reduce_slots_bf16(&rp, stream));
    mf_reduce_dp_params rd = {};
    rd.dp_partial = s->dp_slot;
    rd.parts = 1;
    rd.slot_row = NULL;
    rd.ids = a->ids;
    rd.call_failed = &s->plan_state->call_failed;
    rd.dweights = a->dweights;
    rd.num_tokens = T;
    rd.top_k = K;
    MF_CUDA_TRY(mf_reduce_dp_f32(&rd, stream));
    return MOEFUSE_OK;
}

}  // namespace backend
}  // namespace mf
