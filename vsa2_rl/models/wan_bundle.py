"""Local diffusers Wan folders as model bundles: Wan2.1 and Wan2.2, text- and image-to-video.

``load_wan_bundle`` loads a diffusers Wan folder (never downloads) with VSA2 self-attention and
returns a :class:`WanBundle`, the ``VideoDiTBundle`` the trainer and evaluation drive. What the
folder is comes from its ``model_index.json`` (:func:`read_wan_variant`):

- Wan2.1 T2V / I2V: one ``transformer``; I2V takes the image through extra input channels and
  a CLIP image embedding (``image_encoder/``, ``image_processor/``).
- Wan2.2 A14B T2V / I2V (``boundary_ratio`` and ``transformer_2/``): two experts switched by
  noise level (:mod:`vsa2_rl.models.experts`); I2V through input channels, no CLIP.
- Wan2.2 TI2V-5B (``expand_timesteps``): a 16x spatial VAE, one timestep per token, text-to-video
  or, when a prompt carries an image, image-to-video through its first latent frame.

The conventions are the Wan pipelines': UMT5 prompt embeddings trimmed to the prompt length and
zero-padded to 512 tokens, timestep = sigma * 1000 (flow-matching Euler scheduler), latents
de-normalised with the VAE's ``latents_mean`` / ``latents_std`` before decoding; images as
:mod:`vsa2_rl.models.conditioning` prepares them. The VAE runs as the pipelines' memory-saving
settings make it (tiles, one video at a time) and encodes in float32; it decodes in float32 or,
with ``model.vae_decode_dtype=bfloat16``, through a bfloat16 copy of its decoder
(:func:`decoding_vae`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import warnings
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from vsa2_rl.attention import SparsityState
from vsa2_rl.config import ConfigError, VSA2Config
from vsa2_rl.device import resolve_dtype
from vsa2_rl.models.conditioning import (
    WanCondition,
    clip_image_embeds,
    condition_images,
    vae_scale_factors,
)
from vsa2_rl.models.experts import EXPERT_NAMES, WanExperts, experts_of
from vsa2_rl.models.wan import enable_vsa2, input_dtype, wan_velocity

WAN_TEXT_LEN = 512  # UMT5 context length of Wan (the transformer is trained on 512 tokens)
WAN_COMPONENTS = ("transformer", "text_encoder", "tokenizer", "vae")


@runtime_checkable
class VideoDiTBundle(Protocol):
    """A video DiT with its text encoder and decoder: what the trainer and evaluation drive."""

    transformer: nn.Module
    sparsity_state: SparsityState
    latent_channels: int

    def latent_shape(self, num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        """(C, T, H, W) of the latents of a video of that size."""
        ...

    def encode_prompts(self, prompts: list[str]) -> torch.Tensor:
        """[B, L, D_text] text embeddings."""
        ...

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, condition):
        """Flow-matching velocity (noise - data) at noise level sigma [B] in [0, 1]; condition
        is what ``encode_prompts`` (or a Wan bundle's ``encode_condition``) returned."""
        ...

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Videos [B, T, C, H, W] in [0, 1], float32."""
        ...


def with_transformer(bundle, transformer: nn.Module):
    """A view of ``bundle`` (a dataclass bundle) that runs ``transformer`` instead of its own:
    the encoders, the decoder, the caches and the sparsity state are shared, nothing is copied.
    The trainer's reference, old and evaluation policies are such views."""
    return replace(bundle, transformer=transformer)


@dataclass(frozen=True)
class WanVariant:
    """What a diffusers Wan folder's ``model_index.json`` says about its model."""

    boundary_ratio: float | None = None  # set: Wan2.2 A14B, two experts
    expand_timesteps: bool = False  # Wan2.2 TI2V-5B: one timestep per token
    image_encoder: bool = False  # Wan2.1 I2V: a CLIP image encoder

    @property
    def transformer_folders(self) -> tuple[str, ...]:
        return ("transformer", "transformer_2") if self.boundary_ratio else ("transformer",)


def _listed(index: dict, name: str, index_file: str) -> bool:
    """Whether ``model_index.json`` lists a component (``[null, null]`` or no entry: absent)."""
    entry = index.get(name)
    if entry is None:
        return False
    if not isinstance(entry, list) or len(entry) != 2:
        raise _bad_entry(index_file, name, entry, '["<library>", "<class>"] or [null, null]')
    return any(part is not None for part in entry)


def _bad_entry(file: str, key: str, value, wanted: str) -> ConfigError:
    """The error of a model-folder file whose ``key`` holds ``value`` instead of ``wanted``."""
    return ConfigError(
        f"model.path: {file}: {json.dumps(key)} must be {wanted}, got {json.dumps(value)}; "
        "correct it, or restore the file from the model's download"
    )


def read_json_object(file: str) -> dict:
    """The JSON object a model folder's configuration ``file`` holds; ConfigError naming it
    when it is missing, not JSON, or JSON of another shape."""
    try:
        with open(file, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError) as error:
        reason = " ".join(str(error).split())[:160]
        raise ConfigError(
            f"model.path: {file} is not readable JSON ({reason}); restore it from the model's "
            "download"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"model.path: {file} holds a JSON {type(data).__name__}, not the object "
            "{...} of settings it should; restore it from the model's download"
        )
    return data


def _flag(index: dict, key: str, index_file: str) -> bool:
    """A true/false entry of ``model_index.json`` (absent or null: false), read by type."""
    value = index.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad_entry(index_file, key, value, "true or false (a JSON boolean, unquoted)")
    return value


def _boundary_ratio(index: dict, index_file: str) -> float | None:
    """Wan2.2 A14B's expert boundary: a number in (0, 1), or None (one transformer)."""
    value = index.get("boundary_ratio")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1:
        raise _bad_entry(
            index_file, "boundary_ratio", value, "a number in (0, 1) (Wan2.2 A14B's: 0.875)"
        )
    return float(value)


def read_wan_variant(path: str) -> WanVariant:
    """The :class:`WanVariant` of the folder at ``path`` (a folder without ``model_index.json``
    is Wan2.1-like: one transformer, one timestep per sample). Every entry is read by type: a
    ConfigError names the file, the key and the fix."""
    index_file = os.path.join(path, "model_index.json")
    if not os.path.isfile(index_file):
        return WanVariant()
    index = read_json_object(index_file)
    boundary = _boundary_ratio(index, index_file)
    two = _listed(index, "transformer_2", index_file)
    if two != (boundary is not None):
        raise ConfigError(
            f"model.path: {index_file} lists transformer_2 {'but no' if two else 'nowhere, yet a'}"
            " boundary_ratio; a Wan2.2 A14B folder has both, other Wan folders neither"
        )
    return WanVariant(
        boundary_ratio=boundary,
        expand_timesteps=_flag(index, "expand_timesteps", index_file),
        image_encoder=_listed(index, "image_encoder", index_file),
    )


# the transformer's settings that are sizes: a positive integer each (diffusers' defaults
# stand in for absent ones)
TRANSFORMER_SIZES = (
    "in_channels", "out_channels", "num_attention_heads", "attention_head_dim", "num_layers",
    "ffn_dim", "freq_dim", "text_dim", "rope_max_seq_len",
)  # fmt: skip
TRANSFORMER_OPTIONAL_SIZES = ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len")


def _is_size(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def read_transformer_config(path: str, folder: str = "transformer") -> dict:
    """The settings of the folder's ``folder`` transformer (its ``config.json``), checked by
    type before a model is built from them: ConfigError naming the file, key and fix."""
    file = os.path.join(path, folder, "config.json")
    config = read_json_object(file)
    for key in TRANSFORMER_SIZES:
        if key in config and not _is_size(config[key]):
            raise _bad_entry(file, key, config[key], "a positive integer")
    for key in TRANSFORMER_OPTIONAL_SIZES:
        if config.get(key) is not None and not _is_size(config[key]):
            raise _bad_entry(file, key, config[key], "a positive integer or null")
    patch = config.get("patch_size", [1, 2, 2])
    if not isinstance(patch, list) or len(patch) != 3 or not all(map(_is_size, patch)):
        raise _bad_entry(file, "patch_size", patch, "three positive integers, e.g. [1, 2, 2]")
    return config


def _read_cached(path: str) -> torch.Tensor | None:
    """The embedding a text-cache file holds, or None (encode the prompt, which rewrites the
    file) when it is missing or is not a [L, D] float tensor: a file cut short or overwritten
    costs one encoding, with a warning naming it, not the run."""
    if not os.path.exists(path):
        return None
    try:
        cached = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises many kinds for a damaged file
        cached = f"cannot be loaded ({' '.join(str(error).split())[:120]})"
    if isinstance(cached, torch.Tensor) and cached.dim() == 2 and cached.is_floating_point():
        return cached
    problem = cached if isinstance(cached, str) else "holds no [tokens, dim] float tensor"
    warnings.warn(
        f"model.text_cache_dir: {path} {problem}; encoding its prompt again", stacklevel=3
    )
    return None


@dataclass
class WanBundle:
    """A Wan model as a ``VideoDiTBundle`` (see the module docstring).

    ``text_encoder``, ``tokenizer`` and ``vae`` may be None when only the transformer was loaded;
    then ``encode_prompts`` / ``decode`` raise. ``image_scheme`` is None for a text-to-video
    model, else how it takes an image (``channels``: required; ``first_frame``: optional).
    """

    transformer: nn.Module
    sparsity_state: SparsityState
    latent_channels: int
    text_encoder: nn.Module | None = None
    tokenizer: Any = None
    vae: nn.Module | None = None
    decode_vae: nn.Module | None = None  # decodes (:func:`decoding_vae`); None: ``vae`` does
    text_cache_dir: str | None = None
    cache_key: str = ""  # identifies the text encoder in cache file names
    text_len: int = WAN_TEXT_LEN
    vae_scale: tuple[int, int] = (4, 8)  # (temporal, spatial) compression of the VAE
    expand_timesteps: bool = False
    image_scheme: str | None = None
    image_encoder: nn.Module | None = None
    image_processor: Any = None
    _memory_cache: dict = field(default_factory=dict, repr=False)
    _image_cache: dict = field(default_factory=dict, repr=False)

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return input_dtype(self.transformer)

    @property
    def requires_image(self) -> bool:
        return self.image_scheme == "channels"

    def latent_shape(self, num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        t_scale, s_scale = self.vae_scale
        _, p_h, p_w = experts_of(self.transformer)[0].config.patch_size
        if (num_frames - 1) % t_scale != 0:
            raise ValueError(
                f"num_frames must be {t_scale}*k + 1 for the Wan VAE (e.g. 81), got {num_frames}"
            )
        if height % (s_scale * p_h) or width % (s_scale * p_w):
            raise ValueError(
                f"height and width must be multiples of {s_scale * p_h}, got {height}x{width}"
            )
        frames = (num_frames - 1) // t_scale + 1
        return self.latent_channels, frames, height // s_scale, width // s_scale

    def _cache_path(self, prompt: str) -> str | None:
        if not self.text_cache_dir:
            return None
        digest = hashlib.sha256(f"{self.cache_key}\n{prompt}".encode()).hexdigest()[:32]
        return os.path.join(self.text_cache_dir, f"{digest}.pt")

    def _encode_uncached(self, prompts: list[str]) -> list[torch.Tensor]:
        """Per prompt: UMT5 last hidden states of its real tokens, [L_i, D] (Wan pipeline)."""
        if self.text_encoder is None or self.tokenizer is None:
            raise ValueError("this bundle was loaded without text_encoder/tokenizer")
        tokens = self.tokenizer(
            prompts,
            padding="max_length",
            max_length=self.text_len,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        device = next(self.text_encoder.parameters()).device
        mask = tokens.attention_mask.to(device)
        with torch.no_grad():
            hidden = self.text_encoder(tokens.input_ids.to(device), mask).last_hidden_state
        lengths = mask.gt(0).sum(dim=1).tolist()
        return [h[:n].float().cpu() for h, n in zip(hidden, lengths, strict=True)]

    def encode_prompts(self, prompts: list[str]) -> torch.Tensor:
        """[B, 512, D_text] UMT5 embeddings, zero past each prompt; cached per prompt on disk."""
        prompts = [" ".join(p.split()) for p in prompts]
        embeddings: dict[str, torch.Tensor] = {}
        missing = []
        for prompt in dict.fromkeys(prompts):
            path = self._cache_path(prompt)
            if prompt in self._memory_cache:
                embeddings[prompt] = self._memory_cache[prompt]
            elif path is not None and (cached := _read_cached(path)) is not None:
                embeddings[prompt] = cached
            else:
                missing.append(prompt)
        if missing:
            for prompt, emb in zip(missing, self._encode_uncached(missing), strict=True):
                embeddings[prompt] = emb
                path = self._cache_path(prompt)
                if path is not None:
                    os.makedirs(self.text_cache_dir, exist_ok=True)
                    tmp = f"{path}.tmp{os.getpid()}"
                    torch.save(emb, tmp)
                    os.replace(tmp, path)  # atomic: concurrent ranks never read half a file
        self._memory_cache.update(embeddings)
        out = torch.zeros(len(prompts), self.text_len, embeddings[prompts[0]].shape[-1])
        for i, prompt in enumerate(prompts):
            emb = embeddings[prompt][: self.text_len]
            out[i, : emb.shape[0]] = emb
        return out.to(device=self.device, dtype=self.dtype)

    def encode_condition(
        self, prompts: list[str], images: list[str | None] | None, video_size: tuple[int, int, int]
    ) -> torch.Tensor | WanCondition:
        """What the model is conditioned on for ``prompts``: their text embeddings, and with
        condition images (paths, one per prompt; ``video_size`` = (frames, height, width)) a
        :class:`WanCondition`. Image latents are cached per (path, size) in memory."""
        text = self.encode_prompts(prompts)
        if images is None or all(image is None for image in images):
            if self.requires_image:
                raise ValueError("this image-to-video model needs a condition image per prompt")
            return text
        if self.image_scheme is None:
            raise ValueError("this text-to-video model takes no condition image")
        if any(image is None for image in images):
            raise ValueError("either every prompt of a batch has a condition image or none")
        if self.vae is None:
            raise ValueError("this bundle was loaded without a vae, which encodes the images")
        latents = torch.cat([self._image_latents(path, video_size) for path in images])
        embeds = None
        if self.image_encoder is not None:
            embeds = clip_image_embeds(self.image_encoder, self.image_processor, list(images))
        return WanCondition(
            text=text,
            scheme=self.image_scheme,
            image_latents=latents.to(self.device),
            image_embeds=None if embeds is None else embeds.to(self.device),
        )

    def _image_latents(self, path: str, video_size: tuple[int, int, int]) -> torch.Tensor:
        key = (path, *video_size)
        if key not in self._image_cache:
            latent = condition_images(self.vae, [path], *video_size, self.image_scheme)
            self._image_cache[key] = latent.cpu()
        return self._image_cache[key]

    def velocity(
        self, latents: torch.Tensor, sigma: torch.Tensor, condition: torch.Tensor | WanCondition
    ) -> torch.Tensor:
        return wan_velocity(
            self.transformer, latents, sigma, condition, expand_timesteps=self.expand_timesteps
        )

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """:func:`decode_latents` with ``decode_vae`` (``vae`` where that is None)."""
        if self.vae is None:
            raise ValueError("this bundle was loaded without a vae")
        return decode_latents(self.vae if self.decode_vae is None else self.decode_vae, latents)


def prepare_vae(vae: nn.Module, device: torch.device | str) -> nn.Module:
    """``vae`` as a bundle runs it: frozen, on ``device``, in spatial tiles (diffusers' 256-pixel
    tiles at a 192-pixel stride, blended) and one video of a batch at a time."""
    vae = vae.to(device).eval().requires_grad_(False)
    vae.enable_tiling()
    vae.enable_slicing()
    return vae


def decoding_vae(vae: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The VAE that decodes in ``dtype`` (``model.vae_decode_dtype``): ``vae`` itself where its
    decoder has that dtype, else a copy whose decoding modules (``post_quant_conv``,
    ``decoder``) are in ``dtype`` and whose encoding modules are ``vae``'s own, shared.

    A copy of the decoder rather than ``torch.autocast``: autocast casts a frozen weight anew at
    every call (it caches only casts of weights that require grad), and a tiled decode calls the
    decoder once per tile and latent frame (315 times for a 480p x 81 video); and its float32
    ops (the RMS norms' products with their float32 gains) would turn the activations back to
    float32 between convolutions. The copy costs the decoder's weights once more in ``dtype``
    (Wan2.1's VAE: 73M parameters, 147 MB in bfloat16), and diffusers' Wan VAE is written to run
    in bfloat16 (its RMS norms and upsampling compute in float32 inside). The encoder is not
    copied: image-to-video conditioning encodes with ``vae``, in float32.
    """
    if next(vae.decoder.parameters()).dtype == dtype:
        return vae
    shared = {id(vae.encoder): vae.encoder, id(vae.quant_conv): vae.quant_conv}
    copied = copy.deepcopy(vae, memo=shared)  # deepcopy's memo: these are taken, not copied
    copied.post_quant_conv.to(dtype)
    copied.decoder.to(dtype)
    return copied


def decode_latents(vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
    """Wan VAE decode: de-normalise (float32), decode in the dtype of ``vae``'s decoder, map
    [-1, 1] -> [0, 1]; [B, T, C, H, W] float32."""
    param = next(vae.decoder.parameters())
    shape = (1, -1, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean, device=param.device).view(shape)
    std = torch.tensor(vae.config.latents_std, device=param.device).view(shape)
    latents = latents.to(device=param.device, dtype=torch.float32) * std + mean
    with torch.no_grad():
        video = vae.decode(latents.to(param.dtype), return_dict=False)[0]
    video = (video.float() * 0.5 + 0.5).clamp(0.0, 1.0)  # (B, C, T, H, W)
    return video.permute(0, 2, 1, 3, 4).contiguous()


def missing_component(path: str, component: str, message: str) -> ConfigError:
    """The error of a Wan folder at ``path`` that lacks ``component`` (``message`` says how)."""
    folders = ", ".join(f"{c}/" for c in WAN_COMPONENTS)
    return ConfigError(
        f"model.path={path!r}: {message} Put a local diffusers Wan folder there (Wan2.1 or "
        f"Wan2.2, e.g. /data/Wan2.1-T2V-1.3B-Diffusers with {folders}); missing: {component}"
    )


def read_vae_config(path: str):
    """The VAE's config of the folder at ``path`` (its ``vae/config.json``), None without vae/;
    the entries vsa2_rl reads are checked by type (ConfigError naming file, key and fix)."""
    if not os.path.isdir(os.path.join(path, "vae")):
        return None
    file = os.path.join(path, "vae", "config.json")
    config = read_json_object(file)
    z_dim = config.get("z_dim", 16)
    if not _is_size(z_dim):
        raise _bad_entry(file, "z_dim", z_dim, "a positive integer")
    for key in ("latents_mean", "latents_std"):
        value = config.get(key)
        numbers = isinstance(value, list) and all(_is_number(v) for v in value)
        if not numbers or len(value) != z_dim or (key == "latents_std" and 0 in value):
            raise _bad_entry(file, key, value, f"a list of z_dim ({z_dim}) numbers")
    scales = [config.get(f"scale_factor_{axis}") for axis in ("temporal", "spatial")]
    if any(scale is not None and not _is_size(scale) for scale in scales):
        raise _bad_entry(file, "scale_factor_spatial", scales[1], "a positive integer or null")
    downsample = config.get("temperal_downsample", [False, True, True])
    if not all(scales) and not (
        isinstance(downsample, list) and all(isinstance(v, bool) for v in downsample)
    ):
        raise _bad_entry(file, "temperal_downsample", downsample, "a list of true/false")
    return SimpleNamespace(**{"temperal_downsample": downsample, **config, "z_dim": z_dim})


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _image_scheme(transformer_config, variant: WanVariant) -> str | None:
    if variant.expand_timesteps:
        return "first_frame"
    if transformer_config.in_channels != transformer_config.out_channels:
        return "channels"
    return None


def check_channels(path: str, transformer: dict, vae_config) -> None:
    """The transformer's channels fit its VAE and an image scheme: ``out_channels`` the VAE's
    ``z_dim``, ``in_channels`` that (text) or twice it plus 4 mask channels (image)."""
    file = os.path.join(path, "transformer", "config.json")
    out = transformer.get("out_channels", 16)
    if vae_config is not None and out != vae_config.z_dim:
        raise _bad_entry(file, "out_channels", out, f"the VAE's z_dim ({vae_config.z_dim})")
    wanted = (out, 2 * out + 4)
    if transformer.get("in_channels", 16) not in wanted:
        raise _bad_entry(
            file, "in_channels", transformer.get("in_channels"),
            f"{wanted[0]} (out_channels: text-to-video) or {wanted[1]} (image-to-video)",
        )  # fmt: skip


def read_image_scheme(path: str, variant: WanVariant) -> str | None:
    """How the model at ``path`` (of ``variant``, :func:`read_wan_variant`) takes a condition
    image, from its configuration files alone: None (text-to-video), ``channels`` (image
    required) or ``first_frame`` (image optional)."""
    if not path or not os.path.isdir(os.path.join(path, "transformer")):
        raise missing_component(str(path), "transformer/", "has no transformer/ subfolder.")
    config = {"in_channels": 16, "out_channels": 16, **read_transformer_config(path)}
    check_channels(path, config, read_vae_config(path))
    return _image_scheme(SimpleNamespace(**config), variant)


def assemble_experts(
    path: str, variant: WanVariant, train_experts: tuple[str, ...], load
) -> nn.Module:
    """The folder's transformer, or its two experts as :class:`WanExperts`."""
    if variant.boundary_ratio is None:
        if train_experts:
            raise ConfigError(
                f"model.train_experts: {list(train_experts)} but {path} holds one transformer "
                "(a Wan2.2 A14B folder has transformer_2/ too); leave model.train_experts empty"
            )
        return load("transformer")
    return WanExperts(
        load("transformer"),
        load("transformer_2"),
        variant.boundary_ratio,
        train_experts=train_experts or EXPERT_NAMES,
    )


def needed_folders(variant: WanVariant, components: tuple[str, ...] = WAN_COMPONENTS) -> list:
    """The subfolders loading ``components`` of a folder of ``variant`` reads."""
    needed = [*variant.transformer_folders, *components[1:]]
    if variant.image_encoder and "vae" in components:
        needed += ["image_encoder", "image_processor"]
    return list(dict.fromkeys(needed))


def load_wan_bundle(
    path: str,
    vsa2: VSA2Config,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str = "auto",
    *,
    text_cache_dir: str | None = None,
    components: tuple[str, ...] = WAN_COMPONENTS,
    sparsity_state: SparsityState | None = None,
    train_experts: tuple[str, ...] = (),
    variant: WanVariant | None = None,
    vae_decode_dtype: torch.dtype | str = "float32",
) -> WanBundle:
    """Load a local diffusers Wan folder as a ``WanBundle`` with VSA2 self-attention.

    Args:
        path: the folder (config key ``model.path``); never downloads.
        vsa2: attention settings; ``vsa2.enabled = False`` keeps dense attention.
        device, dtype: where and in which dtype the transformer(s), text and image encoders run
            ("auto": bf16 on CUDA, fp32 on CPU). The VAE runs with tiling and slicing
            (:func:`prepare_vae`) and encodes in float32.
        text_cache_dir: folder for per-prompt embedding files; None = in-memory cache only.
        components: subfolders to load; "transformer" is required (Wan2.2 A14B's
            ``transformer_2`` comes with it; a CLIP image encoder comes with the vae).
        sparsity_state: shared state to use (a new one at sparsity 0 if None).
        train_experts: the experts RL trains (``model.train_experts``; empty = all); only a
            two-expert folder has any to name.
        variant: the folder's :class:`WanVariant` where the caller read it already (the
            trainer's pre-flight); None reads its ``model_index.json``.
        vae_decode_dtype: the dtype the VAE decodes in (``model.vae_decode_dtype``): float32,
            or bfloat16 through a copy of the decoder (:func:`decoding_vae`).
    """
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import AutoTokenizer, UMT5EncoderModel

    unknown = set(components) - set(WAN_COMPONENTS)
    if "transformer" not in components or unknown:
        raise ValueError(
            f"components must include 'transformer' and only {WAN_COMPONENTS}, got {components}"
        )
    if not path or not os.path.isdir(path):
        raise missing_component(
            str(path), "the folder itself", "does not exist or is not a directory."
        )
    variant = variant if variant is not None else read_wan_variant(path)
    for component in needed_folders(variant, components):
        if not os.path.isdir(os.path.join(path, component)):
            raise missing_component(path, f"{component}/", f"has no {component}/ subfolder.")
    for folder in variant.transformer_folders:  # damaged settings: one line, not a traceback
        settings = read_transformer_config(path, folder)
    vae_config = read_vae_config(path)
    check_channels(path, settings, vae_config)
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    state = sparsity_state if sparsity_state is not None else SparsityState()

    def load(folder: str) -> nn.Module:
        model = WanTransformer3DModel.from_pretrained(path, subfolder=folder, torch_dtype=dtype)
        return enable_vsa2(model.to(device), vsa2, state)

    transformer = assemble_experts(path, variant, tuple(train_experts), load)
    text_encoder = tokenizer = vae = decode_vae = image_encoder = image_processor = None
    if "text_encoder" in components:
        text_encoder = UMT5EncoderModel.from_pretrained(
            path, subfolder="text_encoder", torch_dtype=dtype
        )
        text_encoder = text_encoder.to(device).eval().requires_grad_(False)
    if "tokenizer" in components:
        tokenizer = AutoTokenizer.from_pretrained(path, subfolder="tokenizer")
    if "vae" in components:
        vae = AutoencoderKLWan.from_pretrained(path, subfolder="vae", torch_dtype=torch.float32)
        vae = prepare_vae(vae, device)
        decode_vae = decoding_vae(vae, resolve_dtype(vae_decode_dtype, device))
        if variant.image_encoder:
            image_encoder, image_processor = _load_image_encoder(path, device, dtype)
    config = experts_of(transformer)[0].config
    return WanBundle(
        transformer=transformer,
        sparsity_state=state,
        latent_channels=int(config.out_channels),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        vae=vae,
        decode_vae=decode_vae,
        text_cache_dir=text_cache_dir,
        cache_key=os.path.abspath(path),
        vae_scale=vae_scale_factors(vae_config) if vae_config is not None else (4, 8),
        expand_timesteps=variant.expand_timesteps,
        image_scheme=_image_scheme(config, variant),
        image_encoder=image_encoder,
        image_processor=image_processor,
    )


def _load_image_encoder(path: str, device: torch.device, dtype: torch.dtype) -> tuple:
    """Wan2.1 I2V's CLIP vision model and its image processor, frozen."""
    from transformers import CLIPImageProcessor, CLIPVisionModel

    encoder = CLIPVisionModel.from_pretrained(path, subfolder="image_encoder", torch_dtype=dtype)
    processor = CLIPImageProcessor.from_pretrained(path, subfolder="image_processor")
    return encoder.to(device).eval().requires_grad_(False), processor


__all__ = [
    "WAN_COMPONENTS",
    "VideoDiTBundle",
    "WanBundle",
    "WanVariant",
    "decode_latents",
    "decoding_vae",
    "load_wan_bundle",
    "prepare_vae",
    "read_image_scheme",
    "read_wan_variant",
]
