"""Pre-flight: the checks that refuse a command's config before any weight loads, in one place.

Every command runs them on the config of each model it is about to load: ``vsa2-rl train`` and
``check`` through :func:`vsa2_rl.check.before_loading` (all problems at once, one
``error:`` line each), :class:`vsa2_rl.rl.trainer.RLTrainer` again for a config built in code,
``eval`` and ``export`` per target (:func:`check_target`). What the model folder says about its
model comes from its ``model_index.json``, read once per config into :class:`ModelFacts` and
handed to each check that needs it, and on to the loader (``vsa2-rl train`` reads it once).

The checks that need the processes (the engine, the number of ranks) run when the trainer's
processes start (:func:`check_data_parallel`, ``vsa2_rl.rl.engines.check_options``); those of
the model's own loading (its component folders, its adapters) stay with the loader
(vsa2_rl.runtime, vsa2_rl.models), which takes the facts rather than read them again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vsa2_rl.config import ConfigError, RunConfig

if TYPE_CHECKING:
    from vsa2_rl.models.wan_bundle import WanVariant


@dataclass(frozen=True)
class ModelFacts:
    """What the model folder of a config says about its model, read once."""

    variant: WanVariant | None  # the Wan folder's model_index.json; None for the toy

    @property
    def two_experts(self) -> bool:
        """Wan2.2 A14B: two transformers switched at a noise-level boundary."""
        return self.variant is not None and self.variant.boundary_ratio is not None


def model_facts(config: RunConfig) -> ModelFacts:
    """The :class:`ModelFacts` of ``config.model`` (a ConfigError naming ``model.path`` for an
    unreadable or contradictory ``model_index.json``)."""
    if config.model.kind != "wan":
        return ModelFacts(variant=None)
    from vsa2_rl.models.wan_bundle import read_wan_variant

    return ModelFacts(variant=read_wan_variant(config.model.path))


def check_second_guidance(config: RunConfig, facts: ModelFacts) -> None:
    """Refuses a guidance scale for the low-noise expert's steps without two experts (the first
    rollout or evaluation would, after the weights loaded)."""
    _refuse_second_guidance("sampler.guidance_scale_2", config.sampler.guidance_scale_2, facts)
    _refuse_second_guidance("eval.guidance_scale_2", config.eval_guidance_scale_2, facts)


def _refuse_second_guidance(key: str, scale: float | None, facts: ModelFacts) -> None:
    if scale is not None and not facts.two_experts:
        raise ConfigError(
            f"{key}: the guidance scale of the low-noise expert's steps needs a model of two "
            "experts (Wan2.2 A14B); leave it empty"
        )


def check_prompt_count(config: RunConfig, train_prompts: int) -> None:
    """Refuses more prompts a step than the training prompt set holds."""
    if config.rl.prompts_per_step > train_prompts:
        raise ConfigError(
            f"rl.prompts_per_step: {config.rl.prompts_per_step} exceeds the "
            f"{train_prompts} prompts of the prompt set; lower it or add prompts"
        )


def check_data_parallel(config: RunConfig, world: int) -> None:
    """Refuses a step's videos that ``world`` data-parallel ranks cannot share evenly."""
    if (config.rl.prompts_per_step * config.rl.group_size) % world:
        raise ConfigError(
            f"rl.prompts_per_step * rl.group_size must be divisible by the number of "
            f"data-parallel ranks ({world}: processes / parallel.sequence_parallel_size)"
        )


def check_target(run: RunConfig, trained: RunConfig) -> ModelFacts:
    """``eval`` and ``export``: the checks of a model trained with ``trained``, about to be
    loaded under the command's config ``run``, whose evaluation keeps the model's own guidance
    scales unless it gives one (as vsa2_rl.eval.sweep.evaluate does)."""
    facts = model_facts(trained)
    own_scales = run.eval.guidance_scale is None and run.eval.guidance_scale_2 is None
    scale = trained.eval_guidance_scale_2 if own_scales else run.eval_guidance_scale_2
    _refuse_second_guidance("eval.guidance_scale_2", scale, facts)
    return facts


__all__ = [
    "ModelFacts",
    "check_data_parallel",
    "check_prompt_count",
    "check_second_guidance",
    "check_target",
    "model_facts",
]
