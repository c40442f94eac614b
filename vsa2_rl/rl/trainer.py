"""The RL trainer (``vsa2-rl train`` / ``train_rl.py``): :class:`RLTrainer` and :func:`train`.

One iteration reads top to bottom in :meth:`RLTrainer.train`, each phase a method a subclass
may override (as trl's trainers allow) and each built from a part a reader finds by name:

1. schedule: the hard-to-easy schedule (vsa2_rl.rl.schedule) gives this step's sparsities, set
   with ``SparsityState.at``; rollout and training share one value, so routing in the training
   forward equals routing in the rollout.
2. :meth:`RLTrainer.rollout`: this rank's share of ``prompts_per_step`` prompts x
   ``group_size`` samples from the sampling policy (vsa2_rl.rl.rollout), with per-step
   log-probs.
3. :meth:`RLTrainer.score`: score (vsa2_rl.rewards mixer), gather across ranks and normalise
   per prompt group into the step's advantages and reward metrics (vsa2_rl.rl.scoring).
4. :meth:`RLTrainer.update`: on those advantages, the update rule ``rl.algorithm`` names
   (vsa2_rl.rl.update: Flow-GRPO's PPO-clip update in vsa2_rl.rl.flow_grpo, DiffusionNFT's
   forward-process update in vsa2_rl.rl.nft) of the policy (vsa2_rl.rl.policy: the
   engine-wrapped model, optimizer, EMA, reference); a non-finite loss or gradient skips the
   step. Scoring and the update return what they produce; the loop merges their metrics.
5. bookkeeping: evaluation of the EMA weights, metrics.jsonl, trackers, sample videos, atomic
   checkpoints.

Each phase's work runs in a ``torch.profiler.record_function`` range named ``vsa2_rl/<phase>``
(``rollout/text_encode``, ``rollout/sample``, ``rollout/decode``, ``rollout/kl_penalty``,
``score/rewards``, ``score/rewards_thread``, ``score/advantages``, ``update/forward_backward``,
``update/optimizer``, ``eval``, ``samples``, ``checkpoint``), nearly free without a profiler;
benchmarks/profile_rl_iteration.py splits a step's time by them. :meth:`RLTrainer.step_scope`
wraps each whole step (the profiler's place to start and stop).

Distributed runs use accelerate (DDP, DeepSpeed ZeRO or FSDP2 from ``configs/accelerate/``); every
random draw is a pure function of (seed, step, global sample index), so a resumed run repeats an
uninterrupted one exactly.
"""

from __future__ import annotations

import contextlib
import os
import time
from concurrent import futures

import torch
from torch.profiler import record_function
from tqdm.auto import tqdm

from vsa2_rl.config import RunConfig, check_paths, check_resume, config_tree
from vsa2_rl.eval.agreement import rollout_warning
from vsa2_rl.models.conditioning import encode_condition
from vsa2_rl.models.experts import video_tokens
from vsa2_rl.preflight import ModelFacts
from vsa2_rl.rewards import RewardMixer, RewardSkip
from vsa2_rl.rewards.mixing import RewardOutput
from vsa2_rl.rl import engines
from vsa2_rl.rl.evaluation import evaluate_policy
from vsa2_rl.rl.grpo import GroupedPromptSampler
from vsa2_rl.rl.policy import Policy
from vsa2_rl.rl.rollout import (
    RolloutDiverged,
    RolloutSampler,
    StepRollouts,
    sample_seed,
)
from vsa2_rl.rl.run_folder import RunFolder
from vsa2_rl.rl.schedule import SparsitySchedule
from vsa2_rl.rl.scoring import StepScores, step_advantages
from vsa2_rl.rl.setup import RunSetup, write_config
from vsa2_rl.rl.tracking import MetricsLogger, plot_reward_curve, read_metrics
from vsa2_rl.rl.update import build_update_rule, check_rollouts


def _score_in_range(rewards: RewardMixer, videos, prompts: list, metadata: list) -> RewardOutput:
    """``rewards`` of a chunk on the scoring thread (``rewards.async_scoring``), in a profiler
    range of its own: it overlaps the main thread's sampling."""
    with record_function("vsa2_rl/score/rewards_thread"):
        return rewards(videos, prompts, metadata)


class RLTrainer:
    """One RL fine-tuning run of ``config``: ``RLTrainer(config).train()``.

    :meth:`build` sets everything up before the run writes a file; :meth:`train` is the loop.
    Its phases (:meth:`rollout`, :meth:`score`, :meth:`update`, :meth:`evaluate`,
    :meth:`save_samples`, :meth:`checkpoint_if_due`) are the places to override, for example a
    ``score`` that adds a reward term computed from the rollouts' latents. The parts they use
    are attributes: ``policy`` (vsa2_rl.rl.policy.Policy), ``sampler``
    (vsa2_rl.rl.rollout.RolloutSampler), ``update_rule`` (vsa2_rl.rl.update.UpdateRule),
    ``schedule`` (the sparsity curriculum), ``setup`` (prompts, rewards, accelerator).
    ``facts`` (vsa2_rl.preflight.ModelFacts): the model folder's, where the caller read them
    already; None reads them at :meth:`build`.
    """

    def __init__(self, config: RunConfig, facts: ModelFacts | None = None):
        self.config = config
        self.facts = facts

    def build(self, folder: RunFolder) -> None:
        """Every check and all loading, before anything of the run is written (``folder`` is
        locked first, so that no other run writes there meanwhile)."""
        config = self.config
        self.setup = setup = RunSetup(config, folder, self.facts)
        self.acc, self.device = setup.accelerator, setup.device
        self.is_main = self.acc.is_main_process
        self.video_size = (config.model.num_frames, config.model.height, config.model.width)
        self.latent_shape = setup.bundle.latent_shape(*self.video_size)  # from the bare model
        self.policy = Policy(setup.bundle, self.acc, config)
        self.bundle = self.policy.bundle  # runs the engine's wrapper
        self.schedule = SparsitySchedule.from_config(config.sparsity, config.train.num_steps)
        rl = config.rl
        self.prompt_sampler = GroupedPromptSampler(
            len(setup.prompts), rl.group_size, rl.prompts_per_step,
            num_replicas=setup.dp_world, rank=setup.dp_rank, seed=config.seed,
        )  # fmt: skip
        self.sampler = RolloutSampler(
            config.sampler, setup.bundle, batch_size=rl.train_batch_size,
            group_size=rl.group_size, seed=config.seed, device=self.device,
            video_tokens=video_tokens(setup.bundle, *self.video_size),
        )  # fmt: skip
        self.update_rule = build_update_rule(self.policy, self.sampler, config)
        self.checkpoints = os.path.join(config.out_dir, "checkpoints")
        # evaluation runs on the main process alone, except under ZeRO-3 and FSDP2 (the forward
        # gathers sharded weights, a collective every rank must join) and under sequence
        # parallelism, where the main process's group computes together
        self.evaluates = (
            self.is_main
            or engines.shards_parameters(self.acc)
            or (setup.sequence_parallel is not None and setup.dp_rank == 0)
        )
        # rewards.async_scoring: one background thread scores the chunks in their order
        async_scoring = config.rewards.async_scoring
        self.scoring = futures.ThreadPoolExecutor(1, "rewards") if async_scoring else None
        self.logger: MetricsLogger | None = None

    def train(self) -> dict:
        """Runs the RL fine-tuning; returns a summary (start and end rewards, out_dir)."""
        config = self.config
        check_paths(config)  # a config built in code skips the loader's checks of the disk
        with RunFolder(config.out_dir) as folder:  # one run per out_dir; a failed start leaves none
            self.build(folder)
            start_step = self.resume()
            folder.keep()  # under way: from here on a failure leaves the folder to resume=auto
            if start_step == 0 and self.evaluation_due(0):
                self.logger.log(0, self.evaluate(0, self.schedule(0).eval))
            self.acc.wait_for_everyone()
            steps = range(start_step + 1, config.train.num_steps + 1)
            bar = tqdm(steps, desc="RL", disable=not (self.is_main and config.logging.progress))
            for step in bar:
                with self.step_scope(step):
                    self.train_step(step, bar)
            return self.summary()

    def train_step(self, step: int, bar) -> None:
        """One RL step: rollouts at the step's sparsity, their scores, the update, the
        evaluation when due, the metrics line, sample videos and the checkpoint when due."""
        sparsities = self.schedule(step)
        metrics: dict = {f"sparsity/{k}": v for k, v in sparsities._asdict().items()}
        state = self.bundle.sparsity_state  # rollout and update share the step's value
        with state.at(sparsities.rollout), self.update_rule.sampling_policy() as bundle:
            rollouts = self.rollout(step, bundle)
        metrics.update(rollouts.metrics)
        scores = self.score(step, rollouts)
        if scores is None:  # a reward asked to skip the step
            self.logger.log(step, {**metrics, "train/skipped_reward": 1})
            self.checkpoint_if_due(step)  # the weights are unchanged, the step counts
            return
        metrics.update(scores.metrics)
        with state.at(sparsities.train):
            metrics.update(self.update(step, rollouts, scores))
        if self.evaluation_due(step):
            metrics.update(self.evaluate(step, sparsities.eval))
        self.acc.wait_for_everyone()
        self.logger.log(step, metrics)
        bar.set_postfix(
            reward=f"{metrics['reward/mean']:.3f}", density=f"{metrics['attn/density']:.2f}"
        )
        self.save_samples(step, rollouts)
        self.checkpoint_if_due(step)

    def step_scope(self, step: int) -> contextlib.AbstractContextManager:
        """The context each step of the loop runs in (nothing here; a profiler's subclass
        starts and stops its recording here, benchmarks/profile_rl_iteration.py)."""
        return contextlib.nullcontext()

    # ---- set-up and resume -----------------------------------------------------------------

    def resume(self) -> int:
        """Restores the checkpoint ``train.resume`` names (after checking it and its config),
        sets aside a later branch it abandons, writes config.yaml, opens the logger; returns
        the step to continue after."""
        from vsa2_rl.rl import checkpoint

        config = self.config
        resume_from, restored = checkpoint.restore_point(config.train.resume, self.checkpoints)
        start_step, lowered = 0, {}
        if resume_from:
            saved = checkpoint.trained_with(restored, resume_from)
            lowered = check_resume(saved, config, str(resume_from))
            self.policy.load_state(restored, str(resume_from))
            self.schedule.load_state_dict(restored["schedule"])  # a longer run keeps its curriculum
            self.update_rule.load_state(restored)
            start_step = int(restored["step"])
        if "train.learning_rate" in lowered:
            lr = config.train.learning_rate
            checkpoint.set_learning_rate(self.policy.optimizer, self.policy.lr_schedule, lr)
        if self.is_main:
            os.makedirs(config.out_dir, exist_ok=True)
            aside = resume_from and checkpoint.set_aside_branch(config.out_dir, start_step)
            if aside:
                print(f"checkpoints after step {start_step} and their metrics moved to {aside}")
            write_config(config)
        # without a checkpoint the run starts over: no row, step 0's neither, is kept
        resume_step = start_step if resume_from else -1
        self.logger = MetricsLogger(config, resume_step=resume_step, enabled=self.is_main)
        if resume_from and self.is_main:
            print(f"resumed from {resume_from} at step {start_step}")
            for key, (was, now) in lowered.items():
                print(f"{key}: lowered from {was} to {now} from step {start_step + 1} on")
        return start_step

    # ---- rollout ---------------------------------------------------------------------------

    def condition(self, prompt_indices: list[int]):
        """What the model is conditioned on for these training prompts (text, and the
        condition image of an image-to-video prompt)."""
        prompts = [self.setup.prompts[i] for i in prompt_indices]
        images = [self.setup.images[i] for i in prompt_indices]
        return encode_condition(self.setup.bundle, prompts, images, self.video_size)

    def rollout(self, step: int, bundle) -> StepRollouts:
        """This rank's rollouts of the step from ``bundle`` (the sampling policy), at the
        sparsity the caller set, with the rollout phase's metrics; with
        ``rewards.async_scoring`` each chunk is scored while the next ones are sampled."""
        t0 = time.perf_counter()
        batch = self.prompt_sampler.batch(step - 1)
        indices = batch.prompt_indices
        prompts = [self.setup.prompts[i] for i in indices]
        offset = self.setup.dp_rank * self.prompt_sampler.samples_per_rank
        global_index = [offset + i for i in range(len(prompts))]
        metadata = self._reward_metadata(step, indices, global_index)
        pending = []

        def score_chunk(videos: torch.Tensor, part: slice) -> None:
            videos = videos.float().to(self.setup.reward_device)
            pending.append(self.scoring.submit(
                _score_in_range, self.setup.rewards, videos, prompts[part], metadata[part]
            ))  # fmt: skip

        self.policy.model.eval()
        sampled = self.sampler.sample_chunks(
            bundle, step, batch.group_ids, global_index,
            lambda rows: self.condition([indices[i] for i in rows]), self.latent_shape,
            on_chunk=score_chunk if self.scoring is not None else None,
        )  # fmt: skip
        with record_function("vsa2_rl/rollout/kl_penalty"):
            for chunk in sampled.chunks:  # at the rollout's sparsity, by the rule that wants it
                chunk.kl_penalty = self.update_rule.kl_penalty(chunk, sampled.stochastic)
        self._refuse_nonfinite_videos(step, sampled.videos, global_index)
        evaluations = torch.tensor([float(sampled.evaluations)], device=self.device)
        density = bundle.sparsity_state.pop_density()
        seconds = time.perf_counter() - t0
        metrics = {
            "perf/rollout_evals": float(self.acc.reduce(evaluations, "sum").item()),
            "attn/density": density if density is not None else 1.0,
            "perf/rollout_s": seconds,
        }
        return StepRollouts(
            indices, batch.group_ids, prompts, global_index, sampled.chunks,
            torch.cat(sampled.videos).float(), sampled.stochastic, pending, seconds, metrics,
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
                "sample_seed": sample_seed(seed, step, i),
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

    def score(self, step: int, rollouts: StepRollouts) -> StepScores | None:
        """The step's rewards as this rank's group advantages and the scoring metrics; None
        when a reward asked to skip the step on any rank (every rank skips together; the
        weights stay untouched)."""
        config, acc, device = self.config, self.acc, self.device
        try:
            with record_function("vsa2_rl/score/rewards"):
                scored, skip_reason = self._scored(step, rollouts), ""
        except RewardSkip as error:
            scored, skip_reason = None, str(error)
        if acc.gather(torch.tensor([float(scored is None)], device=device)).sum() > 0:
            if self.is_main:
                tqdm.write(f"step {step}: skipped ({skip_reason or 'a reward failed elsewhere'})")
            return None
        penalties = [chunk.kl_penalty for chunk in rollouts.chunks]
        penalty = None if penalties[0] is None else torch.cat(penalties)
        group_ids = torch.tensor(rollouts.group_ids, device=device)
        with record_function("vsa2_rl/score/advantages"):
            advantages, scoring_metrics = step_advantages(
                acc, config.rl, config.rewards.aggregation, self.setup.rewards, scored,
                group_ids, penalty,
            )  # fmt: skip
        return StepScores(advantages, scored.valid.to(device), scoring_metrics)

    # ---- policy update ---------------------------------------------------------------------

    def update(self, step: int, rollouts: StepRollouts, scores: StepScores) -> dict:
        """The update rule's optimizer steps on ``scores``' advantages at the sparsity the
        caller set, one step of the learning-rate schedule; returns the update's metrics."""
        t0 = time.perf_counter()
        self.policy.model.train()
        rollouts.set_scores(scores.advantages, scores.valid, self.config.rl.train_batch_size)
        check_rollouts(self.update_rule, rollouts)
        grad_norms, skipped, metrics = self.update_rule.update(step, rollouts)
        self.policy.advance_lr_schedule()
        self.bundle.sparsity_state.pop_density()
        metrics["perf/train_s"] = time.perf_counter() - t0
        if self.device.type == "cuda":  # the largest per-GPU peak of the iteration over ranks
            peak = torch.cuda.max_memory_allocated(self.device) / 2**30
            metrics["perf/peak_mem_gib"] = self.acc.gather(
                torch.tensor([peak], device=self.device)
            ).max().item()  # fmt: skip
            torch.cuda.reset_peak_memory_stats(self.device)
        seconds = rollouts.seconds + metrics["perf/train_s"]
        metrics["perf/videos_per_s"] = len(rollouts.prompts) * self.setup.dp_world / seconds
        metrics["train/grad_norm"] = grad_norms[-1] if grad_norms else 0.0
        metrics["train/lr"] = self.policy.lr_schedule.get_last_lr()[0]
        metrics["train/skipped_nonfinite"] = skipped
        return metrics

    # ---- evaluation, samples, checkpoints --------------------------------------------------

    def evaluation_due(self, step: int) -> bool:
        every = self.config.eval.every
        last = step == self.config.train.num_steps
        return bool(every) and self.evaluates and (step == 0 or step % every == 0 or last)

    def evaluate(self, step: int, sparsity: float) -> dict:
        """Rewards and velocity agreement at ``sparsity``, agreement at the step's rollout
        sparsity (``eval/*``); step 0's warns once above ``sparsity.max_rollout_velocity_error``."""
        rollout = self.schedule(step).rollout
        with record_function("vsa2_rl/eval"):
            metrics = evaluate_policy(self.setup, self.policy, sparsity, rollout, step, self.logger)
        warning = rollout_warning(metrics, self.config.sparsity.max_rollout_velocity_error, rollout)
        if step == 0 and self.is_main and warning:
            tqdm.write(warning)
        return metrics

    def save_samples(self, step: int, rollouts: StepRollouts) -> None:
        """One group's rollouts as ``samples/step_<step>`` every ``train.sample_every`` steps."""
        every, group = self.config.train.sample_every, self.config.rl.group_size
        if not (self.is_main and every and step % every == 0):
            return
        from vsa2_rl.eval.media import condition_images_of, save_video_grid

        with record_function("vsa2_rl/samples"):
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
        config = self.config
        every = config.train.checkpoint_every
        if not ((every and step % every == 0) or step == config.train.num_steps):
            return
        with record_function("vsa2_rl/checkpoint"):
            self._save_checkpoint(step)

    def _save_checkpoint(self, step: int) -> None:
        """The full state of ``step`` into checkpoints/ (every rank joins)."""
        from accelerate.utils import broadcast_object_list

        from vsa2_rl.rl.checkpoint import save_checkpoint, stage_checkpoint

        config, acc = self.config, self.acc
        acc.wait_for_everyone()
        entries = {
            **self.policy.state_entries(),  # ZeRO-3 and FSDP2 gather the weights
            **self.update_rule.state_entries(),
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
            entries["optimizer"] = self.policy.optimizer.state_dict()
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


def train(config: RunConfig, facts: ModelFacts | None = None) -> dict:
    """Runs RL fine-tuning (``rl.algorithm``); returns a summary (start/end rewards, out_dir).
    ``facts``: the model folder's, where the caller read them already."""
    return RLTrainer(config, facts).train()


__all__ = ["RLTrainer", "train"]
