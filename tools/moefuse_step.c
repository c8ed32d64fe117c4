/* The project's main job: one training step (forward + backward) of the routed
 * experts for a named model shape, checked against the fp64 reference, timed.
 *
 *   moefuse_step [--model qwen3-30b-a3b|qwen3-235b-a22b] [--tokens T]
 *                [--backend cpu|cuda] [--pipeline staged|fused] [--iters N] [--seed S]
 *                [--no-check]
 *
 * The backend defaults to CUDA when an sm_90 GPU is present, else the CPU. --pipeline
 * sets config.pipeline (staged by default; the CPU backend ignores it): with fused, the
 * CUDA step runs the fused forward and backward kernels, checked the same way, and their
 * launches are this step's own to profile (ncu -k regex:moe_fused).
 *
 * Routing comes from the library's Qwen3 routing helper on random logits, so the
 * expert loads look like a real router's. Exit status 0 only when every checked
 * value is within its bf16-derived tolerance. */
#include "moefuse.h"
#include "reference.h" /* src/cpu/reference.h: the fp64 reference (linked in libmoefuse.a) */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef MOEFUSE_HAVE_CUDA
#include <cuda_runtime.h>
#endif

typedef struct {
    const char *name;
    int hidden, intermediate, num_experts, top_k;
} model_shape;

static const model_shape MODELS[] = {
    {"qwen3-30b-a3b", 2048, 768, 128, 8},
    {"qwen3-235b-a22b", 4096, 1536, 128, 8},
};

/* The fp64 reference holds x, W13, W2 and their gradients in doubles; above this the
 * check runs on a sub-problem (see check_step). */
#define REFERENCE_BYTES_MAX (10ull << 30)

typedef struct {
    int T, H, I, E, K;
    /* The CUDA pipeline rounds twice more than the CPU one: each slot's dx row (the
     * combine buffer) and p * a (the operand of dW2). */
    int cuda;
    uint16_t *x, *w13, *w2, *dy;  /* bf16 inputs */
    int32_t *ids;
    float *p;
    uint16_t *y, *dx;             /* outputs */
    float *dp, *dw13, *dw2;
    int32_t *counts;
} step_data;

/* bf16 as raw words (include/moefuse.h): the high half of an fp32, rounded to nearest
 * even (the inputs here are finite). */
static uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
static double bf16_to_double(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static double uniform(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (double)(rng >> 11) * 0x1.0p-53;
}
static double normal(void) {
    double u = uniform();
    return sqrt(-2.0 * log(u > 1e-300 ? u : 1e-300)) * cos(2.0 * M_PI * uniform());
}
/* Uniform values of standard deviation `scale`: as good as normal ones for a check,
 * and cheap enough for the 2.4 G weights of qwen3-235b-a22b. */
static void fill_bf16(uint16_t *a, int64_t n, double scale) {
    double half_width = scale * sqrt(3.0);
    for (int64_t i = 0; i < n; i++)
        a[i] = float_to_bf16((float)((2.0 * uniform() - 1.0) * half_width));
}
static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}
static void *xmalloc(size_t n) {
    void *p = aligned_alloc(256, (n + 255) / 256 * 256);
    if (!p) {
        fprintf(stderr, "out of host memory (%zu bytes)\n", n);
        exit(2);
    }
    return p;
}

#define TRY(call)                                                                          \
    do {                                                                                   \
        moefuse_status st_ = (call);                                                       \
        if (st_ != MOEFUSE_OK) {                                                           \
            fprintf(stderr, "%s failed: %s: %s\n", #call, moefuse_status_string(st_),      \
                    moefuse_last_error());                                                 \
            exit(2);                                                                       \
        }                                                                                  \
    } while (0)

static void make_inputs(step_data *d) {
    int64_t TH = (int64_t)d->T * d->H, TK = (int64_t)d->T * d->K;
    d->x = xmalloc(TH * 2); d->dy = xmalloc(TH * 2); d->y = xmalloc(TH * 2); d->dx = xmalloc(TH * 2);
    d->w13 = xmalloc((int64_t)d->E * 2 * d->I * d->H * 2);
    d->w2 = xmalloc((int64_t)d->E * d->H * d->I * 2);
    d->ids = xmalloc(TK * 4); d->p = xmalloc(TK * 4); d->dp = xmalloc(TK * 4);
    d->dw13 = xmalloc((int64_t)d->E * 2 * d->I * d->H * 4);
    d->dw2 = xmalloc((int64_t)d->E * d->H * d->I * 4);
    d->counts = xmalloc((size_t)d->E * 4);
    fill_bf16(d->x, TH, 1.0);
    fill_bf16(d->dy, TH, 1.0);
    fill_bf16(d->w13, (int64_t)d->E * 2 * d->I * d->H, 1.0 / sqrt(d->H));
    fill_bf16(d->w2, (int64_t)d->E * d->H * d->I, 1.0 / sqrt(d->I));
    float *logits = xmalloc((int64_t)d->T * d->E * 4);
    for (int64_t i = 0; i < (int64_t)d->T * d->E; i++) logits[i] = (float)normal();
    moefuse_route_args ra = {.num_tokens = d->T, .num_experts = d->E, .top_k = d->K,
                             .logits = logits, .ids = d->ids, .weights = d->p};
    TRY(moefuse_route_forward(&ra, MOEFUSE_BACKEND_CPU, NULL));
    free(logits);
}

static double *widen(const uint16_t *a, int64_t n) {
    double *o = xmalloc(n * 8);
    for (int64_t i = 0; i < n; i++) o[i] = bf16_to_double(a[i]);
    return o;
}

/* Norm-wise relative error of a bf16 or fp32 result against the fp64 reference. */
static double rel_err_bf16(const uint16_t *got, const double *ref, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        double g = bf16_to_double(got[i]), dlt = g - ref[i];
        num += dlt * dlt;
        den += ref[i] * ref[i];
    }
    return num != num ? NAN : sqrt(num / (den > 0 ? den : 1));
}
static double rel_err_f32(const float *got, const double *ref, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        double dlt = got[i] - ref[i];
        num += dlt * dlt;
        den += ref[i] * ref[i];
    }
    return num != num ? NAN : sqrt(num / (den > 0 ? den : 1));
}

/* Tolerance rule (tests/harness.h): twice the norm-wise error of `roundings`
 * independent bf16 roundings, plus fp32 accumulation noise. */
static double bf16_tol(int roundings) { return 2.0 / 256.0 * sqrt(roundings / 3.0) + 1e-5; }

static int report(const char *what, double err, int roundings) {
    double tol = bf16_tol(roundings);
    int ok = err <= tol;
    printf("  %-5s rel err %.3e  (tol %.3e, %d bf16 roundings)  %s\n", what, err, tol,
           roundings, ok ? "ok" : "FAIL");
    return ok;
}

/* Compares the outputs in d with the fp64 reference of the same step. */
static int check_step(const step_data *d) {
    mf_ref_shape s = {d->T, d->H, d->I, d->E, d->K};
    int64_t TH = (int64_t)d->T * d->H, TK = (int64_t)d->T * d->K;
    int64_t n13 = (int64_t)d->E * 2 * d->I * d->H, n2 = (int64_t)d->E * d->H * d->I;
    double *x = widen(d->x, TH), *dy = widen(d->dy, TH);
    double *w13 = widen(d->w13, n13), *w2 = widen(d->w2, n2);
    double *p = xmalloc(TK * 8);
    for (int64_t i = 0; i < TK; i++) p[i] = d->p[i];
    double *y = xmalloc(TH * 8), *dx = xmalloc(TH * 8), *dp = xmalloc(TK * 8);
    double *dw13 = xmalloc(n13 * 8), *dw2 = xmalloc(n2 * 8);
    double t0 = now_ms();
    mf_ref_forward(&s, x, d->ids, p, w13, w2, y);
    mf_ref_backward(&s, x, d->ids, p, w13, w2, dy, dx, dp, dw13, dw2);
    printf("check against the fp64 reference (%.0f ms):\n", now_ms() - t0);
    /* bf16 roundings on each path (inputs are exact bf16 in both; the same count as
     * tests/cpu/test_cpu_backend.c): the backend keeps g and u in bf16, rounds a from
     * them, rounds da' = dy W2_e, [dg;du] and the outputs y and dx.
     * y: g, u, a, y. dx: g, u, da', [dg;du], dx. dp: g, u, a, da'. dW13: g, u, da',
     * [dg;du]. dW2: g, u, a; plus d->cuda on dx and dW2. */
    int ok = report("y", rel_err_bf16(d->y, y, TH), 4);
    ok &= report("dx", rel_err_bf16(d->dx, dx, TH), 5 + d->cuda);
    ok &= report("dp", rel_err_f32(d->dp, dp, TK), 4);
    ok &= report("dW13", rel_err_f32(d->dw13, dw13, n13), 4);
    ok &= report("dW2", rel_err_f32(d->dw2, dw2, n2), 3 + d->cuda);
    free(x); free(dy); free(w13); free(w2); free(p); free(y); free(dx); free(dp);
    free(dw13); free(dw2);
    return ok;
}

/* When the full fp64 problem does not fit in host memory (qwen3-235b-a22b): y, dx
 * and dp of a token depend only on that token and its K experts, so the reference
 * runs on a few sampled tokens, one expert at a time (each expert's weights widened to
 * fp64 alone, about 150 MB at that size), and sums the experts' shares. The weight
 * gradients sum over every token and are not checked here (the full check on
 * qwen3-30b-a3b and the tests cover them). */
static int check_sampled_tokens(const step_data *d, int samples) {
    int S = samples < d->T ? samples : d->T, K = d->K, H = d->H, I = d->I;
    int64_t SH = (int64_t)S * H, SK = (int64_t)S * K;
    int64_t n13 = (int64_t)2 * I * H, n2 = (int64_t)H * I;
    int *tok = xmalloc(sizeof(int) * (size_t)S);
    for (int i = 0; i < S; i++) tok[i] = (int)((int64_t)i * d->T / S);
    double *x = xmalloc(SH * 8), *dy = xmalloc(SH * 8), *p = xmalloc(SK * 8);
    uint16_t *y_got = xmalloc(SH * 2), *dx_got = xmalloc(SH * 2);
    float *dp_got = xmalloc(SK * 4);
    for (int i = 0; i < S; i++) {
        for (int h = 0; h < H; h++) {
            x[(int64_t)i * H + h] = bf16_to_double(d->x[(int64_t)tok[i] * H + h]);
            dy[(int64_t)i * H + h] = bf16_to_double(d->dy[(int64_t)tok[i] * H + h]);
        }
        memcpy(y_got + (int64_t)i * H, d->y + (int64_t)tok[i] * H, (size_t)H * 2);
        memcpy(dx_got + (int64_t)i * H, d->dx + (int64_t)tok[i] * H, (size_t)H * 2);
        for (int k = 0; k < K; k++) {
            p[i * K + k] = d->p[(int64_t)tok[i] * K + k];
            dp_got[i * K + k] = d->dp[(int64_t)tok[i] * K + k];
        }
    }
    /* sums over the experts, and one expert's share */
    double *y = calloc((size_t)SH, 8), *dx = calloc((size_t)SH, 8), *dp = calloc((size_t)SK, 8);
    double *y_e = xmalloc(SH * 8), *dx_e = xmalloc(SH * 8), *dp_e = xmalloc(SK * 8);
    double *w13 = xmalloc(n13 * 8), *w2 = xmalloc(n2 * 8);
    double *dw13 = xmalloc(n13 * 8), *dw2 = xmalloc(n2 * 8);
    int32_t *ids = xmalloc(sizeof(int32_t) * (size_t)SK);
    if (!y || !dx || !dp) {
        fprintf(stderr, "out of host memory\n");
        exit(2);
    }
    mf_ref_shape s = {S, H, I, 1, K};
    int used = 0;
    for (int e = 0; e < d->E; e++) {
        int routed = 0;
        for (int i = 0; i < S; i++)
            for (int k = 0; k < K; k++) {
                int hit = d->ids[(int64_t)tok[i] * K + k] == e;
                ids[i * K + k] = hit ? 0 : -1;
                routed |= hit;
            }
        if (!routed) continue;
        used++;
        for (int64_t i = 0; i < n13; i++) w13[i] = bf16_to_double(d->w13[e * n13 + i]);
        for (int64_t i = 0; i < n2; i++) w2[i] = bf16_to_double(d->w2[e * n2 + i]);
        mf_ref_forward(&s, x, ids, p, w13, w2, y_e);
        mf_ref_backward(&s, x, ids, p, w13, w2, dy, dx_e, dp_e, dw13, dw2);
        for (int64_t i = 0; i < SH; i++) y[i] += y_e[i], dx[i] += dx_e[i];
        for (int64_t i = 0; i < SK; i++) dp[i] += dp_e[i]; /* 0 in the other experts' slots */
    }
    printf("check of %d sampled tokens (%d experts, one at a time) against the fp64 reference; "
           "weight gradients not checked at this size:\n", S, used);
    int ok = report("y", rel_err_bf16(y_got, y, SH), 4);
    ok &= report("dx", rel_err_bf16(dx_got, dx, SH), 4 + d->cuda);
    ok &= report("dp", rel_err_f32(dp_got, dp, SK), 3);
    void *bufs[] = {tok, x, dy, p, y_got, dx_got, dp_got, y, dx, dp, y_e, dx_e, dp_e, w13, w2,
                    dw13, dw2, ids};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) free(bufs[i]);
    return ok;
}

static moefuse_fwd_args step_fwd_args(const step_data *d, const uint16_t *x, const int32_t *ids,
                                      const float *p, const uint16_t *w13, const uint16_t *w2,
                                      uint16_t *y, void *saved, int32_t *counts) {
    return (moefuse_fwd_args){.num_tokens = d->T, .x = x, .x_stride = d->H, .ids = ids,
                              .weights = p, .w13 = w13, .w2 = w2, .y = y, .y_stride = d->H,
                              .saved = saved, .expert_counts = counts};
}

static moefuse_bwd_args step_bwd_args(const step_data *d, const moefuse_fwd_args *fa,
                                      size_t saved_bytes, const uint16_t *dy, uint16_t *dx,
                                      float *dp, float *dw13, float *dw2) {
    return (moefuse_bwd_args){.num_tokens = d->T, .x = fa->x, .x_stride = d->H, .ids = fa->ids,
                              .weights = fa->weights, .w13 = fa->w13, .w2 = fa->w2,
                              .saved = fa->saved, .saved_bytes = saved_bytes, .dy = dy,
                              .dy_stride = d->H, .dx = dx, .dx_stride = d->H, .dweights = dp,
                              .dw13 = dw13, .dw2 = dw2};
}

#ifdef MOEFUSE_HAVE_CUDA
#define CUDA_TRY(call)                                                                     \
    do {                                                                                   \
        cudaError_t e_ = (call);                                                           \
        if (e_ != cudaSuccess) {                                                           \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,                 \
                    cudaGetErrorString(e_));                                               \
            exit(2);                                                                       \
        }                                                                                  \
    } while (0)

static void *to_device(const void *host, size_t bytes) {
    void *dev;
    CUDA_TRY(cudaMalloc(&dev, bytes));
    if (host) CUDA_TRY(cudaMemcpy(dev, host, bytes, cudaMemcpyHostToDevice));
    else CUDA_TRY(cudaMemset(dev, 0xff, bytes)); /* poisoned outputs */
    return dev;
}

/* The same step on device copies of the inputs, timed with CUDA events (best of
 * `iters`); the outputs come back into d for the check. */
static void run_cuda_step(step_data *d, moefuse_layer *layer, size_t saved_bytes, int iters,
                          double *fwd_ms, double *bwd_ms) {
    size_t TH = (size_t)d->T * d->H * 2, TK = (size_t)d->T * d->K * 4;
    size_t n13 = (size_t)d->E * 2 * d->I * d->H, n2 = (size_t)d->E * d->H * d->I;
    uint16_t *x = to_device(d->x, TH), *dy = to_device(d->dy, TH);
    uint16_t *w13 = to_device(d->w13, n13 * 2), *w2 = to_device(d->w2, n2 * 2);
    int32_t *ids = to_device(d->ids, TK), *counts = to_device(NULL, (size_t)d->E * 4);
    float *p = to_device(d->p, TK), *dp = to_device(NULL, TK);
    uint16_t *y = to_device(NULL, TH), *dx = to_device(NULL, TH);
    float *dw13 = to_device(NULL, n13 * 4), *dw2 = to_device(NULL, n2 * 4);
    void *saved = to_device(NULL, saved_bytes);
    moefuse_fwd_args fa = step_fwd_args(d, x, ids, p, w13, w2, y, saved, counts);
    moefuse_bwd_args ba = step_bwd_args(d, &fa, saved_bytes, dy, dx, dp, dw13, dw2);
    cudaStream_t stream;
    cudaEvent_t ev[3];
    CUDA_TRY(cudaStreamCreate(&stream));
    for (int i = 0; i < 3; i++) CUDA_TRY(cudaEventCreate(&ev[i]));
    for (int it = -1; it < iters; it++) { /* it = -1 warms up */
        CUDA_TRY(cudaEventRecord(ev[0], stream));
        TRY(moefuse_forward(layer, &fa, stream));
        CUDA_TRY(cudaEventRecord(ev[1], stream));
        TRY(moefuse_backward(layer, &ba, stream));
        CUDA_TRY(cudaEventRecord(ev[2], stream));
        TRY(moefuse_layer_check(layer, stream));
        float f, b;
        CUDA_TRY(cudaEventElapsedTime(&f, ev[0], ev[1]));
        CUDA_TRY(cudaEventElapsedTime(&b, ev[1], ev[2]));
        if (it >= 0 && f < *fwd_ms) *fwd_ms = f;
        if (it >= 0 && b < *bwd_ms) *bwd_ms = b;
    }
    CUDA_TRY(cudaMemcpy(d->y, y, TH, cudaMemcpyDeviceToHost));
    CUDA_TRY(cudaMemcpy(d->dx, dx, TH, cudaMemcpyDeviceToHost));
    CUDA_TRY(cudaMemcpy(d->dp, dp, TK, cudaMemcpyDeviceToHost));
    CUDA_TRY(cudaMemcpy(d->dw13, dw13, n13 * 4, cudaMemcpyDeviceToHost));
    CUDA_TRY(cudaMemcpy(d->dw2, dw2, n2 * 4, cudaMemcpyDeviceToHost));
    CUDA_TRY(cudaMemcpy(d->counts, counts, (size_t)d->E * 4, cudaMemcpyDeviceToHost));
    void *bufs[] = {x, dy, w13, w2, ids, counts, p, dp, y, dx, dw13, dw2, saved};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) cudaFree(bufs[i]);
    for (int i = 0; i < 3; i++) cudaEventDestroy(ev[i]);
    cudaStreamDestroy(stream);
}

/* CUDA when this library has it and a usable GPU is present, else the CPU. */
static moefuse_backend default_backend(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        cudaGetLastError();
        return MOEFUSE_BACKEND_CPU;
    }
    struct cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess || prop.major != 9)
        return MOEFUSE_BACKEND_CPU;
    return MOEFUSE_BACKEND_CUDA;
}
#else
static void run_cuda_step(step_data *d, moefuse_layer *layer, size_t saved_bytes, int iters,
                          double *fwd_ms, double *bwd_ms) {
    (void)d; (void)layer; (void)saved_bytes; (void)iters; (void)fwd_ms; (void)bwd_ms;
    fprintf(stderr, "moefuse_step: built without CUDA\n");
    exit(2);
}
static moefuse_backend default_backend(void) { return MOEFUSE_BACKEND_CPU; }
#endif

static void usage(void) {
    fprintf(stderr, "usage: moefuse_step [--model qwen3-30b-a3b|qwen3-235b-a22b] [--tokens T]\n"
                    "                    [--backend cpu|cuda] [--pipeline staged|fused] [--iters N]\n"
                    "                    [--seed S] [--no-check]\n");
    exit(2);
}

int main(int argc, char **argv) {
    const model_shape *m = &MODELS[0];
    int T = -1, iters = 3, check = 1;
    moefuse_backend backend = default_backend();
    moefuse_pipeline pipeline = MOEFUSE_PIPELINE_STAGED;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--no-check")) { check = 0; continue; }
        if (!v) usage();
        i++;
        if (!strcmp(a, "--model")) {
            m = NULL;
            for (size_t j = 0; j < sizeof MODELS / sizeof *MODELS; j++)
                if (!strcmp(v, MODELS[j].name)) m = &MODELS[j];
            if (!m) usage();
        } else if (!strcmp(a, "--tokens")) T = atoi(v);
        else if (!strcmp(a, "--iters")) iters = atoi(v);
        else if (!strcmp(a, "--seed")) rng = strtoull(v, NULL, 0) | 1;
        else if (!strcmp(a, "--backend")) {
            if (!strcmp(v, "cpu")) backend = MOEFUSE_BACKEND_CPU;
            else if (!strcmp(v, "cuda")) backend = MOEFUSE_BACKEND_CUDA;
            else usage();
        } else if (!strcmp(a, "--pipeline")) {
            if (!strcmp(v, "staged")) pipeline = MOEFUSE_PIPELINE_STAGED;
            else if (!strcmp(v, "fused")) pipeline = MOEFUSE_PIPELINE_FUSED;
            else usage();
        } else usage();
    }
    /* CPU: a step of a few seconds, reference included. CUDA: a training-sized batch. */
    if (T < 0) T = backend == MOEFUSE_BACKEND_CPU ? 128 : 16384;
    if (T < 1 || iters < 1) usage();

    step_data d = {.T = T, .H = m->hidden, .I = m->intermediate, .E = m->num_experts,
                   .K = m->top_k, .cuda = backend == MOEFUSE_BACKEND_CUDA};
    make_inputs(&d);

    moefuse_config cfg;
    moefuse_config_init(&cfg, d.H, d.I, d.E, d.K, T);
    cfg.backend = backend;
    cfg.pipeline = pipeline;
    moefuse_layer *layer;
    TRY(moefuse_layer_create(&cfg, NULL, &layer));
    size_t saved_bytes;
    TRY(moefuse_saved_bytes(layer, T, &saved_bytes));
    /* Poison every output: the check then also proves each element was written. */
    memset(d.y, 0xff, (size_t)T * d.H * 2);
    memset(d.dx, 0xff, (size_t)T * d.H * 2);
    memset(d.dp, 0xff, (size_t)T * d.K * 4);
    memset(d.dw13, 0xff, (size_t)d.E * 2 * d.I * d.H * 4);
    memset(d.dw2, 0xff, (size_t)d.E * d.H * d.I * 4);

    double fwd_best = 1e30, bwd_best = 1e30;
    if (backend == MOEFUSE_BACKEND_CPU) {
        void *saved = xmalloc(saved_bytes);
        moefuse_fwd_args fa = step_fwd_args(&d, d.x, d.ids, d.p, d.w13, d.w2, d.y, saved, d.counts);
        moefuse_bwd_args ba = step_bwd_args(&d, &fa, saved_bytes, d.dy, d.dx, d.dp, d.dw13, d.dw2);
        for (int it = 0; it < iters; it++) {
            double t0 = now_ms();
            TRY(moefuse_forward(layer, &fa, NULL));
            double t1 = now_ms();
            TRY(moefuse_backward(layer, &ba, NULL));
            double t2 = now_ms();
            if (t1 - t0 < fwd_best) fwd_best = t1 - t0;
            if (t2 - t1 < bwd_best) bwd_best = t2 - t1;
        }
        free(saved);
    } else {
        run_cuda_step(&d, layer, saved_bytes, iters, &fwd_best, &bwd_best);
    }
    int busiest = 0, empty = 0;
    for (int e = 0; e < d.E; e++) {
        if (d.counts[e] > busiest) busiest = d.counts[e];
        empty += d.counts[e] == 0;
    }
    double flop_fwd = 6.0 * T * d.K * (double)d.H * d.I;
    printf("moefuse %s step%s: model %s T=%d K=%d (busiest expert %d slots, %d empty)\n",
           backend == MOEFUSE_BACKEND_CPU ? "cpu" : "cuda",
           backend == MOEFUSE_BACKEND_CPU          ? ""
           : pipeline == MOEFUSE_PIPELINE_FUSED ? " (fused pipeline)"
                                                : " (staged pipeline)",
           m->name, T, d.K, busiest, empty);
    printf("  forward  %9.2f ms  %7.1f GFLOP/s\n", fwd_best, flop_fwd / fwd_best * 1e-6);
    printf("  backward %9.2f ms  %7.1f GFLOP/s\n", bwd_best, 2 * flop_fwd / bwd_best * 1e-6);
    printf("  step     %9.2f ms  %7.1f GFLOP/s  (best of %d%s)\n", fwd_best + bwd_best,
           3 * flop_fwd / (fwd_best + bwd_best) * 1e-6, iters,
           backend == MOEFUSE_BACKEND_CUDA ? ", CUDA events" : ", wall clock");

    int ok = 1;
    if (check) {
        size_t ref_bytes = 8 * ((size_t)d.E * 3 * d.I * d.H * 2 + (size_t)T * d.H * 4);
        /* The full fp64 step costs about 140 ms per token on two cores. */
        ok = ref_bytes > REFERENCE_BYTES_MAX || T > 512 ? check_sampled_tokens(&d, 8)
                                                        : check_step(&d);
        printf("%s\n", ok ? "PASS: step matches the fp64 reference"
                          : "FAIL: step differs from the fp64 reference");
    }
    moefuse_layer_destroy(layer);
    return ok ? 0 : 1;
}
