/*
 * moefuse - the routed experts of a Mixture-of-Experts layer, forward and backward.
 *
 * The one public header. C11, usable from C, C++ and Python's ctypes.
 *
 * Shapes and math (names used everywhere, see shared/DESIGN.md section 1):
 *   T tokens on this rank, H hidden, I expert intermediate size, E experts in total,
 *   K experts per token, R ranks, E/R experts on each rank.
 *
 *   x      [T, H]         bf16   input tokens
 *   ids    [T, K]         int32  expert of each (token, slot); -1 = slot dropped
 *   p      [T, K]         fp32   routing weight of each slot (already normalized)
 *   W13    [E/R, 2I, H]   bf16   per expert: gate rows 0..I-1, up rows I..2I-1
 *                                (or as two halves, see "W13 in two halves" below)
 *   W2     [E/R, H, I]    bf16
 *
 *   forward, for each slot (t, k) with e = ids[t,k] >= 0:
 *       g, u = split(W13_e x_t);  a = silu(g) * u;  o = W2_e a
 *       y_t  = sum_k p[t,k] * o_(t,k)
 *   backward, given dy [T, H]:
 *       da' = W2_e^T dy_t;  dp[t,k] = <da', a>;  da = p * da'
 *       dg  = da * u * silu'(g);  du = da * silu(g)
 *       dx_t   = sum_k W13_e^T [dg; du]
 *       dW2_e  = sum over e's slots of (p dy) a^T
 *       dW13_e = sum over e's slots of [dg; du] x^T
 *
 * bf16 is passed as raw 16-bit words (uint16_t in memory, round-to-nearest-even).
 * Every matrix is row-major. Token-major tensors (x, y, dy, dx) take a row stride in
 * elements (>= H); everything else is contiguous.
 *
 * Pointers are host pointers for MOEFUSE_BACKEND_CPU and device pointers for
 * MOEFUSE_BACKEND_CUDA. The CUDA backend needs an sm_90 GPU (H100/H200), H and I in
 * multiples of 128, and 16-byte aligned bf16 tensors, row strides and fp32 weight
 * gradients.
 *
 * A layer owns workspaces: calls on one layer must be ordered (one host thread at a
 * time; on the CUDA backend, one stream or streams ordered by events). Use one layer
 * per concurrent stream; layers made with one comm share buffers and must not run
 * concurrently at all (see "expert parallelism"). Every call returns a status; on any status other than
 * MOEFUSE_OK, moefuse_last_error() says which argument was wrong and what was
 * expected, and no output has been touched. The library never exits or aborts.
 *
 * Not checked (the caller's to get right):
 *   - values: NaN or Inf in x, p, W13, W2 or dy propagate to the outputs they reach (a
 *     token's y, dx and d p through its experts; the weight gradients of every expert
 *     such a token is routed to), as in any matrix product;
 *   - the extent of a buffer beyond what its pointer, alignment and shape say (a
 *     tensor shorter than its shape is read or written past its end), except the saved
 *     buffer of the backward, whose size is passed (moefuse_bwd_args.saved_bytes);
 *   - outputs that overlap inputs or each other;
 *   - handles: a layer or comm used after it was destroyed, or destroyed twice, is
 *     undefined behaviour, as free() of a freed pointer is.
 */
#ifndef MOEFUSE_H
#define MOEFUSE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MOEFUSE_VERSION_MAJOR 0
#define MOEFUSE_VERSION_MINOR 7
#define MOEFUSE_VERSION_PATCH 0
/* MAJOR * 10000 + MINOR * 100 + PATCH */
#define MOEFUSE_VERSION                                                         \
    (MOEFUSE_VERSION_MAJOR * 10000 + MOEFUSE_VERSION_MINOR * 100 + MOEFUSE_VERSION_PATCH)

typedef enum moefuse_status {
    MOEFUSE_OK = 0,
    MOEFUSE_ERR_NULL_POINTER = 1,     /* a required pointer is NULL */
    MOEFUSE_ERR_MISALIGNED = 2,       /* a pointer or stride breaks the alignment asked */
    MOEFUSE_ERR_SHAPE = 3,            /* a shape or stride disagrees with the config */
    MOEFUSE_ERR_EXPERT_ID = 4,        /* an expert id outside [-1, E) */
    MOEFUSE_ERR_DUPLICATE_EXPERT = 5, /* the same expert twice in one token */
    MOEFUSE_ERR_TOO_MANY_TOKENS = 6,  /* T above the configured maximum */
    MOEFUSE_ERR_UNSUPPORTED = 7,      /* precision, backend or feature not built */
    MOEFUSE_ERR_INVALID_CONFIG = 8,   /* a config field out of range */
    MOEFUSE_ERR_NO_MEMORY = 9,        /* an allocation failed */
    MOEFUSE_ERR_CUDA = 10,            /* the CUDA runtime reported an error */
    MOEFUSE_ERR_NCCL = 11,            /* NCCL reported an error */
    MOEFUSE_ERR_TIMEOUT = 12,         /* a bounded wait for a peer ran out */
    MOEFUSE_ERR_SAVED_STATE = 13,     /* saved buffer not written by a matching forward */
    MOEFUSE_ERR_CAPACITY = 14,        /* a rank was routed more rows than it can receive */
} moefuse_status;

typedef enum moefuse_backend {
    MOEFUSE_BACKEND_CPU = 0,  /* host memory, fp32 math, OpenBLAS, all cores */
    MOEFUSE_BACKEND_CUDA = 1, /* device memory, sm_90a kernels */
} moefuse_backend;

typedef enum moefuse_precision {
    MOEFUSE_PRECISION_BF16 = 0,       /* bf16 operands, fp32 accumulation */
    /* e4m3 operands with fp32 scales per 1x128 tile (activations, their gradients),
     * 128x128 block (weights) or 128 tokens (weight-gradient operands); see "FP8 block
     * scales" below and docs/decisions/0018-fp8-block-recipe.md. CPU backend, and CUDA
     * on sm_90, on one rank or with a comm (the forward pushes x's codes, the backward's
     * received rows are quantized once they are all in: docs/decisions/0025). */
    MOEFUSE_PRECISION_FP8_BLOCK = 1,
} moefuse_precision;

/* What the forward keeps for the backward, in the caller's `saved` buffer. */
typedef enum moefuse_saved_mode {
    /* gate/up pre-activations [g; u] of every routed slot, bf16:
     * K * 2I * 2 bytes per token, plus the plan (moefuse_saved_bytes tells). */
    MOEFUSE_SAVE_ACTIVATIONS = 0,
    /* only the plan; the backward recomputes W13 x (one more gemm1, 1/3 of the
     * forward's FLOPs) */
    MOEFUSE_RECOMPUTE = 1,
    /* [g; u] as MOEFUSE_SAVE_ACTIVATIONS, and the expert-sorted input rows the forward
     * dispatched (what dW13 reads): K * (2I + H) * 2 bytes per token, plus the plan. The
     * backward skips its second dispatch of x. Same bits as MOEFUSE_SAVE_ACTIVATIONS.
     * CUDA backend without a comm. A layer with a comm refuses it at create: there the
     * backward's push moves each x row together with its dy row in one kernel, and the
     * received rows land in the layer's windows, not in the caller's buffer, so skipping
     * x needs a push of dy alone, which is not built. The CPU backend takes it as
     * MOEFUSE_SAVE_ACTIVATIONS (its gather of x is not worth keeping). */
    MOEFUSE_SAVE_ACTIVATIONS_AND_INPUTS = 2,
} moefuse_saved_mode;

/* How the CUDA forward and backward run their expert GEMMs (the CPU backend ignores it).
 * Both give the same bits. */
typedef enum moefuse_pipeline {
    /* one kernel per stage (the default: on an H200 it is faster than the fused kernels
     * so far, by 1-5% in the forward and 3-4% in the backward; see
     * docs/decisions/0008-staged-by-default) */
    MOEFUSE_PIPELINE_STAGED = 0,
    /* forward: gemm1 and gemm2 in one persistent kernel, a gemm2 tile starting as soon as
     * the gemm1 tiles of its rows are done (with expert parallelism, once their rows have
     * arrived); shapes it does not take (H a multiple of 128 but not 256) run staged.
     * backward: dW2, dgrad1 and dW13 in one persistent kernel after dgrad2 (with expert
     * parallelism its dgrad1 tiles store into the source ranks' combine rows); H and I
     * multiples of 256, other shapes run staged */
    MOEFUSE_PIPELINE_FUSED = 1,
} moefuse_pipeline;

typedef struct moefuse_config {
    int hidden;         /* H, > 0 */
    int intermediate;   /* I, > 0 */
    int num_experts;    /* E, total over all ranks, > 0, divisible by num_ranks */
    int top_k;          /* K, 1 <= K <= E */
    int max_tokens;     /* largest T any call on this rank will pass, > 0;
                           max_tokens * top_k * num_ranks rows, each expert's padded to
                           128, must stay below 2^31 */
    int num_ranks;      /* R, >= 1; R > 1 needs a moefuse_comm */
    int rank;           /* 0 <= rank < R */
    moefuse_precision precision;
    moefuse_backend backend;
    moefuse_saved_mode saved_mode;
    int num_threads;    /* CPU backend: worker threads, 0 = all cores */
    moefuse_pipeline pipeline;
    /* MOEFUSE_PRECISION_FP8_BLOCK: 1 = every scale rounded up to a power of two (exact
     * rescaling), 0 = amax / 448; must be 0 with MOEFUSE_PRECISION_BF16 */
    int fp8_pow2_scales;
    /* With a comm: the rows a rank can receive in one call, as a multiple of the
     * balanced load max_tokens * top_k (0 = the default 2.0; else >= 1.0; above R it
     * is R, the worst case). The receive windows and the saved buffer are sized by it
     * (plus each local expert's padding to 128 rows), not by R * max_tokens * K: at
     * R = 8 the worst case is 4x the default. A call whose routing sends a rank more
     * rows fails on every rank with MOEFUSE_ERR_CAPACITY (see "expert parallelism").
     * Why 2.0: a router trained with a load-balancing loss keeps each rank's load
     * within a few percent of the mean once trained and well under 2x early on; see
     * docs/decisions/0022-shared-windows-and-receive-capacity. Ignored without a comm
     * (one rank receives exactly T * K rows). */
    double recv_capacity_factor;
} moefuse_config;

/* Fill a config with the defaults (R = 1, bf16, CPU, saved activations, staged, receive
 * capacity 0 = the default). */
void moefuse_config_init(moefuse_config *cfg, int hidden, int intermediate,
                         int num_experts, int top_k, int max_tokens);

typedef struct moefuse_layer moefuse_layer; /* opaque */
typedef struct moefuse_comm moefuse_comm;   /* opaque; expert parallelism, see below */

/* ---- FP8 block scales (config.precision = MOEFUSE_PRECISION_FP8_BLOCK) --------------
 * Every expert GEMM takes e4m3 operands (OCP FP8: max 448, no infinity, 0x7f/0xff NaN;
 * round to nearest even, saturating) with one fp32 scale per tile: value = code * scale.
 * A tile's scale is amax / 448 (fp32; 1 for an all-zero tile; NaN when the tile holds a
 * NaN or infinity; at least 2^-126; with config.fp8_pow2_scales rounded up to a power of
 * two). Weights are quantized once per optimizer step by moefuse_quantize_weights, in
 * both orientations: Hopper's FP8 tensor cores read both operands K-major, so dgrad
 * needs W^T. The 128x128 blocks of W^T are those of W transposed, with the same scales,
 * so W^T's codes are exactly W's transposed.
 *
 * Layouts, row-major, the last index fastest; nb(n) = ceil(n / 128), a short last block
 * where n is no multiple of 128:
 *   w13        [E/R, 2I, H]          e4m3   W13 (gemm1's B, K = H)
 *   w13_scale  [E/R, nb(2I), nb(H)]  fp32   one per 128x128 block, K blocks fastest
 *   w13t       [E/R, H, 2I]          e4m3   W13^T (dgrad1's B, K = 2I)
 *   w13t_scale [E/R, nb(H), nb(2I)]  fp32
 *   w2         [E/R, H, I]           e4m3   W2 (gemm2's B, K = I)
 *   w2_scale   [E/R, nb(H), nb(I)]   fp32
 *   w2t        [E/R, I, H]           e4m3   W2^T (dgrad2's B, K = H)
 *   w2t_scale  [E/R, nb(I), nb(H)]   fp32
 * moefuse_fp8_weights_view carves all eight out of one buffer of
 * moefuse_fp8_weights_bytes bytes (each array 256-byte aligned), or set them yourself.
 * The saved buffer holds what it holds for bf16 (bf16 [g; u], or only the plan), and
 * y, dx, d p and the weight gradients keep their types. */
typedef struct moefuse_fp8_weights {
    /* what the arrays were sized for: set by moefuse_fp8_weights_view (or by hand) and
     * checked against the layer by every call that takes them */
    int hidden;              /* H */
    int intermediate;        /* I */
    int num_local_experts;   /* E/R */
    int pow2_scales;         /* config.fp8_pow2_scales of the layer they are for */
    uint8_t *w13;
    float *w13_scale;
    uint8_t *w13t;
    float *w13t_scale;
    uint8_t *w2;
    float *w2_scale;
    uint8_t *w2t;
    float *w2t_scale;
} moefuse_fp8_weights;

/* Element type of the weights moefuse_quantize_weights reads. */
typedef enum moefuse_dtype {
    MOEFUSE_DTYPE_BF16 = 0,
    MOEFUSE_DTYPE_FP32 = 1,
} moefuse_dtype;

/* ---- W13 in two halves ----------------------------------------------------------------
 * W13 and dW13 come in one of two layouts, picked per call by w13_up:
 *   packed (w13_up = NULL, the default of a zeroed struct): w13 is [E/R, 2I, H], each
 *       expert's gate rows 0..I-1 followed by its up rows I..2I-1; dW13 likewise;
 *   halves (w13_up set): w13 is the gate half [E/R, I, H] and w13_up the up half
 *       [E/R, I, H], two separate contiguous arrays (as a trainer keeping gate and up as
 *       two parameters, w1 and w3, holds them); dW13 then comes back in the same two
 *       halves, the gate half in dw13 (or dw13_bf16) and the up half in dw13_up (or
 *       dw13_up_bf16), [E/R, I, H] each.
 * The two layouts give the same bits in every output. The CUDA kernels read and write the
 * halves where they are (no copy is made), and so does moefuse_quantize_weights_halves;
 * an FP8_BLOCK layer reads its quantized weights (w13 and w13_up are not read there) and
 * writes dW13 in halves when dw13_up / dw13_up_bf16 is set. */

typedef struct moefuse_fwd_args {
    int num_tokens;              /* T, 0 <= T <= max_tokens */
    const uint16_t *x;           /* [T, H] bf16, row stride x_stride */
    int64_t x_stride;            /* elements, >= H */
    const int32_t *ids;          /* [T, K] expert ids in [-1, E); no repeats in a row */
    const float *weights;        /* [T, K] routing weights p */
    const uint16_t *w13;         /* [E/R, 2I, H] bf16; with w13_up: the gate half [E/R, I, H] */
    const uint16_t *w2;          /* [E/R, H, I] bf16 */
    uint16_t *y;                 /* out [T, H] bf16, row stride y_stride */
    int64_t y_stride;            /* elements, >= H */
    void *saved;                 /* out, moefuse_saved_bytes(T) bytes, 256-byte aligned;
                                    NULL when no backward will follow */
    int32_t *expert_counts;      /* optional out [E/R]: slots routed to each of this
                                    rank's experts (dropped slots not counted); NULL
                                    to skip */
    /* MOEFUSE_PRECISION_FP8_BLOCK: the quantized weights (w13 and w2 are then not read
     * and may be NULL); NULL with MOEFUSE_PRECISION_BF16 */
    const moefuse_fp8_weights *fp8_weights;
    /* the up half of W13 [E/R, I, H] bf16 (see "W13 in two halves"); NULL: w13 packed */
    const uint16_t *w13_up;
} moefuse_fwd_args;

typedef struct moefuse_bwd_args {
    int num_tokens;              /* T of the forward that wrote `saved` */
    const uint16_t *x;           /* [T, H] bf16, the forward's input */
    int64_t x_stride;
    const int32_t *ids;          /* [T, K], the forward's */
    const float *weights;        /* [T, K], the forward's */
    const uint16_t *w13;         /* [E/R, 2I, H] bf16, the forward's (with w13_up: the gate
                                    half [E/R, I, H]) */
    const uint16_t *w2;          /* [E/R, H, I] bf16, the forward's */
    const void *saved;           /* the buffer the forward filled */
    size_t saved_bytes;          /* its size in bytes, >= moefuse_saved_bytes(T) */
    const uint16_t *dy;          /* [T, H] bf16, gradient of y */
    int64_t dy_stride;
    uint16_t *dx;                /* out [T, H] bf16; tokens with every slot dropped get 0 */
    int64_t dx_stride;
    float *dweights;             /* out [T, K] fp32, d p; dropped slots get 0 */
    float *dw13;                 /* out [E/R, 2I, H] fp32 (halves: the gate half [E/R, I, H]);
                                    NULL when dw13_bf16 is set */
    float *dw2;                  /* out [E/R, H, I] fp32; NULL when dw2_bf16 is set */
    int accumulate;              /* 0: dw13/dw2 = grad; 1: dw13/dw2 += grad */
    /* Weight gradients in bf16 instead (both or neither, write mode only): the fp32
     * gradient rounded to nearest even, bitwise that of dw13/dw2. For trainers whose
     * parameters and gradients are bf16: half the bytes, no cast afterwards. */
    uint16_t *dw13_bf16;         /* out [E/R, 2I, H] bf16 (halves: the gate half), or NULL */
    uint16_t *dw2_bf16;          /* out [E/R, H, I] bf16, or NULL */
    /* MOEFUSE_PRECISION_FP8_BLOCK: the forward's quantized weights (w13 and w2 are then
     * not read and may be NULL); NULL with MOEFUSE_PRECISION_BF16 */
    const moefuse_fp8_weights *fp8_weights;
    /* W13 and dW13 in two halves (see "W13 in two halves"): w13_up, the forward's up half
     * [E/R, I, H] bf16, NULL for packed; the up half of the gradient goes to dw13_up (fp32,
     * beside dw13) or dw13_up_bf16 (beside dw13_bf16), [E/R, I, H] each, set exactly when
     * w13_up is. FP8_BLOCK reads no w13: there dw13_up / dw13_up_bf16 alone picks the
     * halves (w13_up may be NULL; when set, the up gradient must be too). */
    const uint16_t *w13_up;
    float *dw13_up;
    uint16_t *dw13_up_bf16;
} moefuse_bwd_args;

/* Qwen3 routing: softmax over E logits in fp32, top-K, renormalize the K weights.
 * Ties pick the lower expert id. With T = 0 the arrays may be NULL. A NaN or +inf
 * logit makes that token's weights (and d logits) NaN while its ids stay valid and
 * distinct; a -inf logit masks its expert. The backward refuses ids outside [0, E)
 * (the forward never drops a slot) and repeated ids. */
typedef struct moefuse_route_args {
    int num_tokens;              /* T */
    int num_experts;             /* E */
    int top_k;                   /* K, 1 <= K <= E */
    const float *logits;         /* [T, E] fp32, contiguous */
    int32_t *ids;                /* out [T, K], in decreasing weight order */
    float *weights;              /* out [T, K], sum to 1 over each row */
} moefuse_route_args;

typedef struct moefuse_route_bwd_args {
    int num_tokens;              /* T */
    int num_experts;             /* E */
    int top_k;                   /* K */
    const float *logits;         /* [T, E], the forward's */
    const int32_t *ids;          /* [T, K], the forward's output */
    const float *dweights;       /* [T, K], gradient of the weights */
    float *dlogits;              /* out [T, E] */
} moefuse_route_bwd_args;

/* MOEFUSE_VERSION of the library that is loaded. */
int moefuse_version(void);

/* A static string naming the status ("MOEFUSE_ERR_SHAPE", ...). */
const char *moefuse_status_string(moefuse_status status);

/* The message of this thread's last failed call: names the argument and what was
 * expected. Empty string when the last call succeeded. Valid until the next call. */
const char *moefuse_last_error(void);

/* ---- expert parallelism (R > 1, CUDA backend) --------------------------------------
 * Rank r holds experts r*E/R .. (r+1)*E/R - 1 (W13, W2 and their gradients are the
 * local experts' only). Every rank calls the same sequence of forwards and backwards
 * on its layer; each call's tokens go to the ranks that hold their experts and come
 * back through the combine, all inside the calls' kernels (no host synchronization).
 * Each rank may pass a different T (0 included); config.max_tokens and
 * config.recv_capacity_factor must be the same on every rank. A rank receives up to
 * its capacity, recv_capacity_factor * max_tokens * K rows (default 2x the balanced
 * load, at most R * max_tokens * K): its receive windows, its per-call scratch and its
 * saved buffer (gate_up of received rows) are sized for that many rows plus each local
 * expert's padding to 128 (moefuse_layer_memory reports the bytes). A call whose
 * routing sends some rank more rows than its capacity fails on every rank alike: the
 * count exchange shows every rank the same counts, so no rank sends a row, writes y,
 * saved or expert_counts, and moefuse_layer_check returns MOEFUSE_ERR_CAPACITY on every
 * rank, naming the rank, its experts, the rows asked and the capacity. Nothing is
 * dropped silently; the next call works (no re-creation needed).
 *
 * Every wait for a peer is bounded by the comm's timeout: when it runs out, that call
 * writes no output and moefuse_layer_check returns MOEFUSE_ERR_TIMEOUT naming the
 * rank, the peer, the stage and the values seen. Destroy every rank's layer after a
 * timeout; layers created again on the comm start from clean flags.
 *
 * A bad expert id on one rank (moefuse_layer_check there) makes that rank send no rows
 * and write no y / expert_counts (no dx / d p in its backward), while it still serves
 * the rows the other ranks send it. After a timeout the weight gradients of that call
 * are not valid either. A saved buffer that one rank's backward rejects
 * (MOEFUSE_ERR_SAVED_STATE there) fails that backward on every rank: the others report
 * MOEFUSE_ERR_TIMEOUT naming that rank.
 *
 * A comm is made once and given to moefuse_layer_create of every rank's layers (with
 * config.num_ranks = R and config.rank = r): any number of layers per rank (one per MoE
 * layer of a model), created and destroyed on all ranks in the same order with the same
 * configs but config.rank; a call on a layer needs every rank's layer of that order
 * created. A one-rank comm runs the expert-parallel kernels with R = 1 (same results as
 * no comm). Create and destroy layers while no call on the comm is in flight.
 *
 * Shared buffers: the receive windows (the rows, the combine slots, the flags) and the
 * per-call scratch sized by the capacity belong to the comm, one set per rank, shared
 * by that rank's layers and sized by the largest of them. A layer created later that
 * needs more grows them at its create (with NCCL a collective re-registration of the
 * windows on every rank, at the same point of every rank's sequence of creates); they
 * are freed with the rank's last layer. So the layers of one comm must run in stream
 * order on each rank: two layers of one comm must not run concurrently (on different
 * streams without events between them, or from two host threads); the library does not
 * detect it (a stream switch is legal when ordered by events, and looks the same).
 * Forwards and backwards of different layers may interleave in any order (a layer's
 * backward after other layers' forwards, several forwards of one layer before their
 * backwards): everything a backward needs from its forward is in the caller's saved
 * buffer (the plan, the receive layout, the saved activations); the backward sends the
 * rows, their sources and their p again, and nothing of a forward is read from the
 * shared buffers by a later call. */

/* R virtual ranks inside this process on the current GPU (for tests): each rank has its
 * own buffers and each rank's layer its own stream; give each rank's calls their own
 * stream and launch all ranks' calls before waiting for any (their kernels wait on
 * each other). The GEMMs of each rank use SMs / R blocks, so all ranks are resident.
 * Each rank uses two streams (its caller's and one of its own); layer creation asks for
 * CUDA_DEVICE_MAX_CONNECTIONS >= 2R + 2 in the environment before CUDA starts, so that
 * no waiting kernel shares a hardware queue with a kernel it waits for.
 * MOEFUSE_ERR_UNSUPPORTED without an sm_90 GPU (or in a build without CUDA). */
moefuse_status moefuse_comm_create_virtual(int num_ranks, moefuse_comm **out);

/* One rank per process over the caller's NCCL communicator (an ncclComm_t, e.g. made
 * from a ncclUniqueId the trainer broadcast; NCCL >= 2.28). The comm stays the caller's
 * and must outlive every layer made with it. Needs: the loaded libnccl's version equal
 * to the one moefuse was built against, NCCL_NVLS_ENABLE=0 in the environment, one GPU
 * per rank, every rank reachable by NVLink load/store, and the communicator's device
 * current. Layers are created (and destroyed) on all ranks together, with the same
 * config but config.rank: their windows are registered collectively.
 * MOEFUSE_ERR_UNSUPPORTED when the library was built without NCCL. */
moefuse_status moefuse_comm_create_nccl(void *nccl_comm, moefuse_comm **out);

/* The bound on every wait for a peer, in milliseconds (default 30000, >= 1); read by
 * every call. */
moefuse_status moefuse_comm_set_timeout_ms(moefuse_comm *comm, int timeout_ms);

/* Frees the comm; every layer made with it must be destroyed first. NULL is allowed. */
moefuse_status moefuse_comm_destroy(moefuse_comm *comm);

/* Checks cfg, allocates the layer's workspaces for cfg->max_tokens.
 * comm: NULL for one rank without expert-parallel kernels; else the comm of all R
 * ranks (see above). With an NCCL comm, the create is collective: every rank's layer
 * allocates what it needs locally first, the ranks then agree (an all-reduce) that all
 * of them succeeded, and only then register windows; a rank that failed makes every
 * rank's create fail with a message naming it, instead of leaving the others waiting.
 * The config checks before any allocation (the fields, config.rank against the comm,
 * num_experts against the comm's other layers) are not agreed on: a config refused on
 * one rank only leaves the others waiting, so pass the same config on every rank. */
moefuse_status moefuse_layer_create(const moefuse_config *cfg, moefuse_comm *comm,
                                    moefuse_layer **out);

/* Frees the layer. NULL is allowed. */
moefuse_status moefuse_layer_destroy(moefuse_layer *layer);

/* Bytes the forward writes into `saved` for T tokens (T <= max_tokens). On a layer made
 * with a comm (any R, one rank included) the gate_up rows are those this rank receives:
 * sized for its receive capacity (config.recv_capacity_factor) whatever T is. */
moefuse_status moefuse_saved_bytes(const moefuse_layer *layer, int num_tokens,
                                   size_t *bytes);

/* ---- memory ---------------------------------------------------------------------------
 * Device bytes of a layer, for capacity planning. Set struct_size = sizeof(moefuse_memory)
 * before the call; the library fills the fields of its version that fit in struct_size
 * (so a caller built against an older header keeps working) and sets version. */
#define MOEFUSE_MEMORY_VERSION 1
typedef struct moefuse_memory {
    size_t struct_size;          /* in: sizeof(moefuse_memory) */
    int version;                 /* out: MOEFUSE_MEMORY_VERSION of the library */
    int shared_layers;           /* this rank's layers sharing the comm's buffers; 0 with no comm */
    int64_t recv_capacity_rows;  /* rows this rank may receive per call (no comm: max_tokens * K) */
    int64_t rows_cap;            /* the expert-sorted buffers' rows: the capacity and each
                                    local expert's padding to 128, in whole 128-row blocks */
    /* with a comm: this rank's buffers on the comm, shared by its layers */
    size_t comm_window_bytes;    /* the symmetric windows (rows, combine slots, flags) */
    size_t comm_scratch_bytes;   /* the per-call scratch sized by the capacity */
    size_t layer_window_bytes;   /* what this layer alone needs of comm_window_bytes */
    size_t layer_scratch_bytes;  /* what this layer alone needs of comm_scratch_bytes */
    /* the layer's own device workspaces (without a comm, its row buffers and scratch too) */
    size_t workspace_bytes;
    /* the forward-to-backward state of one call at max_tokens: moefuse_saved_bytes(max_tokens),
     * the caller's buffer, one per forward in flight */
    size_t saved_bytes;
} moefuse_memory;

/* Fills *out for a created layer. The CPU backend reports saved_bytes alone. */
moefuse_status moefuse_layer_memory(const moefuse_layer *layer, moefuse_memory *out);

/* What moefuse_layer_memory would report for a CUDA layer of this config (backend
 * MOEFUSE_BACKEND_CUDA), made with a comm of cfg->num_ranks ranks (with_comm 1; config
 * num_ranks 1 and with_comm 0 for a layer without one) as its rank's largest layer, with
 * shared_layers = 1. Needs no GPU: for planning, and for the tables of bench/. */
moefuse_status moefuse_memory_estimate(const moefuse_config *cfg, int with_comm,
                                       moefuse_memory *out);

/* y = routed experts of x (see the math above). stream: a cudaStream_t for the CUDA
 * backend, ignored (NULL) for the CPU backend. Several forwards may be in flight
 * before their backwards as long as each has its own `saved` buffer. */
moefuse_status moefuse_forward(moefuse_layer *layer, const moefuse_fwd_args *args,
                               void *stream);

/* dx, d p, dW13, dW2 from dy and the forward's saved buffer. */
moefuse_status moefuse_backward(moefuse_layer *layer, const moefuse_bwd_args *args,
                                void *stream);

/* ---- FP8 block-scaled weights ---------------------------------------------------------
 * Bytes of one buffer holding all eight arrays of moefuse_fp8_weights for this layer's
 * E/R, H and I (each array at a 256-byte aligned offset). */
moefuse_status moefuse_fp8_weights_bytes(const moefuse_layer *layer, size_t *bytes);

/* Points out's arrays into `buffer` (moefuse_fp8_weights_bytes bytes, 256-byte aligned,
 * host memory for the CPU backend, device memory for the CUDA backend) and sets its
 * shape fields from the layer. Writes nothing into the buffer. */
moefuse_status moefuse_fp8_weights_view(const moefuse_layer *layer, void *buffer,
                                        moefuse_fp8_weights *out);

/* Quantizes W13 [E/R, 2I, H] (packed: the layout of "W13 in two halves" without w13_up)
 * and W2 [E/R, H, I] (bf16 or fp32, contiguous; 16-byte aligned on the CUDA backend,
 * whose quantizer reads 16-byte pieces, naturally aligned on the CPU) into out's eight
 * arrays, in 128x128 blocks with the layer's scale rule; once per optimizer step.
 * Needs a layer of precision MOEFUSE_PRECISION_FP8_BLOCK. Deterministic; a NaN or
 * infinity in a weight makes its block NaN. stream: as for moefuse_forward. */
moefuse_status moefuse_quantize_weights(const moefuse_layer *layer, moefuse_dtype dtype,
                                        const void *w13, const void *w2,
                                        const moefuse_fp8_weights *out, void *stream);

/* moefuse_quantize_weights of W13 in two halves: w13 the gate half [E/R, I, H] and w13_up
 * the up half [E/R, I, H] (both of `dtype`, contiguous, aligned as W13), read where they
 * are; out gets the codes and scales the packed W13 gets, byte for byte. */
moefuse_status moefuse_quantize_weights_halves(const moefuse_layer *layer, moefuse_dtype dtype,
                                               const void *w13, const void *w13_up,
                                               const void *w2, const moefuse_fp8_weights *out,
                                               void *stream);

/* The CUDA backend reads expert ids from device memory, so moefuse_forward checks
 * them on the device without a host synchronization: a bad id makes that call write
 * no output (y, saved, expert_counts) and is recorded in the layer. This call waits
 * for `stream` and returns the first such error (MOEFUSE_ERR_EXPERT_ID or
 * MOEFUSE_ERR_DUPLICATE_EXPERT, naming the token), clearing it; else MOEFUSE_OK.
 * The CPU backend checks ids before any work, so there it always returns OK. */
moefuse_status moefuse_layer_check(moefuse_layer *layer, void *stream);

/* Qwen3 routing helper and its backward (d logits from d weights). */
moefuse_status moefuse_route_forward(const moefuse_route_args *args, moefuse_backend backend,
                                     void *stream);
moefuse_status moefuse_route_backward(const moefuse_route_bwd_args *args,
                                      moefuse_backend backend, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* MOEFUSE_H */
