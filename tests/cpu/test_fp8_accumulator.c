/* A model of Hopper's FP8 wgmma accumulation, and the GPU tolerances derived from it.
 * The GPU's FP8 GEMMs are checked against the fp64 emulation of the recipe with
 * th_acc_wgmma_fp8 (one GEMM) and th_acc_wgmma_fp8_rms (the layer chains, harness.h);
 * here a truncating model of the tensor core's accumulator, run on the CPU, must stay
 * within the per-GEMM rule, and the layer tolerances the GPU tests will use are printed
 * for the record (api/test_cuda_fp8.c checks them on the device). */
#include "fixture.h"
#include "fp8.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

/* x truncated toward zero to the 14 significant bits below the exponent of `top`. */
static double truncate14(double x, double top) {
    int ex;
    frexp(top, &ex);
    double ulp = ldexp(1.0, ex - 14);
    return trunc(x / ulp) * ulp;
}

/* The per-GEMM rule against a model of Hopper's FP8 accumulation: each wgmma k32 step adds
 * its 32 exact products to the accumulator aligned to the largest addend and truncated to
 * 14 bits; every 128 of K the block sum is scaled and added in fp32. Fresh E4M3 operands
 * with random tile scales, K = 2048 and 4096; the error against the exact fp64 blocks
 * must stay within 2 * th_acc_wgmma_fp8(K). */
static void gpu_gemm_rule_against_a_model(void) {
    enum { M = 16, N = 16 };
    const int64_t ks[2] = {2048, 4096};
    for (int c = 0; c < 2; c++) {
        const int64_t K = ks[c], nbk = K / 128;
        double *a = malloc(sizeof(double) * M * K), *b = malloc(sizeof(double) * N * K);
        double *sa = malloc(sizeof(double) * M * nbk), *sb = malloc(sizeof(double) * nbk);
        for (int64_t i = 0; i < M * K; i++) a[i] = mf_e4m3_decode((uint8_t)th_rand_int(0, 253));
        for (int64_t i = 0; i < N * K; i++) b[i] = mf_e4m3_decode((uint8_t)th_rand_int(0, 253));
        for (int64_t i = 0; i < M * K; i++) a[i] = isnan(a[i]) ? 0.0 : a[i];
        for (int64_t i = 0; i < N * K; i++) b[i] = isnan(b[i]) ? 0.0 : b[i];
        for (int64_t i = 0; i < M * nbk; i++) sa[i] = (float)ldexp(1.0 + th_uniform(), -th_rand_int(4, 12));
        for (int64_t i = 0; i < nbk; i++) sb[i] = (float)ldexp(1.0 + th_uniform(), -th_rand_int(4, 12));
        err_acc e = {0, 0};
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++) {
                double exact = 0.0;
                float gpu = 0.0f;
                for (int64_t blk = 0; blk < nbk; blk++) {
                    double block = 0.0, acc = 0.0;
                    for (int64_t s = 0; s < 4; s++) {
                        double step = 0.0, top = fabs(acc);
                        for (int64_t t = blk * 128 + s * 32; t < blk * 128 + s * 32 + 32; t++) {
                            double p = a[i * K + t] * b[j * K + t];
                            step += p;
                            top = fabs(p) > top ? fabs(p) : top;
                        }
                        block += step;
                        acc = top > 0 ? truncate14(acc + step, top) : 0.0;
                    }
                    const float s2 = (float)(sa[i * nbk + blk] * sb[blk]);
                    exact += s2 * block;
                    gpu += s2 * (float)acc;
                }
                err_add(&e, gpu, exact);
            }
        double tol = 2 * th_acc_wgmma_fp8(K);
        CHECK(err_rel(&e) <= tol, "K = %lld: model error %.3e > 2 acc_gpu(K) = %.3e",
              (long long)K, err_rel(&e), tol);
        printf("    GPU accumulation model, K = %lld: GEMM error %.2e (rule %.2e)\n",
               (long long)K, err_rel(&e), tol);
        free(a); free(b); free(sa); free(sb);
    }
}

/* The tolerances the GPU tests will use (same chains, the tensor cores' accumulation),
 * printed for the record. */
static void print_gpu_tolerances(void) {
    const shape sh[2] = {QWEN3_30B, QWEN3_235B};
    for (int i = 0; i < 2; i++) {
        fp8_tols t = fp8_tolerances(sh[i], 16384 * 8 / 128, th_acc_wgmma_fp8_rms);
        printf("    GPU vs emulation, %s: GEMM %.2e; layer y %.2e dx %.2e dp %.2e dW13 %.2e "
               "dW2 %.2e\n", sh[i].name, 2 * th_acc_wgmma_fp8(sh[i].H), t.y, t.dx, t.dp,
               t.dw13, t.dw2);
    }
}

int main(void) {
    th_seed_from_env_or_clock();
    th_run("GPU per-GEMM rule holds for a model of the FP8 tensor core", gpu_gemm_rule_against_a_model);
    th_run("GPU tolerances (printed)", print_gpu_tolerances);
    return th_finish();
}
