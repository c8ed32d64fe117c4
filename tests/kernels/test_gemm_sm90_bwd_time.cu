/* The timing of the sm_90a backward GEMM kernels (test_gemm_sm90_bwd.cu checks their
 * results): each kernel at the Qwen3 shapes (skewed, heavily skewed, collapsed and nearly
 * collapsed routings), launches interleaved round by round, TFLOP/s printed; the bf16
 * wgrad without and with the experts' order, and the fused backward's kernel
 * (dW2 + dgrad1 + dW13) against the three. A case fails only when a launch fails, never
 * on speed. */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <string.h>

#include <algorithm>
#include <vector>

extern "C" {
#include "harness.h"
}
#include "gemm_test_util.h"
#include "kernels.h"

/* ---- timing at the Qwen3 shapes -------------------------------------------------------- */
/* Median ms of each launch over 10 timed rounds (after 3 untimed), the launches taking
 * turns within a round: under this load the H200 reaches its power limit within
 * seconds and lowers its clock, so variants timed one after the other are not
 * comparable (docs/decisions/0013-power-limit-timing). -1 for a launch that failed. */
template <class... F>
static std::vector<float> time_interleaved_ms(F &&...launch) {
    cudaEvent_t t0, t1;
    cudaEventCreate(&t0);
    cudaEventCreate(&t1);
    constexpr size_t n = sizeof...(F);
    std::vector<std::vector<float>> ms(n);
    std::vector<bool> failed(n, false);
    for (int it = 0; it < 13; ++it) {
        size_t i = 0;
        auto one = [&](auto &&fn) {
            float a = 0;
            cudaEventRecord(t0);
            const cudaError_t e = fn();
            cudaEventRecord(t1);
            cudaEventSynchronize(t1);
            cudaEventElapsedTime(&a, t0, t1);
            if (e != cudaSuccess) failed[i] = true;
            if (it >= 3) ms[i].push_back(a);
            ++i;
        };
        (one(launch), ...);
    }
    cudaEventDestroy(t0);
    cudaEventDestroy(t1);
    std::vector<float> out(n);
    for (size_t i = 0; i < n; ++i) out[i] = failed[i] ? -1.f : median(ms[i]);
    return out;
}

template <class F>
static float time_ms(F &&launch) { return time_interleaved_ms(launch)[0]; }

static void time_model(const char *name, int H, int I, int E, int tokens, int top_k,
                       const std::vector<int> &counts) {
    if (!have_sm90()) return;
    const int total = tokens * top_k;
    Layout L = make_layout(counts, 0, 0);
    const int R = L.rows_cap, parts = mf_dgrad2_dp_parts(I), sms = num_sms();

    /* Padding rows hold hash values here too; timing does not depend on them. */
    uint16_t *dys, *gu, *w2, *w13, *dh, *actp, *comb, *xs;
    float *dp, *dw2, *dw13;
    uint16_t *dw2b, *dw13b;
    CUDA_OK(cudaMalloc(&dys, (size_t)R * H * 2));
    CUDA_OK(cudaMalloc(&xs, (size_t)R * H * 2));
    CUDA_OK(cudaMalloc(&gu, (size_t)R * 2 * I * 2));
    CUDA_OK(cudaMalloc(&dh, (size_t)R * 2 * I * 2));
    CUDA_OK(cudaMalloc(&actp, (size_t)R * I * 2));
    CUDA_OK(cudaMalloc(&w2, (size_t)E * H * I * 2));
    CUDA_OK(cudaMalloc(&w13, (size_t)E * 2 * I * H * 2));
    CUDA_OK(cudaMalloc(&comb, (size_t)L.num_slots * H * 2));
    CUDA_OK(cudaMalloc(&dp, (size_t)R * parts * 4));
    CUDA_OK(cudaMalloc(&dw2, (size_t)E * H * I * 4));
    CUDA_OK(cudaMalloc(&dw13, (size_t)E * 2 * I * H * 4));
    CUDA_OK(cudaMalloc(&dw2b, (size_t)E * H * I * 2));
    CUDA_OK(cudaMalloc(&dw13b, (size_t)E * 2 * I * H * 2));
    const uint32_t seed = (uint32_t)th_rand_u64();
    fill_hash_bf16<<<1024, 256>>>((__nv_bfloat16 *)dys, (size_t)R * H, seed, 1.f);
    fill_hash_bf16<<<1024, 256>>>((__nv_bfloat16 *)xs, (size_t)R * H, seed + 1, 1.f);
    fill_hash_bf16<<<1024, 256>>>((__nv_bfloat16 *)gu, (size_t)R * 2 * I, seed + 2, 2.f);
    fill_hash_bf16<<<1024, 256>>>((__nv_bfloat16 *)w2, (size_t)E * H * I, seed + 3, 1.f / 32);
    fill_hash_bf16<<<1024, 256>>>((__nv_bfloat16 *)w13, (size_t)E * 2 * I * H, seed + 4, 1.f / 32);
    std::vector<float> swh(L.num_slots);
    for (auto &w : swh) w = (float)(0.05 + th_uniform());
    float *rw = dev_upload(row_weights(L, swh));
    int32_t *rbe = dev_upload(L.row_block_expert), *slot = dev_upload(L.row_slot),
            *nr = dev_upload(std::vector<int32_t>{L.num_rows}), *off = dev_upload(L.offsets);
    CUDA_OK(cudaDeviceSynchronize());

    /* operands: a zeroed mf_operand is bf16, unscaled */
    const mf_rows rows = {rbe, nullptr, nr, R, E}, segments = {nullptr, off, nullptr, R, E};
    mf_dgrad2_params p2 = {rows, {dys}, {w2}, gu, slot, rw, dh, actp, dp, H, I, sms};
    mf_dgrad1_params p1 = {rows, {dh}, {w13}, {slot, comb}, H, I, sms};
    mf_wgrad_params pw2 = {segments, {dys}, {actp}, dw2, nullptr, H, I, 0, sms};
    mf_wgrad_params pw13 = {segments, {dh}, {xs}, dw13, nullptr, 2 * I, H, 0, sms};
    mf_wgrad_params pw13a = pw13;
    pw13a.accumulate = 1;
    mf_wgrad_params pw2b = pw2, pw13b = pw13;   /* bf16 out: the store-warp instantiation */
    pw2b.dw = pw13b.dw = nullptr;
    pw2b.dw_bf16 = dw2b;
    pw13b.dw_bf16 = dw13b;
    int32_t *order = nullptr;   /* the backward's order (mf_expert_order) */
    CUDA_OK(cudaMalloc(&order, (E + 1) * 4));
    CUDA_OK(mf_expert_order(off, E, order, 0));
    mf_wgrad_params pw2o = pw2b, pw13o = pw13b;
    pw2o.expert_order = pw13o.expert_order = order;
    const float m2 = time_ms([&] { return mf_sm90_gemm2_dgrad_swiglu_bwd_bf16(&p2, 0); });
    const float m1 = time_ms([&] { return mf_sm90_gemm1_dgrad_bwd_bf16(&p1, 0); });
    const float mw2 = time_ms([&] { return mf_sm90_wgrad_grouped_bf16(&pw2, 0); });
    const float mw13 = time_ms([&] { return mf_sm90_wgrad_grouped_bf16(&pw13, 0); });
    const float mw13a = time_ms([&] { return mf_sm90_wgrad_grouped_bf16(&pw13a, 0); });
    /* bf16 without and with the order: interleaved, so at the same clocks */
    const std::vector<float> w2bo =
        time_interleaved_ms([&] { return mf_sm90_wgrad_grouped_bf16(&pw2b, 0); },
                            [&] { return mf_sm90_wgrad_grouped_bf16(&pw2o, 0); });
    const std::vector<float> w13bo =
        time_interleaved_ms([&] { return mf_sm90_wgrad_grouped_bf16(&pw13b, 0); },
                            [&] { return mf_sm90_wgrad_grouped_bf16(&pw13o, 0); });
    const float mw2b = w2bo[0], mw2o = w2bo[1], mw13b = w13bo[0], mw13o = w13bo[1];
    /* The fused backward's kernel against the three it replaces, as the pipelines run them
     * (bf16 out, ordered), interleaved. Here dys and the dx slot rows are separate buffers;
     * the fused kernel's dW2 wait runs all the same. */
    const bool fused = mf_sm90_moe_fused_bwd_takes(H, I);
    uint32_t *scratch = nullptr;
    CUDA_OK(cudaMalloc(&scratch, 2 * sizeof(uint32_t)));
    const mf_moe_fused_bwd_params pf = {pw2o, p1, pw13o, scratch};
    std::vector<float> fs = {0.f, 0.f};
    if (fused)
        fs = time_interleaved_ms(
            [&] {
                cudaError_t e = mf_sm90_wgrad_grouped_bf16(&pw2o, 0);
                if (e == cudaSuccess) e = mf_sm90_gemm1_dgrad_bwd_bf16(&p1, 0);
                return e == cudaSuccess ? mf_sm90_wgrad_grouped_bf16(&pw13o, 0) : e;
            },
            [&] { return mf_sm90_moe_fused_bwd_bf16(&pf, 0); });
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaDeviceSynchronize());
    const double v = (double)total;
    const double f_small = 2.0 * v * H * I, f_big = 2.0 * v * 2 * I * H;
    const int most = *std::max_element(counts.begin(), counts.end());
    printf("  %-16s rows %d (padded %d) E=%d H=%d I=%d sms=%d, busiest expert %.2f x mean\n",
           name, total, L.num_rows, E, H, I, sms, most * (double)E / total);
    printf("  %-16s dgrad2+swiglu_bwd+dp  %8.3f ms %6.1f TFLOP/s\n", name, m2, f_small / m2 * 1e-9);
    printf("  %-16s dgrad1+scatter        %8.3f ms %6.1f TFLOP/s\n", name, m1, f_big / m1 * 1e-9);
    printf("  %-16s wgrad dW2  (write)    %8.3f ms %6.1f TFLOP/s\n", name, mw2, f_small / mw2 * 1e-9);
    printf("  %-16s wgrad dW13 (write)    %8.3f ms %6.1f TFLOP/s\n", name, mw13, f_big / mw13 * 1e-9);
    printf("  %-16s wgrad dW13 (accum)    %8.3f ms %6.1f TFLOP/s\n", name, mw13a, f_big / mw13a * 1e-9);
    printf("  %-16s wgrad dW2  (bf16)     %8.3f ms %6.1f TFLOP/s\n", name, mw2b, f_small / mw2b * 1e-9);
    printf("  %-16s wgrad dW13 (bf16)     %8.3f ms %6.1f TFLOP/s\n", name, mw13b, f_big / mw13b * 1e-9);
    printf("  %-16s wgrad dW2  (bf16, ordered) %8.3f ms %6.1f TFLOP/s\n", name, mw2o,
           f_small / mw2o * 1e-9);
    printf("  %-16s wgrad dW13 (bf16, ordered) %8.3f ms %6.1f TFLOP/s\n", name, mw13o,
           f_big / mw13o * 1e-9);
    if (fused) {
        const double f3 = f_small + 2 * f_big;   /* dW2 + dgrad1 + dW13 */
        printf("  %-16s dW2, dgrad1, dW13 (bf16, ordered) %8.3f ms %6.1f TFLOP/s\n", name, fs[0],
               f3 / fs[0] * 1e-9);
        printf("  %-16s fused dW2+dgrad1+dW13      %8.3f ms %6.1f TFLOP/s (%.1f%% of the three)\n",
               name, fs[1], f3 / fs[1] * 1e-9, 100.0 * fs[1] / fs[0]);
    }
    CHECK(m2 > 0 && m1 > 0 && mw2 > 0 && mw13 > 0 && mw13a > 0 && mw2b > 0 && mw13b > 0 &&
              mw2o > 0 && mw13o > 0 && (!fused || (fs[0] > 0 && fs[1] > 0)),
          "a timed launch failed");
    cudaFree(dys); cudaFree(xs); cudaFree(gu); cudaFree(dh); cudaFree(actp); cudaFree(w2);
    cudaFree(w13); cudaFree(comb); cudaFree(rw); cudaFree(dp); cudaFree(dw2); cudaFree(dw13);
    cudaFree(dw2b); cudaFree(dw13b);
    cudaFree(rbe); cudaFree(slot); cudaFree(nr); cudaFree(off); cudaFree(order);
    cudaFree(scratch);
}

static void time_qwen3_30b(void) {
    time_model("qwen3-30b-a3b", 2048, 768, 128, 16384, 8, skewed_counts(128, 16384 * 8));
}
static void time_qwen3_235b(void) {
    time_model("qwen3-235b-a22b", 4096, 1536, 128, 16384, 8, skewed_counts(128, 16384 * 8));
}
/* Skewed routing (heavy_skew_counts: the busiest expert ~5x the mean). */
static void time_qwen3_30b_heavy_skew(void) {
    time_model("qwen3-30b-a3b", 2048, 768, 128, 16384, 8, heavy_skew_counts(128, 16384 * 8));
}
/* Collapsed routing, as in bench_train_step.py's randomly initialized model: every token
 * picks the same 8 experts, 120 have no rows. */
static void time_qwen3_30b_collapsed(void) {
    std::vector<int> counts(128, 0);
    for (int e = 0; e < 128; e += 16) counts[e] = 16384;
    time_model("qwen3-30b-a3b", 2048, 768, 128, 16384, 8, counts);
}
/* Nearly collapsed, like that model's first layer: 8 experts with 13-16 K rows, the other
 * ~9% of the rows on 40 experts, 80 without rows. */
static void time_qwen3_30b_nearly_collapsed(void) {
    std::vector<int> counts(128, 0);
    int light = 16384 * 8;
    for (int i = 0; i < 8; ++i) {
        counts[8 * i + 1] = th_rand_int(13000, 16384);
        light -= counts[8 * i + 1];
    }
    int left = light;
    for (int i = 0; i < 40; ++i) {   /* weights 1, 2, 3, 1, ...: sum 79 */
        counts[64 + i] = light * (1 + i % 3) / 79;
        left -= counts[64 + i];
    }
    counts[64] += left;
    time_model("qwen3-30b-a3b", 2048, 768, 128, 16384, 8, counts);
}

/* An optional argument runs only the cases whose name contains it. */
int main(int argc, char **argv) {
    static const struct { const char *name; void (*fn)(void); } cases[] = {
        {"gemm_sm90_bwd_time_qwen3_30b", time_qwen3_30b},
        {"gemm_sm90_bwd_time_qwen3_235b", time_qwen3_235b},
        {"gemm_sm90_bwd_time_qwen3_30b_heavy_skew", time_qwen3_30b_heavy_skew},
        {"gemm_sm90_bwd_time_qwen3_30b_collapsed", time_qwen3_30b_collapsed},
        {"gemm_sm90_bwd_time_qwen3_30b_nearly_collapsed", time_qwen3_30b_nearly_collapsed},
    };
    th_seed_from_env_or_clock();
    for (const auto &c : cases)
        if (argc < 2 || strstr(c.name, argv[1])) th_run(c.name, c.fn);
    return th_finish();
}
