"""moefuse.distributed on a GPU (each SKIPS with its reason without CUDA, or when the
library was built without NCCL): a one-rank NCCL process group and comm,
ExpertParallelExperts forward and backward bitwise equal to the single-rank op
moefuse.experts on the same inputs (the expert-parallel kernels with R = 1 give the
one-rank bits), T = 0, a bad expert id reported by check(); and two virtual ranks on one
GPU against one rank running the concatenated batch.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import moefuse
from moefuse import _lib, distributed
from moefuse.distributed import ExpertParallelExperts

from moe_reference import random_problem
from distributed_helpers import E, H, I, K, assert_bitwise

pytestmark = pytest.mark.usefixtures("library")


# ---- GPU: one rank over NCCL, two virtual ranks ------------------------------------------------


def _cuda_skip_reason():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        return "no CUDA device (torch.cuda.is_available() is False or no device visible)"
    return None


def _nccl_skip_reason():
    reason = _cuda_skip_reason()
    if reason is not None:
        return reason
    if not dist.is_available() or not dist.is_nccl_available():
        return "torch.distributed with NCCL is not built into this PyTorch"
    reason = distributed.nccl_unsupported_reason()
    if reason is not None:
        return f"libmoefuse was built without NCCL: moefuse_comm_create_nccl returns {reason}"
    return None


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    """A one-rank NCCL process group on GPU 0, destroyed after the module's tests."""
    reason = _nccl_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    old = os.environ.get("NCCL_NVLS_ENABLE")
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # before NCCL reads it (at its first communicator)
    torch.cuda.set_device(0)
    init = tmp_path_factory.mktemp("pg") / "init"
    dist.init_process_group("nccl", init_method=f"file://{init}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        if old is None:
            os.environ.pop("NCCL_NVLS_ENABLE", None)
        else:
            os.environ["NCCL_NVLS_ENABLE"] = old


def _leaves(*tensors):
    return tuple(t.detach().cuda().clone().requires_grad_() for t in tensors)


def single_rank(x, ids, p, w13, w2, dy, recompute, precision="bf16"):
    """(y, dx, dp, dw13, dw2) of moefuse.experts (no comm) with autograd."""
    x, p, w13, w2 = _leaves(x, p, w13, w2)
    y = moefuse.experts(x, ids.cuda(), p, w13, w2, recompute=recompute, precision=precision)
    y.backward(dy.cuda())
    moefuse.check_device_errors()
    return y.detach(), x.grad, p.grad, w13.grad, w2.grad


@pytest.mark.parametrize("saved_mode", [_lib.SavedMode.SAVE_ACTIVATIONS, _lib.SavedMode.RECOMPUTE],
                         ids=lambda m: m.name)
def test_nccl_one_rank_matches_single_rank_op(one_rank_group, saved_mode):
    x, ids, p, w13, w2, dy = random_problem(333, 256, 128, 16, 4, seed=11, drop_fraction=0.1)
    comm = distributed.nccl_comm_from_group(timeout_ms=20000)
    try:
        assert comm.num_ranks == 1 and comm.rank == 0
        m = ExpertParallelExperts(256, 128, 16, 4, max_tokens=400, comm=comm, rank=0,
                                  num_ranks=1, saved_mode=saved_mode, device="cuda")
        assert m._layer is not None and comm.layers == {0: m._layer}
        m.load_global_experts(w13.cuda(), w2.cuda())
        xe, pe = _leaves(x, p)
        y = m(xe, ids.cuda(), pe)
        y.backward(dy.cuda())
        m.check()
        got = (y.detach(), xe.grad, pe.grad, m.w13.grad, m.w2.grad)
        assert_bitwise(got, single_rank(x, ids, p, w13, w2, dy,
                                        saved_mode == _lib.SavedMode.RECOMPUTE))
    finally:
        comm.close()
    assert comm.closed and comm.layers == {} and comm.nccl_comm is None


def test_nccl_one_rank_zero_tokens_and_a_bad_id(one_rank_group):
    comm = distributed.nccl_comm_from_group()
    try:
        m = ExpertParallelExperts(H, I, E, K, max_tokens=64, comm=comm, rank=0, num_ranks=1,
                                  device="cuda")
        # T = 0: an empty y, and the weight gradients of no slot are zeros.
        x = torch.zeros(0, H, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        y = m(x, torch.zeros(0, K, dtype=torch.int32, device="cuda"),
              torch.zeros(0, K, device="cuda"))
        y.float().sum().backward()
        m.check()
        assert y.shape == (0, H) and x.grad.shape == (0, H)
        assert not m.w13.grad.any() and not m.w2.grad.any()
        # A bad id is found on the device and reported by check(), then cleared.
        xb, ids, pb, *_ = random_problem(32, H, I, E, K, seed=3)
        ids[5, 1] = E
        with torch.no_grad():
            m(xb.cuda(), ids.cuda(), pb.cuda())
        with pytest.raises(moefuse.MoefuseError) as info:
            m.check()
        assert info.value.status == _lib.Status.ERR_EXPERT_ID
        m.check()
    finally:
        comm.close()


@pytest.mark.parametrize("pipeline, precision",
                         [(p, "bf16") for p in _lib.Pipeline] + [(_lib.Pipeline.STAGED, "fp8")],
                         ids=lambda v: v if isinstance(v, str) else v.name)
def test_two_virtual_ranks_match_one_rank(pipeline, precision):
    """Two ranks in this process (a virtual comm), each with its own stream and tokens
    (uneven T), against moefuse.experts on the concatenated batch (staged): y, dx, dp per
    rank and each rank's shard of dW13, dW2, bitwise, with the ranks' forward staged or
    fused; and in FP8 (the received rows quantized as the one rank quantizes its gathered
    rows). Both modules are made (their layers created) before the first call, and every
    rank's call is launched before any is waited for. The caching allocator is filled on
    each stream first: a cudaMalloc between two ranks' launches could serialize them (they
    wait on each other), which would end in MOEFUSE_ERR_TIMEOUT, not a hang."""
    reason = _cuda_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    R, tokens = 2, (70, 45)
    x, ids, p, w13, w2, dy = random_problem(sum(tokens), 256, 128, 16, 4, seed=21,
                                            drop_fraction=0.1)
    ref = single_rank(x, ids, p, w13, w2, dy, recompute=False, precision=precision)
    comm = distributed.virtual_comm(R, timeout_ms=20000)
    streams = [torch.cuda.Stream() for _ in range(R)]
    try:
        mods = [ExpertParallelExperts(256, 128, 16, 4, max(tokens), comm, r, R, device="cuda",
                                      pipeline=pipeline, precision=precision)
                for r in range(R)]
        for r, m in enumerate(mods):
            m.load_global_experts(w13.cuda(), w2.cuda())
            with torch.cuda.stream(streams[r]):
                warm = [torch.empty(256 << 20, dtype=torch.uint8, device="cuda")]
                warm += [torch.empty(1 << 20, dtype=torch.uint8, device="cuda") for _ in range(8)]
                del warm
        starts = [0, tokens[0]]
        inputs = [_leaves(x[s:s + t], p[s:s + t]) + (ids[s:s + t].cuda(), dy[s:s + t].cuda())
                  for s, t in zip(starts, tokens)]
        torch.cuda.synchronize()
        ys = []
        for r, m in enumerate(mods):
            xr, pr, idr, _ = inputs[r]
            with torch.cuda.stream(streams[r]):
                ys.append(m(xr, idr, pr))
        torch.autograd.backward(ys, [inp[3] for inp in inputs])
        for r, m in enumerate(mods):
            with torch.cuda.stream(streams[r]):
                m.check()
        torch.cuda.synchronize()
        e_loc = 16 // R
        for r, m in enumerate(mods):
            s, t = starts[r], tokens[r]
            xr, pr, _, _ = inputs[r]
            got = (ys[r].detach(), xr.grad, pr.grad, m.w13.grad, m.w2.grad)
            want = (ref[0][s:s + t], ref[1][s:s + t], ref[2][s:s + t],
                    ref[3][r * e_loc:(r + 1) * e_loc], ref[4][r * e_loc:(r + 1) * e_loc])
            assert_bitwise(got, want)
    finally:
        comm.close()
