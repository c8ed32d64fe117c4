/* moefuse_forward on the CUDA backend: one line per case,
 *   model, T, forward ms (median of 20 after 3 warm-ups, CUDA events), TFLOP/s
 * with FLOPs = 6 T K H I, for the staged pipeline (the default) and the fused one
 * (MOEFUSE_PIPELINE_FUSED: gemm1 and gemm2 in one kernel) in alternation, then the small stages alone (plan, dispatch, reduce) as
 * microseconds per call over 100 back-to-back calls, with their DRAM bytes per second.
 * Input sets (x, ids, p) rotate, together larger than L2; weights random bf16 (never
 * zeros); routing uniform random top-K. No baseline yet (the PyTorch MoE baseline of
 * DESIGN 7 lives with the Python benchmarks).
 *
 * Build: make (builds build/bench/bench_forward_cuda when nvcc is found).
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "kernels.h"
#include "internal.h"
#include "bench_common.h"
#include "moefuse.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint64_t next_u64(void) { return xorshift64(&rng); }
static double uniform(void) { return (double)(next_u64() >> 11) * 0x1.0p-53; }

/* bf16 of N(0, scale^2)-ish values (sum of 4 uniforms), not zeros */
static void fill_bf16(uint16_t *h, int64_t n, double scale) {
    for (int64_t i = 0; i < n; i++) {
        double v = (uniform() + uniform() + uniform() + uniform() - 2.0) * 1.732 * scale;
        h[i] = mf_float_to_bf16((float)v);
    }
}

/* Device bf16 of about N(0, scale^2): windows at random offsets of one host pool of
 * 2^24 values (drawn once), scaled by copying from a pool of the right scale. */
#define POOL_N ((int64_t)1 << 24)
static void *dev_random_bf16(int64_t n, double scale) {
    uint16_t *h = malloc((size_t)POOL_N * 2);
    fill_bf16(h, POOL_N, scale);
    void *d;
    TRYC(cudaMalloc(&d, (size_t)n * 2));
    for (int64_t at = 0; at < n; at += POOL_N / 2) {
        const int64_t len = n - at < POOL_N / 2 ? n - at : POOL_N / 2;
        const int64_t shift = (int64_t)(next_u64() % (uint64_t)(POOL_N - len + 1));
        TRYC(cudaMemcpy((uint16_t *)d + at, h + shift, (size_t)len * 2, cudaMemcpyHostToDevice));
    }
    free(h);
    return d;
}

static int cmp_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

int main(void) {
    const model models[] = {
        {"qwen3-30b-a3b", 2048, 768, 128, 8},
        {"qwen3-235b-a22b", 4096, 1536, 128, 8},
    };
    const int Ts[] = {4096, 16384};
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        printf("SKIP bench_forward_cuda: no CUDA device\n");
        return 0;
    }
    int l2 = 0;
    TRYC(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0));
    cudaStream_t stream;
    TRYC(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaEvent_t ev0, ev1;
    TRYC(cudaEventCreate(&ev0));
    TRYC(cudaEventCreate(&ev1));
    printf("%-16s %6s %10s %9s %10s %9s\n", "model", "T", "staged_ms", "TFLOP/s", "fused_ms",
           "TFLOP/s");

    for (size_t mi = 0; mi < sizeof models / sizeof models[0]; mi++) {
        const model *m = &models[mi];
        const int Tmax = Ts[1];
        moefuse_config cfg;
        moefuse_config_init(&cfg, m->H, m->I, m->E, m->K, Tmax);
        cfg.backend = MOEFUSE_BACKEND_CUDA;
        moefuse_layer *layer, *fused;
        TRYM(moefuse_layer_create(&cfg, NULL, &layer));
        cfg.pipeline = MOEFUSE_PIPELINE_FUSED;
        TRYM(moefuse_layer_create(&cfg, NULL, &fused));
        uint16_t *w13 = dev_random_bf16((int64_t)m->E * 2 * m->I * m->H, 1.0 / sqrt(m->H));
        uint16_t *w2 = dev_random_bf16((int64_t)m->E * m->H * m->I, 1.0 / sqrt(m->I));
        size_t saved_bytes;
        TRYM(moefuse_saved_bytes(layer, Tmax, &saved_bytes));
        void *saved;
        uint16_t *y;
        TRYC(cudaMalloc(&saved, saved_bytes));
        TRYC(cudaMalloc((void **)&y, (size_t)Tmax * m->H * 2));

        for (size_t ti = 0; ti < sizeof Ts / sizeof Ts[0]; ti++) {
            const int T = Ts[ti], K = m->K;
            const size_t xb = (size_t)T * m->H * 2;
            int nsets = (int)((4 * (size_t)l2 + xb - 1) / xb);
            if (nsets < 2) nsets = 2;
            uint16_t **x = malloc(sizeof(void *) * nsets);
            int32_t **ids = malloc(sizeof(void *) * nsets);
            float **p = malloc(sizeof(void *) * nsets);
            for (int s = 0; s < nsets; s++) {
                x[s] = dev_random_bf16((int64_t)T * m->H, 1.0);
                device_uniform_routing(&rng, T, K, m->E, &ids[s], &p[s]);
            }
            moefuse_fwd_args a;
            memset(&a, 0, sizeof a);
            a.num_tokens = T;
            a.x_stride = m->H;
            a.w13 = w13;
            a.w2 = w2;
            a.y = y;
            a.y_stride = m->H;
            a.saved = saved;
            /* The default (staged) pipeline and the fused one, alternating. */
            float ms[2][20];
            for (int it = 0; it < 23; it++) {
                const int s = it % nsets;
                a.x = x[s];
                a.ids = ids[s];
                a.weights = p[s];
                for (int l = 0; l < 2; l++) {
                    TRYC(cudaEventRecord(ev0, stream));
                    TRYM(moefuse_forward(l ? fused : layer, &a, stream));
                    TRYC(cudaEventRecord(ev1, stream));
                    TRYC(cudaEventSynchronize(ev1));
                    if (it >= 3) TRYC(cudaEventElapsedTime(&ms[l][it - 3], ev0, ev1));
                }
            }
            TRYM(moefuse_layer_check(layer, stream));
            TRYM(moefuse_layer_check(fused, stream));
            double med[2];
            for (int l = 0; l < 2; l++) {
                qsort(ms[l], 20, sizeof(float), cmp_float);
                med[l] = 0.5 * (ms[l][9] + ms[l][10]);
            }
            const double flops = 6.0 * T * K * (double)m->H * m->I;
            printf("%-16s %6d %10.3f %9.1f %10.3f %9.1f\n", m->name, T, med[0],
                   flops / (med[0] * 1e-3) / 1e12, med[1], flops / (med[1] * 1e-3) / 1e12);
            fflush(stdout);

            /* ---- stages alone, on set 0, 100 back-to-back calls each ---- */
            {
                const int EL = m->E, tb = mf_plan_chunk_tokens(K);
                const int chunks = (T + tb - 1) / tb;
                const int64_t slots = (int64_t)T * K;
                const int rows_cap = (int)((slots + 127 * (slots < EL ? slots : EL) + 127) / 128 * 128);
                int32_t *buf;  /* plan arrays and scratch, one allocation */
                const size_t words = (size_t)slots * 2 + (size_t)chunks * EL + 3 * (size_t)EL + 8 +
                                     (size_t)rows_cap + (size_t)rows_cap / 128 + 64;
                TRYC(cudaMalloc((void **)&buf, words * 4));
                mf_plan_state *st;
                const mf_plan_state init = MF_PLAN_STATE_INIT;
                TRYC(cudaMalloc((void **)&st, sizeof *st));
                TRYC(cudaMemcpy(st, &init, sizeof init, cudaMemcpyHostToDevice));
                mf_plan_params pp;
                memset(&pp, 0, sizeof pp);
                int32_t *at = buf;
                pp.ids = ids[0];
                pp.num_tokens = T;
                pp.top_k = K;
                pp.num_experts = m->E;
                pp.expert_begin = 0;
                pp.num_local_experts = EL;
                pp.rows_cap = rows_cap;
                pp.slot_rank = at; at += slots;
                pp.chunk_base = at; at += (size_t)chunks * EL;
                pp.state = st;
                pp.gemm_num_rows = at; at += 4;
                pp.num_rows = at; at += 4;
                pp.expert_counts = at; at += EL;
                pp.expert_offsets = at; at += EL + 1;
                pp.row_block_expert = at; at += rows_cap / 128 + 1;
                pp.slot_row = at; at += slots;
                pp.row_slot = at;
                TRYC(mf_plan_prepare(K, EL));
                float t_plan, t_disp, t_red;
                TRYC(mf_plan_build_cuda(&pp, stream));
                TRYC(cudaEventRecord(ev0, stream));
                for (int i = 0; i < 100; i++) TRYC(mf_plan_build_cuda(&pp, stream));
                TRYC(cudaEventRecord(ev1, stream));
                TRYC(cudaEventSynchronize(ev1));
                TRYC(cudaEventElapsedTime(&t_plan, ev0, ev1));

                int32_t num_rows;
                TRYC(cudaMemcpy(&num_rows, pp.num_rows, 4, cudaMemcpyDeviceToHost));
                uint16_t *xs, *comb;
                TRYC(cudaMalloc((void **)&xs, (size_t)rows_cap * m->H * 2));
                TRYC(cudaMalloc((void **)&comb, (size_t)slots * m->H * 2));
                TRYC(cudaMemset(comb, 0x3c, (size_t)slots * m->H * 2));
                mf_dispatch_params dp;
                memset(&dp, 0, sizeof dp);
                dp.x[0] = x[0];
                dp.x_stride[0] = m->H;
                dp.xs[0] = xs;
                dp.num_tensors = 1;
                dp.slot_row = pp.slot_row;
                dp.row_slot = pp.row_slot;
                dp.num_rows = pp.gemm_num_rows;
                dp.call_failed = &st->call_failed;
                dp.num_tokens = T;
                dp.rows_cap = rows_cap;
                dp.hidden = m->H;
                dp.top_k = K;
                int sms = 0;
                TRYC(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
                dp.num_sms = sms;
                TRYC(mf_dispatch_rows_bf16(&dp, stream));
                TRYC(cudaEventRecord(ev0, stream));
                for (int i = 0; i < 100; i++) TRYC(mf_dispatch_rows_bf16(&dp, stream));
                TRYC(cudaEventRecord(ev1, stream));
                TRYC(cudaEventSynchronize(ev1));
                TRYC(cudaEventElapsedTime(&t_disp, ev0, ev1));

                mf_reduce_params rp = {comb, ids[0], &st->call_failed, y, m->H, T, K, m->H};
                TRYC(mf_reduce_slots_bf16(&rp, stream));
                TRYC(cudaEventRecord(ev0, stream));
                for (int i = 0; i < 100; i++) TRYC(mf_reduce_slots_bf16(&rp, stream));
                TRYC(cudaEventRecord(ev1, stream));
                TRYC(cudaEventSynchronize(ev1));
                TRYC(cudaEventElapsedTime(&t_red, ev0, ev1));
                const double us_plan = t_plan * 10.0, us_disp = t_disp * 10.0, us_red = t_red * 10.0;
                /* each token read once, each row written once */
                const double disp_bytes = ((double)T + num_rows) * m->H * 2;
                const double red_bytes = (double)slots * m->H * 2 + (double)T * m->H * 2;
                printf("    stages T=%d: plan %.1f us | dispatch %.1f us (%.2f TB/s, %d rows) | "
                       "reduce %.1f us (%.2f TB/s)\n", T, us_plan, us_disp,
                       disp_bytes / (us_disp * 1e-6) / 1e12, num_rows, us_red,
                       red_bytes / (us_red * 1e-6) / 1e12);
                fflush(stdout);
                cudaFree(xs);
                cudaFree(comb);
                cudaFree(buf);
                cudaFree(st);
            }
            for (int s = 0; s < nsets; s++) {
                cudaFree(x[s]);
                cudaFree(ids[s]);
                cudaFree(p[s]);
            }
            free(x);
            free(ids);
            free(p);
        }
        cudaFree(saved);
        cudaFree(y);
        cudaFree(w13);
        cudaFree(w2);
        moefuse_layer_destroy(layer);
        moefuse_layer_destroy(fused);
    }
    return 0;
}
