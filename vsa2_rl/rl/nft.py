"""DiffusionNFT: online RL on the forward process (``rl.algorithm=nft``).

Follows Zheng et al., 2025, "DiffusionNFT: Online Diffusion Reinforcement with Forward Process"
(arXiv 2509.16117), its Algorithm 1 and the authors' SD3.5 scripts (NVlabs/DiffusionNFT), in this
repository's convention ``x_sigma = (1 - sigma) x0 + sigma eps``, velocity ``v = eps - x0``:

- the old policy ``v_old`` samples the rollouts, with any solver (``sampler.kind=ode`` included:
  no log-probs are needed) and without guidance (``nft.guidance=none``, the paper's); beyond the
  paper, ``nft.guidance=rollouts`` samples them with the sampler's classifier-free guidance, and
  ``nft.guidance=anchor`` also takes the guided velocity as ``v_old`` in the loss below;
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

Two anchors against drift beyond the paper, both off by default: ``nft.trust_region`` scales
back an optimizer step that moved the velocity more than a radius (:func:`limit_step`, the
shrinking of a step to its bound that TRPO's line search does, Schulman et al. 2015), and
``rl.kl_reference=ema`` takes the KL term's reference from an EMA of the trained weights
(:class:`EMAReference`) instead of the start of training. Under FSDP2 and DeepSpeed ZeRO-3 the
EMA is held and written shard by shard, as the old policy is (:func:`_copy_into`);
``nft.trust_region`` is refused under DeepSpeed (its float32 master copy would undo the scaling).

:class:`OldPolicy` holds theta_old (LoRA runs and sharded parameters: float32 copies of the
trained tensors, of each rank's shards only, swapped in while it runs; full fine-tuning
otherwise: a frozen copy of the model) and
:class:`NFTUpdate` is this rule behind the trainer's :class:`vsa2_rl.rl.update.UpdateRule`;
rollout, rewards, advantages, guards, the sparsity schedule, engines and checkpoints are the
trainer's own (vsa2_rl.rl.trainer).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from vsa2_rl.config import ConfigError, NFTConfig, RLConfig, RunConfig
from vsa2_rl.models.experts import frozen_copy, trained_sigma_range
from vsa2_rl.models.wan_bundle import with_transformer
from vsa2_rl.rl import engines
from vsa2_rl.rl.ema import EMA, as_shard_of, is_zero3, local_tensor, whole_shape, whole_tensor
from vsa2_rl.rl.policy import Policy
from vsa2_rl.rl.rollout import Rollout, RolloutSampler, StepRollouts
from vsa2_rl.rl.update import UpdateResult

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


@torch.no_grad()
def limit_step(
    params: list[Tensor],
    before: list[Tensor],
    deviation: float,
    radius: float,
    model: torch.nn.Module | None = None,
) -> float:
    """Scales back the optimizer step that took ``before`` to ``params`` (in place) when it moved
    the velocity by a mean square ``deviation`` beyond ``radius``; returns the scale applied.

    A small step changes the velocity linearly in its size, so the mean squared change is
    quadratic in it: ``params <- before + s (params - before)`` with ``s = sqrt(radius /
    deviation)`` brings the change to ``radius`` (exactly for a velocity linear in the weights).
    A step whose deviation is not finite is undone (s = 0). Under FSDP2 ``params`` and
    ``before`` are DTensors, scaled shard by shard; ``model``, the module that holds ``params``,
    has its sharded parameters registered again before they are written (:func:`_reshard`).
    """
    if not radius > 0:
        raise ValueError(f"radius must be > 0, got {radius!r}")
    if deviation <= radius:
        return 1.0
    scale = math.sqrt(radius / deviation) if math.isfinite(deviation) else 0.0
    if model is not None:
        _reshard(model)  # the deviation's forward left the root's gathered weights registered
    for param, start in zip(params, before, strict=True):
        param.copy_(torch.lerp(start, param, scale))
    return scale


class EMAReference:
    """The KL term's reference with ``rl.kl_reference=ema``: an EMA of the trained weights
    (:class:`vsa2_rl.rl.ema.EMA`, float32, of the parameters that train), updated after each
    optimizer step; equal to the start of training until the first.

    LoRA runs (``lora=True``) and sharded parameters swap the EMA tensors into the model while
    the reference runs, as :class:`OldPolicy` does (the EMA's tensors are FSDP2 DTensors of the
    parameters' placement, or copies of ZeRO-3's partitions: each rank averages and swaps its
    shards only); full
    fine-tuning otherwise keeps a frozen copy of the model in its dtype into which the float32
    EMA is written after each update, so that no weights move per call. Same interface as
    :class:`vsa2_rl.rl.policy.ReferencePolicy` (``active``).
    """

    def __init__(self, bundle, model: torch.nn.Module, *, decay: float, lora: bool):
        self.bundle, self.model = bundle, model
        _reshard(model)  # the EMA averages the sharded parameters, not a gathered copy
        self.ema = EMA(model, decay=decay)
        self.frozen, self.copies = None, {}
        if not lora and not _sharded(self.ema.params):
            self.frozen = with_transformer(bundle, frozen_copy(model))
            frozen = dict(self.frozen.transformer.named_parameters())
            self.copies = {name: frozen[name] for name in self.ema.params}

    def update(self) -> None:
        """``ema <- decay * ema + (1 - decay) * theta``; call after each optimizer step."""
        self.ema.update()
        self._write_copy()

    @torch.no_grad()
    def _write_copy(self) -> None:
        for name, copy in self.copies.items():
            copy.copy_(self.ema.shadow[name])

    @contextlib.contextmanager
    def active(self) -> Iterator:
        """Yields the bundle that computes the reference's velocity (call it under no_grad)."""
        if self.frozen is not None:
            yield self.frozen
            return
        with _swapped(self.model, self.ema.params, self.ema.shadow):
            yield self.bundle

    def state_dict(self, keep: bool = True) -> dict:
        """The EMA's state with whole tensors (shards gathered as :meth:`OldPolicy.state_dict`
        does); ``keep=False`` returns ``{}``."""
        state = self.ema.state_dict()
        shadow = _whole_tensors(self.ema.params, state["shadow"], keep)
        return {**state, "shadow": shadow} if keep else {}

    def load_state_dict(self, state: dict) -> None:
        """Restores :meth:`state_dict` (whole tensors; sharded, each rank takes its shards)."""
        self.ema.load_state_dict(state)
        self._write_copy()


class _Probe(NamedTuple):
    """A training pass's input and the velocity the policy gave it before the optimizer step:
    what ``nft.trust_region`` measures the step's change on."""

    x: Tensor
    sigma: Tensor
    condition: object
    velocity: Tensor  # detached, float32


def _reshard(model: torch.nn.Module) -> None:
    """Under FSDP2, registers every module's sharded parameters again (no-op otherwise): a
    forward under ``no_grad`` leaves the root module's gathered copy registered, which the next
    forward would reuse, so the shards are written only after this."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _sharded(params: dict[str, Tensor]) -> bool:
    """Whether ``params`` are sharded over the ranks (FSDP2 DTensors, ZeRO-3 partitions)."""
    return any(isinstance(p, DTensor) or is_zero3(p) for p in params.values())


@contextlib.contextmanager
def _swapped(model: torch.nn.Module, params: dict[str, Tensor], weights: dict[str, Tensor]):
    """Runs the block with ``weights`` copied into ``model``'s parameters ``params`` (same
    names; of sharded parameters each rank's shards, :func:`vsa2_rl.rl.ema.local_tensor`) and
    the trained values copied back after it."""
    trained = {name: local_tensor(param).detach().clone() for name, param in params.items()}
    _copy_into(model, params, weights)
    try:
        yield
    finally:
        _copy_into(model, params, trained)


@torch.no_grad()
def _copy_into(model: torch.nn.Module, params: dict[str, Tensor], values: dict[str, Tensor]):
    """Writes ``values`` (each rank's shards of sharded parameters) into ``params``, so that the
    next forward of ``model`` runs them."""
    _reshard(model)  # else a gathered copy from the last forward would hide what is written
    for name, param in params.items():
        local_tensor(param).copy_(values[name])
    _release_stale(list(params.values()))


def _release_stale(params: list[Tensor]) -> None:
    """Under ZeRO-3, makes the next forward read the partitions just written into ``params``
    (no-op otherwise): the parameters that DeepSpeed holds gathered, those it left so after the
    last forward and those below ``stage3_param_persistence_threshold``, which it keeps gathered
    whole on every rank, are released, so that the next forward gathers them from their
    partitions (and keeps the persistent ones gathered again)."""
    partitioned = [p for p in params if is_zero3(p)]
    if not partitioned:  # DeepSpeed need not be installed
        return
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    gathered = [p for p in partitioned if p.ds_status == ZeroParamStatus.AVAILABLE]
    if gathered:
        gathered[0].partition(gathered)  # frees the stale whole tensors, writes nothing back


def _whole_tensors(
    params: dict[str, Tensor], tensors: dict[str, Tensor], keep: bool
) -> dict[str, Tensor]:
    """``tensors``, each rank's part of the parameters ``params`` of the same names, whole:
    shards are gathered one tensor at a time onto the CPU (a collective every rank joins,
    :func:`vsa2_rl.rl.ema.whole_tensor`); ``keep=False`` (ranks that do not write the
    checkpoint) returns ``{}``."""
    whole = {}
    for name, tensor in tensors.items():
        value = whole_tensor(tensor, params[name])
        if keep:
            whole[name] = value
    return whole


class OldPolicy:
    """theta_old: the policy that samples the rollouts and anchors v+ and v-; starts equal to
    the trained model.

    ``model`` is the unwrapped transformer that trains (``bundle.transformer`` may be its
    DDP / DeepSpeed / FSDP2 wrapper). With ``copy_model=False`` (LoRA runs, and full
    fine-tuning under FSDP2 or ZeRO-3) it keeps float32 copies of the trainable tensors (for
    LoRA the adapters and VSA2 router/gates, a few MB) and swaps them into the parameters while
    the old policy runs, so the base weights are not held twice. Of sharded parameters it copies
    each rank's shards only (:func:`vsa2_rl.rl.ema.local_tensor`: FSDP2's DTensors, of the
    parameters' placement, or ZeRO-3's flat partitions ``ds_tensor``), so each rank holds,
    soft-updates and swaps its shards, and the old policy runs through the same sharded module.
    With ``copy_model=True`` (full fine-tuning without sharded parameters) it keeps a frozen
    copy of the whole model in its dtype, run through a view of ``bundle`` (no weights move per
    call).
    """

    def __init__(self, bundle, model: torch.nn.Module, *, copy_model: bool):
        self.bundle, self.model = bundle, model
        _reshard(model)  # the sharded parameters, not a gathered copy
        self.live = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.frozen = None
        if copy_model:
            self.frozen = with_transformer(bundle, frozen_copy(model))
            frozen = dict(self.frozen.transformer.named_parameters())
            self.weights = {name: frozen[name] for name in self.live}
        else:
            self.weights = {
                n: local_tensor(p).detach().float().clone() for n, p in self.live.items()
            }

    @torch.no_grad()
    def soft_update(self, eta: float) -> None:
        """``theta_old <- eta * theta_old + (1 - eta) * theta`` (shard by shard if sharded)."""
        for name, weight in self.weights.items():
            weight.lerp_(local_tensor(self.live[name]).detach().to(weight.dtype), 1.0 - eta)

    @contextlib.contextmanager
    def active(self) -> Iterator:
        """Yields the bundle that runs the old policy (call it under ``no_grad``)."""
        if self.frozen is not None:
            yield self.frozen
            return
        with _swapped(self.model, self.live, self.weights):
            yield self.bundle

    def state_dict(self, keep: bool = True) -> dict[str, Tensor]:
        """theta_old by parameter name, whole tensors: shards are gathered one tensor at a time
        onto the CPU (a collective every rank joins); ``keep=False`` (ranks that do not write
        the checkpoint) returns ``{}``."""
        return _whole_tensors(self.live, self.weights, keep)

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restores :meth:`state_dict` (whole tensors; sharded, each rank takes its shards);
        names and shapes must be this model's."""
        if set(state) != set(self.weights):
            missing = sorted(set(self.weights) - set(state))
            extra = sorted(set(state) - set(self.weights))
            raise ValueError(
                f"old-policy state does not match the trained parameters: missing "
                f"{missing[:3]}, unexpected {extra[:3]}"
            )
        for name, weight in self.weights.items():
            param = self.live[name]
            if state[name].shape != whole_shape(param):
                raise ValueError(
                    f"old-policy tensor {name!r} has shape {tuple(state[name].shape)}, the "
                    f"parameter {tuple(whole_shape(param))}"
                )
            weight.copy_(as_shard_of(state[name], weight, param))


def _draw_seed(seed: int, step: int, epoch: int, index: int) -> int:
    """Seed of one sample's forward noising (noise levels, then one noise per pass) at an inner
    epoch of a step: a pure function of them, like the rollouts' seeds, so that any number of
    ranks and a resumed run draw the same."""
    return (((seed * 1_000_003 + step) * 10_007 + epoch) * 1_000_033 + index) % (2**63 - 1)


class _Draws(NamedTuple):
    """One chunk's forward noising in one inner epoch."""

    sigmas: Tensor  # [b, K] float32 on the device: each sample's K noise levels
    generators: list[torch.Generator]  # one per sample (CPU), drawing its noise pass by pass


def _check_trained_levels(model, low: float, high: float) -> None:
    """Refuses an ``nft.sigma_range`` that reaches an expert ``model.train_experts`` leaves
    frozen (its losses could change nothing)."""
    trained = trained_sigma_range(model)
    if trained is None:
        return
    lowest, boundary_or_top = trained
    if lowest > 0:  # the high-noise expert trains: [boundary, 1]
        fits, within = low >= lowest, f"[{lowest}, 1]"
    else:  # the low-noise expert trains: [0, boundary)
        fits, within = high < boundary_or_top, f"[0, {boundary_or_top}) (below the boundary)"
    if not fits:
        raise ConfigError(
            f"nft.sigma_range: [{low}, {high}] reaches noise levels of an expert that "
            f"model.train_experts leaves frozen; set it within {within}"
        )


class NFTUpdate:
    """The update of ``rl.algorithm=nft`` (the ``nft`` section) of ``policy`` on the rollouts
    of ``sampler``, and its old policy (a :class:`vsa2_rl.rl.update.UpdateRule`).

    Per inner epoch, every kept sample (its reward not dropped) is trained at K =
    ``nft.timesteps_per_sample(sampler.num_steps)`` noise levels, one backward pass per
    (chunk, level), all accumulated into one optimizer step in which every sample and level
    weighs the same, however ``rl.train_batch_size`` cuts the samples and over any number of
    ranks. The old and the trained velocity both run at the training sparsity, so that at the
    first pass of a run (theta_old = theta) they agree exactly (``train/old_deviation`` 0;
    with ``nft.guidance=anchor`` v_old is the guided velocity, and they differ by guidance).
    """

    requires = ("latents",)  # of the trajectory only its end, the clean samples x0

    def __init__(
        self, policy: Policy, sampler: RolloutSampler, settings: NFTConfig, rl: RLConfig,
        seed: int,
    ):  # fmt: skip
        self.policy, self.settings, self.rl, self.seed = policy, settings, rl, seed
        self.sampler = sampler
        low, high = settings.sigma_range
        _check_trained_levels(policy.unwrapped, low, high)
        levels = sampler.sigmas[:-1]  # the schedule's sigmas but the final 0
        self.levels = levels[(levels >= low) & (levels <= high)]
        if settings.timestep_sampling == "schedule" and not len(self.levels):
            raise ConfigError(
                f"nft.sigma_range: [{low}, {high}] holds none of the rollout schedule's sigmas "
                f"{[round(float(v), 4) for v in levels]}; widen it or use "
                "nft.timestep_sampling=uniform"
            )
        self.num_levels = settings.timesteps_per_sample(sampler.settings.num_steps)
        if settings.timestep_sampling == "schedule":
            self.num_levels = min(self.num_levels, len(self.levels))
        lora = policy.config.model.lora.enabled
        # sharded parameters cannot be copied into a frozen model: their shards are swapped in
        copy_model = not lora and not engines.shards_parameters(policy.acc)
        self.old = OldPolicy(policy.bundle, policy.unwrapped, copy_model=copy_model)
        if settings.trust_region and policy.ema is not None:
            raise ConfigError(
                "nft.trust_region: scales a step back after train.ema_decay's EMA has averaged "
                "it; set train.ema_decay=0 or nft.trust_region=0"
            )
        if settings.trust_region and engines.uses_deepspeed(policy.acc):
            raise ConfigError(
                "nft.trust_region: scales the model's weights back, which DeepSpeed overwrites "
                "from its own float32 master copy at the next step; use DDP or "
                "nft.trust_region=0"
            )
        self.ema_reference = None
        if rl.kl_reference == "ema":
            self.ema_reference = EMAReference(
                policy.bundle, policy.unwrapped, decay=rl.kl_reference_decay, lora=lora
            )
        self.reference = self.ema_reference or policy.reference  # of the KL term

    @classmethod
    def from_config(cls, policy: Policy, sampler: RolloutSampler, config: RunConfig) -> NFTUpdate:
        """The rule of ``config``; refuses an ``nft.sigma_range`` the model cannot train."""
        return cls(policy, sampler, config.nft, config.rl, config.seed)

    def kl_penalty(self, chunk: Rollout, stochastic: Tensor) -> None:
        """None: nft's KL is a loss term (RunConfig refuses ``rl.kl_mode=reward``)."""
        return None

    def sampling_policy(self):
        """Yields the bundle the rollouts come from: the old policy."""
        return self.old.active()

    def state_entries(self) -> dict:
        keep = self.policy.acc.is_main_process  # FSDP2: every rank gathers, the main one keeps
        entries = {"old_policy": self.old.state_dict(keep=keep)}
        if self.ema_reference is not None:
            entries["kl_reference"] = self.ema_reference.state_dict(keep=keep)
        return entries

    def load_state(self, restored: dict) -> None:
        self.old.load_state_dict(restored["old_policy"])
        if self.ema_reference is None:
            return
        if "kl_reference" not in restored:
            raise ConfigError(
                "rl.kl_reference: the checkpoint holds no EMA reference (it was written with "
                "rl.kl_reference=base); resume it with rl.kl_reference=base"
            )
        self.ema_reference.load_state_dict(restored["kl_reference"])

    def update(self, step: int, rollouts: StepRollouts) -> UpdateResult:
        """``rl.num_inner_epochs`` optimizer steps on the step's rollouts and their loss
        statistics, then the old policy's soft update."""
        weight = self._sample_weight(rollouts.chunks)
        names = ("loss/policy", "loss/kl", "train/old_deviation", "train/r_mean")
        sums = {name: [] for name in names}
        epochs = self.rl.num_inner_epochs if weight else 0
        grad_norms, skipped, limits = [], 0, []
        for epoch in range(epochs):
            stepped, grad_norm = self._epoch(step, epoch, rollouts, weight, sums, limits)
            skipped += not stepped  # a NaN/inf never reaches the weights
            grad_norms.append(grad_norm)
        eta = self.settings.eta(step)
        self.old.soft_update(eta)
        # (sample, level) terms of all ranks: num_processes / weight per epoch
        processes = self.policy.acc.num_processes
        metrics = self._means(sums, epochs * processes / weight if epochs else 1)
        metrics["train/old_policy_eta"] = eta
        if limits:  # (deviation, scale) of each optimizer step nft.trust_region measured
            metrics["train/step_deviation"] = sum(d for d, _ in limits) / len(limits)
            metrics["train/trust_region_scale"] = sum(s for _, s in limits) / len(limits)
        return UpdateResult(grad_norms, skipped, metrics)

    def _epoch(
        self, step: int, epoch: int, rollouts, weight: float, sums: dict, limits: list
    ) -> tuple:
        """One optimizer step over every (chunk, noise level) pass, limited to
        ``nft.trust_region`` (its ``(deviation, scale)`` appended to ``limits``) and followed by
        the EMA reference's update; ``(stepped, grad norm)``."""
        policy, kl_beta = self.policy, self.rl.kl_beta
        keys = _chunk_draw_keys(rollouts, by_group=self.settings.group_noise)
        draws = [self._draws(step, epoch, chunk_keys) for chunk_keys in keys]
        work = [  # a chunk's passes in level order: its generators draw one noise per pass
            (chunk, chunk_draws, level)
            for chunk, chunk_draws in zip(rollouts.chunks, draws, strict=True)
            for level in range(self.num_levels)
        ]
        policy.optimizer.zero_grad(set_to_none=True)
        for index, (chunk, draws, level) in enumerate(work):
            last = index == len(work) - 1
            kept = chunk.valid.float()  # a dropped reward's sample is not trained on
            with (
                engines.accumulation_context(policy.acc, policy.model, last),
                record_function("vsa2_rl/update/forward_backward"),
            ):
                losses, pass_probe = self._pass_losses(chunk, draws, level)
                if index == 0:  # the pass nft.trust_region measures the step on
                    probe = pass_probe
                total = ((losses[0] + kl_beta * losses[1]) * kept).sum() * weight
                engines.backward(policy.acc, total, last)
            for name, value in zip(sums, losses, strict=True):
                sums[name].append((value.detach() * kept).sum())
        radius = self.settings.trust_region
        before = [p.detach().clone() for p in policy.params] if radius else None
        stepped, grad_norm = policy.optimizer_step(sums["loss/policy"])
        if stepped and radius:
            deviation = self._step_deviation(probe)
            scale = limit_step(policy.params, before, deviation, radius, policy.unwrapped)
            limits.append((deviation, scale))
        if stepped and self.ema_reference is not None:
            self.ema_reference.update()
        return stepped, grad_norm

    @torch.no_grad()
    def _step_deviation(self, probe: _Probe) -> float:
        """Mean squared change of the velocity on ``probe`` that the optimizer step made, the
        mean over ranks (every rank then scales its step alike)."""
        velocity = self.policy.bundle.velocity(probe.x, probe.sigma, probe.condition).float()
        deviation = (velocity - probe.velocity).square().mean()
        return float(self.policy.acc.reduce(deviation, reduction="mean"))

    def _draws(self, step: int, epoch: int, indices: list[int]) -> _Draws:
        """The noise levels of a chunk's samples (global indices ``indices``) and their noise
        generators: K distinct sigmas of the rollout schedule (not its final 0) or K uniform
        ones per sample."""
        generators = [
            torch.Generator().manual_seed(_draw_seed(self.seed, step, epoch, i)) for i in indices
        ]
        if self.settings.timestep_sampling == "schedule":
            levels = self.levels
            rows = [
                levels[torch.randperm(len(levels), generator=g)[: self.num_levels]]
                for g in generators
            ]
        else:
            low, high = self.settings.sigma_range
            rows = [
                low + (high - low) * torch.rand(self.num_levels, generator=g) for g in generators
            ]
        return _Draws(torch.stack(rows).float().to(self.policy.acc.device), generators)

    def _pass_losses(self, chunk, draws: _Draws, level: int) -> tuple[tuple[Tensor, ...], _Probe]:
        """Per sample of the chunk at its ``level``-th noise level: the NFT loss, the velocity
        MSE to the KL's reference (0 without one), the squared distance of v_theta to v_old and
        r; and the pass as a :class:`_Probe`."""
        policy, settings = self.policy, self.settings
        x0 = chunk.latents[-1]  # [b, C, T, H, W] float32, the rollouts' clean samples
        noise = torch.stack([torch.randn(x0.shape[1:], generator=g) for g in draws.generators])
        noise, sigma = noise.to(x0.device), draws.sigmas[:, level]
        column = sigma.reshape(-1, *[1] * (x0.ndim - 1))
        x = (1.0 - column) * x0 + column * noise
        with torch.no_grad(), self.old.active() as old:
            v_old = self._old_velocity(old, x, sigma, chunk.condition)
        # the reference runs before v_theta: its swap (FSDP2: a reshard) must not fall between
        # v_theta's forward and backward
        v_reference = None
        if self.reference is not None:
            with torch.no_grad(), self.reference.active() as reference:
                v_reference = reference.velocity(x, sigma, chunk.condition).float()
        v_theta = policy.bundle.velocity(x, sigma, chunk.condition).float()
        r = optimality_probability(chunk.advantages, settings.advantage_scale)
        loss = nft_loss(
            v_theta, v_old, noise - x0, sigma, r,
            beta=settings.beta, adaptive_weighting=settings.adaptive_weighting,
        )  # fmt: skip
        dims = tuple(range(1, x0.ndim))
        kl = torch.zeros_like(loss)
        if v_reference is not None:
            kl = (v_theta - v_reference).square().mean(dims)
        losses = loss, kl, (v_theta.detach() - v_old).square().mean(dims), r
        return losses, _Probe(x, sigma, chunk.condition, v_theta.detach())

    def _old_velocity(self, old, x: Tensor, sigma: Tensor, condition) -> Tensor:
        """v_old, float32: the old policy's conditional velocity, or with nft.guidance=anchor
        its velocity under the rollouts' classifier-free guidance."""
        if self.settings.guidance == "anchor":
            return self.sampler.velocity_fn(old, condition)(x, sigma).float()
        return old.velocity(x, sigma, condition).float()

    def _sample_weight(self, chunks: list) -> float:
        """The factor of a pass's summed loss that makes the update the mean over every kept
        sample of all ranks and its K passes (DDP then averages over ranks); 0 when no rank
        kept a sample."""
        acc = self.policy.acc
        kept = torch.tensor([float(sum(int(c.valid.sum()) for c in chunks))], device=acc.device)
        total = float(acc.reduce(kept, reduction="sum").item())
        return acc.num_processes / (total * self.num_levels) if total else 0.0

    def _means(self, sums: dict, count: float) -> dict:
        """Means of the logged per-pass sums of every rank over their ``count`` terms."""
        acc = self.policy.acc
        zero = torch.zeros((), device=acc.device)
        totals = torch.stack([torch.stack(v).sum() if v else zero for v in sums.values()])
        totals = acc.reduce(totals.float(), reduction="sum")
        return {name: float(total) / count for name, total in zip(sums, totals, strict=True)}


def _chunk_draw_keys(rollouts, by_group: bool) -> list[list[int]]:
    """Per chunk, the key seeding each sample's forward noising (chunks hold consecutive samples
    of the step): its global sample index, or with ``by_group`` its prompt group's id, so that a
    group's samples share noise levels and noise."""
    keys = rollouts.group_ids if by_group else rollouts.global_index
    per_chunk, start = [], 0
    for chunk in rollouts.chunks:
        size = chunk.latents.shape[1]
        per_chunk.append(list(keys[start : start + size]))
        start += size
    return per_chunk
