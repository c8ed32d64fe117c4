"""moefuse.experts on CPU tensors (the C library's CPU backend) against the fp64 PyTorch
reference in moe_reference.py (moefuse.route's own tests: test_route_cpu.py).

Why not torch.autograd.gradcheck on moefuse.experts: gradcheck compares analytic
gradients with central finite differences (eps ~1e-6) and needs fp64 inputs to resolve
them. The library computes in bf16 (8 significant bits): a 1e-6 perturbation of a bf16
input is not even representable, and any step large enough to move a bf16 value
(>= 2^-8 relative) makes the finite difference differ from the derivative by far more
than gradcheck's tolerances. So the op's gradients are checked instead against exact
fp64 gradients of the reference at the same bf16 input values, with the tolerance
rule derived from bf16 rounding (moe_reference.py); the reference itself is
gradchecked in fp64.
"""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

import moefuse
from moefuse import _lib, ops

from moe_reference import (assert_close_bf16, experts_reference, experts_reference_grads,
                           random_problem)

REPO = pathlib.Path(__file__).resolve().parents[2]
HEADER = REPO / "include" / "moefuse.h"


pytestmark = pytest.mark.usefixtures("library")


def run_op(x, ids, p, w13, w2, dy, recompute=False, save_inputs=True):
    """(y, dx, dp, dw13, dw2) from the op with autograd."""
    x, p, w13, w2 = (t.detach().clone().requires_grad_() for t in (x, p, w13, w2))
    y = moefuse.experts(x, ids, p, w13, w2, recompute=recompute, save_inputs=save_inputs)
    y.backward(dy)
    return y.detach(), x.grad, p.grad, w13.grad, w2.grad


# ---- the binding -------------------------------------------------------------------------


def test_version_matches_binding_and_header():
    assert moefuse.version() // 100 == _lib.EXPECTED_VERSION // 100
    if HEADER.is_file():
        text = HEADER.read_text()
        parts = [int(re.search(rf"#define MOEFUSE_VERSION_{n}\s+(\d+)", text).group(1))
                 for n in ("MAJOR", "MINOR", "PATCH")]
        assert parts[0] * 10000 + parts[1] * 100 + parts[2] == _lib.EXPECTED_VERSION


def test_library_is_looked_for_in_both_build_directories(monkeypatch):
    """make builds into build/ with CUDA and build/cpu/ without (NVCC=none)."""
    monkeypatch.delenv("MOEFUSE_LIB", raising=False)
    repo = pathlib.Path(_lib.__file__).resolve().parent.parent.parent
    paths = _lib.candidate_paths()
    assert paths[:2] == [repo / "build" / "libmoefuse.so", repo / "build" / "cpu" / "libmoefuse.so"]


def header_struct_fields(text: str, name: str) -> list[str]:
    body = re.search(rf"typedef struct {name} \{{(.*?)\}} {name};", text, re.S).group(1)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    return [re.search(r"(\w+)\s*$", decl).group(1) for decl in body.split(";")[:-1]]


@pytest.mark.parametrize("c_name, mirror", [
    ("moefuse_config", _lib.Config), ("moefuse_fwd_args", _lib.FwdArgs),
    ("moefuse_bwd_args", _lib.BwdArgs), ("moefuse_route_args", _lib.RouteArgs),
    ("moefuse_route_bwd_args", _lib.RouteBwdArgs), ("moefuse_fp8_weights", _lib.Fp8Weights),
    ("moefuse_memory", _lib.Memory)])
def test_struct_mirrors_follow_header(c_name, mirror):
    """The ctypes mirrors name the header's fields in the header's order."""
    if not HEADER.is_file():
        pytest.skip(f"{HEADER} not present (installed package without the checkout)")
    assert [f[0] for f in mirror._fields_] == header_struct_fields(HEADER.read_text(), c_name)


def test_config_init_defaults():
    cfg = _lib.config_init(64, 32, 8, 2, 128)
    assert (cfg.hidden, cfg.intermediate, cfg.num_experts, cfg.top_k, cfg.max_tokens) == (64, 32, 8, 2, 128)
    assert (cfg.num_ranks, cfg.rank, cfg.backend, cfg.precision, cfg.saved_mode) == (1, 0, 0, 0, 0)


def test_error_carries_status_and_message():
    cfg = _lib.config_init(0, 32, 8, 2, 128)
    with pytest.raises(moefuse.MoefuseError) as info:
        _lib.Layer(cfg)
    err = info.value
    assert err.status == _lib.Status.ERR_INVALID_CONFIG
    assert err.status_name == "MOEFUSE_ERR_INVALID_CONFIG"
    assert "hidden" in err.message
    assert isinstance(err, RuntimeError)
    assert _lib.status_string(_lib.Status.ERR_SHAPE) == "MOEFUSE_ERR_SHAPE"


def test_layer_cache_and_saved_bytes():
    n = moefuse.saved_bytes(100, 64, 32, 8, 2)
    n_recompute = moefuse.saved_bytes(100, 64, 32, 8, 2, recompute=True)
    assert n > 0 and n_recompute < n  # recompute keeps the plan, not [g; u]
    # The CPU backend keeps no input rows: save_inputs changes nothing there.
    assert moefuse.saved_bytes(100, 64, 32, 8, 2, save_inputs=False) == n
    assert ops.token_bucket(100) == 128 and ops.token_bucket(1) == 64
    mode = int(_lib.SavedMode.SAVE_ACTIVATIONS_AND_INPUTS)
    assert ops.saved_mode_for(False, True) == mode
    layer = ops.layer_cache.get(64, 32, 8, 2, 100, torch.device("cpu"), mode)
    assert layer is ops.layer_cache.get(64, 32, 8, 2, 128, torch.device("cpu"), mode)
    assert layer.cfg.max_tokens == 128 and layer.cfg.saved_mode == mode
    x, ids, p, w13, w2, _ = random_problem(100, 64, 32, 8, 2)
    y, saved = torch.ops.moefuse.experts_fwd(x, ids, p, w13, w2, True, mode)
    assert saved.dtype == torch.uint8 and saved.numel() == n
    assert saved.data_ptr() % 256 == 0


def test_backward_refuses_a_truncated_saved_buffer():
    """The op passes the saved tensor's size; the library refuses a short one before
    reading it (it would read past its end)."""
    mode = int(_lib.SavedMode.SAVE_ACTIVATIONS)
    x, ids, p, w13, w2, _ = random_problem(20, 64, 32, 8, 2)
    _, saved = torch.ops.moefuse.experts_fwd(x, ids, p, w13, w2, True, mode)
    n = saved.numel()
    with pytest.raises(moefuse.MoefuseError) as info:
        torch.ops.moefuse.experts_bwd(torch.ones_like(x), x, ids, p, w13, w2, saved[:n - 1], mode)
    assert info.value.status == _lib.Status.ERR_SHAPE
    assert f"bwd_args.saved_bytes = {n - 1}: expected >= {n}" in info.value.message


def test_pipeline_from_env(monkeypatch):
    monkeypatch.delenv("MOEFUSE_PIPELINE", raising=False)
    assert ops.pipeline_from_env() == _lib.Pipeline.STAGED == 0
    monkeypatch.setenv("MOEFUSE_PIPELINE", "Fused")
    assert ops.pipeline_from_env() == _lib.Pipeline.FUSED
    layer = ops.layer_cache.get(64, 32, 8, 2, 100, torch.device("cpu"),
                                _lib.SavedMode.SAVE_ACTIVATIONS)
    assert layer.cfg.pipeline == _lib.Pipeline.FUSED  # the CPU backend takes and ignores it
    monkeypatch.setenv("MOEFUSE_PIPELINE", "fastest")
    with pytest.raises(ValueError, match="MOEFUSE_PIPELINE='fastest'.*staged, fused"):
        ops.pipeline_from_env()


# ---- forward and backward against the fp64 reference ------------------------------------

SHAPES = [
    # T, H, I, E, K
    (64, 128, 64, 8, 2),
    (200, 256, 96, 16, 4),  # I not a power of two
    (1, 64, 32, 8, 8),      # T = 1, K = E
    (37, 64, 48, 128, 8),   # E = 128 like Qwen3, most experts empty
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("recompute", [False, True])
def test_forward_backward_match_reference(shape, recompute):
    x, ids, p, w13, w2, dy = random_problem(*shape, seed=1)
    got = run_op(x, ids, p, w13, w2, dy, recompute=recompute)
    ref = experts_reference_grads(x, ids, p, w13, w2, dy)
    for name, g, r in zip(("y", "dx", "dp", "dw13", "dw2"), got, ref):
        assert_close_bf16(g, r, name)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.bfloat16
    assert got[2].dtype == torch.float32
    assert got[3].dtype == torch.bfloat16 and got[4].dtype == torch.bfloat16  # param dtype


@pytest.mark.parametrize("skew, drop", [("one_expert", 0.0), ("zipf", 0.0), ("uniform", 0.3),
                                        ("uniform", 1.0)])
def test_routing_edge_cases(skew, drop):
    """All tokens on one expert, Zipf-skewed, dropped slots (-1), every slot dropped."""
    x, ids, p, w13, w2, dy = random_problem(96, 128, 64, 16, 4, seed=2, drop_fraction=drop,
                                            skew=skew)
    got = run_op(x, ids, p, w13, w2, dy)
    ref = experts_reference_grads(x, ids, p, w13, w2, dy)
    if drop == 1.0:
        for name, g in zip(("y", "dx", "dp", "dw13", "dw2"), got):
            assert torch.count_nonzero(g) == 0, f"{name} not zero with every slot dropped"
        return
    for name, g, r in zip(("y", "dx", "dp", "dw13", "dw2"), got, ref):
        assert_close_bf16(g, r, name)
    assert torch.all(got[2][ids < 0] == 0), "dropped slots must get d p = 0"


def test_fp32_master_weights_get_fp32_gradients():
    x, ids, p, w13, w2, dy = random_problem(64, 128, 64, 8, 2, seed=3)
    w13_f, w2_f = w13.float(), w2.float()  # exactly the bf16 values, held in fp32
    y, dx, dp, dw13, dw2 = run_op(x, ids, p, w13_f, w2_f, dy)
    assert dw13.dtype == torch.float32 and dw2.dtype == torch.float32
    ref = experts_reference_grads(x, ids, p, w13, w2, dy)
    for name, g, r in zip(("y", "dx", "dp", "dw13", "dw2"), (y, dx, dp, dw13, dw2), ref):
        assert_close_bf16(g, r, name)
    # Same bf16 compute as with bf16 weights: the weight gradients only skip the
    # final rounding to bf16.
    y_b, _, _, dw13_b, _ = run_op(x, ids, p, w13, w2, dy)
    assert torch.equal(y, y_b)
    assert torch.equal(dw13.to(torch.bfloat16), dw13_b)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def test_bf16_weight_gradients_are_rounded_fp32():
    """bf16 weights get bf16 gradients written by the library (dw13_bf16 / dw2_bf16), no
    cast: bitwise the fp32 gradients of master weights holding the same values, rounded
    to nearest even (torch's fp32 -> bf16 is that rounding). Weights of mixed dtypes get
    fp32 from the library, then a cast: the same bits. The op's fake returns the real
    op's dtypes."""
    x, ids, p, w13, w2, dy = random_problem(200, 256, 96, 16, 4, seed=13, drop_fraction=0.2)
    _, dx_b, dp_b, dw13_b, dw2_b = run_op(x, ids, p, w13, w2, dy)
    _, dx_f, dp_f, dw13_f, dw2_f = run_op(x, ids, p, w13.float(), w2.float(), dy)
    assert dw13_b.dtype == torch.bfloat16 and dw2_b.dtype == torch.bfloat16
    assert dw13_f.dtype == torch.float32 and dw2_f.dtype == torch.float32
    assert torch.equal(_bits(dw13_b), _bits(dw13_f.to(torch.bfloat16)))
    assert torch.equal(_bits(dw2_b), _bits(dw2_f.to(torch.bfloat16)))
    assert torch.equal(dx_b, dx_f) and torch.equal(dp_b, dp_f)
    _, _, _, dw13_m, dw2_m = run_op(x, ids, p, w13, w2.float(), dy)
    assert dw13_m.dtype == torch.bfloat16 and dw2_m.dtype == torch.float32
    assert torch.equal(_bits(dw13_m), _bits(dw13_b)) and torch.equal(dw2_m, dw2_f)

    mode = int(_lib.SavedMode.SAVE_ACTIVATIONS)
    _, saved = torch.ops.moefuse.experts_fwd(x, ids, p, w13, w2, True, mode)
    for a, b, want in ((w13, w2, torch.bfloat16), (w13.float(), w2.float(), torch.float32),
                       (w13, w2.float(), torch.float32)):
        args = (dy, x, ids, p, a, b, saved, mode)
        dw13, dw2 = torch.ops.moefuse.experts_bwd(*args)[2:4]
        assert dw13.dtype == want and dw2.dtype == want
        torch.library.opcheck(torch.ops.moefuse.experts_bwd.default, args,
                              test_utils=("test_faketensor",))


def test_bf16_weight_gradients_zero_tokens():
    """T = 0: zero gradients, in the weights' dtype."""
    _, _, _, w13, w2, _ = random_problem(1, 64, 32, 8, 2)
    x = torch.empty(0, 64, dtype=torch.bfloat16)
    ids, p = torch.empty(0, 2, dtype=torch.int32), torch.empty(0, 2)
    saved = torch.empty(0, dtype=torch.uint8)
    for a, b, want in ((w13, w2, torch.bfloat16), (w13.float(), w2.float(), torch.float32)):
        dw13, dw2 = torch.ops.moefuse.experts_bwd(x, x, ids, p, a, b, saved,
                                                  int(_lib.SavedMode.SAVE_ACTIVATIONS))[2:4]
        assert dw13.dtype == want and dw2.dtype == want
        assert not dw13.any() and not dw2.any()


def test_deterministic():
    problem = random_problem(128, 128, 64, 8, 4, seed=4)
    first, second = run_op(*problem), run_op(*problem)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_recompute_equals_saved_activations():
    """[g; u] recomputed in the backward is the same GEMM as the forward's, so all
    modes give the same gradients, bit for bit."""
    problem = random_problem(64, 128, 64, 8, 2, seed=5)
    for a, b, c in zip(run_op(*problem), run_op(*problem, recompute=True),
                       run_op(*problem, save_inputs=False)):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_two_forwards_before_backward():
    """Gradient accumulation: two forwards in flight, each with its own saved buffer."""
    x1, ids1, p1, w13, w2, dy1 = random_problem(64, 128, 64, 8, 2, seed=6)
    x2, ids2, p2, _, _, dy2 = random_problem(80, 128, 64, 8, 2, seed=7)
    w13_l, w2_l = w13.clone().requires_grad_(), w2.clone().requires_grad_()
    x1_l, x2_l = x1.clone().requires_grad_(), x2.clone().requires_grad_()
    y1 = moefuse.experts(x1_l, ids1, p1, w13_l.float(), w2_l.float())
    y2 = moefuse.experts(x2_l, ids2, p2, w13_l.float(), w2_l.float())
    torch.autograd.backward([y2, y1], [dy2, dy1])
    r1 = experts_reference_grads(x1, ids1, p1, w13, w2, dy1)
    r2 = experts_reference_grads(x2, ids2, p2, w13, w2, dy2)
    assert_close_bf16(x1_l.grad, r1[1], "dx")
    assert_close_bf16(x2_l.grad, r2[1], "dx")
    # Through .float() the accumulated weight gradients stay fp32 until the leaf.
    assert_close_bf16(w13_l.grad, r1[3] + r2[3], "dw13")
    assert_close_bf16(w2_l.grad, r1[4] + r2[4], "dw2")


def test_strided_and_noncontiguous_x():
    x, ids, p, w13, w2, dy = random_problem(64, 128, 64, 8, 2, seed=8)
    y = moefuse.experts(x, ids, p, w13, w2)
    wide = torch.zeros(64, 160, dtype=torch.bfloat16)
    wide[:, 16:144] = x
    y_strided = moefuse.experts(wide[:, 16:144], ids, p, w13, w2)  # row stride 160, no copy
    y_transposed = moefuse.experts(x.T.contiguous().T, ids, p, w13, w2)  # column-major: copied
    assert torch.equal(y, y_strided) and torch.equal(y, y_transposed)


def test_int64_ids_and_no_grad():
    x, ids, p, w13, w2, _ = random_problem(64, 128, 64, 8, 2, seed=9)
    y = moefuse.experts(x, ids, p, w13, w2)
    with torch.no_grad():
        y_nograd = moefuse.experts(x, ids.long(), p, w13, w2)
    assert torch.equal(y, y_nograd)


def test_zero_tokens():
    _, _, _, w13, w2, _ = random_problem(1, 64, 32, 8, 2)
    x = torch.empty(0, 64, dtype=torch.bfloat16, requires_grad=True)
    w13 = w13.clone().requires_grad_()
    y = moefuse.experts(x, torch.empty(0, 2, dtype=torch.int32), torch.empty(0, 2), w13, w2)
    assert y.shape == (0, 64)
    y.sum().backward()
    assert x.grad.shape == (0, 64) and torch.count_nonzero(w13.grad) == 0


# ---- bad inputs -------------------------------------------------------------------------------


def bad_input_cases():
    x, ids, p, w13, w2, _ = random_problem(16, 64, 32, 8, 2)
    return [
        ("x fp32", TypeError, "x must be bfloat16", (x.float(), ids, p, w13, w2)),
        ("p bf16", TypeError, "p must be float32", (x, ids, p.bfloat16(), w13, w2)),
        ("ids float", TypeError, "ids must be int32", (x, ids.float(), p, w13, w2)),
        ("w13 fp16", TypeError, "w13 must be bfloat16", (x, ids, p, w13.half(), w2)),
        ("x 3-D", ValueError, "x must be [T, H]", (x[None], ids, p, w13, w2)),
        ("ids rows", ValueError, "ids must be [T=16, K]", (x, ids[:8], p, w13, w2)),
        ("p shape", ValueError, "p must be [T=16, K=2]", (x, ids, p[:, :1], w13, w2)),
        ("w13 hidden", ValueError, "w13 must be [E, 2I, H=64]", (x, ids, p, w13[:, :, :32], w2)),
        ("w2 shape", ValueError, "w2 must be [E=8, H=64, I=32]", (x, ids, p, w13, w2[:, :, :16])),
        ("w13 non-contiguous", ValueError, "w13 must be contiguous",
         (x, ids, p, w13.transpose(1, 2).contiguous().transpose(1, 2), w2)),
        ("device mismatch", ValueError, "w2 is on meta but x is on cpu",
         (x, ids, p, w13, w2.to("meta"))),
        ("not a tensor", TypeError, "p must be a torch.Tensor", (x, ids, p.tolist(), w13, w2)),
    ]


@pytest.mark.parametrize("case", bad_input_cases(), ids=lambda c: c[0])
def test_bad_inputs_raise_clear_errors(case):
    _, error, message, args = case
    with pytest.raises(error, match=re.escape(message)):
        moefuse.experts(*args)


@pytest.mark.parametrize("bad_id, status, words", [
    (8, _lib.Status.ERR_EXPERT_ID, "ids"),
    (-2, _lib.Status.ERR_EXPERT_ID, "ids"),
    ("dup", _lib.Status.ERR_DUPLICATE_EXPERT, "ids"),
])
def test_bad_expert_ids_raise_moefuse_error(bad_id, status, words):
    x, ids, p, w13, w2, _ = random_problem(16, 64, 32, 8, 2)
    ids = ids.clone()
    if bad_id == "dup":
        ids[5, 1] = ids[5, 0]
    else:
        ids[5, 1] = bad_id
    with pytest.raises(moefuse.MoefuseError) as info:
        moefuse.experts(x, ids, p, w13, w2)
    assert info.value.status == status
    assert words in info.value.message, info.value.message


@pytest.mark.parametrize("bad_id", [2**32 + 7, 2**32 - 1, -2**32 - 1])
def test_int64_ids_outside_int32_raise_instead_of_wrapping(bad_id):
    """Narrowed to int32, 2^32 + 7 would run as expert 7 and 2^32 - 1 as a dropped slot."""
    x, ids, p, w13, w2, _ = random_problem(16, 64, 32, 8, 2)
    ids = ids.to(torch.int64)
    ids[5, 1] = bad_id
    with pytest.raises(ValueError, match=re.escape(f"moefuse.experts: ids[5][1] = {bad_id} is "
                                                   "outside int32")):
        moefuse.experts(x, ids, p, w13, w2)


@pytest.mark.parametrize("bad_id", [2**32 + 7, 2**32 - 1])
def test_int64_ids_outside_int32_fail_under_compile(bad_id):
    """torch.compile cannot branch on the ids' values (fullgraph): there the ids saturate
    to the int32 bounds, which the library rejects as expert ids, instead of wrapping."""
    x, ids, p, w13, w2, _ = random_problem(16, 64, 32, 8, 2)
    ids = ids.to(torch.int64)
    good = torch.compile(moefuse.experts, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(good(x, ids, p, w13, w2), moefuse.experts(x, ids, p, w13, w2),
                               rtol=0, atol=0)
    ids[5, 1] = bad_id
    with pytest.raises(moefuse.MoefuseError) as info:
        good(x, ids, p, w13, w2)
    assert info.value.status == _lib.Status.ERR_EXPERT_ID, info.value.message


# ---- torch.compile and the reference itself ----------------------------------------------------


class TinyMoE(torch.nn.Module):
    """Router (moefuse.route) + experts (moefuse.experts), enough to trace both ops."""

    def __init__(self, w13, w2, top_k):
        super().__init__()
        self.gate = torch.nn.Linear(w13.shape[2], w13.shape[0], bias=False)
        self.w13 = torch.nn.Parameter(w13.clone())
        self.w2 = torch.nn.Parameter(w2.clone())
        self.top_k = top_k

    def forward(self, x):
        ids, p = moefuse.route(self.gate(x.float()), self.top_k)
        return moefuse.experts(x, ids, p, self.w13, self.w2) * 2


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_fullgraph(backend):
    torch._dynamo.reset()
    x, _, _, w13, w2, dy = random_problem(64, 128, 64, 8, 2, seed=10)
    torch.manual_seed(0)
    model = TinyMoE(w13, w2, 2)
    results = []
    for fn in (model, torch.compile(model, fullgraph=True, backend=backend)):
        model.zero_grad()
        xl = x.clone().requires_grad_()
        y = fn(xl)
        y.backward(dy)
        results.append((y.detach(), xl.grad, model.gate.weight.grad, model.w13.grad,
                        model.w2.grad))
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)


def test_reference_gradcheck():
    """The truth is right: gradcheck of the fp64 reference (a few small shapes)."""
    x, ids, p, w13, w2, _ = random_problem(6, 8, 4, 4, 2, seed=11, drop_fraction=0.2)
    args = [t.double().requires_grad_() for t in (x, p, w13, w2)]
    assert torch.autograd.gradcheck(
        lambda x_, p_, a_, b_: experts_reference(x_, ids.long(), p_, a_, b_), args)


def test_cuda_backend():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine: the CUDA backend is tested where one is")
    x, ids, p, w13, w2, dy = random_problem(256, 256, 128, 16, 4, seed=12)
    dev = torch.device("cuda")
    with torch.no_grad():
        y = moefuse.experts(*(t.to(dev) for t in (x, ids, p, w13, w2)))
    moefuse.check_device_errors()
    assert_close_bf16(y.cpu(), experts_reference(x.double(), ids.long(), p.double(),
                                                 w13.double(), w2.double()), "y")


# ---- W13 in two halves ------------------------------------------------------------------------


def _run_halves(x, ids, p, w13, w2, dy, **kw):
    """(y, dx, dp, d gate, d up, dw2) with W13 passed as the pair (gate, up)."""
    I = w13.shape[1] // 2
    gate, up = (w13[:, :I].clone(), w13[:, I:].clone())
    x, p, gate, up, w2 = (t.detach().clone().requires_grad_() for t in (x, p, gate, up, w2))
    y = moefuse.experts(x, ids, p, (gate, up), w2, **kw)
    y.backward(dy)
    return y.detach(), x.grad, p.grad, gate.grad, up.grad, w2.grad


@pytest.mark.parametrize("weights", ["bf16", "fp32"])
@pytest.mark.parametrize("recompute", [False, True])
def test_w13_halves_equal_packed(weights, recompute):
    """experts(x, ids, p, (gate, up), w2): the library reads the two halves where they are;
    y and every gradient are the packed call's bits, the halves' gradients the two halves
    of dW13, in the weights' dtype."""
    x, ids, p, w13, w2, dy = random_problem(150, 64, 96, 8, 3, seed=11)
    if weights == "fp32":
        w13, w2 = w13.float(), w2.float()
    y, dx, dp, dw13, dw2 = run_op(x, ids, p, w13, w2, dy, recompute=recompute)
    hy, hdx, hdp, dgate, dup, hdw2 = _run_halves(x, ids, p, w13, w2, dy, recompute=recompute)
    I = w13.shape[1] // 2
    assert dgate.dtype == w13.dtype and dup.dtype == w13.dtype
    for a, b in ((y, hy), (dx, hdx), (dp, hdp), (dw13[:, :I], dgate), (dw13[:, I:], dup),
                 (dw2, hdw2)):
        assert torch.equal(a, b)


def test_w13_halves_ops_and_errors():
    """The ops' fake implementations take w13_up (the backward's by opcheck; the
    forward's saved buffer is a view at an allocation-dependent offset on the CPU, so its
    fake is compared by shape), and experts() names a wrong pair."""
    x, ids, p, w13, w2, dy = random_problem(20, 64, 32, 8, 2)
    gate, up = w13[:, :32].contiguous(), w13[:, 32:].contiguous()
    mode = int(_lib.SavedMode.SAVE_ACTIVATIONS)
    y, saved = torch.ops.moefuse.experts_fwd(x, ids, p, gate, w2, True, mode, 0, False, up)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode_fake:
        fy, fsaved = torch.ops.moefuse.experts_fwd(
            *(mode_fake.from_tensor(t) for t in (x, ids, p, gate, w2)), True, mode, 0, False,
            mode_fake.from_tensor(up))
    assert fy.shape == y.shape and fsaved.shape == saved.shape
    torch.library.opcheck(torch.ops.moefuse.experts_bwd.default,
                          (dy, x, ids, p, gate, w2, saved, mode, 0, False, up),
                          test_utils=("test_faketensor",))
    with pytest.raises(ValueError, match="halves .gate, up. must both be"):
        moefuse.experts(x, ids, p, (gate, up[:, :16]), w2)
    with pytest.raises(TypeError, match="must share a dtype"):
        moefuse.experts(x, ids, p, (gate, up.float()), w2)
    with pytest.raises(ValueError, match="must be \\(gate, up\\)"):
        moefuse.experts(x, ids, p, (gate, up, up), w2)
