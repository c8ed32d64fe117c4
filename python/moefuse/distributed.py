"""Expert parallelism from PyTorch: the routed experts sharded over the ranks of a
torch.distributed process group, one GPU per rank, tokens exchanged inside moefuse's
kernels (include/moefuse.h, "expert parallelism").

    nccl_comm_from_group(group=None, timeout_ms=30000) -> NcclComm
        an NCCL communicator of the group's ranks (made through the libnccl PyTorch
        loaded) and moefuse's comm over it. Collective.
    virtual_comm(num_ranks) -> Comm
        R ranks inside this process on one GPU, for tests.
    ExpertParallelExperts(hidden, intermediate, num_experts, top_k, max_tokens, comm,
                          rank, num_ranks)
        nn.Module with this rank's experts only: W13 [E/R, 2I, H], W2 [E/R, H, I];
        forward(x [T, H] bf16, ids [T, K] global expert ids, p [T, K] fp32) -> y [T, H];
        forward(x, ids, p, w13=(gate, up), w2=w2) computes with weights given per call
        instead, W13 packed or in two halves [E/R, I, H] each (TorchTitan's w1, w3).
    load_local_experts(w13_global, w2_global, rank, num_ranks) -> (w13, w2) of the rank.
    memory_estimate(hidden, intermediate, num_experts, top_k, max_tokens, num_ranks, ...)
        -> dict: the device bytes of such a layer (windows and scratch shared by the
        comm's layers, its own workspaces, saved bytes per call), without a GPU;
        ExpertParallelExperts.memory() reports a made layer's.

Sharding is contiguous: rank r holds experts r*E/R .. (r+1)*E/R - 1. Each rank passes
its own tokens (T may differ per rank, 0 included; T <= max_tokens, which is the same
on every rank).

Ordering: every rank of the comm must run the same sequence of forwards and backwards
on its module (a model's MoE layers in the same order on every rank, the backward of
each forward on every rank, also where a rank has T = 0 or its loss ignores y). A rank
that skips a call leaves the others waiting until the comm's timeout.

Nothing synchronizes the host: a bad expert id or a peer that never came shows up in
module.check() (it waits for the current stream), as MoefuseError with
MOEFUSE_ERR_EXPERT_ID / MOEFUSE_ERR_DUPLICATE_EXPERT, MOEFUSE_ERR_CAPACITY (a rank was
routed more rows than its receive capacity: that call wrote nothing on any rank, the next
one works) or MOEFUSE_ERR_TIMEOUT. After a timeout, close() every rank's module (the next
forward makes a fresh layer).

One comm serves every MoE layer of a model: the modules made with it share each rank's
receive windows and scratch (sized for the largest), so they run on one stream.

The comms are made in _comms.py (re-exported here); this file shards the experts and
holds the module and its autograd function.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from . import _fp8, _lib
from ._checks import (_BF16, _aligned_saved, _alloc_saved, _as_rows, _check_weight_tensors,
                      _check_weights_contiguous, _ids_as_int32, _normalize_device, _on_device,
                      _ptr, _row_stride, _stream, _w13_halves, _weight_names, _wgrad_dtype,
                      _wgrad_fields)
from ._comms import (_NCCL_SIGNATURES, NcclComm, NcclError, _check_timeout, _loaded_nccl_path,
                     _nccl_check, _NcclUniqueId, load_nccl, nccl_comm_from_group,
                     nccl_unsupported_reason, virtual_comm)
from .modules import MoEExperts
from .ops import layer_cache, pipeline_from_env

# The comms live in _comms.py; every name stays importable from here.
_REEXPORTED = (_NCCL_SIGNATURES, NcclComm, NcclError, _check_timeout, _loaded_nccl_path,
               _nccl_check, _NcclUniqueId, load_nccl, nccl_comm_from_group,
               nccl_unsupported_reason, virtual_comm)

_CUDA_MULTIPLE = 128  # H and I of the CUDA backend (moefuse.h)


# ---- sharding ------------------------------------------------------------------------------


def _shard_size(num_experts: int, rank: int, num_ranks: int) -> int:
    """E/R, after checking rank and divisibility."""
    for name, v in (("rank", rank), ("num_ranks", num_ranks)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if num_ranks < 1 or not 0 <= rank < num_ranks:
        raise ValueError(f"expected num_ranks >= 1 and 0 <= rank < num_ranks, got rank={rank}, "
                         f"num_ranks={num_ranks}")
    if num_experts % num_ranks:
        raise ValueError(f"num_experts={num_experts} is not divisible by num_ranks={num_ranks}")
    return num_experts // num_ranks


def load_local_experts(w13_global: torch.Tensor, w2_global: torch.Tensor, rank: int,
                       num_ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's experts r*E/R .. (r+1)*E/R - 1 of W13 [E, 2I, H] and W2 [E, H, I]:
    views (no copy) of [E/R, 2I, H] and [E/R, H, I]."""
    for name, w in (("w13_global", w13_global), ("w2_global", w2_global)):
        if not isinstance(w, torch.Tensor) or w.dim() != 3:
            got = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
            raise ValueError(f"load_local_experts: {name} must be a 3-d tensor, got {got}")
    num_experts, two_i, hidden = w13_global.shape
    if two_i % 2 or tuple(w2_global.shape) != (num_experts, hidden, two_i // 2):
        raise ValueError(f"load_local_experts: expected w13 [E, 2I, H] and w2 [E, H, I], got "
                         f"{tuple(w13_global.shape)} and {tuple(w2_global.shape)}")
    e_loc = _shard_size(num_experts, rank, num_ranks)
    return (w13_global[rank * e_loc:(rank + 1) * e_loc],
            w2_global[rank * e_loc:(rank + 1) * e_loc])


# ---- the autograd function ------------------------------------------------------------------


class _ExpertParallelFn(torch.autograd.Function):
    """y = the routed experts of this rank's tokens; the layer's kernels exchange rows
    with the other ranks. Backward: dx, d p and this rank's dW13, dW2 (written by the
    library in bf16 for bf16 weights, else in fp32; returned in each weight's dtype).
    w13_up: W13 in two halves (w13 the gate half, both [E/R, I, H]), read where they are
    and quantized from there (FP8); each half gets its own gradient."""

    @staticmethod
    def forward(ctx, x, ids, p, w13, w2, layer: _lib.Layer, need_saved: bool,
                w13_up: Optional[torch.Tensor] = None):
        T, H = x.shape
        device = x.device
        x = _as_rows(x, H)
        weight_fields, _alive = _fp8.weight_args(layer, w13, w2, layer_cache.fp8, w13_up)
        y = torch.empty((T, H), dtype=_BF16, device=device)
        # With R > 1 the saved buffer holds the rows this rank receives: not empty even
        # at T = 0, and every rank's backward needs one.
        saved = _alloc_saved(layer.saved_bytes(T), device) if need_saved else None
        args = _lib.FwdArgs(
            num_tokens=T, x=_ptr(x), x_stride=_row_stride(x, H), ids=_ptr(ids),
            weights=_ptr(p), y=_ptr(y), y_stride=H, saved=_ptr(saved), expert_counts=None,
            **weight_fields)
        with layer.lock, _on_device(device):
            layer.forward(args, _stream(device))
        ctx.layer = layer
        ctx.save_for_backward(x, ids, p, w13, w2, saved, w13_up)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, ids, p, w13, w2, saved, w13_up = ctx.saved_tensors
        if saved is None:
            raise RuntimeError("ExpertParallelExperts: backward through a forward that kept "
                               "nothing for it (it ran with grad disabled)")
        layer: _lib.Layer = ctx.layer
        T, H = x.shape
        device = x.device
        dy = _as_rows(dy.to(_BF16), H)
        dx = torch.empty((T, H), dtype=_BF16, device=device)
        dp = torch.empty(tuple(ids.shape), dtype=torch.float32, device=device)
        wgrad_dtype = _wgrad_dtype(w13, w2)
        dw13 = torch.empty(w13.shape, dtype=wgrad_dtype, device=device)
        dw2 = torch.empty(w2.shape, dtype=wgrad_dtype, device=device)
        dw13_up = (torch.empty(w13_up.shape, dtype=wgrad_dtype, device=device)
                   if w13_up is not None else None)
        weight_fields, _alive = _fp8.weight_args(layer, w13, w2, layer_cache.fp8, w13_up)
        saved = _aligned_saved(saved)
        args = _lib.BwdArgs(
            num_tokens=T, x=_ptr(x), x_stride=_row_stride(x, H), ids=_ptr(ids),
            weights=_ptr(p), saved=saved.data_ptr(), saved_bytes=saved.numel(), dy=_ptr(dy),
            dy_stride=_row_stride(dy, H), dx=_ptr(dx), dx_stride=H, dweights=_ptr(dp),
            accumulate=0, **_wgrad_fields(dw13, dw2, dw13_up), **weight_fields)
        # Always called, whatever needs a gradient: the other ranks' backwards wait for
        # this rank's.
        with layer.lock, _on_device(device):
            layer.backward(args, _stream(device))
        need = ctx.needs_input_grad
        # w13_up is not None only where apply() got it as the eighth input
        need_up = w13_up is not None and need[7]
        return (dx if need[0] else None, None, dp if need[2] else None,
                dw13.to(w13.dtype) if need[3] else None, dw2.to(w2.dtype) if need[4] else None,
                None, None, dw13_up.to(w13_up.dtype) if need_up else None)


# ---- memory ----------------------------------------------------------------------------------


def memory_estimate(hidden: int, intermediate: int, num_experts: int, top_k: int,
                    max_tokens: int, num_ranks: int,
                    saved_mode: _lib.SavedMode = _lib.SavedMode.SAVE_ACTIVATIONS,
                    recv_capacity_factor: float = 0.0,
                    pipeline: _lib.Pipeline = _lib.Pipeline.STAGED,
                    precision: str = "bf16") -> dict:
    """moefuse_memory_estimate of an ExpertParallelExperts layer with this config, the
    largest of its rank's layers on the comm (shared_layers = 1): a dict of
    recv_capacity_rows, rows_cap, comm_window_bytes, comm_scratch_bytes (shared by every
    layer of the comm; with precision="fp8" the FP8 operands too), workspace_bytes (each
    layer's own) and saved_bytes (each forward's saved activations, until its backward).
    No GPU needed."""
    cfg = _lib.config_init(hidden, intermediate, num_experts, top_k, max_tokens)
    cfg.num_ranks = num_ranks
    cfg.backend = _lib.Backend.CUDA
    cfg.saved_mode = saved_mode
    cfg.pipeline = pipeline
    cfg.recv_capacity_factor = recv_capacity_factor
    cfg.precision, _ = _fp8.resolve_precision(precision, False, "memory_estimate")
    return _lib.memory_estimate(cfg, True)


# ---- the module -------------------------------------------------------------------------------


def _check_module_config(hidden, intermediate, num_experts, top_k, max_tokens, comm, rank,
                         num_ranks, dtype, saved_mode, pipeline, precision,
                         fp8_pow2_scales) -> None:
    """Raises TypeError / ValueError before anything touches the library."""
    _fp8.resolve_precision(precision, fp8_pow2_scales, "ExpertParallelExperts")
    sizes = dict(hidden=hidden, intermediate=intermediate, num_experts=num_experts,
                 top_k=top_k, max_tokens=max_tokens)
    for name, v in sizes.items():
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"ExpertParallelExperts: {name} must be an int, got {type(v).__name__}")
        if v < 1:
            raise ValueError(f"ExpertParallelExperts: {name} must be >= 1, got {v}")
    for name in ("hidden", "intermediate"):
        if sizes[name] % _CUDA_MULTIPLE:
            raise ValueError(f"ExpertParallelExperts: {name}={sizes[name]}: the CUDA backend "
                             f"needs a multiple of {_CUDA_MULTIPLE}")
    if top_k > num_experts:
        raise ValueError(f"ExpertParallelExperts: top_k={top_k} must be <= num_experts="
                         f"{num_experts}")
    _shard_size(num_experts, rank, num_ranks)
    if not isinstance(comm, _lib.Comm):
        raise TypeError("ExpertParallelExperts: comm must be a moefuse Comm (nccl_comm_from_group "
                        f"or virtual_comm), got {type(comm).__name__}")
    if comm.closed:
        raise ValueError("ExpertParallelExperts: the comm is closed")
    if comm.num_ranks != num_ranks:
        raise ValueError(f"ExpertParallelExperts: num_ranks={num_ranks} but the comm has "
                         f"{comm.num_ranks} ranks")
    if comm.rank is not None and comm.rank != rank:
        raise ValueError(f"ExpertParallelExperts: rank={rank} but this process is rank "
                         f"{comm.rank} of the comm")
    if dtype not in (_BF16, torch.float32):
        raise TypeError(f"ExpertParallelExperts: dtype must be bfloat16 (or float32 master "
                        f"weights), got {dtype}")
    if saved_mode not in tuple(_lib.SavedMode):
        raise ValueError(f"ExpertParallelExperts: saved_mode must be a moefuse SavedMode, got "
                         f"{saved_mode!r}")
    if saved_mode == _lib.SavedMode.SAVE_ACTIVATIONS_AND_INPUTS:
        raise ValueError("ExpertParallelExperts: saved_mode SAVE_ACTIVATIONS_AND_INPUTS is for "
                         "one rank (the expert-parallel backward receives its x rows again); "
                         "use SAVE_ACTIVATIONS or RECOMPUTE")
    if pipeline is not None and pipeline not in tuple(_lib.Pipeline):
        raise ValueError(f"ExpertParallelExperts: pipeline must be a moefuse Pipeline or None, "
                         f"got {pipeline!r}")


class ExpertParallelExperts(MoEExperts):
    """This rank's share of the routed experts, computed by libmoefuse with expert
    parallelism over `comm` (nccl_comm_from_group, or virtual_comm in tests).

    Parameters (the local experts only, names as MoEExperts):
        gate_up_proj: W13 [E/R, 2I, H], experts rank*E/R .. (rank+1)*E/R - 1
        down_proj:    W2 [E/R, H, I]
    bf16 by default; float32 works as master weights (cast to bf16 per call, gradients
    stay fp32). load_global_experts() copies this rank's shard of global weights in.
    precision: "bf16" or "fp8" (the option's errors as moefuse.experts(); the forward pushes
    x's FP8 codes, the backward quantizes the received rows once all are in).
    pipeline: how the forward runs its expert GEMMs (Pipeline.STAGED or FUSED, the same
    bits); None reads MOEFUSE_PIPELINE when the module is made (ops.pipeline_from_env).

    forward(x [T, H] bf16, ids [T, K] int32 (int64 converted) global expert ids in
    [-1, E), -1 = dropped, no repeats in a row, p [T, K] fp32) -> y [T, H] bf16, all on
    the module's CUDA device; T <= max_tokens (the same max_tokens on every rank). Runs
    on torch.cuda.current_stream() and never synchronizes; check() reports device-side
    errors. Gradients flow to x, p and the local weights.
    forward(x, ids, p, w13=..., w2=...): the local weights given for this call in place of
    the parameters (None: the parameter), as moefuse.experts() takes them: w13 W13
    [E/R, 2I, H], or its two halves, a pair (gate [E/R, I, H], up [E/R, I, H]) of one dtype
    (TorchTitan's w1 and w3), read where they are and each given its own gradient; w2
    [E/R, H, I]. Each contiguous, bf16 or fp32 (cast to bf16 per call; with "fp8"
    quantized from their own values once per optimizer step).

    Collective: every rank of the comm runs the same sequence of forwards and backwards
    (see the module docstring), and creates and closes its module together with the
    others. The library layer is made here when the parameters are on CUDA, else at the
    first forward. The modules of one comm (one per MoE layer of a model) share each
    rank's receive windows and scratch, sized for the largest of them, so they run on one
    stream (their forwards and backwards may interleave in any order).
    recv_capacity_factor: the rows a rank can receive per call, as a multiple of the
    balanced load max_tokens * top_k (0 = the library's default 2.0; >= 1); a routing
    that sends a rank more fails the call on every rank (check() raises ERR_CAPACITY).
    The windows, scratch and saved activations are sized by it; memory() reports them
    and memory_estimate() computes them without a GPU.
    """

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 max_tokens: int, comm: _lib.Comm, rank: int, num_ranks: int,
                 dtype: torch.dtype = _BF16,
                 saved_mode: _lib.SavedMode = _lib.SavedMode.SAVE_ACTIVATIONS,
                 device: Optional[Union[torch.device, str]] = None,
                 pipeline: Optional[_lib.Pipeline] = None, precision: str = "bf16",
                 fp8_pow2_scales: bool = False, recv_capacity_factor: float = 0.0):
        _check_module_config(hidden, intermediate, num_experts, top_k, max_tokens, comm, rank,
                             num_ranks, dtype, saved_mode, pipeline, precision, fp8_pow2_scales)
        if isinstance(recv_capacity_factor, bool) or not isinstance(recv_capacity_factor,
                                                                    (int, float)):
            raise TypeError("ExpertParallelExperts: recv_capacity_factor must be a number, got "
                            f"{type(recv_capacity_factor).__name__}")
        if recv_capacity_factor != 0 and not recv_capacity_factor >= 1:
            raise ValueError("ExpertParallelExperts: recv_capacity_factor must be 0 (the "
                             f"default) or >= 1, got {recv_capacity_factor}")
        super().__init__(num_experts // num_ranks, hidden, intermediate,
                         recompute=saved_mode == _lib.SavedMode.RECOMPUTE, precision=precision,
                         fp8_pow2_scales=fp8_pow2_scales, device=device, dtype=dtype)
        self.num_experts = num_experts  # E over all ranks; the parameters hold E/R
        self.num_local_experts = num_experts // num_ranks
        self.top_k = top_k
        self.max_tokens = max_tokens
        self.comm = comm
        self.rank = rank
        self.num_ranks = num_ranks
        self.saved_mode = _lib.SavedMode(saved_mode)
        self.recv_capacity_factor = float(recv_capacity_factor)
        # the forward's expert GEMMs (the same bits either way); None: MOEFUSE_PIPELINE
        self.pipeline = pipeline_from_env() if pipeline is None else _lib.Pipeline(pipeline)
        self._layer: Optional[_lib.Layer] = None
        if self.gate_up_proj.device.type == "cuda":
            self._layer_on(self.gate_up_proj.device)

    @property
    def expert_range(self) -> range:
        """The global ids of this rank's experts."""
        return range(self.rank * self.num_local_experts,
                     (self.rank + 1) * self.num_local_experts)

    def load_global_experts(self, w13_global: torch.Tensor, w2_global: torch.Tensor) -> None:
        """Copies this rank's shard of W13 [E, 2I, H] and W2 [E, H, I] into the parameters."""
        w13, w2 = load_local_experts(w13_global, w2_global, self.rank, self.num_ranks)
        if w13.shape != self.gate_up_proj.shape:
            raise ValueError(f"load_global_experts: this rank's shard is {tuple(w13.shape)}, "
                             f"the parameter {tuple(self.gate_up_proj.shape)}")
        with torch.no_grad():
            self.gate_up_proj.copy_(w13)
            self.down_proj.copy_(w2)

    def _layer_on(self, device: torch.device) -> _lib.Layer:
        """The layer, created on `device` the first time (collective with NCCL)."""
        device = _normalize_device(device)
        layer = self._layer
        if layer is not None and not layer.closed:
            if layer.device != device:
                raise ValueError(f"ExpertParallelExperts: its layer is on {layer.device}, the "
                                 f"inputs on {device}; move the module before its first forward")
            return layer
        comm_device = getattr(self.comm, "device", None)  # an NCCL comm's GPU
        if comm_device is not None and device.index != comm_device:
            raise ValueError(f"ExpertParallelExperts: the comm's NCCL communicator is on "
                             f"cuda:{comm_device}, the module on {device}")
        layer = _fp8.create_layer(self._config(), device, self.comm)
        layer.device = device
        self._layer = layer
        return layer

    def _config(self) -> _lib.Config:
        """The layer's moefuse_config: the module's shape, rank, saved mode, pipeline,
        precision and receive capacity, on the CUDA backend."""
        cfg = _lib.config_init(self.hidden_size, self.intermediate_size, self.num_experts,
                               self.top_k, self.max_tokens)
        cfg.num_ranks = self.num_ranks
        cfg.rank = self.rank
        cfg.backend = _lib.Backend.CUDA
        cfg.saved_mode = self.saved_mode
        cfg.pipeline = self.pipeline
        cfg.precision, _ = _fp8.resolve_precision(self.precision, self.fp8_pow2_scales,
                                                  "ExpertParallelExperts")
        cfg.fp8_pow2_scales = int(self.fp8_pow2_scales)
        cfg.recv_capacity_factor = self.recv_capacity_factor
        return cfg

    def _validate(self, x, ids, p) -> torch.Tensor:
        """Raises TypeError / ValueError naming the argument; returns ids as int32."""
        where = "ExpertParallelExperts.forward"
        for name, t in (("x", x), ("ids", ids), ("p", p)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
        for name, t, dtypes in (("x", x, (_BF16,)), ("ids", ids, (torch.int32, torch.int64)),
                                ("p", p, (torch.float32,))):
            if t.dtype not in dtypes:
                raise TypeError(f"{where}: {name} must be {' or '.join(map(str, dtypes))}, "
                                f"got {t.dtype}")
        H, K = self.hidden_size, self.top_k
        if x.dim() != 2 or x.shape[1] != H:
            raise ValueError(f"{where}: x must be [T, H={H}], got shape {tuple(x.shape)}")
        T = x.shape[0]
        for name, t in (("ids", ids), ("p", p)):
            if tuple(t.shape) != (T, K):
                raise ValueError(f"{where}: {name} must be [T={T}, K={K}], got shape "
                                 f"{tuple(t.shape)}")
        if T > self.max_tokens:
            raise ValueError(f"{where}: T={T} tokens > max_tokens={self.max_tokens} (the "
                             "module's, the same on every rank)")
        if x.device.type != "cuda":
            raise ValueError(f"{where}: expert parallelism runs on CUDA tensors, x is on "
                             f"{x.device}")
        for name, t in (("ids", ids), ("p", p)):
            if t.device != x.device:
                raise ValueError(f"{where}: {name} is on {t.device} but x is on {x.device}")
        return _ids_as_int32(ids, where)

    def _weights(self, x, w13, w2) -> tuple:
        """(w13, w13_up, w2) of the call: the parameters, or the weights forward() was
        given (w13 packed, or its halves (gate, up): then w13 the gate half and w13_up the
        up half). Raises TypeError / ValueError naming the argument."""
        where = "ExpertParallelExperts.forward"
        E, H, I = self.num_local_experts, self.hidden_size, self.intermediate_size
        packed_name = "w13" if w13 is not None else "gate_up_proj"
        w13, w13_up = _w13_halves(self.gate_up_proj if w13 is None else w13, where)
        name2 = "down_proj" if w2 is None else "w2"
        w2 = self.down_proj if w2 is None else w2
        weights = tuple(zip(_weight_names(w13_up, packed_name), (w13, w13_up))) + ((name2, w2),)
        _check_weight_tensors(where, weights, x.device, None if w13_up is None else (w13, w13_up))
        rows = 2 * I if w13_up is None else I
        for (name, w), shape in zip(weights, [(E, rows, H)] * (len(weights) - 1) + [(E, H, I)]):
            if tuple(w.shape) != shape:
                raise ValueError(f"{where}: {name} must be {list(shape)} (this rank's experts), "
                                 f"got {tuple(w.shape)}")
        _check_weights_contiguous(where, weights)
        return w13, w13_up, w2

    def forward(self, x: torch.Tensor, ids: torch.Tensor, p: torch.Tensor,
                w13: Union[None, torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = None,
                w2: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [T, H] bf16, ids [T, K] global expert ids, p [T, K] fp32 -> y [T, H] bf16.
        w13 ([E/R, 2I, H], or the pair (gate, up) [E/R, I, H] each) and w2 [E/R, H, I]:
        the local weights of this call; None, the module's parameter."""
        ids = self._validate(x, ids, p).contiguous()
        w13, w13_up, w2 = self._weights(x, w13, w2)
        layer = self._layer_on(x.device)
        need_saved = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, p, w13, w13_up, w2))
        return _ExpertParallelFn.apply(x, ids, p.contiguous(), w13, w2, layer, need_saved,
                                       w13_up)

    def memory(self) -> Optional[dict]:
        """The layer's moefuse_layer_memory (bytes and rows by field name), None before the
        layer is made."""
        layer = self._layer
        if layer is None or layer.closed:
            return None
        return layer.memory()

    def check(self) -> None:
        """Waits for the current stream and raises MoefuseError for the first device-side
        error of this rank's calls since the last check: a bad expert id
        (MOEFUSE_ERR_EXPERT_ID, MOEFUSE_ERR_DUPLICATE_EXPERT), a routing over a rank's
        receive capacity (MOEFUSE_ERR_CAPACITY, the same on every rank) or a peer that did
        not come within the comm's timeout (MOEFUSE_ERR_TIMEOUT; then close() every rank's
        module). No-op before the first forward."""
        layer = self._layer
        if layer is None or layer.closed:
            return
        with _on_device(layer.device):
            layer.check_ids(_stream(layer.device))

    def close(self) -> None:
        """Destroys the library layer (with NCCL, on every rank together). A later forward
        makes a new one; forwards awaiting their backward must not be pending."""
        layer, self._layer = self._layer, None
        if layer is not None and not layer.closed:
            with _on_device(layer.device):
                layer.close()

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts} (local {self.expert_range.start}.."
                f"{self.expert_range.stop - 1}), hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, top_k={self.top_k}, "
                f"max_tokens={self.max_tokens}, rank={self.rank}, num_ranks={self.num_ranks}, "
                f"saved_mode={self.saved_mode.name}, pipeline={self.pipeline.name}, "
                f"precision={self.precision!r}")
