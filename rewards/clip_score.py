"""CLIP text-video alignment (``clip_score``): the mean over ``num_frames`` evenly spaced frames
of the cosine similarity between a frame's open_clip image embedding and the prompt's text
embedding (CLIPScore's cosine, without its 2.5 scale and clipping at 0), in [-1, 1], higher is
better. The model loads from the local ``clip_path`` checkpoint of the ``clip_model``
architecture (:mod:`vsa2_rl.rewards.clip`); nothing is downloaded."""

from __future__ import annotations

import torch

from .clip import ClipEmbedder
from .registry import RewardFn, register_reward


class ClipScorer:
    def __init__(self, clip_path: str | None, clip_model: str, num_frames: int, batch_size: int):
        self.clip = ClipEmbedder(
            clip_path, clip_model, num_frames=num_frames, batch_size=batch_size, text=True
        )

    @torch.no_grad()
    def __call__(
        self, videos: torch.Tensor, prompts: list[str], metadata: list[dict]
    ) -> torch.Tensor:
        frames = self.clip.frames(videos)  # [B, F, E]
        text = self.clip.texts(prompts, videos.device)  # [B, E]
        return torch.einsum("bfe,be->bf", frames, text).mean(dim=1).float()


@register_reward("clip_score")
def clip_score(
    *,
    clip_path: str | None = None,
    clip_model: str = "ViT-L-14",
    num_frames: int = 4,
    batch_size: int = 32,
) -> RewardFn:
    """Prompt-video cosine similarity of open_clip embeddings, averaged over frames."""
    return ClipScorer(clip_path, clip_model, num_frames, batch_size)
