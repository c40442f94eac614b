"""The rollout-agreement figure, velocity_rel_error (vsa2_rl.eval.agreement): it equals the
relative velocity error computed by hand, is 0 at sparsity 0 without an extra forward, leaves
the sweep's videos, density and latency as they were, grows with sparsity on the toy model, and
reaches the trainer's metrics, plot and warning."""

import itertools
import os
import re
import time

import pytest
import torch

from vsa2_rl.attention.state import SparsityState
from vsa2_rl.config import ConfigError, check_resume, config_tree, load_config
from vsa2_rl.eval import sweep_model
from vsa2_rl.eval.agreement import agreement_metrics, rollout_warning
from vsa2_rl.rl.tracking import plot_reward_curve, read_metrics
from vsa2_rl.rl.trainer import train
from vsa2_rl.runtime import build_bundle
from vsa2_rl.sampling import seeded_noise, sigma_schedule

TESTS = os.path.dirname(os.path.abspath(__file__))
FLOW_GRPO_TOY = os.path.join(TESTS, "flow_grpo_toy.yaml")
SHAPE = (4, 16, 16)
PROMPTS = [
    "a red square moving right fast",
    "a blue circle moving up slow",
    "a green triangle moving left fast",
]
SMALL = [
    "model.num_frames=4",
    "model.height=16",
    "model.width=16",
    "logging.progress=false",
    # whole-model runs use the torch reference; the Triton interpreter is tested on the kernels
    "attention.backend=torch",
]


@pytest.fixture(scope="module")
def bundle():
    return build_bundle(load_config(FLOW_GRPO_TOY, SMALL), torch.device("cpu"), torch.float32)


def _sweep(bundle, sparsities, agreement_videos, *, guidance_scale=1.0, prompts=PROMPTS[:2]):
    return sweep_model(
        bundle,
        prompts,
        sparsities,
        [],
        num_steps=3,
        shift=1.0,
        guidance_scale=guidance_scale,
        seed=7,
        batch_size=2,
        shape=SHAPE,
        progress=False,
        agreement_videos=agreement_videos,
    )


def _by_hand(bundle, sparsity, guidance_scale):
    """Per video, the ratios ||v_s - v_0|| / ||v_0|| along its Euler ODE trajectory at
    ``sparsity``, from explicit forwards in the sweep's batches of 2: at every step the guided
    velocity at ``sparsity`` (which takes the step) and at 0, on the step's latent."""
    state, ratios = bundle.sparsity_state, {}
    noise = seeded_noise(bundle.latent_shape(*SHAPE), [7 + i for i in range(len(PROMPTS))])
    sigmas = sigma_schedule(3, 1.0).tolist()
    uncond = bundle.encode_prompts([""])

    def guided(x, sigma, text):
        v_c = bundle.velocity(x, sigma, text).float()
        v_u = bundle.velocity(x, sigma, uncond.expand_as(text)).float()
        return v_u + guidance_scale * (v_c - v_u)

    with torch.no_grad():
        for start in (0, 2):
            text = bundle.encode_prompts(PROMPTS[start : start + 2])
            x = noise[start : start + 2]
            for sigma, sigma_next in itertools.pairwise(sigmas):
                sigma_column = torch.full((x.shape[0],), sigma)
                with state.at(sparsity):
                    sparse = guided(x, sigma_column, text)
                with state.at(0.0):
                    dense = guided(x, sigma_column, text)
                for row in range(x.shape[0]):
                    error = (sparse[row] - dense[row]).norm() / dense[row].norm()
                    ratios.setdefault(start + row, []).append(error.item())
                x = x + (sigma_next - sigma) * sparse
    state.pop_density()
    return ratios


def test_the_figure_is_the_relative_velocity_error_computed_by_hand(bundle):
    ratios = _by_hand(bundle, 0.5, guidance_scale=3.0)
    for videos in (3, 1):  # two batches, the second one short; part of the first batch
        rows, _ = _sweep(bundle, [0.5], videos, guidance_scale=3.0, prompts=PROMPTS)
        measured = [ratio for video in range(videos) for ratio in ratios[video]]
        expected = sum(measured) / len(measured)
        assert rows[0]["velocity_rel_error"] == pytest.approx(expected, rel=1e-5)


def test_zero_at_sparsity_zero_without_a_dense_forward_and_absent_when_off(bundle, monkeypatch):
    calls = []
    velocity = bundle.velocity

    def counted(*args):
        calls.append(bundle.sparsity_state.sparsity)
        return velocity(*args)

    monkeypatch.setattr(bundle, "velocity", counted)
    measured, _ = _sweep(bundle, [0.0], agreement_videos=2)
    forwards = len(calls)
    unmeasured, _ = _sweep(bundle, [0.0], agreement_videos=0)
    assert measured[0]["velocity_rel_error"] == 0.0
    assert len(calls) == 2 * forwards  # the same forwards with the figure as without it
    assert "velocity_rel_error" not in unmeasured[0]


def test_measuring_changes_neither_videos_nor_density_nor_latency(bundle, monkeypatch):
    clock, velocity = [0.0], bundle.velocity

    def timed(*args):  # a clock that a sparse forward advances by 1 s, a dense one by 10 s
        clock[0] += 10.0 if bundle.sparsity_state.sparsity == 0.0 else 1.0
        return velocity(*args)

    monkeypatch.setattr(bundle, "velocity", timed)
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    (measured,), measured_videos = _sweep(bundle, [0.9], agreement_videos=2)
    (plain,), plain_videos = _sweep(bundle, [0.9], agreement_videos=0)
    assert measured["density"] == plain["density"] < 0.5
    assert torch.equal(measured_videos[0.9].videos, plain_videos[0.9].videos)
    # 3 sparse forwards for a batch of 2 videos; the 3 dense ones are not latency
    assert measured["latency_s"] == plain["latency_s"] == 1.5


def test_the_error_grows_with_sparsity_on_the_toy_model(bundle):
    rows, _ = _sweep(bundle, [0.25, 0.5, 0.9], agreement_videos=2)
    errors = [row["velocity_rel_error"] for row in rows]
    # the shipped toy at 4x16x16 gives 0.056, 0.114, 0.155 here, and the same order from 4
    # other seeds (0.75 and 0.9 are close: on some noises 0.75's is the larger)
    assert 0.0 < errors[0] < errors[1] < errors[2]


def test_dense_forwards_inside_unrecorded_leave_the_density_as_it_was():
    state = SparsityState()
    state.record_density(0.25)
    with pytest.raises(RuntimeError), state.unrecorded():
        state.record_density(1.0)
        raise RuntimeError("a failing forward")
    assert state.pop_density() == 0.25


def test_a_negative_count_or_threshold_is_refused_by_its_key():
    with pytest.raises(ConfigError, match=r"^eval\.agreement_prompts: must be >= 0"):
        load_config(FLOW_GRPO_TOY, ["eval.agreement_prompts=-1"])
    with pytest.raises(ConfigError, match=r"^sparsity\.max_rollout_velocity_error: must be >= 0"):
        load_config(FLOW_GRPO_TOY, ["sparsity.max_rollout_velocity_error=-0.1"])
    config = load_config(FLOW_GRPO_TOY, ["eval.agreement_prompts=3", "eval.samples_per_prompt=2"])
    assert config.eval.agreement_videos == 6  # every sample of the first 3 prompts
    assert load_config(FLOW_GRPO_TOY, ["eval.agreement_prompts=0"]).eval.agreement_videos == 0


def test_a_resumed_run_may_change_the_warning_threshold():
    changed = load_config(FLOW_GRPO_TOY, ["sparsity.max_rollout_velocity_error=0.2"])
    check_resume(config_tree(load_config(FLOW_GRPO_TOY, [])), changed, "step_1")  # no error


def test_the_rollout_figure_is_measured_only_where_it_is_not_known():
    calls = []

    def sweep(prompts, sparsities, rewards, images):
        calls.append((prompts, sparsities, rewards, images))
        return [{"sparsity": sparsities[0], "velocity_rel_error": 0.3}], {}

    def metrics(rollout, evaluated):
        return agreement_metrics(sweep, ["a", "b", "c"], [None] * 3, rollout, evaluated, 2)

    row = {"sparsity": 0.25, "velocity_rel_error": 0.1}
    expected = {"eval/velocity_rel_error": 0.1, "eval/rollout_velocity_rel_error": 0.3}
    assert metrics(0.5, row) == expected
    assert calls == [(["a", "b"], [0.5], [], [None, None])]  # the measured prompts alone
    assert metrics(0.25, row)["eval/rollout_velocity_rel_error"] == 0.1  # the row's own
    assert metrics(0.0, row)["eval/rollout_velocity_rel_error"] == 0.0
    assert metrics(0.5, {"sparsity": 0.25}) == {}  # eval.agreement_prompts=0
    assert len(calls) == 1


def test_the_warning_names_the_error_the_threshold_the_sparsity_and_the_fix():
    metrics = {"eval/rollout_velocity_rel_error": 0.3}
    assert rollout_warning(metrics, None, 0.9) is None
    assert rollout_warning(metrics, 0.5, 0.9) is None
    assert rollout_warning({}, 0.1, 0.9) is None
    text = rollout_warning(metrics, 0.1, 0.9)
    for part in ("0.3000", "max_rollout_velocity_error=0.1", "sparsity 0.9", "sparsity.train",
                 "sparsity.warmup_steps"):  # fmt: skip
        assert part in text


def test_the_reward_curve_plots_the_agreement_in_its_own_panel(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    titles = []
    set_title = Axes.set_title

    def recording_set_title(self, title, **kwargs):
        titles.append(title)
        return set_title(self, title, **kwargs)

    monkeypatch.setattr(Axes, "set_title", recording_set_title)
    evaluation = {"eval/reward": 0.5, "eval/velocity_rel_error": 0.1}
    rows = [
        {"step": 0, **evaluation, "eval/rollout_velocity_rel_error": 0.2},
        {"step": 1, "reward/mean": 0.4, "reward/std": 0.1},
    ]
    plot_reward_curve(rows, str(tmp_path / "curve.png"))
    assert titles == ["trained reward", "relative velocity error vs dense attention (eval prompts)"]
    assert (tmp_path / "curve.png").stat().st_size > 0


@pytest.mark.parametrize("threshold", ["1e-9", "null"])
def test_the_trainer_logs_both_figures_and_warns_once_above_the_threshold(
    tmp_path, capsys, threshold
):
    config = load_config(
        FLOW_GRPO_TOY,
        [
            *SMALL,
            f"out_dir={tmp_path / 'run'}",
            "sampler.num_steps=3",
            "sampler.sde_window=[0,2]",
            "sampler.eval_num_steps=3",
            "rl.prompts_per_step=2",
            "rl.group_size=2",
            "rl.train_batch_size=4",
            "train.num_steps=1",
            "train.sample_every=0",
            "rewards.functions=[{name: 'test_trainer:brightness', weight: 1.0}]",
            "eval.every=1",
            "eval.num_prompts=2",
            f"sparsity.max_rollout_velocity_error={threshold}",
        ],
    )
    train(config)
    rows = read_metrics(os.path.join(config.out_dir, "metrics.jsonl"))
    assert [row["step"] for row in rows] == [0, 1]  # both evaluate: before the step and after
    for row in rows:  # evaluation at 0.75, rollouts at 0.9: two measurements
        assert row["eval/velocity_rel_error"] > 0.0 and row["eval/rollout_velocity_rel_error"] > 0
        assert row["eval/velocity_rel_error"] != row["eval/rollout_velocity_rel_error"]
    warnings = re.findall(r"warning: at the rollout sparsity 0\.9", capsys.readouterr().out)
    assert len(warnings) == (1 if threshold == "1e-9" else 0)
