"""VSA2 attention kernels, installed as ``vsa2_rl.kernels``.

Public entry points:

- ``block_sparse_attention``: fine-stage block-sparse attention over selected key segments with
  a per-(tile, segment) logit bias (Triton, with a pure-torch reference backend);
- ``pool_tiles``: fused mean pooling of the valid tokens of each block;
- ``route``: the VSA2 top-k / top-p router (``RouterOutput``, ``max_kv_for``);
- ``vsa2_attention``: one layer's coarse stage + router + fine stage + gated fusion
  (``VSA2Stats``);
- ``modulated_layer_norm``, ``gated_residual_layer_norm``, ``gated_residual``,
  ``rms_norm_rope``: a Wan block's norms, adaLN modulation, residuals, qk-norm and RoPE fused
  (``fused_block.py``).

Run from the repository root (``python -m pytest``, ``python train_rl.py``), this directory
would also be importable as a top-level ``kernels`` package, the import name of HuggingFace's
``kernels``, which transformers imports when that is installed. Imported by any name other
than ``vsa2_rl.kernels``, this file therefore binds that name to the package it shadows further
down ``sys.path`` (HuggingFace's), or fails the import as if the directory were not there; it
never runs this package a second time (``ops.py`` run again would redefine the ``torch.library``
custom ops and leave ``vsa2_rl.kernels``' op handles dangling).
"""

import importlib.machinery
import importlib.util
import sys
from pathlib import Path


def _bind_the_shadowed_package(name: str) -> None:
    """``sys.modules[name]``: the package of that name found on ``sys.path`` outside the
    repository root; ModuleNotFoundError if there is none."""
    root = Path(__file__).resolve().parents[1]
    elsewhere = [entry for entry in sys.path if Path(entry or ".").resolve() != root]
    spec = importlib.machinery.PathFinder.find_spec(name, elsewhere)
    if spec is None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise


if __name__ == "vsa2_rl.kernels":
    from .fused_block import (
        gated_residual,
        gated_residual_layer_norm,
        modulated_layer_norm,
        rms_norm_rope,
    )
    from .ops import block_sparse_attention
    from .pooling import pool_tiles
    from .router import RouterOutput, max_kv_for, route
    from .vsa2 import VSA2Stats, vsa2_attention
else:  # the import system returns the module bound here, not this one
    _bind_the_shadowed_package(__name__)

__all__ = [
    "RouterOutput",
    "VSA2Stats",
    "block_sparse_attention",
    "gated_residual",
    "gated_residual_layer_norm",
    "max_kv_for",
    "modulated_layer_norm",
    "pool_tiles",
    "rms_norm_rope",
    "route",
    "vsa2_attention",
]
