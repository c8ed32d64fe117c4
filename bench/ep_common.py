"""What bench_ep.py's modes share: rank-0 printing, reductions over the ranks, and one
forward and backward of a module or op with its gradients."""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

NAMES = ("y", "dx", "dp", "dw13", "dw2")


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _print0(line: str) -> None:
    if _rank0():
        print(line, flush=True)


def _over_ranks(values, op) -> list:
    """values (a list, nested allowed) reduced elementwise over the ranks with op."""
    t = torch.tensor(values, dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=op)
    return t.tolist()


def forward_backward(forward, x, p, ids, dy, weights) -> tuple:
    """(y, dx, dp, dW13, dW2) of y = forward(x, ids, p) and its backward from dy, where
    weights = (w13, w2) are the leaves forward uses (autograd.grad: nothing accumulates
    into .grad)."""
    y = forward(x, ids, p)
    return (y.detach(),) + torch.autograd.grad(y, (x, p) + tuple(weights), dy,
                                               allow_unused=True)


def module_error(module) -> Optional[str]:
    """None when module.check() passes, else its MoefuseError as text."""
    import moefuse

    try:
        module.check()
    except moefuse.MoefuseError as err:
        return str(err)
    return None


def ep_step(module, x, p, ids, dy) -> tuple:
    """(y, dx, dp, dW13, dW2) of one forward and backward of the EP module."""
    return forward_backward(module, x, p, ids, dy, (module.w13, module.w2))
