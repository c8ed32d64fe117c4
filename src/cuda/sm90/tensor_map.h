/* Host helper: TMA descriptors (CUtensorMap) for 2D tensors, encoded through the driver
 * entry point that the runtime hands out, so the library does not link libcuda. */
#ifndef MOEFUSE_CUDA_TENSOR_MAP_H
#define MOEFUSE_CUDA_TENSOR_MAP_H

#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>

/* A row-major matrix of `type` elements (bf16, fp16, 8-bit or fp32), `rows` rows of `cols`
 * elements (row stride `ld` elements, a multiple of 16 bytes, base 16-byte aligned),
 * copied in boxes of box_rows x box_cols elements with the 128-byte swizzle (box_cols
 * elements must be 128 bytes). The tile code calls it through its precision
 * (tensor_map_2d<P>, sm90/precision.cuh). Returns cudaErrorInvalidValue when the
 * driver rejects the description or the type is not one of those. */
cudaError_t mf_tensor_map_2d(CUtensorMap *map, CUtensorMapDataType type, const void *base,
                             uint64_t rows, uint64_t cols, uint64_t ld, uint32_t box_rows,
                             uint32_t box_cols);

#endif
