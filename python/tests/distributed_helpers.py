"""What the tests of moefuse.distributed share: the smallest sizes the CUDA backend takes,
a stand-in comm, a two-rank CPU module and the bitwise comparison with one rank."""

from __future__ import annotations

import torch

from moefuse import _lib
from moefuse.distributed import ExpertParallelExperts

# The smallest sizes the CUDA backend takes (H, I multiples of 128).
H, I, E, K = 128, 128, 8, 2


def stand_in_comm(num_ranks: int) -> _lib.Comm:
    """A Comm of num_ranks ranks over a NULL handle, for the Python side's bookkeeping
    and checks, which never hand it to the library (a virtual comm needs a GPU)."""
    return _lib.Comm(_lib.CommHandle(), num_ranks)


def make_module(**overrides) -> ExpertParallelExperts:
    """A two-rank module on the CPU (no library layer: that needs CUDA)."""
    kwargs = dict(hidden=H, intermediate=I, num_experts=E, top_k=K, max_tokens=16,
                  comm=stand_in_comm(2), rank=1, num_ranks=2, device="cpu")
    kwargs.update(overrides)
    return ExpertParallelExperts(**kwargs)


def assert_bitwise(got, ref, names=("y", "dx", "dp", "dw13", "dw2")):
    for name, a, b in zip(names, got, ref):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), (name, a.dtype, b.dtype, a.shape, b.shape)
        if not torch.equal(a, b):
            diff = (a.double() - b.double()).abs().max().item()
            raise AssertionError(f"{name} is not bitwise equal to one rank's: max |diff| "
                                 f"{diff:.3e}")
