"""Which settings a resumed run may change (``train.resume``), and the check that refuses the
others: the divergence error's advice (resume with a lower ``train.learning_rate`` or
``sampler.noise_level``) is one a resume accepts."""

from __future__ import annotations

from typing import Any

from vsa2_rl.config.checks import ConfigError
from vsa2_rl.config.loading import _flatten, config_tree, upgrade_tree
from vsa2_rl.config.run import RunConfig
from vsa2_rl.config.targets import TARGET_KEYS

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
    "sparsity.max_rollout_velocity_error",  # a warning's threshold, not the schedule
)
RESUMABLE_SECTIONS = ("eval.", "logging.")
# What a resumed run may lower (never raise): the way out of a run that diverged
LOWERABLE_KEYS = ("train.learning_rate", "sampler.noise_level")


def lowered_on_resume(saved: dict[str, Any], config: RunConfig) -> dict[str, tuple]:
    """The ``LOWERABLE_KEYS`` that ``config`` lowers from the config tree ``saved`` a checkpoint
    was trained with, as ``{key: (was, now)}``."""
    was, now = _flatten(upgrade_tree(saved)), _flatten(config_tree(config))
    numbers = [key for key in LOWERABLE_KEYS if _is_number(was.get(key), now.get(key))]
    return {key: (was[key], now[key]) for key in numbers if now[key] < was[key]}


def _is_number(*values: Any) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def check_resume(saved: dict[str, Any], config: RunConfig, source: str) -> dict[str, tuple]:
    """Refuses to resume ``source`` (a checkpoint, trained with the config tree ``saved``) under
    a config that changes anything outside ``RESUMABLE_KEYS`` / ``RESUMABLE_SECTIONS`` or raises
    one of ``LOWERABLE_KEYS``; returns the lowered ones (:func:`lowered_on_resume`). A key
    the checkpoint does not record (added to the schema after it was written) counts as
    unchanged while it holds its schema default, the behaviour the run had before the key
    existed; sections renamed since (``grpo``, now ``rl``) compare under their new name. The
    EvalTargets keys that checkpoints recorded before they left RunConfig hold are
    no settings of the run and are ignored."""
    flat = _flatten(upgrade_tree(saved))
    was = {key: value for key, value in flat.items() if key not in TARGET_KEYS}
    now = _flatten(config_tree(config))
    absent = "<absent>"
    defaults = _flatten(config_tree(RunConfig()))
    lowered = lowered_on_resume(saved, config)
    changed = [
        key
        for key in sorted(set(was) | set(now))
        if key not in RESUMABLE_KEYS
        and not key.startswith(RESUMABLE_SECTIONS)
        and key not in lowered
        and was.get(key, absent) != now.get(key, absent)
        and not (key not in was and now.get(key) == defaults.get(key, absent))
    ]
    if changed:
        key = changed[0]
        more = f" (and {len(changed) - 1} more: {', '.join(changed[1:4])})" if changed[1:] else ""
        raise ConfigError(
            f"{key}: changed since the checkpoint (was {was.get(key, absent)!r}, now "
            f"{now.get(key, absent)!r}){more}; resume {source} with its settings"
            f"{' (this key may only be lowered)' if key in LOWERABLE_KEYS else ''}, or start a "
            "new run in a new out_dir"
        )
    return lowered
