"""Wan2.1 I2V, Wan2.2 A14B (two experts, T2V and I2V) and Wan2.2 TI2V-5B on tiny random folders:
sampling equals diffusers' own pipelines, the experts route by noise level, and RL trains,
checkpoints, resumes and exports only the experts ``model.train_experts`` names."""

import json
import os
import sys

import pytest
import torch

from vsa2_rl.config import ConfigError, VSA2Config, load_config
from vsa2_rl.models.conditioning import encode_condition, final_latents
from vsa2_rl.models.experts import WanExperts, frozen_copy
from vsa2_rl.models.wan_bundle import load_wan_bundle
from vsa2_rl.sampling import cfg_velocity, sample

sys.path.insert(0, os.path.dirname(__file__))
from wan_folders import KINDS, save_image, save_wan_folder  # noqa: E402

VIDEO = (5, 32, 32)  # frames, height, width: 2 latent frames


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan")
    paths = {kind: save_wan_folder(root / kind, kind) for kind in KINDS}
    paths["image"] = save_image(root / "image.png", size=(VIDEO[2], VIDEO[1]))
    return paths


def _pipeline(path: str, image_to_video: bool):
    """diffusers' own pipeline over the folder's components (the reference)."""
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanImageToVideoPipeline,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import AutoTokenizer, UMT5EncoderModel

    with open(os.path.join(path, "model_index.json")) as handle:
        index = json.load(handle)
    parts = {
        "tokenizer": AutoTokenizer.from_pretrained(path, subfolder="tokenizer"),
        "text_encoder": UMT5EncoderModel.from_pretrained(path, subfolder="text_encoder"),
        "vae": AutoencoderKLWan.from_pretrained(path, subfolder="vae"),
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=1.0),
        "transformer": WanTransformer3DModel.from_pretrained(path, subfolder="transformer"),
        "transformer_2": (
            WanTransformer3DModel.from_pretrained(path, subfolder="transformer_2")
            if index["boundary_ratio"]
            else None
        ),
        "boundary_ratio": index["boundary_ratio"],
        "expand_timesteps": index["expand_timesteps"],
    }
    if not image_to_video:
        return WanPipeline(**parts)
    image_parts = {"image_encoder": None, "image_processor": None}
    if index["image_encoder"][0] is not None:
        from transformers import CLIPImageProcessor, CLIPVisionModel

        image_parts = {
            "image_encoder": CLIPVisionModel.from_pretrained(path, subfolder="image_encoder"),
            "image_processor": CLIPImageProcessor.from_pretrained(path, subfolder="image_processor"),
        }
    return WanImageToVideoPipeline(**parts, **image_parts)


CASES = [
    ("wan21_t2v", False, 1.0),
    ("wan21_i2v", True, 3.0),
    ("wan22_a14b_t2v", False, 1.0),
    ("wan22_a14b_i2v", True, 3.0),
    ("wan22_ti2v", False, 1.0),
    ("wan22_ti2v", True, 1.0),
]


@pytest.mark.parametrize(("kind", "image_to_video", "guidance"), CASES)
def test_dense_sampling_equals_the_diffusers_pipeline(folders, kind, image_to_video, guidance):
    from PIL import Image

    path, prompts, steps = folders[kind], ["a red square moving right"], 4
    pipe = _pipeline(path, image_to_video)
    pipe.scheduler.set_timesteps(steps)
    sigmas = pipe.scheduler.sigmas.clone()  # the pipeline's noise levels, 1 -> 0
    bundle = load_wan_bundle(path, VSA2Config(backend="torch"))
    bundle.sparsity_state.sparsity = 0.0  # stock dense attention, as the pipeline's
    noise = torch.randn(1, *bundle.latent_shape(*VIDEO), generator=torch.Generator().manual_seed(1))
    images = [folders["image"]] if image_to_video else [None]
    condition = encode_condition(bundle, prompts, images, VIDEO)
    uncond = bundle.encode_prompts([""]) if guidance > 1 else None
    with torch.no_grad():
        trajectory = sample(
            cfg_velocity(bundle.velocity, condition, uncond, guidance), noise, sigmas,
            kind="ode", noise_level=0.0,
        )  # fmt: skip
    ours = final_latents(condition, trajectory.latents[-1])

    call = {
        "prompt": prompts, "negative_prompt": "", "num_frames": VIDEO[0], "height": VIDEO[1],
        "width": VIDEO[2], "num_inference_steps": steps, "guidance_scale": guidance,
        "latents": noise.clone(), "output_type": "latent",
    }  # fmt: skip
    if image_to_video:
        call["image"] = Image.open(folders["image"]).convert("RGB")
    with torch.no_grad():
        theirs = pipe(**call).frames
    torch.testing.assert_close(ours, theirs.float(), atol=2e-4, rtol=1e-4)


def test_each_sample_goes_to_the_expert_of_its_noise_level(folders):
    bundle = load_wan_bundle(folders["wan22_a14b_t2v"], VSA2Config(backend="torch"))
    experts = bundle.transformer
    assert isinstance(experts, WanExperts) and experts.boundary_timestep == 875.0
    latents = torch.randn(3, *bundle.latent_shape(*VIDEO))
    text = bundle.encode_prompts(["a", "a red square", "a blue circle"])
    timestep = torch.tensor([990.0, 100.0, 875.0])  # high, low, high (>= the boundary)
    with torch.no_grad():
        mixed = experts(latents, timestep, text)[0]
        for row, expert in enumerate([experts.high_noise, experts.low_noise, experts.high_noise]):
            alone = expert(latents[row : row + 1], timestep[row : row + 1], text[row : row + 1],
                           return_dict=False)[0]  # fmt: skip
            torch.testing.assert_close(mixed[row : row + 1], alone, atol=1e-5, rtol=1e-5)
    # the two experts differ, so the routing is what made the rows equal
    with torch.no_grad():
        other = experts.low_noise(latents[:1], timestep[:1], text[:1], return_dict=False)[0]
    assert (other - mixed[:1]).abs().max() > 1e-3


def test_a_frozen_copy_shares_the_expert_that_does_not_train(folders):
    bundle = load_wan_bundle(
        folders["wan22_a14b_t2v"], VSA2Config(backend="torch"), train_experts=("low_noise",)
    )
    copy = frozen_copy(bundle.transformer)
    assert copy.high_noise is bundle.transformer.high_noise
    assert copy.low_noise is not bundle.transformer.low_noise
    assert not any(p.requires_grad for p in copy.low_noise.parameters())


def test_train_experts_must_name_experts_the_model_has(folders):
    with pytest.raises(ConfigError, match=r"model\.train_experts: \['low_noise'\].*one transformer"):
        load_wan_bundle(folders["wan21_t2v"], VSA2Config(), train_experts=("low_noise",))
    with pytest.raises(ConfigError, match=r"model\.train_experts: got 'middle'"):
        load_config(None, ["model.train_experts=[middle]"])
