"""What the tests of moefuse.distributed share: the smallest sizes the CUDA backend takes,
a stand-in comm, a two-rank CPU module, one-rank modules run on CPU layers and the bitwise
comparison with one rank."""

from __future__ import annotations

import torch

from moefuse import _lib, distributed
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


def modules_on_cpu_layers(monkeypatch) -> list:
    """ExpertParallelExperts made to run on the CPU: its layer a one-rank CPU layer of the
    module's own config (ExpertParallelExperts._config), its check that x is on CUDA
    skipped (the weights' own checks still run). Returns the list of the layers made, for
    the caller to close."""
    layers = []

    def cpu_layer(self, device):
        if self._layer is None:
            cfg = self._config()
            cfg.backend, cfg.num_ranks, cfg.rank = _lib.Backend.CPU, 1, 0
            self._layer = _lib.Layer(cfg)
            self._layer.device = torch.device("cpu")
            layers.append(self._layer)
        return self._layer
    monkeypatch.setattr(distributed.ExpertParallelExperts, "_layer_on", cpu_layer)
    monkeypatch.setattr(distributed.ExpertParallelExperts, "_validate",
                        lambda self, x, ids, p: ids.to(torch.int32))
    return layers
