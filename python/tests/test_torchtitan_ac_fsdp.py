"""moefuse.torchtitan under activation checkpointing (TorchTitan's apply_ac, full and
selective) and FSDP2 (TorchTitan's apply_fsdp on one gloo rank, with and without AC),
compared with the swapped model without them: bit for bit (FSDP: against the model in bf16, which is what
FSDP computes with; one router gradient that FSDP changes in TorchTitan's own model too is
checked to change in both, by less than one bf16 rounding).

The models are torchtitan_helpers.py's; on the CPU the router's histc goes through
conftest.py's cpu_histc fixture (see test_torchtitan.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

torchtitan = pytest.importorskip(
    "torchtitan", reason="TorchTitan is not installed (tools/install_deps.sh installs it)")

from torchtitan.config.job_config import ActivationCheckpoint  # noqa: E402
from torchtitan.distributed import activation_checkpoint  # noqa: E402
from torchtitan.models.llama4.infra.parallelize import apply_fsdp  # noqa: E402
from torchtitan.models.qwen3.infra.parallelize import _op_sac_save_list  # noqa: E402

import moefuse.torchtitan as mtt  # noqa: E402

from moe_reference import rel_error, tolerance  # noqa: E402
from torchtitan_helpers import BS, SLEN, tiny_args, tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("library", "cpu_histc")


# ---- activation checkpointing and FSDP2, as TorchTitan applies them ----------------------------


def train_step(model, tokens, labels, autocast=True):
    """(loss, {param name: grad}) of TorchTitan's step on one rank: the model under autocast
    (its fp32 parameters) or as is, cross entropy in fp32. Names without the wrappers'
    prefixes (checkpoint_wrapper); FSDP's DTensor gradients as full tensors."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(tokens)
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name.replace("._checkpoint_wrapped_module", "")] = (
            g.full_tensor() if hasattr(g, "full_tensor") else g)
    return loss.detach(), grads


def step_inputs(args, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, args.vocab_size, (BS, SLEN), generator=g),
            torch.randint(0, args.vocab_size, (BS, SLEN), generator=g))


def count_moefuse_calls(monkeypatch) -> list:
    """Counts the routed_experts calls of MoefuseMoE.forward (recomputes included)."""
    calls = []
    routed = mtt.routed_experts

    def counted(*args, **kwargs):
        calls.append(1)
        return routed(*args, **kwargs)
    monkeypatch.setattr(mtt, "routed_experts", counted)
    return calls


@pytest.mark.parametrize("mode, option, forwards", [
    ("full", "op", 4),          # every block recomputed in the backward
    ("selective", "op", 4),     # op SAC: aten.mm and attention saved, the rest recomputed
    ("selective", "2", 3),      # layer SAC: every second block checkpointed
], ids=["full", "selective_op", "selective_layer_2"])
def test_activation_checkpointing_is_bitwise(mode, option, forwards, monkeypatch):
    """TorchTitan's apply_ac (with Qwen3's op save list) on the swapped model: the loss and
    every gradient equal the swapped model without AC, bit for bit. The recompute runs the
    same CPU kernels on the same inputs in the same order (moefuse's op is deterministic,
    and not on the save list, so op SAC recomputes it too): there is nothing to differ."""
    args = tiny_args(num_shared_experts=1)
    plain = tiny_model(args, dtype=torch.float32)
    mtt.apply(plain)
    checkpointed = copy.deepcopy(plain)
    monkeypatch.setattr(activation_checkpoint, "_layer_sac_count", 0)  # TorchTitan's global
    activation_checkpoint.apply_ac(
        checkpointed, ActivationCheckpoint(mode=mode, selective_ac_option=option),
        op_sac_save_list=_op_sac_save_list)
    wrapped = [n for n, b in checkpointed.layers.items() if type(b).__name__ == "CheckpointWrapper"]
    assert wrapped == (["1"] if option == "2" else ["0", "1"])
    tokens, labels = step_inputs(args)
    loss, grads = train_step(plain, tokens, labels)
    calls = count_moefuse_calls(monkeypatch)
    loss_ac, grads_ac = train_step(checkpointed, tokens, labels)
    assert len(calls) == forwards  # two MoE layers, plus one forward per recompute
    assert torch.equal(loss_ac, loss), (loss_ac.item(), loss.item())
    assert grads_ac.keys() == grads.keys()
    differ = [n for n in grads if not torch.equal(grads_ac[n], grads[n])]
    assert not differ, f"gradients not bitwise equal under AC {mode}/{option}: {differ}"


def fsdp_model(model, mesh):
    """TorchTitan's apply_fsdp as its Qwen3 parallelize calls it with one rank and no EP:
    bf16 parameters in the forward and backward, fp32 gradient reduction."""
    apply_fsdp(model, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
               pp_enabled=False)
    return model


@pytest.mark.parametrize("ac", [None, "full"])
def test_fsdp2_one_rank_matches_unsharded(one_rank_gloo_mesh, ac, monkeypatch):
    """FSDP2 (TorchTitan's apply_fsdp, one gloo rank, after its apply_ac when asked) on the
    swapped model: the loss and the gradients equal those of the unsharded swapped model
    in bf16 (what FSDP computes with) bit for bit, widened to fp32 by the reduction, except
    where FSDP changes TorchTitan's own model too: the router gate of the second layer,
    whose gradient under FSDP differs from the unsharded one by at most 5e-9 of its
    largest entry (norm-wise 4e-9), in the native model as in the swapped one; that parameter
    must differ in both and stay within one bf16 rounding. The routed experts' gradients,
    moefuse's output, are bitwise."""
    mesh = one_rank_gloo_mesh
    args = tiny_args(num_shared_experts=1)
    native = tiny_model(args, dtype=torch.float32)
    swapped = copy.deepcopy(native)
    mtt.apply(swapped)
    tokens, labels = step_inputs(args)

    def sharded(model):
        model = copy.deepcopy(model)
        if ac is not None:
            monkeypatch.setattr(activation_checkpoint, "_layer_sac_count", 0)
            activation_checkpoint.apply_ac(model, ActivationCheckpoint(mode=ac),
                                           op_sac_save_list=_op_sac_save_list)
        return fsdp_model(model, mesh)

    results = {}
    for what, model in (("native", native), ("swapped", swapped)):
        fsdp = sharded(model)
        assert isinstance(fsdp.layers["0"].moe.experts.w1, DTensor)
        assert type(fsdp.layers["0"].moe).__name__ == type(model.layers["0"].moe).__name__
        results[what] = (train_step(fsdp, tokens, labels, autocast=False),
                         train_step(copy.deepcopy(model).bfloat16(), tokens, labels,
                                    autocast=False))
    (loss_f, grads_f), (loss_u, grads_u) = results["swapped"]
    (_, native_f), (_, native_u) = results["native"]
    assert torch.equal(loss_f, loss_u), (loss_f.item(), loss_u.item())
    assert grads_f.keys() == grads_u.keys()
    fsdp_changes_native = {n for n in native_f if not torch.equal(native_f[n], native_u[n].float())}
    print("parameters whose gradient FSDP changes in TorchTitan's own model:",
          sorted(fsdp_changes_native))
    for name in grads_u:
        got, want = grads_f[name], grads_u[name]
        assert got.dtype == torch.float32 and want.dtype == torch.bfloat16, name
        if torch.equal(got, want.float()):
            continue
        assert ".moe.experts." not in name, f"{name}: moefuse's gradient changed under FSDP"
        assert name in fsdp_changes_native, f"{name}: changed under FSDP, TorchTitan's is not"
        err = rel_error(got, want.float())
        peak = ((got - want.float()).abs().max() / want.float().abs().max()).item()
        print(f"  {name}: norm-wise relative difference {err:.3e}, largest |difference| "
              f"{peak:.1e} of the largest |gradient|")
        assert err <= tolerance(1), (name, err)


def test_fsdp2_fp8_each_layer_gets_its_own_quantization(one_rank_gloo_mesh):
    """FSDP2 with fp32 parameters and precision="fp8", 8 layers: FSDP frees each layer's
    unsharded weights after use and all-gathers the next layer's, often into the memory
    the previous one had (untyped_storage().resize_, no version bump). The FP8 weight cache
    must not take that address for the previous layer's weights: the loss and the experts'
    gradients equal those of the unsharded model bit for bit (FSDP in fp32 changes no
    other numerics here)."""
    args = tiny_args()
    args.n_layers, args.moe_inter_dim = 8, 64
    model = tiny_model(args, dtype=torch.float32)
    mtt.apply(model, precision="fp8")
    tokens, labels = step_inputs(args)
    sharded = copy.deepcopy(model)
    apply_fsdp(sharded, one_rank_gloo_mesh, param_dtype=torch.float32,
               reduce_dtype=torch.float32, pp_enabled=False)
    loss_u, grads_u = train_step(model, tokens, labels, autocast=False)
    loss_f, grads_f = train_step(sharded, tokens, labels, autocast=False)
    assert torch.equal(loss_f, loss_u), (loss_f.item(), loss_u.item())
    experts = [n for n in grads_u if ".moe.experts." in n]
    assert len(experts) == 3 * args.n_layers
    differ = [n for n in experts if not torch.equal(grads_f[n], grads_u[n])]
    assert not differ, f"FP8 experts' gradients differ under FSDP: {differ}"
