"""bench/train_parity.py on the CPU: the data split and order, and a few steps of its tiny
model in bf16 and fp8 (the script's check; the parity itself is a GPU run)."""

from __future__ import annotations

import csv

import pytest
import torch

from bench_helpers import import_bench

pytest.importorskip("transformers", reason="transformers is not installed")
pytestmark = pytest.mark.usefixtures("library")

parity = import_bench("train_parity")
text = import_bench("stdlib_text")


def train_losses(csv_path) -> dict:
    """{precision: [train loss of each step]} from the script's CSV."""
    losses = {}
    with open(csv_path) as f:
        for r in csv.DictReader(f):
            losses.setdefault(r["precision"], []).append(float(r["train_loss"]))
    return losses


def test_split_and_order_are_functions_of_the_names_and_the_seed():
    assert text.held_out("json/decoder.py") == text.held_out("json/decoder.py")
    names = [f"pkg/module_{i}.py" for i in range(2000)]
    share = sum(map(text.held_out, names)) / len(names)
    assert 0.03 < share < 0.07  # about 1 in 20
    stream = torch.arange(250, dtype=torch.int64).to(torch.uint8)  # window w starts at 4w
    a, b = text.Batches(stream, 3, 4, seed=1), text.Batches(stream, 3, 4, seed=1)
    firsts = [a.batch_at(s) for s in range(25)]  # 62 windows: past one pass
    assert all(torch.equal(x, b.batch_at(s)) for s, x in enumerate(firsts))
    assert firsts[0].shape == (3, 5)
    assert all(torch.equal(row, stream[int(row[0]):int(row[0]) + 5]) for x in firsts for row in x)
    starts = [int(row[0]) for x in firsts for row in x]
    assert sorted(starts[:62]) == list(range(0, 248, 4))  # each window once per pass
    assert not torch.equal(firsts[0], text.Batches(stream, 3, 16, seed=2).batch_at(0))


def test_tiny_run_writes_both_curves(tmp_path, capsys):
    rc = parity.main(["--tiny", "--device", "cpu", "--steps", "4", "--eval-every", "2",
                      "--batch", "2", "--seq", "64", "--eval-seqs", "2", "--warmup", "1",
                      "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "final held-out loss at step 4" in out and "relative gap" in out
    assert "tokens/s" in out
    with open(tmp_path / "parity.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["precision"], r["step"]) for r in rows] == [
        (p, str(s)) for p in ("bf16", "fp8") for s in range(1, 5)]
    heldout = {(r["precision"], r["step"]): r["heldout_loss"] for r in rows}
    assert all(heldout[(p, s)] for p in ("bf16", "fp8") for s in ("2", "4"))
    assert not heldout[("bf16", "1")]
    losses = {p: [float(r["train_loss"]) for r in rows if r["precision"] == p]
              for p in ("bf16", "fp8")}
    assert losses["bf16"][0] == pytest.approx(losses["fp8"][0], rel=0.01)  # same weights, data
    assert losses["bf16"] != losses["fp8"]
    assert (tmp_path / "heldout_loss.png").stat().st_size > 0


def test_emulated_precisions_follow_the_library(tmp_path, capsys):
    rc = parity.main(["--tiny", "--device", "cpu", "--steps", "3", "--eval-every", "3",
                      "--batch", "2", "--seq", "64", "--eval-seqs", "2", "--warmup", "1",
                      "--precisions", "bf16", "fp8", "emul:all", "emul:none", "emul:all-dw2",
                      "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    for name in ("fp8", "emul:all", "emul:none", "emul:all-dw2"):
        assert f"final held-out loss at step 3: bf16 " in out and f", {name} " in out, out
    losses = train_losses(tmp_path / "parity.csv")
    # the emulation is the library's recipe (fp32 sums in another order)
    assert losses["emul:all"] == pytest.approx(losses["fp8"], rel=1e-3)
    assert losses["emul:none"] == pytest.approx(losses["bf16"], rel=1e-3)


def test_unknown_precision_is_refused(capsys):
    with pytest.raises(SystemExit):
        parity.parse_args(["--precisions", "bf16", "emul:gemm7"])
    assert "emul:gemm7" in capsys.readouterr().err


def test_a_seeded_run_starts_from_other_weights_on_the_same_data(tmp_path, capsys):
    """precision@seed: that precision from another seed's initial weights, the batches
    unchanged (bf16@0 is bf16 itself when --seed is 0); a bad seed is refused."""
    rc = parity.main(["--tiny", "--device", "cpu", "--steps", "2", "--eval-every", "2",
                      "--batch", "2", "--seq", "64", "--eval-seqs", "2", "--warmup", "1",
                      "--precisions", "bf16", "bf16@0", "bf16@1", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "final held-out loss at step 2: bf16 " in out and ", bf16@1 " in out, out
    losses = train_losses(tmp_path / "parity.csv")
    assert losses["bf16@0"] == losses["bf16"]
    assert losses["bf16@1"][0] != losses["bf16"][0]
    with pytest.raises(SystemExit):
        parity.parse_args(["--precisions", "bf16@one"])
    assert "bf16@one" in capsys.readouterr().err


def test_deterministic_mode_runs_the_library_and_the_emulation(tmp_path, capsys, monkeypatch):
    """--deterministic turns on PyTorch's deterministic algorithms for the run (which then
    refuse the kernels that are not) with cuBLAS's fixed workspace; the library's layer and
    the emulation run under it, and a repeat of one seed trains alike."""
    env = {k: v for k, v in parity.os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    monkeypatch.setattr(parity.os, "environ", env)  # the process's own comes back after
    try:
        rc = parity.main(["--tiny", "--device", "cpu", "--steps", "2", "--eval-every", "2",
                          "--batch", "2", "--seq", "64", "--eval-seqs", "2", "--warmup", "1",
                          "--deterministic", "--precisions", "bf16", "bf16@0", "fp8",
                          "emul:all", "--out", str(tmp_path)])
        enabled = torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert enabled
    assert env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    losses = train_losses(tmp_path / "parity.csv")
    assert losses["bf16@0"] == losses["bf16"]
    assert len(losses["emul:all"]) == len(losses["fp8"]) == 2
