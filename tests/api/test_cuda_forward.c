/* The CUDA forward, through the public API with device buffers, against the fp64
 * reference (src/cpu/reference.h) on fresh random inputs.
 *
 *   - both model shapes, T in {0, 1, 7, 512, 4096 (= max_tokens)}, random routing;
 *   - routing edge cases: all tokens on one expert, most experts empty, dropped slots
 *     with fully dropped tokens (and row strides > H), Zipf-skewed routing;
 *   - expert_counts exact; the plan in `saved` equal to the host plan (mf_plan_build);
 *     padding rows of the saved gate_up exactly 0;
 *   - bad ids: moefuse_layer_check names the first bad token, y / saved /
 *     expert_counts untouched, the next good call works;
 *   - 50 repetitions bitwise identical (y and saved); saved = NULL gives the same y;
 *   - the fused forward (MOEFUSE_PIPELINE_FUSED) equal to the staged one (the default)
 *     bit for bit, 50 repetitions over five routings;
 *   - the forward captured in a CUDA graph and replayed gives the same bits, also
 *     after the inputs change in place.
 *
 * y_t depends only on token t, so for large T the reference runs on a random subset
 * of tokens (all tokens when T <= kCheckTokens). Tolerance: th_bf16_tolerance(5),
 * for the five bf16 roundings on the way (g and u, which each enter act, as in
 * test_cuda_backward.c; act; the p-scaled slot row; y); x and the weights are exact
 * bf16 inputs of both sides. Outputs are poisoned (bf16 NaN) first.
 *
 * With no sm_90 device every case prints SKIP with the reason. MOEFUSE_TEST_PIPELINE=fused
 * makes the fused forward the fixture's pipeline (the default is staged). */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fixture_cuda.h"
#include "harness.h"
#include "internal.h"
#include "moefuse.h"
#include "reference.h"

#define BF16_NAN 0xffffu
#define kCheckTokens 64
#define kMaxTokens 4096

static const model kModels[] = {
    {"qwen3-30b-a3b", 2048, 768, 128, 8},
    {"qwen3-235b-a22b", 4096, 1536, 128, 8},
};

static char g_skip[512];  /* non-empty: why every case skips */

/* ---- the fixture of one model: layer, weights on the device, fp64 weights ---------- */

typedef struct fixture {
    const model *m;
    moefuse_layer *layer;
    uint16_t *w13_d, *w2_d;   /* device, [E, 2I, H] and [E, H, I] */
    double *w13_ref, *w2_ref; /* host fp64 copies of the same bf16 values */
    cudaStream_t stream;
} fixture;

static fixture F;

static double bf16_to_double(uint16_t v) { return (double)mf_bf16_to_float(v); }

static int fixture_setup(const model *m) {
    memset(&F, 0, sizeof F);
    F.m = m;
    moefuse_config cfg;
    moefuse_config_init(&cfg, m->H, m->I, m->E, m->K, kMaxTokens);
    cfg.backend = MOEFUSE_BACKEND_CUDA;
    /* MOEFUSE_TEST_PIPELINE=fused runs every case on the fused forward (sanitizer runs). */
    const char *pipeline = getenv("MOEFUSE_TEST_PIPELINE");
    if (pipeline && !strcmp(pipeline, "fused")) cfg.pipeline = MOEFUSE_PIPELINE_FUSED;
    moefuse_status st = moefuse_layer_create(&cfg, NULL, &F.layer);
    if (st != MOEFUSE_OK) {
        printf("  %s: moefuse_layer_create: %s: %s\n", m->name, moefuse_status_string(st),
               moefuse_last_error());
        return 0;
    }
    const int64_t n13 = (int64_t)m->E * 2 * m->I * m->H, n2 = (int64_t)m->E * m->H * m->I;
    uint16_t *w13 = malloc((size_t)n13 * 2), *w2 = malloc((size_t)n2 * 2);
    F.w13_ref = malloc((size_t)n13 * sizeof(double));
    F.w2_ref = malloc((size_t)n2 * sizeof(double));
    if (!w13 || !w2 || !F.w13_ref || !F.w2_ref) {
        printf("  %s: out of host memory for the weights\n", m->name);
        free(w13);
        free(w2);
        return 0;
    }
    ct_fill_weights(m, w13, w2, F.w13_ref, F.w2_ref);
    int ok = cudaStreamCreateWithFlags(&F.stream, cudaStreamNonBlocking) == cudaSuccess &&
             cudaMalloc((void **)&F.w13_d, (size_t)n13 * 2) == cudaSuccess &&
             cudaMalloc((void **)&F.w2_d, (size_t)n2 * 2) == cudaSuccess &&
             cudaMemcpy(F.w13_d, w13, (size_t)n13 * 2, cudaMemcpyHostToDevice) == cudaSuccess &&
             cudaMemcpy(F.w2_d, w2, (size_t)n2 * 2, cudaMemcpyHostToDevice) == cudaSuccess;
    free(w13);
    free(w2);
    if (!ok) printf("  %s: device setup failed: %s\n", m->name, cudaGetErrorString(cudaGetLastError()));
    return ok;
}

static void fixture_teardown(void) {
    if (F.layer) moefuse_layer_destroy(F.layer);
    cudaFree(F.w13_d);
    cudaFree(F.w2_d);
    if (F.stream) cudaStreamDestroy(F.stream);
    free(F.w13_ref);
    free(F.w2_ref);
    memset(&F, 0, sizeof F);
}

/* SKIP without an sm_90 device; a fixture that failed on one is a failure. */
static int ready(void) {
    if (g_skip[0]) {
        th_skip("%s", g_skip);
        return 0;
    }
    CHECK(F.layer != NULL, "%s: the fixture could not be set up (see above)", F.m->name);
    return F.layer != NULL;
}

/* ---- inputs of one call ------------------------------------------------------------- */

typedef struct inputs {
    int T, K, H;
    int64_t x_stride, y_stride;
    uint16_t *x;   /* host [T, x_stride] */
    int32_t *ids;  /* host [T, K] */
    float *p;      /* host [T, K] */
    /* device copies, and outputs */
    uint16_t *x_d, *y_d;
    int32_t *ids_d, *counts_d;
    float *p_d;
    void *saved_d;
    size_t saved_bytes;
} inputs;

/* Host inputs and device buffers; outputs poisoned. 0 on failure (recorded). */
static int inputs_make(inputs *in, int T, routing r, int64_t x_pad, int64_t y_pad) {
    const model *m = F.m;
    memset(in, 0, sizeof *in);
    in->T = T;
    in->K = m->K;
    in->H = m->H;
    in->x_stride = m->H + x_pad;
    in->y_stride = m->H + y_pad;
    const int64_t nx = (int64_t)(T > 0 ? T : 1) * in->x_stride;
    const int64_t ny = (int64_t)(T > 0 ? T : 1) * in->y_stride;
    const int64_t ns = (int64_t)(T > 0 ? T : 1) * m->K;
    in->x = malloc((size_t)nx * 2);
    in->ids = malloc((size_t)ns * 4);
    in->p = malloc((size_t)ns * 4);
    th_fill_bf16_normal(in->x, NULL, nx, 1.0);
    ct_draw_ids(T, m->K, m->E, r, in->ids);
    ct_draw_weights(T, m->K, in->p);
    moefuse_status st = moefuse_saved_bytes(F.layer, T, &in->saved_bytes);
    CHECK(st == MOEFUSE_OK, "moefuse_saved_bytes: %s", moefuse_last_error());
    int ok = st == MOEFUSE_OK &&
             cudaMalloc((void **)&in->x_d, (size_t)nx * 2) == cudaSuccess &&
             cudaMalloc((void **)&in->y_d, (size_t)ny * 2) == cudaSuccess &&
             cudaMalloc((void **)&in->ids_d, (size_t)ns * 4) == cudaSuccess &&
             cudaMalloc((void **)&in->p_d, (size_t)ns * 4) == cudaSuccess &&
             cudaMalloc((void **)&in->counts_d, (size_t)m->E * 4) == cudaSuccess &&
             cudaMalloc(&in->saved_d, in->saved_bytes) == cudaSuccess &&
             cudaMemcpy(in->x_d, in->x, (size_t)nx * 2, cudaMemcpyHostToDevice) == cudaSuccess &&
             cudaMemcpy(in->ids_d, in->ids, (size_t)ns * 4, cudaMemcpyHostToDevice) == cudaSuccess &&
             cudaMemcpy(in->p_d, in->p, (size_t)ns * 4, cudaMemcpyHostToDevice) == cudaSuccess &&
             cudaMemset(in->y_d, 0xff, (size_t)ny * 2) == cudaSuccess &&            /* NaN */
             cudaMemset(in->counts_d, 0xab, (size_t)m->E * 4) == cudaSuccess &&
             cudaMemset(in->saved_d, 0xcd, in->saved_bytes) == cudaSuccess;
    CHECK(ok, "device buffers: %s", cudaGetErrorString(cudaGetLastError()));
    return ok;
}

static void inputs_free(inputs *in) {
    free(in->x);
    free(in->ids);
    free(in->p);
    cudaFree(in->x_d);
    cudaFree(in->y_d);
    cudaFree(in->ids_d);
    cudaFree(in->p_d);
    cudaFree(in->counts_d);
    cudaFree(in->saved_d);
    memset(in, 0, sizeof *in);
}

static moefuse_fwd_args fwd_args(const inputs *in, int with_saved, int with_counts) {
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
    a.y_stride = in->y_stride;
    a.saved = with_saved ? in->saved_d : NULL;
    a.expert_counts = with_counts ? in->counts_d : NULL;
    return a;
}

/* ---- checks ------------------------------------------------------------------------- */

/* y against the fp64 reference on a subset of tokens; every element of y written. */
static void check_y(const inputs *in, const uint16_t *y) {
    const model *m = F.m;
    const int T = in->T, H = m->H, K = m->K;
    /* every element written (not NaN), stride padding untouched, dropped tokens 0 */
    int64_t nan_count = 0, pad_touched = 0, dropped_nonzero = 0;
    for (int t = 0; t < T; t++) {
        const uint16_t *row = y + (int64_t)t * in->y_stride;
        int all_dropped = 1;
        for (int k = 0; k < K; k++) all_dropped &= in->ids[(int64_t)t * K + k] < 0;
        for (int h = 0; h < H; h++) {
            nan_count += (row[h] & 0x7fff) > 0x7f80;
            dropped_nonzero += all_dropped && row[h] != 0;
        }
        for (int64_t h = H; h < in->y_stride; h++) pad_touched += row[h] != BF16_NAN;
    }
    CHECK(nan_count == 0, "%lld elements of y are NaN (unwritten?)", (long long)nan_count);
    CHECK(pad_touched == 0, "%lld elements past H in y rows were written", (long long)pad_touched);
    CHECK(dropped_nonzero == 0, "%lld elements of fully dropped tokens are not +0",
          (long long)dropped_nonzero);

    /* the subset */
    int n = T <= kCheckTokens ? T : kCheckTokens;
    if (n == 0) return;
    int *tok = malloc((size_t)n * sizeof(int));
    if (T <= kCheckTokens) {
        for (int i = 0; i < n; i++) tok[i] = i;
    } else {
        tok[0] = 0;
        tok[1] = T - 1;
        for (int i = 2; i < n; i++) {
            int t, dup;
            do {
                t = th_rand_int(0, T - 1);
                dup = 0;
                for (int j = 0; j < i; j++) dup |= tok[j] == t;
            } while (dup);
            tok[i] = t;
        }
    }
    double *xr = malloc((size_t)n * H * sizeof(double));
    double *pr = malloc((size_t)n * K * sizeof(double));
    int32_t *idr = malloc((size_t)n * K * sizeof(int32_t));
    double *yr = malloc((size_t)n * H * sizeof(double));
    double *yg = malloc((size_t)n * H * sizeof(double));
    for (int i = 0; i < n; i++) {
        const int t = tok[i];
        for (int h = 0; h < H; h++) {
            xr[(int64_t)i * H + h] = bf16_to_double(in->x[(int64_t)t * in->x_stride + h]);
            yg[(int64_t)i * H + h] = bf16_to_double(y[(int64_t)t * in->y_stride + h]);
        }
        for (int k = 0; k < K; k++) {
            idr[i * K + k] = in->ids[(int64_t)t * K + k];
            pr[i * K + k] = in->p[(int64_t)t * K + k];
        }
    }
    mf_ref_shape s = {n, H, m->I, m->E, K};
    mf_ref_forward(&s, xr, idr, pr, F.w13_ref, F.w2_ref, yr);
    const double err = th_rel_l2(yg, yr, (int64_t)n * H), tol = th_bf16_tolerance(5);
    double worst = 0;
    int worst_t = -1;
    for (int i = 0; i < n; i++) {
        const double e = th_rel_l2(yg + (int64_t)i * H, yr + (int64_t)i * H, H);
        if (!(e <= worst)) worst = e, worst_t = tok[i];
    }
    CHECK(err <= tol, "y: rel l2 error %.3e over %d tokens > tolerance %.3e (worst token %d: %.3e)",
          err, n, tol, worst_t, worst);
    printf("    %s T=%d: rel l2 %.2e over %d tokens (tol %.2e), worst token %.2e\n", m->name, T,
           err, n, tol, worst);
    free(tok);
    free(xr);
    free(pr);
    free(idr);
    free(yr);
    free(yg);
}

/* The plan in `saved` (layout of src/cuda/pipeline/workspace.cu) against the host plan, and the
 * padding rows of gate_up exactly 0. */
static size_t a256(size_t n) { return (n + 255) & ~(size_t)255; }

static void check_saved(const inputs *in, const uint8_t *saved) {
    const model *m = F.m;
    const int T = in->T, K = m->K, E = m->E;
    const int64_t slots = (int64_t)T * K;
    const int64_t nonempty = slots < E ? slots : E;
    const int rows_cap = (int)((slots + 127 * nonempty + 127) / 128 * 128);
    const size_t off_counts = 256, off_offsets = off_counts + a256((size_t)E * 4);
    const size_t off_rbe = off_offsets + a256((size_t)(E + 1) * 4);
    const size_t off_slot_row = off_rbe + a256((size_t)rows_cap / 128 * 4);
    const size_t off_row_slot = off_slot_row + a256((size_t)slots * 4);
    const size_t off_gate_up = off_row_slot + a256((size_t)rows_cap * 4);
    CHECK(off_gate_up + a256((size_t)rows_cap * 2 * m->I * 2) == in->saved_bytes,
          "saved layout: expected %zu bytes, moefuse_saved_bytes says %zu",
          off_gate_up + a256((size_t)rows_cap * 2 * m->I * 2), in->saved_bytes);
    const int32_t *hdr = (const int32_t *)saved;
    CHECK(hdr[0] == 0x5653464d && hdr[2] == T && hdr[3] == K && hdr[7] == rows_cap,
          "saved header: magic %#x T %d K %d rows_cap %d", hdr[0], hdr[2], hdr[3], hdr[7]);

    mf_plan plan;
    plan.expert_counts = malloc((size_t)E * 4);
    plan.expert_offsets = malloc((size_t)(E + 1) * 4);
    plan.slot_row = malloc((size_t)(slots + 1) * 4);
    plan.row_slot = malloc((size_t)(rows_cap + 1) * 4);
    moefuse_status st = mf_plan_build(in->ids, T, K, E, 0, E, 128, &plan);
    CHECK(st == MOEFUSE_OK, "host plan: %s", moefuse_last_error());
    if (st == MOEFUSE_OK) {
        const int num_rows = hdr[9];
        CHECK(num_rows == plan.num_rows, "num_rows %d, host plan %d", num_rows, plan.num_rows);
        CHECK(!memcmp(saved + off_counts, plan.expert_counts, (size_t)E * 4), "expert_counts differ");
        CHECK(!memcmp(saved + off_offsets, plan.expert_offsets, (size_t)(E + 1) * 4),
              "expert_offsets differ");
        CHECK(!memcmp(saved + off_slot_row, plan.slot_row, (size_t)slots * 4), "slot_row differs");
        CHECK(num_rows <= rows_cap && !memcmp(saved + off_row_slot, plan.row_slot,
                                              (size_t)plan.num_rows * 4), "row_slot differs");
        const int32_t *rbe = (const int32_t *)(saved + off_rbe);
        int bad_rbe = 0;
        for (int j = 0; j < rows_cap / 128; j++) {
            int want = -1;
            for (int e = 0; e < E; e++)
                if (j * 128 >= plan.expert_offsets[e] && j * 128 < plan.expert_offsets[e + 1])
                    want = e;
            bad_rbe += rbe[j] != want;
        }
        CHECK(bad_rbe == 0, "row_block_expert: %d of %d blocks wrong", bad_rbe, rows_cap / 128);
        const uint16_t *gu = (const uint16_t *)(saved + off_gate_up);
        int64_t nonzero = 0;
        for (int r = 0; r < num_rows && num_rows <= rows_cap; r++)
            if (plan.row_slot[r] < 0)
                for (int j = 0; j < 2 * m->I; j++) nonzero += gu[(int64_t)r * 2 * m->I + j] != 0;
        CHECK(nonzero == 0, "%lld elements of padding rows of gate_up are not 0", (long long)nonzero);
    }
    free(plan.expert_counts);
    free(plan.expert_offsets);
    free(plan.slot_row);
    free(plan.row_slot);
}

static void check_counts(const inputs *in, const int32_t *counts) {
    const int E = F.m->E;
    int32_t *want = calloc((size_t)E, 4);
    for (int64_t s = 0; s < (int64_t)in->T * in->K; s++)
        if (in->ids[s] >= 0) want[in->ids[s]]++;
    int bad = 0;
    for (int e = 0; e < E; e++) bad += counts[e] != want[e];
    CHECK(bad == 0, "expert_counts: %d of %d experts wrong", bad, E);
    free(want);
}

/* One forward on fresh inputs, checked everywhere. */
static void forward_case(int T, routing r, int64_t x_pad, int64_t y_pad) {
    if (!ready()) return;
    inputs in;
    uint16_t *y = NULL;
    int32_t *counts = NULL;
    uint8_t *saved = NULL;
    if (!inputs_make(&in, T, r, x_pad, y_pad)) goto done;
    moefuse_fwd_args a = fwd_args(&in, 1, 1);
    MF_OK(moefuse_forward(F.layer, &a, F.stream));
    MF_OK(moefuse_layer_check(F.layer, F.stream));
    const int64_t ny = (int64_t)(T > 0 ? T : 1) * in.y_stride;
    y = malloc((size_t)ny * 2);
    counts = malloc((size_t)F.m->E * 4);
    saved = malloc(in.saved_bytes);
    CUDA_OK(cudaMemcpy(y, in.y_d, (size_t)ny * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(counts, in.counts_d, (size_t)F.m->E * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(saved, in.saved_d, in.saved_bytes, cudaMemcpyDeviceToHost));
    check_counts(&in, counts);
    check_saved(&in, saved);
    check_y(&in, y);
    if (T == 0) CHECK(y[0] == BF16_NAN, "T = 0 wrote y");
done:
    free(y);
    free(counts);
    free(saved);
    inputs_free(&in);
}

/* ---- cases -------------------------------------------------------------------------- */

static void case_t0(void) { forward_case(0, ROUTE_RANDOM, 0, 0); }
static void case_t1(void) { forward_case(1, ROUTE_RANDOM, 0, 0); }
static void case_t7(void) { forward_case(7, ROUTE_RANDOM, 0, 0); }
static void case_t512(void) { forward_case(512, ROUTE_RANDOM, 0, 0); }
static void case_tmax(void) { forward_case(kMaxTokens, ROUTE_RANDOM, 0, 0); }
static void case_one_expert(void) { forward_case(kMaxTokens, ROUTE_ONE_EXPERT, 0, 0); }
static void case_few_experts(void) { forward_case(777, ROUTE_FEW_EXPERTS, 0, 0); }
static void case_dropped(void) { forward_case(1000, ROUTE_DROPPED, 8, 64); }
static void case_zipf(void) { forward_case(3000, ROUTE_ZIPF, 0, 8); }
static void case_one_token_one_slot(void) { forward_case(1, ROUTE_ONE_EXPERT, 0, 0); }

/* Bad ids: two bad calls, then check names the first; nothing written; then a good
 * call works and check is clean. */
static void case_bad_ids(void) {
    if (!ready()) return;
    const int T = 300, K = F.m->K;
    inputs in;
    uint16_t *y = NULL;
    int32_t *counts = NULL;
    uint8_t *saved = NULL;
    int32_t *bad = NULL;
    if (!inputs_make(&in, T, ROUTE_RANDOM, 0, 0)) goto done;
    moefuse_fwd_args a = fwd_args(&in, 1, 1);
    const int64_t ny = (int64_t)T * in.y_stride;
    y = malloc((size_t)ny * 2);
    counts = malloc((size_t)F.m->E * 4);
    saved = malloc(in.saved_bytes);

    /* 1: out of range at token 137 (and a duplicate later, at 201: the smaller token wins) */
    bad = malloc((size_t)T * K * 4);
    memcpy(bad, in.ids, (size_t)T * K * 4);
    bad[137 * K + 5] = F.m->E;
    bad[201 * K + 2] = bad[201 * K + 0];
    CUDA_OK(cudaMemcpy(in.ids_d, bad, (size_t)T * K * 4, cudaMemcpyHostToDevice));
    MF_OK(moefuse_forward(F.layer, &a, F.stream));
    /* 2: a duplicate at token 5, before any check: the first error is kept */
    memcpy(bad, in.ids, (size_t)T * K * 4);
    bad[5 * K + 3] = bad[5 * K + 1];
    CUDA_OK(cudaMemcpy(in.ids_d, bad, (size_t)T * K * 4, cudaMemcpyHostToDevice));
    MF_OK(moefuse_forward(F.layer, &a, F.stream));
    moefuse_status st = moefuse_layer_check(F.layer, F.stream);
    CHECK(st == MOEFUSE_ERR_EXPERT_ID, "check after bad calls: %s (%s), expected "
          "MOEFUSE_ERR_EXPERT_ID", moefuse_status_string(st), moefuse_last_error());
    CHECK(strstr(moefuse_last_error(), "[137][5]") != NULL, "message should name ids[137][5]: %s",
          moefuse_last_error());
    printf("    message: %s\n", moefuse_last_error());
    st = moefuse_layer_check(F.layer, F.stream);
    CHECK(st == MOEFUSE_OK, "second check: %s, expected OK (cleared)", moefuse_status_string(st));

    /* nothing written */
    CUDA_OK(cudaMemcpy(y, in.y_d, (size_t)ny * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(counts, in.counts_d, (size_t)F.m->E * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(saved, in.saved_d, in.saved_bytes, cudaMemcpyDeviceToHost));
    int64_t touched = 0;
    for (int64_t i = 0; i < ny; i++) touched += y[i] != BF16_NAN;
    CHECK(touched == 0, "bad ids: %lld elements of y written", (long long)touched);
    touched = 0;
    for (int e = 0; e < F.m->E; e++) touched += (uint32_t)counts[e] != 0xababababu;
    CHECK(touched == 0, "bad ids: %lld expert_counts written", (long long)touched);
    touched = 0;
    for (size_t i = 0; i < in.saved_bytes; i++) touched += saved[i] != 0xcd;
    CHECK(touched == 0, "bad ids: %lld bytes of saved written", (long long)touched);

    /* 3: duplicate alone */
    CUDA_OK(cudaMemcpy(in.ids_d, bad, (size_t)T * K * 4, cudaMemcpyHostToDevice));
    MF_OK(moefuse_forward(F.layer, &a, F.stream));
    st = moefuse_layer_check(F.layer, F.stream);
    CHECK(st == MOEFUSE_ERR_DUPLICATE_EXPERT, "duplicate: %s, expected DUPLICATE_EXPERT",
          moefuse_status_string(st));
    CHECK(strstr(moefuse_last_error(), "[5][3]") != NULL, "message should name ids[5][3]: %s",
          moefuse_last_error());
    printf("    message: %s\n", moefuse_last_error());
    /* 4: -2 */
    memcpy(bad, in.ids, (size_t)T * K * 4);
    bad[(T - 1) * K] = -2;
    CUDA_OK(cudaMemcpy(in.ids_d, bad, (size_t)T * K * 4, cudaMemcpyHostToDevice));
    MF_OK(moefuse_forward(F.layer, &a, F.stream));
    st = moefuse_layer_check(F.layer, F.stream);
    CHECK(st == MOEFUSE_ERR_EXPERT_ID, "id -2: %s, expected EXPERT_ID", moefuse_status_string(st));
    CUDA_OK(cudaMemcpy(y, in.y_d, (size_t)ny * 2, cudaMemcpyDeviceToHost));
    touched = 0;
    for (int64_t i = 0; i < ny; i++) touched += y[i] != BF16_NAN;
    CHECK(touched == 0, "bad ids: %lld elements of y written", (long long)touched);

    /* 5: good ids again: the layer works, check is clean */
    CUDA_OK(cudaMemcpy(in.ids_d, in.ids, (size_t)T * K * 4, cudaMemcpyHostToDevice));
    MF_OK(moefuse_forward(F.layer, &a, F.stream));
    MF_OK(moefuse_layer_check(F.layer, F.stream));
    CUDA_OK(cudaMemcpy(y, in.y_d, (size_t)ny * 2, cudaMemcpyDeviceToHost));
    check_y(&in, y);
done:
    free(bad);
    free(y);
    free(counts);
    free(saved);
    inputs_free(&in);
}

/* Host copies of y and saved: of a reference run (y0, s0) and of the run compared with it
 * (y1, s1). */
typedef struct run_copies {
    uint16_t *y0, *y1;
    uint8_t *s0, *s1;
    size_t y_bytes, saved_bytes;
} run_copies;

static int run_copies_alloc(run_copies *c, const inputs *in) {
    c->y_bytes = (size_t)in->T * in->y_stride * 2;
    c->saved_bytes = in->saved_bytes;
    c->y0 = malloc(c->y_bytes);
    c->y1 = malloc(c->y_bytes);
    c->s0 = malloc(c->saved_bytes);
    c->s1 = malloc(c->saved_bytes);
    const int ok = c->y0 && c->y1 && c->s0 && c->s1;
    CHECK(ok, "out of host memory");
    return ok;
}

static void run_copies_free(run_copies *c) {
    free(c->y0);
    free(c->y1);
    free(c->s0);
    free(c->s1);
    memset(c, 0, sizeof *c);
}

/* One forward of `layer`, y and saved poisoned first, copied into the reference (ref = 1)
 * or the compared copies. 0 on a failed call (recorded). */
static int run_and_copy(moefuse_layer *layer, const inputs *in, const moefuse_fwd_args *a,
                        run_copies *c, int ref) {
    CUDA_OK(cudaMemsetAsync(in->y_d, 0xff, c->y_bytes, F.stream));
    if (a->saved) CUDA_OK(cudaMemsetAsync(in->saved_d, 0xcd, c->saved_bytes, F.stream));
    MF_OK(moefuse_forward(layer, a, F.stream));
    CUDA_OK(cudaStreamSynchronize(F.stream));
    CUDA_OK(cudaMemcpy(ref ? c->y0 : c->y1, in->y_d, c->y_bytes, cudaMemcpyDeviceToHost));
    if (a->saved)
        CUDA_OK(cudaMemcpy(ref ? c->s0 : c->s1, in->saved_d, c->saved_bytes,
                           cudaMemcpyDeviceToHost));
    return 1;
done:
    return 0;
}

/* `reps` runs of `layer` against the reference copies; counts the runs whose y or saved
 * differed. Returns the runs made. */
static int compare_runs(moefuse_layer *layer, const inputs *in, const moefuse_fwd_args *a,
                        run_copies *c, int reps, int *y_diff, int *s_diff) {
    int rep = 0;
    for (; rep < reps && run_and_copy(layer, in, a, c, 0); rep++) {
        *y_diff += memcmp(c->y0, c->y1, c->y_bytes) != 0;
        *s_diff += memcmp(c->s0, c->s1, c->saved_bytes) != 0;
    }
    return rep;
}

/* 50 repetitions, bitwise identical y and saved; saved = NULL gives the same y. */
static void case_deterministic(void) {
    if (!ready()) return;
    inputs in;
    run_copies c = {0};
    int y_diff = 0, s_diff = 0;
    if (!inputs_make(&in, 1536, ROUTE_ZIPF, 0, 0) || !run_copies_alloc(&c, &in)) goto done;
    moefuse_fwd_args a = fwd_args(&in, 1, 0);
    if (!run_and_copy(F.layer, &in, &a, &c, 1)) goto done;
    const int reps = compare_runs(F.layer, &in, &a, &c, 50, &y_diff, &s_diff);
    CHECK(reps == 50, "ran %d of 50 repetitions", reps);
    CHECK(y_diff == 0, "y differed from the first run in %d of 50 repetitions", y_diff);
    CHECK(s_diff == 0, "saved differed from the first run in %d of 50 repetitions", s_diff);
    MF_OK(moefuse_layer_check(F.layer, F.stream));
    check_y(&in, c.y0);

    a.saved = NULL;
    if (!run_and_copy(F.layer, &in, &a, &c, 0)) goto done;
    CHECK(!memcmp(c.y0, c.y1, c.y_bytes), "y with saved = NULL differs from y with saved");
done:
    run_copies_free(&c);
    inputs_free(&in);
}

/* The fused forward against the staged one (the default pipeline), bit for bit: y and
 * saved ([g | u] and the plan), 50 repetitions over five routings (10 each, fresh inputs
 * per routing, outputs poisoned before each run). A missing or early wait in the fused
 * kernel would show as a difference in some repetition. */
static int fused_vs_staged(moefuse_layer *fused, int T, routing r, int *y_diff, int *s_diff) {
    int reps = 0;
    inputs in;
    run_copies c = {0};
    if (!inputs_make(&in, T, r, 0, 0) || !run_copies_alloc(&c, &in)) goto done;
    const moefuse_fwd_args a = fwd_args(&in, 1, 0);
    if (!run_and_copy(F.layer, &in, &a, &c, 1)) goto done;
    reps = compare_runs(fused, &in, &a, &c, 10, y_diff, s_diff);
    if (r == ROUTE_RANDOM) check_y(&in, c.y1);
done:
    run_copies_free(&c);
    inputs_free(&in);
    return reps;
}

static void case_fused_equals_staged(void) {
    if (!ready()) return;
    const model *m = F.m;
    moefuse_config cfg;
    moefuse_config_init(&cfg, m->H, m->I, m->E, m->K, kMaxTokens);
    cfg.backend = MOEFUSE_BACKEND_CUDA;
    cfg.pipeline = MOEFUSE_PIPELINE_FUSED;
    moefuse_layer *fused = NULL;
    MF_OK(moefuse_layer_create(&cfg, NULL, &fused));
    static const routing kRoutes[] = {ROUTE_RANDOM, ROUTE_ZIPF, ROUTE_ONE_EXPERT,
                                      ROUTE_FEW_EXPERTS, ROUTE_DROPPED};
    static const int kTokens[] = {kMaxTokens, 3000, 2048, 777, 1000};
    int y_diff = 0, s_diff = 0, reps = 0;
    for (int i = 0; i < 5; i++) reps += fused_vs_staged(fused, kTokens[i], kRoutes[i], &y_diff, &s_diff);
    CHECK(reps == 50, "ran %d of 50 repetitions", reps);
    CHECK(y_diff == 0, "fused y differed from staged y in %d of %d repetitions", y_diff, reps);
    CHECK(s_diff == 0, "fused saved differed from staged saved in %d of %d repetitions", s_diff,
          reps);
    MF_OK(moefuse_layer_check(fused, F.stream));
done:
    if (fused) moefuse_layer_destroy(fused);
}

/* Captured in a CUDA graph: replays give the eager bits, also for new inputs written
 * in place between replays. */
static void case_graph(void) {
    if (!ready()) return;
    const int T = 640;
    inputs in, in2;
    memset(&in2, 0, sizeof in2);
    uint16_t *ye = NULL, *yg = NULL;
    uint8_t *se = NULL, *sg = NULL;
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    if (!inputs_make(&in, T, ROUTE_RANDOM, 0, 0)) goto done;
    if (!inputs_make(&in2, T, ROUTE_ZIPF, 0, 0)) goto done; /* host inputs of the 2nd round */
    moefuse_fwd_args a = fwd_args(&in, 1, 1);
    const size_t yb = (size_t)T * in.y_stride * 2;
    ye = malloc(yb);
    yg = malloc(yb);
    se = malloc(in.saved_bytes);
    sg = malloc(in.saved_bytes);
    for (int round = 0; round < 2; round++) {
        if (round == 1) { /* new inputs in place */
            CUDA_OK(cudaMemcpy(in.x_d, in2.x, (size_t)T * in.x_stride * 2, cudaMemcpyHostToDevice));
            CUDA_OK(cudaMemcpy(in.ids_d, in2.ids, (size_t)T * in.K * 4, cudaMemcpyHostToDevice));
            CUDA_OK(cudaMemcpy(in.p_d, in2.p, (size_t)T * in.K * 4, cudaMemcpyHostToDevice));
        }
        /* eager */
        CUDA_OK(cudaMemsetAsync(in.y_d, 0xff, yb, F.stream));
        CUDA_OK(cudaMemsetAsync(in.saved_d, 0xcd, in.saved_bytes, F.stream));
        MF_OK(moefuse_forward(F.layer, &a, F.stream));
        MF_OK(moefuse_layer_check(F.layer, F.stream));
        CUDA_OK(cudaMemcpy(ye, in.y_d, yb, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(se, in.saved_d, in.saved_bytes, cudaMemcpyDeviceToHost));
        if (round == 0) {
            CUDA_OK(cudaStreamBeginCapture(F.stream, cudaStreamCaptureModeGlobal));
            moefuse_status st = moefuse_forward(F.layer, &a, F.stream);
            cudaError_t ce = cudaStreamEndCapture(F.stream, &graph);
            CHECK(st == MOEFUSE_OK, "forward under capture: %s", moefuse_last_error());
            CUDA_OK(ce);
            if (st != MOEFUSE_OK) goto done;
            CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
        }
        CUDA_OK(cudaMemsetAsync(in.y_d, 0xff, yb, F.stream));
        CUDA_OK(cudaMemsetAsync(in.saved_d, 0xcd, in.saved_bytes, F.stream));
        CUDA_OK(cudaGraphLaunch(exec, F.stream));
        CUDA_OK(cudaGraphLaunch(exec, F.stream)); /* twice: per-call state resets itself */
        MF_OK(moefuse_layer_check(F.layer, F.stream));
        CUDA_OK(cudaMemcpy(yg, in.y_d, yb, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(sg, in.saved_d, in.saved_bytes, cudaMemcpyDeviceToHost));
        CHECK(!memcmp(ye, yg, yb), "round %d: graph replay y differs from eager y", round);
        CHECK(!memcmp(se, sg, in.saved_bytes), "round %d: graph replay saved differs", round);
    }
    if (in2.ids) { /* y of the 2nd round against the reference */
        memcpy(in.x, in2.x, (size_t)T * in.x_stride * 2);
        memcpy(in.ids, in2.ids, (size_t)T * in.K * 4);
        memcpy(in.p, in2.p, (size_t)T * in.K * 4);
        check_y(&in, yg);
    }
done:
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    free(ye);
    free(yg);
    free(se);
    free(sg);
    inputs_free(&in);
    inputs_free(&in2);
}

/* The forward's saved buffer feeds the CUDA backward (checked in depth by
 * tests/api/test_cuda_backward.c): the call succeeds and writes every dx element. */
static void case_backward_runs(void) {
    if (!ready()) return;
    const int T = 7, K = F.m->K, H = F.m->H;
    inputs in;
    uint16_t *dx_d = NULL, *dx = NULL;
    float *dp_d = NULL, *dw13_d = NULL, *dw2_d = NULL;
    if (!inputs_make(&in, T, ROUTE_RANDOM, 0, 0)) goto done;
    const size_t n13 = (size_t)F.m->E * 2 * F.m->I * H, n2 = (size_t)F.m->E * H * F.m->I;
    CUDA_OK(cudaMalloc((void **)&dx_d, (size_t)T * H * 2));
    CUDA_OK(cudaMalloc((void **)&dp_d, (size_t)T * K * 4));
    CUDA_OK(cudaMalloc((void **)&dw13_d, n13 * 4));
    CUDA_OK(cudaMalloc((void **)&dw2_d, n2 * 4));
    CUDA_OK(cudaMemset(dx_d, 0xff, (size_t)T * H * 2));
    moefuse_fwd_args a = fwd_args(&in, 1, 0);
    MF_OK(moefuse_forward(F.layer, &a, F.stream));
    moefuse_bwd_args b;
    memset(&b, 0, sizeof b);
    b.num_tokens = T;
    b.x = in.x_d;
    b.x_stride = in.x_stride;
    b.ids = in.ids_d;
    b.weights = in.p_d;
    b.w13 = F.w13_d;
    b.w2 = F.w2_d;
    b.saved = in.saved_d;
    b.saved_bytes = in.saved_bytes;
    b.dy = in.x_d; /* any bf16 rows will do */
    b.dy_stride = in.x_stride;
    b.dx = dx_d;
    b.dx_stride = H;
    b.dweights = dp_d;
    b.dw13 = dw13_d;
    b.dw2 = dw2_d;
    MF_OK(moefuse_backward(F.layer, &b, F.stream));
    MF_OK(moefuse_layer_check(F.layer, F.stream));
    dx = malloc((size_t)T * H * 2);
    CUDA_OK(cudaMemcpy(dx, dx_d, (size_t)T * H * 2, cudaMemcpyDeviceToHost));
    int64_t nan_count = 0;
    for (int64_t i = 0; i < (int64_t)T * H; i++) nan_count += (dx[i] & 0x7fff) > 0x7f80;
    CHECK(nan_count == 0, "backward: %lld elements of dx are NaN (unwritten?)", (long long)nan_count);
done:
    free(dx);
    cudaFree(dx_d);
    cudaFree(dp_d);
    cudaFree(dw13_d);
    cudaFree(dw2_d);
    inputs_free(&in);
}

/* ---- main --------------------------------------------------------------------------- */

static void detect_device(void) {
    struct cudaDeviceProp prop;
    if (ct_detect_sm90(g_skip, sizeof g_skip, &prop))
        printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
}

/* test_cuda_forward [model-substring [case-substring]]: all cases by default; the
 * filters keep sanitizer runs small. */
int main(int argc, char **argv) {
    th_seed_from_env_or_clock();
    detect_device();
    for (size_t i = 0; i < sizeof kModels / sizeof kModels[0]; i++) {
        const model *m = &kModels[i];
        if (argc > 1 && !strstr(m->name, argv[1])) continue;
        memset(&F, 0, sizeof F);
        F.m = m;
        if (!g_skip[0]) fixture_setup(m);
        char name[128];
#define RUN(fn, what)                                                      \
    snprintf(name, sizeof name, "cuda_forward %s %s", m->name, what);      \
    if (argc < 3 || strstr(what, argv[2])) th_run(name, fn);
        RUN(case_t0, "T=0")
        RUN(case_t1, "T=1")
        RUN(case_one_token_one_slot, "T=1 one slot")
        RUN(case_t7, "T=7")
        RUN(case_t512, "T=512")
        RUN(case_tmax, "T=4096 (max)")
        RUN(case_one_expert, "T=4096 all tokens on one expert")
        RUN(case_few_experts, "T=777 three experts, rest empty")
        RUN(case_dropped, "T=1000 dropped slots and tokens, strided x/y")
        RUN(case_zipf, "T=3000 zipf routing")
        RUN(case_bad_ids, "bad ids")
        RUN(case_deterministic, "50 repetitions bitwise")
        RUN(case_fused_equals_staged, "fused equals staged, 50 repetitions")
        RUN(case_graph, "cuda graph replay")
        RUN(case_backward_runs, "backward runs")
#undef RUN
        fixture_teardown();
    }
    return th_finish();
}
