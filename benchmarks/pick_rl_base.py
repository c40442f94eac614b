"""Which built testbed base RL starts from: of the gated bases given (each folder holding
``gate.txt``, the output of ``python -m vsa2_rl.toy.gate`` whose last line is its JSON), those
that meet every RL-base gate (:func:`vsa2_rl.toy.gate.rl_base_problems`), and of them the one
whose direction followed is nearest the middle of the partly-learnt range. Prints its folder;
with none, prints each base's problems and exits 1.

    python benchmarks/pick_rl_base.py /tmp/rl_base_1 /tmp/rl_base_0.5
"""

from __future__ import annotations

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


def pick(bases: list[Path]) -> tuple[Path | None, dict[Path, list[str]]]:
    """The chosen base (None when no base qualifies) and every base's problems."""
    results = {base: gate_result(base) for base in bases}
    problems = {base: rl_base_problems(result) if result else ["no gate figures (gate.txt)"]
                for base, result in results.items()}  # fmt: skip
    middle = sum(PARTLY_LEARNT) / 2
    qualified = [base for base in bases if not problems[base]]
    chosen = min(
        qualified, key=lambda b: abs(results[b]["direction_before"] - middle), default=None
    )
    return chosen, problems


def main(argv: list[str] | None = None) -> int:
    bases = [Path(arg) for arg in (sys.argv[1:] if argv is None else argv)]
    if not bases:
        raise SystemExit("usage: pick_rl_base.py BASE_DIR [BASE_DIR ...]")
    chosen, problems = pick(bases)
    if chosen is None:
        for base, found in problems.items():
            print(f"{base}: " + "; ".join(found), file=sys.stderr)
        return 1
    print(chosen)
    return 0


if __name__ == "__main__":
    sys.exit(main())
