"""Loading a config: schema defaults <- YAML file <- command-line dotlist overrides, errors as
one line naming the key and the fix, and the config as YAML or plain containers.

:func:`load_config` gives the :class:`RunConfig` of ``vsa2-rl train``; :func:`load_eval_config`
also splits off the :class:`EvalTargets` that ``vsa2-rl eval`` and ``export`` take. Both return
plain dataclass instances (so every ``__post_init__`` check runs on the merged result) and then
check the paths the config names (:mod:`vsa2_rl.config.paths`) unless told not to.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import warnings
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from vsa2_rl.config.checks import ConfigError
from vsa2_rl.config.paths import _not_a_file, check_paths, check_target_paths
from vsa2_rl.config.run import RunConfig
from vsa2_rl.config.targets import TARGET_KEYS, EvalTargets

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_CONFIG = os.path.join(_REPO, "configs", "default.yaml")

# Sections renamed by this release (old name -> new). The old name loads for one more release
# with a FutureWarning, the category Python shows to the users of a program (a
# DeprecationWarning raised in library code is hidden by default, and a config file is written
# by users, not developers).
RENAMED_SECTIONS = {"grpo": "rl"}


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
        known = _all_keys(RunConfig) + list(TARGET_KEYS)
        close = difflib.get_close_matches(key, known, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return ConfigError(f"{key}: unknown config key{hint}; see `vsa2-rl train --help`")
    if message.startswith("Incompatible value 'None'"):  # KEY= with nothing after it
        return ConfigError(f"{key}: needs a value (nothing follows '='), e.g. {key}=VALUE")
    return ConfigError(f"{key or 'config'}: {message}")


def _layers(path: str | None, overrides: list[str] | None) -> list[DictConfig]:
    """The YAML file ``path`` (None: configs/default.yaml) and each override, parsed."""
    path = path or DEFAULT_CONFIG
    if not os.path.isfile(path):
        raise ConfigError(f"--config: {_not_a_file(path, 'a YAML file')}")
    file = _load_yaml(path, "--config")
    given = [_parse_override(item) for item in overrides or []]
    _check_renamed([file], path)
    _check_renamed(given, "the command line")
    for layer in [file, *given]:
        _move_renamed(layer)
    return [file, *given]


def _move_renamed(layer: DictConfig) -> None:
    """Moves the renamed sections of ``layer`` to their new name, in place, warning once per
    section with its first key spelled both ways."""
    for old, new in RENAMED_SECTIONS.items():
        if old not in layer:
            continue
        key = next(iter(_flatten(_section(layer, old))), "")
        warnings.warn(
            f"{old}.{key}: the {old} section is renamed {new}; write {new}.{key} (the old name "
            "stops loading in the next release)",
            FutureWarning,
            stacklevel=4,  # load_config's caller
        )
        section = layer.pop(old)
        layer[new] = OmegaConf.merge(section, layer[new]) if new in layer else section


def _check_renamed(layers: list[DictConfig], place: str) -> None:
    """Refuses a key that ``layers`` (the config file, or the command line) set under both its
    old and its new section name: which one was meant is a guess."""
    for old, new in RENAMED_SECTIONS.items():
        spelled: dict[str, set[str]] = {}
        for layer in layers:
            for section in (old, new):
                for key in _flatten(_section(layer, section)):
                    spelled.setdefault(key, set()).add(section)
        both = sorted(key for key, sections in spelled.items() if len(sections) == 2)
        if both:
            key = both[0]
            raise ConfigError(
                f"{old}.{key} and {new}.{key}: both given in {place}; {old} is the old name of "
                f"the {new} section: keep {new}.{key} only"
            )


def _section(layer: DictConfig, name: str) -> dict[str, Any]:
    """The section ``name`` of ``layer`` as plain containers ({} if absent or not a mapping)."""
    section = layer.get(name)
    return OmegaConf.to_container(section) if isinstance(section, DictConfig) else {}


def upgrade_tree(tree: dict[str, Any]) -> dict[str, Any]:
    """A recorded config tree (a run folder's config.yaml, a checkpoint's) with its renamed
    sections under their new names: runs written before a rename load and resume silently."""
    return {RENAMED_SECTIONS.get(key, key): value for key, value in tree.items()}


def _split_targets(layers: list[DictConfig]) -> tuple[list[DictConfig], EvalTargets]:
    """The layers without the EvalTargets keys of their top level, and the targets those give."""
    picked = []
    for layer in layers:
        picked.append(OmegaConf.masked_copy(layer, [key for key in TARGET_KEYS if key in layer]))
        for key in TARGET_KEYS:
            layer.pop(key, None)
    return layers, _build(EvalTargets, picked)


def _build(schema: type, layers: list[DictConfig]) -> Any:
    """The ``schema`` instance of ``layers`` merged onto its defaults (its checks run)."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), *layers)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        raise _friendly(error) from None
    except TypeError as error:  # a list where a mapping belongs (OmegaConf cannot merge them)
        raise ConfigError(f"{_list_where_mapping(layers)}: {error}; write a mapping") from None


def load_config(
    path: str | None = None, overrides: list[str] | None = None, check_files: bool = True
) -> RunConfig:
    """Merges schema <- YAML ``path`` <- dotlist ``overrides``, validates the result and, with
    ``check_files``, the paths it names (:func:`vsa2_rl.config.paths.check_paths`).

    ``path=None`` uses ``configs/default.yaml`` (the embedded toy run). Raises
    :class:`ConfigError` for a missing file, an unknown key, a wrong type, a contradiction or a
    path that is not what its key needs. The keys of :class:`EvalTargets` are refused where set
    (the run folders' config.yaml of earlier versions holds them unset, and still loads).
    """
    layers, targets = _split_targets(_layers(path, overrides))
    for key in TARGET_KEYS:
        if getattr(targets, key):
            raise ConfigError(
                f"{key}: names a model for vsa2-rl eval or export to take, not a setting of a "
                "run; to continue training from a checkpoint use train.resume=DIR"
            )
    config = _build(RunConfig, layers)
    if check_files:
        check_paths(config)
    return config


def load_eval_config(
    path: str | None = None, overrides: list[str] | None = None, check_files: bool = True
) -> tuple[RunConfig, EvalTargets]:
    """What ``vsa2-rl eval`` and ``export`` read: :func:`load_config`'s RunConfig of the settings,
    and the :class:`EvalTargets` (``run_dirs``, ``run_dir``, ``checkpoint``) given beside them,
    on the command line or in the file. With ``check_files``, the paths of both are checked."""
    layers, targets = _split_targets(_layers(path, overrides))
    config = _build(RunConfig, layers)
    if check_files:
        check_paths(config)
        check_target_paths(targets)
    return config, targets


def config_from_tree(tree: dict[str, Any], source: str) -> RunConfig:
    """The RunConfig of a recorded config tree (:func:`config_tree`, e.g. a checkpoint's),
    validated like :func:`load_config`'s, its paths unchecked; errors name ``source``. The
    EvalTargets keys that trees recorded before they left RunConfig hold are dropped."""
    tree = {key: value for key, value in upgrade_tree(tree).items() if key not in TARGET_KEYS}
    try:
        merged = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.create(tree))
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        raise ConfigError(f"{source}: records an unusable config: {_friendly(error)}") from None
    assert isinstance(config, RunConfig)
    return config


def load_recorded_config(path: str, key: str) -> RunConfig:
    """The RunConfig a run folder's config.yaml at ``path`` records (what the run was trained
    with), like :func:`config_from_tree`; errors name ``key`` (the key that led to the file)."""
    tree = OmegaConf.to_container(_load_yaml(path, key))
    return config_from_tree(tree, f"{key}: {path}")


def _yaml_problem(error: Exception) -> str:
    return " ".join(str(error).split())  # PyYAML's multi-line report on one line


def _load_yaml(path: str, key: str) -> DictConfig:
    """The mapping in the YAML file ``path``; ConfigError naming ``key`` for broken YAML or a
    non-mapping."""
    try:
        loaded = OmegaConf.load(path)
    except (yaml.YAMLError, OmegaConfBaseException) as error:
        raise ConfigError(f"{key}: {path} is not valid YAML: {_yaml_problem(error)}") from None
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{key}: {path} is not UTF-8 text ({error.reason} at byte "
            f"{error.start}); save it as UTF-8"
        ) from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(
            f"{key}: {path} must hold a mapping of keys (e.g. 'train: {{num_steps: 2}}'), "
            f"got a {type(loaded).__name__}"
        )
    if not loaded:  # empty or comments only: surely not meant as "the schema's defaults"
        fix = f"leave --config out for {DEFAULT_CONFIG}" if key == "--config" else "restore it"
        raise ConfigError(
            f"{key}: {path} holds no settings (empty, or comments only); write the settings "
            f"into it, or {fix}"
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


def config_tree(config: RunConfig) -> dict[str, Any]:
    """The resolved configuration as plain containers (what out_dir/config.yaml holds)."""
    return OmegaConf.to_container(OmegaConf.create(to_yaml(config)))


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(_flatten(value, f"{prefix}{key}."))
    return flat
