"""What ``vsa2-rl eval`` and ``vsa2-rl export`` take besides the run settings: the trained models.

They are not settings of a run (training reads none of them, and a run's recorded config does not
hold them), so they are not fields of :class:`~vsa2_rl.config.RunConfig`; on the command line they
are given like its keys (``run_dir=DIR``, ``"run_dirs=[A,B]"``, ``checkpoint=DIR``), and
:func:`~vsa2_rl.config.load_eval_config` splits them off.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vsa2_rl.config.checks import _doc, _expand_user


@dataclass
class EvalTargets:
    """The models vsa2-rl eval and export take (no target: eval takes the plain model of
    model.path, or the shipped toy; export needs one)."""

    run_dirs: list[str] = _doc(
        "Training run folders to evaluate (the newest checkpoint of each), each with the "
        "settings it was trained with.",
        default_factory=list,
    )
    run_dir: str | None = _doc(
        "One training run folder (same as run_dirs=[DIR]); the one run vsa2-rl export takes.",
        default=None,
    )
    checkpoint: str | None = _doc(
        "One checkpoint folder (a run's checkpoints/step_N) to evaluate or export.",
        default=None,
    )

    def __post_init__(self) -> None:
        _expand_user(self, "run_dirs", "run_dir", "checkpoint")

    @property
    def run_folders(self) -> list[tuple[str, str]]:
        """(key, folder) of ``run_dirs``' folders, then of ``run_dir``: errors name the key."""
        keyed = [("run_dirs", folder) for folder in self.run_dirs]
        return keyed + ([("run_dir", self.run_dir)] if self.run_dir else [])


# The keys of the command line (and of a --config file) that are EvalTargets', not RunConfig's.
TARGET_KEYS = tuple(f.name for f in dataclasses.fields(EvalTargets))
