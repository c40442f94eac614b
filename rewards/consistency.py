"""VBench-style temporal consistency (Huang et al., 2024, "VBench"), as rewards and eval metrics:

- ``subject_consistency``: DINO features (a local transformers ViT / DINOv2 folder,
  ``dino_path``; the CLS token of the last layer), VBench's subject-consistency measure;
- ``background_consistency``: open_clip image features (``clip_path``, ``clip_model``, as the
  other CLIP rewards), VBench's background-consistency measure.

Per video, up to ``num_frames`` evenly spaced frames f_0 .. f_{K-1} are embedded and
L2-normalised; the score is the mean over k >= 1 of (cos(f_k, f_0) + cos(f_k, f_{k-1})) / 2,
VBench's formula: 1 for a static video, lower as the content drifts or flickers. Nothing is
downloaded; a video needs at least 2 frames.
"""

from __future__ import annotations

import os
import threading

import torch
import torch.nn.functional as F

from .clip import KEY, ClipEmbedder
from .image_quality import sample_frames
from .registry import RewardFn, register_reward

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def frame_consistency(embeddings: torch.Tensor) -> torch.Tensor:
    """[B, K, E] unit embeddings (K >= 2) -> [B]: mean_k (cos(f_k, f_0) + cos(f_k, f_{k-1})) / 2."""
    if embeddings.shape[1] < 2:
        raise ValueError(f"videos: consistency needs >= 2 frames, got {embeddings.shape[1]}")
    later = embeddings[:, 1:]
    to_first = (later * embeddings[:, :1]).sum(-1)
    to_previous = (later * embeddings[:, :-1]).sum(-1)
    return ((to_first + to_previous) / 2).mean(dim=1)


class DinoEmbedder:
    """A transformers ViT / DINOv2 backbone from a local folder; CLS features of frames."""

    def __init__(self, dino_path: str | None, num_frames: int, batch_size: int) -> None:
        from transformers import AutoModel

        if dino_path is None:
            raise ValueError(f"{KEY}.dino_path: required: a local DINO model folder")
        if not os.path.isdir(os.path.expanduser(dino_path)):
            raise ValueError(f"{KEY}.dino_path: folder not found: {dino_path}")
        if num_frames < 2:
            raise ValueError(f"{KEY}.num_frames: must be >= 2, got {num_frames}")
        self.model = AutoModel.from_pretrained(os.path.expanduser(dino_path), local_files_only=True)
        self.model.eval().requires_grad_(False)
        size = self.model.config.image_size
        self.image_size = tuple(size) if isinstance(size, (tuple, list)) else (size, size)
        self.mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
        self.std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
        self.num_frames, self.batch_size = num_frames, batch_size
        self._lock = threading.Lock()

    @torch.no_grad()
    def frames(self, videos: torch.Tensor) -> torch.Tensor:
        with self._lock:
            if self.mean.device != videos.device:
                self.model.to(videos.device)
                self.mean, self.std = self.mean.to(videos.device), self.std.to(videos.device)
        frames = sample_frames(videos, self.num_frames).float()
        batch, count = frames.shape[:2]
        flat = frames.flatten(0, 1)
        if flat.shape[1] == 1:
            flat = flat.expand(-1, 3, -1, -1)
        out = []
        for start in range(0, flat.shape[0], self.batch_size):
            pixels = F.interpolate(flat[start : start + self.batch_size], size=self.image_size,
                                   mode="bicubic", antialias=True).clamp(0, 1)  # fmt: skip
            hidden = self.model(pixel_values=(pixels - self.mean) / self.std).last_hidden_state
            out.append(F.normalize(hidden[:, 0].float(), dim=-1))
        return torch.cat(out).view(batch, count, -1)


class ConsistencyScorer:
    def __init__(self, embedder) -> None:
        self.embedder = embedder

    def __call__(
        self, videos: torch.Tensor, prompts: list[str], metadata: list[dict]
    ) -> torch.Tensor:
        return frame_consistency(self.embedder.frames(videos)).float()


@register_reward("subject_consistency")
def subject_consistency(
    *, dino_path: str | None = None, num_frames: int = 16, batch_size: int = 32
) -> RewardFn:
    """VBench subject consistency: DINO CLS features of frames against the first and previous."""
    return ConsistencyScorer(DinoEmbedder(dino_path, num_frames, batch_size))


@register_reward("background_consistency")
def background_consistency(
    *,
    clip_path: str | None = None,
    clip_model: str = "ViT-B-32",
    num_frames: int = 16,
    batch_size: int = 32,
) -> RewardFn:
    """VBench background consistency: CLIP image features against the first and previous."""
    if num_frames < 2:
        raise ValueError(f"{KEY}.num_frames: must be >= 2, got {num_frames}")
    embedder = ClipEmbedder(clip_path, clip_model, num_frames=num_frames, batch_size=batch_size)
    return ConsistencyScorer(embedder)
