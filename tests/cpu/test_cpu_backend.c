/* The CPU backend through the public API, against the fp64 reference, on fresh
 * random inputs: accuracy on the Qwen3 shapes, routing edge cases, every output
 * written (outputs are poisoned first), accumulate mode, bf16 weight gradients,
 * MOEFUSE_RECOMPUTE versus saved activations, several forwards in flight, determinism,
 * refused saved buffers.
 *
 * Tolerances: th_bf16_tolerance(n), n = the bf16 roundings on a value's path (x, dy,
 * the weights and p are inputs, exact in both computations):
 *   y    n = 4: g and u stored as bf16 (both enter a), a stored as bf16, y rounded.
 *   dx   n = 5: g and u as bf16 (they enter dg = da u silu'(g), du = da silu(g)), da' =
 *              dy W2_e rounded to bf16, [dg;du] rounded to bf16 before its GEMM, dx rounded.
 *   dp   n = 4: g, u, a, da' (dp = <da', a> in fp32).
 *   dW2  n = 3: g, u, a (dW2 = (p dy)^T a in fp32).
 *   dW13 n = 4: g, u, da', [dg;du] (dW13 = [dg;du]^T x in fp32). */
#include "fixture.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { N_Y = 4, N_DX = 5, N_DP = 4, N_DW2 = 3, N_DW13 = 4 };

/* backward() in write mode with the weight gradients in bf16 (o->dw13, o->dw2 unused). */
static moefuse_status backward_bf16(moefuse_layer *layer, const problem *pb, outputs *o,
                                    const void *saved,
                                    uint16_t *dw13, /* [E, 2I, H] */
                                    uint16_t *dw2) { /* [E, H, I] */
    moefuse_bwd_args a = {
        .num_tokens = pb->T, .x = pb->x, .x_stride = pb->stride, .ids = pb->ids,
        .weights = pb->p, .w13 = pb->w13, .w2 = pb->w2, .saved = saved,
        .saved_bytes = saved_size(layer, pb->T), .dy = pb->dy,
        .dy_stride = pb->stride, .dx = o->dx, .dx_stride = pb->stride, .dweights = o->dp,
        .dw13_bf16 = dw13, .dw2_bf16 = dw2,
    };
    return moefuse_backward(layer, &a, NULL);
}

static void check_err(const char *what, const err_acc *e, int roundings) {
    double err = err_rel(e), tol = th_bf16_tolerance(roundings);
    CHECK(err <= tol, "%s: relative L2 error %.3e > tolerance %.3e (%d bf16 roundings)",
          what, err, tol, roundings);
    if (getenv("MOEFUSE_TEST_VERBOSE"))
        printf("    %-5s err %.3e  tol %.3e\n", what, err, tol);
}

static void check_errs(const errs *e) {
    check_err("y", &e->y, N_Y);
    check_err("dx", &e->dx, N_DX);
    check_err("dp", &e->dp, N_DP);
    check_err("dW13", &e->dw13, N_DW13);
    check_err("dW2", &e->dw2, N_DW2);
}

/* One accuracy case: `reps` fresh problems on one layer, each with poisoned outputs,
 * forward + backward, every element written; errors against the reference pooled
 * over the problems (see errs). */
static void accuracy_reps(shape s, int T, int max_tokens, int64_t stride, routing r,
                          moefuse_saved_mode mode, int reps) {
    moefuse_layer *layer = make_layer(s, max_tokens, mode, 0);
    if (!layer) return;
    errs e;
    memset(&e, 0, sizeof e);
    for (int i = 0; i < reps; i++) {
        problem pb = problem_make(s, T, stride, r);
        outputs o = outputs_make(&pb);
        run_pair(layer, &pb, &o);
        check_written(&pb, &o);
        compare_with_reference(&pb, &o, &e, REF_BF16);
        outputs_free(&o);
        problem_free(&pb);
    }
    check_errs(&e);
    moefuse_layer_destroy(layer);
}

static void accuracy_case(shape s, int T, int max_tokens, int64_t stride, routing r,
                          moefuse_saved_mode mode) {
    accuracy_reps(s, T, max_tokens, stride, r, mode, 1);
}

/* ---- cases: accuracy on the model shapes ------------------------------------------ */

static void qwen3_30b_random(void) {
    accuracy_case(QWEN3_30B, 4, 16, QWEN3_30B.H, ROUTE_RANDOM, MOEFUSE_SAVE_ACTIVATIONS);
}
static void qwen3_30b_few_experts(void) {
    accuracy_case(QWEN3_30B, 16, 16, QWEN3_30B.H + 8, ROUTE_FEW, MOEFUSE_RECOMPUTE);
}
static void qwen3_235b_e16(void) {
    accuracy_case(QWEN3_235B_E16, 8, 8, QWEN3_235B_E16.H, ROUTE_FEW, MOEFUSE_SAVE_ACTIVATIONS);
}
static void qwen3_235b_full(void) {
    /* bf16 weights + fp32 gradients of all 128 experts */
    double need = 128.0 * 3 * QWEN3_235B.I * QWEN3_235B.H * (2 + 4);
    double have = (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE);
    if (need > 0.5 * have) {
        th_skip("needs %.1f GB for weights and gradients of E = 128, this machine has "
                "%.1f GB (the H/I/K case with E = 16 ran instead)", need / 1e9, have / 1e9);
        return;
    }
    accuracy_case(QWEN3_235B, 8, 8, QWEN3_235B.H, ROUTE_FEW, MOEFUSE_SAVE_ACTIVATIONS);
}

/* ---- cases: routing edge cases ---------------------------------------------------- */

/* 8 draws: one token has only K = 4 values of dp (see errs). */
static void one_token(void) {
    accuracy_reps(SMALL, 1, 64, SMALL.H, ROUTE_RANDOM, MOEFUSE_SAVE_ACTIVATIONS, 8);
}
static void max_tokens_random(void) {
    accuracy_case(SMALL, 300, 300, SMALL.H + 3, ROUTE_RANDOM, MOEFUSE_SAVE_ACTIVATIONS);
}
/* 300 rows on expert 0: more than one row task of the backend. */
static void all_on_one_expert(void) {
    accuracy_case(SMALL, 300, 300, SMALL.H, ROUTE_ONE_EXPERT, MOEFUSE_RECOMPUTE);
}
static void most_experts_empty(void) {
    accuracy_case(SMALL, 40, 64, SMALL.H, ROUTE_FEW, MOEFUSE_SAVE_ACTIVATIONS);
}
static void dropped_slots(void) {
    accuracy_case(SMALL, 33, 64, SMALL.H, ROUTE_DROPPED, MOEFUSE_SAVE_ACTIVATIONS);
    accuracy_case(ODD, 17, 17, ODD.H + 1, ROUTE_DROPPED, MOEFUSE_RECOMPUTE);
}
static void odd_shape(void) {
    accuracy_case(ODD, 50, 64, ODD.H, ROUTE_RANDOM, MOEFUSE_SAVE_ACTIVATIONS);
}

/* T = 0: nothing routed; write mode zeroes the weight gradients, accumulate mode
 * leaves them alone. */
static void zero_tokens(void) {
    moefuse_layer *layer = make_layer(SMALL, 8, MOEFUSE_SAVE_ACTIVATIONS, 0);
    if (!layer) return;
    problem pb = problem_make(SMALL, 0, SMALL.H, ROUTE_RANDOM);
    outputs o = outputs_make(&pb);
    void *saved = saved_make(layer, 0);
    outputs_poison(&o, SMALL.E);
    moefuse_fwd_args fa = {.num_tokens = 0, .x_stride = SMALL.H, .w13 = pb.w13, .w2 = pb.w2,
                           .y_stride = SMALL.H, .saved = saved, .expert_counts = o.counts};
    CHECK_OK(moefuse_forward(layer, &fa, NULL));
    moefuse_bwd_args ba = {.num_tokens = 0, .x_stride = SMALL.H, .w13 = pb.w13, .w2 = pb.w2,
                           .saved = saved, .saved_bytes = saved_size(layer, 0),
                           .dy_stride = SMALL.H, .dx_stride = SMALL.H,
                           .dw13 = o.dw13, .dw2 = o.dw2, .accumulate = 1};
    CHECK_OK(moefuse_backward(layer, &ba, NULL));
    CHECK(count_poison32(o.dw13, o.n_dw13) == o.n_dw13 &&
          count_poison32(o.dw2, o.n_dw2) == o.n_dw2, "accumulate with T = 0 touched dW");
    ba.accumulate = 0;
    CHECK_OK(moefuse_backward(layer, &ba, NULL));
    int64_t nz = 0;
    for (int64_t i = 0; i < o.n_dw13; i++) nz += o.dw13[i] != 0.0f;
    for (int64_t i = 0; i < o.n_dw2; i++) nz += o.dw2[i] != 0.0f;
    CHECK(nz == 0, "write mode with T = 0: %lld dW elements not 0", (long long)nz);
    for (int e = 0; e < SMALL.E; e++) CHECK(o.counts[e] == 0, "expert_counts[%d] != 0", e);
    free(saved);
    outputs_free(&o);
    problem_free(&pb);
    moefuse_layer_destroy(layer);
}

/* ---- cases: properties ------------------------------------------------------------ */

/* accumulate = 1 gives exactly fp32(old + the write-mode gradient), element by
 * element, even for an expert with 1000 rows (sgemm with beta = 1 would add its
 * K-block partial sums to C one at a time and differ once the rows exceed its K
 * block, between 256 and 512 for OpenBLAS 0.3.21 here); experts without slots keep
 * the old bits; dx and dp are the write-mode ones. */
static void accumulate_is_old_plus_grad(void) {
    routing rs[2] = {ROUTE_ONE_EXPERT, ROUTE_FEW};
    for (int c = 0; c < 2; c++) {
        moefuse_layer *layer = make_layer(SMALL, 1000, MOEFUSE_SAVE_ACTIVATIONS, 0);
        if (!layer) return;
        problem pb = problem_make(SMALL, 1000, SMALL.H, rs[c]);
        outputs w = outputs_make(&pb), acc = outputs_make(&pb);
        void *saved = saved_make(layer, pb.T);
        outputs_poison(&w, SMALL.E);
        outputs_poison(&acc, SMALL.E);
        CHECK_OK(forward(layer, &pb, &w, saved));
        CHECK_OK(backward(layer, &pb, &w, saved, 0));
        float *old13 = malloc(sizeof(float) * (size_t)w.n_dw13);
        float *old2 = malloc(sizeof(float) * (size_t)w.n_dw2);
        for (int64_t i = 0; i < w.n_dw13; i++) old13[i] = acc.dw13[i] = (float)th_normal();
        for (int64_t i = 0; i < w.n_dw2; i++) old2[i] = acc.dw2[i] = (float)th_normal();
        CHECK_OK(backward(layer, &pb, &acc, saved, 1));
        int64_t bad = 0;
        for (int64_t i = 0; i < w.n_dw13; i++) {
            float want = old13[i] + w.dw13[i];
            bad += memcmp(&want, &acc.dw13[i], 4) != 0;
        }
        for (int64_t i = 0; i < w.n_dw2; i++) {
            float want = old2[i] + w.dw2[i];
            bad += memcmp(&want, &acc.dw2[i], 4) != 0;
        }
        CHECK(bad == 0, "routing %d: %lld accumulated dW elements differ from old + grad",
              (int)rs[c], (long long)bad);
        CHECK(!memcmp(w.dx, acc.dx, sizeof(uint16_t) * (size_t)w.n_y) &&
              !memcmp(w.dp, acc.dp, sizeof(float) * (size_t)w.n_dp),
              "accumulate mode changed dx or dp");
        free(old13);
        free(old2);
        free(saved);
        outputs_free(&w);
        outputs_free(&acc);
        problem_free(&pb);
        moefuse_layer_destroy(layer);
    }
}

/* bf16 of an fp32 value, round to nearest even, worked out apart from the library's
 * bit trick: 8 significant bits kept by rint() (ties to even in the default rounding
 * mode), or a multiple of 2^-133 below 2^-126, where bf16 is subnormal. */
static uint16_t bf16_rne(float f) {
    double d = f, r;
    if (fabs(d) < ldexp(1.0, -126)) {
        r = ldexp(rint(ldexp(d, 133)), -133);
    } else {
        int ex;
        double m = frexp(d, &ex); /* d = m 2^ex, 0.5 <= |m| < 1 */
        r = ldexp(rint(ldexp(m, 8)), ex - 8);
    }
    float rf = (float)r; /* exact: 8 significant bits */
    uint32_t u;
    memcpy(&u, &rf, 4);
    return (uint16_t)(u >> 16);
}

static int bf16_is_nan(uint16_t v) { return (v & 0x7f80) == 0x7f80 && (v & 0x007f) != 0; }

/* Elements of a bf16 output that are not the fp32 one rounded to nearest even: other
 * bits for a finite value, no NaN for a NaN. *nans counts the NaNs. */
static int64_t count_not_rounded(const float *f32, const uint16_t *b16, int64_t n,
                                 int64_t *nans) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        if (isnan(f32[i])) {
            ++*nans;
            bad += !bf16_is_nan(b16[i]);
        } else {
            bad += b16[i] != bf16_rne(f32[i]);
        }
    }
    return bad;
}

/* dw13_bf16 / dw2_bf16 are bitwise the fp32 write-mode dw13 / dw2 of the same inputs
 * rounded to nearest even, every element (the bf16 outputs are poisoned with +inf,
 * which no gradient here rounds to and which is no NaN); experts without slots get
 * +0; y, dx and dp are the fp32 run's. nan_in_x puts a NaN into x of token 0, whose
 * experts' gradients must then come out NaN in bf16 too. */
static void bf16_wgrads_case(shape s, int T, routing r, moefuse_saved_mode mode,
                             int nan_in_x) {
    moefuse_layer *layer = make_layer(s, T > 0 ? T : 8, mode, 0);
    if (!layer) return;
    problem pb = problem_make(s, T, s.H, r);
    if (nan_in_x) pb.x[0] = 0x7fc1;
    outputs w = outputs_make(&pb), b = outputs_make(&pb);
    run_pair(layer, &pb, &w);
    uint16_t *dw13 = malloc(sizeof(uint16_t) * (size_t)w.n_dw13); /* [E, 2I, H] */
    uint16_t *dw2 = malloc(sizeof(uint16_t) * (size_t)w.n_dw2);   /* [E, H, I] */
    for (int64_t i = 0; i < w.n_dw13; i++) dw13[i] = 0x7f80;
    for (int64_t i = 0; i < w.n_dw2; i++) dw2[i] = 0x7f80;
    void *saved = saved_make(layer, T);
    outputs_poison(&b, s.E);
    CHECK_OK(forward(layer, &pb, &b, saved));
    CHECK_OK(backward_bf16(layer, &pb, &b, saved, dw13, dw2));
    int64_t nans = 0;
    int64_t bad13 = count_not_rounded(w.dw13, dw13, w.n_dw13, &nans);
    int64_t bad2 = count_not_rounded(w.dw2, dw2, w.n_dw2, &nans);
    CHECK(bad13 == 0, "%s T=%d: %lld of dw13_bf16 not bf16(fp32 dw13)", s.name, T,
          (long long)bad13);
    CHECK(bad2 == 0, "%s T=%d: %lld of dw2_bf16 not bf16(fp32 dw2)", s.name, T,
          (long long)bad2);
    CHECK(!nan_in_x || nans > 0, "%s: the NaN in x reached no weight gradient", s.name);
    CHECK(!memcmp(w.y, b.y, sizeof(uint16_t) * (size_t)w.n_y) &&
          !memcmp(w.dx, b.dx, sizeof(uint16_t) * (size_t)w.n_y) &&
          !memcmp(w.dp, b.dp, sizeof(float) * (size_t)w.n_dp),
          "%s T=%d: y, dx or dp differ between the fp32 and bf16 weight-gradient runs",
          s.name, T);
    CHECK(count_poison32(b.dw13, b.n_dw13) == b.n_dw13 &&
          count_poison32(b.dw2, b.n_dw2) == b.n_dw2, "fp32 buffers not passed were written");
    free(saved);
    free(dw13);
    free(dw2);
    outputs_free(&w);
    outputs_free(&b);
    problem_free(&pb);
    moefuse_layer_destroy(layer);
}

static void bf16_wgrads_are_rounded_fp32(void) {
    /* 1000 rows on expert 0: past sgemm's K block, where a different call would differ */
    bf16_wgrads_case(SMALL, 1000, ROUTE_ONE_EXPERT, MOEFUSE_SAVE_ACTIVATIONS, 0);
    bf16_wgrads_case(SMALL, 40, ROUTE_FEW, MOEFUSE_SAVE_ACTIVATIONS, 0);
    bf16_wgrads_case(ODD, 17, ROUTE_DROPPED, MOEFUSE_RECOMPUTE, 0);
    bf16_wgrads_case(QWEN3_30B_E16, 8, ROUTE_RANDOM, MOEFUSE_SAVE_ACTIVATIONS, 0);
    bf16_wgrads_case(SMALL, 0, ROUTE_RANDOM, MOEFUSE_SAVE_ACTIVATIONS, 0);
    bf16_wgrads_case(SMALL, 64, ROUTE_RANDOM, MOEFUSE_SAVE_ACTIVATIONS, 1);
}

/* MOEFUSE_RECOMPUTE repeats the forward's gemm1 exactly: same bits everywhere, for
 * less saved memory. */
static void recompute_equals_saved(void) {
    struct { shape s; int T; routing r; } cs[2] = {
        {SMALL, 300, ROUTE_ONE_EXPERT}, {QWEN3_30B_E16, 8, ROUTE_RANDOM}};
    for (int c = 0; c < 2; c++) {
        moefuse_layer *ls = make_layer(cs[c].s, cs[c].T, MOEFUSE_SAVE_ACTIVATIONS, 0);
        moefuse_layer *lr = make_layer(cs[c].s, cs[c].T, MOEFUSE_RECOMPUTE, 0);
        if (!ls || !lr) return;
        size_t bs = 0, br = 0;
        CHECK_OK(moefuse_saved_bytes(ls, cs[c].T, &bs));
        CHECK_OK(moefuse_saved_bytes(lr, cs[c].T, &br));
        CHECK(br < bs, "%s: RECOMPUTE saves %zu bytes, not fewer than %zu", cs[c].s.name, br, bs);
        problem pb = problem_make(cs[c].s, cs[c].T, cs[c].s.H, cs[c].r);
        outputs os = outputs_make(&pb), orc = outputs_make(&pb);
        run_pair(ls, &pb, &os);
        run_pair(lr, &pb, &orc);
        CHECK(outputs_equal(&os, &orc), "%s: RECOMPUTE and SAVE_ACTIVATIONS differ",
              cs[c].s.name);
        outputs_free(&os);
        outputs_free(&orc);
        problem_free(&pb);
        moefuse_layer_destroy(ls);
        moefuse_layer_destroy(lr);
    }
}

/* Two forwards in flight, then their backwards in order: each equals its own pair. */
static void two_forwards_then_two_backwards(void) {
    moefuse_layer *layer = make_layer(SMALL, 64, MOEFUSE_SAVE_ACTIVATIONS, 0);
    if (!layer) return;
    problem pa = problem_make(SMALL, 37, SMALL.H, ROUTE_RANDOM);
    problem pb = problem_make(SMALL, 52, SMALL.H, ROUTE_DROPPED);
    outputs a1 = outputs_make(&pa), b1 = outputs_make(&pb);
    outputs a2 = outputs_make(&pa), b2 = outputs_make(&pb);
    run_pair(layer, &pa, &a1);
    run_pair(layer, &pb, &b1);
    void *sa = saved_make(layer, pa.T), *sb = saved_make(layer, pb.T);
    outputs_poison(&a2, SMALL.E);
    outputs_poison(&b2, SMALL.E);
    CHECK_OK(forward(layer, &pa, &a2, sa));
    CHECK_OK(forward(layer, &pb, &b2, sb));
    CHECK_OK(backward(layer, &pa, &a2, sa, 0));
    CHECK_OK(backward(layer, &pb, &b2, sb, 0));
    CHECK(outputs_equal(&a1, &a2), "first of two in-flight forwards: results differ");
    CHECK(outputs_equal(&b1, &b2), "second of two in-flight forwards: results differ");
    free(sa);
    free(sb);
    outputs_free(&a1); outputs_free(&a2); outputs_free(&b1); outputs_free(&b2);
    problem_free(&pa);
    problem_free(&pb);
    moefuse_layer_destroy(layer);
}

/* Same inputs, same bits: twice on one layer, and on layers of 1 and 3 threads (the
 * work is cut by the plan, not by the thread count). A forward without a saved
 * buffer gives the same y. */
static void deterministic(void) {
    moefuse_layer *l0 = make_layer(SMALL, 300, MOEFUSE_SAVE_ACTIVATIONS, 0);
    moefuse_layer *l1 = make_layer(SMALL, 300, MOEFUSE_SAVE_ACTIVATIONS, 1);
    moefuse_layer *l3 = make_layer(SMALL, 300, MOEFUSE_SAVE_ACTIVATIONS, 3);
    if (!l0 || !l1 || !l3) return;
    problem pb = problem_make(SMALL, 300, SMALL.H, ROUTE_ONE_EXPERT);
    outputs r[4];
    for (int i = 0; i < 4; i++) r[i] = outputs_make(&pb);
    run_pair(l0, &pb, &r[0]);
    run_pair(l0, &pb, &r[1]);
    run_pair(l1, &pb, &r[2]);
    run_pair(l3, &pb, &r[3]);
    CHECK(outputs_equal(&r[0], &r[1]), "two runs on one layer differ");
    CHECK(outputs_equal(&r[0], &r[2]), "num_threads = 1 differs from all cores");
    CHECK(outputs_equal(&r[0], &r[3]), "num_threads = 3 differs from all cores");
    memset(r[1].y, 0xff, sizeof(uint16_t) * (size_t)r[1].n_y);
    CHECK_OK(forward(l0, &pb, &r[1], NULL));
    CHECK(!memcmp(r[0].y, r[1].y, sizeof(uint16_t) * (size_t)r[0].n_y),
          "forward without a saved buffer gives another y");
    for (int i = 0; i < 4; i++) outputs_free(&r[i]);
    problem_free(&pb);
    moefuse_layer_destroy(l0);
    moefuse_layer_destroy(l1);
    moefuse_layer_destroy(l3);
}

/* W13 and dW13 in two halves (moefuse.h) give the bits of the packed layout: y, dx, dp,
 * dW2 and dW13 (its halves packed back), fp32 gradients written and accumulated and bf16
 * gradients, saved and recomputed. SMALL (2I = 192) and ODD (2I = 144) have a 64-row
 * weight-gradient chunk across the halves. */
static void halves_case(shape s, int T, routing r, moefuse_saved_mode mode) {
    moefuse_layer *layer = make_layer(s, T > 0 ? T : 8, mode, 0);
    if (!layer) return;
    problem pb = problem_make(s, T, s.H, r);
    outputs p = outputs_make(&pb), h = outputs_make(&pb);
    run_pair(layer, &pb, &p);
    outputs_poison(&h, s.E);
    run_pair_halves(layer, &pb, &h, WGRAD_WRITE, NULL, NULL, 1);
    CHECK(outputs_equal(&p, &h), "%s T=%d mode %d: halves differ from packed", s.name, T,
          (int)mode);

    /* accumulate onto the same old gradients */
    for (int64_t i = 0; i < p.n_dw13; i++) p.dw13[i] = h.dw13[i] = (float)th_normal();
    for (int64_t i = 0; i < p.n_dw2; i++) p.dw2[i] = h.dw2[i] = (float)th_normal();
    void *saved = saved_make(layer, pb.T);
    CHECK_OK(forward(layer, &pb, &p, saved));
    CHECK_OK(backward(layer, &pb, &p, saved, 1));
    run_pair_halves(layer, &pb, &h, WGRAD_ACCUMULATE, NULL, NULL, 1);
    CHECK(outputs_equal(&p, &h), "%s T=%d mode %d: accumulated halves differ", s.name, T,
          (int)mode);

    uint16_t *b13[2], *b2[2];
    for (int i = 0; i < 2; i++) {
        b13[i] = malloc(sizeof(uint16_t) * (size_t)p.n_dw13);
        b2[i] = malloc(sizeof(uint16_t) * (size_t)p.n_dw2);
        memset(b13[i], 0xff, sizeof(uint16_t) * (size_t)p.n_dw13);
        memset(b2[i], 0xff, sizeof(uint16_t) * (size_t)p.n_dw2);
    }
    CHECK_OK(forward(layer, &pb, &p, saved));
    CHECK_OK(backward_bf16(layer, &pb, &p, saved, b13[0], b2[0]));
    run_pair_halves(layer, &pb, &h, WGRAD_BF16, b13[1], b2[1], 1);
    CHECK(!memcmp(b13[0], b13[1], sizeof(uint16_t) * (size_t)p.n_dw13) &&
              !memcmp(b2[0], b2[1], sizeof(uint16_t) * (size_t)p.n_dw2),
          "%s T=%d mode %d: bf16 gradients in halves differ", s.name, T, (int)mode);
    for (int i = 0; i < 2; i++) {
        free(b13[i]);
        free(b2[i]);
    }
    free(saved);
    outputs_free(&p);
    outputs_free(&h);
    problem_free(&pb);
    moefuse_layer_destroy(layer);
}

static void halves_equal_packed(void) {
    halves_case(SMALL, 200, ROUTE_RANDOM, MOEFUSE_SAVE_ACTIVATIONS);
    halves_case(SMALL, 77, ROUTE_FEW, MOEFUSE_RECOMPUTE);
    halves_case(ODD, 50, ROUTE_DROPPED, MOEFUSE_SAVE_ACTIVATIONS);
    halves_case(SMALL, 0, ROUTE_RANDOM, MOEFUSE_SAVE_ACTIVATIONS);
}

/* A saved buffer the backward cannot use is refused with MOEFUSE_ERR_SAVED_STATE
 * and no output is touched: another T, another layer config, junk, other ids. */
static void refuses_foreign_saved(void) {
    moefuse_layer *layer = make_layer(SMALL, 64, MOEFUSE_SAVE_ACTIVATIONS, 0);
    shape other_shape = SMALL;
    other_shape.I = SMALL.I + 16;
    moefuse_layer *other = make_layer(other_shape, 64, MOEFUSE_SAVE_ACTIVATIONS, 0);
    if (!layer || !other) return;
    problem p5 = problem_make(SMALL, 5, SMALL.H, ROUTE_RANDOM);
    problem p4 = problem_make(SMALL, 4, SMALL.H, ROUTE_RANDOM);
    problem po = problem_make(other_shape, 5, SMALL.H, ROUTE_RANDOM);
    outputs o5 = outputs_make(&p5), o4 = outputs_make(&p4), oo = outputs_make(&po);
    void *s5 = saved_make(layer, 5), *so = saved_make(other, 5);
    outputs_poison(&o5, SMALL.E);
    outputs_poison(&oo, other_shape.E);
    CHECK_OK(forward(layer, &p5, &o5, s5));
    CHECK_OK(forward(other, &po, &oo, so));

    struct { const char *what; problem *pb; const void *saved; } bad[3] = {
        {"saved of T = 5 given to a backward of T = 4", &p4, s5},
        {"saved of a layer with another I", &p5, so},
        {"saved never written by a forward", &p5, NULL},
    };
    void *junk = saved_make(layer, 5);
    bad[2].saved = junk;
    for (int i = 0; i < 3; i++) {
        outputs *o = bad[i].pb == &p4 ? &o4 : &o5;
        outputs_poison(o, SMALL.E);
        moefuse_status st = backward(layer, bad[i].pb, o, bad[i].saved, 0);
        CHECK(st == MOEFUSE_ERR_SAVED_STATE, "%s: got %s, expected MOEFUSE_ERR_SAVED_STATE",
              bad[i].what, moefuse_status_string(st));
        CHECK(strlen(moefuse_last_error()) > 0, "%s: no error message", bad[i].what);
        CHECK(count_poison32(o->dw13, o->n_dw13) == o->n_dw13 &&
              count_poison32(o->dp, o->n_dp) == o->n_dp, "%s: outputs touched", bad[i].what);
    }
    /* ids changed after the forward: the saved plan no longer describes them */
    int32_t keep = p5.ids[0];
    p5.ids[0] = keep == 1 ? 2 : 1;
    for (int k = 1; k < SMALL.K; k++)
        if (p5.ids[k] == p5.ids[0]) p5.ids[k] = -1;
    outputs_poison(&o5, SMALL.E);
    moefuse_status st = backward(layer, &p5, &o5, s5, 0);
    CHECK(st == MOEFUSE_ERR_SAVED_STATE, "ids changed since the forward: got %s",
          moefuse_status_string(st));
    free(junk);
    free(s5);
    free(so);
    outputs_free(&o5); outputs_free(&o4); outputs_free(&oo);
    problem_free(&p5); problem_free(&p4); problem_free(&po);
    moefuse_layer_destroy(layer);
    moefuse_layer_destroy(other);
}

int main(void) {
    th_seed_from_env_or_clock();
    th_run("qwen3-30b-a3b T=4 random routing vs fp64 reference", qwen3_30b_random);
    th_run("qwen3-30b-a3b T=16 most experts empty, recompute, strided", qwen3_30b_few_experts);
    th_run("qwen3-235b-a22b H/I/K E=16 T=8 vs fp64 reference", qwen3_235b_e16);
    th_run("qwen3-235b-a22b E=128 T=8 vs fp64 reference", qwen3_235b_full);
    th_run("T = 1", one_token);
    th_run("T = max_tokens = 300, strided rows", max_tokens_random);
    th_run("all tokens on one expert (300 rows)", all_on_one_expert);
    th_run("most experts empty", most_experts_empty);
    th_run("dropped slots, a token with all K dropped", dropped_slots);
    th_run("odd shape H=200 I=72 E=9 K=3", odd_shape);
    th_run("T = 0", zero_tokens);
    th_run("accumulate = old + write-mode gradient, bitwise", accumulate_is_old_plus_grad);
    th_run("bf16 weight gradients = bf16(fp32 write mode), bitwise", bf16_wgrads_are_rounded_fp32);
    th_run("MOEFUSE_RECOMPUTE bitwise equals MOEFUSE_SAVE_ACTIVATIONS", recompute_equals_saved);
    th_run("two forwards then two backwards", two_forwards_then_two_backwards);
    th_run("bitwise deterministic, any thread count", deterministic);
    th_run("foreign saved buffers refused", refuses_foreign_saved);
    th_run("W13 and dW13 in two halves = packed, bitwise", halves_equal_packed);
    problem_pool_free();
    return th_finish();
}
