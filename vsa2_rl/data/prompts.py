"""Built-in prompt sets of the embedded default: captions of the synthetic moving-shape videos.

``toy_prompts("train")`` lists every caption the toy model was trained on
("a <color> <shape> moving <direction> <speed>", see :mod:`vsa2_rl.data.synthetic`);
``toy_prompts("eval")`` is a fixed 21-prompt subset that covers every colour, shape, direction
and speed, small enough for a quick sparsity sweep on CPU.
"""

from __future__ import annotations

from vsa2_rl.data.synthetic import all_specs

SPLITS = ("train", "eval")
EVAL_STRIDE = 7  # every 7th spec of all_specs(): 21 prompts, every attribute value covered


def toy_prompts(split: str = "train") -> list[str]:
    """Prompts of the toy motion task for ``split`` ("train" or "eval")."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    specs = all_specs()
    if split == "eval":
        specs = specs[::EVAL_STRIDE]
    return [spec.prompt for spec in specs]
