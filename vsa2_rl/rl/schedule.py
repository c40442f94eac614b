"""Hard-to-easy sparsity schedule: training step -> (rollout, train, eval) attention sparsity.

VSA2 RL post-training rolls out and trains at a high sparsity ("hard": few key segments per query
tile) and evaluates at a lower one ("easy"), so a policy that learned to cope with a tight budget
is deployed with a looser one. Rollout and train always share one value: the PPO ratio compares
log-probs of the same transitions under the rollout and training forwards, which must route
identically for the first on-policy ratio to be 1 (docs/concepts.md, "On-policy consistency").

Timeline of the train (= rollout) sparsity:

1. Optional sparse-rebasing warm-up over ``warmup_steps``: density ``1 - sparsity`` anneals from
   1 (dense) to the target density, linearly or along a half cosine, as in VSA's sparsity
   warm-up when adapting a dense checkpoint.
2. Optional curriculum over the next ``curriculum_steps``: sparsity moves from
   ``train_sparsity`` to ``train_sparsity_end`` (either direction; hard-to-easy when the end is
   lower).
3. Constant afterwards.

The eval sparsity is constant. A schedule is a pure function of the step; ``state_dict`` holds
its settings so a resumed run continues on the same curve.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from vsa2_rl.config import SparsityConfig

SHAPES = ("linear", "cosine")


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
    """Sparsities by step.

    Fields:
        train_sparsity: rollout/train sparsity after warm-up (the curriculum's start value when
            ``train_sparsity_end`` is set). In [0, 1).
        eval_sparsity: evaluation sparsity, in [0, 1); must be <= every train value unless
            ``allow_eval_above_train``.
        warmup_steps: steps of dense -> target density annealing (0 = start at the target).
        warmup_shape: ``"linear"`` or ``"cosine"`` (in density).
        train_sparsity_end: curriculum end value, or None for a constant train sparsity.
        curriculum_steps: steps (after warm-up) to move from ``train_sparsity`` to
            ``train_sparsity_end``; required > 0 iff ``train_sparsity_end`` is set.
        curriculum_shape: ``"linear"`` or ``"cosine"``.
        allow_eval_above_train: permit an eval sparsity above the train one (easy-to-hard
            ablations).
    """

    train_sparsity: float = 0.9
    eval_sparsity: float = 0.75
    warmup_steps: int = 0
    warmup_shape: str = "linear"
    train_sparsity_end: float | None = None
    curriculum_steps: int = 0
    curriculum_shape: str = "linear"
    allow_eval_above_train: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        for name in ("train_sparsity", "eval_sparsity", "train_sparsity_end"):
            value = getattr(self, name)
            if value is None and name == "train_sparsity_end":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a float in [0, 1), got {value!r}")
            if not 0.0 <= value < 1.0:
                raise ValueError(
                    f"{name} must be in [0, 1) (sparsity 1 would keep no keys), got {value!r}"
                )
        for name in ("warmup_steps", "curriculum_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        for name in ("warmup_shape", "curriculum_shape"):
            if getattr(self, name) not in SHAPES:
                raise ValueError(f"{name} must be one of {SHAPES}, got {getattr(self, name)!r}")
        if self.train_sparsity_end is None and self.curriculum_steps > 0:
            raise ValueError(
                f"curriculum_steps={self.curriculum_steps} needs train_sparsity_end; set it or "
                "set curriculum_steps=0"
            )
        if self.train_sparsity_end is not None and self.curriculum_steps == 0:
            raise ValueError(
                f"train_sparsity_end={self.train_sparsity_end} needs curriculum_steps > 0"
            )
        lowest_train = self.train_sparsity
        if self.train_sparsity_end is not None:
            lowest_train = min(lowest_train, self.train_sparsity_end)
        if self.eval_sparsity > lowest_train and not self.allow_eval_above_train:
            raise ValueError(
                f"eval_sparsity={self.eval_sparsity} exceeds the lowest train sparsity "
                f"{lowest_train}: the schedule is hard-to-easy (eval at most as sparse as train); "
                "lower eval_sparsity or set allow_eval_above_train=True"
            )

    @classmethod
    def from_config(cls, config: SparsityConfig, num_steps: int) -> SparsitySchedule:
        """From the run config's ``sparsity`` section; a ``train_end`` curriculum is linear and
        spans the steps after warm-up up to ``num_steps``."""
        if not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")
        curriculum = 0
        if config.train_end is not None:
            curriculum = max(1, num_steps - config.warmup_steps)
        return cls(
            train_sparsity=config.train,
            eval_sparsity=config.eval,
            warmup_steps=config.warmup_steps,
            warmup_shape=config.warmup_shape,
            train_sparsity_end=config.train_end,
            curriculum_steps=curriculum,
        )

    def train_at(self, step: int) -> float:
        """Rollout/train sparsity at ``step`` (>= 0)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if step < self.warmup_steps:
            progress = ramp_progress(step / self.warmup_steps, self.warmup_shape)
            # Anneal the density (the compute budget) from 1 to the target density.
            density = 1.0 - progress * self.train_sparsity
            return 1.0 - density
        if self.train_sparsity_end is None:
            return self.train_sparsity
        frac = min(1.0, (step - self.warmup_steps) / self.curriculum_steps)
        progress = ramp_progress(frac, self.curriculum_shape)
        return self.train_sparsity + progress * (self.train_sparsity_end - self.train_sparsity)

    def __call__(self, step: int) -> SparsityLevels:
        train = self.train_at(step)
        return SparsityLevels(rollout=train, train=train, eval=self.eval_sparsity)

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore settings saved by :meth:`state_dict` (validated; unknown keys rejected)."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(state) - names)
        if unknown:
            raise ValueError(f"unknown SparsitySchedule state keys {unknown}; expected {names}")
        backup = self.state_dict()
        for key, value in state.items():
            setattr(self, key, value)
        try:
            self.validate()
        except ValueError:
            for key, value in backup.items():
                setattr(self, key, value)
            raise


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
