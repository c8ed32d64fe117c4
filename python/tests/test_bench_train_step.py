"""bench/bench_train_step.py on the CPU with its tiny model: the three runs (moefuse bf16,
moefuse fp8, the baseline), their MoE time from the profiler and the ratio lines (the
script's check; the benchmark is a GPU run)."""

from __future__ import annotations

import re

import pytest

from bench_helpers import import_bench

pytest.importorskip("transformers", reason="transformers is not installed")
pytestmark = pytest.mark.usefixtures("library")


def test_tiny_run_with_the_fp8_column(tmp_path, capsys):
    bench = import_bench("bench_train_step")
    rc = bench.main(["--tiny", "--device", "cpu", "--steps", "6", "--warmup", "5",
                     "--batch", "1", "--seq", "64", "--layers", "1", "--profile-steps", "1",
                     "--precision", "bf16", "fp8", "--plot", str(tmp_path / "curves.png")])
    out = capsys.readouterr().out
    assert rc == 0, out
    for name in ("moefuse", "moefuse-fp8", "baseline"):
        row = re.search(rf"^{name} +([0-9.]+) +([0-9]+) +([0-9.]+) +([0-9.]+)%", out, re.M)
        assert row, f"no timing row of {name}:\n{out}"
        assert float(row.group(3)) > 0 and 0 < float(row.group(4)) <= 100
    assert re.search(r"MoE time bf16 / fp8 = [0-9.]+x \(CPU time; moefuse ops' CPU time "
                     r"alone [0-9.]+x\): target >= 1.35x (met|MISSED)", out)
    assert "max |loss_moefuse - loss_baseline|" in out and "PASS" in out
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_micro_batches_accumulate_into_one_optimizer_step():
    """train_step over M micro-batches: the mean of their losses, the gradients of that
    mean (the sum of each micro-batch's, over M), and one optimizer step."""
    import torch

    bench = import_bench("bench_train_step")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)

    class Out:
        def __init__(self, loss):
            self.loss = loss

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, input_ids, labels):
            return Out(self.inner(input_ids.float()).square().mean())

    wrapped = Model()
    tokens = torch.randint(0, 5, (3, 2, 4))
    steps = []
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.0)
    opt.register_step_post_hook(lambda *_: steps.append(1))
    loss = bench.train_step(wrapped, opt, tokens)
    want = sum(wrapped(input_ids=t, labels=t).loss for t in tokens) / 3
    assert torch.allclose(loss, want.detach())
    grads = [p.grad.clone() for p in wrapped.parameters()]
    wrapped.zero_grad()
    want.backward()
    for got, ref in zip(grads, (p.grad for p in wrapped.parameters())):
        assert torch.allclose(got, ref)
    assert len(steps) == 1


def test_tiny_run_with_micro_batches(tmp_path, capsys):
    bench = import_bench("bench_train_step")
    rc = bench.main(["--tiny", "--device", "cpu", "--steps", "6", "--warmup", "5",
                     "--batch", "1", "--seq", "32", "--layers", "1", "--profile-steps", "0",
                     "--micro-batches", "2", "--plot", str(tmp_path / "curves.png")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "2 micro-batches of 1 x 32 = 32 tokens (per MoE call), 64 tokens a step" in out
    row = re.search(r"^moefuse +([0-9.]+) +([0-9]+)", out, re.M)
    # tokens/s of the 64 tokens a step (from the unrounded ms)
    assert row and float(row.group(2)) == pytest.approx(64 / float(row.group(1)) * 1e3, rel=0.01)


def test_kernel_names_keep_what_tells_them_apart():
    bench = import_bench("bench_train_step")
    name = ("void (anonymous namespace)::sm90_wgrad_grouped_kernel<mf::sm90::TileConfig<"
            "mf::sm90::Fp8E4m3TokenScaled<128>, 128, 4, false, false, 0, 512, 32>>"
            "(mf::sm90::WgradArgs)")
    assert bench._short_kernel_name(name) == (
        "sm90_wgrad_grouped_kernel<TileConfig<Fp8E4m3TokenScaled<128>, 128, 4, false, false, "
        "0, 512, 32>>(WgradArgs)")
    cut = bench._short_kernel_name("k" * 50 + "x" * 200 + "tail", width=40)
    assert len(cut) == 40 and cut.startswith("k" * 18) and cut.endswith("x" * 14 + "tail")


def test_device_time_leaves_out_the_profilers_overhead_records():
    """An overhead record (CUPTI's "Activity Buffer Request") that the profiler files under
    an op carries the op's kernels again: device_us counts them once, where
    FunctionEvent.device_time_total counts them twice."""
    from collections import namedtuple

    bench = import_bench("bench_train_step")
    kernel = namedtuple("Kernel", "duration")

    class Event:
        def __init__(self, name, kernels=(), children=(), is_async=False):
            self.name, self.kernels, self.cpu_children = name, list(kernels), list(children)
            self.is_async = is_async

    op_kernels = [kernel(5.0), kernel(7.0)]
    op = Event("moefuse::experts_bwd", op_kernels,
               [Event("cudaLaunchKernel"), Event("Activity Buffer Request", op_kernels)])
    block = Event("moe_block_backward", (), [op, Event("aten::mul", [kernel(1.5)])])
    assert bench.device_us(op) == 12.0
    assert bench.device_us(block) == 13.5
    assert bench.device_us(Event("moe_block_forward", [kernel(3.0)], is_async=True)) == 0.0
