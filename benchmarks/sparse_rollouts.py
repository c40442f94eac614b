"""What sparse rollouts buy in RL: DiffusionNFT on the sparsity testbed for RL (the long toy of
:mod:`vsa2_rl.toy.testbed`, ``--recipe long``) with rollouts at several sparsities, judged on
held-out prompts; the RL half of VSA2's hard-to-easy claim (train sparse, evaluate at a lower
sparsity), and the rollout-agreement threshold (``velocity_rel_error``) beyond which RL gained
less than with dense rollouts.

Commands, each reading and writing ``--out``:

- ``run``: RL of the base ``--base`` with ``configs/testbed_nft.yaml`` at each rollout sparsity
  (``sparsity.train``) and seed, plus one control run per sparsity
  (``configs/testbed_control.yaml``: the random reward, same settings; ``--configs NFT CONTROL``
  gives other recipes, e.g. the shipped toy's), as ``train_rl.py``
  processes, ``--parallel`` at once, each logging to ``runs/<name>.log``; with
  ``--warmup-steps N``, also each seed at ``--warmup-sparsity`` with the density annealed from
  dense over the first N steps (``sparsity.warmup_steps``), against the fixed runs. A finished
  run (its last evaluation logged) is skipped, an unfinished one resumed
  (``train.resume=auto``); a failed run is reported and the others go on. Then the final
  sweep, ``vsa2-rl eval`` of every finished run at sparsity 0 and ``--eval-sparsity``, and of
  the base at those and every rollout sparsity (its ``velocity_rel_error`` there is the
  rollout agreement each sparsity starts from), into ``sweeps/<name>/eval.json``.
- ``time``: one run per sparsity alone, ``--steps`` RL steps without evaluation; the median
  seconds of a step (rollout + update) after the first into ``seconds_per_step.json``.
- ``report``: ``report.md`` (per-run and per-sparsity changes from the base, the base's gate
  (dense rollouts against their control), the verdict, the rollout agreement by sparsity and
  the threshold it calibrates, at Wan's scale from ``benchmarks/results/rl_scale`` the
  iteration speed-up each sparsity has against the one it needs to match dense rollouts'
  reward per GPU-hour, and the rollout sparsity the recipes should use) and
  ``report.png`` (held-out reward against RL step and GPU-seconds).
- ``pack``: a study's results in three files beside ``runs/`` and ``sweeps/``, for results kept
  in the repository: ``configs.jsonl`` (a line per run: ``{"run": NAME, "config": {...}}``, its
  ``config.yaml``), ``runs.jsonl`` (a line per metrics row: ``{"run": NAME, "step": ...}``, its
  ``metrics.jsonl`` with a resumed run's repeated steps merged as :func:`read_metrics` reads
  them) and ``sweeps.jsonl`` (a line per sweep: ``{"sweep": NAME, "rows": [...]}``, its
  ``eval.json``). Each file packed is deleted, and so are the packed runs' and sweeps' ``.log``
  files and ``eval.md``, which no report reads, then the folders left empty (sample grids stay);
  names packed before keep their lines. Every report here (and those of ``drift_remedies.py`` and
  ``nft_guidance.py``) reads a packed study as it reads the unpacked one (a run's or sweep's own
  file, where present, before its packed line).

::

    python benchmarks/sparse_rollouts.py run --base BASE --out runs/sparse_rollouts --parallel 4
    python benchmarks/sparse_rollouts.py time --base BASE --out runs/sparse_rollouts
    python benchmarks/sparse_rollouts.py report --out runs/sparse_rollouts
    python benchmarks/sparse_rollouts.py pack --out benchmarks/results/sparse_rollouts/NAME

``--set KEY=VALUE`` overrides every run's config (``run`` and ``time``), e.g. smaller videos.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import yaml

REPO = Path(__file__).resolve().parents[1]
CONFIGS = (REPO / "configs" / "testbed_nft.yaml", REPO / "configs" / "testbed_control.yaml")
RL_SCALE = REPO / "benchmarks" / "results" / "rl_scale"
DEFAULT_PARTS = [RL_SCALE / "parts_480p33_720p81.md", RL_SCALE / "parts_growth.md",
                 RL_SCALE / "parts_720p81.md"]  # fmt: skip
VERDICT_SPARSITY = 0.9  # the recipes' rollout sparsity, judged against dense rollouts
GATE_POINTS = 15.0  # direction points dense-rollout RL must gain over its control (the base gate)
AGREEMENT_KEY = "velocity_rel_error"
# The base is swept at these too, so a sweep that adds rollout sparsities later finds them there
BASE_SPARSITIES = (0.25, 0.5, 0.75, 0.9)
BASE = "base"
RUN_NAME = re.compile(r"^(nft|control|warmup)_s([0-9.]+)_seed(\d+)$")
PACKED_CONFIGS, PACKED_METRICS, PACKED_SWEEPS = "configs.jsonl", "runs.jsonl", "sweeps.jsonl"
POLL_S = 0.5
LOG_TAIL = 10
VERDICT_RULE = (
    "With the held-out `prompt_motion` gain from the base measured at the evaluation sparsity, "
    "mean and sd over the seeds: **reproduced** if rollouts at 0.9 gain at least dense "
    "rollouts' gain minus the larger of the two groups' seed sd, and beat their own control's "
    "change by more than their seed sd; **not reproduced** if they fall short of dense's gain "
    "by more than 2x that larger sd; **inconclusive** otherwise (fixed before the runs)."
)


class Stat(NamedTuple):
    """Mean and sample sd over seeds (sd NaN for one seed)."""

    mean: float
    sd: float


@dataclass(frozen=True)
class Job:
    """One subprocess: its name in progress lines, command line and log file."""

    name: str
    command: list[str]
    log: Path


@dataclass(frozen=True)
class Run:
    """One RL run folder under ``OUT/runs``."""

    kind: str  # nft, control or warmup (nft with sparsity warm-up)
    sparsity: float
    seed: int
    path: Path

    @property
    def name(self) -> str:
        return self.path.name


# ---- running -----------------------------------------------------------------------------


def run_name(kind: str, sparsity: float, seed: int) -> str:
    return f"{kind}_s{sparsity:g}_seed{seed}"


def train_overrides(args, kind: str, sparsity: float, seed: int, out_dir: Path) -> list[str]:
    """The dotlist of one run: the base, the device, its sparsity (and warm-up), seed and folder,
    then --set."""
    warmup = [f"sparsity.warmup_steps={args.warmup_steps}"] if kind == "warmup" else []
    return [f"model.path={args.base}", f"device={args.device}", f"sparsity.train={sparsity:g}",
            *warmup, f"seed={seed}", f"out_dir={out_dir}", "logging.progress=false",
            *args.set]  # fmt: skip


def config_path(args, kind: str) -> Path:
    """The recipe a run of ``kind`` trains with: ``--configs``' first (nft, warm-up) or second
    (control) file."""
    nft, control = args.configs
    return control if kind == "control" else nft


def planned_num_steps(config: Path, overrides: list[str]) -> int:
    """train.num_steps of a run (its config and overrides, checked as the trainer would)."""
    from vsa2_rl.config import load_config

    return load_config(str(config), overrides, check_files=False).train.num_steps


def read_metrics(path: Path) -> dict[int, dict]:
    """metrics.jsonl's rows by step (a resumed run's later row of a step wins); {} if absent."""
    rows = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line torn by a killed run
                continue
            rows[row["step"]] = {**rows.get(row["step"], {}), **row}
    return rows


def packed_records(path: Path, key: str) -> dict[str, list[dict]]:
    """A packed file's records by their ``key`` field (a run's or a sweep's name), in file
    order; {} if the file is absent."""
    records: dict[str, list[dict]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            records.setdefault(record[key], []).append(record)
    return records


def run_config(run_dir: Path) -> dict | None:
    """The config a run recorded: its ``config.yaml``, or its line of the study's packed
    ``configs.jsonl`` beside ``runs/``; None if it has neither."""
    saved = run_dir / "config.yaml"
    if saved.is_file():
        return yaml.safe_load(saved.read_text())
    packed = packed_records(run_dir.parent.parent / PACKED_CONFIGS, "run").get(run_dir.name)
    return packed[0]["config"] if packed else None


def run_metrics(run_dir: Path) -> dict[int, dict]:
    """A run's metrics rows by step: its ``metrics.jsonl`` (:func:`read_metrics`), or its lines
    of the study's packed ``runs.jsonl`` beside ``runs/``; {} if it has neither."""
    saved = run_dir / "metrics.jsonl"
    if saved.is_file():
        return read_metrics(saved)
    packed = packed_records(run_dir.parent.parent / PACKED_METRICS, "run").get(run_dir.name, [])
    return {record["step"]: {k: v for k, v in record.items() if k != "run"} for record in packed}


def sweep_rows(out: Path, name: str) -> list[dict] | None:
    """A sweep's evaluation rows: its ``sweeps/<name>/eval.json``, or its line of the study's
    packed ``sweeps.jsonl``; None if it has neither."""
    saved = out / "sweeps" / name / "eval.json"
    if saved.is_file():
        return json.loads(saved.read_text())
    packed = packed_records(out / PACKED_SWEEPS, "sweep").get(name)
    return packed[0]["rows"] if packed else None


def packed_run_names(out: Path) -> set[str]:
    """The runs with a line in the study's packed ``configs.jsonl`` or ``runs.jsonl``."""
    return {*packed_records(out / PACKED_CONFIGS, "run"),
            *packed_records(out / PACKED_METRICS, "run")}  # fmt: skip


def run_names(out: Path) -> list[str]:
    """The runs of a study: the folders under ``out/runs`` and the runs of its packed files."""
    folders = {path.name for path in (out / "runs").glob("*") if path.is_dir()}
    return sorted(folders | packed_run_names(out))


def sweep_names(out: Path) -> list[str]:
    """The sweeps of a study: the folders with an ``eval.json`` under ``out/sweeps`` and the
    sweeps of its packed ``sweeps.jsonl``."""
    folders = {path.parent.name for path in (out / "sweeps").glob("*/eval.json")}
    return sorted(folders | set(packed_records(out / PACKED_SWEEPS, "sweep")))


def pack_files(out: Path, packed: str, key: str, pattern: str, records_of) -> list[Path]:
    """Moves the files ``out.glob(pattern)`` into ``out/packed``, each as the records
    ``records_of(name, path)`` of its folder's name (names packed before keep their lines);
    returns the files, deleted only once every one is in the packed file."""
    saved = sorted(out.glob(pattern))
    records = packed_records(out / packed, key)
    for path in saved:
        records[path.parent.name] = records_of(path.parent.name, path)
    if records:
        lines = (json.dumps(record) + "\n" for name in sorted(records) for record in records[name])
        (out / packed).write_text("".join(lines))
    for path in saved:
        path.unlink()
    return saved


def pack_configs(out: Path) -> int:
    """Moves every ``out/runs/<name>/config.yaml`` into ``out/configs.jsonl``; returns the
    number of runs packed now."""

    def records(name: str, path: Path) -> list[dict]:
        return [{"run": name, "config": yaml.safe_load(path.read_text())}]

    return len(pack_files(out, PACKED_CONFIGS, "run", "runs/*/config.yaml", records))


def pack_metrics(out: Path) -> int:
    """Moves every ``out/runs/<name>/metrics.jsonl`` into ``out/runs.jsonl`` (its rows as
    :func:`read_metrics` reads them, in its order); returns the number of runs packed now."""

    def records(name: str, path: Path) -> list[dict]:
        return [{"run": name, **row} for row in read_metrics(path).values()]

    return len(pack_files(out, PACKED_METRICS, "run", "runs/*/metrics.jsonl", records))


def pack_sweeps(out: Path) -> int:
    """Moves every ``out/sweeps/<name>/eval.json`` into ``out/sweeps.jsonl``; returns the
    number of sweeps packed now."""

    def records(name: str, path: Path) -> list[dict]:
        return [{"sweep": name, "rows": json.loads(path.read_text())}]

    return len(pack_files(out, PACKED_SWEEPS, "sweep", "sweeps/*/eval.json", records))


def remove_unread(out: Path) -> int:
    """Deletes what no report reads of the packed runs and sweeps (their ``.log`` files and the
    sweeps' ``eval.md``), then the run and sweep folders left empty; returns the number of files
    deleted."""
    sweeps = set(packed_records(out / PACKED_SWEEPS, "sweep"))
    unread = [out / "runs" / f"{name}.log" for name in packed_run_names(out)]
    unread += [out / "sweeps" / f"{name}.log" for name in sweeps]
    unread += [out / "sweeps" / name / "eval.md" for name in sweeps]
    unread = [path for path in unread if path.is_file()]
    for path in unread:
        path.unlink()
    for path in sorted([*(out / "runs").glob("*"), *(out / "sweeps").glob("*")]):
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()
    return len(unread)


def command_pack(args) -> int:
    counts = {PACKED_CONFIGS: pack_configs(args.out), PACKED_METRICS: pack_metrics(args.out),
              PACKED_SWEEPS: pack_sweeps(args.out)}  # fmt: skip
    for packed, count in counts.items():
        print(f"packed {count} into {args.out / packed}", flush=True)
    print(f"deleted {remove_unread(args.out)} unread files (logs, eval.md)", flush=True)
    return 0


def is_finished(run_dir: Path, num_steps: int) -> bool:
    """The run logged its last evaluation."""
    return "eval/reward" in run_metrics(run_dir).get(num_steps, {})


def train_command(config: Path, overrides: list[str]) -> list[str]:
    return [sys.executable, str(REPO / "train_rl.py"), "--config", str(config), *overrides]


def run_jobs(jobs: list[Job], parallel: int) -> list[str]:
    """Runs ``jobs``, at most ``parallel`` at once, each writing to its log; returns the names
    of the failed ones, each reported with its return code and last log lines."""
    pending, running, failed = list(jobs), {}, []
    while pending or running:
        while pending and len(running) < parallel:
            job = pending.pop(0)
            job.log.parent.mkdir(parents=True, exist_ok=True)
            handle = job.log.open("a")
            process = subprocess.Popen(
                job.command, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO
            )
            running[job.name] = (job, process, handle, time.monotonic())
            print(f"started {job.name} (log {job.log})", flush=True)
        time.sleep(POLL_S)
        for name, (job, process, handle, start) in list(running.items()):
            if process.poll() is None:
                continue
            handle.close()
            del running[name]
            seconds = time.monotonic() - start
            if process.returncode == 0:
                print(f"finished {name} in {seconds:.0f} s", flush=True)
                continue
            failed.append(name)
            tail = job.log.read_text(errors="replace").splitlines()[-LOG_TAIL:]
            print(f"FAILED {name}: return code {process.returncode} after {seconds:.0f} s; "
                  f"last lines of {job.log}:", flush=True)  # fmt: skip
            print("\n".join(f"    {line}" for line in tail), flush=True)
    return failed


def device_info(device: str) -> dict:
    """The device's name and today's date, for every figure made from its runs."""
    name = device
    if device.startswith("cuda"):
        import torch

        name = torch.cuda.get_device_name(device)
    return {"device": name, "date": datetime.date.today().isoformat()}


def rl_jobs(args) -> list[Job]:
    """The runs still to do (unfinished ones resume), after checking every run's config."""
    plan = [("nft", s, seed) for s in args.sparsities for seed in args.seeds]
    plan += [("control", s, args.control_seed) for s in args.sparsities]
    if args.warmup_steps:
        plan += [("warmup", args.warmup_sparsity, seed) for seed in args.seeds]
    jobs = []
    for kind, sparsity, seed in plan:
        name = run_name(kind, sparsity, seed)
        run_dir = args.out / "runs" / name
        overrides = train_overrides(args, kind, sparsity, seed, run_dir)
        config = config_path(args, kind)
        if is_finished(run_dir, planned_num_steps(config, overrides)):
            print(f"skipped {name}: finished", flush=True)
            continue
        jobs.append(Job(name, train_command(config, overrides), args.out / "runs" / f"{name}.log"))
    return jobs


def sweep_job(args, name: str, target: list[str], sparsities: list[float]) -> Job:
    """``vsa2-rl eval`` of one model at ``sparsities``, with the evaluation settings of the runs
    (the nft recipe and --set)."""
    sweep_dir = args.out / "sweeps" / name
    listed = ",".join(f"{s:g}" for s in sparsities)
    command = [sys.executable, "-m", "vsa2_rl.cli", "eval", "--config",
               str(config_path(args, "nft")), f"model.path={args.base}", f"device={args.device}",
               f"eval.sparsities=[{listed}]", f"out_dir={sweep_dir}",
               "logging.progress=false", *args.set, *target]  # fmt: skip
    return Job(f"sweep {name}", command, args.out / "sweeps" / f"{name}.log")


def base_sweep_jobs(args) -> list[Job]:
    """The base's sweep (at 0, --eval-sparsity, every rollout sparsity and
    :data:`BASE_SPARSITIES`) unless written: it runs beside the RL runs, so its rollout
    agreement figures exist even when the runs are cut short."""
    if sweep_rows(args.out, BASE) is not None:
        return []
    sparsities = sorted({0.0, args.eval_sparsity, *args.sparsities, *BASE_SPARSITIES})
    return [sweep_job(args, BASE, [], sparsities)]


def sweep_jobs(args) -> list[Job]:
    """The sweeps not yet written of the finished runs (at 0 and --eval-sparsity)."""
    jobs = []
    for run in find_runs(args.out):
        overrides = train_overrides(args, run.kind, run.sparsity, run.seed, run.path)
        finished = is_finished(run.path, planned_num_steps(config_path(args, run.kind), overrides))
        if finished and sweep_rows(args.out, run.name) is None:
            jobs.append(sweep_job(args, run.name, [f"run_dir={run.path}"],
                                  [0.0, args.eval_sparsity]))  # fmt: skip
    return jobs


def command_run(args) -> int:
    if not args.base.is_dir():
        raise SystemExit(
            f"--base: {args.base} is not a folder (build a base with "
            "python -m vsa2_rl.toy.testbed, see configs/testbed_nft.yaml)"
        )
    jobs = rl_jobs(args)  # every run's config checked before anything starts
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "run_info.json").write_text(json.dumps(device_info(args.device), indent=2))
    failed = run_jobs(base_sweep_jobs(args) + jobs, args.parallel)
    failed += run_jobs(sweep_jobs(args), args.parallel)
    if failed:
        print(f"{len(failed)} failed: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


def median_step_seconds(metrics: dict[int, dict]) -> float:
    """Median of perf/rollout_s + perf/train_s over the steps after the first (a warm-up)."""
    steps = sorted(step for step, row in metrics.items() if step > 1 and "perf/train_s" in row)
    return statistics.median(
        metrics[s]["perf/rollout_s"] + metrics[s]["perf/train_s"] for s in steps
    )


def command_time(args) -> int:
    if args.steps < 2:
        raise SystemExit(f"--steps: {args.steps} leaves no step after the warm-up; give >= 2")
    if not args.base.is_dir():
        raise SystemExit(f"--base: {args.base} is not a folder")
    seconds, failed = {}, []
    for sparsity in args.sparsities:
        name = f"timing_s{sparsity:g}"
        run_dir = args.out / "timing" / name
        shutil.rmtree(run_dir, ignore_errors=True)  # a timing is measured afresh, never resumed
        timed = [f"train.num_steps={args.steps}", "eval.every=0", "train.checkpoint_every=0"]
        overrides = [*train_overrides(args, "nft", sparsity, 0, run_dir), *timed]
        command = train_command(config_path(args, "nft"), overrides)
        job = Job(name, command, args.out / "timing" / f"{name}.log")
        if run_jobs([job], parallel=1):
            failed.append(name)
            continue
        seconds[f"{sparsity:g}"] = median_step_seconds(run_metrics(run_dir))
    record = {**device_info(args.device), "steps": args.steps, "seconds_per_step": seconds}
    (args.out / "seconds_per_step.json").write_text(json.dumps(record, indent=2))
    print(f"wrote {args.out / 'seconds_per_step.json'}: {seconds}", flush=True)
    return 1 if failed else 0


# ---- the report --------------------------------------------------------------------------


def find_runs(out: Path) -> list[Run]:
    """The RL runs of ``out`` (:func:`run_names`), by kind, sparsity and seed."""
    runs = []
    for name in run_names(out):
        match = RUN_NAME.match(name)
        if match:
            runs.append(Run(match[1], float(match[2]), int(match[3]), out / "runs" / name))
    return sorted(runs, key=lambda run: (run.kind != "nft", run.sparsity, run.seed))


def mean_sd(values: list[float]) -> Stat:
    return Stat(statistics.mean(values), statistics.stdev(values) if len(values) > 1 else math.nan)


def rl_verdict(dense: Stat, sparse: Stat, sparse_control: float) -> str:
    """:data:`VERDICT_RULE` on the gains at the evaluation sparsity: ``dense`` and ``sparse``
    (rollouts at 0.9) over their seeds, ``sparse_control`` the change of 0.9's control."""
    margin = max(dense.sd, sparse.sd)
    if math.isnan(margin) or math.isnan(sparse_control):
        return "inconclusive (fewer than 2 seeds or no control)"
    if sparse.mean >= dense.mean - margin and sparse.mean - sparse_control > sparse.sd:
        return "reproduced"
    if dense.mean - sparse.mean > 2 * margin:
        return "not reproduced"
    return "inconclusive"


def sweep_figures(rows: list[dict]) -> dict[float, dict]:
    """A sweep's held-out figures (:func:`sweep_rows`) by evaluation sparsity: motion,
    direction, fidelity and the velocity's relative error against dense attention (NaN where
    the sweep has none)."""
    return {row["sparsity"]: {"motion": row["reward/prompt_motion"],
                              "direction": row["reward/guard/prompt_direction"],
                              "fidelity": row["reward/guard/shape_fidelity"],
                              "agreement": row.get(AGREEMENT_KEY, math.nan)}
            for row in rows}  # fmt: skip


def run_changes(run_sweep: dict, base_sweep: dict, sparsities: list[float]) -> dict:
    """A run's change from the base at each evaluation sparsity: ``motion`` (reward units),
    ``direction`` (points: share x 100) and its own end ``fidelity``."""
    return {s: {"motion": run_sweep[s]["motion"] - base_sweep[s]["motion"],
                "direction": 100 * (run_sweep[s]["direction"] - base_sweep[s]["direction"]),
                "fidelity": run_sweep[s]["fidelity"]}
            for s in sparsities}  # fmt: skip


def evaluated_changes(out: Path, runs: list[Run], sparsities: list[float]) -> dict[str, dict]:
    """Each run with a sweep: its :func:`run_changes`; the base's sweep must exist."""
    base_rows = sweep_rows(out, BASE)
    if base_rows is None:
        raise SystemExit(f"--out: {out / 'sweeps' / BASE / 'eval.json'} is missing (the base's "
                         "sweep; `run` writes it)")  # fmt: skip
    base = sweep_figures(base_rows)
    changes = {}
    for run in runs:
        rows = sweep_rows(out, run.name)
        if rows is not None:
            changes[run.name] = run_changes(sweep_figures(rows), base, sparsities)
    return changes


def group_stats(runs: list[Run], changes: dict, kind: str, key: str, at: float) -> dict:
    """Per rollout sparsity: :class:`Stat` of ``key``'s change at ``at`` over ``kind``'s runs."""
    values: dict[float, list[float]] = {}
    for run in runs:
        if run.kind == kind and run.name in changes:
            values.setdefault(run.sparsity, []).append(changes[run.name][at][key])
    return {sparsity: mean_sd(found) for sparsity, found in sorted(values.items())}


def parse_parts(paths: list[Path]) -> dict[tuple[str, float], float]:
    """``iteration s (LoRA)`` of each (grid, sparsity) in bench_rl_scale's parts tables
    (``dense`` is 0); a later file replaces what an earlier one gave."""
    seconds = {}
    for path in paths:
        columns = None
        for line in path.read_text().splitlines():
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if not line.startswith("|") or set(cells[0]) <= {"-"}:
                continue
            if columns is None:
                columns = {name: index for index, name in enumerate(cells)}
                continue
            sparsity = cells[columns["sparsity"]]
            key = (cells[columns["grid"]], 0.0 if sparsity == "dense" else float(sparsity))
            seconds[key] = float(cells[columns["iteration s (LoRA)"]])
    return seconds


def dense_equivalent_steps(dense_curve: list[tuple[int, float]], reward: float) -> float:
    """The RL step at which dense rollouts' mean held-out curve first reaches ``reward``, linear
    between evaluations; inf when it never does."""
    previous = None
    for step, value in dense_curve:
        if value >= reward:
            if previous is None:
                return float(step)
            step_before, value_before = previous
            return step_before + (step - step_before) * (reward - value_before) / (
                value - value_before
            )
        previous = (step, value)
    return math.inf


def needed_speedup(num_steps: int, equivalent_steps: float) -> float:
    """The iteration speed-up over dense at which ``num_steps`` sparse iterations cost what the
    ``equivalent_steps`` dense ones that reach the same reward cost (inf: dense's start already
    reaches it; below 1: dense never does in the budget, so sparse rollouts pay at any speed)."""
    if equivalent_steps <= 0:
        return math.inf
    return num_steps / min(equivalent_steps, num_steps + 1.0)


def wan_scale_rows(parts: dict, curves: dict[float, list], num_steps: int) -> list[tuple]:
    """(grid, rollout sparsity, iteration s, measured speed-up over dense, needed speed-up) for
    each grid with a dense row and each sparse rollout sparsity in both the parts and the curves."""
    dense_curve = curves.get(0.0)
    if not dense_curve:
        return []
    rows = []
    for (grid, sparsity), seconds in parts.items():
        if sparsity == 0.0 or sparsity not in curves or (grid, 0.0) not in parts:
            continue
        equivalent = dense_equivalent_steps(dense_curve, curves[sparsity][-1][1])
        rows.append((grid, sparsity, seconds, parts[(grid, 0.0)] / seconds,
                     needed_speedup(num_steps, equivalent)))  # fmt: skip
    return rows


def keeps_dense_gain(gain: Stat, dense: Stat) -> bool:
    """The gain is at least dense rollouts' minus the larger of the two seed sds."""
    return gain.mean >= dense.mean - max(gain.sd, dense.sd)


def beats_control(gain: Stat, control: Stat | None) -> bool:
    """The gain exceeds its control's change by more than its seed sd (NaN sd: never)."""
    return control is not None and gain.mean - control.mean > gain.sd


def hardest_kept_sparsity(gains: dict[float, Stat], controls: dict[float, Stat]) -> str:
    """The highest rollout sparsity that keeps dense rollouts' gain and beats its control by more
    than its seed sd, or "none"."""
    dense = gains.get(0.0)
    if dense is None:
        return "none"
    kept = [
        sparsity
        for sparsity, gain in gains.items()
        if keeps_dense_gain(gain, dense) and beats_control(gain, controls.get(sparsity))
    ]
    return f"{max(kept):g}" if kept else "none"


def signed(stat: Stat, digits: int) -> str:
    if math.isnan(stat.sd):
        return f"{stat.mean:+.{digits}f} (n=1)"
    return f"{stat.mean:+.{digits}f} ± {stat.sd:.{digits}f}"


def run_table(runs: list[Run], changes: dict, sparsities: list[float]) -> list[str]:
    dense, at = sparsities
    lines = [f"| run | rollout sparsity | seed | motion change, dense | at {at:g} | "
             f"direction change (points), dense | at {at:g} | shape fidelity, dense | at {at:g} |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for run in runs:
        head = f"| {run.name} | {run.sparsity:g} | {run.seed} |"
        if run.name not in changes:
            lines.append(head + " not evaluated (unfinished or failed) | | | | | |")
            continue
        c = changes[run.name]
        lines.append(f"{head} {c[dense]['motion']:+.3f} | {c[at]['motion']:+.3f} | "
                     f"{c[dense]['direction']:+.1f} | {c[at]['direction']:+.1f} | "
                     f"{c[dense]['fidelity']:.3f} | {c[at]['fidelity']:.3f} |")  # fmt: skip
    return lines


def sparsity_table(runs: list[Run], changes: dict, sparsities: list[float]) -> list[str]:
    dense, at = sparsities
    stats = {(key, s, kind): group_stats(runs, changes, kind, key, s)
             for key in ("motion", "direction") for s in sparsities
             for kind in ("nft", "control")}  # fmt: skip
    lines = [f"| rollout sparsity | seeds | motion change, dense | at {at:g} | direction change "
             f"(points), dense | at {at:g} | control's motion change, dense | at {at:g} |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for sparsity in sorted({run.sparsity for run in runs}):
        seeds = sum(run.kind == "nft" and run.name in changes and run.sparsity == sparsity
                    for run in runs)  # fmt: skip
        cells = []
        for key, kind, digits in (("motion", "nft", 3), ("direction", "nft", 1),
                                  ("motion", "control", 3)):  # fmt: skip
            for s in (dense, at):
                stat = stats[(key, s, kind)].get(sparsity)
                cells.append(signed(stat, digits) if stat else "-")
        lines.append(f"| {sparsity:g} | {seeds} | " + " | ".join(cells) + " |")
    return lines


def warmup_table(runs: list[Run], changes: dict, sparsities: list[float]) -> list[str]:
    """Rollouts at the warm-up runs' sparsity with the warm-up against without it (fixed),
    mean ± sd over seeds; no lines when ``run`` had no --warmup-steps."""
    warmed = {run.sparsity for run in runs if run.kind == "warmup" and run.name in changes}
    if not warmed:
        return []
    dense, at = sparsities
    lines = ["## Sparsity warm-up against fixed sparsity", "",
             f"| rollouts | seeds | motion change, dense | at {at:g} | direction change "
             f"(points), dense | at {at:g} |", "|---|---|---|---|---|---|"]  # fmt: skip
    for sparsity in sorted(warmed):
        for kind, label in (("nft", "fixed"), ("warmup", "warm-up from dense")):
            cells = []
            for key, digits in (("motion", 3), ("direction", 1)):
                for s in (dense, at):
                    stat = group_stats(runs, changes, kind, key, s).get(sparsity)
                    cells.append(signed(stat, digits) if stat else "-")
            seeds = sum(r.kind == kind and r.sparsity == sparsity and r.name in changes
                        for r in runs)  # fmt: skip
            lines.append(f"| {sparsity:g}, {label} | {seeds} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def eval_curves(runs: list[Run], kind: str) -> dict[float, list[tuple[int, float]]]:
    """Per rollout sparsity, the in-training dense evaluations of held-out prompt_motion
    (a control's as a guard), mean over seeds at each step."""
    key = "eval/guard/prompt_motion" if kind == "control" else "eval/reward/prompt_motion"
    by_step: dict[float, dict[int, list[float]]] = {}
    for run in runs:
        if run.kind != kind:
            continue
        for step, row in run_metrics(run.path).items():
            if key in row:
                by_step.setdefault(run.sparsity, {}).setdefault(step, []).append(row[key])
    return {s: [(step, statistics.mean(v)) for step, v in sorted(steps.items())]
            for s, steps in sorted(by_step.items())}  # fmt: skip


def plot_curves(runs: list[Run], timing: dict | None, path: Path, caption: str) -> None:
    """Held-out prompt_motion against RL step and, with ``timing``, against GPU-seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if timing else 1
    figure, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.2), squeeze=False)
    prefixes = {"nft": "", "control": "control, ", "warmup": "warm-up, "}
    colors = {s: f"C{i}" for i, s in enumerate(sorted({run.sparsity for run in runs}))}
    for kind, style in (("nft", "-"), ("control", "--"), ("warmup", ":")):
        for sparsity, points in eval_curves(runs, kind).items():
            steps, values = zip(*points, strict=True)
            look = {"marker": "o", "color": colors[sparsity],
                    "label": f"{prefixes[kind]}rollouts at {sparsity:g}"}  # fmt: skip
            axes[0][0].plot(steps, values, style, **look)
            seconds = timing and timing.get(f"{sparsity:g}")
            if seconds:
                axes[0][1].plot([s * seconds for s in steps], values, style, **look)
    axes[0][0].set_xlabel("RL step")
    if timing:
        axes[0][1].set_xlabel("GPU-seconds (step x median seconds per step)")
    for axis in axes[0]:
        axis.set_ylabel("held-out prompt_motion (dense ODE)")
        axis.legend(fontsize=7)
    figure.suptitle(caption, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def shown_path(path: Path) -> str:
    """``path`` relative to the repository where it lies inside it."""
    path = path.resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def timing_text(timing: dict) -> str:
    seconds = ", ".join(f"{s}: {v:.3g} s" for s, v in timing["seconds_per_step"].items())
    return f"seconds per step ({seconds}): {provenance(timing)}"


def read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def provenance(record: dict | None) -> str:
    return f"{record['device']}, {record['date']}" if record else "device and date not recorded"


def recorded_num_steps(runs: list[Run]) -> int:
    """train.num_steps the runs were given (from the first run's recorded config)."""
    for run in runs:
        config = run_config(run.path)
        if config:
            return config["train"]["num_steps"]
    raise SystemExit("--out: no run recorded a config, in a config.yaml or configs.jsonl (did "
                     "`run` start them?)")  # fmt: skip


def verdict_lines(gains: dict[float, Stat], controls: dict[float, Stat]) -> list[str]:
    lines = ["## Verdict: the RL half of the hard-to-easy claim", "", VERDICT_RULE, ""]
    sparse, dense = gains.get(VERDICT_SPARSITY), gains.get(0.0)
    control = controls.get(VERDICT_SPARSITY)
    if sparse is None or dense is None or control is None:
        return [*lines, "**inconclusive**: rollouts at 0.9, dense rollouts or 0.9's control "
                "have no evaluated run."]  # fmt: skip
    verdict = rl_verdict(dense, sparse, control.mean)
    return [
        *lines,
        f"Gain at the evaluation sparsity: rollouts at 0.9 {signed(sparse, 3)}, dense "
        f"{signed(dense, 3)}, 0.9's control {control.mean:+.3f}: **{verdict}**.",
    ]


def speedup_text(speedup: float) -> str:
    return "none suffices" if math.isinf(speedup) else f"{speedup:.2f}x"


def wan_scale_lines(parts_paths, curves, gains, controls, num_steps, at) -> list[str]:
    rows = wan_scale_rows(parse_parts(parts_paths), curves, num_steps)
    lines = ["## At Wan's scale, on paper", "",
             "Assumption: the testbed's held-out learning curve per RL step (the in-training "
             "dense evaluations) carries over to a Wan iteration; only the seconds per iteration "
             "differ by sparsity. A rollout sparsity pays when its measured iteration speed-up "
             f"over dense reaches the speed-up it needs: {num_steps} steps / the step at which "
             "dense rollouts reached its final held-out reward (linear between evaluations). "
             "Iteration seconds from " + ", ".join(shown_path(p) for p in parts_paths) +
             " (a later file replaces a grid and sparsity an earlier one gave).", "",
             "| grid | rollout sparsity | iteration s (LoRA) | speed-up over dense | needed | "
             "pays |", "|---|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {g} | {s:g} | {sec:g} | {have:.2f}x | {speedup_text(need)} | "
              f"{'yes' if have >= need else 'no'} |" for g, s, sec, have, need in rows]  # fmt: skip
    choice = hardest_kept_sparsity(gains, controls)
    return [*lines, "", f"**Rollout sparsity for the recipes**: {choice} (the highest whose gain "
            f"at the evaluation sparsity {at:g} keeps dense rollouts' and beats its control by "
            "more than its seed sd)."]  # fmt: skip


THRESHOLD_RULE = (
    "The threshold is the largest base `velocity_rel_error` up to which every rollout sparsity "
    "keeps dense rollouts' gain (at least its mean minus the larger seed sd) and beats its "
    "control by more than its seed sd; RL gain fell beyond it (fixed before the runs)."
)


def gate_lines(runs: list[Run], changes: dict, base: dict, at: float) -> list[str]:
    """The base as an RL base: its direction followed and fidelity at ``at``, and dense-rollout
    RL's direction gain over its control's change (at least :data:`GATE_POINTS`)."""
    from vsa2_rl.toy.gate import MIN_FIDELITY, PARTLY_LEARNT

    lines = ["## The base's gates", ""]
    figures = base.get(at)
    if figures:
        low, high = PARTLY_LEARNT
        direction, fidelity = figures["direction"], figures["fidelity"]
        lines.append(f"At sparsity {at:g} the base follows the direction words in {direction:.3f} "
                     f"of held-out videos (gate {low}-{high}) with shape fidelity {fidelity:.3f} "
                     f"(gate >= {MIN_FIDELITY}).")  # fmt: skip
    gain = group_stats(runs, changes, "nft", "direction", at).get(0.0)
    control = group_stats(runs, changes, "control", "direction", at).get(0.0)
    if gain is None or control is None:
        return [*lines, "", "RL gate: **not measured** (dense rollouts or their control have no "
                "evaluated run).", ""]  # fmt: skip
    lead = gain.mean - control.mean
    verdict = "passed" if lead >= GATE_POINTS else "failed"
    return [*lines, "", f"RL gate: dense-rollout DiffusionNFT gains {signed(gain, 1)} direction "
            f"points at {at:g} against its control's {control.mean:+.1f}: {lead:+.1f} points, "
            f"gate >= +{GATE_POINTS:g}: **{verdict}**.", ""]  # fmt: skip


def agreement_threshold(rows: list[tuple[float, float, bool]]) -> tuple[float, tuple | None]:
    """:data:`THRESHOLD_RULE` on (rollout sparsity, base error, kept dense's gain) rows: the
    threshold and the first row beyond it that lost the gain (None: no loss measured)."""
    threshold = 0.0
    for sparsity, error, kept in sorted(rows, key=lambda row: row[1]):
        if not kept:
            return threshold, (sparsity, error)
        threshold = error
    return threshold, None


def agreement_lines(base: dict, gains: dict, controls: dict, at: float) -> list[str]:
    """Per rollout sparsity: the base's velocity error against dense, the gain, whether it keeps
    dense's; then the calibrated threshold."""
    lines = ["## Rollout agreement and RL gain", "", THRESHOLD_RULE, "",
             "| rollout sparsity | base `velocity_rel_error` | gain at "
             f"{at:g} | control's change | keeps dense's gain and beats its control |",
             "|---|---|---|---|---|"]  # fmt: skip
    dense, rows = gains.get(0.0), []
    for sparsity, gain in sorted(gains.items()):
        error = base.get(sparsity, {}).get("agreement", math.nan)
        control = controls.get(sparsity)
        kept = dense is not None and keeps_dense_gain(gain, dense) and beats_control(gain, control)
        shown = f"{control.mean:+.3f}" if control else "-"
        lines.append(f"| {sparsity:g} | {error:.4f} | {signed(gain, 3)} | {shown} | "
                     f"{'yes' if kept else 'no'} |")  # fmt: skip
        if not math.isnan(error):
            rows.append((sparsity, error, kept))
    if not rows:
        return [*lines, "", "**Threshold**: not calibrated (the base's sweep has no "
                f"`{AGREEMENT_KEY}`)."]  # fmt: skip
    threshold, lost = agreement_threshold(rows)
    beyond = (f"gain fell at sparsity {lost[0]:g} (error {lost[1]:.4f})" if lost
              else "no loss of gain measured up to the largest error")  # fmt: skip
    return [*lines, "", f"**Threshold**: `velocity_rel_error` <= {threshold:.4f}; {beyond}."]


def command_report(args) -> int:
    runs = find_runs(args.out)
    if not runs:
        raise SystemExit(f"--out: no runs under {args.out / 'runs'} (run `run` first)")
    at, sparsities = args.eval_sparsity, [0.0, args.eval_sparsity]
    changes = evaluated_changes(args.out, runs, sparsities)
    base = sweep_figures(sweep_rows(args.out, BASE))
    gains = group_stats(runs, changes, "nft", "motion", at)
    controls = group_stats(runs, changes, "control", "motion", at)
    info, timing = (
        read_json(args.out / "run_info.json"),
        read_json(args.out / "seconds_per_step.json"),
    )
    lines = ["# Sparse rollouts on the sparsity testbed", "",
             f"Runs: {provenance(info)}. Held-out prompts; changes from the base's sweep "
             "(`vsa2-rl eval`, same prompts and noises); `prompt_motion` in reward units, "
             "direction followed (`prompt_direction`) in points; mean ± sample sd over seeds.",
             "", *run_table(runs, changes, sparsities), "",
             *sparsity_table(runs, changes, sparsities), "",
             *warmup_table(runs, changes, sparsities),
             *gate_lines(runs, changes, base, at),
             *verdict_lines(gains, controls), "",
             *agreement_lines(base, gains, controls, at), "",
             *wan_scale_lines(args.rl_scale, eval_curves(runs, "nft"), gains, controls,
                              recorded_num_steps(runs), at),
             "", "## Curves", "",
             f"![held-out prompt_motion](report.png) (runs: {provenance(info)}"]  # fmt: skip
    if timing:
        lines[-1] += f"; {timing_text(timing)})"
    else:
        lines[-1] += "; no GPU-seconds panel: seconds_per_step.json is absent, run `time`)"
    caption = f"held-out prompt_motion; runs: {provenance(info)}"
    if timing:
        caption += f"; seconds per step: {provenance(timing)}"
    plot_curves(runs, timing and timing["seconds_per_step"], args.out / "report.png", caption)
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out / 'report.md'} and report.png", flush=True)
    return 0


def parser() -> argparse.ArgumentParser:
    main_parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = main_parser.add_subparsers(dest="command", required=True)
    for name in ("run", "time", "report", "pack"):
        command = commands.add_parser(name)
        command.add_argument("--out", type=Path, required=True, help="the benchmark's folder")
        if name in ("run", "time"):
            command.add_argument("--base", type=Path, required=True, help="built testbed base")
            command.add_argument("--sparsities", type=float, nargs="+", default=[0, 0.5, 0.75, 0.9])
            command.add_argument("--device", default="cuda")
            command.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                                 help="config overrides of every run")  # fmt: skip
            command.add_argument(
                "--configs", type=Path, nargs=2, default=CONFIGS, metavar=("NFT", "CONTROL"),
                help="the runs' recipe and its control's (default: the testbed's)",
            )  # fmt: skip
        if name in ("run", "report"):
            command.add_argument("--eval-sparsity", type=float, default=0.5)
    run, time_, report = (commands.choices[name] for name in ("run", "time", "report"))
    run.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    run.add_argument("--control-seed", type=int, default=0)
    run.add_argument("--parallel", type=int, default=4, help="runs at once on the device")
    run.add_argument(
        "--warmup-steps",
        type=int,
        default=0,
        help="also run each seed with the density warmed up over N steps (0: no)",
    )
    run.add_argument("--warmup-sparsity", type=float, default=VERDICT_SPARSITY,
                     help="rollout sparsity of the warm-up runs")  # fmt: skip
    time_.add_argument("--steps", type=int, default=3)
    report.add_argument("--rl-scale", type=Path, nargs="+", default=DEFAULT_PARTS,
                        help="bench_rl_scale parts tables (markdown)")  # fmt: skip
    return main_parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    commands = {"run": command_run, "time": command_time, "report": command_report,
                "pack": command_pack}  # fmt: skip
    from vsa2_rl.config import ConfigError

    try:
        return commands[args.command](args)
    except ConfigError as error:  # a --set override or a config the runs would refuse
        raise SystemExit(f"error: {error}") from None


if __name__ == "__main__":
    sys.exit(main())
