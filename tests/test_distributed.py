"""Multi-process training on 2 CPU processes (gloo): a prompt's K samples are split across
ranks, advantages come from the gathered group, and the logged numbers equal a 1-process run
with the same global batch and seeds.

The processes are started by ``torch.distributed.run`` (torchrun), whose environment the
trainer's ``Accelerator`` picks up. ``accelerate launch`` starts several CPU processes only
through mpirun; without it, it silently runs one (a multi-CPU config file gave 1 process).
"""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [
    "model.num_frames=4",
    "model.height=16",
    "model.width=16",
    "sampler.num_steps=3",
    "sampler.sde_window=[0,2]",
    "grpo.prompts_per_step=1",
    "grpo.group_size=4",
    "grpo.train_batch_size=4",
    "train.num_steps=2",
    "train.learning_rate=1e-3",
    "train.sample_every=0",
    "logging.progress=false",
    "rewards.num_workers=1",
    "eval.every=0",
    # whole-model runs use the torch reference; the Triton interpreter is tested on the kernels
    "attention.backend=torch",
]


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]


def _run(command, out_dir, *overrides):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [*command, *TINY, f"out_dir={out_dir}", *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(os.path.join(out_dir, "metrics.jsonl")) as handle:
        return [json.loads(line) for line in handle]


def test_two_processes_match_one_process(tmp_path):
    # one prompt, 4 samples: each rank holds 2 samples of the same group
    two = _run([*TORCHRUN, "train_rl.py"], tmp_path / "two")
    one = _run([sys.executable, "train_rl.py"], tmp_path / "one")
    assert [r["step"] for r in two] == [1, 2]
    for a, b in zip(one, two, strict=True):
        for key in ("reward/mean", "reward/std", "loss/policy", "train/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-6), (a["step"], key)
        assert b["train/ratio_dev_first"] < 1e-3


def constant_on_rank0(videos, prompts, metadata):
    """Test reward: a constant on rank 0 (its groups have zero variance, so it has nothing to
    train) and the mean brightness elsewhere."""
    import torch

    if os.environ.get("WORLD_SIZE") == "2" and os.environ.get("RANK") == "0":  # torchrun sets both
        return torch.full((videos.shape[0],), 0.5)
    return videos.float().mean(dim=(1, 2, 3, 4))


def test_a_rank_without_trainable_samples_keeps_step_with_the_others(tmp_path):
    """Every rank must run the same number of backward passes (DDP all-reduces, DeepSpeed
    reduce-scatters per backward) even when all of one rank's groups have zero variance."""
    rows = _run(
        [*TORCHRUN, "train_rl.py"],
        tmp_path / "two",
        # 2 prompts x 2 samples: each rank holds one whole group
        "grpo.prompts_per_step=2",
        "grpo.group_size=2",
        "grpo.train_batch_size=1",
        "rewards.functions=[{name: 'tests.test_distributed:constant_on_rank0'}]",
    )
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["train/zero_var_frac"] == 0.5  # rank 0's group
        assert row["train/grad_norm"] > 0 and row["train/skipped_nonfinite"] == 0


@pytest.mark.parametrize("processes", [2, 4])
def test_sequence_parallel_matches_one_process(tmp_path, processes):
    # every rank shares every video, holding 1 / processes of its tokens (a 4 x 16 x 16 latent
    # is 4 x 8 x 8 = 256 tokens); two steps, with their evaluations, must equal one process's
    from safetensors.torch import load_file

    common = ["train.checkpoint_every=2", "eval.every=2", "eval.num_prompts=2"]
    torchrun = [*TORCHRUN[:-1], str(processes), "train_rl.py"]
    sp = _run(torchrun, tmp_path / "two", f"parallel.sequence_parallel_size={processes}", *common)
    one = _run([sys.executable, "train_rl.py"], tmp_path / "one", *common)
    assert [r["step"] for r in sp] == [0, 1, 2]
    for a, b in zip(one, sp, strict=True):
        keys = ("eval/reward",) if a["step"] == 0 else ("reward/mean", "loss/policy")
        keys += ("train/grad_norm", "reward/std", "eval/reward") if a["step"] == 2 else ()
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), (a["step"], key)
    weights = [
        load_file(os.path.join(tmp_path, run, "checkpoints", "step_2", "model.safetensors"))
        for run in ("one", "two")
    ]
    for name, value in weights[0].items():  # relative RMS per tensor
        error = (weights[1][name].double() - value.double()).pow(2).mean().sqrt()
        assert error <= 1e-4 * value.double().pow(2).mean().sqrt() + 1e-12, name


def test_a_sequence_parallel_run_resumes_as_it_would_have_gone_on(tmp_path):
    sp = ["parallel.sequence_parallel_size=2", "train.checkpoint_every=1"]
    torchrun = [*TORCHRUN, "train_rl.py"]
    whole = _run(torchrun, tmp_path / "whole", *sp)
    _run(torchrun, tmp_path / "part", *sp, "train.num_steps=1")
    resumed = _run(torchrun, tmp_path / "part", *sp)  # train.resume=auto, to step 2
    assert [r["step"] for r in resumed] == [1, 2]
    for key in ("reward/mean", "loss/policy", "train/grad_norm"):
        assert resumed[1][key] == pytest.approx(whole[1][key], rel=1e-5, abs=1e-8), key


def test_a_group_size_that_does_not_divide_the_heads_is_one_error_line(tmp_path):
    # the toy model has 4 heads; 3 processes in one group of 3
    command = [*TORCHRUN[:-1], "3", "train_rl.py", *TINY, f"out_dir={tmp_path / 'run'}",
               "parallel.sequence_parallel_size=3"]  # fmt: skip
    result = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode != 0
    assert (
        "error: parallel.sequence_parallel_size: the group size (3) must divide the number of "
        "attention heads (4)" in result.stderr
    )
    assert not os.path.exists(tmp_path / "run")
