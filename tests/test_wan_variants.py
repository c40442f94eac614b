"""Wan2.1 I2V, Wan2.2 A14B (two experts, T2V and I2V) and Wan2.2 TI2V-5B on tiny random folders:
sampling equals diffusers' own pipelines, the experts route by noise level, and RL trains,
checkpoints, resumes and exports only the experts ``model.train_experts`` names."""

import json
import os
import re
import sys

import pytest
import torch
from torch import nn

from vsa2_rl.config import ConfigError, VSA2Config, load_config, load_eval_config
from vsa2_rl.models.conditioning import encode_condition, final_latents
from vsa2_rl.models.experts import WanExperts, frozen_copy, low_noise_guidance
from vsa2_rl.models.wan_bundle import load_wan_bundle
from vsa2_rl.sampling import cfg_velocity, sample

sys.path.insert(0, os.path.dirname(__file__))
from wan_folders import KINDS, count_index_reads, save_image, save_wan_folder

FLOW_GRPO_TOY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flow_grpo_toy.yaml")

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
            "image_processor": CLIPImageProcessor.from_pretrained(
                path, subfolder="image_processor"
            ),
        }
    return WanImageToVideoPipeline(**parts, **image_parts)


CASES = [
    ("wan21_t2v", False, 1.0),
    ("wan21_i2v", True, 3.0),
    ("wan22_a14b_t2v", False, 1.0),
    ("wan22_a14b_t2v", False, (3.0, 1.5)),  # guidance_scale_2 for the low-noise expert
    ("wan22_a14b_i2v", True, 3.0),
    ("wan22_ti2v", False, 1.0),
    ("wan22_ti2v", True, 1.0),
]


@pytest.mark.parametrize(("kind", "image_to_video", "guidance"), CASES)
def test_dense_sampling_equals_the_diffusers_pipeline(folders, kind, image_to_video, guidance):
    from PIL import Image

    path, prompts, steps = folders[kind], ["a red square moving right"], 4
    guidance, guidance_2 = guidance if isinstance(guidance, tuple) else (guidance, None)
    pipe = _pipeline(path, image_to_video)
    pipe.scheduler.set_timesteps(steps)
    sigmas = pipe.scheduler.sigmas.clone()  # the pipeline's noise levels, 1 -> 0
    bundle = load_wan_bundle(path, VSA2Config(backend="torch"))
    bundle.sparsity_state.sparsity = 0.0  # stock dense attention, as the pipeline's
    noise = torch.randn(1, *bundle.latent_shape(*VIDEO), generator=torch.Generator().manual_seed(1))
    images = [folders["image"]] if image_to_video else [None]
    condition = encode_condition(bundle, prompts, images, VIDEO)
    uncond = bundle.encode_prompts([""]) if max(guidance, guidance_2 or 1.0) > 1 else None
    low_noise = low_noise_guidance(bundle.transformer, guidance_2, "sampler.guidance_scale_2")
    with torch.no_grad():
        trajectory = sample(
            cfg_velocity(bundle.velocity, condition, uncond, guidance, low_noise), noise, sigmas,
            kind="ode", noise_level=0.0,
        )  # fmt: skip
    ours = final_latents(condition, trajectory.latents[-1])

    call = {
        "prompt": prompts, "negative_prompt": "", "num_frames": VIDEO[0], "height": VIDEO[1],
        "width": VIDEO[2], "num_inference_steps": steps, "guidance_scale": guidance,
        "latents": noise.clone(), "output_type": "latent",
    }  # fmt: skip
    if guidance_2 is not None:
        call["guidance_scale_2"] = guidance_2
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
    with pytest.raises(
        ConfigError, match=r"model\.train_experts: \['low_noise'\].*one transformer"
    ):
        load_wan_bundle(folders["wan21_t2v"], VSA2Config(), train_experts=("low_noise",))
    with pytest.raises(ConfigError, match=r"model\.train_experts: got 'middle'"):
        load_config(FLOW_GRPO_TOY, ["model.train_experts=[middle]"])


# --------------------------------------------------------------------------------------------
# RL on the variants

RUN = [
    "model.kind=wan",
    f"model.num_frames={VIDEO[0]}",
    f"model.height={VIDEO[1]}",
    f"model.width={VIDEO[2]}",
    "sampler.num_steps=3",
    "sampler.sde_window=[0,2]",
    "rl.prompts_per_step=2",
    "rl.group_size=2",
    "rl.train_batch_size=4",
    "train.learning_rate=1e-2",
    "train.sample_every=0",
    "logging.progress=false",
    "rewards.num_workers=1",
    "eval.every=0",
    "attention.backend=torch",
    "rewards.functions=[{name: 'test_trainer:brightness'}]",
]
LORA = ["model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=4"]


def _prompt_file(tmp_path, image=None) -> str:
    """Two prompts, with a condition image each when ``image`` is given (JSON Lines)."""
    texts = ["a red square moving right", "a blue circle moving right"]
    if image is None:
        path = tmp_path / "prompts.txt"
        path.write_text("\n".join(texts) + "\n")
    else:
        path = tmp_path / "prompts.jsonl"
        path.write_text("".join(json.dumps({"prompt": t, "image": image}) + "\n" for t in texts))
    return str(path)


def _run_config(tmp_path, folders, kind, *extra, name="run", image=None):
    return load_config(FLOW_GRPO_TOY, [
        *RUN, f"model.path={folders[kind]}", f"prompts.file={_prompt_file(tmp_path, image)}",
        f"out_dir={tmp_path / name}", *extra,
    ])  # fmt: skip


def _checkpoint(out_dir):
    from vsa2_rl.rl.checkpoint import find_latest, load_checkpoint

    return load_checkpoint(find_latest(os.path.join(out_dir, "checkpoints")))


def test_a_train_start_reads_model_index_json_once(tmp_path, folders, monkeypatch):
    """``vsa2-rl train``'s pre-flight, the trainer's set-up and the loader share one read of
    the folder's model_index.json (a run of one step, on a two-expert folder)."""
    from vsa2_rl.cli import main

    path = folders["wan22_a14b_t2v"]
    reads = count_index_reads(monkeypatch)
    argv = [
        "train", "--config", FLOW_GRPO_TOY, *RUN, f"model.path={path}", "train.num_steps=1",
        f"prompts.file={_prompt_file(tmp_path)}", f"out_dir={tmp_path / 'run'}",
    ]  # fmt: skip
    assert main(argv) == 0
    assert reads == [os.path.join(path, "model_index.json")]
    assert os.path.isdir(tmp_path / "run" / "checkpoints")  # the step ran


def test_lora_on_one_expert_trains_saves_resumes_and_exports_that_expert(tmp_path, folders):
    from peft import LoraConfig
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    from vsa2_rl.export import export
    from vsa2_rl.rl.trainer import train
    from vsa2_rl.runtime import build_bundle, load_model

    extra = [*LORA, "model.train_experts=[low_noise]", "train.checkpoint_every=1"]
    whole = _run_config(tmp_path, folders, "wan22_a14b_t2v", *extra, "train.num_steps=2")
    train(whole)
    state = _checkpoint(whole.out_dir)
    assert state["model"] and all(k.startswith("low_noise.") for k in state["model"])
    assert any("lora_" in k for k in state["model"])
    trained = {p for group in state["optimizer"]["param_groups"] for p in group["params"]}
    assert len(state["optimizer"]["state"]) == len(trained) == len(state["model"])

    # one step, then a resumed second step: the same weights as two steps in one go
    split = _run_config(tmp_path, folders, "wan22_a14b_t2v", *extra, "train.num_steps=1",
                        name="split")  # fmt: skip
    train(split)
    resumed = _run_config(tmp_path, folders, "wan22_a14b_t2v", *extra, "train.num_steps=2",
                          "train.resume=auto", name="split")  # fmt: skip
    train(resumed)
    for key, value in _checkpoint(resumed.out_dir)["model"].items():
        torch.testing.assert_close(value, state["model"][key], rtol=0, atol=0)

    folder = export(
        *load_eval_config(None, [f"run_dir={whole.out_dir}", f"out_dir={tmp_path / 'x'}"])
    )
    assert sorted(os.listdir(folder)) == ["transformer_2", "vsa2_attention.json"]
    with open(os.path.join(folder, "vsa2_attention.json")) as handle:
        assert json.load(handle)["experts"] == ["low_noise"]
    from vsa2_rl.rl.checkpoint import find_latest

    checkpoint = str(find_latest(os.path.join(whole.out_dir, "checkpoints")))
    expected = load_model(whole, "cpu", torch.float32, checkpoint=checkpoint)
    fresh = build_bundle(whole, torch.device("cpu"), torch.float32)
    low = fresh.transformer.low_noise
    low.add_adapter(LoraConfig.from_pretrained(os.path.join(folder, "transformer_2")))
    weights = load_file(os.path.join(folder, "transformer_2", "adapter_model.safetensors"))
    assert not set_peft_model_state_dict(low, weights).unexpected_keys
    low.load_state_dict(load_file(os.path.join(folder, "transformer_2", "vsa2.safetensors")),
                        strict=False)  # fmt: skip
    latents = torch.randn(2, *fresh.latent_shape(*VIDEO))
    text = fresh.encode_prompts(["a red square", "a blue circle"])
    sigma = torch.tensor([0.95, 0.3])  # one sample per expert
    for bundle in (expected, fresh):
        bundle.sparsity_state.sparsity = 0.9
    with torch.no_grad():
        torch.testing.assert_close(
            fresh.velocity(latents, sigma, text), expected.velocity(latents, sigma, text),
            rtol=1e-5, atol=1e-6,
        )  # fmt: skip
        base = build_bundle(whole, torch.device("cpu"), torch.float32)
        base.sparsity_state.sparsity = 0.9
        moved = base.velocity(latents, sigma, text) - expected.velocity(latents, sigma, text)
    assert moved[0].abs().max() < 1e-6 < moved[1].abs().max()  # only the low-noise sample moved


@pytest.mark.parametrize(
    "algorithm", ["rl.algorithm=flow_grpo", "rl.algorithm=nft nft.sigma_range=[0.875,1.0]"]
)
def test_full_fine_tuning_of_one_expert_leaves_the_other_as_loaded(tmp_path, folders, algorithm):
    from vsa2_rl.rl.trainer import train
    from vsa2_rl.runtime import build_bundle

    config = _run_config(
        tmp_path, folders, "wan22_a14b_t2v", "model.train_experts=[high_noise]",
        "train.num_steps=1", "rl.kl_beta=0.1", "train.ema_decay=0.9",
        *algorithm.split(),
    )  # fmt: skip
    train(config)
    saved = _checkpoint(config.out_dir)
    assert all(k.startswith("high_noise.") for k in saved["model"])
    base = build_bundle(config, torch.device("cpu"), torch.float32).transformer.state_dict()
    changed = [k for k, v in saved["model"].items() if not torch.equal(v, base[k])]
    assert changed  # the trained expert moved
    assert set(saved["ema"]["shadow"]) <= set(saved["model"])


def test_nft_levels_and_sde_windows_must_reach_a_trained_expert(tmp_path, folders):
    from vsa2_rl.rl.trainer import train

    low_only = ["model.train_experts=[low_noise]", "train.num_steps=1"]
    cases = [
        (["rl.algorithm=nft"], r"nft\.sigma_range: \[0\.0, 1\.0\].*within \[0, 0\.875\)"),
        (["sampler.sde_window=[0,1]"], r"sampler\.sde_window: .*\[1\.0\] all belong"),
    ]
    for index, (extra, message) in enumerate(cases):
        config = _run_config(tmp_path, folders, "wan22_a14b_t2v", *low_only, *extra,
                             name=f"refused{index}")  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            train(config)
        assert not os.path.exists(config.out_dir)


def image_reward(videos, prompts, metadata):
    """Brightness, refusing samples without their condition image in the metadata."""
    for entry in metadata:
        assert os.path.isfile(entry["image"]), entry
    return videos.mean(dim=(1, 2, 3, 4)).float()


@pytest.mark.parametrize(
    ("kind", "extra"),
    [
        ("wan22_ti2v", ["rl.algorithm=nft"]),
        ("wan21_i2v", ["sampler.guidance_scale=3.0", *LORA]),
        ("wan22_a14b_i2v", ["model.train_experts=[low_noise]", *LORA]),
    ],
)
def test_image_to_video_runs_show_the_image_to_rewards_and_in_samples(
    tmp_path, folders, kind, extra
):
    from vsa2_rl.rl.trainer import train

    config = _run_config(
        tmp_path, folders, kind, *extra, "train.num_steps=1", "eval.every=1",
        "eval.num_prompts=2", "train.sample_every=1", "eval.guard_rewards=[]",
        "rewards.functions=[{name: 'test_wan_variants:image_reward'}, "
        "{name: image_consistency, weight: 0.0}]",
        image=folders["image"],
    )  # fmt: skip
    train(config)
    with open(os.path.join(config.out_dir, "metrics.jsonl")) as handle:
        rows = [json.loads(line) for line in handle]
    assert 0.0 < rows[-1]["eval/reward/image_consistency"] <= 1.0
    from PIL import Image

    sheet = Image.open(os.path.join(config.out_dir, "samples", "step_1.png"))
    frames_only = (VIDEO[0] * (VIDEO[2] * 4 + 2) - 2, 4 * (VIDEO[1] * 4 + 2) - 2)
    assert sheet.size[0] > frames_only[0]  # a column for the condition image


def test_a_second_guidance_scale_needs_two_experts_and_is_one_error_line(tmp_path, folders, capsys):
    from vsa2_rl.cli import main

    for key in ("sampler.guidance_scale_2", "eval.guidance_scale_2"):
        out_dir = tmp_path / key
        code = main(["train", "--config", FLOW_GRPO_TOY, *RUN,
                     f"model.path={folders['wan21_t2v']}", f"{key}=2.0",
                     f"prompts.file={_prompt_file(tmp_path)}", f"out_dir={out_dir}",
                     "train.num_steps=1"])  # fmt: skip
        assert code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            f"error: {key}: the guidance scale of the low-noise expert's steps needs a model of "
            "two experts (Wan2.2 A14B); leave it empty"
        ]
        assert not out_dir.exists()


def test_prompt_images_the_model_cannot_take_are_one_error_line(tmp_path, folders, capsys):
    from vsa2_rl.cli import main

    cases = [
        ("wan21_t2v", folders["image"], "carry condition images but the model"),
        ("wan21_i2v", None, "is image-to-video and needs an image per prompt"),
    ]
    for index, (kind, image, message) in enumerate(cases):
        out_dir = tmp_path / f"out{index}"
        prompts = _prompt_file(tmp_path, image)
        code = main(["train", *RUN, f"model.path={folders[kind]}", f"prompts.file={prompts}",
                     f"out_dir={out_dir}", "train.num_steps=1"])  # fmt: skip
        assert code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: prompts.file: ") and message in err[0]
        assert not out_dir.exists()


@pytest.mark.parametrize(
    ("recipe", "kind"),
    [
        ("wan2_2_a14b_i2v_vsa2_grpo.yaml", "wan22_a14b_i2v"),
        ("wan2_2_ti2v_5b_vsa2_grpo.yaml", "wan22_ti2v"),
        ("wan2_2_a14b_i2v_vsa2_nft.yaml", "wan22_a14b_i2v"),
        ("wan2_2_ti2v_5b_vsa2_nft.yaml", "wan22_ti2v"),
    ],
)
def test_the_wan22_recipes_run_one_step_on_a_tiny_model_of_their_kind(
    tmp_path, folders, recipe, kind, monkeypatch
):
    """The recipe's settings (experts, window, guidance, rewards, LoRA) on a tiny model: only
    the sizes shrink."""
    from vsa2_rl.rl.trainer import train

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.chdir(repo)  # the recipes name their evaluation prompt files from there
    shrink = [
        f"model.num_frames={VIDEO[0]}", f"model.height={VIDEO[1]}", f"model.width={VIDEO[2]}",
        "rl.group_size=2", "rl.prompts_per_step=2", "rl.train_batch_size=2",
        "train.num_steps=1", "train.sample_every=0", "logging.report_to=[]",
        "logging.progress=false", "attention.backend=torch", "eval.every=0",
        "rewards.functions=[{name: 'test_wan_variants:image_reward'}, {name: image_consistency}]",
    ]  # fmt: skip
    config = load_config(os.path.join(repo, "configs", recipe), [
        *shrink, f"model.path={folders[kind]}", f"out_dir={tmp_path / 'run'}",
        f"prompts.file={_prompt_file(tmp_path, folders['image'])}",
    ])  # fmt: skip
    assert config.sparsity.eval < config.sparsity.train and config.model.lora.enabled
    train(config)
    with open(os.path.join(config.out_dir, "metrics.jsonl")) as handle:
        (row,) = [json.loads(line) for line in handle]
    assert row["step"] == 1 and row["sparsity/rollout"] == config.sparsity.train == 0.875


def _grpo_update(model, fraction: float, sigmas):
    from types import SimpleNamespace

    from vsa2_rl.rl.flow_grpo import FlowGRPOUpdate

    policy = SimpleNamespace(model=model, reference=None)
    rl = SimpleNamespace(timestep_fraction=fraction, kl_mode="loss")
    return FlowGRPOUpdate(policy, SimpleNamespace(sigmas=sigmas), rl, seed=0)


def test_every_grpo_update_trains_each_expert_the_config_names():
    """timestep_fraction is drawn per expert: with one step in four trained, an update of two
    experts trains one step of each (5 high-noise steps, sigma >= 0.5, and 3 low-noise ones);
    one transformer draws as one group, exactly as torch.randperm over all its steps."""
    sigmas = torch.linspace(1.0, 0.0, 9)
    high, low = {0, 1, 2, 3, 4}, {5, 6, 7}
    both = _grpo_update(WanExperts(nn.Linear(1, 1), nn.Linear(1, 1), 0.5), 0.25, sigmas)
    low_only = WanExperts(nn.Linear(1, 1), nn.Linear(1, 1), 0.5, train_experts=("low_noise",))
    one = _grpo_update(nn.Linear(1, 1), 0.25, sigmas)
    for seed in range(20):
        chosen = both._trained_timesteps(list(range(8)), torch.Generator().manual_seed(seed))
        assert len(chosen) == 2 and len(set(chosen) & high) == 1 and len(set(chosen) & low) == 1
        chosen = _grpo_update(low_only, 0.5, sigmas)._trained_timesteps(
            list(range(8)), torch.Generator().manual_seed(seed)
        )
        assert len(chosen) == 2 and set(chosen) <= low
        expected = torch.randperm(8, generator=torch.Generator().manual_seed(seed))[:2]
        chosen = one._trained_timesteps(list(range(8)), torch.Generator().manual_seed(seed))
        assert chosen == sorted(expected.tolist())


@pytest.mark.parametrize(
    ("zero3", "algorithm", "refused"),
    [(True, "flow_grpo", "ZeRO-3"), (False, "nft", "rl.algorithm=nft"), (False, "flow_grpo", "")],
)
def test_deepspeed_refuses_two_experts_where_it_would_step_them_apart(
    monkeypatch, zero3, algorithm, refused
):
    from vsa2_rl.rl import engines

    monkeypatch.setattr(engines, "uses_deepspeed", lambda acc: True)
    monkeypatch.setattr(engines, "shards_parameters", lambda acc: zero3)
    config = load_config(FLOW_GRPO_TOY, [f"rl.algorithm={algorithm}"])
    both = WanExperts(nn.Linear(1, 1), nn.Linear(1, 1), 0.5)
    one = WanExperts(nn.Linear(1, 1), nn.Linear(1, 1), 0.5, train_experts=("high_noise",))
    engines.check_trained_experts(None, one, config)  # one expert: every engine steps it alike
    if not refused:
        engines.check_trained_experts(None, both, config)
        return
    with pytest.raises(ConfigError, match=rf"^model\.train_experts: {re.escape(refused)}"):
        engines.check_trained_experts(None, both, config)
