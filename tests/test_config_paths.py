"""Config values and config paths are checked apart: a config constructs without looking at the
disk, and ``check_paths`` / ``check_target_paths`` refuse a path that is not what its key needs,
naming the key. The eval targets (``run_dir``, ``run_dirs``, ``checkpoint``) are no run settings."""

import os

import pytest

from vsa2_rl.cli import main
from vsa2_rl.config import (
    ConfigError,
    EvalTargets,
    LoraConfig,
    ModelConfig,
    PromptsConfig,
    RunConfig,
    TrainConfig,
    check_paths,
    check_resume,
    check_target_paths,
    config_from_tree,
    config_tree,
    load_config,
    load_eval_config,
    load_recorded_config,
    to_yaml,
)

# what each key needs, made on disk by hand here rather than with the code under test
KEYS = ("model.path", "model.lora.init_from", "prompts.file", "prompts.eval_file", "train.resume")


def _make(key: str, state: str, root) -> str:
    """A path for ``key`` that is missing, there but of the wrong kind, or what the key needs."""
    path = root / key.replace(".", "_")
    if state == "missing":
        return str(path)
    if key.startswith("prompts."):
        if state == "wrong kind":
            path.mkdir()  # a folder where a file belongs
        else:
            path.write_text("a red ball moving left\n")
        return str(path)
    path.mkdir()
    needed = {
        "model.path": ["model_index.json"],
        "model.lora.init_from": ["adapter_config.json", "adapter_model.safetensors"],
        "train.resume": ["COMPLETE"],
        "checkpoint": ["COMPLETE"],
    }[key]
    for name in needed if state == "right" else needed[:-1]:  # wrong kind: one file short
        (path / name).write_text("{}")
    return str(path)


def _config(key: str, path: str) -> RunConfig:
    prompts = PromptsConfig(**{key.split(".")[1]: path}) if key.startswith("prompts.") else None
    model = ModelConfig()
    if key == "model.path":  # a Wan run, which needs a prompt file: this one
        model, prompts = ModelConfig(kind="wan", path=path), PromptsConfig(file=__file__)
    if key == "model.lora.init_from":
        model = ModelConfig(lora=LoraConfig(enabled=True, init_from=path))
    train = TrainConfig(resume=path) if key == "train.resume" else None
    return RunConfig(model=model, prompts=prompts or PromptsConfig(), train=train or TrainConfig())


def _forbid_disk(monkeypatch) -> None:
    def touched(*args, **kwargs):
        raise AssertionError(f"the config looked at the disk: {args}")

    for name in ("stat", "lstat", "listdir", "scandir", "access", "open"):
        monkeypatch.setattr(os, name, touched)


def test_configs_naming_missing_paths_construct_without_looking_at_the_disk(monkeypatch):
    missing = "/nonexistent/vsa2_rl_test"
    assert not os.path.exists(missing)
    _forbid_disk(monkeypatch)
    config = RunConfig(
        model=ModelConfig(
            kind="wan", path=missing, lora=LoraConfig(enabled=True, init_from=missing)
        ),
        prompts=PromptsConfig(file=missing, eval_file=missing),
        train=TrainConfig(resume=missing),
    )
    targets = EvalTargets(run_dirs=[missing], run_dir=missing, checkpoint=missing)
    monkeypatch.undo()
    assert config.model.path == missing and targets.checkpoint == missing
    assert config_from_tree(config_tree(config), "test").train.resume == missing
    with pytest.raises(ConfigError, match=r"^model.path: directory not found: /nonexistent/"):
        check_paths(config)


@pytest.mark.parametrize("state", ["missing", "wrong kind", "right"])
@pytest.mark.parametrize("key", KEYS)
def test_check_paths_refuses_what_the_key_cannot_use_and_names_it(key, state, tmp_path):
    path = _make(key, state, tmp_path)
    config = _config(key, path)  # constructs whatever is on disk
    usable = {  # the real condition, from the disk
        "model.path": os.path.isdir(path) and bool(os.listdir(path)),
        "model.lora.init_from": all(
            os.path.isfile(os.path.join(path, name))
            for name in ("adapter_config.json", "adapter_model.safetensors")
        ),
        "prompts.file": os.path.isfile(path),
        "prompts.eval_file": os.path.isfile(path),
        "train.resume": os.path.isfile(os.path.join(path, "COMPLETE")),
    }[key]
    assert usable == (state == "right")
    if usable:
        check_paths(config)
        return
    with pytest.raises(ConfigError) as error:
        check_paths(config)
    assert str(error.value).startswith(f"{key}: ") and path in str(error.value)


@pytest.mark.parametrize("state", ["missing", "wrong kind", "right"])
def test_check_target_paths_refuses_a_folder_that_is_no_checkpoint(state, tmp_path):
    from vsa2_rl.rl.checkpoint import COMPLETE_MARKER

    path = _make("checkpoint", state, tmp_path)
    targets = EvalTargets(checkpoint=path)
    if os.path.isfile(os.path.join(path, COMPLETE_MARKER)):
        check_target_paths(targets)
        return
    with pytest.raises(ConfigError) as error:
        check_target_paths(targets)
    assert str(error.value).startswith(f"checkpoint: {path}" if state != "missing" else "checkp")
    assert path in str(error.value)


def test_loaders_check_paths_unless_told_not_to(tmp_path):
    missing = str(tmp_path / "missing.txt")
    with pytest.raises(ConfigError, match=r"^prompts.file: file not found: "):
        load_config(None, [f"prompts.file={missing}"])
    assert load_config(None, [f"prompts.file={missing}"], check_files=False).prompts.file == missing
    with pytest.raises(ConfigError, match=r"^checkpoint: folder not found: "):
        load_eval_config(None, [f"checkpoint={missing}"])
    _, targets = load_eval_config(None, [f"checkpoint={missing}"], check_files=False)
    assert targets.checkpoint == missing


def test_eval_targets_are_given_like_keys_and_are_no_run_settings(tmp_path):
    path = tmp_path / "eval.yaml"
    path.write_text("run_dir: runs/c\neval:\n  seed: 7\n")
    config, targets = load_eval_config(
        str(path), ["run_dirs=[runs/a,runs/b]", "checkpoint=runs/a/checkpoints/step_2"],
        check_files=False,
    )  # fmt: skip
    assert targets.run_folders == [
        ("run_dirs", "runs/a"),
        ("run_dirs", "runs/b"),
        ("run_dir", "runs/c"),
    ]
    assert targets.checkpoint == "runs/a/checkpoints/step_2" and config.eval.seed == 7
    assert not {"run_dir", "run_dirs", "checkpoint"} & set(config_tree(config))
    assert "run_dir" not in to_yaml(config)
    with pytest.raises(ConfigError, match=r"^run_dirs: expects a list"):
        load_eval_config(None, ["run_dirs=runs/a"], check_files=False)


@pytest.mark.parametrize("override", ["checkpoint=runs/x/checkpoints/step_1", "run_dir=runs/x"])
def test_train_refuses_an_eval_target_in_one_line(override, tmp_path, capsys):
    out_dir = tmp_path / "run"
    assert main(["train", override, f"out_dir={out_dir}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    key = override.split("=")[0]
    assert len(err) == 1 and err[0].startswith(f"error: {key}: names a model for vsa2-rl eval")
    assert "train.resume=DIR" in err[0] and not out_dir.exists()


def test_configs_recorded_with_the_eval_targets_still_load_and_resume(tmp_path):
    # what a run's config.yaml held when run_dirs, run_dir and checkpoint were RunConfig keys
    recorded = to_yaml(RunConfig()) + "run_dirs: []\nrun_dir: null\ncheckpoint: null\n"
    path = tmp_path / "config.yaml"
    path.write_text(recorded)
    assert load_recorded_config(str(path), "run_dir") == RunConfig()
    assert load_config(str(path), []) == RunConfig()  # as --config: unset targets are no error
    tree = {**config_tree(RunConfig()), "run_dirs": [], "run_dir": None, "checkpoint": None}
    assert config_from_tree(tree, "checkpoint: old") == RunConfig()
    check_resume(tree, RunConfig(), "old")  # no "changed since the checkpoint"


def test_a_trained_model_is_checked_for_the_folders_its_model_loads_from_alone(tmp_path):
    import torch

    from vsa2_rl.eval.sweep import resolve_targets
    from vsa2_rl.rl.checkpoint import save_checkpoint

    checkpoint = save_checkpoint(
        tmp_path / "run" / "checkpoints", 1, {"model": {"w": torch.ones(1)}}
    )
    gone = tmp_path / "gone"
    recorded = tmp_path / "run" / "config.yaml"  # what _checkpoint_config reads (no config.pt)
    # trained from a prompt file and a checkpoint that are gone since: no use to an evaluation
    recorded.write_text(f"prompts:\n  file: {gone}.txt\ntrain:\n  resume: {gone}\n")
    (target,) = resolve_targets(RunConfig(), EvalTargets(checkpoint=str(checkpoint)))
    assert target.config.prompts.file == f"{gone}.txt" and target.checkpoint == str(checkpoint)
    # trained on a model folder that is gone since: the model cannot load
    recorded.write_text(f"model:\n  path: {gone}\n")
    with pytest.raises(ConfigError, match=rf"^model.path: directory not found: {gone} .*step_1\)$"):
        resolve_targets(RunConfig(), EvalTargets(checkpoint=str(checkpoint)))


def test_a_tilde_in_every_path_key_is_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    keys = {
        "out_dir": "~/run",
        "model.path": "~/wan",
        "model.text_cache_dir": "~/cache",
        "model.lora.init_from": "~/adapter",
        "prompts.file": "~/p.txt",
        "prompts.eval_file": "~/e.txt",
        "train.resume": "~/run/checkpoints/step_2",
    }
    targets = ["run_dir=~/a", "run_dirs=[~/b]", "checkpoint=~/c"]
    config, found = load_eval_config(
        None, [f"{key}={value}" for key, value in keys.items()] + targets, check_files=False
    )
    tree = config_tree(config)
    for key, value in keys.items():
        section, *rest = key.split(".")
        leaf = tree[section] if rest else tree
        for part in rest[:-1]:
            leaf = leaf[part]
        assert leaf[rest[-1] if rest else key] == str(tmp_path / value[2:]), key
    assert found.run_dir == str(tmp_path / "a") and found.run_dirs == [str(tmp_path / "b")]
    assert found.checkpoint == str(tmp_path / "c")
    assert load_config(None, ["train.resume=auto"], check_files=False).train.resume == "auto"


def test_a_text_cache_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "cache").touch()
    with pytest.raises(ConfigError, match=r"^model.text_cache_dir: .*/cache is not a folder"):
        check_paths(RunConfig(model=ModelConfig(text_cache_dir=str(tmp_path / "cache"))))
