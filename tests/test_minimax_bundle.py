"""MiniMax-H3 as the model family ``minimax_h3`` (vsa2_rl.models.minimax_bundle) on a tiny random
diffusers folder written here (nothing downloads): its prompt encoding equals the modular
pipeline's encoder, its velocity the untouched transformer's called as the pipeline's denoise
loop calls it, its decode the pipeline's decode step's arithmetic, a damaged folder is one
error naming what is wrong, and RL trains it."""

import json
import os
import shutil

import pytest
import torch
from run_comparison import (
    check_lora_export_round_trip,
    check_one_step_trains,
    check_resume_is_bit_identical,
    recipe_on_tiny_folder,
)

from vsa2_rl.config import ConfigError, load_config
from vsa2_rl.models.family import MINIMAX_H3, family_of
from vsa2_rl.models.minimax_bundle import unpack_text

FLOW_GRPO_TOY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flow_grpo_toy.yaml")
WORDS = ["<pad>", "<unk>", "a", "red", "square", "moving", "right"]
WORDS += ["<|image_pad|>", "<|video_pad|>"]  # Qwen3-VL's vision pads, text in a text-only prompt
LATENT = 4  # VAE latent channels
VIDEO = (22, 32, 32)  # 17 + 5 frames of 32 x 32: latents [4, 7, 8, 8], 7 x 4 x 4 = 112 rows
PROMPTS = ["a red square moving right", "a square"]  # 5 and 2 tokens


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>")


def _write_folder(root) -> None:
    """A tiny random MiniMax-H3 folder as the modular pipeline's components are laid out (the
    Qwen3-VL text encoder has 53 layers: the pipeline reads the hidden state after layer 50)."""
    from diffusers import AutoencoderKLMiniMaxH3, MiniMaxH3Transformer3DModel
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    text_encoder = Qwen3VLForConditionalGeneration(Qwen3VLConfig(
        text_config={
            "vocab_size": len(WORDS), "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 53, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 8, "rope_scaling": {
                "rope_type": "default", "mrope_section": [1, 1, 2], "mrope_interleaved": True,
            },
        },
        vision_config={
            "depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
            "out_hidden_size": 16, "deepstack_visual_indexes": [],
        },
        image_token_id=WORDS.index("<|image_pad|>"), video_token_id=WORDS.index("<|video_pad|>"),
    ))  # fmt: skip
    transformer = MiniMaxH3Transformer3DModel(
        num_attention_heads=2, attention_head_dim=16, hidden_size=32, num_layers=2,
        num_refiner_layers=1, ffn_dim=64, in_channels=LATENT, audio_in_channels=4,
        patch_size=(1, 2, 2), text_dim=16, freq_dim=16, time_embed_hidden_dim=32,
        time_embed_dim=16, rope_freq_dim=2,
    )  # fmt: skip
    vae = AutoencoderKLMiniMaxH3(
        latent_channels=LATENT, block_out_channels=(8, 8, 8), layers_per_block=1,
        spatial_downsample_factors=(2, 2, 1), temporal_downsample_factors=(1, 2, 2),
        norm_num_groups=4, decoder_num_layers=1, decoder_num_attention_heads=2,
        decoder_attention_head_dim=8, decoder_num_register_tokens=1, decoder_ffn_mult=2,
        latents_mean=(0.1, -0.2, 0.0, 0.3), latents_std=(0.9, 1.1, 0.7, 1.3),
    )  # fmt: skip
    transformer.save_pretrained(root / "transformer")
    text_encoder.save_pretrained(root / "text_encoder")
    _tokenizer().save_pretrained(root / "tokenizer")
    vae.save_pretrained(root / "vae")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("minimax") / "MiniMax-H3-tiny"
    _write_folder(root)
    (root.parent / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return str(root)


def _damaged(folder, tmp_path):
    """A copy of the folder to damage."""
    shutil.copytree(folder, tmp_path / "damaged")
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return tmp_path / "damaged"


def _config(path, *extra):
    return load_config(FLOW_GRPO_TOY, [
        "model.kind=minimax_h3", f"model.path={path}", "attention.backend=torch",
        f"model.num_frames={VIDEO[0]}", f"model.height={VIDEO[1]}", f"model.width={VIDEO[2]}",
        f"prompts.file={os.path.join(os.path.dirname(path), 'prompts.txt')}",
        "sampler.guidance_scale=1.0", *extra,
    ])  # fmt: skip


def _bundle(path, dtype=torch.float64, *extra):
    config = _config(str(path), *extra)
    return family_of("minimax_h3").load_bundle(config, torch.device("cpu"), dtype, None)


def _pipeline_text(folder, prompts):
    """The modular pipeline's text-encoder block (t2va) on each prompt, with the folder's text
    encoder and tokenizer and a real Qwen3-VL processor: (prompt_embeds, text_token_tags)."""
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3TextEncoderStep
    from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    tokenizer = AutoTokenizer.from_pretrained(folder, subfolder="tokenizer")
    pipe = MiniMaxH3TextEncoderStep().init_pipeline()
    pipe.update_components(
        text_encoder=Qwen3VLForConditionalGeneration.from_pretrained(
            folder, subfolder="text_encoder", torch_dtype=torch.float64
        ),
        tokenizer=tokenizer,
        processor=Qwen3VLProcessor(
            image_processor=Qwen2VLImageProcessor(), tokenizer=tokenizer,
            video_processor=Qwen3VLVideoProcessor(),
        ),
    )  # fmt: skip
    outputs = [pipe(prompt=p, output=["prompt_embeds", "text_token_tags"]) for p in prompts]
    return [(out["prompt_embeds"], out["text_token_tags"]) for out in outputs]


def _pipeline_velocity(transformer, latents, sigma_index, prompt_embeds, text_tags):
    """The untouched transformer's output rows for one request as the pipeline's t2va denoise
    loop runs step ``sigma_index`` of an 8-step video schedule with its audio rows still at the
    first step of their schedule (the noise drawn at seed 0): (video sigma, rows)."""
    from diffusers import MiniMaxH3Scheduler
    from diffusers.modular_pipelines.minimax_h3.before_denoise import (
        MiniMaxH3PrepareLayoutStep,
        MiniMaxH3SetTimestepsStep,
        patchify_video_latents,
    )
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import audio_latent_num_frames

    video_schedule, audio_schedule = MiniMaxH3Scheduler(shift=12.0), MiniMaxH3Scheduler(shift=3.0)
    video_schedule.set_timesteps(8)
    audio_schedule.set_timesteps(8)
    num_text = prompt_embeds.shape[1]
    audio_latents = audio_latent_num_frames(VIDEO[0])  # 24 fps, 40 audio latents a second
    layout = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        text_tags, *latents.shape[2:], audio_latents, (1, 2, 2), 2, 2, 0
    )  # stereo audio rows tagged 2, video rows 0
    positions, tags, video, audio, text = layout[:5]
    timesteps, rows = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        video, audio, 0, 0, num_text, float(video_schedule.timesteps[sigma_index]),
        float(audio_schedule.timesteps[0]), 0.0, 1.0,
    )  # fmt: skip
    noise = torch.randn(audio.numel(), 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = transformer(
            hidden_states=patchify_video_latents(latents.float(), (1, 2, 2))[None],
            audio_hidden_states=noise[None], encoder_hidden_states=prompt_embeds,
            timestep=timesteps, timestep_indices=rows, token_tags=tags, position_ids=positions,
            video_indices=video, audio_indices=audio, text_indices=text, return_dict=False,
        )[0]  # fmt: skip
    return video_schedule.sigmas[sigma_index], out


def test_prompts_and_velocity_equal_the_modular_pipeline_and_transformer(folder):
    from diffusers import MiniMaxH3Transformer3DModel
    from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents

    bundle = _bundle(folder)
    packed = bundle.encode_prompts(PROMPTS)
    expected = _pipeline_text(folder, PROMPTS)
    for mine, (theirs, _) in zip(unpack_text(packed), expected, strict=True):
        torch.testing.assert_close(mine, theirs[0], rtol=1e-12, atol=1e-12)
    assert [len(rows) for rows in unpack_text(packed)] == [5, 2]

    # two requests of different text lengths at different noise levels in one call, each
    # against the stock transformer as the pipeline's loop calls it (sigma 1: its first step)
    stock = MiniMaxH3Transformer3DModel.from_pretrained(
        folder, subfolder="transformer", torch_dtype=torch.float64
    )
    latents = torch.randn(2, *bundle.latent_shape(*VIDEO), dtype=torch.float64)
    references = [
        _pipeline_velocity(stock, latents[i : i + 1], step, *text)
        for i, (step, text) in enumerate(zip((0, 3), expected, strict=True))
    ]
    sigma = torch.stack([s for s, _ in references]).double()
    assert sigma[0] == 1.0 and 0 < sigma[1] < 1
    with torch.no_grad():
        for sparsity in (0.0, 0.005):  # stock attention; VSA2's dense fine stage
            bundle.sparsity_state.sparsity = sparsity
            velocity = bundle.velocity(latents, sigma, packed)
            assert velocity.shape == latents.shape and velocity.dtype == torch.float32
            for i, (_, rows) in enumerate(references):
                # the pipeline's transformer predicts the data-ward velocity (data - noise)
                # (its output heads stay float32 in a float64 model, as diffusers keeps them)
                mine = patchify_video_latents(-velocity[i : i + 1], (1, 2, 2))
                torch.testing.assert_close(mine, rows[0], rtol=1e-6, atol=1e-6)
        bundle.sparsity_state.sparsity = 0.5  # a sparse velocity runs and differs
        sparse = bundle.velocity(latents, sigma, packed)
    assert torch.isfinite(sparse).all() and not torch.allclose(sparse, velocity, atol=1e-6)
    assert MINIMAX_H3.vsa2_parameters(bundle.transformer)


def test_latent_shape_decode_and_cache(folder, tmp_path):
    from diffusers import AutoencoderKLMiniMaxH3

    bundle = _bundle(folder, torch.float32, f"model.text_cache_dir={tmp_path / 'cache'}")
    assert bundle.latent_shape(*VIDEO) == (LATENT, 7, 8, 8)
    with pytest.raises(ValueError, match=r"17\*n \+ 5"):
        bundle.latent_shape(21, 32, 32)
    with pytest.raises(ValueError, match=r"multiples of 8"):
        bundle.latent_shape(22, 36, 32)
    latents = torch.randn(2, *bundle.latent_shape(*VIDEO))
    video = bundle.decode(latents)
    assert video.shape == (2, VIDEO[0], 3, VIDEO[1], VIDEO[2]) and video.dtype == torch.float32
    # the pipeline's decode step: latents * std + mean through the VAE, then ImageNet's pixel
    # normalisation undone and clamped to [0, 1]
    vae = AutoencoderKLMiniMaxH3.from_pretrained(folder, subfolder="vae")
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        pixels = vae.decode(latents * std + mean, return_dict=False)[0]
    imagenet = torch.tensor([[0.485, 0.456, 0.406], [0.229, 0.224, 0.225]]).view(2, 1, -1, 1, 1, 1)
    pixels = (pixels * imagenet[1] + imagenet[0]).clamp(0, 1).permute(0, 2, 1, 3, 4)
    torch.testing.assert_close(video, pixels, rtol=1e-5, atol=1e-5)

    first = bundle.encode_prompts(PROMPTS)
    assert len(os.listdir(tmp_path / "cache")) == 2
    again = _bundle(folder, torch.float32, f"model.text_cache_dir={tmp_path / 'cache'}")
    again.text_encoder = None  # encoding would fail: read from the cache
    torch.testing.assert_close(again.encode_prompts(PROMPTS[::-1]), first.flip(0))


def test_empty_and_overlong_prompts_are_refused(folder):
    bundle = _bundle(folder, torch.float32)
    with pytest.raises(ValueError, match=r"at least one token; .*guidance_scale at 1"):
        bundle.encode_prompts([""])
    with pytest.raises(ValueError, match=r"at most 512 tokens, this one has 513"):
        bundle.encode_prompts(["a " * 513])


@pytest.mark.parametrize("component", ["text_encoder", "vae"])
def test_a_missing_subfolder_is_named(folder, tmp_path, component):
    damaged = _damaged(folder, tmp_path)
    shutil.rmtree(damaged / component)
    with pytest.raises(ConfigError, match=rf"model\.path=.*missing: {component}/$"):
        _bundle(damaged)


@pytest.mark.parametrize(
    ("file", "key", "value", "message"),
    [
        ("transformer", "in_channels", 2 * LATENT, r"transformer/config\.json: in_channels is 8"),
        ("transformer", "text_dim", 8, r"transformer/config\.json: text_dim is 8"),
        ("text_encoder", "text_config", {"num_hidden_layers": 50}, r"after layer 50"),
    ],
)
def test_a_mismatched_file_is_named(folder, tmp_path, file, key, value, message):
    damaged = _damaged(folder, tmp_path)
    config_file = damaged / file / "config.json"
    config = json.loads(config_file.read_text())
    if isinstance(value, dict):
        value = {**config[key], **value}
    config_file.write_text(json.dumps({**config, key: value}))
    with pytest.raises(ConfigError, match=message):
        _bundle(damaged)


def test_config_needs_a_path_and_refuses_compiled_or_fused_blocks(folder):
    with pytest.raises(ConfigError, match=r"^model\.path: model\.kind=minimax_h3 needs"):
        load_config(FLOW_GRPO_TOY, ["model.kind=minimax_h3"])
    for key in ("compile_blocks", "fused_kernels"):
        with pytest.raises(ConfigError, match=rf"^model\.{key}: .*minimax_h3"):
            _config(folder, f"model.{key}=true")
    with pytest.raises(ConfigError, match=r"^model\.fused_kernels: MiniMax-H3"):
        MINIMAX_H3.fuse_block_kernels(torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match=r"^MiniMax-H3 has no sequence parallelism"):
        MINIMAX_H3.enable_sequence_parallel(torch.nn.Linear(1, 1), None)


RUN = [
    "sampler.num_steps=3", "sampler.sde_window=[0,2]", "rl.prompts_per_step=2",
    "rl.group_size=2", "rl.train_batch_size=4", "train.learning_rate=1e-2",
    "train.sample_every=0", "train.checkpoint_every=1", "logging.progress=false",
    "rewards.num_workers=1", "eval.every=0", "eval.num_prompts=2", "train.num_steps=1",
    "rewards.functions=[{name: 'test_trainer:brightness'}]",
]  # fmt: skip


@pytest.mark.parametrize("algorithm", ["flow_grpo", "nft"])
def test_one_rl_step_trains_the_transformer(folder, tmp_path, algorithm):
    from vsa2_rl.rl.checkpoint import find_latest, load_checkpoint
    from vsa2_rl.rl.trainer import train

    config = _config(folder, *RUN, f"rl.algorithm={algorithm}", f"out_dir={tmp_path / 'run'}")
    train(config)
    with open(tmp_path / "run" / "metrics.jsonl") as handle:
        steps = [json.loads(line) for line in handle]
    losses = [value for row in steps for key, value in row.items() if key.startswith("loss/")]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
    saved = load_checkpoint(find_latest(os.path.join(config.out_dir, "checkpoints")))["model"]
    base = _bundle(folder, torch.float32).transformer.state_dict()
    changed = [key for key, value in saved.items() if not torch.equal(value, base[key])]
    assert any(".vsa2." in key for key in changed) and any(".to_q." in key for key in changed)


def test_check_plans_a_minimax_folder_and_train_accepts_it(folder, tmp_path):
    from vsa2_rl.check import before_loading, check

    overrides = [
        "model.kind=minimax_h3", f"model.path={folder}", "attention.backend=torch",
        f"model.num_frames={VIDEO[0]}", f"model.height={VIDEO[1]}", f"model.width={VIDEO[2]}",
        f"prompts.file={os.path.join(os.path.dirname(folder), 'prompts.txt')}",
        "sampler.guidance_scale=1.0", f"out_dir={tmp_path / 'run'}", "eval.guard_rewards=[]",
        *RUN,
    ]  # fmt: skip
    report = check(FLOW_GRPO_TOY, overrides)
    assert report.problems == []
    plan = dict(report.plan)
    assert plan["model"].startswith("MiniMax-H3, text-to-video")
    # 22 = 17 + 5 frames -> 5 + 2 latent frames, 32 px / 4 -> 8; patches 1 x 2 x 2: 7 x 4 x 4
    assert plan["video"].startswith("22 frames of 32x32 -> latents 4x7x8x8 -> 112 tokens (7x4x4)")
    assert "GiB" in plan["memory"] and "a step" in plan["time"]
    assert before_loading(load_config(FLOW_GRPO_TOY, overrides)).problems == []


def test_a_lora_run_exports_an_adapter_that_reproduces_the_checkpoint(folder, tmp_path):
    lora = ["model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=4"]
    run = _config(folder, *RUN, *lora, f"out_dir={tmp_path / 'run'}")
    vsa2 = check_lora_export_round_trip(run, VIDEO, PROMPTS, tmp_path)
    assert vsa2 and all(".vsa2." in key for key in vsa2)  # the routers and gates alone


@pytest.mark.parametrize("algorithm", ["flow_grpo", "nft"])
def test_a_run_stopped_after_step_1_and_resumed_goes_on_bit_for_bit(
    folder, tmp_path, capsys, algorithm
):
    run = [*RUN, f"rl.algorithm={algorithm}"]
    check_resume_is_bit_identical(lambda *extra: _config(folder, *extra), run, tmp_path, capsys)


def test_the_recipe_runs_one_step_on_a_tiny_folder(folder, tmp_path, monkeypatch):
    """configs/minimax_h3_704p_vsa2_nft.yaml's settings (DiffusionNFT, guidance-free, LoRA,
    the router, rewards swapped for a weight-free one) on the tiny folder: only sizes shrink."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.chdir(repo)  # the recipe names its evaluation prompt file from there
    config = recipe_on_tiny_folder("minimax_h3_704p_vsa2_nft.yaml", folder, VIDEO, tmp_path / "run")
    assert config.rl.algorithm == "nft" and config.model.lora.enabled
    assert config.sampler.guidance_scale == config.eval_guidance_scale == 1.0
    assert config.sparsity.train == 0.875
    check_one_step_trains(config)
