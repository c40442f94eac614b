"""VSA2 attention of one layer: coarse stage, router, fine stage and gated fusion.

Follows VSA (Zhang et al., "VSA: Faster Video Diffusion with Trainable Sparse Attention", 2025)
and its VSA2 successor, as fixed in DESIGN.md "VSA2 attention":

1. coarse stage: q, k, v mean-pooled per query tile (valid tokens only), dense softmax attention
   among the tiles that hold a valid token, the result broadcast to every token of its tile;
2. router: pooled q per tile against pooled k per ``kv_block`` segment selects a variable number
   of segments per (batch, head, tile) (``route``);
3. fine stage: block-sparse attention over the selected segments, with the logit bias
   ``alpha[h] * log_softmax(scores)`` per (tile, segment) pair, through which the router is
   trained (``block_sparse_attention``);
4. gated fusion ``out = g_c * O_c + g_f * O_f`` (``g_c`` defaults to 0, ``g_f`` to 1);
5. dense fallback: while the kept fraction ``1 - sparsity`` is at least
   ``config.dense_threshold`` the fine stage is exact dense SDPA over the valid keys.

The sparse path does no host sync when the length tensors already live on q's device and the
number of valid segments is given, so it can be captured in a CUDA graph at fixed shapes.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F

from vsa2_rl.config import VSA2Config

from .ops import block_sparse_attention
from .pooling import pool_tiles
from .router import count_valid_segments, route


class VSA2Stats(NamedTuple):
    """What a VSA2 layer reports besides its output."""

    density: torch.Tensor  # float32 scalar on q's device; 1 in the dense fallback
    kv_counts: torch.Tensor | None  # int32 [B, H, NQ] segments per query tile; None when dense


def _check_lengths(name: str, lengths: torch.Tensor, count: int, block: int) -> None:
    if lengths.dim() != 1 or lengths.shape[0] != count or lengths.is_floating_point():
        raise ValueError(
            f"{name} must be an integer tensor of shape [{count}], "
            f"got dtype {lengths.dtype} shape {tuple(lengths.shape)}"
        )
    # values are checked only on the CPU, where reading them does not wait on the device
    if lengths.device.type == "cpu" and not torch.compiler.is_compiling():
        if bool(((lengths < 0) | (lengths > block)).any()):
            raise ValueError(f"{name} must lie in [0, {block}], got {lengths.tolist()}")
        if not bool((lengths > 0).any()):
            raise ValueError(f"{name} has no valid token: every entry is 0")


def _check_inputs(q, k, v, tile_lengths, seg_lengths, sparsity, alpha, config) -> None:
    if config.mode not in ("topk", "topp"):
        raise ValueError(f"config.mode={config.mode!r} is unknown; use 'topk' or 'topp'")
    if config.backend not in ("auto", "triton", "torch"):
        raise ValueError(
            f"config.backend={config.backend!r} is unknown; use 'auto', 'triton' or 'torch'"
        )
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity={sparsity} must lie in [0, 1); 0 keeps every segment")
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(
            f"q, k, v must share one [B, H, S, D] shape, got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    S = q.shape[2]
    q_tile, kv_block = config.q_tile, config.kv_block
    if q_tile < 1 or kv_block < 1 or S % q_tile != 0 or q_tile % kv_block != 0:
        raise ValueError(
            f"S={S} must be a multiple of config.q_tile={q_tile}, itself a multiple of "
            f"config.kv_block={kv_block}; tile the sequence with TileLayout first"
        )
    _check_lengths("tile_lengths", tile_lengths, S // q_tile, q_tile)
    _check_lengths("seg_lengths", seg_lengths, S // kv_block, kv_block)
    if alpha.shape != (q.shape[1],):
        raise ValueError(f"alpha must have shape [H] = [{q.shape[1]}], got {tuple(alpha.shape)}")


def _coarse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_tiles: torch.Tensor,
    tile_lengths: torch.Tensor,
    q_tile: int,
    backend: str,
) -> torch.Tensor:
    """Dense attention among pooled tiles, broadcast back to tokens: (B, H, S, D)."""
    B, H, S, D = q.shape
    k_tiles = pool_tiles(k, tile_lengths, q_tile, backend=backend)
    v_tiles = pool_tiles(v, tile_lengths, q_tile, backend=backend)
    # tiles without a valid token pool to 0 and must not be attended to
    key_mask = (tile_lengths > 0)[None, None, None, :]
    o_tiles = F.scaled_dot_product_attention(q_tiles, k_tiles, v_tiles, attn_mask=key_mask)
    return o_tiles[:, :, :, None, :].expand(B, H, S // q_tile, q_tile, D).reshape(B, H, S, D)


def _dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg_lengths: torch.Tensor, kv_block: int
) -> torch.Tensor:
    """Exact SDPA over the valid keys (padding sits at the end of each segment)."""
    offsets = torch.arange(kv_block, device=q.device)
    key_valid = (offsets[None, :] < seg_lengths[:, None]).reshape(-1)  # (S,)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=key_valid[None, None, None, :])


def vsa2_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    tile_lengths: torch.Tensor,
    seg_lengths: torch.Tensor,
    sparsity: float,
    alpha: torch.Tensor,
    gate_coarse: torch.Tensor | None = None,
    gate_fine: torch.Tensor | None = None,
    config: VSA2Config,
    num_valid_segments: int | None = None,
) -> tuple[torch.Tensor, VSA2Stats]:
    """VSA2 attention of tile-ordered q, k, v (RoPE applied).

    Args:
        q, k, v: ``[B, H, S, D]``, S = number of tiles * ``config.q_tile``.
        tile_lengths: int ``[S // q_tile]`` valid tokens per tile (first in the tile).
        seg_lengths: int ``[S // kv_block]`` valid tokens per key segment (first in it).
            Both may live on the CPU (the layout's copy: moved here, one small host-to-device
            copy each) or on q's device (no copy; needed for CUDA-graph capture).
        sparsity: in ``[0, 1)``; the router keeps at most ``ceil((1 - sparsity) * NSEG_valid)``
            segments per tile; ``1 - sparsity >= config.dense_threshold`` -> dense fallback.
        alpha: ``[H]`` learnable scale of the router bias (zero-init in the module).
        gate_coarse: ``g_c`` broadcastable to ``[B, H, S, D]``; None means 0 and skips the
            coarse stage.
        gate_fine: ``g_f`` broadcastable to ``[B, H, S, D]``; None means 1.
        config: ``q_tile``, ``kv_block``, ``mode``, ``top_p``, ``min_kv``, ``dense_threshold``
            and ``backend`` are read; ``enabled`` is the caller's switch and is not read here.
        num_valid_segments: segments with length > 0, as a python int. None counts them from
            ``seg_lengths``: free on the CPU, one host sync on the device. Pass it with
            device-resident lengths to keep the sparse path free of host syncs.

    Returns:
        ``(out, VSA2Stats)``: ``out`` ``[B, H, S, D]`` in q's dtype. Rows of padded query tokens
        hold finite values that mean nothing (untiling drops them). ``stats.density`` is the
        router's density (1 in the dense fallback), a float32 tensor: reading it is the
        caller's host sync.
    """
    _check_inputs(q, k, v, tile_lengths, seg_lengths, sparsity, alpha, config)
    q_tile, kv_block, backend = config.q_tile, config.kv_block, config.backend
    dense = 1.0 - sparsity >= config.dense_threshold
    if num_valid_segments is None and not dense:
        num_valid_segments = count_valid_segments(seg_lengths)
    tile_lengths = tile_lengths.to(device=q.device, dtype=torch.int32)
    seg_lengths = seg_lengths.to(device=q.device, dtype=torch.int32)

    # the pooled queries feed both the router and the coarse stage: pool them once, if needed
    q_tiles = None
    if gate_coarse is not None or not dense:
        q_tiles = pool_tiles(q, tile_lengths, q_tile, backend=backend)  # (B, H, NQ, D)
    if dense:
        out_fine = _dense_attention(q, k, v, seg_lengths, kv_block)
        stats = VSA2Stats(torch.ones((), dtype=torch.float32, device=q.device), None)
    else:
        k_segs = pool_tiles(k, seg_lengths, kv_block, backend=backend)  # (B, H, NSEG, D)
        routing = route(
            q_tiles,
            k_segs,
            seg_lengths,
            sparsity=sparsity,
            mode=config.mode,
            top_p=config.top_p,
            min_kv=config.min_kv,
            num_valid_segments=num_valid_segments,
        )
        bias = alpha.to(torch.float32)[None, :, None, None] * routing.log_probs
        out_fine, _ = block_sparse_attention(
            q,
            k,
            v,
            routing.kv_indices,
            routing.kv_counts,
            bias,
            q_tile=q_tile,
            kv_block=kv_block,
            kv_lengths=seg_lengths,
            backend=backend,
        )
        stats = VSA2Stats(routing.density, routing.kv_counts)

    out = out_fine if gate_fine is None else gate_fine * out_fine
    if gate_coarse is not None:
        out_coarse = _coarse_attention(q, k, v, q_tiles, tile_lengths, q_tile, backend)
        out = out + gate_coarse * out_coarse
    return out.to(q.dtype), stats
