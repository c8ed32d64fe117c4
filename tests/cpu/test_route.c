/* Tests of the fp32 CPU routing helper (src/cpu/route.c) against the fp64 reference
 * (src/cpu/reference.c, itself checked in test_reference.c): ids, weights and dlogits
 * within the fp32 path's error bound, K = E, ties, T = 0, NaN logits, and every
 * validation error (status, the argument named, outputs untouched). */
#include "harness.h"
#include "internal.h"
#include "reference.h"
#include "cpu_test_util.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- routing: the fp32 helper against the reference ---------------------------- */

#define U32 (1.0 / 16777216.0) /* fp32 unit roundoff 2^-24 */

/* Runs the fp32 helper and the fp64 reference on the same fp32 logits and compares.
 * Ids: both select on the same logits with the same order, so they must be equal.
 * Weights, first-order error of the fp32 path (c = max over the selected of m - l):
 *   fl(l - m) adds c u to the exponent, expf one ulp (2u): p_j = e_j / z is off by
 *   (c + 3) u relative (z's own error is common to all p_j and cancels in the
 *   renormalization); their sum S by (c + 3 + K) u; w = p / S by (2c + K + 7) u.
 * Dlogits, dl_n = w_n (dw_n - s) with s = sum_k w_k dw_k, eps_w the bound above:
 *   |err| <= w_n [(eps_w + (K + 1) u) sum_k |w_k dw_k| + (eps_w + 2u) |dw_n - s|].
 * Second-order terms (~(50u)^2 relative) are covered by a 1e-3 relative slack. */
static void compare_route(int T, int E, int K, const float *logits, const float *dweights) {
    int32_t *ids = xmalloc((size_t)T * K * sizeof(int32_t));
    float *w = xmalloc((size_t)T * K * sizeof(float));
    float *dl = xmalloc((size_t)T * E * sizeof(float));
    int32_t *rids = xmalloc((size_t)T * K * sizeof(int32_t));
    double *rw = xmalloc((size_t)T * K * sizeof(double));
    double *rdl = xmalloc((size_t)T * E * sizeof(double));
    double *l64 = xmalloc((size_t)T * E * sizeof(double));
    double *dw64 = xmalloc((size_t)T * K * sizeof(double));
    for (int64_t i = 0; i < (int64_t)T * E; i++) l64[i] = logits[i];
    for (int64_t i = 0; i < (int64_t)T * K; i++) dw64[i] = dweights[i];
    memset(dl, 0x7b, (size_t)T * E * sizeof(float));

    moefuse_route_args fa = {.num_tokens = T, .num_experts = E, .top_k = K,
                             .logits = logits, .ids = ids, .weights = w};
    moefuse_status st = mf_cpu_route_forward(&fa);
    CHECK(st == MOEFUSE_OK, "route forward: status %d", st);
    moefuse_route_bwd_args ba = {.num_tokens = T, .num_experts = E, .top_k = K,
                                 .logits = logits, .ids = ids, .dweights = dweights,
                                 .dlogits = dl};
    st = mf_cpu_route_backward(&ba);
    CHECK(st == MOEFUSE_OK, "route backward: status %d", st);
    mf_ref_route_forward(T, E, K, l64, rids, rw);
    mf_ref_route_backward(T, E, K, l64, rids, dw64, rdl);

    CHECK(memcmp(ids, rids, (size_t)T * K * sizeof(int32_t)) == 0,
          "ids differ from the reference");
    int bad_w = 0, bad_dl = 0;
    for (int t = 0; t < T && !bad_w && !bad_dl; t++) {
        const double *lt = l64 + (int64_t)t * E;
        const int32_t *id = rids + (int64_t)t * K;
        const double *wt = rw + (int64_t)t * K, *dwt = dw64 + (int64_t)t * K;
        double c = lt[id[0]] - lt[id[K - 1]];
        double eps_w = (2 * c + K + 7) * U32 * (1 + 1e-3);
        double s = 0, s_abs = 0;
        for (int k = 0; k < K; k++) {
            s += wt[k] * dwt[k];
            s_abs += fabs(wt[k] * dwt[k]);
        }
        for (int k = 0; k < K; k++) {
            double err = fabs(w[(int64_t)t * K + k] - wt[k]);
            if (!(err <= eps_w * wt[k])) {
                CHECK(0, "weights[%d][%d] = %.9g, reference %.17g, |err| %.3g > bound %.3g",
                      t, k, w[(int64_t)t * K + k], wt[k], err, eps_w * wt[k]);
                bad_w = 1;
            }
        }
        for (int e = 0; e < E; e++) {
            double ref = rdl[(int64_t)t * E + e], got = dl[(int64_t)t * E + e];
            double bound = 0;
            for (int k = 0; k < K; k++)
                if (id[k] == e)
                    bound = wt[k] * ((eps_w + (K + 1) * U32) * s_abs +
                                     (eps_w + 2 * U32) * fabs(dwt[k] - s)) * (1 + 1e-3);
            if (!(fabs(got - ref) <= bound)) {
                CHECK(0, "dlogits[%d][%d] = %.9g, reference %.17g, bound %.3g", t, e, got,
                      ref, bound);
                bad_dl = 1;
                break;
            }
        }
    }
    free(ids); free(w); free(dl); free(rids); free(rw); free(rdl); free(l64); free(dw64);
}

static float *normal_floats(int64_t n, double scale) {
    float *a = xmalloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) a[i] = (float)(th_normal() * scale);
    return a;
}

static void test_route_fp32_vs_reference(void) {
    const int T = 256, E = 128, K = 8;
    /* Router logits of a trained model spread over a few units. */
    float *l = normal_floats((int64_t)T * E, 2.0);
    float *dw = normal_floats((int64_t)T * K, 1.0);
    compare_route(T, E, K, l, dw);
    free(l);
    free(dw);
}

static void test_route_k_equals_e(void) {
    const int T = 9, E = 16, K = 16;
    float *l = normal_floats((int64_t)T * E, 2.0);
    float *dw = normal_floats((int64_t)T * K, 1.0);
    compare_route(T, E, K, l, dw);
    /* Every expert selected: ids are all of 0..E-1 in decreasing logit order. */
    int32_t ids[16];
    float w[16];
    moefuse_route_args a = {.num_tokens = 1, .num_experts = E, .top_k = K, .logits = l,
                            .ids = ids, .weights = w};
    CHECK(mf_cpu_route_forward(&a) == MOEFUSE_OK, "route forward failed");
    int seen = 0;
    for (int k = 0; k < K; k++) {
        seen |= 1 << ids[k];
        if (k > 0) CHECK(l[ids[k]] <= l[ids[k - 1]], "ids[%d]: logits not decreasing", k);
    }
    CHECK(seen == 0xffff, "K = E: expected every expert once");
    free(l);
    free(dw);
}

/* Equal logits: the lower id wins, in both implementations. */
static void test_route_ties(void) {
    {
        const int E = 8, K = 3;
        float l[8] = {0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f};
        double l64[8];
        for (int e = 0; e < E; e++) l64[e] = l[e];
        int32_t ids[3], rids[3];
        float w[3];
        double rw[3];
        moefuse_route_args a = {.num_tokens = 1, .num_experts = E, .top_k = K, .logits = l,
                                .ids = ids, .weights = w};
        CHECK(mf_cpu_route_forward(&a) == MOEFUSE_OK, "route forward failed");
        mf_ref_route_forward(1, E, K, l64, rids, rw);
        for (int k = 0; k < K; k++) {
            CHECK(ids[k] == k && rids[k] == k, "all equal: ids[%d] = %d (ref %d), expected %d",
                  k, ids[k], rids[k], k);
            /* (1/8) / (3/8): expf(0) = 1 and 1/8, 3/8 are exact, one rounding left */
            CHECK(fabs(w[k] - 1.0 / 3) <= U32 / 3 && fabs(rw[k] - 1.0 / 3) <= DBL_EPSILON,
                  "all equal: weight %d = %.9g (ref %.17g), expected 1/3", k, w[k], rw[k]);
        }
    }
    {
        const int E = 6, K = 4;
        float l[6] = {1.0f, 3.0f, 3.0f, 2.0f, 3.0f, 0.0f};
        double l64[6];
        for (int e = 0; e < E; e++) l64[e] = l[e];
        int32_t ids[4], rids[4];
        float w[4];
        double rw[4];
        const int32_t expect[4] = {1, 2, 4, 3};
        moefuse_route_args a = {.num_tokens = 1, .num_experts = E, .top_k = K, .logits = l,
                                .ids = ids, .weights = w};
        CHECK(mf_cpu_route_forward(&a) == MOEFUSE_OK, "route forward failed");
        mf_ref_route_forward(1, E, K, l64, rids, rw);
        for (int k = 0; k < K; k++)
            CHECK(ids[k] == expect[k] && rids[k] == expect[k],
                  "partial ties: ids[%d] = %d (ref %d), expected %d", k, ids[k], rids[k],
                  expect[k]);
        CHECK(w[0] == w[1] && w[1] == w[2], "tied logits: expected equal weights");
    }
}

static void test_route_zero_tokens(void) {
    moefuse_route_args a = {.num_tokens = 0, .num_experts = 8, .top_k = 2};
    CHECK(mf_cpu_route_forward(&a) == MOEFUSE_OK, "T = 0 with NULL arrays: expected OK");
    moefuse_route_bwd_args b = {.num_tokens = 0, .num_experts = 8, .top_k = 2};
    CHECK(mf_cpu_route_backward(&b) == MOEFUSE_OK, "T = 0 with NULL arrays: expected OK");

    float l[8] = {0}, w[2], dw[2] = {1, 2}, dl[8];
    int32_t ids[2];
    memset(w, 0x5a, sizeof w);
    memset(ids, 0x5a, sizeof ids);
    memset(dl, 0x5a, sizeof dl);
    a = (moefuse_route_args){.num_tokens = 0, .num_experts = 8, .top_k = 2, .logits = l,
                             .ids = ids, .weights = w};
    CHECK(mf_cpu_route_forward(&a) == MOEFUSE_OK, "T = 0: expected OK");
    b = (moefuse_route_bwd_args){.num_tokens = 0, .num_experts = 8, .top_k = 2,
                                 .logits = l, .ids = ids, .dweights = dw, .dlogits = dl};
    CHECK(mf_cpu_route_backward(&b) == MOEFUSE_OK, "T = 0: expected OK");
    unsigned char pat[32];
    memset(pat, 0x5a, sizeof pat);
    CHECK(memcmp(w, pat, sizeof w) == 0 && memcmp(ids, pat, sizeof ids) == 0 &&
              memcmp(dl, pat, sizeof dl) == 0,
          "T = 0: outputs were written");
}

/* NaN logits are documented to give NaN weights with valid, distinct ids. */
static void test_route_nan_logits(void) {
    const int E = 8, K = 3;
    float l[8] = {0.1f, NAN, 2.0f, -1.0f, NAN, 0.7f, 0.3f, 1.5f};
    int32_t ids[3];
    float w[3];
    moefuse_route_args a = {.num_tokens = 1, .num_experts = E, .top_k = K, .logits = l,
                            .ids = ids, .weights = w};
    CHECK(mf_cpu_route_forward(&a) == MOEFUSE_OK, "route forward failed");
    CHECK(ids[0] == 2 && ids[1] == 7 && ids[2] == 5,
          "NaN ranks last: ids = %d %d %d, expected 2 7 5", ids[0], ids[1], ids[2]);
    CHECK(isnan(w[0]) && isnan(w[1]) && isnan(w[2]), "NaN logit: expected NaN weights");
    /* K = E with NaN: ids must still be a permutation. */
    int32_t all[8];
    float wall[8];
    a = (moefuse_route_args){.num_tokens = 1, .num_experts = E, .top_k = E, .logits = l,
                             .ids = all, .weights = wall};
    CHECK(mf_cpu_route_forward(&a) == MOEFUSE_OK, "route forward failed");
    int seen = 0;
    for (int k = 0; k < E; k++)
        if (all[k] >= 0 && all[k] < E) seen |= 1 << all[k];
    CHECK(seen == 0xff && all[6] == 1 && all[7] == 4,
          "K = E with NaN: expected a permutation ending 1 4, got ... %d %d", all[6], all[7]);
}

/* ---- routing: validation ------------------------------------------------------- */

#define POISON 0x7b
static int untouched(const void *p, size_t bytes) {
    const unsigned char *c = p;
    for (size_t i = 0; i < bytes; i++)
        if (c[i] != POISON) return 0;
    return 1;
}

static void expect_fwd(moefuse_route_args a, moefuse_status want, const char *field,
                       const char *what) {
    int32_t ids[4 * 8];
    float w[4 * 8];
    memset(ids, POISON, sizeof ids);
    memset(w, POISON, sizeof w);
    if (a.ids) a.ids = ids;
    if (a.weights) a.weights = w;
    mf_clear_error();
    moefuse_status st = mf_cpu_route_forward(&a);
    CHECK(st == want, "forward, %s: status %d, expected %d", what, st, want);
    if (want != MOEFUSE_OK)
        CHECK(untouched(ids, sizeof ids) && untouched(w, sizeof w),
              "forward, %s: output written", what);
    CHECK(strstr(moefuse_last_error(), field) != NULL,
          "forward, %s: message \"%s\" does not name %s", what, moefuse_last_error(), field);
}

static void expect_bwd(moefuse_route_bwd_args b, moefuse_status want, const char *field,
                       const char *what) {
    float dl[4 * 8];
    memset(dl, POISON, sizeof dl);
    if (b.dlogits) b.dlogits = dl;
    mf_clear_error();
    moefuse_status st = mf_cpu_route_backward(&b);
    CHECK(st == want, "backward, %s: status %d, expected %d", what, st, want);
    if (want != MOEFUSE_OK) CHECK(untouched(dl, sizeof dl), "backward, %s: output written", what);
    CHECK(strstr(moefuse_last_error(), field) != NULL,
          "backward, %s: message \"%s\" does not name %s", what, moefuse_last_error(), field);
}

static void test_route_validation(void) {
    enum { T = 4, E = 8, K = 2 };
    static float logits[T * E];
    for (int i = 0; i < T * E; i++) logits[i] = (float)th_normal();
    int32_t dummy_ids[T * K];
    float dummy_w[T * K];
    const moefuse_route_args ok = {.num_tokens = T, .num_experts = E, .top_k = K,
                                   .logits = logits, .ids = dummy_ids, .weights = dummy_w};
    moefuse_route_args a;

    mf_clear_error();
    CHECK(mf_cpu_route_forward(NULL) == MOEFUSE_ERR_NULL_POINTER, "forward(NULL)");
    CHECK(strstr(moefuse_last_error(), "args") != NULL, "forward(NULL): no message");
    a = ok; a.num_tokens = -1; expect_fwd(a, MOEFUSE_ERR_SHAPE, "num_tokens", "T = -1");
    a = ok; a.num_experts = 0; expect_fwd(a, MOEFUSE_ERR_SHAPE, "num_experts", "E = 0");
    a = ok; a.top_k = 0; expect_fwd(a, MOEFUSE_ERR_SHAPE, "top_k", "K = 0");
    a = ok; a.top_k = E + 1; expect_fwd(a, MOEFUSE_ERR_SHAPE, "top_k", "K = E + 1");
    a = ok; a.logits = NULL; expect_fwd(a, MOEFUSE_ERR_NULL_POINTER, "logits", "logits NULL");
    a = ok; a.ids = NULL; expect_fwd(a, MOEFUSE_ERR_NULL_POINTER, "ids", "ids NULL");
    a = ok; a.weights = NULL; expect_fwd(a, MOEFUSE_ERR_NULL_POINTER, "weights", "weights NULL");
    a = ok; expect_fwd(a, MOEFUSE_OK, "", "valid args");  /* the harness itself is sound */
    CHECK(moefuse_last_error()[0] == '\0', "success left a message");

    /* Ids from a real forward; the bad ones go in the last token, so a backward that
     * wrote tokens before checking all of them would be caught. */
    int32_t ids[T * K];
    float w[T * K], dw[T * K];
    a = ok; a.ids = ids; a.weights = w;
    CHECK(mf_cpu_route_forward(&a) == MOEFUSE_OK, "route forward failed");
    for (int i = 0; i < T * K; i++) dw[i] = (float)th_normal();
    float dl_dummy[T * E];
    const moefuse_route_bwd_args bok = {.num_tokens = T, .num_experts = E, .top_k = K,
                                        .logits = logits, .ids = ids, .dweights = dw,
                                        .dlogits = dl_dummy};
    moefuse_route_bwd_args b;
    mf_clear_error();
    CHECK(mf_cpu_route_backward(NULL) == MOEFUSE_ERR_NULL_POINTER, "backward(NULL)");
    b = bok; b.num_tokens = -3; expect_bwd(b, MOEFUSE_ERR_SHAPE, "num_tokens", "T = -3");
    b = bok; b.num_experts = -1; expect_bwd(b, MOEFUSE_ERR_SHAPE, "num_experts", "E = -1");
    b = bok; b.top_k = 0; expect_bwd(b, MOEFUSE_ERR_SHAPE, "top_k", "K = 0");
    b = bok; b.top_k = E + 1; expect_bwd(b, MOEFUSE_ERR_SHAPE, "top_k", "K = E + 1");
    b = bok; b.logits = NULL; expect_bwd(b, MOEFUSE_ERR_NULL_POINTER, "logits", "logits NULL");
    b = bok; b.ids = NULL; expect_bwd(b, MOEFUSE_ERR_NULL_POINTER, "ids", "ids NULL");
    b = bok; b.dweights = NULL; expect_bwd(b, MOEFUSE_ERR_NULL_POINTER, "dweights", "dweights NULL");
    b = bok; b.dlogits = NULL; expect_bwd(b, MOEFUSE_ERR_NULL_POINTER, "dlogits", "dlogits NULL");

    int32_t bad[T * K];
    b = bok; b.ids = bad;
    memcpy(bad, ids, sizeof bad); bad[(T - 1) * K + 1] = E;
    expect_bwd(b, MOEFUSE_ERR_EXPERT_ID, "ids[3][1]", "id = E");
    memcpy(bad, ids, sizeof bad); bad[(T - 1) * K + 0] = -1;
    expect_bwd(b, MOEFUSE_ERR_EXPERT_ID, "ids[3][0]", "id = -1");
    memcpy(bad, ids, sizeof bad); bad[(T - 1) * K + 1] = bad[(T - 1) * K];
    expect_bwd(b, MOEFUSE_ERR_DUPLICATE_EXPERT, "ids[3][1]", "duplicate id");
    b = bok; expect_bwd(b, MOEFUSE_OK, "", "valid args");
    CHECK(moefuse_last_error()[0] == '\0', "success left a message");
}

int main(void) {
    th_seed_from_env_or_clock();
    th_run("fp32 routing helper vs reference, E=128 K=8", test_route_fp32_vs_reference);
    th_run("fp32 routing helper vs reference, K=E", test_route_k_equals_e);
    th_run("routing ties pick the lower id", test_route_ties);
    th_run("routing with T=0", test_route_zero_tokens);
    th_run("routing with NaN logits", test_route_nan_logits);
    th_run("routing argument validation", test_route_validation);
    return th_finish();
}
