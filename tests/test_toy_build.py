"""vsa2_rl.toy.build on the CPU at a tiny size: a build stopped between two steps and built
again into its folder, or killed while a stage's end is measured and built again, ends where
the uninterrupted build ends (weights bit for bit, figures and curves equal), and a stopped
stage's state is refused by another recipe."""

import json

import pytest
import torch
from safetensors.torch import load_file

from vsa2_rl.config import VSA2Config
from vsa2_rl.toy import build as build_module
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


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The folder of the tiny recipe built without a stop."""
    folder = tmp_path_factory.mktemp("whole")
    build_toy_model(folder, tiny_recipe(), log=lambda line: None)
    return folder


def assert_same_build(folder, reference) -> None:
    """Weights bit for bit and the training info (times aside) equal to ``reference``'s."""
    built, expected = load_file(folder / WEIGHTS_FILE), load_file(reference / WEIGHTS_FILE)
    assert built.keys() == expected.keys()
    assert all(torch.equal(built[name], expected[name]) for name in built)
    assert training_info(folder) == training_info(reference)


@pytest.mark.slow
def test_a_stopped_build_continues_as_the_uninterrupted_build(tmp_path, uninterrupted):
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
    assert_same_build(stopped, uninterrupted)


@pytest.mark.slow
def test_a_build_killed_at_a_stage_end_continues_after_its_last_step(
    tmp_path, uninterrupted, monkeypatch
):
    measure = build_module._stage_report

    def killed_at_stage_1(modules, state, config, stage, samples_dir=None):
        if stage.size == 32:
            raise KeyboardInterrupt  # as a worker killed while it draws the stage's samples
        return measure(modules, state, config, stage, samples_dir)

    monkeypatch.setattr(build_module, "_stage_report", killed_at_stage_1)
    with pytest.raises(KeyboardInterrupt):
        build_toy_model(tmp_path, tiny_recipe(), log=lambda line: None)
    assert (tmp_path / PARTIAL_FILE).exists()
    monkeypatch.setattr(build_module, "_stage_report", measure)
    lines = []
    build_toy_model(tmp_path, tiny_recipe(), log=lines.append, resume_from=tmp_path)
    assert "stage 1: continuing at step 6" in " ".join(lines)
    assert " step " not in " ".join(line for line in lines if "continuing" not in line)
    assert not (tmp_path / PARTIAL_FILE).exists()
    assert_same_build(tmp_path, uninterrupted)


def test_a_stopped_stage_is_refused_by_another_recipe(tmp_path):
    with pytest.raises(BuildStopped):
        build_toy_model(tmp_path, tiny_recipe(), log=lambda line: None,
                        stop_requested=stop_before(6))  # fmt: skip
    with pytest.raises(ValueError, match=r"holds the state of another stage or recipe.*delete it"):
        build_toy_model(tmp_path, tiny_recipe(rebase_stage_steps=8), log=lambda line: None,
                        resume_from=tmp_path)  # fmt: skip


def test_no_caption_dropout_keeps_every_caption_and_draws_nothing():
    generator = torch.Generator().manual_seed(5)
    before = generator.get_state()
    prompts = ["a red square moves left", "a blue disc moves up"]
    assert build_module.drop_captions(prompts, 0.0, generator) == prompts
    assert torch.equal(generator.get_state(), before)  # the shipped base's random stream


def test_caption_dropout_empties_its_share_and_keeps_the_rest_in_order():
    prompts = [f"prompt {i}" for i in range(20_000)]
    kept = build_module.drop_captions(prompts, 0.3, torch.Generator().manual_seed(0))
    dropped = [text == "" for text in kept]
    # binomial: sd sqrt(0.3 * 0.7 / 20000) = 0.0032; within 5 sd
    assert abs(sum(dropped) / len(prompts) - 0.3) < 0.016
    assert all(k in ("", p) for k, p in zip(kept, prompts, strict=True))
    assert build_module.drop_captions(prompts[:3], 1.0, torch.Generator()) == ["", "", ""]
