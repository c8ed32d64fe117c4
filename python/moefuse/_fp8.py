"""FP8 block scales (MOEFUSE_PRECISION_FP8_BLOCK, DeepSeek-V3's recipe) from PyTorch: the
precision option of the ops and modules, the error where FP8 does not run, and the cache
of quantized weights. The recipe itself is the C library's (src/cpu/fp8.c; the reasons
in docs/decisions/0018-fp8-block-recipe.md).

    precision="bf16"  bf16 GEMM operands (the default)
    precision="fp8"   every expert GEMM (forward, dgrad, wgrad) on e4m3 operands with fp32
                      scales per 1x128 tile (activations) or 128x128 block (weights);
                      fp8_pow2_scales=True rounds every scale up to a power of two
Runs on CPU tensors (the CPU backend) and on CUDA tensors of an sm_90 (Hopper) GPU (the
CUDA backend's FP8 kernels, on one GPU or with expert parallelism over a comm).
Fp8UnsupportedError where it does not run: a GPU older than sm_90. y, dx, d p and the
weight gradients keep their dtypes, and the weight gradients are of the real (bf16 or
fp32) weights.

Weights are quantized once per optimizer step, not per call (in a CUDA graph, once per
captured call: below). Fp8WeightCache (the `fp8` attribute of ops.layer_cache) keeps the
quantized W13, W2 and their transposes of each weight set (w13, w2, and w13_up for W13 in
halves), keyed by the tensors' storages (the storage objects themselves, not their
addresses), offsets, shapes, dtypes and the scale rule, and valid while
  - every version counter (tensor._version) is unchanged: every in-place update
    (optimizer.step() of SGD, Adam, ..., or `with torch.no_grad(): w.copy_(...)`) bumps
    them;
  - every tensor is still at the address it was quantized from: FSDP2 frees an unsharded
    parameter's memory after use and all-gathers it again later (untyped_storage().resize_,
    which bumps no version counter), possibly at another layer's former address, so an
    address alone would hand a layer another layer's quantization;
  - no optimizer has stepped since: fused optimizers (AdamW(fused=True)) update in place
    without bumping the counters, so a step of any torch.optim optimizer invalidates every
    entry (a post-step hook, registered at the first FP8 call);
  - the weights' storages are alive (an entry dies with its weights; it never holds them).
So gradient accumulation over micro-batches, the backward of each forward and the
recompute of activation checkpointing reuse one quantization. A CUDA graph capture never
reads the cache and never fills it: each captured call (forward, backward, recompute)
quantizes the weights inside the graph, so each replay reads the weights as they are
then (a cached quantization baked into a graph would go stale at the next optimizer
step, and its buffer be freed when the entry is replaced), at the cost of one
quantization per captured call, not per optimizer step; and what a capture quantized is
written only when the graph replays. What it cannot see: writes
through `w.data` (a tensor with its own version counter) outside a torch.optim step, and
optimizers outside torch.optim that write in place without bumping the counters; call
layer_cache.fp8.clear() after those. The lookup runs inside the custom ops'
implementations, never in traced code, so torch.compile(fullgraph=True) sees no break.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from typing import Optional

import torch

from . import _lib
from ._checks import _BF16, _CUDA_ALIGN, _alloc_saved, _bf16_weight, _on_device, _stream

PRECISIONS = {"bf16": _lib.Precision.BF16, "fp8": _lib.Precision.FP8_BLOCK}


def resolve_precision(precision: str, fp8_pow2_scales: bool, where: str) -> tuple[int, bool]:
    """(moefuse_precision, fp8_pow2_scales) of the option; raises ValueError / TypeError
    naming it."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        choices = ", ".join(repr(name) for name in PRECISIONS)
        raise ValueError(f"{where}: precision={precision!r}: expected one of {choices}")
    if not isinstance(fp8_pow2_scales, bool):
        raise TypeError(f"{where}: fp8_pow2_scales must be a bool, got {fp8_pow2_scales!r}")
    if fp8_pow2_scales and precision != "fp8":
        raise ValueError(f"{where}: fp8_pow2_scales=True applies to precision='fp8', got "
                         f"precision={precision!r}")
    return int(PRECISIONS[precision]), fp8_pow2_scales


# ---- where FP8 does not run ---------------------------------------------------------------


class Fp8UnsupportedError(_lib.MoefuseError):
    """precision='fp8' where it does not run: status MOEFUSE_ERR_UNSUPPORTED and a message
    saying why and what runs instead; when the library refused the layer, its own message
    ends the text (and the library's error is the __cause__)."""


_WHAT_RUNS = ("FP8 runs on CPU tensors (the CPU backend) and on sm_90 GPUs (moefuse.experts, "
              "MoEExperts, MoefuseQwen3MoeBlock, ExpertParallelExperts)")


def _gpu_words(device: torch.device) -> tuple[str, Optional[tuple[int, int]]]:
    if device.type != "cuda" or not torch.cuda.is_available():
        return str(device), None
    major, minor = torch.cuda.get_device_capability(device)
    return f"{device} ({torch.cuda.get_device_name(device)}, sm_{major}{minor})", (major, minor)


def create_layer(cfg: _lib.Config, device: torch.device,
                 comm: Optional[_lib.Comm] = None) -> _lib.Layer:
    """_lib.Layer(cfg, comm) on `device`; Fp8UnsupportedError where the library refuses an
    FP8 config, every other error as it is."""
    try:
        with _on_device(device):
            return _lib.Layer(cfg, comm)
    except _lib.MoefuseError as err:
        raise_if_unsupported(err, cfg, device)
        raise


def raise_if_unsupported(err: _lib.MoefuseError, cfg: _lib.Config,
                         device: torch.device) -> None:
    """Raises Fp8UnsupportedError from err when err is moefuse_layer_create refusing an
    FP8 config (MOEFUSE_ERR_UNSUPPORTED) where FP8 does not run: no usable GPU, or one
    older than sm_90. Returns otherwise (the caller re-raises err): on sm_90 FP8 runs, on
    one rank or with a comm, so a refusal there is of something else (the environment, a
    shape) and is raised as the library raised it."""
    if (cfg.precision != _lib.Precision.FP8_BLOCK
            or err.status != _lib.Status.ERR_UNSUPPORTED):
        return
    words, capability = _gpu_words(device)
    if capability is None:
        why = "this library does not run it"
    elif capability < (9, 0):
        why = ("moefuse's CUDA kernels (FP8 and BF16) are built for sm_90 (H100/H200) "
               "only")
    else:
        return
    raise Fp8UnsupportedError(
        err.function, err.status, err.status_name,
        f"precision='fp8' on {words}: {why}. {_WHAT_RUNS}. The library said: "
        f"{err.message}") from err


# ---- quantized weights, once per optimizer step ----------------------------------------------

_optimizer_steps = 0
_hook_lock = threading.Lock()
_hook = None


def _count_optimizer_step(_optimizer, _args, _kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


def _watch_optimizers() -> None:
    """Registers the post-step hook of every torch.optim optimizer, once."""
    global _hook
    if _hook is None:
        with _hook_lock:
            if _hook is None:
                from torch.optim.optimizer import register_optimizer_step_post_hook
                _hook = register_optimizer_step_post_hook(_count_optimizer_step)


def _version(w: torch.Tensor) -> Optional[int]:
    """The version counter; None for inference tensors, which have none (never cached)."""
    try:
        return w._version
    except RuntimeError:
        return None


class _Entry:
    """One weight pair's quantization (the struct, which holds its buffer), the state
    (versions, optimizer steps) it was made at and weak references to the weights'
    storages."""

    __slots__ = ("state", "weights", "storages", "__weakref__")

    def __init__(self, state, weights: _lib.Fp8Weights):
        self.state, self.weights, self.storages = state, weights, ()

    def alive(self) -> bool:
        return all(ref() is not None for ref in self.storages)

    def made_from(self, tensors) -> bool:
        """The entry was made from these tensors' storages (the very storage objects)."""
        return (len(self.storages) == len(tensors) and
                all(ref() is t.untyped_storage() for ref, t in zip(self.storages, tensors)))


def _ready_on_current_stream(weights: _lib.Fp8Weights) -> None:
    """A cached quantization read from another stream than the one that made it: that
    stream waits for the quantization, and the buffer is not reused until its work is done
    (record_stream), as the caching allocator needs for a tensor used on two streams."""
    made_on = getattr(weights, "stream", None)
    if made_on is None:
        return
    current = torch.cuda.current_stream(made_on.device)
    if current != made_on:
        current.wait_event(weights.ready)
        weights.buffer.record_stream(current)


class Fp8WeightCache:
    """Quantized weights keyed by the weight pair (see the module docstring)."""

    def __init__(self):
        self._entries: dict[tuple, _Entry] = {}
        self._lock = threading.RLock()  # an entry's weakref callback may run inside a lookup

    def get(self, layer: _lib.Layer, w13: torch.Tensor, w2: torch.Tensor,
            w13_up: Optional[torch.Tensor] = None) -> _lib.Fp8Weights:
        """The FP8 weights of (w13, w2) for `layer` (an FP8 layer of their shapes), made
        with moefuse_quantize_weights on the current stream when missing or stale. The
        struct (and its buffer) stays valid until the entry is replaced or cleared; hold
        the returned object during the call that reads it. w13_up: w13 in two halves
        (gate in w13), read where they are (moefuse_quantize_weights_halves). While a CUDA
        graph is captured the weights are quantized inside the graph, neither looked up nor
        kept (the module docstring says why)."""
        _watch_optimizers()
        weights = (w13, w2) if w13_up is None else (w13, w2, w13_up)
        versions = tuple(_version(w) for w in weights)
        state = (*versions, *(w.data_ptr() for w in weights), _optimizer_steps)
        if w13.is_cuda and torch.cuda.is_current_stream_capturing():
            return self._quantize(layer, w13, w2, w13_up, state).weights
        key = (tuple((id(w.untyped_storage()), w.storage_offset(), tuple(w.shape), w.dtype)
                     for w in weights), str(w13.device), int(layer.cfg.fp8_pow2_scales))
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.state == state and entry.made_from(weights):
                _ready_on_current_stream(entry.weights)
                return entry.weights
        entry = self._quantize(layer, w13, w2, w13_up, state)
        if None not in versions:
            self._store(key, entry, weights)
        return entry.weights

    def _quantize(self, layer: _lib.Layer, w13: torch.Tensor, w2: torch.Tensor,
                  w13_up: Optional[torch.Tensor], state) -> _Entry:
        device = w13.device
        sources = (w13, w2) if w13_up is None else (w13, w2, w13_up)
        all_bf16 = all(w.dtype == _BF16 for w in sources)
        # Read as they are: bf16, or fp32 master weights (a bf16 one of a mixed set
        # widened exactly), never rounded to bf16 first.
        if not all_bf16:
            sources = tuple(w.to(torch.float32).contiguous() for w in sources)
        if device.type == "cuda":  # the device's quantizer reads 16-byte pieces
            sources = tuple(w if w.data_ptr() % _CUDA_ALIGN == 0 else w.clone()
                            for w in sources)
        src13, src2 = sources[:2]
        up = sources[2].data_ptr() if w13_up is not None else 0
        dtype = _lib.DType.BF16 if all_bf16 else _lib.DType.FP32
        buffer = _alloc_saved(layer.fp8_weights_bytes(), device)
        weights = layer.fp8_weights_view(buffer.data_ptr())
        weights.buffer = buffer  # the struct points into it: alive as long as the struct
        with layer.lock, _on_device(device):
            layer.quantize_weights(dtype, src13.data_ptr(), src2.data_ptr(), weights,
                                   _stream(device), w13_up=up)
            if device.type == "cuda":
                weights.stream = torch.cuda.current_stream(device)
                weights.ready = torch.cuda.Event()
                weights.ready.record(weights.stream)
        return _Entry(state, weights)

    def _store(self, key: tuple, entry: _Entry, tensors) -> None:
        entry_ref = weakref.ref(entry)

        def forget(_dead_storage, key=key, entry_ref=entry_ref):
            with self._lock:
                current = self._entries.get(key)
                if current is not None and current is entry_ref():
                    del self._entries[key]

        entry.storages = tuple(weakref.ref(t.untyped_storage(), forget) for t in tensors)
        with self._lock:
            self._entries[key] = entry

    def clear(self) -> None:
        """Forgets every quantization (the next call of each weight pair quantizes)."""
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        with self._lock:
            # a copy: a storage dying meanwhile drops its entry (the lock is reentrant)
            return sum(entry.alive() for entry in list(self._entries.values()))


def weight_args(layer: _lib.Layer, w13: torch.Tensor, w2: torch.Tensor,
                cache: Fp8WeightCache, w13_up: Optional[torch.Tensor] = None
                ) -> tuple[dict, tuple]:
    """The weight fields of FwdArgs / BwdArgs for the layer's precision, and what must
    stay alive while the call reads them: bf16 w13 (with w13_up: its gate half, and the
    up half) and w2 (fp32 master weights cast), or the cached FP8 weights (w13, w13_up
    and w2 then NULL: not read)."""
    if layer.cfg.precision == _lib.Precision.FP8_BLOCK:
        fp8 = cache.get(layer, w13, w2, w13_up)
        return dict(w13=None, w13_up=None, w2=None, fp8_weights=ctypes.addressof(fp8)), (fp8,)
    w13, w2 = _bf16_weight(w13), _bf16_weight(w2)
    up = _bf16_weight(w13_up) if w13_up is not None else None
    return (dict(w13=w13.data_ptr(), w13_up=up.data_ptr() if up is not None else None,
                 w2=w2.data_ptr(), fp8_weights=None), (w13, up, w2))
