/* One warp moves one token row: 16-byte vectors, four loads in flight per lane before
 * the stores (dst never aliases src); or zeroes one (bf16 rows, FP8 codes). Used by the
 * dispatch kernels. Device only. */
#pragma once

#include <stdint.h>

namespace mf {

__device__ __forceinline__ void warp_copy_row(int4 *dst, const int4 *src, int vecs, int lane) {
    int v = lane;
    for (; v + 96 < vecs; v += 128) {
        const int4 a0 = __ldg(src + v), a1 = __ldg(src + v + 32);
        const int4 a2 = __ldg(src + v + 64), a3 = __ldg(src + v + 96);
        dst[v] = a0;
        dst[v + 32] = a1;
        dst[v + 64] = a2;
        dst[v + 96] = a3;
    }
    for (; v < vecs; v += 32) dst[v] = __ldg(src + v);
}

__device__ __forceinline__ void warp_zero_row(int4 *dst, int vecs, int lane) {
    for (int v = lane; v < vecs; v += 32) dst[v] = make_int4(0, 0, 0, 0);
}

/* A padding row of FP8 row codes [rows, hidden]: codes 0 and, in the MN-major scales
 * [hidden / 128, scale_ld], scale 1 (an all-zero tile's, as the rows quantizer makes). */
__device__ __forceinline__ void warp_zero_codes_row(uint8_t *codes, float *scales,
                                                    int64_t scale_ld, int row, int hidden,
                                                    int lane) {
    warp_zero_row(reinterpret_cast<int4 *>(codes + (int64_t)row * hidden), hidden / 16, lane);
    for (int b = lane; b < hidden / 128; b += 32) scales[(int64_t)b * scale_ld + row] = 1.0f;
}

}  // namespace mf
