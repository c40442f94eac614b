"""The toy task's prompts: its 144 captions split into disjoint train and eval sets.

The captions are "a <color> <shape> moving <direction> <speed>", one per combination of the
synthetic videos' attributes (:mod:`vsa2_rl.toy.data`). They are split so that evaluation
measures generalisation to unseen combinations, not memorisation: ``toy_prompts("eval")`` holds
the 24 combinations whose index sum ``color + shape + direction + 3 * speed`` is a multiple of 6
(every colour occurs 4 times, every shape 8, every direction 6 and each speed 12, in other company
than in training), ``toy_prompts("train")`` the other 120. The eval prompts come in a fixed
shuffled order, so that the first N (``eval.num_prompts``) mix all attribute values. They are the
prompts of a run without a prompt file (``prompts.file`` and ``prompts.eval_file`` empty).
"""

from __future__ import annotations

import torch

from vsa2_rl.toy.data import COLORS, DIRECTIONS, SHAPES, TRAVEL, ShapeSpec, all_specs

SPLITS = ("train", "eval")
HELD_OUT_MODULUS = 6  # 1 combination in 6 is held out for evaluation
_EVAL_ORDER_SEED = 0


def is_held_out(spec: ShapeSpec) -> bool:
    """Whether ``spec``'s combination belongs to the evaluation split."""
    index = (
        list(COLORS).index(spec.color)
        + SHAPES.index(spec.shape)
        + list(DIRECTIONS).index(spec.direction)
        + 3 * list(TRAVEL).index(spec.speed)
    )
    return index % HELD_OUT_MODULUS == 0


def toy_prompts(split: str = "train") -> list[str]:
    """Prompts of the toy motion task for ``split`` ("train" or "eval"), disjoint sets."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    held_out = split == "eval"
    specs = [spec for spec in all_specs() if is_held_out(spec) == held_out]
    if held_out:
        generator = torch.Generator().manual_seed(_EVAL_ORDER_SEED)
        order = torch.randperm(len(specs), generator=generator)
        specs = [specs[i] for i in order.tolist()]
    return [spec.prompt for spec in specs]
