"""Flow-GRPO's update rule (``rl.algorithm=flow_grpo``; Liu et al. 2025, arXiv 2505.05470),
behind the trainer's :class:`vsa2_rl.rl.update.UpdateRule`.

The rollouts come from the current policy with an SDE (or CPS) sampler that records each
stochastic transition's Gaussian log-prob; those log-probs and the trajectory's latents are what
this rule reads. For each inner epoch (``rl.num_inner_epochs``) :class:`FlowGRPOUpdate` draws a
random ``rl.timestep_fraction`` of the stochastic steps whose expert trains (of each trained
expert's steps, so that every optimizer step trains every expert the config names), recomputes
each chunk's transition log-prob at those steps under the current policy, and accumulates the
PPO-clip loss (+ ``rl.kl_beta`` times the KL to the reference) into one optimizer step in which
every sample and step weighs the same, however ``rl.train_batch_size`` cuts the samples and over
any number of ranks. A non-finite loss or gradient skips the step (weights untouched). With
``rl.kl_mode=reward`` the KL is instead a per-sample penalty of the reward
(:meth:`FlowGRPOUpdate.kl_penalty`). The loss and KL formulas are pure functions in
vsa2_rl.rl.grpo (:func:`grpo_loss`, :func:`gaussian_kl`).
"""

from __future__ import annotations

import contextlib

import torch
from torch.profiler import record_function

from vsa2_rl.config import ConfigError, RLConfig, RunConfig, SamplerConfig
from vsa2_rl.models.experts import expert_at, trains_level
from vsa2_rl.rl import engines
from vsa2_rl.rl.grpo import gaussian_kl, grpo_loss
from vsa2_rl.rl.policy import Policy
from vsa2_rl.rl.rollout import Rollout, RolloutSampler, StepRollouts, sample_seed
from vsa2_rl.rl.update import UpdateResult
from vsa2_rl.sampling import step_log_prob

# grpo_loss's statistics as logged (per-sample means over an update); ratio_max_dev is logged
# as train/ratio_dev_first, from the first pass only
LOGGED_STATS = {
    "clip_frac": "train/clip_frac",
    "ratio_mean": "train/ratio_mean",
    "approx_kl": "train/approx_kl",
}


def _update_plan(acc, chunks: list, timesteps: list[int], kl_beta: float) -> tuple[list, float]:
    """The (chunk, timestep, counted) backward passes of one update and the weight of a sample.

    The update is the mean over every sample of the step (all ranks) and every trained
    timestep, as one batch would give it, however ``rl.train_batch_size`` cuts the samples:
    a pass's loss is its chunk's mean times the chunk's size times the returned weight
    ``num_processes / (samples of all ranks * timesteps)`` (DDP then averages over ranks). A
    chunk whose advantages are all zero adds nothing unless a KL term is trained, so it is not
    counted; with several processes it still runs, with weight 0, since every rank must run
    the same number of backward passes (DDP all-reduces in the last one and DeepSpeed reduces
    in each). Empty when no sample of any rank has a non-zero advantage: the step teaches
    nothing and the weights stay as they are.
    """
    useful = [bool(chunk.advantages.abs().sum() > 0) for chunk in chunks]
    samples = sum(chunk.advantages.numel() for chunk in chunks)
    local = torch.tensor([float(any(useful)), float(samples)], device=acc.device)
    any_useful, all_samples = acc.reduce(local, reduction="sum").tolist()
    if any_useful == 0:
        return [], 0.0
    counted = [flag or kl_beta > 0 for flag in useful]
    keep_all = acc.num_processes > 1
    work = [
        (chunk, j, flag)
        for chunk, flag in zip(chunks, counted, strict=True)
        for j in timesteps
        if flag or keep_all
    ]
    return work, acc.num_processes / (all_samples * len(timesteps))


def _update_metrics(acc, sums: dict, count: float, ratio_dev_first) -> dict:
    """Per-sample means of the update's loss statistics over every rank (``sums`` hold this
    rank's sums over samples and timesteps, ``count`` is the number of both of all ranks)."""
    zero = torch.zeros((), device=acc.device)
    totals = torch.stack([torch.stack(v).float().sum() if v else zero for v in sums.values()])
    totals = acc.reduce(totals, reduction="sum")
    ratio = acc.gather(torch.tensor([ratio_dev_first or 0.0], device=acc.device))
    count = max(count, 1.0)
    means = {name: float(total) / count for name, total in zip(sums, totals, strict=True)}
    return {**means, "train/ratio_dev_first": float(ratio.max())}


def _check_trained_window(model, sigmas: torch.Tensor, samp: SamplerConfig) -> None:
    """Refuses an SDE window none of whose steps a trained expert denoises (Wan2.2 A14B with
    one expert in ``model.train_experts``): Flow-GRPO would have no transition to train."""
    if samp.sde_window_size is not None:
        steps = range(*(samp.sde_window_range or [0, samp.num_steps]))
    else:
        steps = range(*(samp.sde_window or [0, samp.num_steps]))
    if not any(trains_level(model, float(sigmas[j])) for j in steps):
        levels = [round(float(sigmas[j]), 3) for j in steps]
        raise ConfigError(
            f"sampler.sde_window: its steps' noise levels {levels} all belong to an expert "
            "model.train_experts leaves frozen; move the window (or sampler.sde_window_range) "
            "to the trained expert's steps"
        )


class FlowGRPOUpdate:
    """The ``rl`` section's PPO-clip update of ``policy`` on the rollouts of ``sampler``.

    With ``rl.kl_mode=reward`` the KL to the reference is not a loss term: the trainer takes
    :meth:`kl_penalty` of each chunk off its reward instead.
    """

    requires = ("latents", "log_probs")  # the trajectory and its SDE transitions' log-probs

    def __init__(self, policy: Policy, sampler: RolloutSampler, rl: RLConfig, seed: int):
        self.policy, self.sampler, self.rl, self.seed = policy, sampler, rl, seed
        self.kl_in_reward = policy.reference is not None and rl.kl_mode == "reward"

    @classmethod
    def from_config(
        cls, policy: Policy, sampler: RolloutSampler, config: RunConfig
    ) -> FlowGRPOUpdate:
        """The rule of ``config``; refuses an SDE window that trains no expert."""
        _check_trained_window(policy.model, sampler.sigmas, config.sampler)
        return cls(policy, sampler, config.rl, config.seed)

    def sampling_policy(self):
        """Yields the bundle the rollouts come from: the current policy."""
        return contextlib.nullcontext(self.policy.bundle)

    def state_entries(self) -> dict:
        return {}  # the policy's own entries hold all of Flow-GRPO's state

    def load_state(self, restored: dict) -> None:
        pass

    def update(self, step: int, rollouts: StepRollouts) -> UpdateResult:
        """``rl.num_inner_epochs`` optimizer steps and their loss statistics."""
        rl, policy, acc = self.rl, self.policy, self.policy.acc
        stochastic = torch.nonzero(rollouts.stochastic).flatten().tolist()
        step_gen = torch.Generator().manual_seed(sample_seed(self.seed + 2, step, 0))
        sums = {name: [] for name in ("loss/policy", "loss/kl", *LOGGED_STATS.values())}
        first_ratio_dev, grad_norms, count, skipped = [], [], 0.0, 0
        for _epoch in range(rl.num_inner_epochs):
            timesteps = self._trained_timesteps(stochastic, step_gen)
            kl_loss_beta = 0.0 if self.kl_in_reward else rl.kl_beta
            work, weight = _update_plan(acc, rollouts.chunks, timesteps, kl_loss_beta)
            if not work:
                continue  # no rank has a sample with a non-zero advantage
            count += acc.num_processes / weight
            policy.optimizer.zero_grad(set_to_none=True)
            for index, (chunk, j, counted) in enumerate(work):
                last = index == len(work) - 1
                with (
                    engines.accumulation_context(acc, policy.model, last),
                    record_function("vsa2_rl/update/forward_backward"),
                ):
                    loss, kl, stats = self._pass_losses(chunk, j)
                    size = chunk.latents.shape[1]  # the chunk's means, as sums over its samples
                    total = (loss + rl.kl_beta * kl) * size * (weight if counted else 0.0)
                    engines.backward(acc, total, last)
                if counted:
                    if not first_ratio_dev:
                        first_ratio_dev.append(stats["ratio_max_dev"].item())
                    sums["loss/policy"].append(loss.detach() * size)
                    sums["loss/kl"].append(kl.detach() * size)
                    for stat, name in LOGGED_STATS.items():
                        sums[name].append(stats[stat] * size)
            stepped, grad_norm = policy.optimizer_step(sums["loss/policy"])
            skipped += not stepped  # a NaN/inf never reaches the weights
            grad_norms.append(grad_norm)
        ratio_dev = first_ratio_dev[0] if first_ratio_dev else None
        return UpdateResult(grad_norms, skipped, _update_metrics(acc, sums, count, ratio_dev))

    def _transition(self, chunk: Rollout, j: int) -> tuple:
        """The stored transition j -> j + 1: ``(x, sigma [b], step_log_prob's arguments)``."""
        sigmas, samp = self.sampler.sigmas, self.sampler.settings
        x, x_next = chunk.latents[j], chunk.latents[j + 1]
        sigma = torch.full((x.shape[0],), float(sigmas[j]), device=x.device)
        return x, sigma, (x, x_next, float(sigmas[j]), float(sigmas[j + 1]), samp.kind)

    def _trained_timesteps(self, stochastic: list[int], generator: torch.Generator) -> list[int]:
        """A random ``rl.timestep_fraction`` (at least one) of the ``stochastic`` steps of
        each trained expert, sorted. Drawn per expert, every optimizer step trains every expert
        the config names: one that sat out an update would still move under Adam's momentum
        with DeepSpeed (which steps every parameter) and not with torch's optimizers (which skip
        a parameter without a gradient)."""
        model, sigmas = self.policy.model, self.sampler.sigmas
        by_expert: dict[str, list[int]] = {}
        for j in stochastic:
            if trains_level(model, float(sigmas[j])):
                by_expert.setdefault(expert_at(model, float(sigmas[j])), []).append(j)
        chosen = []
        for steps in by_expert.values():
            count = max(1, round(self.rl.timestep_fraction * len(steps)))
            chosen += [steps[i] for i in torch.randperm(len(steps), generator=generator)[:count]]
        return sorted(chosen)

    def _pass_losses(self, chunk: Rollout, j: int) -> tuple:
        """One chunk's policy loss, KL to the reference (0 without one) and loss statistics at
        the stored transition j -> j + 1, under the current policy."""
        rl, noise_level = self.rl, self.sampler.settings.noise_level
        x, sigma, transition = self._transition(chunk, j)
        v = self.sampler.velocity_fn(self.policy.bundle, chunk.condition)(x, sigma)
        log_prob, mean, std = step_log_prob(v, *transition, noise_level)
        loss, stats = grpo_loss(
            log_prob,
            chunk.log_probs[j],
            chunk.advantages,
            clip_range=rl.clip_bounds[0],
            clip_range_high=rl.clip_bounds[1],
            loss_type=rl.loss_type,
        )
        kl = torch.zeros((), device=x.device)
        if self.policy.reference is not None and not self.kl_in_reward:
            with torch.no_grad(), self.policy.reference.active() as reference:
                ref_v = self.sampler.velocity_fn(reference, chunk.condition)(x, sigma)
            ref_mean = step_log_prob(ref_v, *transition, noise_level)[1]
            kl = gaussian_kl(mean, ref_mean, std).mean()
        return loss, kl, stats

    def kl_penalty(self, chunk: Rollout, stochastic: torch.Tensor) -> torch.Tensor | None:
        """With ``rl.kl_mode=reward`` (and a reference), per sample the sum over the stochastic
        steps of log p - log p_ref of the transition the rollout drew (an unbiased estimate of
        the trajectory's KL to the reference), at the rollout's sparsity; else None."""
        if not self.kl_in_reward:
            return None
        penalty = torch.zeros(chunk.latents.shape[1], device=chunk.latents.device)
        noise_level = self.sampler.settings.noise_level
        with torch.no_grad(), self.policy.reference.active() as reference:
            for j in torch.nonzero(stochastic).flatten().tolist():
                x, sigma, transition = self._transition(chunk, j)
                ref_v = self.sampler.velocity_fn(reference, chunk.condition)(x, sigma)
                ref_log_prob = step_log_prob(ref_v, *transition, noise_level)[0]
                penalty += chunk.log_probs[j] - ref_log_prob
        return penalty


__all__ = ["LOGGED_STATS", "FlowGRPOUpdate"]
