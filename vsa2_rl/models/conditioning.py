"""Image conditioning of the Wan image-to-video models, as diffusers' ``WanImageToVideoPipeline``
(0.42) prepares it, and the condition object that travels with a batch of samples.

Two schemes, read from the model's folder by ``vsa2_rl.models.wan``:

- ``channels`` (Wan2.1 I2V, Wan2.2 A14B I2V): the VAE encodes the image followed by
  ``num_frames - 1`` black frames; the transformer takes, besides the noisy latents, 4 mask
  channels (1 on the image's frame) and that latent, concatenated on the channel axis. Wan2.1
  I2V also takes a CLIP image embedding (penultimate hidden states of a local
  ``CLIPVisionModel``), Wan2.2 does not.
- ``first_frame`` (Wan2.2 TI2V-5B): the VAE encodes the image alone; its latent replaces the
  first latent frame of the model's input, whose tokens get timestep 0 (per-token timesteps,
  ``expand_timesteps``). The model's velocity there is set to 0, so the sampler leaves that frame
  as it started (its log-prob terms are the same under every policy and cancel in ratios and in
  the KL), and :meth:`WanCondition.final_latents` puts the image's latent back before decoding.

The image is loaded at the video's size and mapped to [-1, 1] (the pipeline's video processor),
the VAE latent taken at its mode and normalised with ``latents_mean`` / ``latents_std``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from vsa2_rl.data.prompts import condition_rgb, load_condition_image

IMAGE_SCHEMES = ("channels", "first_frame")


@dataclass
class WanCondition:
    """What a Wan transformer is conditioned on for a batch: text, and for image-to-video the
    image's latents (``channels``: mask + latent [B, 4 + C, T, H, W]; ``first_frame``: the
    first frame's latent [B, C, 1, H, W]) and, for Wan2.1 I2V, CLIP embeddings [B, 257, D]."""

    text: torch.Tensor
    scheme: str
    image_latents: torch.Tensor
    image_embeds: torch.Tensor | None = None

    def classifier_free_pair(self, uncond_text: torch.Tensor) -> WanCondition:
        """The batch of 2B for classifier-free guidance: the prompts, then the negative prompt,
        both with the same image (the pipeline's unconditional pass keeps the image)."""

        def twice(x):
            return None if x is None else torch.cat([x, x])

        text = torch.cat([self.text, uncond_text.expand_as(self.text)])
        return replace(
            self, text=text, image_latents=twice(self.image_latents),
            image_embeds=twice(self.image_embeds),
        )  # fmt: skip

    def final_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """``first_frame``: the sampled latents with the image's latent as their first frame
        (what the pipeline decodes); ``channels``: unchanged."""
        if self.scheme != "first_frame":
            return latents
        image = self.image_latents.to(device=latents.device, dtype=latents.dtype)
        return torch.cat([image, latents[:, :, 1:]], dim=2)

    def generated_mask(self, latents: torch.Tensor) -> torch.Tensor:
        """``first_frame``: 1 on the latent frames the model generates, 0 on the image's."""
        mask = torch.ones_like(latents[:1, :1])
        mask[:, :, 0] = 0
        return mask


def encode_condition(
    bundle, prompts: list[str], images: list[str | None], video_size: tuple[int, int, int]
):
    """What ``bundle``'s model is conditioned on for ``prompts`` and their condition images
    (paths or None; ``video_size`` = (frames, height, width)): a Wan bundle's
    ``encode_condition``, or the text embeddings of a text-only bundle (the toy)."""
    if hasattr(bundle, "encode_condition"):
        return bundle.encode_condition(prompts, images, video_size)
    return bundle.encode_prompts(prompts)


def final_latents(condition, latents: torch.Tensor) -> torch.Tensor:
    """The latents to decode: a first-frame condition's image put back (see
    :meth:`WanCondition.final_latents`), any other condition's latents unchanged."""
    return condition.final_latents(latents) if isinstance(condition, WanCondition) else latents


def condition_images(
    vae: torch.nn.Module, paths: list[str], num_frames: int, height: int, width: int, scheme: str
) -> torch.Tensor:
    """The image latents of ``scheme`` for each path (float32, on the VAE's device); see the
    module docstring."""
    if scheme not in IMAGE_SCHEMES:
        raise ValueError(f"scheme must be one of {IMAGE_SCHEMES}, got {scheme!r}")
    param = next(vae.parameters())
    config = vae.config
    shape = (1, -1, 1, 1, 1)
    mean = torch.tensor(config.latents_mean, device=param.device).view(shape)
    std = torch.tensor(config.latents_std, device=param.device).view(shape)
    out = []
    for path in paths:
        image = load_condition_image(path, height, width).to(param.device) * 2.0 - 1.0
        frames = image[None, :, None]  # [1, 3, 1, H, W]
        if scheme == "channels":
            black = frames.new_zeros(1, 3, num_frames - 1, height, width)
            frames = torch.cat([frames, black], dim=2)
        with torch.no_grad():
            latent = vae.encode(frames.to(param.dtype)).latent_dist.mode().float()
        latent = (latent - mean) / std
        if scheme == "channels":
            latent = torch.cat([_first_frame_mask(latent, num_frames, vae), latent], dim=1)
        out.append(latent)
    return torch.cat(out)


def _first_frame_mask(latent: torch.Tensor, num_frames: int, vae) -> torch.Tensor:
    """The pipeline's 4 mask channels: the pixel frames' mask (1 on the first frame) with the
    first frame repeated ``scale_factor_temporal`` times, folded into [1, scale, T, H, W]."""
    scale = vae_scale_factors(vae.config)[0]
    _, _, frames, height, width = latent.shape
    mask = latent.new_zeros(num_frames + scale - 1, height, width)
    mask[:scale] = 1.0
    return mask.view(frames, scale, height, width).transpose(0, 1)[None]


def vae_scale_factors(vae_config) -> tuple[int, int]:
    """(temporal, spatial) compression of a Wan VAE config: its ``scale_factor_*`` entries
    (Wan2.2's 16x spatial VAE has them), else the 2 ** downsamples of Wan2.1's."""
    temporal = getattr(vae_config, "scale_factor_temporal", None)
    spatial = getattr(vae_config, "scale_factor_spatial", None)
    if temporal and spatial:
        return int(temporal), int(spatial)
    downsample = list(vae_config.temperal_downsample)
    return 2 ** sum(downsample), 2 ** len(downsample)


def clip_image_embeds(image_encoder, image_processor, paths: list[str]) -> torch.Tensor:
    """Wan2.1 I2V's image embeddings: penultimate hidden states of the CLIP vision model on
    each image (the processor resizes and normalises), float32 [B, tokens, D]."""
    param = next(image_encoder.parameters())
    images = [condition_rgb(path) for path in paths]  # 16-bit ones scaled, not clipped
    inputs = image_processor(images=images, return_tensors="pt").to(param.device)
    with torch.no_grad():
        hidden = image_encoder(
            pixel_values=inputs.pixel_values.to(param.dtype), output_hidden_states=True
        ).hidden_states
    return hidden[-2].float()


__all__ = [
    "IMAGE_SCHEMES",
    "WanCondition",
    "clip_image_embeds",
    "condition_images",
    "encode_condition",
    "final_latents",
    "vae_scale_factors",
]
