"""The comms of expert parallelism: NCCL through ctypes (the libnccl PyTorch loaded), an
NCCL communicator of a torch.distributed group with moefuse's comm over it, and the
virtual comm of R ranks in one process for tests. distributed.py re-exports every name.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
from typing import Optional

import torch

from . import _lib


# ---- NCCL through ctypes ----------------------------------------------------------------


class NcclError(RuntimeError):
    """An NCCL call returned something other than ncclSuccess."""


class _NcclUniqueId(ctypes.Structure):
    """ncclUniqueId: 128 opaque bytes, passed by value to ncclCommInitRank."""

    _fields_ = [("internal", ctypes.c_byte * 128)]


_NCCL_SIGNATURES = {
    "ncclGetVersion": (ctypes.c_int, [ctypes.POINTER(ctypes.c_int)]),
    "ncclGetUniqueId": (ctypes.c_int, [ctypes.POINTER(_NcclUniqueId)]),
    "ncclCommInitRank": (
        ctypes.c_int, [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, _NcclUniqueId, ctypes.c_int]),
    "ncclCommDestroy": (ctypes.c_int, [ctypes.c_void_p]),
    "ncclGetErrorString": (ctypes.c_char_p, [ctypes.c_int]),
    "ncclGetLastError": (ctypes.c_char_p, [ctypes.c_void_p]),
}

_nccl: Optional[ctypes.CDLL] = None


def _loaded_nccl_path() -> Optional[str]:
    """The libnccl this process has mapped, if any (for messages)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "libnccl.so" in line:
                    return line.split()[-1]
    except OSError:
        pass
    return None


def load_nccl() -> ctypes.CDLL:
    """The libnccl that PyTorch and libmoefuse use in this process.

    libmoefuse is loaded first, so its libnccl.so.2 dependency is the copy already in the
    process (PyTorch's, loaded at `import torch`) or, failing that, its own; dlopen of
    the soname then returns that same copy. One copy matters: the ncclComm_t made here
    goes to libmoefuse. Without a loaded copy, PyTorch's nvidia/nccl package is tried."""
    global _nccl
    if _nccl is not None:
        return _nccl
    _lib.load()
    try:
        cdll = ctypes.CDLL("libnccl.so.2")
    except OSError as err:
        try:
            import nvidia.nccl  # PyTorch's pip dependency
            path = pathlib.Path(list(nvidia.nccl.__path__)[0]) / "lib" / "libnccl.so.2"
            cdll = ctypes.CDLL(str(path))
        except (ImportError, OSError) as err2:
            raise NcclError(f"libnccl.so.2 not loadable ({err}; nvidia.nccl: {err2})") from err2
    for name, (restype, argtypes) in _NCCL_SIGNATURES.items():
        fn = getattr(cdll, name)
        fn.restype = restype
        fn.argtypes = argtypes
    _nccl = cdll
    return cdll


def _nccl_check(nccl: ctypes.CDLL, function: str, result: int) -> None:
    if result != 0:
        detail = (nccl.ncclGetLastError(None) or b"").decode(errors="replace")
        raise NcclError(f"{function}: {nccl.ncclGetErrorString(result).decode()} ({result})"
                        f"{': ' + detail if detail else ''} [libnccl: {_loaded_nccl_path()}]")


class NcclComm(_lib.Comm):
    """moefuse's comm over an NCCL communicator this object owns (nccl_comm, an
    ncclComm_t as an int, of CUDA device `device`). close() destroys the layers,
    moefuse's comm, then the NCCL communicator; every rank calls it together."""

    def __init__(self, nccl: ctypes.CDLL, nccl_comm: int, num_ranks: int, rank: int,
                 device: int):
        super().__init__(_lib.comm_create_nccl(nccl_comm), num_ranks, rank)
        self._nccl = nccl
        self.nccl_comm: Optional[int] = nccl_comm
        self.device = device

    def close(self) -> None:
        with torch.cuda.device(self.device):
            super().close()  # raises, keeping the NCCL communicator, if moefuse still uses it
            if self.nccl_comm is not None:
                comm, self.nccl_comm = self.nccl_comm, None
                _nccl_check(self._nccl, "ncclCommDestroy", self._nccl.ncclCommDestroy(comm))


def nccl_unsupported_reason() -> Optional[str]:
    """None when the loaded libmoefuse was built with NCCL, else the message of its
    MOEFUSE_ERR_UNSUPPORTED. Asks the library (moefuse_comm_create_nccl(NULL)); needs no
    GPU and no communicator."""
    try:
        _lib.Comm(_lib.comm_create_nccl(None), 1).close()  # not expected to succeed
    except _lib.MoefuseError as err:
        if err.status == _lib.Status.ERR_UNSUPPORTED:
            return f"{err.status_name}: {err.message}"
        if err.status != _lib.Status.ERR_NULL_POINTER:
            raise
    return None


def _check_timeout(timeout_ms) -> None:
    if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int) or timeout_ms < 1:
        raise ValueError(f"timeout_ms must be an int >= 1, got {timeout_ms!r}")


def nccl_comm_from_group(group=None, timeout_ms: int = 30000) -> NcclComm:
    """An NCCL communicator of the ranks of `group` (default: the world) and moefuse's
    comm over it. Collective: every rank of the group calls it, with its GPU current
    (torch.cuda.set_device); rank i of the group is rank i of the comm.

    Rank 0 of the group makes an ncclUniqueId, torch.distributed.broadcast_object_list
    sends it over the group, and every rank calls ncclCommInitRank through ctypes on the
    libnccl PyTorch loaded (see load_nccl) on torch.cuda.current_device(). The group
    itself may be NCCL or gloo; only the id travels through it.

    NCCL_NVLS_ENABLE: moefuse refuses NVLink multicast, so this sets
    os.environ["NCCL_NVLS_ENABLE"] to "0" when it is unset (setdefault) and raises
    when it is set to anything else. NCCL may read its variables once per process, at
    its first communicator, so where torch's process group may already have made one,
    set NCCL_NVLS_ENABLE=0 in the launch environment (as bench/bench_ep.py's usage
    line does).

    timeout_ms bounds every wait for a peer inside moefuse's kernels. close() the
    returned comm on every rank together (after the modules using it are done), or
    let the process exit."""
    import torch.distributed as dist

    _check_timeout(timeout_ms)
    nvls = os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if nvls != "0":
        raise ValueError(f"NCCL_NVLS_ENABLE={nvls!r}: moefuse never uses NVLink multicast; "
                         "expected NCCL_NVLS_ENABLE=0")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("nccl_comm_from_group: torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group first")
    if not torch.cuda.is_available():
        raise RuntimeError("nccl_comm_from_group: no CUDA device (expert parallelism runs on "
                           "one GPU per rank)")
    # Every rank answers the same here, so a library without NCCL fails on all of them
    # before any collective.
    reason = nccl_unsupported_reason()
    if reason is not None:
        raise _lib.MoefuseError("moefuse_comm_create_nccl", _lib.Status.ERR_UNSUPPORTED,
                                "MOEFUSE_ERR_UNSUPPORTED", reason)
    nccl = load_nccl()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    device = torch.cuda.current_device()

    # Rank 0 sends the id, or why it has none, so no rank waits in ncclCommInitRank
    # for an id that never comes.
    payload: list = [None]
    if rank == 0:
        uid = _NcclUniqueId()
        try:
            _nccl_check(nccl, "ncclGetUniqueId", nccl.ncclGetUniqueId(ctypes.byref(uid)))
            payload = [bytes(uid)]
        except NcclError as err:
            payload = [str(err)]
    src = dist.get_global_rank(group if group is not None else dist.group.WORLD, 0)
    dist.broadcast_object_list(payload, src=src, group=group)
    if isinstance(payload[0], str):
        raise NcclError(f"rank 0 of the group: {payload[0]}")
    uid = _NcclUniqueId.from_buffer_copy(payload[0])

    comm = ctypes.c_void_p()
    with torch.cuda.device(device):
        _nccl_check(nccl, "ncclCommInitRank",
                    nccl.ncclCommInitRank(ctypes.byref(comm), world, uid, rank))
        try:
            out = NcclComm(nccl, comm.value, world, rank, device)
        except BaseException:
            nccl.ncclCommDestroy(comm.value)
            raise
    try:
        out.set_timeout_ms(timeout_ms)
    except BaseException:
        out.close()
        raise
    return out


def virtual_comm(num_ranks: int, timeout_ms: int = 30000) -> _lib.Comm:
    """R virtual ranks in this process (moefuse_comm_create_virtual), for tests on one
    GPU: make every rank's module (on CUDA, so each creates its layer) before the first
    forward, give each rank's calls their own stream, and launch all ranks' calls
    before waiting on any. Layer creation asks for CUDA_DEVICE_MAX_CONNECTIONS >= 2R + 2
    in the environment before CUDA starts (the default 8 covers R <= 3). Every kernel
    launched between two ranks' calls must have run once before (or set
    CUDA_MODULE_LOADING=EAGER): CUDA's lazy loading waits for the device at a kernel's
    first launch, where an earlier rank's call is spinning, and both hang until the
    timeout. The library loads its own kernels when a layer is created; to load
    PyTorch's (the router's backward, say), run the same path once on one rank (a copy of
    the model on a one-rank virtual comm, as tests/test_torchtitan_ep.py does)."""
    _check_timeout(timeout_ms)
    comm = _lib.Comm.virtual(num_ranks)
    try:
        comm.set_timeout_ms(timeout_ms)
    except BaseException:
        comm.close()
        raise
    return comm
