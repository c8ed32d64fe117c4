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
