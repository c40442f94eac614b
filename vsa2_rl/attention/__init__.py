"""VSA2 attention for video DiTs: token tiling, the shared sparsity state, the per-layer module."""

from vsa2_rl.attention.layout import TileLayout
from vsa2_rl.attention.module import VSA2Attention
from vsa2_rl.attention.state import SparsityState

__all__ = ["SparsityState", "TileLayout", "VSA2Attention"]
