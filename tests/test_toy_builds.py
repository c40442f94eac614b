"""benchmarks/toy_builds.py on made-up build folders: a build's record keeps its stages' sizes
and lengths, seconds, device and last-stage sample figures, a build recorded again replaces its
line, and the table from the records file alone is the one worked out by hand below."""

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import toy_builds


def _write_build(folder: Path, direction: float, device: str | None = "cuda") -> None:
    """A toy build's config.json: 32 px then 64 px, samples of its last stage at 0 and 0.5."""
    figures = {"shape_fidelity": 0.9, "prompt_motion": 0.55, "direction_match": direction,
               "group_std": 0.2, "speed_error": 0.4}  # fmt: skip
    stages = [
        {"stage": {"size": 32, "num_frames": 16, "steps": 375, "batch_size": 16, "vsa2": False},
         "samples": {"dense": figures}, "curve": [{"step": 375, "dense": 0.03}]},
        {"stage": {"size": 64, "num_frames": 16, "steps": 250, "batch_size": 16, "vsa2": True},
         "samples": {"vsa2@0.0": {**figures, "shape_fidelity": 0.5}, "vsa2@0.5": figures},
         "curve": [{"step": 250, "vsa2@0.9": 0.02}]},
    ]  # fmt: skip
    training = {"recipe": {"seed": 0}, "stages": stages, "build_seconds": 220.6}
    if device:
        training["build_device"] = device
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"transformer": {}, "training": training}))


def test_a_record_keeps_what_the_tables_read(tmp_path):
    _write_build(tmp_path / "base_s025", 0.229)
    assert toy_builds.build_record(tmp_path / "base_s025") == {
        "build": "base_s025",
        "stages": [[32, 16, 375, 16], [64, 16, 250, 16]],
        "build_seconds": 220.6,
        "build_device": "cuda",
        "samples": {
            "vsa2@0.0": {"direction_match": 0.229, "shape_fidelity": 0.5, "prompt_motion": 0.55},
            "vsa2@0.5": {"direction_match": 0.229, "shape_fidelity": 0.9, "prompt_motion": 0.55},
        },
    }


def test_the_table_from_the_records_alone_and_a_build_recorded_again(tmp_path, capsys):
    records = tmp_path / "builds.jsonl"
    _write_build(tmp_path / "b", 0.3, device=None)
    _write_build(tmp_path / "a", 0.2)
    toy_builds.main([str(records), str(tmp_path / "b"), str(tmp_path / "a")])
    from_folders = capsys.readouterr().out
    shutil.rmtree(tmp_path / "a")
    shutil.rmtree(tmp_path / "b")
    toy_builds.main([str(records)])
    assert capsys.readouterr().out == from_folders
    assert from_folders.splitlines()[2:] == [
        "| a | 6,000 at 32 px x 16 + 4,000 at 64 px x 16 | 221 | 0.200 | 0.900 | 0.550 |",
        "| b | 6,000 at 32 px x 16 + 4,000 at 64 px x 16 | 221 | 0.300 | 0.900 | 0.550 |",
    ]
    _write_build(tmp_path / "a", 0.25)  # rebuilt: its line is replaced, b's stays
    toy_builds.main([str(records), str(tmp_path / "a"), "--at", "0"])
    rows = capsys.readouterr().out.splitlines()[2:]
    assert [row.split(" | ")[3:5] for row in rows] == [["0.250", "0.500"], ["0.300", "0.500"]]
    assert len(records.read_text().splitlines()) == 2


def test_a_folder_without_a_build_and_a_missing_records_file_are_refused(tmp_path):
    with pytest.raises(SystemExit, match=r"no config.json there"):
        toy_builds.main([str(tmp_path / "builds.jsonl"), str(tmp_path)])
    with pytest.raises(SystemExit, match=r"builds.jsonl: no such file"):
        toy_builds.main([str(tmp_path / "builds.jsonl")])
