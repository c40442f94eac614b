"""Local diffusers MiniMax-H3 folders (text-to-video) as model bundles.

``load_minimax_h3_bundle`` loads a diffusers MiniMax-H3 folder, laid out as the modular
pipeline's components (never downloads), with VSA2 in the transformer's packed self-attention
(:mod:`vsa2_rl.models.minimax_h3`) and returns a :class:`MiniMaxBundle`, the ``VideoDiTBundle``
the trainer and evaluation drive. It reads ``transformer/`` (``MiniMaxH3Transformer3DModel``),
``vae/`` (``AutoencoderKLMiniMaxH3``), ``text_encoder/`` (Qwen3-VL) and ``tokenizer/``; the
``processor/``, ``audio_vae/``, schedulers and ``transformer_ref/`` (reference-to-video) are
not read (the ``sampler`` section sets the noise schedule, ``sampler.shift=12`` being the
pipeline's for video; the checkpoint is guidance-distilled, so ``sampler.guidance_scale`` stays
1 and an empty prompt, which a negative prompt would be, is refused).

The conventions are those of diffusers' ``MiniMaxH3ModularPipeline`` (0.42), text-only
requests (``t2va``):

- prompt: its tokens verbatim (no chat template, no special tokens), through the Qwen3-VL
  language model; the hidden state after decoder layer 50 conditions the transformer, one row
  per token, no padding and no mask (the transformer has none). The layers after 50 and the
  language-model head are dropped at load: nothing of theirs reaches the conditioning.
- the packed sequence ``[text | audio | video]``, its (t, h, w) rotary coordinates, row indices
  and modality tags are the pipeline's own (``MiniMaxH3PrepareLayoutStep.build_packed_sequence``
  and ``MiniMaxH3SetTimestepsStep.build_row_timesteps``); the text length shifts the media
  clock, so samples whose prompts have different lengths run in separate transformer calls, as
  do samples at different noise levels (the transformer takes one timestep list per call).
- the transformer's timestep is ``1 - sigma`` (1 = clean) and it predicts the data-ward
  velocity (data - noise): the bundle's velocity is its negation, noise - data, as Wan's.
- latents are the VAE's normalised by its ``latents_mean`` / ``latents_std``; decoding undoes
  that and the VAE's ImageNet pixel normalisation. Frame counts are ``17 n + 5`` (``5 n + 2``
  latent frames); the pipeline's 5-15 s duration window is not enforced, so that short clips
  can train.

Audio. MiniMax-H3 has no video-only path: every text-only request generates a soundtrack in the
same sequence, its rows stepped down their own schedule (shift 3) beside the video's. RL here
trains video only, and a bundle's state is the video latents alone, so the audio rows are held
where the pipeline starts them: pure noise at audio timestep 0 (sigma 1), one fixed draw
(seed :data:`AUDIO_SEED`, the pipeline's row layout) for every sample and step. The bundle's
velocity at sigma 1 is thus the pipeline's first step exactly; at later steps the video is
generated beside a soundtrack that tells it nothing, where the pipeline's soundtrack would
be taking shape.

``VideoDiTBundle.encode_prompts`` returns one tensor, so a prompt's rows travel in a
[:data:`MAX_TEXT_TOKENS`, D + 1] tensor (:func:`pack_text`): the embeddings zero-padded to the
fixed length, the last column 1 on the prompt's rows (the fixed length lets conditionings of
different batches be concatenated). The per-prompt disk cache (``model.text_cache_dir``) works
on it as on Wan's text embeddings.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vsa2_rl.attention import SparsityState
from vsa2_rl.config import ConfigError, VSA2Config
from vsa2_rl.device import resolve_dtype
from vsa2_rl.models.minimax_h3 import enable_vsa2
from vsa2_rl.models.wan_bundle import _read_cached, read_json_object

MINIMAX_COMPONENTS = ("transformer", "text_encoder", "tokenizer", "vae")
TEXT_LAYER = 50  # the Qwen3-VL hidden state (after this decoder layer) that conditions
MAX_TEXT_TOKENS = 512  # the fixed length of a packed prompt; longer prompts are refused
AUDIO_SEED = 0  # the seed of the audio rows' noise (module docstring)


def pack_text(embeddings: list[torch.Tensor]) -> torch.Tensor:
    """One [B, MAX_TEXT_TOKENS, D + 1] tensor of prompts' embeddings [L_i, D]: each zero-padded
    to the fixed length, the last column 1 on its L_i rows (module docstring)."""
    dim = embeddings[0].shape[-1]
    out = embeddings[0].new_zeros(len(embeddings), MAX_TEXT_TOKENS, dim + 1)
    for row, embedding in enumerate(embeddings):
        out[row, : embedding.shape[0], :dim] = embedding
        out[row, : embedding.shape[0], -1] = 1.0
    return out


def unpack_text(packed: torch.Tensor) -> list[torch.Tensor]:
    """The per-prompt embeddings [L_i, D] of a :func:`pack_text` tensor."""
    return [row[: int(row[:, -1].sum().item()), :-1] for row in packed]


def _unwrapped(transformer: nn.Module) -> nn.Module:
    """The diffusers transformer inside a DDP / DeepSpeed wrapper (``.module``)."""
    return getattr(transformer, "module", transformer)


def pixel_frames(latent_frames: int, vae: nn.Module) -> int:
    """The ``17 n + 5`` pixel frames whose latents have ``latent_frames`` (``5 n + 2``) frames."""
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import video_latent_num_frames

    per_chunk, kept = vae.config.clip_length, vae.tokens_chunk_size
    frames = per_chunk * ((latent_frames - 2) // kept) + kept
    if latent_frames < 2 or video_latent_num_frames(frames, per_chunk, kept) != latent_frames:
        raise ValueError(
            f"MiniMax-H3 latents have {kept}*n + 2 frames, got {latent_frames} latent frames"
        )
    return frames


@dataclass
class MiniMaxBundle:
    """A MiniMax-H3 text-to-video model as a ``VideoDiTBundle`` (module docstring)."""

    transformer: nn.Module
    sparsity_state: SparsityState
    latent_channels: int
    text_encoder: nn.Module  # Qwen3-VL's model without its head, its first 51 text layers
    tokenizer: Any
    vae: nn.Module
    text_cache_dir: str | None = None
    cache_key: str = ""  # identifies the text encoder in cache file names
    _memory_cache: dict = field(default_factory=dict, repr=False)
    _audio_noise: dict = field(default_factory=dict, repr=False)

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return _unwrapped(self.transformer).context_embedder.weight.dtype

    def latent_shape(self, num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
            align_num_frames,
            video_latent_num_frames,
        )

        per_chunk, kept = self.vae.config.clip_length, self.vae.tokens_chunk_size
        if align_num_frames(num_frames, per_chunk, kept) != num_frames:
            raise ValueError(
                f"num_frames must be {per_chunk}*n + {kept} for the MiniMax-H3 VAE (e.g. 124), "
                f"got {num_frames}"
            )
        spatial = self.vae.spatial_compression_ratio
        multiple = spatial * _unwrapped(self.transformer).config.patch_size[2]
        if height % multiple or width % multiple:
            raise ValueError(
                f"height and width must be multiples of {multiple}, got {height}x{width}"
            )
        frames = video_latent_num_frames(num_frames, per_chunk, kept)
        return self.latent_channels, frames, height // spatial, width // spatial

    def _cache_path(self, prompt: str) -> str | None:
        if not self.text_cache_dir:
            return None
        digest = hashlib.sha256(f"{self.cache_key}\n{prompt}".encode()).hexdigest()[:32]
        return os.path.join(self.text_cache_dir, f"{digest}.pt")

    def _encode(self, prompt: str) -> torch.Tensor:
        """The prompt's [L, D + 1] rows of :func:`pack_text` on the CPU."""
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if not ids:
            raise ValueError(
                "MiniMax-H3 needs a prompt of at least one token; it is guidance-distilled, so "
                "leave sampler.guidance_scale at 1 (no negative prompt is encoded)"
            )
        if len(ids) > MAX_TEXT_TOKENS:
            raise ValueError(
                f"MiniMax-H3 prompts may have at most {MAX_TEXT_TOKENS} tokens, this one has "
                f"{len(ids)}: {prompt[:80]!r}"
            )
        config = self.text_encoder.config
        device = next(self.text_encoder.parameters()).device
        ids = torch.tensor([ids], dtype=torch.long, device=device)
        # Qwen3-VL's per-token modality (0 text, 1 image, 2 video), what its processor derives
        # from the vision pad ids
        kinds = (ids == config.image_token_id).long() + 2 * (ids == config.video_token_id).long()
        with torch.no_grad():
            hidden = self.text_encoder(
                input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=kinds,
                use_cache=False, output_hidden_states=True,
            ).hidden_states[TEXT_LAYER][0]  # fmt: skip
        return pack_text([hidden])[0, : hidden.shape[0]].cpu()

    def encode_prompts(self, prompts: list[str]) -> torch.Tensor:
        """[B, MAX_TEXT_TOKENS, D + 1] packed text conditioning (:func:`pack_text`), cached per
        prompt in memory and, with ``text_cache_dir``, on disk."""
        rows = {p: self._memory_cache.get(p) for p in dict.fromkeys(prompts)}
        for prompt, value in rows.items():
            path = self._cache_path(prompt)
            if value is None and path is not None:
                rows[prompt] = _read_cached(path)
            if rows[prompt] is None:
                rows[prompt] = self._encode(prompt)
                self._write_cache(prompt, rows[prompt])
        self._memory_cache.update(rows)
        out = pack_text([rows[p][:, :-1] for p in prompts])
        return out.to(device=self.device, dtype=self.dtype)

    def _write_cache(self, prompt: str, value: torch.Tensor) -> None:
        """Writes a prompt's rows to its cache file (atomically); without a cache dir nothing."""
        path = self._cache_path(prompt)
        if path is None:
            return
        os.makedirs(self.text_cache_dir, exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        torch.save(value, tmp)
        os.replace(tmp, path)  # concurrent ranks never read half a file

    def audio_noise(self, rows: int, channels: int) -> torch.Tensor:
        """The audio rows [rows, channels] (float32, CPU): one fixed standard normal draw."""
        key = (rows, channels)
        if key not in self._audio_noise:
            generator = torch.Generator().manual_seed(AUDIO_SEED)
            self._audio_noise[key] = torch.randn(rows, channels, generator=generator)
        return self._audio_noise[key]

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, condition: torch.Tensor):
        """Flow-matching velocity (noise - data) in float32 of the video latents [B, C, T, H, W]
        at noise levels ``sigma`` [B]; ``condition``: :func:`pack_text`'s [B, ...] tensor."""
        batch = latents.shape[0]
        sigma = sigma.reshape(-1).expand(batch).float()
        lengths = condition[:, :, -1].float().sum(1).round().long().tolist()  # exact in bf16
        groups: dict[tuple[int, float], list[int]] = {}
        for index, key in enumerate(zip(lengths, sigma.tolist(), strict=True)):
            groups.setdefault(key, []).append(index)
        parts = [
            (rows, self._velocity(latents[rows], value, condition[rows, :length, :-1]))
            for (length, value), rows in groups.items()
        ]
        if len(parts) == 1:
            return parts[0][1]
        out = latents.new_empty(latents.shape, dtype=torch.float32)
        for rows, part in parts:
            out[rows] = part.to(out.dtype)
        return out

    def _velocity(self, latents: torch.Tensor, sigma: float, text: torch.Tensor) -> torch.Tensor:
        """The velocity of samples that share one prompt length and one noise level."""
        from diffusers.modular_pipelines.minimax_h3.before_denoise import (
            MiniMaxH3PrepareLayoutStep,
            MiniMaxH3SetTimestepsStep,
            patchify_video_latents,
        )
        from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
            MINIMAX_H3_AUDIO_CHANNELS,
            MINIMAX_H3_AUDIO_TAG,
            MINIMAX_H3_TEXT_TAG,
            MINIMAX_H3_VIDEO_TAG,
            audio_latent_num_frames,
        )

        model = _unwrapped(self.transformer)
        patch = tuple(model.config.patch_size)
        batch, channels, frames, height, width = latents.shape
        audio_latents = audio_latent_num_frames(pixel_frames(frames, self.vae))
        text_tags = torch.full((text.shape[1],), MINIMAX_H3_TEXT_TAG, dtype=torch.long)
        positions, tags, video, audio, text_rows, _, _ = (
            MiniMaxH3PrepareLayoutStep.build_packed_sequence(
                text_tags, frames, height, width, audio_latents, patch,
                MINIMAX_H3_AUDIO_CHANNELS, MINIMAX_H3_AUDIO_TAG, MINIMAX_H3_VIDEO_TAG,
            )
        )  # fmt: skip
        timesteps, timestep_rows = MiniMaxH3SetTimestepsStep.build_row_timesteps(
            video, audio, 0, 0, text.shape[1], 1.0 - sigma, 0.0, 0.0, 0.0
        )
        noise = self.audio_noise(audio.numel(), model.config.audio_in_channels)
        device = latents.device
        rows = patchify_video_latents(latents.float(), patch).reshape(batch, video.numel(), -1)
        out = self.transformer(
            hidden_states=rows,
            audio_hidden_states=noise.to(device).expand(batch, -1, -1),
            encoder_hidden_states=text.to(self.dtype),
            timestep=timesteps.to(device),
            timestep_indices=timestep_rows.to(device),
            token_tags=tags.to(device),
            position_ids=positions.to(device),
            video_indices=video.to(device),
            audio_indices=audio.to(device),
            text_indices=text_rows.to(device),
            return_dict=False,
        )[0]
        # rows (frame-major, then raster) of (C, p_t, p_h, p_w) patches back to [B, C, T, H, W]
        out = out.float().reshape(
            batch, frames // patch[0], height // patch[1], width // patch[2], channels, *patch
        )
        out = out.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(batch, channels, frames, height, width)
        return -out  # the transformer's velocity is data-ward

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """VAE decode (float32), one video at a time, of the de-normalised latents, ImageNet
        pixel normalisation undone: [B, T, C, H, W] float32 in [0, 1]."""
        from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
            MiniMaxH3ModularPipeline,
        )

        config = self.vae.config
        param = next(self.vae.decoder.parameters())
        shape = (1, -1, 1, 1, 1)
        mean = torch.tensor(config.latents_mean, device=param.device).view(shape)
        std = torch.tensor(config.latents_std, device=param.device).view(shape)
        pixel_mean = torch.tensor(MiniMaxH3ModularPipeline.pixel_mean.fget(None)).view(shape)
        pixel_std = torch.tensor(MiniMaxH3ModularPipeline.pixel_std.fget(None)).view(shape)
        videos = []
        with torch.no_grad():
            for one in latents.to(device=param.device, dtype=torch.float32).split(1):
                video = self.vae.decode((one * std + mean).to(param.dtype), return_dict=False)[0]
                video = video.float() * pixel_std.to(video.device) + pixel_mean.to(video.device)
                videos.append(video.clamp(0.0, 1.0))  # (1, C, T, H, W)
        return torch.cat(videos).permute(0, 2, 1, 3, 4).contiguous()


def missing_component(path: str, component: str, message: str) -> ConfigError:
    """The error of a MiniMax-H3 folder at ``path`` that lacks ``component``."""
    folders = ", ".join(f"{c}/" for c in MINIMAX_COMPONENTS)
    return ConfigError(
        f"model.path={path!r}: {message} Put a local diffusers MiniMax-H3 folder there (e.g. "
        f"/data/MiniMax-H3 with {folders}); missing: {component}"
    )


def check_folder(path: str) -> None:
    """The folder has every component subfolder, its transformer's channels fit its VAE, and
    its text encoder reaches layer 50 in the transformer's text width (ConfigError naming the
    file or folder)."""
    if not path or not os.path.isdir(path):
        raise missing_component(
            str(path), "the folder itself", "does not exist or is not a directory."
        )
    for component in MINIMAX_COMPONENTS:
        if not os.path.isdir(os.path.join(path, component)):
            raise missing_component(path, f"{component}/", f"has no {component}/ subfolder.")
    transformer_file = os.path.join(path, "transformer", "config.json")
    transformer = read_json_object(transformer_file)
    vae_file = os.path.join(path, "vae", "config.json")
    latent = read_json_object(vae_file).get("latent_channels", 24)
    if transformer.get("in_channels", 24) != latent:
        raise ConfigError(
            f"model.path: {transformer_file}: in_channels is {transformer.get('in_channels', 24)}, "
            f"but the VAE's latent_channels ({vae_file}) is {latent}; the folder mixes models, "
            "restore it from the model's download"
        )
    encoder_file = os.path.join(path, "text_encoder", "config.json")
    text = read_json_object(encoder_file).get("text_config", {})
    if text.get("num_hidden_layers", 0) <= TEXT_LAYER:
        raise ConfigError(
            f"model.path: {encoder_file}: text_config.num_hidden_layers is "
            f"{text.get('num_hidden_layers')}, but MiniMax-H3 conditions on the hidden state "
            f"after layer {TEXT_LAYER}; restore the Qwen3-VL text encoder from the model's download"
        )
    if transformer.get("text_dim", 5120) != text.get("hidden_size"):
        raise ConfigError(
            f"model.path: {transformer_file}: text_dim is {transformer.get('text_dim', 5120)} but "
            f"text_encoder/ embeds in {text.get('hidden_size')} ({encoder_file}); the folder "
            "mixes models, restore it from the model's download"
        )


def load_minimax_h3_bundle(
    path: str,
    vsa2: VSA2Config,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str = "auto",
    *,
    text_cache_dir: str | None = None,
    sparsity_state: SparsityState | None = None,
) -> MiniMaxBundle:
    """Load a local diffusers MiniMax-H3 folder as a :class:`MiniMaxBundle` with VSA2 in the
    transformer's packed self-attention.

    Args:
        path: the folder (config key ``model.path``); never downloads.
        vsa2: attention settings; ``vsa2.enabled = False`` keeps dense attention.
        device, dtype: where and in which dtype the transformer and the text encoder run
            ("auto": bf16 on CUDA, fp32 on CPU; the transformer keeps the modules diffusers
            pins to float32); the VAE runs in float32, in its default (released) tiles.
        text_cache_dir: folder for per-prompt embedding files; None = in-memory cache only.
        sparsity_state: shared state to use (a new one at sparsity 0 if None).
    """
    from diffusers import AutoencoderKLMiniMaxH3, MiniMaxH3Transformer3DModel
    from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

    check_folder(path)
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    state = sparsity_state if sparsity_state is not None else SparsityState()
    transformer = MiniMaxH3Transformer3DModel.from_pretrained(
        path, subfolder="transformer", torch_dtype=dtype
    )
    text_encoder = Qwen3VLForConditionalGeneration.from_pretrained(
        path, subfolder="text_encoder", torch_dtype=dtype
    ).model  # without the language-model head, which the conditioning never reaches
    language_model = text_encoder.language_model
    language_model.layers = language_model.layers[: TEXT_LAYER + 1]  # nor the layers after 50
    language_model.config.num_hidden_layers = TEXT_LAYER + 1
    transformer = enable_vsa2(transformer.to(device), vsa2, state)
    vae = AutoencoderKLMiniMaxH3.from_pretrained(path, subfolder="vae", torch_dtype=torch.float32)
    return MiniMaxBundle(
        transformer=transformer,
        sparsity_state=state,
        latent_channels=int(transformer.config.in_channels),
        text_encoder=text_encoder.to(device).eval().requires_grad_(False),
        tokenizer=AutoTokenizer.from_pretrained(path, subfolder="tokenizer"),
        vae=vae.to(device).eval().requires_grad_(False),
        text_cache_dir=text_cache_dir,
        cache_key=f"minimax_h3\n{os.path.abspath(path)}",
    )


__all__ = [
    "MINIMAX_COMPONENTS",
    "MiniMaxBundle",
    "load_minimax_h3_bundle",
    "pack_text",
    "unpack_text",
]
