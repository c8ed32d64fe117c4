"""TorchTitan's own training step on one GPU, its Qwen3 MoE model as TorchTitan runs it
(native) and with moefuse computing the routed experts (moefuse.torchtitan.apply), in
the same run, from the same weights and on the same data.

    Model      torchtitan.models.qwen3 (TorchTitan 0.2.2), --model debugmodel_moe (the
               default), 30B-A3B or 235B-A22B, truncated to --layers transformer blocks.
    Step       TorchTitan's pieces, as its Trainer puts them together on one GPU: the
               train spec's parallelize_fn (TorchTitan's per-module torch.compile, the
               inductor backend, unless --no-compile; its activation checkpointing when
               --ac is not none; no FSDP on one rank), fp32 parameters under autocast to
               bf16 (its maybe_enable_amp), its cross-entropy loss (compiled, summed and
               divided by the token count), its gradient clipping (max_norm 1.0), its
               AdamW (lr --lr, fused) and its linear warmup schedule (--steps / 10).
    Data       --batch x --seq tokens per step (default 4 x 4096 = 16384 tokens per MoE
               call) from a random Markov chain (bench_train_step.make_batches): the same
               batches, labels the inputs shifted by one, for both runs.
    Weights    initialized once by TorchTitan's init_weights (seed --seed) and loaded
               into both models before parallelize_fn.

Prints per implementation: median step ms (CUDA events, steps after --warmup), tokens/s,
MFU (TorchTitan's flops per token and its peak table for the GPU), the MoE layers'
forward and backward ms per step (summed over the layers; CUDA events on the MoE
modules' boundaries in --moe-steps extra steps, run with --ac none only) and their share
of the step, and the peak memory; then the ratios, the loss curves' agreement
(max |dloss| and the mean |dloss| of the last 50 steps, PASS when the latter is within
--loss-tol, or within twice the control's when --control runs TorchTitan's for-loop
experts too: docs/decisions/0027-torchtitan-loss-control) and a PNG of the curves (--plot,
default $OUT/torchtitan_loss.png). --fp8 adds moefuse with its expert GEMMs in FP8.
--profile-steps N also runs N steps under torch.profiler per implementation and prints
the 15 CUDA kernels that took the most time (trace in $OUT when set).

How many layers fit: fp32 parameters, gradients and AdamW's two moments cost 16 bytes per
parameter. 30B-A3B: 10 GB for the embedding and output (2 x 151936 x 2048), 10 GB per
layer (623M parameters, 604M of them experts). Measured on an H100 at 16384 tokens per
step, compiled, TorchTitan native (the larger of the two): a peak of 40.9 GB with 2
layers and 63.5 GB with 4, so 11.3 GB per layer (its activations ~1.3 GB) and ~8 GB at
the loss. 235B-A22B: 20 GB of embedding and output, 40 GB per layer (2.49B parameters);
one layer at 4096 tokens peaked at 60.3 GB. The default --layers is the most that this
arithmetic (MEMORY_GB, with activations and loss scaled by the tokens) fits into the
GPU's memory less 3 GB (layers_that_fit): 30B-A3B 5 on an H100, 11 on an H200;
235B-A22B 1 on an H100, 2 on an H200. The peak memory printed per run says how close.

Running it on the GPU machine (no registry there; torch 2.11, Python 3.12, transformers,
pandas, pyarrow, tensorboard, einops, tokenizers are installed): fetch the wheels here,

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux_2_28_x86_64 \\
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \\
        torchtitan==0.2.2 torchdata==0.11.0 datasets==5.2.0 dill==0.4.1 \\
        multiprocess==0.70.19 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 \\
        tomli==2.5.0

(1.9 MB), carry .whl (and the built library) and start the command with

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit;
    make -j lib && MOEFUSE_LIB=$PWD/build/libmoefuse.so python3 bench/bench_torchtitan.py \\
        --steps 200                                # debugmodel_moe: the loss comparison
    ... python3 bench/bench_torchtitan.py --model 30B-A3B --steps 30 --warmup 10

A CPU check of the script (no compile, TorchTitan's for-loop experts):
    python3 bench/bench_torchtitan.py --device cpu --tiny --steps 2 --warmup 1
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import pathlib
import statistics
import sys
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "python"))  # the checkout's package, when not installed

from bench_train_step import make_batches  # noqa: E402
from loss_plot import plot  # noqa: E402

MODELS = ("debugmodel_moe", "30B-A3B", "235B-A22B")
IMPLS = ("native", "moefuse")
FP8 = "moefuse-fp8"       # moefuse.torchtitan.apply(model, precision="fp8") (--fp8)
CONTROL = "native-loop"   # TorchTitan with its for-loop experts (--control)
# GB per model at 16384 tokens per step (the docstring's arithmetic and measures): the
# state (fp32 parameters, gradients, AdamW's moments) of the embedding and output, the
# loss's logits, and per layer its activations and its state.
MEMORY_GB = {"30B-A3B": (10, 9, 1.5, 10), "235B-A22B": (20, 9, 3, 40)}
HEADROOM_GB = 3


def layers_that_fit(model: str, tokens: int, gpu_gb: float) -> int:
    """The most transformer blocks of `model` whose training state and activations fit
    gpu_gb at `tokens` per step, by MEMORY_GB (logits and activations scale with tokens)."""
    outside, logits, activations, state = MEMORY_GB[model]
    scale = tokens / 16384
    free = gpu_gb - HEADROOM_GB - outside - logits * scale
    return max(0, int(free // (state + activations * scale)))


def parse_args(argv=None):
    out = os.environ.get("OUT")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=MODELS, default="debugmodel_moe")
    ap.add_argument("--layers", type=int, default=None,
                    help="transformer blocks (default: debugmodel_moe's 8; for 30B-A3B and "
                         "235B-A22B the most that fit the GPU, see the docstring)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10, help="steps left out of the median")
    ap.add_argument("--lr", type=float, default=8e-4, help="TorchTitan's default")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--impl", choices=IMPLS + ("both",), default="both")
    ap.add_argument("--fp8", action="store_true",
                    help="also run moefuse with its expert GEMMs in block-scaled FP8")
    ap.add_argument("--control", action="store_true",
                    help="also run TorchTitan with its for-loop experts (the same math, other "
                         "roundings): how far two correct implementations drift apart here")
    ap.add_argument("--no-compile", action="store_true",
                    help="eager (compile is on by default on CUDA, off on the CPU)")
    ap.add_argument("--ac", choices=("none", "selective", "full"), default="none",
                    help="TorchTitan's activation checkpointing mode")
    ap.add_argument("--moe-steps", type=int, default=5,
                    help="extra steps that time the MoE layers (0: none)")
    ap.add_argument("--profile-steps", type=int, default=0)
    ap.add_argument("--loss-tol", type=float, default=0.05,
                    help="mean |loss_native - loss_moefuse| (nats) of the last 50 steps for PASS")
    ap.add_argument("--plot", type=pathlib.Path,
                    default=pathlib.Path(out or HERE) / "torchtitan_loss.png")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu with --tiny (a script check)")
    ap.add_argument("--tiny", action="store_true", help="a CPU-sized debugmodel_moe")
    args = ap.parse_args(argv)
    if args.steps <= args.warmup:
        ap.error("--steps must exceed --warmup")
    if args.device == "cpu" and not args.tiny:
        ap.error("--device cpu needs --tiny")
    device = torch.device(args.device)
    args.memory_gb = None
    if (args.layers is None and args.model in MEMORY_GB and not args.tiny
            and device.type == "cuda" and torch.cuda.is_available()):   # else main() skips
        args.memory_gb = torch.cuda.get_device_properties(device).total_memory / 1e9
        args.layers = layers_that_fit(args.model, args.batch * args.seq, args.memory_gb)
    args.compile = args.device == "cuda" and not args.no_compile
    return args


# ---- TorchTitan's pieces -------------------------------------------------------------------


def cpu_histc_for_integers():
    """TorchTitan 0.2.2's router calls torch.histc on int64 ids, which PyTorch implements
    on CUDA only; on the CPU (script checks) it goes through float, exactly."""
    histc = torch.histc

    def histc_int_on_cpu(input, *a, **k):
        if input.device.type == "cpu" and not input.is_floating_point():
            return histc(input.float(), *a, **k).to(input.dtype)
        return histc(input, *a, **k)

    torch.histc = histc_int_on_cpu


def titan_config(args):
    from torchtitan.config import JobConfig
    from torchtitan.models.qwen3 import qwen3_args

    margs = copy.deepcopy(qwen3_args[args.model])
    if args.layers:
        margs.n_layers = args.layers
    if args.tiny:
        margs.dim, margs.n_heads, margs.n_kv_heads, margs.head_dim = 64, 4, 2, 16
        margs.vocab_size, margs.hidden_dim, margs.moe_inter_dim = 256, 128, 32
        margs.n_layers = args.layers or 2
        margs.moe_args.num_experts, margs.moe_args.top_k = 16, 4
    if args.device == "cpu":  # TorchTitan's grouped-mm experts need Triton
        margs.moe_args.use_grouped_mm = False
    margs.max_seq_len = args.seq

    job = JobConfig()
    job.training.seq_len, job.training.local_batch_size = args.seq, args.batch
    job.training.steps = args.steps
    job.compile.enable = args.compile
    job.activation_checkpoint.mode = args.ac
    job.optimizer.lr = args.lr
    job.lr_scheduler.warmup_steps = max(1, args.steps // 10)
    return margs, job


def initial_weights(spec, margs, device, seed):
    torch.manual_seed(seed)
    with torch.device(device):
        model = spec.model_cls(margs)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


class Trainer:
    """One model, its optimizer, schedule and loss, as TorchTitan's Trainer builds them."""

    def __init__(self, impl, spec, margs, job, weights, device):
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed.utils import maybe_enable_amp

        if impl == CONTROL:
            margs = copy.deepcopy(margs)
            margs.moe_args.use_grouped_mm = False
        with torch.device("meta"):
            model = spec.model_cls(margs)
        if impl in ("moefuse", FP8):
            import moefuse.torchtitan

            moefuse.torchtitan.apply(model, precision="fp8" if impl == FP8 else "bf16")
        model.to_empty(device=device)
        with torch.no_grad():
            model.init_weights(buffer_device=device)  # the non-persistent buffers
        model.load_state_dict(weights, strict=True)
        self.parallel_dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1,
                                          etp=1, world_size=1)
        self.model = spec.parallelize_fn(model, self.parallel_dims, job)
        self.model.train()
        self.optimizers = spec.build_optimizers_fn([self.model], job.optimizer,
                                                   self.parallel_dims)
        self.lr_schedulers = spec.build_lr_schedulers_fn(self.optimizers, job.lr_scheduler,
                                                         job.training.steps)
        self.loss_fn = spec.build_loss_fn(job)
        self.amp = maybe_enable_amp(self.parallel_dims, job.training.mixed_precision_param,
                                    device.type)
        self.max_norm = job.training.max_norm

    def step(self, tokens):
        from torchtitan.distributed import utils as dist_utils

        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        self.optimizers.zero_grad()
        with self.amp:
            pred = self.model(inputs)
            loss = self.loss_fn(pred, labels) / labels.numel()
        del pred
        loss.backward()
        dist_utils.clip_grad_norm_([p for p in self.model.parameters()], self.max_norm,
                                   foreach=True)
        self.optimizers.step()
        self.lr_schedulers.step()
        return loss.detach()


# ---- timing ------------------------------------------------------------------------------


class _Mark(torch.autograd.Function):
    """Identity whose backward records a CUDA event: brackets a module's backward."""

    @staticmethod
    def forward(ctx, x, event):
        ctx.event = event
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.event.record()
        return grad, None


class MoETimer:
    """CUDA events on every TorchTitan MoE module's forward and backward boundaries."""

    def __init__(self, model):
        from torchtitan.models.moe import MoE

        self.pairs = []  # (kind, start event, end event)
        self.handles = []
        for m in model.modules():
            if isinstance(m, MoE):
                self.handles += [m.register_forward_pre_hook(self._pre),
                                 m.register_forward_hook(self._post)]

    def _event(self):
        return torch.cuda.Event(enable_timing=True)

    def _pre(self, module, inputs):
        f0, b1 = self._event(), self._event()
        f0.record()
        module._bench_events = (f0, b1)
        return (_Mark.apply(inputs[0], b1),) + tuple(inputs[1:])

    def _post(self, module, inputs, output):
        f0, b1 = module._bench_events
        f1, b0 = self._event(), self._event()
        f1.record()
        self.pairs += [("fwd", f0, f1), ("bwd", b0, b1)]
        return _Mark.apply(output, b0)

    def per_step_ms(self, steps):
        torch.cuda.synchronize()
        total = {"fwd": 0.0, "bwd": 0.0}
        for kind, a, b in self.pairs:
            total[kind] += a.elapsed_time(b)
        return {k: v / steps for k, v in total.items()}

    def remove(self):
        for h in self.handles:
            h.remove()


def run(impl, args, spec, margs, job, weights, batches, device):
    from torchtitan.tools.utils import get_peak_flops

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch._dynamo.reset()
    torch.manual_seed(args.seed)
    trainer = Trainer(impl, spec, margs, job, weights, device)
    losses, times = [], []
    for i, tokens in enumerate(batches):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        losses.append(trainer.step(tokens))
        if device.type == "cuda":
            end.record()
            times.append((start, end))
        else:
            times.append((time.perf_counter() - t0) * 1e3)
        if i == 0:
            print(f"  {impl}: step 0 loss {losses[0].item():.4f}", flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
        times = [a.elapsed_time(b) for a, b in times]
    step_ms = statistics.median(times[args.warmup:])
    tokens_per_step = args.batch * args.seq
    res = {"impl": impl, "losses": [float(l.item()) for l in losses], "step_ms": step_ms,
           "tokens_s": tokens_per_step / (step_ms / 1e3)}
    peak = get_peak_flops(torch.cuda.get_device_name()) if device.type == "cuda" else None
    res["mfu"] = (100.0 * args.flops_per_token * res["tokens_s"] / peak) if peak else None

    if device.type == "cuda" and args.moe_steps > 0 and args.ac == "none":
        timer = MoETimer(trainer.model)
        for tokens in batches[-args.moe_steps:]:
            trainer.step(tokens)
        res["moe"] = timer.per_step_ms(args.moe_steps)
        timer.remove()
    if args.profile_steps > 0:
        profile(trainer, batches[-args.profile_steps:], impl, device)
    res["peak_gb"] = (torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda"
                      else None)
    del trainer
    return res


def profile(trainer, batches, impl, device):
    from torch.profiler import ProfilerActivity, profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=acts) as prof:
        for tokens in batches:
            trainer.step(tokens)
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"-- {impl}: torch.profiler, {len(batches)} steps, top 15 by {key}")
    print(prof.key_averages().table(sort_by=key, row_limit=15))
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        prof.export_chrome_trace(os.path.join(os.environ["OUT"], f"torchtitan_{impl}_trace.json"))


# ---- main ------------------------------------------------------------------------------------


def fmt(v, spec):
    return format(v, spec) if v is not None else format("n/a", ">" + spec.split(".")[0])


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("SKIP bench_torchtitan: no CUDA device")
        return 0
    try:
        import torchtitan  # noqa: F401
    except ImportError as err:
        print(f"SKIP bench_torchtitan: TorchTitan is not installed ({err}); see the docstring")
        return 0
    from torchtitan.models.qwen3 import get_train_spec

    if args.layers == 0:
        print(f"SKIP bench_torchtitan {args.model}: not one layer fits this GPU's "
              f"{args.memory_gb:.0f} GB at {args.batch * args.seq} tokens per step by the "
              "docstring's arithmetic; fewer tokens (--batch), or --layers to try anyway")
        return 0

    if device.type == "cpu":
        cpu_histc_for_integers()
    spec = get_train_spec()
    margs, job = titan_config(args)
    with torch.device("meta"):
        _, args.flops_per_token = margs.get_nparams_and_flops(spec.model_cls(margs), args.seq)
    print(f"TorchTitan {torchtitan_version()} qwen3 {args.model}{' (tiny)' if args.tiny else ''}: "
          f"{margs.n_layers} layers, D={margs.dim} F={margs.moe_inter_dim} "
          f"E={margs.moe_args.num_experts} K={margs.moe_args.top_k}; {args.batch} x {args.seq} "
          f"tokens, {args.steps} steps, compile {'on' if args.compile else 'off'}, ac {args.ac}, "
          f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}")
    weights = initial_weights(spec, margs, device, args.seed)
    batches = make_batches(args.steps, args.batch, args.seq + 1, margs.vocab_size, args.seed,
                           device)
    batches = list(batches)
    impls = IMPLS if args.impl == "both" else (args.impl,)
    if args.impl == "both":
        impls += (FP8,) * args.fp8 + (CONTROL,) * args.control
    results = [run(impl, args, spec, margs, job, weights, batches, device) for impl in impls]

    print(f"{'impl':11s} {'step ms':>9s} {'tokens/s':>10s} {'MFU %':>6s} {'MoE fwd':>8s} "
          f"{'MoE bwd':>8s} {'MoE %':>6s} {'peak GB':>8s}")
    for r in results:
        moe = r.get("moe")
        moe_ms = moe["fwd"] + moe["bwd"] if moe else None
        print(f"{r['impl']:11s} {r['step_ms']:9.2f} {r['tokens_s']:10.0f} {fmt(r['mfu'], '6.2f')} "
              f"{fmt(moe and moe['fwd'], '8.2f')} {fmt(moe and moe['bwd'], '8.2f')} "
              f"{fmt(moe_ms and 100 * moe_ms / r['step_ms'], '6.1f')} {fmt(r['peak_gb'], '8.1f')}")
    if len(results) < 2:
        return 0
    nat = results[0]
    by_impl = {r["impl"]: r for r in results}
    control = None
    if CONTROL in by_impl:
        # Past a loss spike two correct implementations drift apart (their roundings
        # differ): how far TorchTitan's own two expert implementations do on this run.
        ctl_max, control, tail = loss_drift(nat, by_impl[CONTROL])
        print(f"control: native {nat['losses'][-1]:.4f}, {CONTROL} "
              f"{by_impl[CONTROL]['losses'][-1]:.4f}; max |dloss| {ctl_max:.4f}, mean |dloss| "
              f"of the last {tail} steps {control:.4f}")
    ok = True
    for mf in (by_impl[i] for i in ("moefuse", FP8) if i in by_impl):
        ok = compare(nat, mf, args.loss_tol, control) and ok
    plot(args.plot, [(PLOT_LABELS[r["impl"]], r["losses"]) for r in results],
         f"TorchTitan qwen3 {args.model}, {margs.n_layers} layers: loss")
    return 0 if ok else 1


PLOT_LABELS = {"native": "torchtitan", "moefuse": "torchtitan + moefuse",
               FP8: "torchtitan + moefuse fp8", CONTROL: "torchtitan, for-loop experts"}


def compare(nat, mf, loss_tol, control):
    """Prints native / mf's speed-ups and their loss curves' agreement: PASS where the mean
    |dloss| of the last 50 steps is within loss_tol, or within twice the control's
    (TorchTitan's for-loop experts against native) when it ran. Returns PASS."""
    name = mf["impl"]
    line = f"native / {name}: step x{nat['step_ms'] / mf['step_ms']:.3f}"
    if nat.get("moe") and mf.get("moe"):
        n_moe, m_moe = (sum(r["moe"].values()) for r in (nat, mf))
        line += (f", MoE layers x{n_moe / m_moe:.3f} (fwd x{nat['moe']['fwd'] / mf['moe']['fwd']:.3f},"
                 f" bwd x{nat['moe']['bwd'] / mf['moe']['bwd']:.3f})")
    print(line)
    max_diff, mean_tail, tail = loss_drift(nat, mf)
    ok = mean_tail <= loss_tol
    verdict = f"tolerance {loss_tol}"
    if control is not None:
        ok = ok or mean_tail <= 2 * control
        verdict += f", or 2 x the control's {control:.4f}"
    print(f"loss: native {nat['losses'][-1]:.4f}, {name} {mf['losses'][-1]:.4f} at step "
          f"{len(nat['losses']) - 1}; max |dloss| {max_diff:.4f}, mean |dloss| of the last {tail} "
          f"steps {mean_tail:.4f}: {'PASS' if ok else 'FAIL'} ({verdict})")
    return ok


def loss_drift(a, b):
    """max |dloss| over the run, mean |dloss| of the last 50 steps, and how many those are."""
    diffs = [abs(x - y) for x, y in zip(a["losses"], b["losses"])]
    tail = diffs[-50:]
    return max(diffs), sum(tail) / len(tail), len(tail)


def torchtitan_version() -> str:
    from importlib.metadata import version

    return version("torchtitan")


if __name__ == "__main__":
    sys.exit(main())
