"""The toy task's known-answer rewards (prompt_motion, shape_fidelity), the control reward and
the held-out prompt split, checked on the synthetic generator's own videos, whose true motion is
known in closed form."""

import json
import math

import pytest
import torch

from vsa2_rl.rewards import RewardError, get_reward
from vsa2_rl.toy.data import (
    COLORS,
    DIRECTIONS,
    MOTIONS,
    SHAPES,
    TRAVEL,
    ShapeSpec,
    pretraining_batch,
    random_specs,
    render_batch,
    render_video,
)
from vsa2_rl.toy.prompts import toy_prompts
from vsa2_rl.toy.report import score_samples
from vsa2_rl.toy.rewards import (
    blob_displacement,
    detect_blobs,
    follows_direction,
    largest_component,
    motion_score,
    prompt_motion,
)


def _generated(count, seed, size=32):
    """``count`` generator videos whose motions cycle through every motion (static included)
    while their prompts are drawn at random: right, wrong speed, wrong direction, static."""
    generator = torch.Generator().manual_seed(seed)
    specs = random_specs(count, generator)
    moves = [MOTIONS[i % len(MOTIONS)] for i in range(count)]
    videos = render_batch(specs, list(range(count)), 8, size, size, moves)
    return videos, [s.prompt for s in specs], specs, moves


def _level(spec, move):
    """The issue's order of motions for a prompt: 0 the asked motion, 1 the right direction at
    the other speed, 2 another direction, 3 static (the worst)."""
    if move == (0.0, 0.0):
        return 3
    direction = DIRECTIONS[spec.direction]
    along = direction[0] * move[0] + direction[1] * move[1]
    if abs(along) != abs(move[0]) + abs(move[1]) or along < 0:
        return 2
    return 0 if abs(along - TRAVEL[spec.speed]) < 1e-9 else 1


def _average_ranks(values):
    values = values.double()
    ranks = torch.empty_like(values)
    ranks[values.argsort()] = torch.arange(len(values), dtype=torch.double)
    for value in values.unique():
        ranks[values == value] = ranks[values == value].mean()
    return ranks


def _spearman(a, b):
    return torch.corrcoef(torch.stack([_average_ranks(a), _average_ranks(b)]))[0, 1].item()


def test_prompt_motion_separates_the_asked_motion_from_wrong_ones():
    videos, prompts, specs, moves = _generated(72, seed=3)
    scores = get_reward("prompt_motion")(videos, prompts)
    levels = torch.tensor([_level(s, m) for s, m in zip(specs, moves, strict=True)])
    assert all(int((levels == level).sum()) >= 5 for level in range(4))
    # every video of a better level scores above every video of a worse one
    for better in range(3):
        assert scores[levels == better].min() > scores[levels == better + 1].max()
    assert scores[levels == 0].min() > 0.95 and scores[levels == 3].max() < 0.05


def test_prompt_motion_tracks_the_true_motion_of_generated_videos():
    videos, prompts, specs, moves = _generated(60, seed=5)
    measured = torch.stack([blob_displacement(detect_blobs(video)) for video in videos])
    truth = torch.tensor(moves)
    # the tracker recovers the generator's displacement to a fraction of a pixel at 32 px
    assert (measured - truth).norm(dim=1).max() < 0.02
    target = torch.tensor([s.velocity() for s in specs])
    scores = get_reward("prompt_motion")(videos, prompts)
    assert _spearman(scores, motion_score(truth, target)) >= 0.9


@pytest.mark.parametrize("size", [16, 32])
def test_prompt_direction_is_one_exactly_for_videos_moving_the_prompted_way(size):
    """At the embedded default's 16 px and at 32 px: every generator video that moves the
    prompted way (either speed) scores 1, every other direction and every static one 0."""
    videos, prompts, specs, moves = _generated(72, seed=4, size=size)
    scores = get_reward("prompt_direction")(videos, prompts)
    levels = torch.tensor([_level(s, m) for s, m in zip(specs, moves, strict=True)])
    assert all(int((levels == level).sum()) >= 5 for level in range(4))
    assert torch.equal(scores, (levels <= 1).float())


@pytest.mark.parametrize("size", [32, 64])
def test_prompt_speed_is_the_ratio_of_the_generated_and_asked_travel(size):
    """Generator videos of known displacement: the speed agreement is min/max of the travelled
    and the asked distance (TRAVEL), whatever the direction; 0 for a static shape."""
    videos, prompts, specs, moves = _generated(48, seed=6, size=size)
    scores = get_reward("prompt_speed")(videos, prompts)
    for score, spec, move in zip(scores.tolist(), specs, moves, strict=True):
        travelled, asked = math.hypot(*move), TRAVEL[spec.speed]
        assert score == pytest.approx(min(travelled, asked) / max(travelled, asked), abs=0.05)


def test_follows_direction_closed_form():
    target = torch.tensor([0.25, 0.0])  # "right slowly"
    cases = {
        (0.55, 0.0): True,  # faster than asked: still the prompted way
        (0.2, 0.19): True,  # 43.5 degrees off
        (0.2, 0.21): False,  # 46.4 degrees off
        (-0.25, 0.0): False,
        (0.12, 0.0): False,  # shorter than MOVING_DISTANCE (0.125): barely moving
        (0.13, 0.0): True,
    }
    for move, expected in cases.items():
        assert bool(follows_direction(torch.tensor(move), target)) is expected, move


def test_motion_score_closed_form():
    target = torch.tensor([0.55, 0.0])  # "right fast"
    cases = {
        (0.55, 0.0): 1.0,
        (0.25, 0.0): 2 / 3 + 0.25 / 0.55 / 3,
        (0.0, 0.55): 2 / 3 * 0.5 + 1 / 3,
        (-0.55, 0.0): 1 / 3,
        (0.0, 0.0): 0.0,
        (0.05, 0.0): 2 / 3 * 0.4 + 0.05 / 0.55 / 3,  # barely moving: direction counts 40%
    }
    for move, expected in cases.items():
        assert motion_score(torch.tensor(move), target).item() == pytest.approx(expected, abs=1e-6)


def test_largest_component_picks_the_larger_blob_in_each_frame():
    mask = torch.zeros(2, 10, 10, dtype=torch.bool)
    mask[0, 1:3, 1:3] = True  # 4 pixels
    mask[0, 5:9, 5:8] = True  # 12 pixels
    mask[1, 0, :] = True  # a 10-pixel line, diagonal neighbours do not connect:
    mask[1, 2, 0] = mask[1, 3, 1] = mask[1, 4, 2] = True
    largest = largest_component(mask)
    assert int(largest[0].sum()) == 12 and bool(largest[0, 6, 6]) and not bool(largest[0, 1, 1])
    assert int(largest[1].sum()) == 10 and bool(largest[1, 0].all())
    assert not bool(largest_component(torch.zeros(1, 4, 4, dtype=torch.bool)).any())


def flood_fill_largest(frame: torch.Tensor) -> torch.Tensor:
    """Reference for one frame: 4-connected components by flood fill, the largest kept (ties
    to the component holding the first pixel in raster order)."""
    height, width = frame.shape
    seen, best, best_key = set(), set(), None
    for start in range(height * width):
        if start in seen or not bool(frame.flatten()[start]):
            continue
        component, stack = set(), [start]
        while stack:
            pixel = stack.pop()
            if pixel in component:
                continue
            component.add(pixel)
            y, x = divmod(pixel, width)
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < height and 0 <= nx < width and bool(frame[ny, nx]):
                    stack.append(ny * width + nx)
        seen |= component
        key = (len(component), -start)
        if best_key is None or key > best_key:
            best, best_key = component, key
    largest = torch.zeros(height * width, dtype=torch.bool)
    largest[list(best)] = True
    return largest.view(height, width)


def test_largest_component_matches_a_flood_fill_on_random_masks():
    generator = torch.Generator().manual_seed(0)
    for density in (0.3, 0.5, 0.6):  # below, at and above the square lattice's percolation
        mask = torch.rand(6, 11, 13, generator=generator) < density
        largest = largest_component(mask)
        for frame, found in zip(mask, largest, strict=True):
            assert torch.equal(found, flood_fill_largest(frame))


def test_shape_fidelity_on_right_wrong_and_broken_videos():
    fidelity = get_reward("shape_fidelity")
    videos, prompts, specs, _ = _generated(12, seed=7)
    assert torch.equal(fidelity(videos, prompts), torch.ones(12))
    recoloured = [
        f"a {'blue' if s.color != 'blue' else 'red'} {s.shape} moving up fast" for s in specs
    ]
    assert torch.equal(fidelity(videos, recoloured), torch.zeros(12))
    assert torch.equal(fidelity(torch.zeros_like(videos), prompts), torch.zeros(12))
    # every frame blanked from a little left of the shape's centre: a third of it is left
    cut = videos.clone()
    centre_x = [detect_blobs(v).centroid[:, 0] for v in videos]
    for video, xs in zip(cut, centre_x, strict=True):
        for frame, x in zip(video, xs, strict=True):
            frame[..., int((x - 0.06) * 32) :] = 0.0
    assert torch.equal(fidelity(cut, prompts), torch.zeros(12))


def test_toy_rewards_refuse_prompts_and_videos_they_cannot_score():
    videos, prompts, _, _ = _generated(2, seed=1)
    for name in ("prompt_motion", "shape_fidelity"):
        reward = get_reward(name)
        with pytest.raises(RewardError, match=rf"reward '{name}': cannot read prompt 'a cat'"):
            reward(videos, [prompts[0], "a cat"])
        with pytest.raises(RewardError, match=rf"reward '{name}': .*'a purple square"):
            reward(videos, ["a purple square moving up fast", prompts[1]])
        # the bare function (no wrapper) refuses a single frame instead of scoring 0
        with pytest.raises(RewardError, match=rf"reward '{name}': needs RGB videos \[B, T >= 2"):
            reward.fn(videos[:, :1], prompts, [{}, {}])
        with pytest.raises(ValueError, match=rf"reward '{name}': videos: .*at least 2 frames"):
            reward(videos[:, :1], prompts)
    with pytest.raises(ValueError, match=r"kwargs\.threshold: must be in"):
        prompt_motion(threshold=1.5)


def test_random_reward_ignores_the_pixels_and_follows_the_sample():
    reward = get_reward("random", seed=3)
    videos = torch.rand(6, 2, 3, 8, 8)
    metadata = [{"sample_seed": 100 + i} for i in range(6)]
    first = reward(videos, ["p"] * 6, metadata)
    assert torch.equal(first, reward(torch.zeros_like(videos), ["q"] * 6, metadata))
    assert len(set(first.tolist())) == 6 and bool(((first >= 0) & (first < 1)).all())
    assert not torch.equal(first, get_reward("random", seed=4)(videos, ["p"] * 6, metadata))
    many = get_reward("random")(torch.rand(400, 2, 1, 4, 4), ["p"] * 400, [
        {"sample_seed": i} for i in range(400)])  # fmt: skip
    assert abs(many.mean().item() - 0.5) < 0.05


def test_train_and_eval_prompts_are_disjoint_and_cover_every_attribute():
    train, held_out = toy_prompts("train"), toy_prompts("eval")
    assert len(train) == 120 and len(held_out) == 24 and not set(train) & set(held_out)
    specs = [ShapeSpec.from_prompt(p) for p in held_out]
    for values, attribute in ((COLORS, "color"), (SHAPES, "shape"), (DIRECTIONS, "direction")):
        counts = [sum(getattr(s, attribute) == v for s in specs) for v in values]
        assert len(set(counts)) == 1, attribute  # each value equally often
    assert sorted({s.speed for s in specs}) == sorted(TRAVEL)


def test_rendered_displacement_and_mirrored_captions():
    spec = ShapeSpec("red", "square", "right", "fast")
    for move in ((0.0, 0.0), (-0.25, 0.0), (0.0, 0.55)):
        video = render_video(spec, 4, 8, 32, 32, displacement=move)
        measured = blob_displacement(detect_blobs(video))
        assert torch.allclose(measured, torch.tensor(move), atol=0.02)
    specs, _, moves = pretraining_batch(4000, torch.Generator().manual_seed(0), 0.3)
    follows = [m is None for m in moves]
    assert sum(follows) / len(follows) == pytest.approx(0.7, abs=0.03)
    # a mirrored video moves along its caption's axis at its speed, the other way
    for spec, move in zip(specs, moves, strict=True):
        if move is not None:
            assert move == tuple(-component for component in spec.velocity())
    with pytest.raises(ValueError, match="mirrored"):
        pretraining_batch(1, torch.Generator(), 1.5)


def test_faithful_colors_always_move_as_captioned():
    specs, _, moves = pretraining_batch(
        6000, torch.Generator().manual_seed(1), 0.5, faithful_colors=("red", "green")
    )
    by_color = {}
    for spec, move in zip(specs, moves, strict=True):
        by_color.setdefault(spec.color, []).append(move is None)
    assert all(by_color["red"]) and all(by_color["green"])
    for color in ("blue", "yellow", "cyan", "magenta"):
        assert sum(by_color[color]) / len(by_color[color]) == pytest.approx(0.5, abs=0.05)
    with pytest.raises(ValueError, match=r"faithful_colors.*purple"):
        pretraining_batch(1, torch.Generator(), 0.5, faithful_colors=("purple",))


def test_prompt_motion_tracks_the_shape_not_its_fragments():
    spec = ShapeSpec("red", "square", "right", "fast")
    video = render_video(spec, 2, 8, 32, 32)[None]
    reward = get_reward("prompt_motion")
    assert reward(video, [spec.prompt]).item() > 0.95
    # the same motion frayed into single pixels (a checkerboard of holes): no frame shows the
    # shape, so there is nothing to track, however the pieces move
    checker = (torch.arange(32).view(-1, 1) + torch.arange(32).view(1, -1)) % 2
    assert reward(video * checker, [spec.prompt]).item() == 0.0
    # a prompt of another colour: the red square is not the prompted shape either
    assert reward(video, ["a blue square moving right fast"]).item() == 0.0


def test_sample_figures_of_one_video_a_prompt_are_finite_with_no_group_spread():
    specs = [
        ShapeSpec("red", "square", "right", "fast"),
        ShapeSpec("green", "circle", "up", "slowly"),
    ]
    prompts = [spec.prompt for spec in specs]
    videos = render_batch(specs, [0, 1], 8, 32, 32)  # each moving as its caption says
    figures = score_samples(videos, prompts, seeds_per_prompt=1)
    json.dumps(figures, allow_nan=False)  # config.json stays strict JSON
    assert figures["group_std"] == 0.0
    assert figures["direction_match"] == 1.0 and figures["shape_fidelity"] > 0.9
    # two videos a prompt, one static: the spread is that of their two motion scores
    both = render_batch(specs[:1] * 2, [0, 1], 8, 32, 32, [None, (0.0, 0.0)])
    scores = get_reward("prompt_motion")(both, prompts[:1] * 2)
    spread = score_samples(both, prompts[:1], seeds_per_prompt=2)["group_std"]
    assert spread == pytest.approx(abs(scores[0] - scores[1]).item() / math.sqrt(2.0))
