"""Dense optical flow for the motion rewards: a weight-free OpenCV backend and torchvision RAFT.

Every backend maps two frame batches ``src, dst`` of shape [N, C, H, W] in [0, 1] to a flow
[N, 2, H, W] (float32, channels (dx, dy) in pixels, on ``src``'s device) with the usual
convention ``src(x) ~= dst(x + flow(x))``, the convention of ``cv2.calcOpticalFlow*`` and of
RAFT (Teed & Deng, ECCV 2020).

- ``"dis"`` (default): OpenCV's Dense Inverse Search (Kroeger et al., ECCV 2016), CPU, no
  weights, a few ms per 64x64 pair.
- ``"farneback"``: OpenCV's polynomial-expansion flow (Farneback, SCIA 2003), CPU, no weights.
- ``"raft_small"`` / ``"raft_large"``: torchvision's RAFT, weights loaded from a local state-dict
  file (``raft_path``; torchvision's ``Raft_*_Weights`` checkpoints are such files). Runs on the
  device of the frames, pairs batched in chunks; frames with a short side below 128 pixels are
  upsampled for RAFT and the flow scaled back. Nothing is ever downloaded.

``backward_warp`` resamples a frame along a flow; the motion rewards use it for motion
compensation and flow-based frame interpolation.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

FlowEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

FLOW_BACKENDS = ("dis", "farneback", "raft_small", "raft_large")

# OpenCV's DIS refuses frames whose longer side is below this.
DIS_MIN_SIDE = 12

# Shortest frame side torchvision RAFT accepts (16 feature pixels at 1/8 resolution).
RAFT_MIN_SIDE = 128

# ITU-R BT.601 luma weights, the ones cv2.cvtColor(RGB2GRAY) uses.
_LUMA = (0.299, 0.587, 0.114)


def to_gray(frames: torch.Tensor) -> torch.Tensor:
    """Luma of frames [N, C, H, W] (C = 1 or 3) as [N, 1, H, W]."""
    channels = frames.shape[1]
    if channels == 1:
        return frames
    if channels == 3:
        weights = frames.new_tensor(_LUMA).view(1, 3, 1, 1)
        return (frames * weights).sum(dim=1, keepdim=True)
    raise ValueError(f"videos: expected 1 (grey) or 3 (RGB) channels, got {channels}")


class OpenCVFlow:
    """Weight-free CPU flow (DIS or Farneback) on 8-bit luma, one pair at a time.

    OpenCV releases the GIL inside ``calc``, so several rewards running in the mixer's thread
    pool overlap here with GPU work.
    """

    def __init__(self, method: str = "dis") -> None:
        if method not in ("dis", "farneback"):
            raise ValueError(f"OpenCVFlow: method must be 'dis' or 'farneback', got {method!r}")
        # Imported here: only this backend needs OpenCV (RAFT runs on GPU images without it).
        import cv2

        self._cv2 = cv2
        self.method = method
        # A DIS object keeps scratch buffers; one per thread keeps concurrent calls safe.
        self._local = threading.local()

    def _dis(self):
        dis = getattr(self._local, "dis", None)
        if dis is None:
            dis = self._cv2.DISOpticalFlow_create(self._cv2.DISOPTICAL_FLOW_PRESET_MEDIUM)
            self._local.dis = dis
        return dis

    def _pair(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        if self.method == "dis":
            return self._dis().calc(a, b, None)
        # pyramid 0.5 x 3 levels, 15 px window, 3 iterations, poly_n 5, sigma 1.2: the values
        # of OpenCV's optical-flow tutorial, robust on general video.
        return self._cv2.calcOpticalFlowFarneback(a, b, None, 0.5, 3, 15, 3, 5, 1.2, 0)

    def __call__(self, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        def to_u8(x: torch.Tensor) -> np.ndarray:
            gray = to_gray(x.detach().float()).squeeze(1)
            return (gray * 255.0).round().clamp(0, 255).to(torch.uint8).cpu().numpy()

        if self.method == "dis" and max(src.shape[-2:]) < DIS_MIN_SIDE:
            raise ValueError(
                f"DIS flow needs frames with a side of at least {DIS_MIN_SIDE} pixels, got "
                f"{tuple(src.shape[-2:])}; use flow='farneback' for such small videos"
            )
        a, b = to_u8(src), to_u8(dst)
        flows = np.stack([self._pair(a[i], b[i]) for i in range(a.shape[0])])  # (N, H, W, 2)
        return torch.from_numpy(flows).permute(0, 3, 1, 2).to(src.device, torch.float32)


class RaftFlow:
    """torchvision RAFT from a local state dict; batched over pairs on the frames' device."""

    def __init__(
        self,
        arch: str,
        weights_path: str,
        *,
        num_flow_updates: int = 12,
        chunk_size: int = 16,
    ) -> None:
        from torchvision.models.optical_flow import raft_large, raft_small

        builders = {"raft_small": raft_small, "raft_large": raft_large}
        if arch not in builders:
            raise ValueError(f"RaftFlow: arch must be one of {sorted(builders)}, got {arch!r}")
        if num_flow_updates < 1:
            raise ValueError(f"RaftFlow: num_flow_updates must be >= 1, got {num_flow_updates}")
        if chunk_size < 1:
            raise ValueError(f"RaftFlow: chunk_size must be >= 1, got {chunk_size}")
        model = builders[arch](weights=None)
        state = torch.load(weights_path, map_location="cpu", weights_only=True)
        try:
            model.load_state_dict(state)
        except RuntimeError as exc:
            raise ValueError(
                f"raft_path: {weights_path} is not a torchvision {arch} state dict ({exc}); "
                f"check flow= matches the checkpoint's architecture"
            ) from exc
        self.model = model.eval().requires_grad_(False)
        self.num_flow_updates = num_flow_updates
        self.chunk_size = chunk_size
        self._lock = threading.Lock()

    def _on(self, device: torch.device) -> torch.nn.Module:
        with self._lock:
            if next(self.model.parameters()).device != device:
                self.model.to(device)
        return self.model

    def __call__(self, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        if src.shape[1] == 1:  # RAFT's encoders take RGB
            src, dst = src.expand(-1, 3, -1, -1), dst.expand(-1, 3, -1, -1)
        height, width = src.shape[-2:]
        # torchvision's correlation pyramid needs >= 16x16 features at 1/8 resolution: upsample
        # smaller frames to a 128-pixel short side, then scale the flow back down.
        scale = max(1.0, RAFT_MIN_SIDE / min(height, width))
        run_h, run_w = math.ceil(height * scale), math.ceil(width * scale)
        # RAFT works at 1/8 resolution: pad right/bottom to a multiple of 8 by edge replication.
        pad_h, pad_w = (-run_h) % 8, (-run_w) % 8
        model = self._on(src.device)
        out = []
        with torch.no_grad():
            for start in range(0, src.shape[0], self.chunk_size):
                pair = torch.cat(
                    [src[start : start + self.chunk_size], dst[start : start + self.chunk_size]]
                ).float()
                if scale > 1.0:
                    pair = F.interpolate(pair, size=(run_h, run_w), mode="bilinear")
                pair = F.pad(pair * 2.0 - 1.0, (0, pad_w, 0, pad_h), mode="replicate")
                a, b = pair.chunk(2)
                flow = model(a, b, num_flow_updates=self.num_flow_updates)[-1][..., :run_h, :run_w]
                if scale > 1.0:
                    flow = F.interpolate(flow, size=(height, width), mode="bilinear")
                    flow = flow * flow.new_tensor([width / run_w, height / run_h]).view(1, 2, 1, 1)
                out.append(flow)
        return torch.cat(out).float()


def build_flow_estimator(
    backend: str = "dis",
    *,
    raft_path: str | None = None,
    num_flow_updates: int = 12,
    chunk_size: int = 16,
    config_prefix: str = "kwargs",
) -> FlowEstimator:
    """Return the flow estimator ``backend`` (one of ``FLOW_BACKENDS``).

    RAFT backends need ``raft_path``, a local torchvision RAFT state dict of that architecture;
    a missing file fails here, naming the key ``<config_prefix>.raft_path``.
    """
    if backend not in FLOW_BACKENDS:
        raise ValueError(
            f"{config_prefix}.flow: unknown flow backend {backend!r}; "
            f"choose one of {', '.join(FLOW_BACKENDS)}"
        )
    if backend in ("dis", "farneback"):
        return OpenCVFlow(backend)
    if raft_path is None:
        raise ValueError(
            f"{config_prefix}.raft_path: flow={backend!r} needs the path of a local torchvision "
            f"{backend} state dict (nothing is downloaded), or use flow='dis'"
        )
    if not os.path.isfile(raft_path):
        raise ValueError(f"{config_prefix}.raft_path: file not found: {raft_path}")
    return RaftFlow(backend, raft_path, num_flow_updates=num_flow_updates, chunk_size=chunk_size)


def backward_warp(image: torch.Tensor, flow: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``image`` at ``x + flow(x)`` (bilinear).

    image [N, C, H, W], flow [N, 2, H, W] in pixels. Returns (warped [N, C, H, W],
    valid [N, 1, H, W] bool): valid is False where the sample point falls outside the image,
    so callers can leave those pixels out instead of trusting border padding.
    """
    height, width = image.shape[-2:]
    ys, xs = torch.meshgrid(
        torch.arange(height, device=image.device, dtype=torch.float32),
        torch.arange(width, device=image.device, dtype=torch.float32),
        indexing="ij",
    )
    sample_x = xs + flow[:, 0]  # (N, H, W)
    sample_y = ys + flow[:, 1]
    valid = (sample_x >= 0) & (sample_x <= width - 1) & (sample_y >= 0) & (sample_y <= height - 1)
    # grid_sample wants coordinates in [-1, 1] with align_corners=True mapping -1/1 to pixel
    # centres 0 and size - 1.
    grid = torch.stack(
        [2.0 * sample_x / max(width - 1, 1) - 1.0, 2.0 * sample_y / max(height - 1, 1) - 1.0],
        dim=-1,
    )
    warped = F.grid_sample(
        image.float(), grid, mode="bilinear", padding_mode="border", align_corners=True
    )
    return warped, valid.unsqueeze(1)
