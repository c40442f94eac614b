"""Experimental (branch gluon-fwd, not wired in): a Gluon forward of the VSA2 fine stage for
Hopper, kv_block 64, with the FlashAttention-3 overlap of softmax and tensor-core work.

Triton's ``tl`` cannot express it (tried: the compiler waits for every QK^T wgmma at once, and
its automatic warp specialisation rejects the loop), so these kernels issue and wait for the
wgmma groups themselves (``warpgroup_mma`` / ``warpgroup_mma_wait``) and stream the K and V
segments with TMA copies into two rings of shared-memory stages guarded by mbarriers, each
stage refilled as soon as the product reading it has completed. Forward, per selected slot j of
a query tile (one warpgroup, 64 rows):

1. softmax of the logits S_j (in registers) while O += P_{j-1} V_{j-1} is still running;
2. wait for that product, rescale O, refill its V stage;
3. issue S_{j+1} = Q K_{j+1}^T, then O += P_j V_j; wait for S_{j+1} only, refill its K stage.

The dQ pass does the same with S and dP = dO V^T in step 3 and dQ += dS K in place of the P V
product. Same contracts as ``block_sparse._bsa_fwd_kernel`` and ``_bsa_bwd_dq_kernel`` for
kv_block = q_tile = 64, D in {64, 128}, bf16/fp16, contiguous [B, H, S, D] inputs. Not
interpreter-testable: GPU tests compare them with the Triton kernels.
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

BLOCK = 64  # query rows per tile = keys per segment


@gluon.jit
def _issue_load(desc, ring, bars, p_idx, row_base, i_slot, n_sel, STAGES: gl.constexpr):
    """TMA copy of the rows of the segment in the row's slot ``i_slot`` into its stage
    ``i_slot % STAGES`` of ``ring`` (no copy past the row's count); the stage's barrier tracks
    it, with phase ``(i_slot // STAGES) & 1``."""
    pred = i_slot < n_sel
    seg = gl.load(p_idx + i_slot, mask=pred, other=0)
    bar = bars.index(i_slot % STAGES)
    mbarrier.expect(bar, desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(
        desc, [row_base + seg * desc.block_type.shape[0], 0], bar, ring.index(i_slot % STAGES),
        pred=pred,
    )  # fmt: skip


@gluon.jit
def _wait_slot(bars, i_slot, STAGES: gl.constexpr):
    mbarrier.wait(bars.index(i_slot % STAGES), (i_slot // STAGES) & 1)


@gluon.jit
def _bsa_fwd_gluon_kernel(
    q_desc, k_desc, v_desc, O, LSE, KV_IDX, KV_CNT, BIAS, KV_LEN, qk_scale, S, NQ, KMAX,
    HEAD_DIM: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_LEN: gl.constexpr,
    K_STAGES: gl.constexpr, V_STAGES: gl.constexpr, BLOCK: gl.constexpr,
):  # fmt: skip
    # K_j is read by S_j only (done by the end of step 3 of slot j - 1): one stage can already
    # hold K_{j+1} a whole slot ahead. V_j is read by P_j V_j, done in step 2 of slot j + 1, so
    # V needs two stages for the same distance.
    gl.static_assert(V_STAGES >= 2)
    i_t = gl.program_id(0)
    i_bh = gl.program_id(1)
    i_row = i_bh.to(gl.int64) * NQ + i_t
    row_base = i_bh * S

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK, HEAD_DIM], q_desc.layout)
    k_ring = gl.allocate_shared_memory(k_desc.dtype, [K_STAGES, BLOCK, HEAD_DIM], k_desc.layout)
    v_ring = gl.allocate_shared_memory(v_desc.dtype, [V_STAGES, BLOCK, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for s in gl.static_range(K_STAGES):
        mbarrier.init(k_bars.index(s), count=1)
    for s in gl.static_range(V_STAGES):
        mbarrier.init(v_bars.index(s), count=1)
    fence_async_shared()

    n_sel = gl.load(KV_CNT + i_row)
    p_idx = KV_IDX + i_row * KMAX
    p_bias = BIAS + i_row * KMAX
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row_base + i_t * BLOCK, 0], q_bar, q_smem)
    for s in gl.static_range(K_STAGES):
        _issue_load(k_desc, k_ring, k_bars, p_idx, row_base, s, n_sel, K_STAGES)
    for s in gl.static_range(V_STAGES):
        _issue_load(v_desc, v_ring, v_bars, p_idx, row_base, s, n_sel, V_STAGES)
    mbarrier.wait(q_bar, 0)

    bias_to_dot = 1.4426950408889634 / qk_scale
    o_col = gl.arange(0, BLOCK, layout=col_s)
    zero_s = gl.zeros([BLOCK, BLOCK], gl.float32, layout=s_layout)
    m_i = gl.full([BLOCK], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK], gl.float32, layout=row_s)
    acc = warpgroup_mma_init(gl.zeros([BLOCK, HEAD_DIM], gl.float32, layout=o_layout))

    # S_0 (a row without slots computes it from an empty stage and never reads it)
    mbarrier.wait(k_bars.index(0), 0, pred=n_sel > 0)
    s_cur = warpgroup_mma(
        q_smem, k_ring.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True
    )
    s_cur = warpgroup_mma_wait(num_outstanding=0, deps=(s_cur,))
    _issue_load(k_desc, k_ring, k_bars, p_idx, row_base, K_STAGES, n_sel, K_STAGES)
    for j in range(n_sel):
        # -- 1. softmax of S_j while O += P_{j-1} V_{j-1} runs ----
        b_s = s_cur
        if HAS_BIAS:
            b_s = b_s + gl.load(p_bias + j).to(gl.float32) * bias_to_dot
        if HAS_LEN:
            n_key = gl.load(KV_LEN + gl.load(p_idx + j))
            b_s = gl.where(gl.expand_dims(o_col < n_key, 0), b_s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(b_s, 1) * qk_scale)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        b_p = gl.exp2(b_s * qk_scale - gl.expand_dims(m_safe, 1))
        alpha = gl.exp2(m_i - m_safe)
        l_i = l_i * alpha + gl.sum(b_p, 1)
        m_i = m_new
        p_op = gl.convert_layout(b_p.to(q_desc.dtype), p_layout)
        # -- 2. that product is done: rescale O, refill V_{j-1}'s stage ----
        acc_t = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        acc_t = acc_t * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        if j > 0:
            _issue_load(v_desc, v_ring, v_bars, p_idx, row_base, j - 1 + V_STAGES, n_sel, V_STAGES)
        # -- 3. S_{j+1} (the last slot's again at the end: nothing refills its stage), then
        # O += P_j V_j; wait for S_{j+1} only and refill its K stage ----
        i_next = gl.minimum(j + 1, n_sel - 1)
        _wait_slot(k_bars, i_next, K_STAGES)
        s_next = warpgroup_mma(
            q_smem, k_ring.index(i_next % K_STAGES).permute((1, 0)), zero_s, use_acc=False,
            is_async=True,
        )  # fmt: skip
        _wait_slot(v_bars, j, V_STAGES)
        acc = warpgroup_mma(p_op, v_ring.index(j % V_STAGES), acc_t, is_async=True)
        s_cur = warpgroup_mma_wait(num_outstanding=1, deps=(s_next,))
        _issue_load(k_desc, k_ring, k_bars, p_idx, row_base, j + 1 + K_STAGES, n_sel, K_STAGES)
    acc_t = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.invalidate(q_bar)
    for s in gl.static_range(K_STAGES):
        mbarrier.invalidate(k_bars.index(s))
    for s in gl.static_range(V_STAGES):
        mbarrier.invalidate(v_bars.index(s))

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


def _descriptors(*tensors: torch.Tensor):
    """``[BLOCK, D]`` TMA descriptors over ``[B * H * S, D]`` views of contiguous tensors."""
    B, H, S, D = tensors[0].shape
    dtype = gl.bfloat16 if tensors[0].dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([BLOCK, D], dtype)
    return tuple(
        TensorDescriptor.from_tensor(x.contiguous().view(B * H * S, D), [BLOCK, D], layout)
        for x in tensors
    )


def bsa_forward_gluon(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    block_bias: torch.Tensor | None,
    kv_lengths: torch.Tensor | None,
    scale: float,
    k_stages: int = 1,
    v_stages: int = 2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``block_sparse.bsa_forward`` for q_tile = kv_block = 64 on Hopper."""
    B, H, S, D = q.shape
    NQ, KMAX = kv_indices.shape[2], kv_indices.shape[3]
    q_desc, k_desc, v_desc = _descriptors(q, k, v)
    out = torch.empty((B, H, S, D), device=q.device, dtype=q.dtype)
    lse = torch.empty((B, H, S), device=q.device, dtype=torch.float32)
    dummy = torch.empty(1, device=q.device, dtype=torch.float32)
    bias = block_bias.contiguous() if block_bias is not None else dummy
    lens = kv_lengths.contiguous() if kv_lengths is not None else dummy.to(torch.int32)
    _bsa_fwd_gluon_kernel[(NQ, B * H)](
        q_desc, k_desc, v_desc, out, lse, kv_indices.contiguous(), kv_counts.contiguous(), bias,
        lens, scale * 1.4426950408889634, S, NQ, KMAX,
        HEAD_DIM=D, HAS_BIAS=block_bias is not None, HAS_LEN=kv_lengths is not None,
        K_STAGES=k_stages, V_STAGES=v_stages, BLOCK=BLOCK, num_warps=4,
    )  # fmt: skip
    return out, lse


@gluon.jit
def _bsa_bwd_dq_gluon_kernel(
    q_desc, k_desc, v_desc, do_desc, O, LSE, DLSE, DELTA, DQ, DBIAS, MASS, KV_IDX, KV_CNT, BIAS,
    KV_LEN, qk_scale, scale, S, NQ, KMAX,
    HEAD_DIM: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_LEN: gl.constexpr,
    HAS_DLSE: gl.constexpr, K_STAGES: gl.constexpr, V_STAGES: gl.constexpr,
    BLOCK: gl.constexpr,
):  # fmt: skip
    """dQ pass of ``block_sparse._bsa_bwd_dq_kernel`` (dQ, per-pair d(bias) and probability
    mass, delta). K_j is read by S_j and by dQ += dS_j K_j (done in step 2 of slot j + 1), so K
    takes three stages for a slot of distance; V_j only by dP_j: one stage suffices."""
    gl.static_assert(K_STAGES >= 2)
    i_t = gl.program_id(0)
    i_bh = gl.program_id(1)
    i_row = i_bh.to(gl.int64) * NQ + i_t
    row_base = i_bh * S

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [BLOCK, HEAD_DIM], do_desc.layout)
    k_ring = gl.allocate_shared_memory(k_desc.dtype, [K_STAGES, BLOCK, HEAD_DIM], k_desc.layout)
    v_ring = gl.allocate_shared_memory(v_desc.dtype, [V_STAGES, BLOCK, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for s in gl.static_range(K_STAGES):
        mbarrier.init(k_bars.index(s), count=1)
    for s in gl.static_range(V_STAGES):
        mbarrier.init(v_bars.index(s), count=1)
    fence_async_shared()

    n_sel = gl.load(KV_CNT + i_row)
    p_idx = KV_IDX + i_row * KMAX
    p_bias = BIAS + i_row * KMAX
    p_dbias = DBIAS + i_row * KMAX
    p_mass = MASS + i_row * KMAX
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row_base + i_t * BLOCK, 0], q_bar, q_smem)
    tma.async_copy_global_to_shared(do_desc, [row_base + i_t * BLOCK, 0], q_bar, do_smem)
    for s in gl.static_range(K_STAGES):
        _issue_load(k_desc, k_ring, k_bars, p_idx, row_base, s, n_sel, K_STAGES)
    for s in gl.static_range(V_STAGES):
        _issue_load(v_desc, v_ring, v_bars, p_idx, row_base, s, n_sel, V_STAGES)

    # -- delta = rowsum(dO * O) - dLSE, the softmax-backward row constant; lse in log2 units ----
    o_m = gl.arange(0, BLOCK, layout=row_o)
    o_d = gl.arange(0, HEAD_DIM, layout=col_o)
    tok_o = (row_base + i_t * BLOCK + o_m).to(gl.int64)
    p_rows = gl.expand_dims(tok_o, 1) * HEAD_DIM + gl.expand_dims(o_d, 0)
    mbarrier.wait(q_bar, 0)
    b_do = do_smem.load(o_layout).to(gl.float32)
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

    # S_0, dP_0 (a row without slots computes them from empty stages and never reads them)
    mbarrier.wait(k_bars.index(0), 0, pred=n_sel > 0)
    mbarrier.wait(v_bars.index(0), 0, pred=n_sel > 0)
    s_cur = warpgroup_mma(
        q_smem, k_ring.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True
    )
    dp_cur = warpgroup_mma(
        do_smem, v_ring.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True
    )
    s_cur, dp_cur = warpgroup_mma_wait(num_outstanding=0, deps=(s_cur, dp_cur))
    _issue_load(v_desc, v_ring, v_bars, p_idx, row_base, V_STAGES, n_sel, V_STAGES)
    for j in range(n_sel):
        # -- 1. P and dS of slot j while dQ += dS_{j-1} K_{j-1} runs ----
        b_s = s_cur
        if HAS_BIAS:
            b_s = b_s + gl.load(p_bias + j).to(gl.float32) * bias_to_dot
        if HAS_LEN:
            n_key = gl.load(KV_LEN + gl.load(p_idx + j))
            b_s = gl.where(gl.expand_dims(o_col < n_key, 0), b_s, float("-inf"))
        b_p = gl.exp2(b_s * qk_scale - gl.expand_dims(b_lse2, 1))
        b_ds = b_p * (dp_cur - gl.expand_dims(b_delta, 1))
        if HAS_BIAS:
            gl.store(p_dbias + j, gl.sum(gl.sum(b_ds, 1), 0))
            gl.store(p_mass + j, gl.sum(gl.sum(b_p, 1), 0))
        ds_op = gl.convert_layout(b_ds.to(q_desc.dtype), ds_layout)
        # -- 2. that product is done: refill K_{j-1}'s stage ----
        acc_t = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        if j > 0:
            _issue_load(k_desc, k_ring, k_bars, p_idx, row_base, j - 1 + K_STAGES, n_sel, K_STAGES)
        # -- 3. S_{j+1}, dP_{j+1} (the last slot's again at the end: nothing refills its
        # stages), then dQ += dS_j K_j; wait for S_{j+1}, dP_{j+1} only, refill V_{j+1}'s stage ----
        i_next = gl.minimum(j + 1, n_sel - 1)
        _wait_slot(k_bars, i_next, K_STAGES)
        _wait_slot(v_bars, i_next, V_STAGES)
        s_next = warpgroup_mma(
            q_smem, k_ring.index(i_next % K_STAGES).permute((1, 0)), zero_s, use_acc=False,
            is_async=True,
        )  # fmt: skip
        dp_next = warpgroup_mma(
            do_smem, v_ring.index(i_next % V_STAGES).permute((1, 0)), zero_s, use_acc=False,
            is_async=True,
        )  # fmt: skip
        acc = warpgroup_mma(ds_op, k_ring.index(j % K_STAGES), acc_t, is_async=True)
        s_cur, dp_cur = warpgroup_mma_wait(num_outstanding=1, deps=(s_next, dp_next))
        _issue_load(v_desc, v_ring, v_bars, p_idx, row_base, j + 1 + V_STAGES, n_sel, V_STAGES)
    acc_t = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.invalidate(q_bar)
    for s in gl.static_range(K_STAGES):
        mbarrier.invalidate(k_bars.index(s))
    for s in gl.static_range(V_STAGES):
        mbarrier.invalidate(v_bars.index(s))
    gl.store(DQ + p_rows, (acc_t * scale).to(q_desc.dtype))


def bsa_backward_dq_gluon(
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
    scale: float,
    k_stages: int = 3,
    v_stages: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The dQ pass of ``block_sparse.bsa_backward`` for q_tile = kv_block = 64 on Hopper:
    (dq, delta, raw d(bias), pair mass); ``bsa_backward`` then restores the softmax identity of
    d(bias) and runs the dK/dV pass."""
    B, H, S, D = q.shape
    NQ, KMAX = kv_indices.shape[2], kv_indices.shape[3]
    q_desc, k_desc, v_desc, do_desc = _descriptors(q, k, v, dout)
    dq = torch.empty((B, H, S, D), device=q.device, dtype=q.dtype)
    delta = torch.empty((B, H, S), device=q.device, dtype=torch.float32)
    dummy = torch.empty(1, device=q.device, dtype=torch.float32)
    has_bias = block_bias is not None
    bias = block_bias.contiguous() if has_bias else dummy
    dbias = torch.zeros_like(bias) if has_bias else dummy
    mass = torch.zeros(bias.shape, device=q.device) if has_bias else dummy
    lens = kv_lengths.contiguous() if kv_lengths is not None else dummy.to(torch.int32)
    _bsa_bwd_dq_gluon_kernel[(NQ, B * H)](
        q_desc, k_desc, v_desc, do_desc, out.contiguous(), lse.contiguous(),
        dlse.contiguous() if dlse is not None else dummy, delta, dq, dbias, mass,
        kv_indices.contiguous(), kv_counts.contiguous(), bias, lens,
        scale * 1.4426950408889634, scale, S, NQ, KMAX,
        HEAD_DIM=D, HAS_BIAS=has_bias, HAS_LEN=kv_lengths is not None, HAS_DLSE=dlse is not None,
        K_STAGES=k_stages, V_STAGES=v_stages, BLOCK=BLOCK, num_warps=4,
    )  # fmt: skip
    return dq, delta, (dbias if has_bias else None), (mass if has_bias else None)


@gluon.jit
def _issue_tile_load(
    q_desc, do_desc, q_ring, do_ring, bars, CSR_PAIR, row_base, i_start, i_local, n_ent, NQ, KMAX,
    STAGES: gl.constexpr,
):  # fmt: skip
    """TMA copies of the q and dO rows of the query tile at CSR entry ``i_start + i_local`` into
    stage ``i_local % STAGES`` of both rings (none past the segment's entries)."""
    pred = i_local < n_ent
    pair = gl.load(CSR_PAIR + i_start + i_local, mask=pred, other=0)
    row = row_base + (pair // KMAX) % NQ * q_desc.block_type.shape[0]
    bar = bars.index(i_local % STAGES)
    mbarrier.expect(bar, 2 * q_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(
        q_desc, [row, 0], bar, q_ring.index(i_local % STAGES), pred=pred
    )
    tma.async_copy_global_to_shared(
        do_desc, [row, 0], bar, do_ring.index(i_local % STAGES), pred=pred
    )


@gluon.jit
def _bsa_bwd_dkv_gluon_kernel(
    q_desc, k_desc, v_desc, do_desc, LSE, DELTA, DK, DV, CSR_OFF, CSR_PAIR, BIAS, KV_LEN,
    qk_scale, scale, S, NQ, NSEG, KMAX,
    HEAD_DIM: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_LEN: gl.constexpr,
    Q_STAGES: gl.constexpr, WARPS: gl.constexpr, BLOCK: gl.constexpr,
):  # fmt: skip
    """dK/dV pass of ``block_sparse._bsa_bwd_dkv_kernel`` (key-major, kv_block 64): one program
    per key segment walks the query tiles that selected it (the CSR index of
    ``build_kv_major_index``). Per tile i: P^T and dS^T of tile i while dV += P^T_{i-1} dO_{i-1}
    and dK += dS^T_{i-1} Q_{i-1} run; then S^T_{i+1} = K Q_{i+1}^T, dP^T_{i+1} = V dO_{i+1}^T,
    dV and dK of tile i, waiting for the first two only. Q_i and dO_i are read until the dK/dV
    products of tile i finish (step 2 of tile i + 1): three stages keep a tile of distance.
    With WARPS = 8 two warpgroups split every product along N (half the accumulator registers
    each; P^T and dS^T then cross warpgroups through shared memory)."""
    gl.static_assert(Q_STAGES >= 2)
    i_seg = gl.program_id(0)
    i_bh = gl.program_id(1)
    row_base = i_bh * S

    WG: gl.constexpr = WARPS // 4
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, WG], instr_shape=[16, BLOCK // WG, 16]
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, WG], instr_shape=[16, HEAD_DIM // WG, 16]
    )
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    key_st: gl.constexpr = gl.SliceLayout(1, st_layout)
    qrow_st: gl.constexpr = gl.SliceLayout(0, st_layout)
    key_acc: gl.constexpr = gl.SliceLayout(1, acc_layout)
    col_acc: gl.constexpr = gl.SliceLayout(0, acc_layout)

    k_smem = gl.allocate_shared_memory(k_desc.dtype, [BLOCK, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [BLOCK, HEAD_DIM], v_desc.layout)
    q_ring = gl.allocate_shared_memory(q_desc.dtype, [Q_STAGES, BLOCK, HEAD_DIM], q_desc.layout)
    do_ring = gl.allocate_shared_memory(do_desc.dtype, [Q_STAGES, BLOCK, HEAD_DIM], do_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_bars = gl.allocate_shared_memory(gl.int64, [Q_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for s in gl.static_range(Q_STAGES):
        mbarrier.init(q_bars.index(s), count=1)
    fence_async_shared()

    i_csr = i_bh.to(gl.int64) * NSEG + i_seg
    i_start = gl.load(CSR_OFF + i_csr)
    n_ent = gl.load(CSR_OFF + i_csr + 1) - i_start
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row_base + i_seg * BLOCK, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [row_base + i_seg * BLOCK, 0], kv_bar, v_smem)
    for s in gl.static_range(Q_STAGES):
        _issue_tile_load(
            q_desc, do_desc, q_ring, do_ring, q_bars, CSR_PAIR, row_base, i_start, s, n_ent, NQ,
            KMAX, Q_STAGES,
        )  # fmt: skip

    bias_to_dot = 1.4426950408889634 / qk_scale
    o_r = gl.arange(0, BLOCK, layout=qrow_st)
    if HAS_LEN:
        # keys past a partial segment's length get no probability
        m_key = gl.expand_dims(gl.arange(0, BLOCK, layout=key_st) < gl.load(KV_LEN + i_seg), 1)
    zero_st = gl.zeros([BLOCK, BLOCK], gl.float32, layout=st_layout)
    dk = warpgroup_mma_init(gl.zeros([BLOCK, HEAD_DIM], gl.float32, layout=acc_layout))
    dv = warpgroup_mma_init(gl.zeros([BLOCK, HEAD_DIM], gl.float32, layout=acc_layout))

    # S^T_0, dP^T_0 (a segment no tile selected computes them from empty stages, unread)
    mbarrier.wait(kv_bar, 0)
    mbarrier.wait(q_bars.index(0), 0, pred=n_ent > 0)
    st_cur = warpgroup_mma(
        k_smem, q_ring.index(0).permute((1, 0)), zero_st, use_acc=False, is_async=True
    )
    dpt_cur = warpgroup_mma(
        v_smem, do_ring.index(0).permute((1, 0)), zero_st, use_acc=False, is_async=True
    )
    st_cur, dpt_cur = warpgroup_mma_wait(num_outstanding=0, deps=(st_cur, dpt_cur))
    for i in range(n_ent):
        # -- 1. P^T and dS^T of tile i while the dV / dK products of tile i - 1 run ----
        pair = gl.load(CSR_PAIR + i_start + i)
        tok = (row_base + (pair // KMAX) % NQ * BLOCK + o_r).to(gl.int64)
        b_lse = gl.load(LSE + tok)
        # rows that saw no valid key have lse = -inf and zero probability everywhere
        b_lse2 = gl.where(b_lse == float("-inf"), float("inf"), b_lse * 1.4426950408889634)
        b_delta = gl.load(DELTA + tok)
        b_st = st_cur
        if HAS_BIAS:
            b_st = b_st + gl.load(BIAS + pair) * bias_to_dot
        b_pt = gl.exp2(b_st * qk_scale - gl.expand_dims(b_lse2, 0))
        if HAS_LEN:
            b_pt = gl.where(m_key, b_pt, 0.0)
        b_dst = b_pt * (dpt_cur - gl.expand_dims(b_delta, 0))
        pt_op = gl.convert_layout(b_pt.to(q_desc.dtype), op_layout)
        dst_op = gl.convert_layout(b_dst.to(q_desc.dtype), op_layout)
        # -- 2. those products are done: refill tile i - 1's stage ----
        dk_t, dv_t = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
        if i > 0:
            _issue_tile_load(
                q_desc, do_desc, q_ring, do_ring, q_bars, CSR_PAIR, row_base, i_start,
                i - 1 + Q_STAGES, n_ent, NQ, KMAX, Q_STAGES,
            )  # fmt: skip
        # -- 3. S^T, dP^T of tile i + 1 (the last tile's again at the end: nothing refills its
        # stage), then dV, dK of tile i; wait for the first two only ----
        i_next = gl.minimum(i + 1, n_ent - 1)
        _wait_slot(q_bars, i_next, Q_STAGES)
        st_next = warpgroup_mma(
            k_smem, q_ring.index(i_next % Q_STAGES).permute((1, 0)), zero_st, use_acc=False,
            is_async=True,
        )  # fmt: skip
        dpt_next = warpgroup_mma(
            v_smem, do_ring.index(i_next % Q_STAGES).permute((1, 0)), zero_st, use_acc=False,
            is_async=True,
        )  # fmt: skip
        dv = warpgroup_mma(pt_op, do_ring.index(i % Q_STAGES), dv_t, is_async=True)
        dk = warpgroup_mma(dst_op, q_ring.index(i % Q_STAGES), dk_t, is_async=True)
        st_cur, dpt_cur = warpgroup_mma_wait(num_outstanding=2, deps=(st_next, dpt_next))
    dk_t, dv_t = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
    mbarrier.invalidate(kv_bar)
    for s in gl.static_range(Q_STAGES):
        mbarrier.invalidate(q_bars.index(s))

    o_w = gl.arange(0, BLOCK, layout=key_acc)
    o_d = gl.arange(0, HEAD_DIM, layout=col_acc)
    tok_k = (row_base + i_seg * BLOCK + o_w).to(gl.int64)
    p_out = gl.expand_dims(tok_k, 1) * HEAD_DIM + gl.expand_dims(o_d, 0)
    gl.store(DK + p_out, (dk_t * scale).to(k_desc.dtype))
    gl.store(DV + p_out, dv_t.to(v_desc.dtype))


def bsa_backward_dkv_gluon(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    offsets: torch.Tensor,
    pairs: torch.Tensor,
    kmax: int,
    block_bias: torch.Tensor | None,
    kv_lengths: torch.Tensor | None,
    scale: float,
    q_stages: int = 3,
    warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The dK/dV pass of ``block_sparse.bsa_backward`` for q_tile = kv_block = 64 on Hopper,
    given the dQ pass's delta, ``build_kv_major_index``'s (offsets, pairs) and KMAX."""
    B, H, S, D = q.shape
    NQ = NSEG = S // BLOCK
    q_desc, k_desc, v_desc, do_desc = _descriptors(q, k, v, dout)
    dk = torch.empty((B, H, S, D), device=q.device, dtype=k.dtype)
    dv = torch.empty((B, H, S, D), device=q.device, dtype=v.dtype)
    dummy = torch.empty(1, device=q.device, dtype=torch.float32)
    bias = block_bias.contiguous() if block_bias is not None else dummy
    lens = kv_lengths.contiguous() if kv_lengths is not None else dummy.to(torch.int32)
    _bsa_bwd_dkv_gluon_kernel[(NSEG, B * H)](
        q_desc, k_desc, v_desc, do_desc, lse.contiguous(), delta, dk, dv, offsets, pairs, bias,
        lens, scale * 1.4426950408889634, scale, S, NQ, NSEG, kmax,
        HEAD_DIM=D, HAS_BIAS=block_bias is not None, HAS_LEN=kv_lengths is not None,
        Q_STAGES=q_stages, WARPS=warps, BLOCK=BLOCK, num_warps=warps,
    )  # fmt: skip
    return dk, dv
