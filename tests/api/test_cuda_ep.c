/* Expert parallelism with R virtual ranks in this process on one GPU
 * (moefuse_comm_create_virtual), forward + backward, against ONE layer with R = 1 run
 * on the concatenated batch (rank 0's tokens first, then rank 1's, ...), bit for bit.
 *
 * Rank r holds experts r*E/R .. (r+1)*E/R - 1: its w13 / w2 / dw13 / dw2 are those
 * experts' rows of the global tensors. A rank receives the rows of each of its experts
 * in the concatenated order (source rank, then token), so the EP run is expected to
 * have the bits of the R = 1 run: y, dx and dweights of each rank's tokens, dW13, dW2
 * and expert_counts of each rank's experts. Any difference fails, reported with the
 * first differing element and the largest |difference|.
 *
 *   - R in {2, 4, 8} with T = 512 on every rank; T different on every rank with a T = 0
 *     rank (its token tensors NULL in one case, as the API allows); dropped slots;
 *   - skew: every slot of every rank on the experts of one rank (R = 4 and 8, up to
 *     R * max_tokens * K received rows), also onto the rank with T = 0;
 *   - MOEFUSE_RECOMPUTE (every other case saves activations);
 *   - MOEFUSE_PIPELINE_FUSED on the ranks (forward: gemm1 and gemm2 in one kernel beside
 *     the push; backward: dW2, dgrad1 into the source ranks' combine rows and dW13 in one
 *     kernel) against the staged R = 1 run: R = 4 with uneven T and a T = 0 rank, R = 8
 *     skew.
 *     The R = 1 reference runs staged, so the first fused case also launches the fused
 *     kernel for the first time inside an EP call: before the backend loaded every kernel
 *     at create, CUDA's lazy loading hung it there (docs/decisions/0015-ep-transport);
 *   - timeout: rank 3 of 4 never calls; moefuse_layer_check of the others reports
 *     MOEFUSE_ERR_TIMEOUT naming the rank, within a host bound, and y is untouched;
 *     layers made again on the same comm, then on a new comm, give the R = 1 bits;
 *   - the backward's failures after a good forward: one rank's saved buffer rejected
 *     (the others fail at once, naming it), one rank that never calls its backward
 *     (the others time out); no dx written; new layers give the R = 1 bits;
 *   - 1000 forward + backward iterations, R = 2, routing re-drawn every iteration and
 *     no host synchronization between iterations; iterations 0, 1, 2, 499 and 999
 *     against R = 1, every iteration's moefuse_layer_check at the end, time printed;
 *   - the comm's refusals: a call before every rank's layer exists, a second layer for
 *     a rank, moefuse_comm_destroy with live layers; the comm works afterwards.
 *
 * The R = 1 CUDA layer is checked against the fp64 reference by test_cuda_forward and
 * test_cuda_backward; this file checks that expert parallelism changes no bit. All
 * outputs of both runs are poisoned first (0xff bytes, NaN), the R = 1 run must write
 * every one of them (no NaN left), and rows past a rank's T must keep the poison.
 *
 * Every EP run is waited for with a host bound (kWaitSeconds), and every case runs
 * under a watchdog (kCaseSeconds): a hang ends the process with a FAIL line instead of
 * hanging a GPU CI job (kernels that spin cannot be stopped from the host).
 *
 * test_cuda_ep [case-substring]. With no sm_90 device every case prints SKIP. */
#include <cuda_runtime.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "fixture_cuda.h"
#include "harness.h"
#include "moefuse.h"
#ifdef MOEFUSE_HAVE_NCCL
#include <nccl.h>
#endif

/* qwen3-30b-a3b */
#define kModelName "qwen3-30b-a3b"
enum { kH = 2048, kI = 768, kE = 128, kK = 8 };
#define kW13Expert ((int64_t)2 * kI * kH) /* elements of one expert's W13 */
#define kW2Expert ((int64_t)kH * kI)

#define kMaxRanks 8
#define kMaxTokens 512           /* per rank, in every case but the iterations */
#define kIterTokens 256          /* per rank, in the iterations */
#define kIterations 1000
#define kTimeoutMs 200           /* the comm's bound in the timeout case */
#define kTimeoutBoundSeconds 10.0 /* the host's bound there */
#define kWaitSeconds 120.0       /* the host's bound on any other EP run (comm: 30 s a wait) */
#define kCaseSeconds 300         /* the watchdog of one case */

static char g_skip[512];  /* non-empty: why every case skips */
static char g_case[160];  /* the running case's name */

static double bf16_to_double(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* "{512, 0, 37}" */
static const char *fmt_ints(char *buf, size_t size, const int *v, int n) {
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
static void hang_exit(const char *what, double seconds) {
    CHECK(0, "hang: %s not finished after %.0f s", what, seconds);
    printf("FAIL %s (hang: exiting)\n", g_case);
    fflush(stdout);
    _exit(1);
}

/* ---- the fixture: every expert's weights on the device, host result buffers ----------- */

typedef struct result {   /* one run's outputs on the host, in the concatenated order */
    uint16_t *y, *dx;     /* [tokens, H] bf16 */
    float *dp;            /* [tokens, K] */
    float *dw13, *dw2;    /* [E, 2I, H], [E, H, I] */
    int32_t *counts;      /* [E] */
} result;

typedef struct fixture {
    int tried, ok;
    uint16_t *w13, *w2;   /* device [E, 2I, H], [E, H, I] bf16: every rank's experts */
    float *dw13, *dw2;    /* device [E, 2I, H], [E, H, I] fp32: the R = 1 run's */
    cudaStream_t stream;  /* the R = 1 run's */
    result ref, got;      /* host, for kMaxRanks * kMaxTokens tokens */
    int use_nccl;         /* one-rank comms over NCCL (case_nccl_r1) */
} fixture;

static fixture G;

static int result_alloc(result *r, int64_t tokens) {
    r->y = malloc((size_t)(tokens * kH) * 2);
    r->dx = malloc((size_t)(tokens * kH) * 2);
    r->dp = malloc((size_t)(tokens * kK) * 4);
    r->dw13 = malloc((size_t)(kE * kW13Expert) * 4);
    r->dw2 = malloc((size_t)(kE * kW2Expert) * 4);
    r->counts = malloc((size_t)kE * 4);
    return r->y && r->dx && r->dp && r->dw13 && r->dw2 && r->counts;
}

static void result_free(result *r) {
    free(r->y);
    free(r->dx);
    free(r->dp);
    free(r->dw13);
    free(r->dw2);
    free(r->counts);
    memset(r, 0, sizeof *r);
}

/* Weights filled as bf16 rows directly (no fp64 copies: the check is bitwise). */
static int fixture_setup(void) {
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

static void fixture_teardown(void) {
    cudaFree(G.w13);
    cudaFree(G.w2);
    cudaFree(G.dw13);
    cudaFree(G.dw2);
    if (G.stream) cudaStreamDestroy(G.stream);
    result_free(&G.ref);
    result_free(&G.got);
    memset(&G, 0, sizeof G);
}

/* SKIP without an sm_90 device; the fixture is made by the first case that runs. */
static int ready(void) {
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

/* ---- a batch: every rank's inputs, concatenated -------------------------------------- */

typedef struct batch {
    int R;
    int T[kMaxRanks];
    int64_t off[kMaxRanks + 1]; /* rank r's tokens: rows off[r] .. off[r+1]-1 */
    uint16_t *x, *dy;           /* pinned host [off[R], H] */
    int32_t *ids;               /* pinned host [off[R], K] */
    float *p;                   /* pinned host [off[R], K] */
} batch;

/* ids and p of every rank's tokens in b's order. skew_rank >= 0: every slot on the
 * experts of that rank (K distinct of its E/R). */
static void draw_routing(const batch *b, routing r, int skew_rank, int32_t *ids, float *p) {
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

static int batch_make(batch *b, int R, const int *T, routing r, int skew_rank) {
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

static void batch_free(batch *b) {
    cudaFreeHost(b->x);
    cudaFreeHost(b->dy);
    cudaFreeHost(b->ids);
    cudaFreeHost(b->p);
    memset(b, 0, sizeof *b);
}

/* ---- comparing two results ----------------------------------------------------------- */

typedef enum elem { ELEM_BF16, ELEM_F32, ELEM_I32 } elem;

static double elem_value(elem k, const void *base, int64_t i) {
    if (k == ELEM_BF16) return bf16_to_double(((const uint16_t *)base)[i]);
    if (k == ELEM_F32) return ((const float *)base)[i];
    return ((const int32_t *)base)[i];
}

static int64_t count_nan(elem k, const void *v, int64_t n) {
    int64_t c = 0;
#pragma omp parallel for reduction(+ : c) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const double x = elem_value(k, v, i);
        c += x != x;
    }
    return c;
}

/* got == want bit for bit, n elements in rows of `cols` (row0: the id of the first
 * row). Else records how many differ, the first one and the largest |difference|.
 * 1 when equal. */
static int same_bits(int rank, const char *what, elem k, const void *got, const void *want,
                     int64_t n, int64_t cols, const char *row_name, int64_t row0) {
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
    CHECK(0, "rank %d: %s differs from R = 1 in %lld of %lld elements; first at %s %lld "
          "element %lld (%.9g, R = 1: %.9g); max |diff| %.3e; %lld NaN", rank, what,
          (long long)ndiff, (long long)n, row_name, (long long)(row0 + first / cols),
          (long long)(first % cols), elem_value(k, got, first), elem_value(k, want, first),
          maxd, (long long)nnan);
    return 0;
}

/* Each rank's part of `got` against the same part of `ref`; the number of parts that
 * differ. */
static int compare_results(const batch *b, const result *ref, const result *got) {
    const int Er = kE / b->R;
    int bad = 0;
    for (int r = 0; r < b->R; r++) {
        const int64_t t0 = b->off[r], nt = b->T[r], e0 = (int64_t)r * Er;
        bad += !same_bits(r, "y", ELEM_BF16, got->y + t0 * kH, ref->y + t0 * kH, nt * kH, kH,
                          "rank-local token", 0);
        bad += !same_bits(r, "dx", ELEM_BF16, got->dx + t0 * kH, ref->dx + t0 * kH, nt * kH, kH,
                          "rank-local token", 0);
        bad += !same_bits(r, "dweights", ELEM_F32, got->dp + t0 * kK, ref->dp + t0 * kK, nt * kK,
                          kK, "rank-local token", 0);
        bad += !same_bits(r, "dW13", ELEM_F32, got->dw13 + e0 * kW13Expert,
                          ref->dw13 + e0 * kW13Expert, Er * kW13Expert, kW13Expert, "expert", e0);
        bad += !same_bits(r, "dW2", ELEM_F32, got->dw2 + e0 * kW2Expert,
                          ref->dw2 + e0 * kW2Expert, Er * kW2Expert, kW2Expert, "expert", e0);
        bad += !same_bits(r, "expert_counts", ELEM_I32, got->counts + e0, ref->counts + e0, Er, 1,
                          "expert", e0);
    }
    return bad;
}

/* The R = 1 run wrote every output (else equal poison would pass as equal bits), and
 * its expert_counts are the host's. */
static void check_reference(const batch *b, const result *res) {
    const int64_t nt = b->off[b->R];
    const int64_t nan = count_nan(ELEM_BF16, res->y, nt * kH) +
                        count_nan(ELEM_BF16, res->dx, nt * kH) +
                        count_nan(ELEM_F32, res->dp, nt * kK) +
                        count_nan(ELEM_F32, res->dw13, kE * kW13Expert) +
                        count_nan(ELEM_F32, res->dw2, kE * kW2Expert);
    CHECK(nan == 0, "the R = 1 run left %lld outputs unwritten (NaN)", (long long)nan);
    int32_t want[kE];
    memset(want, 0, sizeof want);
    for (int64_t s = 0; s < nt * kK; s++)
        if (b->ids[s] >= 0) want[b->ids[s]]++;
    CHECK(!memcmp(want, res->counts, sizeof want), "the R = 1 run's expert_counts are wrong");
}

/* ---- the reference: one layer, R = 1, on the concatenated batch ----------------------- */

static int ref_run(const batch *b, int max_tokens, moefuse_saved_mode mode, result *out) {
    const int64_t nt = b->off[b->R], n1 = nt > 0 ? nt : 1;
    const cudaStream_t st = G.stream;
    moefuse_layer *layer = NULL;
    uint16_t *x = NULL, *dy = NULL, *y = NULL, *dx = NULL;
    int32_t *ids = NULL, *counts = NULL;
    float *p = NULL, *dp = NULL;
    void *saved = NULL;
    size_t saved_bytes = 0;
    int ok = 0;
    moefuse_config cfg;
    moefuse_config_init(&cfg, kH, kI, kE, kK, max_tokens);
    cfg.backend = MOEFUSE_BACKEND_CUDA;
    cfg.saved_mode = mode;
    MF_OK(moefuse_layer_create(&cfg, NULL, &layer));
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
        .expert_counts = counts,
    };
    const moefuse_bwd_args g = {
        .num_tokens = (int)nt, .x = x, .x_stride = kH, .ids = ids, .weights = p,
        .w13 = G.w13, .w2 = G.w2, .saved = saved, .saved_bytes = saved_bytes, .dy = dy, .dy_stride = kH, .dx = dx,
        .dx_stride = kH, .dweights = dp, .dw13 = G.dw13, .dw2 = G.dw2, .accumulate = 0,
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
    check_reference(b, out);
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
    return ok;
}

/* ---- R ranks: a comm, a layer, a stream and buffers per rank ----------------------------- */

typedef struct rank_state {
    moefuse_layer *layer;
    cudaStream_t stream;
    uint16_t *x, *dy, *y, *dx; /* device [max_tokens, H] */
    int32_t *ids;              /* device [max_tokens, K] */
    float *p, *dp;             /* device [max_tokens, K] */
    int32_t *counts;           /* device [E/R] */
    float *dw13, *dw2;         /* device [E/R, 2I, H], [E/R, H, I] fp32 */
    void *saved;               /* device, saved_cap bytes */
    size_t saved_cap;
} rank_state;

typedef struct ep {
    int R, max_tokens;         /* max_tokens: per rank, the same on every rank */
    moefuse_saved_mode mode;
    int null_if_empty;         /* ranks with T = 0 pass NULL token tensors */
    moefuse_pipeline pipeline; /* the ranks' forward (the R = 1 reference runs staged) */
    moefuse_comm *comm;
    void *nccl;                /* an ncclComm_t of one rank when the comm is NCCL's */
    rank_state rk[kMaxRanks];
} ep;

/* A moefuse call of rank r: a failure is recorded with the rank and the message. */
static int rank_ok(moefuse_status st, int r, const char *what) {
    CHECK(st == MOEFUSE_OK, "rank %d: %s: %s: %s", r, what, moefuse_status_string(st),
          moefuse_last_error());
    return st == MOEFUSE_OK;
}

/* The comm, streams and buffers; no layers yet. 0 on failure (recorded); ep_close
 * cleans up either way. */
/* A one-rank NCCL communicator (this process, this GPU) and moefuse's comm over it. */
static int open_nccl_comm(ep *s) {
#ifdef MOEFUSE_HAVE_NCCL
    ncclUniqueId id;
    ncclComm_t comm = NULL;
    ncclResult_t r = ncclGetUniqueId(&id);
    if (r == ncclSuccess) r = ncclCommInitRank(&comm, 1, id, 0);
    CHECK(r == ncclSuccess, "one-rank NCCL communicator: %s", ncclGetErrorString(r));
    if (r != ncclSuccess) return 0;
    s->nccl = comm;
    MF_OK(moefuse_comm_create_nccl(comm, &s->comm));
    return 1;
done:
    return 0;
#else
    (void)s;
    return 0;
#endif
}

static int ep_open(ep *s, int R, int max_tokens, moefuse_saved_mode mode) {
    memset(s, 0, sizeof *s);
    s->R = R;
    s->max_tokens = max_tokens;
    s->mode = mode;
    const int64_t Er = kE / R, cap = max_tokens;
    if (R == 1 && G.use_nccl) {
        if (!open_nccl_comm(s)) goto done;
    } else {
        MF_OK(moefuse_comm_create_virtual(R, &s->comm));
    }
    for (int r = 0; r < R; r++) {
        rank_state *k = &s->rk[r];
        CUDA_OK(cudaStreamCreateWithFlags(&k->stream, cudaStreamNonBlocking));
        CUDA_OK(cudaMalloc((void **)&k->x, (size_t)(cap * kH) * 2));
        CUDA_OK(cudaMalloc((void **)&k->dy, (size_t)(cap * kH) * 2));
        CUDA_OK(cudaMalloc((void **)&k->y, (size_t)(cap * kH) * 2));
        CUDA_OK(cudaMalloc((void **)&k->dx, (size_t)(cap * kH) * 2));
        CUDA_OK(cudaMalloc((void **)&k->ids, (size_t)(cap * kK) * 4));
        CUDA_OK(cudaMalloc((void **)&k->p, (size_t)(cap * kK) * 4));
        CUDA_OK(cudaMalloc((void **)&k->dp, (size_t)(cap * kK) * 4));
        CUDA_OK(cudaMalloc((void **)&k->counts, (size_t)Er * 4));
        CUDA_OK(cudaMalloc((void **)&k->dw13, (size_t)(Er * kW13Expert) * 4));
        CUDA_OK(cudaMalloc((void **)&k->dw2, (size_t)(Er * kW2Expert) * 4));
    }
    return 1;
done:
    return 0;
}

static moefuse_config ep_config(const ep *s, int r) {
    moefuse_config c;
    moefuse_config_init(&c, kH, kI, kE, kK, s->max_tokens);
    c.num_ranks = s->R;
    c.rank = r;
    c.backend = MOEFUSE_BACKEND_CUDA;
    c.saved_mode = s->mode;
    c.pipeline = s->pipeline;
    return c;
}

static moefuse_status ep_layer_create(ep *s, int r) {
    const moefuse_config c = ep_config(s, r);
    return moefuse_layer_create(&c, s->comm, &s->rk[r].layer);
}

static int ep_layers_create(ep *s) {
    for (int r = 0; r < s->R; r++)
        if (!rank_ok(ep_layer_create(s, r), r, "moefuse_layer_create")) return 0;
    return 1;
}

static void ep_layers_destroy(ep *s) {
    for (int r = 0; r < s->R; r++) {
        rank_ok(moefuse_layer_destroy(s->rk[r].layer), r, "moefuse_layer_destroy");
        s->rk[r].layer = NULL;
    }
}

/* Waits for the streams of ranks 0..n-1, at most `seconds` (a hang ends the process).
 * 0 on a CUDA error (recorded). */
static int ep_wait(const ep *s, int n, double seconds) {
    const double t0 = now_s();
    const struct timespec nap = {0, 100000};
    for (;;) {
        int pending = 0;
        for (int r = 0; r < n; r++) {
            if (!s->rk[r].stream) continue;
            const cudaError_t e = cudaStreamQuery(s->rk[r].stream);
            if (e == cudaErrorNotReady) {
                pending++;
            } else if (e != cudaSuccess) {
                CHECK(0, "rank %d's stream: %s", r, cudaGetErrorString(e));
                return 0;
            }
        }
        if (!pending) return 1;
        if (now_s() - t0 > seconds) {
            char what[64];
            snprintf(what, sizeof what, "%d of ranks 0..%d", pending, n - 1);
            hang_exit(what, seconds);
        }
        nanosleep(&nap, NULL);
    }
}

static void ep_close(ep *s) {
    ep_wait(s, s->R, kWaitSeconds);
    ep_layers_destroy(s);
    if (s->comm) {
        const moefuse_status st = moefuse_comm_destroy(s->comm);
        CHECK(st == MOEFUSE_OK, "moefuse_comm_destroy: %s: %s", moefuse_status_string(st),
              moefuse_last_error());
    }
#ifdef MOEFUSE_HAVE_NCCL
    if (s->nccl) ncclCommDestroy((ncclComm_t)s->nccl);
#endif
    for (int r = 0; r < s->R; r++) {
        rank_state *k = &s->rk[r];
        cudaFree(k->x);
        cudaFree(k->dy);
        cudaFree(k->y);
        cudaFree(k->dx);
        cudaFree(k->ids);
        cudaFree(k->p);
        cudaFree(k->dp);
        cudaFree(k->counts);
        cudaFree(k->dw13);
        cudaFree(k->dw2);
        cudaFree(k->saved);
        if (k->stream) cudaStreamDestroy(k->stream);
    }
    memset(s, 0, sizeof *s);
}

/* Rank r's saved buffer big enough for b. cudaFree / cudaMalloc may synchronize the
 * device, so this runs for every rank before any rank launches. */
static int ep_prepare(ep *s, const batch *b, int r) {
    rank_state *k = &s->rk[r];
    size_t bytes = 0;
    if (!rank_ok(moefuse_saved_bytes(k->layer, b->T[r], &bytes), r, "moefuse_saved_bytes"))
        return 0;
    if (bytes <= k->saved_cap) return 1;
    cudaFree(k->saved);
    k->saved = NULL;
    k->saved_cap = 0;
    CUDA_OK(cudaMalloc(&k->saved, bytes));
    k->saved_cap = bytes;
    return 1;
done:
    return 0;
}

/* Inputs of b to every rank's buffers, on the rank's stream (x and dy skipped when
 * routing_only). */
static int ep_upload(const ep *s, const batch *b, int routing_only) {
    for (int r = 0; r < s->R; r++) {
        const rank_state *k = &s->rk[r];
        const int64_t o = b->off[r], T = b->T[r];
        if (!routing_only) {
            CUDA_OK(cudaMemcpyAsync(k->x, b->x + o * kH, (size_t)(T * kH) * 2,
                                    cudaMemcpyHostToDevice, k->stream));
            CUDA_OK(cudaMemcpyAsync(k->dy, b->dy + o * kH, (size_t)(T * kH) * 2,
                                    cudaMemcpyHostToDevice, k->stream));
        }
        CUDA_OK(cudaMemcpyAsync(k->ids, b->ids + o * kK, (size_t)(T * kK) * 4,
                                cudaMemcpyHostToDevice, k->stream));
        CUDA_OK(cudaMemcpyAsync(k->p, b->p + o * kK, (size_t)(T * kK) * 4,
                                cudaMemcpyHostToDevice, k->stream));
    }
    return 1;
done:
    return 0;
}

/* Every output buffer of every rank, whole, to 0xff bytes (NaN). */
static int ep_poison(const ep *s) {
    const int64_t Er = kE / s->R, cap = s->max_tokens;
    for (int r = 0; r < s->R; r++) {
        const rank_state *k = &s->rk[r];
        CUDA_OK(cudaMemsetAsync(k->y, 0xff, (size_t)(cap * kH) * 2, k->stream));
        CUDA_OK(cudaMemsetAsync(k->dx, 0xff, (size_t)(cap * kH) * 2, k->stream));
        CUDA_OK(cudaMemsetAsync(k->dp, 0xff, (size_t)(cap * kK) * 4, k->stream));
        CUDA_OK(cudaMemsetAsync(k->counts, 0xff, (size_t)Er * 4, k->stream));
        CUDA_OK(cudaMemsetAsync(k->dw13, 0xff, (size_t)(Er * kW13Expert) * 4, k->stream));
        CUDA_OK(cudaMemsetAsync(k->dw2, 0xff, (size_t)(Er * kW2Expert) * 4, k->stream));
    }
    return 1;
done:
    return 0;
}

/* Rank r's args: its tokens, its experts' weights and gradients. */
static moefuse_fwd_args ep_fwd_args(const ep *s, const batch *b, int r) {
    const rank_state *k = &s->rk[r];
    const int none = b->T[r] == 0 && s->null_if_empty;
    const int64_t e0 = (int64_t)r * (kE / s->R);
    const moefuse_fwd_args a = {
        .num_tokens = b->T[r], .x = none ? NULL : k->x, .x_stride = kH,
        .ids = none ? NULL : k->ids, .weights = none ? NULL : k->p,
        .w13 = G.w13 + e0 * kW13Expert, .w2 = G.w2 + e0 * kW2Expert,
        .y = none ? NULL : k->y, .y_stride = kH, .saved = k->saved, .expert_counts = k->counts,
    };
    return a;
}

static moefuse_bwd_args ep_bwd_args(const ep *s, const batch *b, int r) {
    const rank_state *k = &s->rk[r];
    const moefuse_fwd_args a = ep_fwd_args(s, b, r);
    const moefuse_bwd_args g = {
        .num_tokens = a.num_tokens, .x = a.x, .x_stride = kH, .ids = a.ids, .weights = a.weights,
        .w13 = a.w13, .w2 = a.w2, .saved = k->saved, .saved_bytes = k->saved_cap, .dy = a.x ? k->dy : NULL, .dy_stride = kH,
        .dx = a.x ? k->dx : NULL, .dx_stride = kH, .dweights = a.x ? k->dp : NULL,
        .dw13 = k->dw13, .dw2 = k->dw2, .accumulate = 0,
    };
    return g;
}

/* Every rank's forward, each on its stream, then every rank's backward; no wait (the
 * ranks' kernels wait on each other, so all must be launched first). */
static int ep_launch(ep *s, const batch *b) {
    for (int r = 0; r < s->R; r++)
        if (!ep_prepare(s, b, r)) return 0;
    for (int r = 0; r < s->R; r++) {
        const moefuse_fwd_args a = ep_fwd_args(s, b, r);
        if (!rank_ok(moefuse_forward(s->rk[r].layer, &a, s->rk[r].stream), r, "moefuse_forward"))
            return 0;
    }
    for (int r = 0; r < s->R; r++) {
        const moefuse_bwd_args g = ep_bwd_args(s, b, r);
        if (!rank_ok(moefuse_backward(s->rk[r].layer, &g, s->rk[r].stream), r, "moefuse_backward"))
            return 0;
    }
    return 1;
}

static int ep_check(const ep *s) {
    int ok = 1;
    for (int r = 0; r < s->R; r++)
        ok &= rank_ok(moefuse_layer_check(s->rk[r].layer, s->rk[r].stream), r,
                      "moefuse_layer_check");
    return ok;
}

/* The first n of a rank's cap device rows into dst; rows n..cap-1 must hold the poison. */
static int fetch_rows(void *dst, const void *src, int n, int cap, size_t row_bytes,
                      const char *what, int r) {
    const size_t all_bytes = (size_t)cap * row_bytes, n_bytes = (size_t)n * row_bytes;
    uint8_t *all = malloc(all_bytes);
    const int ok = all && cudaMemcpy(all, src, all_bytes, cudaMemcpyDeviceToHost) == cudaSuccess;
    CHECK(ok, "rank %d: copy of %s: %s", r, what, cudaGetErrorString(cudaGetLastError()));
    if (ok) {
        memcpy(dst, all, n_bytes);
        int64_t touched = 0;
        for (size_t i = n_bytes; i < all_bytes; i++) touched += all[i] != 0xff;
        CHECK(touched == 0, "rank %d (T = %d): %lld bytes of %s past row T were written", r, n,
              (long long)touched, what);
    }
    free(all);
    return ok;
}

/* Every rank's outputs into `out`, in the concatenated order (after ep_wait). */
static int ep_gather(const ep *s, const batch *b, result *out) {
    const int64_t Er = kE / s->R;
    int ok = 1;
    for (int r = 0; r < s->R && ok; r++) {
        const rank_state *k = &s->rk[r];
        const int64_t o = b->off[r], e0 = r * Er;
        ok = fetch_rows(out->y + o * kH, k->y, b->T[r], s->max_tokens, kH * 2, "y", r) &&
             fetch_rows(out->dx + o * kH, k->dx, b->T[r], s->max_tokens, kH * 2, "dx", r) &&
             fetch_rows(out->dp + o * kK, k->dp, b->T[r], s->max_tokens, kK * 4, "dweights", r);
        CUDA_OK(cudaMemcpy(out->dw13 + e0 * kW13Expert, k->dw13, (size_t)(Er * kW13Expert) * 4,
                           cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(out->dw2 + e0 * kW2Expert, k->dw2, (size_t)(Er * kW2Expert) * 4,
                           cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(out->counts + e0, k->counts, (size_t)Er * 4, cudaMemcpyDeviceToHost));
    }
    return ok;
done:
    return 0;
}

/* One forward + backward of b on every rank, waited for, checked, gathered. */
static int ep_step(ep *s, const batch *b, result *out) {
    return ep_poison(s) && ep_upload(s, b, 0) && ep_launch(s, b) &&
           ep_wait(s, s->R, kWaitSeconds) && ep_check(s) && ep_gather(s, b, out);
}

/* b on the ranks of s against the R = 1 layer on the concatenated batch. */
static void check_equal(ep *s, const batch *b) {
    if (!ref_run(b, s->R * s->max_tokens, s->mode, &G.ref) || !ep_step(s, b, &G.got)) return;
    const int bad = compare_results(b, &G.ref, &G.got);
    int rows[kMaxRanks];
    const int Er = kE / s->R;
    for (int r = 0; r < s->R; r++) {
        rows[r] = 0;
        for (int e = r * Er; e < (r + 1) * Er; e++) rows[r] += G.ref.counts[e];
    }
    char ts[96], rs[128];
    printf("    R=%d T=%s, rows received %s, %s: %s\n", s->R, fmt_ints(ts, sizeof ts, b->T, s->R),
           fmt_ints(rs, sizeof rs, rows, s->R),
           s->mode == MOEFUSE_RECOMPUTE ? "recompute" : "saved activations",
           bad ? "DIFFERS from R = 1" : "every output bitwise equal to R = 1");
}

/* ---- cases ------------------------------------------------------------------------------ */

typedef struct ep_case {
    int R;
    int T[kMaxRanks];           /* tokens of each rank */
    routing route;
    int skew, skew_rank;        /* skew: every slot on skew_rank's experts */
    moefuse_saved_mode mode;
    int null_if_empty;          /* ranks with T = 0 pass NULL token tensors */
    moefuse_pipeline pipeline;
} ep_case;

static void equality_case(const ep_case *c) {
    if (!ready()) return;
    batch b;
    ep s;
    memset(&s, 0, sizeof s);
    if (batch_make(&b, c->R, c->T, c->route, c->skew ? c->skew_rank : -1) &&
        ep_open(&s, c->R, kMaxTokens, c->mode)) {
        s.null_if_empty = c->null_if_empty;
        s.pipeline = c->pipeline;
        if (ep_layers_create(&s)) check_equal(&s, &b);
    }
    ep_close(&s);
    batch_free(&b);
}

#define M kMaxTokens
static void case_r1(void) { equality_case(&(ep_case){.R = 1, .T = {M}}); }
static void case_r2(void) { equality_case(&(ep_case){.R = 2, .T = {M, M}}); }

/* One rank over a real NCCL communicator: its windows registered with NCCL, the peer
 * table from ncclGetPeerPointer; and moefuse_comm_create_nccl refusing NVLS. (More
 * ranks need more GPUs.) */
static void case_nccl_r1(void) {
#ifdef MOEFUSE_HAVE_NCCL
    if (!ready()) return;
    ncclUniqueId id;
    ncclComm_t comm = NULL;
    ncclResult_t r = ncclGetUniqueId(&id);
    if (r == ncclSuccess) r = ncclCommInitRank(&comm, 1, id, 0);
    CHECK(r == ncclSuccess, "one-rank NCCL communicator: %s", ncclGetErrorString(r));
    if (r != ncclSuccess) return;
    unsetenv("NCCL_NVLS_ENABLE");
    moefuse_comm *mc = (moefuse_comm *)0x1;
    const moefuse_status st = moefuse_comm_create_nccl(comm, &mc);
    CHECK(st == MOEFUSE_ERR_UNSUPPORTED && strstr(moefuse_last_error(), "NCCL_NVLS_ENABLE"),
          "without NCCL_NVLS_ENABLE=0: %s: %s", moefuse_status_string(st), moefuse_last_error());
    CHECK(mc == NULL, "no comm on failure");
    printf("    refused: %s\n", moefuse_last_error());
    setenv("NCCL_NVLS_ENABLE", "0", 1);
    ncclCommDestroy(comm);
    G.use_nccl = 1;
    equality_case(&(ep_case){.R = 1, .T = {M}});
    G.use_nccl = 0;
#else
    th_skip("built without NCCL (no nccl_device.h and libnccl.so.2 under NCCL_HOME)");
#endif
}
static void case_r4(void) { equality_case(&(ep_case){.R = 4, .T = {M, M, M, M}}); }
static void case_r8(void) { equality_case(&(ep_case){.R = 8, .T = {M, M, M, M, M, M, M, M}}); }
static void case_r2_uneven(void) { equality_case(&(ep_case){.R = 2, .T = {1, 333}}); }
static void case_r4_uneven(void) { equality_case(&(ep_case){.R = 4, .T = {M, 0, 37, 300}}); }
static void case_r8_uneven_null(void) {
    equality_case(&(ep_case){.R = 8, .T = {5, M, 0, 128, 1, 77, 256, 400}, .null_if_empty = 1});
}
static void case_r4_dropped(void) {
    equality_case(&(ep_case){.R = 4, .T = {300, M, 64, 0}, .route = ROUTE_DROPPED});
}
static void case_skew_r4(void) {
    equality_case(&(ep_case){.R = 4, .T = {M, M, M, M}, .skew = 1, .skew_rank = 3});
}
static void case_skew_r4_onto_empty(void) {
    equality_case(&(ep_case){.R = 4, .T = {M, 0, 100, M}, .skew = 1, .skew_rank = 1});
}
static void case_skew_r8(void) {
    equality_case(&(ep_case){.R = 8, .T = {M, M, M, M, M, M, M, M}, .skew = 1, .skew_rank = 0});
}
static void case_fused_r4(void) {
    equality_case(&(ep_case){.R = 4, .T = {M, 0, 37, 300}, .pipeline = MOEFUSE_PIPELINE_FUSED});
}
static void case_fused_skew_r8(void) {
    equality_case(&(ep_case){.R = 8, .T = {M, M, M, M, M, M, M, M}, .skew = 1, .skew_rank = 0,
                             .pipeline = MOEFUSE_PIPELINE_FUSED});
}
static void case_recompute_r4(void) {
    equality_case(&(ep_case){.R = 4, .T = {M, 0, 37, 300}, .mode = MOEFUSE_RECOMPUTE});
}
#undef M

/* Rank 3 of 4 never calls: the other ranks' waits run out after kTimeoutMs, their
 * calls write nothing and moefuse_layer_check reports MOEFUSE_ERR_TIMEOUT naming the
 * rank. Then layers made again on the same comm, and a new comm, match R = 1. */
/* Elements of a device bf16 buffer that no longer hold the poison (0xffff), through the
 * host buffer `host` of `bytes`; -1 when the copy fails (recorded). */
static int64_t unpoisoned(const uint16_t *dev, uint16_t *host, size_t bytes) {
    const cudaError_t e = cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost);
    CHECK(e == cudaSuccess, "cudaMemcpy: %s", cudaGetErrorString(e));
    if (e != cudaSuccess) return -1;
    int64_t n = 0;
    for (size_t i = 0; i < bytes / 2; i++) n += host[i] != 0xffff;
    return n;
}

/* The failure cases' start: R = 4 ranks of 256 tokens, the comm's bound kTimeoutMs (set
 * before the layers: right whether they read it when made or at each call), buffers
 * sized, outputs poisoned, inputs uploaded. 0 on failure (recorded). */
static int failure_case_open(batch *b, ep *s) {
    const int T[4] = {256, 256, 256, 256};
    memset(s, 0, sizeof *s);
    if (!batch_make(b, 4, T, ROUTE_RANDOM, -1) ||
        !ep_open(s, 4, kMaxTokens, MOEFUSE_SAVE_ACTIVATIONS))
        return 0;
    MF_OK(moefuse_comm_set_timeout_ms(s->comm, kTimeoutMs));
    if (!ep_layers_create(s)) return 0;
    for (int r = 0; r < s->R; r++)
        if (!ep_prepare(s, b, r)) return 0;
    return ep_poison(s) && ep_upload(s, b, 0);
done:
    return 0;
}

static void case_timeout(void) {
    if (!ready()) return;
    const int R = 4;
    batch b;
    ep s;
    uint16_t *y = NULL;
    if (!failure_case_open(&b, &s)) goto done;
    for (int r = 0; r < R - 1; r++) {
        const moefuse_fwd_args a = ep_fwd_args(&s, &b, r);
        if (!rank_ok(moefuse_forward(s.rk[r].layer, &a, s.rk[r].stream), r, "moefuse_forward"))
            goto done;
    }
    const double t0 = now_s();
    if (!ep_wait(&s, R - 1, kTimeoutBoundSeconds)) goto done;
    printf("    ranks 0..%d finished %.0f ms after their launch (comm timeout %d ms)\n", R - 2,
           1e3 * (now_s() - t0), kTimeoutMs);
    const size_t yb = (size_t)(kMaxTokens * kH) * 2;
    y = malloc(yb);
    for (int r = 0; r < R - 1; r++) {
        const moefuse_status st = moefuse_layer_check(s.rk[r].layer, s.rk[r].stream);
        const char *msg = moefuse_last_error();
        CHECK(st == MOEFUSE_ERR_TIMEOUT, "rank %d: moefuse_layer_check: %s (%s), expected "
              "MOEFUSE_ERR_TIMEOUT", r, moefuse_status_string(st), msg);
        CHECK(strstr(msg, "rank") && (strcasestr(msg, "timeout") || strcasestr(msg, "timed out")),
              "rank %d: the message should name the rank and the timeout: \"%s\"", r, msg);
        printf("    rank %d: %s: %s\n", r, moefuse_status_string(st), msg);
        const int64_t touched = unpoisoned(s.rk[r].y, y, yb);
        CHECK(touched == 0, "rank %d: the timed-out forward wrote %lld elements of y", r,
              (long long)touched);
    }
    const moefuse_status st3 = moefuse_layer_check(s.rk[R - 1].layer, s.rk[R - 1].stream);
    printf("    rank %d (never called): moefuse_layer_check: %s %s\n", R - 1,
           moefuse_status_string(st3), moefuse_last_error());

    /* "layers created again on the comm start from clean flags"; the default bound */
    ep_layers_destroy(&s);
    MF_OK(moefuse_comm_set_timeout_ms(s.comm, 30000));
    if (!ep_layers_create(&s)) goto done;
    printf("    layers made again on the same comm:\n");
    check_equal(&s, &b);

    ep_close(&s);
    if (!ep_open(&s, R, kMaxTokens, MOEFUSE_SAVE_ACTIVATIONS) || !ep_layers_create(&s)) goto done;
    printf("    a new comm and layers:\n");
    check_equal(&s, &b);
done:
    free(y);
    ep_close(&s);
    batch_free(&b);
}

/* The backward's failures, R = 4 after a good forward on every rank:
 *   rejected  rank 2's saved header is overwritten: rank 2 reports MOEFUSE_ERR_SAVED_STATE
 *             and the others MOEFUSE_ERR_TIMEOUT naming rank 2, at once (rank 2 raises
 *             its READY flag as failed, so nobody waits out the bound or pushes rows);
 *   missing   rank 3 never calls its backward: ranks 0..2 report MOEFUSE_ERR_TIMEOUT
 *             naming rank 3 within the host bound.
 * Neither writes any dx or d p; layers made again on the comm then give the R = 1 bits. */
static void backward_failure(int rejected) {
    if (!ready()) return;
    const int R = 4, odd = rejected ? 2 : 3;
    batch b;
    ep s;
    uint16_t *dx = NULL;
    if (!failure_case_open(&b, &s)) goto done;
    for (int r = 0; r < R; r++) {
        const moefuse_fwd_args a = ep_fwd_args(&s, &b, r);
        if (!rank_ok(moefuse_forward(s.rk[r].layer, &a, s.rk[r].stream), r, "moefuse_forward"))
            goto done;
    }
    if (!ep_wait(&s, R, kWaitSeconds) || !ep_check(&s)) goto done;
    if (rejected) CUDA_OK(cudaMemset(s.rk[odd].saved, 0x5a, 64));
    const double t0 = now_s();
    for (int r = 0; r < R; r++) {
        if (!rejected && r == odd) continue;
        const moefuse_bwd_args g = ep_bwd_args(&s, &b, r);
        if (!rank_ok(moefuse_backward(s.rk[r].layer, &g, s.rk[r].stream), r, "moefuse_backward"))
            goto done;
    }
    if (!ep_wait(&s, R, kTimeoutBoundSeconds)) goto done;
    printf("    the backwards finished %.0f ms after their launch (comm timeout %d ms)\n",
           1e3 * (now_s() - t0), kTimeoutMs);
    const size_t dxb = (size_t)(kMaxTokens * kH) * 2;
    dx = malloc(dxb);
    for (int r = 0; r < R; r++) {
        if (!rejected && r == odd) continue;
        const moefuse_status st = moefuse_layer_check(s.rk[r].layer, s.rk[r].stream);
        const char *msg = moefuse_last_error();
        char peer[32];
        snprintf(peer, sizeof peer, "rank %d", odd);
        if (r == odd)
            CHECK(st == MOEFUSE_ERR_SAVED_STATE, "rank %d: moefuse_layer_check: %s (%s), expected "
                  "MOEFUSE_ERR_SAVED_STATE", r, moefuse_status_string(st), msg);
        else
            CHECK(st == MOEFUSE_ERR_TIMEOUT && strstr(msg, peer),
                  "rank %d: moefuse_layer_check: %s (%s), expected MOEFUSE_ERR_TIMEOUT naming %s",
                  r, moefuse_status_string(st), msg, peer);
        printf("    rank %d: %s: %s\n", r, moefuse_status_string(st), msg);
        const int64_t touched = unpoisoned(s.rk[r].dx, dx, dxb);
        CHECK(touched == 0, "rank %d: the failed backward wrote %lld elements of dx", r,
              (long long)touched);
    }
    if (rejected)
        CHECK(now_s() - t0 < 0.5 * kTimeoutMs / 1e3, "the rejected saved buffer should fail the "
              "other ranks at once, not after the %d ms bound", kTimeoutMs);

    ep_layers_destroy(&s);
    MF_OK(moefuse_comm_set_timeout_ms(s.comm, 30000));
    if (!ep_layers_create(&s)) goto done;
    printf("    layers made again on the same comm:\n");
    check_equal(&s, &b);
done:
    free(dx);
    ep_close(&s);
    batch_free(&b);
}

static void case_bwd_rejected_saved(void) { backward_failure(1); }
static void case_bwd_missing_rank(void) { backward_failure(0); }

static int iteration_checked(int it) {
    return it <= 2 || it == kIterations / 2 - 1 || it == kIterations - 1;
}

/* kIterations forward + backward on R = 2, new routing every iteration, launched back to
 * back: the routing of every iteration is drawn before the loop into pinned memory and
 * copied on the ranks' streams, so nothing waits on the host between iterations except
 * at the checked ones (poisoned, waited for, compared with a fresh R = 1 run). The time
 * per iteration is over the unchecked stretches 3..999. */
static void case_iterations(void) {
    if (!ready()) return;
    const int R = 2, T[2] = {kIterTokens, kIterTokens};
    batch b;
    ep s;
    memset(&s, 0, sizeof s);
    int32_t *ids = NULL;
    float *p = NULL;
    if (!batch_make(&b, R, T, ROUTE_RANDOM, -1) ||
        !ep_open(&s, R, kIterTokens, MOEFUSE_SAVE_ACTIVATIONS) || !ep_layers_create(&s))
        goto done;
    const int64_t slots = b.off[R] * kK;
    CUDA_OK(cudaMallocHost((void **)&ids, (size_t)(kIterations * slots) * 4));
    CUDA_OK(cudaMallocHost((void **)&p, (size_t)(kIterations * slots) * 4));
    for (int it = 0; it < kIterations; it++)
        draw_routing(&b, ROUTE_RANDOM, -1, ids + it * slots, p + it * slots);
    if (!ep_upload(&s, &b, 0)) goto done; /* x and dy: the same every iteration */
    double t0 = now_s(), busy = 0;
    int timed = 0, last = -1, differing = 0;
    for (int it = 0; it < kIterations; it++) {
        batch v = b;
        v.ids = ids + it * slots;
        v.p = p + it * slots;
        const int checked = iteration_checked(it);
        if (checked && !ep_poison(&s)) goto done;
        if (!ep_upload(&s, &v, 1) || !ep_launch(&s, &v)) goto done;
        if (!checked) continue;
        if (!ep_wait(&s, R, kWaitSeconds)) goto done;
        if (last >= 2) {
            busy += now_s() - t0;
            timed += it - last;
        }
        if (!ep_gather(&s, &v, &G.got) || !ref_run(&v, R * kIterTokens, s.mode, &G.ref)) goto done;
        const int bad = compare_results(&v, &G.ref, &G.got);
        differing += bad != 0;
        printf("    iteration %d: %s\n", it, bad ? "DIFFERS from R = 1" : "bitwise equal to R = 1");
        last = it;
        t0 = now_s();
    }
    if (!ep_wait(&s, R, kWaitSeconds)) goto done;
    CHECK(ep_check(&s), "moefuse_layer_check after %d iterations (see above)", kIterations);
    CHECK(differing == 0, "%d checked iterations differ from R = 1", differing);
    if (timed > 0)
        printf("    %.3f ms per iteration (forward + backward, R=%d, T=%d per rank, over %d "
               "iterations without a host synchronization)\n", 1e3 * busy / timed, R,
               kIterTokens, timed);
done:
    cudaFreeHost(ids);
    cudaFreeHost(p);
    ep_close(&s);
    batch_free(&b);
}

/* What the comm refuses: a call before every rank's layer exists, a second layer for a
 * rank, destroying it with live layers. None of it breaks the comm. */
static void case_refusals(void) {
    if (!ready()) return;
    const int R = 2, T[2] = {64, 64};
    batch b;
    ep s;
    memset(&s, 0, sizeof s);
    moefuse_layer *second = NULL;
    if (!batch_make(&b, R, T, ROUTE_RANDOM, -1) || !ep_open(&s, R, 64, MOEFUSE_SAVE_ACTIVATIONS))
        goto done;
    MF_OK(ep_layer_create(&s, 0));
    if (!ep_prepare(&s, &b, 0) || !ep_upload(&s, &b, 0)) goto done;

    const moefuse_fwd_args a = ep_fwd_args(&s, &b, 0);
    moefuse_status st = moefuse_forward(s.rk[0].layer, &a, s.rk[0].stream);
    CHECK(st == MOEFUSE_ERR_INVALID_CONFIG && strstr(moefuse_last_error(), "rank 1"),
          "forward before rank 1's layer exists: %s (%s), expected MOEFUSE_ERR_INVALID_CONFIG "
          "naming rank 1", moefuse_status_string(st), moefuse_last_error());
    printf("    forward before rank 1's layer: %s: %s\n", moefuse_status_string(st),
           moefuse_last_error());
    const moefuse_bwd_args g = ep_bwd_args(&s, &b, 0);
    st = moefuse_backward(s.rk[0].layer, &g, s.rk[0].stream);
    CHECK(st == MOEFUSE_ERR_INVALID_CONFIG && strstr(moefuse_last_error(), "rank 1"),
          "backward before rank 1's layer exists: %s (%s), expected MOEFUSE_ERR_INVALID_CONFIG "
          "naming rank 1", moefuse_status_string(st), moefuse_last_error());

    MF_OK(ep_layer_create(&s, 1));
    const moefuse_config c1 = ep_config(&s, 1);
    st = moefuse_layer_create(&c1, s.comm, &second);
    CHECK(st == MOEFUSE_ERR_INVALID_CONFIG && second == NULL,
          "a second layer for rank 1: %s (%s), expected MOEFUSE_ERR_INVALID_CONFIG and no layer",
          moefuse_status_string(st), moefuse_last_error());
    printf("    a second layer for rank 1: %s: %s\n", moefuse_status_string(st),
           moefuse_last_error());

    st = moefuse_comm_destroy(s.comm);
    CHECK(st == MOEFUSE_ERR_INVALID_CONFIG && strstr(moefuse_last_error(), "rank"),
          "moefuse_comm_destroy with live layers: %s (%s), expected MOEFUSE_ERR_INVALID_CONFIG "
          "naming a rank", moefuse_status_string(st), moefuse_last_error());
    printf("    moefuse_comm_destroy with live layers: %s: %s\n", moefuse_status_string(st),
           moefuse_last_error());
    if (st == MOEFUSE_OK) { /* freed under the layers: leak them rather than touch it */
        s.comm = NULL;
        for (int r = 0; r < R; r++) s.rk[r].layer = NULL;
        goto done;
    }
    printf("    after the refusals:\n");
    check_equal(&s, &b);
done:
    if (second) moefuse_layer_destroy(second);
    ep_close(&s);
    batch_free(&b);
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

/* test_cuda_ep [case-substring] */
int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0); /* lines before a hang exit are not lost */
    setenv("NCCL_NVLS_ENABLE", "0", 0);  /* moefuse never uses NVLS (DESIGN 4) */
    /* R = 8 virtual ranks: 2 streams each + ours (moefuse_comm_create_virtual) */
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
    signal(SIGALRM, on_alarm);
    th_seed_from_env_or_clock();
    detect_device();
    const char *filter = argc > 1 ? argv[1] : NULL;
    run_case(case_r1, "R=1 comm: the expert-parallel kernels with one rank", filter);
    run_case(case_nccl_r1, "R=1 NCCL comm: windows registered with a one-rank communicator",
             filter);
    run_case(case_r2, "R=2 T=512 each", filter);
    run_case(case_r4, "R=4 T=512 each", filter);
    run_case(case_r8, "R=8 T=512 each", filter);
    run_case(case_r2_uneven, "R=2 T={1,333}", filter);
    run_case(case_r4_uneven, "R=4 T={512,0,37,300}", filter);
    run_case(case_r8_uneven_null, "R=8 T={5,512,0,128,1,77,256,400}, NULL tensors at T=0",
             filter);
    run_case(case_r4_dropped, "R=4 T={300,512,64,0} dropped slots and tokens", filter);
    run_case(case_skew_r4, "R=4 skew: every slot on rank 3's experts", filter);
    run_case(case_skew_r4_onto_empty, "R=4 skew: T={512,0,100,512}, every slot on rank 1 (T=0)",
             filter);
    run_case(case_skew_r8, "R=8 skew: every slot on rank 0's experts", filter);
    run_case(case_recompute_r4, "R=4 T={512,0,37,300} recompute", filter);
    run_case(case_fused_r4, "R=4 T={512,0,37,300} fused forward and backward", filter);
    run_case(case_fused_skew_r8, "R=8 skew onto rank 0, fused forward and backward", filter);
    run_case(case_timeout, "timeout: rank 3 of 4 never calls", filter);
    run_case(case_bwd_rejected_saved, "backward: rank 2 of 4 passes a rejected saved buffer",
             filter);
    run_case(case_bwd_missing_rank, "backward timeout: rank 3 of 4 never calls its backward",
             filter);
    run_case(case_iterations, "1000 iterations R=2 T=256, routing redrawn", filter);
    run_case(case_refusals, "refusals: call before every layer, second layer, comm destroy",
             filter);
    fixture_teardown();
    return th_finish();
}
