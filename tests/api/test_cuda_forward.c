/* The CUDA forward, through the public API with device buffers, against the fp64
 * reference (src/cpu/reference.h) on fresh random inputs.
 *
 *   - both model shapes, T in {0, 1, 7, 512, 4096 (= max_tokens)}, random routing;
 *   - routing edge cases: all tokens on one expert, most experts empty, dropped slots
 *     with fully dropped tokens (and row strides > H), Zipf-skewed routing;
 *   - expert_counts exact; the plan in `saved` equal to the host plan (mf_plan_build);
 *     padding rows of the saved gate_up exactly 0;
 *   - bad ids: moefuse_layer_check names the first bad token, y / saved /
 *     expert_counts untouched, the next good call works;
 *   - the saved buffer feeds the CUDA backward.
 * The bitwise cases (50 repetitions, fused = staged, CUDA graphs) are in
 * test_cuda_forward_bitwise.c; the fixture both share in cuda_forward.{h,c}.
 *
 * y_t depends only on token t, so for large T the reference runs on a random subset
 * of tokens (all tokens when T <= kCheckTokens). Tolerance: th_bf16_tolerance(5),
 * for the five bf16 roundings on the way (g and u, which each enter act, as in
 * test_cuda_backward.c; act; the p-scaled slot row; y); x and the weights are exact
 * bf16 inputs of both sides. Outputs are poisoned (bf16 NaN) first.
 *
 * With no sm_90 device every case prints SKIP with the reason. MOEFUSE_TEST_PIPELINE=fused
 * makes the fused forward the fixture's pipeline (the default is staged). */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_forward.h"
#include "fixture_cuda.h"
#include "harness.h"
#include "internal.h"
#include "moefuse.h"
#include "reference.h"

/* One forward on fresh inputs, checked everywhere. */
static void forward_case(int T, routing r, int64_t x_pad, int64_t y_pad) {
    if (!ready()) return;
    inputs in;
    uint16_t *y = NULL;
    int32_t *counts = NULL;
    uint8_t *saved = NULL;
    if (!inputs_make(&in, T, r, x_pad, y_pad)) goto done;
    moefuse_fwd_args a = fwd_args(&in, 1, 1);
    MF_OK(moefuse_forward(F.layer, &a, F.stream));
    MF_OK(moefuse_layer_check(F.layer, F.stream));
    const int64_t ny = (int64_t)(T > 0 ? T : 1) * in.y_stride;
    y = malloc((size_t)ny * 2);
    counts = malloc((size_t)F.m->E * 4);
    saved = malloc(in.saved_bytes);
    CUDA_OK(cudaMemcpy(y, in.y_d, (size_t)ny * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(counts, in.counts_d, (size_t)F.m->E * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(saved, in.saved_d, in.saved_bytes, cudaMemcpyDeviceToHost));
    check_counts(&in, counts);
    check_saved(&in, saved);
    check_y(&in, y);
    if (T == 0) CHECK(y[0] == BF16_NAN, "T = 0 wrote y");
done:
    free(y);
    free(counts);
    free(saved);
    inputs_free(&in);
}

/* ---- cases -------------------------------------------------------------------------- */

static void case_t0(void) { forward_case(0, ROUTE_RANDOM, 0, 0); }
static void case_t1(void) { forward_case(1, ROUTE_RANDOM, 0, 0); }
static void case_t7(void) { forward_case(7, ROUTE_RANDOM, 0, 0); }
static void case_t512(void) { forward_case(512, ROUTE_RANDOM, 0, 0); }
static void case_tmax(void) { forward_case(kMaxTokens, ROUTE_RANDOM, 0, 0); }
static void case_one_expert(void) { forward_case(kMaxTokens, ROUTE_ONE_EXPERT, 0, 0); }
static void case_few_experts(void) { forward_case(777, ROUTE_FEW_EXPERTS, 0, 0); }
static void case_dropped(void) { forward_case(1000, ROUTE_DROPPED, 8, 64); }
static void case_zipf(void) { forward_case(3000, ROUTE_ZIPF, 0, 8); }
static void case_one_token_one_slot(void) { forward_case(1, ROUTE_ONE_EXPERT, 0, 0); }

/* Bad ids: two bad calls, then check names the first; nothing written; then a good
 * call works and check is clean. */
static void case_bad_ids(void) {
    if (!ready()) return;
    const int T = 300, K = F.m->K;
    inputs in;
    uint16_t *y = NULL;
    int32_t *counts = NULL;
    uint8_t *saved = NULL;
    int32_t *bad = NULL;
    if (!inputs_make(&in, T, ROUTE_RANDOM, 0, 0)) goto done;
    moefuse_fwd_args a = fwd_args(&in, 1, 1);
    const int64_t ny = (int64_t)T * in.y_stride;
    y = malloc((size_t)ny * 2);
    counts = malloc((size_t)F.m->E * 4);
    saved = malloc(in.saved_bytes);

    /* 1: out of range at token 137 (and a duplicate later, at 201: the smaller token wins) */
    bad = malloc((size_t)T * K * 4);
    memcpy(bad, in.ids, (size_t)T * K * 4);
    bad[137 * K + 5] = F.m->E;
    bad[201 * K + 2] = bad[201 * K + 0];
    CUDA_OK(cudaMemcpy(in.ids_d, bad, (size_t)T * K * 4, cudaMemcpyHostToDevice));
    MF_OK(moefuse_forward(F.layer, &a, F.stream));
    /* 2: a duplicate at token 5, before any check: the first error is kept */
    memcpy(bad, in.ids, (size_t)T * K * 4);
    bad[5 * K + 3] = bad[5 * K + 1];
    CUDA_OK(cudaMemcpy(in.ids_d, bad, (size_t)T * K * 4, cudaMemcpyHostToDevice));
    MF_OK(moefuse_forward(F.layer, &a, F.stream));
    moefuse_status st = moefuse_layer_check(F.layer, F.stream);
    CHECK(st == MOEFUSE_ERR_EXPERT_ID, "check after bad calls: %s (%s), expected "
          "MOEFUSE_ERR_EXPERT_ID", moefuse_status_string(st), moefuse_last_error());
    CHECK(strstr(moefuse_last_error(), "[137][5]") != NULL, "message should name ids[137][5]: %s",
          moefuse_last_error());
    printf("    message: %s\n", moefuse_last_error());
    st = moefuse_layer_check(F.layer, F.stream);
    CHECK(st == MOEFUSE_OK, "second check: %s, expected OK (cleared)", moefuse_status_string(st));

    /* nothing written */
    CUDA_OK(cudaMemcpy(y, in.y_d, (size_t)ny * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(counts, in.counts_d, (size_t)F.m->E * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(saved, in.saved_d, in.saved_bytes, cudaMemcpyDeviceToHost));
    int64_t touched = 0;
    for (int64_t i = 0; i < ny; i++) touched += y[i] != BF16_NAN;
    CHECK(touched == 0, "bad ids: %lld elements of y written", (long long)touched);
    touched = 0;
    for (int e = 0; e < F.m->E; e++) touched += (uint32_t)counts[e] != 0xababababu;
    CHECK(touched == 0, "bad ids: %lld expert_counts written", (long long)touched);
    touched = 0;
    for (size_t i = 0; i < in.saved_bytes; i++) touched += saved[i] != 0xcd;
    CHECK(touched == 0, "bad ids: %lld bytes of saved written", (long long)touched);

    /* 3: duplicate alone */
    CUDA_OK(cudaMemcpy(in.ids_d, bad, (size_t)T * K * 4, cudaMemcpyHostToDevice));
    MF_OK(moefuse_forward(F.layer, &a, F.stream));
    st = moefuse_layer_check(F.layer, F.stream);
    CHECK(st == MOEFUSE_ERR_DUPLICATE_EXPERT, "duplicate: %s, expected DUPLICATE_EXPERT",
          moefuse_status_string(st));
    CHECK(strstr(moefuse_last_error(), "[5][3]") != NULL, "message should name ids[5][3]: %s",
          moefuse_last_error());
    printf("    message: %s\n", moefuse_last_error());
    /* 4: -2 */
    memcpy(bad, in.ids, (size_t)T * K * 4);
    bad[(T - 1) * K] = -2;
    CUDA_OK(cudaMemcpy(in.ids_d, bad, (size_t)T * K * 4, cudaMemcpyHostToDevice));
    MF_OK(moefuse_forward(F.layer, &a, F.stream));
    st = moefuse_layer_check(F.layer, F.stream);
    CHECK(st == MOEFUSE_ERR_EXPERT_ID, "id -2: %s, expected EXPERT_ID", moefuse_status_string(st));
    CUDA_OK(cudaMemcpy(y, in.y_d, (size_t)ny * 2, cudaMemcpyDeviceToHost));
    touched = 0;
    for (int64_t i = 0; i < ny; i++) touched += y[i] != BF16_NAN;
    CHECK(touched == 0, "bad ids: %lld elements of y written", (long long)touched);

    /* 5: good ids again: the layer works, check is clean */
    CUDA_OK(cudaMemcpy(in.ids_d, in.ids, (size_t)T * K * 4, cudaMemcpyHostToDevice));
    MF_OK(moefuse_forward(F.layer, &a, F.stream));
    MF_OK(moefuse_layer_check(F.layer, F.stream));
    CUDA_OK(cudaMemcpy(y, in.y_d, (size_t)ny * 2, cudaMemcpyDeviceToHost));
    check_y(&in, y);
done:
    free(bad);
    free(y);
    free(counts);
    free(saved);
    inputs_free(&in);
}

/* The forward's saved buffer feeds the CUDA backward (checked in depth by
 * tests/api/test_cuda_backward.c): the call succeeds and writes every dx element. */
static void case_backward_runs(void) {
    if (!ready()) return;
    const int T = 7, K = F.m->K, H = F.m->H;
    inputs in;
    uint16_t *dx_d = NULL, *dx = NULL;
    float *dp_d = NULL, *dw13_d = NULL, *dw2_d = NULL;
    if (!inputs_make(&in, T, ROUTE_RANDOM, 0, 0)) goto done;
    const size_t n13 = (size_t)F.m->E * 2 * F.m->I * H, n2 = (size_t)F.m->E * H * F.m->I;
    CUDA_OK(cudaMalloc((void **)&dx_d, (size_t)T * H * 2));
    CUDA_OK(cudaMalloc((void **)&dp_d, (size_t)T * K * 4));
    CUDA_OK(cudaMalloc((void **)&dw13_d, n13 * 4));
    CUDA_OK(cudaMalloc((void **)&dw2_d, n2 * 4));
    CUDA_OK(cudaMemset(dx_d, 0xff, (size_t)T * H * 2));
    moefuse_fwd_args a = fwd_args(&in, 1, 0);
    MF_OK(moefuse_forward(F.layer, &a, F.stream));
    moefuse_bwd_args b;
    memset(&b, 0, sizeof b);
    b.num_tokens = T;
    b.x = in.x_d;
    b.x_stride = in.x_stride;
    b.ids = in.ids_d;
    b.weights = in.p_d;
    b.w13 = F.w13_d;
    b.w2 = F.w2_d;
    b.saved = in.saved_d;
    b.saved_bytes = in.saved_bytes;
    b.dy = in.x_d; /* any bf16 rows will do */
    b.dy_stride = in.x_stride;
    b.dx = dx_d;
    b.dx_stride = H;
    b.dweights = dp_d;
    b.dw13 = dw13_d;
    b.dw2 = dw2_d;
    MF_OK(moefuse_backward(F.layer, &b, F.stream));
    MF_OK(moefuse_layer_check(F.layer, F.stream));
    dx = malloc((size_t)T * H * 2);
    CUDA_OK(cudaMemcpy(dx, dx_d, (size_t)T * H * 2, cudaMemcpyDeviceToHost));
    int64_t nan_count = 0;
    for (int64_t i = 0; i < (int64_t)T * H; i++) nan_count += (dx[i] & 0x7fff) > 0x7f80;
    CHECK(nan_count == 0, "backward: %lld elements of dx are NaN (unwritten?)", (long long)nan_count);
done:
    free(dx);
    cudaFree(dx_d);
    cudaFree(dp_d);
    cudaFree(dw13_d);
    cudaFree(dw2_d);
    inputs_free(&in);
}

/* test_cuda_forward [model-substring [case-substring]]: all cases by default; the filters keep
 * sanitizer runs small. */
int main(int argc, char **argv) {
    static const named_case cases[] = {
        {case_t0, "T=0"},
        {case_t1, "T=1"},
        {case_one_token_one_slot, "T=1 one slot"},
        {case_t7, "T=7"},
        {case_t512, "T=512"},
        {case_tmax, "T=4096 (max)"},
        {case_one_expert, "T=4096 all tokens on one expert"},
        {case_few_experts, "T=777 three experts, rest empty"},
        {case_dropped, "T=1000 dropped slots and tokens, strided x/y"},
        {case_zipf, "T=3000 zipf routing"},
        {case_bad_ids, "bad ids"},
        {case_backward_runs, "backward runs"},
    };
    return forward_main(argc, argv, cases, (int)(sizeof cases / sizeof cases[0]));
}
