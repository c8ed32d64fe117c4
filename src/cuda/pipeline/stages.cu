/* The params of the stages both directions and both transports run, on the layer's
 * workspaces (act, dh, dp_partial, combine, gemm_num_rows) and a call's rows. */
#include <stdint.h>

#include "pipeline/state.h"

namespace mf {
namespace pipeline {

namespace {

/* The call's expert-sorted rows, as the row-block GEMMs read them. */
mf_rows row_blocks(const moefuse_layer *layer, const call_bufs &c) {
    mf_rows r = {};
    r.row_block_expert = c.rbe;
    r.num_rows = state_of(layer)->gemm_num_rows;
    r.rows_cap = c.lay.rows_cap;
    r.num_local_experts = layer->num_local_experts;
    return r;
}

/* A bf16 input, unscaled. */
mf_operand bf16(const void *data) { return mf_operand{data, MF_DTYPE_BF16, NULL, MF_SCALES_NONE}; }

/* The sizes and grid every expert GEMM over the call's rows shares. */
template <class GemmParams>
void sizes(const moefuse_layer *layer, GemmParams *p) {
    p->hidden = layer->cfg.hidden;
    p->intermediate = layer->cfg.intermediate;
    p->num_sms = state_of(layer)->plan.num_sms;
}

}  // namespace

mf_gemm1_params gemm1_params(const moefuse_layer *layer, const call_bufs &c,
                             const uint16_t *w13, const uint16_t *w13_up, uint16_t *gate_up) {
    mf_gemm1_params g = {};
    g.rows = row_blocks(layer, c);
    sizes(layer, &g);
    g.xs = bf16(c.xs);
    g.w13 = bf16(w13);
    g.w13_up = w13_up;
    g.act = state_of(layer)->act;
    g.gate_up = gate_up;
    return g;
}

mf_gemm2_params gemm2_params(const moefuse_layer *layer, const call_bufs &c, const uint16_t *w2) {
    mf_gemm2_params g = {};
    g.rows = row_blocks(layer, c);
    sizes(layer, &g);
    g.act = bf16(state_of(layer)->act);
    g.w2 = bf16(w2);
    return g;
}

mf_dgrad2_params dgrad2_params(const moefuse_layer *layer, const call_bufs &c,
                               const uint16_t *w2, const uint16_t *gate_up) {
    const cuda_state *s = state_of(layer);
    mf_dgrad2_params d = {};
    d.rows = row_blocks(layer, c);
    sizes(layer, &d);
    d.dys = bf16(c.dys);
    d.w2 = bf16(w2);
    d.gate_up = gate_up;
    d.row_slot = c.row_slot;
    d.dh = s->dh;
    d.act_p = s->act;
    d.dp_partial = s->dp_partial;
    return d;
}

mf_dgrad1_params dgrad1_params(const moefuse_layer *layer, const call_bufs &c,
                               const uint16_t *w13, const uint16_t *w13_up) {
    mf_dgrad1_params d = {};
    d.rows = row_blocks(layer, c);
    sizes(layer, &d);
    d.dh = bf16(state_of(layer)->dh);
    d.w13 = bf16(w13);
    d.w13_up = w13_up;
    return d;
}

/* What dW2 and dW13 share: the expert segments, the mode, the grid. */
static mf_wgrad_params wgrad_common(const moefuse_layer *layer, const moefuse_bwd_args *a,
                                    int rows_cap) {
    const cuda_state *s = state_of(layer);
    mf_wgrad_params w = {};
    w.rows.expert_offsets = s->bwd_offsets;
    w.rows.rows_cap = rows_cap;
    w.rows.num_local_experts = layer->num_local_experts;
    w.expert_order = s->expert_order;
    w.accumulate = a->accumulate;
    w.num_sms = s->plan.num_sms;
    return w;
}

mf_wgrad_params dw2_params(const moefuse_layer *layer, const moefuse_bwd_args *a, int rows_cap,
                           const uint16_t *dys) {
    mf_wgrad_params w = wgrad_common(layer, a, rows_cap);
    w.lhs = bf16(dys);
    w.rhs = bf16(state_of(layer)->act);
    w.dw = a->dw2;
    w.dw_bf16 = a->dw2_bf16;
    w.m = layer->cfg.hidden;
    w.n = layer->cfg.intermediate;
    return w;
}

mf_wgrad_params dw13_params(const moefuse_layer *layer, const moefuse_bwd_args *a,
                            int rows_cap, const uint16_t *xs) {
    mf_wgrad_params w = wgrad_common(layer, a, rows_cap);
    w.lhs = bf16(state_of(layer)->dh);
    w.rhs = bf16(xs);
    w.dw = a->dw13;
    w.dw_bf16 = a->dw13_bf16;
    w.dw_up = a->dw13_up;
    w.dw_bf16_up = a->dw13_up_bf16;
    w.m = 2 * layer->cfg.intermediate;
    w.n = layer->cfg.hidden;
    return w;
}

mf_reduce_params reduce_params(const moefuse_layer *layer, const int32_t *ids, int num_tokens,
                               uint16_t *out, int64_t out_stride) {
    const cuda_state *s = state_of(layer);
    mf_reduce_params r = {};
    r.combine = s->combine;
    r.ids = ids;
    r.call_failed = &s->plan_state->call_failed;
    r.y = out;
    r.y_stride = out_stride;
    r.num_tokens = num_tokens;
    r.top_k = layer->cfg.top_k;
    r.hidden = layer->cfg.hidden;
    return r;
}

}  // namespace pipeline
}  // namespace mf
