"""VSA2 inside diffusers' HunyuanVideo15Transformer3DModel (HunyuanVideo-1.5).

Each HunyuanVideo-1.5 block runs one joint self-attention over the video tokens (N, raster
order of the post-patchify grid) followed by the conditioning tokens (L: image, ByT5 and MLLM
text, valid ones first; diffusers 0.42, ``transformer_hunyuan_video15.py``). The model passes a
[B, L] mask of the valid conditioning tokens (text-to-video masks all image tokens); a
query-key pair takes part where both are valid, so a padded conditioning query attends to
nothing (its output is 0, as SDPA gives for a fully masked row). Here the mask is applied to
the keys and the padded queries' outputs are zeroed, which is the same attention without the
model's [B, 1, N + L, N + L] pair mask.

``enable_vsa2`` gives every block's ``attn`` a :class:`VSA2Attention` (its alpha and gates, as
``transformer_blocks.{i}.attn.vsa2.*``) and :class:`HunyuanVSA2AttnProcessor`, which does the
stock projections, per-head RMS qk-norm and RoPE on the video tokens (real cos/sin of
interleaved pairs), and then splits the attention by query:

- conditioning queries: dense attention over all keys (video and conditioning), stock mask;
- video queries at ``state.sparsity == 0``: dense over all keys, the stock model exactly;
- video queries at sparsity > 0: VSA2 on the tiled video grid, its fine stage widened to the
  conditioning keys: ``O_fine`` = softmax over (router-selected video key segments, with the
  router bias ``alpha * log_probs``) together with (every valid conditioning key). It is
  computed as two partial attentions merged exactly by their log-sum-exp (as split-KV
  flash-decoding and ring attention combine partial softmaxes), ``lse =
  logaddexp(lse_v, lse_c)``, ``O_fine = exp(lse_v - lse) O_v + exp(lse_c - lse) O_c``; the
  video part is ``kernels.block_sparse_attention`` (which returns its LSE), the conditioning
  part plain attention over at most L keys, in query chunks of bounded memory. In the dense
  fallback (``1 - sparsity >= dense_threshold``) ``O_fine`` is one exact attention over all
  valid keys. (The kernel's LSE
  is float32, so for float64 inputs the merge is exact to float32 rounding.) The coarse stage
  (pooled video tiles only) and the gated fusion ``g_f * O_fine + g_c * O_coarse`` are VSA2's.
  With fresh (zero) gates and alpha, any density-1 setting therefore equals the stock model.

``kernels.vsa2_attention`` does not return the fine stage's LSE, so the video-query path
assembles VSA2 here from the kernels' public stages (``pool_tiles``, ``route``,
``block_sparse_attention``) instead of calling ``VSA2Attention.forward``; the tests check it
against ``VSA2Attention`` when no conditioning key is valid. The conditioning partial
materialises the [B, H, S, L] logits of one query chunk at a time (checkpointed under
autograd); a fused kernel would avoid even that.

The token grid comes from Wan's :class:`~vsa2_rl.models.wan.VSA2Context`: a forward pre-hook
of the transformer records the :class:`~vsa2_rl.attention.TileLayout` of (T // p_t, H // p,
W // p), the order in which the patch embedding flattens the tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from vsa2_rl import kernels
from vsa2_rl.attention import SparsityState, TileLayout, VSA2Attention
from vsa2_rl.config import VSA2Config
from vsa2_rl.models.wan import VSA2Context, vsa2_parameters


def _rotate(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """HunyuanVideo RoPE in float32: x [B, N, H, D]; cos, sin [N, D], each value repeated for
    the pair (x[2i], x[2i+1]) it rotates."""
    x32 = x.float()
    even, odd = x32.unflatten(-1, (-1, 2)).unbind(-1)
    turned = torch.stack((-odd, even), dim=-1).flatten(-2)
    return (x32 * freqs_cos[:, None] + turned * freqs_sin[:, None]).to(x.dtype)


def _attention(query, key, value, key_valid) -> torch.Tensor:
    """Attention of [B, Nq, H, D] queries over the valid ones ([B, Nk] bool) of [B, Nk, H, D]
    keys, the mask broadcast over the queries."""
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        attn_mask=key_valid[:, None, None, :],
    )
    return out.transpose(1, 2)


# Logit elements one chunk of the conditioning partial holds (1 GiB in float32): at
# HunyuanVideo-1.5's 720p (111,600 video queries, 16 heads, ~1,000 conditioning keys) the whole
# [B, H, N, L] logits and their softmax would take about 14 GiB a block.
PARTIAL_CHUNK_ELEMENTS = 2**28


def _partial_attention_rows(q, k, v, key_valid) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [B, H, S, D] over k, v [B, H, L, D] (valid keys ``key_valid`` [B, L])
    and its log-sum-exp [B, H, S], -inf for a sample without a valid key, whose output then
    means nothing (and gets no gradient through the merge)."""
    cdtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    logits = torch.einsum("bhsd,bhld->bhsl", q.to(cdtype), k.to(cdtype)) * q.shape[-1] ** -0.5
    valid = key_valid[:, None, None, :]
    has_key = valid.any(-1)  # (B, 1, 1)
    # a sample without a valid key keeps finite logits: an all -inf row would give NaN
    # gradients through logsumexp even where the merge weighs it by 0
    logits = logits.masked_fill(~valid & has_key[..., None], float("-inf"))
    out = torch.softmax(logits, dim=-1) @ v.to(cdtype)
    return out, torch.logsumexp(logits, dim=-1).masked_fill(~has_key, float("-inf"))


def _partial_attention(q, k, v, key_valid) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_partial_attention_rows` over query chunks of at most
    ``PARTIAL_CHUNK_ELEMENTS`` logits each; under autograd every chunk is checkpointed (its
    logits recomputed in the backward), so memory stays bounded by one chunk's logits."""
    batch, heads, rows = q.shape[:3]
    chunk_rows = max(1, PARTIAL_CHUNK_ELEMENTS // (batch * heads * k.shape[2]))
    if rows <= chunk_rows:
        return _partial_attention_rows(q, k, v, key_valid)
    outs, lses = [], []
    for q_chunk in q.split(chunk_rows, dim=2):
        if torch.is_grad_enabled():
            out, lse = checkpoint(
                _partial_attention_rows, q_chunk, k, v, key_valid, use_reentrant=False
            )
        else:
            out, lse = _partial_attention_rows(q_chunk, k, v, key_valid)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _merge(out_a, lse_a, out_b, lse_b) -> torch.Tensor:
    """Attention over the union of two disjoint key sets from the two partial attentions."""
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a, weight_b = (torch.exp(x - lse)[..., None] for x in (lse_a, lse_b))
    return out_a.to(lse.dtype) * weight_a + out_b.to(lse.dtype) * weight_b


# Eager inside compiled code, as VSA2Attention._sparse_attention: the sparsity is a Python
# float that the router turns into an output shape.
@torch.compiler.disable
def joint_vsa2_attention(
    vsa2: VSA2Attention,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    hidden_states: torch.Tensor,
    layout: TileLayout,
    cond_key: torch.Tensor,
    cond_value: torch.Tensor,
    cond_valid: torch.Tensor,
) -> torch.Tensor:
    """VSA2 attention of the video queries over the video and conditioning keys at sparsity
    > 0 (module doc). query, key, value [B, N, H, D] raster order, RoPE applied;
    ``hidden_states`` [B, N, dim] drives the gates; cond_key, cond_value [B, L, H, D],
    ``cond_valid`` [B, L]. Returns [B, N, H, D] in raster order, in query's dtype."""
    config, sparsity = vsa2.config, vsa2.state.sparsity
    q_tile, kv_block, backend = config.q_tile, config.kv_block, config.backend
    gate_coarse = vsa2.to_gate_coarse(hidden_states).view(query.shape)
    gate_fine = 1.0 + vsa2.to_gate_fine(hidden_states).view(query.shape)
    q, k, v, g_c, g_f = (
        layout.tile(x).transpose(1, 2) for x in (query, key, value, gate_coarse, gate_fine)
    )  # (B, H, S, D)
    c_k, c_v = cond_key.transpose(1, 2), cond_value.transpose(1, 2)  # (B, H, L, D)
    tile_lengths, seg_lengths = layout.lengths(kv_block, q.device)
    q_tiles = kernels.pool_tiles(q, tile_lengths, q_tile, backend=backend)  # (B, H, NQ, D)

    # -- fine stage: video keys (sparse) together with the conditioning keys (dense) ----------
    if 1.0 - sparsity >= config.dense_threshold:
        video_valid = torch.arange(layout.padded_len, device=q.device) < layout.num_tokens
        key_valid = torch.cat([video_valid.expand(q.shape[0], -1), cond_valid], dim=1)
        fine = F.scaled_dot_product_attention(
            q, torch.cat([k, c_k], dim=2), torch.cat([v, c_v], dim=2),
            attn_mask=key_valid[:, None, None, :],
        )  # fmt: skip
        density = 1.0
    else:
        routing = kernels.route(
            q_tiles,
            kernels.pool_tiles(k, seg_lengths, kv_block, backend=backend),
            seg_lengths,
            sparsity=sparsity,
            mode=config.mode,
            top_p=config.top_p,
            min_kv=config.min_kv,
            num_valid_segments=-(-layout.num_tokens // kv_block),
            backend=backend,
        )
        bias = vsa2.alpha.float()[None, :, None, None] * routing.log_probs
        out_video, lse_video = kernels.block_sparse_attention(
            q, k, v, routing.kv_indices, routing.kv_counts, bias,
            q_tile=q_tile, kv_block=kv_block, kv_lengths=seg_lengths, backend=backend,
        )  # fmt: skip
        fine = _merge(out_video, lse_video, *_partial_attention(q, c_k, c_v, cond_valid))
        density = routing.density
    vsa2.state.record_density(density)

    # -- coarse stage over the video tiles, gated fusion ---------------------------------------
    k_tiles, v_tiles = (
        kernels.pool_tiles(x, tile_lengths, q_tile, backend=backend) for x in (k, v)
    )
    tile_valid = (tile_lengths > 0)[None, None, None, :]
    coarse = F.scaled_dot_product_attention(q_tiles, k_tiles, v_tiles, attn_mask=tile_valid)
    out = g_f * fine + g_c * coarse.repeat_interleave(q_tile, dim=2)
    return layout.untile(out.transpose(1, 2)).to(query.dtype)  # (B, N, H, D)


class HunyuanVSA2AttnProcessor:
    """Joint-attention processor for a HunyuanVideo-1.5 block's ``attn`` running VSA2 on the
    video queries (see module doc). Returns (video output, conditioning output)."""

    def __init__(self, context: VSA2Context) -> None:
        self.context = context

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layout = self.context.layout
        if encoder_hidden_states is None or attention_mask is None or image_rotary_emb is None:
            raise ValueError(
                "HunyuanVSA2AttnProcessor is for the joint attention of a HunyuanVideo-1.5 "
                "block: it needs encoder_hidden_states, attention_mask and image_rotary_emb"
            )
        if layout is None or layout.num_tokens != hidden_states.shape[1]:
            raise ValueError(
                f"no token grid for a sequence of {hidden_states.shape[1]} tokens: call the "
                "transformer (its pre-hook records the grid), not the attention on its own"
            )
        if attn.vsa2.sequence_parallel is not None:
            raise ValueError("sequence parallelism is not supported for HunyuanVideo-1.5 yet")

        def heads(x):
            return x.unflatten(2, (attn.heads, -1))  # (B, N, H, D)

        query = _rotate(attn.norm_q(heads(attn.to_q(hidden_states))), *image_rotary_emb)
        key = _rotate(attn.norm_k(heads(attn.to_k(hidden_states))), *image_rotary_emb)
        value = heads(attn.to_v(hidden_states))
        cond_query = heads(attn.add_q_proj(encoder_hidden_states))
        cond_key = heads(attn.add_k_proj(encoder_hidden_states))
        cond_value = heads(attn.add_v_proj(encoder_hidden_states))
        if attn.norm_added_q is not None:
            cond_query = attn.norm_added_q(cond_query)
        if attn.norm_added_k is not None:
            cond_key = attn.norm_added_k(cond_key)

        cond_valid = attention_mask.bool()  # (B, L)
        video_valid = cond_valid.new_ones(hidden_states.shape[:2])
        keys, values = torch.cat([key, cond_key], dim=1), torch.cat([value, cond_value], dim=1)
        key_valid = torch.cat([video_valid, cond_valid], dim=1)
        # a padded conditioning query attends to nothing: 0, as for the model's fully masked row
        cond_out = _attention(cond_query, keys, values, key_valid) * cond_valid[..., None, None]
        if attn.vsa2.state.sparsity == 0.0:  # the stock model
            attn.vsa2.state.record_density(1.0)
            video_out = _attention(query, keys, values, key_valid)
        else:
            video_out = joint_vsa2_attention(
                attn.vsa2, query, key, value, hidden_states, layout, cond_key, cond_value,
                cond_valid,
            )  # fmt: skip
        video_out = attn.to_out[1](attn.to_out[0](video_out.flatten(2).type_as(query)))
        cond_out = attn.to_add_out(cond_out.flatten(2).type_as(query))
        return video_out, cond_out


def enable_vsa2(transformer: nn.Module, vsa2_config: VSA2Config, state: SparsityState) -> nn.Module:
    """Run every HunyuanVideo-1.5 block's joint attention through VSA2; returns the same
    transformer.

    Each ``transformer_blocks[i].attn`` gets a zero-initialised :class:`VSA2Attention` as
    ``attn.vsa2`` (output = the dense model's at density 1) and the VSA2 processor; a pre-hook
    on the transformer records the token grid of each call. The token refiner's attention stays
    dense. ``vsa2_config.enabled = False`` leaves the model dense. Calling it again updates
    config/state and keeps the trained VSA2 parameters.
    """
    from diffusers import HunyuanVideo15Transformer3DModel

    if not isinstance(transformer, HunyuanVideo15Transformer3DModel):
        raise ValueError(
            "transformer must be a diffusers HunyuanVideo15Transformer3DModel, got "
            f"{type(transformer).__name__}"
        )
    if not vsa2_config.enabled:
        return transformer
    context = getattr(transformer, "_vsa2_context", None)
    if context is None:
        config = transformer.config
        context = VSA2Context((config.patch_size_t, config.patch_size, config.patch_size))
        transformer.register_forward_pre_hook(context.record_grid, with_kwargs=True)
        transformer._vsa2_context = context
    processor = HunyuanVSA2AttnProcessor(context)
    for block in transformer.transformer_blocks:
        attn = block.attn
        if not hasattr(attn, "vsa2"):
            weight = attn.to_q.weight
            attn.vsa2 = VSA2Attention(attn.inner_dim, attn.heads, vsa2_config, state).to(
                device=weight.device, dtype=weight.dtype
            )
        attn.vsa2.config, attn.vsa2.state = vsa2_config, state
        attn.set_processor(processor)
    return transformer


__all__ = ["HunyuanVSA2AttnProcessor", "enable_vsa2", "joint_vsa2_attention", "vsa2_parameters"]
