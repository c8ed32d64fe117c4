/* The fp64 reference: the truth for every test.
 *
 * The loops follow the math of include/moefuse.h directly; the only liberties are
 * the ones that make T = 128 at qwen3-30b-a3b size run in seconds rather than minutes:
 *
 *   - work is grouped by expert, and for each weight row the loop runs over all of
 *     that expert's slots, so every weight row is read from memory once per pass
 *     (instead of once per slot) and stays in L1 while it is used;
 *   - products with W13 and W2 are dot products over contiguous rows, products with
 *     their transposes are axpy loops over contiguous rows (both vectorize);
 *   - experts run in parallel (OpenMP), tokens run in parallel for the reductions.
 *
 * Determinism: every output element is summed by one thread, in an order fixed by
 * the data (slot order within an expert, k order within a token, the fixed tree in
 * dot()), never by the thread count or schedule. Results are bitwise identical for
 * any OMP_NUM_THREADS.
 *
 * The functions return void (see reference.h). If scratch memory cannot be
 * allocated they fill their outputs with NaN, which fails every comparison, rather
 * than exit. Preconditions (the reference trusts its caller, the tests): ids in
 * [-1, E) with no expert twice in a token; pointers valid for their shapes. */
#include "reference.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- small vector helpers ------------------------------------------------------ */

/* Dot products of a with b0 and with b1, each with 8 partial sums combined in a fixed
 * tree: a single accumulator cannot be vectorized without reassociation (which the
 * compiler may not do on its own), and a fixed split keeps the result independent of
 * compiler and machine. Two at a time so each load of a (a weight row) serves two
 * slots; dot() is the same for one vector, bitwise. */
static void dot2(const double *restrict a, const double *restrict b0,
                 const double *restrict b1, int n, double *out0, double *out1) {
    double acc0[8] = {0, 0, 0, 0, 0, 0, 0, 0}, acc1[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int q = 0; q < 8; q++) {
            acc0[q] += a[i + q] * b0[i + q];
            acc1[q] += a[i + q] * b1[i + q];
        }
    for (; i < n; i++) {
        acc0[i & 7] += a[i] * b0[i];
        acc1[i & 7] += a[i] * b1[i];
    }
    *out0 = ((acc0[0] + acc0[4]) + (acc0[2] + acc0[6])) +
            ((acc0[1] + acc0[5]) + (acc0[3] + acc0[7]));
    *out1 = ((acc1[0] + acc1[4]) + (acc1[2] + acc1[6])) +
            ((acc1[1] + acc1[5]) + (acc1[3] + acc1[7]));
}

static double dot(const double *restrict a, const double *restrict b, int n) {
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int q = 0; q < 8; q++) acc[q] += a[i + q] * b[i + q];
    for (; i < n; i++) acc[i & 7] += a[i] * b[i];
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

/* y += c * x. Element-wise, so vectorizing changes no result; the pragma is needed
 * because -O2's cost model will not vectorize a loop with an unknown trip count. */
static void axpy(double *restrict y, double c, const double *restrict x, int n) {
#pragma omp simd
    for (int i = 0; i < n; i++) y[i] += c * x[i];
}

static double sigmoid(double g) { return 1.0 / (1.0 + exp(-g)); }

static void fill_nan(double *a, int64_t n) {
    for (int64_t i = 0; i < n; i++) a[i] = NAN;
}

/* ---- slots grouped by expert (reference.h) --------------------------------------- */

void mf_ref_groups_free(mf_ref_groups *g) {
    free(g->offsets);
    free(g->slots);
    free(g->row_of);
}

int mf_ref_groups_build(const mf_ref_shape *s, const int32_t *ids /* [T, K] */,
                        mf_ref_groups *g) {
    const int E = s->num_experts;
    const int64_t n_slots = (int64_t)s->num_tokens * s->top_k;
    /* +1: malloc(0) may return NULL, which would read as a failure. */
    g->offsets = calloc((size_t)E + 1, sizeof(int64_t));
    g->slots = malloc(((size_t)n_slots + 1) * sizeof(int64_t));
    g->row_of = malloc(((size_t)n_slots + 1) * sizeof(int64_t));
    if (!g->offsets || !g->slots || !g->row_of) {
        mf_ref_groups_free(g);
        return 0;
    }
    for (int64_t i = 0; i < n_slots; i++)
        if (ids[i] >= 0) g->offsets[ids[i] + 1]++;
    for (int e = 0; e < E; e++) g->offsets[e + 1] += g->offsets[e];
    g->num_rows = g->offsets[E];
    /* Counting sort; filling in slot order keeps each expert's rows in slot order. */
    int64_t *next = malloc(((size_t)E + 1) * sizeof(int64_t));
    if (!next) {
        mf_ref_groups_free(g);
        return 0;
    }
    memcpy(next, g->offsets, (size_t)E * sizeof(int64_t));
    for (int64_t i = 0; i < n_slots; i++) {
        if (ids[i] >= 0) {
            int64_t r = next[ids[i]]++;
            g->slots[r] = i;
            g->row_of[i] = r;
        } else {
            g->row_of[i] = -1;
        }
    }
    free(next);
    return 1;
}

/* Row j (0 <= j < 2I) of expert e's W13 (or dW13): packed (up NULL, [E, 2I, H]) or in
 * two halves (w13 the gate half, up the up half, [E, I, H] each). */
static double *w13_row(const mf_ref_shape *s, const double *w13, const double *up, int e,
                       int j) {
    const int64_t H = s->hidden, I = s->intermediate;
    const double *row = !up ? w13 + ((int64_t)e * 2 * I + j) * H
                            : j < I ? w13 + ((int64_t)e * I + j) * H
                                    : up + ((int64_t)e * I + j - I) * H;
    return (double *)row;
}

/* gu [rows, 2I] = W13_e x_t for expert e's rows, then a [rows, I] = silu(g) * u. */
static void expert_gate_up(const mf_ref_shape *s, const mf_ref_groups *g, int e,
                           const double *x,    /* [T, H] */
                           const double *w13,  /* [E, 2I, H], or the gate half [E, I, H] */
                           const double *w13_up, /* NULL, or the up half [E, I, H] */
                           double *gu,         /* [num_rows, 2I] */
                           double *a) {        /* [num_rows, I] */
    const int H = s->hidden, I = s->intermediate, K = s->top_k;
    const int64_t r0 = g->offsets[e], r1 = g->offsets[e + 1];
    for (int j = 0; j < 2 * I; j++) {
        const double *w = w13_row(s, w13, w13_up, e, j);
        int64_t r = r0;
        for (; r + 2 <= r1; r += 2)
            dot2(w, x + (g->slots[r] / K) * H, x + (g->slots[r + 1] / K) * H, H,
                 &gu[r * 2 * I + j], &gu[(r + 1) * 2 * I + j]);
        if (r < r1) gu[r * 2 * I + j] = dot(w, x + (g->slots[r] / K) * H, H);
    }
    for (int64_t r = r0; r < r1; r++)
        for (int i = 0; i < I; i++) {
            double gate = gu[r * 2 * I + i], up = gu[r * 2 * I + I + i];
            a[r * I + i] = gate * sigmoid(gate) * up;
        }
}

/* ---- experts: forward ---------------------------------------------------------- */

void mf_ref_forward(const mf_ref_shape *s, const double *x, const int32_t *ids,
                    const double *p, const double *w13, const double *w2, double *y) {
    mf_ref_forward_halves(s, x, ids, p, w13, NULL, w2, y);
}

void mf_ref_forward_halves(const mf_ref_shape *s, const double *x, const int32_t *ids,
                           const double *p, const double *w13, const double *w13_up,
                           const double *w2, double *y) {
    const int T = s->num_tokens, H = s->hidden, I = s->intermediate;
    const int E = s->num_experts, K = s->top_k;
    mf_ref_groups g;
    if (!mf_ref_groups_build(s, ids, &g)) {
        fill_nan(y, (int64_t)T * H);
        return;
    }
    const int64_t n = g.num_rows + 1;
    double *gu = malloc((size_t)n * 2 * I * sizeof(double));  /* [rows, 2I] */
    double *a = malloc((size_t)n * I * sizeof(double));       /* [rows, I] */
    double *o = malloc((size_t)n * H * sizeof(double));       /* [rows, H] W2_e a */
    if (!gu || !a || !o) {
        fill_nan(y, (int64_t)T * H);
        goto done;
    }

#pragma omp parallel for schedule(dynamic, 1)
    for (int e = 0; e < E; e++) {
        const int64_t r0 = g.offsets[e], r1 = g.offsets[e + 1];
        if (r0 == r1) continue;
        expert_gate_up(s, &g, e, x, w13, w13_up, gu, a);
        for (int h = 0; h < H; h++) {
            const double *w = w2 + ((int64_t)e * H + h) * I;
            int64_t r = r0;
            for (; r + 2 <= r1; r += 2)
                dot2(w, a + r * I, a + (r + 1) * I, I, &o[r * H + h], &o[(r + 1) * H + h]);
            if (r < r1) o[r * H + h] = dot(w, a + r * I, I);
        }
    }

    /* y_t = sum_k p o, in k order. */
#pragma omp parallel for schedule(static)
    for (int t = 0; t < T; t++) {
        double *yt = y + (int64_t)t * H;
        for (int h = 0; h < H; h++) yt[h] = 0.0;
        for (int k = 0; k < K; k++) {
            int64_t r = g.row_of[(int64_t)t * K + k];
            if (r >= 0) axpy(yt, p[(int64_t)t * K + k], o + r * H, H);
        }
    }

done:
    free(gu);
    free(a);
    free(o);
    mf_ref_groups_free(&g);
}

/* ---- experts: backward --------------------------------------------------------- */

void mf_ref_backward(const mf_ref_shape *s, const double *x, const int32_t *ids,
                     const double *p, const double *w13, const double *w2,
                     const double *dy, double *dx, double *dp, double *dw13,
                     double *dw2) {
    mf_ref_backward_halves(s, x, ids, p, w13, NULL, w2, dy, dx, dp, dw13, NULL, dw2);
}

/* dW13 of every expert (both halves when dw13_up is set) to NaN. */
static void dw13_nan(const mf_ref_shape *s, double *dw13, double *dw13_up) {
    const int64_t n = (int64_t)s->num_experts * s->intermediate * s->hidden;
    fill_nan(dw13, dw13_up ? n : 2 * n);
    if (dw13_up) fill_nan(dw13_up, n);
}

void mf_ref_backward_halves(const mf_ref_shape *s, const double *x, const int32_t *ids,
                            const double *p, const double *w13, const double *w13_up,
                            const double *w2, const double *dy, double *dx, double *dp,
                            double *dw13, double *dw13_up, double *dw2) {
    const int T = s->num_tokens, H = s->hidden, I = s->intermediate;
    const int E = s->num_experts, K = s->top_k;
    mf_ref_groups g;
    if (!mf_ref_groups_build(s, ids, &g)) {
        fill_nan(dx, (int64_t)T * H);
        fill_nan(dp, (int64_t)T * K);
        dw13_nan(s, dw13, dw13_up);
        fill_nan(dw2, (int64_t)E * H * I);
        return;
    }
    const int64_t n = g.num_rows + 1;
    double *gu = malloc((size_t)n * 2 * I * sizeof(double));  /* [rows, 2I], then [dg; du] */
    double *a = malloc((size_t)n * I * sizeof(double));       /* [rows, I] */
    double *dap = malloc((size_t)n * I * sizeof(double));     /* [rows, I] da' = W2^T dy */
    double *dxr = malloc((size_t)n * H * sizeof(double));     /* [rows, H] W13^T [dg; du] */
    if (!gu || !a || !dap || !dxr) {
        fill_nan(dx, (int64_t)T * H);
        fill_nan(dp, (int64_t)T * K);
        dw13_nan(s, dw13, dw13_up);
        fill_nan(dw2, (int64_t)E * H * I);
        goto done;
    }

    /* One thread owns expert e: its dW rows are summed in slot order by that thread
     * alone, and dp[slot] / the rows of gu, a, dap, dxr belong to e's slots only. */
#pragma omp parallel for schedule(dynamic, 1)
    for (int e = 0; e < E; e++) {
        const int64_t r0 = g.offsets[e], r1 = g.offsets[e + 1];
        double *dw2_e = dw2 + (int64_t)e * H * I;
        for (int j = 0; j < 2 * I; j++)
            memset(w13_row(s, dw13, dw13_up, e, j), 0, (size_t)H * sizeof(double));
        memset(dw2_e, 0, (size_t)H * I * sizeof(double));
        if (r0 == r1) continue;

        expert_gate_up(s, &g, e, x, w13, w13_up, gu, a);

        /* da'_r = W2_e^T dy_t (axpy over W2's rows) and dW2_e[h, :] += p dy[t,h] a_r,
         * sharing one read of each W2 row. */
        memset(dap + r0 * I, 0, (size_t)(r1 - r0) * I * sizeof(double));
        for (int h = 0; h < H; h++) {
            const double *w = w2 + ((int64_t)e * H + h) * I;
            double *dw = dw2_e + (int64_t)h * I;
            for (int64_t r = r0; r < r1; r++) {
                int64_t slot = g.slots[r];
                double c = dy[(slot / K) * H + h];
                axpy(dap + r * I, c, w, I);
                axpy(dw, p[slot] * c, a + r * I, I);
            }
        }

        /* dp = <da', a>; the SwiGLU backward overwrites gu with [dg; du]. */
        for (int64_t r = r0; r < r1; r++) {
            int64_t slot = g.slots[r];
            dp[slot] = dot(dap + r * I, a + r * I, I);
            for (int i = 0; i < I; i++) {
                double gate = gu[r * 2 * I + i], up = gu[r * 2 * I + I + i];
                double sg = sigmoid(gate);
                double da = p[slot] * dap[r * I + i];
                gu[r * 2 * I + i] = da * up * sg * (1.0 + gate * (1.0 - sg));
                gu[r * 2 * I + I + i] = da * gate * sg;
            }
        }

        /* dx_r = W13_e^T [dg; du] (axpy over W13's rows) and dW13_e[j, :] += dgu[j] x_t,
         * sharing one read of each W13 row. */
        memset(dxr + r0 * H, 0, (size_t)(r1 - r0) * H * sizeof(double));
        for (int j = 0; j < 2 * I; j++) {
            const double *w = w13_row(s, w13, w13_up, e, j);
            double *dw = w13_row(s, dw13, dw13_up, e, j);
            for (int64_t r = r0; r < r1; r++) {
                double c = gu[r * 2 * I + j];
                axpy(dxr + r * H, c, w, H);
                axpy(dw, c, x + (g.slots[r] / K) * H, H);
            }
        }
    }

    /* dx_t = sum_k dx_r in k order; dropped slots get dp = 0. */
#pragma omp parallel for schedule(static)
    for (int t = 0; t < T; t++) {
        double *dxt = dx + (int64_t)t * H;
        for (int h = 0; h < H; h++) dxt[h] = 0.0;
        for (int k = 0; k < K; k++) {
            int64_t r = g.row_of[(int64_t)t * K + k];
            if (r >= 0)
                axpy(dxt, 1.0, dxr + r * H, H);
            else
                dp[(int64_t)t * K + k] = 0.0;
        }
    }

done:
    free(gu);
    free(a);
    free(dap);
    free(dxr);
    mf_ref_groups_free(&g);
}

/* ---- Qwen3 routing ------------------------------------------------------------- */

/* The selection order: higher logit first, equal logits by lower id, NaN after every
 * number (so the order is total and the K ids are distinct even for NaN input).
 * Softmax is strictly increasing, so selecting on logits selects the top-K
 * probabilities, without letting rounding in exp() create or break ties. */
static int ref_precedes(const double *l, int a, int b) {
    int na = isnan(l[a]), nb = isnan(l[b]);
    if (na != nb) return nb;
    if (!na && l[a] != l[b]) return l[a] > l[b];
    return a < b;
}

/* ids [K] of the top-K of l [E] in selection order: pick k is the first expert, in
 * that order, after pick k-1. O(K E) with no scratch. */
static void ref_topk(const double *l, int E, int K, int32_t *ids) {
    for (int k = 0; k < K; k++) {
        int best = -1;
        for (int j = 0; j < E; j++) {
            if (k > 0 && !ref_precedes(l, ids[k - 1], j)) continue;
            if (best < 0 || ref_precedes(l, j, best)) best = j;
        }
        ids[k] = best;
    }
}

/* The pieces of weight k = (exp(l[ids[k]] - m) / z) / sum, as Qwen3 computes it:
 * softmax over all E, then renormalized over the K selected. */
typedef struct ref_softmax {
    double m, z, sum;
} ref_softmax;

static ref_softmax ref_topk_softmax(const double *l, int E, int K, const int32_t *ids) {
    ref_softmax r = {-INFINITY, 0.0, 0.0};
    for (int j = 0; j < E; j++)
        if (l[j] > r.m) r.m = l[j];
    for (int j = 0; j < E; j++) r.z += exp(l[j] - r.m);
    for (int k = 0; k < K; k++) r.sum += exp(l[ids[k]] - r.m) / r.z;
    return r;
}

static double ref_weight(const double *l, const ref_softmax *r, int32_t id) {
    return (exp(l[id] - r->m) / r->z) / r->sum;
}

void mf_ref_route_forward(int num_tokens, int num_experts, int top_k, const double *logits,
                          int32_t *ids, double *weights) {
#pragma omp parallel for schedule(static)
    for (int t = 0; t < num_tokens; t++) {
        const double *l = logits + (int64_t)t * num_experts;
        int32_t *id = ids + (int64_t)t * top_k;
        ref_topk(l, num_experts, top_k, id);
        ref_softmax r = ref_topk_softmax(l, num_experts, top_k, id);
        for (int k = 0; k < top_k; k++) weights[(int64_t)t * top_k + k] = ref_weight(l, &r, id[k]);
    }
}

/* The renormalized weights are a softmax over the selected logits only (the full
 * softmax's denominator cancels): w_k = exp(l_{i_k}) / sum_m exp(l_{i_m}), so
 *     d w_k / d l_{i_n} = w_k (delta_kn - w_n)
 *     d l_{i_n} = sum_k dw_k w_k (delta_kn - w_n) = w_n (dw_n - sum_k w_k dw_k).
 * Unselected logits move no weight (the selection is locally constant): d l_j = 0. */
void mf_ref_route_backward(int num_tokens, int num_experts, int top_k, const double *logits,
                           const int32_t *ids, const double *dweights, double *dlogits) {
#pragma omp parallel for schedule(static)
    for (int t = 0; t < num_tokens; t++) {
        const double *l = logits + (int64_t)t * num_experts;
        const int32_t *id = ids + (int64_t)t * top_k;
        const double *dw = dweights + (int64_t)t * top_k;
        double *dl = dlogits + (int64_t)t * num_experts;
        ref_softmax r = ref_topk_softmax(l, num_experts, top_k, id);
        double s = 0.0;
        for (int k = 0; k < top_k; k++) s += ref_weight(l, &r, id[k]) * dw[k];
        for (int j = 0; j < num_experts; j++) dl[j] = 0.0;
        for (int k = 0; k < top_k; k++) {
            double w = ref_weight(l, &r, id[k]);
            dl[id[k]] = w * (dw[k] - s);
        }
    }
}
