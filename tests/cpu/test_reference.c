/* Tests of the fp64 reference (src/cpu/reference.c), the truth for every other test:
 * the experts' forward and backward, and the routing's backward. The fp32 CPU routing
 * helper is checked against it in test_route.c.
 *
 * The reference's backward is checked against central finite differences of its own
 * forward, and its forward against a direct per-slot transcription of the math, so
 * the truth rests on nothing but the formulas of include/moefuse.h. */
#include "harness.h"
#include "reference.h"
#include "cpu_test_util.h"

#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

/* ---- helpers ------------------------------------------------------------------- */

static double *normal_array(int64_t n, double scale) {
    double *a = xmalloc((size_t)n * sizeof(double));
    for (int64_t i = 0; i < n; i++) a[i] = th_normal() * scale;
    return a;
}

/* ids [T, K]: K distinct experts per token (partial Fisher-Yates). */
static int32_t *random_ids(int T, int E, int K) {
    int32_t *ids = xmalloc((size_t)T * K * sizeof(int32_t));
    int32_t *perm = xmalloc((size_t)E * sizeof(int32_t));
    for (int t = 0; t < T; t++) {
        for (int e = 0; e < E; e++) perm[e] = e;
        for (int k = 0; k < K; k++) {
            int j = th_rand_int(k, E - 1);
            int32_t tmp = perm[k];
            perm[k] = perm[j];
            perm[j] = tmp;
            ids[(int64_t)t * K + k] = perm[k];
        }
    }
    free(perm);
    return ids;
}

static double inner(const double *a, const double *b, int64_t n) {
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* A direct transcription of the forward, one slot at a time, sharing no code with
 * reference.c. */
static void naive_forward(const mf_ref_shape *s, const double *x, const int32_t *ids,
                          const double *p, const double *w13, const double *w2,
                          double *y) {
    const int T = s->num_tokens, H = s->hidden, I = s->intermediate, K = s->top_k;
    double *a = xmalloc((size_t)I * sizeof(double));
    for (int t = 0; t < T; t++) {
        for (int h = 0; h < H; h++) y[t * H + h] = 0;
        for (int k = 0; k < K; k++) {
            int e = ids[t * K + k];
            if (e < 0) continue;
            for (int i = 0; i < I; i++) {
                double g = 0, u = 0;
                for (int h = 0; h < H; h++) {
                    g += w13[((int64_t)e * 2 * I + i) * H + h] * x[t * H + h];
                    u += w13[((int64_t)e * 2 * I + I + i) * H + h] * x[t * H + h];
                }
                a[i] = g / (1 + exp(-g)) * u;
            }
            for (int h = 0; h < H; h++) {
                double o = 0;
                for (int i = 0; i < I; i++) o += w2[((int64_t)e * H + h) * I + i] * a[i];
                y[t * H + h] += p[t * K + k] * o;
            }
        }
    }
    free(a);
}

/* ---- the experts' reference ---------------------------------------------------- */

/* Same terms, different summation order: both errors are bounded by about
 * (H + I) u * sum|terms| with u = 1.1e-16, i.e. ~5e-15 * (sum|terms| / |sum|), and
 * for N(0,1) data that ratio is ~sqrt(H) ~ 5, so ~3e-14. 1e-12 leaves 30x; a wrong
 * formula is off by O(1). */
static void test_forward_matches_naive(void) {
    mf_ref_shape s = {.num_tokens = 37, .hidden = 24, .intermediate = 12,
                      .num_experts = 6, .top_k = 3};
    const int T = s.num_tokens, H = s.hidden, I = s.intermediate, E = s.num_experts,
              K = s.top_k;
    double *x = normal_array((int64_t)T * H, 1.0);
    double *w13 = normal_array((int64_t)E * 2 * I * H, 1.0 / sqrt(H));
    double *w2 = normal_array((int64_t)E * H * I, 1.0 / sqrt(I));
    double *p = normal_array((int64_t)T * K, 1.0);
    int32_t *ids = random_ids(T, E, K);
    ids[0 * K + 1] = -1;                                /* a dropped slot */
    for (int k = 0; k < K; k++) ids[5 * K + k] = -1;    /* a token with all dropped */
    double *y = normal_array((int64_t)T * H, 1.0);      /* poison */
    double *y_naive = xmalloc((size_t)T * H * sizeof(double));

    mf_ref_forward(&s, x, ids, p, w13, w2, y);
    naive_forward(&s, x, ids, p, w13, w2, y_naive);
    double err = th_rel_l2(y, y_naive, (int64_t)T * H);
    CHECK(err < 1e-12, "rel l2 forward vs naive %.3g, expected < 1e-12", err);
    int all_zero = 1;
    for (int h = 0; h < H; h++) all_zero &= y[5 * H + h] == 0.0;
    CHECK(all_zero, "token 5 has every slot dropped: expected y = 0");

    free(x); free(w13); free(w2); free(p); free(ids); free(y); free(y_naive);
}

/* L = <dy, y>. Central differences: truncation h^2/6 |L'''| ~ 2e-13 for O(1)
 * derivatives; roundoff ~ (ops per output ~ H + I + K ~ 15) u |L|_terms / h
 * ~ 15 * 1.1e-16 * 20 / 1e-6 ~ 3e-8 absolute in the worst case (the typical case is
 * 100x smaller), against gradient entries of size ~0.1..1. A relative 2-norm error
 * below 1e-6 is therefore expected with margin; a wrong term is off by O(1). */
#define FD_STEP 1e-6
#define FD_TOL 1e-6

typedef struct fd_problem {
    mf_ref_shape s;
    double *x, *p, *w13, *w2, *dy, *y;
    int32_t *ids;
} fd_problem;

static double fd_loss(fd_problem *f) {
    mf_ref_forward(&f->s, f->x, f->ids, f->p, f->w13, f->w2, f->y);
    return inner(f->dy, f->y, (int64_t)f->s.num_tokens * f->s.hidden);
}

/* Central differences of L over every entry of param [n], into grad. */
static void fd_grad(fd_problem *f, double *param, int64_t n, double *grad) {
    for (int64_t i = 0; i < n; i++) {
        double v = param[i];
        param[i] = v + FD_STEP;
        double lp = fd_loss(f);
        param[i] = v - FD_STEP;
        double lm = fd_loss(f);
        param[i] = v;
        grad[i] = (lp - lm) / (2 * FD_STEP);
    }
}

static void test_backward_finite_differences(void) {
    fd_problem f;
    f.s = (mf_ref_shape){.num_tokens = 4, .hidden = 8, .intermediate = 4,
                         .num_experts = 5, .top_k = 2};
    const int T = f.s.num_tokens, H = f.s.hidden, I = f.s.intermediate,
              E = f.s.num_experts, K = f.s.top_k;
    const int64_t n_x = (int64_t)T * H, n_p = (int64_t)T * K;
    const int64_t n_w13 = (int64_t)E * 2 * I * H, n_w2 = (int64_t)E * H * I;
    /* Scales put g near N(0, 1), where silu is curved, so silu' is really tested. */
    f.x = normal_array(n_x, 1.0);
    f.w13 = normal_array(n_w13, 1.0 / sqrt(H));
    f.w2 = normal_array(n_w2, 1.0 / sqrt(I));
    f.p = normal_array(n_p, 1.0);
    f.dy = normal_array(n_x, 1.0);
    f.y = xmalloc((size_t)n_x * sizeof(double));
    f.ids = random_ids(T, E, K);
    f.ids[1 * K + 1] = -1;                   /* one slot dropped */
    f.ids[3 * K + 0] = f.ids[3 * K + 1] = -1; /* a token with every slot dropped */

    double *dx = normal_array(n_x, 1.0), *dp = normal_array(n_p, 1.0);  /* poisoned */
    double *dw13 = normal_array(n_w13, 1.0), *dw2 = normal_array(n_w2, 1.0);
    mf_ref_backward(&f.s, f.x, f.ids, f.p, f.w13, f.w2, f.dy, dx, dp, dw13, dw2);

    struct {
        const char *name;
        double *param, *grad;
        int64_t n;
    } cases[] = {{"dx", f.x, dx, n_x}, {"dp", f.p, dp, n_p},
                 {"dw13", f.w13, dw13, n_w13}, {"dw2", f.w2, dw2, n_w2}};
    for (int c = 0; c < 4; c++) {
        double *fd = xmalloc((size_t)cases[c].n * sizeof(double));
        fd_grad(&f, cases[c].param, cases[c].n, fd);
        double err = th_rel_l2(cases[c].grad, fd, cases[c].n);
        CHECK(err < FD_TOL, "%s: rel l2 vs central differences %.3g, expected < %g",
              cases[c].name, err, FD_TOL);
        free(fd);
    }
    CHECK(dp[1 * K + 1] == 0.0 && dp[3 * K] == 0.0 && dp[3 * K + 1] == 0.0,
          "dropped slots: expected dp = 0 exactly, got %g %g %g", dp[1 * K + 1], dp[3 * K],
          dp[3 * K + 1]);
    int zero = 1;
    for (int h = 0; h < H; h++) zero &= dx[3 * H + h] == 0.0;
    CHECK(zero, "token 3 has every slot dropped: expected dx = 0 exactly");

    free(f.x); free(f.w13); free(f.w2); free(f.p); free(f.dy); free(f.y); free(f.ids);
    free(dx); free(dp); free(dw13); free(dw2);
}

/* W13 and dW13 in two halves: the packed results, bitwise (the same sums in the same
 * order), for the fp64 math and the FP8 recipe's emulation. */
static void test_halves_equal_packed(void) {
    mf_ref_shape s = {.num_tokens = 21, .hidden = 24, .intermediate = 12,
                      .num_experts = 5, .top_k = 2};
    const int T = s.num_tokens, H = s.hidden, I = s.intermediate, E = s.num_experts,
              K = s.top_k;
    const int64_t n_x = (int64_t)T * H, n_p = (int64_t)T * K;
    const int64_t n_w13 = (int64_t)E * 2 * I * H, n_w2 = (int64_t)E * H * I, half = n_w13 / 2;
    double *x = normal_array(n_x, 1.0), *dy = normal_array(n_x, 1.0);
    double *w13 = normal_array(n_w13, 1.0 / sqrt(H)), *w2 = normal_array(n_w2, 1.0 / sqrt(I));
    double *p = normal_array(n_p, 1.0);
    int32_t *ids = random_ids(T, E, K);
    ids[3] = -1;
    double *gate = xmalloc(sizeof(double) * (size_t)half), *up = xmalloc(sizeof(double) * (size_t)half);
    for (int e = 0; e < E; e++) {
        memcpy(gate + (int64_t)e * I * H, w13 + (int64_t)e * 2 * I * H, sizeof(double) * (size_t)(I * H));
        memcpy(up + (int64_t)e * I * H, w13 + ((int64_t)e * 2 + 1) * I * H, sizeof(double) * (size_t)(I * H));
    }
    for (int fp8 = 0; fp8 < 2; fp8++) {
        double *o[2][4], *dgate = normal_array(half, 1.0), *dup = normal_array(half, 1.0);
        for (int r = 0; r < 2; r++) {
            o[r][0] = normal_array(n_x, 1.0);
            o[r][1] = normal_array(n_x, 1.0);
            o[r][2] = normal_array(n_p, 1.0);
            o[r][3] = normal_array(n_w2, 1.0);
        }
        double *dw13 = normal_array(n_w13, 1.0);
        if (fp8) {
            mf_ref_fp8_forward(&s, 0, x, ids, p, w13, w2, o[0][0]);
            mf_ref_fp8_backward(&s, 0, x, ids, p, w13, w2, dy, o[0][1], o[0][2], dw13, o[0][3]);
            mf_ref_fp8_forward_halves(&s, 0, x, ids, p, gate, up, w2, o[1][0]);
            mf_ref_fp8_backward_halves(&s, 0, x, ids, p, gate, up, w2, dy, o[1][1], o[1][2],
                                       dgate, dup, o[1][3]);
        } else {
            mf_ref_forward(&s, x, ids, p, w13, w2, o[0][0]);
            mf_ref_backward(&s, x, ids, p, w13, w2, dy, o[0][1], o[0][2], dw13, o[0][3]);
            mf_ref_forward_halves(&s, x, ids, p, gate, up, w2, o[1][0]);
            mf_ref_backward_halves(&s, x, ids, p, gate, up, w2, dy, o[1][1], o[1][2], dgate,
                                   dup, o[1][3]);
        }
        const int64_t sizes[4] = {n_x, n_x, n_p, n_w2};
        const char *names[4] = {"y", "dx", "dp", "dw2"};
        for (int i = 0; i < 4; i++)
            CHECK(!memcmp(o[0][i], o[1][i], sizeof(double) * (size_t)sizes[i]),
                  "%s: %s in halves differs from packed", fp8 ? "fp8" : "fp64", names[i]);
        int same = 1;
        for (int e = 0; e < E; e++) {
            const double *de = dw13 + (int64_t)e * 2 * I * H;
            same &= !memcmp(de, dgate + (int64_t)e * I * H, sizeof(double) * (size_t)(I * H));
            same &= !memcmp(de + I * H, dup + (int64_t)e * I * H, sizeof(double) * (size_t)(I * H));
        }
        CHECK(same, "%s: dW13 halves differ from the packed gradient", fp8 ? "fp8" : "fp64");
        for (int r = 0; r < 2; r++)
            for (int i = 0; i < 4; i++) free(o[r][i]);
        free(dw13); free(dgate); free(dup);
    }
    free(x); free(dy); free(w13); free(w2); free(p); free(ids); free(gate); free(up);
}

/* Experts with no slot must get dW = 0 (written, not left), and results must not
 * depend on the thread count (each element is summed by one thread in data order). */
static void test_backward_deterministic_and_empty_experts(void) {
    mf_ref_shape s = {.num_tokens = 29, .hidden = 40, .intermediate = 20,
                      .num_experts = 12, .top_k = 2};
    const int T = s.num_tokens, H = s.hidden, I = s.intermediate, E = s.num_experts,
              K = s.top_k;
    const int64_t n_x = (int64_t)T * H, n_p = (int64_t)T * K;
    const int64_t n_w13 = (int64_t)E * 2 * I * H, n_w2 = (int64_t)E * H * I;
    double *x = normal_array(n_x, 1.0), *dy = normal_array(n_x, 1.0);
    double *w13 = normal_array(n_w13, 1.0 / sqrt(H)), *w2 = normal_array(n_w2, 1.0 / sqrt(I));
    double *p = normal_array(n_p, 1.0);
    /* Only experts 0..5 used: 6..11 are empty. */
    int32_t *ids = random_ids(T, 6, K);
    ids[7] = -1;

    double *out[2][5];
    int threads[2] = {1, 3};
    int saved_threads = omp_get_max_threads();
    for (int r = 0; r < 2; r++) {
        omp_set_num_threads(threads[r]);
        out[r][0] = normal_array(n_x, 1.0);    /* y, poisoned */
        out[r][1] = normal_array(n_x, 1.0);    /* dx */
        out[r][2] = normal_array(n_p, 1.0);    /* dp */
        out[r][3] = normal_array(n_w13, 1.0);  /* dw13 */
        out[r][4] = normal_array(n_w2, 1.0);   /* dw2 */
        mf_ref_forward(&s, x, ids, p, w13, w2, out[r][0]);
        mf_ref_backward(&s, x, ids, p, w13, w2, dy, out[r][1], out[r][2], out[r][3],
                        out[r][4]);
    }
    omp_set_num_threads(saved_threads);
    const int64_t sizes[5] = {n_x, n_x, n_p, n_w13, n_w2};
    const char *names[5] = {"y", "dx", "dp", "dw13", "dw2"};
    for (int i = 0; i < 5; i++)
        CHECK(memcmp(out[0][i], out[1][i], (size_t)sizes[i] * sizeof(double)) == 0,
              "%s differs between 1 and 3 threads", names[i]);
    int zero = 1;
    for (int64_t i = 6 * 2 * I * H; i < n_w13; i++) zero &= out[0][3][i] == 0.0;
    for (int64_t i = 6 * H * I; i < n_w2; i++) zero &= out[0][4][i] == 0.0;
    CHECK(zero, "experts 6..11 have no slot: expected dw13 = dw2 = 0 exactly");

    for (int r = 0; r < 2; r++)
        for (int i = 0; i < 5; i++) free(out[r][i]);
    free(x); free(dy); free(w13); free(w2); free(p); free(ids);
}

/* ---- routing: the fp64 reference ----------------------------------------------- */

/* logits [T, E]: each row a random permutation of 0.3 * (0..E-1) plus noise below
 * 0.05, so neighbouring logits are >= 0.25 apart and the top-K set cannot change
 * under a 1e-6 step. */
static double *spread_logits(int T, int E) {
    double *l = xmalloc((size_t)T * E * sizeof(double));
    int32_t *perm = random_ids(T, E, E);
    for (int64_t i = 0; i < (int64_t)T * E; i++)
        l[i] = 0.3 * perm[i] + 0.05 * th_uniform() - 0.15 * E;
    free(perm);
    return l;
}

/* Same finite-difference argument as for the experts (the loss is K terms deep, so
 * the roundoff bound is smaller still). */
static void test_route_reference_finite_differences(void) {
    const int T = 5, E = 10, K = 3;
    double *l = spread_logits(T, E);
    double *dw = normal_array((int64_t)T * K, 1.0);
    int32_t *ids = xmalloc((size_t)T * K * sizeof(int32_t));
    int32_t *ids2 = xmalloc((size_t)T * K * sizeof(int32_t));
    double *w = xmalloc((size_t)T * K * sizeof(double));
    double *dl = normal_array((int64_t)T * E, 1.0);  /* poisoned */
    double *fd = xmalloc((size_t)T * E * sizeof(double));

    mf_ref_route_forward(T, E, K, l, ids, w);
    for (int t = 0; t < T; t++) {
        double sum = 0;
        for (int k = 0; k < K; k++) {
            sum += w[t * K + k];
            if (k > 0)
                CHECK(w[t * K + k] <= w[t * K + k - 1], "token %d: weights not decreasing", t);
        }
        CHECK(fabs(sum - 1) < 8 * DBL_EPSILON, "token %d: weights sum to %.17g", t, sum);
    }
    mf_ref_route_backward(T, E, K, l, ids, dw, dl);
    for (int64_t i = 0; i < (int64_t)T * E; i++) {
        double v = l[i];
        l[i] = v + FD_STEP;
        mf_ref_route_forward(T, E, K, l, ids2, w);
        double lp = inner(dw, w, (int64_t)T * K);
        int same = memcmp(ids, ids2, (size_t)T * K * sizeof(int32_t)) == 0;
        l[i] = v - FD_STEP;
        mf_ref_route_forward(T, E, K, l, ids2, w);
        double lm = inner(dw, w, (int64_t)T * K);
        same &= memcmp(ids, ids2, (size_t)T * K * sizeof(int32_t)) == 0;
        l[i] = v;
        CHECK(same, "logit %lld: the top-K set moved under the step", (long long)i);
        fd[i] = (lp - lm) / (2 * FD_STEP);
    }
    double err = th_rel_l2(dl, fd, (int64_t)T * E);
    CHECK(err < FD_TOL, "dlogits: rel l2 vs central differences %.3g, expected < %g", err,
          FD_TOL);
    for (int t = 0; t < T; t++) {
        int n_nonzero = 0;
        for (int e = 0; e < E; e++) n_nonzero += dl[t * E + e] != 0.0;
        CHECK(n_nonzero <= K, "token %d: %d nonzero dlogits, expected <= K", t, n_nonzero);
    }
    free(l); free(dw); free(ids); free(ids2); free(w); free(dl); free(fd);
}

int main(void) {
    th_seed_from_env_or_clock();
    th_run("reference forward matches a naive per-slot forward", test_forward_matches_naive);
    th_run("reference backward vs central differences (dx, dp, dW13, dW2)",
           test_backward_finite_differences);
    th_run("reference backward: thread-count independent, empty experts zeroed",
           test_backward_deterministic_and_empty_experts);
    th_run("W13 and dW13 in two halves = packed, bitwise (fp64 and FP8 emulation)",
           test_halves_equal_packed);
    th_run("reference routing backward vs central differences",
           test_route_reference_finite_differences);
    return th_finish();
}
