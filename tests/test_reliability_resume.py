"""Resume, eval/export targets and export staging under hostile but realistic use: an older
checkpoint resumed (the later branch set aside, never mixed), a run killed before its first
checkpoint, a resume that lowers the learning rate after a divergence, an edited config.yaml,
an export stopped by SIGTERM or killed outright."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
import yaml
from test_trainer import FLOW_GRPO_TOY, _config, _rows

from vsa2_rl.cli import main
from vsa2_rl.config import ConfigError, load_config, load_eval_config
from vsa2_rl.eval.sweep import resolve_targets
from vsa2_rl.export import export
from vsa2_rl.rl.checkpoint import (
    UnusableCheckpoint,
    find_latest,
    list_checkpoints,
    recorded_config,
    save_checkpoint,
    set_aside_branch,
)
from vsa2_rl.rl.trainer import RLTrainer, train

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


def test_resuming_an_older_checkpoint_sets_the_later_branch_aside(tmp_path, capsys):
    run = tmp_path / "run"
    train(_config(tmp_path, "train.num_steps=4", "train.checkpoint_every=2"))
    old_rows = _rows(run)
    older = run / "checkpoints" / "step_2"
    train(_config(tmp_path, f"train.resume={older}", "train.num_steps=3"))
    (aside,) = (run / "abandoned").iterdir()
    assert "checkpoints after step 2 and their metrics moved to" in capsys.readouterr().out
    assert [step for step, _ in list_checkpoints(aside / "checkpoints")] == [4]
    assert _rows(aside) == old_rows[2:]  # the abandoned branch's rows 3 and 4, kept whole
    train(_config(tmp_path, "train.num_steps=5"))
    assert f"resumed from {run / 'checkpoints' / 'step_3'} at step 3" in capsys.readouterr().out
    assert [row["step"] for row in _rows(run)] == [1, 2, 3, 4, 5]


def test_a_run_killed_before_its_first_checkpoint_logs_each_step_once(tmp_path, monkeypatch):
    extra = ["train.num_steps=2", "eval.every=2", "eval.num_prompts=2"]

    def killed(self, step, bar):
        raise KeyboardInterrupt  # after step 0's evaluation row, before any checkpoint

    with monkeypatch.context() as patch:
        patch.setattr(RLTrainer, "train_step", killed)
        with pytest.raises(KeyboardInterrupt):
            train(_config(tmp_path, *extra))
    assert [row["step"] for row in _rows(tmp_path / "run")] == [0]
    train(_config(tmp_path, *extra, "train.resume=auto"))
    assert [row["step"] for row in _rows(tmp_path / "run")] == [0, 1, 2]


def test_a_resume_may_lower_the_learning_rate_and_noise_level_as_the_divergence_advice_says(
    tmp_path, capsys
):
    warm = ["train.warmup_steps=4", "train.learning_rate=1e-3"]
    train(_config(tmp_path, "train.num_steps=1", *warm))
    lowered = ["train.learning_rate=4e-4", "sampler.noise_level=0.5"]
    train(_config(tmp_path, "train.num_steps=2", *warm[:1], *lowered))
    out = capsys.readouterr().out
    assert "train.learning_rate: lowered from 0.001 to 0.0004 from step 2 on" in out
    assert "sampler.noise_level: lowered from 0.7 to 0.5" in out
    first, second = _rows(tmp_path / "run")
    # warm-up factor min(1, (s + 1) / 4) after s scheduler steps, at the base rate of the step
    assert first["train/lr"] == pytest.approx(1e-3 * 2 / 4)
    assert second["train/lr"] == pytest.approx(4e-4 * 3 / 4)


def _edit_config_yaml(run, **sections):
    path = run / "config.yaml"
    tree = yaml.safe_load(path.read_text())
    for section, values in sections.items():
        tree[section].update(values)
    path.write_text(yaml.safe_dump(tree))


def test_run_dir_takes_the_checkpoints_settings_like_checkpoint_does(tmp_path, capsys):
    sparse = ["attention.kv_block=64", "attention.mode=topk", "sparsity.train=0.5"]
    train(_config(tmp_path, "train.num_steps=1", *sparse, "sparsity.eval=0.5"))
    run = tmp_path / "run"
    _edit_config_yaml(run, attention={"mode": "topp"}, sparsity={"eval": 0.25})
    capsys.readouterr()
    (by_run,) = resolve_targets(*load_eval_config(None, [f"run_dir={run}"]))
    err = capsys.readouterr().err
    assert "attention.mode, sparsity.eval: using the checkpoint's settings" in err
    checkpoint = find_latest(run / "checkpoints")
    (by_checkpoint,) = resolve_targets(*load_eval_config(None, [f"checkpoint={checkpoint}"]))
    for config in (by_run.config, by_checkpoint.config):
        assert (config.attention.mode, config.attention.kv_block) == ("topk", 64)
        assert (config.sparsity.train, config.sparsity.eval) == (0.5, 0.5)
    folder = export(*load_eval_config(None, [f"run_dir={run}", f"out_dir={tmp_path / 'x'}"]))
    with open(os.path.join(folder, "vsa2_attention.json"), encoding="utf-8") as handle:
        settings = json.load(handle)
    assert settings["attention"]["mode"] == "topk" and settings["sparsity"]["eval"] == 0.5


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    from test_export import TINY

    run_dir = tmp_path_factory.mktemp("run") / "run"
    train(load_config(FLOW_GRPO_TOY, [*TINY, f"out_dir={run_dir}"]))
    return run_dir


_EXPORT_STOPPED = """
import os, signal, sys, time
import vsa2_rl.export as exporting
from vsa2_rl.config import load_eval_config

def write_then_stop(transformer, folder, lora):
    open(os.path.join(folder, "half_written"), "w").close()
    os.kill(os.getpid(), getattr(signal, sys.argv[3]))
    time.sleep(30)

exporting._write_model = write_then_stop
exporting.export(*load_eval_config(None, [f"run_dir={sys.argv[1]}", f"out_dir={sys.argv[2]}"]))
"""


def _export_stopped_by(signal_name, run_dir, out_dir):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, TESTS])}
    args = [sys.executable, "-c", _EXPORT_STOPPED, str(run_dir), str(out_dir), signal_name]
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _staging(parent):
    return [name for name in os.listdir(parent) if name.startswith(".export-")]


def test_an_export_stopped_by_sigterm_leaves_no_staging_folder(trained_run, tmp_path):
    stopped = _export_stopped_by("SIGTERM", trained_run, tmp_path / "x")
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-2000:]
    assert "stopped (SIGTERM); nothing was written to out_dir" in stopped.stderr
    assert _staging(tmp_path) == [] and not (tmp_path / "x").exists()


def test_the_next_export_removes_the_staging_folder_of_a_killed_one(trained_run, tmp_path, capsys):
    killed = _export_stopped_by("SIGKILL", trained_run, tmp_path / "x")
    assert killed.returncode == -signal.SIGKILL
    (left,) = _staging(tmp_path)  # what a kill -9 or a power loss leaves
    export(*load_eval_config(None, [f"run_dir={trained_run}", f"out_dir={tmp_path / 'x'}"]))
    assert _staging(tmp_path) == []
    out = capsys.readouterr().out
    assert f"removed {tmp_path / left}, left by an export that was killed" in out
    assert "vsa2_attention.json" in os.listdir(tmp_path / "x")


def test_train_help_names_both_algorithms(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["train", "--help"])
    assert stopped.value.code == 0
    # the command's description, above the arguments and the keys' own documentation
    description = capsys.readouterr().out.split("positional arguments")[0]
    assert "Flow-GRPO" in description and "DiffusionNFT" in description


def _fake_run(run, steps):
    """A run folder with a tiny checkpoint and a metrics row per step, and one torn line."""
    for step in steps:
        save_checkpoint(run / "checkpoints", step, {"model": {"w": torch.full((2,), step)}})
    rows = [json.dumps({"step": step, "reward/mean": step / 10}) + "\n" for step in steps]
    (run / "metrics.jsonl").write_text("".join(rows[:1]) + '{"step": 1, "rew\n' + "".join(rows[1:]))
    return rows


def test_setting_a_branch_aside_keeps_every_checkpoint_and_row(tmp_path):
    run = tmp_path / "run"
    rows = _fake_run(run, [1, 2, 3])
    aside = set_aside_branch(run, 1)
    assert [step for step, _ in list_checkpoints(run / "checkpoints")] == [1]
    assert [step for step, _ in list_checkpoints(aside / "checkpoints")] == [2, 3]
    assert (aside / "metrics.jsonl").read_text() == "".join(rows[1:])
    # the torn line stays for the logger, which moves it to metrics.jsonl.unreadable
    assert (run / "metrics.jsonl").read_text() == rows[0] + '{"step": 1, "rew\n'
    assert set_aside_branch(run, 1) is None  # nothing later left: nothing moves


def test_a_file_named_abandoned_stops_the_set_aside_before_anything_moves(tmp_path):
    run = tmp_path / "run"
    _fake_run(run, [1, 2])
    (run / "abandoned").write_text("my notes")
    before = (run / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match=r"^out_dir: .*/abandoned is not a folder, .* move it"):
        set_aside_branch(run, 1)
    assert [step for step, _ in list_checkpoints(run / "checkpoints")] == [1, 2]
    assert (run / "metrics.jsonl").read_text() == before


def test_the_recorded_config_is_read_only_from_a_checkpoint_that_verifies(tmp_path):
    tree = {"train": {"learning_rate": 0.001}}
    path = save_checkpoint(tmp_path, 1, {"model": {"w": torch.ones(2)}, "config": tree})
    assert recorded_config(path) == {"config": tree}
    assert recorded_config(save_checkpoint(tmp_path, 2, {"model": {"w": torch.ones(2)}})) == {}
    (path / "meta.json").write_text("{garbled")
    with pytest.raises(UnusableCheckpoint, match=r"step_1 is not a usable .*: meta\.json is"):
        recorded_config(path)
    with pytest.raises(UnusableCheckpoint, match=r"no COMPLETE marker"):
        recorded_config(tmp_path)  # the checkpoints folder, not a checkpoint in it
