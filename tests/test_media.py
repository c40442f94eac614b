"""Sample grids: PNG contact sheet and GIF, with and without image-to-video condition images."""

import numpy as np
import pytest
import torch
from PIL import Image

from vsa2_rl.eval.media import save_video_grid

BATCH, FRAMES, HEIGHT, WIDTH, SCALE = 2, 3, 6, 8, 2
PAD, GAP, GREY = 2, 6, 128  # white between frames and rows; grey after a condition image


def _palette_image(colors, seed):
    """[3, HEIGHT, WIDTH] whose pixels take the few given 8-bit colours (exact in a GIF)."""
    generator = torch.Generator().manual_seed(seed)
    index = torch.randint(len(colors), (HEIGHT, WIDTH), generator=generator)
    return (torch.tensor(colors, dtype=torch.float32)[index] / 255).permute(2, 0, 1)


def _videos():
    """[BATCH, FRAMES, 3, HEIGHT, WIDTH]: video b, frame t is one flat 8-bit colour."""
    levels = torch.tensor([[[40, 80, 120], [60, 100, 140], [80, 120, 160]],
                           [[200, 30, 30], [180, 50, 50], [160, 70, 70]]]) / 255  # fmt: skip
    return levels[:, :, :, None, None].expand(BATCH, FRAMES, 3, HEIGHT, WIDTH).contiguous()


def _upscaled(image):
    """[3, h, w] in [0, 1] -> uint8 [h * SCALE, w * SCALE, 3], nearest neighbour."""
    pixels = (image.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
    return pixels.repeat(SCALE, axis=0).repeat(SCALE, axis=1)


def _read(path):
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def test_without_condition_images_the_layout_is_frames_only(tmp_path):
    png, gif = save_video_grid(_videos(), str(tmp_path / "grid"), scale=SCALE)
    cell_h, cell_w = HEIGHT * SCALE, WIDTH * SCALE
    sheet = _read(png)
    assert sheet.shape == (BATCH * (cell_h + PAD) - PAD, FRAMES * (cell_w + PAD) - PAD, 3)
    assert _read(gif).shape == (cell_h, BATCH * cell_w, 3)
    second_row_third_frame = sheet[cell_h + PAD :, 2 * (cell_w + PAD) :]
    assert (second_row_third_frame == [160, 70, 70]).all()


def test_condition_images_open_each_row_of_the_sheet(tmp_path):
    conditions = [_palette_image([(255, 0, 0), (0, 0, 255)], seed) for seed in range(BATCH)]
    png, _ = save_video_grid(
        _videos(), str(tmp_path / "grid"), scale=SCALE, condition_images=conditions
    )
    cell_h, cell_w = HEIGHT * SCALE, WIDTH * SCALE
    sheet = _read(png)
    frames_left = cell_w + GAP
    assert sheet.shape == (
        BATCH * (cell_h + PAD) - PAD,
        frames_left + FRAMES * (cell_w + PAD) - PAD,
        3,
    )
    for row, condition in enumerate(conditions):
        top = row * (cell_h + PAD)
        np.testing.assert_array_equal(sheet[top : top + cell_h, :cell_w], _upscaled(condition))
        assert (sheet[top : top + cell_h, cell_w:frames_left] == GREY).all()
    first_video_first_frame = sheet[:cell_h, frames_left : frames_left + cell_w]
    assert (first_video_first_frame == [40, 80, 120]).all()


def test_condition_images_stand_left_of_each_video_in_the_gif(tmp_path):
    conditions = [
        _palette_image([(255, 255, 0), (0, 255, 255), (20, 20, 20)], seed) for seed in (0, 1)
    ]
    _, gif = save_video_grid(
        _videos(), str(tmp_path / "grid"), scale=SCALE, condition_images=conditions
    )
    cell_h, cell_w = HEIGHT * SCALE, WIDTH * SCALE
    first = _read(gif)
    pair = 2 * cell_w + GAP
    assert first.shape == (cell_h, BATCH * pair, 3)
    for index, (condition, color) in enumerate(
        zip(conditions, ([40, 80, 120], [200, 30, 30]), strict=True)
    ):
        left = index * pair
        np.testing.assert_array_equal(first[:, left : left + cell_w], _upscaled(condition))
        assert (first[:, left + cell_w : left + cell_w + GAP] == GREY).all()
        assert (first[:, left + cell_w + GAP : left + pair] == color).all()


def test_condition_images_of_any_size_fill_the_frame_cell_and_none_is_blank(tmp_path):
    orange = torch.tensor([1.0, 0.2, 0.0]).view(3, 1, 1).expand(3, 31, 17)  # another shape
    png, gif = save_video_grid(
        _videos(), str(tmp_path / "grid"), scale=SCALE, condition_images=[orange, None]
    )
    cell_h, cell_w = HEIGHT * SCALE, WIDTH * SCALE
    sheet = _read(png)
    assert (sheet[:cell_h, :cell_w] == [255, 51, 0]).all()
    assert (sheet[cell_h + PAD :, :cell_w] == 255).all()  # blank
    assert _read(gif).shape == (cell_h, BATCH * (2 * cell_w + GAP), 3)


def test_mp4_frames_match_the_gif_layout(tmp_path):
    cv2 = pytest.importorskip("cv2")
    conditions = [torch.rand(3, HEIGHT, WIDTH), None]
    save_video_grid(_videos(), str(tmp_path / "grid"), scale=SCALE, condition_images=conditions)
    capture = cv2.VideoCapture(str(tmp_path / "grid.mp4"))
    frames = []
    while (frame := capture.read())[0]:
        frames.append(frame[1])
    assert len(frames) == FRAMES
    assert frames[0].shape == (HEIGHT * SCALE, BATCH * (2 * WIDTH * SCALE + GAP), 3)


def test_one_condition_entry_per_video_is_required(tmp_path):
    with pytest.raises(ValueError, match=r"condition_images: expected 2 .* got 1"):
        save_video_grid(_videos(), str(tmp_path / "grid"), condition_images=[None])
