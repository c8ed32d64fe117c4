/* The fixture of the CUDA backward tests: see cuda_backward.h. */
#include <cuda_runtime.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_backward.h"
#include "fixture_cuda.h"
#include "harness.h"
#include "internal.h"
#include "moefuse.h"
#include "reference.h"

static const model kModels[] = {
    {"qwen3-30b-a3b", 2048, 768, 128, 8},
    {"qwen3-235b-a22b (E=16)", 4096, 1536, 16, 8},
};

char g_skip[512];
fixture F;

double bf(uint16_t v) { return (double)mf_bf16_to_float(v); }
int64_t n13(void) { return (int64_t)F.m->E * 2 * F.m->I * F.m->H; }
int64_t n2(void) { return (int64_t)F.m->E * F.m->H * F.m->I; }

moefuse_layer *make_layer(moefuse_saved_mode mode, moefuse_pipeline pipeline,
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

int ready(void) {
    if (g_skip[0]) {
        th_skip("%s", g_skip);
        return 0;
    }
    CHECK(F.layer != NULL, "%s: the fixture could not be set up (see above)", F.m->name);
    return F.layer != NULL;
}

int inputs_make(inputs *in, int T, routing r, int64_t pad) {
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

void inputs_free(inputs *in) {
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

moefuse_bwd_args bwd_args(const inputs *in, int accumulate) {
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
moefuse_status run_fwd_bwd(moefuse_layer *layer, const inputs *in, int poison_dw) {
    return run_fwd_bwd_halves(layer, in, poison_dw, NULL);
}

moefuse_status run_fwd_bwd_halves(moefuse_layer *layer, const inputs *in, int poison_dw,
                                  const w13_halves *h) {
    const int64_t T1 = in->T > 0 ? in->T : 1;
    cudaMemsetAsync(in->dx_d, 0xff, (size_t)(T1 * in->dx_stride) * 2, F.stream);
    cudaMemsetAsync(in->dp_d, 0xff, (size_t)(T1 * in->K) * 4, F.stream);
    if (poison_dw) {
        if (h) {
            cudaMemsetAsync(h->dw13, 0xff, (size_t)n13() * 2, F.stream);
            cudaMemsetAsync(h->dw13_up, 0xff, (size_t)n13() * 2, F.stream);
        } else {
            cudaMemsetAsync(F.dw13_d, 0xff, (size_t)n13() * 4, F.stream);
        }
        cudaMemsetAsync(F.dw2_d, 0xff, (size_t)n2() * 4, F.stream);
    }
    moefuse_fwd_args a;
    memset(&a, 0, sizeof a);
    a.num_tokens = in->T;
    a.x = in->x_d;
    a.x_stride = in->x_stride;
    a.ids = in->ids_d;
    a.weights = in->p_d;
    a.w13 = h ? h->w13 : F.w13_d;
    a.w13_up = h ? h->w13_up : NULL;
    a.w2 = F.w2_d;
    a.y = in->y_d;
    a.y_stride = F.m->H;
    a.saved = in->saved_d;
    moefuse_status st = moefuse_forward(layer, &a, F.stream);
    if (st != MOEFUSE_OK) return st;
    moefuse_bwd_args b = bwd_args(in, !poison_dw);
    if (h) {
        b.w13 = h->w13;
        b.w13_up = h->w13_up;
        b.dw13 = h->dw13;
        b.dw13_up = h->dw13_up;
    }
    st = moefuse_backward(layer, &b, F.stream);
    if (st != MOEFUSE_OK) return st;
    return moefuse_layer_check(layer, F.stream);
}

cudaError_t w13_halves_copy(void *packed, void *gate, void *up, size_t elem, int to_halves) {
    return ct_w13_halves_copy(packed, gate, up, (size_t)F.m->I * F.m->H * elem, F.m->E,
                              to_halves, F.stream);
}

/* The write-mode backward of `in` into the bf16 weight gradients d13 / d2 (no fp32 ones),
 * synchronized. */
moefuse_status backward_dw_bf16_on(moefuse_layer *layer, const inputs *in, uint16_t *d13,
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

moefuse_status backward_dw_bf16(const inputs *in, uint16_t *d13, uint16_t *d2) {
    return backward_dw_bf16_on(F.layer, in, d13, d2);
}

int outputs_get(outputs *o, const inputs *in) {
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

int outputs_equal(const outputs *a, const outputs *b) {
    return !memcmp(a->dx, b->dx, a->dx_bytes) && !memcmp(a->dp, b->dp, a->dp_bytes) &&
           !memcmp(a->dw13, b->dw13, (size_t)n13() * 4) && !memcmp(a->dw2, b->dw2, (size_t)n2() * 4);
}

void outputs_free(outputs *o) {
    free(o->dx);
    free(o->dp);
    free(o->dw13);
    free(o->dw2);
    memset(o, 0, sizeof *o);
}

/* ---- main --------------------------------------------------------------------------- */

static void detect_device(void) {
    struct cudaDeviceProp prop;
    if (ct_detect_sm90(g_skip, sizeof g_skip, &prop))
        printf("device: %s, %d SMs; %d host threads for the reference\n", prop.name,
               prop.multiProcessorCount, omp_get_max_threads());
}

/* A model's fixture, made unless every case skips. */
static void begin(const model *m) {
    memset(&F, 0, sizeof F);
    F.m = m;
    if (!g_skip[0]) fixture_setup(m);
}

int backward_main(int argc, char **argv, const named_case *cases, int n) {
    th_seed_from_env_or_clock();
    detect_device();
    const int n_models = (int)(sizeof kModels / sizeof kModels[0]);
    return ct_run_models(argc, argv, "cuda_backward", kModels, n_models, begin, fixture_teardown,
                         cases, n);
}
