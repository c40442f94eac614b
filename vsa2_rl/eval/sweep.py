"""Sparsity-sweep evaluation (``vsa2-rl eval``): how good and how fast is a model at each
inference sparsity?

For every model (training runs' newest checkpoints, one checkpoint, or a plain model) and every
sparsity in ``eval.sparsities`` (0.0 = plain dense attention), the same prompts are sampled with
the deterministic ODE from the same seeded noise, decoded and scored by every configured reward.
Nothing is written until every cell succeeded, so a failing reward never leaves a partial table
that looks complete. Outputs in ``out_dir``: ``eval.json`` (one row per run and sparsity, in the
given order), ``eval.md`` (the same as a table), ``eval.png`` (each reward, the
velocity_rel_error and the latency against sparsity, a line per run) and
``samples/<run>/sparsity_<s>.png|.gif``, where ``<run>`` is the run's folder name, with as many
parent folders as it takes to tell the runs apart (``A/run``, ``B/run``). The latency is the
sampling time per video after one untimed warm-up call at each sparsity (compilation and kernel
autotuning at a new setting are not latency).

With ``eval.agreement_prompts`` > 0 each row also holds ``velocity_rel_error``
(vsa2_rl.eval.agreement): the relative L2 error of the guided velocity at the row's sparsity
against the same model's dense velocity, on the same latents along the first
``eval.agreement_prompts`` prompts' trajectories, averaged over their videos and steps (0.0 at
sparsity 0).
Its extra dense forwards change neither the trajectories, nor the row's ``density`` (they are
not recorded), nor its latency (their time, measured apart with the device synchronised, is
subtracted from the sampling's).

The hard-to-easy claim of VSA2 (train at high sparsity, evaluate lower) is checked by running a
sparse-trained and a dense-trained run through the same sweep (docs/concepts.md,
"Hard-to-easy sparsity").
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch
from tqdm.auto import tqdm

from vsa2_rl.config import (
    ConfigError,
    EvalTargets,
    RunConfig,
    check_model_paths,
    check_target_paths,
    config_from_tree,
    config_tree,
    load_recorded_config,
)
from vsa2_rl.config.loading import _flatten
from vsa2_rl.device import resolve_device, resolve_dtype, resolve_reward_device
from vsa2_rl.eval.agreement import VelocityAgreement
from vsa2_rl.eval.media import condition_images_of, save_video_grid
from vsa2_rl.models.conditioning import encode_condition, final_latents
from vsa2_rl.models.experts import low_noise_guidance, video_tokens
from vsa2_rl.preflight import check_target
from vsa2_rl.runtime import (
    check_condition_images,
    check_output_dir,
    image_scheme,
    load_model,
    load_prompt_records,
    prompt_file_key,
)
from vsa2_rl.sampling import cfg_velocity, sample, seeded_noise, sigma_schedule


class Preview(NamedTuple):
    """The first (up to 8) videos of a sweep cell and each one's reward values."""

    videos: torch.Tensor  # [k, T, C, H, W]
    scores: list[dict[str, float]]  # per video: reward name -> value


@dataclass
class EvalTarget:
    """One model to evaluate: a label, the config it was trained with, an optional checkpoint."""

    label: str
    config: RunConfig
    checkpoint: str | None


def _checkpoint_config(checkpoint: str, command_line: RunConfig) -> RunConfig:
    """What ``checkpoint`` was trained with: its own record, else the config.yaml of the run
    folder holding it; only a checkpoint with neither falls back to ``command_line``'s settings,
    with a warning (they may differ from the trained ones)."""
    from vsa2_rl.rl.checkpoint import verify_checkpoint

    problem = verify_checkpoint(checkpoint)  # before any of its files is read
    if problem is not None:
        raise ConfigError(f"checkpoint: {checkpoint} is not a usable checkpoint: {problem}")
    recorded = os.path.join(checkpoint, "config.pt")
    if os.path.isfile(recorded):
        return config_from_tree(_recorded_tree(recorded), f"checkpoint: {checkpoint}")
    run_dir = os.path.dirname(os.path.dirname(os.path.normpath(checkpoint)))
    saved = os.path.join(run_dir, "config.yaml")
    if os.path.isfile(saved):
        return load_recorded_config(saved, "checkpoint")
    print(
        f"warning: checkpoint {checkpoint} records no config and is not in its run folder: "
        "using this command's model, attention and sparsity settings",
        file=sys.stderr,
    )
    return command_line


# what a run folder's model is: taken from its checkpoint, never from its editable config.yaml
_MODEL_SECTIONS = ("model.", "attention.", "sparsity.")


def _run_config(key: str, run_dir: str, checkpoint: str, command_line: RunConfig) -> RunConfig:
    """What the newest ``checkpoint`` of ``run_dir`` was trained with, as ``checkpoint=`` takes
    it; where the run's config.yaml (edited since?) says otherwise about the model, attention or
    sparsity, one line names the keys and that the checkpoint's settings are used."""
    trained = _checkpoint_config(checkpoint, command_line)
    saved = os.path.join(run_dir, "config.yaml")
    try:
        edited = _flatten(config_tree(load_recorded_config(saved, key)))
    except ConfigError as error:
        print(f"warning: {error}; using the settings {checkpoint} records", file=sys.stderr)
        return trained
    recorded = _flatten(config_tree(trained))
    differ = [
        name
        for name in sorted(set(recorded) | set(edited))
        if name.startswith(_MODEL_SECTIONS) and recorded.get(name) != edited.get(name)
    ]
    if differ:
        print(
            f"warning: {saved} differs from {checkpoint} in {', '.join(differ)}: using the "
            "checkpoint's settings",
            file=sys.stderr,
        )
    return trained


def _recorded_tree(recorded: str) -> dict:
    try:
        return torch.load(recorded, map_location="cpu", weights_only=True)
    except Exception as error:  # verified, yet not loadable: written by hand, not by a run
        reason = " ".join(str(error).split())[:200]
        raise ConfigError(f"checkpoint: {recorded} cannot be loaded ({reason})") from None


def run_labels(paths: list[str]) -> list[str]:
    """Per path, its shortest trailing run of folder names that no other path ends with: the
    folder name where that is unique, else as many parents as it takes (``A/run``, ``B/run``)."""
    parts = [os.path.abspath(path).strip(os.sep).split(os.sep) for path in paths]
    labels = []
    for index, mine in enumerate(parts):
        others = parts[:index] + parts[index + 1 :]
        size = next(
            (n for n in range(1, len(mine)) if all(o[-n:] != mine[-n:] for o in others)),
            len(mine),
        )
        labels.append("/".join(mine[-size:]))
    return labels


def _refuse_repeated_runs(run_folders: list[tuple[str, str]]) -> None:
    seen = set()
    for key, run_dir in run_folders:
        if os.path.abspath(run_dir) in seen:
            raise ConfigError(f"{key}: {run_dir} is given twice; list each run once")
        seen.add(os.path.abspath(run_dir))


def resolve_targets(config: RunConfig, targets: EvalTargets | None = None) -> list[EvalTarget]:
    """The models ``targets`` names (none: the plain model of ``config.model``), each with the
    config it was trained with and labelled (table rows, sample folders) by the shortest end of
    its path that tells it apart from the others (:func:`run_labels`). The folders are checked
    before any model loads: each target's, and those loading its model reads."""
    from vsa2_rl.rl.checkpoint import find_latest

    targets = targets or EvalTargets()
    check_target_paths(targets)
    run_folders = targets.run_folders
    _refuse_repeated_runs(run_folders)
    found = []  # (path, the config it was trained with, checkpoint)
    for key, run_dir in run_folders:
        saved = os.path.join(run_dir, "config.yaml")
        if not os.path.isdir(run_dir):
            raise ConfigError(f"{key}: folder not found: {run_dir} (give a training run's out_dir)")
        if not os.path.isfile(saved):
            raise ConfigError(f"{key}: {run_dir} is not a training run (no config.yaml)")
        try:
            latest = find_latest(os.path.join(run_dir, "checkpoints"))
        except ValueError as error:
            raise ConfigError(f"{key}: {error}") from None
        if latest is None:
            raise ConfigError(
                f"{key}: no complete checkpoint under {os.path.join(run_dir, 'checkpoints')} "
                "(train longer or point checkpoint= at a checkpoint folder)"
            )
        found.append((run_dir, _run_config(key, run_dir, str(latest), config), str(latest)))
    if targets.checkpoint:
        trained = _checkpoint_config(targets.checkpoint, config)
        found.append((targets.checkpoint, trained, targets.checkpoint))
    if not found:  # the plain model of config.model (model.path= or the shipped toy)
        check_model_paths(config)
        return [EvalTarget(os.path.basename(config.model.path or "toy"), config, None)]
    for path, trained, _ in found:
        try:
            check_model_paths(trained)
        except ConfigError as error:  # the folders it was trained with moved since
            raise ConfigError(f"{error} (recorded by {path})") from None
    labels = run_labels([path for path, _, _ in found])
    return [
        EvalTarget(label, trained, checkpoint)
        for label, (_, trained, checkpoint) in zip(labels, found, strict=True)
    ]


GUARD_PREFIX = "guard/"


def reward_fns(entries: list, key: str, prefix: str = "") -> list:
    """The rewards of config ``entries`` (``key`` names them in errors), each named
    ``prefix + name``; a reward that cannot be built raises ConfigError naming ``key[i]``."""
    from vsa2_rl.rewards import Reward

    fns = []
    for index, entry in enumerate(entries):
        reward = build_reward(entry, f"{key}[{index}]")
        fns.append(Reward(prefix + reward.name, reward.fn) if prefix else reward)
    return fns


def build_reward(entry, where: str):
    """The reward of one config entry (``where`` names it, e.g. ``rewards.functions[1]``); a
    reward that cannot be built raises ConfigError naming ``where`` and the reward."""
    from vsa2_rl.rewards import get_reward

    try:
        return get_reward(entry.name, **dict(entry.kwargs))
    except (ValueError, TypeError, OSError) as error:  # TypeError: a wrong-typed kwarg
        raise ConfigError(f"{where} ({entry.name}): {error}") from None


def _reward_fns(config: RunConfig) -> list:
    """Trained rewards, then guard metrics (``reward/guard/<name>`` in the table)."""
    return reward_fns(config.rewards.functions, "rewards.functions") + reward_fns(
        config.eval.guard_rewards, "eval.guard_rewards", GUARD_PREFIX
    )


def _warm_up(bundle, condition, noise, sigmas, cfg) -> None:
    """One untimed model call at the current sparsity, so that compilation and kernel
    autotuning at a new setting are not counted as its latency."""
    with torch.no_grad():
        sigma = torch.full((noise.shape[0],), float(sigmas[0]), device=noise.device)
        cfg_velocity(bundle.velocity, condition, *cfg)(noise, sigma)
    if noise.device.type == "cuda":
        torch.cuda.synchronize(noise.device)


def _sample_videos(bundle, prompts, images, noise, sigmas, *, cfg, batch_size, shape, bar,
                   agreement: VelocityAgreement | None):  # fmt: skip
    """ODE videos of ``prompts`` (float32, on the CPU) in batches, and the seconds the sampling
    took (without encoding and decoding, and without ``agreement``'s dense forwards, which
    measure the first batches' velocities when given); ``cfg`` = (negative embedding, guidance
    scale, low-noise guidance) as :func:`vsa2_rl.sampling.cfg_velocity` takes them."""
    device = next(bundle.transformer.parameters()).device
    videos, seconds = [], 0.0
    for start in range(0, len(prompts), batch_size):
        part = slice(start, start + batch_size)
        with torch.no_grad():
            condition = encode_condition(bundle, prompts[part], images[part], shape)
            velocity = cfg_velocity(bundle.velocity, condition, *cfg)
            if agreement is not None:
                velocity = agreement.wrap(velocity, start)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            trajectory = sample(
                velocity, noise[part].to(device), sigmas, kind="ode", noise_level=0.0
            )
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds += time.perf_counter() - t0
            latents = final_latents(condition, trajectory.latents[-1])
            videos.append(bundle.decode(latents).float().cpu())
        bar.update(len(prompts[part]))
    return torch.cat(videos), seconds - (agreement.seconds if agreement is not None else 0.0)


def sweep_model(
    bundle,
    prompts: list[str],
    sparsities: list[float],
    rewards: list,
    *,
    num_steps: int,
    shift: float,
    shift_terminal: float | None = None,
    guidance_scale: float,
    low_noise: tuple[float, float] | None = None,
    seed: int,
    batch_size: int,
    shape: tuple[int, int, int],
    progress: bool = True,
    label: str = "",
    negative_prompt: str = "",
    reward_device: torch.device | str = "cpu",
    images: list[str | None] | None = None,
    agreement_videos: int = 0,
    on_error: str = "stop",
) -> tuple[list[dict], dict[float, torch.Tensor]]:
    """ODE-samples ``prompts`` (with their condition ``images`` for image-to-video) at each
    sparsity; returns the rows and, per sparsity, the :class:`Preview` of the first (up to 8)
    videos. The rewards score the videos on ``reward_device`` (``rewards.device`` or the run's
    device, from the callers) and find each prompt's image in ``metadata["image"]``.
    ``low_noise``: Wan2.2 A14B's second guidance scale
    (:func:`vsa2_rl.models.experts.low_noise_guidance`). ``agreement_videos``: the first this
    many videos' trajectories measure each row's ``velocity_rel_error``; 0 = no such key.
    ``on_error`` (``rewards.on_error``): under "stop" a non-finite score raises, otherwise it is
    logged and left out of its reward's mean."""
    from vsa2_rl.rewards import evaluation_scores, finite_mean_std

    images = list(images) if images is not None else [None] * len(prompts)
    state = bundle.sparsity_state
    latent_shape = bundle.latent_shape(*shape)
    noise = seeded_noise(latent_shape, [seed + i for i in range(len(prompts))])
    sigmas = sigma_schedule(num_steps, shift, shift_terminal)
    device = next(bundle.transformer.parameters()).device
    guided = max(guidance_scale, low_noise[1] if low_noise else 1.0) > 1
    uncond = bundle.encode_prompts([negative_prompt]) if guided else None
    cfg = (uncond, guidance_scale, low_noise)
    rows, previews = [], {}
    bar = tqdm(
        total=len(sparsities) * len(prompts), desc=f"eval {label}".strip(), disable=not progress
    )
    bundle.transformer.eval()
    for sparsity in sparsities:
        with state.at(sparsity):
            first = slice(0, batch_size)
            condition = encode_condition(bundle, prompts[first], images[first], shape)
            _warm_up(bundle, condition, noise[first].to(device), sigmas, cfg)
            state.pop_density()
            measured = agreement_videos > 0 and sparsity > 0.0  # 0.0 at sparsity 0: no forward
            agreement = VelocityAgreement(state, agreement_videos) if measured else None
            videos, seconds = _sample_videos(
                bundle, prompts, images, noise, sigmas, cfg=cfg,
                batch_size=batch_size, shape=shape, bar=bar, agreement=agreement,
            )  # fmt: skip
            density = state.pop_density()
        row = {
            "sparsity": sparsity,
            "density": 1.0 if density is None else density,
            "latency_s": seconds / len(prompts),
        }
        if agreement_videos > 0:
            row["velocity_rel_error"] = agreement.mean() if measured else 0.0
        metadata = [
            {"prompt_index": i, "sparsity": sparsity, **({"image": image} if image else {})}
            for i, image in enumerate(images)
        ]
        shown = min(8, len(videos))
        scores = [{} for _ in range(shown)]
        scored = videos.to(reward_device)
        for reward in rewards:
            values = evaluation_scores(reward, scored, prompts, metadata, on_error)
            row[f"reward/{reward.name}"], row[f"reward/{reward.name}_std"] = finite_mean_std(values)
            for score, value in zip(scores, values[:shown].tolist(), strict=True):
                score[reward.name] = value
        rows.append(row)
        previews[sparsity] = Preview(videos[:shown], scores)
    bar.close()
    return rows, previews


def _markdown(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        cells = [f"{v:.4f}" if isinstance(v, float) else str(v) for v in row.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_sweep(rows: list[dict], path: str) -> None:
    """Each reward, the velocity_rel_error (where measured) and the per-video latency against
    sparsity, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [k for k in rows[0] if k.startswith("reward/") and not k.endswith("_std")]
    metrics += [k for k in ("velocity_rel_error", "latency_s") if k in rows[0]]
    runs = list(dict.fromkeys(row["run"] for row in rows))
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.6 * len(metrics), 3.2), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        for run in runs:
            mine = [row for row in rows if row["run"] == run]
            xs = [row["sparsity"] for row in mine]
            ys = [row[metric] for row in mine]
            errors = [row.get(metric + "_std", 0.0) for row in mine]
            ax.errorbar(
                xs,
                ys,
                yerr=errors if metric.startswith("reward/") else None,
                marker="o",
                capsize=3,
                label=run,
            )
        title = metric.replace("reward/", "")
        vs_dense = " (vs dense)" if metric == "velocity_rel_error" else ""
        ax.set_title(title + vs_dense, fontsize=10)
        ax.set_xlabel("inference sparsity")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def evaluate(config: RunConfig, targets: EvalTargets | None = None) -> list[dict]:
    """Runs the sweep of ``config.eval`` over the models ``targets`` names (none: the plain model
    of ``config.model``); writes and returns the table rows."""
    check_output_dir(config.out_dir)  # before the sweep, whose results would be lost
    models = resolve_targets(config, targets)
    records = config.eval.select_prompts(load_prompt_records(config, "eval"))
    prompts, images = [r.text for r in records], [r.image for r in records]
    for target in models:  # every model's pre-flight, before the first one loads
        scheme = image_scheme(target.config, check_target(config, target.config))
        check_condition_images(scheme, images, prompt_file_key(config, "eval"))
    rewards = _reward_fns(config)
    device = resolve_device(config.device)
    rows, previews = [], {}
    for target in models:
        trained = target.config
        dtype = resolve_dtype(trained.model.dtype, device)
        bundle = load_model(trained, device, dtype, checkpoint=target.checkpoint)
        shape = (trained.model.num_frames, trained.model.height, trained.model.width)
        own_scales = config.eval.guidance_scale is None and config.eval.guidance_scale_2 is None
        table, videos = sweep_model(
            bundle,
            prompts,
            list(config.eval.sparsities),
            rewards,
            on_error=config.rewards.on_error,
            num_steps=config.sampler.eval_num_steps,
            shift=trained.sampler.schedule_shift(video_tokens(bundle, *shape)),
            shift_terminal=trained.sampler.shift_terminal,
            # the evaluation's own guidance settings where it gives them, else the run's
            guidance_scale=(
                trained.eval_guidance_scale
                if config.eval.guidance_scale is None
                else config.eval.guidance_scale
            ),
            low_noise=low_noise_guidance(
                bundle.transformer,
                trained.eval_guidance_scale_2 if own_scales else config.eval_guidance_scale_2,
                "eval.guidance_scale_2",
            ),
            negative_prompt=config.sampler.negative_prompt or trained.sampler.negative_prompt,
            seed=config.eval.seed,
            batch_size=config.rl.train_batch_size,
            shape=shape,
            progress=config.logging.progress,
            label=target.label,
            reward_device=resolve_reward_device(config, device),
            images=images,
            agreement_videos=config.eval.agreement_videos,
        )
        rows.extend({"run": target.label, **row} for row in table)
        previews[target.label] = videos
    # every cell succeeded: only now write the outputs
    os.makedirs(config.out_dir, exist_ok=True)
    with open(os.path.join(config.out_dir, "eval.json"), "w", encoding="utf-8") as handle:
        json.dump(rows, handle, indent=2)
    with open(os.path.join(config.out_dir, "eval.md"), "w", encoding="utf-8") as handle:
        handle.write(_markdown(rows))
    plot_sweep(rows, os.path.join(config.out_dir, "eval.png"))
    for label, by_sparsity in previews.items():
        for sparsity, preview in by_sparsity.items():
            shown = condition_images_of(images[: len(preview.videos)], preview.videos.shape[-2:])
            save_video_grid(
                preview.videos,
                os.path.join(config.out_dir, "samples", label, f"sparsity_{sparsity:g}"),
                condition_images=shown,
            )
    print(_markdown(rows))
    print(f"wrote {config.out_dir}/eval.json, eval.md, eval.png, samples/")
    return rows
