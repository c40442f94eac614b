"""Efficacy of RL runs against control runs: one evaluation metric (``--metric``, trained or
guard) and the guard metrics of each run at its first and last evaluation, then the mean change
per group.

    python benchmarks/efficacy_table.py motion=runs/m0,runs/m1,runs/m2 \
        control=runs/c0,runs/c1,runs/c2 [--out table.md]

A group is ``label=dir,dir,...``, e.g. runs of one reward over seeds, and a control group (the
``random`` reward, same settings) as the yardstick. Every run is listed, then each group's mean
change and its standard deviation over seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics


def _metric(row: dict, name: str) -> float:
    """``name`` as the run's trained reward (eval/reward/NAME) or as a guard (eval/guard/NAME)."""
    for key in (f"eval/reward/{name}", f"eval/guard/{name}"):
        if key in row:
            return row[key]
    raise SystemExit(f"error: step {row['step']}: no eval/reward/{name} or eval/guard/{name}")


def _evals(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    evals = [row for row in rows if "eval/reward" in row]
    if len(evals) < 2:
        raise SystemExit(f"error: {run_dir}: fewer than 2 evaluations in metrics.jsonl")
    return evals


def _guards(row: dict) -> list[str]:
    return sorted(k for k in row if k.startswith("eval/guard/") and not k.endswith("_std"))


def table(groups: dict[str, list[str]], metric: str) -> str:
    first = _evals(next(iter(groups.values()))[0])[0]
    guards = [g for g in _guards(first) if g != f"eval/guard/{metric}"]
    header = ["group", "run", f"eval {metric}, first -> last", "change"]
    header += [f"{g.removeprefix('eval/guard/')}, first -> last" for g in guards]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    changes: dict[str, list[float]] = {}
    for label, runs in groups.items():
        for run in runs:
            evals = _evals(run)
            start, end = _metric(evals[0], metric), _metric(evals[-1], metric)
            changes.setdefault(label, []).append(end - start)
            cells = [label, run, f"{start:.4f} -> {end:.4f}", f"{end - start:+.4f}"]
            cells += [f"{evals[0].get(g, float('nan')):.3f} -> {evals[-1].get(g, float('nan')):.3f}"
                      for g in guards]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| group | runs | mean change | sd over seeds |", "|---|---|---|---|"]
    for label, values in changes.items():
        spread = statistics.stdev(values) if len(values) > 1 else float("nan")
        lines.append(f"| {label} | {len(values)} | {statistics.mean(values):+.4f} | {spread:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("groups", nargs="+", help="label=run_dir,run_dir,...")
    parser.add_argument(
        "--metric", default="prompt_motion", help="reward compared (trained or guard)"
    )
    parser.add_argument("--out", default=None, help="also write the table to this file")
    args = parser.parse_args(argv)
    groups = {}
    for item in args.groups:
        label, _, dirs = item.partition("=")
        if not dirs:
            parser.error(f"expected label=run_dir[,run_dir...], got {item!r}")
        groups[label] = dirs.split(",")
    text = table(groups, args.metric)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text)


if __name__ == "__main__":
    main()
