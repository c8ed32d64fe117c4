"""bench/bench_ep.py's options (CPU: parsed before any GPU or process group)."""

from __future__ import annotations

import os

import pytest
import torch

from bench_helpers import import_bench

pytestmark = pytest.mark.usefixtures("library")


def _bench_ep():
    return import_bench("bench_ep")


def test_bench_ep_test_modes_are_its_own_options():
    bench_ep = _bench_ep()
    args, rest = bench_ep.split_args(["--check", "--check-r1", "--iterations", "7",
                                      "--timeout-test", "--tokens", "8", "--bench"])
    assert args.check_r1 and args.iterations == 7 and args.timeout_test and args.bench
    assert rest == ["--check", "--tokens", "8"]  # the baseline's parser takes these
    # No abbreviations: --check is the baseline's, never a prefix of --check-r1.
    args, rest = bench_ep.split_args(["--check"])
    assert not args.check_r1 and args.iterations is None and rest == ["--check"]


@pytest.mark.parametrize("argv, message", [
    (["--iterations", "0"], "must be >= 1"),
    (["--iterations", "x"], "invalid _positive value"),
    (["--timeout-ms", "0"], "must be >= 1"),
])
def test_bench_ep_refuses_bad_values(argv, message, capsys):
    bench_ep = _bench_ep()
    with pytest.raises(SystemExit) as info:
        bench_ep.split_args(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, check, bench", [
    ([], False, True), ([], True, False), (["--check-r1"], False, False),
    (["--iterations", "3"], False, False), (["--timeout-test"], False, False),
    (["--check-r1", "--bench"], True, True),
])
def test_bench_ep_benches_by_default_only(argv, check, bench):
    bench_ep = _bench_ep()
    assert bench_ep.bench_wanted(bench_ep.split_args(argv)[0], check) is bench


def test_bench_ep_check_iterations():
    bench_ep = _bench_ep()
    assert bench_ep.check_iterations(1000) == [0, 1, 500, 999]
    assert bench_ep.check_iterations(1) == [0]
    assert bench_ep.check_iterations(2) == [0, 1]
    assert bench_ep.check_iterations(3) == [0, 1, 2]


def test_bench_ep_memory_estimate_follows_the_cuda_layout():
    """Workspace bytes per token (K slot rows) as src/cuda/pipeline/workspace.cu states them."""
    bench_ep = _bench_ep()
    assert 8 * bench_ep.slot_row_bytes(2048, 768) == 102_624
    assert 8 * bench_ep.slot_row_bytes(4096, 1536) == 205_216
    assert 8 * (bench_ep.slot_row_bytes(2048, 768, recompute=True)
                - bench_ep.slot_row_bytes(2048, 768)) == 24_576
    small = bench_ep.one_rank_bytes(16384 * 8, 2048, 768, 128, 8)
    large = bench_ep.one_rank_bytes(16384 * 8, 4096, 1536, 128, 8)
    assert 10 << 30 < small < large < 80 << 30


def test_bench_ep_help_and_skip_without_a_gpu():
    import pathlib
    import subprocess
    import sys
    script = pathlib.Path(__file__).resolve().parents[2] / "bench" / "bench_ep.py"
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0
    for flag in ("--check-r1", "--iterations N", "--timeout-test", "--bench"):
        assert flag in out.stdout
    bad = subprocess.run([sys.executable, str(script), "--iterations", "0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--iterations" in bad.stderr
    if torch.cuda.is_available():
        return  # with a GPU the script runs for real; the SKIP below is the CPU path
    out = subprocess.run([sys.executable, str(script), "--check-r1", "--iterations", "3",
                          "--timeout-test"], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, NCCL_NVLS_ENABLE="0"))
    assert out.returncode == 0 and out.stdout.startswith("SKIP bench_ep: no CUDA device")
