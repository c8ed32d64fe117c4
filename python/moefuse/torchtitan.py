"""moefuse inside TorchTitan's MoE models (torchtitan 0.2.x: torchtitan/models/moe/moe.py).

    moefuse.torchtitan.apply(model)    -> names of the MoE modules now computed by moefuse
    moefuse.torchtitan.restore(model)  -> names of the MoE modules given back to TorchTitan

TorchTitan's MoE is a router (TokenChoiceTopKRouter), a TokenReorderer, GroupedExperts
(w1, w3 [E, F, D]; w2 [E, D, F]), optional shared experts, then an unsort and a weighted
sum of the K expert outputs. apply() swaps the class of each such module for MoefuseMoE,
a subclass whose forward keeps the router (with expert_bias), the tokens_per_expert
count that TorchTitan's load-balancing hook reads, and the shared experts, and hands the
rest (reorder, experts, unsort, weighted sum) to one moefuse.experts() call. No parameter
or buffer is added, moved or renamed: state_dict(), TorchTitan's checkpoints and its
state-dict adapters (Qwen3StateDictAdapter) see the model they saw before, both ways.

The math, in TorchTitan's names (D = H hidden, F = I expert intermediate size):
    top_scores [T, K] fp32, ids [T, K] int64 = router(x, expert_bias)
        (softmax or sigmoid in fp32, top-K on scores + expert_bias, gather from the
         scores, route_norm, route_scale: all TorchTitan's code, unchanged)
    y = sum_k top_scores[t,k] * w2_e (silu(w1_e x_t) * (w3_e x_t)),  e = ids[t,k]
    out = y (+ shared_experts(x))
That is moefuse's experts op with W13_e = [w1_e; w3_e] (gate rows, then up rows),
W2_e = w2_e and p = top_scores. TorchTitan's own experts compute on bf16 copies of the
weights (`w1.bfloat16()`, whatever the parameter dtype); so does this adapter, so fp32
master weights get the gradients that TorchTitan's experts give them: bf16, widened.

Cost of the current C API: moefuse_fwd_args takes one W13 pointer, so every forward
concatenates w1 and w3 into a [E, 2F, D] bf16 tensor (E * 2F * D * 2 bytes written, and
read by the op), and autograd splits dW13 back into the gradients of w1 and w3. A later
change of the C API takes gate and up as two pointers and removes both copies.

Not supported (apply() or the forward says so):
- score_before_experts=True (TorchTitan scales the routed tokens by their scores before
  the experts: a different function than moefuse's p * W2 a). Qwen3's configurations set
  it False.
- Experts under expert or tensor parallelism (w1/w2/w3 as DTensors in the forward), and
  DeepEP's MoE (a subclass with its own dispatch).

FSDP2: with one expert-parallel rank TorchTitan's apply_fsdp shards whole transformer
blocks, and FSDP unshards the experts' weights into plain bf16 tensors before the block's
forward: that is the case this adapter takes. Tested on one gloo rank on the CPU: loss and
gradients equal the unsharded model in bf16 bit for bit (see test_torchtitan.py).

Activation checkpointing, as TorchTitan's apply_ac wraps the blocks ('full', 'selective'
by op with Qwen3's save list, 'selective' every n-th layer): moefuse's op runs again in
the recompute (it is not on the save list, like TorchTitan's own _grouped_mm), and the
op is deterministic, so loss and gradients equal those without AC bit for bit (tested on
the CPU). The recompute costs one more forward of the experts per checkpointed block.

torch.compile as TorchTitan applies it (the router, reorderer and shared experts compiled
one by one, the MoE's own forward eager) leaves this adapter's code eager, as it leaves
TorchTitan's unsort and weighted sum; moefuse's op is a custom op with a fake
implementation, so compiling the whole MoE with fullgraph=True traces too (both are
checked on the CPU with the aot_eager backend; inductor on a GPU is the benchmark's).

TorchTitan 0.3 moves this to torchtitan/models/common/moe.py (RoutedExperts = token
dispatcher + GroupedExperts with w1_EFD, w3_EFD, w2_EDF): routed_experts() below is the
part that carries over; only the module that calls it changes.
"""

from __future__ import annotations

try:
    from torchtitan.models.moe import moe as _tt_moe
except ImportError as err:  # pragma: no cover - the message is the point
    raise ImportError(
        "moefuse.torchtitan needs TorchTitan (pip install torchtitan==0.2.2; "
        "tools/install_deps.sh installs it): " + str(err)) from err

import torch
from torch.distributed.tensor import DTensor
from torch import nn

from . import ops

_BF16 = torch.bfloat16

__all__ = ["MoefuseMoE", "apply", "restore", "routed_experts"]


def _plain(w: torch.Tensor, what: str) -> torch.Tensor:
    """The local tensor of an expert weight; DTensors (EP / TP meshes) are refused."""
    if isinstance(w, DTensor):
        raise NotImplementedError(
            f"moefuse.torchtitan: {what} is a DTensor on mesh dims "
            f"{getattr(w.device_mesh, 'mesh_dim_names', None)}; experts under expert or "
            "tensor parallelism are not supported by this adapter (FSDP on the blocks is)")
    return w


def routed_experts(x: torch.Tensor, top_scores: torch.Tensor, ids: torch.Tensor,
                   w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, *,
                   recompute: bool = False, save_inputs: bool = True) -> torch.Tensor:
    """TorchTitan's routed experts with score_before_experts=False, by moefuse:

        x [T, D], top_scores [T, K] (fp32), ids [T, K] (int64 from torch.topk),
        w1, w3 [E, F, D], w2 [E, D, F]  ->  y [T, D] in x's dtype,
        y_t = sum_k top_scores[t,k] * w2_e (silu(w1_e x_t) * w3_e x_t),  e = ids[t,k].

    The weights are taken in bf16 as TorchTitan's experts take them; w1 and w3 are
    concatenated into W13 per call (see the module docstring for the cost)."""
    w13 = torch.cat([w1.to(_BF16), w3.to(_BF16)], dim=1)  # [E, 2F, D]: gate rows, up rows
    y = ops.experts(x.to(_BF16), ids, top_scores.to(torch.float32), w13, w2.to(_BF16),
                    recompute=recompute, save_inputs=save_inputs)
    return y.to(x.dtype)


class MoefuseMoE(_tt_moe.MoE):
    """TorchTitan's MoE whose routed experts run in moefuse. Made by apply() from a MoE
    instance (its class is swapped in place); same parameters, buffers and children."""

    moefuse_recompute: bool = False
    moefuse_save_inputs: bool = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [bs, slen, dim] -> [bs, slen, dim], as TorchTitan's MoE.forward."""
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        top_scores, selected_experts_indices, num_tokens_per_expert = self.router(
            x, self.expert_bias)
        # Read by TorchTitan's load-balancing hook (the expert_bias update) and its logs.
        with torch.no_grad():
            self.tokens_per_expert.add_(num_tokens_per_expert)
        experts = self.experts
        out_experts = routed_experts(
            x, top_scores, selected_experts_indices, _plain(experts.w1, "experts.w1"),
            _plain(experts.w3, "experts.w3"), _plain(experts.w2, "experts.w2"),
            recompute=self.moefuse_recompute, save_inputs=self.moefuse_save_inputs)
        if self.shared_experts is None:
            return out_experts.reshape(bs, slen, dim)
        return (self.shared_experts(x) + out_experts).reshape(bs, slen, dim)


def _check_swappable(name: str, module: nn.Module) -> None:
    if type(module) is not _tt_moe.MoE:
        raise ValueError(f"moefuse.torchtitan: {name} is a {type(module).__name__}, a subclass "
                         "of TorchTitan's MoE with its own forward; only MoE itself is swapped")
    if module.score_before_experts:
        raise ValueError(
            f"moefuse.torchtitan: {name} has score_before_experts=True (the routed tokens "
            "scaled before the experts); moefuse weights the experts' outputs, which is "
            "score_before_experts=False")
    w1, w2, w3 = module.experts.w1, module.experts.w2, module.experts.w3
    E, F, D = w1.shape
    if tuple(w3.shape) != (E, F, D) or tuple(w2.shape) != (E, D, F):
        raise ValueError(f"moefuse.torchtitan: {name}.experts has w1 {tuple(w1.shape)}, "
                         f"w3 {tuple(w3.shape)}, w2 {tuple(w2.shape)}; expected w1, w3 "
                         "[E, F, D] and w2 [E, D, F]")


def apply(model: nn.Module, *, recompute: bool = False, save_inputs: bool = True) -> list[str]:
    """Makes moefuse compute the routed experts of every TorchTitan MoE in `model`, in
    place; returns their names. Call it before or after TorchTitan's parallelize (AC
    wrappers and per-module torch.compile wrap the MoE's children, not the MoE). Raises
    ValueError, before changing anything, if some MoE cannot be swapped (see the module
    docstring). recompute and save_inputs: what the forward keeps for the backward, as
    moefuse.experts() documents."""
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, _tt_moe.MoE)]
    todo = [(name, m) for name, m in found if not isinstance(m, MoefuseMoE)]
    for name, m in todo:
        _check_swappable(name, m)
    for _, m in found:
        m.__class__ = MoefuseMoE
        m.moefuse_recompute = recompute
        m.moefuse_save_inputs = save_inputs
    return [name for name, _ in found]


def restore(model: nn.Module) -> list[str]:
    """Gives every MoefuseMoE in `model` back to TorchTitan's MoE; returns their names."""
    names = []
    for name, m in model.named_modules():
        if isinstance(m, MoefuseMoE):
            m.__class__ = _tt_moe.MoE
            for attr in ("moefuse_recompute", "moefuse_save_inputs"):
                m.__dict__.pop(attr, None)
            names.append(name)
    return names
