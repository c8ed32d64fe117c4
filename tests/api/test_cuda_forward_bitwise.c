/* The CUDA forward, bitwise cases, through the public API with device buffers (the
 * fixture and the models of test_cuda_forward.c, in cuda_forward.{h,c}):
 *   - 50 repetitions bitwise identical (y and saved); saved = NULL gives the same y;
 *   - the fused forward (MOEFUSE_PIPELINE_FUSED) equal to the staged one (the default)
 *     bit for bit, 50 repetitions over five routings;
 *   - the forward captured in a CUDA graph and replayed gives the same bits, also
 *     after the inputs change in place.
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

/* Host copies of y and saved: of a reference run (y0, s0) and of the run compared with it
 * (y1, s1). */
typedef struct run_copies {
    uint16_t *y0, *y1;
    uint8_t *s0, *s1;
    size_t y_bytes, saved_bytes;
} run_copies;

static int run_copies_alloc(run_copies *c, const inputs *in) {
    c->y_bytes = (size_t)in->T * in->y_stride * 2;
    c->saved_bytes = in->saved_bytes;
    c->y0 = malloc(c->y_bytes);
    c->y1 = malloc(c->y_bytes);
    c->s0 = malloc(c->saved_bytes);
    c->s1 = malloc(c->saved_bytes);
    const int ok = c->y0 && c->y1 && c->s0 && c->s1;
    CHECK(ok, "out of host memory");
    return ok;
}

static void run_copies_free(run_copies *c) {
    free(c->y0);
    free(c->y1);
    free(c->s0);
    free(c->s1);
    memset(c, 0, sizeof *c);
}

/* One forward of `layer`, y and saved poisoned first, copied into the reference (ref = 1)
 * or the compared copies. 0 on a failed call (recorded). */
static int run_and_copy(moefuse_layer *layer, const inputs *in, const moefuse_fwd_args *a,
                        run_copies *c, int ref) {
    CUDA_OK(cudaMemsetAsync(in->y_d, 0xff, c->y_bytes, F.stream));
    if (a->saved) CUDA_OK(cudaMemsetAsync(in->saved_d, 0xcd, c->saved_bytes, F.stream));
    MF_OK(moefuse_forward(layer, a, F.stream));
    CUDA_OK(cudaStreamSynchronize(F.stream));
    CUDA_OK(cudaMemcpy(ref ? c->y0 : c->y1, in->y_d, c->y_bytes, cudaMemcpyDeviceToHost));
    if (a->saved)
        CUDA_OK(cudaMemcpy(ref ? c->s0 : c->s1, in->saved_d, c->saved_bytes,
                           cudaMemcpyDeviceToHost));
    return 1;
done:
    return 0;
}

/* `reps` runs of `layer` against the reference copies; counts the runs whose y or saved
 * differed. Returns the runs made. */
static int compare_runs(moefuse_layer *layer, const inputs *in, const moefuse_fwd_args *a,
                        run_copies *c, int reps, int *y_diff, int *s_diff) {
    int rep = 0;
    for (; rep < reps && run_and_copy(layer, in, a, c, 0); rep++) {
        *y_diff += memcmp(c->y0, c->y1, c->y_bytes) != 0;
        *s_diff += memcmp(c->s0, c->s1, c->saved_bytes) != 0;
    }
    return rep;
}

/* 50 repetitions, bitwise identical y and saved; saved = NULL gives the same y. */
static void case_deterministic(void) {
    if (!ready()) return;
    inputs in;
    run_copies c = {0};
    int y_diff = 0, s_diff = 0;
    if (!inputs_make(&in, 1536, ROUTE_ZIPF, 0, 0) || !run_copies_alloc(&c, &in)) goto done;
    moefuse_fwd_args a = fwd_args(&in, 1, 0);
    if (!run_and_copy(F.layer, &in, &a, &c, 1)) goto done;
    const int reps = compare_runs(F.layer, &in, &a, &c, 50, &y_diff, &s_diff);
    CHECK(reps == 50, "ran %d of 50 repetitions", reps);
    CHECK(y_diff == 0, "y differed from the first run in %d of 50 repetitions", y_diff);
    CHECK(s_diff == 0, "saved differed from the first run in %d of 50 repetitions", s_diff);
    MF_OK(moefuse_layer_check(F.layer, F.stream));
    check_y(&in, c.y0);

    a.saved = NULL;
    if (!run_and_copy(F.layer, &in, &a, &c, 0)) goto done;
    CHECK(!memcmp(c.y0, c.y1, c.y_bytes), "y with saved = NULL differs from y with saved");
done:
    run_copies_free(&c);
    inputs_free(&in);
}

/* The fused forward against the staged one (the default pipeline), bit for bit: y and
 * saved ([g | u] and the plan), 50 repetitions over five routings (10 each, fresh inputs
 * per routing, outputs poisoned before each run). A missing or early wait in the fused
 * kernel would show as a difference in some repetition. */
static int fused_vs_staged(moefuse_layer *fused, int T, routing r, int *y_diff, int *s_diff) {
    int reps = 0;
    inputs in;
    run_copies c = {0};
    if (!inputs_make(&in, T, r, 0, 0) || !run_copies_alloc(&c, &in)) goto done;
    const moefuse_fwd_args a = fwd_args(&in, 1, 0);
    if (!run_and_copy(F.layer, &in, &a, &c, 1)) goto done;
    reps = compare_runs(fused, &in, &a, &c, 10, y_diff, s_diff);
    if (r == ROUTE_RANDOM) check_y(&in, c.y1);
done:
    run_copies_free(&c);
    inputs_free(&in);
    return reps;
}

static void case_fused_equals_staged(void) {
    if (!ready()) return;
    const model *m = F.m;
    moefuse_config cfg;
    moefuse_config_init(&cfg, m->H, m->I, m->E, m->K, kMaxTokens);
    cfg.backend = MOEFUSE_BACKEND_CUDA;
    cfg.pipeline = MOEFUSE_PIPELINE_FUSED;
    moefuse_layer *fused = NULL;
    MF_OK(moefuse_layer_create(&cfg, NULL, &fused));
    static const routing kRoutes[] = {ROUTE_RANDOM, ROUTE_ZIPF, ROUTE_ONE_EXPERT,
                                      ROUTE_FEW_EXPERTS, ROUTE_DROPPED};
    static const int kTokens[] = {kMaxTokens, 3000, 2048, 777, 1000};
    int y_diff = 0, s_diff = 0, reps = 0;
    for (int i = 0; i < 5; i++) reps += fused_vs_staged(fused, kTokens[i], kRoutes[i], &y_diff, &s_diff);
    CHECK(reps == 50, "ran %d of 50 repetitions", reps);
    CHECK(y_diff == 0, "fused y differed from staged y in %d of %d repetitions", y_diff, reps);
    CHECK(s_diff == 0, "fused saved differed from staged saved in %d of %d repetitions", s_diff,
          reps);
    MF_OK(moefuse_layer_check(fused, F.stream));
done:
    if (fused) moefuse_layer_destroy(fused);
}

/* Captured in a CUDA graph: replays give the eager bits, also for new inputs written
 * in place between replays. */
static void case_graph(void) {
    if (!ready()) return;
    const int T = 640;
    inputs in, in2;
    memset(&in2, 0, sizeof in2);
    uint16_t *ye = NULL, *yg = NULL;
    uint8_t *se = NULL, *sg = NULL;
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    if (!inputs_make(&in, T, ROUTE_RANDOM, 0, 0)) goto done;
    if (!inputs_make(&in2, T, ROUTE_ZIPF, 0, 0)) goto done; /* host inputs of the 2nd round */
    moefuse_fwd_args a = fwd_args(&in, 1, 1);
    const size_t yb = (size_t)T * in.y_stride * 2;
    ye = malloc(yb);
    yg = malloc(yb);
    se = malloc(in.saved_bytes);
    sg = malloc(in.saved_bytes);
    for (int round = 0; round < 2; round++) {
        if (round == 1) { /* new inputs in place */
            CUDA_OK(cudaMemcpy(in.x_d, in2.x, (size_t)T * in.x_stride * 2, cudaMemcpyHostToDevice));
            CUDA_OK(cudaMemcpy(in.ids_d, in2.ids, (size_t)T * in.K * 4, cudaMemcpyHostToDevice));
            CUDA_OK(cudaMemcpy(in.p_d, in2.p, (size_t)T * in.K * 4, cudaMemcpyHostToDevice));
        }
        /* eager */
        CUDA_OK(cudaMemsetAsync(in.y_d, 0xff, yb, F.stream));
        CUDA_OK(cudaMemsetAsync(in.saved_d, 0xcd, in.saved_bytes, F.stream));
        MF_OK(moefuse_forward(F.layer, &a, F.stream));
        MF_OK(moefuse_layer_check(F.layer, F.stream));
        CUDA_OK(cudaMemcpy(ye, in.y_d, yb, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(se, in.saved_d, in.saved_bytes, cudaMemcpyDeviceToHost));
        if (round == 0) {
            CUDA_OK(cudaStreamBeginCapture(F.stream, cudaStreamCaptureModeGlobal));
            moefuse_status st = moefuse_forward(F.layer, &a, F.stream);
            cudaError_t ce = cudaStreamEndCapture(F.stream, &graph);
            CHECK(st == MOEFUSE_OK, "forward under capture: %s", moefuse_last_error());
            CUDA_OK(ce);
            if (st != MOEFUSE_OK) goto done;
            CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
        }
        CUDA_OK(cudaMemsetAsync(in.y_d, 0xff, yb, F.stream));
        CUDA_OK(cudaMemsetAsync(in.saved_d, 0xcd, in.saved_bytes, F.stream));
        CUDA_OK(cudaGraphLaunch(exec, F.stream));
        CUDA_OK(cudaGraphLaunch(exec, F.stream)); /* twice: per-call state resets itself */
        MF_OK(moefuse_layer_check(F.layer, F.stream));
        CUDA_OK(cudaMemcpy(yg, in.y_d, yb, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(sg, in.saved_d, in.saved_bytes, cudaMemcpyDeviceToHost));
        CHECK(!memcmp(ye, yg, yb), "round %d: graph replay y differs from eager y", round);
        CHECK(!memcmp(se, sg, in.saved_bytes), "round %d: graph replay saved differs", round);
    }
    if (in2.ids) { /* y of the 2nd round against the reference */
        memcpy(in.x, in2.x, (size_t)T * in.x_stride * 2);
        memcpy(in.ids, in2.ids, (size_t)T * in.K * 4);
        memcpy(in.p, in2.p, (size_t)T * in.K * 4);
        check_y(&in, yg);
    }
done:
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    free(ye);
    free(yg);
    free(se);
    free(sg);
    inputs_free(&in);
    inputs_free(&in2);
}

/* test_cuda_forward_bitwise [model-substring [case-substring]]: all cases by default; the filters keep
 * sanitizer runs small. */
int main(int argc, char **argv) {
    static const named_case cases[] = {
        {case_deterministic, "50 repetitions bitwise"},
        {case_fused_equals_staged, "fused equals staged, 50 repetitions"},
        {case_graph, "cuda graph replay"},
    };
    return forward_main(argc, argv, cases, (int)(sizeof cases / sizeof cases[0]));
}
