"""Which built testbed base RL starts from: of the bases given, those that meet every RL-base
gate (:func:`vsa2_rl.toy.gate.rl_base_problems`), and of them the one whose direction followed
is nearest the middle of the partly-learnt range. Prints its folder; with none, prints each
base's problems and exits 1.

A base's figures come from its ``gate.txt`` (the output of ``python -m vsa2_rl.toy.gate``,
whose last line is its JSON), or with ``--build-sparsity S`` from its finished build's own
report (``config.json``: the last stage's samples at sparsity S), for the long toy
(``--recipe long``), whose learnability gate is RL itself (dense-rollout DiffusionNFT against
its control, benchmarks/sparse_rollouts.py) rather than perfect data.

    python benchmarks/pick_rl_base.py /tmp/rl_base_1 /tmp/rl_base_0.5
    python benchmarks/pick_rl_base.py --build-sparsity 0.5 /tmp/long_100 /tmp/long_200
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vsa2_rl.toy.gate import PARTLY_LEARNT, rl_base_problems


def gate_result(base: Path) -> dict | None:
    """The gate's figures (the JSON last line of ``base/gate.txt``); None when it has none (a
    build cut short is not gated)."""
    path = base / "gate.txt"
    lines = path.read_text().strip().splitlines() if path.is_file() else []
    try:
        return json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:  # the gate failed: its last line is an error
        return None


def build_result(base: Path, sparsity: float) -> dict | None:
    """The figures of a finished build's last stage at ``sparsity`` as the gate's keys
    (direction and fidelity before; no gain); None when the build is unfinished or has no
    samples at that sparsity."""
    path = base / "config.json"
    training = json.loads(path.read_text())["training"] if path.is_file() else {}
    if "build_device" not in training:
        return None
    figures = training["stages"][-1]["samples"].get(f"vsa2@{sparsity}")
    if figures is None:
        return None
    return {"direction_before": figures["direction_match"],
            "fidelity_before": figures["shape_fidelity"]}  # fmt: skip


def pick(
    bases: list[Path], build_sparsity: float | None = None
) -> tuple[Path | None, dict[Path, list[str]]]:
    """The chosen base (None when no base qualifies) and every base's problems; the figures
    from each ``gate.txt``, or with ``build_sparsity`` from each finished build's report."""
    if build_sparsity is None:
        results = {base: gate_result(base) for base in bases}
        missing = "no gate figures (gate.txt)"
    else:
        results = {base: build_result(base, build_sparsity) for base in bases}
        missing = f"no finished build with samples at sparsity {build_sparsity:g} (config.json)"
    problems = {base: rl_base_problems(result) if result else [missing]
                for base, result in results.items()}  # fmt: skip
    middle = sum(PARTLY_LEARNT) / 2
    qualified = [base for base in bases if not problems[base]]
    chosen = min(
        qualified, key=lambda b: abs(results[b]["direction_before"] - middle), default=None
    )
    return chosen, problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bases", type=Path, nargs="+", help="built base folders")
    parser.add_argument(
        "--build-sparsity", type=float, default=None,
        help="judge each base by its build's samples at this sparsity, not by gate.txt",
    )  # fmt: skip
    args = parser.parse_args(argv)
    chosen, problems = pick(args.bases, args.build_sparsity)
    if chosen is None:
        for base, found in problems.items():
            print(f"{base}: " + "; ".join(found), file=sys.stderr)
        return 1
    print(chosen)
    return 0


if __name__ == "__main__":
    sys.exit(main())
