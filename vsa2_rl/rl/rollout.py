"""Rollouts: one RL step's videos with their trajectories and log-probs (a part of the trainer).

:class:`RolloutSampler` runs the ``sampler`` section: SDE (or CPS, ODE) sampling of this rank's
prompts (vsa2_rl.sampling), in chunks of ``rl.train_batch_size`` that the update reuses (so
its first probability ratio is 1); the SDE window is fixed or drawn per step, and with one noise
per group the steps before the window run once per group, which branches at the window
(Flow-GRPO-Fast). Every random draw is a pure function of (seed, step, global sample index), so
any number of ranks and a resumed run draw the same. Conditioning, sampling and decoding run in
the profiler ranges ``vsa2_rl/rollout/{text_encode,sample,decode}`` (text_encode includes an
image-to-video prompt's condition image), which benchmarks/profile_rl_iteration.py reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import record_function

from vsa2_rl.config import SamplerConfig
from vsa2_rl.models.conditioning import final_latents
from vsa2_rl.models.experts import low_noise_guidance
from vsa2_rl.sampling import cfg_velocity, sample, seeded_noise, sigma_schedule


class RolloutDiverged(RuntimeError):
    """The rollouts' videos hold NaN or inf: the model (or the sampler) diverged."""


@dataclass
class Rollout:
    """One chunk of rollouts on this rank (all tensors on the training device)."""

    condition: Any  # what the model is conditioned on: text [b, L, D_text] (+ image)
    latents: torch.Tensor  # [N + 1, b, C, T, H, W] float32
    log_probs: torch.Tensor  # [N, b] float32
    advantages: torch.Tensor | None = None  # [b]
    kl_penalty: torch.Tensor | None = None  # [b], rl.kl_mode=reward: sum_j log p - log p_ref
    valid: torch.Tensor | None = None  # bool [b]: False where rewards.on_error dropped the sample


@dataclass
class StepRollouts:
    """What one step's rollout phase hands to scoring and the update (this rank's samples)."""

    prompt_indices: list[int]
    group_ids: list[int]
    prompts: list[str]
    global_index: list[int]  # each sample's index in the step's global batch
    chunks: list[Rollout]
    videos: torch.Tensor  # [n, T, C, H, W] float32, decoded
    stochastic: torch.Tensor  # bool [N]: the steps that drew noise (and may be trained)
    pending: list  # rewards.async_scoring: each chunk's future RewardOutput, in order
    seconds: float  # the rollout phase's wall time (for the step's throughput)
    metrics: dict  # the rollout phase's: perf/rollout_s, perf/rollout_evals, attn/density

    def set_scores(self, advantages: torch.Tensor, valid: torch.Tensor, chunk_size: int) -> None:
        """Hands each chunk its samples' ``advantages`` and ``valid`` flags (each [n]), which
        every update rule reads."""
        parts = chunk_slices(len(self.prompts), chunk_size)
        for chunk, part in zip(self.chunks, parts, strict=True):
            chunk.advantages, chunk.valid = advantages[part], valid[part]


_MASK64 = (1 << 64) - 1


def _mix64(value: int) -> int:
    """The splitmix64 finaliser: a bijection on 64-bit integers that scatters every input bit."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def sample_seed(seed: int, step: int, index: int) -> int:
    """A seed per (run seed, step, global sample index): independent of rank count and resume.

    Each key is folded into a splitmix64 chain, so neighbouring steps, samples and run seeds
    draw unrelated streams (a linear formula would hand step s+1's sample i the seed of one of
    step s's samples). The result fits 63 bits, as ``torch.Generator.manual_seed`` takes it.
    """
    state = 0
    for key in (seed, step, index):
        state = _mix64(state ^ (int(key) & _MASK64))
    return state >> 1


def chunk_slices(n: int, size: int) -> list[slice]:
    """``n`` samples cut into consecutive chunks of at most ``size``."""
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


def initial_noise(
    settings: SamplerConfig, seed: int, group_size: int, step: int, latent_shape: tuple,
    global_index: list[int],
) -> torch.Tensor:  # fmt: skip
    """The rollouts' starting latents: one seed per sample, or per group with
    ``sampler.same_noise_per_group`` (then every sample of a group starts from its group's
    noise; samples are laid out group after group, see ``GroupedPromptSampler``)."""
    if settings.same_noise_per_group:
        global_index = [i // group_size * group_size for i in global_index]
    return seeded_noise(latent_shape, [sample_seed(seed, step, i) for i in global_index])


def _group_prefix(condition_of, velocity_fn, noise, group_ids, sigmas, batch_size):
    """The ODE steps ``sigmas`` (the ones before the SDE window) run once per group on one
    sample of it (all of a group's samples share their noise), expanded to every sample.

    Returns ``(latents [len(sigmas), n, ...], number of groups)``.
    """
    first = {}
    for index, group in enumerate(group_ids):
        first.setdefault(group, index)
    leaders = list(first.values())
    parts = []
    for chunk in chunk_slices(len(leaders), batch_size):
        rows = leaders[chunk]
        with record_function("vsa2_rl/rollout/text_encode"):
            condition = condition_of(rows)
        with record_function("vsa2_rl/rollout/sample"):
            trajectory = sample(
                velocity_fn(condition), noise[rows], sigmas, kind="ode", noise_level=0.0
            )
        parts.append(trajectory.latents)
    shared = torch.cat(parts, dim=1)
    of_group = {group: slot for slot, group in enumerate(first)}
    index = torch.tensor([of_group[group] for group in group_ids], device=shared.device)
    return shared[:, index], len(leaders)


@dataclass
class SampledChunks:
    """This rank's rollouts of a step as :meth:`RolloutSampler.sample_chunks` returns them."""

    chunks: list[Rollout]
    videos: list[torch.Tensor]  # per chunk [b, T, C, H, W], decoded
    stochastic: torch.Tensor  # bool [N]
    evaluations: int  # velocity evaluations this rank ran


class RolloutSampler:
    """The ``sampler`` section's rollouts for a bundle: sigma schedule, guidance and noise.

    ``batch_size`` is ``rl.train_batch_size``, ``group_size`` ``rl.group_size``, ``seed``
    the run's seed, ``device`` where the latents live, ``video_tokens`` a video's tokens (for
    ``sampler.token_shift``); ``bundle`` encodes the negative prompt once when guidance is on.
    """

    def __init__(
        self, settings: SamplerConfig, bundle, *, batch_size: int, group_size: int, seed: int,
        device: torch.device, video_tokens: int,
    ):  # fmt: skip
        self.settings, self.batch_size, self.device = settings, batch_size, device
        self.group_size, self.seed = group_size, seed
        shift = settings.schedule_shift(video_tokens)
        self.sigmas = sigma_schedule(settings.num_steps, shift, settings.shift_terminal)
        self.low_noise = low_noise_guidance(
            bundle.transformer, settings.guidance_scale_2, "sampler.guidance_scale_2"
        )
        guided = max(settings.guidance_scale, settings.guidance_scale_2 or 1.0) > 1
        self.uncond = bundle.encode_prompts([settings.negative_prompt]) if guided else None

    def velocity_fn(self, bundle, condition) -> Callable:
        """``bundle``'s velocity for samples conditioned on ``condition``, with the sampler's
        classifier-free guidance."""
        scale = self.settings.guidance_scale
        return cfg_velocity(bundle.velocity, condition, self.uncond, scale, self.low_noise)

    def sample_chunks(
        self, bundle, step: int, group_ids: list[int], global_index: list[int],
        condition_of: Callable, latent_shape: tuple, on_chunk: Callable | None = None,
    ) -> SampledChunks:  # fmt: skip
        """Rolls out this rank's samples (``condition_of(rows)`` conditions the samples at
        positions ``rows``) chunk by chunk; ``on_chunk(videos, part)`` sees each chunk's
        decoded videos as soon as they exist (rewards.async_scoring)."""
        samp, device = self.settings, self.device
        noise = initial_noise(
            samp, self.seed, self.group_size, step, latent_shape, global_index
        ).to(device)
        generators = [  # per-sample SDE noise: the same whatever the number of ranks
            torch.Generator(device=device).manual_seed(sample_seed(self.seed + 1, step, i))
            for i in global_index
        ]
        window = samp.window_at(self.seed, step)
        start = window[0] if window and samp.same_noise_per_group else 0
        prefix, evaluations = None, len(global_index) * (len(self.sigmas) - 1 - start)
        if start:
            with torch.no_grad():
                prefix, groups = _group_prefix(
                    condition_of, lambda c: self.velocity_fn(bundle, c), noise, group_ids,
                    self.sigmas[: start + 1], self.batch_size,
                )  # fmt: skip
            evaluations += groups * start
        chunks, videos = [], []
        for part in chunk_slices(len(global_index), self.batch_size):
            with torch.no_grad():
                with record_function("vsa2_rl/rollout/text_encode"):
                    condition = condition_of(list(range(part.start, part.stop)))
                with record_function("vsa2_rl/rollout/sample"):
                    trajectory = sample(
                        self.velocity_fn(bundle, condition),
                        noise[part] if prefix is None else prefix[-1, part],
                        self.sigmas[start:],
                        kind=samp.kind,
                        noise_level=samp.noise_level,
                        sde_window=(window[0] - start, window[1] - start) if window else None,
                        generator=generators[part],
                    )
                with record_function("vsa2_rl/rollout/decode"):
                    clean = final_latents(condition, trajectory.latents[-1])
                    videos.append(bundle.decode(clean))
            if on_chunk is not None:
                on_chunk(videos[-1], part)
            latents, log_probs = trajectory.latents, trajectory.log_probs
            if prefix is not None:  # the shared steps: deterministic, log-prob 0
                latents = torch.cat([prefix[:-1, part], latents])
                log_probs = torch.cat([log_probs.new_zeros(start, log_probs.shape[1]), log_probs])
            chunks.append(Rollout(condition, latents, log_probs))
        stochastic = torch.cat([torch.zeros(start, dtype=torch.bool), trajectory.stochastic])
        return SampledChunks(chunks, videos, stochastic, evaluations)


__all__ = [
    "Rollout",
    "RolloutDiverged",
    "RolloutSampler",
    "SampledChunks",
    "StepRollouts",
    "chunk_slices",
    "initial_noise",
    "sample_seed",
]
