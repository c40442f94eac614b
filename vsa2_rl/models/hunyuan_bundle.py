"""Local diffusers HunyuanVideo-1.5 folders (text-to-video) as model bundles.

``load_hunyuan_video15_bundle`` loads a diffusers HunyuanVideo-1.5 folder (never downloads) with
VSA2 in the transformer's joint attention (:mod:`vsa2_rl.models.hunyuan_video15`) and returns
a :class:`HunyuanBundle`, the ``VideoDiTBundle`` the trainer and evaluation drive. The folder
holds ``transformer/`` (``HunyuanVideo15Transformer3DModel``), ``vae/``
(``AutoencoderKLHunyuanVideo15``), ``text_encoder/`` + ``tokenizer/`` (the Qwen2.5-VL language
model, "MLLM") and ``text_encoder_2/`` + ``tokenizer_2/`` (ByT5, the glyph encoder); its
``scheduler/`` and ``guider/`` are not read (the ``sampler`` section sets the noise schedule and
the guidance scale).

The conventions are those of diffusers' ``HunyuanVideo15Pipeline`` (0.42):

- MLLM: the prompt in the model's chat template (its system message, then the prompt, " " for
  an empty one), padded to 108 + 1000 tokens; the hidden states 2 layers below the last, with
  the first 108 (template) positions cut off: [1000, D] and a mask of the real tokens.
- glyphs: the quoted spans of a prompt ("..." or “...”), as ``Text "span". `` each, through
  ByT5 padded to 256 bytes; a prompt without quotes gives zeros and an all-zero mask.
- the transformer takes the noisy latents followed by a zero condition latent and a zero mask
  channel (2C + 1 channels), timestep = sigma * 1000 in the model's dtype, and a zero image
  embedding, which marks the image tokens padding. One zero image token stands in for the
  pipeline's 729: padding tokens take no part in the attention, so the output is the same.
- latents are the VAE's times its ``scaling_factor``; the output is the flow-matching velocity
  (noise - data), as Wan's.

``VideoDiTBundle.encode_prompts`` returns one tensor, so a prompt's four conditioning tensors
travel packed in one [1000 + 256, max(D, D_2) + 1] tensor (:func:`pack_text`): the MLLM rows
first, then the glyph rows, each embedding zero-padded to the common width and followed by its
mask in the last column. Batching, classifier-free guidance's batch of 2B and the per-prompt
disk cache (``model.text_cache_dir``) then work on it as on Wan's text embeddings.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vsa2_rl.attention import SparsityState
from vsa2_rl.config import ConfigError, VSA2Config
from vsa2_rl.device import resolve_dtype
from vsa2_rl.models.hunyuan_video15 import enable_vsa2
from vsa2_rl.models.wan_bundle import _read_cached, prepare_vae, read_json_object

HUNYUAN_COMPONENTS = (
    "transformer", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "vae",
)  # fmt: skip
MLLM_LEN = 1000  # the MLLM tokens the transformer takes (after the template's)
TEMPLATE_LEN = 108  # the chat template's tokens before the prompt's, cut off
SKIPPED_LAYERS = 2  # the MLLM embedding is the hidden state this many layers below the last
GLYPH_LEN = 256  # ByT5 bytes of the glyph text
GLYPH_QUOTES = re.compile(r"\"(.*?)\"|“(.*?)”")


def system_message() -> str:
    """The system message of HunyuanVideo-1.5's chat template, as the installed diffusers
    pipeline has it (the model was trained with it, to the character)."""
    from diffusers import HunyuanVideo15Pipeline

    signature = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds)
    return signature.parameters["system_message"].default


def glyph_text(prompt: str) -> str | None:
    """The ByT5 input of ``prompt``: its quoted spans (duplicates dropped where there are
    several) as ``Text "span". `` each, or None without quotes."""
    spans = [double or curly for double, curly in GLYPH_QUOTES.findall(prompt)]
    if len(spans) > 1:
        spans = list(dict.fromkeys(spans))
    if not spans:
        return None
    return ". ".join(f'Text "{span}"' for span in spans) + ". "


def pack_text(text, text_mask, glyph, glyph_mask) -> torch.Tensor:
    """One [B, L + L_2, max(D, D_2) + 1] tensor of the MLLM embeddings [B, L, D] and the glyph
    embeddings [B, L_2, D_2], each zero-padded to the common width, their masks ([B, L],
    [B, L_2]) in the last column (module docstring); in ``text``'s dtype."""
    batch, length, dim = text.shape
    width = max(dim, glyph.shape[-1]) + 1
    out = text.new_zeros(batch, length + glyph.shape[1], width)
    out[:, :length, :dim] = text
    out[:, length:, : glyph.shape[-1]] = glyph.to(text.dtype)
    out[:, :length, -1] = text_mask.to(text.dtype)
    out[:, length:, -1] = glyph_mask.to(text.dtype)
    return out


def unpack_text(packed: torch.Tensor, text_len: int, text_dim: int, glyph_dim: int) -> tuple:
    """(text, text_mask, glyph, glyph_mask) of a :func:`pack_text` tensor."""
    return (
        packed[:, :text_len, :text_dim],
        packed[:, :text_len, -1],
        packed[:, text_len:, :glyph_dim],
        packed[:, text_len:, -1],
    )


def _unwrapped(transformer: nn.Module) -> nn.Module:
    """The diffusers transformer inside a DDP / DeepSpeed wrapper (``.module``)."""
    return getattr(transformer, "module", transformer)


def hunyuan_velocity(
    transformer: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, packed: torch.Tensor
) -> torch.Tensor:
    """Flow-matching velocity (noise - data) in float32 of HunyuanVideo-1.5 text-to-video at
    noise levels ``sigma`` [B] in [0, 1]; ``packed``: :func:`pack_text`'s [B, ...] tensor."""
    config = _unwrapped(transformer).config
    dtype = _unwrapped(transformer).x_embedder.proj.weight.dtype
    batch = latents.shape[0]
    text, text_mask, glyph, glyph_mask = unpack_text(
        packed, packed.shape[1] - GLYPH_LEN, config.text_embed_dim, config.text_embed_2_dim
    )
    condition = latents.new_zeros(batch, latents.shape[1] + 1, *latents.shape[2:])
    out = transformer(
        hidden_states=torch.cat([latents, condition], dim=1).to(dtype),
        timestep=(sigma.reshape(-1).expand(batch).float() * 1000.0).to(dtype),
        encoder_hidden_states=text.to(dtype),
        encoder_attention_mask=text_mask.to(dtype),
        encoder_hidden_states_2=glyph.to(dtype),
        encoder_attention_mask_2=glyph_mask.to(dtype),
        image_embeds=latents.new_zeros(batch, 1, config.image_embed_dim, dtype=dtype),
        return_dict=False,
    )[0]
    return out.float()


@dataclass
class HunyuanBundle:
    """A HunyuanVideo-1.5 text-to-video model as a ``VideoDiTBundle`` (module docstring)."""

    transformer: nn.Module
    sparsity_state: SparsityState
    latent_channels: int
    text_encoder: nn.Module
    tokenizer: Any
    glyph_encoder: nn.Module
    glyph_tokenizer: Any
    vae: nn.Module
    text_cache_dir: str | None = None
    cache_key: str = ""  # identifies the text encoders in cache file names
    _memory_cache: dict = field(default_factory=dict, repr=False)

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return _unwrapped(self.transformer).x_embedder.proj.weight.dtype

    def latent_shape(self, num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        t_scale = self.vae.temporal_compression_ratio
        s_scale = (
            self.vae.spatial_compression_ratio * _unwrapped(self.transformer).config.patch_size
        )
        if (num_frames - 1) % t_scale != 0:
            raise ValueError(
                f"num_frames must be {t_scale}*k + 1 for the HunyuanVideo-1.5 VAE (e.g. 121), "
                f"got {num_frames}"
            )
        if height % s_scale or width % s_scale:
            raise ValueError(
                f"height and width must be multiples of {s_scale}, got {height}x{width}"
            )
        spatial = self.vae.spatial_compression_ratio
        frames = (num_frames - 1) // t_scale + 1
        return self.latent_channels, frames, height // spatial, width // spatial

    def _cache_path(self, prompt: str) -> str | None:
        if not self.text_cache_dir:
            return None
        digest = hashlib.sha256(f"{self.cache_key}\n{prompt}".encode()).hexdigest()[:32]
        return os.path.join(self.text_cache_dir, f"{digest}.pt")

    def _encode_text(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLLM embeddings [B, 1000, D] and their mask (module docstring)."""
        device = next(self.text_encoder.parameters()).device
        chats = [
            [{"role": "system", "content": system_message()}, {"role": "user", "content": p or " "}]
            for p in prompts
        ]
        tokens = self.tokenizer.apply_chat_template(
            chats, add_generation_prompt=True, tokenize=True, return_dict=True,
            padding="max_length", max_length=MLLM_LEN + TEMPLATE_LEN, truncation=True,
            return_tensors="pt",
        )  # fmt: skip
        mask = tokens["attention_mask"].to(device)
        with torch.no_grad():
            hidden = self.text_encoder(
                input_ids=tokens["input_ids"].to(device), attention_mask=mask,
                output_hidden_states=True,
            ).hidden_states[-1 - SKIPPED_LAYERS]  # fmt: skip
        return hidden[:, TEMPLATE_LEN:], mask[:, TEMPLATE_LEN:]

    def _encode_glyphs(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The ByT5 embedding [1, 256, D_2] of the prompt's glyph text and its mask."""
        param = next(self.glyph_encoder.parameters())
        text = glyph_text(prompt)
        if text is None:
            zeros = param.new_zeros(1, GLYPH_LEN, self.glyph_encoder.config.d_model)
            return zeros, torch.zeros(1, GLYPH_LEN, dtype=torch.long, device=param.device)
        tokens = self.glyph_tokenizer(
            text, padding="max_length", max_length=GLYPH_LEN, truncation=True,
            add_special_tokens=True, return_tensors="pt",
        ).to(param.device)  # fmt: skip
        with torch.no_grad():
            hidden = self.glyph_encoder(
                input_ids=tokens.input_ids, attention_mask=tokens.attention_mask.float()
            )[0]
        return hidden, tokens.attention_mask

    def _encode_uncached(self, prompts: list[str]) -> list[torch.Tensor]:
        """Per prompt: its :func:`pack_text` tensor [1256, W] on the CPU."""
        text, text_mask = self._encode_text(prompts)
        glyphs = [self._encode_glyphs(prompt) for prompt in prompts]
        glyph = torch.cat([g for g, _ in glyphs]).to(text.device)
        glyph_mask = torch.cat([m for _, m in glyphs]).to(text.device)
        return list(pack_text(text, text_mask, glyph, glyph_mask).cpu())

    def encode_prompts(self, prompts: list[str]) -> torch.Tensor:
        """[B, 1256, W] packed text conditioning (:func:`pack_text`), cached per prompt in memory
        and, with ``text_cache_dir``, on disk."""
        packed = {p: self._memory_cache.get(p) for p in dict.fromkeys(prompts)}
        for prompt in packed:
            path = self._cache_path(prompt)
            if packed[prompt] is None and path is not None:
                packed[prompt] = _read_cached(path)
        missing = [p for p, value in packed.items() if value is None]
        if missing:
            for prompt, value in zip(missing, self._encode_uncached(missing), strict=True):
                packed[prompt] = value
                self._write_cache(prompt, value)
        self._memory_cache.update(packed)
        out = torch.stack([packed[p] for p in prompts])
        return out.to(device=self.device, dtype=self.dtype)

    def _write_cache(self, prompt: str, value: torch.Tensor) -> None:
        """Writes a prompt's packed tensor to its cache file (atomically), without a cache dir
        nothing."""
        path = self._cache_path(prompt)
        if path is None:
            return
        os.makedirs(self.text_cache_dir, exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        torch.save(value, tmp)
        os.replace(tmp, path)  # concurrent ranks never read half a file

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, condition: torch.Tensor):
        return hunyuan_velocity(self.transformer, latents, sigma, condition)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """VAE decode (float32) of latents / ``scaling_factor``, [-1, 1] -> [0, 1]:
        [B, T, C, H, W] float32."""
        param = next(self.vae.decoder.parameters())
        latents = latents.to(device=param.device, dtype=param.dtype)
        with torch.no_grad():
            video = self.vae.decode(latents / self.vae.config.scaling_factor, return_dict=False)[0]
        video = (video.float() * 0.5 + 0.5).clamp(0.0, 1.0)  # (B, C, T, H, W)
        return video.permute(0, 2, 1, 3, 4).contiguous()


def missing_component(path: str, component: str, message: str) -> ConfigError:
    """The error of a HunyuanVideo-1.5 folder at ``path`` that lacks ``component``."""
    folders = ", ".join(f"{c}/" for c in HUNYUAN_COMPONENTS)
    return ConfigError(
        f"model.path={path!r}: {message} Put a local diffusers HunyuanVideo-1.5 text-to-video "
        f"folder there (e.g. /data/HunyuanVideo-1.5-480p_t2v with {folders}); missing: "
        f"{component}"
    )


def check_folder(path: str) -> None:
    """The folder has every component subfolder, is not an image-to-video model, and its
    transformer's channels fit its VAE (ConfigError naming the file or folder)."""
    if not path or not os.path.isdir(path):
        raise missing_component(
            str(path), "the folder itself", "does not exist or is not a directory."
        )
    for component in HUNYUAN_COMPONENTS:
        if not os.path.isdir(os.path.join(path, component)):
            raise missing_component(path, f"{component}/", f"has no {component}/ subfolder.")
    index_file = os.path.join(path, "model_index.json")
    if os.path.isfile(index_file) and "ImageToVideo" in str(
        read_json_object(index_file).get("_class_name")
    ):
        raise ConfigError(
            f"model.path: {index_file} is an image-to-video pipeline; model.kind=hunyuan_video15 "
            "loads text-to-video folders only (image-to-video is not supported yet)"
        )
    transformer_file = os.path.join(path, "transformer", "config.json")
    transformer = read_json_object(transformer_file)
    vae_file = os.path.join(path, "vae", "config.json")
    latent = read_json_object(vae_file).get("latent_channels", 32)
    channels = (transformer.get("out_channels", 32), transformer.get("in_channels", 65))
    if channels != (latent, 2 * latent + 1):
        raise ConfigError(
            f"model.path: {transformer_file}: out_channels and in_channels are {channels[0]} and "
            f"{channels[1]}, but text-to-video with the VAE's latent_channels ({latent}, "
            f"{vae_file}) takes {latent} and {2 * latent + 1}; restore the model's files"
        )


def check_text_widths(path: str, transformer: nn.Module, text_encoder, glyph_encoder) -> None:
    """The transformer's text_embed_dim and text_embed_2_dim are its encoders' widths."""
    config = transformer.config
    pairs = (
        ("text_embed_dim", text_encoder.config.hidden_size, "text_encoder"),
        ("text_embed_2_dim", glyph_encoder.config.d_model, "text_encoder_2"),
    )
    for key, width, folder in pairs:
        if getattr(config, key) != width:
            raise ConfigError(
                f"model.path: {os.path.join(path, 'transformer', 'config.json')}: {key} is "
                f"{getattr(config, key)} but {folder}/ embeds in {width}; the folder mixes "
                "models, restore it from the model's download"
            )


def load_hunyuan_video15_bundle(
    path: str,
    vsa2: VSA2Config,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str = "auto",
    *,
    text_cache_dir: str | None = None,
    sparsity_state: SparsityState | None = None,
) -> HunyuanBundle:
    """Load a local diffusers HunyuanVideo-1.5 text-to-video folder as a :class:`HunyuanBundle`
    with VSA2 in the transformer's joint attention.

    Args:
        path: the folder (config key ``model.path``); never downloads.
        vsa2: attention settings; ``vsa2.enabled = False`` keeps dense attention.
        device, dtype: where and in which dtype the transformer and the text encoders run
            ("auto": bf16 on CUDA, fp32 on CPU); the VAE runs in float32, in tiles, one video
            at a time (:func:`vsa2_rl.models.wan_bundle.prepare_vae`).
        text_cache_dir: folder for per-prompt embedding files; None = in-memory cache only.
        sparsity_state: shared state to use (a new one at sparsity 0 if None).
    """
    from diffusers import AutoencoderKLHunyuanVideo15, HunyuanVideo15Transformer3DModel
    from transformers import AutoTokenizer, Qwen2_5_VLTextModel, T5EncoderModel

    check_folder(path)
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    state = sparsity_state if sparsity_state is not None else SparsityState()
    transformer = HunyuanVideo15Transformer3DModel.from_pretrained(
        path, subfolder="transformer", torch_dtype=dtype
    )
    transformer = enable_vsa2(transformer.to(device), vsa2, state)
    text_encoder = Qwen2_5_VLTextModel.from_pretrained(
        path, subfolder="text_encoder", torch_dtype=dtype
    )
    glyph_encoder = T5EncoderModel.from_pretrained(
        path, subfolder="text_encoder_2", torch_dtype=dtype
    )
    check_text_widths(path, transformer, text_encoder, glyph_encoder)
    vae = AutoencoderKLHunyuanVideo15.from_pretrained(
        path, subfolder="vae", torch_dtype=torch.float32
    )
    return HunyuanBundle(
        transformer=transformer,
        sparsity_state=state,
        latent_channels=int(transformer.config.out_channels),
        text_encoder=text_encoder.to(device).eval().requires_grad_(False),
        tokenizer=AutoTokenizer.from_pretrained(path, subfolder="tokenizer"),
        glyph_encoder=glyph_encoder.to(device).eval().requires_grad_(False),
        glyph_tokenizer=AutoTokenizer.from_pretrained(path, subfolder="tokenizer_2"),
        vae=prepare_vae(vae, device),
        text_cache_dir=text_cache_dir,
        cache_key=f"hunyuan_video15\n{os.path.abspath(path)}",
    )


__all__ = [
    "HUNYUAN_COMPONENTS",
    "HunyuanBundle",
    "glyph_text",
    "hunyuan_velocity",
    "load_hunyuan_video15_bundle",
    "pack_text",
    "unpack_text",
]
