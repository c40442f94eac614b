"""VSA2 attention kernels, installed as ``vsa2_rl.kernels``.

Public entry points:

- ``block_sparse_attention``: fine-stage block-sparse attention over selected key segments with
  a per-(tile, segment) logit bias (Triton, with a pure-torch reference backend);
- ``pool_tiles``: fused mean pooling of the valid tokens of each block;
- ``route``: the VSA2 top-k / top-p router (``RouterOutput``, ``max_kv_for``);
- ``vsa2_attention``: one layer's coarse stage + router + fine stage + gated fusion
  (``VSA2Stats``).

Run from the repository root (``python -m pytest``, ``python train_rl.py``), this directory is
also importable as a top-level ``kernels`` package, the import name of HuggingFace's ``kernels``,
which transformers probes with ``importlib.import_module("kernels")``. Executing ``ops.py`` a
second time would redefine the ``torch.library`` custom ops; torch then destroys the first
registration and ``vsa2_rl.kernels``' op handles point at freed dispatcher entries (an
intermittent segfault on the next call). Any other import name is therefore bound to the one
``vsa2_rl.kernels`` package and its submodules instead of running this code again.
"""

import importlib
import sys

if __name__ != "vsa2_rl.kernels":
    importlib.import_module("vsa2_rl.kernels")
    for _name, _module in list(sys.modules.items()):
        if _name == "vsa2_rl.kernels" or _name.startswith("vsa2_rl.kernels."):
            sys.modules[__name__ + _name[len("vsa2_rl.kernels") :]] = _module

from .ops import block_sparse_attention
from .pooling import pool_tiles
from .router import RouterOutput, max_kv_for, route
from .vsa2 import VSA2Stats, vsa2_attention

__all__ = [
    "RouterOutput",
    "VSA2Stats",
    "block_sparse_attention",
    "max_kv_for",
    "pool_tiles",
    "route",
    "vsa2_attention",
]
