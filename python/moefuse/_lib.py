"""ctypes binding of include/moefuse.h: loading the library and every function of the C
API (its enums, structs and signatures are in _c_api.py, re-exported here).

This module knows nothing about torch: it takes raw pointers (ints) and returns
statuses turned into exceptions. ops.py builds the torch side on top of it.

Where the library is found, first match wins:
  1. the file named by the environment variable MOEFUSE_LIB;
  2. build/libmoefuse.so of the source checkout this package sits in
     (python/moefuse/_lib.py -> ../../build/libmoefuse.so; the editable install), then
     build/cpu/libmoefuse.so (where `make NVCC=none` builds, without CUDA);
  3. libmoefuse.so bundled next to this file (copied in by `pip install ./python`).

The library is loaded on first use, not at import, so `import moefuse` works (and
says what is missing) before the C library is built.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import threading
from typing import Optional

# The C API's types (enums, structs, handles, signatures) live in _c_api.py; every name
# stays importable from here.
from ._c_api import (_SIGNATURES, _STATUS, EXPECTED_VERSION, MEMORY_VERSION, Backend, BwdArgs,
                     CommHandle, Config, DType, Fp8Weights, FwdArgs, LayerHandle, Memory,
                     Pipeline, Precision, RouteArgs, RouteBwdArgs, SavedMode, Status)

# used through _lib by the callers
_REEXPORTED = (_STATUS, MEMORY_VERSION, Pipeline, Precision, SavedMode)


class MoefuseError(RuntimeError):
    """A call into libmoefuse returned a status other than MOEFUSE_OK.

    Attributes:
        status: the Status.
        status_name: the library's name for it ("MOEFUSE_ERR_SHAPE", ...).
        message: moefuse_last_error(): which argument was wrong and what was expected.
        function: the C function that failed.
    """

    def __init__(self, function: str, status: int, status_name: str, message: str):
        self.function = function
        try:
            self.status = Status(status)
        except ValueError:
            self.status = status
        self.status_name = status_name
        self.message = message
        super().__init__(f"{function}: {status_name}: {message or '(no message)'}")


class LibraryNotFoundError(OSError):
    """libmoefuse.so could not be found or loaded, or is the wrong version."""


# ---- loading ---------------------------------------------------------------------------

_LIB_NAME = "libmoefuse.so"
_load_lock = threading.Lock()
_loaded: Optional[ctypes.CDLL] = None


def candidate_paths() -> list[pathlib.Path]:
    """Where the library is looked for, in order (see the module docstring)."""
    here = pathlib.Path(__file__).resolve().parent
    paths = []
    env = os.environ.get("MOEFUSE_LIB")
    if env:
        paths.append(pathlib.Path(env))
    paths.append(here.parent.parent / "build" / _LIB_NAME)
    paths.append(here.parent.parent / "build" / "cpu" / _LIB_NAME)
    paths.append(here / _LIB_NAME)
    return paths


def _find_library() -> pathlib.Path:
    env = os.environ.get("MOEFUSE_LIB")
    if env:
        # An explicit choice that does not exist is an error, not a reason to load a
        # different library silently.
        path = pathlib.Path(env)
        if not path.is_file():
            raise LibraryNotFoundError(f"MOEFUSE_LIB={env}: no such file")
        return path
    for path in candidate_paths():
        if path.is_file():
            return path
    tried = ", ".join(str(p) for p in candidate_paths())
    raise LibraryNotFoundError(
        f"{_LIB_NAME} not found (tried {tried}). Build it with `make lib` in the "
        "repository root, or point MOEFUSE_LIB at it.")


def version_string(version: int) -> str:
    return f"{version // 10000}.{version // 100 % 100}.{version % 100}"


def load() -> ctypes.CDLL:
    """Loads the library once, sets every signature, checks the version."""
    global _loaded
    if _loaded is not None:
        return _loaded
    with _load_lock:
        if _loaded is not None:
            return _loaded
        path = _find_library()
        try:
            cdll = ctypes.CDLL(str(path))
        except OSError as err:
            raise LibraryNotFoundError(f"cannot load {path}: {err}") from err
        for name, (restype, argtypes) in _SIGNATURES.items():
            try:
                fn = getattr(cdll, name)
            except AttributeError as err:
                raise LibraryNotFoundError(
                    f"{path} lacks {name}: not a libmoefuse built from this header") from err
            fn.restype = restype
            fn.argtypes = argtypes
        version = cdll.moefuse_version()
        if version // 100 != EXPECTED_VERSION // 100:
            raise LibraryNotFoundError(
                f"{path} is moefuse {version_string(version)}; this binding mirrors the "
                f"structs of {version_string(EXPECTED_VERSION)} (major and minor must "
                "match). Rebuild the library or reinstall the Python package.")
        cdll._moefuse_path = str(path)
        _loaded = cdll
        return cdll


def library_path() -> str:
    """The path of the loaded library (loads it)."""
    return load()._moefuse_path


def is_available() -> bool:
    """True when the library can be loaded (and has the right version)."""
    try:
        load()
        return True
    except LibraryNotFoundError:
        return False


# ---- calls ----------------------------------------------------------------------------


def status_string(status: int) -> str:
    return load().moefuse_status_string(status).decode()


def last_error() -> str:
    return load().moefuse_last_error().decode(errors="replace")


def check(function: str, status: int) -> None:
    """Raises MoefuseError for any status other than OK.

    moefuse_last_error is per OS thread; ctypes runs the call and this read on the
    calling thread, so the message is the one of this call.
    """
    if status != Status.OK:
        lib = load()
        raise MoefuseError(function, status, lib.moefuse_status_string(status).decode(),
                           lib.moefuse_last_error().decode(errors="replace"))


def version() -> int:
    """MOEFUSE_VERSION of the loaded library."""
    return load().moefuse_version()


def config_init(hidden: int, intermediate: int, num_experts: int, top_k: int,
                max_tokens: int) -> Config:
    """A Config with the library's defaults (R = 1, bf16, CPU, saved activations)."""
    cfg = Config()
    load().moefuse_config_init(ctypes.byref(cfg), hidden, intermediate, num_experts, top_k,
                               max_tokens)
    return cfg


def memory_dict(m: Memory) -> dict:
    """The fields of a Memory past its header, by name."""
    return {name: getattr(m, name) for name, _ in Memory._fields_ if name != "struct_size"}


def memory_estimate(cfg: Config, with_comm: bool) -> dict:
    """moefuse_memory_estimate: what a CUDA layer of cfg (backend CUDA) would report as its
    rank's largest layer on a comm (with_comm) or without one; needs no GPU."""
    out = Memory(struct_size=ctypes.sizeof(Memory))
    check("moefuse_memory_estimate",
          load().moefuse_memory_estimate(ctypes.byref(cfg), int(with_comm), ctypes.byref(out)))
    return memory_dict(out)


def comm_create_virtual(num_ranks: int) -> CommHandle:
    """moefuse_comm_create_virtual: a new handle of num_ranks ranks in this process."""
    handle = CommHandle()
    check("moefuse_comm_create_virtual",
          load().moefuse_comm_create_virtual(num_ranks, ctypes.byref(handle)))
    return handle


def comm_create_nccl(nccl_comm: Optional[int]) -> CommHandle:
    """moefuse_comm_create_nccl over an ncclComm_t (an int address); MOEFUSE_ERR_UNSUPPORTED
    when the library was built without NCCL."""
    handle = CommHandle()
    check("moefuse_comm_create_nccl",
          load().moefuse_comm_create_nccl(nccl_comm, ctypes.byref(handle)))
    return handle


class _Owner:
    """An object owning one opaque handle (`_handle`, None once closed)."""

    _what = "handle"

    @property
    def handle(self):
        if self._handle is None:
            raise ValueError(f"moefuse {self._what} used after close()")
        return self._handle

    @property
    def closed(self) -> bool:
        return self._handle is None


class Comm(_Owner):
    """Owns one moefuse_comm handle (expert parallelism) and the layers made with it.

    Comm.virtual(R) makes R ranks inside this process; an NCCL comm comes from
    moefuse.distributed.nccl_comm_from_group. Either holds any number of Layers per rank
    (one per MoE layer of a model; they share the rank's windows and scratch, so their
    calls run in stream order), keyed by creation order. The comm keeps them alive:
    close() destroys the layers still open, in creation order, then the comm. For an NCCL
    comm that is collective (every rank calls close() together), as creating the layers
    was."""

    _what = "comm"

    def __init__(self, handle: CommHandle, num_ranks: int, rank: Optional[int] = None):
        self._lib = load()
        self._handle = handle
        self.num_ranks = num_ranks
        self.rank = rank  # this process's rank for an NCCL comm; None for virtual ranks
        self.layers: dict[int, "Layer"] = {}
        self._next_key = 0  # creation order of the layers

    @classmethod
    def virtual(cls, num_ranks: int) -> "Comm":
        """R virtual ranks on the current GPU (moefuse_comm_create_virtual), for tests."""
        return cls(comm_create_virtual(num_ranks), num_ranks)

    def set_timeout_ms(self, timeout_ms: int) -> None:
        """The bound on every wait for a peer, read by every later call (>= 1)."""
        check("moefuse_comm_set_timeout_ms",
              self._lib.moefuse_comm_set_timeout_ms(self.handle, timeout_ms))

    def close(self) -> None:
        if self._handle is None:
            return
        for rank in sorted(self.layers):
            self.layers[rank].close()
        handle, self._handle = self._handle, None
        check("moefuse_comm_destroy", self._lib.moefuse_comm_destroy(handle))

    def __enter__(self) -> "Comm":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Layer(_Owner):
    """Owns one moefuse_layer handle. Not thread-safe: the layer's workspaces are used
    by every call, so calls on one Layer must be ordered (one host thread at a time,
    and for CUDA one stream at a time or streams ordered by events).

    comm: None for one rank without expert-parallel kernels; else the Comm of all
    cfg.num_ranks ranks, which keeps this layer (as its rank cfg.rank) until close()."""

    _what = "layer"

    def __init__(self, cfg: Config, comm: Optional[Comm] = None):
        self.cfg = cfg
        self._lib = load()
        handle = LayerHandle()
        check("moefuse_layer_create",
              self._lib.moefuse_layer_create(ctypes.byref(cfg),
                                             None if comm is None else comm.handle,
                                             ctypes.byref(handle)))
        self._handle = handle
        self.comm = comm
        if comm is not None:
            self._comm_key, comm._next_key = comm._next_key, comm._next_key + 1
            comm.layers[self._comm_key] = self
        self.lock = threading.Lock()

    def saved_bytes(self, num_tokens: int) -> int:
        out = ctypes.c_size_t()
        check("moefuse_saved_bytes",
              self._lib.moefuse_saved_bytes(self.handle, num_tokens, ctypes.byref(out)))
        return out.value

    def memory(self) -> dict:
        """moefuse_layer_memory as a dict of its fields (bytes and rows)."""
        out = Memory(struct_size=ctypes.sizeof(Memory))
        check("moefuse_layer_memory", self._lib.moefuse_layer_memory(self.handle, ctypes.byref(out)))
        return memory_dict(out)

    def forward(self, args: FwdArgs, stream: int = 0) -> None:
        check("moefuse_forward",
              self._lib.moefuse_forward(self.handle, ctypes.byref(args), stream or None))

    def backward(self, args: BwdArgs, stream: int = 0) -> None:
        check("moefuse_backward",
              self._lib.moefuse_backward(self.handle, ctypes.byref(args), stream or None))

    def fp8_weights_bytes(self) -> int:
        """moefuse_fp8_weights_bytes: one buffer for all eight FP8 weight arrays."""
        out = ctypes.c_size_t()
        check("moefuse_fp8_weights_bytes",
              self._lib.moefuse_fp8_weights_bytes(self.handle, ctypes.byref(out)))
        return out.value

    def fp8_weights_view(self, buffer: int) -> Fp8Weights:
        """moefuse_fp8_weights_view: the arrays carved out of `buffer` (an address,
        fp8_weights_bytes() bytes, 256-byte aligned); writes nothing into it."""
        out = Fp8Weights()
        check("moefuse_fp8_weights_view",
              self._lib.moefuse_fp8_weights_view(self.handle, buffer, ctypes.byref(out)))
        return out

    def quantize_weights(self, dtype: DType, w13: int, w2: int, out: Fp8Weights,
                         stream: int = 0, w13_up: int = 0) -> None:
        """moefuse_quantize_weights: W13 and W2 (addresses of contiguous bf16 or fp32
        arrays) into out's arrays, with this layer's scale rule; with w13_up, W13 in two
        halves, gate w13 and up w13_up (moefuse_quantize_weights_halves)."""
        if w13_up:
            check("moefuse_quantize_weights_halves",
                  self._lib.moefuse_quantize_weights_halves(
                      self.handle, int(dtype), w13, w13_up, w2, ctypes.byref(out),
                      stream or None))
            return
        check("moefuse_quantize_weights",
              self._lib.moefuse_quantize_weights(self.handle, int(dtype), w13, w2,
                                                 ctypes.byref(out), stream or None))

    def check_ids(self, stream: int = 0) -> None:
        """moefuse_layer_check: waits for `stream`, raises the first device-side error
        (a bad expert id; with a comm also MOEFUSE_ERR_TIMEOUT of a peer wait)."""
        check("moefuse_layer_check", self._lib.moefuse_layer_check(self.handle, stream or None))

    def close(self) -> None:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            if self.comm is not None:
                self.comm.layers.pop(self._comm_key, None)
            check("moefuse_layer_destroy", self._lib.moefuse_layer_destroy(handle))


def route_forward(args: RouteArgs, backend: Backend, stream: int = 0) -> None:
    check("moefuse_route_forward",
          load().moefuse_route_forward(ctypes.byref(args), int(backend), stream or None))


def route_backward(args: RouteBwdArgs, backend: Backend, stream: int = 0) -> None:
    check("moefuse_route_backward",
          load().moefuse_route_backward(ctypes.byref(args), int(backend), stream or None))
