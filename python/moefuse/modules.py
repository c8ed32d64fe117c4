"""nn.Modules over the moefuse ops: the routed experts and a drop-in Qwen3-MoE block.

    MoEExperts             W13 [E, 2I, H] and W2 [E, H, I] as parameters; forward(x, ids, p).
    MoefuseQwen3MoeBlock   a replacement for transformers' Qwen3MoeSparseMoeBlock:
                           router gate (nn.Linear(H, E), no bias) + MoEExperts.

Parameter names follow transformers >= 5 (`gate.weight`, `experts.gate_up_proj`,
`experts.down_proj`), so a v5 Qwen3MoeSparseMoeBlock's state dict loads as is; the
per-expert layout of transformers 4.x (`experts.{i}.gate_proj.weight`, `up_proj`,
`down_proj`) is fused on load.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
from torch import nn

from . import _fp8, ops

_BF16 = torch.bfloat16


def fuse_per_expert_state_dict(state_dict: dict, prefix: str = "") -> bool:
    """Rewrites, in place, per-expert weights under `prefix`

        {prefix}{i}.gate_proj.weight [I, H], {prefix}{i}.up_proj.weight [I, H],
        {prefix}{i}.down_proj.weight [H, I]          for i = 0 .. E-1

    into the fused {prefix}gate_up_proj [E, 2I, H] (gate rows first) and
    {prefix}down_proj [E, H, I]. Returns whether it found per-expert weights."""
    if f"{prefix}0.gate_proj.weight" not in state_dict:
        return False
    num_experts = 0
    while f"{prefix}{num_experts}.gate_proj.weight" in state_dict:
        num_experts += 1
    gate_up, down = [], []
    for i in range(num_experts):
        try:
            gate = state_dict.pop(f"{prefix}{i}.gate_proj.weight")
            up = state_dict.pop(f"{prefix}{i}.up_proj.weight")
            down.append(state_dict.pop(f"{prefix}{i}.down_proj.weight"))
        except KeyError as err:
            raise KeyError(f"per-expert state dict under '{prefix}' lacks {err} for expert {i}") from err
        gate_up.append(torch.cat([gate, up], dim=0))
    state_dict[f"{prefix}gate_up_proj"] = torch.stack(gate_up)
    state_dict[f"{prefix}down_proj"] = torch.stack(down)
    return True


class MoEExperts(nn.Module):
    """The routed experts of an MoE layer, computed by libmoefuse.

    Parameters:
        gate_up_proj: W13 [E, 2I, H]; per expert gate rows 0..I-1, up rows I..2I-1
                      ([out, in] as nn.Linear).
        down_proj:    W2 [E, H, I].
    Both bf16 by default; fp32 works too (master weights: cast to bf16 per call,
    gradients stay fp32). recompute and save_inputs (None: by the precision) choose what a
    forward keeps for its backward, and precision ("bf16" or "fp8") and fp8_pow2_scales
    the GEMMs' operands, as moefuse.experts() documents (with "fp8" the weights are
    quantized once per optimizer step; the gradients stay those of the real weights).

    forward(x [T, H], ids [T, K], p [T, K]) -> y [T, H]:
        y_t = sum_k p[t,k] * W2_e (silu(g) * u),  [g; u] = W13_e x_t,  e = ids[t,k].
    The library computes in bf16: x of another floating dtype is cast to bf16 and y
    is returned in x's dtype (what autocast would do for the matmuls).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *,
                 recompute: bool = False, save_inputs: Optional[bool] = None,
                 precision: str = "bf16",
                 fp8_pow2_scales: bool = False,
                 device: Optional[Union[torch.device, str]] = None,
                 dtype: torch.dtype = _BF16):
        super().__init__()
        _fp8.resolve_precision(precision, fp8_pow2_scales, type(self).__name__)
        for name, v in (("num_experts", num_experts), ("hidden_size", hidden_size),
                        ("intermediate_size", intermediate_size)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"MoEExperts: {name} must be an int, got {v!r}")
            if v < 1:
                raise ValueError(f"MoEExperts: {name} must be >= 1, got {v}")
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.recompute = recompute
        self.save_inputs = save_inputs
        self.precision = precision
        self.fp8_pow2_scales = fp8_pow2_scales
        self.gate_up_proj = nn.Parameter(torch.empty(
            num_experts, 2 * intermediate_size, hidden_size, device=device, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(
            num_experts, hidden_size, intermediate_size, device=device, dtype=dtype))
        self.reset_parameters()

    @property
    def w13(self) -> nn.Parameter:
        """W13 [E, 2I, H] (the gate_up_proj parameter)."""
        return self.gate_up_proj

    @property
    def w2(self) -> nn.Parameter:
        """W2 [E, H, I] (the down_proj parameter)."""
        return self.down_proj

    def reset_parameters(self) -> None:
        """nn.Linear's default init, per expert: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
        with torch.no_grad():
            bound13 = 1.0 / math.sqrt(self.hidden_size)
            bound2 = 1.0 / math.sqrt(self.intermediate_size)
            self.gate_up_proj.uniform_(-bound13, bound13)
            self.down_proj.uniform_(-bound2, bound2)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        fuse_per_expert_state_dict(state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """x [T, H], ids [T, K] int32/int64, p [T, K] fp32 -> y [T, H] in x's dtype."""
        in_dtype = x.dtype
        if x.is_floating_point() and in_dtype != _BF16:
            x = x.to(_BF16)
        if p.is_floating_point() and p.dtype != torch.float32:
            p = p.to(torch.float32)
        y = ops.experts(x, ids, p, self.gate_up_proj, self.down_proj, recompute=self.recompute,
                        save_inputs=self.save_inputs, precision=self.precision,
                        fp8_pow2_scales=self.fp8_pow2_scales)
        return y if y.dtype == in_dtype else y.to(in_dtype)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, recompute={self.recompute}, "
                f"save_inputs={self.save_inputs}, precision={self.precision!r}"
                + (", fp8_pow2_scales=True" if self.fp8_pow2_scales else ""))


class MoefuseQwen3MoeBlock(nn.Module):
    """Drop-in for transformers' Qwen3MoeSparseMoeBlock with moefuse experts.

    Routing stays in PyTorch (or the library's helper, router="moefuse"): logits =
    gate(x) in x's dtype, softmax over E in fp32, top-K, renormalized when
    norm_topk_prob (Qwen3 sets it). The weights p stay fp32 (transformers rounds
    them to the model dtype; moefuse does not).

    forward(hidden_states [B, S, H] or [T, H]) returns hidden_states of the same shape
    (the transformers >= 5 contract), or (hidden_states, router_logits [B*S, E]) when
    return_router_logits is True (the transformers 4.x contract). from_transformers()
    picks the contract of the block it replaces. precision="fp8" (and fp8_pow2_scales)
    runs the experts' GEMMs in FP8 (MoEExperts); the router stays as it is.
    """

    def __init__(self, hidden_size: int, moe_intermediate_size: int, num_experts: int,
                 num_experts_per_tok: int, norm_topk_prob: bool = True, *,
                 router: str = "torch", return_router_logits: bool = False,
                 recompute: bool = False, save_inputs: Optional[bool] = None,
                 precision: str = "bf16",
                 fp8_pow2_scales: bool = False,
                 device: Optional[Union[torch.device, str]] = None,
                 dtype: torch.dtype = _BF16):
        super().__init__()
        _fp8.resolve_precision(precision, fp8_pow2_scales, type(self).__name__)
        if router not in ("torch", "moefuse"):
            raise ValueError(f"router must be 'torch' or 'moefuse', got {router!r}")
        if router == "moefuse" and not norm_topk_prob:
            raise ValueError("router='moefuse' always renormalizes the top-K weights; "
                             "use router='torch' for norm_topk_prob=False")
        if not 1 <= num_experts_per_tok <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={num_experts}], "
                             f"got {num_experts_per_tok}")
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.top_k = num_experts_per_tok
        self.norm_topk_prob = norm_topk_prob
        self.router = router
        self.return_router_logits = return_router_logits
        self.gate = nn.Linear(hidden_size, num_experts, bias=False, device=device, dtype=dtype)
        self.experts = MoEExperts(num_experts, hidden_size, moe_intermediate_size,
                                  recompute=recompute, save_inputs=save_inputs,
                                  precision=precision, fp8_pow2_scales=fp8_pow2_scales,
                                  device=device, dtype=dtype)

    @classmethod
    def from_config(cls, config, **kwargs) -> "MoefuseQwen3MoeBlock":
        """From a transformers Qwen3MoeConfig (or anything with its field names)."""
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"moefuse computes SwiGLU (silu); config.hidden_act = {act!r}")
        return cls(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                   config.num_experts_per_tok, getattr(config, "norm_topk_prob", True), **kwargs)

    @classmethod
    def from_transformers(cls, block: nn.Module, **kwargs) -> "MoefuseQwen3MoeBlock":
        """A block with the weights, device and dtype of a transformers
        Qwen3MoeSparseMoeBlock: the fused layout of transformers >= 5 (experts.gate_up_proj
        [E, 2I, H], experts.down_proj [E, H, I], gate.weight [E, H]) or the per-expert
        layout of 4.x (experts.{i}.gate_proj / up_proj / down_proj, gate nn.Linear).
        The return contract follows the source block's version unless given in kwargs;
        the other kwargs (precision="fp8", recompute, router, ...) are the constructor's."""
        gate_weight = block.gate.weight  # [E, H] in both layouts
        num_experts, hidden = gate_weight.shape
        experts = block.experts
        per_expert = isinstance(experts, nn.ModuleList)
        if per_expert:
            intermediate = experts[0].gate_proj.weight.shape[0]
            act = getattr(experts[0], "act_fn", None)
            top_k = block.top_k
            norm_topk_prob = block.norm_topk_prob
        else:
            intermediate = experts.gate_up_proj.shape[1] // 2
            act = getattr(experts, "act_fn", None)
            top_k = block.gate.top_k
            norm_topk_prob = block.gate.norm_topk_prob
        if act is not None and not isinstance(act, nn.SiLU) and "silu" not in type(act).__name__.lower():
            raise ValueError(f"moefuse computes SwiGLU (silu); the block's experts use {act}")
        kwargs.setdefault("return_router_logits", per_expert)
        kwargs.setdefault("device", gate_weight.device)
        kwargs.setdefault("dtype", gate_weight.dtype)
        new = cls(hidden, intermediate, num_experts, top_k, norm_topk_prob, **kwargs)
        new.load_state_dict(block.state_dict())
        return new

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> (router_logits [T, E] in x's dtype, ids [T, K] int32, p [T, K] fp32)."""
        router_logits = self.gate(x)
        if self.router == "moefuse":
            ids, p = ops.route(router_logits, self.top_k)
            return router_logits, ids, p
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        p, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            p = p / p.sum(dim=-1, keepdim=True)
        return router_logits, ids.to(torch.int32), p

    def forward(self, hidden_states: torch.Tensor):
        """hidden_states [B, S, H] (or [T, H]) -> same shape; see the class docstring."""
        shape = hidden_states.shape
        if shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states must end in hidden_size={self.hidden_size}, got "
                             f"shape {tuple(shape)}")
        x = hidden_states.reshape(-1, self.hidden_size)
        router_logits, ids, p = self.route(x)
        y = self.experts(x, ids, p).reshape(shape)
        if self.return_router_logits:
            return y, router_logits
        return y

    def extra_repr(self) -> str:
        return (f"top_k={self.top_k}, norm_topk_prob={self.norm_topk_prob}, "
                f"router={self.router!r}, return_router_logits={self.return_router_logits}")
