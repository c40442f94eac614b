"""The user docs stay true: README's reward example runs, docs/configuration.md is what the
generator makes of the config as it is now, relative links resolve, and nothing in the
repository points at design notes that a clone does not have."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
# build outputs and environments: not part of the repository
SKIPPED_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", "runs", "wandb"}
SKIPPED_DIRS |= {".whl", ".whl_base", ".gl", "build", "dist"}
FILE_SUFFIXES = {"safetensors", "json", "jsonl", "md", "png", "gif", "mp4", "yaml", "py"}


def _code_blocks(path: Path, language: str) -> list[str]:
    text = path.read_text(encoding="utf-8")
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.M | re.S)


def _reward_examples() -> list[pytest.param]:
    return [
        pytest.param(block, id=f"{path.name}-{index}")
        for path in (ROOT / "README.md", ROOT / "docs" / "rewards.md")
        for index, block in enumerate(_code_blocks(path, "python"))
        if "register_reward" in block
    ]


@pytest.mark.parametrize("block", _reward_examples())
def test_reward_example_runs(block):
    from vsa2_rl.rewards import get_reward, registry

    namespace: dict = {}
    try:
        exec(compile(block, "<docs example>", "exec"), namespace)
        scores = namespace["scores"]
        assert scores.dtype == torch.float32 and scores.shape == (2,)
        videos = torch.rand(3, 4, 3, 8, 8)
        again = get_reward("redness")(videos, ["x"] * 3, [{}] * 3)
        assert again.shape == (3,) and bool(torch.isfinite(again).all())
    finally:
        registry._REGISTRY.pop("redness", None)


def test_readme_has_a_reward_example():
    assert any("README" in p.id for p in _reward_examples())


def _generator():
    spec = importlib.util.spec_from_file_location(
        "gen_config_doc", ROOT / "scripts" / "gen_config_doc.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_doc_matches_the_config():
    generator = _generator()
    current = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert current == generator.render(), (
        "docs/configuration.md is stale: run python scripts/gen_config_doc.py"
    )
    assert generator.main(["--check"]) == 0


def test_configuration_doc_lists_every_key():
    from vsa2_rl.config import RunConfig, _all_keys

    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    sections = {key for key in _all_keys(RunConfig) if f"## {key}\n" in page}
    missing = [k for k in _all_keys(RunConfig) if f"`{k}`" not in page and k not in sections]
    assert not missing


def _code_spans(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    return re.findall(r"`([^`\n]+)`", text) + _code_blocks(path, r"\w*")


def test_docs_name_only_real_config_keys():
    from vsa2_rl.config import RunConfig, _all_keys

    keys = set(_all_keys(RunConfig))
    sections = {key for key in keys if "." not in key}
    unknown = []
    for page in [*PAGES, ROOT / "benchmarks" / "BENCHMARKS.md"]:
        for code in _code_spans(page):
            for token in re.findall(r"(?<![\w./-])([a-z_]+(?:\.[a-z_0-9]+|\[\w*\])+)", code):
                suffix = token.rsplit(".", 1)[-1]
                if token.split(".")[0] not in sections or suffix in FILE_SUFFIXES:
                    continue  # not a config key, or a file name such as eval.json
                key = re.sub(r"\.kwargs\..*$", ".kwargs", re.sub(r"\[\w*\]", "", token))
                entry = key.rsplit(".", 1)[-1] in {"name", "weight", "kwargs"}
                if key not in keys and not (entry and key.startswith(("rewards.", "eval."))):
                    unknown.append(f"{page.name}: {token}")
    assert not unknown


def test_docs_name_only_real_serve_reward_flags():
    from vsa2_rl.cli import _parser

    commands = next(a for a in _parser()._actions if a.dest == "command")
    flags = {s for a in commands.choices["serve-reward"]._actions for s in a.option_strings}
    text = (ROOT / "docs" / "rewards.md").read_text(encoding="utf-8")
    table = text.split("| `serve-reward` flag |", 1)[1].split("\n\n", 1)[0]
    documented = set(re.findall(r"`(--[a-z-]+)`", table))
    assert documented and documented <= flags


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def _links(path: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for link in _links(page):
        if re.match(r"[a-z]+:", link):  # http:, https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists() or (path.suffix == ".md" and anchor not in _anchors(path) | {""}):
            broken.append(link)
    assert not broken, f"{page.name}: broken links {broken}"


def test_docs_cover_the_user_topics():
    names = {path.name for path in DOCS}
    wanted = {"concepts", "configuration", "rewards", "distributed", "kernels", "results", "wan"}
    assert {f"{name}.md" for name in wanted} <= names


def test_no_file_mentions_design_notes_outside_the_repository():
    # spelt in two parts so that this file does not name them itself
    needles = [("DESIGN" + ".md").encode(), ("CONTRACTS" + ".md").encode()]
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and not d.endswith(".egg-info")]
        for name in files:
            path = Path(folder, name)
            data = path.read_bytes()
            found += [f"{path.relative_to(ROOT)}: {n.decode()}" for n in needles if n in data]
    assert not found
