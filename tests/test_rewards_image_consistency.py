"""The image_consistency reward: SSIM of a video's first frames to its condition image."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from vsa2_rl.rewards import Reward, RewardError, get_reward
from vsa2_rl.rewards.image_consistency import image_consistency, ssim

SIZE = 32
C1, C2 = 0.01**2, 0.03**2  # Wang et al.'s constants for data range 1


def _texture(seed: int = 0) -> torch.Tensor:
    """A smooth random colour texture [3, SIZE, SIZE] (8x8 noise, bicubic upsampled) on the
    8-bit grid, so that it survives a PNG."""
    generator = torch.Generator().manual_seed(seed)
    noise = torch.rand(1, 3, 8, 8, generator=generator)
    smooth = F.interpolate(noise, size=(SIZE, SIZE), mode="bicubic").clamp(0, 1)[0]
    return (smooth * 255).round() / 255


def _save(path, image: torch.Tensor) -> str:
    pixels = (image.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
    Image.fromarray(pixels).save(path)
    return str(path)


def _video(*frames: torch.Tensor) -> torch.Tensor:
    """One video [1, T, 3, H, W] of the given frames."""
    return torch.stack(frames)[None]


def _blur(image: torch.Tensor) -> torch.Tensor:
    """3x3 box blur, edges replicated."""
    padded = F.pad(image[None], (1, 1, 1, 1), mode="replicate")
    return F.avg_pool2d(padded, 3, stride=1)[0]


@pytest.fixture
def condition(tmp_path):
    image = _texture()
    return image, _save(tmp_path / "condition.png", image)


def test_frames_equal_to_the_image_score_one(condition):
    image, path = condition
    videos = image.expand(2, 6, 3, SIZE, SIZE)
    score = image_consistency()(videos, ["a", "b"], [{"image": path}] * 2)
    torch.testing.assert_close(score, torch.ones(2), atol=1e-5, rtol=0)


@pytest.mark.parametrize(("a", "b"), [(0.5, 0.5), (0.2, 0.6), (0.9, 0.1), (0.0, 1.0), (0.0, 0.04)])
def test_ssim_of_constant_images_is_the_luminance_term(a, b):
    closed_form = (2 * a * b + C1) / (a**2 + b**2 + C1)  # no variance: structure term is 1
    first = torch.full((1, 1, 16, 20), a)
    second = torch.full((1, 1, 16, 20), b)
    torch.testing.assert_close(ssim(first, second), torch.tensor([closed_form]), atol=1e-5, rtol=0)


def test_a_constant_video_against_a_constant_image_through_the_reward(tmp_path):
    a, b = 51 / 255, 0.7
    path = _save(tmp_path / "grey.png", torch.full((3, SIZE, SIZE), a))
    videos = torch.full((1, 4, 3, SIZE, SIZE), b)
    closed_form = (2 * a * b + C1) / (a**2 + b**2 + C1)
    score = get_reward("image_consistency")(videos, ["p"], [{"image": path}])
    torch.testing.assert_close(score, torch.tensor([closed_form]), atol=1e-5, rtol=0)


def test_noise_scores_far_below_a_mildly_blurred_copy(condition):
    image, path = condition
    blurred = _video(*[_blur(image)] * 4)
    noise = torch.rand(1, 4, 3, SIZE, SIZE)
    reward = get_reward("image_consistency")
    scores = reward(torch.cat([blurred, noise]), ["p", "p"], [{"image": path}] * 2)
    assert scores[0] > 0.9 and scores[1] < 0.1


def test_videos_that_drift_away_faster_score_lower(condition):
    image, path = condition
    # frame k is the image moved k * speed pixels right and down
    videos = torch.cat(
        [
            _video(*[torch.roll(image, (k * speed, k * speed), dims=(1, 2)) for k in range(4)])
            for speed in range(4)
        ]
    )
    scores = get_reward("image_consistency")(videos, ["p"] * 4, [{"image": path}] * 4)
    assert scores[0] == pytest.approx(1.0, abs=1e-5)
    assert (scores.diff() < 0).all(), scores


def test_only_the_first_num_frames_count(condition):
    image, path = condition
    noise = torch.rand(3, SIZE, SIZE)
    video = _video(image, image, noise, noise)
    first_two = image_consistency(num_frames=2)(video, ["p"], [{"image": path}])
    all_four = image_consistency(num_frames=4)(video, ["p"], [{"image": path}])
    clipped = image_consistency(num_frames=100)(video, ["p"], [{"image": path}])
    noise_alone = image_consistency(num_frames=1)(_video(noise, noise), ["p"], [{"image": path}])
    torch.testing.assert_close(first_two, torch.ones(1), atol=1e-5, rtol=0)
    torch.testing.assert_close(all_four, (2 + 2 * noise_alone) / 4)
    torch.testing.assert_close(clipped, all_four)


def test_images_of_another_size_are_resized_to_the_video(tmp_path):
    big = F.interpolate(_texture()[None], scale_factor=2, mode="nearest")[0]
    path = _save(tmp_path / "big.png", big)
    close = image_consistency()(_video(_texture(), _texture()), ["p"], [{"image": path}])
    unrelated = image_consistency()(_video(_texture(1), _texture(1)), ["p"], [{"image": path}])
    assert close > 0.9 and unrelated < 0.5


def test_grey_videos_are_scored_on_luma(condition):
    image, path = condition
    luma = (torch.tensor([0.299, 0.587, 0.114]).view(3, 1, 1) * image).sum(0, keepdim=True)
    score = get_reward("image_consistency")(
        luma.expand(1, 3, 1, SIZE, SIZE), ["p"], [{"image": path}]
    )
    torch.testing.assert_close(score, torch.ones(1), atol=1e-5, rtol=0)


def test_each_image_is_read_once_per_size(condition, tmp_path):
    image, path = condition
    reward = image_consistency()
    videos = image.expand(1, 2, 3, SIZE, SIZE)
    first = reward(videos, ["p"], [{"image": path}])
    (tmp_path / "condition.png").unlink()
    torch.testing.assert_close(reward(videos, ["p"], [{"image": path}]), first)


def test_a_sample_without_an_image_is_named():
    videos = torch.rand(2, 3, 3, SIZE, SIZE)
    message = (
        "image_consistency: metadata['image'] is missing for sample 1: use an image-to-video "
        'prompt file (.jsonl with an "image" per prompt)'
    )
    with pytest.raises(ValueError) as error:
        image_consistency()(videos, ["a", "b"], [{"image": "x.png"}, {"prompt_index": 1}])
    assert str(error.value) == message
    reward = get_reward("image_consistency")
    assert isinstance(reward, Reward) and reward.name == "image_consistency"
    with pytest.raises(RewardError, match=r"reward 'image_consistency': .*sample 0: use an image"):
        reward(videos, ["a", "b"])


def test_through_the_registry_and_the_reward_wrapper(condition):
    image, path = condition
    reward = get_reward("image_consistency", num_frames=2)
    videos = torch.stack([image.expand(3, 3, SIZE, SIZE), torch.rand(3, 3, SIZE, SIZE)])
    scores = reward(videos, ["a", "b"], [{"image": path}, {"image": path}])
    assert scores.dtype == torch.float32 and scores.shape == (2,)
    assert scores[0] == pytest.approx(1.0, abs=1e-5) and scores[1] < 0.5
    with pytest.raises(ValueError, match=r"kwargs\.num_frames: must be >= 1"):
        get_reward("image_consistency", num_frames=0)


def test_frames_smaller_than_the_window_are_refused():
    with pytest.raises(ValueError, match="at least 11x11 pixels, got 8x16"):
        ssim(torch.rand(1, 1, 8, 16), torch.rand(1, 1, 8, 16))


def test_independent_images_score_near_zero():
    noise = torch.from_numpy(np.random.default_rng(0).random((2, 1, 64, 64), dtype=np.float32))
    assert ssim(noise[:1], noise[1:]).abs() < 0.05
