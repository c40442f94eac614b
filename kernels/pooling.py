"""Mean pooling of tokens per block over the valid tokens only (VSA2 coarse stage and router).

VSA (Zhang et al., "VSA: Faster Video Diffusion with Trainable Sparse Attention", 2025) pools
queries and keys per 64-token cube to get a coarse view of the sequence; VSA2 pools keys per
`kv_block`-token segment as well. With the packed tile layout of vsa2_rl a block may be partly
padding (its valid tokens come first), so the mean runs over the first ``lengths[i]`` tokens of
block ``i`` only, and a block with no valid token pools to 0.

``pool_tiles`` is one fused Triton kernel (forward and backward: each program reads one block
once, accumulates in fp32 and writes one row), wrapped in a ``torch.autograd.Function``, with a
pure-torch path used on CPU tensors (unless ``TRITON_INTERPRET=1``) or on request.

``pool_qkv`` is what ``vsa2_attention`` uses on the Triton path: one pass over q, k, v yields the
tile means of q (and of k, v for the coarse stage) and the segment means of k (router), and its
backward adds the broadcast pooling gradients to the fine stage's full-size gradients in one
read and one write per token.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .ops import resolve_backend


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


@triton.jit
def _rows_ptr(x_ptr, i_b, i_h, rows, o_d, stride_b, stride_h, stride_s, stride_d):
    """Pointers [len(rows), len(o_d)] to tokens ``rows`` (a column vector) of batch ``i_b``,
    head ``i_h`` of a strided [B, H, S, D] tensor."""
    return x_ptr + i_b * stride_b + i_h * stride_h + rows * stride_s + o_d[None, :] * stride_d


@triton.jit
def _pool_qkv_fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tlen_ptr,
    slen_ptr,
    qt_ptr,
    ks_ptr,
    kt_ptr,
    vt_ptr,
    stride_qb,
    stride_qh,
    stride_qs,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_vd,
    H,
    NQ,
    D,
    Q_TILE: tl.constexpr,
    KV_BLOCK: tl.constexpr,
    BQ: tl.constexpr,
    BD: tl.constexpr,
    SEGMENTS: tl.constexpr,
    KV_TILES: tl.constexpr,
):
    # one program per (query tile, head, batch). Each token of q, k and v is read once: the
    # tile means of q (and of k, v for the coarse stage) and the segment means of k (router)
    # come out of the same loads.
    tl.static_assert(BQ == Q_TILE, "q_tile must be a power of two")
    i_t, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n_t = tl.load(tlen_ptr + i_t)
    # divide (not multiply by a reciprocal) as pool_tiles does, to give the same bits
    n_t_div = tl.maximum(n_t, 1).to(tl.float32)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    o_q = tl.arange(0, BQ)
    i_b64, i_h64 = i_b.to(tl.int64), i_h.to(tl.int64)
    row0 = i_t.to(tl.int64) * Q_TILE
    o_row = ((i_b64 * H + i_h) * NQ + i_t) * D + o_d
    # [BQ, BD]: the same reduction shape as pool_tiles, so the means match it bit for bit
    m_tile = ((o_q < n_t) & (o_q < Q_TILE))[:, None] & m_d[None, :]
    r_q = row0 + o_q[:, None]
    p_q = _rows_ptr(q_ptr, i_b64, i_h64, r_q, o_d, stride_qb, stride_qh, stride_qs, stride_qd)
    b_q = tl.load(p_q, mask=m_tile, other=0.0).to(tl.float32)
    tl.store(qt_ptr + o_row, (tl.sum(b_q, axis=0) / n_t_div).to(qt_ptr.dtype.element_ty), mask=m_d)
    if KV_TILES:
        p_v = _rows_ptr(v_ptr, i_b64, i_h64, r_q, o_d, stride_vb, stride_vh, stride_vs, stride_vd)
        b_v = tl.load(p_v, mask=m_tile, other=0.0).to(tl.float32)
        tl.store(
            vt_ptr + o_row, (tl.sum(b_v, axis=0) / n_t_div).to(vt_ptr.dtype.element_ty), mask=m_d
        )
    if SEGMENTS or KV_TILES:
        # the tile's keys in one load (BQ = Q_TILE, both powers of two); row r of the tile is
        # key r % KV_BLOCK of the tile's segment r // KV_BLOCK
        NSEGT: tl.constexpr = Q_TILE // KV_BLOCK
        i_s0 = i_t * NSEGT
        n_s_row = tl.load(slen_ptr + i_s0 + o_q // KV_BLOCK)
        m_seg = (o_q % KV_BLOCK) < n_s_row
        m_in_tile = o_q < n_t
        m_load = m_seg
        if KV_TILES:
            m_load = m_seg | m_in_tile
        p_k = _rows_ptr(k_ptr, i_b64, i_h64, r_q, o_d, stride_kb, stride_kh, stride_ks, stride_kd)
        # [BQ, BD]
        b_k = tl.load(p_k, mask=m_load[:, None] & m_d[None, :], other=0.0).to(tl.float32)
        if SEGMENTS:
            # [NSEGT, BD] segment means
            b_ks = tl.sum(tl.reshape(tl.where(m_seg[:, None], b_k, 0.0), [NSEGT, KV_BLOCK, BD]), 1)
            o_j = tl.arange(0, NSEGT)
            b_ks = b_ks / tl.maximum(tl.load(slen_ptr + i_s0 + o_j), 1).to(tl.float32)[:, None]
            p_ks = ((i_b64 * H + i_h) * (NQ * NSEGT) + i_s0 + o_j[:, None]) * D + o_d[None, :]
            tl.store(ks_ptr + p_ks, b_ks.to(ks_ptr.dtype.element_ty), mask=m_d[None, :])
        if KV_TILES:
            b_kt = tl.sum(tl.where(m_in_tile[:, None], b_k, 0.0), axis=0)
            tl.store(kt_ptr + o_row, (b_kt / n_t_div).to(kt_ptr.dtype.element_ty), mask=m_d)


@triton.jit
def _pool_qkv_bwd_kernel(
    dx_in_ptr,
    dtile_ptr,
    dseg_ptr,
    tlen_ptr,
    slen_ptr,
    dx_ptr,
    stride_ib,
    stride_ih,
    stride_is,
    stride_id,
    stride_ob,
    stride_oh,
    stride_os,
    stride_od,
    H,
    NQ,
    D,
    Q_TILE: tl.constexpr,
    KV_BLOCK: tl.constexpr,
    BKV: tl.constexpr,
    BD: tl.constexpr,
    HAS_IN: tl.constexpr,
    HAS_TILE: tl.constexpr,
    HAS_SEG: tl.constexpr,
):
    # dx = dx_in (the gradient of the consumer of the aliased input) + dtile / n_t on the tile's
    # valid tokens + dseg / n_s on the segment's valid tokens: one read and one write per token
    # instead of a separate full-size gradient per pooling plus autograd's accumulating adds
    i_t, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n_t = tl.load(tlen_ptr + i_t)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    o_kv = tl.arange(0, BKV)
    row0 = i_t.to(tl.int64) * Q_TILE
    b_dt = tl.zeros([BD], dtype=tl.float32)
    if HAS_TILE:
        p_dt = dtile_ptr + ((i_b.to(tl.int64) * H + i_h) * NQ + i_t) * D + o_d
        b_dt = tl.load(p_dt, mask=m_d, other=0.0).to(tl.float32) / tl.maximum(n_t, 1).to(tl.float32)
    for j in tl.static_range(Q_TILE // KV_BLOCK):
        o_s = j * KV_BLOCK + o_kv
        m_rows = (o_kv < KV_BLOCK)[:, None] & m_d[None, :]
        # [BKV, BD]
        b_dx = tl.zeros([BKV, BD], dtype=tl.float32)
        if HAS_IN:
            p_in = (
                dx_in_ptr
                + i_b.to(tl.int64) * stride_ib
                + i_h.to(tl.int64) * stride_ih
                + (row0 + o_s[:, None]) * stride_is
                + o_d[None, :] * stride_id
            )
            b_dx += tl.load(p_in, mask=m_rows, other=0.0).to(tl.float32)
        if HAS_TILE:
            b_dx += tl.where((o_s < n_t)[:, None], b_dt[None, :], 0.0)
        if HAS_SEG:
            i_s = i_t * (Q_TILE // KV_BLOCK) + j
            n_s = tl.load(slen_ptr + i_s)
            p_ds = dseg_ptr + ((i_b.to(tl.int64) * H + i_h) * (NQ * (Q_TILE // KV_BLOCK)) + i_s) * D
            b_ds = tl.load(p_ds + o_d, mask=m_d, other=0.0).to(tl.float32)
            b_ds = b_ds / tl.maximum(n_s, 1).to(tl.float32)
            b_dx += tl.where((o_kv < n_s)[:, None], b_ds[None, :], 0.0)
        p_dx = (
            dx_ptr
            + i_b.to(tl.int64) * stride_ob
            + i_h.to(tl.int64) * stride_oh
            + (row0 + o_s[:, None]) * stride_os
            + o_d[None, :] * stride_od
        )
        tl.store(p_dx, b_dx.to(dx_ptr.dtype.element_ty), mask=m_rows)


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
    backend = resolve_backend(backend, x)
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
    if backend == "torch":
        return _pool_torch(x, lengths, block)
    return _PoolTiles.apply(x, lengths, block)


class PooledQKV(NamedTuple):
    """What VSA2 pools from q, k, v (``pool_qkv``)."""

    q: torch.Tensor  # aliases of the inputs: feed these (not the inputs) to the fine stage, so
    k: torch.Tensor  # that its gradients and the pooling gradients are summed in one pass
    v: torch.Tensor
    q_tiles: torch.Tensor  # [B, H, NQ, D] tile means of q
    k_segs: torch.Tensor | None  # [B, H, NSEG, D] segment means of k (router); None if not asked
    k_tiles: torch.Tensor | None  # [B, H, NQ, D] tile means of k, v (coarse stage); None if not
    v_tiles: torch.Tensor | None  # asked


class _PoolQKV(torch.autograd.Function):
    """One Triton pass over q, k, v for every mean VSA2 needs, and one for their gradients.

    The forward returns q, k, v themselves (as views) next to the means. Their consumer (the
    fine stage) sends its full-size gradients back through this Function, whose backward adds
    the broadcast pooling gradients to them in one read and one write per token. Separate
    ``pool_tiles`` calls would each write a full-size gradient that autograd then adds: four
    [B, H, S, D] passes per pooling instead of none.
    """

    @staticmethod
    def forward(ctx, q, k, v, tile_lengths, seg_lengths, q_tile, kv_block, segments, kv_tiles):
        B, H, S, D = q.shape
        NQ, NSEG = S // q_tile, S // kv_block
        q_tiles = q.new_empty((B, H, NQ, D))
        k_segs = q.new_empty((B, H, NSEG, D)) if segments else None
        k_tiles = q.new_empty((B, H, NQ, D)) if kv_tiles else None
        v_tiles = q.new_empty((B, H, NQ, D)) if kv_tiles else None
        _pool_qkv_fwd_kernel[(NQ, H, B)](
            q, k, v, tile_lengths, seg_lengths, q_tiles, k_segs, k_tiles, v_tiles,
            *q.stride(), *k.stride(), *v.stride(), H, NQ, D,
            Q_TILE=q_tile, KV_BLOCK=kv_block, BQ=triton.next_power_of_2(q_tile),
            BD=triton.next_power_of_2(D), SEGMENTS=segments, KV_TILES=kv_tiles,
        )  # fmt: skip
        ctx.save_for_backward(tile_lengths, seg_lengths)
        ctx.q_tile, ctx.kv_block = q_tile, kv_block
        ctx.shapes = [(x.shape, x.dtype, x.device) for x in (q, k, v)]
        ctx.set_materialize_grads(False)
        return q.view_as(q), k.view_as(k), v.view_as(v), q_tiles, k_segs, k_tiles, v_tiles

    @staticmethod
    def backward(ctx, dq_in, dk_in, dv_in, dq_tiles, dk_segs, dk_tiles, dv_tiles):
        tile_lengths, seg_lengths = ctx.saved_tensors
        dq = _add_pooling_grads(ctx, 0, dq_in, dq_tiles, None, tile_lengths, seg_lengths)
        dk = _add_pooling_grads(ctx, 1, dk_in, dk_tiles, dk_segs, tile_lengths, seg_lengths)
        dv = _add_pooling_grads(ctx, 2, dv_in, dv_tiles, None, tile_lengths, seg_lengths)
        return dq, dk, dv, None, None, None, None, None, None


def _add_pooling_grads(ctx, which, dx_in, dtile, dseg, tile_lengths, seg_lengths):
    """dx_in + broadcast tile / segment mean gradients, as a new tensor (None if all are None)."""
    if dtile is None and dseg is None:
        return dx_in  # nothing to add: pass the consumer's gradient through without a copy
    shape, dtype, device = ctx.shapes[which]
    B, H, S, D = shape
    NQ = S // ctx.q_tile
    # dx_in keeps its own layout (e.g. the fine stage's); else the input's dtype, contiguous
    dx = (
        torch.empty_like(dx_in)
        if dx_in is not None
        else torch.empty(shape, dtype=dtype, device=device)
    )
    in_strides = dx_in.stride() if dx_in is not None else (0, 0, 0, 0)
    _pool_qkv_bwd_kernel[(NQ, H, B)](
        dx_in, None if dtile is None else dtile.contiguous(),
        None if dseg is None else dseg.contiguous(), tile_lengths, seg_lengths, dx,
        *in_strides, *dx.stride(), H, NQ, D,
        Q_TILE=ctx.q_tile, KV_BLOCK=ctx.kv_block, BKV=triton.next_power_of_2(ctx.kv_block),
        BD=triton.next_power_of_2(D), HAS_IN=dx_in is not None, HAS_TILE=dtile is not None,
        HAS_SEG=dseg is not None,
    )  # fmt: skip
    return dx


def pool_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tile_lengths: torch.Tensor,
    seg_lengths: torch.Tensor,
    *,
    q_tile: int,
    kv_block: int,
    segments: bool,
    kv_tiles: bool,
) -> PooledQKV:
    """Every mean VSA2 takes of q, k, v, in one fused Triton pass (forward and backward).

    Args:
        q, k, v: ``[B, H, S, D]``, one shape and dtype, any strides; S a multiple of ``q_tile``,
            itself a multiple of ``kv_block`` (the caller checks shapes and lengths).
        tile_lengths: int32 ``[S // q_tile]`` on q's device, valid tokens per tile (first).
        seg_lengths: int32 ``[S // kv_block]`` on q's device, valid tokens per segment (first).
        segments: also pool k per segment (``k_segs``, the router's keys).
        kv_tiles: also pool k and v per tile (``k_tiles``, ``v_tiles``, the coarse stage's).

    Returns:
        ``PooledQKV``; fp32 accumulation, x's dtype. The tile means of q equal ``pool_tiles``
        with the Triton backend bit for bit; the means of k and v (reduced from one load of the
        tile's keys) agree with it up to the order of the float32 sums. Use the returned ``q``,
        ``k``, ``v`` in place of the inputs downstream: their gradients and the pooling
        gradients then meet in one pass.
    """
    return PooledQKV(
        *_PoolQKV.apply(q, k, v, tile_lengths, seg_lengths, q_tile, kv_block, segments, kv_tiles)
    )
