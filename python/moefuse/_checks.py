"""Argument checks and conversions of the experts op (ops.py) and of its expert-parallel
module (distributed.py): the device and stream, the bf16 row layouts the library reads
in place, int32 ids, the aligned saved buffer, the weight-gradient dtype, and the
checks of experts()'s operands that raise naming the argument.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from . import _lib

_BF16 = torch.bfloat16
_SAVED_ALIGN = 256  # bytes, what moefuse_fwd_args.saved asks for
_CUDA_ALIGN = 16  # bytes, what the CUDA backend asks of bf16 tensors and row strides


def _normalize_device(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _on_device(device: torch.device):
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _stream(device: torch.device) -> int:
    """cudaStream_t of the current stream as an int for CUDA, 0 (NULL) for the CPU."""
    if device.type == "cuda":
        return torch.cuda.current_stream(device).cuda_stream
    return 0


def _backend(device: torch.device) -> _lib.Backend:
    return _lib.Backend.CUDA if device.type == "cuda" else _lib.Backend.CPU


def _rows_ok(t: torch.Tensor, hidden: int) -> bool:
    """Whether a [T, H] bf16 tensor can be passed as is: unit column stride and a row
    stride >= H (and, on CUDA, 16-byte aligned pointer and row stride)."""
    if t.stride(1) != 1 or (t.shape[0] > 1 and t.stride(0) < hidden):
        return False
    if t.device.type == "cuda":
        return t.data_ptr() % _CUDA_ALIGN == 0 and (t.stride(0) * 2) % _CUDA_ALIGN == 0
    return True


def _as_rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    """t if the library can read it in place, else a contiguous copy (a [T, H] copy
    is cheap next to the experts' GEMMs; the result is the same)."""
    return t if _rows_ok(t, hidden) else t.contiguous()


def _row_stride(t: torch.Tensor, hidden: int) -> int:
    return t.stride(0) if t.shape[0] > 1 else hidden


def _ids_as_int32(ids: torch.Tensor, where: str) -> torch.Tensor:
    """ids as int32, the library's type. int64 ids outside the int32 range would wrap
    when narrowed (2^32 + 7 to expert 7, 2^32 - 1 to -1, a dropped slot): on the CPU they
    raise ValueError here; on CUDA (no host synchronization), and under torch.compile
    (which cannot branch on the ids' values without a graph break), they saturate to the
    int32 bounds, which the library's check of ids rejects (on the CPU at once; on CUDA
    in check_device_errors)."""
    if ids.dtype == torch.int32:
        return ids
    lo, hi = torch.iinfo(torch.int32).min, torch.iinfo(torch.int32).max
    if ids.device.type != "cpu" or torch.compiler.is_compiling():
        return ids.clamp(lo, hi).to(torch.int32)
    outside = (ids < lo) | (ids > hi)
    if ids.numel() and bool(outside.any()):
        t, k = (int(i) for i in outside.nonzero()[0])
        raise ValueError(f"{where}: ids[{t}][{k}] = {int(ids[t, k])} is outside int32, so it "
                         "is no expert id; expected -1 <= id < E")
    return ids.to(torch.int32)


def _bf16_weight(w: torch.Tensor) -> torch.Tensor:
    return w if w.dtype == _BF16 else w.to(_BF16).contiguous()


def _alloc_saved(num_bytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor of num_bytes whose data pointer is 256-byte aligned.

    The CUDA caching allocator hands out 512-byte aligned blocks; the CPU allocator
    only 64, so there the buffer is a view into a slightly larger one."""
    if device.type == "cuda":
        buf = torch.empty(num_bytes, dtype=torch.uint8, device=device)
        if buf.data_ptr() % _SAVED_ALIGN == 0:
            return buf
    raw = torch.empty(num_bytes + _SAVED_ALIGN, dtype=torch.uint8, device=device)
    offset = (-raw.data_ptr()) % _SAVED_ALIGN
    return raw[offset:offset + num_bytes]


def _aligned_saved(saved: torch.Tensor) -> torch.Tensor:
    """The saved buffer, copied to an aligned one if something (a saved-tensor hook
    that offloaded and brought it back) moved it off the 256-byte alignment."""
    if saved.data_ptr() % _SAVED_ALIGN == 0:
        return saved
    copy = _alloc_saved(saved.numel(), saved.device)
    copy.copy_(saved)
    return copy


def _wgrad_dtype(w13: torch.Tensor, w2: torch.Tensor) -> torch.dtype:
    """The dtype the library writes the weight gradients in: bf16 when both weights are
    bf16 (moefuse_bwd_args.dw13_bf16 / dw2_bf16: the fp32 gradients rounded to nearest
    even, half the bytes, no cast), else fp32 (master weights; the pair is both or
    neither, so mixed weights get fp32 and a cast)."""
    return _BF16 if w13.dtype == _BF16 and w2.dtype == _BF16 else torch.float32


def _wgrad_fields(dw13: torch.Tensor, dw2: torch.Tensor,
                  dw13_up: Optional[torch.Tensor] = None) -> dict:
    """The BwdArgs pointers of the weight-gradient outputs, by their dtype: the bf16 pair
    or the fp32 pair, the other NULL (the bf16 pair takes accumulate = 0 only); with
    dw13_up, dW13 in two halves (dw13 the gate half, dw13_up the up half)."""
    up = dw13_up.data_ptr() if dw13_up is not None else None
    if dw13.dtype == _BF16:
        return dict(dw13=None, dw2=None, dw13_bf16=dw13.data_ptr(), dw2_bf16=dw2.data_ptr(),
                    dw13_up=None, dw13_up_bf16=up)
    return dict(dw13=dw13.data_ptr(), dw2=dw2.data_ptr(), dw13_bf16=None, dw2_bf16=None,
                dw13_up=up, dw13_up_bf16=None)


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    """data_ptr for the args structs; None (NULL) for empty tensors."""
    if t is None or t.numel() == 0:
        return None
    return t.data_ptr()


def _shape_of(x: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
              w13_up: Optional[torch.Tensor] = None):
    """(T, H, I, E, K) from the operand shapes (w13 [E, 2I, H], or its gate half
    [E, I, H] beside w13_up)."""
    num_tokens, hidden = x.shape
    num_experts, rows, _ = w13.shape
    return (num_tokens, hidden, rows if w13_up is not None else rows // 2, num_experts,
            ids.shape[1])


def _w13_halves(w13, where: str = "moefuse.experts") -> tuple:
    """experts()'s w13 as (w13, w13_up): a tensor [E, 2I, H] is packed (w13_up None); a
    pair (gate [E, I, H], up [E, I, H]) is W13 in two halves (moefuse.h), as TorchTitan's
    w1 and w3."""
    if isinstance(w13, (tuple, list)):
        if len(w13) != 2:
            raise ValueError(f"{where}: w13 as halves must be (gate, up), got "
                             f"{len(w13)} tensors")
        return w13[0], w13[1]
    return w13, None


def _weight_names(w13_up, packed: str = "w13") -> tuple:
    """The names the checks give W13: packed, or its two halves."""
    return (packed,) if w13_up is None else ("w13[0] (gate)", "w13[1] (up)")


def _check_weight_tensors(where: str, weights, device, halves=None) -> None:
    """Each (name, w) of weights a bf16 or fp32 tensor on device, and halves, W13's
    (gate, up) when it comes in two, of one dtype. Raises TypeError / ValueError naming
    it."""
    for name, w in weights:
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(w).__name__}")
        if w.dtype not in (_BF16, torch.float32):
            raise TypeError(f"{where}: {name} must be bfloat16 (or float32 master weights), "
                            f"got {w.dtype}")
        if w.device != device:
            raise ValueError(f"{where}: {name} is on {w.device} but x is on {device}; all "
                             "operands must be on one device")
    # The library writes both halves' gradients in one dtype, and reads one dtype when it
    # quantizes them.
    if halves is not None and halves[0].dtype != halves[1].dtype:
        raise TypeError(f"{where}: w13's halves must share a dtype, got {halves[0].dtype} and "
                        f"{halves[1].dtype}")


def _check_weights_contiguous(where: str, weights) -> None:
    """Each (name, w) contiguous (after the shapes are checked: a transposed view has the
    wrong shape first)."""
    for name, w in weights:
        # A silent copy of every expert's weights per call would hide a layout mistake
        # (a transposed view) behind a large slowdown.
        if not w.is_contiguous():
            raise ValueError(f"{where}: {name} must be contiguous (row-major [E, out, in] "
                             f"like nn.Linear weights), got strides {w.stride()}")


def _validate_experts(x, ids, p, w13, w2, w13_up=None) -> torch.Tensor:
    """Raises TypeError / ValueError naming the argument; returns ids as int32. With
    w13_up, w13 and w13_up are the gate and up halves [E, I, H] of W13."""
    weights = tuple(zip(_weight_names(w13_up), (w13, w13_up))) + (("w2", w2),)
    for name, t in (("x", x), ("ids", ids), ("p", p)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"moefuse.experts: {name} must be a torch.Tensor, got {type(t).__name__}")
    _check_weight_tensors("moefuse.experts", weights, x.device,
                          None if w13_up is None else (w13, w13_up))
    if x.dtype != _BF16:
        raise TypeError(f"moefuse.experts: x must be bfloat16, got {x.dtype}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"moefuse.experts: ids must be int32 (or int64), got {ids.dtype}")
    if p.dtype != torch.float32:
        raise TypeError(f"moefuse.experts: p must be float32, got {p.dtype}")
    if x.dim() != 2:
        raise ValueError(f"moefuse.experts: x must be [T, H], got shape {tuple(x.shape)}")
    T, H = x.shape
    if ids.dim() != 2 or ids.shape[0] != T:
        raise ValueError(f"moefuse.experts: ids must be [T={T}, K], got shape {tuple(ids.shape)}")
    K = ids.shape[1]
    if tuple(p.shape) != tuple(ids.shape):
        raise ValueError(f"moefuse.experts: p must be [T={T}, K={K}] like ids, got shape "
                         f"{tuple(p.shape)}")
    if w13_up is None:
        if w13.dim() != 3 or w13.shape[2] != H or w13.shape[1] % 2 != 0:
            raise ValueError(f"moefuse.experts: w13 must be [E, 2I, H={H}], got shape "
                             f"{tuple(w13.shape)}")
        E, I = w13.shape[0], w13.shape[1] // 2
    else:
        if w13.dim() != 3 or w13.shape[2] != H or tuple(w13_up.shape) != tuple(w13.shape):
            raise ValueError(f"moefuse.experts: w13's halves (gate, up) must both be [E, I, "
                             f"H={H}], got {tuple(w13.shape)} and {tuple(w13_up.shape)}")
        E, I = w13.shape[0], w13.shape[1]
    if tuple(w2.shape) != (E, H, I):
        raise ValueError(f"moefuse.experts: w2 must be [E={E}, H={H}, I={I}] to match "
                         f"w13, got shape {tuple(w2.shape)}")
    if E == 0 or H == 0 or I == 0 or K == 0 or K > E:
        raise ValueError(f"moefuse.experts: expected E, H, I > 0 and 1 <= K <= E, got "
                         f"E={E}, H={H}, I={I}, K={K}")
    device = x.device
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"moefuse.experts: tensors must be on the CPU or a CUDA device, got {device}")
    for name, t in (("ids", ids), ("p", p)):
        if t.device != device:
            raise ValueError(f"moefuse.experts: {name} is on {t.device} but x is on {device}; "
                             "all operands must be on one device")
    _check_weights_contiguous("moefuse.experts", weights)
    return _ids_as_int32(ids, "moefuse.experts")
