/* The CUDA backend's buffer sizes from a config: the receive capacity, the rows of the
 * expert-sorted buffers, the saved layout, the windows and scratch of a comm's pool and
 * the layer's own workspaces. src/cuda/pipeline/workspace.cu and transport/peers.cu
 * allocate exactly these; moefuse_layer_memory and moefuse_memory_estimate report them.
 * Pure arithmetic, no GPU: the CPU tests check it and bench/ep_memory.py tabulates it.
 * The buffers themselves are described in workspace.cu (layout, workspaces) and
 * internal.h (MF_WIN_*, MF_POOL_*). */
#include "internal.h"

#include <math.h>
#include <string.h>

#include "../cuda/transport/ep_sync.h"

static size_t align256(size_t n) { return (n + 255) & ~(size_t)255; }

int64_t mf_recv_capacity(const moefuse_config *c, int peers, int num_tokens) {
    const int64_t K = c->top_k;
    if (!peers) return (int64_t)num_tokens * K;
    const int64_t balanced = (int64_t)c->max_tokens * K;
    const int64_t worst = balanced * c->num_ranks;
    const double f = c->recv_capacity_factor > 0 ? c->recv_capacity_factor
                                                 : MF_RECV_CAPACITY_DEFAULT;
    if (f >= c->num_ranks) return worst;
    const int64_t rows = (int64_t)ceil(f * (double)balanced);
    return rows < worst ? rows : worst;
}

int mf_padded_rows(int64_t slots, int experts) {
    /* each non-empty expert adds at most MF_ROWS_BLOCK - 1 rows of padding */
    const int64_t padded = slots < experts ? slots : experts;
    const int64_t rows = slots + (int64_t)(MF_ROWS_BLOCK - 1) * padded;
    return (int)((rows + MF_ROWS_BLOCK - 1) / MF_ROWS_BLOCK * MF_ROWS_BLOCK);
}

mf_saved_layout mf_saved_layout_of(const moefuse_config *c, int peers, int num_tokens,
                                   moefuse_saved_mode mode) {
    const int EL = c->num_experts / c->num_ranks;
    mf_saved_layout s;
    s.rows_cap = mf_padded_rows(mf_recv_capacity(c, peers, num_tokens), EL);
    size_t at = 0;
    s.header = at;           at += align256(16 * sizeof(int32_t));  /* MF_SAVED_HEADER_WORDS */
    s.counts = at;           at += align256((size_t)EL * sizeof(int32_t));
    s.offsets = at;          at += align256((size_t)(EL + 1) * sizeof(int32_t));
    s.row_block_expert = at; at += align256((size_t)(s.rows_cap / MF_ROWS_BLOCK) * sizeof(int32_t));
    s.slot_row = at;         at += align256((size_t)num_tokens * c->top_k * sizeof(int32_t));
    s.row_slot = at;
    if (!peers) at += align256((size_t)s.rows_cap * sizeof(int32_t));
    s.gate_up = at;
    if (mode != MOEFUSE_RECOMPUTE)
        at += align256((size_t)s.rows_cap * 2 * c->intermediate * sizeof(uint16_t));
    s.xs = at;
    if (mode == MOEFUSE_SAVE_ACTIVATIONS_AND_INPUTS)
        at += align256((size_t)s.rows_cap * c->hidden * sizeof(uint16_t));
    s.total = at;
    return s;
}

mf_sizes mf_sizes_of(const moefuse_config *c, int peers, mf_tiles tiles) {
    mf_sizes z;
    memset(&z, 0, sizeof z);
    const int64_t T = c->max_tokens, K = c->top_k, H = c->hidden, I = c->intermediate;
    const int E = c->num_experts, R = c->num_ranks, EL = E / R;
    z.peers = peers;
    z.recv_capacity = mf_recv_capacity(c, peers, c->max_tokens);
    z.rows_cap = mf_padded_rows(z.recv_capacity, EL);
    const int64_t rows = z.rows_cap;

    size_t *b = z.rows_bufs;
    /* FP8 on one GPU reads no bf16 x rows: the forward's dispatch writes x's codes, the
     * backward's quantizers gather x (src/cuda/pipeline/operands.cu) */
    const int fp8_local = c->precision == MOEFUSE_PRECISION_FP8_BLOCK && !peers;
    b[MF_WIN_XS] = fp8_local ? 0 : (size_t)(rows * H * 2);
    b[MF_WIN_ROW_WEIGHT] = (size_t)(rows * 4);
    if (peers) {
        b[MF_WIN_DYS] = (size_t)(rows * H * 2);
        b[MF_WIN_ROW_SLOT] = (size_t)(rows * 4);
        b[MF_WIN_COMBINE] = (size_t)(T * K * H * 2);  /* this rank's slot rows */
        b[MF_WIN_DP] = (size_t)(T * K * 4);
        b[MF_WIN_SYNC] = mf_ep_sync_bytes(R, E, (int)(rows / MF_ROWS_BLOCK));
    } else {
        /* rows_cap >= T*K rows: also the backward's dys (workspace.cu says why) */
        b[MF_WIN_COMBINE] = (size_t)(rows * H * 2);
    }
    b[MF_POOL_ACT] = (size_t)(rows * I * 2);
    b[MF_POOL_DH] = (size_t)(rows * 2 * I * 2);
    b[MF_POOL_DP_PARTIAL] = (size_t)(rows * tiles.dp_parts * 4);
    if (c->saved_mode == MOEFUSE_RECOMPUTE) b[MF_POOL_GATE_UP] = (size_t)(rows * 2 * I * 2);

    const int plan_experts = peers ? E : EL;
    const int64_t chunks = (T + tiles.chunk_tokens - 1) / tiles.chunk_tokens;
    z.slot_rank = (size_t)(T * K * 4);
    z.chunk_base = (size_t)((chunks > 0 ? chunks : 1) * plan_experts * 4);
    z.plan_state = tiles.plan_state_bytes;
    z.gemm_num_rows = sizeof(int32_t);
    z.plan_ws = mf_saved_layout_of(c, peers, c->max_tokens, MOEFUSE_RECOMPUTE).total;
    /* the fused kernels' scratch; allocated with either fused direction (a layer asking
     * for MOEFUSE_PIPELINE_FUSED on a shape they do not take keeps these bytes unused) */
    if (c->pipeline == MOEFUSE_PIPELINE_FUSED) z.act_ready = (size_t)((rows / MF_ROWS_BLOCK + 1) * 4);
    z.bwd_offsets = (size_t)(EL + 1) * 4;
    z.expert_order = (size_t)(EL + 1) * 4;
    if (peers) {
        z.send_rows_cap = mf_padded_rows(T * K, E);
        z.send_counts = (size_t)E * 4;
        z.send_offsets = (size_t)(E + 1) * 4;
        z.send_rbe = (size_t)(z.send_rows_cap / MF_ROWS_BLOCK) * 4;
        z.send_slot_row = (size_t)(T * K * 4);
        z.send_row_slot = (size_t)z.send_rows_cap * 4;
        z.send_scalars = 2 * 4;
        z.dest_base = (size_t)E * 4;
    }
    if (c->precision == MOEFUSE_PRECISION_FP8_BLOCK) {
        const int64_t row_cols = H > 2 * I ? H : 2 * I;   /* x, dy; a, [dg; du] */
        const int64_t lhs_cols = row_cols;                /* p dy, [dg; du] */
        const int64_t rhs_cols = H > I ? H : I;           /* a, x */
        const int64_t scale_ld = (rows + 3) / 4 * 4;      /* 16-byte TMA rows of scales */
        z.fp8_rows = (size_t)(rows * row_cols);
        z.fp8_row_scales = (size_t)(row_cols / 128 * scale_ld * 4);
        z.fp8_lhs_t = (size_t)(rows * lhs_cols);
        z.fp8_lhs_scales = (size_t)(rows / 128 * lhs_cols * 4);
        z.fp8_rhs_t = (size_t)(rows * rhs_cols);
        z.fp8_rhs_scales = (size_t)(rows / 128 * rhs_cols * 4);
        if (peers) b[MF_POOL_FP8] = mf_fp8_offsets(&z, (size_t[MF_FP8_ARRAYS]){0});
    }
    z.saved = mf_saved_layout_of(c, peers, c->max_tokens, c->saved_mode).total;
    return z;
}

size_t mf_sizes_sum(const size_t *bytes, int from, int to) {
    size_t n = 0;
    for (int i = from; i < to; i++) n += bytes[i];
    return n;
}

size_t mf_fp8_offsets(const mf_sizes *z, size_t offsets[MF_FP8_ARRAYS]) {
    const size_t bytes[MF_FP8_ARRAYS] = {z->fp8_rows, z->fp8_row_scales, z->fp8_lhs_t,
                                         z->fp8_lhs_scales, z->fp8_rhs_t, z->fp8_rhs_scales};
    size_t at = 0;
    for (int i = 0; i < MF_FP8_ARRAYS; i++) {
        offsets[i] = at;
        at += (bytes[i] + 255) / 256 * 256;
    }
    return bytes[0] ? at : 0;
}

size_t mf_sizes_own(const mf_sizes *s) {
    const size_t own[] = {s->slot_rank, s->chunk_base, s->plan_state, s->gemm_num_rows,
                          s->plan_ws, s->act_ready, s->bwd_offsets, s->expert_order,
                          s->send_counts, s->send_offsets, s->send_rbe, s->send_slot_row,
                          s->send_row_slot, s->send_scalars, s->dest_base};
    const size_t fp8[] = {s->fp8_rows, s->fp8_lhs_t, s->fp8_rhs_t, s->fp8_row_scales,
                          s->fp8_lhs_scales, s->fp8_rhs_scales};
    size_t n = mf_sizes_sum(own, 0, (int)(sizeof own / sizeof own[0]));
    if (!s->peers) {   /* with a comm these are the pool's (MF_POOL_*) */
        n += mf_sizes_sum(s->rows_bufs, 0, MF_POOL_COUNT);
        n += mf_sizes_sum(fp8, 0, (int)(sizeof fp8 / sizeof fp8[0]));
    }
    return n;
}
