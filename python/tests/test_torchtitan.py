"""moefuse.torchtitan on CPU: TorchTitan's Qwen3 MoE model (its debugmodel_moe
configuration, shrunk) with its routed experts swapped for moefuse, against the same
model run by TorchTitan itself.

How close is close enough. Both models compute in bf16 and neither is the truth, so each
is compared with an fp64 copy of the model whose routers are pinned to the selection the
bf16 models made (a near tie resolved the other way would be a different function, not an
error). The rule is FlashAttention's, as in test_modules.py: moefuse's norm-wise relative
error against fp64 at most twice TorchTitan's plus 1e-5, for the output and for the
gradient of every parameter; and, for the MoE layer alone, moefuse within the bf16
tolerance of moe_reference.py. The routers are TorchTitan's code in both models, so with
equal inputs the selections are equal bit for bit; the test asserts it.

Activation checkpointing (TorchTitan's apply_ac, full and selective) and FSDP2
(TorchTitan's apply_fsdp on one gloo rank, with and without AC) are compared with the
swapped model without them: bit for bit (FSDP: against the model in bf16, which is what
FSDP computes with; one router gradient that FSDP changes in TorchTitan's own model too is
checked to change in both, by less than one bf16 rounding).

CPU notes: TorchTitan 0.2.2's router counts tokens with torch.histc on int64 ids, which
PyTorch implements on CUDA only; the fixture below routes integer histc through float on
CPU (exact for these counts) in both models. TorchTitan's grouped-mm experts need Triton
(generate_permute_indices), so the native model runs TorchTitan's for-loop experts
(use_grouped_mm=False): the same math in the same bf16 precision.
"""

from __future__ import annotations

import copy
import socket

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

torchtitan = pytest.importorskip(
    "torchtitan", reason="TorchTitan is not installed (tools/install_deps.sh installs it)")

from torchtitan.config.job_config import ActivationCheckpoint  # noqa: E402
from torchtitan.distributed import activation_checkpoint  # noqa: E402
from torchtitan.models.llama4.infra.parallelize import apply_fsdp, apply_moe_ep_tp  # noqa: E402
from torchtitan.models.moe import MoE, MoEArgs  # noqa: E402
from torchtitan.models.qwen3 import Qwen3Model, qwen3_args  # noqa: E402
from torchtitan.models.qwen3.infra.parallelize import _op_sac_save_list  # noqa: E402
from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter  # noqa: E402

import moefuse.torchtitan as mtt  # noqa: E402
from moefuse import _lib, distributed  # noqa: E402

from moe_reference import assert_close_bf16, random_problem, rel_error, tolerance  # noqa: E402

pytestmark = pytest.mark.usefixtures("library")

BS, SLEN = 2, 32


@pytest.fixture(autouse=True)
def cpu_histc(monkeypatch):
    """torch.histc of integer tensors on CPU, through float (TorchTitan's router)."""
    histc = torch.histc

    def histc_int_on_cpu(input, *args, **kwargs):
        if input.device.type == "cpu" and not input.is_floating_point():
            return histc(input.float(), *args, **kwargs).to(input.dtype)
        return histc(input, *args, **kwargs)

    monkeypatch.setattr(torch, "histc", histc_int_on_cpu)


def tiny_args(**moe_overrides):
    """debugmodel_moe (softmax, route_norm, top-8 of 64, no shared experts, scores after
    the experts) shrunk: D=64, F=32, E=16, K=4, two layers."""
    args = copy.deepcopy(qwen3_args["debugmodel_moe"])
    args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.head_dim = 64, 2, 4, 2, 16
    args.vocab_size, args.max_seq_len, args.hidden_dim, args.moe_inter_dim = 256, SLEN, 128, 32
    args.moe_args.num_experts, args.moe_args.top_k = 16, 4
    args.moe_args.use_grouped_mm = False
    for k, v in moe_overrides.items():
        setattr(args.moe_args, k, v)
    return args


def tiny_model(args, seed=0, dtype=torch.bfloat16) -> Qwen3Model:
    torch.manual_seed(seed)
    model = Qwen3Model(args)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
        for m in model.modules():  # a load-balancing state that matters for the routing
            if isinstance(m, MoE) and m.expert_bias is not None:
                m.expert_bias.copy_(0.01 * torch.randn(m.expert_bias.shape))
    return model.to(dtype)


# ---- the fp64 reference with its routing pinned ------------------------------------------


def record_selection(model) -> dict:
    """Forward hooks that keep each router's ids, by router module name."""
    seen = {}
    for name, m in model.named_modules():
        if name.endswith("router"):
            m.register_forward_hook(
                lambda mod, inp, out, name=name: seen.__setitem__(name, out[1].clone()))
    return seen


def pin_selection(model, selection: dict) -> None:
    """Makes each router of an fp64 model return the scores of the given selection,
    computed as TorchTitan's router computes them (in the router's fp32, then widened)."""
    def hook(router, inputs, out, name):
        x = inputs[0]
        logits = router.gate(x).double()
        scores = (torch.sigmoid(logits) if router.score_func == "sigmoid"
                  else torch.softmax(logits, dim=-1))
        ids = selection[name]
        top = scores.gather(1, ids)
        if router.route_norm:
            top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
        return top * router.route_scale, ids, out[2]

    for name, m in model.named_modules():
        if name.endswith("router"):
            m.register_forward_hook(lambda mod, inp, out, name=name: hook(mod, inp, out, name))


def pinned_fp64_reference_moe_forward(self, x):
    """TorchTitan's MoE.forward in fp64 (its own forward casts the expert outputs to fp32)."""
    bs, slen, dim = x.shape
    x = x.view(-1, dim)
    top_scores, ids, _ = self.router(x, self.expert_bias)
    e = self.experts
    out = torch.zeros_like(x)
    for k in range(ids.shape[1]):
        w1, w3, w2 = e.w1[ids[:, k]], e.w3[ids[:, k]], e.w2[ids[:, k]]
        h = F.silu(torch.einsum("tfd,td->tf", w1, x)) * torch.einsum("tfd,td->tf", w3, x)
        out = out + top_scores[:, k:k + 1] * torch.einsum("tdf,tf->td", w2, h)
    if self.shared_experts is not None:
        out = out + self.shared_experts(x)
    return out.reshape(bs, slen, dim)


class Fp64MoE(MoE):
    forward = pinned_fp64_reference_moe_forward


def run(model, tokens, dy, autocast=False):
    """(output, {param name: grad}) of one forward + backward."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(tokens)
    out.backward(dy)
    return out.detach(), {n: p.grad for n, p in model.named_parameters()}


def compare_three(native, swapped, reference, tokens, dy, autocast=False):
    """Errors against fp64, {what: (moefuse, torchtitan)}, after asserting equal routing."""
    sel_native, sel_swapped = record_selection(native), record_selection(swapped)
    out_n, grads_n = run(native, tokens, dy, autocast)
    out_s, grads_s = run(swapped, tokens, dy, autocast)
    assert sel_native.keys() == sel_swapped.keys() and sel_native
    for name in sel_native:
        assert torch.equal(sel_native[name], sel_swapped[name]), f"{name}: selections differ"
    pin_selection(reference, sel_native)
    out_r, grads_r = run(reference, tokens, dy.double())
    errors = {"output": (rel_error(out_s, out_r), rel_error(out_n, out_r))}
    for name, g_ref in grads_r.items():
        assert grads_s[name] is not None and grads_n[name] is not None, name
        errors[name] = (rel_error(grads_s[name], g_ref), rel_error(grads_n[name], g_ref))
    return errors


def assert_flash_rule(errors):
    print("relative errors against fp64 (moefuse, torchtitan):")
    for k, (a, b) in errors.items():
        print(f"  {k:40s} {a:.3e} {b:.3e}")
    bad = {k: v for k, v in errors.items() if not v[0] <= 2 * v[1] + 1e-5}
    assert not bad, "moefuse error > 2x TorchTitan's + 1e-5 (moefuse, torchtitan): " + ", ".join(
        f"{k}: {a:.3e} vs {b:.3e}" for k, (a, b) in bad.items())


def swapped_and_reference(native):
    swapped = copy.deepcopy(native)
    names = mtt.apply(swapped)
    assert names == [n for n, m in native.named_modules() if isinstance(m, MoE)] and names
    reference = copy.deepcopy(native).double()
    for m in reference.modules():
        if isinstance(m, MoE):
            m.__class__ = Fp64MoE
    return swapped, reference


# ---- the model --------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["bf16", "fp32_autocast"])
@pytest.mark.parametrize("moe_overrides", [
    {},  # debugmodel_moe's routing
    # the other knobs of TorchTitan's MoE: sigmoid scores, no renormalization, a scale,
    # one shared expert.
    {"score_func": "sigmoid", "route_norm": False, "route_scale": 2.5, "num_shared_experts": 1},
], ids=["qwen3", "sigmoid_scaled_shared"])
def test_model_matches_torchtitan(moe_overrides, precision):
    """bf16: a bf16 model (as FSDP's bf16 parameters give it). fp32_autocast: fp32
    parameters under autocast to bf16, as TorchTitan trains on one GPU."""
    args = tiny_args(**moe_overrides)
    autocast = precision == "fp32_autocast"
    native = tiny_model(args, dtype=torch.float32 if autocast else torch.bfloat16)
    swapped, reference = swapped_and_reference(native)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab_size, (BS, SLEN), generator=g)
    dy = torch.randn(BS, SLEN, args.vocab_size, generator=g).bfloat16()
    errors = compare_three(native, swapped, reference, tokens, dy, autocast)
    expected = {"output"} | {n for n, _ in native.named_parameters()}
    assert set(errors) == expected
    assert any(".moe.experts.w1" in n for n in errors)
    assert_flash_rule(errors)
    # The load-balancing counts TorchTitan's hook reads are the same.
    for (name, a), (_, b) in zip(native.named_buffers(), swapped.named_buffers()):
        assert torch.equal(a, b), name


def test_moe_layer_within_bf16_tolerance():
    """One MoE layer with bf16 tokens: moefuse's output and the gradients of x, the router,
    the routed and shared experts against fp64, within moe_reference's tolerance (plus one
    rounding for the router's bf16 logits where the path crosses it)."""
    torch.manual_seed(3)
    args = MoEArgs(num_experts=16, num_shared_experts=1, score_func="softmax", route_norm=True,
                   top_k=4, score_before_experts=False, use_grouped_mm=False)
    native = MoE(args, dim=64, hidden_dim=32)
    with torch.no_grad():
        native.init_weights(0.02, torch.device("cpu"))
        native.expert_bias.copy_(0.01 * torch.randn(16))
    native = native.bfloat16()
    swapped, reference = swapped_and_reference(native)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(BS, SLEN, 64, generator=g).bfloat16()
    dy = torch.randn(BS, SLEN, 64, generator=g).bfloat16()

    grads = {}
    selection = record_selection(native)  # filled by the first forward, pinned in the third
    for what, m, xin, d in (("native", native, x, dy), ("moefuse", swapped, x, dy),
                            ("fp64", reference, x.double(), dy.double())):
        if what == "fp64":
            pin_selection(m, selection)
        xin = xin.clone().requires_grad_()
        out = m(xin)
        out.backward(d)
        grads[what] = {"y": out.detach(), "dx": xin.grad,
                       **{n: p.grad for n, p in m.named_parameters()}}
    ref = grads["fp64"]
    errors = {k: (rel_error(grads["moefuse"][k], ref[k]), rel_error(grads["native"][k], ref[k]))
              for k in ref}
    assert_flash_rule(errors)
    # n bf16 roundings per output as moe_reference.py counts them; dx adds the router's
    # bf16 logits (+1) and the shared experts' FeedForward (+2: its h and its dx), the
    # router's weight gradient the bf16 logits' gradient (+1) to dp's n = 3.
    assert_close_bf16(grads["moefuse"]["y"], ref["y"], "y")
    assert_close_bf16(grads["moefuse"]["experts.w1"], ref["experts.w1"], "dw13")
    assert_close_bf16(grads["moefuse"]["experts.w3"], ref["experts.w3"], "dw13")
    assert_close_bf16(grads["moefuse"]["experts.w2"], ref["experts.w2"], "dw2")
    assert errors["dx"][0] <= tolerance(4 + 1 + 2), errors["dx"]
    assert errors["router.gate.weight"][0] <= tolerance(3 + 1), errors["router.gate.weight"]
    for n in ("shared_experts.w1.weight", "shared_experts.w2.weight", "shared_experts.w3.weight"):
        assert errors[n][0] <= tolerance(3), (n, errors[n])


def test_moe_compiles_fullgraph():
    """The swapped MoE traces into one graph (moefuse's op is a custom op with a fake)."""
    torch.manual_seed(5)
    moe = MoE(MoEArgs(num_experts=16, num_shared_experts=1, score_func="softmax",
                      route_norm=True, top_k=4, score_before_experts=False,
                      use_grouped_mm=False), dim=64, hidden_dim=32)
    with torch.no_grad():
        moe.init_weights(0.02, torch.device("cpu"))
    moe = moe.bfloat16()
    mtt.apply(moe)
    x = torch.randn(BS, SLEN, 64).bfloat16()
    eager = moe(x)
    compiled = torch.compile(moe, fullgraph=True, backend="aot_eager")
    xg = x.clone().requires_grad_()
    out = compiled(xg)
    out.sum().backward()
    assert torch.equal(out, eager)
    assert xg.grad is not None and moe.experts.w1.grad is not None


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def one_rank_gloo_mesh():
    """A one-rank gloo process group (127.0.0.1, a free port) and TorchTitan's 1-d
    'fsdp' mesh on the CPU; destroyed after the module's tests."""
    from torch.distributed.device_mesh import init_device_mesh
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not built into this PyTorch")
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
    finally:
        dist.destroy_process_group()


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


# ---- checkpoints ------------------------------------------------------------------------------


def test_state_dict_round_trip_both_ways():
    args = tiny_args(num_shared_experts=1)
    native = tiny_model(args)
    swapped = copy.deepcopy(native)
    mtt.apply(swapped)
    sd_native, sd_swapped = native.state_dict(), swapped.state_dict()
    assert list(sd_native) == list(sd_swapped)
    assert list(dict(native.named_buffers())) == list(dict(swapped.named_buffers()))

    # native -> swapped
    other = tiny_model(args, seed=7)
    mtt.apply(other)
    missing, unexpected = other.load_state_dict(sd_native, strict=True)
    assert not missing and not unexpected
    for k, v in other.state_dict().items():
        assert torch.equal(v, sd_native[k]), k
    # swapped -> native
    fresh = tiny_model(args, seed=8)
    fresh.load_state_dict(other.state_dict(), strict=True)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, sd_native[k]), k

    # TorchTitan's HF adapter sees the same tensors under the same names.
    adapter = Qwen3StateDictAdapter(args, None)
    hf_native, hf_swapped = adapter.to_hf(sd_native), adapter.to_hf(other.state_dict())
    assert list(hf_native) == list(hf_swapped)
    assert all(torch.equal(hf_native[k], hf_swapped[k]) for k in hf_native)
    back = adapter.from_hf(hf_swapped)
    fresh.load_state_dict(back, strict=False)
    for k in back:
        assert torch.equal(fresh.state_dict()[k], sd_native[k]), k


def test_restore_and_refusals():
    args = tiny_args()
    model = tiny_model(args)
    names = mtt.apply(model)
    assert all(type(model.get_submodule(n)) is mtt.MoefuseMoE for n in names)
    assert mtt.apply(model) == names  # idempotent
    assert mtt.restore(model) == names
    assert all(type(model.get_submodule(n)) is MoE for n in names)

    scaled_before = tiny_model(tiny_args(score_before_experts=True))
    with pytest.raises(ValueError, match="score_before_experts=True"):
        mtt.apply(scaled_before)
    assert not any(isinstance(m, mtt.MoefuseMoE) for m in scaled_before.modules())


# ---- expert parallelism ------------------------------------------------------------------------
#
# CPU: TorchTitan's EP layout made by shard_experts on a one-rank mesh, apply() with a plan
# over a stand-in comm (state_dict unchanged, nothing created on the CPU), what apply()
# refuses, and the path to the library and back on a one-rank CPU layer.
# GPU (SKIPS without CUDA): two virtual ranks of moefuse's comm in this process, each with
# its own copy of a MoE holding its half of the experts (what shard_experts' to_local()
# gives each rank), against the same MoE on one rank running the concatenated tokens.

EP_D, EP_F, EP_E, EP_K = 256, 128, 16, 4  # the CUDA backend takes D, F multiples of 128


def stand_in_comm(num_ranks: int) -> _lib.Comm:
    """A Comm of num_ranks ranks over a NULL handle, as test_distributed.py makes them: the
    CPU tests never hand it to the library (a virtual comm needs a GPU)."""
    return _lib.Comm(_lib.CommHandle(), num_ranks)


def ep_moe(num_shared_experts=0, device="cpu") -> MoE:
    torch.manual_seed(9)
    moe = MoE(MoEArgs(num_experts=EP_E, num_shared_experts=num_shared_experts,
                      score_func="softmax", route_norm=True, top_k=EP_K,
                      score_before_experts=False, use_grouped_mm=False),
              dim=EP_D, hidden_dim=EP_F)
    with torch.no_grad():
        moe.init_weights(0.02, torch.device(device))
        moe.expert_bias.copy_(0.01 * torch.randn(EP_E))
    return moe.to(device=device, dtype=torch.bfloat16)


def rank_copy(moe: MoE, rank: int, num_ranks: int) -> MoE:
    """A copy of `moe` whose experts hold rank's E/R experts as plain parameters."""
    m = copy.deepcopy(moe)
    n = m.experts.num_experts // num_ranks
    for name in ("w1", "w2", "w3"):
        w = getattr(m.experts, name).detach()
        m.experts.register_parameter(name, nn.Parameter(w[rank * n:(rank + 1) * n].clone()))
    return m


def test_expert_parallel_on_a_one_rank_ep_mesh(one_rank_gloo_mesh):
    """shard_experts makes TorchTitan's EP layout (w1, w2, w3 DTensors Shard(0) on the EP
    mesh: the global [E, F, D] in state_dict, each rank's E/R experts locally); apply with
    a plan swaps the experts' class and keeps state_dict; the forward needs CUDA; restore
    gives TorchTitan's classes back and closes the layers."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    moe = ep_moe()
    before = {k: v.clone() for k, v in moe.state_dict().items()}
    assert mtt.shard_experts(moe, mesh) == [""]
    for name in ("w1", "w2", "w3"):
        w = getattr(moe.experts, name)
        assert isinstance(w, DTensor) and tuple(w.placements) == (Shard(0),)
        assert torch.equal(w.full_tensor(), before[f"experts.{name}"])
    comm = stand_in_comm(1)
    plan = mtt.ExpertParallelPlan(comms=[comm], rank=0, num_ranks=1, max_tokens=64)
    assert mtt.apply(moe, expert_parallel=plan) == [""]
    assert type(moe).__name__ == "MoefuseMoE" and type(moe.experts).__name__ == "MoefuseExperts"
    after = moe.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(v.full_tensor() if isinstance(v, DTensor) else v, before[k])
               for k, v in after.items())
    assert comm.layers == {}  # no plan.device: nothing made before the first forward
    with pytest.raises(ValueError, match="expert parallelism runs on CUDA tensors"):
        moe(torch.randn(1, 4, EP_D).bfloat16())
    assert mtt.restore(moe) == [""]
    assert type(moe) is MoE and type(moe.experts).__name__ == "GroupedExperts"
    assert "moefuse_ep" not in moe.experts.__dict__
    comm.close()


def test_expert_parallel_refusals(one_rank_gloo_mesh):
    from torch.distributed.device_mesh import init_device_mesh

    def plan(comms=1, rank=0, num_ranks=1):
        return mtt.ExpertParallelPlan(comms=[stand_in_comm(num_ranks)
                                             for _ in range(comms)],
                                      rank=rank, num_ranks=num_ranks, max_tokens=64)

    # TorchTitan's ExpertParallel (all-to-all hooks on the experts) is not moefuse's.
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    moe = ep_moe()
    block = nn.Module()
    block.moe, block.moe_enabled = moe, True
    holder = nn.Module()
    holder.layers = nn.ModuleDict({"0": block})
    apply_moe_ep_tp(holder, tp_mesh=None, ep_mesh=mesh, etp_mesh=None, ep_etp_mesh=None)
    with pytest.raises(ValueError, match="went through parallelize_module"):
        mtt.apply(holder, expert_parallel=plan())
    assert type(moe) is MoE

    cases = [
        (ep_moe(), plan(comms=2), "2 comms for 1 MoE layers"),
        (ep_moe(), plan(rank=1, num_ranks=2), "holds 16 experts on this rank, expected E/R = 16/2"),
        (rank_copy(ep_moe(), 0, 4), plan(num_ranks=2), "holds 4 experts on this rank"),
    ]
    small = MoE(MoEArgs(num_experts=EP_E, top_k=EP_K, score_before_experts=False,
                        use_grouped_mm=False), dim=64, hidden_dim=EP_F)
    cases.append((small, plan(), "hidden=64: the CUDA backend needs a multiple of 128"))
    for model, p, message in cases:
        with pytest.raises(ValueError, match=message):
            mtt.apply(model, expert_parallel=p)
        assert type(model) is MoE and type(model.experts).__name__ == "GroupedExperts"
        for comm in p.comms:
            assert comm.layers == {}
            comm.close()


@pytest.mark.parametrize("fsdp", [False, True], ids=["ep", "ep_fsdp"])
def test_expert_parallel_path_on_a_cpu_layer(one_rank_gloo_mesh, monkeypatch, fsdp):
    """The expert-parallel path from TorchTitan's DTensor weights (shard_experts, one rank)
    to the library and back, on the CPU: ExpertParallelExperts' layer is a one-rank CPU
    layer here and its check that x is on CUDA is skipped (the CUDA-only parts, run by the
    GPU tests below). Output and gradients equal the swapped MoE without EP bit for bit;
    the experts' gradients arrive as DTensors sharded as their weights.

    ep_fsdp: FSDP2 as TorchTitan's apply_fsdp wraps an MoE under EP, the experts a unit of
    their own on the 'efsdp' mesh (bf16 parameters, fp32 reduction): its hooks run around
    the experts' __call__, which hands moefuse the DTensors on the 'ep' mesh; the routing
    weights reach moefuse in fp32 although FSDP casts the unit's floating inputs to bf16
    (passed as _Fp32: cast, they changed y by a norm-wise 3e-3)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    layers = []

    def cpu_layer(self, device):
        if self._layer is None:
            cfg = _lib.config_init(self.hidden_size, self.intermediate_size, self.num_experts,
                                   self.top_k, self.max_tokens)
            cfg.saved_mode = self.saved_mode
            self._layer = _lib.Layer(cfg)
            self._layer.device = torch.device("cpu")
            layers.append(self._layer)
        return self._layer
    monkeypatch.setattr(distributed.ExpertParallelExperts, "_layer_on", cpu_layer)
    monkeypatch.setattr(distributed.ExpertParallelExperts, "_validate",
                        lambda self, x, ids, p: ids.to(torch.int32))
    seen = []
    ep_local = mtt._ep_local

    def spy(w, what, ep):
        seen.append((what, type(w).__name__, getattr(w, "placements", None)))
        return ep_local(w, what, ep)
    monkeypatch.setattr(mtt, "_ep_local", spy)

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("efsdp", "ep"))
    one_rank = ep_moe()
    ep = copy.deepcopy(one_rank)
    mtt.apply(one_rank)
    mtt.shard_experts(ep, mesh["ep"])
    comm = stand_in_comm(1)
    plan = mtt.ExpertParallelPlan([comm], rank=0, num_ranks=1, max_tokens=BS * SLEN)
    mtt.apply(ep, expert_parallel=plan)
    if fsdp:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fully_shard(ep.experts, mesh=mesh["efsdp"], mp_policy=mp)
        fully_shard(ep, mesh=mesh["efsdp"], mp_policy=mp)
        assert ep.experts.w1.device_mesh.mesh_dim_names == ("efsdp", "ep")
    seen.clear()
    g = torch.Generator().manual_seed(12)
    x = torch.randn(BS, SLEN, EP_D, generator=g).bfloat16()
    dy = torch.randn(BS, SLEN, EP_D, generator=g).bfloat16()
    results = []
    for m in (one_rank, ep):
        xi = x.clone().requires_grad_()
        y = m(xi)
        y.backward(dy)
        results.append({"y": y.detach(), "dx": xi.grad,
                        **{n: p.grad for n, p in m.named_parameters()}})
    assert len(layers) == 1  # the EP path ran the library through ExpertParallelExperts
    # inside the forward moefuse sees each weight on the 'ep' mesh, sharded on the experts
    assert [(t, p) for _, t, p in seen] == [("DTensor", (Shard(0),))] * 3, seen
    want, got = results
    assert got.keys() == want.keys()
    for name in want:
        g_ = got[name]
        if isinstance(g_, DTensor):
            assert name.startswith("experts.") or fsdp, name
            g_ = g_.full_tensor()
        _equal_bits(name, g_, want[name])
    assert torch.equal(ep.tokens_per_expert, one_rank.tokens_per_expert)
    if fsdp:
        other = ep_moe()
        mtt.shard_experts(other, mesh["ep"])
        fully_shard(other.experts, mesh=mesh["efsdp"])
        with pytest.raises(ValueError, match="after shard_experts and before fully_shard"):
            mtt.apply(other, expert_parallel=mtt.ExpertParallelPlan(
                [stand_in_comm(1)], rank=0, num_ranks=1, max_tokens=BS * SLEN))
    mtt.restore(ep)
    assert all(layer.closed for layer in layers)
    comm.close()


def _cuda_skip_reason():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        return "no CUDA device (torch.cuda.is_available() is False or no device visible)"
    return None


def _virtual_rank_moes(moe, num_ranks, max_tokens, comm):
    """Each rank's copy of `moe` with its experts, swapped with a plan over `comm` and its
    layer made on CUDA now (virtual ranks make every layer before the first forward)."""
    moes = []
    for r in range(num_ranks):
        m = rank_copy(moe, r, num_ranks)
        mtt.apply(m, expert_parallel=mtt.ExpertParallelPlan(
            comms=[comm], rank=r, num_ranks=num_ranks, max_tokens=max_tokens, device="cuda"))
        moes.append(m)
    return moes


def _warm_streams(streams):
    """Fills the caching allocator on each rank's stream first: a cudaMalloc between two
    ranks' launches could serialize them (they wait on each other), as in
    test_distributed.py."""
    for s in streams:
        with torch.cuda.stream(s):
            warm = [torch.empty(256 << 20, dtype=torch.uint8, device="cuda")]
            warm += [torch.empty(1 << 20, dtype=torch.uint8, device="cuda") for _ in range(8)]
            del warm
    torch.cuda.synchronize()


def _run_ranks(moes, streams, forwards, dys):
    """Launches every rank's forward on its stream before any is waited for (each waits
    for the others' rows), then the backwards of all, then each rank's check(); returns
    the outputs."""
    ys = []
    for stream, forward in zip(streams, forwards):
        with torch.cuda.stream(stream):
            ys.append(forward())
    torch.autograd.backward(ys, dys)
    for stream, m in zip(streams, moes):
        with torch.cuda.stream(stream):
            m.experts.moefuse_ep.check()
    torch.cuda.synchronize()
    return ys


def _equal_bits(name, got, want):
    assert (got.dtype, got.shape) == (want.dtype, want.shape), (name, got.dtype, want.dtype)
    if not torch.equal(got, want):
        diff = (got.double() - want.double()).abs().max().item()
        raise AssertionError(f"{name} is not bitwise equal to one rank's: max |diff| {diff:.3e}")


def test_expert_parallel_virtual_ranks_routed_experts_bitwise():
    """Two virtual ranks, each calling its MoefuseExperts with its own tokens (uneven T),
    against routed_experts on one rank with the concatenated tokens and all experts: y,
    dx, d top_scores per rank and each rank's slices of dw1, dw3, dw2, bit for bit (the
    library's receive order is the one-rank order of the concatenated batch)."""
    reason = _cuda_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    R, tokens = 2, (70, 45)
    x, ids, p, w13, w2, dy = random_problem(sum(tokens), EP_D, EP_F, EP_E, EP_K, seed=21,
                                            drop_fraction=0.1)
    moe = ep_moe(device="cuda")
    with torch.no_grad():
        moe.experts.w1.copy_(w13[:, :EP_F])
        moe.experts.w3.copy_(w13[:, EP_F:])
        moe.experts.w2.copy_(w2)
    # one rank
    xr, pr = x.cuda().requires_grad_(), p.cuda().requires_grad_()
    ref_w = [getattr(moe.experts, n).detach().clone().requires_grad_() for n in ("w1", "w3", "w2")]
    y_ref = mtt.routed_experts(xr, pr, ids.cuda().long(), *ref_w)
    y_ref.backward(dy.cuda())
    # two virtual ranks
    comm = distributed.virtual_comm(R, timeout_ms=20000)
    try:
        moes = _virtual_rank_moes(moe, R, max(tokens), comm)
        streams = [torch.cuda.Stream() for _ in range(R)]
        _warm_streams(streams)
        starts = [0, tokens[0]]
        inputs = [(x[s:s + t].cuda().requires_grad_(), p[s:s + t].cuda().requires_grad_(),
                   ids[s:s + t].cuda().long(), dy[s:s + t].cuda())
                  for s, t in zip(starts, tokens)]
        torch.cuda.synchronize()
        ys = _run_ranks(moes, streams,
                        [lambda m=m, i=i: m.experts(i[0], i[1], i[2])
                         for m, i in zip(moes, inputs)],
                        [i[3] for i in inputs])
        n = EP_E // R
        for r, m in enumerate(moes):
            s, t = starts[r], tokens[r]
            xi, pi, _, _ = inputs[r]
            _equal_bits(f"rank {r} y", ys[r].detach(), y_ref.detach()[s:s + t])
            _equal_bits(f"rank {r} dx", xi.grad, xr.grad[s:s + t])
            _equal_bits(f"rank {r} d top_scores", pi.grad, pr.grad[s:s + t])
            for name, w in zip(("w1", "w3", "w2"), ref_w):
                _equal_bits(f"rank {r} d{name}", getattr(m.experts, name).grad,
                            w.grad[r * n:(r + 1) * n])
    finally:
        comm.close()


@pytest.mark.xfail(strict=True, reason=(
    "on an H200 (2026-12-04) rank 0's backward timed out waiting for its receive block 4 "
    "('backward: dy and x rows', 247 rows counted in, expected 256): the whole MoE on two "
    "virtual ranks does not complete its backward yet, while the routed experts alone do "
    "(test above); not yet understood"))
def test_expert_parallel_virtual_ranks_moe_layer():
    """Two virtual ranks running TorchTitan's whole MoE (router, load-balancing counts)
    swapped with a plan, each on its own tokens, against the swapped MoE on one rank whose
    router is pinned to the ranks' selections and scores (a GEMM over another number of
    rows may round the router's logits differently on a GPU): the output per rank and each
    rank's slices of the routed experts' gradients bit for bit; the ranks' load-balancing
    counts add up to the counts of the selections. No shared expert: its GEMMs over
    another number of rows need not give the same bits either."""
    reason = _cuda_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    R, tokens = 2, (64, 48)
    moe = ep_moe(device="cuda")
    g = torch.Generator().manual_seed(23)
    x = torch.randn(sum(tokens), EP_D, generator=g).bfloat16().cuda()
    dy = torch.randn(sum(tokens), EP_D, generator=g).bfloat16().cuda()
    starts = [0, tokens[0]]
    comm = distributed.virtual_comm(R, timeout_ms=20000)
    try:
        moes = _virtual_rank_moes(moe, R, max(tokens), comm)
        routed = [{} for _ in range(R)]
        for r, m in enumerate(moes):
            m.router.register_forward_hook(
                lambda mod, inp, out, r=r: routed[r].update(scores=out[0].detach(), ids=out[1]))
        streams = [torch.cuda.Stream() for _ in range(R)]
        _warm_streams(streams)
        ys = _run_ranks(moes, streams,
                        [lambda m=m, s=s, t=t: m(x[s:s + t].unsqueeze(0))
                         for m, s, t in zip(moes, starts, tokens)],
                        [dy[s:s + t].unsqueeze(0) for s, t in zip(starts, tokens)])
    finally:
        comm.close()

    ref = copy.deepcopy(moe)
    mtt.apply(ref)
    scores = torch.cat([routed[r]["scores"] for r in range(R)])
    ids = torch.cat([routed[r]["ids"] for r in range(R)])
    ref.router.register_forward_hook(lambda mod, inp, out: (scores, ids, out[2]))
    y_ref = ref(x.unsqueeze(0))
    y_ref.backward(dy.unsqueeze(0))
    n = EP_E // R
    for r, m in enumerate(moes):
        s, t = starts[r], tokens[r]
        _equal_bits(f"rank {r} output", ys[r].detach()[0], y_ref.detach()[0, s:s + t])
        for name in ("w1", "w2", "w3"):
            _equal_bits(f"rank {r} experts.{name} grad", getattr(m.experts, name).grad,
                        getattr(ref.experts, name).grad[r * n:(r + 1) * n])
    counts = sum(m.tokens_per_expert for m in moes)
    assert torch.equal(counts, torch.bincount(ids.flatten(), minlength=EP_E).to(counts.dtype))
