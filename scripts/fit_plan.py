"""Fit the constants of vsa2_rl/plan.py to the measurements and print them.

Time, once for uncompiled and once for compiled blocks (``plan.TIME_FITS``): the forward's
seconds per unit of each ``plan.forward_terms`` entry, by least squares on relative errors over
the rows of benchmarks/results/rl_scale/*.md at the fit's setting and sparsities (``forward
s``), and its ``train_factor`` as the mean ratio ``LoRA train s / forward s`` there.
Memory: ``ACTIVATION_FACTOR``, least squares of each measured peak of
``plan.MEMORY_MEASUREMENTS`` minus the weights, gradients and optimizer states it holds.
Paste the printed values into vsa2_rl/plan.py after the tables change; ``--table`` prints each
estimate beside its measurement instead (the trainer's peaks too, which are not fitted: they
hold a VAE and its decode that the plan leaves out):

    python scripts/fit_plan.py
    python scripts/fit_plan.py --table
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import numpy as np

from vsa2_rl import plan

ROOT = Path(__file__).resolve().parent.parent
TABLES = sorted((ROOT / "benchmarks" / "results" / "rl_scale").glob("*.md"))
# benchmarks/bench_rl_scale.py times the Wan-1.3B shape (docs/results.md)
WAN_1_3B = plan.ModelShape(params=1_560_647_080, trained_params=0, layers=30, hidden=1536,
                           ffn=8960)  # fmt: skip
# docs/results.md, "Two GPUs": the trainer on benchmarks/wan_shaped_rl.yaml (full fine-tuning,
# 4 videos of 4 steps, 2 trained, VSA2 0.9, no guidance or KL), peak GiB per GPU, 2x H200
TRAINER = dict(tokens=14040, videos=4, sampler_steps=4, trained_steps=2, lora=False, sparsity=0.9)
TRAINER_PEAKS = (("ddp", 1, 16.1), ("ddp", 2, 18.7), ("zero2", 2, 19.2), ("zero3", 2, 19.3))
TERMS = ("linear", "dense attention", "vsa2 attention", "vsa2 overhead")
# compiled: the recipes' router measured at one sparsity cannot tell VSA2's per-token overhead
# from its attention (a free overhead term fits negative), so the attention term carries both
FITTED = {False: TERMS, True: TERMS[:3]}


# a row's setting cell per fit (plan.TIME_FITS): uncompiled blocks at the 1.3B shape's
# kv_block 16, top-p (``dense``, ``0.9``); compiled blocks at the recipes' router, kv64 top-k
# (``dense compiled``, ``0.875 kv64 top-k compiled``)
SETTINGS = {
    False: re.compile(r"(?P<sparsity>dense|[\d.]+)"),
    True: re.compile(r"(?P<sparsity>dense|[\d.]+ kv64 top-k) compiled"),
}


def read_rows(paths=TABLES, compiled: bool = False) -> list[dict]:
    """Every row of the tables at the setting of ``compiled``'s fit (:data:`SETTINGS`):
    tokens, sparsity (0 dense), forward s and LoRA train s. Rows of other kv_blocks, routers
    or block modes are left out."""
    rows = []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            cells = [c.strip() for c in line.strip("|").split("|")]
            if len(cells) < 5 or not re.fullmatch(r"\d+", cells[1]):
                continue
            setting = SETTINGS[compiled].fullmatch(cells[2])
            if setting is None:
                continue
            sparsity = setting["sparsity"].split()[0]
            sparsity = 0.0 if sparsity == "dense" else float(sparsity)
            rows.append(dict(tokens=int(cells[1]), sparsity=sparsity, forward=float(cells[3]),
                             train=float(cells[4])))  # fmt: skip
    return rows


def calibrated(rows: list[dict], compiled: bool = False) -> list[dict]:
    """The rows at the sparsities the constants of ``compiled``'s fit are fitted at."""
    return [r for r in rows if r["sparsity"] in plan.TIME_FITS[compiled].sparsities]


def fit_time(rows: list[dict], compiled: bool = False) -> tuple[dict[str, float], float]:
    """(seconds per unit of each forward term, train_factor) of ``compiled``'s fit from
    ``rows``."""
    rows, names = calibrated(rows, compiled), FITTED[compiled]
    terms = [plan.forward_terms(WAN_1_3B, r["tokens"], r["sparsity"]) for r in rows]
    a = np.array(
        [[t[name] / r["forward"] for name in names] for t, r in zip(terms, rows, strict=True)]
    )
    scale = a.max(axis=0)  # columns of ~1 for a well-conditioned solve
    solution, *_ = np.linalg.lstsq(a / scale, np.ones(len(rows)), rcond=None)
    seconds = dict.fromkeys(TERMS, 0.0) | dict(zip(names, (solution / scale).tolist(), strict=True))
    train_factor = float(np.mean([r["train"] / r["forward"] for r in rows]))
    return seconds, train_factor


def fit_memory(measurements=plan.MEMORY_MEASUREMENTS) -> float:
    """ACTIVATION_FACTOR from ``measurements``."""
    raw = np.array(
        [plan.activation_bytes(m, s)["training"] / plan.GIB for _, m, s, _ in measurements]
    )
    rest = np.array([gib - plan.states_update_gib(m, s) for _, m, s, gib in measurements])
    return float(raw @ rest / (raw @ raw))


def _row(name: str, measured: float, estimate: float) -> str:
    return f"| {name} | {measured:g} | {estimate:.3g} | {100 * (estimate / measured - 1):+.0f}% |"


def print_table() -> None:
    """Each estimate beside its measurement, as markdown."""
    print("| peak GiB | measured | estimate | off |\n|---|---|---|---|")
    for name, model, step, gib in plan.MEMORY_MEASUREMENTS:
        print(_row(name, gib, plan.memory_gib(model, step)["peak"]))
    full = plan.ModelShape(WAN_1_3B.params, WAN_1_3B.params, 30, 1536, 8960)
    for engine, gpus, gib in TRAINER_PEAKS:
        step = plan.StepShape(**TRAINER, engine=engine, gpus=gpus)
        print(
            _row(
                f"trainer, {engine} on {gpus} (not fitted)",
                gib,
                plan.memory_gib(full, step)["peak"],
            )
        )
    print("\n| 1.3B, tokens, sparsity | measured s | estimate s | off |\n|---|---|---|---|")
    for compiled in (False, True):
        blocks = "compiled" if compiled else "uncompiled"
        for r in read_rows(compiled=compiled):
            forward = plan.forward_seconds(WAN_1_3B, r["tokens"], r["sparsity"], compiled)
            name = f"{r['tokens']} at {r['sparsity']:g}, {blocks}"
            print(_row(f"{name}, forward", r["forward"], forward))
            train = plan.TIME_FITS[compiled].train_factor * forward
            print(_row(f"{name}, LoRA train", r["train"], train))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--table", action="store_true", help="estimates beside measurements")
    if parser.parse_args().table:
        print_table()
        return
    print(f"ACTIVATION_FACTOR = {fit_memory():.3g}")
    for compiled in (False, True):
        seconds, train_factor = fit_time(read_rows(compiled=compiled), compiled)
        print(f"TIME_FITS[{compiled}]: seconds_per={{")
        for name, value in seconds.items():
            print(f'    "{name}": {value:.3e},')
        print(f"}}, train_factor={train_factor:.3g}")


if __name__ == "__main__":
    main()
