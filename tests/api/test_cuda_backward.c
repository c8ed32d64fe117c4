/* The CUDA backward, through the public API with device buffers, against the fp64
 * reference (src/cpu/reference.h, mf_ref_backward) on fresh random inputs.
 *
 *   - qwen3-30b-a3b (E = 128) and qwen3-235b-a22b with E = 16 instead of 128 (the fp64
 *     weights of 128 experts are 19 GB of host memory; 16 keep H, I, K and the GEMM
 *     shapes and give each expert 8x the rows), T in {1, 7, 512, 4096 (= max)};
 *   - routing edge cases: all tokens on one expert, most experts empty, T = 1 with one
 *     slot, dropped slots with fully dropped tokens (row strides > H), Zipf;
 *   - T = 0: the weight gradients written as zeros (write mode) or untouched (accumulate).
 * The bitwise cases (saved modes, accumulate, bf16 dW, repetitions, graphs, fused =
 * staged, a bad saved buffer) are in test_cuda_backward_modes.c; the fixture both share
 * in cuda_backward.{h,c}, cuda_backward_ref.c.
 *
 * How the reference stays affordable. Every gradient is a sum over slots of a slot's
 * own contribution, so the reference runs per group of slots of ONE expert
 * (mf_ref_backward with E = 1, K = 1 on that expert's fp64 weights, no copy), groups
 * in parallel, and the fp64 results are summed:
 *   dx, d p   dx_t and dp[t,:] depend only on token t: all slots of a random subset of
 *             kCheckTokens tokens (all tokens when T is smaller), dx_t = sum over k;
 *   dW        needs every row of an expert. A SECOND GPU call (forward + backward) runs
 *             with masked ids: only the slots of the kMaskExperts most loaded experts
 *             stay, at most kMaskSlots of each (the first in token order); every other
 *             slot is -1. Its dW13/dW2 of the kept experts are checked against the
 *             reference over exactly those slots, and every other expert's dW must be
 *             exactly 0 (write mode). At T = 4096 an expert of qwen3-30b-a3b keeps all
 *             its ~256 rows, i.e. the weight-gradient GEMM reduces over several 128-row
 *             blocks; the fp64 cost stays ~20 GFLOP per case.
 *
 * Tolerances th_bf16_tolerance(n), n = the bf16 roundings on each path (x, dy, p and
 * the weights are exact inputs of both sides). g and u are rounded separately and each
 * enters the result on its own, so they count as two, as in tests/cpu/test_cpu_backend.c:
 *   dx        6: g, u saved as bf16, da' = W2^T dy as bf16 (dgrad2's store warps take it
 *                so), dh = [dg;du] as bf16, each slot's dx row as bf16 (combine), dx
 *                after the fp32 sum over k;
 *   dweights  4: g, u as bf16, a = silu(g) u as bf16, da' as bf16 (d p = <da', a> in fp32);
 *             a dot product's rounding error scales with its terms, not with its sum,
 *             which may cancel: the error is relative to the l2 norm over the checked
 *             slots of ||W2^T dy o a||_2 (dp_term_norm), not to the l2 norm of d p;
 *   dW13      4: g, u as bf16, da' as bf16, dh as bf16 (xs is exact);
 *   dW2       4: g, u as bf16, a as bf16, act_p = p a as bf16 (dys is exact).
 * Errors are relative l2 over the checked elements. Outputs are poisoned (NaN) first.
 *
 * With no sm_90 device every case prints SKIP with the reason. MOEFUSE_TEST_PIPELINE=fused
 * makes the fused pipeline the fixture's (the default is staged). */
#include <cuda_runtime.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

/* One backward on fresh inputs: dx and d p on the full call, dW on the masked one. */
static void backward_case(int T, routing r, int64_t pad) {
    if (!ready()) return;
    inputs in;
    uint16_t *dx = NULL;
    float *dp = NULL;
    if (!inputs_make(&in, T, r, pad)) goto done;
    MF_OK(run_fwd_bwd(F.layer, &in, 1));
    const int64_t T1 = T > 0 ? T : 1;
    dx = malloc((size_t)(T1 * in.dx_stride) * 2);
    dp = malloc((size_t)(T1 * in.K) * 4);
    CUDA_OK(cudaMemcpy(dx, in.dx_d, (size_t)(T1 * in.dx_stride) * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(dp, in.dp_d, (size_t)(T1 * in.K) * 4, cudaMemcpyDeviceToHost));
    check_dx_dp(&in, dx, dp);
    check_dw_masked(&in);
done:
    free(dx);
    free(dp);
    inputs_free(&in);
}

/* Counts the 2-byte words of a device buffer that differ from `want`, in 64 MB pieces. */
static int64_t count_words_not(const void *dev, int64_t words, uint16_t want) {
    const int64_t piece = 32 << 20;
    uint16_t *h = malloc((size_t)piece * 2);
    int64_t bad = 0;
    for (int64_t i = 0; h && i < words; i += piece) {
        const int64_t n = words - i < piece ? words - i : piece;
        if (cudaMemcpy(h, (const uint16_t *)dev + i, (size_t)n * 2, cudaMemcpyDeviceToHost) !=
            cudaSuccess) {
            bad = -1;
            break;
        }
        for (int64_t j = 0; j < n; j++) bad += h[j] != want;
    }
    free(h);
    return h ? bad : -1;
}

/* T = 0: write mode writes zeros into every weight gradient, fp32 and bf16; accumulate
 * mode leaves them as they were (poison here). */
static void case_t0(void) {
    if (!ready()) return;
    inputs in;
    uint16_t *d13 = NULL, *d2 = NULL;
    if (!inputs_make(&in, 0, ROUTE_RANDOM, 0)) goto done;
    MF_OK(run_fwd_bwd(F.layer, &in, 1));   /* poisons dW first */
    CHECK(count_words_not(F.dw13_d, 2 * n13(), 0) == 0 &&
              count_words_not(F.dw2_d, 2 * n2(), 0) == 0,
          "T=0, fp32 write mode: weight gradients not all zero");

    /* Poison on the call's stream: it does not wait for the legacy default stream. */
    CUDA_OK(cudaMemsetAsync(F.dw13_d, 0xff, (size_t)n13() * 4, F.stream));
    CUDA_OK(cudaMemsetAsync(F.dw2_d, 0xff, (size_t)n2() * 4, F.stream));
    moefuse_bwd_args b = bwd_args(&in, 1);
    MF_OK(moefuse_backward(F.layer, &b, F.stream));
    CUDA_OK(cudaStreamSynchronize(F.stream));
    CHECK(count_words_not(F.dw13_d, 2 * n13(), 0xffff) == 0 &&
              count_words_not(F.dw2_d, 2 * n2(), 0xffff) == 0,
          "T=0, accumulate: weight gradients changed");

    CUDA_OK(cudaMalloc((void **)&d13, (size_t)n13() * 2));
    CUDA_OK(cudaMalloc((void **)&d2, (size_t)n2() * 2));
    CUDA_OK(cudaMemsetAsync(d13, 0xff, (size_t)n13() * 2, F.stream));
    CUDA_OK(cudaMemsetAsync(d2, 0xff, (size_t)n2() * 2, F.stream));
    MF_OK(backward_dw_bf16(&in, d13, d2));
    CHECK(count_words_not(d13, n13(), 0) == 0 && count_words_not(d2, n2(), 0) == 0,
          "T=0, bf16 write mode: weight gradients not all zero");
done:
    cudaFree(d13);
    cudaFree(d2);
    inputs_free(&in);
}

static void case_t1(void) { backward_case(1, ROUTE_RANDOM, 0); }
static void case_t1_one_slot(void) { backward_case(1, ROUTE_ONE_EXPERT, 0); }
static void case_t7(void) { backward_case(7, ROUTE_RANDOM, 0); }
static void case_t512(void) { backward_case(512, ROUTE_RANDOM, 0); }
static void case_tmax(void) { backward_case(kMaxTokens, ROUTE_RANDOM, 0); }
static void case_one_expert(void) { backward_case(kMaxTokens, ROUTE_ONE_EXPERT, 0); }
static void case_few_experts(void) { backward_case(777, ROUTE_FEW_EXPERTS, 0); }
static void case_dropped(void) { backward_case(1000, ROUTE_DROPPED, 8); }
static void case_zipf(void) { backward_case(3000, ROUTE_ZIPF, 0); }

/* test_cuda_backward [model-substring [case-substring]] */
int main(int argc, char **argv) {
    static const named_case cases[] = {
        {case_t0, "T=0 weight gradients zero / untouched"},
        {case_t1, "T=1"},
        {case_t1_one_slot, "T=1 one slot"},
        {case_t7, "T=7"},
        {case_t512, "T=512"},
        {case_tmax, "T=4096 (max)"},
        {case_one_expert, "T=4096 all tokens on one expert"},
        {case_few_experts, "T=777 three experts, rest empty"},
        {case_dropped, "T=1000 dropped slots and tokens, strided x/dy/dx"},
        {case_zipf, "T=3000 zipf routing"},
    };
    return backward_main(argc, argv, cases, (int)(sizeof cases / sizeof cases[0]));
}
