"""Mean pooling of tokens per block over the valid tokens only (VSA2 coarse stage and router).

VSA (Zhang et al., "VSA: Faster Video Diffusion with Trainable Sparse Attention", 2025) pools
queries and keys per 64-token cube to get a coarse view of the sequence; VSA2 pools keys per
`kv_block`-token segment as well. With the packed tile layout of vsa2_rl a block may be partly
padding (its valid tokens come first), so the mean runs over the first ``lengths[i]`` tokens of
block ``i`` only, and a block with no valid token pools to 0.

``pool_tiles`` is one fused Triton kernel (forward and backward: each program reads one block
once, accumulates in fp32 and writes one row), wrapped in a ``torch.autograd.Function``, with a
pure-torch path used on CPU tensors (unless ``TRITON_INTERPRET=1``) or on request.
"""

import os

import torch
import triton
import triton.language as tl

_BACKENDS = ("auto", "triton", "torch")


@triton.jit
def _pool_fwd_kernel(
    x_ptr,
    len_ptr,
    y_ptr,
    stride_xb,
    stride_xh,
    stride_xs,
    stride_xd,
    H,
    NB,
    D,
    BLOCK: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
):
    # one program per (block, head, batch): y[b, h, i] = mean of the first n tokens of block i
    i_n, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = tl.load(len_ptr + i_n)
    o_t = tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    m_t = (o_t < n) & (o_t < BLOCK)
    m_d = o_d < D
    p_x = (
        x_ptr
        + i_b.to(tl.int64) * stride_xb
        + i_h.to(tl.int64) * stride_xh
        + (i_n.to(tl.int64) * BLOCK + o_t[:, None]) * stride_xs
        + o_d[None, :] * stride_xd
    )
    # [BT, BD]
    b_x = tl.load(p_x, mask=m_t[:, None] & m_d[None, :], other=0.0).to(tl.float32)
    # [BD]; max(n, 1) turns an empty block into 0 / 1 = 0
    b_y = tl.sum(b_x, axis=0) / tl.maximum(n, 1).to(tl.float32)
    p_y = y_ptr + ((i_b.to(tl.int64) * H + i_h) * NB + i_n) * D + o_d
    tl.store(p_y, b_y.to(y_ptr.dtype.element_ty), mask=m_d)


@triton.jit
def _pool_bwd_kernel(
    dy_ptr,
    len_ptr,
    dx_ptr,
    stride_gb,
    stride_gh,
    stride_gn,
    stride_gd,
    H,
    NB,
    D,
    BLOCK: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
):
    # dx of a valid token is dy of its block / n; padded tokens get exactly 0
    i_n, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = tl.load(len_ptr + i_n)
    o_t = tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    p_dy = (
        dy_ptr
        + i_b.to(tl.int64) * stride_gb
        + i_h.to(tl.int64) * stride_gh
        + i_n.to(tl.int64) * stride_gn
        + o_d * stride_gd
    )
    # [BD]
    b_dy = tl.load(p_dy, mask=m_d, other=0.0).to(tl.float32) / tl.maximum(n, 1).to(tl.float32)
    # [BT, BD]
    b_dx = tl.where((o_t < n)[:, None], b_dy[None, :], 0.0)
    S = NB * BLOCK
    p_dx = (
        dx_ptr
        + ((i_b.to(tl.int64) * H + i_h) * S + i_n.to(tl.int64) * BLOCK + o_t[:, None]) * D
        + o_d[None, :]
    )
    tl.store(p_dx, b_dx.to(dx_ptr.dtype.element_ty), mask=(o_t < BLOCK)[:, None] & m_d[None, :])


def _launch_meta(block: int, D: int) -> dict:
    return {
        "BLOCK": block,
        "BT": triton.next_power_of_2(block),
        "BD": triton.next_power_of_2(D),
    }


class _PoolTiles(torch.autograd.Function):
    """Triton forward/backward of the masked block mean (fp32 accumulation)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, lengths: torch.Tensor, block: int) -> torch.Tensor:
        B, H, S, D = x.shape
        NB = S // block
        y = torch.empty((B, H, NB, D), dtype=x.dtype, device=x.device)
        _pool_fwd_kernel[(NB, H, B)](x, lengths, y, *x.stride(), H, NB, D, **_launch_meta(block, D))
        ctx.save_for_backward(lengths)
        ctx.block = block
        ctx.x_shape = x.shape
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (lengths,) = ctx.saved_tensors
        B, H, S, D = ctx.x_shape
        NB = S // ctx.block
        dx = torch.empty((B, H, S, D), dtype=dy.dtype, device=dy.device)
        _pool_bwd_kernel[(NB, H, B)](
            dy, lengths, dx, *dy.stride(), H, NB, D, **_launch_meta(ctx.block, D)
        )
        return dx, None, None


def _pool_torch(x: torch.Tensor, lengths: torch.Tensor, block: int) -> torch.Tensor:
    B, H, S, D = x.shape
    xb = x.reshape(B, H, S // block, block, D)
    # (NB, block): token j of block i is valid iff j < lengths[i]
    valid = torch.arange(block, device=x.device) < lengths[:, None]
    total = (xb * valid[:, :, None].to(x.dtype)).sum(dim=3)
    return total / lengths.clamp(min=1).to(x.dtype)[:, None]


def pool_tiles(
    x: torch.Tensor, lengths: torch.Tensor, block: int, *, backend: str = "auto"
) -> torch.Tensor:
    """Mean of the valid tokens of each block of ``block`` consecutive tokens.

    Args:
        x: ``[B, H, S, D]``, S a multiple of ``block``; any strides.
        lengths: int ``[S // block]``, valid tokens per block (they are the block's first
            tokens), each in ``[0, block]``. Moved to ``x``'s device if needed; pass it already
            there to keep the call free of host-to-device copies (e.g. under CUDA graphs).
        block: tokens per block (``q_tile`` for tiles, ``kv_block`` for key segments).
        backend: ``"triton"`` (fused kernel), ``"torch"`` (reference) or ``"auto"`` (Triton on
            CUDA tensors or when ``TRITON_INTERPRET=1``, torch otherwise).

    Returns:
        ``[B, H, S // block, D]`` in ``x``'s dtype; a block with length 0 gives 0. Differentiable
        w.r.t. ``x``; the Triton path accumulates in fp32 (also for float64 inputs: use the
        torch path for float64 checks). Length values are checked only when ``lengths`` lives
        on the CPU (and not under ``torch.compile``), so that the call never waits on the device.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown; use one of {_BACKENDS}")
    if x.dim() != 4:
        raise ValueError(f"x must be [B, H, S, D], got shape {tuple(x.shape)}")
    if block < 1 or x.shape[2] % block != 0:
        raise ValueError(
            f"block={block} must be >= 1 and divide the sequence length S={x.shape[2]}; "
            "pad the sequence to a multiple of the block"
        )
    num_blocks = x.shape[2] // block
    if lengths.dim() != 1 or lengths.shape[0] != num_blocks or lengths.is_floating_point():
        raise ValueError(
            f"lengths must be an integer tensor of shape [S // block] = [{num_blocks}], "
            f"got dtype {lengths.dtype} shape {tuple(lengths.shape)}"
        )
    # value checks only where reading values is free: CPU tensors, outside torch.compile
    on_host = lengths.device.type == "cpu" and not torch.compiler.is_compiling()
    if on_host and bool(((lengths < 0) | (lengths > block)).any()):
        raise ValueError(f"lengths must lie in [0, block={block}], got {lengths.tolist()}")
    lengths = lengths.to(device=x.device, dtype=torch.int32)
    if backend == "auto":
        use_triton = x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
        backend = "triton" if use_triton else "torch"
    if backend == "torch":
        return _pool_torch(x, lengths, block)
    return _PoolTiles.apply(x, lengths, block)
