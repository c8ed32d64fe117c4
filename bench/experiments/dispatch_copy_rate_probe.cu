/* Probe (bench/NOTES.md v18): how fast do a few SMs copy expert-sorted rows, block by
 * block? The library's register copy (mf_dispatch_blocks_bf16 of
 * bench/experiments/dispatch_beside_one_rank.patch, 1024-thread CTAs) against a TMA bulk
 * copy (4 issuing lanes per CTA, 196 KB of shared memory in flight: cp.async.bulk
 * global -> shared, then shared -> global, each block released at GPU scope), both on
 * D CTAs with nothing beside them; and the token-major dispatch on every SM. Rows: a
 * random permutation of T*K = 131072 slots, no padding.
 *
 *   git apply bench/experiments/dispatch_beside_one_rank.patch && make
 *   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Isrc/cuda -Isrc/host \
 *        -Iinclude bench/experiments/dispatch_copy_rate_probe.cu build/libmoefuse.a \
 *        -o /tmp/copy_probe -lcudart && /tmp/copy_probe 2048 && /tmp/copy_probe 4096
 *
 * One H200, 2026-12-03 (read + write bytes, best of 5): per SM about 72-75 GB/s at
 * H = 2048 and 83-98 GB/s at H = 4096 for both copies, at D = 8, 16, 24 (0.60, 1.18,
 * 1.72 TB/s at H = 2048); the bulk copy no faster than registers at H = 2048. The
 * token-major dispatch on 132 SMs: 0.179 ms (it reads each token once). So the copy is
 * bound per SM, not by the loads in flight. */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <vector>
#include <algorithm>
#include <random>
#include "kernels.h"
#include "sm90/ptx/mbarrier.cuh"
#include "sm90/ptx/tma.cuh"
#include "ptx/flags.cuh"
#define OK(x) do { cudaError_t e = (x); if (e) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)
using namespace mf::ptx;

__device__ __forceinline__ void bulk_load(void *dst, const void *src, uint32_t bytes, uint64_t *bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}
template <int N> __device__ __forceinline__ void wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(N) : "memory");
}
template <int N> __device__ __forceinline__ void wait_done() {
    asm volatile("cp.async.bulk.wait_group %0;" :: "n"(N) : "memory");
}

// W issuing warps (lane 0 each), S slots each; warp w moves rows i = w, w + W, ... of each block.
template <int W, int S>
__global__ void __launch_bounds__(W * 32) bulk_dispatch(const uint16_t *x, uint16_t *xs, const int32_t *row_slot,
                                                        int K, int H, int blocks, uint32_t *arrivals) {
    extern __shared__ __align__(128) uint8_t smem[];
    const int rb = H * 2, w = threadIdx.x / 32;
    uint8_t *slots = smem + (size_t)w * S * rb;
    uint64_t *bars = reinterpret_cast<uint64_t *>(smem + (size_t)W * S * rb) + w * S;
    if ((threadIdx.x & 31) != 0) return;
    for (int s = 0; s < S; ++s) mbar_init(&bars[s], 1);
    mbar_fence_init();
    constexpr int kPer = 128 / W;   // rows per block for this warp
    const int my_blocks = (blocks - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;
    const int n = my_blocks * kPer;
    auto row_of = [&](int q) { return ((int)blockIdx.x + (q / kPer) * (int)gridDim.x) * 128 + (q % kPer) * W + w; };
    constexpr int L = S / 2;
    auto issue = [&](int q) {
        const int r = row_of(q);
        const int s = __ldg(row_slot + r);
        uint64_t *bar = &bars[q % S];
        mbar_arrive_expect_tx(bar, rb);
        bulk_load(slots + (size_t)(q % S) * rb, x + (int64_t)(s / K) * H, rb, bar);
    };
    for (int q = 0; q < L && q < n; ++q) issue(q);
    constexpr int G = 4;   // release lag (rows)
    for (int q = 0; q < n; ++q) {
        if (q + L < n) { wait_read<S / 2 - 1>(); issue(q + L); }
        mbar_wait(&bars[q % S], (q / S) & 1);
        bulk_store_s2g(xs + (int64_t)row_of(q) * H, slots + (size_t)(q % S) * rb, rb);
        bulk_commit();
        const int d = q - G;   // rows <= d are complete after wait_done<G>
        if (d >= 0 && d % kPer == kPer - 1) {
            wait_done<G>();
            asm volatile("fence.proxy.async.global;" ::: "memory");
            red_release_gpu_add(arrivals + (blockIdx.x + (d / kPer) * gridDim.x), 1u);
        }
    }
    wait_done<0>();
    asm volatile("fence.proxy.async.global;" ::: "memory");
    for (int d = n - G < 0 ? 0 : n - G; d < n; ++d)
        if (d % kPer == kPer - 1) red_release_gpu_add(arrivals + (blockIdx.x + (d / kPer) * gridDim.x), 1u);
}

int main(int argc, char **argv) {
    const int H = argc > 1 ? atoi(argv[1]) : 2048, T = 16384, K = 8;
    const int rows = T * K, blocks = rows / 128;
    std::vector<int32_t> row_slot(rows), slot_row(rows);
    for (int i = 0; i < rows; ++i) row_slot[i] = i;
    std::shuffle(row_slot.begin(), row_slot.end(), std::mt19937(1));
    for (int r = 0; r < rows; ++r) slot_row[row_slot[r]] = r;
    uint16_t *x, *xs; int32_t *d_rs, *d_sr, *d_nr, *d_fail; uint32_t *arr; float *wts, *rw;
    OK(cudaMalloc(&x, (size_t)T * H * 2)); OK(cudaMalloc(&xs, (size_t)rows * H * 2));
    OK(cudaMemset(x, 1, (size_t)T * H * 2));
    OK(cudaMalloc(&d_rs, rows * 4)); OK(cudaMalloc(&d_sr, rows * 4)); OK(cudaMalloc(&d_nr, 4)); OK(cudaMalloc(&d_fail, 4));
    OK(cudaMalloc(&arr, blocks * 4)); OK(cudaMalloc(&wts, rows * 4)); OK(cudaMalloc(&rw, rows * 4));
    OK(cudaMemcpy(d_rs, row_slot.data(), rows * 4, cudaMemcpyHostToDevice));
    OK(cudaMemcpy(d_sr, slot_row.data(), rows * 4, cudaMemcpyHostToDevice));
    OK(cudaMemcpy(d_nr, &rows, 4, cudaMemcpyHostToDevice)); OK(cudaMemset(d_fail, 0, 4));
    mf_dispatch_params p = {};
    p.x[0] = x; p.x_stride[0] = H; p.xs[0] = xs; p.num_tensors = 1; p.slot_row = d_sr; p.row_slot = d_rs;
    p.num_rows = d_nr; p.call_failed = d_fail; p.num_tokens = T; p.rows_cap = rows; p.hidden = H; p.top_k = K;
    p.weights = wts; p.row_weight = rw; p.block_arrivals = arr;
    int sms; OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    const double bytes = 2.0 * rows * H * 2;   // read + write
    auto time = [&](const char *what, int D, auto fn) {
        fn(); OK(cudaDeviceSynchronize());
        float best = 1e9;
        for (int i = 0; i < 5; ++i) { cudaEventRecord(e0); fn(); cudaEventRecord(e1); OK(cudaEventSynchronize(e1));
            float ms; cudaEventElapsedTime(&ms, e0, e1); best = std::min(best, ms); }
        printf("H=%d %-26s D=%3d  %.3f ms  %.2f TB/s (r+w)  %.1f GB/s per SM\n", H, what, D, best, bytes / best * 1e-9,
               bytes / best * 1e-6 / D);
    };
    p.num_sms = sms;
    time("token-major (all SMs)", sms, [&] { OK(mf_dispatch_rows_bf16(&p, 0)); });
    for (int D : {8, 16, 24, 132}) {
        p.num_sms = D;
        time("by block, registers", D, [&] { cudaMemsetAsync(arr, 0, blocks * 4); OK(mf_dispatch_blocks_bf16(&p, 0)); });
    }
    constexpr int W = 4;
    const int S = 200 * 1024 / W / (H * 2) & ~1;
    const size_t smem = (size_t)W * S * H * 2 + W * S * 8;
    auto run_bulk = [&](int D) {
        cudaMemsetAsync(arr, 0, blocks * 4);
        if (S >= 12) bulk_dispatch<W, 12><<<D, W * 32, smem>>>(x, xs, d_rs, K, H, blocks, arr);
        else bulk_dispatch<W, 6><<<D, W * 32, smem>>>(x, xs, d_rs, K, H, blocks, arr);
        OK(cudaGetLastError());
    };
    OK(cudaFuncSetAttribute(bulk_dispatch<W, 12>, cudaFuncAttributeMaxDynamicSharedMemorySize, 220 * 1024));
    OK(cudaFuncSetAttribute(bulk_dispatch<W, 6>, cudaFuncAttributeMaxDynamicSharedMemorySize, 220 * 1024));
    printf("bulk: W=%d S=%d smem %zu\n", W, S >= 12 ? 12 : 6, smem);
    for (int D : {8, 16, 24, 132}) time("by block, TMA bulk", D, [&] { run_bulk(D); });
    // check bulk result
    std::vector<uint32_t> a(blocks); OK(cudaMemcpy(a.data(), arr, blocks * 4, cudaMemcpyDeviceToHost));
    int bad = 0; for (int b = 0; b < blocks; ++b) bad += a[b] != (uint32_t)W;
    printf("bulk arrivals wrong: %d of %d\n", bad, blocks);
    return 0;
}
