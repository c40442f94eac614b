"""Remedies for the drift of the shipped toy's DiffusionNFT runs: the default
(``configs/default.yaml``, reward ``prompt_motion``) and its control
(``configs/toy_control.yaml``, reward ``random``, same settings) at the toy's GPU settings
(:data:`TOY_GPU`, the overrides of ``benchmarks/gpu_session.sh``'s ``toy_sweep`` part), once
per remedy (:data:`VARIANTS`) and seed.

The remedies, each one change against ``baseline``:

- ``low_lr``: half the learning rate at this batch (``train.learning_rate=1.5e-5``);
- ``eta_schedule``: the old policy's soft update of the DiffusionNFT paper's OCR run
  (eta growing to 0.999 at 0.0075 a step after 75 steps) compressed into the toy's 40 steps:
  ``nft.eta_rate=0.03 nft.eta_max=0.9`` (eta 0.9 from step 30), so that the rollouts' policy
  and the anchor of v+ / v- lag the trained one (about a 10-step average at the end);
- ``trust_region``: ``nft.trust_region`` (:data:`TRUST_RADIUS` of mean squared velocity change
  a step, a third of the first step's 6.3e-4 measured at lr 3e-5 in a CPU smoke run of this
  script; ``train/trust_region_scale`` shows how often it binds);
- ``ema_reference``: the KL term's reference as an EMA of the trained weights
  (``rl.kl_reference=ema``, decay 0.95: a horizon of half the run).

Commands, each reading and writing ``--out``:

- ``run``: the runs of ``--variants`` x ``--seeds`` (reward and control each) not yet finished,
  as ``train_rl.py`` processes, ``--parallel`` at once (helpers of
  ``benchmarks/sparse_rollouts.py``), each logging to ``runs/<name>.log``; a finished run (its
  last evaluation logged) is skipped, a cut one resumes (``train.resume=auto``). Every run
  writes its evaluations to ``runs/<name>/metrics.jsonl`` as it goes, so a call cut by a
  timeout keeps what it measured, and the report reads them.
- ``report``: ``report.md``, per variant the reward runs' held-out ``prompt_motion`` gain and
  ``shape_fidelity`` change, the controls' changes of both, every seed listed, and the issue's
  criteria (:data:`CRITERIA`), each judged on the largest deviation from step 0 over all the
  run's evaluations (a run that drifts and comes back has drifted); it reads the run folders or
  their packed files (``python benchmarks/sparse_rollouts.py pack --out DIR``, the layout in that
  module's docstring) alike.

The evaluation is every 10 steps on the default's 24 held-out prompts x 4 samples without the
rollout-agreement pass (``eval.agreement_prompts=0``): about 5% of a run's forwards (5
evaluations of 96 videos x 10 steps against 40 steps of 64 rollouts x 8 steps and 5 noise
levels x 64 training passes), while fewer prompts would put the 0.02 criterion within the
evaluation's noise.

::

    python benchmarks/drift_remedies.py run --out runs/drift --parallel 20
    python benchmarks/drift_remedies.py run --out runs/drift --variants baseline trust_region
    python benchmarks/drift_remedies.py report --out runs/drift

``--set KEY=VALUE`` overrides every run's config (after the variant's), e.g. a CPU smoke test's
``train.num_steps=2``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from sparse_rollouts import (
    Job,
    Stat,
    device_info,
    is_finished,
    mean_sd,
    planned_num_steps,
    run_config,
    run_jobs,
    run_metrics,
    run_names,
    train_command,
)

REPO = Path(__file__).resolve().parents[1]
# the shipped toy by its path: an installed wheel (the GPU machine's) has no assets/ beside it
TOY = REPO / "assets" / "toy"
CONFIGS = {"reward": REPO / "configs/default.yaml", "control": REPO / "configs/toy_control.yaml"}
# gpu_session.sh's toy_sweep overrides (float32, reference attention, 16 prompts a step, 40 steps)
TOY_GPU = [
    "model.dtype=float32", "attention.backend=torch", "rl.prompts_per_step=16",
    "rl.train_batch_size=32", "train.num_steps=40", "train.learning_rate=3e-5",
    "nft.timestep_fraction=0.99", "rl.kl_beta=0.1", "eval.every=10", "sparsity.eval=0",
    "train.checkpoint_every=5", "train.sample_every=0",
]  # fmt: skip
EVAL = ["eval.agreement_prompts=0"]
TRUST_RADIUS = 2e-4
VARIANTS = {
    "baseline": [],
    "low_lr": ["train.learning_rate=1.5e-5"],
    "eta_schedule": ["nft.eta_rate=0.03", "nft.eta_max=0.9"],
    "trust_region": [f"nft.trust_region={TRUST_RADIUS:g}"],
    "ema_reference": ["rl.kl_reference=ema", "rl.kl_reference_decay=0.95"],
}
SEEDS = [11, 12, 13, 14, 15]  # seeds the project's other runs never used
REWARD, FIDELITY = "prompt_motion", "shape_fidelity"
CONTROL_FIDELITY, CONTROL_REWARD, KEPT_GAIN, OWN_FIDELITY = 0.05, 0.02, 0.9, 0.05
CRITERIA = (
    f"C1: every control's shape_fidelity within {CONTROL_FIDELITY} of its step 0; "
    f"C2: every control's held-out prompt_motion within {CONTROL_REWARD} of its step 0; "
    f"C3: the reward runs' mean prompt_motion gain at least {KEPT_GAIN:.0%} of the baseline's "
    f"(same seeds); C4: every reward run's shape_fidelity within {OWN_FIDELITY} of its step 0. "
    "C1, C2 and C4 on the largest deviation over all evaluations, C3 on the last one's gain."
)
RUN_NAME = re.compile(r"^(?P<variant>[a-z_]+)_(?P<kind>reward|control)_seed(?P<seed>\d+)$")


@dataclass(frozen=True)
class Change:
    """A held-out metric of one run: its change from step 0 at the last evaluation and its
    largest absolute deviation from step 0 over all evaluations."""

    last: float
    worst: float


def run_name(variant: str, kind: str, seed: int) -> str:
    return f"{variant}_{kind}_seed{seed}"


def train_overrides(args, variant: str, seed: int, out_dir: Path) -> list[str]:
    """One run's dotlist: the toy's GPU settings, the evaluation, the variant, then --set."""
    return [f"model.path={TOY}", f"device={args.device}", *TOY_GPU, *EVAL, *VARIANTS[variant],
            f"seed={seed}", f"out_dir={out_dir}", "logging.progress=false", *args.set]  # fmt: skip


def jobs_to_run(args) -> list[Job]:
    """The runs still to do, after checking every run's config (a bad override stops all)."""
    jobs = []
    for variant in args.variants:
        for seed in args.seeds:
            for kind, config in CONFIGS.items():
                name = run_name(variant, kind, seed)
                run_dir = args.out / "runs" / name
                overrides = train_overrides(args, variant, seed, run_dir)
                if is_finished(run_dir, planned_num_steps(config, overrides)):
                    print(f"skipped {name}: finished", flush=True)
                    continue
                log = args.out / "runs" / f"{name}.log"
                jobs.append(Job(name, train_command(config, overrides), log))
    return jobs


def command_run(args) -> int:
    jobs = jobs_to_run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "run_info.json").write_text(json.dumps(device_info(args.device), indent=2))
    failed = run_jobs(jobs, args.parallel)
    if failed:
        print(f"{len(failed)} failed: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


# ---- the report --------------------------------------------------------------------------


def held_out(row: dict, name: str) -> float | None:
    """An evaluation's mean of ``name``, trained on (``eval/reward/``) or a guard."""
    return row.get(f"eval/reward/{name}", row.get(f"eval/guard/{name}"))


def changes(metrics: dict[int, dict], name: str) -> Change | None:
    """The :class:`Change` of ``name`` over the evaluations in ``metrics`` (None before two)."""
    values = [(step, held_out(row, name)) for step, row in sorted(metrics.items())]
    values = [(step, value) for step, value in values if value is not None]
    if len(values) < 2 or values[0][0] != 0:
        return None
    start = values[0][1]
    return Change(values[-1][1] - start, max(abs(value - start) for _, value in values[1:]))


def read_runs(out: Path) -> dict[tuple[str, str, int], dict[str, Change]]:
    """Finished runs of ``out`` (run folders or packed, ``sparse_rollouts.run_names``) by
    (variant, kind, seed): their reward's and fidelity's changes (a run counts once its config's
    last step is evaluated)."""
    runs = {}
    for name in run_names(out):
        match, path = RUN_NAME.match(name), out / "runs" / name
        config = run_config(path) if match else None
        if not (config and is_finished(path, config["train"]["num_steps"])):
            continue
        metrics = run_metrics(path)
        found = {name: changes(metrics, name) for name in (REWARD, FIDELITY)}
        if all(found.values()):
            scales = [row["train/trust_region_scale"] for row in metrics.values()
                      if "train/trust_region_scale" in row]  # fmt: skip
            found["scale"] = sum(scales) / len(scales) if scales else None
            runs[match["variant"], match["kind"], int(match["seed"])] = found
    return runs


def cell(values: dict[int, float]) -> str:
    """Mean +- sd over the seeds, then every seed's value."""
    if not values:
        return "-"
    stat: Stat = mean_sd(list(values.values()))
    sd = "" if math.isnan(stat.sd) else f" ± {stat.sd:.3f}"
    seeds = ", ".join(f"{seed}: {value:+.3f}" for seed, value in sorted(values.items()))
    return f"{stat.mean:+.3f}{sd} ({seeds})"


def bound(worst: dict[int, float], limit: float, complete: bool) -> str:
    """Pass when every seed's largest deviation is within ``limit``; a seed beyond it fails
    the criterion whatever the seeds still to run."""
    if not worst:
        return "-"
    largest = max(worst.values())
    verdict = "FAIL" if largest > limit else "pass" if complete else "incomplete"
    return f"{verdict} (worst {largest:.3f})"


def kept_gain(gains: dict[int, float], baseline: dict[int, float], complete: bool) -> str:
    """C3: the mean gain against the baseline's over the same seeds."""
    seeds = [seed for seed in gains if seed in baseline]
    if not seeds:
        return "incomplete (no baseline run)" if gains else "-"
    baseline_gain = mean_sd([baseline[seed] for seed in seeds]).mean
    if baseline_gain <= 0:
        return f"FAIL (the baseline gained {baseline_gain:+.3f})"
    kept = mean_sd([gains[seed] for seed in seeds]).mean / baseline_gain
    verdict = ("pass" if kept >= KEPT_GAIN else "FAIL") if complete else "incomplete"
    return f"{verdict} ({kept:.0%} of the baseline's)"


def variant_row(runs: dict, variant: str, seeds: list[int]) -> list:
    """One variant's table cells and its verdict: no when a criterion failed, ships when all
    passed over the issue's five seeds, else incomplete or passing so far."""

    def of(variant: str, kind: str, name: str, field: str) -> dict[int, float]:
        return {seed: getattr(runs[variant, kind, seed][name], field) for seed in seeds
                if (variant, kind, seed) in runs}  # fmt: skip

    complete = all((v, kind, seed) in runs for v in (variant, "baseline") for kind in CONFIGS
                   for seed in seeds)  # fmt: skip
    gains = of(variant, "reward", REWARD, "last")
    checks = [
        bound(of(variant, "control", FIDELITY, "worst"), CONTROL_FIDELITY, complete),
        bound(of(variant, "control", REWARD, "worst"), CONTROL_REWARD, complete),
        kept_gain(gains, of("baseline", "reward", REWARD, "last"), complete),
        bound(of(variant, "reward", FIDELITY, "worst"), OWN_FIDELITY, complete),
    ]
    scales = [runs[key]["scale"] for key in runs if key[0] == variant and runs[key]["scale"]]
    name = variant + (f" (mean step scale {sum(scales) / len(scales):.2f})" if scales else "")
    cells = [
        name,
        cell(gains),
        cell(of(variant, "reward", FIDELITY, "last")),
        cell(of(variant, "control", REWARD, "last")),
        cell(of(variant, "control", FIDELITY, "last")),
        *checks,
    ]
    if any(check.startswith("FAIL") for check in checks):
        return [*cells, "no"]
    if not complete:
        return [*cells, "incomplete"]
    if len(seeds) < len(SEEDS):  # the criteria hold over the five seeds
        return [*cells, f"passes so far ({len(seeds)} of {len(SEEDS)} seeds)"]
    return [*cells, "**ships**"]


def command_report(args) -> int:
    runs = read_runs(args.out)
    variants = [v for v in VARIANTS if any(key[0] == v for key in runs)]
    seeds = sorted({key[2] for key in runs})
    info = args.out / "run_info.json"
    device = json.loads(info.read_text()) if info.is_file() else {}
    lines = [
        "# Drift remedies of the toy's DiffusionNFT default and its control",
        "",
        f"Runs under `{args.out}` ({device.get('device', '?')}, {device.get('date', '?')}), "
        f"seeds {', '.join(map(str, seeds)) or '-'}; held-out changes from step 0 at the last "
        "evaluation, mean ± sd (every seed). Settings: `benchmarks/drift_remedies.py` "
        f"(TOY_GPU, each variant's overrides). {CRITERIA}",
        "",
        "| variant | reward run: prompt_motion gain | reward run: shape_fidelity | "
        "control: prompt_motion | control: shape_fidelity | C1 | C2 | C3 | C4 | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for variant in variants:
        lines.append("| " + " | ".join(variant_row(runs, variant, seeds)) + " |")
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-len(variants) - 2 :]))
    print(f"wrote {args.out / 'report.md'}", flush=True)
    return 0


def parser() -> argparse.ArgumentParser:
    main_parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = main_parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run")
    report = commands.add_parser("report")
    for command in (run, report):
        command.add_argument("--out", type=Path, required=True, help="the benchmark's folder")
    run.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    run.add_argument("--seeds", type=int, nargs="+", default=SEEDS)
    run.add_argument("--parallel", type=int, default=4, help="runs at once on the device")
    run.add_argument("--device", default="cuda")
    run.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                     help="config overrides of every run, after the variant's")  # fmt: skip
    return main_parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from vsa2_rl.config import ConfigError

    try:
        return {"run": command_run, "report": command_report}[args.command](args)
    except ConfigError as error:  # a --set override or a config the runs would refuse
        raise SystemExit(f"error: {error}") from None


if __name__ == "__main__":
    sys.exit(main())
