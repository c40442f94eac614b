"""Multi-process training through ``accelerate launch`` (2 CPU processes, gloo): a prompt's K
samples are split across ranks, advantages come from the gathered group, and the logged numbers
equal a 1-process run with the same global batch and seeds."""

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


def _run(command, out_dir):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [*command, *TINY, f"out_dir={out_dir}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(os.path.join(out_dir, "metrics.jsonl")) as handle:
        return [json.loads(line) for line in handle]


def test_two_processes_match_one_process(tmp_path):
    accelerate = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        os.path.join(REPO, "configs", "accelerate", "cpu_2proc.yaml"),
        "train_rl.py",
    ]
    # one prompt, 4 samples: each rank holds 2 samples of the same group
    two = _run(accelerate, tmp_path / "two")
    one = _run([sys.executable, "train_rl.py"], tmp_path / "one")
    assert [r["step"] for r in two] == [1, 2]
    for a, b in zip(one, two, strict=True):
        for key in ("reward/mean", "reward/std", "loss/policy", "train/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-6), (a["step"], key)
        assert b["train/ratio_dev_first"] < 1e-3
