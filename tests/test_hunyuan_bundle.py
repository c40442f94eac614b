"""HunyuanVideo-1.5 as the model family ``hunyuan_video15`` (vsa2_rl.models.hunyuan_bundle) on a
tiny random diffusers folder written here (nothing downloads): its prompt encoding and velocity
equal diffusers' own pipeline and untouched transformer, its VAE round trip has the pipeline's
shapes, a damaged folder is one error naming what is wrong, and RL trains it."""

import json
import os
import shutil

import pytest
import torch
from run_comparison import (
    check_lora_export_round_trip,
    check_one_step_trains,
    check_resume_is_bit_identical,
)

from vsa2_rl.config import ConfigError, load_config
from vsa2_rl.models.family import HUNYUAN_VIDEO15, family_of
from vsa2_rl.models.hunyuan_bundle import glyph_text, unpack_text

FLOW_GRPO_TOY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flow_grpo_toy.yaml")
WORDS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "a", "red", "square", "moving", "right"]
# The real chat template's system part is the 108 tokens the encoding cuts off, so a prompt's
# tokens, even the empty prompt's end-of-turn tokens, survive; here 107 filler words and the
# user turn's opening token (an all-padding MLLM text makes the model's pooled text NaN).
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ 'system ' * 107 }}"
    "{% else %}<|im_start|> {{ m['content'] }} <|im_end|> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
LATENT = 4  # VAE latent channels
VIDEO = (5, 16, 16)  # frames, height, width: latents [4, 2, 4, 4]
PROMPTS = ['a red square moving right, a sign "OPEN"', "a square"]


def _pipeline():
    """A tiny random diffusers HunyuanVideo15Pipeline (Qwen2.5-VL and ByT5 text encoders)."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from diffusers.guiders import ClassifierFreeGuidance
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        ByT5Tokenizer,
        PreTrainedTokenizerFast,
        Qwen2_5_VLTextConfig,
        Qwen2_5_VLTextModel,
        T5Config,
        T5EncoderModel,
    )

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", chat_template=TEMPLATE
    )
    text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=len(WORDS), hidden_size=16, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, bos_token_id=None, eos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [1, 1, 2]},
    ))  # fmt: skip
    glyph_encoder = T5EncoderModel(T5Config(
        vocab_size=384, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8,
    ))  # fmt: skip
    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=2 * LATENT + 1, out_channels=LATENT, num_attention_heads=2,
        attention_head_dim=16, num_layers=2, num_refiner_layers=1, mlp_ratio=2.0,
        text_embed_dim=16, text_embed_2_dim=8, image_embed_dim=8, rope_axes_dim=(4, 6, 6),
    )  # fmt: skip
    vae = AutoencoderKLHunyuanVideo15(
        latent_channels=LATENT, block_out_channels=(8, 8, 8), layers_per_block=1,
        spatial_compression_ratio=4, temporal_compression_ratio=4, scaling_factor=0.8,
    )  # fmt: skip
    return HunyuanVideo15Pipeline(
        text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), text_encoder_2=glyph_encoder,
        tokenizer_2=ByT5Tokenizer(), guider=ClassifierFreeGuidance(guidance_scale=6.0),
    )  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("hunyuan")
    _pipeline().save_pretrained(root / "HunyuanVideo-1.5-tiny")
    return _with_prompts(root / "HunyuanVideo-1.5-tiny")


def _with_prompts(path) -> str:
    """``path``, with a prompt file beside it (where :func:`_config` reads it)."""
    (path.parent / "prompts.txt").write_text("a red square moving right\na square\n")
    return str(path)


def _damaged(folder, tmp_path):
    """A copy of the folder to damage."""
    shutil.copytree(folder, tmp_path / "damaged")
    _with_prompts(tmp_path / "damaged")
    return tmp_path / "damaged"


def _config(path, *extra):
    return load_config(FLOW_GRPO_TOY, [
        "model.kind=hunyuan_video15", f"model.path={path}", "attention.backend=torch",
        f"model.num_frames={VIDEO[0]}", f"model.height={VIDEO[1]}", f"model.width={VIDEO[2]}",
        f"prompts.file={os.path.join(os.path.dirname(path), 'prompts.txt')}", *extra,
    ])  # fmt: skip


def _bundle(path, dtype=torch.float64, *extra):
    config = _config(path, *extra)
    return family_of("hunyuan_video15").load_bundle(config, torch.device("cpu"), dtype, None)


def test_glyph_text_is_the_quoted_spans():
    assert glyph_text("a plain prompt") is None
    assert glyph_text('a sign "OPEN" and “SHUT”, "OPEN"') == 'Text "OPEN". Text "SHUT". '
    assert glyph_text('one "A"') == 'Text "A". '


def test_prompts_and_velocity_equal_the_diffusers_pipeline_and_transformer(folder):
    from diffusers import HunyuanVideo15Pipeline, HunyuanVideo15Transformer3DModel

    bundle = _bundle(folder)
    pipe = HunyuanVideo15Pipeline.from_pretrained(folder, torch_dtype=torch.float64)
    packed = bundle.encode_prompts(PROMPTS)
    expected = pipe.encode_prompt(PROMPTS, device=torch.device("cpu"), batch_size=2)
    got = unpack_text(packed, 1000, 16, 8)
    assert expected[3].sum(1).tolist()[1] == 0 and expected[3].sum(1).tolist()[0] > 0
    for mine, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(mine, theirs.to(mine.dtype), rtol=1e-12, atol=1e-12)

    # the untouched transformer as the pipeline calls it: cond latents and mask channels of
    # zeros, timestep sigma * 1000, 729 zero image tokens; at density 1 VSA2 is the stock model
    stock = HunyuanVideo15Transformer3DModel.from_pretrained(
        folder, subfolder="transformer", torch_dtype=torch.float64
    )
    latents = torch.randn(2, *bundle.latent_shape(*VIDEO), dtype=torch.float64)
    sigma = torch.tensor([0.9, 0.35], dtype=torch.float64)
    with torch.no_grad():
        reference = stock(
            hidden_states=torch.cat([latents, latents.new_zeros(2, LATENT + 1, 2, 4, 4)], 1),
            timestep=sigma * 1000, encoder_hidden_states=expected[0],
            encoder_attention_mask=expected[1], encoder_hidden_states_2=expected[2],
            encoder_attention_mask_2=expected[3],
            image_embeds=torch.zeros(2, 729, 8, dtype=torch.float64), return_dict=False,
        )[0]  # fmt: skip
        for sparsity in (0.0, 0.005):  # stock attention; VSA2's dense fine stage
            bundle.sparsity_state.sparsity = sparsity
            velocity = bundle.velocity(latents, sigma, packed)
            torch.testing.assert_close(velocity, reference.float(), rtol=1e-6, atol=1e-6)
        bundle.sparsity_state.sparsity = 0.5  # a sparse velocity runs and differs
        sparse = bundle.velocity(latents, sigma, packed)
    assert torch.isfinite(sparse).all() and not torch.allclose(sparse, velocity, atol=1e-6)
    assert HUNYUAN_VIDEO15.vsa2_parameters(bundle.transformer)


def test_vae_round_trip_shapes_and_cache(folder, tmp_path):
    bundle = _bundle(folder, torch.float32, f"model.text_cache_dir={tmp_path / 'cache'}")
    assert bundle.latent_shape(*VIDEO) == (LATENT, 2, 4, 4)
    with pytest.raises(ValueError, match=r"4\*k \+ 1"):
        bundle.latent_shape(6, 16, 16)
    video = bundle.decode(torch.randn(2, *bundle.latent_shape(*VIDEO)))
    assert video.shape == (2, VIDEO[0], 3, VIDEO[1], VIDEO[2]) and video.dtype == torch.float32
    assert video.min() >= 0 and video.max() <= 1
    first = bundle.encode_prompts(PROMPTS)
    assert len(os.listdir(tmp_path / "cache")) == 2
    again = _bundle(folder, torch.float32, f"model.text_cache_dir={tmp_path / 'cache'}")
    again.text_encoder = again.glyph_encoder = None  # encoding would fail: read from the cache
    torch.testing.assert_close(again.encode_prompts(PROMPTS[::-1]), first.flip(0))


@pytest.mark.parametrize("component", ["text_encoder_2", "vae"])
def test_a_missing_subfolder_is_named(folder, tmp_path, component):
    damaged = _damaged(folder, tmp_path)
    shutil.rmtree(damaged / component)
    with pytest.raises(ConfigError, match=rf"model\.path=.*missing: {component}/$"):
        _bundle(str(damaged))


def test_mismatched_channels_and_image_to_video_are_named(folder, tmp_path):
    damaged = _damaged(folder, tmp_path)
    config_file = damaged / "transformer" / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "in_channels": 2 * LATENT}))
    with pytest.raises(ConfigError, match=r"transformer/config\.json: out_channels and in_ch"):
        _bundle(str(damaged))
    index = damaged / "model_index.json"
    index.write_text(json.dumps({"_class_name": "HunyuanVideo15ImageToVideoPipeline"}))
    with pytest.raises(ConfigError, match=r"image-to-video"):
        _bundle(str(damaged))


def test_config_needs_a_path_and_refuses_compiled_or_fused_blocks(folder):
    with pytest.raises(ConfigError, match=r"^model\.path: model\.kind=hunyuan_video15 needs"):
        load_config(FLOW_GRPO_TOY, ["model.kind=hunyuan_video15"])
    for key in ("compile_blocks", "fused_kernels"):
        with pytest.raises(ConfigError, match=rf"^model\.{key}: .*hunyuan_video15"):
            _config(folder, f"model.{key}=true")
    with pytest.raises(ConfigError, match=r"^model\.compile_blocks: HunyuanVideo-1\.5"):
        HUNYUAN_VIDEO15.compile_blocks(torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match=r"no sequence parallelism"):
        HUNYUAN_VIDEO15.enable_sequence_parallel(torch.nn.Linear(1, 1), None)


RUN = [
    "sampler.num_steps=3", "sampler.sde_window=[0,2]", "rl.prompts_per_step=2",
    "rl.group_size=2", "rl.train_batch_size=4", "train.learning_rate=1e-2",
    "train.sample_every=0", "train.checkpoint_every=1", "logging.progress=false",
    "rewards.num_workers=1", "eval.every=0", "eval.num_prompts=2", "train.num_steps=1",
    "rewards.functions=[{name: 'test_trainer:brightness'}]",
]  # fmt: skip


# Flow-GRPO with classifier-free guidance (the packed text in a batch of 2B); NFT is CFG-free
@pytest.mark.parametrize("algorithm", ["flow_grpo sampler.guidance_scale=2.0", "nft"])
def test_one_rl_step_trains_the_transformer(folder, tmp_path, algorithm):
    from vsa2_rl.rl.checkpoint import find_latest, load_checkpoint
    from vsa2_rl.rl.trainer import train

    config = _config(
        folder, *RUN, *f"rl.algorithm={algorithm}".split(), f"out_dir={tmp_path / 'run'}"
    )
    train(config)
    with open(tmp_path / "run" / "metrics.jsonl") as handle:
        steps = [json.loads(line) for line in handle]
    losses = [value for row in steps for key, value in row.items() if key.startswith("loss/")]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
    saved = load_checkpoint(find_latest(os.path.join(config.out_dir, "checkpoints")))["model"]
    base = _bundle(folder, torch.float32).transformer.state_dict()
    changed = [key for key, value in saved.items() if not torch.equal(value, base[key])]
    assert any(".vsa2." in key for key in changed) and any(".to_q." in key for key in changed)


def test_check_plans_a_hunyuan_folder_and_train_accepts_it(folder, tmp_path):
    from vsa2_rl.check import before_loading, check

    overrides = [
        "model.kind=hunyuan_video15", f"model.path={folder}", "attention.backend=torch",
        f"model.num_frames={VIDEO[0]}", f"model.height={VIDEO[1]}", f"model.width={VIDEO[2]}",
        f"prompts.file={os.path.join(os.path.dirname(folder), 'prompts.txt')}",
        f"out_dir={tmp_path / 'run'}", "eval.guard_rewards=[]", *RUN,
    ]  # fmt: skip
    report = check(FLOW_GRPO_TOY, overrides)
    assert report.problems == []
    plan = dict(report.plan)
    assert plan["model"].startswith("HunyuanVideo-1.5, text-to-video: ")
    # 5 frames of 16 x 16 through the 4x temporal, 4x spatial VAE: latents 4 x 2 x 4 x 4; the
    # transformer's 1 x 1 x 1 patches keep every latent a token
    assert plan["video"].startswith("5 frames of 16x16 -> latents 4x2x4x4 -> 32 tokens (2x4x4)")
    assert "GiB" in plan["memory"] and "a step" in plan["time"]
    assert before_loading(load_config(FLOW_GRPO_TOY, overrides)).problems == []


def test_a_lora_run_exports_an_adapter_that_reproduces_the_checkpoint(folder, tmp_path):
    lora = ["model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=4"]
    run = _config(folder, *RUN, *lora, f"out_dir={tmp_path / 'run'}")
    vsa2 = check_lora_export_round_trip(run, VIDEO, PROMPTS, tmp_path)
    assert vsa2 and all(".vsa2." in key for key in vsa2)  # the routers and gates alone


@pytest.mark.parametrize("algorithm", ["flow_grpo sampler.guidance_scale=2.0", "nft"])
def test_a_run_stopped_after_step_1_and_resumed_goes_on_bit_for_bit(
    folder, tmp_path, capsys, algorithm
):
    run = [*RUN, *f"rl.algorithm={algorithm}".split()]
    check_resume_is_bit_identical(lambda *extra: _config(folder, *extra), run, tmp_path, capsys)


@pytest.mark.parametrize("algorithm", ["nft", "grpo"])
def test_the_recipes_run_one_step_on_a_tiny_folder(folder, tmp_path, monkeypatch, algorithm):
    """configs/hunyuan_video15_480p_vsa2_{nft,grpo}.yaml's settings (algorithm, guidance, LoRA,
    the router; rewards swapped for a weight-free one) on the tiny folder: only sizes and the
    sampler's steps shrink, in float32 (bfloat16 is slow on a CPU)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.chdir(repo)  # the recipes name their evaluation prompt file from there
    recipe = os.path.join(repo, "configs", f"hunyuan_video15_480p_vsa2_{algorithm}.yaml")
    window = ["sampler.sde_window=[0,2]"] if algorithm == "grpo" else []
    config = load_config(recipe, [*window,
        f"model.path={folder}", f"out_dir={tmp_path / 'run'}", "attention.backend=torch",
        f"model.num_frames={VIDEO[0]}", f"model.height={VIDEO[1]}", f"model.width={VIDEO[2]}",
        f"prompts.file={os.path.join(os.path.dirname(folder), 'prompts.txt')}",
        "rl.group_size=2", "rl.prompts_per_step=2", "rl.train_batch_size=2",
        "train.num_steps=1", "train.sample_every=0", "logging.report_to=[]",
        "logging.progress=false", "eval.every=0", "sampler.num_steps=4", "model.dtype=float32",
        "rewards.functions=[{name: 'test_trainer:brightness'}]",
    ])  # fmt: skip
    assert config.eval_guidance_scale == 6.0 and config.model.lora.enabled
    assert config.sparsity.train == 0.875
    check_one_step_trains(config)
