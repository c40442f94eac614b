"""Hard-to-easy sparsity schedule: training step -> (rollout, train, eval) attention sparsity.

VSA2 RL post-training rolls out and trains at a high sparsity ("hard": few key segments per query
tile) and evaluates at a lower one ("easy"), so a policy that learned to cope with a tight budget
is deployed with a looser one. Rollout and train always share one value: the PPO ratio compares
log-probs of the same transitions under the rollout and training forwards, which must route
identically for the first on-policy ratio to be 1 (docs/concepts.md, "On-policy consistency").

Timeline of the train (= rollout) sparsity, from the run's ``sparsity`` section
(:class:`vsa2_rl.config.SparsityConfig`, which holds the defaults and validates the values):

1. Optional sparse-rebasing warm-up over ``sparsity.warmup_steps``: density ``1 - sparsity``
   anneals from 1 (dense) to the target density along ``sparsity.warmup_shape`` (linear or a
   half cosine), as in VSA's sparsity warm-up when adapting a dense checkpoint.
2. With ``sparsity.train_end`` set, a linear curriculum over the rest of the run: sparsity moves
   from ``sparsity.train`` to ``sparsity.train_end`` (either direction; hard-to-easy when the
   end is lower).
3. Constant afterwards.

The eval sparsity is constant. A schedule is a pure function of the step; ``state_dict`` holds
its settings and the curriculum's length, so a resumed run (even a longer one) continues on the
same curve.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

from vsa2_rl.config import SparsityConfig

SHAPES = ("linear", "cosine")

# the keys of the schedule state that checkpoints written before it held a SparsityConfig use
_OLD_STATE_KEYS = {
    "train_sparsity": "train",
    "eval_sparsity": "eval",
    "train_sparsity_end": "train_end",
    "warmup_steps": "warmup_steps",
    "warmup_shape": "warmup_shape",
    "curriculum_steps": "curriculum_steps",
}


class SparsityLevels(NamedTuple):
    rollout: float
    train: float
    eval: float


def ramp_progress(frac: float, shape: str) -> float:
    """Progress in [0, 1] for ``frac`` in [0, 1] along a linear or half-cosine ramp (``shape`` one
    of ``SHAPES``; the cosine starts and ends slowly). The one ramp of the dense -> target
    warm-ups: this schedule's and :class:`vsa2_rl.models.rebase.RebaseSchedule`'s."""
    if shape == "linear":
        return frac
    return 0.5 * (1.0 - math.cos(math.pi * frac))


@dataclass
class SparsitySchedule:
    """Sparsities by step of a run's ``sparsity`` section; build it with :meth:`from_config`.

    Fields:
        settings: the ``sparsity`` section (validated by its own ``__post_init__``).
        curriculum_steps: steps after the warm-up over which the train sparsity moves from
            ``settings.train`` to ``settings.train_end``; 0 without a ``train_end``.
    """

    settings: SparsityConfig
    curriculum_steps: int = 0

    @classmethod
    def from_config(cls, settings: SparsityConfig, num_steps: int) -> SparsitySchedule:
        """The schedule of a run of ``num_steps`` steps: a ``train_end`` curriculum spans the
        steps after the warm-up up to ``num_steps``."""
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")
        curriculum = 0
        if settings.train_end is not None:
            curriculum = max(1, num_steps - settings.warmup_steps)
        return cls(settings, curriculum)

    @property
    def warmup_steps(self) -> int:
        return self.settings.warmup_steps

    def train_at(self, step: int) -> float:
        """Rollout/train sparsity at ``step`` (>= 0)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        settings = self.settings
        if step < settings.warmup_steps:
            progress = ramp_progress(step / settings.warmup_steps, settings.warmup_shape)
            # Anneal the density (the compute budget) from 1 to the target density.
            density = 1.0 - progress * settings.train
            return 1.0 - density
        if settings.train_end is None:
            return settings.train
        frac = min(1.0, (step - settings.warmup_steps) / self.curriculum_steps)
        return settings.train + frac * (settings.train_end - settings.train)

    def __call__(self, step: int) -> SparsityLevels:
        train = self.train_at(step)
        return SparsityLevels(rollout=train, train=train, eval=self.settings.eval)

    def state_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self.settings), "curriculum_steps": self.curriculum_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict` (or the state of a checkpoint written before the schedule
        held a SparsityConfig), validated like the config; unknown keys are refused."""
        if "train_sparsity" in state:
            old = {"curriculum_shape": "linear", "allow_eval_above_train": False}  # always so
            if any(state.get(key, value) != value for key, value in old.items()):
                raise ValueError(f"schedule state {state} is not one a run config gives")
            state = {_OLD_STATE_KEYS[k]: v for k, v in state.items() if k not in old}
        names = {f.name for f in dataclasses.fields(SparsityConfig)} | {"curriculum_steps"}
        unknown = sorted(set(state) - names)
        if unknown:
            raise ValueError(f"unknown SparsitySchedule state keys {unknown}; expected {names}")
        state = dict(state)
        curriculum = state.pop("curriculum_steps", 0)
        settings = SparsityConfig(**state)  # a ConfigError (a ValueError) names a bad value
        fits = curriculum >= 1 if settings.train_end is not None else curriculum == 0
        if isinstance(curriculum, bool) or not isinstance(curriculum, int) or not fits:
            raise ValueError(
                f"schedule state: curriculum_steps={curriculum} does not fit train_end="
                f"{settings.train_end} (a curriculum needs both)"
            )
        self.settings, self.curriculum_steps = settings, curriculum


def plot_schedule(schedule: SparsitySchedule, num_steps: int, path: str) -> None:
    """Save a figure of rollout/train and eval sparsity over ``num_steps`` steps to ``path``."""
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")
    # The object-oriented Figure API needs no pyplot backend (headless training nodes).
    from matplotlib.figure import Figure

    steps = list(range(num_steps))
    levels = [schedule(s) for s in steps]
    fig = Figure(figsize=(6, 3.5), layout="constrained")
    ax = fig.add_subplot()
    ax.plot(steps, [lv.train for lv in levels], label="rollout = train")
    ax.plot(steps, [lv.eval for lv in levels], "--", label="eval")
    if schedule.warmup_steps:
        ax.axvspan(0, min(schedule.warmup_steps, num_steps), alpha=0.15, label="dense warm-up")
    ax.set_xlabel("training step")
    ax.set_ylabel("attention sparsity")
    ax.set_ylim(0.0, 1.0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.savefig(path, dpi=120)
