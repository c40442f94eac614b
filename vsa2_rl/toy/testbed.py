"""The sparsity testbed: the toy task scaled up until sparse attention has something to skip.

The shipped toy model (:mod:`vsa2_rl.toy.model`) sees 512 tokens, eight 64-token cubes: at
sparsity 0.9 VSA2 keeps one of them, and a 16-key segment is a quarter of a cube. The testbed
is the same family (diffusers' ``WanTransformer3DModel`` on pixel latents, the toy data and
prompts) at 64 x 64 px x 16 frames with 4 x 4 px patches: 4,096 tokens, 64 cubes, 256 segments of
16 keys; 8 blocks of width 384 (6 heads of 64), 20.3 M parameters
(:data:`TESTBED_ARCHITECTURE`).

:func:`testbed_recipe` is its progressive pretraining (:mod:`vsa2_rl.toy.build`): 32 px
(1,024 tokens), then 64 px, on videos half of which move opposite to their caption (the claims'
bases; ``mirrored_captions`` changes that), with the attention switch of VSA2's sparse-rebasing
claim:

- ``dense``: full attention throughout;
- ``rebase``: full attention at 32 px, rebased to VSA2 at the resolution change (density
  annealed from 1 to the target over ``REBASE_STEPS``, then held);
- ``sparse``: VSA2 at the target sparsity from the first step.

``dense`` and ``rebase`` share their 32 px stage (:func:`low_resolution_recipe`, built once).

:func:`fine_tune_recipe` adds one flow-matching stage at 64 px to a built base (resumed from its
folder): the runs of the router and hard-to-easy claims (``benchmarks/sparsity_claims.py``).

:func:`rl_base_recipe` (``--recipe rl``) is meant as the base for RL at the testbed's video size:
a smaller model (:data:`RL_ARCHITECTURE`, 4 blocks of width 256, 4.9 M parameters; attention is
most of its work, as in Wan at 720p), truthful captions, 32 px at batch 64 in ``--low-chunks``
runs of the toy's 1,250 steps (each with its own warm-up and cosine), then rebased to VSA2 at
64 px and trained across the sparsities RL and evaluation use (0 to 0.9). Measured on one H100,
it is not an RL base yet: its 32 px stage follows the direction words in 20%, 26%, 42% and 45% of
held-out videos after 1 to 4 chunks (chance is 25%), but after the 64 px stages the 4-chunk
base follows them in 26% at sparsity 0.5, and 40 steps of perfect data move it by -0.5 points.
The claims' recipe with truthful captions fares no better (23-31%, -3 points).
``python -m vsa2_rl.toy.gate --model DIR --micro-batch 8`` measures how much perfect data moves
a base.

:func:`long_recipe` (``--recipe long``) grows the shipped toy in time instead of space: the
shipped base (``assets/toy``, 16 px x 8 frames, 512 tokens), whose direction words RL moves by
30 points, continued at 16 px x :data:`LONG_FRAMES` frames (2,048 tokens: 32 query tiles of 64,
128 key segments of 16, so 0.9 keeps 13 segments a tile and 0.75 keeps 32), the temporal
analogue of sparse rebasing. The synthetic videos keep their travel over the clip, so a shape
moves a quarter as far between frames and stays in view. The build resumes the shipped stages
and trains one more across the sparsities RL uses (0 to 0.9), for ``--long-steps`` steps::

    python -m vsa2_rl.toy.testbed --out DIR --device cuda --recipe rl [--low-chunks 4]
    python -m vsa2_rl.toy.testbed --out DIR --device cuda --recipe long [--long-steps 200]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import threading
from pathlib import Path

from vsa2_rl.config import VSA2Config
from vsa2_rl.toy.build import (
    BACKENDS,
    PARTIAL_FILE,
    SHARE,
    SPARSITY,
    BuildStopped,
    ToyBuildConfig,
    ToyStage,
    build_toy_model,
    check_resumable,
    device_arg,
    int_at_least,
    out_folder,
    positive_number,
)
from vsa2_rl.toy.model import ASSET_DIR, CONFIG_FILE, read_toy_config

TESTBED_ARCHITECTURE = {
    "patch_size": [1, 4, 4],
    "num_attention_heads": 6,
    "attention_head_dim": 64,
    "ffn_dim": 1536,
    "num_layers": 8,
    "freq_dim": 256,
}
FRAMES = 16
LOW_SIZE, HIGH_SIZE = 32, 64
BATCH = 16
# Steps of the two pretraining stages and of the rebasing ramp (times --steps-scale).
LOW_STEPS, HIGH_STEPS, REBASE_STEPS = 1500, 1000, 200
VAL_EVERY, WARMUP_STEPS = 50, 100
ATTENTION_SWITCHES = ("dense", "rebase", "sparse")
RL_ARCHITECTURE = {
    "patch_size": [1, 4, 4],
    "num_attention_heads": 4,
    "attention_head_dim": 64,
    "ffn_dim": 1024,
    "num_layers": 4,
    "freq_dim": 256,
}
# The RL base's stages (times --steps-scale): RL_LOW_CHUNKS runs of 32 px dense at RL_LOW_BATCH,
# then at 64 px the rebasing stage (ramp to 0.9, then 0.5-0.9) and the stage across every
# sparsity (0-0.9).
RL_LOW_STEPS, RL_REBASE_STEPS, RL_RANGE_STEPS, RL_LOW_BATCH = 1250, 300, 200, 64
RL_LOW_CHUNKS = 4
EVAL_SPARSITIES = (0.0, 0.5, 0.75, 0.9)
# The long toy (long_recipe): the shipped toy's frames x LONG_FRAMES / 8, one stage of
# LONG_STEPS at batch LONG_BATCH and LONG_LR_SCALE x the recipe's lr, sparsities 0-0.9.
LONG_FRAMES, LONG_STEPS, LONG_BATCH, LONG_LR_SCALE = 32, 200, 64, 0.3
LONG_REPORT_SEEDS = 4  # noises per held-out prompt in the build's sample figures
# Share of pretraining videos moving opposite to their caption in the claims' bases: the
# direction words carry no sign information, so "direction followed" stays near 0.5 at most.
CLAIMS_MIRRORED_CAPTIONS = 0.5


def _scaled(steps: int, scale: float) -> int:
    return max(1, round(steps * scale))


def testbed_recipe(
    attention: str,
    seed: int = 0,
    sparsity: float = 0.9,
    steps_scale: float = 1.0,
    vsa2: VSA2Config | None = None,
    mirrored_captions: float = CLAIMS_MIRRORED_CAPTIONS,
) -> ToyBuildConfig:
    """The testbed's pretraining with the ``attention`` switch (module docstring); VSA2 runs at
    ``sparsity`` with the router ``vsa2`` (default: kv_block 16, top-p, Triton on CUDA), on
    pretraining videos of which ``mirrored_captions`` move opposite to their caption."""
    if attention not in ATTENTION_SWITCHES:
        raise ValueError(f"attention must be one of {ATTENTION_SWITCHES}, got {attention!r}")
    sparse_low, sparse_high = attention == "sparse", attention != "dense"
    held = (sparsity, sparsity)
    stages = [
        ToyStage(LOW_SIZE, FRAMES, _scaled(LOW_STEPS, steps_scale), BATCH, vsa2=sparse_low,
                 sparsity_range=held if sparse_low else (0.0, 0.0)),
        ToyStage(HIGH_SIZE, FRAMES, _scaled(HIGH_STEPS, steps_scale), BATCH, vsa2=sparse_high,
                 sparsity_range=held if sparse_high else (0.0, 0.0), lr_scale=0.5),
    ]  # fmt: skip
    return ToyBuildConfig(
        seed=seed,
        stages=stages,
        mirrored_captions=mirrored_captions,
        architecture=dict(TESTBED_ARCHITECTURE),
        target_sparsity=sparsity,
        rebase_steps=0 if attention == "sparse" else _scaled(REBASE_STEPS, steps_scale),
        warmup_lr_steps=_scaled(WARMUP_STEPS, steps_scale),
        vsa2=vsa2 or VSA2Config(),
        eval_sparsities=EVAL_SPARSITIES,
        report_seeds=2,
        val_every=_scaled(VAL_EVERY, steps_scale),
    )


def rl_base_recipe(
    seed: int = 0,
    steps_scale: float = 1.0,
    vsa2: VSA2Config | None = None,
    low_chunks: int | None = None,
) -> ToyBuildConfig:
    """The base meant for RL at the testbed's size (module docstring): truthful captions,
    ``low_chunks`` (default :data:`RL_LOW_CHUNKS`) runs of the 32 px stage, ``steps_scale`` x
    every stage's steps."""
    chunks = RL_LOW_CHUNKS if low_chunks is None else low_chunks
    if chunks < 1:
        raise ValueError(f"low_chunks: must be >= 1, got {chunks}")
    low = ToyStage(LOW_SIZE, FRAMES, _scaled(RL_LOW_STEPS, steps_scale), RL_LOW_BATCH, vsa2=False)
    stages = [
        *[low] * chunks,
        ToyStage(HIGH_SIZE, FRAMES, _scaled(RL_REBASE_STEPS, steps_scale), BATCH, vsa2=True,
                 sparsity_range=(0.5, 0.9), lr_scale=0.5),
        ToyStage(HIGH_SIZE, FRAMES, _scaled(RL_RANGE_STEPS, steps_scale), BATCH, vsa2=True,
                 sparsity_range=(0.0, 0.9), lr_scale=0.1),
    ]  # fmt: skip
    return ToyBuildConfig(
        seed=seed,
        stages=stages,
        mirrored_captions=0.0,
        architecture=dict(RL_ARCHITECTURE),
        target_sparsity=0.9,
        rebase_steps=_scaled(REBASE_STEPS, steps_scale),
        warmup_lr_steps=_scaled(WARMUP_STEPS, steps_scale),
        vsa2=vsa2 or VSA2Config(),
        eval_sparsities=EVAL_SPARSITIES,
        report_seeds=2,
        val_every=_scaled(VAL_EVERY, steps_scale),
    )


def long_recipe(
    steps: int = LONG_STEPS,
    frames: int = LONG_FRAMES,
    lr_scale: float = LONG_LR_SCALE,
    vsa2: VSA2Config | None = None,
) -> ToyBuildConfig:
    """The shipped toy's recipe (its stages are resumed from ``assets/toy``, not trained again)
    and one stage more at 16 px x ``frames`` frames: ``steps`` of flow matching at sparsities
    drawn from 0 to 0.9 with a fresh AdamW peaking at ``lr_scale`` x the recipe's lr; its
    samples are reported at the testbed's :data:`EVAL_SPARSITIES`."""
    if steps < 1 or frames < 2:
        raise ValueError(f"long_recipe: need steps >= 1 and frames >= 2, got {steps}, {frames}")
    shipped = ToyBuildConfig()
    stage = ToyStage(shipped.stages[-1].size, frames, steps, LONG_BATCH, vsa2=True,
                     sparsity_range=(0.0, 0.9), lr_scale=lr_scale)  # fmt: skip
    return dataclasses.replace(
        shipped,
        stages=[*shipped.stages, stage],
        vsa2=vsa2 or VSA2Config(),
        eval_sparsities=EVAL_SPARSITIES,
        report_seeds=LONG_REPORT_SEEDS,
    )


def low_resolution_recipe(
    seed: int = 0, steps_scale: float = 1.0, mirrored_captions: float = CLAIMS_MIRRORED_CAPTIONS
) -> ToyBuildConfig:
    """The 32 px dense stage that ``dense`` and ``rebase`` start with, alone: build it once and
    resume both from its folder."""
    recipe = testbed_recipe(
        "dense", seed, steps_scale=steps_scale, mirrored_captions=mirrored_captions
    )
    return dataclasses.replace(recipe, stages=recipe.stages[:1])


def fine_tune_recipe(
    base: ToyBuildConfig,
    steps: int,
    sparsity: float,
    seed: int,
    vsa2: VSA2Config | None = None,
    eval_sparsities: tuple[float, ...] | None = None,
    report_seeds: int = 0,
    lr_scale: float = 0.1,
) -> ToyBuildConfig:
    """``base``'s stages and one more at 64 px: ``steps`` of flow matching at ``sparsity``
    (0: dense attention) with a fresh AdamW warmed up to ``lr_scale`` x the recipe's lr, the
    first half of them rebasing (density 1 -> ``1 - sparsity``) where ``base`` has no VSA2
    layers yet; data and new parameters drawn from ``seed``, the router ``vsa2`` (default
    ``base``'s). At ``lr_scale`` 0.3 the fresh optimizer's warm-up doubled a converged base's
    validation loss by step 100, and 400 steps did not bring it back below the base's."""
    has_vsa2 = any(stage.vsa2 for stage in base.stages)
    stage = ToyStage(HIGH_SIZE, FRAMES, steps, BATCH, vsa2=True,
                     sparsity_range=(sparsity, sparsity), lr_scale=lr_scale)  # fmt: skip
    return dataclasses.replace(
        base,
        seed=seed,
        stages=[*base.stages, stage],
        vsa2=vsa2 or base.vsa2,
        target_sparsity=sparsity,
        rebase_steps=0 if has_vsa2 else steps // 2,
        eval_sparsities=eval_sparsities or (sparsity,),
        report_seeds=report_seeds,
    )


def main(argv: list[str] | None = None) -> None:
    """Build one testbed base (module docstring) into ``--out``."""
    parser = argparse.ArgumentParser(description="Build one sparsity-testbed base.")
    parser.add_argument("--out", type=out_folder, required=True, help="output folder")
    parser.add_argument(
        "--recipe", choices=("claims", "rl", "long"), default="claims",
        help="claims: the claims' bases (--attention, --mirrored-captions); rl: the 64 px RL "
        "base; long: the shipped toy grown in time (--long-steps, --frames, --from)",
    )  # fmt: skip
    parser.add_argument(
        "--attention", choices=ATTENTION_SWITCHES, default=None, help="claims: default rebase"
    )
    parser.add_argument("--sparsity", type=SPARSITY, default=None, help="claims: default 0.9")
    parser.add_argument(
        "--mirrored-captions",
        type=SHARE,
        default=None,
        help="share of pretraining videos moving opposite to their caption (claims' bases: 0.5)",
    )
    parser.add_argument(
        "--steps-scale", type=positive_number, default=1.0, help="times every stage's steps"
    )
    parser.add_argument(
        "--low-chunks", type=int, default=None,
        help=f"rl: runs of the 32 px stage (default {RL_LOW_CHUNKS}; each reports its samples)",
    )  # fmt: skip
    parser.add_argument(
        "--long-steps", type=int, default=None,
        help=f"long: steps of the stage at the longer length (default {LONG_STEPS})",
    )  # fmt: skip
    parser.add_argument(
        "--frames", type=int, default=None, help=f"long: frames a video (default {LONG_FRAMES})"
    )
    parser.add_argument(
        "--from", dest="start_from", type=Path, default=None,
        help="long: the built 16 px x 8 frames toy to grow (default: the shipped assets/toy)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int_at_least(0), default=0)
    parser.add_argument("--device", type=device_arg, default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--backend", choices=BACKENDS, default="auto", help="VSA2 kernels")
    parser.add_argument(
        "--resume", action="store_true",
        help="continue the build stopped in --out, if any (same recipe options); a SIGTERM "
        "stops a build with its state saved",
    )  # fmt: skip
    args = parser.parse_args(argv)
    _refuse_other_recipes_options(args, parser)
    vsa2 = VSA2Config(backend=args.backend)
    start_from = None
    if args.recipe == "long":
        start_from = args.start_from or ASSET_DIR
        recipe = long_recipe(
            _scaled(args.long_steps or LONG_STEPS, args.steps_scale),
            args.frames or LONG_FRAMES,
            vsa2=vsa2,
        )
    elif args.recipe == "rl":
        recipe = rl_base_recipe(args.seed, args.steps_scale, vsa2, args.low_chunks)
    else:
        mirrored = args.mirrored_captions
        recipe = testbed_recipe(
            args.attention or "rebase",
            args.seed,
            0.9 if args.sparsity is None else args.sparsity,
            args.steps_scale,
            vsa2=vsa2,
            mirrored_captions=CLAIMS_MIRRORED_CAPTIONS if mirrored is None else mirrored,
        )
    info = _build(args.out, recipe, args.device, args.resume, parser, start_from)
    if info is not None:
        print(json.dumps({"out": str(args.out), "build_seconds": info["build_seconds"]}))


# Each recipe's own options: given to another recipe, they are refused, not ignored.
RECIPE_OPTIONS = {
    "claims": ("attention", "sparsity", "mirrored_captions"),
    "rl": ("low_chunks",),
    "long": ("long_steps", "frames", "start_from"),
}


def _refuse_other_recipes_options(args, parser: argparse.ArgumentParser) -> None:
    """Stops with a usage error naming an option of another recipe than ``--recipe``, or a
    value out of range."""
    for recipe, names in RECIPE_OPTIONS.items():
        for name in names:
            if recipe != args.recipe and getattr(args, name) is not None:
                option = "--from" if name == "start_from" else "--" + name.replace("_", "-")
                parser.error(f"{option} is an option of --recipe {recipe}, not of --recipe "
                             f"{args.recipe} (drop it, or pass --recipe {recipe})")  # fmt: skip
    for name, low in (("low_chunks", 1), ("long_steps", 1), ("frames", 2)):
        value = getattr(args, name)
        if value is not None and value < low:
            parser.error(f"--{name.replace('_', '-')}: must be >= {low}, got {value}")
    if args.start_from is not None and not (args.start_from / CONFIG_FILE).is_file():
        parser.error(f"--from {args.start_from}: no {CONFIG_FILE} there (a built toy folder)")


def _recorded_training(out: Path, parser: argparse.ArgumentParser) -> dict | None:
    """The ``training`` record of the build in ``out`` (None: none there); a usage error where
    its record is garbled."""
    if not (out / CONFIG_FILE).is_file():
        return None
    try:
        training = read_toy_config(out)["training"]
        len(training["stages"])
    except (ValueError, KeyError, TypeError) as error:
        parser.error(f"--out {out}: its {CONFIG_FILE} is not a toy build's record ({error!r}); "
                     "choose another --out")  # fmt: skip
    return training


def _build(
    out: Path,
    recipe: ToyBuildConfig,
    device: str,
    resume: bool,
    parser: argparse.ArgumentParser,
    start_from: Path | None = None,
) -> dict | None:
    """Builds ``recipe`` into ``out``, from the finished first stages in ``start_from`` if given,
    continuing the build stopped in ``out`` with ``resume``; a SIGTERM stops it at the next step
    (or sample setting measured) with its state saved (exit code 143). Returns the build's info,
    or None when ``out`` already holds the finished build."""
    if not resume and ((out / CONFIG_FILE).is_file() or (out / PARTIAL_FILE).is_file()):
        parser.error(f"--out {out} holds a build; pass --resume to continue it, or choose "
                     "another --out")  # fmt: skip
    training = _recorded_training(out, parser)
    if training is not None and "build_device" in training:
        print(f"{out} holds the finished build: nothing to do", file=sys.stderr)
        return None
    finished_stages = 0 if training is None else len(training["stages"])
    resume_from = out if finished_stages else start_from
    try:
        check_resumable(out, recipe, resume_from)
    except ValueError as error:
        parser.error(f"--resume: {error}")
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        return build_toy_model(out, recipe, device=device, stop_requested=stop.is_set,
                               resume_from=resume_from)  # fmt: skip
    except BuildStopped as stopped:
        print(f"{stopped}; continue with the same command and --resume", file=sys.stderr)
        raise SystemExit(143) from None
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    main()
