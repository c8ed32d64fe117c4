"""tools/ncu_stalls.py, the reader of ncu's per-instruction stall samples, on a small
hand-made source page in ncu's CSV layout: the reason totals, the mbarrier waits by
named offset, the top instructions and the address ranges, each checked against numbers
worked out by hand."""

from __future__ import annotations

import csv
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "ncu_stalls.py"

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)",
          "Warp Stall Sampling (Not-issued Samples)", "Instructions Executed",
          "stall_long_sb", "stall_wait", "stall_barrier", "stall_long_sb (Not Issued)"]
# address, SASS, samples, executed, long_sb, wait, barrier: 100 samples in all
ROWS = [
    ("0x7f00000a4000", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8].tnspB, R24", 10, 1000, 0, 10, 0),
    ("0x7f00000a4010", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R13+URZ+0x38030], R2", 5, 500, 5, 0, 0),
    ("0x7f00000a4020", "@P0 BRA 0x7f00000a4090", 15, 500, 15, 0, 0),
    ("0x7f00000b0000", "WARPGROUP.DEPBAR.LE gsb0, 0x1", 40, 2000, 0, 0, 40),
    ("0x7f00000c0000", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R24+URZ+0x38060], R3", 0, 100, 0, 0, 0),
    ("0x7f00000c0010", "@P0 BRA 0x7f00000c0080", 30, 100, 30, 0, 0),
]


def write_page(path):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "void some_kernel(Args)"])
        w.writerow(HEADER)
        for a, sass, s, e, lsb, wait, bar in ROWS:
            w.writerow([a, sass, s, 0, f"{e:,}", lsb, wait, bar, 0])


def run(path, *args):
    out = subprocess.run([sys.executable, str(TOOL), str(path), *args], check=True,
                         capture_output=True, text=True)
    return out.stdout


def test_reasons_waits_top_and_ranges(tmp_path):
    page = tmp_path / "page.csv"
    write_page(page)
    out = run(page, "--top", "2", "--barriers", "0x38000=full,0x38028=empty,0x38060=epi_full",
              "--ranges", "a0000-b0000,b0000-d0000")
    lines = out.splitlines()
    assert lines[0] == "# 6 instructions, 100 samples"
    # stall reasons: long_sb 5 + 15 + 30 = 50, barrier 40, wait 10; "(Not Issued)" ignored
    reasons = lines[lines.index("## stall reasons") + 1:lines.index("## stall reasons") + 4]
    assert [r.split() for r in reasons] == [["long_sb", "50.0%"], ["barrier", "40.0%"],
                                           ["wait", "10.0%"]]
    # waits: the try_wait's samples and the branch's after it; 0x38030 lies in "empty"
    waits = out.split("## mbarrier waits")[1].split("## top")[0].splitlines()[1:]
    assert [w.split() for w in waits] == [["c0000", "epi_full", "30.00%"],
                                         ["a4010", "empty", "20.00%"]]
    top = out.split("## top 2 instructions")[1].split("## ranges")[0].splitlines()[1:]
    assert top[0].split()[:3] == ["40.00%", "b0000", "WARPGROUP.DEPBAR.LE"]
    assert top[1].split()[:3] == ["30.00%", "c0010", "@P0"]
    ranges = out.split("## ranges: samples, executed instructions")[1].splitlines()[1:]
    assert [r.split() for r in ranges] == [["a0000-b0000", "30.0%", "2000"],
                                          ["b0000-d0000", "70.0%", "2200"]]


def test_unnamed_barriers_print_their_offset(tmp_path):
    page = tmp_path / "page.csv"
    write_page(page)
    waits = run(page).split("## mbarrier waits")[1].split("## top")[0].splitlines()[1:]
    assert [w.split()[1] for w in waits] == ["0x38060", "0x38030"]


def test_a_page_without_samples_is_refused(tmp_path):
    page = tmp_path / "page.csv"
    with open(page, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(HEADER)
        w.writerow(["0x7f00000a4000", "NOP", 0, 0, "1", 0, 0, 0, 0])
    out = subprocess.run([sys.executable, str(TOOL), str(page)], capture_output=True, text=True)
    assert out.returncode != 0
    assert "no stall samples" in out.stderr
