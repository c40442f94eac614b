"""Weight-free per-frame image quality: sharpness, colourfulness and exposure, gated by noise.

For machines without reward-model weights. Each term is mapped to [0, 1] (higher = better); the
frame's score is their weighted mean times a noise gate, averaged over up to ``num_frames``
evenly spaced frames:

- sharpness: variance of the 3x3 Laplacian of the luma (Pech-Pacheco et al., ICPR 2000), mapped
  by ``v / (v + v0)`` with ``v0 = 100 / 255**2``, the customary "blurry below 100" threshold on
  8-bit images, so a frame at that threshold scores 0.5.
- colourfulness: Hasler & Suesstrunk (SPIE 2003),
  ``M = sqrt(std(rg)**2 + std(yb)**2) + 0.3 * sqrt(mean(rg)**2 + mean(yb)**2)`` with
  ``rg = R - G`` and ``yb = (R + G) / 2 - B`` on the 0..255 scale, divided by 109 (their
  "extremely colourful" level) and clipped to 1. Grey frames score 0.
- exposure: ``(1 - |2 * mean_luma - 1|) * (1 - clipped)``, where ``clipped`` is the fraction of
  pixels with luma below 2% or above 98%: 1 for a mid-grey mean with no crushed or blown pixels,
  0 for an all-black or all-white frame.
- noise gate: ``exp(-sigma / noise_scale)`` with ``sigma`` the frame's noise level estimated
  from Immerkaer's mask (CVIU 1996: the 3x3 difference of two Laplacians, blind to edges and
  linear ramps), taking the median absolute response (robust to the edges it does see) over
  ``0.6745 * 6`` (the response's median for unit Gaussian noise). ``noise_scale`` 0.01 (2.5 of
  255): a frame with noise of sigma 0.1 keeps e^-10 of its score.

Without the gate all three terms rise with added noise (noise is high-frequency, colourful and
lifts crushed blacks), so a policy could raise them by un-denoising its samples; with it, a clean
frame scores above the same frame with noise and above a blurred copy (tests). Its limit: fine
texture at the scale of single pixels reads partly as noise, so on such frames a slight blur can
score higher.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .flow import to_gray
from .registry import RewardFn, register_reward

SHARPNESS_REFERENCE = 100.0 / 255.0**2
COLORFULNESS_REFERENCE = 109.0
_CLIP_LOW, _CLIP_HIGH = 0.02, 0.98
NOISE_SCALE = 0.01
# Median of |Immerkaer response| for unit Gaussian noise: 0.6745 (normal MAD) times the mask's
# norm, sqrt(1 + 4 + 1 + 4 + 16 + 4 + 1 + 4 + 1) = 6.
_IMMERKAER_MEDIAN = 0.6745 * 6.0


def sample_frames(videos: torch.Tensor, num_frames: int) -> torch.Tensor:
    """Up to ``num_frames`` evenly spaced frames (first and last included): [B, K, C, H, W]."""
    total = videos.shape[1]
    if num_frames >= total:
        return videos
    index = torch.linspace(0, total - 1, num_frames).round().long().to(videos.device)
    return videos.index_select(1, index)


def sharpness(frames: torch.Tensor) -> torch.Tensor:
    """Laplacian-variance sharpness of frames [N, C, H, W] mapped to [0, 1): [N]."""
    kernel = frames.new_tensor([[0.0, 1.0, 0.0], [1.0, -4.0, 1.0], [0.0, 1.0, 0.0]])
    laplacian = F.conv2d(to_gray(frames), kernel.view(1, 1, 3, 3))  # valid region only
    variance = laplacian.flatten(1).var(dim=1, unbiased=False)
    return variance / (variance + SHARPNESS_REFERENCE)


def colorfulness(frames: torch.Tensor) -> torch.Tensor:
    """Hasler-Suesstrunk colourfulness of frames [N, C, H, W] / 109, clipped to 1: [N]."""
    if frames.shape[1] == 1:
        return frames.new_zeros(frames.shape[0])
    red, green, blue = (frames * 255.0).unbind(dim=1)
    rg = (red - green).flatten(1)
    yb = (0.5 * (red + green) - blue).flatten(1)
    spread = torch.sqrt(rg.var(dim=1, unbiased=False) + yb.var(dim=1, unbiased=False))
    offset = torch.sqrt(rg.mean(dim=1) ** 2 + yb.mean(dim=1) ** 2)
    return ((spread + 0.3 * offset) / COLORFULNESS_REFERENCE).clamp(max=1.0)


def exposure(frames: torch.Tensor) -> torch.Tensor:
    """Exposure score of frames [N, C, H, W] in [0, 1]: [N]."""
    luma = to_gray(frames).flatten(1)
    centred = 1.0 - (2.0 * luma.mean(dim=1) - 1.0).abs()
    clipped = ((luma < _CLIP_LOW) | (luma > _CLIP_HIGH)).float().mean(dim=1)
    return centred * (1.0 - clipped)


def noise_level(frames: torch.Tensor) -> torch.Tensor:
    """Estimated Gaussian noise sigma of the luma of frames [N, C, H, W] (Immerkaer): [N]."""
    kernel = frames.new_tensor([[1.0, -2.0, 1.0], [-2.0, 4.0, -2.0], [1.0, -2.0, 1.0]])
    response = F.conv2d(to_gray(frames), kernel.view(1, 1, 3, 3))  # valid region only
    return response.flatten(1).abs().median(dim=1).values / _IMMERKAER_MEDIAN


@register_reward("image_quality")
def image_quality(
    *,
    num_frames: int = 8,
    sharpness_weight: float = 1.0,
    colorfulness_weight: float = 1.0,
    exposure_weight: float = 1.0,
    noise_scale: float = NOISE_SCALE,
) -> RewardFn:
    """Weighted mean of sharpness, colourfulness and exposure, times the noise gate, over
    sampled frames; [0, 1]."""
    if noise_scale <= 0:
        raise ValueError(f"kwargs.noise_scale: must be > 0, got {noise_scale}")
    if num_frames < 1:
        raise ValueError(f"kwargs.num_frames: must be >= 1, got {num_frames}")
    weights = (sharpness_weight, colorfulness_weight, exposure_weight)
    if min(weights) < 0 or sum(weights) <= 0:
        raise ValueError(
            f"rewards.image_quality: weights must be >= 0 with a positive sum, got "
            f"sharpness={sharpness_weight}, colorfulness={colorfulness_weight}, "
            f"exposure={exposure_weight}"
        )

    @torch.no_grad()
    def reward(videos: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        if videos.shape[2] not in (1, 3):
            raise ValueError(f"videos: expected 1 or 3 channels, got {videos.shape[2]}")
        frames = sample_frames(videos, num_frames).float()
        batch, count = frames.shape[:2]
        flat = frames.flatten(0, 1)  # (B*K, C, H, W)
        terms = torch.stack([sharpness(flat), colorfulness(flat), exposure(flat)], dim=1)
        mixed = terms @ flat.new_tensor(weights) / sum(weights)  # (B*K,)
        gated = mixed * torch.exp(-noise_level(flat) / noise_scale)
        return gated.view(batch, count).mean(dim=1)

    reward.__name__ = "image_quality"
    return reward
