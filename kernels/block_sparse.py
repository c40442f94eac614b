"""Triton kernels for the VSA2 fine stage: block-sparse attention over selected key segments.

Each 64-token query tile attends to its own list of key segments (``kv_block`` contiguous keys
each), chosen by the VSA2 router, with one additive logit bias per (tile, segment) pair. The
kernels follow FlashAttention-2 (Dao, 2023): an online-softmax forward that saves the row
log-sum-exp, and a backward split into

* a query-major pass (one program per query tile) that recomputes P, accumulates dQ and the
  per-pair bias gradient d(bias) = sum of dS over the pair's logits, and stores
  delta = rowsum(dO * O) - dLSE for the second pass;
* a key-major pass (one program per key segment) that walks a transposed, CSR-style index of the
  (query tile, slot) pairs that selected the segment and accumulates dK and dV without atomics.

Segments of 16 or 32 keys would make ``tl.dot`` tiles too thin for the tensor cores, so the
forward and dQ kernels gather ``BLOCK_N // kv_block`` selected segments into one BLOCK_N-key tile
per iteration (a pointer gather of rows from different segments), masked by the per-segment valid
lengths and the row's count. The dK/dV kernel likewise gathers ``QG`` query tiles per iteration,
and for 16- or 32-key segments accumulates dK^T / dV^T (head-dim major) so that every product
keeps M >= 64, the smallest Hopper tensor-core tile.

The kv-major index is built on the device with a stable sort (no host sync, deterministic order);
see :func:`build_kv_major_index`. ``bsa_backward(..., bwd="fused")`` runs the single-pass
backward of :mod:`.block_sparse_fused` instead (atomic dK/dV; built for kv_block 16). Index conventions follow FlexAttention's ``BlockMask``
(``kv_num_blocks`` / ``kv_indices``) with per-row counts.
"""

from __future__ import annotations

import functools
import importlib
import os
import re

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .segments import (
    add_column_terms,
    gather_segments,
    interpreting,
    keep_block_n,
    load_segment_tma,
    selected_row,
    store_pair_sums,
)

LOG2E = 1.4426950408889634


# -- autotune configs -----------------------------------------------------------------------------
# The interpreter runs every config it is given, so it gets one small config; on the GPU the
# pruning functions drop configs whose tile cannot hold a whole number of segments / query tiles.


def _fwd_configs() -> list[triton.Config]:
    if interpreting():
        return [triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=1)]
    # BLOCK_N=64, 4 warps, 2 stages first (the fastest at D=128, bf16, for every kv_block in
    # ``benchmarks/tune_kernels.py --sweep``); the others stay as the autotuner's alternatives
    return [
        triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s)
        for bn, w, s in ((64, 4, 2), (64, 4, 3), (128, 8, 2))
    ]


def _dkv_configs() -> list[triton.Config]:
    if interpreting():
        return [triton.Config({"QG": 1}, num_warps=4, num_stages=1)]
    # QG=1, 4 warps, 2 stages first (the fastest in ``benchmarks/tune_kernels.py --sweep``)
    return [
        triton.Config({"QG": qg}, num_warps=w, num_stages=s)
        for qg, w, s in ((1, 4, 2), (2, 4, 2), (2, 8, 2))
    ]


def _keep_qg(configs, named_args, **kwargs):
    rows = [c for c in configs if c.kwargs["QG"] * kwargs["Q_TILE"] <= 256]
    return rows or configs[:1]


# -- forward --------------------------------------------------------------------------------------


@triton.autotune(
    configs=_fwd_configs(),
    key=["Q_TILE", "KV_BLOCK", "HEAD_DIM"],
    prune_configs_by={"early_config_prune": keep_block_n},
)
@triton.jit
def _bsa_fwd_kernel(
    Q,
    K,
    V,
    DESC_K,
    DESC_V,
    O,
    LSE,
    KV_IDX,
    KV_CNT,
    BIAS,
    KV_LEN,
    s_qb,
    s_qh,
    s_qs,
    s_kb,
    s_kh,
    s_ks,
    s_vb,
    s_vh,
    s_vs,
    qk_scale,
    H,
    S,
    NQ,
    KMAX,
    Q_TILE: tl.constexpr,
    KV_BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_LEN: tl.constexpr,
    DOT_PREC: tl.constexpr,
    TMA: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    tl.static_assert(BLOCK_N % KV_BLOCK == 0)
    G: tl.constexpr = BLOCK_N // KV_BLOCK
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    i_row = i_bh.to(tl.int64) * NQ + i_t

    o_m = tl.arange(0, Q_TILE)
    o_d = tl.arange(0, HEAD_DIM)
    o_tok_q = i_t.to(tl.int64) * Q_TILE + o_m

    p_q = (
        Q
        + i_b.to(tl.int64) * s_qb
        + i_h.to(tl.int64) * s_qh
        + o_tok_q[:, None] * s_qs
        + o_d[None, :]
    )
    # [Q_TILE, HEAD_DIM]
    b_q = tl.load(p_q)
    p_k0 = K + i_b.to(tl.int64) * s_kb + i_h.to(tl.int64) * s_kh
    p_v0 = V + i_b.to(tl.int64) * s_vb + i_h.to(tl.int64) * s_vh
    p_idx, p_bias, n_sel = selected_row(KV_IDX, KV_CNT, BIAS, i_row, KMAX)
    # bias in log2 units is bias * LOG2E = qk_scale * (bias / scale)
    bias_to_dot = 1.4426950408889634 / qk_scale

    b_m = tl.full([Q_TILE], float("-inf"), tl.float32)
    b_l = tl.zeros([Q_TILE], tl.float32)
    b_acc = tl.zeros([Q_TILE, HEAD_DIM], tl.float32)
    for i_s in range(0, n_sel, G):
        # -- gather G segments into one BLOCK_N-key tile ----
        o_slot, m_slot, m_key, o_tok_k = gather_segments(
            p_idx, KV_LEN, i_s, n_sel, BLOCK_N, KV_BLOCK, HAS_LEN
        )
        if TMA and G == 1:
            b_k, b_v = load_segment_tma(DESC_K, DESC_V, i_b, i_h, p_idx + i_s, KV_BLOCK, HEAD_DIM)
            b_kt = tl.trans(b_k)
        else:
            # [HEAD_DIM, BLOCK_N]
            b_kt = tl.load(
                p_k0 + o_tok_k[None, :] * s_ks + o_d[:, None], mask=m_key[None, :], other=0.0
            )
            # [BLOCK_N, HEAD_DIM]
            b_v = tl.load(
                p_v0 + o_tok_k[:, None] * s_vs + o_d[None, :], mask=m_key[:, None], other=0.0
            )
        # -- logits in units of the dot product: the bias enters divided by the scale, so the
        # log2-domain scaling is one fused multiply-add with the row max below ----
        # [Q_TILE, BLOCK_N]
        b_s = tl.dot(b_q, b_kt, input_precision=DOT_PREC)
        b_s = add_column_terms(
            b_s, p_bias, o_slot, m_slot, m_key, bias_to_dot, HAS_BIAS, HAS_LEN or G > 1
        )
        # -- online softmax; a row may have seen only masked keys so far ----
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1) * qk_scale)
        b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_p = tl.math.exp2(b_s * qk_scale - b_m_safe[:, None])
        b_alpha = tl.math.exp2(b_m - b_m_safe)
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PREC)
        b_m = b_m_new

    m_nz = b_l > 0
    b_o = b_acc / tl.where(m_nz, b_l, 1.0)[:, None]
    b_lse = tl.where(
        m_nz, (b_m + tl.math.log2(tl.where(m_nz, b_l, 1.0))) * 0.6931471805599453, float("-inf")
    )
    p_o = O + i_bh.to(tl.int64) * S * HEAD_DIM + o_tok_q[:, None] * HEAD_DIM + o_d[None, :]
    tl.store(p_o, b_o.to(O.dtype.element_ty))
    tl.store(LSE + i_bh.to(tl.int64) * S + o_tok_q, b_lse)


# -- backward, query-major pass: dQ, d(bias), delta -----------------------------------------------


@triton.autotune(
    configs=_fwd_configs(),
    key=["Q_TILE", "KV_BLOCK", "HEAD_DIM"],
    prune_configs_by={"early_config_prune": keep_block_n},
)
@triton.jit
def _bsa_bwd_dq_kernel(
    Q,
    K,
    V,
    DESC_K,
    DESC_V,
    O,
    DO,
    LSE,
    DLSE,
    DELTA,
    DQ,
    DBIAS,
    MASS,
    KV_IDX,
    KV_CNT,
    BIAS,
    KV_LEN,
    s_qb,
    s_qh,
    s_qs,
    s_kb,
    s_kh,
    s_ks,
    s_vb,
    s_vh,
    s_vs,
    s_ob,
    s_oh,
    s_os,
    s_dob,
    s_doh,
    s_dos,
    qk_scale,
    scale,
    H,
    S,
    NQ,
    KMAX,
    Q_TILE: tl.constexpr,
    KV_BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_LEN: tl.constexpr,
    HAS_DLSE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    TMA: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    tl.static_assert(BLOCK_N % KV_BLOCK == 0)
    G: tl.constexpr = BLOCK_N // KV_BLOCK
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // H).to(tl.int64), (i_bh % H).to(tl.int64)
    i_row = i_bh.to(tl.int64) * NQ + i_t

    o_m = tl.arange(0, Q_TILE)
    o_d = tl.arange(0, HEAD_DIM)
    o_tok_q = i_t.to(tl.int64) * Q_TILE + o_m

    # [Q_TILE, HEAD_DIM]
    b_q = tl.load(Q + i_b * s_qb + i_h * s_qh + o_tok_q[:, None] * s_qs + o_d[None, :])
    b_do = tl.load(DO + i_b * s_dob + i_h * s_doh + o_tok_q[:, None] * s_dos + o_d[None, :])
    b_o = tl.load(O + i_b * s_ob + i_h * s_oh + o_tok_q[:, None] * s_os + o_d[None, :])
    # -- delta = rowsum(dO * O) - dLSE: the softmax-backward row constant ----
    # [Q_TILE]
    b_delta = tl.sum(b_do.to(tl.float32) * b_o.to(tl.float32), 1)
    if HAS_DLSE:
        b_delta -= tl.load(DLSE + i_bh.to(tl.int64) * S + o_tok_q)
    tl.store(DELTA + i_bh.to(tl.int64) * S + o_tok_q, b_delta)
    b_lse = tl.load(LSE + i_bh.to(tl.int64) * S + o_tok_q)
    # rows that saw no valid key have lse = -inf and zero probability everywhere
    b_lse2 = tl.where(b_lse == float("-inf"), float("inf"), b_lse * 1.4426950408889634)

    p_k0 = K + i_b * s_kb + i_h * s_kh
    p_v0 = V + i_b * s_vb + i_h * s_vh
    p_idx, p_bias, n_sel = selected_row(KV_IDX, KV_CNT, BIAS, i_row, KMAX)
    p_dbias = DBIAS + i_row * KMAX
    p_mass = MASS + i_row * KMAX
    bias_to_dot = 1.4426950408889634 / qk_scale

    b_dq = tl.zeros([Q_TILE, HEAD_DIM], tl.float32)
    for i_s in range(0, n_sel, G):
        o_slot, m_slot, m_key, o_tok_k = gather_segments(
            p_idx, KV_LEN, i_s, n_sel, BLOCK_N, KV_BLOCK, HAS_LEN
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
        # -- recompute P from the saved lse (logits as in the forward: bias / scale, one FMA) ----
        # [Q_TILE, BLOCK_N]
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)
        b_s = add_column_terms(
            b_s, p_bias, o_slot, m_slot, m_key, bias_to_dot, HAS_BIAS, HAS_LEN or G > 1
        )
        b_p = tl.math.exp2(b_s * qk_scale - b_lse2[:, None])
        # -- dS = P * (dP - delta) ----
        b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PREC)
        b_ds = b_p * (b_dp - b_delta[:, None])
        b_dq += tl.dot(b_ds.to(b_k.dtype), b_k, input_precision=DOT_PREC)
        if HAS_BIAS:
            # d(bias) of a pair: dS summed over the tile's rows and the segment's keys; and the
            # pair's probability mass, which bsa_backward uses to restore the softmax identity
            store_pair_sums(p_dbias, i_s, n_sel, b_ds, G, KV_BLOCK)
            store_pair_sums(p_mass, i_s, n_sel, b_p, G, KV_BLOCK)

    p_dq = DQ + i_bh.to(tl.int64) * S * HEAD_DIM + o_tok_q[:, None] * HEAD_DIM + o_d[None, :]
    tl.store(p_dq, (b_dq * scale).to(DQ.dtype.element_ty))


# -- backward, key-major pass: dK, dV -------------------------------------------------------------


@triton.jit
def _gather_query_rows(
    p_q0, p_do0, DESC_Q, DESC_DO, i_b, i_h, p_lse0, p_delta0, CSR_PAIR, i_p, i_end, s_qs, s_dos,
    NQ, KMAX,
    Q_TILE: tl.constexpr, HEAD_DIM: tl.constexpr, QG: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """Rows of the QG selecting tiles at CSR entries [i_p, i_p + QG): q, dO, lse (log2), delta.
    One tile (QG = 1) comes as TMA copies when ``TMA``."""
    ROWS: tl.constexpr = QG * Q_TILE
    o_r = tl.arange(0, ROWS)
    o_d = tl.arange(0, HEAD_DIM)
    # query row r of the gathered tile is row (r % Q_TILE) of the (r // Q_TILE)-th selecting tile
    o_ent = i_p + o_r // Q_TILE
    m_ent = o_ent < i_end
    # global pair id ((b * H + h) * NQ + t) * KMAX + slot
    b_pair = tl.load(CSR_PAIR + o_ent, mask=m_ent, other=0)
    b_t = (b_pair // KMAX) % NQ
    o_tok_q = b_t.to(tl.int64) * Q_TILE + o_r % Q_TILE
    if TMA and QG == 1:
        # the loop visits entries below i_end only, so the one tile is a real one
        at = [
            i_b.to(tl.int32),
            i_h.to(tl.int32),
            (tl.load(CSR_PAIR + i_p) // KMAX) % NQ * Q_TILE,
            0,
        ]
        b_q = DESC_Q.load(at).reshape(ROWS, HEAD_DIM)
        b_do = DESC_DO.load(at).reshape(ROWS, HEAD_DIM)
    else:
        # [ROWS, HEAD_DIM]
        b_q = tl.load(p_q0 + o_tok_q[:, None] * s_qs + o_d[None, :], mask=m_ent[:, None], other=0.0)
        b_do = tl.load(
            p_do0 + o_tok_q[:, None] * s_dos + o_d[None, :], mask=m_ent[:, None], other=0.0
        )
    # [ROWS]; rows that saw no valid key have lse = -inf and zero probability everywhere
    b_lse = tl.load(p_lse0 + o_tok_q, mask=m_ent, other=float("-inf"))
    b_lse2 = tl.where(b_lse == float("-inf"), float("inf"), b_lse * 1.4426950408889634)
    b_delta = tl.load(p_delta0 + o_tok_q, mask=m_ent, other=0.0)
    return b_pair, m_ent, b_q, b_do, b_lse2, b_delta


@triton.jit
def _dkv_key_major_loop(
    b_k, b_v, m_key, key_partial, p_q0, p_do0, DESC_Q, DESC_DO, i_b, i_h, p_lse0, p_delta0,
    CSR_PAIR, BIAS, i_start, i_end, s_qs, s_dos, qk_scale, NQ, KMAX,
    Q_TILE: tl.constexpr, KV_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr, QG: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """dK, dV of one segment from transposed scores S^T = K Q^T ([KV_BLOCK, ROWS]).

    P^T and dS^T then come out in the layout the dK / dV products consume (the segment's keys
    are the M dimension), which suits kv_block 64.
    """
    b_dk = tl.zeros([KV_BLOCK, HEAD_DIM], tl.float32)
    b_dv = tl.zeros([KV_BLOCK, HEAD_DIM], tl.float32)
    bias_to_dot = 1.4426950408889634 / qk_scale
    for i_p in range(i_start, i_end, QG):
        b_pair, m_ent, b_q, b_do, b_lse2, b_delta = _gather_query_rows(
            p_q0, p_do0, DESC_Q, DESC_DO, i_b, i_h, p_lse0, p_delta0, CSR_PAIR, i_p, i_end,
            s_qs, s_dos, NQ, KMAX, Q_TILE, HEAD_DIM, QG, TMA,
        )  # fmt: skip
        # [KV_BLOCK, ROWS]; logits as in the forward (bias / scale, one FMA)
        b_st = tl.dot(b_k, tl.trans(b_q), input_precision=DOT_PREC)
        if HAS_BIAS:
            b_st += (tl.load(BIAS + b_pair, mask=m_ent, other=0.0) * bias_to_dot)[None, :]
        # rows past the list end have lse2 = +inf, so P is 0 there without a select
        b_pt = tl.math.exp2(b_st * qk_scale - b_lse2[None, :])
        if key_partial:
            b_pt = tl.where(m_key[:, None], b_pt, 0.0)
        b_dv += tl.dot(b_pt.to(b_do.dtype), b_do, input_precision=DOT_PREC)
        b_dpt = tl.dot(b_v, tl.trans(b_do), input_precision=DOT_PREC)
        b_dst = b_pt * (b_dpt - b_delta[None, :])
        b_dk += tl.dot(b_dst.to(b_q.dtype), b_q, input_precision=DOT_PREC)
    return b_dk, b_dv


@triton.jit
def _dkv_dim_major_loop(
    b_k, b_v, m_key, key_partial, p_q0, p_do0, DESC_Q, DESC_DO, i_b, i_h, p_lse0, p_delta0,
    CSR_PAIR, BIAS, i_start, i_end, s_qs, s_dos, qk_scale, NQ, KMAX,
    Q_TILE: tl.constexpr, KV_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr, QG: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """dK, dV of one segment accumulated transposed: dK^T = Q^T dS ([HEAD_DIM, KV_BLOCK]).

    With 16- or 32-key segments, key-major products would have M = kv_block, too thin for the
    Hopper tensor-core instructions (M >= 64); here every product has M = ROWS or HEAD_DIM.
    """
    b_dkt = tl.zeros([HEAD_DIM, KV_BLOCK], tl.float32)
    b_dvt = tl.zeros([HEAD_DIM, KV_BLOCK], tl.float32)
    bias_to_dot = 1.4426950408889634 / qk_scale
    for i_p in range(i_start, i_end, QG):
        b_pair, m_ent, b_q, b_do, b_lse2, b_delta = _gather_query_rows(
            p_q0, p_do0, DESC_Q, DESC_DO, i_b, i_h, p_lse0, p_delta0, CSR_PAIR, i_p, i_end,
            s_qs, s_dos, NQ, KMAX, Q_TILE, HEAD_DIM, QG, TMA,
        )  # fmt: skip
        # [ROWS, KV_BLOCK]; logits as in the forward (bias / scale, one FMA)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)
        if HAS_BIAS:
            b_s += (tl.load(BIAS + b_pair, mask=m_ent, other=0.0) * bias_to_dot)[:, None]
        # rows past the list end have lse2 = +inf, so P is 0 there without a select
        b_p = tl.math.exp2(b_s * qk_scale - b_lse2[:, None])
        if key_partial:
            b_p = tl.where(m_key[None, :], b_p, 0.0)
        b_dvt += tl.dot(tl.trans(b_do), b_p.to(b_do.dtype), input_precision=DOT_PREC)
        b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PREC)
        b_ds = b_p * (b_dp - b_delta[:, None])
        b_dkt += tl.dot(tl.trans(b_q), b_ds.to(b_q.dtype), input_precision=DOT_PREC)
    return tl.trans(b_dkt), tl.trans(b_dvt)


@triton.autotune(
    configs=_dkv_configs(),
    key=["Q_TILE", "KV_BLOCK", "HEAD_DIM"],
    prune_configs_by={"early_config_prune": _keep_qg},
)
@triton.jit
def _bsa_bwd_dkv_kernel(
    Q,
    K,
    V,
    DO,
    DESC_Q,
    DESC_DO,
    LSE,
    DELTA,
    DK,
    DV,
    CSR_OFF,
    CSR_PAIR,
    BIAS,
    KV_LEN,
    s_qb,
    s_qh,
    s_qs,
    s_kb,
    s_kh,
    s_ks,
    s_vb,
    s_vh,
    s_vs,
    s_dob,
    s_doh,
    s_dos,
    qk_scale,
    scale,
    H,
    S,
    NQ,
    NSEG,
    KMAX,
    Q_TILE: tl.constexpr,
    KV_BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_LEN: tl.constexpr,
    DOT_PREC: tl.constexpr,
    DIM_MAJOR: tl.constexpr,
    TMA: tl.constexpr,
    QG: tl.constexpr,
):
    i_seg, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // H).to(tl.int64), (i_bh % H).to(tl.int64)

    o_w = tl.arange(0, KV_BLOCK)
    o_d = tl.arange(0, HEAD_DIM)
    o_tok_k = i_seg.to(tl.int64) * KV_BLOCK + o_w

    m_key = o_w < KV_BLOCK
    key_partial = i_seg < 0  # a run-time False
    if HAS_LEN:
        n_key = tl.load(KV_LEN + i_seg)
        m_key = o_w < n_key
        key_partial = n_key < KV_BLOCK
    # [KV_BLOCK, HEAD_DIM]
    b_k = tl.load(
        K + i_b * s_kb + i_h * s_kh + o_tok_k[:, None] * s_ks + o_d[None, :],
        mask=m_key[:, None],
        other=0.0,
    )
    b_v = tl.load(
        V + i_b * s_vb + i_h * s_vh + o_tok_k[:, None] * s_vs + o_d[None, :],
        mask=m_key[:, None],
        other=0.0,
    )

    p_q0 = Q + i_b * s_qb + i_h * s_qh
    p_do0 = DO + i_b * s_dob + i_h * s_doh
    p_lse0 = LSE + i_bh.to(tl.int64) * S
    p_delta0 = DELTA + i_bh.to(tl.int64) * S
    i_csr = i_bh.to(tl.int64) * NSEG + i_seg
    i_start = tl.load(CSR_OFF + i_csr)
    i_end = tl.load(CSR_OFF + i_csr + 1)

    if DIM_MAJOR:
        b_dk, b_dv = _dkv_dim_major_loop(
            b_k, b_v, m_key, key_partial, p_q0, p_do0, DESC_Q, DESC_DO, i_b, i_h, p_lse0,
            p_delta0, CSR_PAIR, BIAS, i_start, i_end, s_qs, s_dos, qk_scale, NQ, KMAX,
            Q_TILE, KV_BLOCK, HEAD_DIM, HAS_BIAS, DOT_PREC, QG, TMA,
        )  # fmt: skip
    else:
        b_dk, b_dv = _dkv_key_major_loop(
            b_k, b_v, m_key, key_partial, p_q0, p_do0, DESC_Q, DESC_DO, i_b, i_h, p_lse0,
            p_delta0, CSR_PAIR, BIAS, i_start, i_end, s_qs, s_dos, qk_scale, NQ, KMAX,
            Q_TILE, KV_BLOCK, HEAD_DIM, HAS_BIAS, DOT_PREC, QG, TMA,
        )  # fmt: skip

    o_out = i_bh.to(tl.int64) * S * HEAD_DIM + o_tok_k[:, None] * HEAD_DIM + o_d[None, :]
    tl.store(DK + o_out, (b_dk * scale).to(DK.dtype.element_ty))
    tl.store(DV + o_out, b_dv.to(DV.dtype.element_ty))


# -- launchers ------------------------------------------------------------------------------------


def _bhs_strides(x: torch.Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs get exact float32 products (tf32 costs ~3 significant digits) unless
    # torch's matmuls may use TF32 (model.allow_tf32)
    exact = dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    return "ieee" if exact else "tf32"


def build_kv_major_index(
    kv_indices: torch.Tensor, kv_counts: torch.Tensor, num_segments: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Transpose the query-major selection into a kv-major CSR index, on the device, no sync.

    Returns ``(offsets, pairs)``: ``offsets`` int32 [B*H*num_segments + 1]; for segment ``s`` of
    head ``bh`` the selecting pairs are ``pairs[offsets[i]:offsets[i + 1]]`` with
    ``i = bh * num_segments + s``, each the flat index ``((bh * NQ) + t) * KMAX + slot`` into
    ``kv_indices``. ``pairs`` has the fixed size B*H*NQ*KMAX (unused entries sort to the end).
    A stable sort keeps the pairs of a segment in ascending query-tile order, so the backward is
    deterministic.
    """
    B, H, _, KMAX = kv_indices.shape
    device = kv_indices.device
    o_slot = torch.arange(KMAX, device=device, dtype=torch.int32)
    m_valid = o_slot < kv_counts.unsqueeze(-1)
    o_bh = torch.arange(B * H, device=device, dtype=torch.int32).view(B, H, 1, 1)
    sentinel = B * H * num_segments
    # [B, H, NQ, KMAX]: sort key = global segment id, unused slots after every real one
    b_key = torch.where(m_valid, o_bh * num_segments + kv_indices.to(torch.int32), sentinel)
    b_key_sorted, b_order = torch.sort(b_key.flatten(), stable=True)
    o_seg = torch.arange(sentinel + 1, device=device, dtype=torch.int32)
    offsets = torch.searchsorted(b_key_sorted, o_seg, out_int32=True)
    return offsets, b_order.to(torch.int32)


def _restore_softmax_identity(
    dbias: torch.Tensor,
    mass: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    q_tile: int,
) -> torch.Tensor:
    """Make each query tile's d(bias) sum to what the softmax gradient makes it sum to.

    For every query row, sum_j dS_ij = dLSE_i exactly (sum_j P_ij = 1), so the d(bias) of a
    tile's pairs add up to the tile's sum of dLSE. With 16-bit inputs the kernel's delta comes
    from the rounded output O and the rounded P of the forward's PV product, which breaks this
    by ~1% of |d(bias)| per tile. Harmless for dQ / dK, but d(alpha) = sum d(bias) * log p
    multiplies the broken sum by the mean log-probability (about -ln(NSEG)), which would swamp
    it at bf16. The excess is taken back from the tile's pairs in proportion to their
    probability mass, which is how it arose if the per-row error is even across the tile's
    rows. Float32 inputs change in the last bits only.
    """
    B, H, NQ, _ = dbias.shape
    target = torch.zeros((B, H, NQ), device=dbias.device)
    if dlse is not None:
        # rows that saw no valid key have lse = -inf and no d(bias) of their own
        valid = torch.where(torch.isfinite(lse), dlse.float(), 0.0)
        target = valid.view(B, H, NQ, q_tile).sum(-1)
    dbias32 = dbias.float()
    excess = dbias32.sum(-1) - target
    total = mass.sum(-1, keepdim=True)
    share = torch.where(total > 0, mass / total.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    return (dbias32 - excess[..., None] * share).to(dbias.dtype)


def _tma_descriptors(rows: int, *tensors: torch.Tensor) -> tuple[tuple, bool]:
    """``[1, 1, rows, D]`` TMA descriptors of ``[B, H, S, D]`` tensors and True; or the tensors
    themselves and False where TMA does not apply (a GPU older than Hopper, a stride or the base
    address not a multiple of 16 bytes): the kernels then gather rows by pointers."""
    x = tensors[0]
    usable = interpreting() or (x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9)
    usable = usable and all(
        t.data_ptr() % 16 == 0 and all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1])
        for t in tensors
    )
    if not usable:
        return tensors, False
    return tuple(
        TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, t.shape[-1]])
        for t in tensors
    ), True


def _dummy(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(1, device=device, dtype=dtype)


@functools.cache
def _gluon_available() -> bool:
    """Whether this Triton has the Gluon Hopper API the kernels of ``block_sparse_gluon`` are
    written against: 3.6 or newer (3.6 runs them on the GPU tests, 3.8 compiles them in CI);
    older versions keep the Triton kernels."""
    version = re.match(r"(\d+)\.(\d+)", triton.__version__)
    if version is None or (int(version[1]), int(version[2])) < (3, 6):
        return False
    try:
        importlib.import_module(f"{__package__}.block_sparse_gluon")
    except ImportError:
        return False
    return True


def _gluon_wanted(q_tile: int, kv_block: int, *tensors: torch.Tensor) -> bool:
    """Whether the Hopper Gluon kernels of ``block_sparse_gluon`` take the call: q_tile = 64,
    bf16/fp16, D in {64, 128}, an sm_90 GPU, tensors with 16-byte aligned bases and strides
    that are multiples of 16 elements (TMA boxes), a Triton with the Gluon API; ``VSA2_RL_GLUON=0`` keeps the Triton kernels (A/B runs)."""
    x = tensors[0]
    return (
        os.environ.get("VSA2_RL_GLUON", "1") != "0"
        and x.is_cuda
        and torch.cuda.get_device_capability(x.device)[0] == 9
        and q_tile == 64
        and kv_block in (16, 32, 64)
        and x.shape[-1] in (64, 128)
        and x.dtype in (torch.bfloat16, torch.float16)
        and all(
            t.stride(-1) == 1
            and t.data_ptr() % 16 == 0
            and all(st % 16 == 0 for st in t.stride()[:-1])
            for t in tensors
        )
        and _gluon_available()
    )


def bsa_forward(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel (Gluon where ``_gluon_wanted``, else Triton); returns
    (out [B,H,S,D] in q's dtype, lse float32 [B,H,S])."""
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    B, H, S, D = q.shape
    NQ, KMAX = kv_indices.shape[2], kv_indices.shape[3]
    out = torch.empty((B, H, S, D), device=q.device, dtype=q.dtype)
    lse = torch.empty((B, H, S), device=q.device, dtype=torch.float32)
    kv_indices = kv_indices.contiguous()
    kv_counts = kv_counts.contiguous()
    bias = block_bias.contiguous() if block_bias is not None else _dummy(q.device, torch.float32)
    lens = kv_lengths.contiguous() if kv_lengths is not None else _dummy(q.device, torch.int32)
    if _gluon_wanted(q_tile, kv_block, q, k, v):
        from .block_sparse_gluon import bsa_forward_gluon

        bsa_forward_gluon(
            q, k, v, kv_indices, kv_counts, bias, lens, out, lse, kv_block=kv_block,
            qk_scale=scale * LOG2E, has_bias=block_bias is not None,
            has_len=kv_lengths is not None,
        )  # fmt: skip
        return out, lse
    (desc_k, desc_v), tma = _tma_descriptors(kv_block, k, v)
    _bsa_fwd_kernel[(NQ, B * H)](
        q, k, v, desc_k, desc_v, out, lse,
        kv_indices, kv_counts, bias, lens,
        *_bhs_strides(q), *_bhs_strides(k), *_bhs_strides(v),
        scale * LOG2E,
        H=H, S=S, NQ=NQ, KMAX=KMAX,
        Q_TILE=q_tile, KV_BLOCK=kv_block, HEAD_DIM=D,
        HAS_BIAS=block_bias is not None, HAS_LEN=kv_lengths is not None,
        DOT_PREC=_dot_precision(q.dtype), TMA=tma,
    )  # fmt: skip
    return out, lse


def _dq_pass_outputs(
    q: torch.Tensor, bias: torch.Tensor, has_bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The buffers ``_dq_pass`` writes: (dq like q, delta float32 [B,H,S], raw d(bias), pair
    mass); the last two zero-filled (slots past a row's count are never visited and keep their
    zero gradient), or 1-element placeholders without a bias."""
    B, H, S, D = q.shape
    dq = torch.empty((B, H, S, D), device=q.device, dtype=q.dtype)
    delta = torch.empty((B, H, S), device=q.device, dtype=torch.float32)
    if not has_bias:
        return dq, delta, _dummy(q.device, torch.float32), _dummy(q.device, torch.float32)
    return dq, delta, torch.zeros_like(bias), torch.zeros(bias.shape, device=q.device)


def _dq_pass(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    bias: torch.Tensor,
    lens: torch.Tensor,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    q_tile: int,
    kv_block: int,
    scale: float,
    has_bias: bool,
    has_len: bool,
    has_dlse: bool,
) -> None:
    """The dQ / d(bias) pass of ``bsa_backward`` on its prepared arguments (placeholders where a
    flag is False), writing ``grads`` = (dq, delta, raw d(bias), pair mass): the Gluon kernel
    where ``_gluon_wanted``, else Triton."""
    B, H, S, D = q.shape
    NQ, KMAX = kv_indices.shape[2], kv_indices.shape[3]
    dq, delta, dbias, mass = grads
    if _gluon_wanted(q_tile, kv_block, q, k, v, dout):
        from .block_sparse_gluon import bsa_backward_dq_gluon

        bsa_backward_dq_gluon(
            dout, q, k, v, out, lse, dlse, kv_indices, kv_counts, bias, lens, grads,
            scale=scale, qk_scale=scale * LOG2E, has_bias=has_bias, has_len=has_len,
            has_dlse=has_dlse, kv_block=kv_block,
        )  # fmt: skip
        return
    (desc_k, desc_v), tma = _tma_descriptors(kv_block, k, v)
    _bsa_bwd_dq_kernel[(NQ, B * H)](
        q, k, v, desc_k, desc_v, out, dout, lse, dlse, delta, dq, dbias, mass,
        kv_indices, kv_counts, bias, lens,
        *_bhs_strides(q), *_bhs_strides(k), *_bhs_strides(v), *_bhs_strides(out),
        *_bhs_strides(dout), scale * LOG2E, scale,
        H=H, S=S, NQ=NQ, KMAX=KMAX,
        Q_TILE=q_tile, KV_BLOCK=kv_block, HEAD_DIM=D,
        HAS_BIAS=has_bias, HAS_LEN=has_len, HAS_DLSE=has_dlse,
        DOT_PREC=_dot_precision(q.dtype), TMA=tma,
    )  # fmt: skip


BWD_PATHS = ("two_pass", "fused")


def _two_pass_dkv(
    dout, q, k, v, lse, delta, kv_indices, kv_counts, bias, lens, *,
    q_tile: int, kv_block: int, scale: float, has_bias: bool, has_len: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The key-major dK/dV pass of the two-pass backward: build the kv-major index, launch."""
    B, H, S, D = q.shape
    NQ, KMAX = kv_indices.shape[2], kv_indices.shape[3]
    NSEG = S // kv_block
    dk = torch.empty((B, H, S, D), device=q.device, dtype=k.dtype)
    dv = torch.empty((B, H, S, D), device=q.device, dtype=v.dtype)
    offsets, pairs = build_kv_major_index(kv_indices, kv_counts, NSEG)
    (desc_q, desc_do), tma = _tma_descriptors(q_tile, q, dout)
    _bsa_bwd_dkv_kernel[(NSEG, B * H)](
        q, k, v, dout, desc_q, desc_do, lse, delta, dk, dv,
        offsets, pairs, bias, lens,
        *_bhs_strides(q), *_bhs_strides(k), *_bhs_strides(v), *_bhs_strides(dout),
        scale * LOG2E, scale,
        H=H, S=S, NQ=NQ, NSEG=NSEG, KMAX=KMAX,
        Q_TILE=q_tile, KV_BLOCK=kv_block, HEAD_DIM=D,
        HAS_BIAS=has_bias, HAS_LEN=has_len, DOT_PREC=_dot_precision(q.dtype),
        DIM_MAJOR=kv_block < 64, TMA=tma,
    )  # fmt: skip
    return dk, dv


def bsa_backward(
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients (dq, dk, dv, d(bias) or None) by one of ``BWD_PATHS``: ``"two_pass"`` (the dQ /
    d(bias) pass, then the key-major dK/dV pass; deterministic) or ``"fused"`` (one query-major
    pass adding dK/dV atomically, :mod:`.block_sparse_fused`; faster at kv_block 16, not
    bit-reproducible)."""
    if bwd not in BWD_PATHS:
        raise ValueError(f"bwd must be one of {BWD_PATHS}, got {bwd!r}")
    q, k, v, out, dout = (_last_dim_contiguous(x) for x in (q, k, v, out, dout))
    device = q.device
    kv_indices = kv_indices.contiguous()
    kv_counts = kv_counts.contiguous()
    lse = lse.contiguous()
    has_bias = block_bias is not None
    bias = block_bias.contiguous() if has_bias else _dummy(device, torch.float32)
    lens = kv_lengths.contiguous() if kv_lengths is not None else _dummy(device, torch.int32)
    dlse_arg = dlse.contiguous() if dlse is not None else _dummy(device, torch.float32)
    flags = dict(has_bias=has_bias, has_len=kv_lengths is not None, has_dlse=dlse is not None)

    if bwd == "fused":
        from .block_sparse_fused import bsa_backward_fused

        descs, tma = _tma_descriptors(kv_block, k, v)
        dq, dk, dv, dbias, mass = bsa_backward_fused(
            dout, dlse_arg, q, k, v, out, lse, kv_indices, kv_counts, bias, lens, descs,
            q_tile=q_tile, kv_block=kv_block, scale=scale, dot_prec=_dot_precision(q.dtype),
            tma=tma, **flags,
        )  # fmt: skip
    else:
        dq, delta, dbias, mass = _dq_pass_outputs(q, bias, has_bias)
        _dq_pass(
            dout, q, k, v, out, lse, dlse_arg, kv_indices, kv_counts, bias, lens,
            (dq, delta, dbias, mass), q_tile=q_tile, kv_block=kv_block, scale=scale, **flags,
        )  # fmt: skip
        dk, dv = _two_pass_dkv(
            dout, q, k, v, lse, delta, kv_indices, kv_counts, bias, lens, q_tile=q_tile,
            kv_block=kv_block, scale=scale, has_bias=has_bias, has_len=flags["has_len"],
        )  # fmt: skip
    if has_bias:
        dbias = _restore_softmax_identity(dbias, mass, lse, dlse, q_tile)
    return dq, dk, dv, (dbias if has_bias else None)
