"""bench/torch_moe_fp8_baseline.py on the CPU: the FP8 peer's quantizers against a plain
fp32 computation of torchao's rule, the routing plan's padding, the operands it hands
torch._scaled_grouped_mm (layouts checked by the op's own meta function), and the layer
through the fp32 emulation of the GEMM against the fp64 reference."""

from __future__ import annotations

import math

import pytest
import torch

from bench_helpers import import_bench
from moe_reference import experts_reference_grads, rel_error

peer = import_bench("torch_moe_fp8_baseline")
baseline = import_bench("torch_moe_baseline")
E4M3 = torch.float8_e4m3fn


def _multiplier(amax: float) -> float:
    """torchao's rule: fp32(448 / max(amax, 1e-12)) rounded down to a power of two."""
    s = float(torch.tensor(448.0 / max(amax, 1e-12), dtype=torch.float32))
    return 2.0 ** math.floor(math.log2(s))


def _codes(v: torch.Tensor, mult: float) -> torch.Tensor:
    return (v.float() * mult).clamp(-448.0, 448.0).to(E4M3)


def _rows(g: torch.Generator) -> torch.Tensor:
    x = torch.randn(9, 48, generator=g)
    x[1] *= 1e-3
    x[2] = 0.0
    x[3, 5] = 300.0  # an outlier sets its row's scale
    return x.bfloat16()


def test_quantize_rows_matches_fp32_rule():
    x = _rows(torch.Generator().manual_seed(1))
    q, scale = peer.quantize_rows(x)
    assert q.dtype == E4M3 and q.is_contiguous() and scale.shape == (9,)
    for r in range(x.shape[0]):
        mult = _multiplier(x[r].float().abs().max().item())
        assert scale[r].item() == 1.0 / mult, r
        assert torch.equal(q[r].float(), _codes(x[r], mult).float()), r
    # E4M3 keeps 4 significant bits: at most 2^-4 relative error above the subnormals
    deq, xf = q.float() * scale[:, None], x.float()
    normal = xf.abs() * (1.0 / scale[:, None]) >= 2.0 ** -6
    assert ((deq - xf).abs() <= 2.0 ** -4 * xf.abs())[normal].all()


def test_quantize_rows_of_transposed_weights_is_contiguous():
    w = torch.randn(3, 16, 32, dtype=torch.bfloat16)
    q, scale = peer.quantize_rows(w.transpose(-2, -1))  # along the 16: a scale per (g, k)
    assert q.shape == (3, 32, 16) and q.is_contiguous() and scale.shape == (3, 32)
    mult = _multiplier(w[1, :, 7].float().abs().max().item())
    assert torch.equal(q[1, 7].float(), _codes(w[1, :, 7], mult).float())


def test_quantize_columns_per_group_matches_fp32_rule():
    g = torch.Generator().manual_seed(2)
    M, n = 96, 24
    offs = torch.tensor([16, 16, 48, 80], dtype=torch.int32)  # group 1 empty, 80.. in none
    x = torch.randn(M, n, generator=g)
    x[16:32, 3] *= 50.0
    x[80:] = math.nan  # rows outside the groups must not reach a scale
    x = x.bfloat16()
    q, scale = peer.quantize_columns_per_group(x, offs)
    assert q.dtype == E4M3 and q.shape == (M, n) and q.stride() == (1, M)  # column-major
    assert scale.shape == (4 * n,) and torch.isfinite(scale).all()
    start = 0
    for grp, end in enumerate(offs.tolist()):
        for c in range(n):
            col = x[start:end, c]
            mult = _multiplier(col.float().abs().max().item() if end > start else 0.0)
            assert scale[grp * n + c].item() == 1.0 / mult, (grp, c)
            assert torch.equal(q[start:end, c].float(), _codes(col, mult).float()), (grp, c)
        start = end


def test_plan_pads_every_expert_to_16_rows():
    ids = torch.tensor([[0, 2], [2, -1], [0, 3], [3, 2]], dtype=torch.int32)  # expert 1 empty
    row, valid, offs, rows_cap = baseline._expert_rows(ids, 4)
    assert offs.tolist() == [16, 16, 32, 48]
    assert rows_cap % 16 == 0 and rows_cap >= 48
    assert valid.tolist() == [True, True, True, False, True, True, True, True]
    # each expert's slots in slot order from its group's first row
    assert row[valid].tolist() == [0, 16, 17, 1, 32, 33, 18]


def _meta_checked(calls):
    """A stand-in GEMM: torch._scaled_grouped_mm's meta function checks the operands'
    dtypes, layouts and scale shapes; the fp32 emulation computes."""
    def gemm(a, b, scale_a, scale_b, offs):
        meta = torch._scaled_grouped_mm(
            a.to("meta"), b.to("meta"), scale_a.to("meta"), scale_b.to("meta"),
            offs=offs.to("meta"), out_dtype=torch.bfloat16, use_fast_accum=True)
        out = peer.emulated_scaled_grouped_mm(a, b, scale_a, scale_b, offs)
        assert meta.shape == out.shape
        calls.append((a.dim(), b.dim()))
        return out
    return gemm


def test_layer_operands_and_error_against_fp64():
    x, ids, p, w13, w2, dy = baseline.make_problem(48, 64, 32, 6, 2, device="cpu", seed=3)
    ids[5, 1] = -1
    calls = []
    y = peer.experts_fp8(x, ids, p, w13, w2, gemm=_meta_checked(calls))
    got = (y, *torch.autograd.grad(y, (x, p, w13, w2), dy))
    # forward 2 GEMMs; backward per GEMM a dgrad (2d x 3d) and a wgrad (2d x 2d)
    assert sorted(calls) == [(2, 2)] * 2 + [(2, 3)] * 4
    want = experts_reference_grads(x, ids, p, w13, w2, dy)
    # The rule of moe_reference.tolerance with E4M3's 4 significant bits: n roundings of
    # relative error up to 2^-4; y passes 4 (x, W13, a, W2), the gradients 6 (2 more GEMMs).
    for name, g, w, n in zip(("y", "dx", "dp", "dw13", "dw2"), got, want, (4, 6, 6, 6, 6)):
        tol = 2.0 * 2.0 ** -4 * math.sqrt(n / 3.0)
        err = rel_error(g, w)
        assert err <= tol, f"{name}: {err:.3e} > {tol:.3e}"
        assert err > 2.0 ** -8, f"{name}: {err:.3e}, bf16-sized: the operands were not FP8"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for the real GEMM")
def test_real_gemm_matches_emulation_on_cuda():
    device = torch.device("cuda")
    reason = peer.scaled_grouped_mm_reason(device)
    if reason is not None:
        pytest.skip(reason)
    x, ids, p, w13, w2, dy = baseline.make_problem(256, 256, 128, 8, 2, device=device, seed=4)
    outs = []
    for gemm in (None, peer.emulated_scaled_grouped_mm):
        y = peer.experts_fp8(x, ids, p, w13, w2, gemm=gemm)
        outs.append((y, *torch.autograd.grad(y, (x, p, w13, w2), dy)))
    # The GEMMs' bf16 outputs may differ by a rounding (fast accumulation, order); where one
    # is quantized again (act, d[g; u]) a code moves by a step 2^-3 with probability ~ its
    # difference / step: rms sqrt(2 * 2^-3 * 2^-9) per such point (fp8_reference.py's rule),
    # twice that for the bound; y passes 1 such point, the gradients up to 3.
    for name, a, b in zip(("y", "dx", "dp", "dw13", "dw2"), *outs):
        points = 1 if name == "y" else 3
        tol = 2.0 * math.sqrt(points * 2.0 * 2.0 ** -3 * 2.0 ** -9)
        assert rel_error(a, b) <= tol, f"{name}: {rel_error(a, b):.3e} > {tol:.3e}"
