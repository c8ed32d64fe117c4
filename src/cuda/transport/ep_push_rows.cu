/* Expert parallelism: dispatch by pushing rows to the ranks that hold their experts
 * (see mf_ep_push_params in kernels.h).
 *
 * Work items, grid-stride, one warp each:
 *   [0, T*K)                 this rank's slot s: its token's x row (and dy row) to the
 *                            expert's rank, with the row's source and p;
 *   [T*K, T*K + E_local*128) candidate padding rows of this rank's receive layout
 *                            (expert l, j-th row past its count): zeros, source -1.
 * The peers' rows and this rank's padding rows are disjoint, so no ordering is needed
 * between them. Forward: each row written counts one arrival on its receive block
 * (gemm1 starts a block once all 128 are in). Both directions: the rows flag is raised
 * by the last block to finish, after every block made its writes visible at system
 * scope (threadfence reduction pattern).
 *
 * FP8 forward (x_codes): x's rows are quantized as they are pushed, 1 byte and 1/32 of a
 * scale per element instead of 2 bytes (decision 0025).
 * NOTE: the same bytes as the one-rank gather (T*K*H*2 read and written per tensor),
 * but the writes cross NVLink: at ~450 GB/s per direction per H200 link set, 16384
 * tokens of qwen3-30b-a3b (~268 MB of x rows, 7/8 remote at R = 8) take ~0.5 ms.
 * Overlapping them with the GEMMs is the job of the fused kernel (see
 * docs/decisions/0015-ep-transport). */
#include <cuda_runtime.h>
#include <stdint.h>

#include "check.h"
#include "fp8_recipe.cuh"
#include "transport/ep_wait.cuh"
#include "kernels.h"
#include "transport/row_copy.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

template <class T>
__device__ inline T *window(void *const *peers, int w, int q, int R) {
    return static_cast<T *>(peers[w * R + q]);
}

/* One row of rank q's receive block is written (by this warp): every lane's writes made
 * visible at system scope, then one count on the block's arrival counter there. */
__device__ inline void count_arrival(const mf_ep_push_params &p, int q, int row, int lane) {
    mf::ptx::fence_sys();
    __syncwarp();
    if (lane != 0) return;
    uint32_t *arrivals = mf::ep::sync_of(p.peers, q, p.num_ranks) +
                         mf_ep_arrivals_word(p.num_ranks, p.num_experts);
    atomicAdd_system(arrivals + row / MF_ROW_BLOCK_M, 1u);
}

/* FP8: a token's x row quantized into row `row` of window `win` (mf_ep_push_params,
 * x_codes): each 1 x 128 tile by a half-warp, 16 bytes a lane, one piece at a time (pieces
 * held across the quantization spilled when it had an out-of-line division). */
__device__ inline void push_row_codes(uint8_t *win, int row, const uint16_t *x,
                                      const mf_ep_push_params &p, int lane) {
    const int vecs = p.hidden / 8;   /* % 16 == 0: a tile's pieces are all there or none */
    const unsigned half_lanes = lane < 16 ? 0x0000ffffu : 0xffff0000u;
    float *scales = reinterpret_cast<float *>(win + MF_FP8_CODES_BYTES(p.rows_cap, p.hidden));
    const uint4 *src = reinterpret_cast<const uint4 *>(x);
    for (int v = lane; v < vecs; v += 32) {   /* uniform per half-warp */
        float scale;
        const uint2 codes = mf::fp8::row_tile_codes(__ldg(src + v), half_lanes, p.pow2, &scale);
        *reinterpret_cast<uint2 *>(win + (int64_t)row * p.hidden + 8 * v) = codes;
        if ((lane & 15) == 0) scales[(int64_t)(v / 16) * p.rows_cap + row] = scale;
    }
}

__global__ void __launch_bounds__(kThreads)
ep_push_rows_kernel(const __grid_constant__ mf_ep_push_params p) {
    uint32_t *sync = p.sync;
    const uint32_t epoch = sync[MF_EP_SYNC_EPOCH];
    const bool comm_failed = sync[MF_EP_SYNC_COMM_FAILED] != 0;
    const bool own_failed = *(volatile int32_t *)&p.state->call_failed != 0;
    const int R = p.num_ranks, me = p.rank, K = p.top_k, EL = p.num_local_experts;
    const int vecs = p.hidden / 8;
    const int lane = threadIdx.x & 31;
    const int64_t slots = (int64_t)p.num_tokens * K;
    // No receive layout when the call failed before it (gemm_num_rows is then 0).
    const int64_t pad_items = *p.gemm_num_rows > 0 ? (int64_t)EL * MF_ROW_BLOCK_M : 0;
    const int64_t items = comm_failed ? 0 : slots + pad_items;
    const int64_t warps = (int64_t)gridDim.x * kWarps;

    for (int64_t i = blockIdx.x * (int64_t)kWarps + (threadIdx.x >> 5); i < items; i += warps) {
        if (i < slots) {
            const int e = own_failed ? -1 : __ldg(p.ids + i);
            int row = -1;
            if (e >= 0)
                row = p.backward ? __ldg(p.slot_row + i)
                                 : __ldg(p.dest_base + e) + __ldg(p.plan_slot_row + i) -
                                       __ldg(p.plan_offsets + e);
            // a failed call writes nothing into the caller's saved buffer
            if (!p.backward && !own_failed && lane == 0) p.slot_row[i] = row;
            if (row < 0) continue;
            const int q = e / EL;
            const int64_t t = i / K;
            if (p.x_codes)
                push_row_codes(window<uint8_t>(p.peers, MF_WIN_XS, q, R), row,
                               p.x + t * p.x_stride, p, lane);
            else
                mf::warp_copy_row(window<int4>(p.peers, MF_WIN_XS, q, R) + (int64_t)row * vecs,
                                  reinterpret_cast<const int4 *>(p.x + t * p.x_stride), vecs,
                                  lane);
            if (p.dy)
                mf::warp_copy_row(window<int4>(p.peers, MF_WIN_DYS, q, R) + (int64_t)row * vecs,
                         reinterpret_cast<const int4 *>(p.dy + t * p.dy_stride), vecs, lane);
            if (lane == 0) {
                window<int32_t>(p.peers, MF_WIN_ROW_SLOT, q, R)[row] = (int32_t)(i * R + me);
                window<float>(p.peers, MF_WIN_ROW_WEIGHT, q, R)[row] = __ldg(p.weights + i);
            }
            if (p.count_arrivals) count_arrival(p, q, row, lane);
        } else {
            const int64_t j = i - slots;
            const int l = (int)(j / MF_ROW_BLOCK_M);
            const int row = p.recv_offsets[l] + p.recv_counts[l] + (int)(j % MF_ROW_BLOCK_M);
            if (row >= p.recv_offsets[l + 1]) continue;
            if (p.x_codes)
                mf::warp_zero_codes_row(
                    window<uint8_t>(p.peers, MF_WIN_XS, me, R),
                    reinterpret_cast<float *>(window<uint8_t>(p.peers, MF_WIN_XS, me, R) +
                                              MF_FP8_CODES_BYTES(p.rows_cap, p.hidden)),
                    p.rows_cap, row, p.hidden, lane);
            else
                mf::warp_zero_row(window<int4>(p.peers, MF_WIN_XS, me, R) + (int64_t)row * vecs,
                                  vecs, lane);
            if (p.dy)
                mf::warp_zero_row(window<int4>(p.peers, MF_WIN_DYS, me, R) + (int64_t)row * vecs, vecs,
                         lane);
            if (lane == 0) {
                window<int32_t>(p.peers, MF_WIN_ROW_SLOT, me, R)[row] = -1;
                window<float>(p.peers, MF_WIN_ROW_WEIGHT, me, R)[row] = 0.f;
            }
            if (p.count_arrivals) count_arrival(p, me, row, lane);
        }
    }

    // ---- the last block raises the rows flag on every rank ----
    mf::ptx::fence_sys();
    __syncthreads();
    __shared__ bool s_last;
    if (threadIdx.x == 0)
        s_last = atomicAdd(sync + MF_EP_SYNC_PUSH_DONE, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!s_last) return;
    if (threadIdx.x == 0) sync[MF_EP_SYNC_PUSH_DONE] = 0;  // ready for the next call
    mf::ep::raise_on_all(p.peers, me, R, MF_EP_FLAG_ROWS, epoch, comm_failed);
}

}  // namespace

extern "C" cudaError_t mf_ep_push_rows(const mf_ep_push_params *p, cudaStream_t stream) {
    if (!p || p->num_ranks < 1 || p->hidden <= 0 || p->hidden % 8 || p->x_stride % 8 ||
        p->dy_stride % 8 || p->top_k < 1 || p->num_tokens < 0 || p->num_sms < 1 ||
        p->num_local_experts < 1 ||
        (p->x_codes && (p->dy || p->hidden % 128 || p->rows_cap < 1 || p->rows_cap % 4)))
        return cudaErrorInvalidValue;
    const int64_t items = (int64_t)p->num_tokens * p->top_k +
                          (int64_t)p->num_local_experts * MF_ROW_BLOCK_M;
    const int64_t need = (items + kWarps - 1) / kWarps;
    const int blocks = (int)(need < p->num_sms * 8 ? need : p->num_sms * 8);
    ep_push_rows_kernel<<<blocks, kThreads, 0, stream>>>(*p);
    return cudaGetLastError();
}

extern "C" cudaError_t mf_ep_push_rows_load(void) { return mf_load_kernels(ep_push_rows_kernel); }
