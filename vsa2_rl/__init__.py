"""vsa2_rl: Flow-GRPO post-training of video diffusion transformers with VSA2 sparse attention.

Subpackages: ``attention`` (tiling, sparsity state, VSA2 module), ``models`` (Wan processor, toy
model, sparse rebasing), ``rl`` (GRPO, trainer, schedule, checkpoints), ``eval`` (sparsity
sweeps), ``kernels`` (Triton kernels) and ``rewards`` (reward registry and built-ins). Imports
stay lazy here so ``import vsa2_rl`` is cheap; see README.md for the two entry commands.
"""

__version__ = "0.1.0"
