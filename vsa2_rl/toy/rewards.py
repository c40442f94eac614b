"""Rewards of the toy motion task with a known answer: the prompted motion, and shape fidelity.

Both read prompts of the synthetic task ("a red square moving left fast",
:mod:`vsa2_rl.toy.data`) and find the shape in each frame with one detector:

- **Detector** (:func:`detect_blobs`): foreground = pixels whose brightest channel exceeds
  ``threshold`` (the background is black); the largest 4-connected component of the foreground
  is the blob. Per frame it reports the blob's area (pixels), centroid (frame units, 0..1) and
  the palette colour nearest to its mean colour. Frames are area-downsampled to at most
  ``MAX_SIDE`` pixels first, so that the component search stays cheap at any resolution.
- ``prompt_motion``: the prompted shape's displacement over the clip, a least-squares line
  through the blob's centroids in the frames where the blob *is* the shape (prompted colour,
  area within ``area_tolerance`` of the shape's), against the displacement the prompt asks for
  (direction and speed, ``data.TRAVEL``). Frames where the shape is not found do not count,
  so a policy cannot buy motion by fraying the shape into fragments whose largest piece jumps
  about (an RL run on the untracked blob did just that); with fewer than 2 such frames there is
  no shape to track and the score is 0, as for a static one. :func:`motion_score` maps the
  pair to [0, 1]: 2/3 for the direction (``(1 + cos) / 2``, gated by how far the blob moved)
  and 1/3 for the speed (the ratio of the slower to the faster of the two lengths). So a static
  video scores 0, a wrong direction at most 2/3, the right direction at the wrong speed 0.82
  and the asked motion 1. The score is validated on the generator's own videos, whose true
  motion is known (tests).
- ``prompt_direction``: 1 when the prompted shape (tracked as for ``prompt_motion``) moves the
  prompted way, 0 otherwise (:func:`follows_direction`: within 45 degrees of the prompted
  direction and at least ``MOVING_DISTANCE`` far, whatever the speed). The binary figure behind
  "the share of videos moving the prompted way".
- ``shape_fidelity``: fraction of frames whose blob has the prompted colour and an area within
  ``area_tolerance`` (default 50%) of the prompted shape's true area at that resolution. A guard
  metric: it falls when a policy buys motion with smeared, split or recoloured shapes.

A prompt outside the task's grammar, or a video of fewer than 2 frames, raises
:class:`RewardError` naming the reward and the prompt: nothing is silently scored 0.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vsa2_rl.rewards.registry import RewardError, RewardFn, register_reward
from vsa2_rl.toy.data import COLORS, ShapeSpec, render_video

MAX_SIDE = 64
FOREGROUND_THRESHOLD = 0.5
# Below this displacement (frame units, half the slow travel) the direction counts only partly.
MOVING_DISTANCE = 0.125
_PALETTE = list(COLORS)


@dataclass
class Blobs:
    """Largest foreground component per frame of a video, [T] each (``found`` False: none)."""

    found: torch.Tensor  # bool
    area: torch.Tensor  # pixels at the detection resolution
    centroid: torch.Tensor  # [T, 2] (x, y), frame units
    color: list[str]  # nearest palette colour, "" where none was found


def _downsample(frames: torch.Tensor) -> torch.Tensor:
    height, width = frames.shape[-2:]
    factor = math.ceil(max(height, width) / MAX_SIDE)
    return F.avg_pool2d(frames, factor) if factor > 1 else frames


def largest_component(mask: torch.Tensor) -> torch.Tensor:
    """The largest 4-connected component of each frame of ``mask`` [N, H, W] (bool), as bool.

    Label propagation: every foreground pixel starts with its own index and repeatedly takes the
    smallest label among itself and its 4 neighbours until nothing changes; ties in size go to
    the component with the smaller label.
    """
    count, height, width = mask.shape
    empty = height * width  # larger than every pixel index
    index = torch.arange(empty, device=mask.device).view(1, height, width).expand_as(mask)
    labels = torch.where(mask, index, empty)
    for _ in range(empty):
        padded = F.pad(labels, (1, 1, 1, 1), value=empty)
        neighbours = labels
        for shifted in (padded[:, :-2, 1:-1], padded[:, 2:, 1:-1], padded[:, 1:-1, :-2],
                        padded[:, 1:-1, 2:]):  # fmt: skip
            neighbours = torch.minimum(neighbours, shifted)
        updated = torch.where(mask, neighbours, empty)
        if torch.equal(updated, labels):
            break
        labels = updated
    offsets = torch.arange(count, device=mask.device).view(-1, 1) * (empty + 1)
    flat = (labels.flatten(1) + offsets).flatten()
    sizes = torch.bincount(flat, minlength=count * (empty + 1)).view(count, empty + 1)
    sizes[:, empty] = 0  # the background label
    best = sizes.argmax(dim=1)  # (N,)
    return (labels == best.view(-1, 1, 1)) & mask


def detect_blobs(video: torch.Tensor, threshold: float = FOREGROUND_THRESHOLD) -> Blobs:
    """The detector of the module docstring on one video [T, 3, H, W] in [0, 1]."""
    frames = _downsample(video.float())
    height, width = frames.shape[-2:]
    blob = largest_component(frames.amax(dim=1) > threshold)  # (T, H, W)
    weight = blob.float()
    area = weight.sum(dim=(1, 2))
    found = area > 0
    denominator = area.clamp_min(1.0)
    ys = (torch.arange(height, device=frames.device) + 0.5) / height
    xs = (torch.arange(width, device=frames.device) + 0.5) / width
    cx = (weight * xs.view(1, 1, -1)).sum(dim=(1, 2)) / denominator
    cy = (weight * ys.view(1, -1, 1)).sum(dim=(1, 2)) / denominator
    mean_color = (frames * weight.unsqueeze(1)).sum(dim=(2, 3)) / denominator.view(-1, 1)
    palette = torch.tensor([COLORS[c] for c in _PALETTE], device=frames.device)
    nearest = torch.cdist(mean_color, palette).argmin(dim=1).tolist()
    colors = [_PALETTE[i] if ok else "" for i, ok in zip(nearest, found.tolist(), strict=True)]
    return Blobs(found, area, torch.stack([cx, cy], dim=1), colors)


def blob_displacement(blobs: Blobs, frames: torch.Tensor | None = None) -> torch.Tensor:
    """Displacement (dx, dy) over the clip of a least-squares line through the blob centroids
    of the frames where one was found (and ``frames``, bool [T], allows); (0, 0) with fewer
    than 2 such frames."""
    valid = blobs.found if frames is None else blobs.found & frames.to(blobs.found.device)
    progress = torch.linspace(0.0, 1.0, valid.numel(), device=blobs.centroid.device)[valid]
    points = blobs.centroid[valid]  # (K, 2)
    if points.shape[0] < 2:
        return torch.zeros(2, device=points.device)
    centred = progress - progress.mean()
    slope = (centred.view(-1, 1) * (points - points.mean(dim=0))).sum(dim=0)
    return slope / centred.square().sum()


def motion_score(displacement: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Agreement in [0, 1] of a displacement [..., 2] with the asked ``target`` [..., 2].

    ``2/3 * min(1, |d| / MOVING_DISTANCE) * (1 + cos(d, t)) / 2 + 1/3 * min(|d|, |t|) /
    max(|d|, |t|)``: 0 for a static shape, 1 for exactly the asked motion.
    """
    length = displacement.norm(dim=-1)
    target_length = target.norm(dim=-1)
    cosine = (displacement * target).sum(dim=-1) / (length * target_length).clamp_min(1e-8)
    moving = (length / MOVING_DISTANCE).clamp(max=1.0)
    return 2.0 / 3.0 * moving * (1.0 + cosine) / 2.0 + speed_agreement(displacement, target) / 3.0


def speed_agreement(displacement: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``min(|d|, |t|) / max(|d|, |t|)`` in [0, 1] of a displacement [..., 2] and the asked
    ``target`` [..., 2]: 1 at the asked speed, whatever the direction; 0 for a static shape."""
    length, target_length = displacement.norm(dim=-1), target.norm(dim=-1)
    return torch.minimum(length, target_length) / torch.maximum(length, target_length).clamp_min(
        1e-8
    )


def follows_direction(displacement: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Bool [...]: the displacement [..., 2] points within 45 degrees of ``target`` [..., 2] and
    is at least ``MOVING_DISTANCE`` long (a shape that barely moves follows no direction)."""
    length = displacement.norm(dim=-1)
    cosine = (displacement * target).sum(dim=-1) / (length * target.norm(dim=-1)).clamp_min(1e-8)
    return (length >= MOVING_DISTANCE) & (cosine >= math.cos(math.pi / 4))


def parse_prompts(name: str, prompts: list[str]) -> list[ShapeSpec]:
    """The task's spec of every prompt; RewardError naming ``name`` and the prompt otherwise."""
    specs = []
    for prompt in prompts:
        try:
            specs.append(ShapeSpec.from_prompt(prompt))
        except ValueError as error:
            raise RewardError(
                name,
                f"cannot read prompt {prompt!r} ({error}); this reward scores the toy task's "
                "prompts 'a <color> <shape> moving <direction> <speed>'",
            ) from None
    return specs


def _check_frames(name: str, videos: torch.Tensor) -> None:
    if videos.dim() != 5 or videos.shape[1] < 2 or videos.shape[2] != 3:
        raise RewardError(
            name, f"needs RGB videos [B, T >= 2, 3, H, W], got shape {tuple(videos.shape)}"
        )


@functools.lru_cache(maxsize=256)
def true_area(shape: str, color: str, height: int, width: int, threshold: float) -> float:
    """Detected area (pixels, at the detection resolution) of a shape drawn by the generator."""
    spec = ShapeSpec(color, shape, "right", "slowly")
    frame = render_video(spec, 0, 2, height, width, displacement=(0.0, 0.0))[:1]
    return float(detect_blobs(frame, threshold).area[0])


def shape_frames(
    video: torch.Tensor, spec: ShapeSpec, threshold: float, area_tolerance: float
) -> tuple[Blobs, torch.Tensor]:
    """The video's blobs and which frames' blob is the prompted shape (colour and area), [T]."""
    blobs = detect_blobs(video, threshold)
    height, width = _downsample(video[:1].float()).shape[-2:]
    expected = true_area(spec.shape, spec.color, height, width, threshold)
    right_size = ((blobs.area - expected).abs() <= area_tolerance * expected).cpu()
    right_color = torch.tensor([c == spec.color for c in blobs.color])
    return blobs, right_size & right_color


def _check_kwargs(threshold: float, area_tolerance: float) -> None:
    if not 0.0 < threshold < 1.0:
        raise ValueError(f"kwargs.threshold: must be in (0, 1), got {threshold}")
    if not 0.0 < area_tolerance < 1.0:
        raise ValueError(f"kwargs.area_tolerance: must be in (0, 1), got {area_tolerance}")


def _tracked_motion_reward(name: str, score, threshold: float, area_tolerance: float) -> RewardFn:
    """A reward of ``score(displacement [B, 2], target [B, 2])`` where the displacement is the
    prompted shape's over the clip and the target the prompt's motion."""
    _check_kwargs(threshold, area_tolerance)

    @torch.no_grad()
    def reward(videos: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        _check_frames(name, videos)
        specs = parse_prompts(name, prompts)
        moved = []
        for video, spec in zip(videos, specs, strict=True):
            blobs, is_shape = shape_frames(video, spec, threshold, area_tolerance)
            moved.append(blob_displacement(blobs, is_shape))
        target = torch.tensor([s.velocity() for s in specs])
        return score(torch.stack(moved).cpu(), target).float().to(videos.device)

    reward.__name__ = name
    return reward


@register_reward("prompt_motion")
def prompt_motion(
    *, threshold: float = FOREGROUND_THRESHOLD, area_tolerance: float = 0.5
) -> RewardFn:
    """How closely the prompted shape moves as the prompt asks (:func:`motion_score`); [0, 1]."""
    return _tracked_motion_reward("prompt_motion", motion_score, threshold, area_tolerance)


@register_reward("prompt_direction")
def prompt_direction(
    *, threshold: float = FOREGROUND_THRESHOLD, area_tolerance: float = 0.5
) -> RewardFn:
    """1 when the prompted shape moves the prompted way (:func:`follows_direction`), else 0."""
    return _tracked_motion_reward("prompt_direction", follows_direction, threshold, area_tolerance)


@register_reward("prompt_speed")
def prompt_speed(
    *, threshold: float = FOREGROUND_THRESHOLD, area_tolerance: float = 0.5
) -> RewardFn:
    """How close the prompted shape's speed is to the asked one (:func:`speed_agreement`),
    whatever its direction; [0, 1]."""
    return _tracked_motion_reward("prompt_speed", speed_agreement, threshold, area_tolerance)


@register_reward("shape_fidelity")
def shape_fidelity(
    *, threshold: float = FOREGROUND_THRESHOLD, area_tolerance: float = 0.5
) -> RewardFn:
    """Fraction of frames whose blob has the prompted colour and about the true area; [0, 1]."""
    _check_kwargs(threshold, area_tolerance)

    @torch.no_grad()
    def reward(videos: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        _check_frames("shape_fidelity", videos)
        specs = parse_prompts("shape_fidelity", prompts)
        scores = [
            shape_frames(video, spec, threshold, area_tolerance)[1].float().mean()
            for video, spec in zip(videos, specs, strict=True)
        ]
        return torch.stack(scores).to(videos.device)

    reward.__name__ = "shape_fidelity"
    return reward
