"""benchmarks/sparsity_claims.py at a tiny scale on the CPU: every part runs from the one
before it, the measured densities of VSA's router are its closed-form budget, and the verdict
rule judges paired differences against their spread."""

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import sparsity_claims

from vsa2_rl.toy import testbed


def test_verdict_compares_the_mean_difference_with_its_spread():
    verdict = sparsity_claims.verdict
    assert verdict([-0.3, -0.1], "lower") == "reproduced"  # mean -0.2, sd 0.14
    assert verdict([-0.3, -0.1], "higher") == "not reproduced"
    assert verdict([-0.3, 0.2], "lower") == "inconclusive"  # mean -0.05, sd 0.35
    assert verdict([0.5], "higher").startswith("inconclusive")
    # "matches": only a worse side by more than the spread fails the claim
    assert verdict([-0.3, 0.2], "lower", "matches") == "reproduced (within the spread)"
    assert verdict([0.3, 0.1], "lower", "matches") == "not reproduced"
    assert verdict([-0.3, -0.1], "lower", "matches").startswith("reproduced (better")


@pytest.fixture
def tiny_testbed(monkeypatch):
    """The testbed's recipe at 16 / 32 px x 4 frames, 2 blocks of width 32, a few steps."""
    architecture = {"patch_size": [1, 4, 4], "num_attention_heads": 2, "attention_head_dim": 16,
                    "ffn_dim": 64, "num_layers": 2, "freq_dim": 32}  # fmt: skip
    settings = {"TESTBED_ARCHITECTURE": architecture, "FRAMES": 4, "LOW_SIZE": 16,
                "HIGH_SIZE": 32, "BATCH": 2, "LOW_STEPS": 4, "HIGH_STEPS": 4,
                "REBASE_STEPS": 2, "VAL_EVERY": 2, "WARMUP_STEPS": 1}  # fmt: skip
    for name, value in settings.items():
        monkeypatch.setattr(testbed, name, value)
    monkeypatch.setattr(sparsity_claims, "CLAIM1_STEPS", 2)
    monkeypatch.setattr(sparsity_claims, "CLAIM2_STEPS", 2)


def test_every_part_runs_and_the_report_has_each_claim(tmp_path, tiny_testbed):
    out = tmp_path / "claims"
    sparsity_claims.main(["base", "claim1", "claim2", "report", "--out", str(out),
                          "--backend", "torch", "--seeds", "0", "1",
                          "--densities", "0.5", "0.25"])  # fmt: skip
    report = (out / "claims.md").read_text()
    for heading in ("## Claim 1", "## Claim 2", "## Claim 3"):
        assert heading in report
    assert "not run" not in report
    assert (out / "claim1.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "claim3.png").read_bytes()[:4] == b"\x89PNG"
    # at 32 px x 4 frames, 8 x 8 x 4 = 256 tokens: 4 cubes of 64 keys; VSA's router keeps
    # ceil(density * 4) of them for every query tile
    for density in (0.5, 0.25):
        folder = sparsity_claims.claim1_folder(out, "kv64 top-k", density, 0)
        validation = json.loads((folder / "config.json").read_text())["training"]["stages"][-1]
        measured = validation["validation"][f"density@{1.0 - density}"]
        assert measured == pytest.approx(math.ceil(density * 4) / 4)
    # claim 3's curves: a point every 2 steps of both pretraining stages
    info = json.loads((out / "base_rebase" / "config.json").read_text())["training"]
    assert [[p["step"] for p in stage["curve"]] for stage in info["stages"]] == [[2, 4], [2, 4]]
    # dense and rebase continue one build of the 32 px stage: its figures, carried over
    low = json.loads((out / "base_low" / "config.json").read_text())["training"]["stages"]
    dense = json.loads((out / "base_dense" / "config.json").read_text())["training"]["stages"]
    assert low[0] == dense[0] == info["stages"][0]


def test_a_finished_run_is_not_run_again(tmp_path, tiny_testbed, monkeypatch):
    out = tmp_path / "claims"
    sparsity_claims.main(["base", "--out", str(out), "--backend", "torch"])
    before = (out / "base_dense" / "config.json").read_text()

    def refuse(*args, **kwargs):
        raise AssertionError("a finished base was built again")

    monkeypatch.setattr(sparsity_claims, "build_toy_model", refuse)
    sparsity_claims.main(["base", "--out", str(out), "--backend", "torch"])
    assert (out / "base_dense" / "config.json").read_text() == before
