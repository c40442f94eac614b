"""Typed configuration of vsa2_rl: OmegaConf structured schemas and the loader.

Precedence is schema defaults <- YAML file <- command-line dotlist overrides
(``train.num_steps=2 out_dir=runs/x``), the OmegaConf recipe that trl and FastVideo users know.
Every field documents itself through ``metadata["help"]`` (printed by ``vsa2-rl train --help``).
Unknown keys, wrong types and contradictory settings raise :class:`ConfigError` naming the key
and the fix before any work starts; ``load_config`` returns plain dataclass instances, so
``__post_init__`` checks run on the merged result. Those check values alone; the folders and
files a config names are checked by :func:`check_paths`, which the loaders call.

Modules, one per concern:

- ``checks``: :class:`ConfigError` and the value checks the sections share;
- ``model``, ``algorithm``, ``run``: the sections (``model``, ``attention``, ``sparsity``;
  ``sampler``, ``rl``, ``nft``, ``rewards``; ``prompts``, ``train``, ``eval``, ``parallel``,
  ``logging``) and :class:`RunConfig`, the whole config with its checks across sections;
- ``targets``: :class:`EvalTargets`, the models ``vsa2-rl eval`` and ``export`` take;
- ``paths``: the file-system checks;
- ``loading``: YAML and overrides into a config, the errors as one line, the config as YAML;
- ``resume``: what a resumed run may change; ``help``: the ``--help`` text.

``GRPOConfig``, :class:`RLConfig`'s name before the section ``grpo`` became ``rl``, still imports
for this release, with a FutureWarning.
"""

import warnings

from vsa2_rl.config.algorithm import (
    ALGORITHMS,
    UPDATE_RULES,
    NFTConfig,
    RewardEntry,
    RewardsConfig,
    RLConfig,
    SamplerConfig,
)
from vsa2_rl.config.checks import MAX_INT, MAX_ROLLOUTS_PER_STEP, ConfigError
from vsa2_rl.config.help import help_lines
from vsa2_rl.config.loading import (
    DEFAULT_CONFIG,
    config_from_tree,
    config_tree,
    load_config,
    load_eval_config,
    load_recorded_config,
    to_yaml,
)
from vsa2_rl.config.loading import _all_keys as _all_keys  # the keys of a schema (tests, docs)
from vsa2_rl.config.model import (
    AttentionConfig,
    LoraConfig,
    ModelConfig,
    SparsityConfig,
    VSA2Config,
)
from vsa2_rl.config.paths import check_model_paths, check_paths, check_target_paths
from vsa2_rl.config.resume import RESUMABLE_KEYS, RESUMABLE_SECTIONS, check_resume
from vsa2_rl.config.run import (
    EvalConfig,
    LoggingConfig,
    ParallelConfig,
    PromptsConfig,
    RunConfig,
    TrainConfig,
)
from vsa2_rl.config.targets import TARGET_KEYS, EvalTargets

__all__ = [
    "ALGORITHMS",
    "DEFAULT_CONFIG",
    "MAX_INT",
    "MAX_ROLLOUTS_PER_STEP",
    "RESUMABLE_KEYS",
    "RESUMABLE_SECTIONS",
    "TARGET_KEYS",
    "UPDATE_RULES",
    "AttentionConfig",
    "ConfigError",
    "EvalConfig",
    "EvalTargets",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "NFTConfig",
    "ParallelConfig",
    "PromptsConfig",
    "RLConfig",
    "RewardEntry",
    "RewardsConfig",
    "RunConfig",
    "SamplerConfig",
    "SparsityConfig",
    "TrainConfig",
    "VSA2Config",
    "check_model_paths",
    "check_paths",
    "check_resume",
    "check_target_paths",
    "config_from_tree",
    "config_tree",
    "help_lines",
    "load_config",
    "load_eval_config",
    "load_recorded_config",
    "to_yaml",
]


def __getattr__(name: str):
    """The renamed ``GRPOConfig`` (PEP 562): :class:`RLConfig`, with a FutureWarning."""
    if name == "GRPOConfig":
        warnings.warn(
            "vsa2_rl.config.GRPOConfig is renamed RLConfig (the section grpo is rl); import "
            "RLConfig, the old name goes in the next release",
            FutureWarning,
            stacklevel=2,
        )
        return RLConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
