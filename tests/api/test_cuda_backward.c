/* The CUDA backward, through the public API with device buffers, against the fp64
 * reference (src/cpu/reference.h, mf_ref_backward) on fresh random inputs.
 *
 *   - qwen3-30b-a3b (E = 128) and qwen3-235b-a22b with E = 16 instead of 128 (the fp64
 *     weights of 128 experts are 19 GB of host memory; 16 keep H, I, K and the GEMM
 *     shapes and give each expert 8x the rows), T in {1, 7, 512, 4096 (= max)};
 *   - routing edge cases: all tokens on one expert, most experts empty, T = 1 with one
 *     slot, dropped slots with fully dropped tokens (row strides > H), Zipf;
 *   - MOEFUSE_RECOMPUTE and MOEFUSE_SAVE_ACTIVATIONS_AND_INPUTS give the bits of
 *     MOEFUSE_SAVE_ACTIVATIONS, the latter also with the fused pipeline (forward and
 *     backward);
 *   - accumulate = 1 gives exactly old + the write-mode gradient;
 *   - the fused backward (MOEFUSE_PIPELINE_FUSED: dW2, dgrad1 and dW13 in one kernel)
 *     bitwise equal to the staged one: fp32 write and accumulate, bf16 dW, five routings;
 *   - 50 repetitions bitwise identical; a CUDA graph replays to the eager bits;
 *   - a saved buffer of no forward: moefuse_layer_check reports MOEFUSE_ERR_SAVED_STATE
 *     and dx / dweights are untouched.
 *
 * How the reference stays affordable. Every gradient is a sum over slots of a slot's
 * own contribution, so the reference runs per group of slots of ONE expert
 * (mf_ref_backward with E = 1, K = 1 on that expert's fp64 weights, no copy), groups
 * in parallel, and the fp64 results are summed:
 *   dx, d p   dx_t and dp[t,:] depend only on token t: all slots of a random subset of
 *             kCheckTokens tokens (all tokens when T is smaller), dx_t = sum over k;
 *   dW        needs every row of an expert. A SECOND GPU call (forward + backward) runs
 *             with masked ids: only the slots of the kMaskExperts most loaded experts
 *             stay, at most kMaskSlots of each (the first in token order); every other
 *             slot is -1. Its dW13/dW2 of the kept experts are checked against the
 *             reference over exactly those slots, and every other expert's dW must be
 *             exactly 0 (write mode). At T = 4096 an expert of qwen3-30b-a3b keeps all
 *             its ~256 rows, i.e. the weight-gradient GEMM reduces over several 128-row
 *             blocks; the fp64 cost stays ~20 GFLOP per case.
 *
 * Tolerances th_bf16_tolerance(n), n = the bf16 roundings on each path (x, dy, p and
 * the weights are exact inputs of both sides). g and u are rounded separately and each
 * enters the result on its own, so they count as two, as in tests/cpu/test_cpu_backend.c:
 *   dx        6: g, u saved as bf16, da' = W2^T dy as bf16 (dgrad2's store warps take it
 *                so), dh = [dg;du] as bf16, each slot's dx row as bf16 (combine), dx
 *                after the fp32 sum over k;
 *   dweights  4: g, u as bf16, a = silu(g) u as bf16, da' as bf16 (d p = <da', a> in fp32);
 *             a dot product's rounding error scales with its terms, not with its sum,
 *             which may cancel: the error is relative to the l2 norm over the checked
 *             slots of ||W2^T dy o a||_2 (dp_term_norm), not to the l2 norm of d p;
 *   dW13      4: g, u as bf16, da' as bf16, dh as bf16 (xs is exact);
 *   dW2       4: g, u as bf16, a as bf16, act_p = p a as bf16 (dys is exact).
 * Errors are relative l2 over the checked elements. Outputs are poisoned (NaN) first.
 *
 * With no sm_90 device every case prints SKIP with the reason. MOEFUSE_TEST_PIPELINE=fused
 * makes the fused pipeline the fixture's (the default is staged). */
#include <cuda_runtime.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fixture_cuda.h"
#include "harness.h"
#include "internal.h"
#include "moefuse.h"
#include "reference.h"

#define kMaxTokens 4096
#define kCheckTokens 16
#define kMaskExperts 3
#define kMaskSlots 256
#define kGroupSlots 32

static const model kModels[] = {
    {"qwen3-30b-a3b", 2048, 768, 128, 8},
    {"qwen3-235b-a22b (E=16)", 4096, 1536, 16, 8},
};

static char g_skip[512];

/* ---- fixture: layer, weights, weight-gradient buffers ------------------------------- */

typedef struct fixture {
    const model *m;
    moefuse_layer *layer;     /* MOEFUSE_SAVE_ACTIVATIONS */
    moefuse_pipeline pipeline;/* the layer's: staged unless MOEFUSE_TEST_PIPELINE=fused */
    uint16_t *w13_d, *w2_d;   /* [E, 2I, H], [E, H, I] */
    float *dw13_d, *dw2_d;    /* [E, 2I, H], [E, H, I] fp32 */
    double *w13_ref, *w2_ref; /* fp64 copies */
    float *dw13_h, *dw2_h;    /* host copies of the gradients */
    cudaStream_t stream;
} fixture;

static fixture F;

static double bf(uint16_t v) { return (double)mf_bf16_to_float(v); }
static int64_t n13(void) { return (int64_t)F.m->E * 2 * F.m->I * F.m->H; }
static int64_t n2(void) { return (int64_t)F.m->E * F.m->H * F.m->I; }

static moefuse_layer *make_layer(moefuse_saved_mode mode, moefuse_pipeline pipeline,
                                 int max_tokens) {
    moefuse_config cfg;
    moefuse_config_init(&cfg, F.m->H, F.m->I, F.m->E, F.m->K, max_tokens);
    cfg.backend = MOEFUSE_BACKEND_CUDA;
    cfg.saved_mode = mode;
    cfg.pipeline = pipeline;
    moefuse_layer *l = NULL;
    moefuse_status st = moefuse_layer_create(&cfg, NULL, &l);
    if (st != MOEFUSE_OK)
        printf("  %s: moefuse_layer_create: %s: %s\n", F.m->name, moefuse_status_string(st),
               moefuse_last_error());
    return l;
}

static int fixture_setup(const model *m) {
    memset(&F, 0, sizeof F);
    F.m = m;
    /* MOEFUSE_TEST_PIPELINE=fused runs every case on the fused pipeline (sanitizer runs). */
    const char *pipeline = getenv("MOEFUSE_TEST_PIPELINE");
    F.pipeline = pipeline && !strcmp(pipeline, "fused") ? MOEFUSE_PIPELINE_FUSED
                                                         : MOEFUSE_PIPELINE_STAGED;
    F.layer = make_layer(MOEFUSE_SAVE_ACTIVATIONS, F.pipeline, kMaxTokens);
    if (!F.layer) return 0;
    uint16_t *w13 = malloc((size_t)n13() * 2), *w2 = malloc((size_t)n2() * 2);
    F.w13_ref = malloc((size_t)n13() * 8);
    F.w2_ref = malloc((size_t)n2() * 8);
    F.dw13_h = malloc((size_t)n13() * 4);
    F.dw2_h = malloc((size_t)n2() * 4);
    if (!w13 || !w2 || !F.w13_ref || !F.w2_ref || !F.dw13_h || !F.dw2_h) {
        printf("  %s: out of host memory\n", m->name);
        free(w13);
        free(w2);
        moefuse_layer_destroy(F.layer);
        F.layer = NULL;
        return 0;
    }
    ct_fill_weights(m, w13, w2, F.w13_ref, F.w2_ref);
    int ok = cudaStreamCreateWithFlags(&F.stream, cudaStreamNonBlocking) == cudaSuccess &&
             cudaMalloc((void **)&F.w13_d, (size_t)n13() * 2) == cudaSuccess &&
             cudaMalloc((void **)&F.w2_d, (size_t)n2() * 2) == cudaSuccess &&
             cudaMalloc((void **)&F.dw13_d, (size_t)n13() * 4) == cudaSuccess &&
             cudaMalloc((void **)&F.dw2_d, (size_t)n2() * 4) == cudaSuccess &&
             cudaMemcpy(F.w13_d, w13, (size_t)n13() * 2, cudaMemcpyHostToDevice) == cudaSuccess &&
             cudaMemcpy(F.w2_d, w2, (size_t)n2() * 2, cudaMemcpyHostToDevice) == cudaSuccess;
    free(w13);
    free(w2);
    if (!ok) {
        printf("  %s: device setup failed: %s\n", m->name, cudaGetErrorString(cudaGetLastError()));
        moefuse_layer_destroy(F.layer);
        F.layer = NULL;
    }
    return ok;
}

static void fixture_teardown(void) {
    if (F.layer) moefuse_layer_destroy(F.layer);
    cudaFree(F.w13_d);
    cudaFree(F.w2_d);
    cudaFree(F.dw13_d);
    cudaFree(F.dw2_d);
    if (F.stream) cudaStreamDestroy(F.stream);
    free(F.w13_ref);
    free(F.w2_ref);
    free(F.dw13_h);
    free(F.dw2_h);
    memset(&F, 0, sizeof F);
}

static int ready(void) {
    if (g_skip[0]) {
        th_skip("%s", g_skip);
        return 0;
    }
    CHECK(F.layer != NULL, "%s: the fixture could not be set up (see above)", F.m->name);
    return F.layer != NULL;
}

/* ---- inputs ------------------------------------------------------------------------- */

typedef struct inputs {
    int T, K, H;
    int64_t x_stride, dy_stride, dx_stride;
    uint16_t *x, *dy;  /* host [T, stride] */
    int32_t *ids;      /* host [T, K] */
    float *p;          /* host [T, K] */
    uint16_t *x_d, *dy_d, *dx_d, *y_d;
    int32_t *ids_d;
    float *p_d, *dp_d;
    void *saved_d;
    size_t saved_bytes;
} inputs;

static int inputs_make(inputs *in, int T, routing r, int64_t pad) {
    const model *m = F.m;
    memset(in, 0, sizeof *in);
    in->T = T;
    in->K = m->K;
    in->H = m->H;
    in->x_stride = m->H + pad;
    in->dy_stride = m->H + 2 * pad;
    in->dx_stride = m->H + 3 * pad;
    const int64_t T1 = T > 0 ? T : 1;
    const int64_t ns = T1 * m->K;
    in->x = malloc((size_t)(T1 * in->x_stride) * 2);
    in->dy = malloc((size_t)(T1 * in->dy_stride) * 2);
    in->ids = malloc((size_t)ns * 4);
    in->p = malloc((size_t)ns * 4);
    th_fill_bf16_normal(in->x, NULL, T1 * in->x_stride, 1.0);
    th_fill_bf16_normal(in->dy, NULL, T1 * in->dy_stride, 1.0);
    ct_draw_ids(T, m->K, m->E, r, in->ids);
    ct_draw_weights(T, m->K, in->p);
    moefuse_status st = moefuse_saved_bytes(F.layer, T, &in->saved_bytes);
    CHECK(st == MOEFUSE_OK, "moefuse_saved_bytes: %s", moefuse_last_error());
    int ok = st == MOEFUSE_OK &&
             cudaMalloc((void **)&in->x_d, (size_t)(T1 * in->x_stride) * 2) == cudaSuccess &&
             cudaMalloc((void **)&in->dy_d, (size_t)(T1 * in->dy_stride) * 2) == cudaSuccess &&
             cudaMalloc((void **)&in->dx_d, (size_t)(T1 * in->dx_stride) * 2) == cudaSuccess &&
             cudaMalloc((void **)&in->y_d, (size_t)(T1 * m->H) * 2) == cudaSuccess &&
             cudaMalloc((void **)&in->ids_d, (size_t)ns * 4) == cudaSuccess &&
             cudaMalloc((void **)&in->p_d, (size_t)ns * 4) == cudaSuccess &&
             cudaMalloc((void **)&in->dp_d, (size_t)ns * 4) == cudaSuccess &&
             cudaMalloc(&in->saved_d, in->saved_bytes) == cudaSuccess &&
             cudaMemcpy(in->x_d, in->x, (size_t)(T1 * in->x_stride) * 2, cudaMemcpyHostToDevice) == cudaSuccess &&
             cudaMemcpy(in->dy_d, in->dy, (size_t)(T1 * in->dy_stride) * 2, cudaMemcpyHostToDevice) == cudaSuccess &&
             cudaMemcpy(in->ids_d, in->ids, (size_t)ns * 4, cudaMemcpyHostToDevice) == cudaSuccess &&
             cudaMemcpy(in->p_d, in->p, (size_t)ns * 4, cudaMemcpyHostToDevice) == cudaSuccess;
    CHECK(ok, "device buffers: %s", cudaGetErrorString(cudaGetLastError()));
    return ok;
}

static void inputs_free(inputs *in) {
    free(in->x);
    free(in->dy);
    free(in->ids);
    free(in->p);
    cudaFree(in->x_d);
    cudaFree(in->dy_d);
    cudaFree(in->dx_d);
    cudaFree(in->y_d);
    cudaFree(in->ids_d);
    cudaFree(in->p_d);
    cudaFree(in->dp_d);
    cudaFree(in->saved_d);
    memset(in, 0, sizeof *in);
}

static moefuse_bwd_args bwd_args(const inputs *in, int accumulate) {
    moefuse_bwd_args b;
    memset(&b, 0, sizeof b);
    b.num_tokens = in->T;
    b.x = in->x_d;
    b.x_stride = in->x_stride;
    b.ids = in->ids_d;
    b.weights = in->p_d;
    b.w13 = F.w13_d;
    b.w2 = F.w2_d;
    b.saved = in->saved_d;
    b.saved_bytes = in->saved_bytes;
    b.dy = in->dy_d;
    b.dy_stride = in->dy_stride;
    b.dx = in->dx_d;
    b.dx_stride = in->dx_stride;
    b.dweights = in->dp_d;
    b.dw13 = F.dw13_d;
    b.dw2 = F.dw2_d;
    b.accumulate = accumulate;
    return b;
}

/* Poison (write mode: also dW), forward, backward on `layer`. */
static moefuse_status run_fwd_bwd(moefuse_layer *layer, const inputs *in, int poison_dw) {
    const int64_t T1 = in->T > 0 ? in->T : 1;
    cudaMemsetAsync(in->dx_d, 0xff, (size_t)(T1 * in->dx_stride) * 2, F.stream);
    cudaMemsetAsync(in->dp_d, 0xff, (size_t)(T1 * in->K) * 4, F.stream);
    if (poison_dw) {
        cudaMemsetAsync(F.dw13_d, 0xff, (size_t)n13() * 4, F.stream);
        cudaMemsetAsync(F.dw2_d, 0xff, (size_t)n2() * 4, F.stream);
    }
    moefuse_fwd_args a;
    memset(&a, 0, sizeof a);
    a.num_tokens = in->T;
    a.x = in->x_d;
    a.x_stride = in->x_stride;
    a.ids = in->ids_d;
    a.weights = in->p_d;
    a.w13 = F.w13_d;
    a.w2 = F.w2_d;
    a.y = in->y_d;
    a.y_stride = F.m->H;
    a.saved = in->saved_d;
    moefuse_status st = moefuse_forward(layer, &a, F.stream);
    if (st != MOEFUSE_OK) return st;
    moefuse_bwd_args b = bwd_args(in, !poison_dw);
    st = moefuse_backward(layer, &b, F.stream);
    if (st != MOEFUSE_OK) return st;
    return moefuse_layer_check(layer, F.stream);
}

/* ---- the reference, per group of slots of one expert -------------------------------- */

typedef struct group {
    int expert, n;
    const int32_t *slot; /* [n] slots t*K+k, all routed to `expert` */
} group;

/* For each group: mf_ref_backward over its slots with E = 1, K = 1. dx_slot [n, H] and
 * dp_slot [n] per slot (in group order, at out_row[g] + i); dW of the group into
 * dw13_g / dw2_g (per group, [2I, H] / [H, I]) when non-NULL. Groups run in parallel,
 * each reference call single-threaded (nested OpenMP regions are inactive). */
static void ref_groups(const inputs *in, const group *g, int ng, const int64_t *out_row,
                       double *dx_slot, double *dp_slot, double **dw13_g, double **dw2_g) {
    const int H = F.m->H, I = F.m->I, K = F.m->K;
#pragma omp parallel for schedule(dynamic, 1)
    for (int gi = 0; gi < ng; gi++) {
        const int n = g[gi].n, e = g[gi].expert;
        double *x = malloc((size_t)n * H * 8), *dy = malloc((size_t)n * H * 8);
        double *p = malloc((size_t)n * 8), *dx = malloc((size_t)n * H * 8), *dp = malloc((size_t)n * 8);
        int32_t *ids = malloc((size_t)n * 4);
        double *w13g = dw13_g ? dw13_g[gi] : malloc((size_t)2 * I * H * 8);
        double *w2g = dw2_g ? dw2_g[gi] : malloc((size_t)H * I * 8);
        for (int i = 0; i < n; i++) {
            const int32_t s = g[gi].slot[i], t = s / K;
            for (int h = 0; h < H; h++) {
                x[(int64_t)i * H + h] = bf(in->x[(int64_t)t * in->x_stride + h]);
                dy[(int64_t)i * H + h] = bf(in->dy[(int64_t)t * in->dy_stride + h]);
            }
            p[i] = in->p[s];
            ids[i] = 0;
        }
        mf_ref_shape sh = {n, H, I, 1, 1};
        mf_ref_backward(&sh, x, ids, p, F.w13_ref + (int64_t)e * 2 * I * H,
                        F.w2_ref + (int64_t)e * H * I, dy, dx, dp, w13g, w2g);
        if (dx_slot)
            memcpy(dx_slot + out_row[gi] * H, dx, (size_t)n * H * 8);
        if (dp_slot) memcpy(dp_slot + out_row[gi], dp, (size_t)n * 8);
        if (!dw13_g) free(w13g);
        if (!dw2_g) free(w2g);
        free(x);
        free(dy);
        free(p);
        free(dx);
        free(dp);
        free(ids);
    }
}

/* ||da' o a||_2 of slot (token t, expert e) in fp64: the norm of the terms of its
 * d p = sum_i da'_i a_i, da' = W2_e^T dy_t, a = silu(g) u, [g; u] = W13_e x_t. */
static double dp_term_norm(const inputs *in, int t, int e) {
    const int H = F.m->H, I = F.m->I;
    const double *w13 = F.w13_ref + (int64_t)e * 2 * I * H, *w2 = F.w2_ref + (int64_t)e * H * I;
    const uint16_t *x = in->x + (int64_t)t * in->x_stride, *dy = in->dy + (int64_t)t * in->dy_stride;
    double *da = calloc((size_t)I, 8), sum = 0.0;
    for (int h = 0; h < H; h++) {
        const double d = bf(dy[h]);
        for (int i = 0; i < I; i++) da[i] += d * w2[(int64_t)h * I + i];
    }
    for (int i = 0; i < I; i++) {
        double g = 0.0, u = 0.0;
        for (int h = 0; h < H; h++) {
            g += w13[(int64_t)i * H + h] * bf(x[h]);
            u += w13[(int64_t)(I + i) * H + h] * bf(x[h]);
        }
        const double term = da[i] * g / (1.0 + exp(-g)) * u;
        sum += term * term;
    }
    free(da);
    return sqrt(sum);
}

/* dx (rows strided) and dweights: every element written, dropped slots 0, fully
 * dropped tokens 0, stride padding untouched; a token subset against the reference. */
static void check_dx_dp(const inputs *in, const uint16_t *dx, const float *dp) {
    const int T = in->T, H = F.m->H, K = F.m->K;
    int64_t nan_count = 0, pad_touched = 0, dropped_nonzero = 0;
    for (int t = 0; t < T; t++) {
        const uint16_t *row = dx + (int64_t)t * in->dx_stride;
        int all_dropped = 1;
        for (int k = 0; k < K; k++) {
            const int64_t s = (int64_t)t * K + k;
            all_dropped &= in->ids[s] < 0;
            nan_count += isnan(dp[s]);
            dropped_nonzero += in->ids[s] < 0 && dp[s] != 0.0f;
        }
        for (int h = 0; h < H; h++) {
            nan_count += (row[h] & 0x7fff) > 0x7f80;
            dropped_nonzero += all_dropped && row[h] != 0;
        }
        for (int64_t h = H; h < in->dx_stride; h++) pad_touched += row[h] != 0xffff;
    }
    CHECK(nan_count == 0, "%lld elements of dx / dweights are NaN (unwritten?)", (long long)nan_count);
    CHECK(pad_touched == 0, "%lld elements past H in dx rows were written", (long long)pad_touched);
    CHECK(dropped_nonzero == 0, "%lld elements of dropped slots / tokens are not 0",
          (long long)dropped_nonzero);

    const int n = T <= kCheckTokens ? T : kCheckTokens;
    if (n == 0) return;
    int tok[kCheckTokens];
    for (int i = 0; i < n; i++) {
        int t, dup;
        do {
            t = T <= kCheckTokens ? i : (i == 0 ? 0 : i == 1 ? T - 1 : th_rand_int(0, T - 1));
            dup = 0;
            for (int j = 0; j < i; j++) dup |= tok[j] == t;
        } while (dup);
        tok[i] = t;
    }
    /* the live slots of the subset sorted by expert (the order of out_pos), one group
     * per run of one expert: each reference call writes its expert's whole dW, so
     * fewer calls cost less */
    group *g = malloc((size_t)n * K * sizeof(group));
    int32_t *slots = malloc((size_t)n * K * 4);
    int64_t *out_row = malloc((size_t)n * K * 8);
    int32_t *out_pos = malloc((size_t)n * K * 4); /* [i*K + k]: row in dx_slot, -1 dropped */
    int ng = 0, nl = 0;
    for (int e = 0; e < F.m->E; e++) {
        const int begin = nl;
        for (int i = 0; i < n; i++)
            for (int k = 0; k < K; k++)
                if (in->ids[tok[i] * K + k] == e) {
                    out_pos[i * K + k] = nl;
                    slots[nl++] = tok[i] * K + k;
                }
        if (nl > begin) {
            g[ng] = (group){e, nl - begin, &slots[begin]};
            out_row[ng++] = begin;
        }
    }
    for (int i = 0; i < n; i++)
        for (int k = 0; k < K; k++)
            if (in->ids[tok[i] * K + k] < 0) out_pos[i * K + k] = -1;
    double *dx_slot = malloc((size_t)(nl > 0 ? nl : 1) * H * 8), *dp_slot = malloc((size_t)(nl > 0 ? nl : 1) * 8);
    ref_groups(in, g, ng, out_row, dx_slot, dp_slot, NULL, NULL);
    double *dxr = calloc((size_t)n * H, 8), *dxg = malloc((size_t)n * H * 8);
    double *dpr = calloc((size_t)n * K, 8), *dpg = malloc((size_t)n * K * 8);
    for (int i = 0; i < n; i++) {
        for (int k = 0; k < K; k++) {
            const int32_t s = tok[i] * K + k, r = out_pos[i * K + k];
            dpg[i * K + k] = dp[s];
            if (r < 0) continue;
            for (int h = 0; h < H; h++) dxr[(int64_t)i * H + h] += dx_slot[(int64_t)r * H + h];
            dpr[i * K + k] = dp_slot[r];
        }
        for (int h = 0; h < H; h++) dxg[(int64_t)i * H + h] = bf(dx[(int64_t)tok[i] * in->dx_stride + h]);
    }
    double *dp_scale = calloc((size_t)n * K, 8);
#pragma omp parallel for schedule(dynamic, 1)
    for (int s = 0; s < n * K; s++) {
        const int e = in->ids[tok[s / K] * K + s % K];
        if (e >= 0) dp_scale[s] = dp_term_norm(in, tok[s / K], e);
    }
    double dp_err2 = 0.0, dp_scale2 = 0.0;
    for (int s = 0; s < n * K; s++) {
        dp_err2 += (dpg[s] - dpr[s]) * (dpg[s] - dpr[s]);
        dp_scale2 += dp_scale[s] * dp_scale[s];
    }
    free(dp_scale);
    const double ex = th_rel_l2(dxg, dxr, (int64_t)n * H), tx = th_bf16_tolerance(6);
    const double ep = dp_scale2 > 0.0 ? sqrt(dp_err2 / dp_scale2) : sqrt(dp_err2),
                 tp = th_bf16_tolerance(4);
    CHECK(ex <= tx, "dx: rel l2 %.3e over %d tokens > tol %.3e", ex, n, tx);
    CHECK(ep <= tp, "dweights: l2 error / term norm %.3e over %d tokens > tol %.3e", ep, n, tp);
    printf("    %s T=%d: dx rel l2 %.2e (tol %.2e), dweights err/term norm %.2e (tol %.2e), %d tokens\n",
           F.m->name, T, ex, tx, ep, tp, n);
    free(g);
    free(slots);
    free(out_row);
    free(out_pos);
    free(dx_slot);
    free(dp_slot);
    free(dxr);
    free(dxg);
    free(dpr);
    free(dpg);
}

/* The masked call: keep the slots of the kMaskExperts most loaded experts (at most
 * kMaskSlots each, the first in token order); run forward + backward on them; check
 * dW13 / dW2 of the kept experts against the reference, every other expert exactly 0. */
static void check_dw_masked(inputs *in) {
    const int T = in->T, K = F.m->K, E = F.m->E, H = F.m->H, I = F.m->I;
    const int64_t slots = (int64_t)T * K;
    int32_t *counts = calloc((size_t)E, 4), *keep = malloc((size_t)E * 4);
    int32_t *masked = malloc((size_t)slots * 4), *saved_ids = in->ids;
    int nkeep = 0;
    for (int64_t s = 0; s < slots; s++)
        if (in->ids[s] >= 0) counts[in->ids[s]]++;
    for (int j = 0; j < kMaskExperts; j++) { /* most loaded, ties to the lower id */
        int best = -1;
        for (int e = 0; e < E; e++) {
            int taken = 0;
            for (int i = 0; i < nkeep; i++) taken |= keep[i] == e;
            if (!taken && counts[e] > 0 && (best < 0 || counts[e] > counts[best])) best = e;
        }
        if (best >= 0) keep[nkeep++] = best;
    }
    /* groups of kGroupSlots slots of one kept expert, in slot order */
    int32_t *kept_slots = malloc((size_t)(slots > 0 ? slots : 1) * 4);
    group *g = malloc((size_t)(kMaskExperts * kMaskSlots / kGroupSlots + kMaskExperts) * sizeof(group));
    int ng = 0, nkept = 0;
    int group_begin[kMaskExperts + 1];
    for (int64_t s = 0; s < slots; s++) masked[s] = -1;
    for (int j = 0; j < nkeep; j++) {
        group_begin[j] = ng;
        int taken = 0;
        for (int64_t s = 0; s < slots && taken < kMaskSlots; s++) {
            if (in->ids[s] != keep[j]) continue;
            masked[s] = keep[j];
            if (taken % kGroupSlots == 0) g[ng++] = (group){keep[j], 0, &kept_slots[nkept]};
            kept_slots[nkept++] = (int32_t)s;
            g[ng - 1].n++;
            taken++;
        }
    }
    group_begin[nkeep] = ng;
    const size_t e13 = (size_t)2 * I * H, e2 = (size_t)H * I;
    double **dw13_g = malloc((size_t)(ng > 0 ? ng : 1) * sizeof(double *));
    double **dw2_g = malloc((size_t)(ng > 0 ? ng : 1) * sizeof(double *));
    for (int i = 0; i < ng; i++) {
        dw13_g[i] = malloc(e13 * 8);
        dw2_g[i] = malloc(e2 * 8);
    }
    CUDA_OK(cudaMemcpy(in->ids_d, masked, (size_t)slots * 4, cudaMemcpyHostToDevice));
    MF_OK(run_fwd_bwd(F.layer, in, 1));
    CUDA_OK(cudaMemcpy(F.dw13_h, F.dw13_d, (size_t)n13() * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(F.dw2_h, F.dw2_d, (size_t)n2() * 4, cudaMemcpyDeviceToHost));
    in->ids = masked;
    ref_groups(in, g, ng, NULL, NULL, NULL, dw13_g, dw2_g);
    in->ids = saved_ids;

    int64_t nonzero = 0;
    for (int e = 0; e < E; e++) {
        int kept = 0;
        for (int j = 0; j < nkeep; j++) kept |= keep[j] == e;
        if (kept) continue;
        const float *a = F.dw13_h + (int64_t)e * e13, *b = F.dw2_h + (int64_t)e * e2;
        for (size_t i = 0; i < e13; i++) nonzero += a[i] != 0.0f;
        for (size_t i = 0; i < e2; i++) nonzero += b[i] != 0.0f;
    }
    CHECK(nonzero == 0, "%lld dW elements of experts without rows are not 0", (long long)nonzero);
    double *r13 = malloc(e13 * 8), *g13 = malloc(e13 * 8), *r2 = malloc(e2 * 8), *g2 = malloc(e2 * 8);
    for (int j = 0; j < nkeep; j++) {
        const int e = keep[j];
        memset(r13, 0, e13 * 8);
        memset(r2, 0, e2 * 8);
        for (int gi = group_begin[j]; gi < group_begin[j + 1]; gi++) {
            for (size_t i = 0; i < e13; i++) r13[i] += dw13_g[gi][i];
            for (size_t i = 0; i < e2; i++) r2[i] += dw2_g[gi][i];
        }
        for (size_t i = 0; i < e13; i++) g13[i] = F.dw13_h[(int64_t)e * e13 + i];
        for (size_t i = 0; i < e2; i++) g2[i] = F.dw2_h[(int64_t)e * e2 + i];
        const double a13 = th_rel_l2(g13, r13, (int64_t)e13), t13 = th_bf16_tolerance(4);
        const double a2 = th_rel_l2(g2, r2, (int64_t)e2), t2 = th_bf16_tolerance(4);
        const int rows = counts[e] < kMaskSlots ? counts[e] : kMaskSlots;
        CHECK(a13 <= t13, "dW13 of expert %d (%d rows): rel l2 %.3e > tol %.3e", e, rows, a13, t13);
        CHECK(a2 <= t2, "dW2 of expert %d (%d rows): rel l2 %.3e > tol %.3e", e, rows, a2, t2);
        printf("    %s T=%d masked: expert %d, %d rows: dW13 rel l2 %.2e (tol %.2e), dW2 %.2e "
               "(tol %.2e)\n", F.m->name, T, e, rows, a13, t13, a2, t2);
    }
    free(r13);
    free(g13);
    free(r2);
    free(g2);
done:
    CHECK(cudaMemcpy(in->ids_d, saved_ids, (size_t)slots * 4, cudaMemcpyHostToDevice) == cudaSuccess,
          "restore ids");
    for (int i = 0; i < ng; i++) {
        free(dw13_g[i]);
        free(dw2_g[i]);
    }
    free(dw13_g);
    free(dw2_g);
    free(counts);
    free(keep);
    free(masked);
    free(kept_slots);
    free(g);
}

/* One backward on fresh inputs: dx and d p on the full call, dW on the masked one. */
static void backward_case(int T, routing r, int64_t pad) {
    if (!ready()) return;
    inputs in;
    uint16_t *dx = NULL;
    float *dp = NULL;
    if (!inputs_make(&in, T, r, pad)) goto done;
    MF_OK(run_fwd_bwd(F.layer, &in, 1));
    const int64_t T1 = T > 0 ? T : 1;
    dx = malloc((size_t)(T1 * in.dx_stride) * 2);
    dp = malloc((size_t)(T1 * in.K) * 4);
    CUDA_OK(cudaMemcpy(dx, in.dx_d, (size_t)(T1 * in.dx_stride) * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(dp, in.dp_d, (size_t)(T1 * in.K) * 4, cudaMemcpyDeviceToHost));
    check_dx_dp(&in, dx, dp);
    check_dw_masked(&in);
done:
    free(dx);
    free(dp);
    inputs_free(&in);
}

/* ---- bitwise cases ------------------------------------------------------------------ */

typedef struct outputs {
    uint16_t *dx;
    float *dp, *dw13, *dw2;
    size_t dx_bytes, dp_bytes;
} outputs;

static int outputs_get(outputs *o, const inputs *in) {
    o->dx_bytes = (size_t)in->T * in->dx_stride * 2;
    o->dp_bytes = (size_t)in->T * in->K * 4;
    if (!o->dx) {
        o->dx = malloc(o->dx_bytes);
        o->dp = malloc(o->dp_bytes);
        o->dw13 = malloc((size_t)n13() * 4);
        o->dw2 = malloc((size_t)n2() * 4);
    }
    return o->dw2 && cudaStreamSynchronize(F.stream) == cudaSuccess &&
           cudaMemcpy(o->dx, in->dx_d, o->dx_bytes, cudaMemcpyDeviceToHost) == cudaSuccess &&
           cudaMemcpy(o->dp, in->dp_d, o->dp_bytes, cudaMemcpyDeviceToHost) == cudaSuccess &&
           cudaMemcpy(o->dw13, F.dw13_d, (size_t)n13() * 4, cudaMemcpyDeviceToHost) == cudaSuccess &&
           cudaMemcpy(o->dw2, F.dw2_d, (size_t)n2() * 4, cudaMemcpyDeviceToHost) == cudaSuccess;
}

static int outputs_equal(const outputs *a, const outputs *b) {
    return !memcmp(a->dx, b->dx, a->dx_bytes) && !memcmp(a->dp, b->dp, a->dp_bytes) &&
           !memcmp(a->dw13, b->dw13, (size_t)n13() * 4) && !memcmp(a->dw2, b->dw2, (size_t)n2() * 4);
}

static void outputs_free(outputs *o) {
    free(o->dx);
    free(o->dp);
    free(o->dw13);
    free(o->dw2);
    memset(o, 0, sizeof *o);
}

/* The other saved modes give the saving layer's bits: MOEFUSE_RECOMPUTE reruns gemm1,
 * MOEFUSE_SAVE_ACTIVATIONS_AND_INPUTS reads the forward's xs rows from the saved buffer
 * instead of gathering x again (with either pipeline: the fused forward and backward
 * give the staged bits). */
static void saved_mode_case(moefuse_saved_mode mode, moefuse_pipeline pipeline, int T,
                            routing r, int64_t pad) {
    if (!ready()) return;
    inputs in;
    outputs a, b;
    memset(&a, 0, sizeof a);
    memset(&b, 0, sizeof b);
    moefuse_layer *ml = make_layer(mode, pipeline, T);
    CHECK(ml != NULL, "layer of saved_mode %d", (int)mode);
    if (!ml || !inputs_make(&in, T, r, pad)) goto done;
    MF_OK(run_fwd_bwd(F.layer, &in, 1));
    CHECK(outputs_get(&a, &in), "copy");
    size_t mbytes = 0;
    MF_OK(moefuse_saved_bytes(ml, T, &mbytes));
    if (mode == MOEFUSE_RECOMPUTE)
        CHECK(mbytes < in.saved_bytes, "recompute saves %zu bytes, activations %zu", mbytes,
              in.saved_bytes);
    else  /* at least the T*K slot rows of H bf16 more */
        CHECK(mbytes >= in.saved_bytes + (size_t)T * F.m->K * F.m->H * 2,
              "activations and inputs save %zu bytes, activations %zu", mbytes, in.saved_bytes);
    if (mbytes > in.saved_bytes) {
        CUDA_OK(cudaFree(in.saved_d));
        CUDA_OK(cudaMalloc(&in.saved_d, mbytes));
        in.saved_bytes = mbytes;
    }
    MF_OK(run_fwd_bwd(ml, &in, 1));
    CHECK(outputs_get(&b, &in), "copy");
    CHECK(outputs_equal(&a, &b), "saved_mode %d differs from MOEFUSE_SAVE_ACTIVATIONS",
          (int)mode);
done:
    if (ml) moefuse_layer_destroy(ml);
    outputs_free(&a);
    outputs_free(&b);
    inputs_free(&in);
}

static void case_recompute(void) {
    saved_mode_case(MOEFUSE_RECOMPUTE, MOEFUSE_PIPELINE_STAGED, 512, ROUTE_ZIPF, 0);
}
static void case_saved_inputs(void) {
    saved_mode_case(MOEFUSE_SAVE_ACTIVATIONS_AND_INPUTS, MOEFUSE_PIPELINE_STAGED, 1000,
                    ROUTE_DROPPED, 8);
}
static void case_saved_inputs_fused(void) {
    saved_mode_case(MOEFUSE_SAVE_ACTIVATIONS_AND_INPUTS, MOEFUSE_PIPELINE_FUSED, 700,
                    ROUTE_ZIPF, 0);
}

/* accumulate = 1 on old values gives exactly old + the write-mode gradient (fp32). */
static void case_accumulate(void) {
    if (!ready()) return;
    const int T = 700;
    inputs in;
    outputs w, acc;
    memset(&w, 0, sizeof w);
    memset(&acc, 0, sizeof acc);
    float *old13 = NULL, *old2 = NULL;
    if (!inputs_make(&in, T, ROUTE_FEW_EXPERTS, 0)) goto done;
    MF_OK(run_fwd_bwd(F.layer, &in, 1));
    CHECK(outputs_get(&w, &in), "copy");
    old13 = malloc((size_t)n13() * 4);
    old2 = malloc((size_t)n2() * 4);
    for (int64_t i = 0; i < n13(); i++) old13[i] = (float)((int64_t)(i * 2654435761u % 1999) - 999) * 1e-3f;
    for (int64_t i = 0; i < n2(); i++) old2[i] = (float)((int64_t)(i * 2246822519u % 1999) - 999) * 1e-3f;
    CUDA_OK(cudaMemcpy(F.dw13_d, old13, (size_t)n13() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(F.dw2_d, old2, (size_t)n2() * 4, cudaMemcpyHostToDevice));
    MF_OK(run_fwd_bwd(F.layer, &in, 0));
    CHECK(outputs_get(&acc, &in), "copy");
    int64_t bad = 0;
    for (int64_t i = 0; i < n13(); i++) {
        const float want = old13[i] + w.dw13[i];
        bad += memcmp(&want, &acc.dw13[i], 4) != 0;
    }
    for (int64_t i = 0; i < n2(); i++) {
        const float want = old2[i] + w.dw2[i];
        bad += memcmp(&want, &acc.dw2[i], 4) != 0;
    }
    CHECK(bad == 0, "accumulate: %lld elements differ from old + write-mode gradient", (long long)bad);
    CHECK(!memcmp(w.dx, acc.dx, w.dx_bytes) && !memcmp(w.dp, acc.dp, w.dp_bytes),
          "accumulate changed dx / dweights");
done:
    free(old13);
    free(old2);
    outputs_free(&w);
    outputs_free(&acc);
    inputs_free(&in);
}

/* The write-mode backward of `in` into the bf16 weight gradients d13 / d2 (no fp32 ones),
 * synchronized. */
static moefuse_status backward_dw_bf16_on(moefuse_layer *layer, const inputs *in, uint16_t *d13,
                                          uint16_t *d2) {
    moefuse_bwd_args b = bwd_args(in, 0);
    b.dw13 = NULL;
    b.dw2 = NULL;
    b.dw13_bf16 = d13;
    b.dw2_bf16 = d2;
    moefuse_status st = moefuse_backward(layer, &b, F.stream);
    if (st == MOEFUSE_OK && cudaStreamSynchronize(F.stream) != cudaSuccess) st = MOEFUSE_ERR_CUDA;
    return st;
}

static moefuse_status backward_dw_bf16(const inputs *in, uint16_t *d13, uint16_t *d2) {
    return backward_dw_bf16_on(F.layer, in, d13, d2);
}

/* bf16 weight gradients (dw13_bf16 / dw2_bf16): the write-mode fp32 gradients rounded
 * to nearest even, bitwise, experts without rows 0; dx and d p unchanged. */
static void case_dw_bf16(void) {
    if (!ready()) return;
    const int T = 700;
    inputs in;
    outputs w;
    memset(&w, 0, sizeof w);
    uint16_t *d13 = NULL, *d2 = NULL, *h13 = NULL, *h2 = NULL, *dx = NULL;
    float *dp = NULL;
    if (!inputs_make(&in, T, ROUTE_FEW_EXPERTS, 0)) goto done;
    MF_OK(run_fwd_bwd(F.layer, &in, 1));
    CHECK(outputs_get(&w, &in), "copy");
    CUDA_OK(cudaMalloc((void **)&d13, (size_t)n13() * 2));
    CUDA_OK(cudaMalloc((void **)&d2, (size_t)n2() * 2));
    if (!d13 || !d2) goto done;
    CUDA_OK(cudaMemsetAsync(d13, 0xff, (size_t)n13() * 2, F.stream));
    CUDA_OK(cudaMemsetAsync(d2, 0xff, (size_t)n2() * 2, F.stream));
    CUDA_OK(cudaMemsetAsync(in.dx_d, 0xff, w.dx_bytes, F.stream));
    CUDA_OK(cudaMemsetAsync(in.dp_d, 0xff, w.dp_bytes, F.stream));
    MF_OK(backward_dw_bf16(&in, d13, d2));
    h13 = malloc((size_t)n13() * 2);
    h2 = malloc((size_t)n2() * 2);
    dx = malloc(w.dx_bytes);
    dp = malloc(w.dp_bytes);
    CUDA_OK(cudaMemcpy(h13, d13, (size_t)n13() * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(h2, d2, (size_t)n2() * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(dx, in.dx_d, w.dx_bytes, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(dp, in.dp_d, w.dp_bytes, cudaMemcpyDeviceToHost));
    int64_t bad = 0;
    for (int64_t i = 0; i < n13(); i++) bad += h13[i] != mf_float_to_bf16(w.dw13[i]);
    for (int64_t i = 0; i < n2(); i++) bad += h2[i] != mf_float_to_bf16(w.dw2[i]);
    CHECK(bad == 0, "bf16 dW: %lld elements differ from the rounded fp32 gradient", (long long)bad);
    CHECK(!memcmp(w.dx, dx, w.dx_bytes) && !memcmp(w.dp, dp, w.dp_bytes),
          "bf16 dW changed dx / dweights");
done:
    cudaFree(d13);
    cudaFree(d2);
    free(h13);
    free(h2);
    free(dx);
    free(dp);
    outputs_free(&w);
    inputs_free(&in);
}

/* Counts the 2-byte words of a device buffer that differ from `want`, in 64 MB pieces. */
static int64_t count_words_not(const void *dev, int64_t words, uint16_t want) {
    const int64_t piece = 32 << 20;
    uint16_t *h = malloc((size_t)piece * 2);
    int64_t bad = 0;
    for (int64_t i = 0; h && i < words; i += piece) {
        const int64_t n = words - i < piece ? words - i : piece;
        if (cudaMemcpy(h, (const uint16_t *)dev + i, (size_t)n * 2, cudaMemcpyDeviceToHost) !=
            cudaSuccess) {
            bad = -1;
            break;
        }
        for (int64_t j = 0; j < n; j++) bad += h[j] != want;
    }
    free(h);
    return h ? bad : -1;
}

/* T = 0: write mode writes zeros into every weight gradient, fp32 and bf16; accumulate
 * mode leaves them as they were (poison here). */
static void case_t0(void) {
    if (!ready()) return;
    inputs in;
    uint16_t *d13 = NULL, *d2 = NULL;
    if (!inputs_make(&in, 0, ROUTE_RANDOM, 0)) goto done;
    MF_OK(run_fwd_bwd(F.layer, &in, 1));   /* poisons dW first */
    CHECK(count_words_not(F.dw13_d, 2 * n13(), 0) == 0 &&
              count_words_not(F.dw2_d, 2 * n2(), 0) == 0,
          "T=0, fp32 write mode: weight gradients not all zero");

    /* Poison on the call's stream: it does not wait for the legacy default stream. */
    CUDA_OK(cudaMemsetAsync(F.dw13_d, 0xff, (size_t)n13() * 4, F.stream));
    CUDA_OK(cudaMemsetAsync(F.dw2_d, 0xff, (size_t)n2() * 4, F.stream));
    moefuse_bwd_args b = bwd_args(&in, 1);
    MF_OK(moefuse_backward(F.layer, &b, F.stream));
    CUDA_OK(cudaStreamSynchronize(F.stream));
    CHECK(count_words_not(F.dw13_d, 2 * n13(), 0xffff) == 0 &&
              count_words_not(F.dw2_d, 2 * n2(), 0xffff) == 0,
          "T=0, accumulate: weight gradients changed");

    CUDA_OK(cudaMalloc((void **)&d13, (size_t)n13() * 2));
    CUDA_OK(cudaMalloc((void **)&d2, (size_t)n2() * 2));
    CUDA_OK(cudaMemsetAsync(d13, 0xff, (size_t)n13() * 2, F.stream));
    CUDA_OK(cudaMemsetAsync(d2, 0xff, (size_t)n2() * 2, F.stream));
    MF_OK(backward_dw_bf16(&in, d13, d2));
    CHECK(count_words_not(d13, n13(), 0) == 0 && count_words_not(d2, n2(), 0) == 0,
          "T=0, bf16 write mode: weight gradients not all zero");
done:
    cudaFree(d13);
    cudaFree(d2);
    inputs_free(&in);
}

/* 50 repetitions of the backward on one saved buffer: bitwise the first. dx and d p
 * are compared whole every time; dW (2.4 GB at qwen3-30b-a3b) in a window of 8 experts
 * that moves each repetition, so the 50 cover every expert. */
static void case_deterministic(void) {
    if (!ready()) return;
    const int T = 1536, W = 8;
    inputs in;
    outputs first;
    memset(&first, 0, sizeof first);
    uint16_t *dx = NULL;
    float *dp = NULL, *w13 = NULL, *w2 = NULL;
    if (!inputs_make(&in, T, ROUTE_ZIPF, 0)) goto done;
    MF_OK(run_fwd_bwd(F.layer, &in, 1));
    CHECK(outputs_get(&first, &in), "copy");
    const size_t e13 = (size_t)2 * F.m->I * F.m->H, e2 = (size_t)F.m->H * F.m->I;
    const int E = F.m->E, win = W < E ? W : E;
    dx = malloc(first.dx_bytes);
    dp = malloc(first.dp_bytes);
    w13 = malloc(e13 * 4 * win);
    w2 = malloc(e2 * 4 * win);
    moefuse_bwd_args b = bwd_args(&in, 0);
    int diff = 0;
    for (int rep = 0; rep < 50; rep++) {
        const int e0 = (rep * win) % E < E - win ? (rep * win) % E : E - win;
        CUDA_OK(cudaMemsetAsync(in.dx_d, 0xff, first.dx_bytes, F.stream));
        CUDA_OK(cudaMemsetAsync(in.dp_d, 0xff, first.dp_bytes, F.stream));
        CUDA_OK(cudaMemsetAsync(F.dw13_d + e0 * e13, 0xff, e13 * 4 * win, F.stream));
        CUDA_OK(cudaMemsetAsync(F.dw2_d + e0 * e2, 0xff, e2 * 4 * win, F.stream));
        MF_OK(moefuse_backward(F.layer, &b, F.stream));
        CUDA_OK(cudaStreamSynchronize(F.stream));
        CUDA_OK(cudaMemcpy(dx, in.dx_d, first.dx_bytes, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(dp, in.dp_d, first.dp_bytes, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(w13, F.dw13_d + e0 * e13, e13 * 4 * win, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(w2, F.dw2_d + e0 * e2, e2 * 4 * win, cudaMemcpyDeviceToHost));
        diff += memcmp(dx, first.dx, first.dx_bytes) || memcmp(dp, first.dp, first.dp_bytes) ||
                memcmp(w13, first.dw13 + e0 * e13, e13 * 4 * win) ||
                memcmp(w2, first.dw2 + e0 * e2, e2 * 4 * win);
    }
    CHECK(diff == 0, "the backward differed from the first run in %d of 50 repetitions", diff);
    MF_OK(moefuse_layer_check(F.layer, F.stream));
done:
    free(dx);
    free(dp);
    free(w13);
    free(w2);
    outputs_free(&first);
    inputs_free(&in);
}

/* The backward captured in a CUDA graph: two replays give the eager bits; then new dy
 * written in place, replay again = eager again. */
static void case_graph(void) {
    if (!ready()) return;
    const int T = 640;
    inputs in;
    outputs e, g;
    memset(&e, 0, sizeof e);
    memset(&g, 0, sizeof g);
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    if (!inputs_make(&in, T, ROUTE_RANDOM, 0)) goto done;
    MF_OK(run_fwd_bwd(F.layer, &in, 1));
    moefuse_bwd_args b = bwd_args(&in, 0);
    CUDA_OK(cudaStreamBeginCapture(F.stream, cudaStreamCaptureModeGlobal));
    moefuse_status st = moefuse_backward(F.layer, &b, F.stream);
    cudaError_t ce = cudaStreamEndCapture(F.stream, &graph);
    CHECK(st == MOEFUSE_OK, "backward under capture: %s", moefuse_last_error());
    CUDA_OK(ce);
    if (st != MOEFUSE_OK) goto done;
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    for (int round = 0; round < 2; round++) {
        if (round == 1) {
            th_fill_bf16_normal(in.dy, NULL, (int64_t)T * in.dy_stride, 1.0);
            CUDA_OK(cudaMemcpy(in.dy_d, in.dy, (size_t)T * in.dy_stride * 2, cudaMemcpyHostToDevice));
        }
        CUDA_OK(cudaMemsetAsync(in.dx_d, 0xff, (size_t)T * in.dx_stride * 2, F.stream));
        MF_OK(moefuse_backward(F.layer, &b, F.stream));
        MF_OK(moefuse_layer_check(F.layer, F.stream));
        CHECK(outputs_get(&e, &in), "copy");
        CUDA_OK(cudaMemsetAsync(in.dx_d, 0xff, (size_t)T * in.dx_stride * 2, F.stream));
        CUDA_OK(cudaMemsetAsync(in.dp_d, 0xff, (size_t)T * in.K * 4, F.stream));
        CUDA_OK(cudaMemsetAsync(F.dw13_d, 0xff, (size_t)n13() * 4, F.stream));
        CUDA_OK(cudaGraphLaunch(exec, F.stream));
        CUDA_OK(cudaGraphLaunch(exec, F.stream));
        MF_OK(moefuse_layer_check(F.layer, F.stream));
        CHECK(outputs_get(&g, &in), "copy");
        CHECK(outputs_equal(&e, &g), "round %d: graph replay differs from the eager backward", round);
    }
    check_dx_dp(&in, g.dx, g.dp);
done:
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    outputs_free(&e);
    outputs_free(&g);
    inputs_free(&in);
}

/* A saved buffer no forward wrote, and one of another T: the call returns OK (the plan
 * is in device memory), moefuse_layer_check reports it, dx / dweights untouched; the
 * next good backward works. */
static void case_bad_saved(void) {
    if (!ready()) return;
    const int T = 300;
    inputs in;
    uint16_t *dx = NULL;
    if (!inputs_make(&in, T, ROUTE_RANDOM, 0)) goto done;
    MF_OK(run_fwd_bwd(F.layer, &in, 1));
    moefuse_bwd_args b = bwd_args(&in, 0);
    const size_t dxb = (size_t)T * in.dx_stride * 2;
    dx = malloc(dxb);
    for (int variant = 0; variant < 3; variant++) {
        if (variant == 0) CUDA_OK(cudaMemset(in.saved_d, 0xcd, in.saved_bytes)); /* no forward */
        if (variant == 1) { /* a good plan, but other ids */
            MF_OK(run_fwd_bwd(F.layer, &in, 1));
            int32_t *ids = malloc((size_t)T * in.K * 4);
            memcpy(ids, in.ids, (size_t)T * in.K * 4);
            int32_t t = ids[77 * in.K + 2];
            ids[77 * in.K + 2] = ids[77 * in.K + 3];
            ids[77 * in.K + 3] = t;
            cudaMemcpy(in.ids_d, ids, (size_t)T * in.K * 4, cudaMemcpyHostToDevice);
            free(ids);
        }
        if (variant == 2) { /* num_tokens of another forward */
            CUDA_OK(cudaMemcpy(in.ids_d, in.ids, (size_t)T * in.K * 4, cudaMemcpyHostToDevice));
            b.num_tokens = T - 1;
        }
        CUDA_OK(cudaMemset(in.dx_d, 0xff, dxb));
        MF_OK(moefuse_backward(F.layer, &b, F.stream));
        moefuse_status st = moefuse_layer_check(F.layer, F.stream);
        CHECK(st == MOEFUSE_ERR_SAVED_STATE, "variant %d: check %s, expected SAVED_STATE", variant,
              moefuse_status_string(st));
        printf("    message: %s\n", moefuse_last_error());
        CUDA_OK(cudaMemcpy(dx, in.dx_d, dxb, cudaMemcpyDeviceToHost));
        int64_t touched = 0;
        for (size_t i = 0; i < dxb / 2; i++) touched += dx[i] != 0xffff;
        CHECK(touched == 0, "variant %d: %lld elements of dx written", variant, (long long)touched);
    }
    b.num_tokens = T;
    MF_OK(run_fwd_bwd(F.layer, &in, 1));
    MF_OK(moefuse_layer_check(F.layer, F.stream));
done:
    free(dx);
    inputs_free(&in);
}

/* The fused backward (MOEFUSE_PIPELINE_FUSED: dW2, dgrad1 and dW13 in one kernel) against
 * the staged one, bit for bit, on five routings with fresh inputs each: fp32 write mode
 * three times (outputs poisoned before each run: a dgrad1 tile storing dx rows over dys
 * before a dW2 tile had read them would show in dW2), accumulate mode once on top, and
 * the bf16 weight gradients once (experts without rows: zero tiles). */
static int fused_vs_staged(moefuse_layer *fused, int T, routing r, uint16_t *b13, uint16_t *b2,
                           int *diff) {
    int runs = 0;
    inputs in;
    outputs staged, staged_acc, got;
    memset(&staged, 0, sizeof staged);
    memset(&staged_acc, 0, sizeof staged_acc);
    memset(&got, 0, sizeof got);
    const size_t h13 = (size_t)n13() * 2, h2 = (size_t)n2() * 2;
    uint16_t *s13 = malloc(h13), *s2 = malloc(h2), *f13 = malloc(h13), *f2 = malloc(h2);
    if (!s13 || !s2 || !f13 || !f2 || !inputs_make(&in, T, r, 0)) goto done;
    /* staged: write, accumulate on top, bf16 */
    MF_OK(run_fwd_bwd(F.layer, &in, 1));
    CHECK(outputs_get(&staged, &in), "copy");
    MF_OK(run_fwd_bwd(F.layer, &in, 0));
    CHECK(outputs_get(&staged_acc, &in), "copy");
    MF_OK(backward_dw_bf16_on(F.layer, &in, b13, b2));
    CUDA_OK(cudaMemcpy(s13, b13, h13, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(s2, b2, h2, cudaMemcpyDeviceToHost));
    /* fused */
    for (int rep = 0; rep < 3; rep++) {
        MF_OK(run_fwd_bwd(fused, &in, 1));
        CHECK(outputs_get(&got, &in), "copy");
        *diff += !outputs_equal(&staged, &got);
        runs++;
    }
    MF_OK(run_fwd_bwd(fused, &in, 0));   /* onto the write-mode gradients, as staged */
    CHECK(outputs_get(&got, &in), "copy");
    *diff += !outputs_equal(&staged_acc, &got);
    runs++;
    CUDA_OK(cudaMemsetAsync(b13, 0xff, h13, F.stream));
    CUDA_OK(cudaMemsetAsync(b2, 0xff, h2, F.stream));
    MF_OK(backward_dw_bf16_on(fused, &in, b13, b2));
    CUDA_OK(cudaMemcpy(f13, b13, h13, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(f2, b2, h2, cudaMemcpyDeviceToHost));
    *diff += memcmp(s13, f13, h13) != 0 || memcmp(s2, f2, h2) != 0;
    runs++;
    if (r == ROUTE_RANDOM) check_dx_dp(&in, got.dx, got.dp);
done:
    free(s13);
    free(s2);
    free(f13);
    free(f2);
    outputs_free(&staged);
    outputs_free(&staged_acc);
    outputs_free(&got);
    inputs_free(&in);
    return runs;
}

static void case_fused_equals_staged(void) {
    if (!ready()) return;
    if (F.pipeline == MOEFUSE_PIPELINE_FUSED) {
        th_skip("the fixture runs the fused pipeline already (MOEFUSE_TEST_PIPELINE=fused)");
        return;
    }
    moefuse_layer *fused = make_layer(MOEFUSE_SAVE_ACTIVATIONS, MOEFUSE_PIPELINE_FUSED, kMaxTokens);
    uint16_t *b13 = NULL, *b2 = NULL;
    CHECK(fused != NULL, "fused layer");
    if (!fused) goto done;
    CUDA_OK(cudaMalloc((void **)&b13, (size_t)n13() * 2));
    CUDA_OK(cudaMalloc((void **)&b2, (size_t)n2() * 2));
    if (!b13 || !b2) goto done;
    static const routing kRoutes[] = {ROUTE_RANDOM, ROUTE_ZIPF, ROUTE_ONE_EXPERT,
                                      ROUTE_FEW_EXPERTS, ROUTE_DROPPED};
    static const int kTokens[] = {kMaxTokens, 3000, 2048, 777, 1000};
    int diff = 0, runs = 0;
    for (int i = 0; i < 5; i++) runs += fused_vs_staged(fused, kTokens[i], kRoutes[i], b13, b2, &diff);
    CHECK(runs == 25, "ran %d of 25 fused backwards", runs);
    CHECK(diff == 0, "the fused backward differed from the staged one in %d of %d runs", diff, runs);
    MF_OK(moefuse_layer_check(fused, F.stream));
done:
    cudaFree(b13);
    cudaFree(b2);
    if (fused) moefuse_layer_destroy(fused);
}

static void case_t1(void) { backward_case(1, ROUTE_RANDOM, 0); }
static void case_t1_one_slot(void) { backward_case(1, ROUTE_ONE_EXPERT, 0); }
static void case_t7(void) { backward_case(7, ROUTE_RANDOM, 0); }
static void case_t512(void) { backward_case(512, ROUTE_RANDOM, 0); }
static void case_tmax(void) { backward_case(kMaxTokens, ROUTE_RANDOM, 0); }
static void case_one_expert(void) { backward_case(kMaxTokens, ROUTE_ONE_EXPERT, 0); }
static void case_few_experts(void) { backward_case(777, ROUTE_FEW_EXPERTS, 0); }
static void case_dropped(void) { backward_case(1000, ROUTE_DROPPED, 8); }
static void case_zipf(void) { backward_case(3000, ROUTE_ZIPF, 0); }

/* ---- main --------------------------------------------------------------------------- */

static void detect_device(void) {
    struct cudaDeviceProp prop;
    if (ct_detect_sm90(g_skip, sizeof g_skip, &prop))
        printf("device: %s, %d SMs; %d host threads for the reference\n", prop.name,
               prop.multiProcessorCount, omp_get_max_threads());
}

/* test_cuda_backward [model-substring [case-substring]] */
int main(int argc, char **argv) {
    th_seed_from_env_or_clock();
    detect_device();
    for (size_t i = 0; i < sizeof kModels / sizeof kModels[0]; i++) {
        const model *m = &kModels[i];
        if (argc > 1 && !strstr(m->name, argv[1])) continue;
        memset(&F, 0, sizeof F);
        F.m = m;
        if (!g_skip[0]) fixture_setup(m);
        char name[160];
#define RUN(fn, what)                                                      \
    snprintf(name, sizeof name, "cuda_backward %s %s", m->name, what);     \
    if (argc < 3 || strstr(what, argv[2])) th_run(name, fn);
        RUN(case_t0, "T=0 weight gradients zero / untouched")
        RUN(case_t1, "T=1")
        RUN(case_t1_one_slot, "T=1 one slot")
        RUN(case_t7, "T=7")
        RUN(case_t512, "T=512")
        RUN(case_tmax, "T=4096 (max)")
        RUN(case_one_expert, "T=4096 all tokens on one expert")
        RUN(case_few_experts, "T=777 three experts, rest empty")
        RUN(case_dropped, "T=1000 dropped slots and tokens, strided x/dy/dx")
        RUN(case_zipf, "T=3000 zipf routing")
        RUN(case_recompute, "recompute bitwise = saved activations")
        RUN(case_saved_inputs, "saved inputs bitwise = saved activations")
        RUN(case_saved_inputs_fused, "saved inputs, fused pipeline, bitwise = saved activations")
        RUN(case_accumulate, "accumulate = old + write mode, exactly")
        RUN(case_dw_bf16, "bf16 dW = rounded fp32 dW, bitwise")
        RUN(case_deterministic, "50 repetitions bitwise")
        RUN(case_graph, "cuda graph replay")
        RUN(case_bad_saved, "bad saved buffer")
        RUN(case_fused_equals_staged, "fused backward bitwise = staged")
#undef RUN
        fixture_teardown();
    }
    return th_finish();
}
