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
 * sync; with the scratch act, dh, dp_partial and gate_up they are the rank's pool on the
 * comm, shared by its layers, sized by the largest (transport/ep_pool.cu). Each receiver
 * sizes its row buffers for its receive capacity plus padding
 * (config.recv_capacity_factor); a routing over it fails the call on every rank in the
 * count exchange (MOEFUSE_ERR_CAPACITY).
 *
 * Results: the receive order is the one-rank plan's order on the ranks' concatenated
 * tokens (see ep_exchange_counts.cu), so y, dx, d p and dW are the bits of one rank
 * running the concatenated batch. */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "check.h"
#include "pipeline/state.h"
#include "transport/ep_sync.h"

namespace mf {
namespace pipeline {

namespace {

int64_t timeout_ns(const moefuse_layer *layer) {
    return (int64_t)layer->comm->timeout_ms * 1000000;
}

/* ---- create, destroy ----------------------------------------------------------------- */

/* Local work only: the checks, the send plan's buffers, the streams, and what the layer
 * needs of its rank's pool (pool_prepare). */
moefuse_status create(moefuse_layer *layer, cuda_state *s) {
    const moefuse_config *c = &layer->cfg;
    moefuse_comm *comm = layer->comm;
    const int R = c->num_ranks;
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
#ifndef MOEFUSE_HAVE_NCCL
    if (comm->kind == MF_COMM_NCCL)
        return mf_fail(MOEFUSE_ERR_UNSUPPORTED, "an NCCL comm in a build without NCCL");
#endif
    const mf_sizes &z = s->sizes;
    MF_ALLOC_FIELD(s, send_counts, z.send_counts);
    MF_ALLOC_FIELD(s, send_offsets, z.send_offsets);
    MF_ALLOC_FIELD(s, send_rbe, z.send_rbe);
    MF_ALLOC_FIELD(s, send_slot_row, z.send_slot_row);
    MF_ALLOC_FIELD(s, send_row_slot, z.send_row_slot);
    MF_ALLOC_FIELD(s, send_scalars, z.send_scalars);
    MF_ALLOC_FIELD(s, dest_base, z.dest_base);
    MF_CUDA_TRY(cudaStreamCreateWithFlags(&s->side, cudaStreamNonBlocking));
    MF_CUDA_TRY(cudaEventCreateWithFlags(&s->fork, cudaEventDisableTiming));
    MF_CUDA_TRY(cudaEventCreateWithFlags(&s->join, cudaEventDisableTiming));
    return pool_prepare(layer, s);
}

moefuse_status connect(moefuse_layer *layer, cuda_state *s, moefuse_status created) {
#ifdef MOEFUSE_HAVE_NCCL
    moefuse_comm *comm = layer->comm;
    if (comm->kind == MF_COMM_NCCL) {
        char mine[1024];  // this rank's own message, kept over the vote
        snprintf(mine, sizeof mine, "%s", moefuse_last_error());
        int failed_rank = 0;
        const moefuse_status voted = mf_nccl_agree(comm, created != MOEFUSE_OK, &failed_rank);
        if (created != MOEFUSE_OK) return mf_fail(created, "%s", mine);
        if (voted != MOEFUSE_OK) return voted;
        if (failed_rank)
            return mf_fail(MOEFUSE_ERR_NCCL,
                           "moefuse_layer_create: rank %d's create failed (its "
                           "moefuse_last_error says why), so no rank registered a window; "
                           "expected the create to succeed on every rank",
                           failed_rank - 1);
    }
#endif
    if (created != MOEFUSE_OK) return created;
    MF_TRY(pool_join(layer, s));
    pool_bind(layer, s);
    return MOEFUSE_OK;
}

/* Also undoes a partial create. */
void destroy(moefuse_layer *layer, cuda_state *s) {
    if (s->side) cudaStreamDestroy(s->side);
    if (s->fork) cudaEventDestroy(s->fork);
    if (s->join) cudaEventDestroy(s->join);
    s->side = NULL;
    s->fork = s->join = NULL;
    void *own[] = {s->send_counts, s->send_offsets, s->send_rbe, s->send_slot_row,
                   s->send_row_slot, s->send_scalars, s->dest_base};
    for (void *b : own)
        if (b) cudaFree(b);
    s->send_counts = s->send_offsets = s->send_rbe = s->send_slot_row = NULL;
    s->send_row_slot = s->send_scalars = s->dest_base = NULL;
    pool_leave(layer, s);
}

void bind(moefuse_layer *layer, cuda_state *s) { pool_bind(layer, s); }

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
    pp.rows_cap = mf_padded_rows((int64_t)T * layer->cfg.top_k, E);
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
    ex.recv_capacity = (int)s->sizes.recv_capacity;
    ex.arrival_target = s->targets;
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
    if (c.x_codes) {   // FP8 forward: x's rows quantized as they are pushed
        pu.x_codes = 1;
        pu.pow2 = layer->cfg.fp8_pow2_scales;
        pu.rows_cap = c.lay.rows_cap;
    }
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
    w.rows_in.target = s->targets;
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
        sp.arrival_target = s->targets;
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
    "peers", create, connect, destroy, bind, locate_rows, plan, dispatch, arrivals, scatter, sync,
    dp_sums,
};

}  // namespace pipeline
}  // namespace mf
