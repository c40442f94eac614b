"""Hopper (sm_90) Gluon kernels of the VSA2 fine stage (q_tile 64): the forward and the dQ pass
of the backward for kv_block 16, 32 and 64, with the FlashAttention-3 overlap of softmax and
tensor-core work. ``block_sparse.bsa_forward`` / ``bsa_backward`` route to them when
``_gluon_wanted`` says so; the dK/dV pass is always the Triton one.

Triton's ``tl`` cannot express the overlap (its compiler waits for every QK^T wgmma at once,
and its automatic warp specialisation rejects the loop), so these kernels issue and wait
for the wgmma groups themselves (``warpgroup_mma`` / ``warpgroup_mma_wait``) and stream the
keys and values into two rings of shared-memory stages guarded by mbarriers, each stage
refilled as soon as the product reading it has completed. A stage holds a group of 64 keys:
one segment at kv_block 64, 64 // kv_block consecutive slots at 16 and 32, each slot copied by
TMA into its rows of the stage. The slots' bias and validity enter per column, from per-slot
values loaded a group ahead. Keys and values past a partial segment's length (and the rows of slots past the count,
which read segment 0) are copied too, as the Triton TMA path does: their logits are -inf, so
they take no weight as long as they are finite (the DiT's tile layout pads with zeros).
Forward, per group j of a query tile (one warpgroup, 64 rows):

1. softmax of the logits S_j (in registers) while O += P_{j-1} V_{j-1} is still running;
2. wait for that product, rescale O, refill its V stage;
3. issue S_{j+1} = Q K_{j+1}^T, then O += P_j V_j; wait for S_{j+1} only, refill its K stage.

The dQ pass does the same with S and dP = dO V^T in step 3 and dQ += dS K in place of the P V
product. Same contracts as ``block_sparse._bsa_fwd_kernel`` and ``_bsa_bwd_dq_kernel`` for
D in {64, 128}, bf16/fp16, [B, H, S, D] tensors with 16-byte aligned strides (4-D TMA
descriptors: the transposed views a DiT passes need no copy). No
interpreter for Gluon: GPU tests compare them with a float64 reference, and a CPU test
compiles them for sm_90 and checks the overlap, the copy paths and the register budget.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .segments import selected_row

BLOCK = 64  # query rows per tile = keys per segment


@gluon.constexpr_function
def _mma_layout(n):
    """Register layout of a ``[64, n]`` wgmma accumulator over one warpgroup."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.jit
def _kv_rings(k_desc, v_desc, K_STAGES: gl.constexpr, V_STAGES: gl.constexpr,
              HEAD_DIM: gl.constexpr):  # fmt: skip
    """The K and V rings of ``[1, 1, 64, D]`` stages, each with an mbarrier whose phase
    the stage's TMA copies complete (one arrival with the expected byte count)."""
    k_ring = gl.allocate_shared_memory(k_desc.dtype, [K_STAGES, 1, 1, 64, HEAD_DIM], k_desc.layout)
    v_ring = gl.allocate_shared_memory(v_desc.dtype, [V_STAGES, 1, 1, 64, HEAD_DIM], v_desc.layout)
    k_bars = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(K_STAGES):
        mbarrier.init(k_bars.index(s), count=1)
    for s in gl.static_range(V_STAGES):
        mbarrier.init(v_bars.index(s), count=1)
    return k_ring, v_ring, k_bars, v_bars


@gluon.jit
def _segment(p_idx, i_slot, n_sel):
    """The segment id in slot ``i_slot`` of a row (0 past the row's count). The loops load these
    (and the slots' bias and length) an iteration before they need them: nothing pipelines the
    scalar loads of a Gluon loop, and a load waited for at once stalls the warpgroup."""
    return gl.load(p_idx + i_slot, mask=i_slot < n_sel, other=0)


@gluon.jit
def _issue_load(desc, ring, bars, seg, i_b, i_h, i_slot, n_sel, STAGES: gl.constexpr):
    """TMA copy of the rows of segment ``seg``, in the row's slot ``i_slot``, into its stage
    ``i_slot % STAGES`` of ``ring`` (no copy past the row's count); the stage's barrier tracks
    it, with phase ``(i_slot // STAGES) & 1``."""
    pred = i_slot < n_sel
    bar = bars.index(i_slot % STAGES)
    mbarrier.expect(bar, desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(
        desc, [i_b, i_h, seg * desc.block_type.shape[2], 0], bar, ring.index(i_slot % STAGES),
        pred=pred,
    )  # fmt: skip


@gluon.constexpr_function
def _slots_layout(n):
    """Layout of one value per slot of a group (segment ids, biases, lengths; ``n`` slots), each
    thread holding all of them: picking one is a select within the thread, no shuffle."""
    return gl.BlockedLayout([n], [32], [4], [0])


@gluon.jit
def _group_segments(p_idx, i_grp, n_sel, KV_BLOCK: gl.constexpr):
    """What ``_copy_group`` needs of group ``i_grp``'s segment ids (0 past the row's count),
    loaded a group ahead by the loops (see ``_segment``): the scalar id of its one slot at
    kv_block 64; else the vector of its 64 // KV_BLOCK slots' ids."""
    if KV_BLOCK == 64:
        return _segment(p_idx, i_grp, n_sel)
    else:
        G: gl.constexpr = 64 // KV_BLOCK
        slot = i_grp * G + gl.arange(0, G, layout=_slots_layout(G))
        return gl.load(p_idx + slot, mask=slot < n_sel, other=0)


@gluon.jit
def _copy_group(desc, ring, bars, segs, i_b, i_h, i_grp, n_sel, STAGES: gl.constexpr,
                KV_BLOCK: gl.constexpr):  # fmt: skip
    """TMA copies of group ``i_grp`` of a row's keys (or values) into stage ``i_grp % STAGES``,
    ``segs`` from ``_group_segments``: the one segment at kv_block 64; else one
    ``[1, 1, KV_BLOCK, D]`` copy per slot into its rows of the stage, all on the stage's barrier
    (a slot past the count copies segment 0: its columns are masked). Nothing is copied for a
    group past the count."""
    if KV_BLOCK == 64:
        _issue_load(desc, ring, bars, segs, i_b, i_h, i_grp, n_sel, STAGES)
    else:
        G: gl.constexpr = 64 // KV_BLOCK
        pred = i_grp * G < n_sel
        bar = bars.index(i_grp % STAGES)
        stage = ring.index(i_grp % STAGES)
        mbarrier.expect(bar, G * desc.block_type.nbytes, pred=pred)
        o_g = gl.arange(0, G, layout=_slots_layout(G))
        for g in gl.static_range(G):
            seg = gl.sum(gl.where(o_g == g, segs, 0), 0)
            tma.async_copy_global_to_shared(
                desc, [i_b, i_h, seg * KV_BLOCK, 0], bar,
                stage.slice(g * KV_BLOCK, KV_BLOCK, dim=2), pred=pred,
            )  # fmt: skip


@gluon.jit
def _fill_ring(desc, ring, bars, p_idx, i_b, i_h, n_sel, STAGES: gl.constexpr,
               KV_BLOCK: gl.constexpr):  # fmt: skip
    """Start the copies of a row's first ``STAGES`` groups, one into each stage of ``ring``."""
    for s in gl.static_range(STAGES):
        segs = _group_segments(p_idx, s, n_sel, KV_BLOCK)
        _copy_group(desc, ring, bars, segs, i_b, i_h, s, n_sel, STAGES, KV_BLOCK)


@gluon.jit
def _invalidate_rings(k_bars, v_bars, K_STAGES: gl.constexpr, V_STAGES: gl.constexpr):
    """Invalidate the barriers of the rings of ``_kv_rings``."""
    for s in gl.static_range(K_STAGES):
        mbarrier.invalidate(k_bars.index(s))
    for s in gl.static_range(V_STAGES):
        mbarrier.invalidate(v_bars.index(s))


@gluon.jit
def _group_columns(p_idx, p_bias, KV_LEN, i_grp, n_sel, KV_BLOCK: gl.constexpr,
                   HAS_BIAS: gl.constexpr, HAS_LEN: gl.constexpr):  # fmt: skip
    """kv_block < 64: the bias (0 without one) and the number of valid keys (0 past the row's
    count) of each of group ``i_grp``'s 64 // KV_BLOCK slots, two small vectors that every
    thread holds whole (carried across the loop in 2 * 64 // KV_BLOCK registers, not the 16 of
    a per-column vector); ``_column_terms`` spreads them over the columns."""
    G: gl.constexpr = 64 // KV_BLOCK
    slot = i_grp * G + gl.arange(0, G, layout=_slots_layout(G))
    valid = slot < n_sel
    bias = slot.to(gl.float32) * 0.0
    if HAS_BIAS:
        bias = gl.load(p_bias + slot, mask=valid, other=0.0).to(gl.float32)
    n_key = gl.where(valid, KV_BLOCK, 0)
    if HAS_LEN:
        seg = gl.load(p_idx + slot, mask=valid, other=0)
        n_key = gl.load(KV_LEN + seg, mask=valid, other=0)
    return bias, n_key


@gluon.jit
def _column_terms(cols, o_col, KV_BLOCK: gl.constexpr):
    """Per column of a group: its slot's bias, or -inf where the key is not valid, from the
    per-slot values ``cols`` of ``_group_columns``."""
    G: gl.constexpr = 64 // KV_BLOCK
    bias, n_key = cols
    o_g = gl.arange(0, G, layout=_slots_layout(G))
    terms = gl.full(o_col.shape, float("-inf"), gl.float32, layout=o_col.type.layout)
    for g in gl.static_range(G):
        slot_bias = gl.sum(gl.where(o_g == g, bias, 0.0), 0)
        slot_keys = gl.sum(gl.where(o_g == g, n_key, 0), 0)
        valid = (o_col // KV_BLOCK == g) & (o_col % KV_BLOCK < slot_keys)
        terms = gl.where(valid, slot_bias, terms)
    return terms


@gluon.jit
def _first_columns(p_idx, p_bias, KV_LEN, n_sel, KV_BLOCK: gl.constexpr,
                   HAS_BIAS: gl.constexpr, HAS_LEN: gl.constexpr):  # fmt: skip
    """The column terms of group 0 for ``_masked_logits``."""
    if KV_BLOCK == 64:
        bias = gl.load(p_bias, mask=n_sel > 0, other=0.0).to(gl.float32) if HAS_BIAS else 0.0
        n_key = gl.load(KV_LEN + _segment(p_idx, 0, n_sel)) if HAS_LEN else 64
        return bias, n_key, _segment(p_idx, 1, n_sel)
    else:
        return _group_columns(p_idx, p_bias, KV_LEN, 0, n_sel, KV_BLOCK, HAS_BIAS, HAS_LEN)


@gluon.jit
def _masked_logits(s_raw, cols, p_idx, p_bias, KV_LEN, j, n_sel, o_col, bias_to_dot,
                   KV_BLOCK: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_LEN: gl.constexpr):  # fmt: skip
    """S_j plus its slots' bias (in dot units), -inf at invalid keys, from the column terms
    ``cols`` of group j loaded an iteration earlier; returns it and group j + 1's terms. At
    kv_block 64 ``cols`` = (bias, length, segment of slot j + 1), scalars: the next length
    needs no dependent load; else per-slot vectors (``_group_columns``)."""
    b_s = s_raw
    if KV_BLOCK == 64:
        bias, n_key, seg_ahead = cols
        if HAS_BIAS:
            b_s = b_s + bias * bias_to_dot
            bias = gl.load(p_bias + j + 1, mask=j + 1 < n_sel, other=0.0).to(gl.float32)
        if HAS_LEN:
            b_s = gl.where(gl.expand_dims(o_col < n_key, 0), b_s, float("-inf"))
            n_key = gl.load(KV_LEN + seg_ahead)
            seg_ahead = _segment(p_idx, j + 2, n_sel)
        return b_s, (bias, n_key, seg_ahead)
    else:
        b_s = b_s + gl.expand_dims(_column_terms(cols, o_col, KV_BLOCK) * bias_to_dot, 0)
        return b_s, _group_columns(p_idx, p_bias, KV_LEN, j + 1, n_sel, KV_BLOCK, HAS_BIAS, HAS_LEN)


@gluon.jit
def _mat(ring, stage):
    """The ``[rows, D]`` matrix of one ``[1, 1, rows, D]`` TMA stage of a ring."""
    return ring.index(stage).reshape([ring.shape[3], ring.shape[4]])


@gluon.jit
def _wait_slot(bars, i_slot, STAGES: gl.constexpr):
    """Wait for the copies of slot (group) ``i_slot``."""
    mbarrier.wait(bars.index(i_slot % STAGES), (i_slot // STAGES) & 1)


@gluon.jit
def _bsa_fwd_gluon_kernel(
    q_desc, k_desc, v_desc, O, LSE, KV_IDX, KV_CNT, BIAS, KV_LEN, qk_scale, H, S, NQ, KMAX,
    HEAD_DIM: gl.constexpr, KV_BLOCK: gl.constexpr, HAS_BIAS: gl.constexpr,
    HAS_LEN: gl.constexpr, K_STAGES: gl.constexpr, V_STAGES: gl.constexpr, BLOCK: gl.constexpr,
):  # fmt: skip
    # The loop runs over groups of 64 keys: one segment at kv_block 64, else 64 // KV_BLOCK
    # consecutive slots, each copied by TMA into its rows of the stage.
    # K_j is read by S_j only (done by the end of step 3 of group j - 1): one stage can already
    # hold K_{j+1} a whole group ahead. V_j is read by P_j V_j, done in step 2 of group j + 1, so
    # V needs two stages for the same distance.
    gl.static_assert(V_STAGES >= 2)
    G: gl.constexpr = BLOCK // KV_BLOCK
    i_t = gl.program_id(0)
    i_bh = gl.program_id(1)
    i_row = i_bh.to(gl.int64) * NQ + i_t
    row_base = i_bh * S
    i_b = i_bh // H
    i_h = i_bh % H

    s_layout: gl.constexpr = _mma_layout(BLOCK)
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [1, 1, BLOCK, HEAD_DIM], q_desc.layout)
    q_mat = q_smem.reshape([BLOCK, HEAD_DIM])
    k_ring, v_ring, k_bars, v_bars = _kv_rings(k_desc, v_desc, K_STAGES, V_STAGES, HEAD_DIM)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    fence_async_shared()

    p_idx, p_bias, n_sel = selected_row(KV_IDX, KV_CNT, BIAS, i_row, KMAX)
    n_grp = (n_sel + G - 1) // G
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [i_b, i_h, i_t * BLOCK, 0], q_bar, q_smem)
    _fill_ring(k_desc, k_ring, k_bars, p_idx, i_b, i_h, n_sel, K_STAGES, KV_BLOCK)
    _fill_ring(v_desc, v_ring, v_bars, p_idx, i_b, i_h, n_sel, V_STAGES, KV_BLOCK)
    mbarrier.wait(q_bar, 0)

    bias_to_dot = 1.4426950408889634 / qk_scale
    o_col = gl.arange(0, BLOCK, layout=col_s)
    zero_s = gl.zeros([BLOCK, BLOCK], gl.float32, layout=s_layout)
    m_i = gl.full([BLOCK], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK], gl.float32, layout=row_s)
    acc = warpgroup_mma_init(gl.zeros([BLOCK, HEAD_DIM], gl.float32, layout=o_layout))
    # the register operand P of the product in flight: carried until the wait for that product,
    # so that the next P cannot take its registers while the tensor cores still read them
    p_prev = gl.zeros([BLOCK, BLOCK], q_desc.dtype, layout=p_layout)

    # S_0 (a row without slots computes it from an empty stage and never reads it)
    mbarrier.wait(k_bars.index(0), 0, pred=n_grp > 0)
    s_cur = warpgroup_mma(
        q_mat, _mat(k_ring, 0).permute((1, 0)), zero_s, use_acc=False, is_async=True
    )
    s_cur = warpgroup_mma_wait(num_outstanding=0, deps=(s_cur,))
    segs = _group_segments(p_idx, K_STAGES, n_sel, KV_BLOCK)
    _copy_group(k_desc, k_ring, k_bars, segs, i_b, i_h, K_STAGES, n_sel, K_STAGES, KV_BLOCK)
    # loaded a group ahead: the segments of the next V and K refills (TMA) and the column
    # terms (bias, key validity) of the group
    seg_v = _group_segments(p_idx, V_STAGES, n_sel, KV_BLOCK)
    seg_k = _group_segments(p_idx, K_STAGES + 1, n_sel, KV_BLOCK)
    cols = _first_columns(p_idx, p_bias, KV_LEN, n_sel, KV_BLOCK, HAS_BIAS, HAS_LEN)
    for j in range(n_grp):
        # -- 1. softmax of S_j while O += P_{j-1} V_{j-1} runs ----
        b_s, cols = _masked_logits(
            s_cur, cols, p_idx, p_bias, KV_LEN, j, n_sel, o_col, bias_to_dot, KV_BLOCK, HAS_BIAS,
            HAS_LEN,
        )  # fmt: skip
        m_new = gl.maximum(m_i, gl.max(b_s, 1) * qk_scale)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        b_p = gl.exp2(b_s * qk_scale - gl.expand_dims(m_safe, 1))
        alpha = gl.exp2(m_i - m_safe)
        l_i = l_i * alpha + gl.sum(b_p, 1)
        m_i = m_new
        # -- 2. that product is done: rescale O, refill V_{j-1}'s stage ----
        acc_t, p_prev = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_prev))
        p_op = gl.convert_layout(b_p.to(q_desc.dtype), p_layout)
        acc_t = acc_t * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        if j > 0:
            _copy_group(
                v_desc, v_ring, v_bars, seg_v, i_b, i_h, j - 1 + V_STAGES, n_sel, V_STAGES, KV_BLOCK
            )
            seg_v = _group_segments(p_idx, j + V_STAGES, n_sel, KV_BLOCK)
        # -- 3. S_{j+1} (the last group's again at the end: nothing refills its stage), then
        # O += P_j V_j; wait for S_{j+1} only and refill its K stage ----
        i_next = gl.minimum(j + 1, n_grp - 1)
        _wait_slot(k_bars, i_next, K_STAGES)
        s_next = warpgroup_mma(
            q_mat, _mat(k_ring, i_next % K_STAGES).permute((1, 0)), zero_s, use_acc=False,
            is_async=True,
        )  # fmt: skip
        _wait_slot(v_bars, j, V_STAGES)
        acc = warpgroup_mma(p_op, _mat(v_ring, j % V_STAGES), acc_t, is_async=True)
        p_prev = p_op
        s_cur = warpgroup_mma_wait(num_outstanding=1, deps=(s_next,))
        _copy_group(
            k_desc, k_ring, k_bars, seg_k, i_b, i_h, j + 1 + K_STAGES, n_sel, K_STAGES, KV_BLOCK
        )
        seg_k = _group_segments(p_idx, j + 2 + K_STAGES, n_sel, KV_BLOCK)
    acc_t, p_prev = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_prev))
    mbarrier.invalidate(q_bar)
    _invalidate_rings(k_bars, v_bars, K_STAGES, V_STAGES)

    # -- epilogue: O = acc / l, lse = m + log l (natural log); rows without keys: 0 and -inf ----
    m_nz = l_i > 0
    l_safe = gl.where(m_nz, l_i, 1.0)
    out = acc_t / gl.expand_dims(gl.convert_layout(l_safe, row_o), 1)
    lse = gl.where(m_nz, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    o_m = gl.arange(0, BLOCK, layout=row_o)
    o_d = gl.arange(0, HEAD_DIM, layout=col_o)
    tok = (row_base + i_t * BLOCK + o_m).to(gl.int64)
    gl.store(O + gl.expand_dims(tok, 1) * HEAD_DIM + gl.expand_dims(o_d, 0), out.to(q_desc.dtype))
    o_ms = gl.arange(0, BLOCK, layout=row_s)
    gl.store(LSE + (row_base + i_t * BLOCK + o_ms).to(gl.int64), lse)


def _descriptors(*tensors: torch.Tensor, rows: int = BLOCK):
    """``[1, 1, rows, D]`` TMA descriptors of ``[B, H, S, D]`` tensors (any strides that are
    multiples of 16 bytes, the last dimension contiguous: ``_gluon_wanted`` checks), in the
    shared layout of a 64-row stage (copies of one 16- or 32-key segment fill its rows)."""
    D = tensors[0].shape[-1]
    dtype = gl.bfloat16 if tensors[0].dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([1, 1, BLOCK, D], dtype)
    return tuple(
        TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, rows, D], layout)
        for x in tensors
    )


def bsa_forward_gluon(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    bias: torch.Tensor,
    lens: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    kv_block: int,
    qk_scale: float,
    has_bias: bool,
    has_len: bool,
    k_stages: int = 1,
    v_stages: int = 2,
) -> None:
    """The launch of ``block_sparse.bsa_forward`` for q_tile = 64 and kv_block 16, 32 or 64 on
    Hopper, with its prepared arguments: contiguous indices, counts, bias and lengths (1-element
    placeholders where ``has_bias`` / ``has_len`` is False), the contiguous outputs ``out`` and
    ``lse`` to write, ``qk_scale`` = scale * log2(e)."""
    B, H, S, D = q.shape
    NQ, KMAX = kv_indices.shape[2], kv_indices.shape[3]
    (q_desc,) = _descriptors(q)
    k_desc, v_desc = _descriptors(k, v, rows=kv_block)
    _bsa_fwd_gluon_kernel[(NQ, B * H)](
        q_desc, k_desc, v_desc, out, lse, kv_indices, kv_counts, bias, lens, qk_scale, H, S, NQ,
        KMAX,
        HEAD_DIM=D, KV_BLOCK=kv_block, HAS_BIAS=has_bias, HAS_LEN=has_len, K_STAGES=k_stages,
        V_STAGES=v_stages, BLOCK=BLOCK, num_warps=4,
    )  # fmt: skip


@gluon.jit
def _store_group_sums(p_out, b_x, i_grp, n_sel, o_col, KV_BLOCK: gl.constexpr):
    """Store the sums of ``b_x`` [64, 64] over each pair's block (the tile's rows x the slot's
    keys) of group ``i_grp``: one slot at kv_block 64, else its 64 // KV_BLOCK slots (none past
    the row's count)."""
    if KV_BLOCK == 64:
        # row sums first: in-thread and quad reductions, then one across the rows
        gl.store(p_out + i_grp, gl.sum(gl.sum(b_x, 1), 0))
    else:
        G: gl.constexpr = 64 // KV_BLOCK
        b_sum = gl.sum(gl.sum(gl.reshape(b_x, [64, G, KV_BLOCK]), 2), 0)
        slot = i_grp * G + gl.arange(0, G, layout=b_sum.type.layout)
        gl.store(p_out + slot, b_sum, mask=slot < n_sel)


@gluon.jit
def _bsa_bwd_dq_gluon_kernel(
    q_desc, k_desc, v_desc, do_desc, O, LSE, DLSE, DELTA, DQ, DBIAS, MASS, KV_IDX, KV_CNT, BIAS,
    KV_LEN, qk_scale, scale, H, S, NQ, KMAX,
    HEAD_DIM: gl.constexpr, KV_BLOCK: gl.constexpr, HAS_BIAS: gl.constexpr,
    HAS_LEN: gl.constexpr, HAS_DLSE: gl.constexpr, K_STAGES: gl.constexpr,
    V_STAGES: gl.constexpr, BLOCK: gl.constexpr,
):  # fmt: skip
    """dQ pass of ``block_sparse._bsa_bwd_dq_kernel`` (dQ, per-pair d(bias) and probability
    mass, delta) over groups of 64 keys as in the forward: one segment at kv_block 64, else
    64 // KV_BLOCK slots copied by TMA one slot at a time. K_j is read by S_j and by
    dQ += dS_j K_j (done in step 2 of group j + 1), so K takes three stages for a group of
    distance; V_j only by dP_j: one stage suffices."""
    gl.static_assert(K_STAGES >= 2)
    G: gl.constexpr = BLOCK // KV_BLOCK
    i_t = gl.program_id(0)
    i_bh = gl.program_id(1)
    i_row = i_bh.to(gl.int64) * NQ + i_t
    row_base = i_bh * S
    i_b = i_bh // H
    i_h = i_bh % H

    s_layout: gl.constexpr = _mma_layout(BLOCK)
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM)
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [1, 1, BLOCK, HEAD_DIM], q_desc.layout)
    q_mat = q_smem.reshape([BLOCK, HEAD_DIM])
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [1, 1, BLOCK, HEAD_DIM], do_desc.layout)
    do_mat = do_smem.reshape([BLOCK, HEAD_DIM])
    k_ring, v_ring, k_bars, v_bars = _kv_rings(k_desc, v_desc, K_STAGES, V_STAGES, HEAD_DIM)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    fence_async_shared()

    p_idx, p_bias, n_sel = selected_row(KV_IDX, KV_CNT, BIAS, i_row, KMAX)
    n_grp = (n_sel + G - 1) // G
    p_dbias = DBIAS + i_row * KMAX
    p_mass = MASS + i_row * KMAX
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [i_b, i_h, i_t * BLOCK, 0], q_bar, q_smem)
    tma.async_copy_global_to_shared(do_desc, [i_b, i_h, i_t * BLOCK, 0], q_bar, do_smem)
    _fill_ring(k_desc, k_ring, k_bars, p_idx, i_b, i_h, n_sel, K_STAGES, KV_BLOCK)
    _fill_ring(v_desc, v_ring, v_bars, p_idx, i_b, i_h, n_sel, V_STAGES, KV_BLOCK)

    # -- delta = rowsum(dO * O) - dLSE, the softmax-backward row constant; lse in log2 units ----
    o_m = gl.arange(0, BLOCK, layout=row_o)
    o_d = gl.arange(0, HEAD_DIM, layout=col_o)
    tok_o = (row_base + i_t * BLOCK + o_m).to(gl.int64)
    p_rows = gl.expand_dims(tok_o, 1) * HEAD_DIM + gl.expand_dims(o_d, 0)
    mbarrier.wait(q_bar, 0)
    b_do = do_mat.load(o_layout).to(gl.float32)
    b_delta = gl.sum(b_do * gl.load(O + p_rows).to(gl.float32), 1)
    if HAS_DLSE:
        b_delta -= gl.load(DLSE + tok_o)
    gl.store(DELTA + tok_o, b_delta)
    b_delta = gl.convert_layout(b_delta, row_s)
    tok_s = (row_base + i_t * BLOCK + gl.arange(0, BLOCK, layout=row_s)).to(gl.int64)
    b_lse = gl.load(LSE + tok_s)
    # rows that saw no valid key have lse = -inf and zero probability everywhere
    b_lse2 = gl.where(b_lse == float("-inf"), float("inf"), b_lse * 1.4426950408889634)

    bias_to_dot = 1.4426950408889634 / qk_scale
    o_col = gl.arange(0, BLOCK, layout=col_s)
    zero_s = gl.zeros([BLOCK, BLOCK], gl.float32, layout=s_layout)
    acc = warpgroup_mma_init(gl.zeros([BLOCK, HEAD_DIM], gl.float32, layout=o_layout))
    # the register operand dS of the product in flight, kept alive until its wait (as P forward)
    ds_prev = gl.zeros([BLOCK, BLOCK], q_desc.dtype, layout=ds_layout)

    # S_0, dP_0 (a row without slots computes them from empty stages and never reads them)
    mbarrier.wait(k_bars.index(0), 0, pred=n_grp > 0)
    mbarrier.wait(v_bars.index(0), 0, pred=n_grp > 0)
    s_cur = warpgroup_mma(
        q_mat, _mat(k_ring, 0).permute((1, 0)), zero_s, use_acc=False, is_async=True
    )
    dp_cur = warpgroup_mma(
        do_mat, _mat(v_ring, 0).permute((1, 0)), zero_s, use_acc=False, is_async=True
    )
    s_cur, dp_cur = warpgroup_mma_wait(num_outstanding=0, deps=(s_cur, dp_cur))
    segs = _group_segments(p_idx, V_STAGES, n_sel, KV_BLOCK)
    _copy_group(v_desc, v_ring, v_bars, segs, i_b, i_h, V_STAGES, n_sel, V_STAGES, KV_BLOCK)
    # loaded a group ahead, as in the forward
    seg_k = _group_segments(p_idx, K_STAGES, n_sel, KV_BLOCK)
    seg_v = _group_segments(p_idx, V_STAGES + 1, n_sel, KV_BLOCK)
    cols = _first_columns(p_idx, p_bias, KV_LEN, n_sel, KV_BLOCK, HAS_BIAS, HAS_LEN)
    for j in range(n_grp):
        # -- 1. P and dS of group j while dQ += dS_{j-1} K_{j-1} runs ----
        b_s, cols = _masked_logits(
            s_cur, cols, p_idx, p_bias, KV_LEN, j, n_sel, o_col, bias_to_dot, KV_BLOCK, HAS_BIAS,
            HAS_LEN,
        )  # fmt: skip
        b_p = gl.exp2(b_s * qk_scale - gl.expand_dims(b_lse2, 1))
        if HAS_BIAS:
            _store_group_sums(p_mass, b_p, j, n_sel, o_col, KV_BLOCK)
        b_ds = b_p * (dp_cur - gl.expand_dims(b_delta, 1))
        if HAS_BIAS:
            _store_group_sums(p_dbias, b_ds, j, n_sel, o_col, KV_BLOCK)
        # -- 2. that product is done: refill K_{j-1}'s stage ----
        acc_t, ds_prev = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ds_prev))
        ds_op = gl.convert_layout(b_ds.to(q_desc.dtype), ds_layout)
        if j > 0:
            _copy_group(
                k_desc, k_ring, k_bars, seg_k, i_b, i_h, j - 1 + K_STAGES, n_sel, K_STAGES, KV_BLOCK
            )
            seg_k = _group_segments(p_idx, j + K_STAGES, n_sel, KV_BLOCK)
        # -- 3. S_{j+1}, dP_{j+1} (the last group's again at the end: nothing refills its
        # stages), then dQ += dS_j K_j; wait for S_{j+1}, dP_{j+1} only, refill V_{j+1}'s
        # stage ----
        i_next = gl.minimum(j + 1, n_grp - 1)
        _wait_slot(k_bars, i_next, K_STAGES)
        _wait_slot(v_bars, i_next, V_STAGES)
        s_next = warpgroup_mma(
            q_mat, _mat(k_ring, i_next % K_STAGES).permute((1, 0)), zero_s, use_acc=False,
            is_async=True,
        )  # fmt: skip
        dp_next = warpgroup_mma(
            do_mat, _mat(v_ring, i_next % V_STAGES).permute((1, 0)), zero_s, use_acc=False,
            is_async=True,
        )  # fmt: skip
        acc = warpgroup_mma(ds_op, _mat(k_ring, j % K_STAGES), acc_t, is_async=True)
        ds_prev = ds_op
        s_cur, dp_cur = warpgroup_mma_wait(num_outstanding=1, deps=(s_next, dp_next))
        _copy_group(
            v_desc, v_ring, v_bars, seg_v, i_b, i_h, j + 1 + V_STAGES, n_sel, V_STAGES, KV_BLOCK
        )
        seg_v = _group_segments(p_idx, j + 2 + V_STAGES, n_sel, KV_BLOCK)
    acc_t, ds_prev = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ds_prev))
    mbarrier.invalidate(q_bar)
    _invalidate_rings(k_bars, v_bars, K_STAGES, V_STAGES)
    gl.store(DQ + p_rows, (acc_t * scale).to(q_desc.dtype))


def bsa_backward_dq_gluon(
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
    scale: float,
    qk_scale: float,
    has_bias: bool,
    has_len: bool,
    has_dlse: bool,
    kv_block: int,
    k_stages: int = 3,
    v_stages: int = 1,
) -> None:
    """The dQ-pass launch of ``block_sparse.bsa_backward`` for q_tile = 64 and kv_block 16, 32
    or 64 on Hopper, with its prepared arguments (contiguous lse, indices, counts; bias,
    lengths and dlse or 1-element placeholders where the flag is False). Writes ``grads`` = (dq
    [B,H,S,D] contiguous, delta float32 [B,H,S], raw d(bias), pair mass), the last two zero-filled by the
    caller; ``bsa_backward`` then restores the softmax identity of d(bias) and runs the dK/dV
    pass."""
    B, H, S, D = q.shape
    NQ, KMAX = kv_indices.shape[2], kv_indices.shape[3]
    dq, delta, dbias, mass = grads
    q_desc, do_desc = _descriptors(q, dout)
    k_desc, v_desc = _descriptors(k, v, rows=kv_block)
    # the kernel reads O (for delta) with the offsets of a contiguous tensor
    _bsa_bwd_dq_gluon_kernel[(NQ, B * H)](
        q_desc, k_desc, v_desc, do_desc, out.contiguous(), lse, dlse, delta, dq, dbias, mass,
        kv_indices, kv_counts, bias, lens, qk_scale, scale, H, S, NQ, KMAX,
        HEAD_DIM=D, KV_BLOCK=kv_block, HAS_BIAS=has_bias, HAS_LEN=has_len, HAS_DLSE=has_dlse,
        K_STAGES=k_stages, V_STAGES=v_stages, BLOCK=BLOCK, num_warps=4,
    )  # fmt: skip
