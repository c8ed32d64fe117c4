/* MOEFUSE_PRECISION_FP8_BLOCK on the CPU backend, through the public API:
 * moefuse_quantize_weights against a direct per-block computation, its errors and those
 * of the forward and backward; forward and backward against the fp64 emulation of the
 * recipe (reference_fp8.c) on fresh random inputs, on the model shapes and the routing
 * edge cases of test_cpu_backend, with tolerances derived from the recipe (harness.h,
 * th_gemm ...: the chain of each output below); determinism and recompute = saved.
 * The recipe's own error against the bf16 fp64 reference is printed, not checked: it
 * is a property of the recipe (docs/decisions/0018-fp8-block-recipe.md records it). */
#include "fixture.h"
#include "fp8.h"
#include "reference.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void check_err(const char *what, const err_acc *e, double tol) {
    double err = err_rel(e);
    CHECK(err <= tol, "%s: relative L2 error %.3e against the emulation > tolerance %.3e",
          what, err, tol);
    if (getenv("MOEFUSE_TEST_VERBOSE"))
        printf("    %-5s err %.3e  tol %.3e\n", what, err, tol);
}

/* ---- quantized weights ------------------------------------------------------------- */

/* The layer's FP8 weights of pb's w13 / w2 in one buffer (pb->fp8 points at them). */
typedef struct fp8_buf {
    void *buf;
    moefuse_fp8_weights w;
} fp8_buf;

static void fp8_make(moefuse_layer *layer, problem *pb, fp8_buf *f) {
    size_t bytes = 0;
    CHECK_OK(moefuse_fp8_weights_bytes(layer, &bytes));
    f->buf = aligned_alloc(256, (bytes + 255) / 256 * 256);
    memset(f->buf, 0xa5, bytes);
    CHECK_OK(moefuse_fp8_weights_view(layer, f->buf, &f->w));
    CHECK_OK(moefuse_quantize_weights(layer, MOEFUSE_DTYPE_BF16, pb->w13, pb->w2, &f->w, NULL));
    pb->fp8 = &f->w;
}

static moefuse_layer *fp8_layer(shape s, int max_tokens, moefuse_saved_mode mode, int pow2,
                                int threads) {
    return make_layer_precision(s, max_tokens, mode, threads, MOEFUSE_PRECISION_FP8_BLOCK, pow2);
}

/* Codes and scales of one expert's [rows, cols] weight (and of its transpose) against
 * mf_fp8_scale / mf_e4m3_encode on each 128x128 block, straight from the definition. */
static int64_t weight_mismatches(const float *w, int64_t rows, int64_t cols, int pow2,
                                 const uint8_t *q, const float *s, const uint8_t *qt,
                                 const float *st) {
    const int64_t nr = (rows + 127) / 128, nc = (cols + 127) / 128;
    int64_t bad = 0;
    for (int64_t bi = 0; bi < nr; bi++)
        for (int64_t bj = 0; bj < nc; bj++) {
            float amax = 0.0f;
            for (int64_t r = bi * 128; r < rows && r < (bi + 1) * 128; r++)
                for (int64_t c = bj * 128; c < cols && c < (bj + 1) * 128; c++)
                    amax = fabsf(w[r * cols + c]) > amax || isnan(w[r * cols + c])
                               ? fabsf(w[r * cols + c]) : amax;
            float scale = mf_fp8_scale(amax, pow2);
            int same = !memcmp(&scale, &s[bi * nc + bj], 4) && !memcmp(&scale, &st[bj * nr + bi], 4);
            bad += !same;
            for (int64_t r = bi * 128; r < rows && r < (bi + 1) * 128; r++)
                for (int64_t c = bj * 128; c < cols && c < (bj + 1) * 128; c++) {
                    uint8_t want = mf_e4m3_encode(w[r * cols + c] / scale);
                    bad += q[r * cols + c] != want || qt[c * rows + r] != want;
                }
        }
    return bad;
}

/* bf16 and fp32 weights, both scale rules, partial blocks (ODD: 2I = 144, H = 200), a
 * zero block, a NaN (its block NaN, no other), values far beyond 448. */
static void quantize_weights_matches_blocks(void) {
    for (int c = 0; c < 4; c++) {
        const int pow2 = c & 1, fp32 = c >> 1;
        shape s = c == 3 ? SMALL : ODD;
        moefuse_layer *layer = fp8_layer(s, 8, MOEFUSE_SAVE_ACTIVATIONS, pow2, 0);
        if (!layer) return;
        const int64_t n13 = (int64_t)s.E * 2 * s.I * s.H, n2 = (int64_t)s.E * s.H * s.I;
        float *w13 = malloc(sizeof(float) * (size_t)n13), *w2 = malloc(sizeof(float) * (size_t)n2);
        uint16_t *b13 = malloc(2 * (size_t)n13), *b2 = malloc(2 * (size_t)n2);
        th_fill_bf16_normal(b13, NULL, n13, 0.05);
        th_fill_bf16_normal(b2, NULL, n2, 3000.0); /* most of W2 beyond 448: scales > 1 */
        for (int64_t i = 0; i < 128 * s.H; i++) b13[i] = 0; /* expert 0's first block row */
        b13[n13 - 1] = 0x7fc0;                          /* NaN in the last block */
        for (int64_t i = 0; i < n13; i++) w13[i] = bf16_value(b13[i]);
        for (int64_t i = 0; i < n2; i++) w2[i] = bf16_value(b2[i]);
        if (fp32) /* fp32 values between bf16s */
            for (int64_t i = 0; i < n2; i++) w2[i] *= 1.0f + 0x1p-12f;
        size_t bytes = 0;
        CHECK_OK(moefuse_fp8_weights_bytes(layer, &bytes));
        void *buf = aligned_alloc(256, (bytes + 255) / 256 * 256);
        moefuse_fp8_weights f;
        CHECK_OK(moefuse_fp8_weights_view(layer, buf, &f));
        CHECK_OK(moefuse_quantize_weights(layer, fp32 ? MOEFUSE_DTYPE_FP32 : MOEFUSE_DTYPE_BF16,
                                          fp32 ? (const void *)w13 : b13,
                                          fp32 ? (const void *)w2 : b2, &f, NULL));
        int64_t bad = 0, I2 = 2 * s.I, H = s.H, I = s.I;
        int64_t s13 = ((I2 + 127) / 128) * ((H + 127) / 128), s2 = ((H + 127) / 128) * ((I + 127) / 128);
        for (int64_t e = 0; e < s.E; e++) {
            bad += weight_mismatches(w13 + e * I2 * H, I2, H, pow2, f.w13 + e * I2 * H,
                                     f.w13_scale + e * s13, f.w13t + e * I2 * H,
                                     f.w13t_scale + e * s13);
            bad += weight_mismatches(w2 + e * H * I, H, I, pow2, f.w2 + e * H * I,
                                     f.w2_scale + e * s2, f.w2t + e * H * I, f.w2t_scale + e * s2);
        }
        CHECK(bad == 0, "%s pow2=%d fp32=%d: %lld codes or scales differ from the blocks",
              s.name, pow2, fp32, (long long)bad);
        CHECK(f.w13_scale[0] == 1.0f && f.w13[0] == 0, "a zero block: scale 1, codes 0");
        CHECK(isnan(f.w13_scale[s.E * s13 - 1]) && isnan(f.w13t_scale[s.E * s13 - 1]) &&
              !isnan(f.w13_scale[s.E * s13 - 2]), "the NaN block only is NaN");
        /* W13 from its gate and up halves: the packed W13's bytes */
        const size_t elem = fp32 ? 4 : 2;
        void *gate = malloc(elem * (size_t)(n13 / 2)), *up = malloc(elem * (size_t)(n13 / 2));
        w13_repack(fp32 ? (void *)w13 : (void *)b13, gate, up, s.E, s.I, s.H, elem, 1);
        void *buf_halves = aligned_alloc(256, (bytes + 255) / 256 * 256);
        moefuse_fp8_weights fh;
        CHECK_OK(moefuse_fp8_weights_view(layer, buf_halves, &fh));
        memset(buf_halves, 0x5a, bytes);
        memset(buf, 0x5a, bytes);
        CHECK_OK(moefuse_quantize_weights(layer, fp32 ? MOEFUSE_DTYPE_FP32 : MOEFUSE_DTYPE_BF16,
                                          fp32 ? (const void *)w13 : b13,
                                          fp32 ? (const void *)w2 : b2, &f, NULL));
        CHECK_OK(moefuse_quantize_weights_halves(
            layer, fp32 ? MOEFUSE_DTYPE_FP32 : MOEFUSE_DTYPE_BF16, gate, up,
            fp32 ? (const void *)w2 : b2, &fh, NULL));
        CHECK(!memcmp(buf, buf_halves, bytes), "%s pow2=%d fp32=%d: W13 in halves quantizes "
              "to other bytes than W13 packed", s.name, pow2, fp32);
        free(gate); free(up); free(buf_halves);
        free(buf);
        free(w13); free(w2); free(b13); free(b2);
        moefuse_layer_destroy(layer);
    }
}

static void expect(moefuse_status got, moefuse_status want, const char *needle,
                   const char *what) {
    CHECK(got == want, "%s: %s, expected %s (%s)", what, moefuse_status_string(got),
          moefuse_status_string(want), moefuse_last_error());
    CHECK(strstr(moefuse_last_error(), needle) != NULL, "%s: message '%s' should name '%s'",
          what, moefuse_last_error(), needle);
}

/* Bad quantized weights are refused with a message naming them; nothing is written. */
static void fp8_weights_errors(void) {
    moefuse_layer *l8 = fp8_layer(SMALL, 8, MOEFUSE_SAVE_ACTIVATIONS, 0, 0);
    moefuse_layer *l8p = fp8_layer(SMALL, 8, MOEFUSE_SAVE_ACTIVATIONS, 1, 0);
    moefuse_layer *lb = make_layer(SMALL, 8, MOEFUSE_SAVE_ACTIVATIONS, 0);
    shape other = SMALL;
    other.I = 128;
    moefuse_layer *lo = fp8_layer(other, 8, MOEFUSE_SAVE_ACTIVATIONS, 0, 0);
    if (!l8 || !l8p || !lb || !lo) return;
    problem pb = problem_make(SMALL, 5, SMALL.H, ROUTE_RANDOM);
    outputs o = outputs_make(&pb);
    fp8_buf f;
    fp8_make(l8, &pb, &f);
    moefuse_fp8_weights w = f.w, wo;
    expect(moefuse_quantize_weights(lb, MOEFUSE_DTYPE_BF16, pb.w13, pb.w2, &w, NULL),
           MOEFUSE_ERR_INVALID_CONFIG, "MOEFUSE_PRECISION_FP8_BLOCK", "quantize on a bf16 layer");
    expect(moefuse_quantize_weights(l8, (moefuse_dtype)7, pb.w13, pb.w2, &w, NULL),
           MOEFUSE_ERR_INVALID_CONFIG, "dtype", "bad dtype");
    expect(moefuse_quantize_weights(l8, MOEFUSE_DTYPE_BF16, NULL, pb.w2, &w, NULL),
           MOEFUSE_ERR_NULL_POINTER, "w13", "w13 NULL");
    expect(moefuse_quantize_weights_halves(l8, MOEFUSE_DTYPE_BF16, pb.w13, NULL, pb.w2, &w,
                                           NULL), MOEFUSE_ERR_NULL_POINTER, "w13_up",
           "halves without the up half");
    expect(moefuse_quantize_weights_halves(l8, MOEFUSE_DTYPE_FP32, pb.w13,
                                           (const char *)pb.w13 + 2, pb.w2, &w, NULL),
           MOEFUSE_ERR_MISALIGNED, "w13_up", "fp32 w13_up misaligned");
    expect(moefuse_quantize_weights(l8, MOEFUSE_DTYPE_FP32, (const char *)pb.w13 + 2, pb.w2, &w,
                                    NULL), MOEFUSE_ERR_MISALIGNED, "w13", "fp32 w13 misaligned");
    expect(moefuse_quantize_weights(l8, MOEFUSE_DTYPE_BF16, pb.w13, pb.w2, NULL, NULL),
           MOEFUSE_ERR_NULL_POINTER, "out", "out NULL");
    expect(moefuse_quantize_weights(l8p, MOEFUSE_DTYPE_BF16, pb.w13, pb.w2, &w, NULL),
           MOEFUSE_ERR_INVALID_CONFIG, "pow2_scales", "weights viewed for the other scale rule");
    wo = w; wo.w2t_scale = NULL;
    expect(moefuse_quantize_weights(l8, MOEFUSE_DTYPE_BF16, pb.w13, pb.w2, &wo, NULL),
           MOEFUSE_ERR_NULL_POINTER, "out->w2t_scale", "an array NULL");
    expect(moefuse_fp8_weights_view(l8, (char *)f.buf + 16, &wo), MOEFUSE_ERR_MISALIGNED,
           "256", "view of a misaligned buffer");

    void *saved = saved_make(l8, pb.T);
    outputs_poison(&o, SMALL.E);
    pb.fp8 = NULL;
    expect(forward(l8, &pb, &o, saved), MOEFUSE_ERR_NULL_POINTER, "fwd_args.fp8_weights",
           "FP8 forward without quantized weights");
    pb.fp8 = &w;
    expect(forward(lo, &pb, &o, saved), MOEFUSE_ERR_SHAPE, "fwd_args.fp8_weights->intermediate",
           "weights of another I");
    expect(forward(lb, &pb, &o, saved), MOEFUSE_ERR_INVALID_CONFIG, "fwd_args.fp8_weights",
           "quantized weights on a bf16 layer");
    wo = w; wo.w13 = NULL;
    pb.fp8 = &wo;
    expect(backward(l8, &pb, &o, saved, 0), MOEFUSE_ERR_NULL_POINTER, "bwd_args.fp8_weights->w13",
           "backward with an array NULL");
    CHECK(count_poison32(o.dw13, o.n_dw13) == o.n_dw13 && count_poison32(o.dp, o.n_dp) == o.n_dp,
          "a refused call touched an output");
    /* with FP8 the bf16 weights are not read: NULL is fine */
    pb.fp8 = &w;
    uint16_t *w13 = pb.w13, *w2 = pb.w2;
    pb.w13 = pb.w2 = NULL;
    CHECK_OK(forward(l8, &pb, &o, saved));
    CHECK_OK(backward(l8, &pb, &o, saved, 0));
    pb.w13 = w13;
    pb.w2 = w2;
    free(saved);
    free(f.buf);
    outputs_free(&o);
    problem_free(&pb);
    moefuse_layer_destroy(l8); moefuse_layer_destroy(l8p);
    moefuse_layer_destroy(lb); moefuse_layer_destroy(lo);
}

/* ---- accuracy against the emulation ------------------------------------------------ */

static void print_recipe_error(const char *name, int pow2, const errs *e) {
    printf("    recipe vs bf16 reference, %s%s: y %.2e  dx %.2e  dp %.2e  dW13 %.2e  dW2 %.2e\n",
           name, pow2 ? " pow2" : "", err_rel(&e->y), err_rel(&e->dx), err_rel(&e->dp),
           err_rel(&e->dw13), err_rel(&e->dw2));
}

/* `reps` fresh problems: poisoned outputs, forward + backward, every element written,
 * errors against the emulation pooled and checked, errors against the bf16 reference
 * printed. */
static void accuracy_reps(shape s, int T, int max_tokens, int64_t stride, routing r,
                          moefuse_saved_mode mode, int pow2, int reps) {
    moefuse_layer *layer = fp8_layer(s, max_tokens, mode, pow2, 0);
    if (!layer) return;
    errs emu, bf;
    memset(&emu, 0, sizeof emu);
    memset(&bf, 0, sizeof bf);
    int64_t rows = 1;
    for (int i = 0; i < reps; i++) {
        problem pb = problem_make(s, T, stride, r);
        fp8_buf f;
        fp8_make(layer, &pb, &f);
        outputs o = outputs_make(&pb);
        run_pair(layer, &pb, &o);
        check_written(&pb, &o);
        compare_with_reference(&pb, &o, &emu, pow2 ? REF_FP8_POW2 : REF_FP8);
        compare_with_reference(&pb, &o, &bf, REF_BF16);
        for (int e = 0; e < s.E; e++) rows = pb.counts[e] > rows ? pb.counts[e] : rows;
        outputs_free(&o);
        free(f.buf);
        problem_free(&pb);
    }
    fp8_tols t = fp8_tolerances(s, rows, th_acc_fp32);
    check_err("y", &emu.y, t.y);
    check_err("dx", &emu.dx, t.dx);
    check_err("dp", &emu.dp, t.dp);
    check_err("dW13", &emu.dw13, t.dw13);
    check_err("dW2", &emu.dw2, t.dw2);
    print_recipe_error(s.name, pow2, &bf);
    moefuse_layer_destroy(layer);
}

static void qwen3_30b_random(void) {
    accuracy_reps(QWEN3_30B_E16, 4, 16, QWEN3_30B.H, ROUTE_RANDOM, MOEFUSE_SAVE_ACTIVATIONS, 0, 1);
}
static void qwen3_30b_few_pow2(void) {
    accuracy_reps(QWEN3_30B_E16, 16, 16, QWEN3_30B.H + 8, ROUTE_FEW, MOEFUSE_RECOMPUTE, 1, 1);
}
static void qwen3_235b_e16(void) {
    accuracy_reps(QWEN3_235B_E16, 8, 8, QWEN3_235B_E16.H, ROUTE_FEW, MOEFUSE_SAVE_ACTIVATIONS, 0, 1);
}
static void one_token(void) {
    accuracy_reps(SMALL, 1, 64, SMALL.H, ROUTE_RANDOM, MOEFUSE_SAVE_ACTIVATIONS, 0, 8);
}
static void max_tokens_random(void) {
    accuracy_reps(SMALL, 300, 300, SMALL.H + 3, ROUTE_RANDOM, MOEFUSE_SAVE_ACTIVATIONS, 1, 1);
}
/* 300 rows on expert 0: three token tiles (128, 128, 44) in its weight gradients. */
static void all_on_one_expert(void) {
    accuracy_reps(SMALL, 300, 300, SMALL.H, ROUTE_ONE_EXPERT, MOEFUSE_RECOMPUTE, 0, 1);
    accuracy_reps(SMALL, 300, 300, SMALL.H, ROUTE_ONE_EXPERT, MOEFUSE_SAVE_ACTIVATIONS, 1, 1);
}
static void most_experts_empty(void) {
    accuracy_reps(SMALL, 40, 64, SMALL.H, ROUTE_FEW, MOEFUSE_SAVE_ACTIVATIONS, 0, 1);
}
static void dropped_slots(void) {
    accuracy_reps(SMALL, 33, 64, SMALL.H, ROUTE_DROPPED, MOEFUSE_SAVE_ACTIVATIONS, 0, 1);
    accuracy_reps(ODD, 17, 17, ODD.H + 1, ROUTE_DROPPED, MOEFUSE_RECOMPUTE, 1, 1);
}
static void zipf_routing(void) {
    accuracy_reps(SMALL, 512, 512, SMALL.H, ROUTE_ZIPF, MOEFUSE_SAVE_ACTIVATIONS, 0, 1);
}
/* H = 200, 2I = 144: a short tile at the end of every row and block. */
static void odd_shape(void) {
    accuracy_reps(ODD, 50, 64, ODD.H, ROUTE_RANDOM, MOEFUSE_SAVE_ACTIVATIONS, 0, 1);
}

/* T = 0: nothing routed; write mode zeroes the weight gradients, accumulate leaves them. */
static void zero_tokens(void) {
    moefuse_layer *layer = fp8_layer(SMALL, 8, MOEFUSE_SAVE_ACTIVATIONS, 1, 0);
    if (!layer) return;
    problem pb = problem_make(SMALL, 0, SMALL.H, ROUTE_RANDOM);
    fp8_buf f;
    fp8_make(layer, &pb, &f);
    outputs o = outputs_make(&pb);
    void *saved = saved_make(layer, 0);
    outputs_poison(&o, SMALL.E);
    CHECK_OK(forward(layer, &pb, &o, saved));
    CHECK_OK(backward(layer, &pb, &o, saved, 1));
    CHECK(count_poison32(o.dw13, o.n_dw13) == o.n_dw13, "accumulate with T = 0 touched dW");
    CHECK_OK(backward(layer, &pb, &o, saved, 0));
    int64_t nz = 0;
    for (int64_t i = 0; i < o.n_dw13; i++) nz += o.dw13[i] != 0.0f;
    for (int64_t i = 0; i < o.n_dw2; i++) nz += o.dw2[i] != 0.0f;
    CHECK(nz == 0, "write mode with T = 0: %lld dW elements not 0", (long long)nz);
    free(saved);
    free(f.buf);
    outputs_free(&o);
    problem_free(&pb);
    moefuse_layer_destroy(layer);
}

/* ---- the emulation's single GEMMs -------------------------------------------------- */

/* mf_ref_fp8_gemm / _tokens against the same GEMMs done another way: operands replaced by
 * decode(code) * scale in fp32 (fp8.c's fake quantizers, per row, block or token tile),
 * then a plain fp64 product. Equal up to the fp32 rounding of the dequantized values
 * (none with pow2 scales). Short tiles everywhere: m = 37, n = 200, k = 300. */
static void emulated_gemms_match_dequantized(void) {
    enum { M = 37, N = 200, K = 300 };
    float *a = malloc(sizeof(float) * M * K), *w = malloc(sizeof(float) * N * K);
    float *amax = malloc(sizeof(float) * N);
    uint8_t *wq = malloc(N * K);
    double *ad = malloc(sizeof(double) * M * K), *wd = malloc(sizeof(double) * N * K);
    double *c = malloc(sizeof(double) * M * N);
    for (int pow2 = 0; pow2 < 2; pow2++)
        for (int form = 0; form < 3; form++) { /* A W^T, A W, A^T B (tokens: K rows) */
            const int64_t m = M, n = N, k = K;
            for (int64_t i = 0; i < m * k; i++) ad[i] = a[i] = (float)(th_normal() * 3.0);
            for (int64_t i = 0; i < n * k; i++) wd[i] = w[i] = (float)(th_normal() * 0.01);
            if (form == 2) {
                mf_ref_fp8_gemm_tokens(k, m, n, pow2, ad, wd, c);
                for (int64_t t = 0; t < k; t += 128) { /* A [k, m], B [k, n] */
                    mf_fp8_fake_quant_cols(a + t * m, k - t < 128 ? k - t : 128, m, m, pow2, amax);
                    mf_fp8_fake_quant_cols(w + t * n, k - t < 128 ? k - t : 128, n, n, pow2, amax);
                }
            } else {
                mf_ref_fp8_gemm(m, n, k, pow2, ad, wd, form, c);
                mf_fp8_fake_quant_rows(a, m, k, k, pow2);
                const int64_t wr = form ? k : n, wc = form ? n : k;
                float *wsc = malloc(sizeof(float) * (size_t)(((wr + 127) / 128) * ((wc + 127) / 128)));
                mf_fp8_quantize_blocks(w, wr, wc, wc, pow2, wq, wsc, NULL, NULL);
                mf_fp8_dequant_block_rows(wq, wsc, wc, 0, wr, w);
                free(wsc);
            }
            err_acc e = {0, 0};
            for (int64_t i = 0; i < m; i++)
                for (int64_t j = 0; j < n; j++) {
                    double acc = 0.0;
                    for (int64_t t = 0; t < k; t++)
                        acc += form == 2 ? (double)a[t * m + i] * w[t * n + j]
                                         : (double)a[i * k + t] * (form ? w[t * n + j] : w[j * k + t]);
                    err_add(&e, c[i * n + j], acc);
                }
            double tol = pow2 ? 1e-14 : 2 * th_acc_fp32(k);
            CHECK(err_rel(&e) <= tol, "form %d pow2 %d: %.3e from the dequantized GEMM > %.3e",
                  form, pow2, err_rel(&e), tol);
        }
    free(a); free(w); free(amax); free(wq); free(ad); free(wd); free(c);
}

/* ---- properties -------------------------------------------------------------------- */

/* Same bits: twice on one layer, on 1 and 3 threads, and RECOMPUTE = SAVE_ACTIVATIONS. */
static void deterministic_and_recompute(void) {
    moefuse_layer *l[4] = {
        fp8_layer(SMALL, 300, MOEFUSE_SAVE_ACTIVATIONS, 0, 0),
        fp8_layer(SMALL, 300, MOEFUSE_SAVE_ACTIVATIONS, 0, 1),
        fp8_layer(SMALL, 300, MOEFUSE_SAVE_ACTIVATIONS, 0, 3),
        fp8_layer(SMALL, 300, MOEFUSE_RECOMPUTE, 0, 0)};
    if (!l[0] || !l[1] || !l[2] || !l[3]) return;
    problem pb = problem_make(SMALL, 300, SMALL.H, ROUTE_ONE_EXPERT);
    fp8_buf f;
    fp8_make(l[0], &pb, &f);
    outputs r[5];
    for (int i = 0; i < 5; i++) r[i] = outputs_make(&pb);
    run_pair(l[0], &pb, &r[0]);
    for (int i = 0; i < 4; i++) run_pair(l[i], &pb, &r[i + 1]);
    const char *what[4] = {"a second run", "num_threads = 1", "num_threads = 3",
                           "MOEFUSE_RECOMPUTE"};
    for (int i = 0; i < 4; i++)
        CHECK(outputs_equal(&r[0], &r[i + 1]), "%s differs from the first run", what[i]);
    for (int i = 0; i < 5; i++) outputs_free(&r[i]);
    free(f.buf);
    problem_free(&pb);
    for (int i = 0; i < 4; i++) moefuse_layer_destroy(l[i]);
}

/* dW13 in two halves (moefuse.h) is the packed gradient's bits, with W13 passed in halves
 * or not (the FP8 layer reads its quantized weights), fp32 and bf16 gradients. */
static void halves_equal_packed(void) {
    moefuse_layer *layer = fp8_layer(ODD, 200, MOEFUSE_SAVE_ACTIVATIONS, 0, 0);
    if (!layer) return;
    problem pb = problem_make(ODD, 200, ODD.H, ROUTE_DROPPED);
    fp8_buf f;
    fp8_make(layer, &pb, &f);
    outputs p = outputs_make(&pb), h = outputs_make(&pb);
    run_pair(layer, &pb, &p);
    for (int weights_in_halves = 0; weights_in_halves < 2; weights_in_halves++) {
        outputs_poison(&h, pb.s.E);
        run_pair_halves(layer, &pb, &h, WGRAD_WRITE, NULL, NULL, weights_in_halves);
        CHECK(outputs_equal(&p, &h), "W13 %s: dW13 in halves differs from packed",
              weights_in_halves ? "in halves" : "packed");
    }
    uint16_t *b13 = malloc(sizeof(uint16_t) * (size_t)p.n_dw13);
    uint16_t *b2 = malloc(sizeof(uint16_t) * (size_t)p.n_dw2);
    run_pair_halves(layer, &pb, &h, WGRAD_BF16, b13, b2, 0);
    int64_t bad = 0;
    for (int64_t i = 0; i < p.n_dw13; i++) {   /* bf16 of the fp32 gradient (rne) */
        uint32_t u;
        memcpy(&u, &p.dw13[i], 4);
        bad += b13[i] != (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    CHECK(bad == 0, "bf16 dW13 in halves: %lld elements not the fp32 gradient rounded",
          (long long)bad);
    free(b13);
    free(b2);
    free(f.buf);
    outputs_free(&p);
    outputs_free(&h);
    problem_free(&pb);
    moefuse_layer_destroy(layer);
}

int main(void) {
    th_seed_from_env_or_clock();
    th_run("moefuse_quantize_weights = per-block quantization, W and W^T; W13 in halves alike",
           quantize_weights_matches_blocks);
    th_run("FP8 weights: errors name the argument", fp8_weights_errors);
    th_run("qwen3-30b-a3b H/I/K E=16 T=4 vs emulation", qwen3_30b_random);
    th_run("qwen3-30b-a3b H/I/K E=16 T=16 few experts, recompute, pow2, strided", qwen3_30b_few_pow2);
    th_run("qwen3-235b-a22b H/I/K E=16 T=8 vs emulation", qwen3_235b_e16);
    th_run("T = 1", one_token);
    th_run("T = max_tokens = 300, pow2, strided", max_tokens_random);
    th_run("all tokens on one expert (300 rows: 3 token tiles)", all_on_one_expert);
    th_run("most experts empty", most_experts_empty);
    th_run("dropped slots, a token with all K dropped", dropped_slots);
    th_run("T = 512, Zipf routing (a few hot experts)", zipf_routing);
    th_run("odd shape H=200 I=72 E=9 K=3 (short tiles)", odd_shape);
    th_run("T = 0", zero_tokens);
    th_run("emulated GEMMs = GEMMs of dequantized operands, three forms", emulated_gemms_match_dequantized);
    th_run("bitwise deterministic, any thread count, recompute = saved", deterministic_and_recompute);
    th_run("dW13 in two halves = packed, bitwise", halves_equal_packed);
    problem_pool_free();
    return th_finish();
}
