"""Row-wise top-k selection with log-softmax, one Triton program per row (the router's top-k),
and the row pass of its backward.

``topk_log_softmax`` selects KMAX of NSEG router scores per query tile together with the row
log-sum-exp, in place of ``torch.topk`` and the separate log-sum-exp passes around it; the
router uses it for rows of up to ``router.TRITON_TOPK_MAX_SEGMENTS`` segments. It reads each
row once and, in registers:

1. computes the row log-sum-exp (max, then sum of exp);
2. finds a threshold for the KMAX largest scores exactly by a bitwise binary search over the
   scores mapped to order-preserving unsigned integers (one counting pass over the row per bit,
   no sort), stopping once exactly KMAX scores reach it (about 16 of the 32 bits with distinct
   scores; all 32 only where ties straddle the KMAX-th place);
3. keeps every score above that threshold and, of the scores equal to it, the first ones in
   index order until KMAX are kept: exactly KMAX distinct ids even with ties;
4. writes the kept ids in ascending id order with their log-softmax values ``score - lse``;
5. for the router's "topp" mode, reads the KMAX winners back, finds the nucleus (the smallest
   set of best winners whose probability mass reaches top_p, ties in id order) and rewrites
   the winners as the kept ids ascending followed by the others ascending (the fine stage
   reads segments in id order). Up to ``SORTED_NUCLEUS_MAX`` winners it sorts them best first
   in registers (``tl.sort`` of (score key, id) packed into one integer) and counts the
   prefix; above, where a register sort of that many grows slow, it sorts nothing: a bitwise
   search over their keys for the largest threshold whose winners at or above it hold top_p of
   the mass (32 mass-weighted counts; a count search as in 2 where fewer than min_kv reach
   it), and positions from prefix sums.

The router hands it the raw GEMM output ``q . k``: score scale and segment mask are applied as
a row is loaded, so the GEMM writes without an expanded mask to start from.

``dense_score_grads`` is the backward's row pass: the dense term ``-grad_sum * softmax`` of the
score gradient from the raw scores ``q . k``, in one read, written in bf16 for the tensor-core
GEMMs of the pooled gradients (``router._fused_score_backward``).

``benchmarks/tune_kernels.py --topk`` times the kernel against ``torch.topk`` and the sort
against the search; docs/results.md ("Where the time goes") gives the router's share of the op.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _ordered_bits(x):
    """Float32 -> uint32 with the same order (larger float, larger integer; -inf lowest)."""
    bits = x.to(tl.uint32, bitcast=True)
    flip = tl.where((bits >> 31) != 0, 0xFFFFFFFF, 0x80000000).to(tl.uint32)
    return bits ^ flip


@triton.jit
def _count_threshold(b_key, n, N_PAD: tl.constexpr):
    """The largest t with count(b_key >= t) >= n, bit by bit from the top, stopping as soon as
    exactly n keys reach t (then every key >= t is one of the n largest): the n-th largest key,
    or a t between it and the next key up. Padding must hold key 0."""
    b_thr = tl.zeros([], tl.uint32)
    n_ge = tl.full([], N_PAD, tl.int32)  # count(key >= 0)
    i_bit = tl.full([], 31, tl.int32)
    while (i_bit >= 0) & (n_ge != n):
        b_try = b_thr | (tl.full([], 1, tl.uint32) << i_bit.to(tl.uint32))
        n_try = tl.sum((b_key >= b_try).to(tl.int32), 0)
        b_thr = tl.where(n_try >= n, b_try, b_thr)
        n_ge = tl.where(n_try >= n, n_try, n_ge)
        i_bit -= 1
    return b_thr


@triton.jit
def _load_scores(SCORES, MASK_BIAS, i_row, o_s, m_s, NSEG, SCALE, HAS_MASK: tl.constexpr):
    """``SCALE * s + mask`` at the ids ``o_s`` of row ``i_row``; -inf where ``m_s`` is off."""
    b_x = tl.load(SCORES + i_row * NSEG + o_s, mask=m_s, other=float("-inf")) * SCALE
    if HAS_MASK:
        b_x += tl.load(MASK_BIAS + o_s, mask=m_s, other=0.0)
    return b_x


@triton.jit
def _topk_log_softmax_kernel(
    SCORES, MASK_BIAS, TOP_LOGP, TOP_IDX, LSE, COUNTS, NSEG, KMAX, SCALE, TOP_P, MIN_KV,
    NSEG_PAD: tl.constexpr, KMAX_PAD: tl.constexpr, TOPP: tl.constexpr, HAS_MASK: tl.constexpr,
    SORT_NUCLEUS: tl.constexpr,
):  # fmt: skip
    i_row = tl.program_id(0).to(tl.int64)
    o_s = tl.arange(0, NSEG_PAD)
    m_s = o_s < NSEG
    b_x = _load_scores(SCORES, MASK_BIAS, i_row, o_s, m_s, NSEG, SCALE, HAS_MASK)

    # -- row log-sum-exp (natural log); the caller guarantees a finite score per row ----
    b_max = tl.max(b_x, 0)
    b_lse = b_max + tl.log(tl.sum(tl.exp(b_x - b_max), 0))
    tl.store(LSE + i_row, b_lse)

    # -- a threshold t with count(key >= t) = KMAX if one exists, else the KMAX-th largest key:
    # the largest t with count(key >= t) >= KMAX, bit by bit from the top, stopping as soon as
    # exactly KMAX keys reach t (about 16 of the 32 bits for distinct scores; every key kept
    # then lies at or above t, so the selection below is the same as with the exact key) ----
    # padding gets key 0, below every real score (-inf maps to 0x007FFFFF), so it never counts
    # past the first bit
    b_key = tl.where(m_s, _ordered_bits(b_x), tl.zeros([NSEG_PAD], tl.uint32))
    b_thr = _count_threshold(b_key, KMAX, NSEG_PAD)

    # -- keep all keys above it, and ties in id order up to KMAX ----
    m_above = b_key > b_thr
    m_tie = (b_key == b_thr) & m_s
    n_tie_room = KMAX - tl.sum(m_above.to(tl.int32), 0)
    m_keep = m_above | (m_tie & (tl.cumsum(m_tie.to(tl.int32), 0) <= n_tie_room))
    o_out = tl.cumsum(m_keep.to(tl.int32), 0) - 1
    tl.store(TOP_IDX + i_row * KMAX + o_out, o_s.to(tl.int64), mask=m_keep)
    tl.store(TOP_LOGP + i_row * KMAX + o_out, b_x - b_lse, mask=m_keep)
    if TOPP:
        if SORT_NUCLEUS:
            _keep_top_p_by_sort(SCORES, MASK_BIAS, TOP_LOGP, TOP_IDX, COUNTS, i_row, b_lse,
                                NSEG, KMAX, SCALE, TOP_P, MIN_KV, NSEG_PAD, KMAX_PAD,
                                HAS_MASK)  # fmt: skip
        else:
            _keep_top_p_by_search(TOP_LOGP, TOP_IDX, COUNTS, i_row, KMAX, TOP_P, MIN_KV, KMAX_PAD)


@triton.jit
def _keep_top_p_by_search(
    TOP_LOGP, TOP_IDX, COUNTS, i_row, KMAX, TOP_P, MIN_KV, KMAX_PAD: tl.constexpr
):
    """Top-p among the row's KMAX winners, stored ascending: the smallest set of best winners
    (ties in id order) whose probability mass reaches TOP_P, clamped to [min(MIN_KV, KMAX),
    KMAX], rewritten as those ids ascending, then the other winners ascending, with the count
    in COUNTS. No sort: bitwise threshold searches over the winners' keys, then prefix sums."""
    tl.debug_barrier()  # the winners stored above are read back by other threads
    o_k = tl.arange(0, KMAX_PAD)
    m_k = o_k < KMAX
    b_id = tl.load(TOP_IDX + i_row * KMAX + o_k, mask=m_k, other=0)
    b_logp = tl.load(TOP_LOGP + i_row * KMAX + o_k, mask=m_k, other=float("-inf"))
    b_p = tl.exp(b_logp)  # 0 in the padding
    b_key = tl.where(m_k, _ordered_bits(b_logp), 0)  # the padding below every winner
    # -- the largest threshold t whose winners at or above it hold >= TOP_P of the mass (a
    # winner's key, or 0 = all of them where their whole mass falls short) ----
    b_thr = tl.zeros([], tl.uint32)
    i_bit = tl.full([], 31, tl.int32)
    while i_bit >= 0:
        b_try = b_thr | (tl.full([], 1, tl.uint32) << i_bit.to(tl.uint32))
        b_thr = tl.where(tl.sum(tl.where(b_key >= b_try, b_p, 0.0), 0) >= TOP_P, b_try, b_thr)
        i_bit -= 1
    # -- fewer than min(MIN_KV, KMAX) reach it: the largest t with that many at or above ----
    n_min = tl.minimum(MIN_KV, KMAX)
    if tl.sum((b_key >= b_thr).to(tl.int32), 0) < n_min:
        b_thr = _count_threshold(b_key, n_min, KMAX_PAD)
    # -- keep all winners above it and, of those at it (id order = rank order), each whose
    # better winners hold less than TOP_P or number fewer than n_min ----
    m_above = b_key > b_thr
    m_tie = (b_key == b_thr) & m_k
    b_tie_p = tl.where(m_tie, b_p, 0.0)
    b_mass_before = tl.sum(tl.where(m_above, b_p, 0.0), 0) + tl.cumsum(b_tie_p, 0) - b_tie_p
    b_rank = tl.sum(m_above.to(tl.int32), 0) + tl.cumsum(m_tie.to(tl.int32), 0) - 1
    m_keep = m_above | (m_tie & ((b_mass_before < TOP_P) | (b_rank < n_min)))
    n_keep = tl.sum(m_keep.to(tl.int32), 0)
    # kept ids ascending, then the other winners ascending
    o_out = tl.where(
        m_keep, tl.cumsum(m_keep.to(tl.int32), 0), n_keep + tl.cumsum((m_k & ~m_keep).to(tl.int32), 0)
    ) - 1  # fmt: skip
    tl.debug_barrier()  # every thread has read the winners before they are overwritten
    tl.store(TOP_IDX + i_row * KMAX + o_out, b_id, mask=m_k)
    tl.store(TOP_LOGP + i_row * KMAX + o_out, b_logp, mask=m_k)
    tl.store(COUNTS + i_row, n_keep)


@triton.jit
def _keep_top_p_by_sort(
    SCORES, MASK_BIAS, TOP_LOGP, TOP_IDX, COUNTS, i_row, b_lse, NSEG, KMAX, SCALE, TOP_P, MIN_KV,
    NSEG_PAD: tl.constexpr, KMAX_PAD: tl.constexpr, HAS_MASK: tl.constexpr,
):  # fmt: skip
    """``_keep_top_p_by_search``'s result by sorting the winners in registers: faster for up to
    ``SORTED_NUCLEUS_MAX`` winners, far slower above (see ``SORTED_NUCLEUS_MAX``)."""
    tl.debug_barrier()  # the winners stored above are read back by other threads
    o_k = tl.arange(0, KMAX_PAD)
    m_k = o_k < KMAX
    b_id = tl.load(TOP_IDX + i_row * KMAX + o_k, mask=m_k, other=0)
    b_key = tl.where(m_k, _ordered_bits(tl.load(TOP_LOGP + i_row * KMAX + o_k, mask=m_k)), 0)
    # best first, ties in id order: sort (key, NSEG_PAD - 1 - id) descending as one integer
    b_pack = (b_key.to(tl.uint64) << 32) | (NSEG_PAD - 1 - b_id).to(tl.uint64)
    b_best = NSEG_PAD - 1 - (tl.sort(b_pack, descending=True) & 0xFFFFFFFF).to(tl.int64)
    b_s = _load_scores(SCORES, MASK_BIAS, i_row, b_best, m_k, NSEG, SCALE, HAS_MASK)
    b_p = tl.where(m_k, tl.exp(b_s - b_lse), 0.0)
    # slot j is kept iff the mass of the better slots is still short of TOP_P
    n_keep = tl.sum(((tl.cumsum(b_p, 0) - b_p < TOP_P) & m_k).to(tl.int32), 0)
    n_keep = tl.minimum(tl.maximum(n_keep, tl.minimum(MIN_KV, KMAX)), KMAX)
    # kept ids ascending, then the other winners ascending (padding last)
    b_rank = tl.where(o_k < n_keep, 0, 1) + tl.where(m_k, 0, 1)
    b_pack = (b_rank.to(tl.uint64) << 32) | b_best.to(tl.uint64)
    b_out = (tl.sort(b_pack) & 0xFFFFFFFF).to(tl.int64)
    b_logp = _load_scores(SCORES, MASK_BIAS, i_row, b_out, m_k, NSEG, SCALE, HAS_MASK) - b_lse
    tl.debug_barrier()  # every thread has read the winners before they are overwritten
    tl.store(TOP_IDX + i_row * KMAX + o_k, b_out, mask=m_k)
    tl.store(TOP_LOGP + i_row * KMAX + o_k, b_logp, mask=m_k)
    tl.store(COUNTS + i_row, n_keep)


# warps per row (``benchmarks/tune_kernels.py --topk`` compares them): more warps wait longer on
# the cross-warp sums of the threshold search, fewer hold too many of a wide row's scores each
NUM_WARPS = 4
# top-p sorts the winners in registers up to this many (padded to a power of two), where the
# sort is the faster of the two, and searches a mass threshold above it, where the sort's cost
# grows far faster than the search's (``benchmarks/tune_kernels.py --topk`` times both)
SORTED_NUCLEUS_MAX = 256


def topk_log_softmax(
    scores: torch.Tensor,
    kmax: int,
    top_p: float | None = None,
    min_kv: int = 1,
    *,
    scale: float = 1.0,
    mask_bias: torch.Tensor | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The ``kmax`` largest entries of each row of ``scale * scores + mask_bias``, float32
    ``scores [..., NSEG]`` and ``mask_bias [NSEG]`` (0 where None), and with ``top_p`` the
    nucleus among them. Scale and mask are applied as the kernel loads the row, so the raw GEMM
    output ``q . k`` needs no pass of its own.

    Returns ``(log_probs, ids, lse, counts)``: ``log_probs`` float32 ``[..., kmax]`` = score -
    lse at the kept ids; ``ids`` int64 ``[..., kmax]``, distinct (ascending without ``top_p``);
    ``lse`` float32 ``[..., 1]`` the row log-sum-exp. With ``top_p``, ``counts`` int32 ``[...]``
    is the size of the smallest set of best winners whose softmax mass reaches ``top_p`` (ties
    in id order), clamped to ``[min(min_kv, kmax), kmax]``, and the first ``counts`` slots of a
    row hold that set, ascending, the rest the other winners, ascending; without it ``counts``
    is None. Every
    row needs at least ``kmax`` scores above -inf (the router's budget never exceeds its valid
    segments). No host synchronisation. ``num_warps`` per row (a power of two) overrides
    ``NUM_WARPS`` (``benchmarks/tune_kernels.py --topk`` times the choices).
    """
    if scores.dtype != torch.float32:
        raise ValueError(f"scores must be float32, got {scores.dtype}")
    nseg = scores.shape[-1]
    if not 1 <= kmax <= nseg:
        raise ValueError(f"kmax={kmax} must lie in [1, NSEG={nseg}]")
    rows = scores.numel() // nseg
    scores = scores.contiguous()
    log_probs = torch.empty((*scores.shape[:-1], kmax), device=scores.device)
    ids = torch.empty((*scores.shape[:-1], kmax), device=scores.device, dtype=torch.int64)
    lse = torch.empty((*scores.shape[:-1], 1), device=scores.device)
    counts = None
    if top_p is not None:
        counts = torch.empty(scores.shape[:-1], device=scores.device, dtype=torch.int32)
    nseg_pad, kmax_pad = triton.next_power_of_2(nseg), triton.next_power_of_2(kmax)
    if mask_bias is not None and mask_bias.shape != (nseg,):
        raise ValueError(
            f"mask_bias must have shape [NSEG] = [{nseg}], got {tuple(mask_bias.shape)}"
        )
    _topk_log_softmax_kernel[(rows,)](
        scores, mask_bias, log_probs, ids, lse, counts, nseg, kmax, float(scale),
        1.0 if top_p is None else float(top_p), min_kv,
        NSEG_PAD=nseg_pad, KMAX_PAD=kmax_pad, TOPP=top_p is not None,
        HAS_MASK=mask_bias is not None, SORT_NUCLEUS=kmax_pad <= SORTED_NUCLEUS_MAX,
        num_warps=num_warps or NUM_WARPS,
    )  # fmt: skip
    return log_probs, ids, lse, counts


@triton.jit
def _dense_score_grad_kernel(
    SCORES, MASK_BIAS, LSE, GRAD_SUM, OUT, NSEG, SCALE, BLOCK: tl.constexpr,
):  # fmt: skip
    """One ``BLOCK``-wide chunk of a row: ``-grad_sum * exp(scale * s + mask - lse)``."""
    i_row, i_chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_s = i_chunk * BLOCK + tl.arange(0, BLOCK)
    m_s = o_s < NSEG
    # [BLOCK]
    b_s = tl.load(SCORES + i_row * NSEG + o_s, mask=m_s, other=0.0)
    b_mask = tl.load(MASK_BIAS + o_s, mask=m_s, other=float("-inf"))
    b_p = tl.exp(b_s * SCALE + b_mask - tl.load(LSE + i_row))
    b_g = -tl.load(GRAD_SUM + i_row) * b_p
    tl.store(OUT + i_row * NSEG + o_s, b_g.to(OUT.dtype.element_ty), mask=m_s)


def dense_score_grads(
    raw_scores: torch.Tensor,
    mask_bias: torch.Tensor,
    lse: torch.Tensor,
    grad_sum: torch.Tensor,
    scale: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The dense part of the router's score gradient, ``-grad_sum * softmax(scores)``, in one
    pass over float32 ``raw_scores [..., NSEG]`` (``q . k`` before scale and mask), written in
    ``out_dtype`` (bf16 for the tensor-core GEMMs that follow). ``mask_bias [NSEG]``, ``lse``
    and ``grad_sum`` ``[..., 1]`` float32. Replaces a float32 ``[..., NSEG]`` mask-minus-lse
    buffer, an ``exp_`` and a ``mul_`` pass of torch (three reads and writes of the matrix)."""
    nseg = raw_scores.shape[-1]
    rows = raw_scores.numel() // nseg
    out = torch.empty(raw_scores.shape, device=raw_scores.device, dtype=out_dtype)
    block = min(1024, triton.next_power_of_2(nseg))
    _dense_score_grad_kernel[(rows, triton.cdiv(nseg, block))](
        raw_scores, mask_bias, lse.contiguous(), grad_sum.contiguous(), out, nseg, scale,
        BLOCK=block,
    )  # fmt: skip
    return out
