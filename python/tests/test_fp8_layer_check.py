"""tools/fp8_layer_check.py, the GPU FP8 layer's diagnostic, run on the CPU backend (its
--device cpu): repeated calls are bitwise equal, and the training case (a tiny byte-level
model, two steps) finds the training step's expert call equal to the same call made
again, and within a bf16 rounding of the recipe emulated in fp32."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "fp8_layer_check.py"


def run(*args) -> str:
    env = dict(os.environ)
    out = subprocess.run([sys.executable, str(TOOL), "--device", "cpu", *args], check=True,
                         capture_output=True, text=True, env=env, timeout=600)
    return out.stdout


def test_repeated_calls_are_equal():
    out = run("repeat", "48:3", "--shape", "parity-model")
    assert "fp8 x3: runs against the first (elements differing): equal | equal" in out, out


def test_training_call_equals_the_same_call_made_again():
    pytest.importorskip("transformers")
    out = run("training", "--steps", "0", "1", "--layer", "0", "--repeat", "1",
              "--parity-args", "--tiny", "--batch", "1", "--seq", "64")
    again = re.findall(r"training call against fresh: (.*)", out)
    assert len(again) == 2, out
    for line in again:   # every output's relative difference exactly 0
        assert re.findall(r"\d\.\d\de[+-]\d\d", line) and all(
            float(v) == 0.0 for v in re.findall(r"\d\.\d\de[+-]\d\d", line)), line
    recipe = re.findall(r"fresh against the recipe: *y (\S+)", out)
    assert recipe and all(float(v) < 1e-2 for v in recipe), out   # y's own bf16 rounding
    assert "2 calls: runs against the first (elements differing): equal" in out, out
