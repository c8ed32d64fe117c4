"""bench/bench_torchtitan.py on the CPU (TorchTitan's tiny Qwen3 MoE, its for-loop experts):
the four runs (native, moefuse, moefuse fp8, the for-loop control), the ratio and loss
lines; and the default layer counts of its memory arithmetic (the benchmark is a GPU run)."""

from __future__ import annotations

import re

import pytest

from bench_helpers import import_bench

pytest.importorskip("torchtitan", reason="TorchTitan is not installed")
pytestmark = pytest.mark.usefixtures("library")


def test_tiny_run_with_fp8_and_the_control(tmp_path, capsys):
    bench = import_bench("bench_torchtitan")
    rc = bench.main(["--device", "cpu", "--tiny", "--steps", "3", "--warmup", "1",
                     "--fp8", "--control", "--plot", str(tmp_path / "loss.png")])
    out = capsys.readouterr().out
    assert rc == 0, out
    for name in ("native", "moefuse", "moefuse-fp8", "native-loop"):
        row = re.search(rf"^{name} +([0-9.]+) +([0-9]+) ", out, re.M)
        assert row and float(row.group(1)) > 0, f"no timing row of {name}:\n{out}"
    assert re.search(r"^control: native [0-9.]+, native-loop [0-9.]+; max \|dloss\|", out, re.M)
    for name in ("moefuse", "moefuse-fp8"):
        assert re.search(rf"^native / {name}: step x[0-9.]+$", out, re.M), out
        verdict = re.search(rf"^loss: native [0-9.]+, {name} [0-9.]+ at step 2; .*: (PASS|FAIL) "
                            r"\(tolerance 0.05, or 2 x the control's [0-9.]+\)$", out, re.M)
        assert verdict and verdict.group(1) == "PASS", out
    assert (tmp_path / "loss.png").stat().st_size > 0


def test_layers_that_fit_the_measured_memory():
    bench = import_bench("bench_torchtitan")
    # total_memory of an H100 80GB and an H200, in GB (the docstring's counts)
    assert [bench.layers_that_fit("30B-A3B", 16384, gb) for gb in (85.0, 150.0)] == [5, 11]
    assert [bench.layers_that_fit("235B-A22B", 16384, gb) for gb in (85.0, 150.0)] == [1, 2]
    assert bench.layers_that_fit("235B-A22B", 16384, 60.0) == 0
