/* The FP8 block recipe in fp64: the oracle of every FP8 backend (reference.h,
 * docs/decisions/0018-fp8-block-recipe.md).
 *
 * Quantization goes through src/cpu/fp8.c, the one definition of the recipe; here a
 * quantized operand is its decoded codes (exact in fp64) and its scales, kept apart so
 * that every GEMM is, as on the GPU,
 *     C = sum over 128-blocks b of K:  (scale_a * scale_b) * (sum over k in b of qa qb)
 * E4M3 values carry 4 significant bits, so a product carries 8 and lies in
 * [2^-18, 2^17.6]; a sum of 128 of them spans at most 2^-18 .. 2^25, 43 bits: the block
 * sums are exact in fp64 in any order, and the scale product (two fp32) is exact too.
 * What is left is one fp64 rounding per block and the fp64 sum over blocks.
 *
 * Structure as in reference.c: one thread per expert, every output element summed by
 * one thread in a fixed order, so results do not depend on the thread count. On an
 * allocation failure the outputs are NaN. */
#include "fp8.h"
#include "internal.h"
#include "reference.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define TILE MF_FP8_TILE

static int64_t nb(int64_t n) { return (n + TILE - 1) / TILE; }
static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* bf16 through fp32, as a GPU epilogue rounds its fp32 value. */
static double bf16(double v) { return mf_bf16_to_float(mf_float_to_bf16((float)v)); }
static double sigmoid(double g) { return 1.0 / (1.0 + exp(-g)); }

static void fill_nan(double *a, int64_t n) {
    for (int64_t i = 0; i < n; i++) a[i] = NAN;
}

/* ---- quantizers: decoded codes and scales ------------------------------------------ */

/* Rows [rows, cols] in 1 x 128 tiles along cols: q [rows, cols], s [rows, nb(cols)]. */
static void quant_rows(const double *v, int64_t rows, int64_t cols, int pow2, double *q,
                       double *s) {
    float f[TILE];
    uint8_t c[TILE];
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < nb(cols); b++) {
            const int64_t n = min64(TILE, cols - b * TILE), at = r * cols + b * TILE;
            for (int64_t i = 0; i < n; i++) f[i] = (float)v[at + i];
            s[r * nb(cols) + b] = mf_fp8_quantize_tile(f, n, 1, pow2, c, 1);
            for (int64_t i = 0; i < n; i++) q[at + i] = mf_e4m3_decode(c[i]);
        }
}

/* Rows [rows, cols] in tiles of 128 rows per column: s [nb(rows), cols]. */
static void quant_tokens(const double *v, int64_t rows, int64_t cols, int pow2, double *q,
                         double *s) {
    float f[TILE];
    uint8_t c[TILE];
    for (int64_t t = 0; t < nb(rows); t++)
        for (int64_t j = 0; j < cols; j++) {
            const int64_t n = min64(TILE, rows - t * TILE), at = t * TILE * cols + j;
            for (int64_t i = 0; i < n; i++) f[i] = (float)v[at + i * cols];
            s[t * cols + j] = mf_fp8_quantize_tile(f, n, 1, pow2, c, 1);
            for (int64_t i = 0; i < n; i++) q[at + i * cols] = mf_e4m3_decode(c[i]);
        }
}

/* A weight [rows, cols] in 128 x 128 blocks: q [rows, cols], s [nb(rows), nb(cols)].
 * Returns 0 when out of memory. */
static int quant_blocks(const double *w, int64_t rows, int64_t cols, int pow2, double *q,
                        double *s) {
    float *f = calloc((size_t)(rows * cols), sizeof(float));
    uint8_t *c = malloc((size_t)(rows * cols));
    float *sf = malloc(sizeof(float) * (size_t)(nb(rows) * nb(cols)));
    int ok = f && c && sf;
    if (ok) {
        for (int64_t i = 0; i < rows * cols; i++) f[i] = (float)w[i];
        mf_fp8_quantize_blocks(f, rows, cols, cols, pow2, c, sf, NULL, NULL);
        for (int64_t i = 0; i < rows * cols; i++) q[i] = mf_e4m3_decode(c[i]);
        for (int64_t i = 0; i < nb(rows) * nb(cols); i++) s[i] = sf[i];
    }
    free(f);
    free(c);
    free(sf);
    return ok;
}

/* ---- the three GEMM forms ----------------------------------------------------------- */

/* C [m, n] = A W^T: A rows [m, k] (s [m, nb(k)]), W [n, k] in blocks (s [nb(n), nb(k)]). */
static void gemm_a_wt(int64_t m, int64_t n, int64_t k, const double *qa, const double *sa,
                      const double *qw, const double *sw, double *c) {
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            double acc = 0.0;
            for (int64_t b = 0; b < nb(k); b++) {
                const double *x = qa + i * k + b * TILE, *y = qw + j * k + b * TILE;
                double part = 0.0; /* exact */
                for (int64_t t = 0; t < min64(TILE, k - b * TILE); t++) part += x[t] * y[t];
                acc += (sa[i * nb(k) + b] * sw[(j / TILE) * nb(k) + b]) * part;
            }
            c[i * n + j] = acc;
        }
}

/* A row-by-block operand: element (i, t) at q[i * qi + t * qt], the scale of (i, block b
 * of t) at s[i * si + b * sb]; for the B side, i is a column and t a row. */
typedef struct operand {
    const double *q, *s;
    int64_t qi, qt, si, sb, s_div; /* s_div: columns per scale (128 for weight blocks) */
} operand;

/* C [m, n] = sum over 128-blocks b of t: (scale_a scale_b) * (sum over t in b of A B),
 * with B's rows contiguous (qi = 1 for B). part [n] scratch. The forms: A W with W [k, n]
 * in blocks (W^T's blocks are W's transposed), and the weight gradients A^T B over tiles
 * of 128 token rows. */
static void gemm_rows(int64_t m, int64_t n, int64_t k, operand a, operand b, double *c,
                      double *part) {
    for (int64_t i = 0; i < m; i++) {
        double *ci = c + i * n;
        for (int64_t j = 0; j < n; j++) ci[j] = 0.0;
        for (int64_t blk = 0; blk < nb(k); blk++) {
            for (int64_t j = 0; j < n; j++) part[j] = 0.0;
            for (int64_t t = blk * TILE; t < min64((blk + 1) * TILE, k); t++) {
                const double x = a.q[i * a.qi + t * a.qt], *w = b.q + t * b.qt;
                for (int64_t j = 0; j < n; j++) part[j] += x * w[j]; /* exact */
            }
            const double sa = a.s[i * a.si + blk * a.sb];
            for (int64_t j = 0; j < n; j++)
                ci[j] += (sa * b.s[(j / b.s_div) * b.si + blk * b.sb]) * part[j];
        }
    }
}

/* C [m, n] = A W: A rows [m, k] (s [m, nb(k)]), W [k, n] in blocks (s [nb(k), nb(n)]). */
static void gemm_a_w(int64_t m, int64_t n, int64_t k, const double *qa, const double *sa,
                     const double *qw, const double *sw, double *c, double *part) {
    operand a = {qa, sa, k, 1, nb(k), 1, 1}, w = {qw, sw, 1, n, 1, nb(n), TILE};
    gemm_rows(m, n, k, a, w, c, part);
}

/* C [m, n] = A^T B over `rows` token rows: A [rows, m], B [rows, n], both in tiles of
 * 128 rows (s [nb(rows), m] and [nb(rows), n]). */
static void gemm_tokens(int64_t rows, int64_t m, int64_t n, const double *qa,
                        const double *sa, const double *qb, const double *sb, double *c,
                        double *part) {
    operand a = {qa, sa, 1, m, 1, m, 1}, b = {qb, sb, 1, n, 1, n, 1};
    gemm_rows(m, n, rows, a, b, c, part);
}

/* ---- single GEMMs (reference.h) ---------------------------------------------------- */

void mf_ref_fp8_gemm(int64_t m, int64_t n, int64_t k, int pow2, const double *a,
                     const double *w, int w_kn, double *c) {
    const int64_t wr = w_kn ? k : n, wc = w_kn ? n : k;
    double *qa = malloc(sizeof(double) * (size_t)(m * k + 1));
    double *sa = malloc(sizeof(double) * (size_t)(m * nb(k) + 1));
    double *qw = malloc(sizeof(double) * (size_t)(n * k + 1));
    double *sw = malloc(sizeof(double) * (size_t)(nb(n) * nb(k) + 1));
    double *part = malloc(sizeof(double) * (size_t)(n + 1));
    if (qa && sa && qw && sw && part && quant_blocks(w, wr, wc, pow2, qw, sw)) {
        quant_rows(a, m, k, pow2, qa, sa);
        if (w_kn)
            gemm_a_w(m, n, k, qa, sa, qw, sw, c, part);
        else
            gemm_a_wt(m, n, k, qa, sa, qw, sw, c);
    } else {
        fill_nan(c, m * n);
    }
    free(qa); free(sa); free(qw); free(sw); free(part);
}

void mf_ref_fp8_gemm_tokens(int64_t rows, int64_t m, int64_t n, int pow2, const double *a,
                            const double *b, double *c) {
    double *qa = malloc(sizeof(double) * (size_t)(rows * m + 1));
    double *sa = malloc(sizeof(double) * (size_t)(nb(rows) * m + 1));
    double *qb = malloc(sizeof(double) * (size_t)(rows * n + 1));
    double *sb = malloc(sizeof(double) * (size_t)(nb(rows) * n + 1));
    double *part = malloc(sizeof(double) * (size_t)(n + 1));
    if (qa && sa && qb && sb && part) {
        quant_tokens(a, rows, m, pow2, qa, sa);
        quant_tokens(b, rows, n, pow2, qb, sb);
        gemm_tokens(rows, m, n, qa, sa, qb, sb, c, part);
    } else {
        fill_nan(c, m * n);
    }
    free(qa); free(sa); free(qb); free(sb); free(part);
}

/* ---- one expert --------------------------------------------------------------------- */

/* Everything one expert's rows need; each array [rows or weight shape]. */
typedef struct expert_work {
    int64_t n;                        /* rows of this expert */
    double *xr, *qx, *sx;             /* x rows [n, H], codes, scales [n, nb(H)] */
    double *gu, *a, *q, *s;           /* [g;u] [n, 2I], a [n, I]; operand codes, scales */
    double *qw13, *sw13, *qw2, *sw2;  /* the expert's quantized weights */
    double *part;                     /* [max(H, 2I)] block sums */
} expert_work;

static void work_free(expert_work *w) {
    free(w->xr); free(w->qx); free(w->sx); free(w->gu); free(w->a); free(w->q); free(w->s);
    free(w->qw13); free(w->sw13); free(w->qw2); free(w->sw2); free(w->part);
}

static int work_alloc(expert_work *w, int64_t n, int64_t H, int64_t I) {
    const int64_t wide = H > 2 * I ? H : 2 * I, n1 = n + 1;
    memset(w, 0, sizeof *w);
    w->n = n;
    w->xr = malloc(sizeof(double) * (size_t)(n1 * H));
    w->qx = malloc(sizeof(double) * (size_t)(n1 * H));
    w->sx = malloc(sizeof(double) * (size_t)(n1 * nb(H)));
    w->gu = malloc(sizeof(double) * (size_t)(n1 * 2 * I));
    w->a = malloc(sizeof(double) * (size_t)(n1 * I));
    w->q = malloc(sizeof(double) * (size_t)(n1 * wide));
    /* two operands' scales, each <= max(n nb(wide), nb(n) wide) <= n1 wide */
    w->s = malloc(sizeof(double) * (size_t)(2 * n1 * wide));
    w->qw13 = malloc(sizeof(double) * (size_t)(2 * I * H));
    w->sw13 = malloc(sizeof(double) * (size_t)(nb(2 * I) * nb(H)));
    w->qw2 = malloc(sizeof(double) * (size_t)(H * I));
    w->sw2 = malloc(sizeof(double) * (size_t)(nb(H) * nb(I)));
    w->part = malloc(sizeof(double) * (size_t)wide);
    return w->xr && w->qx && w->sx && w->gu && w->a && w->q && w->s && w->qw13 && w->sw13 &&
           w->qw2 && w->sw2 && w->part;
}

/* Expert e's forward up to a: x rows quantized along H, gemm1, g and u to bf16,
 * a = bf16(silu(g) u); the weights quantized. Returns 0 when out of memory. */
static int expert_forward(const mf_ref_shape *s, int pow2, const mf_ref_groups *g, int e,
                          const double *x, const double *w13, const double *w2,
                          expert_work *w) {
    const int64_t H = s->hidden, I = s->intermediate, K = s->top_k, r0 = g->offsets[e];
    if (!quant_blocks(w13 + e * 2 * I * H, 2 * I, H, pow2, w->qw13, w->sw13) ||
        !quant_blocks(w2 + e * H * I, H, I, pow2, w->qw2, w->sw2))
        return 0;
    for (int64_t r = 0; r < w->n; r++)
        memcpy(w->xr + r * H, x + (g->slots[r0 + r] / K) * H, sizeof(double) * (size_t)H);
    quant_rows(w->xr, w->n, H, pow2, w->qx, w->sx);
    gemm_a_wt(w->n, 2 * I, H, w->qx, w->sx, w->qw13, w->sw13, w->gu);
    for (int64_t r = 0; r < w->n; r++)
        for (int64_t i = 0; i < I; i++) {
            double *gate = &w->gu[r * 2 * I + i], *up = &w->gu[r * 2 * I + I + i];
            *gate = bf16(*gate);
            *up = bf16(*up);
            w->a[r * I + i] = bf16(*gate * sigmoid(*gate) * *up);
        }
    return 1;
}

/* ---- forward ------------------------------------------------------------------------ */

void mf_ref_fp8_forward(const mf_ref_shape *s, int pow2, const double *x, const int32_t *ids,
                        const double *p, const double *w13, const double *w2, double *y) {
    const int64_t T = s->num_tokens, H = s->hidden, I = s->intermediate, K = s->top_k;
    mf_ref_groups g;
    if (!mf_ref_groups_build(s, ids, &g)) {
        fill_nan(y, T * H);
        return;
    }
    double *o = malloc(sizeof(double) * (size_t)((g.num_rows + 1) * H)); /* [rows, H] */
    int failed = !o;
#pragma omp parallel for schedule(dynamic, 1)
    for (int e = 0; e < s->num_experts; e++) {
        const int64_t r0 = g.offsets[e], n = g.offsets[e + 1] - r0;
        if (n == 0 || failed) continue;
        expert_work w;
        if (!work_alloc(&w, n, H, I) || !expert_forward(s, pow2, &g, e, x, w13, w2, &w)) {
#pragma omp atomic write
            failed = 1;
        } else {
            quant_rows(w.a, n, I, pow2, w.q, w.s); /* a along I */
            gemm_a_wt(n, H, I, w.q, w.s, w.qw2, w.sw2, o + r0 * H);
        }
        work_free(&w);
    }
    if (failed) {
        fill_nan(y, T * H);
    } else {
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < T; t++) /* y_t = sum_k p o, in k order */
            for (int64_t h = 0; h < H; h++) {
                double acc = 0.0;
                for (int64_t k = 0; k < K; k++) {
                    int64_t r = g.row_of[t * K + k];
                    if (r >= 0) acc += p[t * K + k] * o[r * H + h];
                }
                y[t * H + h] = acc;
            }
    }
    free(o);
    mf_ref_groups_free(&g);
}

/* ---- backward ----------------------------------------------------------------------- */

/* Expert e's backward after expert_forward: dgrad2 (dy along H, W2^T), dp, the SwiGLU
 * backward to bf16, dgrad1 ([dg;du] along 2I, W13^T) into dxr, and the weight gradients
 * over its rows in tiles of 128 rows (p dy with a, [dg;du] with x). */
static void expert_backward(const mf_ref_shape *s, int pow2, const mf_ref_groups *g, int e,
                            const double *p, const double *dy, expert_work *w,
                            double *dxr, double *dp, double *dw13, double *dw2) {
    const int64_t H = s->hidden, I = s->intermediate, K = s->top_k, n = w->n;
    const int64_t r0 = g->offsets[e];
    double *dyr = dxr + r0 * H; /* [n, H]: dy rows, later p dy, then dx rows */
    double *dap = malloc(sizeof(double) * (size_t)(n * I)); /* da' [n, I] */
    double *dgu = malloc(sizeof(double) * (size_t)(n * 2 * I)); /* [dg; du] */
    if (!dap || !dgu) {
        fill_nan(dw13, 2 * I * H);
        fill_nan(dw2, H * I);
        fill_nan(dyr, n * H);
        goto done;
    }
    for (int64_t r = 0; r < n; r++)
        memcpy(dyr + r * H, dy + (g->slots[r0 + r] / K) * H, sizeof(double) * (size_t)H);
    quant_rows(dyr, n, H, pow2, w->q, w->s);
    gemm_a_w(n, I, H, w->q, w->s, w->qw2, w->sw2, dap, w->part);
    for (int64_t r = 0; r < n; r++) {
        const int64_t slot = g->slots[r0 + r];
        double acc = 0.0;
        for (int64_t i = 0; i < I; i++) {
            dap[r * I + i] = bf16(dap[r * I + i]);
            acc += dap[r * I + i] * w->a[r * I + i];
        }
        dp[slot] = acc;
        for (int64_t i = 0; i < I; i++) {
            double gate = w->gu[r * 2 * I + i], up = w->gu[r * 2 * I + I + i];
            double sg = sigmoid(gate), da = p[slot] * dap[r * I + i];
            dgu[r * 2 * I + i] = bf16(da * up * sg * (1.0 + gate * (1.0 - sg)));
            dgu[r * 2 * I + I + i] = bf16(da * gate * sg);
        }
        /* p dy in fp32, the operand dW2 quantizes */
        for (int64_t h = 0; h < H; h++) dyr[r * H + h] = (float)(p[slot] * dyr[r * H + h]);
    }
    /* dW2 = (p dy)^T a and dW13 = [dg;du]^T x, both operands in tiles of 128 rows */
    double *sb = w->s + (n + 1) * (H > 2 * I ? H : 2 * I); /* the second operand's */
    quant_tokens(dyr, n, H, pow2, w->q, w->s);
    quant_tokens(w->a, n, I, pow2, w->a, sb); /* in place: a is not needed any more */
    gemm_tokens(n, H, I, w->q, w->s, w->a, sb, dw2, w->part);
    quant_tokens(dgu, n, 2 * I, pow2, w->q, w->s);
    quant_tokens(w->xr, n, H, pow2, w->qx, sb);
    gemm_tokens(n, 2 * I, H, w->q, w->s, w->qx, sb, dw13, w->part);
    /* dgrad1: dx rows = [dg;du] W13 */
    quant_rows(dgu, n, 2 * I, pow2, w->q, w->s);
    gemm_a_w(n, H, 2 * I, w->q, w->s, w->qw13, w->sw13, dyr, w->part);
done:
    free(dap);
    free(dgu);
}

void mf_ref_fp8_backward(const mf_ref_shape *s, int pow2, const double *x, const int32_t *ids,
                         const double *p, const double *w13, const double *w2,
                         const double *dy, double *dx, double *dp, double *dw13,
                         double *dw2) {
    const int64_t T = s->num_tokens, H = s->hidden, I = s->intermediate, K = s->top_k;
    const int64_t E = s->num_experts;
    mf_ref_groups g;
    double *dxr = NULL; /* [rows, H] */
    const int grouped = mf_ref_groups_build(s, ids, &g);
    int failed = !grouped;
    if (grouped) {
        dxr = malloc(sizeof(double) * (size_t)((g.num_rows + 1) * H));
        failed = !dxr;
    }
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t e = 0; e < E; e++) {
        double *dw13_e = dw13 + e * 2 * I * H, *dw2_e = dw2 + e * H * I;
        memset(dw13_e, 0, sizeof(double) * (size_t)(2 * I * H));
        memset(dw2_e, 0, sizeof(double) * (size_t)(H * I));
        if (failed || g.offsets[e + 1] == g.offsets[e]) continue;
        expert_work w;
        if (!work_alloc(&w, g.offsets[e + 1] - g.offsets[e], H, I) ||
            !expert_forward(s, pow2, &g, (int)e, x, w13, w2, &w)) {
#pragma omp atomic write
            failed = 1;
        } else {
            expert_backward(s, pow2, &g, (int)e, p, dy, &w, dxr, dp, dw13_e, dw2_e);
        }
        work_free(&w);
    }
    if (failed) {
        fill_nan(dx, T * H);
        fill_nan(dp, T * K);
        fill_nan(dw13, E * 2 * I * H);
        fill_nan(dw2, E * H * I);
    } else {
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < T; t++) { /* dx_t = sum_k dx rows, in k order */
            for (int64_t h = 0; h < H; h++) {
                double acc = 0.0;
                for (int64_t k = 0; k < K; k++) {
                    int64_t r = g.row_of[t * K + k];
                    if (r >= 0) acc += dxr[r * H + h];
                }
                dx[t * H + h] = acc;
            }
            for (int64_t k = 0; k < K; k++)
                if (g.row_of[t * K + k] < 0) dp[t * K + k] = 0.0;
        }
    }
    free(dxr);
    if (grouped) mf_ref_groups_free(&g);
}

/* ---- W13 in two halves ------------------------------------------------------------------ */

/* [E, I, H] gate and up halves <-> packed [E, 2I, H] (to_halves: packed -> halves). */
static void w13_repack(const mf_ref_shape *s, double *packed, double *gate, double *up,
                       int to_halves) {
    const int64_t half = (int64_t)s->intermediate * s->hidden;
    for (int64_t e = 0; e < s->num_experts; e++) {
        double *pe = packed + e * 2 * half;
        if (to_halves) {
            memcpy(gate + e * half, pe, sizeof(double) * (size_t)half);
            memcpy(up + e * half, pe + half, sizeof(double) * (size_t)half);
        } else {
            memcpy(pe, gate + e * half, sizeof(double) * (size_t)half);
            memcpy(pe + half, up + e * half, sizeof(double) * (size_t)half);
        }
    }
}

void mf_ref_fp8_forward_halves(const mf_ref_shape *s, int pow2, const double *x,
                               const int32_t *ids, const double *p, const double *w13,
                               const double *w13_up, const double *w2, double *y) {
    if (!w13_up) {
        mf_ref_fp8_forward(s, pow2, x, ids, p, w13, w2, y);
        return;
    }
    const int64_t n = (int64_t)s->num_experts * 2 * s->intermediate * s->hidden;
    double *packed = malloc(sizeof(double) * (size_t)n);
    if (!packed) {
        fill_nan(y, (int64_t)s->num_tokens * s->hidden);
        return;
    }
    w13_repack(s, packed, (double *)w13, (double *)w13_up, 0);
    mf_ref_fp8_forward(s, pow2, x, ids, p, packed, w2, y);
    free(packed);
}

void mf_ref_fp8_backward_halves(const mf_ref_shape *s, int pow2, const double *x,
                                const int32_t *ids, const double *p, const double *w13,
                                const double *w13_up, const double *w2, const double *dy,
                                double *dx, double *dp, double *dw13, double *dw13_up,
                                double *dw2) {
    if (!w13_up) {
        mf_ref_fp8_backward(s, pow2, x, ids, p, w13, w2, dy, dx, dp, dw13, dw2);
        return;
    }
    const int64_t n = (int64_t)s->num_experts * 2 * s->intermediate * s->hidden;
    double *packed = malloc(sizeof(double) * (size_t)n);
    double *dpacked = malloc(sizeof(double) * (size_t)n);
    if (!packed || !dpacked) {
        fill_nan(dx, (int64_t)s->num_tokens * s->hidden);
        fill_nan(dp, (int64_t)s->num_tokens * s->top_k);
        fill_nan(dw13, n / 2);
        fill_nan(dw13_up, n / 2);
        fill_nan(dw2, (int64_t)s->num_experts * s->hidden * s->intermediate);
    } else {
        w13_repack(s, packed, (double *)w13, (double *)w13_up, 0);
        mf_ref_fp8_backward(s, pow2, x, ids, p, packed, w2, dy, dx, dp, dpacked, dw2);
        w13_repack(s, dpacked, dw13, dw13_up, 1);
    }
    free(packed);
    free(dpacked);
}
