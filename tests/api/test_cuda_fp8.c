/* MOEFUSE_PRECISION_FP8_BLOCK on the CUDA backend, through the public API with device
 * buffers, on fresh random problems (the host fixture's, tests/api/fixture.h):
 *   - moefuse_quantize_weights on the device: codes and scales byte for byte those of
 *     the CPU backend (bf16 and fp32 weights, both scale rules);
 *   - forward + backward against the fp64 emulation of the recipe
 *     (src/cpu/reference_fp8.c), tolerances from each output's chain of rounding points
 *     with the FP8 tensor cores' accumulation (fp8_tolerances, th_acc_wgmma_fp8_rms); every
 *     output element written (poisoned first);
 *   - bitwise: a second run equal, the three saved modes equal (recompute dispatches x's
 *     row codes again and repeats gemm1 before dy's dispatch; the saved inputs are the
 *     same rows, quantized by the rows quantizer where the others' dispatches quantize
 *     them), and
 *     forward + backward captured in a CUDA graph and replayed equal to the direct run;
 *   - T = 0: zero weight gradients, accumulate leaves them;
 *   - dW13 in two halves (dw13_up, dw13_up_bf16) bitwise equal to packed.
 * The recipe's error against the bf16 fp64 reference is printed (a property of the
 * recipe, docs/decisions/0018-fp8-block-recipe.md). The FP8 GEMM kernels have no
 * stage-by-stage checks of their own against emulated single GEMMs: this suite checks
 * them through the layer; the kernel tests check the quantizers bitwise
 * (tests/kernels/test_fp8_quant.cu).
 * With no sm_90 device every case prints SKIP. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fixture.h"
#include "harness.h"
#include "moefuse.h"

/* The Qwen3 shapes' H, I, K with 16 experts (the fp64 emulation of all 128 is slow), and a
 * small one of whole 128 blocks (the CUDA backend's FP8 needs H, I multiples of 128). */
static const shape SMALL128 = {"small 128", 256, 128, 8, 4};
static const shape WIDE256 = {"wide 256", 384, 256, 4, 2};

static int g_have_gpu = -1;
static char g_skip[256];

static int ready(void) {
    if (g_have_gpu < 0) {
        struct cudaDeviceProp prop;
        int n = 0;
        g_have_gpu = cudaGetDeviceCount(&n) == cudaSuccess && n > 0 &&
                     cudaGetDeviceProperties(&prop, 0) == cudaSuccess && prop.major == 9 &&
                     prop.minor == 0;
        if (!g_have_gpu) snprintf(g_skip, sizeof g_skip, "no sm_90 device");
    }
    if (!g_have_gpu) th_skip("%s", g_skip);
    return g_have_gpu;
}

#define CUDA_CHECK(call)                                                                  \
    do {                                                                                  \
        cudaError_t e_ = (call);                                                          \
        CHECK(e_ == cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_));                \
    } while (0)

static void *upload(const void *host, size_t bytes) {
    void *d = NULL;
    CUDA_CHECK(cudaMalloc(&d, bytes ? bytes : 16));
    if (bytes) CUDA_CHECK(cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice));
    return d;
}

static moefuse_layer *cuda_fp8_layer(shape s, int max_tokens, moefuse_saved_mode mode, int pow2) {
    moefuse_config cfg;
    moefuse_config_init(&cfg, s.H, s.I, s.E, s.K, max_tokens);
    cfg.backend = MOEFUSE_BACKEND_CUDA;
    cfg.precision = MOEFUSE_PRECISION_FP8_BLOCK;
    cfg.fp8_pow2_scales = pow2;
    cfg.saved_mode = mode;
    moefuse_layer *layer = NULL;
    const moefuse_status st = moefuse_layer_create(&cfg, NULL, &layer);
    CHECK(st == MOEFUSE_OK, "create: %s (%s)", moefuse_status_string(st), moefuse_last_error());
    return layer;
}

/* A problem's inputs and outputs on the device, with the layer's quantized weights. */
typedef struct device_problem {
    uint16_t *x, *dy, *w13, *w2, *y, *dx;
    int32_t *ids, *counts;
    float *p, *dp, *dw13, *dw2;
    void *saved, *fp8_buf;
    size_t saved_bytes, fp8_bytes;
    moefuse_fp8_weights fp8;
} device_problem;

static int device_problem_make(moefuse_layer *layer, const problem *pb, device_problem *d) {
    memset(d, 0, sizeof *d);
    const shape s = pb->s;
    const size_t rows = (size_t)pb->T * (size_t)pb->stride;
    const size_t n13 = (size_t)s.E * 2 * s.I * s.H, n2 = (size_t)s.E * s.H * s.I;
    d->x = upload(pb->x, rows * 2);
    d->dy = upload(pb->dy, rows * 2);
    d->ids = upload(pb->ids, (size_t)pb->T * s.K * 4);
    d->p = upload(pb->p, (size_t)pb->T * s.K * 4);
    d->w13 = upload(pb->w13, n13 * 2);
    d->w2 = upload(pb->w2, n2 * 2);
    CUDA_CHECK(cudaMalloc((void **)&d->y, rows * 2 + 16));
    CUDA_CHECK(cudaMalloc((void **)&d->dx, rows * 2 + 16));
    CUDA_CHECK(cudaMalloc((void **)&d->dp, (size_t)pb->T * s.K * 4 + 16));
    CUDA_CHECK(cudaMalloc((void **)&d->dw13, n13 * 4));
    CUDA_CHECK(cudaMalloc((void **)&d->dw2, n2 * 4));
    CUDA_CHECK(cudaMalloc((void **)&d->counts, (size_t)s.E * 4));
    CHECK_OK(moefuse_saved_bytes(layer, pb->T, &d->saved_bytes));
    CUDA_CHECK(cudaMalloc(&d->saved, d->saved_bytes ? d->saved_bytes : 256));
    CHECK_OK(moefuse_fp8_weights_bytes(layer, &d->fp8_bytes));
    CUDA_CHECK(cudaMalloc(&d->fp8_buf, d->fp8_bytes));
    CUDA_CHECK(cudaMemset(d->fp8_buf, 0xa5, d->fp8_bytes));
    CHECK_OK(moefuse_fp8_weights_view(layer, d->fp8_buf, &d->fp8));
    const moefuse_status st =
        moefuse_quantize_weights(layer, MOEFUSE_DTYPE_BF16, d->w13, d->w2, &d->fp8, NULL);
    CHECK(st == MOEFUSE_OK, "moefuse_quantize_weights: %s (%s)", moefuse_status_string(st),
          moefuse_last_error());
    return st == MOEFUSE_OK;
}

static void device_problem_free(device_problem *d) {
    void *all[] = {d->x, d->dy, d->w13, d->w2, d->y, d->dx, d->ids, d->counts, d->p,
                   d->dp, d->dw13, d->dw2, d->saved, d->fp8_buf};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) cudaFree(all[i]);
}

/* Poisoned device outputs (0xff: bf16 / fp32 NaN), forward, backward (write mode, or
 * accumulate onto what dW holds), outputs copied into o. */
/* The forward and backward of pb enqueued on `stream`. */
static moefuse_status enqueue(moefuse_layer *layer, const problem *pb, device_problem *d,
                              int accumulate, cudaStream_t stream) {
    moefuse_fwd_args fa = {
        .num_tokens = pb->T, .x = d->x, .x_stride = pb->stride, .ids = d->ids,
        .weights = d->p, .y = d->y, .y_stride = pb->stride, .saved = d->saved,
        .expert_counts = d->counts, .fp8_weights = &d->fp8,
    };
    moefuse_status st = moefuse_forward(layer, &fa, stream);
    if (st != MOEFUSE_OK) return st;
    moefuse_bwd_args ba = {
        .num_tokens = pb->T, .x = d->x, .x_stride = pb->stride, .ids = d->ids,
        .weights = d->p, .saved = d->saved, .saved_bytes = d->saved_bytes, .dy = d->dy,
        .dy_stride = pb->stride, .dx = d->dx, .dx_stride = pb->stride, .dweights = d->dp,
        .dw13 = d->dw13, .dw2 = d->dw2, .accumulate = accumulate, .fp8_weights = &d->fp8,
    };
    return moefuse_backward(layer, &ba, stream);
}

/* The forward and backward captured into a CUDA graph on a stream of their own, the graph
 * launched once. */
static moefuse_status enqueue_graph(moefuse_layer *layer, const problem *pb,
                                    device_problem *d, int accumulate) {
    cudaStream_t stream;
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    const moefuse_status st = enqueue(layer, pb, d, accumulate, stream);
    const cudaError_t ce = cudaStreamEndCapture(stream, &graph);
    CHECK(st == MOEFUSE_OK && ce == cudaSuccess, "capture: %s, %s", moefuse_status_string(st),
          cudaGetErrorString(ce));
    if (st == MOEFUSE_OK && ce == cudaSuccess) {
        CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
        CUDA_CHECK(cudaGraphLaunch(exec, stream));
        CUDA_CHECK(cudaStreamSynchronize(stream));
        cudaGraphExecDestroy(exec);
    }
    if (graph) cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
    return st;
}

/* One forward + backward of pb, outputs poisoned first, copied into o; `graph`: through a
 * captured CUDA graph. */
static moefuse_status run_device(moefuse_layer *layer, const problem *pb, device_problem *d,
                                 outputs *o, int accumulate, int graph) {
    const shape s = pb->s;
    const size_t rows = (size_t)pb->T * (size_t)pb->stride;
    cudaMemset(d->y, 0xff, rows * 2);
    cudaMemset(d->dx, 0xff, rows * 2);
    cudaMemset(d->dp, 0xff, (size_t)pb->T * s.K * 4);
    if (!accumulate) {
        cudaMemset(d->dw13, 0xff, (size_t)o->n_dw13 * 4);
        cudaMemset(d->dw2, 0xff, (size_t)o->n_dw2 * 4);
    }
    cudaMemset(d->counts, 0xff, (size_t)s.E * 4);
    CUDA_CHECK(cudaDeviceSynchronize());
    moefuse_status st = graph ? enqueue_graph(layer, pb, d, accumulate)
                              : enqueue(layer, pb, d, accumulate, NULL);
    if (st != MOEFUSE_OK) return st;
    st = moefuse_layer_check(layer, NULL);
    if (st != MOEFUSE_OK) return st;
    CUDA_CHECK(cudaMemcpy(o->y, d->y, rows * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(o->dx, d->dx, rows * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(o->dp, d->dp, (size_t)o->n_dp * 4, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(o->dw13, d->dw13, (size_t)o->n_dw13 * 4, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(o->dw2, d->dw2, (size_t)o->n_dw2 * 4, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(o->counts, d->counts, (size_t)s.E * 4, cudaMemcpyDeviceToHost));
    return MOEFUSE_OK;
}

static void check_err(const char *what, const err_acc *e, double tol) {
    const double err = err_rel(e);
    CHECK(err <= tol, "%s: relative L2 error %.3e against the emulation > tolerance %.3e",
          what, err, tol);
    printf("    %-5s err %.3e  tol %.3e\n", what, err, tol);
}

/* ---- weights ----------------------------------------------------------------------- */

/* The device quantizer against the CPU backend's, bf16 and fp32 weights, both scale
 * rules: every code and scale byte equal. Inputs with zero blocks, a NaN, values far
 * beyond 448 and a block of tiny ones. */
static void quantized_weights_equal_cpu(void) {
    if (!ready()) return;
    for (int c = 0; c < 4; c++) {
        const int pow2 = c & 1, fp32 = c >> 1;
        /* I = 256 once: each W13 half two block rows (the up half's offsets past its first) */
        const shape s = c == 3 ? WIDE256 : SMALL128;
        const size_t n13 = (size_t)s.E * 2 * s.I * s.H, n2 = (size_t)s.E * s.H * s.I;
        moefuse_layer *gpu = cuda_fp8_layer(s, 8, MOEFUSE_SAVE_ACTIVATIONS, pow2);
        moefuse_layer *cpu = make_layer_precision(s, 8, MOEFUSE_SAVE_ACTIVATIONS, 0,
                                                  MOEFUSE_PRECISION_FP8_BLOCK, pow2);
        if (!gpu || !cpu) return;
        uint16_t *b13 = malloc(n13 * 2), *b2 = malloc(n2 * 2);
        float *f13 = malloc(n13 * 4), *f2 = malloc(n2 * 4);
        th_fill_bf16_normal(b13, NULL, (int64_t)n13, 0.05);
        th_fill_bf16_normal(b2, NULL, (int64_t)n2, 3000.0);
        for (int i = 0; i < 128 * s.H; i++) b13[i] = 0;
        b13[n13 - 1] = 0x7fc0;
        /* W2's first block tiny (bf16 exponents 0..11: an amax under 2^-80, the quotients'
         * rescaled path), subnormals among them */
        for (int i = 0; i < 128 * s.I; i++)
            if (i % s.I < 128) b2[i] = (uint16_t)((b2[i] & 0x807f) | ((i * 7 % 12) << 7));
        for (size_t i = 0; i < n13; i++) f13[i] = (float)bf16_value(b13[i]) * (1.0f + 0x1p-12f);
        for (size_t i = 0; i < n2; i++) f2[i] = (float)bf16_value(b2[i]) * (1.0f - 0x1p-13f);
        const moefuse_dtype dt = fp32 ? MOEFUSE_DTYPE_FP32 : MOEFUSE_DTYPE_BF16;
        const void *h13 = fp32 ? (const void *)f13 : b13, *h2 = fp32 ? (const void *)f2 : b2;
        size_t bytes = 0;
        CHECK_OK(moefuse_fp8_weights_bytes(cpu, &bytes));
        void *host = aligned_alloc(256, (bytes + 255) / 256 * 256), *back = malloc(bytes);
        void *dev = NULL, *d13 = upload(h13, n13 * (fp32 ? 4 : 2)), *d2 = upload(h2, n2 * (fp32 ? 4 : 2));
        CUDA_CHECK(cudaMalloc(&dev, bytes));
        CUDA_CHECK(cudaMemset(dev, 0xa5, bytes));
        memset(host, 0x5a, bytes);
        moefuse_fp8_weights fh, fd;
        CHECK_OK(moefuse_fp8_weights_view(cpu, host, &fh));
        CHECK_OK(moefuse_fp8_weights_view(gpu, dev, &fd));
        CHECK_OK(moefuse_quantize_weights(cpu, dt, h13, h2, &fh, NULL));
        CHECK_OK(moefuse_quantize_weights(gpu, dt, d13, d2, &fd, NULL));
        CUDA_CHECK(cudaDeviceSynchronize());
        /* both views carve the same offsets out of their buffer */
        CUDA_CHECK(cudaMemcpy(back, dev, bytes, cudaMemcpyDeviceToHost));
        const uint8_t *arrays_h[8] = {fh.w13, (uint8_t *)fh.w13_scale, fh.w13t, (uint8_t *)fh.w13t_scale,
                                      fh.w2, (uint8_t *)fh.w2_scale, fh.w2t, (uint8_t *)fh.w2t_scale};
        const uint8_t *arrays_d[8] = {fd.w13, (uint8_t *)fd.w13_scale, fd.w13t, (uint8_t *)fd.w13t_scale,
                                      fd.w2, (uint8_t *)fd.w2_scale, fd.w2t, (uint8_t *)fd.w2t_scale};
        const size_t nb13 = (size_t)s.E * (2 * s.I / 128) * (s.H / 128), nb2 = (size_t)s.E * (s.H / 128) * (s.I / 128);
        const size_t sizes[8] = {n13, nb13 * 4, n13, nb13 * 4, n2, nb2 * 4, n2, nb2 * 4};
        static const char *names[8] = {"w13", "w13_scale", "w13t", "w13t_scale",
                                       "w2", "w2_scale", "w2t", "w2t_scale"};
        for (int i = 0; i < 8; i++) {
            const size_t off_h = (size_t)(arrays_h[i] - (const uint8_t *)host);
            const size_t off_d = (size_t)(arrays_d[i] - (const uint8_t *)dev);
            CHECK(off_h == off_d, "%s: views differ", names[i]);
            size_t bad = 0;
            for (size_t j = 0; j < sizes[i]; j++)
                bad += ((const uint8_t *)back)[off_d + j] != ((const uint8_t *)host)[off_h + j];
            CHECK(bad == 0, "pow2=%d fp32=%d %s: %zu of %zu bytes differ from the CPU backend's",
                  pow2, fp32, names[i], bad, sizes[i]);
        }
        /* W13 from its gate and up halves, read where they are: the same bytes */
        const size_t elem = fp32 ? 4 : 2, half = n13 / 2 * elem;
        void *gate = malloc(half), *up = malloc(half), *back_halves = malloc(bytes), *dev_halves;
        w13_repack((void *)h13, gate, up, s.E, s.I, s.H, elem, 1);
        void *dgate = upload(gate, half), *dup = upload(up, half);
        CUDA_CHECK(cudaMalloc(&dev_halves, bytes));
        CUDA_CHECK(cudaMemset(dev_halves, 0xa5, bytes));
        CHECK_OK(moefuse_fp8_weights_view(gpu, dev_halves, &fd));
        CHECK_OK(moefuse_quantize_weights_halves(gpu, dt, dgate, dup, d2, &fd, NULL));
        CUDA_CHECK(cudaMemcpy(back_halves, dev_halves, bytes, cudaMemcpyDeviceToHost));
        CHECK(!memcmp(back, back_halves, bytes), "pow2=%d fp32=%d: W13 in halves quantizes to "
              "other bytes than W13 packed", pow2, fp32);
        /* weights off the 16-byte alignment the device's quantizer reads: refused by name */
        const moefuse_status st = moefuse_quantize_weights(gpu, dt, (const char *)d13 + elem,
                                                           d2, &fd, NULL);
        CHECK(st == MOEFUSE_ERR_MISALIGNED && strstr(moefuse_last_error(), "w13"),
              "pow2=%d fp32=%d: w13 + %zu bytes: status %d (%s), expected "
              "MOEFUSE_ERR_MISALIGNED naming w13", pow2, fp32, elem, (int)st,
              moefuse_last_error());
        cudaFree(dev_halves); cudaFree(dgate); cudaFree(dup);
        free(gate); free(up); free(back_halves);
        cudaFree(dev); cudaFree(d13); cudaFree(d2);
        free(host); free(back); free(b13); free(b2); free(f13); free(f2);
        moefuse_layer_destroy(gpu);
        moefuse_layer_destroy(cpu);
    }
}

/* ---- forward and backward against the emulation ------------------------------------ */

/* `reps` fresh problems under one layer: errors against the emulation pooled and
 * checked, against the bf16 reference printed; each run repeated and equal bit for bit;
 * with `modes`, the other two saved modes' layers give the same bits. */
static void accuracy_strided(shape s, int T, int max_tokens, routing r, int pow2, int reps,
                             int modes, int64_t stride);
static void accuracy(shape s, int T, int max_tokens, routing r, int pow2, int reps, int modes) {
    accuracy_strided(s, T, max_tokens, r, pow2, reps, modes, s.H);
}

/* As accuracy, with x, y, dy and dx of row stride `stride` (>= H; the backward's
 * quantizers read x and dy where they are). */
static void accuracy_strided(shape s, int T, int max_tokens, routing r, int pow2, int reps,
                             int modes, int64_t stride) {
    if (!ready()) return;
    moefuse_layer *layer = cuda_fp8_layer(s, max_tokens, MOEFUSE_SAVE_ACTIVATIONS, pow2);
    moefuse_layer *other[2] = {NULL, NULL};
    if (modes) {
        other[0] = cuda_fp8_layer(s, max_tokens, MOEFUSE_RECOMPUTE, pow2);
        other[1] = cuda_fp8_layer(s, max_tokens, MOEFUSE_SAVE_ACTIVATIONS_AND_INPUTS, pow2);
    }
    if (!layer || (modes && (!other[0] || !other[1]))) return;
    errs emu, bf;
    memset(&emu, 0, sizeof emu);
    memset(&bf, 0, sizeof bf);
    int64_t rows = 1;
    for (int i = 0; i < reps; i++) {
        problem pb = problem_make(s, T, stride, r);
        outputs o = outputs_make(&pb), o2 = outputs_make(&pb);
        device_problem d;
        if (device_problem_make(layer, &pb, &d)) {
            CHECK_OK(run_device(layer, &pb, &d, &o, 0, 0));
            check_written(&pb, &o);
            compare_with_reference(&pb, &o, &emu, pow2 ? REF_FP8_POW2 : REF_FP8);
            compare_with_reference(&pb, &o, &bf, REF_BF16);
            CHECK_OK(run_device(layer, &pb, &d, &o2, 0, 0));
            CHECK(outputs_equal(&o, &o2), "a second run differs (not deterministic)");
            if (modes) {
                CHECK_OK(run_device(layer, &pb, &d, &o2, 0, 1));
                CHECK(outputs_equal(&o, &o2), "the run captured in a CUDA graph differs");
            }
            for (int m = 0; m < 2 && modes; m++) {
                device_problem dm;
                if (!device_problem_make(other[m], &pb, &dm)) break;
                CHECK_OK(run_device(other[m], &pb, &dm, &o2, 0, 0));
                CHECK(outputs_equal(&o, &o2), "saved mode %d differs from SAVE_ACTIVATIONS",
                      m == 0 ? (int)MOEFUSE_RECOMPUTE : (int)MOEFUSE_SAVE_ACTIVATIONS_AND_INPUTS);
                device_problem_free(&dm);
            }
        }
        device_problem_free(&d);
        for (int e = 0; e < s.E; e++) rows = pb.counts[e] > rows ? pb.counts[e] : rows;
        outputs_free(&o);
        outputs_free(&o2);
        problem_free(&pb);
    }
    const fp8_tols t = fp8_tolerances(s, rows, th_acc_wgmma_fp8_rms);
    check_err("y", &emu.y, t.y);
    check_err("dx", &emu.dx, t.dx);
    check_err("dp", &emu.dp, t.dp);
    check_err("dW13", &emu.dw13, t.dw13);
    check_err("dW2", &emu.dw2, t.dw2);
    printf("    recipe vs bf16 reference%s: y %.2e  dx %.2e  dp %.2e  dW13 %.2e  dW2 %.2e\n",
           pow2 ? " (pow2)" : "", err_rel(&bf.y), err_rel(&bf.dx), err_rel(&bf.dp),
           err_rel(&bf.dw13), err_rel(&bf.dw2));
    moefuse_layer_destroy(layer);
    moefuse_layer_destroy(other[0]);
    moefuse_layer_destroy(other[1]);
}

static void qwen3_30b_t1(void) { accuracy(QWEN3_30B_E16, 1, 8, ROUTE_RANDOM, 0, 8, 0); }
static void qwen3_30b_t7(void) { accuracy(QWEN3_30B_E16, 7, 64, ROUTE_RANDOM, 0, 4, 1); }
static void qwen3_30b_t64_pow2(void) { accuracy(QWEN3_30B_E16, 64, 64, ROUTE_RANDOM, 1, 1, 1); }
static void qwen3_235b_t16(void) { accuracy(QWEN3_235B_E16, 16, 64, ROUTE_RANDOM, 0, 2, 0); }
static void one_expert(void) { accuracy(SMALL128, 300, 300, ROUTE_ONE_EXPERT, 0, 1, 1); }
static void few_experts(void) { accuracy(SMALL128, 100, 128, ROUTE_FEW, 1, 1, 0); }
static void dropped(void) { accuracy(SMALL128, 77, 128, ROUTE_DROPPED, 0, 1, 1); }
static void qwen3_30b_t512_zipf(void) { accuracy(QWEN3_30B_E16, 512, 512, ROUTE_ZIPF, 0, 1, 1); }
static void small_t4096_zipf(void) { accuracy(SMALL128, 4096, 4096, ROUTE_ZIPF, 1, 1, 0); }
static void strided_rows(void) {
    accuracy_strided(SMALL128, 300, 300, ROUTE_DROPPED, 0, 1, 1, SMALL128.H + 8);
}

/* T = 0: write mode zeroes the weight gradients, accumulate leaves them. */
static void zero_tokens(void) {
    if (!ready()) return;
    moefuse_layer *layer = cuda_fp8_layer(SMALL128, 8, MOEFUSE_SAVE_ACTIVATIONS, 0);
    if (!layer) return;
    problem pb = problem_make(SMALL128, 0, SMALL128.H, ROUTE_RANDOM);
    outputs o = outputs_make(&pb);
    device_problem d;
    if (device_problem_make(layer, &pb, &d)) {
        CUDA_CHECK(cudaMemset(d.dw13, 0xff, (size_t)o.n_dw13 * 4));
        CUDA_CHECK(cudaMemset(d.dw2, 0xff, (size_t)o.n_dw2 * 4));
        CHECK_OK(run_device(layer, &pb, &d, &o, 1, 0));
        CHECK(count_poison32(o.dw13, o.n_dw13) == o.n_dw13, "accumulate with T = 0 touched dW13");
        CHECK_OK(run_device(layer, &pb, &d, &o, 0, 0));
        int64_t nz = 0;
        for (int64_t i = 0; i < o.n_dw13; i++) nz += o.dw13[i] != 0.0f;
        for (int64_t i = 0; i < o.n_dw2; i++) nz += o.dw2[i] != 0.0f;
        CHECK(nz == 0, "write mode with T = 0: %lld dW elements not 0", (long long)nz);
    }
    device_problem_free(&d);
    outputs_free(&o);
    problem_free(&pb);
    moefuse_layer_destroy(layer);
}

/* dW13 in two halves (moefuse.h, dw13_up / dw13_up_bf16): the packed gradient's bits
 * (the wgrad writes each 128-row tile where its half is), fp32 and bf16, with w13_up unset
 * and set (the FP8 layer reads neither weight half). */
static void halves_case(shape s, int T, routing r) {
    if (!ready()) return;
    moefuse_layer *layer = cuda_fp8_layer(s, T, MOEFUSE_SAVE_ACTIVATIONS, 0);
    if (!layer) return;
    problem pb = problem_make(s, T, s.H, r);
    outputs o = outputs_make(&pb);
    const size_t n13 = (size_t)o.n_dw13, n2 = (size_t)o.n_dw2, half = n13 / 2;
    float *dgate = NULL, *dup = NULL, *got13 = malloc(n13 * 4), *got2 = malloc(n2 * 4);
    uint16_t *g16 = NULL, *u16 = NULL, *p13 = NULL, *p2 = NULL;
    uint16_t *want13 = malloc(n13 * 2), *want2 = malloc(n2 * 2), *b13 = malloc(n13 * 2),
             *b2 = malloc(n2 * 2);
    device_problem d;
    if (!device_problem_make(layer, &pb, &d)) goto done;
    CUDA_CHECK(cudaMalloc((void **)&dgate, half * 4));
    CUDA_CHECK(cudaMalloc((void **)&dup, half * 4));
    CUDA_CHECK(cudaMalloc((void **)&g16, half * 2));
    CUDA_CHECK(cudaMalloc((void **)&u16, half * 2));
    CUDA_CHECK(cudaMalloc((void **)&p13, n13 * 2));
    CUDA_CHECK(cudaMalloc((void **)&p2, n2 * 2));
    CHECK_OK(run_device(layer, &pb, &d, &o, 0, 0));   /* packed; leaves d.saved */
    moefuse_bwd_args ba = {
        .num_tokens = pb.T, .x = d.x, .x_stride = pb.stride, .ids = d.ids,
        .weights = d.p, .saved = d.saved, .saved_bytes = d.saved_bytes, .dy = d.dy,
        .dy_stride = pb.stride, .dx = d.dx, .dx_stride = pb.stride, .dweights = d.dp,
        .fp8_weights = &d.fp8,
    };
    /* bf16 dW, packed */
    ba.dw13_bf16 = p13;
    ba.dw2_bf16 = p2;
    CHECK_OK(moefuse_backward(layer, &ba, NULL));
    CUDA_CHECK(cudaMemcpy(want13, p13, n13 * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(want2, p2, n2 * 2, cudaMemcpyDeviceToHost));
    for (int with_up = 0; with_up < 2; with_up++) {
        /* set: any device pointer (the FP8 layer reads the quantized weights, neither
         * w13 nor w13_up); the dW13 halves are what is checked */
        ba.w13_up = with_up ? d.w13 + half : NULL;
        ba.dw13_bf16 = NULL;
        ba.dw2_bf16 = NULL;
        ba.dw13 = dgate;
        ba.dw13_up = dup;
        ba.dw2 = d.dw2;
        CUDA_CHECK(cudaMemset(dgate, 0xff, half * 4));
        CUDA_CHECK(cudaMemset(dup, 0xff, half * 4));
        CUDA_CHECK(cudaMemset(d.dw2, 0xff, n2 * 4));
        CHECK_OK(moefuse_backward(layer, &ba, NULL));
        CUDA_CHECK(cudaMemcpy(got13, dgate, half * 4, cudaMemcpyDeviceToHost));
        CUDA_CHECK(cudaMemcpy(got13 + half, dup, half * 4, cudaMemcpyDeviceToHost));
        CUDA_CHECK(cudaMemcpy(got2, d.dw2, n2 * 4, cudaMemcpyDeviceToHost));
        float *packed = malloc(n13 * 4);
        w13_repack(packed, got13, got13 + half, s.E, s.I, s.H, 4, 0);
        CHECK(!memcmp(packed, o.dw13, n13 * 4) && !memcmp(got2, o.dw2, n2 * 4),
              "w13_up %s: fp32 dW13 in halves differs from packed", with_up ? "set" : "NULL");
        free(packed);
        ba.dw13 = NULL;
        ba.dw13_up = NULL;
        ba.dw2 = NULL;
        ba.dw13_bf16 = g16;
        ba.dw13_up_bf16 = u16;
        ba.dw2_bf16 = p2;
        CUDA_CHECK(cudaMemset(p2, 0xff, n2 * 2));
        CUDA_CHECK(cudaMemset(g16, 0xff, half * 2));   /* not the previous pass's bits */
        CUDA_CHECK(cudaMemset(u16, 0xff, half * 2));
        CHECK_OK(moefuse_backward(layer, &ba, NULL));
        ba.dw13_up_bf16 = NULL;
        uint16_t *hg = malloc(n13 * 2);
        CUDA_CHECK(cudaMemcpy(hg, g16, half * 2, cudaMemcpyDeviceToHost));
        CUDA_CHECK(cudaMemcpy(hg + half, u16, half * 2, cudaMemcpyDeviceToHost));
        CUDA_CHECK(cudaMemcpy(b2, p2, n2 * 2, cudaMemcpyDeviceToHost));
        w13_repack(b13, hg, hg + half, s.E, s.I, s.H, 2, 0);
        free(hg);
        CHECK(!memcmp(b13, want13, n13 * 2) && !memcmp(b2, want2, n2 * 2),
              "w13_up %s: bf16 dW13 in halves differs from packed", with_up ? "set" : "NULL");
    }
done:
    device_problem_free(&d);
    cudaFree(dgate);
    cudaFree(dup);
    cudaFree(g16);
    cudaFree(u16);
    cudaFree(p13);
    cudaFree(p2);
    free(got13);
    free(got2);
    free(want13);
    free(want2);
    free(b13);
    free(b2);
    outputs_free(&o);
    problem_free(&pb);
    moefuse_layer_destroy(layer);
}
static void halves_small(void) { halves_case(SMALL128, 300, ROUTE_DROPPED); }
static void halves_30b(void) { halves_case(QWEN3_30B_E16, 64, ROUTE_RANDOM); }

/* Runs the cases whose name contains argv[1] (all without one: a sanitizer run picks a
 * small case). */
int main(int argc, char **argv) {
    static const struct {
        const char *name;
        void (*fn)(void);
    } cases[] = {
        {"cuda fp8: device-quantized weights = the CPU backend's, bf16/fp32, pow2; misaligned refused", quantized_weights_equal_cpu},
        {"cuda fp8: qwen3-30b-a3b H/I/K E=16 T=1 vs emulation", qwen3_30b_t1},
        {"cuda fp8: qwen3-30b-a3b H/I/K E=16 T=7, saved modes equal", qwen3_30b_t7},
        {"cuda fp8: qwen3-30b-a3b H/I/K E=16 T=64 pow2, saved modes equal", qwen3_30b_t64_pow2},
        {"cuda fp8: qwen3-235b-a22b H/I/K E=16 T=16 vs emulation", qwen3_235b_t16},
        {"cuda fp8: all tokens on one expert (300 rows)", one_expert},
        {"cuda fp8: most experts empty, pow2", few_experts},
        {"cuda fp8: dropped slots, saved modes equal", dropped},
        {"cuda fp8: qwen3-30b-a3b H/I/K E=16 T=512 Zipf, saved modes equal", qwen3_30b_t512_zipf},
        {"cuda fp8: small T=4096 Zipf, pow2", small_t4096_zipf},
        {"cuda fp8: rows of stride H + 8, saved modes equal", strided_rows},
        {"cuda fp8: T = 0", zero_tokens},
        {"cuda fp8: dW13 in two halves bitwise = packed, small", halves_small},
        {"cuda fp8: dW13 in two halves bitwise = packed, qwen3-30b-a3b H/I/K E=16", halves_30b},
    };
    th_seed_from_env_or_clock();
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (argc < 2 || strstr(cases[i].name, argv[1])) th_run(cases[i].name, cases[i].fn);
    problem_pool_free();
    return th_finish();
}
