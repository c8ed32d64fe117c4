/* The CPU routing helper: Qwen3 routing (softmax over E in fp32, top-K, renormalize
 * the K weights to sum to 1) and its backward, with the semantics of the fp64
 * reference in reference.c.
 *
 * Computed as Hugging Face's Qwen3-MoE computes it (softmax in fp32 with the max
 * subtracted, top-K of the probabilities, divide by their sum), so weights agree
 * with a PyTorch trainer's to fp32 rounding.
 *
 * Non-finite logits are not rejected (checking costs a pass, and a trainer wants the
 * NaN to surface where it came from): a NaN or +inf logit makes every weight of its
 * token NaN, and so its dlogits; the ids stay valid and distinct (NaN ranks below
 * every number). A -inf logit is an expert with probability 0, as in a masked
 * softmax, as long as the token has one finite logit.
 *
 * With T = 0 the array pointers may be NULL (an empty PyTorch tensor's data pointer
 * can be). Outputs are written only after every check has passed. */
#include "internal.h"

#include <math.h>
#include <string.h>

/* ---- checks -------------------------------------------------------------------- */

static moefuse_status check_shape(const char *args_name, int num_tokens, int num_experts,
                                  int top_k) {
    if (num_tokens < 0)
        return mf_fail(MOEFUSE_ERR_SHAPE, "%s.num_tokens = %d: expected >= 0", args_name,
                       num_tokens);
    if (num_experts <= 0)
        return mf_fail(MOEFUSE_ERR_SHAPE, "%s.num_experts = %d: expected > 0", args_name,
                       num_experts);
    if (top_k < 1 || top_k > num_experts)
        return mf_fail(MOEFUSE_ERR_SHAPE,
                       "%s.top_k = %d: expected 1 <= top_k <= num_experts (%d)", args_name,
                       top_k, num_experts);
    return MOEFUSE_OK;
}

static moefuse_status check_pointer(const char *args_name, const char *field,
                                    const void *ptr) {
    if (!ptr)
        return mf_fail(MOEFUSE_ERR_NULL_POINTER, "%s.%s is NULL: expected a host pointer",
                       args_name, field);
    return MOEFUSE_OK;
}

/* ---- selection and weights ----------------------------------------------------- */

/* The selection order (same as the reference): higher logit first, equal logits by
 * lower id, NaN after every number, so the order is total. Selecting on logits
 * rather than probabilities picks the same experts (softmax is increasing) without
 * letting rounding in expf() create ties that the logits do not have. */
static int precedes(const float *l, int a, int b) {
    int na = isnan(l[a]), nb = isnan(l[b]);
    if (na != nb) return nb;
    if (!na && l[a] != l[b]) return l[a] > l[b];
    return a < b;
}

/* ids [K] of the top-K of l [E] in selection order; pick k is the best expert that
 * comes after pick k-1. O(K E): K is small, and it needs no scratch. */
static void topk(const float *l, int E, int K, int32_t *ids) {
    for (int k = 0; k < K; k++) {
        int best = -1;
        for (int j = 0; j < E; j++) {
            if (k > 0 && !precedes(l, ids[k - 1], j)) continue;
            if (best < 0 || precedes(l, j, best)) best = j;
        }
        ids[k] = best;
    }
}

/* weight k = (exp(l[ids[k]] - m) / z) / sum: the full softmax, then renormalized over
 * the K selected, in that order, as Qwen3 does it. */
typedef struct softmax_parts {
    float m, z, sum;
} softmax_parts;

static softmax_parts topk_softmax(const float *l, int E, int K, const int32_t *ids) {
    softmax_parts r = {-INFINITY, 0.0f, 0.0f};
    for (int j = 0; j < E; j++) r.m = fmaxf(r.m, l[j]);
    /* fmaxf skips NaN; a NaN logit still reaches z through expf below. */
    for (int j = 0; j < E; j++) r.z += expf(l[j] - r.m);
    for (int k = 0; k < K; k++) r.sum += expf(l[ids[k]] - r.m) / r.z;
    return r;
}

static float topk_weight(const float *l, const softmax_parts *r, int32_t id) {
    return (expf(l[id] - r->m) / r->z) / r->sum;
}

/* ---- forward ------------------------------------------------------------------- */

moefuse_status mf_cpu_route_forward(const moefuse_route_args *args) {
    static const char name[] = "route_args";
    if (!args) return mf_fail(MOEFUSE_ERR_NULL_POINTER, "args is NULL: expected a moefuse_route_args");
    const int T = args->num_tokens, E = args->num_experts, K = args->top_k;
    moefuse_status st = check_shape(name, T, E, K);
    if (st != MOEFUSE_OK) return st;
    if (T == 0) return MOEFUSE_OK;
    if ((st = check_pointer(name, "logits", args->logits)) != MOEFUSE_OK) return st;
    if ((st = check_pointer(name, "ids", args->ids)) != MOEFUSE_OK) return st;
    if ((st = check_pointer(name, "weights", args->weights)) != MOEFUSE_OK) return st;

    const float *logits = args->logits;  /* [T, E] */
    int32_t *ids = args->ids;            /* [T, K] */
    float *weights = args->weights;      /* [T, K] */
#pragma omp parallel for schedule(static)
    for (int t = 0; t < T; t++) {
        const float *l = logits + (int64_t)t * E;
        int32_t *id = ids + (int64_t)t * K;
        topk(l, E, K, id);
        softmax_parts r = topk_softmax(l, E, K, id);
        for (int k = 0; k < K; k++) weights[(int64_t)t * K + k] = topk_weight(l, &r, id[k]);
    }
    return MOEFUSE_OK;
}

/* ---- backward -----------------------------------------------------------------
 * The renormalized weights are a softmax over the selected logits only, so
 *     d l_{i_n} = w_n (dw_n - sum_k w_k dw_k),   d l_j = 0 for unselected j
 * (derivation in reference.c). */

moefuse_status mf_cpu_route_backward(const moefuse_route_bwd_args *args) {
    static const char name[] = "route_bwd_args";
    if (!args)
        return mf_fail(MOEFUSE_ERR_NULL_POINTER, "args is NULL: expected a moefuse_route_bwd_args");
    const int T = args->num_tokens, E = args->num_experts, K = args->top_k;
    moefuse_status st = check_shape(name, T, E, K);
    if (st != MOEFUSE_OK) return st;
    if (T == 0) return MOEFUSE_OK;
    if ((st = check_pointer(name, "logits", args->logits)) != MOEFUSE_OK) return st;
    if ((st = check_pointer(name, "ids", args->ids)) != MOEFUSE_OK) return st;
    if ((st = check_pointer(name, "dweights", args->dweights)) != MOEFUSE_OK) return st;
    if ((st = check_pointer(name, "dlogits", args->dlogits)) != MOEFUSE_OK) return st;

    const float *logits = args->logits;      /* [T, E] */
    const int32_t *ids = args->ids;          /* [T, K] */
    const float *dweights = args->dweights;  /* [T, K] */
    float *dlogits = args->dlogits;          /* [T, E] */

    /* Every id is checked before any output is written. The routing forward never
     * drops a slot, so -1 is out of range here. Serial, so the error reported is
     * always the first bad (t, k). */
    for (int t = 0; t < T; t++) {
        const int32_t *id = ids + (int64_t)t * K;
        for (int k = 0; k < K; k++) {
            if (id[k] < 0 || id[k] >= E)
                return mf_fail(MOEFUSE_ERR_EXPERT_ID,
                               "%s.ids[%d][%d] = %d: expected 0 <= id < num_experts (%d)",
                               name, t, k, id[k], E);
            for (int k2 = 0; k2 < k; k2++)
                if (id[k2] == id[k])
                    return mf_fail(MOEFUSE_ERR_DUPLICATE_EXPERT,
                                   "%s.ids[%d][%d] = %d: expected no expert twice in a "
                                   "token (also at ids[%d][%d])",
                                   name, t, k, id[k], t, k2);
        }
    }

#pragma omp parallel for schedule(static)
    for (int t = 0; t < T; t++) {
        const float *l = logits + (int64_t)t * E;
        const int32_t *id = ids + (int64_t)t * K;
        const float *dw = dweights + (int64_t)t * K;
        float *dl = dlogits + (int64_t)t * E;
        softmax_parts r = topk_softmax(l, E, K, id);
        float s = 0.0f;
        for (int k = 0; k < K; k++) s += topk_weight(l, &r, id[k]) * dw[k];
        memset(dl, 0, (size_t)E * sizeof(float));
        for (int k = 0; k < K; k++) dl[id[k]] = topk_weight(l, &r, id[k]) * (dw[k] - s);
    }
    return MOEFUSE_OK;
}
