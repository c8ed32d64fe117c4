"""What the tests of moefuse.torchtitan share: TorchTitan's debugmodel_moe shrunk, and the
fp64 copy of a model with its routers pinned to the selection the bf16 models made, with
the comparison of TorchTitan's and moefuse's errors against it (the rule is in
test_torchtitan.py's docstring). Imported by those tests after their importorskip of
torchtitan.

TorchTitan's grouped-mm experts need Triton (generate_permute_indices), so the native
model runs TorchTitan's for-loop experts (use_grouped_mm=False): the same math in the
same bf16 precision.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torchtitan.models.moe import MoE, MoEArgs
from torchtitan.models.qwen3 import Qwen3Model, qwen3_args

import moefuse.torchtitan as mtt

from moe_reference import rel_error

BS, SLEN = 2, 32


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


def tiny_moe(seed: int, dim: int, hidden_dim: int, num_shared_experts: int = 0) -> MoE:
    """A TorchTitan MoE alone (16 experts, top-4, softmax, route_norm, scores after the
    experts, for-loop experts), initialized by its init_weights; fp32."""
    torch.manual_seed(seed)
    moe = MoE(MoEArgs(num_experts=16, num_shared_experts=num_shared_experts,
                      score_func="softmax", route_norm=True, top_k=4,
                      score_before_experts=False, use_grouped_mm=False),
              dim=dim, hidden_dim=hidden_dim)
    with torch.no_grad():
        moe.init_weights(0.02, torch.device("cpu"))
    return moe


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
