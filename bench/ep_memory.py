"""Device memory of the MoE layers of a model per GPU with expert parallelism: moefuse's
shared windows and scratch, each layer's own workspaces and each layer's saved
activations (one forward in flight per layer, as in a training step), next to an
all_to_all_single baseline. No GPU: the numbers come from the library's own arithmetic
(moefuse.memory_estimate, the function behind moefuse_layer_memory, which
test_cuda_ep_memory checks against cudaMemGetInfo).

Rows (R = 8, T = 16384 tokens per GPU, balanced routing, bf16 unless FP8 is named):
  moefuse, saved activations   capacity 2x the balanced T * K rows (the default): the
                               windows and scratch once per GPU, shared by the layers;
                               per layer its own workspaces and its saved [g; u] rows
  moefuse, recompute           the same with MOEFUSE_RECOMPUTE (the plan saved only; the
                               backward recomputes W13 x into a shared scratch)
  moefuse FP8                  saved activations at 2x with MOEFUSE_PRECISION_FP8_BLOCK: the
                               same saved bf16 [g; u], the FP8 operands in the shared scratch
  moefuse, per-layer windows   what the layers needed before: windows and scratch per
                               layer, every buffer sized for R * T * K rows
  all_to_all_single baseline   TorchTitan-style (bench/torch_moe_ep_baseline.py), exact
                               split sizes, so N = T * K received rows when balanced;
                               autograd keeps per layer the received x rows [N, H] (dW13),
                               gate/up [N, 2I] (SwiGLU backward), act [N, I] (dW2) and the
                               returned rows [N, H] (d p): N * (4H + 6I) bytes. Its
                               transient all_to_all buffers are the allocator's and not
                               counted (nor are moefuse's caller-side y, dx).
The project's target: a 48-layer qwen3-30b-a3b at R = 8, T = 16384 fits its MoE
activations and buffers in under 40 GB per GPU (balanced routing, capacity 2x).

    python3 bench/ep_memory.py [--markdown FILE]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "python"))  # the checkout's package, when not installed

import torch_moe_baseline as baseline  # noqa: E402

import moefuse  # noqa: E402
from moefuse import _lib  # noqa: E402

RANKS = 8
TOKENS = 16384
LAYERS = {"qwen3-30b-a3b": 48, "qwen3-235b-a22b": 94}
TARGET = ("qwen3-30b-a3b", 40e9)  # the project's target: model, bytes per GPU


def moefuse_bytes(shape: dict, layers: int, saved_mode, factor: float,
                  shared: bool, precision: str = "bf16") -> tuple[float, float, float]:
    """(bytes shared by the layers, bytes per layer, total) per GPU."""
    m = moefuse.memory_estimate(shape["hidden"], shape["intermediate"], shape["num_experts"],
                                shape["top_k"], TOKENS, RANKS, saved_mode=saved_mode,
                                recv_capacity_factor=factor, precision=precision)
    pool = m["comm_window_bytes"] + m["comm_scratch_bytes"]
    own = m["workspace_bytes"] + m["saved_bytes"]
    if not shared:  # every layer its own windows and scratch
        own, pool = own + pool, 0
    return pool, own, pool + layers * own


def baseline_bytes(shape: dict, layers: int) -> tuple[float, float, float]:
    n = TOKENS * shape["top_k"]
    per_layer = n * (4 * shape["hidden"] + 6 * shape["intermediate"])
    return 0, per_layer, layers * per_layer


def rows() -> list[tuple]:
    out = []
    for model, layers in LAYERS.items():
        shape = baseline.MODELS[model]
        variants = [
            ("moefuse, saved activations, capacity 2x",
             moefuse_bytes(shape, layers, _lib.SavedMode.SAVE_ACTIVATIONS, 2.0, True)),
            ("moefuse, recompute, capacity 2x",
             moefuse_bytes(shape, layers, _lib.SavedMode.RECOMPUTE, 2.0, True)),
            ("moefuse, saved activations, capacity 1.5x",
             moefuse_bytes(shape, layers, _lib.SavedMode.SAVE_ACTIVATIONS, 1.5, True)),
            ("moefuse FP8, saved activations, capacity 2x",
             moefuse_bytes(shape, layers, _lib.SavedMode.SAVE_ACTIVATIONS, 2.0, True, "fp8")),
            (f"moefuse before: per-layer windows, {RANKS}x (R * T * K rows)",
             moefuse_bytes(shape, layers, _lib.SavedMode.SAVE_ACTIVATIONS, RANKS, False)),
            ("all_to_all_single baseline (saved tensors)", baseline_bytes(shape, layers)),
        ]
        out += [(model, layers, name, *v) for name, v in variants]
    return out


def markdown(table: list[tuple]) -> str:
    gb = 1e9
    lines = [
        "### ep_memory: MoE layers' device memory per GPU, R = 8, T = 16384 (computed)",
        "",
        "From moefuse.memory_estimate (the arithmetic of moefuse_layer_memory), no GPU. "
        "Shared: the comm's windows and scratch, once per GPU. Per layer: its own "
        "workspaces and one forward's saved state. GB = 1e9 bytes.",
        "",
        "| model | layers | variant | shared GB | per layer GB | total GB |",
        "|---|---|---|---|---|---|",
    ]
    for model, layers, name, shared, per_layer, total in table:
        lines.append(f"| {model} | {layers} | {name} | {shared / gb:.2f} | "
                     f"{per_layer / gb:.3f} | {total / gb:.1f} |")
    model, limit = TARGET
    lines.append("")
    for row in table:
        if row[0] == model and row[2].startswith("moefuse") and "before" not in row[2]:
            verdict = "meets" if row[5] < limit else "misses"
            lines.append(f"- target < {limit / gb:.0f} GB ({model}, {row[1]} layers): "
                         f"{row[2]}: {row[5] / gb:.1f} GB, {verdict} it")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", type=pathlib.Path, help="also write the table here")
    args = parser.parse_args(argv)
    text = markdown(rows())
    print(text, end="")
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
