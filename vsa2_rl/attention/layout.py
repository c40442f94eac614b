"""Tile layout of video tokens for VSA2: 4x4x4 cubes packed into 64-token tiles.

A latent video after patchify is a token grid (T, H, W) stored in raster order (t slowest,
w fastest), which is how diffusers' Wan flattens it. VSA2's coarse stage pools queries and keys
per 64-token tile and its router picks key segments of ``kv_block`` tokens, so the tokens of a
tile should be spatio-temporally close. Following VSA (Zhang et al., "VSA: Faster Video Diffusion
with Trainable Sparse Attention", 2025), a tile is a 4x4x4 cube of tokens, raster order inside
the cube; with ``kv_block`` 16 a segment is one 1x4x4 slice of a cube.

Where the grid is not a multiple of 4, FastVideo pads every boundary cube to 64 tokens (+21.9 %
tokens on Wan's 480p and 720p grids). Here the tokens of the boundary (partial) cubes are instead
packed, in cube raster order, into further 64-token tiles after all full cubes, so only the last
tile is partial and the padding is always < 64 tokens.

Routing consequence of the packing: a packed tile (and a segment inside it) can hold tokens of
several partial cubes, e.g. the 2-row strip at the bottom of one cube row followed by the strip
of the next cube, or the end of one frame strip and the start of the next cube row. Such a tile
is not a compact 4x4x4 box, so its pooled query/key is an average over a stretched region and
the router's score for it is a blurrier summary than for a cube. Attention itself stays exact
(positions enter through RoPE, applied before tiling); only the quality of the block selection
for those tiles is lower. On Wan grids they hold a small share of the tokens (11 % at 480p,
latent grid 21x30x52; 5 % at 720p, 21x45x80).
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass, field

import torch

TILE = 64  # tokens per tile: one 4x4x4 cube
CUBE = 4  # cube edge in tokens along T, H and W


def _check_grid(grid) -> tuple[int, int, int]:
    try:
        sizes = tuple(operator.index(n) for n in grid)
    except TypeError:
        raise ValueError(f"grid must be 3 ints (T, H, W), got {grid!r}") from None
    if len(sizes) != 3 or min(sizes) < 1:
        raise ValueError(f"grid must be 3 ints (T, H, W), each >= 1, got {grid!r}")
    return sizes


def _tile_order(grid: tuple[int, int, int]) -> torch.Tensor:
    """Raster token index of every token, listed in tile order (int64 [T*H*W])."""
    t_len, h_len, w_len = grid
    raster = torch.arange(t_len * h_len * w_len).view(t_len, h_len, w_len)
    full_cubes = []
    partial_cubes = []
    for t0 in range(0, t_len, CUBE):
        for h0 in range(0, h_len, CUBE):
            for w0 in range(0, w_len, CUBE):
                # Slicing a cube and flattening gives raster order inside the cube.
                cube = raster[t0 : t0 + CUBE, h0 : h0 + CUBE, w0 : w0 + CUBE].reshape(-1)
                (full_cubes if cube.numel() == TILE else partial_cubes).append(cube)
    return torch.cat(full_cubes + partial_cubes)


@dataclass(frozen=True, eq=False)
class TileLayout:
    """Permutation of a (T, H, W) token grid into 64-token tiles (see the module docstring).

    Build with :meth:`from_grid` (cached per grid). Tile order position ``i`` holds raster token
    ``perm[i]``; positions ``num_tokens .. padded_len - 1`` are padding (zeros after
    :meth:`tile`), all inside the last tile.
    """

    grid: tuple[int, int, int]
    perm: torch.Tensor  # int64 [num_tokens]: tile position -> raster index
    inv_perm: torch.Tensor  # int64 [num_tokens]: raster index -> tile position
    num_tokens: int
    num_tiles: int
    padded_len: int
    tile_lengths: torch.Tensor  # int32 [num_tiles]: valid tokens per tile (64 except the last)
    # Copies of the gather indices on other devices, made on first use.
    _device_cache: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_grid(cls, grid: tuple[int, int, int]) -> TileLayout:
        """The layout of a post-patchify token grid ``(T, H, W)``; cached per grid."""
        return _layout_for(cls, _check_grid(grid))

    @classmethod
    def _build(cls, grid: tuple[int, int, int]) -> TileLayout:
        num_tokens = math.prod(grid)
        perm = _tile_order(grid)
        inv_perm = torch.empty_like(perm)
        inv_perm[perm] = torch.arange(num_tokens)
        num_tiles = -(-num_tokens // TILE)
        tile_lengths = torch.full((num_tiles,), TILE, dtype=torch.int32)
        tile_lengths[-1] = num_tokens - TILE * (num_tiles - 1)
        return cls(
            grid=grid,
            perm=perm,
            inv_perm=inv_perm,
            num_tokens=num_tokens,
            num_tiles=num_tiles,
            padded_len=num_tiles * TILE,
            tile_lengths=tile_lengths,
        )

    @property
    def num_padding(self) -> int:
        """Padding tokens at the end of the last tile (always < 64)."""
        return self.padded_len - self.num_tokens

    def segment_lengths(self, kv_block: int) -> torch.Tensor:
        """Valid tokens per key segment of ``kv_block`` tokens: int32 [padded_len // kv_block].

        Padding sits at the end of the sequence, so only the last segments are short or empty.
        """
        if kv_block <= 0 or TILE % kv_block != 0:
            raise ValueError(f"kv_block must divide {TILE} (16, 32 or 64), got {kv_block}")
        starts = torch.arange(0, self.padded_len, kv_block)
        return (self.num_tokens - starts).clamp(0, kv_block).to(torch.int32)

    def _on_device(self, key: tuple, device: torch.device, make) -> tuple[torch.Tensor, ...]:
        # Layouts are shared by all layers, so each device copy is made once, not per forward.
        key = (*key, str(device))
        if key not in self._device_cache:
            self._device_cache[key] = tuple(t.to(device) for t in make())
        return self._device_cache[key]

    def _indices(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return self._on_device(("perm",), device, lambda: (self.perm, self.inv_perm))

    def prepare(self, device: torch.device) -> TileLayout:
        """Put the tile/untile indices on ``device`` now (cached); returns the layout.

        Call it outside compiled code before compiled code tiles on that device: made inside
        a compiled call, the indices are found cached by the next one, which fails a guard and
        recompiles; under gradient checkpointing the recompute can then run another graph than
        the forward did, which ``torch.utils.checkpoint`` rejects.
        """
        self._indices(device)
        return self

    def lengths(self, kv_block: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tile_lengths, segment_lengths(kv_block))`` on ``device``, cached."""
        return self._on_device(
            ("lengths", kv_block),
            device,
            lambda: (self.tile_lengths, self.segment_lengths(kv_block)),
        )

    def tile(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T*H*W, ...] in raster order -> [B, padded_len, ...] in tile order, zero padding."""
        if x.dim() < 2 or x.shape[1] != self.num_tokens:
            raise ValueError(
                f"x must be [B, {self.num_tokens}, ...] for grid {self.grid}, got {tuple(x.shape)}"
            )
        perm, inv_perm = self._indices(x.device)
        return _PermuteTokens.apply(x, perm, inv_perm, self.num_padding, 0)

    def untile(self, y: torch.Tensor) -> torch.Tensor:
        """[B, padded_len, ...] in tile order -> [B, T*H*W, ...] in raster order (drops padding)."""
        if y.dim() < 2 or y.shape[1] != self.padded_len:
            raise ValueError(
                f"y must be [B, {self.padded_len}, ...] for grid {self.grid}, got {tuple(y.shape)}"
            )
        perm, inv_perm = self._indices(y.device)
        return _PermuteTokens.apply(y, inv_perm, perm, 0, self.num_padding)


def _gather_tokens(x: torch.Tensor, index: torch.Tensor, padding: int) -> torch.Tensor:
    """Rows ``index`` of ``x`` along dim 1, then ``padding`` zero rows."""
    out = x[:, index]
    if padding:
        out = torch.cat([out, out.new_zeros((out.shape[0], padding, *out.shape[2:]))], dim=1)
    return out


class _PermuteTokens(torch.autograd.Function):
    """Tiling or untiling: a gather of token rows by a permutation, padded after or dropped.

    Its gradient is the inverse permutation's gather. Autograd's own for ``index_select`` is a
    scatter-add (``index_add_``), which cannot know that the index is a permutation.
    """

    @staticmethod
    def forward(ctx, x, index, inverse, padding: int, input_padding: int):
        ctx.save_for_backward(inverse)
        ctx.input_padding = input_padding
        return _gather_tokens(x, index, padding)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return _gather_tokens(grad, inverse, ctx.input_padding), None, None, None, None


@functools.lru_cache(maxsize=64)
def _layout_for(cls: type[TileLayout], grid: tuple[int, int, int]) -> TileLayout:
    return cls._build(grid)
