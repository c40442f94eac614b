"""GRPO math: advantages, PPO-clip loss, Gaussian KL, distributed gather, prompt sampler."""

import math
import threading

import pytest
import torch

from vsa2_rl.rl.grpo import (
    GroupedPromptSampler,
    gather_group_rewards,
    gaussian_kl,
    group_advantages,
    grpo_loss,
)
from vsa2_rl.sampling import step_log_prob

EPS = 1e-4


def test_group_advantages_group_scale_with_zero_variance_group():
    rewards = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0])
    groups = torch.tensor([0, 0, 0, 1, 1])
    adv, zero_var = group_advantages(rewards, groups, scale="group", eps=EPS)
    std0 = math.sqrt(2 / 3)  # population std of 1, 2, 3
    expected = torch.tensor([-1 / (std0 + EPS), 0.0, 1 / (std0 + EPS), 0.0, 0.0])
    torch.testing.assert_close(adv, expected)
    assert zero_var.tolist() == [False, False, False, True, True]
    assert adv.dtype == torch.float32


def test_group_advantages_batch_and_none_scales_unequal_groups():
    rewards = torch.tensor([4.0, 0.0, 2.0, 1.0, 7.0])
    groups = torch.tensor([7, 3, 7, 3, 3])  # arbitrary ids, interleaved, sizes 2 and 3
    mean3 = 8.0 / 3  # group 3 is {0, 1, 7}; group 7 is {4, 2} with mean 3
    centered = torch.tensor([1.0, -mean3, -1.0, 1 - mean3, 7 - mean3])
    batch_std = torch.tensor([4.0, 0.0, 2.0, 1.0, 7.0], dtype=torch.float64).std(correction=0)
    adv, _ = group_advantages(rewards, groups, scale="batch", eps=EPS)
    torch.testing.assert_close(adv, (centered / (batch_std.item() + EPS)).float())
    adv, zero_var = group_advantages(rewards, groups, scale="none")
    torch.testing.assert_close(adv, centered)
    assert not zero_var.any()


def test_group_advantages_clip_and_exact_zero_for_equal_rewards():
    rewards = torch.tensor([0.0, 0.0, 0.0, 10.0, 0.1, 0.1, 0.1])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    adv, zero_var = group_advantages(rewards, groups, scale="group", eps=EPS, clip=1.5)
    # group 0: mean 2.5, std sqrt(18.75) = 4.33 -> 10 maps to 1.732, clipped to 1.5
    std = math.sqrt(18.75)
    torch.testing.assert_close(adv[:3], torch.full((3,), -2.5 / (std + EPS)))
    assert adv[3].item() == 1.5
    assert torch.equal(adv[4:], torch.zeros(3))  # 0.1 repeated: exactly 0, not 1 ulp off
    assert zero_var.tolist() == [False] * 4 + [True] * 3


def test_group_advantages_rejects_bad_input():
    r, g = torch.tensor([1.0, 2.0]), torch.tensor([0, 0])
    with pytest.raises(ValueError, match="scale"):
        group_advantages(r, g, scale="global")
    with pytest.raises(ValueError, match="finite"):
        group_advantages(torch.tensor([1.0, float("nan")]), g)
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(r, torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match="integer"):
        group_advantages(r, torch.tensor([0.0, 0.0]))
    with pytest.raises(ValueError, match="clip"):
        group_advantages(r, g, clip=0.0)


def test_ppo_clip_loss_branches_and_stats():
    ratios = torch.tensor([1.5, 0.5, 1.05, 0.7], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    old = torch.tensor([-0.3, 0.2, 0.0, 1.1])
    log_prob = (old.double() + ratios.log()).float().requires_grad_(True)
    loss, stats = grpo_loss(log_prob, old, adv, clip_range=0.2, loss_type="ppo_clip")
    # per element max(-A r, -A clip(r)): -1.2 (clipped), -0.5, 1.05, 0.8 (clipped)
    torch.testing.assert_close(loss, torch.tensor((-1.2 - 0.5 + 1.05 + 0.8) / 4))
    loss.backward()
    # d/dlogp of -A r is -A r on unclipped elements, 0 where the clip is active
    torch.testing.assert_close(log_prob.grad, torch.tensor([0.0, -0.5, 1.05, 0.0]) / 4)
    assert stats["clip_frac"].item() == 0.5
    torch.testing.assert_close(stats["ratio_mean"], torch.tensor(3.75 / 4))
    torch.testing.assert_close(stats["ratio_max_dev"], torch.tensor(0.5))
    k3 = (ratios - 1 - ratios.log()).mean().float()
    torch.testing.assert_close(stats["approx_kl"], k3)


def test_asymmetric_clipping_bounds_each_side_on_its_own():
    # [1 - 0.1, 1 + 0.3]: r = 1.2 with A > 0 is inside (symmetric 0.1 would clip it), r = 1.4
    # with A > 0 and r = 0.85 with A < 0 are outside
    ratios = torch.tensor([1.2, 1.4, 0.85, 0.95], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    log_prob = ratios.log().float().requires_grad_(True)
    loss, stats = grpo_loss(log_prob, torch.zeros(4), adv, clip_range=0.1, clip_range_high=0.3)
    torch.testing.assert_close(loss, torch.tensor((-1.2 - 1.3 + 0.9 + 0.95) / 4))
    loss.backward()
    torch.testing.assert_close(log_prob.grad, torch.tensor([-1.2, 0.0, 0.0, 0.95]) / 4)
    assert stats["clip_frac"].item() == 0.5
    with pytest.raises(ValueError, match="clip_range_high"):
        grpo_loss(log_prob, torch.zeros(4), adv, clip_range_high=0.0)


def test_approx_kl_survives_the_small_log_ratios_of_per_element_log_probs():
    # k3 = r - 1 - log r = x^2 / 2 + x^3 / 6 + ... at log-ratio x; in float32 r - 1 - x cancels
    for x in (1e-4, -3e-5, 2e-3):
        log_prob = torch.full((8,), x, dtype=torch.float32)
        stats = grpo_loss(log_prob, torch.zeros(8), torch.ones(8))[1]
        x64 = float(log_prob[0].double())
        expected = x64**2 / 2 + x64**3 / 6 + x64**4 / 24
        assert stats["approx_kl"].item() == pytest.approx(expected, rel=1e-4)


def test_reinforce_loss_and_timestep_broadcast():
    log_prob = torch.tensor([[0.1, -0.2, 0.3], [0.0, 0.5, -1.0]], requires_grad=True)
    adv = torch.tensor([2.0, -1.0])
    loss, stats = grpo_loss(log_prob, log_prob.detach(), adv, loss_type="reinforce")
    expected = -(2.0 * (0.1 - 0.2 + 0.3) - 1.0 * (0.0 + 0.5 - 1.0)) / 6
    torch.testing.assert_close(loss, torch.tensor(expected))
    loss.backward()
    torch.testing.assert_close(log_prob.grad, -adv.view(2, 1).expand(2, 3) / 6)
    assert stats["ratio_max_dev"].item() == 0.0 and stats["clip_frac"].item() == 0.0
    # on-policy (ratio 1) PPO-clip has the same gradient as REINFORCE
    lp2 = log_prob.detach().clone().requires_grad_(True)
    grpo_loss(lp2, log_prob.detach(), adv, clip_range=0.2, loss_type="ppo_clip")[0].backward()
    torch.testing.assert_close(lp2.grad, log_prob.grad)


def test_grpo_loss_rejects_bad_arguments():
    lp = torch.zeros(3)
    with pytest.raises(ValueError, match="loss_type"):
        grpo_loss(lp, lp, lp, loss_type="grpo++")
    with pytest.raises(ValueError, match="clip_range"):
        grpo_loss(lp, lp, lp, clip_range=0.0)
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(lp, lp, torch.zeros(4))


def test_gaussian_kl_closed_form_and_log_prob_consistency():
    gen = torch.Generator().manual_seed(3)
    mean = torch.randn(2, 50, 40, generator=gen)
    ref = mean + 0.3 * torch.randn(2, 50, 40, generator=gen)
    std = torch.tensor([0.5, 0.8]).view(2, 1, 1)
    kl = gaussian_kl(mean, ref, std)
    p = torch.distributions.Normal(mean.double(), std.double().expand_as(mean))
    q = torch.distributions.Normal(ref.double(), std.double().expand_as(mean))
    expected = torch.distributions.kl_divergence(p, q).flatten(1).mean(1)
    torch.testing.assert_close(kl.double(), expected, rtol=1e-5, atol=1e-7)

    # Monte Carlo through the sampler's log-probs: E_p[log p - log q] = KL with the same
    # per-element-mean convention. Velocities v, v_ref give transition means m, m_ref.
    x = torch.randn(2, 200, 100, generator=gen)
    v = torch.randn(2, 200, 100, generator=gen)
    v_ref = v + 3.0 * torch.randn(2, 200, 100, generator=gen)  # KL ~ 0.5 per element
    s, s_next = 0.6, 0.5
    _, m, sd = step_log_prob(v, x, x, s, s_next, "sde", 0.8)  # for the mean and std
    _, m_ref, _ = step_log_prob(v_ref, x, x, s, s_next, "sde", 0.8)
    samples = m + sd * torch.randn(m.shape, generator=gen)
    lp_p, _, _ = step_log_prob(v, x, samples, s, s_next, "sde", 0.8)
    lp_q, _, _ = step_log_prob(v_ref, x, samples, s, s_next, "sde", 0.8)
    exact = gaussian_kl(m, m_ref, sd)
    # MC std of the estimate ~ sqrt(2 KL / 20000) ~ 0.007 relative to KL ~ 0.5
    torch.testing.assert_close(lp_p - lp_q, exact, rtol=0.05, atol=0)
    assert exact.min() > 0.1


class _ThreadRank:
    """A fake accelerate.Accelerator for one of `world` threads: gather is a real all-gather."""

    def __init__(self, rank, world, slots, barrier):
        self.process_index, self.num_processes, self.device = rank, world, torch.device("cpu")
        self._slots, self._barrier = slots, barrier

    def gather(self, tensor):
        self._slots[self.process_index] = tensor.clone()
        self._barrier.wait()
        out = torch.cat(list(self._slots))
        self._barrier.wait()  # nobody overwrites a slot before everyone has read it
        return out


def _run_ranks(per_rank_rewards, per_rank_ids, **kwargs):
    world = len(per_rank_rewards)
    slots, barrier, results = [None] * world, threading.Barrier(world, timeout=30), [None] * world

    def work(rank):
        acc = _ThreadRank(rank, world, slots, barrier)
        try:
            results[rank] = gather_group_rewards(
                acc, per_rank_rewards[rank], per_rank_ids[rank], **kwargs
            )
        except Exception as exc:
            results[rank] = exc
            barrier.abort()

    threads = [threading.Thread(target=work, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_gather_group_rewards_matches_single_process_over_ranks():
    # 2 prompts x K=3 samples over 3 ranks of 2 samples: both groups straddle ranks
    rewards = torch.tensor([1.0, 4.0, 2.0, 0.5, 0.5, 3.0])
    ids = torch.tensor([0, 0, 0, 1, 1, 1])
    full_adv, full_zero = group_advantages(rewards, ids, scale="group", clip=2.0)
    results = _run_ranks(list(rewards.split(2)), list(ids.split(2)), clip=2.0)
    for rank, result in enumerate(results):
        assert not isinstance(result, Exception), result
        part = slice(2 * rank, 2 * rank + 2)
        torch.testing.assert_close(result.advantages, full_adv[part])
        assert torch.equal(result.zero_var_mask, full_zero[part])
        assert torch.equal(result.all_rewards, rewards)
    # the per-rank answer differs from normalising each rank alone (the point of gathering)
    alone, _ = group_advantages(rewards[:2], ids[:2], clip=2.0)
    assert not torch.allclose(alone, full_adv[:2])
    single = gather_group_rewards(None, rewards, ids, clip=2.0)
    torch.testing.assert_close(single.advantages, full_adv)


def test_gather_group_rewards_with_unequal_rank_sizes():
    # rank 1 dropped a sample (failed reward): 3 + 1 + 2 samples of 2 groups
    rewards = torch.tensor([1.0, 4.0, 2.0, 0.5, 7.0, 3.0])
    ids = torch.tensor([0, 0, 0, 1, 1, 1])
    full_adv, _ = group_advantages(rewards, ids, scale="batch")
    blocks = [slice(0, 3), slice(3, 4), slice(4, 6)]
    results = _run_ranks([rewards[b] for b in blocks], [ids[b] for b in blocks], scale="batch")
    for block, result in zip(blocks, results, strict=True):
        assert not isinstance(result, Exception), result
        torch.testing.assert_close(result.advantages, full_adv[block])
        assert torch.equal(result.all_rewards, rewards)


def test_grouped_prompt_sampler_covers_groups_across_ranks():
    num_prompts, k, per_step, world = 10, 3, 4, 2
    samplers = [
        GroupedPromptSampler(num_prompts, k, per_step, num_replicas=world, rank=r, seed=5)
        for r in range(world)
    ]
    assert samplers[0].steps_per_epoch == 2 and samplers[0].samples_per_rank == 6
    seen_epoch0 = []
    for step in range(2):
        parts = [s.batch(step) for s in samplers]
        indices = [i for p in parts for i in p.prompt_indices]
        ids = [g for p in parts for g in p.group_ids]
        assert ids == [g for g in range(per_step) for _ in range(k)]
        # each group id maps to one prompt, each prompt appears exactly K times
        assert len({(g, i) for g, i in zip(ids, indices, strict=True)}) == per_step
        assert all(indices.count(i) == k for i in set(indices))
        seen_epoch0 += sorted(set(indices))
    assert len(set(seen_epoch0)) == 8  # no prompt repeats within an epoch
    # a pure function of the step: a fresh sampler gives the same batch (resume needs no state)
    fresh = GroupedPromptSampler(num_prompts, k, per_step, num_replicas=world, rank=1, seed=5)
    assert fresh.batch(3) == samplers[1].batch(3)
    assert samplers[0].batch(2).epoch == 1
    orders = {tuple(samplers[0].batch(2 * e).prompt_indices) for e in range(6)}
    assert len(orders) > 1  # epochs reshuffle


def test_grouped_prompt_sampler_rejects_bad_arguments():
    with pytest.raises(ValueError, match="divisible"):
        GroupedPromptSampler(10, 3, 3, num_replicas=2)
    with pytest.raises(ValueError, match="prompts_per_step"):
        GroupedPromptSampler(3, 2, 4)
    with pytest.raises(ValueError, match="rank"):
        GroupedPromptSampler(10, 2, 2, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="group_size"):
        GroupedPromptSampler(10, 0, 2)
