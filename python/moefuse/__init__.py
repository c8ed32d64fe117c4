"""moefuse: the routed experts of Mixture-of-Experts layers, forward and backward,
from PyTorch. A ctypes binding of libmoefuse (include/moefuse.h) with torch ops and
nn.Modules on top.

    moefuse.experts(x, ids, p, w13, w2) -> y        differentiable custom op
                                                    (precision="bf16" or "fp8")
    moefuse.route(logits, top_k) -> (ids, weights)  Qwen3 routing, differentiable
    moefuse.MoEExperts, moefuse.MoefuseQwen3MoeBlock
    moefuse.ExpertParallelExperts, moefuse.nccl_comm_from_group  expert parallelism
                                                    (moefuse.distributed)
    moefuse.memory_estimate(...)                    an EP layer's device bytes, no GPU
    moefuse.torchtitan.apply(model)                 TorchTitan's MoE models (imported on
                                                    its own: it needs torchtitan)

The C library is found through MOEFUSE_LIB, else build/libmoefuse.so of the source
checkout, else a copy installed next to this package (see moefuse._lib).
"""

from ._fp8 import Fp8UnsupportedError
from ._lib import (EXPECTED_VERSION, Comm, LibraryNotFoundError, MoefuseError, Pipeline,
                   SavedMode, Status, is_available, library_path, version)
from .distributed import (ExpertParallelExperts, load_local_experts, memory_estimate,
                          nccl_comm_from_group, virtual_comm)
from .modules import MoEExperts, MoefuseQwen3MoeBlock, fuse_per_expert_state_dict
from .ops import (backward_unsupported_reason, check_device_errors, experts, layer_cache,
                  route, saved_bytes)

__version__ = "0.3.0"

__all__ = [
    "EXPECTED_VERSION", "Comm", "ExpertParallelExperts", "Fp8UnsupportedError",
    "LibraryNotFoundError", "MoEExperts",
    "MoefuseError", "Pipeline", "SavedMode", "backward_unsupported_reason", "load_local_experts",
    "memory_estimate",
    "nccl_comm_from_group", "virtual_comm",
    "MoefuseQwen3MoeBlock", "Status", "check_device_errors", "experts",
    "fuse_per_expert_state_dict", "is_available", "layer_cache", "library_path", "route",
    "saved_bytes", "version",
]
