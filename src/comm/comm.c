/* The comm of expert parallelism: how many layers each rank has on it and each rank's
 * pool of shared buffers (internal.h, mf_pool). Bookkeeping on the host; the CUDA
 * backend allocates the pools and builds the device peer tables
 * (src/cuda/transport/ep_pool.cu) and the kernels do the transport. */
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

int mf_comm_num_layers(const moefuse_comm *comm) {
    int n = 0;
    for (int r = 0; r < comm->num_ranks; r++) n += comm->pools[r].num_layers;
    return n;
}

moefuse_status moefuse_comm_destroy(moefuse_comm *comm) {
    mf_clear_error();
    if (!comm) return MOEFUSE_OK;
    for (int r = 0; r < comm->num_ranks; r++)
        if (comm->pools[r].num_layers != 0)
            return mf_fail(MOEFUSE_ERR_INVALID_CONFIG,
                           "moefuse_comm_destroy: rank %d still has %d layers on the comm; "
                           "expected every layer of the comm destroyed first",
                           r, comm->pools[r].num_layers);
#ifdef MOEFUSE_HAVE_NCCL
    if (comm->kind == MF_COMM_NCCL) mf_nccl_comm_release(comm);
#endif
    free(comm);
    return MOEFUSE_OK;
}

moefuse_status mf_comm_check_ready(const moefuse_comm *comm, const moefuse_layer *layer,
                                   const char *call) {
    /* NCCL: the other ranks' layers are theirs; their creation was collective with ours */
    if (comm->kind == MF_COMM_NCCL) return MOEFUSE_OK;
    for (int r = 0; r < comm->num_ranks; r++) {
        const mf_pool *p = &comm->pools[r];
        if (p->num_layers == 0)
            return mf_fail(MOEFUSE_ERR_INVALID_CONFIG,
                           "%s: rank %d of the comm has no layer; expected every rank's layer "
                           "created (moefuse_layer_create with config.rank = %d) before a call",
                           call, r, r);
        for (int w = 0; w < MF_WIN_COUNT; w++)
            if (p->bytes[w] < layer->pool_need[w])
                return mf_fail(MOEFUSE_ERR_INVALID_CONFIG,
                               "%s: rank %d's windows on the comm hold %zu bytes (window %d), "
                               "this layer needs %zu; expected every rank's layers created "
                               "with the same configs in the same order before a call",
                               call, r, p->bytes[w], w, layer->pool_need[w]);
    }
    return MOEFUSE_OK;
}
