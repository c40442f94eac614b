"""TileLayout: 64-token tiles of 4x4x4 cubes with packed boundary cubes (vsa2_rl.attention)."""

import pytest
import torch

from vsa2_rl.attention import SparsityState, TileLayout

WAN_GRIDS = [(21, 30, 52), (21, 45, 80)]
ODD_GRIDS = [(1, 1, 1), (3, 5, 7), (4, 4, 4), (5, 9, 13), (8, 8, 8)]


def _coords(grid, raster_index):
    """(t, h, w) of raster token indices, the closed form of diffusers' flatten order."""
    _, h_len, w_len = grid
    return raster_index // (h_len * w_len), (raster_index // w_len) % h_len, raster_index % w_len


@pytest.mark.parametrize("grid", WAN_GRIDS + ODD_GRIDS)
def test_layout_is_a_permutation_with_small_padding(grid):
    layout = TileLayout.from_grid(grid)
    n = grid[0] * grid[1] * grid[2]
    assert layout.num_tokens == n
    assert torch.equal(layout.perm.sort().values, torch.arange(n))
    assert torch.equal(layout.perm[layout.inv_perm], torch.arange(n))
    assert layout.padded_len == layout.num_tiles * 64
    assert 0 <= layout.padded_len - n < 64
    lengths = layout.tile_lengths
    assert lengths.dtype == torch.int32 and lengths.shape == (layout.num_tiles,)
    assert int(lengths.sum()) == n
    assert bool((lengths[:-1] == 64).all()) and 1 <= int(lengths[-1]) <= 64
    for kv_block in (16, 32, 64):
        seg = layout.segment_lengths(kv_block)
        assert seg.dtype == torch.int32 and seg.shape == (layout.padded_len // kv_block,)
        assert int(seg.sum()) == n
        # Full segments first, then at most one partial one, then empty ones at the end.
        full = n // kv_block
        assert bool((seg[:full] == kv_block).all()) and bool((seg[full + 1 :] == 0).all())


@pytest.mark.parametrize("grid", WAN_GRIDS + ODD_GRIDS)
def test_full_cubes_are_contiguous_tiles_in_raster_order(grid):
    layout = TileLayout.from_grid(grid)
    t_len, h_len, w_len = grid
    cubes = [
        (t0, h0, w0)
        for t0 in range(0, t_len - 3, 4)
        for h0 in range(0, h_len - 3, 4)
        for w0 in range(0, w_len - 3, 4)
    ]
    local = torch.arange(64)
    lt, lh, lw = local // 16, (local // 4) % 4, local % 4
    for tile_id, (t0, h0, w0) in enumerate(cubes):
        t, h, w = _coords(grid, layout.perm[tile_id * 64 : (tile_id + 1) * 64])
        assert torch.equal(t, t0 + lt) and torch.equal(h, h0 + lh) and torch.equal(w, w0 + lw)
    # Tokens after the full cubes belong to partial cubes only, in cube raster order.
    t, h, w = _coords(grid, layout.perm[len(cubes) * 64 :])
    in_full = (t < t_len // 4 * 4) & (h < h_len // 4 * 4) & (w < w_len // 4 * 4)
    assert not bool(in_full.any())
    cube_id = ((t // 4) * -(-h_len // 4) + h // 4) * -(-w_len // 4) + w // 4
    assert bool((cube_id[1:] >= cube_id[:-1]).all())


def test_first_tile_is_origin_cube_in_raster_order():
    layout = TileLayout.from_grid((21, 30, 52))
    expected = [t * 30 * 52 + h * 52 + w for t in range(4) for h in range(4) for w in range(4)]
    assert layout.perm[:64].tolist() == expected
    # Without full cubes the first tile starts with the origin cube's tokens, raster order.
    small = TileLayout.from_grid((3, 5, 7))
    expected = [t * 35 + h * 7 + w for t in range(3) for h in range(4) for w in range(4)]
    assert small.perm[:48].tolist() == expected


@pytest.mark.parametrize("grid", [(21, 30, 52), (1, 1, 1), (3, 5, 7), (5, 9, 13)])
def test_tile_untile_exact_inverse_with_zero_padding(grid):
    layout = TileLayout.from_grid(grid)
    x = torch.randn(2, layout.num_tokens, 3, 2, dtype=torch.float64)
    tiled = layout.tile(x)
    assert tiled.shape == (2, layout.padded_len, 3, 2)
    assert torch.equal(tiled[:, : layout.num_tokens], x[:, layout.perm])
    assert bool((tiled[:, layout.num_tokens :] == 0).all())
    assert torch.equal(layout.untile(tiled), x)
    # untile(tile(.)) is the identity and tile(untile(.)) the identity on non-padding rows.
    y = torch.randn(2, layout.padded_len, 5)
    y[:, layout.num_tokens :] = 0
    assert torch.equal(layout.tile(layout.untile(y)), y)


@pytest.mark.parametrize("grid", [(4, 8, 8), (3, 5, 7)])
def test_tile_and_untile_gradients_are_the_inverse_permutations(grid):
    layout = TileLayout.from_grid(grid)
    x = torch.randn(2, layout.num_tokens, 3, dtype=torch.float64, requires_grad=True)
    y = torch.randn(2, layout.padded_len, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(layout.tile, (x,))
    assert torch.autograd.gradcheck(layout.untile, (y,))
    # closed form: tile's gradient reads the upstream gradient at each token's tile position,
    # untile's puts it back there with zeros at the padding
    upstream = torch.randn(2, layout.padded_len, 3, dtype=torch.float64)
    (grad_x,) = torch.autograd.grad(layout.tile(x), x, upstream)
    assert torch.equal(grad_x, upstream[:, layout.inv_perm])
    upstream = torch.randn(2, layout.num_tokens, 3, dtype=torch.float64)
    (grad_y,) = torch.autograd.grad(layout.untile(y), y, upstream)
    assert torch.equal(grad_y[:, : layout.num_tokens], upstream[:, layout.perm])
    assert bool((grad_y[:, layout.num_tokens :] == 0).all())


def test_layout_is_cached_and_validates():
    assert TileLayout.from_grid((5, 9, 13)) is TileLayout.from_grid([5, 9, 13])
    with pytest.raises(ValueError, match="grid"):
        TileLayout.from_grid((0, 4, 4))
    with pytest.raises(ValueError, match="grid"):
        TileLayout.from_grid((4, 4))
    layout = TileLayout.from_grid((4, 4, 4))
    with pytest.raises(ValueError, match="kv_block"):
        layout.segment_lengths(24)
    with pytest.raises(ValueError, match=r"\[B, 64"):
        layout.tile(torch.zeros(1, 63, 2))


def test_sparsity_state_accumulates_density():
    state = SparsityState(sparsity=0.5)
    assert state.pop_density() is None
    state.record_density(torch.tensor(0.25))
    state.record_density(0.75)
    assert state.pop_density() == pytest.approx(0.5)
    assert state.pop_density() is None
    with pytest.raises(ValueError, match="sparsity"):
        state.sparsity = 1.0


def test_sparsity_state_at_sets_and_restores_the_sparsity_even_on_error():
    state = SparsityState(sparsity=0.25)
    with state.at(0.9) as inside:
        assert inside is state and state.sparsity == 0.9
        with state.at(0.0):
            assert state.sparsity == 0.0
        assert state.sparsity == 0.9
    assert state.sparsity == 0.25
    with pytest.raises(RuntimeError), state.at(0.75):
        raise RuntimeError("a failing forward")
    assert state.sparsity == 0.25
    with pytest.raises(ValueError, match="sparsity"), state.at(1.0):
        pass
    assert state.sparsity == 0.25
