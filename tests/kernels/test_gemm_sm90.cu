/* The sm_90a grouped GEMM kernels (gemm1 + SwiGLU, gemm2 + combine) against an fp64 CPU
 * computation, on expert-sorted rows with varied per-expert counts (empty experts, a
 * one-row expert, a 1000+-row expert), outputs poisoned first; rows past num_rows and
 * combine rows of unrouted slots must stay poisoned; runs with different grid sizes
 * must agree bit for bit; the act the backward recomputes (dgrad2) is bitwise the
 * forward's; the fused forward kernel (both GEMMs in one) gives the same bits with any
 * grid. Then times the kernels at the Qwen3 shapes (rows checked on a sample against
 * fp64) and prints TFLOP/s. */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

extern "C" {
#include "harness.h"
}
#include "gemm_test_util.h"
#include "kernels.h"

/* Device copies of the layout and the buffers of one problem. */
struct Dev {
    uint16_t *xs = nullptr, *w13 = nullptr, *w2 = nullptr, *act = nullptr, *gate_up = nullptr,
             *combine = nullptr;
    int32_t *rbe = nullptr, *num_rows = nullptr, *row_slot = nullptr;
    float *row_weight = nullptr;
    uint32_t *act_ready = nullptr;   /* the fused kernel's counters */
    ~Dev() {
        cudaFree(xs); cudaFree(w13); cudaFree(w2); cudaFree(act); cudaFree(gate_up);
        cudaFree(combine); cudaFree(rbe); cudaFree(num_rows); cudaFree(row_slot);
        cudaFree(row_weight); cudaFree(act_ready);
    }
};

static cudaError_t dev_alloc(Dev &d, const Layout &L, int H, int I) {
    cudaError_t e;
#define ALLOC(p, bytes) if ((e = cudaMalloc((void **)&(p), (bytes))) != cudaSuccess) return e
    ALLOC(d.xs, (size_t)L.rows_cap * H * 2);
    ALLOC(d.w13, (size_t)L.E * 2 * I * H * 2);
    ALLOC(d.w2, (size_t)L.E * H * I * 2);
    ALLOC(d.act, (size_t)L.rows_cap * I * 2);
    ALLOC(d.gate_up, (size_t)L.rows_cap * 2 * I * 2);
    ALLOC(d.combine, (size_t)L.num_slots * H * 2);
    ALLOC(d.rbe, L.row_block_expert.size() * 4);
    ALLOC(d.num_rows, 4);
    ALLOC(d.row_slot, (size_t)L.rows_cap * 4);
    ALLOC(d.row_weight, (size_t)L.rows_cap * 4);
    ALLOC(d.act_ready, (size_t)(L.rows_cap / 128 + 1) * 4);
#undef ALLOC
    if ((e = cudaMemcpy(d.rbe, L.row_block_expert.data(), L.row_block_expert.size() * 4,
                        cudaMemcpyHostToDevice)) != cudaSuccess)
        return e;
    if ((e = cudaMemcpy(d.num_rows, &L.num_rows, 4, cudaMemcpyHostToDevice)) != cudaSuccess)
        return e;
    return cudaMemcpy(d.row_slot, L.row_slot.data(), (size_t)L.rows_cap * 4,
                      cudaMemcpyHostToDevice);
}

static cudaError_t poison_outputs(Dev &d, const Layout &L, int H, int I) {
    cudaError_t e;
    if ((e = cudaMemset(d.act, 0xFF, (size_t)L.rows_cap * I * 2)) != cudaSuccess) return e;
    if ((e = cudaMemset(d.gate_up, 0xFF, (size_t)L.rows_cap * 2 * I * 2)) != cudaSuccess)
        return e;
    return cudaMemset(d.combine, 0xFF, (size_t)L.num_slots * H * 2);
}

/* The layout's rows on the device (operands: a zeroed mf_operand is bf16, unscaled). */
static mf_rows dev_rows(const Dev &d, const Layout &L) {
    return mf_rows{d.rbe, nullptr, d.num_rows, L.rows_cap, L.E};
}

static mf_gemm1_params gemm1_params(Dev &d, const Layout &L, int H, int I, int sms,
                                    bool gate_up) {
    return mf_gemm1_params{dev_rows(d, L), {d.xs}, {d.w13}, d.act,
                           gate_up ? d.gate_up : nullptr, H, I, sms};
}

static mf_gemm2_params gemm2_params(Dev &d, const Layout &L, int H, int I, int sms) {
    return mf_gemm2_params{dev_rows(d, L), {d.act}, {d.w2}, d.row_weight,
                           {d.row_slot, d.combine}, H, I, sms};
}

static mf_moe_fused_fwd_params fwd_params(Dev &d, const Layout &L, int H, int I, int sms,
                                          bool gate_up) {
    mf_moe_fused_fwd_params p = {};
    p.gemm1 = gemm1_params(d, L, H, I, sms, gate_up);
    p.gemm2 = gemm2_params(d, L, H, I, sms);
    p.act_ready = d.act_ready;
    return p;
}

/* gemm1 then gemm2, one kernel each (the staged forward). */
static cudaError_t run_both(Dev &d, const Layout &L, int H, int I, int sms, bool gate_up) {
    const mf_moe_fused_fwd_params p = fwd_params(d, L, H, I, sms, gate_up);
    cudaError_t e = mf_sm90_gemm1_swiglu_fwd_bf16(&p.gemm1, 0);
    if (e != cudaSuccess) return e;
    return mf_sm90_gemm2_combine_fwd_bf16(&p.gemm2, 0);
}

/* Both in the fused kernel. */
static cudaError_t run_fused(Dev &d, const Layout &L, int H, int I, int sms, bool gate_up) {
    const mf_moe_fused_fwd_params p = fwd_params(d, L, H, I, sms, gate_up);
    return mf_sm90_moe_fused_fwd_bf16(&p, 0);
}

/* The fused kernel, with `sms` CTAs, gives the staged outputs bit for bit (act, gate_up,
 * combine, and what stays poisoned); shapes it does not take are refused. */
static void check_fused_matches(Dev &d, const Layout &L, int H, int I, int sms,
                                const std::vector<uint16_t> &act,
                                const std::vector<uint16_t> &gu,
                                const std::vector<uint16_t> &comb) {
    CUDA_OK(poison_outputs(d, L, H, I));
    if (!mf_sm90_moe_fused_fwd_takes(H, I)) {
        CHECK(run_fused(d, L, H, I, sms, true) == cudaErrorInvalidValue,
              "the fused kernel accepted H=%d I=%d, which it does not take", H, I);
        return;
    }
    CUDA_OK(run_fused(d, L, H, I, sms, true));
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint16_t> act2(act.size()), gu2(gu.size()), comb2(comb.size());
    CUDA_OK(cudaMemcpy(act2.data(), d.act, act.size() * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(gu2.data(), d.gate_up, gu.size() * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(comb2.data(), d.combine, comb.size() * 2, cudaMemcpyDeviceToHost));
    CHECK(memcmp(act.data(), act2.data(), act.size() * 2) == 0,
          "fused act differs from staged (%d CTAs)", sms);
    CHECK(memcmp(gu.data(), gu2.data(), gu.size() * 2) == 0,
          "fused gate_up differs from staged (%d CTAs)", sms);
    CHECK(memcmp(comb.data(), comb2.data(), comb.size() * 2) == 0,
          "fused combine differs from staged (%d CTAs)", sms);
}

/* ---- correctness on random inputs ----------------------------------------------------- */
/* The backward recomputes a from the saved gate_up (dgrad2); with p = 1 its act_p =
 * bf16(p a) is a itself, which must be bitwise the forward's act on every routed row.
 * dgrad2 takes I a multiple of 128; other shapes are skipped here. */
static void check_act_matches_dgrad2(Dev &d, const Layout &L, int H, int I,
                                     const std::vector<uint16_t> &act) {
    const int parts = mf_dgrad2_dp_parts(I);
    if (parts == 0) return;
    uint16_t *dys = nullptr, *dh = nullptr, *act_p = nullptr;
    float *dp = nullptr, *ones = nullptr;
    CUDA_OK(cudaMalloc(&dys, (size_t)L.rows_cap * H * 2));
    CUDA_OK(cudaMalloc(&dh, (size_t)L.rows_cap * 2 * I * 2));
    CUDA_OK(cudaMalloc(&act_p, (size_t)L.rows_cap * I * 2));
    CUDA_OK(cudaMalloc(&dp, (size_t)L.rows_cap * parts * 4));
    CUDA_OK(cudaMalloc(&ones, (size_t)L.rows_cap * 4));
    CUDA_OK(cudaMemset(dys, 0, (size_t)L.rows_cap * H * 2));
    CUDA_OK(cudaMemset(act_p, 0xFF, (size_t)L.rows_cap * I * 2));
    const std::vector<float> one(L.rows_cap, 1.f);
    CUDA_OK(cudaMemcpy(ones, one.data(), one.size() * 4, cudaMemcpyHostToDevice));
    mf_dgrad2_params p2 = {dev_rows(d, L), {dys}, {d.w2}, d.gate_up, d.row_slot, ones,
                           dh, act_p, dp, H, I, num_sms()};
    CUDA_OK(mf_sm90_gemm2_dgrad_swiglu_bwd_bf16(&p2, 0));
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint16_t> ap((size_t)L.rows_cap * I);
    CUDA_OK(cudaMemcpy(ap.data(), act_p, ap.size() * 2, cudaMemcpyDeviceToHost));
    int64_t differ = 0;
    for (int r = 0; r < L.num_rows; ++r)
        if (L.row_slot[r] >= 0)
            for (int j = 0; j < I; ++j) differ += ap[(size_t)r * I + j] != act[(size_t)r * I + j];
    CHECK(differ == 0, "the backward's recomputed a differs from the forward's act in %lld "
          "values", (long long)differ);
    cudaFree(dys); cudaFree(dh); cudaFree(act_p); cudaFree(dp); cudaFree(ones);
}

static void check_shape(int H, int I, const std::vector<int> &counts) {
    if (!have_sm90()) return;
    const int E = (int)counts.size();
    Layout L = make_layout(counts, /*extra_rows=*/256, /*dropped=*/37);
    const size_t nx = (size_t)L.rows_cap * H, n13 = (size_t)E * 2 * I * H,
                 n2 = (size_t)E * H * I;
    std::vector<uint16_t> xs(nx), w13(n13), w2(n2);
    std::vector<double> xs_d(nx), w13_d(n13), w2_d(n2);
    th_fill_bf16_normal(xs.data(), xs_d.data(), (int64_t)nx, 1.0);
    th_fill_bf16_normal(w13.data(), w13_d.data(), (int64_t)n13, 1.0 / sqrt((double)H));
    th_fill_bf16_normal(w2.data(), w2_d.data(), (int64_t)n2, 1.0 / sqrt((double)I));
    /* Padding rows and rows past num_rows hold NaN: no row may leak into another. */
    for (int r = 0; r < L.rows_cap; ++r)
        if (L.row_expert[r] < 0)
            for (int k = 0; k < H; ++k) xs[(size_t)r * H + k] = 0x7FC0;
    std::vector<float> sw(L.num_slots);
    for (auto &w : sw) w = (float)(0.05 + th_uniform());

    Dev d;
    CUDA_OK(dev_alloc(d, L, H, I));
    CUDA_OK(cudaMemcpy(d.xs, xs.data(), nx * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d.w13, w13.data(), n13 * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d.w2, w2.data(), n2 * 2, cudaMemcpyHostToDevice));
    const std::vector<float> rw = row_weights(L, sw);
    CUDA_OK(cudaMemcpy(d.row_weight, rw.data(), rw.size() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(poison_outputs(d, L, H, I));
    CUDA_OK(run_both(d, L, H, I, num_sms(), true));
    CUDA_OK(cudaDeviceSynchronize());

    std::vector<uint16_t> act((size_t)L.rows_cap * I), gu((size_t)L.rows_cap * 2 * I),
        comb((size_t)L.num_slots * H);
    CUDA_OK(cudaMemcpy(act.data(), d.act, act.size() * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(gu.data(), d.gate_up, gu.size() * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(comb.data(), d.combine, comb.size() * 2, cudaMemcpyDeviceToHost));

    /* fp64 reference on the valid rows: gate_up from the inputs, act from the device's
     * gate_up, gemm2 from the device's act (their exact bf16 values), so each output went
     * through one bf16 rounding. */
    std::vector<int> valid;
    for (int r = 0; r < L.num_rows; ++r)
        if (L.row_expert[r] >= 0) valid.push_back(r);
    const int nv = (int)valid.size();
    std::vector<double> ref_act((size_t)nv * I), got_act((size_t)nv * I);
    std::vector<double> ref_gu((size_t)nv * 2 * I), got_gu((size_t)nv * 2 * I);
    std::vector<double> ref_c((size_t)nv * H), got_c((size_t)nv * H);
#pragma omp parallel for schedule(dynamic, 4)
    for (int v = 0; v < nv; ++v) {
        const int r = valid[v], e = L.row_expert[r];
        const double *x = &xs_d[(size_t)r * H];
        for (int j = 0; j < 2 * I; ++j) {
            const double *w = &w13_d[((size_t)e * 2 * I + j) * H];
            double s = 0;
            for (int k = 0; k < H; ++k) s += x[k] * w[k];
            ref_gu[(size_t)v * 2 * I + j] = s;
            got_gu[(size_t)v * 2 * I + j] = bf2d(gu[(size_t)r * 2 * I + j]);
        }
        for (int j = 0; j < I; ++j) {
            /* act is silu(g) u of the bf16-rounded g and u (the device's gate_up). */
            const double g = got_gu[(size_t)v * 2 * I + j], u = got_gu[(size_t)v * 2 * I + I + j];
            ref_act[(size_t)v * I + j] = g / (1.0 + exp(-g)) * u;
            got_act[(size_t)v * I + j] = bf2d(act[(size_t)r * I + j]);
        }
        const int slot = L.row_slot[r];
        for (int n = 0; n < H; ++n) {
            const uint16_t *w = &w2[((size_t)e * H + n) * I];
            double s = 0;
            for (int k = 0; k < I; ++k) s += bf2d(act[(size_t)r * I + k]) * bf2d(w[k]);
            ref_c[(size_t)v * H + n] = sw[slot] * s;
            got_c[(size_t)v * H + n] = bf2d(comb[(size_t)slot * H + n]);
        }
    }
    const double tol = th_bf16_tolerance(1);
    const double e_gu = th_rel_l2(got_gu.data(), ref_gu.data(), (int64_t)got_gu.size());
    const double e_act = th_rel_l2(got_act.data(), ref_act.data(), (int64_t)got_act.size());
    const double e_c = th_rel_l2(got_c.data(), ref_c.data(), (int64_t)got_c.size());
    printf("  H=%d I=%d E=%d rows=%d (valid %d): rel err gate_up %.2e act %.2e combine %.2e "
           "(tol %.2e)\n", H, I, E, L.num_rows, nv, e_gu, e_act, e_c, tol);
    CHECK(e_gu <= tol, "gate_up rel error %.3e > %.3e", e_gu, tol);
    CHECK(e_act <= tol, "act rel error %.3e > %.3e", e_act, tol);
    CHECK(e_c <= tol, "combine rel error %.3e > %.3e", e_c, tol);

    /* Untouched: rows past num_rows, and combine rows of slots no row maps to. */
    const size_t past = (size_t)(L.rows_cap - L.num_rows);
    CHECK(all_poison(&act[(size_t)L.num_rows * I], past * I), "act written past num_rows");
    CHECK(all_poison(&gu[(size_t)L.num_rows * 2 * I], past * 2 * I),
          "gate_up written past num_rows");
    const int stray = unrouted_rows_written(L, comb.data(), H);
    CHECK(stray == 0, "%d combine rows of unrouted slots were written", stray);

    /* Bitwise repeatability, with a small grid (many tiles per CTA, the ring wrapping). */
    CUDA_OK(poison_outputs(d, L, H, I));
    CUDA_OK(run_both(d, L, H, I, 7, true));
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint16_t> act2(act.size()), gu2(gu.size()), comb2(comb.size());
    CUDA_OK(cudaMemcpy(act2.data(), d.act, act.size() * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(gu2.data(), d.gate_up, gu.size() * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(comb2.data(), d.combine, comb.size() * 2, cudaMemcpyDeviceToHost));
    CHECK(memcmp(act.data(), act2.data(), act.size() * 2) == 0, "act differs between runs");
    CHECK(memcmp(gu.data(), gu2.data(), gu.size() * 2) == 0, "gate_up differs between runs");
    CHECK(memcmp(comb.data(), comb2.data(), comb.size() * 2) == 0,
          "combine differs between runs");

    check_act_matches_dgrad2(d, L, H, I, act);
    /* The fused kernel: a full grid, 7 CTAs, and one CTA (every gemm2 tile waits for
     * gemm1 tiles of its own CTA). */
    for (int sms : {num_sms(), 7, 1}) check_fused_matches(d, L, H, I, sms, act, gu, comb);

    /* Without gate_up: act identical, gate_up untouched. */
    CUDA_OK(poison_outputs(d, L, H, I));
    CUDA_OK(run_both(d, L, H, I, num_sms(), false));
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(act2.data(), d.act, act.size() * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(gu2.data(), d.gate_up, gu.size() * 2, cudaMemcpyDeviceToHost));
    CHECK(memcmp(act.data(), act2.data(), act.size() * 2) == 0,
          "act differs when gate_up is not stored");
    CHECK(all_poison(gu2.data(), gu2.size()), "gate_up written though NULL was passed");
}

/* Experts: empty ones, a single row, one of 1000+ rows, exact multiples of 128. */
static void test_bn256_paths(void) { check_shape(512, 384, {0, 1, 1037, 37, 0, 200, 128, 5}); }
static void test_bn128_paths(void) { check_shape(384, 320, {3, 0, 0, 256, 1, 1100}); }
static void test_no_rows(void) {
    if (!have_sm90()) return;
    /* num_rows = 0: nothing may be written. */
    std::vector<int> counts(4, 0);
    Layout L = make_layout(counts, 256, 8);
    const int H = 256, I = 128;
    Dev d;
    CUDA_OK(dev_alloc(d, L, H, I));
    CUDA_OK(cudaMemset(d.xs, 0, (size_t)L.rows_cap * H * 2));
    CUDA_OK(cudaMemset(d.row_weight, 0, (size_t)L.rows_cap * 4));
    CUDA_OK(poison_outputs(d, L, H, I));
    CUDA_OK(run_both(d, L, H, I, num_sms(), true));
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint16_t> act((size_t)L.rows_cap * I), comb((size_t)L.num_slots * H);
    CUDA_OK(cudaMemcpy(act.data(), d.act, act.size() * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(comb.data(), d.combine, comb.size() * 2, cudaMemcpyDeviceToHost));
    CHECK(all_poison(act.data(), act.size()), "act written with num_rows = 0");
    CHECK(all_poison(comb.data(), comb.size()), "combine written with num_rows = 0");
    CUDA_OK(run_fused(d, L, H, I, num_sms(), true));
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(act.data(), d.act, act.size() * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(comb.data(), d.combine, comb.size() * 2, cudaMemcpyDeviceToHost));
    CHECK(all_poison(act.data(), act.size()), "fused: act written with num_rows = 0");
    CHECK(all_poison(comb.data(), comb.size()), "fused: combine written with num_rows = 0");
}

/* ---- timing at the Qwen3 shapes --------------------------------------------------------
 * Inputs come from a counter hash (fill_hash_bf16), and a sample of rows is still
 * checked against fp64. */
/* Milliseconds of launch() (one or more kernel launches) between two events. */
template <class Launch>
static cudaError_t time_ms(cudaEvent_t t0, cudaEvent_t t1, Launch &&launch, float *ms) {
    cudaError_t e;
    if ((e = cudaEventRecord(t0)) != cudaSuccess || (e = launch()) != cudaSuccess ||
        (e = cudaEventRecord(t1)) != cudaSuccess || (e = cudaEventSynchronize(t1)) != cudaSuccess)
        return e;
    return cudaEventElapsedTime(ms, t0, t1);
}

static void time_model(const char *name, int H, int I, int E, int tokens, int top_k) {
    if (!have_sm90()) return;
    /* Rows spread unevenly over experts: weight ~ 0.25 + U(0,1)^2 * 3. */
    const int total = tokens * top_k;
    Layout L = make_layout(skewed_counts(E, total), 0, 0);

    Dev d;
    CUDA_OK(dev_alloc(d, L, H, I));
    const float sx = 1.0f, s13 = 2.0f / 64, s2 = 2.0f / 64; /* powers of two: exact */
    const uint32_t seed = (uint32_t)th_rand_u64();
    fill_hash_bf16<<<1024, 256>>>((__nv_bfloat16 *)d.xs, (size_t)L.rows_cap * H, seed, sx);
    fill_hash_bf16<<<1024, 256>>>((__nv_bfloat16 *)d.w13, (size_t)E * 2 * I * H, seed + 1, s13);
    fill_hash_bf16<<<1024, 256>>>((__nv_bfloat16 *)d.w2, (size_t)E * H * I, seed + 2, s2);
    std::vector<float> sw(L.num_slots);
    for (auto &w : sw) w = (float)(0.05 + th_uniform());
    const std::vector<float> rw = row_weights(L, sw);
    CUDA_OK(cudaMemcpy(d.row_weight, rw.data(), rw.size() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(poison_outputs(d, L, H, I));
    const int sms = num_sms();
    CUDA_OK(run_both(d, L, H, I, sms, true));
    CUDA_OK(cudaDeviceSynchronize());

    /* Sampled check: 16 random valid rows, all columns of act and combine. */
    {
        std::vector<uint16_t> arow(I), crow(H);
        std::vector<double> ra, ga, rc, gc;
        for (int s = 0; s < 16; ++s) {
            int r;
            do r = th_rand_int(0, L.num_rows - 1); while (L.row_expert[r] < 0);
            const int e = L.row_expert[r], slot = L.row_slot[r];
            CUDA_OK(cudaMemcpy(arow.data(), d.act + (size_t)r * I, I * 2, cudaMemcpyDeviceToHost));
            CUDA_OK(cudaMemcpy(crow.data(), d.combine + (size_t)slot * H, H * 2,
                               cudaMemcpyDeviceToHost));
            std::vector<double> x(H);
            for (int k = 0; k < H; ++k) x[k] = hash_bf16((size_t)r * H + k, seed, sx);
            for (int j = 0; j < I; ++j) {
                double g = 0, u = 0;
                const size_t gb = ((size_t)e * 2 * I + j) * H, ub = gb + (size_t)I * H;
                for (int k = 0; k < H; ++k) {
                    g += x[k] * hash_bf16(gb + k, seed + 1, s13);
                    u += x[k] * hash_bf16(ub + k, seed + 1, s13);
                }
                ra.push_back(g / (1 + exp(-g)) * u);
                ga.push_back(bf2d(arow[j]));
            }
            for (int n = 0; n < H; ++n) {
                double o = 0;
                const size_t wb = ((size_t)e * H + n) * I;
                for (int k = 0; k < I; ++k) o += bf2d(arow[k]) * hash_bf16(wb + k, seed + 2, s2);
                rc.push_back(sw[slot] * o);
                gc.push_back(bf2d(crow[n]));
            }
        }
        /* act: g, u and act rounded to bf16; combine: one rounding of the device's act. */
        const double tol = th_bf16_tolerance(1), tol_act = th_bf16_tolerance(3);
        const double ea = th_rel_l2(ga.data(), ra.data(), (int64_t)ra.size());
        const double ec = th_rel_l2(gc.data(), rc.data(), (int64_t)rc.size());
        printf("  %s sampled rows: rel err act %.2e (tol %.2e) combine %.2e (tol %.2e)\n", name,
               ea, tol_act, ec, tol);
        CHECK(ea <= tol_act && ec <= tol, "sampled rows off: act %.3e combine %.3e", ea, ec);
    }

    /* Timing: 3 warm-ups, median of 20, CUDA events around each launch. */
    mf_gemm1_params p1 = gemm1_params(d, L, H, I, sms, true);
    mf_gemm1_params p1n = p1;
    p1n.gate_up = nullptr;
    mf_gemm2_params p2 = gemm2_params(d, L, H, I, sms);
    const mf_moe_fused_fwd_params pf = fwd_params(d, L, H, I, sms, true);
    cudaEvent_t t0, t1;
    CUDA_OK(cudaEventCreate(&t0));
    CUDA_OK(cudaEventCreate(&t1));
    std::vector<float> ms1, ms1n, ms2, msf, msb;
    for (int it = 0; it < 23; ++it) {
        float a, b, c, f, both;
        /* gemm1 (+gate_up) and gemm2 back to back, then the fused kernel, then each alone */
        CUDA_OK(time_ms(t0, t1, [&] {
            const cudaError_t e = mf_sm90_gemm1_swiglu_fwd_bf16(&p1, 0);
            return e != cudaSuccess ? e : mf_sm90_gemm2_combine_fwd_bf16(&p2, 0);
        }, &both));
        CUDA_OK(time_ms(t0, t1, [&] { return mf_sm90_moe_fused_fwd_bf16(&pf, 0); }, &f));
        CUDA_OK(time_ms(t0, t1, [&] { return mf_sm90_gemm1_swiglu_fwd_bf16(&p1, 0); }, &a));
        CUDA_OK(time_ms(t0, t1, [&] { return mf_sm90_gemm1_swiglu_fwd_bf16(&p1n, 0); }, &b));
        CUDA_OK(time_ms(t0, t1, [&] { return mf_sm90_gemm2_combine_fwd_bf16(&p2, 0); }, &c));
        if (it >= 3) {
            ms1.push_back(a); ms1n.push_back(b); ms2.push_back(c);
            msf.push_back(f); msb.push_back(both);
        }
    }
    cudaEventDestroy(t0);
    cudaEventDestroy(t1);
    {   /* the fused kernel's combine and act, bitwise the staged ones at this shape */
        std::vector<uint16_t> c1((size_t)L.num_slots * H), c2(c1.size());
        std::vector<uint16_t> a1((size_t)L.num_rows * I), a2(a1.size());
        CUDA_OK(poison_outputs(d, L, H, I));
        CUDA_OK(run_both(d, L, H, I, sms, true));
        CUDA_OK(cudaMemcpy(c1.data(), d.combine, c1.size() * 2, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(a1.data(), d.act, a1.size() * 2, cudaMemcpyDeviceToHost));
        CUDA_OK(poison_outputs(d, L, H, I));
        CUDA_OK(run_fused(d, L, H, I, sms, true));
        CUDA_OK(cudaMemcpy(c2.data(), d.combine, c2.size() * 2, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(a2.data(), d.act, a2.size() * 2, cudaMemcpyDeviceToHost));
        CHECK(memcmp(c1.data(), c2.data(), c1.size() * 2) == 0, "fused combine differs from staged");
        CHECK(memcmp(a1.data(), a2.data(), a1.size() * 2) == 0, "fused act differs from staged");
    }
    const double valid = (double)total, padded = (double)L.num_rows;
    const double f1 = 2.0 * valid * H * 2 * I, f2 = 2.0 * valid * I * H;
    const double m1 = median(ms1), m1n = median(ms1n), m2 = median(ms2);
    printf("  %-16s rows %d (padded %d) E=%d H=%d I=%d sms=%d\n", name, total, L.num_rows, E,
           H, I, sms);
    printf("  %-16s gemm1+swiglu (+gate_up) %8.3f ms %6.1f TFLOP/s\n", name, m1, f1 / m1 * 1e-9);
    printf("  %-16s gemm1+swiglu (act only) %8.3f ms %6.1f TFLOP/s\n", name, m1n, f1 / m1n * 1e-9);
    printf("  %-16s gemm2+combine           %8.3f ms %6.1f TFLOP/s\n", name, m2,
           f2 / m2 * 1e-9);
    const double mb = median(msb), mf = median(msf);
    printf("  %-16s gemm1 then gemm2        %8.3f ms %6.1f TFLOP/s\n", name, mb,
           (f1 + f2) / mb * 1e-9);
    printf("  %-16s fused gemm1+gemm2       %8.3f ms %6.1f TFLOP/s (%.1f%% of gemm1 then "
           "gemm2)\n", name, mf, (f1 + f2) / mf * 1e-9, 100.0 * mf / mb);
    printf("  %-16s (FLOPs counted on %0.f valid rows; padding adds %.1f%%)\n", name, valid,
           100.0 * (padded - valid) / valid);
}

static void time_qwen3_30b(void) { time_model("qwen3-30b-a3b", 2048, 768, 128, 16384, 8); }
static void time_qwen3_235b(void) { time_model("qwen3-235b-a22b", 4096, 1536, 128, 16384, 8); }

/* An optional argument runs only the cases whose name contains it (e.g. "time_qwen3_235b"
 * under a profiler). */
int main(int argc, char **argv) {
    static const struct { const char *name; void (*fn)(void); } cases[] = {
        {"gemm_sm90_bn256_paths", test_bn256_paths},
        {"gemm_sm90_bn128_paths", test_bn128_paths},
        {"gemm_sm90_no_rows", test_no_rows},
        {"gemm_sm90_time_qwen3_30b", time_qwen3_30b},
        {"gemm_sm90_time_qwen3_235b", time_qwen3_235b},
    };
    th_seed_from_env_or_clock();
    for (const auto &c : cases)
        if (argc < 2 || strstr(c.name, argv[1])) th_run(c.name, c.fn);
    return th_finish();
}
