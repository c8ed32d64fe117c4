/* Error checks of the CUDA backend.
 *
 *   MF_CUDA_TRY(call)   host: on an error, records "file:line: call: cudaGetErrorString"
 *                       through mf_fail(MOEFUSE_ERR_CUDA, ...) and returns that status
 *                       from the enclosing function (which returns moefuse_status).
 *   MF_CUDA_LAUNCHED()  host: MF_CUDA_TRY(cudaGetLastError()), after every <<<...>>>.
 *   MF_DEVICE_CHECK(c)  device: a broken invariant prints block/thread and file:line and
 *                       traps. For bugs only, never for bad input (bad input is
 *                       reported through a status, see moe_plan.cu).
 */
#ifndef MOEFUSE_CUDA_CHECK_H
#define MOEFUSE_CUDA_CHECK_H

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

#include "internal.h"

#define MF_CUDA_TRY(call)                                                                 \
    do {                                                                                  \
        cudaError_t mf_err_ = (call);                                                     \
        if (mf_err_ != cudaSuccess)                                                       \
            return mf_fail(MOEFUSE_ERR_CUDA, "%s:%d: %s: %s (%s)", __FILE__, __LINE__,    \
                           #call, cudaGetErrorString(mf_err_), cudaGetErrorName(mf_err_)); \
    } while (0)

#define MF_CUDA_LAUNCHED() MF_CUDA_TRY(cudaGetLastError())

#ifdef __CUDACC__
#define MF_DEVICE_CHECK(cond)                                                             \
    do {                                                                                  \
        if (!(cond)) {                                                                    \
            printf("moefuse: %s:%d: device check failed: %s (block %d, thread %d)\n",     \
                   __FILE__, __LINE__, #cond, (int)blockIdx.x, (int)threadIdx.x);         \
            __trap();                                                                     \
        }                                                                                 \
    } while (0)
#endif

#ifdef __cplusplus
/* Loads kernels into the current context now (host). Under CUDA's lazy loading (the
 * default since CUDA 12.2) a kernel is loaded at its first launch, and a load may wait
 * for the kernels already running. With expert parallelism those kernels can be
 * waiting for a launch that the same host thread has not made yet (virtual ranks):
 * the first call would hang until its timeout. So every kernel file has an mf_*_load()
 * that the backend calls when a layer is created. */
template <class... Kernels>
inline cudaError_t mf_load_kernels(Kernels... kernels) {
    cudaFuncAttributes attr;
    cudaError_t err = cudaSuccess;
    ((err = err != cudaSuccess ? err
                               : cudaFuncGetAttributes(&attr, reinterpret_cast<const void *>(kernels))),
     ...);
    return err;
}
#endif

#endif /* MOEFUSE_CUDA_CHECK_H */
