/* The fixture of the CUDA forward tests: see cuda_forward.h. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_forward.h"
#include "fixture_cuda.h"
#include "harness.h"
#include "internal.h"
#include "moefuse.h"
#include "reference.h"

static const model kModels[] = {
    {"qwen3-30b-a3b", 2048, 768, 128, 8},
    {"qwen3-235b-a22b", 4096, 1536, 128, 8},
};

char g_skip[512];  /* non-empty: why every case skips */

fixture F;

double bf16_to_double(uint16_t v) { return (double)mf_bf16_to_float(v); }

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
int ready(void) {
    if (g_skip[0]) {
        th_skip("%s", g_skip);
        return 0;
    }
    CHECK(F.layer != NULL, "%s: the fixture could not be set up (see above)", F.m->name);
    return F.layer != NULL;
}

/* Host inputs and device buffers; outputs poisoned. 0 on failure (recorded). */
int inputs_make(inputs *in, int T, routing r, int64_t x_pad, int64_t y_pad) {
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

void inputs_free(inputs *in) {
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

moefuse_fwd_args fwd_args(const inputs *in, int with_saved, int with_counts) {
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

/* y against the fp64 reference on a subset of tokens; every element of y written. */
void check_y(const inputs *in, const uint16_t *y) {
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

void check_saved(const inputs *in, const uint8_t *saved) {
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

void check_counts(const inputs *in, const int32_t *counts) {
    const int E = F.m->E;
    int32_t *want = calloc((size_t)E, 4);
    for (int64_t s = 0; s < (int64_t)in->T * in->K; s++)
        if (in->ids[s] >= 0) want[in->ids[s]]++;
    int bad = 0;
    for (int e = 0; e < E; e++) bad += counts[e] != want[e];
    CHECK(bad == 0, "expert_counts: %d of %d experts wrong", bad, E);
    free(want);
}

static void detect_device(void) {
    struct cudaDeviceProp prop;
    if (ct_detect_sm90(g_skip, sizeof g_skip, &prop))
        printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
}

/* A model's fixture, made unless every case skips. */
static void begin(const model *m) {
    memset(&F, 0, sizeof F);
    F.m = m;
    if (!g_skip[0]) fixture_setup(m);
}

int forward_main(int argc, char **argv, const named_case *cases, int n) {
    th_seed_from_env_or_clock();
    detect_device();
    const int n_models = (int)(sizeof kModels / sizeof kModels[0]);
    return ct_run_models(argc, argv, "cuda_forward", kModels, n_models, begin, fixture_teardown,
                         cases, n);
}
