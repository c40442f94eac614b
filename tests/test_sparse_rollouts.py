"""benchmarks/sparse_rollouts.py: the testbed recipe and its control differ only in the reward,
the verdict rule judges each branch at its boundaries, the Wan-scale arithmetic and the report's
figures equal hand-computed ones, and on the CPU at a tiny size ``run`` trains, resumes nothing
it finished, and ``time`` and ``report`` read what it wrote."""

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import sparse_rollouts
from sparse_rollouts import Stat

from vsa2_rl.config import load_config

REPO = Path(__file__).resolve().parents[1]


def test_the_control_recipe_differs_from_the_testbed_recipe_only_in_rewards_and_folder():
    runs = {kind: dataclasses.asdict(load_config(str(REPO / "configs" / f"testbed_{kind}.yaml")))
            for kind in ("nft", "control")}  # fmt: skip
    nft, control = runs["nft"], runs["control"]
    assert (nft["model"]["num_frames"], nft["model"]["height"]) == (32, 16)  # the long toy
    assert nft["sparsity"]["train"] == 0.9
    assert [f["name"] for f in control["rewards"]["functions"]] == ["random"]
    guards = {kind: [g["name"] for g in run["eval"]["guard_rewards"]] for kind, run in runs.items()}
    assert guards["control"] == ["prompt_motion", *guards["nft"]]
    for run in (nft, control):
        del run["rewards"]["functions"], run["eval"]["guard_rewards"], run["out_dir"]
    assert nft == control


def test_the_verdict_rule_at_each_branch_and_boundary():
    verdict = sparse_rollouts.rl_verdict
    dense = Stat(0.5, 0.125)  # margin max(0.125, sd) below; control 0.25
    # at least dense - margin, control beaten by more than the sd: reproduced, boundary included
    assert verdict(dense, Stat(0.375, 0.0625), 0.25) == "reproduced"
    assert verdict(dense, Stat(0.625, 0.0625), 0.25) == "reproduced"
    # the control beaten by exactly the sd is not "more than": inconclusive
    assert verdict(dense, Stat(0.375, 0.125), 0.25) == "inconclusive"
    # short of dense by more than 2 margins: not reproduced; by exactly 2: inconclusive
    assert verdict(dense, Stat(0.25 - 1 / 64, 0.0625), 0.0) == "not reproduced"
    assert verdict(dense, Stat(0.25, 0.0625), 0.0) == "inconclusive"
    # between 1 and 2 margins short: inconclusive; the larger sd sets the margin
    assert verdict(dense, Stat(0.3125, 0.0625), 0.0) == "inconclusive"
    assert verdict(dense, Stat(0.25, 0.25), -1.0) == "reproduced"
    assert verdict(dense, Stat(0.5, math.nan), 0.0).startswith("inconclusive")


def _write_parts(path: Path) -> None:
    path.write_text(
        "RL iteration caption; NVIDIA H100, 2026-12-06\n\n"
        "| grid | tokens | sparsity | forward s | iteration s (LoRA) | x dense |\n"
        "|---|---|---|---|---|---|\n"
        "| 480p:33 | 14040 | dense | 0.2 | 400 | 1.00 |\n"
        "| 720p:81 | 75600 | dense | 2.6 | 7200 | 1.00 |\n"
        "| 720p:81 | 75600 | 0.5 | 2.4 | 6000 | 1.20 |\n"
        "\nA note after the table.\n"
    )


def test_the_wan_scale_arithmetic_on_a_parts_table(tmp_path):
    _write_parts(tmp_path / "a.md")
    (tmp_path / "b.md").write_text(
        "| grid | sparsity | iteration s (LoRA) |\n|---|---|---|\n| 720p:81 | 0.9 | 3600 |\n"
        "| 720p:81 | dense | 6000 |\n"  # replaces a.md's dense 7200
    )
    parts = sparse_rollouts.parse_parts([tmp_path / "a.md", tmp_path / "b.md"])
    assert parts == {("480p:33", 0.0): 400.0, ("720p:81", 0.0): 6000.0,
                     ("720p:81", 0.5): 6000.0, ("720p:81", 0.9): 3600.0}  # fmt: skip
    # dense mean curve 0.5, 0.6, 0.8 at steps 0, 10, 20; 0.9 ends at 0.7 (dense's at step 15),
    # 0.5 at 0.9 (dense never reaches it); no 0.75 in the parts: its row is left out
    curves = {0.0: [(0, 0.5), (10, 0.6), (20, 0.8)], 0.5: [(0, 0.5), (20, 0.9)],
              0.75: [(0, 0.5), (20, 0.6)], 0.9: [(0, 0.5), (20, 0.7)]}  # fmt: skip
    rows = sparse_rollouts.wan_scale_rows(parts, curves, num_steps=20)
    speedups = {(grid, s): (seconds, have, need) for grid, s, seconds, have, need in rows}
    assert set(speedups) == {("720p:81", 0.5), ("720p:81", 0.9)}
    assert speedups[("720p:81", 0.9)] == pytest.approx((3600.0, 6000 / 3600, 20 / 15))
    assert speedups[("720p:81", 0.5)] == pytest.approx((6000.0, 1.0, 20 / 21))
    # a sparse run that ends at the base's reward needs an infinite speed-up
    assert sparse_rollouts.needed_speedup(20, sparse_rollouts.dense_equivalent_steps(
        curves[0.0], 0.5)) == math.inf  # fmt: skip
    assert sparse_rollouts.wan_scale_rows(parts, {0.9: curves[0.9]}, num_steps=20) == []


def test_the_recipes_rollout_sparsity_is_the_hardest_that_keeps_dense_gain():
    hardest = sparse_rollouts.hardest_kept_sparsity
    gains = {0.0: Stat(0.2, 0.01), 0.5: Stat(0.25, 0.01), 0.75: Stat(0.19, 0.01),
             0.9: Stat(0.1, 0.01)}  # fmt: skip
    controls = {s: Stat(0.0, math.nan) for s in gains}
    assert hardest(gains, controls) == "0.75"  # 0.19 >= 0.2 - 0.01; 0.9 falls short
    assert hardest(gains, {**controls, 0.75: Stat(0.185, 0)}) == "0.5"  # beaten by less than sd
    assert hardest(gains, {}) == "none"
    assert hardest({0.9: Stat(0.1, 0.01)}, controls) == "none"  # no dense runs to keep


def _eval_rows(label: str, figures: dict[float, tuple[float, ...]]) -> list[dict]:
    """eval.json rows in `vsa2-rl eval`'s format: (motion, direction, fidelity) per sparsity,
    and a fourth figure, the velocity's relative error against dense, where given."""
    return [{"run": label, "sparsity": s, "density": 1.0 - s, "latency_s": 0.5,
             **({"velocity_rel_error": figures[s][3]} if len(figures[s]) > 3 else {}),
             "reward/prompt_motion": motion, "reward/prompt_motion_std": 0.1,
             "reward/guard/prompt_direction": direction,
             "reward/guard/prompt_direction_std": 0.4,
             "reward/guard/shape_fidelity": fidelity, "reward/guard/shape_fidelity_std": 0.05,
             "reward/guard/image_quality": 0.5, "reward/guard/image_quality_std": 0.1}
            for s, (motion, direction, fidelity, *_) in figures.items()]  # fmt: skip


def _write_run(out: Path, name: str, end: dict, key: str, curve: list[float]) -> None:
    """A run folder (config.yaml, metrics.jsonl with evaluations at steps 0, 2, 4) and its
    sweep's eval.json with ``end``'s figures."""
    folder = out / "runs" / name
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text("train:\n  num_steps: 4\n")
    rows = [{"step": 2 * i, key: value, "eval/reward": value} for i, value in enumerate(curve)]
    rows.insert(1, {"step": 1, "perf/rollout_s": 1.0, "perf/train_s": 1.0})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    sweep = out / "sweeps" / name
    sweep.mkdir(parents=True)
    (sweep / "eval.json").write_text(json.dumps(_eval_rows(name, end)))


def _synthetic_out(out: Path) -> None:
    """Base: motion 0.5 / 0.4, direction 0.5 / 0.25 at 0 / 0.5, velocity error 0 / 0.1 / 0.3
    at 0 / 0.5 / 0.9. Two seeds at 0 and 0.9 and a control at each; dense seeds gain 0.2 and
    0.3 at 0.5, the 0.9 seeds 0.25 and 0.35."""
    (out / "sweeps" / "base").mkdir(parents=True)
    base = _eval_rows("base", {0.0: (0.5, 0.5, 0.9, 0.0), 0.5: (0.4, 0.25, 0.8, 0.1),
                               0.9: (0.35, 0.25, 0.7, 0.3)})  # fmt: skip
    (out / "sweeps" / "base" / "eval.json").write_text(json.dumps(base))
    motion = "eval/reward/prompt_motion"
    _write_run(out, "nft_s0_seed0", {0.0: (0.6, 0.75, 0.95), 0.5: (0.6, 0.5, 0.85)}, motion,
               [0.5, 0.55, 0.6])  # fmt: skip
    _write_run(out, "nft_s0_seed1", {0.0: (0.7, 1.0, 0.93), 0.5: (0.7, 0.5, 0.83)}, motion,
               [0.5, 0.65, 0.7])  # fmt: skip
    _write_run(out, "nft_s0.9_seed0", {0.0: (0.5, 0.5, 0.9), 0.5: (0.65, 0.5, 0.8)}, motion,
               [0.5, 0.5, 0.5])  # fmt: skip
    _write_run(out, "nft_s0.9_seed1", {0.0: (0.5, 0.5, 0.9), 0.5: (0.75, 0.75, 0.8)}, motion,
               [0.5, 0.5, 0.5])  # fmt: skip
    guard = "eval/guard/prompt_motion"
    _write_run(out, "control_s0_seed0", {0.0: (0.5, 0.5, 0.9), 0.5: (0.45, 0.25, 0.8)}, guard,
               [0.5, 0.5, 0.5])  # fmt: skip
    _write_run(out, "control_s0.9_seed0", {0.0: (0.5, 0.5, 0.9), 0.5: (0.3, 0.25, 0.8)}, guard,
               [0.5, 0.5, 0.5])  # fmt: skip
    (out / "seconds_per_step.json").write_text(json.dumps(
        {"device": "NVIDIA H100", "date": "2026-12-07", "steps": 3,
         "seconds_per_step": {"0": 10.0, "0.9": 5.0}}))  # fmt: skip


def test_the_report_tables_equal_the_hand_computed_changes(tmp_path):
    _synthetic_out(tmp_path)
    parts = tmp_path / "parts.md"
    _write_parts(parts)
    (tmp_path / "parts_0.9.md").write_text(
        "| grid | sparsity | iteration s (LoRA) |\n|---|---|---|\n| 720p:81 | 0.9 | 3600 |\n"
    )
    args = argparse.Namespace(out=tmp_path, eval_sparsity=0.5,
                              rl_scale=[parts, tmp_path / "parts_0.9.md"])  # fmt: skip
    assert sparse_rollouts.command_report(args) == 0
    report = (tmp_path / "report.md").read_text()
    rows = [line for line in report.splitlines() if line.startswith(("| nft", "| control"))]
    assert rows == [
        "| nft_s0_seed0 | 0 | 0 | +0.100 | +0.200 | +25.0 | +25.0 | 0.950 | 0.850 |",
        "| nft_s0_seed1 | 0 | 1 | +0.200 | +0.300 | +50.0 | +25.0 | 0.930 | 0.830 |",
        "| nft_s0.9_seed0 | 0.9 | 0 | +0.000 | +0.250 | +0.0 | +25.0 | 0.900 | 0.800 |",
        "| nft_s0.9_seed1 | 0.9 | 1 | +0.000 | +0.350 | +0.0 | +50.0 | 0.900 | 0.800 |",
        "| control_s0_seed0 | 0 | 0 | +0.000 | +0.050 | +0.0 | +0.0 | 0.900 | 0.800 |",
        "| control_s0.9_seed0 | 0.9 | 0 | +0.000 | -0.100 | +0.0 | +0.0 | 0.900 | 0.800 |",
    ]
    # sd of (0.1, 0.2) and of (0.2, 0.3): 0.0707; of (25, 50): 17.7; of (0.25, 0.35): 0.0707
    assert "| 0 | 2 | +0.150 ± 0.071 | +0.250 ± 0.071 | +37.5 ± 17.7 | +25.0 ± 0.0 | " \
        "+0.000 (n=1) | +0.050 (n=1) |" in report  # fmt: skip
    assert "| 0.9 | 2 | +0.000 ± 0.000 | +0.300 ± 0.071 | +0.0 ± 0.0 | +37.5 ± 17.7 | " \
        "+0.000 (n=1) | -0.100 (n=1) |" in report  # fmt: skip
    # 0.3 >= 0.25 - 0.0707 and 0.3 - (-0.1) > 0.0707
    assert "**reproduced**" in report and sparse_rollouts.VERDICT_RULE in report
    # 720p:81 at 0.9: 7200 / 3600 s = 2x, but its runs end at the base's 0.5, dense's start
    assert "| 720p:81 | 0.9 | 3600 | 2.00x | none suffices | no |" in report
    assert "**Rollout sparsity for the recipes**: 0.9 " in report  # keeps dense's 0.25 at 0.5
    assert "NVIDIA H100, 2026-12-07" in report
    # the gates: base at 0.5 (direction 0.25, fidelity 0.8); dense's direction +25 ± 0 points
    # at 0.5 against its control's 0.25 - 0.25 = 0
    assert "in 0.250 of held-out videos (gate 0.35-0.65) with shape fidelity 0.800" in report
    assert "gains +25.0 ± 0.0 direction points at 0.5 against its control's +0.0: +25.0 " \
        "points, gate >= +15: **passed**" in report  # fmt: skip
    # both rollout sparsities keep dense's gain and beat their control: no loss up to 0.3
    assert "| 0.9 | 0.3000 | +0.300 ± 0.071 | -0.100 | yes |" in report
    assert "**Threshold**: `velocity_rel_error` <= 0.3000; no loss of gain measured" in report
    assert (tmp_path / "report.png").read_bytes()[:4] == b"\x89PNG"


def test_the_report_refuses_an_out_without_runs_naming_the_argument(tmp_path):
    args = argparse.Namespace(out=tmp_path, eval_sparsity=0.5, rl_scale=[])
    with pytest.raises(SystemExit, match="--out: no runs"):
        sparse_rollouts.command_report(args)


@pytest.fixture
def tiny_base(tmp_path_factory, monkeypatch):
    """A testbed base at 32 px x 4 frames, 2 blocks of width 32, a few pretraining steps."""
    from vsa2_rl.toy import testbed

    architecture = {"patch_size": [1, 4, 4], "num_attention_heads": 2, "attention_head_dim": 16,
                    "ffn_dim": 64, "num_layers": 2, "freq_dim": 32}  # fmt: skip
    settings = {"TESTBED_ARCHITECTURE": architecture, "FRAMES": 4, "LOW_SIZE": 16,
                "HIGH_SIZE": 32, "BATCH": 2, "LOW_STEPS": 2, "HIGH_STEPS": 2,
                "REBASE_STEPS": 1, "VAL_EVERY": 2, "WARMUP_STEPS": 1}  # fmt: skip
    for name, value in settings.items():
        monkeypatch.setattr(testbed, name, value)
    base = tmp_path_factory.mktemp("base")
    testbed.main(["--out", str(base), "--mirrored-captions", "0", "--backend", "torch"])
    return base


TINY = ["model.height=32", "model.width=32", "model.num_frames=4", "attention.backend=torch",
        "rl.group_size=2", "rl.prompts_per_step=2", "rl.train_batch_size=4",
        "sampler.num_steps=2", "sampler.eval_num_steps=2", "train.num_steps=2", "eval.every=2",
        "train.checkpoint_every=2", "eval.num_prompts=2", "eval.samples_per_prompt=1",
        "rewards.num_workers=1"]  # fmt: skip


@pytest.mark.slow
def test_run_time_and_report_end_to_end_on_the_cpu(tmp_path, tiny_base, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "out"
    common = ["--base", str(tiny_base), "--out", str(out), "--sparsities", "0", "0.5",
              "--device", "cpu", "--set", *TINY]  # fmt: skip
    run = ["run", "--seeds", "0", "--parallel", "2", *common]
    assert sparse_rollouts.main(run) == 0
    names = ["nft_s0_seed0", "nft_s0.5_seed0", "control_s0_seed0", "control_s0.5_seed0"]
    for name in [*names, "base"]:
        assert (out / "sweeps" / name / "eval.json").is_file(), name
    metrics = {name: (out / "runs" / name / "metrics.jsonl").read_text() for name in names}
    logs = {name: (out / "runs" / f"{name}.log").read_text() for name in names}
    for text in metrics.values():
        assert [json.loads(line)["step"] for line in text.splitlines()] == [0, 1, 2]
    capsys.readouterr()
    assert sparse_rollouts.main(run) == 0  # everything finished: nothing runs again
    printed = capsys.readouterr().out
    assert printed.count("skipped") == 4 and "started" not in printed
    for name in names:
        assert (out / "runs" / name / "metrics.jsonl").read_text() == metrics[name]
        assert (out / "runs" / f"{name}.log").read_text() == logs[name]
    assert sparse_rollouts.main(["time", *common, "--steps", "2"]) == 0
    timing = json.loads((out / "seconds_per_step.json").read_text())
    assert timing["device"] == "cpu" and set(timing["seconds_per_step"]) == {"0", "0.5"}
    assert sparse_rollouts.main(["report", "--out", str(out)]) == 0
    report = (out / "report.md").read_text()
    for name in names:
        assert f"| {name} |" in report
    assert "not evaluated" not in report and (out / "report.png").is_file()


def test_warm_up_runs_are_planned_per_seed_with_the_warm_up_key(tmp_path):
    args = argparse.Namespace(base=tmp_path, device="cpu", set=[], out=tmp_path / "out",
                              sparsities=[0.0, 0.9], seeds=[0, 1], control_seed=0,
                              warmup_steps=0, warmup_sparsity=0.9,
                              configs=sparse_rollouts.CONFIGS)  # fmt: skip
    names = [job.name for job in sparse_rollouts.rl_jobs(args)]
    assert not [name for name in names if name.startswith("warmup")]  # not asked for
    args.warmup_steps = 5
    jobs = {job.name: job for job in sparse_rollouts.rl_jobs(args)}
    assert {"warmup_s0.9_seed0", "warmup_s0.9_seed1"} <= set(jobs)
    assert len(jobs) == 4 + 2 + 2  # 2 sparsities x 2 seeds, a control each, 2 warm-up runs
    command = jobs["warmup_s0.9_seed1"].command
    assert "sparsity.warmup_steps=5" in command and "sparsity.train=0.9" in command
    assert "seed=1" in command and str(sparse_rollouts.CONFIGS[0]) in command
    assert not [arg for arg in jobs["nft_s0.9_seed1"].command if "warmup" in arg]


def test_the_report_compares_warm_up_with_fixed_sparsity(tmp_path):
    _synthetic_out(tmp_path)
    motion = "eval/reward/prompt_motion"  # warm-up seeds gain 0.1 and 0.2 at 0.5 (base 0.4)
    _write_run(tmp_path, "warmup_s0.9_seed0", {0.0: (0.5, 0.5, 0.9), 0.5: (0.5, 0.25, 0.8)},
               motion, [0.5, 0.5, 0.5])  # fmt: skip
    _write_run(tmp_path, "warmup_s0.9_seed1", {0.0: (0.6, 0.75, 0.9), 0.5: (0.6, 0.5, 0.8)},
               motion, [0.5, 0.5, 0.5])  # fmt: skip
    parts = tmp_path / "parts.md"
    _write_parts(parts)
    args = argparse.Namespace(out=tmp_path, eval_sparsity=0.5, rl_scale=[parts])
    assert sparse_rollouts.command_report(args) == 0
    report = (tmp_path / "report.md").read_text()
    # fixed at 0.9: +0.000 ± 0.000 dense, +0.300 ± 0.071 at 0.5 (the test above); warm-up:
    # +0.050 ± 0.071 dense (0 and 0.1), +0.150 ± 0.071 at 0.5, direction +12.5 / +12.5 points
    assert "| 0.9, fixed | 2 | +0.000 ± 0.000 | +0.300 ± 0.071 | +0.0 ± 0.0 | +37.5 ± 17.7 |" \
        in report  # fmt: skip
    assert "| 0.9, warm-up from dense | 2 | +0.050 ± 0.071 | +0.150 ± 0.071 | +12.5 ± 17.7 | " \
        "+12.5 ± 17.7 |" in report  # fmt: skip
    assert "**reproduced**" in report  # the verdict is the fixed runs' alone


def test_the_agreement_threshold_stops_at_the_first_error_that_lost_the_gain():
    threshold = sparse_rollouts.agreement_threshold
    rows = [(0.9, 0.3, True), (0.0, 0.0, True), (0.75, 0.2, False), (0.5, 0.1, True)]
    # sorted by error: 0 kept, 0.1 kept, 0.2 lost: the threshold is 0.1, whatever 0.3 did
    assert threshold(rows) == (0.1, (0.75, 0.2))
    assert threshold([(0.0, 0.0, True), (0.5, 0.25, True)]) == (0.25, None)
    assert threshold([(0.0, 0.0, True), (0.5, 0.25, False)]) == (0.0, (0.5, 0.25))


def test_the_gate_fails_below_fifteen_points_and_says_when_unmeasured():
    base = {0.5: {"direction": 0.5, "fidelity": 0.95}}
    dense = [sparse_rollouts.Run("nft", 0.0, seed, Path(f"nft_s0_seed{seed}")) for seed in (0, 1)]
    control = sparse_rollouts.Run("control", 0.0, 0, Path("control_s0_seed0"))
    changes = {"nft_s0_seed0": {0.5: {"direction": 16.0}},
               "nft_s0_seed1": {0.5: {"direction": 14.0}},
               "control_s0_seed0": {0.5: {"direction": 1.0}}}  # fmt: skip
    text = "\n".join(sparse_rollouts.gate_lines([*dense, control], changes, base, 0.5))
    assert "+15.0 ± 1.4 direction points" in text and "+14.0 points" in text
    assert "**failed**" in text
    text = "\n".join(sparse_rollouts.gate_lines(dense, changes, base, 0.5))
    assert "**not measured**" in text


def test_packed_configs_read_back_as_the_files_they_replace(tmp_path):
    import yaml

    nft, control = sparse_rollouts.CONFIGS
    recipes = {"nft_s0.5_seed0": nft, "control_s0.5_seed0": control}
    for name, recipe in recipes.items():
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "config.yaml").write_text(recipe.read_text())
        (tmp_path / "runs" / name / "metrics.jsonl").write_text('{"step": 0}\n')
    assert sparse_rollouts.main(["pack", "--out", str(tmp_path)]) == 0
    assert not list((tmp_path / "runs").glob("*/config.yaml"))  # the files are gone
    for name, recipe in recipes.items():  # and each run's config reads back whole
        expected = yaml.safe_load(recipe.read_text())
        assert sparse_rollouts.run_config(tmp_path / "runs" / name) == expected
    # a run added later is packed beside the earlier ones, which keep their lines
    (tmp_path / "runs" / "nft_s0.9_seed0").mkdir()
    (tmp_path / "runs" / "nft_s0.9_seed0" / "config.yaml").write_text(nft.read_text())
    assert sparse_rollouts.pack_configs(tmp_path) == 1
    lines = (tmp_path / "configs.jsonl").read_text().splitlines()
    assert [json.loads(line)["run"] for line in lines] == [
        "control_s0.5_seed0", "nft_s0.5_seed0", "nft_s0.9_seed0"
    ]  # fmt: skip
    assert sparse_rollouts.run_config(tmp_path / "runs" / "nft_s0.75_seed0") is None


def test_a_packed_study_gives_the_unpacked_studys_report(tmp_path):
    parts = tmp_path / "parts.md"
    _write_parts(parts)
    reports = {}
    for folder in ("unpacked", "packed"):
        out = tmp_path / folder
        _synthetic_out(out)
        with (out / "runs" / "nft_s0_seed0" / "metrics.jsonl").open("a") as metrics:
            metrics.write('{"step": 4, "eval/reward": 0.6}\n{"step": 5, "eval/re')  # resumed, torn
        (out / "runs" / "nft_s0_seed0.log").write_text("a run's log\n")
        (out / "sweeps" / "base.log").write_text("a sweep's log\n")
        (out / "sweeps" / "base" / "eval.md").write_text("| a sweep's table |\n")
        (out / "runs" / "nft_s0_seed1" / "eval_step_4.png").write_bytes(b"\x89PNG")
        if folder == "packed":
            assert sparse_rollouts.main(["pack", "--out", str(out)]) == 0
        args = argparse.Namespace(out=out, eval_sparsity=0.5, rl_scale=[parts])
        assert sparse_rollouts.command_report(args) == 0
        reports[folder] = (out / "report.md").read_text()
    assert reports["packed"] == reports["unpacked"]
    packed = tmp_path / "packed"
    # what remains: the packed files, the sample grid and its run folder, the reports
    assert sorted(str(p.relative_to(packed)) for p in packed.rglob("*") if p.is_file()) == [
        "configs.jsonl", "report.md", "report.png", "runs.jsonl",
        "runs/nft_s0_seed1/eval_step_4.png", "seconds_per_step.json", "sweeps.jsonl",
    ]  # fmt: skip
    unpacked = tmp_path / "unpacked" / "runs" / "nft_s0_seed0"
    assert sparse_rollouts.run_metrics(packed / "runs" / "nft_s0_seed0") == (
        sparse_rollouts.read_metrics(unpacked / "metrics.jsonl")
    )
    base = json.loads((tmp_path / "unpacked" / "sweeps" / "base" / "eval.json").read_text())
    assert sparse_rollouts.sweep_rows(packed, "base") == base
    # a run added later is packed beside the earlier ones, which keep their lines
    _write_run(packed, "nft_s0.5_seed0", {0.0: (0.5, 0.5, 0.9), 0.5: (0.4, 0.25, 0.8)},
               "eval/reward/prompt_motion", [0.5, 0.5, 0.5])  # fmt: skip
    assert sparse_rollouts.pack_metrics(packed) == 1 and sparse_rollouts.pack_sweeps(packed) == 1
    assert sparse_rollouts.run_names(packed)[:3] == [
        "control_s0.9_seed0", "control_s0_seed0", "nft_s0.5_seed0"
    ]  # fmt: skip
    assert sparse_rollouts.sweep_names(packed) == ["base", *sparse_rollouts.run_names(packed)]
    assert sparse_rollouts.run_metrics(packed / "runs" / "nft_s0_seed0")[4]["eval/reward"] == 0.6
