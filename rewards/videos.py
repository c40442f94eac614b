"""The input half of the reward contract: :func:`check_videos` validates what a reward is given
(a float tensor [B, T, C, H, W] in [0, 1] of B >= 1 videos of at least 2 frames, one prompt and
one metadata dict per video) and raises a ``ValueError`` naming the problem and its fix.

The registry's :class:`~vsa2_rl.rewards.registry.Reward`, the mixer and the remote client and
server check their input with it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def check_videos(
    videos: Any, prompts: Sequence[str] | None = None, metadata: Sequence[dict] | None = None
) -> int:
    """Validate reward input; returns the batch size B. Raises ValueError naming the problem."""
    if not isinstance(videos, torch.Tensor):
        raise ValueError(f"videos: expected a torch.Tensor [B, T, C, H, W], got {type(videos)}")
    if videos.dim() != 5:
        raise ValueError(
            f"videos: expected rank 5 [B, T, C, H, W], got shape {tuple(videos.shape)}; "
            f"add a batch dimension with videos[None] for a single video"
        )
    if not videos.dtype.is_floating_point:
        raise ValueError(
            f"videos: expected a float tensor in [0, 1], got dtype {videos.dtype}; "
            f"convert uint8 frames with videos.float() / 255"
        )
    batch, frames = videos.shape[:2]
    if batch < 1 or frames < 2:
        raise ValueError(
            f"videos: need B >= 1 videos of at least 2 frames, got shape {tuple(videos.shape)}"
        )
    if not bool(((videos >= 0) & (videos <= 1)).all()):
        finite = videos[torch.isfinite(videos)]
        span = (
            f"[{finite.min().item():.4g}, {finite.max().item():.4g}]" if finite.numel() else "n/a"
        )
        has_nan = bool(torch.isnan(videos).any())
        raise ValueError(
            f"videos: values must lie in [0, 1], got finite range {span}"
            f"{' and NaN values' if has_nan else ''}; map decoder output from [-1, 1] with "
            f"(x + 1) / 2 and clamp to [0, 1]"
        )
    if prompts is not None and len(prompts) != batch:
        raise ValueError(f"prompts: expected {batch} prompts (one per video), got {len(prompts)}")
    if metadata is not None and len(metadata) != batch:
        raise ValueError(f"metadata: expected {batch} dicts (one per video), got {len(metadata)}")
    return batch
