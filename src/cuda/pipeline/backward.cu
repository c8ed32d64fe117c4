/* The backward, one pipeline over the layer's transport (state.h); the forward's plan
 * is reused from the saved buffer, no new count exchange:
 *   check     the saved plan against the layer, T and ids, on the device
 *             (simt/saved_check.cu); peers: then every rank has started the call
 *             (its windows are free) and the arrival targets of this call are set
 *   dispatch  dy -> dys and x -> xs in the saved plan's row order: local, one
 *             token-major pass (x not with MOEFUSE_SAVE_ACTIVATIONS_AND_INPUTS: dW13
 *             reads the saved xs; FP8: no bf16 rows, dy's row codes, the token tiles'
 *             quantizers gather the caller's rows, and the rows' p; recomputing gemm1,
 *             x's row codes in a pass of their own before it and dy's after it);
 *             peers, a push on the side stream
 *   gemm1     MOEFUSE_RECOMPUTE only: xs -> [g | u] (the forward's very call, so the
 *             forward's bits; act goes to the act workspace and is not read)
 *   dgrad2    dys W2_e with the SwiGLU backward -> dh = [dg | du], act_p = bf16(p a),
 *             d p partial sums per column block
 *             (beside a push, gemm1 and dgrad2 take each row block once it is in)
 *   rows in   peers: the push joined, every rank's push done
 *   dW2       sum over e's rows of dys^T act_p              (reads dys: before dgrad1;
 *             FP8 reads p dy's token codes, made from dy by dgrad2's hook)
 *   dgrad1    dh W13_e -> one dx row per slot (local: into combine over the dead dys;
 *             peers: into the source ranks' combine windows)
 *   sent back peers: d p to the source ranks, DONE raised
 *   dW13      sum over e's rows of dh^T xs: peers here, filling the wait for the others
 *   combined  peers: every rank's DONE
 *   reduce    dx[t] = bf16(sum over k in order of the slot rows), like y; d p of each
 *             slot, its partial sums in order
 *   dW13      local: here
 * With MOEFUSE_PIPELINE_FUSED (and shapes the fused kernel takes) dW2, dgrad1 and dW13
 * are one kernel (src/cuda/sm90/fused_backward.cu); the same bits. FP8: each GEMM's
 * operands quantized right before it (pipeline/operands.cu), dgrad2 writes the unweighted
 * a and dW2 reads p dy (the recipe's dW2 = (p dy)^T a). Every sum has one
 * owner and a fixed order: bitwise reproducible, no atomics. */
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "check.h"
#include "pipeline/state.h"

namespace mf {
namespace pipeline {

namespace {

/* Fails the call (call_failed, gemm_num_rows 0, bwd_offsets 0) and records
 * MOEFUSE_ERR_SAVED_STATE when the saved buffer does not match a forward of this layer
 * with these T and ids. */
moefuse_status check_saved(moefuse_layer *layer, const moefuse_bwd_args *a,
                           const call_bufs &c, cudaStream_t stream) {
    cuda_state *s = state_of(layer);
    const saved_layout &lay = c.lay;
    mf_saved_check_params cp;
    memset(&cp, 0, sizeof cp);
    cp.header = (const int32_t *)(c.base + lay.header);
    cp.counts = (const int32_t *)(c.base + lay.counts);
    cp.offsets = (const int32_t *)(c.base + lay.offsets);
    cp.row_block_expert = (const int32_t *)(c.base + lay.row_block_expert);
    cp.slot_row = (const int32_t *)(c.base + lay.slot_row);
    cp.row_slot = (const int32_t *)(c.base + lay.row_slot);
    cp.ids = a->ids;
    int32_t want[MF_SAVED_HEADER_WORDS];
    header_words(layer, a->num_tokens, lay.rows_cap, c.mode, want);
    memcpy(cp.want, want, sizeof cp.want);
    cp.num_tokens = a->num_tokens;
    cp.top_k = layer->cfg.top_k;
    cp.num_local_experts = layer->num_local_experts;
    cp.expert_begin = layer->expert_begin;
    cp.rows_cap = lay.rows_cap;
    cp.peers = s->plan.rows_from_peers;
    cp.state = s->plan_state;
    cp.gemm_num_rows = s->gemm_num_rows;
    cp.bwd_offsets = s->bwd_offsets;
    MF_CUDA_TRY(mf_saved_check(&cp, stream));
    return MOEFUSE_OK;
}

/* The reduces of dx and d p. */
moefuse_status reduce(moefuse_layer *layer, const moefuse_bwd_args *a, const call_bufs &c,
                      cudaStream_t stream) {
    const cuda_state *s = state_of(layer);
    const mf_reduce_params rp = reduce_params(layer, a->ids, a->num_tokens, a->dx, a->dx_stride);
    MF_CUDA_TRY(mf_reduce_slots_bf16(&rp, stream));
    mf_reduce_dp_params rd = {};
    s->plan.net->dp_sums(layer, c, a->ids, &rd);
    rd.call_failed = &s->plan_state->call_failed;
    rd.dweights = a->dweights;
    rd.num_tokens = a->num_tokens;
    rd.top_k = layer->cfg.top_k;
    MF_CUDA_TRY(mf_reduce_dp_f32(&rd, stream));
    return MOEFUSE_OK;
}

}  // namespace

moefuse_status backward(moefuse_layer *layer, const moefuse_bwd_args *a, void *stream_) {
    cuda_state *s = state_of(layer);
    const exec_plan &plan = s->plan;
    const mf_gemm_ops *gemm = plan.gemm;
    const cudaStream_t stream = (cudaStream_t)stream_;
    plan.net->bind(layer, s);  // peers: the rank's pool, as large as its largest layer
    const int T = a->num_tokens;
    call_bufs c = call_for(layer, T, plan.saved_mode, a->saved);
    if (plan.quantizers_gather) {   // FP8 on one GPU: dy and x read where the caller has them
        c.dy_tokens = a->dy;
        c.dy_tokens_stride = a->dy_stride;
        if (plan.saved_mode != MOEFUSE_SAVE_ACTIVATIONS_AND_INPUTS) {
            c.x_tokens = a->x;
            c.x_tokens_stride = a->x_stride;
        }
    }
    if (T == 0 && !plan.rows_from_peers) {
        // no rows: the wgrad launcher writes zero gradients (accumulating: none)
        mf_wgrad_params dw2 = dw2_params(layer, a, 0, c.dys);
        mf_wgrad_params dw13 = dw13_params(layer, a, 0, c.xs);
        MF_TRY(plan.operands->dw2(layer, c, a->fp8_weights, &dw2, stream));
        MF_TRY(plan.operands->dw13(layer, c, a->fp8_weights, &dw13, stream));
        MF_CUDA_TRY(gemm->wgrad(&dw2, stream));
        MF_CUDA_TRY(gemm->wgrad(&dw13, stream));
        return MOEFUSE_OK;
    }

    // ---- 0. the saved plan, checked; peers: every rank in the call ----
    MF_TRY(check_saved(layer, a, c, stream));
    MF_TRY(plan.net->sync(layer, kBackwardStart, c, stream));

    // ---- 1. dispatch of dy and x (FP8 recomputing gemm1 on one GPU: x's row codes
    //      first, as the forward's dispatch makes them, and dy's after gemm1 has read
    //      them: both use the one row-code workspace) ----
    const token_rows rows = {a->ids, a->weights, a->x, a->x_stride, a->dy, a->dy_stride};
    const bool recompute = plan.saved_mode == MOEFUSE_RECOMPUTE;
    const bool x_codes_first = recompute && plan.quantizers_gather;
    if (x_codes_first) {
        call_bufs cx = c;
        cx.x_codes = true;
        const token_rows x_rows = {a->ids, a->weights, a->x, a->x_stride, NULL, 0};
        MF_TRY(plan.net->dispatch(layer, x_rows, cx, stream));
    } else {
        MF_TRY(plan.net->dispatch(layer, rows, c, stream));
    }
    const row_arrivals arrivals = plan.net->arrivals(layer, c, true);

    // ---- 2. [g | u]: saved, or recomputed by the forward's gemm1 ----
    // (act is not read: dgrad2 overwrites it with act_p)
    const uint16_t *gate_up = (const uint16_t *)(c.base + c.lay.gate_up);
    if (recompute) {
        call_bufs cg = c;
        cg.x_codes = x_codes_first;
        mf_gemm1_params g1 = gemm1_params(layer, cg, a->w13, a->w13_up, s->gate_up);
        with_arrivals(&g1, arrivals);
        MF_TRY(plan.operands->gemm1(layer, cg, a->fp8_weights, &g1, stream));
        MF_CUDA_TRY(gemm->gemm1(&g1, stream));
        gate_up = s->gate_up;
    }
    if (x_codes_first) MF_TRY(plan.net->dispatch(layer, rows, c, stream));

    // ---- 3. dgrad2 + SwiGLU backward: dh, act_p, d p partials; then every row in (a
    //      failed wait fails the call: no dx rows, d p or reduce after it) ----
    mf_dgrad2_params d2 = dgrad2_params(layer, c, a->w2, gate_up);
    d2.row_weight = s->row_weight;
    with_arrivals(&d2, arrivals);
    MF_TRY(plan.operands->dgrad2(layer, c, a->fp8_weights, &d2, stream));
    MF_CUDA_TRY(gemm->dgrad2(&d2, stream));
    MF_TRY(plan.net->sync(layer, kBackwardRowsIn, c, stream));

    // ---- 4. dW2 = dys^T act_p per expert, before dgrad1 overwrites dys (local);
    //      5. dgrad1: dh W13_e -> dx slot rows; 6. dW13 = dh^T xs per expert.
    //      One fused kernel or one kernel each; the same bits ----
    MF_CUDA_TRY(mf_expert_order(s->bwd_offsets, layer->num_local_experts, s->expert_order,
                                stream));
    mf_wgrad_params dw2 = dw2_params(layer, a, c.lay.rows_cap, c.dys);
    mf_dgrad1_params d1 = dgrad1_params(layer, c, a->w13, a->w13_up);
    d1.to = plan.net->scatter(layer, c);
    mf_wgrad_params dw13 = dw13_params(layer, a, c.lay.rows_cap, c.xs);
    if (plan.fused_backward) {
        const mf_moe_fused_bwd_params fb = {dw2, d1, dw13, s->act_ready};
        MF_CUDA_TRY(gemm->fused_backward(&fb, stream));
    } else {
        MF_TRY(plan.operands->dw2(layer, c, a->fp8_weights, &dw2, stream));
        MF_CUDA_TRY(gemm->wgrad(&dw2, stream));
        MF_TRY(plan.operands->dgrad1(layer, c, a->fp8_weights, &d1, stream));
        MF_CUDA_TRY(gemm->dgrad1(&d1, stream));
    }
    MF_TRY(plan.net->sync(layer, kBackwardSentBack, c, stream));
    const bool dw13_staged = !plan.fused_backward;
    if (dw13_staged) MF_TRY(plan.operands->dw13(layer, c, a->fp8_weights, &dw13, stream));
    if (dw13_staged && plan.dw13_before_wait) MF_CUDA_TRY(gemm->wgrad(&dw13, stream));

    // ---- 7. dx = sum of its K slot rows, fp32, k order; d p ----
    MF_TRY(plan.net->sync(layer, kBackwardCombined, c, stream));
    MF_TRY(reduce(layer, a, c, stream));
    if (dw13_staged && !plan.dw13_before_wait) MF_CUDA_TRY(gemm->wgrad(&dw13, stream));
    return MOEFUSE_OK;
}

}  // namespace pipeline
}  // namespace mf
