"""Data of the embedded default: synthetic moving-shape videos and their prompt sets."""

from vsa2_rl.data.prompts import toy_prompts
from vsa2_rl.data.synthetic import ShapeSpec, all_specs, random_specs, render_batch, render_video

__all__ = ["ShapeSpec", "all_specs", "random_specs", "render_batch", "render_video", "toy_prompts"]
