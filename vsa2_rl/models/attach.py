"""What the model adapters share when they put VSA2 into a diffusers transformer: the grid
context recorded by a forward pre-hook, and a VSA2Attention attached to an attention module.

An adapter (:mod:`vsa2_rl.models.minimax_h3`, :mod:`vsa2_rl.models.ltx2`) keeps the module's
stock processor as ``attn._vsa2_stock_processor`` for sparsity 0, so a density-1 run is the
untouched model whatever its VSA2 parameters.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from vsa2_rl.attention import SparsityState, VSA2Attention
from vsa2_rl.config import VSA2Config


def grid_context(transformer: nn.Module, make_context: Callable[[], object]):
    """The transformer's VSA2 context (``transformer._vsa2_context``), made by
    ``make_context()`` and hooked before the transformer's forward (its ``record(module, args,
    kwargs)``) on the first call."""
    context = getattr(transformer, "_vsa2_context", None)
    if context is None:
        context = make_context()
        transformer.register_forward_pre_hook(context.record, with_kwargs=True)
        transformer._vsa2_context = context
    return context


def attach_vsa2(
    attn: nn.Module, vsa2_config: VSA2Config, state: SparsityState, processor: object
) -> None:
    """Give ``attn`` a zero-initialised :class:`VSA2Attention` as ``attn.vsa2`` (on its
    projections' device and dtype; kept, with its trained values, when attached before), keep
    its stock processor, and run ``processor``."""
    if not hasattr(attn, "vsa2"):
        weight = attn.to_q.weight
        attn._vsa2_stock_processor = attn.processor
        attn.vsa2 = VSA2Attention(attn.inner_dim, attn.heads, vsa2_config, state).to(
            device=weight.device, dtype=weight.dtype
        )
    attn.vsa2.config, attn.vsa2.state = vsa2_config, state
    attn.set_processor(processor)
