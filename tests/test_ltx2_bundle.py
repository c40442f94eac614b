"""LTX-2 as the model family ``ltx2`` (vsa2_rl.models.ltx2_bundle) on a tiny random diffusers
folder written here (nothing downloads): its prompt encoding equals LTX2Pipeline's encoder and
connectors, its velocity the untouched transformer's called as the pipeline's denoise loop calls
it, its decode the pipeline's decode arithmetic, a damaged folder is one error naming what is
wrong, RL trains it, a run stopped and resumed goes on bit for bit as one that ran through, and
a LoRA run's export loads back through peft to its checkpoint's velocity."""

import inspect
import json
import os
import re
import shutil

import numpy as np
import pytest
import torch
from run_comparison import (
    check_lora_export_round_trip,
    check_one_step_trains,
    check_resume_is_bit_identical,
    recipe_on_tiny_folder,
)

from vsa2_rl.config import ConfigError, load_config
from vsa2_rl.models.family import LTX2, family_of

FLOW_GRPO_TOY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flow_grpo_toy.yaml")
WORDS = ["<pad>", "<unk>", "<bos>", "<eos>", "a", "red", "square", "moving", "right"]
LATENT = 4  # VAE latent channels
VIDEO = (9, 64, 64)  # 8 + 1 frames of 64 x 64: latents [4, 2, 8, 8], 128 tokens
PROMPTS = ["a red square moving right", " a square "]  # 5 and 2 words (+ <bos>)
TRANSFORMER = {
    "in_channels": LATENT, "out_channels": LATENT, "num_attention_heads": 2,
    "attention_head_dim": 16, "cross_attention_dim": 32, "audio_in_channels": 4,
    "audio_out_channels": 4, "audio_num_attention_heads": 2, "audio_attention_head_dim": 8,
    "audio_cross_attention_dim": 16, "num_layers": 2, "caption_channels": 8,
}  # fmt: skip
# LTX-2.3's differences: per-modality text projections in the connectors (text rows as wide as
# each stream's cross-attention), timestep-modulated cross-attention that reads sigma, gated
# attention and split rotary embeddings
LTX23_TRANSFORMER = {
    "use_prompt_embeddings": False, "cross_attn_mod": True, "audio_cross_attn_mod": True,
    "gated_attn": True, "audio_gated_attn": True, "rope_type": "split",
}  # fmt: skip
LTX23_CONNECTORS = {
    "per_modality_projections": True, "video_hidden_dim": 32, "audio_hidden_dim": 16,
    "video_connector_attention_head_dim": 16, "audio_connector_attention_head_dim": 8,
    "rope_type": "split",
}  # fmt: skip


def _tokenizer():
    """A word-level tokenizer that starts each prompt with <bos>, as Gemma's does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", WORDS.index("<bos>"))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", bos_token="<bos>",
        eos_token="<eos>",
    )  # fmt: skip


def _write_folder(root, ltx23: bool = False) -> None:
    """A tiny random LTX-2 folder laid out as LTX2Pipeline's components (LTX-2.0's: connectors
    that project the stacked Gemma 3 hidden states to the caption width, learned registers in
    place of the padding; with ``ltx23`` LTX-2.3's)."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text_encoder = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config={
            "vocab_size": len(WORDS), "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 4, "pad_token_id": 0,
        },
        vision_config={
            "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 2, "image_size": 28, "patch_size": 14,
        },
        mm_tokens_per_image=4,
    ))  # fmt: skip
    connectors = LTX2TextConnectors(**{
        "caption_channels": 8, "text_proj_in_factor": 3, "video_connector_num_attention_heads": 2,
        "video_connector_attention_head_dim": 4, "video_connector_num_layers": 1,
        "video_connector_num_learnable_registers": 128, "audio_connector_num_attention_heads": 2,
        "audio_connector_attention_head_dim": 4, "audio_connector_num_layers": 1,
        "audio_connector_num_learnable_registers": 128, **(LTX23_CONNECTORS if ltx23 else {}),
    })  # fmt: skip
    vae = AutoencoderKLLTX2Video(
        latent_channels=LATENT, block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 16, 32), layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1), patch_size=1, scaling_factor=1.5,
        spatial_compression_ratio=8, temporal_compression_ratio=8,
    )  # fmt: skip
    with torch.no_grad():
        vae.latents_mean.copy_(torch.tensor([0.1, -0.2, 0.0, 0.3]))
        vae.latents_std.copy_(torch.tensor([0.9, 1.1, 0.7, 1.3]))
    # 2 latent channels x 8 mel bins / 4 = the transformer's 4 audio channels
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4, ch_mult=(1,), num_res_blocks=1, latent_channels=2, mel_bins=8
    )
    transformer = LTX2VideoTransformer3DModel(**TRANSFORMER | (LTX23_TRANSFORMER if ltx23 else {}))
    if ltx23:  # gates that matter: zero logits would make every gate exactly 1
        for name, param in transformer.named_parameters():
            if "to_gate_logits" in name:
                param.data.normal_(0.0, 0.5)
    transformer.save_pretrained(root / "transformer")
    text_encoder.save_pretrained(root / "text_encoder")
    _tokenizer().save_pretrained(root / "tokenizer")
    connectors.save_pretrained(root / "connectors")
    vae.save_pretrained(root / "vae")
    audio_vae.save_pretrained(root / "audio_vae")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("ltx2") / "LTX-2-tiny"
    _write_folder(root)
    (root.parent / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return str(root)


@pytest.fixture(scope="module")
def folder_ltx23(tmp_path_factory):
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("ltx23") / "LTX-2.3-tiny"
    _write_folder(root, ltx23=True)
    (root.parent / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return str(root)


def _damaged(folder, tmp_path):
    """A copy of the folder to damage."""
    shutil.copytree(folder, tmp_path / "damaged")
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return tmp_path / "damaged"


def _config(path, *extra):
    return load_config(FLOW_GRPO_TOY, [
        "model.kind=ltx2", f"model.path={path}", "attention.backend=torch",
        f"model.num_frames={VIDEO[0]}", f"model.height={VIDEO[1]}", f"model.width={VIDEO[2]}",
        f"prompts.file={os.path.join(os.path.dirname(path), 'prompts.txt')}",
        "sampler.guidance_scale=1.0", *extra,
    ])  # fmt: skip


def _bundle(path, dtype=torch.float64, *extra):
    config = _config(str(path), *extra)
    return family_of("ltx2").load_bundle(config, torch.device("cpu"), dtype, None)


def _pipeline(folder):
    """diffusers' LTX2Pipeline of the folder's components in float64 (no vocoder: nothing
    here decodes audio)."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from transformers import AutoTokenizer, Gemma3ForConditionalGeneration

    def load(model_class, subfolder, dtype=torch.float64):
        return model_class.from_pretrained(folder, subfolder=subfolder, torch_dtype=dtype)

    return LTX2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(
            use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
            max_image_seq_len=4096, shift_terminal=0.1,
        ),
        vae=load(AutoencoderKLLTX2Video, "vae", torch.float32),
        audio_vae=load(AutoencoderKLLTX2Audio, "audio_vae", torch.float32),
        text_encoder=load(Gemma3ForConditionalGeneration, "text_encoder"),
        tokenizer=AutoTokenizer.from_pretrained(folder, subfolder="tokenizer"),
        connectors=load(LTX2TextConnectors, "connectors"),
        transformer=load(LTX2VideoTransformer3DModel, "transformer"),
        vocoder=None,
    )  # fmt: skip


def _pipeline_text(pipe, prompts):
    """The pipeline's prompt encoding and connectors, as its __call__ runs them without
    guidance: (video text rows, audio text rows, text mask)."""
    embeds, mask, _, _ = pipe.encode_prompt(
        prompts, do_classifier_free_guidance=False, device=torch.device("cpu")
    )
    with torch.no_grad():
        return pipe.connectors(embeds, mask, padding_side=pipe.tokenizer.padding_side)


def _pipeline_velocity(pipe, latents, step, text):
    """The untouched transformer's video output for one request as the pipeline's denoise loop
    runs step ``step`` of an 8-step schedule, with its audio latents still at the first step
    of theirs (the noise drawn at seed 0): (sigma, packed output rows)."""
    from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

    transformer, scheduler = pipe.transformer, pipe.scheduler
    frames, height, width = latents.shape[2:]
    packed = pipe._pack_latents(latents)
    shift = calculate_shift(packed.shape[1], 1024, 4096, 0.95, 2.05)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / 8, 8), mu=shift)
    t = scheduler.timesteps[step]
    duration = VIDEO[0] / 24.0  # the pipeline's default frame rate
    audio_frames = round(duration * 16000 / 160 / 4)  # the audio VAE's rate, 4x compressed
    noise = torch.randn(1, 2, audio_frames, 2, generator=torch.Generator().manual_seed(0))
    audio = pipe._pack_audio_latents(noise).to(torch.float64)
    video_embeds, audio_embeds, mask = text
    first = scheduler.timesteps[:1].expand(1)
    with torch.no_grad():
        out = transformer(
            hidden_states=packed, audio_hidden_states=audio, encoder_hidden_states=video_embeds,
            audio_encoder_hidden_states=audio_embeds, timestep=t.expand(1), audio_timestep=first,
            sigma=t.expand(1), audio_sigma=first, encoder_attention_mask=mask,
            audio_encoder_attention_mask=mask, num_frames=frames, height=height, width=width,
            fps=24.0, audio_num_frames=audio_frames,
            video_coords=transformer.rope.prepare_video_coords(
                1, frames, height, width, latents.device, fps=24.0
            ),
            audio_coords=transformer.audio_rope.prepare_audio_coords(1, audio_frames, "cpu"),
            isolate_modalities=False, use_cross_timestep=True, return_dict=False,
        )[0]  # fmt: skip
    return scheduler.sigmas[step], out


@pytest.mark.parametrize(("name", "widths"), [("folder", (8, 8)), ("folder_ltx23", (32, 16))])
def test_prompts_and_velocity_equal_the_pipeline_and_transformer(request, name, widths):
    folder = request.getfixturevalue(name)
    bundle = _bundle(folder)
    pipe = _pipeline(folder)
    condition = bundle.encode_prompts(PROMPTS)
    video_embeds, audio_embeds, mask = _pipeline_text(pipe, PROMPTS)
    video, audio = widths
    assert condition.shape == (2, 1024, video + audio + 1)
    close = {"rtol": 1e-10, "atol": 1e-10}
    torch.testing.assert_close(condition[..., :video], video_embeds, **close)
    torch.testing.assert_close(condition[..., video : video + audio], audio_embeds, **close)
    torch.testing.assert_close(condition[..., -1], mask.to(condition.dtype))

    # two requests at different noise levels in one call, each against the stock transformer
    # as the pipeline's loop calls it (sigma 1: its first step)
    latents = torch.randn(2, *bundle.latent_shape(*VIDEO), dtype=torch.float64)
    texts = [tuple(x[i : i + 1] for x in (video_embeds, audio_embeds, mask)) for i in range(2)]
    references = [
        _pipeline_velocity(pipe, latents[i : i + 1], step, texts[i])
        for i, step in enumerate((0, 3))
    ]
    sigma = torch.stack([s for s, _ in references]).double()
    assert sigma[0] == 1.0 and 0 < sigma[1] < 1
    with torch.no_grad():
        for sparsity in (0.0, 0.005):  # stock attention; VSA2's dense fine stage
            bundle.sparsity_state.sparsity = sparsity
            velocity = bundle.velocity(latents, sigma, condition)
            assert velocity.shape == latents.shape and velocity.dtype == torch.float32
            for i, (_, rows) in enumerate(references):
                # the pipeline's clean prediction is sample - output * sigma: the output is
                # the velocity noise - data, the bundle's own convention
                mine = pipe._pack_latents(velocity[i : i + 1])
                torch.testing.assert_close(mine, rows.float(), rtol=1e-6, atol=1e-6)
        bundle.sparsity_state.sparsity = 0.5  # a sparse velocity runs and differs
        sparse = bundle.velocity(latents, sigma, condition)
    assert torch.isfinite(sparse).all() and not torch.allclose(sparse, velocity, atol=1e-6)
    assert LTX2.vsa2_parameters(bundle.transformer)


def test_latent_shape_decode_and_cache(folder, tmp_path):
    bundle = _bundle(folder, torch.float32, f"model.text_cache_dir={tmp_path / 'cache'}")
    assert bundle.latent_shape(*VIDEO) == (LATENT, 2, 8, 8)
    with pytest.raises(ValueError, match=r"8\*n \+ 1"):
        bundle.latent_shape(8, 64, 64)
    with pytest.raises(ValueError, match=r"multiples of 8"):
        bundle.latent_shape(9, 60, 64)
    latents = torch.randn(2, *bundle.latent_shape(*VIDEO))
    video = bundle.decode(latents)
    assert video.shape == (2, VIDEO[0], 3, VIDEO[1], VIDEO[2]) and video.dtype == torch.float32
    # the pipeline's decode: de-normalised latents through the VAE, then its video processor
    pipe = _pipeline(folder)
    vae = pipe.vae
    with torch.no_grad():
        latent = pipe._denormalize_latents(
            latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor
        )
        pixels = vae.decode(latent, None, return_dict=False)[0]
    pixels = pipe.video_processor.postprocess_video(pixels, output_type="pt")
    torch.testing.assert_close(video, pixels, rtol=1e-5, atol=1e-5)

    first = bundle.encode_prompts(PROMPTS)
    assert len(os.listdir(tmp_path / "cache")) == 2
    again = _bundle(folder, torch.float32, f"model.text_cache_dir={tmp_path / 'cache'}")
    again.text_encoder = None  # encoding would fail: read from the cache
    torch.testing.assert_close(again.encode_prompts(PROMPTS[::-1]), first.flip(0))


def test_a_timestep_conditioned_decoder_decodes_at_the_pipelines_decode_timestep(folder):
    import inspect

    from diffusers import AutoencoderKLLTX2Video, LTX2Pipeline
    from diffusers.video_processor import VideoProcessor

    torch.manual_seed(0)
    bundle = _bundle(folder, torch.float32)
    bundle.vae = AutoencoderKLLTX2Video(
        latent_channels=LATENT, block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 16, 32), layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1), patch_size=1, spatial_compression_ratio=8,
        temporal_compression_ratio=8, timestep_conditioning=True,
    ).eval()  # fmt: skip
    latents = torch.randn(2, *bundle.latent_shape(*VIDEO))
    # the pipeline's decode branch for such a VAE at its defaults: noise mixed in at the decode
    # noise scale (the decode timestep when unset), the decoder conditioned on the timestep
    defaults = inspect.signature(LTX2Pipeline.__call__).parameters
    decode_timestep = defaults["decode_timestep"].default
    assert defaults["decode_noise_scale"].default is None
    noisy = (1 - decode_timestep) * latents + decode_timestep * torch.randn_like(latents)
    with torch.no_grad():
        pixels = bundle.vae.decode(
            LTX2Pipeline._denormalize_latents(
                noisy, bundle.vae.latents_mean, bundle.vae.latents_std,
                bundle.vae.config.scaling_factor,
            ),
            torch.tensor([decode_timestep] * 2), return_dict=False,
        )[0]  # fmt: skip
    expected = VideoProcessor(vae_scale_factor=8).postprocess_video(pixels, output_type="pt")
    torch.testing.assert_close(bundle.decode(latents), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("component", ["connectors", "audio_vae"])
def test_a_missing_subfolder_is_named(folder, tmp_path, component):
    damaged = _damaged(folder, tmp_path)
    shutil.rmtree(damaged / component)
    with pytest.raises(ConfigError, match=rf"model\.path=.*missing: {component}/$"):
        _bundle(damaged)


@pytest.mark.parametrize(
    ("file", "key", "value", "message"),
    [
        ("transformer", "in_channels", 2 * LATENT, r"transformer/config\.json: in_channels is 8"),
        ("transformer", "audio_in_channels", 8, r"transformer/config\.json: audio_in_channels"),
        ("transformer", "caption_channels", 16, r"transformer/config\.json: caption_channels"),
        ("connectors", "text_proj_in_factor", 4, r"connectors/config\.json: caption_channels x"),
        ("text_encoder", "model_type", "gemma4", r"text_encoder/config\.json: model_type is"),
    ],
)
def test_a_mismatched_file_is_named(folder, tmp_path, file, key, value, message):
    damaged = _damaged(folder, tmp_path)
    config_file = damaged / file / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, key: value}))
    with pytest.raises(ConfigError, match=message):
        _bundle(damaged)


def test_config_needs_a_path_and_refuses_compiled_or_fused_blocks(folder):
    with pytest.raises(ConfigError, match=r"^model\.path: model\.kind=ltx2 needs"):
        load_config(FLOW_GRPO_TOY, ["model.kind=ltx2"])
    for key in ("compile_blocks", "fused_kernels"):
        with pytest.raises(ConfigError, match=rf"^model\.{key}: .*ltx2"):
            _config(folder, f"model.{key}=true")
    with pytest.raises(ConfigError, match=r"^model\.fused_kernels: LTX-2"):
        LTX2.fuse_block_kernels(torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match=r"^LTX-2 has no sequence parallelism"):
        LTX2.enable_sequence_parallel(torch.nn.Linear(1, 1), None)


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
    assert any(".vsa2." in key for key in changed) and any(".attn1.to_q." in key for key in changed)


def _recording(shapes: list, plan_module):
    """plan.seconds_per_step, recording the ModelShape it prices in ``shapes``."""
    seconds_per_step = plan_module.seconds_per_step

    def record(model, step):
        shapes.append(model)
        return seconds_per_step(model, step)

    return record


def test_check_plans_an_ltx2_folder_and_train_accepts_it(folder, tmp_path, monkeypatch):
    from diffusers import LTX2Pipeline

    from vsa2_rl import plan as plan_module
    from vsa2_rl.check import before_loading, check

    overrides = [
        "model.kind=ltx2", f"model.path={folder}", "attention.backend=torch",
        f"model.num_frames={VIDEO[0]}", f"model.height={VIDEO[1]}", f"model.width={VIDEO[2]}",
        f"prompts.file={os.path.join(os.path.dirname(folder), 'prompts.txt')}",
        "sampler.guidance_scale=1.0", f"out_dir={tmp_path / 'run'}", "eval.guard_rewards=[]",
        *RUN,
    ]  # fmt: skip
    shapes = []
    monkeypatch.setattr(plan_module, "seconds_per_step", _recording(shapes, plan_module))
    report = check(FLOW_GRPO_TOY, overrides)
    assert report.problems == []
    # the plan prices the prompt's text rows as the pipeline pads them
    padded = inspect.signature(LTX2Pipeline.__call__).parameters["max_sequence_length"].default
    assert [shape.text_tokens for shape in shapes] == [padded]
    plan = dict(report.plan)
    assert plan["model"].startswith("LTX-2, text-to-video")
    # 9 = 8 + 1 frames -> 2 latent frames, 64 px / 8 -> 8; patches 1 x 1 x 1: 2 x 8 x 8
    assert plan["video"].startswith("9 frames of 64x64 -> latents 4x2x8x8 -> 128 tokens (2x8x8)")
    assert "GiB" in plan["memory"] and "a step" in plan["time"]
    assert before_loading(load_config(FLOW_GRPO_TOY, overrides)).problems == []


@pytest.mark.parametrize("name", ["folder", "folder_ltx23"])
def test_a_lora_run_exports_an_adapter_that_reproduces_the_checkpoint(request, tmp_path, name):
    folder = request.getfixturevalue(name)
    lora = ["model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=4"]
    run = _config(folder, *RUN, *lora, f"out_dir={tmp_path / 'run'}")
    vsa2 = check_lora_export_round_trip(run, VIDEO, PROMPTS, tmp_path)
    # the routers and gates alone, in the video self-attention (the module docstring's names)
    assert vsa2 and all(re.match(r"transformer_blocks\.\d+\.attn1\.vsa2\.", key) for key in vsa2)


@pytest.mark.parametrize("name", ["folder", "folder_ltx23"])
@pytest.mark.parametrize("algorithm", ["flow_grpo", "nft"])
def test_a_run_stopped_after_step_1_and_resumed_goes_on_bit_for_bit(
    request, tmp_path, capsys, name, algorithm
):
    folder = request.getfixturevalue(name)
    run = [*RUN, f"rl.algorithm={algorithm}"]
    check_resume_is_bit_identical(lambda *extra: _config(folder, *extra), run, tmp_path, capsys)


def _pipeline_sigmas(num_steps: int, tokens: int) -> list[float]:
    """LTX2Pipeline's schedule for videos of ``tokens`` tokens: diffusers' scheduler with the
    released LTX-2 scheduler's settings, its timesteps set as the pipeline sets them."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
        max_image_seq_len=4096, shift_terminal=0.1,
    )  # fmt: skip
    mu = calculate_shift(tokens, 1024, 4096, 0.95, 2.05)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
    return scheduler.sigmas.tolist()


def test_the_recipe_runs_one_step_on_a_tiny_folder_with_the_pipelines_schedule(
    folder, tmp_path, monkeypatch
):
    """configs/ltx2_704p_vsa2_nft.yaml's settings (DiffusionNFT, guidance-free rollouts, LoRA,
    the router, rewards swapped for a weight-free one) on the tiny folder: only sizes shrink.
    Its rollouts and evaluations step through LTX2Pipeline's schedule at the video's 128
    tokens."""
    from vsa2_rl.rl import rollout

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.chdir(repo)  # the recipe names its evaluation prompt file from there
    schedules = []
    real_schedule = rollout.sigma_schedule
    monkeypatch.setattr(
        rollout, "sigma_schedule", lambda *a: schedules.append(real_schedule(*a)) or schedules[-1]
    )
    config = recipe_on_tiny_folder("ltx2_704p_vsa2_nft.yaml", folder, VIDEO, tmp_path / "run")
    assert config.rl.algorithm == "nft" and config.model.lora.enabled
    assert config.sampler.guidance_scale == 1.0 and config.eval_guidance_scale == 4.0
    check_one_step_trains(config)
    (rollout_sigmas,) = schedules
    expected = _pipeline_sigmas(config.sampler.num_steps, tokens=128)
    assert rollout_sigmas.tolist() == pytest.approx(expected, abs=1e-6)
    assert rollout_sigmas[-2].item() == pytest.approx(0.1)


def test_evaluations_step_through_the_pipelines_schedule(folder, tmp_path, monkeypatch):
    """``vsa2-rl eval`` with the recipe's sampler settings samples on LTX2Pipeline's schedule
    at 40 steps."""
    from vsa2_rl.eval import sweep

    schedules = []
    real_schedule = sweep.sigma_schedule
    monkeypatch.setattr(
        sweep, "sigma_schedule", lambda *a: schedules.append(real_schedule(*a)) or schedules[-1]
    )
    config = _config(
        folder, "sampler.token_shift=[1024,0.95,4096,2.05]", "sampler.shift_terminal=0.1",
        "sampler.eval_num_steps=40", "eval.num_prompts=1", "eval.sparsities=[0.0]",
        "eval.guard_rewards=[]",
        "logging.progress=false", f"out_dir={tmp_path / 'eval'}",
        "rewards.functions=[{name: 'test_trainer:brightness'}]",
    )  # fmt: skip
    sweep.evaluate(config)
    (sigmas,) = schedules
    assert sigmas.tolist() == pytest.approx(_pipeline_sigmas(40, tokens=128), abs=1e-6)
