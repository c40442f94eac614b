"""Build the toy Wan-architecture model of the embedded default and write it to assets/toy/.

Trains ``vsa2_rl.models.toy.ToyBuildConfig``'s recipe: flow matching on synthetic moving-shape
videos, half of them moving opposite to their caption, dense at 16x16 px, then sparse rebasing
to VSA2 (the sparsity ramped to 0.9, then drawn from the RL range), then every sparsity from
dense to 0.9. After each stage it prints the validation flow-matching loss and the detector's
figures of ODE samples on the held-out eval prompts (``sample_report``: shape fidelity, motion
score, share of videos with the prompted motion and direction, share of prompts whose samples
both follow and miss the direction, spread within a prompt's group). The shipped model was
built on one H200 GPU (``--device cuda``, about 6 minutes); on 2 CPU cores it takes hours.

    python scripts/build_toy_model.py [--out assets/toy] [--seed 0] [--device cuda]
    python scripts/build_toy_model.py --steps-scale 0.01 --out /tmp/toy   # a quick smoke run
    python scripts/build_toy_model.py --resume-from DIR ...   # continue a build cut short
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from vsa2_rl.data.synthetic import COLORS
from vsa2_rl.models.toy import ASSET_DIR, ToyBuildConfig, build_toy_model


def _table(info: dict) -> str:
    """Markdown: per stage, the validation loss and the detector's figures per attention."""
    rows = ["| stage | attention | val. loss | shape fidelity | motion score | motion match "
            "| direction match | direction mixed | group sd |",
            "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    stages = [(str(i), s["validation"], s["samples"]) for i, s in enumerate(info["stages"])]
    final = {"dense": info["final_dense_without_vsa2"]}
    stages.append(("final, VSA2 layers removed", final, info["final_dense_samples"]))
    for name, losses, samples in stages:
        for attention, figures in samples.items():
            loss = losses.get(attention, losses.get("dense", float("nan")))
            rows.append(
                f"| {name} | {attention} | {loss:.4f} | {figures['shape_fidelity']:.3f} | "
                f"{figures['prompt_motion']:.3f} | {figures['motion_match']:.3f} | "
                f"{figures['direction_match']:.3f} | {figures['direction_mixed']:.3f} | "
                f"{figures['group_std']:.3f} |"
            )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ASSET_DIR, help="output folder")
    parser.add_argument("--seed", type=int, default=0, help="training seed")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument(
        "--resume-from",
        type=Path,
        default=None,
        help="a partial build's folder (its first stages done): continue with the next stage",
    )
    parser.add_argument(
        "--steps-scale",
        type=float,
        default=1.0,
        help="multiply every stage's steps (and the rebasing ramp) by this; 1 = the recipe",
    )
    parser.add_argument(
        "--mirrored-captions",
        type=float,
        default=None,
        help="share of pretraining videos moving opposite to their caption (default: recipe's)",
    )
    parser.add_argument(
        "--faithful-colors",
        default=None,
        help="comma-separated colours whose videos always move as captioned (default: none)",
    )
    parser.add_argument(
        "--size", type=int, default=None, help="frame height = width of every stage (px)"
    )
    parser.add_argument(
        "--no-frame-positions",
        action="store_true",
        help="ablation: no frame-position input channel (time only from the relative RoPE)",
    )
    args = parser.parse_args()
    if args.steps_scale <= 0:
        parser.error(f"--steps-scale: must be > 0, got {args.steps_scale}")
    torch.set_num_threads(args.threads)
    config = ToyBuildConfig(seed=args.seed, frame_positions=not args.no_frame_positions)
    if args.mirrored_captions is not None:
        config.mirrored_captions = args.mirrored_captions
    if args.faithful_colors:
        config.faithful_colors = tuple(args.faithful_colors.split(","))
        unknown = sorted(set(config.faithful_colors) - set(COLORS))
        if unknown:
            parser.error(f"--faithful-colors: unknown {unknown}; known: {','.join(COLORS)}")
    if args.size is not None:
        config.stages = [dataclasses.replace(s, size=args.size) for s in config.stages]
    if args.steps_scale != 1.0:

        def scaled(steps: int) -> int:
            return max(1, round(steps * args.steps_scale))

        config.stages = [dataclasses.replace(s, steps=scaled(s.steps)) for s in config.stages]
        config.rebase_steps = scaled(config.rebase_steps)
        config.warmup_lr_steps = scaled(config.warmup_lr_steps)
    info = build_toy_model(args.out, config, device=args.device, resume_from=args.resume_from)
    print(_table(info))
    print(json.dumps({"build_seconds": info["build_seconds"], "device": info["build_device"]}))


if __name__ == "__main__":
    main()
