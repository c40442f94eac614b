"""Prompt files and condition images (the toy task's own data is in :mod:`vsa2_rl.toy`)."""

from vsa2_rl.data.prompts import PromptRecord, load_condition_image, read_prompt_records

__all__ = ["PromptRecord", "load_condition_image", "read_prompt_records"]
