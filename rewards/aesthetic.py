"""LAION aesthetic reward: the improved-aesthetic-predictor MLP on CLIP ViT-L/14 embeddings.

Follows christophschuhmann/improved-aesthetic-predictor (the LAION-Aesthetics v2 scorer, also
the aesthetic reward of DDPO and Flow-GRPO): frames are embedded by an open_clip image tower,
L2-normalised, and scored by an MLP ``768 -> 1024 -> 128 -> 64 -> 16 -> 1`` (dropout between the
first layers, no activations, as in the original). Its parameter names match the released
``sac+logos+ava1-l14-linearMSE.pth`` state dict, which therefore loads as is.

The reward of a video is the mean score of ``num_frames`` evenly spaced frames. Scores are on
the LAION 1..10 scale (most natural images 4..7); higher is better.

Everything loads from local files named in the config; nothing is downloaded:

- ``clip_path``: an open_clip checkpoint of the ``clip_model`` architecture (e.g. the OpenAI
  ViT-L/14 weights ``open_clip_pytorch_model.bin``).
- ``predictor_path``: the MLP state dict.
- ``clip_model``: an open_clip config name (default ``"ViT-L-14"``) or the path of an open_clip
  model-config JSON file (``{"embed_dim", "vision_cfg", "text_cfg"}``), which is registered with
  ``open_clip.add_model_config`` under the file's stem; tests use this for a tiny model.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from .clip import KEY, ClipEmbedder, required_file
from .registry import RewardFn, register_reward


class AestheticMLP(nn.Module):
    """The improved-aesthetic-predictor head; ``layers`` indices match the released weights."""

    def __init__(self, input_dim: int = 768) -> None:
        super().__init__()
        self.input_dim = input_dim
        self.layers = nn.Sequential(
            nn.Linear(input_dim, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        return self.layers(embeddings).squeeze(-1)


def load_aesthetic_mlp(path: str) -> AestheticMLP:
    """Load an ``AestheticMLP`` from a state-dict file; the input width comes from the file."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    if "layers.0.weight" not in state:
        raise ValueError(
            f"{KEY}.predictor_path: {path} is not an aesthetic-predictor state dict "
            f"(no 'layers.0.weight'; keys: {sorted(state)[:6]}...)"
        )
    mlp = AestheticMLP(state["layers.0.weight"].shape[1])
    mlp.load_state_dict(state)
    return mlp.eval().requires_grad_(False)


class AestheticScorer:
    """CLIP image tower (:class:`ClipEmbedder`) + aesthetic MLP."""

    def __init__(
        self,
        clip_path: str | None,
        predictor_path: str | None,
        clip_model: str = "ViT-L-14",
        *,
        num_frames: int = 4,
        batch_size: int = 32,
    ) -> None:
        required_file(clip_path, "clip_path", "an open_clip checkpoint")  # checked first
        mlp_file = required_file(predictor_path, "predictor_path", "the aesthetic MLP state dict")
        self.clip = ClipEmbedder(
            clip_path, clip_model, num_frames=num_frames, batch_size=batch_size
        )
        self.mlp = load_aesthetic_mlp(mlp_file)
        if self.clip.embed_dim is not None and self.clip.embed_dim != self.mlp.input_dim:
            raise ValueError(
                f"{KEY}: the predictor expects {self.mlp.input_dim}-d embeddings but "
                f"clip_model {clip_model!r} gives {self.clip.embed_dim}-d ones; use matching "
                "files"
            )
        self._lock = threading.Lock()

    @torch.no_grad()
    def __call__(
        self, videos: torch.Tensor, prompts: list[str], metadata: list[dict]
    ) -> torch.Tensor:
        embeddings = self.clip.frames(videos)  # [B, F, E], unit length
        with self._lock:
            self.mlp.to(embeddings.device)
        return self.mlp(embeddings).mean(dim=1).float()


@register_reward("aesthetic")
def aesthetic(
    *,
    clip_path: str | None = None,
    predictor_path: str | None = None,
    clip_model: str = "ViT-L-14",
    num_frames: int = 4,
    batch_size: int = 32,
) -> RewardFn:
    """LAION aesthetic score (1..10 scale) averaged over ``num_frames`` frames."""
    return AestheticScorer(
        clip_path,
        predictor_path,
        clip_model,
        num_frames=num_frames,
        batch_size=batch_size,
    )
