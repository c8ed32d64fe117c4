/* The backward's device check of a saved buffer's plan against the layer, T and ids
 * (see mf_saved_check_params in kernels.h for what each kernel checks).
 * NOTE: the slot pass reads 4 words per slot and row: ~1 MB at T = 4096, K = 8, a few
 * microseconds. */
#include <cuda_runtime.h>
#include <stdint.h>

#include "check.h"
#include "kernels.h"

namespace {

/* What failed (mf_plan_error.slot of a MOEFUSE_ERR_SAVED_STATE record). */
enum { kBadHeader = 0, kBadOffsets = 1, kBadBlocks = 2, kBadSlot = 3, kBadRow = 4 };

__device__ void record_saved_error(mf_plan_state *st, int what, int index, int value) {
    if (st->record.code == 0) {  // keep the first failure until moefuse_layer_check
        st->record.token = index;
        st->record.slot = what;
        st->record.value = value;
        st->record.code = MOEFUSE_ERR_SAVED_STATE;
    }
}

__global__ void __launch_bounds__(256) bwd_check_header_kernel(const __grid_constant__ mf_saved_check_params p) {
    __shared__ int s_bad;   // smallest bad index * 8 + what; INT_MAX none
    if (threadIdx.x == 0) s_bad = 0x7fffffff;
    __syncthreads();
    const int EL = p.num_local_experts;
    const int32_t nr = p.header[MF_SAVED_NUM_ROWS];
    // header words (each thread one word; num_rows: multiple of 128 within rows_cap)
    if (threadIdx.x < MF_SAVED_NUM_ROWS && p.header[threadIdx.x] != p.want[threadIdx.x])
        atomicMin(&s_bad, (int)threadIdx.x * 8 + kBadHeader);
    if (threadIdx.x == 0 && (nr < 0 || nr > p.rows_cap || nr % MF_ROW_BLOCK_M != 0))
        atomicMin(&s_bad, MF_SAVED_NUM_ROWS * 8 + kBadHeader);
    __syncthreads();
    if (s_bad == 0x7fffffff) {
        // counts and offsets: offsets[e+1] - offsets[e] = counts[e] padded to 128
        for (int e = threadIdx.x; e <= EL; e += blockDim.x) {
            bool ok;
            if (e == EL) {
                ok = p.offsets[EL] == nr && p.offsets[0] == 0;
            } else {
                const int32_t c = p.counts[e];
                ok = c >= 0 && c <= p.rows_cap &&
                     p.offsets[e + 1] - p.offsets[e] ==
                         (c + MF_ROW_BLOCK_M - 1) / MF_ROW_BLOCK_M * MF_ROW_BLOCK_M;
            }
            if (!ok) atomicMin(&s_bad, e * 8 + kBadOffsets);
        }
        __syncthreads();
    }
    if (s_bad == 0x7fffffff) {
        // each 128-row block names the expert whose segment holds it
        for (int b = threadIdx.x; b < nr / MF_ROW_BLOCK_M; b += blockDim.x) {
            const int32_t e = p.row_block_expert[b];
            const bool ok = e >= 0 && e < EL && p.offsets[e] <= b * MF_ROW_BLOCK_M &&
                            b * MF_ROW_BLOCK_M < p.offsets[e + 1];
            if (!ok) atomicMin(&s_bad, b * 8 + kBadBlocks);
        }
        __syncthreads();
    }
    const bool bad = s_bad != 0x7fffffff;
    for (int e = threadIdx.x; e <= EL; e += blockDim.x) p.bwd_offsets[e] = bad ? 0 : p.offsets[e];
    if (threadIdx.x == 0) {
        if (bad) {
            const int what = s_bad % 8, index = s_bad / 8;
            const int value = what == kBadHeader ? p.header[index]
                              : what == kBadOffsets ? p.offsets[index] : p.row_block_expert[index];
            record_saved_error(p.state, what, index, value);
        }
        /* Rows from peers: a rank whose forward ids were bad sent no rows and gets no dx, but still
         * serves the rows the other ranks send it. */
        const bool sent_nothing = p.peers && p.header[MF_SAVED_SEND_FAILED] != 0;
        p.state->call_failed = bad || sent_nothing ? 1 : 0;
        p.state->saved_rejected = bad ? 1 : 0;
        *p.gemm_num_rows = bad ? 0 : nr;
    }
}

__global__ void __launch_bounds__(256) bwd_check_slots_kernel(const __grid_constant__ mf_saved_check_params p) {
    if (p.state->call_failed) return;  // the header failed: the rest is not to be read
    const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    const int64_t slots = (int64_t)p.num_tokens * p.top_k;
    const int32_t nr = p.header[MF_SAVED_NUM_ROWS];
    bool ok = true;
    if (p.peers) {
        // peers: a routed slot has a row on its expert's rank (within every rank's capacity),
        // a dropped one none; the rows live on the other ranks, their check is theirs
        if (i < slots) {
            const int32_t r = p.slot_row[i];
            ok = p.ids[i] >= 0 ? r >= 0 && r < p.rows_cap : r == -1;
        }
    } else if (i < slots) {
        // a local slot has a row that points back at it; any other slot has none
        const int32_t e = p.ids[i] - p.expert_begin, r = p.slot_row[i];
        if (e >= 0 && e < p.num_local_experts)
            ok = r >= p.offsets[e] && r < p.offsets[e] + p.counts[e] && p.row_slot[r] == i;
        else
            ok = r == -1;
    } else if (i < slots + nr) {
        // a row of a segment's first counts[e] holds a slot routed to e that points
        // back at it; the rest of the segment is padding
        const int32_t r = (int32_t)(i - slots), s = p.row_slot[r];
        const int32_t e = p.row_block_expert[r / MF_ROW_BLOCK_M];
        if (r - p.offsets[e] < p.counts[e])
            ok = s >= 0 && s < slots && p.slot_row[s] == r && p.ids[s] == p.expert_begin + e;
        else
            ok = s == -1;
    }
    if (!ok) atomicMin(&p.state->first_bad_token, (uint32_t)i);
}

__global__ void bwd_check_finish_kernel(const __grid_constant__ mf_saved_check_params p) {
    const uint32_t bad = p.state->first_bad_token;
    if (bad == 0xffffffffu) return;
    const int64_t slots = (int64_t)p.num_tokens * p.top_k;
    if ((int64_t)bad < slots)
        record_saved_error(p.state, kBadSlot, (int)bad, p.ids[bad]);
    else
        record_saved_error(p.state, kBadRow, (int)(bad - slots), p.row_slot[bad - slots]);
    p.state->call_failed = 1;
    p.state->saved_rejected = 1;
    *p.gemm_num_rows = 0;
    for (int e = 0; e <= p.num_local_experts; e++) p.bwd_offsets[e] = 0;
    p.state->first_bad_token = 0xffffffffu;
}

}  // namespace

extern "C" cudaError_t mf_saved_check(const mf_saved_check_params *p, cudaStream_t stream) {
    if (!p || p->num_tokens < 0 || p->top_k < 1) return cudaErrorInvalidValue;
    bwd_check_header_kernel<<<1, 256, 0, stream>>>(*p);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    // rows from peers: the slots only (the rows are the other ranks' sends)
    const int64_t check_n = (int64_t)p->num_tokens * p->top_k + (p->peers ? 0 : p->rows_cap);
    if (check_n > 0) {
        bwd_check_slots_kernel<<<(unsigned)((check_n + 255) / 256), 256, 0, stream>>>(*p);
        err = cudaGetLastError();
        if (err != cudaSuccess) return err;
    }
    bwd_check_finish_kernel<<<1, 1, 0, stream>>>(*p);
    return cudaGetLastError();
}

extern "C" cudaError_t mf_saved_check_load(void) {
    return mf_load_kernels(bwd_check_header_kernel, bwd_check_slots_kernel,
                           bwd_check_finish_kernel);
}
