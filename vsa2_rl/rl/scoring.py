"""Scoring: one RL step's rewards into GRPO advantages, across ranks.

The trainer hands over the rewards of this rank's samples (a ``RewardOutput``) and their prompt
groups; :func:`step_advantages` gathers every rank's rewards of a group, normalises them as
``rl.scale_rewards`` says (per reward and then combined by weight with
``rewards.aggregation=advantage``, or on the weighted total minus the KL penalty with
``reward``), and logs the reward statistics of the whole step. Samples a reward dropped
(``rewards.on_error=drop_sample``, a non-finite value) get advantage 0. The result is the same
for any number of ranks. The trainer's scoring phase returns them as :class:`StepScores`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from vsa2_rl.config import RLConfig
from vsa2_rl.rl.grpo import gather_group_rewards


class StepScores(NamedTuple):
    """What one step's scoring produced for this rank's samples, in rollout order."""

    advantages: torch.Tensor  # [n]
    valid: torch.Tensor  # bool [n]: False where rewards.on_error dropped the sample
    metrics: dict[str, float]  # the step's reward/* and train/* scoring metrics


def rank_advantages(acc, values: torch.Tensor, group_ids: torch.Tensor, rl) -> tuple:
    """GRPO advantages of this rank's samples, normalised over every rank's samples of a group.

    Non-finite rewards (samples dropped by ``rewards.on_error=drop_sample``) get advantage 0
    and count as zero-variance; the rest go through ``gather_group_rewards``, which accepts
    ranks with different numbers of kept samples.
    Returns ``(advantages [n_local], zero_var [n_local], kept rewards of all ranks)``.
    """
    values = values.to(group_ids.device).float()
    finite = torch.isfinite(values)
    advantages = torch.zeros_like(values)
    zero_var = torch.ones_like(finite)
    if not bool(acc.gather(finite.any().float().reshape(1)).max() > 0):
        return advantages, zero_var, values[finite]  # every sample of the step was dropped
    gathered = gather_group_rewards(
        acc, values[finite], group_ids[finite], scale=rl.scale_rewards, clip=rl.adv_clip
    )
    advantages[finite], zero_var[finite] = gathered.advantages, gathered.zero_var_mask
    return advantages, zero_var, gathered.all_rewards


def step_advantages(
    acc, rl: RLConfig, aggregation: str, mixer, scored, group_ids: torch.Tensor,
    kl_penalty: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, float]]:  # fmt: skip
    """This rank's advantages [n] for ``scored`` (the step's ``RewardOutput``) of samples in
    ``group_ids``, and the step's ``reward/*`` and ``train/*`` scoring metrics; ``kl_penalty``
    [n] (Flow-GRPO's ``rl.kl_mode=reward``) is taken off the total, weighted by
    ``rl.kl_beta``."""
    device, metrics = group_ids.device, {}
    if aggregation == "reward":
        total = scored.total.to(device)
        if kl_penalty is not None:
            metrics["train/kl_penalty"] = acc.gather(kl_penalty).mean().item()
            total = total - rl.kl_beta * kl_penalty
        advantages, zero_var, all_rewards = rank_advantages(acc, total, group_ids, rl)
    else:
        per_reward = {
            name: rank_advantages(acc, values, group_ids, rl)
            for name, values in scored.rewards.items()
        }
        advantages = mixer.combine_advantages({name: r[0] for name, r in per_reward.items()})
        zero_var = torch.stack([result[1] for result in per_reward.values()]).all(0)
        all_rewards = acc.gather(scored.total.to(device))
    valid_rewards = all_rewards[torch.isfinite(all_rewards)]
    metrics["reward/mean"] = valid_rewards.mean().item()
    metrics["reward/std"] = valid_rewards.std(correction=0).item()
    for name, values in scored.rewards.items():
        values = acc.gather(values.to(device).float())
        metrics[f"reward/{name}"] = values[torch.isfinite(values)].mean().item()
    metrics["train/zero_var_frac"] = acc.gather(zero_var.float()).mean().item()
    metrics["train/dropped_samples"] = int(acc.gather((~scored.valid).float().to(device)).sum())
    # the advantages every rank trains on, gathered: equal for any number of ranks
    metrics["train/advantage_abs_mean"] = acc.gather(advantages.abs()).mean().item()
    return advantages, metrics


__all__ = ["StepScores", "rank_advantages", "step_advantages"]
