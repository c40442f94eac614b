"""Pre-flight (vsa2_rl.preflight): every command refuses a config its model cannot run before
any weight loads, with the same line naming the key."""

import os

import pytest

from vsa2_rl.check import check
from vsa2_rl.cli import main
from vsa2_rl.config import ConfigError, load_config
from vsa2_rl.eval import evaluate

FLOW_GRPO_TOY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flow_grpo_toy.yaml")
SECOND_GUIDANCE = "the guidance scale of the low-noise expert's steps needs a model of two experts"


@pytest.mark.parametrize("key", ["sampler.guidance_scale_2", "eval.guidance_scale_2"])
def test_check_and_train_refuse_a_second_guidance_scale_for_one_transformer(key, tmp_path, capsys):
    """The toy has one transformer: no boundary for a second scale. ``check`` lists it and
    ``train`` stops on it before its folder exists (a Flow-GRPO run: nft refuses rollout
    guidance for its own reason)."""
    overrides = [f"{key}=2.0"]
    assert check(FLOW_GRPO_TOY, overrides).problems == [
        f"{key}: {SECOND_GUIDANCE} (Wan2.2 A14B); leave it empty"
    ]
    out_dir = tmp_path / "run"
    assert main(["train", "--config", FLOW_GRPO_TOY, *overrides, f"out_dir={out_dir}"]) == 2
    assert capsys.readouterr().err.startswith(f"error: {key}: {SECOND_GUIDANCE}")
    assert not out_dir.exists()


def test_eval_refuses_a_second_guidance_scale_before_any_model_loads(tmp_path, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model loaded before the pre-flight refused the config")

    monkeypatch.setattr("vsa2_rl.eval.sweep.load_model", no_loading)
    config = load_config(None, ["eval.guidance_scale_2=2.0", f"out_dir={tmp_path / 'eval'}"])
    with pytest.raises(ConfigError, match=rf"^eval\.guidance_scale_2: {SECOND_GUIDANCE}"):
        evaluate(config)
    assert not os.path.exists(tmp_path / "eval")
