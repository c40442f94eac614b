"""Wan2.2 A14B's two experts as one trainable module, and the helpers that treat a one-expert
and a two-expert transformer alike.

Wan2.2 A14B denoises with two transformers of the same architecture: ``transformer`` for the
high-noise steps and ``transformer_2`` for the low-noise ones, switched where the timestep
(sigma * 1000) falls below ``boundary_ratio * 1000`` (diffusers' ``WanPipeline``). In vsa2_rl
they are the ``high_noise`` and ``low_noise`` submodules of :class:`WanExperts`, whose forward
sends each sample to the expert of its own timestep. A batch whose samples sit on both sides
runs each expert on its rows: the Flow-GRPO update trains one transition of a whole chunk at a
time (one expert), DiffusionNFT draws a noise level per sample (both).

``model.train_experts`` names the experts RL trains; the other one stays frozen, holds no
optimizer state, is not copied for a reference or old policy (:func:`frozen_copy`), and is not
saved in checkpoints (``vsa2_rl.runtime.trained_state``).
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

EXPERT_NAMES = ("high_noise", "low_noise")
EXPERT_FOLDERS = {"high_noise": "transformer", "low_noise": "transformer_2"}  # diffusers' names


class WanExperts(nn.Module):
    """The two experts of Wan2.2 A14B (see the module docstring); ``train_experts`` names the
    ones RL updates."""

    def __init__(
        self,
        high_noise: nn.Module,
        low_noise: nn.Module,
        boundary_ratio: float,
        train_experts: tuple[str, ...] = EXPERT_NAMES,
    ) -> None:
        super().__init__()
        if not 0.0 < boundary_ratio < 1.0:
            raise ValueError(f"boundary_ratio must be in (0, 1), got {boundary_ratio!r}")
        unknown = set(train_experts) - set(EXPERT_NAMES)
        if unknown or not train_experts:
            raise ValueError(f"train_experts must name some of {EXPERT_NAMES}, got {train_experts}")
        self.high_noise = high_noise
        self.low_noise = low_noise
        self.boundary_timestep = boundary_ratio * 1000.0
        self.train_experts = tuple(name for name in EXPERT_NAMES if name in train_experts)

    @property
    def config(self):
        """The experts' shared architecture (diffusers config of the high-noise one)."""
        return self.high_noise.config

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_image: torch.Tensor | None = None,
        return_dict: bool = False,
    ) -> tuple[torch.Tensor]:
        """diffusers' ``WanTransformer3DModel`` call (``return_dict=False``) routed per sample:
        timestep [B] or per token [B, N] (a sample's level is its largest token timestep)."""
        level = timestep if timestep.ndim == 1 else timestep.amax(dim=1)
        high = level >= self.boundary_timestep
        inputs = (hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image)
        if bool(high.all()) or not bool(high.any()):
            expert = self.high_noise if bool(high.all()) else self.low_noise
            return (self._run(expert, *inputs),)
        out = None
        for expert, rows in ((self.high_noise, high), (self.low_noise, ~high)):
            index = rows.nonzero().flatten()
            part = self._run(expert, *(None if x is None else x[index] for x in inputs))
            if out is None:
                out = part.new_empty((hidden_states.shape[0], *part.shape[1:]))
            out[index] = part
        return (out,)

    @staticmethod
    def _run(expert, hidden_states, timestep, encoder_hidden_states, image_states):
        return expert(
            hidden_states=hidden_states,
            timestep=timestep,
            encoder_hidden_states=encoder_hidden_states,
            encoder_hidden_states_image=image_states,
            return_dict=False,
        )[0]

    def trained(self) -> list[nn.Module]:
        return [getattr(self, name) for name in self.train_experts]

    def enable_gradient_checkpointing(self) -> None:
        for expert in self.trained():
            expert.enable_gradient_checkpointing()

    def disable_adapters(self) -> None:
        for expert in self.trained():
            expert.disable_adapters()

    def enable_adapters(self) -> None:
        for expert in self.trained():
            expert.enable_adapters()


def experts_of(model: nn.Module) -> list[nn.Module]:
    """The diffusers transformers inside ``model`` (itself, or both experts), unwrapping the
    ``.module`` of DDP / DeepSpeed."""
    model = getattr(model, "module", model)
    return [model.high_noise, model.low_noise] if isinstance(model, WanExperts) else [model]


def token_grid(model: nn.Module, latent_shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(t, h, w) tokens of a video whose latents are ``latent_shape`` ([C,] T, H, W) after the
    transformer's patch embedding: Wan's ``patch_size`` tuple, or HunyuanVideo-1.5's and
    LTX-2's ``patch_size_t`` and square ``patch_size``."""
    config = experts_of(model)[0].config
    if hasattr(config, "patch_size_t"):
        patch = (config.patch_size_t, config.patch_size, config.patch_size)
    else:
        patch = tuple(config.patch_size)
    return tuple(size // p for size, p in zip(latent_shape[-3:], patch, strict=True))


def video_tokens(bundle, num_frames: int, height: int, width: int) -> int:
    """Tokens of one video of the bundle's transformer at that size."""
    return math.prod(token_grid(bundle.transformer, bundle.latent_shape(num_frames, height, width)))


def trained_modules(model: nn.Module) -> list[nn.Module]:
    """The parts of ``model`` RL trains: the experts ``model.train_experts`` names, or all."""
    model = getattr(model, "module", model)
    return model.trained() if isinstance(model, WanExperts) else [model]


def trained_prefixes(model: nn.Module) -> tuple[str, ...]:
    """State-dict key prefixes of :func:`trained_modules` ("" = every key)."""
    model = getattr(model, "module", model)
    if isinstance(model, WanExperts):
        return tuple(f"{name}." for name in model.train_experts)
    return ("",)


def expert_at(model: nn.Module, sigma: float) -> str:
    """The name of the expert that denoises at noise level ``sigma`` ("" for one transformer)."""
    model = getattr(model, "module", model)
    if not isinstance(model, WanExperts):
        return ""
    return "high_noise" if sigma * 1000.0 >= model.boundary_timestep else "low_noise"


def low_noise_guidance(
    model: nn.Module, scale: float | None, key: str
) -> tuple[float, float] | None:
    """``(boundary_timestep, scale)``, the second guidance scale of Wan2.2 A14B's low-noise
    steps as :func:`vsa2_rl.sampling.cfg_velocity` takes it; None when ``scale`` is None.
    ``ConfigError`` naming ``key`` for a model of one transformer, which has no boundary."""
    if scale is None:
        return None
    unwrapped = getattr(model, "module", model)
    if not isinstance(unwrapped, WanExperts):
        from vsa2_rl.config import ConfigError

        raise ConfigError(
            f"{key}: the guidance scale of the low-noise expert's steps needs a model of two "
            "experts (Wan2.2 A14B); leave it empty"
        )
    return unwrapped.boundary_timestep, scale


def trains_level(model: nn.Module, sigma: float) -> bool:
    """Whether the expert that denoises at noise level ``sigma`` trains (always, for one
    transformer): an update at another level would have nothing to change."""
    unwrapped = getattr(model, "module", model)
    if not isinstance(unwrapped, WanExperts):
        return True
    return expert_at(unwrapped, sigma) in unwrapped.train_experts


def trained_sigma_range(model: nn.Module) -> tuple[float, float] | None:
    """The noise levels [low, high) of the one expert that trains (high may be 1 inclusive), or
    None when every part of the model trains."""
    model = getattr(model, "module", model)
    if not isinstance(model, WanExperts) or len(model.train_experts) == len(EXPERT_NAMES):
        return None
    boundary = model.boundary_timestep / 1000.0
    return (boundary, 1.0) if model.train_experts == ("high_noise",) else (0.0, boundary)


def frozen_copy(model: nn.Module) -> nn.Module:
    """A frozen deep copy of ``model`` for a reference or old policy; an expert RL does not
    train is shared with ``model``, not copied (it never changes)."""
    model = getattr(model, "module", model)
    trained = {id(m) for m in trained_modules(model)}
    memo = {id(e): e for e in experts_of(model) if id(e) not in trained}
    duplicate = copy.deepcopy(model, memo)
    for module in trained_modules(duplicate):
        module.requires_grad_(False)
    return duplicate.eval()


__all__ = [
    "EXPERT_FOLDERS",
    "EXPERT_NAMES",
    "WanExperts",
    "experts_of",
    "frozen_copy",
    "trained_modules",
    "trained_prefixes",
    "trained_sigma_range",
    "trains_level",
]
