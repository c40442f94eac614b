"""benchmarks/bench_model_families.py on the CPU with ``--tiny`` (reference attention): every
family builds with LoRA and VSA2, runs dense and sparse, and its row says what ran."""

import argparse
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_model_families


def test_every_family_runs_dense_and_at_the_asked_density(tmp_path):
    out = tmp_path / "families.md"
    assert bench_model_families.main(["--tiny", "--reps", "1", "--out", str(out)]) == 0
    rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| ")]
    assert [row[0].strip("| ") for row in rows[1:]] == [
        family.name for family in bench_model_families.FAMILIES.values()
    ]
    for row in rows[1:]:
        # 128 video tokens: 2 tiles, 2 key segments of 64; top-k at 0.875 keeps ceil(0.25) = 1
        assert row[2] == "128" and float(row[9]) == 0.5, row
        assert all(float(x) > 0 for x in row[3].split(" / ") + row[5].split(" / ")), row


def test_out_of_memory_row_names_the_phase_and_the_request(tmp_path, monkeypatch):
    def runs_out(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.50 GiB. GPU 0 ...")

    monkeypatch.setattr(bench_model_families, "timed", runs_out)
    out = tmp_path / "families.md"
    argv = ["--tiny", "--reps", "1", "--families", "ltx2", "--out", str(out)]
    assert bench_model_families.main(argv) == 0
    assert "| LTX-2 (18.9B) | out of memory in dense forward, tried to allocate 12.50 GiB |" in (
        out.read_text()
    )


def test_latents_override_is_parsed_and_bad_ones_name_the_argument():
    assert bench_model_families.parse_latents("hunyuan_video15=31x30x53") == (
        "hunyuan_video15",
        (31, 30, 53),
    )
    for bad in ("wan=1x2x3", "ltx2=16x22", "ltx2=16x22xA"):
        with pytest.raises(argparse.ArgumentTypeError, match="--latents"):
            bench_model_families.parse_latents(bad)
