"""vsa2_rl: RL post-training (Flow-GRPO, DiffusionNFT) of video diffusion transformers with VSA2
sparse attention.

Subpackages: ``attention`` (tiling, sparsity state, VSA2 module), ``models`` (Wan processor,
sparse rebasing), ``toy`` (the small Wan-architecture model and its testbed), ``rl`` (trainer,
the two update rules, group advantages, sparsity schedule, checkpoints), ``eval`` (sparsity
sweeps, rollout agreement), ``kernels`` (Triton kernels) and ``rewards`` (reward registry and
built-ins). Imports stay lazy here so ``import vsa2_rl`` is cheap; see README.md for the entry
commands.
"""

__version__ = "0.1.0"
