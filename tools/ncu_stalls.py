#!/usr/bin/env python3
"""Where a kernel's warps spend their time, from ncu's per-instruction stall samples.

Input: the SASS source page of one profiled kernel as CSV, written on the GPU machine by

    ncu --set full --import-source yes -k regex:NAME -c 1 -o rep BINARY ARGS
    ncu -i rep.ncu-rep --page source --csv --print-source sass > rep.csv

Output (stdout):
  1. the stall reasons over all samples, in % of the samples;
  2. the mbarrier waits: every try_wait loop with its share of the samples, by the
     barrier's shared-memory offset (name them with --barriers 0x38000=full,...; an offset
     between two named ones takes the lower name, so "full" covers every stage);
  3. the instructions with the most samples and their top stall reasons;
  4. the samples and executed instructions per address range (--ranges), to compare, say,
     a K loop with the epilogue interleaved into it against the plain one.

docs/decisions/0011-dgrad2-epilogue cites readings made this way. Samples are per warp:
a role with more warps has more of them, so compare a role's regions with each other,
not with another role's.
"""
import argparse
import collections
import csv
import re
import sys


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read_rows(path):
    """(header, rows) of the first kernel in the CSV; the page starts with a line naming it."""
    with open(path, newline="") as f:
        lines = list(csv.reader(f))
    start = next(i for i, row in enumerate(lines) if row and row[0] == "Address")
    header = lines[start]
    rows = [row for row in lines[start + 1:] if len(row) >= len(header)]
    if not rows:
        sys.exit(f"{path}: no instruction rows after the header")
    return header, rows


def parse_names(spec):
    names = {}
    for item in filter(None, (spec or "").split(",")):
        offset, name = item.split("=")
        names[int(offset, 16)] = name
    return names


def barrier_name(offset, names):
    below = [o for o in names if o <= offset]
    return names[max(below)] if below else hex(offset)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--top", type=int, default=25, help="instructions to list (25)")
    ap.add_argument("--barriers", help="names of barrier offsets: 0x38000=full,0x38028=empty")
    ap.add_argument("--ranges", help="address ranges (low 20 bits, hex) to sum: a000-b000,...")
    args = ap.parse_args(argv)

    header, rows = read_rows(args.csv)
    col = {name: i for i, name in enumerate(header)}
    samples_col = col["Warp Stall Sampling (All Samples)"]
    executed_col = col["Instructions Executed"]
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    samples = [number(row[samples_col]) for row in rows]
    total = sum(samples)
    if total == 0:
        sys.exit(f"{args.csv}: no stall samples (was the source page collected with --set full?)")
    addr = [int(row[col["Address"]], 16) & 0xFFFFF for row in rows]
    sass = [row[col["Source"]].strip() for row in rows]

    print(f"# {len(rows)} instructions, {total:.0f} samples")
    print("## stall reasons")
    by_reason = collections.Counter()
    for row in rows:
        for r in reasons:
            by_reason[r] += number(row[col[r]])
    for r, v in by_reason.most_common():
        if v:
            print(f"  {r[6:]:20s} {100 * v / total:5.1f}%")

    print("## mbarrier waits (the try_wait and the branch after it)")
    names = parse_names(args.barriers)
    waits = collections.Counter()
    for i, text in enumerate(sass):
        m = re.search(r"TRYWAIT.*\[[^\]]*\+(0x[0-9a-f]+)\]", text)
        if m:
            share = samples[i] + (samples[i + 1] if i + 1 < len(rows) else 0)
            waits[(barrier_name(int(m.group(1), 16), names), addr[i])] += share
    for (name, a), v in sorted(waits.items(), key=lambda kv: -kv[1]):
        if v / total >= 0.002:
            print(f"  {a:05x} {name:14s} {100 * v / total:5.2f}%")

    print(f"## top {args.top} instructions")
    for i in sorted(range(len(rows)), key=lambda i: -samples[i])[: args.top]:
        top = sorted(((number(rows[i][col[r]]), r) for r in reasons), reverse=True)[:3]
        why = " ".join(f"{r[6:]}={100 * v / total:.1f}" for v, r in top if v)
        print(f"  {100 * samples[i] / total:5.2f}% {addr[i]:05x} {sass[i][:60]:60s} {why}")

    if args.ranges:
        print("## ranges: samples, executed instructions")
        for item in args.ranges.split(","):
            lo, hi = (int(x, 16) for x in item.split("-"))
            inside = [i for i in range(len(rows)) if lo <= addr[i] < hi]
            s = sum(samples[i] for i in inside)
            e = sum(number(rows[i][executed_col]) for i in inside)
            print(f"  {lo:05x}-{hi:05x} {100 * s / total:5.1f}% {e:14.0f}")


if __name__ == "__main__":
    main()
