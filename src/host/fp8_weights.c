/* FP8 block-scaled weights: sizing, the view into one buffer, their checks, and
 * moefuse_quantize_weights (on the host for the CPU backend). The recipe is src/cpu/fp8.c;
 * the layouts are in include/moefuse.h, the reasons in docs/decisions/0018-fp8-block-recipe.md. */
#include "fp8.h"
#include "internal.h"

#include <stdlib.h>

static size_t align256(size_t n) { return (n + 255) / 256 * 256; }
static int64_t nb(int64_t n) { return (n + MF_FP8_TILE - 1) / MF_FP8_TILE; }

/* Byte sizes of the eight arrays in the order of moefuse_fp8_weights. */
static void array_bytes(const moefuse_layer *layer, size_t bytes[8]) {
    const int64_t E = layer->num_local_experts, H = layer->cfg.hidden;
    const int64_t I2 = 2 * (int64_t)layer->cfg.intermediate, I = layer->cfg.intermediate;
    bytes[0] = bytes[2] = (size_t)(E * I2 * H);
    bytes[1] = bytes[3] = sizeof(float) * (size_t)(E * nb(I2) * nb(H));
    bytes[4] = bytes[6] = (size_t)(E * H * I);
    bytes[5] = bytes[7] = sizeof(float) * (size_t)(E * nb(H) * nb(I));
}

moefuse_status moefuse_fp8_weights_bytes(const moefuse_layer *layer, size_t *bytes) {
    mf_clear_error();
    if (!layer) return mf_fail(MOEFUSE_ERR_NULL_POINTER, "layer: expected a layer");
    if (!bytes) return mf_fail(MOEFUSE_ERR_NULL_POINTER, "bytes: expected a size_t *");
    size_t b[8], total = 0;
    array_bytes(layer, b);
    for (int i = 0; i < 8; i++) total += align256(b[i]);
    *bytes = total;
    return MOEFUSE_OK;
}

moefuse_status moefuse_fp8_weights_view(const moefuse_layer *layer, void *buffer,
                                        moefuse_fp8_weights *out) {
    mf_clear_error();
    if (!layer) return mf_fail(MOEFUSE_ERR_NULL_POINTER, "layer: expected a layer");
    if (!out) return mf_fail(MOEFUSE_ERR_NULL_POINTER, "out: expected a moefuse_fp8_weights *");
    if (!buffer) return mf_fail(MOEFUSE_ERR_NULL_POINTER, "buffer: expected a non-NULL pointer");
    if ((uintptr_t)buffer % 256 != 0)
        return mf_fail(MOEFUSE_ERR_MISALIGNED, "buffer = %p: expected 256-byte alignment",
                       buffer);
    size_t b[8], off[8], at = 0;
    array_bytes(layer, b);
    for (int i = 0; i < 8; i++) {
        off[i] = at;
        at += align256(b[i]);
    }
    unsigned char *base = buffer;
    out->hidden = layer->cfg.hidden;
    out->intermediate = layer->cfg.intermediate;
    out->num_local_experts = layer->num_local_experts;
    out->pow2_scales = layer->cfg.fp8_pow2_scales;
    out->w13 = base + off[0];
    out->w13_scale = (float *)(base + off[1]);
    out->w13t = base + off[2];
    out->w13t_scale = (float *)(base + off[3]);
    out->w2 = base + off[4];
    out->w2_scale = (float *)(base + off[5]);
    out->w2t = base + off[6];
    out->w2t_scale = (float *)(base + off[7]);
    return MOEFUSE_OK;
}

static moefuse_status need_array(const void *p, const char *name, const char *field,
                                 size_t align) {
    if (!p)
        return mf_fail(MOEFUSE_ERR_NULL_POINTER, "%s->%s: expected a non-NULL pointer", name,
                       field);
    if ((uintptr_t)p % align != 0)
        return mf_fail(MOEFUSE_ERR_MISALIGNED, "%s->%s = %p: expected %zu-byte alignment",
                       name, field, p, align);
    return MOEFUSE_OK;
}

moefuse_status mf_check_fp8_weights(const moefuse_layer *layer, const moefuse_fp8_weights *w,
                                    const char *name) {
    if (layer->cfg.precision != MOEFUSE_PRECISION_FP8_BLOCK) {
        if (w)
            return mf_fail(MOEFUSE_ERR_INVALID_CONFIG,
                           "%s = %p on a layer of precision MOEFUSE_PRECISION_BF16: expected "
                           "NULL (quantized weights are read by MOEFUSE_PRECISION_FP8_BLOCK "
                           "layers only)", name, (const void *)w);
        return MOEFUSE_OK;
    }
    if (!w)
        return mf_fail(MOEFUSE_ERR_NULL_POINTER,
                       "%s: NULL on a layer of precision MOEFUSE_PRECISION_FP8_BLOCK; expected "
                       "the weights moefuse_quantize_weights wrote", name);
    const struct { int got, want; const char *field, *what; } shapes[3] = {
        {w->hidden, layer->cfg.hidden, "hidden", "config.hidden"},
        {w->intermediate, layer->cfg.intermediate, "intermediate", "config.intermediate"},
        {w->num_local_experts, layer->num_local_experts, "num_local_experts",
         "num_experts / num_ranks"},
    };
    for (int i = 0; i < 3; i++)
        if (shapes[i].got != shapes[i].want)
            return mf_fail(MOEFUSE_ERR_SHAPE, "%s->%s = %d: expected %d (%s of this layer)",
                           name, shapes[i].field, shapes[i].got, shapes[i].want,
                           shapes[i].what);
    if (w->pow2_scales != layer->cfg.fp8_pow2_scales)
        return mf_fail(MOEFUSE_ERR_INVALID_CONFIG,
                       "%s->pow2_scales = %d: expected %d (config.fp8_pow2_scales of this "
                       "layer; weights quantized with the other scale rule)", name,
                       w->pow2_scales, layer->cfg.fp8_pow2_scales);
    const size_t a8 = mf_array_align(layer, 1), a32 = mf_array_align(layer, 4);
    const struct { const void *p; const char *field; size_t align; } arrays[8] = {
        {w->w13, "w13", a8}, {w->w13_scale, "w13_scale", a32},
        {w->w13t, "w13t", a8}, {w->w13t_scale, "w13t_scale", a32},
        {w->w2, "w2", a8}, {w->w2_scale, "w2_scale", a32},
        {w->w2t, "w2t", a8}, {w->w2t_scale, "w2t_scale", a32},
    };
    for (int i = 0; i < 8; i++) {
        moefuse_status st = need_array(arrays[i].p, name, arrays[i].field, arrays[i].align);
        if (st != MOEFUSE_OK) return st;
    }
    return MOEFUSE_OK;
}

/* One expert's matrix [rows, cols] from bf16 or fp32 into fp32 scratch. */
static void widen(moefuse_dtype dtype, const void *src, int64_t n, float *dst) {
    if (dtype == MOEFUSE_DTYPE_BF16)
        mf_bf16_to_float_n(src, dst, n);
    else
        for (int64_t i = 0; i < n; i++) dst[i] = ((const float *)src)[i];
}

/* moefuse_quantize_weights and its halves form (w13_up NULL: W13 packed). */
static moefuse_status quantize_weights(const moefuse_layer *layer, moefuse_dtype dtype,
                                       const void *w13, const void *w13_up, const void *w2,
                                       const moefuse_fp8_weights *out, void *stream,
                                       const char *fn) {
    mf_clear_error();
    if (!layer) return mf_fail(MOEFUSE_ERR_NULL_POINTER, "layer: expected a layer");
    if (layer->cfg.precision != MOEFUSE_PRECISION_FP8_BLOCK)
        return mf_fail(MOEFUSE_ERR_INVALID_CONFIG,
                       "layer: config.precision = %d; expected MOEFUSE_PRECISION_FP8_BLOCK "
                       "(the layer's scale rule and shapes define the quantization)",
                       (int)layer->cfg.precision);
    if (dtype != MOEFUSE_DTYPE_BF16 && dtype != MOEFUSE_DTYPE_FP32)
        return mf_fail(MOEFUSE_ERR_INVALID_CONFIG,
                       "dtype = %d: expected MOEFUSE_DTYPE_BF16 (0) or MOEFUSE_DTYPE_FP32 (1)",
                       (int)dtype);
    /* the GPU's quantizer reads 16-byte pieces; the host, values */
    const size_t align = mf_array_align(layer, dtype == MOEFUSE_DTYPE_BF16 ? 2 : 4);
    moefuse_status st = need_array(w13, fn, "w13", align);
    if (st == MOEFUSE_OK && w13_up) st = need_array(w13_up, fn, "w13_up", align);
    if (st == MOEFUSE_OK) st = need_array(w2, fn, "w2", align);
    if (st == MOEFUSE_OK) st = mf_check_fp8_weights(layer, out, "out");
    if (st != MOEFUSE_OK) return st;
    if (layer->ops->quantize_weights)  /* weights in the backend's (device) memory */
        return layer->ops->quantize_weights(layer, dtype, w13, w13_up, w2, out, stream);

    const int64_t E = layer->num_local_experts, H = layer->cfg.hidden;
    const int64_t I = layer->cfg.intermediate, I2 = 2 * I;
    const size_t esize = dtype == MOEFUSE_DTYPE_BF16 ? 2 : 4;
    int failed = 0;
#pragma omp parallel
    {
        float *v = malloc(sizeof(float) * (size_t)(I2 * H)); /* [2I, H] or [H, I] */
        if (!v) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t e = 0; e < 2 * E; e++) {
            if (!v) continue;
            const int64_t x = e / 2;
            if (e % 2 == 0) { /* W13_x [2I, H], packed or its gate and up halves [I, H] */
                if (w13_up) {
                    widen(dtype, (const char *)w13 + esize * (size_t)(x * I * H), I * H, v);
                    widen(dtype, (const char *)w13_up + esize * (size_t)(x * I * H), I * H,
                          v + I * H);
                } else {
                    widen(dtype, (const char *)w13 + esize * (size_t)(x * I2 * H), I2 * H, v);
                }
                mf_fp8_quantize_blocks(v, I2, H, H, out->pow2_scales, out->w13 + x * I2 * H,
                                       out->w13_scale + x * nb(I2) * nb(H),
                                       out->w13t + x * I2 * H,
                                       out->w13t_scale + x * nb(I2) * nb(H));
            } else {          /* W2_x [H, I] */
                widen(dtype, (const char *)w2 + esize * (size_t)(x * H * I), H * I, v);
                mf_fp8_quantize_blocks(v, H, I, I, out->pow2_scales, out->w2 + x * H * I,
                                       out->w2_scale + x * nb(H) * nb(I), out->w2t + x * H * I,
                                       out->w2t_scale + x * nb(H) * nb(I));
            }
        }
        free(v);
    }
    if (failed)
        return mf_fail(MOEFUSE_ERR_NO_MEMORY,
                       "%s: out of host memory for one expert's fp32 copy (%lld MiB per "
                       "thread)", fn, (long long)((I2 * H * 4) >> 20));
    return MOEFUSE_OK;
}

moefuse_status moefuse_quantize_weights(const moefuse_layer *layer, moefuse_dtype dtype,
                                        const void *w13, const void *w2,
                                        const moefuse_fp8_weights *out, void *stream) {
    return quantize_weights(layer, dtype, w13, NULL, w2, out, stream,
                            "moefuse_quantize_weights");
}

moefuse_status moefuse_quantize_weights_halves(const moefuse_layer *layer, moefuse_dtype dtype,
                                               const void *w13, const void *w13_up,
                                               const void *w2, const moefuse_fp8_weights *out,
                                               void *stream) {
    if (!w13_up) {
        mf_clear_error();
        return mf_fail(MOEFUSE_ERR_NULL_POINTER,
                       "moefuse_quantize_weights_halves: w13_up: expected the up half "
                       "[E/R, I, H] (moefuse_quantize_weights takes W13 packed)");
    }
    return quantize_weights(layer, dtype, w13, w13_up, w2, out, stream,
                            "moefuse_quantize_weights_halves");
}
