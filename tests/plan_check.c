#include "plan_check.h"

#include <stdio.h>

const char *plan_check(const mf_plan *plan, const int32_t *ids, int num_experts) {
    static _Thread_local char msg[256];
    int64_t num_slots = (int64_t)plan->num_tokens * plan->top_k;
    int L = plan->num_local_experts, A = plan->row_align;
    (void)num_experts;
    if (plan->expert_offsets[0] != 0) return "expert_offsets[0] != 0";
    for (int e = 0; e < L; e++) {
        int32_t begin = plan->expert_offsets[e], end = plan->expert_offsets[e + 1];
        if (begin % A != 0) return "a segment does not start on row_align";
        if (end - begin < plan->expert_counts[e]) return "a segment is shorter than its count";
        if (end - begin >= plan->expert_counts[e] + A) return "a segment has a whole padding block";
        int64_t want = 0;
        for (int64_t s = 0; s < num_slots; s++) want += ids[s] == plan->expert_begin + e;
        if (want != plan->expert_counts[e]) {
            snprintf(msg, sizeof msg, "expert_counts[%d] = %d, expected %lld", e,
                     plan->expert_counts[e], (long long)want);
            return msg;
        }
        /* Rows of one expert: first the routed slots in increasing slot order, then padding. */
        int32_t last = -1;
        for (int32_t r = begin; r < end; r++) {
            int32_t s = plan->row_slot[r];
            if (r - begin < plan->expert_counts[e]) {
                if (s <= last) return "rows of an expert are not in increasing slot order";
                if (s < 0 || s >= num_slots || ids[s] != plan->expert_begin + e)
                    return "row_slot points at a slot of another expert";
                if (plan->slot_row[s] != r) return "slot_row and row_slot are not inverse";
                last = s;
            } else if (s != -1) {
                return "a padding row has row_slot != -1";
            }
        }
    }
    if (plan->num_rows != plan->expert_offsets[L]) return "num_rows != expert_offsets[L]";
    if (plan->num_rows > mf_plan_max_rows(plan->num_tokens, plan->top_k, L, A))
        return "num_rows above mf_plan_max_rows";
    for (int64_t s = 0; s < num_slots; s++) {
        int local = ids[s] >= 0 && ids[s] >= plan->expert_begin && ids[s] < plan->expert_begin + L;
        if (!local && plan->slot_row[s] != -1) return "a dropped or remote slot has a row";
        if (local && plan->slot_row[s] < 0) return "a local slot has no row";
    }
    return NULL;
}
