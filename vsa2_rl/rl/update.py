"""The seam between the trainer and a policy-improvement algorithm: the :class:`UpdateRule`
protocol and :func:`build_update_rule`, which picks the rule ``rl.algorithm`` names.

Rollout, scoring (rewards, guards, group advantages), the sparsity schedule, engines,
checkpoints and tracking are the trainer's (vsa2_rl.rl.trainer); an update rule owns what
differs between algorithms: which policy samples the rollouts, which rollout fields its loss
reads, its loss on a chunk, its optimizer steps and their metrics, and its own checkpoint state.
Flow-GRPO is :class:`vsa2_rl.rl.flow_grpo.FlowGRPOUpdate`, DiffusionNFT
:class:`vsa2_rl.rl.nft.NFTUpdate`. A third algorithm is one module with a class that follows
:class:`UpdateRule` and its entry in :data:`vsa2_rl.config.UPDATE_RULES` (its settings, if it
has any, a config section beside ``nft``), as trl adds a trainer per algorithm behind one base.
"""

from __future__ import annotations

import importlib
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

from vsa2_rl.config import UPDATE_RULES

if TYPE_CHECKING:
    from vsa2_rl.config import RunConfig
    from vsa2_rl.rl.policy import Policy
    from vsa2_rl.rl.rollout import Rollout, RolloutSampler, StepRollouts


class UpdateResult(NamedTuple):
    """What one step's update produced."""

    grad_norms: list[float]  # one per optimizer step taken (inner epochs with work)
    skipped: int  # optimizer steps refused for a non-finite loss or gradient
    metrics: dict[str, float]  # the rule's loss statistics (``loss/*``, ``train/*``)


class UpdateRule(Protocol):
    """A policy-improvement rule of the trainer (``rl.algorithm``)."""

    # The fields of vsa2_rl.rl.rollout.Rollout the rule reads besides ``condition``,
    # ``advantages`` and ``valid`` (which scoring sets for every rule); checked by
    # :func:`check_rollouts` before each update.
    requires: tuple[str, ...]

    @classmethod
    def from_config(cls, policy: Policy, sampler: RolloutSampler, config: RunConfig) -> Any:
        """The rule for ``config``; a :class:`vsa2_rl.config.ConfigError` naming the key for a
        setting the model or the rollout schedule cannot train, before the run writes a file."""
        ...

    def sampling_policy(self) -> AbstractContextManager:
        """Yields the model bundle the step's rollouts come from."""
        ...

    def kl_penalty(self, chunk: Rollout, stochastic: torch.Tensor) -> torch.Tensor | None:
        """Per sample of ``chunk`` [b], the term ``rl.kl_beta`` times which scoring takes off
        its reward; None when the rule puts no penalty in the reward. Called right after the
        rollout, at its sparsity."""
        ...

    def update(self, step: int, rollouts: StepRollouts) -> UpdateResult:
        """The step's optimizer steps on ``rollouts`` (advantages set), at the training
        sparsity the caller set."""
        ...

    def state_entries(self) -> dict:
        """Checkpoint entries of the rule's own state (beyond the policy's)."""
        ...

    def load_state(self, restored: dict) -> None:
        """Restores :meth:`state_entries` from a loaded checkpoint."""
        ...


def build_update_rule(policy: Policy, sampler: RolloutSampler, config: RunConfig) -> UpdateRule:
    """The update rule ``rl.algorithm`` names (:data:`vsa2_rl.config.UPDATE_RULES`)."""
    module, _, name = UPDATE_RULES[config.rl.algorithm].partition(":")
    rule_class = getattr(importlib.import_module(module), name)
    return rule_class.from_config(policy, sampler, config)


def check_rollouts(rule: UpdateRule, rollouts: StepRollouts) -> None:
    """Refuses rollouts that lack a field ``rule`` reads (a subclass's rollout phase, say)."""
    for chunk in rollouts.chunks:
        for field in rule.requires:
            if getattr(chunk, field, None) is None:
                raise ValueError(
                    f"{type(rule).__name__} trains on the rollouts' {field}, which the rollout "
                    "phase left empty"
                )


__all__ = ["UpdateResult", "UpdateRule", "build_update_rule", "check_rollouts"]
