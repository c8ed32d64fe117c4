/* The FP8 block recipe's weight quantizer (fp8_recipe.cuh; bit for bit src/cpu/fp8.c),
 * once per optimizer step:
 *
 *   weights  bf16 or fp32 [E, rows, cols] -> codes [E, rows, cols] and codes^T [E, cols,
 *            rows], scales [E, rows / 128, cols / 128] and their transpose: 128 x 128
 *            blocks (W^T's codes are W's transposed: the same blocks and scales), W13
 *            packed or from its two halves.
 *
 * A CTA per block reads it once, in 16-byte pieces, and transposes the codes in registers
 * (docs/decisions/0023-fp8-quantizer-bandwidth.md). */
#include <cuda_runtime.h>
#include <stdint.h>

#include "check.h"
#include "fp8_recipe.cuh"
#include "kernels.h"

namespace {

using namespace mf::fp8;

/* ---- weights: 128 x 128 blocks, W and W^T ------------------------------------------- */

constexpr int kWThreads = 256;

/* The amax of the CTA's kWThreads partial ones m (every thread gets it); red: a warp's
 * slot each in shared memory. */
__device__ __forceinline__ float block_amax(float m, float *red) {
    m = warp_amax(m);
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = m;
    __syncthreads();
    m = 0.0f;
#pragma unroll
    for (int i = 0; i < kWThreads / 32; ++i) m = amax_fold(m, red[i]);
    return m;
}

/* A thread's part of a block: kCols = 4 consecutive columns (16 bytes of fp32, 8 of
 * bf16) of kRows = 16 consecutive rows, kLanes threads to a row. (bf16 read 16 bytes a
 * load, 8 columns of 8 rows, was no faster: 1.125 against 1.109 ms on an H100,
 * docs/decisions/0023-fp8-quantizer-bandwidth.md.) */
constexpr int kCols = 4, kRows = 128 * 128 / kWThreads / kCols, kLanes = 128 / kCols;
static_assert(kRows == 16 && kWThreads / kLanes * kRows == 128,
              "the threads cover the block's 128 rows, 16 rows (four 4 x 4 transposes) each");

/* A row's kCols weights as loaded, kept so until its codes: fp32's 16 bytes, bf16's 8.
 * bf16 held packed is 32 registers for a thread's 16 rows, not 64 as floats, so 3 CTAs
 * fit an SM (80 registers): 96 KB of loads in flight, not 64 (fp32's 2 CTAs hold 128 KB;
 * bf16 1.06 -> 0.96 ms at qwen3-30b-a3b on an H100,
 * docs/decisions/0023-fp8-quantizer-bandwidth.md). */
template <class T>
struct Weights4 {
    using Raw = float4;
    static constexpr int kCtasPerSm = 2;
};
template <>
struct Weights4<uint16_t> {
    using Raw = uint2;
    static constexpr int kCtasPerSm = 3;
};

/* 4 consecutive weights (aligned: the launcher's check), as loaded. */
__device__ __forceinline__ void load_weights(const float *w, float4 &raw) {
    raw = *reinterpret_cast<const float4 *>(w);
}
__device__ __forceinline__ void load_weights(const uint16_t *w, uint2 &raw) {
    raw = *reinterpret_cast<const uint2 *>(w);
}

/* ... as floats. */
__device__ __forceinline__ void unpack4(const float4 &f, float (&v)[4]) {
    v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
}
__device__ __forceinline__ void unpack4(const uint2 &b, float (&v)[4]) {
    v[0] = bf16_bits(b.x, 0), v[1] = bf16_bits(b.x, 1), v[2] = bf16_bits(b.y, 0),
    v[3] = bf16_bits(b.y, 1);
}

/* The 4 x 4 bytes of rows[0..3] (byte j of row i: column j) transposed: byte i of cols[j]
 * is byte j of rows[i]. */
__device__ __forceinline__ void transpose4x4(const uint32_t (&rows)[4], uint32_t (&cols)[4]) {
    const uint32_t lo01 = __byte_perm(rows[0], rows[1], 0x5140);   /* r0.0 r1.0 r0.1 r1.1 */
    const uint32_t hi01 = __byte_perm(rows[0], rows[1], 0x7362);   /* r0.2 r1.2 r0.3 r1.3 */
    const uint32_t lo23 = __byte_perm(rows[2], rows[3], 0x5140);
    const uint32_t hi23 = __byte_perm(rows[2], rows[3], 0x7362);
    cols[0] = __byte_perm(lo01, lo23, 0x5410);
    cols[1] = __byte_perm(lo01, lo23, 0x7632);
    cols[2] = __byte_perm(hi01, hi23, 0x5410);
    cols[3] = __byte_perm(hi01, hi23, 0x7632);
}

/* A 128 x 128 block of W (bf16 or fp32) to W's codes and W^T's, and its scale, without
 * shared memory for the codes: thread t takes columns 4 (t % 32) .. + 3 of rows
 * 16 (t / 32) .. + 15 and keeps them in registers from the amax to the codes (the block
 * is read once), so each load of a warp is a whole row of the block (512 bytes of fp32,
 * 256 of bf16), W's codes go out as one 4-byte word per row (a warp: 128 contiguous
 * bytes) and W^T's, transposed in registers, as one 16-byte piece per column (16 rows of
 * it). 2 CTAs an SM for fp32, 3 for bf16 (Weights4), so that one's loads overlap the
 * others' codes. */
template <class T>
__global__ void __launch_bounds__(kWThreads, Weights4<T>::kCtasPerSm)
    fp8_quantize_weights_kernel(const mf_quantize_fp8_weights_params p, const T *w) {
    __shared__ float red[kWThreads / 32];
    /* this CTA's block: expert e, block row br and column bc; base, its first element in
     * the codes (W's layout); src, in w: the one array, or the half that holds its rows */
    const int nbr = p.rows / 128, nbc = p.cols / 128;
    const int e = blockIdx.x / (nbr * nbc), br = (blockIdx.x / nbc) % nbr, bc = blockIdx.x % nbc;
    const int64_t base = (int64_t)e * p.rows * p.cols + (int64_t)br * 128 * p.cols + bc * 128;
    int64_t src = base;
    if (p.w_hi && br * 128 < p.split_rows) {
        src = ((int64_t)e * p.split_rows + br * 128) * p.cols + bc * 128;
    } else if (p.w_hi) {
        w = (const T *)p.w_hi;
        src = ((int64_t)e * (p.rows - p.split_rows) + br * 128 - p.split_rows) * p.cols +
              bc * 128;
    }
    const int col = kCols * (threadIdx.x % kLanes), row0 = kRows * (threadIdx.x / kLanes);
    typename Weights4<T>::Raw raw[kRows];
#pragma unroll
    for (int k = 0; k < kRows; ++k)
        load_weights(w + src + (int64_t)(row0 + k) * p.cols + col, raw[k]);
    float m = 0.0f;
#pragma unroll
    for (int k = 0; k < kRows; ++k) {
        float v[kCols];
        unpack4(raw[k], v);
#pragma unroll
        for (int j = 0; j < kCols; ++j) m = amax_fold(m, v[j]);
    }
    m = block_amax(m, red);
    const float s = tile_scale(m, p.pow2), inv = __frcp_rn(s);
    uint32_t words[kRows];   /* row k's 4 codes, column j in byte j */
#pragma unroll
    for (int k = 0; k < kRows; ++k) {
        float v[kCols], q[kCols];
        unpack4(raw[k], v);
        quotients(v, s, inv, q);
        words[k] = encode4(q[0], q[1], q[2], q[3]);
        *reinterpret_cast<uint32_t *>(p.codes + base + (int64_t)(row0 + k) * p.cols + col) =
            words[k];
    }
    uint32_t t[kCols][kRows / 4];   /* [column j][rows 4g .. 4g + 3] */
#pragma unroll
    for (int g = 0; g < kRows / 4; ++g) {
        const uint32_t rows[4] = {words[4 * g], words[4 * g + 1], words[4 * g + 2],
                                  words[4 * g + 3]};
        uint32_t cols[4];
        transpose4x4(rows, cols);
#pragma unroll
        for (int j = 0; j < 4; ++j) t[j][g] = cols[j];
    }
    const int64_t base_t = (int64_t)e * p.rows * p.cols + (int64_t)bc * 128 * p.rows + br * 128;
#pragma unroll
    for (int j = 0; j < kCols; ++j)
        *reinterpret_cast<uint4 *>(p.codes_t + base_t + (int64_t)(col + j) * p.rows + row0) =
            make_uint4(t[j][0], t[j][1], t[j][2], t[j][3]);
    if (threadIdx.x == 0) {
        p.scale[((int64_t)e * nbr + br) * nbc + bc] = s;
        p.scale_t[((int64_t)e * nbc + bc) * nbr + br] = s;
    }
}

}  // namespace

extern "C" cudaError_t mf_quantize_fp8_weights(const mf_quantize_fp8_weights_params *p,
                                               cudaStream_t stream) {
    if (!p || !p->w || !p->codes || !p->codes_t || !p->scale || !p->scale_t ||
        p->num_experts <= 0 || p->rows <= 0 || p->cols <= 0 || p->rows % 128 || p->cols % 128 ||
        (p->w_hi && (p->split_rows <= 0 || p->split_rows >= p->rows || p->split_rows % 128)))
        return cudaErrorInvalidValue;
    const int64_t ctas = (int64_t)p->num_experts * (p->rows / 128) * (p->cols / 128);
    if (ctas > INT32_MAX) return cudaErrorInvalidValue;
    /* a thread's kCols weights in one load (16 bytes of fp32, 8 of bf16), 4-byte codes,
     * 16-byte codes^T (the API asks 16-byte aligned arrays on CUDA) */
    const uintptr_t a = p->fp32 ? 16 : 2 * kCols;
    if ((uintptr_t)p->w % a || (uintptr_t)p->w_hi % a || (uintptr_t)p->codes % 4 ||
        (uintptr_t)p->codes_t % 16)
        return cudaErrorMisalignedAddress;
    if (p->fp32)
        fp8_quantize_weights_kernel<float>
            <<<(unsigned)ctas, kWThreads, 0, stream>>>(*p, (const float *)p->w);
    else
        fp8_quantize_weights_kernel<uint16_t>
            <<<(unsigned)ctas, kWThreads, 0, stream>>>(*p, (const uint16_t *)p->w);
    return cudaGetLastError();
}

extern "C" cudaError_t mf_quantize_fp8_weights_load(void) {
    return mf_load_kernels(fp8_quantize_weights_kernel<float>,
                           fp8_quantize_weights_kernel<uint16_t>);
}
