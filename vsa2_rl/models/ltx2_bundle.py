"""Local diffusers LTX-2 folders (text-to-video) as model bundles.

``load_ltx2_bundle`` loads a diffusers LTX-2 folder (never downloads) with VSA2 in every
block's video self-attention (:mod:`vsa2_rl.models.ltx2`) and returns an :class:`LTX2Bundle`,
the ``VideoDiTBundle`` the trainer and evaluation drive. It reads ``transformer/``
(``LTX2VideoTransformer3DModel``), ``vae/`` (``AutoencoderKLLTX2Video``), ``text_encoder/``
(Gemma 3), ``tokenizer/``, ``connectors/`` (``LTX2TextConnectors``) and the configuration of
``audio_vae/`` (the soundtrack's latent shape; no audio weights load). The vocoder, the
scheduler and the prompt enhancer are not read: the ``sampler`` section sets the noise
schedule.

The conventions are those of diffusers' ``LTX2Pipeline`` (0.42), without prompt enhancement:

- prompt: stripped, tokenized with special tokens, left-padded to :data:`MAX_TEXT_TOKENS`
  (longer prompts are cut there, as the pipeline cuts them); every hidden state of the Gemma 3
  language model (the embeddings and each layer's) stacked per token, through the connectors,
  which give the video stream's and the audio stream's text rows and the text mask (all ones
  where the connectors replace padding by their learned registers). Gemma's language-model
  head is dropped at load: nothing of it reaches the conditioning.
- the transformer's timestep (and its ``sigma``, which LTX-2.3 reads) is ``sigma * 1000`` and
  its video output is the flow-matching velocity noise - data, as Wan's: the bundle returns it
  as it is. The video is conditioned at :data:`FRAME_RATE` frames a second (the pipeline's
  default; its rotary coordinates carry time in seconds), with ``use_cross_timestep`` as the
  pipeline sets it.
- latents are the VAE's normalised by its ``latents_mean`` / ``latents_std`` (and
  ``scaling_factor``); decoding undoes that (a timestep-conditioned decoder decodes at the
  pipeline's default decode timestep 0, which adds no noise) and maps [-1, 1] to [0, 1].
  Frame counts are ``8 n + 1`` and sides multiples of 32 (LTX-2's VAE compression).
- classifier-free guidance (``sampler.guidance_scale``) is the trainer's, on the velocity,
  which equals the pipeline's guidance of the clean prediction; the pipeline's guidance
  rescale, spatio-temporal (STG) and modality-isolation guidance are not applied.

Audio. LTX-2 always generates a soundtrack beside the video: the audio latents run through the
same transformer, attending to the video and attended to by it. RL here trains video only, and
a bundle's state is the video latents alone, so the audio latents are held where the pipeline
starts them: pure noise at sigma 1 (audio timestep 1000), one fixed draw (seed
:data:`AUDIO_SEED`, in the pipeline's packed layout) for every sample and step, as long as the
video lasts (the pipeline's audio length for its frame count at :data:`FRAME_RATE`). The
bundle's velocity at sigma 1 is thus the transformer's video output at the pipeline's first step
exactly; at later steps the video is generated beside a soundtrack that tells it nothing, where
the pipeline's soundtrack would be taking shape.

``VideoDiTBundle.encode_prompts`` returns one tensor, so a prompt's conditioning travels as one
[:data:`MAX_TEXT_TOKENS`, D_video + D_audio + 1] tensor: the video stream's text rows, the
audio stream's, and the text mask as the last column. The per-prompt disk cache
(``model.text_cache_dir``) works on it as on Wan's text embeddings; at LTX-2's widths (3840 +
3840 + 1) a prompt's tensor is 15.7 MB in bfloat16, on disk and in the in-memory cache.
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
from vsa2_rl.models.ltx2 import enable_vsa2
from vsa2_rl.models.wan_bundle import _read_cached, read_json_object

LTX2_COMPONENTS = ("transformer", "vae", "audio_vae", "text_encoder", "tokenizer", "connectors")
MAX_TEXT_TOKENS = 1024  # the pipeline's max_sequence_length: prompts are padded to it
FRAME_RATE = 24.0  # frames a second the video is conditioned on (the pipeline's default)
NUM_TRAIN_TIMESTEPS = 1000  # timestep = sigma * 1000 (the flow-matching Euler scheduler's)
AUDIO_SEED = 0  # the seed of the audio latents' noise (module docstring)


def _unwrapped(transformer: nn.Module) -> nn.Module:
    """The diffusers transformer inside a DDP / DeepSpeed wrapper (``.module``)."""
    return getattr(transformer, "module", transformer)


def text_widths(connectors_config: dict) -> tuple[int, int]:
    """(video, audio) widths of the connectors' text rows: LTX-2.3's per-modality projections,
    or LTX-2.0's caption width for both streams."""
    if connectors_config.get("per_modality_projections", False):
        return (
            int(connectors_config.get("video_hidden_dim", 4096)),
            int(connectors_config.get("audio_hidden_dim", 2048)),
        )
    width = int(connectors_config.get("caption_channels", 3840))
    return width, width


def audio_latent_frames(pixel_frames: int, audio_vae_config: dict) -> int:
    """The pipeline's audio latent length for a video of ``pixel_frames`` at FRAME_RATE."""
    from diffusers.models.autoencoders.autoencoder_kl_ltx2_audio import LATENT_DOWNSAMPLE_FACTOR

    per_second = (
        audio_vae_config.get("sample_rate", 16000)
        / audio_vae_config.get("mel_hop_length", 160)
        / LATENT_DOWNSAMPLE_FACTOR
    )
    return round(pixel_frames / FRAME_RATE * per_second)


@dataclass
class LTX2Bundle:
    """An LTX-2 text-to-video model as a ``VideoDiTBundle`` (module docstring)."""

    transformer: nn.Module
    sparsity_state: SparsityState
    latent_channels: int
    text_encoder: nn.Module  # Gemma 3's model without its language-model head
    tokenizer: Any
    connectors: nn.Module
    vae: nn.Module
    audio_vae_config: dict  # audio_vae/config.json: the soundtrack's latent shape
    text_widths: tuple[int, int]  # (video, audio) widths of the connectors' text rows
    text_cache_dir: str | None = None
    cache_key: str = ""  # identifies the text encoder in cache file names
    _memory_cache: dict = field(default_factory=dict, repr=False)
    _audio_noise: dict = field(default_factory=dict, repr=False)

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return _unwrapped(self.transformer).proj_in.weight.dtype

    def _patch(self) -> tuple[int, int]:
        config = _unwrapped(self.transformer).config
        return config.patch_size_t, config.patch_size

    def latent_shape(self, num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        temporal = self.vae.temporal_compression_ratio
        spatial = self.vae.spatial_compression_ratio
        if num_frames < 1 or (num_frames - 1) % temporal:
            raise ValueError(
                f"num_frames must be {temporal}*n + 1 for the LTX-2 VAE (e.g. 121), "
                f"got {num_frames}"
            )
        multiple = spatial * self._patch()[1]
        if height % multiple or width % multiple:
            raise ValueError(
                f"height and width must be multiples of {multiple}, got {height}x{width}"
            )
        frames = (num_frames - 1) // temporal + 1
        return self.latent_channels, frames, height // spatial, width // spatial

    def _cache_path(self, prompt: str) -> str | None:
        if not self.text_cache_dir:
            return None
        digest = hashlib.sha256(f"{self.cache_key}\n{prompt}".encode()).hexdigest()[:32]
        return os.path.join(self.text_cache_dir, f"{digest}.pt")

    def _encode(self, prompt: str) -> torch.Tensor:
        """The prompt's [MAX_TEXT_TOKENS, D_video + D_audio + 1] conditioning on the CPU."""
        tokens = self.tokenizer(
            [prompt.strip()], padding="max_length", max_length=MAX_TEXT_TOKENS, truncation=True,
            add_special_tokens=True, return_tensors="pt",
        )  # fmt: skip
        device = next(self.text_encoder.parameters()).device
        ids, mask = tokens["input_ids"].to(device), tokens["attention_mask"].to(device)
        with torch.no_grad():
            hidden = self.text_encoder(
                input_ids=ids, attention_mask=mask, output_hidden_states=True
            ).hidden_states
            # every layer's hidden state side by side per token, as the connectors take them
            stacked = torch.stack(hidden, dim=-1).flatten(2, 3)
            video, audio, text_mask = self.connectors(
                stacked.to(self.connectors.dtype), mask, padding_side=self.tokenizer.padding_side
            )
        rows = torch.cat([video[0], audio[0], text_mask[0, :, None].to(video.dtype)], dim=-1)
        return rows.cpu()

    def encode_prompts(self, prompts: list[str]) -> torch.Tensor:
        """[B, MAX_TEXT_TOKENS, D_video + D_audio + 1] text conditioning (module docstring),
        cached per prompt in memory and, with ``text_cache_dir``, on disk."""
        rows = {p: self._memory_cache.get(p) for p in dict.fromkeys(prompts)}
        for prompt, value in rows.items():
            path = self._cache_path(prompt)
            if value is None and path is not None:
                rows[prompt] = _read_cached(path)
            if rows[prompt] is None:
                rows[prompt] = self._encode(prompt)
                self._write_cache(prompt, rows[prompt])
        self._memory_cache.update(rows)
        out = torch.stack([rows[p] for p in prompts])
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

    def audio_noise(self, latent_frames: int) -> torch.Tensor:
        """The audio latents [L, C_audio * mel bins] (float32, CPU) of a video of
        ``latent_frames``: one fixed standard normal draw of [C_audio, L, mel bins], packed
        time-major as the pipeline packs its audio latents."""
        from diffusers.models.autoencoders.autoencoder_kl_ltx2_audio import (
            LATENT_DOWNSAMPLE_FACTOR,
        )

        pixel_frames = (latent_frames - 1) * self.vae.temporal_compression_ratio + 1
        length = audio_latent_frames(pixel_frames, self.audio_vae_config)
        if length not in self._audio_noise:
            config = self.audio_vae_config
            channels = config.get("latent_channels", 8)
            mel_bins = config.get("mel_bins", 64) // LATENT_DOWNSAMPLE_FACTOR
            generator = torch.Generator().manual_seed(AUDIO_SEED)
            noise = torch.randn(channels, length, mel_bins, generator=generator)
            self._audio_noise[length] = noise.transpose(0, 1).flatten(1)
        return self._audio_noise[length]

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, condition: torch.Tensor):
        """Flow-matching velocity (noise - data) in float32 of the video latents [B, C, T, H, W]
        at noise levels ``sigma`` [B]; ``condition``: :meth:`encode_prompts`' [B, ...] tensor."""
        batch, channels, frames, height, width = latents.shape
        patch_t, patch = self._patch()
        grid = (frames // patch_t, height // patch, width // patch)
        device, dtype = latents.device, self.dtype
        # tokens in raster order of the patch grid, each its (C, p_t, p, p) patch
        rows = latents.reshape(batch, channels, grid[0], patch_t, grid[1], patch, grid[2], patch)
        rows = rows.permute(0, 2, 4, 6, 1, 3, 5, 7).flatten(4).flatten(1, 3)
        timestep = sigma.reshape(-1).expand(batch).float().to(device) * NUM_TRAIN_TIMESTEPS
        audio_timestep = torch.full_like(timestep, float(NUM_TRAIN_TIMESTEPS))  # sigma 1: noise
        noise = self.audio_noise(frames)
        video_width, audio_width = self.text_widths
        text = condition.to(device=device, dtype=dtype)
        mask = text[..., -1]
        out = self.transformer(
            hidden_states=rows.to(dtype),
            audio_hidden_states=noise.to(device=device, dtype=dtype).expand(batch, -1, -1),
            encoder_hidden_states=text[..., :video_width],
            audio_encoder_hidden_states=text[..., video_width : video_width + audio_width],
            timestep=timestep,
            audio_timestep=audio_timestep,
            sigma=timestep,
            audio_sigma=audio_timestep,
            encoder_attention_mask=mask,
            audio_encoder_attention_mask=mask,
            num_frames=grid[0],
            height=grid[1],
            width=grid[2],
            fps=FRAME_RATE,
            audio_num_frames=noise.shape[0],
            use_cross_timestep=True,
            return_dict=False,
        )[0]
        out = out.float().reshape(batch, *grid, channels, patch_t, patch, patch)
        return out.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(batch, channels, frames, height, width)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """VAE decode (float32), one video at a time, of the de-normalised latents, [-1, 1] ->
        [0, 1]: [B, T, C, H, W] float32."""
        vae = self.vae
        param = next(vae.decoder.parameters())
        shape = (1, -1, 1, 1, 1)
        mean = vae.latents_mean.to(param.device, torch.float32).view(shape)
        std = vae.latents_std.to(param.device, torch.float32).view(shape)
        # the pipeline's decode timestep and decode noise scale (0: no noise added)
        timestep = torch.zeros(1, device=param.device) if vae.config.timestep_conditioning else None
        videos = []
        with torch.no_grad():
            for one in latents.to(device=param.device, dtype=torch.float32).split(1):
                one = one * std / vae.config.scaling_factor + mean
                video = vae.decode(one.to(param.dtype), timestep, return_dict=False)[0]
                videos.append((video.float() * 0.5 + 0.5).clamp(0.0, 1.0))  # (1, C, T, H, W)
        return torch.cat(videos).permute(0, 2, 1, 3, 4).contiguous()


def missing_component(path: str, component: str, message: str) -> ConfigError:
    """The error of an LTX-2 folder at ``path`` that lacks ``component``."""
    folders = ", ".join(f"{c}/" for c in LTX2_COMPONENTS)
    return ConfigError(
        f"model.path={path!r}: {message} Put a local diffusers LTX-2 folder there (e.g. "
        f"/data/LTX-2 with {folders}); missing: {component}"
    )


def _mismatch(file: str, what: str, other: str) -> ConfigError:
    return ConfigError(
        f"model.path: {file}: {what}, but {other}; the folder mixes models, restore it from the "
        "model's download"
    )


def check_folder(path: str) -> None:
    """The folder has every component subfolder, a Gemma 3 text encoder whose stacked hidden
    states the connectors take, and a transformer whose channels fit its VAEs and connectors
    (ConfigError naming the file or folder)."""
    from diffusers.models.autoencoders.autoencoder_kl_ltx2_audio import LATENT_DOWNSAMPLE_FACTOR

    if not path or not os.path.isdir(path):
        raise missing_component(
            str(path), "the folder itself", "does not exist or is not a directory."
        )
    for component in LTX2_COMPONENTS:
        if not os.path.isdir(os.path.join(path, component)):
            raise missing_component(path, f"{component}/", f"has no {component}/ subfolder.")
    files = {c: os.path.join(path, c, "config.json") for c in LTX2_COMPONENTS if c != "tokenizer"}
    configs = {component: read_json_object(file) for component, file in files.items()}
    transformer, connectors = configs["transformer"], configs["connectors"]
    latent = configs["vae"].get("latent_channels", 128)
    if transformer.get("in_channels", 128) != latent:
        raise _mismatch(
            files["transformer"], f"in_channels is {transformer.get('in_channels', 128)}",
            f"the VAE's latent_channels ({files['vae']}) is {latent}",
        )  # fmt: skip
    audio = configs["audio_vae"]
    audio_rows = audio.get("latent_channels", 8) * (
        audio.get("mel_bins", 64) // LATENT_DOWNSAMPLE_FACTOR
    )
    if transformer.get("audio_in_channels", 128) != audio_rows:
        raise _mismatch(
            files["transformer"],
            f"audio_in_channels is {transformer.get('audio_in_channels', 128)}",
            f"the audio VAE ({files['audio_vae']}) packs latent_channels x mel_bins / 4 = "
            f"{audio_rows}",
        )
    encoder = configs["text_encoder"]
    if encoder.get("model_type") != "gemma3":
        raise ConfigError(
            f"model.path: {files['text_encoder']}: model_type is {encoder.get('model_type')!r}, "
            "but LTX-2 and LTX-2.3 encode prompts with Gemma 3 ('gemma3'); restore the text "
            "encoder from the model's download"
        )
    text = encoder.get("text_config", {})
    stacked = text.get("hidden_size", 0) * (text.get("num_hidden_layers", 0) + 1)
    taken = connectors.get("caption_channels", 3840) * connectors.get("text_proj_in_factor", 49)
    if stacked != taken:
        raise _mismatch(
            files["connectors"],
            f"caption_channels x text_proj_in_factor is {taken}",
            f"the text encoder ({files['text_encoder']}) stacks hidden_size x "
            f"(num_hidden_layers + 1) = {stacked}",
        )
    if transformer.get("use_prompt_embeddings", True):
        video_width = text_widths(connectors)[0]
        if transformer.get("caption_channels", 3840) != video_width:
            raise _mismatch(
                files["transformer"],
                f"caption_channels is {transformer.get('caption_channels', 3840)}",
                f"the connectors ({files['connectors']}) give text rows of {video_width}",
            )


def load_ltx2_bundle(
    path: str,
    vsa2: VSA2Config,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str = "auto",
    *,
    text_cache_dir: str | None = None,
    sparsity_state: SparsityState | None = None,
) -> LTX2Bundle:
    """Load a local diffusers LTX-2 folder as an :class:`LTX2Bundle` with VSA2 in the
    transformer's video self-attention.

    Args:
        path: the folder (config key ``model.path``); never downloads.
        vsa2: attention settings; ``vsa2.enabled = False`` keeps dense attention.
        device, dtype: where and in which dtype the transformer, the text encoder and the
            connectors run ("auto": bf16 on CUDA, fp32 on CPU); the VAE runs in float32.
        text_cache_dir: folder for per-prompt conditioning files; None = in-memory cache only.
        sparsity_state: shared state to use (a new one at sparsity 0 if None).
    """
    from diffusers import AutoencoderKLLTX2Video, LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from transformers import AutoTokenizer, Gemma3ForConditionalGeneration

    check_folder(path)
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    state = sparsity_state if sparsity_state is not None else SparsityState()
    transformer = LTX2VideoTransformer3DModel.from_pretrained(
        path, subfolder="transformer", torch_dtype=dtype
    )
    text_encoder = Gemma3ForConditionalGeneration.from_pretrained(
        path, subfolder="text_encoder", torch_dtype=dtype
    ).model  # without the language-model head, which the conditioning never reaches
    connectors = LTX2TextConnectors.from_pretrained(path, subfolder="connectors", torch_dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(path, subfolder="tokenizer")
    tokenizer.padding_side = "left"  # as the pipeline pads Gemma's prompts
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    transformer = enable_vsa2(transformer.to(device), vsa2, state)
    vae = AutoencoderKLLTX2Video.from_pretrained(path, subfolder="vae", torch_dtype=torch.float32)
    return LTX2Bundle(
        transformer=transformer,
        sparsity_state=state,
        latent_channels=int(transformer.config.in_channels),
        text_encoder=text_encoder.to(device).eval().requires_grad_(False),
        tokenizer=tokenizer,
        connectors=connectors.to(device).eval().requires_grad_(False),
        vae=vae.to(device).eval().requires_grad_(False),
        audio_vae_config=read_json_object(os.path.join(path, "audio_vae", "config.json")),
        text_widths=text_widths(connectors.config),
        text_cache_dir=text_cache_dir,
        cache_key=f"ltx2\n{os.path.abspath(path)}",
    )


__all__ = ["LTX2_COMPONENTS", "LTX2Bundle", "check_folder", "load_ltx2_bundle"]
