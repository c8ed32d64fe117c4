/* A rank's pool on a comm (internal.h, mf_pool): the windows its peers write into and
 * the per-call scratch sized by the receive capacity, shared by the rank's layers.
 *
 * Why shared: a model's MoE layers run one after another on a rank's stream, and no call
 * reads what an earlier call left in them (a backward gets its forward's plan and
 * activations from the caller's saved buffer and is sent its rows again), so one set
 * serves all; per-layer windows cost 48-94 times as much (the arithmetic:
 * docs/decisions/0022-shared-windows-and-receive-capacity).
 *
 * Create, in two steps so that no rank of an NCCL comm waits in a collective for a rank
 * that failed:
 *   pool_prepare  local: every buffer this layer needs larger than the pool holds is
 *                 allocated into the layer's state (windows zeroed: no peer writes into
 *                 one before its registration, and a new sync window starts at epoch 0);
 *   (the ranks agree that every create got this far: transport/peers.cu, connect)
 *   pool_join     the new buffers replace the pool's (NCCL: old windows deregistered,
 *                 new ones registered, collectively: every rank makes the same
 *                 replacements in the same order, as it creates the same layers in the
 *                 same order), the layer is counted, and the peer tables are rewritten
 *                 where a window changed. Virtual ranks: every rank's table, and every
 *                 rank's sync window zeroed, so all ranks restart at epoch 0 together.
 * Nothing of the comm is in flight meanwhile (moefuse.h). The pool never shrinks while
 * a layer uses it; the rank's last layer frees it (NCCL: a collective deregistration,
 * every rank destroying its layers in the same order). */
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "check.h"
#include "pipeline/state.h"
#include "transport/ep_sync.h"

namespace mf {
namespace pipeline {

namespace {

const char *const kPoolNames[MF_POOL_COUNT] = {
    "the x rows window", "the dy rows window", "the row sources window",
    "the row weights window", "the combine window", "the d p window", "the sync window",
    "the act scratch", "the dh scratch", "the d p partials scratch", "the gate_up scratch",
    "the FP8 operands scratch",
};

bool nccl_window(const moefuse_comm *comm, int i) {
    return comm->kind == MF_COMM_NCCL && i < MF_WIN_COUNT;
}

void free_buffer(moefuse_comm *comm, int i, void *ptr, void *handle) {
    if (!ptr) return;
#ifdef MOEFUSE_HAVE_NCCL
    if (nccl_window(comm, i)) {
        mf_nccl_window_free(comm, ptr, handle);
        return;
    }
#else
    (void)handle;
    (void)i;
    (void)comm;
#endif
    cudaFree(ptr);
}

/* Virtual ranks: every rank's table of every rank's windows (NULL for a rank with no
 * pool: calls are refused until it has one) and every rank's sync window zeroed. */
moefuse_status refresh_virtual_tables(moefuse_comm *comm) {
    const int R = comm->num_ranks;
    void *table[MF_WIN_COUNT * MF_MAX_RANKS];
    for (int w = 0; w < MF_WIN_COUNT; w++)
        for (int q = 0; q < R; q++) table[w * R + q] = comm->pools[q].buf[w];
    MF_CUDA_TRY(cudaDeviceSynchronize());
    for (int q = 0; q < R; q++) {
        const mf_pool &p = comm->pools[q];
        if (!p.peer_table) continue;
        MF_CUDA_TRY(cudaMemcpy(p.peer_table, table, sizeof(void *) * MF_WIN_COUNT * R,
                               cudaMemcpyHostToDevice));
        if (p.buf[MF_WIN_SYNC]) MF_CUDA_TRY(cudaMemset(p.buf[MF_WIN_SYNC], 0, p.bytes[MF_WIN_SYNC]));
    }
    MF_CUDA_TRY(cudaDeviceSynchronize());
    return MOEFUSE_OK;
}

}  // namespace

moefuse_status pool_prepare(moefuse_layer *layer, cuda_state *s) {
    moefuse_comm *comm = layer->comm;
    const mf_pool &p = comm->pools[layer->cfg.rank];
    memcpy(layer->pool_need, s->sizes.rows_bufs, sizeof layer->pool_need);
    for (int i = 0; i < MF_POOL_COUNT; i++) {
        const size_t need = layer->pool_need[i];
        if (need <= p.bytes[i]) continue;
#ifdef MOEFUSE_HAVE_NCCL
        if (nccl_window(comm, i)) {
            MF_TRY(mf_nccl_window_alloc(comm, need, &s->grow[i]));
            continue;
        }
#endif
        MF_TRY(alloc(&s->grow[i], need, kPoolNames[i]));
        if (i < MF_WIN_COUNT) MF_CUDA_TRY(cudaMemset(s->grow[i], 0, need));
    }
    if (!p.peer_table)
        MF_TRY(alloc(&s->grow_table, sizeof(void *) * MF_WIN_COUNT * comm->num_ranks,
                     "the peer table"));
    return MOEFUSE_OK;
}

moefuse_status pool_join(moefuse_layer *layer, cuda_state *s) {
    moefuse_comm *comm = layer->comm;
    mf_pool &p = comm->pools[layer->cfg.rank];
    p.num_layers++;  // counted first: pool_leave undoes a join that fails halfway
    s->joined = true;
    comm->num_experts = layer->cfg.num_experts;
    bool windows_changed = false;
    if (s->grow_table) {
        p.peer_table = s->grow_table;
        s->grow_table = NULL;
        windows_changed = true;
    }
    // MF_CUDA_TRY: the device is idle (cudaFree waits for it anyway)
    for (int i = 0; i < MF_POOL_COUNT; i++) {
        if (!s->grow[i]) continue;
        free_buffer(comm, i, p.buf[i], i < MF_WIN_COUNT ? p.win_handle[i] : NULL);
        p.buf[i] = s->grow[i];
        p.bytes[i] = layer->pool_need[i];
        s->grow[i] = NULL;
        if (i >= MF_WIN_COUNT) continue;
        p.win_handle[i] = NULL;
        windows_changed = true;
#ifdef MOEFUSE_HAVE_NCCL
        if (nccl_window(comm, i))
            MF_TRY(mf_nccl_window_register(comm, p.buf[i], p.bytes[i], &p.win_handle[i]));
#endif
    }
    if (!windows_changed) return MOEFUSE_OK;
#ifdef MOEFUSE_HAVE_NCCL
    if (comm->kind == MF_COMM_NCCL)
        return mf_nccl_peer_table(comm, p.win_handle, (void **)p.peer_table);
#endif
    return refresh_virtual_tables(comm);
}

void pool_leave(moefuse_layer *layer, cuda_state *s) {
    moefuse_comm *comm = layer->comm;
    for (int i = 0; i < MF_POOL_COUNT; i++) {
        free_buffer(comm, i, s->grow[i], NULL);
        s->grow[i] = NULL;
    }
    if (s->grow_table) cudaFree(s->grow_table);
    s->grow_table = NULL;
    if (!s->joined) return;
    s->joined = false;
    mf_pool &p = comm->pools[layer->cfg.rank];
    if (--p.num_layers > 0) return;
    for (int i = 0; i < MF_POOL_COUNT; i++)
        free_buffer(comm, i, p.buf[i], i < MF_WIN_COUNT ? p.win_handle[i] : NULL);
    if (p.peer_table) cudaFree(p.peer_table);
    memset(&p, 0, sizeof p);
}

void pool_bind(const moefuse_layer *layer, cuda_state *s) {
    const mf_pool &p = layer->comm->pools[layer->cfg.rank];
    s->xs = (uint16_t *)p.buf[MF_WIN_XS];
    s->dys = (uint16_t *)p.buf[MF_WIN_DYS];
    s->row_slot = (int32_t *)p.buf[MF_WIN_ROW_SLOT];
    s->row_weight = (float *)p.buf[MF_WIN_ROW_WEIGHT];
    s->combine = (uint16_t *)p.buf[MF_WIN_COMBINE];
    s->dp_slot = (float *)p.buf[MF_WIN_DP];
    s->sync = (uint32_t *)p.buf[MF_WIN_SYNC];
    // the sync window holds arrivals and targets of (bytes / 4 - arrivals_word) / 2 blocks
    const int R = layer->comm->num_ranks, E = layer->cfg.num_experts;
    const size_t at = mf_ep_arrivals_word(R, E);
    const int blocks = (int)((p.bytes[MF_WIN_SYNC] / sizeof(uint32_t) - at) / 2);
    s->targets = s->sync ? s->sync + mf_ep_targets_word(R, E, blocks) : NULL;
    s->peers = (void **)p.peer_table;
    s->act = (uint16_t *)p.buf[MF_POOL_ACT];
    s->dh = (uint16_t *)p.buf[MF_POOL_DH];
    s->dp_partial = (float *)p.buf[MF_POOL_DP_PARTIAL];
    s->gate_up = (uint16_t *)p.buf[MF_POOL_GATE_UP];
    // FP8: this layer's six operand arrays, laid out in the pool's scratch by its sizes
    uint8_t *fp8 = (uint8_t *)p.buf[MF_POOL_FP8];
    size_t off[MF_FP8_ARRAYS];
    if (!fp8 || !mf_fp8_offsets(&s->sizes, off)) return;
    s->fp8_rows = fp8 + off[0];
    s->fp8_row_scales = (float *)(fp8 + off[1]);
    s->fp8_lhs_t = fp8 + off[2];
    s->fp8_lhs_scales = (float *)(fp8 + off[3]);
    s->fp8_rhs_t = fp8 + off[4];
    s->fp8_rhs_scales = (float *)(fp8 + off[5]);
}

}  // namespace pipeline
}  // namespace mf
