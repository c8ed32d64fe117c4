"""bench/torch_moe_ep_baseline.py, the expert-parallel PyTorch baseline, on the CPU (gloo):
its argument handling, and real multi-process runs of its --check (y and the gradients of
x, p and each rank's expert shard against one process computing the global batch in a
wider dtype) on tiny problems with uneven T per rank, a rank with T = 0, skewed routing
(every slot to the last rank's experts) and dropped slots.

Multi-process runs: 4 ranks as forked processes calling the script's main() (fast: torch
is already imported), and 2 ranks through the real `torchrun --standalone` command line.
"""

from __future__ import annotations

import multiprocessing
import os
import pathlib
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "torch_moe_ep_baseline.py"
sys.path.insert(0, str(SCRIPT.parent))
import torch_moe_ep_baseline as ep  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not built")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------
# Argument handling (in-process: validation happens before any process group exists).

@pytest.fixture
def world(monkeypatch):
    """Pretend to be rank 0 of a torchrun job of the given size."""
    def set_world(size: int, local: int | None = None):
        monkeypatch.setenv("WORLD_SIZE", str(size))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(size if local is None else local))
        monkeypatch.setenv("RANK", "0")
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "NCCL_NVLS_ENABLE"):
        monkeypatch.delenv(name, raising=False)
    return set_world


def _parse_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        ep.parse_args(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--model", "qwen3-1t"], "invalid choice: 'qwen3-1t'"),
    (["--model", "tiny", "--tokens", "-1"], "token counts must be >= 0"),
    (["--model", "tiny", "--tokens", "4,x"], "want a token count or a comma list"),
    (["--model", "tiny", "--tokens", "4,0,5", "--device", "cpu"], "3 counts for 2 ranks"),
    (["--model", "tiny", "--device", "tpu"], "invalid choice: 'tpu'"),
    (["--model", "tiny", "--reps", "0", "--device", "cpu"], "must be >= 1"),
    (["--model", "tiny", "--dtype", "fp8"], "invalid choice: 'fp8'"),
])
def test_bad_values(argv, message, world, capsys):
    world(2)
    assert message in _parse_error(argv, capsys)


def test_experts_not_divisible_by_world(world, capsys):
    world(3)
    err = _parse_error(["--model", "tiny", "--device", "cpu"], capsys)
    assert "E=8 experts, not divisible by the world size 3" in err


def test_one_rank_routing_needs_top_k_experts_per_rank(world, capsys):
    world(8)  # 1 expert per rank < top_k = 2
    err = _parse_error(["--model", "tiny", "--device", "cpu", "--routing", "one-rank"], capsys)
    assert "top_k=2 <= experts per rank 1" in err


def test_cuda_without_gpus(world, capsys, monkeypatch):
    world(2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _parse_error(["--model", "tiny", "--device", "cuda"], capsys)
    assert "no CUDA GPU is visible" in err


def test_cuda_fewer_gpus_than_ranks(world, capsys, monkeypatch):
    world(4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    err = _parse_error(["--model", "tiny", "--device", "cuda"], capsys)
    assert "4 ranks on this node need 4 GPUs, 2 visible" in err


def test_nvls_must_stay_off(world, capsys, monkeypatch):
    world(2)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    assert "NVLink multicast must stay off" in _parse_error(
        ["--model", "tiny", "--device", "cpu"], capsys)


def test_good_values(world):
    world(4)
    args = ep.parse_args(["--model", "tiny", "--device", "cpu", "--tokens", "3", "7,0,1,2"])
    assert args.tokens == [[3, 3, 3, 3], [7, 0, 1, 2]]
    assert args.dtype == torch.float32 and args.bench and not args.check


def test_bad_argument_exits_nonzero_from_the_command_line():
    env = dict(os.environ, WORLD_SIZE="3", LOCAL_WORLD_SIZE="3")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "--device", "cpu"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "not divisible by the world size 3" in proc.stderr


# ---------------------------------------------------------------------------------------
# Real runs.

def _rank_main(rank: int, world: int, port: int, argv, patch):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    os.environ.pop("NCCL_NVLS_ENABLE", None)
    torch.set_num_threads(1)
    if patch is not None:
        patch()
    code = 1
    try:
        code = ep.main(argv)
    finally:
        sys.stdout.flush()
        os._exit(code)


def _run_ranks(world: int, argv, patch=None, timeout: float = 60) -> list:
    """Runs main(argv) as `world` ranks in fresh processes; returns their exit codes.

    spawn, not fork: on a GPU machine earlier tests of this pytest process have made a
    CUDA context, which a forked child cannot use (the script asks for the device)."""
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, argv, patch))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return codes


TINY_CHECK = ["--model", "tiny", "--device", "cpu", "--check", "--routing",
              "uniform", "one-rank", "dropped"]


@pytest.mark.parametrize("experts", ["loop", "grouped"])
def test_four_ranks_check(experts, capfd):
    codes = _run_ranks(4, TINY_CHECK + ["--experts", experts, "--tokens", "7,0,3,5", "9", "0"])
    out = capfd.readouterr().out
    assert codes == [0, 0, 0, 0], out
    assert out.count(": ok (") == 9 and "FAILED" not in out, out


def _break_backward():
    """A wrong gradient of the exchange (doubled): --check must catch it."""
    backward = ep._AllToAll.backward

    def doubled(ctx, grad):
        grad_in, *rest = backward(ctx, grad)
        return (2 * grad_in, *rest)
    ep._AllToAll.backward = staticmethod(doubled)


def test_check_catches_a_wrong_gradient(capfd):
    codes = _run_ranks(2, TINY_CHECK[:5] + ["--tokens", "4,6"], patch=_break_backward)
    out = capfd.readouterr().out
    assert codes == [1, 1], out
    assert "CHECK FAILED" in out and "dx" in out, out


def test_two_ranks_torchrun():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("NCCL_NVLS_ENABLE", None)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(SCRIPT), *TINY_CHECK, "--tokens", "0,6", "--bench", "--warmup", "1", "--reps", "2"],
        env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(": ok (") == 3, proc.stdout
    assert proc.stdout.count("fwd+bwd") == 3, proc.stdout
