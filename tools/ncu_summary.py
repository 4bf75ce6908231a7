#!/usr/bin/env python3
"""Sums the kernel times of an Nsight Compute CSV log, per kernel name.

    ncu --clock-control none --metrics gpu__time_duration.sum --csv --page raw --log-file LOG.csv CMD
    tools/ncu_summary.py LOG.csv [--steps N] [--top K]

With --steps N the totals are also given per step (divided by N), e.g. per decode step of a run
that made N of them. Kernel names are shortened to their first 90 characters.
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

    total = collections.Counter()
    count = collections.Counter()
    for row in rows[2:]:
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


if __name__ == "__main__":
    main()
