"""Shared pytest fixtures of the binding's tests."""

import socket

import pytest
import torch
import torch.distributed as dist

import moefuse
from moefuse import _lib


@pytest.fixture(scope="module")
def library():
    """The library is what is under test: missing is a failure, not a skip. Modules that
    test it say `pytestmark = pytest.mark.usefixtures("library")`."""
    if not moefuse.is_available():
        try:
            _lib.load()
        except _lib.LibraryNotFoundError as err:
            pytest.fail(f"libmoefuse not loadable: {err}")
    yield


@pytest.fixture
def quantize_calls(monkeypatch):
    """The weight quantizations through the library (fp8_reference.WeightQuantization:
    each one's fp8_pow2_scales and halves), from an empty cache of FP8 weights."""
    from fp8_reference import spy_weight_quantizations
    return spy_weight_quantizations(monkeypatch)


@pytest.fixture
def cpu_histc(monkeypatch):
    """torch.histc of integer tensors on CPU, through float (TorchTitan's router). The
    moefuse.torchtitan tests use it on every test (their pytestmark)."""
    histc = torch.histc

    def histc_int_on_cpu(input, *args, **kwargs):
        if input.device.type == "cpu" and not input.is_floating_point():
            return histc(input.float(), *args, **kwargs).to(input.dtype)
        return histc(input, *args, **kwargs)

    monkeypatch.setattr(torch, "histc", histc_int_on_cpu)


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
