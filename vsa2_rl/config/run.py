"""Config sections of the run's bookkeeping (``prompts``, ``train``, ``eval``, ``parallel``,
``logging``) and :class:`RunConfig`, the whole config, with the checks across its sections."""

from __future__ import annotations

import dataclasses
import re
import warnings
from dataclasses import dataclass, field

from vsa2_rl.config.algorithm import (
    NFTConfig,
    RewardEntry,
    RewardsConfig,
    RLConfig,
    SamplerConfig,
)
from vsa2_rl.config.checks import (
    MAX_ROLLOUTS_PER_STEP,
    _check,
    _check_choice,
    _check_finite_fields,
    _check_int_fields,
    _doc,
    _expand_user,
)
from vsa2_rl.config.model import AttentionConfig, ModelConfig, SparsityConfig


@dataclass
class PromptsConfig:
    """Prompt set for training and evaluation."""

    file: str | None = _doc(
        "Text file with one prompt per line, or a .jsonl file with one "
        '{"prompt": ..., "image": ...} per line (image-to-video models; relative image paths '
        "are resolved against the file's folder); empty = the toy task's built-in prompts, which "
        "only model.kind=toy may use.",
        default=None,
    )
    eval_file: str | None = _doc(
        "Prompt file for evaluation, text or .jsonl with one "
        '{"prompt": ..., "image": ...} per line (image-to-video models); empty = prompts.file.',
        default=None,
    )

    def __post_init__(self) -> None:
        _expand_user(self, "file", "eval_file")


@dataclass
class TrainConfig:
    """Optimisation and bookkeeping of the RL run."""

    num_steps: int = _doc("RL iterations (rollout + update).", default=20)
    learning_rate: float = _doc("AdamW learning rate.", default=1e-4)
    weight_decay: float = _doc("AdamW weight decay.", default=0.0)
    warmup_steps: int = _doc("Linear learning-rate warm-up steps.", default=0)
    max_grad_norm: float = _doc("Gradient-norm clip; 0 = off.", default=1.0)
    ema_decay: float = _doc("EMA of trainable weights (used for eval); 0 = off.", default=0.0)
    checkpoint_every: int = _doc(
        "Save a full checkpoint every N steps; 0 = only at the end.", default=10
    )
    keep_last: int = _doc("Checkpoints kept on disk.", default=2)
    sample_every: int = _doc("Save sample videos every N steps; 0 = never.", default=10)
    resume: str = _doc(
        "'auto' = continue from the newest complete checkpoint in out_dir if any, 'none', or a "
        "checkpoint folder.",
        default="auto",
    )

    def __post_init__(self) -> None:
        _expand_user(self, "resume")
        _check(self.num_steps >= 1, "train.num_steps", f"must be >= 1, got {self.num_steps}")
        _check(
            self.learning_rate > 0,
            "train.learning_rate",
            f"must be > 0, got {self.learning_rate}",
        )
        _check(
            0 <= self.ema_decay < 1, "train.ema_decay", f"must be in [0, 1), got {self.ema_decay}"
        )
        # a negative warm-up would give a negative learning rate (gradient ascent)
        for key in ("weight_decay", "warmup_steps", "max_grad_norm", "checkpoint_every"):
            value = getattr(self, key)
            _check(value >= 0, f"train.{key}", f"must be >= 0, got {value}")
        _check(
            self.sample_every >= 0,
            "train.sample_every",
            f"must be >= 0 (0 = never), got {self.sample_every}",
        )
        _check(self.keep_last >= 1, "train.keep_last", f"must be >= 1, got {self.keep_last}")


@dataclass
class EvalConfig:
    """Sparsity-sweep evaluation (vsa2-rl eval)."""

    sparsities: list[float] = _doc(
        "Inference sparsities to evaluate (0.0 = dense attention).",
        default_factory=lambda: [0.0, 0.5, 0.75, 0.9],
    )
    num_prompts: int = _doc("Prompts evaluated (first N of the eval prompt set).", default=8)
    samples_per_prompt: int = _doc(
        "Videos per evaluated prompt, each from its own noise (more of them: a steadier "
        "estimate of a share such as prompt_direction's).",
        default=1,
    )
    seed: int = _doc(
        "Seed of the evaluation noise (the same for every sparsity and run).", default=1234
    )
    every: int = _doc(
        "During training: deterministic evaluation at the eval sparsity before the first step, "
        "every N steps and after the last (logged as eval/*); 0 = never.",
        default=0,
    )
    guidance_scale: float | None = _doc(
        "Classifier-free guidance scale of evaluations (ODE); empty = sampler.guidance_scale.",
        default=None,
    )
    guidance_scale_2: float | None = _doc(
        "Wan2.2 A14B: evaluations' guidance scale below the experts' boundary; empty = "
        "sampler.guidance_scale_2 when eval.guidance_scale is empty too, else "
        "eval.guidance_scale.",
        default=None,
    )
    guard_rewards: list[RewardEntry] = _doc(
        "Guard metrics, each {name, kwargs} like rewards.functions (weight unused): scored at "
        "every evaluation (logged as eval/guard/<name>, and by vsa2-rl eval), never trained on, "
        "so that reward hacking shows.",
        default_factory=list,
    )
    agreement_prompts: int = _doc(
        "Rollout agreement: the ODE trajectories of the first N evaluated prompts (every sample "
        "of each) measure velocity_rel_error, the relative L2 error of the velocity at the "
        "evaluated sparsity against dense attention at each step (one extra dense forward a "
        "step); in eval.json and metrics.jsonl (eval/velocity_rel_error, "
        "eval/rollout_velocity_rel_error); 0 = not measured.",
        default=8,
    )

    def select_prompts(self, prompts: list[str]) -> list[str]:
        """The evaluated prompts: the first ``num_prompts``, each ``samples_per_prompt`` times
        (with a warning when the set holds fewer: then all of them)."""
        if self.num_prompts > len(prompts):
            warnings.warn(
                f"eval.num_prompts={self.num_prompts} but the evaluation prompt set holds "
                f"{len(prompts)}; evaluating all {len(prompts)}",
                stacklevel=2,
            )
        return [p for p in prompts[: self.num_prompts] for _ in range(self.samples_per_prompt)]

    @property
    def agreement_videos(self) -> int:
        """The evaluated videos (the first ones) whose trajectories measure velocity_rel_error:
        every sample of the first ``agreement_prompts`` prompts."""
        return min(self.agreement_prompts, self.num_prompts) * self.samples_per_prompt

    def __post_init__(self) -> None:
        _check(bool(self.sparsities), "eval.sparsities", "needs at least one value")
        for index, entry in enumerate(self.guard_rewards):
            _check(
                entry.name not in ("", "???"),
                f"eval.guard_rewards[{index}].name",
                "is missing: give a registered reward name or 'package.module:callable'",
            )
        for value in self.sparsities:
            _check(0.0 <= value < 1.0, "eval.sparsities", f"each must be in [0, 1), got {value}")
        repeated = sorted({v for v in self.sparsities if self.sparsities.count(v) > 1})
        _check(not repeated, "eval.sparsities", f"{repeated} given more than once")
        _check(self.seed >= 0, "eval.seed", f"must be >= 0, got {self.seed}")
        _check(self.num_prompts >= 1, "eval.num_prompts", f"must be >= 1, got {self.num_prompts}")
        _check(
            self.samples_per_prompt >= 1,
            "eval.samples_per_prompt",
            f"must be >= 1, got {self.samples_per_prompt}",
        )
        _check(
            self.samples_per_prompt <= MAX_ROLLOUTS_PER_STEP,
            "eval.samples_per_prompt",
            f"must be at most {MAX_ROLLOUTS_PER_STEP:,} videos a prompt (every sparsity makes "
            f"them all), got {self.samples_per_prompt:,}; 1 to 8 give a steady estimate",
        )
        _check(self.every >= 0, "eval.every", f"must be >= 0, got {self.every}")
        _check(
            self.agreement_prompts >= 0,
            "eval.agreement_prompts",
            f"must be >= 0 (0 = velocity_rel_error not measured), got {self.agreement_prompts}",
        )
        _check(
            self.guidance_scale is None or self.guidance_scale >= 1.0,
            "eval.guidance_scale",
            f"must be >= 1 (1 disables guidance; empty = sampler.guidance_scale), got "
            f"{self.guidance_scale}",
        )
        _check(
            self.guidance_scale_2 is None or self.guidance_scale_2 >= 1.0,
            "eval.guidance_scale_2",
            f"must be >= 1 (1 disables guidance), got {self.guidance_scale_2}",
        )


@dataclass
class ParallelConfig:
    """Parallelism beyond data parallelism (the launcher's processes are the world)."""

    sequence_parallel_size: int = _doc(
        "Ulysses sequence parallelism: groups of this many consecutive ranks share each video, "
        "every rank holding a slice of its tokens (must divide the number of processes and "
        "the attention heads; needs VSA2 attention and DDP, not DeepSpeed); 1 = off.",
        default=1,
    )

    def __post_init__(self) -> None:
        _check(
            self.sequence_parallel_size >= 1,
            "parallel.sequence_parallel_size",
            f"must be >= 1 (1 = off), got {self.sequence_parallel_size}",
        )


@dataclass
class LoggingConfig:
    """Where metrics go besides out_dir/metrics.jsonl."""

    report_to: list[str] = _doc(
        "Trackers: any of wandb, tensorboard; empty = metrics.jsonl only.", default_factory=list
    )
    wandb_mode: str = _doc(
        "wandb mode: offline (default, no network) or online.", default="offline"
    )
    project: str = _doc("wandb project / tensorboard run group.", default="vsa2_rl")
    progress: bool = _doc("Show progress bars.", default=True)

    def __post_init__(self) -> None:
        for tracker in self.report_to:
            _check_choice(tracker, "logging.report_to", ("wandb", "tensorboard"))
        _check_choice(self.wandb_mode, "logging.wandb_mode", ("offline", "online", "disabled"))


@dataclass
class RunConfig:
    """A whole vsa2_rl run (training or evaluation)."""

    out_dir: str = _doc(
        "Run directory: metrics, checkpoints, samples, plots.", default="runs/default"
    )
    seed: int = _doc("Global seed.", default=0)
    device: str = _doc("auto (CUDA if available), cpu or cuda[:N].", default="auto")
    model: ModelConfig = field(default_factory=ModelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    sparsity: SparsityConfig = field(default_factory=SparsityConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    nft: NFTConfig = field(default_factory=NFTConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    prompts: PromptsConfig = field(default_factory=PromptsConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        _expand_user(self, "out_dir")
        _check_finite_fields(self, "")
        _check_int_fields(self, "")
        _check(self.seed >= 0, "seed", f"must be >= 0, got {self.seed}")
        _check(bool(self.out_dir), "out_dir", "must not be empty")
        _check(
            re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None,
            "device",
            f"got {self.device!r}, expected auto, cpu or cuda[:N]",
        )
        _check(
            not (self.rl.kl_mode == "reward" and self.rewards.aggregation == "advantage"),
            "rl.kl_mode",
            "'reward' subtracts the KL from the combined reward, so it needs "
            "rewards.aggregation=reward (with 'advantage' there is no combined reward)",
        )
        _check(
            not self.sampler.negative_prompt
            or max(self.sampler.guidance_scale, self.eval_guidance_scale) > 1
            or max(self.sampler.guidance_scale_2 or 1.0, self.eval_guidance_scale_2 or 1.0) > 1,
            "sampler.negative_prompt",
            "is only used by classifier-free guidance, and sampler.guidance_scale and "
            "eval.guidance_scale are both 1; raise one of them or leave it empty",
        )

        self._check_prompts()
        self._check_algorithm()

    def _check_prompts(self) -> None:
        """Only the toy trains on the toy task's built-in prompts: a real model without a prompt
        file would learn to draw coloured squares (prompts are checked at load, before a model's
        tens of gigabytes load)."""
        _check(
            self.model.kind == "toy" or bool(self.prompts.file),
            "prompts.file",
            f"model.kind={self.model.kind} needs a prompt file (the built-in prompts are the toy "
            "task's); give one (one prompt per line, or .jsonl with condition images), e.g. the "
            "shipped prompts.file=configs/prompts/wan_motion_train.txt",
        )

    def _check_algorithm(self) -> None:
        """Settings that only one update rule can honour (vsa2_rl.rl.nft says why)."""
        if self.rl.algorithm == "flow_grpo":
            _check(
                self.sampler.kind != "ode",
                "sampler.kind",
                "'ode' rollouts have no log-probs for Flow-GRPO to train on; use sde or cps, "
                "or rl.algorithm=nft",
            )
            _check(
                self.sampler.noise_level > 0,
                "sampler.noise_level",
                "0 makes every rollout step deterministic (an ODE): Flow-GRPO has no log-probs "
                "to train on; use a level > 0 (0.7 is Flow-GRPO's), or rl.algorithm=nft",
            )
            changed = [
                f.name
                for f in dataclasses.fields(NFTConfig)
                if getattr(self.nft, f.name) != getattr(NFTConfig(), f.name)
            ]
            _check(
                not changed,
                f"nft.{changed[0] if changed else ''}",
                "is only read by rl.algorithm=nft (this run is flow_grpo); set "
                "rl.algorithm=nft or leave nft.* at its defaults",
            )
            return
        _check(
            self.rl.kl_mode == "loss",
            "rl.kl_mode",
            "'reward' needs the log-probs of SDE transitions, which nft does not use; with "
            "rl.algorithm=nft the KL is a loss term (rl.kl_mode=loss)",
        )
        guided = max(self.sampler.guidance_scale, self.sampler.guidance_scale_2 or 1.0) > 1
        if self.nft.guidance == "none":
            for key in ("guidance_scale", "guidance_scale_2"):
                _check(
                    getattr(self.sampler, key) in (None, 1.0),
                    f"sampler.{key}",
                    "with nft.guidance=none nft samples its rollouts without guidance, as the "
                    f"DiffusionNFT paper: set 1 (eval.{key} may differ), or guide them with "
                    "nft.guidance=rollouts or anchor",
                )
        _check(
            self.nft.guidance == "none" or guided,
            "nft.guidance",
            f"{self.nft.guidance} guides the rollouts with sampler.guidance_scale, which is 1; "
            "raise it (e.g. 5) or set nft.guidance=none",
        )

    @property
    def eval_guidance_scale(self) -> float:
        """The guidance scale of evaluations: ``eval.guidance_scale``, else the rollouts'."""
        scale = self.eval.guidance_scale
        return self.sampler.guidance_scale if scale is None else scale

    @property
    def eval_guidance_scale_2(self) -> float | None:
        """Evaluations' scale below Wan2.2 A14B's boundary (None: ``eval_guidance_scale``):
        ``eval.guidance_scale_2``, else the rollouts' when evaluation keeps their scale."""
        if self.eval.guidance_scale_2 is not None:
            return self.eval.guidance_scale_2
        return self.sampler.guidance_scale_2 if self.eval.guidance_scale is None else None
