/* The public entry points: config checks, argument validation, backend dispatch.
 * Everything here runs before any work, so a bad call touches no output. */
#include "internal.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef MOEFUSE_HAVE_CUDA
const mf_backend_ops *mf_cuda_backend(void) { return NULL; }

/* The rules of the CUDA kernels (sm90/dgrad2_swiglu.cu mf_dgrad2_dp_parts: BN = 256 when
 * I allows it, else 128, and FP8's always 128; simt/moe_plan.cu chunk_tokens: 2048 slots
 * per chunk; sizeof(mf_plan_state) in kernels.h), for the sizes a build without CUDA
 * reports. The CUDA build takes them from the kernels (workspace.cu). */
mf_tiles mf_cuda_tiles(int top_k, int intermediate, moefuse_precision precision) {
    mf_tiles t;
    t.dp_parts = intermediate % 256 == 0 && precision != MOEFUSE_PRECISION_FP8_BLOCK
                     ? intermediate / 256
                     : intermediate / 128;
    t.chunk_tokens = top_k >= 2048 ? 1 : 2048 / top_k;
    t.plan_state_bytes = 48;
    return t;
}
#endif

void moefuse_config_init(moefuse_config *cfg, int hidden, int intermediate, int num_experts,
                         int top_k, int max_tokens) {
    if (!cfg) return;
    memset(cfg, 0, sizeof *cfg);
    cfg->hidden = hidden;
    cfg->intermediate = intermediate;
    cfg->num_experts = num_experts;
    cfg->top_k = top_k;
    cfg->max_tokens = max_tokens;
    cfg->num_ranks = 1;
    cfg->rank = 0;
    cfg->precision = MOEFUSE_PRECISION_BF16;
    cfg->backend = MOEFUSE_BACKEND_CPU;
    cfg->saved_mode = MOEFUSE_SAVE_ACTIVATIONS;
    cfg->num_threads = 0;
    cfg->pipeline = MOEFUSE_PIPELINE_STAGED;
}

/* ---- config ---------------------------------------------------------------------- */

/* The fields alone, as for a layer with a comm of c->num_ranks ranks. */
moefuse_status mf_check_config_fields(const moefuse_config *c) {
#define POSITIVE(field)                                                                  \
    if (c->field <= 0)                                                                   \
        return mf_fail(MOEFUSE_ERR_INVALID_CONFIG, "config." #field " = %d: expected > 0",  \
                       c->field);
    POSITIVE(hidden)
    POSITIVE(intermediate)
    POSITIVE(num_experts)
    POSITIVE(max_tokens)
    POSITIVE(num_ranks)
#undef POSITIVE
    if (c->top_k < 1 || c->top_k > c->num_experts)
        return mf_fail(MOEFUSE_ERR_INVALID_CONFIG,
                       "config.top_k = %d: expected 1 <= top_k <= num_experts (%d)", c->top_k,
                       c->num_experts);
    if (c->num_experts % c->num_ranks != 0)
        return mf_fail(MOEFUSE_ERR_INVALID_CONFIG,
                       "config.num_experts = %d: expected a multiple of num_ranks (%d)",
                       c->num_experts, c->num_ranks);
    if (c->rank < 0 || c->rank >= c->num_ranks)
        return mf_fail(MOEFUSE_ERR_INVALID_CONFIG, "config.rank = %d: expected 0 <= rank < %d",
                       c->rank, c->num_ranks);
    if (c->num_threads < 0)
        return mf_fail(MOEFUSE_ERR_INVALID_CONFIG,
                       "config.num_threads = %d: expected >= 0 (0 = all cores)", c->num_threads);
    if (c->saved_mode != MOEFUSE_SAVE_ACTIVATIONS && c->saved_mode != MOEFUSE_RECOMPUTE &&
        c->saved_mode != MOEFUSE_SAVE_ACTIVATIONS_AND_INPUTS)
        return mf_fail(MOEFUSE_ERR_INVALID_CONFIG,
                       "config.saved_mode = %d: expected MOEFUSE_SAVE_ACTIVATIONS (0), "
                       "MOEFUSE_RECOMPUTE (1) or MOEFUSE_SAVE_ACTIVATIONS_AND_INPUTS (2)",
                       (int)c->saved_mode);
    if (c->pipeline != MOEFUSE_PIPELINE_STAGED && c->pipeline != MOEFUSE_PIPELINE_FUSED)
        return mf_fail(MOEFUSE_ERR_INVALID_CONFIG,
                       "config.pipeline = %d: expected MOEFUSE_PIPELINE_STAGED (0) or "
                       "MOEFUSE_PIPELINE_FUSED (1)", (int)c->pipeline);
    /* The largest buffers are max_tokens * K rows of max(H, 2I) elements; keep their
     * element counts far from int overflow in every backend's index arithmetic. */
    int64_t widest = c->hidden > 2 * (int64_t)c->intermediate ? c->hidden : 2 * (int64_t)c->intermediate;
    if ((int64_t)c->max_tokens * c->top_k * widest > ((int64_t)1 << 40))
        return mf_fail(MOEFUSE_ERR_INVALID_CONFIG,
                       "config: max_tokens * top_k * max(H, 2I) = %lld: expected <= 2^40",
                       (long long)((int64_t)c->max_tokens * c->top_k * widest));
    /* Plan rows and slot indices are int32: the rows a rank may receive, each local
     * expert's padded to the largest row alignment (128), must fit. */
    int64_t rows = (int64_t)c->max_tokens * c->top_k * c->num_ranks +
                   (int64_t)(c->num_experts / c->num_ranks) * 128;
    if (rows > INT32_MAX)
        return mf_fail(MOEFUSE_ERR_INVALID_CONFIG,
                       "config: max_tokens (%d) * top_k (%d) * num_ranks (%d) + 128 rows of "
                       "padding per local expert = %lld rows: expected <= INT32_MAX (%d)",
                       c->max_tokens, c->top_k, c->num_ranks, (long long)rows, INT32_MAX);
    if (c->precision != MOEFUSE_PRECISION_BF16 && c->precision != MOEFUSE_PRECISION_FP8_BLOCK)
        return mf_fail(MOEFUSE_ERR_UNSUPPORTED,
                       "config.precision = %d: expected MOEFUSE_PRECISION_BF16 (0) or "
                       "MOEFUSE_PRECISION_FP8_BLOCK (1)", (int)c->precision);
    if (c->fp8_pow2_scales != 0 &&
        (c->fp8_pow2_scales != 1 || c->precision != MOEFUSE_PRECISION_FP8_BLOCK))
        return mf_fail(MOEFUSE_ERR_INVALID_CONFIG,
                       "config.fp8_pow2_scales = %d: expected 0 or 1, and 0 unless "
                       "config.precision = MOEFUSE_PRECISION_FP8_BLOCK", c->fp8_pow2_scales);
    if (c->backend != MOEFUSE_BACKEND_CPU && c->backend != MOEFUSE_BACKEND_CUDA)
        return mf_fail(MOEFUSE_ERR_UNSUPPORTED,
                       "config.backend = %d: expected MOEFUSE_BACKEND_CPU (0) or "
                       "MOEFUSE_BACKEND_CUDA (1)", (int)c->backend);
    /* !(x >= 1) also refuses NaN */
    if (c->recv_capacity_factor != 0 && !(c->recv_capacity_factor >= 1.0 &&
                                          c->recv_capacity_factor <= 1e6))
        return mf_fail(MOEFUSE_ERR_INVALID_CONFIG,
                       "config.recv_capacity_factor = %g: expected 0 (the default, %.1f) or a "
                       "multiple of the balanced load max_tokens * top_k in [1, 1e6] (above "
                       "num_ranks it is num_ranks)",
                       c->recv_capacity_factor, MF_RECV_CAPACITY_DEFAULT);
    return MOEFUSE_OK;
}

static moefuse_status check_config(const moefuse_config *c, const moefuse_comm *comm) {
    moefuse_status st = mf_check_config_fields(c);
    if (st != MOEFUSE_OK) return st;
    if (c->num_ranks > 1 && comm == NULL)
        return mf_fail(MOEFUSE_ERR_INVALID_CONFIG,
                       "config.num_ranks = %d with comm = NULL: expected a moefuse_comm of %d "
                       "ranks (moefuse_comm_create_virtual)", c->num_ranks, c->num_ranks);
    if (comm != NULL && comm->num_ranks != c->num_ranks)
        return mf_fail(MOEFUSE_ERR_INVALID_CONFIG,
                       "config.num_ranks = %d: the comm has %d ranks; expected the same",
                       c->num_ranks, comm->num_ranks);
    if (comm != NULL && comm->kind == MF_COMM_NCCL && c->rank != comm->nccl_rank)
        return mf_fail(MOEFUSE_ERR_INVALID_CONFIG,
                       "config.rank = %d: this process is rank %d of the NCCL communicator; "
                       "expected the same", c->rank, comm->nccl_rank);
    /* checked before any allocation: the layers' flags, counts and arrival counters share
     * one window per rank, laid out by E */
    if (comm != NULL && mf_comm_num_layers(comm) > 0 && comm->num_experts != c->num_experts)
        return mf_fail(MOEFUSE_ERR_INVALID_CONFIG,
                       "config.num_experts = %d: the comm's other layers have %d; expected the "
                       "same on every layer of a comm (they share its windows)",
                       c->num_experts, comm->num_experts);
    if (comm != NULL && c->backend != MOEFUSE_BACKEND_CUDA)
        return mf_fail(MOEFUSE_ERR_UNSUPPORTED,
                       "config.backend = %d with a comm: expert parallelism runs on "
                       "MOEFUSE_BACKEND_CUDA only", (int)c->backend);
    if (comm != NULL && c->saved_mode == MOEFUSE_SAVE_ACTIVATIONS_AND_INPUTS)
        return mf_fail(MOEFUSE_ERR_UNSUPPORTED,
                       "config.saved_mode = MOEFUSE_SAVE_ACTIVATIONS_AND_INPUTS with a comm: "
                       "the expert-parallel backward receives its x rows again and does not "
                       "read saved ones; expected MOEFUSE_SAVE_ACTIVATIONS or "
                       "MOEFUSE_RECOMPUTE");
    return MOEFUSE_OK;
}

moefuse_status moefuse_layer_create(const moefuse_config *cfg, moefuse_comm *comm,
                                    moefuse_layer **out) {
    mf_clear_error();
    if (!out) return mf_fail(MOEFUSE_ERR_NULL_POINTER, "out: expected a moefuse_layer **");
    if (!cfg) return mf_fail(MOEFUSE_ERR_NULL_POINTER, "cfg: expected a moefuse_config *");
    moefuse_status st = check_config(cfg, comm);
    if (st != MOEFUSE_OK) return st;

    /* The backends by config.backend (check_config took only these values); NULL where
     * this build has none. */
    const mf_backend_ops *const backends[] = {
        [MOEFUSE_BACKEND_CPU] = &mf_cpu_backend,
        [MOEFUSE_BACKEND_CUDA] = mf_cuda_backend(),
    };
    const mf_backend_ops *ops = (unsigned)cfg->backend < sizeof backends / sizeof backends[0]
                                    ? backends[cfg->backend] : NULL;
    if (!ops)
        return mf_fail(MOEFUSE_ERR_UNSUPPORTED,
                       "config.backend = MOEFUSE_BACKEND_CUDA: this library was built "
                       "without nvcc; expected MOEFUSE_BACKEND_CPU");

    moefuse_layer *layer = calloc(1, sizeof *layer);
    if (!layer) return mf_fail(MOEFUSE_ERR_NO_MEMORY, "moefuse_layer_create: out of host memory");
    layer->cfg = *cfg;
    layer->num_local_experts = cfg->num_experts / cfg->num_ranks;
    layer->expert_begin = cfg->rank * layer->num_local_experts;
    layer->ops = ops;
    layer->comm = comm;
    st = ops->create(layer);
    if (st != MOEFUSE_OK) {
        free(layer);
        return st;
    }
    *out = layer;
    return MOEFUSE_OK;
}

moefuse_status moefuse_layer_destroy(moefuse_layer *layer) {
    mf_clear_error();
    if (!layer) return MOEFUSE_OK;
    layer->ops->destroy(layer);
    free(layer);
    return MOEFUSE_OK;
}

moefuse_status moefuse_saved_bytes(const moefuse_layer *layer, int num_tokens, size_t *bytes) {
    mf_clear_error();
    if (!layer) return mf_fail(MOEFUSE_ERR_NULL_POINTER, "layer: expected a layer");
    if (!bytes) return mf_fail(MOEFUSE_ERR_NULL_POINTER, "bytes: expected a size_t *");
    if (num_tokens < 0)
        return mf_fail(MOEFUSE_ERR_SHAPE, "num_tokens = %d: expected >= 0", num_tokens);
    if (num_tokens > layer->cfg.max_tokens)
        return mf_fail(MOEFUSE_ERR_TOO_MANY_TOKENS,
                       "num_tokens = %d: expected <= config.max_tokens (%d)", num_tokens,
                       layer->cfg.max_tokens);
    *bytes = layer->ops->saved_bytes(layer, num_tokens);
    return MOEFUSE_OK;
}

moefuse_status moefuse_layer_check(moefuse_layer *layer, void *stream) {
    mf_clear_error();
    if (!layer) return mf_fail(MOEFUSE_ERR_NULL_POINTER, "layer: expected a layer");
    return layer->ops->check ? layer->ops->check(layer, stream) : MOEFUSE_OK;
}

/* ---- argument validation --------------------------------------------------------- */

static moefuse_status need_ptr(const void *p, const char *name, size_t align) {
    if (!p) return mf_fail(MOEFUSE_ERR_NULL_POINTER, "%s: expected a non-NULL pointer", name);
    if ((uintptr_t)p % align != 0)
        return mf_fail(MOEFUSE_ERR_MISALIGNED, "%s = %p: expected %zu-byte alignment", name, p,
                       align);
    return MOEFUSE_OK;
}

/* A token-major bf16 tensor [T, H] with a row stride; NULL allowed when T = 0. */
static moefuse_status need_rows(const moefuse_layer *layer, const void *p, int64_t stride,
                                int num_tokens, const char *name, const char *stride_name) {
    if (num_tokens == 0 && p == NULL) return MOEFUSE_OK;
    /* bf16 rows and their stride: 16-byte aligned on the CUDA backend (mf_array_align) */
    moefuse_status st = need_ptr(p, name, mf_array_align(layer, 2));
    if (st != MOEFUSE_OK) return st;
    if (stride < layer->cfg.hidden)
        return mf_fail(MOEFUSE_ERR_SHAPE, "%s = %lld: expected >= hidden (%d)", stride_name,
                       (long long)stride, layer->cfg.hidden);
    const int64_t stride_align = (int64_t)mf_array_align(layer, 2) / 2;
    if (stride % stride_align != 0)
        return mf_fail(MOEFUSE_ERR_MISALIGNED, "%s = %lld: expected a multiple of %lld elements",
                       stride_name, (long long)stride, (long long)stride_align);
    return MOEFUSE_OK;
}

/* A per-token [T, K] tensor; NULL allowed when T = 0. */
static moefuse_status need_slots(const void *p, int num_tokens, const char *name) {
    if (num_tokens == 0 && p == NULL) return MOEFUSE_OK;
    return need_ptr(p, name, 4);
}

static moefuse_status check_tokens(const moefuse_layer *layer, int num_tokens,
                                   const char *name) {
    if (num_tokens < 0)
        return mf_fail(MOEFUSE_ERR_SHAPE, "%s = %d: expected >= 0", name, num_tokens);
    if (num_tokens > layer->cfg.max_tokens)
        return mf_fail(MOEFUSE_ERR_TOO_MANY_TOKENS,
                       "%s = %d: expected <= config.max_tokens (%d)", name, num_tokens,
                       layer->cfg.max_tokens);
    return MOEFUSE_OK;
}

#define TRY(expr)                                                                        \
    do {                                                                                 \
        moefuse_status st_ = (expr);                                                     \
        if (st_ != MOEFUSE_OK) return st_;                                               \
    } while (0)

/* The weight-gradient outputs: the fp32 pair (dw13, dw2) or the bf16 pair (dw13_bf16,
 * dw2_bf16), exactly one of them whole. Either bf16 pointer set picks the bf16 pair,
 * so a NULL in it is reported as half a pair rather than as a missing dw13. */
static moefuse_status check_wgrad_outputs(const moefuse_layer *layer,
                                          const moefuse_bwd_args *a) {
    if (a->dw13_bf16 == NULL && a->dw2_bf16 == NULL) {
        if (!a->dw13)
            return mf_fail(MOEFUSE_ERR_NULL_POINTER,
                           "bwd_args.dw13: expected a non-NULL pointer (fp32 weight "
                           "gradients), or dw13_bf16 and dw2_bf16 with dw13 = dw2 = NULL");
        if (!a->dw2)
            return mf_fail(MOEFUSE_ERR_NULL_POINTER,
                           "bwd_args.dw2: expected a non-NULL pointer (fp32 weight "
                           "gradients), or dw13_bf16 and dw2_bf16 with dw13 = dw2 = NULL");
        const size_t align = mf_array_align(layer, 4);
        TRY(need_ptr(a->dw13, "bwd_args.dw13", align));
        return need_ptr(a->dw2, "bwd_args.dw2", align);
    }
    if (a->dw13 || a->dw2)
        return mf_fail(MOEFUSE_ERR_INVALID_CONFIG,
                       "bwd_args.%s = %p with bwd_args.dw13_bf16 / dw2_bf16 set: expected "
                       "NULL (weight gradients go to the fp32 pair or the bf16 pair, not both)",
                       a->dw13 ? "dw13" : "dw2", a->dw13 ? (void *)a->dw13 : (void *)a->dw2);
    if (!a->dw13_bf16 || !a->dw2_bf16)
        return mf_fail(MOEFUSE_ERR_NULL_POINTER,
                       "bwd_args.%s: NULL while bwd_args.%s is set; expected both bf16 "
                       "weight-gradient pointers or neither",
                       a->dw13_bf16 ? "dw2_bf16" : "dw13_bf16",
                       a->dw13_bf16 ? "dw13_bf16" : "dw2_bf16");
    TRY(need_ptr(a->dw13_bf16, "bwd_args.dw13_bf16", mf_array_align(layer, 2)));
    TRY(need_ptr(a->dw2_bf16, "bwd_args.dw2_bf16", mf_array_align(layer, 2)));
    if (a->accumulate == 1)
        return mf_fail(MOEFUSE_ERR_INVALID_CONFIG,
                       "bwd_args.accumulate = 1 with dw13_bf16 / dw2_bf16: accumulate needs "
                       "the fp32 buffers dw13 / dw2; expected 0 (write) with the bf16 pair");
    return MOEFUSE_OK;
}

/* The up half of dW13 (moefuse.h, "W13 in two halves"): beside the gate half's pointer
 * of the same type, exactly when w13_up is set (FP8_BLOCK, which reads no w13: whenever
 * w13_up is, and also without it). Runs after check_wgrad_outputs. */
static moefuse_status check_dw13_up(const moefuse_layer *layer, const moefuse_bwd_args *a) {
    const int bf16 = a->dw13_bf16 != NULL;
    const char *want = bf16 ? "dw13_up_bf16" : "dw13_up";
    const void *up = bf16 ? (const void *)a->dw13_up_bf16 : (const void *)a->dw13_up;
    const void *other = bf16 ? (const void *)a->dw13_up : (const void *)a->dw13_up_bf16;
    if (other)
        return mf_fail(MOEFUSE_ERR_INVALID_CONFIG,
                       "bwd_args.%s = %p with the %s weight gradients: expected NULL (the up "
                       "half of dW13 is %s, of the type of dw13%s)",
                       bf16 ? "dw13_up" : "dw13_up_bf16", other, bf16 ? "bf16" : "fp32", want,
                       bf16 ? "_bf16" : "");
    const int fp8 = layer->cfg.precision == MOEFUSE_PRECISION_FP8_BLOCK;
    if (a->w13_up && !up)
        return mf_fail(MOEFUSE_ERR_NULL_POINTER,
                       "bwd_args.%s: NULL while bwd_args.w13_up is set; expected the up half "
                       "of dW13 [E/R, I, H] (W13 in two halves gives dW13 in two halves)", want);
    if (!a->w13_up && up && !fp8)
        return mf_fail(MOEFUSE_ERR_INVALID_CONFIG,
                       "bwd_args.%s = %p with bwd_args.w13_up = NULL: expected NULL (packed "
                       "W13 gives packed dW13), or the up half of W13 in w13_up", want, up);
    if (!up) return MOEFUSE_OK;
    char name[64];
    snprintf(name, sizeof name, "bwd_args.%s", want);
    return need_ptr(up, name, mf_array_align(layer, bf16 ? 2 : 4));
}

/* Checks shared by forward and backward: the forward's inputs. */
static moefuse_status check_inputs(const moefuse_layer *layer, int T, const uint16_t *x,
                                   int64_t x_stride, const int32_t *ids, const float *weights,
                                   const uint16_t *w13, const uint16_t *w13_up,
                                   const uint16_t *w2, const char *args) {
    char name[64];
    snprintf(name, sizeof name, "%s.num_tokens", args);
    TRY(check_tokens(layer, T, name));
    char stride[64];
    snprintf(name, sizeof name, "%s.x", args);
    snprintf(stride, sizeof stride, "%s.x_stride", args);
    TRY(need_rows(layer, x, x_stride, T, name, stride));
    snprintf(name, sizeof name, "%s.ids", args);
    TRY(need_slots(ids, T, name));
    snprintf(name, sizeof name, "%s.weights", args);
    TRY(need_slots(weights, T, name));
    /* FP8_BLOCK layers read the quantized weights instead (see mf_check_fp8_weights). */
    if (layer->cfg.precision == MOEFUSE_PRECISION_BF16) {
        snprintf(name, sizeof name, "%s.w13", args);
        TRY(need_ptr(w13, name, mf_array_align(layer, 2)));
        snprintf(name, sizeof name, "%s.w13_up", args);
        if (w13_up) TRY(need_ptr(w13_up, name, mf_array_align(layer, 2)));
        snprintf(name, sizeof name, "%s.w2", args);
        TRY(need_ptr(w2, name, mf_array_align(layer, 2)));
    }
    /* Device ids are checked by the GPU plan (see moefuse_layer_check). */
    if (layer->cfg.backend == MOEFUSE_BACKEND_CPU && T > 0)
        TRY(mf_check_ids(ids, T, layer->cfg.top_k, layer->cfg.num_experts));
    return MOEFUSE_OK;
}

moefuse_status moefuse_forward(moefuse_layer *layer, const moefuse_fwd_args *a, void *stream) {
    mf_clear_error();
    if (!layer) return mf_fail(MOEFUSE_ERR_NULL_POINTER, "layer: expected a layer");
    if (!a) return mf_fail(MOEFUSE_ERR_NULL_POINTER, "args: expected a moefuse_fwd_args *");
    if (layer->comm) TRY(mf_comm_check_ready(layer->comm, layer, "moefuse_forward"));
    TRY(check_inputs(layer, a->num_tokens, a->x, a->x_stride, a->ids, a->weights, a->w13,
                     a->w13_up, a->w2, "fwd_args"));
    TRY(need_rows(layer, a->y, a->y_stride, a->num_tokens, "fwd_args.y", "fwd_args.y_stride"));
    if (a->saved && (uintptr_t)a->saved % 256 != 0)
        return mf_fail(MOEFUSE_ERR_MISALIGNED, "fwd_args.saved = %p: expected 256-byte alignment",
                       a->saved);
    if (a->expert_counts) TRY(need_ptr(a->expert_counts, "fwd_args.expert_counts", 4));
    TRY(mf_check_fp8_weights(layer, a->fp8_weights, "fwd_args.fp8_weights"));
    return layer->ops->forward(layer, a, stream);
}

moefuse_status moefuse_backward(moefuse_layer *layer, const moefuse_bwd_args *a, void *stream) {
    mf_clear_error();
    if (!layer) return mf_fail(MOEFUSE_ERR_NULL_POINTER, "layer: expected a layer");
    if (!a) return mf_fail(MOEFUSE_ERR_NULL_POINTER, "args: expected a moefuse_bwd_args *");
    if (layer->comm) TRY(mf_comm_check_ready(layer->comm, layer, "moefuse_backward"));
    TRY(check_inputs(layer, a->num_tokens, a->x, a->x_stride, a->ids, a->weights, a->w13,
                     a->w13_up, a->w2, "bwd_args"));
    TRY(need_ptr(a->saved, "bwd_args.saved", 256));
    /* before any backend reads it: a short buffer would be read past its end */
    size_t saved_need = layer->ops->saved_bytes(layer, a->num_tokens);
    if (a->saved_bytes < saved_need)
        return mf_fail(MOEFUSE_ERR_SHAPE,
                       "bwd_args.saved_bytes = %zu: expected >= %zu (moefuse_saved_bytes for "
                       "num_tokens = %d)", a->saved_bytes, saved_need, a->num_tokens);
    TRY(need_rows(layer, a->dy, a->dy_stride, a->num_tokens, "bwd_args.dy", "bwd_args.dy_stride"));
    TRY(need_rows(layer, a->dx, a->dx_stride, a->num_tokens, "bwd_args.dx", "bwd_args.dx_stride"));
    TRY(need_slots(a->dweights, a->num_tokens, "bwd_args.dweights"));
    if (a->accumulate != 0 && a->accumulate != 1)
        return mf_fail(MOEFUSE_ERR_INVALID_CONFIG,
                       "bwd_args.accumulate = %d: expected 0 (write) or 1 (add)", a->accumulate);
    TRY(check_wgrad_outputs(layer, a));
    TRY(check_dw13_up(layer, a));
    TRY(mf_check_fp8_weights(layer, a->fp8_weights, "bwd_args.fp8_weights"));
    return layer->ops->backward(layer, a, stream);
}

/* ---- routing helper ------------------------------------------------------------------ */

static moefuse_status route_backend(moefuse_backend backend) {
    if (backend == MOEFUSE_BACKEND_CPU) return MOEFUSE_OK;
    if (backend == MOEFUSE_BACKEND_CUDA)
        return mf_fail(MOEFUSE_ERR_UNSUPPORTED,
                       "backend = MOEFUSE_BACKEND_CUDA: the routing helper runs on the CPU "
                       "backend only so far; expected MOEFUSE_BACKEND_CPU");
    return mf_fail(MOEFUSE_ERR_UNSUPPORTED, "backend = %d: expected MOEFUSE_BACKEND_CPU (0)",
                   (int)backend);
}

moefuse_status moefuse_route_forward(const moefuse_route_args *args, moefuse_backend backend,
                                     void *stream) {
    (void)stream;
    mf_clear_error();
    TRY(route_backend(backend));
    return mf_cpu_route_forward(args);
}

moefuse_status moefuse_route_backward(const moefuse_route_bwd_args *args,
                                      moefuse_backend backend, void *stream) {
    (void)stream;
    mf_clear_error();
    TRY(route_backend(backend));
    return mf_cpu_route_backward(args);
}
