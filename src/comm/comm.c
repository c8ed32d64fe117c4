/* The comm of expert parallelism: which ranks' layers exist and where their windows
 * are. Pure bookkeeping on the host; the CUDA backend builds the device peer tables
 * from it (src/cuda/transport/peers.cu) and the kernels do the transport. */
#include "internal.h"

#include <stdlib.h>
#include <string.h>

#ifdef MOEFUSE_HAVE_CUDA
#include <cuda_runtime.h>
#endif

/* Virtual ranks run the CUDA backend's kernels on the current GPU: without an sm_90
 * one the comm could make no layer, so it is refused here, as layer creation does. */
static moefuse_status need_sm90_gpu(void) {
#ifdef MOEFUSE_HAVE_CUDA
    int count = 0, device = 0, major = 0, minor = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
        cudaGetLastError();
        return mf_fail(MOEFUSE_ERR_UNSUPPORTED,
                       "moefuse_comm_create_virtual: no CUDA device is usable (%s); virtual "
                       "ranks run the CUDA backend, expected an sm_90 GPU (H100/H200)",
                       err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
    }
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
        cudaGetLastError();
        return mf_fail(MOEFUSE_ERR_UNSUPPORTED,
                       "moefuse_comm_create_virtual: the current CUDA device cannot be queried; "
                       "expected an sm_90 GPU (H100/H200)");
    }
    if (major != 9 || minor != 0)
        return mf_fail(MOEFUSE_ERR_UNSUPPORTED,
                       "moefuse_comm_create_virtual: device %d has compute capability %d.%d; "
                       "virtual ranks run the sm_90a kernels, expected 9.0 (H100/H200)",
                       device, major, minor);
    return MOEFUSE_OK;
#else
    return mf_fail(MOEFUSE_ERR_UNSUPPORTED,
                   "moefuse_comm_create_virtual: this library was built without nvcc; virtual "
                   "ranks run the CUDA backend");
#endif
}

moefuse_status moefuse_comm_create_virtual(int num_ranks, moefuse_comm **out) {
    mf_clear_error();
    if (!out) return mf_fail(MOEFUSE_ERR_NULL_POINTER, "out: expected a moefuse_comm **");
    *out = NULL;
    if (num_ranks < 1 || num_ranks > MF_MAX_RANKS)
        return mf_fail(MOEFUSE_ERR_INVALID_CONFIG, "num_ranks = %d: expected 1 <= num_ranks <= %d",
                       num_ranks, MF_MAX_RANKS);
    moefuse_status st = need_sm90_gpu();
    if (st != MOEFUSE_OK) return st;
    moefuse_comm *c = calloc(1, sizeof *c);
    if (!c) return mf_fail(MOEFUSE_ERR_NO_MEMORY, "moefuse_comm_create_virtual: out of host memory");
    c->kind = MF_COMM_VIRTUAL;
    c->num_ranks = num_ranks;
    c->timeout_ms = 30000;
    *out = c;
    return MOEFUSE_OK;
}

#ifndef MOEFUSE_HAVE_NCCL
moefuse_status moefuse_comm_create_nccl(void *nccl_comm, moefuse_comm **out) {
    (void)nccl_comm;
    mf_clear_error();
    if (out) *out = NULL;
    return mf_fail(MOEFUSE_ERR_UNSUPPORTED,
                   "moefuse_comm_create_nccl: this library was built without NCCL (no "
                   "nccl_device.h and libnccl under NCCL_HOME); expected a build with NCCL >= "
                   "2.28, or moefuse_comm_create_virtual");
}
#endif

moefuse_status moefuse_comm_set_timeout_ms(moefuse_comm *comm, int timeout_ms) {
    mf_clear_error();
    if (!comm) return mf_fail(MOEFUSE_ERR_NULL_POINTER, "comm: expected a moefuse_comm");
    if (timeout_ms < 1)
        return mf_fail(MOEFUSE_ERR_INVALID_CONFIG, "timeout_ms = %d: expected >= 1", timeout_ms);
    comm->timeout_ms = timeout_ms;
    return MOEFUSE_OK;
}

moefuse_status moefuse_comm_destroy(moefuse_comm *comm) {
    mf_clear_error();
    if (!comm) return MOEFUSE_OK;
    if (comm->num_attached != 0) {
        for (int r = 0; r < comm->num_ranks; r++)
            if (comm->layers[r])
                return mf_fail(MOEFUSE_ERR_INVALID_CONFIG,
                               "moefuse_comm_destroy: rank %d's layer still exists; expected "
                               "every layer of the comm destroyed first", r);
        return mf_fail(MOEFUSE_ERR_INVALID_CONFIG,
                       "moefuse_comm_destroy: %d layers of the comm still exist; expected "
                       "every layer of the comm destroyed first", comm->num_attached);
    }
#ifdef MOEFUSE_HAVE_NCCL
    if (comm->kind == MF_COMM_NCCL) mf_nccl_comm_release(comm);
#endif
    free(comm);
    return MOEFUSE_OK;
}

/* Virtual ranks: one layer per rank, whose windows the peer tables are made of. NCCL:
 * any number of layers (the peers' windows come from NCCL), counted. */
moefuse_status mf_comm_attach(moefuse_comm *comm, int rank, moefuse_layer *layer,
                              void *const windows[MF_WIN_COUNT], size_t sync_bytes,
                              void *peer_table) {
    if (comm->kind == MF_COMM_NCCL) {
        comm->num_attached++;
        return MOEFUSE_OK;
    }
    if (comm->layers[rank])
        return mf_fail(MOEFUSE_ERR_INVALID_CONFIG,
                       "config.rank = %d: this comm already has a layer for rank %d; expected "
                       "one layer per rank (destroy the old one first)", rank, rank);
    comm->layers[rank] = layer;
    memcpy(comm->windows[rank], windows, sizeof comm->windows[rank]);
    comm->sync_bytes[rank] = sync_bytes;
    comm->peer_table[rank] = peer_table;
    comm->num_attached++;
    return MOEFUSE_OK;
}

void mf_comm_detach(moefuse_comm *comm, int rank) {
    if (comm->kind == MF_COMM_NCCL) {
        comm->num_attached--;
        return;
    }
    if (!comm->layers[rank]) return;
    comm->layers[rank] = NULL;
    memset(comm->windows[rank], 0, sizeof comm->windows[rank]);
    comm->peer_table[rank] = NULL;
    comm->num_attached--;
}

int mf_comm_complete(const moefuse_comm *comm) {
    return comm->kind == MF_COMM_NCCL || comm->num_attached == comm->num_ranks;
}

moefuse_status mf_comm_check_ready(const moefuse_comm *comm, const char *call) {
    /* NCCL: the other ranks' layers are theirs; their creation was collective with ours */
    if (mf_comm_complete(comm)) return MOEFUSE_OK;
    for (int r = 0; r < comm->num_ranks; r++)
        if (!comm->layers[r])
            return mf_fail(MOEFUSE_ERR_INVALID_CONFIG,
                           "%s: rank %d of the comm has no layer; expected every rank's layer "
                           "created (moefuse_layer_create with config.rank = %d) before a call",
                           call, r, r);
    return MOEFUSE_OK;
}
