/* The CUDA backend's layer: the execution plan, the workspaces, the saved-buffer layout,
 * create and destroy, the kernels loaded at create.
 *
 * A forward or backward is launches on the caller's stream only (and, with peers, the
 * layer's side stream joined back into it): no host synchronization, no allocation, no
 * host-to-device copy, so it can be captured in a CUDA graph. The workspaces belong to
 * the layer: calls on one layer must be ordered (one stream, or events between streams).
 * What the backward needs goes to the caller's `saved` buffer, so several forwards may
 * be in flight before their backwards.
 *
 * Saved buffer (moefuse_saved_bytes(T)), one layout for both transports, each section at
 * a 256-byte boundary (B = the row block, 128):
 *   header           int32[16]  MF_SAVED_* words (kernels.h); num_rows at word 9
 *   expert_counts    int32[E_local]
 *   expert_offsets   int32[E_local + 1]
 *   row_block_expert int32[rows_cap / B]
 *   slot_row         int32[T * K]
 *   row_slot         int32[rows_cap]       local only: peers send each row's source
 *                                          again in the backward, with its dy row, into
 *                                          their window, so the section is 0 bytes
 *   gate_up          bf16 [rows_cap, 2I]   MOEFUSE_SAVE_ACTIVATIONS(_AND_INPUTS)
 *   xs               bf16 [rows_cap, H]    MOEFUSE_SAVE_ACTIVATIONS_AND_INPUTS (local)
 * with rows_cap = roundup(slots + (B - 1) * min(E_local, slots), B), slots = T*K (local)
 * or the receive capacity (peers: config.recv_capacity_factor * max_tokens * K, at most
 * R * max_tokens * K), the most rows the padded layout can take. The arithmetic of every
 * size here is src/host/sizing.c's (moefuse_layer_memory reports the same numbers). Local bytes per token: 8K (slot_row + row_slot) + 4KI (gate_up, K rows of
 * 2I bf16) + K/32 (row_block_expert): qwen3-30b-a3b 64 + 24576 = 24,640 B,
 * qwen3-235b-a22b 64 + 49152 = 49,216 B; plus at most 127 * min(E_local, T*K) padding
 * rows of 4 + 4I bytes, and the header and counts (under 2 KB at E = 128). The inputs
 * add 2KH bytes per token (xs, the forward's own dispatch target): qwen3-30b-a3b 32,768,
 * qwen3-235b-a22b 65,536.
 *
 * Layer workspaces, local, bytes per token of max_tokens (K slot rows each; the padding
 * rows of rows_cap add up to 127 * min(E_local, T*K) rows on top):
 *   xs        [rows_cap, H]  bf16   fwd: gathered x      bwd: gathered x again (dW13)
 *                                   (MOEFUSE_SAVE_ACTIVATIONS_AND_INPUTS: saved's xs
 *                                   instead, but for forwards with saved = NULL)
 *   act       [rows_cap, I]  bf16   fwd: a               bwd: act_p = bf16(p a) (dW2)
 *   combine   [rows_cap, H]  bf16   fwd: slot rows of y  bwd: dys, then slot rows of dx
 *   dh        [rows_cap, 2I] bf16   bwd: [dg | du]
 *   dp_partial[rows_cap, P]  fp32   bwd: d p partial sums (P = the plan's dp_parts)
 *   gate_up   [rows_cap, 2I] bf16   bwd, MOEFUSE_RECOMPUTE only: [g | u] recomputed
 *   slot_rank [T*K] int32, chunk_base, plan_ws (a plan when saved = NULL): small
 * per token: 2KH (xs) + 2KI (act) + 2KH (combine) + 4KI (dh) + 4KP (dp_partial) + 4K
 * (slot_rank) [+ 4KI gate_up when recomputing]:
 *   qwen3-30b-a3b   (P = 3):  32768 + 12288 + 32768 + 24576 + 96 + 32 = 102,528 B
 *                             (+24,576 recompute), 420 MB at max_tokens = 4096;
 *   qwen3-235b-a22b (P = 6):  65536 + 24576 + 65536 + 49152 + 192 + 32 = 205,024 B
 *                             (+49,152 recompute).
 * The backward's dys shares combine: dW2 consumes dys before dgrad1 writes dx slot rows
 * there, which is why combine has rows_cap rows, not T*K (+~50% of one [T*K, H] at
 * T = 4096, E = 128, instead of a separate dys of rows_cap rows). Peers: xs, dys,
 * row_slot, row_weight, combine and d p are windows, and act, dh, dp_partial and gate_up
 * scratch, all of the rank's pool on the comm, shared by its layers (transport/ep_pool.cu);
 * the layer owns the rest. */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "gemm_ops.h"
#include "internal.h"
#include "kernels.h"
#include "pipeline/state.h"

namespace mf {
namespace pipeline {

/* ---- layout ------------------------------------------------------------------------ */

saved_layout layout_for(const moefuse_layer *layer, int num_tokens, moefuse_saved_mode mode) {
    return mf_saved_layout_of(&layer->cfg, state_of(layer)->plan.rows_from_peers, num_tokens,
                              mode);
}

void header_words(const moefuse_layer *layer, int num_tokens, int rows_cap,
                  moefuse_saved_mode mode, int32_t words[MF_SAVED_HEADER_WORDS]) {
    const moefuse_config *c = &layer->cfg;
    memset(words, 0, sizeof(int32_t) * MF_SAVED_HEADER_WORDS);
    words[MF_SAVED_MAGIC] = MF_SAVED_MAGIC_VALUE;
    words[MF_SAVED_VERSION] = MF_SAVED_VERSION_VALUE;
    words[MF_SAVED_TOKENS] = num_tokens;
    words[MF_SAVED_TOP_K] = c->top_k;
    words[MF_SAVED_LOCAL_EXPERTS] = layer->num_local_experts;
    words[MF_SAVED_HIDDEN] = c->hidden;
    words[MF_SAVED_INTERMEDIATE] = c->intermediate;
    words[MF_SAVED_ROWS_CAP] = rows_cap;
    words[MF_SAVED_MODE] = mode;
}

call_bufs call_for(const moefuse_layer *layer, int num_tokens, moefuse_saved_mode mode,
                   const void *saved) {
    const cuda_state *s = state_of(layer);
    call_bufs c = {};
    c.num_tokens = num_tokens;
    c.mode = mode;
    c.lay = layout_for(layer, num_tokens, mode);
    c.base = saved ? (char *)saved : (char *)s->plan_ws;
    c.rbe = (const int32_t *)(c.base + c.lay.row_block_expert);
    s->plan.net->locate_rows(layer, &c);
    return c;
}

/* ---- state ------------------------------------------------------------------------- */

/* What create_checked allocated (the transport's destroy frees its own); peers: the row
 * buffers and scratch (the FP8 operands' too) are the pool's, not these. */
static void free_state(cuda_state *s) {
    if (!s) return;
    void *own[] = {s->slot_rank, s->chunk_base, s->plan_state, s->gemm_num_rows, s->plan_ws,
                   s->act_ready, s->bwd_offsets, s->expert_order};
    for (void *b : own)
        if (b) cudaFree(b);
    if (!s->plan.rows_from_peers) {
        void *rows[] = {s->xs, s->combine, s->row_weight, s->act, s->dh, s->dp_partial,
                        s->gate_up, s->fp8_rows, s->fp8_row_scales, s->fp8_lhs_t,
                        s->fp8_lhs_scales, s->fp8_rhs_t, s->fp8_rhs_scales};
        for (void *b : rows)
            if (b) cudaFree(b);
    }
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

/* ---- the execution plan ------------------------------------------------------------ */

/* The device and the GEMM table of (its architecture, the precision). */
static moefuse_status pick_device(const moefuse_layer *layer, cuda_state *s) {
    const moefuse_config *c = &layer->cfg;
    if (!mf_gemm_ops_find(-1, c->precision))
        return mf_fail(MOEFUSE_ERR_UNSUPPORTED,
                       "config.precision = %d: this build's CUDA backend has no GEMMs of that "
                       "precision; expected MOEFUSE_PRECISION_BF16 or MOEFUSE_PRECISION_FP8_BLOCK",
                       (int)c->precision);
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
    s->plan.gemm = mf_gemm_ops_find(major * 10 + minor, c->precision);
    if (!s->plan.gemm) {
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
    return MOEFUSE_OK;
}

static moefuse_status resolve_plan(const moefuse_layer *layer, cuda_state *s) {
    const moefuse_config *c = &layer->cfg;
    exec_plan &p = s->plan;
    const mf_gemm_ops *g = p.gemm;
    if (g->block_m != MF_ROW_BLOCK_M)  // the plan and transport kernels pad to MF_ROW_BLOCK_M
        return mf_fail(MOEFUSE_ERR_UNSUPPORTED, "the %s GEMMs tile %d rows, the plan %d",
                       g->name, g->block_m, MF_ROW_BLOCK_M);
    if (c->hidden % g->dim_multiple != 0 || c->intermediate % g->dim_multiple != 0)
        return mf_fail(MOEFUSE_ERR_UNSUPPORTED,
                       "config.hidden = %d, config.intermediate = %d: the CUDA backend's "
                       "GEMM tiles take multiples of %d; expected both multiples of %d "
                       "(or MOEFUSE_BACKEND_CPU)", c->hidden, c->intermediate,
                       g->dim_multiple, g->dim_multiple);
    p.operands = c->precision == MOEFUSE_PRECISION_FP8_BLOCK ? &kFp8Operands : &kBf16Operands;
    p.net = layer->comm ? &kPeers : &kLocal;
    p.rows_from_peers = layer->comm != NULL;
    p.fused_forward = c->pipeline == MOEFUSE_PIPELINE_FUSED &&
                      g->fused_forward_takes(c->hidden, c->intermediate);
    p.fused_backward = c->pipeline == MOEFUSE_PIPELINE_FUSED &&
                       g->fused_backward_takes(c->hidden, c->intermediate);
    p.dw13_before_wait = p.rows_from_peers;
    p.dispatch_quantizes_x = c->precision == MOEFUSE_PRECISION_FP8_BLOCK;
    p.quantizers_gather = p.dispatch_quantizes_x && !p.rows_from_peers;
    if (p.quantizers_gather && (p.fused_forward || p.fused_backward))
        return mf_fail(MOEFUSE_ERR_UNSUPPORTED,
                       "the %s GEMMs offer a fused kernel, but FP8 on one GPU dispatches no "
                       "bf16 x or dy rows for one to read", g->name);
    p.saved_mode = c->saved_mode;
    p.block_m = g->block_m;
    p.dp_parts = g->dp_parts(c->intermediate);
    if (p.dp_parts < 1)
        return mf_fail(MOEFUSE_ERR_UNSUPPORTED,
                       "config.intermediate = %d: the backward's dgrad2 takes no such size "
                       "(dp_parts = %d)", c->intermediate, p.dp_parts);
    MF_CUDA_TRY(cudaDeviceGetAttribute(&p.num_sms, cudaDevAttrMultiProcessorCount, s->device));
    /* Virtual ranks share the GPU: each rank's grids get SMs / R blocks, so every
     * rank's kernels are resident together. */
    if (layer->comm && layer->comm->kind == MF_COMM_VIRTUAL)
        p.num_sms = p.num_sms / c->num_ranks > 0 ? p.num_sms / c->num_ranks : 1;
    /* The push is bound by NVLink (or, with virtual ranks, by HBM): an eighth of the SMs
     * carry it, the rest run the GEMMs beside it. */
    p.push_sms = p.num_sms / 8 > 0 ? p.num_sms / 8 : 1;
    p.beside_push_sms = p.num_sms - p.push_sms > 0 ? p.num_sms - p.push_sms : 1;
    /* peers plan this rank's slots over all E experts first (the sends) */
    p.plan_experts = p.rows_from_peers ? c->num_experts : layer->num_local_experts;
    return MOEFUSE_OK;
}

/* Every kernel a layer may launch, loaded at create (check.h, mf_load_kernels): the
 * GEMM table's and the SIMT and transport kernels. */
static moefuse_status load_kernels(const mf_gemm_ops *gemm) {
    static const mf_kernel_loader kOthers[] = {
        {mf_plan_load, "plan"},
        {mf_dispatch_rows_load, "dispatch"},
        {mf_reduce_slots_load, "reduce"},
        {mf_reduce_dp_load, "reduce_dp"},
        {mf_expert_order_load, "expert order"},
        {mf_saved_check_load, "saved check"},
        {mf_ep_exchange_counts_load, "ep exchange"},
        {mf_ep_push_rows_load, "ep push rows"},
        {mf_ep_push_dp_load, "ep push dp"},
        {mf_ep_signal_wait_load, "ep signal"},
        {mf_quantize_fp8_load, "fp8 quantize"},
        {mf_quantize_fp8_weights_load, "fp8 quantize weights"},
    };
    const int others = (int)(sizeof kOthers / sizeof kOthers[0]);
    for (int i = 0; i < gemm->num_loaders + others; i++) {
        const mf_kernel_loader &l = i < gemm->num_loaders ? gemm->loaders[i]
                                                          : kOthers[i - gemm->num_loaders];
        const cudaError_t err = l.load();
        if (err != cudaSuccess)
            return mf_fail(MOEFUSE_ERR_CUDA, "loading the %s kernels: %s (%s)", l.what,
                           cudaGetErrorString(err), cudaGetErrorName(err));
    }
    return MOEFUSE_OK;
}

/* ---- create, destroy ----------------------------------------------------------------- */

static moefuse_status create_checked(moefuse_layer *layer, cuda_state *s) {
    const moefuse_config *c = &layer->cfg;
    MF_TRY(pick_device(layer, s));
    MF_TRY(resolve_plan(layer, s));
    const exec_plan &plan = s->plan;
    s->num_ranks = c->num_ranks;
    s->rank = c->rank;

    const int K = c->top_k;
    int smem_optin = 0;
    MF_CUDA_TRY(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                       s->device));
    const size_t plan_smem = mf_plan_smem_bytes(K, plan.plan_experts);
    if (plan_smem > (size_t)smem_optin)
        return mf_fail(MOEFUSE_ERR_UNSUPPORTED,
                       "config.num_experts = %d, top_k = %d: the GPU plan needs %zu bytes of "
                       "shared memory per block, the device allows %d",
                       c->num_experts, K, plan_smem, smem_optin);
    MF_CUDA_TRY(mf_plan_prepare(K, plan.plan_experts));
    MF_TRY(load_kernels(plan.gemm));

    const mf_tiles tiles = {plan.dp_parts, mf_plan_chunk_tokens(K), sizeof(mf_plan_state)};
    s->sizes = mf_sizes_of(c, plan.rows_from_peers, tiles);
    const mf_sizes &z = s->sizes;
    if (!plan.rows_from_peers) {  // peers: these are the pool's (transport/ep_pool.cu)
        if (z.rows_bufs[MF_WIN_XS]) MF_ALLOC_FIELD(s, xs, z.rows_bufs[MF_WIN_XS]);  // not FP8
        MF_ALLOC_FIELD(s, combine, z.rows_bufs[MF_WIN_COMBINE]);
        MF_ALLOC_FIELD(s, row_weight, z.rows_bufs[MF_WIN_ROW_WEIGHT]);
        MF_ALLOC_FIELD(s, act, z.rows_bufs[MF_POOL_ACT]);
        MF_ALLOC_FIELD(s, dh, z.rows_bufs[MF_POOL_DH]);
        MF_ALLOC_FIELD(s, dp_partial, z.rows_bufs[MF_POOL_DP_PARTIAL]);
        if (z.rows_bufs[MF_POOL_GATE_UP]) MF_ALLOC_FIELD(s, gate_up, z.rows_bufs[MF_POOL_GATE_UP]);
    }
    MF_ALLOC_FIELD(s, slot_rank, z.slot_rank);
    MF_ALLOC_FIELD(s, chunk_base, z.chunk_base);
    MF_ALLOC_FIELD(s, plan_state, z.plan_state);
    MF_ALLOC_FIELD(s, gemm_num_rows, z.gemm_num_rows);
    MF_ALLOC_FIELD(s, plan_ws, z.plan_ws);
    if (z.act_ready) MF_ALLOC_FIELD(s, act_ready, z.act_ready);
    MF_ALLOC_FIELD(s, bwd_offsets, z.bwd_offsets);
    MF_ALLOC_FIELD(s, expert_order, z.expert_order);
    MF_TRY(plan.operands->create(layer, s));
    const mf_plan_state init = MF_PLAN_STATE_INIT;
    MF_CUDA_TRY(cudaMemcpy(s->plan_state, &init, sizeof init, cudaMemcpyHostToDevice));
    MF_CUDA_TRY(cudaMemset(s->gemm_num_rows, 0, sizeof(int32_t)));
    return plan.net->create(layer, s);
}

/* Everything local first (create_checked, the transport's create included), then the
 * transport's connect, which every rank of an NCCL comm reaches whatever its outcome so
 * far: no rank waits in a collective for one that failed. */
static moefuse_status create(moefuse_layer *layer) {
    cuda_state *s = (cuda_state *)calloc(1, sizeof(cuda_state));
    if (!s) return mf_fail(MOEFUSE_ERR_NO_MEMORY, "moefuse_layer_create: out of host memory");
    layer->backend = s;  // the layout and the transport read the plan through the layer
    s->plan.net = layer->comm ? &kPeers : &kLocal;
    s->plan.rows_from_peers = layer->comm != NULL;
    moefuse_status st = create_checked(layer, s);
    st = s->plan.net->connect(layer, s, st);
    if (st != MOEFUSE_OK) {
        s->plan.net->destroy(layer, s);
        free_state(s);
        layer->backend = NULL;
        return st;
    }
    return MOEFUSE_OK;
}

static void destroy(moefuse_layer *layer) {
    cuda_state *s = state_of(layer);
    s->plan.net->destroy(layer, s);
    free_state(s);
    layer->backend = NULL;
}

static size_t saved_bytes(const moefuse_layer *layer, int num_tokens) {
    return layout_for(layer, num_tokens, state_of(layer)->plan.saved_mode).total;
}

/* W13 [E, 2I, H] (or its halves, gate w13 and up w13_up [E, I, H]) and W2 [E, H, I] into
 * the FP8 weights, both orientations, on the stream. */
static moefuse_status quantize_weights(const moefuse_layer *layer, moefuse_dtype dtype,
                                       const void *w13, const void *w13_up, const void *w2,
                                       const moefuse_fp8_weights *out, void *stream) {
    const moefuse_config *c = &layer->cfg;
    mf_quantize_fp8_weights_params q = {};
    q.fp32 = dtype == MOEFUSE_DTYPE_FP32;
    q.num_experts = layer->num_local_experts;
    q.pow2 = out->pow2_scales;
    q.w = w13;
    q.w_hi = w13_up;
    q.split_rows = w13_up ? c->intermediate : 0;
    q.rows = 2 * c->intermediate;
    q.cols = c->hidden;
    q.codes = out->w13;
    q.scale = out->w13_scale;
    q.codes_t = out->w13t;
    q.scale_t = out->w13t_scale;
    MF_CUDA_TRY(mf_quantize_fp8_weights(&q, (cudaStream_t)stream));
    q.w = w2;
    q.w_hi = NULL;
    q.split_rows = 0;
    q.rows = c->hidden;
    q.cols = c->intermediate;
    q.codes = out->w2;
    q.scale = out->w2_scale;
    q.codes_t = out->w2t;
    q.scale_t = out->w2t_scale;
    MF_CUDA_TRY(mf_quantize_fp8_weights(&q, (cudaStream_t)stream));
    return MOEFUSE_OK;
}

static void memory(const moefuse_layer *layer, moefuse_memory *m) {
    const mf_sizes &z = state_of(layer)->sizes;
    if (!layer->comm) {
        mf_memory_from_sizes(&z, z.rows_bufs, 0, m);
        return;
    }
    const mf_pool &pool = layer->comm->pools[layer->cfg.rank];
    mf_memory_from_sizes(&z, pool.bytes, pool.num_layers, m);
}

static const mf_backend_ops kCudaOps = {
    "cuda", create, destroy, saved_bytes, forward, backward, check, quantize_weights, memory,
};

}  // namespace pipeline
}  // namespace mf

extern "C" const mf_backend_ops *mf_cuda_backend(void) { return &mf::pipeline::kCudaOps; }

/* The kernels' rules for the sizes (internal.h), from the sm_90 GEMMs of the precision a
 * layer of this build runs. */
extern "C" mf_tiles mf_cuda_tiles(int top_k, int intermediate, moefuse_precision precision) {
    const mf_gemm_ops *g = mf_gemm_ops_find(90, precision);
    mf_tiles t;
    t.dp_parts = g ? g->dp_parts(intermediate) : intermediate / MF_ROW_BLOCK_M;
    t.chunk_tokens = mf_plan_chunk_tokens(top_k);
    t.plan_state_bytes = sizeof(mf_plan_state);
    return t;
}
