"""moefuse.route (the Qwen3 routing helper: top-K of a softmax, renormalized) on CPU tensors
against the fp64 reference in moe_reference.py; its gradient gradchecked in fp32 (the
helper's precision) with a step fp32 resolves; the PyTorch fallback against the library;
the errors."""

from __future__ import annotations

import re

import pytest
import torch

import moefuse
from moefuse import ops

from moe_reference import rel_error, route_reference

pytestmark = pytest.mark.usefixtures("library")


# ---- the routing op --------------------------------------------------------------------------


@pytest.mark.parametrize("T, E, K", [(50, 16, 4), (33, 128, 8), (5, 8, 8), (1, 4, 1)])
def test_route_matches_reference(T, E, K):
    g = torch.Generator().manual_seed(T)
    logits = torch.randn(T, E, generator=g).requires_grad_()
    ids, weights = moefuse.route(logits, K)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    ref_logits = logits.detach().double().requires_grad_()
    ref_ids, ref_weights = route_reference(ref_logits, K)
    assert torch.equal(ids.long(), ref_ids)
    assert rel_error(weights, ref_weights) <= 1e-6
    dweights = torch.randn(T, K, generator=g)
    weights.backward(dweights)
    (ref_grad,) = torch.autograd.grad(ref_weights, ref_logits, dweights.double())
    assert rel_error(logits.grad, ref_grad) <= 1e-5


def test_route_ties_pick_lower_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]])
    ids, weights = moefuse.route(logits, 2)
    assert ids.tolist() == [[1, 2]]
    assert torch.allclose(weights, torch.tensor([[0.5, 0.5]]))


def test_route_gradcheck():
    """gradcheck in fp32 (the helper's precision) with a step fp32 resolves."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 8, generator=g).requires_grad_()
    with pytest.warns(UserWarning):  # gradcheck warns that the input is not fp64
        assert torch.autograd.gradcheck(lambda l: moefuse.route(l, 3)[1], (logits,),
                                        eps=1e-3, atol=1e-3, rtol=1e-2)


def test_route_torch_fallback_matches_library():
    """The PyTorch routing used where the C helper is not built (CUDA, for now)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(40, 32, generator=g)
    logits[3, 5] = logits[3, 7] = logits[3].max() + 1  # a tie
    ids, weights = moefuse.route(logits, 4)
    ids_t, weights_t = ops._route_torch(logits, 4)
    assert torch.equal(ids, ids_t)
    assert rel_error(weights_t, weights) <= 1e-6
    dweights = torch.randn(40, 4, generator=g)
    d_lib = torch.ops.moefuse.route_bwd(logits, ids, weights, dweights)
    d_torch = ops._route_bwd_torch(ids, weights, dweights, 32)
    assert rel_error(d_torch, d_lib) <= 1e-5


def test_route_bad_inputs():
    with pytest.raises(ValueError, match="top_k must be an int"):
        moefuse.route(torch.randn(4, 8), 9)
    with pytest.raises(ValueError, match=re.escape("logits must be [T, E]")):
        moefuse.route(torch.randn(8), 2)
    with pytest.raises(TypeError, match="floating point"):
        moefuse.route(torch.ones(4, 8, dtype=torch.int32), 2)
