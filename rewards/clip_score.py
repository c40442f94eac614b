"""Text-video alignment and preference scores on open_clip models, from local checkpoints
(:mod:`vsa2_rl.rewards.clip`; nothing is downloaded). Each is the mean over ``num_frames``
evenly spaced frames of the cosine similarity between the frame's image embedding and the
prompt's text embedding, higher is better:

- ``clip_score``: the plain cosine (CLIPScore's, without its 2.5 scale and clipping at 0), in
  [-1, 1], with any CLIP (default ViT-L-14).
- ``pickscore``: the cosine times the model's learned ``logit_scale`` (exp'd, about 100), as
  PickScore (Kirstain et al., 2023) scores image-prompt pairs; for a ViT-H-14 checkpoint
  fine-tuned on Pick-a-Pic.
- ``hpsv2``: the cosine, as HPSv2 (Wu et al., 2023) reports it (typical values 0.2-0.3); for
  its ViT-H-14 checkpoint (``HPS_v2_compressed.pt``).
"""

from __future__ import annotations

import torch

from .clip import ClipEmbedder
from .registry import RewardFn, register_reward


class ClipScorer:
    def __init__(
        self,
        clip_path: str | None,
        clip_model: str,
        num_frames: int,
        batch_size: int,
        logit_scaled: bool = False,
    ):
        self.clip = ClipEmbedder(
            clip_path, clip_model, num_frames=num_frames, batch_size=batch_size, text=True
        )
        self.scale = float(self.clip.model.logit_scale.exp()) if logit_scaled else 1.0

    @torch.no_grad()
    def __call__(
        self, videos: torch.Tensor, prompts: list[str], metadata: list[dict]
    ) -> torch.Tensor:
        frames = self.clip.frames(videos)  # [B, F, E]
        text = self.clip.texts(prompts, videos.device)  # [B, E]
        return (self.scale * torch.einsum("bfe,be->bf", frames, text).mean(dim=1)).float()


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


@register_reward("pickscore")
def pickscore(
    *,
    clip_path: str | None = None,
    clip_model: str = "ViT-H-14",
    num_frames: int = 4,
    batch_size: int = 16,
) -> RewardFn:
    """PickScore-style preference: logit_scale x prompt-frame cosine, averaged over frames."""
    return ClipScorer(clip_path, clip_model, num_frames, batch_size, logit_scaled=True)


@register_reward("hpsv2")
def hpsv2(
    *,
    clip_path: str | None = None,
    clip_model: str = "ViT-H-14",
    num_frames: int = 4,
    batch_size: int = 16,
) -> RewardFn:
    """HPSv2-style preference: prompt-frame cosine of its fine-tuned CLIP, averaged over frames."""
    return ClipScorer(clip_path, clip_model, num_frames, batch_size)
