#!/usr/bin/env python3
"""Sums the kernel times of an Nsight Compute CSV log, per kernel name.

    ncu --clock-control none --metrics gpu__time_duration.sum --csv --page raw --log-file LOG.csv CMD
    tools/ncu_summary.py LOG.csv [--steps N] [--top K]

With --steps N the totals are also given per step (divided by N), e.g. per decode step of a run
that made N of them. With --one-step GRID only one step counts: the first whose attention kernel
was launched with that grid (e.g. "(3072, 1, 1)" for 384 decodes of the 8B's 8 KV heads), a step
ending at each `sample_rows` launch. Kernel names are shortened to their first 90 characters.
"""
import argparse
import collections
import csv
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("log")
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--one-step", metavar="GRID", default=None)
    args = ap.parse_args()

    with open(args.log, newline="") as f:
        # ncu prints its own lines ("==PROF==") before the CSV header.
        lines = [line for line in f if line.startswith('"')]
    rows = list(csv.reader(lines))
    if not rows:
        sys.exit(f"{args.log}: no CSV rows")
    header = rows[0]
    name_col = header.index("Kernel Name")
    time_col = header.index("gpu__time_duration.sum")
    # The row after the header gives the units.
    unit = rows[1][time_col] if len(rows) > 1 else "ns"
    scale = {"ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "nsecond": 1e-3}.get(unit, 1e-3)

    data = rows[2:]
    if args.one_step is not None:
        data = one_step(header, data, name_col, args.one_step)
    total = collections.Counter()
    count = collections.Counter()
    for row in data:
        try:
            t = float(row[time_col].replace(",", "")) * scale
        except ValueError:
            continue
        name = row[name_col][:90]
        total[name] += t
        count[name] += 1
    grand = sum(total.values())
    per = f"{'us/step':>10} " if args.steps else ""
    print(f"{'kernel':<90} {'calls':>7} {'avg us':>9} {'total us':>11} {per}{'share':>6}")
    for name, t in total.most_common(args.top):
        step = f"{t / args.steps:>10.1f} " if args.steps else ""
        print(f"{name:<90} {count[name]:>7} {t / count[name]:>9.2f} {t:>11.1f} {step}{100 * t / grand:>5.1f}%")
    step = f"{grand / args.steps:>10.1f} " if args.steps else ""
    print(f"{'all kernels':<90} {sum(count.values()):>7} {'':>9} {grand:>11.1f} {step}{100.0:>5.1f}%")


def is_attention(name):
    return "attention" in name or "paged_decode" in name


def one_step(header, data, name_col, grid):
    """The rows of the first step whose attention kernel has grid `grid`."""
    grid_col = header.index("Grid Size")
    step = []
    for row in data:
        step.append(row)
        if "sample_rows" in row[name_col]:
            if any(is_attention(r[name_col]) and r[grid_col] == grid for r in step):
                return step
            step = []
    sys.exit(f"no step with an attention kernel of grid {grid}")


if __name__ == "__main__":
    main()
