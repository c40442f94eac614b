"""Ulysses sequence parallelism (Jacobs et al., 2023, "DeepSpeed Ulysses") around VSA2.

The ranks of a sequence-parallel group each hold a contiguous slice of every video's tokens
(raster order), with every head. Around self-attention one all-to-all turns token slices into
head slices, so that each rank holds the whole sequence for ``heads / P`` heads and runs VSA2
on it unchanged (tiling, router, coarse and fine stage are per head); a second all-to-all turns
the output back into token slices. Tokens need not divide by the group size: slices are
``ceil(N / P)`` long except the last ones, and the all-to-all pads to that length.

Both exchanges are ``torch.distributed.all_to_all_single`` (any backend that has it: NCCL, and
gloo for the CPU tests) inside autograd functions whose backward is the other exchange (each is
a permutation of the elements, so its adjoint is its inverse).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


class SequenceParallel:
    """A sequence-parallel group (``group`` None = the whole world)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def __deepcopy__(self, memo: dict) -> SequenceParallel:
        # a frozen copy of the model (the KL reference) runs in the same group
        return self

    def token_slice(self, num_tokens: int) -> slice:
        """This rank's contiguous slice of ``num_tokens`` raster-order tokens."""
        chunk = -(-num_tokens // self.size)
        start = min(self.rank * chunk, num_tokens)
        return slice(start, min(start + chunk, num_tokens))

    def head_slice(self, heads: int) -> slice:
        """The heads this rank attends for after :meth:`tokens_to_heads`."""
        if heads % self.size:
            raise ValueError(
                f"the group size ({self.size}) must divide the number of attention heads ({heads})"
            )
        local = heads // self.size
        return slice(self.rank * local, (self.rank + 1) * local)

    def tokens_to_heads(self, x: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """[B, n_local, H, D] token slice -> [B, num_tokens, H / P, D] (all tokens, my heads)."""
        return _TokensToHeads.apply(x, self, num_tokens)

    def heads_to_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """[B, N, H / P, D] (all tokens, my heads) -> [B, n_local, H, D] token slice."""
        return _HeadsToTokens.apply(x, self)

    def gather_tokens(self, x: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """[B, n_local, ...] token slices of every rank -> [B, num_tokens, ...] on every rank.

        Every rank continues with the same whole tensor, so what comes after is computed (and
        its parameters' gradients are whole) on every rank, while what came before saw only a
        slice; the backward hands a rank its slice of the gradient times the group size, so
        that the mean of the ranks' parameter gradients, what DDP's all-reduce takes, is the
        single-process gradient of every parameter.
        """
        return _GatherTokens.apply(x, self, num_tokens)


def _exchange(send: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """all_to_all of ``send`` [P, ...]: part p goes to rank p; returns [P, ...] by source."""
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=sp.group)
    return received


def _tokens_to_heads(x: torch.Tensor, sp: SequenceParallel, num_tokens: int) -> torch.Tensor:
    batch, local, heads, dim = x.shape
    size, chunk = sp.size, -(-num_tokens // sp.size)
    sp.head_slice(heads)  # checks divisibility
    x = F.pad(x, (0, 0, 0, 0, 0, chunk - local))
    send = x.reshape(batch, chunk, size, heads // size, dim).permute(2, 0, 1, 3, 4).contiguous()
    received = _exchange(send, sp)  # [source rank, B, chunk, H / P, D]
    out = received.permute(1, 0, 2, 3, 4).reshape(batch, size * chunk, heads // size, dim)
    return out[:, :num_tokens]


def _heads_to_tokens(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    batch, num_tokens, local_heads, dim = x.shape
    size, chunk = sp.size, -(-num_tokens // sp.size)
    x = F.pad(x, (0, 0, 0, 0, 0, size * chunk - num_tokens))
    send = x.reshape(batch, size, chunk, local_heads, dim).permute(1, 0, 2, 3, 4).contiguous()
    received = _exchange(send, sp)  # [source rank (its heads), B, chunk, H / P, D]
    out = received.permute(1, 2, 0, 3, 4).reshape(batch, chunk, size * local_heads, dim)
    mine = sp.token_slice(num_tokens)
    return out[:, : mine.stop - mine.start]


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sp, num_tokens):
        ctx.sp, ctx.num_tokens = sp, num_tokens
        chunk = -(-num_tokens // sp.size)
        padded = F.pad(x, (0, 0) * (x.dim() - 2) + (0, chunk - x.shape[1])).contiguous()
        parts = [torch.empty_like(padded) for _ in range(sp.size)]
        dist.all_gather(parts, padded, group=sp.group)
        return torch.cat(parts, dim=1)[:, :num_tokens]

    @staticmethod
    def backward(ctx, grad):
        return grad[:, ctx.sp.token_slice(ctx.num_tokens)] * ctx.sp.size, None, None


class _TokensToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sp, num_tokens):
        ctx.sp = sp
        return _tokens_to_heads(x.contiguous(), sp, num_tokens)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_tokens(grad.contiguous(), ctx.sp), None, None


class _HeadsToTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sp):
        ctx.sp, ctx.num_tokens = sp, x.shape[1]
        return _heads_to_tokens(x.contiguous(), sp)

    @staticmethod
    def backward(ctx, grad):
        return _tokens_to_heads(grad.contiguous(), ctx.sp, ctx.num_tokens), None
