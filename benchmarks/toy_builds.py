"""The compact record of finished toy builds (``python -m vsa2_rl.toy.testbed``,
``scripts/build_toy_model.py``): a JSON line a build holding what docs/results.md's tables of
built bases and benchmarks/pick_rl_base.py read of the build's ``config.json`` (which also holds
the whole recipe and each stage's validation curve): the stages' sizes and lengths, the build's
seconds and device, and its last stage's sample figures at each attention it was evaluated at.

Records a build folder's figures in a records file (a build of the same name already there is
replaced) and prints the table of every build in the file at one evaluation sparsity::

    python benchmarks/toy_builds.py benchmarks/results/testbed_rl/builds.jsonl /tmp/base_s1 --at 0.5
    python benchmarks/toy_builds.py benchmarks/results/testbed_rl/builds.jsonl --at 0.5
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CONFIG_FILE = "config.json"  # a toy build's record (vsa2_rl.toy.model.CONFIG_FILE)
# the sample measures the tables and pick_rl_base.py read
MEASURES = ("direction_match", "shape_fidelity", "prompt_motion")


def build_record(folder: Path) -> dict:
    """What the tables read of the build in ``folder``: ``stages`` as [size, frames, steps,
    batch] each, ``build_seconds``, ``build_device`` (None: a build cut short, or recorded
    before builds named their device) and the last stage's :data:`MEASURES` per attention."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise SystemExit(f"error: {folder}: no {CONFIG_FILE} there (not a toy build)")
    training = json.loads(path.read_text())["training"]
    stages = [built["stage"] for built in training["stages"]]
    samples = training["stages"][-1].get("samples", {})
    kept = {attention: {name: figures[name] for name in MEASURES}
            for attention, figures in samples.items()}  # fmt: skip
    return {
        "build": folder.name,
        "stages": [[s["size"], s["num_frames"], s["steps"], s["batch_size"]] for s in stages],
        "build_seconds": training.get("build_seconds"),
        "build_device": training.get("build_device"),
        "samples": kept,
    }


def read_records(path: Path) -> list[dict]:
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line) for line in lines if line.strip()]


def record_builds(path: Path, folders: list[Path]) -> list[dict]:
    """``path``'s records with those of ``folders`` added (replacing any of the same name),
    written back in name order."""
    records = {record["build"]: record for record in read_records(path)}
    records |= {folder.name: build_record(folder) for folder in folders}
    ordered = [records[name] for name in sorted(records)]
    path.write_text("".join(json.dumps(record) + "\n" for record in ordered))
    return ordered


def videos(stages: list[list[int]]) -> str:
    """Training videos (steps x batch) by stage size and length, e.g. "6,000 at 32 px x 16"."""
    counts: dict[tuple[int, int], int] = {}
    for size, frames, steps, batch in stages:
        counts[size, frames] = counts.get((size, frames), 0) + steps * batch
    return " + ".join(f"{n:,} at {size} px x {frames}" for (size, frames), n in counts.items())


def table(records: list[dict], sparsity: float) -> str:
    """A markdown row a build: its videos, seconds and last-stage samples at ``sparsity`` (a
    dense build's ``dense`` samples at 0)."""
    keys = [f"vsa2@{sparsity}", *(["dense"] if sparsity == 0 else [])]
    lines = [f"| build | videos (size x frames) | build s | {' | '.join(MEASURES)} at {sparsity} |",
             "|---" * (3 + len(MEASURES)) + "|"]  # fmt: skip
    for record in records:
        figures = next((record["samples"][k] for k in keys if k in record["samples"]), None)
        seconds = record["build_seconds"]
        cells = [
            record["build"],
            videos(record["stages"]),
            "-" if seconds is None else f"{seconds:.0f}",
            *(f"{figures[name]:.3f}" if figures else "-" for name in MEASURES),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", type=Path, help="the records file (JSON lines)")
    parser.add_argument("builds", type=Path, nargs="*", help="build folders to record first")
    parser.add_argument("--at", type=float, default=0.5, help="the table's evaluation sparsity")
    args = parser.parse_args(argv)
    if args.builds:
        records = record_builds(args.records, args.builds)
    elif args.records.is_file():
        records = read_records(args.records)
    else:
        raise SystemExit(f"error: {args.records}: no such file (give build folders to record)")
    print(table(records, args.at), end="")


if __name__ == "__main__":
    main()
