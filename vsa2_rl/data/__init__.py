"""Prompt files and condition images, and the data of the embedded default: synthetic
moving-shape videos and their prompt sets."""

from vsa2_rl.data.prompts import (
    PromptRecord,
    load_condition_image,
    read_prompt_records,
    toy_prompts,
)
from vsa2_rl.data.synthetic import ShapeSpec, all_specs, random_specs, render_batch, render_video

__all__ = [
    "PromptRecord",
    "ShapeSpec",
    "all_specs",
    "load_condition_image",
    "random_specs",
    "read_prompt_records",
    "render_batch",
    "render_video",
    "toy_prompts",
]
