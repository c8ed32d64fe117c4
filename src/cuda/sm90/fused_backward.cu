/* The fused backward after dgrad2 (sm_90a, bf16): dW2, dgrad1 and dW13 in one persistent,
 * warp-specialized kernel.
 *
 *   dW2_e  = sum over e's rows of dys^T act_p      (wgrad tiles: both operands MN-major)
 *   combine[row_slot[r]] = bf16(dh_r W13_e)         (dgrad1 tiles: A K-major, B MN-major)
 *   dW13_e = sum over e's rows of dh^T xs           (wgrad tiles)
 *
 * Every tile is computed by the code of the stage-by-stage kernels
 * (src/cuda/sm90/moe_bwd_tiles.cuh) with the same 128 x 256 tile, so the two paths agree bit for
 * bit; what is new is one ring for two operand layouts, the order and one wait:
 *  - Ring: 3 stages of 48 KB, A 16 KB and B 32 KB in either layout (the TMA boxes
 *    differ, the bytes do not), the two 33 KB store buffers, the tile queue in the 1 KB
 *    extra region. The consumers pick the wgmma form per tile (k_loop_in_layout).
 *  - Order: every dW2 tile (experts heavy first, as the wgrad kernel), then dW13's (heavy
 *    first), then dgrad1's (row blocks in order), taken in order (src/cuda/sm90/common/tile_queue.cuh).
 *    Experts without rows: with bf16 out their tiles are not in the order, and the store
 *    warps write their zeros between drains (as the wgrad kernel does); with fp32 out
 *    they run K loops of length 0 (zeros, or nothing in accumulate mode). Run as tiles of
 *    the order, a collapsed routing's ~17000 empty tiles made this kernel slower than the
 *    three kernels (see docs/decisions/0009-fused-tile-queue-order).
 *    dgrad1 comes last for two reasons: its tiles are all of one length, so they even out
 *    the end of the kernel where the wgrads' tiles (as long as an expert's rows) would
 *    leave SMs idle; and its wait below is then long satisfied.
 *  - Wait: dys lives in the combine buffer that dgrad1 stores its dx slot rows into, and
 *    dW2 reads dys. When a dW2 tile's K loop is over, its operands are all in shared
 *    memory: consumer thread 0 adds 1 to dw2_reads_done (relaxed: the reads were TMA's,
 *    complete when their mbarrier was seen; nothing of its own to order). The store warps, before
 *    they store the rows of their first dgrad1 tile, wait until it counts every dW2 tile
 *    (acquire; bounded, wait_order_count in src/cuda/sm90/common/tile_queue.cuh). dgrad1's
 *    K loops read dh and W13 only and do not wait, nor do dW13's.
 * NOTE: why this cannot deadlock: every dW2 tile comes before every dgrad1 tile in the
 * order, so each CTA runs all its dW2 tiles before its first dgrad1 tile; a dW2 tile
 * waits for nothing but the ring and its CTA's store buffers, which only earlier tiles
 * (dW2 tiles, which do not wait) hold. So every dW2 K loop ends, and then every wait ends.
 * (dW13 tiles wait for nothing either; they only sit between the two.)
 *
 * FLOPs: those of the three kernels, 2 * rows * (H I + 2I H + 2I H) = 10 rows H I
 * (qwen3-30b-a3b at 131072 rows: 2062 GFLOP, 2.6 ms at 790 TFLOP/s). What fusing can
 * save: the tail of each kernel's last wave and the next one's ramp, twice.
 * NOTE: on an H200 it does not save them yet: it is slower than the three kernels, as
 * the fused forward is than its two, and neither the index atomic between tiles nor the
 * queue's arrivals per tile was the cause. So the pipeline stays staged by default (see
 * docs/decisions/0008-staged-by-default); what this kernel is for: expert parallelism's
 * combine and the weight gradients filling the SMs while other ranks' rows arrive. */
#include "ptx/flags.cuh"
#include "sm90/moe_bwd_tiles.cuh"
#include "sm90/common/tile_queue.cuh"

namespace {

using namespace mf;
using namespace mf::sm90;

/* One ring for both layouts (the wgrad's and dgrad1's BN = 256 configurations, with the
 * queue's extra region). The store warps get 56 registers, as in the fused forward: they
 * drain three kinds of tile. */
using WgradCfg = ProducerRegs<TileConfig<Bf16, 256, 3, true, true, 1024, 512>, 56>;
using DgradCfg = ProducerRegs<TileConfig<Bf16, 256, 3, false, true, 1024, 512>, 56>;
static_assert(WgradCfg::kSmemBytes == DgradCfg::kSmemBytes &&
                  WgradCfg::kStageBytes == DgradCfg::kStageBytes &&
                  WgradCfg::kABytes == DgradCfg::kABytes &&
                  WgradCfg::kEpiBytes == DgradCfg::kEpiBytes &&
                  WgradCfg::kConsumerRegs == DgradCfg::kConsumerRegs &&
                  std::is_same<WgradCfg::Precision, DgradCfg::Precision>::value,
              "the two layouts share one ring");

struct FusedBwdArgs {
    WgradArgs dw2;
    Dgrad1Args d1;
    WgradArgs dw13;
    uint32_t *dw2_reads_done;   /* dW2 tiles whose K loop is over, zeroed before the launch */
    int *tile_counter;          /* the next index of the order, zeroed before the launch */
};

/* dgrad1's column blocks (the wgrads' tiles: wgrad_tiles). Sizes are read from the
 * kernel's parameters at each use (the fused forward's scheduler spilled when it kept
 * them in registers). */
__device__ __forceinline__ int dgrad1_n_blocks(const FusedBwdArgs &a) {
    return a.d1.hidden / WgradCfg::BN;
}

/* Tiles as (m_block, n_block), n_block telling the kind:
 *   [0, n2)            dW2's column block n,        m_block = e * m_blocks + m block
 *   [n2, n2 + nd)      dgrad1's column block n - n2, m_block = the 128-row block
 *   [n2 + nd, ...)     dW13's column block n - n2 - nd
 * with n2 = dW2's column blocks and nd = dgrad1's. */
enum TileKind { kDw2 = 0, kDgrad1 = 1, kDw13 = 2 };

__device__ __forceinline__ int tile_kind(const FusedBwdArgs &a, int n_block) {
    return n_block < a.dw2.n_blocks ? kDw2
                                    : n_block < a.dw2.n_blocks + dgrad1_n_blocks(a) ? kDgrad1 : kDw13;
}
/* The column block within its GEMM. */
__device__ __forceinline__ int own_n_block(const FusedBwdArgs &a, int kind, int n_block) {
    return kind == kDw2 ? n_block
                        : n_block - a.dw2.n_blocks - (kind == kDw13 ? dgrad1_n_blocks(a) : 0);
}

/* A wgrad's tiles in the order: with bf16 out (the store warps' drain), those of the
 * experts with rows, the zero tiles of the others being the store warps' idle work, as
 * in the wgrad kernel; with fp32 out every tile (the consumers store, zeros included). */
__device__ __forceinline__ int ordered_wgrad_tiles(const WgradArgs &w) {
    return wgrad_gemm_tiles(w, w.dw_bf16 != nullptr);
}

struct FusedBwdScheduler {
    const FusedBwdArgs &args;
    TileQueueCursor cursor;
    int row_blocks;   /* dgrad1's 128-row blocks (the rows come from the device) */
    int dw2_tiles, dw13_tiles;   /* ordered_wgrad_tiles (the order's experts from the device) */

    __device__ __forceinline__ FusedBwdScheduler(const FusedBwdArgs &a, TileQueue *q,
                                                 int dw2_tiles_, int dw13_tiles_)
        : args(a), cursor(q), dw2_tiles(dw2_tiles_), dw13_tiles(dw13_tiles_) {
        int rows = *a.d1.num_rows;
        rows = rows < 0 ? 0 : (rows > a.d1.rows_cap ? a.d1.rows_cap : rows);
        row_blocks = rows / kBlockM;
    }
    __device__ __forceinline__ int num_k_blocks(int m_block, int n_block) const {
        const int kind = tile_kind(args, n_block);
        if (kind == kDgrad1) return 2 * args.d1.intermediate / DgradCfg::kBlockK;
        const WgradArgs &w = kind == kDw2 ? args.dw2 : args.dw13;
        return wgrad_k_blocks<WgradCfg::kBlockK>(w.expert_offsets, w.m_blocks, m_block);
    }
    __device__ __forceinline__ void decode(int t, int &m_block, int &n_block) const {
        const int first_dw13 = dw2_tiles, nd = dgrad1_n_blocks(args);
        const int first_d1 = first_dw13 + dw13_tiles;
        if (t < first_dw13) {
            wgrad_tile(args.dw2.expert_order, args.dw2.m_blocks, args.dw2.n_blocks, t, m_block,
                       n_block);
        } else if (t < first_d1) {
            wgrad_tile(args.dw13.expert_order, args.dw13.m_blocks, args.dw13.n_blocks,
                       t - first_dw13, m_block, n_block);
            n_block += args.dw2.n_blocks + nd;
        } else {
            m_block = (t - first_d1) / nd;
            n_block = args.dw2.n_blocks + (t - first_d1) % nd;
        }
    }
    __device__ __forceinline__ bool next_tile(int &m_block, int &n_block) {
        const int t = cursor.next(args.tile_counter, [&] {
            const int total = dw2_tiles + dw13_tiles + row_blocks * dgrad1_n_blocks(args);
            const int i = cursor.draw(args.tile_counter);
            return i < total ? i : -1;
        });
        if (t >= 0) decode(t, m_block, n_block);
        return t >= 0;
    }
};

/* Producer: the loads of the tile's GEMM. */
struct FusedBwdLoad {
    const FusedBwdArgs &args;
    WgradLoad<WgradCfg> dw2, dw13;
    Dgrad1Load<DgradCfg> d1;
    int kind;

    __device__ __forceinline__ void tile_begin(int m_block, int n_block) {
        kind = tile_kind(args, n_block);
        const int n = own_n_block(args, kind, n_block);
        if (kind == kDw2)
            dw2.tile_begin(m_block, n);
        else if (kind == kDgrad1)
            d1.tile_begin(m_block, n);
        else
            dw13.tile_begin(m_block, n);
    }
    __device__ __forceinline__ void stage(int kb, uint8_t *a, uint8_t *b, uint64_t *bar) {
        if (kind == kDw2)
            dw2.stage(kb, a, b, bar);
        else if (kind == kDgrad1)
            d1.stage(kb, a, b, bar);
        else
            dw13.stage(kb, a, b, bar);
    }
};

/* Epilogue: the tile's GEMM's, through one handoff of the buffers. fp32 weight-gradient
 * tiles are stored by the consumers (drains() is false for them). */
struct FusedBwdEpilogue {
    const FusedBwdArgs &args;
    WgradEpilogue<WgradCfg> dw2, dw13;
    ScatterRowsEpilogue<DgradCfg> d1;
    Ring<WgradCfg> ring;
    StoreHandoff handoff;
    uint32_t dw2_tiles;   /* ordered_wgrad_tiles(dW2) */
    bool dw2_read;        /* store warps: every dW2 tile's operands have been read */

    __device__ __forceinline__ FusedBwdEpilogue(const FusedBwdArgs &a, uint8_t *smem_raw,
                                                int dw2_tiles_, int dw13_tiles_)
        : args(a),
          dw2(a.dw2, ring_from_smem<WgradCfg>(smem_raw), dw2_tiles_),
          dw13(a.dw13, ring_from_smem<WgradCfg>(smem_raw), dw13_tiles_),
          d1{a.d1.to, ring_from_smem<DgradCfg>(smem_raw), {}, {0.f, 0.f}},
          ring(ring_from_smem<WgradCfg>(smem_raw)),
          handoff{},
          dw2_tiles((uint32_t)dw2_tiles_),
          dw2_read(false) {}

    __device__ __forceinline__ WgradEpilogue<WgradCfg> &wgrad(int kind) {
        return kind == kDw2 ? dw2 : dw13;
    }
    /* Store warps, between drains and after the last tile: a piece of a zero tile of an
     * expert without rows (bf16 out; none with fp32). */
    __device__ __forceinline__ bool idle_work() { return dw2.idle_work() || dw13.idle_work(); }
    __device__ __forceinline__ bool drains(int, int n_block) {
        const int kind = tile_kind(args, n_block);
        return kind == kDgrad1 || wgrad(kind).args.dw_bf16 != nullptr;
    }
    __device__ __forceinline__ void prepare(int m_block, int n_block) {
        const int kind = tile_kind(args, n_block);
        if (kind == kDgrad1) d1.prepare(m_block, own_n_block(args, kind, n_block));
    }
    __device__ __forceinline__ void operator()(int m_block, int n_block,
                                               float (&acc)[WgradCfg::kAccRegs], uint8_t *buf) {
        const int kind = tile_kind(args, n_block);
        /* The tile's operands are in shared memory (this thread saw every stage's mbarrier
         * complete): no fence needed, so none paid (red.release: a GPU-wide MEMBAR). */
        if (kind == kDw2 && threadIdx.x == 0) ptx::red_relaxed_gpu_add(args.dw2_reads_done, 1u);
        if (kind == kDgrad1) {
            handoff.stage(ring, buf, [&](uint8_t *b) { d1.write_rows(acc, b); });
            return;
        }
        WgradEpilogue<WgradCfg> &w = wgrad(kind);
        if (w.args.dw_bf16)
            handoff.stage(ring, buf, [&](uint8_t *b) { epi_write_acc_bf16<WgradCfg>(b, acc); });
        else
            w.store_fp32(m_block, own_n_block(args, kind, n_block), acc);
    }
    /* Store warps. A dgrad1 tile's rows go over dys: first every dW2 tile must have read
     * its operands. */
    __device__ __forceinline__ void drain(int m_block, int n_block, int wg, const uint8_t *buf) {
        const int kind = tile_kind(args, n_block);
        const int n = own_n_block(args, kind, n_block);
        /* The two wgrads named, not wgrad(kind): with the bulk-copy drain that reference
         * put both epilogue objects in local memory (a 320-byte stack frame, LDL here). */
        if (kind == kDw2) {
            dw2.drain(m_block, n, wg, buf);
            return;
        }
        if (kind == kDw13) {
            dw13.drain(m_block, n, wg, buf);
            return;
        }
        if (!dw2_read) {   /* bounded: wait_order_count */
            wait_order_count<64>(args.dw2_reads_done, dw2_tiles, [] { return kOrderWaitNs; });
            dw2_read = true;
        }
        d1.drain(m_block, n, wg, buf);
    }
};

/* Consumers: consumer_role, each tile's K loop in the tile's operand layout from one ring
 * position (the two Ring types differ only in how a stage's bytes are read). The layout
 * is made warp-uniform (a shuffle from lane 0) so that ptxas can keep the wgmmas of both
 * branches asynchronous (no C7518; see docs/decisions/0008-staged-by-default). */
template <class Cfg>
__device__ __forceinline__ void k_loop_in_layout(uint8_t *smem_raw, RingPos<WgradCfg> &pos,
                                                 float (&acc)[Cfg::kAccRegs], int num_k_blocks) {
    static_assert(Cfg::kStages == WgradCfg::kStages, "one ring position for both layouts");
    k_loop<Cfg>(ring_from_smem<Cfg>(smem_raw), pos, acc, num_k_blocks);
}

__global__ void __launch_bounds__(kThreads, 1)
    sm90_moe_fused_bwd_bf16_kernel(const __grid_constant__ FusedBwdArgs args) {
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    FusedBwdLoad load{args, {args.dw2, 0, 0, 0}, {args.dw13, 0, 0, 0}, {args.d1, 0, 0, 0, 0}, 0};
    /* the tiles of each wgrad in the order: the scheduler's ranges, the store warps' zero
     * tiles and dgrad1's wait */
    const int dw2_tiles = ordered_wgrad_tiles(args.dw2), dw13_tiles = ordered_wgrad_tiles(args.dw13);
    FusedBwdEpilogue epi(args, smem_raw, dw2_tiles, dw13_tiles);
    TileQueue *queue = reinterpret_cast<TileQueue *>(epi.ring.extra);
    static_assert(sizeof(TileQueue) <= WgradCfg::kExtraBytes, "the tile queue fits the extra region");
    if (threadIdx.x == kQueueWriter) tile_queue_init(queue);
    const FusedBwdScheduler sched(args, queue, dw2_tiles, dw13_tiles);
    run_grouped_gemm_roles<WgradCfg>(
        smem_raw, &args.d1.map_dh, &args.dw13.map_rhs, sched, load, epi,
        [](const Ring<WgradCfg> &ring, const FusedBwdScheduler &s, FusedBwdEpilogue &e) {
            consumer_role<WgradCfg>(
                ring, s, e,
                [&](int, int n_block, RingPos<WgradCfg> &pos, float (&acc)[WgradCfg::kAccRegs],
                    int k_blocks) {
                    const int dgrad =
                        __shfl_sync(0xffffffffu, tile_kind(e.args, n_block) == kDgrad1, 0);
                    if (dgrad)
                        k_loop_in_layout<DgradCfg>(ring.base, pos, acc, k_blocks);
                    else
                        k_loop_in_layout<WgradCfg>(ring.base, pos, acc, k_blocks);
                });
        });
}

}  // namespace

extern "C" int mf_sm90_moe_fused_bwd_takes(int hidden, int intermediate) {
    return hidden > 0 && intermediate > 0 && hidden % WgradCfg::BN == 0 &&
           intermediate % WgradCfg::BN == 0;
}

extern "C" cudaError_t mf_sm90_moe_fused_bwd_bf16(const mf_moe_fused_bwd_params *p,
                                                  cudaStream_t stream) {
    if (!p || !p->scratch) return cudaErrorInvalidValue;
    const mf_wgrad_params *w2 = &p->dw2, *w13 = &p->dw13;
    const mf_dgrad1_params *d = &p->dgrad1;
    if (!wgrad_params_ok<Bf16>(w2) || !wgrad_params_ok<Bf16>(w13) || !dgrad1_params_ok<Bf16>(d) ||
        !mf_sm90_moe_fused_bwd_takes(d->hidden, d->intermediate))
        return cudaErrorInvalidValue;
    const int H = d->hidden, I = d->intermediate;
    const mf_rows &r2 = w2->rows, &rd = d->rows, &r13 = w13->rows;
    if (w2->m != H || w2->n != I || w13->m != 2 * I || w13->n != H ||
        r2.rows_cap != rd.rows_cap || r13.rows_cap != rd.rows_cap ||
        r2.num_local_experts != rd.num_local_experts ||
        r13.num_local_experts != rd.num_local_experts || w2->num_sms != d->num_sms ||
        w13->num_sms != d->num_sms)
        return cudaErrorInvalidValue;
    cudaError_t err;
    if (rd.rows_cap == 0) {   /* no rows: the weight gradients alone (zeros, or nothing) */
        if ((err = mf_sm90_wgrad_grouped_bf16(w2, stream)) != cudaSuccess) return err;
        return mf_sm90_wgrad_grouped_bf16(w13, stream);
    }

    FusedBwdArgs args;
    if ((err = wgrad_args_from<WgradCfg>(w2, &args.dw2)) != cudaSuccess) return err;
    if ((err = dgrad1_args_from<DgradCfg>(d, &args.d1)) != cudaSuccess) return err;
    if ((err = wgrad_args_from<WgradCfg>(w13, &args.dw13)) != cudaSuccess) return err;
    args.dw2_reads_done = p->scratch;
    args.tile_counter = reinterpret_cast<int *>(p->scratch + 1);
    if ((err = cudaMemsetAsync(p->scratch, 0, 2 * sizeof(uint32_t), stream)) != cudaSuccess)
        return err;
    return launch_persistent(sm90_moe_fused_bwd_bf16_kernel, WgradCfg::kSmemBytes, d->num_sms,
                             args, stream);
}

extern "C" cudaError_t mf_sm90_moe_fused_bwd_load(void) {
    return mf_load_kernels(sm90_moe_fused_bwd_bf16_kernel);
}
