"""The shipped prompt sets (configs/prompts/, written by scripts/make_prompt_sets.py): the script
writes the committed files again, the evaluation prompts pair subjects and motions never paired
in training from parts that all occur in it, and every model recipe loads with its prompt files."""

import glob
import importlib.util
import os
import re
import sys

import numpy as np
import pytest
from PIL import Image

from vsa2_rl.config import load_config
from vsa2_rl.data.prompts import read_prompt_records
from vsa2_rl.runtime import load_prompt_records

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = os.path.join(REPO, "configs", "prompts")
RECIPES = sorted(
    glob.glob(os.path.join(REPO, "configs", "wan2_*.yaml"))
    + glob.glob(os.path.join(REPO, "configs", "hunyuan_*.yaml"))
    + glob.glob(os.path.join(REPO, "configs", "minimax_*.yaml"))
    + glob.glob(os.path.join(REPO, "configs", "ltx2_*.yaml"))
)


def _script():
    spec = importlib.util.spec_from_file_location(
        "make_prompt_sets", os.path.join(REPO, "scripts", "make_prompt_sets.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def _lines(path: str) -> list[str]:
    with open(path, encoding="utf-8") as handle:
        return handle.read().splitlines()


def _parts(line: str, script) -> tuple[str, str, str, str]:
    """(subject, motion, scene, camera) of a prompt, read back from its text."""
    subjects = "|".join(map(re.escape, script.AGENTS + script.OBJECTS))
    found = re.fullmatch(rf"(.+), ({subjects}) (.+)\. (.+)\.", line)
    assert found, f"not a '<Scene>, <subject> <motion>. <Camera>.' prompt: {line}"
    scene, subject, motion, camera = found.groups()
    return subject, motion, scene.lower(), camera[0].lower() + camera[1:]


def test_the_script_writes_the_committed_files(tmp_path):
    _script().main(["--out", str(tmp_path)])
    for name in ("wan_motion_train.txt", "wan_motion_eval.txt", "i2v_example.jsonl"):
        assert _lines(tmp_path / name) == _lines(os.path.join(PROMPTS, name)), name
    written = sorted(os.listdir(tmp_path / "i2v_images"))
    assert written == sorted(os.listdir(os.path.join(PROMPTS, "i2v_images")))
    for name in written:  # pixels, not bytes: PNG compression may differ between zlib versions
        ours = np.asarray(Image.open(tmp_path / "i2v_images" / name))
        assert np.array_equal(
            ours, np.asarray(Image.open(os.path.join(PROMPTS, "i2v_images", name)))
        )


def test_eval_prompts_pair_parts_never_paired_in_training():
    script = _script()
    train = _lines(os.path.join(PROMPTS, "wan_motion_train.txt"))
    held_out = _lines(os.path.join(PROMPTS, "wan_motion_eval.txt"))
    assert (len(train), len(held_out)) == (400, 100)
    assert len(set(train)) == 400 and len(set(held_out)) == 100
    train_parts = [_parts(line, script) for line in train]
    eval_parts = [_parts(line, script) for line in held_out]
    for parts in (train_parts, eval_parts):  # read back as the script's own parts
        assert {p[2] for p in parts} <= set(script.SCENES)
        assert {p[3] for p in parts} <= set(script.CAMERAS)
    pairs = {
        split: {p[:2] for p in parts}
        for split, parts in [("train", train_parts), ("eval", eval_parts)]
    }
    # 10 agents x 20 motions + 5 objects x 10 motions, one pair in five held out, each twice
    assert (len(pairs["train"]), len(pairs["eval"])) == (200, 50)
    assert not pairs["train"] & pairs["eval"]
    for index, name in enumerate(("subject", "motion", "scene", "camera")):
        seen = {p[index] for p in train_parts}
        unseen = {p[index] for p in eval_parts} - seen
        assert not unseen, f"eval {name}s never in training: {unseen}"
    # every motion the sets know is held out with some subject: each kind is evaluated
    motions = [
        m
        for table in (script.AGENT_MOTIONS, script.OBJECT_MOTIONS)
        for k in table.values()
        for m in k
    ]
    assert {p[1] for p in eval_parts} == set(motions)


def test_the_i2v_example_names_its_images_by_relative_path():
    records = read_prompt_records(os.path.join(PROMPTS, "i2v_example.jsonl"), "prompts.file")
    assert len(records) == 8
    for record in records:
        assert os.path.dirname(record.image) == os.path.join(PROMPTS, "i2v_images")
        with Image.open(record.image) as image:
            assert image.size == (832, 480)
    for line in _lines(os.path.join(PROMPTS, "i2v_example.jsonl")):
        assert '"image": "i2v_images/' in line  # relative, so the folder can move


@pytest.mark.parametrize("recipe", RECIPES, ids=os.path.basename)
def test_each_recipe_loads_with_its_prompt_files(recipe, tmp_path, monkeypatch):
    (tmp_path / "model_index.json").write_text("{}")  # a model folder is not empty
    monkeypatch.chdir(REPO)  # the recipes name their prompt files from the repository root
    config = load_config(recipe, [f"model.path={tmp_path}"])
    name = os.path.basename(recipe)
    kinds = {"hunyuan_": "hunyuan_video15", "minimax_": "minimax_h3", "ltx2_": "ltx2"}
    expected_kind = next((kind for prefix, kind in kinds.items() if name.startswith(prefix)), "wan")
    assert config.model.kind == expected_kind and config.model.lora.enabled
    assert config.sparsity.eval < config.sparsity.train
    train, held_out = load_prompt_records(config, "train"), load_prompt_records(config, "eval")
    if config.prompts.file.endswith(".jsonl"):  # image-to-video: the example
        assert len(train) == len(held_out) == 8 and all(r.image for r in train + held_out)
    else:
        assert (len(train), len(held_out)) == (400, 100)
        assert not {r.text for r in train} & {r.text for r in held_out}
