"""Noise seeds: every (run seed, step, sample index) draws its own stream, reproducibly."""

import torch

from vsa2_rl.rl.rollout import sample_seed


def test_sample_seeds_never_collide_across_seeds_steps_and_indices():
    keys = [(s, t, i) for s in range(8) for t in range(200) for i in range(256)]
    seeds = {sample_seed(*key) for key in keys}
    assert len(seeds) == len(keys)


def test_the_next_step_does_not_reuse_a_sample_of_this_step():
    assert sample_seed(0, 1, 0) != sample_seed(0, 0, 10_007)
    assert sample_seed(1, 0, 0) != sample_seed(0, 0, 1_000_003)


def test_sample_seeds_are_deterministic_and_valid_generator_seeds():
    for key in [(0, 0, 0), (7, 199, 255), (2**40, 3, 9), (-1, 0, 0)]:
        value = sample_seed(*key)
        assert value == sample_seed(*key)
        assert 0 <= value < 2**63
        torch.Generator().manual_seed(value)
