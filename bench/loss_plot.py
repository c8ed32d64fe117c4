"""Loss curves as a PNG: matplotlib where it is installed, else a small built-in writer (lines,
axes with ticks, a legend of coloured boxes; the names go to the printed line, as there is
no font). Used by the benchmarks that train (bench_train_step.py, train_parity.py,
bench_torchtitan.py)."""

from __future__ import annotations

import math
import pathlib
import struct
import zlib


def _png_bytes(width, height, rows) -> bytes:
    """An 8-bit RGB PNG of rows (list of bytearrays, width*3 each)."""
    raw = b"".join(b"\x00" + bytes(r) for r in rows)

    def chunk(kind, data):
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


PLOT_COLOURS = (("blue", (31, 119, 180)), ("orange", (255, 127, 14)), ("green", (44, 160, 44)),
                ("red", (214, 39, 40)), ("purple", (148, 103, 189)), ("brown", (140, 86, 75)),
                ("pink", (227, 119, 194)), ("grey", (127, 127, 127)))


def write_png_plot(path, curves, width=800, height=500):
    """Pure-Python line plot: white background, axes with ticks, one polyline per curve
    (blue, orange, ...) and a legend of coloured boxes in the top-right corner (legend
    labels are printed by the caller; there is no font here)."""
    colours = [rgb for _, rgb in PLOT_COLOURS]
    rows = [bytearray(b"\xff" * (width * 3)) for _ in range(height)]

    def put(x, y, c, thick=1):
        for dx in range(-(thick // 2), thick - thick // 2):
            for dy in range(-(thick // 2), thick - thick // 2):
                xx, yy = x + dx, y + dy
                if 0 <= xx < width and 0 <= yy < height:
                    rows[yy][3 * xx:3 * xx + 3] = bytes(c)

    def line(x0, y0, x1, y1, c, thick=1):
        n = max(abs(x1 - x0), abs(y1 - y0), 1)
        for i in range(n + 1):
            put(round(x0 + (x1 - x0) * i / n), round(y0 + (y1 - y0) * i / n), c, thick)

    left, right, top, bottom = 60, width - 20, 20, height - 40
    values = [v for _, ys in curves for v in ys if math.isfinite(v)]
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    if hi - lo < 1e-9:
        lo, hi = lo - 0.5, hi + 0.5
    pad = 0.05 * (hi - lo)
    lo, hi = lo - pad, hi + pad
    n = max(len(ys) for _, ys in curves)
    black, grey = (0, 0, 0), (220, 220, 220)
    for i in range(6):  # grid + ticks
        y = round(bottom - (bottom - top) * i / 5)
        line(left, y, right, y, grey)
        line(left - 5, y, left, y, black)
        x = round(left + (right - left) * i / 5)
        line(x, bottom, x, bottom + 5, black)
    line(left, top, left, bottom, black, 2)
    line(left, bottom, right, bottom, black, 2)
    for k, (_, ys) in enumerate(curves):
        pts = [(round(left + (right - left) * i / max(n - 1, 1)),
                round(bottom - (bottom - top) * (v - lo) / (hi - lo)))
               for i, v in enumerate(ys) if math.isfinite(v)]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            # earlier curves drawn thicker, so a curve on top leaves them visible
            line(x0, y0, x1, y1, colours[k % len(colours)], 2 + 2 * (len(curves) - 1 - k))
        for dy in range(12):  # legend box
            line(right - 40, top + 10 + 20 * k + dy, right - 20, top + 10 + 20 * k + dy,
                 colours[k % len(colours)])
    pathlib.Path(path).write_bytes(_png_bytes(width, height, rows))
    return lo, hi


def plot(path, curves, title, xlabel="step", ylabel="loss"):
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        lo, hi = write_png_plot(path, curves)
        names = ", ".join(f"{name} = {c}" for (name, _), c in zip(curves, (n for n, _ in PLOT_COLOURS)))
        print(f"plot: {path} (built-in PNG writer, matplotlib not installed; x: {xlabel} 0.."
              f"{max(len(y) for _, y in curves) - 1}, y: {ylabel} {lo:.3f}..{hi:.3f}; {names})")
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, ys in curves:
        ax.plot(range(len(ys)), ys, label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"plot: {path} (matplotlib)")
