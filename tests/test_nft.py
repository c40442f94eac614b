"""DiffusionNFT (rl.algorithm=nft): the loss against closed forms and a float64 hand
computation, reward -> r, the old policy's soft update and swap, its config keys, and the toy
trainer end to end (weights change, metrics logged, resume equals an uninterrupted run)."""

import dataclasses
import json
import math
import os
from types import SimpleNamespace

import pytest
import torch
from test_trainer import TINY as TRAINER_TINY

from vsa2_rl.cli import main
from vsa2_rl.config import ConfigError, NFTConfig, load_config
from vsa2_rl.rl import engines
from vsa2_rl.rl import nft as nft_module
from vsa2_rl.rl import rollout as rollout_module
from vsa2_rl.rl import trainer as trainer_module
from vsa2_rl.rl.checkpoint import load_checkpoint
from vsa2_rl.rl.grpo import GroupedPromptSampler, group_advantages
from vsa2_rl.rl.nft import OldPolicy, implicit_policies, nft_loss, optimality_probability
from vsa2_rl.rl.run_folder import RunFolder
from vsa2_rl.rl.trainer import train
from vsa2_rl.runtime import build_bundle, load_prompts

FLOW_GRPO_TOY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flow_grpo_toy.yaml")

TINY = [
    *TRAINER_TINY,
    "rewards.functions=[{name: 'test_trainer:brightness', weight: 1.0}]",
    "rl.algorithm=nft",
]


def _case(batch=3, shape=(2, 5), dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    v_theta, v_old, target = (torch.randn(batch, *shape, generator=gen, dtype=dtype) for _ in "abc")
    sigma = torch.rand(batch, generator=gen, dtype=dtype) * 0.8 + 0.1
    return v_theta.requires_grad_(True), v_old, target, sigma


def _flow_matching_grad(velocity, target, sigma, adaptive):
    """Gradient of plain flow matching (velocity MSE, or the self-normalised x0 regression)
    w.r.t. the velocity, by autograd on a loss written out here."""
    velocity = velocity.detach().clone().requires_grad_(True)
    error = velocity - target
    if adaptive:
        x0_error = sigma[:, None, None] * error
        loss = x0_error.square().mean((1, 2)) / x0_error.detach().abs().mean((1, 2))
    else:
        loss = error.square().mean((1, 2))
    (grad,) = torch.autograd.grad(loss.sum(), velocity)
    return grad


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_with_r_one_the_gradient_is_flow_matching_at_the_positive_policy(adaptive, beta):
    v_theta, v_old, target, sigma = _case()
    loss = nft_loss(v_theta, v_old, target, sigma, torch.ones(3), beta=beta,
                    adaptive_weighting=adaptive)  # fmt: skip
    (grad,) = torch.autograd.grad(loss.sum(), v_theta)
    positive = (1 - beta) * v_old + beta * v_theta.detach()
    torch.testing.assert_close(grad, _flow_matching_grad(positive, target, sigma, adaptive))
    n = positive[0].numel()
    if adaptive:  # closed form: 2 sigma (v+ - target) / (n mean|v+ - target|)
        mean_abs = (positive - target).abs().mean((1, 2), keepdim=True)
        closed = 2 * sigma[:, None, None] * (positive - target) / (n * mean_abs)
    else:
        closed = 2 * (positive - target) / n
    torch.testing.assert_close(grad, closed)


@pytest.mark.parametrize("adaptive", [False, True])
def test_with_r_zero_the_gradient_is_minus_flow_matching_at_the_negative_policy(adaptive):
    v_theta, v_old, target, sigma = _case(seed=1)
    beta = 0.3
    loss = nft_loss(v_theta, v_old, target, sigma, torch.zeros(3), beta=beta,
                    adaptive_weighting=adaptive)  # fmt: skip
    (grad,) = torch.autograd.grad(loss.sum(), v_theta)
    negative = (1 + beta) * v_old - beta * v_theta.detach()
    torch.testing.assert_close(grad, -_flow_matching_grad(negative, target, sigma, adaptive))


def test_at_the_old_policy_a_neutral_sample_has_no_gradient():
    _, v_old, target, sigma = _case(seed=2)
    v_theta = v_old.clone().requires_grad_(True)
    loss = nft_loss(v_theta, v_old, target, sigma, torch.full((3,), 0.5), beta=1.0)
    (grad,) = torch.autograd.grad(loss.sum(), v_theta)
    assert grad.abs().max() < 1e-7


def _hand_loss_and_grad(v_theta, v_old, target, sigma, r, beta):
    """The adaptive-weighting NFT loss per sample and d(sum of losses)/d(v_theta), element by
    element in python floats (float64)."""
    losses, grads = [], []
    for vt, vo, tg, s, ri in zip(v_theta, v_old, target, sigma, r, strict=True):
        vt, vo, tg = vt.flatten().tolist(), vo.flatten().tolist(), tg.flatten().tolist()
        n = len(vt)
        e_pos = [s * ((1 - beta) * o + beta * t - g) for t, o, g in zip(vt, vo, tg, strict=True)]
        e_neg = [s * ((1 + beta) * o - beta * t - g) for t, o, g in zip(vt, vo, tg, strict=True)]
        m_pos, m_neg = sum(map(abs, e_pos)) / n, sum(map(abs, e_neg)) / n
        l_pos = sum(e * e for e in e_pos) / n / m_pos
        l_neg = sum(e * e for e in e_neg) / n / m_neg
        losses.append((ri * l_pos + (1 - ri) * l_neg) / beta)
        # d e_pos / d v_theta = s beta, d e_neg / d v_theta = -s beta (weights are constants)
        grads.append([
            (ri * 2 * ep * s * beta / (n * m_pos) - (1 - ri) * 2 * en * s * beta / (n * m_neg))
            / beta
            for ep, en in zip(e_pos, e_neg, strict=True)
        ])  # fmt: skip
    return losses, grads


def test_loss_and_gradient_equal_a_float64_hand_computation():
    v_theta, v_old, target, sigma = _case(batch=2, shape=(2, 3), dtype=torch.float64, seed=3)
    r, beta = torch.tensor([0.8, 0.25], dtype=torch.float64), 0.4
    loss = nft_loss(v_theta, v_old, target, sigma, r, beta=beta)
    (grad,) = torch.autograd.grad(loss.sum(), v_theta)
    hand_loss, hand_grad = _hand_loss_and_grad(
        v_theta.detach(), v_old, target, sigma.tolist(), r.tolist(), beta
    )
    # the loss works in float32 (the trainer's precision): agreement to float32 rounding
    torch.testing.assert_close(loss.double(), torch.tensor(hand_loss, dtype=torch.float64),
                               rtol=1e-5, atol=1e-7)  # fmt: skip
    expected = torch.tensor(hand_grad, dtype=torch.float64).reshape(grad.shape)
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-7)


def test_implicit_policies_average_to_the_old_one():
    v_theta, v_old, _, _ = _case()
    positive, negative = implicit_policies(v_theta, v_old, beta=0.7)
    torch.testing.assert_close((positive + negative) / 2, v_old)
    torch.testing.assert_close(positive - negative, 2 * 0.7 * (v_theta - v_old))


def test_reward_to_optimality_probability_by_hand():
    advantages = torch.tensor([-10.0, -5.0, -2.5, 0.0, 1.0, 5.0, 7.5])
    r = optimality_probability(advantages, scale=5.0)
    torch.testing.assert_close(r, torch.tensor([0.0, 0.0, 0.25, 0.5, 0.6, 1.0, 1.0]))
    # rewards of two groups through group advantages (batch std, the paper's global_std):
    # rewards 1, 3 | 2, 10: group means 2 and 6, population std of all four = sqrt(12.5)
    rewards, groups = torch.tensor([1.0, 3.0, 2.0, 10.0]), torch.tensor([0, 0, 1, 1])
    advantages, _ = group_advantages(rewards, groups, scale="batch")
    std = (((1 - 4) ** 2 + (3 - 4) ** 2 + (2 - 4) ** 2 + (10 - 4) ** 2) / 4) ** 0.5
    by_hand = [
        0.5 + 0.5 * max(-1.0, min(1.0, a / (std + 1e-4) / 2.0)) for a in (-1.0, 1.0, -4.0, 4.0)
    ]
    torch.testing.assert_close(optimality_probability(advantages, 2.0), torch.tensor(by_hand))
    with pytest.raises(ValueError, match="scale must be > 0"):
        optimality_probability(advantages, 0.0)


def test_old_policy_eta_schedule_of_the_paper():
    paper = NFTConfig()  # eta_i = min(0.001 i, 0.5)
    assert [paper.eta(i) for i in (1, 2, 250)] == pytest.approx([0.001, 0.002, 0.25])
    assert paper.eta(500) == pytest.approx(0.5) and paper.eta(10_000) == 0.5
    ocr = NFTConfig(eta_rate=0.0075, eta_max=0.999, eta_delay_steps=75)  # the OCR run's
    assert [ocr.eta(i) for i in (1, 75)] == [0.0, 0.0]
    assert ocr.eta(76) == pytest.approx(0.0075) and ocr.eta(300) == 0.999
    assert NFTConfig().timesteps_per_sample(10) == 9 and NFTConfig().timesteps_per_sample(1) == 1


@dataclasses.dataclass
class _Bundle:
    transformer: torch.nn.Module


@pytest.mark.parametrize("copy_model", [False, True], ids=["lora_tensors", "frozen_copy"])
def test_old_policy_soft_update_swap_and_state(copy_model):
    model = torch.nn.Linear(3, 2)
    bundle = _Bundle(model)
    old = OldPolicy(bundle, model, copy_model=copy_model)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    old.soft_update(0.25)
    expected = {n: 0.25 * start[n] + 0.75 * trained[n] for n in start}
    x = torch.randn(4, 3)
    with torch.no_grad(), old.active() as old_bundle:
        out_old = old_bundle.transformer(x)
    torch.testing.assert_close(out_old, torch.nn.functional.linear(x, *expected.values()))
    assert bundle.transformer is model  # the trained model, its weights untouched
    for name, param in model.named_parameters():
        assert torch.equal(param, trained[name])
    state = {n: t.clone() for n, t in old.state_dict().items()}
    fresh = OldPolicy(_Bundle(model), model, copy_model=copy_model)
    fresh.load_state_dict(state)
    for name, value in fresh.state_dict().items():
        torch.testing.assert_close(value, expected[name])
    with pytest.raises(ValueError, match=r"missing \['bias'\]"):
        fresh.load_state_dict({"weight": state["weight"]})


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["rl.algorithm=ppo"], "rl.algorithm: got 'ppo', expected one of flow_grpo, nft"),
        (["rl.algorithm=nft", "nft.beta=0"], "nft.beta: must be > 0"),
        (["rl.algorithm=nft", "nft.beta=nan"], "nft.beta: must be a finite number, got nan"),
        (["rl.algorithm=nft", "nft.advantage_scale=inf"], "nft.advantage_scale: must be a fin"),
        (["rl.algorithm=nft", "nft.eta_max=1.0"], "nft.eta_max: must be in [0, 1)"),
        (["rl.algorithm=nft", "nft.eta_delay_steps=-1"], "nft.eta_delay_steps: must be >= 0"),
        (["rl.algorithm=nft", "nft.timestep_fraction=0"], "nft.timestep_fraction: must be in"),
        (["rl.algorithm=nft", "nft.timestep_sampling=log"], "nft.timestep_sampling: got 'log'"),
        (["rl.algorithm=nft", "nft.sigma_range=[0.9,0.2]"], "nft.sigma_range: must be [low,"),
        (["nft.beta=0.1"], "nft.beta: is only read by rl.algorithm=nft"),
        (["sampler.kind=ode"], "sampler.kind: 'ode' rollouts have no log-probs for Flow-GRPO"),
        (["rl.algorithm=nft", "rl.kl_mode=reward"], "rl.kl_mode: 'reward' needs the log"),
        (["rl.algorithm=nft", "sampler.guidance_scale=3"], "sampler.guidance_scale: with nft."),
        (["rl.algorithm=nft", "nft.guidance=rollouts"], "nft.guidance: rollouts guides the"),
        (["rl.algorithm=nft", "nft.guidance=cfg"], "nft.guidance: got 'cfg', expected one of"),
        (["nft.guidance=anchor"], "nft.guidance: is only read by rl.algorithm=nft"),
        (
            ["rl.algorithm=nft", "sampler.kind=ode", "sampler.same_noise_per_group=true"],
            "sampler.same_noise_per_group: with sampler.noise_level 0 or sampler.kind ode",
        ),
    ],
)
def test_bad_nft_settings_are_one_error_line(overrides, expected, tmp_path, capsys):
    with pytest.raises(ConfigError) as error:
        load_config(FLOW_GRPO_TOY, overrides)
    assert str(error.value).startswith(expected) and "\n" not in str(error.value)
    argv = ["train", "--config", FLOW_GRPO_TOY, *overrides, f"out_dir={tmp_path / 'run'}"]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {error.value}"]
    assert not (tmp_path / "run").exists()


def test_nft_defaults_are_the_papers():
    config = load_config(FLOW_GRPO_TOY, ["rl.algorithm=nft", "sampler.kind=ode"])
    assert config.nft == NFTConfig(
        beta=1.0, advantage_scale=5.0, eta_rate=0.001, eta_max=0.5, eta_delay_steps=0,
        timestep_sampling="schedule", timestep_fraction=0.99, adaptive_weighting=True,
    )  # fmt: skip


def _config(tmp_path, *extra, name="run"):
    return load_config(FLOW_GRPO_TOY, [*TINY, f"out_dir={tmp_path / name}", *extra])


def _rows(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as handle:
        return [json.loads(line) for line in handle]


def _checkpoint(out_dir, step):
    return load_checkpoint(os.path.join(out_dir, "checkpoints", f"step_{step}"))


def _step_inputs(config, bundle, step):
    """The prompts' embeddings and the starting noise of the rollouts of ``step``."""
    prompts = load_prompts(config)
    batch = GroupedPromptSampler(
        len(prompts), config.rl.group_size, config.rl.prompts_per_step, seed=config.seed
    ).batch(step - 1)
    shape = bundle.latent_shape(config.model.num_frames, config.model.height, config.model.width)
    noise = rollout_module.initial_noise(
        config.sampler, config.seed, config.rl.group_size, step, shape,
        list(range(len(batch.group_ids))),
    )  # fmt: skip
    return bundle.encode_prompts([prompts[i] for i in batch.prompt_indices]), noise


def test_an_nft_run_trains_samples_with_the_old_policy_and_logs_its_metrics(tmp_path, monkeypatch):
    first_velocities = []
    real_sample = rollout_module.sample

    def recording_sample(velocity_fn, noise, sigmas, **kwargs):
        first_velocities.append(velocity_fn(noise, sigmas[:1].expand(noise.shape[0])).clone())
        return real_sample(velocity_fn, noise, sigmas, **kwargs)

    passes = []
    real_loss = nft_module.nft_loss

    def recording_loss(v_theta, v_old, target, sigma, r, **kwargs):
        passes.append((target.clone(), sigma.clone()))
        return real_loss(v_theta, v_old, target, sigma, r, **kwargs)

    monkeypatch.setattr(rollout_module, "sample", recording_sample)
    monkeypatch.setattr(nft_module, "nft_loss", recording_loss)
    # eta 0.5 from step 1: the step-2 rollouts come from (theta_0 + theta_1) / 2
    config = _config(
        tmp_path, "train.num_steps=2", "train.checkpoint_every=1", "sampler.kind=ode",
        "nft.eta_rate=0.5",
    )  # fmt: skip
    train(config)
    rows = _rows(config.out_dir)
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        for key in ("loss/policy", "loss/kl", "train/old_deviation", "train/grad_norm",
                    "attn/density", "perf/train_s", "reward/mean"):  # fmt: skip
            assert key in row and row[key] == row[key], key
        assert row["train/r_mean"] == pytest.approx(0.5, abs=1e-6)  # zero-mean advantages
        assert row["train/old_policy_eta"] == 0.5 and row["loss/policy"] > 0
        assert "train/ratio_dev_first" not in row
    assert rows[0]["train/old_deviation"] == 0.0  # theta_old = theta at the first update
    # one chunk of 4 samples, K = floor(0.99 * 3) = 2 levels a step: distinct schedule sigmas
    # (not the final 0) and fresh noise at each level
    assert len(passes) == 4
    (target_a, sigma_a), (target_b, sigma_b) = passes[:2]
    schedule = rollout_module.sigma_schedule(3)[:-1].tolist()
    assert set(sigma_a.tolist() + sigma_b.tolist()) <= set(schedule)
    assert (sigma_a != sigma_b).all() and (target_a - target_b).abs().amin(dim=(1, 2, 3, 4)).gt(
        0
    ).all()
    bundle = build_bundle(config, torch.device("cpu"), torch.float32)
    bundle.sparsity_state.sparsity = 0.9
    start = {k: v.clone() for k, v in bundle.transformer.state_dict().items()}
    step_1 = _checkpoint(config.out_dir, 1)
    changed = [k for k in step_1["model"] if not torch.equal(step_1["model"][k], start[k])]
    assert changed, "no parameter changed after an nft step"
    for name, value in step_1["old_policy"].items():
        torch.testing.assert_close(value, (start[name] + step_1["model"][name]) / 2)
    text_emb, noise = _step_inputs(config, bundle, 2)
    sigma = torch.ones(noise.shape[0])
    bundle.transformer.load_state_dict(step_1["old_policy"], strict=False)
    with torch.no_grad():
        old_velocity = bundle.velocity(noise, sigma, text_emb)
        bundle.transformer.load_state_dict(step_1["model"])
        trained_velocity = bundle.velocity(noise, sigma, text_emb)
    torch.testing.assert_close(first_velocities[1], old_velocity, rtol=1e-5, atol=1e-5)
    assert (first_velocities[1] - trained_velocity).abs().max() > 1e-4


@pytest.mark.parametrize("sampling", ["schedule", "uniform"])
def test_nft_trains_only_at_noise_levels_within_its_sigma_range(sampling, tmp_path, monkeypatch):
    sigmas = []
    real_loss = nft_module.nft_loss

    def recording_loss(v_theta, v_old, target, sigma, r, **kwargs):
        sigmas.extend(sigma.tolist())
        return real_loss(v_theta, v_old, target, sigma, r, **kwargs)

    monkeypatch.setattr(nft_module, "nft_loss", recording_loss)
    config = _config(
        tmp_path, "train.num_steps=2", "sampler.kind=ode", "nft.sigma_range=[0.5,1.0]",
        f"nft.timestep_sampling={sampling}", "nft.timestep_fraction=1.0",
    )  # fmt: skip
    train(config)
    # 2 steps x 4 samples; the 3-step schedule's sigmas are 1, 2/3, 1/3 (and the final 0)
    if sampling == "schedule":  # both levels in the range, each once per sample and step
        assert sorted(sigmas) == pytest.approx(sorted([1.0, 2 / 3] * 8))
    else:  # 3 uniform draws per sample and step, all in the range
        assert len(sigmas) == 24 and min(sigmas) >= 0.5 and max(sigmas) <= 1.0
        assert max(sigmas) - min(sigmas) > 0.1


@pytest.mark.parametrize("group_noise", [False, True])
def test_group_noise_gives_a_groups_samples_the_same_noise_levels_and_noise(group_noise, tmp_path):
    config = _config(tmp_path, "sampler.kind=ode", f"nft.group_noise={str(group_noise).lower()}")
    with RunFolder(config.out_dir) as folder:
        run = trainer_module.RLTrainer(config)
        run.build(folder)
        update = run.update_rule
    # two chunks of 3 and 1 samples; groups 5, 5, 8 | 8 (a group may straddle chunks)
    rollouts = SimpleNamespace(
        chunks=[
            SimpleNamespace(latents=torch.zeros(4, 3)),
            SimpleNamespace(latents=torch.zeros(4, 1)),
        ],
        group_ids=[5, 5, 8, 8],
        global_index=[0, 1, 2, 3],
    )
    keys = nft_module._chunk_draw_keys(rollouts, by_group=config.nft.group_noise)
    draws = [update._draws(1, 0, chunk_keys) for chunk_keys in keys]
    sigmas = torch.cat([d.sigmas for d in draws])
    noises = torch.stack([torch.randn(6, generator=g) for d in draws for g in d.generators])
    same = [torch.equal(noises[a], noises[b]) and torch.equal(sigmas[a], sigmas[b])
            for a, b in ((0, 1), (2, 3))]  # fmt: skip
    assert same == [group_noise, group_noise]
    assert not torch.equal(noises[1], noises[2])  # other groups (or samples): other noise


def test_a_sigma_range_without_schedule_sigmas_is_one_error_line(tmp_path):
    config = _config(tmp_path, "sampler.kind=ode", "nft.sigma_range=[0.7,0.9]")
    with pytest.raises(ConfigError, match=r"^nft.sigma_range: \[0.7, 0.9\] holds none of"):
        train(config)
    assert not os.path.exists(config.out_dir)


def test_an_nft_lora_run_resumes_as_it_would_have_gone_on(tmp_path):
    # LoRA (the old policy as swapped adapter tensors), an SDE sampler and a KL to the reference
    common = ("train.checkpoint_every=1", "model.lora.enabled=true", "rl.kl_beta=0.1",
              "nft.eta_rate=0.3", "nft.timestep_sampling=uniform")  # fmt: skip
    whole = _config(tmp_path, "train.num_steps=2", *common, name="whole")
    train(whole)
    train(_config(tmp_path, "train.num_steps=1", *common, name="part"))
    part = _config(tmp_path, "train.num_steps=2", *common, name="part")
    train(part)
    whole_rows, part_rows = _rows(whole.out_dir), _rows(part.out_dir)
    assert [r["step"] for r in part_rows] == [1, 2]
    assert whole_rows[1]["loss/kl"] > 0  # the adapters moved away from the reference
    for a, b in zip(whole_rows, part_rows, strict=True):
        for key in ("reward/mean", "loss/policy", "loss/kl", "train/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)
    whole_state, part_state = _checkpoint(whole.out_dir, 2), _checkpoint(part.out_dir, 2)
    assert set(whole_state["old_policy"]) == set(whole_state["model"])  # adapters, router, gates
    for entry in ("model", "old_policy"):
        for key, value in whole_state[entry].items():
            torch.testing.assert_close(part_state[entry][key], value, rtol=1e-5, atol=1e-6)
    step_1 = _checkpoint(part.out_dir, 1)
    assert any(
        not torch.equal(step_1["old_policy"][k], whole_state["old_policy"][k])
        for k in step_1["old_policy"]
    )


def _first_gradient(tmp_path, monkeypatch, name, *extra):
    grads = []
    real_finish = engines.finish_update

    def recording_finish(acc, optimizer, params, max_grad_norm, losses):
        grads.append(torch.cat([p.grad.flatten() for p in params if p.grad is not None]))
        return real_finish(acc, optimizer, params, max_grad_norm, losses)

    monkeypatch.setattr(engines, "finish_update", recording_finish)
    config = _config(tmp_path, "train.num_steps=1", "sampler.kind=ode", *extra, name=name)
    train(config)
    (grad,) = grads
    return _rows(config.out_dir)[-1], grad


def test_every_sample_and_level_weighs_the_same_whatever_the_chunking(tmp_path, monkeypatch):
    # 2 groups of 3: chunks of 4 and 2 against one chunk of 6
    group = ("rl.group_size=3",)
    whole, whole_grad = _first_gradient(tmp_path, monkeypatch, "whole", *group,
                                        "rl.train_batch_size=6")  # fmt: skip
    split, split_grad = _first_gradient(tmp_path, monkeypatch, "split", *group,
                                        "rl.train_batch_size=4")  # fmt: skip
    assert split["loss/policy"] == pytest.approx(whole["loss/policy"], rel=1e-5)
    error = (split_grad - whole_grad).norm() / whole_grad.norm()
    assert error < 1e-4, f"relative gradient difference {error:.2e}"


def test_zero3_and_fsdp2_take_nft_with_its_drift_anchors():
    def launcher(zero_stage=None, fsdp_version=None):
        plugin = SimpleNamespace(zero_stage=zero_stage, deepspeed_config={}) if zero_stage else None
        fsdp = SimpleNamespace(fsdp_version=fsdp_version) if fsdp_version else None
        return SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin, fsdp_plugin=fsdp))

    nft = ["rl.algorithm=nft", "model.lora.enabled=true"]
    config = load_config(FLOW_GRPO_TOY, nft)
    engines.check_options(launcher(zero_stage=3), config)
    engines.check_options(launcher(zero_stage=2), config)
    fsdp2 = launcher(fsdp_version=2)
    anchors = (["rl.kl_beta=0.1", "rl.kl_reference=ema"], ["nft.trust_region=0.1"])
    for extra in ([], *anchors):  # LoRA and full fine-tuning, shard by shard
        engines.check_options(fsdp2, load_config(FLOW_GRPO_TOY, [*nft, *extra]))
        engines.check_options(fsdp2, load_config(FLOW_GRPO_TOY, [*nft[:1], *extra]))
    with pytest.raises(ConfigError, match=r"^rl\.kl_beta: the KL reference of full fine-tuning"):
        engines.check_options(fsdp2, load_config(FLOW_GRPO_TOY, [*nft[:1], "rl.kl_beta=0.1"]))


def test_a_checkpoint_from_before_the_algorithm_keys_resumes_at_their_defaults():
    from vsa2_rl.config import check_resume, config_tree

    config = load_config(FLOW_GRPO_TOY, [])
    saved = config_tree(config)
    del saved["rl"]["algorithm"], saved["nft"]  # what a checkpoint of an older version holds
    check_resume(saved, config, "old")
    with pytest.raises(ConfigError, match=r"^rl\.algorithm: changed since the checkpoint"):
        check_resume(saved, load_config(FLOW_GRPO_TOY, ["rl.algorithm=nft"]), "old")


@pytest.mark.parametrize(("mode", "anchored"), [("rollouts", False), ("anchor", True)])
def test_guided_nft_anchors_on_the_velocity_its_setting_names(tmp_path, mode, anchored):
    # At the first update theta_old = theta: anchored on the old policy's conditional velocity
    # (rollouts), v_old is v_theta exactly; anchored on its guided velocity, v_old - v_theta =
    # (w - 1)(v_c - v_u), which a model whose text changes its velocity makes nonzero.
    config = _config(
        tmp_path, "train.num_steps=1", "sampler.kind=ode", f"nft.guidance={mode}",
        "sampler.guidance_scale=3",
    )  # fmt: skip
    train(config)
    (row,) = _rows(config.out_dir)
    assert math.isfinite(row["loss/policy"]) and math.isfinite(row["train/grad_norm"])
    assert (row["train/old_deviation"] > 1e-6) is anchored
    assert anchored or row["train/old_deviation"] == 0.0
