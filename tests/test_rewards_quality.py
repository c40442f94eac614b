"""Aesthetic (open_clip + LAION MLP) and weight-free image-quality rewards."""

import json

import pytest
import torch
import torch.nn.functional as F

from vsa2_rl.rewards import get_reward
from vsa2_rl.rewards.aesthetic import AestheticMLP, load_aesthetic_mlp
from vsa2_rl.rewards.image_quality import (
    NOISE_SCALE,
    colorfulness,
    exposure,
    noise_level,
    sharpness,
)

# A tiny open_clip architecture (random weights): 32x32 images, 16-d embeddings.
TINY_CLIP = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
    # the text tower takes the ids of open_clip's bundled BPE tokenizer (49408 tokens)
    "text_cfg": {"context_length": 8, "vocab_size": 49408, "width": 16, "heads": 2, "layers": 1},
}
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)


@pytest.fixture
def tiny_clip_files(tmp_path):
    """(config json, open_clip checkpoint, predictor state dict) of random tiny models."""
    import open_clip

    config = tmp_path / "tiny-vsa2-test-clip.json"
    config.write_text(json.dumps(TINY_CLIP))
    open_clip.add_model_config(str(config))
    model = open_clip.create_model("tiny-vsa2-test-clip").eval()
    clip_path = tmp_path / "clip.pt"
    torch.save(model.state_dict(), clip_path)
    mlp = AestheticMLP(16)
    for layer in mlp.layers:  # non-trivial weights so that every layer matters
        if isinstance(layer, torch.nn.Linear):
            torch.nn.init.normal_(layer.weight, std=0.5)
            torch.nn.init.normal_(layer.bias, std=0.5)
    predictor_path = tmp_path / "mlp.pt"
    torch.save(mlp.state_dict(), predictor_path)
    return str(config), str(clip_path), str(predictor_path), model


def _mlp_float64(state, x):
    """The aesthetic head from its state dict in float64: five affine maps, no activations."""
    for index in (0, 2, 4, 6, 7):
        x = x @ state[f"layers.{index}.weight"].double().T + state[f"layers.{index}.bias"].double()
    return x.squeeze(-1)


def test_aesthetic_matches_reference(tiny_clip_files):
    config, clip_path, predictor_path, model = tiny_clip_files
    reward = get_reward(
        "aesthetic",
        clip_path=clip_path,
        predictor_path=predictor_path,
        clip_model=config,
        num_frames=2,
    )
    videos = torch.rand(2, 3, 3, 32, 32)  # already at the model's size: no resize
    values = reward(videos, ["a", "b"])
    # Reference: open_clip's own encode_image on frames 0 and 2 (2 evenly spaced of 3).
    frames = videos[:, [0, 2]].flatten(0, 1)
    mean, std = (
        torch.tensor(OPENAI_MEAN).view(1, 3, 1, 1),
        torch.tensor(OPENAI_STD).view(1, 3, 1, 1),
    )
    with torch.no_grad():
        embeddings = model.encode_image((frames - mean) / std, normalize=True)
    state = torch.load(predictor_path, weights_only=True)
    expected = _mlp_float64(state, embeddings.double()).view(2, 2).mean(dim=1)
    assert values.dtype == torch.float32
    torch.testing.assert_close(values.double(), expected, rtol=1e-4, atol=1e-4)


def test_aesthetic_resizes_other_resolutions(tiny_clip_files):
    config, clip_path, predictor_path, _ = tiny_clip_files
    reward = get_reward(
        "aesthetic", clip_path=clip_path, predictor_path=predictor_path, clip_model=config
    )
    values = reward(torch.rand(2, 5, 1, 40, 56), ["a", "b"])  # grey, non-square
    assert values.shape == (2,) and torch.isfinite(values).all()


def test_aesthetic_mlp_loads_from_state_dict(tmp_path):
    mlp = AestheticMLP(24)
    path = tmp_path / "mlp.pt"
    torch.save(mlp.state_dict(), path)
    loaded = load_aesthetic_mlp(str(path))
    assert loaded.input_dim == 24 and not loaded.training
    for key, value in mlp.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value)
    torch.save({"weight": torch.zeros(1)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match=r"predictor_path: .* is not an aesthetic-predictor"):
        load_aesthetic_mlp(str(tmp_path / "other.pt"))


def test_aesthetic_missing_files_fail_at_construction(tiny_clip_files, tmp_path):
    config, clip_path, predictor_path, _ = tiny_clip_files
    missing = str(tmp_path / "missing.pth")
    with pytest.raises(ValueError, match=r"kwargs.predictor_path: file not found: .*missing"):
        get_reward("aesthetic", clip_path=clip_path, predictor_path=missing, clip_model=config)
    with pytest.raises(ValueError, match=r"kwargs.clip_path: file not found: .*missing"):
        get_reward("aesthetic", clip_path=missing, predictor_path=predictor_path, clip_model=config)
    with pytest.raises(ValueError, match=r"kwargs.clip_path: required"):
        get_reward("aesthetic", predictor_path=predictor_path)
    with pytest.raises(ValueError, match=r"kwargs.clip_model: unknown open_clip config"):
        get_reward(
            "aesthetic", clip_path=clip_path, predictor_path=predictor_path, clip_model="ViT-Q-99"
        )
    wider = tmp_path / "tiny-vsa2-test-clip-wider.json"
    wider.write_text(json.dumps({**TINY_CLIP, "embed_dim": 24}))
    with pytest.raises(
        ValueError,
        match=r"kwargs.clip_path: .*clip.pt is not a checkpoint of the "
        r"'tiny-vsa2-test-clip-wider' architecture \(kwargs.clip_model\)",
    ):
        get_reward(
            "aesthetic", clip_path=clip_path, predictor_path=predictor_path, clip_model=str(wider)
        )
    wide = tmp_path / "wide.pt"
    torch.save(AestheticMLP(32).state_dict(), wide)
    with pytest.raises(ValueError, match=r"predictor expects 32-d embeddings .* gives 16-d"):
        get_reward("aesthetic", clip_path=clip_path, predictor_path=str(wide), clip_model=config)


def test_colorfulness_hand_computed():
    # Left half pure red (255, 0, 0), right half pure green (0, 255, 0).
    frame = torch.zeros(1, 3, 4, 4)
    frame[0, 0, :, :2] = 1.0
    frame[0, 1, :, 2:] = 1.0
    # rg = +-255 (mean 0, std 255); yb = 127.5 everywhere (mean 127.5, std 0).
    expected = (255.0 + 0.3 * 127.5) / 109.0
    assert colorfulness(frame).item() == pytest.approx(min(expected, 1.0))
    half = frame * 0.2  # rg = +-51, yb = 25.5
    assert colorfulness(half).item() == pytest.approx((51.0 + 0.3 * 25.5) / 109.0, rel=1e-5)
    assert colorfulness(torch.full((1, 3, 4, 4), 0.5)).item() == 0.0


def test_exposure_and_sharpness_terms():
    grey = torch.full((1, 3, 8, 8), 0.5)
    assert exposure(grey).item() == pytest.approx(1.0)
    assert exposure(torch.zeros(1, 3, 8, 8)).item() == 0.0
    assert exposure(torch.full((1, 3, 8, 8), 0.75)).item() == pytest.approx(0.5)
    assert sharpness(grey).item() == 0.0
    checker = (torch.arange(16).view(1, 16) + torch.arange(16).view(16, 1)) % 2
    checker = checker.float().view(1, 1, 16, 16).expand(1, 3, 16, 16)
    # Laplacian of a 0/1 checkerboard is +-4 everywhere: variance 16.
    assert sharpness(checker).item() == pytest.approx(16.0 / (16.0 + 100.0 / 255.0**2))
    blurred = F.avg_pool2d(checker, 3, 1, 1, count_include_pad=False)
    assert sharpness(blurred) < sharpness(checker)


def test_image_quality_is_weighted_mean_of_terms():
    videos = torch.rand(2, 3, 3, 16, 16)
    reward = get_reward(
        "image_quality",
        num_frames=8,
        sharpness_weight=1.0,
        colorfulness_weight=2.0,
        exposure_weight=0.0,
    )
    values = reward(videos, ["a", "b"])
    flat = videos.flatten(0, 1)
    per_frame = (sharpness(flat) + 2.0 * colorfulness(flat)) / 3.0
    per_frame = per_frame * torch.exp(-noise_level(flat) / NOISE_SCALE)
    torch.testing.assert_close(values, per_frame.view(2, 3).mean(dim=1))
    with pytest.raises(ValueError, match=r"kwargs.num_frames: must be >= 1"):
        get_reward("image_quality", num_frames=0)


def test_noise_level_estimates_gaussian_sigma():
    generator = torch.Generator().manual_seed(0)
    grey = torch.full((4, 3, 64, 64), 0.5)
    for sigma in (0.01, 0.05, 0.1):
        noisy = grey + sigma * torch.randn(4, 1, 64, 64, generator=generator)  # same in R, G, B
        estimate = noise_level(noisy)
        assert torch.allclose(estimate, torch.full((4,), sigma), rtol=0.1)
    # piecewise-constant and linear-ramp frames carry no noise: the mask is blind to them
    ramp = torch.linspace(0, 1, 64).view(1, 1, 1, 64).expand(1, 3, 64, 64)
    square = torch.zeros(1, 3, 64, 64)
    square[..., 20:40, 20:40] = 1.0
    assert noise_level(ramp).item() < 1e-6 and noise_level(square).item() < 1e-6


def _blur(videos, kernel=5, sigma=1.0):
    import torchvision.transforms.functional as TF

    return TF.gaussian_blur(videos.flatten(0, 1), kernel, sigma).view_as(videos).clamp(0, 1)


def test_image_quality_prefers_clean_frames_to_noisy_and_blurred_ones():
    from vsa2_rl.toy.data import random_specs, render_batch

    generator = torch.Generator().manual_seed(1)
    shapes = render_batch(random_specs(8, generator), list(range(8)), 4, 32, 32)
    # a smooth random field (structure at several pixels, like natural images; fine texture at
    # the pixel scale reads partly as noise to the gate: the measure's documented limit)
    texture = _blur(torch.rand(8, 4, 3, 64, 64, generator=generator), kernel=9, sigma=3.0)
    texture = (texture - texture.amin()) / (texture.amax() - texture.amin())
    reward = get_reward("image_quality")
    for clean in (shapes, texture):
        noisy = (clean + 0.1 * torch.randn(clean.shape, generator=generator)).clamp(0, 1)
        score = reward(clean, ["p"] * 8)
        assert bool((score > reward(noisy, ["p"] * 8)).all())
        assert bool((score > reward(_blur(clean), ["p"] * 8)).all())
    assert reward(torch.rand(4, 2, 3, 32, 32, generator=generator), ["p"] * 4).max() < 0.01


def test_clip_scores_are_the_frames_mean_cosine_with_the_prompt(tiny_clip_files):
    import open_clip

    config, clip_path, _, model = tiny_clip_files
    reward = get_reward("clip_score", clip_path=clip_path, clip_model=config, num_frames=2)
    videos = torch.rand(2, 3, 3, 32, 32)
    prompts = ["a red square", "a blue circle moving left"]
    values = reward(videos, prompts, [{}, {}])
    # reference: open_clip's own encoders on frames 0 and 2, its own tokenizer
    mean, std = (
        torch.tensor(OPENAI_MEAN).view(1, 3, 1, 1),
        torch.tensor(OPENAI_STD).view(1, 3, 1, 1),
    )
    with torch.no_grad():
        images = model.encode_image((videos[:, [0, 2]].flatten(0, 1) - mean) / std, normalize=True)
        tokens = open_clip.get_tokenizer("tiny-vsa2-test-clip")(prompts)
        texts = model.encode_text(tokens, normalize=True)
    expected = (images.view(2, 2, -1).double() * texts[:, None].double()).sum(-1).mean(1)
    torch.testing.assert_close(values.double(), expected, rtol=1e-4, atol=1e-5)
    for name, scale in (("pickscore", model.logit_scale.exp().item()), ("hpsv2", 1.0)):
        preference = get_reward(name, clip_path=clip_path, clip_model=config, num_frames=2)
        scored = preference(videos, prompts, [{}, {}]).double()
        torch.testing.assert_close(scored, scale * expected, rtol=1e-4, atol=1e-5)
    swapped = reward(videos, prompts[::-1], [{}, {}])  # the prompt matters
    assert not torch.allclose(swapped, values)
    with pytest.raises(ValueError, match=r"kwargs\.clip_path: required"):
        get_reward("clip_score", clip_model=config)


def _vbench_consistency(features):
    """VBench's formula in float64 on features [B, K, E], frame by frame."""
    f = F.normalize(features.double(), dim=-1)
    terms = [(f[:, k] * (f[:, 0] + f[:, k - 1])).sum(-1) / 2 for k in range(1, f.shape[1])]
    return sum(terms) / len(terms)


def test_subject_consistency_uses_dino_cls_features_and_is_one_for_a_static_video(tmp_path):
    from transformers import Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    config = Dinov2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                          intermediate_size=64, image_size=32, patch_size=8)  # fmt: skip
    model = Dinov2Model(config).eval()
    model.save_pretrained(tmp_path / "dino")
    reward = get_reward("subject_consistency", dino_path=str(tmp_path / "dino"), num_frames=4)
    videos = torch.rand(2, 4, 3, 32, 32)  # at the model's size: no resize
    values = reward(videos, ["a", "b"], [{}, {}])
    mean, std = torch.tensor((0.485, 0.456, 0.406)), torch.tensor((0.229, 0.224, 0.225))
    pixels = (videos.flatten(0, 1) - mean.view(1, 3, 1, 1)) / std.view(1, 3, 1, 1)
    with torch.no_grad():
        cls = model(pixel_values=pixels).last_hidden_state[:, 0].view(2, 4, -1)
    torch.testing.assert_close(values.double(), _vbench_consistency(cls), rtol=1e-5, atol=1e-6)
    static = videos[:, :1].expand(-1, 4, -1, -1, -1)
    torch.testing.assert_close(reward(static, ["a", "b"], [{}, {}]), torch.ones(2))
    with pytest.raises(Exception, match=r"at least 2 frames"):
        reward(videos[:, :1], ["a", "b"], [{}, {}])
    with pytest.raises(ValueError, match=r"kwargs\.dino_path: folder not found"):
        get_reward("subject_consistency", dino_path=str(tmp_path / "nowhere"))


def test_background_consistency_uses_clip_image_features(tiny_clip_files):
    config, clip_path, _, model = tiny_clip_files
    reward = get_reward("background_consistency", clip_path=clip_path, clip_model=config)
    videos = torch.rand(2, 3, 3, 32, 32)
    mean, std = (
        torch.tensor(OPENAI_MEAN).view(1, 3, 1, 1),
        torch.tensor(OPENAI_STD).view(1, 3, 1, 1),
    )
    with torch.no_grad():
        features = model.encode_image((videos.flatten(0, 1) - mean) / std).view(2, 3, -1)
    values = reward(videos, ["a", "b"], [{}, {}])
    torch.testing.assert_close(values.double(), _vbench_consistency(features), rtol=1e-4, atol=1e-5)
