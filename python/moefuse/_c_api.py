"""The C API's types, mirrored in ctypes: the version these mirrors match, the enums,
the args structs, the opaque handles and every function's signature (include/moefuse.h).
_lib.py loads the library with these signatures and re-exports every name.
"""

from __future__ import annotations

import ctypes
import enum

# The MOEFUSE_VERSION (MAJOR * 10000 + MINOR * 100 + PATCH) whose structs this file
# mirrors. While MAJOR is 0 a MINOR change may change the structs, so MAJOR and MINOR
# must match exactly; PATCH may differ.
EXPECTED_VERSION = 700


class Status(enum.IntEnum):
    """moefuse_status."""

    OK = 0
    ERR_NULL_POINTER = 1
    ERR_MISALIGNED = 2
    ERR_SHAPE = 3
    ERR_EXPERT_ID = 4
    ERR_DUPLICATE_EXPERT = 5
    ERR_TOO_MANY_TOKENS = 6
    ERR_UNSUPPORTED = 7
    ERR_INVALID_CONFIG = 8
    ERR_NO_MEMORY = 9
    ERR_CUDA = 10
    ERR_NCCL = 11
    ERR_TIMEOUT = 12
    ERR_SAVED_STATE = 13
    ERR_CAPACITY = 14  # a rank was routed more rows than its receive capacity


class Backend(enum.IntEnum):
    """moefuse_backend."""

    CPU = 0
    CUDA = 1


class Precision(enum.IntEnum):
    """moefuse_precision."""

    BF16 = 0
    FP8_BLOCK = 1  # CPU backend; the CUDA backend answers ERR_UNSUPPORTED at create


class SavedMode(enum.IntEnum):
    """moefuse_saved_mode: what the forward keeps for the backward."""

    SAVE_ACTIVATIONS = 0  # [g; u] of every routed slot, bf16
    RECOMPUTE = 1  # only the plan; the backward recomputes W13 x
    # [g; u] and the forward's expert-sorted x rows (one rank, CUDA: the backward does
    # not gather x again; the CPU backend keeps [g; u] only)
    SAVE_ACTIVATIONS_AND_INPUTS = 2


class Pipeline(enum.IntEnum):
    """moefuse_pipeline: how the CUDA forward and the one-rank backward run their expert
    GEMMs (same bits)."""

    STAGED = 0  # one kernel per stage (default: faster on an H200 so far, bench/RESULTS.md)
    FUSED = 1  # gemm1 and gemm2 in one persistent kernel


class DType(enum.IntEnum):
    """moefuse_dtype: the element type of the weights moefuse_quantize_weights reads."""

    BF16 = 0
    FP32 = 1


# ---- struct mirrors ------------------------------------------------------------------
# Enums are C ints. Data pointers are c_void_p (ABI-identical to the typed pointers of
# the header, whose C type each comment gives) so callers pass tensor.data_ptr().


class Config(ctypes.Structure):
    """moefuse_config."""

    _fields_ = [
        ("hidden", ctypes.c_int),  # H
        ("intermediate", ctypes.c_int),  # I
        ("num_experts", ctypes.c_int),  # E, total over all ranks
        ("top_k", ctypes.c_int),  # K
        ("max_tokens", ctypes.c_int),  # largest T any call will pass
        ("num_ranks", ctypes.c_int),  # R
        ("rank", ctypes.c_int),
        ("precision", ctypes.c_int),  # Precision
        ("backend", ctypes.c_int),  # Backend
        ("saved_mode", ctypes.c_int),  # SavedMode
        ("num_threads", ctypes.c_int),  # CPU backend: 0 = all cores
        ("pipeline", ctypes.c_int),  # Pipeline
        ("fp8_pow2_scales", ctypes.c_int),  # FP8_BLOCK: 1 = power-of-two scales
        # with a comm: rows a rank can receive per call, as a multiple of max_tokens * K
        # (0 = the default 2.0; else >= 1; above R it is R)
        ("recv_capacity_factor", ctypes.c_double),
    ]


MEMORY_VERSION = 1  # MOEFUSE_MEMORY_VERSION


class Memory(ctypes.Structure):
    """moefuse_memory: a layer's device bytes (moefuse_layer_memory, moefuse_memory_estimate).
    struct_size must be set to ctypes.sizeof(Memory) before the call."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("version", ctypes.c_int),
        ("shared_layers", ctypes.c_int),  # this rank's layers sharing the comm's buffers
        ("recv_capacity_rows", ctypes.c_int64),  # rows this rank may receive per call
        ("rows_cap", ctypes.c_int64),  # with each local expert's padding, whole 128-row blocks
        ("comm_window_bytes", ctypes.c_size_t),  # this rank's windows on the comm (shared)
        ("comm_scratch_bytes", ctypes.c_size_t),  # its per-call scratch on the comm (shared)
        ("layer_window_bytes", ctypes.c_size_t),  # what this layer alone needs of the windows
        ("layer_scratch_bytes", ctypes.c_size_t),  # ... of the scratch
        ("workspace_bytes", ctypes.c_size_t),  # the layer's own device workspaces
        ("saved_bytes", ctypes.c_size_t),  # forward-to-backward state of one call at max_tokens
    ]


class Fp8Weights(ctypes.Structure):
    """moefuse_fp8_weights: W13, W2 and their transposes as e4m3 codes with one fp32 scale
    per 128x128 block (nb(n) = ceil(n / 128)); moefuse_fp8_weights_view fills it."""

    _fields_ = [
        ("hidden", ctypes.c_int),  # H the arrays were sized for
        ("intermediate", ctypes.c_int),  # I
        ("num_local_experts", ctypes.c_int),  # E/R
        ("pow2_scales", ctypes.c_int),  # config.fp8_pow2_scales of the layer
        ("w13", ctypes.c_void_p),  # uint8_t* [E/R, 2I, H] e4m3
        ("w13_scale", ctypes.c_void_p),  # float* [E/R, nb(2I), nb(H)]
        ("w13t", ctypes.c_void_p),  # uint8_t* [E/R, H, 2I]
        ("w13t_scale", ctypes.c_void_p),  # float* [E/R, nb(H), nb(2I)]
        ("w2", ctypes.c_void_p),  # uint8_t* [E/R, H, I]
        ("w2_scale", ctypes.c_void_p),  # float* [E/R, nb(H), nb(I)]
        ("w2t", ctypes.c_void_p),  # uint8_t* [E/R, I, H]
        ("w2t_scale", ctypes.c_void_p),  # float* [E/R, nb(I), nb(H)]
    ]


class FwdArgs(ctypes.Structure):
    """moefuse_fwd_args."""

    _fields_ = [
        ("num_tokens", ctypes.c_int),  # T
        ("x", ctypes.c_void_p),  # const uint16_t* [T, H] bf16, row stride x_stride
        ("x_stride", ctypes.c_int64),  # elements
        ("ids", ctypes.c_void_p),  # const int32_t* [T, K]
        ("weights", ctypes.c_void_p),  # const float* [T, K]
        ("w13", ctypes.c_void_p),  # const uint16_t* [E/R, 2I, H] bf16
        ("w2", ctypes.c_void_p),  # const uint16_t* [E/R, H, I] bf16
        ("y", ctypes.c_void_p),  # uint16_t* out [T, H] bf16, row stride y_stride
        ("y_stride", ctypes.c_int64),
        ("saved", ctypes.c_void_p),  # void* out, saved_bytes(T), 256-byte aligned, or NULL
        ("expert_counts", ctypes.c_void_p),  # int32_t* optional out [E], or NULL
        ("fp8_weights", ctypes.c_void_p),  # const moefuse_fp8_weights*, FP8_BLOCK only
        # W13 in two halves: w13 is then the gate half [E/R, I, H] and this the up half
        ("w13_up", ctypes.c_void_p),  # const uint16_t* [E/R, I, H] bf16, or NULL (packed)
    ]


class BwdArgs(ctypes.Structure):
    """moefuse_bwd_args."""

    _fields_ = [
        ("num_tokens", ctypes.c_int),  # T of the forward that wrote `saved`
        ("x", ctypes.c_void_p),  # const uint16_t* [T, H] bf16
        ("x_stride", ctypes.c_int64),
        ("ids", ctypes.c_void_p),  # const int32_t* [T, K]
        ("weights", ctypes.c_void_p),  # const float* [T, K]
        ("w13", ctypes.c_void_p),  # const uint16_t* [E/R, 2I, H] bf16
        ("w2", ctypes.c_void_p),  # const uint16_t* [E/R, H, I] bf16
        ("saved", ctypes.c_void_p),  # const void*, the forward's
        ("saved_bytes", ctypes.c_size_t),  # its size, >= moefuse_saved_bytes(T)
        ("dy", ctypes.c_void_p),  # const uint16_t* [T, H] bf16
        ("dy_stride", ctypes.c_int64),
        ("dx", ctypes.c_void_p),  # uint16_t* out [T, H] bf16
        ("dx_stride", ctypes.c_int64),
        ("dweights", ctypes.c_void_p),  # float* out [T, K]
        ("dw13", ctypes.c_void_p),  # float* out [E/R, 2I, H] fp32; NULL with dw13_bf16
        ("dw2", ctypes.c_void_p),  # float* out [E/R, H, I] fp32; NULL with dw2_bf16
        ("accumulate", ctypes.c_int),  # 0: write dw13/dw2, 1: add into them
        # bf16 weight gradients instead (both or neither, accumulate = 0): the fp32 ones
        # rounded to nearest even
        ("dw13_bf16", ctypes.c_void_p),  # uint16_t* out [E/R, 2I, H] bf16, or NULL
        ("dw2_bf16", ctypes.c_void_p),  # uint16_t* out [E/R, H, I] bf16, or NULL
        ("fp8_weights", ctypes.c_void_p),  # const moefuse_fp8_weights*, FP8_BLOCK only
        # W13 and dW13 in two halves (w13, dw13 / dw13_bf16 then hold the gate halves)
        ("w13_up", ctypes.c_void_p),  # const uint16_t* [E/R, I, H] bf16, or NULL (packed)
        ("dw13_up", ctypes.c_void_p),  # float* out [E/R, I, H], beside dw13
        ("dw13_up_bf16", ctypes.c_void_p),  # uint16_t* out [E/R, I, H], beside dw13_bf16
    ]


class RouteArgs(ctypes.Structure):
    """moefuse_route_args."""

    _fields_ = [
        ("num_tokens", ctypes.c_int),  # T
        ("num_experts", ctypes.c_int),  # E
        ("top_k", ctypes.c_int),  # K
        ("logits", ctypes.c_void_p),  # const float* [T, E]
        ("ids", ctypes.c_void_p),  # int32_t* out [T, K]
        ("weights", ctypes.c_void_p),  # float* out [T, K]
    ]


class RouteBwdArgs(ctypes.Structure):
    """moefuse_route_bwd_args."""

    _fields_ = [
        ("num_tokens", ctypes.c_int),  # T
        ("num_experts", ctypes.c_int),  # E
        ("top_k", ctypes.c_int),  # K
        ("logits", ctypes.c_void_p),  # const float* [T, E]
        ("ids", ctypes.c_void_p),  # const int32_t* [T, K]
        ("dweights", ctypes.c_void_p),  # const float* [T, K]
        ("dlogits", ctypes.c_void_p),  # float* out [T, E]
    ]


LayerHandle = ctypes.c_void_p  # moefuse_layer*, opaque
CommHandle = ctypes.c_void_p  # moefuse_comm*, opaque (expert parallelism)

_STATUS = ctypes.c_int

# name -> (restype, argtypes). Every function of moefuse.h.
_SIGNATURES = {
    "moefuse_config_init": (
        None,
        [ctypes.POINTER(Config), ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
         ctypes.c_int],
    ),
    "moefuse_version": (ctypes.c_int, []),
    "moefuse_status_string": (ctypes.c_char_p, [_STATUS]),
    "moefuse_last_error": (ctypes.c_char_p, []),
    "moefuse_comm_create_virtual": (_STATUS, [ctypes.c_int, ctypes.POINTER(CommHandle)]),
    "moefuse_comm_create_nccl": (_STATUS, [ctypes.c_void_p, ctypes.POINTER(CommHandle)]),
    "moefuse_comm_set_timeout_ms": (_STATUS, [CommHandle, ctypes.c_int]),
    "moefuse_comm_destroy": (_STATUS, [CommHandle]),
    "moefuse_layer_create": (
        _STATUS, [ctypes.POINTER(Config), CommHandle, ctypes.POINTER(LayerHandle)]),
    "moefuse_layer_destroy": (_STATUS, [LayerHandle]),
    "moefuse_saved_bytes": (
        _STATUS, [LayerHandle, ctypes.c_int, ctypes.POINTER(ctypes.c_size_t)]),
    "moefuse_layer_memory": (_STATUS, [LayerHandle, ctypes.POINTER(Memory)]),
    "moefuse_memory_estimate": (
        _STATUS, [ctypes.POINTER(Config), ctypes.c_int, ctypes.POINTER(Memory)]),
    "moefuse_forward": (_STATUS, [LayerHandle, ctypes.POINTER(FwdArgs), ctypes.c_void_p]),
    "moefuse_backward": (_STATUS, [LayerHandle, ctypes.POINTER(BwdArgs), ctypes.c_void_p]),
    "moefuse_layer_check": (_STATUS, [LayerHandle, ctypes.c_void_p]),
    "moefuse_fp8_weights_bytes": (_STATUS, [LayerHandle, ctypes.POINTER(ctypes.c_size_t)]),
    "moefuse_fp8_weights_view": (
        _STATUS, [LayerHandle, ctypes.c_void_p, ctypes.POINTER(Fp8Weights)]),
    "moefuse_quantize_weights": (
        _STATUS, [LayerHandle, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                  ctypes.POINTER(Fp8Weights), ctypes.c_void_p]),
    "moefuse_quantize_weights_halves": (
        _STATUS, [LayerHandle, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                  ctypes.POINTER(Fp8Weights), ctypes.c_void_p]),
    "moefuse_route_forward": (
        _STATUS, [ctypes.POINTER(RouteArgs), ctypes.c_int, ctypes.c_void_p]),
    "moefuse_route_backward": (
        _STATUS, [ctypes.POINTER(RouteBwdArgs), ctypes.c_int, ctypes.c_void_p]),
}
