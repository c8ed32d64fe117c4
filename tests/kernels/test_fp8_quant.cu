/* The FP8 quantizers (src/cuda/simt/fp8_quant.cu) bit for bit against the recipe's CPU
 * definition (src/cpu/fp8.c):
 *   - the hardware encoder (cvt.rn.satfinite.e4m3x2.f32) against the integer one on every
 *     one of the 2^32 fp32 inputs;
 *   - rows (1 x 128, MN-major scales) and tokens (128 rows per column, transposed, with and
 *     without each row's p) on random bf16 rows with zeros, an all-zero tile, subnormals,
 *     values far beyond 448, infinities and NaN, both scale rules, num_rows < rows_cap:
 *     codes and scale bits equal, everything past num_rows left as poisoned;
 *   - both from one read (mf_quantize_fp8_rows_tokens) = the two passes above, byte for byte;
 *   - gathered (row_slot: the caller's token-major rows, strided, with padding rows) = the
 *     three passes on the rows gathered by hand, byte for byte (the tokens pass alone at
 *     264 columns: its last column slab partial);
 *   - the quantizers' division-free x / scale (quantize8: the product by the reciprocal and
 *     one fma correction, quotients()) = encode(div.rn(x, scale)) for all 65536 bf16 x
 *     within twice a tile's range (finite, |x| <= 896 scale) under thousands of scales
 *     (amax / 448 of random amax, and the edges: the smallest scale, amax near FLT_MAX,
 *     subnormal-only tiles), and for fp32 x placed at every e4m3 rounding midpoint times
 *     the scale, +-8 ulp (p dy's values are fp32);
 *   - more blocks than the GPU's SMs hold at once (8192 x 2048), with and without p.
 * The weights' quantizer is checked through moefuse_quantize_weights against the CPU
 * backend (tests/api/test_cuda_fp8.c). */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <vector>

#include "fp8.h"
#include "fp8_recipe.cuh"
#include "gemm_test_util.h"
#include "kernels.h"

namespace {

__global__ void encoders_agree_kernel(unsigned long long *mismatches, uint32_t *first) {
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (1ull << 32);
         i += stride) {
        const float v = __uint_as_float((uint32_t)i);
        const uint8_t want = mf::fp8::e4m3_encode(v);
        const uint16_t got = mf::fp8::e4m3x2_encode(v, -v);
        const uint8_t want_neg = mf::fp8::e4m3_encode(-v);
        if ((got & 0xff) != want || (got >> 8) != want_neg) {
            if (atomicAdd(mismatches, 1ull) == 0) *first = (uint32_t)i;
        }
    }
}

void encoders_agree(void) {
    if (!have_sm90()) return;
    unsigned long long *bad;
    uint32_t *first;
    CUDA_OK(cudaMalloc(&bad, 8));
    CUDA_OK(cudaMalloc(&first, 4));
    CUDA_OK(cudaMemset(bad, 0, 8));
    encoders_agree_kernel<<<num_sms() * 8, 256>>>(bad, first);
    CUDA_OK(cudaDeviceSynchronize());
    unsigned long long n = 0;
    uint32_t f = 0;
    CUDA_OK(cudaMemcpy(&n, bad, 8, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(&f, first, 4, cudaMemcpyDeviceToHost));
    CHECK(n == 0, "cvt.rn.satfinite.e4m3x2 differs from the recipe's encoder on %llu inputs "
                  "(e.g. 0x%08x)", n, f);
    cudaFree(bad);
    cudaFree(first);
}

/* quantize8 against encode(div.rn(x, s)), element by element: each thread one group of 8
 * values under one scale. Values: the bf16 patterns (mode 0: group g = patterns 8g..8g+7)
 * or fp32 values at an e4m3 rounding midpoint m times s, nudged by k ulp (mode 1: group g
 * = midpoint g / 17, k = g % 17 - 8, the 8 values that and its negation and 6 neighbours). */
__global__ void quotient_agrees_kernel(const float *scales, int num_scales, int mode,
                                       unsigned long long *mismatches, uint32_t *first) {
    const int groups = mode == 0 ? 65536 / 8 : 118 * 17;   /* the normals' 118 midpoints */
    const int64_t total = (int64_t)groups * num_scales;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const int g = (int)(i % groups), si = (int)(i / groups);
        const float s = scales[si];
        float x[8];
        if (mode == 0) {
            for (int j = 0; j < 8; ++j) x[j] = __uint_as_float((uint32_t)(8 * g + j) << 16);
        } else {
            /* midpoint of e4m3 normals c and c + 1, c = 8 (2^-6) .. 125 (416 and 448):
             * fp32 exponent (c >> 3) + 120, mantissa (c & 7) then a half of its last place */
            const int c = 8 + g / 17, k = g % 17 - 8;
            const uint32_t lo = (uint32_t)(c >> 3) + 120u, m3 = (uint32_t)(c & 7);
            const float mid = __uint_as_float((lo << 23) | (m3 << 20) | 0x80000u);
            const float base = __fmul_rn(mid, s);
            const uint32_t b = __float_as_uint(base);
            for (int j = 0; j < 8; ++j) {
                const int kk = k + (j >> 1) - 2;
                const float v = __uint_as_float((uint32_t)((int32_t)b + kk));
                x[j] = (j & 1) ? -v : v;
            }
        }
        const uint2 got = mf::fp8::quantize8(x, s, __frcp_rn(s));
        for (int j = 0; j < 8; ++j) {
            const uint32_t word = j < 4 ? got.x : got.y;
            const uint8_t code = (uint8_t)(word >> (8 * (j & 3)));
            /* a tile's values are within 448 scales and finite (quotients()'
             * precondition; a tile with an infinity has a NaN scale); twice that keeps
             * saturating quotients in the check */
            if (!(fabsf(x[j]) <= fminf(896.0f * s, 3.402823466e38f))) continue;
            if (code != mf::fp8::e4m3_encode(__fdiv_rn(x[j], s))) {
                if (atomicAdd(mismatches, 1ull) == 0) *first = __float_as_uint(x[j]);
            }
        }
    }
}

void quotient_agrees(void) {
    if (!have_sm90()) return;
    /* scales as the recipe makes them: amax / 448, at least the smallest normal */
    std::vector<float> scales;
    for (int i = 0; i < 2000; i++) {
        const float amax = (float)ldexp(0.5 + th_uniform(), (int)(th_uniform() * 200) - 100);
        scales.push_back(mf_fp8_scale(amax, 0));
    }
    const float edges[] = {1.0e-44f /* subnormal-only tile */, 1.1754944e-38f, 3.4e38f,
                           448.0f, 1.0f, 3.0f, 0.1f};
    for (float a : edges) scales.push_back(mf_fp8_scale(a, 0));
    float *d_scales = dev_upload(scales);
    CHECK(d_scales != nullptr, "cudaMalloc of %zu scales", scales.size());
    if (!d_scales) return;
    unsigned long long *bad;
    uint32_t *first;
    CUDA_OK(cudaMalloc(&bad, 8));
    CUDA_OK(cudaMalloc(&first, 4));
    for (int mode = 0; mode < 2; mode++) {
        CUDA_OK(cudaMemset(bad, 0, 8));
        quotient_agrees_kernel<<<num_sms() * 8, 256>>>(d_scales, (int)scales.size(), mode, bad,
                                                       first);
        CUDA_OK(cudaDeviceSynchronize());
        unsigned long long n = 0;
        uint32_t f = 0;
        CUDA_OK(cudaMemcpy(&n, bad, 8, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(&f, first, 4, cudaMemcpyDeviceToHost));
        CHECK(n == 0, "quantize8 differs from encode(div.rn) on %llu %s values (e.g. 0x%08x)", n,
              mode == 0 ? "bf16" : "near-midpoint fp32", f);
    }
    cudaFree(bad);
    cudaFree(first);
    cudaFree(d_scales);
}

/* rows x cols bf16 of N(0, 1) scaled per row, with the special values of the recipe. */
std::vector<uint16_t> special_rows(int rows, int cols) {
    std::vector<uint16_t> v((size_t)rows * cols);
    for (int r = 0; r < rows; r++) {
        const double s = ldexp(1.0, (int)(th_uniform() * 40) - 20);
        for (int c = 0; c < cols; c++) v[(size_t)r * cols + c] = f2bf((float)(th_normal() * s));
    }
    const uint16_t specials[] = {0x0000, 0x8000, 0x0001, 0x8003, 0x7f80, 0xff80, 0x7fc0,
                                 0x4780 /* 65536 */, 0xc6fa, 0x43e0 /* 448 */, 0x43e8};
    for (int i = 0; i < 64; i++) {
        const size_t at = (size_t)(th_uniform() * (double)v.size()) % v.size();
        v[at] = specials[i % (int)(sizeof specials / sizeof specials[0])];
    }
    for (int c = 0; c < 128 && c < cols; c++) v[(size_t)(rows / 2) * cols + c] = 0;   /* a zero tile */
    return v;
}

void rows_case(int rows_cap, int num_rows, int cols, int pow2) {
    const int ld = (rows_cap + 3) / 4 * 4, tiles = cols / 128;
    std::vector<uint16_t> in = special_rows(rows_cap, cols);
    std::vector<float> f(in.size());
    for (size_t i = 0; i < in.size(); i++) f[i] = (float)bf2d(in[i]);
    std::vector<uint8_t> want((size_t)rows_cap * cols, 0xab);
    std::vector<float> want_s((size_t)tiles * ld);
    memset(want_s.data(), 0xab, want_s.size() * 4);
    mf_fp8_quantize_rows(f.data(), num_rows, cols, cols, pow2, want.data(), want_s.data(), 1, ld);

    uint16_t *d_in = dev_upload(in);
    int32_t *d_rows = dev_upload(std::vector<int32_t>{num_rows});
    uint8_t *d_codes;
    float *d_scales;
    CUDA_OK(cudaMalloc(&d_codes, want.size()));
    CUDA_OK(cudaMalloc(&d_scales, want_s.size() * 4));
    CUDA_OK(cudaMemset(d_codes, 0xab, want.size()));
    CUDA_OK(cudaMemset(d_scales, 0xab, want_s.size() * 4));
    mf_quantize_fp8_rows_params p = {d_in, cols, rows_cap, d_rows, cols, pow2, d_codes, d_scales, ld};
    CUDA_OK(mf_quantize_fp8_rows(&p, 0));
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint8_t> got = dev_download(d_codes, want.size());
    std::vector<float> got_s = dev_download(d_scales, want_s.size());
    size_t bad = 0, bad_s = 0;
    for (size_t i = 0; i < want.size(); i++) bad += got[i] != want[i];
    bad_s = memcmp(got_s.data(), want_s.data(), want_s.size() * 4) != 0;
    CHECK(bad == 0 && bad_s == 0, "rows %d/%d x %d pow2=%d: %zu codes differ, scales %s", num_rows,
          rows_cap, cols, pow2, bad, bad_s ? "differ" : "equal");
    cudaFree(d_in); cudaFree(d_rows); cudaFree(d_codes); cudaFree(d_scales);
}

void tokens_case(int rows_cap, int num_rows, int cols, int pow2, bool weighted) {
    std::vector<uint16_t> in = special_rows(rows_cap, cols);
    std::vector<float> pw(rows_cap);
    for (int r = 0; r < rows_cap; r++) pw[r] = (float)(th_uniform() * 2.0);
    std::vector<uint8_t> want((size_t)cols * rows_cap, 0xab);
    std::vector<float> want_s((size_t)rows_cap / 128 * cols);
    memset(want_s.data(), 0xab, want_s.size() * 4);
    std::vector<float> col(128);
    for (int t = 0; t < num_rows / 128; t++)
        for (int c = 0; c < cols; c++) {
            for (int i = 0; i < 128; i++) {
                const int r = t * 128 + i;
                const float x = (float)bf2d(in[(size_t)r * cols + c]);
                col[i] = weighted ? pw[r] * x : x;
            }
            want_s[(size_t)t * cols + c] = mf_fp8_quantize_tile(
                col.data(), 128, 1, pow2, want.data() + (size_t)c * rows_cap + t * 128, 1);
        }
    uint16_t *d_in = dev_upload(in);
    float *d_pw = dev_upload(pw);
    int32_t *d_rows = dev_upload(std::vector<int32_t>{num_rows});
    uint8_t *d_codes;
    float *d_scales;
    CUDA_OK(cudaMalloc(&d_codes, want.size()));
    CUDA_OK(cudaMalloc(&d_scales, want_s.size() * 4));
    CUDA_OK(cudaMemset(d_codes, 0xab, want.size()));
    CUDA_OK(cudaMemset(d_scales, 0xab, want_s.size() * 4));
    mf_quantize_fp8_tokens_params p = {d_in, cols, rows_cap, d_rows, cols,
                                       weighted ? d_pw : nullptr, pow2, d_codes, d_scales};
    CUDA_OK(mf_quantize_fp8_tokens(&p, 0));
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint8_t> got = dev_download(d_codes, want.size());
    std::vector<float> got_s = dev_download(d_scales, want_s.size());
    size_t bad = 0;
    for (size_t i = 0; i < want.size(); i++) bad += got[i] != want[i];
    const bool bad_s = memcmp(got_s.data(), want_s.data(), want_s.size() * 4) != 0;
    CHECK(bad == 0 && !bad_s, "tokens %d/%d x %d pow2=%d p=%d: %zu codes differ, scales %s",
          num_rows, rows_cap, cols, pow2, (int)weighted, bad, bad_s ? "differ" : "equal");
    cudaFree(d_in); cudaFree(d_pw); cudaFree(d_rows); cudaFree(d_codes); cudaFree(d_scales);
}

void rows_match(void) {
    if (!have_sm90()) return;
    for (int pow2 = 0; pow2 < 2; pow2++) {
        rows_case(128, 128, 128, pow2);
        rows_case(384, 257, 768, pow2);
        rows_case(4096, 3968, 2048, pow2);
        rows_case(512, 0, 4096, pow2);
    }
}

void tokens_match(void) {
    if (!have_sm90()) return;
    for (int pow2 = 0; pow2 < 2; pow2++)
        for (int w = 0; w < 2; w++) {
            tokens_case(128, 128, 128, pow2, w);
            tokens_case(384, 256, 776, pow2, w);
            tokens_case(2048, 1920, 2048, pow2, w);
        }
    /* more blocks (62 x 16) than an SM's CTAs (2 weighted, else 4) on every SM at once */
    tokens_case(8192, 7936, 2048, 0, true);
    tokens_case(8192, 7936, 2048, 0, false);
}

/* The rows and tokens passes' outputs on the device, poisoned (0xab bytes). */
struct QuantOut {
    size_t n_codes, n_rs, n_ts;   /* codes (both forms), row scales, token scales */
    uint8_t *codes = nullptr, *codes_t = nullptr;
    float *rs = nullptr, *ts = nullptr;
    QuantOut(int rows_cap, int cols, int ld)
        : n_codes((size_t)rows_cap * cols), n_rs((size_t)cols / 128 * ld),
          n_ts((size_t)rows_cap / 128 * cols) {
        if (cudaMalloc(&codes, n_codes) != cudaSuccess || cudaMalloc(&codes_t, n_codes) ||
            cudaMalloc(&rs, n_rs * 4) || cudaMalloc(&ts, n_ts * 4))
            return;
        cudaMemset(codes, 0xab, n_codes);
        cudaMemset(codes_t, 0xab, n_codes);
        cudaMemset(rs, 0xab, n_rs * 4);
        cudaMemset(ts, 0xab, n_ts * 4);
    }
    ~QuantOut() { cudaFree(codes); cudaFree(codes_t); cudaFree(rs); cudaFree(ts); }
    bool ok() const { return codes && codes_t && rs && ts; }
};

/* Each of the four arrays of a and b the same bytes; what differs into CHECK's message. */
void check_same(const QuantOut &a, const QuantOut &b, const char *what) {
    const bool codes = dev_download(a.codes, a.n_codes) == dev_download(b.codes, b.n_codes);
    const bool codes_t = dev_download(a.codes_t, a.n_codes) == dev_download(b.codes_t, b.n_codes);
    const std::vector<float> ra = dev_download(a.rs, a.n_rs), rb = dev_download(b.rs, b.n_rs);
    const std::vector<float> ta = dev_download(a.ts, a.n_ts), tb = dev_download(b.ts, b.n_ts);
    const bool rs = memcmp(ra.data(), rb.data(), a.n_rs * 4) == 0;
    const bool ts = memcmp(ta.data(), tb.data(), a.n_ts * 4) == 0;
    CHECK(codes && codes_t && rs && ts,
          "%s: row codes %s, row scales %s, token codes %s, token scales %s", what,
          codes ? "equal" : "differ", rs ? "equal" : "differ", codes_t ? "equal" : "differ",
          ts ? "equal" : "differ");
}

/* The fused pass against the two separate ones (each checked against the CPU above). */
void rows_tokens_case(int rows_cap, int num_rows, int cols, int pow2, bool weighted) {
    const int ld = (rows_cap + 3) / 4 * 4;
    std::vector<uint16_t> in = special_rows(rows_cap, cols);
    std::vector<float> pw(rows_cap);
    for (int r = 0; r < rows_cap; r++) pw[r] = (float)(th_uniform() * 2.0);
    uint16_t *d_in = dev_upload(in);
    float *d_pw = dev_upload(pw);
    int32_t *d_rows = dev_upload(std::vector<int32_t>{num_rows});
    QuantOut two(rows_cap, cols, ld), one(rows_cap, cols, ld);
    CHECK(two.ok() && one.ok(), "cudaMalloc of the outputs");
    if (two.ok() && one.ok()) {
        QuantOut *out[2] = {&two, &one};
        mf_quantize_fp8_rows_params r[2];
        mf_quantize_fp8_tokens_params t[2];
        for (int k = 0; k < 2; k++) {
            r[k] = {d_in, cols, rows_cap, d_rows, cols, pow2, out[k]->codes, out[k]->rs, ld};
            t[k] = {d_in, cols, rows_cap, d_rows, cols, weighted ? d_pw : nullptr, pow2,
                    out[k]->codes_t, out[k]->ts};
        }
        CUDA_OK(mf_quantize_fp8_rows(&r[0], 0));
        CUDA_OK(mf_quantize_fp8_tokens(&t[0], 0));
        CUDA_OK(mf_quantize_fp8_rows_tokens(&r[1], &t[1], 0));
        CUDA_OK(cudaDeviceSynchronize());
        char what[96];
        snprintf(what, sizeof what, "rows+tokens %d/%d x %d pow2=%d p=%d", num_rows, rows_cap,
                 cols, pow2, (int)weighted);
        check_same(two, one, what);
    }
    cudaFree(d_in); cudaFree(d_pw); cudaFree(d_rows);
}

/* The gathered passes (row_slot, token rows of stride cols + 8, a tenth of the rows
 * padding) against the sorted passes on the same rows gathered on the host. */
void gathered_case(int rows_cap, int num_rows, int cols, int pow2, bool weighted, int K) {
    const int ld = (rows_cap + 3) / 4 * 4, x_ld = cols + 8, T = rows_cap / K + 1;
    const std::vector<uint16_t> x = special_rows(T, x_ld);
    std::vector<int32_t> row_slot(rows_cap);
    std::vector<uint16_t> sorted((size_t)rows_cap * cols, 0);
    for (int r = 0; r < rows_cap; r++) {
        row_slot[r] = th_uniform() < 0.1 ? -1 : th_rand_int(0, T * K - 1);
        if (row_slot[r] >= 0)
            memcpy(&sorted[(size_t)r * cols], &x[(size_t)(row_slot[r] / K) * x_ld], cols * 2);
    }
    std::vector<float> pw(rows_cap);
    for (int r = 0; r < rows_cap; r++) pw[r] = (float)(th_uniform() * 2.0);
    uint16_t *d_x = dev_upload(x), *d_sorted = dev_upload(sorted);
    int32_t *d_slot = dev_upload(row_slot), *d_rows = dev_upload(std::vector<int32_t>{num_rows});
    float *d_pw = dev_upload(pw);
    /* sorted rows, gathered, gathered rows + tokens in one pass */
    QuantOut sorted_out(rows_cap, cols, ld), gathered(rows_cap, cols, ld), one(rows_cap, cols, ld);
    QuantOut *out[3] = {&sorted_out, &gathered, &one};
    CHECK(sorted_out.ok() && gathered.ok() && one.ok(), "cudaMalloc of the outputs");
    if (sorted_out.ok() && gathered.ok() && one.ok()) {
        mf_quantize_fp8_rows_params r[3];
        mf_quantize_fp8_tokens_params t[3];
        for (int k = 0; k < 3; k++) {
            const bool g = k > 0;
            r[k] = {g ? d_x : d_sorted, g ? x_ld : cols, rows_cap, d_rows, cols, pow2,
                    out[k]->codes, out[k]->rs, ld, g ? d_slot : nullptr, g ? K : 0};
            t[k] = {g ? d_x : d_sorted, g ? x_ld : cols, rows_cap, d_rows, cols,
                    weighted ? d_pw : nullptr, pow2, out[k]->codes_t, out[k]->ts,
                    g ? d_slot : nullptr, g ? K : 0};
        }
        /* cols not a multiple of 128: the tokens pass alone (its last column slab partial) */
        const bool rows = cols % 128 == 0;
        for (int k = 0; k < 2; k++) {
            if (rows) CUDA_OK(mf_quantize_fp8_rows(&r[k], 0));
            CUDA_OK(mf_quantize_fp8_tokens(&t[k], 0));
        }
        if (rows) CUDA_OK(mf_quantize_fp8_rows_tokens(&r[2], &t[2], 0));
        CUDA_OK(cudaDeviceSynchronize());
        char what[128];
        for (int k = 1; k < (rows ? 3 : 2); k++) {
            snprintf(what, sizeof what, "gathered %s %d/%d x %d K=%d pow2=%d p=%d",
                     k == 1 ? "rows, tokens" : "rows + tokens", num_rows, rows_cap, cols, K,
                     pow2, (int)weighted);
            check_same(sorted_out, *out[k], what);
        }
    }
    cudaFree(d_x); cudaFree(d_sorted); cudaFree(d_slot); cudaFree(d_rows); cudaFree(d_pw);
}

void gathered_match(void) {
    if (!have_sm90()) return;
    for (int pow2 = 0; pow2 < 2; pow2++)
        for (int w = 0; w < 2; w++) {
            gathered_case(128, 128, 128, pow2, w, 1);
            gathered_case(512, 384, 768, pow2, w, 8);
            gathered_case(2048, 1920, 2048, pow2, w, 4);
            gathered_case(384, 300, 264, pow2, w, 8);   /* two slabs and 8 columns */
        }
    gathered_case(8192, 7936, 2048, 0, true, 8);   /* more blocks than resident CTAs */
}

void rows_tokens_match(void) {
    if (!have_sm90()) return;
    for (int pow2 = 0; pow2 < 2; pow2++)
        for (int w = 0; w < 2; w++) {
            rows_tokens_case(128, 128, 128, pow2, w);
            rows_tokens_case(512, 384, 768, pow2, w);
            rows_tokens_case(2048, 1920, 2048, pow2, w);
        }
    rows_tokens_case(8192, 7936, 2048, 1, true);   /* more blocks than resident CTAs */
}

}  // namespace

int main() {
    th_seed_from_env_or_clock();
    th_run("fp8: the hardware encoder = the recipe's on all 2^32 fp32 inputs", encoders_agree);
    th_run("fp8: the division-free x / scale = encode(div.rn), bf16 and near-midpoint x",
           quotient_agrees);
    th_run("fp8: rows quantizer = mf_fp8_quantize_rows (specials, both scale rules)", rows_match);
    th_run("fp8: tokens quantizer = per-column tiles of 128 rows (p dy too)", tokens_match);
    th_run("fp8: rows + tokens in one pass = the two passes", rows_tokens_match);
    th_run("fp8: gathered token rows (row_slot) = the passes on rows gathered by hand",
           gathered_match);
    return th_finish();
}
