"""The control reward of RL experiments: a value that says nothing about the video.

``random`` scores every sample with a uniform draw in [0, 1) that depends only on the reward's
``seed`` and the sample's identity in the metadata (``sample_seed``, the seed of its initial
noise in training; ``prompt_index`` otherwise), never on its pixels. A run with it and the same
settings as a real run is the yardstick for "RL learned something": whatever the control run's
metrics do (drift of the policy under advantages of pure noise) is not the reward's doing.
Deterministic, so a resumed control run scores its samples as the uninterrupted one would.
"""

from __future__ import annotations

import torch

from .registry import RewardFn, register_reward


@register_reward("random")
def random_reward(*, seed: int = 0) -> RewardFn:
    """Uniform [0, 1) per sample, from ``seed`` and the sample's metadata alone."""

    def reward(videos: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        values = []
        for entry in metadata:
            identity = int(entry.get("sample_seed", entry.get("prompt_index", 0)))
            generator = torch.Generator().manual_seed((seed * 1_000_003 + identity) % (2**63 - 1))
            values.append(torch.rand((), generator=generator))
        return torch.stack(values).to(videos.device)

    reward.__name__ = "random"
    return reward
