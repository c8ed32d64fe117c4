"""moefuse.distributed: expert parallelism from PyTorch.

CPU (runs in CI): the comm bindings' error paths, load_local_experts' sharding,
ExpertParallelExperts' argument checks, which raise before the library is touched, and
the module's autograd function driving a one-rank CPU layer (its args structs, saved
buffer and gradients), bitwise equal to moefuse.experts.

GPU (each SKIPS with its reason without CUDA, or when the library was built without
NCCL): a one-rank NCCL process group and comm, ExpertParallelExperts forward and
backward bitwise equal to the single-rank op moefuse.experts on the same inputs (the
expert-parallel kernels with R = 1 give the one-rank bits), T = 0, a bad expert id
reported by check(); and two virtual ranks on one GPU against one rank running the
concatenated batch.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import moefuse
from moefuse import _lib, distributed
from moefuse.distributed import ExpertParallelExperts, load_local_experts

from moe_reference import random_problem

pytestmark = pytest.mark.usefixtures("library")

# The smallest sizes the CUDA backend takes (H, I multiples of 128).
H, I, E, K = 128, 128, 8, 2


def stand_in_comm(num_ranks: int) -> _lib.Comm:
    """A Comm of num_ranks ranks over a NULL handle, for the Python side's bookkeeping
    and checks, which never hand it to the library (a virtual comm needs a GPU)."""
    return _lib.Comm(_lib.CommHandle(), num_ranks)


def virtual_comm_or_skip(num_ranks: int) -> _lib.Comm:
    """A real virtual comm; the test is skipped where the library refuses one (no sm_90
    GPU, or a build without CUDA)."""
    try:
        return distributed.virtual_comm(num_ranks)
    except moefuse.MoefuseError as e:
        if e.status != _lib.Status.ERR_UNSUPPORTED:
            raise
        pytest.skip(f"no virtual comm here: {e.message}")


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


def test_comm_keeps_one_layer_per_rank_and_closes_them_first():
    """Bookkeeping of Comm.layers, with stand-ins for layers (real ones need a GPU)."""
    closed = []

    class StandIn:
        def __init__(self, comm, rank):
            self.comm, self.rank = comm, rank
            comm.layers[rank] = self

        def close(self):
            closed.append(self.rank)
            self.comm.layers.pop(self.rank)

    comm = stand_in_comm(2)
    StandIn(comm, 1)
    StandIn(comm, 0)
    cfg = _config(2, _lib.Backend.CUDA)
    with pytest.raises(ValueError, match="already has a layer for rank 0"):
        _lib.Layer(cfg, comm)  # refused before the library is asked
    comm.close()
    assert closed == [0, 1] and comm.layers == {} and comm.closed


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


# ---- sharding -----------------------------------------------------------------------------


def test_load_local_experts_takes_the_contiguous_shard():
    w13 = torch.arange(8 * 4 * 3, dtype=torch.float32).reshape(8, 4, 3)
    w2 = torch.arange(8 * 3 * 2, dtype=torch.float32).reshape(8, 3, 2)
    for rank in range(4):
        l13, l2 = load_local_experts(w13, w2, rank, 4)
        assert torch.equal(l13, w13[2 * rank:2 * rank + 2])
        assert torch.equal(l2, w2[2 * rank:2 * rank + 2])
        assert l13.data_ptr() == w13[2 * rank].data_ptr()  # a view, no copy
    l13, l2 = load_local_experts(w13, w2, 0, 1)
    assert torch.equal(l13, w13) and torch.equal(l2, w2)


@pytest.mark.parametrize("w2_shape, rank, num_ranks, error, message", [
    ((8, 3, 2), 0, 3, ValueError, "not divisible by num_ranks=3"),
    ((8, 3, 2), 4, 4, ValueError, "0 <= rank < num_ranks"),
    ((8, 3, 2), -1, 4, ValueError, "0 <= rank < num_ranks"),
    ((8, 3, 2), 0, 0, ValueError, "num_ranks >= 1"),
    ((8, 2, 3), 0, 2, ValueError, "expected w13 \\[E, 2I, H\\] and w2 \\[E, H, I\\]"),
    ((8, 3), 0, 2, ValueError, "w2_global must be a 3-d tensor"),
    ((8, 3, 2), 1.0, 2, TypeError, "rank must be an int"),
])
def test_load_local_experts_refuses(w2_shape, rank, num_ranks, error, message):
    w13 = torch.zeros(8, 4, 3)
    with pytest.raises(error, match=message):
        load_local_experts(w13, torch.zeros(w2_shape), rank, num_ranks)


# ---- ExpertParallelExperts: construction ------------------------------------------------------


def test_module_holds_the_local_experts_only():
    m = make_module()
    assert tuple(m.w13.shape) == (E // 2, 2 * I, H) and tuple(m.w2.shape) == (E // 2, H, I)
    assert m.w13.dtype == torch.bfloat16
    assert m.num_experts == E and m.num_local_experts == E // 2
    assert m.expert_range == range(4, 8)
    assert m._layer is None and m.comm.layers == {}  # nothing made on the CPU
    m.check()  # no layer yet: nothing to check
    m.close()
    w13 = torch.randn(E, 2 * I, H).to(torch.bfloat16)
    w2 = torch.randn(E, H, I).to(torch.bfloat16)
    m.load_global_experts(w13, w2)
    assert torch.equal(m.w13, w13[4:]) and torch.equal(m.w2, w2[4:])
    assert "rank=1, num_ranks=2" in repr(m)


def _closed_comm():
    comm = stand_in_comm(2)
    comm.close()
    return comm


@pytest.mark.parametrize("overrides, error, message", [
    (dict(hidden=100), ValueError, "hidden=100: the CUDA backend needs a multiple of 128"),
    (dict(intermediate=64), ValueError, "intermediate=64"),
    (dict(max_tokens=0), ValueError, "max_tokens must be >= 1"),
    (dict(top_k=True), TypeError, "top_k must be an int"),
    (dict(top_k=9), ValueError, "top_k=9 must be <= num_experts=8"),
    (dict(num_experts=6, num_ranks=4), ValueError, "not divisible by num_ranks=4"),
    (dict(rank=2), ValueError, "0 <= rank < num_ranks"),
    (dict(comm=None), TypeError, "comm must be a moefuse Comm"),
    (dict(comm=_closed_comm), ValueError, "the comm is closed"),
    (dict(num_ranks=4, rank=0), ValueError, "num_ranks=4 but the comm has 2 ranks"),
    (dict(dtype=torch.float16), TypeError, "dtype must be bfloat16"),
    (dict(saved_mode="recompute"), ValueError, "saved_mode must be a moefuse SavedMode"),
    (dict(saved_mode=_lib.SavedMode.SAVE_ACTIVATIONS_AND_INPUTS), ValueError,
     "SAVE_ACTIVATIONS_AND_INPUTS is for one rank"),
    (dict(pipeline="fused"), ValueError, "pipeline must be a moefuse Pipeline or None"),
])
def test_module_refuses_bad_config(overrides, error, message):
    if callable(overrides.get("comm")):
        overrides = dict(overrides, comm=overrides["comm"]())
    with pytest.raises(error, match=message):
        make_module(**overrides)


def test_module_refuses_another_rank_of_an_nccl_comm():
    """A comm that knows this process's rank (NCCL) must agree with `rank`."""
    comm = stand_in_comm(2)
    comm.rank = 0  # what an NCCL comm of rank 0 says
    with pytest.raises(ValueError, match="rank=1 but this process is rank 0"):
        make_module(comm=comm)


def test_module_pipeline_from_argument_or_environment(monkeypatch):
    monkeypatch.delenv("MOEFUSE_PIPELINE", raising=False)
    assert make_module().pipeline is _lib.Pipeline.STAGED
    monkeypatch.setenv("MOEFUSE_PIPELINE", "fused")
    m = make_module()
    assert m.pipeline is _lib.Pipeline.FUSED and "pipeline=FUSED" in repr(m)
    assert make_module(pipeline=_lib.Pipeline.STAGED).pipeline is _lib.Pipeline.STAGED


def test_module_takes_fp32_master_weights_and_recompute():
    m = make_module(dtype=torch.float32, saved_mode=_lib.SavedMode.RECOMPUTE)
    assert m.w13.dtype == torch.float32 and m.recompute
    assert m.saved_mode is _lib.SavedMode.RECOMPUTE


# ---- ExpertParallelExperts: forward arguments --------------------------------------------------


def _inputs(T=5, h=H, k=K, x_dtype=torch.bfloat16, ids_dtype=torch.int32,
            p_dtype=torch.float32):
    x = torch.randn(T, h).to(x_dtype)
    ids = torch.zeros(T, k, dtype=ids_dtype)
    p = torch.full((T, k), 1.0 / k).to(p_dtype)
    return x, ids, p


@pytest.mark.parametrize("inputs, error, message", [
    (_inputs(x_dtype=torch.float32), TypeError, "x must be torch.bfloat16, got torch.float32"),
    (_inputs(ids_dtype=torch.int16), TypeError, "ids must be torch.int32 or torch.int64"),
    (_inputs(p_dtype=torch.bfloat16), TypeError, "p must be torch.float32"),
    (_inputs(h=64), ValueError, "x must be \\[T, H=128\\]"),
    ((torch.zeros(5, H, dtype=torch.bfloat16), torch.zeros(5, 3, dtype=torch.int32),
      torch.zeros(5, 3)), ValueError, "ids must be \\[T=5, K=2\\]"),
    ((torch.zeros(5, H, dtype=torch.bfloat16), torch.zeros(5, K, dtype=torch.int32),
      torch.zeros(4, K)), ValueError, "p must be \\[T=5, K=2\\]"),
    (_inputs(T=17), ValueError, "T=17 tokens > max_tokens=16"),
    (_inputs(), ValueError, "expert parallelism runs on CUDA tensors, x is on cpu"),
    (("x", None, None), TypeError, "x must be a torch.Tensor, got str"),
])
def test_forward_refuses_before_the_library(inputs, error, message, monkeypatch):
    def no_layer(*args, **kwargs):
        raise AssertionError("the library was touched")
    monkeypatch.setattr(_lib, "Layer", no_layer)
    m = make_module()
    with pytest.raises(error, match=message):
        m(*inputs)
    assert m._layer is None and m.comm.layers == {}


# ---- the autograd function's plumbing, on the CPU backend --------------------------------------


@pytest.fixture
def cpu_layer():
    """A one-rank CPU layer (no comm) of the tests' tiny shape: what the function drives
    on CUDA with a comm, here on the CPU backend, so its args structs, saved buffer and
    gradients run in CI."""
    def make(saved_mode=_lib.SavedMode.SAVE_ACTIVATIONS):
        cfg = _lib.config_init(64, 32, 8, 2, 64)
        cfg.saved_mode = saved_mode
        layer = _lib.Layer(cfg)
        layers.append(layer)
        return layer
    layers = []
    yield make
    for layer in layers:
        layer.close()


def _fn_leaves(*tensors):
    return [t.clone().requires_grad_() for t in tensors]


@pytest.mark.parametrize("saved_mode", list(_lib.SavedMode), ids=lambda m: m.name)
@pytest.mark.parametrize("T", [37, 1])
def test_function_gives_the_single_rank_bits(cpu_layer, saved_mode, T):
    x, ids, p, w13, w2, dy = random_problem(T, 64, 32, 8, 2, seed=5, drop_fraction=0.2)
    got = _fn_leaves(x, p, w13, w2)
    y = distributed._ExpertParallelFn.apply(got[0], ids, got[1], got[2], got[3],
                                            cpu_layer(saved_mode), True)
    y.backward(dy)
    want = _fn_leaves(x, p, w13, w2)
    y_ref = moefuse.experts(want[0], ids, want[1], want[2], want[3],
                            recompute=saved_mode == _lib.SavedMode.RECOMPUTE)
    y_ref.backward(dy)
    assert_bitwise([y.detach()] + [t.grad for t in got],
                   [y_ref.detach()] + [t.grad for t in want])


def test_function_bf16_weight_gradients_are_rounded_fp32(cpu_layer):
    """bf16 weights: dW13 / dW2 come from the library in bf16, bitwise the fp32 ones of
    master weights holding the same values, rounded to nearest even."""
    x, ids, p, w13, w2, dy = random_problem(37, 64, 32, 8, 2, seed=7, drop_fraction=0.2)
    grads = []
    for weights in ((w13, w2), (w13.float(), w2.float())):
        leaves = _fn_leaves(x, p, *weights)
        y = distributed._ExpertParallelFn.apply(leaves[0], ids, leaves[1], leaves[2],
                                                leaves[3], cpu_layer(), True)
        y.backward(dy)
        grads.append((leaves[2].grad, leaves[3].grad))
    (dw13_b, dw2_b), (dw13_f, dw2_f) = grads
    assert dw13_b.dtype == torch.bfloat16 and dw13_f.dtype == torch.float32
    assert torch.equal(dw13_b.view(torch.int16), dw13_f.bfloat16().view(torch.int16))
    assert torch.equal(dw2_b.view(torch.int16), dw2_f.bfloat16().view(torch.int16))


def test_function_with_zero_tokens_and_fp32_weights(cpu_layer):
    x = torch.zeros(0, 64, dtype=torch.bfloat16, requires_grad=True)
    p = torch.zeros(0, 2, requires_grad=True)
    w13 = torch.randn(8, 64, 64, requires_grad=True)  # fp32 master weights
    w2 = torch.randn(8, 64, 32, requires_grad=True)
    y = distributed._ExpertParallelFn.apply(x, torch.zeros(0, 2, dtype=torch.int32), p, w13,
                                            w2, cpu_layer(), True)
    y.float().sum().backward()
    assert y.shape == (0, 64) and x.grad.shape == (0, 64) and p.grad.shape == (0, 2)
    assert w13.grad.dtype == torch.float32 and not w13.grad.any() and not w2.grad.any()


def test_function_backward_needs_a_saved_forward(cpu_layer):
    x, ids, p, w13, w2, dy = random_problem(4, 64, 32, 8, 2, seed=6)
    x.requires_grad_()
    y = distributed._ExpertParallelFn.apply(x, ids, p, w13, w2, cpu_layer(), False)
    with pytest.raises(RuntimeError, match="kept nothing"):
        y.backward(dy)


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


def single_rank(x, ids, p, w13, w2, dy, recompute):
    """(y, dx, dp, dw13, dw2) of moefuse.experts (no comm) with autograd."""
    x, p, w13, w2 = _leaves(x, p, w13, w2)
    y = moefuse.experts(x, ids.cuda(), p, w13, w2, recompute=recompute)
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


@pytest.mark.parametrize("pipeline", list(_lib.Pipeline), ids=lambda p: p.name)
def test_two_virtual_ranks_match_one_rank(pipeline):
    """Two ranks in this process (a virtual comm), each with its own stream and tokens
    (uneven T), against moefuse.experts on the concatenated batch (staged): y, dx, dp per
    rank and each rank's shard of dW13, dW2, bitwise, with the ranks' forward staged or
    fused. Both modules are made (their layers
    created) before the first call, and every rank's call is launched before any is
    waited for. The caching allocator is filled on each stream first: a cudaMalloc
    between two ranks' launches could serialize them (they wait on each other), which
    would end in MOEFUSE_ERR_TIMEOUT, not a hang."""
    reason = _cuda_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    R, tokens = 2, (70, 45)
    x, ids, p, w13, w2, dy = random_problem(sum(tokens), 256, 128, 16, 4, seed=21,
                                            drop_fraction=0.1)
    ref = single_rank(x, ids, p, w13, w2, dy, recompute=False)
    comm = distributed.virtual_comm(R, timeout_ms=20000)
    streams = [torch.cuda.Stream() for _ in range(R)]
    try:
        mods = [ExpertParallelExperts(256, 128, 16, 4, max(tokens), comm, r, R, device="cuda",
                                      pipeline=pipeline)
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


# ---- bench/bench_ep.py's options (CPU: parsed before any GPU or process group) ---------------


def _bench_ep():
    import importlib
    import pathlib
    import sys
    bench = pathlib.Path(__file__).resolve().parents[2] / "bench"
    if str(bench) not in sys.path:
        sys.path.insert(0, str(bench))
    return importlib.import_module("bench_ep")


def test_bench_ep_test_modes_are_its_own_options():
    bench_ep = _bench_ep()
    args, rest = bench_ep.split_args(["--check", "--check-r1", "--iterations", "7",
                                      "--timeout-test", "--tokens", "8", "--bench"])
    assert args.check_r1 and args.iterations == 7 and args.timeout_test and args.bench
    assert rest == ["--check", "--tokens", "8"]  # the baseline's parser takes these
    # No abbreviations: --check is the baseline's, never a prefix of --check-r1.
    args, rest = bench_ep.split_args(["--check"])
    assert not args.check_r1 and args.iterations is None and rest == ["--check"]


@pytest.mark.parametrize("argv, message", [
    (["--iterations", "0"], "must be >= 1"),
    (["--iterations", "x"], "invalid _positive value"),
    (["--timeout-ms", "0"], "must be >= 1"),
])
def test_bench_ep_refuses_bad_values(argv, message, capsys):
    bench_ep = _bench_ep()
    with pytest.raises(SystemExit) as info:
        bench_ep.split_args(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, check, bench", [
    ([], False, True), ([], True, False), (["--check-r1"], False, False),
    (["--iterations", "3"], False, False), (["--timeout-test"], False, False),
    (["--check-r1", "--bench"], True, True),
])
def test_bench_ep_benches_by_default_only(argv, check, bench):
    bench_ep = _bench_ep()
    assert bench_ep.bench_wanted(bench_ep.split_args(argv)[0], check) is bench


def test_bench_ep_check_iterations():
    bench_ep = _bench_ep()
    assert bench_ep.check_iterations(1000) == [0, 1, 500, 999]
    assert bench_ep.check_iterations(1) == [0]
    assert bench_ep.check_iterations(2) == [0, 1]
    assert bench_ep.check_iterations(3) == [0, 1, 2]


def test_bench_ep_memory_estimate_follows_the_cuda_layout():
    """Workspace bytes per token (K slot rows) as src/cuda/pipeline/workspace.cu states them."""
    bench_ep = _bench_ep()
    assert 8 * bench_ep.slot_row_bytes(2048, 768) == 102_624
    assert 8 * bench_ep.slot_row_bytes(4096, 1536) == 205_216
    assert 8 * (bench_ep.slot_row_bytes(2048, 768, recompute=True)
                - bench_ep.slot_row_bytes(2048, 768)) == 24_576
    small = bench_ep.one_rank_bytes(16384 * 8, 2048, 768, 128, 8)
    large = bench_ep.one_rank_bytes(16384 * 8, 4096, 1536, 128, 8)
    assert 10 << 30 < small < large < 80 << 30


def test_bench_ep_help_and_skip_without_a_gpu():
    import pathlib
    import subprocess
    import sys
    script = pathlib.Path(__file__).resolve().parents[2] / "bench" / "bench_ep.py"
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0
    for flag in ("--check-r1", "--iterations N", "--timeout-test", "--bench"):
        assert flag in out.stdout
    bad = subprocess.run([sys.executable, str(script), "--iterations", "0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--iterations" in bad.stderr
    if torch.cuda.is_available():
        return  # with a GPU the script runs for real; the SKIP below is the CPU path
    out = subprocess.run([sys.executable, str(script), "--check-r1", "--iterations", "3",
                          "--timeout-test"], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, NCCL_NVLS_ENABLE="0"))
    assert out.returncode == 0 and out.stdout.startswith("SKIP bench_ep: no CUDA device")
