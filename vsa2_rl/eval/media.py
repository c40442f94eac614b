"""Saving generated videos for people to look at: a PNG contact sheet (one row per video, one
column per frame), an animated GIF (videos side by side) and, where OpenCV can encode it, the
same as an MP4; image-to-video samples show their condition image before each video."""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

PAD = 2  # white pixels between the frames of the grid
WHITE = 255
CONDITION_GAP = 3 * PAD  # grey pixels between a condition image and its video
GAP_GREY = 128


def _to_uint8(videos: torch.Tensor) -> np.ndarray:
    """[B, T, C, H, W] in [0, 1] -> uint8 [B, T, H, W, 3]."""
    array = (videos.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)
    array = array.permute(0, 1, 3, 4, 2).cpu().numpy()
    if array.shape[-1] == 1:
        array = np.repeat(array, 3, axis=-1)
    return array


def write_mp4(frames: list[np.ndarray], path: str, fps: int) -> bool:
    """``frames`` (uint8 [H, W, 3] RGB) as an MP4 (OpenCV's mp4v encoder); False, and no file,
    where OpenCV is missing or cannot encode MP4."""
    try:
        import cv2
    except ImportError:
        return False
    height, width = frames[0].shape[:2]
    writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))
    if not writer.isOpened():
        return False
    for frame in frames:
        writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
    writer.release()
    if os.path.isfile(path) and os.path.getsize(path) > 0:
        return True
    if os.path.exists(path):
        os.remove(path)
    return False


def condition_images_of(paths: list[str | None], size: tuple[int, int]) -> list | None:
    """The condition images at ``paths`` (None where a prompt has none) at ``size`` (height,
    width), for :func:`save_video_grid`; None when no prompt has one."""
    from vsa2_rl.data.prompts import load_condition_image

    if all(path is None for path in paths):
        return None
    return [None if path is None else load_condition_image(path, *size) for path in paths]


def save_video_grid(
    videos: torch.Tensor,
    path_prefix: str,
    titles: list[str] | None = None,
    scale: int = 4,
    fps: int = 8,
    condition_images: list[torch.Tensor | None] | None = None,
) -> tuple[str, str]:
    """Writes ``path_prefix.png`` (frames grid), ``path_prefix.gif`` and, where OpenCV can
    encode it, ``path_prefix.mp4`` (the GIF's frames); returns the PNG and GIF paths.

    Small toy videos are upscaled ``scale`` times (nearest neighbour) so they stay visible. With
    ``titles`` the prompts are written to ``path_prefix.txt``, one line per row. With
    ``condition_images`` (one [C, h, w] in [0, 1] or None per video; image-to-video) each row of
    the grid starts with its condition image, resized to the frame size, and each video of the
    GIF has it on its left, both set off by a grey gap; a None row gets a blank cell.
    """
    os.makedirs(os.path.dirname(path_prefix) or ".", exist_ok=True)
    frames = _to_uint8(videos)
    cells = None
    if condition_images is not None:
        cells = _condition_cells(condition_images, videos.shape[0], videos.shape[-2:])
    if scale > 1:
        frames = frames.repeat(scale, axis=2).repeat(scale, axis=3)
        cells = None if cells is None else cells.repeat(scale, axis=1).repeat(scale, axis=2)
    png = path_prefix + ".png"
    Image.fromarray(_contact_sheet(frames, cells)).save(png)
    strip = [Image.fromarray(image) for image in _side_by_side_frames(frames, cells)]
    gif = path_prefix + ".gif"
    strip[0].save(gif, save_all=True, append_images=strip[1:], duration=1000 // fps, loop=0)
    write_mp4([np.asarray(frame) for frame in strip], path_prefix + ".mp4", fps)
    if titles:
        with open(path_prefix + ".txt", "w", encoding="utf-8") as handle:
            handle.writelines(title + "\n" for title in titles)
    return png, gif


def _condition_cells(
    images: list[torch.Tensor | None], batch: int, size: tuple[int, int]
) -> np.ndarray:
    """uint8 [B, H, W, 3]: each condition image resized to the frame ``size``; blank for None."""
    if len(images) != batch:
        raise ValueError(
            f"condition_images: expected {batch} (one per video, None where it has none), got "
            f"{len(images)}"
        )
    blank = torch.ones(3, *size)
    resized = [blank if image is None else _resize(image, size) for image in images]
    return _to_uint8(torch.stack(resized)[:, None])[:, 0]


def _resize(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """[C, h, w] (C = 1 or 3) -> [3, *size], bilinear with antialiasing."""
    image = image.detach().float().cpu().expand(3, -1, -1)
    if tuple(image.shape[-2:]) == tuple(size):
        return image
    resized = F.interpolate(image[None], size=tuple(size), mode="bilinear", antialias=True)
    return resized[0].clamp(0, 1)


def _side_by_side(pieces: list[np.ndarray], gap: int, fill: int) -> np.ndarray:
    """Images [H, W_i, 3] left to right with ``gap`` columns of grey level ``fill`` between."""
    spacer = np.full((pieces[0].shape[0], gap, 3), fill, np.uint8)
    joined = [pieces[0]]
    for piece in pieces[1:]:
        joined += [spacer, piece]
    return np.concatenate(joined, axis=1)


def _contact_sheet(frames: np.ndarray, cells: np.ndarray | None) -> np.ndarray:
    """One row per video of its frames, after its condition image where ``cells`` are given."""
    rows = []
    for index, video in enumerate(frames):
        row = _side_by_side(list(video), PAD, WHITE)
        if cells is not None:
            row = _side_by_side([cells[index], row], CONDITION_GAP, GAP_GREY)
        rows.append(row)
    spacer = np.full((PAD, rows[0].shape[1], 3), WHITE, np.uint8)
    stacked = [rows[0]]
    for row in rows[1:]:
        stacked += [spacer, row]
    return np.concatenate(stacked, axis=0)


def _side_by_side_frames(frames: np.ndarray, cells: np.ndarray | None) -> list[np.ndarray]:
    """Per time step, the videos' frames left to right, each after its condition image."""
    strip = []
    for t in range(frames.shape[1]):
        if cells is None:
            pieces = list(frames[:, t])
        else:
            pieces = [
                _side_by_side([cell, frame], CONDITION_GAP, GAP_GREY)
                for cell, frame in zip(cells, frames[:, t], strict=True)
            ]
        strip.append(np.concatenate(pieces, axis=1))
    return strip
