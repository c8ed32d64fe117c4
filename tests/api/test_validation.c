/* Every validation error of the public API: each returns its own status, names the
 * argument in moefuse_last_error(), and leaves every output untouched. */
#include "harness.h"
#include "internal.h"
#include "moefuse.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { H = 64, I = 32, E = 8, K = 2, TMAX = 6 };

/* One set of buffers, outputs poisoned with a byte pattern that no kernel writes. */
typedef struct {
    moefuse_layer *layer;
    uint16_t x[TMAX * H], y[TMAX * H], dy[TMAX * H], dx[TMAX * H];
    uint16_t w13[E * 2 * I * H], w2[E * H * I];
    int32_t ids[TMAX * K], counts[E];
    float p[TMAX * K], dp[TMAX * K];
    float dw13[E * 2 * I * H], dw2[E * H * I];
    uint16_t dw13_bf16[E * 2 * I * H], dw2_bf16[E * H * I];
    void *saved;
    size_t saved_bytes;
    moefuse_fwd_args fa;
    moefuse_bwd_args ba;
} fixture;

#define POISON 0xA5

static void poison_outputs(fixture *f) {
    memset(f->y, POISON, sizeof f->y);
    memset(f->dx, POISON, sizeof f->dx);
    memset(f->dp, POISON, sizeof f->dp);
    memset(f->dw13, POISON, sizeof f->dw13);
    memset(f->dw2, POISON, sizeof f->dw2);
    memset(f->dw13_bf16, POISON, sizeof f->dw13_bf16);
    memset(f->dw2_bf16, POISON, sizeof f->dw2_bf16);
    memset(f->counts, POISON, sizeof f->counts);
}

static int all_bytes(const void *p, size_t n, unsigned char v) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        if (b[i] != v) return 0;
    return 1;
}

static int outputs_untouched(const fixture *f) {
    return all_bytes(f->y, sizeof f->y, POISON) && all_bytes(f->dx, sizeof f->dx, POISON) &&
           all_bytes(f->dp, sizeof f->dp, POISON) && all_bytes(f->dw13, sizeof f->dw13, POISON) &&
           all_bytes(f->dw2, sizeof f->dw2, POISON) &&
           all_bytes(f->dw13_bf16, sizeof f->dw13_bf16, POISON) &&
           all_bytes(f->dw2_bf16, sizeof f->dw2_bf16, POISON) &&
           all_bytes(f->counts, sizeof f->counts, POISON);
}

static fixture *fixture_new(void) {
    fixture *f = calloc(1, sizeof *f);
    moefuse_config cfg;
    moefuse_config_init(&cfg, H, I, E, K, TMAX);
    if (moefuse_layer_create(&cfg, NULL, &f->layer) != MOEFUSE_OK) {
        printf("  layer_create failed: %s\n", moefuse_last_error());
        free(f);
        return NULL;
    }
    size_t bytes = 0;
    moefuse_saved_bytes(f->layer, TMAX, &bytes);
    f->saved_bytes = bytes;
    f->saved = aligned_alloc(256, (bytes + 255) / 256 * 256 + 256);
    th_fill_bf16_normal(f->x, NULL, TMAX * H, 1.0);
    th_fill_bf16_normal(f->dy, NULL, TMAX * H, 1.0);
    th_fill_bf16_normal(f->w13, NULL, E * 2 * I * H, 0.125);
    th_fill_bf16_normal(f->w2, NULL, E * H * I, 0.125);
    for (int t = 0; t < TMAX; t++) {
        int e0 = th_rand_int(0, E - 1);
        f->ids[t * K] = e0;
        f->ids[t * K + 1] = (e0 + th_rand_int(1, E - 1)) % E;
        f->p[t * K] = 0.75f;
        f->p[t * K + 1] = 0.25f;
    }
    f->fa = (moefuse_fwd_args){.num_tokens = TMAX, .x = f->x, .x_stride = H, .ids = f->ids,
                               .weights = f->p, .w13 = f->w13, .w2 = f->w2, .y = f->y,
                               .y_stride = H, .saved = f->saved, .expert_counts = f->counts};
    f->ba = (moefuse_bwd_args){.num_tokens = TMAX, .x = f->x, .x_stride = H, .ids = f->ids,
                               .weights = f->p, .w13 = f->w13, .w2 = f->w2, .saved = f->saved,
                               .saved_bytes = bytes, .dy = f->dy, .dy_stride = H, .dx = f->dx, .dx_stride = H,
                               .dweights = f->dp, .dw13 = f->dw13, .dw2 = f->dw2};
    poison_outputs(f);
    return f;
}

static void fixture_free(fixture *f) {
    if (!f) return;
    moefuse_layer_destroy(f->layer);
    free(f->saved);
    free(f);
}

/* Runs a forward whose args were spoiled by `spoil`, expects `want` and a message
 * that contains `needle`. The saved buffer is written by a valid forward first, so a
 * spoiled backward is checked the same way. */
static void expect_fwd(moefuse_status want, const char *needle, void (*spoil)(fixture *)) {
    fixture *f = fixture_new();
    CHECK(f != NULL, "fixture");
    if (!f) return;
    spoil(f);
    moefuse_status st = moefuse_forward(f->layer, &f->fa, NULL);
    CHECK(st == want, "forward returned %s, expected %s (%s)", moefuse_status_string(st),
          moefuse_status_string(want), moefuse_last_error());
    CHECK(strstr(moefuse_last_error(), needle) != NULL, "message '%s' should name '%s'",
          moefuse_last_error(), needle);
    if (want != MOEFUSE_OK)
        CHECK(outputs_untouched(f), "an output was written by a rejected forward");
    fixture_free(f);
}

static void expect_bwd(moefuse_status want, const char *needle, void (*spoil)(fixture *)) {
    fixture *f = fixture_new();
    CHECK(f != NULL, "fixture");
    if (!f) return;
    moefuse_status st = moefuse_forward(f->layer, &f->fa, NULL);
    CHECK(st == MOEFUSE_OK, "valid forward: %s", moefuse_last_error());
    poison_outputs(f);
    spoil(f);
    st = moefuse_backward(f->layer, &f->ba, NULL);
    CHECK(st == want, "backward returned %s, expected %s (%s)", moefuse_status_string(st),
          moefuse_status_string(want), moefuse_last_error());
    CHECK(strstr(moefuse_last_error(), needle) != NULL, "message '%s' should name '%s'",
          moefuse_last_error(), needle);
    CHECK(outputs_untouched(f), "an output was written by a rejected backward");
    fixture_free(f);
}

static void nothing(fixture *f) { (void)f; }
static void null_x(fixture *f) { f->fa.x = NULL; }
static void null_ids(fixture *f) { f->fa.ids = NULL; }
static void null_weights(fixture *f) { f->fa.weights = NULL; }
static void null_w13(fixture *f) { f->fa.w13 = NULL; }
static void null_w2(fixture *f) { f->fa.w2 = NULL; }
static void null_y(fixture *f) { f->fa.y = NULL; }
static void odd_x(fixture *f) { f->fa.x = (const uint16_t *)((const char *)f->x + 1); }
static void odd_ids(fixture *f) { f->fa.ids = (const int32_t *)((const char *)f->ids + 2); }
static void odd_saved(fixture *f) { f->fa.saved = (char *)f->saved + 16; }
static void short_stride(fixture *f) { f->fa.x_stride = H - 1; }
static void short_y_stride(fixture *f) { f->fa.y_stride = 0; }
static void negative_t(fixture *f) { f->fa.num_tokens = -1; }
static void too_many(fixture *f) { f->fa.num_tokens = TMAX + 1; }
static void id_high(fixture *f) { f->ids[3 * K + 1] = E; }
static void id_low(fixture *f) { f->ids[2 * K] = -2; }
static void id_dup(fixture *f) { f->ids[4 * K + 1] = f->ids[4 * K]; }

static void bwd_null_saved(fixture *f) { f->ba.saved = NULL; }
static void bwd_null_dy(fixture *f) { f->ba.dy = NULL; }
static void bwd_null_dx(fixture *f) { f->ba.dx = NULL; }
static void bwd_null_dp(fixture *f) { f->ba.dweights = NULL; }
static void bwd_null_dw13(fixture *f) { f->ba.dw13 = NULL; }
static void bwd_null_dw2(fixture *f) { f->ba.dw2 = NULL; }
static void bwd_odd_dw2(fixture *f) { f->ba.dw2 = (float *)((char *)f->dw2 + 2); }
static void bwd_short_dx_stride(fixture *f) { f->ba.dx_stride = H / 2; }
static void bwd_id_high(fixture *f) { f->ids[0] = 1000; }
static void bwd_id_dup(fixture *f) { f->ids[1] = f->ids[0]; }
static void bwd_accumulate(fixture *f) { f->ba.accumulate = 2; }
static void bwd_too_many(fixture *f) { f->ba.num_tokens = TMAX + 5; }
static void bwd_short_saved(fixture *f) { f->ba.saved_bytes = f->saved_bytes - 1; }
static void bwd_no_saved_size(fixture *f) { f->ba.saved_bytes = 0; }

/* The weight gradients in bf16: dw13_bf16 and dw2_bf16 instead of dw13 and dw2. */
static void use_bf16_wgrads(fixture *f) {
    f->ba.dw13 = NULL;
    f->ba.dw2 = NULL;
    f->ba.dw13_bf16 = f->dw13_bf16;
    f->ba.dw2_bf16 = f->dw2_bf16;
}
static void bwd_no_wgrads(fixture *f) { f->ba.dw13 = NULL; f->ba.dw2 = NULL; }
static void bwd_both_pairs(fixture *f) {
    f->ba.dw13_bf16 = f->dw13_bf16;
    f->ba.dw2_bf16 = f->dw2_bf16;
}
static void bwd_bf16_with_dw2(fixture *f) { use_bf16_wgrads(f); f->ba.dw2 = f->dw2; }
static void bwd_bf16_pair_and_dw13(fixture *f) { use_bf16_wgrads(f); f->ba.dw13 = f->dw13; }
static void bwd_only_dw13_bf16(fixture *f) { use_bf16_wgrads(f); f->ba.dw2_bf16 = NULL; }
static void bwd_only_dw2_bf16(fixture *f) { use_bf16_wgrads(f); f->ba.dw13_bf16 = NULL; }
static void bwd_odd_dw2_bf16(fixture *f) {
    use_bf16_wgrads(f);
    f->ba.dw2_bf16 = (uint16_t *)((char *)f->dw2_bf16 + 1);
}
static void bwd_bf16_accumulate(fixture *f) { use_bf16_wgrads(f); f->ba.accumulate = 1; }
/* The fp32 pair and one stray bf16 pointer: refused, not the stray pointer ignored. */
static void bwd_fp32_pair_and_dw13_bf16(fixture *f) { f->ba.dw13_bf16 = f->dw13_bf16; }

/* W13 in two halves: the fixture's w13 and dW13 buffers hold both halves (gate in the
 * first E*I*H elements, up in the rest). */
static void use_halves(fixture *f) {
    f->fa.w13_up = f->w13 + E * I * H;
    f->ba.w13_up = f->w13 + E * I * H;
    f->ba.dw13_up = f->dw13 + E * I * H;
}
static void fwd_odd_w13_up(fixture *f) { f->fa.w13_up = (const uint16_t *)((const char *)f->w13 + 1); }
static void bwd_up_without_dw13_up(fixture *f) { use_halves(f); f->ba.dw13_up = NULL; }
static void bwd_dw13_up_without_up(fixture *f) { use_halves(f); f->ba.w13_up = NULL; }
static void bwd_halves_bf16_without_up(fixture *f) {
    use_halves(f);
    use_bf16_wgrads(f);
    f->ba.dw13_up = NULL;
}
static void bwd_halves_bf16_fp32_up(fixture *f) { use_halves(f); use_bf16_wgrads(f); }
static void bwd_odd_dw13_up(fixture *f) { use_halves(f); f->ba.dw13_up = (float *)((char *)f->dw13 + 2); }

static void test_valid_calls_pass(void) {
    fixture *f = fixture_new();
    CHECK(f != NULL, "fixture");
    if (!f) return;
    CHECK(moefuse_forward(f->layer, &f->fa, NULL) == MOEFUSE_OK, "%s", moefuse_last_error());
    CHECK(moefuse_last_error()[0] == '\0', "a successful call leaves an empty message");
    CHECK(moefuse_backward(f->layer, &f->ba, NULL) == MOEFUSE_OK, "%s", moefuse_last_error());
    CHECK(moefuse_layer_check(f->layer, NULL) == MOEFUSE_OK, "%s", moefuse_last_error());
    /* the bf16 weight gradients: written, and the fp32 buffers (not passed) untouched */
    poison_outputs(f);
    use_bf16_wgrads(f);
    CHECK(moefuse_backward(f->layer, &f->ba, NULL) == MOEFUSE_OK, "bf16 weight gradients: %s",
          moefuse_last_error());
    CHECK(!all_bytes(f->dw13_bf16, sizeof f->dw13_bf16, POISON) &&
          !all_bytes(f->dw2_bf16, sizeof f->dw2_bf16, POISON), "bf16 weight gradients not written");
    CHECK(all_bytes(f->dw13, sizeof f->dw13, POISON) && all_bytes(f->dw2, sizeof f->dw2, POISON),
          "a bf16-gradient backward wrote dw13 / dw2");
    fixture_free(f);
    expect_fwd(MOEFUSE_OK, "", nothing);
}

static void test_forward_null_pointers(void) {
    expect_fwd(MOEFUSE_ERR_NULL_POINTER, "fwd_args.x", null_x);
    expect_fwd(MOEFUSE_ERR_NULL_POINTER, "fwd_args.ids", null_ids);
    expect_fwd(MOEFUSE_ERR_NULL_POINTER, "fwd_args.weights", null_weights);
    expect_fwd(MOEFUSE_ERR_NULL_POINTER, "fwd_args.w13", null_w13);
    expect_fwd(MOEFUSE_ERR_NULL_POINTER, "fwd_args.w2", null_w2);
    expect_fwd(MOEFUSE_ERR_NULL_POINTER, "fwd_args.y", null_y);
    CHECK(moefuse_forward(NULL, NULL, NULL) == MOEFUSE_ERR_NULL_POINTER, "NULL layer");
}

static void test_forward_misaligned(void) {
    expect_fwd(MOEFUSE_ERR_MISALIGNED, "fwd_args.x", odd_x);
    expect_fwd(MOEFUSE_ERR_MISALIGNED, "fwd_args.ids", odd_ids);
    expect_fwd(MOEFUSE_ERR_MISALIGNED, "fwd_args.saved", odd_saved);
}

static void test_forward_shapes(void) {
    expect_fwd(MOEFUSE_ERR_SHAPE, "fwd_args.x_stride", short_stride);
    expect_fwd(MOEFUSE_ERR_SHAPE, "fwd_args.y_stride", short_y_stride);
    expect_fwd(MOEFUSE_ERR_SHAPE, "fwd_args.num_tokens", negative_t);
    expect_fwd(MOEFUSE_ERR_TOO_MANY_TOKENS, "max_tokens", too_many);
}

static void test_forward_expert_ids(void) {
    expect_fwd(MOEFUSE_ERR_EXPERT_ID, "ids[3][1] = 8", id_high);
    expect_fwd(MOEFUSE_ERR_EXPERT_ID, "ids[2][0] = -2", id_low);
    expect_fwd(MOEFUSE_ERR_DUPLICATE_EXPERT, "ids[4]", id_dup);
}

static void test_backward_errors(void) {
    expect_bwd(MOEFUSE_ERR_NULL_POINTER, "bwd_args.saved", bwd_null_saved);
    expect_bwd(MOEFUSE_ERR_NULL_POINTER, "bwd_args.dy", bwd_null_dy);
    expect_bwd(MOEFUSE_ERR_NULL_POINTER, "bwd_args.dx", bwd_null_dx);
    expect_bwd(MOEFUSE_ERR_NULL_POINTER, "bwd_args.dweights", bwd_null_dp);
    expect_bwd(MOEFUSE_ERR_NULL_POINTER, "bwd_args.dw13", bwd_null_dw13);
    expect_bwd(MOEFUSE_ERR_NULL_POINTER, "bwd_args.dw2", bwd_null_dw2);
    expect_bwd(MOEFUSE_ERR_MISALIGNED, "bwd_args.dw2", bwd_odd_dw2);
    expect_bwd(MOEFUSE_ERR_SHAPE, "bwd_args.dx_stride", bwd_short_dx_stride);
    expect_bwd(MOEFUSE_ERR_EXPERT_ID, "ids[0][0] = 1000", bwd_id_high);
    expect_bwd(MOEFUSE_ERR_DUPLICATE_EXPERT, "ids[0]", bwd_id_dup);
    expect_bwd(MOEFUSE_ERR_INVALID_CONFIG, "bwd_args.accumulate", bwd_accumulate);
    expect_bwd(MOEFUSE_ERR_TOO_MANY_TOKENS, "bwd_args.num_tokens", bwd_too_many);
    char want[96];
    fixture *f = fixture_new();
    CHECK(f != NULL, "fixture");
    if (!f) return;
    snprintf(want, sizeof want, "bwd_args.saved_bytes = %zu: expected >= %zu", f->saved_bytes - 1,
             f->saved_bytes);
    fixture_free(f);
    expect_bwd(MOEFUSE_ERR_SHAPE, want, bwd_short_saved);
    expect_bwd(MOEFUSE_ERR_SHAPE, "bwd_args.saved_bytes = 0", bwd_no_saved_size);
}

/* Exactly one whole pair of weight-gradient outputs, the bf16 pair in write mode only. */
static void test_backward_wgrad_outputs(void) {
    expect_bwd(MOEFUSE_ERR_NULL_POINTER, "bwd_args.dw13: expected a non-NULL pointer",
               bwd_no_wgrads);
    expect_bwd(MOEFUSE_ERR_INVALID_CONFIG, "bwd_args.dw13 = ", bwd_both_pairs);
    expect_bwd(MOEFUSE_ERR_INVALID_CONFIG, "bwd_args.dw13 = ", bwd_fp32_pair_and_dw13_bf16);
    expect_bwd(MOEFUSE_ERR_INVALID_CONFIG, "bwd_args.dw2 = ", bwd_bf16_with_dw2);
    expect_bwd(MOEFUSE_ERR_INVALID_CONFIG, "bwd_args.dw13 = ", bwd_bf16_pair_and_dw13);
    expect_bwd(MOEFUSE_ERR_NULL_POINTER, "bwd_args.dw2_bf16: NULL", bwd_only_dw13_bf16);
    expect_bwd(MOEFUSE_ERR_NULL_POINTER, "bwd_args.dw13_bf16: NULL", bwd_only_dw2_bf16);
    expect_bwd(MOEFUSE_ERR_MISALIGNED, "bwd_args.dw2_bf16", bwd_odd_dw2_bf16);
    expect_bwd(MOEFUSE_ERR_INVALID_CONFIG, "accumulate needs the fp32 buffers",
               bwd_bf16_accumulate);
}

/* W13 in two halves: the up half of dW13 beside dw13 (or dw13_bf16) exactly when w13_up
 * is set. */
static void test_w13_halves(void) {
    expect_fwd(MOEFUSE_OK, "", use_halves);
    fixture *f = fixture_new();
    CHECK(f != NULL, "fixture");
    if (!f) return;
    use_halves(f);
    CHECK(moefuse_forward(f->layer, &f->fa, NULL) == MOEFUSE_OK, "%s", moefuse_last_error());
    CHECK(moefuse_backward(f->layer, &f->ba, NULL) == MOEFUSE_OK, "%s", moefuse_last_error());
    fixture_free(f);
    expect_fwd(MOEFUSE_ERR_MISALIGNED, "fwd_args.w13_up", fwd_odd_w13_up);
    expect_bwd(MOEFUSE_ERR_NULL_POINTER, "bwd_args.dw13_up: NULL while bwd_args.w13_up",
               bwd_up_without_dw13_up);
    expect_bwd(MOEFUSE_ERR_INVALID_CONFIG, "bwd_args.dw13_up = ", bwd_dw13_up_without_up);
    expect_bwd(MOEFUSE_ERR_NULL_POINTER, "bwd_args.dw13_up_bf16: NULL",
               bwd_halves_bf16_without_up);
    expect_bwd(MOEFUSE_ERR_INVALID_CONFIG, "bwd_args.dw13_up = ", bwd_halves_bf16_fp32_up);
    expect_bwd(MOEFUSE_ERR_MISALIGNED, "bwd_args.dw13_up", bwd_odd_dw13_up);
}

/* Config errors: each field out of range gets INVALID_CONFIG (or UNSUPPORTED for
 * what is valid but not built) and no layer. */
static void expect_config(moefuse_status want, const char *needle, moefuse_config cfg) {
    moefuse_layer *layer = (moefuse_layer *)0x1;
    moefuse_status st = moefuse_layer_create(&cfg, NULL, &layer);
    CHECK(st == want, "create returned %s, expected %s (%s)", moefuse_status_string(st),
          moefuse_status_string(want), moefuse_last_error());
    CHECK(strstr(moefuse_last_error(), needle) != NULL, "message '%s' should name '%s'",
          moefuse_last_error(), needle);
    CHECK(layer == (moefuse_layer *)0x1, "out must be untouched on failure");
}

static void test_config_errors(void) {
    moefuse_config base, c;
    moefuse_config_init(&base, H, I, E, K, TMAX);
    c = base; c.hidden = 0; expect_config(MOEFUSE_ERR_INVALID_CONFIG, "config.hidden", c);
    c = base; c.intermediate = -3; expect_config(MOEFUSE_ERR_INVALID_CONFIG, "config.intermediate", c);
    c = base; c.num_experts = 0; expect_config(MOEFUSE_ERR_INVALID_CONFIG, "config.num_experts", c);
    c = base; c.top_k = E + 1; expect_config(MOEFUSE_ERR_INVALID_CONFIG, "config.top_k", c);
    c = base; c.top_k = 0; expect_config(MOEFUSE_ERR_INVALID_CONFIG, "config.top_k", c);
    c = base; c.max_tokens = 0; expect_config(MOEFUSE_ERR_INVALID_CONFIG, "config.max_tokens", c);
    c = base; c.num_ranks = 3; expect_config(MOEFUSE_ERR_INVALID_CONFIG, "num_ranks (3)", c);
    c = base; c.num_ranks = 2; c.rank = 2; expect_config(MOEFUSE_ERR_INVALID_CONFIG, "config.rank", c);
    c = base; c.num_ranks = 2; expect_config(MOEFUSE_ERR_INVALID_CONFIG, "moefuse_comm", c);
    c = base; c.num_threads = -1; expect_config(MOEFUSE_ERR_INVALID_CONFIG, "config.num_threads", c);
    c = base; c.saved_mode = 7; expect_config(MOEFUSE_ERR_INVALID_CONFIG, "config.saved_mode", c);
    c = base; c.pipeline = (moefuse_pipeline)2; expect_config(MOEFUSE_ERR_INVALID_CONFIG, "config.pipeline", c);
    c = base; c.fp8_pow2_scales = 1; expect_config(MOEFUSE_ERR_INVALID_CONFIG, "fp8_pow2_scales", c);
    c = base; c.precision = MOEFUSE_PRECISION_FP8_BLOCK; c.fp8_pow2_scales = 2;
    expect_config(MOEFUSE_ERR_INVALID_CONFIG, "fp8_pow2_scales", c);
    c = base; c.precision = 9; expect_config(MOEFUSE_ERR_UNSUPPORTED, "config.precision", c);
    c = base; c.backend = 5; expect_config(MOEFUSE_ERR_UNSUPPORTED, "config.backend", c);
    c = base; c.max_tokens = 1 << 30; c.hidden = 1 << 16;
    expect_config(MOEFUSE_ERR_INVALID_CONFIG, "2^40", c);
    /* plan rows are int32: max_tokens * K * R rows (plus padding) must fit, even where
     * the buffers' bytes would (H = I = 8 here) */
    c = base; c.max_tokens = 1 << 30; c.hidden = 8; c.intermediate = 8;
    expect_config(MOEFUSE_ERR_INVALID_CONFIG, "max_tokens (1073741824) * top_k (2)", c);
    c = base; c.max_tokens = (INT32_MAX - 512) / 2; c.hidden = 8; c.intermediate = 8; /* the padding */
    expect_config(MOEFUSE_ERR_INVALID_CONFIG, "INT32_MAX", c);
    moefuse_layer *layer;
    CHECK(moefuse_layer_create(NULL, NULL, &layer) == MOEFUSE_ERR_NULL_POINTER, "NULL cfg");
    CHECK(moefuse_layer_create(&base, NULL, NULL) == MOEFUSE_ERR_NULL_POINTER, "NULL out");
    CHECK(moefuse_layer_destroy(NULL) == MOEFUSE_OK, "destroy(NULL) is allowed");
}

/* Whether this process can create a CUDA layer (an sm_90 GPU and a build with CUDA). */
static int cuda_layer_possible(void) {
    moefuse_config cfg;
    moefuse_config_init(&cfg, 128, 128, E, K, TMAX);
    cfg.backend = MOEFUSE_BACKEND_CUDA;
    moefuse_layer *layer = NULL;
    if (moefuse_layer_create(&cfg, NULL, &layer) != MOEFUSE_OK) return 0;
    moefuse_layer_destroy(layer);
    return 1;
}

/* The comm of expert parallelism: its own checks, and those of a layer made with it.
 * (The CUDA backend's use of it is tested in tests/api/test_cuda_ep.c.) */
static void test_comm_errors(void) {
    moefuse_comm *comm = (moefuse_comm *)0x1;
    CHECK(moefuse_comm_create_virtual(0, &comm) == MOEFUSE_ERR_INVALID_CONFIG, "0 ranks");
    CHECK(comm == NULL, "out is NULL on failure");
    CHECK(moefuse_comm_create_virtual(65, &comm) == MOEFUSE_ERR_INVALID_CONFIG, "65 ranks");
    CHECK(strstr(moefuse_last_error(), "num_ranks") != NULL, "%s", moefuse_last_error());
    CHECK(moefuse_comm_create_virtual(2, NULL) == MOEFUSE_ERR_NULL_POINTER, "NULL out");
    CHECK(moefuse_comm_set_timeout_ms(NULL, 5) == MOEFUSE_ERR_NULL_POINTER, "NULL comm");
    CHECK(moefuse_comm_destroy(NULL) == MOEFUSE_OK, "destroy(NULL) is allowed");
    /* Virtual ranks run on a GPU: without one the comm is refused, as a CUDA layer is. */
    const int gpu = cuda_layer_possible();
    comm = (moefuse_comm *)0x1;
    moefuse_status st = moefuse_comm_create_virtual(2, &comm);
    if (gpu) {
        CHECK(st == MOEFUSE_OK, "%s", moefuse_last_error());
        moefuse_comm_destroy(comm);
    } else {
        CHECK(st == MOEFUSE_ERR_UNSUPPORTED, "virtual comm without a GPU: got %s (%s)",
              moefuse_status_string(st), moefuse_last_error());
        CHECK(strstr(moefuse_last_error(), "moefuse_comm_create_virtual") != NULL, "%s",
              moefuse_last_error());
        CHECK(comm == NULL, "out is NULL on failure");
    }
    /* The checks of a layer made with a comm, on a comm made by hand (so they run
     * without a GPU too). */
    comm = calloc(1, sizeof *comm);
    if (!comm) return;
    comm->kind = MF_COMM_VIRTUAL;
    comm->num_ranks = 2;
    comm->timeout_ms = 30000;
    CHECK(moefuse_comm_set_timeout_ms(comm, 0) == MOEFUSE_ERR_INVALID_CONFIG, "timeout 0");
    CHECK(moefuse_comm_set_timeout_ms(comm, 250) == MOEFUSE_OK, "%s", moefuse_last_error());

    moefuse_config c;
    moefuse_config_init(&c, H, I, E, K, TMAX);
    moefuse_layer *layer = (moefuse_layer *)0x1;
    /* R must match the comm's; EP runs on the CUDA backend */
    CHECK(moefuse_layer_create(&c, comm, &layer) == MOEFUSE_ERR_INVALID_CONFIG, "R = 1, comm of 2");
    CHECK(strstr(moefuse_last_error(), "comm has 2 ranks") != NULL, "%s", moefuse_last_error());
    c.num_ranks = 4;
    CHECK(moefuse_layer_create(&c, comm, &layer) == MOEFUSE_ERR_INVALID_CONFIG, "R = 4, comm of 2");
    CHECK(strstr(moefuse_last_error(), "comm has 2 ranks") != NULL, "%s", moefuse_last_error());
    c.num_ranks = 2;
    CHECK(moefuse_layer_create(&c, comm, &layer) == MOEFUSE_ERR_UNSUPPORTED, "CPU backend with a comm");
    CHECK(strstr(moefuse_last_error(), "MOEFUSE_BACKEND_CUDA") != NULL, "%s", moefuse_last_error());
    /* the saved input rows are for one rank */
    c.backend = MOEFUSE_BACKEND_CUDA;
    c.saved_mode = MOEFUSE_SAVE_ACTIVATIONS_AND_INPUTS;
    CHECK(moefuse_layer_create(&c, comm, &layer) == MOEFUSE_ERR_UNSUPPORTED, "saved inputs with a comm");
    CHECK(strstr(moefuse_last_error(), "SAVE_ACTIVATIONS_AND_INPUTS with a comm") != NULL, "%s",
          moefuse_last_error());
    CHECK(layer == (moefuse_layer *)0x1, "out must be untouched on failure");
    CHECK(moefuse_comm_destroy(comm) == MOEFUSE_OK, "%s", moefuse_last_error());
}

static void test_saved_bytes_errors(void) {
    fixture *f = fixture_new();
    CHECK(f != NULL, "fixture");
    if (!f) return;
    size_t bytes = 12345;
    CHECK(moefuse_saved_bytes(f->layer, TMAX + 1, &bytes) == MOEFUSE_ERR_TOO_MANY_TOKENS, "T > max");
    CHECK(moefuse_saved_bytes(f->layer, -1, &bytes) == MOEFUSE_ERR_SHAPE, "T < 0");
    CHECK(bytes == 12345, "bytes untouched on error");
    CHECK(moefuse_saved_bytes(f->layer, 1, NULL) == MOEFUSE_ERR_NULL_POINTER, "NULL bytes");
    size_t b1 = 0, b2 = 0;
    CHECK(moefuse_saved_bytes(f->layer, 1, &b1) == MOEFUSE_OK, "%s", moefuse_last_error());
    CHECK(moefuse_saved_bytes(f->layer, TMAX, &b2) == MOEFUSE_OK, "%s", moefuse_last_error());
    CHECK(b2 > b1, "more tokens need more saved bytes (%zu vs %zu)", b2, b1);
    fixture_free(f);
}

/* With T = 0 the token tensors may be NULL (an empty PyTorch tensor has no data). */
static void test_zero_tokens(void) {
    fixture *f = fixture_new();
    CHECK(f != NULL, "fixture");
    if (!f) return;
    f->fa.num_tokens = 0;
    f->fa.x = NULL; f->fa.y = NULL; f->fa.ids = NULL; f->fa.weights = NULL;
    CHECK(moefuse_forward(f->layer, &f->fa, NULL) == MOEFUSE_OK, "%s", moefuse_last_error());
    for (int e = 0; e < E; e++) CHECK(f->counts[e] == 0, "count of expert %d = %d", e, f->counts[e]);
    fixture_free(f);
}

static void test_cuda_backend_without_gpu(void) {
    moefuse_config cfg;
    moefuse_config_init(&cfg, H, I, E, K, TMAX);
    cfg.backend = MOEFUSE_BACKEND_CUDA;
    moefuse_layer *layer = NULL;
    moefuse_status st = moefuse_layer_create(&cfg, NULL, &layer);
    if (st == MOEFUSE_OK) {
        moefuse_layer_destroy(layer);
        th_skip("a CUDA device is present: the no-GPU error path is not reachable here");
        return;
    }
    CHECK(st == MOEFUSE_ERR_UNSUPPORTED || st == MOEFUSE_ERR_CUDA,
          "CUDA layer without a usable GPU: got %s (%s)", moefuse_status_string(st),
          moefuse_last_error());
    CHECK(moefuse_last_error()[0] != '\0', "the error names what is missing");
}

static void test_route_backend_errors(void) {
    float logits[E] = {0};
    int32_t ids[K];
    float w[K];
    moefuse_route_args ra = {.num_tokens = 1, .num_experts = E, .top_k = K, .logits = logits,
                             .ids = ids, .weights = w};
    CHECK(moefuse_route_forward(&ra, MOEFUSE_BACKEND_CUDA, NULL) == MOEFUSE_ERR_UNSUPPORTED,
          "CUDA routing is not built");
    CHECK(moefuse_route_forward(&ra, 7, NULL) == MOEFUSE_ERR_UNSUPPORTED, "unknown backend");
}

static void test_status_strings(void) {
    CHECK(strcmp(moefuse_status_string(MOEFUSE_ERR_TIMEOUT), "MOEFUSE_ERR_TIMEOUT") == 0, "name");
    CHECK(strcmp(moefuse_status_string(99), "MOEFUSE_ERR_UNKNOWN") == 0, "unknown status");
    CHECK(moefuse_version() == MOEFUSE_VERSION, "version %d", moefuse_version());
}

int main(void) {
    th_seed_from_env_or_clock();
    th_run("valid calls pass", test_valid_calls_pass);
    th_run("forward: NULL pointers", test_forward_null_pointers);
    th_run("forward: misaligned pointers", test_forward_misaligned);
    th_run("forward: shapes and T", test_forward_shapes);
    th_run("forward: expert ids", test_forward_expert_ids);
    th_run("backward: every argument", test_backward_errors);
    th_run("backward: fp32 or bf16 weight gradients", test_backward_wgrad_outputs);
    th_run("W13 in two halves: the up pointers", test_w13_halves);
    th_run("config errors", test_config_errors);
    th_run("comm errors", test_comm_errors);
    th_run("saved_bytes errors", test_saved_bytes_errors);
    th_run("T = 0 with NULL token tensors", test_zero_tokens);
    th_run("CUDA backend without a GPU", test_cuda_backend_without_gpu);
    th_run("routing helper backend errors", test_route_backend_errors);
    th_run("status strings and version", test_status_strings);
    return th_finish();
}
