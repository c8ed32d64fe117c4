/* How a precision feeds the expert GEMMs: the pipeline builds each GEMM's params on the
 * bf16 buffers (stages.cu), then the layer's operand preparation (exec_plan.operands)
 * makes them the operands its GEMMs read, right before the launch:
 *   bf16  the rows and the weights as they are: nothing to do;
 *   FP8   (docs/decisions/0018-fp8-block-recipe.md) each A operand quantized 1 x 128
 *         along its K into the layer's row codes (x for gemm1, a for gemm2, dy for
 *         dgrad2, [dg; du] for dgrad1: one buffer, used in turn), the weight gradients'
 *         operands quantized in tiles of 128 tokens and transposed (p dy and a for dW2,
 *         [dg; du] and x for dW13: two buffers, used in turn), and the weights the
 *         caller quantized (W for the forward, W^T for the dgrads).
 * NOTE: the FP8 quantizations are passes of their own over rows a kernel just wrote
 * (about 3 bytes per element moved: read bf16, write the code; the scales add 1/32):
 * the dispatch and the epilogues that hold these tiles could write them instead.
 *
 * FP8 workspaces, bytes per row of rows_cap (W = max(H, 2I)): row codes W + 4W/128;
 * token codes (max(H, 2I) + max(H, I)) (1 + 4/128). qwen3-30b-a3b: 2,112 + 4,224 B,
 * qwen3-235b-a22b: 4,224 + 8,448 B (against the bf16 workspaces' ~12.8 / 25.6 KB). */
#include <cuda_runtime.h>
#include <stdint.h>

#include "check.h"
#include "pipeline/state.h"

namespace mf {
namespace pipeline {

namespace {

int max_int(int a, int b) { return a > b ? a : b; }

/* Scale rows of a [K / 128, rows] scale array: rows rounded up to 4 (16-byte TMA rows). */
int scale_ld(int rows_cap) { return (rows_cap + 3) / 4 * 4; }

/* ---- bf16: the operands as they are ------------------------------------------------ */

moefuse_status bf16_create(moefuse_layer *, cuda_state *) { return MOEFUSE_OK; }
template <class Params>
moefuse_status as_they_are(const moefuse_layer *, const call_bufs &, const moefuse_fp8_weights *,
                           Params *, cudaStream_t) {
    return MOEFUSE_OK;
}

/* ---- FP8 --------------------------------------------------------------------------- */

moefuse_status fp8_create(moefuse_layer *layer, cuda_state *s) {
    const moefuse_config *c = &layer->cfg;
    const int64_t rows_cap = s->sizes.rows_cap;   /* the workspaces' rows (sizing.c) */
    const int64_t ld = scale_ld((int)rows_cap);
    const int64_t row_cols = max_int(c->hidden, 2 * c->intermediate);
    const int64_t lhs_cols = max_int(c->hidden, 2 * c->intermediate);   /* p dy, [dg; du] */
    const int64_t rhs_cols = max_int(c->hidden, c->intermediate);       /* a, x */
    MF_ALLOC_FIELD(s, fp8_rows, rows_cap * row_cols);
    MF_ALLOC_FIELD(s, fp8_row_scales, row_cols / 128 * ld * 4);
    MF_ALLOC_FIELD(s, fp8_lhs_t, rows_cap * lhs_cols);
    MF_ALLOC_FIELD(s, fp8_lhs_scales, rows_cap / 128 * lhs_cols * 4);
    MF_ALLOC_FIELD(s, fp8_rhs_t, rows_cap * rhs_cols);
    MF_ALLOC_FIELD(s, fp8_rhs_scales, rows_cap / 128 * rhs_cols * 4);
    return MOEFUSE_OK;
}

/* The call's rows of `in` ([rows_cap, cols] bf16, the GEMMs' row count) quantized
 * 1 x 128 into the layer's row codes: the A operand of a row GEMM. */
moefuse_status quantized_rows(const moefuse_layer *layer, const call_bufs &c,
                              const uint16_t *in, int cols, cudaStream_t stream,
                              mf_operand *out) {
    const cuda_state *s = state_of(layer);
    mf_quantize_fp8_rows_params q = {};
    q.in = in;
    q.ld = cols;
    q.rows_cap = c.lay.rows_cap;
    q.num_rows = s->gemm_num_rows;
    q.cols = cols;
    q.pow2 = layer->cfg.fp8_pow2_scales;
    q.codes = s->fp8_rows;
    q.scales = s->fp8_row_scales;
    q.scale_ld = scale_ld(c.lay.rows_cap);
    if (c.lay.rows_cap > 0) MF_CUDA_TRY(mf_quantize_fp8_rows(&q, stream));
    *out = mf_operand{s->fp8_rows, MF_DTYPE_E4M3, s->fp8_row_scales, MF_SCALES_1X128};
    return MOEFUSE_OK;
}

/* A weight gradient's operand: `in` ([rows_cap, cols] bf16; times each row's p when
 * row_weight is set) quantized per 128 tokens and transposed, [cols, rows_cap]. */
moefuse_status quantized_tokens(const moefuse_layer *layer, int rows_cap, const uint16_t *in,
                                int cols, const float *row_weight, uint8_t *codes,
                                float *scales, cudaStream_t stream, mf_operand *out) {
    const cuda_state *s = state_of(layer);
    mf_quantize_fp8_tokens_params q = {};
    q.in = in;
    q.ld = cols;
    q.rows_cap = rows_cap;
    q.num_rows = s->gemm_num_rows;
    q.cols = cols;
    q.row_weight = row_weight;
    q.pow2 = layer->cfg.fp8_pow2_scales;
    q.codes_t = codes;
    q.scales = scales;
    if (rows_cap > 0) MF_CUDA_TRY(mf_quantize_fp8_tokens(&q, stream));
    *out = mf_operand{codes, MF_DTYPE_E4M3, scales, MF_SCALES_TOKENS_128};
    return MOEFUSE_OK;
}

mf_operand weight(const uint8_t *codes, const float *scales) {
    return mf_operand{codes, MF_DTYPE_E4M3, scales, MF_SCALES_128X128};
}

moefuse_status fp8_gemm1(const moefuse_layer *layer, const call_bufs &c,
                         const moefuse_fp8_weights *w, mf_gemm1_params *p, cudaStream_t stream) {
    p->w13 = weight(w->w13, w->w13_scale);
    p->w13_up = NULL;   /* the quantized weights are packed */
    return quantized_rows(layer, c, (const uint16_t *)p->xs.data, p->hidden, stream, &p->xs);
}

moefuse_status fp8_gemm2(const moefuse_layer *layer, const call_bufs &c,
                         const moefuse_fp8_weights *w, mf_gemm2_params *p, cudaStream_t stream) {
    p->w2 = weight(w->w2, w->w2_scale);
    return quantized_rows(layer, c, (const uint16_t *)p->act.data, p->intermediate, stream,
                          &p->act);
}

/* dgrad2 reads W2^T (its FP8 kernel writes the unweighted a for dW2 = (p dy)^T a). */
moefuse_status fp8_dgrad2(const moefuse_layer *layer, const call_bufs &c,
                          const moefuse_fp8_weights *w, mf_dgrad2_params *p,
                          cudaStream_t stream) {
    p->w2 = weight(w->w2t, w->w2t_scale);
    return quantized_rows(layer, c, (const uint16_t *)p->dys.data, p->hidden, stream, &p->dys);
}

moefuse_status fp8_dgrad1(const moefuse_layer *layer, const call_bufs &c,
                          const moefuse_fp8_weights *w, mf_dgrad1_params *p,
                          cudaStream_t stream) {
    p->w13 = weight(w->w13t, w->w13t_scale);
    p->w13_up = NULL;   /* W13^T [E, H, 2I]: packed */
    return quantized_rows(layer, c, (const uint16_t *)p->dh.data, 2 * p->intermediate, stream,
                          &p->dh);
}

/* dW2 = (p dy)^T a: lhs = dy with each row's p applied here, rhs = a. */
moefuse_status fp8_dw2(const moefuse_layer *layer, const call_bufs &, const moefuse_fp8_weights *,
                       mf_wgrad_params *p, cudaStream_t stream) {
    cuda_state *s = state_of(layer);
    MF_TRY(quantized_tokens(layer, p->rows.rows_cap, (const uint16_t *)p->lhs.data, p->m,
                            s->row_weight, s->fp8_lhs_t, s->fp8_lhs_scales, stream, &p->lhs));
    return quantized_tokens(layer, p->rows.rows_cap, (const uint16_t *)p->rhs.data, p->n, NULL,
                            s->fp8_rhs_t, s->fp8_rhs_scales, stream, &p->rhs);
}

/* dW13 = [dg; du]^T x. */
moefuse_status fp8_dw13(const moefuse_layer *layer, const call_bufs &, const moefuse_fp8_weights *,
                        mf_wgrad_params *p, cudaStream_t stream) {
    cuda_state *s = state_of(layer);
    MF_TRY(quantized_tokens(layer, p->rows.rows_cap, (const uint16_t *)p->lhs.data, p->m, NULL,
                            s->fp8_lhs_t, s->fp8_lhs_scales, stream, &p->lhs));
    return quantized_tokens(layer, p->rows.rows_cap, (const uint16_t *)p->rhs.data, p->n, NULL,
                            s->fp8_rhs_t, s->fp8_rhs_scales, stream, &p->rhs);
}

}  // namespace

const operand_prep kBf16Operands = {
    bf16_create,
    as_they_are<mf_gemm1_params>,
    as_they_are<mf_gemm2_params>,
    as_they_are<mf_dgrad2_params>,
    as_they_are<mf_dgrad1_params>,
    as_they_are<mf_wgrad_params>,
    as_they_are<mf_wgrad_params>,
};
const operand_prep kFp8Operands = {
    fp8_create, fp8_gemm1, fp8_gemm2, fp8_dgrad2, fp8_dgrad1, fp8_dw2, fp8_dw13,
};

}  // namespace pipeline
}  // namespace mf
