"""bench/ep_memory.py: the memory table of make bench, computed on the CPU from the
library's arithmetic."""

from __future__ import annotations

import pytest

from bench_helpers import import_bench

pytestmark = pytest.mark.usefixtures("library")


def _ep_memory():
    return import_bench("ep_memory")


def test_table_rows_and_the_shared_windows_arithmetic():
    ep_memory = _ep_memory()
    table = {(r[0], r[2]): r for r in ep_memory.rows()}
    model = "qwen3-30b-a3b"
    shared = table[(model, "moefuse, saved activations, capacity 2x")]
    before = table[(model, "moefuse before: per-layer windows, 8x (R * T * K rows)")]
    _, layers, _, pool, per_layer, total = shared
    assert layers == 48 and total == pool + layers * per_layer
    assert before[3] == 0 and before[5] > 15 * total  # per-layer worst-case windows
    recompute = table[(model, "moefuse, recompute, capacity 2x")]
    assert recompute[5] < 10e9  # only the plan is saved per layer


def test_markdown_states_the_target(tmp_path):
    ep_memory = _ep_memory()
    out = tmp_path / "t.md"
    assert ep_memory.main(["--markdown", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("### ep_memory")
    assert "| qwen3-235b-a22b | 94 |" in text
    assert "target < 40 GB (qwen3-30b-a3b, 48 layers)" in text
