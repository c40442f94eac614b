"""What a toy model draws, scored with the toy task's detector.

:func:`draw_samples` draws videos of prompts, each repeated over seeds, with the library's
sampler (:mod:`vsa2_rl.sampling`: the deterministic ODE, or the SDE steps of the RL rollouts);
:func:`score_samples` turns them into the figures of the toy task's rewards
(:mod:`vsa2_rl.toy.rewards`): shape fidelity, motion score, share of videos moving the prompted
way, share of prompts whose videos both do and do not, and the spread within a prompt's group.
The build reports these after every stage (:mod:`vsa2_rl.toy.build`), as do
``benchmarks/toy_skill.py`` and ``benchmarks/toy_ceiling.py``.
"""

from __future__ import annotations

import torch

from vsa2_rl.rewards import get_reward
from vsa2_rl.sampling import sample, seeded_noise, sigma_schedule
from vsa2_rl.toy.model import ToyBundle


@torch.no_grad()
def draw_samples(
    bundle: ToyBundle,
    prompts: list[str],
    *,
    seeds_per_prompt: int,
    num_steps: int,
    num_frames: int,
    size: int,
    kind: str = "ode",
    noise_level: float = 0.0,
    sde_window: tuple[int, int] | None = None,
    seed: int = 0,
) -> torch.Tensor:
    """Videos [len(prompts) * seeds_per_prompt, T, 3, H, W] of each prompt repeated
    ``seeds_per_prompt`` times (prompt-major), at the bundle's current sparsity: the ODE by
    default, or the SDE steps of the RL rollouts (``kind``, ``noise_level``, ``sde_window``).
    Video i starts from ``seeded_noise`` of ``seed * len(videos) + i``; the SDE noise is drawn
    from ``seed``."""
    repeated = [p for p in prompts for _ in range(seeds_per_prompt)]
    first = seed * len(repeated)
    seeds = list(range(first, first + len(repeated)))
    noise = seeded_noise(bundle.latent_shape(num_frames, size, size), seeds)
    text_emb = bundle.encode_prompts(repeated)
    sigmas = sigma_schedule(num_steps)
    generator = torch.Generator(bundle.device).manual_seed(seed)
    videos = []
    for start in range(0, len(repeated), 64):
        emb = text_emb[start : start + 64]
        trajectory = sample(
            lambda x, sigma, emb=emb: bundle.velocity(x.to(bundle.dtype), sigma, emb),
            noise[start : start + 64].to(bundle.device),
            sigmas,
            kind=kind,
            noise_level=noise_level,
            sde_window=sde_window,
            generator=generator,
        )
        videos.append(bundle.decode(trajectory.latents[-1]).float().cpu())
    return torch.cat(videos)


def score_samples(videos: torch.Tensor, prompts: list[str], seeds_per_prompt: int) -> dict:
    """The toy task's detector figures (:mod:`vsa2_rl.toy.rewards`) of :func:`draw_samples`'
    videos of ``prompts``.

    ``shape_fidelity``: share of frames with one blob of the prompted colour and about the
    prompted shape's area; ``prompt_motion``: mean motion score; ``motion_match``: share of
    videos whose motion scores >= 0.9 (right direction, about the right speed);
    ``direction_match``: share of videos whose shape moves the prompted way
    (``prompt_direction``); ``direction_mixed``: share of prompts whose videos include both one
    moving the prompted way and one that does not (a group GRPO can learn from);
    ``group_std``: standard deviation of the motion score among a prompt's videos, averaged over
    prompts (the spread GRPO's group advantages feed on; 0 with one video a prompt);
    ``speed_error``: mean relative speed error, 1 - ``prompt_speed`` (0 at the asked speed, 1
    for a static shape).
    """
    repeated = [p for p in prompts for _ in range(seeds_per_prompt)]
    fidelity = get_reward("shape_fidelity")(videos, repeated)
    motion = get_reward("prompt_motion")(videos, repeated)
    direction = get_reward("prompt_direction")(videos, repeated).view(len(prompts), -1)
    mixed = (direction.amax(dim=1) > 0.5) & (direction.amin(dim=1) < 0.5)
    groups = motion.view(len(prompts), -1)
    group_spread = groups.std(dim=1).mean().item() if seeds_per_prompt > 1 else 0.0
    return {
        "shape_fidelity": fidelity.mean().item(),
        "prompt_motion": motion.mean().item(),
        "motion_match": (motion >= 0.9).float().mean().item(),
        "direction_match": direction.mean().item(),
        "direction_mixed": mixed.float().mean().item(),
        "group_std": group_spread,
        "speed_error": 1.0 - get_reward("prompt_speed")(videos, repeated).mean().item(),
    }
