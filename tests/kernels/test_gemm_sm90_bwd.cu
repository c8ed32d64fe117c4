/* The sm_90a backward GEMM kernels (dgrad2 + SwiGLU backward + dp, dgrad1 + combine
 * scatter, K-grouped wgrad) against an fp64 CPU computation, on expert-sorted rows with
 * varied per-expert counts (empty experts, a one-row expert, 1000+-row experts) padded to
 * 128 with zero padding rows; outputs poisoned first. Padding rows must come out zero,
 * rows past num_rows and unrouted combine rows untouched, runs with different grid sizes
 * bitwise equal, and wgrad's accumulate mode exactly write + old. dgrad2 also runs as the
 * pipelines call it, with expert parallelism's block waits: bitwise the plain run when
 * every block's rows are in, and when the rows and their weights are copied in while it
 * runs; a block that never completes ends in the timeout record, not a hang. Then times
 * each kernel at the Qwen3 shapes and prints TFLOP/s, and the fused backward's kernel
 * (dW2 + dgrad1 + dW13) against the three.
 *
 * Tolerances (th_bf16_tolerance(n), n = bf16 roundings on the path, inputs exact bf16):
 *   act_p, combine: one rounding of an fp32 result -> n = 1.
 *   dh: da' = W2^T dy rounded to bf16 (the store warps' input), then dg, du -> n = 2.
 *   dp: fp32 sum of bf16 da' * a; a = bf16(silu(g) u) is computed on both sides but the
 *       device's exp may land a different rounding of a now and then: n = 2.
 *   dW: fp32 accumulation only (n = 0): the norm-wise error of a K-term fp32 sum is
 *       about sqrt(K) * 2^-24 (K <= 1152 here: ~2e-6), inside the rule's 1e-5 floor. */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <chrono>
#include <vector>

extern "C" {
#include "harness.h"
}
#include "gemm_test_util.h"
#include "kernels.h"
extern "C" {
#include "internal.h"
}

template <class T>
static T *dev_upload(const std::vector<T> &v) {
    T *p = nullptr;
    if (cudaMalloc((void **)&p, v.size() * sizeof(T) + 16) != cudaSuccess) return nullptr;
    cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
    return p;
}
template <class T>
static std::vector<T> dev_download(const T *p, size_t n) {
    std::vector<T> v(n);
    cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost);
    return v;
}
/* ---- dgrad2 + dgrad1 ------------------------------------------------------------------ */
static void check_dgrad(int H, int I, const std::vector<int> &counts) {
    if (!have_sm90()) return;
    const int E = (int)counts.size();
    Layout L = make_layout(counts, /*extra_rows=*/256, /*dropped=*/29);
    const int R = L.rows_cap, parts = mf_dgrad2_dp_parts(I);
    CHECK(parts > 0, "mf_dgrad2_dp_parts(%d) = %d", I, parts);
    if (parts <= 0) return;
    const size_t ny = (size_t)R * H, ngu = (size_t)R * 2 * I, n2 = (size_t)E * H * I,
                 n13 = (size_t)E * 2 * I * H;
    std::vector<uint16_t> dys(ny), gu(ngu), w2(n2), w13(n13);
    std::vector<double> dys_d(ny), gu_d(ngu), w2_d(n2), w13_d(n13);
    th_fill_bf16_normal(dys.data(), dys_d.data(), (int64_t)ny, 1.0);
    th_fill_bf16_normal(gu.data(), gu_d.data(), (int64_t)ngu, 1.5);
    th_fill_bf16_normal(w2.data(), w2_d.data(), (int64_t)n2, 1.0 / sqrt((double)H));
    th_fill_bf16_normal(w13.data(), w13_d.data(), (int64_t)n13, 1.0 / sqrt((double)(2 * I)));
    /* dys padding rows are zero (dispatch zeroes them); gate_up padding rows keep random
     * values: the outputs of padding rows must be zero anyway. */
    for (int r = 0; r < R; ++r)
        if (L.row_expert[r] < 0)
            for (int k = 0; k < H; ++k) { dys[(size_t)r * H + k] = 0; dys_d[(size_t)r * H + k] = 0; }
    std::vector<float> sw(L.num_slots);
    for (auto &w : sw) w = (float)(0.05 + th_uniform());

    int32_t *d_rbe = dev_upload(L.row_block_expert), *d_slot = dev_upload(L.row_slot);
    int32_t *d_nr = dev_upload(std::vector<int32_t>{L.num_rows});
    uint16_t *d_dys = dev_upload(dys), *d_gu = dev_upload(gu), *d_w2 = dev_upload(w2),
             *d_w13 = dev_upload(w13);
    const std::vector<float> rw = row_weights(L, sw);   /* as the dispatch writes them */
    float *d_rw = dev_upload(rw);
    uint16_t *d_dh = nullptr, *d_actp = nullptr, *d_comb = nullptr;
    float *d_dp = nullptr;
    CUDA_OK(cudaMalloc(&d_dh, ngu * 2));
    CUDA_OK(cudaMalloc(&d_actp, (size_t)R * I * 2));
    CUDA_OK(cudaMalloc(&d_comb, (size_t)L.num_slots * H * 2));
    CUDA_OK(cudaMalloc(&d_dp, (size_t)R * parts * 4));
    auto poison = [&]() {
        cudaMemset(d_dh, 0xFF, ngu * 2);
        cudaMemset(d_actp, 0xFF, (size_t)R * I * 2);
        cudaMemset(d_comb, 0xFF, (size_t)L.num_slots * H * 2);
        cudaMemset(d_dp, 0xFF, (size_t)R * parts * 4);
    };
    const mf_rows rows = {d_rbe, nullptr, d_nr, R, E};   /* operands: bf16, unscaled */
    auto run = [&](int sms) -> cudaError_t {
        mf_dgrad2_params p2 = {rows, {d_dys}, {d_w2}, d_gu, d_slot, d_rw, d_dh, d_actp, d_dp,
                               H, I, sms};
        cudaError_t e = mf_sm90_gemm2_dgrad_swiglu_bwd_bf16(&p2, 0);
        if (e != cudaSuccess) return e;
        mf_dgrad1_params p1 = {rows, {d_dh}, {d_w13}, {d_slot, d_comb}, H, I, sms};
        return mf_sm90_gemm1_dgrad_bwd_bf16(&p1, 0);
    };
    poison();
    CUDA_OK(run(num_sms()));
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint16_t> dh = dev_download(d_dh, ngu), actp = dev_download(d_actp, (size_t)R * I),
                          comb = dev_download(d_comb, (size_t)L.num_slots * H);
    std::vector<float> dp = dev_download(d_dp, (size_t)R * parts);

    std::vector<int> valid;
    for (int r = 0; r < L.num_rows; ++r)
        if (L.row_expert[r] >= 0) valid.push_back(r);
    const int nv = (int)valid.size();
    std::vector<double> ref_dh((size_t)nv * 2 * I), got_dh((size_t)nv * 2 * I);
    std::vector<double> ref_ap((size_t)nv * I), got_ap((size_t)nv * I);
    std::vector<double> ref_dp(nv), got_dp(nv);
    std::vector<double> ref_c((size_t)nv * H), got_c((size_t)nv * H);
#pragma omp parallel for schedule(dynamic, 4)
    for (int v = 0; v < nv; ++v) {
        const int r = valid[v], e = L.row_expert[r], slot = L.row_slot[r];
        const double p = sw[slot];
        std::vector<double> dap(I, 0.0);
        for (int k = 0; k < H; ++k) {
            const double y = dys_d[(size_t)r * H + k];
            const double *w = &w2_d[((size_t)e * H + k) * I];
            for (int j = 0; j < I; ++j) dap[j] += y * w[j];
        }
        double dps = 0;
        for (int j = 0; j < I; ++j) {
            const double g = gu_d[(size_t)r * 2 * I + j], u = gu_d[(size_t)r * 2 * I + I + j];
            const double s = 1.0 / (1.0 + exp(-g));
            const double a = bf2d(f2bf((float)(g * s * u)));
            dps += dap[j] * a;
            ref_ap[(size_t)v * I + j] = p * a;
            got_ap[(size_t)v * I + j] = bf2d(actp[(size_t)r * I + j]);
            ref_dh[(size_t)v * 2 * I + j] = p * dap[j] * u * s * (1 + g * (1 - s));
            ref_dh[(size_t)v * 2 * I + I + j] = p * dap[j] * g * s;
            got_dh[(size_t)v * 2 * I + j] = bf2d(dh[(size_t)r * 2 * I + j]);
            got_dh[(size_t)v * 2 * I + I + j] = bf2d(dh[(size_t)r * 2 * I + I + j]);
        }
        ref_dp[v] = dps;
        double gs = 0;
        for (int q = 0; q < parts; ++q) gs += dp[(size_t)r * parts + q];
        got_dp[v] = gs;
        /* dgrad1 from the device's dh (its exact bf16 values): one rounding. */
        for (int n = 0; n < H; ++n) {
            double s = 0;
            for (int j = 0; j < 2 * I; ++j)
                s += bf2d(dh[(size_t)r * 2 * I + j]) * w13_d[((size_t)e * 2 * I + j) * H + n];
            ref_c[(size_t)v * H + n] = s;
            got_c[(size_t)v * H + n] = bf2d(comb[(size_t)slot * H + n]);
        }
    }
    const double tol = th_bf16_tolerance(1), tol_da = th_bf16_tolerance(2);
    const double e_dh = th_rel_l2(got_dh.data(), ref_dh.data(), (int64_t)got_dh.size());
    const double e_ap = th_rel_l2(got_ap.data(), ref_ap.data(), (int64_t)got_ap.size());
    const double e_dp = th_rel_l2(got_dp.data(), ref_dp.data(), (int64_t)got_dp.size());
    const double e_c = th_rel_l2(got_c.data(), ref_c.data(), (int64_t)got_c.size());
    printf("  H=%d I=%d E=%d rows=%d (valid %d): rel err dh %.2e act_p %.2e dp %.2e "
           "combine %.2e (tol %.2e, dh and dp %.2e)\n", H, I, E, L.num_rows, nv, e_dh, e_ap,
           e_dp, e_c, tol, tol_da);
    CHECK(e_dh <= tol_da, "dgrad2 dh rel error %.3e > %.3e", e_dh, tol_da);
    CHECK(e_ap <= tol, "dgrad2 act_p rel error %.3e > %.3e", e_ap, tol);
    CHECK(e_dp <= tol_da, "dgrad2 dp rel error %.3e > %.3e", e_dp, tol_da);
    CHECK(e_c <= tol, "dgrad1 combine rel error %.3e > %.3e", e_c, tol);

    /* Padding rows inside blocks: exact zeros; rows past num_rows: untouched. */
    int bad_pad = 0;
    for (int r = 0; r < L.num_rows; ++r) {
        if (L.row_slot[r] >= 0) continue;
        for (int j = 0; j < 2 * I; ++j) bad_pad += dh[(size_t)r * 2 * I + j] != 0;
        for (int j = 0; j < I; ++j) bad_pad += actp[(size_t)r * I + j] != 0;
        for (int q = 0; q < parts; ++q) bad_pad += dp[(size_t)r * parts + q] != 0.f;
    }
    CHECK(bad_pad == 0, "%d outputs of padding rows are not zero", bad_pad);
    const size_t past = (size_t)(R - L.num_rows);
    CHECK(all_poison(&dh[(size_t)L.num_rows * 2 * I], past * 2 * I), "dh written past num_rows");
    CHECK(all_poison(&actp[(size_t)L.num_rows * I], past * I), "act_p written past num_rows");
    {
        uint32_t pat;
        memset(&pat, 0xFF, 4);
        int bad = 0;
        for (size_t i = (size_t)L.num_rows * parts; i < (size_t)R * parts; ++i) {
            uint32_t u;
            memcpy(&u, &dp[i], 4);
            bad += u != pat;
        }
        CHECK(bad == 0, "dp_partial written past num_rows (%d)", bad);
    }
    const int stray = unrouted_rows_written(L, comb.data(), H);
    CHECK(stray == 0, "%d combine rows of unrouted slots were written", stray);

    /* Bitwise repeatability with a small grid (many tiles per CTA, the ring wrapping). */
    poison();
    CUDA_OK(run(7));
    CUDA_OK(cudaDeviceSynchronize());
    CHECK(dev_download(d_dh, ngu) == dh, "dh differs between runs");
    CHECK(dev_download(d_actp, (size_t)R * I) == actp, "act_p differs between runs");
    CHECK(dev_download(d_comb, (size_t)L.num_slots * H) == comb, "combine differs between runs");
    std::vector<float> dp2 = dev_download(d_dp, (size_t)R * parts);
    CHECK(memcmp(dp2.data(), dp.data(), dp.size() * 4) == 0, "dp_partial differs between runs");

    /* dgrad2 with expert parallelism's wait for each block's rows. Every block's count
     * past its target across the 32-bit wrap (0x40 against 0xffffffc0): bitwise the run
     * above. One block's target 128 rows ahead: the wait runs
     * out after timeout_ns, the record names the block and the stage, the call is failed,
     * and the kernel ends. */
    const int blocks = R / MF_SM90_BLOCK_M;
    std::vector<uint32_t> arrivals(blocks, 0x40u), targets(blocks, 0xffffffc0u);
    const mf_plan_state state0 = MF_PLAN_STATE_INIT;
    uint32_t *d_arr = dev_upload(arrivals), *d_tgt = dev_upload(targets);
    mf_plan_state *d_state = dev_upload(std::vector<mf_plan_state>{state0});
    auto run_ep = [&](int64_t timeout_ns, cudaStream_t stream = 0) -> cudaError_t {
        mf_dgrad2_params p2 = {rows, {d_dys}, {d_w2}, d_gu, d_slot, d_rw, d_dh, d_actp, d_dp,
                               H, I, num_sms()};
        p2.rows_in = {d_arr, d_tgt, d_state, timeout_ns, MF_EP_STAGE_BWD_ROWS};
        return mf_sm90_gemm2_dgrad_swiglu_bwd_bf16(&p2, stream);
    };
    /* dh, act_p and dp_partial bitwise those of the run above, and the call not failed. */
    auto expect_plain_run = [&](const char *when) {
        CHECK(dev_download(d_dh, ngu) == dh, "dh %s differs", when);
        CHECK(dev_download(d_actp, (size_t)R * I) == actp, "act_p %s differs", when);
        const std::vector<float> dp3 = dev_download(d_dp, (size_t)R * parts);
        CHECK(memcmp(dp3.data(), dp.data(), dp.size() * 4) == 0, "dp_partial %s differs", when);
        CHECK(dev_download(d_state, 1)[0].call_failed == 0, "the call %s failed", when);
    };
    poison();
    CUDA_OK(run_ep(1000000000));
    CUDA_OK(cudaDeviceSynchronize());
    expect_plain_run("with block waits");
    /* The rows and their weights arriving while the kernel runs: every block's count one
     * short, row_weight stale (zeros) until, 20 ms into the run, another stream copies
     * the weights in and then the counts. The consumers read row_weight only after their
     * block is in (H < 512: the plain consumer role, which waits for it itself), so
     * bitwise the run above. */
    if (L.num_rows >= MF_SM90_BLOCK_M) {
        cudaStream_t late;
        CUDA_OK(cudaStreamCreateWithFlags(&late, cudaStreamNonBlocking));
        const std::vector<uint32_t> short_of(blocks, 0xffffffbfu);   /* target - 1 */
        CUDA_OK(cudaMemcpy(d_arr, short_of.data(), (size_t)blocks * 4, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemset(d_rw, 0, (size_t)R * 4));
        poison();
        CUDA_OK(cudaDeviceSynchronize());
        CUDA_OK(run_ep(2000000000, late));
        const auto t_start = std::chrono::steady_clock::now();
        while (std::chrono::steady_clock::now() - t_start < std::chrono::milliseconds(20)) {}
        CHECK(cudaStreamQuery(late) == cudaErrorNotReady, "dgrad2 did not wait for the rows");
        cudaStream_t writer;
        CUDA_OK(cudaStreamCreateWithFlags(&writer, cudaStreamNonBlocking));
        CUDA_OK(cudaMemcpyAsync(d_rw, rw.data(), (size_t)R * 4, cudaMemcpyHostToDevice, writer));
        CUDA_OK(cudaMemcpyAsync(d_arr, arrivals.data(), (size_t)blocks * 4, cudaMemcpyHostToDevice,
                                writer));
        CUDA_OK(cudaDeviceSynchronize());
        expect_plain_run("with rows arriving late");
        CUDA_OK(cudaStreamDestroy(writer));
        CUDA_OK(cudaStreamDestroy(late));
    }
    if (L.num_rows >= MF_SM90_BLOCK_M) {
        const int b = th_rand_int(0, L.num_rows / MF_SM90_BLOCK_M - 1);
        const uint32_t ahead = arrivals[b] + MF_SM90_BLOCK_M;
        CUDA_OK(cudaMemcpy(d_tgt + b, &ahead, 4, cudaMemcpyHostToDevice));
        const auto t0 = std::chrono::steady_clock::now();
        CUDA_OK(run_ep(20000000));
        CUDA_OK(cudaDeviceSynchronize());
        const double waited =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const mf_plan_state st = dev_download(d_state, 1)[0];
        CHECK(st.record.code == MOEFUSE_ERR_TIMEOUT && st.record.token == -1 - b &&
                  st.record.slot == MF_EP_STAGE_BWD_ROWS && (uint32_t)st.record.value == arrivals[b] &&
                  (uint32_t)st.record.expected == ahead && st.call_failed == 1,
              "block %d never complete: record code %d token %d stage %d seen %u want %u, "
              "call_failed %d; expected TIMEOUT, %d, %d, %u, %u, 1", b, st.record.code,
              st.record.token, st.record.slot, (unsigned)st.record.value,
              (unsigned)st.record.expected, st.call_failed, -1 - b, (int)MF_EP_STAGE_BWD_ROWS,
              arrivals[b], ahead);
        CHECK(waited < 2.0, "the run with a block that never completes took %.2f s (bound 20 ms)",
              waited);
        printf("  block %d never complete: the kernel ended after %.1f ms (bound 20 ms)\n", b,
               1e3 * waited);
    }
    cudaFree(d_arr); cudaFree(d_tgt); cudaFree(d_state);

    cudaFree(d_rbe); cudaFree(d_slot); cudaFree(d_nr); cudaFree(d_dys); cudaFree(d_gu);
    cudaFree(d_w2); cudaFree(d_w13); cudaFree(d_rw); cudaFree(d_dh); cudaFree(d_actp);
    cudaFree(d_comb); cudaFree(d_dp);
}

/* ---- wgrad ------------------------------------------------------------------------------ */
static void check_wgrad(int M, int N, const std::vector<int> &counts) {
    if (!have_sm90()) return;
    const int E = (int)counts.size();
    Layout L = make_layout(counts, /*extra_rows=*/128, 0);
    const int R = L.rows_cap;
    std::vector<uint16_t> lhs((size_t)R * M), rhs((size_t)R * N);
    std::vector<double> lhs_d(lhs.size()), rhs_d(rhs.size());
    th_fill_bf16_normal(lhs.data(), lhs_d.data(), (int64_t)lhs.size(), 1.0);
    th_fill_bf16_normal(rhs.data(), rhs_d.data(), (int64_t)rhs.size(), 1.0);
    /* Padding rows are zero (rows past num_rows too, though no expert covers them). */
    for (int r = 0; r < R; ++r)
        if (L.row_expert[r] < 0) {
            for (int k = 0; k < M; ++k) { lhs[(size_t)r * M + k] = 0; lhs_d[(size_t)r * M + k] = 0; }
            for (int k = 0; k < N; ++k) { rhs[(size_t)r * N + k] = 0; rhs_d[(size_t)r * N + k] = 0; }
        }
    const size_t ndw = (size_t)E * M * N;
    uint16_t *d_l = dev_upload(lhs), *d_r = dev_upload(rhs);
    int32_t *d_off = dev_upload(L.offsets);
    float *d_dw = nullptr;
    CUDA_OK(cudaMalloc(&d_dw, ndw * 4));
    auto run = [&](int sms, int acc) {
        mf_wgrad_params p = {{nullptr, d_off, nullptr, R, E}, {d_l}, {d_r}, d_dw, nullptr,
                             M, N, acc, sms};
        return mf_sm90_wgrad_grouped_bf16(&p, 0);
    };
    CUDA_OK(cudaMemset(d_dw, 0xFF, ndw * 4));
    CUDA_OK(run(num_sms(), 0));
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<float> dw = dev_download(d_dw, ndw);

    std::vector<double> ref(ndw, 0.0), got(ndw);
#pragma omp parallel for schedule(dynamic, 1)
    for (int em = 0; em < E * M; ++em) {
        const int e = em / M, m = em % M;
        double *out = &ref[(size_t)em * N];
        for (int r = L.offsets[e]; r < L.offsets[e + 1]; ++r) {
            const double a = lhs_d[(size_t)r * M + m];
            if (a == 0) continue;
            const double *b = &rhs_d[(size_t)r * N];
            for (int n = 0; n < N; ++n) out[n] += a * b[n];
        }
    }
    for (size_t i = 0; i < ndw; ++i) got[i] = dw[i];
    const double tol = th_bf16_tolerance(0);
    const double err = th_rel_l2(got.data(), ref.data(), (int64_t)ndw);
    printf("  M=%d N=%d E=%d rows=%d: rel err dW %.2e (tol %.2e)\n", M, N, E, L.num_rows, err,
           tol);
    CHECK(err <= tol, "wgrad rel error %.3e > %.3e", err, tol);
    int nonzero_empty = 0;
    for (int e = 0; e < E; ++e)
        if (L.counts[e] == 0)
            for (size_t i = (size_t)e * M * N; i < (size_t)(e + 1) * M * N; ++i)
                nonzero_empty += dw[i] != 0.f;
    CHECK(nonzero_empty == 0, "%d dW elements of experts without rows are not 0",
          nonzero_empty);

    /* Bitwise repeatability with a small grid. */
    CUDA_OK(cudaMemset(d_dw, 0xFF, ndw * 4));
    CUDA_OK(run(7, 0));
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<float> dw2 = dev_download(d_dw, ndw);
    CHECK(memcmp(dw.data(), dw2.data(), ndw * 4) == 0, "dW differs between runs");

    /* The experts in mf_expert_order's order, on the full grid and on 7 CTAs: the tiles
     * move between CTAs, the bits stay. */
    int32_t *d_order = nullptr;
    CUDA_OK(cudaMalloc(&d_order, (E + 1) * 4));
    CUDA_OK(mf_expert_order(d_off, E, d_order, 0));
    for (int sms : {num_sms(), 7}) {
        CUDA_OK(cudaMemset(d_dw, 0xFF, ndw * 4));
        mf_wgrad_params po = {{nullptr, d_off, nullptr, R, E}, {d_l}, {d_r}, d_dw, nullptr,
                              M, N, 0, sms, d_order};
        CUDA_OK(mf_sm90_wgrad_grouped_bf16(&po, 0));
        CUDA_OK(cudaDeviceSynchronize());
        dw2 = dev_download(d_dw, ndw);
        CHECK(memcmp(dw.data(), dw2.data(), ndw * 4) == 0,
              "dW with the experts in mf_expert_order's order differs (%d CTAs)", sms);
    }

    /* Accumulate: exactly old + write result (one fp32 add); empty experts unchanged. */
    std::vector<float> old(ndw);
    for (auto &x : old) x = (float)th_normal();
    CUDA_OK(cudaMemcpy(d_dw, old.data(), ndw * 4, cudaMemcpyHostToDevice));
    CUDA_OK(run(num_sms(), 1));
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<float> acc = dev_download(d_dw, ndw);
    size_t bad = 0;
    for (size_t i = 0; i < ndw; ++i) {
        const float want = old[i] + dw[i];
        bad += memcmp(&want, &acc[i], 4) != 0;
    }
    CHECK(bad == 0, "accumulate differs from write + old in %zu elements", bad);

    /* bf16 output: the write-mode fp32 gradient rounded to nearest even, bitwise; with
     * accumulate it is refused. */
    uint16_t *d_dwb = nullptr;
    CUDA_OK(cudaMalloc(&d_dwb, ndw * 2));
    CUDA_OK(cudaMemset(d_dwb, 0xFF, ndw * 2));
    mf_wgrad_params pb = {{nullptr, d_off, nullptr, R, E}, {d_l}, {d_r}, nullptr, d_dwb,
                          M, N, 0, num_sms()};
    CUDA_OK(mf_sm90_wgrad_grouped_bf16(&pb, 0));
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint16_t> dwb = dev_download(d_dwb, ndw);
    size_t bad_bf16 = 0;
    for (size_t i = 0; i < ndw; ++i) bad_bf16 += dwb[i] != mf_float_to_bf16(dw[i]);
    CHECK(bad_bf16 == 0, "bf16 dW differs from the rounded fp32 dW in %zu elements", bad_bf16);
    /* With the order the store warps write the empty experts' zero tiles beside the GEMM
     * tiles (on 7 CTAs each has several, and more zero tiles than GEMM tiles): the same
     * bits, nothing left poisoned. */
    for (int sms : {num_sms(), 7}) {
        CUDA_OK(cudaMemset(d_dwb, 0xFF, ndw * 2));
        mf_wgrad_params po = pb;
        po.num_sms = sms;
        po.expert_order = d_order;
        CUDA_OK(mf_sm90_wgrad_grouped_bf16(&po, 0));
        CUDA_OK(cudaDeviceSynchronize());
        const std::vector<uint16_t> got = dev_download(d_dwb, ndw);
        CHECK(memcmp(got.data(), dwb.data(), ndw * 2) == 0,
              "bf16 dW with the experts in mf_expert_order's order differs (%d CTAs)", sms);
    }
    cudaFree(d_order);
    pb.accumulate = 1;
    CHECK(mf_sm90_wgrad_grouped_bf16(&pb, 0) == cudaErrorInvalidValue,
          "bf16 dW with accumulate was not refused");
    cudaFree(d_dwb);
    cudaFree(d_l); cudaFree(d_r); cudaFree(d_off); cudaFree(d_dw);
}

static void test_dgrad_bn256(void) { check_dgrad(512, 256, {0, 1, 1037, 37, 0, 200, 128, 5}); }
static void test_dgrad_bn128(void) { check_dgrad(384, 384, {3, 0, 0, 256, 1, 1100}); }
/* A longer K loop (20 K blocks) than the store warps' SwiGLU backward of a tile; the 7-CTA
 * rerun gives each CTA several tiles, so the store buffers wrap. */
static void test_dgrad_bn256_long_k(void) { check_dgrad(1280, 256, {0, 1, 1037, 37, 0, 200, 128, 5}); }
static void test_wgrad_bn256(void) { check_wgrad(384, 512, {0, 1, 1037, 37, 0, 200, 128, 5}); }
static void test_wgrad_bn128(void) { check_wgrad(256, 384, {3, 0, 0, 256, 1, 1100}); }

/* ---- the experts' order for the wgrad scheduler ---------------------------------------- */
/* mf_expert_order against a host stable sort by its key (experts with more than 1/16 of
 * the rows by rows, then the other experts with rows, then those without), and the count
 * of experts with rows after it: E past one block of threads (1024) and past one
 * shared-memory chunk (2048), ties, empty experts, heavy experts (some E = 5 and 128
 * draws have several, E = 1 has one). */
static void test_expert_order(void) {
    if (!have_sm90()) return;
    for (int E : {1, 5, 128, 1500, 5000}) {
        std::vector<int32_t> off(E + 1, 0);
        for (int e = 0; e < E; ++e) {
            const int heavy = E > 1 && E <= 128 && th_rand_int(0, 15) == 0;
            off[e + 1] = off[e] + 128 * (heavy ? th_rand_int(2 * E, 4 * E) : th_rand_int(0, 9));
        }
        const int64_t all = off[E];
        auto key = [&](int e) -> int64_t {
            const int64_t r = off[e + 1] - off[e];
            return 16 * r > all ? r : r > 0;
        };
        std::vector<int32_t> want(E);
        for (int e = 0; e < E; ++e) want[e] = e;
        std::stable_sort(want.begin(), want.end(), [&](int a, int b) { return key(a) > key(b); });
        int busy = 0;
        for (int e = 0; e < E; ++e) busy += off[e + 1] > off[e];
        int32_t *d_off = dev_upload(off), *d_order = nullptr;
        CUDA_OK(cudaMalloc(&d_order, (E + 1) * 4));
        CUDA_OK(cudaMemset(d_order, 0xFF, (E + 1) * 4));
        CUDA_OK(mf_expert_order(d_off, E, d_order, 0));
        CUDA_OK(cudaDeviceSynchronize());
        const std::vector<int32_t> got = dev_download(d_order, E + 1);
        int bad = 0;
        for (int i = 0; i < E; ++i) bad += got[i] != want[i];
        CHECK(bad == 0, "E=%d: %d positions of the expert order differ from the host sort", E,
              bad);
        CHECK(got[E] == busy, "E=%d: order[E] = %d experts with rows, expected %d", E, got[E],
              busy);
        cudaFree(d_off);
        cudaFree(d_order);
    }
    CHECK(mf_expert_order(nullptr, 4, nullptr, 0) == cudaErrorInvalidValue,
          "a NULL order was not refused");
}

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
        {"gemm_sm90_bwd_dgrad_bn256", test_dgrad_bn256},
        {"gemm_sm90_bwd_dgrad_bn128", test_dgrad_bn128},
        {"gemm_sm90_bwd_dgrad_bn256_long_k", test_dgrad_bn256_long_k},
        {"gemm_sm90_bwd_wgrad_bn256", test_wgrad_bn256},
        {"gemm_sm90_bwd_wgrad_bn128", test_wgrad_bn128},
        {"gemm_sm90_bwd_expert_order", test_expert_order},
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
