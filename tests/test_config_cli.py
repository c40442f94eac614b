"""Configuration loading and the command line: precedence, validation, exit codes."""

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from vsa2_rl.cli import main
from vsa2_rl.config import (
    ConfigError,
    RLConfig,
    RunConfig,
    check_resume,
    config_tree,
    help_lines,
    load_config,
    load_eval_config,
)
from vsa2_rl.config.loading import load_recorded_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLOW_GRPO_TOY = os.path.join(REPO, "tests", "flow_grpo_toy.yaml")


def test_precedence_schema_yaml_cli(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  num_steps: 7\n  learning_rate: 0.5\nseed: 3\n")
    config = load_config(str(path), ["train.num_steps=2"])
    assert isinstance(config, RunConfig)
    assert config.train.num_steps == 2  # CLI beats YAML
    assert config.train.learning_rate == 0.5  # YAML beats schema
    assert config.seed == 3
    assert config.rl.group_size == RunConfig().rl.group_size  # schema default


def test_default_config_is_valid_and_embedded():
    config = load_config()
    assert config.model.kind == "toy"
    assert config.sparsity.eval < config.sparsity.train  # hard-to-easy
    assert [f.name for f in config.rewards.functions] == ["prompt_motion"]
    assert [g.name for g in config.eval.guard_rewards] == [
        "prompt_direction",
        "shape_fidelity",
        "image_quality",
    ]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["train.num_step=3"],
            "train.num_step: unknown config key (did you mean 'train.num_steps'",
        ),
        (["train.num_steps=abc"], "train.num_steps"),
        (["rl.group_size=1"], "rl.group_size: must be >= 2"),
        (["attention.kv_block=24"], "attention.kv_block: must be 16, 32 or 64"),
        (["attention.mode=top3"], "attention.mode: got 'top3'"),
        (["sparsity.train=1.0"], "sparsity.train: must be in [0, 1)"),
        (["sparsity.train=0.5", "sparsity.eval=0.8"], "sparsity.eval: hard-to-easy"),
        (
            ["sparsity.train=0.9", "sparsity.train_end=0.5", "sparsity.eval=0.75"],
            "sparsity.train_end: hard-to-easy: the curriculum ends at sparsity 0.5, below",
        ),
        (["model.kind=wan"], "model.path: model.kind=wan needs a local diffusers"),
        (["model.kind=wan", "prompts.file=p.txt", "model.path=/no/dir"], "model.path: directory"),
        (["sampler.sde_window=[3,99]"], "sampler.sde_window"),
        (["eval.sparsities=[0.0,1.0]"], "eval.sparsities: each must be in [0, 1)"),
        (["rewards.functions=[{weight: 1}]"], "rewards.functions[0].name"),
        (["prompts.file=/no/such/prompts.txt"], "prompts.file: file not found"),
        (["prompts.file=/tmp"], "prompts.file: /tmp is a folder; give a prompt file"),
        (["prompts.file=/dev/null"], "prompts.file: /dev/null is not a regular file; give a"),
        (["out_dir="], "out_dir: needs a value (nothing follows '='), e.g. out_dir=VALUE"),
        (["train.warmup_steps=-2"], "train.warmup_steps: must be >= 0, got -2"),
        (["train.checkpoint_every=-1"], "train.checkpoint_every: must be >= 0"),
        (["train.sample_every=-5"], "train.sample_every: must be >= 0 (0 = never)"),
        (["train.weight_decay=-0.1"], "train.weight_decay: must be >= 0"),
        (["train.max_grad_norm=-1"], "train.max_grad_norm: must be >= 0"),
        (["model.lora.alpha=0"], "model.lora.alpha: must be > 0"),
        (["eval.guard_rewards=[{kwargs: {}}]"], "eval.guard_rewards[0].name"),
        (["train.num_steps=[1,2"], "train.num_steps: cannot parse the value '[1,2' as YAML"),
        (["eval.sparsities=0.5"], "eval.sparsities: expects a list, e.g. eval.sparsities=[0.0"),
        (["train.learning_rate=inf"], "train.learning_rate: must be a finite number, got inf"),
        (["sampler.noise_level=inf"], "sampler.noise_level: must be a finite number, got inf"),
        (["sampler.shift=inf"], "sampler.shift: must be a finite number, got inf"),
        (["rl.kl_beta=inf"], "rl.kl_beta: must be a finite number, got inf"),
        (["train.max_grad_norm=nan"], "train.max_grad_norm: must be >= 0, got nan"),
        (
            ["rewards.functions=[{name: prompt_motion, weight: .inf}]"],
            "rewards.functions[0].weight: must be a finite number, got inf",
        ),
        (["sampler.noise_level=0"], "sampler.noise_level: 0 makes every rollout step determ"),
        (["rl.group_size=100000000000"], "rl.prompts_per_step = 400,000,000,000 videos"),
        (["rl.group_size=400000"], "rl.group_size x rl.prompts_per_step = 1,600,000 vid"),
        (["train.keep_last=" + "9" * 12], "train.keep_last: must be at most 2**31 - 1 in size"),
        (["train.num_steps=" + "1" * 23], "train.num_steps: must be at most 2**31 - 1 in size"),
        (["seed=" + "1" * 20], "seed: must be at most 2**31 - 1 in size"),
        (["seed=-1"], "seed: must be >= 0, got -1"),
        (["eval.seed=-3"], "eval.seed: must be >= 0, got -3"),
        (["sampler.kind=cps", "sampler.noise_level=1.5"], "sampler.noise_level: must be in [0, 1]"),
        (["model.num_frames=1"], "model.num_frames: must be >= 2 (the rewards score motion"),
        (["eval.sparsities=[0.5,0.0,0.5]"], "eval.sparsities: [0.5] given more than once"),
        (
            ["rewards.functions=[{name:image_quality}]"],
            "no space follows the colon; write {name: image_quality}",
        ),
    ],
)
def test_bad_config_names_the_key(overrides, expected):
    with pytest.raises(ConfigError) as error:
        load_config(FLOW_GRPO_TOY, overrides)
    assert expected in str(error.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("train: {num_steps: 2\n", "is not valid YAML: while parsing a flow mapping"),
        ("- a\n- b\n", "must hold a mapping of keys"),
        (
            "rewards:\n  functions:\n    - name: image_quality\n      kwargs: [1, 2]\n",
            "rewards.functions[0].kwargs: Cannot merge incompatible container types",
        ),
        (
            "rewards:\n  functions:\n    - name: image_quality\n      weight: 0\n",
            "rewards.functions: every weight is 0, so every advantage would be 0",
        ),
    ],
)
def test_bad_yaml_files_name_the_problem(tmp_path, text, expected):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        load_config(str(path), [])
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_files_that_are_not_utf8_name_the_key(tmp_path):
    latin1 = "train:\n  num_steps: 2  # caf\u00e9\n".encode("latin-1")
    (tmp_path / "config.yaml").write_bytes(latin1)
    with pytest.raises(ConfigError, match=r"--config: .*config.yaml is not UTF-8 text"):
        load_config(str(tmp_path / "config.yaml"), [])
    from vsa2_rl.runtime import read_prompt_file

    (tmp_path / "prompts.txt").write_bytes("a caf\u00e9 moving\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"prompts.file: .*prompts.txt is not UTF-8 text"):
        read_prompt_file(str(tmp_path / "prompts.txt"), "prompts.file")


def test_a_guard_reward_kwarg_of_the_wrong_type_names_the_entry():
    from vsa2_rl.eval.sweep import reward_fns

    guard = "eval.guard_rewards=[{name: image_quality, kwargs: {num_frames: [1]}}]"
    config = load_config(None, [guard])
    with pytest.raises(ConfigError, match=r"eval.guard_rewards\[0\] \(image_quality\): "):
        reward_fns(config.eval.guard_rewards, "eval.guard_rewards")


def test_folders_that_are_not_what_a_key_needs(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"model.path: .*empty is an empty folder"):
        load_config(None, [f"model.path={empty}"])
    with pytest.raises(ConfigError, match=r"train.resume: .*empty is not a checkpoint \(no COMP"):
        load_config(None, [f"train.resume={empty}"])
    with pytest.raises(ConfigError, match=r"checkpoint: .*empty is not a checkpoint folder"):
        load_eval_config(None, [f"checkpoint={empty}"])


def test_help_shows_the_values_a_plain_run_uses():
    lines = "\n".join(help_lines())
    default = load_config(None, [])
    assert (
        f"  sparsity.train = {default.sparsity.train!r}  (default.yaml; schema default 0.9)"
        in lines
    )
    assert f"  sampler.num_steps = {default.sampler.num_steps!r}  (default.yaml" in lines
    assert "  train.max_grad_norm = 1.0\n" in lines  # not in default.yaml: the schema default
    assert "  rewards.functions = [{'name': 'prompt_motion'" in lines
    # an installed wheel has no configs/: the schema defaults are what a run uses
    assert "  train.learning_rate = 0.0001\n" in "\n".join(help_lines(path="/no/default.yaml"))


def test_help_lists_every_documented_key():
    lines = "\n".join(help_lines())
    for key in ("train.num_steps", "attention.top_p", "sparsity.eval", "rewards.aggregation"):
        assert f"  {key} = " in lines
    # every leaf key carries a help text
    for entry in help_lines():
        key_line, help_line = entry.split("\n")
        assert help_line.strip(), f"{key_line.strip()} has no help text"


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--config", "/no/such.yaml"],
        ["train", "train.num_step=2"],
        ["train", "model.kind=wan", "model.path=/no/such/dir"],
        ["eval", "eval.sparsities=[1.5]"],
        ["train", "not-a-key-value"],
        ["train", "train.num_steps=[1,2"],
        ["train", "train.warmup_steps=-2"],
    ],
)
def test_cli_bad_input_exits_2_and_writes_nothing(argv, tmp_path, capsys):
    out_dir = tmp_path / "run"
    assert main([*argv, f"out_dir={out_dir}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    assert not out_dir.exists()


@pytest.mark.slow
def test_train_rl_script_is_the_train_subcommand(tmp_path):
    out_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "train_rl.py", "rl.group_size=1", f"out_dir={out_dir}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert (
        result.stderr.strip() == "error: rl.group_size: must be >= 2 (advantages are "
        "relative within a group), got 1"
    )
    assert not out_dir.exists()
    help_text = subprocess.run(
        [sys.executable, "train_rl.py", "--help"], cwd=REPO, capture_output=True, text=True
    )
    assert help_text.returncode == 0 and "sparsity.train" in help_text.stdout


def test_control_recipe_differs_from_the_default_in_its_reward_alone():
    from omegaconf import OmegaConf

    default = OmegaConf.to_container(OmegaConf.structured(load_config(None, [])))
    control = OmegaConf.to_container(
        OmegaConf.structured(load_config(os.path.join(REPO, "configs", "toy_control.yaml"), []))
    )
    assert [f["name"] for f in control["rewards"]["functions"]] == ["random"]
    assert [f["name"] for f in default["rewards"]["functions"]] == ["prompt_motion"]
    # the control scores the default's reward as a guard, next to the default's guards
    guards = [g["name"] for g in control["eval"].pop("guard_rewards")]
    assert guards == ["prompt_motion"] + [g["name"] for g in default["eval"].pop("guard_rewards")]
    for config in (default, control):
        del config["out_dir"], config["rewards"]["functions"]
    assert control == default


def test_a_video_size_the_model_cannot_make_is_a_config_error():
    import torch

    from vsa2_rl.runtime import build_bundle

    config = load_config(None, ["model.height=33", "attention.backend=torch"])
    with pytest.raises(ConfigError, match=r"model.num_frames / model.height / model.width: .*33"):
        build_bundle(config, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("kind", ["toy", "wan"])
def test_a_model_path_that_holds_no_model_is_one_error_line(kind, tmp_path, capsys):
    unrelated = tmp_path / "notes"
    unrelated.mkdir()
    (unrelated / "readme.txt").write_text("not a model\n")
    argv = ["train", f"model.kind={kind}", f"model.path={unrelated}", f"out_dir={tmp_path / 'r'}"]
    if kind == "wan":  # which needs a prompt file, of rl.prompts_per_step prompts at least
        (tmp_path / "prompts.txt").write_text("a red kite rising over a hill\n" * 8)
        argv.append(f"prompts.file={tmp_path / 'prompts.txt'}")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: model.path='{unrelated}'")


def test_only_the_toy_runs_without_a_prompt_file(tmp_path, capsys):
    """A Wan run without prompts.file is refused when the config loads, before its model folder
    is looked at (it does not exist here), and on the command line as one error line."""
    expected = "prompts.file: model.kind=wan needs a prompt file (the built-in prompts are the toy"
    for check_files in (True, False):
        with pytest.raises(ConfigError, match=f"^{re.escape(expected)}"):
            load_config(None, ["model.kind=wan", "model.path=/no/such/dir"], check_files)
    out_dir = tmp_path / "run"
    assert main(["train", "model.kind=wan", "model.path=/no/such/dir", f"out_dir={out_dir}"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {expected} task's); give one (one prompt per line, or .jsonl with condition "
        "images), e.g. the shipped prompts.file=configs/prompts/wan_motion_train.txt"
    ]
    assert not out_dir.exists()
    assert load_config(None, []).prompts.file is None  # the toy keeps its built-in prompts


@pytest.mark.parametrize("device", ["cudafoo", "cuda:1x", "cuda:x", "cuda:-1", "cuda0", "tpu"])
def test_a_device_that_is_not_a_device_names_the_key(device):
    with pytest.raises(ConfigError, match=rf"^device: got '{device}', expected auto, cpu or"):
        load_config(None, [f"device={device}"])


@pytest.mark.parametrize(
    ("device", "expected"), [("cuda", "cuda"), ("cuda:1", "cuda:1"), ("cpu", "cpu")]
)
def test_devices_this_process_sees_resolve(device, expected, monkeypatch):
    from vsa2_rl.runtime import resolve_device

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    assert str(resolve_device(device)) == expected


def test_a_cuda_index_this_process_does_not_see_is_one_error_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    assert main(["eval", "device=cuda:2", f"out_dir={tmp_path / 'eval'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("error: device: 'cuda:2' requested but this process sees 2 CUDA")


def test_overrides_may_stand_on_both_sides_of_the_config_flag(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  num_steps: 7\n")
    argv = ["train", "rl.group_size=1", "--config", str(path), f"out_dir={tmp_path / 'r'}"]
    assert main(argv) == 2  # both overrides were read: group_size's error, out_dir untouched
    assert capsys.readouterr().err.startswith("error: rl.group_size: must be >= 2")
    assert not (tmp_path / "r").exists()
    with pytest.raises(SystemExit):
        main(["train", "--config", str(path), "--no-such-flag"])


def test_more_eval_prompts_than_the_set_holds_warns_and_takes_them_all():
    config = load_config(None, ["eval.num_prompts=30", "eval.samples_per_prompt=2"])
    prompts = [f"prompt {i}" for i in range(3)]
    with pytest.warns(UserWarning, match=r"eval.num_prompts=30 but the evaluation prompt set hol"):
        selected = config.eval.select_prompts(prompts)
    assert selected == [p for p in prompts for _ in range(2)]


@pytest.mark.parametrize("text", ["", "# only a comment\n\n"])
def test_an_empty_config_file_is_an_error_naming_it(tmp_path, capsys, text):
    empty = tmp_path / "e.yaml"
    empty.write_text(text)
    with pytest.raises(ConfigError, match=rf"^--config: {empty} holds no settings"):
        load_config(str(empty))
    assert main(["train", "--config", str(empty), f"out_dir={tmp_path / 'run'}"]) == 2
    assert capsys.readouterr().err.startswith(f"error: --config: {empty} holds no settings")
    assert os.listdir(tmp_path) == ["e.yaml"]


def test_a_full_disk_during_a_checkpoint_save_is_one_error_line(tmp_path, monkeypatch, capsys):
    from vsa2_rl.rl.checkpoint import DiskFull

    def fills_the_disk(config, facts):
        raise DiskFull(28, "checkpoint: writing X/model.safetensors failed: its disk is full")

    monkeypatch.setattr("vsa2_rl.rl.trainer.train", fills_the_disk)
    assert main(["train", f"out_dir={tmp_path / 'run'}"]) == 1
    err = capsys.readouterr().err
    assert err == "error: checkpoint: writing X/model.safetensors failed: its disk is full\n"


def test_ctrl_c_during_training_is_one_line_and_exit_130(tmp_path, monkeypatch, capsys):
    def interrupted(config, facts):
        raise KeyboardInterrupt

    monkeypatch.setattr("vsa2_rl.rl.trainer.train", interrupted)
    assert main(["train", f"out_dir={tmp_path / 'run'}"]) == 130
    assert capsys.readouterr().err == (
        "vsa2-rl train: interrupted (Ctrl-C); the checkpoints written are whole, continue with "
        "train.resume=auto\n"
    )


def test_a_config_that_is_a_folder_says_so(tmp_path):
    with pytest.raises(ConfigError, match=rf"^--config: {tmp_path} is a folder; give a YAML file"):
        load_config(str(tmp_path))


def test_an_emptied_run_config_names_the_key_that_led_to_it(tmp_path):
    (tmp_path / "config.yaml").write_text("# nothing\n")
    with pytest.raises(
        ConfigError, match=r"^run_dir: .*config.yaml holds no settings .*restore it$"
    ):
        load_recorded_config(str(tmp_path / "config.yaml"), "run_dir")


def test_the_old_grpo_section_loads_as_rl_with_a_warning(tmp_path):
    """``grpo`` (renamed ``rl``) still loads for one release, from a file and from an override,
    to the config the new name gives, with a warning naming the new key."""
    new = load_config(FLOW_GRPO_TOY, ["rl.kl_beta=0.01", "rl.clip_range=0.1"])
    path = tmp_path / "old.yaml"
    path.write_text(Path(FLOW_GRPO_TOY).read_text().replace("\nrl:\n", "\ngrpo:\n"))
    assert "\ngrpo:\n" in path.read_text()
    with pytest.warns(FutureWarning, match=r"^grpo\.\w+: the grpo section is renamed rl; write"):
        old = load_config(str(path), ["rl.kl_beta=0.01", "rl.clip_range=0.1"])
    assert old == new
    with pytest.warns(FutureWarning, match=r"grpo\.kl_beta: .* write rl\.kl_beta"):
        assert load_config(FLOW_GRPO_TOY, ["grpo.kl_beta=0.01", "rl.clip_range=0.1"]) == new


def test_the_old_name_grpoconfig_imports_as_rlconfig_with_a_warning():
    import vsa2_rl.config

    with pytest.warns(FutureWarning, match=r"GRPOConfig is renamed RLConfig") as caught:
        from vsa2_rl.config import GRPOConfig
    assert GRPOConfig is RLConfig
    assert caught[0].filename == __file__  # the warning points at the importing line
    with pytest.warns(FutureWarning, match=r"import RLConfig"):
        assert vsa2_rl.config.GRPOConfig is RLConfig
    with pytest.raises(AttributeError, match=r"has no attribute 'NoSuchConfig'"):
        vsa2_rl.config.NoSuchConfig  # noqa: B018
    assert "GRPOConfig" not in vsa2_rl.config.__all__


@pytest.mark.parametrize("where", ["file", "command line"])
def test_a_key_under_both_grpo_and_rl_is_an_error(tmp_path, where):
    path = tmp_path / "both.yaml"
    if where == "file":
        path.write_text("grpo:\n  group_size: 3\nrl:\n  group_size: 4\n")
        args = (str(path), [])
    else:
        args = (FLOW_GRPO_TOY, ["grpo.group_size=3", "rl.group_size=4"])
    with pytest.raises(ConfigError, match=r"^grpo\.group_size and rl\.group_size: both given"):
        load_config(*args)


def test_a_run_recorded_with_the_grpo_section_loads_and_resumes(tmp_path):
    """Run folders and checkpoints written before the rename hold ``grpo:``: they load (no
    warning: the user did not write them) and resume under a config of ``rl.*``."""
    config = load_config(FLOW_GRPO_TOY, ["rl.group_size=3"])
    tree = config_tree(config)
    tree["grpo"] = tree.pop("rl")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(tree))
        assert load_recorded_config(str(path), "run_dir") == config
        check_resume(tree, config, "old")
    with pytest.raises(ConfigError, match=r"^rl\.group_size: changed since the checkpoint"):
        check_resume(tree, load_config(FLOW_GRPO_TOY, ["rl.group_size=4"]), "old")
