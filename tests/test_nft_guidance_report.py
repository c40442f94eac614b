"""``benchmarks/nft_guidance.py``'s report on hand-made runs and sweeps: the base's figures by
guidance scale, and per variant the unguided and guided held-out gains of the reward runs, the
controls' changes and each seed's margin, computed here by hand; a packed study's report is
the unpacked one's."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import nft_guidance
import sparse_rollouts


def _write_run(out, variant, kind, seed, motion, fidelity):
    """A finished run folder: its recipe (16 steps), evaluations at steps 0, 8 and 16."""
    run = out / "runs" / f"{variant}_{kind}_seed{seed}"
    run.mkdir(parents=True)
    config = nft_guidance.CONFIGS[kind]
    (run / "config.yaml").write_text(config.read_text())
    prefix = "eval/reward" if kind == "reward" else "eval/guard"
    rows = [{"step": s, "eval/reward": 0.5, f"{prefix}/prompt_motion": m,
             "eval/guard/shape_fidelity": f}
            for s, m, f in zip((0, 8, 16), motion, fidelity, strict=True)]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _write_sweep(out, name, motion, direction=0.5, fidelity=0.9):
    sweep = out / "sweeps" / name
    sweep.mkdir(parents=True)
    row = {
        "run": name,
        "sparsity": 0.0,
        "reward/prompt_motion": motion,
        "reward/guard/prompt_direction": direction,
        "reward/guard/shape_fidelity": fidelity,
    }
    (sweep / "eval.json").write_text(json.dumps([row]))  # fmt: skip


def _table(out):
    return {
        line.split(" | ")[0].strip("| "): [cell.strip(" |") for cell in line.split(" | ")]
        for line in (out / "report.md").read_text().splitlines()
        if line.startswith("| ") and not line.startswith(("| variant", "| guidance"))
    }


def test_the_report_gives_unguided_and_guided_gains_with_each_seeds_margin(tmp_path):
    (tmp_path / "run_info.json").write_text(json.dumps({"device": "cpu", "scale": 3.0}))
    for scale, motion, direction in ((1, 0.40, 0.5), (3, 0.50, 0.625), (10, 0.45, 0.6)):
        _write_sweep(tmp_path, nft_guidance.base_sweep_name(scale), motion, direction)
    # unguided: step 0 -> 16 of the runs' own evaluations; guided: the sweep less the base's 0.50
    _write_run(tmp_path, "none", "reward", 11, (0.40, 0.45, 0.50), (0.90, 0.90, 0.88))
    _write_run(tmp_path, "none", "control", 11, (0.40, 0.40, 0.42), (0.90, 0.90, 0.90))
    _write_run(tmp_path, "none", "reward", 12, (0.40, 0.45, 0.60), (0.90, 0.90, 0.90))
    _write_run(tmp_path, "none", "control", 12, (0.40, 0.40, 0.37), (0.90, 0.90, 0.90))
    for name, motion in (
        ("none_reward_seed11", 0.55),
        ("none_control_seed11", 0.49),
        ("none_reward_seed12", 0.65),
        ("none_control_seed12", 0.50),
    ):
        _write_sweep(tmp_path, name, motion)  # fmt: skip
    _write_run(tmp_path, "anchor", "reward", 11, (0.40, 0.45, 0.45), (0.90, 0.90, 0.90))
    assert nft_guidance.main(["report", "--out", str(tmp_path)]) == 0
    table = _table(tmp_path)
    assert list(table) == ["1", "3", "10", "none", "anchor"]  # base rows by scale, then variants
    assert table["3"][1:] == ["0.500", "0.625", "0.900"]
    none = table["none"]
    assert none[1] == "+0.150 ± 0.071 (11: +0.100, 12: +0.200)"  # reward, unguided
    assert none[2] == "-0.005 ± 0.035 (11: +0.020, 12: -0.030)"  # control, unguided
    # margins: each gain less the controls' mean change, -0.005
    assert none[3] == "+0.155 ± 0.071 (11: +0.105, 12: +0.205)"
    assert none[4] == "+0.100 ± 0.071 (11: +0.050, 12: +0.150)"  # reward, guided
    assert none[5] == "-0.005 ± 0.007 (11: -0.010, 12: +0.000)"  # control, guided
    assert none[6] == "+0.105 ± 0.071 (11: +0.055, 12: +0.155)"  # controls' mean -0.005
    assert none[7] == "-0.010 ± 0.014 (11: -0.020, 12: +0.000)"  # reward run's fidelity
    anchor = table["anchor"]  # no control and no sweep yet: its margins and guided cells wait
    assert anchor[1] == "+0.050 (11: +0.050)" and anchor[2:7] == ["-"] * 5
    assert anchor[7] == "+0.000 (11: +0.000)"


def test_run_refuses_a_missing_base_naming_the_flag(tmp_path):
    with pytest.raises(SystemExit, match=r"^--base: .* is not a folder"):
        nft_guidance.main(["run", "--out", str(tmp_path), "--base", str(tmp_path / "nope")])


def test_a_packed_study_gives_the_unpacked_studys_report_rows(tmp_path):
    tables = {}
    for folder in ("unpacked", "packed"):
        out = tmp_path / folder
        out.mkdir()
        (out / "run_info.json").write_text(json.dumps({"device": "cpu", "scale": 3.0}))
        for scale, motion in ((1, 0.40), (3, 0.50)):
            _write_sweep(out, nft_guidance.base_sweep_name(scale), motion)
        _write_run(out, "none", "reward", 11, (0.40, 0.45, 0.50), (0.90, 0.90, 0.88))
        _write_run(out, "none", "control", 11, (0.40, 0.40, 0.42), (0.90, 0.90, 0.90))
        _write_sweep(out, "none_reward_seed11", 0.55)
        _write_run(out, "anchor", "reward", 11, (0.40, 0.45, 0.45), (0.90, 0.90, 0.90))
        if folder == "packed":
            assert sparse_rollouts.main(["pack", "--out", str(out)]) == 0
            assert not any((out / "runs").iterdir()) and not any((out / "sweeps").iterdir())
        assert nft_guidance.main(["report", "--out", str(out)]) == 0
        tables[folder] = _table(out)
    assert list(tables["packed"]) == ["1", "3", "none", "anchor"]
    assert tables["packed"] == tables["unpacked"]
