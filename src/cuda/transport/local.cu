/* The local transport (no comm, R = 1): the plan sorts the slots over the local
 * experts; the dispatch gathers token-major rows into the expert-sorted buffers
 * (dispatch_rows.cu), in the backward dy and x in one pass; the GEMMs find all their
 * rows there and write slot rows into the layer's combine workspace, which also holds
 * the backward's dys. The rows' sources (row_slot) are the saved plan's. Nothing to
 * wait for: no sync points. */
#include <cuda_runtime.h>
#include <stdint.h>

#include "check.h"
#include "pipeline/state.h"

namespace mf {
namespace pipeline {

namespace {

moefuse_status create(moefuse_layer *, cuda_state *) { return MOEFUSE_OK; }

moefuse_status connect(moefuse_layer *, cuda_state *, moefuse_status created) { return created; }

void destroy(moefuse_layer *, cuda_state *) {}

void bind(moefuse_layer *, cuda_state *) {}  // the layer owns every buffer

void locate_rows(const moefuse_layer *layer, call_bufs *c) {
    cuda_state *s = state_of(layer);
    c->xs = c->mode == MOEFUSE_SAVE_ACTIVATIONS_AND_INPUTS ? (uint16_t *)(c->base + c->lay.xs)
                                                           : s->xs;
    c->dys = s->combine;
    c->row_slot = (const int32_t *)(c->base + c->lay.row_slot);
}

moefuse_status plan(moefuse_layer *layer, const moefuse_fwd_args *a, const call_bufs &c,
                    cudaStream_t stream) {
    const cuda_state *s = state_of(layer);
    mf_plan_params pp = {};
    pp.ids = a->ids;
    pp.num_tokens = a->num_tokens;
    pp.top_k = layer->cfg.top_k;
    pp.num_experts = layer->cfg.num_experts;
    pp.expert_begin = layer->expert_begin;
    pp.num_local_experts = layer->num_local_experts;
    pp.rows_cap = c.lay.rows_cap;
    pp.slot_rank = s->slot_rank;
    pp.chunk_base = s->chunk_base;
    pp.state = s->plan_state;
    pp.gemm_num_rows = s->gemm_num_rows;
    pp.expert_counts = (int32_t *)(c.base + c.lay.counts);
    pp.expert_offsets = (int32_t *)(c.base + c.lay.offsets);
    pp.row_block_expert = (int32_t *)(c.base + c.lay.row_block_expert);
    pp.slot_row = (int32_t *)(c.base + c.lay.slot_row);
    pp.row_slot = (int32_t *)(c.base + c.lay.row_slot);
    pp.saved_header = (int32_t *)(c.base + c.lay.header);
    pp.num_rows = pp.saved_header + MF_SAVED_NUM_ROWS;
    pp.user_counts = a->expert_counts;
    header_words(layer, a->num_tokens, c.lay.rows_cap, c.mode, pp.header_words);
    MF_CUDA_TRY(mf_plan_build_cuda(&pp, stream));
    return MOEFUSE_OK;
}

/* Forward: x -> xs (FP8 with c.x_codes: x -> its row codes). Backward: dy -> dys and
 * x -> s->xs in one pass, x not when the forward saved its xs or the FP8 quantizers
 * gather it (c.x_tokens); where they gather dy's tokens (c.dy_tokens), dy -> its row
 * codes instead of dys (x is then gathered or saved: one tensor). */
moefuse_status dispatch(moefuse_layer *layer, const token_rows &rows, const call_bufs &c,
                        cudaStream_t stream) {
    const cuda_state *s = state_of(layer);
    mf_dispatch_params dp = {};
    if (rows.dy) {
        int n = 0;   // dy (bf16 rows, or FP8 codes), x: unless gathered or saved
        dp.x[n] = rows.dy;
        dp.x_stride[n] = rows.dy_stride;
        if (c.dy_tokens)   // FP8: codes, not bf16 rows (x is then gathered or saved)
            fp8_row_codes_out(layer, c, &dp);
        else
            dp.xs[n] = c.dys;
        ++n;
        if (c.mode != MOEFUSE_SAVE_ACTIVATIONS_AND_INPUTS && !c.x_tokens) {
            dp.x[n] = rows.x;
            dp.x_stride[n] = rows.x_stride;
            dp.xs[n++] = s->xs;
        }
        dp.num_tensors = n;   // 0: the rows' p only
    } else {
        dp.x[0] = rows.x;
        dp.x_stride[0] = rows.x_stride;
        dp.xs[0] = c.xs;
        dp.num_tensors = 1;
        if (c.x_codes) fp8_row_codes_out(layer, c, &dp);   // FP8: codes, not bf16 rows
    }
    dp.slot_row = (const int32_t *)(c.base + c.lay.slot_row);
    dp.row_slot = c.row_slot;
    dp.num_rows = s->gemm_num_rows;
    dp.call_failed = &s->plan_state->call_failed;
    dp.num_tokens = c.num_tokens;
    dp.rows_cap = c.lay.rows_cap;
    dp.hidden = layer->cfg.hidden;
    dp.top_k = layer->cfg.top_k;
    dp.num_sms = s->plan.num_sms;
    dp.weights = rows.weights;
    dp.row_weight = s->row_weight;
    MF_CUDA_TRY(mf_dispatch_rows_bf16(&dp, stream));
    return MOEFUSE_OK;
}

row_arrivals arrivals(const moefuse_layer *, const call_bufs &, bool) {
    return row_arrivals{};  // the dispatch ran before: every row is there
}

mf_scatter scatter(const moefuse_layer *layer, const call_bufs &c) {
    return mf_scatter{c.row_slot, state_of(layer)->combine, NULL, 0};
}

moefuse_status sync(moefuse_layer *, sync_point, const call_bufs &, cudaStream_t) {
    return MOEFUSE_OK;
}

/* d p of a slot: the dgrad2 partial sums of its row */
void dp_sums(const moefuse_layer *layer, const call_bufs &c, const int32_t *,
             mf_reduce_dp_params *rd) {
    const cuda_state *s = state_of(layer);
    rd->dp_partial = s->dp_partial;
    rd->parts = s->plan.dp_parts;
    rd->slot_row = (const int32_t *)(c.base + c.lay.slot_row);
    rd->ids = NULL;
}

}  // namespace

extern const transport kLocal = {
    "local", create, connect, destroy, bind, locate_rows, plan, dispatch, arrivals, scatter, sync,
    dp_sums,
};

}  // namespace pipeline
}  // namespace mf
