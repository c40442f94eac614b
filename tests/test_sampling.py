"""Flow-matching samplers: step math against float64 closed forms, windows, reproducibility."""

import math

import pytest
import torch

from vsa2_rl.sampling import (
    cfg_velocity,
    sample,
    sde_step,
    sigma_schedule,
    step_log_prob,
)


def _normal_log_prob_mean(x, mean, std):
    """float64 reference: per-element Normal log density averaged over non-batch dims."""
    x, mean = x.double(), mean.double()
    std = torch.as_tensor(std, dtype=torch.float64).expand_as(x)
    lp = torch.distributions.Normal(mean, std).log_prob(x)
    return lp.flatten(1).mean(1)


def _inputs(batch=3, shape=(4, 5, 6), seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, *shape, generator=gen)
    v = torch.randn(batch, *shape, generator=gen)
    return x, v


def _sde_reference(x, v, s, s_next, a):
    """Reverse-time SDE written from the score: drift v - g^2/2 * score, score = -eps_hat / s."""
    x, v = x.double(), v.double()
    dt = s_next - s
    g = a * math.sqrt(s / (1 - (s_next if s >= 1 else s)))
    score = -(x + (1 - s) * v) / s
    return x + (v - 0.5 * g * g * score) * dt, g * math.sqrt(-dt)


@pytest.mark.parametrize(("s", "s_next"), [(0.8, 0.7), (1.0, 0.9), (0.1, 0.0)])
def test_sde_step_log_prob_matches_float64_gaussian(s, s_next):
    x, v = _inputs()
    gen = torch.Generator().manual_seed(7)
    out = sde_step(v, x, s, s_next, kind="sde", noise_level=0.7, generator=gen)
    ref_mean, ref_std = _sde_reference(x, v, s, s_next, 0.7)
    torch.testing.assert_close(out.mean.double(), ref_mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.std.double().flatten(), torch.full((3,), ref_std).double())
    # the drawn sample is mean + std * noise with the generator's first normal draw
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(
        out.prev_sample.double(), ref_mean + ref_std * noise.double(), rtol=1e-5, atol=1e-5
    )
    ref_lp = _normal_log_prob_mean(out.prev_sample, ref_mean, ref_std)
    torch.testing.assert_close(out.log_prob.double(), ref_lp, rtol=1e-5, atol=1e-5)
    # a transition far from the mean has a lower density, consistently with the reference
    far = out.prev_sample + 3 * ref_std
    lp_far = sde_step(v, x, s, s_next, kind="sde", noise_level=0.7, prev_sample=far).log_prob
    torch.testing.assert_close(
        lp_far.double(), _normal_log_prob_mean(far, ref_mean, ref_std), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize(("s", "s_next", "a"), [(0.8, 0.6, 0.7), (0.5, 0.45, 0.3)])
def test_cps_step_log_prob_matches_float64_gaussian(s, s_next, a):
    x, v = _inputs(seed=2)
    out = sde_step(v, x, s, s_next, kind="cps", noise_level=a, generator=torch.Generator())
    xd, vd = x.double(), v.double()
    std = s_next * math.sin(a * math.pi / 2)
    x0_hat, eps_hat = xd - s * vd, xd + (1 - s) * vd
    mean = (1 - s_next) * x0_hat + math.sqrt(s_next**2 - std**2) * eps_hat
    torch.testing.assert_close(out.mean.double(), mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.std.double().flatten(), torch.full((3,), std).double())
    ref_lp = _normal_log_prob_mean(out.prev_sample, mean, std)
    torch.testing.assert_close(out.log_prob.double(), ref_lp, rtol=1e-5, atol=1e-5)


def test_sde_step_preserves_marginals_of_gaussian_data():
    """For data N(0, c^2) the exact velocity is linear, v = k(s) x, and x_s ~ N(0, V(s)),
    V(s) = (1-s)^2 c^2 + s^2. One SDE step maps V(s) to V(s + dt) up to O(dt^2); a wrong
    score correction would leave an error of order g^2 dt, the size of the injected noise."""
    c2 = 0.25

    def var(s):
        return (1 - s) ** 2 * c2 + s**2

    for s in (0.9, 0.5, 0.2):
        s_next = s - 1e-4
        k = (s - (1 - s) * c2) / var(s)
        ones = torch.ones(1, 4)
        out = sde_step(k * ones, ones, s, s_next, kind="sde", noise_level=0.9, prev_sample=ones)
        alpha = out.mean[0, 0].double().item()  # mean = alpha * x for this linear velocity
        std = out.std.double().item()
        error = alpha**2 * var(s) + std**2 - var(s_next)
        assert abs(error) < 0.02 * std**2, (s, error, std**2)


def test_ode_step_is_euler_and_zero_noise_sde_cps_match_it():
    x, v = _inputs(seed=3)
    s, s_next = 0.6, 0.45
    ode = sde_step(v, x, s, s_next, kind="ode", noise_level=0.0)
    torch.testing.assert_close(ode.prev_sample, x + (s_next - s) * v)
    assert torch.equal(ode.log_prob, torch.zeros(3))
    for kind in ("sde", "cps"):
        out = sde_step(v, x, s, s_next, kind=kind, noise_level=0.0, generator=torch.Generator())
        torch.testing.assert_close(out.mean, ode.prev_sample, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out.prev_sample, ode.prev_sample, rtol=1e-6, atol=1e-6)
        assert torch.equal(out.log_prob, torch.zeros(3))  # deterministic: log-prob 0


def test_deterministic_step_has_finite_gradients():
    x, v = _inputs(seed=4)
    v.requires_grad_(True)
    lp, _, _ = step_log_prob(v, x, x + 0.1, 0.5, 0.0, "cps", 0.7)  # cps to sigma 0: std = 0
    lp.sum().backward()
    assert torch.equal(lp.detach(), torch.zeros(3))
    assert torch.isfinite(v.grad).all()


def test_step_math_in_float32_for_bf16_velocity():
    x, v = _inputs(seed=5)
    out = sde_step(v.bfloat16(), x.bfloat16(), 0.5, 0.4, kind="sde", noise_level=0.5)
    assert out.prev_sample.dtype == out.log_prob.dtype == out.mean.dtype == torch.float32


def _velocity_model(dtype=torch.bfloat16):
    torch.manual_seed(11)
    lin = torch.nn.Linear(6, 6).to(dtype)

    def velocity_fn(x, sigma):
        assert x.dtype == torch.float32 and sigma.shape == (x.shape[0],)
        h = x.to(dtype) + sigma.to(dtype).view(-1, 1, 1, 1)
        return torch.tanh(lin(h))  # returns the model dtype, like a bf16 transformer

    return velocity_fn


@pytest.mark.parametrize("kind", ["sde", "cps"])
def test_sample_window_reproducibility_and_recomputed_log_probs(kind):
    velocity_fn = _velocity_model()
    sigmas = sigma_schedule(6, shift=3.0)
    noise = torch.randn(2, 3, 4, 6)
    window = (1, 4)

    def run(seed):
        gen = torch.Generator().manual_seed(seed)
        return sample(
            velocity_fn,
            noise,
            sigmas,
            kind=kind,
            noise_level=0.7,
            sde_window=window,
            generator=gen,
        )

    traj = run(0)
    assert traj.latents.shape == (7, 2, 3, 4, 6) and traj.latents.dtype == torch.float32
    assert traj.log_probs.shape == (6, 2)
    assert traj.stochastic.tolist() == [False, True, True, True, False, False]
    assert torch.equal(traj.latents[0], noise)
    assert torch.equal(traj.log_probs[~traj.stochastic], torch.zeros(3, 2))
    assert torch.isfinite(traj.log_probs).all()
    # outside the window each step is an Euler step on the same velocity
    for i in (0, 4, 5):
        v = velocity_fn(traj.latents[i], torch.full((2,), float(sigmas[i]))).float()
        expected = traj.latents[i] + (sigmas[i + 1] - sigmas[i]) * v
        torch.testing.assert_close(traj.latents[i + 1], expected)
    # same generator seed -> identical trajectory; another seed -> a different one
    again = run(0)
    assert torch.equal(again.latents, traj.latents)
    assert torch.equal(again.log_probs, traj.log_probs)
    assert not torch.equal(run(1).latents[-1], traj.latents[-1])
    # recomputing each stored stochastic transition under the same velocity gives ratio 1
    for i in torch.nonzero(traj.stochastic).flatten().tolist():
        x = traj.latents[i]
        v = velocity_fn(x, torch.full((2,), float(sigmas[i])))
        lp, _, _ = step_log_prob(
            v, x, traj.latents[i + 1], float(sigmas[i]), float(sigmas[i + 1]), kind, 0.7
        )
        ratio = torch.exp(lp - traj.log_probs[i])
        torch.testing.assert_close(ratio, torch.ones(2), rtol=0, atol=1e-6)


def test_sample_ode_and_final_cps_step_not_stochastic():
    velocity_fn = _velocity_model(torch.float32)
    sigmas = sigma_schedule(3)
    noise = torch.randn(1, 2, 4, 6)
    ode = sample(velocity_fn, noise, sigmas, kind="ode", noise_level=0.0)
    assert not ode.stochastic.any() and torch.equal(ode.log_probs, torch.zeros(3, 1))
    cps = sample(velocity_fn, noise, sigmas, kind="cps", noise_level=0.5, generator=None)
    assert cps.stochastic.tolist() == [True, True, False]  # std = sigma_next * ... = 0 at the end


def test_sigma_schedule():
    plain = sigma_schedule(4)
    torch.testing.assert_close(plain, torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))
    shifted = sigma_schedule(4, shift=3.0)
    assert shifted[0] == 1.0 and shifted[-1] == 0.0
    torch.testing.assert_close(shifted[2], torch.tensor(3 * 0.5 / (1 + 2 * 0.5)))
    assert (shifted[1:] < shifted[:-1]).all()
    with pytest.raises(ValueError, match="num_steps"):
        sigma_schedule(0)
    with pytest.raises(ValueError, match="shift"):
        sigma_schedule(4, shift=0.0)


@pytest.mark.parametrize("shift", [1.0, 3.0, 277.27])
def test_a_terminal_stretch_equals_diffusers_shift_terminal(shift):
    """diffusers' FlowMatchEulerDiscreteScheduler (shift, shift_terminal 0.1), timesteps set as
    its pipelines set them, is the independent reference."""
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift, shift_terminal=0.1)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / 8, 8))
    ours = sigma_schedule(8, shift=shift, terminal=0.1)
    assert ours.tolist() == pytest.approx(scheduler.sigmas.tolist(), abs=1e-6)
    assert ours[0] == 1.0 and ours[-1] == 0.0 and ours[-2] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="terminal"):
        sigma_schedule(8, terminal=1.0)


def test_token_shift_is_diffusers_dynamic_shift_and_excludes_a_fixed_one():
    """sampler.token_shift's shift at a token count equals diffusers' exponential time shift by
    calculate_shift's mu (both read at sigma 0.5: shift * s / (1 + (shift - 1) s))."""
    from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

    from vsa2_rl.config import ConfigError
    from vsa2_rl.config.algorithm import SamplerConfig

    rule = [1024, 0.95, 4096, 2.05]
    sampler = SamplerConfig(token_shift=rule)
    for tokens in (128, 2048, 14_080):
        mu = calculate_shift(tokens, 1024, 4096, 0.95, 2.05)
        diffusers_sigma = math.exp(mu) / (math.exp(mu) + (1 / 0.5 - 1))
        shift = sampler.schedule_shift(tokens)
        assert shift * 0.5 / (1 + (shift - 1) * 0.5) == pytest.approx(diffusers_sigma, rel=1e-12)
    assert SamplerConfig(shift=5.0).schedule_shift(14_080) == 5.0
    with pytest.raises(ConfigError, match=r"^sampler\.shift: sampler\.token_shift sets"):
        SamplerConfig(shift=5.0, token_shift=rule)
    with pytest.raises(ConfigError, match=r"^sampler\.token_shift: must be"):
        SamplerConfig(token_shift=[4096, 0.95, 1024, 2.05])
    with pytest.raises(ConfigError, match=r"^sampler\.shift_terminal: must be in \(0, 1\)"):
        SamplerConfig(shift_terminal=0.0)


def test_cfg_velocity_combines_cond_and_uncond():
    def model_fn(x, sigma, cond):
        return x * sigma.view(-1, 1) + cond.sum(dim=(1, 2)).view(-1, 1)

    x, sigma = torch.randn(2, 3), torch.tensor([0.5, 0.7])
    cond, uncond = torch.randn(2, 4, 5), torch.randn(1, 4, 5)
    v = cfg_velocity(model_fn, cond, uncond, 4.0)(x, sigma)
    v_c = model_fn(x, sigma, cond)
    v_u = model_fn(x, sigma, uncond.expand(2, 4, 5))
    torch.testing.assert_close(v, v_u + 4.0 * (v_c - v_u))
    torch.testing.assert_close(cfg_velocity(model_fn, cond, None, 1.0)(x, sigma), v_c)
    with pytest.raises(ValueError, match="uncond"):
        cfg_velocity(model_fn, cond, None, 3.0)


def test_cfg_velocity_guides_low_noise_samples_with_the_second_scale():
    """Wan2.2's guidance_scale_2: timesteps (sigma * 1000) below the boundary (875 here) take
    the second scale, those at or above it the first; both 1 needs no unconditional pass."""

    def model_fn(x, sigma, cond):
        return x * sigma.view(-1, 1) + cond.sum(dim=(1, 2)).view(-1, 1)

    x, sigma = torch.randn(3, 2), torch.tensor([0.9, 0.875, 0.5])
    cond, uncond = torch.randn(3, 4, 5), torch.randn(1, 4, 5)
    v = cfg_velocity(model_fn, cond, uncond, 4.0, low_noise=(875.0, 1.5))(x, sigma)
    v_c = model_fn(x, sigma, cond)
    v_u = model_fn(x, sigma, uncond.expand(3, 4, 5))
    scales = torch.tensor([4.0, 4.0, 1.5]).view(-1, 1)
    torch.testing.assert_close(v, v_u + scales * (v_c - v_u))
    plain = cfg_velocity(model_fn, cond, None, 1.0, low_noise=(875.0, 1.0))(x, sigma)
    torch.testing.assert_close(plain, v_c)


def test_sampler_rejects_bad_arguments():
    x, v = _inputs()
    with pytest.raises(ValueError, match="kind"):
        sde_step(v, x, 0.5, 0.4, kind="ddim", noise_level=0.5)
    with pytest.raises(ValueError, match="noise_level"):
        sde_step(v, x, 0.5, 0.4, kind="cps", noise_level=1.5)
    with pytest.raises(ValueError, match="sigma"):
        sde_step(v, x, torch.ones(5), 0.4, kind="sde", noise_level=0.5)
    fn = _velocity_model(torch.float32)
    noise = torch.randn(1, 2, 4, 6)
    with pytest.raises(ValueError, match="sde_window"):
        sample(fn, noise, sigma_schedule(4), sde_window=(3, 9))
    with pytest.raises(ValueError, match="decreasing"):
        sample(fn, noise, torch.tensor([1.0, 0.5, 0.6, 0.0]))


def test_seeded_noise_draws_each_sample_from_its_own_seed():
    from vsa2_rl.sampling import seeded_noise

    batch = seeded_noise((2, 3), [7, 11, 7])
    assert batch.shape == (3, 2, 3)
    assert torch.equal(batch[0], torch.randn(2, 3, generator=torch.Generator().manual_seed(7)))
    # a sample's noise does not depend on the batch it is drawn in (or on the rank drawing it)
    assert torch.equal(batch[1], seeded_noise((2, 3), [11])[0]) and torch.equal(batch[0], batch[2])
