"""benchmarks/bench_model_families.py on the CPU with ``--tiny`` (reference attention): every
family builds with LoRA and VSA2, runs dense and sparse, and its row says what ran."""

import sys
from pathlib import Path

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
