"""VSA2 fine-grained router: which key segments each query tile attends to.

Scores are dot products of the mean-pooled queries of a 64-token tile with the mean-pooled keys
of a ``kv_block``-token segment (VSA's coarse scores, at segment granularity as in VSA2). Per
(batch, head, query tile) the router keeps a *variable* number of segments:

- ``topk``: the ``max_kv`` best segments, the fixed budget of VSA (Zhang et al., 2025);
- ``topp``: the smallest set of best segments whose softmax mass reaches ``top_p`` (nucleus
  selection, Holtzman et al., 2020), clamped to ``[min_kv, max_kv]``.

The sparsity setting caps the budget: ``max_kv = ceil((1 - sparsity) * NSEG_valid)``. Selection
runs on the device with the Triton kernel of ``topk_log_softmax`` (``torch.topk`` for rows of
more than ``TRITON_TOPK_MAX_SEGMENTS`` segments and on the torch backend): ``topk`` keeps the
KMAX winners, ``topp`` sorts them best first, takes a cumulative sum over their probabilities
and keeps the smallest prefix that reaches ``top_p``, returned in ascending id order. No host
sync and no per-token masks, so it can be captured in a CUDA graph at fixed shapes. The
selection itself is not differentiable; ``log_probs`` (the log-softmax at the selected ids) is,
and the fine stage adds ``alpha * log_probs`` to the logits so router gradients flow through it.
"""

import functools
import math
from typing import NamedTuple

import torch

from .ops import resolve_backend
from .topk import dense_score_grads, topk_log_softmax

_MODES = ("topk", "topp")
# rows up to this many segments take the Triton top-k (its row lives in registers), wider ones
# torch.topk; `benchmarks/tune_kernels.py --topk` times the two
TRITON_TOPK_MAX_SEGMENTS = 8192


class RouterOutput(NamedTuple):
    """Padded-CSR routing of query tiles to key segments (the format FlexAttention uses)."""

    kv_indices: torch.Tensor  # int32 [B, H, NQ, KMAX]; slots >= kv_counts hold -1; ascending
    # ids in "topp" mode and in "topk" mode on the Triton path, no set order with torch.topk
    kv_counts: torch.Tensor  # int32 [B, H, NQ], each in [min(min_kv, KMAX), KMAX]
    log_probs: torch.Tensor  # float32 [B, H, NQ, KMAX]; log-softmax of the scores, 0 if unused
    density: torch.Tensor  # float32 scalar: selected valid key tokens / valid key tokens


def _autocast_off(method):
    """Runs an autograd method (``ctx``, then a tensor on the work's device) with the caller's
    autocast off: it would round the float32 score GEMMs to 16 bits (16-bit pooled inputs still
    multiply on the tensor cores, see ``_scores_plus``)."""

    @functools.wraps(method)
    def run(ctx, tensor, *args):
        with torch.autocast(tensor.device.type, enabled=False):
            return method(ctx, tensor, *args)

    return run


class _TopLogProbs(torch.autograd.Function):
    """The selected segments of each row, their log-softmax and their count, lean in memory.

    Selects the ``kmax`` best segments of each row and, with ``top_p``, the smallest set of
    them whose softmax mass reaches ``top_p`` (clamped to ``[min(min_kv, kmax), kmax]``, the
    count), stored first in ascending id order, the other winners after them. Plain autograd
    would keep the full fp32 ``[B, H, NQ, NSEG]`` log-softmax for the backward: 0.9 GB per
    layer for Wan-14B at 720p (H=40, 1176 tiles, 4704 segments). This keeps only the pooled
    inputs, the selected ids and the row log-sum-exp, and recomputes the scores in the
    backward. Scores are computed in fp32 (float64 for float64 inputs, for gradcheck).
    """

    @staticmethod
    @_autocast_off
    def forward(
        ctx, q_pooled, k_seg_pooled, invalid, kmax: int, scale: float, top_p: float | None,
        min_kv: int, triton_select: bool,
    ):  # fmt: skip
        compute_dtype = torch.promote_types(q_pooled.dtype, torch.float32)
        mask_bias = _mask_bias(invalid, compute_dtype)
        nseg = k_seg_pooled.shape[2]
        if triton_select and compute_dtype == torch.float32 and nseg <= TRITON_TOPK_MAX_SEGMENTS:
            # one read of each row of the raw q . k (scale and mask applied as it loads) for the
            # threshold, ids, lse and the top-p count
            top_log_p, top_idx, lse, counts = topk_log_softmax(
                _raw_scores(q_pooled, k_seg_pooled), kmax, top_p, min_kv,
                scale=scale, mask_bias=mask_bias,
            )  # fmt: skip
        else:
            scores = _scores_plus(mask_bias, q_pooled, k_seg_pooled, scale)  # (B, H, NQ, NSEG)
            top_scores, top_idx = torch.topk(scores, kmax, dim=-1, sorted=top_p is not None)
            # log-sum-exp with the row max from top-k, in place: the scores are not needed any
            # more, so this costs no [B, H, NQ, NSEG] allocation and one pass fewer than
            # torch.logsumexp (the same formula and reductions, so the same bits)
            row_max = top_scores.amax(dim=-1, keepdim=True).clamp(
                min=torch.finfo(compute_dtype).min
            )
            lse = scores.sub_(row_max).exp_().sum(dim=-1, keepdim=True).log_().add_(row_max)
            top_log_p = top_scores - lse
            counts = None
            if top_p is not None:  # best first: keep the smallest prefix reaching top_p
                top_log_p, top_idx, counts = _keep_top_p(top_log_p, top_idx, top_p, min_kv, nseg)
        if counts is None:
            counts = torch.full(top_idx.shape[:-1], kmax, dtype=torch.int32, device=top_idx.device)
        ctx.save_for_backward(q_pooled, k_seg_pooled, mask_bias, top_idx, lse, top_log_p)
        ctx.scale = scale
        ctx.fused = triton_select and compute_dtype == torch.float32
        ctx.mark_non_differentiable(top_idx, counts)
        return top_log_p, top_idx, counts

    @staticmethod
    @_autocast_off
    def backward(ctx, grad_top, _grad_idx, _grad_counts):
        q_pooled, k_seg_pooled, mask_bias, top_idx, lse, top_log_p = ctx.saved_tensors
        # d log_softmax_j / d s_i = [i == j] - p_i, summed over the selected j:
        # grad_s = p * (-sum_j grad_j) + scatter(grad)
        if ctx.fused:
            return _fused_score_backward(
                q_pooled, k_seg_pooled, mask_bias, top_idx, lse, top_log_p, grad_top, ctx.scale
            )
        # p = exp(s - lse) comes out of one GEMM whose accumulator starts at (mask - lse), then
        # stays in that one buffer (in place)
        probs = _scores_plus(mask_bias - lse, q_pooled, k_seg_pooled, ctx.scale).exp_()
        grad_scores = probs.mul_(-grad_top.sum(dim=-1, keepdim=True).to(lse.dtype))
        # the ids of a row are distinct, so a gather + scatter adds without the atomics that
        # make scatter_add_ non-deterministic on the GPU
        picked = grad_scores.gather(-1, top_idx) + grad_top.to(lse.dtype)
        grad_scores.scatter_(-1, top_idx, picked)
        # the score scale is applied to the small [.., D] results, not to grad_scores
        grad_q = (grad_scores @ k_seg_pooled.to(lse.dtype)).mul_(ctx.scale)
        grad_k = (grad_scores.transpose(-1, -2) @ q_pooled.to(lse.dtype)).mul_(ctx.scale)
        return grad_q.to(q_pooled.dtype), grad_k.to(k_seg_pooled.dtype), *([None] * 6)


def _fused_score_backward(
    q_pooled, k_seg_pooled, mask_bias, top_idx, lse, top_log_p, grad_top, scale: float
):  # fmt: skip
    """The backward of ``_TopLogProbs`` on the Triton path (float32 scores): the raw scores from
    one GEMM, the dense term ``-grad_sum * p`` in one pass (``dense_score_grads``), the selected
    entries written from the saved log-probabilities, and the two GEMMs on the tensor cores in
    bf16 for 16-bit pooled inputs on CUDA (float32 accumulation), where the torch path runs a
    float32 mask-minus-lse buffer, two in-place passes and float32 GEMMs over the
    [B, H, NQ, NSEG] matrix."""
    B, H, NQ, D = q_pooled.shape
    NSEG = k_seg_pooled.shape[2]
    half_inputs = q_pooled.dtype in (torch.float16, torch.bfloat16) and q_pooled.is_cuda
    grad_dtype = torch.bfloat16 if half_inputs else torch.float32
    q3 = q_pooled.reshape(B * H, NQ, D)
    k3 = k_seg_pooled.reshape(B * H, NSEG, D)
    raw = _raw_scores(q_pooled, k_seg_pooled).view(B * H, NQ, NSEG)
    grad_sum = grad_top.sum(dim=-1, keepdim=True).to(torch.float32)  # (B, H, NQ, 1)
    grad_scores = dense_score_grads(raw, mask_bias, lse, grad_sum, scale, grad_dtype)
    del raw
    # the selected entries: -grad_sum * p + grad, with p from the saved log-probabilities (the
    # same scores); the ids of a row are distinct, so scatter_ needs no atomics
    picked = grad_top.to(torch.float32) - grad_sum * top_log_p.to(torch.float32).exp()
    grad_scores = grad_scores.view(B, H, NQ, NSEG).scatter_(-1, top_idx, picked.to(grad_dtype))
    g3 = grad_scores.view(B * H, NQ, NSEG)
    grad_q = _bmm(g3, k3.to(grad_dtype), half_inputs).mul_(scale)
    grad_k = _bmm(g3.transpose(1, 2), q3.to(grad_dtype), half_inputs).mul_(scale)
    return (
        grad_q.view(B, H, NQ, D).to(q_pooled.dtype),
        grad_k.view(B, H, NSEG, D).to(k_seg_pooled.dtype),
        *([None] * 6),
    )


def _raw_scores(q_pooled: torch.Tensor, k_seg_pooled: torch.Tensor) -> torch.Tensor:
    """``q . k`` as float32 (B, H, NQ, NSEG), before scale and mask: one GEMM that only writes
    (on the tensor cores for 16-bit inputs on CUDA, see ``_scores_plus``)."""
    B, H, NQ, D = q_pooled.shape
    NSEG = k_seg_pooled.shape[2]
    half_inputs = q_pooled.dtype in (torch.float16, torch.bfloat16) and q_pooled.is_cuda
    q3 = q_pooled.reshape(B * H, NQ, D)
    k3 = k_seg_pooled.reshape(B * H, NSEG, D).to(q3.dtype)
    return _bmm(q3, k3.transpose(1, 2), half_inputs).view(B, H, NQ, NSEG)


def _bmm(a: torch.Tensor, b: torch.Tensor, half_inputs: bool) -> torch.Tensor:
    """``a @ b`` in float32: 16-bit inputs on the tensor cores with a float32 result."""
    if half_inputs:
        return torch.bmm(a.to(b.dtype), b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


def _keep_top_p(top_log_p, top_idx, top_p: float, min_kv: int, nseg: int):
    """Torch path of the top-p selection of ``topk_log_softmax``: from the KMAX winners best
    first, the count of the smallest prefix whose mass reaches ``top_p`` (clamped to
    ``[min(min_kv, KMAX), KMAX]``), and the winners reordered as the kept ids ascending, then
    the others."""
    kmax = top_idx.shape[-1]
    probs = top_log_p.exp()
    # slot j is kept iff the mass of the better slots is still short of top_p
    mass_before = torch.cumsum(probs, dim=-1) - probs
    counts = (mass_before < top_p).sum(dim=-1).clamp(min=min(min_kv, kmax), max=kmax)
    kept = torch.arange(kmax, device=top_idx.device) < counts[..., None]
    order = torch.where(kept, top_idx, top_idx + nseg).argsort(dim=-1)
    return top_log_p.gather(-1, order), top_idx.gather(-1, order), counts.to(torch.int32)


def _mask_bias(invalid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[NSEG] additive score mask: -inf at segments without a valid token, 0 elsewhere."""
    return torch.zeros(invalid.shape, dtype=dtype, device=invalid.device).masked_fill_(
        invalid, float("-inf")
    )


def _scores_plus(init, q_pooled, k_seg_pooled, scale) -> torch.Tensor:
    """``init + scale * q . k`` as (B, H, NQ, NSEG) in ``init``'s dtype, from one GEMM (the
    torch path; the Triton top-k applies scale and mask itself to ``_raw_scores``).

    ``init`` (the [NSEG] mask, or a fresh [B, H, NQ, NSEG] mask minus the row lse) is the
    GEMM's starting accumulator (``baddbmm``, beta = 1), so scaling and masking cost no extra
    pass over the scores as ``* scale`` and ``masked_fill`` would. Half-precision pooled inputs
    on CUDA multiply on the tensor cores into a float32 result (``out_dtype``): their products
    are exact in float32, so this equals the float32 GEMM up to the order of the sums, at a
    fraction of its time (the tensor cores have no float32 path).
    """
    B, H, NQ, D = q_pooled.shape
    NSEG = k_seg_pooled.shape[2]
    half_inputs = q_pooled.dtype in (torch.float16, torch.bfloat16) and q_pooled.is_cuda
    gemm_dtype = q_pooled.dtype if half_inputs else init.dtype
    q3 = q_pooled.reshape(B * H, NQ, D).to(gemm_dtype)
    k3 = k_seg_pooled.reshape(B * H, NSEG, D).to(gemm_dtype).transpose(1, 2)
    if half_inputs:
        init3 = init.view(B * H, NQ, NSEG) if init.dim() == 4 else init.expand(B * H, NQ, NSEG)
        out = torch.baddbmm(init3, q3, k3, alpha=scale, out_dtype=init.dtype)
        return out.view(B, H, NQ, NSEG)
    if init.dim() == 4:  # in place: init is a fresh buffer
        return init.view(B * H, NQ, NSEG).baddbmm_(q3, k3, alpha=scale).view(B, H, NQ, NSEG)
    return torch.baddbmm(init, q3, k3, alpha=scale).view(B, H, NQ, NSEG)


def max_kv_for(sparsity: float, num_valid_segments: int) -> int:
    """Segment budget per query tile: ``clamp(ceil((1 - sparsity) * n), 1, n)``.

    A tolerance of 1e-6 keeps floating-point noise from adding a segment: ``(1 - 0.7) * 10`` is
    ``3.0000000000000004`` in binary floating point and must give 3, not 4.
    """
    budget = math.ceil((1.0 - sparsity) * num_valid_segments - 1e-6)
    return max(1, min(budget, num_valid_segments))


def count_valid_segments(seg_lengths: torch.Tensor) -> int:
    """Number of segments with at least one valid token (a host sync if on the device)."""
    return int((seg_lengths > 0).sum())


def route(
    q_pooled: torch.Tensor,
    k_seg_pooled: torch.Tensor,
    seg_lengths: torch.Tensor,
    *,
    sparsity: float,
    mode: str,
    top_p: float,
    min_kv: int,
    scale: float | None = None,
    num_valid_segments: int | None = None,
    backend: str = "auto",
) -> RouterOutput:
    """Select key segments per query tile from pooled queries and keys.

    Args:
        q_pooled: ``[B, H, NQ, D]`` mean-pooled queries per query tile.
        k_seg_pooled: ``[B, H, NSEG, D]`` mean-pooled keys per key segment.
        seg_lengths: int ``[NSEG]`` valid tokens per segment; segments of length 0 are masked
            to ``-inf`` and never selected. It may live on the CPU (where a layout keeps it) or
            on the device.
        sparsity: in ``[0, 1)``; sets the budget ``KMAX = max_kv_for(sparsity, NSEG_valid)``.
        mode: ``"topk"`` (count = KMAX everywhere) or ``"topp"`` (smallest prefix of the sorted
            softmax with mass >= ``top_p``, clamped to ``[min_kv, KMAX]``).
        top_p: in ``(0, 1]``, used by ``"topp"``.
        min_kv: >= 1, fewest segments per query tile in ``"topp"`` (capped at KMAX).
        scale: score scale, default ``1 / sqrt(D)``.
        num_valid_segments: ``NSEG_valid`` as a python int. KMAX is an output shape, so it must
            be known on the host: when None it is counted from ``seg_lengths``, which is free
            for a CPU tensor and one host sync for a device tensor. Pass it (e.g. from the tile
            layout) together with device-resident ``seg_lengths`` to keep the call sync-free
            and CUDA-graph capturable.
        backend: ``"auto"`` (the Triton top-k of ``topk_log_softmax`` on CUDA or under
            ``TRITON_INTERPRET=1``, for rows of at most ``TRITON_TOPK_MAX_SEGMENTS``
            segments), ``"triton"`` (the same rule) or ``"torch"`` (``torch.topk`` always).

    Returns:
        ``RouterOutput``; ``log_probs`` is float32 and differentiable w.r.t. both pooled inputs.
    """
    if mode not in _MODES:
        raise ValueError(f"mode={mode!r} is unknown; use one of {_MODES}")
    triton_select = resolve_backend(backend, q_pooled) == "triton"
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity={sparsity} must lie in [0, 1); 0 keeps every segment")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p} must lie in (0, 1]")
    if int(min_kv) != min_kv or min_kv < 1:
        raise ValueError(f"min_kv={min_kv} must be an integer >= 1")
    if q_pooled.dim() != 4 or k_seg_pooled.dim() != 4:
        raise ValueError(
            f"q_pooled and k_seg_pooled must be [B, H, N, D], got shapes "
            f"{tuple(q_pooled.shape)} and {tuple(k_seg_pooled.shape)}"
        )
    B, H, _, D = q_pooled.shape
    NSEG = k_seg_pooled.shape[2]
    if k_seg_pooled.shape[:2] != (B, H) or k_seg_pooled.shape[3] != D:
        raise ValueError(
            f"k_seg_pooled shape {tuple(k_seg_pooled.shape)} does not match q_pooled shape "
            f"{tuple(q_pooled.shape)} in B, H or D"
        )
    if seg_lengths.dim() != 1 or seg_lengths.shape[0] != NSEG or seg_lengths.is_floating_point():
        raise ValueError(
            f"seg_lengths must be an integer tensor of shape [NSEG] = [{NSEG}], "
            f"got dtype {seg_lengths.dtype} shape {tuple(seg_lengths.shape)}"
        )
    if num_valid_segments is None:
        num_valid_segments = count_valid_segments(seg_lengths)
    if not 1 <= num_valid_segments <= NSEG:
        raise ValueError(
            f"num_valid_segments={num_valid_segments} must lie in [1, NSEG={NSEG}]: at least one "
            "key segment needs a valid token"
        )
    kmax = max_kv_for(sparsity, num_valid_segments)
    scale = D**-0.5 if scale is None else scale

    seg_lengths = seg_lengths.to(device=q_pooled.device)
    # -- the selected segments and their log-softmax over the valid segments ----
    # KMAX <= NSEG_valid, so every one of them is a valid segment. Slots < count are used:
    # all KMAX in "topk" mode (ascending ids on the Triton path, no set order with torch.topk),
    # the top-p set in ascending id order in "topp" mode
    top_log_p, top_idx, counts = _TopLogProbs.apply(
        q_pooled, k_seg_pooled, seg_lengths == 0, kmax, scale,
        top_p if mode == "topp" else None, min_kv, triton_select,
    )  # fmt: skip
    top_log_p = top_log_p.float()
    used = torch.arange(kmax, device=q_pooled.device) < counts[..., None]  # (B, H, NQ, KMAX)
    kv_indices = torch.where(used, top_idx.to(torch.int32), -1)
    log_probs = torch.where(used, top_log_p, 0.0)

    # -- density: selected valid key tokens / valid key tokens, mean over (b, h, tile) ---------
    seg_tokens = seg_lengths.to(torch.float32)
    selected_tokens = (seg_tokens[top_idx] * used).sum(dim=-1)
    density = (selected_tokens / seg_tokens.sum()).mean()
    return RouterOutput(kv_indices, counts, log_probs, density)
