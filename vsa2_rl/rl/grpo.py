"""GRPO math for flow-matching policies: group advantages, PPO-clip loss, Gaussian KL.

Follows Flow-GRPO (Liu et al., 2025) on top of GRPO (Shao et al., 2024, DeepSeekMath), with
trl's option names where they exist (``scale_rewards`` -> ``scale``, ``loss_type``):

- :func:`group_advantages`: ``A = (r - mean_group(r)) / (std + eps)``; ``scale`` picks the std of
  the prompt's group (``"group"``), of the whole batch (``"batch"``, flow_grpo's ``global_std``)
  or none (``"none"``, Dr. GRPO). Groups whose rewards are all equal get advantage exactly 0.
- :func:`grpo_loss`: per sample and per denoising step, PPO-clip or plain REINFORCE.
- :func:`gaussian_kl`: closed-form KL between the policy's and the reference's Gaussian
  transitions (equal std), averaged over latent elements like the sampler's log-probs.
- :func:`gather_group_rewards`: all-gathers rewards so a prompt's K samples, spread over ranks,
  are normalised together, and returns this rank's slice.
- :class:`GroupedPromptSampler`: which prompts (K samples each) a rank rolls out at a step.

The math is pure functions of tensors, unit-tested on CPU.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

SCALES = ("group", "batch", "none")
LOSS_TYPES = ("ppo_clip", "reinforce")


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    scale: str = "group",
    eps: float = 1e-4,
    clip: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Group-relative advantages.

    Args:
        rewards: float [N], one scalar per sample (all finite; checked). Syncs with the host
            (the check and ``torch.unique``): call once per step, not per minibatch.
        group_ids: int [N]; samples with the same id share a prompt. Groups may differ in size.
        scale: ``"group"`` divide by the group's std, ``"batch"`` by the std of all N rewards,
            ``"none"`` only subtract the group mean. Stds are population stds (``correction=0``,
            as flow_grpo's ``np.std``), so a group of one has std 0, not NaN.
        eps: added to the std before dividing.
        clip: if set, advantages are clamped to ``[-clip, clip]``.

    Returns:
        ``(advantages float32 [N], zero_var_mask bool [N])``; ``zero_var_mask[i]`` is True when
        every reward in sample i's group is identical. Those samples get advantage exactly 0
        whatever ``scale`` is (``r - mean`` can be 1 ulp off zero), and contribute no gradient;
        ``zero_var_mask.float().mean()`` is the fraction of wasted samples worth logging.
    """
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES} (trl's scale_rewards), got {scale!r}")
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_ids.shape != rewards.shape:
        raise ValueError(
            f"group_ids shape {tuple(group_ids.shape)} must equal rewards shape "
            f"{tuple(rewards.shape)}"
        )
    if group_ids.dtype.is_floating_point or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got dtype {group_ids.dtype}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    if clip is not None and not clip > 0:
        raise ValueError(f"clip must be > 0 or None, got {clip!r}")
    if rewards.numel() == 0:
        raise ValueError("rewards is empty: need at least one sample")
    finite = torch.isfinite(rewards)
    if not bool(finite.all()):
        bad = torch.nonzero(~finite).flatten().tolist()
        raise ValueError(
            f"rewards must be finite; samples {bad} are NaN/inf (drop or skip them before "
            "computing advantages)"
        )

    r = rewards.detach().double()  # float64: the mean of large equal rewards stays exact
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    num_groups = counts.numel()
    mean = torch.zeros(num_groups, dtype=r.dtype, device=r.device).index_add_(0, inverse, r)
    mean = mean / counts
    centered = r - mean[inverse]
    if scale == "group":
        var = torch.zeros_like(mean).index_add_(0, inverse, centered.square()) / counts
        adv = centered / (var.sqrt()[inverse] + eps)
    elif scale == "batch":
        adv = centered / (r.std(correction=0) + eps)
    else:
        adv = centered
    hi = torch.full_like(mean, -torch.inf).scatter_reduce(0, inverse, r, "amax")
    lo = torch.full_like(mean, torch.inf).scatter_reduce(0, inverse, r, "amin")
    zero_var = (hi == lo)[inverse]
    adv = torch.where(zero_var, torch.zeros_like(adv), adv)
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    return adv.float(), zero_var


def grpo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    *,
    clip_range: float = 1e-4,
    clip_range_high: float | None = None,
    loss_type: str = "ppo_clip",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Policy loss for one minibatch of transitions.

    Args:
        log_prob: float [B] or [B, T]: log-probs of the stored transitions under the current
            policy (differentiable), T = denoising steps trained in this minibatch.
        old_log_prob: same shape, recorded at rollout time (treated as a constant).
        advantages: float [B] (broadcast over T) or the same shape as log_prob; a constant.
        clip_range: PPO epsilon (the lower bound ``1 - clip_range``, and the upper one unless
            ``clip_range_high`` is given). Log-probs are per-element means (see
            vsa2_rl.sampling), so ratios move little per update and flow_grpo's default is 1e-4.
        clip_range_high: the upper bound ``1 + clip_range_high`` when it differs from the
            lower one (asymmetric clipping, DAPO's "clip-higher"); None = ``clip_range``.
        loss_type: ``"ppo_clip"``: ``mean(max(-A r, -A clip(r, 1 - eps, 1 + eps)))`` with
            ``r = exp(log_prob - old_log_prob)``. ``"reinforce"``: ``mean(-A log_prob)``, no
            ratio or clipping (its gradient equals ppo_clip's at r = 1). trl's ``bnpo`` /
            ``dr_grpo`` differ from its ``grpo`` only in how token counts normalise the mean; every
            sample here has the same number of steps, so they would equal ``ppo_clip`` up to a
            constant factor and are not offered.

    Returns:
        ``(loss, stats)``: ``loss`` a scalar mean over all elements; ``stats`` detached scalar
        tensors (no host sync): ``clip_frac`` (fraction of elements whose gradient the clip
        removes: r > 1 + eps_high with A > 0, or r < 1 - eps with A < 0, trl's definition),
        ``ratio_mean``, ``ratio_max_dev`` (max |r - 1|), ``approx_kl`` (the k3 estimator
        ``mean(r - 1 - log r)`` of KL(old || new), computed as ``expm1(x) - x`` of the
        log-ratio x in float64: ``r - 1 - x`` in float32 cancels to 0 at the ~1e-4 log-ratios
        that per-element mean log-probs give).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if not clip_range > 0:
        raise ValueError(f"clip_range must be > 0, got {clip_range!r}")
    high = clip_range if clip_range_high is None else clip_range_high
    if not high > 0:
        raise ValueError(f"clip_range_high must be > 0, got {clip_range_high!r}")
    if old_log_prob.shape != log_prob.shape:
        raise ValueError(
            f"old_log_prob shape {tuple(old_log_prob.shape)} must equal log_prob shape "
            f"{tuple(log_prob.shape)}"
        )
    if advantages.shape != log_prob.shape:
        if advantages.ndim != 1 or advantages.shape[0] != log_prob.shape[0]:
            raise ValueError(
                f"advantages must have shape [B]=({log_prob.shape[0]},) or "
                f"{tuple(log_prob.shape)}, got {tuple(advantages.shape)}"
            )
        advantages = advantages.reshape(-1, *([1] * (log_prob.ndim - 1)))
    adv = advantages.detach().float().expand_as(log_prob)
    log_ratio = log_prob.float() - old_log_prob.detach().float()
    ratio = torch.exp(log_ratio)
    if loss_type == "ppo_clip":
        unclipped = -adv * ratio
        clipped = -adv * ratio.clamp(1.0 - clip_range, 1.0 + high)
        loss = torch.maximum(unclipped, clipped).mean()
    else:
        loss = (-adv * log_prob.float()).mean()
    with torch.no_grad():
        clipped_mask = ((ratio > 1.0 + high) & (adv > 0)) | ((ratio < 1.0 - clip_range) & (adv < 0))
        stats = {
            "clip_frac": clipped_mask.float().mean(),
            "ratio_mean": ratio.mean(),
            "ratio_max_dev": (ratio - 1.0).abs().max(),
            "approx_kl": (torch.expm1(log_ratio.double()) - log_ratio.double()).mean().float(),
        }
    return loss, stats


def gaussian_kl(mean: Tensor, ref_mean: Tensor, std: Tensor | float) -> Tensor:
    """KL(N(mean, std^2) || N(ref_mean, std^2)) per sample, averaged over non-batch dims.

    For equal variances the per-element KL is ``(mean - ref_mean)^2 / (2 std^2)``; averaging
    (not summing) over elements matches the sampler's log-prob convention. ``std`` must be > 0
    (deterministic steps have no KL; skip them with ``Trajectory.stochastic``). Returns float32
    [B], differentiable w.r.t. ``mean``.
    """
    if mean.shape != ref_mean.shape:
        raise ValueError(
            f"ref_mean shape {tuple(ref_mean.shape)} must equal mean shape {tuple(mean.shape)}"
        )
    std = torch.as_tensor(std, dtype=torch.float32, device=mean.device)
    kl = (mean.float() - ref_mean.float()).square() / (2.0 * std.square())
    return kl.mean(dim=tuple(range(1, kl.ndim)))


class GroupAdvantages(NamedTuple):
    advantages: Tensor  # float32 [n_local], this rank's samples
    zero_var_mask: Tensor  # bool [n_local]
    all_rewards: Tensor  # [n_global], every rank's rewards in rank order (for logging)


def gather_group_rewards(
    accelerator: Any | None,
    rewards: Tensor,
    group_ids: Tensor,
    *,
    scale: str = "group",
    eps: float = 1e-4,
    clip: float | None = None,
) -> GroupAdvantages:
    """Advantages for this rank's samples, normalised over every rank's samples of each group.

    ``accelerator`` is an ``accelerate.Accelerator`` (uses ``num_processes``, ``process_index``,
    ``device`` and ``gather``, which concatenates in rank order) or None for one process.
    ``group_ids`` must be global (the same prompt has the same id on every rank, e.g.
    ``GroupedPromptSampler`` ids). Ranks may hold different numbers of samples (e.g. after
    dropping failed rewards): blocks are padded to the largest count for the all-gather and the
    padding is removed before normalising.
    """
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_ids.shape != rewards.shape:
        raise ValueError(
            f"group_ids shape {tuple(group_ids.shape)} must equal rewards shape "
            f"{tuple(rewards.shape)}"
        )
    if accelerator is None or accelerator.num_processes == 1:
        adv, zero_var = group_advantages(rewards, group_ids, scale=scale, eps=eps, clip=clip)
        return GroupAdvantages(adv, zero_var, rewards)
    n = rewards.shape[0]
    device = accelerator.device
    counts = accelerator.gather(torch.tensor([n], device=device)).tolist()  # one host sync
    width = max(counts)
    padded_rewards = torch.zeros(width, dtype=torch.float32, device=device)
    padded_rewards[:n] = rewards.detach().float()
    padded_ids = torch.zeros(width, dtype=torch.long, device=device)
    padded_ids[:n] = group_ids.long()
    # [world * width] -> keep the first counts[r] entries of every rank's block
    keep = torch.cat([torch.arange(width, device=device) < count for count in counts])
    all_rewards = accelerator.gather(padded_rewards)[keep]
    all_ids = accelerator.gather(padded_ids)[keep]
    adv, zero_var = group_advantages(all_rewards, all_ids, scale=scale, eps=eps, clip=clip)
    start = sum(counts[: accelerator.process_index])
    local = slice(start, start + n)
    return GroupAdvantages(
        adv[local].to(rewards.device), zero_var[local].to(rewards.device), all_rewards
    )


class PromptBatch(NamedTuple):
    prompt_indices: list[int]  # this rank's samples: dataset index of each sample's prompt
    group_ids: list[int]  # this rank's samples: global group id (prompt slot within the step)
    epoch: int


class GroupedPromptSampler:
    """Step-indexed prompt sampler: K samples per prompt, the step's samples split over ranks.

    At step ``s`` the global batch is ``prompts_per_step`` prompts, each repeated
    ``group_size`` (K) times consecutively; rank r takes the r-th contiguous slice of the
    ``prompts_per_step * K`` samples, so a group may straddle ranks (advantages are gathered
    with :func:`gather_group_rewards`). Prompts come from a permutation of the dataset drawn
    from ``seed + epoch``; the incomplete last batch of an epoch is dropped so every step has
    the same number of groups.

    Like trl's ``RepeatSampler`` but a pure function of ``step``: resuming at step s needs no
    sampler state, and the rank split is explicit instead of left to ``accelerator.prepare``
    (trl's sampler advances a private generator per epoch and has no ``set_epoch``).
    """

    def __init__(
        self,
        num_prompts: int,
        group_size: int,
        prompts_per_step: int,
        *,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
        shuffle: bool = True,
    ):
        for name, value in (
            ("num_prompts", num_prompts),
            ("group_size", group_size),
            ("prompts_per_step", prompts_per_step),
            ("num_replicas", num_replicas),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if prompts_per_step > num_prompts:
            raise ValueError(
                f"prompts_per_step={prompts_per_step} exceeds num_prompts={num_prompts}; lower it "
                "or add prompts"
            )
        if (prompts_per_step * group_size) % num_replicas:
            raise ValueError(
                f"prompts_per_step * group_size = {prompts_per_step * group_size} samples must be "
                f"divisible by num_replicas={num_replicas}"
            )
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}), got {rank!r}")
        self.num_prompts = num_prompts
        self.group_size = group_size
        self.prompts_per_step = prompts_per_step
        self.num_replicas = num_replicas
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.steps_per_epoch = num_prompts // prompts_per_step
        self.samples_per_rank = prompts_per_step * group_size // num_replicas

    def batch(self, step: int) -> PromptBatch:
        """This rank's samples at ``step`` (>= 0)."""
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        epoch, slot = divmod(step, self.steps_per_epoch)
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.num_prompts, generator=gen).tolist()
        else:
            order = list(range(self.num_prompts))
        prompts = order[slot * self.prompts_per_step : (slot + 1) * self.prompts_per_step]
        start = self.rank * self.samples_per_rank
        flat = range(start, start + self.samples_per_rank)
        return PromptBatch(
            [prompts[i // self.group_size] for i in flat],
            [i // self.group_size for i in flat],
            epoch,
        )
