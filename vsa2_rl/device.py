"""Where and in what precision a run computes: the run's device (``device``), the rewards'
device (``rewards.device``) and the model's dtype (``model.dtype``), resolved from their config
values. Below the model loaders (:mod:`vsa2_rl.models.wan_bundle`, :mod:`vsa2_rl.toy.model`)
and :mod:`vsa2_rl.runtime`, which import it; it imports only the config's error type."""

from __future__ import annotations

import torch

from vsa2_rl.config import ConfigError, RunConfig


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present; a CUDA device this process does not see (no CUDA, or
    ``cuda:N`` with N >= the device count) is a config error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device: {name!r} requested but CUDA is not available (use device=cpu)")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ConfigError(
            f"device: {name!r} requested but this process sees {torch.cuda.device_count()} CUDA "
            "device(s); name one of them (cuda:0 ...), cuda, or cpu"
        )
    return device


def resolve_reward_device(config: RunConfig, run_device: torch.device) -> torch.device:
    """Where the rewards score: ``rewards.device``, else the run's device."""
    name = config.rewards.device
    if name is None:
        return run_device
    device = torch.device(name)
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ConfigError(
            f"rewards.device: {name!r} requested but this process sees "
            f"{torch.cuda.device_count()} CUDA device(s); name one of them, cpu, or leave it empty"
        )
    return device


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``auto`` = bf16 on CUDA (the trained precision of Wan), fp32 on CPU; a dtype or one of
    ``DTYPES``' names as it says."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be auto, {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]
