"""VSA2 inside diffusers' WanTransformer3DModel (Wan2.1 and Wan2.2).

``enable_vsa2`` swaps the self-attention (``attn1``) of every Wan block to VSA2; cross-attention
(``attn2``) stays dense. The processor does what diffusers' ``WanAttnProcessor`` (diffusers 0.42,
``transformer_wan.py``) does for self-attention -- q/k/v projections, RMS qk-norm across heads,
interleaved-pair RoPE, output projection -- but replaces the attention call with: tile the
tokens (:class:`~vsa2_rl.attention.TileLayout` of the post-patchify grid), VSA2 attention
(:class:`~vsa2_rl.attention.VSA2Attention`, which owns the layer's alpha and gates), untile.

The processor needs the token grid, which an attention layer cannot infer from its
[B, T*H*W, dim] input. A forward pre-hook on the transformer records the layout of
(T // p_t, H // p_h, W // p_w) in a context object shared by the model's processors before the
blocks run, so any latent size works. The VSA2 parameters live in ``attn1.vsa2`` (an
nn.Module), so state_dict, optimizers and peft see them as ``blocks.{i}.attn1.vsa2.*``.

``fuse_block_kernels`` (``model.fused_kernels``) runs the blocks' norms, adaLN modulation,
residuals, qk-norm and RoPE through the fused kernels of :mod:`vsa2_rl.kernels.fused_block`;
``wan_block_forward`` and the processor's unfused path stay the reference.

``wan_velocity`` is the one call of a Wan transformer (or Wan2.2 A14B's pair of experts,
:mod:`vsa2_rl.models.experts`) that the bundles make; :mod:`vsa2_rl.models.wan_bundle` loads
local diffusers folders.
"""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn

from vsa2_rl.attention import SparsityState, TileLayout, VSA2Attention
from vsa2_rl.config import VSA2Config
from vsa2_rl.kernels import (
    gated_residual,
    gated_residual_layer_norm,
    modulated_layer_norm,
    rms_norm_rope,
)
from vsa2_rl.models.conditioning import WanCondition
from vsa2_rl.models.experts import experts_of

# --------------------------------------------------------------------------------------------
# Attention processor


class VSA2Context:
    """Token layout of the current call, shared by the hook and the processors of one model,
    and whether those processors run the fused qk-norm + RoPE kernel (``fuse_block_kernels``).

    With gradient checkpointing the blocks are recomputed in the backward pass with the layout
    recorded then, so a forward of a different grid through the same model must not come
    between a forward and its backward (a different token count raises; same-grid forwards,
    such as a LoRA-disabled reference pass, are fine).
    """

    def __init__(self, patch_size) -> None:
        self.patch_size = tuple(int(p) for p in patch_size)
        self.layout: TileLayout | None = None
        self.fused_kernels = False

    # Eager under a compiled transformer: dynamo would trace through the layout's cache and
    # build the tile order inside the graph, every call.
    @torch.compiler.disable
    def record_grid(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook of the transformer: layout of this call's post-patchify grid."""
        latents = args[0] if args else kwargs["hidden_states"]
        frames, height, width = latents.shape[-3:]
        p_t, p_h, p_w = self.patch_size
        # indices on the device before the (possibly compiled) blocks run: made in the first
        # compiled block, the next block recompiled, and under gradient checkpointing the
        # first block's recompute then ran the recompiled graph, which saved its tensors in
        # another order (torch.utils.checkpoint raised, on an H200 in float32)
        grid = (frames // p_t, height // p_h, width // p_w)
        self.layout = TileLayout.from_grid(grid).prepare(latents.device)


def _rotate(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Wan RoPE: rotate interleaved pairs (x[2i], x[2i+1]); x [B, N, H, D], freqs [1, N, 1, D]."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


class WanVSA2AttnProcessor:
    """Self-attention processor for diffusers' ``WanAttention`` running VSA2 (see module doc)."""

    def __init__(self, context: VSA2Context) -> None:
        self.context = context

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError(
                "WanVSA2AttnProcessor is for self-attention (attn1) without a mask; got "
                "encoder_hidden_states or attention_mask"
            )
        layout, sp = self.context.layout, attn.vsa2.sequence_parallel
        tokens = None if layout is None else layout.num_tokens
        if tokens is not None and sp is not None:  # this rank holds a slice of the tokens
            mine = sp.token_slice(tokens)
            tokens = mine.stop - mine.start
        if tokens != hidden_states.shape[1]:
            raise ValueError(
                f"no token grid for a sequence of {hidden_states.shape[1]} tokens: call the "
                "transformer (its pre-hook records the grid), not attn1 on its own"
            )
        if getattr(attn, "fused_projections", False):
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = (
                attn.to_q(hidden_states),
                attn.to_k(hidden_states),
                attn.to_v(hidden_states),
            )
        value = value.unflatten(2, (attn.heads, -1))
        if self.context.fused_kernels and rotary_emb is not None and _has_rms_qk_norm(attn):
            query = _fused_rms_norm_rope(attn.norm_q, query, rotary_emb, attn.heads)
            key = _fused_rms_norm_rope(attn.norm_k, key, rotary_emb, attn.heads)
        else:
            query = attn.norm_q(query).unflatten(2, (attn.heads, -1))  # (B, N, H, D)
            key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
            if rotary_emb is not None:
                query = _rotate(query, *rotary_emb)
                key = _rotate(key, *rotary_emb)

        out = attn.vsa2(query, key, value, hidden_states, layout)  # (B, N, H, D)
        out = out.flatten(2, 3).type_as(query)
        out = attn.to_out[0](out)
        return attn.to_out[1](out)


def _has_rms_qk_norm(attn: nn.Module) -> bool:
    """Wan's ``qk_norm="rms_norm_across_heads"``: an RMSNorm with a weight over all heads."""
    return all(
        isinstance(norm, nn.RMSNorm) and norm.weight is not None
        for norm in (attn.norm_q, attn.norm_k)
    )


def _fused_rms_norm_rope(norm: nn.RMSNorm, x, rotary_emb, heads: int) -> torch.Tensor:
    """``_rotate(norm(x))`` as (B, N, H, D), in one kernel (``rms_norm_rope``)."""
    eps = torch.finfo(x.dtype).eps if norm.eps is None else norm.eps
    return rms_norm_rope(x, norm.weight, *rotary_emb, heads, eps)


def enable_vsa2(transformer: nn.Module, vsa2_config: VSA2Config, state: SparsityState) -> nn.Module:
    """Run every Wan block's self-attention through VSA2; returns the same transformer.

    Each ``blocks[i].attn1`` gets a zero-initialised :class:`VSA2Attention` as ``attn1.vsa2``
    (output = the dense model's at density 1) and the VSA2 processor; a pre-hook on the
    transformer records the token grid of each call. ``vsa2_config.enabled = False`` leaves the
    model dense. Calling it again updates config/state and keeps the trained VSA2 parameters.
    """
    if not vsa2_config.enabled:
        return transformer
    blocks = getattr(transformer, "blocks", None)
    patch_size = getattr(getattr(transformer, "config", None), "patch_size", None)
    if blocks is None or patch_size is None:
        raise ValueError(
            "transformer must be a diffusers WanTransformer3DModel, got "
            f"{type(transformer).__name__}"
        )
    context = getattr(transformer, "_vsa2_context", None)
    if context is None:
        context = VSA2Context(patch_size)
        transformer.register_forward_pre_hook(context.record_grid, with_kwargs=True)
        transformer._vsa2_context = context
    processor = WanVSA2AttnProcessor(context)
    for block in blocks:
        attn = block.attn1
        if not hasattr(attn, "vsa2"):
            weight = attn.to_q.weight
            attn.vsa2 = VSA2Attention(attn.inner_dim, attn.heads, vsa2_config, state).to(
                device=weight.device, dtype=weight.dtype
            )
        attn.vsa2.config, attn.vsa2.state = vsa2_config, state
        attn.set_processor(processor)
    return transformer


def vsa2_parameters(transformer: nn.Module) -> list[nn.Parameter]:
    """The VSA2 parameters (alpha and gates of every layer) of a VSA2-enabled transformer."""
    return [p for name, p in transformer.named_parameters() if ".vsa2." in f".{name}"]


def compile_blocks(transformer: nn.Module) -> nn.Module:
    """Regional ``torch.compile`` of the transformer blocks (``model.compile_blocks``).

    A dense model compiles each block whole (diffusers' ``compile_repeated_blocks``). A VSA2
    block compiles whole too, with and without autograd, but runs :func:`wan_block_forward`
    instead of diffusers' forward. The VSA2 call is a graph break inside the block (see
    ``VSA2Attention._sparse_attention``); with diffusers' forward, the modulation chunks used
    after the self-attention become inputs of the graph resumed after the break, and its
    backward failed at the Wan-1.3B shape in bf16 on an H200 (torch 2.11: a ``[C]`` gradient
    returned for a ``[1, 1, C]`` chunk; pytorch/pytorch#178080 is the same bug; a two-layer
    test model does not reproduce it). ``wan_block_forward`` recomputes those chunks after the
    break (a ``[B, 6, C]`` add), so none crosses it, and trains at that shape
    (docs/results.md). Compiles on first use; returns the same transformer.
    """
    for expert in experts_of(transformer):
        blocks = getattr(expert, "blocks", None)
        if blocks is None or not any(hasattr(block.attn1, "vsa2") for block in blocks):
            expert.compile_repeated_blocks()
            continue
        for block in blocks:
            block.forward = _CompiledBlockForward(block)
    return transformer


def _modulation(block: nn.Module, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The six modulation tensors of a Wan block (shift, scale, gate of the self-attention, then
    of the feed-forward), float32, as diffusers 0.42 computes them: from ``temb`` [B, 6, C]
    (Wan2.1, Wan2.2-14B) as [B, 1, C] each, or from ``temb`` [B, N, 6, C] (Wan2.2-TI2V, one
    timestep per token) as [B, N, C] each."""
    if temb.ndim == 4:
        chunks = (block.scale_shift_table.unsqueeze(0) + temb.float()).chunk(6, dim=2)
        return tuple(chunk.squeeze(2) for chunk in chunks)
    return (block.scale_shift_table + temb.float()).chunk(6, dim=1)


def _self_attention_input(block: nn.Module, hidden_states, temb) -> torch.Tensor:
    shift, scale = _modulation(block, temb)[:2]
    return (block.norm1(hidden_states.float()) * (1 + scale) + shift).type_as(hidden_states)


def enable_sequence_parallel(transformer: nn.Module, sp) -> nn.Module:
    """Ulysses sequence parallelism for a Wan transformer with VSA2 (``vsa2_rl.parallel``).

    Each rank's blocks run on its slice of the tokens (RoPE frequencies and per-token timestep
    embeddings sliced alike); cross-attention, FFN and norms work per token on the slice, VSA2
    self-attention exchanges slices for heads around the sparse attention, and after the last
    block the slices are gathered so the output projection and unpatchify see every token.
    Every rank of the group must get the same inputs. Wan2.2 A14B's experts are each split so.
    Returns the same transformer.
    """
    from functools import partial

    for expert in experts_of(transformer):
        context = getattr(expert, "_vsa2_context", None)
        if context is None:
            raise ValueError("enable_vsa2 the transformer before enable_sequence_parallel")
        sp.head_slice(expert.config.num_attention_heads)  # the group size must divide the heads
        for block in expert.blocks:
            block.attn1.vsa2.sequence_parallel = sp
            block.register_forward_pre_hook(partial(_slice_block_inputs, sp, context))
        expert.blocks[-1].register_forward_hook(partial(_gather_block_output, sp, context))
    return transformer


def _slice_block_inputs(sp, context: VSA2Context, block: nn.Module, args: tuple) -> tuple:
    """Forward pre-hook of a block: this rank's token slice of whatever still holds all tokens
    (the hidden states before the first block, RoPE, per-token timestep embeddings)."""
    tokens = context.layout.num_tokens
    mine = sp.token_slice(tokens)

    def slice_tokens(x):
        return x[:, mine] if torch.is_tensor(x) and x.dim() >= 2 and x.shape[1] == tokens else x

    hidden_states, encoder_hidden_states, timestep_proj, rotary_emb = args
    if timestep_proj.dim() == 4:  # [B, N, 6, dim] (Wan 2.2 per-token timesteps)
        timestep_proj = slice_tokens(timestep_proj)
    return (
        slice_tokens(hidden_states),
        encoder_hidden_states,
        timestep_proj,
        tuple(slice_tokens(x) for x in rotary_emb),
    )


def _gather_block_output(sp, context: VSA2Context, block, args, output) -> torch.Tensor:
    return sp.gather_tokens(output, context.layout.num_tokens)


def wan_block_forward(
    block: nn.Module,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    rotary_emb: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """The math of diffusers' ``WanTransformerBlock.forward`` (0.42), arranged for a graph break
    in ``attn1``: the modulation chunks are computed before the self-attention only inside a
    helper and again after it, so none is alive across the break (``compile_blocks`` says
    why). Equal to diffusers' forward (tests/test_models.py checks it)."""
    attn_output = block.attn1(
        _self_attention_input(block, hidden_states, temb), None, None, rotary_emb
    )
    _, _, gate, ffn_shift, ffn_scale, ffn_gate = _modulation(block, temb)
    hidden_states = (hidden_states.float() + attn_output * gate).type_as(hidden_states)
    norm_hidden_states = block.norm2(hidden_states.float()).type_as(hidden_states)
    hidden_states = hidden_states + block.attn2(
        norm_hidden_states, encoder_hidden_states, None, None
    )
    norm_hidden_states = (block.norm3(hidden_states.float()) * (1 + ffn_scale) + ffn_shift).type_as(
        hidden_states
    )
    ff_output = block.ffn(norm_hidden_states)
    return (hidden_states.float() + ff_output.float() * ffn_gate).type_as(hidden_states)


def fused_wan_block_forward(
    block: nn.Module,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    rotary_emb: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """:func:`wan_block_forward` with the norms, adaLN modulation and gated residuals in fused
    kernels: norm1 and norm3 with their shift / scale, attn1's gated residual with norm2 (the
    cross-attention norm), the feed-forward's gated residual. The attention layers, the
    cross-attention's plain residual and the feed-forward are unchanged."""
    shift, scale, gate, ffn_shift, ffn_scale, ffn_gate = _modulation(block, temb)
    norm_hidden_states = modulated_layer_norm(hidden_states, shift, scale, block.norm1.eps)
    attn_output = block.attn1(norm_hidden_states, None, None, rotary_emb)
    norm2 = block.norm2
    if isinstance(norm2, nn.LayerNorm) and norm2.weight is not None and norm2.bias is not None:
        hidden_states, norm_hidden_states = gated_residual_layer_norm(
            hidden_states, attn_output, gate, norm2.weight, norm2.bias, norm2.eps
        )
    else:  # cross_attn_norm=False: norm2 is nn.Identity
        hidden_states = gated_residual(hidden_states, attn_output, gate)
        norm_hidden_states = norm2(hidden_states.float()).type_as(hidden_states)
    hidden_states = hidden_states + block.attn2(
        norm_hidden_states, encoder_hidden_states, None, None
    )
    norm_hidden_states = modulated_layer_norm(hidden_states, ffn_shift, ffn_scale, block.norm3.eps)
    return gated_residual(hidden_states, block.ffn(norm_hidden_states), ffn_gate)


def fuse_block_kernels(transformer: nn.Module) -> nn.Module:
    """Run every VSA2 block through :func:`fused_wan_block_forward` and its self-attention's
    qk-norm + RoPE through ``rms_norm_rope`` (``model.fused_kernels``); returns the same
    transformer.

    The kernels run on CUDA tensors (and on CPU under ``TRITON_INTERPRET=1``); elsewhere, for
    float64 and under ``torch.compile`` the same functions run their pure-torch reference, the
    unfused math. ``compile_blocks`` leaves the fusion to inductor instead: the trainer applies
    one or the other, never both. Blocks without VSA2 (a dense model) keep diffusers' forward.
    A deep copy (full fine-tuning's frozen reference) runs fused as well.
    """
    for expert in experts_of(transformer):
        context = getattr(expert, "_vsa2_context", None)
        if context is None:
            continue
        context.fused_kernels = True
        for block in expert.blocks:
            if hasattr(block.attn1, "vsa2"):
                block.forward = functools.partial(fused_wan_block_forward, block)
    return transformer


class _CompiledBlockForward:
    """A VSA2 block's forward: ``wan_block_forward`` compiled (every block compiles the same
    function, so they share its compiled code, as in regional compilation). A deep copy (the
    frozen reference policy of full fine-tuning) runs the copied block, not the original."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        self.compiled = torch.compile(wan_block_forward)

    def __call__(self, *args, **kwargs):
        return self.compiled(self.block, *args, **kwargs)

    def __deepcopy__(self, memo) -> _CompiledBlockForward:
        return _CompiledBlockForward(copy.deepcopy(self.block, memo))


# --------------------------------------------------------------------------------------------
# Bundle


def input_dtype(transformer: nn.Module) -> torch.dtype:
    """The dtype the DiT takes its inputs in: its patch embedding's.

    Not the first parameter's: diffusers keeps ``scale_shift_table`` and the time embedder in
    float32 when it loads a bf16 checkpoint. ``transformer`` may be wrapped by DDP or DeepSpeed
    (both keep the model as ``.module``) and may be Wan2.2's pair of experts.
    """
    return experts_of(transformer)[0].patch_embedding.weight.dtype


def wan_velocity(
    transformer: nn.Module,
    latents: torch.Tensor,
    sigma: torch.Tensor,
    condition: torch.Tensor | WanCondition,
    *,
    expand_timesteps: bool = False,
) -> torch.Tensor:
    """Flow-matching velocity (noise - data) in float32 at noise levels ``sigma`` [B] in [0, 1].

    The timestep is ``sigma * 1000``, as Wan's FlowMatchEulerDiscreteScheduler feeds it; with
    ``expand_timesteps`` (Wan2.2 TI2V-5B) one per token, 0 on an image's first frame.
    ``condition`` is the text embedding [B, L, D] or a :class:`WanCondition` (image-to-video,
    vsa2_rl.models.conditioning says how each scheme enters the model).
    """
    dtype = input_dtype(transformer)
    timestep = sigma.reshape(-1).expand(latents.shape[0]).float() * 1000.0
    text, image_states, model_input, generated = condition, None, latents, None
    if isinstance(condition, WanCondition):
        text, image_states = condition.text, condition.image_embeds
        image = condition.image_latents.to(device=latents.device, dtype=latents.dtype)
        if condition.scheme == "channels":
            model_input = torch.cat([latents, image], dim=1)
        else:
            generated = condition.generated_mask(latents)
            model_input = condition.final_latents(latents)
    if expand_timesteps:
        timestep = _token_timesteps(transformer, latents, timestep, generated)
    out = transformer(
        hidden_states=model_input.to(dtype),
        timestep=timestep,
        encoder_hidden_states=text.to(dtype),
        encoder_hidden_states_image=None if image_states is None else image_states.to(dtype),
        return_dict=False,
    )[0].float()
    return out if generated is None else out * generated


def _token_timesteps(transformer, latents, timestep, generated) -> torch.Tensor:
    """[B, N] timesteps of the post-patchify tokens (frame-major, as the model flattens them):
    each sample's timestep, 0 where ``generated`` (1 on generated latent frames) is 0."""
    _, p_h, p_w = experts_of(transformer)[0].config.patch_size
    if generated is None:
        generated = torch.ones_like(latents[:1, :1])
    per_token = generated[0, 0, :, ::p_h, ::p_w].flatten().to(timestep)
    return timestep[:, None] * per_token[None]


__all__ = [
    "VSA2Context",
    "WanVSA2AttnProcessor",
    "compile_blocks",
    "enable_sequence_parallel",
    "enable_vsa2",
    "fuse_block_kernels",
    "fused_wan_block_forward",
    "input_dtype",
    "vsa2_parameters",
    "wan_block_forward",
    "wan_velocity",
]
