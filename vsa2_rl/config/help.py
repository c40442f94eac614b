"""The ``--help`` text of the config: one entry per key with the value a plain run uses."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from omegaconf import OmegaConf

from vsa2_rl.config.loading import DEFAULT_CONFIG, _flatten
from vsa2_rl.config.run import RunConfig


def help_lines(schema: Any = RunConfig, prefix: str = "", path: str | None = DEFAULT_CONFIG):
    """One line per key for the CLI's ``--help``: ``key = value  help``, where value is what a
    run without ``--config`` uses: the value in ``path`` (configs/default.yaml) where it sets
    the key, with the schema default beside it, else the schema default."""
    # an installed wheel has no configs/ folder: then the schema defaults are what a run uses
    found = path is not None and os.path.isfile(path)
    used = _flatten(OmegaConf.to_container(OmegaConf.load(path))) if found else {}
    lines = []
    for f in dataclasses.fields(schema):
        name = prefix + f.name
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            lines.extend(help_lines(type(default), name + ".", path))
            continue
        if isinstance(default, list) and default and dataclasses.is_dataclass(default[0]):
            default = [dataclasses.asdict(item) for item in default]
        shown = f"{default!r}"
        if name in used and used[name] != default:
            shown = f"{used[name]!r}  (default.yaml; schema default {default!r})"
        lines.append(f"  {name} = {shown}\n      {f.metadata.get('help', '')}")
    return lines
