"""Multi-process training on 2 CPU processes (gloo): a prompt's K samples are split across
ranks, advantages come from the gathered group, and the logged numbers equal a 1-process run
with the same global batch and seeds.

The processes are started by ``torch.distributed.run`` (torchrun), whose environment the
trainer's ``Accelerator`` picks up. ``accelerate launch`` starts several CPU processes only
through mpirun; without it, it silently runs one (a multi-CPU config file gave 1 process).
An FSDP config file is the exception: ``accelerate launch --config_file
configs/accelerate/fsdp2.yaml`` starts them through torchrun, and the FSDP2 tests run the
trainer under it through tests/fsdp2_cpu_worker.py (accelerate enables FSDP on GPUs only).
"""

import fcntl
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # every test starts processes that train

FLOW_GRPO_TOY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flow_grpo_toy.yaml")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [
    "--config",
    FLOW_GRPO_TOY,
    "model.num_frames=4",
    "model.height=16",
    "model.width=16",
    "sampler.num_steps=3",
    "sampler.sde_window=[0,2]",
    "rl.prompts_per_step=1",
    "rl.group_size=4",
    "rl.train_batch_size=4",
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
    return _rows(out_dir)


def _rows(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as handle:
        return [json.loads(line) for line in handle]


def _assert_same_weights(out_dir, reference_dir, rel=1e-4, entry="model", step=2):
    """Every tensor of the two runs' ``step`` checkpoints agrees to ``rel`` (relative RMS);
    tensors of RMS under 0.01 (VSA2's gates start at zero) to ``rel * 0.01``: the ranks'
    all-reduce adds in another order, a float32 noise of a few 1e-7 whatever the tensor's
    scale."""
    from safetensors.torch import load_file

    path = os.path.join("checkpoints", f"step_{step}", f"{entry}.safetensors")
    weights = load_file(os.path.join(out_dir, path))
    reference = load_file(os.path.join(reference_dir, path))
    _assert_same_tensors(weights, reference, rel)


def _assert_same_tensors(weights, reference, rel):
    """:func:`_assert_same_weights` of two ``{name: tensor}`` dicts."""
    assert weights.keys() == reference.keys()
    for name, value in reference.items():
        error = (weights[name].double() - value.double()).pow(2).mean().sqrt()
        assert error <= rel * max(value.double().pow(2).mean().sqrt().item(), 1e-2), name


def test_two_processes_match_one_process(tmp_path):
    # one prompt, 4 samples: each rank holds 2 samples of the same group
    two = _run([*TORCHRUN, "train_rl.py"], tmp_path / "two")
    one = _run([sys.executable, "train_rl.py"], tmp_path / "one")
    assert [r["step"] for r in two] == [1, 2]
    for a, b in zip(one, two, strict=True):
        for key in ("reward/mean", "reward/std", "loss/policy", "train/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-6), (a["step"], key)
        assert b["train/ratio_dev_first"] < 1e-3


def test_a_run_folder_in_use_stops_every_rank(tmp_path):
    """Only the main process locks out_dir (it alone writes there); the other ranks learn that
    the folder is in use from it and stop with it, instead of waiting for it forever."""
    from vsa2_rl.rl.run_folder import LOCK_FILE

    out_dir = tmp_path / "run"
    out_dir.mkdir()
    with open(out_dir / LOCK_FILE, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running training run holds it
        result = subprocess.run(
            [*TORCHRUN, "train_rl.py", *TINY, f"out_dir={out_dir}"],
            cwd=REPO, capture_output=True, text=True, timeout=240,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
    assert result.returncode != 0
    error = f"error: out_dir: {out_dir} is in use by another training run"
    assert result.stderr.count(error) == 2, result.stderr[-3000:]  # one line from each rank
    assert os.listdir(out_dir) == [LOCK_FILE]


# DiffusionNFT, full fine-tuning; its old policy keeps eta = 0.3 of itself at the soft update
# after step 1 and 0.5 after step 2 (no delay), so that it runs apart from the trained weights
# at step 2. The reward is brightness's (tests.test_distributed:mean_brightness, below), and
# every step is checkpointed, for the FSDP2 resume
NFT = [
    "rl.algorithm=nft", "sampler.kind=ode", "nft.eta_rate=0.3", "nft.eta_delay_steps=0",
    "train.checkpoint_every=1",
    "rewards.functions=[{name: 'tests.test_distributed:mean_brightness'}]",
]  # fmt: skip


@pytest.fixture(scope="module")
def nft_one(tmp_path_factory):
    """The one-process NFT run that the runs of several processes are held to."""
    out_dir = tmp_path_factory.mktemp("nft") / "one"
    _run([sys.executable, "train_rl.py"], out_dir, *NFT)
    return out_dir


@pytest.mark.parametrize("parallel", ["ddp", "sequence_parallel"])
def test_nft_on_two_processes_matches_one_process(nft_one, tmp_path, parallel):
    # DiffusionNFT: the forward noising is drawn per sample, so ranks that split a group (DDP)
    # or share its videos (sequence parallelism) train as one process does
    sp = ["parallel.sequence_parallel_size=2"] if parallel == "sequence_parallel" else []
    two = _run([*TORCHRUN, "train_rl.py"], tmp_path / "two", *NFT, *sp)
    one = _rows(nft_one)
    for a, b in zip(one, two, strict=True):
        for key in ("reward/mean", "loss/policy", "train/grad_norm", "train/old_deviation"):
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-6), (a["step"], key)
    for entry in ("model", "old_policy"):
        _assert_same_weights(tmp_path / "two", nft_one, entry=entry)


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
        "rl.prompts_per_step=2",
        "rl.group_size=2",
        "rl.train_batch_size=1",
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
    _assert_same_weights(tmp_path / "two", tmp_path / "one")


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


# ---- FSDP2 (configs/accelerate/fsdp2.yaml) -------------------------------------------------

FSDP2_LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                "configs/accelerate/fsdp2.yaml", "--mixed_precision", "no"]  # fmt: skip
FSDP2_TRAIN = [*FSDP2_LAUNCH, "tests/fsdp2_cpu_worker.py"]
# every step trains (the default reward is 0 for every sample of the first step), with an
# evaluation before and after, which under FSDP2 every rank joins
EVERY_STEP_TRAINS = [
    "rewards.functions=[{name: 'tests.test_distributed:mean_brightness'}]",
    "eval.every=2",
    "eval.num_prompts=2",
]
COMPARED = ("reward/mean", "reward/std", "loss/policy", "train/grad_norm")


def mean_brightness(videos, prompts, metadata):
    """Test reward that differs between the samples of every group."""
    return videos.float().mean(dim=(1, 2, 3, 4))


@pytest.fixture(scope="module")
def fsdp2_references(tmp_path_factory):
    """The runs FSDP2 is compared with (one process, DDP over 2), and FSDP2 over 2 processes."""
    root = tmp_path_factory.mktemp("fsdp2")
    _run([sys.executable, "train_rl.py"], root / "one", *EVERY_STEP_TRAINS)
    _run([*TORCHRUN, "train_rl.py"], root / "ddp", *EVERY_STEP_TRAINS)
    _run(FSDP2_TRAIN, root / "fsdp2", *EVERY_STEP_TRAINS)
    return root


def _assert_same_metrics(rows, reference_rows, rel):
    assert [r["step"] for r in rows] == [r["step"] for r in reference_rows] == [0, 1, 2]
    for a, b in zip(reference_rows, rows, strict=True):
        keys = ("eval/reward",) if a["step"] != 1 else ()
        keys += COMPARED if a["step"] else ()
        for key in keys:
            assert b[key] == pytest.approx(a[key], rel=rel, abs=1e-7), (a["step"], key)


def test_fsdp2_trains_as_ddp_and_one_process(fsdp2_references):
    root = fsdp2_references
    _assert_same_metrics(_rows(root / "fsdp2"), _rows(root / "one"), rel=1e-4)
    # the weights are compared with DDP's, whose ranks hold the same samples: Adam's first
    # steps normalise every gradient element, so near-zero ones (the VSA2 gates), summed over
    # ranks in another order than one process sums them, leave DDP's weights as well about
    # 1e-4 (relative) from one process's
    _assert_same_weights(root / "fsdp2", root / "ddp")
    checkpoint = root / "fsdp2" / "checkpoints" / "step_2"
    assert (checkpoint / "fsdp2").is_dir() and not (checkpoint / "optimizer.pt").exists()


def test_fsdp2_with_sequence_parallelism_trains_as_ddp(fsdp2_references, tmp_path):
    # 4 processes: 2 data-parallel ranks, each a sequence-parallel group of 2, parameters
    # sharded over all 4
    root = fsdp2_references
    launch = [*FSDP2_LAUNCH, "--num_processes", "4", "tests/fsdp2_cpu_worker.py"]
    rows = _run(launch, tmp_path / "sp", "parallel.sequence_parallel_size=2", *EVERY_STEP_TRAINS)
    _assert_same_metrics(rows, _rows(root / "one"), rel=1e-4)
    _assert_same_weights(tmp_path / "sp", root / "ddp")


def test_an_fsdp2_run_resumes_as_it_would_have_gone_on(fsdp2_references, tmp_path):
    root = fsdp2_references
    _run(FSDP2_TRAIN, tmp_path / "part", *EVERY_STEP_TRAINS, "train.num_steps=1")
    resumed = _run(FSDP2_TRAIN, tmp_path / "part", *EVERY_STEP_TRAINS)  # resume=auto, to step 2
    whole = _rows(root / "fsdp2")
    assert [r["step"] for r in resumed] == [0, 1, 2]
    for key in (*COMPARED, "eval/reward"):
        assert resumed[-1][key] == pytest.approx(whole[-1][key], rel=1e-6, abs=1e-9), key
    _assert_same_weights(tmp_path / "part", root / "fsdp2", rel=1e-6)


def test_a_nan_on_one_fsdp2_rank_skips_the_step_on_all(tmp_path, monkeypatch):
    """LoRA with a KL term (the reference is the sharded model with adapters off): rank 1's
    NaN loss skips the step on both ranks, and the checkpoint holds the adapters' start."""
    import torch
    from safetensors.torch import load_file

    from vsa2_rl.config import load_config
    from vsa2_rl.runtime import build_bundle, trainable_parameters, trained_state

    lora = ["model.lora.enabled=true", "rl.kl_beta=0.1", "train.num_steps=1"]
    overrides = [*TINY, *EVERY_STEP_TRAINS[:1], *lora]
    monkeypatch.setenv("NAN_LOSS_ON_RANK", "1")  # read by tests/fsdp2_cpu_worker.py
    (row,) = _run(FSDP2_TRAIN, tmp_path / "run", *overrides)
    assert row["train/skipped_nonfinite"] == 1
    config = load_config(FLOW_GRPO_TOY, [*overrides[2:], f"out_dir={tmp_path / 'run'}"])
    bundle = build_bundle(config, torch.device("cpu"), torch.float32)
    trainable_parameters(bundle.transformer, config)
    start = trained_state(bundle.transformer, config)
    saved = load_file(tmp_path / "run" / "checkpoints" / "step_1" / "model.safetensors")
    assert saved.keys() == start.keys()  # the adapters and VSA2 parameters only
    for name, value in start.items():
        assert torch.equal(saved[name], value), name


def test_the_fsdp2_launcher_on_cpu_is_one_error_line(tmp_path):
    """accelerate does not enable FSDP for CPU processes; the trainer refuses to run as DDP."""
    command = [*FSDP2_LAUNCH, "train_rl.py", *TINY, f"out_dir={tmp_path / 'run'}"]
    result = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode != 0
    assert "error: device: accelerate runs FSDP on GPUs only" in result.stderr
    assert not os.path.exists(tmp_path / "run")


# ---- DiffusionNFT under FSDP2: the old policy's shards swapped into the sharded module --------

NFT_COMPARED = (*COMPARED, "train/old_deviation")


@pytest.fixture(scope="module")
def nft_fsdp2(tmp_path_factory):
    """The NFT run of ``nft_one`` under FSDP2 over 2 processes."""
    out_dir = tmp_path_factory.mktemp("nft_fsdp2") / "fsdp2"
    _run(FSDP2_TRAIN, out_dir, *NFT)
    return out_dir


def _assert_same_nft_rows(rows, reference_rows, rel):
    for a, b in zip(reference_rows, rows, strict=True):
        for key in NFT_COMPARED:
            assert b[key] == pytest.approx(a[key], rel=rel, abs=1e-9), (a["step"], key)


def test_fsdp2_trains_nft_and_soft_updates_its_old_policy_as_one_process(nft_one, nft_fsdp2):
    """Full fine-tuning, where the old policy's shards of every parameter, the root module's
    included, are swapped in: losses, gradient norms, the distance of v_theta to v_old, and the
    trained and the old policy's weights of both checkpoints (1e-4: Adam's first steps amplify
    the sum order of near-zero gradients, see test_fsdp2_trains_as_ddp_and_one_process)."""
    import torch
    from safetensors.torch import load_file

    one, fsdp2 = _rows(nft_one), _rows(nft_fsdp2)
    assert [r["step"] for r in fsdp2] == [r["step"] for r in one] == [1, 2]
    assert one[1]["train/old_deviation"] > 0  # the old policy ran with its own weights
    _assert_same_nft_rows(fsdp2, one, rel=1e-5)
    for step in (1, 2):
        for entry in ("model", "old_policy"):
            _assert_same_weights(nft_fsdp2, nft_one, entry=entry, step=step)
    checkpoint = nft_fsdp2 / "checkpoints" / "step_2"
    old, trained = (load_file(checkpoint / f"{e}.safetensors") for e in ("old_policy", "model"))
    assert old.keys() == trained.keys()
    assert any(not torch.equal(old[k], trained[k]) for k in old)


def test_an_fsdp2_nft_run_resumes_its_old_policy_as_it_would_have_gone_on(nft_fsdp2, tmp_path):
    step_1 = nft_fsdp2 / "checkpoints" / "step_1"
    resumed = _run(FSDP2_TRAIN, tmp_path / "resumed", *NFT, f"train.resume={step_1}")
    assert [r["step"] for r in resumed] == [2]
    _assert_same_nft_rows(resumed, _rows(nft_fsdp2)[1:], rel=1e-6)
    for entry in ("model", "old_policy"):
        _assert_same_weights(tmp_path / "resumed", nft_fsdp2, rel=1e-6, entry=entry)


# nft's anchors against drift under FSDP2, each held, like the old policy, shard by shard: the
# KL term's EMA reference (full fine-tuning: its shards are swapped in), and a trust region
# that binds (the toy's steps move the velocity by a mean square of about 0.4 to 0.55, so a
# radius of 0.1 scales each back to about a half)
NFT_ANCHORS = {
    "kl_reference_ema": (["rl.kl_beta=0.1", "rl.kl_reference=ema"], ("loss/kl",)),
    "trust_region": (
        ["nft.trust_region=0.1"],
        ("train/step_deviation", "train/trust_region_scale"),
    ),
}


@pytest.fixture(scope="module", params=list(NFT_ANCHORS))
def nft_anchor_runs(request, tmp_path_factory):
    """``(anchor, folder)``: the NFT run with an anchor of NFT_ANCHORS on one process
    (``folder / "one"``) and under FSDP2 over 2 processes (``folder / "fsdp2"``)."""
    overrides = NFT_ANCHORS[request.param][0]
    root = tmp_path_factory.mktemp(request.param)
    _run([sys.executable, "train_rl.py"], root / "one", *NFT, *overrides)
    _run(FSDP2_TRAIN, root / "fsdp2", *NFT, *overrides)
    return request.param, root


def _assert_same_anchored_nft(out_dir, reference_dir, anchor, rel, weight_rel, steps):
    """The rows and checkpoints of ``steps`` of two NFT runs with ``anchor``: the compared
    metrics and the anchor's own to ``rel``, the trained and old policy's weights and the EMA
    reference's to ``weight_rel`` (see _assert_same_weights)."""
    from vsa2_rl.rl.checkpoint import load_checkpoint

    keys = (*NFT_COMPARED, *NFT_ANCHORS[anchor][1])
    rows = {r["step"]: r for r in _rows(reference_dir)}
    for row in _rows(out_dir):
        for key in keys:
            assert row[key] == pytest.approx(rows[row["step"]][key], rel=rel, abs=1e-9), key
    for step in steps:
        for entry in ("model", "old_policy"):
            _assert_same_weights(out_dir, reference_dir, weight_rel, entry=entry, step=step)
        if anchor == "kl_reference_ema":
            states = [
                load_checkpoint(d / "checkpoints" / f"step_{step}")
                for d in (out_dir, reference_dir)
            ]
            ema, reference = (state["kl_reference"] for state in states)
            assert ema["num_calls"] == reference["num_calls"] == step
            _assert_same_tensors(ema["shadow"], reference["shadow"], weight_rel)


def test_fsdp2_trains_nft_with_an_anchor_against_drift_as_one_process(nft_anchor_runs):
    """The EMA reference's KL (not 0 at step 2, the EMA then apart from theta) or the trust
    region's scale (below 0.9: it binds) and deviation, with everything
    test_fsdp2_trains_nft_and_soft_updates_its_old_policy_as_one_process compares."""
    anchor, root = nft_anchor_runs
    one = _rows(root / "one")
    assert [r["step"] for r in _rows(root / "fsdp2")] == [r["step"] for r in one] == [1, 2]
    if anchor == "kl_reference_ema":
        assert one[1]["loss/kl"] > 0
    else:
        assert all(r["train/trust_region_scale"] < 0.9 for r in one)
    _assert_same_anchored_nft(root / "fsdp2", root / "one", anchor, 1e-5, 1e-4, steps=(1, 2))


def test_an_fsdp2_nft_run_resumes_its_anchor_against_drift_as_it_would_have_gone_on(
    nft_anchor_runs, tmp_path
):
    anchor, root = nft_anchor_runs
    step_1 = root / "fsdp2" / "checkpoints" / "step_1"
    resumed = tmp_path / "resumed"
    rows = _run(FSDP2_TRAIN, resumed, *NFT, *NFT_ANCHORS[anchor][0], f"train.resume={step_1}")
    assert [r["step"] for r in rows] == [2]
    _assert_same_anchored_nft(resumed, root / "fsdp2", anchor, 1e-6, 1e-6, steps=(2,))


# ---- Wan2.2 A14B's two experts under every engine ------------------------------------------


def _prompt_files(folder) -> list[str]:
    """``prompts.file`` and ``prompts.eval_file`` overrides naming files of the toy's train and
    eval prompts in ``folder`` (a Wan run needs a prompt file; the default config's guards
    read the toy's captions)."""
    from vsa2_rl.toy.prompts import toy_prompts

    overrides = []
    for key, split in (("file", "train"), ("eval_file", "eval")):
        path = folder / f"{split}_prompts.txt"
        path.write_text("\n".join(toy_prompts(split)) + "\n")
        overrides.append(f"prompts.{key}={path}")
    return overrides


@pytest.fixture(scope="module")
def two_expert_runs(tmp_path_factory):
    """A tiny Wan2.2 A14B folder trained on one process, DDP, FSDP2 and sequence parallelism.
    Its 3 sampler steps sit at sigma 1 (the high-noise expert) and 2/3 (the low-noise one): each
    Flow-GRPO backward reaches one expert only."""
    from wan_folders import save_wan_folder

    root = tmp_path_factory.mktemp("experts")
    wan = [
        "model.kind=wan", f"model.path={save_wan_folder(root / 'a14b', 'wan22_a14b_t2v')}",
        *_prompt_files(root),
        "model.num_frames=5", "model.height=32", "model.width=32", *EVERY_STEP_TRAINS,
    ]  # fmt: skip
    sequence_parallel = [*wan, "parallel.sequence_parallel_size=2"]
    return {
        "one": _run([sys.executable, "train_rl.py"], root / "one", *wan),
        "ddp": _run([*TORCHRUN, "train_rl.py"], root / "ddp", *wan),
        "fsdp2": _run(FSDP2_TRAIN, root / "fsdp2", *wan),
        "sp": _run([*TORCHRUN, "train_rl.py"], root / "sp", *sequence_parallel),
        "root": root,
    }


@pytest.mark.parametrize("engine", ["ddp", "fsdp2", "sp"])
def test_two_experts_train_under_every_engine_as_on_one_process(two_expert_runs, engine):
    _assert_same_metrics(two_expert_runs[engine], two_expert_runs["one"], rel=1e-4)
    root = two_expert_runs["root"]
    if engine != "ddp":  # 1e-3: Adam's first steps amplify the sum order of near-zero gradients
        _assert_same_weights(root / engine, root / "ddp", rel=1e-3)
    from safetensors.torch import load_file

    weights = load_file(root / engine / "checkpoints" / "step_2" / "model.safetensors")
    assert any(k.startswith("high_noise.") for k in weights)
    assert any(k.startswith("low_noise.") for k in weights)


def _two_expert_command(tmp_path, monkeypatch, stage):
    """The plain and the DeepSpeed (one GPU, one process, float32) command lines of a tiny
    Wan2.2 A14B run, with the overrides they share."""
    from wan_folders import save_wan_folder

    monkeypatch.setenv("PYTHONSAFEPATH", "1")  # the installed package, not the checkout's folder
    # ... and the checkout after it, where the reward spec's module (tests.test_distributed) is
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (path, str(REPO)) if p))
    wan = [
        "model.kind=wan", f"model.path={save_wan_folder(tmp_path / 'a14b', 'wan22_a14b_t2v')}",
        *_prompt_files(tmp_path),
        "model.num_frames=5", "model.height=32", "model.width=32", "device=cuda",
        "model.dtype=float32",
        *EVERY_STEP_TRAINS,
    ]  # fmt: skip
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
              f"configs/accelerate/{stage}.yaml", "--mixed_precision", "no",
              "--num_processes", "1"]  # fmt: skip
    # the installed package cannot see the checkout's configs/: name the default file
    train = ["train_rl.py", "--config", "configs/default.yaml"]
    return [sys.executable, *train], [*launch, *train], wan


@pytest.mark.gpu
def test_two_experts_train_under_zero2_as_on_one_process(tmp_path, monkeypatch):
    """ZeRO-2 wraps both experts of a tiny Wan2.2 A14B: the rewards, losses and gradient norms
    equal a plain run's, and so do both experts' weights in its checkpoint (each Flow-GRPO
    update trains one noise level of each expert: sigma 1 goes to the high-noise one, 2/3 to
    the low-noise one, so each backward leaves one expert without gradients)."""
    pytest.importorskip("deepspeed")
    plain, deepspeed, wan = _two_expert_command(tmp_path, monkeypatch, "zero2")
    one = _run(plain, tmp_path / "one", *wan)
    engine = _run(deepspeed, tmp_path / "zero2", *wan)
    _assert_same_metrics(engine, one, rel=1e-4)
    _assert_same_weights(tmp_path / "zero2", tmp_path / "one", rel=1e-3)
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "zero2" / "checkpoints" / "step_2" / "model.safetensors")
    assert {key.split(".")[0] for key in weights} == {"high_noise", "low_noise"}


@pytest.mark.gpu
def test_zero3_refuses_two_trained_experts_before_writing_anything(tmp_path, monkeypatch):
    """Measured: under ZeRO-3 the second update's gradient norm departs from a plain run's
    (0.138 against 0.110 with both experts trained), so a run of both is refused."""
    pytest.importorskip("deepspeed")
    _, deepspeed, wan = _two_expert_command(tmp_path, monkeypatch, "zero3")
    out_dir = tmp_path / "zero3"
    result = subprocess.run(
        [*deepspeed, *TINY, f"out_dir={out_dir}", *wan],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode != 0  # the run's 2, which the launcher reports as its own 1
    assert "error: model.train_experts: ZeRO-3 trains one expert per run" in result.stderr
    assert not out_dir.exists()


# ---- DiffusionNFT under ZeRO-3 (configs/accelerate/zero3.yaml): the old policy's partitions ----

ZERO3_TRAIN = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               "configs/accelerate/zero3.yaml", "--mixed_precision", "no",
               "tests/zero3_cpu_worker.py"]  # fmt: skip


@pytest.fixture(scope="module")
def nft_zero3(tmp_path_factory):
    """The NFT run of ``nft_one`` under DeepSpeed ZeRO-3 over 2 CPU processes (some of the toy's
    parameters partitioned, the small ones kept whole: tests/zero3_cpu_worker.py)."""
    out_dir = tmp_path_factory.mktemp("nft_zero3") / "zero3"
    _run(ZERO3_TRAIN, out_dir, *NFT)
    return out_dir


def test_zero3_trains_nft_and_soft_updates_its_old_policy_as_one_process(nft_one, nft_zero3):
    """Full fine-tuning, where the old policy's partitions of every parameter are swapped in:
    what test_fsdp2_trains_nft_and_soft_updates_its_old_policy_as_one_process compares."""
    one, zero3 = _rows(nft_one), _rows(nft_zero3)
    assert [r["step"] for r in zero3] == [r["step"] for r in one] == [1, 2]
    assert one[1]["train/old_deviation"] > 0  # the old policy ran with its own weights
    _assert_same_nft_rows(zero3, one, rel=1e-4)
    for step in (1, 2):
        for entry in ("model", "old_policy"):
            _assert_same_weights(nft_zero3, nft_one, rel=1e-3, entry=entry, step=step)
    assert (nft_zero3 / "checkpoints" / "step_2" / "deepspeed").is_dir()


def test_a_zero3_nft_run_resumes_its_old_policy_as_it_would_have_gone_on(nft_zero3, tmp_path):
    step_1 = nft_zero3 / "checkpoints" / "step_1"
    resumed = _run(ZERO3_TRAIN, tmp_path / "resumed", *NFT, f"train.resume={step_1}")
    assert [r["step"] for r in resumed] == [2]
    _assert_same_nft_rows(resumed, _rows(nft_zero3)[1:], rel=1e-6)
    for entry in ("model", "old_policy"):
        _assert_same_weights(tmp_path / "resumed", nft_zero3, rel=1e-6, entry=entry)


@pytest.mark.parametrize("nft_anchor_runs", ["kl_reference_ema"], indirect=True)
def test_zero3_trains_nft_with_an_ema_kl_reference_as_one_process(nft_anchor_runs, tmp_path):
    """Full fine-tuning: the EMA reference's partitions are swapped in (nft.trust_region is
    refused under DeepSpeed, whose master weights would undo its scaling)."""
    anchor, root = nft_anchor_runs
    _run(ZERO3_TRAIN, tmp_path / "zero3", *NFT, *NFT_ANCHORS[anchor][0])
    assert _rows(root / "one")[1]["loss/kl"] > 0
    _assert_same_anchored_nft(tmp_path / "zero3", root / "one", anchor, 1e-4, 1e-3, steps=(1, 2))


def test_zero3_trains_lora_nft_with_its_kl_to_the_base_as_one_process(tmp_path):
    """LoRA, the 14B NFT recipe's setting: the old policy's adapter partitions are swapped in,
    and the KL's reference is the partitioned model with adapters off."""
    lora = [*NFT, "model.lora.enabled=true", "rl.kl_beta=0.1"]
    one = _run([sys.executable, "train_rl.py"], tmp_path / "one", *lora)
    zero3 = _run(ZERO3_TRAIN, tmp_path / "zero3", *lora)
    assert one[1]["train/old_deviation"] > 0 and one[1]["loss/kl"] > 0
    for a, b in zip(one, zero3, strict=True):
        for key in (*NFT_COMPARED, "loss/kl"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-9), (a["step"], key)
    for entry in ("model", "old_policy"):
        _assert_same_weights(tmp_path / "zero3", tmp_path / "one", rel=1e-3, entry=entry)


@pytest.mark.gpu
def test_zero3_trains_nft_on_a_gpu_as_one_process(tmp_path):
    """The CPU runs above on one GPU (NCCL, CUDA tensors), one process, float32."""
    pytest.importorskip("deepspeed")
    gpu = [*NFT, "device=cuda", "model.dtype=float32"]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
              "configs/accelerate/zero3.yaml", "--mixed_precision", "no",
              "--num_processes", "1", "train_rl.py"]  # fmt: skip
    one = _run([sys.executable, "train_rl.py"], tmp_path / "one", *gpu)
    zero3 = _run(launch, tmp_path / "zero3", *gpu)
    assert one[1]["train/old_deviation"] > 0
    _assert_same_nft_rows(zero3, one, rel=1e-4)
    for entry in ("model", "old_policy"):
        _assert_same_weights(tmp_path / "zero3", tmp_path / "one", rel=1e-3, entry=entry)
