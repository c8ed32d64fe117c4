/* The FP8 block recipe, defined once (see docs/decisions/0018-fp8-block-recipe.md): OCP E4M3
 * codes, fp32 scales per tile, quantization of a tile as encode(x / scale).
 *
 * E4M3: sign, 4 exponent bits (bias 7), 3 mantissa bits; largest finite 448 (0x7e),
 * smallest subnormal 2^-9 (0x01); no infinity; 0x7f and 0xff are NaN.
 * Encoding rounds to nearest, ties to even, and saturates: every value beyond +-448
 * (infinity included) becomes +-448, as the GPU's cvt.rn.satfinite.e4m3x2.f32 does;
 * NaN becomes 0x7f.
 *
 * The scale of a tile: amax = the largest |x| of the tile (NaN if any x is NaN);
 *   amax = 0            -> scale 1 (every code is 0, so any scale decodes to 0; 1 keeps
 *                          the scale products finite and is a power of two)
 *   amax not finite     -> scale NaN (every code 0x7f: the tile decodes to NaN)
 *   otherwise           -> scale = fp32(amax / 448), raised to 2^-126 if below it (no
 *                          subnormal scale: a GPU may flush it), and with pow2 rounded
 *                          up to a power of two (then x / scale is exact).
 * Quantization divides in fp32 rounded to nearest (div.rn.f32 on the GPU; with pow2
 * scales that is a multiplication by 2^-k, exact). */
#ifndef MOEFUSE_FP8_H
#define MOEFUSE_FP8_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MF_E4M3_MAX 448.0f
#define MF_E4M3_NAN 0x7f
/* Elements per tile along a quantized dimension (1x128 rows, 128x128 weight blocks,
 * 128 tokens for the weight-gradient operands). */
#define MF_FP8_TILE 128

uint8_t mf_e4m3_encode(float v);
float mf_e4m3_decode(uint8_t code);

/* The scale of a tile whose largest magnitude is amax (NaN-propagating, see above). */
float mf_fp8_scale(float amax, int pow2);

/* amax of n values at a stride; NaN when any is NaN. */
float mf_fp8_amax(const float *v, int64_t n, int64_t stride);

/* Quantizes one tile: codes q[i * q_stride] = encode(v[i * v_stride] / scale); returns
 * the scale. */
float mf_fp8_quantize_tile(const float *v, int64_t n, int64_t v_stride, int pow2,
                           uint8_t *q, int64_t q_stride);

/* Rows of a row-major [rows, cols] fp32 matrix (row stride ld), each quantized in
 * 1 x 128 tiles along cols (the last tile of a row may be short). codes [rows, cols]
 * contiguous; the scale of (row r, tile b) at scale[b * scale_tile_stride + r *
 * scale_row_stride]. */
void mf_fp8_quantize_rows(const float *v, int64_t rows, int64_t cols, int64_t ld, int pow2,
                          uint8_t *codes, float *scale, int64_t scale_row_stride,
                          int64_t scale_tile_stride);

/* Weights: a [rows, cols] matrix (row stride ld) in 128 x 128 blocks. codes [rows, cols]
 * and codes_t [cols, rows] (the transpose: same blocks, same scales, so the same codes),
 * either may be NULL; scale [ceil(rows/128), ceil(cols/128)] and scale_t its transpose,
 * either may be NULL. */
void mf_fp8_quantize_blocks(const float *v, int64_t rows, int64_t cols, int64_t ld, int pow2,
                            uint8_t *codes, float *scale, uint8_t *codes_t, float *scale_t);

/* Rows row0 .. row0 + n - 1 of a block-scaled [rows, cols] matrix (codes [rows, cols],
 * scale [ceil(rows/128), ceil(cols/128)]) into out [n, cols]: decode(code) * scale. */
void mf_fp8_dequant_block_rows(const uint8_t *codes, const float *scale, int64_t cols,
                               int64_t row0, int64_t n, float *out);

/* In place: every value replaced by decode(code) * scale (fp32) of its tile.
 * _rows: 1 x 128 tiles along each row of [rows, cols] (ld); _cols: each column of
 * [rows, cols] one tile (rows <= 128: the token tiles of the weight-gradient GEMMs). */
void mf_fp8_fake_quant_rows(float *v, int64_t rows, int64_t cols, int64_t ld, int pow2);
void mf_fp8_fake_quant_cols(float *v, int64_t rows, int64_t cols, int64_t ld, int pow2,
                            float *amax_scratch /* [cols] */);

#ifdef __cplusplus
}
#endif

#endif /* MOEFUSE_FP8_H */
