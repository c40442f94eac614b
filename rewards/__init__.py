"""Rewards for vsa2_rl: the reward registry, built-in video rewards and their mixing.

``get_reward(spec, **kwargs)`` builds a registered reward, an installed plug-in (entry point
group ``vsa2_rl.rewards``) or ``"package.module:callable"``; ``RewardMixer`` computes several
rewards concurrently and combines them at the reward or the advantage level. Importing this
package registers the built-ins: ``dynamic_degree``, ``motion_smoothness``, ``temporal_flicker``,
``motion_quality`` (optical flow), ``aesthetic`` (LAION predictor on open_clip, local weights),
``clip_score``, ``pickscore``, ``hpsv2`` (prompt-frame cosine of open_clip embeddings, local
weights), ``subject_consistency`` and ``background_consistency`` (VBench, DINO / CLIP features),
``image_quality`` (weight-free sharpness, colourfulness, exposure, gated by a noise estimate),
``image_consistency`` (image-to-video: SSIM of the first frames to the condition image),
``prompt_motion``, ``prompt_direction`` and ``shape_fidelity`` (the toy task's known-answer
motion rewards and shape guard, defined with the task in :mod:`vsa2_rl.toy.rewards`),
``vlm_judge`` (a local transformers video-language model's yes/no log-odds or scalar head) and
``random`` (the control of RL experiments).
"""

# The toy task keeps its rewards with its other parts; importing them registers their names.
import vsa2_rl.toy.rewards  # noqa: F401

from . import (  # noqa: F401
    aesthetic,
    clip_score,
    consistency,
    control,
    image_consistency,
    image_quality,
    motion,
    videoalign,
    vlm_judge,
)
from .mixing import (
    RewardMixer,
    RewardOutput,
    combine_advantages,
    evaluation_scores,
    finite_mean_std,
)
from .registry import (
    ENTRY_POINT_GROUP,
    Reward,
    RewardBuildError,
    RewardError,
    RewardFn,
    RewardSkip,
    get_reward,
    list_rewards,
    register_reward,
)
from .videos import check_videos

__all__ = [
    "ENTRY_POINT_GROUP",
    "Reward",
    "RewardBuildError",
    "RewardError",
    "RewardFn",
    "RewardMixer",
    "RewardOutput",
    "RewardSkip",
    "check_videos",
    "combine_advantages",
    "evaluation_scores",
    "finite_mean_std",
    "get_reward",
    "list_rewards",
    "register_reward",
]
