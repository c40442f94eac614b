"""Hostile-but-realistic model folders, configs and run folders: each is one problem line of
``vsa2-rl check`` (and one ConfigError of the loaders ``train`` and ``eval`` use) naming the
file or key and the fix, never a traceback or a silent misreading."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from vsa2_rl.check import check
from vsa2_rl.config import ConfigError, config_tree, load_config, load_eval_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = os.path.join(REPO, "configs", "prompts", "wan_motion_train.txt")
BASE = [
    "model.kind=wan", f"prompts.file={PROMPTS}", "model.num_frames=9", "model.height=32",
    "model.width=32", "rewards.functions=[{name: motion_quality}]", "rl.prompts_per_step=2",
    "rl.group_size=2", "eval.agreement_prompts=0", "eval.guard_rewards=[]",
]  # fmt: skip


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A tiny Wan2.1 T2V folder without weight files (check reads none)."""
    from wan_folders import save_wan_folder

    folder = save_wan_folder(tmp_path_factory.mktemp("wan") / "t2v", "wan21_t2v")
    for root, _, files in os.walk(folder):
        for name in files:
            if name.endswith(".safetensors"):
                os.remove(os.path.join(root, name))
    return folder


@pytest.fixture
def folder(pristine, tmp_path):
    """A copy of the tiny folder to damage."""
    return str(shutil.copytree(pristine, tmp_path / "model"))


def _check(folder, tmp_path, *overrides):
    return check(None, [*BASE, f"model.path={folder}", f"out_dir={tmp_path / 'run'}", *overrides])


def _edit_json(path, **changes):
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    data.update(changes)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle)


def test_the_tiny_folder_checks_clean(folder, tmp_path):
    assert _check(folder, tmp_path).problems == []


# ---- 3: condition images of other bit depths ----------------------------------------------


def test_a_16_bit_png_is_read_scaled_by_its_depth(tmp_path):
    from vsa2_rl.data.prompts import condition_rgb, load_condition_image

    path = str(tmp_path / "gray16.png")
    Image.fromarray(np.full((16, 16), 30000, dtype=np.uint16)).save(path)
    assert Image.open(path).mode == "I;16"
    image = load_condition_image(path, 8, 8)
    assert image.shape == (3, 8, 8)
    torch.testing.assert_close(image, torch.full((3, 8, 8), 30000 / 65535))
    assert np.asarray(condition_rgb(path))[0, 0].tolist() == [117, 117, 117]  # 30000 / 257


def test_a_float_tiff_is_refused_naming_the_file(tmp_path):
    from vsa2_rl.data.prompts import load_condition_image, read_prompt_records

    path = tmp_path / "float.tif"
    Image.fromarray(np.full((16, 16), 0.5, dtype=np.float32)).save(path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "a red ball", "image": "float.tif"}) + "\n")
    with pytest.raises(ConfigError) as error:
        read_prompt_records(str(prompts), "prompts.file")
    assert str(error.value).startswith(f"prompts.file: {prompts} line 1: image {path}")
    assert "floating-point pixels" in str(error.value) and "16-bit PNG" in str(error.value)
    with pytest.raises(ValueError, match=r"float\.tif: has floating-point pixels"):
        load_condition_image(str(path), 8, 8)


# ---- 4 and 8: model folders read by type --------------------------------------------------


DAMAGE = {
    "expand_timesteps as a string": ("model_index.json", {"expand_timesteps": "false"},
                                     '"expand_timesteps" must be true or false'),
    "boundary_ratio not a number": ("model_index.json", {"boundary_ratio": "abc"},
                                    '"boundary_ratio" must be a number in (0, 1)'),
    "boundary_ratio above 1": ("model_index.json", {"boundary_ratio": 1.7},
                               '"boundary_ratio" must be a number in (0, 1)'),
    "transformer_2 a string": ("model_index.json", {"transformer_2": "WanTransformer3DModel"},
                               '"transformer_2" must be ["<library>", "<class>"]'),
    "no attention heads": ("transformer/config.json", {"num_attention_heads": 0},
                           '"num_attention_heads" must be a positive integer, got 0'),
    "in_channels a string": ("transformer/config.json", {"in_channels": "16"},
                             '"in_channels" must be a positive integer, got "16"'),
    "in_channels of no scheme": ("transformer/config.json", {"in_channels": 20},
                                 '"in_channels" must be 16 (out_channels'),
    "patch_size of two": ("transformer/config.json", {"patch_size": [2, 2]},
                          '"patch_size" must be three positive integers'),
    "VAE of other channels": ("vae/config.json", {"z_dim": 8, "latents_mean": [0.0] * 8,
                                                  "latents_std": [1.0] * 8},
                              '"out_channels" must be the VAE\'s z_dim (8)'),
    "latents_std short": ("vae/config.json", {"latents_std": [1.0]},
                          '"latents_std" must be a list of z_dim (16) numbers'),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_model_folder_is_one_problem_naming_file_and_key(folder, tmp_path, case):
    name, changes, expected = DAMAGE[case]
    _edit_json(os.path.join(folder, name), **changes)
    problems = _check(folder, tmp_path).problems
    assert len(problems) == 1, problems
    (problem,) = problems
    assert problem.startswith("model.path: "), problem
    named = (
        "transformer/config.json" if name == "vae/config.json" and "z_dim (8)" in expected else name
    )
    assert problem.startswith(f"model.path: {os.path.join(folder, named)}: "), problem
    assert expected in problem and "restore the file" in problem


@pytest.mark.parametrize(
    "name, text, expected",
    [
        ("model_index.json", "[1, 2]", "holds a JSON list, not the object"),
        ("transformer/config.json", '{"in_channels": 16,', "is not readable JSON"),
        ("vae/config.json", None, "No such file or directory"),
    ],
)
def test_a_garbled_or_missing_settings_file_is_one_problem(folder, tmp_path, name, text, expected):
    path = os.path.join(folder, name)
    if text is None:
        os.remove(path)
    else:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
    problems = _check(folder, tmp_path).problems
    assert len(problems) == 1 and problems[0].startswith(f"model.path: {path} "), problems
    assert expected in problems[0] and "restore it from the model's download" in problems[0]


def test_the_loader_of_train_and_eval_refuses_damage_before_any_weight(folder):
    from vsa2_rl.config import VSA2Config
    from vsa2_rl.models.wan_bundle import load_wan_bundle

    _edit_json(os.path.join(folder, "transformer", "config.json"), num_attention_heads=0)
    with pytest.raises(ConfigError, match='"num_attention_heads" must be a positive integer'):
        load_wan_bundle(folder, VSA2Config())  # the weights were removed: nothing loads first


def test_a_string_flag_does_not_make_a_wan21_folder_a_ti2v_one(folder):
    from vsa2_rl.models.wan_bundle import read_wan_variant

    _edit_json(os.path.join(folder, "model_index.json"), expand_timesteps="false")
    with pytest.raises(ConfigError, match="expand_timesteps"):
        read_wan_variant(folder)
    _edit_json(os.path.join(folder, "model_index.json"), expand_timesteps=None)
    assert read_wan_variant(folder).expand_timesteps is False


# ---- 6: sequence parallelism of sizes that do not divide 2 ---------------------------------


@pytest.mark.parametrize("size, counts", [(1, "2 / 4 / 8"), (4, "4 / 8"), (8, "8")])
def test_describe_engines_takes_whole_sequence_parallel_groups(size, counts):
    from vsa2_rl.plan import ModelShape, StepShape, describe_engines

    model = ModelShape(params=10**9, trained_params=10**7, layers=30, hidden=1536, ffn=8960)
    step = StepShape(14040, 8, 16, 4, sequence_parallel=size, gpus=size)
    engines, switched = describe_engines(model, step)
    assert engines.startswith(f"peak GiB per GPU on {counts} GPUs: ddp ")
    assert switched.endswith("one GPU" if size == 1 else f"on {size} GPUs")


@pytest.mark.parametrize("size", [4, 8])
def test_check_plans_a_sequence_parallel_run_of_4_or_8(folder, tmp_path, size):
    report = _check(folder, tmp_path, f"parallel.sequence_parallel_size={size}")
    assert report.problems == []
    assert dict(report.plan)["engines"].startswith(f"peak GiB per GPU on {size}")


# ---- 10: sizes ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, key",
    [
        ("eval.samples_per_prompt=2147483647", "eval.samples_per_prompt"),
        ("model.height=1000000", "model.height"),
        ("model.num_frames=100000001", "model.num_frames"),
    ],
)
def test_sizes_beyond_any_machine_are_refused_before_allocating(override, key):
    with pytest.raises(ConfigError, match=f"^{key}: "):
        load_config(None, [override])


def test_a_plan_that_fits_no_gpu_is_a_problem(folder, tmp_path, monkeypatch):
    import vsa2_rl.plan

    monkeypatch.setattr(vsa2_rl.plan, "H200_GIB", 1e-6)  # the tiny model as a huge one
    (problem,) = _check(folder, tmp_path).problems
    assert problem.startswith("model.num_frames / model.height / model.width: a step needs")
    assert "more than any GPU holds" in problem


def test_smallest_peak_of_a_full_14b_run_exceeds_an_h200():
    from vsa2_rl.plan import H200_GIB, ModelShape, StepShape, smallest_peak

    model = ModelShape(params=28 * 10**9, trained_params=28 * 10**9, layers=40, hidden=5120,
                       ffn=13824)  # fmt: skip
    step = StepShape(75600 * 16, 8, 16, 4, train_batch_size=8, lora=False, kl=True)
    assert smallest_peak(model, step) > H200_GIB


# ---- 11: what out_dir holds ------------------------------------------------------------------


@pytest.mark.parametrize("name, make", [("samples", "file"), ("eval.json", "folder")])
def test_an_out_dir_child_of_the_wrong_kind_is_refused_up_front(folder, tmp_path, name, make):
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    child = out_dir / name
    child.mkdir() if make == "folder" else child.write_text("")
    (problem,) = _check(folder, tmp_path).problems
    assert problem.startswith(f"out_dir: {child} is not a ") and "move it away" in problem
    with pytest.raises(ConfigError, match=f"out_dir: {child} is not a"):
        load_eval_config(None, [f"out_dir={out_dir}"])


# ---- 15: what train refuses, check reports -----------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_device_without_cuda_is_a_problem(folder, tmp_path):
    (problem,) = _check(folder, tmp_path, "device=cuda").problems
    assert problem.startswith("device: 'cuda' requested but CUDA is not available")


def test_a_fresh_run_in_a_folder_holding_one_is_a_problem(folder, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    (problem,) = _check(folder, tmp_path, "train.resume=none").problems
    assert problem.startswith("out_dir: ") and "holds a run" in problem


def test_a_resume_that_changes_a_key_is_a_problem(folder, tmp_path):
    from vsa2_rl.rl.checkpoint import save_checkpoint

    trained = load_config(None, [*BASE, f"model.path={folder}", f"out_dir={tmp_path / 'run'}"])
    save_checkpoint(tmp_path / "run" / "checkpoints", 1, {"config": config_tree(trained)})
    assert _check(folder, tmp_path).problems == []
    (problem,) = _check(folder, tmp_path, "train.learning_rate=0.5").problems
    assert problem.startswith("train.learning_rate: changed since the checkpoint")


def test_a_reward_that_cannot_read_the_prompts_is_a_problem(folder, tmp_path):
    rewards = "rewards.functions=[{name: prompt_motion}, {name: image_consistency}]"
    problems = _check(folder, tmp_path, rewards).problems
    assert [p.split(":")[0] for p in problems] == [
        "rewards.functions[0] (prompt_motion)",
        "rewards.functions[1] (image_consistency)",
    ]
    assert all("cannot score this prompt set" in p for p in problems)
