/* Host helper: TMA descriptors (CUtensorMap) for 2D bf16 tensors, encoded through the
 * driver entry point that the runtime hands out, so the library does not link libcuda. */
#ifndef MOEFUSE_CUDA_TENSOR_MAP_H
#define MOEFUSE_CUDA_TENSOR_MAP_H

#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>

/* A row-major bf16 matrix of `rows` rows of `cols` elements (row stride `ld` elements,
 * ld*2 a multiple of 16 bytes, base 16-byte aligned), copied in boxes of box_rows x
 * box_cols elements with the 128-byte swizzle (box_cols * 2 must be 128). Returns
 * cudaErrorInvalidValue when the driver rejects the description. */
cudaError_t mf_tensor_map_bf16_2d(CUtensorMap *map, const void *base, uint64_t rows,
                                  uint64_t cols, uint64_t ld, uint32_t box_rows,
                                  uint32_t box_cols);

#endif
