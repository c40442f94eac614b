"""The learnability gate: can a toy base learn its direction words from perfect data at all?

A reward can teach a model no more than the best data would, and a base that does not move
toward the skill when fine-tuned on videos that all move as captioned will not move toward it
under RL either (measured: the base built with half its captions mirrored stays at a coin flip
after 19,200 perfect videos). :func:`learnability_gate` fine-tunes a copy of a base with the
flow-matching loss on fresh synthetic videos that move as captioned (Adam on the transformer,
the text encoder frozen as in RL, dense attention), and measures the share of held-out videos
moving the prompted way (``prompt_direction``) before and after, on the same noises, at the
evaluation's sparsity. The shipped base must raise it by at least ``MIN_GAIN`` (its figures are
on the results page).

    python -m vsa2_rl.toy.gate [--model assets/toy] [--device cuda] [--eval-sparsity 0.25]

A base for RL also needs the skill partly learnt and its shapes intact (:func:`rl_base_problems`:
direction followed in 35-65% of held-out videos, shape fidelity >= 0.9); the command prints
both verdicts and the figures as JSON on its last line.

On CUDA its products run in TF32 and its VSA2 layers on the Triton kernels, as the build's do
(``--backend torch``: the reference).

It measures and fine-tunes at the video size the base was built for (its last pretraining
stage's, from its ``config.json``): 16 px x 8 frames for the shipped toy, 64 px x 16 frames
for a sparsity-testbed base (:mod:`vsa2_rl.toy.testbed`).
"""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from vsa2_rl.toy.build import (
    BACKENDS,
    SPARSITY,
    device_arg,
    flow_matching_loss,
    int_at_least,
    positive_number,
)
from vsa2_rl.toy.data import pretraining_batch, render_batch
from vsa2_rl.toy.model import ToyBundle, pixels_to_latents
from vsa2_rl.toy.prompts import toy_prompts
from vsa2_rl.toy.report import draw_samples, score_samples

MIN_GAIN = 0.08  # share of held-out videos (8 points) the perfect data must add
# A base for RL: the direction words partly learnt (followed in this share of held-out videos
# at the evaluation sparsity) with its shapes intact (shape fidelity at least MIN_FIDELITY).
PARTLY_LEARNT = (0.35, 0.65)
MIN_FIDELITY = 0.9


@dataclass
class GateSettings:
    """The gate's fine-tuning and measurement (defaults: the shipped base's gate)."""

    steps: int = 40
    batch: int = 64  # perfectly captioned videos a step
    micro_batch: int = 64  # videos a forward/backward holds (the testbed's 64 px: fewer)
    lr: float = 3e-5
    train_sparsity: float = 0.0  # dense fine-tuning
    eval_sparsity: float = 0.25  # the embedded default's evaluation sparsity
    eval_seeds: int = 8  # noises per held-out prompt (24 prompts: 192 videos)
    eval_num_steps: int = 10  # ODE steps
    num_frames: int = 8
    size: int = 16
    seed: int = 0


def captioned_batch(count: int, settings: GateSettings, generator: torch.Generator, device):
    """Prompts and latents [count, C, T, H, W] of synthetic videos moving as captioned."""
    specs, seeds, moves = pretraining_batch(count, generator, mirrored=0.0)
    videos = render_batch(
        specs, seeds, settings.num_frames, settings.size, settings.size, moves, device
    )
    return [spec.prompt for spec in specs], pixels_to_latents(videos)


def held_out_direction(bundle: ToyBundle, settings: GateSettings) -> dict:
    """Detector figures of ODE samples of the held-out prompts at the evaluation sparsity."""
    prompts = toy_prompts("eval")
    bundle.sparsity_state.sparsity = settings.eval_sparsity
    videos = draw_samples(
        bundle,
        prompts,
        seeds_per_prompt=settings.eval_seeds,
        num_steps=settings.eval_num_steps,
        num_frames=settings.num_frames,
        size=settings.size,
    )
    bundle.sparsity_state.pop_density()
    return score_samples(videos, prompts, settings.eval_seeds)


def fine_tune_on_captioned(bundle: ToyBundle, settings: GateSettings) -> None:
    """``settings.steps`` Adam steps of flow matching on perfectly captioned videos, in place."""
    params = list(bundle.transformer.parameters())
    optimizer = torch.optim.Adam(params, lr=settings.lr)
    generator = torch.Generator().manual_seed(settings.seed)
    bundle.sparsity_state.sparsity = settings.train_sparsity
    for _ in range(settings.steps):
        prompts, latents = captioned_batch(settings.batch, settings, generator, bundle.device)
        noise = torch.randn(latents.shape, generator=generator).to(bundle.device)
        sigma = torch.sigmoid(torch.randn(len(prompts), generator=generator)).to(bundle.device)
        optimizer.zero_grad(set_to_none=True)
        for start in range(0, settings.batch, settings.micro_batch):
            part = slice(start, start + settings.micro_batch)
            loss = flow_matching_loss(
                bundle.transformer,
                latents[part],
                bundle.encode_prompts(prompts[part]),
                sigma[part],
                noise[part],
                bundle.frame_positions,
            )
            (loss * len(prompts[part]) / settings.batch).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        bundle.sparsity_state.pop_density()


def learnability_gate(base: ToyBundle, settings: GateSettings | None = None) -> dict:
    """The gate on a copy of ``base`` (left untouched): direction share and shape fidelity
    before and after fine-tuning on perfect data, the gain, and whether it passes."""
    settings = settings or GateSettings()
    bundle = copy.deepcopy(base)
    bundle.transformer.train()
    before = held_out_direction(bundle, settings)
    fine_tune_on_captioned(bundle, settings)
    after = held_out_direction(bundle, settings)
    gain = after["direction_match"] - before["direction_match"]
    return {
        "settings": asdict(settings),
        "direction_before": before["direction_match"],
        "direction_after": after["direction_match"],
        "fidelity_before": before["shape_fidelity"],
        "fidelity_after": after["shape_fidelity"],
        "gain": gain,
        "passed": gain >= MIN_GAIN,
    }


def rl_base_problems(result: dict) -> list[str]:
    """What keeps a gated base (:func:`learnability_gate`'s ``result``) from being an RL base:
    the direction words not partly learnt, shapes below :data:`MIN_FIDELITY`, or perfect data
    moving it less than :data:`MIN_GAIN` (when ``result`` has a ``gain``: the long toy's
    figures have none, dense-rollout RL against its control is its learnability gate); empty
    when it is one."""
    problems = []
    low, high = PARTLY_LEARNT
    if not low <= result["direction_before"] <= high:
        problems.append(f"direction followed {result['direction_before']:.3f}, outside "
                        f"[{low}, {high}]")  # fmt: skip
    if result["fidelity_before"] < MIN_FIDELITY:
        problems.append(f"shape fidelity {result['fidelity_before']:.3f} < {MIN_FIDELITY}")
    if "gain" in result and result["gain"] < MIN_GAIN:  # no gain: a base RL itself gates
        problems.append(f"perfect data moved it {100 * result['gain']:+.1f} points < "
                        f"{100 * MIN_GAIN:.0f}")  # fmt: skip
    return problems


def built_video_size(toy_config: dict) -> tuple[int, int]:
    """(size in px, frames) of the last pretraining stage a toy checkpoint's ``config.json``
    records."""
    last = toy_config["training"]["recipe"]["stages"][-1]
    return last["size"], last["num_frames"]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line, every value checked before the model loads (one ``error:`` line), with
    the base's video size (``args.size``, ``args.frames``) read from ``--model``."""
    from vsa2_rl.toy.model import ASSET_DIR

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ASSET_DIR, help="toy checkpoint folder")
    parser.add_argument("--device", type=device_arg, default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--threads", type=int_at_least(1), default=2, help="torch CPU threads")
    parser.add_argument("--eval-sparsity", type=SPARSITY, default=GateSettings.eval_sparsity)
    parser.add_argument("--lr", type=positive_number, default=GateSettings.lr)
    parser.add_argument("--steps", type=int_at_least(0), default=GateSettings.steps)
    parser.add_argument("--seed", type=int_at_least(0), default=GateSettings.seed, help="data seed")
    parser.add_argument("--backend", choices=BACKENDS, default="auto", help="VSA2 kernels")
    parser.add_argument(
        "--micro-batch", type=int_at_least(1), default=GateSettings.micro_batch,
        help="videos a forward/backward holds (same update; 8 fits the testbed on 80 GB)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    args.size, args.frames = _model_video_size(args.model, parser)
    return args


def _model_video_size(model: Path, parser: argparse.ArgumentParser) -> tuple[int, int]:
    """(size, frames) the toy checkpoint at ``model`` was built for; a usage error where
    ``model`` holds no readable toy checkpoint."""
    from vsa2_rl.toy.model import read_toy_config

    try:
        return built_video_size(read_toy_config(model))
    except (ValueError, OSError, KeyError, IndexError, TypeError) as error:
        detail = str(error) if isinstance(error, ValueError) else f"{type(error).__name__} {error}"
        parser.error(f"--model {model}: not a readable toy checkpoint ({detail})")


def main(argv: list[str] | None = None) -> int:
    """Run the gate on a toy checkpoint folder; exit 0 when it passes, 1 when it does not."""
    from vsa2_rl.config import VSA2Config
    from vsa2_rl.toy.model import load_toy_bundle

    args = _parse(argv)
    torch.set_num_threads(args.threads)
    if torch.device(args.device).type == "cuda":  # the build's TF32 products
        torch.backends.cuda.matmul.allow_tf32 = True
    base = load_toy_bundle(VSA2Config(backend=args.backend), device=args.device, path=args.model)
    settings = GateSettings(
        eval_sparsity=args.eval_sparsity,
        lr=args.lr,
        steps=args.steps,
        seed=args.seed,
        micro_batch=args.micro_batch,
        size=args.size,
        num_frames=args.frames,
    )
    result = learnability_gate(base, settings)
    verdict = "passes" if result["passed"] else f"fails (needs a gain of >= {MIN_GAIN:.2f})"
    print(
        f"direction followed {result['direction_before']:.3f} -> {result['direction_after']:.3f}"
        f" (gain {result['gain']:+.3f}), shape fidelity {result['fidelity_before']:.3f} -> "
        f"{result['fidelity_after']:.3f}: the gate {verdict}"
    )
    problems = rl_base_problems(result)
    print("an RL base" if not problems else "not an RL base: " + "; ".join(problems))
    print(json.dumps(result))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
