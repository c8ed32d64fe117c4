/* The CUDA backward, bitwise cases, through the public API with device buffers (the
 * fixture and the models of test_cuda_backward.c, in cuda_backward.{h,c}):
 *   - MOEFUSE_RECOMPUTE and MOEFUSE_SAVE_ACTIVATIONS_AND_INPUTS give the bits of
 *     MOEFUSE_SAVE_ACTIVATIONS, the latter also with the fused pipeline (forward and
 *     backward);
 *   - accumulate = 1 gives exactly old + the write-mode gradient;
 *   - the fused backward (MOEFUSE_PIPELINE_FUSED: dW2, dgrad1 and dW13 in one kernel)
 *     bitwise equal to the staged one: fp32 write and accumulate, bf16 dW, five routings;
 *   - 50 repetitions bitwise identical; a CUDA graph replays to the eager bits;
 *   - a saved buffer of no forward: moefuse_layer_check reports MOEFUSE_ERR_SAVED_STATE
 *     and dx / dweights are untouched.
 * W13 in two halves: test_cuda_backward_halves.c.
 *
 * With no sm_90 device every case prints SKIP with the reason. MOEFUSE_TEST_PIPELINE=fused
 * makes the fused pipeline the fixture's (the default is staged). */
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

/* The other saved modes give the saving layer's bits: MOEFUSE_RECOMPUTE reruns gemm1,
 * MOEFUSE_SAVE_ACTIVATIONS_AND_INPUTS reads the forward's xs rows from the saved buffer
 * instead of gathering x again (with either pipeline: the fused forward and backward
 * give the staged bits). */
static void saved_mode_case(moefuse_saved_mode mode, moefuse_pipeline pipeline, int T,
                            routing r, int64_t pad) {
    if (!ready()) return;
    inputs in;
    outputs a, b;
    memset(&a, 0, sizeof a);
    memset(&b, 0, sizeof b);
    moefuse_layer *ml = make_layer(mode, pipeline, T);
    CHECK(ml != NULL, "layer of saved_mode %d", (int)mode);
    if (!ml || !inputs_make(&in, T, r, pad)) goto done;
    MF_OK(run_fwd_bwd(F.layer, &in, 1));
    CHECK(outputs_get(&a, &in), "copy");
    size_t mbytes = 0;
    MF_OK(moefuse_saved_bytes(ml, T, &mbytes));
    if (mode == MOEFUSE_RECOMPUTE)
        CHECK(mbytes < in.saved_bytes, "recompute saves %zu bytes, activations %zu", mbytes,
              in.saved_bytes);
    else  /* at least the T*K slot rows of H bf16 more */
        CHECK(mbytes >= in.saved_bytes + (size_t)T * F.m->K * F.m->H * 2,
              "activations and inputs save %zu bytes, activations %zu", mbytes, in.saved_bytes);
    if (mbytes > in.saved_bytes) {
        CUDA_OK(cudaFree(in.saved_d));
        CUDA_OK(cudaMalloc(&in.saved_d, mbytes));
        in.saved_bytes = mbytes;
    }
    MF_OK(run_fwd_bwd(ml, &in, 1));
    CHECK(outputs_get(&b, &in), "copy");
    CHECK(outputs_equal(&a, &b), "saved_mode %d differs from MOEFUSE_SAVE_ACTIVATIONS",
          (int)mode);
done:
    if (ml) moefuse_layer_destroy(ml);
    outputs_free(&a);
    outputs_free(&b);
    inputs_free(&in);
}

static void case_recompute(void) {
    saved_mode_case(MOEFUSE_RECOMPUTE, MOEFUSE_PIPELINE_STAGED, 512, ROUTE_ZIPF, 0);
}
static void case_saved_inputs(void) {
    saved_mode_case(MOEFUSE_SAVE_ACTIVATIONS_AND_INPUTS, MOEFUSE_PIPELINE_STAGED, 1000,
                    ROUTE_DROPPED, 8);
}
static void case_saved_inputs_fused(void) {
    saved_mode_case(MOEFUSE_SAVE_ACTIVATIONS_AND_INPUTS, MOEFUSE_PIPELINE_FUSED, 700,
                    ROUTE_ZIPF, 0);
}

/* accumulate = 1 on old values gives exactly old + the write-mode gradient (fp32). */
static void case_accumulate(void) {
    if (!ready()) return;
    const int T = 700;
    inputs in;
    outputs w, acc;
    memset(&w, 0, sizeof w);
    memset(&acc, 0, sizeof acc);
    float *old13 = NULL, *old2 = NULL;
    if (!inputs_make(&in, T, ROUTE_FEW_EXPERTS, 0)) goto done;
    MF_OK(run_fwd_bwd(F.layer, &in, 1));
    CHECK(outputs_get(&w, &in), "copy");
    old13 = malloc((size_t)n13() * 4);
    old2 = malloc((size_t)n2() * 4);
    for (int64_t i = 0; i < n13(); i++) old13[i] = (float)((int64_t)(i * 2654435761u % 1999) - 999) * 1e-3f;
    for (int64_t i = 0; i < n2(); i++) old2[i] = (float)((int64_t)(i * 2246822519u % 1999) - 999) * 1e-3f;
    CUDA_OK(cudaMemcpy(F.dw13_d, old13, (size_t)n13() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(F.dw2_d, old2, (size_t)n2() * 4, cudaMemcpyHostToDevice));
    MF_OK(run_fwd_bwd(F.layer, &in, 0));
    CHECK(outputs_get(&acc, &in), "copy");
    int64_t bad = 0;
    for (int64_t i = 0; i < n13(); i++) {
        const float want = old13[i] + w.dw13[i];
        bad += memcmp(&want, &acc.dw13[i], 4) != 0;
    }
    for (int64_t i = 0; i < n2(); i++) {
        const float want = old2[i] + w.dw2[i];
        bad += memcmp(&want, &acc.dw2[i], 4) != 0;
    }
    CHECK(bad == 0, "accumulate: %lld elements differ from old + write-mode gradient", (long long)bad);
    CHECK(!memcmp(w.dx, acc.dx, w.dx_bytes) && !memcmp(w.dp, acc.dp, w.dp_bytes),
          "accumulate changed dx / dweights");
done:
    free(old13);
    free(old2);
    outputs_free(&w);
    outputs_free(&acc);
    inputs_free(&in);
}

/* bf16 weight gradients (dw13_bf16 / dw2_bf16): the write-mode fp32 gradients rounded
 * to nearest even, bitwise, experts without rows 0; dx and d p unchanged. */
static void case_dw_bf16(void) {
    if (!ready()) return;
    const int T = 700;
    inputs in;
    outputs w;
    memset(&w, 0, sizeof w);
    uint16_t *d13 = NULL, *d2 = NULL, *h13 = NULL, *h2 = NULL, *dx = NULL;
    float *dp = NULL;
    if (!inputs_make(&in, T, ROUTE_FEW_EXPERTS, 0)) goto done;
    MF_OK(run_fwd_bwd(F.layer, &in, 1));
    CHECK(outputs_get(&w, &in), "copy");
    CUDA_OK(cudaMalloc((void **)&d13, (size_t)n13() * 2));
    CUDA_OK(cudaMalloc((void **)&d2, (size_t)n2() * 2));
    if (!d13 || !d2) goto done;
    CUDA_OK(cudaMemsetAsync(d13, 0xff, (size_t)n13() * 2, F.stream));
    CUDA_OK(cudaMemsetAsync(d2, 0xff, (size_t)n2() * 2, F.stream));
    CUDA_OK(cudaMemsetAsync(in.dx_d, 0xff, w.dx_bytes, F.stream));
    CUDA_OK(cudaMemsetAsync(in.dp_d, 0xff, w.dp_bytes, F.stream));
    MF_OK(backward_dw_bf16(&in, d13, d2));
    h13 = malloc((size_t)n13() * 2);
    h2 = malloc((size_t)n2() * 2);
    dx = malloc(w.dx_bytes);
    dp = malloc(w.dp_bytes);
    CUDA_OK(cudaMemcpy(h13, d13, (size_t)n13() * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(h2, d2, (size_t)n2() * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(dx, in.dx_d, w.dx_bytes, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(dp, in.dp_d, w.dp_bytes, cudaMemcpyDeviceToHost));
    int64_t bad = 0;
    for (int64_t i = 0; i < n13(); i++) bad += h13[i] != mf_float_to_bf16(w.dw13[i]);
    for (int64_t i = 0; i < n2(); i++) bad += h2[i] != mf_float_to_bf16(w.dw2[i]);
    CHECK(bad == 0, "bf16 dW: %lld elements differ from the rounded fp32 gradient", (long long)bad);
    CHECK(!memcmp(w.dx, dx, w.dx_bytes) && !memcmp(w.dp, dp, w.dp_bytes),
          "bf16 dW changed dx / dweights");
done:
    cudaFree(d13);
    cudaFree(d2);
    free(h13);
    free(h2);
    free(dx);
    free(dp);
    outputs_free(&w);
    inputs_free(&in);
}

/* 50 repetitions of the backward on one saved buffer: bitwise the first. dx and d p
 * are compared whole every time; dW (2.4 GB at qwen3-30b-a3b) in a window of 8 experts
 * that moves each repetition, so the 50 cover every expert. */
static void case_deterministic(void) {
    if (!ready()) return;
    const int T = 1536, W = 8;
    inputs in;
    outputs first;
    memset(&first, 0, sizeof first);
    uint16_t *dx = NULL;
    float *dp = NULL, *w13 = NULL, *w2 = NULL;
    if (!inputs_make(&in, T, ROUTE_ZIPF, 0)) goto done;
    MF_OK(run_fwd_bwd(F.layer, &in, 1));
    CHECK(outputs_get(&first, &in), "copy");
    const size_t e13 = (size_t)2 * F.m->I * F.m->H, e2 = (size_t)F.m->H * F.m->I;
    const int E = F.m->E, win = W < E ? W : E;
    dx = malloc(first.dx_bytes);
    dp = malloc(first.dp_bytes);
    w13 = malloc(e13 * 4 * win);
    w2 = malloc(e2 * 4 * win);
    moefuse_bwd_args b = bwd_args(&in, 0);
    int diff = 0;
    for (int rep = 0; rep < 50; rep++) {
        const int e0 = (rep * win) % E < E - win ? (rep * win) % E : E - win;
        CUDA_OK(cudaMemsetAsync(in.dx_d, 0xff, first.dx_bytes, F.stream));
        CUDA_OK(cudaMemsetAsync(in.dp_d, 0xff, first.dp_bytes, F.stream));
        CUDA_OK(cudaMemsetAsync(F.dw13_d + e0 * e13, 0xff, e13 * 4 * win, F.stream));
        CUDA_OK(cudaMemsetAsync(F.dw2_d + e0 * e2, 0xff, e2 * 4 * win, F.stream));
        MF_OK(moefuse_backward(F.layer, &b, F.stream));
        CUDA_OK(cudaStreamSynchronize(F.stream));
        CUDA_OK(cudaMemcpy(dx, in.dx_d, first.dx_bytes, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(dp, in.dp_d, first.dp_bytes, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(w13, F.dw13_d + e0 * e13, e13 * 4 * win, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(w2, F.dw2_d + e0 * e2, e2 * 4 * win, cudaMemcpyDeviceToHost));
        diff += memcmp(dx, first.dx, first.dx_bytes) || memcmp(dp, first.dp, first.dp_bytes) ||
                memcmp(w13, first.dw13 + e0 * e13, e13 * 4 * win) ||
                memcmp(w2, first.dw2 + e0 * e2, e2 * 4 * win);
    }
    CHECK(diff == 0, "the backward differed from the first run in %d of 50 repetitions", diff);
    MF_OK(moefuse_layer_check(F.layer, F.stream));
done:
    free(dx);
    free(dp);
    free(w13);
    free(w2);
    outputs_free(&first);
    inputs_free(&in);
}

/* The backward captured in a CUDA graph: two replays give the eager bits; then new dy
 * written in place, replay again = eager again. */
static void case_graph(void) {
    if (!ready()) return;
    const int T = 640;
    inputs in;
    outputs e, g;
    memset(&e, 0, sizeof e);
    memset(&g, 0, sizeof g);
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    if (!inputs_make(&in, T, ROUTE_RANDOM, 0)) goto done;
    MF_OK(run_fwd_bwd(F.layer, &in, 1));
    moefuse_bwd_args b = bwd_args(&in, 0);
    CUDA_OK(cudaStreamBeginCapture(F.stream, cudaStreamCaptureModeGlobal));
    moefuse_status st = moefuse_backward(F.layer, &b, F.stream);
    cudaError_t ce = cudaStreamEndCapture(F.stream, &graph);
    CHECK(st == MOEFUSE_OK, "backward under capture: %s", moefuse_last_error());
    CUDA_OK(ce);
    if (st != MOEFUSE_OK) goto done;
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    for (int round = 0; round < 2; round++) {
        if (round == 1) {
            th_fill_bf16_normal(in.dy, NULL, (int64_t)T * in.dy_stride, 1.0);
            CUDA_OK(cudaMemcpy(in.dy_d, in.dy, (size_t)T * in.dy_stride * 2, cudaMemcpyHostToDevice));
        }
        CUDA_OK(cudaMemsetAsync(in.dx_d, 0xff, (size_t)T * in.dx_stride * 2, F.stream));
        MF_OK(moefuse_backward(F.layer, &b, F.stream));
        MF_OK(moefuse_layer_check(F.layer, F.stream));
        CHECK(outputs_get(&e, &in), "copy");
        CUDA_OK(cudaMemsetAsync(in.dx_d, 0xff, (size_t)T * in.dx_stride * 2, F.stream));
        CUDA_OK(cudaMemsetAsync(in.dp_d, 0xff, (size_t)T * in.K * 4, F.stream));
        CUDA_OK(cudaMemsetAsync(F.dw13_d, 0xff, (size_t)n13() * 4, F.stream));
        CUDA_OK(cudaGraphLaunch(exec, F.stream));
        CUDA_OK(cudaGraphLaunch(exec, F.stream));
        MF_OK(moefuse_layer_check(F.layer, F.stream));
        CHECK(outputs_get(&g, &in), "copy");
        CHECK(outputs_equal(&e, &g), "round %d: graph replay differs from the eager backward", round);
    }
    check_dx_dp(&in, g.dx, g.dp);
done:
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    outputs_free(&e);
    outputs_free(&g);
    inputs_free(&in);
}

/* A saved buffer no forward wrote, and one of another T: the call returns OK (the plan
 * is in device memory), moefuse_layer_check reports it, dx / dweights untouched; the
 * next good backward works. */
static void case_bad_saved(void) {
    if (!ready()) return;
    const int T = 300;
    inputs in;
    uint16_t *dx = NULL;
    if (!inputs_make(&in, T, ROUTE_RANDOM, 0)) goto done;
    MF_OK(run_fwd_bwd(F.layer, &in, 1));
    moefuse_bwd_args b = bwd_args(&in, 0);
    const size_t dxb = (size_t)T * in.dx_stride * 2;
    dx = malloc(dxb);
    for (int variant = 0; variant < 3; variant++) {
        if (variant == 0) CUDA_OK(cudaMemset(in.saved_d, 0xcd, in.saved_bytes)); /* no forward */
        if (variant == 1) { /* a good plan, but other ids */
            MF_OK(run_fwd_bwd(F.layer, &in, 1));
            int32_t *ids = malloc((size_t)T * in.K * 4);
            memcpy(ids, in.ids, (size_t)T * in.K * 4);
            int32_t t = ids[77 * in.K + 2];
            ids[77 * in.K + 2] = ids[77 * in.K + 3];
            ids[77 * in.K + 3] = t;
            cudaMemcpy(in.ids_d, ids, (size_t)T * in.K * 4, cudaMemcpyHostToDevice);
            free(ids);
        }
        if (variant == 2) { /* num_tokens of another forward */
            CUDA_OK(cudaMemcpy(in.ids_d, in.ids, (size_t)T * in.K * 4, cudaMemcpyHostToDevice));
            b.num_tokens = T - 1;
        }
        CUDA_OK(cudaMemset(in.dx_d, 0xff, dxb));
        MF_OK(moefuse_backward(F.layer, &b, F.stream));
        moefuse_status st = moefuse_layer_check(F.layer, F.stream);
        CHECK(st == MOEFUSE_ERR_SAVED_STATE, "variant %d: check %s, expected SAVED_STATE", variant,
              moefuse_status_string(st));
        printf("    message: %s\n", moefuse_last_error());
        CUDA_OK(cudaMemcpy(dx, in.dx_d, dxb, cudaMemcpyDeviceToHost));
        int64_t touched = 0;
        for (size_t i = 0; i < dxb / 2; i++) touched += dx[i] != 0xffff;
        CHECK(touched == 0, "variant %d: %lld elements of dx written", variant, (long long)touched);
    }
    b.num_tokens = T;
    MF_OK(run_fwd_bwd(F.layer, &in, 1));
    MF_OK(moefuse_layer_check(F.layer, F.stream));
done:
    free(dx);
    inputs_free(&in);
}

/* The fused backward (MOEFUSE_PIPELINE_FUSED: dW2, dgrad1 and dW13 in one kernel) against
 * the staged one, bit for bit, on five routings with fresh inputs each: fp32 write mode
 * three times (outputs poisoned before each run: a dgrad1 tile storing dx rows over dys
 * before a dW2 tile had read them would show in dW2), accumulate mode once on top, and
 * the bf16 weight gradients once (experts without rows: zero tiles). */
static int fused_vs_staged(moefuse_layer *fused, int T, routing r, uint16_t *b13, uint16_t *b2,
                           int *diff) {
    int runs = 0;
    inputs in;
    outputs staged, staged_acc, got;
    memset(&staged, 0, sizeof staged);
    memset(&staged_acc, 0, sizeof staged_acc);
    memset(&got, 0, sizeof got);
    const size_t h13 = (size_t)n13() * 2, h2 = (size_t)n2() * 2;
    uint16_t *s13 = malloc(h13), *s2 = malloc(h2), *f13 = malloc(h13), *f2 = malloc(h2);
    if (!s13 || !s2 || !f13 || !f2 || !inputs_make(&in, T, r, 0)) goto done;
    /* staged: write, accumulate on top, bf16 */
    MF_OK(run_fwd_bwd(F.layer, &in, 1));
    CHECK(outputs_get(&staged, &in), "copy");
    MF_OK(run_fwd_bwd(F.layer, &in, 0));
    CHECK(outputs_get(&staged_acc, &in), "copy");
    MF_OK(backward_dw_bf16_on(F.layer, &in, b13, b2));
    CUDA_OK(cudaMemcpy(s13, b13, h13, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(s2, b2, h2, cudaMemcpyDeviceToHost));
    /* fused */
    for (int rep = 0; rep < 3; rep++) {
        MF_OK(run_fwd_bwd(fused, &in, 1));
        CHECK(outputs_get(&got, &in), "copy");
        *diff += !outputs_equal(&staged, &got);
        runs++;
    }
    MF_OK(run_fwd_bwd(fused, &in, 0));   /* onto the write-mode gradients, as staged */
    CHECK(outputs_get(&got, &in), "copy");
    *diff += !outputs_equal(&staged_acc, &got);
    runs++;
    CUDA_OK(cudaMemsetAsync(b13, 0xff, h13, F.stream));
    CUDA_OK(cudaMemsetAsync(b2, 0xff, h2, F.stream));
    MF_OK(backward_dw_bf16_on(fused, &in, b13, b2));
    CUDA_OK(cudaMemcpy(f13, b13, h13, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(f2, b2, h2, cudaMemcpyDeviceToHost));
    *diff += memcmp(s13, f13, h13) != 0 || memcmp(s2, f2, h2) != 0;
    runs++;
    if (r == ROUTE_RANDOM) check_dx_dp(&in, got.dx, got.dp);
done:
    free(s13);
    free(s2);
    free(f13);
    free(f2);
    outputs_free(&staged);
    outputs_free(&staged_acc);
    outputs_free(&got);
    inputs_free(&in);
    return runs;
}

static void case_fused_equals_staged(void) {
    if (!ready()) return;
    if (F.pipeline == MOEFUSE_PIPELINE_FUSED) {
        th_skip("the fixture runs the fused pipeline already (MOEFUSE_TEST_PIPELINE=fused)");
        return;
    }
    moefuse_layer *fused = make_layer(MOEFUSE_SAVE_ACTIVATIONS, MOEFUSE_PIPELINE_FUSED, kMaxTokens);
    uint16_t *b13 = NULL, *b2 = NULL;
    CHECK(fused != NULL, "fused layer");
    if (!fused) goto done;
    CUDA_OK(cudaMalloc((void **)&b13, (size_t)n13() * 2));
    CUDA_OK(cudaMalloc((void **)&b2, (size_t)n2() * 2));
    if (!b13 || !b2) goto done;
    static const routing kRoutes[] = {ROUTE_RANDOM, ROUTE_ZIPF, ROUTE_ONE_EXPERT,
                                      ROUTE_FEW_EXPERTS, ROUTE_DROPPED};
    static const int kTokens[] = {kMaxTokens, 3000, 2048, 777, 1000};
    int diff = 0, runs = 0;
    for (int i = 0; i < 5; i++) runs += fused_vs_staged(fused, kTokens[i], kRoutes[i], b13, b2, &diff);
    CHECK(runs == 25, "ran %d of 25 fused backwards", runs);
    CHECK(diff == 0, "the fused backward differed from the staged one in %d of %d runs", diff, runs);
    MF_OK(moefuse_layer_check(fused, F.stream));
done:
    cudaFree(b13);
    cudaFree(b2);
    if (fused) moefuse_layer_destroy(fused);
}

/* test_cuda_backward_modes [model-substring [case-substring]] */
int main(int argc, char **argv) {
    static const named_case cases[] = {
        {case_recompute, "recompute bitwise = saved activations"},
        {case_saved_inputs, "saved inputs bitwise = saved activations"},
        {case_saved_inputs_fused, "saved inputs, fused pipeline, bitwise = saved activations"},
        {case_accumulate, "accumulate = old + write mode, exactly"},
        {case_dw_bf16, "bf16 dW = rounded fp32 dW, bitwise"},
        {case_deterministic, "50 repetitions bitwise"},
        {case_graph, "cuda graph replay"},
        {case_bad_saved, "bad saved buffer"},
        {case_fused_equals_staged, "fused backward bitwise = staged"},
    };
    return backward_main(argc, argv, cases, (int)(sizeof cases / sizeof cases[0]));
}
