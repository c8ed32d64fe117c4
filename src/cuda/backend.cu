/* The CUDA backend (sm_90a, R = 1): workspaces, the saved-buffer layout, and the
 * forward pipeline  plan -> dispatch -> gemm1 (SwiGLU) -> gemm2 (combine) -> reduce.
 *
 * A forward is launches on the caller's stream only: no host synchronization, no
 * allocation, no host-to-device copy, so it can be captured in a CUDA graph. The
 * workspaces (xs, act, combine, plan scratch) belong to the layer: calls on one
 * layer must be ordered (one stream, or events between streams). What the backward
 * needs goes to the caller's `saved` buffer, so several forwards may be in flight
 * before their backwards.
 *
 * Saved buffer (moefuse_saved_bytes(T)), each section at a 256-byte boundary:
 *   header           int32[16]  see kHeader* below; num_rows at word 9
 *   expert_counts    int32[E_local]
 *   expert_offsets   int32[E_local + 1]
 *   row_block_expert int32[rows_cap / 128]
 *   slot_row         int32[T * K]
 *   row_slot         int32[rows_cap]
 *   gate_up          bf16 [rows_cap, 2I]   MOEFUSE_SAVE_ACTIVATIONS only
 * with rows_cap = roundup(T*K + 127 * min(E_local, T*K), 128), the most rows the
 * padded layout can take. Bytes per token: 8K (slot_row + row_slot) + 4KI (gate_up,
 * K rows of 2I bf16) + K/32 (row_block_expert): qwen3-30b-a3b 64 + 24576 = 24,640 B,
 * qwen3-235b-a22b 64 + 49152 = 49,216 B; plus at most 127 * min(E_local, T*K) padding
 * rows of 4 + 4I bytes, and the header and counts (under 2 KB at E = 128).
 * (This layout is the contract with the CUDA backward; move it to a header shared
 * with it when that exists.) */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "internal.h"
#include "kernels.h"

namespace {

/* ---- layout ------------------------------------------------------------------------ */

enum {
    kHeaderMagic = 0,        /* kSavedMagic */
    kHeaderVersion = 1,
    kHeaderTokens = 2,
    kHeaderTopK = 3,
    kHeaderLocalExperts = 4,
    kHeaderHidden = 5,
    kHeaderIntermediate = 6,
    kHeaderRowsCap = 7,
    kHeaderSavedMode = 8,
    kHeaderNumRows = 9,      /* written by the plan on the device */
    kHeaderWords = 16,
};
constexpr int32_t kSavedMagic = 0x5653464d;  /* "MFSV" */
constexpr int32_t kSavedVersion = 1;

struct saved_layout {
    size_t header, counts, offsets, row_block_expert, slot_row, row_slot, gate_up, total;
    int rows_cap;
};

size_t align256(size_t n) { return (n + 255) & ~(size_t)255; }

int rows_cap_for(const moefuse_layer *layer, int num_tokens) {
    const int64_t slots = (int64_t)num_tokens * layer->cfg.top_k;
    const int64_t experts = slots < layer->num_local_experts ? slots : layer->num_local_experts;
    const int64_t rows = slots + (int64_t)(MF_SM90_BLOCK_M - 1) * experts;
    return (int)((rows + MF_SM90_BLOCK_M - 1) / MF_SM90_BLOCK_M * MF_SM90_BLOCK_M);
}

saved_layout layout_for(const moefuse_layer *layer, int num_tokens, bool with_gate_up) {
    saved_layout s;
    const int EL = layer->num_local_experts;
    s.rows_cap = rows_cap_for(layer, num_tokens);
    size_t at = 0;
    s.header = at;           at += align256(kHeaderWords * sizeof(int32_t));
    s.counts = at;           at += align256((size_t)EL * sizeof(int32_t));
    s.offsets = at;          at += align256((size_t)(EL + 1) * sizeof(int32_t));
    s.row_block_expert = at; at += align256((size_t)(s.rows_cap / MF_SM90_BLOCK_M) * sizeof(int32_t));
    s.slot_row = at;         at += align256((size_t)num_tokens * layer->cfg.top_k * sizeof(int32_t));
    s.row_slot = at;         at += align256((size_t)s.rows_cap * sizeof(int32_t));
    s.gate_up = at;
    if (with_gate_up)
        at += align256((size_t)s.rows_cap * 2 * layer->cfg.intermediate * sizeof(uint16_t));
    s.total = at;
    return s;
}

/* ---- state ------------------------------------------------------------------------- */

struct cuda_state {
    int device;
    int num_sms;
    uint16_t *xs;               /* [rows_cap(max_tokens), H] */
    uint16_t *act;              /* [rows_cap(max_tokens), I] */
    uint16_t *combine;          /* [max_tokens * K, H] */
    int32_t *slot_rank;         /* [max_tokens * K] */
    int32_t *chunk_base;        /* [chunks(max_tokens), E_local] */
    mf_plan_state *plan_state;  /* error record and per-call flags */
    int32_t *gemm_num_rows;     /* device scalar */
    void *plan_ws;              /* layout_for(max_tokens, no gate_up): the plan when saved = NULL */
};

cuda_state *state_of(const moefuse_layer *layer) { return (cuda_state *)layer->backend; }

void free_state(cuda_state *s) {
    if (!s) return;
    void *bufs[] = {s->xs, s->act, s->combine, s->slot_rank, s->chunk_base, s->plan_state,
                    s->gemm_num_rows, s->plan_ws};
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

/* ---- ops --------------------------------------------------------------------------- */

moefuse_status cuda_create_checked(moefuse_layer *layer, cuda_state *s) {
    const moefuse_config *c = &layer->cfg;
    if (c->precision != MOEFUSE_PRECISION_BF16)
        return mf_fail(MOEFUSE_ERR_UNSUPPORTED,
                       "config.precision = %d: the CUDA backend runs MOEFUSE_PRECISION_BF16 "
                       "only so far", (int)c->precision);
    if (c->num_ranks != 1)
        return mf_fail(MOEFUSE_ERR_UNSUPPORTED,
                       "config.num_ranks = %d: the CUDA backend runs one rank only so far "
                       "(expert parallelism is not built); expected 1", c->num_ranks);
    if (c->hidden % 8 != 0 || c->intermediate % 8 != 0)
        return mf_fail(MOEFUSE_ERR_UNSUPPORTED,
                       "config.hidden = %d, config.intermediate = %d: the CUDA backend "
                       "moves 16-byte vectors; expected multiples of 8",
                       c->hidden, c->intermediate);

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

    const int K = c->top_k, EL = layer->num_local_experts;
    int smem_optin = 0;
    MF_CUDA_TRY(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                       s->device));
    const size_t plan_smem = mf_plan_smem_bytes(K, EL);
    if (plan_smem > (size_t)smem_optin)
        return mf_fail(MOEFUSE_ERR_UNSUPPORTED,
                       "config.num_experts = %d, top_k = %d: the GPU plan needs %zu bytes of "
                       "shared memory per block, the device allows %d",
                       c->num_experts, K, plan_smem, smem_optin);
    MF_CUDA_TRY(mf_plan_prepare(K, EL));

    const int T = c->max_tokens;
    const int64_t rows_cap = rows_cap_for(layer, T);
    const int tb = mf_plan_chunk_tokens(K);
    const int64_t chunks = (T + tb - 1) / tb;
    moefuse_status st;
#define ALLOC(field, bytes)                                                    \
    if ((st = alloc((void **)&s->field, (size_t)(bytes), #field)) != MOEFUSE_OK) return st;
    ALLOC(xs, rows_cap * c->hidden * 2)
    ALLOC(act, rows_cap * c->intermediate * 2)
    ALLOC(combine, (int64_t)T * K * c->hidden * 2)
    ALLOC(slot_rank, (int64_t)T * K * 4)
    ALLOC(chunk_base, (chunks > 0 ? chunks : 1) * EL * 4)
    ALLOC(plan_state, sizeof(mf_plan_state))
    ALLOC(gemm_num_rows, sizeof(int32_t))
    ALLOC(plan_ws, layout_for(layer, T, false).total)
#undef ALLOC
    const mf_plan_state init = MF_PLAN_STATE_INIT;
    MF_CUDA_TRY(cudaMemcpy(s->plan_state, &init, sizeof init, cudaMemcpyHostToDevice));
    MF_CUDA_TRY(cudaMemset(s->gemm_num_rows, 0, sizeof(int32_t)));
    return MOEFUSE_OK;
}

moefuse_status cuda_create(moefuse_layer *layer) {
    cuda_state *s = (cuda_state *)calloc(1, sizeof(cuda_state));
    if (!s) return mf_fail(MOEFUSE_ERR_NO_MEMORY, "moefuse_layer_create: out of host memory");
    const moefuse_status st = cuda_create_checked(layer, s);
    if (st != MOEFUSE_OK) {
        free_state(s);
        return st;
    }
    layer->backend = s;
    return MOEFUSE_OK;
}

void cuda_destroy(moefuse_layer *layer) {
    free_state(state_of(layer));
    layer->backend = NULL;
}

size_t cuda_saved_bytes(const moefuse_layer *layer, int num_tokens) {
    return layout_for(layer, num_tokens, layer->cfg.saved_mode == MOEFUSE_SAVE_ACTIVATIONS)
        .total;
}

moefuse_status cuda_forward(moefuse_layer *layer, const moefuse_fwd_args *a, void *stream_) {
    cuda_state *s = state_of(layer);
    const cudaStream_t stream = (cudaStream_t)stream_;
    const moefuse_config *c = &layer->cfg;
    const int T = a->num_tokens, K = c->top_k, EL = layer->num_local_experts;
    const bool save_act = a->saved && c->saved_mode == MOEFUSE_SAVE_ACTIVATIONS;

    // ---- 1. plan: into the caller's saved buffer, else into the workspace ----
    const saved_layout lay = layout_for(layer, T, save_act);
    char *plan_base = a->saved ? (char *)a->saved : (char *)s->plan_ws;
    mf_plan_params pp;
    memset(&pp, 0, sizeof pp);
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
    pp.header_words[kHeaderMagic] = kSavedMagic;
    pp.header_words[kHeaderVersion] = kSavedVersion;
    pp.header_words[kHeaderTokens] = T;
    pp.header_words[kHeaderTopK] = K;
    pp.header_words[kHeaderLocalExperts] = EL;
    pp.header_words[kHeaderHidden] = c->hidden;
    pp.header_words[kHeaderIntermediate] = c->intermediate;
    pp.header_words[kHeaderRowsCap] = lay.rows_cap;
    pp.header_words[kHeaderSavedMode] = save_act ? MOEFUSE_SAVE_ACTIVATIONS : MOEFUSE_RECOMPUTE;
    MF_CUDA_TRY(mf_plan_build_cuda(&pp, stream));
    if (T == 0) return MOEFUSE_OK;  // the plan wrote expert_counts = 0; y has no rows
    const int32_t *call_failed = &s->plan_state->call_failed;

    // ---- 2. dispatch: x rows -> expert-sorted xs ----
    mf_dispatch_params dp;
    dp.x = a->x;
    dp.x_stride = a->x_stride;
    dp.row_slot = pp.row_slot;
    dp.num_rows = s->gemm_num_rows;
    dp.call_failed = call_failed;
    dp.xs = s->xs;
    dp.rows_cap = lay.rows_cap;
    dp.hidden = c->hidden;
    dp.top_k = K;
    dp.num_sms = s->num_sms;
    MF_CUDA_TRY(mf_dispatch_rows_bf16(&dp, stream));

    // ---- 3. gemm1 + SwiGLU: xs -> act (and [g; u] into saved) ----
    // On bad ids gemm_num_rows is 0: the gemms touch nothing.
    mf_gemm1_params g1;
    g1.xs = s->xs;
    g1.w13 = a->w13;
    g1.row_block_expert = pp.row_block_expert;
    g1.num_rows = s->gemm_num_rows;
    g1.act = s->act;
    g1.gate_up = save_act ? (uint16_t *)((char *)a->saved + lay.gate_up) : NULL;
    g1.rows_cap = lay.rows_cap;
    g1.hidden = c->hidden;
    g1.intermediate = c->intermediate;
    g1.num_local_experts = EL;
    g1.num_sms = s->num_sms;
    MF_CUDA_TRY(mf_sm90_gemm1_swiglu_fwd_bf16(&g1, stream));

    // ---- 4. gemm2 + combine: act -> p-scaled slot rows of combine ----
    mf_gemm2_params g2;
    g2.act = s->act;
    g2.w2 = a->w2;
    g2.row_block_expert = pp.row_block_expert;
    g2.num_rows = s->gemm_num_rows;
    g2.row_slot = pp.row_slot;
    g2.slot_weight = a->weights;
    g2.combine = s->combine;
    g2.rows_cap = lay.rows_cap;
    g2.hidden = c->hidden;
    g2.intermediate = c->intermediate;
    g2.num_local_experts = EL;
    g2.num_sms = s->num_sms;
    MF_CUDA_TRY(mf_sm90_gemm2_combine_fwd_bf16(&g2, stream));

    // ---- 5. reduce: y[t] = sum of its K slot rows, fp32, k order ----
    mf_reduce_params rp;
    rp.combine = s->combine;
    rp.ids = a->ids;
    rp.call_failed = call_failed;
    rp.y = a->y;
    rp.y_stride = a->y_stride;
    rp.num_tokens = T;
    rp.top_k = K;
    rp.hidden = c->hidden;
    MF_CUDA_TRY(mf_reduce_slots_bf16(&rp, stream));
    return MOEFUSE_OK;
}

moefuse_status cuda_backward(moefuse_layer *layer, const moefuse_bwd_args *a, void *stream) {
    (void)layer;
    (void)a;
    (void)stream;
    return mf_fail(MOEFUSE_ERR_UNSUPPORTED,
                   "moefuse_backward: the CUDA backward is not built yet (issue 4); use "
                   "MOEFUSE_BACKEND_CPU");
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
    return mf_fail(MOEFUSE_ERR_CUDA, "moefuse_layer_check: unexpected device error record %d",
                   rec.code);
}

const mf_backend_ops kCudaOps = {
    "cuda", cuda_create, cuda_destroy, cuda_saved_bytes, cuda_forward, cuda_backward, cuda_check,
};

}  // namespace

extern "C" const mf_backend_ops *mf_cuda_backend(void) { return &kCudaOps; }
