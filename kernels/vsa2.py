"""VSA2 attention of one layer: coarse stage, router, fine stage and gated fusion.

Follows VSA (Zhang et al., "VSA: Faster Video Diffusion with Trainable Sparse Attention", 2025)
and its VSA2 successor, as described in docs/concepts.md "VSA2 attention" (contract in
docs/kernels.md):

1. coarse stage: q, k, v mean-pooled per query tile (valid tokens only), dense softmax attention
   among the tiles that hold a valid token, the result broadcast to every token of its tile;
2. router: pooled q per tile against pooled k per ``kv_block`` segment selects a variable number
   of segments per (batch, head, tile) (``route``);
3. fine stage: block-sparse attention over the selected segments, with the logit bias
   ``alpha[h] * log_softmax(scores)`` per (tile, segment) pair, through which the router is
   trained (``block_sparse_attention``);
4. gated fusion ``out = g_c * O_c + g_f * O_f`` (``g_c`` defaults to 0, ``g_f`` to 1);
5. dense fallback: while the kept fraction ``1 - sparsity`` is at least
   ``dense_threshold`` the fine stage is exact dense SDPA over the valid keys.

On the Triton path the glue around the fine stage is bandwidth-lean: one fused pass pools
q, k, v for the router and the coarse stage (``pool_qkv``), the router builds its masked, scaled
scores in one GEMM (``route``), and the gated fusion reads O_f, the gates and the per-tile O_c
once, without broadcasting O_c to [B, H, S, D] (``_GatedFusion``).

The sparse path does no host sync when the length tensors already live on q's device and the
number of valid segments is given, so it can be captured in a CUDA graph at fixed shapes.

The settings (tile sizes, router mode, dense threshold, backend) are plain arguments: the
application's attention config is turned into them by its caller
(``vsa2_rl.attention.module.kernel_settings``).
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .ops import block_sparse_attention, resolve_backend
from .pooling import PooledQKV, pool_qkv, pool_tiles
from .router import count_valid_segments, route

_FUSION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class VSA2Stats(NamedTuple):
    """What a VSA2 layer reports besides its output."""

    density: torch.Tensor  # float32 scalar on q's device; 1 in the dense fallback
    kv_counts: torch.Tensor | None  # int32 [B, H, NQ] segments per query tile; None when dense


# -- gated fusion: out = g_f * O_f + g_c * O_c[tile], O_c never broadcast to [B, H, S, D] ---------


@triton.jit
def _fusion_fwd_kernel(
    of_ptr,
    oc_ptr,
    gf_ptr,
    gc_ptr,
    out_ptr,
    s_ofb, s_ofh, s_ofs, s_ofd,
    s_gfb, s_gfh, s_gfs, s_gfd,
    s_gcb, s_gch, s_gcs, s_gcd,
    s_ob, s_oh, s_os, s_od,
    H,
    NQ,
    D,
    Q_TILE: tl.constexpr,
    BR: tl.constexpr,
    BD: tl.constexpr,
    HAS_GF: tl.constexpr,
):  # fmt: skip
    # one program per (query tile, head, batch); gates may be broadcast views (stride 0)
    i_t, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b64, i_h64 = i_b.to(tl.int64), i_h.to(tl.int64)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    # [BD] the tile's coarse output, shared by its Q_TILE rows
    b_oc = tl.load(oc_ptr + ((i_b64 * H + i_h) * NQ + i_t) * D + o_d, mask=m_d).to(tl.float32)
    for r0 in tl.static_range(0, Q_TILE, BR):
        o_r = r0 + tl.arange(0, BR)
        r = i_t.to(tl.int64) * Q_TILE + o_r[:, None]
        m = (o_r < Q_TILE)[:, None] & m_d[None, :]
        # [BR, BD]
        p_of = of_ptr + i_b64 * s_ofb + i_h64 * s_ofh + r * s_ofs + o_d[None, :] * s_ofd
        b_out = tl.load(p_of, mask=m, other=0.0).to(tl.float32)
        if HAS_GF:
            p_gf = gf_ptr + i_b64 * s_gfb + i_h64 * s_gfh + r * s_gfs + o_d[None, :] * s_gfd
            b_out *= tl.load(p_gf, mask=m, other=0.0).to(tl.float32)
        p_gc = gc_ptr + i_b64 * s_gcb + i_h64 * s_gch + r * s_gcs + o_d[None, :] * s_gcd
        b_out += tl.load(p_gc, mask=m, other=0.0).to(tl.float32) * b_oc[None, :]
        p_out = out_ptr + i_b64 * s_ob + i_h64 * s_oh + r * s_os + o_d[None, :] * s_od
        tl.store(p_out, b_out.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _fusion_bwd_kernel(
    do_ptr,
    of_ptr,
    oc_ptr,
    gf_ptr,
    gc_ptr,
    dof_ptr,
    doc_ptr,
    dgf_ptr,
    dgc_ptr,
    s_dob, s_doh, s_dos, s_dod,
    s_ofb, s_ofh, s_ofs, s_ofd,
    s_gfb, s_gfh, s_gfs, s_gfd,
    s_gcb, s_gch, s_gcs, s_gcd,
    s_dofb, s_dofh, s_dofs, s_dofd,
    s_dgfb, s_dgfh, s_dgfs, s_dgfd,
    s_dgcb, s_dgch, s_dgcs, s_dgcd,
    H,
    NQ,
    D,
    Q_TILE: tl.constexpr,
    BR: tl.constexpr,
    BD: tl.constexpr,
    HAS_GF: tl.constexpr,
    D_GF: tl.constexpr,
    D_GC: tl.constexpr,
):  # fmt: skip
    # d O_f = g_f * dout (only with a fine gate: else dout itself is d O_f), d O_c = sum over the
    # tile's rows of g_c * dout, d g_f = O_f * dout, d g_c = O_c * dout; dout is read once
    i_t, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b64, i_h64 = i_b.to(tl.int64), i_h.to(tl.int64)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    p_oc = ((i_b64 * H + i_h) * NQ + i_t) * D + o_d
    b_oc = tl.load(oc_ptr + p_oc, mask=m_d).to(tl.float32)
    # [BD] fp32 sum of the rows' coarse gradients
    b_doc = tl.zeros([BD], dtype=tl.float32)
    for r0 in tl.static_range(0, Q_TILE, BR):
        o_r = r0 + tl.arange(0, BR)
        r = i_t.to(tl.int64) * Q_TILE + o_r[:, None]
        m = (o_r < Q_TILE)[:, None] & m_d[None, :]
        # [BR, BD]
        p_do = do_ptr + i_b64 * s_dob + i_h64 * s_doh + r * s_dos + o_d[None, :] * s_dod
        b_do = tl.load(p_do, mask=m, other=0.0).to(tl.float32)
        p_gc = gc_ptr + i_b64 * s_gcb + i_h64 * s_gch + r * s_gcs + o_d[None, :] * s_gcd
        b_doc += tl.sum(b_do * tl.load(p_gc, mask=m, other=0.0).to(tl.float32), axis=0)
        if D_GC:
            p_dgc = dgc_ptr + i_b64 * s_dgcb + i_h64 * s_dgch + r * s_dgcs + o_d[None, :] * s_dgcd
            tl.store(p_dgc, (b_do * b_oc[None, :]).to(dgc_ptr.dtype.element_ty), mask=m)
        if HAS_GF:
            p_gf = gf_ptr + i_b64 * s_gfb + i_h64 * s_gfh + r * s_gfs + o_d[None, :] * s_gfd
            b_gf = tl.load(p_gf, mask=m, other=0.0).to(tl.float32)
            p_dof = dof_ptr + i_b64 * s_dofb + i_h64 * s_dofh + r * s_dofs + o_d[None, :] * s_dofd
            tl.store(p_dof, (b_do * b_gf).to(dof_ptr.dtype.element_ty), mask=m)
        if D_GF:
            p_of = of_ptr + i_b64 * s_ofb + i_h64 * s_ofh + r * s_ofs + o_d[None, :] * s_ofd
            b_of = tl.load(p_of, mask=m, other=0.0).to(tl.float32)
            p_dgf = dgf_ptr + i_b64 * s_dgfb + i_h64 * s_dgfh + r * s_dgfs + o_d[None, :] * s_dgfd
            tl.store(p_dgf, (b_do * b_of).to(dgf_ptr.dtype.element_ty), mask=m)
    tl.store(doc_ptr + p_oc, b_doc.to(doc_ptr.dtype.element_ty), mask=m_d)


def _fusion_meta(q_tile: int, D: int) -> dict:
    # 16-row chunks keep the [rows, D] fp32 tiles of up to four tensors in registers
    return {
        "Q_TILE": q_tile,
        "BR": min(16, triton.next_power_of_2(q_tile)),
        "BD": triton.next_power_of_2(D),
    }


def _grad_buffer(gate: torch.Tensor, full: torch.Size) -> torch.Tensor:
    """Full-size gradient buffer for a gate: the gate's own layout if it is full-size already."""
    if gate.shape == full:
        return torch.empty_like(gate)  # keeps a transposed gate's strides: no copy upstream
    return torch.empty(full, dtype=gate.dtype, device=gate.device)


class _GatedFusion(torch.autograd.Function):
    """``g_f * O_f + g_c * O_c`` with O_c given per tile; one read of each full-size operand."""

    @staticmethod
    def forward(ctx, out_fine, o_tiles, gate_fine, gate_coarse, q_tile, out_dtype):
        # the kernels index O_c as contiguous [B, H, NQ, D]; SDPA's float32 output on CUDA is a
        # transposed [B, NQ, H, D] buffer (a small copy: one row per tile)
        o_tiles = o_tiles.contiguous()
        B, H, S, D = out_fine.shape
        full = out_fine.shape
        out = torch.empty(full, dtype=out_dtype, device=out_fine.device)
        gf = gate_fine.broadcast_to(full) if gate_fine is not None else out_fine
        gc = gate_coarse.broadcast_to(full)
        _fusion_fwd_kernel[(S // q_tile, H, B)](
            out_fine, o_tiles, gf, gc, out,
            *out_fine.stride(), *gf.stride(), *gc.stride(), *out.stride(), H, S // q_tile, D,
            HAS_GF=gate_fine is not None, **_fusion_meta(q_tile, D),
        )  # fmt: skip
        ctx.save_for_backward(out_fine, o_tiles, gate_fine, gate_coarse)
        ctx.q_tile = q_tile
        return out

    @staticmethod
    def backward(ctx, dout):
        out_fine, o_tiles, gate_fine, gate_coarse = ctx.saved_tensors
        B, H, S, D = full = out_fine.shape
        need_gf = gate_fine is not None and ctx.needs_input_grad[2]
        need_gc = ctx.needs_input_grad[3]
        gf = gate_fine.broadcast_to(full) if gate_fine is not None else out_fine
        gc = gate_coarse.broadcast_to(full)
        # without a fine gate d O_f is dout itself: handed on as is, no copy
        d_of = torch.empty_like(out_fine) if gate_fine is not None else dout
        d_oc = torch.empty(o_tiles.shape, dtype=torch.float32, device=o_tiles.device)
        d_gf = _grad_buffer(gate_fine, full) if need_gf else out_fine
        d_gc = _grad_buffer(gate_coarse, full) if need_gc else out_fine
        _fusion_bwd_kernel[(S // ctx.q_tile, H, B)](
            dout, out_fine, o_tiles, gf, gc, d_of, d_oc, d_gf, d_gc,
            *dout.stride(), *out_fine.stride(), *gf.stride(), *gc.stride(), *d_of.stride(),
            *d_gf.stride(), *d_gc.stride(), H, S // ctx.q_tile, D,
            HAS_GF=gate_fine is not None, D_GF=need_gf, D_GC=need_gc,
            **_fusion_meta(ctx.q_tile, D),
        )  # fmt: skip
        # a broadcast gate's gradient is summed back to the gate's shape
        d_gf = d_gf.sum_to_size(gate_fine.shape) if need_gf else None
        d_gc = d_gc.sum_to_size(gate_coarse.shape) if need_gc else None
        return d_of, d_oc.to(o_tiles.dtype), d_gf, d_gc, None, None


def _check_lengths(name: str, lengths: torch.Tensor, count: int, block: int) -> None:
    if lengths.dim() != 1 or lengths.shape[0] != count or lengths.is_floating_point():
        raise ValueError(
            f"{name} must be an integer tensor of shape [{count}], "
            f"got dtype {lengths.dtype} shape {tuple(lengths.shape)}"
        )
    # values are checked only on the CPU, where reading them does not wait on the device
    if lengths.device.type == "cpu" and not torch.compiler.is_compiling():
        if bool(((lengths < 0) | (lengths > block)).any()):
            raise ValueError(f"{name} must lie in [0, {block}], got {lengths.tolist()}")
        if not bool((lengths > 0).any()):
            raise ValueError(f"{name} has no valid token: every entry is 0")


def _check_gates(q: torch.Tensor, gate_coarse, gate_fine) -> None:
    for name, gate in (("gate_coarse", gate_coarse), ("gate_fine", gate_fine)):
        if gate is None:
            continue
        try:
            fits = gate.dim() <= 4 and torch.broadcast_shapes(gate.shape, q.shape) == q.shape
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(
                f"{name} of shape {tuple(gate.shape)} does not broadcast to q's shape "
                f"{tuple(q.shape)}; pass [B, H, S, D] or a broadcastable shape such as [1, H, 1, D]"
            )


def _check_inputs(
    q, k, v, tile_lengths, seg_lengths, sparsity, alpha, q_tile, kv_block, mode, backend
) -> None:
    if mode not in ("topk", "topp"):
        raise ValueError(f"mode={mode!r} is unknown; use 'topk' or 'topp'")
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend={backend!r} is unknown; use 'auto', 'triton' or 'torch'")
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity={sparsity} must lie in [0, 1); 0 keeps every segment")
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(
            f"q, k, v must share one [B, H, S, D] shape, got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    S = q.shape[2]
    if q_tile < 1 or kv_block < 1 or S % q_tile != 0 or q_tile % kv_block != 0:
        raise ValueError(
            f"S={S} must be a multiple of q_tile={q_tile}, itself a multiple of "
            f"kv_block={kv_block}; tile the sequence with TileLayout first"
        )
    _check_lengths("tile_lengths", tile_lengths, S // q_tile, q_tile)
    _check_lengths("seg_lengths", seg_lengths, S // kv_block, kv_block)
    if alpha.shape != (q.shape[1],):
        raise ValueError(f"alpha must have shape [H] = [{q.shape[1]}], got {tuple(alpha.shape)}")


def _pool(q, k, v, tile_lengths, seg_lengths, q_tile, kv_block, segments, kv_tiles, triton_path):
    """Every mean VSA2 needs, fused on the Triton path, by ``pool_tiles`` on the torch path."""
    if triton_path:
        return pool_qkv(
            q, k, v, tile_lengths, seg_lengths,
            q_tile=q_tile, kv_block=kv_block, segments=segments, kv_tiles=kv_tiles,
        )  # fmt: skip
    pool = lambda x, lengths, block: pool_tiles(x, lengths, block, backend="torch")
    return PooledQKV(
        q,
        k,
        v,
        pool(q, tile_lengths, q_tile),
        pool(k, seg_lengths, kv_block) if segments else None,
        pool(k, tile_lengths, q_tile) if kv_tiles else None,
        pool(v, tile_lengths, q_tile) if kv_tiles else None,
    )


def _gated_fusion(out_fine, o_tiles, gate_fine, gate_coarse, q_tile, triton_path):
    """``g_f * O_f + g_c * O_c`` in ``O_f``'s dtype, O_c given per tile ``[B, H, NQ, D]``."""
    fused = triton_path and all(
        t is None or t.dtype in _FUSION_DTYPES for t in (out_fine, gate_fine, gate_coarse)
    )
    if fused:
        return _GatedFusion.apply(out_fine, o_tiles, gate_fine, gate_coarse, q_tile, out_fine.dtype)
    B, H, S, D = out_fine.shape
    out_coarse = o_tiles[:, :, :, None, :].expand(B, H, S // q_tile, q_tile, D).reshape(B, H, S, D)
    out = out_fine if gate_fine is None else gate_fine * out_fine
    return (out + gate_coarse * out_coarse).to(out_fine.dtype)


def _dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg_lengths: torch.Tensor, kv_block: int
) -> torch.Tensor:
    """Exact SDPA over the valid keys (padding sits at the end of each segment)."""
    offsets = torch.arange(kv_block, device=q.device)
    key_valid = (offsets[None, :] < seg_lengths[:, None]).reshape(-1)  # (S,)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=key_valid[None, None, None, :])


def vsa2_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    tile_lengths: torch.Tensor,
    seg_lengths: torch.Tensor,
    sparsity: float,
    alpha: torch.Tensor,
    gate_coarse: torch.Tensor | None = None,
    gate_fine: torch.Tensor | None = None,
    q_tile: int,
    kv_block: int,
    mode: str,
    top_p: float,
    min_kv: int,
    dense_threshold: float,
    backend: str = "auto",
    num_valid_segments: int | None = None,
    bwd: str = "two_pass",
) -> tuple[torch.Tensor, VSA2Stats]:
    """VSA2 attention of tile-ordered q, k, v (RoPE applied).

    Args:
        q, k, v: ``[B, H, S, D]``, S = number of tiles * ``q_tile``.
        tile_lengths: int ``[S // q_tile]`` valid tokens per tile (first in the tile).
        seg_lengths: int ``[S // kv_block]`` valid tokens per key segment (first in it).
            Both may live on the CPU (the layout's copy: moved here, one small host-to-device
            copy each) or on q's device (no copy; needed for CUDA-graph capture).
        sparsity: in ``[0, 1)``; the router keeps at most ``ceil((1 - sparsity) * NSEG_valid)``
            segments per tile; ``1 - sparsity >= dense_threshold`` -> dense fallback.
        alpha: ``[H]`` learnable scale of the router bias (zero-init in the module).
        gate_coarse: ``g_c`` broadcastable to ``[B, H, S, D]``; None means 0 and skips the
            coarse stage.
        gate_fine: ``g_f`` broadcastable to ``[B, H, S, D]``; None means 1.
        q_tile: tokens per query tile (a multiple of ``kv_block``).
        kv_block: tokens per key segment, the router's unit.
        mode, top_p, min_kv: the router's selection (:func:`route`): ``"topk"`` or ``"topp"``,
            the mass a ``"topp"`` row covers, the fewest segments per row.
        dense_threshold: the kept fraction ``1 - sparsity`` from which on the fine stage is
            exact dense attention (the dense fallback).
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` for every stage.
        num_valid_segments: segments with length > 0, as a python int. None counts them from
            ``seg_lengths``: free on the CPU, one host sync on the device. Pass it with
            device-resident lengths to keep the sparse path free of host syncs.
        bwd: the fine stage's backward on the Triton path, ``"two_pass"`` (deterministic) or
            ``"fused"`` (faster at kv_block 16, atomic sums): ``block_sparse_attention``'s.

    Returns:
        ``(out, VSA2Stats)``: ``out`` ``[B, H, S, D]`` in q's dtype. Rows of padded query tokens
        hold finite values that mean nothing (untiling drops them). ``stats.density`` is the
        router's density (1 in the dense fallback), a float32 tensor: reading it is the
        caller's host sync.
    """
    _check_inputs(
        q, k, v, tile_lengths, seg_lengths, sparsity, alpha, q_tile, kv_block, mode, backend
    )
    _check_gates(q, gate_coarse, gate_fine)
    dense = 1.0 - sparsity >= dense_threshold
    if num_valid_segments is None and not dense:
        num_valid_segments = count_valid_segments(seg_lengths)
    tile_lengths = tile_lengths.to(device=q.device, dtype=torch.int32)
    seg_lengths = seg_lengths.to(device=q.device, dtype=torch.int32)
    triton_path = resolve_backend(backend, q) == "triton"

    # one pass over q, k, v for the router's and the coarse stage's means; the fine stage reads
    # the returned aliases, so its gradients and the pooling gradients are summed in one pass
    coarse = gate_coarse is not None
    if coarse or not dense:
        pooled = _pool(
            q, k, v, tile_lengths, seg_lengths, q_tile, kv_block,
            segments=not dense, kv_tiles=coarse, triton_path=triton_path,
        )  # fmt: skip
        q, k, v = pooled.q, pooled.k, pooled.v
    if dense:
        out_fine = _dense_attention(q, k, v, seg_lengths, kv_block)
        stats = VSA2Stats(torch.ones((), dtype=torch.float32, device=q.device), None)
    else:
        routing = route(
            pooled.q_tiles,
            pooled.k_segs,
            seg_lengths,
            sparsity=sparsity,
            mode=mode,
            top_p=top_p,
            min_kv=min_kv,
            num_valid_segments=num_valid_segments,
            backend=backend,
        )
        bias = alpha.to(torch.float32)[None, :, None, None] * routing.log_probs
        out_fine, _ = block_sparse_attention(
            q,
            k,
            v,
            routing.kv_indices,
            routing.kv_counts,
            bias,
            q_tile=q_tile,
            kv_block=kv_block,
            kv_lengths=seg_lengths,
            backend=backend,
            bwd=bwd,
        )
        stats = VSA2Stats(routing.density, routing.kv_counts)

    if not coarse:
        out = out_fine if gate_fine is None else gate_fine * out_fine
        return out.to(out_fine.dtype), stats
    # coarse stage: dense attention among the tiles that hold a valid token (empty tiles pool
    # to 0 and are masked out); its [B, H, NQ, D] output is fused per tile, never broadcast
    key_mask = (tile_lengths > 0)[None, None, None, :]
    o_tiles = F.scaled_dot_product_attention(
        pooled.q_tiles, pooled.k_tiles, pooled.v_tiles, attn_mask=key_mask
    )
    out = _gated_fusion(out_fine, o_tiles, gate_fine, gate_coarse, q_tile, triton_path)
    return out, stats
