"""moefuse inside TorchTitan's MoE models (torchtitan 0.2.x: torchtitan/models/moe/moe.py).

    moefuse.torchtitan.apply(model)    -> names of the MoE modules now computed by moefuse
    moefuse.torchtitan.apply(model, precision="fp8")   the same, the expert GEMMs in FP8
    moefuse.torchtitan.restore(model)  -> names of the MoE modules given back to TorchTitan
    moefuse.torchtitan.shard_experts(model, ep_mesh)   TorchTitan's EP layout of the experts
    moefuse.torchtitan.apply(model, expert_parallel=ExpertParallelPlan(comms, rank, R, ...))
        -> the same, the experts computed with moefuse's expert parallelism

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
weights (`w1.bfloat16()`, whatever the parameter dtype); so does this adapter in bf16, so
fp32 master weights get the gradients that TorchTitan's experts give them: bf16, widened
(FP8 reads the parameters themselves: see precision="fp8" below).

w1 and w3 go to the library as W13's two halves (moefuse_fwd_args.w13 and w13_up, see
"W13 in two halves" in include/moefuse.h): its kernels read each where it is, and the
backward writes the gradients of w1 and w3 into two tensors of their own. So no
[E, 2F, D] concatenation is made per call (E * 2F * D * 2 bytes written and read again:
about 0.4 ms per forward on qwen3-30b-a3b on an H200), and no split of dW13 after the
backward: the bits are those of the concatenated W13. The expert-parallel path below
does the same: ExpertParallelExperts takes this rank's w1 and w3 as the pair (gate, up).

precision="fp8" runs the routed experts' GEMMs in block-scaled FP8 (moefuse.experts(),
_fp8.py), with expert_parallel in its ExpertParallelExperts. On one rank and under expert
parallelism (there this rank's local tensors of them) w1, w3 and w2 reach the FP8 weight
cache as the parameters themselves, fp32 master weights or bf16 (no per-call bf16 copy):
they are quantized from their own values once per optimizer step, w1 and w3 where they
are (moefuse_quantize_weights_halves), and fp32 parameters get fp32 gradients (the
recipe's; bf16 runs give TorchTitan's bf16 gradients widened).

Not supported (apply() or the forward says so):
- score_before_experts=True (TorchTitan scales the routed tokens by their scores before
  the experts: a different function than moefuse's p * W2 a). Qwen3's configurations set
  it False.
- Experts under tensor parallelism (TorchTitan's TensorParallel, ExpertTensorParallel:
  w1/w3 sharded on F, w2 on F), DeepEP's MoE (a subclass with its own dispatch), and
  experts that went through TorchTitan's own ExpertParallel (its all-to-all hooks sit on
  the experts module): shard them with shard_experts instead.

Expert parallelism (docs/decisions/0019-torchtitan-expert-parallel.md): shard_experts makes
TorchTitan's EP layout (w1, w2, w3 DTensors sharded on the experts over the EP mesh, the
same state_dict and checkpoints as TorchTitan's EP) without its dispatch hooks, and apply
with an ExpertParallelPlan gives each MoE's experts a moefuse.distributed layer: the
router's ids go to the library as they are (global expert ids) and the token exchange
happens inside moefuse's kernels, replacing TorchTitan's reorder, count all-to-all (and
its host synchronization), token all-to-all, permute, unpermute and combine all-to-all.
The experts module is called through its __call__, so FSDP's hooks on it (TorchTitan's
separate experts unit on the edp mesh) run; the routing weights pass that call in fp32
(FSDP's mixed precision would cast them to bf16). On the CPU the path is tested with one
rank, with and without FSDP's EP layout; the virtual-rank tests need a GPU.

FSDP2: with one expert-parallel rank TorchTitan's apply_fsdp shards whole transformer
blocks, and FSDP unshards the experts' weights into plain bf16 tensors before the block's
forward: that is the case this adapter takes. Tested on one gloo rank on the CPU: loss and
gradients equal the unsharded model in bf16 bit for bit, except one router gradient that
FSDP changes in TorchTitan's own model too (by 5e-9 of its largest entry).

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

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch import nn

from . import _fp8, _lib, ops

_BF16 = torch.bfloat16

__all__ = ["ExpertParallelPlan", "MoefuseExperts", "MoefuseMoE", "apply", "restore",
           "routed_experts", "shard_experts"]


def _plain(w: torch.Tensor, what: str) -> torch.Tensor:
    """The local tensor of an expert weight; DTensors (EP / TP meshes) are refused."""
    if isinstance(w, DTensor):
        raise NotImplementedError(
            f"moefuse.torchtitan: {what} is a DTensor on mesh dims "
            f"{getattr(w.device_mesh, 'mesh_dim_names', None)}; experts under expert "
            "parallelism need apply(model, expert_parallel=ExpertParallelPlan(...)), and "
            "tensor parallelism of the experts is not supported (FSDP on the blocks is)")
    return w


def routed_experts(x: torch.Tensor, top_scores: torch.Tensor, ids: torch.Tensor,
                   w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, *,
                   recompute: bool = False, save_inputs: Optional[bool] = None,
                   precision: str = "bf16") -> torch.Tensor:
    """TorchTitan's routed experts with score_before_experts=False, by moefuse:

        x [T, D], top_scores [T, K] (fp32), ids [T, K] (int64 from torch.topk),
        w1, w3 [E, F, D], w2 [E, D, F]  ->  y [T, D] in x's dtype,
        y_t = sum_k top_scores[t,k] * w2_e (silu(w1_e x_t) * w3_e x_t),  e = ids[t,k].

    bf16: the weights are taken in bf16 as TorchTitan's experts take them (a no-op for
    bf16 parameters); fp8: as they are, for the FP8 weight cache (see the module
    docstring). w1 and w3 are W13's gate and up halves, read where they are. precision:
    "bf16" or "fp8", as moefuse.experts() takes it."""
    w1, w3, w2 = _expert_weights(w1, w3, w2, precision)
    y = ops.experts(x.to(_BF16), ids, top_scores.to(torch.float32), (w1, w3), w2,
                    recompute=recompute, save_inputs=save_inputs, precision=precision)
    return y.to(x.dtype)


def _expert_weights(w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                    precision: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weights as moefuse takes them, on one rank and under expert parallelism: bf16
    (TorchTitan's experts compute on bf16 copies, so fp32 master weights get its gradients:
    bf16, widened); fp8 as they are, so the FP8 weight cache quantizes the parameters
    themselves once per optimizer step."""
    if precision == "fp8":
        return w1, w3, w2
    return w1.to(_BF16), w3.to(_BF16), w2.to(_BF16)


class MoefuseMoE(_tt_moe.MoE):
    """TorchTitan's MoE whose routed experts run in moefuse. Made by apply() from a MoE
    instance (its class is swapped in place); same parameters, buffers and children."""

    moefuse_recompute: bool = False
    moefuse_save_inputs: Optional[bool] = None
    moefuse_precision: str = "bf16"

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
        if isinstance(experts, MoefuseExperts):  # expert parallelism: through experts'
            # __call__, so FSDP's hooks on an experts unit (TorchTitan's EP layout) run.
            out_experts = experts(x, _Fp32(top_scores), selected_experts_indices)
            if self.shared_experts is None:
                return out_experts.reshape(bs, slen, dim)
            return (self.shared_experts(x) + out_experts).reshape(bs, slen, dim)
        out_experts = routed_experts(
            x, top_scores, selected_experts_indices, _plain(experts.w1, "experts.w1"),
            _plain(experts.w3, "experts.w3"), _plain(experts.w2, "experts.w2"),
            recompute=self.moefuse_recompute, save_inputs=self.moefuse_save_inputs,
            precision=self.moefuse_precision)
        if self.shared_experts is None:
            return out_experts.reshape(bs, slen, dim)
        return (self.shared_experts(x) + out_experts).reshape(bs, slen, dim)


# ---- expert parallelism --------------------------------------------------------------------


@dataclass
class ExpertParallelPlan:
    """This rank's part of moefuse's expert parallelism, for apply(expert_parallel=...).

    comms: one moefuse comm per MoE of the model, in named_modules() order
        (distributed.nccl_comm_from_group over the EP mesh's group; distributed.virtual_comm
        in tests), each of num_ranks ranks. The same comm may be given for every layer:
        its layers then share each rank's receive windows and scratch (sized for the
        largest layer), which a model of 48-94 MoE layers needs to fit; separate comms
        give each layer its own.
    rank, num_ranks: this rank in the EP group; its experts are rank*E/R .. (rank+1)*E/R-1.
    max_tokens: the most tokens (batch * sequence) one rank passes to one MoE, the same
        on every rank (sizes the library's receive buffers).
    saved_mode, pipeline: as ExpertParallelExperts takes them.
    device: where apply() creates the library layers (collective with NCCL: every rank
        calls apply() together); None creates each at its first forward, which virtual
        ranks cannot do (see distributed.virtual_comm).
    """

    comms: Sequence[_lib.Comm]
    rank: int
    num_ranks: int
    max_tokens: int
    saved_mode: _lib.SavedMode = _lib.SavedMode.SAVE_ACTIVATIONS
    pipeline: Optional[_lib.Pipeline] = None
    device: Optional[Union[torch.device, str]] = None


def _ep_local(w: torch.Tensor, what: str, ep) -> torch.Tensor:
    """This rank's experts of an EP-sharded weight: the local tensor of a DTensor sharded
    on dim 0 over a 1-d mesh of ep.num_ranks ranks (TorchTitan's EP layout, also what FSDP
    gives inside the forward when it shards the experts on an edp mesh), or a plain tensor
    that already holds only them."""
    if isinstance(w, DTensor):
        mesh = w.device_mesh
        if mesh.ndim != 1 or tuple(w.placements) != (Shard(0),):
            raise NotImplementedError(
                f"moefuse.torchtitan: {what} is a DTensor with placements {w.placements} on "
                f"mesh dims {mesh.mesh_dim_names}; moefuse's expert parallelism takes experts "
                "sharded on dim 0 over the EP mesh only (no tensor parallel of the experts)")
        if mesh.size() != ep.num_ranks or mesh.get_local_rank() != ep.rank:
            raise ValueError(
                f"moefuse.torchtitan: {what} is sharded over {mesh.size()} ranks, this is rank "
                f"{mesh.get_local_rank()}; the comm's layer is rank {ep.rank} of {ep.num_ranks}")
        w = w.to_local()
    if w.shape[0] != ep.num_local_experts:
        raise ValueError(f"moefuse.torchtitan: {what} holds {w.shape[0]} experts on this rank, "
                         f"expected E/R = {ep.num_experts}/{ep.num_ranks}")
    return w


class _Fp32:
    """A tensor passed through a module's __call__ untouched: FSDP's MixedPrecisionPolicy
    casts the floating tensors among a unit's forward inputs to its param_dtype (bf16), and
    the routing weights must reach moefuse in fp32, as on one rank."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class MoefuseExperts(_tt_moe.GroupedExperts):
    """TorchTitan's GroupedExperts computed by moefuse with expert parallelism (made by
    apply(expert_parallel=...), its class swapped in place; same parameters). forward(x
    [T, D], top_scores [T, K] fp32, ids [T, K] global expert ids) -> y [T, D]: the tokens
    go to their experts' ranks and back inside moefuse's kernels (no reorder, no
    all-to-all, no host synchronization). The ExpertParallelExperts that holds the
    library layer lives in __dict__, not as a child: it adds nothing to state_dict()."""

    def forward(self, x: torch.Tensor, top_scores: Union[torch.Tensor, _Fp32],
                ids: torch.Tensor) -> torch.Tensor:
        if isinstance(top_scores, _Fp32):
            top_scores = top_scores.tensor
        ep = self.__dict__["moefuse_ep"]
        w1, w3, w2 = _expert_weights(_ep_local(self.w1, "experts.w1", ep),
                                     _ep_local(self.w3, "experts.w3", ep),
                                     _ep_local(self.w2, "experts.w2", ep), ep.precision)
        # The module's own parameters are on the meta device (it holds the layer, not the
        # weights): the call takes this rank's slices of TorchTitan's, w1 and w3 as W13's
        # two halves, as on one rank.
        y = ep(x.to(_BF16), ids, top_scores.to(torch.float32), w13=(w1, w3), w2=w2)
        return y.to(x.dtype)


def _ep_module(name: str, moe: nn.Module, comm, plan: ExpertParallelPlan,
               precision: str = "bf16"):
    """The ExpertParallelExperts (meta parameters) that holds `moe`'s library layer;
    raises before anything is created where the experts do not fit the plan."""
    from . import distributed  # its NCCL bindings, only where EP is asked for
    name = name or "the model"
    experts = moe.experts
    if getattr(experts, "_distribute_module_applied", False):
        raise ValueError(
            f"moefuse.torchtitan: {name}.experts went through parallelize_module (TorchTitan's "
            "ExpertParallel, TensorParallel or DeepEP style), whose dispatch hooks would run "
            "around moefuse's; shard the experts with moefuse.torchtitan.shard_experts "
            "instead of TorchTitan's apply_moe_ep_tp")
    w1 = experts.w1
    if isinstance(w1, DTensor) and w1.device_mesh.ndim > 1:
        raise ValueError(
            f"moefuse.torchtitan: {name}.experts.w1 is a DTensor on mesh dims "
            f"{w1.device_mesh.mesh_dim_names} (FSDP applied?); call "
            "apply(model, expert_parallel=...) after shard_experts and before fully_shard")
    _, F, D = w1.shape
    E = experts.num_experts  # all ranks' (TorchTitan keeps it when it shards the weights)
    ep = distributed.ExpertParallelExperts(
        D, F, E, moe.router.top_k, plan.max_tokens, comm, plan.rank, plan.num_ranks,
        saved_mode=plan.saved_mode, device="meta", pipeline=plan.pipeline, precision=precision)
    for w, what in ((experts.w1, "w1"), (experts.w3, "w3"), (experts.w2, "w2")):
        _ep_local(w, f"{name}.experts.{what}", ep)
    return ep


def shard_experts(model: nn.Module, ep_mesh) -> list[str]:
    """TorchTitan's EP layout of every MoE's routed experts, without its dispatch: w1, w2,
    w3 become DTensors sharded on dim 0 (the experts) over the 1-d `ep_mesh`, as
    TorchTitan's ExpertParallel._partition_fn makes them, so checkpoints (DCP) and FSDP's
    edp sharding see what they see under TorchTitan's EP. Use it in place of
    apply_moe_ep_tp; then apply(model, expert_parallel=...). Returns the MoEs' names."""
    names = []
    for name, m in model.named_modules():
        if not isinstance(m, _tt_moe.MoE):
            continue
        experts = m.experts
        if experts.num_experts % ep_mesh.size():
            raise ValueError(f"moefuse.torchtitan: {name} has {experts.num_experts} experts, "
                             f"not divisible by the EP mesh's {ep_mesh.size()} ranks")
        for pname, param in list(experts.named_parameters(recurse=False)):
            experts.register_parameter(pname, nn.Parameter(
                distribute_tensor(param, ep_mesh, [Shard(0)])))
        names.append(name)
    return names


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


def apply(model: nn.Module, *, recompute: bool = False, save_inputs: Optional[bool] = None,
          precision: str = "bf16",
          expert_parallel: Optional[ExpertParallelPlan] = None) -> list[str]:
    """Makes moefuse compute the routed experts of every TorchTitan MoE in `model`, in
    place; returns their names. Call it before or after TorchTitan's parallelize (AC
    wrappers and per-module torch.compile wrap the MoE's children, not the MoE). Raises
    ValueError, before changing anything, if some MoE cannot be swapped (see the module
    docstring). recompute and save_inputs: what the forward keeps for the backward, as
    moefuse.experts() documents (one rank). precision: "bf16" or "fp8" (the expert GEMMs
    in block-scaled FP8, expert_parallel or not).

    expert_parallel: the experts hold this rank's E/R experts (shard_experts' DTensors, or
    plain tensors of E/R experts) and moefuse's expert parallelism runs them, one comm per
    MoE (see ExpertParallelPlan); recompute and save_inputs are then the plan's
    saved_mode. In TorchTitan's parallelize order: shard_experts and this call where it
    calls apply_moe_ep_tp, so before AC, compile and FSDP."""
    _fp8.resolve_precision(precision, False, "moefuse.torchtitan.apply")
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, _tt_moe.MoE)]
    todo = [(name, m) for name, m in found if not isinstance(m, MoefuseMoE)]
    for name, m in todo:
        _check_swappable(name, m)
    ep_modules = []
    if expert_parallel is not None:
        plan = expert_parallel
        if len(plan.comms) != len(found):
            raise ValueError(f"moefuse.torchtitan: the plan has {len(plan.comms)} comms for "
                             f"{len(found)} MoE layers (one comm per layer)")
        if isinstance(found[0][1].experts if found else None, MoefuseExperts):
            raise ValueError("moefuse.torchtitan: the model's experts already run with expert "
                             "parallelism; restore() first")
        ep_modules = [_ep_module(name, m, comm, plan, precision)
                      for (name, m), comm in zip(found, plan.comms)]
        if plan.device is not None:
            for ep in ep_modules:
                ep._layer_on(torch.device(plan.device))
    for i, (_, m) in enumerate(found):
        m.__class__ = MoefuseMoE
        m.moefuse_recompute = recompute
        m.moefuse_save_inputs = save_inputs
        m.moefuse_precision = precision
        if ep_modules:
            m.experts.__class__ = MoefuseExperts
            m.experts.__dict__["moefuse_ep"] = ep_modules[i]
    return [name for name, _ in found]


def restore(model: nn.Module) -> list[str]:
    """Gives every MoefuseMoE in `model` back to TorchTitan's MoE; returns their names."""
    names = []
    for name, m in model.named_modules():
        if isinstance(m, MoefuseMoE):
            m.__class__ = _tt_moe.MoE
            for attr in ("moefuse_recompute", "moefuse_save_inputs", "moefuse_precision"):
                m.__dict__.pop(attr, None)
            if isinstance(m.experts, MoefuseExperts):
                m.experts.__class__ = _tt_moe.GroupedExperts
                m.experts.__dict__.pop("moefuse_ep").close()  # collective with NCCL
            names.append(name)
    return names
