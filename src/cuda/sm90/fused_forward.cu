/* The fused forward of the routed experts (sm_90a, bf16): gemm1 with SwiGLU and gemm2
 * with the weighted combine in one persistent, warp-specialized kernel.
 *
 *   act = bf16(silu(g) * u), [g | u] = bf16(xs W13_e^T)          (gemm1 tiles)
 *   combine[row_slot[r]] = bf16(p * (act_r W2_e^T))               (gemm2 tiles)
 *
 * Every tile is computed by the code of the stage-by-stage kernels
 * (src/cuda/sm90/moe_fwd_tiles.cuh) with the same tile shape, so the two paths agree bit for
 * bit; what is new is the order and the wait between them:
 *  - Order: the 128-row blocks are cut into groups of G blocks. Unit u holds the gemm1
 *    tiles of group u, then the gemm2 tiles of group u - 1; a CTA that is free takes the
 *    next tile of that order (FusedFwdScheduler). G is chosen so a group's gemm1 tiles
 *    make about two waves: by the time a gemm2 tile is taken, the gemm1 tiles it needs
 *    have mostly finished, and their act rows (G x 128 x I bf16, 8.6 MB on
 *    qwen3-30b-a3b) are still in L2.
 *  - Wait: after the store warps have stored both halves of a gemm1 tile's act rows,
 *    they meet on a named barrier and one of them adds 1 to act_ready[block] (release,
 *    GPU scope). The producer, before the first TMA load of a gemm2 tile, waits until
 *    act_ready[block] counts all 2I / BN gemm1 tiles of the block (acquire), then fences
 *    the async proxy, so its TMA reads see the rows. The wait is bounded and traps when
 *    it runs out (wait_order_count, src/cuda/sm90/common/tile_queue.cuh).
 * NOTE: why this cannot deadlock: a tile only waits for tiles earlier in the order, which
 * were taken earlier, by CTAs that are running (a CTA takes tiles only once it runs), and
 * a CTA's producer issues all loads of a tile before it takes the next one; so the
 * earliest unfinished tile always makes progress.
 *
 * FLOPs: those of gemm1 and gemm2, 6 * rows * H * I: qwen3-30b-a3b at 16384 tokens
 * (131072 rows) 1237 GFLOP, 1.6 ms at 777 TFLOP/s. What fusing can save: the tail of
 * gemm1's last wave and gemm2's ramp (the two kernels' boundary), and the DRAM re-read
 * of act (201 MB on qwen3-30b-a3b).
 * NOTE: on an H200 it does not save them yet: it is slower than the two kernels, so the
 * default pipeline is staged (see docs/decisions/0008-staged-by-default). What it is
 * for: the dispatch and the combine of expert parallelism moving into it. */
#include "sm90/moe_fwd_tiles.cuh"
#include "sm90/common/tile_queue.cuh"

namespace {

using namespace mf;
using namespace mf::sm90;

/* One tile shape for both GEMMs (the ring, buffers and stage bytes must agree): 128 x 256
 * tiles, 3 stages of 48 KB (gemm1: A 16 KB + gate and up halves of B; gemm2: A 16 KB + B
 * 32 KB), 2 x 33 KB of store buffers, the tile queue in the 1 KB extra region (no TMA
 * lands there in this kernel). The store warps get 56 registers (consumers 224,
 * of which ptxas uses at most 168 anyway): with both GEMMs' drains and this scheduler
 * they spilled at 40. */
using FusedCfg = ProducerRegs<TileConfig<Bf16, 256, 3, false, false, 1024, 512>, 56>;
constexpr uint32_t kActReadyBarrier = 1;   /* named barrier of the store warps */

struct FusedFwdArgs {
    Gemm1Args g1;
    Gemm2Args g2;
    uint32_t *act_ready;   /* [rows_cap / 128] gemm1 tiles stored, zeroed before the launch */
    int *tile_counter;     /* the next tile to take, zeroed before the launch */
    int group_blocks;      /* G */
};

/* Column blocks of gemm1 at tile width BN. */
template <int BN>
__device__ __forceinline__ int gemm1_n_blocks(const FusedFwdArgs &args) {
    return 2 * args.g1.intermediate / BN;
}

/* Waits until block m_block's gemm1 tiles are all stored (acquire). Their producer waited
 * for the block's rows, so after this the rows' act and everything that came with them
 * (expert parallelism: row_slot and row_weight, pushed with the rows) are visible.
 * Bounded (wait_order_count): by the order's bound, plus the rows' timeout for which
 * those gemm1 tiles may have waited themselves (expert parallelism). */
template <int BN>
__device__ __forceinline__ void wait_act_ready(const FusedFwdArgs &args, int m_block) {
    wait_order_count<32>(args.act_ready + m_block, gemm1_n_blocks<BN>(args), [&] {
        const ep::RowArrivals &rows = args.g1.rows_in;
        return kOrderWaitNs + (rows.arrivals ? rows.timeout_ns : 0);
    });
}

/* The tile order above, taken in order (src/cuda/sm90/common/tile_queue.cuh).
 * NOTE: at two waves per group neither the in-order nor the round-robin hand-out waits
 * (a model says so, and both measured the same): the 1-3% the fused kernel still loses
 * there is per tile, not yet explained.
 * The order is a sequence of units of G * (n1 + n2) indices: unit u holds gemm1's tiles
 * of group u, then gemm2's of group u - 1; indices past the last row block (and gemm2's
 * part of unit 0) are holes, skipped by the producer. Tiles are returned as (block, n):
 * n < n1 is gemm1's column block n, n >= n1 gemm2's column block n - n1.
 * NOTE: the sizes are read from the kernel's parameters at each use rather than kept in
 * registers: a scheduler holding nine ints made ptxas spill 44 bytes. */
template <int BN>
struct FusedFwdScheduler {
    const FusedFwdArgs &args;
    TileQueueCursor cursor;
    int m_blocks;

    __device__ __forceinline__ FusedFwdScheduler(const FusedFwdArgs &a, TileQueue *q)
        : args(a), cursor(q) {
        int rows = *a.g1.num_rows;
        rows = rows < 0 ? 0 : (rows > a.g1.rows_cap ? a.g1.rows_cap : rows);
        m_blocks = rows / kBlockM;
    }
    __device__ __forceinline__ int n1() const { return gemm1_n_blocks<BN>(args); }
    __device__ __forceinline__ int n2() const { return args.g1.hidden / BN; }
    __device__ __forceinline__ int num_k_blocks(int, int n_block) const {
        return (n_block < n1() ? args.g1.hidden : args.g1.intermediate) / FusedCfg::kBlockK;
    }
    /* Indices of the order: units 0 .. groups, each G * (n1 + n2). */
    __device__ __forceinline__ int num_indices() const {
        const int G = args.group_blocks;
        return m_blocks > 0 ? ((m_blocks + G - 1) / G + 1) * G * (n1() + n2()) : 0;
    }
    /* Index t of the order as (block, n); false for a hole. */
    __device__ __forceinline__ bool decode(int t, int &m_block, int &n_block) const {
        const int G = args.group_blocks, first = G * n1();
        const int u = t / (first + G * n2()), r = t - u * (first + G * n2());
        if (r < first) {
            m_block = u * G + r / n1();
            n_block = r % n1();
        } else {
            m_block = (u - 1) * G + (r - first) / n2();
            n_block = n1() + (r - first) % n2();
        }
        return m_block >= 0 && m_block < m_blocks;
    }
    __device__ __forceinline__ bool next_tile(int &m_block, int &n_block) {
        const int t = cursor.next(args.tile_counter, [&] {
            const int total = num_indices();
            int i;
            do {
                i = cursor.draw(args.tile_counter);
            } while (i < total && !decode(i, m_block, n_block));
            return i < total ? i : -1;
        });
        if (t >= 0) decode(t, m_block, n_block);
        return t >= 0;
    }
};

/* Producer: gemm1's or gemm2's loads; a gemm2 tile first waits for its act rows. */
template <class Cfg>
struct FusedFwdLoad {
    const FusedFwdArgs &args;
    Gemm1Load<Cfg> g1;
    Gemm2Load<Cfg> g2;
    bool second;   /* the tile is gemm2's */

    __device__ __forceinline__ void wait_act(int m_block) {
        wait_act_ready<Cfg::BN>(args, m_block);
        asm volatile("fence.proxy.async.global;" ::: "memory");
    }
    __device__ __forceinline__ void tile_begin(int m_block, int n_block) {
        const int n1 = gemm1_n_blocks<Cfg::BN>(args);
        second = n_block >= n1;
        if (second) {
            wait_act(m_block);
            g2.tile_begin(m_block, n_block - n1);
        } else {
            g1.tile_begin(m_block, n_block);
        }
    }
    __device__ __forceinline__ void stage(int kb, uint8_t *a, uint8_t *b, uint64_t *bar) {
        if (second)
            g2.stage(kb, a, b, bar);
        else
            g1.stage(kb, a, b, bar);
    }
};

/* Epilogue: gemm1's or gemm2's, through one handoff of the buffers; after a gemm1 tile's
 * rows are out, its block's act_ready count goes up. */
template <class Cfg>
struct FusedFwdEpilogue {
    const FusedFwdArgs &args;
    Gemm1Epilogue<Cfg> g1;
    ScatterRowsEpilogue<Cfg> g2;
    Ring<Cfg> ring;
    StoreHandoff handoff;

    __device__ __forceinline__ int n1() const { return gemm1_n_blocks<Cfg::BN>(args); }
    /* Consumers, before a gemm2 tile's K loop: its rows' weights. With expert parallelism
     * they are pushed with the rows, maybe still on their way (nothing else orders this
     * read after the producer's wait_act): wait for the block here too. */
    __device__ __forceinline__ void prepare(int m_block, int n_block) {
        if (n_block < n1()) return;
        if (args.g2.to.row_weight) wait_act_ready<Cfg::BN>(args, m_block);
        g2.prepare(m_block, n_block - n1());
    }
    __device__ __forceinline__ void operator()(int, int n_block, float (&acc)[Cfg::kAccRegs],
                                               uint8_t *buf) {
        handoff.stage(ring, buf, [&](uint8_t *b) {
            if (n_block < n1())
                g1.write_rows(acc, b);
            else
                g2.write_rows(acc, b);
        });
    }
    __device__ __forceinline__ void drain(int m_block, int n_block, int wg, const uint8_t *buf) {
        if (n_block >= n1()) {
            g2.drain(m_block, n_block - n1(), wg, buf);
            return;
        }
        g1.drain(m_block, n_block, wg, buf);
        if (wg != kConsumerWarpgroups - 1) return;
        /* Both halves stored: every store-warp thread's stores, then one release. */
        ptx::named_barrier_sync(kActReadyBarrier, kStoreThreads);
        if (threadIdx.x == kFirstStoreWarp * 32) {
            __threadfence();
            ptx::red_release_gpu_add(args.act_ready + m_block, 1u);
        }
    }
};

template <class Cfg>
__global__ void __launch_bounds__(kThreads, 1)
    sm90_moe_fused_fwd_bf16_kernel(const __grid_constant__ FusedFwdArgs args) {
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    const Ring<Cfg> ring = ring_from_smem<Cfg>(smem_raw);
    FusedFwdLoad<Cfg> load{args, {args.g1, 0, 0, 0, false}, {args.g2, 0, 0}, false};
    FusedFwdEpilogue<Cfg> epi{args, {args.g1, ring, {}}, {args.g2.to, ring, {}, {0.f, 0.f}},
                              ring, {}};
    TileQueue *queue = reinterpret_cast<TileQueue *>(ring.extra);
    static_assert(sizeof(TileQueue) <= Cfg::kExtraBytes, "the tile queue fits the extra region");
    if (threadIdx.x == kConsumerWarpgroups * 128) tile_queue_init(queue);
    const FusedFwdScheduler<Cfg::BN> sched(args, queue);
    run_grouped_gemm_sched<Cfg>(smem_raw, &args.g1.map_xs, &args.g1.w13.map_gate, sched, load, epi);
}

}  // namespace

extern "C" int mf_sm90_moe_fused_fwd_takes(int hidden, int intermediate) {
    return hidden > 0 && intermediate > 0 && hidden % FusedCfg::BN == 0 &&
           intermediate % (FusedCfg::BN / 2) == 0;
}

extern "C" cudaError_t mf_sm90_moe_fused_fwd_bf16(const mf_moe_fused_fwd_params *p,
                                                  cudaStream_t stream) {
    if (!p || !p->act_ready) return cudaErrorInvalidValue;
    const mf_gemm1_params *a = &p->gemm1;
    const mf_gemm2_params *b = &p->gemm2;
    using P = FusedCfg::Precision;
    if (!gemm1_params_ok<P>(a) || !gemm2_params_ok<P>(b) ||
        !mf_sm90_moe_fused_fwd_takes(a->hidden, a->intermediate))
        return cudaErrorInvalidValue;
    const mf_rows &ra = a->rows, &rb = b->rows;
    if (a->act != b->act.data || ra.row_block_expert != rb.row_block_expert ||
        ra.num_rows != rb.num_rows || ra.rows_cap != rb.rows_cap || a->hidden != b->hidden ||
        a->intermediate != b->intermediate || ra.num_local_experts != rb.num_local_experts ||
        a->num_sms != b->num_sms)
        return cudaErrorInvalidValue;
    if (ra.rows_cap == 0) return cudaSuccess;

    FusedFwdArgs args;
    cudaError_t err;
    if ((err = gemm1_args_from<FusedCfg>(a, &args.g1)) != cudaSuccess) return err;
    if ((err = gemm2_args_from<FusedCfg>(b, &args.g2)) != cudaSuccess) return err;
    const int blocks = ra.rows_cap / kBlockM;
    args.act_ready = p->act_ready;
    args.tile_counter = reinterpret_cast<int *>(p->act_ready + blocks);
    /* G: about two waves of gemm1 tiles per group. */
    const int n1 = 2 * a->intermediate / FusedCfg::BN;
    args.group_blocks = (2 * a->num_sms + n1 - 1) / n1;
    if ((err = cudaMemsetAsync(p->act_ready, 0, (size_t)(blocks + 1) * 4, stream)) != cudaSuccess)
        return err;
    return launch_persistent(sm90_moe_fused_fwd_bf16_kernel<FusedCfg>, FusedCfg::kSmemBytes,
                             a->num_sms, args, stream);
}

extern "C" cudaError_t mf_sm90_moe_fused_fwd_load(void) { return mf_load_kernels(sm90_moe_fused_fwd_bf16_kernel<FusedCfg>); }
