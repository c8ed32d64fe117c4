/* The CUDA layer with W13 and dW13 in two halves (moefuse.h, "W13 in two halves":
 * w13_up, dw13_up, dw13_up_bf16), through the public API with device buffers (the fixture
 * of test_cuda_backward.c, in cuda_backward.{h,c}): bitwise the packed layout's outputs,
 * staged, recomputed and fused, fp32 dW written and accumulated, bf16 dW. The FP8
 * layer's dW13 halves: test_cuda_fp8.c.
 *
 * With no sm_90 device every case prints SKIP with the reason. */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_backward.h"
#include "fixture_cuda.h"
#include "harness.h"
#include "moefuse.h"

/* W13 and dW13 in two halves (moefuse.h, w13_up; separate allocations) give the packed
 * layout's bits: y, dx, d p, dW2 and dW13 (its halves copied back into the packed
 * layout), fp32 dW written and accumulated, bf16 dW. */
static void halves_case(moefuse_saved_mode mode, moefuse_pipeline pipeline, int T, routing r) {
    if (!ready()) return;
    inputs in;
    outputs a, b;
    memset(&a, 0, sizeof a);
    memset(&b, 0, sizeof b);
    memset(&in, 0, sizeof in);
    const size_t half = (size_t)n13() / 2, y_bytes = (size_t)T * F.m->H * 2;
    uint16_t *gate = NULL, *up = NULL, *g16 = NULL, *u16 = NULL, *p13 = NULL, *p2 = NULL;
    uint16_t *ya = malloc(y_bytes ? y_bytes : 1), *yb = malloc(y_bytes ? y_bytes : 1);
    uint16_t *h13[2] = {malloc((size_t)n13() * 2), malloc((size_t)n13() * 2)};
    uint16_t *h2[2] = {malloc((size_t)n2() * 2), malloc((size_t)n2() * 2)};
    float *dgate = NULL, *dup = NULL;
    moefuse_layer *ml = make_layer(mode, pipeline, T);
    CHECK(ml != NULL, "layer of saved_mode %d, pipeline %d", (int)mode, (int)pipeline);
    if (!ml || !inputs_make(&in, T, r, 0)) goto done;
    CUDA_OK(cudaMalloc((void **)&gate, half * 2));
    CUDA_OK(cudaMalloc((void **)&up, half * 2));
    CUDA_OK(cudaMalloc((void **)&dgate, half * 4));
    CUDA_OK(cudaMalloc((void **)&dup, half * 4));
    CUDA_OK(cudaMalloc((void **)&g16, half * 2));
    CUDA_OK(cudaMalloc((void **)&u16, half * 2));
    CUDA_OK(cudaMalloc((void **)&p13, (size_t)n13() * 2));
    CUDA_OK(cudaMalloc((void **)&p2, (size_t)n2() * 2));
    CUDA_OK(w13_halves_copy(F.w13_d, gate, up, 2, 1));
    const w13_halves h = {gate, up, dgate, dup};

    /* write mode */
    MF_OK(run_fwd_bwd(ml, &in, 1));
    CHECK(outputs_get(&a, &in), "copy");
    CUDA_OK(cudaMemcpy(ya, in.y_d, y_bytes, cudaMemcpyDeviceToHost));
    MF_OK(run_fwd_bwd_halves(ml, &in, 1, &h));
    CUDA_OK(cudaMemsetAsync(F.dw13_d, 0xff, (size_t)n13() * 4, F.stream));
    CUDA_OK(w13_halves_copy(F.dw13_d, dgate, dup, 4, 0));
    CHECK(outputs_get(&b, &in), "copy");
    CUDA_OK(cudaMemcpy(yb, in.y_d, y_bytes, cudaMemcpyDeviceToHost));
    CHECK(outputs_equal(&a, &b) && !memcmp(ya, yb, y_bytes), "halves differ from packed");

    /* accumulate onto the write-mode gradients (b's, = a's) */
    MF_OK(run_fwd_bwd(ml, &in, 0));
    CHECK(outputs_get(&a, &in), "copy");
    /* on F.stream (non-blocking): a legacy-stream copy may land after the split reads it */
    CUDA_OK(cudaMemcpyAsync(F.dw13_d, b.dw13, (size_t)n13() * 4, cudaMemcpyHostToDevice,
                            F.stream));
    CUDA_OK(cudaMemcpyAsync(F.dw2_d, b.dw2, (size_t)n2() * 4, cudaMemcpyHostToDevice, F.stream));
    CUDA_OK(w13_halves_copy(F.dw13_d, dgate, dup, 4, 1));
    MF_OK(run_fwd_bwd_halves(ml, &in, 0, &h));
    CUDA_OK(w13_halves_copy(F.dw13_d, dgate, dup, 4, 0));
    CHECK(outputs_get(&b, &in), "copy");
    CHECK(outputs_equal(&a, &b), "accumulated halves differ from packed");

    /* bf16 dW (the saved buffer of the last forward: the same bits either way) */
    MF_OK(backward_dw_bf16_on(ml, &in, p13, p2));
    CUDA_OK(cudaMemcpy(h13[0], p13, (size_t)n13() * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(h2[0], p2, (size_t)n2() * 2, cudaMemcpyDeviceToHost));
    /* every output poisoned first, on the backward's stream */
    CUDA_OK(cudaMemsetAsync(p13, 0xff, (size_t)n13() * 2, F.stream));
    CUDA_OK(cudaMemsetAsync(p2, 0xff, (size_t)n2() * 2, F.stream));
    CUDA_OK(cudaMemsetAsync(g16, 0xff, half * 2, F.stream));
    CUDA_OK(cudaMemsetAsync(u16, 0xff, half * 2, F.stream));
    moefuse_bwd_args bb = bwd_args(&in, 0);
    bb.w13 = gate;
    bb.w13_up = up;
    bb.dw13 = NULL;
    bb.dw2 = NULL;
    bb.dw13_bf16 = g16;
    bb.dw13_up_bf16 = u16;
    bb.dw2_bf16 = p2;
    MF_OK(moefuse_backward(ml, &bb, F.stream));
    CUDA_OK(w13_halves_copy(p13, g16, u16, 2, 0));
    CUDA_OK(cudaStreamSynchronize(F.stream));
    CUDA_OK(cudaMemcpy(h13[1], p13, (size_t)n13() * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(h2[1], p2, (size_t)n2() * 2, cudaMemcpyDeviceToHost));
    CHECK(!memcmp(h13[0], h13[1], (size_t)n13() * 2) && !memcmp(h2[0], h2[1], (size_t)n2() * 2),
          "bf16 dW with dW13 in halves differs from packed");
    MF_OK(moefuse_layer_check(ml, F.stream));
done:
    if (ml) moefuse_layer_destroy(ml);
    cudaFree(gate);
    cudaFree(up);
    cudaFree(dgate);
    cudaFree(dup);
    cudaFree(g16);
    cudaFree(u16);
    cudaFree(p13);
    cudaFree(p2);
    free(ya);
    free(yb);
    for (int i = 0; i < 2; i++) {
        free(h13[i]);
        free(h2[i]);
    }
    outputs_free(&a);
    outputs_free(&b);
    inputs_free(&in);
}

static void case_halves_staged(void) {
    halves_case(MOEFUSE_SAVE_ACTIVATIONS, MOEFUSE_PIPELINE_STAGED, 1000, ROUTE_ZIPF);
}
static void case_halves_recompute(void) {
    halves_case(MOEFUSE_RECOMPUTE, MOEFUSE_PIPELINE_STAGED, 777, ROUTE_FEW_EXPERTS);
}
static void case_halves_fused(void) {
    halves_case(MOEFUSE_SAVE_ACTIVATIONS, MOEFUSE_PIPELINE_FUSED, 2048, ROUTE_DROPPED);
}

/* test_cuda_backward_halves [model-substring [case-substring]] */
int main(int argc, char **argv) {
    static const named_case cases[] = {
        {case_halves_staged, "W13 in two halves bitwise = packed, staged"},
        {case_halves_recompute, "W13 in two halves bitwise = packed, recompute"},
        {case_halves_fused, "W13 in two halves bitwise = packed, fused"},
    };
    return backward_main(argc, argv, cases, (int)(sizeof cases / sizeof cases[0]));
}
