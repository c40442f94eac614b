"""Compare the metrics.jsonl of runs that should agree (1 GPU vs DDP vs DeepSpeed, resumed vs
uninterrupted): one markdown table of the per-step values and the throughput of each run.

    python benchmarks/compare_runs.py gpu1=/tmp/mg/gpu1 ddp=/tmp/mg/ddp_2gpu --out table.md

Throughput is videos per hour over the steps after the first (the first holds the Triton
autotuning and compilation); peak memory is the largest per-GPU peak any step logged.
"""

from __future__ import annotations

import argparse
import json
import os

KEYS = ("reward/mean", "reward/std", "train/advantage_abs_mean", "loss/policy", "train/grad_norm")


def read(run_dir: str) -> dict[int, dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    return {row["step"]: row for row in rows if "reward/mean" in row}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("runs", nargs="+", help="label=run_dir")
    p.add_argument("--keys", nargs="+", default=list(KEYS), help="metrics of the per-step table")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    keys = args.keys
    runs = dict(item.split("=", 1) for item in args.runs)
    metrics = {label: read(path) for label, path in runs.items()}
    lines = ["| run | step | " + " | ".join(keys) + " |", "|---" * (len(keys) + 2) + "|"]
    for label, rows in metrics.items():
        if not rows:
            lines.append(f"| {label} | (no metrics: the run failed, see its log) |")
        for step, row in sorted(rows.items()):
            values = " | ".join(f"{row.get(key, float('nan')):.6g}" for key in keys)
            lines.append(f"| {label} | {step} | {values} |")
    lines += ["", "| run | videos/hour (steps >= 2) | peak GiB per GPU |", "|---|---|---|"]
    for label, rows in metrics.items():
        later = [row for step, row in rows.items() if step >= 2]
        rate = sum(r["perf/videos_per_s"] for r in later) / len(later) * 3600 if later else 0.0
        peak = max((r.get("perf/peak_mem_gib", 0.0) for r in rows.values()), default=0.0)
        lines.append(f"| {label} | {rate:.0f} | {peak:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text)


if __name__ == "__main__":
    main()
