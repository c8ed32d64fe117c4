/* How a precision feeds the expert GEMMs: the pipeline builds each GEMM's params on the
 * bf16 buffers (stages.cu), then the layer's operand preparation (exec_plan.operands)
 * makes them the operands its GEMMs read, right before the launch:
 *   bf16  the rows and the weights as they are: nothing to do;
 *   FP8   (docs/decisions/0018-fp8-block-recipe.md) each A operand quantized 1 x 128
 *         along its K into the layer's row codes (x for gemm1, a for gemm2, dy for
 *         dgrad2, [dg; du] for dgrad1: one buffer, used in turn; the forward's x by its
 *         dispatch as it moves the rows, unless saved: on one GPU into that buffer,
 *         fp8_row_codes_out, with a comm into the x rows window by the push; on one GPU
 *         the backward's dy by its dispatch too (after x's again where gemm1 is
 *         recomputed), and the token tiles of dy and x read where the caller has them,
 *         gathered through row_slot), the weight gradients'
 *         operands quantized in tiles of 128 tokens and transposed (p dy and a for dW2,
 *         [dg; du] and x for dW13: two buffers, used in turn), and the weights the
 *         caller quantized (W for the forward, W^T for the dgrads). [dg; du], and dy
 *         where the dispatch did not quantize it, are read once for both of their forms,
 *         by dgrad1's and dgrad2's hooks (the backward runs dgrad2, dW2, dgrad1, dW13 in
 *         this order on one stream; FP8 has no fused backward), so dW2's and dW13's
 *         hooks quantize only a and x (docs/decisions/0023-fp8-quantizer-bandwidth.md,
 *         0026-fp8-x-quantized-by-the-dispatch.md).
 *         With expert parallelism the backward's x and dy arrive from the peers while the
 *         call runs: the hooks of the GEMMs that quantize received rows (the recomputed
 *         gemm1, dgrad2) wait for all of them first (mf_ep_wait_rows), so that
 *         quantization does not overlap the push; the forward's gemm1 reads the pushed
 *         codes block by block as they arrive, as BF16's does. The
 *         received rows are the rows a single rank would gather, so the codes are too.
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

/* Without a comm the layer's own; with one the pool's MF_POOL_FP8 scratch, pointed at by
 * the pool's bind (transport/ep_pool.cu). */
moefuse_status fp8_create(moefuse_layer *, cuda_state *s) {
    if (s->plan.rows_from_peers) return MOEFUSE_OK;
    const mf_sizes &z = s->sizes;   /* sizing.c: the FP8 workspaces' bytes */
    MF_ALLOC_FIELD(s, fp8_rows, z.fp8_rows);
    MF_ALLOC_FIELD(s, fp8_row_scales, z.fp8_row_scales);
    MF_ALLOC_FIELD(s, fp8_lhs_t, z.fp8_lhs_t);
    MF_ALLOC_FIELD(s, fp8_lhs_scales, z.fp8_lhs_scales);
    MF_ALLOC_FIELD(s, fp8_rhs_t, z.fp8_rhs_t);
    MF_ALLOC_FIELD(s, fp8_rhs_scales, z.fp8_rhs_scales);
    return MOEFUSE_OK;
}

/* Where a quantizer reads the call's rows: the expert-sorted rows (in, row stride cols),
 * or, gathered, the caller's token-major rows (in, row stride ld) through row_slot. */
struct rows_src {
    const uint16_t *in;
    int64_t ld;
    const int32_t *row_slot;   /* NULL: sorted */
    int top_k;
};

rows_src sorted_rows(const void *in, int cols) {
    return rows_src{(const uint16_t *)in, cols, NULL, 0};
}

/* The caller's token rows `tokens` (stride ld) where the call has them gathered
 * (c.dy_tokens, c.x_tokens), else the sorted rows `sorted`. */
rows_src rows_of(const moefuse_layer *layer, const call_bufs &c, const uint16_t *tokens,
                 int64_t ld, const void *sorted, int cols) {
    if (!tokens) return sorted_rows(sorted, cols);
    return rows_src{tokens, ld, c.row_slot, layer->cfg.top_k};
}

/* The quantizer params of the call's rows `src` ([rows_cap, cols] bf16, the GEMMs' row
 * count): 1 x 128 into the layer's row codes (the A operand of a row GEMM), and per 128
 * tokens, transposed ([cols, rows_cap]; times each row's p when row_weight is set) into
 * `codes` / `scales` (a weight gradient's operand). */
mf_quantize_fp8_rows_params rows_params(const moefuse_layer *layer, int rows_cap,
                                        const rows_src &src, int cols) {
    const cuda_state *s = state_of(layer);
    mf_quantize_fp8_rows_params q = {};
    q.in = src.in;
    q.ld = src.ld;
    q.row_slot = src.row_slot;
    q.top_k = src.top_k;
    q.rows_cap = rows_cap;
    q.num_rows = s->gemm_num_rows;
    q.cols = cols;
    q.pow2 = layer->cfg.fp8_pow2_scales;
    q.codes = s->fp8_rows;
    q.scales = s->fp8_row_scales;
    q.scale_ld = scale_ld(rows_cap);
    return q;
}

mf_quantize_fp8_tokens_params tokens_params(const moefuse_layer *layer, int rows_cap,
                                            const rows_src &src, int cols,
                                            const float *row_weight, uint8_t *codes,
                                            float *scales) {
    const cuda_state *s = state_of(layer);
    mf_quantize_fp8_tokens_params q = {};
    q.in = src.in;
    q.ld = src.ld;
    q.row_slot = src.row_slot;
    q.top_k = src.top_k;
    q.rows_cap = rows_cap;
    q.num_rows = s->gemm_num_rows;
    q.cols = cols;
    q.row_weight = row_weight;
    q.pow2 = layer->cfg.fp8_pow2_scales;
    q.codes_t = codes;
    q.scales = scales;
    return q;
}

mf_operand row_operand(const cuda_state *s) {
    return mf_operand{s->fp8_rows, MF_DTYPE_E4M3, s->fp8_row_scales, MF_SCALES_1X128};
}

mf_operand token_operand(const uint8_t *codes, const float *scales) {
    return mf_operand{codes, MF_DTYPE_E4M3, scales, MF_SCALES_TOKENS_128};
}

moefuse_status quantized_rows(const moefuse_layer *layer, const call_bufs &c,
                              const rows_src &src, int cols, cudaStream_t stream,
                              mf_operand *out) {
    const mf_quantize_fp8_rows_params q = rows_params(layer, c.lay.rows_cap, src, cols);
    if (c.lay.rows_cap > 0) MF_CUDA_TRY(mf_quantize_fp8_rows(&q, stream));
    *out = row_operand(state_of(layer));
    return MOEFUSE_OK;
}

/* The weight gradient's operand of `src` per 128 tokens into codes and scales (and *out,
 * where not NULL). */
moefuse_status quantized_tokens(const moefuse_layer *layer, int rows_cap, const rows_src &src,
                                int cols, const float *row_weight, uint8_t *codes,
                                float *scales, cudaStream_t stream, mf_operand *out) {
    const mf_quantize_fp8_tokens_params q =
        tokens_params(layer, rows_cap, src, cols, row_weight, codes, scales);
    if (rows_cap > 0) MF_CUDA_TRY(mf_quantize_fp8_tokens(&q, stream));
    if (out) *out = token_operand(codes, scales);
    return MOEFUSE_OK;
}

/* Both from one read of `src`: the row GEMM's operand now, the weight gradient's (the
 * layer's lhs token codes) for a GEMM later in the call. */
moefuse_status quantized_rows_and_tokens(const moefuse_layer *layer, const call_bufs &c,
                                         const rows_src &src, int cols, const float *row_weight,
                                         cudaStream_t stream, mf_operand *out) {
    const cuda_state *s = state_of(layer);
    const int rows_cap = c.lay.rows_cap;
    const mf_quantize_fp8_rows_params r = rows_params(layer, rows_cap, src, cols);
    const mf_quantize_fp8_tokens_params t =
        tokens_params(layer, rows_cap, src, cols, row_weight, s->fp8_lhs_t, s->fp8_lhs_scales);
    if (rows_cap > 0) MF_CUDA_TRY(mf_quantize_fp8_rows_tokens(&r, &t, stream));
    *out = row_operand(s);
    return MOEFUSE_OK;
}

/* Expert parallelism (the GEMM's rows_in set): every received row in before a quantizer
 * reads them. */
moefuse_status rows_arrived(const moefuse_layer *layer, const mf_arrivals &rows_in,
                            cudaStream_t stream) {
    if (!rows_in.arrivals) return MOEFUSE_OK;
    const cuda_state *s = state_of(layer);
    const mf_ep_wait_rows_params w = {rows_in, s->sync, s->gemm_num_rows};
    MF_CUDA_TRY(mf_ep_wait_rows(&w, stream));
    return MOEFUSE_OK;
}

/* x's row codes as the forward's dispatch left them: the row-code workspace (local), or
 * the x rows window with its scales after the codes (peers, mf_ep_push_params). */
mf_operand x_codes_operand(const moefuse_layer *layer, const call_bufs &c) {
    const cuda_state *s = state_of(layer);
    if (!s->plan.rows_from_peers) return row_operand(s);
    const uint8_t *codes = (const uint8_t *)c.xs;
    const float *scales =
        (const float *)(codes + MF_FP8_CODES_BYTES(c.lay.rows_cap, layer->cfg.hidden));
    return mf_operand{codes, MF_DTYPE_E4M3, scales, MF_SCALES_1X128};
}

mf_operand weight(const uint8_t *codes, const float *scales) {
    return mf_operand{codes, MF_DTYPE_E4M3, scales, MF_SCALES_128X128};
}

moefuse_status fp8_gemm1(const moefuse_layer *layer, const call_bufs &c,
                         const moefuse_fp8_weights *w, mf_gemm1_params *p, cudaStream_t stream) {
    p->w13 = weight(w->w13, w->w13_scale);
    p->w13_up = NULL;   /* the quantized weights are packed */
    if (c.x_codes) {    /* the dispatch wrote them (peers: into the x rows window) */
        p->xs = x_codes_operand(layer, c);
        return MOEFUSE_OK;
    }
    MF_TRY(rows_arrived(layer, p->rows_in, stream));
    return quantized_rows(layer, c,
                          rows_of(layer, c, c.x_tokens, c.x_tokens_stride, p->xs.data, p->hidden),
                          p->hidden, stream, &p->xs);
}

moefuse_status fp8_gemm2(const moefuse_layer *layer, const call_bufs &c,
                         const moefuse_fp8_weights *w, mf_gemm2_params *p, cudaStream_t stream) {
    p->w2 = weight(w->w2, w->w2_scale);
    return quantized_rows(layer, c, sorted_rows(p->act.data, p->intermediate), p->intermediate,
                          stream, &p->act);
}

/* dgrad2 reads W2^T (its FP8 kernel writes the unweighted a for dW2 = (p dy)^T a) and
 * dy's row codes: the dispatch's where dy's tokens are gathered (c.dy_tokens), else made
 * here from the same read of dy as dW2's lhs. dW2's lhs, p dy per 128 tokens, goes to the
 * lhs token codes, free (dW13 of the previous call has read them), until dW2. */
moefuse_status fp8_dgrad2(const moefuse_layer *layer, const call_bufs &c,
                          const moefuse_fp8_weights *w, mf_dgrad2_params *p,
                          cudaStream_t stream) {
    const cuda_state *s = state_of(layer);
    p->w2 = weight(w->w2t, w->w2t_scale);
    MF_TRY(rows_arrived(layer, p->rows_in, stream));
    const rows_src dy = rows_of(layer, c, c.dy_tokens, c.dy_tokens_stride, p->dys.data, p->hidden);
    if (!c.dy_tokens)
        return quantized_rows_and_tokens(layer, c, dy, p->hidden, s->row_weight, stream, &p->dys);
    p->dys = row_operand(s);
    /* dW2 takes the lhs token codes from the state (fp8_dw2) */
    return quantized_tokens(layer, c.lay.rows_cap, dy, p->hidden, s->row_weight, s->fp8_lhs_t,
                            s->fp8_lhs_scales, stream, NULL);
}

/* dgrad1 runs after dW2: its read of [dg; du] also makes dW13's lhs. */
moefuse_status fp8_dgrad1(const moefuse_layer *layer, const call_bufs &c,
                          const moefuse_fp8_weights *w, mf_dgrad1_params *p,
                          cudaStream_t stream) {
    p->w13 = weight(w->w13t, w->w13t_scale);
    p->w13_up = NULL;   /* W13^T [E, H, 2I]: packed */
    return quantized_rows_and_tokens(layer, c, sorted_rows(p->dh.data, 2 * p->intermediate),
                                     2 * p->intermediate, NULL, stream, &p->dh);
}

/* dW2 = (p dy)^T a: lhs = p dy, quantized with dgrad2's operand; rhs = a. */
moefuse_status fp8_dw2(const moefuse_layer *layer, const call_bufs &, const moefuse_fp8_weights *,
                       mf_wgrad_params *p, cudaStream_t stream) {
    cuda_state *s = state_of(layer);
    p->lhs = token_operand(s->fp8_lhs_t, s->fp8_lhs_scales);
    return quantized_tokens(layer, p->rows.rows_cap, sorted_rows(p->rhs.data, p->n), p->n, NULL,
                            s->fp8_rhs_t, s->fp8_rhs_scales, stream, &p->rhs);
}

/* dW13 = [dg; du]^T x: lhs = [dg; du], quantized with dgrad1's operand; rhs = x (gathered
 * from the caller's x on one GPU). */
moefuse_status fp8_dw13(const moefuse_layer *layer, const call_bufs &c,
                        const moefuse_fp8_weights *, mf_wgrad_params *p, cudaStream_t stream) {
    cuda_state *s = state_of(layer);
    p->lhs = token_operand(s->fp8_lhs_t, s->fp8_lhs_scales);
    return quantized_tokens(layer, p->rows.rows_cap,
                            rows_of(layer, c, c.x_tokens, c.x_tokens_stride, p->rhs.data, p->n),
                            p->n, NULL, s->fp8_rhs_t, s->fp8_rhs_scales, stream, &p->rhs);
}

}  // namespace

void fp8_row_codes_out(const moefuse_layer *layer, const call_bufs &c, mf_dispatch_params *dp) {
    const cuda_state *s = state_of(layer);
    dp->codes = s->fp8_rows;
    dp->scales = s->fp8_row_scales;
    dp->scale_ld = scale_ld(c.lay.rows_cap);
    dp->pow2 = layer->cfg.fp8_pow2_scales;
}

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
