/* The helpers of fixture_cuda.h. */
#include "fixture_cuda.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

int ct_detect_sm90(char *skip, size_t skip_size, struct cudaDeviceProp *prop) {
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess || n == 0) {
        snprintf(skip, skip_size, "no CUDA device (%s)",
                 err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
        return 0;
    }
    if (cudaGetDeviceProperties(prop, 0) != cudaSuccess) {
        snprintf(skip, skip_size, "cudaGetDeviceProperties failed");
        return 0;
    }
    if (prop->major != 9 || prop->minor != 0) {
        snprintf(skip, skip_size, "device 0 (%.200s) is sm_%d%d; the kernels need sm_90",
                 prop->name, prop->major, prop->minor);
        return 0;
    }
    return 1;
}

int ct_run_models(int argc, char **argv, const char *suite, const model *models, int n_models,
                  void (*begin)(const model *m), void (*end)(void), const named_case *cases,
                  int n_cases) {
    for (int i = 0; i < n_models; i++) {
        const model *m = &models[i];
        if (argc > 1 && !strstr(m->name, argv[1])) continue;
        begin(m);
        char name[160];
        for (int c = 0; c < n_cases; c++) {
            snprintf(name, sizeof name, "%s %s %s", suite, m->name, cases[c].what);
            if (argc < 3 || strstr(cases[c].what, argv[2])) th_run(name, cases[c].fn);
        }
        end();
    }
    return th_finish();
}

void ct_fill_rows(uint16_t *out, int64_t rows, int cols, double scale) {
    const int64_t pool_n = (int64_t)1 << 22;
    uint16_t *pool = malloc((size_t)pool_n * 2);
    int64_t *offs = malloc((size_t)rows * sizeof(int64_t));
    th_fill_bf16_normal(pool, NULL, pool_n, scale);
    for (int64_t r = 0; r < rows; r++) offs[r] = (int64_t)(th_rand_u64() % (uint64_t)(pool_n - cols));
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) memcpy(out + r * cols, pool + offs[r], (size_t)cols * 2);
    free(pool);
    free(offs);
}

void ct_fill_weights(const model *m, uint16_t *w13, uint16_t *w2, double *w13_ref,
                     double *w2_ref) {
    const int64_t n13 = (int64_t)m->E * 2 * m->I * m->H, n2 = (int64_t)m->E * m->H * m->I;
    ct_fill_rows(w13, (int64_t)m->E * 2 * m->I, m->H, 1.0 / sqrt((double)m->H));
    ct_fill_rows(w2, (int64_t)m->E * m->H, m->I, 1.0 / sqrt((double)m->I));
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n13; i++) w13_ref[i] = (double)mf_bf16_to_float(w13[i]);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n2; i++) w2_ref[i] = (double)mf_bf16_to_float(w2[i]);
}

void ct_draw_ids(int T, int K, int E, routing r, int32_t *ids) {
    static double zipf_cdf[1024];
    int perm_e[1024];
    for (int e = 0; e < E; e++) perm_e[e] = e;
    for (int e = E - 1; e > 0; e--) { /* which experts are popular: random */
        int j = th_rand_int(0, e), t = perm_e[e];
        perm_e[e] = perm_e[j];
        perm_e[j] = t;
    }
    double acc = 0;
    for (int e = 0; e < E; e++) zipf_cdf[e] = (acc += 1.0 / pow(e + 1.0, 1.2));
    const int one = th_rand_int(0, E - 1);
    const int few[3] = {perm_e[0], perm_e[1], perm_e[2]};
    for (int t = 0; t < T; t++) {
        int32_t *row = ids + (int64_t)t * K;
        for (int k = 0; k < K; k++) row[k] = -1;
        if (r == ROUTE_ONE_EXPERT) {
            row[th_rand_int(0, K - 1)] = one;
            continue;
        }
        if (r == ROUTE_FEW_EXPERTS) {
            int n = th_rand_int(1, K < 3 ? K : 3); /* distinct ones of the 3 at distinct k */
            for (int i = 0; i < n; i++) {
                int k;
                do k = th_rand_int(0, K - 1); while (row[k] != -1);
                row[k] = few[i];
            }
            continue;
        }
        for (int k = 0; k < K; k++) {
            int e, dup;
            do {
                if (r == ROUTE_ZIPF) {
                    double u = th_uniform() * acc;
                    int lo = 0;
                    while (zipf_cdf[lo] < u && lo < E - 1) lo++;
                    e = perm_e[lo];
                } else {
                    e = th_rand_int(0, E - 1);
                }
                dup = 0;
                for (int j = 0; j < k; j++) dup |= row[j] == e;
            } while (dup);
            row[k] = e;
        }
        if (r == ROUTE_DROPPED) {
            int all = t == 0 || t == T - 1 || t % 5 == 3;
            for (int k = 0; k < K; k++)
                if (all || th_uniform() < 0.3) row[k] = -1;
        }
    }
}

void ct_draw_weights(int T, int K, float *p) {
    for (int t = 0; t < T; t++) {
        double sum = 0;
        float *pr = p + (int64_t)t * K;
        for (int k = 0; k < K; k++) sum += (pr[k] = (float)(0.05 + th_uniform()));
        for (int k = 0; k < K; k++) pr[k] = (float)(pr[k] / sum);
    }
}

cudaError_t ct_w13_halves_copy(void *packed, void *gate, void *up, size_t half_bytes, int E,
                               int to_halves, cudaStream_t stream) {
    char *p = (char *)packed;
    void *halves[2] = {gate, up};
    for (int h = 0; h < 2; h++) {
        const cudaError_t e =
            to_halves ? cudaMemcpy2DAsync(halves[h], half_bytes, p + h * half_bytes,
                                          2 * half_bytes, half_bytes, (size_t)E,
                                          cudaMemcpyDeviceToDevice, stream)
                      : cudaMemcpy2DAsync(p + h * half_bytes, 2 * half_bytes, halves[h],
                                          half_bytes, half_bytes, (size_t)E,
                                          cudaMemcpyDeviceToDevice, stream);
        if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
}
