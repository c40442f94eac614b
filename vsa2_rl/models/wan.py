"""VSA2 inside diffusers' WanTransformer3DModel, and the Wan2.1 model bundle.

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

``load_wan_bundle`` loads a local diffusers Wan2.1 folder (no download) and implements the
``VideoDiTBundle`` protocol of docs/concepts.md with the Wan pipeline's conventions: UMT5
prompt embeddings trimmed to the prompt length and zero-padded to 512 tokens, timestep =
sigma * 1000 (flow-matching Euler scheduler), and latents de-normalised with the VAE's
``latents_mean`` / ``latents_std`` before decoding.
"""

from __future__ import annotations

import copy
import hashlib
import os
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from vsa2_rl.attention import SparsityState, TileLayout, VSA2Attention
from vsa2_rl.config import ConfigError, VSA2Config

WAN_TEXT_LEN = 512  # UMT5 context length of Wan2.1 (the transformer is trained on 512 tokens)
WAN_COMPONENTS = ("transformer", "text_encoder", "tokenizer", "vae")


@runtime_checkable
class VideoDiTBundle(Protocol):
    """A video DiT with its text encoder and decoder (docs/concepts.md, "The model bundle")."""

    transformer: nn.Module
    sparsity_state: SparsityState
    latent_channels: int

    def latent_shape(self, num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        """(C, T, H, W) of the latents of a video of that size."""
        ...

    def encode_prompts(self, prompts: list[str]) -> torch.Tensor:
        """[B, L, D_text] text embeddings."""
        ...

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, text_emb: torch.Tensor):
        """Flow-matching velocity (noise - data) at noise level sigma [B] in [0, 1]."""
        ...

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Videos [B, T, C, H, W] in [0, 1], float32."""
        ...


# --------------------------------------------------------------------------------------------
# Attention processor


class VSA2Context:
    """Token layout of the current call, shared by the hook and the processors of one model.

    With gradient checkpointing the blocks are recomputed in the backward pass with the layout
    recorded then, so a forward of a different grid through the same model must not come
    between a forward and its backward (a different token count raises; same-grid forwards,
    such as a LoRA-disabled reference pass, are fine).
    """

    def __init__(self, patch_size) -> None:
        self.patch_size = tuple(int(p) for p in patch_size)
        self.layout: TileLayout | None = None

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
        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))  # (B, N, H, D)
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query = _rotate(query, *rotary_emb)
            key = _rotate(key, *rotary_emb)

        out = attn.vsa2(query, key, value, hidden_states, layout)  # (B, N, H, D)
        out = out.flatten(2, 3).type_as(query)
        out = attn.to_out[0](out)
        return attn.to_out[1](out)


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
    (benchmarks/BENCHMARKS.md). Compiles on first use; returns the same transformer.
    """
    blocks = getattr(transformer, "blocks", None)
    if blocks is None or not any(hasattr(block.attn1, "vsa2") for block in blocks):
        transformer.compile_repeated_blocks()
        return transformer
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
    Every rank of the group must get the same inputs. Returns the same transformer.
    """
    from functools import partial

    context = getattr(transformer, "_vsa2_context", None)
    if context is None:
        raise ValueError("enable_vsa2 the transformer before enable_sequence_parallel")
    heads = transformer.config.num_attention_heads
    sp.head_slice(heads)  # the group size must divide the heads
    for block in transformer.blocks:
        block.attn1.vsa2.sequence_parallel = sp
        block.register_forward_pre_hook(partial(_slice_block_inputs, sp, context))
    transformer.blocks[-1].register_forward_hook(partial(_gather_block_output, sp, context))
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
    (both keep the model as ``.module``).
    """
    return getattr(transformer, "module", transformer).patch_embedding.weight.dtype


def wan_velocity(
    transformer: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, text_emb: torch.Tensor
) -> torch.Tensor:
    """Flow-matching velocity (noise - data) in float32 at noise levels ``sigma`` [B] in [0, 1].

    The timestep is ``sigma * 1000``, as Wan's FlowMatchEulerDiscreteScheduler feeds it.
    """
    dtype = input_dtype(transformer)
    sigma = sigma.reshape(-1).expand(latents.shape[0])
    out = transformer(
        hidden_states=latents.to(dtype),
        timestep=sigma.float() * 1000.0,
        encoder_hidden_states=text_emb.to(dtype),
        return_dict=False,
    )[0]
    return out.float()


def resolve_dtype(dtype: torch.dtype | str, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in names:
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    return names[dtype]


@dataclass
class WanBundle:
    """Wan2.1 text-to-video model as a ``VideoDiTBundle`` (see the module docstring).

    ``text_encoder``, ``tokenizer`` and ``vae`` may be None when only the transformer was loaded;
    then ``encode_prompts`` / ``decode`` raise.
    """

    transformer: nn.Module
    sparsity_state: SparsityState
    latent_channels: int
    text_encoder: nn.Module | None = None
    tokenizer: Any = None
    vae: nn.Module | None = None
    text_cache_dir: str | None = None
    cache_key: str = ""  # identifies the text encoder in cache file names
    text_len: int = WAN_TEXT_LEN
    _memory_cache: dict = field(default_factory=dict, repr=False)

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return input_dtype(self.transformer)

    def _scale_factors(self) -> tuple[int, int]:
        if self.vae is None:
            return 4, 8  # Wan2.1 VAE: 4x in time, 8x in space
        downsample = list(self.vae.config.temperal_downsample)
        return 2 ** sum(downsample), 2 ** len(downsample)

    def latent_shape(self, num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        t_scale, s_scale = self._scale_factors()
        _, p_h, p_w = self.transformer.config.patch_size
        if (num_frames - 1) % t_scale != 0:
            raise ValueError(
                f"num_frames must be {t_scale}*k + 1 for the Wan VAE (e.g. 81), got {num_frames}"
            )
        if height % (s_scale * p_h) or width % (s_scale * p_w):
            raise ValueError(
                f"height and width must be multiples of {s_scale * p_h}, got {height}x{width}"
            )
        frames = (num_frames - 1) // t_scale + 1
        return self.latent_channels, frames, height // s_scale, width // s_scale

    def _cache_path(self, prompt: str) -> str | None:
        if not self.text_cache_dir:
            return None
        digest = hashlib.sha256(f"{self.cache_key}\n{prompt}".encode()).hexdigest()[:32]
        return os.path.join(self.text_cache_dir, f"{digest}.pt")

    def _encode_uncached(self, prompts: list[str]) -> list[torch.Tensor]:
        """Per prompt: UMT5 last hidden states of its real tokens, [L_i, D] (Wan pipeline)."""
        if self.text_encoder is None or self.tokenizer is None:
            raise ValueError("this bundle was loaded without text_encoder/tokenizer")
        tokens = self.tokenizer(
            prompts,
            padding="max_length",
            max_length=self.text_len,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        device = next(self.text_encoder.parameters()).device
        mask = tokens.attention_mask.to(device)
        with torch.no_grad():
            hidden = self.text_encoder(tokens.input_ids.to(device), mask).last_hidden_state
        lengths = mask.gt(0).sum(dim=1).tolist()
        return [h[:n].float().cpu() for h, n in zip(hidden, lengths, strict=True)]

    def encode_prompts(self, prompts: list[str]) -> torch.Tensor:
        """[B, 512, D_text] UMT5 embeddings, zero past each prompt; cached per prompt on disk."""
        prompts = [" ".join(p.split()) for p in prompts]
        embeddings: dict[str, torch.Tensor] = {}
        missing = []
        for prompt in dict.fromkeys(prompts):
            path = self._cache_path(prompt)
            if prompt in self._memory_cache:
                embeddings[prompt] = self._memory_cache[prompt]
            elif path is not None and os.path.exists(path):
                embeddings[prompt] = torch.load(path, map_location="cpu", weights_only=True)
            else:
                missing.append(prompt)
        if missing:
            for prompt, emb in zip(missing, self._encode_uncached(missing), strict=True):
                embeddings[prompt] = emb
                path = self._cache_path(prompt)
                if path is not None:
                    os.makedirs(self.text_cache_dir, exist_ok=True)
                    tmp = f"{path}.tmp{os.getpid()}"
                    torch.save(emb, tmp)
                    os.replace(tmp, path)  # atomic: concurrent ranks never read half a file
        self._memory_cache.update(embeddings)
        out = torch.zeros(len(prompts), self.text_len, embeddings[prompts[0]].shape[-1])
        for i, prompt in enumerate(prompts):
            emb = embeddings[prompt][: self.text_len]
            out[i, : emb.shape[0]] = emb
        return out.to(device=self.device, dtype=self.dtype)

    def velocity(
        self, latents: torch.Tensor, sigma: torch.Tensor, text_emb: torch.Tensor
    ) -> torch.Tensor:
        return wan_velocity(self.transformer, latents, sigma, text_emb)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Wan VAE decode: de-normalise, decode, map [-1, 1] -> [0, 1]; [B, T, C, H, W] float32."""
        if self.vae is None:
            raise ValueError("this bundle was loaded without a vae")
        vae_param = next(self.vae.parameters())
        shape = (1, -1, 1, 1, 1)
        mean = torch.tensor(self.vae.config.latents_mean, device=vae_param.device).view(shape)
        std = torch.tensor(self.vae.config.latents_std, device=vae_param.device).view(shape)
        latents = latents.to(device=vae_param.device, dtype=torch.float32) * std + mean
        with torch.no_grad():
            video = self.vae.decode(latents.to(vae_param.dtype), return_dict=False)[0]
        video = (video.float() * 0.5 + 0.5).clamp(0.0, 1.0)  # (B, C, T, H, W)
        return video.permute(0, 2, 1, 3, 4).contiguous()


def _missing(path: str, component: str, message: str) -> ConfigError:
    folders = ", ".join(f"{c}/" for c in WAN_COMPONENTS)
    return ConfigError(
        f"model.path={path!r}: {message} Put a local diffusers Wan2.1 text-to-video folder there "
        f"(e.g. /data/Wan2.1-T2V-1.3B-Diffusers with {folders}); missing: {component}"
    )


def load_wan_bundle(
    path: str,
    vsa2: VSA2Config,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str = "auto",
    *,
    text_cache_dir: str | None = None,
    components: tuple[str, ...] = WAN_COMPONENTS,
    sparsity_state: SparsityState | None = None,
) -> WanBundle:
    """Load a local diffusers Wan2.1 directory as a ``WanBundle`` with VSA2 self-attention.

    Args:
        path: the folder (config key ``model.path``); never downloads.
        vsa2: attention settings; ``vsa2.enabled = False`` keeps dense attention.
        device, dtype: where and in which dtype the transformer and text encoder run ("auto":
            bf16 on CUDA, fp32 on CPU). The VAE runs in float32 with tiling and slicing on.
        text_cache_dir: folder for per-prompt embedding files; None = in-memory cache only.
        components: subfolders to load; "transformer" is required.
        sparsity_state: shared state to use (a new one at sparsity 0 if None).
    """
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import AutoTokenizer, UMT5EncoderModel

    unknown = set(components) - set(WAN_COMPONENTS)
    if "transformer" not in components or unknown:
        raise ValueError(
            f"components must include 'transformer' and only {WAN_COMPONENTS}, got {components}"
        )
    if not path or not os.path.isdir(path):
        raise _missing(str(path), "the folder itself", "does not exist or is not a directory.")
    for component in components:
        if not os.path.isdir(os.path.join(path, component)):
            raise _missing(path, f"{component}/", f"has no {component}/ subfolder.")
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    state = sparsity_state if sparsity_state is not None else SparsityState()

    transformer = WanTransformer3DModel.from_pretrained(
        path, subfolder="transformer", torch_dtype=dtype
    )
    transformer = enable_vsa2(transformer.to(device), vsa2, state)
    text_encoder = tokenizer = vae = None
    if "text_encoder" in components:
        text_encoder = UMT5EncoderModel.from_pretrained(
            path, subfolder="text_encoder", torch_dtype=dtype
        )
        text_encoder = text_encoder.to(device).eval().requires_grad_(False)
    if "tokenizer" in components:
        tokenizer = AutoTokenizer.from_pretrained(path, subfolder="tokenizer")
    if "vae" in components:
        vae = AutoencoderKLWan.from_pretrained(path, subfolder="vae", torch_dtype=torch.float32)
        vae = vae.to(device).eval().requires_grad_(False)
        vae.enable_tiling()
        vae.enable_slicing()
    return WanBundle(
        transformer=transformer,
        sparsity_state=state,
        latent_channels=int(transformer.config.in_channels),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        vae=vae,
        text_cache_dir=text_cache_dir,
        cache_key=os.path.abspath(path),
    )


__all__ = [
    "VSA2Context",
    "VideoDiTBundle",
    "WanBundle",
    "WanVSA2AttnProcessor",
    "enable_vsa2",
    "input_dtype",
    "load_wan_bundle",
    "resolve_dtype",
    "vsa2_parameters",
    "wan_velocity",
]
