/* Expert parallelism over the caller's NCCL communicator (NCCL >= 2.28, device API):
 * the comm's checks, the layer's windows and the table of peer pointers.
 *
 *   moefuse_comm_create_nccl  the runtime libnccl is the one compiled against; NVLS
 *                             is off; one GPU per rank (device UUIDs all-gathered
 *                             once); a device communicator (ncclDevCommCreate, no
 *                             multicast asked) whose LSA team, the ranks reachable
 *                             by NVLink load/store, holds every rank.
 *   agreement                 an all-reduce of every rank's create outcome before any
 *                             registration, so one rank's failure fails every rank's
 *                             create instead of leaving them in a collective.
 *   windows                   ncclMemAlloc (zeroed, local, before the agreement) +
 *                             ncclCommWindowRegister (symmetric, collective: every rank's
 *                             layer create makes the same registrations in the same
 *                             order), so no peer can write into a window earlier.
 *   peer table                one kernel: ncclGetPeerPointer of every window for
 *                             every rank, into the layer's device table.
 * Across nodes (no LSA path) the same places would take NCCL GIN puts: planned. */
#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "internal.h"

#define MF_NCCL_TRY(comm, call)                                                          \
    do {                                                                                 \
        ncclResult_t r_ = (call);                                                        \
        if (r_ != ncclSuccess)                                                           \
            return mf_fail(MOEFUSE_ERR_NCCL, "%s:%d: %s: %s (%s)", __FILE__, __LINE__,   \
                           #call, ncclGetErrorString(r_), ncclGetLastError(comm));       \
    } while (0)

namespace {

/* UUID of every rank's GPU; two equal ones mean two ranks on one GPU. */
moefuse_status check_one_gpu_per_rank(ncclComm_t comm, int num_ranks, int device) {
    cudaDeviceProp prop;
    MF_CUDA_TRY(cudaGetDeviceProperties(&prop, device));
    const size_t n = sizeof prop.uuid.bytes;
    unsigned char *buf = NULL;
    cudaStream_t stream = NULL;
    unsigned char *all = (unsigned char *)malloc(n * num_ranks);
    if (!all) return mf_fail(MOEFUSE_ERR_NO_MEMORY, "moefuse_comm_create_nccl: out of host memory");
    moefuse_status st = MOEFUSE_OK;
    ncclResult_t r = ncclSuccess;
    cudaError_t e = cudaMalloc((void **)&buf, n * (num_ranks + 1));
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaMemcpy(buf, prop.uuid.bytes, n, cudaMemcpyHostToDevice);
    if (e == cudaSuccess) r = ncclAllGather(buf, buf + n, n, ncclUint8, comm, stream);
    if (e == cudaSuccess && r == ncclSuccess) e = cudaStreamSynchronize(stream);
    if (e == cudaSuccess && r == ncclSuccess)
        e = cudaMemcpy(all, buf + n, n * num_ranks, cudaMemcpyDeviceToHost);
    if (e != cudaSuccess)
        st = mf_fail(MOEFUSE_ERR_CUDA, "moefuse_comm_create_nccl: gathering the GPUs' UUIDs: %s",
                     cudaGetErrorString(e));
    else if (r != ncclSuccess)
        st = mf_fail(MOEFUSE_ERR_NCCL, "moefuse_comm_create_nccl: ncclAllGather of the GPUs' "
                     "UUIDs: %s (%s)", ncclGetErrorString(r), ncclGetLastError(comm));
    for (int i = 0; st == MOEFUSE_OK && i < num_ranks; i++)
        for (int j = i + 1; st == MOEFUSE_OK && j < num_ranks; j++)
            if (!memcmp(all + i * n, all + j * n, n))
                st = mf_fail(MOEFUSE_ERR_UNSUPPORTED,
                             "moefuse_comm_create_nccl: ranks %d and %d are on the same GPU; "
                             "expected one GPU per rank (for ranks sharing one GPU in tests: "
                             "moefuse_comm_create_virtual)", i, j);
    if (stream) cudaStreamDestroy(stream);
    if (buf) cudaFree(buf);
    free(all);
    return st;
}

struct peer_table_args {
    ncclWindow_t windows[MF_WIN_COUNT];
    int num_ranks;
    void **table;  /* [MF_WIN_COUNT * R] */
};

__global__ void peer_table_kernel(const __grid_constant__ peer_table_args a) {
    for (int i = threadIdx.x; i < MF_WIN_COUNT * a.num_ranks; i += blockDim.x)
        a.table[i] = ncclGetPeerPointer(a.windows[i / a.num_ranks], 0, i % a.num_ranks);
}

}  // namespace

extern "C" moefuse_status moefuse_comm_create_nccl(void *nccl_comm, moefuse_comm **out) {
    mf_clear_error();
    if (!out) return mf_fail(MOEFUSE_ERR_NULL_POINTER, "out: expected a moefuse_comm **");
    *out = NULL;
    if (!nccl_comm)
        return mf_fail(MOEFUSE_ERR_NULL_POINTER, "nccl_comm: expected an ncclComm_t");
    ncclComm_t comm = (ncclComm_t)nccl_comm;
    int version = 0;
    MF_NCCL_TRY(comm, ncclGetVersion(&version));
    if (version != NCCL_VERSION_CODE)
        return mf_fail(MOEFUSE_ERR_NCCL,
                       "moefuse_comm_create_nccl: the loaded libnccl is version %d, moefuse was "
                       "compiled against %d; expected the same (build with NCCL_HOME set to the "
                       "libnccl that is loaded, e.g. PyTorch's nvidia/nccl)",
                       version, NCCL_VERSION_CODE);
    const char *nvls = getenv("NCCL_NVLS_ENABLE");
    if (!nvls || strcmp(nvls, "0") != 0)
        return mf_fail(MOEFUSE_ERR_UNSUPPORTED,
                       "moefuse_comm_create_nccl: NCCL_NVLS_ENABLE is %s: moefuse never uses "
                       "NVLink multicast (NVLS); expected NCCL_NVLS_ENABLE=0 in the environment "
                       "before the communicator is made", nvls ? nvls : "not set");
    int R = 0, rank = 0, device = -1, current = -1;
    MF_NCCL_TRY(comm, ncclCommCount(comm, &R));
    MF_NCCL_TRY(comm, ncclCommUserRank(comm, &rank));
    MF_NCCL_TRY(comm, ncclCommCuDevice(comm, &device));
    MF_CUDA_TRY(cudaGetDevice(&current));
    if (current != device)
        return mf_fail(MOEFUSE_ERR_INVALID_CONFIG,
                       "moefuse_comm_create_nccl: the communicator's rank %d uses device %d, the "
                       "current device is %d; expected cudaSetDevice(%d) first",
                       rank, device, current, device);
    if (R < 1 || R > MF_MAX_RANKS)
        return mf_fail(MOEFUSE_ERR_UNSUPPORTED,
                       "moefuse_comm_create_nccl: %d ranks; expected 1 .. %d", R, MF_MAX_RANKS);
    moefuse_status st = check_one_gpu_per_rank(comm, R, device);
    if (st != MOEFUSE_OK) return st;

    ncclDevComm *dev = (ncclDevComm *)calloc(1, sizeof *dev);
    moefuse_comm *c = (moefuse_comm *)calloc(1, sizeof *c);
    if (!dev || !c) {
        free(dev);
        free(c);
        return mf_fail(MOEFUSE_ERR_NO_MEMORY, "moefuse_comm_create_nccl: out of host memory");
    }
    void *vote = NULL;
    const cudaError_t ve = cudaMalloc(&vote, sizeof(int));
    if (ve != cudaSuccess) {
        cudaGetLastError();
        free(dev);
        free(c);
        return mf_fail(MOEFUSE_ERR_NO_MEMORY, "moefuse_comm_create_nccl: cudaMalloc of the "
                       "create-time vote (%zu bytes): %s", sizeof(int), cudaGetErrorString(ve));
    }
    ncclDevCommRequirements reqs;
    memset(&reqs, 0, sizeof reqs);  // no multimem (NVLS), no barriers, no GIN
    const ncclResult_t r = ncclDevCommCreate(comm, &reqs, dev);
    if (r != ncclSuccess) {
        cudaFree(vote);
        free(dev);
        free(c);
        return mf_fail(MOEFUSE_ERR_NCCL, "moefuse_comm_create_nccl: ncclDevCommCreate: %s (%s)",
                       ncclGetErrorString(r), ncclGetLastError(comm));
    }
    if (dev->lsaSize != R) {
        const int lsa = dev->lsaSize;
        ncclDevCommDestroy(comm, dev);
        cudaFree(vote);
        free(dev);
        free(c);
        return mf_fail(MOEFUSE_ERR_UNSUPPORTED,
                       "moefuse_comm_create_nccl: %d of the %d ranks reach rank %d by NVLink "
                       "load/store (its LSA team); expert parallelism across nodes needs NCCL "
                       "GIN, which is planned; expected every rank on one NVLink domain",
                       lsa, R, rank);
    }
    c->kind = MF_COMM_NCCL;
    c->num_ranks = R;
    c->timeout_ms = 30000;
    c->nccl_comm = comm;
    c->nccl_rank = rank;
    c->nccl_dev_comm = dev;
    c->nccl_vote = vote;
    *out = c;
    return MOEFUSE_OK;
}

extern "C" void mf_nccl_comm_release(moefuse_comm *c) {
    ncclDevCommDestroy((ncclComm_t)c->nccl_comm, (ncclDevComm *)c->nccl_dev_comm);
    free(c->nccl_dev_comm);
    c->nccl_dev_comm = NULL;
    cudaFree(c->nccl_vote);
    c->nccl_vote = NULL;
}

extern "C" moefuse_status mf_nccl_agree(moefuse_comm *c, int failed, int *any_failed) {
    ncclComm_t comm = (ncclComm_t)c->nccl_comm;
    const int mine = failed ? c->nccl_rank + 1 : 0;
    *any_failed = 0;
    /* the legacy stream: ordered after the create's allocations and memsets */
    MF_CUDA_TRY(cudaMemcpy(c->nccl_vote, &mine, sizeof mine, cudaMemcpyHostToDevice));
    MF_NCCL_TRY(comm, ncclAllReduce(c->nccl_vote, c->nccl_vote, 1, ncclInt32, ncclMax, comm, 0));
    MF_CUDA_TRY(cudaStreamSynchronize(0));
    MF_CUDA_TRY(cudaMemcpy(any_failed, c->nccl_vote, sizeof *any_failed, cudaMemcpyDeviceToHost));
    return MOEFUSE_OK;
}

static size_t window_size(size_t bytes) {
    return (bytes + NCCL_WIN_REQUIRED_ALIGNMENT - 1) / NCCL_WIN_REQUIRED_ALIGNMENT *
           NCCL_WIN_REQUIRED_ALIGNMENT;
}

extern "C" moefuse_status mf_nccl_window_alloc(moefuse_comm *c, size_t bytes, void **ptr) {
    ncclComm_t comm = (ncclComm_t)c->nccl_comm;
    const size_t size = window_size(bytes);
    *ptr = NULL;
    MF_NCCL_TRY(comm, ncclMemAlloc(ptr, size));
    cudaError_t e = cudaMemset(*ptr, 0, size);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
        ncclMemFree(*ptr);
        *ptr = NULL;
        return mf_fail(MOEFUSE_ERR_CUDA, "moefuse_layer_create: zeroing a window: %s",
                       cudaGetErrorString(e));
    }
    return MOEFUSE_OK;
}

extern "C" moefuse_status mf_nccl_window_register(moefuse_comm *c, void *ptr, size_t bytes,
                                                  void **handle) {
    ncclComm_t comm = (ncclComm_t)c->nccl_comm;
    const size_t size = window_size(bytes);
    ncclWindow_t win = NULL;
    *handle = NULL;
    const ncclResult_t r = ncclCommWindowRegister(comm, ptr, size, &win, NCCL_WIN_COLL_SYMMETRIC);
    if (r != ncclSuccess || !win)
        return mf_fail(MOEFUSE_ERR_NCCL,
                       "moefuse_layer_create: a window of %zu bytes did not register "
                       "(ncclCommWindowRegister: %s, %s); expected every rank to create its "
                       "layers with the same configs in the same order",
                       size, ncclGetErrorString(r), ncclGetLastError(comm));
    *handle = win;
    return MOEFUSE_OK;
}

extern "C" void mf_nccl_window_free(moefuse_comm *c, void *ptr, void *handle) {
    if (handle) ncclCommWindowDeregister((ncclComm_t)c->nccl_comm, (ncclWindow_t)handle);
    if (ptr) ncclMemFree(ptr);
}

extern "C" moefuse_status mf_nccl_peer_table(moefuse_comm *c, void *const handles[MF_WIN_COUNT],
                                             void **device_table) {
    peer_table_args a;
    for (int w = 0; w < MF_WIN_COUNT; w++) a.windows[w] = (ncclWindow_t)handles[w];
    a.num_ranks = c->num_ranks;
    a.table = device_table;
    peer_table_kernel<<<1, 256>>>(a);
    MF_CUDA_LAUNCHED();
    MF_CUDA_TRY(cudaDeviceSynchronize());
    return MOEFUSE_OK;
}
