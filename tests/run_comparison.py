"""Comparing two training runs bit for bit (the resume tests of the model families): their
metrics rows and their checkpoints' nested entries."""

import json
import os

import torch


def metrics_rows(out_dir) -> list[dict]:
    """The run's metrics rows without their wall-clock timings (``perf/*``)."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as handle:
        rows = [json.loads(line) for line in handle]
    return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in rows]


def checkpoint_differences(a, b, path="") -> list[str]:
    """The paths where two nested checkpoint entries are not bit-identical."""
    if isinstance(a, torch.Tensor):
        same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        return [] if same else [path]
    if isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            return [path]
        return [d for key in a for d in checkpoint_differences(a[key], b[key], f"{path}/{key}")]
    if isinstance(a, list | tuple):
        if not isinstance(b, list | tuple) or len(a) != len(b):
            return [path]
        pairs = enumerate(zip(a, b, strict=True))
        return [d for i, (x, y) in pairs for d in checkpoint_differences(x, y, f"{path}/{i}")]
    return [] if a == b else [path]


def check_resume_is_bit_identical(make_config, run: list[str], tmp_path, capsys) -> None:
    """Trains 2 steps whole, and 1 step then a resume to 2 (``make_config(*overrides)`` gives
    each run's config); asserts the resumed run's metrics rows and step-2 checkpoint (every entry
    but the recorded config, which names its out_dir: weights, optimizer, schedules, EMA, NFT's
    old policy) equal the whole run's bit for bit, and that step 2 moved the weights."""
    from vsa2_rl.rl.checkpoint import load_checkpoint
    from vsa2_rl.rl.trainer import train

    train(make_config(*run, "train.num_steps=2", f"out_dir={tmp_path / 'whole'}"))
    train(make_config(*run, "train.num_steps=1", f"out_dir={tmp_path / 'part'}"))
    part = make_config(
        *run, "train.num_steps=2", "train.resume=auto", f"out_dir={tmp_path / 'part'}"
    )
    capsys.readouterr()
    train(part)
    step_1 = tmp_path / "part" / "checkpoints" / "step_1"
    assert f"resumed from {step_1} at step 1" in capsys.readouterr().out
    whole_rows, part_rows = metrics_rows(tmp_path / "whole"), metrics_rows(tmp_path / "part")
    assert [row["step"] for row in part_rows] == [1, 2]
    assert part_rows == whole_rows
    whole = load_checkpoint(tmp_path / "whole" / "checkpoints" / "step_2")
    resumed = load_checkpoint(tmp_path / "part" / "checkpoints" / "step_2")
    assert set(whole) == set(resumed)
    for entry in sorted(set(whole) - {"config"}):
        assert checkpoint_differences(whole[entry], resumed[entry], entry) == []
    first = load_checkpoint(step_1)["model"]
    assert any(not torch.equal(first[k], v) for k, v in whole["model"].items())


def check_lora_export_round_trip(run, video, prompts, tmp_path) -> dict:
    """Trains the LoRA run ``run`` (a config), exports it with ``vsa2-rl export`` and loads the
    adapter and the VSA2 weights back with peft's own loaders onto the untouched folder's model;
    asserts its velocity (at sparsity 0.5, where the trained VSA2 parameters count, on videos
    of ``video`` = (frames, height, width)) equals the checkpoint's and differs from the base's.
    Returns the exported VSA2 weights."""
    from peft import LoraConfig
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    from vsa2_rl.config import load_eval_config
    from vsa2_rl.export import ADAPTER_WEIGHTS, VSA2_WEIGHTS, export
    from vsa2_rl.rl.checkpoint import find_latest
    from vsa2_rl.rl.trainer import train
    from vsa2_rl.runtime import build_bundle, load_model

    train(run)
    checkpoint = str(find_latest(os.path.join(run.out_dir, "checkpoints")))

    def velocity(bundle):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(2, *bundle.latent_shape(*video), generator=generator)
        bundle.sparsity_state.sparsity = 0.5
        with torch.no_grad():
            return bundle.velocity(x, torch.tensor([0.7, 0.4]), bundle.encode_prompts(prompts))

    expected = velocity(load_model(run, "cpu", torch.float32, checkpoint=checkpoint))
    base = build_bundle(run, torch.device("cpu"), torch.float32)
    assert (expected - velocity(base)).abs().max() > 1e-4  # the run changed the model
    out = export(*load_eval_config(None, [f"run_dir={run.out_dir}", f"out_dir={tmp_path / 'x'}"]))
    assert sorted(os.listdir(out)) == sorted(
        [ADAPTER_WEIGHTS, "adapter_config.json", VSA2_WEIGHTS, "vsa2_attention.json"]
    )
    base.transformer.add_adapter(LoraConfig.from_pretrained(out))
    result = set_peft_model_state_dict(base.transformer, load_file(f"{out}/{ADAPTER_WEIGHTS}"))
    assert not result.unexpected_keys
    vsa2 = load_file(f"{out}/{VSA2_WEIGHTS}")
    routers = base.transformer.load_state_dict(vsa2, strict=False)
    assert not routers.unexpected_keys
    torch.testing.assert_close(velocity(base), expected, rtol=1e-5, atol=1e-6)
    return vsa2


def recipe_on_tiny_folder(recipe: str, folder: str, video: tuple[int, int, int], out_dir):
    """configs/``recipe`` with only its sizes shrunk to a tiny model ``folder`` (its training
    prompts in ``prompts.txt`` beside it, videos of ``video`` = (frames, height, width)): one
    step of 2 groups of 2, no evaluation, its rewards swapped for a weight-free one. Call it from
    the repository root (a recipe names its evaluation prompt file from there)."""
    from vsa2_rl.config import load_config

    return load_config(os.path.join("configs", recipe), [
        f"model.path={folder}", f"out_dir={out_dir}", "attention.backend=torch",
        f"model.num_frames={video[0]}", f"model.height={video[1]}", f"model.width={video[2]}",
        f"prompts.file={os.path.join(os.path.dirname(folder), 'prompts.txt')}",
        "rl.group_size=2", "rl.prompts_per_step=2", "rl.train_batch_size=2",
        "train.num_steps=1", "train.sample_every=0", "logging.report_to=[]",
        "logging.progress=false", "eval.every=0",
        "rewards.functions=[{name: 'test_trainer:brightness'}]",
    ])  # fmt: skip


def check_one_step_trains(config) -> None:
    """Trains ``config`` for its one step; asserts one metrics row, at the configured rollout
    sparsity, with finite losses."""
    from vsa2_rl.rl.trainer import train

    train(config)
    (row,) = metrics_rows(config.out_dir)
    assert row["step"] == 1 and row["sparsity/rollout"] == config.sparsity.train
    losses = [value for key, value in row.items() if key.startswith("loss/")]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
