"""A training run's evaluation: ODE rewards of the policy (EMA weights if kept) on the fixed
held-out prompts, the guards, the rollout agreement, and the first videos as a captioned grid."""

from __future__ import annotations

import functools
import os

from vsa2_rl.eval.agreement import agreement_metrics
from vsa2_rl.eval.sweep import GUARD_PREFIX, sweep_model
from vsa2_rl.models.experts import low_noise_guidance, video_tokens
from vsa2_rl.rl.policy import Policy
from vsa2_rl.rl.setup import RunSetup


def evaluate_policy(
    setup: RunSetup, policy: Policy, sparsity: float, rollout: float, step: int, logger
) -> dict:
    """ODE rewards on the fixed evaluation prompts at ``sparsity`` (EMA weights if kept) and the
    velocity agreement there and at ``rollout`` (vsa2_rl.eval.agreement), on the unwrapped model
    of this process (no collectives but ZeRO-3's weight gathers), as ``eval/*`` metrics; the main
    process also writes the first videos as ``samples/eval_step_<step>.{png,gif,mp4}`` and hands
    them to the trackers, each with its prompt and rewards as caption."""
    config = setup.config
    prompts, images, measured = setup.eval_prompts, setup.eval_images, config.eval.agreement_videos
    shape = (config.model.num_frames, config.model.height, config.model.width)
    with policy.evaluation() as bundle:
        sweep = functools.partial(
            sweep_model,
            bundle,
            num_steps=config.sampler.eval_num_steps,
            shift=config.sampler.schedule_shift(video_tokens(bundle, *shape)),
            shift_terminal=config.sampler.shift_terminal,
            guidance_scale=config.eval_guidance_scale,
            low_noise=low_noise_guidance(
                bundle.transformer, config.eval_guidance_scale_2, "eval.guidance_scale_2"
            ),
            negative_prompt=config.sampler.negative_prompt,
            seed=config.eval.seed,
            batch_size=config.rl.train_batch_size,
            shape=shape,
            progress=False,
            reward_device=setup.reward_device,
            agreement_videos=measured,
            on_error=config.rewards.on_error,
        )
        rewards = [*setup.rewards.rewards.values(), *setup.guards]
        (row,), previews = sweep(prompts, [sparsity], rewards, images=images)
        agreement = agreement_metrics(sweep, prompts, images, rollout, row, measured)
    if setup.accelerator.is_main_process:
        save_eval_videos(setup, previews[sparsity], step, logger)
    total = setup.rewards.weighted_total({n: row[f"reward/{n}"] for n in setup.rewards.names})
    metrics = {"eval/reward": total, "eval/density": row["density"], **agreement}
    for key, value in row.items():  # reward/<name> -> eval/reward/<name>, guards eval/guard/<name>
        if key.startswith("reward/" + GUARD_PREFIX):
            metrics["eval/" + key[len("reward/") :]] = value
        elif key.startswith("reward/"):
            metrics[f"eval/{key}"] = value
    return metrics


def save_eval_videos(setup: RunSetup, preview, step: int, logger) -> None:
    """The evaluation's first videos as a grid (captions: prompt and rewards), to the trackers."""
    from vsa2_rl.eval.media import condition_images_of, save_video_grid

    prompts = setup.eval_prompts[: len(preview.videos)]
    images = condition_images_of(setup.eval_images[: len(prompts)], preview.videos.shape[-2:])
    prefix = os.path.join(setup.config.out_dir, "samples", f"eval_step_{step}")
    png, gif = save_video_grid(preview.videos, prefix, titles=prompts, condition_images=images)
    captions = [
        f"{prompt} | " + ", ".join(f"{name} {value:.3f}" for name, value in scores.items())
        for prompt, scores in zip(prompts, preview.scores, strict=True)
    ]
    logger.log_videos(step, "eval/videos", gif, png, captions)


__all__ = ["evaluate_policy", "save_eval_videos"]
