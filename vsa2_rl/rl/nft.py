"""DiffusionNFT: online RL on the forward process (``grpo.algorithm=nft``).

Follows Zheng et al., 2025, "DiffusionNFT: Online Diffusion Reinforcement with Forward Process"
(arXiv 2509.16117), its Algorithm 1 and the authors' SD3.5 scripts (NVlabs/DiffusionNFT), in this
repository's convention ``x_sigma = (1 - sigma) x0 + sigma eps``, velocity ``v = eps - x0``:

- the old policy ``v_old`` samples the rollouts, with any solver (``sampler.kind=ode`` included:
  no log-probs are needed) and without guidance;
- a reward becomes an optimality probability ``r = 0.5 + 0.5 clip(A / Z, -1, 1)`` of the sample's
  group advantage A (:func:`optimality_probability`);
- the clean rollouts x0 are noised again on the forward process, and the policy regresses the
  flow-matching target ``eps - x0`` through two implicit policies, ``v+ = (1 - beta) v_old +
  beta v_theta`` weighted by r and ``v- = (1 + beta) v_old - beta v_theta`` weighted by 1 - r
  (:func:`implicit_policies`, :func:`nft_loss`): raising r pulls v_theta towards the sample,
  lowering it pushes v_theta away, both measured from v_old;
- the paper's adaptive weighting is a self-normalised x0 regression: ``|x0_hat - x0|^2`` divided
  by its detached mean ``|x0_hat - x0|`` per sample;
- after every RL step the old policy follows the trained one by a soft update
  ``theta_old <- eta theta_old + (1 - eta) theta`` with a growing eta (``NFTConfig.eta``).

The math is pure functions of tensors, unit-tested on CPU.
"""

from __future__ import annotations

from torch import Tensor

# the authors' floor of the adaptive weight (a sample whose x0 is already exact)
MIN_WEIGHT = 1e-5


def optimality_probability(advantages: Tensor, scale: float) -> Tensor:
    """``r = 0.5 + 0.5 * clip(A / scale, -1, 1)`` per sample, float32 in [0, 1].

    A sample with advantage 0 (a group whose rewards are all equal) gets r = 0.5: it pulls
    v_theta towards v_old rather than towards or away from itself.
    """
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale!r}")
    return 0.5 + 0.5 * (advantages.detach().float() / scale).clamp(-1.0, 1.0)


def implicit_policies(v_theta: Tensor, v_old: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    """The implicit positive and negative velocities ``(v+, v-)`` (v_old is a constant)."""
    v_old = v_old.detach()
    return (1.0 - beta) * v_old + beta * v_theta, (1.0 + beta) * v_old - beta * v_theta


def _regression(velocity: Tensor, target: Tensor, sigma: Tensor, adaptive: bool) -> Tensor:
    """Per-sample regression loss of ``velocity`` onto the flow-matching ``target``.

    The x0 estimate ``x_sigma - sigma v`` misses x0 by ``sigma (target - v)``, so the adaptive
    x0 regression needs sigma, not x_sigma.
    """
    dims = tuple(range(1, velocity.ndim))
    if not adaptive:
        return (velocity - target).square().mean(dims)
    x0_error = sigma.reshape(-1, *[1] * len(dims)) * (velocity - target)
    weight = x0_error.detach().abs().mean(dims).clamp_min(MIN_WEIGHT)
    return x0_error.square().mean(dims) / weight


def nft_loss(
    v_theta: Tensor,
    v_old: Tensor,
    target: Tensor,
    sigma: Tensor,
    r: Tensor,
    *,
    beta: float,
    adaptive_weighting: bool = True,
) -> Tensor:
    """DiffusionNFT's loss per sample, float32 [B]:
    ``(r * L(v+) + (1 - r) * L(v-)) / beta`` with L the regression onto ``target = eps - x0``.

    Args:
        v_theta: [B, ...] velocity of the trained policy at x_sigma (differentiable).
        v_old: [B, ...] velocity of the old policy at the same x_sigma (a constant).
        target: [B, ...] ``eps - x0`` of the forward noising.
        sigma: [B] noise levels of x_sigma.
        r: [B] optimality probabilities (:func:`optimality_probability`).
        beta: > 0; dividing by it keeps the gradient's scale independent of it (as the
            authors' scripts do; they also multiply by Z, a constant that Adam ignores up to
            where ``train.max_grad_norm`` clips).
        adaptive_weighting: the self-normalised x0 regression; False = velocity MSE.

    With r = 1 the gradient w.r.t. v_theta is plain flow matching's at v+ (the 1 / beta
    cancels the chain rule's beta); with r = 0 it is minus flow matching's at v-.
    """
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta!r}")
    if not v_theta.shape == v_old.shape == target.shape:
        raise ValueError(
            f"v_theta {tuple(v_theta.shape)}, v_old {tuple(v_old.shape)} and target "
            f"{tuple(target.shape)} must have one shape"
        )
    positive, negative = implicit_policies(v_theta.float(), v_old.float(), beta)
    target, sigma, r = target.float(), sigma.float(), r.detach().float()
    loss_positive = _regression(positive, target, sigma, adaptive_weighting)
    loss_negative = _regression(negative, target, sigma, adaptive_weighting)
    return (r * loss_positive + (1.0 - r) * loss_negative) / beta
