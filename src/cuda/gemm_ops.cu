/* The GEMM tables this library has, by (architecture, precision). */
#include <stddef.h>

#include "gemm_ops.h"

static const mf_gemm_ops *const kTables[] = {&mf_sm90_bf16_ops, &mf_sm90_fp8_ops};

extern "C" const mf_gemm_ops *mf_gemm_ops_find(int arch, int precision) {
    for (const mf_gemm_ops *t : kTables)
        if ((arch < 0 || t->arch == arch) && t->precision == precision) return t;
    return NULL;
}
