"""The real text of bench/train_parity.py: the Python standard library's own .py sources
(the Lib/ directory of the running interpreter, sysconfig.get_paths()["stdlib"], without
site-packages), read as bytes, files joined in path order with a NUL byte between them.
A file is held out when the SHA-256 of its relative path says so (one in HELD_OUT_ONE_IN),
so the split does not depend on the file system's order. Training windows come in a seeded
permuted order (Batches); the held-out set is a fixed spread of windows (heldout_set)."""

from __future__ import annotations

import hashlib
import pathlib
import sysconfig

import torch

HELD_OUT_ONE_IN = 20


def held_out(relative_path: str) -> bool:
    digest = hashlib.sha256(relative_path.encode()).digest()
    return int.from_bytes(digest[:4], "little") % HELD_OUT_ONE_IN == 0


def stdlib_streams() -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(train bytes, held-out bytes) as uint8 tensors and a description."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    parts = {True: [], False: []}
    count = {True: 0, False: 0}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if any(p in ("site-packages", "dist-packages") for p in rel.split("/")):
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        side = held_out(rel)
        parts[side] += [data, b"\0"]
        count[side] += 1
    streams = [torch.frombuffer(bytearray(b"".join(parts[side])), dtype=torch.uint8)
               for side in (False, True)]
    info = dict(root=str(root), train_files=count[False], heldout_files=count[True],
                train_bytes=streams[0].numel(), heldout_bytes=streams[1].numel())
    return streams[0], streams[1], info


class Batches:
    """Training windows of seq + 1 bytes in a seeded permuted order, one permutation per
    pass over the stream; batch(step) is a function of step alone."""

    def __init__(self, stream: torch.Tensor, batch: int, seq: int, seed: int):
        self.stream, self.batch, self.seq, self.seed = stream, batch, seq, seed
        self.windows = (stream.numel() - 1) // seq
        if self.windows < 1:
            raise ValueError(f"the training stream ({stream.numel()} bytes) is shorter than "
                             f"one sequence of {seq + 1}")
        self._perms = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1000003 + epoch)
            self._perms = {epoch: torch.randperm(self.windows, generator=g)}
        return self._perms[epoch]

    def batch_at(self, step: int) -> torch.Tensor:
        rows = []
        for i in range(self.batch):
            n = step * self.batch + i
            start = int(self._perm(n // self.windows)[n % self.windows]) * self.seq
            rows.append(self.stream[start:start + self.seq + 1])
        return torch.stack(rows).long()


def heldout_set(stream: torch.Tensor, seqs: int, seq: int) -> torch.Tensor:
    """seqs windows of seq + 1 bytes spread evenly over the held-out stream (all of its
    files, not its first few)."""
    windows = (stream.numel() - 1) // seq
    n = min(seqs, windows)
    if n < 1:
        raise ValueError(f"the held-out stream ({stream.numel()} bytes) is shorter than one "
                         f"sequence of {seq + 1}")
    starts = [(i * windows // n) * seq for i in range(n)]
    return torch.stack([stream[s:s + seq + 1] for s in starts]).long()
