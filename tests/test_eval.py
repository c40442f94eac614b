"""Sparsity-sweep evaluation: density falls with sparsity, seeds reproduce, sparsity 0 is the
plain dense model, outputs parse, and bad input gives one clear message and no table."""

import itertools
import json
import os
import tempfile

import pytest
import torch

from vsa2_rl.config import ConfigError, load_config, load_eval_config
from vsa2_rl.eval import evaluate, sweep_model
from vsa2_rl.rewards import RewardError, get_reward
from vsa2_rl.runtime import build_bundle

FLOW_GRPO_TOY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flow_grpo_toy.yaml")

SMALL = [
    "model.num_frames=4",
    "model.height=16",
    "model.width=16",
    "sampler.eval_num_steps=3",
    "eval.num_prompts=2",
    "logging.progress=false",
    "rewards.functions=[{name: motion_quality}]",
    # whole-model runs use the torch reference; the Triton interpreter is tested on the kernels
    "attention.backend=torch",
]


def broken(videos, prompts, metadata):
    raise RuntimeError("scorer crashed")


def _sweep(bundle, sparsities, seed=7):
    return sweep_model(
        bundle,
        ["a red square moving right fast", "a blue circle moving up slow"],
        sparsities,
        [get_reward("test_trainer:brightness")],
        num_steps=3,
        shift=1.0,
        guidance_scale=1.0,
        seed=seed,
        batch_size=2,
        shape=(4, 16, 16),
        progress=False,
    )


@pytest.fixture(scope="module")
def bundle():
    config = load_config(FLOW_GRPO_TOY, SMALL)
    return build_bundle(config, torch.device("cpu"), torch.float32)


def test_density_falls_as_sparsity_rises(bundle):
    rows, _ = _sweep(bundle, [0.0, 0.5, 0.75, 0.9])
    densities = [row["density"] for row in rows]
    assert densities[0] == 1.0
    assert all(a > b for a, b in itertools.pairwise(densities))
    # 4x8x8 tokens = 16 segments of 16: max_kv = ceil(0.1 * 16) = 2 segments per query tile
    assert densities[-1] <= 2 / 16 + 1e-6


def test_same_seed_gives_same_videos(bundle):
    _, first = _sweep(bundle, [0.75])
    _, again = _sweep(bundle, [0.75])
    _, other = _sweep(bundle, [0.75], seed=8)
    assert torch.equal(first[0.75].videos, again[0.75].videos)
    assert not torch.allclose(first[0.75].videos, other[0.75].videos)


def test_sparsity_zero_is_the_model_without_vsa2(bundle):
    _, with_vsa2 = _sweep(bundle, [0.0])
    dense_config = load_config(FLOW_GRPO_TOY, [*SMALL, "attention.enabled=false"])
    plain = build_bundle(dense_config, torch.device("cpu"), torch.float32)
    _, without = _sweep(plain, [0.0])
    torch.testing.assert_close(with_vsa2[0.0].videos, without[0.0].videos, rtol=0, atol=1e-6)


def test_outputs_exist_and_parse(tmp_path):
    config = load_config(
        FLOW_GRPO_TOY, [*SMALL, f"out_dir={tmp_path}", "eval.sparsities=[0.0,0.9]"]
    )
    rows = evaluate(config)
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert saved == rows
    assert [row["sparsity"] for row in saved] == [0.0, 0.9]
    for row in saved:
        assert {"sparsity", "density", "latency_s", "reward/motion_quality"} <= set(row)
        assert "reward/motion_quality_std" in row and row["latency_s"] > 0
    # the rollout agreement on the first eval.agreement_prompts (8 by default: both) prompts
    assert saved[0]["velocity_rel_error"] == 0.0 < saved[1]["velocity_rel_error"]
    table = (tmp_path / "eval.md").read_text().splitlines()
    assert len(table) == 2 + len(saved) and "reward/motion_quality" in table[0]
    assert "velocity_rel_error" in table[0]
    assert (tmp_path / "eval.png").stat().st_size > 0
    assert (tmp_path / "samples" / "toy" / "sparsity_0.9.png").exists()


def test_failing_reward_leaves_no_partial_table(tmp_path):
    config = load_config(
        FLOW_GRPO_TOY,
        [*SMALL, f"out_dir={tmp_path / 'out'}", "rewards.functions=[{name: 'test_eval:broken'}]"],
    )
    with pytest.raises(RewardError, match="broken"):
        evaluate(config)
    assert not (tmp_path / "out").exists()


def test_run_dir_without_checkpoints_is_rejected(tmp_path):
    run_dir = tmp_path / "run"
    os.makedirs(run_dir / "checkpoints" / ".tmp-step_3-x")
    (run_dir / "config.yaml").write_text("seed: 0\n")
    config, targets = load_eval_config(
        None, [*SMALL, f"run_dir={run_dir}", f"out_dir={tmp_path / 'out'}"]
    )
    with pytest.raises(ConfigError, match="run_dir: no complete checkpoint"):
        evaluate(config, targets)
    assert not (tmp_path / "out").exists()


def test_previews_carry_each_videos_rewards(bundle):
    rows, previews = _sweep(bundle, [0.75])
    scores = [score["brightness"] for score in previews[0.75].scores]
    expected = previews[0.75].videos.mean(dim=(1, 2, 3, 4))  # the reward, computed here
    torch.testing.assert_close(torch.tensor(scores), expected, rtol=1e-6, atol=1e-7)
    assert rows[0]["reward/brightness"] == pytest.approx(sum(scores) / len(scores))


def test_sample_videos_are_also_written_as_mp4_where_opencv_encodes():
    cv2 = pytest.importorskip("cv2")
    from vsa2_rl.eval.media import save_video_grid

    ramp = torch.linspace(0, 1, 8).view(1, 8, 1, 1, 1).expand(2, 8, 3, 16, 16)  # fades in
    with tempfile.TemporaryDirectory() as folder:
        save_video_grid(ramp, os.path.join(folder, "clip"), scale=2)
        capture = cv2.VideoCapture(os.path.join(folder, "clip.mp4"))
        frames = []
        while (frame := capture.read())[0]:
            frames.append(frame[1])
    assert len(frames) == 8 and frames[0].shape == (32, 64, 3)
    means = [float(frame.mean()) / 255 for frame in frames]
    assert means == pytest.approx(ramp[0, :, 0, 0, 0].tolist(), abs=0.05)


def test_run_labels_are_the_shortest_distinct_path_suffixes():
    from vsa2_rl.eval.sweep import run_labels

    paths = ["x/A/run", "/y/B/run/", "z/other", "w/A/b", "v/C/b"]
    assert run_labels(paths) == ["A/run", "B/run", "other", "A/b", "C/b"]
    assert run_labels(["runs/a", "runs/b"]) == ["a", "b"]


def test_runs_with_the_same_folder_name_get_their_own_rows_and_samples(tmp_path):
    import shutil

    from test_trainer import TINY

    from vsa2_rl.rl.trainer import train

    first, second = tmp_path / "A" / "run", tmp_path / "B" / "run"
    train(load_config(FLOW_GRPO_TOY, [*TINY, "train.num_steps=1", f"out_dir={first}"]))
    shutil.copytree(first, second)
    out = tmp_path / "eval"
    config, targets = load_eval_config(
        None, [*SMALL, f"run_dirs=[{first},{second}]", f"out_dir={out}", "eval.sparsities=[0.9]"]
    )
    assert [row["run"] for row in evaluate(config, targets)] == ["A/run", "B/run"]
    assert [row["run"] for row in json.loads((out / "eval.json").read_text())] == ["A/run", "B/run"]
    assert (out / "samples" / "A" / "run" / "sparsity_0.9.png").exists()
    assert (out / "samples" / "B" / "run" / "sparsity_0.9.png").exists()


def test_a_folder_of_run_dirs_that_is_no_run_is_refused_by_that_key(tmp_path):
    config, targets = load_eval_config(None, [*SMALL, f"run_dirs=[{tmp_path}]"])
    with pytest.raises(ConfigError, match=r"^run_dirs: .* is not a training run"):
        evaluate(config, targets)
    config, targets = load_eval_config(None, [*SMALL, f"run_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"^run_dir: .* is not a training run"):
        evaluate(config, targets)


def test_a_run_given_twice_is_refused(tmp_path):
    config, targets = load_eval_config(None, [*SMALL, f"run_dirs=[{tmp_path},{tmp_path}/]"])
    with pytest.raises(ConfigError, match=r"^run_dirs: .* is given twice"):
        evaluate(config, targets)


PLANTED = []


def planted(**kwargs):
    """A reward a run folder's config could name: it must never be built by eval."""
    PLANTED.append(kwargs)
    return broken


def test_eval_never_builds_the_rewards_a_run_folder_records(tmp_path):
    from test_trainer import TINY

    from vsa2_rl.rl.trainer import train

    run = tmp_path / "run"
    brightness = "rewards.functions=[{name: 'test_trainer:brightness'}]"
    train(load_config(FLOW_GRPO_TOY, [*TINY, brightness, "train.num_steps=1", f"out_dir={run}"]))
    recorded = (run / "config.yaml").read_text()
    assert "test_trainer:brightness" in recorded  # TINY's trained reward, replaced below
    (run / "config.yaml").write_text(
        recorded.replace("test_trainer:brightness", "test_eval:planted")
    )
    config, targets = load_eval_config(
        None, [*SMALL, f"run_dir={run}", f"out_dir={tmp_path / 'eval'}", "eval.sparsities=[0.9]"]
    )
    (row,) = evaluate(config, targets)
    assert PLANTED == [] and "reward/motion_quality" in row


def test_eval_refuses_an_out_dir_inside_a_checkpoint(tmp_path):
    from vsa2_rl.rl.checkpoint import save_checkpoint, verify_checkpoint

    checkpoint = save_checkpoint(tmp_path / "run" / "checkpoints", 1, {"m": {"w": torch.ones(1)}})
    config = load_config(FLOW_GRPO_TOY, [*SMALL, f"out_dir={checkpoint / 'eval'}"])
    with pytest.raises(ConfigError, match=rf"^out_dir: {checkpoint}/eval lies inside {checkpoint}"):
        evaluate(config)
    assert verify_checkpoint(checkpoint) is None


def test_a_folder_named_checkpoints_that_holds_no_run_may_hold_outputs(tmp_path):
    from vsa2_rl.runtime import check_output_dir

    (tmp_path / "config.yaml").write_text("seed: 0\n")  # a project's config, not a run's
    check_output_dir(str(tmp_path / "checkpoints" / "eval"))  # no error: no run there
    (tmp_path / ".lock").touch()  # now it is a training run's folder
    with pytest.raises(ConfigError, match=r"lies inside .*/checkpoints, a run's checkpoints"):
        check_output_dir(str(tmp_path / "checkpoints" / "eval"))


def test_a_run_dir_that_does_not_exist_is_named_as_missing(tmp_path):
    config, targets = load_eval_config(None, [*SMALL, f"run_dir={tmp_path / 'gone'}"])
    with pytest.raises(ConfigError, match=rf"^run_dir: folder not found: {tmp_path / 'gone'} \("):
        evaluate(config, targets)
