/* The forward, one pipeline over the layer's transport (state.h):
 *   plan      local: the slots over the local experts; peers: the slots over all
 *             experts (the sends), then the count exchange and the receive layout
 *   dispatch  x rows and their p into the expert-sorted xs: local, the token-major
 *             gather; peers, a push to the experts' ranks on the side stream
 *   gemm1     xs W13^T with SwiGLU -> act (and [g; u] into saved); beside a push, each
 *             row block once its rows have arrived
 *   gemm2     act W2^T, rows scaled by p into their slot rows of the combine buffer
 *             (peers: the source rank's)
 *             (MOEFUSE_PIPELINE_FUSED: gemm1 and gemm2 in one kernel; the same bits)
 *             (FP8: x rows and act quantized 1 x 128 before each GEMM, operands.cu; on
 *             one GPU x by its dispatch unless the forward saves its rows)
 *   combined  peers: every rank's combine rows are in, the push joined
 *   reduce    y[t] = sum of its K slot rows, fp32, k order
 * On bad ids the plan sets the GEMMs' row count to 0 and fails the call: the later
 * kernels touch nothing. */
#include <cuda_runtime.h>
#include <stdint.h>

#include "check.h"
#include "pipeline/state.h"

namespace mf {
namespace pipeline {

moefuse_status forward(moefuse_layer *layer, const moefuse_fwd_args *a, void *stream_) {
    cuda_state *s = state_of(layer);
    const exec_plan &plan = s->plan;
    const cudaStream_t stream = (cudaStream_t)stream_;
    plan.net->bind(layer, s);  // peers: the rank's pool, as large as its largest layer
    const int T = a->num_tokens;
    /* the plan into the caller's saved buffer, else into the workspace */
    const moefuse_saved_mode mode = a->saved ? plan.saved_mode : MOEFUSE_RECOMPUTE;
    call_bufs c = call_for(layer, T, mode, a->saved);
    // FP8: x quantized by its dispatch, its bf16 rows kept only when saved (one GPU)
    c.x_codes = plan.dispatch_quantizes_x && mode != MOEFUSE_SAVE_ACTIVATIONS_AND_INPUTS;

    // ---- 1. plan ----
    MF_TRY(plan.net->plan(layer, a, c, stream));
    if (T == 0 && !plan.rows_from_peers) return MOEFUSE_OK;  // expert_counts = 0; no rows

    // ---- 2. dispatch ----
    const token_rows rows = {a->ids, a->weights, a->x, a->x_stride, NULL, 0};
    MF_TRY(plan.net->dispatch(layer, rows, c, stream));

    // ---- 3. gemm1 + SwiGLU; 4. gemm2 + combine ----
    uint16_t *gate_up = mode != MOEFUSE_RECOMPUTE ? (uint16_t *)(c.base + c.lay.gate_up) : NULL;
    mf_gemm1_params g1 = gemm1_params(layer, c, a->w13, a->w13_up, gate_up);
    with_arrivals(&g1, plan.net->arrivals(layer, c, false));
    mf_gemm2_params g2 = gemm2_params(layer, c, a->w2);
    g2.row_weight = s->row_weight;
    g2.to = plan.net->scatter(layer, c);
    if (plan.fused_forward) {
        // beside a push its gemm2 tiles run on the SMs the push leaves too
        g2.num_sms = g1.num_sms;
        const mf_moe_fused_fwd_params fp = {g1, g2, s->act_ready};
        MF_CUDA_TRY(plan.gemm->fused_forward(&fp, stream));
    } else {
        MF_TRY(plan.operands->gemm1(layer, c, a->fp8_weights, &g1, stream));
        MF_CUDA_TRY(plan.gemm->gemm1(&g1, stream));
        MF_TRY(plan.operands->gemm2(layer, c, a->fp8_weights, &g2, stream));
        MF_CUDA_TRY(plan.gemm->gemm2(&g2, stream));
    }

    // ---- 5. reduce, once every slot row is in ----
    MF_TRY(plan.net->sync(layer, kForwardCombined, c, stream));
    const mf_reduce_params rp = reduce_params(layer, a->ids, T, a->y, a->y_stride);
    MF_CUDA_TRY(mf_reduce_slots_bf16(&rp, stream));
    return MOEFUSE_OK;
}

}  // namespace pipeline
}  // namespace mf
