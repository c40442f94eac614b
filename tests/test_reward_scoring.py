"""Where and when the trainer scores its rollouts: ``rewards.async_scoring`` scores each chunk in
the background while the next ones are sampled and trains exactly as synchronous scoring does;
``rewards.device`` is where the rewards get the videos; a reward server killed in the middle of
a run is a reward failure that ``rewards.on_error`` handles, with nothing lost."""

import os
import socket
import subprocess
import sys
import threading

import pytest
import torch
from test_trainer import TINY, _rows, brightness

from vsa2_rl.config import ConfigError, load_config
from vsa2_rl.rewards import RewardError
from vsa2_rl.rl import rollout as rollout_module
from vsa2_rl.rl.checkpoint import find_latest, load_checkpoint
from vsa2_rl.rl.trainer import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CALLS: list[dict] = []  # what the recording reward saw, call by call


def recording_brightness(videos, prompts, metadata):
    """Brightness plus a metadata-dependent term (chunked scoring must hand each video its own
    metadata), recording the thread and device of each call."""
    CALLS.append({"thread": threading.current_thread().name, "device": videos.device.type})
    seeds = torch.tensor([m["sample_seed"] % 97 for m in metadata], dtype=torch.float32)
    return brightness(videos, prompts, metadata) + 1e-3 * seeds


def _config(tmp_path, name, *extra):
    return load_config(
        None,
        [
            *TINY,
            f"out_dir={tmp_path / name}",
            "rl.train_batch_size=1",  # 4 chunks a step
            "rewards.functions=[{name: 'test_reward_scoring:recording_brightness'}]",
            *extra,
        ],
    )


@pytest.mark.slow
def test_async_scoring_overlaps_the_rollout_and_trains_as_synchronous_scoring(
    tmp_path, monkeypatch
):
    sync = train(_config(tmp_path, "sync", "train.num_steps=2"))
    assert {call["thread"] for call in CALLS} == {threading.current_thread().name}
    CALLS.clear()
    # the last chunk of a step is only sampled once the first chunk's reward has started: that
    # can happen only if scoring runs beside the rollout (the wait would time out otherwise)
    first_scored, samples, waits = threading.Event(), [0], []
    original_sample = rollout_module.sample

    def sample_after_first_score(*args, **kwargs):
        samples[0] += 1
        if samples[0] % 4 == 0:  # the step's last chunk
            waits.append(first_scored.wait(timeout=30))
            first_scored.clear()
        return original_sample(*args, **kwargs)

    record = recording_brightness

    def scored_first(*args):
        first_scored.set()
        return record(*args)

    monkeypatch.setattr(rollout_module, "sample", sample_after_first_score)
    monkeypatch.setattr(sys.modules[__name__], "recording_brightness", scored_first)
    asynchronous = train(
        _config(tmp_path, "async", "train.num_steps=2", "rewards.async_scoring=true")
    )
    assert waits == [True, True]
    assert {call["thread"] for call in CALLS} == {"rewards_0"}
    assert len(CALLS) == 8  # one call per chunk
    for a, b in zip(_rows(sync["out_dir"]), _rows(asynchronous["out_dir"]), strict=True):
        for key in ("reward/mean", "reward/std", "loss/policy", "train/advantage_abs_mean"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), key
    for name, value in _final_weights(sync["out_dir"]).items():
        torch.testing.assert_close(_final_weights(asynchronous["out_dir"])[name], value)


def _final_weights(out_dir):
    return load_checkpoint(find_latest(os.path.join(out_dir, "checkpoints")))["model"]


def test_rewards_score_on_rewards_device(tmp_path):
    CALLS.clear()
    train(_config(tmp_path, "cpu", "train.num_steps=1", "rewards.device=cpu"))
    assert {call["device"] for call in CALLS} == {"cpu"}


def test_a_bad_rewards_device_is_one_error_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"rewards.device: 'gpu' is not a device"):
        _config(tmp_path, "bad", "rewards.device=gpu")
    if torch.cuda.device_count() < 8:
        with pytest.raises(ConfigError, match=r"rewards.device: 'cuda:7' requested"):
            train(_config(tmp_path, "absent", "rewards.device=cuda:7"))
        assert not os.path.exists(tmp_path / "absent")


# ---- a reward server killed mid-run ------------------------------------------------------------

SERVED = {"requests": 0}


def dies_at_the_second_request(videos, prompts, metadata):
    """Served reward: brightness for the first request, then the server process dies."""
    SERVED["requests"] += 1
    if SERVED["requests"] == 2:
        os._exit(1)
    return brightness(videos, prompts, metadata)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _serve(reward: str, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "vsa2_rl.cli", "serve-reward", "--port", str(port),
               "--reward", reward]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "tests")}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    assert f"on http://127.0.0.1:{port}" in process.stdout.readline()
    return process


@pytest.fixture
def dying_server():
    port = _free_port()
    process = _serve("test_reward_scoring:dies_at_the_second_request", port)
    yield process, port
    process.kill()
    process.wait()


def _remote_config(tmp_path, port, *extra):
    return load_config(
        None,
        [
            *TINY,
            f"out_dir={tmp_path / 'run'}",
            "train.num_steps=3",
            "train.checkpoint_every=1",
            "train.keep_last=3",
            f"rewards.functions=[{{name: 'remote:http://127.0.0.1:{port}', "
            "kwargs: {timeout: 5, retries: 1}}]",
            *extra,
        ],
    )


@pytest.mark.slow
def test_a_server_killed_mid_run_skips_the_steps_it_cannot_score(tmp_path, dying_server):
    process, port = dying_server
    summary = train(_remote_config(tmp_path, port, "rewards.on_error=skip"))
    assert process.wait(timeout=30) == 1  # it died at step 2's request
    rows = {row["step"]: row for row in _rows(summary["out_dir"])}
    assert "train/skipped_reward" not in rows[1] and "loss/policy" in rows[1]
    assert rows[2]["train/skipped_reward"] == 1 and rows[3]["train/skipped_reward"] == 1
    # nothing lost: every step's checkpoint is whole, the weights those of step 1
    checkpoints = os.path.join(summary["out_dir"], "checkpoints")
    step_1 = load_checkpoint(os.path.join(checkpoints, "step_1"))["model"]
    assert find_latest(checkpoints).name == "step_3"
    for name, value in load_checkpoint(find_latest(checkpoints))["model"].items():
        assert torch.equal(value, step_1[name]), name


@pytest.mark.slow
def test_a_server_killed_under_on_error_stop_stops_the_run_resumably(tmp_path, dying_server):
    process, port = dying_server
    with pytest.raises(RewardError, match=rf"remote_dies_at_the_second_request.*127.0.0.1:{port}"):
        train(_remote_config(tmp_path, port, "rewards.on_error=stop"))
    checkpoints = tmp_path / "run" / "checkpoints"
    assert find_latest(checkpoints).name == "step_1"  # step 1's checkpoint, whole
    # a server back on the same address: the run resumes from step 1 and finishes
    process.wait(timeout=30)
    healthy = _serve("test_trainer:brightness", port)
    try:
        train(_remote_config(tmp_path, port, "rewards.on_error=stop"))
    finally:
        healthy.kill()
        healthy.wait()
    assert [row["step"] for row in _rows(tmp_path / "run")] == [1, 2, 3]
    assert find_latest(checkpoints).name == "step_3"
