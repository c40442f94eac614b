"""benchmarks/frontier.py on the router claim's recorded runs (benchmarks/results/claims/
runs.jsonl) and a hand-written op table: the losses are the recorded ones, the frontier and the
recipe rule's choice are those worked out by hand below; on a made-up runs.jsonl, the losses
are its claim-1 lines' own."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import frontier

CLAIMS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "claims"
# rows as bench_attention.py writes them; speed-ups made up for the test
OP_TABLE = """| shape | method | sparsity | mode | ms | x cuDNN | eff. TFLOP/s |
|---|---|---|---|---|---|---|
| 720p | cudnn | dense | fwd+bwd | 727.0 | 1.00 | 300 |
| 720p | ours-full-topp-kv16 | 0.875 | fwd | 59.2 | 3.19 | 90 |
| 720p | ours-full-topp-kv16 | 0.875 | fwd+bwd | 279.9 | 2.60 | 90 |
| 720p | ours-full-kv64 | 0.875 | fwd+bwd | 151.5 | 4.80 | 90 |
| 720p | ours-full-topp-kv16 | 0.9375 | fwd+bwd | 148.4 | 4.90 | 90 |
| 720p | ours-full-kv64 | 0.9375 | fwd+bwd | 181.8 | 4.00 | 90 |
| 480p | ours-full-kv64 | 0.75 | fwd+bwd | 74.2 | 9.80 | 90 |
"""


@pytest.fixture
def settings(tmp_path):
    table = tmp_path / "attention.md"
    table.write_text(OP_TABLE)
    return {(s.router, s.density): s for s in frontier.gather(CLAIMS, table)}


def test_losses_are_the_router_claims_per_seed(settings):
    # docs/results.md, claim 1: 0.0245 ± 0.0015 and 0.0250 ± 0.0019 at density 0.125
    kv16, kv64 = settings[("kv16 top-p", 0.125)], settings[("kv64 top-k", 0.125)]
    assert len(kv16.losses) == len(kv64.losses) == 3
    assert (round(kv16.loss, 4), round(kv16.loss_sd, 4)) == (0.0245, 0.0015)
    assert (round(kv64.loss, 4), round(kv64.loss_sd, 4)) == (0.0250, 0.0019)


def test_only_the_720p_rows_of_each_router_give_speeds(settings):
    assert settings[("kv16 top-p", 0.125)].fwd_speedup == 3.19
    assert settings[("kv64 top-k", 0.125)].fwd_speedup is None  # no forward row
    assert settings[("kv64 top-k", 0.25)].fwd_bwd_speedup is None  # its row is 480p


def test_the_frontier_and_the_recipe_choice(settings):
    everything = list(settings.values())

    def mark(router, density):
        return frontier.on_frontier(settings[(router, density)], everything)

    # kv16 0.875 (0.0245, 2.60x): lowest timed loss; kv64 0.875 (0.0250, 4.80x): nothing both
    # lower and faster; kv16 0.9375 (0.0263, 4.90x): fastest. kv64 0.9375 (0.0276, 4.00x) is
    # beaten on both by kv16 0.9375.
    assert mark("kv16 top-p", 0.125) and mark("kv64 top-k", 0.125) and mark("kv16 top-p", 0.0625)
    assert mark("kv64 top-k", 0.0625) is False
    assert mark("kv16 top-p", 0.25) is None  # not timed
    # the bound is VSA's loss at 0.875 plus its sd: 0.0250 + 0.0019 = 0.0269 >= 0.0263
    choice = frontier.recipe_choice(everything)
    assert (choice.router, choice.density) == ("kv16 top-p", 0.0625)


def test_without_vsas_own_setting_no_setting_is_chosen(settings):
    rest = [
        s for (router, density), s in settings.items() if (router, density) != frontier.REFERENCE
    ]
    assert frontier.recipe_choice(rest) is None
    assert "no setting qualifies" in frontier.report(rest)


def test_losses_come_from_the_claim1_lines_of_runs_jsonl(tmp_path):
    def line(run, validation):
        return json.dumps({"run": run, "sparsity": 0.75, "validation": validation}) + "\n"

    (tmp_path / "runs.jsonl").write_text(
        line("base_dense", {"dense": 0.5})  # not a claim-1 run: ignored
        + line("claim1/kv16_top-p_d0.25_s0", {"vsa2@0.75": 0.020, "density@0.75": 0.25})
        + line("claim1/kv16_top-p_d0.25_s1", {"vsa2@0.75": 0.024, "density@0.75": 0.25})
        + line("claim1/kv64_top-k_d0.25_s0", {"vsa2@0.75": 0.030, "density@0.75": 0.25})
        + line("claim2/dense_s0", {"vsa2@0.75": 0.9})
    )
    table = tmp_path / "attention.md"
    table.write_text(OP_TABLE)
    settings = {(s.router, s.density): s for s in frontier.gather(tmp_path, table)}
    assert sorted(settings) == [("kv16 top-p", 0.25), ("kv64 top-k", 0.25)]
    kv16 = settings[("kv16 top-p", 0.25)]
    assert kv16.losses == [0.020, 0.024]
    assert (kv16.loss, kv16.loss_sd) == pytest.approx((0.022, 0.004 / 2**0.5))
    assert settings[("kv64 top-k", 0.25)].losses == [0.030]


def test_claims_without_runs_jsonl_are_refused_by_name(tmp_path):
    table = tmp_path / "attention.md"
    table.write_text(OP_TABLE)
    with pytest.raises(SystemExit, match=r"--claims .*: no runs.jsonl there"):
        frontier.main(["--claims", str(tmp_path), "--attention", str(table)])


def test_a_missing_op_table_is_refused_by_name(tmp_path):
    with pytest.raises(SystemExit, match="--attention"):
        frontier.main(["--attention", str(tmp_path / "absent.md")])


# rows as bench_rl_scale.py --compile writes them (header shortened, made-up iterations); the
# 0.75 rows are absent
RL_TABLE = """| grid | tokens | sparsity | fwd | LoRA | full | iter | x dense | full it | x dense |
|---|---|---|---|---|---|---|---|---|---|
| 720p:81 | 75600 | dense compiled | 2.283 | 10.120 | - | 5514 | 1.00 | - | - |
| 720p:81 | 75600 | 0.875 compiled | 1.000 | 4.000 | - | 2506 | 2.20 | - | - |
| 720p:81 | 75600 | 0.9375 compiled | 0.800 | 3.300 | - | 1838 | 3.00 | - | - |
| 720p:81 | 75600 | 0.875 kv64 top-k compiled | 0.700 | 3.100 | - | 1723 | 3.20 | - | - |
| 720p:81 | 75600 | 0.9375 kv64 top-k compiled | 0.650 | 2.900 | - | 1622 | 3.40 | - | - |
"""


def test_with_an_rl_table_the_rl_iteration_draws_the_frontier_and_picks_the_recipe(tmp_path):
    op, rl = tmp_path / "attention.md", tmp_path / "rl.md"
    op.write_text(OP_TABLE)
    rl.write_text(RL_TABLE)
    everything = frontier.gather(CLAIMS, op, rl)
    settings = {(s.router, s.density): s for s in everything}
    assert settings[("kv64 top-k", 0.125)].rl_speedup == 3.20
    assert settings[("kv16 top-p", 0.25)].rl_speedup is None

    def mark(router, density):
        return frontier.on_frontier(settings[(router, density)], everything)

    # by the iteration, kv64 0.875 (0.0250, 3.20x) beats kv16 0.9375 (0.0263, 3.00x) on both,
    # though the op table has kv16 0.9375 faster; kv64 0.9375 (0.0276, 3.40x) is the fastest
    assert mark("kv16 top-p", 0.0625) is False
    assert mark("kv16 top-p", 0.125) and mark("kv64 top-k", 0.125) and mark("kv64 top-k", 0.0625)
    choice = frontier.recipe_choice(everything)  # within 0.0269: kv16 2.20x and kv64 3.20x
    assert (choice.router, choice.density) == ("kv64 top-k", 0.125)
    assert "kv64 top-k at sparsity 0.875 (3.20x RL iteration" in frontier.report(everything)


def test_a_missing_rl_table_is_refused_by_name(tmp_path):
    op = tmp_path / "attention.md"
    op.write_text(OP_TABLE)
    with pytest.raises(SystemExit, match="--rl"):
        frontier.main(["--attention", str(op), "--rl", str(tmp_path / "absent.md")])
