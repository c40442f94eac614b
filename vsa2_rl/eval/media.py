"""Saving generated videos for people to look at: a PNG contact sheet (one row per video, one
column per frame), an animated GIF (videos side by side) and, where OpenCV can encode it, the
same as an MP4."""

from __future__ import annotations

import os

import numpy as np
import torch
from PIL import Image


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


def save_video_grid(
    videos: torch.Tensor,
    path_prefix: str,
    titles: list[str] | None = None,
    scale: int = 4,
    fps: int = 8,
) -> tuple[str, str]:
    """Writes ``path_prefix.png`` (frames grid), ``path_prefix.gif`` and, where OpenCV can
    encode it, ``path_prefix.mp4`` (the GIF's frames); returns the PNG and GIF paths.

    Small toy videos are upscaled ``scale`` times (nearest neighbour) so they stay visible. With
    ``titles`` the prompts are written to ``path_prefix.txt``, one line per row.
    """
    os.makedirs(os.path.dirname(path_prefix) or ".", exist_ok=True)
    frames = _to_uint8(videos)
    if scale > 1:
        frames = frames.repeat(scale, axis=2).repeat(scale, axis=3)
    batch, num_frames, height, width, _ = frames.shape
    pad = 2
    sheet = np.full(
        (batch * (height + pad) - pad, num_frames * (width + pad) - pad, 3), 255, np.uint8
    )
    for b in range(batch):
        for t in range(num_frames):
            y, x = b * (height + pad), t * (width + pad)
            sheet[y : y + height, x : x + width] = frames[b, t]
    png = path_prefix + ".png"
    Image.fromarray(sheet).save(png)
    strip = [Image.fromarray(np.concatenate(list(frames[:, t]), axis=1)) for t in range(num_frames)]
    gif = path_prefix + ".gif"
    strip[0].save(gif, save_all=True, append_images=strip[1:], duration=1000 // fps, loop=0)
    write_mp4([np.asarray(frame) for frame in strip], path_prefix + ".mp4", fps)
    if titles:
        with open(path_prefix + ".txt", "w", encoding="utf-8") as handle:
            handle.writelines(title + "\n" for title in titles)
    return png, gif
