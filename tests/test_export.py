"""``vsa2-rl export``: a tiny toy run exported as a peft adapter (LoRA) or a diffusers folder
(full fine-tuning) plus its VSA2 parameters, loaded back by those libraries' own loaders, gives
the checkpoint's velocities; ``model.lora.init_from`` starts a run from such an adapter."""

import json
import os
import stat

import pytest
import torch
from safetensors.torch import load_file
from test_trainer import TINY as TRAINER_TINY

from vsa2_rl.cli import main
from vsa2_rl.config import ConfigError, load_config, load_eval_config
from vsa2_rl.export import ADAPTER_WEIGHTS, VSA2_WEIGHTS, export
from vsa2_rl.rl.checkpoint import find_latest
from vsa2_rl.rl.trainer import train
from vsa2_rl.runtime import build_bundle, load_model, load_prompts, trainable_parameters

FLOW_GRPO_TOY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flow_grpo_toy.yaml")

TINY = [
    *TRAINER_TINY,
    "train.learning_rate=1e-2",  # one step moves the weights well above rounding
    "train.num_steps=1",
    "rewards.functions=[{name: 'test_trainer:brightness'}]",
]
LORA = ["model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=4"]


def _velocity(bundle, config):
    """The model's velocity at sparsity 0.9 (so the VSA2 parameters count) on fixed inputs."""
    generator = torch.Generator().manual_seed(0)
    shape = bundle.latent_shape(config.model.num_frames, config.model.height, config.model.width)
    x = torch.randn(2, *shape, generator=generator)
    bundle.sparsity_state.sparsity = 0.9
    emb = bundle.encode_prompts(["a red square moving left fast", "a blue circle"])
    with torch.no_grad():
        return bundle.velocity(x, torch.tensor([0.7, 0.4]), emb)


def _trained(tmp_path, *extra):
    run = load_config(FLOW_GRPO_TOY, [*TINY, *extra, f"out_dir={tmp_path / 'run'}"])
    train(run)
    checkpoint = str(find_latest(tmp_path / "run" / "checkpoints"))
    expected = _velocity(load_model(run, "cpu", torch.float32, checkpoint=checkpoint), run)
    base = _velocity(build_bundle(run, torch.device("cpu"), torch.float32), run)
    assert (expected - base).abs().max() > 1e-4  # the run changed the model
    folder = export(
        *load_eval_config(None, [f"run_dir={tmp_path / 'run'}", f"out_dir={tmp_path / 'x'}"])
    )
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
    started = load_config(FLOW_GRPO_TOY, [*TINY, *LORA, f"model.lora.init_from={folder}"])
    model = build_bundle(started, torch.device("cpu"), torch.float32).transformer
    trainable_parameters(model, started)
    saved = load_file(f"{folder}/{ADAPTER_WEIGHTS}")
    state = model.state_dict()
    for key, value in saved.items():  # peft saves without the adapter name
        torch.testing.assert_close(state[key.replace(".weight", ".default.weight")], value)
    routers = load_file(f"{folder}/{VSA2_WEIGHTS}")  # trained with the adapters: taken too
    base = build_bundle(started, torch.device("cpu"), torch.float32).transformer.state_dict()
    assert any(not torch.equal(base[key], value) for key, value in routers.items())
    for key, value in routers.items():
        torch.testing.assert_close(state[key], value)
    other = load_config(
        FLOW_GRPO_TOY, [*TINY, *LORA[:1], "model.lora.rank=8", f"model.lora.init_from={folder}"]
    )
    with pytest.raises(ConfigError, match=r"^model\.lora\.rank: 8 differs from the adapter"):
        trainable_parameters(build_bundle(other, "cpu", torch.float32).transformer, other)


def test_export_refuses_a_folder_that_is_not_empty_and_writes_nothing(tmp_path):
    train(load_config(FLOW_GRPO_TOY, [*TINY, f"out_dir={tmp_path / 'run'}"]))
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"^out_dir: .* is not empty"):
        export(
            *load_eval_config(None, [f"run_dir={tmp_path / 'run'}", f"out_dir={tmp_path / 'x'}"])
        )
    assert os.listdir(tmp_path / "x") == ["notes.txt"]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".export-")]


def test_kl_reward_penalty_is_the_sampled_log_ratio_to_the_reference(tmp_path, monkeypatch):
    # a LoRA run started from a trained export differs from its reference (adapters off) at
    # step 1: its logged penalty is the mean over samples of sum_j log p - log p_ref of the
    # transitions it drew, recomputed here with the base model
    from vsa2_rl.rl import rollout as rollout_module
    from vsa2_rl.sampling import sigma_schedule, step_log_prob

    _, folder, _ = _trained(tmp_path, *LORA)
    trajectories, real_sample = [], rollout_module.sample

    def recording_sample(velocity_fn, noise, sigmas, **kwargs):
        trajectories.append(real_sample(velocity_fn, noise, sigmas, **kwargs))
        return trajectories[-1]

    monkeypatch.setattr(rollout_module, "sample", recording_sample)
    kl = ["rl.kl_beta=1.0", "rl.kl_mode=reward", f"model.lora.init_from={folder}"]
    run = load_config(FLOW_GRPO_TOY, [*TINY, *LORA, *kl, f"out_dir={tmp_path / 'kl'}"])
    train(run)
    logged = json.loads((tmp_path / "kl" / "metrics.jsonl").read_text().splitlines()[-1])

    reference = build_bundle(run, torch.device("cpu"), torch.float32)  # no adapters
    # the routers and gates the run started from (the export's), which adapters-off keeps
    reference.transformer.load_state_dict(load_file(f"{folder}/{VSA2_WEIGHTS}"), strict=False)
    reference.sparsity_state.sparsity = 0.9
    sigmas = sigma_schedule(run.sampler.num_steps)
    prompts = [load_prompts(run)[i] for i in _batch_prompts(run)]
    emb = reference.encode_prompts(prompts)
    penalties = []
    for trajectory in trajectories:  # one chunk: every sample of the step
        penalty = torch.zeros(trajectory.latents.shape[1])
        for j in torch.nonzero(trajectory.stochastic).flatten().tolist():
            x, x_next = trajectory.latents[j], trajectory.latents[j + 1]
            sigma = torch.full((x.shape[0],), float(sigmas[j]))
            v = reference.velocity(x, sigma, emb)
            ref = step_log_prob(v, x, x_next, float(sigmas[j]), float(sigmas[j + 1]), "sde", 0.7)
            penalty += trajectory.log_probs[j] - ref[0]
        penalties.append(penalty)
    expected = torch.cat(penalties).mean().item()
    assert abs(expected) > 1e-9
    assert logged["train/kl_penalty"] == pytest.approx(expected, rel=1e-4)


def _batch_prompts(config):
    from vsa2_rl.rl.grpo import GroupedPromptSampler

    sampler = GroupedPromptSampler(
        len(load_prompts(config)), config.rl.group_size, config.rl.prompts_per_step,
        seed=config.seed,
    )  # fmt: skip
    return sampler.batch(0).prompt_indices


def test_a_checkpoint_moved_out_of_its_run_exports_with_its_own_settings(tmp_path):
    import shutil

    sparse = ["attention.kv_block=64", "attention.mode=topk", "sparsity.train=0.5"]
    run = load_config(
        FLOW_GRPO_TOY, [*TINY, *sparse, "sparsity.eval=0.5", f"out_dir={tmp_path / 'run'}"]
    )
    train(run)
    moved = tmp_path / "elsewhere" / "step_1"
    shutil.copytree(find_latest(tmp_path / "run" / "checkpoints"), moved)
    folder = export(*load_eval_config(None, [f"checkpoint={moved}", f"out_dir={tmp_path / 'x'}"]))
    with open(os.path.join(folder, "vsa2_attention.json"), encoding="utf-8") as handle:
        settings = json.load(handle)
    assert settings["attention"]["kv_block"] == 64 and settings["attention"]["mode"] == "topk"
    assert settings["sparsity"]["train"] == 0.5


@pytest.fixture(scope="module", params=["lora", "full"])
def trained_run(request, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp(request.param) / "run"
    train(
        load_config(
            FLOW_GRPO_TOY, [*TINY, *(LORA if request.param == "lora" else []), f"out_dir={run_dir}"]
        )
    )
    return run_dir


def _modes(folder) -> dict[str, int]:
    """Permission bits of the folder and of everything in it, by path relative to it."""
    paths = [folder] + [
        os.path.join(root, name) for root, dirs, files in os.walk(folder) for name in dirs + files
    ]
    return {os.path.relpath(path, folder): stat.S_IMODE(os.stat(path).st_mode) for path in paths}


@pytest.mark.parametrize(
    ("umask", "folders", "files"), [(0o022, 0o755, 0o644), (0o027, 0o750, 0o640)]
)
def test_an_export_gets_the_permissions_the_umask_gives(
    umask, folders, files, trained_run, tmp_path
):
    before = os.umask(umask)
    try:
        folder = export(
            *load_eval_config(None, [f"run_dir={trained_run}", f"out_dir={tmp_path / 'x'}"])
        )
    finally:
        os.umask(before)
    modes = _modes(folder)
    assert len(modes) >= 4
    assert modes == {
        path: folders if os.path.isdir(os.path.join(folder, path)) else files for path in modes
    }


def test_export_needs_an_out_dir_of_its_own(trained_run, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # where the config's out_dir (runs/default) would be
    assert main(["export", f"run_dir={trained_run}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: out_dir: export needs out_dir=DIR")
    assert os.listdir(tmp_path) == []


def test_export_refuses_an_out_dir_inside_a_checkpoint(trained_run, tmp_path, capsys):
    checkpoint = find_latest(trained_run / "checkpoints")
    for out_dir in (checkpoint / "peft", trained_run / "checkpoints" / "peft"):
        assert main(["export", f"run_dir={trained_run}", f"out_dir={out_dir}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: out_dir: {out_dir} lies inside")
        assert not out_dir.exists()
    assert find_latest(trained_run / "checkpoints") == checkpoint  # still whole


def test_export_into_a_link_to_an_empty_folder_fills_that_folder(trained_run, tmp_path):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    export(*load_eval_config(None, [f"run_dir={trained_run}", f"out_dir={tmp_path / 'link'}"]))
    assert os.path.islink(tmp_path / "link")
    assert VSA2_WEIGHTS in os.listdir(tmp_path / "real")


@pytest.mark.parametrize("damage", ["truncate", "pickle"])
def test_export_of_a_damaged_checkpoint_is_one_line_before_config_pt_is_read(
    trained_run, tmp_path, capsys, damage
):
    import shutil

    copy = tmp_path / "step_1"
    shutil.copytree(find_latest(trained_run / "checkpoints"), copy)
    recorded = copy / "config.pt"
    if damage == "truncate":
        recorded.write_bytes(recorded.read_bytes()[:100])
    else:
        recorded.write_bytes(b"\x80\x04cos\nsystem\n.")
    assert main(["export", f"checkpoint={copy}", f"out_dir={tmp_path / 'x'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith(f"error: checkpoint: {copy} is not a usable checkpoint: config.pt")


def test_init_from_refuses_router_weights_of_another_shape_in_one_line(tmp_path):
    from safetensors.torch import save_file

    from vsa2_rl.runtime import _load_vsa2

    config = load_config(FLOW_GRPO_TOY, [*TINY, *LORA])
    model = build_bundle(config, torch.device("cpu"), torch.float32).transformer
    routers = {k: v for k, v in model.state_dict().items() if ".vsa2." in f".{k}"}
    name = sorted(routers)[0]
    routers[name] = torch.zeros(routers[name].numel() + 1)  # another model's layer size
    save_file(routers, str(tmp_path / VSA2_WEIGHTS))
    with pytest.raises(ConfigError, match=rf"^model.lora.init_from: .* \(\['{name}'\] differ\)"):
        _load_vsa2(model, str(tmp_path))
