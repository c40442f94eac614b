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

import os
import threading

import torch
import torch.nn.functional as F
from torch import nn

from .image_quality import sample_frames
from .registry import RewardFn, register_reward

_KEY = "kwargs"


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
            f"{_KEY}.predictor_path: {path} is not an aesthetic-predictor state dict "
            f"(no 'layers.0.weight'; keys: {sorted(state)[:6]}...)"
        )
    mlp = AestheticMLP(state["layers.0.weight"].shape[1])
    mlp.load_state_dict(state)
    return mlp.eval().requires_grad_(False)


def _required_file(value: str | None, key: str, what: str) -> str:
    if value is None:
        raise ValueError(f"{_KEY}.{key}: required: the local path of {what}")
    path = os.path.expanduser(str(value))
    if not os.path.isfile(path):
        raise ValueError(f"{_KEY}.{key}: file not found: {path} (expected {what})")
    return path


def _model_name(clip_model: str) -> str:
    import open_clip

    if clip_model.endswith(".json"):
        if not os.path.isfile(clip_model):
            raise ValueError(f"{_KEY}.clip_model: config file not found: {clip_model}")
        open_clip.add_model_config(clip_model)
        return os.path.splitext(os.path.basename(clip_model))[0]
    if clip_model not in open_clip.list_models():
        raise ValueError(
            f"{_KEY}.clip_model: unknown open_clip config {clip_model!r}; give a name from "
            f"open_clip.list_models() (e.g. 'ViT-L-14') or a model-config .json path"
        )
    return clip_model


class AestheticScorer:
    """CLIP image tower + aesthetic MLP; moved to the videos' device on first use there."""

    def __init__(
        self,
        clip_path: str | None,
        predictor_path: str | None,
        clip_model: str = "ViT-L-14",
        *,
        num_frames: int = 4,
        batch_size: int = 32,
    ) -> None:
        import open_clip

        clip_file = _required_file(clip_path, "clip_path", "an open_clip checkpoint")
        mlp_file = _required_file(predictor_path, "predictor_path", "the aesthetic MLP state dict")
        if num_frames < 1:
            raise ValueError(f"{_KEY}.num_frames: must be >= 1, got {num_frames}")
        if batch_size < 1:
            raise ValueError(f"{_KEY}.batch_size: must be >= 1, got {batch_size}")
        model = open_clip.create_model(_model_name(clip_model), pretrained=clip_file)
        preprocess = open_clip.get_model_preprocess_cfg(model)
        # Only the image tower is needed; dropping the text tower frees ~120M parameters.
        self.visual = model.visual.eval().requires_grad_(False)
        self.mlp = load_aesthetic_mlp(mlp_file)
        embed_dim = getattr(self.visual, "output_dim", None)
        if embed_dim is not None and embed_dim != self.mlp.input_dim:
            raise ValueError(
                f"{_KEY}: the predictor expects {self.mlp.input_dim}-d embeddings but "
                f"clip_model {clip_model!r} gives {embed_dim}-d ones; use matching files"
            )
        size = self.visual.image_size
        self.image_size = tuple(size) if isinstance(size, (tuple, list)) else (size, size)
        self.mean = torch.tensor(preprocess["mean"]).view(1, 3, 1, 1)
        self.std = torch.tensor(preprocess["std"]).view(1, 3, 1, 1)
        self.num_frames = num_frames
        self.batch_size = batch_size
        self._lock = threading.Lock()

    def _to(self, device: torch.device) -> None:
        with self._lock:
            if self.mean.device != device:
                self.visual.to(device)
                self.mlp.to(device)
                self.mean, self.std = self.mean.to(device), self.std.to(device)

    def preprocess(self, frames: torch.Tensor) -> torch.Tensor:
        """CLIP preprocessing on tensors: resize the short side, centre crop, normalise."""
        if frames.shape[1] == 1:
            frames = frames.expand(-1, 3, -1, -1)
        out_h, out_w = self.image_size
        height, width = frames.shape[-2:]
        scale = max(out_h / height, out_w / width)
        resized_h, resized_w = max(out_h, round(height * scale)), max(out_w, round(width * scale))
        if (resized_h, resized_w) != (height, width):
            frames = F.interpolate(
                frames, size=(resized_h, resized_w), mode="bicubic", antialias=True
            ).clamp(0.0, 1.0)
        top, left = (resized_h - out_h) // 2, (resized_w - out_w) // 2
        frames = frames[..., top : top + out_h, left : left + out_w]
        return (frames - self.mean) / self.std

    @torch.no_grad()
    def __call__(
        self, videos: torch.Tensor, prompts: list[str], metadata: list[dict]
    ) -> torch.Tensor:
        if videos.shape[2] not in (1, 3):
            raise ValueError(f"videos: expected 1 or 3 channels, got {videos.shape[2]}")
        self._to(videos.device)
        frames = sample_frames(videos, self.num_frames).float()
        batch, count = frames.shape[:2]
        flat = frames.flatten(0, 1)
        scores = []
        for start in range(0, flat.shape[0], self.batch_size):
            pixels = self.preprocess(flat[start : start + self.batch_size])
            embeddings = F.normalize(self.visual(pixels).float(), dim=-1)
            scores.append(self.mlp(embeddings))
        return torch.cat(scores).view(batch, count).mean(dim=1).float()


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
