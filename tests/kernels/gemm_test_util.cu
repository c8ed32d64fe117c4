/* The helpers of gemm_test_util.h. */
#include "gemm_test_util.h"

#include <string.h>

#include <algorithm>

#include "kernels.h"

static const uint16_t kPoison = 0xFFFF; /* bf16 NaN */

uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
double bf2d(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

int have_sm90(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        th_skip("no CUDA device: these kernels need an sm_90a GPU");
        return 0;
    }
    cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, 0);
    if (prop.major != 9 || prop.minor != 0) {
        th_skip("device is sm_%d%d, the kernels are built for sm_90a only", prop.major,
                prop.minor);
        return 0;
    }
    return 1;
}

int num_sms(void) {
    cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, 0);
    return prop.multiProcessorCount;
}

Layout make_layout(const std::vector<int> &counts, int extra_rows, int dropped) {
    Layout L;
    L.E = (int)counts.size();
    L.counts = counts;
    int rows = 0, valid = 0;
    for (int e = 0; e < L.E; ++e) {
        L.offsets.push_back(rows);
        rows += (counts[e] + MF_SM90_BLOCK_M - 1) / MF_SM90_BLOCK_M * MF_SM90_BLOCK_M;
        valid += counts[e];
    }
    L.offsets.push_back(rows);
    L.num_rows = rows;
    L.rows_cap = rows + extra_rows;
    L.num_slots = valid + dropped;
    std::vector<int> perm(L.num_slots);
    for (int i = 0; i < L.num_slots; ++i) perm[i] = i;
    for (int i = L.num_slots - 1; i > 0; --i) std::swap(perm[i], perm[th_rand_int(0, i)]);
    L.row_block_expert.assign(L.rows_cap / MF_SM90_BLOCK_M, -1);
    L.row_slot.assign(L.rows_cap, -1);
    L.row_expert.assign(L.rows_cap, -1);
    int next = 0;
    for (int e = 0; e < L.E; ++e) {
        for (int b = L.offsets[e]; b < L.offsets[e + 1]; b += MF_SM90_BLOCK_M)
            L.row_block_expert[b / MF_SM90_BLOCK_M] = e;
        for (int i = 0; i < counts[e]; ++i) {
            L.row_slot[L.offsets[e] + i] = perm[next++];
            L.row_expert[L.offsets[e] + i] = e;
        }
    }
    return L;
}

/* E counts summing to total in proportion to the weights, the rounding remainder on one
 * random expert. */
static std::vector<int> counts_by_weight(const std::vector<double> &wt, int total) {
    double ws = 0;
    for (double w : wt) ws += w;
    const int E = (int)wt.size();
    std::vector<int> counts(E);
    int assigned = 0;
    for (int e = 0; e < E; ++e) { counts[e] = (int)(total * wt[e] / ws); assigned += counts[e]; }
    counts[th_rand_int(0, E - 1)] += total - assigned;
    return counts;
}

std::vector<float> row_weights(const Layout &L, const std::vector<float> &slot_weight) {
    std::vector<float> rw(L.rows_cap, 0.f);
    for (int r = 0; r < L.num_rows; ++r)
        if (L.row_slot[r] >= 0) rw[r] = slot_weight[L.row_slot[r]];
    return rw;
}

std::vector<int> skewed_counts(int E, int total) {
    std::vector<double> wt(E);
    for (auto &w : wt) { const double u = th_uniform(); w = 0.25 + 3 * u * u; }
    return counts_by_weight(wt, total);
}

std::vector<int> heavy_skew_counts(int E, int total) {
    std::vector<double> wt(E);
    for (auto &w : wt) { const double u = th_uniform(); w = 0.02 + u * u * u * u; }
    return counts_by_weight(wt, total);
}

bool all_poison(const uint16_t *p, size_t n) {
    for (size_t i = 0; i < n; ++i)
        if (p[i] != kPoison) return false;
    return true;
}

int unrouted_rows_written(const Layout &L, const uint16_t *comb, int H) {
    std::vector<char> routed(L.num_slots, 0);
    for (int r = 0; r < L.num_rows; ++r)
        if (L.row_slot[r] >= 0) routed[L.row_slot[r]] = 1;
    int stray = 0;
    for (int s = 0; s < L.num_slots; ++s)
        if (!routed[s] && !all_poison(&comb[(size_t)s * H], H)) ++stray;
    return stray;
}

float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

__host__ __device__ static inline float hash_unit(uint64_t i, uint32_t seed) {
    uint64_t z = i * 0x9e3779b97f4a7c15ull + seed;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (float)(uint32_t)(z >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f; /* exact */
}

__global__ void fill_hash_bf16(__nv_bfloat16 *out, size_t n, uint32_t seed, float scale) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        out[i] = __float2bfloat16_rn(hash_unit(i, seed) * scale);
}
double hash_bf16(size_t i, uint32_t seed, float scale) {
    return bf2d(f2bf(hash_unit(i, seed) * scale));
}
