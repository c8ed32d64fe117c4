/* The CUDA backend (sm_90a, R = 1): workspaces, the saved-buffer layout, the forward
 * pipeline  plan -> dispatch -> gemm1 (SwiGLU) -> gemm2 (combine) -> reduce, and the
 * backward that mirrors it (see "backward" below).
 *
 * A forward or backward is launches on the caller's stream only: no host
 * synchronization, no allocation, no host-to-device copy, so it can be captured in a
 * CUDA graph. The workspaces (xs, act, combine, dh, plan scratch) belong to the
 * layer: calls on one layer must be ordered (one stream, or events between streams).
 * What the backward needs goes to the caller's `saved` buffer, so several forwards may
 * be in flight before their backwards.
 *
 * Saved buffer (moefuse_saved_bytes(T)), each section at a 256-byte boundary:
 *   header           int32[16]  see kHeader* below; num_rows at word 9
 *   expert_counts    int32[E_local]
 *   expert_offsets   int32[E_local + 1]
 *   row_block_expert int32[rows_cap / 128]
 *   slot_row         int32[T * K]
 *   row_slot         int32[rows_cap]
 *   gate_up          bf16 [rows_cap, 2I]   MOEFUSE_SAVE_ACTIVATIONS(_AND_INPUTS)
 *   xs               bf16 [rows_cap, H]    MOEFUSE_SAVE_ACTIVATIONS_AND_INPUTS only
 * with rows_cap = roundup(T*K + 127 * min(E_local, T*K), 128), the most rows the
 * padded layout can take. Bytes per token: 8K (slot_row + row_slot) + 4KI (gate_up,
 * K rows of 2I bf16) + K/32 (row_block_expert): qwen3-30b-a3b 64 + 24576 = 24,640 B,
 * qwen3-235b-a22b 64 + 49152 = 49,216 B; plus at most 127 * min(E_local, T*K) padding
 * rows of 4 + 4I bytes, and the header and counts (under 2 KB at E = 128). The
 * inputs add 2KH bytes per token (xs, the forward's own dispatch target): qwen3-30b-a3b
 * 32,768, qwen3-235b-a22b 65,536.
 * (This layout is the contract between the CUDA forward and backward below.)
 *
 * Layer workspaces, bytes per token of max_tokens (K slot rows each; the padding rows
 * of rows_cap add up to 127 * min(E_local, T*K) rows on top):
 *   xs        [rows_cap, H]  bf16   fwd: gathered x      bwd: gathered x again (dW13)
 *                                   (MOEFUSE_SAVE_ACTIVATIONS_AND_INPUTS: saved's xs
 *                                   instead, but for forwards with saved = NULL)
 *   act       [rows_cap, I]  bf16   fwd: a               bwd: act_p = bf16(p a) (dW2)
 *   combine   [rows_cap, H]  bf16   fwd: slot rows of y  bwd: dys, then slot rows of dx
 *   dh        [rows_cap, 2I] bf16   bwd: [dg | du]
 *   dp_partial[rows_cap, P]  fp32   bwd: d p partial sums (P = mf_dgrad2_dp_parts(I))
 *   gate_up   [rows_cap, 2I] bf16   bwd, MOEFUSE_RECOMPUTE only: [g | u] recomputed
 *   slot_rank [T*K] int32, chunk_base, plan_ws (a plan when saved = NULL): small
 * per token: 2KH (xs) + 2KI (act) + 2KH (combine) + 4KI (dh) + 4KP (dp_partial) + 4K (slot_rank) [+ 4KI gate_up when recomputing]:
 *   qwen3-30b-a3b   (P = 3):  32768 + 12288 + 32768 + 24576 + 96 + 32 = 102,528 B
 *                             (+24,576 recompute), 420 MB at max_tokens = 4096;
 *   qwen3-235b-a22b (P = 6):  65536 + 24576 + 65536 + 49152 + 192 + 32 = 205,024 B
 *                             (+49,152 recompute).
 * (P: dgrad2's 256-column tiles; the real P comes from the kernel.) The
 * backward's dys shares combine: dW2 consumes dys before dgrad1 writes dx slot rows
 * there, which is why combine has rows_cap rows, not T*K (+~50% of one [T*K, H] at
 * T = 4096, E = 128, instead of a separate dys of rows_cap rows). */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pipeline/backend.h"
#include "check.h"
#include "internal.h"
#include "kernels.h"

namespace mf {
namespace backend {

/* ---- layout ------------------------------------------------------------------------ */

static size_t align256(size_t n) { return (n + 255) & ~(size_t)255; }

int rows_cap_for(const moefuse_layer *layer, int num_tokens) {
    const int64_t slots = layer->comm
                              ? (int64_t)layer->cfg.num_ranks * layer->cfg.max_tokens * layer->cfg.top_k
                              : (int64_t)num_tokens * layer->cfg.top_k;
    const int64_t experts = slots < layer->num_local_experts ? slots : layer->num_local_experts;
    const int64_t rows = slots + (int64_t)(MF_SM90_BLOCK_M - 1) * experts;
    return (int)((rows + MF_SM90_BLOCK_M - 1) / MF_SM90_BLOCK_M * MF_SM90_BLOCK_M);
}

saved_layout layout_for(const moefuse_layer *layer, int num_tokens, moefuse_saved_mode mode) {
    saved_layout s;
    const int EL = layer->num_local_experts;
    s.rows_cap = rows_cap_for(layer, num_tokens);
    size_t at = 0;
    s.header = at;           at += align256(kHeaderWords * sizeof(int32_t));
    s.counts = at;           at += align256((size_t)EL * sizeof(int32_t));
    s.offsets = at;          at += align256((size_t)(EL + 1) * sizeof(int32_t));
    s.row_block_expert = at; at += align256((size_t)(s.rows_cap / MF_SM90_BLOCK_M) * sizeof(int32_t));
    s.slot_row = at;         at += align256((size_t)num_tokens * layer->cfg.top_k * sizeof(int32_t));
    s.row_slot = at;  // one rank only (EP: the rows' sources are sent again by the backward)
    if (!layer->comm) at += align256((size_t)s.rows_cap * sizeof(int32_t));
    s.gate_up = at;
    if (mode != MOEFUSE_RECOMPUTE)
        at += align256((size_t)s.rows_cap * 2 * layer->cfg.intermediate * sizeof(uint16_t));
    s.xs = at;
    if (mode == MOEFUSE_SAVE_ACTIVATIONS_AND_INPUTS)
        at += align256((size_t)s.rows_cap * layer->cfg.hidden * sizeof(uint16_t));
    s.total = at;
    return s;
}

/* ---- state ------------------------------------------------------------------------- */

static void free_state(cuda_state *s) {
    if (!s) return;
    void *bufs[] = {s->xs, s->act, s->combine, s->slot_rank, s->chunk_base, s->plan_state,
                    s->gemm_num_rows, s->plan_ws, s->act_ready, s->dh, s->dp_partial, s->gate_up,
                    s->bwd_offsets, s->expert_order, s->dys, s->row_slot, s->row_weight,
                    s->dp_slot, s->sync, s->peers, s->send_counts, s->send_offsets, s->send_rbe,
                    s->send_slot_row, s->send_row_slot, s->send_scalars, s->dest_base};
    for (void *b : bufs)
        if (b) cudaFree(b);
    free(s);
}

moefuse_status alloc(void **p, size_t bytes, const char *what) {
    cudaError_t err = cudaMalloc(p, bytes ? bytes : 256);
    if (err != cudaSuccess) {
        *p = NULL;
        cudaGetLastError();  // not sticky; keep it from being reported by a later launch
        return mf_fail(err == cudaErrorMemoryAllocation ? MOEFUSE_ERR_NO_MEMORY
                                                        : MOEFUSE_ERR_CUDA,
                       "moefuse_layer_create: cudaMalloc of %s (%zu bytes) failed: %s", what,
                       bytes, cudaGetErrorString(err));
    }
    return MOEFUSE_OK;
}

/* ---- the stages both pipelines run (backend.h) ------------------------------------- */

moefuse_saved_mode saved_mode_of(const moefuse_layer *layer, const void *saved) {
    return saved ? layer->cfg.saved_mode : MOEFUSE_RECOMPUTE;
}

uint16_t *saved_gate_up(void *saved, const saved_layout &lay, moefuse_saved_mode mode) {
    return mode != MOEFUSE_RECOMPUTE ? (uint16_t *)((char *)saved + lay.gate_up) : NULL;
}

void header_words(const moefuse_layer *layer, int num_tokens, int rows_cap,
                  moefuse_saved_mode mode, int32_t words[kHeaderWords]) {
    const moefuse_config *c = &layer->cfg;
    memset(words, 0, sizeof(int32_t) * kHeaderWords);
    words[kHeaderMagic] = kSavedMagic;
    words[kHeaderVersion] = kSavedVersion;
    words[kHeaderTokens] = num_tokens;
    words[kHeaderTopK] = c->top_k;
    words[kHeaderLocalExperts] = layer->num_local_experts;
    words[kHeaderHidden] = c->hidden;
    words[kHeaderIntermediate] = c->intermediate;
    words[kHeaderRowsCap] = rows_cap;
    words[kHeaderSavedMode] = mode;
}

mf_gemm1_params gemm1_params(const moefuse_layer *layer, const uint16_t *xs,
                             const uint16_t *w13, const int32_t *rbe, uint16_t *gate_up,
                             int rows_cap) {
    const cuda_state *s = state_of(layer);
    mf_gemm1_params g = {};
    g.xs = xs;
    g.w13 = w13;
    g.row_block_expert = rbe;
    g.num_rows = s->gemm_num_rows;
    g.act = s->act;
    g.gate_up = gate_up;
    g.rows_cap = rows_cap;
    g.hidden = layer->cfg.hidden;
    g.intermediate = layer->cfg.intermediate;
    g.num_local_experts = layer->num_local_experts;
    g.num_sms = s->num_sms;
    return g;
}

mf_gemm2_params gemm2_params(const moefuse_layer *layer, const uint16_t *w2, const int32_t *rbe,
                             const int32_t *row_slot, int rows_cap) {
    const cuda_state *s = state_of(layer);
    mf_gemm2_params g = {};
    g.act = s->act;
    g.w2 = w2;
    g.row_block_expert = rbe;
    g.num_rows = s->gemm_num_rows;
    g.row_slot = row_slot;
    g.rows_cap = rows_cap;
    g.hidden = layer->cfg.hidden;
    g.intermediate = layer->cfg.intermediate;
    g.num_local_experts = layer->num_local_experts;
    g.num_sms = s->num_sms;
    return g;
}

mf_dgrad2_params dgrad2_params(const moefuse_layer *layer, const uint16_t *dys,
                               const uint16_t *w2, const uint16_t *gate_up, const int32_t *rbe,
                               const int32_t *row_slot, int rows_cap) {
    const cuda_state *s = state_of(layer);
    mf_dgrad2_params d = {};
    d.dys = dys;
    d.w2 = w2;
    d.gate_up = gate_up;
    d.row_block_expert = rbe;
    d.num_rows = s->gemm_num_rows;
    d.row_slot = row_slot;
    d.dh = s->dh;
    d.act_p = s->act;
    d.dp_partial = s->dp_partial;
    d.rows_cap = rows_cap;
    d.hidden = layer->cfg.hidden;
    d.intermediate = layer->cfg.intermediate;
    d.num_local_experts = layer->num_local_experts;
    d.num_sms = s->num_sms;
    return d;
}

mf_dgrad1_params dgrad1_params(const moefuse_layer *layer, const uint16_t *w13,
                               const int32_t *rbe, const int32_t *row_slot, int rows_cap) {
    const cuda_state *s = state_of(layer);
    mf_dgrad1_params d = {};
    d.dh = s->dh;
    d.w13 = w13;
    d.row_block_expert = rbe;
    d.num_rows = s->gemm_num_rows;
    d.row_slot = row_slot;
    d.rows_cap = rows_cap;
    d.hidden = layer->cfg.hidden;
    d.intermediate = layer->cfg.intermediate;
    d.num_local_experts = layer->num_local_experts;
    d.num_sms = s->num_sms;
    return d;
}

/* What dW2 and dW13 share: the expert segments, the mode, the grid. */
static mf_wgrad_params wgrad_common(const moefuse_layer *layer, const moefuse_bwd_args *a,
                                    int rows_cap) {
    const cuda_state *s = state_of(layer);
    mf_wgrad_params w = {};
    w.expert_offsets = s->bwd_offsets;
    w.expert_order = s->expert_order;
    w.rows_cap = rows_cap;
    w.num_local_experts = layer->num_local_experts;
    w.accumulate = a->accumulate;
    w.num_sms = s->num_sms;
    return w;
}

mf_wgrad_params dw2_params(const moefuse_layer *layer, const moefuse_bwd_args *a, int rows_cap,
                           const uint16_t *dys) {
    mf_wgrad_params w = wgrad_common(layer, a, rows_cap);
    w.lhs = dys;
    w.rhs = state_of(layer)->act;
    w.dw = a->dw2;
    w.dw_bf16 = a->dw2_bf16;
    w.m = layer->cfg.hidden;
    w.n = layer->cfg.intermediate;
    return w;
}

mf_wgrad_params dw13_params(const moefuse_layer *layer, const moefuse_bwd_args *a,
                            int rows_cap, const uint16_t *xs) {
    mf_wgrad_params w = wgrad_common(layer, a, rows_cap);
    w.lhs = state_of(layer)->dh;
    w.rhs = xs;
    w.dw = a->dw13;
    w.dw_bf16 = a->dw13_bf16;
    w.m = 2 * layer->cfg.intermediate;
    w.n = layer->cfg.hidden;
    return w;
}

moefuse_status order_experts(moefuse_layer *layer, cudaStream_t stream) {
    const cuda_state *s = state_of(layer);
    MF_CUDA_TRY(mf_expert_order(s->bwd_offsets, layer->num_local_experts, s->expert_order, stream));
    return MOEFUSE_OK;
}

moefuse_status backward_gemms(const moefuse_layer *layer, const mf_wgrad_params &dw2,
                              const mf_dgrad1_params &d1, const mf_wgrad_params &dw13,
                              cudaStream_t stream, bool *fused) {
    const cuda_state *s = state_of(layer);
    *fused = s->act_ready && mf_sm90_moe_fused_bwd_takes(layer->cfg.hidden, layer->cfg.intermediate);
    if (*fused) {
        const mf_moe_fused_bwd_params fb = {dw2, d1, dw13, s->act_ready};
        MF_CUDA_TRY(mf_sm90_moe_fused_bwd_bf16(&fb, stream));
        return MOEFUSE_OK;
    }
    MF_CUDA_TRY(mf_sm90_wgrad_grouped_bf16(&dw2, stream));
    MF_CUDA_TRY(mf_sm90_gemm1_dgrad_bwd_bf16(&d1, stream));
    return MOEFUSE_OK;
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

/* ---- ops --------------------------------------------------------------------------- */

moefuse_status load_kernels(void);  // below the check kernels

moefuse_status cuda_create_checked(moefuse_layer *layer, cuda_state *s) {
    const moefuse_config *c = &layer->cfg;
    if (c->precision != MOEFUSE_PRECISION_BF16)
        return mf_fail(MOEFUSE_ERR_UNSUPPORTED,
                       "config.precision = %d: the CUDA backend runs MOEFUSE_PRECISION_BF16 "
                       "only so far", (int)c->precision);
    /* The GEMM tiles: 128-row output blocks over H and 2I in the weight gradients and
     * 128-column blocks over H and I in the dgrads (the launchers refuse the rest). */
    if (c->hidden % 128 != 0 || c->intermediate % 128 != 0)
        return mf_fail(MOEFUSE_ERR_UNSUPPORTED,
                       "config.hidden = %d, config.intermediate = %d: the CUDA backend's "
                       "GEMM tiles take multiples of 128; expected both multiples of 128 "
                       "(or MOEFUSE_BACKEND_CPU)", c->hidden, c->intermediate);

    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
        cudaGetLastError();
        return mf_fail(MOEFUSE_ERR_UNSUPPORTED,
                       "config.backend = MOEFUSE_BACKEND_CUDA: no CUDA device is usable (%s); "
                       "expected an sm_90 GPU (H100/H200) or MOEFUSE_BACKEND_CPU",
                       err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
    }
    MF_CUDA_TRY(cudaGetDevice(&s->device));
    int major = 0, minor = 0;
    MF_CUDA_TRY(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, s->device));
    MF_CUDA_TRY(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, s->device));
    if (major != 9 || minor != 0) {
        char name[256] = "";
        cudaDeviceProp prop;
        if (cudaGetDeviceProperties(&prop, s->device) == cudaSuccess)
            snprintf(name, sizeof name, "%s", prop.name);
        return mf_fail(MOEFUSE_ERR_UNSUPPORTED,
                       "config.backend = MOEFUSE_BACKEND_CUDA: device %d (%s) has compute "
                       "capability %d.%d; the kernels are built for sm_90a only, expected "
                       "9.0 (H100/H200) or MOEFUSE_BACKEND_CPU",
                       s->device, name, major, minor);
    }
    MF_CUDA_TRY(cudaDeviceGetAttribute(&s->num_sms, cudaDevAttrMultiProcessorCount, s->device));
    s->num_ranks = c->num_ranks;
    s->rank = c->rank;
    /* Virtual ranks share the GPU: each rank's grids get SMs / R blocks, so every
     * rank's kernels are resident together. */
    if (layer->comm && layer->comm->kind == MF_COMM_VIRTUAL)
        s->num_sms = s->num_sms / c->num_ranks > 0 ? s->num_sms / c->num_ranks : 1;

    const int K = c->top_k, EL = layer->num_local_experts;
    /* EP plans this rank's slots over all E experts first (the sends), see backend_ep.cu */
    const int plan_experts = layer->comm ? c->num_experts : EL;
    int smem_optin = 0;
    MF_CUDA_TRY(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                       s->device));
    const size_t plan_smem = mf_plan_smem_bytes(K, plan_experts);
    if (plan_smem > (size_t)smem_optin)
        return mf_fail(MOEFUSE_ERR_UNSUPPORTED,
                       "config.num_experts = %d, top_k = %d: the GPU plan needs %zu bytes of "
                       "shared memory per block, the device allows %d",
                       c->num_experts, K, plan_smem, smem_optin);
    MF_CUDA_TRY(mf_plan_prepare(K, plan_experts));
    const moefuse_status loaded = load_kernels();
    if (loaded != MOEFUSE_OK) return loaded;

    const int T = c->max_tokens;
    const int64_t rows_cap = rows_cap_for(layer, T);
    const int tb = mf_plan_chunk_tokens(K);
    const int64_t chunks = (T + tb - 1) / tb;
    if (!layer->comm) {  // EP: xs and combine are windows (ep_create)
        MF_ALLOC_FIELD(s, xs, rows_cap * c->hidden * 2);
        // rows_cap >= T*K rows: also the backward's dys
        MF_ALLOC_FIELD(s, combine, rows_cap * c->hidden * 2);
        MF_ALLOC_FIELD(s, row_weight, rows_cap * 4);
    }
    MF_ALLOC_FIELD(s, act, rows_cap * c->intermediate * 2);
    MF_ALLOC_FIELD(s, slot_rank, (int64_t)T * K * 4);
    MF_ALLOC_FIELD(s, chunk_base, (chunks > 0 ? chunks : 1) * plan_experts * 4);
    MF_ALLOC_FIELD(s, plan_state, sizeof(mf_plan_state));
    MF_ALLOC_FIELD(s, gemm_num_rows, sizeof(int32_t));
    MF_ALLOC_FIELD(s, plan_ws, layout_for(layer, T, MOEFUSE_RECOMPUTE).total);
    if (c->pipeline == MOEFUSE_PIPELINE_FUSED &&
        mf_sm90_moe_fused_fwd_takes(c->hidden, c->intermediate))
        MF_ALLOC_FIELD(s, act_ready, (rows_cap / 128 + 1) * 4);
    s->dp_parts = mf_dgrad2_dp_parts(c->intermediate);
    if (s->dp_parts < 1)
        return mf_fail(MOEFUSE_ERR_UNSUPPORTED,
                       "config.intermediate = %d: the backward's dgrad2 takes no such size "
                       "(mf_dgrad2_dp_parts = %d)", c->intermediate, s->dp_parts);
    MF_ALLOC_FIELD(s, dh, rows_cap * 2 * c->intermediate * 2);
    MF_ALLOC_FIELD(s, dp_partial, rows_cap * s->dp_parts * 4);
    if (c->saved_mode == MOEFUSE_RECOMPUTE)
        MF_ALLOC_FIELD(s, gate_up, rows_cap * 2 * c->intermediate * 2);
    MF_ALLOC_FIELD(s, bwd_offsets, (int64_t)(EL + 1) * 4);
    MF_ALLOC_FIELD(s, expert_order, (int64_t)(EL + 1) * 4);
    const mf_plan_state init = MF_PLAN_STATE_INIT;
    MF_CUDA_TRY(cudaMemcpy(s->plan_state, &init, sizeof init, cudaMemcpyHostToDevice));
    MF_CUDA_TRY(cudaMemset(s->gemm_num_rows, 0, sizeof(int32_t)));
    if (layer->comm) return ep_create(layer, s);
    return MOEFUSE_OK;
}

moefuse_status cuda_create(moefuse_layer *layer) {
    cuda_state *s = (cuda_state *)calloc(1, sizeof(cuda_state));
    if (!s) return mf_fail(MOEFUSE_ERR_NO_MEMORY, "moefuse_layer_create: out of host memory");
    const moefuse_status st = cuda_create_checked(layer, s);
    if (st != MOEFUSE_OK) {
        if (layer->comm) ep_destroy(layer, s);
        free_state(s);
        return st;
    }
    layer->backend = s;
    return MOEFUSE_OK;
}

void cuda_destroy(moefuse_layer *layer) {
    if (layer->comm) ep_destroy(layer, state_of(layer));
    free_state(state_of(layer));
    layer->backend = NULL;
}

size_t cuda_saved_bytes(const moefuse_layer *layer, int num_tokens) {
    return layout_for(layer, num_tokens, layer->cfg.saved_mode).total;
}

moefuse_status cuda_forward(moefuse_layer *layer, const moefuse_fwd_args *a, void *stream_) {
    cuda_state *s = state_of(layer);
    const cudaStream_t stream = (cudaStream_t)stream_;
    if (layer->comm) return ep_forward(layer, a, stream);
    const moefuse_config *c = &layer->cfg;
    const int T = a->num_tokens, K = c->top_k, EL = layer->num_local_experts;
    const moefuse_saved_mode mode = saved_mode_of(layer, a->saved);

    // ---- 1. plan: into the caller's saved buffer, else into the workspace ----
    const saved_layout lay = layout_for(layer, T, mode);
    char *plan_base = a->saved ? (char *)a->saved : (char *)s->plan_ws;
    mf_plan_params pp = {};
    pp.ids = a->ids;
    pp.num_tokens = T;
    pp.top_k = K;
    pp.num_experts = c->num_experts;
    pp.expert_begin = layer->expert_begin;
    pp.num_local_experts = EL;
    pp.rows_cap = lay.rows_cap;
    pp.slot_rank = s->slot_rank;
    pp.chunk_base = s->chunk_base;
    pp.state = s->plan_state;
    pp.gemm_num_rows = s->gemm_num_rows;
    pp.expert_counts = (int32_t *)(plan_base + lay.counts);
    pp.expert_offsets = (int32_t *)(plan_base + lay.offsets);
    pp.row_block_expert = (int32_t *)(plan_base + lay.row_block_expert);
    pp.slot_row = (int32_t *)(plan_base + lay.slot_row);
    pp.row_slot = (int32_t *)(plan_base + lay.row_slot);
    pp.saved_header = (int32_t *)(plan_base + lay.header);
    pp.num_rows = pp.saved_header + kHeaderNumRows;
    pp.user_counts = a->expert_counts;
    header_words(layer, T, lay.rows_cap, mode, pp.header_words);
    MF_CUDA_TRY(mf_plan_build_cuda(&pp, stream));
    if (T == 0) return MOEFUSE_OK;  // the plan wrote expert_counts = 0; y has no rows
    const int32_t *call_failed = &s->plan_state->call_failed;

    // ---- 2. dispatch: x rows -> expert-sorted xs (the workspace, or saved's for the
    //      backward's dW13) ----
    uint16_t *xs = mode == MOEFUSE_SAVE_ACTIVATIONS_AND_INPUTS
                       ? (uint16_t *)((char *)a->saved + lay.xs) : s->xs;
    mf_dispatch_params dp = {};
    dp.x[0] = a->x;
    dp.x_stride[0] = a->x_stride;
    dp.xs[0] = xs;
    dp.num_tensors = 1;
    dp.slot_row = pp.slot_row;
    dp.row_slot = pp.row_slot;
    dp.num_rows = s->gemm_num_rows;
    dp.call_failed = call_failed;
    dp.num_tokens = T;
    dp.rows_cap = lay.rows_cap;
    dp.hidden = c->hidden;
    dp.top_k = K;
    dp.num_sms = s->num_sms;
    dp.weights = a->weights;
    dp.row_weight = s->row_weight;
    MF_CUDA_TRY(mf_dispatch_rows_bf16(&dp, stream));

    // ---- 3. gemm1 + SwiGLU: xs -> act (and [g; u] into saved) ----
    // ---- 4. gemm2 + combine: act -> p-scaled slot rows of combine ----
    // One fused kernel (act_ready set) or one kernel each; the same bits.
    // On bad ids gemm_num_rows is 0: the gemms touch nothing.
    const mf_gemm1_params g1 = gemm1_params(layer, xs, a->w13, pp.row_block_expert,
                                            saved_gate_up(a->saved, lay, mode), lay.rows_cap);
    mf_gemm2_params g2 = gemm2_params(layer, a->w2, pp.row_block_expert, pp.row_slot, lay.rows_cap);
    g2.row_weight = s->row_weight;
    g2.combine = s->combine;
    if (s->act_ready) {
        const mf_moe_fused_fwd_params fp = {g1, g2, s->act_ready};
        MF_CUDA_TRY(mf_sm90_moe_fused_fwd_bf16(&fp, stream));
    } else {
        MF_CUDA_TRY(mf_sm90_gemm1_swiglu_fwd_bf16(&g1, stream));
        MF_CUDA_TRY(mf_sm90_gemm2_combine_fwd_bf16(&g2, stream));
    }

    // ---- 5. reduce: y[t] = sum of its K slot rows, fp32, k order ----
    const mf_reduce_params rp = reduce_params(layer, a->ids, T, a->y, a->y_stride);
    MF_CUDA_TRY(mf_reduce_slots_bf16(&rp, stream));
    return MOEFUSE_OK;
}

/* ---- backward ----------------------------------------------------------------------
 *
 *   check     the saved plan against the layer, T and ids (device, below)
 *   dispatch  dy -> dys (in combine), x -> xs, in the saved plan's row order (x not
 *             with MOEFUSE_SAVE_ACTIVATIONS_AND_INPUTS: dW13 reads the saved xs)
 *   gemm1     MOEFUSE_RECOMPUTE only: xs -> [g | u] (the forward's very call, so the
 *             forward's bits; act goes to the act workspace and is not read)
 *   dgrad2    dys W2_e with the SwiGLU backward -> dh = [dg | du], act_p = bf16(p a),
 *             d p partial sums per column block
 *   dW2       sum over e's rows of dys^T act_p              (reads dys: before dgrad1)
 *   dgrad1    dh W13_e -> one dx row per slot, into combine (over the dead dys)
 *   reduce    dx[t] = bf16(sum over k in order of the slot rows), like y
 *   reduce_dp dweights[t,k] = sum over the column blocks in order
 *   dW13      sum over e's rows of dh^T xs
 * With MOEFUSE_PIPELINE_FUSED (and H, I multiples of 256) dW2, dgrad1 and dW13 are one
 * kernel (src/cuda/sm90/fused_backward.cu), the reduces after it; the same bits.
 * Every sum has one owner and a fixed order: bitwise reproducible, no atomics. */

/* Device check of the saved plan, three tiny kernels (the plan lives in device memory;
 * reading it on the host would need a synchronization):
 *   header  one block: header words, counts/offsets, row_block_expert; num_rows,
 *           call_failed and the offsets the weight gradients read come from here;
 *   slots   grid over slots and rows: slot_row / row_slot are inverse, every live
 *           slot sits in the segment of its ids[] expert, every local slot is routed;
 *   finish  one thread: on a failure, records it, fails the call (num_rows 0, offsets
 *           0), and restores the per-call fields.
 * So a stale or foreign buffer is reported by moefuse_layer_check instead of reading
 * out of bounds. NOTE: the slot pass reads 4 words per slot and row: ~1 MB at
 * T = 4096, K = 8, a few microseconds. */
struct bwd_check_params {
    const int32_t *header;            /* [16] */
    const int32_t *counts;            /* [E_local] */
    const int32_t *offsets;           /* [E_local + 1] */
    const int32_t *row_block_expert;  /* [rows_cap / 128] */
    const int32_t *slot_row;          /* [T*K] */
    const int32_t *row_slot;          /* [rows_cap] */
    const int32_t *ids;               /* [T, K] */
    int32_t want[kHeaderNumRows];     /* header words 0..8 a matching forward wrote */
    int num_tokens, top_k, num_local_experts, expert_begin, rows_cap;
    int ep;                           /* expert parallelism (backend_ep.cu) */
    mf_plan_state *state;
    int32_t *gemm_num_rows;
    int32_t *bwd_offsets;             /* [E_local + 1] out */
};

/* What failed (mf_plan_error.slot of a MOEFUSE_ERR_SAVED_STATE record). */
enum { kBadHeader = 0, kBadOffsets = 1, kBadBlocks = 2, kBadSlot = 3, kBadRow = 4 };

__device__ void record_saved_error(mf_plan_state *st, int what, int index, int value) {
    if (st->record.code == 0) {  // keep the first failure until moefuse_layer_check
        st->record.token = index;
        st->record.slot = what;
        st->record.value = value;
        st->record.code = MOEFUSE_ERR_SAVED_STATE;
    }
}

__global__ void __launch_bounds__(256) bwd_check_header_kernel(const __grid_constant__ bwd_check_params p) {
    __shared__ int s_bad;   // smallest bad index * 8 + what; INT_MAX none
    if (threadIdx.x == 0) s_bad = 0x7fffffff;
    __syncthreads();
    const int EL = p.num_local_experts;
    const int32_t nr = p.header[kHeaderNumRows];
    // header words (each thread one word; num_rows: multiple of 128 within rows_cap)
    if (threadIdx.x < kHeaderNumRows && p.header[threadIdx.x] != p.want[threadIdx.x])
        atomicMin(&s_bad, (int)threadIdx.x * 8 + kBadHeader);
    if (threadIdx.x == 0 && (nr < 0 || nr > p.rows_cap || nr % MF_SM90_BLOCK_M != 0))
        atomicMin(&s_bad, kHeaderNumRows * 8 + kBadHeader);
    __syncthreads();
    if (s_bad == 0x7fffffff) {
        // counts and offsets: offsets[e+1] - offsets[e] = counts[e] padded to 128
        for (int e = threadIdx.x; e <= EL; e += blockDim.x) {
            bool ok;
            if (e == EL) {
                ok = p.offsets[EL] == nr && p.offsets[0] == 0;
            } else {
                const int32_t c = p.counts[e];
                ok = c >= 0 && c <= p.rows_cap &&
                     p.offsets[e + 1] - p.offsets[e] ==
                         (c + MF_SM90_BLOCK_M - 1) / MF_SM90_BLOCK_M * MF_SM90_BLOCK_M;
            }
            if (!ok) atomicMin(&s_bad, e * 8 + kBadOffsets);
        }
        __syncthreads();
    }
    if (s_bad == 0x7fffffff) {
        // each 128-row block names the expert whose segment holds it
        for (int b = threadIdx.x; b < nr / MF_SM90_BLOCK_M; b += blockDim.x) {
            const int32_t e = p.row_block_expert[b];
            const bool ok = e >= 0 && e < EL && p.offsets[e] <= b * MF_SM90_BLOCK_M &&
                            b * MF_SM90_BLOCK_M < p.offsets[e + 1];
            if (!ok) atomicMin(&s_bad, b * 8 + kBadBlocks);
        }
        __syncthreads();
    }
    const bool bad = s_bad != 0x7fffffff;
    for (int e = threadIdx.x; e <= EL; e += blockDim.x) p.bwd_offsets[e] = bad ? 0 : p.offsets[e];
    if (threadIdx.x == 0) {
        if (bad) {
            const int what = s_bad % 8, index = s_bad / 8;
            const int value = what == kBadHeader ? p.header[index]
                              : what == kBadOffsets ? p.offsets[index] : p.row_block_expert[index];
            record_saved_error(p.state, what, index, value);
        }
        /* EP: a rank whose forward ids were bad sent no rows and gets no dx, but still
         * serves the rows the other ranks send it. */
        const bool sent_nothing = p.ep && p.header[kHeaderSendFailed] != 0;
        p.state->call_failed = bad || sent_nothing ? 1 : 0;
        p.state->saved_rejected = bad ? 1 : 0;
        *p.gemm_num_rows = bad ? 0 : nr;
    }
}

__global__ void __launch_bounds__(256) bwd_check_slots_kernel(const __grid_constant__ bwd_check_params p) {
    if (p.state->call_failed) return;  // the header failed: the rest is not to be read
    const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    const int64_t slots = (int64_t)p.num_tokens * p.top_k;
    const int32_t nr = p.header[kHeaderNumRows];
    bool ok = true;
    if (p.ep) {
        // EP: a routed slot has a row on its expert's rank (within every rank's capacity),
        // a dropped one none; the rows live on the other ranks, their check is theirs
        if (i < slots) {
            const int32_t r = p.slot_row[i];
            ok = p.ids[i] >= 0 ? r >= 0 && r < p.rows_cap : r == -1;
        }
    } else if (i < slots) {
        // a local slot has a row that points back at it; any other slot has none
        const int32_t e = p.ids[i] - p.expert_begin, r = p.slot_row[i];
        if (e >= 0 && e < p.num_local_experts)
            ok = r >= p.offsets[e] && r < p.offsets[e] + p.counts[e] && p.row_slot[r] == i;
        else
            ok = r == -1;
    } else if (i < slots + nr) {
        // a row of a segment's first counts[e] holds a slot routed to e that points
        // back at it; the rest of the segment is padding
        const int32_t r = (int32_t)(i - slots), s = p.row_slot[r];
        const int32_t e = p.row_block_expert[r / MF_SM90_BLOCK_M];
        if (r - p.offsets[e] < p.counts[e])
            ok = s >= 0 && s < slots && p.slot_row[s] == r && p.ids[s] == p.expert_begin + e;
        else
            ok = s == -1;
    }
    if (!ok) atomicMin(&p.state->first_bad_token, (uint32_t)i);
}

__global__ void bwd_check_finish_kernel(const __grid_constant__ bwd_check_params p) {
    const uint32_t bad = p.state->first_bad_token;
    if (bad == 0xffffffffu) return;
    const int64_t slots = (int64_t)p.num_tokens * p.top_k;
    if ((int64_t)bad < slots)
        record_saved_error(p.state, kBadSlot, (int)bad, p.ids[bad]);
    else
        record_saved_error(p.state, kBadRow, (int)(bad - slots), p.row_slot[bad - slots]);
    p.state->call_failed = 1;
    p.state->saved_rejected = 1;
    *p.gemm_num_rows = 0;
    for (int e = 0; e <= p.num_local_experts; e++) p.bwd_offsets[e] = 0;
    p.state->first_bad_token = 0xffffffffu;
}

moefuse_status check_saved(moefuse_layer *layer, const moefuse_bwd_args *a,
                           const saved_layout &lay, cudaStream_t stream) {
    cuda_state *s = state_of(layer);
    const moefuse_config *c = &layer->cfg;
    const int T = a->num_tokens, K = c->top_k;
    const char *base = (const char *)a->saved;
    bwd_check_params cp;
    memset(&cp, 0, sizeof cp);
    cp.header = (const int32_t *)(base + lay.header);
    cp.counts = (const int32_t *)(base + lay.counts);
    cp.offsets = (const int32_t *)(base + lay.offsets);
    cp.row_block_expert = (const int32_t *)(base + lay.row_block_expert);
    cp.slot_row = (const int32_t *)(base + lay.slot_row);
    cp.row_slot = (const int32_t *)(base + lay.row_slot);
    cp.ids = a->ids;
    int32_t want[kHeaderWords];
    header_words(layer, T, lay.rows_cap, c->saved_mode, want);
    memcpy(cp.want, want, sizeof cp.want);
    cp.num_tokens = T;
    cp.top_k = K;
    cp.num_local_experts = layer->num_local_experts;
    cp.expert_begin = layer->expert_begin;
    cp.rows_cap = lay.rows_cap;
    cp.ep = layer->comm != NULL;
    cp.state = s->plan_state;
    cp.gemm_num_rows = s->gemm_num_rows;
    cp.bwd_offsets = s->bwd_offsets;
    bwd_check_header_kernel<<<1, 256, 0, stream>>>(cp);
    MF_CUDA_LAUNCHED();
    // EP checks the slots only (the rows are the other ranks' sends)
    const int64_t check_n = (int64_t)T * K + (cp.ep ? 0 : lay.rows_cap);
    if (check_n > 0) {
        bwd_check_slots_kernel<<<(unsigned)((check_n + 255) / 256), 256, 0, stream>>>(cp);
        MF_CUDA_LAUNCHED();
    }
    bwd_check_finish_kernel<<<1, 1, 0, stream>>>(cp);
    MF_CUDA_LAUNCHED();
    return MOEFUSE_OK;
}

/* Every kernel a layer may launch, loaded at create (check.h, mf_load_kernels). */
moefuse_status load_kernels(void) {
    typedef cudaError_t (*load_fn)(void);
    static const struct { load_fn load; const char *what; } files[] = {
        {mf_plan_load, "plan"},
        {mf_dispatch_rows_load, "dispatch"},
        {mf_reduce_slots_load, "reduce"},
        {mf_reduce_dp_load, "reduce_dp"},
        {mf_sm90_gemm1_swiglu_fwd_load, "gemm1"},
        {mf_sm90_gemm2_combine_fwd_load, "gemm2"},
        {mf_sm90_moe_fused_fwd_load, "fused forward"},
        {mf_sm90_gemm2_dgrad_swiglu_load, "dgrad2"},
        {mf_sm90_gemm1_dgrad_bwd_load, "dgrad1"},
        {mf_sm90_wgrad_grouped_load, "wgrad"},
        {mf_sm90_moe_fused_bwd_load, "fused backward"},
        {mf_expert_order_load, "expert order"},
        {mf_ep_exchange_counts_load, "ep exchange"},
        {mf_ep_push_rows_load, "ep push rows"},
        {mf_ep_push_dp_load, "ep push dp"},
        {mf_ep_signal_wait_load, "ep signal"},
    };
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        const cudaError_t err = files[i].load();
        if (err != cudaSuccess)
            return mf_fail(MOEFUSE_ERR_CUDA, "loading the %s kernels: %s (%s)", files[i].what,
                           cudaGetErrorString(err), cudaGetErrorName(err));
    }
    MF_CUDA_TRY(mf_load_kernels(bwd_check_header_kernel, bwd_check_slots_kernel,
                                bwd_check_finish_kernel));
    return MOEFUSE_OK;
}

namespace {

moefuse_status cuda_backward(moefuse_layer *layer, const moefuse_bwd_args *a, void *stream_) {
    cuda_state *s = state_of(layer);
    const cudaStream_t stream = (cudaStream_t)stream_;
    const moefuse_config *c = &layer->cfg;
    const int T = a->num_tokens, K = c->top_k, H = c->hidden;
    const bool recompute = c->saved_mode == MOEFUSE_RECOMPUTE;
    if (layer->comm) return ep_backward(layer, a, stream);
    if (T == 0) {  // no rows: the wgrad launcher writes zero gradients (accumulating: none)
        const mf_wgrad_params dw2 = dw2_params(layer, a, 0, s->combine);
        const mf_wgrad_params dw13 = dw13_params(layer, a, 0, s->xs);
        MF_CUDA_TRY(mf_sm90_wgrad_grouped_bf16(&dw2, stream));
        MF_CUDA_TRY(mf_sm90_wgrad_grouped_bf16(&dw13, stream));
        return MOEFUSE_OK;
    }

    // ---- 0. the saved plan: checked on the device ----
    const saved_layout lay = layout_for(layer, T, c->saved_mode);
    const char *base = (const char *)a->saved;
    const int32_t *row_slot = (const int32_t *)(base + lay.row_slot);
    const int32_t *rbe = (const int32_t *)(base + lay.row_block_expert);
    const int32_t *call_failed = &s->plan_state->call_failed;
    const moefuse_status checked = check_saved(layer, a, lay, stream);
    if (checked != MOEFUSE_OK) return checked;

    // ---- 1. dispatch: dy -> dys (the combine workspace), x -> xs, in one pass; x not
    //      with MOEFUSE_SAVE_ACTIVATIONS_AND_INPUTS (the forward's xs is saved) ----
    uint16_t *dys = s->combine;
    const bool saved_xs = c->saved_mode == MOEFUSE_SAVE_ACTIVATIONS_AND_INPUTS;
    const uint16_t *xs = saved_xs ? (const uint16_t *)(base + lay.xs) : s->xs;
    mf_dispatch_params dp = {};
    dp.x[0] = a->dy;
    dp.x_stride[0] = a->dy_stride;
    dp.xs[0] = dys;
    dp.x[1] = a->x;
    dp.x_stride[1] = a->x_stride;
    dp.xs[1] = s->xs;
    dp.num_tensors = saved_xs ? 1 : 2;
    dp.slot_row = (const int32_t *)(base + lay.slot_row);
    dp.row_slot = row_slot;
    dp.num_rows = s->gemm_num_rows;
    dp.call_failed = call_failed;
    dp.num_tokens = T;
    dp.rows_cap = lay.rows_cap;
    dp.hidden = H;
    dp.top_k = K;
    dp.num_sms = s->num_sms;
    dp.weights = a->weights;
    dp.row_weight = s->row_weight;
    MF_CUDA_TRY(mf_dispatch_rows_bf16(&dp, stream));

    // ---- 2. [g | u]: saved, or recomputed by the forward's gemm1 ----
    // (act is not read: dgrad2 overwrites it with act_p)
    const uint16_t *gate_up = (const uint16_t *)(base + lay.gate_up);
    if (recompute) {
        const mf_gemm1_params g1 =
            gemm1_params(layer, s->xs, a->w13, rbe, s->gate_up, lay.rows_cap);
        MF_CUDA_TRY(mf_sm90_gemm1_swiglu_fwd_bf16(&g1, stream));
        gate_up = s->gate_up;
    }

    // ---- 3. dgrad2 + SwiGLU backward: dh, act_p, d p partials ----
    mf_dgrad2_params d2 = dgrad2_params(layer, dys, a->w2, gate_up, rbe, row_slot, lay.rows_cap);
    d2.row_weight = s->row_weight;
    MF_CUDA_TRY(mf_sm90_gemm2_dgrad_swiglu_bwd_bf16(&d2, stream));

    // ---- 4. dW2 = dys^T act_p per expert: before dgrad1 overwrites dys;
    //      5. dgrad1: dh W13_e -> dx slot rows in combine; 7. dW13 = dh^T xs per expert.
    //      One fused kernel (the fused pipeline, act_ready set) or one kernel each; the
    //      same bits ----
    const moefuse_status ordered = order_experts(layer, stream);
    if (ordered != MOEFUSE_OK) return ordered;
    const mf_wgrad_params dw2 = dw2_params(layer, a, lay.rows_cap, dys);
    mf_dgrad1_params d1 = dgrad1_params(layer, a->w13, rbe, row_slot, lay.rows_cap);
    d1.combine = s->combine;
    const mf_wgrad_params dw13 = dw13_params(layer, a, lay.rows_cap, xs);
    bool fused;
    const moefuse_status launched = backward_gemms(layer, dw2, d1, dw13, stream, &fused);
    if (launched != MOEFUSE_OK) return launched;

    // ---- 6. reduce: dx[t] = sum of its K slot rows, fp32, k order; and d p ----
    const mf_reduce_params rp = reduce_params(layer, a->ids, T, a->dx, a->dx_stride);
    MF_CUDA_TRY(mf_reduce_slots_bf16(&rp, stream));
    mf_reduce_dp_params rd = {};
    rd.dp_partial = s->dp_partial;
    rd.parts = s->dp_parts;
    rd.slot_row = (const int32_t *)(base + lay.slot_row);
    rd.ids = NULL;
    rd.call_failed = call_failed;
    rd.dweights = a->dweights;
    rd.num_tokens = T;
    rd.top_k = K;
    MF_CUDA_TRY(mf_reduce_dp_f32(&rd, stream));

    // ---- 7. dW13 (staged) ----
    if (!fused) MF_CUDA_TRY(mf_sm90_wgrad_grouped_bf16(&dw13, stream));
    return MOEFUSE_OK;
}

moefuse_status cuda_check(moefuse_layer *layer, void *stream_) {
    cuda_state *s = state_of(layer);
    const cudaStream_t stream = (cudaStream_t)stream_;
    mf_plan_error rec;
    MF_CUDA_TRY(cudaMemcpyAsync(&rec, &s->plan_state->record, sizeof rec,
                                cudaMemcpyDeviceToHost, stream));
    MF_CUDA_TRY(cudaStreamSynchronize(stream));
    if (rec.code == 0) return MOEFUSE_OK;
    MF_CUDA_TRY(cudaMemsetAsync(&s->plan_state->record, 0, sizeof rec, stream));
    MF_CUDA_TRY(cudaStreamSynchronize(stream));
    if (rec.code == MOEFUSE_ERR_EXPERT_ID)
        return mf_fail(MOEFUSE_ERR_EXPERT_ID,
                       "moefuse_forward: fwd_args.ids[%d][%d] = %d: expected -1 (dropped) or "
                       "an expert in [0, %d); that call wrote no output",
                       rec.token, rec.slot, rec.value, layer->cfg.num_experts);
    if (rec.code == MOEFUSE_ERR_DUPLICATE_EXPERT)
        return mf_fail(MOEFUSE_ERR_DUPLICATE_EXPERT,
                       "moefuse_forward: fwd_args.ids[%d][%d] = %d: expert already routed "
                       "earlier in token %d; expected no expert twice in a token; that call "
                       "wrote no output",
                       rec.token, rec.slot, rec.value, rec.token);
    if (rec.code == MOEFUSE_ERR_SAVED_STATE) {
        static const char *const what[] = {"header word", "expert_offsets/counts entry",
                                           "row_block_expert of block", "slot", "row"};
        return mf_fail(MOEFUSE_ERR_SAVED_STATE,
                       "moefuse_backward: bwd_args.saved: %s %d holds %d, which does not match "
                       "a forward of this layer with these num_tokens and ids; expected the "
                       "buffer that forward filled; that call wrote no dx and no dweights "
                       "(the weight gradients: zeros in write mode, unchanged when accumulating)",
                       rec.slot >= 0 && rec.slot < 5 ? what[rec.slot] : "entry", rec.token,
                       rec.value);
    }
    if (rec.code == MOEFUSE_ERR_TIMEOUT || rec.code == MOEFUSE_ERR_TOO_MANY_TOKENS) {
        static const char *const stage[] = {
            "forward: row counts", "forward: x rows", "forward: y slot rows",
            "backward: start of the call", "backward: dy and x rows",
            "backward: dx slot rows and d p"};
        const char *st = rec.slot >= 0 && rec.slot < 6 ? stage[rec.slot] : "?";
        if (rec.code == MOEFUSE_ERR_TOO_MANY_TOKENS)
            return mf_fail(MOEFUSE_ERR_TOO_MANY_TOKENS,
                           "rank %d: rank %d would receive %d rows, over its capacity of %d "
                           "(R * max_tokens * K + padding); expected the same config.max_tokens "
                           "on every rank; that call wrote no output on any rank",
                           layer->cfg.rank, rec.token, rec.value, rec.expected);
        if (rec.token < 0)  // gemm1 waiting for the rows of one receive block
            return mf_fail(MOEFUSE_ERR_TIMEOUT,
                           "rank %d: timeout after %d ms waiting for the rows of its receive "
                           "block %d at stage '%s': %u rows counted in, expected %u; that "
                           "call wrote no output on this rank; destroy and create every "
                           "rank's layer",
                           layer->cfg.rank, layer->comm ? layer->comm->timeout_ms : 0,
                           -1 - rec.token, st, (unsigned)rec.value, (unsigned)rec.expected);
        if (rec.value & 1)
            return mf_fail(MOEFUSE_ERR_TIMEOUT,
                           "rank %d: peer rank %d reported a failed call (a timeout on its side, "
                           "or at the start of a backward a saved buffer it rejected) "
                           "at stage '%s' (flag 0x%x, epoch %u); that call wrote no output on "
                           "this rank; destroy and create every rank's layer",
                           layer->cfg.rank, rec.token, st, (unsigned)rec.value,
                           (unsigned)rec.expected >> 1);
        return mf_fail(MOEFUSE_ERR_TIMEOUT,
                       "rank %d: timeout after %d ms waiting for rank %d at stage '%s': its flag "
                       "was 0x%x (epoch %u), expected epoch %u; that call wrote no output on "
                       "this rank; destroy and create every rank's layer",
                       layer->cfg.rank, layer->comm ? layer->comm->timeout_ms : 0, rec.token, st,
                       (unsigned)rec.value, (unsigned)rec.value >> 1,
                       (unsigned)rec.expected >> 1);
    }
    return mf_fail(MOEFUSE_ERR_CUDA, "moefuse_layer_check: unexpected device error record %d",
                   rec.code);
}

const mf_backend_ops kCudaOps = {
    "cuda", cuda_create, cuda_destroy, cuda_saved_bytes, cuda_forward, cuda_backward, cuda_check,
};

}  // namespace
}  // namespace backend
}  // namespace mf

extern "C" const mf_backend_ops *mf_cuda_backend(void) { return &mf::backend::kCudaOps; }
