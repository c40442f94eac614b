"""Output folders of ``vsa2-rl train | eval | export``: checked before any model loads (one
``error: out_dir: ...`` line, exit status 2), written by one training run at a time, and never
left half-made by a training run whose start failed."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from test_trainer import TINY as TRAINER_TINY

from vsa2_rl.cli import main
from vsa2_rl.config import ConfigError

FLOW_GRPO_TOY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flow_grpo_toy.yaml")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [
    "--config",
    FLOW_GRPO_TOY,
    *TRAINER_TINY,
    "train.num_steps=1",
    "rewards.functions=[{name: 'test_trainer:brightness'}]",
    "eval.guard_rewards=[]",
]


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def _steps(out_dir) -> list[int]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as handle:
        return [json.loads(line)["step"] for line in handle]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    assert main(["train", *TINY, f"out_dir={run_dir}"]) == 0
    return run_dir


# ---- output locations, checked before any work --------------------------------------------


def _unwritable(kind: str, tmp_path) -> str:
    """An out_dir of ``kind`` that no command can write into."""
    (tmp_path / "file").write_text("not a folder")
    if kind == "a file":
        return str(tmp_path / "file")
    if kind == "under a file":
        return str(tmp_path / "file" / "run")
    if kind == "a dangling symlink":
        os.symlink(tmp_path / "missing", tmp_path / "link")
        return str(tmp_path / "link")
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    os.mkdir(tmp_path / "read_only", 0o555)
    return str(tmp_path / "read_only" / "run")


def _no_model(*args, **kwargs):
    raise AssertionError("a model was loaded before the output location was checked")


@pytest.mark.parametrize("command", ["train", "eval", "export"])
@pytest.mark.parametrize(
    "kind", ["a file", "under a file", "a dangling symlink", "in a read-only folder"]
)
def test_an_out_dir_that_cannot_be_written_stops_before_any_model_loads(
    command, kind, tmp_path, trained_run, monkeypatch, capsys
):
    out_dir = _unwritable(kind, tmp_path)
    monkeypatch.setattr("vsa2_rl.runtime.build_bundle", _no_model)
    monkeypatch.setattr("vsa2_rl.rl.setup.build_bundle", _no_model)
    source = [f"run_dir={trained_run}"] if command == "export" else []
    assert main([command, *TINY, *source, f"out_dir={out_dir}"]) == 2
    line = _error_line(capsys)
    assert line.startswith("error: out_dir: ")
    assert out_dir in line or os.path.dirname(out_dir) in line
    assert sorted(os.listdir(tmp_path)) == sorted(
        name for name in ("file", "link", "read_only") if os.path.lexists(tmp_path / name)
    )


# ---- one training run per folder ----------------------------------------------------------


def _start_a_long_run(out_dir) -> subprocess.Popen:
    """A ``vsa2-rl train`` that goes on until it is killed; returns once its folder holds its
    config.yaml (the run has started)."""
    run = subprocess.Popen(
        [sys.executable, "train_rl.py", *TINY, "train.num_steps=100000",
         "train.checkpoint_every=0", f"out_dir={out_dir}"],
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}/tests"},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(out_dir, "config.yaml")):
        assert run.poll() is None, run.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "the first run did not start within 120 s"
        time.sleep(0.2)
    return run


@pytest.mark.slow
def test_a_second_run_in_a_folder_in_use_stops_and_a_killed_run_frees_it(tmp_path, capsys):
    out_dir = tmp_path / "run"
    first = _start_a_long_run(out_dir)
    try:
        assert main(["train", *TINY, f"out_dir={out_dir}"]) == 2
        line = _error_line(capsys)
        assert line.startswith(f"error: out_dir: {out_dir} is in use by another training run")
        assert first.poll() is None  # the first run goes on
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    # a killed run leaves no lock behind: the folder's run continues (no checkpoint yet, so
    # from the start), and every step is logged once
    assert main(["train", *TINY, f"out_dir={out_dir}", "train.resume=auto"]) == 0
    assert _steps(out_dir) == [1]


# ---- a failed start leaves no half-made run folder ----------------------------------------


def _tracker_that_cannot_start(*args, **kwargs):
    """Stands for a failure after the run folder is made (a tracker that cannot start)."""
    raise ConfigError("logging.report_to: the tracker cannot start")


@pytest.mark.parametrize(
    ("failure", "expected"),
    [
        (["rl.prompts_per_step=1000"], "error: rl.prompts_per_step: 1000 exceeds"),
        ([], "error: logging.report_to: the tracker cannot start"),
    ],
)
@pytest.mark.parametrize("where", ["run", "new/parents/run"])
def test_a_failed_start_removes_the_folders_it_made(
    failure, expected, where, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr("vsa2_rl.rl.trainer.MetricsLogger", _tracker_that_cannot_start)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    assert main(["train", *TINY, *failure, f"out_dir={out_dir / where}"]) == 2
    assert _error_line(capsys).startswith(expected)
    assert os.listdir(out_dir) == []


def test_a_failed_start_leaves_a_folder_that_was_there_before(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("vsa2_rl.rl.trainer.MetricsLogger", _tracker_that_cannot_start)
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    (out_dir / "notes.txt").write_text("mine")
    assert main(["train", *TINY, f"out_dir={out_dir}"]) == 2
    _error_line(capsys)
    assert (out_dir / "notes.txt").read_text() == "mine"
