/* The fixture of the expert-parallel tests: see cuda_ep.h. */
#include <cuda_runtime.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda_ep.h"
#include "fixture_cuda.h"
#include "harness.h"
#include "moefuse.h"
#ifdef MOEFUSE_HAVE_NCCL
#include <nccl.h>
#endif

char g_skip[512];  /* non-empty: why every case skips */
char g_case[160];  /* the running case's name */

double bf16_to_double(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* "{512, 0, 37}" */
const char *fmt_ints(char *buf, size_t size, const int *v, int n) {
    size_t o = (size_t)snprintf(buf, size, "{");
    for (int i = 0; i < n && o < size; i++)
        o += (size_t)snprintf(buf + o, size - o, "%s%d", i ? ", " : "", v[i]);
    if (o < size) snprintf(buf + o, size - o, "}");
    return buf;
}

/* ---- hangs: the process ends with a FAIL line ---------------------------------------- */

static char g_alarm_msg[256];

static void on_alarm(int sig) {
    (void)sig;
    if (write(STDOUT_FILENO, g_alarm_msg, strlen(g_alarm_msg)) < 0) _exit(2);
    _exit(1);
}

/* A wait that did not end. The spinning kernels cannot be stopped, so the process
 * exits here (without the CUDA runtime's teardown, which would wait for them). */
void hang_exit(const char *what, double seconds) {
    CHECK(0, "hang: %s not finished after %.0f s", what, seconds);
    printf("FAIL %s (hang: exiting)\n", g_case);
    fflush(stdout);
    _exit(1);
}

fixture G;

int result_alloc(result *r, int64_t tokens) {
    r->y = malloc((size_t)(tokens * kH) * 2);
    r->dx = malloc((size_t)(tokens * kH) * 2);
    r->dp = malloc((size_t)(tokens * kK) * 4);
    r->dw13 = malloc((size_t)(kE * kW13Expert) * 4);
    r->dw2 = malloc((size_t)(kE * kW2Expert) * 4);
    r->counts = malloc((size_t)kE * 4);
    return r->y && r->dx && r->dp && r->dw13 && r->dw2 && r->counts;
}

void result_free(result *r) {
    free(r->y);
    free(r->dx);
    free(r->dp);
    free(r->dw13);
    free(r->dw2);
    free(r->counts);
    memset(r, 0, sizeof *r);
}

/* Weights filled as bf16 rows directly (no fp64 copies: the check is bitwise). */
int fixture_setup(void) {
    const int64_t n13 = kE * kW13Expert, n2 = kE * kW2Expert;
    uint16_t *w13 = malloc((size_t)n13 * 2), *w2 = malloc((size_t)n2 * 2);
    int ok = w13 && w2 && result_alloc(&G.ref, kMaxRanks * kMaxTokens) &&
             result_alloc(&G.got, kMaxRanks * kMaxTokens);
    if (!ok) {
        printf("  out of host memory for the weights and results\n");
    } else {
        ct_fill_rows(w13, (int64_t)kE * 2 * kI, kH, 1.0 / sqrt((double)kH));
        ct_fill_rows(w2, (int64_t)kE * kH, kI, 1.0 / sqrt((double)kI));
        ok = cudaStreamCreateWithFlags(&G.stream, cudaStreamNonBlocking) == cudaSuccess &&
             cudaMalloc((void **)&G.w13, (size_t)n13 * 2) == cudaSuccess &&
             cudaMalloc((void **)&G.w2, (size_t)n2 * 2) == cudaSuccess &&
             cudaMalloc((void **)&G.dw13, (size_t)n13 * 4) == cudaSuccess &&
             cudaMalloc((void **)&G.dw2, (size_t)n2 * 4) == cudaSuccess &&
             cudaMemcpy(G.w13, w13, (size_t)n13 * 2, cudaMemcpyHostToDevice) == cudaSuccess &&
             cudaMemcpy(G.w2, w2, (size_t)n2 * 2, cudaMemcpyHostToDevice) == cudaSuccess;
        if (!ok) printf("  device setup failed: %s\n", cudaGetErrorString(cudaGetLastError()));
    }
    free(w13);
    free(w2);
    return ok;
}

/* G.w13's gate and up halves [E, I, H] each, in arrays of their own; made once, waited
 * for (the ranks' non-blocking streams do not wait for a device-to-device copy). */
int fixture_halves(void) {
    if (G.w13_gate) return 1;
    const size_t half = (size_t)kI * kH * 2, bytes = (size_t)kE * half;
    CUDA_OK(cudaMalloc((void **)&G.w13_gate, bytes));
    CUDA_OK(cudaMalloc((void **)&G.w13_up, bytes));
    CUDA_OK(ct_w13_halves_copy(G.w13, G.w13_gate, G.w13_up, half, kE, 1, G.stream));
    CUDA_OK(cudaStreamSynchronize(G.stream));
    return 1;
done:
    cudaFree(G.w13_gate);
    cudaFree(G.w13_up);
    G.w13_gate = G.w13_up = NULL;
    return 0;
}

static void fixture_teardown(void) {
    cudaFree(G.w13);
    cudaFree(G.w13_gate);
    cudaFree(G.w13_up);
    cudaFree(G.w2);
    cudaFree(G.dw13);
    cudaFree(G.dw2);
    if (G.stream) cudaStreamDestroy(G.stream);
    result_free(&G.ref);
    result_free(&G.got);
    memset(&G, 0, sizeof G);
}

/* SKIP without an sm_90 device; the fixture is made by the first case that runs. */
int ready(void) {
    if (g_skip[0]) {
        th_skip("%s", g_skip);
        return 0;
    }
    if (!G.tried) {
        G.tried = 1;
        G.ok = fixture_setup();
    }
    CHECK(G.ok, "the fixture could not be set up (see above)");
    return G.ok;
}

/* ids and p of every rank's tokens in b's order. skew_rank >= 0: every slot on the
 * experts of that rank (K distinct of its E/R). */
void draw_routing(const batch *b, routing r, int skew_rank, int32_t *ids, float *p) {
    const int Er = kE / b->R;
    for (int q = 0; q < b->R; q++) {
        int32_t *rank_ids = ids + b->off[q] * kK;
        if (skew_rank < 0) {
            ct_draw_ids(b->T[q], kK, kE, r, rank_ids);
            continue;
        }
        ct_draw_ids(b->T[q], kK, Er, r, rank_ids);
        for (int64_t s = 0; s < (int64_t)b->T[q] * kK; s++)
            if (rank_ids[s] >= 0) rank_ids[s] += skew_rank * Er;
    }
    ct_draw_weights((int)b->off[b->R], kK, p);
}

int batch_make(batch *b, int R, const int *T, routing r, int skew_rank) {
    memset(b, 0, sizeof *b);
    b->R = R;
    for (int q = 0; q < R; q++) {
        b->T[q] = T[q];
        b->off[q + 1] = b->off[q] + T[q];
    }
    const int64_t n = b->off[R] > 0 ? b->off[R] : 1;
    int ok = cudaMallocHost((void **)&b->x, (size_t)(n * kH) * 2) == cudaSuccess &&
             cudaMallocHost((void **)&b->dy, (size_t)(n * kH) * 2) == cudaSuccess &&
             cudaMallocHost((void **)&b->ids, (size_t)(n * kK) * 4) == cudaSuccess &&
             cudaMallocHost((void **)&b->p, (size_t)(n * kK) * 4) == cudaSuccess;
    CHECK(ok, "pinned host inputs: %s", cudaGetErrorString(cudaGetLastError()));
    if (!ok) return 0;
    th_fill_bf16_normal(b->x, NULL, b->off[R] * kH, 1.0);
    th_fill_bf16_normal(b->dy, NULL, b->off[R] * kH, 1.0);
    draw_routing(b, r, skew_rank, b->ids, b->p);
    return 1;
}

void batch_free(batch *b) {
    cudaFreeHost(b->x);
    cudaFreeHost(b->dy);
    cudaFreeHost(b->ids);
    cudaFreeHost(b->p);
    memset(b, 0, sizeof *b);
}

/* ---- comparing two results ----------------------------------------------------------- */

double elem_value(elem k, const void *base, int64_t i) {
    if (k == ELEM_BF16) return bf16_to_double(((const uint16_t *)base)[i]);
    if (k == ELEM_F32) return ((const float *)base)[i];
    return ((const int32_t *)base)[i];
}

int64_t count_nan(elem k, const void *v, int64_t n) {
    int64_t c = 0;
#pragma omp parallel for reduction(+ : c) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const double x = elem_value(k, v, i);
        c += x != x;
    }
    return c;
}

/* got == want bit for bit, n elements in rows of `cols` (row0: the id of the first
 * row; want_name: what made want). Else records how many differ, the first one and the
 * largest |difference|. 1 when equal. */
int same_bits(int rank, const char *what, elem k, const void *got, const void *want,
              const char *want_name, int64_t n, int64_t cols, const char *row_name,
              int64_t row0) {
    const size_t es = k == ELEM_BF16 ? 2 : 4;
    if (n == 0 || !memcmp(got, want, (size_t)n * es)) return 1;
    int64_t ndiff = 0, nnan = 0, first = n;
    double maxd = 0;
#pragma omp parallel for reduction(+ : ndiff, nnan) reduction(min : first) \
    reduction(max : maxd) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        if (!memcmp((const char *)got + i * (int64_t)es, (const char *)want + i * (int64_t)es, es))
            continue;
        ndiff++;
        if (i < first) first = i;
        const double d = fabs(elem_value(k, got, i) - elem_value(k, want, i));
        if (d != d) nnan++;
        else if (d > maxd) maxd = d;
    }
    CHECK(0, "rank %d: %s differs from %s in %lld of %lld elements; first at %s %lld "
          "element %lld (%.9g, %s: %.9g); max |diff| %.3e; %lld NaN", rank, what, want_name,
          (long long)ndiff, (long long)n, row_name, (long long)(row0 + first / cols),
          (long long)(first % cols), elem_value(k, got, first), want_name,
          elem_value(k, want, first), maxd, (long long)nnan);
    return 0;
}

/* Each rank's part of `got` against the same part of `want`; the number of parts that
 * differ. dW13 per expert: its gate rows [0, I) (elements below I * H), then its up rows
 * [I, 2I). */
int compare_results(const batch *b, const result *want, const char *want_name,
                    const result *got) {
    const int Er = kE / b->R;
    const char *n = want_name;
    int bad = 0;
    for (int r = 0; r < b->R; r++) {
        const int64_t t0 = b->off[r], nt = b->T[r], e0 = (int64_t)r * Er;
        bad += !same_bits(r, "y", ELEM_BF16, got->y + t0 * kH, want->y + t0 * kH, n, nt * kH,
                          kH, "rank-local token", 0);
        bad += !same_bits(r, "dx", ELEM_BF16, got->dx + t0 * kH, want->dx + t0 * kH, n, nt * kH,
                          kH, "rank-local token", 0);
        bad += !same_bits(r, "dweights", ELEM_F32, got->dp + t0 * kK, want->dp + t0 * kK, n,
                          nt * kK, kK, "rank-local token", 0);
        bad += !same_bits(r, "dW13", ELEM_F32, got->dw13 + e0 * kW13Expert,
                          want->dw13 + e0 * kW13Expert, n, Er * kW13Expert, kW13Expert, "expert",
                          e0);
        bad += !same_bits(r, "dW2", ELEM_F32, got->dw2 + e0 * kW2Expert,
                          want->dw2 + e0 * kW2Expert, n, Er * kW2Expert, kW2Expert, "expert", e0);
        bad += !same_bits(r, "expert_counts", ELEM_I32, got->counts + e0, want->counts + e0, n,
                          Er, 1, "expert", e0);
    }
    return bad;
}

/* The run that made res (what) wrote every output (else equal poison would pass as
 * equal bits), and its expert_counts are the host's. */
void check_reference(const batch *b, const result *res, const char *what) {
    const int64_t nt = b->off[b->R];
    const int64_t nan = count_nan(ELEM_BF16, res->y, nt * kH) +
                        count_nan(ELEM_BF16, res->dx, nt * kH) +
                        count_nan(ELEM_F32, res->dp, nt * kK) +
                        count_nan(ELEM_F32, res->dw13, kE * kW13Expert) +
                        count_nan(ELEM_F32, res->dw2, kE * kW2Expert);
    CHECK(nan == 0, "%s left %lld outputs unwritten (NaN)", what, (long long)nan);
    int32_t want[kE];
    memset(want, 0, sizeof want);
    for (int64_t s = 0; s < nt * kK; s++)
        if (b->ids[s] >= 0) want[b->ids[s]]++;
    CHECK(!memcmp(want, res->counts, sizeof want), "%s: expert_counts are wrong", what);
}

/* ---- the reference: one layer, R = 1, on the concatenated batch ----------------------- */

/* The buffer is poisoned (0xff: NaN codes and scales) first: a new allocation may
 * reuse a freed one's bytes, the weights of another run. */
int fp8_weights_make(moefuse_layer *layer, int64_t e0, int halves, cudaStream_t stream,
                     void **buf, moefuse_fp8_weights *w) {
    const int64_t h0 = e0 * kI * kH; /* expert e0 in a half [E, I, H] */
    size_t bytes = 0;
    MF_OK(moefuse_fp8_weights_bytes(layer, &bytes));
    CUDA_OK(cudaMalloc(buf, bytes));
    CUDA_OK(cudaMemsetAsync(*buf, 0xff, bytes, stream));
    MF_OK(moefuse_fp8_weights_view(layer, *buf, w));
    if (halves)
        MF_OK(moefuse_quantize_weights_halves(layer, MOEFUSE_DTYPE_BF16, G.w13_gate + h0,
                                              G.w13_up + h0, G.w2 + e0 * kW2Expert, w, stream));
    else
        MF_OK(moefuse_quantize_weights(layer, MOEFUSE_DTYPE_BF16, G.w13 + e0 * kW13Expert,
                                       G.w2 + e0 * kW2Expert, w, stream));
    return 1;
done:
    return 0;
}

int ref_run(const batch *b, int max_tokens, moefuse_saved_mode mode, moefuse_precision precision,
            result *out) {
    const int64_t nt = b->off[b->R], n1 = nt > 0 ? nt : 1;
    const cudaStream_t st = G.stream;
    moefuse_layer *layer = NULL;
    uint16_t *x = NULL, *dy = NULL, *y = NULL, *dx = NULL;
    int32_t *ids = NULL, *counts = NULL;
    float *p = NULL, *dp = NULL;
    void *saved = NULL, *fp8_buf = NULL;
    moefuse_fp8_weights fp8;
    size_t saved_bytes = 0;
    int ok = 0;
    moefuse_config cfg;
    moefuse_config_init(&cfg, kH, kI, kE, kK, max_tokens);
    cfg.backend = MOEFUSE_BACKEND_CUDA;
    cfg.saved_mode = mode;
    cfg.precision = precision;
    MF_OK(moefuse_layer_create(&cfg, NULL, &layer));
    const int is_fp8 = precision == MOEFUSE_PRECISION_FP8_BLOCK;
    if (is_fp8 && !fp8_weights_make(layer, 0, 0, st, &fp8_buf, &fp8)) goto done;
    MF_OK(moefuse_saved_bytes(layer, (int)nt, &saved_bytes));
    CUDA_OK(cudaMalloc((void **)&x, (size_t)(n1 * kH) * 2));
    CUDA_OK(cudaMalloc((void **)&dy, (size_t)(n1 * kH) * 2));
    CUDA_OK(cudaMalloc((void **)&y, (size_t)(n1 * kH) * 2));
    CUDA_OK(cudaMalloc((void **)&dx, (size_t)(n1 * kH) * 2));
    CUDA_OK(cudaMalloc((void **)&ids, (size_t)(n1 * kK) * 4));
    CUDA_OK(cudaMalloc((void **)&p, (size_t)(n1 * kK) * 4));
    CUDA_OK(cudaMalloc((void **)&dp, (size_t)(n1 * kK) * 4));
    CUDA_OK(cudaMalloc((void **)&counts, (size_t)kE * 4));
    CUDA_OK(cudaMalloc(&saved, saved_bytes));
    CUDA_OK(cudaMemcpyAsync(x, b->x, (size_t)(nt * kH) * 2, cudaMemcpyHostToDevice, st));
    CUDA_OK(cudaMemcpyAsync(dy, b->dy, (size_t)(nt * kH) * 2, cudaMemcpyHostToDevice, st));
    CUDA_OK(cudaMemcpyAsync(ids, b->ids, (size_t)(nt * kK) * 4, cudaMemcpyHostToDevice, st));
    CUDA_OK(cudaMemcpyAsync(p, b->p, (size_t)(nt * kK) * 4, cudaMemcpyHostToDevice, st));
    CUDA_OK(cudaMemsetAsync(y, 0xff, (size_t)(n1 * kH) * 2, st));
    CUDA_OK(cudaMemsetAsync(dx, 0xff, (size_t)(n1 * kH) * 2, st));
    CUDA_OK(cudaMemsetAsync(dp, 0xff, (size_t)(n1 * kK) * 4, st));
    CUDA_OK(cudaMemsetAsync(counts, 0xff, (size_t)kE * 4, st));
    CUDA_OK(cudaMemsetAsync(G.dw13, 0xff, (size_t)(kE * kW13Expert) * 4, st));
    CUDA_OK(cudaMemsetAsync(G.dw2, 0xff, (size_t)(kE * kW2Expert) * 4, st));
    const moefuse_fwd_args a = {
        .num_tokens = (int)nt, .x = x, .x_stride = kH, .ids = ids, .weights = p,
        .w13 = G.w13, .w2 = G.w2, .y = y, .y_stride = kH, .saved = saved,
        .expert_counts = counts, .fp8_weights = is_fp8 ? &fp8 : NULL,
    };
    const moefuse_bwd_args g = {
        .num_tokens = (int)nt, .x = x, .x_stride = kH, .ids = ids, .weights = p,
        .w13 = G.w13, .w2 = G.w2, .saved = saved, .saved_bytes = saved_bytes, .dy = dy, .dy_stride = kH, .dx = dx,
        .dx_stride = kH, .dweights = dp, .dw13 = G.dw13, .dw2 = G.dw2, .accumulate = 0,
        .fp8_weights = is_fp8 ? &fp8 : NULL,
    };
    MF_OK(moefuse_forward(layer, &a, st));
    MF_OK(moefuse_backward(layer, &g, st));
    MF_OK(moefuse_layer_check(layer, st));
    CUDA_OK(cudaMemcpy(out->y, y, (size_t)(nt * kH) * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(out->dx, dx, (size_t)(nt * kH) * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(out->dp, dp, (size_t)(nt * kK) * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(out->counts, counts, (size_t)kE * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(out->dw13, G.dw13, (size_t)(kE * kW13Expert) * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(out->dw2, G.dw2, (size_t)(kE * kW2Expert) * 4, cudaMemcpyDeviceToHost));
    check_reference(b, out, "the R = 1 run");
    ok = 1;
done:
    cudaStreamSynchronize(st);
    moefuse_layer_destroy(layer);
    cudaFree(x);
    cudaFree(dy);
    cudaFree(y);
    cudaFree(dx);
    cudaFree(ids);
    cudaFree(p);
    cudaFree(dp);
    cudaFree(counts);
    cudaFree(saved);
    cudaFree(fp8_buf);
    return ok;
}

/* ---- main ------------------------------------------------------------------------------- */

static void detect_device(void) {
    struct cudaDeviceProp prop;
    if (ct_detect_sm90(g_skip, sizeof g_skip, &prop))
        printf("device: %s, %d SMs, %.0f GiB\n", prop.name, prop.multiProcessorCount,
               (double)prop.totalGlobalMem / (1 << 30));
}

/* A case under the watchdog: a case still running after kCaseSeconds ends the process. */
static void run_case(void (*fn)(void), const char *what, const char *filter) {
    snprintf(g_case, sizeof g_case, "cuda_ep %s %s", kModelName, what);
    if (filter && !strstr(g_case, filter)) return;
    snprintf(g_alarm_msg, sizeof g_alarm_msg, "FAIL %s (still running after %d s: a hang? "
             "exiting)\n", g_case, kCaseSeconds);
    alarm(kCaseSeconds);
    th_run(g_case, fn);
    alarm(0);
}
int ep_main(int argc, char **argv, const named_case *cases, int n) {
    setvbuf(stdout, NULL, _IOLBF, 0); /* lines before a hang exit are not lost */
    setenv("NCCL_NVLS_ENABLE", "0", 0);  /* moefuse never uses NVLS (DESIGN 4) */
    /* R = 8 virtual ranks: 2 streams each + ours (moefuse_comm_create_virtual) */
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
    signal(SIGALRM, on_alarm);
    th_seed_from_env_or_clock();
    detect_device();
    const char *filter = argc > 1 ? argv[1] : NULL;
    for (int i = 0; i < n; i++) run_case(cases[i].fn, cases[i].what, filter);
    fixture_teardown();
    return th_finish();
}
