"""The CUDA FP8 layer against the recipe emulated on the device (bench/fp8_emulation.py,
exact fp32) and against itself, where tests/ see too little: training data, training
sizes, repeated calls. A diagnostic, run on an sm_90 GPU:

    python3 tools/fp8_layer_check.py forward    y against the recipe over shapes, routing
                                                skews, T and weight dtypes (row error
                                                quantiles, per 128-column tile, the worst
                                                rows' experts); the quantized weights
                                                against the recipe's codes
    python3 tools/fp8_layer_check.py gate-up    the forward's saved [g; u] against the
                                                recipe's (and with x or W13 left in bf16),
                                                then y of the recipe's gemm2 on them
    python3 tools/fp8_layer_check.py training [--steps 0 20 ...] [--repeat N]
                                                bench/train_parity.py's model trained in
                                                FP8; at the steps, one layer's expert call
                                                of the training step (inputs, weights, dy,
                                                what the library returned) against the
                                                same call made again and against the
                                                recipe; --repeat: N more calls of it
    python3 tools/fp8_layer_check.py repeat T:N ... [--shape qwen3-30b-a3b]
                                                N forward + backward calls of a random
                                                problem of T tokens: bitwise equal? (also
                                                the calls ncu profiles: gpu_checks ncu_fp8)
    python3 tools/fp8_layer_check.py bisect     where run-to-run differences come from:
                                                the saved bytes of four forwards, backwards
                                                from one saved buffer, the differing rows'
                                                row blocks and warps, and balanced routing
                                                without padding rows
(the parity model's layer, H = 1024, I = 512, E = 64, K = 8, unless a case says else).
It found the emulation's scale rounding on CUDA (fp8_emulation.scales) and the FP8
mainloop's unfenced scale reads (mainloop.cuh, k_loop_promoted).
"""


from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "python"), os.path.join(ROOT, "python", "tests"),
                os.path.join(ROOT, "bench")]

import fp8_emulation as em  # noqa: E402
import moefuse  # noqa: E402
from moefuse import _fp8, _lib, ops  # noqa: E402
from moe_reference import random_problem  # noqa: E402

DEV = torch.device("cuda")  # --device sets it
SHAPES = {"parity-model": (1024, 512, 64, 8), "qwen3-30b-a3b": (2048, 768, 128, 8),
          "qwen3-235b-a22b": (4096, 1536, 128, 8)}  # H, I, E, K


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def forward_case(shape, skew, wdtype, seed=41):
    T, H, I, E, K = shape
    x, ids, p, w13, w2, _ = random_problem(T, H, I, E, K, seed=seed, skew=skew)
    x, ids, p, w13, w2 = (t.to(DEV) for t in (x, ids, p, w13, w2))
    w13, w2 = w13.to(wdtype), w2.to(wdtype)
    with torch.no_grad():
        y = moefuse.experts(x, ids, p, w13, w2, precision="fp8").float()
    moefuse.check_device_errors()
    with em.exact_fp32(DEV):
        want, (plan, _, _) = em.experts_forward(x, ids, p, w13, w2, em.Recipe(em.GEMMS))
        bf16, _ = em.experts_forward(x, ids, p, w13, w2, em.Recipe(()))
    rows = (y - want).norm(dim=1) / want.norm(dim=1).clamp_min(1e-30)
    q = torch.quantile(rows, torch.tensor([0.5, 0.9, 0.99, 1.0], device=DEV)).tolist()
    counts = torch.tensor(plan.counts, device=DEV)
    print(f"T={T} H={H} I={I} E={E} K={K} {skew:8s} w {str(wdtype)[6:]:9s} "
          f"lib-emul {rel(y, want):.2e}  emul-bf16 {rel(want, bf16):.2e}  "
          f"lib-bf16 {rel(y, bf16):.2e}  rows p50/p90/p99/max "
          + " ".join(f"{v:.1e}" for v in q)
          + f"  rows>1e-2: {(rows > 1e-2).float().mean().item():.3f}  "
          f"max rows/expert {int(counts.max())}")
    col = ((y - want).norm(dim=0) / want.norm(dim=0).clamp_min(1e-30)).view(-1, 128).mean(1)
    print("    error per 128-column tile of y: " + " ".join(f"{v:.1e}" for v in col.tolist()))
    quarter = rows.view(4, -1).mean(1) if T % 4 == 0 else rows.mean().view(1)
    print("    mean row error per quarter of the tokens: "
          + " ".join(f"{v:.1e}" for v in quarter.tolist()))
    worst = rows.topk(min(5, T)).indices
    for t in worst.tolist():
        experts = ids[t].tolist()
        print(f"    token {t}: error {rows[t]:.2e}, experts {experts} "
              f"(rows {[int(counts[e]) for e in experts if e >= 0]})")
    # per expert: the error of the tokens whose slots all go to one load class
    return rows


def weights_case(E, H, I, wdtype, seed=7):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(DEV, wdtype)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(DEV, wdtype)
    layer = ops.layer_cache.get(H, I, E, 1, 1, DEV, _lib.SavedMode.SAVE_ACTIVATIONS,
                                _lib.Precision.FP8_BLOCK, False)
    weights = _fp8.Fp8WeightCache().get(layer, w13, w2)
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    from fp8_reference import _array
    buf = weights.buffer
    bad = []
    for w, name, rows, cols in ((w13, "w13", 2 * I, H), (w2, "w2", H, I)):
        codes = _array(buf, getattr(weights, name), (E, rows, cols), torch.uint8)
        scale = _array(buf, getattr(weights, name + "_scale"), (E, rows // 128, cols // 128),
                       torch.float32)
        codes_t = _array(buf, getattr(weights, name + "t"), (E, cols, rows), torch.uint8)
        want_codes, want_scale = (t.cpu() for t in em.block_codes(w.float()))
        bad.append(f"{name}: codes differ {(codes != want_codes.view(torch.uint8)).sum().item()}"
                   f", scales differ {(scale != want_scale).sum().item()}, transposes differ "
                   f"{(codes_t != codes.transpose(1, 2)).sum().item()}")
    print(f"weights E={E} H={H} I={I} {wdtype}: " + "; ".join(bad))


def _saved_sections(saved, T, I, E, K):
    """The sections of a one-GPU SAVE_ACTIVATIONS saved buffer (src/host/sizing.c
    mf_saved_layout_of, each 256-byte aligned): expert counts and offsets, slot_row [T, K],
    gate_up [rows_cap, 2I] bf16."""
    a256 = lambda n: (n + 255) // 256 * 256  # noqa: E731
    rows_cap = (T * K + 127 * min(T * K, E) + 127) // 128 * 128   # mf_padded_rows
    at = a256(16 * 4)
    counts = saved[at:at + E * 4].view(torch.int32)
    at += a256(E * 4)
    offsets = saved[at:at + (E + 1) * 4].view(torch.int32)
    at += a256((E + 1) * 4) + a256(rows_cap // 128 * 4)
    slot_row = saved[at:at + T * K * 4].view(torch.int32).view(T, K)
    at += a256(T * K * 4) + a256(rows_cap * 4)
    assert saved.numel() == at + a256(rows_cap * 2 * I * 2), (saved.numel(), at)
    gate_up = saved[at:at + rows_cap * 2 * I * 2].view(torch.bfloat16).view(rows_cap, 2 * I)
    return counts, offsets, slot_row, gate_up


def gate_up_case(shape, skew="uniform", seed=43):
    """The forward's saved [g; u] (bf16, SAVE_ACTIVATIONS) against the emulation's, and
    against variants of the recipe (x or W13 left in bf16); then y of the emulation's gemm2
    on the library's [g; u]."""
    T, H, I, E, K = shape
    x, ids, p, w13, w2, _ = random_problem(T, H, I, E, K, seed=seed, skew=skew)
    x, ids, p, w13, w2 = (t.to(DEV) for t in (x, ids, p, w13, w2))
    with torch.no_grad():
        y, saved = torch.ops.moefuse.experts_fwd(
            x, ids, p, w13, w2, True, int(_lib.SavedMode.SAVE_ACTIVATIONS),
            int(_lib.Precision.FP8_BLOCK), False, None)
    moefuse.check_device_errors()
    _, _, slot_row, gu_lib = _saved_sections(saved, T, I, E, K)
    recipe = em.Recipe(em.GEMMS)
    with em.exact_fp32(DEV):
        want_y, (plan, gu, a) = em.experts_forward(x, ids, p, w13, w2, recipe)
        got = gu_lib[slot_row.reshape(-1).long()[plan.slot]].float()
        xs = x[plan.token].float()
        q13 = recipe.weight("gemm1", w13)
        variants = {
            "recipe": gu,
            "x bf16": recipe.bf16(em._per_expert(xs, plan.counts, lambda e, v: v @ q13[e].T)),
            "w13 bf16": recipe.bf16(em._per_expert(
                em.quant_rows(xs), plan.counts, lambda e, v: v @ w13[e].float().T)),
        }
        for name, want in variants.items():
            rows = (got - want).norm(dim=1) / want.norm(dim=1).clamp_min(1e-30)
            q = torch.quantile(rows, torch.tensor([0.5, 0.9, 0.99, 1.0], device=DEV)).tolist()
            print(f"[g; u] T={T} H={H} I={I} E={E} K={K} {skew}: lib against {name:9s} "
                  f"{rel(got, want):.2e}  rows p50/p90/p99/max "
                  + " ".join(f"{v:.1e}" for v in q))
        # gemm2 of the emulation on the library's [g; u]
        g, u = got[:, :I], got[:, I:]
        a_lib = recipe.bf16(torch.nn.functional.silu(g) * u)
        q2 = recipe.weight("gemm2", w2)
        o = em._per_expert(recipe.rows("gemm2", a_lib), plan.counts, lambda e, v: v @ q2[e].T)
        ps = p.reshape(-1)[plan.slot].float()
        y_on_lib = torch.zeros(x.shape, device=DEV)
        y_on_lib.index_add_(0, plan.token, ps[:, None] * o)
    print(f"    y: lib against recipe {rel(y.float(), want_y):.2e}; lib against the "
          f"recipe's gemm2 on lib's [g; u] {rel(y.float(), y_on_lib):.2e}; a: "
          f"{rel(a_lib, a):.2e}")


def _compare(name, got, want):
    got, want = got.double(), want.double()
    err = rel(got, want)
    if got.dim() == 2 and name in ("y", "dx"):
        rows = (got - want).norm(dim=1) / want.norm(dim=1).clamp_min(1e-30)
        return f"{name} {err:.2e} (row {rows.max().item():.1e})"
    return f"{name} {err:.2e}"


def training_case(check_steps=(0, 20, 50, 80, 120, 160), layer_index=4, extra_args=(),
                  repeat=0):
    """The parity model (bench/train_parity.py) trained in FP8; at the check steps, layer
    layer_index's expert call of the training step (its inputs, weights, dy and what the
    library returned) against the same call made fresh (weights quantized again) and
    against the recipe emulated."""
    import stdlib_text
    import train_parity as tp
    from fp8_reference import run_fp8

    args = tp.parse_args(["--steps", "300", "--precisions", "fp8", *extra_args])
    train, _, _ = stdlib_text.stdlib_streams()
    batches = stdlib_text.Batches(train, args.batch, args.seq, args.seed)
    run = tp.Run("fp8", tp.model_config(args), args, DEV)
    experts = run.model.model.layers[layer_index].mlp.experts
    cap = {}

    plain_forward = experts.forward

    def forward(x, ids, p):  # the call's own dx: x also feeds the router
        if not cap.get("on"):
            return plain_forward(x, ids, p)
        xb = x.to(torch.bfloat16)
        cap.update(x=xb.detach().clone(), ids=ids.detach().clone(), p=p.detach().float().clone(),
                   w13=experts.gate_up_proj.detach().clone(),
                   w2=experts.down_proj.detach().clone())
        xb.register_hook(lambda g: cap.__setitem__("dx", g.detach().clone()))
        p.register_hook(lambda g: cap.__setitem__("dp", g.detach().clone()))
        return plain_forward(xb, ids, p).to(x.dtype)

    experts.forward = forward

    def hook(module, inputs, output):
        if cap.get("on"):
            cap["y"] = output.detach().to(torch.bfloat16).clone()
            output.register_hook(lambda g: cap.__setitem__("dy", g.detach().to(torch.bfloat16)
                                                           .clone()))
    experts.register_forward_hook(hook)
    for name, param in (("dw13", experts.gate_up_proj), ("dw2", experts.down_proj)):
        param.register_post_accumulate_grad_hook(
            lambda t, name=name: cap.__setitem__(name, t.grad.detach().clone())
            if cap.get("on") else None)
    for step in range(max(check_steps) + 1):
        cap.clear()
        cap["on"] = step in check_steps
        run.step(step, batches.batch_at(step).to(DEV))
        if not cap["on"]:
            continue
        run.flush()
        loss = run.records[-1]["loss"]
        train_out = [cap[k] for k in ("y", "dx", "dp", "dw13", "dw2")]
        problem = [cap[k] for k in ("x", "ids", "p", "w13", "w2", "dy")]
        fresh = [t.to(DEV) for t in run_fp8(*problem, device=DEV)]
        recipe = em.Recipe(em.GEMMS)
        x, ids, p, w13, w2, dy = problem
        with em.exact_fp32(DEV):
            y, state = em.experts_forward(x, ids, p, w13, w2, recipe)
            want = (y, *em.experts_backward(dy, x, p, w13, w2, state, recipe))
            plain = em.Recipe(())
            bf16_y, bf16_state = em.experts_forward(x, ids, p, w13, w2, plain)
            bf16 = (bf16_y, *em.experts_backward(dy, x, p, w13, w2, bf16_state, plain))
        names = ("y", "dx", "dp", "dw13", "dw2")
        counts = torch.bincount(ids[ids >= 0].long().flatten(), minlength=w13.shape[0])
        print(f"step {step} loss {loss:.4f}: |x| max {x.float().abs().max():.3g} rms "
              f"{x.float().pow(2).mean().sqrt():.3g}; |dy| max {dy.float().abs().max():.3g} rms "
              f"{dy.float().pow(2).mean().sqrt():.3g}; rows per expert min {int(counts.min())} "
              f"max {int(counts.max())}; |w13| max {w13.abs().max():.3g}")
        print("    training call against fresh: " + ", ".join(
            _compare(n, a.reshape(b.shape), b) for n, a, b in zip(names, train_out, fresh)))
        print("    fresh against the recipe:    " + ", ".join(
            _compare(n, a.reshape(b.shape), b) for n, a, b in zip(names, fresh, want))
              , flush=True)
        print("    the recipe against bf16 GEMMs: " + ", ".join(
            _compare(n, a, b) for n, a, b in zip(names, want, bf16)), flush=True)
        if repeat:
            _report_runs(f"{repeat + 1} calls", [fresh] + _runs(problem, repeat), ids)


def _runs(problem, n, **kw):
    from fp8_reference import run_fp8
    return [[t.to(DEV) for t in run_fp8(*problem, device=DEV, **kw)] for _ in range(n)]


def _report_runs(label, outs, ids):
    names = ("y", "dx", "dp", "dw13", "dw2")
    first = outs[0]
    diffs = []
    for o in outs[1:]:
        diffs.append(", ".join(f"{n} {int((a != b).sum())}" for n, a, b in zip(names, o, first)
                               if not torch.equal(a, b)) or "equal")
    print(f"  {label}: runs against the first (elements differing): " + " | ".join(diffs))
    for o in outs[1:]:
        bad = (o[1] != first[1]).any(dim=1).nonzero().flatten()
        if len(bad):
            counts = torch.bincount(ids[ids >= 0].long().flatten(), minlength=first[3].shape[0])
            t = bad[:6].tolist()
            dp_bad = (o[2] != first[2]).any(dim=1).nonzero().flatten()
            print(f"    dx differs in {len(bad)} tokens, e.g. {t}; their experts "
                  f"{[ids[i].tolist() for i in t[:3]]}; expert rows {counts.tolist()[:16]}...; "
                  f"d p differs in {len(dp_bad)} tokens, e.g. {dp_bad[:6].tolist()}; "
                  f"dx finite {bool(torch.isfinite(o[1]).all())}")
            break


def repeat_case(T, runs, shape=(1024, 512, 64, 8), skew="uniform"):
    """FP8 forward + backward `runs` times on one random problem: differences from the
    first run (the library is meant to be bitwise deterministic)."""
    problem = list(random_problem(T, *shape, seed=51, skew=skew))
    problem[3], problem[4] = problem[3].float(), problem[4].float()
    problem = [t.to(DEV) for t in problem]
    print(f"T={T} {shape} {skew}:")
    _report_runs(f"fp8 x{runs}", _runs(problem, runs), problem[1])


def _balanced_ids(T, E, K):
    """Every expert exactly T*K/E rows (whole 128-row blocks when T*K/E is a multiple of
    128): no padding rows."""
    t = torch.arange(T, device=DEV)[:, None]
    k = torch.arange(K, device=DEV)[None, :]
    return ((t * K + k * (E // K + 1)) % E).int()


def bisect_case(T=16384, runs=8):
    """Where the FP8 backward's run-to-run differences come from: the forward's saved bytes
    across forwards; backwards from one saved buffer; the differing rows' places (row
    block, warp, padding); the same without padding rows."""
    x, ids, p, w13, w2, dy = random_problem(T, 1024, 512, 64, 8, seed=51)
    x, ids, p, w13, w2, dy = (t.to(DEV) for t in (x, ids, p, w13, w2, dy))
    w13, w2 = w13.float(), w2.float()
    mode, fp8 = int(_lib.SavedMode.SAVE_ACTIVATIONS), int(_lib.Precision.FP8_BLOCK)
    for label, ids_ in (("random routing", ids), ("balanced, no padding", _balanced_ids(T, 64, 8))):
        fwd = [torch.ops.moefuse.experts_fwd(x, ids_, p, w13, w2, True, mode, fp8, False, None)
               for _ in range(4)]
        saved0 = fwd[0][1]
        print(f"{label}: forwards: y equal {all(torch.equal(f[0], fwd[0][0]) for f in fwd)}, "
              f"saved bytes differing {[int((f[1] != saved0).sum()) for f in fwd[1:]]}")
        outs = [torch.ops.moefuse.experts_bwd(dy, x, ids_, p, w13, w2, saved0, mode, fp8, False,
                                              None)[:4] for _ in range(runs)]
        moefuse.check_device_errors()
        counts, offsets, slot_row, _ = _saved_sections(saved0, T, 512, 64, 8)
        ref = outs[0]
        for i, o in enumerate(outs[1:], 1):
            bad_dp = (o[1] != ref[1])
            if not bad_dp.any() and torch.equal(o[0], ref[0]):
                continue
            rows = slot_row[bad_dp].long()
            blocks = sorted(set((rows // 128).tolist()))
            warps = sorted(set(((rows % 128) // 16).tolist()))
            desc = []
            for b in blocks[:4]:
                e = int(torch.searchsorted(offsets.long(), torch.tensor(b * 128, device=DEV),
                                           right=True)) - 1
                last = (int(offsets[e]) + int(counts[e]) - 1) // 128
                desc.append(f"block {b} (expert {e}, {int(counts[e])} rows, its block "
                            f"{b - int(offsets[e]) // 128} of {last - int(offsets[e]) // 128 + 1})")
            print(f"  backward {i}: dx rows differing {int((o[0] != ref[0]).any(dim=1).sum())}, "
                  f"d p slots {int(bad_dp.sum())} in row blocks {blocks[:8]}, warps {warps}; "
                  + "; ".join(desc))
        print(f"  {runs - 1} backwards from one saved buffer: "
              f"{sum(not all(torch.equal(a, b) for a, b in zip(o, ref)) for o in outs[1:])} "
              "differ from the first")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cpu runs the CPU backend (a check)")
    sub = ap.add_subparsers(dest="case", required=True)
    sub.add_parser("forward")
    sub.add_parser("gate-up")
    training = sub.add_parser("training")
    training.add_argument("--steps", type=int, nargs="+", default=[0, 20, 50, 80, 120, 160])
    training.add_argument("--layer", type=int, default=4)
    training.add_argument("--repeat", type=int, default=0)
    training.add_argument("--parity-args", nargs=argparse.REMAINDER, default=[],
                          help="more bench/train_parity.py arguments (last)")
    repeat = sub.add_parser("repeat")
    repeat.add_argument("specs", nargs="+", help="T:N, e.g. 16384:10")
    repeat.add_argument("--shape", choices=sorted(SHAPES), default="parity-model",
                        help="H, I, E, K of the layer")
    sub.add_parser("bisect")
    args = ap.parse_args(argv)
    global DEV
    DEV = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.case == "forward":
        for wdtype in (torch.bfloat16, torch.float32):
            weights_case(64, 1024, 512, wdtype)
        parity = (1024, 512, 64, 8)
        for T in (512, 2048, 4096, 16384):
            forward_case((T, *parity), "uniform", torch.bfloat16)
        for skew in ("zipf", "one_expert"):
            forward_case((16384, *parity), skew, torch.bfloat16)
        forward_case((16384, *parity), "uniform", torch.float32)
        for shape in ((4096, 256, 128, 8, 2), (4096, 1024, 128, 8, 2), (4096, 128, 512, 8, 2),
                      (4096, 2048, 768, 128, 8)):
            forward_case(shape, "uniform", torch.bfloat16)
    elif args.case == "gate-up":
        for shape in ((4096, 1024, 512, 64, 8), (4096, 256, 128, 8, 2), (4096, 128, 512, 8, 2)):
            gate_up_case(shape)
    elif args.case == "training":
        training_case(tuple(args.steps), args.layer, ["--device", args.device, *args.parity_args],
                      args.repeat)
    elif args.case == "repeat":
        for spec in args.specs:
            T, runs = (int(v) for v in spec.split(":"))
            repeat_case(T, runs, SHAPES[args.shape])
    else:
        bisect_case()


if __name__ == "__main__":
    main()
