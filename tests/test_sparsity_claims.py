"""benchmarks/sparsity_claims.py at a tiny scale on the CPU: every part runs from the one
before it, the measured densities of VSA's router are its closed-form budget, runs in worker
processes give the figures of runs in one, a failed run skips only the runs that continue it,
the verdict rule judges paired differences against their spread, the report reads the runs'
compact record (runs.jsonl) alone as it read their folders, and bad arguments are refused by
name before anything is written."""

import argparse
import dataclasses
import json
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import sparsity_claims

from vsa2_rl.toy import testbed
from vsa2_rl.toy.build import PARTIAL_FILE


@pytest.mark.parametrize("attention", testbed.ATTENTION_SWITCHES)
def test_the_claims_bases_pretrain_on_half_mirrored_captions(attention):
    # the documented claims' bases: half the videos move opposite to their caption, whatever
    # the toy base's own default
    from vsa2_rl.toy.data import pretraining_batch

    for recipe in (testbed.testbed_recipe(attention), testbed.low_resolution_recipe()):
        generator = torch.Generator().manual_seed(0)
        _, _, moves = pretraining_batch(4000, generator, recipe.mirrored_captions)
        mirrored = sum(move is not None for move in moves) / len(moves)
        assert abs(mirrored - 0.5) < 0.03, mirrored


def test_verdict_compares_the_mean_difference_with_its_spread():
    verdict = sparsity_claims.verdict
    assert verdict([-0.3, -0.1], "lower") == "reproduced"  # mean -0.2, sd 0.14
    assert verdict([-0.3, -0.1], "higher") == "not reproduced"
    assert verdict([-0.3, 0.2], "lower") == "inconclusive"  # mean -0.05, sd 0.35
    assert verdict([0.5], "higher").startswith("inconclusive")
    # "matches": only a worse side by more than the spread fails the claim
    assert verdict([-0.3, 0.2], "lower", "matches") == "reproduced (within the spread)"
    assert verdict([0.3, 0.1], "lower", "matches") == "not reproduced"
    assert verdict([-0.3, -0.1], "lower", "matches").startswith("reproduced (better")


def _write_run(folder: Path, stage: dict, sparsity: float | None = 0.9) -> None:
    """A finished run's config.json in ``folder``: one stage, ``stage``'s figures, trained at
    ``sparsity`` (None: dense)."""
    stage = {"stage": {"steps": 4, "vsa2": sparsity is not None}, **stage}
    training = {"build_device": "cpu", "recipe": {"target_sparsity": sparsity or 0.9},
                "stages": [stage]}  # fmt: skip
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"transformer": {}, "training": training}))


def _compacted(out: Path) -> dict[str, dict]:
    """The runs of ``out`` as the report reads them once their folders are gone: gathered into
    runs.jsonl, every run folder removed, read back from runs.jsonl alone."""
    gathered = sparsity_claims.gather_runs(out)
    for config in list(out.rglob("config.json")):
        shutil.rmtree(config.parent)
    runs = sparsity_claims.read_runs(out)
    assert runs == gathered
    return runs


def _write_claim2_run(out: Path, trained: str, seed: int, losses: dict[float, float]) -> None:
    """A finished claim-2 run with the validation ``losses`` per evaluation sparsity and fixed
    sample figures."""
    samples = {"shape_fidelity": 0.9, "direction_match": 0.25, "speed_error": 0.5,
               "prompt_motion": 0.6}  # fmt: skip
    stage = {"validation": {f"vsa2@{s}": loss for s, loss in losses.items()},
             "samples": {f"vsa2@{s}": samples for s in losses}}  # fmt: skip
    _write_run(sparsity_claims.claim2_folder(out, trained, seed), stage)


def test_claim2_judges_the_sparse_trained_model_against_dense_training_at_full_attention(
    tmp_path,
):
    sparsities = testbed.EVAL_SPARSITIES
    for seed, shift in ((0, 0.0), (1, 0.001)):
        # dense training: 0.020 with full attention, much worse sparse; sparse training: 0.030
        # at 0 and 0.015 at every sparser setting
        _write_claim2_run(
            tmp_path, "dense", seed, {s: (0.020 if s == 0.0 else 0.050) + shift for s in sparsities}
        )
        _write_claim2_run(
            tmp_path,
            "sparse 0.9",
            seed,
            {s: (0.030 if s == 0.0 else 0.015) + shift for s in sparsities},
        )
    args = argparse.Namespace(out=tmp_path, seeds=[0, 1])
    lines = sparsity_claims.claim2_report(args, _compacted(tmp_path))
    verdicts = {line.split(":")[0]: line for line in lines if "validation loss:" in line}
    assert verdicts["- at 0.0, validation loss"].endswith(
        "+1.00e-02 ± 0.00e+00 (n=2): not reproduced"
    )
    for sparsity in sparsities[1:]:  # against 0.020 at full attention, not 0.050 at its own
        assert verdicts[f"- at {sparsity}, validation loss"].endswith(
            "-5.00e-03 ± 0.00e+00 (n=2): reproduced"
        )
    assert any("inconclusive" in line for line in lines if "speed error:" in line)
    assert (tmp_path / "claim2.png").read_bytes()[:4] == b"\x89PNG"


def test_claim1_judges_half_density_and_equal_density_separately(tmp_path):
    # kv16 top-p: 0.020 at 0.25 and 0.023 at 0.125; kv64 top-k: 0.021 and 0.024, in both seeds
    losses = {("kv16 top-p", 0.25): 0.020, ("kv16 top-p", 0.125): 0.023,
              ("kv64 top-k", 0.25): 0.021, ("kv64 top-k", 0.125): 0.024}  # fmt: skip
    for seed, shift in ((0, 0.0), (1, 0.0005)):
        for (router, density), loss in losses.items():
            folder = sparsity_claims.claim1_folder(tmp_path, router, density, seed)
            sparsity = 1.0 - density
            stage = {"validation": {f"vsa2@{sparsity}": loss + shift,
                                    f"density@{sparsity}": density}, "samples": {}}  # fmt: skip
            _write_run(folder, stage, sparsity)
    args = argparse.Namespace(out=tmp_path, seeds=[0, 1], densities=[0.25, 0.125])
    lines = sparsity_claims.claim1_report(args, _compacted(tmp_path))
    judged = [line for line in lines if line.startswith("- ")]
    assert judged == [
        "- kv16 top-p at 0.125 vs kv64 top-k at 0.25: +2.00e-03 ± 0.00e+00 (n=2): not reproduced",
        "- kv16 top-p at 0.25 vs kv64 top-k at 0.25: -1.00e-03 ± 0.00e+00 (n=2): reproduced",
        "- kv16 top-p at 0.125 vs kv64 top-k at 0.125: -1.00e-03 ± 0.00e+00 (n=2): reproduced",
    ]
    assert (tmp_path / "claim1.png").read_bytes()[:4] == b"\x89PNG"


def _write_base(out, attention: str, seed: int, loss: float, fidelity: float) -> None:
    """A built base: ``loss`` and ``fidelity`` at its training attention."""
    own = sparsity_claims._at_own_attention(attention)
    samples = {"shape_fidelity": fidelity, "direction_match": 0.25, "speed_error": 0.5}
    validation = {own: loss, "vsa2@0.0": 0.033} if own != "dense" else {own: loss}
    # a sparse base's dense samples are worse: the table must not show them
    stage = {"validation": validation,
             "samples": {own: samples, "vsa2@0.0": {**samples, "shape_fidelity": 0.5}},
             "curve": [{"step": 2, own: loss}]}  # fmt: skip
    folder = sparsity_claims.base_folder(out, attention, seed)
    _write_run(folder, stage, None if attention == "dense" else 0.9)


def test_claim3_puts_each_bases_loss_beside_its_samples_at_its_training_attention(tmp_path):
    _write_base(tmp_path, "dense", 0, 0.020, 0.97)
    _write_base(tmp_path, "rebase", 0, 0.019, 0.86)
    args = argparse.Namespace(out=tmp_path, seeds=[0])
    lines = sparsity_claims.claim3_report(args, _compacted(tmp_path))
    rows = [line for line in lines if line.startswith(("| dense", "| rebase", "| sparse"))]
    one = "± 0.0000 (n=1)"
    assert rows == [
        f"| dense | 0.0200 {one} | 0.0200 {one} | 0.970 ± 0.000 (n=1) | 0.250 ± 0.000 (n=1) | "
        "0.500 ± 0.000 (n=1) |",
        f"| rebase | 0.0190 {one} | 0.0330 {one} | 0.860 ± 0.000 (n=1) | 0.250 ± 0.000 (n=1) | "
        "0.500 ± 0.000 (n=1) |",
        "| sparse | not run | not run | not run | not run | not run |",
    ]
    assert "- against full attention, shape fidelity: -1.10e-01 ± 0.00e+00 (n=1): " \
        "inconclusive (fewer than 2 seeds)" in lines  # fmt: skip
    assert not [line for line in lines if "VSA2 from the start" in line and line[0] == "-"]


def test_claim3_pairs_each_seeds_bases_and_judges_them_by_the_spread(tmp_path):
    for seed, (dense, rebase, sparse) in enumerate([(0.97, 0.86, 0.92), (0.98, 0.85, 0.79)]):
        _write_base(tmp_path, "dense", seed, 0.0200 + seed / 1000, dense)
        _write_base(tmp_path, "rebase", seed, 0.0190 + seed / 1000 - seed / 5000, rebase)
        _write_base(tmp_path, "sparse", seed, 0.0224, sparse)
    args = argparse.Namespace(out=tmp_path, seeds=[0, 1])
    lines = sparsity_claims.claim3_report(args, _compacted(tmp_path))
    assert "| dense | 0.0205 ± 0.0007 (n=2) | 0.0205 ± 0.0007 (n=2) | 0.975 ± 0.007 (n=2) |" \
        in " ".join(lines)  # fmt: skip
    verdicts = {line.split(":")[0]: line.rsplit(": ", 1)[1] for line in lines if line[:2] == "- "}
    # loss, rebase minus dense: -0.0010 and -0.0012 (mean -0.0011, sd 0.00014): lower is
    # better by more than the spread
    assert verdicts["- against full attention, loss at its attention"] == (
        "reproduced (better by more than the spread)"
    )
    # fidelity, rebase minus dense: -0.11 and -0.13: dense better by more than the spread
    assert verdicts["- against full attention, shape fidelity"] == "not reproduced"
    # fidelity, rebase minus sparse: -0.06 and +0.06: within the spread
    assert verdicts["- against VSA2 from the start, shape fidelity"] == "inconclusive"
    # loss, rebase minus sparse: -0.0034 and -0.0026 (sd 0.0006): rebase better beyond it
    assert verdicts["- against VSA2 from the start, loss at its attention"] == "reproduced"
    assert (tmp_path / "claim3.png").read_bytes()[:4] == b"\x89PNG"


def test_a_claim_without_finished_runs_gets_no_plot(tmp_path):
    _write_claim2_run(tmp_path, "dense", 0, dict.fromkeys(testbed.EVAL_SPARSITIES, 0.02))
    args = argparse.Namespace(out=tmp_path, seeds=[0], densities=[0.25, 0.125])
    runs = _compacted(tmp_path)
    for report in (sparsity_claims.claim1_report, sparsity_claims.claim3_report):
        assert any("not run" in line for line in report(args, runs))
    sparsity_claims.claim2_report(args, runs)
    assert sorted(path.name for path in tmp_path.glob("*.png")) == ["claim2.png"]


def test_the_precision_check_lists_each_run_with_both_stage_end_figures_and_its_curve(tmp_path):
    stage = {"validation": {"vsa2@0.9": 0.0278, "vsa2@0.0": 0.03},
             "validation_bf16": {"vsa2@0.9": 0.0213, "vsa2@0.0": 0.029},
             "curve": [{"step": 400, "vsa2@0.9": 0.0211}]}  # fmt: skip
    _write_run(tmp_path / "claim2" / "sparse_0.9_s0", stage)
    # a CPU build records no bf16 figure: not listed
    _write_run(tmp_path / "base_low", {"validation": {"dense": 0.03}}, None)
    runs = _compacted(tmp_path)
    lines = sparsity_claims.precision_report(argparse.Namespace(out=tmp_path), runs)
    rows = [line for line in lines if line.startswith("| claim2") or line.startswith("| base")]
    assert rows == ["| claim2/sparse_0.9_s0 | 0.9 | 0.0278 | 0.0213 | 0.0211 |"]


def test_runs_jsonl_keeps_only_what_the_report_reads_and_takes_in_fresh_runs(tmp_path):
    samples = {"shape_fidelity": 0.9, "direction_match": 0.25, "speed_error": 0.5,
               "prompt_motion": 0.6, "group_std": 0.2}  # fmt: skip
    stage = {"validation": {"vsa2@0.9": 0.02}, "validation_bf16": {"vsa2@0.9": 0.021},
             "samples": {"vsa2@0.9": samples},
             "curve": [{"step": 2, "vsa2@0.9": 0.03}, {"step": 4, "vsa2@0.9": 0.025}]}  # fmt: skip
    _write_run(tmp_path / "base_rebase", stage)
    _write_run(tmp_path / "claim2" / "dense_s0", {**stage, "validation": {"vsa2@0.9": 0.04}})
    runs = _compacted(tmp_path)
    assert [json.loads(line)["run"] for line in (tmp_path / "runs.jsonl").open()] == [
        "base_rebase", "claim2/dense_s0"
    ]  # fmt: skip
    shared = {"sparsity": 0.9, "validation_bf16": {"vsa2@0.9": 0.021}, "curve_end": 0.025,
              "samples": {"vsa2@0.9": {"shape_fidelity": 0.9, "direction_match": 0.25,
                                       "speed_error": 0.5}}}  # fmt: skip
    # a base keeps its curve over the whole build (claim 3's plot), other runs its last point
    curve = {"curve": [[2, 0.03], [4, 0.025]], "stage_steps": [4]}
    assert runs["base_rebase"] == {**shared, "validation": {"vsa2@0.9": 0.02}, **curve}
    assert runs["claim2/dense_s0"] == {**shared, "validation": {"vsa2@0.9": 0.04}}
    # a fresh run's folder (a GPU session's, brought back) is added; one of the same name
    # replaces its record; runs only recorded stay
    _write_run(tmp_path / "claim2" / "dense_s1", {**stage, "validation": {"vsa2@0.9": 0.05}})
    _write_run(tmp_path / "claim2" / "dense_s0", {**stage, "validation": {"vsa2@0.9": 0.03}})
    runs = _compacted(tmp_path)
    assert sorted(runs) == ["base_rebase", "claim2/dense_s0", "claim2/dense_s1"]
    assert runs["claim2/dense_s0"]["validation"] == {"vsa2@0.9": 0.03}
    assert runs["claim2/dense_s1"]["validation"] == {"vsa2@0.9": 0.05}


def test_the_report_from_runs_jsonl_alone_is_the_report_from_the_run_folders(tmp_path):
    for seed in (0, 1):
        _write_claim2_run(tmp_path, "dense", seed, dict.fromkeys(testbed.EVAL_SPARSITIES, 0.02))
        _write_claim2_run(tmp_path, "sparse 0.9", seed,
                          dict.fromkeys(testbed.EVAL_SPARSITIES, 0.01 + seed / 100))  # fmt: skip
        for attention, loss in (("dense", 0.020), ("rebase", 0.019), ("sparse", 0.022)):
            _write_base(tmp_path, attention, seed, loss + seed / 1000, 0.9)
    args = argparse.Namespace(out=tmp_path, seeds=[0, 1], densities=[0.25], steps_scale=1.0)
    sparsity_claims.run_report(args)  # from the folders
    from_folders = {p.name: p.read_bytes() for p in tmp_path.glob("claim*.*")}
    _compacted(tmp_path)
    sparsity_claims.run_report(args)  # from runs.jsonl alone
    assert {p.name: p.read_bytes() for p in tmp_path.glob("claim*.*")} == from_folders
    report = from_folders["claims.md"].decode()
    assert "| 0.0 | dense | 0.020 ± 0.000 (n=2) | 0.900 ± 0.000 (n=2) |" in report
    assert "| rebase | 0.0195 ± 0.0007 (n=2) | 0.0330 ± 0.0000 (n=2) |" in report


@pytest.fixture
def tiny_testbed(monkeypatch):
    """The testbed's recipe at 16 / 32 px x 4 frames, 2 blocks of width 32, a few steps."""
    architecture = {"patch_size": [1, 4, 4], "num_attention_heads": 2, "attention_head_dim": 16,
                    "ffn_dim": 64, "num_layers": 2, "freq_dim": 32}  # fmt: skip
    settings = {"TESTBED_ARCHITECTURE": architecture, "FRAMES": 4, "LOW_SIZE": 16,
                "HIGH_SIZE": 32, "BATCH": 2, "LOW_STEPS": 4, "HIGH_STEPS": 4,
                "REBASE_STEPS": 2, "VAL_EVERY": 2, "WARMUP_STEPS": 1}  # fmt: skip
    for name, value in settings.items():
        monkeypatch.setattr(testbed, name, value)
    monkeypatch.setattr(sparsity_claims, "CLAIM1_STEPS", 2)
    monkeypatch.setattr(sparsity_claims, "CLAIM2_STEPS", 2)


@pytest.mark.slow
def test_a_testbed_base_with_truthful_captions_and_its_gate_at_its_own_size(
    tmp_path, tiny_testbed, capsys
):
    from vsa2_rl.toy import gate
    from vsa2_rl.toy.model import read_toy_config

    out = tmp_path / "learnable"
    testbed.main(["--out", str(out), "--mirrored-captions", "0", "--steps-scale", "0.5",
                  "--backend", "torch"])  # fmt: skip
    recipe = read_toy_config(out)["training"]["recipe"]
    assert recipe["mirrored_captions"] == 0.0
    assert [stage["steps"] for stage in recipe["stages"]] == [2, 2]  # the tiny 4 + 4, halved
    capsys.readouterr()
    # no fine-tuning: the same videos before and after, a gain of 0 fails the gate
    gate_args = ["--model", str(out), "--steps", "0", "--threads", "1", "--backend", "torch"]
    assert gate.main(gate_args) == 1
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["gain"] == 0.0
    # measured at the base's last stage: the tiny testbed's 32 px x 4 frames
    assert (result["settings"]["size"], result["settings"]["num_frames"]) == (32, 4)


def test_the_rl_base_learns_from_truthful_captions_and_covers_every_rl_sparsity():
    from vsa2_rl.toy.data import pretraining_batch

    recipe = testbed.rl_base_recipe(steps_scale=0.5)
    generator = torch.Generator().manual_seed(0)
    _, _, moves = pretraining_batch(1000, generator, recipe.mirrored_captions)
    assert all(move is None for move in moves)  # no video moves against its caption
    *low, rebase, spread = recipe.stages
    assert len(low) == testbed.RL_LOW_CHUNKS
    assert all((stage.size, stage.batch_size, stage.vsa2) == (32, 64, False) for stage in low)
    assert (rebase.size, rebase.vsa2, spread.size, spread.vsa2) == (64, True, 64, True)
    assert spread.sparsity_range == (0.0, 0.9)  # every rollout and evaluation sparsity
    assert [stage.steps for stage in (*low, rebase, spread)] == [625] * len(low) + [150, 100]
    assert len(testbed.rl_base_recipe(low_chunks=2).stages) == 4


def test_low_chunks_belongs_to_the_rl_recipe_and_counts_at_least_one(tmp_path, capsys):
    for option in (["--low-chunks", "2"], ["--recipe", "rl", "--low-chunks", "0"]):
        with pytest.raises(SystemExit):
            testbed.main(["--out", str(tmp_path / "x"), *option])
    errors = capsys.readouterr().err
    assert "--low-chunks is an option of --recipe rl, not of --recipe claims" in errors
    assert "--low-chunks: must be >= 1, got 0" in errors
    assert not (tmp_path / "x").exists()


def test_the_rl_recipe_refuses_the_claims_options(tmp_path, capsys):
    for option in (["--attention", "dense"], ["--mirrored-captions", "0.5"], ["--sparsity", "0.8"]):
        with pytest.raises(SystemExit):
            testbed.main(["--out", str(tmp_path / "x"), "--recipe", "rl", *option])
        message = f"{option[0]} is an option of --recipe claims, not of --recipe rl"
        assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()  # refused before anything is written


def test_the_long_recipe_is_the_shipped_one_and_a_stage_at_the_longer_length():
    from vsa2_rl.toy.model import ASSET_DIR, read_toy_config

    recipe = testbed.long_recipe(steps=150, frames=32)
    shipped = read_toy_config(ASSET_DIR)["training"]["recipe"]["stages"]
    assert json.loads(json.dumps([dataclasses.asdict(s) for s in recipe.stages[:-1]])) == shipped
    grown = recipe.stages[-1]
    assert (grown.size, grown.num_frames, grown.steps) == (16, 32, 150)
    assert grown.vsa2 and grown.sparsity_range == (0.0, 0.9)  # every RL and eval sparsity
    assert recipe.mirrored_captions == 0.0  # truthful captions, as the shipped base's


def test_the_long_recipe_refuses_other_recipes_options_and_a_folder_without_a_build(
    tmp_path, capsys
):
    for option in (["--recipe", "rl", "--long-steps", "5"], ["--frames", "32"],
                   ["--recipe", "long", "--low-chunks", "2"],
                   ["--recipe", "long", "--frames", "1"],
                   ["--recipe", "long", "--from", str(tmp_path)]):  # fmt: skip
        with pytest.raises(SystemExit):
            testbed.main(["--out", str(tmp_path / "x"), *option])
    errors = capsys.readouterr().err
    assert "--long-steps is an option of --recipe long, not of --recipe rl" in errors
    assert "--frames is an option of --recipe long, not of --recipe claims" in errors
    assert "--low-chunks is an option of --recipe rl, not of --recipe long" in errors
    assert "--frames: must be >= 2, got 1" in errors
    assert f"--from {tmp_path}: no config.json there" in errors
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_the_long_toy_grows_the_shipped_base_and_keeps_its_stages(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from vsa2_rl.toy.model import ASSET_DIR, WEIGHTS_FILE, read_toy_config

    monkeypatch.setattr(testbed, "LONG_BATCH", 2)
    monkeypatch.setattr(testbed, "LONG_REPORT_SEEDS", 1)
    out = tmp_path / "long"
    testbed.main(["--out", str(out), "--recipe", "long", "--frames", "4", "--long-steps", "2",
                  "--backend", "torch"])  # fmt: skip
    shipped, grown = read_toy_config(ASSET_DIR)["training"], read_toy_config(out)["training"]
    assert grown["stages"][:3] == shipped["stages"]  # resumed, not trained again
    assert grown["stages"][3]["stage"]["num_frames"] == 4
    assert set(grown["stages"][3]["samples"]) == {f"vsa2@{s}" for s in testbed.EVAL_SPARSITIES}
    before, after = load_file(str(ASSET_DIR / WEIGHTS_FILE)), load_file(str(out / WEIGHTS_FILE))
    assert before.keys() == after.keys()  # the VSA2 layers' router and gates included
    moved = [(after[k] - before[k]).norm() / before[k].norm() for k in before
             if before[k].norm() > 0]  # fmt: skip
    # two steps at a low rate move the shipped weights a little: loaded, not re-initialised
    assert 0 < max(moved) < 0.2


@pytest.mark.slow
def test_an_rl_base_builds_at_the_tiny_size(tmp_path, tiny_testbed, monkeypatch):
    from vsa2_rl.toy.model import read_toy_config

    monkeypatch.setattr(testbed, "RL_ARCHITECTURE", testbed.TESTBED_ARCHITECTURE)
    for name in ("RL_LOW_STEPS", "RL_REBASE_STEPS", "RL_RANGE_STEPS", "RL_LOW_BATCH"):
        monkeypatch.setattr(testbed, name, 2)
    out = tmp_path / "rl_base"
    testbed.main(["--out", str(out), "--recipe", "rl", "--low-chunks", "2", "--backend", "torch"])
    saved = read_toy_config(out)
    assert saved["transformer"]["num_layers"] == 2  # the tiny architecture it was given
    recipe = saved["training"]["recipe"]
    assert recipe["mirrored_captions"] == 0.0
    assert [(stage["size"], stage["vsa2"]) for stage in recipe["stages"]] == [
        (16, False), (16, False), (32, True), (32, True)
    ]  # fmt: skip
    assert len(saved["training"]["stages"]) == 4  # each stage ran and was measured


@pytest.mark.slow
def test_every_part_runs_and_the_report_has_each_claim(tmp_path, tiny_testbed):
    out = tmp_path / "claims"
    sparsity_claims.main(["base", "claim1", "claim2", "report", "--out", str(out),
                          "--backend", "torch", "--seeds", "0", "1",
                          "--densities", "0.5", "0.25"])  # fmt: skip
    report = (out / "claims.md").read_text()
    for heading in ("## Claim 1", "## Claim 2", "## Claim 3"):
        assert heading in report
    assert "not run" not in report
    assert (out / "claim1.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "claim3.png").read_bytes()[:4] == b"\x89PNG"
    # the sample sheets: each run's grid (one row a prompt) under a title strip
    grids = [
        out / f"base_{a}" / "samples" / name
        for a, name in (
            ("dense", "dense.png"),
            ("rebase", "vsa2@0.9.png"),
            ("sparse", "vsa2@0.9.png"),
        )
    ]
    heights = [Image.open(grid).height for grid in grids]
    assert not (out / "base_rebase" / "samples" / "dense.png").exists()  # its 32 px stage's
    sheet = Image.open(out / "claim3_samples.png")
    assert sheet.height == sum(heights) + 3 * sparsity_claims.TITLE_HEIGHT
    assert Image.open(out / "claim2_samples.png").height > 4 * sparsity_claims.TITLE_HEIGHT
    # at 32 px x 4 frames, 8 x 8 x 4 = 256 tokens: 4 cubes of 64 keys; VSA's router keeps
    # ceil(density * 4) of them for every query tile
    for density in (0.5, 0.25):
        folder = sparsity_claims.claim1_folder(out, "kv64 top-k", density, 0)
        validation = json.loads((folder / "config.json").read_text())["training"]["stages"][-1]
        measured = validation["validation"][f"density@{1.0 - density}"]
        assert measured == pytest.approx(math.ceil(density * 4) / 4)
    # claim 3's curves: a point every 2 steps of both pretraining stages
    info = json.loads((out / "base_rebase" / "config.json").read_text())["training"]
    assert [[p["step"] for p in stage["curve"]] for stage in info["stages"]] == [[2, 4], [2, 4]]
    # dense and rebase continue one build of the 32 px stage: its figures, carried over
    low = json.loads((out / "base_low" / "config.json").read_text())["training"]["stages"]
    dense = json.loads((out / "base_dense" / "config.json").read_text())["training"]["stages"]
    assert low[0] == dense[0] == info["stages"][0]


@pytest.mark.slow
def test_a_finished_run_is_not_run_again(tmp_path, tiny_testbed, monkeypatch):
    out = tmp_path / "claims"
    sparsity_claims.main(["base", "--out", str(out), "--backend", "torch"])
    before = (out / "base_dense" / "config.json").read_text()

    def refuse(*args, **kwargs):
        raise AssertionError("a finished base was built again")

    monkeypatch.setattr(sparsity_claims, "build_toy_model", refuse)
    sparsity_claims.main(["base", "--out", str(out), "--backend", "torch"])
    assert (out / "base_dense" / "config.json").read_text() == before


def _validation(folder: Path) -> list[dict]:
    info = json.loads((folder / "config.json").read_text())["training"]
    return [stage["validation"] for stage in info["stages"]]


def _low_then_dense(out: Path) -> list:
    """The 32 px stage and the dense base that continues it."""
    low = out / "low"
    return [sparsity_claims.Run(low, testbed.low_resolution_recipe()),
            sparsity_claims.Run(out / "dense", testbed.testbed_recipe("dense"), low)]  # fmt: skip


@pytest.mark.slow
def test_runs_in_worker_processes_give_the_figures_of_one_process(tmp_path, tiny_testbed):
    for jobs in (1, 2):
        runs = _low_then_dense(tmp_path / f"jobs{jobs}")
        sparsity_claims.execute(runs, argparse.Namespace(jobs=jobs, device="cpu"))
    for name in ("low", "dense"):
        one, workers = (
            _validation(tmp_path / "jobs1" / name),
            _validation(tmp_path / "jobs2" / name),
        )
        assert workers == [pytest.approx(stage, rel=1e-4, abs=1e-6) for stage in one]
        assert "saved to" in (tmp_path / "jobs2" / f"{name}.log").read_text()


@pytest.mark.slow
def test_a_failed_run_skips_only_the_runs_that_continue_it(tmp_path, tiny_testbed):
    (tmp_path / "low").write_text("a file where the 32 px stage's folder goes")
    other = sparsity_claims.Run(tmp_path / "other", testbed.low_resolution_recipe(seed=1))
    with pytest.raises(RuntimeError, match="2 run") as raised:
        sparsity_claims.execute([*_low_then_dense(tmp_path), other],
                                argparse.Namespace(jobs=2, device="cpu"))  # fmt: skip
    assert f"{tmp_path / 'dense'}: skipped: {tmp_path / 'low'} failed" in str(raised.value)
    assert sparsity_claims._info(tmp_path / "other") is not None
    assert not (tmp_path / "dense").exists()


@pytest.mark.slow
def test_a_claim_alone_builds_only_the_bases_it_continues(tmp_path, tiny_testbed):
    sparsity_claims.main(["claim2", "--out", str(tmp_path), "--backend", "torch", "--seeds", "0"])
    built = {name for name in ("low", "dense", "rebase", "sparse")
             if sparsity_claims._info(tmp_path / f"base_{name}")}  # fmt: skip
    assert built == {"low", "rebase"}
    for trained in sparsity_claims.CLAIM2_TRAIN:
        assert sparsity_claims._info(sparsity_claims.claim2_folder(tmp_path, trained, 0))


def test_dependency_order_moves_a_base_just_before_its_first_dependent():
    recipe = testbed.low_resolution_recipe()
    run = lambda name, base=None: sparsity_claims.Run(Path(name), recipe, base and Path(base))
    given = [run("claim_a", "rebase"), run("claim_b", "rebase"), run("dense", "low"),
             run("rebase", "low"), run("sparse")]  # fmt: skip
    ordered = sparsity_claims.in_dependency_order(given)
    assert [str(r.folder) for r in ordered] == ["rebase", "claim_a", "claim_b", "dense", "sparse"]


@pytest.mark.slow
def test_runs_in_one_process_follow_the_runs_they_continue_whatever_the_parts_order(
    tmp_path, tiny_testbed
):
    sparsity_claims.main(["claim2", "base", "--out", str(tmp_path), "--backend", "torch",
                          "--seeds", "0"])  # fmt: skip
    for name in ("low", "dense", "rebase", "sparse"):
        assert sparsity_claims._info(tmp_path / f"base_{name}")
    for trained in sparsity_claims.CLAIM2_TRAIN:
        assert sparsity_claims._info(sparsity_claims.claim2_folder(tmp_path, trained, 0))


@pytest.mark.slow
def test_a_base_stored_in_bf16_is_its_weights_rounded_and_claims_continue_it(
    tmp_path, tiny_testbed
):
    claim1 = ["claim1", "--out", str(tmp_path), "--backend", "torch", "--densities", "0.5"]
    sparsity_claims.main([*claim1, "--seeds", "0"])
    weights = tmp_path / "base_dense" / "toy.safetensors"
    original = load_file(str(weights))
    sparsity_claims.main([*claim1, "--seeds", "0", "--store-bf16", "base_dense"])
    stored = load_file(str(weights))
    assert stored.keys() == original.keys()
    for name, tensor in original.items():
        assert stored[name].dtype == torch.bfloat16
        assert torch.equal(stored[name], tensor.to(torch.bfloat16))
    assert weights.stat().st_size < 0.6 * sum(t.numel() * 4 for t in original.values())
    assert not list(tmp_path.glob("base_dense/*.tmp"))
    sparsity_claims.main([*claim1, "--seeds", "1"])
    validation = _validation(sparsity_claims.claim1_folder(tmp_path, "kv16 top-p", 0.5, 1))
    assert math.isfinite(validation[-1]["vsa2@0.5"])
    with pytest.raises(SystemExit, match=r"--store-bf16: .*base_sparse holds no finished run"):
        sparsity_claims.store_in_bf16(tmp_path / "base_sparse")


@pytest.mark.parametrize(
    ("argument", "value", "message"),
    [
        ("--densities", "1.5", "--densities: each must be between 0 and 1"),
        ("--densities", "0", "--densities: each must be between 0 and 1"),
        ("--steps-scale", "0", "--steps-scale: must be > 0"),
        ("--jobs", "0", "--jobs: must be >= 1"),
        ("--device", "tpu", "--device: 'tpu' is not a device"),
        ("--backend", "fast", "--backend: attention.backend: got 'fast'"),
    ],
)
def test_a_bad_argument_is_refused_by_name_before_anything_is_written(
    tmp_path, capsys, argument, value, message
):
    out = tmp_path / "claims"
    with pytest.raises(SystemExit) as exit_info:
        sparsity_claims.main(["claim1", argument, value, "--out", str(out)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_cuda_without_a_gpu_is_refused_before_anything_is_written(tmp_path, capsys):
    with pytest.raises(SystemExit):
        sparsity_claims.main(["base", "--device", "cuda", "--out", str(tmp_path / "claims")])
    assert "--device: cuda asked for, but no CUDA GPU is visible" in capsys.readouterr().err
    assert not (tmp_path / "claims").exists()


def test_a_run_whose_base_is_missing_is_refused_before_anything_runs(tmp_path):
    claim = sparsity_claims.Run(tmp_path / "claim", testbed.low_resolution_recipe(),
                                tmp_path / "missing_base")  # fmt: skip
    with pytest.raises(SystemExit, match="run the part 'base' first"):
        sparsity_claims.execute([claim], argparse.Namespace(jobs=1, device="cpu"))
    assert not (tmp_path / "claim").exists()


def _start_long_runs(out: Path, jobs: int) -> subprocess.Popen:
    """A process building two tiny runs of a million steps each, ``jobs`` at once."""
    script = out / "long_runs.py"
    script.write_text(f"""
import argparse, sys
sys.path.insert(0, {str(Path(sparsity_claims.__file__).parent)!r})
import sparsity_claims
from vsa2_rl.toy import testbed
testbed.TESTBED_ARCHITECTURE.update(num_attention_heads=2, attention_head_dim=16, ffn_dim=64,
                                    num_layers=2, freq_dim=32)
testbed.FRAMES, testbed.LOW_SIZE, testbed.BATCH, testbed.LOW_STEPS = 4, 16, 2, 10**6
if __name__ == "__main__":
    runs = [sparsity_claims.Run(sparsity_claims.Path({str(out)!r}) / f"run{{i}}",
                                testbed.low_resolution_recipe(seed=i)) for i in range(2)]
    sparsity_claims.execute(runs, argparse.Namespace(jobs={jobs}, device="cpu"))
""")
    return subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_sigterm_stops_the_workers_with_their_state_saved(tmp_path):
    """`timeout` stops a call with SIGTERM: no worker may go on writing into the output, and
    each saves its stage's state for the next call to continue from."""
    parent = _start_long_runs(tmp_path, jobs=2)
    started = [parent.stdout.readline() for _ in range(2)]
    assert all(line.startswith("== ") for line in started)
    children = psutil.Process(parent.pid).children()
    workers = [child for child in children if "spawn_main" in " ".join(child.cmdline())]
    assert len(workers) == 2
    logs = [sparsity_claims.log_file(tmp_path / f"run{i}") for i in range(2)]
    deadline = time.time() + 120
    while not all(log.exists() and " step " in log.read_text() for log in logs):
        assert time.time() < deadline, "the workers did not start training"
        time.sleep(0.5)
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=90) != 0
    _, alive = psutil.wait_procs(workers, timeout=30)
    for orphan in alive:  # left by a failure: not to go on for minutes after the test
        orphan.kill()
    assert not alive
    for index, log in enumerate(logs):
        assert sparsity_claims._info(tmp_path / f"run{index}") is None
        assert "stopped before step" in log.read_text()
        assert (tmp_path / f"run{index}" / PARTIAL_FILE).exists()


@pytest.mark.slow
def test_a_sigterm_stops_a_run_in_this_process_with_its_state_saved(tmp_path):
    parent = _start_long_runs(tmp_path, jobs=1)
    lines = [parent.stdout.readline()]
    while " step " not in lines[-1]:
        assert lines[-1], f"the run ended before training: {lines}"
        lines.append(parent.stdout.readline())
    parent.send_signal(signal.SIGTERM)
    output = parent.communicate(timeout=90)[0]
    assert parent.returncode != 0
    assert "run0 stage 0 stopped before step" in output
    assert (tmp_path / "run0" / PARTIAL_FILE).exists()
    assert not (tmp_path / "run1").exists()


@pytest.fixture
def tiny_rl_recipe(monkeypatch):
    """The RL base's recipe at 16 / 32 px x 4 frames, 2 blocks of width 32, two steps a stage."""
    architecture = {"patch_size": [1, 4, 4], "num_attention_heads": 2, "attention_head_dim": 16,
                    "ffn_dim": 64, "num_layers": 2, "freq_dim": 32}  # fmt: skip
    settings = {"RL_ARCHITECTURE": architecture, "FRAMES": 4, "LOW_SIZE": 16, "HIGH_SIZE": 32,
                "BATCH": 2, "RL_LOW_BATCH": 2, "RL_LOW_STEPS": 2, "RL_REBASE_STEPS": 2,
                "RL_RANGE_STEPS": 2, "REBASE_STEPS": 1, "VAL_EVERY": 2,
                "WARMUP_STEPS": 1}  # fmt: skip
    for name, value in settings.items():
        monkeypatch.setattr(testbed, name, value)


@pytest.mark.slow
def test_a_stopped_testbed_build_resumed_equals_the_uninterrupted_one(
    tmp_path, tiny_rl_recipe, monkeypatch, capsys
):
    from safetensors.torch import load_file

    command = ["--recipe", "rl", "--low-chunks", "1", "--backend", "torch"]
    testbed.main(["--out", str(tmp_path / "whole"), *command])
    build = testbed.build_toy_model
    checks = iter(range(100))

    def stopped_in_the_second_stage(*args, **kwargs):  # as a SIGTERM before its second step
        return build(*args, **{**kwargs, "stop_requested": lambda: next(checks) == 3})

    monkeypatch.setattr(testbed, "build_toy_model", stopped_in_the_second_stage)
    cut = ["--out", str(tmp_path / "cut"), *command]
    with pytest.raises(SystemExit) as stopped:
        testbed.main(cut)
    assert stopped.value.code == 143
    assert "stage 1 stopped before step 1" in capsys.readouterr().err
    monkeypatch.setattr(testbed, "build_toy_model", build)
    with pytest.raises(SystemExit):  # an existing build is not overwritten without --resume
        testbed.main(cut)
    assert "pass --resume to continue it" in capsys.readouterr().err
    testbed.main([*cut, "--resume"])
    whole = load_file(str(tmp_path / "whole" / "toy.safetensors"))
    resumed = load_file(str(tmp_path / "cut" / "toy.safetensors"))
    assert whole.keys() == resumed.keys()
    assert all(torch.equal(whole[name], resumed[name]) for name in whole)
    testbed.main([*cut, "--resume"])  # finished: nothing to do
    assert "holds the finished build" in capsys.readouterr().err
