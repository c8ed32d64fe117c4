/* The sm_90a grouped (per-expert) GEMM kernels: the persistent tile scheduler, the kernel
 * skeleton (barrier setup, setmaxnreg, one role per warpgroup), the row-scatter epilogue
 * of gemm2 and dgrad1, and what every launcher does. The pieces: tile shapes and the
 * ring (tile_config.cuh), the producer and consumer roles (mainloop.cuh), the store
 * warps (store_warps.cuh). gemm1 and gemm2 differ only in which boxes they load and in
 * the epilogue, passed in as functors.
 *
 * Shape of the work: C[rows, N] = A[rows, K] * B_e[N, K]^T, where the rows are sorted
 * by expert and each 128-row block belongs to one expert (row_block_expert). In the
 * forward both A and B are K-major (K contiguous), the natural wgmma "TN" layout, loaded
 * by TMA with the 128-byte swizzle in K slices of one swizzle row (the precision's
 * kBlockK: 64 bf16).
 *
 * MN-major operands (the backward, bf16): an operand whose M or N index is contiguous in
 * memory (dgrad's B = W2_e [H, I] or W13_e [2I, H] with K = the row index; both wgrad
 * operands, whose K = the expert's rows) is loaded as boxes of 64 contiguous MN elements
 * x 64 K rows (8 KB each, the same bytes per stage as K-major) and handed to wgmma with
 * the transpose immediate set and an MN-major descriptor (ptx::make_desc_mnmajor_sw128).
 * A precision without transposes (FP8) takes K-major operands only.
 * TileConfig says which operand is which; the mainloop is the same for all kernels.
 * The K-loop length may differ per tile (wgrad: the expert's rows), even be 0. */
#pragma once

#include <cuda.h>
#include <stdint.h>

#include "check.h"
#include "kernels.h"
#include "sm90/common/mainloop.cuh"
#include "sm90/common/store_warps.cuh"
#include "sm90/common/tile_config.cuh"
#include "sm90/ptx/tma.cuh"

namespace mf {
namespace sm90 {

/* ---- persistent tile scheduler ------------------------------------------------------
 * Tiles are (128-row block, n block), n fastest: the CTAs running at the same time cover
 * a few consecutive row blocks (mostly one expert) and all of its n blocks, so each A
 * block is read from DRAM about once and the expert's weights stay in L2 while its row
 * blocks pass. The row count lives in device memory (written by the plan kernel). */
/* A scheduler gives the tiles of this CTA (next_tile) and the K-loop length of a tile
 * (num_k_blocks); producer and consumers each walk their own copy in the same order. */
struct TileScheduler {
    int num_n_blocks;
    int total;
    int next;
    int k_blocks;

    __device__ __forceinline__ TileScheduler(const int32_t *num_rows, int rows_cap,
                                             int n_blocks, int num_k_blocks) {
        int rows = *num_rows;
        rows = rows < 0 ? 0 : (rows > rows_cap ? rows_cap : rows);
        num_n_blocks = n_blocks;
        total = (rows / kBlockM) * n_blocks;
        next = blockIdx.x;
        k_blocks = num_k_blocks;
    }
    __device__ __forceinline__ int num_k_blocks(int, int) const { return k_blocks; }
    __device__ __forceinline__ bool next_tile(int &m_block, int &n_block) {
        if (next >= total) return false;
        m_block = next / num_n_blocks;
        n_block = next - m_block * num_n_blocks;
        next += gridDim.x;
        return true;
    }
};

/* ---- kernel skeleton ----------------------------------------------------------------
 * Role split shared by all kernels: barrier setup, setmaxnreg, then one role per
 * warpgroup; the consumers run consume(ring, sched, epi). Must be called from a
 * __launch_bounds__(kThreads, 1) kernel. */
template <class Cfg, class Sched, class Load, class Epi, class Consume>
__device__ __forceinline__ void run_grouped_gemm_roles(uint8_t *smem_raw,
                                                       const CUtensorMap *map_a,
                                                       const CUtensorMap *map_b,
                                                       const Sched &sched, Load &load,
                                                       Epi &epi, Consume &&consume) {
    /* NOTE: the swizzled TMA tiles need 1024-byte alignment; a dynamic buffer declared
     * __align__(1024) with no static shared memory starts there, and we check. */
    if (ptx::smem_u32(smem_raw) & 1023u) __trap();
    const Ring<Cfg> ring = ring_from_smem<Cfg>(smem_raw);
    const int wg = threadIdx.x / 128;
    if (threadIdx.x == kConsumerWarpgroups * 128) {
        ring_init<Cfg>(ring);
        ptx::tma_prefetch_desc(map_a);
        ptx::tma_prefetch_desc(map_b);
    }
    __syncthreads();

    if (wg == kConsumerWarpgroups) {
        ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
        if (threadIdx.x == kConsumerWarpgroups * 128) producer_role<Cfg>(ring, sched, load);
        if constexpr (Cfg::kStoreWarps)
            if (threadIdx.x / 32 >= kFirstStoreWarp) store_role<Cfg>(ring, sched, epi);
    } else {
        ptx::setmaxnreg_inc<Cfg::kConsumerRegs>();
        consume(ring, sched, epi);
    }
}

/* The kernels with one operand layout. A scaled precision (FP8) promotes every K block
 * with the scale hook the Load makes per tile (load.block_scale(m_block, n_block,
 * k_blocks): where the tile's scales are). */
template <class Cfg, class Sched, class Load, class Epi>
__device__ __forceinline__ void run_grouped_gemm_sched(uint8_t *smem_raw,
                                                       const CUtensorMap *map_a,
                                                       const CUtensorMap *map_b,
                                                       const Sched &sched, Load &load,
                                                       Epi &epi) {
    if constexpr (Cfg::kAScaleBytes == 0) {
        run_grouped_gemm_roles<Cfg>(smem_raw, map_a, map_b, sched, load, epi,
                                    [](const Ring<Cfg> &ring, const Sched &s, Epi &e) {
                                        consumer_role<Cfg>(ring, s, e);
                                    });
    } else {
        run_grouped_gemm_roles<Cfg>(
            smem_raw, map_a, map_b, sched, load, epi,
            [&](const Ring<Cfg> &ring, const Sched &s, Epi &e) {
                consumer_role<Cfg>(ring, s, e,
                                   [&](int m_block, int n_block, RingPos<Cfg> &pos,
                                       float (&acc)[Cfg::kAccRegs], int k_blocks) {
                                       auto scale = load.block_scale(m_block, n_block, k_blocks);
                                       k_loop<Cfg>(ring, pos, acc, k_blocks, scale);
                                   });
            });
    }
}

/* ---- FP8 block scales of a row-block GEMM (gemm_params.h) ------------------------------
 * A's 1 x 128 row scales [K / 128, a_ld] (a tile's 128 row scales of K block kb are 512
 * contiguous bytes, bulk-copied with the stage), B's 128 x 128 weight-block scales
 * [E * N / 128, K / 128] (a weight block's K-block scales contiguous). Null for bf16. */
struct BlockScales {
    const float *a;
    int64_t a_ld;
    const float *b;

    template <class Cfg>
    __device__ __forceinline__ void load_a(uint8_t *dst, int kb, int m_row, uint64_t *bar) const {
        ptx::bulk_load_g2s(dst, a + kb * a_ld + m_row, Cfg::kAScaleBytes, bar);
    }
    /* The K-block scales of the weight block holding weight row n (all experts' rows in
     * order), K = k. */
    __device__ __forceinline__ const float *b_row(int64_t n, int k) const {
        return b + (n / 128) * (k / 128);
    }
    /* The hook of a tile whose B columns are weight rows n_left.. (left half) and
     * n_right.. (right half). */
    template <class Cfg>
    __device__ __forceinline__ PromoteBlockScale<Cfg::kAccRegs> tile(int64_t n_left,
                                                                    int64_t n_right, int k,
                                                                    int k_blocks) const {
        return PromoteBlockScale<Cfg::kAccRegs>(b_row(n_left, k), b_row(n_right, k), k_blocks);
    }
};

inline BlockScales block_scales_of(const mf_operand &a, const mf_operand &b, int rows_cap) {
    return BlockScales{a.scales, (int64_t)(rows_cap + 3) / 4 * 4, b.scales};
}

/* ---- W13's gate and up rows, packed or in two halves (gemm_params.h) --------------------
 * Two tensor maps over rows of H elements: expert e's gate row j is row
 * e * expert_rows + j of map_gate, its up row j row e * expert_rows + up_first + j of
 * map_up. Packed: both maps describe the one [E * 2I, H] array, expert_rows = 2I,
 * up_first = I (the rows of old); halves: each map its own [E * I, H] array,
 * expert_rows = I, up_first = 0. No copy either way: the boxes come from where the rows
 * are. */
struct W13Halves {
    CUtensorMap map_gate, map_up;
    int expert_rows, up_first;

    __device__ __forceinline__ int gate_row(int e, int j) const { return e * expert_rows + j; }
    __device__ __forceinline__ int up_row(int e, int j) const {
        return e * expert_rows + up_first + j;
    }
};

/* The up half apart (up set) is for bf16 (FP8 weights are quantized packed), with whole K
 * blocks of dgrad1 (K = 2I) in each half. */
template <class P>
inline bool w13_halves_ok(const void *up, int intermediate) {
    return !up || (P::kAScaleBytes == 0 && intermediate % P::kBlockK == 0);
}

/* Host: the maps of W13 (gate half or packed, at w13) and its up half (NULL: packed), in
 * boxes of box_rows x box_cols elements. */
template <class P>
inline cudaError_t w13_halves_from(W13Halves *w, const void *w13, const void *up, int experts,
                                   int intermediate, int hidden, uint32_t box_rows,
                                   uint32_t box_cols) {
    w->expert_rows = up ? intermediate : 2 * intermediate;
    w->up_first = up ? 0 : intermediate;
    const cudaError_t err = tensor_map_2d<P>(&w->map_gate, w13, (uint64_t)experts * w->expert_rows,
                                             hidden, hidden, box_rows, box_cols);
    if (err != cudaSuccess || !up) {
        w->map_up = w->map_gate;
        return err;
    }
    return tensor_map_2d<P>(&w->map_up, up, (uint64_t)experts * intermediate, hidden, hidden,
                            box_rows, box_cols);
}

/* Row-block GEMMs (gemm1, gemm2, dgrad1, dgrad2): tiles (128-row block, n block), a
 * fixed K loop. */
template <class Cfg, class Load, class Epi>
__device__ __forceinline__ void run_grouped_gemm(uint8_t *smem_raw, const CUtensorMap *map_a,
                                                 const CUtensorMap *map_b,
                                                 const int32_t *num_rows, int rows_cap,
                                                 int n_blocks, int num_k_blocks, Load &load,
                                                 Epi &epi) {
    const TileScheduler sched(num_rows, rows_cap, n_blocks, num_k_blocks);
    run_grouped_gemm_sched<Cfg>(smem_raw, map_a, map_b, sched, load, epi);
}

/* ---- shared epilogue: scatter rows to their slots -------------------------------------
 * Each row with row_slot[r] >= 0 goes to one slot row of a combine buffer, scaled by w:
 *   dst = combine + slot * ld                      (one rank: row_slot[r] = slot)
 *   dst = combine_peers[v % R] + (v / R) * ld      (expert parallelism, v = row_slot[r]
 *                                                  = slot * R + source rank)
 *   w   = row_weight[r], or 1 without row weights (dgrad1)
 * Rows with row_slot -1 are not written. Chunks of 128 columns. */
struct ScatterTarget {
    const int32_t *row_slot;       /* [rows_cap] */
    const float *row_weight;       /* [rows_cap] or null (weight 1) */
    uint16_t *combine;             /* one rank */
    uint16_t *const *combine_peers;/* [R] or null (takes precedence) */
    int num_ranks;
    int ld;

    __device__ __forceinline__ float weight(int64_t r) const {
        return row_weight ? row_weight[r] : 1.f;
    }
    __device__ __forceinline__ uint16_t *row_ptr(int64_t r) const {
        const int v = row_slot[r];
        if (v < 0) return nullptr;
        if (!combine_peers) return combine + (int64_t)v * ld;
        return combine_peers[v % num_ranks] + (int64_t)(v / num_ranks) * ld;
    }
};

/* The epilogue of gemm2 and dgrad1: each row of the tile, scaled by its weight, to its
 * slot (ScatterTarget). The weights are loaded before the K loop; the consumers write the
 * scaled tile into their buffers and the store warps store the rows. */
template <class Cfg>
struct ScatterRowsEpilogue {
    const ScatterTarget &to;
    Ring<Cfg> ring;
    StoreHandoff handoff;
    float w[2];   /* the weights of this lane's two rows */

    __device__ __forceinline__ int64_t first_row(int m_block, int wg) const {
        return (int64_t)m_block * kBlockM + wg * 64;
    }
    /* Before the K loop: the weights of this lane's rows (16 * warp + lane / 4 + 8h). */
    __device__ __forceinline__ void prepare(int m_block, int) {
        const int t = threadIdx.x % 128;
        const int64_t row0 = first_row(m_block, threadIdx.x / 128);
#pragma unroll
        for (int h = 0; h < 2; ++h) w[h] = to.weight(row0 + (t / 32) * 16 + (t % 32) / 4 + 8 * h);
    }

    /* The scaled rows into the buffer, which the caller holds (StoreHandoff). */
    __device__ __forceinline__ void write_rows(float (&acc)[Cfg::kAccRegs], uint8_t *buf) {
        epi_write_bf16<Cfg>(buf, [&](int c, int h) {
            return pack_bf16x2_rn(w[h] * acc[4 * c + 2 * h], w[h] * acc[4 * c + 2 * h + 1]);
        });
    }
    __device__ __forceinline__ void operator()(int, int, float (&acc)[Cfg::kAccRegs],
                                               uint8_t *buf) {
        handoff.stage(ring, buf, [&](uint8_t *b) { write_rows(acc, b); });
    }

    /* Store warps: the rows of warpgroup wg to their slots. */
    __device__ __forceinline__ void drain(int m_block, int n_block, int wg, const uint8_t *buf) {
        const int64_t row0 = first_row(m_block, wg);
        drain_rows<Cfg>(buf, [&](int r) -> uint16_t * {
            uint16_t *row = to.row_ptr(row0 + r);
            return row ? row + n_block * Cfg::BN : nullptr;
        });
    }
};

/* ---- host side: what every launcher of these kernels does -------------------------- */

/* TMA sources and the 16-byte epilogue stores need 16-byte aligned bases (NULL passes). */
template <class... T>
inline bool misaligned16(const T *...ptrs) {
    return ((reinterpret_cast<uintptr_t>(ptrs) & 15u) | ...) != 0;
}

/* The checks of the params' shared pieces (gemm_params.h) every launcher makes. */
/* An input of the bf16 kernels: bf16, unscaled. */
inline bool bf16_operand(const mf_operand &o) {
    return o.data && o.dtype == MF_DTYPE_BF16 && !o.scales && o.scale_layout == MF_SCALES_NONE;
}
/* An input of precision P's kernels: bf16 unscaled, or e4m3 with scales in `layout`. */
template <class P>
inline bool operand_ok(const mf_operand &o, mf_scale_layout layout) {
    if constexpr (P::kAScaleBytes == 0) return bf16_operand(o);
    return o.data && o.dtype == MF_DTYPE_E4M3 && o.scales && o.scale_layout == layout;
}
/* The row blocks of a row-block GEMM (row_block_expert, num_rows). */
inline bool row_blocks_ok(const mf_rows &r) {
    return r.row_block_expert && r.num_rows && r.rows_cap >= 0 && r.rows_cap % kBlockM == 0 &&
           r.num_local_experts > 0;
}
inline bool arrivals_ok(const mf_arrivals &a) { return !a.arrivals || (a.target && a.state); }
inline bool scatter_ok(const mf_scatter &t) {
    return t.row_slot && (t.combine || t.combine_peers) && !(t.combine_peers && t.num_ranks < 1);
}

/* Raises the kernel's dynamic shared-memory limit and launches the persistent grid. */
template <class Args>
inline cudaError_t launch_persistent(void (*kernel)(Args), size_t smem_bytes, int num_ctas,
                                     const Args &args, cudaStream_t stream) {
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           (int)smem_bytes);
    if (err != cudaSuccess) return err;
    kernel<<<num_ctas, kThreads, smem_bytes, stream>>>(args);
    return cudaGetLastError();
}

}  // namespace sm90
}  // namespace mf
