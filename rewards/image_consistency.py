"""Image-to-video faithfulness: how well the first frames of a video keep its condition image.

The score of a video is the mean, over its first ``num_frames`` frames (clipped to the video's
length), of the SSIM (Wang et al., IEEE TIP 2004) between the frame and the condition image,
both as luma: Gaussian window of 11 pixels with sigma 1.5, ``C1 = 0.01**2``, ``C2 = 0.03**2``
(data range 1), averaged over the window positions that lie inside the frame. 1 means the
frames repeat the image; it falls as they drift from it. The condition image's path comes in
``metadata[i]["image"]`` (the trainer and evaluation pass it for image-to-video prompts); it is
loaded with :func:`vsa2_rl.data.prompts.load_condition_image` at the video's size and kept for
later batches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vsa2_rl.data.prompts import load_condition_image

from .flow import to_gray
from .registry import RewardFn, register_reward

WINDOW_SIZE = 11
WINDOW_SIGMA = 1.5
C1 = 0.01**2
C2 = 0.03**2


def _gaussian_window(like: torch.Tensor) -> torch.Tensor:
    """The normalised 1-D Gaussian window of ``WINDOW_SIZE`` taps, on ``like``'s device/dtype."""
    offsets = torch.arange(WINDOW_SIZE, dtype=like.dtype, device=like.device)
    taps = torch.exp(-((offsets - WINDOW_SIZE // 2) ** 2) / (2 * WINDOW_SIGMA**2))
    return taps / taps.sum()


def _local_mean(images: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """Gaussian-weighted means of [N, 1, H, W] over every window inside the image (separable)."""
    rows = F.conv2d(images, window.view(1, 1, 1, -1))
    return F.conv2d(rows, window.view(1, 1, -1, 1))


def ssim(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Mean SSIM of image pairs [N, 1, H, W] (single channel, values in [0, 1]): float32 [N]."""
    height, width = first.shape[-2:]
    if min(height, width) < WINDOW_SIZE:
        raise ValueError(
            f"videos: SSIM needs frames of at least {WINDOW_SIZE}x{WINDOW_SIZE} pixels, got "
            f"{height}x{width}"
        )
    # float64: the variances are differences of nearly equal local moments
    first, second = first.double(), second.double()
    window = _gaussian_window(first)
    mean_first, mean_second = _local_mean(first, window), _local_mean(second, window)
    var_first = _local_mean(first * first, window) - mean_first**2
    var_second = _local_mean(second * second, window) - mean_second**2
    covariance = _local_mean(first * second, window) - mean_first * mean_second
    luminance = (2 * mean_first * mean_second + C1) / (mean_first**2 + mean_second**2 + C1)
    structure = (2 * covariance + C2) / (var_first + var_second + C2)
    return (luminance * structure).flatten(1).mean(dim=1).float()


class ImageConsistency:
    """The reward function: SSIM of each video's first frames to its condition image."""

    def __init__(self, num_frames: int) -> None:
        if num_frames < 1:
            raise ValueError(f"kwargs.num_frames: must be >= 1, got {num_frames}")
        self.num_frames = num_frames
        self._images: dict[tuple[str, int, int], torch.Tensor] = {}

    def condition_image(self, path: str, height: int, width: int) -> torch.Tensor:
        """The condition image at ``path`` resized to (height, width), loaded once."""
        key = (path, height, width)
        if key not in self._images:
            self._images[key] = load_condition_image(path, height, width)
        return self._images[key]

    @torch.no_grad()
    def __call__(
        self, videos: torch.Tensor, prompts: list[str], metadata: list[dict]
    ) -> torch.Tensor:
        height, width = videos.shape[-2:]
        images = torch.stack(
            [self.condition_image(path, height, width) for path in _image_paths(metadata)]
        ).to(videos.device)
        frames = videos[:, : self.num_frames].float()
        batch, count = frames.shape[:2]
        frame_luma = to_gray(frames.flatten(0, 1))
        image_luma = to_gray(images).repeat_interleave(count, dim=0)
        return ssim(frame_luma, image_luma).view(batch, count).mean(dim=1)


def _image_paths(metadata: list[dict]) -> list[str]:
    paths = [entry.get("image") for entry in metadata]
    for index, path in enumerate(paths):
        if path is None:
            raise ValueError(
                f"image_consistency: metadata['image'] is missing for sample {index}: use an "
                'image-to-video prompt file (.jsonl with an "image" per prompt)'
            )
    return paths


@register_reward("image_consistency")
def image_consistency(*, num_frames: int = 4) -> RewardFn:
    """SSIM of the first ``num_frames`` frames to the condition image, averaged; <= 1."""
    return ImageConsistency(num_frames)
