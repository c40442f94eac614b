"""The RL training loop with VSA2 sparse rollouts (``vsa2-rl train`` / ``train_rl.py``).

One iteration reads top to bottom in :func:`train` (cleanrl style), each phase a method of the
run's state (``_Run``: set-up and resume, rollout, score, update, evaluation, samples and
checkpoints):

1. schedule: the hard-to-easy schedule gives this step's sparsities; rollout and training share
   one value, so routing in the training forward equals routing in the rollout.
2. rollout: this rank's share of ``prompts_per_step`` prompts x ``group_size`` samples, SDE
   sampling (Flow-GRPO, vsa2_rl.sampling) with per-step log-probs, in chunks of
   ``grpo.train_batch_size`` (the training forward uses the same chunks, so the first ratio is 1);
   the SDE window is fixed or drawn per step, and with one noise per group the steps before it
   run once per group.
3. rewards: decode latents to videos, score them (vsa2_rl.rewards mixer), gather across ranks
   and normalise per prompt group (GRPO advantages, vsa2_rl.rl.scoring).
4. update: for each chunk and each trained timestep, recompute the transition log-prob under
   the current policy, PPO-clip loss (+ KL to the reference), backward, every sample weighing
   the same whatever the chunking; one optimizer step per inner epoch, skipped (weights
   untouched) if the loss or the gradient is not finite.
5. bookkeeping: metrics.jsonl, trackers, sample videos, atomic checkpoints.

That is Flow-GRPO (``grpo.algorithm=flow_grpo``). With ``grpo.algorithm=nft`` (DiffusionNFT,
vsa2_rl.rl.nft) the old policy samples the rollouts (any ``sampler.kind``, ``ode`` included),
scoring is the same, and the update is :class:`vsa2_rl.rl.nft.NFTUpdate`'s flow-matching loss on
forward-noised rollouts, followed by the old policy's soft update.

Distributed runs use accelerate (DDP, DeepSpeed ZeRO or FSDP2 from ``configs/accelerate/``); every
random draw is a pure function of (seed, step, global sample index), so a resumed run repeats an
uninterrupted one exactly.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import torch
import yaml
from tqdm.auto import tqdm

from vsa2_rl.config import ConfigError, RunConfig, check_resume, config_tree, to_yaml
from vsa2_rl.eval.sweep import GUARD_PREFIX, reward_fns, sweep_model
from vsa2_rl.models.conditioning import encode_condition, final_latents
from vsa2_rl.models.experts import frozen_copy, trains_level
from vsa2_rl.rewards import RewardMixer, RewardSkip
from vsa2_rl.rewards.mixing import RewardOutput
from vsa2_rl.rl import engines
from vsa2_rl.rl.grpo import (
    GroupedPromptSampler,
    gaussian_kl,
    grpo_loss,
)
from vsa2_rl.rl.nft import NFTUpdate
from vsa2_rl.rl.run_folder import RunFolder
from vsa2_rl.rl.scoring import step_advantages
from vsa2_rl.rl.tracking import MetricsLogger, plot_reward_curve, read_metrics
from vsa2_rl.runtime import (
    build_bundle,
    check_condition_images,
    check_output_dir,
    image_scheme,
    load_prompt_records,
    load_trained_state,
    prompt_file_key,
    resolve_device,
    resolve_dtype,
    resolve_reward_device,
    trainable_parameters,
)
from vsa2_rl.sampling import cfg_velocity, sample, seeded_noise, sigma_schedule, step_log_prob


class RolloutDiverged(RuntimeError):
    """The rollouts' videos hold NaN or inf: the model (or the sampler) diverged."""


@dataclass
class Rollout:
    """One chunk of rollouts on this rank (all tensors on the training device)."""

    condition: Any  # what the model is conditioned on: text [b, L, D_text] (+ image)
    latents: torch.Tensor  # [N + 1, b, C, T, H, W] float32
    log_probs: torch.Tensor  # [N, b] float32
    advantages: torch.Tensor | None = None  # [b]
    kl_penalty: torch.Tensor | None = None  # [b], grpo.kl_mode=reward: sum_j log p - log p_ref
    valid: torch.Tensor | None = None  # bool [b]: False where rewards.on_error dropped the sample


# grpo_loss's statistics as logged (per-sample means over an update); ratio_max_dev is logged
# as train/ratio_dev_first, from the first pass only
LOGGED_STATS = {
    "clip_frac": "train/clip_frac",
    "ratio_mean": "train/ratio_mean",
    "approx_kl": "train/approx_kl",
}


def _sample_seed(seed: int, step: int, index: int) -> int:
    """A seed per (run seed, step, global sample index): independent of rank count and resume."""
    return (seed * 1_000_003 + step * 10_007 + index) % (2**63 - 1)


def initial_noise(
    config: RunConfig, step: int, latent_shape: tuple, global_index: list[int]
) -> torch.Tensor:
    """The rollouts' starting latents: one seed per sample, or per group with
    ``sampler.same_noise_per_group`` (then every sample of a group starts from its group's
    noise; samples are laid out group after group, see ``GroupedPromptSampler``)."""
    if config.sampler.same_noise_per_group:
        group = config.grpo.group_size
        global_index = [i // group * group for i in global_index]
    return seeded_noise(latent_shape, [_sample_seed(config.seed, step, i) for i in global_index])


def _group_prefix(condition_of, velocity_fn, noise, group_ids, sigmas, batch_size):
    """The ODE steps ``sigmas`` (the ones before the SDE window) run once per group on one
    sample of it (all of a group's samples share their noise), expanded to every sample.

    Returns ``(latents [len(sigmas), n, ...], number of groups)``.
    """
    first = {}
    for index, group in enumerate(group_ids):
        first.setdefault(group, index)
    leaders = list(first.values())
    parts = []
    for chunk in _chunks(len(leaders), batch_size):
        rows = leaders[chunk]
        trajectory = sample(
            velocity_fn(condition_of(rows)), noise[rows], sigmas, kind="ode", noise_level=0.0
        )
        parts.append(trajectory.latents)
    shared = torch.cat(parts, dim=1)
    of_group = {group: slot for slot, group in enumerate(first)}
    index = torch.tensor([of_group[group] for group in group_ids], device=shared.device)
    return shared[:, index], len(leaders)


def _update_plan(acc, chunks: list, timesteps: list[int], kl_beta: float) -> tuple[list, float]:
    """The (chunk, timestep, counted) backward passes of one update and the weight of a sample.

    The update is the mean over every sample of the step (all ranks) and every trained
    timestep, as one batch would give it, however ``grpo.train_batch_size`` cuts the samples:
    a pass's loss is its chunk's mean times the chunk's size times the returned weight
    ``num_processes / (samples of all ranks * timesteps)`` (DDP then averages over ranks). A
    chunk whose advantages are all zero adds nothing unless a KL term is trained, so it is not
    counted; with several processes it still runs, with weight 0, since every rank must run
    the same number of backward passes (DDP all-reduces in the last one and DeepSpeed reduces
    in each). Empty when no sample of any rank has a non-zero advantage: the step teaches
    nothing and the weights stay as they are.
    """
    useful = [bool(chunk.advantages.abs().sum() > 0) for chunk in chunks]
    samples = sum(chunk.advantages.numel() for chunk in chunks)
    local = torch.tensor([float(any(useful)), float(samples)], device=acc.device)
    any_useful, all_samples = acc.reduce(local, reduction="sum").tolist()
    if any_useful == 0:
        return [], 0.0
    counted = [flag or kl_beta > 0 for flag in useful]
    keep_all = acc.num_processes > 1
    work = [
        (chunk, j, flag)
        for chunk, flag in zip(chunks, counted, strict=True)
        for j in timesteps
        if flag or keep_all
    ]
    return work, acc.num_processes / (all_samples * len(timesteps))


def _update_metrics(acc, device, sums: dict, count: float, ratio_dev_first) -> dict:
    """Per-sample means of the update's loss statistics over every rank (``sums`` hold this
    rank's sums over samples and timesteps, ``count`` is the number of both of all ranks)."""
    totals = torch.stack(
        [
            torch.stack(values).float().sum() if values else torch.zeros((), device=device)
            for values in sums.values()
        ]
    )
    totals = acc.reduce(totals, reduction="sum")
    ratio = acc.gather(torch.tensor([ratio_dev_first or 0.0], device=device))
    count = max(count, 1.0)
    means = {name: float(total) / count for name, total in zip(sums, totals, strict=True)}
    return {**means, "train/ratio_dev_first": float(ratio.max())}


def _chunks(n: int, size: int) -> list[slice]:
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


def _trained_with(restored: dict, checkpoint) -> dict:
    """The config tree a checkpoint was trained with: its own record, or (checkpoints written
    before it had one) the config.yaml of the run folder that holds it."""
    if "config" in restored:
        return restored["config"]
    run_config = os.path.join(os.path.dirname(os.path.dirname(str(checkpoint))), "config.yaml")
    if not os.path.isfile(run_config):
        raise ConfigError(
            f"train.resume: {checkpoint} records no config and its run folder has no "
            "config.yaml, so what it was trained with cannot be checked; resume it from its "
            "run folder"
        )
    with open(run_config, encoding="utf-8") as handle:
        return yaml.safe_load(handle)


def _refuse_abandoned_run(config: RunConfig) -> None:
    """A fresh run (``train.resume=none``) must not share its folder with an earlier run: a later
    ``resume=auto`` would continue from the abandoned run's checkpoints and metrics."""
    held = [
        name
        for name in ("checkpoints", "metrics.jsonl")
        if os.path.exists(os.path.join(config.out_dir, name))
        and (name != "checkpoints" or os.listdir(os.path.join(config.out_dir, name)))
    ]
    if config.train.resume == "none" and held:
        raise ConfigError(
            f"out_dir: {config.out_dir} holds a run ({' and '.join(held)}); use "
            "train.resume=auto to continue it, or a new out_dir for a fresh run"
        )


class _Setup:
    """Everything the loop needs, built before any file of the run is written (``folder`` is
    locked first, so that no other run writes there meanwhile)."""

    def __init__(self, config: RunConfig, folder: RunFolder):
        from accelerate import Accelerator

        check_output_dir(config.out_dir)
        self.config = config
        self.accelerator = Accelerator(
            cpu=resolve_device(config.device).type == "cpu", kwargs_handlers=_ddp_options(config)
        )
        engines.check_options(self.accelerator, config)
        folder.claim(self.accelerator)
        _refuse_abandoned_run(config)  # under the lock: no other run adds to the folder
        self.device = self.accelerator.device
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        records = load_prompt_records(config, "train")
        self.prompts, self.images = [r.text for r in records], [r.image for r in records]
        records = config.eval.select_prompts(load_prompt_records(config, "eval"))
        self.eval_prompts, self.eval_images = [r.text for r in records], [r.image for r in records]
        scheme = image_scheme(config)  # before any weight loads
        check_condition_images(scheme, self.images, prompt_file_key(config, "train"))
        check_condition_images(scheme, self.eval_images, prompt_file_key(config, "eval"))
        self.sequence_parallel = _sequence_parallel_group(self.accelerator, config)
        sp_size = config.parallel.sequence_parallel_size
        # data-parallel ranks: sequence-parallel groups share their samples
        self.dp_world = self.accelerator.num_processes // sp_size
        self.dp_rank = self.accelerator.process_index // sp_size
        world = self.dp_world
        if config.grpo.prompts_per_step > len(self.prompts):
            raise ConfigError(
                f"grpo.prompts_per_step: {config.grpo.prompts_per_step} exceeds the "
                f"{len(self.prompts)} prompts of the prompt set; lower it or add prompts"
            )
        if (config.grpo.prompts_per_step * config.grpo.group_size) % world:
            raise ConfigError(
                f"grpo.prompts_per_step * grpo.group_size must be divisible by the number of "
                f"data-parallel ranks ({world}: processes / parallel.sequence_parallel_size)"
            )
        try:
            self.rewards = RewardMixer.from_config(config.rewards)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        self.reward_device = resolve_reward_device(config, self.device)
        self.guards = reward_fns(config.eval.guard_rewards, "eval.guard_rewards", GUARD_PREFIX)
        with engines.whole_model_loading(self.accelerator):
            self.bundle = build_bundle(config, self.device, self.dtype)
        if self.sequence_parallel is not None:
            from vsa2_rl.models.wan import enable_sequence_parallel

            try:
                enable_sequence_parallel(self.bundle.transformer, self.sequence_parallel)
            except ValueError as error:
                raise ConfigError(f"parallel.sequence_parallel_size: {error}") from None


def _ddp_options(config: RunConfig) -> list:
    """DDP's settings: a Wan2.2 A14B run that trains both experts leaves one of them without
    gradients in every Flow-GRPO backward (a chunk's transition is one noise level), which DDP
    must be told to expect."""
    from accelerate.utils import DistributedDataParallelKwargs

    if config.model.kind != "wan" or len(config.model.train_experts) == 1:
        return []
    from vsa2_rl.models.wan_bundle import read_wan_variant

    if read_wan_variant(config.model.path).boundary_ratio is None:
        return []
    return [DistributedDataParallelKwargs(find_unused_parameters=True)]


def _check_trained_window(model, sigmas: torch.Tensor, samp) -> None:
    """Refuses an SDE window none of whose steps a trained expert denoises (Wan2.2 A14B with
    one expert in ``model.train_experts``): Flow-GRPO would have no transition to train."""
    if samp.sde_window_size is not None:
        steps = range(*(samp.sde_window_range or [0, samp.num_steps]))
    else:
        steps = range(*(samp.sde_window or [0, samp.num_steps]))
    if not any(trains_level(model, float(sigmas[j])) for j in steps):
        levels = [round(float(sigmas[j]), 3) for j in steps]
        raise ConfigError(
            f"sampler.sde_window: its steps' noise levels {levels} all belong to an expert "
            "model.train_experts leaves frozen; move the window (or sampler.sde_window_range) "
            "to the trained expert's steps"
        )


def _sequence_parallel_group(acc, config: RunConfig):
    """This rank's :class:`SequenceParallel` group (consecutive ranks), or None when off."""
    size = config.parallel.sequence_parallel_size
    if size == 1:
        return None
    key = "parallel.sequence_parallel_size"
    if acc.num_processes % size:
        raise ConfigError(
            f"{key}: {size} must divide the number of processes ({acc.num_processes})"
        )
    if engines.uses_deepspeed(acc):
        raise ConfigError(f"{key}: sequence parallelism runs under DDP or FSDP2, not DeepSpeed")
    if not config.attention.enabled:
        raise ConfigError(f"{key}: sequence parallelism runs through VSA2 (attention.enabled)")
    import torch.distributed as dist

    from vsa2_rl.parallel import SequenceParallel

    groups = [
        dist.new_group(list(range(start, start + size)))  # every rank creates every group
        for start in range(0, acc.num_processes, size)
    ]
    return SequenceParallel(groups[acc.process_index // size])


def _reference_policy(bundle, acc, config: RunConfig):
    """A context manager under which ``bundle`` computes the frozen reference policy's velocity:
    LoRA adapters disabled (peft) or, for full fine-tuning, a frozen copy of the start weights."""
    if config.model.lora.enabled:
        model = acc.unwrap_model(bundle.transformer)

        @contextlib.contextmanager
        def lora_disabled():
            model.disable_adapters()
            try:
                yield
            finally:
                model.enable_adapters()

        return lora_disabled
    frozen = frozen_copy(acc.unwrap_model(bundle.transformer))

    @contextlib.contextmanager
    def frozen_weights():
        live, bundle.transformer = bundle.transformer, frozen
        try:
            yield
        finally:
            bundle.transformer = live

    return frozen_weights


def _evaluate(setup: _Setup, sparsity: float, ema, step: int, logger: MetricsLogger) -> dict:
    """ODE rewards on the fixed evaluation prompts at ``sparsity`` (EMA weights if kept), run on
    the unwrapped model of this process (no collectives but ZeRO-3's weight gathers), as
    ``eval/*`` metrics; the main process also writes the first videos as
    ``samples/eval_step_<step>.{png,gif,mp4}`` and hands them to the trackers, each with its
    prompt and rewards as caption."""
    config, bundle, acc = setup.config, setup.bundle, setup.accelerator
    live = bundle.transformer
    bundle.transformer = acc.unwrap_model(live)
    try:
        with ema.swapped() if ema is not None else contextlib.nullcontext():
            (row,), previews = sweep_model(
                bundle,
                setup.eval_prompts,
                [sparsity],
                [*setup.rewards.rewards.values(), *setup.guards],
                num_steps=config.sampler.eval_num_steps,
                shift=config.sampler.shift,
                guidance_scale=config.eval_guidance_scale,
                negative_prompt=config.sampler.negative_prompt,
                seed=config.eval.seed,
                batch_size=config.grpo.train_batch_size,
                shape=(config.model.num_frames, config.model.height, config.model.width),
                progress=False,
                reward_device=setup.reward_device,
                images=setup.eval_images,
            )
    finally:
        bundle.transformer = live
    if acc.is_main_process:
        from vsa2_rl.eval.media import condition_images_of, save_video_grid

        preview = previews[sparsity]
        prompts = setup.eval_prompts[: len(preview.videos)]
        images = condition_images_of(setup.eval_images[: len(prompts)], preview.videos.shape[-2:])
        prefix = os.path.join(config.out_dir, "samples", f"eval_step_{step}")
        png, gif = save_video_grid(preview.videos, prefix, titles=prompts, condition_images=images)
        captions = [
            f"{prompt} | " + ", ".join(f"{name} {value:.3f}" for name, value in scores.items())
            for prompt, scores in zip(prompts, preview.scores, strict=True)
        ]
        logger.log_videos(step, "eval/videos", gif, png, captions)
    total = sum(w * row[f"reward/{name}"] for name, w in setup.rewards.weights.items())
    metrics = {"eval/reward": total, "eval/density": row["density"]}
    for key, value in row.items():  # reward/<name> -> eval/reward/<name>, guards eval/guard/<name>
        if key.startswith("reward/" + GUARD_PREFIX):
            metrics["eval/" + key[len("reward/") :]] = value
        elif key.startswith("reward/"):
            metrics[f"eval/{key}"] = value
    return metrics


@dataclass
class StepRollouts:
    """What one step's rollout phase hands to scoring and the update (this rank's samples)."""

    prompt_indices: list[int]
    group_ids: list[int]
    prompts: list[str]
    global_index: list[int]  # each sample's index in the step's global batch
    chunks: list[Rollout]
    videos: torch.Tensor  # [n, T, C, H, W] float32, decoded
    stochastic: torch.Tensor  # bool [N]: the steps that drew noise (and may be trained)
    pending: list  # rewards.async_scoring: each chunk's future RewardOutput, in order


class _Run:
    """One training run's state, set up before anything is written, and the phases of an
    iteration (:meth:`rollout`, :meth:`score`, :meth:`update`, :meth:`checkpoint_if_due`) that
    :func:`train` strings together."""

    def __init__(self, config: RunConfig, folder: RunFolder):
        from vsa2_rl.models.wan import compile_blocks
        from vsa2_rl.rl.ema import EMA
        from vsa2_rl.rl.schedule import SparsitySchedule

        self.config = config
        self.setup = setup = _Setup(config, folder)  # all validation and loading
        self.acc, self.bundle, self.device = setup.accelerator, setup.bundle, setup.device
        self.is_main = self.acc.is_main_process
        transformer = self.bundle.transformer
        if config.model.gradient_checkpointing:
            transformer.enable_gradient_checkpointing()
        self.params = trainable_parameters(transformer, config)
        if config.model.compile_blocks:  # after LoRA adapters are in place; compiles on first use
            compile_blocks(transformer)
        optimizer = torch.optim.AdamW(
            self.params, lr=config.train.learning_rate, weight_decay=config.train.weight_decay
        )
        warmup = config.train.warmup_steps
        self.lr_schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
        )
        # shapes are read from the bare model: a DDP/DeepSpeed wrapper hides its config
        self.video_size = (config.model.num_frames, config.model.height, config.model.width)
        self.latent_shape = self.bundle.latent_shape(*self.video_size)
        engines.configure(self.acc, config)
        self.transformer, self.optimizer = self.acc.prepare(transformer, optimizer)
        # FSDP2 replaces every parameter by its shard: clipping and the finite check need those
        self.params = [p for p in self.transformer.parameters() if p.requires_grad]
        self.bundle.transformer = self.transformer
        self.reference = (
            _reference_policy(self.bundle, self.acc, config) if config.grpo.kl_beta > 0 else None
        )
        self.ema = (
            EMA(self.acc.unwrap_model(self.transformer), decay=config.train.ema_decay)
            if config.train.ema_decay > 0
            else None
        )
        self.schedule = SparsitySchedule.from_config(config.sparsity, config.train.num_steps)
        self.sampler = GroupedPromptSampler(
            len(setup.prompts),
            config.grpo.group_size,
            config.grpo.prompts_per_step,
            num_replicas=setup.dp_world,
            rank=setup.dp_rank,
            seed=config.seed,
        )
        self.sigmas = sigma_schedule(config.sampler.num_steps, config.sampler.shift)
        if config.grpo.algorithm == "flow_grpo":
            _check_trained_window(self.transformer, self.sigmas, config.sampler)
        samp = config.sampler
        self.uncond = (
            self.bundle.encode_prompts([samp.negative_prompt]) if samp.guidance_scale > 1 else None
        )
        self.checkpoints = os.path.join(config.out_dir, "checkpoints")
        # evaluation runs on the main process alone, except under ZeRO-3 and FSDP2: there the
        # forward gathers sharded weights, a collective every rank must join (the logger writes
        # on the main only)
        # and under sequence parallelism, where the main process's group computes together
        self.evaluates = (
            self.is_main
            or engines.shards_parameters(self.acc)
            or (setup.sequence_parallel is not None and setup.dp_rank == 0)
        )
        self.kl_in_reward = self.reference is not None and config.grpo.kl_mode == "reward"
        # rewards.async_scoring: one background thread scores the chunks in their order
        self.scoring = (
            futures.ThreadPoolExecutor(1, thread_name_prefix="rewards")
            if config.rewards.async_scoring
            else None
        )
        self.logger: MetricsLogger | None = None
        self.nft = NFTUpdate(self) if config.grpo.algorithm == "nft" else None

    def sampling_policy(self):
        """The policy the rollouts come from: DiffusionNFT's old policy, or (Flow-GRPO) the
        current one."""
        return self.nft.old.active() if self.nft is not None else contextlib.nullcontext()

    def velocity_fn(self, condition):
        """The sampler's velocity for samples conditioned on ``condition`` (with the
        sampler's classifier-free guidance)."""
        samp = self.config.sampler
        return cfg_velocity(self.bundle.velocity, condition, self.uncond, samp.guidance_scale)

    def condition(self, prompt_indices: list[int]):
        """What the model is conditioned on for these training prompts (text, and the
        condition image of an image-to-video prompt)."""
        prompts = [self.setup.prompts[i] for i in prompt_indices]
        images = [self.setup.images[i] for i in prompt_indices]
        return encode_condition(self.bundle, prompts, images, self.video_size)

    # ---- set-up and resume -----------------------------------------------------------------

    def resume(self) -> int:
        """Restores the checkpoint ``train.resume`` names (after checking it and its config),
        writes config.yaml, opens the logger; returns the step to continue after."""
        from vsa2_rl.rl.checkpoint import find_latest, load_checkpoint

        config, acc = self.config, self.acc
        resume_from, start_step = None, 0
        try:  # a damaged checkpoint is skipped (find_latest warns) or named in one error line
            if config.train.resume == "auto":
                resume_from = find_latest(self.checkpoints)
            elif config.train.resume != "none":
                resume_from = config.train.resume
            restored = load_checkpoint(resume_from) if resume_from else None
        except ValueError as error:
            raise ConfigError(f"train.resume: {error}") from None
        if resume_from:
            check_resume(_trained_with(restored, resume_from), config, str(resume_from))
            if engines.shards_optimizer_state(acc):  # weight and optimizer shards, the engine's
                engines.load_engine_state(acc, resume_from)
            elif "optimizer" not in restored:
                raise ConfigError(
                    f"train.resume: {resume_from} was written by a DeepSpeed or FSDP2 run (its "
                    "optimizer state is in the engine's shards); resume it with the same launcher"
                )
            else:
                model = acc.unwrap_model(self.transformer)
                load_trained_state(model, restored["model"], config, str(resume_from))
                self.optimizer.load_state_dict(restored["optimizer"])
            self.lr_schedule.load_state_dict(restored["lr_schedule"])
            self.schedule.load_state_dict(restored["schedule"])  # a longer run keeps its curriculum
            if self.ema is not None:
                self.ema.load_state_dict(restored["ema"])
            if self.nft is not None:
                self.nft.old.load_state_dict(restored["old_policy"])
            start_step = int(restored["step"])
        if self.is_main:
            os.makedirs(config.out_dir, exist_ok=True)
            with open(os.path.join(config.out_dir, "config.yaml"), "w", encoding="utf-8") as f:
                f.write(to_yaml(config))
        self.logger = MetricsLogger(config, resume_step=start_step, enabled=self.is_main)
        if resume_from and self.is_main:
            print(f"resumed from {resume_from} at step {start_step}")
        return start_step

    # ---- rollout ---------------------------------------------------------------------------

    def rollout(self, step: int, metrics: dict) -> StepRollouts:
        """This rank's SDE rollouts of the step (at the sparsity the caller set), in chunks of
        ``grpo.train_batch_size`` (the update uses the same chunks, so its first ratio is 1)."""
        config, samp, grpo, device = self.config, self.config.sampler, self.config.grpo, self.device
        t0 = time.perf_counter()
        batch = self.sampler.batch(step - 1)
        prompts = [self.setup.prompts[i] for i in batch.prompt_indices]
        offset = self.setup.dp_rank * self.sampler.samples_per_rank
        global_index = [offset + i for i in range(len(prompts))]
        noise = initial_noise(config, step, self.latent_shape, global_index).to(device)
        generators = [  # per-sample SDE noise: the same whatever the number of ranks
            torch.Generator(device=device).manual_seed(_sample_seed(config.seed + 1, step, i))
            for i in global_index
        ]
        state = self.bundle.sparsity_state
        self.transformer.eval()
        window = samp.window_at(config.seed, step)
        # with one noise per group the steps before the window are the same for the whole
        # group: they run once per group, which branches at the window (Flow-GRPO-Fast)
        start = window[0] if window and samp.same_noise_per_group else 0
        sigmas = self.sigmas
        prefix, evaluations = None, len(prompts) * (len(sigmas) - 1 - start)
        if start:
            with torch.no_grad():
                prefix, groups = _group_prefix(
                    lambda rows: self.condition([batch.prompt_indices[i] for i in rows]),
                    self.velocity_fn, noise, batch.group_ids, sigmas[: start + 1],
                    grpo.train_batch_size,
                )  # fmt: skip
            evaluations += groups * start
        chunks, videos, pending = [], [], []
        metadata = self._reward_metadata(step, batch.prompt_indices, global_index)
        for part in _chunks(len(prompts), grpo.train_batch_size):
            with torch.no_grad():
                condition = self.condition(batch.prompt_indices[part])
                trajectory = sample(
                    self.velocity_fn(condition),
                    noise[part] if prefix is None else prefix[-1, part],
                    sigmas[start:],
                    kind=samp.kind,
                    noise_level=samp.noise_level,
                    sde_window=(window[0] - start, window[1] - start) if window else None,
                    generator=generators[part],
                )
                videos.append(self.bundle.decode(final_latents(condition, trajectory.latents[-1])))
            if self.scoring is not None:  # scored while the next chunks are sampled
                chunk_videos = videos[-1].float().to(self.setup.reward_device)
                pending.append(self.scoring.submit(
                    self.setup.rewards, chunk_videos, prompts[part], metadata[part]
                ))  # fmt: skip
            latents, log_probs = trajectory.latents, trajectory.log_probs
            if prefix is not None:  # the shared steps: deterministic, log-prob 0
                latents = torch.cat([prefix[:-1, part], latents])
                log_probs = torch.cat([log_probs.new_zeros(start, log_probs.shape[1]), log_probs])
            chunks.append(Rollout(condition, latents, log_probs))
        stochastic = torch.cat([torch.zeros(start, dtype=torch.bool), trajectory.stochastic])
        if self.kl_in_reward:
            for chunk in chunks:
                chunk.kl_penalty = self._kl_penalty(chunk, stochastic)
        self._refuse_nonfinite_videos(step, videos, global_index)
        total = self.acc.reduce(torch.tensor([float(evaluations)], device=device), reduction="sum")
        metrics["perf/rollout_evals"] = float(total.item())
        density = state.pop_density()
        metrics["attn/density"] = density if density is not None else 1.0
        metrics["perf/rollout_s"] = time.perf_counter() - t0
        return StepRollouts(
            batch.prompt_indices, batch.group_ids, prompts, global_index, chunks,
            torch.cat(videos).float(), stochastic, pending,
        )  # fmt: skip

    def _refuse_nonfinite_videos(self, step: int, videos: list, global_index: list) -> None:
        """Stops every rank, naming the samples, when any rank's videos hold NaN or inf (before
        a reward would fail on them with a message about its input)."""
        finite = torch.cat([torch.isfinite(v.flatten(1)).all(dim=1) for v in videos])
        bad = [global_index[i] for i in (~finite).nonzero().flatten().tolist()]
        count = self.acc.gather(torch.tensor([float(len(bad))], device=self.device)).sum()
        if count > 0:
            raise RolloutDiverged(
                f"step {step}: {int(count.item())} rollout video(s) hold NaN or inf (samples "
                f"{bad or 'on other ranks'}): the model or the sampler diverged; resume from the "
                "last checkpoint with a lower train.learning_rate or sampler.noise_level"
            )

    # ---- rewards and advantages ------------------------------------------------------------

    def _reward_metadata(self, step: int, prompt_indices: list, global_index: list) -> list:
        """Per sample: its prompt, step and noise seed, and its condition image's path."""
        seed, images = self.config.seed, self.setup.images
        return [
            {
                "prompt_index": p,
                "step": step,
                "sample_seed": _sample_seed(seed, step, i),
                **({"image": images[p]} if images[p] else {}),
            }
            for p, i in zip(prompt_indices, global_index, strict=True)
        ]

    def _scored(self, step: int, rollouts: StepRollouts) -> RewardOutput:
        """The step's rewards: the chunks' background scores (``rewards.async_scoring``), all
        awaited before the first failure is raised, or the whole batch scored now."""
        if not rollouts.pending:
            metadata = self._reward_metadata(step, rollouts.prompt_indices, rollouts.global_index)
            videos = rollouts.videos.to(self.setup.reward_device)
            return self.setup.rewards(videos, rollouts.prompts, metadata)
        futures.wait(rollouts.pending)
        for pending in rollouts.pending:
            if pending.exception() is not None:
                raise pending.exception()
        return RewardOutput.concat([pending.result() for pending in rollouts.pending])

    def score(self, step: int, rollouts: StepRollouts, metrics: dict) -> bool:
        """Rewards and group advantages (set on the chunks); False when a reward asked to skip
        the step on any rank (every rank skips together; the weights stay untouched)."""
        config, acc, device, grpo = self.config, self.acc, self.device, self.config.grpo
        try:
            scored, skip_reason = self._scored(step, rollouts), ""
        except RewardSkip as error:
            scored, skip_reason = None, str(error)
        skip = torch.tensor([float(scored is None)], device=device)
        if acc.gather(skip).sum() > 0:
            if self.is_main:
                reason = skip_reason or "a reward failed on another rank"
                tqdm.write(f"step {step}: skipped ({reason})")
            return False
        penalty = None
        if self.kl_in_reward:
            penalty = torch.cat([chunk.kl_penalty for chunk in rollouts.chunks])
        group_ids = torch.tensor(rollouts.group_ids, device=device)
        advantages = step_advantages(
            acc, grpo, config.rewards.aggregation, self.setup.rewards, scored, group_ids,
            penalty, metrics,
        )  # fmt: skip
        parts = _chunks(len(rollouts.prompts), grpo.train_batch_size)
        for chunk, part in zip(rollouts.chunks, parts, strict=True):
            chunk.advantages = advantages[part]
            chunk.valid = scored.valid[part].to(device)
        return True

    # ---- policy update ---------------------------------------------------------------------

    def advance_lr_schedule(self) -> None:
        """One RL step of the learning-rate schedule. It counts RL steps, including those that
        updated nothing (every group without reward variance, or a skipped update), so PyTorch's
        warning about a scheduler step before any optimizer step does not apply."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)`")
            self.lr_schedule.step()

    def update(self, step: int, rollouts: StepRollouts, metrics: dict) -> None:
        """``grpo.num_inner_epochs`` optimizer steps (at the sparsity the caller set) over a
        random ``grpo.timestep_fraction`` of the stochastic steps; a non-finite loss or gradient
        skips the step (weights untouched). DiffusionNFT's update is :meth:`NFTUpdate.update`."""
        if self.nft is not None:
            self.nft.update(step, rollouts, metrics)
            return
        config, grpo, acc = self.config, self.config.grpo, self.acc
        t0 = time.perf_counter()
        state = self.bundle.sparsity_state
        self.transformer.train()
        trainable_steps = [  # the stochastic steps whose expert trains
            j
            for j in torch.nonzero(rollouts.stochastic).flatten().tolist()
            if trains_level(self.transformer, float(self.sigmas[j]))
        ]
        step_gen = torch.Generator().manual_seed(_sample_seed(config.seed + 2, step, 0))
        num_train = max(1, round(grpo.timestep_fraction * len(trainable_steps)))
        sums = {name: [] for name in ("loss/policy", "loss/kl", *LOGGED_STATS.values())}
        first_ratio_dev, grad_norms, count, skipped = [], [], 0.0, 0
        for _epoch in range(grpo.num_inner_epochs):
            order = torch.randperm(len(trainable_steps), generator=step_gen)[:num_train]
            timesteps = sorted(trainable_steps[i] for i in order.tolist())
            kl_loss_beta = 0.0 if self.kl_in_reward else grpo.kl_beta
            work, weight = _update_plan(acc, rollouts.chunks, timesteps, kl_loss_beta)
            if not work:
                continue  # no rank has a sample with a non-zero advantage
            count += acc.num_processes / weight
            self.optimizer.zero_grad(set_to_none=True)
            for index, (chunk, j, counted) in enumerate(work):
                last = index == len(work) - 1
                with engines.accumulation_context(acc, self.transformer, last):
                    loss, kl, stats = self._pass_losses(chunk, j)
                    size = chunk.latents.shape[1]  # the chunk's means, as sums over its samples
                    total = (loss + grpo.kl_beta * kl) * size * (weight if counted else 0.0)
                    engines.backward(acc, total, last)
                if counted:
                    if not first_ratio_dev:
                        first_ratio_dev.append(stats["ratio_max_dev"].item())
                    sums["loss/policy"].append(loss.detach() * size)
                    sums["loss/kl"].append(kl.detach() * size)
                    for stat, name in LOGGED_STATS.items():
                        sums[name].append(stats[stat] * size)
            stepped, grad_norm = engines.finish_update(
                acc, self.optimizer, self.params, config.train.max_grad_norm, sums["loss/policy"]
            )
            if stepped:
                if self.ema is not None:
                    self.ema.update()
            else:
                skipped += 1  # a NaN/inf never reaches the weights
            self.optimizer.zero_grad(set_to_none=True)
            grad_norms.append(grad_norm)
        self.advance_lr_schedule()
        state.pop_density()
        metrics["perf/train_s"] = time.perf_counter() - t0
        self._log_update(metrics, rollouts, sums, count, first_ratio_dev, grad_norms, skipped)

    def _pass_losses(self, chunk: Rollout, j: int) -> tuple:
        """One chunk's policy loss, KL to the reference (0 without one) and loss statistics at
        the stored transition j -> j + 1, under the current policy."""
        samp, sigmas, device = self.config.sampler, self.sigmas, self.device
        grpo = self.config.grpo
        x, x_next = chunk.latents[j], chunk.latents[j + 1]
        sigma = torch.full((x.shape[0],), float(sigmas[j]), device=device)
        transition = (x, x_next, float(sigmas[j]), float(sigmas[j + 1]), samp.kind)
        v = self.velocity_fn(chunk.condition)(x, sigma)
        log_prob, mean, std = step_log_prob(v, *transition, samp.noise_level)
        loss, stats = grpo_loss(
            log_prob,
            chunk.log_probs[j],
            chunk.advantages,
            clip_range=grpo.clip_bounds[0],
            clip_range_high=grpo.clip_bounds[1],
            loss_type=grpo.loss_type,
        )
        kl = torch.zeros((), device=device)
        if self.reference is not None and not self.kl_in_reward:
            with torch.no_grad(), self.reference():
                ref_v = self.velocity_fn(chunk.condition)(x, sigma)
            ref_mean = step_log_prob(ref_v, *transition, samp.noise_level)[1]
            kl = gaussian_kl(mean, ref_mean, std).mean()
        return loss, kl, stats

    def _kl_penalty(self, chunk: Rollout, stochastic: torch.Tensor) -> torch.Tensor:
        """Per sample, sum over the stochastic steps of log p - log p_ref of the transition the
        rollout drew (an unbiased estimate of the trajectory's KL to the reference), at the
        rollout's sparsity."""
        samp, sigmas = self.config.sampler, self.sigmas
        penalty = torch.zeros(chunk.latents.shape[1], device=self.device)
        with torch.no_grad(), self.reference():
            for j in torch.nonzero(stochastic).flatten().tolist():
                x, x_next = chunk.latents[j], chunk.latents[j + 1]
                sigma = torch.full((x.shape[0],), float(sigmas[j]), device=self.device)
                ref_v = self.velocity_fn(chunk.condition)(x, sigma)
                ref_log_prob = step_log_prob(
                    ref_v, x, x_next, float(sigmas[j]), float(sigmas[j + 1]), samp.kind,
                    samp.noise_level,
                )[0]  # fmt: skip
                penalty += chunk.log_probs[j] - ref_log_prob
        return penalty

    def _log_update(self, metrics, rollouts, sums, count, first_ratio_dev, grad_norms, skipped):
        ratio_dev = first_ratio_dev[0] if first_ratio_dev else None
        metrics.update(_update_metrics(self.acc, self.device, sums, count, ratio_dev))
        self.log_optimizer_steps(metrics, rollouts, grad_norms, skipped)

    def log_optimizer_steps(self, metrics, rollouts, grad_norms, skipped) -> None:
        """The update's peak memory, throughput, last gradient norm, learning rate and skipped
        optimizer steps (either algorithm)."""
        acc, device = self.acc, self.device
        if device.type == "cuda":  # the largest per-GPU peak of the iteration over the ranks
            peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30], device=device)
            metrics["perf/peak_mem_gib"] = acc.gather(peak).max().item()
            torch.cuda.reset_peak_memory_stats(device)
        seconds = metrics["perf/rollout_s"] + metrics["perf/train_s"]
        metrics["perf/videos_per_s"] = len(rollouts.prompts) * self.setup.dp_world / seconds
        metrics["train/grad_norm"] = grad_norms[-1] if grad_norms else 0.0
        metrics["train/lr"] = self.lr_schedule.get_last_lr()[0]
        metrics["train/skipped_nonfinite"] = skipped

    # ---- evaluation, samples, checkpoints --------------------------------------------------

    def evaluation_due(self, step: int) -> bool:
        every = self.config.eval.every
        last = step == self.config.train.num_steps
        return bool(every) and self.evaluates and (step == 0 or step % every == 0 or last)

    def evaluate(self, step: int, sparsity: float) -> dict:
        return _evaluate(self.setup, sparsity, self.ema, step, self.logger)

    def save_samples(self, step: int, rollouts: StepRollouts) -> None:
        """One group's rollouts as ``samples/step_<step>`` every ``train.sample_every`` steps."""
        every, group = self.config.train.sample_every, self.config.grpo.group_size
        if not (self.is_main and every and step % every == 0):
            return
        from vsa2_rl.eval.media import condition_images_of, save_video_grid

        videos = rollouts.videos[:group].cpu()
        images = [self.setup.images[i] for i in rollouts.prompt_indices[:group]]
        save_video_grid(
            videos,
            os.path.join(self.config.out_dir, "samples", f"step_{step}"),
            titles=rollouts.prompts[:group],
            condition_images=condition_images_of(images, videos.shape[-2:]),
        )

    def checkpoint_if_due(self, step: int) -> None:
        """Full state every ``train.checkpoint_every`` steps and after the last step."""
        from accelerate.utils import broadcast_object_list

        from vsa2_rl.rl.checkpoint import save_checkpoint, stage_checkpoint

        config, acc = self.config, self.acc
        every = config.train.checkpoint_every
        if not ((every and step % every == 0) or step == config.train.num_steps):
            return
        acc.wait_for_everyone()
        weights = engines.model_state(acc, self.transformer, config)  # ZeRO-3, FSDP2 gather
        entries = {
            "model": weights,
            "lr_schedule": self.lr_schedule.state_dict(),
            "ema": self.ema.state_dict() if self.ema is not None else {},
            **({"old_policy": self.nft.old.state_dict()} if self.nft is not None else {}),
            "schedule": self.schedule.state_dict(),
            "config": config_tree(config),
            "step": step,
        }
        staged = None
        if engines.shards_optimizer_state(acc):
            # every rank writes its optimizer (and, under ZeRO-3 and FSDP2, weight) shards into
            # the directory the main process staged, which then commits it
            where = [stage_checkpoint(self.checkpoints, step) if self.is_main else None]
            broadcast_object_list(where)
            staged = where[0]
            engines.save_engine_state(acc, staged)
            acc.wait_for_everyone()
        else:
            entries["optimizer"] = self.optimizer.state_dict()
        if self.is_main:
            save_checkpoint(
                self.checkpoints, step, entries, keep_last=config.train.keep_last, staged=staged
            )
        acc.wait_for_everyone()

    def summary(self) -> dict:
        """Closes the trackers, draws the reward curve and prints the start and end rewards."""
        self.logger.close()
        if self.scoring is not None:
            self.scoring.shutdown()
        config = self.config
        summary = {"out_dir": config.out_dir}
        if not self.is_main:
            return summary
        rows = read_metrics(self.logger.path)
        train_rows = [r for r in rows if isinstance(r.get("reward/mean"), float)]
        points = [(r["step"], r["eval/reward"]) for r in rows if "eval/reward" in r]
        if train_rows:
            plot_reward_curve(rows, os.path.join(config.out_dir, "reward_curve.png"))
        if len(points) >= 2:
            summary["reward_start"], summary["reward_end"] = points[0][1], points[-1][1]
            print(
                f"eval reward (ODE, sparsity {self.schedule(config.train.num_steps).eval}, "
                f"{len(self.setup.eval_prompts)} videos of fixed prompts): step {points[0][0]} "
                f"{points[0][1]:.4f} -> step {points[-1][0]} {points[-1][1]:.4f}"
            )
        if train_rows:
            shown = min(3, len(train_rows))
            head, tail = train_rows[:shown], train_rows[-shown:]
            start = sum(r["reward/mean"] for r in head) / len(head)
            end = sum(r["reward/mean"] for r in tail) / len(tail)
            print(
                f"rollout reward (first {len(head)} vs last {len(tail)} steps): "
                f"{start:.4f} -> {end:.4f}; curve: {config.out_dir}/reward_curve.png"
            )
        return summary


def train(config: RunConfig) -> dict:
    """Runs RL fine-tuning (``grpo.algorithm``); returns a summary (start/end rewards, out_dir)."""
    with RunFolder(config.out_dir) as folder:  # one run per out_dir; a failed start leaves none
        run = _Run(config, folder)  # every check and all loading happen before the run writes
        start_step = run.resume()
        folder.keep()  # under way: from here on a failure leaves the folder to train.resume=auto
        if start_step == 0 and run.evaluation_due(0):
            run.logger.log(0, run.evaluate(0, run.schedule(0).eval))
        run.acc.wait_for_everyone()
        steps = range(start_step + 1, config.train.num_steps + 1)
        bar = tqdm(steps, desc="GRPO", disable=not (run.is_main and config.logging.progress))
        for step in bar:
            sparsities = run.schedule(step)
            metrics: dict = {
                "sparsity/rollout": sparsities.rollout,
                "sparsity/train": sparsities.train,
                "sparsity/eval": sparsities.eval,
            }
            state = run.bundle.sparsity_state  # rollout and update share the step's sparsity
            with state.at(sparsities.rollout), run.sampling_policy():
                rollouts = run.rollout(step, metrics)
            if not run.score(step, rollouts, metrics):  # a reward asked to skip the step
                run.logger.log(step, {**metrics, "train/skipped_reward": 1})
                run.checkpoint_if_due(step)  # the weights are unchanged, the step still counts
                continue
            with state.at(sparsities.train):
                run.update(step, rollouts, metrics)
            if run.evaluation_due(step):
                metrics.update(run.evaluate(step, sparsities.eval))
            run.acc.wait_for_everyone()
            run.logger.log(step, metrics)
            bar.set_postfix(
                reward=f"{metrics['reward/mean']:.3f}", density=f"{metrics['attn/density']:.2f}"
            )
            run.save_samples(step, rollouts)
            run.checkpoint_if_due(step)
        return run.summary()
