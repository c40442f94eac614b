"""Rollout agreement: how far the velocity a model samples with at a sparsity is from the same
model's velocity with dense attention (docs/concepts.md, "Choosing a rollout sparsity").

``velocity_rel_error`` at sparsity s is ``||v_s - v_0|| / ||v_0||``, the relative L2 error of
the velocity the sampler uses at s (the guided one, :func:`vsa2_rl.sampling.cfg_velocity`)
against the same velocity function under ``SparsityState.at(0.0)`` (dense attention), both on
the same latent x_t and sigma at every step of the ODE trajectory sampled at s; the ratio is
taken per video and step, then averaged over videos and steps. The dense forward only looks: the
sampler steps with v_s, so the trajectory and its videos are those sampled without the
measurement. At sparsity 0 the figure is 0.0 by definition and costs no forward.

:class:`VelocityAgreement` wraps the velocity functions of a sweep cell's first batches
(vsa2_rl.eval.sweep); :func:`agreement_metrics` gives a trainer evaluation's figures, at the
evaluation sparsity and at the rollout sparsity; :func:`rollout_warning` is the trainer's
warning when the rollout's figure is above ``sparsity.max_rollout_velocity_error``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from vsa2_rl.attention.state import SparsityState
from vsa2_rl.sampling import VelocityFn


def relative_error(velocity: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Per video (first dimension), ``||velocity - reference|| / ||reference||`` in float32."""
    velocity, reference = velocity.float().flatten(1), reference.float().flatten(1)
    return (velocity - reference).norm(dim=1) / reference.norm(dim=1)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class VelocityAgreement:
    """The velocity_rel_error of the first ``videos`` trajectories of a sweep cell, sampled at
    the sparsity ``state`` holds, measured through :meth:`wrap`.

    The dense forwards add nothing to ``state``'s density (``SparsityState.unrecorded``) and
    their wall time, the device synchronised around them, is kept in ``seconds`` for the
    caller to subtract from the sampling time.
    """

    def __init__(self, state: SparsityState, videos: int):
        self.state, self.videos = state, videos
        self.errors: list[torch.Tensor] = []  # per velocity call: the measured videos' ratios
        self.seconds = 0.0

    def wrap(self, velocity_fn: VelocityFn, start: int) -> VelocityFn:
        """``velocity_fn`` of the batch whose first video is video ``start`` of the cell,
        measuring each call on the batch's videos among the first ``videos``; unchanged for a
        batch past them."""
        measured = self.videos - start
        if measured <= 0:
            return velocity_fn

        def velocity(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
            v = velocity_fn(x, sigma)
            _synchronize(x.device)
            t0 = time.perf_counter()
            with torch.no_grad(), self.state.at(0.0), self.state.unrecorded():
                dense = velocity_fn(x, sigma)
            self.errors.append(relative_error(v[:measured], dense[:measured]))
            _synchronize(x.device)
            self.seconds += time.perf_counter() - t0
            return v

        return velocity

    def mean(self) -> float:
        """The mean ratio over the measured videos and their steps."""
        return torch.cat(self.errors).mean().item()


def agreement_metrics(
    sweep: Callable, prompts: list, images: list, rollout: float, evaluated: dict, videos: int
) -> dict[str, float]:
    """A trainer evaluation's ``eval/velocity_rel_error`` (the ``evaluated`` sweep row's) and
    ``eval/rollout_velocity_rel_error``, the figure at the ``rollout`` sparsity on the same first
    ``videos`` trajectories of ``prompts``: 0.0 at sparsity 0, the row's own where it was
    evaluated at ``rollout``, else one more sweep cell of those prompts alone (no rewards; its
    few videos are decoded and dropped). ``sweep``: :func:`vsa2_rl.eval.sweep.sweep_model` with
    the model and every sampling setting bound, ``agreement_videos=videos`` included. Empty
    where the row has no figure (``eval.agreement_prompts=0``)."""
    if "velocity_rel_error" not in evaluated:
        return {}
    if rollout == 0.0:
        error = 0.0
    elif rollout == evaluated["sparsity"]:
        error = evaluated["velocity_rel_error"]
    else:
        (row,), _ = sweep(prompts[:videos], [rollout], [], images=images[:videos])
        error = row["velocity_rel_error"]
    return {
        "eval/velocity_rel_error": evaluated["velocity_rel_error"],
        "eval/rollout_velocity_rel_error": error,
    }


def rollout_warning(metrics: dict, threshold: float | None, rollout: float) -> str | None:
    """The warning when an evaluation's ``eval/rollout_velocity_rel_error`` exceeds
    ``threshold`` (``sparsity.max_rollout_velocity_error``; None: never), else None."""
    error = metrics.get("eval/rollout_velocity_rel_error")
    if threshold is None or error is None or error <= threshold:
        return None
    return (
        f"warning: at the rollout sparsity {rollout:g} the model's velocity is {error:.4f} "
        "(relative L2 error, eval/rollout_velocity_rel_error) away from its dense velocity, "
        f"above sparsity.max_rollout_velocity_error={threshold:g}: the rollouts sample a policy "
        "far from the dense model; lower sparsity.train, or reach it from dense attention over "
        "sparsity.warmup_steps"
    )
