/* The timing of the FP8 quantizers (test_fp8_quant.cu checks their bits) at qwen3-30b-a3b,
 * T = 16384: 139,264 rows (T K = 131,072 slots, each of 128 experts padded to 128 rows),
 * the passes of a forward + backward: rows 1 x 128 of x (H = 2048), a (I = 768), dy
 * (2048), [dg; du] (2I = 1536); tokens (128 per column, transposed) of p dy, a, [dg; du], x;
 * and, where the library has it, the one-read pass of dy and [dg; du] (rows + tokens),
 * and the passes the layer gathers from token rows through row_slot on one GPU (rows +
 * tokens of dy, tokens of x; their floor reads each token row once).
 * Inputs N(0, 1) bf16 made on the device, larger than L2; and x's two passes again on
 * heavy-tailed values (N(0, 1) times 2^k, k uniform in -12..3, continuous bf16): tiles of
 * wide range, where an earlier form of the quantizers took its divisions most often.
 * Launches of a round take turns (docs/decisions/0013-power-limit-timing); median of 20
 * rounds after 3. One line per pass: ms, GB/s moved (bf16 read, codes and scales
 * written) and the floor at the rate of a device-to-device copy of 1 GiB timed in the
 * same rounds (the HBM speed this GPU reaches in this run: about 3 TB/s on an H100, 4 on
 * an H200; decision 0023's floors were at a fixed 4.0 TB/s). A case fails only when a
 * launch fails.
 *   test_fp8_quant_time [substring of a pass name]   (built in main's tree too: copy it) */
#include <stdio.h>
#include <string.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "gemm_test_util.h"
#include "kernels.h"

namespace {

constexpr int kRows = 139264;

__global__ void fill_normal_bf16(uint16_t *v, int64_t n, uint32_t seed) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2654435761u ^ seed;
        h ^= h >> 15; h *= 0x2c1b3c6du; h ^= h >> 12; h *= 0x297a2d39u; h ^= h >> 15;
        /* the sum of 4 uniform bytes: roughly normal */
        const float u = ((h & 255) + ((h >> 8) & 255) + ((h >> 16) & 255) + (h >> 24) - 510.0f) / 147.0f;
        v[i] = (uint16_t)(__float_as_uint(u) >> 16);
    }
}

/* N(0, 1)-ish times 2^k, k = -12..3 from a second hash: many values far below their tile's
 * amax, and every bf16 mantissa. */
__global__ void fill_heavy_bf16(uint16_t *v, int64_t n, uint32_t seed) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2654435761u ^ seed;
        h ^= h >> 15; h *= 0x2c1b3c6du; h ^= h >> 12; h *= 0x297a2d39u; h ^= h >> 15;
        uint32_t g = h * 0x9e3779b9u;
        g ^= g >> 16; g *= 0x85ebca6bu; g ^= g >> 13;
        const float u = ((h & 255) + ((h >> 8) & 255) + ((h >> 16) & 255) + (h >> 24) - 510.0f) / 147.0f;
        const float w = ldexpf(u + (float)(g & 0xffff) * 0x1.0p-22f, (int)((g >> 16) & 15) - 12);
        v[i] = (uint16_t)(__float_as_uint(w) >> 16);
    }
}

__global__ void fill_weights(float *p, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        p[i] = 0.05f + 0.9f * (float)((unsigned)i * 7919u % 1000u) / 1000.0f;
}

constexpr int kTokens = 16384, kTopK = 8, kExperts = 128;

struct pass {
    std::string name;
    double bytes;
    std::function<cudaError_t()> launch;
};

/* bytes of one pass over rows x cols: read bf16, write codes and one fp32 scale per 128 */
double pass_bytes(double rows, double cols, int outputs) {
    return rows * cols * (2.0 + outputs * (1.0 + 4.0 / 128));
}

/* the same, rows gathered from kTokens token rows: each token row read from HBM once (the
 * floor; its K - 1 other reads can come from L2) */
double gathered_bytes(double rows, double cols, int outputs) {
    return kTokens * cols * 2.0 + rows * cols * outputs * (1.0 + 4.0 / 128);
}

void time_passes(const char *filter) {
    if (!have_sm90()) return;
    const int cols_max = 2048;
    uint16_t *in[4];   /* x, a, dy, [dg; du]: each its own buffer, as in a real step */
    const int cols_of[4] = {2048, 768, 2048, 1536};
    for (int k = 0; k < 4; k++) {
        CUDA_OK(cudaMalloc(&in[k], (size_t)kRows * cols_of[k] * 2));
        fill_normal_bf16<<<num_sms() * 8, 256>>>(in[k], (int64_t)kRows * cols_of[k], 1234u + k);
    }
    uint16_t *heavy;
    CUDA_OK(cudaMalloc(&heavy, (size_t)kRows * cols_of[0] * 2));
    fill_heavy_bf16<<<num_sms() * 8, 256>>>(heavy, (int64_t)kRows * cols_of[0], 99u);
    float *pw;
    int32_t *num_rows = dev_upload(std::vector<int32_t>{kRows});
    CUDA_OK(cudaMalloc(&pw, (size_t)kRows * 4));
    fill_weights<<<num_sms(), 256>>>(pw, kRows);
    uint8_t *codes, *codes_t;
    float *scales, *scales_t;
    const int ld = kRows;
    CUDA_OK(cudaMalloc(&codes, (size_t)kRows * cols_max));
    CUDA_OK(cudaMalloc(&codes_t, (size_t)kRows * cols_max));
    CUDA_OK(cudaMalloc(&scales, (size_t)cols_max / 128 * ld * 4));
    CUDA_OK(cudaMalloc(&scales_t, (size_t)kRows / 128 * cols_max * 4));
    CUDA_OK(cudaDeviceSynchronize());

    auto rows_p = [&](int k) {
        return mf_quantize_fp8_rows_params{in[k], cols_of[k], kRows, num_rows, cols_of[k], 0,
                                           codes, scales, ld};
    };
    auto tokens_p = [&](int k, bool weighted) {
        return mf_quantize_fp8_tokens_params{in[k], cols_of[k], kRows, num_rows, cols_of[k],
                                             weighted ? pw : nullptr, 0, codes_t, scales_t};
    };
    std::vector<pass> passes;
    const char *names[4] = {"x", "a", "dy", "[dg;du]"};
    for (int k = 0; k < 4; k++) {
        const mf_quantize_fp8_rows_params r = rows_p(k);
        passes.push_back({std::string("rows ") + names[k], pass_bytes(kRows, cols_of[k], 1),
                          [r] { return mf_quantize_fp8_rows(&r, 0); }});
    }
    const int tok_order[4] = {2, 1, 3, 0};   /* p dy, a, [dg; du], x */
    for (int k : tok_order) {
        const mf_quantize_fp8_tokens_params t = tokens_p(k, k == 2);
        passes.push_back({std::string("tokens ") + (k == 2 ? "p dy" : names[k]),
                          pass_bytes(kRows, cols_of[k], 1),
                          [t] { return mf_quantize_fp8_tokens(&t, 0); }});
    }
    {
        mf_quantize_fp8_rows_params r = rows_p(0);
        mf_quantize_fp8_tokens_params t = tokens_p(0, false);
        r.in = heavy;
        t.in = heavy;
        passes.push_back({"rows x heavy-tailed", pass_bytes(kRows, cols_of[0], 1),
                          [r] { return mf_quantize_fp8_rows(&r, 0); }});
        passes.push_back({"tokens x heavy-tailed", pass_bytes(kRows, cols_of[0], 1),
                          [t] { return mf_quantize_fp8_tokens(&t, 0); }});
    }
#ifdef MF_HAVE_QUANTIZE_FP8_ROWS_TOKENS
    for (int k : {2, 3}) {
        const mf_quantize_fp8_rows_params r = rows_p(k);
        const mf_quantize_fp8_tokens_params t = tokens_p(k, k == 2);
        passes.push_back({std::string("rows+tokens ") + names[k],
                          pass_bytes(kRows, cols_of[k], 2),
                          [r, t] { return mf_quantize_fp8_rows_tokens(&r, &t, 0); }});
    }
    /* dy as the layer reads it on one GPU: the caller's token rows gathered through
     * row_slot, each expert's slots in token order as the plan sorts them */
    Layout L = make_layout(skewed_counts(kExperts, kTokens * kTopK), 0, 0);
    for (int e = 0; e < kExperts; ++e) {
        const auto first = L.row_slot.begin() + L.offsets[e];
        std::sort(first, first + L.counts[e]);
    }
    const int H = cols_of[2], g_rows = L.rows_cap;
    int32_t *row_slot = dev_upload(L.row_slot), *g_num = dev_upload(std::vector<int32_t>{g_rows});
    uint8_t *g_codes, *g_codes_t;
    float *g_scales, *g_scales_t, *g_pw;
    CUDA_OK(cudaMalloc(&g_pw, (size_t)g_rows * 4));
    fill_weights<<<num_sms(), 256>>>(g_pw, g_rows);
    CUDA_OK(cudaMalloc(&g_codes, (size_t)g_rows * H));
    CUDA_OK(cudaMalloc(&g_codes_t, (size_t)g_rows * H));
    CUDA_OK(cudaMalloc(&g_scales, (size_t)H / 128 * g_rows * 4));
    CUDA_OK(cudaMalloc(&g_scales_t, (size_t)g_rows / 128 * H * 4));
    {
        const mf_quantize_fp8_rows_params r = {in[2], H, g_rows, g_num, H, 0,
                                               g_codes, g_scales, g_rows, row_slot, kTopK};
        const mf_quantize_fp8_tokens_params t = {in[2], H, g_rows, g_num, H, g_pw, 0,
                                                 g_codes_t, g_scales_t, row_slot, kTopK};
        /* dy's rows and p dy's tokens from one read (the layer's before dy's rows came
         * from the backward's dispatch: the figure to compare), and p dy's tokens alone
         * (the layer's now) */
        passes.push_back({"rows+tokens dy gathered", gathered_bytes(g_rows, H, 2),
                          [r, t] { return mf_quantize_fp8_rows_tokens(&r, &t, 0); }});
        passes.push_back({"tokens p dy gathered", gathered_bytes(g_rows, H, 1),
                          [t] { return mf_quantize_fp8_tokens(&t, 0); }});
        /* x's tokens for dW13, gathered from the caller's x (unweighted) */
        mf_quantize_fp8_tokens_params tx = t;
        tx.in = in[0];
        tx.row_weight = nullptr;
        passes.push_back({"tokens x gathered", gathered_bytes(g_rows, H, 1),
                          [tx] { return mf_quantize_fp8_tokens(&tx, 0); }});
    }
#endif
    /* the weights, once per optimizer step: qwen3-30b-a3b's fp32 W13 [128, 1536, 2048] and
     * W2 [128, 2048, 768] (read 4 bytes, write W's and W^T's codes: 6 bytes an element) */
    const int wE = 128, wI = 768, wH = 2048;
    const int64_t w13n = (int64_t)wE * 2 * wI * wH, w2n = (int64_t)wE * wH * wI;
    float *w13 = nullptr, *w2 = nullptr;
    uint8_t *wcodes = nullptr, *wcodes_t = nullptr;
    float *wscale = nullptr, *wscale_t = nullptr;
    CUDA_OK(cudaMalloc(&w13, (size_t)w13n * 4));
    CUDA_OK(cudaMalloc(&w2, (size_t)w2n * 4));
    CUDA_OK(cudaMalloc(&wcodes, (size_t)w13n));
    CUDA_OK(cudaMalloc(&wcodes_t, (size_t)w13n));
    CUDA_OK(cudaMalloc(&wscale, (size_t)w13n / (128 * 128) * 4));
    CUDA_OK(cudaMalloc(&wscale_t, (size_t)w13n / (128 * 128) * 4));
    fill_weights<<<num_sms() * 8, 256>>>(w13, (int)w13n);
    fill_weights<<<num_sms() * 8, 256>>>(w2, (int)w2n);
    const mf_quantize_fp8_weights_params q13 = {w13, nullptr, 0, 1, wE, 2 * wI, wH, 0,
                                                wcodes, wcodes_t, wscale, wscale_t};
    const mf_quantize_fp8_weights_params q2 = {w2, nullptr, 0, 1, wE, wH, wI, 0,
                                               wcodes, wcodes_t, wscale, wscale_t};
    passes.push_back({"weights fp32", (double)(w13n + w2n) * 6.0, [q13, q2] {
                          const cudaError_t e = mf_quantize_fp8_weights(&q13, 0);
                          return e != cudaSuccess ? e : mf_quantize_fp8_weights(&q2, 0);
                      }});
    /* and as bf16 weights (pure bf16 training, FSDP's bf16 parameters): 4 bytes an element */
    uint16_t *w13b = nullptr, *w2b = nullptr;
    CUDA_OK(cudaMalloc(&w13b, (size_t)w13n * 2));
    CUDA_OK(cudaMalloc(&w2b, (size_t)w2n * 2));
    fill_heavy_bf16<<<num_sms() * 8, 256>>>(w13b, w13n, 11u);
    fill_heavy_bf16<<<num_sms() * 8, 256>>>(w2b, w2n, 12u);
    mf_quantize_fp8_weights_params q13b = q13, q2b = q2;
    q13b.w = w13b, q13b.fp32 = 0;
    q2b.w = w2b, q2b.fp32 = 0;
    passes.push_back({"weights bf16", (double)(w13n + w2n) * 4.0, [q13b, q2b] {
                          const cudaError_t e = mf_quantize_fp8_weights(&q13b, 0);
                          return e != cudaSuccess ? e : mf_quantize_fp8_weights(&q2b, 0);
                      }});
    std::vector<pass> chosen;
    for (const pass &p : passes)
        if (!filter || strstr(p.name.c_str(), filter)) chosen.push_back(p);
    /* the floor's rate: a 1 GiB copy (read and written), first of every round */
    constexpr size_t kCopyBytes = (size_t)1 << 30;
    void *copy_src = nullptr, *copy_dst = nullptr;
    CUDA_OK(cudaMalloc(&copy_src, kCopyBytes));
    CUDA_OK(cudaMalloc(&copy_dst, kCopyBytes));
    CUDA_OK(cudaMemset(copy_src, 0, kCopyBytes));
    chosen.insert(chosen.begin(), pass{"device copy 1 GiB", 2.0 * kCopyBytes, [=] {
                      return cudaMemcpyAsync(copy_dst, copy_src, kCopyBytes,
                                             cudaMemcpyDeviceToDevice, 0);
                  }});

    printf("  inputs ready; %zu passes, 23 rounds\n", chosen.size() - 1);
    cudaEvent_t t0, t1;
    cudaEventCreate(&t0);
    cudaEventCreate(&t1);
    std::vector<std::vector<float>> ms(chosen.size());
    for (int it = 0; it < 23; ++it)
        for (size_t i = 0; i < chosen.size(); ++i) {
            cudaEventRecord(t0);
            const cudaError_t e = chosen[i].launch();
            cudaEventRecord(t1);
            cudaEventSynchronize(t1);
            CHECK(e == cudaSuccess, "%s: %s", chosen[i].name.c_str(), cudaGetErrorString(e));
            float a = 0;
            cudaEventElapsedTime(&a, t0, t1);
            if (it >= 3) ms[i].push_back(a);
        }
    CUDA_OK(cudaGetLastError());
    const double floor_bytes_per_s = chosen[0].bytes / (median(ms[0]) * 1e-3);
    printf("  fp8 quantizers, qwen3-30b-a3b T=16384 (%d rows), floor at %.2f TB/s (the copy's "
           "rate):\n", kRows, floor_bytes_per_s / 1e12);
    double total = 0, total_floor = 0;
    for (size_t i = 1; i < chosen.size(); ++i) {
        const double m = median(ms[i]);
        const double floor_ms = chosen[i].bytes / floor_bytes_per_s * 1e3;
        total += m;
        total_floor += floor_ms;
        printf("  %-20s %7.3f ms  %7.1f GB/s  floor %.3f ms  %5.1f%% of floor speed\n",
               chosen[i].name.c_str(), m, chosen[i].bytes / (m * 1e-3) / 1e9, floor_ms,
               100.0 * floor_ms / m);
    }
    printf("  %-20s %7.3f ms  (floor %.3f ms)\n", "all of the above", total, total_floor);
    cudaEventDestroy(t0);
    cudaEventDestroy(t1);
    for (int k = 0; k < 4; k++) cudaFree(in[k]);
    cudaFree(heavy);
    cudaFree(pw); cudaFree(num_rows); cudaFree(codes); cudaFree(codes_t); cudaFree(scales);
    cudaFree(scales_t);
    cudaFree(w13); cudaFree(w2); cudaFree(w13b); cudaFree(w2b);
    cudaFree(wcodes); cudaFree(wcodes_t); cudaFree(wscale); cudaFree(wscale_t);
    cudaFree(copy_src); cudaFree(copy_dst);
#ifdef MF_HAVE_QUANTIZE_FP8_ROWS_TOKENS
    cudaFree(row_slot); cudaFree(g_num);
    cudaFree(g_codes); cudaFree(g_codes_t); cudaFree(g_scales); cudaFree(g_scales_t);
    cudaFree(g_pw);
#endif
}

const char *g_filter = nullptr;
void time_qwen3_30b(void) { time_passes(g_filter); }

}  // namespace

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);   /* lines out as they come, through a pipe too */
    /* the gathered passes' routing; MOEFUSE_TEST_SEED makes it the same in an A/B's trees */
    th_seed_from_env_or_clock();
    if (argc > 1) g_filter = argv[1];
    th_run("fp8 quantizers: time at qwen3-30b-a3b T=16384", time_qwen3_30b);
    return th_finish();
}
