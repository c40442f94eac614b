"""DiffusionNFT's math: the loss against closed forms and a float64 hand computation, and
reward -> r."""

import pytest
import torch

from vsa2_rl.rl.grpo import group_advantages
from vsa2_rl.rl.nft import implicit_policies, nft_loss, optimality_probability


def _case(batch=3, shape=(2, 5), dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    v_theta, v_old, target = (torch.randn(batch, *shape, generator=gen, dtype=dtype) for _ in "abc")
    sigma = torch.rand(batch, generator=gen, dtype=dtype) * 0.8 + 0.1
    return v_theta.requires_grad_(True), v_old, target, sigma


def _flow_matching_grad(velocity, target, sigma, adaptive):
    """Gradient of plain flow matching (velocity MSE, or the self-normalised x0 regression)
    w.r.t. the velocity, by autograd on a loss written out here."""
    velocity = velocity.detach().clone().requires_grad_(True)
    error = velocity - target
    if adaptive:
        x0_error = sigma[:, None, None] * error
        loss = x0_error.square().mean((1, 2)) / x0_error.detach().abs().mean((1, 2))
    else:
        loss = error.square().mean((1, 2))
    (grad,) = torch.autograd.grad(loss.sum(), velocity)
    return grad


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_with_r_one_the_gradient_is_flow_matching_at_the_positive_policy(adaptive, beta):
    v_theta, v_old, target, sigma = _case()
    loss = nft_loss(v_theta, v_old, target, sigma, torch.ones(3), beta=beta,
                    adaptive_weighting=adaptive)  # fmt: skip
    (grad,) = torch.autograd.grad(loss.sum(), v_theta)
    positive = (1 - beta) * v_old + beta * v_theta.detach()
    torch.testing.assert_close(grad, _flow_matching_grad(positive, target, sigma, adaptive))
    n = positive[0].numel()
    if adaptive:  # closed form: 2 sigma (v+ - target) / (n mean|v+ - target|)
        mean_abs = (positive - target).abs().mean((1, 2), keepdim=True)
        closed = 2 * sigma[:, None, None] * (positive - target) / (n * mean_abs)
    else:
        closed = 2 * (positive - target) / n
    torch.testing.assert_close(grad, closed)


@pytest.mark.parametrize("adaptive", [False, True])
def test_with_r_zero_the_gradient_is_minus_flow_matching_at_the_negative_policy(adaptive):
    v_theta, v_old, target, sigma = _case(seed=1)
    beta = 0.3
    loss = nft_loss(v_theta, v_old, target, sigma, torch.zeros(3), beta=beta,
                    adaptive_weighting=adaptive)  # fmt: skip
    (grad,) = torch.autograd.grad(loss.sum(), v_theta)
    negative = (1 + beta) * v_old - beta * v_theta.detach()
    torch.testing.assert_close(grad, -_flow_matching_grad(negative, target, sigma, adaptive))


def test_at_the_old_policy_a_neutral_sample_has_no_gradient():
    _, v_old, target, sigma = _case(seed=2)
    v_theta = v_old.clone().requires_grad_(True)
    loss = nft_loss(v_theta, v_old, target, sigma, torch.full((3,), 0.5), beta=1.0)
    (grad,) = torch.autograd.grad(loss.sum(), v_theta)
    assert grad.abs().max() < 1e-7


def _hand_loss_and_grad(v_theta, v_old, target, sigma, r, beta):
    """The adaptive-weighting NFT loss per sample and d(sum of losses)/d(v_theta), element by
    element in python floats (float64)."""
    losses, grads = [], []
    for vt, vo, tg, s, ri in zip(v_theta, v_old, target, sigma, r, strict=True):
        vt, vo, tg = vt.flatten().tolist(), vo.flatten().tolist(), tg.flatten().tolist()
        n = len(vt)
        e_pos = [s * ((1 - beta) * o + beta * t - g) for t, o, g in zip(vt, vo, tg, strict=True)]
        e_neg = [s * ((1 + beta) * o - beta * t - g) for t, o, g in zip(vt, vo, tg, strict=True)]
        m_pos, m_neg = sum(map(abs, e_pos)) / n, sum(map(abs, e_neg)) / n
        l_pos = sum(e * e for e in e_pos) / n / m_pos
        l_neg = sum(e * e for e in e_neg) / n / m_neg
        losses.append((ri * l_pos + (1 - ri) * l_neg) / beta)
        # d e_pos / d v_theta = s beta, d e_neg / d v_theta = -s beta (weights are constants)
        grads.append([
            (ri * 2 * ep * s * beta / (n * m_pos) - (1 - ri) * 2 * en * s * beta / (n * m_neg))
            / beta
            for ep, en in zip(e_pos, e_neg, strict=True)
        ])  # fmt: skip
    return losses, grads


def test_loss_and_gradient_equal_a_float64_hand_computation():
    v_theta, v_old, target, sigma = _case(batch=2, shape=(2, 3), dtype=torch.float64, seed=3)
    r, beta = torch.tensor([0.8, 0.25], dtype=torch.float64), 0.4
    loss = nft_loss(v_theta, v_old, target, sigma, r, beta=beta)
    (grad,) = torch.autograd.grad(loss.sum(), v_theta)
    hand_loss, hand_grad = _hand_loss_and_grad(
        v_theta.detach(), v_old, target, sigma.tolist(), r.tolist(), beta
    )
    # the loss works in float32 (the trainer's precision): agreement to float32 rounding
    torch.testing.assert_close(loss.double(), torch.tensor(hand_loss, dtype=torch.float64),
                               rtol=1e-5, atol=1e-7)  # fmt: skip
    expected = torch.tensor(hand_grad, dtype=torch.float64).reshape(grad.shape)
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-7)


def test_implicit_policies_average_to_the_old_one():
    v_theta, v_old, _, _ = _case()
    positive, negative = implicit_policies(v_theta, v_old, beta=0.7)
    torch.testing.assert_close((positive + negative) / 2, v_old)
    torch.testing.assert_close(positive - negative, 2 * 0.7 * (v_theta - v_old))


def test_reward_to_optimality_probability_by_hand():
    advantages = torch.tensor([-10.0, -5.0, -2.5, 0.0, 1.0, 5.0, 7.5])
    r = optimality_probability(advantages, scale=5.0)
    torch.testing.assert_close(r, torch.tensor([0.0, 0.0, 0.25, 0.5, 0.6, 1.0, 1.0]))
    # rewards of two groups through group advantages (batch std, the paper's global_std):
    # rewards 1, 3 | 2, 10: group means 2 and 6, population std of all four = sqrt(12.5)
    rewards, groups = torch.tensor([1.0, 3.0, 2.0, 10.0]), torch.tensor([0, 0, 1, 1])
    advantages, _ = group_advantages(rewards, groups, scale="batch")
    std = (((1 - 4) ** 2 + (3 - 4) ** 2 + (2 - 4) ** 2 + (10 - 4) ** 2) / 4) ** 0.5
    by_hand = [
        0.5 + 0.5 * max(-1.0, min(1.0, a / (std + 1e-4) / 2.0)) for a in (-1.0, 1.0, -4.0, 4.0)
    ]
    torch.testing.assert_close(optimality_probability(advantages, 2.0), torch.tensor(by_hand))
    with pytest.raises(ValueError, match="scale must be > 0"):
        optimality_probability(advantages, 0.0)
