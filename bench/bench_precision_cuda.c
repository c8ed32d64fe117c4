/* The CUDA layer in FP8 (MOEFUSE_PRECISION_FP8_BLOCK) against the same layer in bf16, in
 * the same run, samples interleaved: forward, backward (fp32 weight gradients, write
 * mode) and their sum, ms as the median of 20 after 3 warm-ups (CUDA events), TFLOP/s
 * with FLOPs = 6 T K H I forward and twice that backward, and FP8's speed-up; then
 * moefuse_quantize_weights alone (once per optimizer step). Both Qwen3 shapes at
 * T = 4096 and 16384; routing uniform random top-K, input sets rotating (together
 * larger than L2), weights N(0, 1/fan-in) bf16. Public API only. Prints one line per
 * case and, with a file argument, the table as markdown. MOEFUSE_BENCH_CASE=model:T runs
 * that case alone (for a profiler). MOEFUSE_FP8_PEAK_TFLOPS (bench/fp8_peak.py, measured in
 * the same run by make bench) adds FP8's fwd+bwd share of the dense FP8 matmul peak.
 *
 * Build: make (build/bench/bench_precision_cuda when nvcc is found). */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_common.h"
#include "moefuse.h"

enum { kWarm = 3, kReps = 20 };

static uint64_t rng = 0x2545f4914f6cdd1dull;
static uint64_t next_u64(void) { return xorshift64(&rng); }

/* bf16 normals come from a pool of kPool values of N(0, scale^2) on the device (Box-Muller
 * on the host), copied in pieces from random offsets: every row differs, at a fraction of
 * the cost of drawing billions of normals on the host. */
enum { kPool = 1 << 24, kPiece = 1 << 16 };

static uint16_t bf16_of(float v) {
    uint32_t b;
    memcpy(&b, &v, 4);
    return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

static uint16_t *pool_make(double scale) {
    uint16_t *h = malloc((size_t)kPool * 2), *d;
    for (int64_t i = 0; i < kPool; i++) {
        const double u1 = ((next_u64() >> 11) + 1) * 0x1.0p-53, u2 = (next_u64() >> 11) * 0x1.0p-53;
        h[i] = bf16_of((float)(scale * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2)));
    }
    TRYC(cudaMalloc((void **)&d, (size_t)kPool * 2));
    TRYC(cudaMemcpy(d, h, (size_t)kPool * 2, cudaMemcpyHostToDevice));
    free(h);
    return d;
}

static uint16_t *dev_normal_bf16(int64_t n, const uint16_t *pool) {
    uint16_t *d;
    TRYC(cudaMalloc((void **)&d, (size_t)n * 2));
    for (int64_t i = 0; i < n; i += kPiece) {
        const int64_t len = n - i < kPiece ? n - i : kPiece;
        const int64_t off = (int64_t)(next_u64() % (uint64_t)(kPool - kPiece));
        TRYC(cudaMemcpy(d + i, pool + off, (size_t)len * 2, cudaMemcpyDeviceToDevice));
    }
    return d;
}

static int cmp_float(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}
static double median(float *v, int n) {
    qsort(v, (size_t)n, sizeof(float), cmp_float);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* One precision's layer and the buffers of its calls. */
typedef struct run {
    moefuse_layer *layer;
    void *saved, *fp8_buf;
    moefuse_fp8_weights fp8;
    float fwd[kReps], bwd[kReps], sum[kReps];
} run;

static void run_make(run *r, const model *m, int Tmax, moefuse_precision prec,
                     const uint16_t *w13, const uint16_t *w2) {
    memset(r, 0, sizeof *r);
    moefuse_config cfg;
    moefuse_config_init(&cfg, m->H, m->I, m->E, m->K, Tmax);
    cfg.backend = MOEFUSE_BACKEND_CUDA;
    cfg.precision = prec;
    TRYM(moefuse_layer_create(&cfg, NULL, &r->layer));
    size_t bytes;
    TRYM(moefuse_saved_bytes(r->layer, Tmax, &bytes));
    TRYC(cudaMalloc(&r->saved, bytes));
    if (prec == MOEFUSE_PRECISION_FP8_BLOCK) {
        TRYM(moefuse_fp8_weights_bytes(r->layer, &bytes));
        TRYC(cudaMalloc(&r->fp8_buf, bytes));
        TRYM(moefuse_fp8_weights_view(r->layer, r->fp8_buf, &r->fp8));
        TRYM(moefuse_quantize_weights(r->layer, MOEFUSE_DTYPE_BF16, w13, w2, &r->fp8, NULL));
    }
}

static void run_free(run *r) {
    cudaFree(r->saved);
    cudaFree(r->fp8_buf);
    moefuse_layer_destroy(r->layer);
}

int main(int argc, char **argv) {
    const model models[] = {
        {"qwen3-30b-a3b", 2048, 768, 128, 8},
        {"qwen3-235b-a22b", 4096, 1536, 128, 8},
    };
    const int Ts[] = {4096, 16384};
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        printf("SKIP bench_precision_cuda: no CUDA device\n");
        return 0;
    }
    FILE *md = argc > 1 ? fopen(argv[1], "w") : NULL;
    struct cudaDeviceProp prop;
    TRYC(cudaGetDeviceProperties(&prop, 0));
    const char *peak_env = getenv("MOEFUSE_FP8_PEAK_TFLOPS");
    const double peak = peak_env ? atof(peak_env) : 0.0;
    if (md) {
        if (peak > 0)
            fprintf(md, "Dense FP8 matmul peak measured in this run (torch._scaled_mm, 8192^3 "
                        "e4m3): %.1f TFLOP/s.\n\n", peak);
        fprintf(md, "%s; forward and backward (fp32 weight gradients) of one layer, bf16 and FP8 "
                    "samples interleaved, CUDA events, median of %d; TFLOP/s with 6 T K H I forward, "
                    "twice that backward; weight quantization: moefuse_quantize_weights alone.\n\n",
                prop.name, kReps);
        fprintf(md, "| model | T | bf16 fwd ms | fp8 fwd ms | fwd x | bf16 bwd ms | fp8 bwd ms | bwd x "
                    "| bf16 fwd+bwd ms | fp8 fwd+bwd ms | fwd+bwd x | fp8 fwd+bwd TFLOP/s | "
                    "fp8 %%peak | quantize weights ms |\n"
                    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    }
    printf("%-16s %6s %9s %9s %6s %9s %9s %6s %9s %9s %6s %8s %8s\n", "model", "T", "bf16_fwd",
           "fp8_fwd", "x", "bf16_bwd", "fp8_bwd", "x", "bf16_sum", "fp8_sum", "x", "fp8_TF/s",
           "quant_ms");
    int l2 = 0;
    TRYC(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0));
    cudaStream_t stream;
    TRYC(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaEvent_t ev[3];
    for (int i = 0; i < 3; i++) TRYC(cudaEventCreate(&ev[i]));
    uint16_t *unit = pool_make(1.0);

    for (size_t mi = 0; mi < sizeof models / sizeof models[0]; mi++) {
        const model *m = &models[mi];
        const char *only = getenv("MOEFUSE_BENCH_CASE");
        if (only && strncmp(only, m->name, strlen(m->name)) != 0) continue;
        const int Tmax = Ts[1], K = m->K;
        const int64_t n13 = (int64_t)m->E * 2 * m->I * m->H, n2 = (int64_t)m->E * m->H * m->I;
        uint16_t *pool_h = pool_make(1.0 / sqrt(m->H)), *pool_i = pool_make(1.0 / sqrt(m->I));
        uint16_t *w13 = dev_normal_bf16(n13, pool_h);
        uint16_t *w2 = dev_normal_bf16(n2, pool_i);
        cudaFree(pool_h);
        cudaFree(pool_i);
        float *dw13, *dw2, *dp;
        uint16_t *y, *dx;
        TRYC(cudaMalloc((void **)&dw13, (size_t)n13 * 4));
        TRYC(cudaMalloc((void **)&dw2, (size_t)n2 * 4));
        TRYC(cudaMalloc((void **)&dp, (size_t)Tmax * K * 4));
        TRYC(cudaMalloc((void **)&y, (size_t)Tmax * m->H * 2));
        TRYC(cudaMalloc((void **)&dx, (size_t)Tmax * m->H * 2));
        run runs[2];
        run_make(&runs[0], m, Tmax, MOEFUSE_PRECISION_BF16, w13, w2);
        run_make(&runs[1], m, Tmax, MOEFUSE_PRECISION_FP8_BLOCK, w13, w2);

        /* the weights' quantization alone */
        float qms[kReps];
        for (int it = 0; it < kWarm + kReps; it++) {
            TRYC(cudaEventRecord(ev[0], stream));
            TRYM(moefuse_quantize_weights(runs[1].layer, MOEFUSE_DTYPE_BF16, w13, w2,
                                          &runs[1].fp8, stream));
            TRYC(cudaEventRecord(ev[1], stream));
            TRYC(cudaEventSynchronize(ev[1]));
            if (it >= kWarm) TRYC(cudaEventElapsedTime(&qms[it - kWarm], ev[0], ev[1]));
        }
        const double quant_ms = median(qms, kReps);

        for (size_t ti = 0; ti < sizeof Ts / sizeof Ts[0]; ti++) {
            const int T = Ts[ti];
            if (only && strchr(only, ':') && atoi(strchr(only, ':') + 1) != T) continue;
            const size_t xb = (size_t)T * m->H * 2;
            int nsets = (int)((4 * (size_t)l2 + xb - 1) / xb);
            nsets = nsets < 2 ? 2 : nsets;
            uint16_t **x = malloc(sizeof(void *) * nsets), **dy = malloc(sizeof(void *) * nsets);
            int32_t **ids = malloc(sizeof(void *) * nsets);
            float **p = malloc(sizeof(void *) * nsets);
            for (int s = 0; s < nsets; s++) {
                x[s] = dev_normal_bf16((int64_t)T * m->H, unit);
                dy[s] = dev_normal_bf16((int64_t)T * m->H, unit);
                device_uniform_routing(&rng, T, K, m->E, &ids[s], &p[s]);
            }
            for (int it = 0; it < kWarm + kReps; it++) {
                const int s = it % nsets;
                for (int l = 0; l < 2; l++) {
                    run *r = &runs[l];
                    const moefuse_fp8_weights *f = l ? &r->fp8 : NULL;
                    moefuse_fwd_args a = {
                        .num_tokens = T, .x = x[s], .x_stride = m->H, .ids = ids[s],
                        .weights = p[s], .w13 = w13, .w2 = w2, .y = y, .y_stride = m->H,
                        .saved = r->saved, .fp8_weights = f,
                    };
                    size_t saved_bytes;
                    TRYM(moefuse_saved_bytes(r->layer, T, &saved_bytes));
                    moefuse_bwd_args b = {
                        .num_tokens = T, .x = x[s], .x_stride = m->H, .ids = ids[s],
                        .weights = p[s], .w13 = w13, .w2 = w2, .saved = r->saved,
                        .saved_bytes = saved_bytes, .dy = dy[s], .dy_stride = m->H, .dx = dx,
                        .dx_stride = m->H, .dweights = dp, .dw13 = dw13, .dw2 = dw2,
                        .fp8_weights = f,
                    };
                    TRYC(cudaEventRecord(ev[0], stream));
                    TRYM(moefuse_forward(r->layer, &a, stream));
                    TRYC(cudaEventRecord(ev[1], stream));
                    TRYM(moefuse_backward(r->layer, &b, stream));
                    TRYC(cudaEventRecord(ev[2], stream));
                    TRYC(cudaEventSynchronize(ev[2]));
                    if (it >= kWarm) {
                        const int i = it - kWarm;
                        TRYC(cudaEventElapsedTime(&r->fwd[i], ev[0], ev[1]));
                        TRYC(cudaEventElapsedTime(&r->bwd[i], ev[1], ev[2]));
                        TRYC(cudaEventElapsedTime(&r->sum[i], ev[0], ev[2]));
                    }
                }
            }
            for (int l = 0; l < 2; l++) TRYM(moefuse_layer_check(runs[l].layer, stream));
            double med[2][3];
            for (int l = 0; l < 2; l++) {
                med[l][0] = median(runs[l].fwd, kReps);
                med[l][1] = median(runs[l].bwd, kReps);
                med[l][2] = median(runs[l].sum, kReps);
            }
            const double flops = 18.0 * T * K * (double)m->H * m->I;
            const double tf = flops / (med[1][2] * 1e-3) / 1e12;
            printf("%-16s %6d %9.3f %9.3f %6.2f %9.3f %9.3f %6.2f %9.3f %9.3f %6.2f %8.1f %8.3f\n",
                   m->name, T, med[0][0], med[1][0], med[0][0] / med[1][0], med[0][1], med[1][1],
                   med[0][1] / med[1][1], med[0][2], med[1][2], med[0][2] / med[1][2], tf, quant_ms);
            if (md)
                fprintf(md, "| %s | %d | %.3f | %.3f | %.2f | %.3f | %.3f | %.2f | %.3f | %.3f | "
                            "%.2f | %.1f | %.1f | %.3f |\n",
                        m->name, T, med[0][0], med[1][0], med[0][0] / med[1][0], med[0][1],
                        med[1][1], med[0][1] / med[1][1], med[0][2], med[1][2],
                        med[0][2] / med[1][2], tf, peak > 0 ? 100.0 * tf / peak : 0.0, quant_ms);
            fflush(stdout);
            for (int s = 0; s < nsets; s++) {
                cudaFree(x[s]); cudaFree(dy[s]); cudaFree(ids[s]); cudaFree(p[s]);
            }
            free(x); free(dy); free(ids); free(p);
        }
        run_free(&runs[0]);
        run_free(&runs[1]);
        cudaFree(w13); cudaFree(w2); cudaFree(dw13); cudaFree(dw2); cudaFree(dp);
        cudaFree(y); cudaFree(dx);
    }
    cudaFree(unit);
    if (md) fclose(md);
    return 0;
}
