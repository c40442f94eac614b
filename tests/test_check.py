"""``vsa2-rl check``: the plan of a config from its model folder's configuration alone (no
weight file is read), with figures computed here by hand, and every problem at once, one line
each naming its key, exit status 1."""

import dataclasses
import glob
import os
import shutil

import pytest

from vsa2_rl.check import check
from vsa2_rl.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE_1_3B = os.path.join(REPO, "configs", "wan2_1_1.3b_vsa2_grpo.yaml")
RECIPE_A14B = os.path.join(REPO, "configs", "wan2_2_a14b_i2v_vsa2_grpo.yaml")
NFT_RECIPES = [
    os.path.join(REPO, "configs", f"{name}_vsa2_nft.yaml")
    for name in (
        "wan2_1_1.3b", "wan2_1_14b", "wan2_2_a14b_i2v", "wan2_2_ti2v_5b", "hunyuan_video15_480p"
    )
]  # fmt: skip
# a weight-free reward in place of the recipe's aesthetic one, whose files live under /data
NO_WEIGHTS = "rewards.functions=[{name: motion_quality}]"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tiny Wan folders (tests/wan_folders.py) without any weight file: check reads none."""
    from wan_folders import save_wan_folder

    root = tmp_path_factory.mktemp("check")
    made = {kind: save_wan_folder(root / kind, kind) for kind in ("wan21_t2v", "wan22_a14b_i2v")}
    for folder in made.values():
        for weights in glob.glob(os.path.join(folder, "**", "*.safetensors"), recursive=True):
            os.remove(weights)
    return made


@pytest.fixture(autouse=True)
def _from_the_repository_root(monkeypatch):
    monkeypatch.chdir(REPO)  # the recipes name their prompt files from there


def _plan(report) -> dict:
    return dict(report.plan)


def _key(problem: str) -> str:
    """The key a problem line names ("model.path='/x': ..." names model.path)."""
    return problem.split(":")[0].split("=")[0].strip()


def _tiny_parameters(in_channels: int) -> int:
    """Parameters of the tiny Wan transformer, built here with weights."""
    from diffusers import WanTransformer3DModel
    from wan_folders import TRANSFORMER

    model = WanTransformer3DModel(**TRANSFORMER, in_channels=in_channels, out_channels=16)
    return sum(p.numel() for p in model.parameters())


def test_the_plan_of_the_1_3b_recipe(folders):
    report = check(RECIPE_1_3B, [f"model.path={folders['wan21_t2v']}", NO_WEIGHTS])
    assert report.problems == []
    plan = _plan(report)
    assert plan["model"] == (
        f"Wan2.1, text-to-video: one transformer of {_tiny_parameters(16):,} parameters"
    )
    # 81 frames -> (81 - 1) / 4 + 1 = 21 latent frames; 480x832 / 8 (VAE) / 2 (patch) = 30x52
    assert "-> 32,760 tokens (21x30x52), 512 query tiles of 64" in plan["video"]
    # rank 32 on q, k, v, out of self- and cross-attention (64 -> 64), 2 layers:
    # 2 x 8 x 32 x (64 + 64) = 65,536; VSA2 per layer: 2 head alphas + 2 gates of 64 x 64 + 64
    assert plan["trains"] == (
        "LoRA rank 32, alpha 32 on to_q, to_k, to_v, to_out.0: 65,536, and the VSA2 router and "
        "gates: 16,644"
    )
    # 32,760 tokens in segments of 64: 512 (rounded up); 12.5% of them: 64; 25%: 128
    assert plan["sparsity"] == (
        "rollout = train: 0.875: at most 64 of 512 key segments at every step; eval 0.75: at "
        "most 128 of 512 key segments"
    )
    assert plan["prompts"] == (
        "train 400 (configs/prompts/wan_motion_train.txt); eval 100 "
        "(configs/prompts/wan_motion_eval.txt)"
    )
    assert plan["step"].startswith("4 prompts x 8 samples = 32 videos of 16 sampler steps")


def test_check_reads_model_index_json_once(folders, monkeypatch, capsys):
    """The plan, the guidance checks and the prompts' condition images all come from one read
    of the folder's model_index.json."""
    from wan_folders import count_index_reads

    reads = count_index_reads(monkeypatch)
    for kind, recipe in (("wan21_t2v", RECIPE_1_3B), ("wan22_a14b_i2v", RECIPE_A14B)):
        reads.clear()
        assert main(["check", "--config", recipe, f"model.path={folders[kind]}", NO_WEIGHTS]) == 0
        assert reads == [os.path.join(folders[kind], "model_index.json")], kind
    assert "no problems found" in capsys.readouterr().out


def test_the_plan_estimates_memory_and_time_from_the_recipes_shapes(folders):
    from wan_folders import TRANSFORMER

    from vsa2_rl.plan import (
        ModelShape,
        StepShape,
        describe,
        describe_engines,
        memory_gib,
        seconds_per_step,
    )

    report = check(RECIPE_1_3B, [f"model.path={folders['wan21_t2v']}", NO_WEIGHTS])
    model = ModelShape(
        params=_tiny_parameters(16) + 16_644,  # with VSA2's, before the adapters
        trained_params=65_536 + 16_644,
        layers=TRANSFORMER["num_layers"],
        hidden=TRANSFORMER["num_attention_heads"] * TRANSFORMER["attention_head_dim"],
        ffn=TRANSFORMER["ffn_dim"],
    )
    # the recipe: 4 x 8 videos of 16 SDE steps with guidance 5, half of the 8 stochastic steps
    # trained, KL 0.004, EMA, LoRA, gradient checkpointing, rollouts at 0.875, compiled blocks,
    # one GPU
    step = StepShape(
        tokens=32_760, videos=32, sampler_steps=16, trained_steps=4, train_batch_size=1,
        guidance=True, kl=True, ema=True, lora=True, checkpointing=True, sparsity=0.875,
        compiled=True,
    )  # fmt: skip
    memory, time = describe(memory_gib(model, step), seconds_per_step(model, step), step)
    assert (_plan(report)["memory"], _plan(report)["time"]) == (memory, time)
    engines, checkpointing = describe_engines(model, step)
    assert (_plan(report)["engines"], _plan(report)["checkpointing"]) == (engines, checkpointing)
    # each engine's figure is that engine's peak on that many GPUs
    fsdp2_on_8 = memory_gib(model, dataclasses.replace(step, engine="fsdp2", gpus=8))["peak"]
    assert engines.endswith(f"/ {fsdp2_on_8:.1f}")
    unchecked = memory_gib(model, dataclasses.replace(step, checkpointing=False))["peak"]
    assert checkpointing == f"without gradient checkpointing: {unchecked:.1f} GiB on one GPU"


@pytest.mark.parametrize(
    ("overrides", "changed"),
    [
        ([], {}),
        (["rl.num_inner_epochs=2"], {"trained_steps": 8}),
        (["sampler.sde_window=null", "rl.timestep_fraction=0.25"], {"trained_steps": 4}),
        (["rl.algorithm=nft", "sampler.kind=ode", "sampler.guidance_scale=1",
          "nft.timestep_fraction=0.5", "rl.kl_beta=0"],
         {"trained_steps": 8, "guidance": False, "guided_update": False, "kl": False,
          "old_policy_forwards": 1}),  # nft: the old policy's conditional forward, no KL's;
        # its training passes are conditional alone
        (["rl.algorithm=nft", "sampler.kind=ode", "nft.guidance=rollouts", "rl.kl_beta=0",
          "nft.timestep_fraction=0.5"],
         {"trained_steps": 8, "guided_update": False, "kl": False,
          "old_policy_forwards": 1}),  # guided rollouts, anchored on the conditional velocity
        (["rl.algorithm=nft", "sampler.kind=ode", "nft.guidance=anchor",
          "nft.timestep_fraction=0.5"],
         {"trained_steps": 8, "guided_update": False, "old_policy_forwards": 2}),  # anchored
        # on the guided velocity: both branches of the old policy, and the KL's reference
        (["sampler.guidance_scale=1", "rl.kl_beta=0", "train.ema_decay=0"],
         {"guidance": False, "kl": False, "ema": False}),
        (["attention.enabled=false", "model.lora.enabled=false"],
         {"sparsity": 0.0, "lora": False}),
        (["model.compile_blocks=false"], {"compiled": False}),
    ],
)  # fmt: skip
def test_a_recipes_step_shape_follows_its_config(overrides, changed):
    from vsa2_rl.config import load_config
    from vsa2_rl.plan import StepShape, step_shape

    config = load_config(RECIPE_1_3B, ["model.path=/nowhere", *overrides], check_files=False)
    recipe = StepShape(
        tokens=100, videos=32, sampler_steps=16, trained_steps=4, train_batch_size=1,
        guidance=True, kl=True, ema=True, lora=True, checkpointing=True, sparsity=0.875,
        compiled=True,
    )  # fmt: skip
    assert step_shape(config, 100) == dataclasses.replace(recipe, **changed)


@pytest.mark.parametrize("recipe", NFT_RECIPES, ids=os.path.basename)
def test_the_nft_recipes_step_shape(recipe):
    """Each DiffusionNFT recipe, read by hand: 4 x 8 videos of 16 unguided ODE steps, 4 noise
    levels trained a video (0.25 of 16), each with the old policy's conditional forward and the
    KL reference's (kl_beta 0.1); the update's passes conditional alone."""
    from vsa2_rl.config import load_config
    from vsa2_rl.plan import StepShape, step_shape

    config = load_config(recipe, ["model.path=/nowhere"], check_files=False)
    expected = StepShape(
        tokens=100, videos=32, sampler_steps=16, trained_steps=4, train_batch_size=1,
        guidance=False, kl=True, ema=config.train.ema_decay > 0, lora=True, checkpointing=True,
        sparsity=0.875, compiled=config.model.compile_blocks, guided_update=False,
        old_policy_forwards=1,
    )  # fmt: skip
    assert step_shape(config, 100) == expected
    assert config.eval_guidance_scale > 1  # evaluations sample as the base model does


def test_full_fine_tuning_counts_every_weight(folders):
    report = check(
        RECIPE_1_3B,
        [f"model.path={folders['wan21_t2v']}", NO_WEIGHTS, "model.lora.enabled=false"],
    )
    expected = _tiny_parameters(16) + 16_644  # + VSA2's
    assert _plan(report)["trains"] == f"every weight (full fine-tuning): {expected:,}"


def test_the_a14b_recipe_names_its_experts_and_images(folders):
    folder = folders["wan22_a14b_i2v"]
    report = check(RECIPE_A14B, [f"model.path={folder}", "model.train_experts=[low_noise]"])
    assert report.problems == []
    plan = _plan(report)
    assert "2 experts" in plan["model"] and "boundary 0.9" in plan["model"]
    # one expert trains: half the two-expert LoRA and VSA2 counts
    assert plan["trains"].endswith("of low_noise: 65,536, and the VSA2 router and gates: 16,644")
    assert plan["prompts"].count("8 with images") == 2
    assert plan["rewards"] == "motion_quality (weight 1), image_consistency (weight 0.5)"


def test_every_problem_is_listed_once_naming_its_key(folders, tmp_path, capsys):
    folder = tmp_path / "model"
    shutil.copytree(folders["wan21_t2v"], folder)
    shutil.rmtree(folder / "vae")
    out_dir = tmp_path / "run"
    argv = [
        "check", "--config", RECIPE_1_3B, f"model.path={folder}", f"out_dir={out_dir}",
        f"prompts.eval_file={tmp_path / 'missing.txt'}",
        "rewards.functions=[{name: motion_quality}, {name: no_such_reward}]",
        "eval.guard_rewards=[{name: aesthetic, kwargs: {clip_path: /no/clip.bin}}]",
        "train.resume=/no/checkpoint",
    ]  # fmt: skip
    assert main(argv) == 1
    lines = capsys.readouterr().out.splitlines()
    problems = lines[lines.index("5 problems:") + 1 :]
    assert [_key(line) for line in problems] == [
        "train.resume",
        "model.path",
        "prompts.eval_file",
        "rewards.functions[1] (no_such_reward)",
        "eval.guard_rewards[0] (aesthetic)",
    ]
    assert "has no vae/" in problems[1] and "missing.txt" in problems[2]
    assert not out_dir.exists()  # a check writes nothing


def test_train_lists_every_problem_before_anything_loads(folders, tmp_path, capsys):
    folder = tmp_path / "model"
    shutil.copytree(folders["wan21_t2v"], folder)
    shutil.rmtree(folder / "vae")
    out_dir = tmp_path / "run"
    argv = [
        "train", "--config", RECIPE_1_3B, f"model.path={folder}", f"out_dir={out_dir}",
        f"prompts.eval_file={tmp_path / 'missing.txt'}", "rl.prompts_per_step=401",
        "rewards.functions=[{name: no_such_reward}]",  # built by training, after these
    ]  # fmt: skip
    assert main(argv) == 2
    errors = capsys.readouterr().err.splitlines()
    assert [_key(line.removeprefix("error: ")) for line in errors] == [
        "model.path",
        "prompts.eval_file",
        "rl.prompts_per_step",
    ]
    assert all(line.startswith("error: ") for line in errors)
    assert not out_dir.exists()


def test_a_video_size_the_model_cannot_make_is_a_problem(folders):
    report = check(
        RECIPE_1_3B, [f"model.path={folders['wan21_t2v']}", NO_WEIGHTS, "model.num_frames=32"]
    )
    assert report.problems == [
        "model.num_frames / model.height / model.width: num_frames must be 4*k + 1 for the Wan "
        "VAE (e.g. 81), got 32"
    ]


def test_lora_modules_the_model_lacks_are_a_problem():
    report = check(None, ["model.lora.enabled=true", "model.lora.target_modules=[to_qq]"])
    (problem,) = report.problems
    assert problem.startswith("model.lora.target_modules: Target modules {'to_qq'} not found")


def test_a_config_that_does_not_load_is_one_problem(capsys):
    assert main(["check", "train.num_step=3"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-2:] == [
        "1 problem:",
        "  train.num_step: unknown config key (did you mean "
        "'train.num_steps'?); see `vsa2-rl train --help`",
    ]


def test_the_default_toy_run_checks_clean(capsys):
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("no problems found")
    assert "train 120 (the toy's built-in prompts); eval 24" in out
