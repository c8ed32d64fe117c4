/* The host routing plan: invariants on random and edge-case routings. */
#include "harness.h"
#include "plan_check.h"

#include <stdlib.h>

typedef struct {
    mf_plan plan;
    int32_t *ids;
} planned;

static planned make(int T, int K, int L, int align) {
    planned p = {0};
    int64_t rows = mf_plan_max_rows(T, K, L, align);
    p.ids = calloc((size_t)T * K + 1, sizeof(int32_t));
    p.plan.expert_counts = calloc((size_t)L, sizeof(int32_t));
    p.plan.expert_offsets = calloc((size_t)L + 1, sizeof(int32_t));
    p.plan.slot_row = calloc((size_t)T * K + 1, sizeof(int32_t));
    p.plan.row_slot = calloc((size_t)rows + 1, sizeof(int32_t));
    return p;
}

static void release(planned *p) {
    free(p->ids);
    free(p->plan.expert_counts);
    free(p->plan.expert_offsets);
    free(p->plan.slot_row);
    free(p->plan.row_slot);
}

/* Distinct experts per token, some dropped; `hot` > 0 sends every slot it can to the
 * first `hot` experts. */
static void route(int32_t *ids, int T, int K, int E, double drop, int hot) {
    for (int t = 0; t < T; t++)
        for (int k = 0; k < K; k++) {
            int32_t e;
            int again;
            do {
                e = (hot > 0 && k < hot) ? k : th_rand_int(0, E - 1);
                again = 0;
                for (int j = 0; j < k; j++) again |= ids[t * K + j] == e;
            } while (again);
            ids[t * K + k] = th_uniform() < drop ? -1 : e;
        }
}

static void check_case(int T, int K, int E, int R, int rank, int align, double drop, int hot) {
    int L = E / R;
    planned p = make(T, K, L, align);
    route(p.ids, T, K, E, drop, hot);
    moefuse_status st = mf_plan_build(p.ids, T, K, E, rank * L, L, align, &p.plan);
    CHECK(st == MOEFUSE_OK, "plan_build: %s", moefuse_last_error());
    const char *bad = st == MOEFUSE_OK ? plan_check(&p.plan, p.ids, E) : NULL;
    CHECK(bad == NULL, "T=%d K=%d E=%d R=%d rank=%d align=%d: %s", T, K, E, R, rank, align, bad);
    release(&p);
}

static void test_random_plans(void) {
    for (int i = 0; i < 200; i++) {
        int E = 1 << th_rand_int(0, 7), K = th_rand_int(1, E < 8 ? E : 8);
        int R = 1 << th_rand_int(0, 3);
        if (R > E) R = E;
        check_case(th_rand_int(0, 300), K, E, R, th_rand_int(0, R - 1), th_rand_int(1, 130),
                   th_uniform() * 0.3, 0);
    }
}

static void test_edge_plans(void) {
    check_case(1, 8, 128, 1, 0, 128, 0, 0);       /* T = 1 */
    check_case(0, 8, 128, 1, 0, 128, 0, 0);       /* T = 0 */
    check_case(500, 1, 128, 1, 0, 128, 0, 1);     /* all tokens on expert 0 */
    check_case(500, 8, 128, 1, 0, 1, 0, 8);       /* most experts empty */
    check_case(64, 8, 128, 1, 0, 128, 1.0, 0);    /* every slot dropped */
    check_case(64, 4, 8, 8, 7, 128, 0.1, 0);      /* one expert per rank */
}

static void test_bad_ids_leave_error(void) {
    planned p = make(2, 2, 4, 1);
    int32_t ids[4] = {0, 1, 2, 4};
    CHECK(mf_plan_build(ids, 2, 2, 4, 0, 4, 1, &p.plan) == MOEFUSE_ERR_EXPERT_ID, "id 4 of 4");
    int32_t dup[4] = {0, 1, 3, 3};
    CHECK(mf_plan_build(dup, 2, 2, 4, 0, 4, 1, &p.plan) == MOEFUSE_ERR_DUPLICATE_EXPERT, "dup");
    int32_t dropped_twice[4] = {-1, -1, 3, 2};
    CHECK(mf_plan_build(dropped_twice, 2, 2, 4, 0, 4, 1, &p.plan) == MOEFUSE_OK,
          "two dropped slots in a token are not duplicates: %s", moefuse_last_error());
    release(&p);
}

int main(void) {
    th_seed_from_env_or_clock();
    th_run("random plans keep every invariant", test_random_plans);
    th_run("edge-case plans", test_edge_plans);
    th_run("bad ids are refused", test_bad_ids_leave_error);
    return th_finish();
}
