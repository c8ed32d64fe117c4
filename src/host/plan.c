/* The routing plan on the host: id checks, per-expert counts and offsets, the
 * slot <-> row maps. The CPU backend uses it directly; the GPU builds the same plan
 * with src/cuda/simt/moe_plan.cu, and the tests compare against this one. */
#include "internal.h"

#include <string.h>

int64_t mf_plan_max_rows(int num_tokens, int top_k, int num_local_experts, int row_align) {
    return (int64_t)num_tokens * top_k + (int64_t)num_local_experts * (row_align - 1);
}

moefuse_status mf_check_ids(const int32_t *ids, int num_tokens, int top_k, int num_experts) {
    for (int t = 0; t < num_tokens; t++) {
        const int32_t *row = ids + (int64_t)t * top_k; /* [K] */
        for (int k = 0; k < top_k; k++) {
            int32_t e = row[k];
            if (e < -1 || e >= num_experts)
                return mf_fail(MOEFUSE_ERR_EXPERT_ID,
                               "ids[%d][%d] = %d: expected -1 (dropped) or an expert in "
                               "[0, %d)", t, k, (int)e, num_experts);
            if (e < 0) continue;
            /* K is small (8 for Qwen3): the quadratic scan beats any set. */
            for (int j = 0; j < k; j++)
                if (row[j] == e)
                    return mf_fail(MOEFUSE_ERR_DUPLICATE_EXPERT,
                                   "ids[%d]: expert %d appears in slots %d and %d; "
                                   "expected each expert at most once per token",
                                   t, (int)e, j, k);
        }
    }
    return MOEFUSE_OK;
}

moefuse_status mf_plan_build(const int32_t *ids, int num_tokens, int top_k, int num_experts,
                             int expert_begin, int num_local_experts, int row_align,
                             mf_plan *plan) {
    moefuse_status st = mf_check_ids(ids, num_tokens, top_k, num_experts);
    if (st != MOEFUSE_OK) return st;
    if (row_align < 1) return mf_fail(MOEFUSE_ERR_INVALID_CONFIG, "row_align = %d: expected >= 1", row_align);

    int64_t num_slots = (int64_t)num_tokens * top_k;
    plan->num_tokens = num_tokens;
    plan->top_k = top_k;
    plan->expert_begin = expert_begin;
    plan->num_local_experts = num_local_experts;
    plan->row_align = row_align;

    /* Counting sort by expert, stable in slot order: the row order is a pure function
     * of ids, which is what makes every backend deterministic. */
    memset(plan->expert_counts, 0, sizeof(int32_t) * (size_t)num_local_experts);
    for (int64_t s = 0; s < num_slots; s++) {
        int e = ids[s] - expert_begin;
        if (ids[s] >= 0 && e >= 0 && e < num_local_experts) plan->expert_counts[e]++;
    }
    int32_t row = 0;
    for (int e = 0; e < num_local_experts; e++) {
        plan->expert_offsets[e] = row;
        int32_t padded = (plan->expert_counts[e] + row_align - 1) / row_align * row_align;
        row += padded;
    }
    plan->expert_offsets[num_local_experts] = row;
    plan->num_rows = row;

    for (int32_t r = 0; r < row; r++) plan->row_slot[r] = -1;
    /* expert_counts doubles as the fill cursor below, so rebuild it at the end. */
    for (int e = 0; e < num_local_experts; e++) plan->expert_counts[e] = 0;
    for (int64_t s = 0; s < num_slots; s++) {
        int e = ids[s] - expert_begin;
        if (ids[s] < 0 || e < 0 || e >= num_local_experts) {
            plan->slot_row[s] = -1;
            continue;
        }
        int32_t r = plan->expert_offsets[e] + plan->expert_counts[e]++;
        plan->slot_row[s] = r;
        plan->row_slot[r] = (int32_t)s;
    }
    return MOEFUSE_OK;
}
