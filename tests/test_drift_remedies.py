"""The drift remedies of DiffusionNFT (``nft.trust_region``, ``rl.kl_reference=ema``) against
references computed here: the trust region scales a step of a velocity linear in its weights to
exactly the radius; the EMA reference is the start of training at step 0 and the closed-form EMA
of the trained weights after k updates, in a run's checkpoints too; the defaults leave a run's
losses bit-identical; bad values are one ConfigError naming the key. Also
``benchmarks/drift_remedies.py``'s report on hand-made runs, packed or not."""

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from test_nft import FLOW_GRPO_TOY, _checkpoint, _config, _rows

from vsa2_rl.config import ConfigError, load_config
from vsa2_rl.rl.nft import EMAReference, limit_step
from vsa2_rl.rl.trainer import train
from vsa2_rl.runtime import build_bundle

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import drift_remedies
import sparse_rollouts


@dataclasses.dataclass
class _Bundle:
    transformer: torch.nn.Module


# ---- trust region ------------------------------------------------------------------------


def _linear_step(seed=0):
    """A velocity linear in its weights, v = W x, before and after one SGD step."""
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Linear(6, 4, bias=False)
    x, target = torch.randn(16, 6, generator=gen), torch.randn(16, 4, generator=gen)
    before = [p.detach().clone() for p in model.parameters()]
    v_before = model(x).detach()
    (model(x) - target).square().mean().backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    return model, x, before, v_before


def _deviation(model, x, v_before):
    with torch.no_grad():
        return float((model(x) - v_before).square().mean())


def test_a_step_beyond_the_radius_is_scaled_to_meet_it_exactly_for_a_linear_velocity():
    model, x, before, v_before = _linear_step()
    step = [p.detach() - b for p, b in zip(model.parameters(), before, strict=True)]
    deviation = _deviation(model, x, v_before)
    radius = deviation / 9
    scale = limit_step(list(model.parameters()), before, deviation, radius)
    assert scale == pytest.approx(1 / 3)
    assert _deviation(model, x, v_before) == pytest.approx(radius, rel=1e-5)
    for param, start, delta in zip(model.parameters(), before, step, strict=True):
        torch.testing.assert_close(param.detach(), start + delta / 3)


def test_a_step_within_the_radius_is_untouched_and_a_non_finite_one_undone():
    model, x, before, v_before = _linear_step()
    after = [p.detach().clone() for p in model.parameters()]
    deviation = _deviation(model, x, v_before)
    assert limit_step(list(model.parameters()), before, deviation, deviation) == 1.0
    assert all(torch.equal(p, a) for p, a in zip(model.parameters(), after, strict=True))
    assert limit_step(list(model.parameters()), before, math.nan, deviation) == 0.0
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    with pytest.raises(ValueError, match="radius must be > 0"):
        limit_step(list(model.parameters()), before, deviation, 0.0)


# ---- EMA reference -----------------------------------------------------------------------


@pytest.mark.parametrize("lora", [True, False], ids=["swapped_tensors", "frozen_copy"])
def test_the_ema_reference_starts_at_the_base_and_follows_the_closed_form_ema(lora):
    decay, updates = 0.8, 3
    model = torch.nn.Linear(3, 2)
    bundle = _Bundle(model)
    reference = EMAReference(bundle, model, decay=decay, lora=lora)
    x = torch.randn(5, 3)
    start = [p.detach().double().clone() for p in model.parameters()]
    with torch.no_grad():
        base_out = model(x)
        for param in model.parameters():
            param.add_(1.0)  # trained, not yet averaged: the reference is still the base
        with reference.active() as active:
            torch.testing.assert_close(active.transformer(x), base_out)
    # theta_k after update k: the EMA in float64, written out
    expected, trained = start, [p.detach().double().clone() for p in model.parameters()]
    for k in range(updates):
        reference.update()
        expected = [decay * e + (1 - decay) * t for e, t in zip(expected, trained, strict=True)]
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(-0.5).add_(0.25 * k)
        trained = [p.detach().double().clone() for p in model.parameters()]
    with torch.no_grad(), reference.active() as active:
        out = active.transformer(x)
    weight, bias = (e.float() for e in expected)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias))
    for param, value in zip(model.parameters(), trained, strict=True):  # trained weights back
        assert torch.equal(param.detach().double(), value)
    fresh = EMAReference(_Bundle(model), model, decay=decay, lora=lora)
    fresh.load_state_dict(reference.state_dict())
    with torch.no_grad(), fresh.active() as active:
        torch.testing.assert_close(active.transformer(x), out)


def _start(config):
    """theta_0: the weights the runs of ``config`` start from."""
    bundle = build_bundle(config, torch.device("cpu"), torch.float32)
    return {n: v.clone() for n, v in bundle.transformer.state_dict().items()}


def _ema_run(tmp_path, name, *extra):
    config = _config(
        tmp_path, "train.num_steps=2", "train.checkpoint_every=1", "sampler.kind=ode",
        "rl.kl_beta=0.1", "nft.eta_rate=0.3", *extra, name=name,
    )  # fmt: skip
    train(config)
    return config


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """A 2-step nft run at the defaults (no remedy), which the remedies' runs are held to."""
    return _ema_run(tmp_path_factory.mktemp("drift"), "default")


def test_an_ema_reference_run_keeps_the_closed_form_ema_of_its_weights(tmp_path, default_run):
    decay, base = 0.7, default_run
    ema = _ema_run(tmp_path, "ema", "rl.kl_reference=ema", f"rl.kl_reference_decay={decay}")
    base_rows, ema_rows = _rows(base.out_dir), _rows(ema.out_dir)
    # step 1: the EMA is the start of training, as the base reference: the same losses
    for key in ("loss/policy", "loss/kl", "train/grad_norm"):
        assert ema_rows[0][key] == base_rows[0][key], key
    # step 2: the reference moved towards theta_1, so the KL to it is smaller
    assert 0 < ema_rows[1]["loss/kl"] < base_rows[1]["loss/kl"]
    theta_0, theta_1 = _start(ema), _checkpoint(ema.out_dir, 1)["model"]
    state_1 = _checkpoint(ema.out_dir, 1)["kl_reference"]
    state_2 = _checkpoint(ema.out_dir, 2)["kl_reference"]
    theta_2 = _checkpoint(ema.out_dir, 2)["model"]
    assert state_2["num_calls"] == 2 and state_2["decay"] == decay
    for name, value in state_2["shadow"].items():
        first = decay * theta_0[name] + (1 - decay) * theta_1[name]
        torch.testing.assert_close(state_1["shadow"][name], first, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(value, decay * first + (1 - decay) * theta_2[name])


def test_a_trust_region_leaves_a_step_within_it_and_takes_the_share_that_meets_it(
    tmp_path, default_run
):
    keys = ("loss/policy", "loss/kl", "train/old_deviation", "train/grad_norm", "reward/mean")
    free = _ema_run(tmp_path, "free", "nft.trust_region=1e30")  # measures, never binds
    default, idle = _rows(default_run.out_dir), _rows(free.out_dir)
    for a, b in zip(default, idle, strict=True):  # bit-identical to a run without it
        assert all(a[key] == b[key] for key in keys), a["step"]
    assert "train/trust_region_scale" not in default[0]
    assert [row["train/trust_region_scale"] for row in idle] == [1.0, 1.0]
    deviation = idle[0]["train/step_deviation"]
    assert deviation > 0
    limited = _ema_run(tmp_path, "limited", f"nft.trust_region={deviation / 4!r}")
    row = _rows(limited.out_dir)[0]
    # the first step's gradient and Adam update are the free run's: half of it meets D / 4
    assert row["train/step_deviation"] == pytest.approx(deviation, rel=1e-6)
    assert row["train/trust_region_scale"] == pytest.approx(0.5, rel=1e-6)
    theta_0, theta_free = _start(free), _checkpoint(free.out_dir, 1)["model"]
    theta_limited = _checkpoint(limited.out_dir, 1)["model"]
    changed = 0
    for name, value in theta_limited.items():
        changed += not torch.equal(theta_free[name], theta_0[name])
        expected = theta_0[name] + 0.5 * (theta_free[name] - theta_0[name])
        torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-7)
    assert changed


# ---- config errors -----------------------------------------------------------------------

NFT = ["rl.algorithm=nft", "sampler.kind=ode", "rl.kl_beta=0.1"]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([*NFT, "nft.trust_region=-1"], "nft.trust_region: must be >= 0"),
        ([*NFT, "nft.trust_region=nan"], "nft.trust_region: must be a finite number"),
        (["nft.trust_region=0.1"], "nft.trust_region: is only read by rl.algorithm=nft"),
        ([*NFT, "rl.kl_reference=ref"], "rl.kl_reference: got 'ref', expected one of base, ema"),
        ([*NFT, "rl.kl_reference=ema", "rl.kl_reference_decay=1"], "rl.kl_reference_decay: must"),
        ([*NFT, "rl.kl_reference_decay=0.9"], "rl.kl_reference_decay: is only read with"),
        (["rl.kl_beta=0.1", "rl.kl_reference=ema"], "rl.kl_reference: 'ema' is implemented for"),
        (["rl.algorithm=nft", "sampler.kind=ode", "rl.kl_reference=ema"], "rl.kl_reference: 'ema' "
         "is the reference of the KL term, which rl.kl_beta=0 turns off"),
    ],
)  # fmt: skip
def test_bad_remedy_settings_are_one_config_error_naming_the_key(overrides, expected):
    with pytest.raises(ConfigError) as error:
        load_config(FLOW_GRPO_TOY, overrides)
    assert str(error.value).startswith(expected) and "\n" not in str(error.value)


def test_a_trust_region_with_an_evaluation_ema_is_refused_before_training(tmp_path):
    config = _config(tmp_path, "sampler.kind=ode", "nft.trust_region=0.1", "train.ema_decay=0.9")
    with pytest.raises(ConfigError, match=r"^nft\.trust_region: .*train\.ema_decay"):
        train(config)
    assert not (Path(config.out_dir) / "metrics.jsonl").exists()


# ---- the benchmark's report --------------------------------------------------------------


def _write_run(out, variant, kind, seed, motion, fidelity):
    """A finished run folder: its recipe (16 steps) and evaluations at steps 0, 8 and 16."""
    run = out / "runs" / drift_remedies.run_name(variant, kind, seed)
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(drift_remedies.CONFIGS[kind].read_text())
    prefix = "eval/reward" if kind == "reward" else "eval/guard"
    rows = [{"step": s, "eval/reward": 0.5, f"{prefix}/prompt_motion": m,
             "eval/guard/shape_fidelity": f}
            for s, m, f in zip((0, 8, 16), motion, fidelity, strict=True)]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_report_lists_every_seed_and_judges_each_criterion(tmp_path):
    for seed, gain in ((11, 0.10), (12, 0.06)):
        _write_run(tmp_path, "baseline", "reward", seed, (0.6, 0.65, 0.6 + gain), (0.9, 0.9, 0.9))
        # a control that drifts 0.08 in fidelity at step 8 and comes back: C1 fails
        _write_run(tmp_path, "baseline", "control", seed, (0.6, 0.6, 0.61), (0.9, 0.82, 0.89))
        _write_run(tmp_path, "low_lr", "reward", seed, (0.6, 0.6, 0.6 + gain), (0.9, 0.9, 0.88))
        _write_run(tmp_path, "low_lr", "control", seed, (0.6, 0.6, 0.605), (0.9, 0.9, 0.9))
    _write_run(tmp_path, "trust_region", "reward", 11, (0.6, 0.6, 0.7), (0.9, 0.9, 0.9))
    assert drift_remedies.main(["report", "--out", str(tmp_path)]) == 0
    table = {
        line.split(" | ")[0].strip("| "): line.split(" | ")
        for line in (tmp_path / "report.md").read_text().splitlines()
        if line.startswith("| ") and not line.startswith("| variant")
    }
    assert list(table) == ["baseline", "low_lr", "trust_region"]
    baseline, low_lr, trust_region = table.values()
    assert baseline[1] == "+0.080 ± 0.028 (11: +0.100, 12: +0.060)"
    assert baseline[5].startswith("FAIL (worst 0.080)") and baseline[-1].strip(" |") == "no"
    assert low_lr[5:9] == ["pass (worst 0.000)", "pass (worst 0.005)",
                           "pass (100% of the baseline's)", "pass (worst 0.020)"]  # fmt: skip
    assert low_lr[-1].strip(" |") == "passes so far (2 of 5 seeds)"  # ships at 5 seeds
    assert trust_region[-1].strip(" |") == "incomplete"


def test_a_remedy_ships_only_over_all_five_seeds(tmp_path):
    for seed in drift_remedies.SEEDS:
        for variant in ("baseline", "low_lr"):
            _write_run(tmp_path, variant, "reward", seed, (0.6, 0.65, 0.7), (0.9, 0.9, 0.9))
            _write_run(tmp_path, variant, "control", seed, (0.6, 0.6, 0.605), (0.9, 0.9, 0.9))
    assert drift_remedies.main(["report", "--out", str(tmp_path)]) == 0
    verdicts = [line.split(" | ")[-1].strip(" |")
                for line in (tmp_path / "report.md").read_text().splitlines()
                if line.startswith("| low_lr")]  # fmt: skip
    assert verdicts == ["**ships**"]


def test_a_failed_bound_is_final_and_kept_gain_compares_the_same_seeds(tmp_path):
    # the baseline at seeds 11 (gain 0.20) and 12 (gain 0.10); the remedy at seed 12 only
    for seed, gain in ((11, 0.20), (12, 0.10)):
        _write_run(tmp_path, "baseline", "reward", seed, (0.6, 0.6, 0.6 + gain), (0.9, 0.9, 0.9))
        _write_run(tmp_path, "baseline", "control", seed, (0.6, 0.6, 0.6), (0.9, 0.9, 0.9))
    _write_run(tmp_path, "low_lr", "reward", 12, (0.6, 0.6, 0.695), (0.9, 0.9, 0.9))
    # its control's held-out reward strays 0.03 at step 8: C2 fails with seed 11 still to run
    _write_run(tmp_path, "low_lr", "control", 12, (0.6, 0.63, 0.6), (0.9, 0.9, 0.9))
    assert drift_remedies.main(["report", "--out", str(tmp_path)]) == 0
    row = next(line.split(" | ") for line in (tmp_path / "report.md").read_text().splitlines()
               if line.startswith("| low_lr"))  # fmt: skip
    assert row[5] == "incomplete (worst 0.000)"
    assert row[6] == "FAIL (worst 0.030)"
    # 0.095 against seed 12's 0.10, not against the two seeds' mean of 0.15
    assert row[7] == "incomplete (95% of the baseline's)"
    assert row[-1].strip(" |") == "no"


def test_a_packed_study_gives_the_unpacked_studys_report_rows(tmp_path):
    rows = {}
    for folder in ("unpacked", "packed"):
        out = tmp_path / folder
        for seed, gain in ((11, 0.10), (12, 0.06)):
            _write_run(out, "baseline", "reward", seed, (0.6, 0.65, 0.6 + gain), (0.9, 0.9, 0.9))
            _write_run(out, "baseline", "control", seed, (0.6, 0.6, 0.61), (0.9, 0.82, 0.89))
        _write_run(out, "low_lr", "reward", 11, (0.6, 0.6, 0.7), (0.9, 0.9, 0.88))
        if folder == "packed":
            assert sparse_rollouts.main(["pack", "--out", str(out)]) == 0
            assert not any((out / "runs").iterdir())  # every run folder packed away
        assert drift_remedies.main(["report", "--out", str(out)]) == 0
        rows[folder] = [line for line in (out / "report.md").read_text().splitlines()
                        if line.startswith("| ")]  # fmt: skip
    assert len(rows["packed"]) == 3 and rows["packed"] == rows["unpacked"]  # header, 2 variants
