/* The one-GPU dispatch (mf_dispatch_rows_bf16, src/cuda/transport/dispatch_rows.cu) against a host
 * copy: expert-sorted layouts with uneven experts, dropped slots and spare capacity, one
 * or two tensors of token rows with their own row strides, outputs poisoned first.
 *   - every live row r < num_rows holds its token's row (token = row_slot[r] / K);
 *   - every padding row below num_rows is zero;
 *   - rows at or past num_rows keep the poison;
 *   - each row's routing weight: row_weight[r] = weights[row_slot[r]], 0 for padding
 *     rows, poison at or past num_rows (with one tensor and with two);
 *   - with the plan's call_failed flag set, nothing is written;
 *   - with no tensor (the FP8 backward on one GPU), the rows' p alone;
 *   - FP8 (codes set): the codes and scales bitwise those of mf_quantize_fp8_rows run on
 *     the bf16 dispatch's rows (padding rows included, rows past num_rows untouched),
 *     amax and power-of-two scales, with a NaN, values far beyond 448 and an all-zero
 *     token among the inputs. */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

extern "C" {
#include "harness.h"
}
#include "gemm_test_util.h"
#include "kernels.h"

namespace {

constexpr uint16_t kPoisonBits = 0xFFFF;

/* One tensor of token rows [T, H] at row stride `stride` (elements), random bf16. */
struct TokenRows {
    int stride;
    std::vector<uint16_t> host;
    uint16_t *x = nullptr;    /* device copy */
    uint16_t *xs = nullptr;   /* device output [rows_cap, H] */
    ~TokenRows() { cudaFree(x); cudaFree(xs); }
};

/* The plan's device arrays. */
struct PlanBufs {
    int32_t *slot_row = nullptr, *row_slot = nullptr, *num_rows = nullptr, *failed = nullptr;
    ~PlanBufs() { cudaFree(slot_row); cudaFree(row_slot); cudaFree(num_rows); cudaFree(failed); }
};

/* The FP8 dispatch of p's tensor (its bf16 rows already in p.xs[0], checked) against
 * mf_quantize_fp8_rows run on those rows: every code and scale byte, both poisoned first. */
void check_fp8(const char *what, mf_dispatch_params p, const Layout &L, int H, int pow2,
               bool failed) {
    const int scale_ld = (L.rows_cap + 3) / 4 * 4;
    const size_t ncodes = (size_t)L.rows_cap * H, nscales = (size_t)(H / 128) * scale_ld * 4;
    uint8_t *codes[2] = {nullptr, nullptr};
    float *scales[2] = {nullptr, nullptr};
    for (int i = 0; i < 2; ++i) {
        CUDA_OK(cudaMalloc((void **)&codes[i], ncodes));
        CUDA_OK(cudaMalloc((void **)&scales[i], nscales));
        CUDA_OK(cudaMemset(codes[i], 0xFF, ncodes));
        CUDA_OK(cudaMemset(scales[i], 0xFF, nscales));
    }
    {
        mf_quantize_fp8_rows_params q = {};
        q.in = p.xs[0];
        q.ld = H;
        q.rows_cap = L.rows_cap;
        q.num_rows = p.num_rows;
        q.cols = H;
        q.pow2 = pow2;
        q.codes = codes[0];
        q.scales = scales[0];
        q.scale_ld = scale_ld;
        CUDA_OK(mf_quantize_fp8_rows(&q, 0));
        p.row_weight = nullptr;
        p.codes = codes[1];
        p.scales = scales[1];
        p.scale_ld = scale_ld;
        p.pow2 = pow2;
        CUDA_OK(mf_dispatch_rows_bf16(&p, 0));
        CUDA_OK(cudaDeviceSynchronize());
        std::vector<uint8_t> c[2];
        std::vector<uint32_t> sc[2];
        for (int i = 0; i < 2; ++i) {
            c[i].resize(ncodes);
            sc[i].resize(nscales / 4);
            CUDA_OK(cudaMemcpy(c[i].data(), codes[i], ncodes, cudaMemcpyDeviceToHost));
            CUDA_OK(cudaMemcpy(sc[i].data(), scales[i], nscales, cudaMemcpyDeviceToHost));
        }
        /* call_failed: the dispatch writes nothing (the rows quantizer would quantize the
         * bf16 dispatch's untouched poison), so its buffers keep theirs */
        const std::vector<uint8_t> poison_codes(H, 0xFF);
        int wrong = 0, first = -1;
        for (int r = 0; r < L.rows_cap; ++r) {
            const uint8_t *want = failed ? poison_codes.data() : c[0].data() + (size_t)r * H;
            bool ok = !memcmp(want, c[1].data() + (size_t)r * H, H);
            for (int b = 0; b < H / 128 && ok; ++b)
                ok = sc[1][(size_t)b * scale_ld + r] ==
                     (failed ? 0xFFFFFFFFu : sc[0][(size_t)b * scale_ld + r]);
            if (!ok && wrong++ == 0) first = r;
        }
        CHECK(wrong == 0,
              "%s, fp8 (pow2 %d): %d of %d rows' codes or scales differ from the rows "
              "quantizer's, first row %d (num_rows %d, slot %d)", what, pow2, wrong,
              L.rows_cap, first, L.num_rows, first >= 0 ? L.row_slot[first] : 0);
    }
    for (int i = 0; i < 2; ++i) {
        cudaFree(codes[i]);
        cudaFree(scales[i]);
    }
}

/* Runs the dispatch of `tensors` (1 or 2) over the layout and checks every output row;
 * fp8_pow2 >= 0 (one tensor, H % 128 == 0): then the FP8 dispatch with that scale rule
 * (check_fp8). */
void check_dispatch(const char *what, const std::vector<int> &counts, int K, int H,
                    int extra_rows, int dropped, int num_tensors, bool failed,
                    int fp8_pow2 = -1) {
    Layout L = make_layout(counts, extra_rows, dropped);
    /* Whole tokens: pad the slot count up to a multiple of K with more dropped slots. */
    const int T = (L.num_slots + K - 1) / K;
    std::vector<int32_t> slot_row((size_t)T * K, -1);
    for (int r = 0; r < L.num_rows; ++r)
        if (L.row_slot[r] >= 0) slot_row[L.row_slot[r]] = r;

    TokenRows t[2];
    const int strides[2] = {H, H + 8 * th_rand_int(1, 4)};
    PlanBufs b;
    int32_t *&d_slot_row = b.slot_row, *&d_row_slot = b.row_slot, *&d_num_rows = b.num_rows,
            *&d_failed = b.failed;
    mf_dispatch_params p;
    memset(&p, 0, sizeof p);
    const int flag = failed ? 1 : 0;
    CUDA_OK(cudaMalloc((void **)&d_slot_row, slot_row.size() * 4 + 4));
    CUDA_OK(cudaMalloc((void **)&d_row_slot, (size_t)L.rows_cap * 4));
    CUDA_OK(cudaMalloc((void **)&d_num_rows, 4));
    CUDA_OK(cudaMalloc((void **)&d_failed, 4));
    CUDA_OK(cudaMemcpy(d_slot_row, slot_row.data(), slot_row.size() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_row_slot, L.row_slot.data(), (size_t)L.rows_cap * 4,
                       cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_num_rows, &L.num_rows, 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_failed, &flag, 4, cudaMemcpyHostToDevice));
    for (int j = 0; j < num_tensors; ++j) {
        t[j].stride = strides[j];
        t[j].host.resize((size_t)T * strides[j]);
        for (auto &v : t[j].host) v = f2bf((float)th_normal());
        if (fp8_pow2 >= 0 && T >= 3) {   /* a NaN, values beyond 448, an all-zero token */
            t[j].host[5] = 0x7FC0;
            t[j].host[(size_t)strides[j] + 7] = f2bf(3.0e4f);
            t[j].host[(size_t)strides[j] + 200 % H] = f2bf(-1.0e30f);
            for (int c = 0; c < H; ++c) t[j].host[(size_t)2 * strides[j] + c] = 0;
        }
        CUDA_OK(cudaMalloc((void **)&t[j].x, t[j].host.size() * 2));
        CUDA_OK(cudaMalloc((void **)&t[j].xs, (size_t)L.rows_cap * H * 2));
        CUDA_OK(cudaMemcpy(t[j].x, t[j].host.data(), t[j].host.size() * 2,
                           cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemset(t[j].xs, 0xFF, (size_t)L.rows_cap * H * 2));
        p.x[j] = t[j].x;
        p.x_stride[j] = strides[j];
        p.xs[j] = t[j].xs;
    }
    p.num_tensors = num_tensors;
    p.slot_row = d_slot_row;
    p.row_slot = d_row_slot;
    p.num_rows = d_num_rows;
    p.call_failed = d_failed;
    p.num_tokens = T;
    p.rows_cap = L.rows_cap;
    p.hidden = H;
    p.top_k = K;
    p.num_sms = num_sms();
    std::vector<float> weights((size_t)T * K);
    for (auto &w : weights) w = (float)(0.05 + th_uniform());
    float *d_weights = nullptr, *d_row_weight = nullptr;
    CUDA_OK(cudaMalloc((void **)&d_weights, weights.size() * 4 + 4));
    CUDA_OK(cudaMalloc((void **)&d_row_weight, (size_t)L.rows_cap * 4));
    CUDA_OK(cudaMemcpy(d_weights, weights.data(), weights.size() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(d_row_weight, 0xFF, (size_t)L.rows_cap * 4));
    p.weights = d_weights;
    p.row_weight = d_row_weight;
    CUDA_OK(mf_dispatch_rows_bf16(&p, 0));
    CUDA_OK(cudaDeviceSynchronize());
    {
        std::vector<uint32_t> rw(L.rows_cap);
        CUDA_OK(cudaMemcpy(rw.data(), d_row_weight, rw.size() * 4, cudaMemcpyDeviceToHost));
        int wrong = 0, first = -1;
        for (int r = 0; r < L.rows_cap; ++r) {
            uint32_t want = 0xFFFFFFFFu;
            if (!failed && r < L.num_rows) {
                const float w = L.row_slot[r] >= 0 ? weights[L.row_slot[r]] : 0.f;
                memcpy(&want, &w, 4);
            }
            if (rw[r] != want && wrong++ == 0) first = r;
        }
        CHECK(wrong == 0, "%s: row_weight: %d of %d rows wrong, first row %d (num_rows %d)",
              what, wrong, L.rows_cap, first, L.num_rows);
    }
    cudaFree(d_weights);
    cudaFree(d_row_weight);

    for (int j = 0; j < num_tensors; ++j) {
        std::vector<uint16_t> out((size_t)L.rows_cap * H);
        CUDA_OK(cudaMemcpy(out.data(), t[j].xs, out.size() * 2, cudaMemcpyDeviceToHost));
        int wrong = 0, first = -1;
        for (int r = 0; r < L.rows_cap; ++r) {
            const uint16_t *row = out.data() + (size_t)r * H;
            const int slot = L.row_slot[r];
            bool ok = true;
            for (int c = 0; c < H && ok; ++c) {
                uint16_t want = kPoisonBits;
                if (!failed && r < L.num_rows)
                    want = slot >= 0 ? t[j].host[(size_t)(slot / K) * t[j].stride + c] : 0;
                ok = row[c] == want;
            }
            if (!ok && wrong++ == 0) first = r;
        }
        CHECK(wrong == 0,
              "%s, tensor %d: %d of %d rows wrong, first row %d (num_rows %d, slot %d)", what, j,
              wrong, L.rows_cap, first, L.num_rows, first >= 0 ? L.row_slot[first] : 0);
    }
    if (fp8_pow2 >= 0) check_fp8(what, p, L, H, fp8_pow2, failed);
}

void test_one_tensor(void) {
    if (!have_sm90()) return;
    check_dispatch("H 2048, K 8, 16 uneven experts", skewed_counts(16, 2000), 8, 2048, 256, 48,
                   1, false);
    check_dispatch("H 4096 (4 passes a row), K 4", skewed_counts(8, 700), 4, 4096, 0, 4, 1,
                   false);
    check_dispatch("H 136 (17 vectors a row), K 2", skewed_counts(5, 333), 2, 136, 128, 9, 1,
                   false);
    check_dispatch("one token, K 1", std::vector<int>{0, 1, 0}, 1, 256, 0, 0, 1, false);
}

void test_two_tensors(void) {
    if (!have_sm90()) return;
    check_dispatch("dy and x, H 2048, K 8", skewed_counts(32, 3000), 8, 2048, 384, 40, 2, false);
    check_dispatch("dy and x, H 1280, K 6, empty experts",
                   std::vector<int>{0, 700, 0, 0, 31, 0, 129, 0}, 6, 1280, 128, 26, 2, false);
}

/* num_tensors 0 (the FP8 backward on one GPU): each row's p only */
void test_weights_only(void) {
    if (!have_sm90()) return;
    check_dispatch("the rows' p only, K 8", skewed_counts(16, 2000), 8, 2048, 256, 48, 0, false);
}

void test_call_failed(void) {
    if (!have_sm90()) return;
    check_dispatch("call_failed set: nothing written", skewed_counts(16, 1000), 8, 512, 128, 24,
                   2, true);
}

void test_fp8(void) {
    if (!have_sm90()) return;
    check_dispatch("fp8, H 2048, K 8, 16 uneven experts", skewed_counts(16, 2000), 8, 2048, 256,
                   48, 1, false, 0);
    check_dispatch("fp8 pow2, H 4096, K 4", skewed_counts(8, 700), 4, 4096, 0, 4, 1, false, 1);
    check_dispatch("fp8, H 128 (one tile), K 2", skewed_counts(5, 333), 2, 128, 128, 9, 1,
                   false, 0);
    check_dispatch("fp8, H 1280 (5 tiles: a partial pass), K 6",
                   std::vector<int>{0, 700, 0, 0, 31, 0, 129, 0}, 6, 1280, 128, 26, 1, false, 0);
    check_dispatch("fp8, call_failed set: nothing written", skewed_counts(16, 1000), 8, 512, 128,
                   24, 1, true, 0);
}

}  // namespace

int main(int argc, char **argv) {
    static const struct { const char *name; void (*fn)(void); } cases[] = {
        {"dispatch_rows_one_tensor", test_one_tensor},
        {"dispatch_rows_two_tensors", test_two_tensors},
        {"dispatch_rows_call_failed", test_call_failed},
        {"dispatch_rows_weights_only", test_weights_only},
        {"dispatch_rows_fp8", test_fp8},
    };
    th_seed_from_env_or_clock();
    for (const auto &c : cases)
        if (argc < 2 || strstr(c.name, argv[1])) th_run(c.name, c.fn);
    return th_finish();
}
