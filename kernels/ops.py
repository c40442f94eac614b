"""Public entry point of the VSA2 fine stage: ``block_sparse_attention`` (contract in
docs/kernels.md).

The Triton path is registered as two ``torch.library.custom_op``s (forward and backward) with fake
implementations and an autograd formula, so ``torch.compile`` traces it as opaque ops without a
graph break. The ``"torch"`` backend is the pure-torch reference of :mod:`.naive` under plain
autograd. Input validation runs in eager mode only; checks that read tensor values (index and
length ranges) are skipped while compiling or capturing a CUDA graph, and on CUDA tensors they run
only when the environment sets ``VSA2_RL_CHECK_INDICES=1`` because they cost a device sync.
"""

from __future__ import annotations

import math
import os

import torch

from .block_sparse import BWD_PATHS, bsa_backward, bsa_forward
from .naive import block_sparse_attention_torch

__all__ = ["block_sparse_attention", "block_sparse_attention_torch"]

_OP_FWD = "vsa2_rl::block_sparse_attention_fwd"
_OP_BWD = "vsa2_rl::block_sparse_attention_bwd"
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TORCH_DTYPES = (*_TRITON_DTYPES, torch.float64)
_Q_TILES = (16, 32, 64, 128)
_KV_BLOCKS = (16, 32, 64)
_HEAD_DIMS = (16, 32, 64, 128)


# -- custom ops -----------------------------------------------------------------------------------


@torch.library.custom_op(_OP_FWD, mutates_args=())
def _bsa_fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    block_bias: torch.Tensor | None,
    kv_lengths: torch.Tensor | None,
    q_tile: int,
    kv_block: int,
    scale: float,
    bwd: str = "two_pass",
) -> tuple[torch.Tensor, torch.Tensor]:
    # bwd only travels to the backward (through the autograd context)
    return bsa_forward(
        q, k, v, kv_indices, kv_counts, block_bias, kv_lengths, q_tile, kv_block, scale
    )


@_bsa_fwd_op.register_fake
def _bsa_fwd_fake(
    q, k, v, kv_indices, kv_counts, block_bias, kv_lengths, q_tile, kv_block, scale, bwd="two_pass"
):
    B, H, S, D = q.shape
    return q.new_empty((B, H, S, D)), q.new_empty((B, H, S), dtype=torch.float32)


@torch.library.custom_op(_OP_BWD, mutates_args=())
def _bsa_bwd_op(
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    block_bias: torch.Tensor | None,
    kv_lengths: torch.Tensor | None,
    q_tile: int,
    kv_block: int,
    scale: float,
    bwd: str = "two_pass",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv, dbias = bsa_backward(
        dout, dlse, q, k, v, out, lse, kv_indices, kv_counts, block_bias, kv_lengths,
        q_tile, kv_block, scale, bwd,
    )  # fmt: skip
    # custom ops cannot return None: an empty tensor stands for "no bias"
    return dq, dk, dv, (dbias if dbias is not None else q.new_empty((0,), dtype=torch.float32))


@_bsa_bwd_op.register_fake
def _bsa_bwd_fake(
    dout, dlse, q, k, v, out, lse, kv_indices, kv_counts, block_bias, kv_lengths,
    q_tile, kv_block, scale, bwd="two_pass",
):  # fmt: skip
    dbias = (
        torch.empty_like(block_bias)
        if block_bias is not None
        else q.new_empty((0,), dtype=torch.float32)
    )
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dbias


def _setup_context(ctx, inputs, output):
    q, k, v, kv_indices, kv_counts, block_bias, kv_lengths, q_tile, kv_block, scale, bwd = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, kv_indices, kv_counts, block_bias, kv_lengths)
    ctx.q_tile, ctx.kv_block, ctx.scale, ctx.bwd = q_tile, kv_block, scale, bwd
    # an unused lse (the common case) then arrives as None and costs nothing in the backward
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, kv_indices, kv_counts, block_bias, kv_lengths = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, dbias = _bsa_bwd_op(
        dout, dlse, q, k, v, out, lse, kv_indices, kv_counts, block_bias, kv_lengths,
        ctx.q_tile, ctx.kv_block, ctx.scale, ctx.bwd,
    )  # fmt: skip
    return (
        dq,
        dk,
        dv,
        None,
        None,
        (dbias if block_bias is not None else None),
        None,
        None,
        None,
        None,
        None,
    )


_bsa_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# -- validation -----------------------------------------------------------------------------------


def _check_shapes(
    q, k, v, kv_indices, kv_counts, block_bias, kv_lengths, q_tile, kv_block, backend
):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a 4-D tensor [B, H, S, D], got {shape}")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f"q, k, v must have one shape [B, H, S, D], got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    dtypes = _TRITON_DTYPES if backend == "triton" else _TORCH_DTYPES
    if q.dtype not in dtypes or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"q, k, v must share one dtype of {dtypes} for backend={backend!r}, got "
            f"q {q.dtype}, k {k.dtype}, v {v.dtype}"
        )
    B, H, S, D = q.shape
    if q_tile not in _Q_TILES:
        raise ValueError(f"q_tile must be one of {_Q_TILES}, got {q_tile}")
    if kv_block not in _KV_BLOCKS:
        raise ValueError(f"kv_block must be one of {_KV_BLOCKS}, got {kv_block}")
    if S % q_tile or S % kv_block:
        raise ValueError(
            f"sequence length S={S} must be a multiple of q_tile={q_tile} and kv_block={kv_block}; "
            "pad the sequence (TileLayout pads to whole tiles)"
        )
    if backend == "triton" and D not in _HEAD_DIMS:
        raise ValueError(f"head dim D={D} must be one of {_HEAD_DIMS} for backend='triton'")
    NQ = S // q_tile
    if not isinstance(kv_indices, torch.Tensor) or kv_indices.dtype != torch.int32:
        got = (
            kv_indices.dtype if isinstance(kv_indices, torch.Tensor) else type(kv_indices).__name__
        )
        raise ValueError(f"kv_indices must be an int32 tensor, got {got}")
    if (
        kv_indices.dim() != 4
        or tuple(kv_indices.shape[:3]) != (B, H, NQ)
        or kv_indices.shape[3] < 1
    ):
        raise ValueError(
            f"kv_indices must have shape [B, H, S // q_tile, KMAX] = [{B}, {H}, {NQ}, KMAX>=1], "
            f"got {tuple(kv_indices.shape)}"
        )
    KMAX = kv_indices.shape[3]
    if B * H * NQ * KMAX >= 2**31:
        raise ValueError(
            f"kv_indices has {B * H * NQ * KMAX} entries; the kernel's int32 pair ids need "
            "< 2**31: split the batch or heads"
        )
    if not isinstance(kv_counts, torch.Tensor) or kv_counts.dtype != torch.int32:
        got = kv_counts.dtype if isinstance(kv_counts, torch.Tensor) else type(kv_counts).__name__
        raise ValueError(f"kv_counts must be an int32 tensor, got {got}")
    if tuple(kv_counts.shape) != (B, H, NQ):
        raise ValueError(
            f"kv_counts must have shape [{B}, {H}, {NQ}], got {tuple(kv_counts.shape)}"
        )
    if block_bias is not None:
        if not isinstance(block_bias, torch.Tensor) or not block_bias.dtype.is_floating_point:
            got = (
                block_bias.dtype
                if isinstance(block_bias, torch.Tensor)
                else type(block_bias).__name__
            )
            raise ValueError(f"block_bias must be a floating tensor or None, got {got}")
        if block_bias.shape != kv_indices.shape:
            raise ValueError(
                f"block_bias must have kv_indices' shape {tuple(kv_indices.shape)}, "
                f"got {tuple(block_bias.shape)}"
            )
    if kv_lengths is not None:
        if not isinstance(kv_lengths, torch.Tensor) or kv_lengths.dtype != torch.int32:
            got = (
                kv_lengths.dtype
                if isinstance(kv_lengths, torch.Tensor)
                else type(kv_lengths).__name__
            )
            raise ValueError(f"kv_lengths must be an int32 tensor or None, got {got}")
        if tuple(kv_lengths.shape) != (S // kv_block,):
            raise ValueError(
                f"kv_lengths must have shape [S // kv_block] = [{S // kv_block}], "
                f"got {tuple(kv_lengths.shape)}"
            )
    named = {"k": k, "v": v, "kv_indices": kv_indices, "kv_counts": kv_counts}
    named.update({"block_bias": block_bias, "kv_lengths": kv_lengths})
    for name, x in named.items():
        if x is not None and x.device != q.device:
            raise ValueError(
                f"{name} is on {x.device} but q is on {q.device}; move it to {q.device}"
            )


def _check_values(kv_indices, kv_counts, kv_lengths, kv_block, num_segments):
    """Range checks that read tensor values (each one a device sync on CUDA)."""
    KMAX = kv_indices.shape[-1]
    bad = (kv_counts < 0) | (kv_counts > KMAX)
    if bool(bad.any()):
        value = int(kv_counts[bad][0])
        raise ValueError(f"kv_counts must lie in [0, KMAX={KMAX}], found {value}")
    m_used = torch.arange(KMAX, device=kv_indices.device) < kv_counts.unsqueeze(-1)
    bad = m_used & ((kv_indices < 0) | (kv_indices >= num_segments))
    if bool(bad.any()):
        value = int(kv_indices[bad][0])
        raise ValueError(
            f"kv_indices entries within kv_counts must lie in [0, S // kv_block = {num_segments}), "
            f"found {value}"
        )
    # distinct ids per row: after sorting the used entries, no two neighbours are equal
    keyed = torch.where(
        m_used, kv_indices.long(), -1 - torch.arange(KMAX, device=kv_indices.device)
    )
    srt = keyed.sort(-1).values
    if bool(((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)).any()):
        raise ValueError(
            "kv_indices must list distinct segment ids within each row's first kv_counts"
        )
    if kv_lengths is not None:
        bad = (kv_lengths < 0) | (kv_lengths > kv_block)
        if bool(bad.any()):
            value = int(kv_lengths[bad][0])
            raise ValueError(f"kv_lengths must lie in [0, kv_block={kv_block}], found {value}")


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    """``"triton"`` or ``"torch"`` for a kernel backend setting: ``"auto"`` is Triton on CUDA
    tensors or under ``TRITON_INTERPRET=1`` (the rule of every op in this package)."""
    if backend == "auto":
        use_triton = q.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1"
        return "triton" if use_triton else "torch"
    if backend not in ("triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    return backend


def _value_checks_wanted(q: torch.Tensor) -> bool:
    if torch.compiler.is_compiling():
        return False
    if q.is_cuda:
        if torch.cuda.is_current_stream_capturing():
            return False
        return os.environ.get("VSA2_RL_CHECK_INDICES", "0") == "1"
    return True


# -- public entry ---------------------------------------------------------------------------------


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    block_bias: torch.Tensor | None = None,
    *,
    q_tile: int = 64,
    kv_block: int = 16,
    kv_lengths: torch.Tensor | None = None,
    scale: float | None = None,
    backend: str = "auto",
    bwd: str = "two_pass",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each ``q_tile``-row query tile over its selected ``kv_block``-key segments.

    Args:
        q, k, v: [B, H, S, D]; S a multiple of q_tile and kv_block; bf16, fp16 or fp32
            (float64 with backend="torch").
        kv_indices: int32 [B, H, S // q_tile, KMAX]; row t lists the segment ids tile t attends
            to; only the first kv_counts[b, h, t] entries are read and they must be distinct.
        kv_counts: int32 [B, H, S // q_tile] in [0, KMAX]; 0 gives out 0, lse -inf, zero grads.
        block_bias: float [B, H, S // q_tile, KMAX] or None; added to every logit of the
            (tile, segment) pair; differentiable (d(bias) = sum of dS over the pair).
        q_tile: query rows per tile (16, 32, 64 or 128; VSA2 uses 64).
        kv_block: keys per segment (16, 32 or 64).
        kv_lengths: int32 [S // kv_block] valid keys per segment (padding at the segment's end);
            None = all full. Padded keys never receive weight.
        scale: logit scale, default 1 / sqrt(D).
        backend: "triton", "torch" (reference) or "auto" (Triton on CUDA or under
            TRITON_INTERPRET=1, else torch).
        bwd: backward of the Triton path: "two_pass" (query-major dQ pass + key-major dK/dV
            pass; deterministic) or "fused" (one query-major pass with float32 atomic dK/dV;
            built for kv_block 16, sums in run-dependent order). The torch backend ignores it.

    Returns:
        out [B, H, S, D] in q's dtype and lse float32 [B, H, S] (natural log, -inf for empty rows).
    """
    backend = resolve_backend(backend, q)
    if bwd not in BWD_PATHS:
        raise ValueError(f"bwd must be one of {BWD_PATHS}, got {bwd!r}")
    _check_shapes(q, k, v, kv_indices, kv_counts, block_bias, kv_lengths, q_tile, kv_block, backend)
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if _value_checks_wanted(q):
        _check_values(kv_indices, kv_counts, kv_lengths, kv_block, q.shape[2] // kv_block)
    if backend == "torch":
        return block_sparse_attention_torch(
            q, k, v, kv_indices, kv_counts, block_bias, kv_lengths, q_tile, kv_block, scale
        )
    return _bsa_fwd_op(
        q, k, v, kv_indices, kv_counts, block_bias, kv_lengths, q_tile, kv_block, scale, bwd
    )
