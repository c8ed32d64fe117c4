/* wgmma (sm_90a) wrappers: shared-memory matrix descriptors for K-major and MN-major
 * tiles with the 128-byte swizzle, the fence/commit/wait protocol, and the m64nN
 * instructions with both operands in shared memory and fp32 accumulators: one asm
 * statement per N (MF_WGMMA_M64N*_SS), a wrapper per precision (bf16: k16, each operand
 * K-major or MN-major through the transpose immediates; e4m3: k32, K-major only). Which
 * wrapper a tile runs is its precision's (sm90/precision.cuh). Also e4m3's form with A in
 * registers (RS) and the ldmatrix that loads A for it (common/mainloop.cuh's promoted K
 * loop). Inline device helpers only. */
#pragma once

#include <stdint.h>

#include "sm90/ptx/mbarrier.cuh"

namespace mf {
namespace ptx {

/* Descriptor of a K-major bf16 tile written by TMA with CU_TENSOR_MAP_SWIZZLE_128B:
 * rows of 64 elements (128 bytes), 8-row swizzle atoms of 1024 bytes stacked along
 * M/N. Fields: start address >> 4 (bits 0-13), leading byte offset >> 4 (16-29; unused
 * for swizzled K-major, set to 1), stride byte offset >> 4 (32-45; 1024 bytes between
 * 8-row groups), layout type (62-63; 1 = 128-byte swizzle). The tile base must be
 * 1024-byte aligned so the base-offset field (49-51) stays 0.
 * NOTE: stepping K by 16 elements inside the atom is +32 bytes on the start address
 * (+2 in the encoded field): the hardware applies the swizzle to the full address. */
__device__ __forceinline__ uint64_t make_desc_kmajor_sw128(const void *smem_tile) {
    const uint64_t addr = smem_u32(smem_tile);
    uint64_t desc = 0;
    desc |= (addr & 0x3FFFFull) >> 4;
    desc |= 1ull << 16;
    desc |= (uint64_t)(1024 >> 4) << 32;
    desc |= 1ull << 62;
    return desc;
}

/* Descriptor of an MN-major bf16 tile (M or N contiguous, "transposed" operand) written
 * by TMA with CU_TENSOR_MAP_SWIZZLE_128B in boxes of 64 MN elements (128 bytes) x kRowsK
 * K rows: inside a box, K row k sits at k * 128 bytes (swizzled in 8-row, 1024-byte
 * atoms); boxes for the next 64 MN elements follow each other `mn_stride_bytes` apart.
 * For MN-major swizzled layouts the two offsets swap roles against K-major: the leading
 * byte offset (16-29) is the step between 64-element MN atoms (one box), the stride
 * byte offset (32-45) the step between 8-row K groups (1024 bytes).
 * NOTE: stepping K by 16 elements is +16 rows = +2048 bytes on the start address (+128
 * in the encoded field), i.e. two whole swizzle atoms, so the base-offset field stays 0. */
__device__ __forceinline__ uint64_t make_desc_mnmajor_sw128(const void *smem_tile,
                                                           uint32_t mn_stride_bytes) {
    const uint64_t addr = smem_u32(smem_tile);
    uint64_t desc = 0;
    desc |= (addr & 0x3FFFFull) >> 4;
    desc |= (uint64_t)((mn_stride_bytes >> 4) & 0x3FFFu) << 16;
    desc |= (uint64_t)(1024 >> 4) << 32;
    desc |= 1ull << 62;
    return desc;
}

/* Orders prior register/shared accesses before the next wgmma of this warpgroup. */
__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

/* Waits until at most N committed wgmma groups of this thread are still pending. */
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

/* The m64nN instruction with both operands in shared memory and D (N/2 fp32 registers
 * per thread) in registers, as one asm statement: OP is the instruction
 * ("wgmma.mma_async.sync.aligned.m64nNkK.f32.<a>.<b>"), TAIL what follows the scale-d
 * predicate (the scale immediates, and for 16-bit types the transpose immediates, with
 * their "n" operands after the asm's (d, desc_a, desc_b, scale_d)). scale_d = 0
 * overwrites D. A precision's wrappers below are these two macros and its OP strings. */
#define MF_WGMMA_M64N128_SS(OP, TAIL, ...)                                                 \
    asm volatile("{\n\t.reg .pred p;\n\t"                                                 \
                 "setp.ne.b32 p, %66, 0;\n\t" OP " "                                        \
                 MF_WGMMA_D64 ", %64, %65, p" TAIL ";\n\t}"                                 \
                 : MF_WGMMA_D64_OPERANDS                                                   \
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d), ##__VA_ARGS__)
#define MF_WGMMA_M64N256_SS(OP, TAIL, ...)                                                 \
    asm volatile("{\n\t.reg .pred p;\n\t"                                                 \
                 "setp.ne.b32 p, %130, 0;\n\t" OP " "                                       \
                 MF_WGMMA_D128 ", %128, %129, p" TAIL ";\n\t}"                              \
                 : MF_WGMMA_D128_OPERANDS                                                  \
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d), ##__VA_ARGS__)

/* The accumulator operands of m64n128 (64 registers) and m64n256 (128, the same first 64). */
#define MF_WGMMA_D_0_63 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define MF_WGMMA_D64 "{" MF_WGMMA_D_0_63 "}"
#define MF_WGMMA_D128 "{" MF_WGMMA_D_0_63 ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"
#define MF_WGMMA_D64_OPERANDS \
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define MF_WGMMA_D128_OPERANDS \
        MF_WGMMA_D64_OPERANDS, \
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

/* bf16: D[64 x N] (+)= A[64 x 16] * B[N x 16]^T, A and B K-major (kTransA/kTransB = 0)
 * or MN-major (1). */
template <int kTransA = 0, int kTransB = 0>
__device__ __forceinline__ void wgmma_m64n256k16_bf16_ss(float (&d)[128], uint64_t desc_a,
                                                        uint64_t desc_b, int scale_d) {
    MF_WGMMA_M64N256_SS("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16",
                        ", 1, 1, %131, %132", "n"(kTransA), "n"(kTransB));
}

template <int kTransA = 0, int kTransB = 0>
__device__ __forceinline__ void wgmma_m64n128k16_bf16_ss(float (&d)[64], uint64_t desc_a,
                                                        uint64_t desc_b, int scale_d) {
    MF_WGMMA_M64N128_SS("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16",
                        ", 1, 1, %67, %68", "n"(kTransA), "n"(kTransB));
}

/* e4m3: D[64 x N] (+)= A[64 x 32] * B[N x 32]^T, both K-major (8-bit types have no
 * transpose immediates). */
__device__ __forceinline__ void wgmma_m64n256k32_e4m3_ss(float (&d)[128], uint64_t desc_a,
                                                        uint64_t desc_b, int scale_d) {
    MF_WGMMA_M64N256_SS("wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3", ", 1, 1");
}

__device__ __forceinline__ void wgmma_m64n128k32_e4m3_ss(float (&d)[64], uint64_t desc_a,
                                                        uint64_t desc_b, int scale_d) {
    MF_WGMMA_M64N128_SS("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3", ", 1, 1");
}

/* e4m3 with A from registers (the RS form): a[4] this thread's 16 values of A [64 x 32]
 * (ldmatrix_a_e4m3's layout), B K-major in shared memory. */
__device__ __forceinline__ void wgmma_m64n128k32_e4m3_rs(float (&d)[64], const uint32_t (&a)[4],
                                                        uint64_t desc_b, int scale_d) {
    asm volatile("{\n\t.reg .pred p;\n\t"
                 "setp.ne.b32 p, %69, 0;\n\t"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " MF_WGMMA_D64
                 ", {%64, %65, %66, %67}, %68, p, 1, 1;\n\t}"
                 : MF_WGMMA_D64_OPERANDS
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

/* This thread's part of A [64 x 32] (e4m3, K-major, the 128-byte swizzle of a TMA tile
 * whose rows are 128 bytes: chunk c of row r at chunk c ^ (r % 8)) at K offset k0 (a
 * multiple of 32) of the warpgroup's 64 rows at `rows`, in the RS wgmma's layout: register
 * 2 h + j holds row 16 warp + lane / 4 + 8 j, K k0 + 16 h + 4 (lane % 4) .. + 3. One
 * ldmatrix.x4: its matrices are (rows 0-7, 8-15) x (K k0 .. + 15, k0 + 16 .. + 31) of the
 * warp's 16 rows, lane l naming row l % 8 of matrix l / 8. `rows` must be 1024-byte
 * aligned (the swizzle's phase is the row's index within its 1024-byte atom). */
__device__ __forceinline__ void ldmatrix_a_e4m3(const uint8_t *rows, int k0, uint32_t (&a)[4]) {
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
    const int r = 16 * warp + lane % 8 + 8 * ((lane / 8) % 2);
    const int chunk = k0 / 16 + lane / 16;
    const uint32_t addr = smem_u32(rows + r * 128 + ((chunk ^ (r % 8)) * 16));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
                 : "r"(addr));
}

/* Keeps A's registers live and unmodified up to here (after the wait of the wgmmas that
 * read them), as wgmma_fence_operand does D's. */
__device__ __forceinline__ void wgmma_fence_a(uint32_t (&a)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

__device__ __forceinline__ void wgmma_fence_operand(float (&d)[128]) {
#pragma unroll
    for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

__device__ __forceinline__ void wgmma_fence_operand(float (&d)[64]) {
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

}  // namespace ptx
}  // namespace mf
