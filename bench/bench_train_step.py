"""A real training step: transformers' Qwen3MoeForCausalLM, Qwen3-30B-A3B config reduced
to a few layers, with (a) moefuse.MoefuseQwen3MoeBlock and (b) the TorchTitan-style
PyTorch MoE of bench/torch_moe_baseline.py (TorchQwen3MoeBlock) in every layer.

    Model      Qwen3-30B-A3B's config.json (attention, norms, vocab, ...) with --layers
               decoder layers (default 4), random init (seed --seed), sdpa attention.
    Precision  pure bf16: parameters, gradients and AdamW state (torch.optim.AdamW,
               fused on CUDA) are bf16; no fp32 master weights, no autocast. The loss is
               transformers' causal-LM cross entropy (computed in fp32).
    Data       synthetic token batches of --batch x --seq (default 4 x 4096 = 16384
               tokens per MoE call) from a fixed random first-order Markov chain
               (each token has 4 possible successors), so the loss has something to
               learn; the same --steps batches (default 50) for both runs, each of
               --micro-batches (default 1) whose gradients accumulate before one
               optimizer step (FP8 quantizes the weights once per optimizer step).
    Runs       moefuse in each --precision (default bf16; `--precision bf16 fp8` adds
               moefuse-fp8: the experts' GEMMs in block-scaled FP8, weights quantized
               once per optimizer step) and the baseline, all from the same initial
               weights (one model built once, its MoE blocks swapped per run); every
               MoE block uses the same routing code.
    Timing     each step (zero_grad, forward, backward, optimizer step) bracketed by
               CUDA events; median over the steps after --warmup (default 5).
    MoE time   then --profile-steps (default 3) more steps under torch.profiler, each
               MoE block's forward and backward inside a profiler range (module hooks):
               the CUDA time of the kernels in those ranges per step (router included),
               its share of all kernels' time per step, and for moefuse the CUDA time of
               its ops (moefuse::experts_fwd / experts_bwd) alone, and the --kernels
               (default 12) longest kernels. With fp8 the ratio of the MoE time of bf16
               to fp8 is printed against the 1.35x FP8 should give.

Prints per implementation the median step ms, tokens/s and the MoE time, the ratios, the
loss curves side by side, max |loss_moefuse - loss_baseline| (bf16) with PASS/FAIL against
--loss-tol (default
0.05 nats: bf16 rounding differences between the two implementations, amplified by
50 AdamW steps and routing flips of near-tied experts), and writes a PNG of the two
curves to --plot (default $OUT/loss_curves.png when $OUT is set, else
bench/loss_curves.png; bench/loss_plot.py: matplotlib when installed, else a small built-in
PNG writer).

If the library's CUDA backward answers MOEFUSE_ERR_UNSUPPORTED, the moefuse run prints
SKIP and the baseline still runs (exit 0). Without a CUDA device it prints SKIP and
exits 0. Exit 1 when the loss curves disagree beyond --loss-tol.

    python3 bench/bench_train_step.py [--layers 4] [--steps 50] [--batch 4 --seq 4096]
                                      [--precision bf16 fp8]
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import pathlib
import statistics
import sys
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "python"))  # the checkout's package, when not installed

import torch_moe_baseline as baseline  # noqa: E402
from loss_plot import plot  # noqa: E402

# config.json of Qwen/Qwen3-30B-A3B (num_hidden_layers is overridden by --layers).
QWEN3_30B_A3B = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
    mlp_only_layers=[], hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1e6,
    max_position_embeddings=40960, max_window_layers=48, initializer_range=0.02,
    tie_word_embeddings=False, attention_bias=False, attention_dropout=0.0,
    use_sliding_window=False, sliding_window=None, output_router_logits=False,
    router_aux_loss_coef=0.001)  # bos/eos ids left out: unused by the synthetic data

# --tiny: a CPU-sized model with the same structure (for checking the script itself).
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=16,
            num_experts_per_tok=4)


def parse_args(argv=None):
    out = os.environ.get("OUT")
    default_plot = (pathlib.Path(out) / "loss_curves.png") if out else HERE / "loss_curves.png"
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--micro-batches", type=int, default=1,
                    help="forward + backward passes (of --batch x --seq tokens) accumulated "
                         "per optimizer step")
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=None, help="override the config's vocab size")
    ap.add_argument("--loss-tol", type=float, default=0.05,
                    help="max |loss_a - loss_b| (nats) for PASS")
    ap.add_argument("--plot", type=pathlib.Path, default=default_plot)
    ap.add_argument("--device", default="cuda",
                    help="cuda (the benchmark); cpu only with --tiny, to check the script")
    ap.add_argument("--tiny", action="store_true", help="a CPU-sized model (script check)")
    ap.add_argument("--precision", nargs="+", default=["bf16"], choices=["bf16", "fp8"],
                    help="moefuse runs: bf16, fp8 or both")
    ap.add_argument("--kernels", type=int, default=12,
                    help="the profiled steps' N longest kernels per run (0: none)")
    ap.add_argument("--profile-steps", type=int, default=3,
                    help="steps profiled for the MoE time (0: none)")
    args = ap.parse_args(argv)
    if args.steps <= args.warmup:
        ap.error("--steps must exceed --warmup")
    if args.micro_batches < 1:
        ap.error("--micro-batches must be at least 1")
    return args


# ---- data, model, training --------------------------------------------------------------


def make_batches(steps, batch, seq, vocab, seed, device):
    """steps batches [batch, seq] int64 from a random Markov chain with 4 successors per
    token (over min(vocab, 8192) tokens). Generated on the CPU, so identical anywhere."""
    g = torch.Generator().manual_seed(seed + 12345)
    used = min(vocab, 8192)
    successors = torch.randint(0, used, (used, 4), generator=g)
    tokens = torch.empty(steps, batch, seq, dtype=torch.int64)
    cur = torch.randint(0, used, (steps, batch), generator=g)
    choice = torch.randint(0, 4, (steps, batch, seq), generator=g)
    for s in range(seq):
        tokens[:, :, s] = cur
        cur = successors[cur, choice[:, :, s]]
    return tokens.to(device)


def qwen3_moe_config(cfg: dict, *overrides: dict):
    """transformers.Qwen3MoeConfig of cfg updated by each non-empty override, sdpa
    attention."""
    import transformers

    cfg = dict(cfg)
    for override in overrides:
        cfg.update(override or {})
    config = transformers.Qwen3MoeConfig(**cfg)
    config._attn_implementation = "sdpa"
    return config


def build_model(args, device):
    import transformers

    config = qwen3_moe_config(QWEN3_30B_A3B, dict(num_hidden_layers=args.layers),
                              args.tiny and TINY, args.vocab and dict(vocab_size=args.vocab))
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = transformers.Qwen3MoeForCausalLM(config)
    return model.to(torch.bfloat16), config


def swap_blocks(model, make_block):
    for layer in model.model.layers:
        layer.mlp = make_block(layer.mlp)
    return model


def train_step(model, opt, tokens):
    """One optimizer step over tokens [micro_batches, batch, seq]: the gradients of the
    micro-batches' mean loss accumulated, then AdamW; returns that mean loss."""
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for micro in tokens:
        loss = model(input_ids=micro, labels=micro).loss / len(tokens)
        loss.backward()
        total = total + loss.detach()
    opt.step()
    return total


def train(model, batches, args, device, label):
    """Runs len(batches) steps, then args.profile_steps more under the profiler; returns
    (losses list[float], step times ms list[float], MoE time dict or None)."""
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.1, fused=fused)
    model.train()
    losses, events, cpu_ms = [], [], []
    for step, tokens in enumerate(batches):
        if fused:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        losses.append(train_step(model, opt, tokens).detach())
        if fused:
            end.record()
            events.append((start, end))
        else:
            cpu_ms.append((time.perf_counter() - t0) * 1e3)
        if step == 0 and device.type == "cuda":
            torch.cuda.synchronize()
            print(f"  {label}: step 0 done, loss {losses[0].item():.4f}", flush=True)
    if fused:
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) for s, e in events]
    else:
        times = cpu_ms
    moe = profile_moe(model, opt, batches, args.profile_steps, device, args.kernels)
    del opt
    return [float(l.item()) for l in losses], times, moe


# ---- the MoE blocks' time ----------------------------------------------------------------------


def _range_hooks(module, name):
    """Hooks that open a profiler range (record_function) named name + "_forward" around
    the module's forward and name + "_backward" around its backward; returns the handles."""
    from torch.autograd.profiler import record_function

    open_ranges = []

    def enter(suffix):
        def hook(*_):
            rf = record_function(name + suffix)
            rf.__enter__()
            open_ranges.append(rf)
        return hook

    def leave(*_):
        open_ranges.pop().__exit__(None, None, None)

    return [module.register_forward_pre_hook(enter("_forward")),
            module.register_forward_hook(leave),
            module.register_full_backward_pre_hook(enter("_backward")),
            module.register_full_backward_hook(leave)]


MOEFUSE_OPS = ("moefuse::experts_fwd", "moefuse::experts_bwd")

# CUPTI's overhead records (the profiler's own host-side work). PyTorch 2.11 files each
# under the op it interrupts, with that op's kernels a second time (pytorch/pytorch#193924):
# a 12-layer FP8 step read 189 ms of moefuse ops' kernels against 77 in the kernel table.
PROFILER_OVERHEAD = frozenset(("Activity Buffer Request", "Lazy Function Loading", "Resource",
    "Buffer Flush", "Driver Compiler", "Instrumentation", "Runtime Triggered Module Loading",
    "Command Buffer Full", "UVM Activity Init"))


def device_us(ev) -> float:
    """The kernel time (µs) under a CPU event: its kernels and its descendants', the
    profiler's overhead records left out (FunctionEvent.device_time_total counts theirs)."""
    if ev.is_async:
        return 0.0
    return (sum(k.duration for k in ev.kernels) +
            sum(device_us(ch) for ch in ev.cpu_children if ch.name not in PROFILER_OVERHEAD))


def profile_moe(model, opt, batches, steps, device, top_kernels=0):
    """{moe_ms, total_ms, ops_ms, span_ms} per step from `steps` profiled training steps:
    the time of the kernels in the MoE blocks' ranges, of all kernels (CUDA; the steps'
    CPU time on the CPU) and in moefuse's ops, and (CUDA) the GPU time the MoE blocks'
    ranges span; with top_kernels (CUDA) also "kernels": the longest kernels, a list
    of (name, ms per step, launches per step). None when steps is 0."""
    if steps <= 0:
        return None
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    handles = [h for layer in model.model.layers for h in _range_hooks(layer.mlp, "moe_block")]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        with profile(activities=activities) as prof:
            for i in range(steps):
                with torch.profiler.record_function("train_step"):
                    train_step(model, opt, batches[i % len(batches)])
            if cuda:
                torch.cuda.synchronize()
    finally:
        for h in handles:
            h.remove()
    sums = {"moe": 0.0, "total": 0.0, "ops": 0.0, "span": 0.0}  # µs over the steps
    for ev in prof.events():
        # On CUDA a record_function range also appears as a GPU annotation of its name:
        # its span on the GPU (the MoE blocks' spans: "span"; kineto makes one per stream,
        # so a block with kernels on a second stream, as expert parallelism's push, would
        # count twice); the kernels under its CPU range are counted apart.
        if cuda and getattr(ev, "is_user_annotation", False) and \
                ev.device_type != torch.autograd.DeviceType.CPU:
            if ev.name in ("moe_block_forward", "moe_block_backward"):
                sums["span"] += ev.time_range.end - ev.time_range.start
            continue
        if ev.name in ("moe_block_forward", "moe_block_backward", *MOEFUSE_OPS):
            us = device_us(ev) if cuda else ev.cpu_time_total
            sums["ops" if ev.name in MOEFUSE_OPS else "moe"] += us
        elif cuda and ev.device_type == torch.autograd.DeviceType.CUDA:
            sums["total"] += ev.device_time_total   # a kernel, memcpy or memset: its own time
        elif not cuda and ev.name == "train_step":
            sums["total"] += ev.cpu_time_total
    out = {f"{k}_ms": v / steps / 1e3 for k, v in sums.items()}
    if cuda and top_kernels > 0:
        # the ranges (ours and the optimizer's) also appear as GPU annotations: not kernels
        ranges = ("train_step", "moe_block_forward", "moe_block_backward")
        kernels = [ev for ev in prof.key_averages()
                   if ev.device_type == torch.autograd.DeviceType.CUDA
                   and not getattr(ev, "is_user_annotation", False)
                   and ev.key not in ranges and not ev.key.startswith("Optimizer.")]
        kernels.sort(key=lambda ev: ev.self_device_time_total, reverse=True)
        out["kernels"] = [(ev.key, ev.self_device_time_total / steps / 1e3, ev.count / steps)
                          for ev in kernels[:top_kernels]]
    return out


# ---- main -------------------------------------------------------------------------------------

MOE_RATIO_TARGET = 1.35  # MoE time of bf16 / fp8 that FP8 should give in a training step


def _short_kernel_name(name: str, width: int = 110) -> str:
    """A kernel's name without the namespaces that fill it (so moefuse's tile
    configurations stay apart), cut in the middle when still too long."""
    for noise in ("void ", "(anonymous namespace)::", "at::native::", "mf::sm90::", "mf::"):
        name = name.replace(noise, "")
    if len(name) <= width:
        return name
    half = width // 2 - 2
    return name[:half] + " .. " + name[-half:]


def moefuse_name(precision: str) -> str:
    return "moefuse" if precision == "bf16" else f"moefuse-{precision}"


def print_times(medians: dict, moe_times: dict, tokens_per_step: int, profile_steps: int,
                what: str) -> None:
    print(f"\n{'impl':<12} {'median step ms':>15} {'tokens/s':>12} {'MoE ms/step':>12} "
          f"{'MoE share':>10} {'moefuse ops ms':>15} {'MoE span ms':>12}")
    for name, ms in medians.items():
        moe = moe_times.get(name)
        cols = "  (not profiled)"
        if moe is not None:
            ops = f"{moe['ops_ms']:15.2f}" if name.startswith("moefuse") else f"{'-':>15}"
            share = moe["moe_ms"] / moe["total_ms"] if moe["total_ms"] > 0 else float("nan")
            cols = f" {moe['moe_ms']:12.2f} {share:10.1%} {ops} {moe['span_ms']:12.2f}"
        print(f"{name:<12} {ms:15.2f} {tokens_per_step / ms * 1e3:12.0f}" + cols)
    if profile_steps > 0 and moe_times:
        print(f"MoE ms/step: the {what} time inside the MoE blocks' forward and backward "
              f"(router included) per step, over {profile_steps} profiled steps; share: of all "
              f"{what} time per step; moefuse ops: moefuse::experts_fwd + experts_bwd; "
              f"MoE span: the GPU time from the start to the end of each MoE block's forward "
              f"and backward, summed (CUDA; the kernel sums can disagree with the step time, "
              f"the spans add up with it)")
    for name, moe in moe_times.items():
        if moe and moe.get("kernels"):
            print(f"\n{name}: the longest kernels per step (ms, launches)")
            for kernel, ms, count in moe["kernels"]:
                print(f"  {ms:9.2f} {count:6.0f}  {_short_kernel_name(kernel)}")
    print()
    for name in medians:
        if name != "baseline" and "baseline" in medians:
            print(f"ratio: baseline step ms / {name} step ms = "
                  f"{medians['baseline'] / medians[name]:.3f}x")
    if "moefuse-fp8" in medians and "moefuse" in medians:
        print(f"ratio: moefuse step ms / moefuse-fp8 step ms = "
              f"{medians['moefuse'] / medians['moefuse-fp8']:.3f}x")
        bf16, fp8 = moe_times.get("moefuse"), moe_times.get("moefuse-fp8")
        if bf16 and fp8:
            key = "span_ms" if fp8["span_ms"] > 0 else "moe_ms"
            ratio = bf16[key] / fp8[key]
            ops = bf16["ops_ms"] / fp8["ops_ms"] if fp8["ops_ms"] > 0 else float("nan")
            verdict = "met" if ratio >= MOE_RATIO_TARGET else "MISSED"
            measure = "GPU spans" if key == "span_ms" else f"{what} time"
            print(f"MoE time bf16 / fp8 = {ratio:.3f}x ({measure}; moefuse ops' {what} time "
                  f"alone {ops:.3f}x): target >= {MOE_RATIO_TARGET}x {verdict}")


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("SKIP bench_train_step: no CUDA device (torch.cuda.is_available() is False)")
        return 0
    if device.type == "cpu" and not args.tiny:
        print("SKIP bench_train_step: --device cpu only with --tiny (the full model is a "
              "GPU benchmark)")
        return 0
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("SKIP bench_train_step: transformers is not installed")
        return 0
    import moefuse

    moefuse_skip = None
    try:
        moefuse._lib.load()
    except moefuse.LibraryNotFoundError as err:
        moefuse_skip = f"libmoefuse not loadable: {err}"
    if moefuse_skip is None:
        moefuse_skip = moefuse.backward_unsupported_reason(device)
        if moefuse_skip is not None:
            moefuse_skip = f"the library's backward on {device.type} is unsupported ({moefuse_skip})"

    base_model, config = build_model(args, device)
    tokens_per_step = args.micro_batches * args.batch * args.seq
    batches = make_batches(args.steps * args.micro_batches, args.batch, args.seq,
                           config.vocab_size, args.seed, device)
    batches = batches.view(args.steps, args.micro_batches, args.batch, args.seq)
    gm = baseline.grouped_mm_reason(device)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# device {dev_name}; Qwen3MoeForCausalLM, Qwen3-30B-A3B config with "
          f"{config.num_hidden_layers} layers (H={config.hidden_size}, I={config.moe_intermediate_size}, "
          f"E={config.num_experts}, K={config.num_experts_per_tok}, vocab={config.vocab_size}), "
          f"{sum(p.numel() for p in base_model.parameters()) / 1e9:.2f} B params")
    micro = (f"{args.micro_batches} micro-batches of " if args.micro_batches > 1 else "")
    print(f"# {args.steps} steps of {micro}{args.batch} x {args.seq} = "
          f"{args.batch * args.seq} tokens (per MoE call), {tokens_per_step} tokens a step, "
          f"pure bf16 params/grads/AdamW state (lr {args.lr}, no master weights, no "
          f"autocast); median over steps {args.warmup}..{args.steps - 1}")
    print(f"# baseline experts: {'torch._grouped_mm' if gm is None else 'per-expert loop (' + gm + ')'}; "
          f"library: {moefuse.library_path() if moefuse.is_available() else 'n/a'}")

    # The initial weights wait on the host while each model trains, so that only one
    # model's weights, gradients and AdamW state are on the device at a time (at 12 layers
    # a device-resident copy would take 16 GB of the H200's 140).
    base_model = base_model.to("cpu")
    runs, moe_times = {}, {}
    plans = [(moefuse_name(p), lambda b, p=p: moefuse.MoefuseQwen3MoeBlock.from_transformers(
                 b, precision=p)) for p in dict.fromkeys(args.precision)]
    plans.append(("baseline", baseline.TorchQwen3MoeBlock.from_transformers))
    for name, make_block in plans:
        if name.startswith("moefuse") and moefuse_skip is not None:
            print(f"SKIP {name} run: {moefuse_skip}")
            continue
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        model = swap_blocks(copy.deepcopy(base_model).to(device), make_block)
        try:
            losses, times, moe = train(model, batches, args, device, name)
        except moefuse.Fp8UnsupportedError as err:
            print(f"SKIP {name} run: {err}")
            continue
        if name.startswith("moefuse") and device.type == "cuda":
            moefuse.check_device_errors()
        runs[name] = (losses, times)
        moe_times[name] = moe
        del model
        if device.type == "cuda":
            print(f"# {name}: peak memory {torch.cuda.max_memory_allocated(device) / 1e9:.1f} GB")
            # the next run gets the memory of this one's model and moefuse layers back
            moefuse.ops.layer_cache.clear()
            torch.cuda.empty_cache()

    medians = {name: statistics.median(times[args.warmup:]) for name, (_, times) in runs.items()}
    print_times(medians, moe_times, tokens_per_step, args.profile_steps,
                "kernel" if device.type == "cuda" else "CPU")

    names = list(runs)
    pair = "moefuse" in runs and "baseline" in runs
    print("\nstep  " + "  ".join(f"{n:>11}" for n in names)
          + ("    |moefuse - baseline|" if pair else ""))
    for i in range(args.steps):
        vals = [runs[n][0][i] for n in names]
        diff = f"  {abs(runs['moefuse'][0][i] - runs['baseline'][0][i]):8.4f}" if pair else ""
        print(f"{i:4d}  " + "  ".join(f"{v:11.4f}" for v in vals) + diff)

    rc = 0
    if "moefuse-fp8" in runs and "moefuse" in runs:
        fp8_diff = max(abs(a - b) for a, b in zip(runs["moefuse-fp8"][0], runs["moefuse"][0]))
        print(f"max |loss_fp8 - loss_bf16| = {fp8_diff:.4f} over {args.steps} steps (FP8's "
              f"accuracy is judged by bench/train_parity.py's held-out loss, not here)")
    if pair:
        la, lb = runs["moefuse"][0], runs["baseline"][0]
        max_diff = max(abs(a - b) for a, b in zip(la, lb))
        finite = all(math.isfinite(v) for v in la + lb)
        ok = finite and max_diff <= args.loss_tol
        print(f"max |loss_moefuse - loss_baseline| = {max_diff:.4f} over {args.steps} steps "
              f"(tolerance {args.loss_tol}): {'PASS' if ok else 'FAIL'}")
        rc = 0 if ok else 1
    plot(args.plot, [(n, runs[n][0]) for n in names],
         f"Qwen3-30B-A3B x{config.num_hidden_layers} layers, {tokens_per_step} tokens/step")
    print(f"# total wall time {time.perf_counter() - t_start:.1f} s")
    return rc


if __name__ == "__main__":
    sys.exit(main())
