"""VSA2 inside diffusers' MiniMaxH3Transformer3DModel (MiniMax-H3).

MiniMax-H3 runs one self-attention per block over a packed sequence of text, audio and video
rows (diffusers 0.42, ``transformer_minimax_h3.py``): there is no cross-attention, every row
attends to every row, and the model passes no mask. The call names each modality's rows
(``video_indices``, ``audio_indices``, ``text_indices``) and gives every row its (t, h, w)
rotary coordinates (``position_ids``).

``enable_vsa2`` gives every block's ``attn`` a :class:`~vsa2_rl.attention.VSA2Attention` (its
alpha and gates, as ``transformer_blocks.{i}.attn.vsa2.*``) and :class:`MiniMaxVSA2AttnProcessor`,
which does the stock projections, per-head RMS qk-norm and rotary embedding on every row, then
splits the attention by query:

- text and audio queries: dense attention over every row, as the stock model;
- video queries at ``state.sparsity == 0``: the stock processor, the stock model exactly;
- video queries at sparsity > 0: VSA2 on the tiled video grid, its fine stage widened to the
  text and audio keys (dense) and merged with the sparse video part by their log-sum-exp
  (:func:`vsa2_rl.models.hunyuan_video15.joint_vsa2_attention`, which the HunyuanVideo-1.5
  adapter shares). With fresh (zero) gates and alpha, a density-1 setting is the stock model.

The video grid comes from the call: a forward pre-hook reads the video rows' coordinates,
counts the distinct t, h and w values and checks that the rows enumerate that (T, H, W) grid
frame by frame in raster order (the layout of text-to-video and text-to-video-and-audio
requests). Keyframe-conditioned requests add conditioning frames to the video rows at an
anchor time, which breaks that order; they are refused with an error rather than tiled wrong.
The token refiner's attention (text only) stays dense. Sequence parallelism is not supported.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn

from vsa2_rl.attention import SparsityState, TileLayout
from vsa2_rl.config import VSA2Config
from vsa2_rl.models.attach import attach_vsa2, grid_context
from vsa2_rl.models.hunyuan_video15 import joint_vsa2_attention
from vsa2_rl.models.wan import vsa2_parameters


def rotate_leading_channels(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """MiniMax-H3's rotary embedding: the first ``cos.shape[-1]`` channels of every head of x
    [B, S, H, D] rotated in rotate-half pairs (channel i with channel i + half), the rest
    passed through; cos, sin [S, rotary_dim]."""
    rotary = cos.shape[-1]
    turned, kept = x[..., :rotary], x[..., rotary:]
    first, second = turned.chunk(2, dim=-1)
    cos, sin = (c.to(x.dtype)[None, :, None, :] for c in (cos, sin))
    rotated = turned * cos + torch.cat((-second, first), dim=-1) * sin
    return torch.cat((rotated, kept), dim=-1)


def video_grid(coordinates: torch.Tensor) -> tuple[int, int, int]:
    """The (T, H, W) grid that video rows' (t, h, w) coordinates [N, 3] enumerate frame by
    frame in raster order; ValueError when they do not."""
    axes = [torch.unique(coordinates[:, axis]) for axis in range(3)]
    grid = tuple(len(axis) for axis in axes)
    if grid[0] * grid[1] * grid[2] == coordinates.shape[0]:
        raster = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3)
        if torch.equal(raster.to(coordinates.dtype), coordinates):
            return grid
    raise ValueError(
        f"MiniMax-H3 VSA2: the {coordinates.shape[0]} video rows are not one (t, h, w) grid in "
        "raster order (keyframe-conditioned requests are not supported with VSA2); run them "
        "with attention.enabled=false"
    )


class MiniMaxVSA2Context:
    """The current call's video rows and their tile layout, recorded by the transformer's
    forward pre-hook and read by every block's processor."""

    def __init__(self, forward) -> None:
        self.signature = inspect.signature(forward)
        self.video_rows: torch.Tensor | None = None
        self.other_rows: torch.Tensor | None = None
        self.layout: TileLayout | None = None

    @torch.compiler.disable
    def record(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook: the video rows, the other rows and the video grid's layout."""
        call = self.signature.bind(*args, **kwargs).arguments
        positions, video_rows = call["position_ids"], call["video_indices"]
        grid = video_grid(positions[video_rows].to(torch.float64))
        others = torch.ones(positions.shape[0], dtype=torch.bool, device=video_rows.device)
        others[video_rows] = False
        self.video_rows, self.other_rows = video_rows, others.nonzero().squeeze(1)
        self.layout = TileLayout.from_grid(grid).prepare(video_rows.device)


class MiniMaxVSA2AttnProcessor:
    """Self-attention processor for a MiniMax-H3 block's ``attn`` running VSA2 on the video
    queries (see module doc)."""

    def __init__(self, context: MiniMaxVSA2Context) -> None:
        self.context = context

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if attn.vsa2.state.sparsity == 0.0:  # the stock model
            attn.vsa2.state.record_density(1.0)
            return attn._vsa2_stock_processor(attn, hidden_states, rotary_emb, attention_mask)
        context = self.context
        if context.layout is None or rotary_emb is None or attention_mask is not None:
            raise ValueError(
                "MiniMaxVSA2AttnProcessor needs the transformer's call (its pre-hook records the "
                "video grid), the rotary embedding and no attention mask"
            )

        def heads(x):
            return x.unflatten(-1, (attn.heads, -1))  # (B, S, H, D)

        query = rotate_leading_channels(attn.norm_q(heads(attn.to_q(hidden_states))), *rotary_emb)
        key = rotate_leading_channels(attn.norm_k(heads(attn.to_k(hidden_states))), *rotary_emb)
        value = heads(attn.to_v(hidden_states))
        video, other = context.video_rows, context.other_rows
        other_key, other_value = key[:, other], value[:, other]
        out = torch.empty_like(query)
        out[:, other] = F.scaled_dot_product_attention(
            query[:, other].transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        ).transpose(1, 2)
        out[:, video] = joint_vsa2_attention(
            attn.vsa2, query[:, video], key[:, video], value[:, video], hidden_states[:, video],
            context.layout, other_key, other_value,
            other_key.new_ones(other_key.shape[:2], dtype=torch.bool),
        )  # fmt: skip
        return attn.to_out[1](attn.to_out[0](out.flatten(2).type_as(query)))


def enable_vsa2(transformer: nn.Module, vsa2_config: VSA2Config, state: SparsityState) -> nn.Module:
    """Run every MiniMax-H3 block's self-attention through VSA2; returns the same transformer.

    Each ``transformer_blocks[i].attn`` gets a zero-initialised VSA2Attention as ``attn.vsa2``
    (output = the dense model's at density 1) and the VSA2 processor, keeping its stock processor
    for sparsity 0 (:func:`~vsa2_rl.models.attach.attach_vsa2`); a pre-hook on the transformer
    records each call's video grid. ``vsa2_config.enabled = False`` leaves the model dense. Calling
    it again updates config/state and keeps the trained VSA2 parameters.
    """
    from diffusers import MiniMaxH3Transformer3DModel

    if not isinstance(transformer, MiniMaxH3Transformer3DModel):
        raise ValueError(
            "transformer must be a diffusers MiniMaxH3Transformer3DModel, got "
            f"{type(transformer).__name__}"
        )
    if not vsa2_config.enabled:
        return transformer
    context = grid_context(transformer, lambda: MiniMaxVSA2Context(transformer.forward))
    processor = MiniMaxVSA2AttnProcessor(context)
    for block in transformer.transformer_blocks:
        attach_vsa2(block.attn, vsa2_config, state, processor)
    return transformer


__all__ = ["MiniMaxVSA2AttnProcessor", "enable_vsa2", "video_grid", "vsa2_parameters"]
