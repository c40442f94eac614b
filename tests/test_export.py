"""``vsa2-rl export``: a tiny toy run exported as a peft adapter (LoRA) or a diffusers folder
(full fine-tuning) plus its VSA2 parameters, loaded back by those libraries' own loaders, gives
the checkpoint's velocities; ``model.lora.init_from`` starts a run from such an adapter."""

import os

import pytest
import torch
from safetensors.torch import load_file

from vsa2_rl.config import ConfigError, load_config
from vsa2_rl.export import ADAPTER_WEIGHTS, VSA2_WEIGHTS, export
from vsa2_rl.rl.checkpoint import find_latest
from vsa2_rl.rl.trainer import train
from vsa2_rl.runtime import build_bundle, load_model, trainable_parameters

TINY = [
    "model.num_frames=4",
    "model.height=16",
    "model.width=16",
    "sampler.num_steps=3",
    "sampler.sde_window=[0,2]",
    "grpo.prompts_per_step=2",
    "grpo.group_size=2",
    "train.learning_rate=1e-2",
    "train.num_steps=1",
    "train.sample_every=0",
    "logging.progress=false",
    "eval.every=0",
    "attention.backend=torch",
    "rewards.functions=[{name: 'test_trainer:brightness'}]",
]
LORA = ["model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=4"]


def _velocity(bundle, config):
    """The model's velocity at sparsity 0.9 (so the VSA2 parameters count) on fixed inputs."""
    generator = torch.Generator().manual_seed(0)
    shape = bundle.latent_shape(config.model.num_frames, config.model.height, config.model.width)
    x = torch.randn(2, *shape, generator=generator)
    bundle.sparsity_state.sparsity, bundle.sparsity_state.phase = 0.9, "eval"
    emb = bundle.encode_prompts(["a red square moving left fast", "a blue circle"])
    with torch.no_grad():
        return bundle.velocity(x, torch.tensor([0.7, 0.4]), emb)


def _trained(tmp_path, *extra):
    run = load_config(None, [*TINY, *extra, f"out_dir={tmp_path / 'run'}"])
    train(run)
    checkpoint = str(find_latest(tmp_path / "run" / "checkpoints"))
    expected = _velocity(load_model(run, "cpu", torch.float32, checkpoint=checkpoint), run)
    base = _velocity(build_bundle(run, torch.device("cpu"), torch.float32), run)
    assert (expected - base).abs().max() > 1e-4  # the run changed the model
    folder = export(load_config(None, [f"run_dir={tmp_path / 'run'}", f"out_dir={tmp_path / 'x'}"]))
    return run, folder, expected


def test_a_lora_run_exports_a_peft_adapter_that_reproduces_the_checkpoint(tmp_path):
    from peft import LoraConfig
    from peft.utils import set_peft_model_state_dict

    run, folder, expected = _trained(tmp_path, *LORA)
    assert sorted(os.listdir(folder)) == sorted(
        ["adapter_config.json", ADAPTER_WEIGHTS, VSA2_WEIGHTS, "vsa2_attention.json"]
    )
    bundle = build_bundle(run, torch.device("cpu"), torch.float32)
    bundle.transformer.add_adapter(LoraConfig.from_pretrained(folder))
    result = set_peft_model_state_dict(bundle.transformer, load_file(f"{folder}/{ADAPTER_WEIGHTS}"))
    assert not result.unexpected_keys
    missing = bundle.transformer.load_state_dict(
        load_file(f"{folder}/{VSA2_WEIGHTS}"), strict=False
    )
    assert not missing.unexpected_keys
    torch.testing.assert_close(_velocity(bundle, run), expected, rtol=1e-5, atol=1e-6)


def test_a_full_run_exports_a_diffusers_folder_that_reproduces_the_checkpoint(tmp_path):
    from diffusers import WanTransformer3DModel

    run, folder, expected = _trained(tmp_path)
    plain = WanTransformer3DModel.from_pretrained(os.path.join(folder, "transformer"))
    bundle = build_bundle(run, torch.device("cpu"), torch.float32)
    weights = {**plain.state_dict(), **load_file(f"{folder}/{VSA2_WEIGHTS}")}
    bundle.transformer.load_state_dict(weights, strict=True)  # every key, nothing else
    torch.testing.assert_close(_velocity(bundle, run), expected, rtol=1e-5, atol=1e-6)


def test_init_from_starts_the_adapters_from_an_export_of_the_same_shape(tmp_path):
    _, folder, _ = _trained(tmp_path, *LORA)
    started = load_config(None, [*TINY, *LORA, f"model.lora.init_from={folder}"])
    model = build_bundle(started, torch.device("cpu"), torch.float32).transformer
    trainable_parameters(model, started)
    saved = load_file(f"{folder}/{ADAPTER_WEIGHTS}")
    state = model.state_dict()
    for key, value in saved.items():  # peft saves without the adapter name
        torch.testing.assert_close(state[key.replace(".weight", ".default.weight")], value)
    other = load_config(
        None, [*TINY, *LORA[:1], "model.lora.rank=8", f"model.lora.init_from={folder}"]
    )
    with pytest.raises(ConfigError, match=r"^model\.lora\.rank: 8 differs from the adapter"):
        trainable_parameters(build_bundle(other, "cpu", torch.float32).transformer, other)


def test_export_refuses_a_folder_that_is_not_empty_and_writes_nothing(tmp_path):
    train(load_config(None, [*TINY, f"out_dir={tmp_path / 'run'}"]))
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"^out_dir: .* is not empty"):
        export(load_config(None, [f"run_dir={tmp_path / 'run'}", f"out_dir={tmp_path / 'x'}"]))
    assert os.listdir(tmp_path / "x") == ["notes.txt"]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".export-")]
