"""open_clip towers from local files, shared by the CLIP-based rewards (``aesthetic``,
``clip_score``): frames are sampled evenly, preprocessed on tensors as open_clip's own
transforms do (short side resized, centre crop, mean/std), embedded in batches and
L2-normalised; prompts go through the model's own tokenizer (open_clip's bundled BPE vocabulary
for CLIP text towers: nothing is downloaded).

``clip_model`` is an open_clip config name (e.g. ``"ViT-L-14"``) or the path of an open_clip
model-config JSON file (``{"embed_dim", "vision_cfg", "text_cfg"}``), registered with
``open_clip.add_model_config`` under the file's stem; tests use this for tiny models.
"""

from __future__ import annotations

import os
import threading

import torch
import torch.nn.functional as F

from .image_quality import sample_frames

KEY = "kwargs"


def required_file(value: str | None, key: str, what: str) -> str:
    if value is None:
        raise ValueError(f"{KEY}.{key}: required: the local path of {what}")
    path = os.path.expanduser(str(value))
    if not os.path.isfile(path):
        raise ValueError(f"{KEY}.{key}: file not found: {path} (expected {what})")
    return path


def model_name(clip_model: str) -> str:
    import open_clip

    if clip_model.endswith(".json"):
        if not os.path.isfile(clip_model):
            raise ValueError(f"{KEY}.clip_model: config file not found: {clip_model}")
        open_clip.add_model_config(clip_model)
        return os.path.splitext(os.path.basename(clip_model))[0]
    if clip_model not in open_clip.list_models():
        raise ValueError(
            f"{KEY}.clip_model: unknown open_clip config {clip_model!r}; give a name from "
            f"open_clip.list_models() (e.g. 'ViT-L-14') or a model-config .json path"
        )
    return clip_model


class ClipEmbedder:
    """An open_clip model's image tower (and, with ``text``, its text tower and tokenizer),
    moved to the videos' device on first use there."""

    def __init__(
        self,
        clip_path: str | None,
        clip_model: str,
        *,
        num_frames: int,
        batch_size: int,
        text: bool = False,
    ) -> None:
        import open_clip

        clip_file = required_file(clip_path, "clip_path", "an open_clip checkpoint")
        if num_frames < 1:
            raise ValueError(f"{KEY}.num_frames: must be >= 1, got {num_frames}")
        if batch_size < 1:
            raise ValueError(f"{KEY}.batch_size: must be >= 1, got {batch_size}")
        name = model_name(clip_model)
        try:
            model = open_clip.create_model(name, pretrained=clip_file)
        except RuntimeError as error:  # load_state_dict: missing, unexpected or mis-sized keys
            first = str(error).strip().splitlines()[0]
            raise ValueError(
                f"{KEY}.clip_path: {clip_file} is not a checkpoint of the {name!r} architecture "
                f"(kwargs.clip_model): {first[:300]}; set clip_model to the checkpoint's "
                "architecture or give that architecture's checkpoint"
            ) from None
        model = model.eval().requires_grad_(False)
        preprocess = open_clip.get_model_preprocess_cfg(model)
        # without text only the image tower is kept (a ViT-L/14's text tower is ~120M weights)
        self.model = model if text else None
        self.visual = model.visual
        self.tokenizer = open_clip.get_tokenizer(name) if text else None
        size = self.visual.image_size
        self.image_size = tuple(size) if isinstance(size, (tuple, list)) else (size, size)
        self.mean = torch.tensor(preprocess["mean"]).view(1, 3, 1, 1)
        self.std = torch.tensor(preprocess["std"]).view(1, 3, 1, 1)
        self.num_frames = num_frames
        self.batch_size = batch_size
        self._lock = threading.Lock()

    @property
    def embed_dim(self) -> int | None:
        return getattr(self.visual, "output_dim", None)

    def to(self, device: torch.device) -> None:
        with self._lock:
            if self.mean.device != device:
                (self.model or self.visual).to(device)
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
    def frames(self, videos: torch.Tensor) -> torch.Tensor:
        """[B, num_frames, E] unit embeddings of evenly spaced frames of ``videos``."""
        if videos.shape[2] not in (1, 3):
            raise ValueError(f"videos: expected 1 or 3 channels, got {videos.shape[2]}")
        self.to(videos.device)
        frames = sample_frames(videos, self.num_frames).float()
        batch, count = frames.shape[:2]
        flat = frames.flatten(0, 1)
        embeddings = [
            F.normalize(self.visual(self.preprocess(flat[s : s + self.batch_size])).float(), dim=-1)
            for s in range(0, flat.shape[0], self.batch_size)
        ]
        return torch.cat(embeddings).view(batch, count, -1)

    @torch.no_grad()
    def texts(self, prompts: list[str], device: torch.device) -> torch.Tensor:
        """[B, E] unit embeddings of ``prompts`` (needs ``text=True``)."""
        self.to(device)
        tokens = self.tokenizer(list(prompts)).to(device)
        return F.normalize(self.model.encode_text(tokens).float(), dim=-1)
