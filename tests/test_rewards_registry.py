"""Reward registry, input/output checks and the reward mixer (vsa2_rl.rewards)."""

import importlib.metadata
import math
import sys
import textwrap

import pytest
import torch

from vsa2_rl.rewards import (
    RewardError,
    RewardMixer,
    RewardSkip,
    combine_advantages,
    get_reward,
    list_rewards,
    register_reward,
)
from vsa2_rl.rewards import registry as registry_module

PLUGIN_SOURCE = """
import torch


def brightness(videos, prompts, metadata):
    return videos.mean(dim=(1, 2, 3, 4))


def make_scaled(scale=1.0):
    def reward(videos, prompts, metadata):
        return scale * videos.mean(dim=(1, 2, 3, 4))
    return reward


def make_default():
    return brightness


class Offset:
    def __init__(self, offset=0.0):
        self.offset = offset

    def __call__(self, videos, prompts, metadata):
        return videos.mean(dim=(1, 2, 3, 4)) + self.offset


def from_metadata(videos, prompts, metadata):
    return torch.tensor([float(m["score"]) for m in metadata])


def nan_reward(videos, prompts, metadata):
    out = videos.mean(dim=(1, 2, 3, 4))
    out[0] = float("nan")
    return out
"""


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """A throwaway module `rewards_plugin_tmp` on sys.path holding custom rewards."""
    (tmp_path / "rewards_plugin_tmp.py").write_text(textwrap.dedent(PLUGIN_SOURCE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "rewards_plugin_tmp"
    sys.modules.pop("rewards_plugin_tmp", None)


def _videos(batch=3, frames=2, size=8):
    return torch.rand(batch, frames, 3, size, size)


def _means(videos):
    return videos.double().mean(dim=(1, 2, 3, 4))


def test_builtins_registered():
    for name in (
        "dynamic_degree",
        "motion_smoothness",
        "temporal_flicker",
        "motion_quality",
        "aesthetic",
        "image_quality",
    ):
        assert name in list_rewards()


def test_module_callable_plain_function_factory_and_class(plugin):
    videos = _videos()
    expected = _means(videos)
    plain = get_reward(f"{plugin}:brightness")
    assert plain.name == "brightness"
    torch.testing.assert_close(plain(videos, ["p"] * 3).double(), expected)
    # kwargs given -> the target is a factory
    scaled = get_reward(f"{plugin}:make_scaled", scale=2.0)
    torch.testing.assert_close(scaled(videos, ["p"] * 3).double(), 2.0 * expected)
    # a zero-argument callable cannot take (videos, prompts, metadata) -> a factory
    default = get_reward(f"{plugin}:make_default")
    torch.testing.assert_close(default(videos, ["p"] * 3).double(), expected)
    # a class is a factory; its instances are the rewards
    offset = get_reward(f"{plugin}:Offset", offset=0.5)
    torch.testing.assert_close(offset(videos, ["p"] * 3).double(), expected + 0.5)
    offset_default = get_reward(f"{plugin}:Offset")
    torch.testing.assert_close(offset_default(videos, ["p"] * 3).double(), expected)


def test_bad_module_specs(plugin):
    with pytest.raises(ValueError, match=r"cannot import module 'no_such_module_xyz'"):
        get_reward("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match=r"has no attribute 'missing'"):
        get_reward(f"{plugin}:missing")
    with pytest.raises(ValueError, match=r"unknown reward 'no_such_reward'"):
        get_reward("no_such_reward")
    with pytest.raises(ValueError, match=r"reward 'make_scaled': bad kwargs \['bogus'\]"):
        get_reward(f"{plugin}:make_scaled", bogus=1)


def test_register_reward_and_kwargs(monkeypatch):
    monkeypatch.setattr(registry_module, "_REGISTRY", dict(registry_module._REGISTRY))

    @register_reward("test_constant")
    def constant(value=1.0):
        return lambda videos, prompts, metadata: torch.full((len(videos),), value)

    reward = get_reward("test_constant", value=3.0)
    assert reward.name == "test_constant"
    assert reward(_videos(batch=2), ["a", "b"]).tolist() == [3.0, 3.0]
    with pytest.raises(ValueError, match=r"'test_constant' is already registered"):
        register_reward("test_constant")(lambda: None)
    register_reward("test_constant", overwrite=True)(constant)
    with pytest.raises(ValueError, match=r"without ':'"):
        register_reward("bad:name")
    with pytest.raises(ValueError, match=r"reward 'test_constant': bad kwargs \['nope'\]"):
        get_reward("test_constant", nope=1)


def test_entry_point_plugin(plugin, monkeypatch):
    point = importlib.metadata.EntryPoint(
        name="plugged", value=f"{plugin}:make_scaled", group="vsa2_rl.rewards"
    )
    monkeypatch.setattr(
        registry_module,
        "entry_points",
        lambda group: [point] if group == "vsa2_rl.rewards" else [],
    )
    videos = _videos()
    reward = get_reward("plugged", scale=3.0)
    assert reward.name == "plugged"
    torch.testing.assert_close(reward(videos, ["p"] * 3).double(), 3.0 * _means(videos))


def test_nan_reward_raises_with_its_name(plugin):
    reward = get_reward(f"{plugin}:nan_reward")
    with pytest.raises(
        RewardError, match=r"reward 'nan_reward': returned non-finite .* \[0\]"
    ) as info:
        reward(_videos(), ["p"] * 3)
    assert info.value.name == "nan_reward"
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (lambda v, p, m: torch.zeros(len(v), 1), r"must return shape \[3\].*\(3, 1\)"),
        (lambda v, p, m: torch.zeros(len(v) + 1), r"must return shape \[3\].*\(4,\)"),
        (lambda v, p, m: torch.zeros(len(v), dtype=torch.float64), "must return float32"),
        (lambda v, p, m: [0.0] * len(v), "must return a torch.Tensor"),
    ],
)
def test_wrong_output_raises(fn, message):
    fn.__name__ = "broken"
    with pytest.raises(RewardError, match=f"reward 'broken': {message}"):
        get_reward(fn)(_videos(), ["p"] * 3)


def test_raising_reward_is_wrapped_with_name():
    def exploding(videos, prompts, metadata):
        raise RuntimeError("boom")

    with pytest.raises(RewardError, match=r"reward 'exploding': raised RuntimeError: boom") as info:
        get_reward(exploding)(_videos(), ["p"] * 3)
    assert isinstance(info.value.__cause__, RuntimeError)


@pytest.mark.parametrize(
    ("videos", "message"),
    [
        (torch.rand(2, 3, 3, 8, 8) * 2.0, r"values must lie in \[0, 1\], got finite range"),
        (-torch.rand(2, 3, 3, 8, 8), r"values must lie in \[0, 1\]"),
        (torch.full((2, 3, 3, 8, 8), float("nan")), "NaN values"),
        (torch.rand(3, 3, 8, 8), r"expected rank 5 \[B, T, C, H, W\], got shape \(3, 3, 8, 8\)"),
        (torch.rand(2, 1, 3, 8, 8), "at least 2 frames"),
        (torch.zeros(2, 3, 3, 8, 8, dtype=torch.uint8), "expected a float tensor"),
    ],
)
def test_bad_videos_raise_value_error(videos, message):
    reward = get_reward("image_quality")
    with pytest.raises(ValueError, match=message) as info:
        reward(videos, ["p"] * len(videos))
    assert not isinstance(info.value, RewardError)  # bad input is not a reward failure


def test_prompt_and_metadata_count_checked():
    reward = get_reward("image_quality")
    with pytest.raises(ValueError, match=r"prompts: expected 2 prompts"):
        reward(_videos(batch=2), ["only one"])
    with pytest.raises(ValueError, match=r"metadata: expected 2 dicts"):
        reward(_videos(batch=2), ["a", "b"], [{}])


# ----------------------------------------------------------------------------- mixer


def _score_entries(plugin, weights=(0.5, 2.0)):
    return [
        (f"{plugin}:from_metadata", weights[0], {}),
        (f"{plugin}:Offset", weights[1], {"offset": 1.0}),
    ]


def test_mixer_reward_level_aggregation(plugin):
    videos = _videos(batch=3)
    metadata = [{"score": 1.0}, {"score": -2.0}, {"score": 4.0}]
    mixer = RewardMixer(_score_entries(plugin), aggregation="reward", num_workers=2)
    out = mixer(videos, ["p"] * 3, metadata)
    assert mixer.names == ["from_metadata", "Offset"]
    offset = _means(videos) + 1.0
    expected = [0.5 * s + 2.0 * o for s, o in zip((1.0, -2.0, 4.0), offset.tolist(), strict=True)]
    torch.testing.assert_close(out.total.double(), torch.tensor(expected, dtype=torch.float64))
    assert out.rewards["from_metadata"].tolist() == [1.0, -2.0, 4.0]
    assert out.valid.all() and out.dropped == {}
    metrics = out.metrics()
    assert metrics["reward/from_metadata"] == pytest.approx(1.0)
    assert metrics["reward/Offset"] == pytest.approx(float(offset.mean()), rel=1e-6)
    assert metrics["reward/total"] == pytest.approx(sum(expected) / 3, rel=1e-6)
    assert metrics["reward/valid_fraction"] == 1.0


def test_weighted_total_is_the_hand_computed_weighted_sum(plugin):
    """The mixer's weighted total, of per-sample tensors (its reward-level ``total``) and of
    numbers (an evaluation's mean rewards), equals the sum worked out by hand."""
    mixer = RewardMixer(_score_entries(plugin, weights=(0.25, 3.0)))
    # 0.25 * 2 + 3 * -0.5 = -1.0; rewards the mixer does not hold are ignored
    assert mixer.weighted_total({"Offset": -0.5, "from_metadata": 2.0, "other": 9.0}) == -1.0
    per_sample = {"from_metadata": torch.tensor([1.0, -4.0]), "Offset": torch.tensor([0.5, 2.0])}
    torch.testing.assert_close(mixer.weighted_total(per_sample), torch.tensor([1.75, 5.0]))
    videos, metadata = _videos(batch=2), [{"score": 1.0}, {"score": -4.0}]
    out = mixer(videos, ["p"] * 2, metadata)
    assert torch.equal(out.total, mixer.weighted_total(out.rewards))
    with pytest.raises(ValueError, match=r"no value for the reward\(s\) \['Offset'\]"):
        mixer.weighted_total({"from_metadata": 1.0})


def test_advantage_level_aggregation_hand_computed(plugin):
    mixer = RewardMixer(_score_entries(plugin, weights=(0.25, 3.0)), aggregation="advantage")
    advantages = {
        "from_metadata": torch.tensor([1.0, -1.0, 0.5]),
        "Offset": torch.tensor([-0.5, 0.0, 2.0]),
    }
    # 0.25 * a + 3 * b, by hand
    expected = torch.tensor([0.25 - 1.5, -0.25 + 0.0, 0.125 + 6.0])
    torch.testing.assert_close(mixer.combine_advantages(advantages), expected)
    torch.testing.assert_close(combine_advantages(advantages, mixer.weights), expected)
    with pytest.raises(ValueError, match=r"advantages given for"):
        combine_advantages({"from_metadata": advantages["from_metadata"]}, mixer.weights)
    with pytest.raises(ValueError, match=r"advantage shapes differ"):
        combine_advantages({"a": torch.zeros(3), "b": torch.zeros(2)}, {"a": 1.0, "b": 1.0})


def test_mixer_accepts_config_entries_and_dedupes_names(plugin):
    from vsa2_rl.config import RewardEntry

    mixer = RewardMixer(
        [
            RewardEntry(name="image_quality", weight=1.0),
            {"name": "image_quality", "weight": 0.5, "kwargs": {"num_frames": 1}},
        ]
    )
    assert mixer.names == ["image_quality", "image_quality_2"]
    assert mixer.weights == {"image_quality": 1.0, "image_quality_2": 0.5}
    out = mixer(_videos(batch=2, frames=3), ["a", "b"])
    assert set(out.metrics()) == {
        "reward/image_quality",
        "reward/image_quality_2",
        "reward/total",
        "reward/valid_fraction",
    }


def test_thread_pool_matches_sequential():
    videos = torch.rand(2, 4, 3, 32, 32)
    entries = [
        ("dynamic_degree", 1.0, {}),
        ("temporal_flicker", 0.5, {}),
        ("image_quality", 2.0, {}),
    ]
    sequential = RewardMixer(entries, num_workers=1)(videos, ["a", "b"])
    pooled = RewardMixer(entries, num_workers=3)(videos, ["a", "b"])
    for name, values in sequential.rewards.items():
        assert torch.equal(values, pooled.rewards[name]), name
    assert torch.equal(sequential.total, pooled.total)


def test_on_error_stop_and_skip(plugin):
    entries = [(f"{plugin}:brightness", 1.0, {}), (f"{plugin}:nan_reward", 1.0, {})]
    with pytest.raises(RewardError, match=r"reward 'nan_reward': returned non-finite") as stop:
        RewardMixer(entries, on_error="stop")(_videos(), ["p"] * 3)
    assert not isinstance(stop.value, RewardSkip)
    with pytest.raises(RewardSkip, match=r"reward 'nan_reward': step skipped: returned non-finite"):
        RewardMixer(entries, on_error="skip")(_videos(), ["p"] * 3)


def test_on_error_drop_sample_masks_and_never_zeroes(plugin):
    videos = _videos(batch=3)
    entries = [(f"{plugin}:brightness", 1.0, {}), (f"{plugin}:nan_reward", 2.0, {})]
    out = RewardMixer(entries, on_error="drop_sample")(videos, ["p"] * 3)
    assert out.valid.tolist() == [False, True, True]
    assert out.dropped == {"nan_reward": [0]}
    assert math.isnan(out.rewards["nan_reward"][0].item())  # kept as NaN, not zeroed
    assert math.isnan(out.total[0].item())
    means = _means(videos)
    torch.testing.assert_close(out.total[1:].double(), 3.0 * means[1:])
    metrics = out.metrics()
    assert metrics["reward/brightness"] == pytest.approx(float(means[1:].mean()), rel=1e-6)
    assert metrics["reward/valid_fraction"] == pytest.approx(2 / 3)


def test_an_overflowing_weighted_sum_follows_on_error():
    def huge(videos, prompts, metadata):
        return torch.tensor([3e38, 1.0, -3e38])  # finite in float32; times 2 it is not

    entries = [(huge, 2.0)]
    with pytest.raises(RewardError, match=r"reward 'weighted sum': overflows at samples \[0, 2\]"):
        RewardMixer(entries, on_error="stop")(_videos(), ["p"] * 3)
    with pytest.raises(RewardSkip, match=r"'weighted sum': step skipped: overflows"):
        RewardMixer(entries, on_error="skip")(_videos(), ["p"] * 3)
    out = RewardMixer(entries, on_error="drop_sample")(_videos(), ["p"] * 3)
    assert out.valid.tolist() == [False, True, False]
    assert out.dropped == {"weighted sum": [0, 2]}
    assert out.total[1].item() == 2.0


def test_a_reward_past_its_timeout_fails_by_name_and_is_left_behind():
    import threading
    import time

    release = threading.Event()

    def hangs(videos, prompts, metadata):
        release.wait(30)  # bounded: the test releases it at its end
        return torch.zeros(len(videos))

    entries = [(hangs, 1.0), ("image_quality", 1.0)]
    try:
        for on_error, error in (("stop", RewardError), ("skip", RewardSkip)):
            start = time.monotonic()
            with pytest.raises(error, match=r"'hangs': .*did not finish within rewards.timeout_s"):
                RewardMixer(entries, on_error=on_error, timeout_s=0.3)(_videos(), ["p"] * 3)
            assert time.monotonic() - start < 5
        fast = RewardMixer([("image_quality", 1.0)], timeout_s=30)(_videos(), ["p"] * 3)
        assert fast.valid.all()
    finally:
        release.set()
    with pytest.raises(ValueError, match=r"rewards.timeout_s: must be > 0"):
        RewardMixer(entries, timeout_s=0)


def test_an_error_that_is_not_a_reward_failure_still_propagates():
    def broken_contract(videos, prompts, metadata):
        raise KeyboardInterrupt  # not wrapped by the reward: the run must see it

    with pytest.raises(KeyboardInterrupt):
        RewardMixer([(broken_contract, 1.0), ("image_quality", 1.0)])(_videos(), ["p"] * 3)


def test_drop_sample_still_stops_on_batch_level_failures():
    def wrong_shape(videos, prompts, metadata):
        return torch.zeros(len(videos), 2)

    with pytest.raises(RewardError, match=r"reward 'wrong_shape': must return shape"):
        RewardMixer([(wrong_shape, 1.0)], on_error="drop_sample")(_videos(), ["p"] * 3)


def test_mixer_construction_errors(tmp_path):
    missing = tmp_path / "nope.pt"
    with pytest.raises(
        ValueError,
        match=r"rewards.functions\[1\] \(aesthetic\): kwargs.clip_path: file not found",
    ):
        RewardMixer(
            [
                ("image_quality", 1.0),
                ("aesthetic", 1.0, {"clip_path": str(missing), "predictor_path": str(missing)}),
            ]
        )
    with pytest.raises(ValueError, match=r"rewards.functions\[0\].weight: must be a finite"):
        RewardMixer([("image_quality", float("nan"))])
    with pytest.raises(ValueError, match=r"rewards.on_error: got 'ignore'"):
        RewardMixer([("image_quality", 1.0)], on_error="ignore")
    with pytest.raises(ValueError, match=r"rewards.aggregation: got 'sum'"):
        RewardMixer([("image_quality", 1.0)], aggregation="sum")


def exits(videos, prompts, metadata):
    raise SystemExit(3)


def edits_in_place(videos, prompts, metadata):
    videos.mul_(0.0)  # e.g. a normalisation written in place
    return torch.zeros(len(videos))


def test_system_exit_and_in_place_edits_are_reward_failures():
    videos = _videos(batch=2)
    with pytest.raises(RewardError, match=r"reward 'exits': raised SystemExit: 3"):
        get_reward("test_rewards_registry:exits")(videos, ["a", "b"])
    with pytest.raises(RewardError, match=r"reward 'edits_in_place': changed the videos in place"):
        get_reward("test_rewards_registry:edits_in_place")(videos, ["a", "b"])
    mixer = RewardMixer(
        [("test_rewards_registry:exits", 1.0), ("image_quality", 1.0)], on_error="skip"
    )
    with pytest.raises(RewardSkip, match=r"reward 'exits'"):
        mixer(_videos(batch=2), ["a", "b"])


@pytest.mark.slow
def test_one_ctrl_c_stops_a_mixer_waiting_on_a_hung_reward(tmp_path):
    import signal
    import subprocess
    import time

    script = tmp_path / "hang.py"
    script.write_text(
        textwrap.dedent(
            """
            import threading, torch
            from vsa2_rl.rewards import RewardMixer

            def hangs(videos, prompts, metadata):
                threading.Event().wait()
                return torch.zeros(len(videos))

            mixer = RewardMixer([(hangs, 1.0), ("image_quality", 1.0)], num_workers=2)
            print("scoring", flush=True)
            mixer(torch.rand(2, 3, 3, 8, 8), ["a", "b"])
            """
        )
    )
    process = subprocess.Popen(  # SIGINT at its default, even under a shell that ignores it
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        assert process.stdout.readline().strip() == "scoring"
        time.sleep(0.5)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=20)
    finally:
        process.kill()
    assert "KeyboardInterrupt" in err
