"""moefuse.distributed: expert parallelism from PyTorch, on the CPU (runs in CI).

load_local_experts' sharding, ExpertParallelExperts' argument checks, which raise before
the library is touched, and the module's autograd function driving a one-rank CPU layer
(its args structs, saved buffer and gradients), bitwise equal to moefuse.experts, with W13
packed or in two halves (bf16 and FP8, the FP8 weights quantized from the halves and
cached until one is updated).

The comms are tested in test_distributed_comms.py, the GPU paths in
test_distributed_gpu.py, bench/bench_ep.py's options in test_bench_ep.py.
"""

from __future__ import annotations

import pytest
import torch

import moefuse
from moefuse import _lib, distributed
from moefuse.distributed import load_local_experts

from fp8_reference import spy_weight_quantizations
from moe_reference import random_problem
from distributed_helpers import (E, H, I, K, assert_bitwise, make_module, modules_on_cpu_layers,
                                 stand_in_comm)

pytestmark = pytest.mark.usefixtures("library")


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
    (dict(recv_capacity_factor=0.5), ValueError, "recv_capacity_factor must be 0"),
    (dict(recv_capacity_factor="2"), TypeError, "recv_capacity_factor must be a number"),
])
def test_module_refuses_bad_config(overrides, error, message):
    if callable(overrides.get("comm")):
        overrides = dict(overrides, comm=overrides["comm"]())
    with pytest.raises(error, match=message):
        make_module(**overrides)


def test_memory_estimate_of_qwen3_30b_at_r8():
    """The library's arithmetic (no GPU): qwen3-30b-a3b, R = 8, T = 16384, capacity 2x the
    balanced T * K rows, each of the 16 local experts padded to 128 rows."""
    m = moefuse.memory_estimate(2048, 768, 128, 8, 16384, 8)
    rows = (2 * 16384 * 8 + 16 * 127 + 127) // 128 * 128
    assert m["version"] == _lib.MEMORY_VERSION and m["shared_layers"] == 1
    assert (m["recv_capacity_rows"], m["rows_cap"]) == (2 * 16384 * 8, rows)
    assert m["comm_window_bytes"] == m["layer_window_bytes"] == 2_703_794_496
    assert m["saved_bytes"] == 812_131_328  # gate_up [rows, 2I] bf16 and the plan
    assert m["comm_scratch_bytes"] == rows * (768 * 2 + 2 * 768 * 2 + 3 * 4)
    worst = moefuse.memory_estimate(2048, 768, 128, 8, 16384, 8, recv_capacity_factor=8)
    assert worst["recv_capacity_rows"] == 8 * 16384 * 8
    assert worst["saved_bytes"] > 3.9 * m["saved_bytes"]
    with pytest.raises(moefuse.MoefuseError, match="recv_capacity_factor"):
        moefuse.memory_estimate(2048, 768, 128, 8, 16384, 8, recv_capacity_factor=0.5)
    # FP8: its operands' codes and scales join the comm's scratch (shared by the layers),
    # and d p's partials there are per 128 columns of I (FP8's dgrad2 tile), 6 against 3
    f8 = moefuse.memory_estimate(2048, 768, 128, 8, 16384, 8, precision="fp8")
    fp8_row = (2048 + 2048 * 4 // 128 + 2048 + 2048 * 4 // 128 + 2048 + 2048 * 4 // 128
               + (6 - 3) * 4)
    assert f8["comm_scratch_bytes"] - m["comm_scratch_bytes"] == rows * fp8_row
    assert (f8["workspace_bytes"], f8["saved_bytes"]) == (m["workspace_bytes"],
                                                          m["saved_bytes"])


def test_module_takes_the_capacity_and_reports_no_memory_before_its_layer():
    m = make_module(recv_capacity_factor=1.5)
    assert m.recv_capacity_factor == 1.5 and m.memory() is None


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
    def make(saved_mode=_lib.SavedMode.SAVE_ACTIVATIONS, precision=_lib.Precision.BF16):
        cfg = _lib.config_init(64, 32, 8, 2, 64)
        cfg.saved_mode = saved_mode
        cfg.precision = precision
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


# ---- W13 in two halves -------------------------------------------------------------------------


def _halves_run(layer, problem, w13, w2, halves):
    """(y, dx, dp, dW13, dW2) of _ExpertParallelFn on `layer`, W13 packed or as its two
    halves (then dW13 the halves' gradients joined, and each half's gradient checked to be
    in its own tensor of the half's shape)."""
    x, ids, p, _, _, dy = problem
    inter = w13.shape[1] // 2
    xs, ps, w2s = _fn_leaves(x, p, w2)
    if halves:
        ws = _fn_leaves(w13[:, :inter], w13[:, inter:])
        y = distributed._ExpertParallelFn.apply(xs, ids, ps, ws[0], w2s, layer, True, ws[1])
    else:
        ws = _fn_leaves(w13)
        y = distributed._ExpertParallelFn.apply(xs, ids, ps, ws[0], w2s, layer, True)
    y.backward(dy)
    for w in ws:
        assert w.grad.shape == w.shape and w.grad.dtype == w.dtype
    return y.detach(), xs.grad, ps.grad, torch.cat([w.grad for w in ws], dim=1), w2s.grad


@pytest.mark.parametrize("precision", [_lib.Precision.BF16, _lib.Precision.FP8_BLOCK],
                         ids=["bf16", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("saved_mode", [_lib.SavedMode.SAVE_ACTIVATIONS,
                                        _lib.SavedMode.RECOMPUTE], ids=lambda m: m.name)
def test_function_w13_halves_give_the_packed_bits(cpu_layer, precision, dtype, saved_mode,
                                                  monkeypatch):
    """W13 as (gate, up), read where they are (FP8: quantized from the halves by
    moefuse_quantize_weights_halves), gives the packed W13's y, dx, d p and dW2, and each
    half the matching half of its dW13, bit for bit; bf16 and fp32 master weights."""
    problem = random_problem(37, 64, 32, 8, 2, seed=11, drop_fraction=0.2)
    w13, w2 = problem[3], problem[4]
    if dtype == torch.float32:  # values between bf16s, so a rounding to bf16 would show
        w13, w2 = w13.float() * (1 + 2.0 ** -12), w2.float() * (1 - 2.0 ** -13)
    quantized = spy_weight_quantizations(monkeypatch)
    layer = cpu_layer(saved_mode, precision)
    packed = _halves_run(layer, problem, w13, w2, halves=False)
    halves = _halves_run(layer, problem, w13, w2, halves=True)
    assert_bitwise(halves, packed)
    if precision == _lib.Precision.FP8_BLOCK:
        halves_read = [q.halves for q in quantized]
        assert halves_read == [False, True], halves_read  # each quantized once, as it is
    else:
        assert quantized == []


def test_function_w13_halves_with_zero_tokens(cpu_layer):
    """T = 0 (a rank with no tokens still runs its backward): each half gets a zero
    gradient of its own shape."""
    gate, up = (torch.randn(8, 32, 64, requires_grad=True) for _ in range(2))
    w2 = torch.randn(8, 64, 32, requires_grad=True)
    x = torch.zeros(0, 64, dtype=torch.bfloat16, requires_grad=True)
    y = distributed._ExpertParallelFn.apply(x, torch.zeros(0, 2, dtype=torch.int32),
                                            torch.zeros(0, 2), gate, w2, cpu_layer(), True, up)
    y.float().sum().backward()
    for w in (gate, up, w2):
        assert w.grad.shape == w.shape and w.grad.dtype == torch.float32
        assert not w.grad.any()


@pytest.mark.parametrize("half", ["gate", "up"])
def test_fp8_halves_requantized_when_a_half_is_updated(cpu_layer, half, quantize_calls):
    """The FP8 weights of (gate, up, w2) are made once for a forward and its backward and
    reused by the next call; an in-place update of either half (its version counter) makes
    the next call quantize again, and that call gives the bits of fresh tensors holding
    the new values."""
    layer = cpu_layer(precision=_lib.Precision.FP8_BLOCK)
    x, ids, p, w13, w2, dy = random_problem(37, 64, 32, 8, 2, seed=13, drop_fraction=0.1)
    gate, up, w2 = _fn_leaves(w13[:, :32], w13[:, 32:], w2)

    def run(g, u, w):
        return distributed._ExpertParallelFn.apply(x, ids, p, g, w, layer, True, u)
    run(gate, up, w2).backward(dy)
    run(gate, up, w2).backward(dy)
    assert len(quantize_calls) == 1  # one quantization for both calls and their backwards
    with torch.no_grad():
        (gate if half == "gate" else up).mul_(0.5)
        y_after = run(gate, up, w2)
    assert len(quantize_calls) == 2
    fresh = [t.detach().clone() for t in (gate, up, w2)]
    with torch.no_grad():
        assert torch.equal(y_after, run(*fresh))
    assert len(quantize_calls) == 3
    with torch.no_grad():
        run(gate, up, w2)  # no update since: reused
    assert len(quantize_calls) == 3


# ---- ExpertParallelExperts: the weights given per call ------------------------------------------


@pytest.fixture
def module_on_a_cpu_layer(monkeypatch):
    """A one-rank module whose layer is a one-rank CPU layer and whose check that x is on
    CUDA is skipped (as test_torchtitan_ep.py does), so its forward's weight arguments run
    here; the weights' own checks still run."""
    layers = modules_on_cpu_layers(monkeypatch)

    def make(**overrides):
        torch.manual_seed(3)
        return make_module(comm=stand_in_comm(1), rank=0, num_ranks=1, max_tokens=64,
                           **overrides)
    yield make
    for layer in layers:
        layer.close()


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_module_forward_takes_w13_halves(module_on_a_cpu_layer, precision):
    """forward(x, ids, p, w13=(gate, up), w2=w2) gives the bits of the module's own
    gate_up_proj and down_proj holding the same values; each half's gradient is its half of
    gate_up_proj's."""
    m = module_on_a_cpu_layer(precision=precision)
    x, ids, p, _, _, dy = random_problem(40, H, I, E, K, seed=17, drop_fraction=0.1)
    got, want = [], []
    for results, halves in ((want, False), (got, True)):
        xs, ps = _fn_leaves(x, p)
        if halves:
            ws = _fn_leaves(*(w.detach() for w in (m.gate_up_proj[:, :I], m.gate_up_proj[:, I:],
                                                          m.down_proj)))
            y = m(xs, ids, ps, w13=(ws[0], ws[1]), w2=ws[2])
        else:
            m.zero_grad()
            y = m(xs, ids, ps)
        y.backward(dy)
        grads = ([torch.cat([ws[0].grad, ws[1].grad], dim=1), ws[2].grad] if halves else
                 [m.gate_up_proj.grad, m.down_proj.grad])
        results.extend([y.detach(), xs.grad, ps.grad] + grads)
    assert_bitwise(got, want)
    # a packed w13 given per call is the parameter's form
    xs = x.clone().requires_grad_()
    y = m(xs, ids, p, w13=m.gate_up_proj.detach().clone(), w2=m.down_proj.detach().clone())
    assert torch.equal(y, want[0])


def test_module_forward_refuses_bad_weights(module_on_a_cpu_layer):
    m = module_on_a_cpu_layer()
    x, ids, p = _inputs(k=K)
    gate = torch.zeros(E, I, H, dtype=torch.bfloat16)
    w2 = torch.zeros(E, H, I, dtype=torch.bfloat16)
    cases = [
        (dict(w13=(gate, gate, gate)), ValueError, "w13 as halves must be \\(gate, up\\), got 3"),
        (dict(w13=(gate, "up")), TypeError, "w13\\[1\\] \\(up\\) must be a torch.Tensor"),
        (dict(w13=(gate, gate.float())), TypeError, "w13's halves must share a dtype"),
        (dict(w13=(gate, gate[:, :64])), ValueError,
         "w13\\[1\\] \\(up\\) must be \\[8, 128, 128\\] \\(this rank's experts\\)"),
        (dict(w13=gate), ValueError, "w13 must be \\[8, 256, 128\\]"),
        (dict(w13=(gate, gate.half())), TypeError, "w13\\[1\\] \\(up\\) must be bfloat16"),
        (dict(w13=(gate, gate.transpose(1, 2))), ValueError,
         "w13\\[1\\] \\(up\\) must be contiguous"),
        (dict(w13=(gate, gate), w2=w2[:, :, :64]), ValueError, "w2 must be \\[8, 128, 128\\]"),
        (dict(w13=(gate, gate.to("meta"))), ValueError,
         "w13\\[1\\] \\(up\\) is on meta but x is on cpu"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            m(x, ids, p, **kwargs)
    assert m._layer is None  # refused before the library
