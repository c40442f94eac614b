"""Model families: what the run-time needs of a family of base models, keyed by ``model.kind``.

A :class:`ModelFamily` gathers a family's functions: loading the ``VideoDiTBundle`` of a run's
config and, on its transformer, swapping the attention to VSA2, finding the VSA2 parameters,
compiling or fusing the blocks and splitting them for sequence parallelism. The run-time looks a
family up with :func:`family_of` and calls these, never a family's module directly.

Two families share Wan's transformer functions (:mod:`vsa2_rl.models.wan`): ``wan`` (local
diffusers Wan folders, :mod:`vsa2_rl.models.wan_bundle`) and ``toy``, whose transformer is a
small diffusers ``WanTransformer3DModel`` but whose checkpoint, text encoder and pixel-space
"latents" are its own (:mod:`vsa2_rl.toy.model`); the two differ only in how they load.
``hunyuan_video15`` (local diffusers HunyuanVideo-1.5 text-to-video folders,
:mod:`vsa2_rl.models.hunyuan_bundle`) has its own VSA2 attention
(:mod:`vsa2_rl.models.hunyuan_video15`); it does not compile, fuse or split its blocks yet.
Nor does ``minimax_h3`` (local diffusers MiniMax-H3 folders, text-to-video with the audio rows
held as noise, :mod:`vsa2_rl.models.minimax_bundle`), with its own VSA2 attention
(:mod:`vsa2_rl.models.minimax_h3`), nor ``ltx2`` (local diffusers LTX-2 folders, text-to-video
with the audio latents held as noise, :mod:`vsa2_rl.models.ltx2_bundle`), with VSA2 in its video
self-attention (:mod:`vsa2_rl.models.ltx2`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from vsa2_rl.config import ConfigError, RunConfig
from vsa2_rl.models import hunyuan_video15, ltx2, minimax_h3, wan

if TYPE_CHECKING:
    from vsa2_rl.models.wan_bundle import VideoDiTBundle
    from vsa2_rl.preflight import ModelFacts


@dataclass(frozen=True)
class ModelFamily:
    """One family of base models: each field is a function the run-time calls.

    ``load_bundle(config, device, dtype, facts)`` returns the ``VideoDiTBundle`` of
    ``config.model`` with VSA2 per ``config.attention`` (``facts``: the model folder's, or None
    where the caller has not read them). The others take the bundle's transformer, change it in
    place and return it (``vsa2_parameters`` returns the parameters): ``enable_vsa2(transformer,
    vsa2_config, state)``, ``compile_blocks`` (``model.compile_blocks``), ``fuse_block_kernels``
    (``model.fused_kernels``) and ``enable_sequence_parallel(transformer, group)`` (a
    ``ValueError`` for a group that cannot split the model). ``conditioning_tokens`` is what
    ``vsa2-rl check``'s plan counts as the keys beside the video's that every video query
    attends to: the padded text (and soundtrack) rows a prompt brings.
    """

    kind: str  # the model.kind that selects it
    load_bundle: Callable[[RunConfig, torch.device, torch.dtype, ModelFacts | None], VideoDiTBundle]
    enable_vsa2: Callable[..., nn.Module]
    vsa2_parameters: Callable[[nn.Module], list[nn.Parameter]]
    compile_blocks: Callable[[nn.Module], nn.Module]
    fuse_block_kernels: Callable[[nn.Module], nn.Module]
    enable_sequence_parallel: Callable[[nn.Module, object], nn.Module]
    conditioning_tokens: int = 512  # Wan's UMT5 text, padded to 512


def _load_wan_bundle(config: RunConfig, device, dtype, facts: ModelFacts | None):
    from vsa2_rl.models.wan_bundle import load_wan_bundle

    model = config.model
    cache = model.text_cache_dir or os.path.join(config.out_dir, "text_cache")
    return load_wan_bundle(
        model.path, config.attention, device=device, dtype=dtype, text_cache_dir=cache,
        train_experts=tuple(model.train_experts), variant=facts.variant if facts else None,
        vae_decode_dtype=model.vae_decode_dtype,
    )  # fmt: skip


def _load_toy_bundle(config: RunConfig, device, dtype, facts: ModelFacts | None):
    from vsa2_rl.toy.model import load_toy_bundle

    return load_toy_bundle(config.attention, device=device, dtype=dtype, path=config.model.path)


def _load_hunyuan_bundle(config: RunConfig, device, dtype, facts: ModelFacts | None):
    from vsa2_rl.models.hunyuan_bundle import load_hunyuan_video15_bundle

    model = config.model
    cache = model.text_cache_dir or os.path.join(config.out_dir, "text_cache")
    return load_hunyuan_video15_bundle(
        model.path, config.attention, device=device, dtype=dtype, text_cache_dir=cache
    )


def _load_minimax_bundle(config: RunConfig, device, dtype, facts: ModelFacts | None):
    from vsa2_rl.models.minimax_bundle import load_minimax_h3_bundle

    model = config.model
    cache = model.text_cache_dir or os.path.join(config.out_dir, "text_cache")
    return load_minimax_h3_bundle(
        model.path, config.attention, device=device, dtype=dtype, text_cache_dir=cache
    )


def _load_ltx2_bundle(config: RunConfig, device, dtype, facts: ModelFacts | None):
    from vsa2_rl.models.ltx2_bundle import load_ltx2_bundle

    model = config.model
    cache = model.text_cache_dir or os.path.join(config.out_dir, "text_cache")
    return load_ltx2_bundle(
        model.path, config.attention, device=device, dtype=dtype, text_cache_dir=cache
    )


def _refuse(model: str, key: str, what: str) -> Callable[[nn.Module], nn.Module]:
    """A block transformation ``model`` does not have yet: a ConfigError naming ``key``, the
    setting that asked for it."""

    def refuse(transformer: nn.Module) -> nn.Module:
        raise ConfigError(f"{key}: {model} has no {what} yet; set it to false")

    return refuse


def _refuse_sequence_parallel(model: str) -> Callable[[nn.Module, object], nn.Module]:
    """``model`` has no sequence parallelism yet (the trainer names the key)."""

    def refuse(transformer: nn.Module, group) -> nn.Module:
        raise ValueError(f"{model} has no sequence parallelism yet; set it to 1")

    return refuse


WAN = ModelFamily(
    kind="wan",
    load_bundle=_load_wan_bundle,
    enable_vsa2=wan.enable_vsa2,
    vsa2_parameters=wan.vsa2_parameters,
    compile_blocks=wan.compile_blocks,
    fuse_block_kernels=wan.fuse_block_kernels,
    enable_sequence_parallel=wan.enable_sequence_parallel,
)
TOY = replace(WAN, kind="toy", load_bundle=_load_toy_bundle)
HUNYUAN_VIDEO15 = ModelFamily(
    kind="hunyuan_video15",
    load_bundle=_load_hunyuan_bundle,
    enable_vsa2=hunyuan_video15.enable_vsa2,
    vsa2_parameters=hunyuan_video15.vsa2_parameters,
    compile_blocks=_refuse("HunyuanVideo-1.5", "model.compile_blocks", "compiled blocks"),
    fuse_block_kernels=_refuse("HunyuanVideo-1.5", "model.fused_kernels", "fused block kernels"),
    enable_sequence_parallel=_refuse_sequence_parallel("HunyuanVideo-1.5"),
    conditioning_tokens=1000 + 256 + 1,  # MLLM text, ByT5 glyphs, one (padding) image token
)
MINIMAX_H3 = ModelFamily(
    kind="minimax_h3",
    load_bundle=_load_minimax_bundle,
    enable_vsa2=minimax_h3.enable_vsa2,
    vsa2_parameters=minimax_h3.vsa2_parameters,
    compile_blocks=_refuse("MiniMax-H3", "model.compile_blocks", "compiled blocks"),
    fuse_block_kernels=_refuse("MiniMax-H3", "model.fused_kernels", "fused block kernels"),
    enable_sequence_parallel=_refuse_sequence_parallel("MiniMax-H3"),
    conditioning_tokens=512 + 128,  # packed text rows, and a 5 s soundtrack's audio rows
)
LTX2 = ModelFamily(
    kind="ltx2",
    load_bundle=_load_ltx2_bundle,
    enable_vsa2=ltx2.enable_vsa2,
    vsa2_parameters=ltx2.vsa2_parameters,
    compile_blocks=_refuse("LTX-2", "model.compile_blocks", "compiled blocks"),
    fuse_block_kernels=_refuse("LTX-2", "model.fused_kernels", "fused block kernels"),
    enable_sequence_parallel=_refuse_sequence_parallel("LTX-2"),
    conditioning_tokens=1024,  # Gemma 3 text padded to the pipeline's 1,024 tokens
)

FAMILIES: dict[str, ModelFamily] = {
    family.kind: family for family in (HUNYUAN_VIDEO15, LTX2, MINIMAX_H3, TOY, WAN)
}


def family_of(kind: str) -> ModelFamily:
    """The family that ``model.kind = kind`` selects; a ConfigError naming the known kinds for
    any other."""
    family = FAMILIES.get(kind)
    if family is None:
        raise ConfigError(
            f"model.kind: no model family {kind!r}; known kinds: {', '.join(sorted(FAMILIES))}"
        )
    return family


__all__ = [
    "FAMILIES",
    "HUNYUAN_VIDEO15",
    "LTX2",
    "MINIMAX_H3",
    "TOY",
    "WAN",
    "ModelFamily",
    "family_of",
]
