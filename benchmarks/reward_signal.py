"""How many rollouts a GRPO step needs before its gradient points somewhere: the signal-to-noise
ratio of the policy gradient of a run's config, measured by split-half agreement.

One batch of ``--prompts`` x ``rl.group_size`` rollouts is sampled exactly as the trainer
samples them (SDE, window, rollout sparsity), scored by the config's rewards and turned into
group-relative advantages. For every stochastic step the policy gradient
``mean_i A_i * grad log p_i`` (the first-minibatch GRPO gradient, where every ratio is 1) is
formed separately on two halves of the groups. If a half's gradient is ``s + e`` with a shared
signal ``s`` and independent noise ``e`` of per-sample variance ``sigma^2``, their cosine is
``|s|^2 / (|s|^2 + sigma^2 / n_half)``, so ``rho = n_half * (1 - cos) / cos`` is the per-sample
noise-to-signal ratio: a run accumulates a gradient with signal-to-noise 1 only after about
``rho`` trained samples of that step. The same is measured with random advantages (what the
``random`` control reward trains on), whose cosine must scatter around 0.

With ``rl.algorithm=nft`` the gradient is DiffusionNFT's at its first pass (theta_old =
theta), per noise level of the schedule within ``nft.sigma_range``: the clean rollouts are
noised again at that sigma (one noise per sample, or per group with ``nft.group_noise``) and
the gradient of the NFT loss with ``r`` from the advantages is formed on each half.

    python benchmarks/reward_signal.py --config configs/default.yaml --prompts 64 \
        device=cuda model.dtype=float32 sampler.noise_level=1.0
"""

from __future__ import annotations

import argparse
import math

import torch

from vsa2_rl.config import load_config
from vsa2_rl.rewards import RewardMixer
from vsa2_rl.rl.grpo import group_advantages
from vsa2_rl.rl.rollout import initial_noise
from vsa2_rl.runtime import (
    build_bundle,
    load_prompts,
    resolve_device,
    resolve_dtype,
    trainable_parameters,
)
from vsa2_rl.sampling import sample, sigma_schedule, step_log_prob


def _rollouts(config, bundle, prompts: list[str], seed: int):
    """Latents of one trainer-like rollout batch, its text embeddings and decoded videos."""
    samp = config.sampler
    shape = bundle.latent_shape(config.model.num_frames, config.model.height, config.model.width)
    noise = initial_noise(  # as the trainer's step
        samp, config.seed, config.rl.group_size, seed, shape, list(range(len(prompts)))
    )
    generators = [
        torch.Generator(device=bundle.device).manual_seed(seed * 100_019 + i)
        for i in range(len(prompts))
    ]
    sigmas = sigma_schedule(samp.num_steps, samp.shift)
    bundle.sparsity_state.sparsity = config.sparsity.train
    latents, embeddings, videos, stochastic = [], [], [], None
    for start in range(0, len(prompts), 64):
        part = slice(start, start + 64)
        emb = bundle.encode_prompts(prompts[part])
        trajectory = sample(
            lambda x, sigma, emb=emb: bundle.velocity(x, sigma, emb),
            noise[part].to(bundle.device),
            sigmas,
            kind=samp.kind,
            noise_level=samp.noise_level,
            sde_window=tuple(samp.sde_window) if samp.sde_window else None,
            generator=generators[part],
        )
        latents.append(trajectory.latents)
        embeddings.append(emb)
        videos.append(bundle.decode(trajectory.latents[-1]).float().cpu())
        stochastic = trajectory.stochastic
    return torch.cat(latents, 1), torch.cat(embeddings), torch.cat(videos), stochastic, sigmas


def _half_gradient(config, bundle, params, latents, emb, advantages, index, j, sigmas):
    """Flattened ``mean_i A_i grad log p_i(step j)`` over the samples ``index``."""
    samp = config.sampler
    for p in params:
        p.grad = None
    for start in range(0, len(index), config.rl.train_batch_size):
        rows = index[start : start + config.rl.train_batch_size]
        x, x_next = latents[j, rows], latents[j + 1, rows]
        sigma = torch.full((len(rows),), float(sigmas[j]), device=x.device)
        velocity = bundle.velocity(x.to(bundle.dtype), sigma, emb[rows])
        log_prob = step_log_prob(
            velocity,
            x,
            x_next,
            float(sigmas[j]),
            float(sigmas[j + 1]),
            samp.kind,
            samp.noise_level,
        )[0]
        (advantages[rows] * log_prob).sum().div(len(index)).backward()
    return torch.cat([p.grad.flatten() for p in params if p.grad is not None])


def _nft_half_gradient(config, bundle, params, x0, emb, r, index, sigma, noise):
    """Flattened gradient of the mean NFT loss over the samples ``index`` at noise level
    ``sigma``, with v_old = v_theta (the first pass of a step)."""
    from vsa2_rl.rl.nft import nft_loss

    for p in params:
        p.grad = None
    for start in range(0, len(index), config.rl.train_batch_size):
        rows = index[start : start + config.rl.train_batch_size]
        sigmas = torch.full((len(rows),), sigma, device=x0.device)
        x = (1.0 - sigma) * x0[rows] + sigma * noise[rows]
        v_theta = bundle.velocity(x.to(bundle.dtype), sigmas, emb[rows]).float()
        loss = nft_loss(
            v_theta, v_theta.detach(), noise[rows] - x0[rows], sigmas, r[rows],
            beta=config.nft.beta, adaptive_weighting=config.nft.adaptive_weighting,
        )  # fmt: skip
        loss.sum().div(len(index)).backward()
    return torch.cat([p.grad.flatten() for p in params if p.grad is not None])


def _gradient_pairs(config, bundle, params, latents, emb, stochastic, sigmas, group_ids, seed):
    """Per trained step or noise level: (label step, sigma, gradient of a half given advantages
    and a half's sample indices)."""
    if config.rl.algorithm != "nft":
        for j in torch.nonzero(stochastic).flatten().tolist():
            yield (
                j,
                float(sigmas[j]),
                lambda adv, half, j=j: _half_gradient(
                    config, bundle, params, latents, emb, adv, half, j, sigmas
                ),
            )
        return
    from vsa2_rl.rl.nft import optimality_probability

    low, high = config.nft.sigma_range
    x0 = latents[-1]
    keys = group_ids if config.nft.group_noise else torch.arange(len(group_ids))
    generator = torch.Generator().manual_seed(seed + 17)
    per_key = torch.randn(int(keys.max()) + 1, *x0.shape[1:], generator=generator)
    noise = per_key[keys].to(x0.device)
    for j, sigma in enumerate(sigmas[:-1].tolist()):
        if low <= sigma <= high:
            yield j, sigma, lambda adv, half, sigma=sigma: _nft_half_gradient(
                config, bundle, params, x0, emb,
                optimality_probability(adv, config.nft.advantage_scale), half, sigma, noise,
            )  # fmt: skip


def measure(config, num_prompts: int, seed: int) -> list[dict]:
    """One row per stochastic step: cosines and noise-to-signal ratios, real and random."""
    device = resolve_device(config.device)
    bundle = build_bundle(config, device, resolve_dtype(config.model.dtype, device))
    params = trainable_parameters(bundle.transformer, config)
    group = config.rl.group_size
    train = load_prompts(config, "train")
    prompts = [train[(seed * 7 + i) % len(train)] for i in range(num_prompts) for _ in range(group)]
    latents, emb, videos, stochastic, sigmas = _rollouts(config, bundle, prompts, seed)
    metadata = [
        {"prompt_index": i // group, "step": 0, "sample_seed": i} for i in range(len(prompts))
    ]
    rewards = RewardMixer.from_config(config.rewards)(videos, prompts, metadata).total
    group_ids = torch.arange(len(prompts)) // group
    scale, clip = config.rl.scale_rewards, config.rl.adv_clip
    real = group_advantages(rewards.float(), group_ids, scale=scale, clip=clip)[0]
    noise = torch.randn(len(prompts), generator=torch.Generator().manual_seed(seed))
    control = group_advantages(noise, group_ids, scale=scale, clip=clip)[0]
    halves = [torch.nonzero(group_ids % 2 == h).flatten().to(device) for h in (0, 1)]
    n_half = len(halves[0])
    rows = []
    pairs = _gradient_pairs(
        config, bundle, params, latents, emb, stochastic, sigmas, group_ids, seed
    )
    for j, sigma, half_gradient in pairs:
        row = {
            "step": j,
            "sigma": sigma,
            "reward_mean": rewards.mean().item(),
            "reward_group_std": rewards.view(-1, group).std(1, correction=0).mean().item(),
        }
        for name, adv in (("real", real), ("random", control)):
            adv = adv.to(device)
            g0, g1 = (half_gradient(adv, h) for h in halves)
            cos = torch.nn.functional.cosine_similarity(g0, g1, dim=0).item()
            row[f"cos_{name}"] = cos
            row[f"rho_{name}"] = n_half * (1 - cos) / cos if cos > 0 else math.inf
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--prompts", type=int, default=64, help="groups in the batch (even)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--label", default="", help="name of this setting in the table")
    parser.add_argument("--out", default=None, help="append the table rows to this markdown file")
    parser.add_argument("overrides", nargs="*", help="config overrides (key=value)")
    args = parser.parse_args()
    if args.prompts < 2 or args.prompts % 2:
        parser.error(f"--prompts must be even and >= 2, got {args.prompts}")
    config = load_config(args.config, args.overrides)
    lines = []
    for row in measure(config, args.prompts, args.seed):
        lines.append(
            f"| {args.label or ' '.join(args.overrides)} | {row['step']} | {row['sigma']:.3f} | "
            f"{row['reward_mean']:.3f} | {row['reward_group_std']:.3f} | {row['cos_real']:.3f} | "
            f"{row['rho_real']:.0f} | {row['cos_random']:.3f} | {row['rho_random']:.0f} |"
        )
    header = (
        "| setting | step | sigma | reward | group sd | cos real | samples for SNR 1 | "
        "cos random | samples (random) |\n|---|---|---|---|---|---|---|---|---|"
    )
    print(header, *lines, sep="\n")
    if args.out:
        with open(args.out, "a", encoding="utf-8") as handle:
            handle.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
