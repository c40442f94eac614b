"""Classifier-free guidance in DiffusionNFT, measured on the toy (``nft.guidance``): the
default (``configs/default.yaml``, reward ``prompt_motion``) and its control
(``configs/toy_control.yaml``, reward ``random``, same settings) at the toy's GPU settings
(``drift_remedies.TOY_GPU``), from a toy base built with caption dropout (``--base``:
``scripts/build_toy_model.py --caption-dropout 0.1``, so that the empty prompt is an
unconditional model and guidance has something to extrapolate from), once per variant
(:data:`VARIANTS`) and seed:

- ``none``: the paper's guidance-free rollouts (``sampler.guidance_scale=1``);
- ``rollouts``: rollouts guided at ``--scale``, v+ and v- anchored on the old policy's
  conditional velocity;
- ``anchor``: rollouts guided at ``--scale``, v+ and v- anchored on the old policy's guided
  velocity.

Every run evaluates its held-out prompts without guidance during training
(``eval.guidance_scale=1``, dense, every 10 steps): the trained model sampled without guidance.
Once a run has finished, ``vsa2-rl eval`` samples its last checkpoint on the same prompts with
guidance at ``--scale`` (``sweeps/<run>``), and the base once at each of :data:`BASE_SCALES`
and ``--scale`` (``sweeps/base_w<scale>``): the guided held-out gain is the run's guided
score less the base's at ``--scale``.

Commands, each reading and writing ``--out``:

- ``run``: the base's sweeps and the runs of ``--variants`` x ``--seeds`` (reward runs) and
  ``--control-seeds`` (controls; default ``--seeds``) not yet finished, ``--parallel`` at once
  (finished ones are skipped, cut ones resume from their last checkpoint), then the guided
  sweeps of the finished runs not yet swept;
- ``report``: ``report.md``: the base's held-out figures at every guidance scale, then per
  variant the held-out ``prompt_motion`` gains of the reward runs and the controls' changes,
  unguided and guided, each reward run's margin (its gain less the mean change of the
  variant's controls) and the reward runs' change of ``shape_fidelity``, every seed listed; it
  reads the run and sweep folders or their packed files (``python benchmarks/sparse_rollouts.py
  pack --out DIR``, the layout in that module's docstring) alike.

::

    python benchmarks/nft_guidance.py run --out runs/guidance --base runs/guidance/base
    python benchmarks/nft_guidance.py report --out runs/guidance

``--set KEY=VALUE`` overrides every run's and sweep's config, e.g. a CPU smoke test's
``train.num_steps=2``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from drift_remedies import CONFIGS, EVAL, RUN_NAME, TOY_GPU, cell, changes, run_name
from sparse_rollouts import (
    Job,
    device_info,
    is_finished,
    mean_sd,
    planned_num_steps,
    run_config,
    run_jobs,
    run_metrics,
    run_names,
    sweep_figures,
    sweep_names,
    sweep_rows,
    train_command,
)

VARIANTS = {
    "none": ["nft.guidance=none", "sampler.guidance_scale=1"],
    "rollouts": ["nft.guidance=rollouts"],
    "anchor": ["nft.guidance=anchor"],
}
SEEDS = [11, 12, 13]
SCALE = 3.0
BASE_SCALES = (1.0, 2.0, 3.0, 5.0)
UNGUIDED_EVAL = ["eval.guidance_scale=1"]
REWARD, FIDELITY = "prompt_motion", "shape_fidelity"


def shared_overrides(args) -> list[str]:
    """What every run and sweep is given: the base, the device and the toy's GPU settings."""
    return [f"model.path={args.base}", f"device={args.device}", *TOY_GPU, *EVAL]


def train_overrides(args, variant: str, seed: int, out_dir: Path) -> list[str]:
    """One run's dotlist: the shared settings, the variant's guidance, then --set."""
    guidance = [f"sampler.guidance_scale={args.scale:g}", *VARIANTS[variant]]
    return [*shared_overrides(args), *guidance, *UNGUIDED_EVAL, f"seed={seed}",
            f"out_dir={out_dir}", "logging.progress=false", *args.set]  # fmt: skip


def sweep_job(args, name: str, scale: float, target: list[str]) -> Job:
    """``vsa2-rl eval`` of one model, dense, guided at ``scale``, into ``sweeps/<name>``."""
    command = [sys.executable, "-m", "vsa2_rl.cli", "eval", "--config", str(CONFIGS["reward"]),
               *shared_overrides(args), "eval.sparsities=[0]", f"eval.guidance_scale={scale:g}",
               f"out_dir={args.out / 'sweeps' / name}", "logging.progress=false", *args.set,
               *target]  # fmt: skip
    return Job(f"sweep {name}", command, args.out / "sweeps" / f"{name}.log")


def base_sweep_name(scale: float) -> str:
    return f"base_w{scale:g}"


def base_sweep_jobs(args) -> list[Job]:
    """The base's sweeps not yet written, at :data:`BASE_SCALES` and --scale."""
    names = {base_sweep_name(scale): scale for scale in sorted({*BASE_SCALES, args.scale})}
    return [sweep_job(args, name, scale, []) for name, scale in names.items()
            if sweep_rows(args.out, name) is None]  # fmt: skip


def planned_runs(args) -> list[tuple[str, Path, list[str], Path]]:
    """(name, folder, overrides, config) of every run: --variants x --seeds reward runs and
    --control-seeds controls."""
    seeds = {"reward": args.seeds, "control": args.control_seeds or args.seeds}
    runs = []
    for variant in args.variants:
        for kind, config in CONFIGS.items():
            for seed in seeds[kind]:
                name = run_name(variant, kind, seed)
                folder = args.out / "runs" / name
                runs.append((name, folder, train_overrides(args, variant, seed, folder), config))
    return runs


def command_run(args) -> int:
    if not args.base.is_dir():
        raise SystemExit(f"--base: {args.base} is not a folder (build a base with "
                         "scripts/build_toy_model.py --caption-dropout 0.1 --out DIR)")  # fmt: skip
    runs = planned_runs(args)
    jobs = base_sweep_jobs(args)
    for name, folder, overrides, config in runs:  # every config checked before the first job
        if is_finished(folder, planned_num_steps(config, overrides)):
            print(f"skipped {name}: finished", flush=True)
        else:
            jobs.append(Job(name, train_command(config, overrides), folder.with_suffix(".log")))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "run_info.json").write_text(json.dumps(
        {**device_info(args.device), "scale": args.scale}, indent=2))  # fmt: skip
    failed = run_jobs(jobs, args.parallel)
    sweeps = [sweep_job(args, name, args.scale, [f"run_dir={folder}"])
              for name, folder, overrides, config in runs
              if is_finished(folder, planned_num_steps(config, overrides))
              and sweep_rows(args.out, name) is None]  # fmt: skip
    failed += run_jobs(sweeps, args.parallel)
    if failed:
        print(f"{len(failed)} failed: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


# ---- the report --------------------------------------------------------------------------


def guided_score(out: Path, name: str, figure: str = "motion") -> float | None:
    """A sweep's dense held-out ``figure`` (None until the sweep is written)."""
    rows = sweep_rows(out, name)
    return None if rows is None else sweep_figures(rows)[0.0][figure]


def read_runs(out: Path, scale: float) -> dict[tuple[str, str, int], dict[str, float]]:
    """Finished runs by (variant, kind, seed): their unguided changes of the reward and the
    fidelity, and their guided gain against the base's sweep at ``scale`` (when swept)."""
    base = guided_score(out, base_sweep_name(scale))
    runs = {}
    for name in run_names(out):
        match, path = RUN_NAME.match(name), out / "runs" / name
        config = run_config(path) if match else None
        if not (config and is_finished(path, config["train"]["num_steps"])):
            continue
        metrics = run_metrics(path)
        motion, fidelity = changes(metrics, REWARD), changes(metrics, FIDELITY)
        if motion is None or fidelity is None:
            continue
        guided = guided_score(out, name)
        runs[match["variant"], match["kind"], int(match["seed"])] = {
            "unguided": motion.last,
            "guided": None if guided is None or base is None else guided - base,
            "fidelity": fidelity.last,
        }
    return runs


def variant_cells(runs: dict, variant: str) -> list[str]:
    """One variant's table cells: per measure, the reward runs, the controls and each reward
    run's margin over the mean of the variant's controls."""

    def of(kind: str, field: str) -> dict[int, float]:
        return {seed: row[field] for (v, k, seed), row in runs.items()
                if v == variant and k == kind and row[field] is not None}  # fmt: skip

    cells = []
    for field in ("unguided", "guided"):
        gains, controls = of("reward", field), of("control", field)
        drift = mean_sd(list(controls.values())).mean if controls else None
        margins = {seed: gain - drift for seed, gain in gains.items()} if controls else {}
        cells += [cell(gains), cell(controls), cell(margins)]
    return [variant, *cells, cell(of("reward", "fidelity"))]


def base_rows(out: Path) -> list[str]:
    """The base's held-out figures at every guidance scale swept."""
    rows = []
    for name in sweep_names(out):
        if not name.startswith("base_w"):
            continue
        figures = sweep_figures(sweep_rows(out, name))[0.0]
        scale = name.removeprefix("base_w")
        rows.append(f"| {scale} | {figures['motion']:.3f} | {figures['direction']:.3f} | "
                    f"{figures['fidelity']:.3f} |")  # fmt: skip
    return sorted(rows, key=lambda row: float(row.split(" | ")[0].strip("| ")))


def command_report(args) -> int:
    info = args.out / "run_info.json"
    device = json.loads(info.read_text()) if info.is_file() else {}
    scale = device.get("scale", SCALE)
    runs = read_runs(args.out, scale)
    seeds = sorted({key[2] for key in runs})
    lines = [
        "# Guidance in the toy's DiffusionNFT default",
        "",
        f"Runs under `{args.out}` ({device.get('device', '?')}, {device.get('date', '?')}), "
        f"seeds {', '.join(map(str, seeds)) or '-'}, guidance scale {scale:g}; settings: "
        "`benchmarks/nft_guidance.py` (TOY_GPU of `drift_remedies.py`, each variant's "
        "overrides).",
        "",
        "The base's held-out figures (dense, 10 ODE steps) by guidance scale:",
        "",
        "| guidance | prompt_motion | prompt_direction | shape_fidelity |",
        "|---|---|---|---|",
        *base_rows(args.out),
        "",
        "Held-out `prompt_motion` changes from the base, mean ± sd (every seed): unguided at the "
        "last evaluation of training; guided, the last checkpoint's sweep at the guidance scale "
        "less the base's. Margin: a reward run's gain less the mean change of the variant's "
        "controls.",
        "",
        "| variant | reward, unguided | control, unguided | margin, unguided | reward, guided | "
        "control, guided | margin, guided | reward run: shape_fidelity |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for variant in VARIANTS:
        if any(key[0] == variant for key in runs):
            lines.append("| " + " | ".join(variant_cells(runs, variant)) + " |")
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-len(VARIANTS) - 2 :]))
    print(f"wrote {args.out / 'report.md'}", flush=True)
    return 0


def parser() -> argparse.ArgumentParser:
    main_parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = main_parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run")
    report = commands.add_parser("report")
    for command in (run, report):
        command.add_argument("--out", type=Path, required=True, help="the benchmark's folder")
    run.add_argument("--base", type=Path, required=True, help="a toy base with caption dropout")
    run.add_argument("--scale", type=float, default=SCALE, help="the guided variants' scale")
    run.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    run.add_argument("--seeds", type=int, nargs="+", default=SEEDS)
    run.add_argument("--control-seeds", type=int, nargs="+", help="default: --seeds")
    run.add_argument("--parallel", type=int, default=4, help="runs at once on the device")
    run.add_argument("--device", default="cuda")
    run.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                     help="config overrides of every run and sweep")  # fmt: skip
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
