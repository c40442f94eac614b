"""The value checks every config section's ``__post_init__`` uses, and :class:`ConfigError`.

These look at values alone, never at the file system: a config constructs the same on any
machine (only a ``~`` in a path key becomes the home folder, :func:`_expand_user`), and
:mod:`vsa2_rl.config.paths` checks the folders and files it names where a command is about to
use them.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import field
from typing import Any


class ConfigError(ValueError):
    """A configuration problem; the message names the key and the fix."""


def _doc(text: str, **kwargs: Any) -> Any:
    """A dataclass field with its help text (kept in ``metadata`` for ``--help``)."""
    return field(metadata={"help": text}, **kwargs)


def _expand_user(section: Any, *names: str) -> None:
    """``~`` and ``~user`` at the start of the path fields ``names`` of ``section`` (strings, or
    lists of them) become home folders, as a shell would have made them."""
    for name in names:
        value = getattr(section, name)
        if isinstance(value, str):
            setattr(section, name, os.path.expanduser(value))
        elif isinstance(value, list):
            setattr(section, name, [os.path.expanduser(item) for item in value])


def _check(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{key}: {message}")


def _check_choice(value: str, key: str, choices: tuple[str, ...]) -> None:
    _check(value in choices, key, f"got {value!r}, expected one of {', '.join(choices)}")


def _check_finite(value: float, key: str) -> None:
    _check(math.isfinite(value), key, f"must be a finite number, got {value}")


def _check_finite_fields(section, prefix: str) -> None:
    """Every float of ``section`` and of its nested sections (lists included) is finite: an inf
    learning rate, noise level or shift would only show as NaN videos mid-run."""
    for entry in dataclasses.fields(section):
        value, key = getattr(section, entry.name), f"{prefix}{entry.name}"
        if dataclasses.is_dataclass(value):
            _check_finite_fields(value, f"{key}.")
        elif isinstance(value, float):
            _check_finite(value, key)
        elif isinstance(value, list):
            for index, item in enumerate(value):
                if isinstance(item, float):
                    _check_finite(item, key)
                elif dataclasses.is_dataclass(item):
                    _check_finite_fields(item, f"{key}[{index}].")


# The largest integer any key takes (int32's): beyond it a value is a typo, and a size
# (group_size, num_steps) would exhaust memory or never end rather than fail.
MAX_INT = 2**31 - 1
MAX_ROLLOUTS_PER_STEP = 100_000


def _check_int(value: int, key: str) -> None:
    _check(abs(value) <= MAX_INT, key, f"must be at most 2**31 - 1 in size, got {value}")


def _check_int_fields(section, prefix: str) -> None:
    """Every integer of ``section`` and of its nested sections is at most ``MAX_INT`` in size."""
    for entry in dataclasses.fields(section):
        value, key = getattr(section, entry.name), f"{prefix}{entry.name}"
        if dataclasses.is_dataclass(value):
            _check_int_fields(value, f"{key}.")
        items = value if isinstance(value, list) else [value]
        for item in items:
            if isinstance(item, int) and not isinstance(item, bool):
                _check_int(item, key)
