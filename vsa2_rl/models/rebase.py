"""Sparse rebasing: turn a full-attention Wan transformer into VSA2 in the middle of training.

Following VSA's recipe for adapting a dense checkpoint ("sparse adaptation"), the switch must not
change the function the model computes, and the sparsity is then raised gradually:

1. ``rebase_to_vsa2`` attaches freshly initialised VSA2 parameters to every self-attention:
   ``alpha = 0`` (no router bias), coarse gate ``g_c = 0`` and fine gate ``g_f = 1`` (zero-init
   linears). The layer output is then exactly the fine stage, and at density 1 the fine stage is
   dense attention: the rebased model equals the dense one (tested in tests/test_rebase.py). It
   also sets the shared state's sparsity to 0.
2. The density is annealed from 1 to the target over N steps. While ``1 - sparsity >=
   dense_threshold`` the fine stage runs as exact dense SDPA (the dense fallback), so the first
   steps cost and behave like the dense model; below it the router takes over.

Two ways to drive step 2:

- RL runs: ``vsa2_rl.rl.schedule.SparsitySchedule`` (config ``sparsity.warmup_steps`` and
  ``sparsity.warmup_shape``) already contains this dense -> target warm-up; the trainer writes its
  value into the ``SparsityState`` before each rollout/train forward.
- Stand-alone fine-tuning (e.g. ``scripts/build_toy_model.py``): :class:`RebaseSchedule` below,
  ``schedule.apply(state, step)`` once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from vsa2_rl.attention import SparsityState
from vsa2_rl.config import VSA2Config
from vsa2_rl.models.wan import enable_vsa2
from vsa2_rl.rl.schedule import SHAPES, ramp_progress

RAMPS = SHAPES


def rebase_to_vsa2(
    transformer: nn.Module, vsa2_config: VSA2Config, state: SparsityState
) -> nn.Module:
    """Switch a dense Wan transformer to VSA2 without changing its output at density 1.

    Any VSA2 parameters already attached are reset too (alpha = 0, g_c = 0, g_f = 1), so calling
    it on a previously VSA2-trained model restarts the sparse adaptation from its dense function.
    Returns the same transformer; ``state.sparsity`` is set to 0.
    """
    if not vsa2_config.enabled:
        raise ValueError("vsa2_config.enabled is False: rebasing needs VSA2 enabled (set it True)")
    state.sparsity = 0.0
    enable_vsa2(transformer, vsa2_config, state)
    for module in transformer.modules():
        vsa2 = getattr(module, "vsa2", None)
        if isinstance(vsa2, nn.Module):
            vsa2.reset_parameters()
    return transformer


@dataclass(frozen=True)
class RebaseSchedule:
    """Sparsity of step ``step`` of a rebasing run: density 1 -> ``1 - target`` over ``steps``.

    ``ramp`` is the shape in density: "linear" or "cosine" (half cosine, slow start and end),
    along :func:`vsa2_rl.rl.schedule.ramp_progress`, the RL warm-up's ramp too. After ``steps``
    the sparsity stays at ``target``.
    """

    target: float
    steps: int
    ramp: str = "cosine"

    def __post_init__(self) -> None:
        if not 0.0 <= self.target < 1.0:
            raise ValueError(f"target sparsity must be in [0, 1), got {self.target}")
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")
        if self.ramp not in RAMPS:
            raise ValueError(f"ramp must be one of {RAMPS}, got {self.ramp!r}")

    def __call__(self, step: int) -> float:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self.steps == 0 or step >= self.steps:
            return self.target
        return self.target * ramp_progress(step / self.steps, self.ramp)

    def apply(self, state: SparsityState, step: int) -> float:
        """Write this step's sparsity into ``state``; returns it."""
        state.sparsity = self(step)
        return state.sparsity
