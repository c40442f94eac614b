"""Optical-flow motion rewards on synthetic videos of known motion (vsa2_rl.rewards.motion)."""

import pytest
import torch
import torch.nn.functional as F

from vsa2_rl.rewards import RewardError, get_reward
from vsa2_rl.rewards.flow import RaftFlow, backward_warp, build_flow_estimator
from vsa2_rl.rewards.motion import (
    dynamic_degree_from_flow,
    flicker_instability,
    interpolation_error,
)

SIZE, SQUARE, FRAMES = 64, 24, 6


def square_video(positions, *, seed=0, size=SIZE, square=SQUARE):
    """A textured square at the given (x, y) per frame on a flat grey background: [T, 3, S, S]."""
    generator = torch.Generator().manual_seed(seed)
    # Lightly smoothed noise: enough texture for flow everywhere inside the square.
    texture = F.avg_pool2d(torch.rand(1, 3, square, square, generator=generator), 3, 1, 1)[0]
    frames = []
    for x, y in positions:
        frame = torch.full((3, size, size), 0.3)
        frame[:, y : y + square, x : x + square] = texture
        frames.append(frame)
    return torch.stack(frames)


def moving(speed, frames=FRAMES):
    return square_video([(8 + speed * t, 20) for t in range(frames)])


def jittery(frames=FRAMES, amplitude=3):
    generator = torch.Generator().manual_seed(1)
    signs = torch.randint(0, 2, (frames, 2), generator=generator) * 2 - 1
    return square_video(
        [
            (8 + 2 * t + amplitude * int(sx), 20 + amplitude * int(sy))
            for t, (sx, sy) in enumerate(signs)
        ]
    )


def flickering(frames=FRAMES, dip=0.8):
    gains = torch.tensor([1.0 if t % 2 == 0 else dip for t in range(frames)])
    return moving(2, frames) * gains.view(frames, 1, 1, 1)


@pytest.mark.parametrize("backend", ["dis", "farneback"])
def test_dynamic_degree_ranks_speeds(backend):
    videos = torch.stack([moving(0), moving(1), moving(3)])
    values = get_reward("dynamic_degree", flow=backend)(videos, ["p"] * 3)
    assert values.dtype == torch.float32
    assert values[0] < values[1] < values[2]
    assert values[0] == pytest.approx(0.0, abs=0.05)
    # Speed s px/frame at a 64-px short side is 4 s in 256-px units; the square covers 14% of
    # the frame, so the top 5% magnitudes are all inside it.
    assert values[2].item() == pytest.approx(12.0, rel=0.1)


def test_dynamic_degree_closed_form():
    flow = torch.zeros(2, 2, 32, 64)
    flow[0, 0], flow[0, 1] = 3.0, 4.0  # |flow| = 5 everywhere
    flow[1, 0, :4, :] = 10.0  # 256 of 2048 pixels moving 10 px: top 5% (102 px) all = 10
    # scale = min(32, 64) / 256 = 1/8
    expected = (5.0 * 8 + 10.0 * 8) / 2
    assert dynamic_degree_from_flow(flow).item() == pytest.approx(expected)


def test_backward_warp_integer_shift_and_validity():
    image = torch.rand(1, 3, 8, 10)
    flow = torch.zeros(1, 2, 8, 10)
    flow[:, 0] = 2.0  # sample two pixels to the right
    warped, valid = backward_warp(image, flow)
    torch.testing.assert_close(warped[..., :8], image[..., 2:])
    assert valid[..., :8].all() and not valid[..., 8:].any()


def test_motion_smoothness_smooth_beats_jitter():
    values = get_reward("motion_smoothness")(torch.stack([moving(2), jittery()]), ["p"] * 2)
    assert values[0] > values[1]
    assert values[0] > 0.99  # a constant-speed square is almost exactly interpolated


def test_interpolation_error_closed_form():
    # Static frames with brightness 0.2, 0.6, 0.4: midpoint of neighbours = 0.3, error 0.3.
    video = torch.tensor([0.2, 0.6, 0.4]).view(3, 1, 1, 1).expand(3, 3, 8, 8)
    error = interpolation_error(video, torch.zeros(1, 2, 8, 8))
    assert error.item() == pytest.approx(0.3, abs=1e-6)


def test_temporal_flicker_steady_beats_alternating():
    values = get_reward("temporal_flicker")(torch.stack([moving(2), flickering()]), ["p"] * 2)
    assert values[0] > values[1]
    assert values[0] > 0.99


def test_flicker_instability_closed_form():
    # A static scene whose brightness alternates by +-0.1: every pair differs by 0.1.
    base = torch.rand(1, 3, 16, 16) * 0.5
    video = torch.cat([base, base + 0.1, base, base + 0.1])
    instability = flicker_instability(video, torch.zeros(3, 2, 16, 16), block=4)
    assert instability.item() == pytest.approx(0.1, abs=1e-5)


def test_motion_quality_prefers_smooth_stable_motion():
    videos = torch.stack([moving(2), moving(0), jittery(), flickering()])
    values = get_reward("motion_quality")(videos, ["p"] * 4)
    assert values[0] == values.max()
    assert ((values >= 0) & (values <= 1)).all()


def test_motion_smoothness_needs_three_frames():
    with pytest.raises(RewardError, match=r"motion_smoothness needs videos of at least 3 frames"):
        get_reward("motion_smoothness")(torch.stack([moving(1, frames=2)]), ["p"])


def test_bad_flow_options():
    with pytest.raises(ValueError, match=r"kwargs.flow: unknown flow backend 'lk'"):
        get_reward("dynamic_degree", flow="lk")
    with pytest.raises(ValueError, match=r"kwargs.raft_path: flow='raft_small' needs"):
        get_reward("temporal_flicker", flow="raft_small")
    with pytest.raises(ValueError, match=r"kwargs.raft_path: file not found: /no/raft.pt"):
        get_reward("motion_quality", flow="raft_large", raft_path="/no/raft.pt")
    with pytest.raises(RewardError, match=r"DIS flow needs .* use flow='farneback'"):
        get_reward("dynamic_degree")(torch.rand(1, 2, 3, 8, 8), ["p"])


def test_raft_small_random_weights(tmp_path):
    from torchvision.models.optical_flow import raft_small

    path = tmp_path / "raft_small.pt"
    torch.save(raft_small(weights=None).state_dict(), path)
    estimator = build_flow_estimator("raft_small", raft_path=str(path), num_flow_updates=2)
    assert isinstance(estimator, RaftFlow)
    frames = torch.rand(2, 3, 64, 72)  # below RAFT's 128-px minimum and not a multiple of 8
    assert estimator(frames, frames.flip(0)).shape == (2, 2, 64, 72)
    videos = torch.stack([moving(1, frames=3), moving(3, frames=3)])
    values = get_reward(
        "dynamic_degree", flow="raft_small", raft_path=str(path), num_flow_updates=2
    )(videos, ["p"] * 2)
    assert values.shape == (2,) and torch.isfinite(values).all()


class _ConstantFlowModel(torch.nn.Module):
    """Stands in for RAFT: returns flow (2, -4) px at whatever resolution it is run."""

    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(()))
        self.inputs = []

    def forward(self, a, b, num_flow_updates):
        self.inputs.append(tuple(a.shape))
        flow = torch.zeros(a.shape[0], 2, *a.shape[-2:])
        flow[:, 0], flow[:, 1] = 2.0, -4.0
        return [flow]


def test_raft_small_frames_are_upsampled_and_flow_rescaled(tmp_path):
    from torchvision.models.optical_flow import raft_small

    path = tmp_path / "raft_small.pt"
    torch.save(raft_small(weights=None).state_dict(), path)
    estimator = RaftFlow("raft_small", str(path), chunk_size=2)
    estimator.model = _ConstantFlowModel()
    flow = estimator(torch.rand(3, 3, 64, 99), torch.rand(3, 3, 64, 99))
    # Run at a 128-px short side (x2, 99 -> 198) padded to 200, in chunks of 2 pairs.
    assert estimator.model.inputs == [(2, 3, 128, 200), (1, 3, 128, 200)]
    torch.testing.assert_close(flow[:, 0], torch.full((3, 64, 99), 2.0 * 99 / 198))
    torch.testing.assert_close(flow[:, 1], torch.full((3, 64, 99), -2.0))
