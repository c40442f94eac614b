"""Single-pass backward of the VSA2 fine stage, built for fine segments (kv_block 16 / 32).

``block_sparse.bsa_backward(..., bwd="fused")`` runs this instead of the two-pass design (a
query-major dQ pass and a key-major dK/dV pass). One program per (query tile, key range) walks
the tile's selected segments like the forward, ``BLOCK_N // kv_block`` segments per step, and
per step computes P and dS once (FlashAttention-2's backward recurrence, Dao 2023) and

* accumulates dQ in registers (stored once, or added atomically when a tile's keys are split
  over several key ranges);
* adds the step's dV = P^T dO and dK = dS^T Q rows to float32 buffers with atomic adds.

Why (docs/kernels.md, "Backward at fine segments"): the key-major pass reloads a query tile's Q
and dO (32 KB) for every selected 16-key segment; here the tile's rows are loaded once and each
(tile, segment) pair costs its K/V rows (8 KB) plus its float32 dK/dV rows (16 KB of atomic
adds), and five products instead of seven.

Key ranges: with random selections the float32 dK/dV of a whole head (S * D * 8 bytes; 77 MB at
the 720p shape) plus its K/V do not fit in L2, so atomic adds would go to HBM. The launcher
therefore sorts each row's segment ids and splits the keys into R ranges, each small enough to
stay in L2 while the programs of one (head, range) run; program (t, r) visits tile t's segments
that fall in range r. ``VSA2_RL_BWD_KEY_RANGES`` overrides R (A/B runs).

Not deterministic: float32 atomic adds land in whatever order the programs run, so the sums'
last bits vary from run to run. The two-pass backward (the default) is the deterministic one.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .segments import (
    add_column_terms,
    gather_segments,
    interpreting,
    keep_block_n,
    load_segment_tma,
    selected_row,
    store_pair_sums,
)

__all__ = ["bsa_backward_fused", "key_range_bounds", "num_key_ranges"]


def _fused_configs() -> list[triton.Config]:
    if interpreting():
        return [triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=1)]
    # not tuned on a GPU yet. ptxas (sm_90, D=128): 64 keys fit 8 warps without spills (~240
    # registers), 4 warps spill; 32 keys fit 4 warps
    return [
        triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s)
        for bn, w, s in ((64, 8, 2), (64, 8, 3), (32, 4, 2))
    ]


@triton.jit
def _atomic_add_rows(p_base, o_tok, b_x, m_row, HEAD_DIM: tl.constexpr):
    """Add ``b_x`` [N, HEAD_DIM] float32 to rows ``o_tok`` of a contiguous [S, HEAD_DIM] buffer
    at ``p_base``, skipping rows where ``m_row`` is False."""
    o_d = tl.arange(0, HEAD_DIM)
    p = p_base + o_tok[:, None] * HEAD_DIM + o_d[None, :]
    tl.atomic_add(p, b_x, mask=m_row[:, None], sem="relaxed")


@triton.jit
def _load_query_tile(
    Q, DO, O, LSE, DLSE, i_b, i_h, i_bh, o_tok_q, s_qb, s_qh, s_qs, s_ob, s_oh, s_os,
    s_dob, s_doh, s_dos, S, HEAD_DIM: tl.constexpr, HAS_DLSE: tl.constexpr,
):  # fmt: skip
    """A query tile's q and dO [Q_TILE, HEAD_DIM], its lse in log2 units (+inf on rows that saw
    no valid key, so their P is 0) and delta = rowsum(dO * O) - dLSE [Q_TILE]."""
    o_d = tl.arange(0, HEAD_DIM)
    b_q = tl.load(Q + i_b * s_qb + i_h * s_qh + o_tok_q[:, None] * s_qs + o_d[None, :])
    b_do = tl.load(DO + i_b * s_dob + i_h * s_doh + o_tok_q[:, None] * s_dos + o_d[None, :])
    b_o = tl.load(O + i_b * s_ob + i_h * s_oh + o_tok_q[:, None] * s_os + o_d[None, :])
    b_delta = tl.sum(b_do.to(tl.float32) * b_o.to(tl.float32), 1)
    if HAS_DLSE:
        b_delta -= tl.load(DLSE + i_bh.to(tl.int64) * S + o_tok_q)
    b_lse = tl.load(LSE + i_bh.to(tl.int64) * S + o_tok_q)
    b_lse2 = tl.where(b_lse == float("-inf"), float("inf"), b_lse * 1.4426950408889634)
    return b_q, b_do, b_lse2, b_delta


@triton.autotune(
    configs=_fused_configs(),
    key=["Q_TILE", "KV_BLOCK", "HEAD_DIM", "DQ_ATOMIC"],
    prune_configs_by={"early_config_prune": keep_block_n},
    # autotuning runs the kernel once per config: the atomic targets must start at zero each time
    reset_to_zero=["DQ", "DK", "DV"],
)
@triton.jit
def _bsa_bwd_fused_kernel(
    Q, K, V, DESC_K, DESC_V, O, DO, LSE, DLSE, DQ, DK, DV, DBIAS, MASS,
    KV_IDX, BOUNDS, BIAS, KV_LEN,
    s_qb, s_qh, s_qs, s_kb, s_kh, s_ks, s_vb, s_vh, s_vs, s_ob, s_oh, s_os, s_dob, s_doh, s_dos,
    qk_scale, scale, H, S, NQ, KMAX,
    Q_TILE: tl.constexpr, KV_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_LEN: tl.constexpr, HAS_DLSE: tl.constexpr,
    DQ_ATOMIC: tl.constexpr, DOT_PREC: tl.constexpr, TMA: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    tl.static_assert(BLOCK_N % KV_BLOCK == 0)
    G: tl.constexpr = BLOCK_N // KV_BLOCK
    i_t, i_r, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = (i_bh // H).to(tl.int64), (i_bh % H).to(tl.int64)
    i_row = i_bh.to(tl.int64) * NQ + i_t
    n_rows = tl.num_programs(2).to(tl.int64) * NQ

    o_tok_q = i_t.to(tl.int64) * Q_TILE + tl.arange(0, Q_TILE)
    o_d = tl.arange(0, HEAD_DIM)
    # [Q_TILE, HEAD_DIM], [Q_TILE]
    b_q, b_do, b_lse2, b_delta = _load_query_tile(
        Q, DO, O, LSE, DLSE, i_b, i_h, i_bh, o_tok_q, s_qb, s_qh, s_qs, s_ob, s_oh, s_os,
        s_dob, s_doh, s_dos, S, HEAD_DIM, HAS_DLSE,
    )  # fmt: skip
    # slots [lo, hi) of the row hold the segments of key range i_r (BOUNDS is [R + 1, rows])
    p_idx, p_bias, hi = selected_row(KV_IDX, BOUNDS + (i_r + 1) * n_rows, BIAS, i_row, KMAX)
    lo = tl.load(BOUNDS + i_r * n_rows + i_row)
    p_k0 = K + i_b * s_kb + i_h * s_kh
    p_v0 = V + i_b * s_vb + i_h * s_vh
    p_dk = DK + i_bh.to(tl.int64) * S * HEAD_DIM
    p_dv = DV + i_bh.to(tl.int64) * S * HEAD_DIM
    bias_to_dot = 1.4426950408889634 / qk_scale

    b_dq = tl.zeros([Q_TILE, HEAD_DIM], tl.float32)
    for i_s in range(lo, hi, G):
        # -- gather G segments into one BLOCK_N-key tile ----
        o_slot, m_slot, m_key, o_tok_k = gather_segments(
            p_idx, KV_LEN, i_s, hi, BLOCK_N, KV_BLOCK, HAS_LEN
        )
        if TMA and G == 1:
            b_k, b_v = load_segment_tma(DESC_K, DESC_V, i_b, i_h, p_idx + i_s, KV_BLOCK, HEAD_DIM)
        else:
            # [BLOCK_N, HEAD_DIM]
            b_k = tl.load(
                p_k0 + o_tok_k[:, None] * s_ks + o_d[None, :], mask=m_key[:, None], other=0.0
            )
            b_v = tl.load(
                p_v0 + o_tok_k[:, None] * s_vs + o_d[None, :], mask=m_key[:, None], other=0.0
            )
        # -- recompute P from the saved lse (logits as in the forward) ----
        # [Q_TILE, BLOCK_N]
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)
        b_s = add_column_terms(
            b_s, p_bias, o_slot, m_slot, m_key, bias_to_dot, HAS_BIAS, HAS_LEN or G > 1
        )
        b_p = tl.math.exp2(b_s * qk_scale - b_lse2[:, None])
        # -- dV rows first, so only one float32 [BLOCK_N, HEAD_DIM] partial is live ----
        b_dv = tl.dot(tl.trans(b_p.to(b_do.dtype)), b_do, input_precision=DOT_PREC)
        _atomic_add_rows(p_dv, o_tok_k, b_dv, m_key, HEAD_DIM)
        # -- dS = P * (dP - delta); the scale of dQ and dK enters before the 16-bit cast ----
        b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PREC)
        b_ds = b_p * (b_dp - b_delta[:, None])
        if HAS_BIAS:
            store_pair_sums(DBIAS + i_row * KMAX, i_s, hi, b_ds, G, KV_BLOCK)
            store_pair_sums(MASS + i_row * KMAX, i_s, hi, b_p, G, KV_BLOCK)
        b_ds = (b_ds * scale).to(b_k.dtype)
        b_dq += tl.dot(b_ds, b_k, input_precision=DOT_PREC)
        b_dk = tl.dot(tl.trans(b_ds), b_q, input_precision=DOT_PREC)
        _atomic_add_rows(p_dk, o_tok_k, b_dk, m_key, HEAD_DIM)

    p_dq = DQ + i_bh.to(tl.int64) * S * HEAD_DIM + o_tok_q[:, None] * HEAD_DIM + o_d[None, :]
    if DQ_ATOMIC:
        if hi > lo:  # a key range the row selected nothing in adds nothing
            tl.atomic_add(p_dq, b_dq, sem="relaxed")
    else:
        tl.store(p_dq, b_dq.to(DQ.dtype.element_ty))


# -- launcher -------------------------------------------------------------------------------------


def num_key_ranges(q: torch.Tensor, num_segments: int) -> int:
    """R, the key ranges of the fused backward: ``VSA2_RL_BWD_KEY_RANGES`` if set, else the
    fewest ranges whose K, V and float32 dK, dV (S * D * (2 * itemsize + 8) bytes per head)
    take at most half of the GPU's L2 cache; 1 off CUDA."""
    forced = os.environ.get("VSA2_RL_BWD_KEY_RANGES")
    if forced:
        ranges = int(forced)
        if ranges < 1:
            raise ValueError(f"VSA2_RL_BWD_KEY_RANGES must be >= 1, got {forced!r}")
        return min(ranges, num_segments)
    if not q.is_cuda:
        return 1
    S, D = q.shape[2], q.shape[3]
    per_head = S * D * (2 * q.element_size() + 8)
    budget = torch.cuda.get_device_properties(q.device).L2_cache_size // 2
    return max(1, min(num_segments, math.ceil(per_head / budget)))


def key_range_bounds(
    kv_indices: torch.Tensor, kv_counts: torch.Tensor, num_segments: int, ranges: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The selection as the fused kernel walks it: ``(ids, order, bounds)``.

    ``bounds`` int32 [ranges + 1, B*H*NQ]: slots ``[bounds[r, i], bounds[r + 1, i])`` of row i
    hold the segments in key range r, ``[r * NSEG // R, (r + 1) * NSEG // R)``. With one range
    the ids are used as given (``order`` None, bounds 0 and the count); with more, each row's
    used ids are sorted ascending (unused slots after them) and ``order`` maps the sorted slots
    back to the given ones. On the device, no host sync.
    """
    counts = kv_counts.reshape(-1)
    if ranges == 1:
        return kv_indices, None, torch.stack([torch.zeros_like(counts), counts]).contiguous()
    KMAX = kv_indices.shape[-1]
    device = kv_indices.device
    m_used = torch.arange(KMAX, device=device) < kv_counts.unsqueeze(-1)
    keyed = torch.where(m_used, kv_indices, num_segments)
    ids, order = keyed.sort(dim=-1, stable=True)
    edges = torch.arange(ranges + 1, device=device, dtype=torch.int32) * num_segments // ranges
    flat = ids.reshape(-1, KMAX)
    bounds = torch.searchsorted(flat, edges.expand(flat.shape[0], -1).contiguous(), out_int32=True)
    return ids.contiguous(), order, bounds.t().contiguous()


def _fused_outputs(q: torch.Tensor, bias: torch.Tensor, has_bias: bool, dq_atomic: bool):
    """(dq, dk, dv accumulators, raw d(bias), pair mass): dK/dV always zeroed float32 (the
    atomic targets; q's own tensors for float32 inputs), dq float32 zeros when several key
    ranges add into it, d(bias) and mass zeros (unvisited slots keep a zero gradient)."""
    device = q.device
    dq = torch.zeros(q.shape, device=device) if dq_atomic else torch.empty_like(q)
    dk = torch.zeros(q.shape, device=device)
    dv = torch.zeros(q.shape, device=device)
    if not has_bias:
        dummy = torch.zeros(1, device=device)
        return dq, dk, dv, dummy, dummy
    return dq, dk, dv, torch.zeros_like(bias), torch.zeros(bias.shape, device=device)


def bsa_backward_fused(
    dout, dlse, q, k, v, out, lse, kv_indices, kv_counts, bias, lens, descs, *,
    q_tile: int, kv_block: int, scale: float, has_bias: bool, has_len: bool, has_dlse: bool,
    dot_prec: str, tma: bool,
):  # fmt: skip
    """The fused backward on ``bsa_backward``'s prepared arguments (placeholders where a flag is
    False; ``descs`` the K/V TMA descriptors or the tensors). Returns (dq, dk, dv in the inputs'
    dtype, raw d(bias) and pair mass in the given slot order, or placeholders)."""
    B, H, S, D = q.shape
    NQ, KMAX = kv_indices.shape[2], kv_indices.shape[3]
    NSEG = S // kv_block
    ranges = num_key_ranges(q, NSEG)
    ids, order, bounds = key_range_bounds(kv_indices, kv_counts, NSEG, ranges)
    if has_bias and order is not None:
        bias = bias.gather(-1, order)
    dq, dk, dv, dbias, mass = _fused_outputs(q, bias, has_bias, dq_atomic=ranges > 1)
    _bsa_bwd_fused_kernel[(NQ, ranges, B * H)](
        q, k, v, *descs, out, dout, lse, dlse, dq, dk, dv, dbias, mass,
        ids, bounds, bias, lens,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2),
        scale * 1.4426950408889634, scale, H, S, NQ, KMAX,
        Q_TILE=q_tile, KV_BLOCK=kv_block, HEAD_DIM=D,
        HAS_BIAS=has_bias, HAS_LEN=has_len, HAS_DLSE=has_dlse,
        DQ_ATOMIC=ranges > 1, DOT_PREC=dot_prec, TMA=tma,
    )  # fmt: skip
    if has_bias and order is not None:
        dbias = torch.zeros_like(dbias).scatter_(-1, order, dbias)
        mass = torch.zeros_like(mass).scatter_(-1, order, mass)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbias, mass
