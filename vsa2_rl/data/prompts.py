"""Prompt files (plain text, or JSON Lines with image-to-video condition images) and their
condition images.

A prompt file whose name ends in ``.jsonl`` holds one JSON object per non-empty line,
``{"prompt": "<text>", "image": "<path>"}`` ("image" optional, relative paths resolved against
the file's folder; every record carries one or none does); any other file holds one prompt per
non-empty line. :func:`load_condition_image` reads a condition image at the video size: RGB
in [0, 1] whatever its bit depth (16-bit grayscale scaled by 65535; 32-bit and float images are
refused, their range being unknown), resized (Lanczos, no crop: what diffusers' Wan
image-to-video pipeline does). Without a prompt file a toy run uses the toy task's built-in
prompts (:mod:`vsa2_rl.toy.prompts`); any other model needs one (the config refuses it
without).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageOps

from vsa2_rl.config import ConfigError


@dataclass(frozen=True)
class PromptRecord:
    """One prompt; ``image`` is the absolute path of its condition image (image-to-video)."""

    text: str
    image: str | None = None


JSONL_KEYS = ("prompt", "image")
# The filter condition images are resized with. diffusers' VideoProcessor.preprocess resizes
# the same way (straight to the size, no crop) but with Lanczos by default.
CONDITION_RESAMPLE = Image.Resampling.LANCZOS
SIXTEEN_BIT_MAX = 65535.0  # the white of a 16-bit image
UNREADABLE = "cannot be read as an image, "
_JSON_TYPE_NAMES = {
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "true/false",
    type(None): "null",
}


def read_prompt_records(path: str, key: str) -> list[PromptRecord]:
    """The prompts of the prompt file ``path`` (config key ``key``): JSON Lines with condition
    images where the name ends in ``.jsonl``, otherwise one prompt per non-empty line."""
    lines = _read_lines(path, key)
    if path.lower().endswith(".jsonl"):
        records = _parse_jsonl(lines, path, key)
        layout = 'one JSON object per line: {"prompt": ..., "image": ...}'
    else:
        records = [PromptRecord(line.strip()) for line in lines if line.strip()]
        layout = "one prompt per line"
    if not records:
        raise ConfigError(f"{key}: prompt file {path} has no prompts ({layout})")
    return records


def _read_lines(path: str, key: str) -> list[str]:
    try:
        with open(path, encoding="utf-8-sig") as handle:  # a byte-order mark is no text
            return list(handle)
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{key}: {path} is not UTF-8 text ({error.reason} at byte {error.start}); save it "
            "as UTF-8"
        ) from None


def _parse_jsonl(lines: list[str], path: str, key: str) -> list[PromptRecord]:
    folder = os.path.dirname(os.path.abspath(path))
    records: list[PromptRecord] = []
    first_line = 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{key}: {path} line {number}"
        record = _parse_record(line, folder, where)
        if not records:
            first_line = number
        elif (record.image is None) != (records[0].image is None):
            first = "carries" if records[0].image is not None else "does not carry"
            this = "does" if record.image is not None else "does not"
            raise ConfigError(
                f"{where}: every record or none carries an image; line {first_line} {first} "
                f"an image and this one {this}"
            )
        records.append(record)
    return records


def _parse_record(line: str, folder: str, where: str) -> PromptRecord:
    try:
        entry = json.loads(line.rstrip())
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"{where}: not valid JSON ({error.msg} at column {error.colno}); write one object "
            'per line, e.g. {"prompt": "a red ball", "image": "ball.png"}'
        ) from None
    if not isinstance(entry, dict):
        raise ConfigError(
            f'{where}: expected a JSON object {{"prompt": ..., "image": ...}}, got '
            f"{_JSON_TYPE_NAMES.get(type(entry), type(entry).__name__)}"
        )
    unknown = [name for name in entry if name not in JSONL_KEYS]
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(map(json.dumps, unknown))}; allowed: "
            f"{', '.join(map(json.dumps, JSONL_KEYS))}"
        )
    text = entry.get("prompt")
    if not isinstance(text, str) or not text.strip():
        got = "it is missing" if "prompt" not in entry else f"got {json.dumps(text)}"
        raise ConfigError(f'{where}: "prompt" must be a non-empty string; {got}')
    if "image" not in entry:
        return PromptRecord(text.strip())
    return PromptRecord(text.strip(), _check_image(entry["image"], folder, where))


def _check_image(image: object, folder: str, where: str) -> str:
    """The absolute path of a record's readable condition image."""
    if not isinstance(image, str) or not image:
        raise ConfigError(
            f'{where}: "image" must be a non-empty string (the condition image\'s path), got '
            f"{json.dumps(image)}; leave the key out for a prompt without an image"
        )
    resolved = os.path.abspath(os.path.join(folder, os.path.expanduser(image)))
    if not os.path.isfile(resolved):
        relative = "" if os.path.isabs(image) else f" ({image} read from the prompt file's folder)"
        raise ConfigError(f"{where}: image file not found: {resolved}{relative}")
    try:
        open_condition_image(resolved)  # decodes every pixel: verify() checks only checksums
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}") from None
    return resolved


def open_condition_image(path: str) -> Image.Image:
    """The condition image at ``path``, EXIF orientation applied: RGB for 8-bit images (and
    any PIL converts to RGB), or a mode ``F`` grayscale image in [0, 1] for 16-bit grayscale
    ones (scaled by their bit depth: PIL's RGB conversion would clip them to white). 32-bit
    integer and float images have no range to scale by: ConfigError naming the file."""
    try:
        with Image.open(path) as handle:
            image, source = ImageOps.exif_transpose(handle), handle.format
    except Exception as error:  # PIL signals a bad image with many exception types
        raise ConfigError(
            f"image {path} {UNREADABLE}cannot be opened ({error}); save it as PNG or JPEG"
        ) from None
    if image.mode.startswith("I;16") or (image.mode == "I" and source == "PNG"):
        pixels = np.asarray(image, dtype=np.float32) / SIXTEEN_BIT_MAX
        return Image.fromarray(pixels, mode="F")
    if image.mode in ("I", "F"):
        depth = "32-bit integer" if image.mode == "I" else "floating-point"
        raise ConfigError(
            f"image {path} has {depth} pixels (PIL mode {image.mode}), whose range is not "
            "known; save it as an 8-bit or 16-bit PNG, or a JPEG"
        )
    return image.convert("RGB")


def condition_rgb(path: str) -> Image.Image:
    """The condition image at ``path`` as an 8-bit RGB image (what CLIP's processor takes),
    16-bit ones scaled to 8 bits (see :func:`open_condition_image`)."""
    image = open_condition_image(path)
    if image.mode != "F":
        return image
    gray = np.rint(np.clip(np.asarray(image), 0.0, 1.0) * 255.0).astype(np.uint8)
    return Image.fromarray(gray).convert("RGB")


def load_condition_image(path: str, height: int, width: int) -> torch.Tensor:
    """The image at ``path`` as RGB float32 [3, height, width] in [0, 1]: EXIF orientation
    applied, scaled by its bit depth (:func:`open_condition_image`), resized with PIL's
    ``CONDITION_RESAMPLE`` (Lanczos) filter straight to (width, height), no crop."""
    try:
        image = open_condition_image(path)
    except ConfigError as error:
        reason = str(error).removeprefix(f"image {path} ").removeprefix(UNREADABLE)
        raise ValueError(f"condition image {path}: {reason}") from None
    resized = image.resize((width, height), CONDITION_RESAMPLE)
    if image.mode == "F":  # 16-bit grayscale, already in [0, 1]
        gray = np.clip(np.asarray(resized, dtype=np.float32), 0.0, 1.0)
        pixels = np.repeat(gray[..., None], 3, axis=-1)
    else:
        pixels = np.asarray(resized, dtype=np.float32) / 255.0
    return torch.from_numpy(pixels).permute(2, 0, 1).contiguous()
