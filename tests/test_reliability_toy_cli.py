"""The toy testbed, gate and build command lines: every bad argument is one usage error before
any work, and a stop request interrupts a stage's sample measurements."""

from __future__ import annotations

import types

import pytest
import torch

from vsa2_rl.attention import SparsityState
from vsa2_rl.toy import build as build_module
from vsa2_rl.toy import gate, testbed
from vsa2_rl.toy.build import PARTIAL_FILE, BuildStopped, ToyBuildConfig, ToyStage


@pytest.fixture
def no_work(monkeypatch):
    """Loading a model or building fails the test: validation must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr("vsa2_rl.toy.model.load_toy_bundle", refuse)
    monkeypatch.setattr(testbed, "build_toy_model", refuse)
    monkeypatch.setattr(build_module, "build_toy_model", refuse)


def _usage_error(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--device", "gpu"], "--device: 'gpu' is not a device"),
        (["--device", "cuda:9"], "--device: 'cuda:9': this machine has"),
        (["--threads", "0"], "--threads: must be >= 1, got 0"),
        (["--eval-sparsity", "1.5"], "--eval-sparsity: must be in [0, 1), got 1.5"),
        (["--eval-sparsity", "nan"], "--eval-sparsity: must be in [0, 1)"),
        (["--micro-batch", "0"], "--micro-batch: must be >= 1, got 0"),
        (["--steps", "-1"], "--steps: must be >= 0"),
        (["--lr", "inf"], "--lr: must be in"),
        (["--backend", "cuda"], "--backend: invalid choice"),
        (["--model", "/nonexistent/toy"], "--model /nonexistent/toy: not a readable toy"),
    ],
)
def test_the_gate_refuses_a_bad_argument_before_loading(argv, expected, capsys, no_work):
    assert expected in _usage_error(gate.main, argv, capsys)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--sparsity", "1.0"], "--sparsity: must be in [0, 1), got 1.0"),
        (["--sparsity", "-0.1"], "--sparsity: must be in [0, 1)"),
        (["--mirrored-captions", "2"], "--mirrored-captions: must be in [0, 1], got 2"),
        (["--steps-scale", "0"], "--steps-scale: must be > 0"),
        (["--steps-scale", "inf"], "--steps-scale: must be in"),
        (["--device", "tpu"], "--device: 'tpu'"),
        (["--seed", "-3"], "--seed: must be >= 0"),
        (["--backend", "x"], "--backend: invalid choice"),
    ],
)
def test_the_testbed_refuses_a_bad_argument_before_building(argv, expected, tmp_path, capsys,
                                                            no_work):  # fmt: skip
    assert expected in _usage_error(testbed.main, ["--out", str(tmp_path / "o"), *argv], capsys)
    assert not (tmp_path / "o").exists()


def test_an_out_under_a_file_is_refused_at_once(tmp_path, capsys, no_work):
    (tmp_path / "file").write_text("x")
    line = _usage_error(testbed.main, ["--out", str(tmp_path / "file" / "base")], capsys)
    assert "--out" in line and "lies under the file" in line
    line = _usage_error(build_module.main, ["--out", str(tmp_path / "file")], capsys)
    assert "--out" in line and "is a file" in line


def _partial(out, payload) -> None:
    out.mkdir()
    if isinstance(payload, bytes):
        (out / PARTIAL_FILE).write_bytes(payload)
    else:
        torch.save(payload, out / PARTIAL_FILE)


def test_a_garbled_partial_stage_is_one_line_before_any_work(tmp_path, capsys, no_work):
    _partial(tmp_path / "o", b"not a torch file")
    line = _usage_error(testbed.main, ["--out", str(tmp_path / "o"), "--resume"], capsys)
    assert "--resume" in line and PARTIAL_FILE in line and "not a readable partial stage" in line


def test_resuming_with_a_changed_recipe_is_refused_before_any_work(tmp_path, capsys, no_work):
    recipe = testbed.testbed_recipe("rebase", sparsity=0.9)
    identity = build_module._stage_identity(0, recipe.stages[0], recipe)
    _partial(tmp_path / "o", {"identity": identity, "step": 3})
    argv = ["--out", str(tmp_path / "o"), "--resume", "--sparsity", "0.8"]
    line = _usage_error(testbed.main, argv, capsys)
    assert "holds stage 0 of another recipe" in line


def test_the_build_cli_refuses_bad_threads_and_mirrored_captions(tmp_path, capsys, no_work):
    out = ["--out", str(tmp_path / "o")]
    assert "--threads: must be >= 1" in _usage_error(build_module.main, [*out, "--threads", "0"],
                                                     capsys)  # fmt: skip
    line = _usage_error(build_module.main, [*out, "--mirrored-captions", "-1"], capsys)
    assert "--mirrored-captions: must be in [0, 1]" in line
    line = _usage_error(build_module.main, [*out, "--resume-from", str(tmp_path)], capsys)
    assert "--resume-from/--out" in line and "config.json" in line


def test_a_stop_request_interrupts_a_stages_sample_measurements(monkeypatch):
    measured = []
    monkeypatch.setattr(build_module, "ToyBundle", lambda *a, **k: types.SimpleNamespace(
        device=torch.device("cpu")))  # fmt: skip
    monkeypatch.setattr(build_module, "draw_samples", lambda *a, **k: measured.append(1))
    monkeypatch.setattr(build_module, "score_samples", lambda *a, **k: {})
    config = ToyBuildConfig(eval_sparsities=(0.0, 0.5, 0.9), report_seeds=1)
    stage = ToyStage(16, 8, 1, 1, vsa2=True)
    monkeypatch.setattr(build_module, "_STOP", [lambda: len(measured) >= 1])
    with pytest.raises(BuildStopped, match="samples were measured"):
        build_module._stage_report((None, None, None), SparsityState(), config, stage)
    assert len(measured) == 1


def test_a_finished_build_leaves_no_stop_request_behind(monkeypatch):
    monkeypatch.setattr(build_module, "_run_build", lambda *args: {})
    build_module.build_toy_model("unused", stop_requested=lambda: True)
    assert build_module._STOP[0]() is False


def test_a_garbled_build_record_in_out_is_one_line(tmp_path, capsys, no_work):
    out = tmp_path / "o"
    out.mkdir()
    (out / "config.json").write_text("{not json")
    (out / "toy.safetensors").write_bytes(b"")
    line = _usage_error(testbed.main, ["--out", str(out), "--resume"], capsys)
    assert "--out" in line and "not a toy build's record" in line


def test_the_gate_refuses_a_folder_with_a_garbled_record(tmp_path, capsys, no_work):
    (tmp_path / "config.json").write_text("[]")
    (tmp_path / "toy.safetensors").write_bytes(b"")
    line = _usage_error(gate.main, ["--model", str(tmp_path)], capsys)
    assert f"--model {tmp_path}: not a readable toy checkpoint" in line
