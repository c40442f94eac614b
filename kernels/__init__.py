"""VSA2 attention kernels, installed as ``vsa2_rl.kernels``.

Public entry points:

- ``block_sparse_attention``: fine-stage block-sparse attention over selected key segments with
  a per-(tile, segment) logit bias (Triton, with a pure-torch reference backend);
- ``pool_tiles``: fused mean pooling of the valid tokens of each block;
- ``route``: the VSA2 top-k / top-p router (``RouterOutput``, ``max_kv_for``);
- ``vsa2_attention``: one layer's coarse stage + router + fine stage + gated fusion
  (``VSA2Stats``).
"""

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
