/* libFuzzer target: arbitrary bytes become a routing (shape, ids, T) and a tiny CPU
 * layer. mf_plan_build must either refuse the ids with the right status or build a
 * plan that keeps every invariant; the public forward must agree with it on which
 * routings are valid, and never read or write outside the buffers (ASan/UBSan). */
#include "moefuse.h"
#include "plan_check.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { H = 16, I = 8 };

static int read_byte(const uint8_t **d, size_t *n) {
    if (*n == 0) return 0;
    (*n)--;
    return *(*d)++;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    int E = 1 + read_byte(&data, &size) % 16;
    int K = 1 + read_byte(&data, &size) % E;
    int R = 1 << (read_byte(&data, &size) % 3);
    if (E % R) R = 1;
    int rank = read_byte(&data, &size) % R;
    int align = 1 + read_byte(&data, &size) % 9;
    int T = (int)(size / (size_t)K);
    if (T > 64) T = 64;
    int L = E / R;

    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(T * K + 1));
    for (int s = 0; s < T * K; s++) ids[s] = (int32_t)(int8_t)data[s] % (E + 2);

    mf_plan plan = {0};
    plan.expert_counts = malloc(sizeof(int32_t) * (size_t)L);
    plan.expert_offsets = malloc(sizeof(int32_t) * (size_t)(L + 1));
    plan.slot_row = malloc(sizeof(int32_t) * (size_t)(T * K + 1));
    plan.row_slot = malloc(sizeof(int32_t) * (size_t)(mf_plan_max_rows(T, K, L, align) + 1));
    moefuse_status st = mf_plan_build(ids, T, K, E, rank * L, L, align, &plan);
    if (st == MOEFUSE_OK) {
        const char *bad = plan_check(&plan, ids, E);
        if (bad) {
            fprintf(stderr, "plan invariant broken: %s\n", bad);
            abort();
        }
    } else if (st != MOEFUSE_ERR_EXPERT_ID && st != MOEFUSE_ERR_DUPLICATE_EXPERT) {
        fprintf(stderr, "unexpected status %s\n", moefuse_status_string(st));
        abort();
    }

    /* The public forward validates the same ids the same way (R = 1 layer). */
    moefuse_config cfg;
    moefuse_config_init(&cfg, H, I, E, K, 64);
    cfg.num_threads = 1;
    moefuse_layer *layer = NULL;
    if (moefuse_layer_create(&cfg, NULL, &layer) != MOEFUSE_OK) abort();
    uint16_t *x = calloc((size_t)T * H + 1, 2), *y = malloc((size_t)T * H * 2 + 2);
    uint16_t *w13 = calloc((size_t)E * 2 * I * H, 2), *w2 = calloc((size_t)E * H * I, 2);
    float *p = calloc((size_t)T * K + 1, sizeof(float));
    memset(y, 0x5a, (size_t)T * H * 2 + 2);
    moefuse_fwd_args fa = {.num_tokens = T, .x = x, .x_stride = H, .ids = ids, .weights = p,
                           .w13 = w13, .w2 = w2, .y = y, .y_stride = H};
    moefuse_status fst = moefuse_forward(layer, &fa, NULL);
    if (fst != st) {
        fprintf(stderr, "forward says %s, plan says %s\n", moefuse_status_string(fst),
                moefuse_status_string(st));
        abort();
    }
    if (fst != MOEFUSE_OK)
        for (size_t i = 0; i < (size_t)T * H; i++)
            if (y[i] != 0x5a5a) abort(); /* a rejected call wrote y */
    moefuse_layer_destroy(layer);
    free(x); free(y); free(w13); free(w2); free(p);
    free(ids);
    free(plan.expert_counts); free(plan.expert_offsets); free(plan.slot_row); free(plan.row_slot);
    return 0;
}
