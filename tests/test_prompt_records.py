"""Prompt files with condition images (JSON Lines), plain prompt files, and condition images."""

import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from vsa2_rl.config import ConfigError, load_config
from vsa2_rl.data.prompts import PromptRecord, load_condition_image, read_prompt_records
from vsa2_rl.runtime import load_prompt_records, load_prompts, read_prompt_file
from vsa2_rl.toy.prompts import toy_prompts

KEY = "prompts.file"
RED, BLUE = (255, 0, 0), (0, 0, 255)


def _png(path, pixels):
    """Writes uint8 pixels [H, W, 3] (or [H, W]) as a PNG; returns the path as a string."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(np.asarray(pixels, dtype=np.uint8)).save(path)
    return str(path)


def _jsonl(path, *lines):
    """Writes the given lines (dicts as JSON, strings as they are) to a .jsonl file."""
    text = "".join((json.dumps(line) if isinstance(line, dict) else line) + "\n" for line in lines)
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.fixture
def picture(tmp_path):
    return _png(tmp_path / "good.png", np.full((4, 4, 3), 200))


def test_plain_text_files_read_as_before(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("  a red ball  \n\n\ta blue cube\n   \nlast line", encoding="utf-8")
    assert read_prompt_records(str(path), KEY) == [
        PromptRecord("a red ball"),
        PromptRecord("a blue cube"),
        PromptRecord("last line"),
    ]
    assert read_prompt_file(str(path), KEY) == ["a red ball", "a blue cube", "last line"]


@pytest.mark.parametrize("name", ["prompts.txt", "prompts.jsonl"])
def test_a_file_without_prompts_names_the_key_and_file(tmp_path, name):
    (tmp_path / name).write_text("\n   \n", encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"^{KEY}: prompt file .*{name} has no prompts"):
        read_prompt_records(str(tmp_path / name), KEY)


@pytest.mark.parametrize("name", ["prompts.txt", "prompts.jsonl"])
def test_a_file_that_is_not_utf8_names_the_key_and_the_fix(tmp_path, name):
    (tmp_path / name).write_bytes('{"prompt": "a caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(ConfigError) as error:
        read_prompt_records(str(tmp_path / name), "prompts.eval_file")
    message = str(error.value)
    assert message.startswith(f"prompts.eval_file: {tmp_path / name} is not UTF-8 text")
    assert message.endswith("save it as UTF-8")


def test_jsonl_images_resolve_against_the_files_folder(tmp_path, monkeypatch):
    folder = tmp_path / "set"
    inside = _png(folder / "images" / "a.png", np.zeros((4, 4, 3)))
    beside = _png(tmp_path / "b.png", np.zeros((4, 4, 3)))
    elsewhere = _png(tmp_path / "other" / "c.png", np.zeros((4, 4, 3)))
    path = _jsonl(
        folder / "prompts.jsonl",
        {"prompt": " a red ball ", "image": "images/a.png"},
        "",
        {"image": "../b.png", "prompt": "a blue cube"},
        {"prompt": "a cat", "image": elsewhere},
    )
    monkeypatch.chdir(tmp_path / "other")  # not the file's folder
    records = read_prompt_records(os.path.relpath(path), KEY)
    assert records == [
        PromptRecord("a red ball", inside),
        PromptRecord("a blue cube", beside),
        PromptRecord("a cat", elsewhere),
    ]
    assert all(os.path.isabs(record.image) for record in records)
    assert read_prompt_file(path, KEY) == ["a red ball", "a blue cube", "a cat"]


def test_jsonl_records_may_all_go_without_an_image(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", {"prompt": "one"}, {"prompt": "two"})
    assert read_prompt_records(path, KEY) == [PromptRecord("one"), PromptRecord("two")]


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"prompt": "a red ball", ', "not valid JSON (Expecting property name enclosed in"),
        ('{"prompt": "a red ball", ', "at column 25)"),  # just past the 24 characters
        ('["a red ball"]', 'expected a JSON object {"prompt": ..., "image": ...}, got an array'),
        ('"a red ball"', "got a string"),
        ({"image": "good.png"}, '"prompt" must be a non-empty string; it is missing'),
        ({"prompt": 3, "image": "good.png"}, '"prompt" must be a non-empty string; got 3'),
        ({"prompt": "   ", "image": "good.png"}, '"prompt" must be a non-empty string; got "   "'),
        (
            {"prompt": "x", "img": "good.png", "seed": 1},
            'unknown key(s) "img", "seed"; allowed: "prompt", "image"',
        ),
        ({"prompt": "x", "image": 5}, '"image" must be a non-empty string'),
        ({"prompt": "x", "image": None}, '"image" must be a non-empty string'),
        ({"prompt": "x", "image": "missing.png"}, "image file not found: {folder}/missing.png"),
        ({"prompt": "x", "image": "fake.png"}, "image {folder}/fake.png cannot be read"),
        ({"prompt": "x"}, "every record or none carries an image; line 1 carries"),
    ],
)
def test_jsonl_errors_name_the_key_file_and_line(tmp_path, picture, line, expected):
    (tmp_path / "fake.png").write_text("not a picture")
    path = _jsonl(tmp_path / "prompts.jsonl", {"prompt": "fine", "image": "good.png"}, "", line)
    with pytest.raises(ConfigError) as error:
        read_prompt_records(path, "prompts.eval_file")
    message = str(error.value)
    assert message.startswith(f"prompts.eval_file: {path} line 3: ")
    assert expected.replace("{folder}", str(tmp_path)) in message
    assert "\n" not in message


def test_mixing_names_the_first_line_that_differs(tmp_path, picture):
    path = _jsonl(
        tmp_path / "prompts.jsonl",
        {"prompt": "no image"},
        {"prompt": "no image either"},
        {"prompt": "with image", "image": "good.png"},
        {"prompt": "no image again"},
    )
    with pytest.raises(ConfigError) as error:
        read_prompt_records(path, KEY)
    assert str(error.value).startswith(f"{KEY}: {path} line 3: every record or none carries")
    assert "line 1 does not carry an image" in str(error.value)


def test_load_prompt_records_follows_the_split_rules(tmp_path, picture):
    train = _jsonl(tmp_path / "train.jsonl", {"prompt": "a", "image": "good.png"})
    evaluation = _jsonl(tmp_path / "eval.jsonl", {"prompt": "b"})
    both = load_config(None, [f"prompts.file={train}", f"prompts.eval_file={evaluation}"])
    assert load_prompt_records(both, "train") == [PromptRecord("a", picture)]
    assert load_prompt_records(both, "eval") == [PromptRecord("b")]
    assert load_prompts(both, "train") == ["a"]
    train_only = load_config(None, [f"prompts.file={train}"])
    assert load_prompt_records(train_only, "eval") == [PromptRecord("a", picture)]
    toy = load_config(None, [])
    for split in ("train", "eval"):
        assert load_prompt_records(toy, split) == [PromptRecord(p) for p in toy_prompts(split)]


def test_condition_image_is_resized_straight_to_height_by_width(tmp_path):
    # 32 x 32: left half red, right half blue. Shrunk 4x in width (Lanczos reaches 12 source
    # pixels each side): output column 0 only sees red, column 7 only blue, between a blend.
    pixels = np.zeros((32, 32, 3))
    pixels[:, :16], pixels[:, 16:] = RED, BLUE
    image = load_condition_image(_png(tmp_path / "two.png", pixels), height=6, width=8)
    assert image.dtype == torch.float32 and image.shape == (3, 6, 8)
    red, blue = torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 0.0, 1.0])
    torch.testing.assert_close(image[:, :, :1], red.view(3, 1, 1).expand(3, 6, 1), atol=1 / 255,
                               rtol=0)  # fmt: skip
    torch.testing.assert_close(image[:, :, 7:], blue.view(3, 1, 1).expand(3, 6, 1), atol=1 / 255,
                               rtol=0)  # fmt: skip
    assert image[0, :, 2].mean() > image[0, :, 5].mean()  # red fades out from left to right
    assert image.min() >= 0 and image.max() <= 1


def test_condition_image_is_what_the_wan_pipeline_feeds_its_vae(tmp_path):
    from diffusers.video_processor import VideoProcessor

    generator = np.random.default_rng(0)
    path = _png(tmp_path / "noise.png", generator.integers(0, 256, (30, 50, 3)))
    ours = load_condition_image(path, height=16, width=32)
    with Image.open(path) as handle:
        theirs = VideoProcessor(vae_scale_factor=8).preprocess(handle, height=16, width=32)
    torch.testing.assert_close(ours * 2 - 1, theirs[0].float(), atol=1e-6, rtol=0)


def test_grey_condition_images_become_rgb(tmp_path):
    path = _png(tmp_path / "grey.png", np.full((5, 7), 51))
    image = load_condition_image(path, height=5, width=7)
    torch.testing.assert_close(image, torch.full((3, 5, 7), 0.2))


def test_condition_images_that_cannot_be_opened_name_the_path(tmp_path):
    (tmp_path / "fake.png").write_text("not a picture")
    for path in (str(tmp_path / "fake.png"), str(tmp_path / "missing.png")):
        with pytest.raises(ValueError, match=f"condition image {path}: cannot be opened"):
            load_condition_image(path, 8, 8)


@pytest.mark.parametrize(
    ("name", "text"),
    [("prompts.txt", "a red ball\na blue cube\n"), ("prompts.jsonl", '{"prompt": "a red ball"}\n')],
)
def test_a_byte_order_mark_is_not_part_of_the_first_prompt(tmp_path, name, text):
    (tmp_path / name).write_text("\ufeff" + text, encoding="utf-8")  # as Notepad saves UTF-8
    assert read_prompt_records(str(tmp_path / name), KEY)[0] == PromptRecord("a red ball")


def _corrupt_pixels(path):
    """Rewrites the PNG's pixel data (IDAT) with bytes that do not inflate, and a CRC that
    matches them: the file's checksums all hold, its pixels do not decode."""
    import struct
    import zlib

    with open(path, "rb") as handle:
        data = handle.read()
    at = data.index(b"IDAT") - 4
    length = struct.unpack(">I", data[at : at + 4])[0]
    garbage = b"\x78\x9c" + bytes(i % 251 for i in range(7, 5 + length))
    chunk = b"IDAT" + garbage
    fixed = struct.pack(">I", len(garbage)) + chunk + struct.pack(">I", zlib.crc32(chunk))
    with open(path, "wb") as handle:
        handle.write(data[:at] + fixed + data[at + 12 + length :])
    with Image.open(path) as image:
        image.verify()  # what the old check did: it passes


def test_a_condition_image_whose_pixels_do_not_decode_is_refused_at_start(tmp_path):
    picture = _png(tmp_path / "bad.png", np.random.default_rng(0).integers(0, 255, (16, 16, 3)))
    _corrupt_pixels(picture)
    path = _jsonl(tmp_path / "prompts.jsonl", {"prompt": "x", "image": "bad.png"})
    with pytest.raises(ConfigError, match=rf"line 1: image {picture} cannot be read as an image"):
        read_prompt_records(path, KEY)


def test_a_condition_image_under_the_home_folder_may_be_given_with_a_tilde(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    picture = _png(tmp_path / "home" / "pictures" / "a.png", np.full((4, 4, 3), 9))
    path = _jsonl(tmp_path / "prompts.jsonl", {"prompt": "x", "image": "~/pictures/a.png"})
    assert read_prompt_records(path, KEY) == [PromptRecord("x", picture)]
