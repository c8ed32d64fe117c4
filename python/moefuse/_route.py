"""The Qwen3 routing helper as a torch.library custom op (moefuse::route_fwd /
route_bwd): route(logits, top_k) -> (ids int32 [T, K], weights fp32 [T, K]), softmax over
E in fp32, top-K (ties: lower id), renormalized; differentiable in logits. The library's
routing kernel where the backend has one, else the same math in PyTorch. Re-exported by
moefuse.ops."""

from __future__ import annotations

import torch

from . import _lib
from ._checks import _backend, _on_device, _ptr, _stream


# ---- the routing helper -------------------------------------------------------------------


def _route_torch(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The helper's semantics in PyTorch (for devices the C helper does not run on):
    select on logits (softmax is increasing; ties: lower id first, since topk of a
    stable descending sort keeps index order), weights = softmax over the selected."""
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices
    ids = order[:, :top_k]
    probs = torch.softmax(logits, dim=-1)
    top = probs.gather(1, ids)
    weights = top / top.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32), weights


def _route_bwd_torch(ids: torch.Tensor, weights: torch.Tensor, dweights: torch.Tensor,
                     num_experts: int) -> torch.Tensor:
    """d logits: the renormalized weights are a softmax over the selected logits only,
    so d l_j = w_j (dw_j - <dw, w>) on the selected experts and 0 elsewhere."""
    dsel = weights * (dweights - (dweights * weights).sum(dim=-1, keepdim=True))
    dlogits = torch.zeros((ids.shape[0], num_experts), dtype=torch.float32, device=ids.device)
    return dlogits.scatter_(1, ids.long(), dsel)


def _library_route(call, args, device: torch.device) -> bool:
    """Runs one of the library's routing helpers (_lib.route_forward / route_backward);
    False when it is not built for this backend (it answers ERR_UNSUPPORTED before
    touching anything), so the caller falls back to PyTorch."""
    backend = _backend(device)
    try:
        with _on_device(device):
            call(args, backend, _stream(device))
    except _lib.MoefuseError as err:
        if err.status == _lib.Status.ERR_UNSUPPORTED and backend != _lib.Backend.CPU:
            return False
        raise
    return True


def _library_route_forward(logits, ids, weights) -> bool:
    T, E = logits.shape
    args = _lib.RouteArgs(num_tokens=T, num_experts=E, top_k=ids.shape[1],
                          logits=_ptr(logits), ids=_ptr(ids), weights=_ptr(weights))
    return _library_route(_lib.route_forward, args, logits.device)


def _library_route_backward(logits, ids, dweights, dlogits) -> bool:
    T, E = logits.shape
    args = _lib.RouteBwdArgs(num_tokens=T, num_experts=E, top_k=ids.shape[1],
                             logits=_ptr(logits), ids=_ptr(ids), dweights=_ptr(dweights),
                             dlogits=_ptr(dlogits))
    return _library_route(_lib.route_backward, args, logits.device)


@torch.library.custom_op("moefuse::route_fwd", mutates_args=())
def _route_fwd(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [T, K] int32, weights [T, K] fp32) from fp32 logits [T, E]."""
    T = logits.shape[0]
    ids = torch.empty((T, top_k), dtype=torch.int32, device=logits.device)
    weights = torch.empty((T, top_k), dtype=torch.float32, device=logits.device)
    if _library_route_forward(logits, ids, weights):
        return ids, weights
    ids_t, weights_t = _route_torch(logits, top_k)
    return ids.copy_(ids_t), weights.copy_(weights_t)


@_route_fwd.register_fake
def _route_fwd_fake(logits, top_k):
    T = logits.shape[0]
    return (logits.new_empty((T, top_k), dtype=torch.int32),
            logits.new_empty((T, top_k), dtype=torch.float32))


@torch.library.custom_op("moefuse::route_bwd", mutates_args=())
def _route_bwd(logits: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
               dweights: torch.Tensor) -> torch.Tensor:
    """dlogits [T, E] fp32."""
    T, E = logits.shape
    dweights = dweights.to(torch.float32).contiguous()
    dlogits = torch.empty((T, E), dtype=torch.float32, device=logits.device)
    if _library_route_backward(logits, ids, dweights, dlogits):
        return dlogits
    return _route_bwd_torch(ids, weights, dweights, E)


@_route_bwd.register_fake
def _route_bwd_fake(logits, ids, weights, dweights):
    return logits.new_empty(logits.shape, dtype=torch.float32)


def _route_setup_context(ctx, inputs, output):
    logits, _ = inputs
    ids, weights = output
    ctx.save_for_backward(logits, ids, weights)


def _route_backward(ctx, _dids, dweights):
    logits, ids, weights = ctx.saved_tensors
    return torch.ops.moefuse.route_bwd(logits, ids, weights, dweights), None


_route_fwd.register_autograd(_route_backward, setup_context=_route_setup_context)


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3 routing of logits [T, E] -> (ids [T, K] int32, weights [T, K] fp32).

    Softmax over the E experts in fp32, the top K (in decreasing weight; equal logits
    by lower id), weights renormalized to sum to 1. Differentiable in logits.
    bf16/fp16 logits are upcast to fp32 first (as Qwen3's softmax(dtype=float) does).
    On CUDA the library's helper is used once it is built; until then the same math
    runs in PyTorch inside the op.
    """
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"moefuse.route: logits must be a torch.Tensor, got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise TypeError(f"moefuse.route: logits must be floating point, got {logits.dtype}")
    if logits.dim() != 2:
        raise ValueError(f"moefuse.route: logits must be [T, E], got shape {tuple(logits.shape)}")
    if not isinstance(top_k, int) or not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"moefuse.route: top_k must be an int in [1, E={logits.shape[1]}], "
                         f"got {top_k!r}")
    if logits.device.type not in ("cpu", "cuda"):
        raise ValueError(f"moefuse.route: logits must be on the CPU or a CUDA device, got "
                         f"{logits.device}")
    logits = logits.to(torch.float32).contiguous()
    return torch.ops.moefuse.route_fwd(logits, top_k)
