"""Flow-matching samplers with per-step Gaussian log-probabilities (Flow-GRPO style).

Convention (rectified flow, as in SD3 and Wan): ``x_sigma = (1 - sigma) * x0 + sigma * eps`` with
``sigma`` running from 1 (pure noise) to 0 (data), and the network predicts the velocity
``v = eps - x0``, so the probability-flow ODE is ``dx / dsigma = v``. From a velocity the two
endpoint estimates are ``x0_hat = x - sigma * v`` and ``eps_hat = x + (1 - sigma) * v``.

Three step kinds, all evaluated in float32 whatever the model dtype (bf16 overflows in the drift):

``"ode"``  deterministic Euler step ``x_next = x + (sigma_next - sigma) * v``; log-prob 0.

``"sde"``  the Flow-GRPO sampler (Liu et al., 2025, "Flow-GRPO: Training Flow Matching Models via
           Online RL"). The reverse-time SDE with the same marginals as the ODE has drift
           ``v - (g^2 / 2) * score`` with ``score = -eps_hat / sigma``; its Euler-Maruyama step is
           ``mean = x + (v + g^2 / (2 sigma) * eps_hat) * dt``, ``std = g * sqrt(-dt)`` with
           ``dt = sigma_next - sigma < 0`` and diffusion ``g = a * sqrt(sigma / (1 - sigma))``
           (``a`` = ``noise_level``). At ``sigma = 1`` the ratio is infinite; like flow_grpo (which
           substitutes the schedule's second sigma there) we use ``1 - sigma_next`` in the
           denominator of that step, which for the usual schedule is the same number.

``"cps"``  coefficients-preserving sampling (Wang & Yu, 2025, "Coefficients-Preserving Sampling
           for Reinforcement Learning with Flow Matching", as shipped in flow_grpo):
           ``x_next = x0_hat * (1 - sigma_next) + eps_hat * sqrt(sigma_next^2 - std^2) + std * z``
           with ``std = sigma_next * sin(a * pi / 2)``, so the total noise coefficient of the next
           sample is exactly ``sigma_next``. Its fresh-noise fraction per step does not shrink
           with the step size (unlike ``sde``'s ``sqrt(-dt)``), so prefer small ``a`` with it.

Log-probability convention: the per-element Gaussian log density
``-(x_next - mean)^2 / (2 std^2) - log(std) - log(2 pi) / 2`` **averaged** over all non-batch
dimensions (flow_grpo averages too). Summing would scale every log-ratio by the number of latent
elements (~2M for a Wan 480p clip), making ``exp(logp - old_logp)`` overflow or collapse to 0 at
any realistic learning rate, so PPO clip ranges would be meaningless. With the mean, the ratio is
the geometric mean of per-element ratios, and ``vsa2_rl.rl.grpo.gaussian_kl`` uses the same
per-element mean so that KL and log-ratios live on the same scale. Unlike flow_grpo's ``cps``
branch (which drops the ``1 / (2 std^2)`` factor and the constants), ``cps`` here is the full
density, so both kinds have the same meaning.

Where ``std`` is 0 (``noise_level = 0``, or ``cps``'s step to ``sigma_next = 0``) the transition
is deterministic; its log-prob is defined as 0, like an ODE step, and :func:`sample` marks it as
not stochastic so the trainer skips it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

KINDS = ("sde", "cps", "ode")

VelocityFn = Callable[[Tensor, Tensor], Tensor]


class StepOutput(NamedTuple):
    """One sampler step (all float32)."""

    prev_sample: Tensor  # x at sigma_next, [B, ...]
    log_prob: Tensor  # [B], per-element mean Gaussian log density (0 for deterministic steps)
    mean: Tensor  # [B, ...], mean of the transition
    std: Tensor  # [B, 1, ...] broadcastable to x, transition standard deviation


class Trajectory(NamedTuple):
    """A sampled trajectory.

    ``latents`` is float32 (not the model dtype): the trainer recomputes the log-prob of each
    stored transition, and rounding ``x_next`` to bf16 would change it by far more than the
    first-minibatch ratio tolerance.
    """

    latents: Tensor  # [N + 1, B, ...] float32, latents[0] = noise, latents[-1] = sample
    log_probs: Tensor  # [N, B] float32, 0 where the step is not stochastic
    stochastic: Tensor  # bool [N]: True where the step drew noise and has a log-prob
    sigmas: Tensor  # [N + 1] float32, the schedule used


def seeded_noise(shape: tuple[int, ...], seeds: list[int]) -> Tensor:
    """Initial latents ``[len(seeds), *shape]``, sample i drawn on the CPU from its own seed.

    One generator per sample makes a sample's noise independent of the batch it is drawn in and
    of the number of ranks that share the batch (and of the device it then moves to).
    """
    return torch.stack(
        [torch.randn(shape, generator=torch.Generator().manual_seed(seed)) for seed in seeds]
    )


def sigma_schedule(num_steps: int, shift: float = 1.0, terminal: float | None = None) -> Tensor:
    """Shifted flow-matching sigmas, ``[num_steps + 1]`` float32 from 1 down to 0.

    Uniform sigmas ``s`` are warped as ``shift * s / (1 + (shift - 1) * s)`` (SD3 / Wan "shift";
    shift > 1 spends more steps at high noise). Endpoints stay exactly 1 and 0. With
    ``terminal`` the sigmas before the final 0 are then stretched affinely in ``1 - sigma`` so
    that the last of them is ``terminal`` (LTX-2's schedule ends its steps at 0.1, then jumps
    to 0).
    """
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")
    if not shift > 0:
        raise ValueError(f"shift must be > 0, got {shift!r} (1.0 = no shift)")
    if terminal is not None and not 0 < terminal < 1:
        raise ValueError(f"terminal must be in (0, 1), got {terminal!r}")
    s = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    s = shift * s / (1.0 + (shift - 1.0) * s)
    if terminal is not None and num_steps > 1:
        steps = 1.0 - s[:-1]  # 0 at sigma 1
        s[:-1] = 1.0 - steps * (1.0 - terminal) / steps[-1]
    return s.to(torch.float32)


def _batch_column(value: float | Tensor, x: Tensor) -> Tensor:
    """A per-sample scalar (python float, 0-d or [B] tensor) as float32 [B, 1, ..., 1]."""
    t = torch.as_tensor(value, dtype=torch.float32, device=x.device)
    if t.ndim == 0:
        t = t.expand(x.shape[0])
    if t.shape != (x.shape[0],):
        raise ValueError(
            f"sigma must be a scalar or have shape [B]=({x.shape[0]},), got {tuple(t.shape)}"
        )
    return t.reshape(-1, *([1] * (x.ndim - 1)))


def _check_kind(kind: str, noise_level: float) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if not noise_level >= 0:
        raise ValueError(f"noise_level must be >= 0, got {noise_level!r}")
    if kind == "cps" and noise_level > 1:
        raise ValueError(
            f"noise_level must be in [0, 1] for kind='cps' (std = sigma_next * sin(a * pi / 2)), "
            f"got {noise_level!r}"
        )


def _transition(
    v: Tensor, x: Tensor, s: Tensor, s_next: Tensor, kind: str, noise_level: float
) -> tuple[Tensor, Tensor]:
    """Mean and std of the step x(sigma) -> x(sigma_next); s, s_next are [B, 1, ...] float32."""
    dt = s_next - s
    if kind == "ode":
        return x + dt * v, torch.zeros_like(s)
    if kind == "sde":
        # sigma / (1 - sigma) is infinite at sigma = 1; use the next sigma there (see docstring).
        s_safe = torch.where(s >= 1.0, s_next, s)
        g = noise_level * torch.sqrt(s / (1.0 - s_safe))
        eps_hat = x + (1.0 - s) * v
        mean = x + (v + g.square() / (2.0 * s) * eps_hat) * dt
        return mean, g * torch.sqrt(-dt)
    # cps
    std = s_next * math.sin(noise_level * math.pi / 2.0)
    x0_hat = x - s * v
    eps_hat = x + (1.0 - s) * v
    # clamp: sigma_next^2 - std^2 >= 0 analytically, rounding can make it -1e-9.
    eps_coef = torch.sqrt((s_next.square() - std.square()).clamp_min(0.0))
    return x0_hat * (1.0 - s_next) + eps_hat * eps_coef, std


def _gaussian_log_prob(x_next: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """Per-element Gaussian log density averaged over non-batch dims; 0 where std == 0."""
    noisy = std > 0
    # A std of 1 in the unused branch keeps the backward free of 0 * inf = NaN.
    safe_std = torch.where(noisy, std, torch.ones_like(std))
    lp = (
        -(x_next - mean).square() / (2.0 * safe_std.square())
        - torch.log(safe_std)
        - 0.5 * math.log(2.0 * math.pi)
    )
    lp = torch.where(noisy, lp, torch.zeros_like(lp))
    return lp.mean(dim=tuple(range(1, lp.ndim)))


def _gaussian_noise(
    x: Tensor, generator: torch.Generator | Sequence[torch.Generator] | None
) -> Tensor:
    """Standard normal float32 noise shaped like ``x`` from one generator or one per sample."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.randn(x.shape, generator=generator, device=x.device, dtype=torch.float32)
    if len(generator) != x.shape[0]:
        raise ValueError(
            f"generator: got {len(generator)} per-sample generators for a batch of {x.shape[0]}"
        )
    return torch.stack(
        [
            torch.randn(x.shape[1:], generator=g, device=g.device, dtype=torch.float32)
            for g in generator
        ]
    ).to(x.device)


def sde_step(
    velocity: Tensor,
    x: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    *,
    kind: str,
    noise_level: float,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    prev_sample: Tensor | None = None,
) -> StepOutput:
    """One step from ``sigma`` to ``sigma_next`` (< sigma) given the model velocity at ``x``.

    ``generator`` may be one generator for the batch or one per sample (then every sample's
    noise depends only on its own generator, not on how samples are batched or split over ranks).
    With ``prev_sample=None`` the next sample is drawn (float32 noise from ``generator``, on
    x's device); otherwise the log-prob of the given ``prev_sample`` is evaluated (gradients flow
    to ``velocity`` through ``mean``, the given sample is detached). ``sigma`` / ``sigma_next``
    are python floats or tensors of shape [] or [B].
    """
    _check_kind(kind, noise_level)
    if velocity.shape != x.shape:
        raise ValueError(
            f"velocity shape {tuple(velocity.shape)} must equal x shape {tuple(x.shape)}"
        )
    v = velocity.float()
    x = x.float()
    s = _batch_column(sigma, x)
    s_next = _batch_column(sigma_next, x)
    mean, std = _transition(v, x, s, s_next, kind, noise_level)
    if prev_sample is None:
        if kind == "ode":
            prev_sample = mean
        else:
            noise = _gaussian_noise(x, generator)
            prev_sample = mean + std * noise
    else:
        if prev_sample.shape != x.shape:
            raise ValueError(
                f"prev_sample shape {tuple(prev_sample.shape)} must equal x shape {tuple(x.shape)}"
            )
        prev_sample = prev_sample.detach().float()
    if kind == "ode":
        log_prob = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
    else:
        log_prob = _gaussian_log_prob(prev_sample.detach(), mean, std)
    return StepOutput(prev_sample, log_prob, mean, std)


def step_log_prob(
    velocity: Tensor,
    x: Tensor,
    x_next: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    kind: str,
    noise_level: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Log-prob of a stored transition ``x -> x_next`` under a (new) ``velocity``.

    Returns ``(log_prob [B], mean, std)``; differentiable w.r.t. ``velocity``. This is what the
    trainer calls to form PPO ratios against the log-probs recorded by :func:`sample`.
    """
    out = sde_step(
        velocity, x, sigma, sigma_next, kind=kind, noise_level=noise_level, prev_sample=x_next
    )
    return out.log_prob, out.mean, out.std


def _is_stochastic(kind: str, noise_level: float, sigma_next: float) -> bool:
    if kind == "ode" or noise_level == 0:
        return False
    # cps's noise is sigma_next * sin(...): the final step to sigma 0 is deterministic.
    return not (kind == "cps" and sigma_next == 0)


def sample(
    velocity_fn: VelocityFn,
    noise: Tensor,
    sigmas: Tensor,
    *,
    kind: str = "sde",
    noise_level: float = 0.7,
    sde_window: tuple[int, int] | None = None,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    progress: bool = False,
) -> Trajectory:
    """Integrate from ``noise`` (sigma = sigmas[0]) to sigmas[-1], recording every latent.

    ``velocity_fn(x, sigma)`` gets float32 latents [B, ...] and float32 sigmas [B] and returns
    the velocity in any float dtype (cast to the model dtype inside it). ``sde_window=(start,
    end)`` makes only steps ``start <= i < end`` stochastic (Flow-GRPO-Fast); the others are ODE
    steps with log-prob 0 and ``stochastic[i] = False``. Runs under ``torch.no_grad()``: rollouts
    are never differentiated; the trainer recomputes log-probs with :func:`step_log_prob`.
    Deterministic given ``generator`` (and a deterministic ``velocity_fn``).
    """
    _check_kind(kind, noise_level)
    if sigmas.ndim != 1 or sigmas.numel() < 2:
        raise ValueError(
            f"sigmas must be 1-D with >= 2 entries (see sigma_schedule), got shape "
            f"{tuple(sigmas.shape)}"
        )
    sig = [float(s) for s in sigmas.tolist()]
    num_steps = len(sig) - 1
    if any(a <= b for a, b in itertools.pairwise(sig)):
        raise ValueError(f"sigmas must be strictly decreasing, got {sig}")
    if sig[0] > 1.0 or sig[-1] < 0.0:
        raise ValueError(f"sigmas must lie in [0, 1], got first {sig[0]} and last {sig[-1]}")
    if sde_window is None:
        window = (0, num_steps)
    else:
        window = tuple(sde_window)
        if len(window) != 2 or not 0 <= window[0] < window[1] <= num_steps:
            raise ValueError(
                f"sde_window must be (start, end) with 0 <= start < end <= num_steps="
                f"{num_steps}, got {sde_window!r}"
            )

    batch = noise.shape[0]
    latents = torch.empty((num_steps + 1, *noise.shape), dtype=torch.float32, device=noise.device)
    log_probs = torch.zeros((num_steps, batch), dtype=torch.float32, device=noise.device)
    stochastic = torch.zeros(num_steps, dtype=torch.bool)
    latents[0] = noise
    steps = range(num_steps)
    if progress:
        from tqdm.auto import tqdm

        steps = tqdm(steps, desc=f"sampling ({kind})")
    with torch.no_grad():
        for i in steps:
            x = latents[i]
            sigma = torch.full((batch,), sig[i], dtype=torch.float32, device=noise.device)
            v = velocity_fn(x, sigma)
            noisy = window[0] <= i < window[1] and _is_stochastic(kind, noise_level, sig[i + 1])
            out = sde_step(
                v,
                x,
                sig[i],
                sig[i + 1],
                kind=kind if noisy else "ode",
                noise_level=noise_level,
                generator=generator,
            )
            latents[i + 1] = out.prev_sample
            log_probs[i] = out.log_prob
            stochastic[i] = noisy
    return Trajectory(latents, log_probs, stochastic, torch.tensor(sig, dtype=torch.float32))


def cfg_velocity(
    model_fn: Callable[[Tensor, Tensor, Tensor], Tensor],
    cond: Tensor | Any,
    uncond: Tensor | None,
    guidance_scale: float,
    low_noise: tuple[float, float] | None = None,
) -> VelocityFn:
    """Classifier-free guidance as a ``velocity_fn`` for :func:`sample`.

    ``model_fn(x, sigma, cond)`` is the conditional velocity (e.g. ``bundle.velocity``). With
    ``guidance_scale != 1`` the conditional and unconditional passes run as one batch of 2B and
    combine as ``v_u + w * (v_c - v_u)``. ``uncond`` may have batch 1 (one negative prompt for
    all samples); with ``guidance_scale == 1`` it is not used and may be None. ``cond`` is a
    text embedding [B, L, D] or a condition object with more than text (an image) that makes
    its own batch of 2B with ``cond.classifier_free_pair(uncond)``. ``low_noise`` =
    ``(boundary_timestep, scale)`` is Wan2.2 A14B's second scale: a sample whose timestep
    (sigma * 1000) is below the experts' boundary is guided with ``scale``, as diffusers'
    ``WanPipeline`` does with ``guidance_scale_2``.
    """
    if guidance_scale == 1.0 and (low_noise is None or low_noise[1] == 1.0):
        return lambda x, sigma: model_fn(x, sigma, cond)
    if uncond is None:
        raise ValueError(
            f"uncond is required when guidance_scale != 1 (got {guidance_scale!r}); "
            "pass the empty/negative prompt embedding"
        )
    text = cond if torch.is_tensor(cond) else cond.text
    if uncond.shape[1:] != text.shape[1:] or uncond.shape[0] not in (1, text.shape[0]):
        raise ValueError(
            f"uncond shape {tuple(uncond.shape)} must match cond shape {tuple(text.shape)} "
            "(batch 1 is broadcast)"
        )
    if torch.is_tensor(cond):
        both = torch.cat([cond, uncond.expand_as(cond)], dim=0)
    else:
        both = cond.classifier_free_pair(uncond)

    def velocity(x: Tensor, sigma: Tensor) -> Tensor:
        v_c, v_u = model_fn(torch.cat([x, x]), torch.cat([sigma, sigma]), both).float().chunk(2)
        # float32: in bf16 the difference v_c - v_u loses most of its mantissa.
        return v_u + _guidance_scales(sigma, guidance_scale, low_noise, v_c.dim()) * (v_c - v_u)

    return velocity


def _guidance_scales(
    sigma: Tensor, scale: float, low_noise: tuple[float, float] | None, dims: int
) -> Tensor | float:
    """``scale``, or per sample [B, 1, ...] the ``low_noise`` scale below its boundary."""
    if low_noise is None:
        return scale
    boundary_timestep, low_scale = low_noise
    high = (sigma.float() * 1000.0 >= boundary_timestep).view(-1, *[1] * (dims - 1))
    return torch.where(high, torch.tensor(scale), torch.tensor(low_scale)).to(sigma.device)
