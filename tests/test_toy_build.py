"""vsa2_rl.toy.build on the CPU at a tiny size: a build stopped between two steps and built
again into its folder ends where the uninterrupted build ends (weights bit for bit, figures
and curves equal), and a stopped stage's state is refused by another recipe."""

import json

import pytest
import torch
from safetensors.torch import load_file

from vsa2_rl.config import VSA2Config
from vsa2_rl.toy.build import (
    PARTIAL_FILE,
    BuildStopped,
    ToyBuildConfig,
    ToyStage,
    build_toy_model,
)
from vsa2_rl.toy.model import CONFIG_FILE, WEIGHTS_FILE


def tiny_recipe(rebase_stage_steps: int = 6) -> ToyBuildConfig:
    """A dense 16 px stage, then a VSA2 stage rebased over 4 steps (sparsity drawn after)."""
    return ToyBuildConfig(
        stages=[
            ToyStage(16, 4, steps=4, batch_size=2, vsa2=False),
            ToyStage(32, 4, rebase_stage_steps, 2, vsa2=True, sparsity_range=(0.5, 0.75)),
        ],
        architecture={
            "num_attention_heads": 2,
            "attention_head_dim": 16,
            "ffn_dim": 64,
            "num_layers": 2,
            "freq_dim": 32,
        },
        warmup_lr_steps=2,
        rebase_steps=4,
        vsa2=VSA2Config(backend="torch"),
        val_videos=4,
        val_every=2,
        eval_sparsities=(0.0, 0.75),
        report_seeds=1,
        report_steps=2,
    )


def stop_before(call: int):
    """A ``stop_requested`` that turns true at its ``call``-th call (one call per step)."""
    calls = iter(range(1, 10**6))
    return lambda: next(calls) >= call


def training_info(folder) -> dict:
    info = json.loads((folder / CONFIG_FILE).read_text())["training"]
    return {key: value for key, value in info.items() if "seconds" not in key}


def test_a_stopped_build_continues_as_the_uninterrupted_build(tmp_path):
    build_toy_model(tmp_path / "whole", tiny_recipe(), log=lambda line: None)
    stopped = tmp_path / "stopped"
    # 4 steps of stage 0, then stage 1 stops before its step 2: mid-ramp, after one curve point
    with pytest.raises(BuildStopped, match="stage 1 stopped before step 2"):
        build_toy_model(stopped, tiny_recipe(), log=lambda line: None,
                        stop_requested=stop_before(7))  # fmt: skip
    assert (stopped / PARTIAL_FILE).exists()
    assert len(training_info(stopped)["stages"]) == 1
    lines = []
    build_toy_model(stopped, tiny_recipe(), log=lines.append, resume_from=stopped)
    assert "stage 1: continuing at step 2" in " ".join(lines)
    assert not (stopped / PARTIAL_FILE).exists()
    whole, continued = (
        load_file(tmp_path / "whole" / WEIGHTS_FILE),
        load_file(stopped / WEIGHTS_FILE),
    )
    assert whole.keys() == continued.keys()
    assert all(torch.equal(whole[name], continued[name]) for name in whole)
    assert training_info(stopped) == training_info(tmp_path / "whole")


def test_a_stopped_stage_is_refused_by_another_recipe(tmp_path):
    with pytest.raises(BuildStopped):
        build_toy_model(tmp_path, tiny_recipe(), log=lambda line: None,
                        stop_requested=stop_before(6))  # fmt: skip
    with pytest.raises(ValueError, match=r"holds the state of another stage or recipe.*delete it"):
        build_toy_model(tmp_path, tiny_recipe(rebase_stage_steps=8), log=lambda line: None,
                        resume_from=tmp_path)  # fmt: skip
