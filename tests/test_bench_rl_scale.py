"""benchmarks/bench_rl_scale.py's table on the CPU: token counts from Wan's VAE strides, the
rows a run measures and their names, the row of a setting one GPU cannot hold, and the plot's
reader skipping it."""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_rl_scale


def test_latents_and_tokens_follow_wans_strides():
    # 81 frames -> 21 latent frames (4x in time), 720 x 1280 -> 90 x 160 (8x), 2 x 2 patches
    assert bench_rl_scale.latent_shape("720p:81") == (21, 90, 160)
    assert bench_rl_scale._tokens("720p:81") == 21 * 45 * 80 == 75600
    assert bench_rl_scale._tokens("480p:33") == 9 * 30 * 52 == 14040


def test_an_out_of_memory_setting_is_a_row_and_ratios_need_a_measured_dense(tmp_path):
    table = tmp_path / "scale.md"
    table.write_text(bench_rl_scale.HEADER)
    bench_rl_scale.write_out_of_memory("720p:81", "dense", str(table))
    row = {"forward": 1.5, "lora_train": 4.0, "lora": 900.0}
    bench_rl_scale.write_row("720p:81", "0.9", row, {}, str(table))  # dense did not fit
    lines = table.read_text().splitlines()
    assert lines[2] == "| 720p:81 | 75600 | dense |" + " out of memory |" * 7
    assert lines[3] == "| 720p:81 | 75600 | 0.9 | 1.500 | 4.000 | - | 900 | - | - | - |"
    assert bench_rl_scale.read_rows([str(table)]) == {"0.9": {75600: ("720p:81", 900.0)}}


def test_rows_are_dense_once_then_every_kv_block_at_every_sparsity_named_apart():
    args = argparse.Namespace(
        model="1.3b",
        sparsities=[0.0, 0.9, 0.95],
        kv_blocks=[16, 64],
        router_modes=["topp"],
        compile=False,
        fused=False,
    )
    rows = bench_rl_scale.settings(args)
    assert rows == [
        (0.0, None, "topp"),
        (0.9, 16, "topp"),
        (0.95, 16, "topp"),
        (0.9, 64, "topp"),
        (0.95, 64, "topp"),
    ]
    labels = [bench_rl_scale.setting_label(*row, args) for row in rows]
    # the recipe's kv_block (16 for 1.3B) keeps the older tables' names; others say theirs
    assert labels == ["dense", "0.9", "0.95", "0.9 kv64", "0.95 kv64"]
    args.compile, args.model = True, "14b"  # 14B's recipe is kv64
    assert bench_rl_scale.setting_label(0.9, 64, "topp", args) == "0.9 compiled"
    assert bench_rl_scale.setting_label(0.0, None, "topp", args) == "dense compiled"
    args.compile, args.fused = False, True
    assert bench_rl_scale.setting_label(0.875, 64, "topk", args) == "0.875 top-k fused"
    only_sparse = argparse.Namespace(sparsities=[0.9], kv_blocks=[64], router_modes=["topp"])
    assert bench_rl_scale.settings(only_sparse) == [(0.9, 64, "topp")]


def test_each_kv_block_runs_its_own_router_and_top_k_rows_say_so():
    args = argparse.Namespace(
        model="1.3b",
        sparsities=[0.0, 0.875, 0.9375],
        kv_blocks=[16, 64],
        router_modes=["topp", "topk"],
        compile=True,
        fused=False,
    )
    rows = bench_rl_scale.settings(args)
    assert rows == [
        (0.0, None, "topp"),
        (0.875, 16, "topp"),
        (0.9375, 16, "topp"),
        (0.875, 64, "topk"),
        (0.9375, 64, "topk"),
    ]
    labels = [bench_rl_scale.setting_label(*row, args) for row in rows]
    assert labels == [
        "dense compiled",
        "0.875 compiled",
        "0.9375 compiled",
        "0.875 kv64 top-k compiled",
        "0.9375 kv64 top-k compiled",
    ]
