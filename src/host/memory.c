/* The memory report: moefuse_layer_memory of a created layer (its backend fills it) and
 * moefuse_memory_estimate of a config, both from the sizes of src/host/sizing.c, so a
 * trainer can plan without a GPU. */
#include "internal.h"

#include <stddef.h>
#include <string.h>

#define TRY(expr)                                                                        \
    do {                                                                                 \
        moefuse_status st_ = (expr);                                                     \
        if (st_ != MOEFUSE_OK) return st_;                                               \
    } while (0)

/* The caller's struct_size checked; full gets the library's version. */
static moefuse_status memory_begin(moefuse_memory *out, moefuse_memory *full) {
    if (!out) return mf_fail(MOEFUSE_ERR_NULL_POINTER, "out: expected a moefuse_memory *");
    const size_t least = offsetof(moefuse_memory, saved_bytes) + sizeof out->saved_bytes;
    if (out->struct_size < least)
        return mf_fail(MOEFUSE_ERR_SHAPE,
                       "out->struct_size = %zu: expected sizeof(moefuse_memory) (%zu in version "
                       "%d); set it before the call", out->struct_size, least,
                       MOEFUSE_MEMORY_VERSION);
    memset(full, 0, sizeof *full);
    full->struct_size = out->struct_size;
    full->version = MOEFUSE_MEMORY_VERSION;
    return MOEFUSE_OK;
}

/* The fields of this version that fit in the caller's struct. */
static void memory_end(const moefuse_memory *full, moefuse_memory *out) {
    const size_t n = out->struct_size < sizeof *full ? out->struct_size : sizeof *full;
    memcpy(out, full, n);
}

void mf_memory_from_sizes(const mf_sizes *z, const size_t *pool, int shared_layers,
                          moefuse_memory *m) {
    m->recv_capacity_rows = z->recv_capacity;
    m->rows_cap = z->rows_cap;
    m->shared_layers = z->peers ? shared_layers : 0;
    if (z->peers) {
        m->comm_window_bytes = mf_sizes_sum(pool, 0, MF_WIN_COUNT);
        m->comm_scratch_bytes = mf_sizes_sum(pool, MF_WIN_COUNT, MF_POOL_COUNT);
        m->layer_window_bytes = mf_sizes_sum(z->rows_bufs, 0, MF_WIN_COUNT);
        m->layer_scratch_bytes = mf_sizes_sum(z->rows_bufs, MF_WIN_COUNT, MF_POOL_COUNT);
    }
    m->workspace_bytes = mf_sizes_own(z);
    m->saved_bytes = z->saved;
}

moefuse_status moefuse_layer_memory(const moefuse_layer *layer, moefuse_memory *out) {
    mf_clear_error();
    if (!layer) return mf_fail(MOEFUSE_ERR_NULL_POINTER, "layer: expected a layer");
    moefuse_memory m;
    TRY(memory_begin(out, &m));
    m.recv_capacity_rows = (int64_t)layer->cfg.max_tokens * layer->cfg.top_k;
    if (layer->ops->memory) layer->ops->memory(layer, &m);
    else m.saved_bytes = layer->ops->saved_bytes(layer, layer->cfg.max_tokens);
    memory_end(&m, out);
    return MOEFUSE_OK;
}

moefuse_status moefuse_memory_estimate(const moefuse_config *cfg, int with_comm,
                                       moefuse_memory *out) {
    mf_clear_error();
    if (!cfg) return mf_fail(MOEFUSE_ERR_NULL_POINTER, "cfg: expected a moefuse_config *");
    moefuse_memory m;
    TRY(memory_begin(out, &m));
    TRY(mf_check_config_fields(cfg));
    if (cfg->backend != MOEFUSE_BACKEND_CUDA)
        return mf_fail(MOEFUSE_ERR_INVALID_CONFIG,
                       "config.backend = %d: expected MOEFUSE_BACKEND_CUDA (the estimate is "
                       "of the CUDA backend's buffers)", (int)cfg->backend);
    if (with_comm != 0 && with_comm != 1)
        return mf_fail(MOEFUSE_ERR_INVALID_CONFIG, "with_comm = %d: expected 0 or 1", with_comm);
    if (!with_comm && cfg->num_ranks != 1)
        return mf_fail(MOEFUSE_ERR_INVALID_CONFIG,
                       "config.num_ranks = %d with with_comm = 0: expected 1 (more ranks need "
                       "a comm)", cfg->num_ranks);
    if (with_comm && cfg->saved_mode == MOEFUSE_SAVE_ACTIVATIONS_AND_INPUTS)
        return mf_fail(MOEFUSE_ERR_UNSUPPORTED,
                       "config.saved_mode = MOEFUSE_SAVE_ACTIVATIONS_AND_INPUTS with a comm: "
                       "refused at create; expected MOEFUSE_SAVE_ACTIVATIONS or "
                       "MOEFUSE_RECOMPUTE");
    const mf_sizes z = mf_sizes_of(cfg, with_comm, mf_cuda_tiles(cfg->top_k, cfg->intermediate,
                                                                   cfg->precision));
    mf_memory_from_sizes(&z, z.rows_bufs, 1, &m);
    memory_end(&m, out);
    return MOEFUSE_OK;
}
