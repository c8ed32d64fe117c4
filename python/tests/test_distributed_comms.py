"""moefuse.distributed's comms (CPU: their error paths; a virtual comm where a GPU takes
one): the virtual comm, timeouts, close, the layers a comm keeps, the NCCL probe and
nccl_comm_from_group's checks before any collective."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import moefuse
from moefuse import _lib, distributed

from distributed_helpers import E, H, I, K, stand_in_comm

pytestmark = pytest.mark.usefixtures("library")


def virtual_comm_or_skip(num_ranks: int) -> _lib.Comm:
    """A real virtual comm; the test is skipped where the library refuses one (no sm_90
    GPU, or a build without CUDA)."""
    try:
        return distributed.virtual_comm(num_ranks)
    except moefuse.MoefuseError as e:
        if e.status != _lib.Status.ERR_UNSUPPORTED:
            raise
        pytest.skip(f"no virtual comm here: {e.message}")


# ---- comms ----------------------------------------------------------------------------------


def test_virtual_comm_of_zero_ranks_raises():
    with pytest.raises(moefuse.MoefuseError) as info:
        _lib.Comm.virtual(0)
    assert info.value.status == _lib.Status.ERR_INVALID_CONFIG
    assert "num_ranks = 0" in info.value.message


def test_virtual_comm_needs_a_gpu():
    """moefuse_comm_create_virtual refuses what no layer of it could run on."""
    try:
        comm = distributed.virtual_comm(2)
    except moefuse.MoefuseError as e:
        assert e.status == _lib.Status.ERR_UNSUPPORTED
        assert "moefuse_comm_create_virtual" in e.message
        assert _cuda_layer_skip_reason() is not None, "a CUDA layer works but no virtual comm"
        return
    comm.close()
    assert _cuda_layer_skip_reason() is None, "a virtual comm without a usable GPU"


def _cuda_layer_skip_reason():
    """Why a one-rank CUDA layer cannot be made here, or None."""
    try:
        _lib.Layer(_config(1, _lib.Backend.CUDA)).close()
    except moefuse.MoefuseError as e:
        return e.message
    return None


def test_set_timeout_of_zero_raises():
    with virtual_comm_or_skip(2) as comm:
        with pytest.raises(moefuse.MoefuseError) as info:
            comm.set_timeout_ms(0)
        assert info.value.status == _lib.Status.ERR_INVALID_CONFIG
        assert "timeout_ms = 0" in info.value.message
        comm.set_timeout_ms(5)
    with pytest.raises(ValueError, match="timeout_ms must be an int >= 1"):
        distributed.virtual_comm(2, timeout_ms=0)


def test_comm_close_is_idempotent_and_final():
    comm = stand_in_comm(4)
    assert comm.num_ranks == 4 and comm.rank is None and not comm.closed
    comm.close()
    comm.close()
    assert comm.closed
    with pytest.raises(ValueError, match="comm used after close"):
        comm.set_timeout_ms(10)


def _config(num_ranks: int, backend: _lib.Backend) -> _lib.Config:
    cfg = _lib.config_init(H, I, E, K, 16)
    cfg.num_ranks, cfg.backend = num_ranks, backend
    return cfg


def test_comm_keeps_its_layers_and_closes_them_first():
    """Bookkeeping of Comm.layers (any number per rank, by creation order), with stand-ins
    for layers (real ones need a GPU)."""
    closed = []

    class StandIn:
        def __init__(self, comm, name):
            self.comm, self.name = comm, name
            self.key, comm._next_key = comm._next_key, comm._next_key + 1
            comm.layers[self.key] = self

        def close(self):
            closed.append(self.name)
            self.comm.layers.pop(self.key)

    comm = stand_in_comm(2)
    for name in ("rank 1 layer 0", "rank 0 layer 0", "rank 1 layer 1"):
        StandIn(comm, name)
    comm.close()
    assert closed == ["rank 1 layer 0", "rank 0 layer 0", "rank 1 layer 1"]
    assert comm.layers == {} and comm.closed


def test_layer_with_a_comm_needs_the_cuda_backend():
    with virtual_comm_or_skip(2) as comm:
        with pytest.raises(moefuse.MoefuseError) as info:
            _lib.Layer(_config(2, _lib.Backend.CPU), comm)
        assert info.value.status == _lib.Status.ERR_UNSUPPORTED
        assert comm.layers == {}


def test_layer_ranks_must_match_the_comm():
    with virtual_comm_or_skip(4) as comm:
        with pytest.raises(moefuse.MoefuseError) as info:
            _lib.Layer(_config(2, _lib.Backend.CUDA), comm)
        assert info.value.status == _lib.Status.ERR_INVALID_CONFIG
        assert "the comm has 4 ranks" in info.value.message


def test_layer_of_several_ranks_needs_a_comm():
    with pytest.raises(moefuse.MoefuseError) as info:
        _lib.Layer(_config(2, _lib.Backend.CUDA))
    assert info.value.status == _lib.Status.ERR_INVALID_CONFIG


def test_nccl_probe_agrees_with_the_library():
    """moefuse_comm_create_nccl(NULL): NULL_POINTER when built with NCCL, else
    UNSUPPORTED; nccl_unsupported_reason() says which without a GPU."""
    with pytest.raises(moefuse.MoefuseError) as info:
        _lib.comm_create_nccl(None)
    reason = distributed.nccl_unsupported_reason()
    if reason is None:
        assert info.value.status == _lib.Status.ERR_NULL_POINTER
    else:
        assert info.value.status == _lib.Status.ERR_UNSUPPORTED and "NCCL" in reason


def test_nccl_comm_from_group_checks_before_any_collective(monkeypatch):
    with pytest.raises(ValueError, match="timeout_ms"):
        distributed.nccl_comm_from_group(timeout_ms=-1)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    with pytest.raises(ValueError, match="NVLink multicast"):
        distributed.nccl_comm_from_group()
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            distributed.nccl_comm_from_group()
