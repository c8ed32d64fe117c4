/* The sm_90a backward GEMM kernels (dgrad2 + SwiGLU backward + dp, dgrad1 + combine
 * scatter, K-grouped wgrad) against an fp64 CPU computation, on expert-sorted rows with
 * varied per-expert counts (empty experts, a one-row expert, 1000+-row experts) padded to
 * 128 with zero padding rows; outputs poisoned first. Padding rows must come out zero,
 * rows past num_rows and unrouted combine rows untouched, runs with different grid sizes
 * bitwise equal, and wgrad's accumulate mode exactly write + old. dgrad2 also runs as the
 * pipelines call it, with expert parallelism's block waits: bitwise the plain run when
 * every block's rows are in, and when the rows and their weights are copied in while it
 * runs; a block that never completes ends in the timeout record, not a hang. And the
 * experts' order of the wgrad scheduler against a host sort. Their timing at the Qwen3
 * shapes is test_gemm_sm90_bwd_time.cu.
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

/* An optional argument runs only the cases whose name contains it. */
int main(int argc, char **argv) {
    static const struct { const char *name; void (*fn)(void); } cases[] = {
        {"gemm_sm90_bwd_dgrad_bn256", test_dgrad_bn256},
        {"gemm_sm90_bwd_dgrad_bn128", test_dgrad_bn128},
        {"gemm_sm90_bwd_dgrad_bn256_long_k", test_dgrad_bn256_long_k},
        {"gemm_sm90_bwd_wgrad_bn256", test_wgrad_bn256},
        {"gemm_sm90_bwd_wgrad_bn128", test_wgrad_bn128},
        {"gemm_sm90_bwd_expert_order", test_expert_order},
    };
    th_seed_from_env_or_clock();
    for (const auto &c : cases)
        if (argc < 2 || strstr(c.name, argv[1])) th_run(c.name, c.fn);
    return th_finish();
}
