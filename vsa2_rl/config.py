"""Typed configuration of vsa2_rl: OmegaConf structured schemas and the loader.

Precedence is schema defaults <- YAML file <- command-line dotlist overrides
(``train.num_steps=2 out_dir=runs/x``), the OmegaConf recipe that trl and FastVideo users know.
Every field documents itself through ``metadata["help"]`` (printed by ``vsa2-rl train --help``).
Unknown keys, wrong types and contradictory settings raise :class:`ConfigError` naming the key
and the fix before any work starts; ``load_config`` returns plain dataclass instances, so
``__post_init__`` checks run on the merged result.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import random
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "default.yaml")


class ConfigError(ValueError):
    """A configuration problem; the message names the key and the fix."""


def _doc(text: str, **kwargs: Any) -> Any:
    """A dataclass field with its help text (kept in ``metadata`` for ``--help``)."""
    return field(metadata={"help": text}, **kwargs)


def _check(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{key}: {message}")


def _check_choice(value: str, key: str, choices: tuple[str, ...]) -> None:
    _check(value in choices, key, f"got {value!r}, expected one of {', '.join(choices)}")


def _check_finite(value: float, key: str) -> None:
    _check(math.isfinite(value), key, f"must be a finite number, got {value}")


def _check_finite_fields(section, prefix: str) -> None:
    """Every float of ``section`` and of its nested sections (lists included) is finite: an inf
    learning rate, noise level or shift would only show as NaN videos mid-run."""
    for entry in dataclasses.fields(section):
        value, key = getattr(section, entry.name), f"{prefix}{entry.name}"
        if dataclasses.is_dataclass(value):
            _check_finite_fields(value, f"{key}.")
        elif isinstance(value, float):
            _check_finite(value, key)
        elif isinstance(value, list):
            for index, item in enumerate(value):
                if isinstance(item, float):
                    _check_finite(item, key)
                elif dataclasses.is_dataclass(item):
                    _check_finite_fields(item, f"{key}[{index}].")


# The largest integer any key takes (int32's): beyond it a value is a typo, and a size
# (group_size, num_steps) would exhaust memory or never end rather than fail.
MAX_INT = 2**31 - 1
MAX_ROLLOUTS_PER_STEP = 100_000


def _check_int(value: int, key: str) -> None:
    _check(abs(value) <= MAX_INT, key, f"must be at most 2**31 - 1 in size, got {value}")


def _check_int_fields(section, prefix: str) -> None:
    """Every integer of ``section`` and of its nested sections is at most ``MAX_INT`` in size."""
    for entry in dataclasses.fields(section):
        value, key = getattr(section, entry.name), f"{prefix}{entry.name}"
        if dataclasses.is_dataclass(value):
            _check_int_fields(value, f"{key}.")
        items = value if isinstance(value, list) else [value]
        for item in items:
            if isinstance(item, int) and not isinstance(item, bool):
                _check_int(item, key)


def _is_adapter_folder(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, "adapter_config.json")) and os.path.isfile(
        os.path.join(folder, "adapter_model.safetensors")
    )


@dataclass
class LoraConfig:
    """LoRA adapters on the transformer (peft). Disabled = full fine-tuning."""

    enabled: bool = _doc("Train LoRA adapters instead of all weights.", default=False)
    rank: int = _doc("LoRA rank r.", default=16)
    alpha: float = _doc("LoRA scaling alpha (effective scale alpha / rank).", default=16.0)
    target_modules: list[str] = _doc(
        "Module names to adapt (peft target_modules).",
        default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"],
    )
    init_from: str | None = _doc(
        "A peft adapter folder (adapter_config.json + adapter_model.safetensors, e.g. from "
        "vsa2-rl export; for Wan2.2 A14B an export with transformer/ and transformer_2/ "
        "adapter folders) to start the adapters from; its rank, alpha and target modules must "
        "equal these. Empty = fresh adapters.",
        default=None,
    )

    def __post_init__(self) -> None:
        _check(self.rank >= 1, "model.lora.rank", f"must be >= 1, got {self.rank}")
        _check(self.alpha > 0, "model.lora.alpha", f"must be > 0, got {self.alpha}")
        _check(bool(self.target_modules), "model.lora.target_modules", "must not be empty")
        if self.init_from:
            folders = [self.init_from] + [
                os.path.join(self.init_from, expert) for expert in ("transformer", "transformer_2")
            ]
            _check(
                any(_is_adapter_folder(folder) for folder in folders),
                "model.lora.init_from",
                f"{self.init_from} is not a peft adapter folder (adapter_config.json + "
                "adapter_model.safetensors, as vsa2-rl export writes)",
            )


@dataclass
class ModelConfig:
    """The video DiT to fine-tune."""

    kind: str = _doc(
        "'toy' = the library's small Wan-architecture model (pixel latents, built-in text "
        "encoder; no download), 'wan' = a local diffusers Wan2.1 or Wan2.2 directory at "
        "model.path (T2V, I2V, TI2V-5B, A14B; what it is comes from its model_index.json).",
        default="toy",
    )
    path: str | None = _doc(
        "Local directory of the model. kind=wan: a diffusers Wan folder such as "
        "/data/Wan2.1-T2V-1.3B-Diffusers (transformer/, text_encoder/, tokenizer/, vae/; "
        "Wan2.2 A14B adds transformer_2/, Wan2.1 I2V image_encoder/ and image_processor/). "
        "kind=toy: optional checkpoint folder; empty = the shipped toy model.",
        default=None,
    )
    train_experts: list[str] = _doc(
        "Wan2.2 A14B: the experts RL trains, of high_noise (the folder's transformer/) and "
        "low_noise (transformer_2/); the other stays frozen and holds no optimizer state. "
        "Empty = every expert (and the only choice for one-transformer models).",
        default_factory=list,
    )
    dtype: str = _doc(
        "Weights/compute dtype: auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16.",
        default="auto",
    )
    num_frames: int = _doc("Frames per generated video (pixel space).", default=8)
    height: int = _doc("Video height in pixels.", default=32)
    width: int = _doc("Video width in pixels.", default=32)
    text_cache_dir: str | None = _doc(
        "Folder for cached prompt embeddings (one file per prompt); empty = out_dir/text_cache.",
        default=None,
    )
    gradient_checkpointing: bool = _doc(
        "Recompute transformer blocks in the backward pass to save memory.", default=False
    )
    compile_blocks: bool = _doc(
        "torch.compile every transformer block (diffusers' regional compilation): faster steps "
        "after the first ones, which compile. The VSA2 call stays eager inside each block "
        "(vsa2_rl.models.wan.compile_blocks says how).",
        default=False,
    )
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        _check_choice(self.kind, "model.kind", ("toy", "wan"))
        for expert in self.train_experts:
            _check_choice(expert, "model.train_experts", ("high_noise", "low_noise"))
        _check(
            len(set(self.train_experts)) == len(self.train_experts),
            "model.train_experts",
            f"names an expert twice: {list(self.train_experts)}",
        )
        _check_choice(self.dtype, "model.dtype", ("auto", "float32", "bfloat16", "float16"))
        if self.path and os.path.isdir(self.path):
            _check(
                bool(os.listdir(self.path)),
                "model.path",
                f"{self.path} is an empty folder; point it at the model's files",
            )
        for key in ("height", "width"):
            value = getattr(self, key)
            _check(value >= 1, f"model.{key}", f"must be >= 1, got {value}")
        _check(
            self.num_frames >= 2,
            "model.num_frames",
            f"must be >= 2 (the rewards score motion between frames), got {self.num_frames}",
        )
        if self.kind == "wan":
            _check(
                bool(self.path),
                "model.path",
                "model.kind=wan needs a local diffusers Wan directory, "
                "e.g. model.path=/data/Wan2.1-T2V-1.3B-Diffusers",
            )
        _check(
            self.kind == "wan" or not self.train_experts,
            "model.train_experts",
            "the toy model has one transformer; leave it empty",
        )


@dataclass
class AttentionConfig:
    """VSA2 sparse attention (docs/concepts.md, "VSA2 attention")."""

    enabled: bool = _doc("Use VSA2 in self-attention; false = dense attention.", default=True)
    q_tile: int = _doc("Query tile size in tokens (one 4x4x4 cube).", default=64)
    kv_block: int = _doc("Key segment size chosen by the router: 16, 32 or 64.", default=16)
    mode: str = _doc(
        "Router selection: 'topp' (variable count: smallest set with router mass >= top_p) or "
        "'topk' (fixed count, VSA-compatible).",
        default="topp",
    )
    top_p: float = _doc("Router mass each query tile must cover in topp mode.", default=0.9)
    min_kv: int = _doc("Fewest key segments per query tile.", default=1)
    dense_threshold: float = _doc(
        "While the scheduled density (1 - sparsity) is >= this, the fine stage is exact dense "
        "attention (sparse rebasing warm-up).",
        default=0.99,
    )
    backend: str = _doc(
        "Kernel backend: auto (Triton on CUDA, torch reference on CPU), triton, torch.",
        default="auto",
    )

    def __post_init__(self) -> None:
        _check(self.q_tile == 64, "attention.q_tile", f"only 64 is supported, got {self.q_tile}")
        _check(
            self.kv_block in (16, 32, 64),
            "attention.kv_block",
            f"must be 16, 32 or 64, got {self.kv_block}",
        )
        _check_choice(self.mode, "attention.mode", ("topp", "topk"))
        _check(0.0 < self.top_p <= 1.0, "attention.top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.min_kv >= 1, "attention.min_kv", f"must be >= 1, got {self.min_kv}")
        _check(
            0.0 < self.dense_threshold <= 1.0,
            "attention.dense_threshold",
            f"must be in (0, 1], got {self.dense_threshold}",
        )
        _check_choice(self.backend, "attention.backend", ("auto", "triton", "torch"))


# The kernels and models take the attention settings under this name (docs/kernels.md).
VSA2Config = AttentionConfig


@dataclass
class SparsityConfig:
    """Hard-to-easy sparsity schedule: rollout and training share one value, evaluation is lower."""

    train: float = _doc("Sparsity of rollouts and training forwards (after warm-up).", default=0.9)
    train_end: float | None = _doc(
        "If set, the train/rollout sparsity moves linearly from `train` to this value over the "
        "run (a curriculum); empty = constant.",
        default=None,
    )
    eval: float = _doc("Sparsity used for evaluation (lower = easier).", default=0.75)
    warmup_steps: int = _doc(
        "Sparse-rebasing warm-up: density anneals from dense to the target over these steps.",
        default=0,
    )
    warmup_shape: str = _doc("Warm-up curve: linear or cosine.", default="cosine")

    def __post_init__(self) -> None:
        for key in ("train", "eval"):
            value = getattr(self, key)
            _check(0.0 <= value < 1.0, f"sparsity.{key}", f"must be in [0, 1), got {value}")
        if self.train_end is not None:
            _check(
                0.0 <= self.train_end < 1.0,
                "sparsity.train_end",
                f"must be in [0, 1), got {self.train_end}",
            )
        _check(
            self.eval <= self.train,
            "sparsity.eval",
            f"hard-to-easy: evaluation sparsity ({self.eval}) must not exceed the train "
            f"sparsity ({self.train}); lower sparsity.eval or raise sparsity.train",
        )
        _check(
            self.warmup_steps >= 0,
            "sparsity.warmup_steps",
            f"must be >= 0, got {self.warmup_steps}",
        )
        _check_choice(self.warmup_shape, "sparsity.warmup_shape", ("linear", "cosine"))


@dataclass
class SamplerConfig:
    """Flow-matching sampler for rollouts (SDE) and evaluation (deterministic ODE)."""

    kind: str = _doc(
        "Rollout sampler: 'sde' (Flow-GRPO), 'cps' (coefficient-preserving) or 'ode' "
        "(deterministic Euler, no log-probs: grpo.algorithm=nft only, the DiffusionNFT paper's "
        "setting).",
        default="sde",
    )
    num_steps: int = _doc("Denoising steps per rollout.", default=10)
    eval_num_steps: int = _doc("ODE steps for evaluation and sample videos.", default=10)
    shift: float = _doc(
        "Timestep shift of the sigma schedule (Wan uses 3-5 at 480p/720p).", default=1.0
    )
    noise_level: float = _doc(
        "SDE noise level a (> 0 for Flow-GRPO; 0 = ODE steps, for grpo.algorithm=nft).",
        default=0.7,
    )
    guidance_scale: float = _doc(
        "Classifier-free guidance scale of rollouts and training; 1 = no guidance. Both use the "
        "same guided velocity, so the trained log-probs are those of the policy that sampled.",
        default=1.0,
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


ALGORITHMS = ("flow_grpo", "nft")


@dataclass
class GRPOConfig:
    """Group-relative RL: prompt groups, advantages and the update rule (grpo.algorithm)."""

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
    timestep_fraction: float = _doc(
        "Fraction of the stochastic steps trained per rollout (random subset).", default=1.0
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
        _check_choice(self.algorithm, "grpo.algorithm", ALGORITHMS)
        _check(
            self.group_size >= 2,
            "grpo.group_size",
            f"must be >= 2 (advantages are relative within a group), got {self.group_size}",
        )
        _check(
            self.prompts_per_step >= 1,
            "grpo.prompts_per_step",
            f"must be >= 1, got {self.prompts_per_step}",
        )
        rollouts = self.group_size * self.prompts_per_step
        _check(
            rollouts <= MAX_ROLLOUTS_PER_STEP,
            "grpo.group_size",
            f"grpo.group_size x grpo.prompts_per_step = {rollouts:,} videos a step; at most "
            f"{MAX_ROLLOUTS_PER_STEP:,}",
        )
        _check_choice(self.scale_rewards, "grpo.scale_rewards", ("group", "batch", "none"))
        _check_choice(self.loss_type, "grpo.loss_type", ("ppo_clip", "reinforce"))
        _check(self.adv_clip > 0, "grpo.adv_clip", f"must be > 0, got {self.adv_clip}")
        _check(
            0 < self.clip_range < 1,
            "grpo.clip_range",
            f"must be in (0, 1) (the lower bound 1 - clip_range stays above 0), got "
            f"{self.clip_range}",
        )
        _check(
            self.clip_range_low is None or 0 < self.clip_range_low < 1,
            "grpo.clip_range_low",
            f"must be in (0, 1) (the lower bound 1 - clip_range_low stays above 0), or empty for "
            f"clip_range; got {self.clip_range_low}",
        )
        _check(
            self.clip_range_high is None or self.clip_range_high > 0,
            "grpo.clip_range_high",
            f"must be > 0 (or empty for clip_range), got {self.clip_range_high}",
        )
        _check(self.kl_beta >= 0, "grpo.kl_beta", f"must be >= 0, got {self.kl_beta}")
        _check_choice(self.kl_mode, "grpo.kl_mode", ("loss", "reward"))
        _check(
            0 < self.timestep_fraction <= 1,
            "grpo.timestep_fraction",
            f"must be in (0, 1], got {self.timestep_fraction}",
        )
        _check(
            self.num_inner_epochs >= 1,
            "grpo.num_inner_epochs",
            f"must be >= 1, got {self.num_inner_epochs}",
        )
        _check(
            self.train_batch_size >= 1,
            "grpo.train_batch_size",
            f"must be >= 1, got {self.train_batch_size}",
        )


@dataclass
class NFTConfig:
    """DiffusionNFT (grpo.algorithm=nft; Zheng et al. 2025, arXiv 2509.16117): defaults are the
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
    adaptive_weighting: bool = _doc(
        "Self-normalised x0 regression (the paper's adaptive loss weighting): each sample's "
        "|x0_hat - x0|^2 divided by its detached mean |x0_hat - x0|; false = the plain "
        "velocity MSE.",
        default=True,
    )

    def __post_init__(self) -> None:
        for key in ("beta", "advantage_scale", "eta_rate", "eta_max", "timestep_fraction"):
            _check_finite(getattr(self, key), f"nft.{key}")
        _check(self.beta > 0, "nft.beta", f"must be > 0, got {self.beta}")
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
        "Score each chunk of grpo.train_batch_size videos in a background thread as soon as it "
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


@dataclass
class PromptsConfig:
    """Prompt set for training and evaluation."""

    file: str | None = _doc(
        "Text file with one prompt per line, or a .jsonl file with one "
        '{"prompt": ..., "image": ...} per line (image-to-video models; relative image paths '
        "are resolved against the file's folder); empty = the built-in toy motion prompts.",
        default=None,
    )
    eval_file: str | None = _doc(
        "Prompt file for evaluation, text or .jsonl with one "
        '{"prompt": ..., "image": ...} per line (image-to-video models); empty = prompts.file.',
        default=None,
    )

    def __post_init__(self) -> None:
        for key in ("file", "eval_file"):
            path = getattr(self, key)
            if path:
                _check(os.path.isfile(path), f"prompts.{key}", f"file not found: {path}")


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
        if self.resume not in ("auto", "none"):
            _check(
                os.path.isdir(self.resume),
                "train.resume",
                f"checkpoint folder not found: {self.resume} (use auto, none or a folder)",
            )
            _check(
                os.path.isfile(os.path.join(self.resume, "COMPLETE")),
                "train.resume",
                f"{self.resume} is not a checkpoint (no COMPLETE marker); give a "
                "checkpoints/step_N folder of a run, or auto",
            )


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
    guard_rewards: list[RewardEntry] = _doc(
        "Guard metrics, each {name, kwargs} like rewards.functions (weight unused): scored at "
        "every evaluation (logged as eval/guard/<name>, and by vsa2-rl eval), never trained on, "
        "so that reward hacking shows.",
        default_factory=list,
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
        _check(self.every >= 0, "eval.every", f"must be >= 0, got {self.every}")
        _check(
            self.guidance_scale is None or self.guidance_scale >= 1.0,
            "eval.guidance_scale",
            f"must be >= 1 (1 disables guidance; empty = sampler.guidance_scale), got "
            f"{self.guidance_scale}",
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
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    nft: NFTConfig = field(default_factory=NFTConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    prompts: PromptsConfig = field(default_factory=PromptsConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    run_dirs: list[str] = _doc(
        "vsa2-rl eval: training run folders to evaluate (newest checkpoint of each).",
        default_factory=list,
    )
    run_dir: str | None = _doc(
        "vsa2-rl eval: one training run folder (same as run_dirs=[DIR]).", default=None
    )
    checkpoint: str | None = _doc("vsa2-rl eval: one checkpoint folder to evaluate.", default=None)

    def __post_init__(self) -> None:
        _check_finite_fields(self, "")
        _check_int_fields(self, "")
        _check(self.seed >= 0, "seed", f"must be >= 0, got {self.seed}")
        _check(bool(self.out_dir), "out_dir", "must not be empty")
        _check(
            re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None,
            "device",
            f"got {self.device!r}, expected auto, cpu or cuda[:N]",
        )
        if self.model.kind == "wan" and self.model.path:
            _check(
                os.path.isdir(self.model.path),
                "model.path",
                f"directory not found: {self.model.path} (put a local diffusers Wan2.1 folder "
                "there, e.g. Wan2.1-T2V-1.3B-Diffusers)",
            )
        if self.model.kind == "toy" and self.model.path:
            _check(
                os.path.isdir(self.model.path),
                "model.path",
                f"directory not found: {self.model.path} (leave empty for the shipped toy model)",
            )
        if self.checkpoint:
            _check(
                os.path.isfile(os.path.join(self.checkpoint, "COMPLETE")),
                "checkpoint",
                f"{self.checkpoint} is not a checkpoint folder (no COMPLETE marker); give a "
                "run's checkpoints/step_N folder, or run_dir= for its newest",
            )
        _check(
            not (self.grpo.kl_mode == "reward" and self.rewards.aggregation == "advantage"),
            "grpo.kl_mode",
            "'reward' subtracts the KL from the combined reward, so it needs "
            "rewards.aggregation=reward (with 'advantage' there is no combined reward)",
        )
        _check(
            not self.sampler.negative_prompt
            or max(self.sampler.guidance_scale, self.eval_guidance_scale) > 1,
            "sampler.negative_prompt",
            "is only used by classifier-free guidance, and sampler.guidance_scale and "
            "eval.guidance_scale are both 1; raise one of them or leave it empty",
        )

        self._check_algorithm()

    def _check_algorithm(self) -> None:
        """Settings that only one update rule can honour (vsa2_rl.rl.nft says why)."""
        if self.grpo.algorithm == "flow_grpo":
            _check(
                self.sampler.kind != "ode",
                "sampler.kind",
                "'ode' rollouts have no log-probs for Flow-GRPO to train on; use sde or cps, "
                "or grpo.algorithm=nft",
            )
            _check(
                self.sampler.noise_level > 0,
                "sampler.noise_level",
                "0 makes every rollout step deterministic (an ODE): Flow-GRPO has no log-probs "
                "to train on; use a level > 0 (0.7 is Flow-GRPO's), or grpo.algorithm=nft",
            )
            changed = [
                f.name
                for f in dataclasses.fields(NFTConfig)
                if getattr(self.nft, f.name) != getattr(NFTConfig(), f.name)
            ]
            _check(
                not changed,
                f"nft.{changed[0] if changed else ''}",
                "is only read by grpo.algorithm=nft (this run is flow_grpo); set "
                "grpo.algorithm=nft or leave nft.* at its defaults",
            )
            return
        _check(
            self.grpo.kl_mode == "loss",
            "grpo.kl_mode",
            "'reward' needs the log-probs of SDE transitions, which nft does not use; with "
            "grpo.algorithm=nft the KL is a loss term (grpo.kl_mode=loss)",
        )
        _check(
            self.sampler.guidance_scale == 1.0,
            "sampler.guidance_scale",
            "nft trains the conditional velocity alone (CFG-free, as the DiffusionNFT paper), "
            "so its rollouts must come from that policy: set 1 (eval.guidance_scale may differ)",
        )

    @property
    def eval_guidance_scale(self) -> float:
        """The guidance scale of evaluations: ``eval.guidance_scale``, else the rollouts'."""
        scale = self.eval.guidance_scale
        return self.sampler.guidance_scale if scale is None else scale


def _all_keys(schema: Any, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(schema):
        name = prefix + f.name
        keys.append(name)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            keys.extend(_all_keys(default, name + "."))
    return keys


def _friendly(error: OmegaConfBaseException) -> ConfigError:
    """Turns an OmegaConf error into one line naming the key and the fix."""
    key = getattr(error, "full_key", None) or ""
    message = str(error).splitlines()[0]
    if "is not a ListConfig" in message:
        return ConfigError(f"{key}: expects a list, e.g. {key}=[0.0,0.5] (brackets, no spaces)")
    if ("not in struct" in message or "Key '" in message) and ":" in key.split(".")[-1]:
        return ConfigError(
            f"{key}: YAML reads this as one key because no space follows the colon; write "
            f"{{{key.split('.')[-1].replace(':', ': ', 1)}}}"
        )
    if "not in struct" in message or ("Key '" in message and "not" in message):
        close = difflib.get_close_matches(key, _all_keys(RunConfig), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return ConfigError(f"{key}: unknown config key{hint}; see `vsa2-rl train --help`")
    return ConfigError(f"{key or 'config'}: {message}")


def load_config(path: str | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Merges schema <- YAML ``path`` <- dotlist ``overrides`` and validates the result.

    ``path=None`` uses ``configs/default.yaml`` (the embedded toy run). Raises
    :class:`ConfigError` for a missing file, an unknown key, a wrong type or a contradiction.
    """
    path = path or DEFAULT_CONFIG
    if not os.path.isfile(path):
        raise ConfigError(f"--config: file not found: {path}")
    layers = [_load_yaml(path)] + [_parse_override(item) for item in overrides or []]
    try:
        merged = OmegaConf.merge(OmegaConf.structured(RunConfig), *layers)
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        raise _friendly(error) from None
    except TypeError as error:  # a list where a mapping belongs (OmegaConf cannot merge them)
        raise ConfigError(f"{_list_where_mapping(layers)}: {error}; write a mapping") from None
    assert isinstance(config, RunConfig)
    return config


def config_from_tree(tree: dict[str, Any], source: str) -> RunConfig:
    """The RunConfig of a recorded config tree (:func:`config_tree`, e.g. a checkpoint's),
    validated like :func:`load_config`'s; errors name ``source``."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.create(tree))
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        raise ConfigError(f"{source}: records an unusable config: {_friendly(error)}") from None
    assert isinstance(config, RunConfig)
    return config


def _yaml_problem(error: Exception) -> str:
    return " ".join(str(error).split())  # PyYAML's multi-line report on one line


def _load_yaml(path: str) -> DictConfig:
    """The mapping in the YAML file ``path``; ConfigError for broken YAML or a non-mapping."""
    try:
        loaded = OmegaConf.load(path)
    except (yaml.YAMLError, OmegaConfBaseException) as error:
        raise ConfigError(f"--config: {path} is not valid YAML: {_yaml_problem(error)}") from None
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"--config: {path} is not UTF-8 text ({error.reason} at byte "
            f"{error.start}); save it as UTF-8"
        ) from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(
            f"--config: {path} must hold a mapping of keys (e.g. 'train: {{num_steps: 2}}'), "
            f"got a {type(loaded).__name__}"
        )
    return loaded


def _parse_override(item: str) -> DictConfig:
    key, _, value = item.partition("=")
    try:
        return OmegaConf.from_dotlist([item])
    except (yaml.YAMLError, OmegaConfBaseException) as error:
        raise ConfigError(
            f"{key}: cannot parse the value {value!r} as YAML ({_yaml_problem(error)}); quote "
            "strings that hold brackets, braces or colons"
        ) from None


def _list_where_mapping(layers: list[DictConfig]) -> str:
    """The first key whose value is a list where the schema has a mapping (for the error)."""
    for layer in layers:
        for key, value in _flatten(OmegaConf.to_container(layer)).items():
            if isinstance(value, list) and key.endswith("kwargs"):
                return key
            for index, item in enumerate(value if isinstance(value, list) else []):
                if isinstance(item, dict) and isinstance(item.get("kwargs"), list):
                    return f"{key}[{index}].kwargs"
    return "config"


def to_yaml(config: RunConfig) -> str:
    """The resolved configuration as YAML (saved as out_dir/config.yaml)."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(_flatten(value, f"{prefix}{key}."))
    return flat


def help_lines(schema: Any = RunConfig, prefix: str = "", path: str | None = DEFAULT_CONFIG):
    """One line per key for the CLI's ``--help``: ``key = value  help``, where value is what a
    run without ``--config`` uses: the value in ``path`` (configs/default.yaml) where it sets
    the key, with the schema default beside it, else the schema default."""
    # an installed wheel has no configs/ folder: then the schema defaults are what a run uses
    found = path is not None and os.path.isfile(path)
    used = _flatten(OmegaConf.to_container(OmegaConf.load(path))) if found else {}
    lines = []
    for f in dataclasses.fields(schema):
        name = prefix + f.name
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            lines.extend(help_lines(type(default), name + ".", path))
            continue
        if isinstance(default, list) and default and dataclasses.is_dataclass(default[0]):
            default = [dataclasses.asdict(item) for item in default]
        shown = f"{default!r}"
        if name in used and used[name] != default:
            shown = f"{used[name]!r}  (default.yaml; schema default {default!r})"
        lines.append(f"  {name} = {shown}\n      {f.metadata.get('help', '')}")
    return lines


# What a resumed run may change: how long it runs and what it logs, evaluates and keeps. Every
# other key changes the model, the optimizer, the rollouts or the schedule the checkpoint was
# trained with.
RESUMABLE_KEYS = (
    "out_dir",
    "device",
    "train.num_steps",
    "train.resume",
    "train.checkpoint_every",
    "train.keep_last",
    "train.sample_every",
    "rewards.num_workers",
    "rewards.on_error",
    "rewards.timeout_s",
    "rewards.device",
    "rewards.async_scoring",
    "prompts.eval_file",
)
RESUMABLE_SECTIONS = ("eval.", "logging.")


def config_tree(config: RunConfig) -> dict[str, Any]:
    """The resolved configuration as plain containers (what out_dir/config.yaml holds)."""
    return OmegaConf.to_container(OmegaConf.create(to_yaml(config)))


def check_resume(saved: dict[str, Any], config: RunConfig, source: str) -> None:
    """Refuses to resume ``source`` (a checkpoint, trained with the config tree ``saved``) under
    a config that changes anything outside ``RESUMABLE_KEYS`` / ``RESUMABLE_SECTIONS``. A key
    the checkpoint does not record (added to the schema after it was written) counts as
    unchanged while it holds its schema default, the behaviour the run had before the key
    existed."""
    was, now = _flatten(saved), _flatten(config_tree(config))
    absent = "<absent>"
    defaults = _flatten(config_tree(RunConfig()))
    changed = [
        key
        for key in sorted(set(was) | set(now))
        if key not in RESUMABLE_KEYS
        and not key.startswith(RESUMABLE_SECTIONS)
        and was.get(key, absent) != now.get(key, absent)
        and not (key not in was and now.get(key) == defaults.get(key, absent))
    ]
    if changed:
        key = changed[0]
        more = f" (and {len(changed) - 1} more: {', '.join(changed[1:4])})" if changed[1:] else ""
        raise ConfigError(
            f"{key}: changed since the checkpoint (was {was.get(key, absent)!r}, now "
            f"{now.get(key, absent)!r}){more}; resume {source} with its settings, or start a "
            "new run in a new out_dir"
        )
