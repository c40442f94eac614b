"""Video DiTs with VSA2 self-attention: diffusers Wan integration, bundles, sparse rebasing.

The toy task's model is in :mod:`vsa2_rl.toy.model`.
"""

from vsa2_rl.models.experts import WanExperts
from vsa2_rl.models.rebase import RebaseSchedule, rebase_to_vsa2
from vsa2_rl.models.wan import enable_vsa2, vsa2_parameters
from vsa2_rl.models.wan_bundle import VideoDiTBundle, WanBundle, load_wan_bundle, with_transformer

__all__ = [
    "RebaseSchedule",
    "VideoDiTBundle",
    "WanBundle",
    "WanExperts",
    "enable_vsa2",
    "load_wan_bundle",
    "rebase_to_vsa2",
    "vsa2_parameters",
    "with_transformer",
]
