"""The tests' way to import a script of bench/ (not a package) by its module name."""

from __future__ import annotations

import importlib
import pathlib
import sys


def import_bench(name: str):
    bench = pathlib.Path(__file__).resolve().parents[2] / "bench"
    if str(bench) not in sys.path:
        sys.path.insert(0, str(bench))
    return importlib.import_module(name)
