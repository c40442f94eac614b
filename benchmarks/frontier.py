"""The quality-speed frontier of VSA2's router settings: kv_block 16 with top-p against kv_block
64 with top-k (VSA's router), at each density the router claim measured.

Quality is the sparsity testbed's validation loss after rebasing at that density (the router
claim's runs, ``benchmarks/sparsity_claims.py claim1``, as its ``report`` records them in
``--claims``'s ``runs.jsonl``: mean and standard deviation over seeds);
speed is the full VSA2 op at the Wan-14B 720p shape against cuDNN in the same run
(``bench_attention.py --out``: forward and forward+backward) and, with ``--rl``, the Wan-1.3B
shape's RL iteration against dense in the same run (``bench_rl_scale.py --out``, LoRA: the
recipe's own cost). A setting is on the frontier when no other setting has both a loss at most
its own and a speed-up at least its own (one of them strictly); the speed-up is the RL
iteration's when ``--rl`` is given, else the op's forward+backward. The recipe rule, fixed
before either was timed at these densities: the fastest frontier setting whose mean loss is
within one seed standard deviation of VSA's own setting (kv_block 64, top-k, density 0.125, i.e.
sparsity 0.875), which is the point VSA itself recommends.

    python benchmarks/bench_attention.py --shapes 720p --kv-blocks 16 --router-modes topp \\
        --sparsities 0.75,0.875,0.9375,0.96875 --no-flex --no-fastvideo --out kv16.md
    python benchmarks/bench_attention.py --shapes 720p --kv-blocks 64 --router-modes topk \\
        --sparsities 0.75,0.875,0.9375,0.96875 --no-flex --no-fastvideo --out kv64.md
    cat kv16.md kv64.md > attention.md
    python benchmarks/bench_rl_scale.py --grids 720p:81 --compile --sparsities 0 0.875 0.9375 \\
        --kv-blocks 16 64 --router-modes topp topk --reps 2 --out rl.md
    python benchmarks/frontier.py --attention attention.md --rl rl.md --out frontier.md
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

# the router claim's two routers: its folder name part, the op's method name in bench_attention
ROUTERS = {"kv16 top-p": ("kv16_top-p", "ours-full-topp-kv16"),
           "kv64 top-k": ("kv64_top-k", "ours-full-kv64")}  # fmt: skip
# each router's row label in a bench_rl_scale table of the 1.3B shape (its recipe kv_block is
# 16), without the " compiled" that rows of compiled blocks add
RL_LABELS = {"kv16 top-p": "{sparsity}", "kv64 top-k": "{sparsity} kv64 top-k"}
REFERENCE = ("kv64 top-k", 0.125)  # VSA's router at its recommended sparsity 0.875


@dataclass
class Setting:
    """One router at one density: its testbed losses over seeds and its op's speed-ups."""

    router: str
    density: float
    losses: list[float]
    fwd_speedup: float | None
    fwd_bwd_speedup: float | None
    rl_speedup: float | None = None

    @property
    def loss(self) -> float:
        return statistics.mean(self.losses)

    @property
    def loss_sd(self) -> float:
        return statistics.stdev(self.losses) if len(self.losses) > 1 else 0.0


RUNS_FILE = "runs.jsonl"  # sparsity_claims.py report's record of the claims' runs


def claim1_runs(claims: Path) -> dict[str, dict]:
    """The router claim's runs in ``claims``'s :data:`RUNS_FILE` (one JSON object a line), by
    folder name (``<router>_d<density>_s<seed>``)."""
    path = claims / RUNS_FILE
    if not path.is_file():
        raise SystemExit(f"error: --claims {claims}: no {RUNS_FILE} there (write it with "
                         "benchmarks/sparsity_claims.py report --out CLAIMS)")  # fmt: skip
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["run"].removeprefix("claim1/"): r for r in records if r["run"].startswith("claim1/")}


def claim_losses(runs: dict[str, dict], router: str, density: float) -> list[float]:
    """Validation losses at the router's density of every seed the router claim ran."""
    prefix = f"{ROUTERS[router][0]}_d{density}_s"
    return [runs[name]["validation"][f"vsa2@{1 - density:g}"]
            for name in sorted(runs) if name.startswith(prefix)]  # fmt: skip


def op_speedups(attention_md: Path) -> dict[tuple[str, float, str], float]:
    """(method, sparsity, fwd or fwd+bwd) -> x cuDNN, from a bench_attention table (720p rows)."""
    speedups = {}
    for line in attention_md.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        methods = [method for _, method in ROUTERS.values()]
        if len(cells) != 7 or cells[0] != "720p" or cells[1] not in methods or cells[5] == "-":
            continue
        speedups[(cells[1], float(cells[2]), cells[3])] = float(cells[5])
    return speedups


def rl_speedups(rl_md: Path) -> dict[str, float]:
    """Row label (less " compiled") -> LoRA iteration x dense, from a bench_rl_scale table."""
    speedups = {}
    for line in rl_md.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[1].isdigit() and cells[7] not in ("-", "out of memory"):
            speedups[cells[2].removesuffix(" compiled")] = float(cells[7])
    return speedups


def claim_densities(runs: dict[str, dict]) -> list[float]:
    names = {name.rsplit("_s", 1)[0] for name in runs}
    return sorted({float(name.rsplit("_d", 1)[1]) for name in names}, reverse=True)


def gather(claims: Path, attention_md: Path, rl_md: Path | None = None) -> list[Setting]:
    speedups = op_speedups(attention_md)
    rl = rl_speedups(rl_md) if rl_md else {}
    runs = claim1_runs(claims)
    settings = []
    for density in claim_densities(runs):
        for router, (_, method) in ROUTERS.items():
            losses = claim_losses(runs, router, density)
            if not losses:
                continue
            sparsity = round(1 - density, 6)
            rl_label = RL_LABELS[router].format(sparsity=sparsity)
            settings.append(Setting(router, density, losses,
                                    speedups.get((method, sparsity, "fwd")),
                                    speedups.get((method, sparsity, "fwd+bwd")),
                                    rl.get(rl_label)))  # fmt: skip
    if not settings:
        raise SystemExit(f"error: --claims {claims}: no claim1 runs under it")
    return settings


def speed_key(settings: list[Setting]) -> str:
    """The speed-up the frontier is drawn by: the RL iteration's where any setting has one."""
    return "rl_speedup" if any(s.rl_speedup is not None for s in settings) else "fwd_bwd_speedup"


def on_frontier(setting: Setting, settings: list[Setting]) -> bool | None:
    """Whether no other timed setting dominates ``setting`` (None: not timed)."""
    key = speed_key(settings)
    speed = getattr(setting, key)
    if speed is None:
        return None
    for other in settings:
        other_speed = getattr(other, key)
        if other is setting or other_speed is None:
            continue
        no_worse = other.loss <= setting.loss and other_speed >= speed
        if no_worse and (other.loss < setting.loss or other_speed > speed):
            return False
    return True


def recipe_choice(settings: list[Setting]) -> Setting | None:
    """The recipe rule (module docstring); None when VSA's own setting was not measured."""
    reference = next((s for s in settings if (s.router, s.density) == REFERENCE), None)
    if reference is None:
        return None
    bound = reference.loss + reference.loss_sd
    candidates = [s for s in settings if on_frontier(s, settings) and s.loss <= bound]
    return max(candidates, key=lambda s: getattr(s, speed_key(settings)), default=None)


def _speed(value: float | None) -> str:
    return "not timed" if value is None else f"{value:.2f}x"


def report(settings: list[Setting]) -> str:
    columns = ("router", "density", "sparsity", "testbed loss, mean ± sd (seeds)", "op fwd",
               "op fwd+bwd", "RL iteration", "frontier")  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for s in settings:
        frontier = {True: "yes", False: "", None: "-"}[on_frontier(s, settings)]
        lines.append(f"| {s.router} | {s.density:g} | {1 - s.density:g} | {s.loss:.4f} ± "
                     f"{s.loss_sd:.4f} ({len(s.losses)}) | {_speed(s.fwd_speedup)} | "
                     f"{_speed(s.fwd_bwd_speedup)} | {_speed(s.rl_speedup)} | "
                     f"{frontier} |")  # fmt: skip
    key = speed_key(settings)
    choice = recipe_choice(settings)
    if choice is None:
        verdict = "no setting qualifies (or VSA's own setting was not measured)"
    else:
        speed = _speed(getattr(choice, key))
        what = "RL iteration" if key == "rl_speedup" else "op fwd+bwd"
        verdict = (f"{choice.router} at sparsity {1 - choice.density:g} "
                   f"({speed} {what}, loss {choice.loss:.4f})")  # fmt: skip
    return "\n".join(lines) + f"\n\nRecipe rule's choice: {verdict}\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--claims", type=Path, default=Path("benchmarks/results/claims"))
    parser.add_argument("--attention", type=Path, required=True, help="bench_attention --out")
    parser.add_argument("--rl", type=Path, default=None, help="bench_rl_scale --out (1.3B)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    if not args.attention.is_file():
        raise SystemExit(f"error: --attention {args.attention}: no such file")
    if args.rl is not None and not args.rl.is_file():
        raise SystemExit(f"error: --rl {args.rl}: no such file")
    text = report(gather(args.claims, args.attention, args.rl))
    print(text, end="")
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
