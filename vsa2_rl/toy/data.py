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

A video may also move other than its caption says (``displacement=``): that is how motion
rewards are validated on videos whose true motion is known (static, wrong direction, wrong
speed), and what :func:`pretraining_batch` can give part of a pretraining batch: videos moving
opposite to their caption ("right" for a shape moving left). The shipped base is pretrained on
truthful captions (``ToyBuildConfig.mirrored_captions`` 0); a base pretrained with half of them
mirrored picks a motion's sign by chance and does not learn it even from perfect data. (Captions
whose motion is drawn at random instead, uniform over :data:`MOTIONS`, were tried first: at half
of the captions a 4-block model learnt to ignore motion words altogether.)
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


# Every motion a synthetic video can show: the 4 directions at both speeds, and standing still.
MOTIONS = [
    *((dx * travel, dy * travel) for dx, dy in DIRECTIONS.values() for travel in TRAVEL.values()),
    (0.0, 0.0),
]


def start_position(
    spec: ShapeSpec, seed: int, displacement: tuple[float, float] | None = None
) -> tuple[float, float]:
    """Start centre (x, y) drawn from ``seed`` so the shape stays inside over the clip.

    ``displacement``: the motion the video really shows (default: the caption's).
    """
    generator = torch.Generator().manual_seed(int(seed))
    u = torch.rand(2, generator=generator, dtype=torch.float64).tolist()
    start = []
    for axis, delta in enumerate(displacement or spec.velocity()):
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
    spec: ShapeSpec,
    seed: int,
    num_frames: int,
    height: int,
    width: int,
    displacement: tuple[float, float] | None = None,
) -> torch.Tensor:
    """One video [T, 3, H, W] float32 in [0, 1]; ``displacement`` overrides the caption's motion."""
    return render_batch([spec], [seed], num_frames, height, width, [displacement])[0]


def render_batch(
    specs: list[ShapeSpec],
    seeds: list[int],
    num_frames: int,
    height: int,
    width: int,
    displacements: list[tuple[float, float] | None] | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Videos [B, T, 3, H, W] float32 in [0, 1] for paired specs and seeds, rendered at once.

    ``displacements[i]`` (frame units over the clip, None = the caption's) is the motion video i
    really shows. Geometry is computed in float64 on ``device``.
    """
    if num_frames < 2 or height < 4 or width < 4:
        raise ValueError(
            f"need num_frames >= 2 and height, width >= 4, got {num_frames}x{height}x{width}"
        )
    displacements = displacements or [None] * len(specs)
    if not len(specs) == len(seeds) == len(displacements):
        raise ValueError(
            f"specs, seeds and displacements must pair up, got {len(specs)}, {len(seeds)} and "
            f"{len(displacements)}"
        )
    f64 = {"dtype": torch.float64, "device": device}
    moves = [d or s.velocity() for s, d in zip(specs, displacements, strict=True)]
    starts = [start_position(s, i, d) for s, i, d in zip(specs, seeds, moves, strict=True)]
    x0, y0 = torch.tensor(starts, **f64).view(-1, 2, 1, 1, 1).unbind(1)  # (B, 1, 1, 1) each
    vx, vy = torch.tensor(moves, **f64).view(-1, 2, 1, 1, 1).unbind(1)
    progress = torch.linspace(0.0, 1.0, num_frames, **f64).view(1, -1, 1, 1)
    ys = ((torch.arange(height, **f64) + 0.5) / height).view(1, 1, -1, 1)
    xs = ((torch.arange(width, **f64) + 0.5) / width).view(1, 1, 1, -1)
    dx, dy = torch.broadcast_tensors(xs - (x0 + vx * progress), ys - (y0 + vy * progress))
    distance = torch.zeros_like(dx)  # (B, T, H, W)
    for shape in SHAPES:
        rows = torch.tensor([s.shape == shape for s in specs], device=device)
        if bool(rows.any()):
            distance[rows] = _signed_distance(shape, dx[rows], dy[rows])
    # One-pixel anti-aliasing ramp, measured in pixels of the smaller side.
    coverage = (0.5 - distance * min(height, width)).clamp(0.0, 1.0)
    color = torch.tensor([COLORS[s.color] for s in specs], **f64).view(-1, 1, 3, 1, 1)
    return (coverage.unsqueeze(2) * color).float()


def pretraining_batch(
    count: int,
    generator: torch.Generator,
    mirrored: float,
    faithful_colors: tuple[str, ...] = (),
) -> tuple[list[ShapeSpec], list[int], list[tuple[float, float] | None]]:
    """Captions, seeds and true motions of ``count`` pretraining videos.

    With probability ``mirrored`` a video moves opposite to its caption (same axis and speed,
    the other sign); the others move as captioned (motion None). A model trained on them moves a
    shape the prompted way in about ``1 - mirrored`` of its samples and along the prompted axis
    in all of them. Videos of a colour in ``faithful_colors`` always move as captioned.
    """
    if not 0.0 <= mirrored <= 1.0:
        raise ValueError(f"mirrored must be in [0, 1], got {mirrored}")
    unknown = sorted(set(faithful_colors) - set(COLORS))
    if unknown:
        raise ValueError(f"faithful_colors: unknown colours {unknown}; known: {list(COLORS)}")
    specs = random_specs(count, generator)
    seeds = torch.randint(1 << 30, (count,), generator=generator).tolist()
    flips = (torch.rand(count, generator=generator) < mirrored).tolist()
    moves = []
    for spec, flip in zip(specs, flips, strict=True):
        dx, dy = spec.velocity()
        flip = flip and spec.color not in faithful_colors
        moves.append((-dx, -dy) if flip else None)
    return specs, seeds, moves


def random_specs(count: int, generator: torch.Generator) -> list[ShapeSpec]:
    """``count`` specs drawn uniformly from :func:`all_specs` with ``generator``."""
    pool = all_specs()
    ids = torch.randint(len(pool), (count,), generator=generator).tolist()
    return [pool[i] for i in ids]
