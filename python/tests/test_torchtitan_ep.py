"""moefuse.torchtitan with expert parallelism.

CPU: TorchTitan's EP layout made by shard_experts on a one-rank mesh, apply() with a plan
over a stand-in comm (state_dict unchanged, nothing created on the CPU), what apply()
refuses, and the path to the library and back on a one-rank CPU layer.
GPU (SKIPS without CUDA): two virtual ranks of moefuse's comm in this process, each with
its own copy of a MoE holding its half of the experts (what shard_experts' to_local()
gives each rank), against the same MoE on one rank running the concatenated tokens.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

torchtitan = pytest.importorskip(
    "torchtitan", reason="TorchTitan is not installed (tools/install_deps.sh installs it)")

from torchtitan.models.llama4.infra.parallelize import apply_moe_ep_tp  # noqa: E402
from torchtitan.models.moe import MoE, MoEArgs  # noqa: E402

import moefuse  # noqa: E402
import moefuse.torchtitan as mtt  # noqa: E402
from moefuse import distributed  # noqa: E402

from distributed_helpers import modules_on_cpu_layers, stand_in_comm  # noqa: E402
from fp8_reference import spy_weight_quantizations  # noqa: E402
from moe_reference import random_problem  # noqa: E402
from torchtitan_helpers import BS, SLEN  # noqa: E402

pytestmark = pytest.mark.usefixtures("library", "cpu_histc")


EP_D, EP_F, EP_E, EP_K = 256, 128, 16, 4  # the CUDA backend takes D, F multiples of 128


def ep_moe(num_shared_experts=0, device="cpu") -> MoE:
    torch.manual_seed(9)
    moe = MoE(MoEArgs(num_experts=EP_E, num_shared_experts=num_shared_experts,
                      score_func="softmax", route_norm=True, top_k=EP_K,
                      score_before_experts=False, use_grouped_mm=False),
              dim=EP_D, hidden_dim=EP_F)
    with torch.no_grad():
        moe.init_weights(0.02, torch.device(device))
        moe.expert_bias.copy_(0.01 * torch.randn(EP_E))
    return moe.to(device=device, dtype=torch.bfloat16)


def rank_copy(moe: MoE, rank: int, num_ranks: int) -> MoE:
    """A copy of `moe` whose experts hold rank's E/R experts as plain parameters."""
    m = copy.deepcopy(moe)
    n = m.experts.num_experts // num_ranks
    for name in ("w1", "w2", "w3"):
        w = getattr(m.experts, name).detach()
        m.experts.register_parameter(name, nn.Parameter(w[rank * n:(rank + 1) * n].clone()))
    return m


def test_expert_parallel_on_a_one_rank_ep_mesh(one_rank_gloo_mesh):
    """shard_experts makes TorchTitan's EP layout (w1, w2, w3 DTensors Shard(0) on the EP
    mesh: the global [E, F, D] in state_dict, each rank's E/R experts locally); apply with
    a plan swaps the experts' class and keeps state_dict; the forward needs CUDA; restore
    gives TorchTitan's classes back and closes the layers."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    moe = ep_moe()
    before = {k: v.clone() for k, v in moe.state_dict().items()}
    assert mtt.shard_experts(moe, mesh) == [""]
    for name in ("w1", "w2", "w3"):
        w = getattr(moe.experts, name)
        assert isinstance(w, DTensor) and tuple(w.placements) == (Shard(0),)
        assert torch.equal(w.full_tensor(), before[f"experts.{name}"])
    comm = stand_in_comm(1)
    plan = mtt.ExpertParallelPlan(comms=[comm], rank=0, num_ranks=1, max_tokens=64)
    assert mtt.apply(moe, expert_parallel=plan) == [""]
    assert type(moe).__name__ == "MoefuseMoE" and type(moe.experts).__name__ == "MoefuseExperts"
    after = moe.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(v.full_tensor() if isinstance(v, DTensor) else v, before[k])
               for k, v in after.items())
    assert comm.layers == {}  # no plan.device: nothing made before the first forward
    with pytest.raises(ValueError, match="expert parallelism runs on CUDA tensors"):
        moe(torch.randn(1, 4, EP_D).bfloat16())
    assert mtt.restore(moe) == [""]
    assert type(moe) is MoE and type(moe.experts).__name__ == "GroupedExperts"
    assert "moefuse_ep" not in moe.experts.__dict__
    comm.close()


def test_expert_parallel_refusals(one_rank_gloo_mesh):
    from torch.distributed.device_mesh import init_device_mesh

    def plan(comms=1, rank=0, num_ranks=1):
        return mtt.ExpertParallelPlan(comms=[stand_in_comm(num_ranks)
                                             for _ in range(comms)],
                                      rank=rank, num_ranks=num_ranks, max_tokens=64)

    # TorchTitan's ExpertParallel (all-to-all hooks on the experts) is not moefuse's.
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    moe = ep_moe()
    block = nn.Module()
    block.moe, block.moe_enabled = moe, True
    holder = nn.Module()
    holder.layers = nn.ModuleDict({"0": block})
    apply_moe_ep_tp(holder, tp_mesh=None, ep_mesh=mesh, etp_mesh=None, ep_etp_mesh=None)
    with pytest.raises(ValueError, match="went through parallelize_module"):
        mtt.apply(holder, expert_parallel=plan())
    assert type(moe) is MoE

    cases = [
        (ep_moe(), plan(comms=2), "2 comms for 1 MoE layers"),
        (ep_moe(), plan(rank=1, num_ranks=2), "holds 16 experts on this rank, expected E/R = 16/2"),
        (rank_copy(ep_moe(), 0, 4), plan(num_ranks=2), "holds 4 experts on this rank"),
    ]
    small = MoE(MoEArgs(num_experts=EP_E, top_k=EP_K, score_before_experts=False,
                        use_grouped_mm=False), dim=64, hidden_dim=EP_F)
    cases.append((small, plan(), "hidden=64: the CUDA backend needs a multiple of 128"))
    for model, p, message in cases:
        with pytest.raises(ValueError, match=message):
            mtt.apply(model, expert_parallel=p)
        assert type(model) is MoE and type(model.experts).__name__ == "GroupedExperts"
        for comm in p.comms:
            assert comm.layers == {}
            comm.close()


@pytest.mark.parametrize("fsdp, precision", [(False, "bf16"), (True, "bf16"), (False, "fp8")],
                         ids=["ep", "ep_fsdp", "ep_fp8"])
def test_expert_parallel_path_on_a_cpu_layer(one_rank_gloo_mesh, monkeypatch, fsdp, precision):
    """The expert-parallel path from TorchTitan's DTensor weights (shard_experts, one rank)
    to the library and back, on the CPU: ExpertParallelExperts' layer is a one-rank CPU
    layer here and its check that x is on CUDA is skipped (the CUDA-only parts, run by the
    GPU tests below). Output and gradients equal the swapped MoE without EP bit for bit;
    the experts' gradients arrive as DTensors sharded as their weights. w1 and w3 reach the
    library as W13's two halves (no concatenation), and with fp8 the FP8 weights are
    quantized from them (moefuse_quantize_weights_halves), once for the forward and its
    backward.

    ep_fsdp: FSDP2 as TorchTitan's apply_fsdp wraps an MoE under EP, the experts a unit of
    their own on the 'efsdp' mesh (bf16 parameters, fp32 reduction): its hooks run around
    the experts' __call__, which hands moefuse the DTensors on the 'ep' mesh; the routing
    weights reach moefuse in fp32 although FSDP casts the unit's floating inputs to bf16
    (passed as _Fp32: cast, they changed y by a norm-wise 3e-3)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    layers = modules_on_cpu_layers(monkeypatch)
    w13_ups = []  # the up half each call of the EP function got (None: W13 packed)
    apply_fn = distributed._ExpertParallelFn.apply

    def apply_spy(*args):
        w13_ups.append(args[7] if len(args) > 7 else None)
        return apply_fn(*args)
    monkeypatch.setattr(distributed._ExpertParallelFn, "apply", apply_spy)
    quantized = spy_weight_quantizations(monkeypatch)
    seen = []
    ep_local = mtt._ep_local

    def spy(w, what, ep):
        seen.append((what, type(w).__name__, getattr(w, "placements", None)))
        return ep_local(w, what, ep)
    monkeypatch.setattr(mtt, "_ep_local", spy)

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("efsdp", "ep"))
    one_rank = ep_moe()
    ep = copy.deepcopy(one_rank)
    mtt.apply(one_rank, precision=precision)
    mtt.shard_experts(ep, mesh["ep"])
    comm = stand_in_comm(1)
    plan = mtt.ExpertParallelPlan([comm], rank=0, num_ranks=1, max_tokens=BS * SLEN)
    mtt.apply(ep, precision=precision, expert_parallel=plan)
    if fsdp:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fully_shard(ep.experts, mesh=mesh["efsdp"], mp_policy=mp)
        fully_shard(ep, mesh=mesh["efsdp"], mp_policy=mp)
        assert ep.experts.w1.device_mesh.mesh_dim_names == ("efsdp", "ep")
    seen.clear()
    g = torch.Generator().manual_seed(12)
    x = torch.randn(BS, SLEN, EP_D, generator=g).bfloat16()
    dy = torch.randn(BS, SLEN, EP_D, generator=g).bfloat16()
    results = []
    for m in (one_rank, ep):
        xi = x.clone().requires_grad_()
        y = m(xi)
        y.backward(dy)
        results.append({"y": y.detach(), "dx": xi.grad,
                        **{n: p.grad for n, p in m.named_parameters()}})
    assert len(layers) == 1  # the EP path ran the library through ExpertParallelExperts
    # w3's local tensor as the up half, as it is: no concatenation, no copy
    assert len(w13_ups) == 1 and w13_ups[0] is not None
    assert w13_ups[0].shape == (EP_E, EP_F, EP_D)
    if precision == "fp8":
        # one rank's weights, then the EP path's (a deepcopy), each quantized once from
        # its halves for its forward and backward
        halves_read = [q.halves for q in quantized]
        assert halves_read == [True, True], halves_read
    else:
        assert quantized == []
    # inside the forward moefuse sees each weight on the 'ep' mesh, sharded on the experts
    assert [(t, p) for _, t, p in seen] == [("DTensor", (Shard(0),))] * 3, seen
    want, got = results
    assert got.keys() == want.keys()
    for name in want:
        g_ = got[name]
        if isinstance(g_, DTensor):
            assert name.startswith("experts.") or fsdp, name
            g_ = g_.full_tensor()
        _equal_bits(name, g_, want[name])
    assert torch.equal(ep.tokens_per_expert, one_rank.tokens_per_expert)
    if fsdp:
        other = ep_moe()
        mtt.shard_experts(other, mesh["ep"])
        fully_shard(other.experts, mesh=mesh["efsdp"])
        with pytest.raises(ValueError, match="after shard_experts and before fully_shard"):
            mtt.apply(other, expert_parallel=mtt.ExpertParallelPlan(
                [stand_in_comm(1)], rank=0, num_ranks=1, max_tokens=BS * SLEN))
    mtt.restore(ep)
    assert all(layer.closed for layer in layers)
    comm.close()


def _cuda_skip_reason():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        return "no CUDA device (torch.cuda.is_available() is False or no device visible)"
    return None


def test_fp8_with_expert_parallel():
    """apply(precision="fp8", expert_parallel=...): the ranks' modules run in FP8. No GPU
    needed: nothing is made before the first forward."""
    moe = rank_copy(ep_moe(), 0, 1)
    comm = stand_in_comm(1)
    plan = mtt.ExpertParallelPlan(comms=[comm], rank=0, num_ranks=1, max_tokens=64)
    assert mtt.apply(moe, precision="fp8", expert_parallel=plan) == [""]
    assert moe.experts.moefuse_ep.precision == "fp8"
    assert mtt.restore(moe) == [""]
    comm.close()

def _virtual_rank_moes(moe, num_ranks, max_tokens, comm):
    """Each rank's copy of `moe` with its experts, swapped with a plan over `comm` and its
    layer made on CUDA now (virtual ranks make every layer before the first forward)."""
    moes = []
    for r in range(num_ranks):
        m = rank_copy(moe, r, num_ranks)
        mtt.apply(m, expert_parallel=mtt.ExpertParallelPlan(
            comms=[comm], rank=r, num_ranks=num_ranks, max_tokens=max_tokens, device="cuda"))
        moes.append(m)
    return moes


def _warm_streams(streams):
    """Fills the caching allocator on each rank's stream first: a cudaMalloc between two
    ranks' launches could serialize them (they wait on each other), as in
    test_distributed_gpu.py. Both of its pools: blocks over 1 MB (one 256 MB segment) and
    the small ones (64 blocks of up to 1 MB, 2 MB segments)."""
    for s in streams:
        with torch.cuda.stream(s):
            warm = [torch.empty(256 << 20, dtype=torch.uint8, device="cuda")]
            warm += [torch.empty(1 << 20, dtype=torch.uint8, device="cuda") for _ in range(64)]
            warm += [torch.empty(4 << 10, dtype=torch.uint8, device="cuda") for _ in range(256)]
            del warm
    torch.cuda.synchronize()


def _load_kernels(moe, max_tokens, runs):
    """Runs each of `runs` (a callable taking a module: a forward and its backward) on a
    one-rank copy of `moe` swapped with a plan over a virtual comm of one rank: the ranks'
    own path, so every PyTorch kernel they launch between their calls (the casts, the
    router's backward and its GEMMs at these shapes) has run once before any rank's call
    spins on the device. CUDA's lazy
    loading loads a kernel at its first launch after waiting for the device, and between
    two virtual ranks' calls that wait never ends; the library loads its own kernels when a
    layer is created (docs/decisions/0015-ep-transport.md)."""
    comm = distributed.virtual_comm(1)
    try:
        (one,) = _virtual_rank_moes(moe, 1, max_tokens, comm)
        for run in runs:
            run(one)
        torch.cuda.synchronize()
        mtt.restore(one)
    finally:
        comm.close()


def _run_ranks(moes, streams, forwards, dys):
    """Launches every rank's forward on its stream before any is waited for (each waits
    for the others' rows), then the backwards of all, then each rank's check(); returns
    the outputs."""
    ys = []
    for stream, forward in zip(streams, forwards):
        with torch.cuda.stream(stream):
            ys.append(forward())
    # A host synchronization between two ranks' launches hangs them until their waits run
    # out: PyTorch's sync debug mode names any synchronizing op of the backward.
    with warnings.catch_warnings(record=True) as syncs:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            torch.autograd.backward(ys, dys)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in syncs:
        if "synchroniz" in str(w.message):
            print(f"a synchronizing op in the ranks' backward: {w.message} "
                  f"({w.filename}:{w.lineno})")
    for stream, m in zip(streams, moes):
        with torch.cuda.stream(stream):
            m.experts.moefuse_ep.check()
    torch.cuda.synchronize()
    return ys


def _equal_bits(name, got, want):
    assert (got.dtype, got.shape) == (want.dtype, want.shape), (name, got.dtype, want.dtype)
    if not torch.equal(got, want):
        diff = (got.double() - want.double()).abs().max().item()
        raise AssertionError(f"{name} is not bitwise equal to one rank's: max |diff| {diff:.3e}")


def test_expert_parallel_virtual_ranks_routed_experts_bitwise():
    """Two virtual ranks, each calling its MoefuseExperts with its own tokens (uneven T),
    against routed_experts on one rank with the concatenated tokens and all experts: y,
    dx, d top_scores per rank and each rank's slices of dw1, dw3, dw2, bit for bit (the
    library's receive order is the one-rank order of the concatenated batch)."""
    reason = _cuda_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    R, tokens = 2, (70, 45)
    x, ids, p, w13, w2, dy = random_problem(sum(tokens), EP_D, EP_F, EP_E, EP_K, seed=21,
                                            drop_fraction=0.1)
    moe = ep_moe(device="cuda")
    with torch.no_grad():
        moe.experts.w1.copy_(w13[:, :EP_F])
        moe.experts.w3.copy_(w13[:, EP_F:])
        moe.experts.w2.copy_(w2)
    # one rank
    xr, pr = x.cuda().requires_grad_(), p.cuda().requires_grad_()
    ref_w = [getattr(moe.experts, n).detach().clone().requires_grad_() for n in ("w1", "w3", "w2")]
    y_ref = mtt.routed_experts(xr, pr, ids.cuda().long(), *ref_w)
    y_ref.backward(dy.cuda())
    # two virtual ranks
    comm = distributed.virtual_comm(R, timeout_ms=20000)
    try:
        moes = _virtual_rank_moes(moe, R, max(tokens), comm)
        streams = [torch.cuda.Stream() for _ in range(R)]
        _warm_streams(streams)
        starts = [0, tokens[0]]
        inputs = [(x[s:s + t].cuda().requires_grad_(), p[s:s + t].cuda().requires_grad_(),
                   ids[s:s + t].cuda().long(), dy[s:s + t].cuda())
                  for s, t in zip(starts, tokens)]
        torch.cuda.synchronize()
        _load_kernels(moe, max(tokens), [
            lambda one, i=i: one.experts(i[0].detach().requires_grad_(),
                                         i[1].detach().requires_grad_(), i[2]).backward(i[3])
            for i in inputs])
        ys = _run_ranks(moes, streams,
                        [lambda m=m, i=i: m.experts(i[0], i[1], i[2])
                         for m, i in zip(moes, inputs)],
                        [i[3] for i in inputs])
        n = EP_E // R
        for r, m in enumerate(moes):
            s, t = starts[r], tokens[r]
            xi, pi, _, _ = inputs[r]
            _equal_bits(f"rank {r} y", ys[r].detach(), y_ref.detach()[s:s + t])
            _equal_bits(f"rank {r} dx", xi.grad, xr.grad[s:s + t])
            _equal_bits(f"rank {r} d top_scores", pi.grad, pr.grad[s:s + t])
            for name, w in zip(("w1", "w3", "w2"), ref_w):
                _equal_bits(f"rank {r} d{name}", getattr(m.experts, name).grad,
                            w.grad[r * n:(r + 1) * n])
    finally:
        comm.close()


def test_expert_parallel_virtual_ranks_moe_layer():
    """Two virtual ranks running TorchTitan's whole MoE (router, load-balancing counts)
    swapped with a plan, each on its own tokens, against the swapped MoE on one rank whose
    router is pinned to the ranks' selections and scores (a GEMM over another number of
    rows may round the router's logits differently on a GPU): the output per rank and each
    rank's slices of the routed experts' gradients bit for bit; the ranks' load-balancing
    counts add up to the counts of the selections. No shared expert: its GEMMs over
    another number of rows need not give the same bits either."""
    reason = _cuda_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    R, tokens = 2, (64, 48)
    moe = ep_moe(device="cuda")
    g = torch.Generator().manual_seed(23)
    x = torch.randn(sum(tokens), EP_D, generator=g).bfloat16().cuda()
    dy = torch.randn(sum(tokens), EP_D, generator=g).bfloat16().cuda()
    starts = [0, tokens[0]]
    comm = distributed.virtual_comm(R, timeout_ms=20000)
    try:
        moes = _virtual_rank_moes(moe, R, max(tokens), comm)
        routed = [{} for _ in range(R)]
        for r, m in enumerate(moes):
            m.router.register_forward_hook(
                lambda mod, inp, out, r=r: routed[r].update(scores=out[0].detach(), ids=out[1]))
        streams = [torch.cuda.Stream() for _ in range(R)]
        _warm_streams(streams)
        _load_kernels(moe, max(tokens), [
            lambda one, s=s, t=t: one(x[s:s + t].unsqueeze(0)).backward(
                dy[s:s + t].unsqueeze(0))
            for s, t in zip(starts, tokens)])
        ys = _run_ranks(moes, streams,
                        [lambda m=m, s=s, t=t: m(x[s:s + t].unsqueeze(0))
                         for m, s, t in zip(moes, starts, tokens)],
                        [dy[s:s + t].unsqueeze(0) for s, t in zip(starts, tokens)])
    finally:
        comm.close()

    ref = copy.deepcopy(moe)
    mtt.apply(ref)
    scores = torch.cat([routed[r]["scores"] for r in range(R)])
    ids = torch.cat([routed[r]["ids"] for r in range(R)])
    ref.router.register_forward_hook(lambda mod, inp, out: (scores, ids, out[2]))
    y_ref = ref(x.unsqueeze(0))
    y_ref.backward(dy.unsqueeze(0))
    n = EP_E // R
    for r, m in enumerate(moes):
        s, t = starts[r], tokens[r]
        _equal_bits(f"rank {r} output", ys[r].detach()[0], y_ref.detach()[0, s:s + t])
        for name in ("w1", "w2", "w3"):
            _equal_bits(f"rank {r} experts.{name} grad", getattr(m.experts, name).grad,
                        getattr(ref.experts, name).grad[r * n:(r + 1) * n])
    counts = sum(m.tokens_per_expert for m in moes)
    assert torch.equal(counts, torch.bincount(ids.flatten(), minlength=EP_E).to(counts.dtype))
