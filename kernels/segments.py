"""Helpers shared by the block-sparse kernels of the VSA2 fine stage: reading a query tile's
selection (its segment ids, pair biases and count), gathering ``BLOCK_N // kv_block`` selected
key segments into one key tile (pointer gather or TMA copies), the per-key logit terms (pair
bias, -inf past a row's list or a segment's length), the per-pair sums of the backward, and the
autotune pruning and interpreter test they share.

:mod:`.block_sparse` (forward, two-pass backward), :mod:`.block_sparse_fused` (single-pass
backward) and :mod:`.block_sparse_gluon` (Hopper Gluon forward and dQ pass) import them from
here; this module imports none of them.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def keep_block_n(configs, named_args, **kwargs):
    kv_block = kwargs["KV_BLOCK"]
    return [c for c in configs if c.kwargs["BLOCK_N"] >= kv_block]


@triton.jit
def add_column_terms(
    b_s, p_bias, o_slot, m_slot, m_key, bias_to_dot,
    HAS_BIAS: tl.constexpr, MAY_MASK: tl.constexpr,
):  # fmt: skip
    """Add the per-key terms to raw logits ``q . k``: the pair bias divided by the scale and
    -inf at keys past a row's list or a segment's valid length. Both live in one [BLOCK_N]
    vector, so the key mask costs no per-element select."""
    if HAS_BIAS or MAY_MASK:
        b_col = tl.zeros(m_key.shape, tl.float32)
        if HAS_BIAS:
            b_col = tl.load(p_bias + o_slot, mask=m_slot, other=0.0).to(tl.float32) * bias_to_dot
        if MAY_MASK:
            b_col = tl.where(m_key, b_col, float("-inf"))
        b_s += b_col[None, :]
    return b_s


@triton.jit
def selected_row(KV_IDX, KV_CNT, BIAS, i_row, KMAX):
    """A query tile's selection: pointers to its segment ids and pair biases (KMAX slots) and
    its count of used slots."""
    return KV_IDX + i_row * KMAX, BIAS + i_row * KMAX, tl.load(KV_CNT + i_row)


@triton.jit
def gather_segments(
    p_idx, KV_LEN, i_s, n_sel,
    BLOCK_N: tl.constexpr, KV_BLOCK: tl.constexpr, HAS_LEN: tl.constexpr,
):  # fmt: skip
    """The BLOCK_N-key tile of the ``BLOCK_N // KV_BLOCK`` segments at slots ``i_s ..`` of a row's
    list: key row n is key (n % KV_BLOCK) of the (n // KV_BLOCK)-th of them. Returns each key
    row's slot, whether the slot is used, whether the key is valid (used slot, and within the
    segment's length when ``HAS_LEN``) and its token index (int64)."""
    o_n = tl.arange(0, BLOCK_N)
    o_w = o_n % KV_BLOCK
    o_slot = i_s + o_n // KV_BLOCK
    m_slot = o_slot < n_sel
    b_seg = tl.load(p_idx + o_slot, mask=m_slot, other=0)
    m_key = m_slot
    if HAS_LEN:
        b_len = tl.load(KV_LEN + b_seg, mask=m_slot, other=0)
        m_key = m_key & (o_w < b_len)
    return o_slot, m_slot, m_key, b_seg.to(tl.int64) * KV_BLOCK + o_w


@triton.jit
def load_segment_tma(
    DESC_K, DESC_V, i_b, i_h, p_seg, KV_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr
):
    """K and V rows [KV_BLOCK, HEAD_DIM] of the segment whose id is at ``p_seg``, as TMA copies
    (Hopper's tensor memory accelerator: no per-element addresses in registers). Keys past a
    partial segment's length are loaded too; the caller's -inf column bias gives them weight 0."""
    at = [i_b.to(tl.int32), i_h.to(tl.int32), tl.load(p_seg) * KV_BLOCK, 0]
    b_k = DESC_K.load(at).reshape(KV_BLOCK, HEAD_DIM)
    b_v = DESC_V.load(at).reshape(KV_BLOCK, HEAD_DIM)
    return b_k, b_v


@triton.jit
def store_pair_sums(p_out, i_s, n_sel, b_x, G: tl.constexpr, KV_BLOCK: tl.constexpr):
    """Store the sums of ``b_x`` [Q_TILE, BLOCK_N] over each gathered pair's block (the tile's
    rows x the segment's keys) at slots ``i_s .. i_s + G`` of the row's list."""
    if G == 1:
        # row sums first: in-warp reductions, then one across the rows
        tl.store(p_out + i_s, tl.sum(tl.sum(b_x, 1), 0).to(p_out.dtype.element_ty))
    else:
        o_gs = tl.arange(0, G)
        b_sum = tl.sum(tl.reshape(tl.sum(b_x, 0), [G, KV_BLOCK]), 1)
        tl.store(p_out + i_s + o_gs, b_sum.to(p_out.dtype.element_ty), mask=(i_s + o_gs) < n_sel)
