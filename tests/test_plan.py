"""vsa2_rl.plan: closed forms on a toy shape, and the calibration against the measurements it
was fitted to (benchmarks/results/rl_scale/*.md, read here; plan.MEMORY_MEASUREMENTS)."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from vsa2_rl import plan

ROOT = Path(__file__).resolve().parent.parent
TOY = plan.ModelShape(params=1_000_000, trained_params=250_000, layers=4, hidden=64, ffn=256)
STEP = plan.StepShape(tokens=1024, videos=8, sampler_steps=10, trained_steps=2)


def _fit_plan():
    spec = importlib.util.spec_from_file_location("fit_plan", ROOT / "scripts" / "fit_plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FIT = _fit_plan()
ROWS = FIT.read_rows()


@pytest.mark.parametrize("engine", ["zero3", "fsdp2"])
def test_sharded_weights_are_total_over_gpus(engine):
    one = plan.memory_gib(TOY, dataclasses.replace(STEP, engine=engine, gpus=1))
    four = plan.memory_gib(TOY, dataclasses.replace(STEP, engine=engine, gpus=4))
    assert four["weights"] == pytest.approx(one["weights"] / 4, rel=1e-12)
    assert one["weights"] == pytest.approx(2 * TOY.params / plan.GIB, rel=1e-12)


def test_zero2_shards_states_not_weights():
    one = plan.memory_gib(TOY, dataclasses.replace(STEP, engine="zero2", gpus=1))
    two = plan.memory_gib(TOY, dataclasses.replace(STEP, engine="zero2", gpus=2))
    assert two["weights"] == one["weights"]
    assert two["optimizer"] == pytest.approx(one["optimizer"] / 2, rel=1e-12)
    assert one["optimizer"] == pytest.approx(12 * TOY.trained_params / plan.GIB, rel=1e-12)


def test_full_fine_tuning_kl_reference_is_a_copy_lora_none():
    full = plan.memory_gib(TOY, dataclasses.replace(STEP, kl=True, lora=False))
    lora = plan.memory_gib(TOY, dataclasses.replace(STEP, kl=True, lora=True))
    assert full["reference"] == pytest.approx(2 * TOY.trained_params / plan.GIB, rel=1e-12)
    assert lora["reference"] == 0.0


def test_nft_old_policy_is_a_model_copy_in_full_fine_tuning_else_trained_tensors():
    nft = dataclasses.replace(STEP, old_policy_forwards=1)

    def gib(**changes):
        return plan.memory_gib(TOY, dataclasses.replace(nft, **changes))

    assert plan.memory_gib(TOY, STEP)["old policy"] == 0.0  # Flow-GRPO has none
    assert gib(lora=False)["old policy"] * plan.GIB == pytest.approx(2 * TOY.params)
    # LoRA: fp32 copies of what trains, and their bf16 clone while the old policy runs
    assert gib()["old policy"] * plan.GIB == pytest.approx(6 * TOY.trained_params)
    # full fine-tuning under FSDP2 or ZeRO-3: the same on each GPU's shard
    fsdp2 = gib(lora=False, engine="fsdp2", gpus=4)
    assert fsdp2["old policy"] * plan.GIB == pytest.approx(6 * TOY.trained_params / 4)
    zero3 = gib(lora=False, engine="zero3", gpus=4)
    assert zero3["old policy"] == fsdp2["old policy"]
    held = fsdp2["weights"] + fsdp2["optimizer"] + fsdp2["old policy"]
    assert fsdp2["rollout"] == pytest.approx(held + fsdp2["rollout activations"])


def test_nft_update_counts_each_old_policy_forward_and_the_kl_reference():
    forward = plan.forward_seconds(TOY, STEP.tokens, STEP.sparsity, STEP.compiled)
    per_video_step = STEP.videos * STEP.trained_steps * forward
    seconds = {
        (kl, old): plan.seconds_per_step(
            TOY, dataclasses.replace(STEP, kl=kl, old_policy_forwards=old)
        )["update"]
        for kl in (False, True)
        for old in (0, 1, 2)
    }
    assert seconds[False, 0] == pytest.approx(plan.TIME_FITS[False].train_factor * per_video_step)
    for kl, old in seconds:
        assert seconds[kl, old] - seconds[False, 0] == pytest.approx((kl + old) * per_video_step)


def test_nfts_engine_peaks_hold_every_engine():
    nft = dataclasses.replace(STEP, old_policy_forwards=1)
    assert list(plan.engine_peaks(TOY, STEP)) == list(plan.ENGINES)
    assert list(plan.engine_peaks(TOY, nft)) == list(plan.ENGINES)


def test_checkpointing_holds_fewer_activations():
    kept = plan.memory_gib(TOY, STEP)["training activations"]
    every = plan.memory_gib(TOY, dataclasses.replace(STEP, checkpointing=False))
    assert every["training activations"] > kept


def test_guidance_doubles_rollout_activations_and_time():
    guided = dataclasses.replace(STEP, guidance=True)
    assert plan.memory_gib(TOY, guided)["rollout activations"] == pytest.approx(
        2 * plan.memory_gib(TOY, STEP)["rollout activations"], rel=1e-12
    )
    assert plan.seconds_per_step(TOY, guided)["total"] == pytest.approx(
        2 * plan.seconds_per_step(TOY, STEP)["total"], rel=1e-12
    )


def test_a_conditional_update_keeps_guidance_to_the_rollouts():
    guided = dataclasses.replace(STEP, guidance=True)
    conditional = dataclasses.replace(guided, guided_update=False)
    assert plan.memory_gib(TOY, conditional)["rollout activations"] == pytest.approx(
        plan.memory_gib(TOY, guided)["rollout activations"], rel=1e-12
    )
    assert plan.memory_gib(TOY, conditional)["training activations"] == pytest.approx(
        plan.memory_gib(TOY, STEP)["training activations"], rel=1e-12
    )
    seconds = plan.seconds_per_step(TOY, conditional)
    assert seconds["rollout"] == pytest.approx(plan.seconds_per_step(TOY, guided)["rollout"])
    assert seconds["update"] == pytest.approx(plan.seconds_per_step(TOY, STEP)["update"])


def test_sequence_parallelism_divides_activations_not_states():
    one = plan.memory_gib(TOY, dataclasses.replace(STEP, gpus=4))
    four = plan.memory_gib(TOY, dataclasses.replace(STEP, gpus=4, sequence_parallel=4))
    assert four["training activations"] == pytest.approx(one["training activations"] / 4)
    assert four["weights"] == one["weights"]
    with pytest.raises(ValueError, match="sequence_parallel must divide gpus"):
        dataclasses.replace(STEP, gpus=4, sequence_parallel=3)


def test_doubling_tokens_quadruples_attention_flops():
    assert plan.attention_flops(TOY, 2048) == 4 * plan.attention_flops(TOY, 1024)
    assert plan.attention_flops(TOY, 1024) == TOY.layers * 4 * 1024**2 * TOY.hidden


def test_gpus_divide_the_step_time():
    one = plan.seconds_per_step(TOY, STEP)["total"]
    four = plan.seconds_per_step(TOY, dataclasses.replace(STEP, gpus=4))["total"]
    assert four == pytest.approx(one / 4, rel=1e-12)


def test_unmeasured_sparsity_is_interpolated():
    assert (
        plan.seconds_per_step(TOY, dataclasses.replace(STEP, sparsity=0.9))["interpolated"] == 0.0
    )
    middle = plan.seconds_per_step(TOY, dataclasses.replace(STEP, sparsity=0.8))
    assert middle["interpolated"] == 1.0
    assert "interpolated" in plan.describe(plan.memory_gib(TOY, STEP), middle, STEP)[1]


def test_unknown_engine_is_refused():
    with pytest.raises(ValueError, match="engine must be one of"):
        dataclasses.replace(STEP, engine="zero1")


@pytest.mark.parametrize("compiled", [False, True])
def test_constants_are_the_fit(compiled):
    seconds, train_factor = FIT.fit_time(FIT.read_rows(compiled=compiled), compiled)
    fit = plan.TIME_FITS[compiled]
    for name, value in seconds.items():
        assert fit.seconds_per[name] == pytest.approx(value, rel=1e-3), name
    assert abs(fit.train_factor / train_factor - 1) < 1e-2
    assert abs(plan.ACTIVATION_FACTOR / FIT.fit_memory() - 1) < 1e-2


@pytest.mark.parametrize(
    "compiled, row",
    [(c, r) for c in (False, True) for r in FIT.calibrated(FIT.read_rows(compiled=c), c)],
    ids=lambda v: v if isinstance(v, bool) else f"{v['tokens']}-{v['sparsity']}",
)
def test_forward_and_train_reproduce_the_tables(compiled, row):
    forward = plan.forward_seconds(FIT.WAN_1_3B, row["tokens"], row["sparsity"], compiled)
    assert forward == pytest.approx(row["forward"], rel=0.06)
    train_factor = plan.TIME_FITS[compiled].train_factor
    assert train_factor * forward == pytest.approx(row["train"], rel=0.2)


def test_compiled_rows_are_read_at_the_recipes_router_only():
    rows = FIT.read_rows(compiled=True)
    assert {(r["tokens"], r["sparsity"]) for r in rows} == {
        (32760, 0.0), (32760, 0.875), (75600, 0.0), (75600, 0.875)
    }  # fmt: skip
    assert all(r["tokens"] != 32760 or r["forward"] != 0.701 for r in rows)  # not eager rows


def test_compiled_blocks_shorten_the_plan():
    compiled = dataclasses.replace(STEP, compiled=True)
    assert plan.seconds_per_step(TOY, compiled)["total"] < plan.seconds_per_step(TOY, STEP)["total"]
    assert (
        "compiled, VSA2 kv64 top-k"
        in plan.describe(
            plan.memory_gib(TOY, compiled), plan.seconds_per_step(TOY, compiled), compiled
        )[1]
    )


def test_held_out_row_is_predicted():
    """Fitted without 720p x 121 (the largest video), the forward there is within 10%."""
    largest = max(r["tokens"] for r in ROWS)
    seconds, _ = FIT.fit_time([r for r in ROWS if r["tokens"] != largest])
    for row in FIT.calibrated([r for r in ROWS if r["tokens"] == largest]):
        terms = plan.forward_terms(FIT.WAN_1_3B, row["tokens"], row["sparsity"])
        predicted = sum(seconds[name] * value for name, value in terms.items())
        assert predicted == pytest.approx(row["forward"], rel=0.1)


@pytest.mark.parametrize("measured", plan.MEMORY_MEASUREMENTS, ids=lambda m: m[0])
def test_memory_reproduces_the_peaks(measured):
    _, model, step, gib = measured
    assert plan.memory_gib(model, step)["peak"] == pytest.approx(gib, rel=0.3)


def test_held_out_peak_is_predicted():
    """Fitted without A14B at 720p, its peak (118.7 GiB) is within 10%."""
    held = [m for m in plan.MEMORY_MEASUREMENTS if "720p" in m[0]]
    factor = FIT.fit_memory([m for m in plan.MEMORY_MEASUREMENTS if "720p" not in m[0]])
    ((_, model, step, gib),) = held
    raw = plan.activation_bytes(model, step)["training"] / plan.GIB
    assert plan.states_update_gib(model, step) + factor * raw == pytest.approx(gib, rel=0.1)


def test_describe_says_whether_one_h100_holds_it():
    big = dataclasses.replace(TOY, params=50 * 2**30)  # 100 GiB of bf16 weights
    lines = {
        model: plan.describe(plan.memory_gib(model, STEP), plan.seconds_per_step(model, STEP), STEP)
        for model in (TOY, big)
    }
    assert lines[TOY][0].endswith(": yes") and lines[big][0].endswith(": no")
