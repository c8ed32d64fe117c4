/* The reference checks of the CUDA backward tests (see the top of test_cuda_backward.c
 * for the method and the tolerances). */
#include <cuda_runtime.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_backward.h"
#include "fixture_cuda.h"
#include "harness.h"
#include "internal.h"
#include "moefuse.h"
#include "reference.h"

/* ---- the reference, per group of slots of one expert -------------------------------- */

typedef struct group {
    int expert, n;
    const int32_t *slot; /* [n] slots t*K+k, all routed to `expert` */
} group;

/* For each group: mf_ref_backward over its slots with E = 1, K = 1. dx_slot [n, H] and
 * dp_slot [n] per slot (in group order, at out_row[g] + i); dW of the group into
 * dw13_g / dw2_g (per group, [2I, H] / [H, I]) when non-NULL. Groups run in parallel,
 * each reference call single-threaded (nested OpenMP regions are inactive). */
static void ref_groups(const inputs *in, const group *g, int ng, const int64_t *out_row,
                       double *dx_slot, double *dp_slot, double **dw13_g, double **dw2_g) {
    const int H = F.m->H, I = F.m->I, K = F.m->K;
#pragma omp parallel for schedule(dynamic, 1)
    for (int gi = 0; gi < ng; gi++) {
        const int n = g[gi].n, e = g[gi].expert;
        double *x = malloc((size_t)n * H * 8), *dy = malloc((size_t)n * H * 8);
        double *p = malloc((size_t)n * 8), *dx = malloc((size_t)n * H * 8), *dp = malloc((size_t)n * 8);
        int32_t *ids = malloc((size_t)n * 4);
        double *w13g = dw13_g ? dw13_g[gi] : malloc((size_t)2 * I * H * 8);
        double *w2g = dw2_g ? dw2_g[gi] : malloc((size_t)H * I * 8);
        for (int i = 0; i < n; i++) {
            const int32_t s = g[gi].slot[i], t = s / K;
            for (int h = 0; h < H; h++) {
                x[(int64_t)i * H + h] = bf(in->x[(int64_t)t * in->x_stride + h]);
                dy[(int64_t)i * H + h] = bf(in->dy[(int64_t)t * in->dy_stride + h]);
            }
            p[i] = in->p[s];
            ids[i] = 0;
        }
        mf_ref_shape sh = {n, H, I, 1, 1};
        mf_ref_backward(&sh, x, ids, p, F.w13_ref + (int64_t)e * 2 * I * H,
                        F.w2_ref + (int64_t)e * H * I, dy, dx, dp, w13g, w2g);
        if (dx_slot)
            memcpy(dx_slot + out_row[gi] * H, dx, (size_t)n * H * 8);
        if (dp_slot) memcpy(dp_slot + out_row[gi], dp, (size_t)n * 8);
        if (!dw13_g) free(w13g);
        if (!dw2_g) free(w2g);
        free(x);
        free(dy);
        free(p);
        free(dx);
        free(dp);
        free(ids);
    }
}

/* ||da' o a||_2 of slot (token t, expert e) in fp64: the norm of the terms of its
 * d p = sum_i da'_i a_i, da' = W2_e^T dy_t, a = silu(g) u, [g; u] = W13_e x_t. */
static double dp_term_norm(const inputs *in, int t, int e) {
    const int H = F.m->H, I = F.m->I;
    const double *w13 = F.w13_ref + (int64_t)e * 2 * I * H, *w2 = F.w2_ref + (int64_t)e * H * I;
    const uint16_t *x = in->x + (int64_t)t * in->x_stride, *dy = in->dy + (int64_t)t * in->dy_stride;
    double *da = calloc((size_t)I, 8), sum = 0.0;
    for (int h = 0; h < H; h++) {
        const double d = bf(dy[h]);
        for (int i = 0; i < I; i++) da[i] += d * w2[(int64_t)h * I + i];
    }
    for (int i = 0; i < I; i++) {
        double g = 0.0, u = 0.0;
        for (int h = 0; h < H; h++) {
            g += w13[(int64_t)i * H + h] * bf(x[h]);
            u += w13[(int64_t)(I + i) * H + h] * bf(x[h]);
        }
        const double term = da[i] * g / (1.0 + exp(-g)) * u;
        sum += term * term;
    }
    free(da);
    return sqrt(sum);
}

/* dx (rows strided) and dweights: every element written, dropped slots 0, fully
 * dropped tokens 0, stride padding untouched; a token subset against the reference. */
void check_dx_dp(const inputs *in, const uint16_t *dx, const float *dp) {
    const int T = in->T, H = F.m->H, K = F.m->K;
    int64_t nan_count = 0, pad_touched = 0, dropped_nonzero = 0;
    for (int t = 0; t < T; t++) {
        const uint16_t *row = dx + (int64_t)t * in->dx_stride;
        int all_dropped = 1;
        for (int k = 0; k < K; k++) {
            const int64_t s = (int64_t)t * K + k;
            all_dropped &= in->ids[s] < 0;
            nan_count += isnan(dp[s]);
            dropped_nonzero += in->ids[s] < 0 && dp[s] != 0.0f;
        }
        for (int h = 0; h < H; h++) {
            nan_count += (row[h] & 0x7fff) > 0x7f80;
            dropped_nonzero += all_dropped && row[h] != 0;
        }
        for (int64_t h = H; h < in->dx_stride; h++) pad_touched += row[h] != 0xffff;
    }
    CHECK(nan_count == 0, "%lld elements of dx / dweights are NaN (unwritten?)", (long long)nan_count);
    CHECK(pad_touched == 0, "%lld elements past H in dx rows were written", (long long)pad_touched);
    CHECK(dropped_nonzero == 0, "%lld elements of dropped slots / tokens are not 0",
          (long long)dropped_nonzero);

    const int n = T <= kCheckTokens ? T : kCheckTokens;
    if (n == 0) return;
    int tok[kCheckTokens];
    for (int i = 0; i < n; i++) {
        int t, dup;
        do {
            t = T <= kCheckTokens ? i : (i == 0 ? 0 : i == 1 ? T - 1 : th_rand_int(0, T - 1));
            dup = 0;
            for (int j = 0; j < i; j++) dup |= tok[j] == t;
        } while (dup);
        tok[i] = t;
    }
    /* the live slots of the subset sorted by expert (the order of out_pos), one group
     * per run of one expert: each reference call writes its expert's whole dW, so
     * fewer calls cost less */
    group *g = malloc((size_t)n * K * sizeof(group));
    int32_t *slots = malloc((size_t)n * K * 4);
    int64_t *out_row = malloc((size_t)n * K * 8);
    int32_t *out_pos = malloc((size_t)n * K * 4); /* [i*K + k]: row in dx_slot, -1 dropped */
    int ng = 0, nl = 0;
    for (int e = 0; e < F.m->E; e++) {
        const int begin = nl;
        for (int i = 0; i < n; i++)
            for (int k = 0; k < K; k++)
                if (in->ids[tok[i] * K + k] == e) {
                    out_pos[i * K + k] = nl;
                    slots[nl++] = tok[i] * K + k;
                }
        if (nl > begin) {
            g[ng] = (group){e, nl - begin, &slots[begin]};
            out_row[ng++] = begin;
        }
    }
    for (int i = 0; i < n; i++)
        for (int k = 0; k < K; k++)
            if (in->ids[tok[i] * K + k] < 0) out_pos[i * K + k] = -1;
    double *dx_slot = malloc((size_t)(nl > 0 ? nl : 1) * H * 8), *dp_slot = malloc((size_t)(nl > 0 ? nl : 1) * 8);
    ref_groups(in, g, ng, out_row, dx_slot, dp_slot, NULL, NULL);
    double *dxr = calloc((size_t)n * H, 8), *dxg = malloc((size_t)n * H * 8);
    double *dpr = calloc((size_t)n * K, 8), *dpg = malloc((size_t)n * K * 8);
    for (int i = 0; i < n; i++) {
        for (int k = 0; k < K; k++) {
            const int32_t s = tok[i] * K + k, r = out_pos[i * K + k];
            dpg[i * K + k] = dp[s];
            if (r < 0) continue;
            for (int h = 0; h < H; h++) dxr[(int64_t)i * H + h] += dx_slot[(int64_t)r * H + h];
            dpr[i * K + k] = dp_slot[r];
        }
        for (int h = 0; h < H; h++) dxg[(int64_t)i * H + h] = bf(dx[(int64_t)tok[i] * in->dx_stride + h]);
    }
    double *dp_scale = calloc((size_t)n * K, 8);
#pragma omp parallel for schedule(dynamic, 1)
    for (int s = 0; s < n * K; s++) {
        const int e = in->ids[tok[s / K] * K + s % K];
        if (e >= 0) dp_scale[s] = dp_term_norm(in, tok[s / K], e);
    }
    double dp_err2 = 0.0, dp_scale2 = 0.0;
    for (int s = 0; s < n * K; s++) {
        dp_err2 += (dpg[s] - dpr[s]) * (dpg[s] - dpr[s]);
        dp_scale2 += dp_scale[s] * dp_scale[s];
    }
    free(dp_scale);
    const double ex = th_rel_l2(dxg, dxr, (int64_t)n * H), tx = th_bf16_tolerance(6);
    const double ep = dp_scale2 > 0.0 ? sqrt(dp_err2 / dp_scale2) : sqrt(dp_err2),
                 tp = th_bf16_tolerance(4);
    CHECK(ex <= tx, "dx: rel l2 %.3e over %d tokens > tol %.3e", ex, n, tx);
    CHECK(ep <= tp, "dweights: l2 error / term norm %.3e over %d tokens > tol %.3e", ep, n, tp);
    printf("    %s T=%d: dx rel l2 %.2e (tol %.2e), dweights err/term norm %.2e (tol %.2e), %d tokens\n",
           F.m->name, T, ex, tx, ep, tp, n);
    free(g);
    free(slots);
    free(out_row);
    free(out_pos);
    free(dx_slot);
    free(dp_slot);
    free(dxr);
    free(dxg);
    free(dpr);
    free(dpg);
}

/* The masked call: keep the slots of the kMaskExperts most loaded experts (at most
 * kMaskSlots each, the first in token order); run forward + backward on them; check
 * dW13 / dW2 of the kept experts against the reference, every other expert exactly 0. */
void check_dw_masked(inputs *in) {
    const int T = in->T, K = F.m->K, E = F.m->E, H = F.m->H, I = F.m->I;
    const int64_t slots = (int64_t)T * K;
    int32_t *counts = calloc((size_t)E, 4), *keep = malloc((size_t)E * 4);
    int32_t *masked = malloc((size_t)slots * 4), *saved_ids = in->ids;
    int nkeep = 0;
    for (int64_t s = 0; s < slots; s++)
        if (in->ids[s] >= 0) counts[in->ids[s]]++;
    for (int j = 0; j < kMaskExperts; j++) { /* most loaded, ties to the lower id */
        int best = -1;
        for (int e = 0; e < E; e++) {
            int taken = 0;
            for (int i = 0; i < nkeep; i++) taken |= keep[i] == e;
            if (!taken && counts[e] > 0 && (best < 0 || counts[e] > counts[best])) best = e;
        }
        if (best >= 0) keep[nkeep++] = best;
    }
    /* groups of kGroupSlots slots of one kept expert, in slot order */
    int32_t *kept_slots = malloc((size_t)(slots > 0 ? slots : 1) * 4);
    group *g = malloc((size_t)(kMaskExperts * kMaskSlots / kGroupSlots + kMaskExperts) * sizeof(group));
    int ng = 0, nkept = 0;
    int group_begin[kMaskExperts + 1];
    for (int64_t s = 0; s < slots; s++) masked[s] = -1;
    for (int j = 0; j < nkeep; j++) {
        group_begin[j] = ng;
        int taken = 0;
        for (int64_t s = 0; s < slots && taken < kMaskSlots; s++) {
            if (in->ids[s] != keep[j]) continue;
            masked[s] = keep[j];
            if (taken % kGroupSlots == 0) g[ng++] = (group){keep[j], 0, &kept_slots[nkept]};
            kept_slots[nkept++] = (int32_t)s;
            g[ng - 1].n++;
            taken++;
        }
    }
    group_begin[nkeep] = ng;
    const size_t e13 = (size_t)2 * I * H, e2 = (size_t)H * I;
    double **dw13_g = malloc((size_t)(ng > 0 ? ng : 1) * sizeof(double *));
    double **dw2_g = malloc((size_t)(ng > 0 ? ng : 1) * sizeof(double *));
    for (int i = 0; i < ng; i++) {
        dw13_g[i] = malloc(e13 * 8);
        dw2_g[i] = malloc(e2 * 8);
    }
    CUDA_OK(cudaMemcpy(in->ids_d, masked, (size_t)slots * 4, cudaMemcpyHostToDevice));
    MF_OK(run_fwd_bwd(F.layer, in, 1));
    CUDA_OK(cudaMemcpy(F.dw13_h, F.dw13_d, (size_t)n13() * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(F.dw2_h, F.dw2_d, (size_t)n2() * 4, cudaMemcpyDeviceToHost));
    in->ids = masked;
    ref_groups(in, g, ng, NULL, NULL, NULL, dw13_g, dw2_g);
    in->ids = saved_ids;

    int64_t nonzero = 0;
    for (int e = 0; e < E; e++) {
        int kept = 0;
        for (int j = 0; j < nkeep; j++) kept |= keep[j] == e;
        if (kept) continue;
        const float *a = F.dw13_h + (int64_t)e * e13, *b = F.dw2_h + (int64_t)e * e2;
        for (size_t i = 0; i < e13; i++) nonzero += a[i] != 0.0f;
        for (size_t i = 0; i < e2; i++) nonzero += b[i] != 0.0f;
    }
    CHECK(nonzero == 0, "%lld dW elements of experts without rows are not 0", (long long)nonzero);
    double *r13 = malloc(e13 * 8), *g13 = malloc(e13 * 8), *r2 = malloc(e2 * 8), *g2 = malloc(e2 * 8);
    for (int j = 0; j < nkeep; j++) {
        const int e = keep[j];
        memset(r13, 0, e13 * 8);
        memset(r2, 0, e2 * 8);
        for (int gi = group_begin[j]; gi < group_begin[j + 1]; gi++) {
            for (size_t i = 0; i < e13; i++) r13[i] += dw13_g[gi][i];
            for (size_t i = 0; i < e2; i++) r2[i] += dw2_g[gi][i];
        }
        for (size_t i = 0; i < e13; i++) g13[i] = F.dw13_h[(int64_t)e * e13 + i];
        for (size_t i = 0; i < e2; i++) g2[i] = F.dw2_h[(int64_t)e * e2 + i];
        const double a13 = th_rel_l2(g13, r13, (int64_t)e13), t13 = th_bf16_tolerance(4);
        const double a2 = th_rel_l2(g2, r2, (int64_t)e2), t2 = th_bf16_tolerance(4);
        const int rows = counts[e] < kMaskSlots ? counts[e] : kMaskSlots;
        CHECK(a13 <= t13, "dW13 of expert %d (%d rows): rel l2 %.3e > tol %.3e", e, rows, a13, t13);
        CHECK(a2 <= t2, "dW2 of expert %d (%d rows): rel l2 %.3e > tol %.3e", e, rows, a2, t2);
        printf("    %s T=%d masked: expert %d, %d rows: dW13 rel l2 %.2e (tol %.2e), dW2 %.2e "
               "(tol %.2e)\n", F.m->name, T, e, rows, a13, t13, a2, t2);
    }
    free(r13);
    free(g13);
    free(r2);
    free(g2);
done:
    CHECK(cudaMemcpy(in->ids_d, saved_ids, (size_t)slots * 4, cudaMemcpyHostToDevice) == cudaSuccess,
          "restore ids");
    for (int i = 0; i < ng; i++) {
        free(dw13_g[i]);
        free(dw2_g[i]);
    }
    free(dw13_g);
    free(dw2_g);
    free(counts);
    free(keep);
    free(masked);
    free(kept_slots);
    free(g);
}
