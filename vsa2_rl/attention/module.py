"""VSA2Attention: the learnable part of one VSA2 self-attention layer (docs/concepts.md,
"VSA2 attention").

The attention math (coarse stage, fine-grained router, block-sparse fine stage, dense fallback)
is ``vsa2_rl.kernels.vsa2_attention``, which takes its settings as plain arguments
(:func:`kernel_settings` turns the attention config into them). This module owns what a layer
adds on top of it, following VSA2 (trainable sparse attention with a fine-grained router) and
VSA's gated coarse/fine fusion:

- ``alpha`` [H]: scale of the router bias ``alpha_h * log_softmax(scores)`` added to the selected
  blocks' logits (the path by which the router learns); zero-init, so a fresh layer's fine stage
  is plain attention over the selected blocks.
- ``to_gate_coarse`` / ``to_gate_fine``: Linear(dim, dim) on the layer's input hidden states,
  zero-init, with g_c = to_gate_coarse(x) and g_f = 1 + to_gate_fine(x). A fresh (or rebased)
  layer therefore outputs exactly the fine stage, i.e. dense attention at density 1.

At ``state.sparsity == 0`` the layer is the stock dense attention (the gates and alpha are not
used), so "sparsity 0" always means the unmodified model; any sparsity > 0 runs VSA2, with the
exact-dense fine stage while ``1 - sparsity >= config.dense_threshold``.

It takes q, k, v in raster order (as diffusers holds them after RoPE), tiles them with the layer
grid's :class:`TileLayout`, runs VSA2, records the achieved density into the shared
:class:`SparsityState` and returns the output in raster order. With ``sequence_parallel`` set
(:class:`vsa2_rl.parallel.SequenceParallel`) its inputs are this rank's token slice: q, k, v
and the gates go through an all-to-all to all tokens of this rank's heads, VSA2 runs on those
heads (with their ``alpha``), and the output comes back as the token slice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vsa2_rl import kernels
from vsa2_rl.attention.layout import TileLayout
from vsa2_rl.attention.state import SparsityState
from vsa2_rl.config import VSA2Config
from vsa2_rl.parallel import SequenceParallel


def kernel_settings(config: VSA2Config) -> dict:
    """The keyword arguments of ``kernels.vsa2_attention`` that the attention config sets
    (``enabled`` is the caller's switch, not the kernel's)."""
    return {
        "q_tile": config.q_tile,
        "kv_block": config.kv_block,
        "mode": config.mode,
        "top_p": config.top_p,
        "min_kv": config.min_kv,
        "dense_threshold": config.dense_threshold,
        "backend": config.backend,
    }


class VSA2Attention(nn.Module):
    """Learnable VSA2 parameters of one layer + the call into ``vsa2_attention``.

    Args:
        dim: width of the hidden states (= heads * head_dim in Wan).
        heads: number of attention heads.
        config: VSA2 settings (tile size, router mode, backend, dense threshold).
        state: the model's shared sparsity state; ``state.sparsity`` is read at every forward.
    """

    def __init__(self, dim: int, heads: int, config: VSA2Config, state: SparsityState) -> None:
        super().__init__()
        if heads <= 0 or dim % heads != 0:
            raise ValueError(
                f"dim must be a positive multiple of heads, got dim={dim} heads={heads}"
            )
        self.dim = dim
        self.heads = heads
        self.config = config
        self.state = state
        self.alpha = nn.Parameter(torch.zeros(heads))
        # set by vsa2_rl.parallel: this rank then holds a token slice of every video
        self.sequence_parallel: SequenceParallel | None = None
        self.to_gate_coarse = nn.Linear(dim, dim)
        self.to_gate_fine = nn.Linear(dim, dim)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Zero alpha and both gates: output = fine stage = dense attention at density 1."""
        self.alpha.zero_()
        for linear in (self.to_gate_coarse, self.to_gate_fine):
            linear.weight.zero_()
            linear.bias.zero_()

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        hidden_states: torch.Tensor,
        layout: TileLayout,
    ) -> torch.Tensor:
        """VSA2 attention of raster-order tokens.

        Args:
            query, key, value: [B, N, H, D] in raster order, RoPE applied (N = layout.num_tokens).
            hidden_states: [B, N, dim], the attention layer's input (drives the gates).
            layout: tile layout of the token grid.

        Returns:
            [B, N, H, D] in raster order, in query's dtype.
        """
        batch, num_tokens, heads, head_dim = query.shape
        sp = self.sequence_parallel
        mine = slice(0, layout.num_tokens) if sp is None else sp.token_slice(layout.num_tokens)
        if heads != self.heads or num_tokens != mine.stop - mine.start:
            raise ValueError(
                f"query must be [B, {mine.stop - mine.start}, {self.heads}, D] for grid "
                f"{layout.grid}{'' if sp is None else ' (this rank s token slice)'}, got "
                f"{tuple(query.shape)}"
            )
        sparse = self.state.sparsity > 0.0
        tensors, alpha = [query, key, value], self.alpha
        if sparse:  # gates per token from the layer's input (a padding position's is dropped)
            shape = (batch, num_tokens, heads, head_dim)
            tensors.append(self.to_gate_coarse(hidden_states).view(shape))
            tensors.append(1.0 + self.to_gate_fine(hidden_states).view(shape))
        if sp is not None:  # all tokens, this rank's heads
            tensors = tuple(sp.tokens_to_heads(x, layout.num_tokens) for x in tensors)
            alpha = self.alpha[sp.head_slice(heads)]
        if not sparse:
            # Sparsity 0 means the stock dense model (docs/concepts.md, "Density and the dense
            # cases"): plain attention in raster order, without tiling, router or gates.
            self.state.record_density(1.0)
            out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in tensors[:3]))
            out = out.transpose(1, 2)
        else:
            q, k, v, g_c, g_f = (layout.tile(x).transpose(1, 2) for x in tensors)  # (B, H, S, D)
            out = self._sparse_attention(q, k, v, g_c.to(q.dtype), g_f.to(q.dtype), alpha, layout)
            out = layout.untile(out.transpose(1, 2))  # (B, N, H, D)
        if sp is not None:
            out = sp.heads_to_tokens(out)
        return out.to(query.dtype)

    # Run eagerly inside compiled blocks (a graph break; the kernels are opaque custom ops
    # anyway): the sparsity is a Python float that the router turns into an output shape, and
    # once it changes (rollout vs eval, a warm-up) torch.compile would make it symbolic, which
    # the shape arithmetic cannot take. The density bookkeeping stays out of the graph too.
    @torch.compiler.disable
    def _sparse_attention(self, q, k, v, gate_coarse, gate_fine, alpha, layout) -> torch.Tensor:
        tile_lengths, seg_lengths = layout.lengths(self.config.kv_block, q.device)
        out, stats = kernels.vsa2_attention(
            q,
            k,
            v,
            tile_lengths=tile_lengths,
            seg_lengths=seg_lengths,
            sparsity=self.state.sparsity,
            alpha=alpha,
            gate_coarse=gate_coarse,
            gate_fine=gate_fine,
            **kernel_settings(self.config),
            # Known on the host from the layout: saves the kernel a host sync per layer.
            num_valid_segments=-(-layout.num_tokens // self.config.kv_block),
        )
        self.state.record_density(stats.density)
        return out

    def extra_repr(self) -> str:
        return f"dim={self.dim}, heads={self.heads}, kv_block={self.config.kv_block}"
