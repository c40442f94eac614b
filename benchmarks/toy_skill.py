"""How much of the motion skill a toy base model has, and whether the rollouts' noise decides it.

For a toy checkpoint (``scripts/build_toy_model.py``), on the held-out eval prompts:

1. dense ODE samples (``--seeds`` per prompt, the eval's steps): the detector's figures
   (``vsa2_rl.toy.report.score_samples``) and a table of the prompted direction against the
   direction the shape really moved (the largest component of its tracked displacement, or
   "still" below ``MOVING_DISTANCE``);
2. rollouts at the settings of a run config (default: the embedded default's): its sampler (SDE
   kind, noise level, window, steps), its rollout sparsity and its group size, initial noise per
   sample as the trainer draws it: the share of videos moving the prompted way and the share of
   groups holding both a video that does and one that does not (the groups GRPO learns from).

    python benchmarks/toy_skill.py --model assets/toy [--config configs/default.yaml]
        [--device cuda] [--seeds 8] [--groups 4] [--out skill.md]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from vsa2_rl.config import load_config
from vsa2_rl.toy.data import DIRECTIONS, ShapeSpec
from vsa2_rl.toy.model import load_toy_bundle
from vsa2_rl.toy.prompts import toy_prompts
from vsa2_rl.toy.report import draw_samples, score_samples
from vsa2_rl.toy.rewards import MOVING_DISTANCE, blob_displacement, shape_frames

MOVED = (*DIRECTIONS, "still")


def moved_direction(video: torch.Tensor, prompt: str) -> str:
    """Which way the prompted shape moved: the larger axis of its displacement, or "still"."""
    blobs, is_shape = shape_frames(video, ShapeSpec.from_prompt(prompt), 0.5, 0.5)
    dx, dy = blob_displacement(blobs, is_shape).tolist()
    if max(abs(dx), abs(dy)) < MOVING_DISTANCE:
        return "still"
    if abs(dx) >= abs(dy):
        return "right" if dx > 0 else "left"
    return "down" if dy > 0 else "up"


def confusion_table(videos: torch.Tensor, prompts: list[str], seeds: int) -> str:
    """Markdown: rows = prompted direction, columns = moved direction, counts of videos."""
    counts = {asked: dict.fromkeys(MOVED, 0) for asked in DIRECTIONS}
    repeated = [p for p in prompts for _ in range(seeds)]
    for video, prompt in zip(videos, repeated, strict=True):
        counts[ShapeSpec.from_prompt(prompt).direction][moved_direction(video, prompt)] += 1
    rows = ["| prompted \\ moved | " + " | ".join(MOVED) + " |", "|---" * (len(MOVED) + 1) + "|"]
    for asked, row in counts.items():
        rows.append(f"| {asked} | " + " | ".join(str(row[m]) for m in MOVED) + " |")
    return "\n".join(rows)


def figures_row(label: str, figures: dict) -> str:
    keys = ("shape_fidelity", "direction_match", "direction_mixed", "prompt_motion", "group_std")
    return f"| {label} | " + " | ".join(f"{figures[k]:.3f}" for k in keys) + " |"


def rollout_figures(bundle, prompts: list[str], config, groups: int, shape: dict) -> dict:
    """:func:`score_samples` of ``groups`` draws of a group of ``rl.group_size`` videos per
    prompt at the config's rollout settings (sampler and rollout sparsity), averaged."""
    samp, group = config.sampler, config.rl.group_size
    bundle.sparsity_state.sparsity = config.sparsity.train
    per_draw = [
        score_samples(
            draw_samples(
                bundle, prompts, seeds_per_prompt=group, num_steps=samp.num_steps,
                kind=samp.kind, noise_level=samp.noise_level, sde_window=samp.sde_window,
                seed=1 + g, **shape,
            ),
            prompts,
            group,
        )
        for g in range(groups)
    ]  # fmt: skip
    return {key: sum(f[key] for f in per_draw) / len(per_draw) for key in per_draw[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="toy checkpoint folder")
    parser.add_argument("--config", default="configs/default.yaml", help="run config")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seeds", type=int, default=8, help="dense ODE samples per prompt")
    parser.add_argument("--groups", type=int, default=4, help="rollout groups per prompt")
    parser.add_argument("--out", type=Path, default=None, help="also write the tables here")
    args = parser.parse_args()
    config = load_config(args.config, [f"model.path={args.model}", "attention.backend=torch"])
    model, samp = config.model, config.sampler
    bundle = load_toy_bundle(config.attention, device=args.device, path=args.model)
    prompts = toy_prompts("eval")
    shape = {"num_frames": model.num_frames, "size": model.height}
    if model.height != model.width:
        sys.exit("error: model.height and model.width must match for this script")

    bundle.sparsity_state.sparsity = 0.0
    dense = draw_samples(
        bundle, prompts, seeds_per_prompt=args.seeds, num_steps=samp.eval_num_steps, **shape
    )
    rollouts = rollout_figures(bundle, prompts, config, args.groups, shape)
    group = config.rl.group_size
    header = (
        "| samples | shape fidelity | direction match | direction mixed | motion score | "
        "group sd |\n|---|---|---|---|---|---|"
    )
    rollout_label = (
        f"rollouts ({samp.kind} {samp.noise_level}, window {samp.sde_window}, sparsity "
        f"{config.sparsity.train}), {args.groups} groups of {group} per prompt"
    )
    lines = [
        f"model {args.model}, {len(prompts)} held-out prompts",
        "",
        header,
        figures_row(
            f"dense ODE, {args.seeds} per prompt", score_samples(dense, prompts, args.seeds)
        ),
        figures_row(rollout_label, rollouts),
    ]
    lines += ["", "Dense ODE samples, prompted against moved direction:", ""]
    lines.append(confusion_table(dense, prompts, args.seeds))
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
