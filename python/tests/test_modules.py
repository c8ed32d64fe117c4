"""MoEExperts and MoefuseQwen3MoeBlock on CPU tensors: against a straightforward fp64
PyTorch Qwen3-MoE block, and against transformers' own Qwen3MoeSparseMoeBlock when
transformers is installed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moefuse

from moe_reference import (assert_close_bf16, experts_reference, random_problem, rel_error,
                           tolerance)

H, I, E, K = 128, 64, 16, 4


pytestmark = pytest.mark.usefixtures("library")


def qwen3_block_reference(x, gate_weight, w13, w2, top_k, norm_topk_prob=True, ids=None):
    """The Qwen3 MoE block written out plainly. Router logits in the gate's dtype (as
    nn.Linear computes them), softmax over E in fp32, top-K, renormalized; experts in
    fp64. ids may be given to pin the selection (ties among bf16 logits). Returns
    (y fp64 [T, H], router_logits, ids)."""
    logits = F.linear(x, gate_weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    if ids is None:
        ids = torch.topk(probs, top_k, dim=-1).indices
    p = probs.double().gather(1, ids.long())
    if norm_topk_prob:
        p = p / p.sum(dim=-1, keepdim=True)
    y = experts_reference(x.double(), ids.long(), p, w13.double(), w2.double())
    return y, logits, ids


def make_block(router="torch", seed=0, **kwargs):
    torch.manual_seed(seed)
    block = moefuse.MoefuseQwen3MoeBlock(H, I, E, K, router=router, **kwargs)
    with torch.no_grad():  # routing that is not nearly uniform, so top-K is well separated
        block.gate.weight.normal_(0, 1.0 / H ** 0.5 * 4)
    return block


# ---- MoEExperts ------------------------------------------------------------------------


def test_experts_module_matches_reference():
    x, ids, p, w13, w2, dy = random_problem(96, H, I, E, K, seed=20)
    module = moefuse.MoEExperts(E, H, I)
    with torch.no_grad():
        module.gate_up_proj.copy_(w13)
        module.down_proj.copy_(w2)
    assert module.w13 is module.gate_up_proj and module.w2 is module.down_proj
    xl = x.clone().requires_grad_()
    y = module(xl, ids, p)
    y.backward(dy)
    leaves = [t.double().requires_grad_() for t in (x, w13, w2)]
    y_ref = experts_reference(leaves[0], ids.long(), p.double(), leaves[1], leaves[2])
    dx, dw13, dw2 = torch.autograd.grad(y_ref, leaves, dy.double())
    assert_close_bf16(y.detach(), y_ref.detach(), "y")
    assert_close_bf16(xl.grad, dx, "dx")
    assert_close_bf16(module.gate_up_proj.grad, dw13, "dw13")
    assert_close_bf16(module.down_proj.grad, dw2, "dw2")
    assert module.gate_up_proj.grad.dtype == torch.bfloat16


def test_experts_module_fp32_input_returns_fp32():
    x, ids, p, *_ = random_problem(16, H, I, E, K, seed=21)
    module = moefuse.MoEExperts(E, H, I)
    y32 = module(x.float(), ids, p)
    assert y32.dtype == torch.float32
    assert torch.equal(y32, module(x, ids, p).float())


def test_per_expert_state_dict_is_fused_on_load():
    torch.manual_seed(1)
    per_expert = {}
    for e in range(E):
        per_expert[f"{e}.gate_proj.weight"] = torch.randn(I, H).bfloat16()
        per_expert[f"{e}.up_proj.weight"] = torch.randn(I, H).bfloat16()
        per_expert[f"{e}.down_proj.weight"] = torch.randn(H, I).bfloat16()
    module = moefuse.MoEExperts(E, H, I)
    module.load_state_dict(dict(per_expert))
    for e in (0, E - 1):
        assert torch.equal(module.gate_up_proj[e, :I], per_expert[f"{e}.gate_proj.weight"])
        assert torch.equal(module.gate_up_proj[e, I:], per_expert[f"{e}.up_proj.weight"])
        assert torch.equal(module.down_proj[e], per_expert[f"{e}.down_proj.weight"])


# ---- the drop-in block against a plain Qwen3 block ---------------------------------------


@pytest.mark.parametrize("router", ["torch", "moefuse"])
def test_block_matches_plain_qwen3_block(router):
    block = make_block(router)
    g = torch.Generator().manual_seed(22)
    hidden = torch.randn(2, 48, H, generator=g).bfloat16().requires_grad_()
    dy = torch.randn(2, 48, H, generator=g).bfloat16()
    out = block(hidden)
    assert isinstance(out, torch.Tensor) and out.shape == hidden.shape
    out.backward(dy)

    x = hidden.detach().reshape(-1, H)
    _, ids, _ = block.route(x)  # the block's own selection (ties among bf16 logits)
    leaves = [t.detach().double().requires_grad_()
              for t in (x, block.gate.weight, block.experts.w13, block.experts.w2)]
    # fp64 throughout the reference, the selection pinned to the block's.
    logits = leaves[0] @ leaves[1].T
    probs = torch.softmax(logits, dim=-1).gather(1, ids.long())
    p = probs / probs.sum(dim=-1, keepdim=True)
    y_ref = experts_reference(leaves[0], ids.long(), p, leaves[2], leaves[3])
    grads = torch.autograd.grad(y_ref, leaves, dy.reshape(-1, H).double())

    assert_close_bf16(out.detach().reshape(-1, H), y_ref.detach(), "y")
    # The reference's selection is the plain block's (softmax fp32, top-K).
    y_plain, _, ids_plain = qwen3_block_reference(x, block.gate.weight, block.experts.w13,
                                                  block.experts.w2, K)
    assert torch.equal(ids_plain.sort(-1).values, ids.long().sort(-1).values)
    assert_close_bf16(out.detach().reshape(-1, H), y_plain, "y")
    # dx: through the experts ([dg; du], dx roundings) and through the router's
    # logits (computed in bf16 by nn.Linear from fp32 dlogits: one more rounding).
    assert_close_bf16(hidden.grad.reshape(-1, H), grads[0], "dx")
    assert_close_bf16(block.experts.w13.grad, grads[2], "dw13")
    assert_close_bf16(block.experts.w2.grad, grads[3], "dw2")
    # gate: dp (n = 2), then d logits -> bf16 (nn.Linear backward in bf16), dW_gate.
    assert rel_error(block.gate.weight.grad, grads[1]) <= tolerance(4)


def test_block_returns_router_logits_when_asked():
    block = make_block(return_router_logits=True)
    hidden = torch.randn(3, 5, H).bfloat16()
    y, logits = block(hidden)
    assert y.shape == hidden.shape and logits.shape == (15, E)
    assert torch.equal(logits, block.gate(hidden.reshape(-1, H)))


def test_block_torch_compile_fullgraph():
    torch._dynamo.reset()
    block = make_block("moefuse")
    hidden = torch.randn(2, 32, H).bfloat16()
    results = []
    for fn in (block, torch.compile(block, fullgraph=True, backend="aot_eager")):
        block.zero_grad()
        h = hidden.clone().requires_grad_()
        y = fn(h)
        y.float().square().sum().backward()
        results.append((y.detach(), h.grad, block.gate.weight.grad, block.experts.w13.grad))
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)


def test_block_rejects_other_activations():
    class Cfg:
        hidden_size, moe_intermediate_size, num_experts, num_experts_per_tok = H, I, E, K
        hidden_act = "gelu"

    with pytest.raises(ValueError, match="silu"):
        moefuse.MoefuseQwen3MoeBlock.from_config(Cfg())


# ---- transformers' own block ----------------------------------------------------------------


class PerExpertQwen3Block(nn.Module):
    """The per-expert layout and (hidden_states, router_logits) return of transformers
    4.x's Qwen3MoeSparseMoeBlock, written out (the installed transformers may be 5.x)."""

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = nn.Linear(H, I, bias=False, dtype=torch.bfloat16)
            self.up_proj = nn.Linear(H, I, bias=False, dtype=torch.bfloat16)
            self.down_proj = nn.Linear(I, H, bias=False, dtype=torch.bfloat16)
            self.act_fn = nn.SiLU()

    def __init__(self):
        super().__init__()
        self.top_k, self.norm_topk_prob = K, True
        self.gate = nn.Linear(H, E, bias=False, dtype=torch.bfloat16)
        self.experts = nn.ModuleList([self.MLP() for _ in range(E)])


def test_from_transformers_per_expert_layout():
    torch.manual_seed(3)
    source = PerExpertQwen3Block()
    block = moefuse.MoefuseQwen3MoeBlock.from_transformers(source)
    assert block.return_router_logits  # the 4.x contract
    e = 5
    assert torch.equal(block.experts.w13[e, :I], source.experts[e].gate_proj.weight)
    assert torch.equal(block.experts.w13[e, I:], source.experts[e].up_proj.weight)
    assert torch.equal(block.experts.w2[e], source.experts[e].down_proj.weight)
    hidden = torch.randn(1, 40, H).bfloat16()
    y, logits = block(hidden)
    y_ref, logits_ref, _ = qwen3_block_reference(
        hidden.reshape(-1, H), source.gate.weight, block.experts.w13, block.experts.w2, K)
    assert torch.equal(logits, logits_ref)
    assert_close_bf16(y.reshape(-1, H), y_ref, "y")


def tiny_transformers_block():
    transformers = pytest.importorskip(
        "transformers", reason="transformers not installed: `pip install transformers` to "
        "compare against its Qwen3MoeSparseMoeBlock")
    from transformers.models.qwen3_moe import modeling_qwen3_moe as hf

    config = transformers.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I,
                                         num_experts=E, num_experts_per_tok=K,
                                         norm_topk_prob=True, hidden_act="silu")
    torch.manual_seed(4)
    block = hf.Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():  # transformers leaves init to the model; give it weights
        for name, param in block.named_parameters():
            fan_in = param.shape[-1]
            param.normal_(0, (4.0 if name.startswith("gate") else 1.0) / fan_in ** 0.5)
    return block.to(torch.bfloat16), config


def test_matches_transformers_block():
    """Forward and gradients against transformers' block, both against fp64: moefuse's
    error at most 2x that of transformers' bf16 block, plus rounding noise (the
    FlashAttention rule), and within moefuse's own bf16 tolerance."""
    hf_block, config = tiny_transformers_block()
    block = moefuse.MoefuseQwen3MoeBlock.from_transformers(hf_block)
    g = torch.Generator().manual_seed(23)
    hidden = torch.randn(2, 64, H, generator=g).bfloat16()
    dy = torch.randn(2, 64, H, generator=g).bfloat16()

    outputs = {}
    for name, module in (("hf", hf_block), ("moefuse", block)):
        h = hidden.clone().requires_grad_()
        out = module(h)
        if isinstance(out, tuple):
            out = out[0]
        out.backward(dy)
        outputs[name] = (out.detach(), h.grad)
    with torch.no_grad():  # the same return contract (a tensor in transformers 5)
        assert type(block(hidden)) is type(hf_block(hidden))

    x = hidden.reshape(-1, H)
    y_ref, _, ids = qwen3_block_reference(x, hf_block.gate.weight, block.experts.w13,
                                          block.experts.w2, K)
    ours = rel_error(outputs["moefuse"][0].reshape(-1, H), y_ref)
    theirs = rel_error(outputs["hf"][0].reshape(-1, H), y_ref)
    assert ours <= 2 * theirs + 1e-5, f"y: moefuse {ours:.3e} vs transformers {theirs:.3e}"
    assert_close_bf16(outputs["moefuse"][0].reshape(-1, H), y_ref, "y")

    # Expert weight gradients, the selection pinned to the one both blocks made.
    leaves = [t.detach().double().requires_grad_() for t in (x, block.experts.w13, block.experts.w2)]
    probs = torch.softmax(F.linear(x, hf_block.gate.weight), dim=-1, dtype=torch.float32)
    p = probs.double().gather(1, ids)
    p = p / p.sum(dim=-1, keepdim=True)
    y_ref_grad = experts_reference(leaves[0], ids, p, leaves[1], leaves[2])
    _, dw13, dw2 = torch.autograd.grad(y_ref_grad, leaves, dy.reshape(-1, H).double())
    for what, ours_grad, theirs_grad, ref in (
            ("dw13", block.experts.w13.grad, hf_block.experts.gate_up_proj.grad, dw13),
            ("dw2", block.experts.w2.grad, hf_block.experts.down_proj.grad, dw2)):
        ours, theirs = rel_error(ours_grad, ref), rel_error(theirs_grad, ref)
        assert ours <= 2 * theirs + 1e-5, f"{what}: moefuse {ours:.3e} vs transformers {theirs:.3e}"
        assert_close_bf16(ours_grad, ref, what)


def test_state_dict_loads_into_transformers_block():
    hf_block, _ = tiny_transformers_block()
    block = make_block(seed=7)
    missing, unexpected = hf_block.load_state_dict(block.state_dict(), strict=True)
    assert not missing and not unexpected
    hidden = torch.randn(1, 32, H).bfloat16()
    y_ref, _, _ = qwen3_block_reference(hidden.reshape(-1, H), block.gate.weight,
                                        block.experts.w13, block.experts.w2, K)
    with torch.no_grad():
        ours = block(hidden).reshape(-1, H)
        theirs = hf_block(hidden).reshape(-1, H)
    assert rel_error(ours, y_ref) <= 2 * rel_error(theirs, y_ref) + 1e-5


@pytest.mark.parametrize("field", ["num_experts", "hidden_size", "intermediate_size"])
@pytest.mark.parametrize("value, error, message", [
    (0, ValueError, "must be >= 1, got 0"), (-1, ValueError, "must be >= 1, got -1"),
    (2.0, TypeError, "must be an int, got 2.0")])
def test_experts_module_refuses_bad_sizes(field, value, error, message):
    sizes = dict(num_experts=4, hidden_size=64, intermediate_size=32)
    sizes[field] = value
    with pytest.raises(error, match=f"MoEExperts: {field} {message}"):
        moefuse.MoEExperts(**sizes)
