#include "fixture.h"

#include "reference.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const shape QWEN3_30B = {"qwen3-30b-a3b", 2048, 768, 128, 8};
const shape QWEN3_235B = {"qwen3-235b-a22b", 4096, 1536, 128, 8};
/* The 235b H, I, K with 16 experts: the full E = 128 gradient buffers alone are
 * 9.6 GB of fp32, more than a small test box holds; H, I and K set the numerics. */
const shape QWEN3_235B_E16 = {"qwen3-235b-a22b H/I/K, E=16", 4096, 1536, 16, 8};
/* The 30b H, I, K with 16 experts, for the cases that hold two sets of outputs. */
const shape QWEN3_30B_E16 = {"qwen3-30b-a3b H/I/K, E=16", 2048, 768, 16, 8};
/* Fast shapes for edge cases; ODD is off every block and chunk multiple. */
const shape SMALL = {"small", 256, 96, 32, 4};
const shape ODD = {"odd", 200, 72, 9, 3};

/* ---- bf16 without the library (the library's conversions are under test) ---------- */

double bf16_value(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* v * 2^-shift, exact: lowers the exponent field. N(0, 1) draws are never near the
 * bottom of the exponent range, so no subnormal case arises. */
static uint16_t bf16_scaled(uint16_t v, int shift) {
    return v == 0 || v == 0x8000 ? v : (uint16_t)(v - (shift << 7));
}

/* ---- weights from a per-run pool ---------------------------------------------------
 * th_fill_bf16_normal costs ~40 ns a value and one qwen3-235b expert holds 19M, so
 * each expert's matrix is a window, at a random offset, of a pool of fresh N(0, 1)
 * bf16 values drawn once per run. */
static uint16_t *pool;   /* [pool_n] */
static int64_t pool_n;

static const uint16_t *pool_window(int64_t n) {
    if (pool_n < 2 * n) {
        free(pool);
        pool_n = 2 * n > ((int64_t)1 << 20) ? 2 * n : ((int64_t)1 << 20);
        pool = malloc(sizeof(uint16_t) * (size_t)pool_n);
        th_fill_bf16_normal(pool, NULL, pool_n, 1.0);
    }
    return pool + (int64_t)(th_uniform() * (double)(pool_n - n));
}

void problem_pool_free(void) {
    free(pool);
    pool = NULL;
    pool_n = 0;
}

/* Power of two nearest 1/sqrt(fan_in): keeps g, u and o near unit scale while the
 * scaled values stay exact bf16. */
static int fan_in_shift(int fan_in) { return (int)lround(0.5 * log2((double)fan_in)); }

static void route(problem *pb, routing r) {
    int E = pb->s.E, K = pb->s.K;
    int pool_e = r == ROUTE_FEW ? (K + 2 < E ? K + 2 : E) : E;
    int32_t *perm = malloc(sizeof(int32_t) * (size_t)E);  /* [E] */
    for (int e = 0; e < E; e++) perm[e] = e;
    for (int e = E - 1; e > 0; e--) { /* the FEW pool: a random subset */
        int j = th_rand_int(0, e);
        int32_t tmp = perm[e]; perm[e] = perm[j]; perm[j] = tmp;
    }
    int32_t *choice = malloc(sizeof(int32_t) * (size_t)pool_e);  /* [pool_e] */
    double *zipf_cdf = malloc(sizeof(double) * (size_t)E);       /* [E] */
    for (int e = 0; e < E; e++) zipf_cdf[e] = (e ? zipf_cdf[e - 1] : 0.0) + 1.0 / (e + 1);
    for (int t = 0; t < pb->T; t++) {
        int32_t *row = pb->ids + (int64_t)t * K;  /* [K] */
        memcpy(choice, perm, sizeof(int32_t) * (size_t)pool_e);
        for (int k = 0; k < K; k++) {
            if (r == ROUTE_ZIPF) {   /* rejection of repeats: K distinct */
                int e, dup;
                do {
                    const double u = th_uniform() * zipf_cdf[E - 1];
                    int j = 0;
                    while (j < E - 1 && zipf_cdf[j] < u) j++;
                    e = perm[j];
                    dup = 0;
                    for (int q = 0; q < k; q++) dup |= row[q] == e;
                } while (dup);
                row[k] = e;
                continue;
            }
            /* partial Fisher-Yates: K distinct experts */
            int j = th_rand_int(k, pool_e - 1);
            int32_t tmp = choice[k]; choice[k] = choice[j]; choice[j] = tmp;
            row[k] = choice[k];
        }
        if (r == ROUTE_ONE_EXPERT) {
            int has = -1;
            for (int k = 0; k < K; k++) if (row[k] == 0) has = k;
            int k0 = th_rand_int(0, K - 1);
            if (has >= 0) { row[has] = row[k0]; }
            row[k0] = 0;
        }
        if (r == ROUTE_DROPPED)
            for (int k = 0; k < K; k++)
                if (t == 0 || th_uniform() < 0.3) row[k] = -1;
        /* p: a softmax of random logits over the K slots, positive, sums to 1. */
        float *p = pb->p + (int64_t)t * K;
        double z[64], sum = 0;
        for (int k = 0; k < K; k++) { z[k] = exp(th_normal()); sum += z[k]; }
        for (int k = 0; k < K; k++) p[k] = (float)(z[k] / sum);
    }
    free(zipf_cdf);
    free(choice);
    free(perm);
}

problem problem_make(shape s, int T, int64_t stride, routing r) {
    problem pb = {.s = s, .T = T, .stride = stride};
    int64_t H = s.H, I = s.I, E = s.E, K = s.K;
    pb.x = malloc(sizeof(uint16_t) * (size_t)(T * stride + 1));
    pb.dy = malloc(sizeof(uint16_t) * (size_t)(T * stride + 1));
    pb.ids = malloc(sizeof(int32_t) * (size_t)(T * K + 1));
    pb.p = malloc(sizeof(float) * (size_t)(T * K + 1));
    pb.w13 = malloc(sizeof(uint16_t) * (size_t)(E * 2 * I * H));
    pb.w2 = malloc(sizeof(uint16_t) * (size_t)(E * H * I));
    pb.counts = calloc((size_t)E, sizeof(int32_t));
    for (int t = 0; t < T; t++) { /* x, dy ~ N(0, 1); the stride gap is NaN */
        memset(pb.x + t * stride, 0xff, sizeof(uint16_t) * (size_t)stride);
        memset(pb.dy + t * stride, 0xff, sizeof(uint16_t) * (size_t)stride);
        th_fill_bf16_normal(pb.x + t * stride, NULL, H, 1.0);
        th_fill_bf16_normal(pb.dy + t * stride, NULL, H, 1.0);
    }
    route(&pb, r);
    for (int64_t i = 0; i < T * K; i++)
        if (pb.ids[i] >= 0) pb.counts[pb.ids[i]]++;
    int sh13 = fan_in_shift((int)H), sh2 = fan_in_shift((int)I);
    for (int64_t e = 0; e < E; e++) {
        uint16_t *w13 = pb.w13 + e * 2 * I * H, *w2 = pb.w2 + e * H * I;
        if (pb.counts[e] == 0) { /* never read: NaN shows it if it were */
            memset(w13, 0xff, sizeof(uint16_t) * (size_t)(2 * I * H));
            memset(w2, 0xff, sizeof(uint16_t) * (size_t)(H * I));
            continue;
        }
        const uint16_t *src = pool_window(2 * I * H);
        for (int64_t i = 0; i < 2 * I * H; i++) w13[i] = bf16_scaled(src[i], sh13);
        src = pool_window(H * I);
        for (int64_t i = 0; i < H * I; i++) w2[i] = bf16_scaled(src[i], sh2);
    }
    return pb;
}

void problem_free(problem *pb) {
    free(pb->x); free(pb->dy); free(pb->ids); free(pb->p);
    free(pb->w13); free(pb->w2); free(pb->counts);
}

outputs outputs_make(const problem *pb) {
    outputs o;
    int64_t H = pb->s.H, I = pb->s.I, E = pb->s.E;
    o.n_y = pb->T * pb->stride;
    o.n_dp = (int64_t)pb->T * pb->s.K;
    o.n_dw13 = E * 2 * I * H;
    o.n_dw2 = E * H * I;
    o.y = malloc(sizeof(uint16_t) * (size_t)(o.n_y + 1));
    o.dx = malloc(sizeof(uint16_t) * (size_t)(o.n_y + 1));
    o.dp = malloc(sizeof(float) * (size_t)(o.n_dp + 1));
    o.dw13 = malloc(sizeof(float) * (size_t)o.n_dw13);
    o.dw2 = malloc(sizeof(float) * (size_t)o.n_dw2);
    o.counts = malloc(sizeof(int32_t) * (size_t)E);
    return o;
}

/* Every output byte 0xff: bf16 and fp32 NaN, expert count -1; the backend writes
 * none of these for finite inputs, so a survivor is an element never written. */
void outputs_poison(outputs *o, int32_t num_experts) {
    memset(o->y, 0xff, sizeof(uint16_t) * (size_t)o->n_y);
    memset(o->dx, 0xff, sizeof(uint16_t) * (size_t)o->n_y);
    memset(o->dp, 0xff, sizeof(float) * (size_t)o->n_dp);
    memset(o->dw13, 0xff, sizeof(float) * (size_t)o->n_dw13);
    memset(o->dw2, 0xff, sizeof(float) * (size_t)o->n_dw2);
    memset(o->counts, 0xff, sizeof(int32_t) * (size_t)num_experts);
}

void outputs_free(outputs *o) {
    free(o->y); free(o->dx); free(o->dp); free(o->dw13); free(o->dw2); free(o->counts);
}

int outputs_equal(const outputs *a, const outputs *b) {
    return !memcmp(a->y, b->y, sizeof(uint16_t) * (size_t)a->n_y) &&
           !memcmp(a->dx, b->dx, sizeof(uint16_t) * (size_t)a->n_y) &&
           !memcmp(a->dp, b->dp, sizeof(float) * (size_t)a->n_dp) &&
           !memcmp(a->dw13, b->dw13, sizeof(float) * (size_t)a->n_dw13) &&
           !memcmp(a->dw2, b->dw2, sizeof(float) * (size_t)a->n_dw2);
}

int64_t count_poison32(const float *a, int64_t n) {
    int64_t c = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &a[i], 4);
        c += u == 0xffffffffu;
    }
    return c;
}

/* Every element of y and dx inside [0, H) written, the stride gap untouched; every
 * dp, dW and expert count written. */
void check_written(const problem *pb, const outputs *o) {
    int64_t H = pb->s.H, y_unwritten = 0, dx_unwritten = 0, gap_written = 0;
    for (int t = 0; t < pb->T; t++)
        for (int64_t h = 0; h < pb->stride; h++) {
            uint16_t y = o->y[t * pb->stride + h], dx = o->dx[t * pb->stride + h];
            if (h < H) {
                y_unwritten += y == 0xffff;
                dx_unwritten += dx == 0xffff;
            } else {
                gap_written += (y != 0xffff) + (dx != 0xffff);
            }
        }
    CHECK(y_unwritten == 0, "%lld elements of y not written (or NaN)", (long long)y_unwritten);
    CHECK(dx_unwritten == 0, "%lld elements of dx not written (or NaN)", (long long)dx_unwritten);
    CHECK(gap_written == 0, "%lld elements written in the row-stride gap of y/dx",
          (long long)gap_written);
    int64_t dp = count_poison32(o->dp, o->n_dp);
    int64_t d13 = count_poison32(o->dw13, o->n_dw13), d2 = count_poison32(o->dw2, o->n_dw2);
    CHECK(dp == 0, "%lld of dp not written", (long long)dp);
    CHECK(d13 == 0, "%lld of dw13 not written", (long long)d13);
    CHECK(d2 == 0, "%lld of dw2 not written", (long long)d2);
    for (int e = 0; e < pb->s.E; e++)
        CHECK(o->counts[e] == pb->counts[e], "expert_counts[%d] = %d: expected %d", e,
              (int)o->counts[e], (int)pb->counts[e]);
}

/* ---- the library ------------------------------------------------------------------- */

moefuse_layer *make_layer(shape s, int max_tokens, moefuse_saved_mode mode, int num_threads) {
    return make_layer_precision(s, max_tokens, mode, num_threads, MOEFUSE_PRECISION_BF16, 0);
}

moefuse_layer *make_layer_precision(shape s, int max_tokens, moefuse_saved_mode mode,
                                    int num_threads, moefuse_precision precision, int pow2) {
    moefuse_config cfg;
    moefuse_config_init(&cfg, s.H, s.I, s.E, s.K, max_tokens);
    cfg.saved_mode = mode;
    cfg.num_threads = num_threads;
    cfg.precision = precision;
    cfg.fp8_pow2_scales = pow2;
    moefuse_layer *layer = NULL;
    moefuse_status st = moefuse_layer_create(&cfg, NULL, &layer);
    CHECK(st == MOEFUSE_OK, "moefuse_layer_create: %s (%s)", moefuse_status_string(st),
          moefuse_last_error());
    return layer;
}

/* A saved buffer for T tokens, 256-byte aligned, filled with junk. */
void *saved_make(const moefuse_layer *layer, int T) {
    size_t bytes = 0;
    moefuse_status st = moefuse_saved_bytes(layer, T, &bytes);
    CHECK(st == MOEFUSE_OK, "moefuse_saved_bytes: %s", moefuse_status_string(st));
    size_t n = (bytes + 255) / 256 * 256;
    void *b = aligned_alloc(256, n ? n : 256);
    memset(b, 0x5a, n ? n : 256);
    return b;
}

/* What the backward is told the saved buffer holds: what saved_make allocated for T. */
size_t saved_size(const moefuse_layer *layer, int T) {
    size_t bytes = 0;
    moefuse_saved_bytes(layer, T, &bytes);
    return bytes;
}

moefuse_status forward(moefuse_layer *layer, const problem *pb, outputs *o,
                              void *saved) {
    moefuse_fwd_args a = {
        .num_tokens = pb->T, .x = pb->x, .x_stride = pb->stride, .ids = pb->ids,
        .weights = pb->p, .w13 = pb->w13, .w2 = pb->w2, .y = o->y, .y_stride = pb->stride,
        .saved = saved, .expert_counts = o->counts, .fp8_weights = pb->fp8,
    };
    return moefuse_forward(layer, &a, NULL);
}

moefuse_status backward(moefuse_layer *layer, const problem *pb, outputs *o,
                               const void *saved, int accumulate) {
    moefuse_bwd_args a = {
        .num_tokens = pb->T, .x = pb->x, .x_stride = pb->stride, .ids = pb->ids,
        .weights = pb->p, .w13 = pb->w13, .w2 = pb->w2, .saved = saved,
        .saved_bytes = saved_size(layer, pb->T), .dy = pb->dy,
        .dy_stride = pb->stride, .dx = o->dx, .dx_stride = pb->stride, .dweights = o->dp,
        .dw13 = o->dw13, .dw2 = o->dw2, .accumulate = accumulate, .fp8_weights = pb->fp8,
    };
    return moefuse_backward(layer, &a, NULL);
}

/* Poisoned outputs, forward, backward (write mode). */
void run_pair(moefuse_layer *layer, const problem *pb, outputs *o) {
    void *saved = saved_make(layer, pb->T);
    outputs_poison(o, pb->s.E);
    CHECK_OK(forward(layer, pb, o, saved));
    CHECK_OK(backward(layer, pb, o, saved, 0));
    free(saved);
}

/* ---- W13 in two halves ---- */

void w13_repack(void *packed, void *gate, void *up, int64_t E, int64_t I, int64_t H,
                size_t elem, int to_halves) {
    const size_t half = (size_t)(I * H) * elem;
    for (int64_t e = 0; e < E; e++) {
        char *pe = (char *)packed + (size_t)e * 2 * half;
        char *ge = (char *)gate + (size_t)e * half, *ue = (char *)up + (size_t)e * half;
        if (to_halves) {
            memcpy(ge, pe, half);
            memcpy(ue, pe + half, half);
        } else {
            memcpy(pe, ge, half);
            memcpy(pe + half, ue, half);
        }
    }
}

void run_pair_halves(moefuse_layer *layer, const problem *pb, outputs *o, wgrad_mode mode,
                     uint16_t *dw13_bf16, uint16_t *dw2_bf16, int weights_in_halves) {
    const int64_t E = pb->s.E, I = pb->s.I, H = pb->s.H, half = E * I * H;
    uint16_t *gate = malloc(sizeof(uint16_t) * (size_t)half);
    uint16_t *up = malloc(sizeof(uint16_t) * (size_t)half);
    /* the gradient's halves: fp32, or bf16 in the same bytes */
    float *dgate = malloc(sizeof(float) * (size_t)half), *dup = malloc(sizeof(float) * (size_t)half);
    void *saved = saved_make(layer, pb->T);
    w13_repack(pb->w13, gate, up, E, I, H, sizeof(uint16_t), 1);
    const size_t gsize = mode == WGRAD_BF16 ? sizeof(uint16_t) : sizeof(float);
    if (mode == WGRAD_ACCUMULATE) w13_repack(o->dw13, dgate, dup, E, I, H, gsize, 1);
    const uint16_t *w13 = weights_in_halves ? gate : pb->w13;
    const uint16_t *w13_up = weights_in_halves ? up : NULL;
    moefuse_fwd_args a = {
        .num_tokens = pb->T, .x = pb->x, .x_stride = pb->stride, .ids = pb->ids,
        .weights = pb->p, .w13 = w13, .w2 = pb->w2, .y = o->y, .y_stride = pb->stride,
        .saved = saved, .expert_counts = o->counts, .fp8_weights = pb->fp8, .w13_up = w13_up,
    };
    CHECK_OK(moefuse_forward(layer, &a, NULL));
    moefuse_bwd_args b = {
        .num_tokens = pb->T, .x = pb->x, .x_stride = pb->stride, .ids = pb->ids,
        .weights = pb->p, .w13 = w13, .w2 = pb->w2, .saved = saved,
        .saved_bytes = saved_size(layer, pb->T), .dy = pb->dy,
        .dy_stride = pb->stride, .dx = o->dx, .dx_stride = pb->stride, .dweights = o->dp,
        .accumulate = mode == WGRAD_ACCUMULATE, .fp8_weights = pb->fp8, .w13_up = w13_up,
    };
    if (mode == WGRAD_BF16) {
        b.dw13_bf16 = (uint16_t *)dgate;
        b.dw13_up_bf16 = (uint16_t *)dup;
        b.dw2_bf16 = dw2_bf16;
    } else {
        b.dw13 = dgate;
        b.dw13_up = dup;
        b.dw2 = o->dw2;
    }
    CHECK_OK(moefuse_backward(layer, &b, NULL));
    w13_repack(mode == WGRAD_BF16 ? (void *)dw13_bf16 : (void *)o->dw13, dgate, dup, E, I, H,
               gsize, 0);
    free(gate);
    free(up);
    free(dgate);
    free(dup);
    free(saved);
}

void err_add(err_acc *e, double got, double want) {
    e->num += (got - want) * (got - want);
    e->den += want * want;
}

double err_rel(const err_acc *e) {
    if (e->num != e->num) return NAN;
    if (e->den == 0) return e->num == 0 ? 0 : INFINITY;
    return sqrt(e->num / e->den);
}

/* Adds this problem's errors against the reference to `e`; checks exactly what is
 * exact (zero gradients of experts without slots, dp of dropped slots, y and dx of
 * tokens with every slot dropped). */
void compare_with_reference(const problem *pb, const outputs *o, errs *er, int ref) {
    int64_t T = pb->T, H = pb->s.H, I = pb->s.I, E = pb->s.E, K = pb->s.K;
    int32_t *map = malloc(sizeof(int32_t) * (size_t)E);  /* [E] used id or -1 */
    int64_t eu = 0;
    for (int64_t e = 0; e < E; e++) map[e] = pb->counts[e] > 0 ? (int32_t)eu++ : -1;
    int64_t ec = eu > 0 ? eu : 1;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(T * K + 1));   /* [T, K] */
    double *p = malloc(sizeof(double) * (size_t)(T * K + 1));       /* [T, K] */
    double *x = malloc(sizeof(double) * (size_t)(T * H + 1));        /* [T, H] */
    double *dy = malloc(sizeof(double) * (size_t)(T * H + 1));       /* [T, H] */
    double *w13 = calloc((size_t)(ec * 2 * I * H), sizeof(double)); /* [Eu, 2I, H] */
    double *w2 = calloc((size_t)(ec * H * I), sizeof(double));       /* [Eu, H, I] */
    double *y = malloc(sizeof(double) * (size_t)(T * H + 1));        /* [T, H] */
    double *dx = malloc(sizeof(double) * (size_t)(T * H + 1));       /* [T, H] */
    double *dp = malloc(sizeof(double) * (size_t)(T * K + 1));       /* [T, K] */
    double *dw13 = malloc(sizeof(double) * (size_t)(ec * 2 * I * H)); /* [Eu, 2I, H] */
    double *dw2 = malloc(sizeof(double) * (size_t)(ec * H * I));     /* [Eu, H, I] */
    if (!map || !ids || !p || !x || !dy || !w13 || !w2 || !y || !dx || !dp || !dw13 || !dw2) {
        CHECK(0, "out of memory for the reference");
        goto done;
    }
    for (int64_t i = 0; i < T * K; i++) {
        ids[i] = pb->ids[i] >= 0 ? map[pb->ids[i]] : -1;
        p[i] = pb->p[i];
    }
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) {
            x[t * H + h] = bf16_value(pb->x[t * pb->stride + h]);
            dy[t * H + h] = bf16_value(pb->dy[t * pb->stride + h]);
        }
    for (int64_t e = 0; e < E; e++) {
        if (map[e] < 0) continue;
        for (int64_t i = 0; i < 2 * I * H; i++)
            w13[map[e] * 2 * I * H + i] = bf16_value(pb->w13[e * 2 * I * H + i]);
        for (int64_t i = 0; i < H * I; i++)
            w2[map[e] * H * I + i] = bf16_value(pb->w2[e * H * I + i]);
    }
    mf_ref_shape rs = {(int)T, (int)H, (int)I, (int)ec, (int)K};
    if (ref == REF_BF16) {
        mf_ref_forward(&rs, x, ids, p, w13, w2, y);
        mf_ref_backward(&rs, x, ids, p, w13, w2, dy, dx, dp, dw13, dw2);
    } else {
        mf_ref_fp8_forward(&rs, ref == REF_FP8_POW2, x, ids, p, w13, w2, y);
        mf_ref_fp8_backward(&rs, ref == REF_FP8_POW2, x, ids, p, w13, w2, dy, dx, dp, dw13,
                            dw2);
    }

    err_acc *ey = &er->y, *edx = &er->dx, *edp = &er->dp, *ed13 = &er->dw13, *ed2 = &er->dw2;
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) {
            err_add(ey, bf16_value(o->y[t * pb->stride + h]), y[t * H + h]);
            err_add(edx, bf16_value(o->dx[t * pb->stride + h]), dx[t * H + h]);
        }
    for (int64_t i = 0; i < T * K; i++) err_add(edp, o->dp[i], dp[i]);
    int64_t nonzero_unused = 0;
    for (int64_t e = 0; e < E; e++) {
        const float *g13 = o->dw13 + e * 2 * I * H, *g2 = o->dw2 + e * H * I;
        if (map[e] < 0) {
            for (int64_t i = 0; i < 2 * I * H; i++) nonzero_unused += g13[i] != 0.0f;
            for (int64_t i = 0; i < H * I; i++) nonzero_unused += g2[i] != 0.0f;
            continue;
        }
        for (int64_t i = 0; i < 2 * I * H; i++) err_add(ed13, g13[i], dw13[map[e] * 2 * I * H + i]);
        for (int64_t i = 0; i < H * I; i++) err_add(ed2, g2[i], dw2[map[e] * H * I + i]);
    }
    CHECK(nonzero_unused == 0, "%lld weight-gradient elements of experts without slots "
          "are not 0 in write mode", (long long)nonzero_unused);
    /* dropped slots: dp exactly 0; tokens with every slot dropped: dx exactly 0 */
    for (int64_t t = 0; t < T; t++) {
        int routed = 0;
        for (int64_t k = 0; k < K; k++) {
            if (pb->ids[t * K + k] >= 0) { routed++; continue; }
            CHECK(o->dp[t * K + k] == 0.0f, "dp[%lld][%lld] of a dropped slot = %g",
                  (long long)t, (long long)k, o->dp[t * K + k]);
        }
        for (int64_t h = 0; !routed && h < H; h++)
            CHECK(o->dx[t * pb->stride + h] == 0 && o->y[t * pb->stride + h] == 0,
                  "token %lld has every slot dropped: expected y = dx = +0", (long long)t);
    }
done:
    free(map); free(ids); free(p); free(x); free(dy); free(w13); free(w2);
    free(y); free(dx); free(dp); free(dw13); free(dw2);
}


fp8_tols fp8_tolerances(shape s, int64_t rows, double (*acc)(int64_t)) {
    const th_diff none = {0.0, 0.0};
    th_diff gu = th_round(th_gemm(none, acc(s.H)), TH_BF16_STEP);    /* gemm1 -> bf16 g, u */
    th_diff a = th_round(th_elementwise(gu, 2.0), TH_BF16_STEP);     /* bf16 silu(g) u */
    th_diff o = th_gemm(th_quant_fp8(a), acc(s.I));                  /* gemm2 */
    th_diff dap = th_round(th_gemm(none, acc(s.H)), TH_BF16_STEP);   /* dgrad2 -> bf16 da' */
    th_diff dgu = th_round(th_elementwise(th_sum(dap, gu), 2.0), TH_BF16_STEP);
    th_diff dxr = th_gemm(th_quant_fp8(dgu), acc(2 * s.I));          /* dgrad1 */
    th_diff dp = th_gemm(th_sum(dap, a), acc(s.I));                  /* <da', a> */
    th_diff dw2 = th_gemm(th_quant_fp8(a), acc(rows));               /* (p dy)^T a */
    th_diff dw13 = th_gemm(th_quant_fp8(dgu), acc(rows));            /* [dg;du]^T x */
    fp8_tols t = {2 * o.rms + th_bf16_tolerance(1), 2 * dxr.rms + th_bf16_tolerance(1),
                  2 * dp.rms + 1e-6, 2 * dw13.rms + 1e-6, 2 * dw2.rms + 1e-6};
    return t;
}
