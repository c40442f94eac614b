"""Motion rewards on dense optical flow: dynamic degree, smoothness, flicker, and a combination.

All four follow the VBench dimensions of the same names (Huang et al., CVPR 2024) but are
continuous per-video scores suitable as RL rewards (no gradient is taken through them);
higher is better for each.

- ``dynamic_degree``: per consecutive frame pair, the mean of the top 5% flow magnitudes
  (VBench's per-pair statistic), divided by ``min(H, W) / 256`` so that it is in pixels at a
  256-pixel short side (VBench's resolution normalisation, applied before it thresholds at 6.0
  to call a pair "moving"); the reward is the mean over pairs. Range [0, inf), 0 = static.
- ``motion_smoothness``: how well each interior frame is predicted by flow-based interpolation
  of its two neighbours (VBench uses a learned interpolator, AMT, for the same test). With ``F``
  the flow from frame t-1 to t+1, the prediction of frame t is the mean of frame t-1 warped by
  ``-F/2`` and frame t+1 warped by ``+F/2`` (the linear-motion midpoint, Super SloMo's
  approximation at t = 1/2). Reward = 1 - mean absolute prediction error. Range [0, 1],
  1 = every frame is exactly the midpoint of its neighbours. Needs at least 3 frames.
- ``temporal_flicker``: frame t+1 is warped back onto frame t along the flow (motion
  compensation); the residual is averaged over blocks of ``block`` pixels per channel, so texture
  misalignment largely cancels while brightness/colour changes (flicker) remain; instability is
  the mean absolute block residual. Reward = 1 - instability. Range [0, 1], 1 = no flicker.
- ``motion_quality``: a weighted mean (default weights 1, 1, 1) of three terms in [0, 1]:
  ``d / (d + dynamic_scale)`` (dynamic degree squashed, 0.5 at VBench's 6.0 threshold),
  ``exp(-interpolation_error / error_scale)`` and ``exp(-flicker_instability / error_scale)``
  (``error_scale`` 0.02 = a 2% mean error, a mediocre VBench smoothness, maps to 1/e). The
  exponential spreads the small errors of real videos over [0, 1], so that the policy cannot buy
  dynamic degree with jitter or flicker; static videos are perfectly smooth but score 0 on the
  first term. Range [0, 1].

Pixels whose flow points outside the frame are left out of every average. Videos are processed
one at a time (bounded memory for long videos); the frame pairs of a video are batched.
Flow backends (kwarg ``flow``): ``"dis"`` (default), ``"farneback"``, ``"raft_small"``,
``"raft_large"`` (with ``raft_path``); see :mod:`vsa2_rl.rewards.flow`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .flow import FlowEstimator, backward_warp, build_flow_estimator
from .registry import RewardFn, register_reward

# VBench's dynamic-degree threshold (pixels at a 256-pixel short side).
VBENCH_DYNAMIC_THRESHOLD = 6.0


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` (broadcastable) is true; 0 when nothing is valid."""
    weights = mask.to(values.dtype).expand_as(values)
    return (values * weights).sum() / weights.sum().clamp_min(1.0)


def dynamic_degree_from_flow(flow: torch.Tensor, top_fraction: float = 0.05) -> torch.Tensor:
    """Continuous VBench dynamic degree of one video from its pair flows [N, 2, H, W]."""
    height, width = flow.shape[-2:]
    magnitude = flow.float().norm(dim=1).flatten(1)  # (N, H*W)
    count = max(1, int(magnitude.shape[1] * top_fraction))
    top_mean = magnitude.topk(count, dim=1).values.mean(dim=1)  # (N,)
    return (top_mean / (min(height, width) / 256.0)).mean()


def interpolation_error(video: torch.Tensor, skip_flow: torch.Tensor) -> torch.Tensor:
    """Mean |frame t - midpoint interpolation of frames t-1, t+1| for video [T, C, H, W].

    skip_flow [T-2, 2, H, W] is the flow from frame t-1 to frame t+1.
    """
    half = 0.5 * skip_flow
    from_prev, valid_prev = backward_warp(video[:-2], -half)
    from_next, valid_next = backward_warp(video[2:], half)
    predicted = 0.5 * (from_prev + from_next)
    error = (predicted - video[1:-1].float()).abs()  # (T-2, C, H, W)
    return _masked_mean(error, valid_prev & valid_next)


def flicker_instability(video: torch.Tensor, flow: torch.Tensor, block: int) -> torch.Tensor:
    """Mean absolute block-averaged motion-compensated residual of video [T, C, H, W].

    flow [T-1, 2, H, W] is the flow from frame t to frame t+1.
    """
    warped, valid = backward_warp(video[1:], flow)
    valid_f = valid.float()
    residual = (warped - video[:-1].float()) * valid_f  # (T-1, C, H, W)
    block = max(1, min(block, *video.shape[-2:]))
    residual_sum = F.avg_pool2d(residual, block, stride=block)
    valid_fraction = F.avg_pool2d(valid_f, block, stride=block)  # (T-1, 1, h, w)
    block_mean = residual_sum / valid_fraction.clamp_min(1e-6)
    # Blocks mostly outside the motion-compensated area carry too few pixels to be trusted.
    return _masked_mean(block_mean.abs(), valid_fraction >= 0.5)


def _check_channels(video: torch.Tensor) -> None:
    if video.shape[1] not in (1, 3):
        raise ValueError(f"videos: expected 1 or 3 channels, got {video.shape[1]}")


class _FlowCache:
    """Flows of one video, computed on first use so combined rewards estimate each flow once."""

    def __init__(self, estimate: FlowEstimator, video: torch.Tensor) -> None:
        _check_channels(video)
        self.estimate = estimate
        self.video = video
        self._consecutive: torch.Tensor | None = None
        self._skip: torch.Tensor | None = None

    @property
    def consecutive(self) -> torch.Tensor:  # frame t -> t+1, (T-1, 2, H, W)
        if self._consecutive is None:
            self._consecutive = self.estimate(self.video[:-1], self.video[1:])
        return self._consecutive

    @property
    def skip(self) -> torch.Tensor:  # frame t-1 -> t+1, (T-2, 2, H, W)
        if self.video.shape[0] < 3:
            raise ValueError(
                f"motion_smoothness needs videos of at least 3 frames, got {self.video.shape[0]}"
            )
        if self._skip is None:
            self._skip = self.estimate(self.video[:-2], self.video[2:])
        return self._skip


def _flow_reward(
    name: str,
    per_video: Callable[[_FlowCache], torch.Tensor],
    *,
    flow: str,
    raft_path: str | None,
    num_flow_updates: int,
    chunk_size: int,
) -> RewardFn:
    estimate = build_flow_estimator(
        flow,
        raft_path=raft_path,
        num_flow_updates=num_flow_updates,
        chunk_size=chunk_size,
        config_prefix="kwargs",
    )

    def reward(videos: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        with torch.no_grad():
            values = [per_video(_FlowCache(estimate, video)) for video in videos]
        return torch.stack(values).float()

    reward.__name__ = name
    return reward


def _default_block(video: torch.Tensor) -> int:
    # An eighth of the short side: large enough to average out texture misalignment, small
    # enough to see local flicker (e.g. one region pulsing).
    return max(4, min(video.shape[-2:]) // 8)


@register_reward("dynamic_degree")
def dynamic_degree(
    *,
    flow: str = "dis",
    raft_path: str | None = None,
    num_flow_updates: int = 12,
    chunk_size: int = 16,
    top_fraction: float = 0.05,
) -> RewardFn:
    """Continuous VBench dynamic degree (pixels at a 256-pixel short side); range [0, inf)."""
    if not 0 < top_fraction <= 1:
        raise ValueError(f"kwargs.top_fraction: must be in (0, 1], got {top_fraction}")
    return _flow_reward(
        "dynamic_degree",
        lambda cache: dynamic_degree_from_flow(cache.consecutive, top_fraction),
        flow=flow,
        raft_path=raft_path,
        num_flow_updates=num_flow_updates,
        chunk_size=chunk_size,
    )


@register_reward("motion_smoothness")
def motion_smoothness(
    *,
    flow: str = "dis",
    raft_path: str | None = None,
    num_flow_updates: int = 12,
    chunk_size: int = 16,
) -> RewardFn:
    """1 - mean error of flow-based midpoint interpolation of each interior frame; [0, 1]."""
    return _flow_reward(
        "motion_smoothness",
        lambda cache: 1.0 - interpolation_error(cache.video, cache.skip),
        flow=flow,
        raft_path=raft_path,
        num_flow_updates=num_flow_updates,
        chunk_size=chunk_size,
    )


@register_reward("temporal_flicker")
def temporal_flicker(
    *,
    flow: str = "dis",
    raft_path: str | None = None,
    num_flow_updates: int = 12,
    chunk_size: int = 16,
    block: int | None = None,
) -> RewardFn:
    """1 - mean absolute block-averaged motion-compensated frame difference; [0, 1].

    ``block``: side in pixels of the averaging blocks; default an eighth of the short side.
    """
    if block is not None and block < 1:
        raise ValueError(f"kwargs.block: must be >= 1, got {block}")

    def per_video(cache: _FlowCache) -> torch.Tensor:
        window = block or _default_block(cache.video)
        return 1.0 - flicker_instability(cache.video, cache.consecutive, window)

    return _flow_reward(
        "temporal_flicker",
        per_video,
        flow=flow,
        raft_path=raft_path,
        num_flow_updates=num_flow_updates,
        chunk_size=chunk_size,
    )


@register_reward("motion_quality")
def motion_quality(
    *,
    flow: str = "dis",
    raft_path: str | None = None,
    num_flow_updates: int = 12,
    chunk_size: int = 16,
    dynamic_weight: float = 1.0,
    smoothness_weight: float = 1.0,
    flicker_weight: float = 1.0,
    dynamic_scale: float = VBENCH_DYNAMIC_THRESHOLD,
    error_scale: float = 0.02,
    block: int | None = None,
) -> RewardFn:
    """Weighted mean of d / (d + dynamic_scale), exp(-smoothness error / error_scale) and
    exp(-flicker instability / error_scale); range [0, 1]."""
    weights = {
        "dynamic_weight": dynamic_weight,
        "smoothness_weight": smoothness_weight,
        "flicker_weight": flicker_weight,
    }
    for key, value in weights.items():
        if value < 0:
            raise ValueError(f"kwargs.{key}: must be >= 0, got {value}")
    total = sum(weights.values())
    if total <= 0:
        raise ValueError("rewards.motion_quality: at least one of the three weights must be > 0")
    for key, value in (("dynamic_scale", dynamic_scale), ("error_scale", error_scale)):
        if value <= 0:
            raise ValueError(f"kwargs.{key}: must be > 0, got {value}")

    def per_video(cache: _FlowCache) -> torch.Tensor:
        degree = dynamic_degree_from_flow(cache.consecutive)
        smooth_error = interpolation_error(cache.video, cache.skip)
        instability = flicker_instability(
            cache.video, cache.consecutive, block or _default_block(cache.video)
        )
        mixed = (
            dynamic_weight * degree / (degree + dynamic_scale)
            + smoothness_weight * torch.exp(-smooth_error / error_scale)
            + flicker_weight * torch.exp(-instability / error_scale)
        )
        return mixed / total

    return _flow_reward(
        "motion_quality",
        per_video,
        flow=flow,
        raft_path=raft_path,
        num_flow_updates=num_flow_updates,
        chunk_size=chunk_size,
    )
