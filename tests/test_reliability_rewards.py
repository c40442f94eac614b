"""Reward failures named and handled: factories that raise, scores on the wrong device,
non-finite evaluation values under ``rewards.on_error``, and server/client timeouts."""

from __future__ import annotations

import math

import pytest
import torch

from vsa2_rl.config import ConfigError
from vsa2_rl.rewards import (
    RewardError,
    RewardMixer,
    evaluation_scores,
    finite_mean_std,
    get_reward,
    register_reward,
)
from vsa2_rl.rewards.remote import RemoteReward, RewardServer

VIDEOS = torch.rand(3, 2, 3, 8, 8)
PROMPTS = ["a", "b", "c"]


def _raising(error: BaseException):
    def factory(**kwargs):
        raise error

    return factory


@pytest.mark.parametrize(
    "error", [KeyError("weights"), RuntimeError("CUDA is broken"), ImportError("no open_clip")]
)
def test_a_factory_failure_is_one_value_error_naming_the_reward(error):
    name = f"broken_{type(error).__name__}"
    register_reward(name, overwrite=True)(_raising(error))
    with pytest.raises(ValueError) as caught:
        get_reward(name)
    text = str(caught.value)
    assert name in text and type(error).__name__ in text and str(error.args[0]) in text
    assert "\n" not in text


def test_the_mixer_names_the_config_key_of_a_factory_failure():
    register_reward("broken_keyerror_mix", overwrite=True)(_raising(KeyError("weights")))
    with pytest.raises(ValueError, match=r"rewards\.functions\[0\].*broken_keyerror_mix.*KeyError"):
        RewardMixer([("broken_keyerror_mix", 1.0)])


def test_a_module_that_fails_on_import_is_named(tmp_path, monkeypatch):
    (tmp_path / "bad_reward_mod.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"bad_reward_mod.*RuntimeError: no GPU here"):
        get_reward("bad_reward_mod:score")


def _constant(device: str, shape=(3,)):
    def fn(videos, prompts, metadata):
        return torch.zeros(shape, device=device)

    return fn


def test_scores_on_the_meta_device_are_the_rewards_error():
    reward = get_reward(_constant("meta"))
    with pytest.raises(RewardError, match=r"reward 'fn'.*meta"):
        reward(VIDEOS, PROMPTS)


@pytest.mark.parametrize(("on_error", "expected"), [("skip", "step skipped"), ("stop", "meta")])
def test_the_mixer_applies_on_error_to_scores_on_the_meta_device(on_error, expected):
    register_reward("on_meta", overwrite=True)(lambda: _constant("meta"))
    mixer = RewardMixer([("on_meta", 1.0)], on_error=on_error)
    with pytest.raises(RewardError, match=rf"'on_meta'.*{expected}"):
        mixer(VIDEOS, PROMPTS)


def test_scores_of_the_wrong_shape_on_the_meta_device_are_an_error():
    with pytest.raises(RewardError, match="meta"):
        get_reward(_constant("meta", (2, 2)))(VIDEOS, PROMPTS)


def test_scores_on_another_real_device_move_to_the_videos_device():
    moved = []

    class Elsewhere(torch.Tensor):
        """Scores reporting another device; moving them records the target."""

    def fn(videos, prompts, metadata):
        out = torch.zeros(3).as_subclass(Elsewhere)
        out.__class__.device = property(lambda self: torch.device("cuda", 7))
        out.__class__.to = lambda self, device: moved.append(device) or torch.zeros(3)
        return out

    scores = get_reward(fn)(VIDEOS, PROMPTS)
    assert moved == [VIDEOS.device] and scores.device == VIDEOS.device


def _one_nan(videos, prompts, metadata):
    return torch.tensor([1.0, math.nan, 3.0])


@pytest.mark.parametrize("on_error", ["skip", "drop_sample"])
def test_a_nan_guard_value_is_left_out_of_its_mean_unless_on_error_is_stop(on_error, caplog):
    guard = get_reward(_one_nan)
    values = evaluation_scores(guard, VIDEOS, PROMPTS, None, on_error)
    assert values.shape == (3,)
    assert finite_mean_std(values) == pytest.approx((2.0, 1.0))
    assert "_one_nan" in caplog.text and "[1]" in caplog.text


def test_a_nan_guard_value_stops_the_evaluation_under_stop():
    with pytest.raises(RewardError, match=r"'_one_nan'.*non-finite"):
        evaluation_scores(get_reward(_one_nan), VIDEOS, PROMPTS, None, "stop")


def test_finite_mean_std_of_no_finite_value_is_nan():
    mean, std = finite_mean_std(torch.tensor([math.nan, math.inf]))
    assert math.isnan(mean) and math.isnan(std)


@pytest.mark.parametrize("timeout", [math.inf, math.nan, 0.0, -1.0])
def test_the_server_refuses_a_client_timeout_that_is_not_finite_and_positive(timeout):
    with pytest.raises(ConfigError, match="--client-timeout-s"):
        RewardServer("127.0.0.1", 0, client_timeout_s=timeout)


@pytest.mark.parametrize("timeout", [math.inf, math.nan, "60"])
def test_the_client_refuses_a_timeout_that_is_not_finite_and_positive(timeout):
    with pytest.raises(ValueError, match="timeout"):
        RemoteReward("http://127.0.0.1:1", timeout=timeout)


@pytest.mark.parametrize("retries", [-1, "2", True, 1.5])
def test_the_client_refuses_retries_that_are_not_a_whole_number(retries):
    with pytest.raises(ValueError, match="retries"):
        RemoteReward("http://127.0.0.1:1", retries=retries)


def test_a_plugin_that_fails_to_load_is_named(monkeypatch):
    from vsa2_rl.rewards import registry

    class Broken:
        name = "broken_plugin"

        def load(self):
            raise ImportError("needs open_clip")

    monkeypatch.setattr(registry, "entry_points", lambda group: [Broken()])
    with pytest.raises(ValueError, match=r"'broken_plugin'.*plug-in.*ImportError: needs open_clip"):
        get_reward("broken_plugin")
