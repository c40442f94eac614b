"""The GRPO trainer end to end on the toy model (CPU, tiny sizes): parameters change, the first
ratio is 1, resume equals an uninterrupted run, failures never touch the weights."""

import contextlib
import importlib.machinery
import json
import math
import os
import re
import shutil
import sys
from types import SimpleNamespace

import pytest
import torch

from vsa2_rl.config import ConfigError, load_config, load_eval_config
from vsa2_rl.rl import engines
from vsa2_rl.rl import flow_grpo as update_module
from vsa2_rl.rl import policy as policy_module
from vsa2_rl.rl import rollout as rollout_module
from vsa2_rl.rl.checkpoint import find_latest, load_checkpoint
from vsa2_rl.rl.trainer import train
from vsa2_rl.runtime import load_prompts

FLOW_GRPO_TOY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flow_grpo_toy.yaml")

TINY = [
    "model.num_frames=4",
    "model.height=16",
    "model.width=16",
    "sampler.num_steps=3",
    "sampler.sde_window=[0,2]",
    "rl.prompts_per_step=2",
    "rl.group_size=2",
    "rl.train_batch_size=4",
    "train.learning_rate=1e-3",
    "train.sample_every=0",
    "logging.progress=false",
    "rewards.num_workers=1",
    "eval.every=0",
    # whole-model runs use the torch reference; the Triton interpreter is tested on the kernels
    "attention.backend=torch",
]
REQUIRED_KEYS = {
    "step",
    "reward/mean",
    "reward/std",
    "loss/policy",
    "loss/kl",
    "train/ratio_dev_first",
    "train/clip_frac",
    "train/ratio_mean",
    "train/approx_kl",
    "attn/density",
    "sparsity/rollout",
    "sparsity/train",
    "sparsity/eval",
    "perf/rollout_s",
    "perf/train_s",
}


def brightness(videos, prompts, metadata):
    """A dense, deterministic test reward: mean brightness (any policy change moves it)."""
    return videos.mean(dim=(1, 2, 3, 4)).float()


def nan_reward(videos, prompts, metadata):
    return torch.full((videos.shape[0],), float("nan"))


def nan_for_the_first_video(videos, prompts, metadata):
    """brightness, but NaN for the batch's first video (a guard that fails on one video)."""
    values = brightness(videos, prompts, metadata)
    values[0] = float("nan")
    return values


def _config(tmp_path, *extra, name="run"):
    return load_config(
        FLOW_GRPO_TOY,
        [
            *TINY,
            f"out_dir={tmp_path / name}",
            "rewards.functions=[{name: 'test_trainer:brightness', weight: 1.0}]",
            *extra,
        ],
    )


def _rows(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as handle:
        return [json.loads(line) for line in handle]


def _weights(out_dir):
    return load_checkpoint(find_latest(os.path.join(out_dir, "checkpoints")))["model"]


def test_two_steps_change_parameters_and_log_every_key(tmp_path):
    config = _config(tmp_path, "train.num_steps=2", "eval.every=2", "eval.num_prompts=2")
    from vsa2_rl.runtime import build_bundle

    before = {
        k: v.clone()
        for k, v in build_bundle(config, torch.device("cpu"), torch.float32)
        .transformer.state_dict()
        .items()
    }
    summary = train(config)
    rows = _rows(config.out_dir)
    assert [row["step"] for row in rows] == [0, 1, 2]
    evaluation, rows = rows[0], rows[1:]
    # deterministic ODE evaluation before the first update and after the last one
    assert {"eval/reward", "eval/reward/brightness", "eval/density"} <= set(evaluation)
    assert "eval/reward" not in rows[0] and "eval/reward" in rows[1]
    assert summary["reward_start"] == evaluation["eval/reward"]
    assert summary["reward_end"] == rows[1]["eval/reward"]
    for row in rows:
        assert set(row) >= REQUIRED_KEYS
        assert "reward/brightness" in row
        assert row["train/ratio_dev_first"] < 1e-3  # rollout and training forward agree
        assert row["sparsity/rollout"] == row["sparsity/train"] == 0.9
        assert row["sparsity/eval"] == 0.75
        assert 0 < row["attn/density"] < 0.5  # VSA2 really ran sparse
    after = _weights(config.out_dir)
    changed = [k for k in before if not torch.equal(before[k], after[k].to(before[k].dtype))]
    assert changed, "no parameter changed after two GRPO steps"
    assert os.path.exists(os.path.join(config.out_dir, "reward_curve.png"))


@pytest.mark.parametrize("on_error", ["skip", "drop_sample"])
def test_a_guard_failing_on_one_evaluation_video_does_not_stop_training(tmp_path, on_error):
    guard = "eval.guard_rewards=[{name: 'test_trainer:nan_for_the_first_video'}]"
    config = _config(tmp_path, "train.num_steps=1", "eval.every=1", "eval.num_prompts=3",
                     guard, f"rewards.on_error={on_error}")  # fmt: skip
    train(config)
    evaluations = [row for row in _rows(config.out_dir) if "eval/reward" in row]
    assert [row["step"] for row in evaluations] == [0, 1]
    for row in evaluations:  # the guard's mean is over the two finite videos: finite, in [0, 1]
        assert 0.0 <= row["eval/guard/nan_for_the_first_video"] <= 1.0
    assert find_latest(os.path.join(config.out_dir, "checkpoints")) is not None


def test_a_guard_failing_on_one_evaluation_video_stops_training_under_stop(tmp_path):
    guard = "eval.guard_rewards=[{name: 'test_trainer:nan_for_the_first_video'}]"
    config = _config(tmp_path, "train.num_steps=1", "eval.every=1", "eval.num_prompts=3",
                     guard, "rewards.on_error=stop")  # fmt: skip
    with pytest.raises(ValueError, match="nan_for_the_first_video"):
        train(config)


def test_guard_metrics_are_scored_at_every_evaluation_and_never_trained_on(tmp_path):
    config = _config(
        tmp_path,
        "train.num_steps=2",
        "eval.every=1",
        "eval.num_prompts=2",
        "eval.guard_rewards=[{name: 'test_trainer:brightness'}, {name: shape_fidelity}]",
    )
    train(config)
    rows = _rows(config.out_dir)
    evaluations = [row for row in rows if "eval/reward" in row]
    assert [row["step"] for row in evaluations] == [0, 1, 2]
    for row in evaluations:
        # the guard scores the same evaluation videos as the trained reward of the same function
        assert row["eval/guard/brightness"] == pytest.approx(row["eval/reward/brightness"])
        assert 0.0 <= row["eval/guard/shape_fidelity"] <= 1.0
    for row in rows[1:]:  # training steps: only the trained reward enters reward/*
        assert not [key for key in row if key.startswith("reward/") and "shape" in key]
        assert row["reward/mean"] == pytest.approx(row["reward/brightness"])
    with pytest.raises(ConfigError, match=r"eval.guard_rewards\[0\] \(no_such_reward\)"):
        train(_config(tmp_path, "eval.guard_rewards=[{name: no_such_reward}]", name="bad"))
    assert not os.path.exists(tmp_path / "bad")


def test_a_fresh_run_refuses_a_folder_that_holds_a_run(tmp_path):
    train(_config(tmp_path, "train.num_steps=1"))
    before = sorted(os.listdir(tmp_path / "run"))
    with pytest.raises(ConfigError, match=r"out_dir: .* holds a run \(checkpoints and metrics"):
        train(_config(tmp_path, "train.num_steps=2", "train.resume=none"))
    assert sorted(os.listdir(tmp_path / "run")) == before  # nothing moved, nothing written
    assert [row["step"] for row in _rows(tmp_path / "run")] == [1]


@pytest.mark.parametrize(("name", "kind"), [("checkpoints", "folder"), ("metrics.jsonl", "file")])
def test_a_file_or_folder_where_the_run_writes_is_refused_before_any_step(tmp_path, name, kind):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / name).mkdir() if kind == "file" else (tmp_path / "run" / name).touch()
    with pytest.raises(ConfigError, match=rf"^out_dir: .*/run/{name} is not a {kind}, and the"):
        train(_config(tmp_path, "train.num_steps=1"))
    assert sorted(os.listdir(tmp_path / "run")) == [".lock", name]  # no step ran


def test_a_resume_stopped_while_writing_config_yaml_leaves_the_old_one(tmp_path, monkeypatch):
    from vsa2_rl.rl import setup as setup_module

    train(_config(tmp_path, "train.num_steps=1"))
    before = (tmp_path / "run" / "config.yaml").read_text()

    def interrupted(config):
        raise KeyboardInterrupt  # Ctrl-C (or a full disk) while config.yaml is being written

    monkeypatch.setattr(setup_module, "to_yaml", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train(_config(tmp_path, "train.num_steps=2"))
    assert (tmp_path / "run" / "config.yaml").read_text() == before  # eval and export read it


def test_resume_skips_a_damaged_newest_checkpoint(tmp_path):
    from vsa2_rl.eval.sweep import resolve_targets

    train(_config(tmp_path, "train.num_steps=2", "train.checkpoint_every=1"))
    weights = tmp_path / "run" / "checkpoints" / "step_2" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated, its COMPLETE marker still there
    with pytest.warns(UserWarning, match=r"skipping damaged checkpoints \(step_2: model"):
        (target,) = resolve_targets(*load_eval_config(None, [f"run_dir={tmp_path / 'run'}"]))
    assert target.checkpoint.endswith("step_1")
    with pytest.warns(UserWarning, match=r"skipping damaged checkpoints \(step_2: model"):
        train(_config(tmp_path, "train.num_steps=3", "train.checkpoint_every=1"))
    # step 2 is redone from step 1: its first row is replaced, not duplicated
    assert [row["step"] for row in _rows(tmp_path / "run")] == [1, 2, 3]
    with pytest.raises(ConfigError, match=r"train.resume: .*step_2 is not a usable checkpoint"):
        weights.write_bytes(b"garbage")
        train(_config(tmp_path, f"train.resume={weights.parent}", "train.num_steps=4"))


def test_resume_equals_uninterrupted(tmp_path):
    full = _config(tmp_path, "train.num_steps=3", "train.checkpoint_every=1", name="full")
    train(full)
    part = _config(tmp_path, "train.num_steps=3", "train.checkpoint_every=1", name="part")
    part_first = _config(tmp_path, "train.num_steps=2", "train.checkpoint_every=1", name="part")
    train(part_first)
    # a crash in the middle of writing step 3 leaves a temp folder and no COMPLETE marker
    shutil.copytree(
        os.path.join(part.out_dir, "checkpoints", "step_2"),
        os.path.join(part.out_dir, "checkpoints", "step_3"),
    )
    os.remove(os.path.join(part.out_dir, "checkpoints", "step_3", "COMPLETE"))
    train(part)
    full_rows, part_rows = _rows(full.out_dir), _rows(part.out_dir)
    assert [r["step"] for r in part_rows] == [1, 2, 3]
    for a, b in zip(full_rows, part_rows, strict=True):
        for key in ("reward/mean", "loss/policy", "train/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)
    full_w, part_w = _weights(full.out_dir), _weights(part.out_dir)
    for key in full_w:
        torch.testing.assert_close(full_w[key], part_w[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("same_noise", [True, False])
def test_same_noise_per_group_starts_a_group_from_one_noise(tmp_path, monkeypatch, same_noise):
    starts, videos = [], []
    real_sample = rollout_module.sample

    def recording_sample(velocity_fn, noise, sigmas, **kwargs):
        starts.append(noise.clone())
        return real_sample(velocity_fn, noise, sigmas, **kwargs)

    def recording_reward(batch, prompts, metadata):
        videos.append(batch.clone())
        return brightness(batch, prompts, metadata)

    monkeypatch.setattr(rollout_module, "sample", recording_sample)
    monkeypatch.setattr(sys.modules[__name__], "recorded_reward", recording_reward, raising=False)
    config = _config(
        tmp_path,
        "train.num_steps=1",
        f"sampler.same_noise_per_group={str(same_noise).lower()}",
        "rewards.functions=[{name: 'test_trainer:recorded_reward'}]",
    )
    train(config)
    (start,), (video,) = starts, videos  # 2 groups of 2, one rollout chunk
    assert torch.equal(start[0], start[1]) == same_noise
    assert torch.equal(start[2], start[3]) == same_noise
    assert not torch.equal(start[0], start[2])
    # the SDE noise still makes a group's videos differ
    assert (video[0] - video[1]).abs().max() > 1e-3 and (video[2] - video[3]).abs().max() > 1e-3


def test_same_noise_per_group_needs_sde_noise():
    with pytest.raises(ConfigError, match=r"sampler\.same_noise_per_group"):
        load_config(FLOW_GRPO_TOY, ["sampler.same_noise_per_group=true", "sampler.noise_level=0"])


def test_nan_reward_skips_the_step_without_touching_weights(tmp_path):
    config = _config(
        tmp_path,
        "train.num_steps=1",
        "rewards.functions=[{name: 'test_trainer:nan_reward'}]",
        "rewards.on_error=skip",
    )
    from vsa2_rl.runtime import build_bundle

    before = build_bundle(config, torch.device("cpu"), torch.float32).transformer.state_dict()
    train(config)
    (row,) = _rows(config.out_dir)
    assert row["train/skipped_reward"] == 1 and "loss/policy" not in row
    after = _weights(config.out_dir)
    for key in before:
        assert torch.equal(before[key], after[key]), key


def test_nonfinite_loss_never_reaches_the_weights(tmp_path, monkeypatch):
    real_loss = update_module.grpo_loss

    def poisoned(*args, **kwargs):
        loss, stats = real_loss(*args, **kwargs)
        return loss * float("nan"), stats

    monkeypatch.setattr(update_module, "grpo_loss", poisoned)
    config = _config(tmp_path, "train.num_steps=1")
    from vsa2_rl.runtime import build_bundle

    before = build_bundle(config, torch.device("cpu"), torch.float32).transformer.state_dict()
    train(config)
    (row,) = _rows(config.out_dir)
    assert row["train/skipped_nonfinite"] == 1
    after = _weights(config.out_dir)
    for key in before:
        assert torch.equal(before[key], after[key]), key


def test_videos_that_turn_nan_stop_the_run_by_name(tmp_path, monkeypatch, capsys):
    from vsa2_rl.cli import main
    from vsa2_rl.toy.model import ToyBundle

    real_decode = ToyBundle.decode

    def decode(self, latents):
        videos = real_decode(self, latents)
        videos[1] = float("nan")  # the second video of every chunk
        return videos

    monkeypatch.setattr(ToyBundle, "decode", decode)
    argv = ["train", *TINY, "train.num_steps=1", f"out_dir={tmp_path / 'run'}"]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: step 1: 1 rollout video(s) hold NaN or inf (samples [1])")


def constant(videos, prompts, metadata):
    return torch.ones(len(videos))


@pytest.mark.parametrize("algorithm", [[], ["rl.algorithm=nft", "sampler.kind=ode"]])
def test_a_step_without_reward_variance_raises_no_scheduler_warning(tmp_path, algorithm):
    import warnings

    config = _config(
        tmp_path, "train.num_steps=1", "rewards.functions=[{name: 'test_trainer:constant'}]",
        *algorithm,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(config)
    assert _rows(config.out_dir)[0]["train/zero_var_frac"] == 1.0
    assert not [(w.filename, w.lineno) for w in caught if "lr_scheduler.step()" in str(w.message)]


def test_lora_with_kl_to_the_reference(tmp_path):
    config = _config(tmp_path, "train.num_steps=2", "model.lora.enabled=true", "rl.kl_beta=0.1")
    train(config)
    rows = _rows(config.out_dir)
    assert rows[0]["loss/kl"] == pytest.approx(0.0, abs=1e-12)  # LoRA starts at the reference
    assert rows[1]["loss/kl"] > 0  # after one update the policy has moved away from it
    saved = _weights(config.out_dir)
    assert saved and all("lora_" in k or ".vsa2." in k for k in saved)


def test_empty_prompt_file_is_rejected_before_any_work(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n  \n")
    config = _config(tmp_path, f"prompts.file={prompts}")
    with pytest.raises(ConfigError, match=r"prompts\.file: prompt file .* has no prompts"):
        train(config)
    assert not os.path.exists(config.out_dir)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True])
def test_compiled_blocks_train_like_eager_ones(tmp_path, lora):
    """model.compile_blocks=true (torch.compile of every block, inductor) changes the speed, not
    the run: same rewards, same first-minibatch ratio, nearly the same update; and the blocks
    keep working when the sparsity changes between rollout/training and evaluation. With LoRA
    (the recipes' setting) the KL reference runs the same compiled blocks, adapters off."""
    # Adam's first step moves every weight by about +-lr whatever its gradient's size, so a
    # gradient component that float noise flips moves a weight by 2 lr: a small lr keeps the
    # comparison about the compiled kernels, not about the signs of near-zero gradients
    common = ("train.num_steps=1", "eval.every=1", "eval.num_prompts=2", "train.learning_rate=1e-5")
    if lora:
        common += ("model.lora.enabled=true", "rl.kl_beta=0.1")
    eager = _config(tmp_path, *common, name="eager")
    compiled = _config(tmp_path, *common, "model.compile_blocks=true", name="compiled")
    assert compiled.sparsity.train != compiled.sparsity.eval
    train(eager)
    train(compiled)
    rows_e, rows_c = _rows(eager.out_dir), _rows(compiled.out_dir)
    assert rows_c[-1]["train/ratio_dev_first"] < 1e-3
    # before the update: the rollout and the first evaluation
    for key in ("reward/mean", "reward/std"):
        assert rows_c[-1][key] == pytest.approx(rows_e[-1][key], rel=1e-3), key
    assert rows_c[0]["eval/reward"] == pytest.approx(rows_e[0]["eval/reward"], rel=1e-3)
    # the update and the evaluation after it: each group's two samples pull in nearly opposite
    # directions, so the summed gradient magnifies float differences of the compiled kernels;
    # with LoRA both varied by 0.2-0.5% between runs (test_models checks the compiled LoRA
    # model's own gradients to 1e-4)
    for key in ("train/grad_norm", "eval/reward"):
        assert rows_c[-1][key] == pytest.approx(rows_e[-1][key], rel=1e-2 if lora else 1e-3), key


def _first_update(tmp_path, monkeypatch, name, *extra):
    """The logged metrics and the gradient of a 1-step run's update (before the optimizer)."""
    grads = []
    real_finish = engines.finish_update

    def recording_finish(acc, optimizer, params, max_grad_norm, losses):
        grads.append(torch.cat([p.grad.flatten() for p in params if p.grad is not None]))
        return real_finish(acc, optimizer, params, max_grad_norm, losses)

    monkeypatch.setattr(engines, "finish_update", recording_finish)
    config = _config(tmp_path, "train.num_steps=1", *extra, name=name)
    train(config)
    (grad,) = grads
    return _rows(config.out_dir)[-1], grad


@pytest.mark.parametrize("kl_beta", ["0.0", "0.5"])
def test_every_sample_weighs_the_same_whatever_the_chunking(tmp_path, monkeypatch, kl_beta):
    # 2 groups of 3: chunks of 4 split the second group and leave a chunk of 2; one chunk of 6
    # is the reference. The on-policy loss of zero-mean advantages is 0 in both.
    kl = f"rl.kl_beta={kl_beta} rl.group_size=3".split()
    whole, whole_grad = _first_update(tmp_path, monkeypatch, "whole", "rl.train_batch_size=6", *kl)
    split, split_grad = _first_update(tmp_path, monkeypatch, "split", "rl.train_batch_size=4", *kl)
    assert abs(whole["loss/policy"]) < 1e-6 and abs(split["loss/policy"]) < 1e-6
    assert split["loss/kl"] == pytest.approx(whole["loss/kl"], rel=1e-4, abs=1e-12)
    error = (split_grad - whole_grad).norm() / whole_grad.norm()
    assert error < 1e-4, f"relative gradient difference {error:.2e}"


def test_resume_refuses_a_changed_setting_and_accepts_a_longer_run(tmp_path):
    first = _config(tmp_path, "train.num_steps=1")
    train(first)
    for key, value, was in (
        ("rl.group_size", "3", "2"),
        ("train.learning_rate", "0.01", "0.001"),
        ("model.lora.enabled", "true", "False"),
        ("attention.enabled", "false", "True"),
    ):
        changed = _config(tmp_path, "train.num_steps=2", f"{key}={value}")
        with pytest.raises(ConfigError, match=rf"^{key}: changed since the checkpoint \(was {was}"):
            train(changed)
    assert [r["step"] for r in _rows(first.out_dir)] == [1]  # nothing was written
    longer = _config(tmp_path, "train.num_steps=2", "eval.every=0", "logging.progress=false")
    train(longer)
    assert [r["step"] for r in _rows(first.out_dir)] == [1, 2]


def test_a_longer_resumed_run_keeps_its_sparsity_curriculum(tmp_path):
    # a 2-step curriculum 0.5 -> 0.8 (no warm-up): the steps after it train at 0.8, the end value
    curriculum = ["sparsity.train=0.5", "sparsity.train_end=0.8", "sparsity.eval=0.0"]
    train(_config(tmp_path, "train.num_steps=2", *curriculum))
    resumed = _config(tmp_path, "train.num_steps=4", *curriculum)
    train(resumed)
    rows = _rows(resumed.out_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[2]["sparsity/train"] == pytest.approx(0.8)
    assert rows[3]["sparsity/train"] == pytest.approx(0.8)


def test_trained_weights_load_only_when_every_key_matches(tmp_path):
    from vsa2_rl.runtime import build_bundle, load_trained_state, trainable_parameters

    config = _config(tmp_path)
    model = build_bundle(config, torch.device("cpu"), torch.float32).transformer
    trainable_parameters(model, config)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    dropped = next(iter(weights))
    with pytest.raises(ConfigError, match=rf"missing \['{re.escape(dropped)}'\]"):
        load_trained_state(model, {k: v for k, v in weights.items() if k != dropped}, config, "x")
    with pytest.raises(ConfigError, match=r"unexpected \['blocks.99.bias'\]"):
        load_trained_state(model, {**weights, "blocks.99.bias": torch.zeros(1)}, config, "x")
    weights[dropped] = weights[dropped] + 1.0
    load_trained_state(model, weights, config, "x")
    assert torch.equal(model.state_dict()[dropped], weights[dropped])


def test_rollouts_and_evaluations_take_their_own_guidance_and_the_negative_prompt(
    tmp_path, monkeypatch
):
    from vsa2_rl.eval import sweep as sweep_module
    from vsa2_rl.runtime import build_bundle

    used = {"train": [], "eval": []}
    for phase, module in (("train", rollout_module), ("eval", sweep_module)):
        real = module.cfg_velocity

        def recording(model_fn, cond, uncond, scale, low_noise=None, *, phase=phase, real=real):
            used[phase].append((scale, uncond))
            return real(model_fn, cond, uncond, scale, low_noise)

        monkeypatch.setattr(module, "cfg_velocity", recording)
    guided = ["sampler.guidance_scale=2.0", "eval.guidance_scale=4.0"]
    config = _config(
        tmp_path, "train.num_steps=1", "eval.every=1", "eval.num_prompts=2", *guided,
        "sampler.negative_prompt=blurry",
    )  # fmt: skip
    train(config)
    bundle = build_bundle(config, torch.device("cpu"), torch.float32)
    negative = bundle.encode_prompts(["blurry"])
    assert not torch.equal(negative, bundle.encode_prompts([""]))
    for phase, scale in (("train", 2.0), ("eval", 4.0)):
        assert used[phase] and {s for s, _ in used[phase]} == {scale}
        assert all(torch.equal(uncond, negative) for _, uncond in used[phase])


def test_a_negative_prompt_without_guidance_is_refused():
    with pytest.raises(ConfigError, match=r"^sampler\.negative_prompt: is only used by"):
        load_config(FLOW_GRPO_TOY, ["sampler.negative_prompt=blurry"])
    with pytest.raises(ConfigError, match=r"^eval\.guidance_scale: must be >= 1"):
        load_config(FLOW_GRPO_TOY, ["eval.guidance_scale=0.5"])


def test_a_group_shares_its_steps_before_the_window_and_branches_at_it(tmp_path, monkeypatch):
    from vsa2_rl.runtime import build_bundle
    from vsa2_rl.sampling import sample, sigma_schedule

    videos = []

    def recording_reward(batch, prompts, metadata):
        videos.append(batch.clone())
        return brightness(batch, prompts, metadata)

    monkeypatch.setattr(sys.modules[__name__], "recorded_reward", recording_reward, raising=False)
    config = _config(
        tmp_path, "train.num_steps=1", "sampler.sde_window=[1,3]", "rl.group_size=3",
        "sampler.same_noise_per_group=true",
        "rewards.functions=[{name: 'test_trainer:recorded_reward'}]",
    )  # fmt: skip
    train(config)
    (video,) = videos
    # reference: every sample integrated on its own over the whole schedule, same seeds
    bundle = build_bundle(config, torch.device("cpu"), torch.float32)
    bundle.sparsity_state.sparsity = config.sparsity.train
    shape = bundle.latent_shape(config.model.num_frames, config.model.height, config.model.width)
    noise = rollout_module.initial_noise(
        config.sampler, config.seed, config.rl.group_size, 1, shape, list(range(6))
    )
    prompts = [load_prompts(config)[i] for i in _prompt_indices(config)]
    expected = []
    for i in range(6):
        emb = bundle.encode_prompts([prompts[i]])
        generator = torch.Generator().manual_seed(rollout_module.sample_seed(config.seed + 1, 1, i))
        trajectory = sample(
            lambda x, s, emb=emb: bundle.velocity(x, s, emb), noise[i : i + 1],
            sigma_schedule(config.sampler.num_steps), kind="sde", noise_level=0.7,
            sde_window=(1, 3), generator=[generator],
        )  # fmt: skip
        expected.append(bundle.decode(trajectory.latents[-1]))
    assert rel_rms(video, torch.cat(expected)) < 1e-5
    assert (video[0] - video[1]).abs().max() > 1e-3  # the group branched
    # 2 groups x 1 shared step + 6 samples x 2 steps of their own, not 6 x 3
    assert _rows(config.out_dir)[-1]["perf/rollout_evals"] == 2 * 1 + 6 * 2


def _prompt_indices(config):
    from vsa2_rl.rl.grpo import GroupedPromptSampler

    sampler = GroupedPromptSampler(
        len(load_prompts(config)), config.rl.group_size,
        config.rl.prompts_per_step, seed=config.seed,
    )  # fmt: skip
    return sampler.batch(0).prompt_indices


def rel_rms(a, b):
    return float((a - b).double().pow(2).mean().sqrt() / b.double().pow(2).mean().sqrt())


@pytest.mark.slow
def test_the_moving_window_is_drawn_per_step_within_its_range(tmp_path, monkeypatch):
    windows = []
    real_sample = rollout_module.sample

    def recording_sample(velocity_fn, noise, sigmas, **kwargs):
        trajectory = real_sample(velocity_fn, noise, sigmas, **kwargs)
        windows.append(torch.nonzero(trajectory.stochastic).flatten().tolist())
        return trajectory

    monkeypatch.setattr(rollout_module, "sample", recording_sample)
    moving = ["sampler.num_steps=6", "sampler.sde_window_size=2", "sampler.sde_window_range=[1,5]"]
    for name in ("first", "again"):
        config = _config(tmp_path, "train.num_steps=6", "sampler.sde_window=null", *moving,
                         name=name)  # fmt: skip
        train(config)
    drawn = [tuple(w) for w in windows]  # one rollout chunk a step, no shared prefix
    first, again = drawn[:6], drawn[6:]
    assert len(set(first)) > 1 and again == first  # drawn anew each step, the same each run
    assert all(len(w) == 2 and w[1] == w[0] + 1 and w[0] >= 1 and w[1] < 5 for w in first)


def test_clip_ranges_are_checked():
    with pytest.raises(ConfigError, match=r"^rl\.clip_range: must be in \(0, 1\)"):
        load_config(FLOW_GRPO_TOY, ["rl.clip_range=1.5"])
    with pytest.raises(ConfigError, match=r"^rl\.clip_range_high: must be > 0"):
        load_config(FLOW_GRPO_TOY, ["rl.clip_range_high=0"])
    with pytest.raises(ConfigError, match=r"^rl\.clip_range_low: must be in \(0, 1\)"):
        load_config(FLOW_GRPO_TOY, ["rl.clip_range_low=1.5"])


def test_each_clip_side_takes_its_own_range_or_clip_range(tmp_path, monkeypatch):
    seen = []
    original = update_module.grpo_loss

    def recording_loss(*args, **kwargs):
        seen.append((kwargs["clip_range"], kwargs["clip_range_high"]))
        return original(*args, **kwargs)

    monkeypatch.setattr(update_module, "grpo_loss", recording_loss)
    for name, extra, bounds in (
        ("low", ["rl.clip_range_low=0.3"], (0.3, 0.05)),
        ("high", ["rl.clip_range_high=0.28"], (0.05, 0.28)),
        ("both", ["rl.clip_range_low=0.1", "rl.clip_range_high=0.4"], (0.1, 0.4)),
    ):
        seen.clear()
        train(_config(tmp_path, "train.num_steps=1", "rl.clip_range=0.05", *extra, name=name))
        assert seen and set(seen) == {bounds}, name


def test_moving_window_settings_are_checked():
    for overrides, key in (
        (["sampler.sde_window_range=[0,4]"], "sampler.sde_window_range"),
        (["sampler.sde_window=[0,2]", "sampler.sde_window_size=2"], "sampler.sde_window"),
        (
            ["sampler.sde_window_size=5", "sampler.sde_window_range=[0,4]"],
            "sampler.sde_window_size",
        ),
        (
            ["sampler.sde_window_size=1", "sampler.sde_window_range=[3,1]"],
            "sampler.sde_window_range",
        ),
    ):
        with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: "):
            load_config(
                FLOW_GRPO_TOY, ["sampler.num_steps=8", "sampler.sde_window=null", *overrides]
            )


def test_trackers_get_the_config_and_captioned_eval_videos(tmp_path, monkeypatch):
    calls = {"init": [], "log": []}

    class FakeVideo:
        def __init__(self, path, caption, format):
            self.path, self.caption = path, caption

    class FakeRun:
        def log(self, data, step):
            calls["log"].append((step, data))

        def finish(self):
            pass

    def init(**kwargs):
        calls["init"].append(kwargs)
        return FakeRun()

    fake = type(sys)("wandb")
    fake.init, fake.Video = init, FakeVideo
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # find_spec("wandb") works
    monkeypatch.setitem(sys.modules, "wandb", fake)
    config = _config(
        tmp_path, "train.num_steps=1", "eval.every=1", "eval.num_prompts=2",
        "logging.report_to=[wandb]",
    )  # fmt: skip
    train(config)
    (init_kwargs,) = calls["init"]
    assert init_kwargs["config"]["rl"]["group_size"] == 2  # the whole resolved config
    assert init_kwargs["config"]["sampler"]["num_steps"] == 3
    videos = [(step, data["eval/videos"]) for step, data in calls["log"] if "eval/videos" in data]
    assert [step for step, _ in videos] == [0, 1]
    rows = {row["step"]: row for row in _rows(config.out_dir)}
    for step, video in videos:
        assert os.path.isfile(video.path) and video.path.endswith(f"eval_step_{step}.gif")
        values = [
            float(re.search(r" brightness ([-0-9.]+)", line)[1])
            for line in video.caption.splitlines()
        ]
        assert len(values) == 2  # one caption line per video, its reward in it
        assert sum(values) / 2 == pytest.approx(rows[step]["eval/reward"], abs=2e-3)


def test_kl_as_reward_penalty_is_the_log_ratio_to_the_reference(tmp_path, monkeypatch):
    """rl.kl_mode=reward with a reference that differs from the policy (velocity 0): each
    sample's penalty is the sum over the stochastic steps of log p - log p_ref of the transition
    it drew, with log p_ref the closed-form Gaussian of the reference's SDE step written out
    below, and the reward it trains on is the reward minus kl_beta times the penalty."""

    @contextlib.contextmanager
    def zero_velocity_reference(reference):
        yield SimpleNamespace(velocity=lambda latents, sigma, text_emb: torch.zeros_like(latents))

    recorded = []
    real_penalty = update_module.FlowGRPOUpdate.kl_penalty

    def recording_penalty(rule, chunk, stochastic):
        penalty = real_penalty(rule, chunk, stochastic)
        sigmas = torch.as_tensor(rule.sampler.sigmas).double()
        recorded.append((sigmas, chunk.latents.double(), chunk.log_probs.double(), stochastic))
        recorded[-1] += (penalty.clone(),)
        return penalty

    monkeypatch.setattr(policy_module.ReferencePolicy, "active", zero_velocity_reference)
    monkeypatch.setattr(update_module.FlowGRPOUpdate, "kl_penalty", recording_penalty)
    beta = 0.5
    config = _config(
        tmp_path, "train.num_steps=1", f"rl.kl_beta={beta}", "rl.kl_mode=reward",
        "sampler.kind=sde",
    )  # fmt: skip
    train(config)
    row = _rows(config.out_dir)[-1]

    a = config.sampler.noise_level
    penalties, expected = [], []
    for sigmas, latents, log_probs, stochastic, penalty in recorded:
        ratio = torch.zeros(latents.shape[1], dtype=torch.float64)
        steps = stochastic.nonzero().flatten().tolist()
        assert steps == [0, 1]  # sampler.sde_window=[0,2]
        for j in steps:
            s, s_next = float(sigmas[j]), float(sigmas[j + 1])
            x, x_next = latents[j], latents[j + 1]
            # Flow-GRPO's SDE step at velocity 0: eps_hat = x, so the mean is
            # x + g^2 / (2 s) * x * dt and the std g * sqrt(-dt), g = a * sqrt(s / (1 - s))
            # (1 - s_next in the root at s = 1, the sampler's convention there)
            dt = s_next - s
            g2 = a**2 * s / (1.0 - (s_next if s >= 1.0 else s))
            mean = x * (1.0 + g2 / (2.0 * s) * dt)
            var = g2 * -dt
            log_ref = -((x_next - mean) ** 2) / (2 * var) - 0.5 * math.log(2 * math.pi * var)
            ratio += log_probs[j] - log_ref.flatten(1).mean(dim=1)
        penalties.append(penalty)
        expected.append(ratio)
    penalty, expected = torch.cat(penalties).double(), torch.cat(expected)
    assert expected.abs().min() > 0.1  # the policy is not the reference
    torch.testing.assert_close(penalty, expected, rtol=1e-4, atol=1e-4)
    assert row["train/kl_penalty"] == pytest.approx(expected.mean().item(), rel=1e-4)
    # the reward the advantages come from: brightness - kl_beta * penalty
    penalized = row["reward/brightness"] - beta * expected.mean().item()
    assert row["reward/mean"] == pytest.approx(penalized, rel=1e-4, abs=1e-5)
    with pytest.raises(ConfigError, match=r"^rl\.kl_mode: 'reward' .* rewards\.aggregation"):
        load_config(FLOW_GRPO_TOY, ["rl.kl_mode=reward", "rewards.aggregation=advantage"])


def test_sequence_parallel_size_must_divide_the_processes(tmp_path):
    config = _config(tmp_path, "parallel.sequence_parallel_size=2")
    with pytest.raises(ConfigError, match=r"^parallel\.sequence_parallel_size: 2 must divide"):
        train(config)
    assert not os.path.exists(config.out_dir)
    with pytest.raises(ConfigError, match=r"^parallel\.sequence_parallel_size: must be >= 1"):
        load_config(FLOW_GRPO_TOY, ["parallel.sequence_parallel_size=0"])


def test_a_subclass_overrides_a_phase_and_the_loop_uses_it(tmp_path):
    """RLTrainer's phases are the places to override: a ``score`` that adds the rollouts' mean
    brightness to its metrics logs it in metrics.jsonl, and an ``update`` that trains nothing
    (its metrics logged too) leaves the checkpointed weights at the start's (compared with a
    plain run that changes them)."""
    from vsa2_rl.rl.trainer import RLTrainer

    seen = []

    class Recording(RLTrainer):
        def score(self, step, rollouts):
            scores = super().score(step, rollouts)
            seen.append((step, rollouts.videos.mean().item()))
            return scores._replace(metrics={**scores.metrics, "train/brightness": seen[-1][1]})

        def update(self, step, rollouts, scores):
            return {"train/frozen_advantages": len(scores.advantages)}

    config = _config(tmp_path, "train.num_steps=2", name="frozen")
    Recording(config).train()
    rows = _rows(config.out_dir)
    assert [(row["step"], row["train/brightness"]) for row in rows] == seen
    assert [step for step, _ in seen] == [1, 2]
    per_rank = config.rl.prompts_per_step * config.rl.group_size
    assert [row["train/frozen_advantages"] for row in rows] == [per_rank] * 2
    from vsa2_rl.runtime import build_bundle

    initial = build_bundle(config, torch.device("cpu"), torch.float32).transformer.state_dict()
    frozen = _weights(config.out_dir)
    assert frozen and all(torch.equal(frozen[name], initial[name]) for name in frozen)
    trained = _config(tmp_path, "train.num_steps=2", name="trained")
    train(trained)
    changed = _weights(trained.out_dir)
    assert any(not torch.equal(changed[name], initial[name]) for name in changed)
