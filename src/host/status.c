/* Status strings, the per-thread last-error message, the version. */
#include "internal.h"

#include <stdarg.h>
#include <stdio.h>

/* One message per thread: two training threads calling the library must not read
 * each other's errors. */
static _Thread_local char last_error[1024];

moefuse_status mf_fail(moefuse_status status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return status;
}

void mf_clear_error(void) { last_error[0] = '\0'; }

const char *moefuse_last_error(void) { return last_error; }

int moefuse_version(void) { return MOEFUSE_VERSION; }

const char *moefuse_status_string(moefuse_status status) {
    switch (status) {
    case MOEFUSE_OK: return "MOEFUSE_OK";
    case MOEFUSE_ERR_NULL_POINTER: return "MOEFUSE_ERR_NULL_POINTER";
    case MOEFUSE_ERR_MISALIGNED: return "MOEFUSE_ERR_MISALIGNED";
    case MOEFUSE_ERR_SHAPE: return "MOEFUSE_ERR_SHAPE";
    case MOEFUSE_ERR_EXPERT_ID: return "MOEFUSE_ERR_EXPERT_ID";
    case MOEFUSE_ERR_DUPLICATE_EXPERT: return "MOEFUSE_ERR_DUPLICATE_EXPERT";
    case MOEFUSE_ERR_TOO_MANY_TOKENS: return "MOEFUSE_ERR_TOO_MANY_TOKENS";
    case MOEFUSE_ERR_UNSUPPORTED: return "MOEFUSE_ERR_UNSUPPORTED";
    case MOEFUSE_ERR_INVALID_CONFIG: return "MOEFUSE_ERR_INVALID_CONFIG";
    case MOEFUSE_ERR_NO_MEMORY: return "MOEFUSE_ERR_NO_MEMORY";
    case MOEFUSE_ERR_CUDA: return "MOEFUSE_ERR_CUDA";
    case MOEFUSE_ERR_NCCL: return "MOEFUSE_ERR_NCCL";
    case MOEFUSE_ERR_TIMEOUT: return "MOEFUSE_ERR_TIMEOUT";
    case MOEFUSE_ERR_SAVED_STATE: return "MOEFUSE_ERR_SAVED_STATE";
    case MOEFUSE_ERR_CAPACITY: return "MOEFUSE_ERR_CAPACITY";
    }
    return "MOEFUSE_ERR_UNKNOWN";
}
