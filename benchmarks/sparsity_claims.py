"""VSA2's three quality claims on the sparsity testbed (:mod:`vsa2_rl.toy.testbed`).

Parts; the runs of those given are built under ``--out`` in the order of the parts, each after
the base it continues (``claim2 base``: claim 2's base and runs, then the other bases), one at a
time or ``--jobs`` at once in worker processes (each writing its progress to
``<folder>.log``). A finished run's folder is reused, and a call stopped by SIGTERM
(``timeout``) saves its runs' stage state, so a call cut short is continued by running it
again:

- ``base``: the testbed pretrained three ways, ``dense``, ``rebase`` (VSA2 from the resolution
  change on) and ``sparse`` (VSA2 from the start), for each of ``--seeds`` (``base_<way>`` for
  seed 0, ``base_<way>_s<seed>`` for the others): claim 3's validation-loss curves and each
  base's held-out sample measures at its training attention, judged over seeds, and (seed 0's)
  the bases of claims 1 and 2;
- ``claim1``: the dense base rebased to VSA2 at each density (``--densities``) with the
  fine-grained router (kv_block 16, top-p) and with VSA's (kv_block 64, top-k), fine-tuned for
  the same steps (peak lr 1e-4, :func:`~vsa2_rl.toy.testbed.fine_tune_recipe`); flow-matching
  validation loss at that density, per seed;
- ``claim2``: the rebase base fine-tuned at sparsity 0.9 and with dense attention for the same
  steps, each evaluated at sparsity 0, 0.5, 0.75 and 0.9 on the held-out prompts: validation
  loss, shape fidelity, share of videos moving the prompted way, speed error; the sparse-trained
  model at each sparsity is judged against the dense-trained one with full attention;
- ``report``: ``runs.jsonl`` (one line a finished run: the figures the tables read, gathered
  from the runs' folders under ``--out`` into those already there) and, from it, ``claims.md``
  (tables, the verdict rules and their results, and each run's float32 stage-end validation
  loss against the same under the training's bf16 kernels) with ``claim1.png``, ``claim2.png``
  and ``claim3.png`` (plots) and ``claim2_samples.png`` and ``claim3_samples.png`` (sample grids
  of the first seed's runs, where their folders are there).

::

    python benchmarks/sparsity_claims.py base claim1 claim2 report --device cuda --out runs/claims
    python benchmarks/sparsity_claims.py report --out runs/claims   # tables of what has run

``--steps-scale`` multiplies every step count (a quick look: 0.05). The parts given build the
bases their runs continue (``claim1`` alone: the 32 px stage and the dense base).

Time and memory on one H200 (bf16 autocast), measured: one run alone trains the 32 px stage at
12 steps a second (1,500 steps in 123 s) and the rebase base's 64 px stage at 5 (kv16 top-p,
1,000 steps in 180 to 205 s; batch 16); runs in several processes share the GPU by time slices
and lose to one run at a time (3 at once advanced about 3 steps a second together). A run holds
12 to 26 GiB (kv16 top-p at 64 px the most); 8 at once ran out of memory. In 64 px steps, the
bases are about 4,200, ``claim2``'s runs 2,400 and ``claim1``'s 4,800 (about 40 minutes at 5
steps a second), and each run ends with its evaluation (validation loss, then ODE samples
scored at each evaluation sparsity). One session of 30 GPU minutes does one part with the
bases it needs (``base`` for claim 3, ``claim2``, or ``claim1``).
``benchmarks/gpu_session.sh claims`` brings back each finished run's ``config.json`` and sample
grids (``claims_runs.tar`` in 15 MiB pieces, no weights); the ``report`` of the results folder
adds their figures to its ``runs.jsonl`` and writes the tables from all of them, after which the
run folders need not be kept::

    cat claims_runs.tar.part* | tar -x -C benchmarks/results/claims   # each session's runs
    python benchmarks/sparsity_claims.py report --out benchmarks/results/claims

A base's weights (20 M parameters, 81 MB) travel to a later session's machine in bfloat16
(``--store-bf16 base_dense``, ``CLAIMS_KEEP`` there): the runs continuing it start from its
weights rounded to 8 significant bits, so every run of one claim continues the same stored base.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import statistics
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_for_any
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from vsa2_rl.config import ConfigError, VSA2Config
from vsa2_rl.toy import testbed
from vsa2_rl.toy.build import SAMPLES_DIR, BuildStopped, ToyBuildConfig, build_toy_model
from vsa2_rl.toy.model import CONFIG_FILE, WEIGHTS_FILE

PARTS = ("base", "claim1", "claim2", "report")
# The fine-grained router of the 1.3B recipe and VSA's router (fixed budget of 64-key cubes).
ROUTERS = {"kv16 top-p": (16, "topp"), "kv64 top-k": (64, "topk")}
CLAIM1_STEPS, CLAIM2_STEPS = 200, 400
CLAIM2_TRAIN = {"sparse 0.9": 0.9, "dense": 0.0}
TITLE_HEIGHT = 16  # pixels above each grid of a sample sheet
STOP_GRACE_S = 60  # how long a stopped worker may take to save its stage's state
STOPPED_EXIT_CODE = 3  # a worker's exit code after saving a stopped stage's state
RUNS_FILE = "runs.jsonl"  # under --out: one line a finished run, the figures the report reads


def _info(folder: Path) -> dict | None:
    """The training info of a finished run in ``folder`` (None if it has not finished)."""
    path = folder / CONFIG_FILE
    if not path.exists():
        return None
    info = json.loads(path.read_text())["training"]
    return info if "build_device" in info else None


@dataclass(frozen=True)
class Run:
    """One build into ``folder``, continuing the finished build in ``resume_from`` if given."""

    folder: Path
    config: ToyBuildConfig
    resume_from: Path | None = None


def _router(args, kv_block: int = 16, mode: str = "topp") -> VSA2Config:
    return VSA2Config(kv_block=kv_block, mode=mode, backend=args.backend)


def _base_recipe(attention: str, args, seed: int = 0):
    return testbed.testbed_recipe(attention, seed, steps_scale=args.steps_scale, vsa2=_router(args))


def base_folder(out: Path, name: str, seed: int = 0) -> Path:
    """A base's folder: ``base_<name>`` for seed 0 (claims 1 and 2 continue those) and
    ``base_<name>_s<seed>`` for the others."""
    return out / (f"base_{name}" if seed == 0 else f"base_{name}_s{seed}")


def _steps(steps: int, args) -> int:
    return max(1, round(steps * args.steps_scale))


def base_runs(args) -> list[Run]:
    """The three bases of each seed; ``dense`` and ``rebase`` resume from one build of their
    32 px stage."""
    runs = []
    for seed in args.seeds:
        low = base_folder(args.out, "low", seed)
        runs.append(Run(low, testbed.low_resolution_recipe(seed, steps_scale=args.steps_scale)))
        for attention in ("dense", "rebase"):
            recipe = _base_recipe(attention, args, seed)
            runs.append(Run(base_folder(args.out, attention, seed), recipe, low))
        sparse = _base_recipe("sparse", args, seed)
        runs.append(Run(base_folder(args.out, "sparse", seed), sparse))
    return runs


def claim1_folder(out: Path, router: str, density: float, seed: int) -> Path:
    return out / "claim1" / f"{router.replace(' ', '_')}_d{density}_s{seed}"


def claim1_runs(args) -> list[Run]:
    base = _base_recipe("dense", args)
    runs = []
    for seed in args.seeds:
        for density in args.densities:
            for router, (kv_block, mode) in ROUTERS.items():
                config = testbed.fine_tune_recipe(
                    base, _steps(CLAIM1_STEPS, args), 1.0 - density, seed,
                    vsa2=_router(args, kv_block, mode),
                )  # fmt: skip
                folder = claim1_folder(args.out, router, density, seed)
                runs.append(Run(folder, config, base_folder(args.out, "dense")))
    return runs


def claim2_folder(out: Path, trained: str, seed: int) -> Path:
    return out / "claim2" / f"{trained.replace(' ', '_')}_s{seed}"


def claim2_runs(args) -> list[Run]:
    base = _base_recipe("rebase", args)
    runs = []
    for seed in args.seeds:
        for trained, sparsity in CLAIM2_TRAIN.items():
            config = testbed.fine_tune_recipe(
                base, _steps(CLAIM2_STEPS, args), sparsity, seed,
                eval_sparsities=testbed.EVAL_SPARSITIES, report_seeds=2,
            )  # fmt: skip
            folder = claim2_folder(args.out, trained, seed)
            runs.append(Run(folder, config, base_folder(args.out, "rebase")))
    return runs


def with_bases(runs: list[Run], args) -> list[Run]:
    """``runs`` after the bases (:func:`base_runs`) they continue that are neither built nor
    among them: a claim alone builds only the bases it needs."""
    bases = {run.folder: run for run in base_runs(args)}
    scheduled = {run.folder for run in runs}
    needed, unchecked = [], list(runs)
    while unchecked:
        base = bases.get(unchecked.pop().resume_from)
        if base is not None and base.folder not in scheduled and _info(base.folder) is None:
            scheduled.add(base.folder)
            needed.insert(0, base)
            unchecked.append(base)
    return [*needed, *runs]


def log_file(folder: Path) -> Path:
    """Where a run in a worker process writes its progress: beside its folder."""
    return folder.parent / f"{folder.name}.log"


def resume_point(run: Run) -> Path | None:
    """Where ``run`` starts: its own folder once a stage of it has been saved there (a call cut
    short), else the build it continues."""
    return run.folder if (run.folder / CONFIG_FILE).exists() else run.resume_from


def _build_in_worker(run: Run, device: str, threads: int) -> None:
    """A worker process's build of ``run``, its progress and any traceback in :func:`log_file`
    (appended: a run continued by a later call keeps its earlier lines). A SIGTERM stops the
    build at its next step with the stage's state saved, to be continued by the next call."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    torch.set_num_threads(threads)
    log_file(run.folder).parent.mkdir(parents=True, exist_ok=True)
    with log_file(run.folder).open("a") as stream:
        try:
            build_toy_model(
                run.folder, run.config, log=lambda line: print(line, file=stream, flush=True),
                device=device, resume_from=resume_point(run), stop_requested=stop.is_set,
            )  # fmt: skip
        except BuildStopped as stopped:
            print(stopped, file=stream, flush=True)
            raise SystemExit(STOPPED_EXIT_CODE) from None
        except BaseException:
            traceback.print_exc(file=stream)
            raise


def in_dependency_order(runs: list[Run]) -> list[Run]:
    """``runs`` in the order given, except that a run continuing another of them comes after
    it (the other moved up to just before its first such run)."""
    by_folder = {run.folder: run for run in runs}
    ordered, placed = [], set()

    def place(run: Run) -> None:
        if run.folder not in placed:
            placed.add(run.folder)
            if run.resume_from in by_folder:
                place(by_folder[run.resume_from])
            ordered.append(run)

    for run in runs:
        place(run)
    return ordered


def execute(runs: list[Run], args) -> None:
    """Builds the unfinished ``runs``: in this process one after another (``--jobs 1``; in the
    order given, each after the run it continues), or in ``--jobs`` worker processes, each run
    as soon as the run it continues has finished. A failed run does not stop the others (those
    continuing it are skipped); the failures are raised together at the end."""
    pending = in_dependency_order([run for run in runs if _info(run.folder) is None])
    scheduled = {run.folder for run in pending}
    for run in pending:
        if run.resume_from and run.resume_from not in scheduled and not _info(run.resume_from):
            raise SystemExit(f"error: {run.folder} continues {run.resume_from}, which has not "
                             "been built: run the part 'base' first (same --out)")  # fmt: skip
    if args.jobs == 1:
        _run_here(pending, args)
        return
    failed = _run_in_workers(pending, args)
    if failed:
        lines = "\n".join(f"  {folder}: {why}" for folder, why in failed.items())
        raise RuntimeError(f"{len(failed)} run(s) did not finish:\n{lines}")


def _run_here(pending: list[Run], args) -> None:
    """:func:`execute` in this process, one run after another; a SIGTERM stops the run at its
    next step with its stage's state saved, then raises KeyboardInterrupt."""
    stop = threading.Event()
    sigterm = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        for run in pending:
            print(f"== {run.folder}", flush=True)
            start = time.time()
            resume_from = resume_point(run)
            try:
                build_toy_model(run.folder, run.config, device=args.device,
                                resume_from=resume_from, stop_requested=stop.is_set)  # fmt: skip
            except BuildStopped as stopped:
                print(f"== {run.folder} {stopped}", flush=True)
                raise KeyboardInterrupt from None
            print(f"== {run.folder} done in {time.time() - start:.0f} s", flush=True)
    finally:
        signal.signal(signal.SIGTERM, sigterm)


def _ready(pending: list[Run], running: dict, failed: dict[Path, str]) -> list[Run]:
    """The pending runs whose base has finished; those whose base failed are moved to
    ``failed``."""
    for run in [run for run in pending if run.resume_from in failed]:
        pending.remove(run)
        failed[run.folder] = f"skipped: {run.resume_from} failed"
    unfinished = {run.folder for run in pending} | set(running)
    return [run for run in pending if run.resume_from not in unfinished]


def _run_in_workers(pending: list[Run], args) -> dict[Path, str]:
    """:func:`execute` with ``--jobs`` worker processes; returns why each failed run failed.
    Leaving early (an error, Ctrl-C, a SIGTERM such as ``timeout``'s) stops the workers still
    running: each saves its stage's state at its next step (killed after ``STOP_GRACE_S``)."""
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
    failed: dict[Path, str] = {}
    running: dict[Path, tuple] = {}  # folder: (process, start time)
    sigterm = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        while pending or running:
            for run in _ready(pending, running, failed)[: args.jobs - len(running)]:
                pending.remove(run)
                process = context.Process(target=_build_in_worker,
                                          args=(run, args.device, threads))  # fmt: skip
                process.start()
                running[run.folder] = (process, time.time())
                print(f"== {run.folder} (log: {log_file(run.folder)})", flush=True)
            if not running:
                if pending:
                    raise RuntimeError(f"runs wait on runs that never start: {pending}")
                break
            wait_for_any([process.sentinel for process, _ in running.values()])
            for folder, (process, start) in list(running.items()):
                if process.exitcode is None:
                    continue
                del running[folder]
                if process.exitcode:
                    failed[folder] = f"exit code {process.exitcode}, see {log_file(folder)}"
                    print(f"== {folder} FAILED ({failed[folder]})", flush=True)
                else:
                    print(f"== {folder} done in {time.time() - start:.0f} s", flush=True)
        return failed
    finally:
        signal.signal(signal.SIGTERM, sigterm)
        for process, _ in running.values():
            process.terminate()
        deadline = time.time() + STOP_GRACE_S
        for process, _ in running.values():
            process.join(max(0.0, deadline - time.time()))
            if process.exitcode is None:
                process.kill()
                process.join()


# ---- report -------------------------------------------------------------------------------

# the sample measures the tables read (claims 2 and 3)
SAMPLE_MEASURES = ("shape_fidelity", "direction_match", "speed_error")


def run_record(info: dict, curve: bool = False) -> dict:
    """What the report reads of a finished run's training info (its ``config.json``), all from
    its last stage: the float32 validation figures and, where recorded, their bf16 twins; the
    :data:`SAMPLE_MEASURES` of its samples at each attention; its training sparsity (None:
    dense) and the last point of its validation curve at it. With ``curve`` (claim 3's bases),
    also the validation curve of the whole build at its training attention, ``[step, loss]``
    with steps counted from the build's start, and each stage's step count."""
    stage = info["stages"][-1]
    sparsity = info["recipe"]["target_sparsity"] if stage["stage"]["vsa2"] else None
    key = "dense" if sparsity is None else f"vsa2@{sparsity}"
    record = {
        "sparsity": sparsity,
        "validation": stage["validation"],
        "samples": {
            attention: {name: figures[name] for name in SAMPLE_MEASURES if name in figures}
            for attention, figures in stage.get("samples", {}).items()
        },
        "curve_end": (stage.get("curve") or [{}])[-1].get(key),
    }
    if "validation_bf16" in stage:
        record["validation_bf16"] = stage["validation_bf16"]
    if curve:
        points, offset = [], 0
        for built in info["stages"]:
            points += [[offset + point["step"], point.get("dense", point.get("vsa2@0.9"))]
                       for point in built.get("curve", [])]  # fmt: skip
            offset += built["stage"]["steps"]
        record |= {"curve": points, "stage_steps": [s["stage"]["steps"] for s in info["stages"]]}
    return record


def _is_base(name: str) -> bool:
    """Whether the run ``name`` (a folder under --out) is a base (:func:`base_folder`)."""
    return "/" not in name and name.startswith("base_")


def read_runs(out: Path) -> dict[str, dict]:
    """The records of ``out``'s :data:`RUNS_FILE`, by run (its folder under ``out``)."""
    path = out / RUNS_FILE
    lines = path.read_text().splitlines() if path.is_file() else []
    records = [json.loads(line) for line in lines if line.strip()]
    return {record.pop("run"): record for record in records}


def gather_runs(out: Path) -> dict[str, dict]:
    """Every finished run's :func:`run_record`, by run: those of ``out``'s :data:`RUNS_FILE`,
    added to or replaced by those of the finished runs' folders under ``out`` (their
    ``config.json``); the file is rewritten when a folder gave one."""
    runs = read_runs(out)
    found = {}
    for path in out.rglob(CONFIG_FILE):
        info = _info(path.parent)
        if info is not None:
            name = path.parent.relative_to(out).as_posix()
            found[name] = run_record(info, curve=_is_base(name))
    if found:
        runs |= found
        lines = [json.dumps({"run": name, **runs[name]}) for name in sorted(runs, key=Path)]
        (out / RUNS_FILE).write_text("\n".join(lines) + "\n")
    return runs


def _run(runs: dict[str, dict], out: Path, folder: Path) -> dict | None:
    """The record of the run in ``folder`` (None if it has not finished)."""
    return runs.get(folder.relative_to(out).as_posix())


def _stats(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _cell(values: list[float], digits: int = 4) -> str:
    if not values:
        return "not run"
    mean, spread = _stats(values)
    return f"{mean:.{digits}f} ± {spread:.{digits}f} (n={len(values)})"


def verdict(differences: list[float], better: str, claim: str = "beats") -> str:
    """Paired differences (the claim's side minus the other, per seed) judged against their
    standard deviation over seeds (the spread). ``better``: "lower" or "higher" favours the
    claim's side. A claim that its side ``beats`` the other is "reproduced" when the mean
    favours it by more than the spread, "not reproduced" when it favours the other side by more
    than that, "inconclusive" otherwise; a claim that it ``matches`` the other is reproduced
    unless the other side is better by more than the spread. Fewer than 2 seeds: inconclusive."""
    if len(differences) < 2:
        return "inconclusive (fewer than 2 seeds)"
    mean, spread = _stats(differences)
    signed = -mean if better == "lower" else mean
    if signed > spread:
        return "reproduced" if claim == "beats" else "reproduced (better by more than the spread)"
    if -signed > spread:
        return "not reproduced"
    return "inconclusive" if claim == "beats" else "reproduced (within the spread)"


def _difference_cell(values: list[float]) -> str:
    mean, spread = _stats(values)
    return f"{mean:+.2e} ± {spread:.2e} (n={len(values)})"


def _claim1_losses(args, runs: dict, router: str, density: float) -> dict[int, tuple]:
    """Per seed that has run: (validation loss, measured density) at the router's density."""
    found = {}
    for seed in args.seeds:
        run = _run(runs, args.out, claim1_folder(args.out, router, density, seed))
        if run is not None:
            validation = run["validation"]
            sparsity = 1.0 - density
            found[seed] = (validation[f"vsa2@{sparsity}"], validation[f"density@{sparsity}"])
    return found


def _router_differences(found: dict, args, ratio: int, claim: str) -> list[str]:
    """kv16 top-p at ``density / ratio`` minus kv64 top-k at ``density``, per seed, judged as
    :func:`verdict`'s ``claim`` (lower loss is better), a line per density pair that has run."""
    lines = []
    for density in args.densities:
        if density / ratio not in args.densities:
            continue
        fine, coarse = found["kv16 top-p", density / ratio], found["kv64 top-k", density]
        paired = [fine[s][0] - coarse[s][0] for s in args.seeds if s in fine and s in coarse]
        if paired:
            judged = verdict(paired, "lower", claim)
            lines.append(f"- kv16 top-p at {density / ratio} vs kv64 top-k at {density}: "
                         f"{_difference_cell(paired)}: {judged}")  # fmt: skip
    return lines


def claim1_report(args, runs: dict[str, dict]) -> list[str]:
    lines = ["## Claim 1: the fine-grained router at half the attention of VSA's", "",
             "Validation flow-matching loss at each density after the same rebasing and "
             "fine-tuning from the dense base (measured density: keys kept / keys).", "",
             "| density | " + " | ".join(f"{r} loss | {r} measured density" for r in ROUTERS)
             + " |", "|---" * (1 + 2 * len(ROUTERS)) + "|"]  # fmt: skip
    found = {(r, d): _claim1_losses(args, runs, r, d) for r in ROUTERS
             for d in args.densities}  # fmt: skip
    for density in args.densities:
        cells = []
        for router in ROUTERS:
            runs = found[router, density].values()
            cells += [_cell([loss for loss, _ in runs]), _cell([d for _, d in runs], 3)]
        lines.append(f"| {density} | " + " | ".join(cells) + " |")
    lines += ["", "kv16 top-p at half the density against kv64 top-k, kv16's loss minus kv64's "
              "per seed (the claim, reaching VSA's loss, is reproduced unless kv16's is higher "
              "by more than the standard deviation over seeds):", ""]  # fmt: skip
    lines += _router_differences(found, args, ratio=2, claim="matches")
    lines += ["", "The same at equal density (kv16 top-p is better when its loss is lower by "
              "more than the standard deviation over seeds):", ""]  # fmt: skip
    lines += _router_differences(found, args, ratio=1, claim="beats")
    if any(found.values()):
        _plot_claim1(args, found)
    return lines


def _plot_claim1(args, found: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for router in ROUTERS:
        points = [(d, list(found[router, d].values())) for d in args.densities]
        points = [(d, runs) for d, runs in points if runs]
        if not points:
            continue
        x = [statistics.fmean(m for _, m in runs) for _, runs in points]
        y = [_stats([loss for loss, _ in runs]) for _, runs in points]
        axis.errorbar(x, [m for m, _ in y], yerr=[s for _, s in y], marker="o", label=router)
    axis.set_xscale("log")
    axis.set_xlabel("measured attention density")
    axis.set_ylabel("validation flow-matching loss")
    axis.legend()
    figure.tight_layout()
    figure.savefig(args.out / "claim1.png", dpi=120)
    plt.close(figure)


# (measure key in a run's stage figures, table heading, which way is better)
CLAIM2_MEASURES = (
    ("validation", "validation loss", "lower"),
    ("shape_fidelity", "shape fidelity", "higher"),
    ("direction_match", "direction followed", "higher"),
    ("speed_error", "speed error", "lower"),
)


def _claim2_measures(args, runs: dict) -> dict[tuple[str, float], dict[int, dict[str, float]]]:
    """Per (trained, evaluation sparsity): per seed that has run, its :data:`CLAIM2_MEASURES`."""
    measures = {}
    for trained in CLAIM2_TRAIN:
        found = {s: _run(runs, args.out, claim2_folder(args.out, trained, s)) for s in args.seeds}
        found = {s: run for s, run in found.items() if run}
        for sparsity in testbed.EVAL_SPARSITIES:
            key = f"vsa2@{sparsity}"
            measures[trained, sparsity] = {
                s: {name: run["validation"][key] if name == "validation"
                    else run["samples"][key][name] for name, _, _ in CLAIM2_MEASURES}
                for s, run in found.items()
            }  # fmt: skip
    return measures


def claim2_report(args, runs: dict[str, dict]) -> list[str]:
    lines = ["## Claim 2: hard-to-easy (trained at 0.9, evaluated easier)", "",
             "The rebase base fine-tuned at sparsity 0.9 and with dense attention for the same "
             "steps; held-out prompts, ODE samples (2 per prompt) and the validation set.", "",
             "| evaluated at | trained | " + " | ".join(h for _, h, _ in CLAIM2_MEASURES) + " |",
             "|---" * (2 + len(CLAIM2_MEASURES)) + "|"]  # fmt: skip
    measures = _claim2_measures(args, runs)
    for sparsity in testbed.EVAL_SPARSITIES:
        for trained in CLAIM2_TRAIN:
            runs = measures[trained, sparsity].values()
            cells = [_cell([run[name] for run in runs], 3) for name, _, _ in CLAIM2_MEASURES]
            lines.append(f"| {sparsity} | {trained} | " + " | ".join(cells) + " |")
    lines += ["", "The claim: the sparse-trained model, evaluated at an easier sparsity, beats "
              "the dense-trained model with full attention. Sparse-trained at each evaluation "
              "sparsity minus dense-trained at 0.0, per seed (reproduced when the sparse-trained "
              "side is better by more than the standard deviation over seeds):", ""]  # fmt: skip
    reference = measures["dense", 0.0]
    for sparsity in testbed.EVAL_SPARSITIES:
        sparse = measures["sparse 0.9", sparsity]
        seeds = [s for s in args.seeds if s in sparse and s in reference]
        for name, heading, better in CLAIM2_MEASURES:
            paired = [sparse[s][name] - reference[s][name] for s in seeds]
            if paired:
                lines.append(f"- at {sparsity}, {heading}: {_difference_cell(paired)}: "
                             f"{verdict(paired, better)}")  # fmt: skip
    if any(measures.values()):
        _plot_claim2(args, measures)
    seed = args.seeds[0]
    shown = [("dense", 0.0)] + [("sparse 0.9", s) for s in testbed.EVAL_SPARSITIES]
    sheets = [(f"trained {trained}, seed {seed}, evaluated at {sparsity}",
               claim2_folder(args.out, trained, seed) / SAMPLES_DIR / f"vsa2@{sparsity}.png")
              for trained, sparsity in shown]  # fmt: skip
    return lines + _sample_sheet(sheets, args.out / "claim2_samples.png")


def _plot_claim2(args, measures: dict) -> None:
    """``claim2.png``: each measure against the evaluation sparsity, per training, mean and
    spread over seeds, with the dense-trained model at full attention as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(CLAIM2_MEASURES), figsize=(4 * len(CLAIM2_MEASURES), 3.4))
    for axis, (name, heading, better) in zip(axes, CLAIM2_MEASURES, strict=True):
        for trained in CLAIM2_TRAIN:
            points = [(s, [run[name] for run in measures[trained, s].values()])
                      for s in testbed.EVAL_SPARSITIES]  # fmt: skip
            points = [(s, _stats(values)) for s, values in points if values]
            if points:
                axis.errorbar([s for s, _ in points], [m for _, (m, _) in points],
                              yerr=[sd for _, (_, sd) in points], marker="o",
                              capsize=3, label=f"trained {trained}")  # fmt: skip
        full = [run[name] for run in measures["dense", 0.0].values()]
        if full:
            mean, spread = _stats(full)
            axis.axhspan(mean - spread, mean + spread, color="grey", alpha=0.25,
                         label="trained dense, full attention")  # fmt: skip
        axis.set_title(f"{heading} ({better} is better)")
        axis.set_xlabel("evaluation sparsity")
    axes[0].legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(args.out / "claim2.png", dpi=110)
    plt.close(figure)


def _at_own_attention(attention: str) -> str:
    """The key of a base's stage figures at its training attention."""
    return "dense" if attention == "dense" else "vsa2@0.9"


# a base's figures for claim 3: (key, heading, which way is better), at its training attention
CLAIM3_MEASURES = (
    ("own_loss", "loss at its attention", "lower"),
    ("dense_loss", "loss dense", "lower"),
    *CLAIM2_MEASURES[1:],
)


def _base_figures(run: dict, attention: str) -> dict[str, float]:
    """A built base's :data:`CLAIM3_MEASURES` (samples at its training attention)."""
    own = _at_own_attention(attention)
    validation = run["validation"]
    figures = {name: run["samples"][own][name] for name, _, _ in CLAIM2_MEASURES[1:]}
    dense = validation.get("dense", validation.get("vsa2@0.0"))
    return {"own_loss": validation[own], "dense_loss": dense, **figures}


def _claim3_measures(args, runs: dict) -> dict[str, dict[int, dict[str, float]]]:
    """Per variant, per seed whose base has been built: its :data:`CLAIM3_MEASURES`."""
    measures: dict[str, dict[int, dict[str, float]]] = {}
    for attention in testbed.ATTENTION_SWITCHES:
        found = {s: _run(runs, args.out, base_folder(args.out, attention, s)) for s in args.seeds}
        measures[attention] = {
            seed: _base_figures(run, attention) for seed, run in found.items() if run
        }
    return measures


def _claim3_verdicts(measures: dict) -> list[str]:
    """Rebasing against full attention throughout (it should match it) and against VSA2 from
    the start (it should beat it), paired by seed, for each measure but the dense loss."""
    lines = ["", "The claim: rebased at the resolution change, VSA2 matches full attention "
             "throughout (rebase minus dense, per seed: reproduced unless full attention is better "
             "by more than the standard deviation over seeds) and beats VSA2 from the start "
             "(rebase minus sparse: reproduced when better by more than it):", ""]  # fmt: skip
    rebase = measures["rebase"]
    for other, label, claim in (("dense", "full attention", "matches"),
                                ("sparse", "VSA2 from the start", "beats")):  # fmt: skip
        seeds = [seed for seed in rebase if seed in measures[other]]
        for name, heading, better in CLAIM3_MEASURES:
            if name == "dense_loss" or not seeds:
                continue
            paired = [rebase[seed][name] - measures[other][seed][name] for seed in seeds]
            lines.append(f"- against {label}, {heading}: {_difference_cell(paired)}: "
                         f"{verdict(paired, better, claim)}")  # fmt: skip
    return lines


def claim3_report(args, runs: dict[str, dict]) -> list[str]:
    lines = ["## Claim 3: sparse rebasing at the resolution change", "",
             "Validation loss at 64 px at the end of pretraining (32 px, then 64 px), each "
             "variant at its training attention and dense (sparsity 0); held-out samples (ODE) "
             "at its training attention; mean ± standard deviation over seeds.", "",
             "| variant | " + " | ".join(heading for _, heading, _ in CLAIM3_MEASURES) + " |",
             "|---" * (1 + len(CLAIM3_MEASURES)) + "|"]  # fmt: skip
    measures = _claim3_measures(args, runs)
    for attention, by_seed in measures.items():
        cells = [_cell([run[name] for run in by_seed.values()], 4 if "loss" in name else 3)
                 for name, _, _ in CLAIM3_MEASURES]  # fmt: skip
        lines.append(f"| {attention} | " + " | ".join(cells) + " |")
    lines += _claim3_verdicts(measures)
    first = args.seeds[0]
    bases = {attention: base_folder(args.out, attention, first)
             for attention in testbed.ATTENTION_SWITCHES}  # fmt: skip
    curves = {attention: run for attention, folder in bases.items()
              if (run := _run(runs, args.out, folder))}  # fmt: skip
    if curves:
        _plot_claim3(args, curves)
    sheets = [(f"{attention}, seed {first}, at its attention",
               base_folder(args.out, attention, first) / SAMPLES_DIR
               / f"{_at_own_attention(attention)}.png")
              for attention in testbed.ATTENTION_SWITCHES]  # fmt: skip
    return lines + _sample_sheet(sheets, args.out / "claim3_samples.png")


def _sample_sheet(grids: list[tuple[str, Path]], path: Path) -> list[str]:
    """The sample grids (PNG, one video a row) that exist among ``grids``, one under the other,
    each under its title, as ``path``; the report's line pointing at it (none without grids)."""
    from PIL import Image, ImageDraw

    found = [(title, Image.open(png).convert("RGB")) for title, png in grids if png.exists()]
    if not found:
        return []
    width = max(image.width for _, image in found)
    height = sum(TITLE_HEIGHT + image.height for _, image in found)
    sheet = Image.new("RGB", (width, height), "white")
    top = 0
    for title, image in found:
        ImageDraw.Draw(sheet).text((2, top + 2), title, fill="black")
        sheet.paste(image, (0, top + TITLE_HEIGHT))
        top += TITLE_HEIGHT + image.height
    sheet.save(path)
    return ["", f"Samples (held-out prompts, ODE, first seed): {path.name}; the prompts of the "
            "rows are in each run's samples/*.txt."]  # fmt: skip


def _plot_claim3(args, curves: dict[str, dict]) -> None:
    """``claim3.png``: each base's validation curve (its record's ``curve``) over pretraining."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for attention, run in curves.items():
        axis.plot([x for x, _ in run["curve"]], [y for _, y in run["curve"]], label=attention)
    switch = next(iter(curves.values()))["stage_steps"][0]
    axis.axvline(switch, color="grey", linestyle=":", label="32 px -> 64 px")
    axis.set_yscale("log")
    axis.set_xlabel("pretraining step")
    axis.set_ylabel("validation loss (at its training attention)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(args.out / "claim3.png", dpi=120)
    plt.close(figure)


def precision_report(args, runs: dict[str, dict]) -> list[str]:
    """Each finished run's last stage at its training sparsity: the float32 stage-end validation
    loss against the same under bf16 autocast (the training's kernels, recorded on CUDA) and
    the last point of its validation curve (bf16, the weights before the EMA is swapped in)."""
    lines = ["## Measurement check: float32 against the training's bf16 kernels", "",
             "| run | sparsity | float32 | bf16 autocast | curve's last point (live weights) |",
             "|---|---|---|---|---|"]  # fmt: skip
    for name in sorted(runs, key=Path):
        run = runs[name]
        if "validation_bf16" not in run:
            continue
        sparsity = run["sparsity"]
        key = "dense" if sparsity is None else f"vsa2@{sparsity}"
        cells = [run["validation"].get(key), run["validation_bf16"].get(key), run["curve_end"]]
        cells = ["-" if value is None else f"{value:.4f}" for value in cells]
        lines.append(f"| {name} | {sparsity or 0.0} | " + " | ".join(cells) + " |")
    return lines if len(lines) > 4 else []


def run_report(args) -> None:
    lines = ["# VSA2's quality claims on the sparsity testbed", "",
             f"Steps scale {args.steps_scale}; seeds {args.seeds}; the figures of every run are "
             f"in {RUNS_FILE}.", ""]  # fmt: skip
    runs = gather_runs(args.out)
    for part in (claim1_report, claim2_report, claim3_report, precision_report):
        lines += [*part(args, runs), ""]
    (args.out / "claims.md").write_text("\n".join(lines))
    print("\n".join(lines))


def store_in_bf16(folder: Path) -> None:
    """Rewrites the weights of the finished run in ``folder`` in bfloat16: half the bytes (a base
    of the testbed fits a machine's carry limit then), read back into float32 by every run that
    continues it, rounded to 8 significant bits."""
    if _info(folder) is None:
        raise SystemExit(f"error: --store-bf16: {folder} holds no finished run")
    path = folder / WEIGHTS_FILE
    tensors = {name: tensor.to(torch.bfloat16) for name, tensor in load_file(str(path)).items()}
    written = path.with_suffix(".tmp")
    save_file(tensors, str(written))
    os.replace(written, path)


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses bad arguments before any run starts (parser.error exits with the message)."""
    if args.steps_scale <= 0:
        parser.error(f"--steps-scale: must be > 0, got {args.steps_scale}")
    if args.jobs < 1:
        parser.error(f"--jobs: must be >= 1, got {args.jobs}")
    outside = [density for density in args.densities if not 0 < density < 1]
    if outside:
        parser.error(f"--densities: each must be between 0 and 1 (exclusive), got {outside}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device: {args.device!r} is not a device; use cpu or cuda[:N]")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device: {args.device} asked for, but no CUDA GPU is visible; use cpu")
    try:
        VSA2Config(backend=args.backend)
    except ConfigError as error:
        parser.error(f"--backend: {error}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="+", choices=PARTS, help="what to run (report last)")
    parser.add_argument("--out", type=Path, default=Path("runs/claims"), help="output folder")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--backend", default="auto", help="VSA2 kernels: auto, triton, torch")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--densities", type=float, nargs="+",
                        default=[0.25, 0.125, 0.0625, 0.03125])  # fmt: skip
    parser.add_argument("--steps-scale", type=float, default=1.0, help="x every step count")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at once, each in its own process")  # fmt: skip
    parser.add_argument(
        "--store-bf16", nargs="+", default=[], metavar="RUN",
        help="afterwards, rewrite these finished runs' weights (folders under --out, e.g. "
        "base_dense) in bfloat16, to carry them elsewhere",
    )  # fmt: skip
    args = parser.parse_args(argv)
    _check_args(parser, args)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = {"base": base_runs, "claim1": claim1_runs, "claim2": claim2_runs}
    execute(with_bases([run for part in args.parts if part in runs for run in runs[part](args)],
                       args), args)  # fmt: skip
    if "report" in args.parts:
        run_report(args)
    for run in args.store_bf16:
        store_in_bf16(args.out / run)


if __name__ == "__main__":
    main()
