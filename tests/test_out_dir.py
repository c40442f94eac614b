"""Output folders of ``vsa2-rl train | eval | export``: checked before any model loads (one
``error: out_dir: ...`` line, exit status 2)."""

import os

import pytest
from test_trainer import TINY as TRAINER_TINY

from vsa2_rl.cli import main

TINY = [
    *TRAINER_TINY,
    "train.num_steps=1",
    "rewards.functions=[{name: 'test_trainer:brightness'}]",
    "eval.guard_rewards=[]",
]


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


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
    monkeypatch.setattr("vsa2_rl.rl.trainer.build_bundle", _no_model)
    source = [f"run_dir={trained_run}"] if command == "export" else []
    assert main([command, *TINY, *source, f"out_dir={out_dir}"]) == 2
    line = _error_line(capsys)
    assert line.startswith("error: out_dir: ")
    assert out_dir in line or os.path.dirname(out_dir) in line
    assert sorted(os.listdir(tmp_path)) == sorted(
        name for name in ("file", "link", "read_only") if os.path.lexists(tmp_path / name)
    )
