"""Synthetic moving-shape videos with matching prompts (the embedded default's training data).

A video shows one coloured shape (square, circle or triangle) on a black background moving in a
straight line (right, left, up or down), slowly or fast, described by a prompt such as
"a red square moving right fast". Everything is fixed by a :class:`ShapeSpec` and a seed, so a
video is reproducible and its motion is known in closed form (useful to check motion rewards).

Geometry is in normalised frame units (0..1 along each axis), so the same spec renders at any
resolution: the shape's half size is ``HALF_SIZE`` of the frame and over a clip it travels
``TRAVEL[speed]`` of the frame; the start point is drawn so the shape stays fully inside. Edges
are anti-aliased over one pixel (coverage from a signed distance), so sub-pixel motion at 16 px
still changes the pixels smoothly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

COLORS = {
    "red": (1.0, 0.1, 0.1),
    "green": (0.1, 0.9, 0.1),
    "blue": (0.15, 0.3, 1.0),
    "yellow": (1.0, 0.9, 0.1),
    "cyan": (0.1, 0.9, 0.9),
    "magenta": (0.9, 0.1, 0.9),
}
SHAPES = ("square", "circle", "triangle")
DIRECTIONS = {"right": (1.0, 0.0), "left": (-1.0, 0.0), "up": (0.0, -1.0), "down": (0.0, 1.0)}
TRAVEL = {"slowly": 0.25, "fast": 0.55}  # distance over the clip, in frame widths
HALF_SIZE = 0.17  # half the shape's extent, in frame widths


@dataclass(frozen=True)
class ShapeSpec:
    """What a synthetic video shows; ``prompt`` is its caption."""

    color: str
    shape: str
    direction: str
    speed: str

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("color", self.color, tuple(COLORS)),
            ("shape", self.shape, SHAPES),
            ("direction", self.direction, tuple(DIRECTIONS)),
            ("speed", self.speed, tuple(TRAVEL)),
        ):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")

    @property
    def prompt(self) -> str:
        return f"a {self.color} {self.shape} moving {self.direction} {self.speed}"

    @classmethod
    def from_prompt(cls, prompt: str) -> ShapeSpec:
        """Parse "a <color> <shape> moving <direction> <speed>" (the inverse of ``prompt``)."""
        words = prompt.lower().split()
        if len(words) != 6 or words[0] != "a" or words[3] != "moving":
            raise ValueError(
                f"prompt must read 'a <color> <shape> moving <direction> <speed>', got {prompt!r}"
            )
        return cls(color=words[1], shape=words[2], direction=words[4], speed=words[5])

    def velocity(self) -> tuple[float, float]:
        """Displacement (dx, dy) over the whole clip, in frame widths/heights."""
        dx, dy = DIRECTIONS[self.direction]
        return dx * TRAVEL[self.speed], dy * TRAVEL[self.speed]


def all_specs() -> list[ShapeSpec]:
    """Every (color, shape, direction, speed) combination, in a fixed order."""
    return [
        ShapeSpec(c, s, d, v) for c in COLORS for s in SHAPES for d in DIRECTIONS for v in TRAVEL
    ]


def start_position(spec: ShapeSpec, seed: int) -> tuple[float, float]:
    """Start centre (x, y) drawn from ``seed`` so the shape stays inside over the clip."""
    generator = torch.Generator().manual_seed(int(seed))
    u = torch.rand(2, generator=generator, dtype=torch.float64).tolist()
    start = []
    for axis, delta in enumerate(spec.velocity()):
        low = HALF_SIZE + max(0.0, -delta)
        high = 1.0 - HALF_SIZE - max(0.0, delta)
        start.append(low + (high - low) * u[axis])
    return start[0], start[1]


def _signed_distance(shape: str, dx: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """Distance to the shape's edge (negative inside), frame units; dx, dy from the centre."""
    if shape == "square":
        return torch.maximum(dx.abs(), dy.abs()) - HALF_SIZE * 0.85
    if shape == "circle":
        return torch.sqrt(dx**2 + dy**2) - HALF_SIZE
    # Upward triangle, apex (0, -h), base corners (+-h, h): the largest of the signed
    # distances to its three edge lines (exact inside, a close bound outside).
    h = HALF_SIZE
    base = dy - h
    left = (-2.0 * dx - dy - h) / math.sqrt(5.0)
    right = (2.0 * dx - dy - h) / math.sqrt(5.0)
    return torch.maximum(base, torch.maximum(left, right))


def render_video(
    spec: ShapeSpec, seed: int, num_frames: int, height: int, width: int
) -> torch.Tensor:
    """One video [T, 3, H, W] float32 in [0, 1]."""
    if num_frames < 2 or height < 4 or width < 4:
        raise ValueError(
            f"need num_frames >= 2 and height, width >= 4, got {num_frames}x{height}x{width}"
        )
    x0, y0 = start_position(spec, seed)
    vx, vy = spec.velocity()
    progress = torch.linspace(0.0, 1.0, num_frames, dtype=torch.float64)
    cx = (x0 + vx * progress).view(-1, 1, 1)  # (T, 1, 1)
    cy = (y0 + vy * progress).view(-1, 1, 1)
    ys = ((torch.arange(height, dtype=torch.float64) + 0.5) / height).view(1, -1, 1)
    xs = ((torch.arange(width, dtype=torch.float64) + 0.5) / width).view(1, 1, -1)
    distance = _signed_distance(spec.shape, xs - cx, ys - cy)  # (T, H, W)
    # One-pixel anti-aliasing ramp, measured in pixels of the smaller side.
    coverage = (0.5 - distance * min(height, width)).clamp(0.0, 1.0)
    color = torch.tensor(COLORS[spec.color], dtype=torch.float64).view(1, 3, 1, 1)
    return (coverage.unsqueeze(1) * color).float()


def render_batch(
    specs: list[ShapeSpec], seeds: list[int], num_frames: int, height: int, width: int
) -> torch.Tensor:
    """Videos [B, T, 3, H, W] in [0, 1] for paired specs and seeds."""
    if len(specs) != len(seeds):
        raise ValueError(f"specs and seeds must pair up, got {len(specs)} and {len(seeds)}")
    return torch.stack(
        [render_video(s, i, num_frames, height, width) for s, i in zip(specs, seeds, strict=True)]
    )


def random_specs(count: int, generator: torch.Generator) -> list[ShapeSpec]:
    """``count`` specs drawn uniformly from :func:`all_specs` with ``generator``."""
    pool = all_specs()
    ids = torch.randint(len(pool), (count,), generator=generator).tolist()
    return [pool[i] for i in ids]
