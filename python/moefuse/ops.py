"""PyTorch ops over libmoefuse: the routed experts and the Qwen3 routing helper.

Public functions (differentiable, torch.compile(fullgraph=True) friendly):

    experts(x, ids, p, w13, w2, recompute=False, save_inputs=None, precision="bf16",
            fp8_pow2_scales=False) -> y
        x    [T, H]      bf16
        ids  [T, K]      int32 (int64 is converted: it is what torch.topk returns);
                         expert id per slot, -1 = slot dropped
        p    [T, K]      fp32 routing weights
        w13  [E, 2I, H]  bf16 (or fp32 master weights: cast to bf16 for each call,
                         gradient returned in fp32 without the bf16 round trip);
                         or W13 in two halves, a pair (gate [E, I, H], up [E, I, H]):
                         read where they are, one gradient each (TorchTitan's w1, w3)
        w2   [E, H, I]   bf16 (or fp32, as w13)
        y    [T, H]      bf16
      Gradients flow to x, p, w13 and w2, each weight's in its dtype: bf16 weights get
      bf16 gradients written by the library (the fp32 gradients rounded to nearest
      even, no cast afterwards), fp32 master weights fp32 gradients.
      precision="fp8": every expert GEMM on block-scaled e4m3 operands, the weights
      quantized once per optimizer step (_fp8.py; in a CUDA graph, once per captured
      call): CPU tensors, and CUDA tensors on an sm_90 GPU; with expert parallelism
      through moefuse.distributed.

    route(logits, top_k) -> (ids int32 [T, K], weights fp32 [T, K])   (in _route.py)
        Qwen3 routing: softmax over E in fp32, top-K (ties: lower id), renormalize.
        Differentiable in logits.

Both are torch.library custom ops (moefuse::experts_fwd / experts_bwd, moefuse::route_fwd
/ route_bwd) with fake implementations and registered autograd, so torch.compile
traces through them without graph breaks.

CPU tensors run the C library's CPU backend; CUDA tensors its CUDA backend on the
current CUDA stream. The saved activations the backward needs live in a torch.uint8
tensor from PyTorch's allocator (moefuse_saved_bytes(T) bytes).

Layers (moefuse_layer handles: the workspaces of one config) are cached per
(H, I, E, K, device, saved mode, precision, pipeline, max_tokens bucket) in `layer_cache`
(with the FP8 weights, layer_cache.fp8), the one piece of module state, and destroyed at
interpreter exit (or by layer_cache.clear()).
The environment variable MOEFUSE_PIPELINE (staged, the default, or fused) picks how the
CUDA forward runs its two expert GEMMs and the one-rank backward its dW2, dgrad1 and dW13
(moefuse_config.pipeline; the same bits).

Id errors on CUDA: the CUDA backend checks expert ids on the device without a host
synchronization; a bad id leaves y unwritten and is recorded in the layer. Call
check_device_errors() (it synchronizes) where a trainer wants that check, e.g. after
the first step. The CPU backend checks ids before any work and raises at once.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Optional

import torch

from . import _fp8, _lib

# The checks and conversions live in _checks.py; their names stay importable from here.
from ._checks import (_BF16, _CUDA_ALIGN, _SAVED_ALIGN, _aligned_saved, _alloc_saved,
                      _as_rows, _ids_as_int32, _normalize_device, _on_device, _ptr,
                      _row_stride, _rows_ok, _shape_of, _stream, _validate_experts,
                      _w13_halves, _wgrad_dtype, _wgrad_fields)

_REEXPORTED = (_CUDA_ALIGN, _SAVED_ALIGN, _ids_as_int32, _rows_ok)  # used in _checks.py only

_MIN_TOKEN_BUCKET = 64


# ---- the layer cache ----------------------------------------------------------------


def token_bucket(num_tokens: int) -> int:
    """max_tokens of the cached layer that serves num_tokens: the next power of two
    (at least 64), so workspaces are at most 2x what a call needs and a run with
    varying T creates O(log T) layers, not one per T."""
    return max(_MIN_TOKEN_BUCKET, 1 << max(0, (num_tokens - 1).bit_length()))


def pipeline_from_env() -> _lib.Pipeline:
    """moefuse_config.pipeline from MOEFUSE_PIPELINE ("staged" when unset)."""
    name = os.environ.get("MOEFUSE_PIPELINE", "staged")
    try:
        return _lib.Pipeline[name.strip().upper()]
    except KeyError:
        choices = ", ".join(p.name.lower() for p in _lib.Pipeline)
        raise ValueError(f"MOEFUSE_PIPELINE={name!r}: expected one of {choices}") from None


class LayerCache:
    """moefuse_layer handles keyed by (hidden, intermediate, num_experts, top_k, device,
    saved_mode, precision, fp8_pow2_scales, pipeline, max_tokens bucket). A forward and
    its backward use the same key, so the backward reads its saved buffer with the layer
    that wrote it (both pipelines write the same saved format). `fp8`: FP8 weights."""

    def __init__(self):
        self._layers: dict[tuple, _lib.Layer] = {}
        self._lock = threading.Lock()
        self.fp8 = _fp8.Fp8WeightCache()

    def get(self, hidden: int, intermediate: int, num_experts: int, top_k: int,
            num_tokens: int, device: torch.device, saved_mode: int, precision: int = 0,
            fp8_pow2_scales: bool = False) -> _lib.Layer:
        saved_mode = _lib.SavedMode(saved_mode)
        bucket = token_bucket(num_tokens)
        device = _normalize_device(device)
        pipeline = pipeline_from_env()
        key = (hidden, intermediate, num_experts, top_k, str(device), int(saved_mode),
               int(precision), bool(fp8_pow2_scales), int(pipeline), bucket)
        layer = self._layers.get(key)
        if layer is not None:
            return layer
        with self._lock:
            layer = self._layers.get(key)
            if layer is None:
                cfg = _lib.config_init(hidden, intermediate, num_experts, top_k, bucket)
                cfg.backend = _lib.Backend.CUDA if device.type == "cuda" else _lib.Backend.CPU
                cfg.saved_mode = saved_mode
                cfg.pipeline = pipeline
                cfg.precision, cfg.fp8_pow2_scales = int(precision), int(fp8_pow2_scales)
                layer = _fp8.create_layer(cfg, device)
                layer.device = device
                self._layers[key] = layer
            return layer

    def layers(self) -> list[_lib.Layer]:
        with self._lock:
            return list(self._layers.values())

    def clear(self) -> None:
        """Destroys every cached layer. Forwards whose backward has not run yet must
        not be pending (their backward would create a new layer of the same config;
        the saved buffer format is the config's, so that works, but do not rely on it
        across library versions)."""
        with self._lock:
            layers, self._layers = list(self._layers.values()), {}
        self.fp8.clear()
        for layer in layers:
            try:
                with _on_device(layer.device):
                    layer.close()
            except Exception:  # noqa: BLE001 - at exit the CUDA context may be gone
                pass

    def __len__(self) -> int:
        return len(self._layers)


layer_cache = LayerCache()
atexit.register(layer_cache.clear)


def check_device_errors() -> None:
    """Raises MoefuseError for the first bad expert id any cached CUDA layer recorded
    (waits for the current stream of the layer's device). No-op for CPU layers."""
    for layer in layer_cache.layers():
        if layer.device.type == "cuda":
            with _on_device(layer.device):
                layer.check_ids(torch.cuda.current_stream(layer.device).cuda_stream)


# ---- helpers ----------------------------------------------------------------------------


def backward_unsupported_reason(device) -> Optional[str]:
    """None when the library runs the backward on `device`, else the message of its
    MOEFUSE_ERR_UNSUPPORTED. Found by trying a small problem (H = I = 128, E = 8, K = 2),
    never assumed; any other error propagates."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(0)
    T, H, I, E, K = 64, 128, 128, 8, 2
    x = torch.randn(T, H, device=device, generator=g).to(torch.bfloat16).requires_grad_()
    ids = torch.rand(T, E, device=device, generator=g).topk(K, dim=-1).indices.to(torch.int32)
    p = torch.full((T, K), 1.0 / K, device=device, requires_grad=True)
    w13 = (torch.randn(E, 2 * I, H, device=device, generator=g) * H ** -0.5).to(
        torch.bfloat16).requires_grad_()
    w2 = (torch.randn(E, H, I, device=device, generator=g) * I ** -0.5).to(
        torch.bfloat16).requires_grad_()
    dy = torch.randn(T, H, device=device, generator=g).to(torch.bfloat16)
    try:
        torch.autograd.grad(experts(x, ids, p, w13, w2), (x, p, w13, w2), dy)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except _lib.MoefuseError as err:
        if err.status == _lib.Status.ERR_UNSUPPORTED:
            return f"{err.status_name}: {err.message}"
        raise
    return None


def saved_mode_for(recompute: bool, save_inputs: Optional[bool],
                   precision: int = int(_lib.Precision.BF16)) -> _lib.SavedMode:
    """The layer's moefuse_saved_mode for experts()'s two switches. save_inputs None: the
    faster for the precision (docs/decisions/0012-saved-state.md): bf16 keeps the
    dispatched x rows, FP8 does not (its dispatch then writes x's codes, not bf16 rows)."""
    if recompute:
        return _lib.SavedMode.RECOMPUTE
    if save_inputs is None:
        save_inputs = precision == _lib.Precision.BF16
    return (_lib.SavedMode.SAVE_ACTIVATIONS_AND_INPUTS if save_inputs
            else _lib.SavedMode.SAVE_ACTIVATIONS)


def saved_bytes(num_tokens: int, hidden: int, intermediate: int, num_experts: int,
                top_k: int, device: torch.device | str = "cpu",
                recompute: bool = False, save_inputs: Optional[bool] = None,
                precision: str = "bf16") -> int:
    """Bytes the forward keeps for the backward for T tokens (moefuse_saved_bytes), with
    experts()'s switches."""
    precision_id, _ = _fp8.resolve_precision(precision, False, "moefuse.saved_bytes")
    if num_tokens == 0:
        return 0
    layer = layer_cache.get(hidden, intermediate, num_experts, top_k, num_tokens,
                            torch.device(device),
                            saved_mode_for(recompute, save_inputs, precision_id), precision_id)
    return layer.saved_bytes(num_tokens)


# ---- the experts op: forward ----------------------------------------------------------


@torch.library.custom_op("moefuse::experts_fwd", mutates_args=())
def _experts_fwd(x: torch.Tensor, ids: torch.Tensor, p: torch.Tensor, w13: torch.Tensor,
                 w2: torch.Tensor, need_saved: bool, saved_mode: int, precision: int = 0,
                 fp8_pow2_scales: bool = False, w13_up: Optional[torch.Tensor] = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [T, H] bf16, saved uint8 [saved_bytes(T)], empty when need_saved is False).
    w13_up: W13 in two halves (w13 the gate half). Arguments already validated by
    experts()."""
    T, H, I, E, K = _shape_of(x, ids, w13, w13_up)
    device = x.device
    y = torch.empty((T, H), dtype=_BF16, device=device)
    if T == 0:
        return y, torch.empty(0, dtype=torch.uint8, device=device)
    layer = layer_cache.get(H, I, E, K, T, device, saved_mode, precision, fp8_pow2_scales)
    x = _as_rows(x, H)
    weight_fields, _alive = _fp8.weight_args(layer, w13, w2, layer_cache.fp8, w13_up)
    saved = (_alloc_saved(layer.saved_bytes(T), device) if need_saved
             else torch.empty(0, dtype=torch.uint8, device=device))
    args = _lib.FwdArgs(
        num_tokens=T, x=x.data_ptr(), x_stride=_row_stride(x, H), ids=ids.data_ptr(),
        weights=p.data_ptr(), y=y.data_ptr(), y_stride=H, saved=_ptr(saved),
        expert_counts=None, **weight_fields)
    with layer.lock, _on_device(device):
        layer.forward(args, _stream(device))
    return y, saved


@_experts_fwd.register_fake
def _experts_fwd_fake(x, ids, p, w13, w2, need_saved, saved_mode, precision=0,
                      fp8_pow2_scales=False, w13_up=None):
    T, H, I, E, K = _shape_of(x, ids, w13, w13_up)
    y = x.new_empty((T, H), dtype=_BF16)
    if not need_saved:
        num_bytes = 0
    elif isinstance(T, int):
        num_bytes = layer_cache.get(H, I, E, K, T, x.device, saved_mode, precision,
                                    fp8_pow2_scales).saved_bytes(T)
    else:
        # Dynamic T: the size is a function of T and the config only, but that
        # function lives in C; an unbacked size says "known at run time".
        num_bytes = torch.library.get_ctx().new_dynamic_size()
    return y, x.new_empty((num_bytes,), dtype=torch.uint8)


# ---- the experts op: backward ---------------------------------------------------------


@torch.library.custom_op("moefuse::experts_bwd", mutates_args=())
def _experts_bwd(dy: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, p: torch.Tensor,
                 w13: torch.Tensor, w2: torch.Tensor, saved: torch.Tensor, saved_mode: int,
                 precision: int = 0, fp8_pow2_scales: bool = False,
                 w13_up: Optional[torch.Tensor] = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx [T, H] bf16, dp [T, K] fp32, dw13 [E, 2I, H], dw2 [E, H, I], dw13_up); the
    weight gradients bf16 when w13 and w2 are bf16, else fp32 (_wgrad_dtype). With w13_up
    (W13 in two halves) dw13 is the gate half's gradient and dw13_up the up half's
    [E, I, H]; else dw13_up is empty."""
    T, H, I, E, K = _shape_of(x, ids, w13, w13_up)
    device = x.device
    dx = torch.empty((T, H), dtype=_BF16, device=device)
    dp = torch.empty((T, K), dtype=torch.float32, device=device)
    wgrad_dtype = _wgrad_dtype(w13, w2)
    up_shape = w13_up.shape if w13_up is not None else (0,)
    make = torch.zeros if T == 0 else torch.empty
    dw13 = make(w13.shape, dtype=wgrad_dtype, device=device)
    dw2 = make(w2.shape, dtype=wgrad_dtype, device=device)
    dw13_up = make(up_shape, dtype=wgrad_dtype, device=device)
    if T == 0:
        return dx, dp, dw13, dw2, dw13_up
    layer = layer_cache.get(H, I, E, K, T, device, saved_mode, precision, fp8_pow2_scales)
    x, dy = _as_rows(x, H), _as_rows(dy.to(_BF16), H)
    weight_fields, _alive = _fp8.weight_args(layer, w13, w2, layer_cache.fp8, w13_up)
    saved = _aligned_saved(saved)
    args = _lib.BwdArgs(
        num_tokens=T, x=x.data_ptr(), x_stride=_row_stride(x, H), ids=ids.data_ptr(),
        weights=p.data_ptr(), saved=saved.data_ptr(), saved_bytes=saved.numel(),
        dy=dy.data_ptr(), dy_stride=_row_stride(dy, H), dx=dx.data_ptr(), dx_stride=H,
        dweights=dp.data_ptr(), accumulate=0,
        **_wgrad_fields(dw13, dw2, dw13_up if w13_up is not None else None), **weight_fields)
    with layer.lock, _on_device(device):
        layer.backward(args, _stream(device))
    return dx, dp, dw13, dw2, dw13_up


@_experts_bwd.register_fake
def _experts_bwd_fake(dy, x, ids, p, w13, w2, saved, saved_mode, precision=0,
                      fp8_pow2_scales=False, w13_up=None):
    T, H, _, _, K = _shape_of(x, ids, w13, w13_up)
    wgrad_dtype = _wgrad_dtype(w13, w2)
    up_shape = w13_up.shape if w13_up is not None else (0,)
    return (x.new_empty((T, H), dtype=_BF16), x.new_empty((T, K), dtype=torch.float32),
            w13.new_empty(w13.shape, dtype=wgrad_dtype),
            w2.new_empty(w2.shape, dtype=wgrad_dtype),
            w13.new_empty(up_shape, dtype=wgrad_dtype))


def _experts_setup_context(ctx, inputs, output):
    x, ids, p, w13, w2, need_saved, saved_mode, precision, fp8_pow2_scales, w13_up = inputs
    _, saved = output
    ctx.save_for_backward(x, ids, p, w13, w2, saved, w13_up)
    ctx.need_saved = need_saved
    ctx.saved_mode = saved_mode
    ctx.precision = (precision, fp8_pow2_scales)
    # saved never gets a gradient: without this, autograd would pass a zero-filled
    # uint8 tensor of its size (a fill of 0.4 GB per call on qwen3-30b-a3b at T = 16384).
    ctx.set_materialize_grads(False)


def _experts_backward(ctx, dy, _dsaved):
    if dy is None:   # y did not reach the loss: no gradient flows into the inputs
        return (None,) * 10
    if not ctx.need_saved:
        raise RuntimeError(
            "moefuse.experts: backward through a forward that kept nothing for it "
            "(need_saved=False; experts() sets it when grad mode is on and an input "
            "requires grad)")
    x, ids, p, w13, w2, saved, w13_up = ctx.saved_tensors
    dx, dp, dw13, dw2, dw13_up = torch.ops.moefuse.experts_bwd(
        dy, x, ids, p, w13, w2, saved, ctx.saved_mode, *ctx.precision, w13_up)
    need = ctx.needs_input_grad
    # Already each weight's dtype (a no-op) unless one weight is bf16 and the other fp32.
    return (dx if need[0] else None, None, dp if need[2] else None,
            dw13.to(w13.dtype) if need[3] else None, dw2.to(w2.dtype) if need[4] else None,
            None, None, None, None,
            dw13_up.to(w13_up.dtype) if w13_up is not None and need[9] else None)


_experts_fwd.register_autograd(_experts_backward, setup_context=_experts_setup_context)


# ---- the experts op: public function ----------------------------------------------------


def experts(x: torch.Tensor, ids: torch.Tensor, p: torch.Tensor, w13: torch.Tensor,
            w2: torch.Tensor, recompute: bool = False, save_inputs: Optional[bool] = None,
            precision: str = "bf16", fp8_pow2_scales: bool = False) -> torch.Tensor:
    """The routed experts: y_t = sum_k p[t,k] * W2_e silu-glu(W13_e x_t), e = ids[t,k].

    Args:
        x:   [T, H] bf16 tokens. Any strides; copied when the library cannot read it
             in place (unit column stride, row stride >= H, 16-byte alignment on CUDA).
        ids: [T, K] int32 (int64 is converted) expert ids in [-1, E), no repeats in a
             row; -1 drops the slot.
        p:   [T, K] fp32 routing weights (made contiguous).
        w13: [E, 2I, H] contiguous, bf16 (or fp32: cast per call); gate rows 0..I-1,
             up rows I..2I-1. Or W13 in two halves: a pair (gate, up), each [E, I, H]
             contiguous, of one dtype (TorchTitan's w1 and w3): the library reads them
             where they are (no concatenation) and each gets its own gradient.
        w2:  [E, H, I] contiguous, bf16 (or fp32).
        recompute: keep only the routing plan and recompute W13 x in the backward
             (saves K * 2I * 2 bytes per token for 1/3 more forward FLOPs).
        save_inputs: without recompute, also keep the forward's expert-sorted copies of
             x (K * H * 2 bytes more per token), so the backward does not gather x
             again (CUDA; the CPU backend ignores it). Even so, fewer bytes than autograd
             through torch._grouped_mm keeps. Same results either way. None (the
             default): the faster for the precision, True for bf16 and False for fp8
             (whose forward dispatch then writes x's FP8 codes instead of bf16 rows).
        precision: "bf16" (default) or "fp8": block-scaled e4m3 GEMM operands, the
             weights quantized once per optimizer step (_fp8.py); on the CPU and on an
             sm_90 GPU.
        fp8_pow2_scales: with precision="fp8", every scale a power of two.

    Returns:
        y [T, H] bf16.
    """
    precision_id, fp8_pow2_scales = _fp8.resolve_precision(precision, fp8_pow2_scales,
                                                           "moefuse.experts")
    w13, w13_up = _w13_halves(w13)
    ids = _validate_experts(x, ids, p, w13, w2, w13_up).contiguous()
    p = p.contiguous()
    H = x.shape[1]
    if x.stride(1) != 1 or (x.shape[0] > 1 and x.stride(0) < H):
        x = x.contiguous()
    need_saved = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, p, w13, w2, w13_up))
    y, _ = torch.ops.moefuse.experts_fwd(x, ids, p, w13, w2, need_saved,
                                         int(saved_mode_for(recompute, save_inputs,
                                                            precision_id)),
                                         precision_id, fp8_pow2_scales, w13_up)
    return y


# The routing helper lives in _route.py; its names stay importable from here.
from ._route import (_library_route, _library_route_backward, _library_route_forward,  # noqa: E402
                     _route_bwd_torch, _route_torch, route)

_REEXPORTED_ROUTE = (_library_route, _library_route_backward, _library_route_forward,
                     _route_bwd_torch, _route_torch, route)
