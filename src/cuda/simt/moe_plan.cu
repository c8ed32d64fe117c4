/* The routing plan on the GPU: from ids [T, K] to the expert-sorted row layout that
 * the gemms, the dispatch and the backward read (see mf_plan in internal.h).
 *
 *   expert_counts [E_local]      slots of each local expert
 *   expert_offsets[E_local + 1]  first row of each expert; segments padded to 128 rows
 *   row_block_expert[rows_cap/128]  expert of each 128-row block (-1 past num_rows)
 *   slot_row [T*K]               row of each slot (slot = t*K + k), -1 when dropped
 *   row_slot [rows_cap]          slot of each row, -1 for padding and past num_rows
 *   num_rows                     expert_offsets[E_local] (device scalar)
 *
 * Rows of one expert are in increasing slot order: a stable counting sort, so the
 * layout is a function of ids alone, never of scheduling. No host synchronization,
 * no allocation, no atomics whose order can change a result (integer atomics only,
 * whose sums do not depend on order).
 *
 * Two kernels:
 *   count   one block per chunk of 2048 slots (whole tokens). Validates its tokens,
 *           ranks each slot among the earlier slots of the same expert in its chunk
 *           (warp match_any + per-warp counts, round by round in slot order) and
 *           writes the chunk's histogram. The last block to finish (threadfence +
 *           counter, as in the CUDA threadFenceReduction sample) turns the
 *           histograms into per-chunk bases and the padded expert offsets, or, if any
 *           token was bad, records the error and marks the call failed.
 *   scatter one thread per slot and per row: slot_row / row_slot from base + rank,
 *           and -1 in the padding rows.
 * NOTE: at T*K = 131072 the count pass is 64 blocks of 256 threads, 8 rounds each;
 * the last block sums 64 histograms per expert. Both passes touch a few MB at most,
 * so the plan costs a handful of microseconds, mostly launch and L2 latency.
 *
 * Bad ids (outside [-1, E) or repeated within a token): nothing of the plan is
 * written, the gemms' row count is set to 0, and call_failed tells every later
 * kernel of the call to return, so the call writes no output. The layer's error
 * record keeps the first failure until moefuse_layer_check reads it. */
#include <cuda_runtime.h>
#include <stdint.h>

#include "check.h"
#include "kernels.h"

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kChunkSlots = 2048;
constexpr uint32_t kNoBadToken = 0xffffffffu;

static_assert(kThreads % 32 == 0, "whole warps");
static_assert(MF_ROW_BLOCK_M == 128, "row_block_expert uses r >> 7");

__host__ __device__ inline int chunk_tokens(int top_k) {
    return top_k >= kChunkSlots ? 1 : kChunkSlots / top_k;
}

/* The K ids of one token: 0 when good, else the status, with the slot and value. */
__device__ inline int check_token(const int32_t *ids /* [K] */, int top_k, int num_experts,
                                  int *bad_k, int *bad_value) {
    for (int k = 0; k < top_k; k++) {
        const int e = ids[k];
        if (e < -1 || e >= num_experts) {
            *bad_k = k;
            *bad_value = e;
            return MOEFUSE_ERR_EXPERT_ID;
        }
    }
    for (int k = 1; k < top_k; k++) {
        const int e = ids[k];
        if (e < 0) continue;
        for (int j = 0; j < k; j++)
            if (ids[j] == e) {
                *bad_k = k;
                *bad_value = e;
                return MOEFUSE_ERR_DUPLICATE_EXPERT;
            }
    }
    return 0;
}

/* ---- count pass ------------------------------------------------------------------ */

/* Last block, ids all good: per-chunk bases, padded offsets, counts, block experts. */
__device__ void finish_plan(const mf_plan_params &p, int num_chunks, int *s_count,
                            int *s_off) {
    const int EL = p.num_local_experts;
    const int tid = threadIdx.x;

    // Column prefix over chunks: chunk_base[c][l] becomes the rows of expert l in
    // chunks before c. The loads of one column are independent; unrolled so that
    // several are in flight before the dependent sum.
    for (int l = tid; l < EL; l += kThreads) {
        int sum = 0;
        int c = 0;
        for (; c + 8 <= num_chunks; c += 8) {
            int v[8];
#pragma unroll
            for (int q = 0; q < 8; q++) v[q] = __ldcg(p.chunk_base + (int64_t)(c + q) * EL + l);
#pragma unroll
            for (int q = 0; q < 8; q++) {
                p.chunk_base[(int64_t)(c + q) * EL + l] = sum;
                sum += v[q];
            }
        }
        for (; c < num_chunks; c++) {
            const int v = __ldcg(p.chunk_base + (int64_t)c * EL + l);
            p.chunk_base[(int64_t)c * EL + l] = sum;
            sum += v;
        }
        s_count[l] = sum;
    }
    __syncthreads();

    // Exclusive scan of the padded counts: each thread a contiguous run of experts,
    // then a warp scan and a scan of the warp totals.
    __shared__ int s_warp_total[kWarps];
    const int per = (EL + kThreads - 1) / kThreads;
    const int l0 = min(EL, tid * per), l1 = min(EL, l0 + per);
    int run = 0;
    for (int l = l0; l < l1; l++) run += (s_count[l] + 127) & ~127;
    const int lane = tid & 31, warp = tid >> 5;
    int incl = run;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) incl += v;
    }
    if (lane == 31) s_warp_total[warp] = incl;
    __syncthreads();
    int before = incl - run;
    for (int w = 0; w < warp; w++) before += s_warp_total[w];
    for (int l = l0; l < l1; l++) {
        s_off[l] = before;
        before += (s_count[l] + 127) & ~127;
    }
    if (tid == kThreads - 1) s_off[EL] = before;  // the last thread's run ends at the total
    __syncthreads();

    const int total = s_off[EL];
    for (int l = tid; l < EL; l += kThreads) {
        p.expert_counts[l] = s_count[l];
        p.expert_offsets[l] = s_off[l];
        if (p.user_counts) p.user_counts[l] = s_count[l];
    }
    // Expert of each 128-row block: the largest l with s_off[l] <= first row (empty
    // experts share their offset with the next one, which is the owner).
    const int num_blocks = p.rows_cap / MF_ROW_BLOCK_M;
    for (int j = tid; j < num_blocks; j += kThreads) {
        const int r0 = j * MF_ROW_BLOCK_M;
        int e = -1;
        if (r0 < total) {
            int lo = 0, hi = EL - 1;  // s_off[lo] <= r0 always (s_off[0] = 0)
            while (lo < hi) {
                const int mid = (lo + hi + 1) >> 1;
                if (s_off[mid] <= r0) lo = mid; else hi = mid - 1;
            }
            e = lo;
        }
        p.row_block_expert[j] = e;
    }
    if (tid == 0) {
        p.expert_offsets[EL] = total;
        if (p.saved_header)
            for (int w = 0; w < 16; w++) p.saved_header[w] = p.header_words[w];
        *p.num_rows = total;  // may point into the header: written after it
        *p.gemm_num_rows = total;
        p.state->call_failed = 0;
        p.state->blocks_done = 0;  // ready for the next call
    }
}

/* Last block, some token bad: record it, write no plan, fail the call. */
__device__ void fail_plan(const mf_plan_params &p, uint32_t bad_token) {
    if (threadIdx.x != 0) return;
    int bad_k = 0, bad_value = 0;
    const int code = check_token(p.ids + (int64_t)bad_token * p.top_k, p.top_k,
                                 p.num_experts, &bad_k, &bad_value);
    MF_DEVICE_CHECK(code != 0);  // the count pass saw this token fail
    mf_plan_error *rec = &p.state->record;
    if (rec->code == 0) {  // keep the first failure until moefuse_layer_check
        rec->token = (int32_t)bad_token;
        rec->slot = bad_k;
        rec->value = bad_value;
        rec->code = code;
    }
    *p.gemm_num_rows = 0;
    p.state->call_failed = 1;
    p.state->first_bad_token = kNoBadToken;
    p.state->blocks_done = 0;
}

__global__ void __launch_bounds__(kThreads)
plan_count_kernel(const __grid_constant__ mf_plan_params p) {
    extern __shared__ int smem[];
    const int K = p.top_k, EL = p.num_local_experts;
    const int tb = chunk_tokens(K);
    const int tok0 = blockIdx.x * tb;
    const int ntok = max(0, min(tb, p.num_tokens - tok0));
    const int nslot = ntok * K;
    const int64_t slot0 = (int64_t)tok0 * K;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    int *s_ids = smem;                       // [tb * K]
    int *s_warp_cnt = s_ids + tb * K;        // [kWarps][EL] slots of expert l in warp w, this round
    int *s_running = s_warp_cnt + kWarps * EL;  // [EL] slots of expert l in earlier rounds

    // ---- load the chunk's ids, clear the counters ----
    for (int i = tid; i < kWarps * EL; i += kThreads) s_warp_cnt[i] = 0;
    for (int i = tid; i < EL; i += kThreads) s_running[i] = 0;
    for (int i = tid; i < nslot; i += kThreads) s_ids[i] = __ldg(p.ids + slot0 + i);
    __syncthreads();

    // ---- validate: one thread per token ----
    for (int t = tid; t < ntok; t += kThreads) {
        int bad_k, bad_value;
        if (check_token(s_ids + t * K, K, p.num_experts, &bad_k, &bad_value))
            atomicMin(&p.state->first_bad_token, (uint32_t)(tok0 + t));
    }

    // ---- stable rank within the chunk, one slot per thread per round ----
    for (int base = 0; base < nslot; base += kThreads) {
        const int s = base + tid;
        const int l = s < nslot ? s_ids[s] - p.expert_begin : -1;
        const bool routed = s < nslot && l >= 0 && l < EL;
        const unsigned peers = __match_any_sync(0xffffffffu, routed ? l : -1);
        const int in_warp = __popc(peers & ((1u << lane) - 1u));
        const bool leader = in_warp == 0;
        if (routed && leader) s_warp_cnt[warp * EL + l] = __popc(peers);
        __syncthreads();
        if (routed) {
            int rank = s_running[l] + in_warp;
            for (int w = 0; w < warp; w++) rank += s_warp_cnt[w * EL + l];
            p.slot_rank[slot0 + s] = rank;
        }
        __syncthreads();
        if (routed && leader) {
            atomicAdd(&s_running[l], __popc(peers));  // leaders of several warps: integer sum
            s_warp_cnt[warp * EL + l] = 0;
        }
        __syncwarp();
    }
    __syncthreads();

    // ---- publish the histogram; the last block finishes the plan ----
    for (int l = tid; l < EL; l += kThreads)
        p.chunk_base[(int64_t)blockIdx.x * EL + l] = s_running[l];
    __threadfence();
    __shared__ bool s_last;
    __syncthreads();
    if (tid == 0) s_last = atomicAdd(&p.state->blocks_done, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();

    const uint32_t bad_token = atomicAdd(&p.state->first_bad_token, 0u);
    if (bad_token != kNoBadToken) {
        fail_plan(p, bad_token);
        return;
    }
    // Reuse shared memory: counts in s_running, offsets [EL + 1] in s_warp_cnt.
    finish_plan(p, gridDim.x, s_running, s_warp_cnt);
}

/* ---- scatter pass ---------------------------------------------------------------- */

__global__ void __launch_bounds__(kThreads)
plan_scatter_kernel(const __grid_constant__ mf_plan_params p) {
    if (p.state->call_failed) return;
    const int K = p.top_k, EL = p.num_local_experts;
    const int tb = chunk_tokens(K);
    const int64_t n_slots = (int64_t)p.num_tokens * K;
    const int64_t n = n_slots > p.rows_cap ? n_slots : p.rows_cap;
    const int num_rows = __ldg(p.num_rows);
    for (int64_t i = blockIdx.x * (int64_t)kThreads + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * kThreads) {
        if (i < n_slots) {
            const int l = __ldg(p.ids + i) - p.expert_begin;
            if (l >= 0 && l < EL) {
                const int64_t chunk = (i / K) / tb;
                const int row = __ldg(p.expert_offsets + l) +
                                __ldg(p.chunk_base + chunk * EL + l) + __ldg(p.slot_rank + i);
                p.slot_row[i] = row;
                p.row_slot[row] = (int32_t)i;
            } else {
                p.slot_row[i] = -1;
            }
        }
        if (i < p.rows_cap) {
            bool padding = i >= num_rows;
            if (!padding) {
                const int l = __ldg(p.row_block_expert + (i >> 7));
                padding = i >= __ldg(p.expert_offsets + l) + __ldg(p.expert_counts + l);
            }
            if (padding) p.row_slot[i] = -1;
        }
    }
}

}  // namespace

extern "C" int mf_plan_chunk_tokens(int top_k) { return chunk_tokens(top_k); }

extern "C" size_t mf_plan_smem_bytes(int top_k, int num_local_experts) {
    return sizeof(int) * ((size_t)chunk_tokens(top_k) * top_k +
                          (size_t)(kWarps + 1) * num_local_experts);
}

extern "C" cudaError_t mf_plan_prepare(int top_k, int num_local_experts) {
    const size_t smem = mf_plan_smem_bytes(top_k, num_local_experts);
    if (smem <= 48 * 1024) return cudaSuccess;
    return cudaFuncSetAttribute(plan_count_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                (int)smem);
}

extern "C" cudaError_t mf_plan_build_cuda(const mf_plan_params *p, cudaStream_t stream) {
    if (!p || p->num_tokens < 0 || p->top_k < 1 || p->num_local_experts < 1 ||
        p->rows_cap < 0 || p->rows_cap % MF_ROW_BLOCK_M != 0)
        return cudaErrorInvalidValue;
    const int tb = chunk_tokens(p->top_k);
    const int num_chunks = p->num_tokens == 0 ? 1 : (p->num_tokens + tb - 1) / tb;
    plan_count_kernel<<<num_chunks, kThreads, mf_plan_smem_bytes(p->top_k, p->num_local_experts),
                        stream>>>(*p);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;

    const int64_t n_slots = (int64_t)p->num_tokens * p->top_k;
    const int64_t n = n_slots > p->rows_cap ? n_slots : p->rows_cap;
    if (n == 0) return cudaSuccess;
    const int64_t blocks = (n + kThreads - 1) / kThreads;
    plan_scatter_kernel<<<(unsigned)(blocks < 65536 ? blocks : 65536), kThreads, 0, stream>>>(*p);
    return cudaGetLastError();
}

extern "C" cudaError_t mf_plan_load(void) { return mf_load_kernels(plan_count_kernel, plan_scatter_kernel); }
