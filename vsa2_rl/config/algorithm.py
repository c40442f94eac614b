"""Config sections of the RL algorithm: ``sampler`` (rollouts), ``rl`` (groups, advantages and
the update rule), ``nft`` (DiffusionNFT's settings) and ``rewards``."""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from typing import Any

from vsa2_rl.config.checks import (
    MAX_ROLLOUTS_PER_STEP,
    _check,
    _check_choice,
    _check_finite,
    _doc,
)


@dataclass
class SamplerConfig:
    """Flow-matching sampler for rollouts (SDE) and evaluation (deterministic ODE)."""

    kind: str = _doc(
        "Rollout sampler: 'sde' (Flow-GRPO), 'cps' (coefficient-preserving) or 'ode' "
        "(deterministic Euler, no log-probs: rl.algorithm=nft only, the DiffusionNFT paper's "
        "setting).",
        default="sde",
    )
    num_steps: int = _doc("Denoising steps per rollout.", default=10)
    eval_num_steps: int = _doc("ODE steps for evaluation and sample videos.", default=10)
    shift: float = _doc(
        "Timestep shift of the sigma schedule (Wan uses 3-5 at 480p/720p).", default=1.0
    )
    token_shift: list[float] | None = _doc(
        "[base_tokens, base_mu, max_tokens, max_mu]: a shift that grows with the video's tokens, "
        "exp(mu) with mu linear in them through the two points, as diffusers' dynamic shifting "
        "(LTX-2: [1024, 0.95, 4096, 2.05]); replaces sampler.shift; empty = sampler.shift.",
        default=None,
    )
    shift_terminal: float | None = _doc(
        "Stretch the shifted schedule so that its last sigma before 0 is this, as diffusers' "
        "shift_terminal (LTX-2: 0.1); empty = no stretch.",
        default=None,
    )
    noise_level: float = _doc(
        "SDE noise level a (> 0 for Flow-GRPO; 0 = ODE steps, for rl.algorithm=nft).",
        default=0.7,
    )
    guidance_scale: float = _doc(
        "Classifier-free guidance scale of rollouts and training; 1 = no guidance. Both use the "
        "same guided velocity, so the trained log-probs are those of the policy that sampled.",
        default=1.0,
    )
    guidance_scale_2: float | None = _doc(
        "Wan2.2 A14B: guidance scale of the steps below the experts' boundary (the low-noise "
        "expert's), as diffusers' guidance_scale_2; empty = sampler.guidance_scale.",
        default=None,
    )
    negative_prompt: str = _doc(
        "Prompt of the unconditional branch of guidance (rollouts, training and evaluation); "
        "empty = the empty prompt.",
        default="",
    )
    sde_window: list[int] | None = _doc(
        "[start, end) step indices that are stochastic and trained; empty = all steps.",
        default=None,
    )
    sde_window_size: int | None = _doc(
        "Flow-GRPO-Fast with a moving window: this many consecutive stochastic (and trained) "
        "steps, their start drawn anew every RL step within sampler.sde_window_range; empty = "
        "the fixed sampler.sde_window.",
        default=None,
    )
    sde_window_range: list[int] | None = _doc(
        "[low, high): steps the moving window stays within (flow_grpo's sde_window_range); "
        "empty = all steps.",
        default=None,
    )
    same_noise_per_group: bool = _doc(
        "One initial noise per prompt for its whole group (flow_grpo same_latent, DanceGRPO "
        "use_same_noise): a group's samples then differ only through the SDE noise, and the "
        "deterministic steps before the SDE window run once per group, which then branches.",
        default=False,
    )

    def __post_init__(self) -> None:
        _check_choice(self.kind, "sampler.kind", ("sde", "cps", "ode"))
        _check(self.num_steps >= 1, "sampler.num_steps", f"must be >= 1, got {self.num_steps}")
        _check(
            self.eval_num_steps >= 1,
            "sampler.eval_num_steps",
            f"must be >= 1, got {self.eval_num_steps}",
        )
        _check(self.shift > 0, "sampler.shift", f"must be > 0, got {self.shift}")
        self._check_token_shift()
        _check(
            self.shift_terminal is None or 0 < self.shift_terminal < 1,
            "sampler.shift_terminal",
            f"must be in (0, 1) (empty = no stretch), got {self.shift_terminal}",
        )
        _check(
            self.noise_level >= 0, "sampler.noise_level", f"must be >= 0, got {self.noise_level}"
        )
        _check(
            self.kind != "cps" or self.noise_level <= 1,
            "sampler.noise_level",
            f"must be in [0, 1] with sampler.kind=cps (its noise is sigma_next * sin(a * pi / 2)), "
            f"got {self.noise_level}",
        )
        _check(
            self.guidance_scale >= 1.0,
            "sampler.guidance_scale",
            f"must be >= 1 (1 disables guidance), got {self.guidance_scale}",
        )
        _check(
            self.guidance_scale_2 is None or self.guidance_scale_2 >= 1.0,
            "sampler.guidance_scale_2",
            f"must be >= 1 (1 disables guidance; empty = sampler.guidance_scale), got "
            f"{self.guidance_scale_2}",
        )
        _check(
            not (self.same_noise_per_group and (self.noise_level == 0 or self.kind == "ode")),
            "sampler.same_noise_per_group",
            "with sampler.noise_level 0 or sampler.kind ode every sample of a group would be the "
            "same video; use SDE noise or set same_noise_per_group false",
        )
        if self.sde_window is not None:
            _check(
                len(self.sde_window) == 2
                and 0 <= self.sde_window[0] < self.sde_window[1] <= self.num_steps,
                "sampler.sde_window",
                f"must be [start, end) with 0 <= start < end <= sampler.num_steps "
                f"({self.num_steps}), got {list(self.sde_window)}",
            )
        if self.sde_window_size is None:
            _check(
                self.sde_window_range is None,
                "sampler.sde_window_range",
                "needs sampler.sde_window_size (the length of the window that moves within it)",
            )
            return
        _check(
            self.sde_window is None,
            "sampler.sde_window",
            "give either a fixed sampler.sde_window or a moving sampler.sde_window_size, not both",
        )
        window_range = self.sde_window_range or [0, self.num_steps]
        _check(
            len(window_range) == 2 and 0 <= window_range[0] < window_range[1] <= self.num_steps,
            "sampler.sde_window_range",
            f"must be [low, high) with 0 <= low < high <= sampler.num_steps ({self.num_steps}), "
            f"got {self.sde_window_range}",
        )
        low, high = window_range
        _check(
            1 <= self.sde_window_size <= high - low,
            "sampler.sde_window_size",
            f"must be in [1, {high - low}] (the width of sampler.sde_window_range), got "
            f"{self.sde_window_size}",
        )

    def window_at(self, seed: int, step: int) -> tuple[int, int] | None:
        """The [start, end) SDE window of RL step ``step``: the fixed one, or the moving one's
        draw, a pure function of (seed, step) so that a resumed run draws the same."""
        if self.sde_window_size is None:
            return tuple(self.sde_window) if self.sde_window else None
        low, high = self.sde_window_range or [0, self.num_steps]
        start = random.Random(seed * 1_000_033 + step).randint(low, high - self.sde_window_size)
        return start, start + self.sde_window_size

    def _check_token_shift(self) -> None:
        if self.token_shift is None:
            return
        rule = list(self.token_shift)
        _check(
            len(rule) == 4 and rule[0] >= 1 and rule[2] > rule[0],
            "sampler.token_shift",
            f"must be [base_tokens, base_mu, max_tokens, max_mu] with 1 <= base_tokens < "
            f"max_tokens, got {rule}",
        )
        _check(
            self.shift == 1.0,
            "sampler.shift",
            f"sampler.token_shift sets the shift from the video's tokens; leave sampler.shift at "
            f"1, got {self.shift}",
        )

    def schedule_shift(self, video_tokens: int) -> float:
        """The schedule's shift for videos of ``video_tokens`` tokens: ``sampler.shift``, or
        with ``sampler.token_shift`` exp(mu), mu linear in the tokens through its two points
        (extrapolated beyond them), as diffusers' dynamic shifting (its exponential time shift
        of sigma by mu is the plain shift by exp(mu))."""
        if self.token_shift is None:
            return self.shift
        base_tokens, base_mu, max_tokens, max_mu = self.token_shift
        slope = (max_mu - base_mu) / (max_tokens - base_tokens)
        return math.exp(base_mu + (video_tokens - base_tokens) * slope)


# rl.algorithm -> "module:class" of its update rule (vsa2_rl.rl.update.UpdateRule), imported
# when a run builds it; a new algorithm is its module plus an entry here
UPDATE_RULES = {
    "flow_grpo": "vsa2_rl.rl.flow_grpo:FlowGRPOUpdate",
    "nft": "vsa2_rl.rl.nft:NFTUpdate",
}
ALGORITHMS = tuple(UPDATE_RULES)


@dataclass
class RLConfig:
    """Group-relative RL: prompt groups, advantages and the update rule (rl.algorithm)."""

    algorithm: str = _doc(
        "Update rule. 'flow_grpo': PPO-clip on the log-probs of SDE transitions (Flow-GRPO, Liu "
        "et al. 2025). 'nft': DiffusionNFT (Zheng et al. 2025), a flow-matching loss on "
        "forward-noised rollouts contrasting implicit positive and negative policies, rollouts "
        "from any solver (sampler.kind ode included) by the old policy, settings in nft.*. "
        "Shared: group_size, prompts_per_step, scale_rewards, adv_clip, kl_beta (with nft an "
        "MSE of velocities to the reference), num_inner_epochs, train_batch_size; loss_type, "
        "clip_range*, kl_mode=reward and timestep_fraction are Flow-GRPO's only.",
        default="flow_grpo",
    )
    group_size: int = _doc(
        "K: samples per prompt; advantages are relative within a group.", default=4
    )
    prompts_per_step: int = _doc("Prompts per RL iteration (global, across ranks).", default=4)
    scale_rewards: str = _doc(
        "Advantage normalisation (trl naming): 'group' std, 'batch' std, or 'none'.",
        default="group",
    )
    adv_clip: float = _doc("Clip advantages to [-adv_clip, adv_clip].", default=5.0)
    loss_type: str = _doc(
        "Policy loss: 'ppo_clip' (clipped ratio per timestep) or 'reinforce'.", default="ppo_clip"
    )
    clip_range: float = _doc(
        "PPO ratio clip range epsilon: ratios are clipped to [1 - eps, 1 + eps].", default=0.2
    )
    clip_range_low: float | None = _doc(
        "Lower clip range when it differs from the upper one: ratios below 1 - clip_range_low "
        "are clipped; empty = clip_range.",
        default=None,
    )
    clip_range_high: float | None = _doc(
        "Upper clip range when it differs from the lower one (asymmetric clipping, DAPO's "
        "clip-higher): [1 - clip_range_low, 1 + clip_range_high]; empty = clip_range.",
        default=None,
    )
    kl_beta: float = _doc(
        "Weight of the latent-space KL to the reference policy; 0 = off.", default=0.0
    )
    kl_mode: str = _doc(
        "'loss': the KL is a loss term (Flow-GRPO); 'reward': its per-sample estimate over the "
        "stochastic steps, log p - log p_ref of the sampled transitions, is subtracted from the "
        "reward before the advantages (as in RLHF PPO), needs rewards.aggregation=reward.",
        default="loss",
    )
    kl_reference: str = _doc(
        "Reference of the KL term (rl.algorithm=nft, rl.kl_beta > 0): 'base' = the start of "
        "training (LoRA: adapters off; full fine-tuning: a frozen copy); 'ema' = an EMA of the "
        "trained weights (rl.kl_reference_decay) after each optimizer step, starting equal to "
        "base (LoRA: float32 EMA of the trainable tensors, swapped in; full fine-tuning: a "
        "float32 EMA written into a frozen copy): an anchor that limits how fast the policy "
        "moves rather than how far it gets from the start.",
        default="base",
    )
    kl_reference_decay: float = _doc(
        "Decay of rl.kl_reference=ema: ema <- decay * ema + (1 - decay) * theta after each "
        "optimizer step, an averaging horizon of about 1 / (1 - decay) steps.",
        default=0.99,
    )
    timestep_fraction: float = _doc(
        "Fraction of the stochastic steps trained per rollout (a random subset of each "
        "trained expert's steps).",
        default=1.0,
    )
    num_inner_epochs: int = _doc("Passes over each rollout batch.", default=1)
    train_batch_size: int = _doc(
        "Samples per training forward (gradient accumulation unit).", default=8
    )

    @property
    def clip_bounds(self) -> tuple[float, float]:
        """(low, high): ratios are clipped to ``[1 - low, 1 + high]``."""
        low = self.clip_range if self.clip_range_low is None else self.clip_range_low
        high = self.clip_range if self.clip_range_high is None else self.clip_range_high
        return low, high

    def __post_init__(self) -> None:
        _check_choice(self.algorithm, "rl.algorithm", ALGORITHMS)
        _check(
            self.group_size >= 2,
            "rl.group_size",
            f"must be >= 2 (advantages are relative within a group), got {self.group_size}",
        )
        _check(
            self.prompts_per_step >= 1,
            "rl.prompts_per_step",
            f"must be >= 1, got {self.prompts_per_step}",
        )
        rollouts = self.group_size * self.prompts_per_step
        _check(
            rollouts <= MAX_ROLLOUTS_PER_STEP,
            "rl.group_size",
            f"rl.group_size x rl.prompts_per_step = {rollouts:,} videos a step; at most "
            f"{MAX_ROLLOUTS_PER_STEP:,}",
        )
        _check_choice(self.scale_rewards, "rl.scale_rewards", ("group", "batch", "none"))
        _check_choice(self.loss_type, "rl.loss_type", ("ppo_clip", "reinforce"))
        _check(self.adv_clip > 0, "rl.adv_clip", f"must be > 0, got {self.adv_clip}")
        _check(
            0 < self.clip_range < 1,
            "rl.clip_range",
            f"must be in (0, 1) (the lower bound 1 - clip_range stays above 0), got "
            f"{self.clip_range}",
        )
        _check(
            self.clip_range_low is None or 0 < self.clip_range_low < 1,
            "rl.clip_range_low",
            f"must be in (0, 1) (the lower bound 1 - clip_range_low stays above 0), or empty for "
            f"clip_range; got {self.clip_range_low}",
        )
        _check(
            self.clip_range_high is None or self.clip_range_high > 0,
            "rl.clip_range_high",
            f"must be > 0 (or empty for clip_range), got {self.clip_range_high}",
        )
        _check(self.kl_beta >= 0, "rl.kl_beta", f"must be >= 0, got {self.kl_beta}")
        _check_choice(self.kl_mode, "rl.kl_mode", ("loss", "reward"))
        self._check_kl_reference()
        _check(
            0 < self.timestep_fraction <= 1,
            "rl.timestep_fraction",
            f"must be in (0, 1], got {self.timestep_fraction}",
        )
        _check(
            self.num_inner_epochs >= 1,
            "rl.num_inner_epochs",
            f"must be >= 1, got {self.num_inner_epochs}",
        )
        _check(
            self.train_batch_size >= 1,
            "rl.train_batch_size",
            f"must be >= 1, got {self.train_batch_size}",
        )

    def _check_kl_reference(self) -> None:
        _check_choice(self.kl_reference, "rl.kl_reference", ("base", "ema"))
        _check_finite(self.kl_reference_decay, "rl.kl_reference_decay")
        _check(
            0 < self.kl_reference_decay < 1,
            "rl.kl_reference_decay",
            f"must be in (0, 1), got {self.kl_reference_decay}",
        )
        if self.kl_reference == "base":
            _check(
                self.kl_reference_decay == RLConfig.kl_reference_decay,
                "rl.kl_reference_decay",
                "is only read with rl.kl_reference=ema; set that or leave the decay at its default",
            )
            return
        _check(
            self.algorithm == "nft",
            "rl.kl_reference",
            "'ema' is implemented for rl.algorithm=nft (its KL is a velocity MSE); use 'base' "
            "with flow_grpo",
        )
        _check(
            self.kl_beta > 0,
            "rl.kl_reference",
            "'ema' is the reference of the KL term, which rl.kl_beta=0 turns off; set "
            "rl.kl_beta > 0 or rl.kl_reference=base",
        )


@dataclass
class NFTConfig:
    """DiffusionNFT (rl.algorithm=nft; Zheng et al. 2025, arXiv 2509.16117): defaults are the
    paper's (its Algorithm 1 and the authors' SD3.5 scripts, NVlabs/DiffusionNFT)."""

    beta: float = _doc(
        "beta of the implicit policies v+ = (1 - beta) v_old + beta v_theta and v- = (1 + beta) "
        "v_old - beta v_theta (the loss is divided by beta so its gradient scale does not "
        "depend on it); the paper's 1, 0.1 in its OCR and multi-reward runs.",
        default=1.0,
    )
    advantage_scale: float = _doc(
        "Z of the optimality probability r = 0.5 + 0.5 * clip(A / Z, -1, 1) of a sample with "
        "group advantage A; the paper's 5 (its adv_clip_max).",
        default=5.0,
    )
    eta_rate: float = _doc(
        "Old-policy soft update after RL step i: theta_old <- eta_i theta_old + (1 - eta_i) "
        "theta with eta_i = min(eta_rate * (i - eta_delay_steps), eta_max), 0 before the delay; "
        "the paper's 0.001 (0.0075 in its OCR run).",
        default=0.001,
    )
    eta_max: float = _doc(
        "Largest eta (see nft.eta_rate); the paper's 0.5 (0.999 in its OCR run).", default=0.5
    )
    eta_delay_steps: int = _doc(
        "RL steps with eta 0 (the old policy follows the current one) before eta grows; the "
        "paper's 0 (75 in its OCR run).",
        default=0,
    )
    timestep_sampling: str = _doc(
        "Noise levels sigma of the training samples x_sigma = (1 - sigma) x0 + sigma eps: "
        "'schedule' = distinct sigmas of the rollout schedule (sampler.num_steps, "
        "sampler.shift) per sample, as the authors' scripts; 'uniform' = sigma ~ U(0, 1).",
        default="schedule",
    )
    timestep_fraction: float = _doc(
        "Noise levels trained per sample and inner epoch: max(1, floor(fraction * "
        "sampler.num_steps)), each with fresh noise (at most the schedule's sigmas within "
        "nft.sigma_range); the authors' 0.99 (9 of 10 steps).",
        default=0.99,
    )
    sigma_range: list[float] = _doc(
        "[low, high]: train only at noise levels low <= sigma <= high (the schedule's sigmas "
        "in it, or U(low, high)); [0, 1] = all, as the paper. A narrower range at high noise "
        "trains where a sample's layout and motion are decided.",
        default_factory=lambda: [0.0, 1.0],
    )
    group_noise: bool = _doc(
        "Noise the samples of a prompt's group with the same noise levels and noise (common "
        "random numbers): with r centred on 0.5 within the group, the noise's own part of the "
        "regression target largely cancels across it, and what is left is the samples' "
        "difference. false = independent noise per sample, as the paper.",
        default=False,
    )
    trust_region: float = _doc(
        "Radius of a trust region on each optimizer step, in the units of "
        "train/old_deviation (mean squared velocity); 0 = off. After the step, the velocity on "
        "the step's first training pass (one chunk at one noise level) is run again (one "
        "forward without gradient) and D, its mean squared change, measured over all ranks; a "
        "step with D > radius is scaled back to sqrt(radius / D) of itself, which meets the "
        "radius to first order (a small step changes the velocity linearly, D quadratically), "
        "as TRPO's line search shrinks a step to its KL bound. A step, not a penalty: a "
        "penalty on |v_theta - v_old|^2 has no gradient where the step starts (theta = "
        "theta_old up to nft.eta's lag). Logged as train/step_deviation (D) and "
        "train/trust_region_scale; not with train.ema_decay (its EMA would see the unscaled "
        "step) nor DeepSpeed (its float32 master weights would undo the scaling).",
        default=0.0,
    )
    guidance: str = _doc(
        "How classifier-free guidance (sampler.guidance_scale > 1) enters: 'none' = "
        "guidance-free rollouts, as the paper (sampler.guidance_scale must be 1); 'rollouts' = "
        "the old policy samples with guidance and v+ and v- are anchored on its conditional "
        "velocity; 'anchor' = the old policy samples with guidance and v+ and v- are anchored "
        "on its guided velocity (each training pass runs the old policy's unconditional branch "
        "too). The trained velocity is the conditional one in every case.",
        default="none",
    )
    adaptive_weighting: bool = _doc(
        "Self-normalised x0 regression (the paper's adaptive loss weighting): each sample's "
        "|x0_hat - x0|^2 divided by its detached mean |x0_hat - x0|; false = the plain "
        "velocity MSE.",
        default=True,
    )

    def __post_init__(self) -> None:
        for key in (
            "beta", "advantage_scale", "eta_rate", "eta_max", "timestep_fraction", "trust_region"
        ):  # fmt: skip
            _check_finite(getattr(self, key), f"nft.{key}")
        _check(self.beta > 0, "nft.beta", f"must be > 0, got {self.beta}")
        _check_choice(self.guidance, "nft.guidance", ("none", "rollouts", "anchor"))
        _check(
            self.advantage_scale > 0,
            "nft.advantage_scale",
            f"must be > 0, got {self.advantage_scale}",
        )
        _check(self.eta_rate >= 0, "nft.eta_rate", f"must be >= 0, got {self.eta_rate}")
        _check(0 <= self.eta_max < 1, "nft.eta_max", f"must be in [0, 1), got {self.eta_max}")
        _check(
            self.eta_delay_steps >= 0,
            "nft.eta_delay_steps",
            f"must be >= 0, got {self.eta_delay_steps}",
        )
        _check(
            self.trust_region >= 0,
            "nft.trust_region",
            f"must be >= 0 (0 turns the trust region off), got {self.trust_region}",
        )
        _check_choice(self.timestep_sampling, "nft.timestep_sampling", ("schedule", "uniform"))
        _check(
            len(self.sigma_range) == 2
            and all(math.isfinite(v) for v in self.sigma_range)
            and 0.0 <= self.sigma_range[0] < self.sigma_range[1] <= 1.0,
            "nft.sigma_range",
            f"must be [low, high] with 0 <= low < high <= 1, got {self.sigma_range}",
        )
        _check(
            0 < self.timestep_fraction <= 1,
            "nft.timestep_fraction",
            f"must be in (0, 1], got {self.timestep_fraction}",
        )

    def eta(self, step: int) -> float:
        """The old policy's soft-update weight after RL step ``step`` (1-based)."""
        if step < self.eta_delay_steps:
            return 0.0
        return min(self.eta_rate * (step - self.eta_delay_steps), self.eta_max)

    def timesteps_per_sample(self, num_steps: int) -> int:
        return max(1, math.floor(self.timestep_fraction * num_steps))


@dataclass
class RewardEntry:
    """One reward function and its weight."""

    name: str = _doc("Registered reward name or 'package.module:callable'.", default="???")
    weight: float = _doc("Weight in the combination.", default=1.0)
    kwargs: dict[str, Any] = _doc(
        "Keyword arguments of the reward factory (e.g. local weight paths).", default_factory=dict
    )


@dataclass
class RewardsConfig:
    """Reward functions (vsa2_rl.rewards) and how they are combined."""

    functions: list[RewardEntry] = _doc(
        "Rewards to compute, each {name, weight, kwargs}.",
        default_factory=lambda: [RewardEntry(name="motion_quality", weight=1.0)],
    )
    aggregation: str = _doc(
        "'reward' = weighted sum of rewards, then advantages; 'advantage' = advantages per "
        "reward, then weighted sum.",
        default="reward",
    )
    on_error: str = _doc(
        "A reward that raises or returns NaN/inf/wrong shape: 'skip' the step, 'stop' the run, "
        "or 'drop_sample' (drop the affected samples).",
        default="skip",
    )
    num_workers: int = _doc("Threads computing rewards concurrently.", default=2)
    timeout_s: float | None = _doc(
        "Seconds a reward may take on one batch; one that takes longer fails as if it had "
        "raised (rewards.on_error) and its thread is left running. Empty = no limit.",
        default=None,
    )
    device: str | None = _doc(
        "Device the rewards score on, e.g. 'cuda:1' or 'cpu': the decoded videos move there "
        "and learned scorers load there on first use (once per process); empty = the run's "
        "device.",
        default=None,
    )
    async_scoring: bool = _doc(
        "Score each chunk of rl.train_batch_size videos in a background thread as soon as it "
        "is decoded, while the rollout samples the next chunks (not named rewards.async: "
        "async is a Python keyword). The update waits for every score, so GRPO stays "
        "on-policy; a reward sees one chunk per call.",
        default=False,
    )

    def __post_init__(self) -> None:
        _check(bool(self.functions), "rewards.functions", "needs at least one reward")
        _check(
            self.device is None or re.fullmatch(r"cpu|cuda(:\d+)?", self.device) is not None,
            "rewards.device",
            f"{self.device!r} is not a device: use cpu, cuda or cuda:N, or leave it empty for "
            "the run's device",
        )
        for index, entry in enumerate(self.functions):
            _check(
                entry.name not in ("", "???"),
                f"rewards.functions[{index}].name",
                "is missing: give a registered reward name or 'package.module:callable'",
            )
        _check(
            any(entry.weight != 0 for entry in self.functions),
            "rewards.functions",
            "every weight is 0, so every advantage would be 0 and nothing would train; give a "
            "reward a non-zero weight",
        )
        _check_choice(self.aggregation, "rewards.aggregation", ("reward", "advantage"))
        _check_choice(self.on_error, "rewards.on_error", ("skip", "stop", "drop_sample"))
        _check(
            self.num_workers >= 1, "rewards.num_workers", f"must be >= 1, got {self.num_workers}"
        )
        _check(
            self.timeout_s is None or self.timeout_s > 0,
            "rewards.timeout_s",
            f"must be > 0 (or empty for no limit), got {self.timeout_s}",
        )
