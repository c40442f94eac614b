"""Sparse rebasing: a dense Wan transformer switched to VSA2 keeps its output at density 1."""

import copy
import math

import pytest
import torch
from diffusers import WanTransformer3DModel
from test_models import TINY_WAN  # the tests folder is on sys.path under pytest

from vsa2_rl.attention import SparsityState
from vsa2_rl.config import SparsityConfig, VSA2Config
from vsa2_rl.models.rebase import RebaseSchedule, rebase_to_vsa2
from vsa2_rl.models.wan import vsa2_parameters
from vsa2_rl.rl.schedule import SparsitySchedule


def _forward(model, inputs):
    latents, timestep, text = inputs
    return model(latents, timestep, text, return_dict=False)[0]


@pytest.fixture
def dense_and_inputs():
    model = WanTransformer3DModel(**TINY_WAN).double()
    inputs = (
        torch.randn(2, 4, 4, 8, 16, dtype=torch.float64),  # grid 4x4x8: 128 tokens, 2 tiles
        torch.tensor([900.0, 100.0], dtype=torch.float64),
        torch.randn(2, 5, 16, dtype=torch.float64),
    )
    return model, inputs


def test_rebasing_preserves_outputs_and_resets_trained_vsa2(dense_and_inputs):
    dense, inputs = dense_and_inputs
    reference = _forward(dense, inputs)
    state = SparsityState(sparsity=0.6)
    config = VSA2Config(backend="torch", mode="topk")
    model = rebase_to_vsa2(copy.deepcopy(dense), config, state)
    assert state.sparsity == 0.0
    torch.testing.assert_close(_forward(model, inputs), reference, rtol=1e-10, atol=1e-10)
    # First annealing steps: VSA2 with the exact-dense fine stage (density >= dense_threshold).
    state.sparsity = 0.005
    torch.testing.assert_close(_forward(model, inputs), reference, rtol=1e-10, atol=1e-10)
    # ... and the sparse path selecting every segment (budget ceil((1 - 1e-6) * 8) = 8).
    rebase_to_vsa2(model, VSA2Config(backend="torch", mode="topk", dense_threshold=1.0), state)
    state.sparsity = 1e-6
    torch.testing.assert_close(_forward(model, inputs), reference, rtol=1e-10, atol=1e-10)

    # Pretend VSA2 was trained, then rebase again: back to the dense function.
    with torch.no_grad():
        for param in vsa2_parameters(model):
            param.normal_(0.0, 0.1)
    state.sparsity = 0.005
    assert not torch.allclose(_forward(model, inputs), reference)
    rebase_to_vsa2(model, config, state)
    state.sparsity = 0.005
    assert vsa2_parameters(model)[0].abs().sum() == 0
    torch.testing.assert_close(_forward(model, inputs), reference, rtol=1e-10, atol=1e-10)

    with pytest.raises(ValueError, match="enabled"):
        rebase_to_vsa2(model, VSA2Config(enabled=False), state)


def test_rebase_schedule_closed_forms():
    linear = RebaseSchedule(target=0.8, steps=10, ramp="linear")
    assert [linear(s) for s in (0, 5, 10, 50)] == pytest.approx([0.0, 0.4, 0.8, 0.8])
    cosine = RebaseSchedule(target=0.9, steps=4)
    expected = [0.9 * 0.5 * (1 - math.cos(math.pi * s / 4)) for s in range(4)] + [0.9]
    assert [cosine(s) for s in range(5)] == pytest.approx(expected)
    assert RebaseSchedule(target=0.5, steps=0)(0) == 0.5
    with pytest.raises(ValueError, match="ramp"):
        RebaseSchedule(target=0.5, steps=3, ramp="step")
    with pytest.raises(ValueError, match="target"):
        RebaseSchedule(target=1.0, steps=3)


@pytest.mark.parametrize("shape", ["linear", "cosine"])
def test_rebase_and_rl_warmups_follow_one_closed_form_ramp(shape):
    """Stand-alone rebasing (RebaseSchedule) and the RL warm-up (SparsitySchedule) anneal the
    density 1 -> 1 - target along the same curve: target * f(step / steps), f(x) = x or
    (1 - cos(pi x)) / 2."""
    target, steps = 0.85, 7
    rebase = RebaseSchedule(target=target, steps=steps, ramp=shape)
    rl = SparsitySchedule.from_config(
        SparsityConfig(train=target, eval=0.0, warmup_steps=steps, warmup_shape=shape), 100
    )
    for step in (0, 1, 2, 3, 5, 6, 7, 20):
        x = min(step / steps, 1.0)
        progress = x if shape == "linear" else (1 - math.cos(math.pi * x)) / 2
        expected = target * progress
        assert rebase(step) == pytest.approx(expected, rel=1e-12, abs=1e-15), step
        assert rl.train_at(step) == pytest.approx(expected, rel=1e-12, abs=1e-15), step
        assert rl.train_at(step) == pytest.approx(rebase(step), rel=1e-12, abs=1e-15), step


def test_annealing_lowers_achieved_density_through_the_state(dense_and_inputs):
    dense, inputs = dense_and_inputs
    state = SparsityState()
    model = rebase_to_vsa2(dense, VSA2Config(backend="torch", mode="topk"), state)
    schedule = RebaseSchedule(target=0.75, steps=3, ramp="linear")
    densities = []
    with torch.no_grad():
        for step in range(4):
            schedule.apply(state, step)
            _forward(model, inputs)
            densities.append(state.pop_density())
    # 8 segments per layer; topk keeps ceil((1 - s) * 8): s = 0 (dense fallback), 0.25, 0.5, 0.75.
    assert densities == pytest.approx([1.0, 6 / 8, 4 / 8, 2 / 8])
