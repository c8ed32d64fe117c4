/* Hashes of every output of the CUDA layer for fixed inputs, one line per configuration:
 * y, dx, d p, dW13 and dW2 (fp32 and bf16 weight gradients) for qwen3-30b-a3b and
 * qwen3-235b-a22b, staged and fused, the three saved modes, R = 1 without a comm
 * (local) and R = 1, 2, 4, 8 virtual ranks (peers) (the ranks' outputs concatenated in rank order, so every R
 * is expected to print the R = 1 hashes). Two builds of the library that print the same
 * lines computed the same bits; that is how a refactor is shown to change no result:
 *
 *   build/tools/output_hashes > new.txt      (in each tree, on the same GPU)
 *   diff old.txt new.txt
 *
 * The inputs come from a fixed seed (a different seed: MOEFUSE_HASH_SEED), skewed
 * (Zipf-like) routing with dropped slots. It uses only the public header, so it builds
 * against any version of the library that has this API.
 *
 *   build/tools/output_hashes halves   W13 and dW13 in two halves (w13_up, from version
 *                                      0.6): dW13's halves are copied into the packed
 *                                      layout before hashing, so the lines must be those
 *                                      of the packed run */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moefuse.h"

#define CHECK_CUDA(call)                                                                  \
    do {                                                                                  \
        cudaError_t e_ = (call);                                                          \
        if (e_ != cudaSuccess) {                                                          \
            fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));   \
            exit(1);                                                                      \
        }                                                                                 \
    } while (0)
#define CHECK_MF(call)                                                                    \
    do {                                                                                  \
        moefuse_status s_ = (call);                                                       \
        if (s_ != MOEFUSE_OK) {                                                           \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__,                        \
                    moefuse_status_string(s_), moefuse_last_error());                     \
            exit(1);                                                                      \
        }                                                                                 \
    } while (0)

enum { kMaxRanks = 8, kTokens = 2048 /* over all ranks */ };

typedef struct model {
    const char *name;
    int H, I, E, K;
} model;

static uint64_t g_rng;
static uint64_t next_u64(void) {  /* splitmix64 */
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static double uniform(void) { return (double)(next_u64() >> 11) * 0x1.0p-53; }
static uint16_t bf16_of(float f) {  /* round to nearest even; inputs are finite */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static uint16_t *random_bf16(int64_t n, float scale) {
    uint16_t *h = (uint16_t *)malloc((size_t)n * 2);
    for (int64_t i = 0; i < n; i++) h[i] = bf16_of((float)((2.0 * uniform() - 1.0) * scale));
    return h;
}

/* FNV-1a over 64-bit words in 64 MiB chunks hashed in parallel, then over the chunks'
 * hashes in order: the same value whatever the thread count. */
static uint64_t fnv1a_words(const uint64_t *w, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ w[i]) * 0x100000001b3ull;
    return h;
}
static void *g_host;       /* pinned staging buffer */
static size_t g_host_bytes;
static uint64_t device_hash(const void *d, size_t bytes) {
    if (bytes > g_host_bytes) {
        if (g_host) cudaFreeHost(g_host);
        CHECK_CUDA(cudaMallocHost(&g_host, bytes));
        g_host_bytes = bytes;
    }
    CHECK_CUDA(cudaMemcpy(g_host, d, bytes, cudaMemcpyDeviceToHost));
    const size_t chunk = (size_t)8 << 20, words = bytes / 8;  /* bytes % 8 == 0 here */
    const int64_t chunks = (int64_t)((words + chunk - 1) / chunk);
    uint64_t *part = (uint64_t *)malloc(sizeof(uint64_t) * (chunks ? chunks : 1));
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const size_t begin = (size_t)c * chunk;
        const size_t n = words - begin < chunk ? words - begin : chunk;
        part[c] = fnv1a_words((const uint64_t *)g_host + begin, n);
    }
    const uint64_t h = fnv1a_words(part, (size_t)chunks);
    free(part);
    return h;
}
static void *device_copy(const void *h, size_t bytes) {
    void *d;
    CHECK_CUDA(cudaMalloc(&d, bytes ? bytes : 256));
    if (bytes) CHECK_CUDA(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice));
    return d;
}
static void *device_poisoned(size_t bytes) {
    void *d;
    CHECK_CUDA(cudaMalloc(&d, bytes ? bytes : 256));
    CHECK_CUDA(cudaMemset(d, 0xff, bytes ? bytes : 256));
    return d;
}

/* One model's inputs, on the device, for the whole batch of kTokens tokens. */
typedef struct inputs {
    uint16_t *x, *dy, *w13, *w2;
    uint16_t *gate, *up;   /* halves: w13's [E, I, H] halves */
    int32_t *ids;
    float *p;
} inputs;

static int g_halves;   /* argv "halves": W13 and dW13 in two halves */

/* Packed [E, 2I, H] elements of elem bytes <-> halves [E, I, H] (to_halves 1: packed ->
 * halves). */
static void repack(void *packed, void *gate, void *up, int64_t E, int64_t I, int64_t H,
                   size_t elem, int to_halves) {
    const size_t half = (size_t)(I * H) * elem;
    char *p = (char *)packed;
    if (to_halves) {
        CHECK_CUDA(cudaMemcpy2D(gate, half, p, 2 * half, half, (size_t)E, cudaMemcpyDeviceToDevice));
        CHECK_CUDA(cudaMemcpy2D(up, half, p + half, 2 * half, half, (size_t)E, cudaMemcpyDeviceToDevice));
    } else {
        CHECK_CUDA(cudaMemcpy2D(p, 2 * half, gate, half, half, (size_t)E, cudaMemcpyDeviceToDevice));
        CHECK_CUDA(cudaMemcpy2D(p + half, 2 * half, up, half, half, (size_t)E, cudaMemcpyDeviceToDevice));
    }
}

static inputs make_inputs(const model *m) {
    const int64_t T = kTokens, H = m->H, I = m->I, E = m->E, K = m->K;
    inputs in;
    uint16_t *h = random_bf16(T * H, 1.0f);
    in.x = (uint16_t *)device_copy(h, (size_t)T * H * 2);
    free(h);
    h = random_bf16(T * H, 1.0f);
    in.dy = (uint16_t *)device_copy(h, (size_t)T * H * 2);
    free(h);
    h = random_bf16(E * 2 * I * H, 1.0f / 64);
    in.w13 = (uint16_t *)device_copy(h, (size_t)E * 2 * I * H * 2);
    free(h);
    h = random_bf16(E * H * I, 1.0f / 32);
    in.w2 = (uint16_t *)device_copy(h, (size_t)E * H * I * 2);
    free(h);
    in.gate = in.up = NULL;
    if (g_halves) {
        CHECK_CUDA(cudaMalloc((void **)&in.gate, (size_t)E * I * H * 2));
        CHECK_CUDA(cudaMalloc((void **)&in.up, (size_t)E * I * H * 2));
        repack(in.w13, in.gate, in.up, E, I, H, 2, 1);
    }
    /* Zipf-like expert popularity, distinct experts per token, 3% of slots dropped */
    int32_t *ids = (int32_t *)malloc((size_t)T * K * 4);
    float *p = (float *)malloc((size_t)T * K * 4);
    for (int64_t t = 0; t < T; t++) {
        float sum = 0;
        for (int64_t k = 0; k < K; k++) {
            int e, dup;
            do {
                e = (int)(E * uniform() * uniform());
                dup = 0;
                for (int64_t j = 0; j < k; j++) dup |= ids[t * K + j] == e;
            } while (dup);
            ids[t * K + k] = e;
            p[t * K + k] = (float)(0.05 + uniform());
            sum += p[t * K + k];
        }
        for (int64_t k = 0; k < K; k++) {
            p[t * K + k] /= sum;
            if (uniform() < 0.03) ids[t * K + k] = -1;
        }
    }
    in.ids = (int32_t *)device_copy(ids, (size_t)T * K * 4);
    in.p = (float *)device_copy(p, (size_t)T * K * 4);
    free(ids);
    free(p);
    return in;
}

static void free_inputs(inputs *in) {
    cudaFree(in->x);
    cudaFree(in->dy);
    cudaFree(in->w13);
    cudaFree(in->w2);
    cudaFree(in->gate);
    cudaFree(in->up);
    cudaFree(in->ids);
    cudaFree(in->p);
}

/* Forward + backward of the whole batch over R virtual ranks (R = 0: one layer, no comm);
 * prints the hashes of the concatenated outputs. */
static void run_case(const model *m, const inputs *in, int R, moefuse_pipeline pipeline,
                     moefuse_saved_mode mode, int bf16_grads) {
    const int ranks = R ? R : 1, T = kTokens / ranks, H = m->H, I = m->I, K = m->K;
    const int EL = m->E / ranks;
    const int64_t w13_el = (int64_t)EL * 2 * I * H, w2_el = (int64_t)EL * H * I;
    moefuse_comm *comm = NULL;
    if (R) CHECK_MF(moefuse_comm_create_virtual(R, &comm));
    moefuse_layer *layer[kMaxRanks];
    cudaStream_t stream[kMaxRanks];
    void *saved[kMaxRanks];
    for (int r = 0; r < ranks; r++) {
        moefuse_config cfg;
        moefuse_config_init(&cfg, H, I, m->E, K, T);
        cfg.backend = MOEFUSE_BACKEND_CUDA;
        cfg.num_ranks = ranks;
        cfg.rank = r;
        cfg.saved_mode = mode;
        cfg.pipeline = pipeline;
#ifdef MOEFUSE_MEMORY_VERSION
        /* the skewed routing sends a rank more than the default 2x the balanced load:
         * the worst case (the library's sizing before the receive capacity existed) */
        cfg.recv_capacity_factor = ranks;
#endif
        CHECK_MF(moefuse_layer_create(&cfg, comm, &layer[r]));
        CHECK_CUDA(cudaStreamCreateWithFlags(&stream[r], cudaStreamNonBlocking));
    }
    uint16_t *y = (uint16_t *)device_poisoned((size_t)kTokens * H * 2);
    uint16_t *dx = (uint16_t *)device_poisoned((size_t)kTokens * H * 2);
    float *dp = (float *)device_poisoned((size_t)kTokens * K * 4);
    float *dw13 = (float *)device_poisoned((size_t)m->E * 2 * I * H * 4);
    float *dw2 = (float *)device_poisoned((size_t)m->E * H * I * 4);
    /* halves: dW13's gate and up halves [E, I, H] (fp32, or bf16 in the same bytes) */
    float *dgate = g_halves ? (float *)device_poisoned((size_t)m->E * I * H * 4) : NULL;
    float *dup = g_halves ? (float *)device_poisoned((size_t)m->E * I * H * 4) : NULL;
    const int64_t half_el = (int64_t)EL * I * H;
    size_t saved_bytes[kMaxRanks];
    for (int r = 0; r < ranks; r++) {
        CHECK_MF(moefuse_saved_bytes(layer[r], T, &saved_bytes[r]));
        saved[r] = device_poisoned(saved_bytes[r]);
    }
    /* the poison (legacy stream) lands before the ranks' non-blocking streams start */
    CHECK_CUDA(cudaDeviceSynchronize());
    for (int r = 0; r < ranks; r++) {
        moefuse_fwd_args a;
        memset(&a, 0, sizeof a);
        a.num_tokens = T;
        a.x = in->x + (int64_t)r * T * H;
        a.x_stride = H;
        a.ids = in->ids + (int64_t)r * T * K;
        a.weights = in->p + (int64_t)r * T * K;
        a.w13 = in->w13 + r * w13_el;
        a.w2 = in->w2 + r * w2_el;
#if MOEFUSE_VERSION >= 600
        if (g_halves) {
            a.w13 = in->gate + r * half_el;
            a.w13_up = in->up + r * half_el;
        }
#endif
        a.y = y + (int64_t)r * T * H;
        a.y_stride = H;
        a.saved = saved[r];
        CHECK_MF(moefuse_forward(layer[r], &a, stream[r]));
    }
    for (int r = 0; r < ranks; r++) {
        moefuse_bwd_args b;
        memset(&b, 0, sizeof b);
        b.num_tokens = T;
        b.x = in->x + (int64_t)r * T * H;
        b.x_stride = H;
        b.ids = in->ids + (int64_t)r * T * K;
        b.weights = in->p + (int64_t)r * T * K;
        b.w13 = in->w13 + r * w13_el;
        b.w2 = in->w2 + r * w2_el;
        b.saved = saved[r];
        b.saved_bytes = saved_bytes[r];
        b.dy = in->dy + (int64_t)r * T * H;
        b.dy_stride = H;
        b.dx = dx + (int64_t)r * T * H;
        b.dx_stride = H;
        b.dweights = dp + (int64_t)r * T * K;
        if (bf16_grads) {  /* the fp32 buffers hold the bf16 gradients' bits */
            b.dw13_bf16 = (uint16_t *)dw13 + r * w13_el;
            b.dw2_bf16 = (uint16_t *)dw2 + r * w2_el;
        } else {
            b.dw13 = dw13 + r * w13_el;
            b.dw2 = dw2 + r * w2_el;
        }
#if MOEFUSE_VERSION >= 600
        if (g_halves) {
            b.w13 = in->gate + r * half_el;
            b.w13_up = in->up + r * half_el;
            if (bf16_grads) {
                b.dw13_bf16 = (uint16_t *)dgate + r * half_el;
                b.dw13_up_bf16 = (uint16_t *)dup + r * half_el;
            } else {
                b.dw13 = dgate + r * half_el;
                b.dw13_up = dup + r * half_el;
            }
        }
#endif
        CHECK_MF(moefuse_backward(layer[r], &b, stream[r]));
    }
    for (int r = 0; r < ranks; r++) {
        CHECK_CUDA(cudaStreamSynchronize(stream[r]));
        CHECK_MF(moefuse_layer_check(layer[r], stream[r]));
    }
    const size_t gsize = bf16_grads ? 2 : 4;
    if (g_halves) repack(dw13, dgate, dup, m->E, I, H, gsize, 0);
    static const char *const modes[] = {"save_act", "recompute", "save_act_inputs"};
    printf("%-16s R=%d %-5s %-6s %-15s dw=%s  y %016llx  dx %016llx  dp %016llx  dw13 %016llx  "
           "dw2 %016llx\n",
           m->name, ranks, R ? "peers" : "local", pipeline == MOEFUSE_PIPELINE_FUSED ? "fused" : "staged", modes[mode],
           bf16_grads ? "bf16" : "fp32",
           (unsigned long long)device_hash(y, (size_t)kTokens * H * 2),
           (unsigned long long)device_hash(dx, (size_t)kTokens * H * 2),
           (unsigned long long)device_hash(dp, (size_t)kTokens * K * 4),
           (unsigned long long)device_hash(dw13, (size_t)m->E * 2 * I * H * gsize),
           (unsigned long long)device_hash(dw2, (size_t)m->E * H * I * gsize));
    fflush(stdout);
    for (int r = 0; r < ranks; r++) {
        CHECK_MF(moefuse_layer_destroy(layer[r]));
        cudaStreamDestroy(stream[r]);
        cudaFree(saved[r]);
    }
    if (comm) CHECK_MF(moefuse_comm_destroy(comm));
    cudaFree(y);
    cudaFree(dx);
    cudaFree(dp);
    cudaFree(dw13);
    cudaFree(dw2);
    cudaFree(dgate);
    cudaFree(dup);
}

int main(int argc, char **argv) {
    g_halves = argc > 1 && !strcmp(argv[1], "halves");
#if MOEFUSE_VERSION < 600
    if (g_halves) {
        fprintf(stderr, "output_hashes halves: this library's API has no w13_up\n");
        return 2;
    }
#endif
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);  /* 8 virtual ranks: 2 streams each */
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        printf("SKIP output_hashes: no CUDA device\n");
        return 0;
    }
    const char *seed = getenv("MOEFUSE_HASH_SEED");
    const model models[] = {{"qwen3-30b-a3b", 2048, 768, 128, 8},
                            {"qwen3-235b-a22b", 4096, 1536, 128, 8}};
    for (int mi = 0; mi < 2; mi++) {
        g_rng = seed ? strtoull(seed, NULL, 0) : 20261204ull;
        inputs in = make_inputs(&models[mi]);
        const int ranks[] = {0, 1, 2, 4, 8};
        for (int ri = 0; ri < 5; ri++)
            for (int fused = 0; fused < 2; fused++)
                for (int mode = 0; mode < 3; mode++) {
                    /* inputs are saved without a comm only */
                    if (mode == MOEFUSE_SAVE_ACTIVATIONS_AND_INPUTS && ranks[ri]) continue;
                    for (int bf16 = 0; bf16 < 2; bf16++)
                        run_case(&models[mi], &in, ranks[ri],
                                 fused ? MOEFUSE_PIPELINE_FUSED : MOEFUSE_PIPELINE_STAGED,
                                 (moefuse_saved_mode)mode, bf16);
                }
        free_inputs(&in);
    }
    return 0;
}
