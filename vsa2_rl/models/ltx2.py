"""VSA2 inside diffusers' LTX2VideoTransformer3DModel (LTX-2).

An LTX-2 block (diffusers 0.42, ``transformer_ltx2.py``) runs a video self-attention
(``attn1``), an audio self-attention, cross-attention of each to its text, and attention between
audio and video. Only the video self-attention grows with the square of the video's tokens;
``enable_vsa2`` gives every block's ``attn1`` a :class:`~vsa2_rl.attention.VSA2Attention` (its
alpha and gates, as ``transformer_blocks.{i}.attn1.vsa2.*``) and :class:`LTX2VSA2AttnProcessor`;
every other attention stays dense.

The processor does the stock steps around the attention: the projections, RMS qk-norm across
heads, the rotary embedding (interleaved or split, the model's ``rope_type``, through diffusers'
own functions) and, with ``gated_attn``, the per-head output gates. At ``state.sparsity == 0`` it
hands the call to the stock processor (the stock model exactly); above, the attention itself is
VSA2 over the tiled video grid. With fresh (zero) gates and alpha, a density-1 setting is the
stock model.

The grid is the call's ``(num_frames, height, width)`` in latents (LTX-2 patchifies 1 x 1 x 1, so
the tokens are the latents in raster order), recorded by a forward pre-hook. A call that gives
only ``video_coords``, a model with perturbed attention (``perturbed_attn``) and a video
self-attention mask (IC-LoRA) are refused with VSA2 rather than tiled wrong. Sequence
parallelism is not supported.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from vsa2_rl.attention import SparsityState, TileLayout
from vsa2_rl.config import VSA2Config
from vsa2_rl.models.attach import attach_vsa2, grid_context
from vsa2_rl.models.wan import vsa2_parameters


class LTX2VSA2Context:
    """The current call's video tile layout, recorded by the transformer's forward pre-hook and
    read by every block's processor."""

    def __init__(self, forward, patch_size: tuple[int, int, int]) -> None:
        self.signature = inspect.signature(forward)
        self.patch_size = patch_size
        self.layout: TileLayout | None = None

    @torch.compiler.disable
    def record(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook: the layout of this call's (frames, height, width) token grid."""
        call = self.signature.bind(*args, **kwargs).arguments
        latent_grid = [call.get(name) for name in ("num_frames", "height", "width")]
        if any(size is None for size in latent_grid):
            raise ValueError(
                "LTX-2 VSA2 needs the call's num_frames, height and width (the latent grid it "
                "tiles), not video_coords alone"
            )
        pairs = zip(latent_grid, self.patch_size, strict=True)
        grid = tuple(int(size) // patch for size, patch in pairs)
        self.layout = TileLayout.from_grid(grid).prepare(call["hidden_states"].device)


class LTX2VSA2AttnProcessor:
    """Processor for an LTX-2 block's video self-attention ``attn1`` running VSA2 (see module
    doc)."""

    def __init__(self, context: LTX2VSA2Context) -> None:
        self.context = context

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        query_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        key_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if attn.vsa2.state.sparsity == 0.0:  # the stock model
            attn.vsa2.state.record_density(1.0)
            return attn._vsa2_stock_processor(
                attn, hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb,
                key_rotary_emb,
            )  # fmt: skip
        self._check(hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb)
        from diffusers.models.transformers.transformer_ltx2 import (
            apply_interleaved_rotary_emb,
            apply_split_rotary_emb,
        )

        rotate = (
            apply_split_rotary_emb if attn.rope_type == "split" else apply_interleaved_rotary_emb
        )
        query = rotate(attn.norm_q(attn.to_q(hidden_states)), query_rotary_emb)
        key = rotate(attn.norm_k(attn.to_k(hidden_states)), key_rotary_emb or query_rotary_emb)
        value = attn.to_v(hidden_states)
        q, k, v = (x.unflatten(2, (attn.heads, -1)) for x in (query, key, value))
        out = attn.vsa2(q, k, v, hidden_states, self.context.layout)  # (B, N, H, D)
        if attn.to_gate_logits is not None:  # 2 sigmoid(logits): 1 at zero logits, as stock
            out = out * (2.0 * torch.sigmoid(attn.to_gate_logits(hidden_states)))[..., None]
        return attn.to_out[1](attn.to_out[0](out.flatten(2).to(query.dtype)))

    def _check(self, hidden_states, encoder_hidden_states, attention_mask, rotary_emb) -> None:
        layout = self.context.layout
        if encoder_hidden_states is not None or rotary_emb is None:
            raise ValueError("LTX2VSA2AttnProcessor is for the video self-attention attn1")
        if attention_mask is not None:
            raise ValueError(
                "LTX-2 VSA2: a video self-attention mask (IC-LoRA) is not supported; run with "
                "attention.enabled=false"
            )
        if layout is None or layout.num_tokens != hidden_states.shape[1]:
            raise ValueError(
                f"no token grid for a sequence of {hidden_states.shape[1]} tokens: call the "
                "transformer (its pre-hook records the grid), not the attention on its own"
            )


def enable_vsa2(transformer: nn.Module, vsa2_config: VSA2Config, state: SparsityState) -> nn.Module:
    """Run every LTX-2 block's video self-attention through VSA2; returns the same transformer.

    Each ``transformer_blocks[i].attn1`` gets a zero-initialised VSA2Attention as ``attn1.vsa2``
    (output = the dense model's at density 1) and the VSA2 processor, keeping its stock processor
    for sparsity 0 (:func:`~vsa2_rl.models.attach.attach_vsa2`); a pre-hook on the transformer
    records each call's grid. ``vsa2_config.enabled = False`` leaves the model dense. Calling it
    again updates config/state and keeps the trained VSA2 parameters.
    """
    from diffusers import LTX2VideoTransformer3DModel

    if not isinstance(transformer, LTX2VideoTransformer3DModel):
        raise ValueError(
            "transformer must be a diffusers LTX2VideoTransformer3DModel, got "
            f"{type(transformer).__name__}"
        )
    if transformer.config.perturbed_attn:
        raise ValueError("LTX-2 VSA2: models with perturbed attention are not supported yet")
    if not vsa2_config.enabled:
        return transformer
    config = transformer.config
    patch = (config.patch_size_t, config.patch_size, config.patch_size)
    context = grid_context(transformer, lambda: LTX2VSA2Context(transformer.forward, patch))
    processor = LTX2VSA2AttnProcessor(context)
    for block in transformer.transformer_blocks:
        attach_vsa2(block.attn1, vsa2_config, state, processor)
    return transformer


__all__ = ["LTX2VSA2AttnProcessor", "enable_vsa2", "vsa2_parameters"]
