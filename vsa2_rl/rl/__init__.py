"""RL post-training building blocks: group advantages and the PPO-clip loss, sparsity schedule,
checkpoints, EMA.

The trainer loop lives in ``vsa2_rl.rl.trainer``, its two update rules behind
``vsa2_rl.rl.update.UpdateRule``: Flow-GRPO (``flow_grpo``) and DiffusionNFT (``nft``); the
samplers with per-step log-probs live in ``vsa2_rl.sampling`` because evaluation uses them too.
"""

from vsa2_rl.rl.checkpoint import (
    capture_rng_state,
    checkpoint_step,
    find_latest,
    list_checkpoints,
    load_checkpoint,
    load_latest,
    restore_rng_state,
    save_checkpoint,
)
from vsa2_rl.rl.ema import EMA
from vsa2_rl.rl.grpo import (
    GroupAdvantages,
    GroupedPromptSampler,
    PromptBatch,
    gather_group_rewards,
    gaussian_kl,
    group_advantages,
    grpo_loss,
)
from vsa2_rl.rl.schedule import SparsityLevels, SparsitySchedule, plot_schedule

__all__ = [
    "EMA",
    "GroupAdvantages",
    "GroupedPromptSampler",
    "PromptBatch",
    "SparsityLevels",
    "SparsitySchedule",
    "capture_rng_state",
    "checkpoint_step",
    "find_latest",
    "gather_group_rewards",
    "gaussian_kl",
    "group_advantages",
    "grpo_loss",
    "list_checkpoints",
    "load_checkpoint",
    "load_latest",
    "plot_schedule",
    "restore_rng_state",
    "save_checkpoint",
]
