/* The CPU backend: the pipeline of DESIGN.md section 2 with R = 1, in fp32 on the
 * host, GEMMs through OpenBLAS. (Longer than 500 lines: both directions, both precisions
 * and the saved format share one set of GEMM calls and row tasks here, which is what
 * makes a recomputing backward repeat the forward bit for bit.)
 *
 * Forward:  plan -> dispatch (gather x rows into expert-sorted Xs) -> gemm1 + SwiGLU
 *           -> gemm2 scaled by p into per-slot rows -> reduce over k in fixed order.
 * Backward: dispatch dy with the saved plan -> da' = dy W2_e, dp, SwiGLU backward
 *           -> dx slot rows = [dg;du] W13_e -> reduce; dW2_e, dW13_e as GEMMs over
 *           each expert's rows.
 *
 * Rounding points are the GPU's: [g;u] and a are stored as bf16 (and every later use
 * reads the rounded values), [dg;du] is rounded to bf16 before both of its GEMMs,
 * y and dx are rounded once after the fp32 reduce, bf16 weight gradients once after
 * their fp32 GEMM. Everything else is fp32.
 *
 * Threads: one OpenMP team per call. Work is cut into tasks whose boundaries depend
 * only on the plan and the shapes, never on the thread count, and every output
 * element is produced by one task in a fixed order, so results are bitwise the same
 * run to run and for any cfg.num_threads. Each task calls single-threaded sgemm
 * (OpenBLAS-openmp runs one thread inside a parallel region). With M = T*K/E rows
 * per expert that beats a serial loop of threaded sgemms: qwen3-30b-a3b fwd+bwd on
 * 2 cores (EPYC, OpenBLAS 0.3.21) took 1.1 / 1.4 / 1.8 / 2.9 s at T = 128 / 256 /
 * 512 / 1024 this way against 2.7 / 2.5 / 2.9 / 4.7 s with threaded sgemm.
 *
 * Weights are bf16 and OpenBLAS has no bf16 GEMM here, so each GEMM converts its
 * weight operand in column/row blocks of about 1 MiB into a per-thread fp32 scratch
 * that stays in L2 while sgemm consumes it; the bf16 weights are read once per use
 * and no whole-expert fp32 copy ever goes to memory.
 *
 * FP8_BLOCK (docs/decisions/0018-fp8-block-recipe.md): the same pipeline on quantized
 * values. Each GEMM's activation operand is quantized in place (or in `aux` where the
 * unquantized values are still needed) and replaced by decode(code) * scale, the weights
 * are decoded from the caller's FP8 copies (dgrad from W^T, as on the GPU), and the
 * weight-gradient operands are quantized in tiles of 128 rows of each expert once every
 * row task is done; then the same fp32 sgemm. Rounding points as for bf16.
 *
 * One call at a time per layer: the workspaces live in the layer. */
#include "fp8.h"
#include "internal.h"

#include <cblas.h>
/* OpenBLAS's cblas.h pulls in <complex.h>, whose macro I would eat the intermediate
 * size; nothing here uses complex numbers. */
#undef I
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

/* ---- sizes ------------------------------------------------------------------------ */

/* Rows per forward/backward row task. An expert with more rows is split so that a
 * skewed routing (everything on one expert) still keeps all threads busy; each task
 * re-reads the expert's weights, which at 256 rows costs well under 1% of its FLOPs. */
enum { ROW_TASK_ROWS = 256 };
/* Output rows per weight-gradient task (of 2I for dW13, of H for dW2). */
enum { WGRAD_CHUNK = 64 };
/* fp32 elements of one converted weight block: 1 MiB, the L2 of one core here. */
enum { WBLOCK_ELEMS = 1 << 18 };

static int64_t max_i64(int64_t a, int64_t b) { return a > b ? a : b; }
static size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

/* ---- state ------------------------------------------------------------------------ */

typedef struct row_task {
    int32_t expert;     /* local expert */
    int32_t row_begin;  /* first row (expert-sorted) */
    int32_t row_end;    /* one past the last */
} row_task;

typedef struct thread_scratch {
    float *wblock;      /* [wblock_elems] a converted block of one weight matrix */
    float *wgrad;       /* [WGRAD_CHUNK, max(H, I)] one weight-gradient chunk (accumulate,
                         * bf16 outputs) */
    float *row;         /* [max(H, 2I)] one fp32 row (reduce, SwiGLU) */
    uint16_t *row16;    /* [max(H, 2I)] the same row rounded to bf16 */
} thread_scratch;

typedef struct cpu_state {
    int num_threads;        /* team size of every parallel region */
    int64_t wblock_elems;   /* fp32 elements of each thread's weight block */
    int64_t max_rows;       /* max_tokens * K: no padding on the CPU (row_align 1) */
    /* plan arrays for forwards called without a saved buffer */
    int32_t *counts;        /* [E_local] */
    int32_t *offsets;       /* [E_local + 1] */
    int32_t *slot_row;      /* [max_rows] */
    int32_t *row_slot;      /* [max_rows] */
    /* expert-sorted fp32 rows */
    float *xs;              /* [max_rows, H]  x rows; in the forward then p * o rows */
    float *dys;             /* [max_rows, H]  dy rows, then p * dy rows */
    float *dxs;             /* [max_rows, H]  dx slot rows */
    float *gu;              /* [max_rows, 2I] [g;u] (bf16 values), then [dg;du] (bf16 values) */
    float *act;             /* [max_rows, I]  da', then a (bf16 values) */
    float *aux;             /* FP8: [max_rows, max(H, 2I)] a GEMM operand's quantized copy */
    int64_t aux_ld;         /* max(H, 2I): row r of aux is every task's own */
    row_task *tasks;        /* [E_local + max_rows / ROW_TASK_ROWS + 1] */
    thread_scratch *ts;     /* [num_threads] */
} cpu_state;

/* ---- the saved buffer ---------------------------------------------------------------
 * [header | expert_counts | expert_offsets | slot_row | row_slot | [g;u] rows]
 * The header names the layer's identity and T; backward refuses anything else.
 * [g;u] (every mode but RECOMPUTE) is bf16 [T*K, 2I] in plan row order: this backend
 * takes MOEFUSE_SAVE_ACTIVATIONS_AND_INPUTS as SAVE_ACTIVATIONS (its gather of x rows
 * is cheap beside its GEMMs, so it does not keep them). */

#define SAVED_MAGIC 0x3143464du /* "MFC1" */
#define SAVED_VERSION 1u

typedef struct saved_header {
    uint32_t magic;
    uint32_t version;
    int32_t num_tokens;
    int32_t top_k;
    int32_t hidden;
    int32_t intermediate;
    int32_t num_experts;
    int32_t num_ranks;
    int32_t rank;
    int32_t num_local_experts;
    int32_t saved_mode;
    int32_t precision;
    int32_t num_rows;
    int32_t reserved;
    uint64_t checksum;      /* FNV-1a over everything above */
} saved_header;

typedef struct saved_layout {
    size_t counts, offsets, slot_row, row_slot, gu; /* byte offsets */
    size_t total;
} saved_layout;

static saved_layout layout_for(const moefuse_layer *layer, int num_tokens) {
    int64_t slots = (int64_t)num_tokens * layer->cfg.top_k;
    int64_t el = layer->num_local_experts;
    saved_layout l;
    l.counts = align_up(sizeof(saved_header), 256);
    l.offsets = align_up(l.counts + sizeof(int32_t) * (size_t)el, 64);
    l.slot_row = align_up(l.offsets + sizeof(int32_t) * (size_t)(el + 1), 64);
    l.row_slot = align_up(l.slot_row + sizeof(int32_t) * (size_t)slots, 64);
    l.gu = align_up(l.row_slot + sizeof(int32_t) * (size_t)slots, 256);
    l.total = l.gu;
    if (layer->cfg.saved_mode != MOEFUSE_RECOMPUTE)
        l.total += sizeof(uint16_t) * (size_t)slots * 2 * (size_t)layer->cfg.intermediate;
    return l;
}

static uint64_t header_checksum(const saved_header *h) {
    const unsigned char *b = (const unsigned char *)h;
    uint64_t x = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < offsetof(saved_header, checksum); i++) {
        x ^= b[i];
        x *= 0x100000001b3ull;
    }
    return x;
}

static saved_header header_for(const moefuse_layer *layer, int num_tokens, int num_rows) {
    saved_header h;
    memset(&h, 0, sizeof h);
    h.magic = SAVED_MAGIC;
    h.version = SAVED_VERSION;
    h.num_tokens = num_tokens;
    h.top_k = layer->cfg.top_k;
    h.hidden = layer->cfg.hidden;
    h.intermediate = layer->cfg.intermediate;
    h.num_experts = layer->cfg.num_experts;
    h.num_ranks = layer->cfg.num_ranks;
    h.rank = layer->cfg.rank;
    h.num_local_experts = layer->num_local_experts;
    h.saved_mode = (int32_t)layer->cfg.saved_mode;
    h.precision = (int32_t)layer->cfg.precision;
    h.num_rows = num_rows;
    h.checksum = header_checksum(&h);
    return h;
}

/* A read-only view of a plan (the saved buffer's is const). */
typedef struct plan_view {
    int num_rows;
    const int32_t *counts;    /* [E_local] */
    const int32_t *offsets;   /* [E_local + 1] */
    const int32_t *slot_row;  /* [T * K] */
    const int32_t *row_slot;  /* [num_rows] */
} plan_view;

/* Refuses a saved buffer that this layer's forward with T tokens did not write, or
 * whose plan does not describe `ids`: the backward indexes with the plan, so a stale
 * or foreign one must fail cleanly instead of reading out of bounds. */
static moefuse_status check_saved(const moefuse_layer *layer, const moefuse_bwd_args *a,
                                  plan_view *view) {
    const unsigned char *base = a->saved;
    saved_header h;
    memcpy(&h, base, sizeof h);
    if (h.magic != SAVED_MAGIC || h.version != SAVED_VERSION || h.checksum != header_checksum(&h))
        return mf_fail(MOEFUSE_ERR_SAVED_STATE,
                       "bwd_args.saved: no header of a moefuse CPU forward (magic 0x%08x, "
                       "version %u); expected the buffer a forward of this layer filled",
                       h.magic, h.version);
    saved_header want = header_for(layer, a->num_tokens, h.num_rows);
    if (h.num_tokens != want.num_tokens)
        return mf_fail(MOEFUSE_ERR_SAVED_STATE,
                       "bwd_args.saved: written by a forward of %d tokens; expected "
                       "bwd_args.num_tokens = %d tokens", h.num_tokens, a->num_tokens);
    if (memcmp(&h, &want, offsetof(saved_header, checksum)) != 0)
        return mf_fail(MOEFUSE_ERR_SAVED_STATE,
                       "bwd_args.saved: written by a layer with H=%d I=%d E=%d K=%d R=%d "
                       "rank=%d saved_mode=%d; expected H=%d I=%d E=%d K=%d R=%d rank=%d "
                       "saved_mode=%d", h.hidden, h.intermediate, h.num_experts, h.top_k,
                       h.num_ranks, h.rank, h.saved_mode, want.hidden, want.intermediate,
                       want.num_experts, want.top_k, want.num_ranks, want.rank,
                       want.saved_mode);

    saved_layout l = layout_for(layer, a->num_tokens);
    int el = layer->num_local_experts;
    int64_t slots = (int64_t)a->num_tokens * layer->cfg.top_k;
    view->num_rows = h.num_rows;
    view->counts = (const int32_t *)(base + l.counts);
    view->offsets = (const int32_t *)(base + l.offsets);
    view->slot_row = (const int32_t *)(base + l.slot_row);
    view->row_slot = (const int32_t *)(base + l.row_slot);

    /* Segments tile [0, num_rows); every routed local slot owns one row of its
     * expert's segment and the row points back; as many routed slots as rows. */
    int ok = h.num_rows >= 0 && h.num_rows <= slots && view->offsets[0] == 0;
    for (int e = 0; ok && e < el; e++)
        ok = view->counts[e] >= 0 && view->offsets[e + 1] == view->offsets[e] + view->counts[e];
    ok = ok && view->offsets[el] == h.num_rows;
    int64_t routed = 0;
    for (int64_t s = 0; ok && s < slots; s++) {
        int e = a->ids[s] - layer->expert_begin;
        int32_t r = view->slot_row[s];
        if (a->ids[s] < 0 || e < 0 || e >= el) {
            ok = r == -1;
            continue;
        }
        ok = r >= view->offsets[e] && r < view->offsets[e + 1] && view->row_slot[r] == s;
        routed++;
    }
    if (!ok || routed != h.num_rows)
        return mf_fail(MOEFUSE_ERR_SAVED_STATE,
                       "bwd_args.saved: its routing plan does not match bwd_args.ids; "
                       "expected the saved buffer of the forward that took these ids");
    return MOEFUSE_OK;
}

/* ---- create / destroy ------------------------------------------------------------- */

static void *alloc64(size_t bytes) {
    return aligned_alloc(64, align_up(bytes ? bytes : 1, 64));
}

static void cpu_destroy(moefuse_layer *layer) {
    cpu_state *st = layer->backend;
    if (!st) return;
    free(st->counts);
    free(st->offsets);
    free(st->slot_row);
    free(st->row_slot);
    free(st->xs);
    free(st->dys);
    free(st->dxs);
    free(st->gu);
    free(st->act);
    free(st->aux);
    free(st->tasks);
    if (st->ts) {
        for (int i = 0; i < st->num_threads; i++) {
            free(st->ts[i].wblock);
            free(st->ts[i].wgrad);
            free(st->ts[i].row);
            free(st->ts[i].row16);
        }
        free(st->ts);
    }
    free(st);
    layer->backend = NULL;
}

/* Workspaces for max_tokens, so that forward and backward never allocate:
 * (3H + 3I) * 4 bytes per routed slot (max_tokens * K of them), plus per thread a
 * weight block (1 MiB, or 16 rows of the widest weight) and 66 rows of max(H, 2I)
 * fp32 for the weight-gradient chunk and the row scratch. */
static moefuse_status cpu_create(moefuse_layer *layer) {
    const moefuse_config *c = &layer->cfg;
    cpu_state *st = calloc(1, sizeof *st);
    if (!st) return mf_fail(MOEFUSE_ERR_NO_MEMORY, "CPU backend: out of host memory");
    layer->backend = st;

    int64_t H = c->hidden, I = c->intermediate, el = layer->num_local_experts;
    int64_t rows = (int64_t)c->max_tokens * c->top_k;
    int64_t wide = max_i64(H, 2 * I);
    st->num_threads = c->num_threads > 0 ? c->num_threads : omp_get_num_procs();
    st->max_rows = rows;
    /* At least 16 whole rows or columns of any weight, so that every block is a GEMM
     * of useful width even for a huge H. */
    st->wblock_elems = max_i64(WBLOCK_ELEMS, 16 * wide);
    st->counts = alloc64(sizeof(int32_t) * (size_t)el);
    st->offsets = alloc64(sizeof(int32_t) * (size_t)(el + 1));
    st->slot_row = alloc64(sizeof(int32_t) * (size_t)rows);
    st->row_slot = alloc64(sizeof(int32_t) * (size_t)rows);
    st->xs = alloc64(sizeof(float) * (size_t)(rows * H));
    st->dys = alloc64(sizeof(float) * (size_t)(rows * H));
    st->dxs = alloc64(sizeof(float) * (size_t)(rows * H));
    st->gu = alloc64(sizeof(float) * (size_t)(rows * 2 * I));
    st->act = alloc64(sizeof(float) * (size_t)(rows * I));
    if (c->precision == MOEFUSE_PRECISION_FP8_BLOCK)
        st->aux = alloc64(sizeof(float) * (size_t)(rows * wide));
    st->aux_ld = wide;
    st->tasks = alloc64(sizeof(row_task) * (size_t)(el + rows / ROW_TASK_ROWS + 1));
    st->ts = calloc((size_t)st->num_threads, sizeof *st->ts);
    int ok = st->counts && st->offsets && st->slot_row && st->row_slot && st->xs && st->dys &&
             st->dxs && st->gu && st->act && st->tasks && st->ts &&
             (st->aux || c->precision != MOEFUSE_PRECISION_FP8_BLOCK);
    for (int i = 0; ok && i < st->num_threads; i++) {
        thread_scratch *t = &st->ts[i];
        t->wblock = alloc64(sizeof(float) * (size_t)st->wblock_elems);
        t->wgrad = alloc64(sizeof(float) * (size_t)(WGRAD_CHUNK * max_i64(H, I)));
        t->row = alloc64(sizeof(float) * (size_t)wide);
        t->row16 = alloc64(sizeof(uint16_t) * (size_t)wide);
        ok = t->wblock && t->wgrad && t->row && t->row16;
    }
    if (!ok) {
        cpu_destroy(layer);
        return mf_fail(MOEFUSE_ERR_NO_MEMORY,
                       "CPU backend: out of host memory for the workspaces of max_tokens = "
                       "%d (about %lld MiB)", c->max_tokens,
                       (long long)((rows * (3 * H + 3 * I) * 4) >> 20));
    }
    return MOEFUSE_OK;
}

static size_t cpu_saved_bytes(const moefuse_layer *layer, int num_tokens) {
    return layout_for(layer, num_tokens).total;
}

/* ---- GEMMs with a bf16 weight operand ---------------------------------------------- */

/* Width of a weight block: as many whole output columns as fit the thread's block,
 * a multiple of 16 (the sgemm micro-tile) unless it is all of n. A function of the
 * shape only, so the forward and a recomputing backward make identical calls. */
static int block_width(int64_t k, int n, int64_t wblock_elems) {
    int64_t nb = wblock_elems / k;
    if (nb >= n) return n;
    nb = nb / 16 * 16;
    return (int)(nb < 16 ? 16 : nb);
}

/* One expert's weight matrix [n, k] as stored: bf16, or FP8 codes with 128x128 block
 * scales [ceil(n/128), ceil(k/128)]. bf16 W13 in two halves (moefuse.h): rows up_row..
 * are rows 0.. of bf16_up. */
typedef struct weight_src {
    const uint16_t *bf16;
    const uint16_t *bf16_up;   /* NULL: all n rows at bf16 */
    int64_t up_row;
    const uint8_t *fp8;
    const float *scale;
} weight_src;

/* Row r of a bf16 weight [n, k]. */
static const uint16_t *bf16_row(weight_src W, int64_t r, int64_t k) {
    return W.bf16_up && r >= W.up_row ? W.bf16_up + (r - W.up_row) * k : W.bf16 + r * k;
}

/* The caller's bf16 weights: W13 packed (w13_up NULL) or in two halves, and W2. */
typedef struct bf16_weights {
    const uint16_t *w13, *w13_up, *w2;
} bf16_weights;

enum { W13, W13T, W2, W2T };

/* Expert e's W13 [2I, H], W13^T [H, 2I], W2 [H, I] or W2^T [I, H]; the ^T ones exist in
 * FP8 only. */
static weight_src weight_of(const moefuse_layer *layer, bf16_weights b,
                            const moefuse_fp8_weights *f8, int which, int e) {
    const int64_t H = layer->cfg.hidden, I = layer->cfg.intermediate, T = MF_FP8_TILE;
    const int64_t n13 = 2 * I * H, n2 = H * I;
    const int64_t s13 = (2 * I + T - 1) / T * ((H + T - 1) / T), s2 = (H + T - 1) / T * ((I + T - 1) / T);
    weight_src w = {NULL, NULL, 0, NULL, NULL};
    if (!f8) {
        if (which != W13) {
            w.bf16 = b.w2 + e * n2;
        } else if (b.w13_up) {
            w.bf16 = b.w13 + e * I * H;
            w.bf16_up = b.w13_up + e * I * H;
            w.up_row = I;
        } else {
            w.bf16 = b.w13 + e * n13;
        }
        return w;
    }
    switch (which) {
    case W13: w.fp8 = f8->w13 + e * n13; w.scale = f8->w13_scale + e * s13; break;
    case W13T: w.fp8 = f8->w13t + e * n13; w.scale = f8->w13t_scale + e * s13; break;
    case W2: w.fp8 = f8->w2 + e * n2; w.scale = f8->w2_scale + e * s2; break;
    default: w.fp8 = f8->w2t + e * n2; w.scale = f8->w2t_scale + e * s2; break;
    }
    return w;
}

/* C = A W^T: A fp32 [m, k] (row stride lda), W [n, k] ([out, in], as the weights are
 * stored), C fp32 [m, n] (row stride ldc). W is converted a block of whole rows at a
 * time; each block's sgemm reduces over all of k, so no output is a sum of partial
 * GEMMs. */
static void gemm_a_wt(int m, int n, int k, const float *A, int64_t lda,
                      weight_src W, float *C, int64_t ldc,
                      float *wblock, int64_t wblock_elems) {
    int nb = block_width(k, n, wblock_elems);
    for (int c0 = 0; c0 < n; c0 += nb) {
        int w = n - c0 < nb ? n - c0 : nb;
        if (W.bf16 && (!W.bf16_up || c0 + w <= W.up_row || c0 >= W.up_row))
            mf_bf16_to_float_n(bf16_row(W, c0, k), wblock, (int64_t)w * k);
        else if (W.bf16)   /* rows of both halves */
            for (int64_t r = 0; r < w; r++)
                mf_bf16_to_float_n(bf16_row(W, c0 + r, k), wblock + r * k, k);
        else
            mf_fp8_dequant_block_rows(W.fp8, W.scale, k, c0, w, wblock);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, w, k, 1.0f, A, (int)lda,
                    wblock, k, 0.0f, C + c0, (int)ldc);
    }
}

/* C = A W: A fp32 [m, k], W bf16 [k, n] (rows contiguous), C fp32 [m, n]. W is converted
 * a block of columns at a time (strided rows of it, packed to width w). */
static void gemm_a_w(int m, int n, int k, const float *A, int64_t lda,
                     weight_src W, float *C, int64_t ldc,
                     float *wblock, int64_t wblock_elems) {
    int nb = block_width(k, n, wblock_elems);
    for (int c0 = 0; c0 < n; c0 += nb) {
        int w = n - c0 < nb ? n - c0 : nb;
        for (int64_t r = 0; r < k; r++)
            mf_bf16_to_float_n(bf16_row(W, r, n) + c0, wblock + r * w, w);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, w, k, 1.0f, A, (int)lda,
                    wblock, w, 0.0f, C + c0, (int)ldc);
    }
}

/* ---- row helpers ------------------------------------------------------------------- */

static inline float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

/* One expression for a = silu(g) * u, used by the forward and the backward, so the
 * backward's recomputed a is bitwise the forward's. */
static inline float swiglu(float g, float u) { return g * sigmoid(g) * u; }

/* Rounds an fp32 row to bf16 values in place; the bf16 words land in `bits`. */
static void round_row(float *row, /* [n] */
                      uint16_t *bits, /* [n] */
                      int64_t n) {
    mf_float_to_bf16_n(row, bits, n);
    mf_bf16_to_float_n(bits, row, n);
}

/* out_t = bf16(sum over k = 0..K-1 of its slot rows), in that order, in fp32; a
 * token with no routed slot gets +0. */
static void reduce_token(const float *rows,     /* [*, H] expert-sorted slot rows */
                         const int32_t *slot_row, /* [K] rows of this token's slots */
                         int K, int64_t H,
                         float *acc,            /* [H] scratch */
                         uint16_t *out) {       /* [H] */
    for (int64_t h = 0; h < H; h++) acc[h] = 0.0f;
    for (int k = 0; k < K; k++) {
        int32_t r = slot_row[k];
        if (r < 0) continue;
        const float *src = rows + (int64_t)r * H; /* [H] */
        for (int64_t h = 0; h < H; h++) acc[h] += src[h];
    }
    mf_float_to_bf16_n(acc, out, H);
}

/* ---- tasks ------------------------------------------------------------------------ */

static int task_order(const void *pa, const void *pb) {
    const row_task *a = pa, *b = pb;
    int32_t na = a->row_end - a->row_begin, nb = b->row_end - b->row_begin;
    if (na != nb) return na > nb ? -1 : 1;
    return a->row_begin < b->row_begin ? -1 : a->row_begin > b->row_begin;
}

/* Each expert's rows in ceil(n / ROW_TASK_ROWS) near-equal pieces, largest first so
 * the dynamic schedule ends balanced. The cut depends only on the counts, so a
 * recomputing backward repeats the forward's gemm1 calls exactly. */
static int build_tasks(const plan_view *pv, int num_local_experts,
                       row_task *tasks) { /* [E_local + rows / ROW_TASK_ROWS + 1] */
    int n = 0;
    for (int e = 0; e < num_local_experts; e++) {
        int32_t rows = pv->counts[e], off = pv->offsets[e];
        if (rows == 0) continue;
        int32_t pieces = (rows + ROW_TASK_ROWS - 1) / ROW_TASK_ROWS;
        for (int32_t j = 0; j < pieces; j++) {
            tasks[n].expert = e;
            tasks[n].row_begin = off + (int32_t)((int64_t)rows * j / pieces);
            tasks[n].row_end = off + (int32_t)((int64_t)rows * (j + 1) / pieces);
            n++;
        }
    }
    qsort(tasks, (size_t)n, sizeof *tasks, task_order);
    return n;
}

/* Dispatch: the token row of every plan row, widened to fp32. */
static void gather_row(const uint16_t *src, int64_t stride, const int32_t *row_slot,
                       int K, int64_t H, int32_t r, float *dst) { /* dst [*, H] */
    int64_t t = row_slot[r] / K;
    mf_bf16_to_float_n(src + t * stride, dst + (int64_t)r * H, H);
}

/* ---- forward ---------------------------------------------------------------------- */

typedef struct fwd_ctx {
    const moefuse_layer *layer;
    cpu_state *st;
    const moefuse_fwd_args *a;
    plan_view pv;
    uint16_t *saved_gu;   /* [T*K, 2I] bf16, NULL when not saving activations */
} fwd_ctx;

/* gemm1 + SwiGLU, gemm2, scale by p, for one piece of one expert's rows. */
static void fwd_task(const fwd_ctx *c, const row_task *task, thread_scratch *ts) {
    const cpu_state *st = c->st;
    int64_t H = c->layer->cfg.hidden, I = c->layer->cfg.intermediate;
    int64_t r0 = task->row_begin;
    int m = task->row_end - task->row_begin;
    const moefuse_fp8_weights *f8 = c->a->fp8_weights;
    const bf16_weights b = {c->a->w13, c->a->w13_up, c->a->w2};
    weight_src w13 = weight_of(c->layer, b, f8, W13, task->expert);
    weight_src w2 = weight_of(c->layer, b, f8, W2, task->expert);
    const int pow2 = c->layer->cfg.fp8_pow2_scales;
    float *xs = st->xs + r0 * H;        /* [m, H] */
    float *gu = st->gu + r0 * 2 * I;    /* [m, 2I] */
    float *act = st->act + r0 * I;      /* [m, I] */

    if (f8) mf_fp8_fake_quant_rows(xs, m, H, H, pow2); /* x along H */
    gemm_a_wt(m, (int)(2 * I), (int)H, xs, H, w13, gu, 2 * I, ts->wblock, st->wblock_elems);
    for (int i = 0; i < m; i++) {
        float *gu_i = gu + i * 2 * I;   /* [2I] */
        float *a_i = act + i * I;       /* [I] */
        uint16_t *bits = c->saved_gu ? c->saved_gu + (r0 + i) * 2 * I : ts->row16;
        round_row(gu_i, bits, 2 * I);
        for (int64_t j = 0; j < I; j++) a_i[j] = swiglu(gu_i[j], gu_i[I + j]);
        round_row(a_i, ts->row16, I);
    }
    if (f8) mf_fp8_fake_quant_rows(act, m, I, I, pow2); /* a along I */
    /* o rows overwrite the x rows, which gemm1 was the last to read. */
    gemm_a_wt(m, (int)H, (int)I, act, I, w2, xs, H, ts->wblock, st->wblock_elems);
    for (int i = 0; i < m; i++) {
        float p = c->a->weights[c->pv.row_slot[r0 + i]];
        float *o_i = xs + i * H;        /* [H] */
        for (int64_t h = 0; h < H; h++) o_i[h] *= p;
    }
}

static moefuse_status cpu_forward(moefuse_layer *layer, const moefuse_fwd_args *a,
                                  void *stream) {
    (void)stream;
    cpu_state *st = layer->backend;
    const moefuse_config *cfg = &layer->cfg;
    int T = a->num_tokens, K = cfg->top_k, el = layer->num_local_experts;
    int64_t H = cfg->hidden;

    /* The plan goes straight into the saved buffer when there is one. */
    mf_plan plan;
    unsigned char *saved = a->saved;
    saved_layout l = layout_for(layer, T);
    if (saved) {
        plan.expert_counts = (int32_t *)(saved + l.counts);
        plan.expert_offsets = (int32_t *)(saved + l.offsets);
        plan.slot_row = (int32_t *)(saved + l.slot_row);
        plan.row_slot = (int32_t *)(saved + l.row_slot);
    } else {
        plan.expert_counts = st->counts;
        plan.expert_offsets = st->offsets;
        plan.slot_row = st->slot_row;
        plan.row_slot = st->row_slot;
    }
    moefuse_status s = mf_plan_build(a->ids, T, K, cfg->num_experts, layer->expert_begin, el,
                                     1, &plan);
    if (s != MOEFUSE_OK) return s;
    if (saved) {
        saved_header h = header_for(layer, T, plan.num_rows);
        memcpy(saved, &h, sizeof h);
    }
    if (a->expert_counts) {
        for (int e = 0; e < cfg->num_experts; e++) {
            int le = e - layer->expert_begin;
            a->expert_counts[e] = le >= 0 && le < el ? plan.expert_counts[le] : 0;
        }
    }

    fwd_ctx c = {
        .layer = layer, .st = st, .a = a,
        .pv = {plan.num_rows, plan.expert_counts, plan.expert_offsets, plan.slot_row,
               plan.row_slot},
        .saved_gu = saved && cfg->saved_mode != MOEFUSE_RECOMPUTE
                        ? (uint16_t *)(saved + l.gu) : NULL,
    };
    int num_tasks = build_tasks(&c.pv, el, st->tasks);
    int32_t num_rows = plan.num_rows;

#pragma omp parallel num_threads(st->num_threads)
    {
        /* Local to this region's tasks: keeps OpenBLAS single-threaded inside our
         * tasks even when the team has one thread (omp_in_parallel() is then 0). */
        omp_set_num_threads(1);
        thread_scratch *ts = &st->ts[omp_get_thread_num()];

#pragma omp for schedule(static)
        for (int32_t r = 0; r < num_rows; r++)
            gather_row(a->x, a->x_stride, c.pv.row_slot, K, H, r, st->xs);

#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < num_tasks; i++) fwd_task(&c, &st->tasks[i], ts);

#pragma omp for schedule(static)
        for (int t = 0; t < T; t++)
            reduce_token(st->xs, c.pv.slot_row + (int64_t)t * K, K, H, ts->row,
                         a->y + (int64_t)t * a->y_stride);
    }
    return MOEFUSE_OK;
}

/* ---- backward --------------------------------------------------------------------- */

typedef struct bwd_ctx {
    const moefuse_layer *layer;
    cpu_state *st;
    const moefuse_bwd_args *a;
    plan_view pv;
    const uint16_t *saved_gu; /* [T*K, 2I] bf16, NULL in MOEFUSE_RECOMPUTE */
} bwd_ctx;

/* [g;u] (saved or recomputed), da' = dy W2_e, dp and the SwiGLU backward, p * dy,
 * dx slot rows = [dg;du] W13_e, for one piece of one expert's rows. */
/* FP8: rows [m, cols] (contiguous) quantized along cols into the task's rows of aux
 * (row stride cols), which are returned; the bf16 path takes the rows themselves. */
static const float *operand_rows(const cpu_state *st, const moefuse_layer *layer,
                                 const float *rows, int m, int64_t cols, int64_t r0) {
    if (layer->cfg.precision != MOEFUSE_PRECISION_FP8_BLOCK) return rows;
    float *q = st->aux + r0 * st->aux_ld; /* [m, cols] within rows r0 .. r0+m-1 of aux */
    memcpy(q, rows, sizeof(float) * (size_t)(m * cols));
    mf_fp8_fake_quant_rows(q, m, cols, cols, layer->cfg.fp8_pow2_scales);
    return q;
}

static void bwd_task(const bwd_ctx *c, const row_task *task, thread_scratch *ts) {
    const cpu_state *st = c->st;
    const moefuse_bwd_args *a = c->a;
    int64_t H = c->layer->cfg.hidden, I = c->layer->cfg.intermediate;
    int64_t r0 = task->row_begin;
    int m = task->row_end - task->row_begin;
    const moefuse_fp8_weights *f8 = a->fp8_weights;
    const int e = task->expert;
    const bf16_weights b = {a->w13, a->w13_up, a->w2};
    weight_src w13 = weight_of(c->layer, b, f8, W13, e);   /* [2I, H] */
    const float *xs = st->xs + r0 * H;  /* [m, H] */
    float *dys = st->dys + r0 * H;      /* [m, H] */
    float *dxs = st->dxs + r0 * H;      /* [m, H] */
    float *gu = st->gu + r0 * 2 * I;    /* [m, 2I] */
    float *act = st->act + r0 * I;      /* [m, I] */

    if (c->saved_gu) {
        mf_bf16_to_float_n(c->saved_gu + r0 * 2 * I, gu, m * 2 * I);
    } else {
        /* The forward's very call (same piece, same blocks), so the same bits; FP8 keeps
         * xs whole for dW13 and quantizes a copy. */
        gemm_a_wt(m, (int)(2 * I), (int)H, operand_rows(st, c->layer, xs, m, H, r0), H, w13,
                  gu, 2 * I, ts->wblock, st->wblock_elems);
        for (int i = 0; i < m; i++) round_row(gu + i * 2 * I, ts->row16, 2 * I);
    }
    if (f8) /* dgrad2 from W2^T, K-major as on the GPU */
        gemm_a_wt(m, (int)I, (int)H, operand_rows(st, c->layer, dys, m, H, r0), H,
                  weight_of(c->layer, b, f8, W2T, e), act, I, ts->wblock, st->wblock_elems);
    else
        gemm_a_w(m, (int)I, (int)H, dys, H, weight_of(c->layer, b, NULL, W2, e), act, I,
                 ts->wblock, st->wblock_elems);
    /* da' to bf16, as the CUDA backend's dgrad2 hands it to its store warps. */
    for (int i = 0; i < m; i++) round_row(act + i * I, ts->row16, I);

    for (int i = 0; i < m; i++) {
        int32_t slot = c->pv.row_slot[r0 + i];
        float p = a->weights[slot];
        float *gu_i = gu + i * 2 * I;   /* [2I] [g;u] in, [dg;du] out */
        float *act_i = act + i * I;     /* [I] da' in, a out */
        float *a_i = ts->row;           /* [I] */
        for (int64_t j = 0; j < I; j++) a_i[j] = swiglu(gu_i[j], gu_i[I + j]);
        round_row(a_i, ts->row16, I);
        float dp = 0.0f;
        for (int64_t j = 0; j < I; j++) dp += act_i[j] * a_i[j];
        for (int64_t j = 0; j < I; j++) {
            float g = gu_i[j], u = gu_i[I + j];
            float s = sigmoid(g);
            float da = p * act_i[j];
            gu_i[j] = da * u * (s * (1.0f + g * (1.0f - s)));
            gu_i[I + j] = da * (g * s);
            act_i[j] = a_i[j];
        }
        round_row(gu_i, ts->row16, 2 * I);
        a->dweights[slot] = dp;
        /* dy is done as a GEMM operand; dW2 wants p * dy. */
        float *dy_i = dys + i * H;      /* [H] */
        for (int64_t h = 0; h < H; h++) dy_i[h] *= p;
    }
    if (f8) /* dgrad1 from W13^T; gu stays whole for dW13 */
        gemm_a_wt(m, (int)H, (int)(2 * I), operand_rows(st, c->layer, gu, m, 2 * I, r0), 2 * I,
                  weight_of(c->layer, b, f8, W13T, e), dxs, H, ts->wblock, st->wblock_elems);
    else
        gemm_a_w(m, (int)H, (int)(2 * I), gu, 2 * I, w13, dxs, H, ts->wblock,
                 st->wblock_elems);
}

/* FP8: the weight-gradient operands of expert e (x, p dy, a, [dg;du] rows) quantized in
 * place in tiles of 128 rows from the expert's first row, per column; the GPU pads each
 * expert to 128 rows with zeros, which change no amax. */
static void quantize_token_tiles(const bwd_ctx *c, int e, thread_scratch *ts) {
    const cpu_state *st = c->st;
    const int64_t H = c->layer->cfg.hidden, I = c->layer->cfg.intermediate;
    const int pow2 = c->layer->cfg.fp8_pow2_scales;
    const int64_t r0 = c->pv.offsets[e], r1 = r0 + c->pv.counts[e];
    for (int64_t t = r0; t < r1; t += MF_FP8_TILE) {
        int64_t n = r1 - t < MF_FP8_TILE ? r1 - t : MF_FP8_TILE;
        mf_fp8_fake_quant_cols(st->xs + t * H, n, H, H, pow2, ts->row);
        mf_fp8_fake_quant_cols(st->dys + t * H, n, H, H, pow2, ts->row);
        mf_fp8_fake_quant_cols(st->act + t * I, n, I, I, pow2, ts->row);
        mf_fp8_fake_quant_cols(st->gu + t * 2 * I, n, 2 * I, 2 * I, pow2, ts->row);
    }
}

/* One WGRAD_CHUNK-row piece of dW13_e (rows of 2I) or dW2_e (rows of H): a GEMM
 * reducing over all of expert e's rows in one call. Accumulate mode computes the
 * same call into scratch and adds it, so accumulate is exactly old + write-mode
 * value (sgemm with beta = 1 is not: past its K block it adds partial sums to C one
 * at a time). The bf16 outputs likewise take the same call into scratch and round
 * it, so they are exactly bf16(write-mode value). */
static void wgrad_chunk(const bwd_ctx *c, int64_t idx, thread_scratch *ts) {
    const cpu_state *st = c->st;
    const moefuse_bwd_args *a = c->a;
    int64_t H = c->layer->cfg.hidden, I = c->layer->cfg.intermediate;
    int64_t c13 = (2 * I + WGRAD_CHUNK - 1) / WGRAD_CHUNK;
    int64_t c2 = (H + WGRAD_CHUNK - 1) / WGRAD_CHUNK;
    int e = (int)(idx / (c13 + c2));
    int64_t chunk = idx % (c13 + c2);
    int32_t rows = c->pv.counts[e];
    int64_t r0 = c->pv.offsets[e];

    const float *A, *B;   /* the GEMM dst[m, n] = A[rows, m]^T B[rows, n] */
    int64_t lda, n, m0, m, first; /* first: the chunk's offset in dW13 or dW2 */
    if (chunk < c13) {    /* dW13_e[m0 .. m0+m) = [dg;du][:, m0 .. m0+m)^T Xs */
        m0 = chunk * WGRAD_CHUNK;
        m = 2 * I - m0 < WGRAD_CHUNK ? 2 * I - m0 : WGRAD_CHUNK;
        n = H;
        A = st->gu + r0 * 2 * I + m0;
        lda = 2 * I;
        B = st->xs + r0 * H;
        first = (int64_t)e * 2 * I * H + m0 * H;
    } else {              /* dW2_e[m0 .. m0+m) = (p dy)[:, m0 .. m0+m)^T A */
        m0 = (chunk - c13) * WGRAD_CHUNK;
        m = H - m0 < WGRAD_CHUNK ? H - m0 : WGRAD_CHUNK;
        n = I;
        A = st->dys + r0 * H + m0;
        lda = H;
        B = st->act + r0 * I;
        first = (int64_t)e * H * I + m0 * I;
    }
    /* The host layer let through exactly one pair, and the bf16 one in write mode only.
     * The chunk's rows go to one run of rows, or to two when dW13 comes in two halves
     * (moefuse.h) and the chunk spans them: rows [0, split) to run 0, [split, m) to run 1. */
    int bf16 = a->dw13_bf16 != NULL;
    float *dst[2] = {NULL, NULL};       /* [rows, n] rows of dW13_e or dW2_e, fp32 */
    uint16_t *dst16[2] = {NULL, NULL};  /* the same rows, bf16 */
    int64_t split = m;
    if (chunk < c13 && (a->dw13_up || a->dw13_up_bf16)) {
        split = m0 >= I ? 0 : (m0 + m <= I ? m : I - m0);   /* the gate half's rows */
        const int64_t expert = (int64_t)e * I * H;
        if (split > 0) {
            if (bf16) dst16[0] = a->dw13_bf16 + expert + m0 * H;
            else dst[0] = a->dw13 + expert + m0 * H;
        }
        if (split < m) {   /* up rows from m0 + split - I */
            if (bf16) dst16[1] = a->dw13_up_bf16 + expert + (m0 + split - I) * H;
            else dst[1] = a->dw13_up + expert + (m0 + split - I) * H;
        }
    } else if (bf16) {
        dst16[0] = (chunk < c13 ? a->dw13_bf16 : a->dw2_bf16) + first;
    } else {
        dst[0] = (chunk < c13 ? a->dw13 : a->dw2) + first;
    }
    const int64_t run_rows[2] = {split, m - split};
    if (rows == 0) {
        for (int i = 0; i < 2; i++) {
            if (run_rows[i] == 0) continue;
            if (bf16) memset(dst16[i], 0, sizeof(uint16_t) * (size_t)(run_rows[i] * n)); /* +0 */
            else if (!a->accumulate) memset(dst[i], 0, sizeof(float) * (size_t)(run_rows[i] * n));
        }
        return;
    }
    const int direct = !a->accumulate && !bf16 && split == m;
    float *out = direct ? dst[0] : ts->wgrad; /* [m, n] */
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)m, (int)n, rows, 1.0f, A,
                (int)lda, B, (int)n, 0.0f, out, (int)n);
    if (direct) return;
    for (int i = 0; i < 2; i++) {
        const float *o = out + (i ? split * n : 0);
        const int64_t count = run_rows[i] * n;
        if (count == 0) continue;
        if (bf16) mf_float_to_bf16_n(o, dst16[i], count);
        else if (a->accumulate) for (int64_t j = 0; j < count; j++) dst[i][j] += o[j];
        else memcpy(dst[i], o, sizeof(float) * (size_t)count);
    }
}

static moefuse_status cpu_backward(moefuse_layer *layer, const moefuse_bwd_args *a,
                                   void *stream) {
    (void)stream;
    cpu_state *st = layer->backend;
    const moefuse_config *cfg = &layer->cfg;
    int T = a->num_tokens, K = cfg->top_k, el = layer->num_local_experts;
    int64_t H = cfg->hidden, I = cfg->intermediate;

    bwd_ctx c = {.layer = layer, .st = st, .a = a, .saved_gu = NULL};
    moefuse_status s = check_saved(layer, a, &c.pv);
    if (s != MOEFUSE_OK) return s;
    if (cfg->saved_mode != MOEFUSE_RECOMPUTE)
        c.saved_gu = (const uint16_t *)((const unsigned char *)a->saved +
                                        layout_for(layer, T).gu);
    int num_tasks = build_tasks(&c.pv, el, st->tasks);
    int32_t num_rows = c.pv.num_rows;
    int64_t num_chunks = (int64_t)el * ((2 * I + WGRAD_CHUNK - 1) / WGRAD_CHUNK +
                                        (H + WGRAD_CHUNK - 1) / WGRAD_CHUNK);

#pragma omp parallel num_threads(st->num_threads)
    {
        omp_set_num_threads(1); /* see cpu_forward */
        thread_scratch *ts = &st->ts[omp_get_thread_num()];

#pragma omp for schedule(static)
        for (int32_t r = 0; r < num_rows; r++) {
            gather_row(a->x, a->x_stride, c.pv.row_slot, K, H, r, st->xs);
            gather_row(a->dy, a->dy_stride, c.pv.row_slot, K, H, r, st->dys);
        }

#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < num_tasks; i++) bwd_task(&c, &st->tasks[i], ts);

        if (cfg->precision == MOEFUSE_PRECISION_FP8_BLOCK) {
#pragma omp for schedule(dynamic, 1)
            for (int e = 0; e < el; e++) quantize_token_tiles(&c, e, ts);
        }

#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t i = 0; i < num_chunks; i++) wgrad_chunk(&c, i, ts);

        /* Independent of the weight gradients: both only read the task outputs. */
#pragma omp for schedule(static)
        for (int t = 0; t < T; t++) {
            const int32_t *rows = c.pv.slot_row + (int64_t)t * K; /* [K] */
            reduce_token(st->dxs, rows, K, H, ts->row, a->dx + (int64_t)t * a->dx_stride);
            for (int k = 0; k < K; k++)
                if (rows[k] < 0) a->dweights[(int64_t)t * K + k] = 0.0f;
        }
    }
    return MOEFUSE_OK;
}

const mf_backend_ops mf_cpu_backend = {
    .name = "cpu",
    .create = cpu_create,
    .destroy = cpu_destroy,
    .saved_bytes = cpu_saved_bytes,
    .forward = cpu_forward,
    .backward = cpu_backward,
    .check = NULL,
};
