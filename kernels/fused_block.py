"""Fused norms and elementwise ops of a Wan transformer block (diffusers 0.42
``WanTransformerBlock`` and its self-attention's q/k path), forward and backward in Triton.

Uncompiled, a Wan block spends more device time in LayerNorms, adaLN modulation
(shift / scale / gate), RMS qk-norm, RoPE and dtype casts than in its matmuls: each is several
memory-bound torch kernels over [B, N, C]. Each op here is one read and one write per token:

- ``modulated_layer_norm``: ``LN(x) * (1 + scale) + shift`` (norm1, norm3 and their adaLN);
- ``gated_residual_layer_norm``: ``h = x + y * gate`` and ``LN(h) * w + b`` (attn1's residual
  and norm2, the cross-attention norm, in one pass);
- ``gated_residual``: ``x + y * gate`` (the feed-forward residual);
- ``rms_norm_rope``: RMSNorm over all heads with a weight, then Wan's interleaved-pair RoPE
  (attn1's ``norm_q`` / ``norm_k`` and ``_rotate``).

Math follows diffusers: fp32 compute, LayerNorms without affine except norm2 (eps 1e-6), ``h``
rounded to the input dtype before norm2 reads it. Modulation tensors (shift, scale, gate) are
float32 ``[B, 1, C]`` (Wan2.1, Wan2.2-14B: broadcast over tokens, their gradients summed over
tokens) or ``[B, N, C]`` (Wan2.2-TI2V, one per token); they are read through strides, so the
chunks of ``scale_shift_table + temb`` need no copy.

Forward kernels run one program per token. Backward kernels that owe a gradient summed over
tokens (broadcast modulation, norm weights) run a few programs per batch row, each looping over
its share of the tokens with fp32 accumulators and writing one partial row; torch sums the
partials (the LayerNorm tutorial's two-stage reduction, without its locks).

Every op is a ``torch.autograd.Function`` with a pure-torch reference (``*_torch``, the unfused
math of ``vsa2_rl.models.wan``) behind ``backend=``: ``"auto"`` runs Triton on CUDA tensors or
under ``TRITON_INTERPRET=1``, and the reference for float64 inputs and while ``torch.compile``
traces (inductor then fuses the same math itself; the Triton Functions are not registered as
custom ops).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .ops import resolve_backend

__all__ = [
    "gated_residual",
    "gated_residual_layer_norm",
    "gated_residual_layer_norm_torch",
    "gated_residual_torch",
    "modulated_layer_norm",
    "modulated_layer_norm_torch",
    "rms_norm_rope",
    "rms_norm_rope_torch",
]


# -- kernels ---------------------------------------------------------------------------------------


@triton.jit
def _modulated_ln_fwd_kernel(
    x_ptr,
    shift_ptr,
    scale_ptr,
    y_ptr,
    mean_ptr,
    rstd_ptr,
    stride_mb,
    stride_mn,
    N,
    C,
    eps,
    BC: tl.constexpr,
):
    # one program per token (i_n, i_b): y = LN(x) * (1 + scale) + shift
    i_n, i_b = tl.program_id(0), tl.program_id(1)
    i_row = i_b.to(tl.int64) * N + i_n
    o_c = tl.arange(0, BC)
    m_c = o_c < C
    # [BC]
    b_x = tl.load(x_ptr + i_row * C + o_c, mask=m_c, other=0.0).to(tl.float32)
    b_mean = tl.sum(b_x, axis=0) / C
    b_xc = tl.where(m_c, b_x - b_mean, 0.0)
    b_rstd = tl.rsqrt(tl.sum(b_xc * b_xc, axis=0) / C + eps)
    o_mod = i_b.to(tl.int64) * stride_mb + i_n.to(tl.int64) * stride_mn + o_c
    b_shift = tl.load(shift_ptr + o_mod, mask=m_c, other=0.0).to(tl.float32)
    b_scale = tl.load(scale_ptr + o_mod, mask=m_c, other=0.0).to(tl.float32)
    b_y = b_xc * b_rstd * (1.0 + b_scale) + b_shift
    tl.store(y_ptr + i_row * C + o_c, b_y.to(y_ptr.dtype.element_ty), mask=m_c)
    tl.store(mean_ptr + i_row, b_mean)
    tl.store(rstd_ptr + i_row, b_rstd)


@triton.jit
def _modulated_ln_bwd_kernel(
    x_ptr,
    scale_ptr,
    dy_ptr,
    mean_ptr,
    rstd_ptr,
    dx_ptr,
    dshift_ptr,
    dscale_ptr,
    stride_mb,
    stride_mn,
    N,
    C,
    G,
    BC: tl.constexpr,
    PER_TOKEN: tl.constexpr,
):
    # program (i_g, i_b) takes tokens i_g, i_g + G, ... of batch row i_b. Per-token modulation:
    # dshift, dscale per token ([B, N, C]); broadcast: this program's sums ([B, G, C] partials)
    # int64 token loop: row offsets (and token x stride products) can pass 2**31
    i_g, i_b = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    o_c = tl.arange(0, BC)
    m_c = o_c < C
    b_dshift_sum = tl.zeros([BC], dtype=tl.float32)
    b_dscale_sum = tl.zeros([BC], dtype=tl.float32)
    for i_n in range(i_g, N, G):
        i_row = i_b * N + i_n
        b_x = tl.load(x_ptr + i_row * C + o_c, mask=m_c, other=0.0).to(tl.float32)
        b_dy = tl.load(dy_ptr + i_row * C + o_c, mask=m_c, other=0.0).to(tl.float32)
        b_rstd = tl.load(rstd_ptr + i_row)
        b_xhat = tl.where(m_c, (b_x - tl.load(mean_ptr + i_row)) * b_rstd, 0.0)
        o_mod = i_b * stride_mb + i_n * stride_mn + o_c
        b_scale = tl.load(scale_ptr + o_mod, mask=m_c, other=0.0).to(tl.float32)
        # -- LayerNorm backward of g = dL/dLN(x) ----
        b_g = b_dy * (1.0 + b_scale)
        b_dx = b_g - tl.sum(b_g, axis=0) / C - b_xhat * (tl.sum(b_g * b_xhat, axis=0) / C)
        tl.store(dx_ptr + i_row * C + o_c, (b_dx * b_rstd).to(dx_ptr.dtype.element_ty), mask=m_c)
        if PER_TOKEN:
            tl.store(dshift_ptr + i_row * C + o_c, b_dy, mask=m_c)
            tl.store(dscale_ptr + i_row * C + o_c, b_dy * b_xhat, mask=m_c)
        else:
            b_dshift_sum += b_dy
            b_dscale_sum += b_dy * b_xhat
    if not PER_TOKEN:
        o_part = (i_b * G + i_g) * C + o_c
        tl.store(dshift_ptr + o_part, b_dshift_sum, mask=m_c)
        tl.store(dscale_ptr + o_part, b_dscale_sum, mask=m_c)


@triton.jit
def _gated_residual_fwd_kernel(
    x_ptr,
    y_ptr,
    gate_ptr,
    w_ptr,
    b_ptr,
    h_ptr,
    n_ptr,
    mean_ptr,
    rstd_ptr,
    stride_gb,
    stride_gn,
    N,
    C,
    eps,
    BC: tl.constexpr,
    NORM: tl.constexpr,
):
    # one program per token: h = x + y * gate; with NORM also n = LN(h) * w + b
    i_n, i_b = tl.program_id(0), tl.program_id(1)
    i_row = i_b.to(tl.int64) * N + i_n
    o_c = tl.arange(0, BC)
    m_c = o_c < C
    o_gate = i_b.to(tl.int64) * stride_gb + i_n.to(tl.int64) * stride_gn + o_c
    b_x = tl.load(x_ptr + i_row * C + o_c, mask=m_c, other=0.0).to(tl.float32)
    b_y = tl.load(y_ptr + i_row * C + o_c, mask=m_c, other=0.0).to(tl.float32)
    b_gate = tl.load(gate_ptr + o_gate, mask=m_c, other=0.0).to(tl.float32)
    # the residual stream is stored (and read by the norm) in its own dtype, as diffusers does
    b_h = (b_x + b_y * b_gate).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + i_row * C + o_c, b_h, mask=m_c)
    if NORM:
        b_hf = b_h.to(tl.float32)
        b_mean = tl.sum(b_hf, axis=0) / C
        b_hc = tl.where(m_c, b_hf - b_mean, 0.0)
        b_rstd = tl.rsqrt(tl.sum(b_hc * b_hc, axis=0) / C + eps)
        b_w = tl.load(w_ptr + o_c, mask=m_c, other=0.0).to(tl.float32)
        b_b = tl.load(b_ptr + o_c, mask=m_c, other=0.0).to(tl.float32)
        b_n = b_hc * b_rstd * b_w + b_b
        tl.store(n_ptr + i_row * C + o_c, b_n.to(n_ptr.dtype.element_ty), mask=m_c)
        tl.store(mean_ptr + i_row, b_mean)
        tl.store(rstd_ptr + i_row, b_rstd)


@triton.jit
def _gated_residual_bwd_kernel(
    dh_ptr,
    dn_ptr,
    h_ptr,
    y_ptr,
    gate_ptr,
    w_ptr,
    mean_ptr,
    rstd_ptr,
    dx_ptr,
    dy_ptr,
    dgate_ptr,
    dw_ptr,
    db_ptr,
    stride_gb,
    stride_gn,
    N,
    C,
    G,
    BC: tl.constexpr,
    NORM: tl.constexpr,
    PER_TOKEN: tl.constexpr,
):
    # program (i_g, i_b) takes tokens i_g, i_g + G, ... of batch row i_b; gradients summed over
    # tokens (dw, db; dgate when the gate is broadcast) leave as [B, G, C] partials
    # int64 token loop: row offsets (and token x stride products) can pass 2**31
    i_g, i_b = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    o_c = tl.arange(0, BC)
    m_c = o_c < C
    b_dgate_sum = tl.zeros([BC], dtype=tl.float32)
    b_dw_sum = tl.zeros([BC], dtype=tl.float32)
    b_db_sum = tl.zeros([BC], dtype=tl.float32)
    if NORM:
        b_w = tl.load(w_ptr + o_c, mask=m_c, other=0.0).to(tl.float32)
    for i_n in range(i_g, N, G):
        i_row = i_b * N + i_n
        b_dh = tl.load(dh_ptr + i_row * C + o_c, mask=m_c, other=0.0).to(tl.float32)
        if NORM:
            # -- LayerNorm backward, added to the residual stream's own gradient ----
            b_dn = tl.load(dn_ptr + i_row * C + o_c, mask=m_c, other=0.0).to(tl.float32)
            b_h = tl.load(h_ptr + i_row * C + o_c, mask=m_c, other=0.0).to(tl.float32)
            b_rstd = tl.load(rstd_ptr + i_row)
            b_hhat = tl.where(m_c, (b_h - tl.load(mean_ptr + i_row)) * b_rstd, 0.0)
            b_g = b_dn * b_w
            b_dln = b_g - tl.sum(b_g, axis=0) / C - b_hhat * (tl.sum(b_g * b_hhat, axis=0) / C)
            b_dh += b_dln * b_rstd
            b_dw_sum += b_dn * b_hhat
            b_db_sum += b_dn
        # -- residual x + y * gate ----
        o_gate = i_b * stride_gb + i_n * stride_gn + o_c
        b_gate = tl.load(gate_ptr + o_gate, mask=m_c, other=0.0).to(tl.float32)
        b_y = tl.load(y_ptr + i_row * C + o_c, mask=m_c, other=0.0).to(tl.float32)
        tl.store(dx_ptr + i_row * C + o_c, b_dh.to(dx_ptr.dtype.element_ty), mask=m_c)
        tl.store(dy_ptr + i_row * C + o_c, (b_dh * b_gate).to(dy_ptr.dtype.element_ty), mask=m_c)
        if PER_TOKEN:
            tl.store(dgate_ptr + i_row * C + o_c, b_dh * b_y, mask=m_c)
        else:
            b_dgate_sum += b_dh * b_y
    o_part = (i_b * G + i_g) * C + o_c
    if not PER_TOKEN:
        tl.store(dgate_ptr + o_part, b_dgate_sum, mask=m_c)
    if NORM:
        tl.store(dw_ptr + o_part, b_dw_sum, mask=m_c)
        tl.store(db_ptr + o_part, b_db_sum, mask=m_c)


@triton.jit
def _pair_offsets(BP: tl.constexpr):
    """[BP, 2] channel offsets of BP interleaved pairs: row p holds channels 2p and 2p + 1."""
    return tl.arange(0, BP)[:, None] * 2 + tl.arange(0, 2)[None, :]


@triton.jit
def _rms_rope_fwd_kernel(
    x_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    rstd_ptr,
    stride_fn,
    stride_fd,
    N,
    C,
    eps,
    HALF_D: tl.constexpr,
    BP: tl.constexpr,
):
    # one program per token: y = x / rms(x) * w over all heads, then each head's pairs
    # (y[2j], y[2j+1]) rotated by the angle of pair j (cos[2j], sin[2j + 1] as Wan reads them)
    i_n, i_b = tl.program_id(0), tl.program_id(1)
    i_row = i_b.to(tl.int64) * N + i_n
    o_c = _pair_offsets(BP)
    m_c = o_c < C
    o_p = tl.arange(0, BP)
    m_p = o_p < C // 2
    # [BP, 2]
    b_x = tl.load(x_ptr + i_row * C + o_c, mask=m_c, other=0.0).to(tl.float32)
    b_rstd = tl.rsqrt(tl.sum(tl.sum(b_x * b_x, axis=1), axis=0) / C + eps)
    b_y = b_x * b_rstd * tl.load(w_ptr + o_c, mask=m_c, other=0.0).to(tl.float32)
    # [BP] angle of each pair, from its index inside its head
    o_f = cos_ptr + i_n.to(tl.int64) * stride_fn + (o_p % HALF_D) * 2 * stride_fd
    b_cos = tl.load(o_f, mask=m_p, other=0.0).to(tl.float32)
    o_f = sin_ptr + i_n.to(tl.int64) * stride_fn + ((o_p % HALF_D) * 2 + 1) * stride_fd
    b_sin = tl.load(o_f, mask=m_p, other=0.0).to(tl.float32)
    b_y1, b_y2 = tl.split(b_y)
    b_out = tl.join(b_y1 * b_cos - b_y2 * b_sin, b_y1 * b_sin + b_y2 * b_cos)
    tl.store(out_ptr + i_row * C + o_c, b_out.to(out_ptr.dtype.element_ty), mask=m_c)
    tl.store(rstd_ptr + i_row, b_rstd)


@triton.jit
def _rms_rope_bwd_kernel(
    x_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    dout_ptr,
    rstd_ptr,
    dx_ptr,
    dw_ptr,
    stride_fn,
    stride_fd,
    N,
    C,
    G,
    HALF_D: tl.constexpr,
    BP: tl.constexpr,
):
    # program (i_g, i_b) takes tokens i_g, i_g + G, ... of batch row i_b; dw leaves as
    # [B, G, C] partials
    # int64 token loop: row offsets (and token x stride products) can pass 2**31
    i_g, i_b = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    o_c = _pair_offsets(BP)
    m_c = o_c < C
    o_p = tl.arange(0, BP)
    m_p = o_p < C // 2
    b_w = tl.load(w_ptr + o_c, mask=m_c, other=0.0).to(tl.float32)
    b_dw_sum = tl.zeros([BP, 2], dtype=tl.float32)
    for i_n in range(i_g, N, G):
        i_row = i_b * N + i_n
        o_f = cos_ptr + i_n * stride_fn + (o_p % HALF_D) * 2 * stride_fd
        b_cos = tl.load(o_f, mask=m_p, other=0.0).to(tl.float32)
        o_f = sin_ptr + i_n * stride_fn + ((o_p % HALF_D) * 2 + 1) * stride_fd
        b_sin = tl.load(o_f, mask=m_p, other=0.0).to(tl.float32)
        # -- rotate the gradient back (the transpose of the rotation) ----
        b_do1, b_do2 = tl.split(
            tl.load(dout_ptr + i_row * C + o_c, mask=m_c, other=0.0).to(tl.float32)
        )
        b_dy = tl.join(b_do1 * b_cos + b_do2 * b_sin, b_do2 * b_cos - b_do1 * b_sin)
        # -- RMSNorm backward ----
        b_rstd = tl.load(rstd_ptr + i_row)
        b_xhat = tl.load(x_ptr + i_row * C + o_c, mask=m_c, other=0.0).to(tl.float32) * b_rstd
        b_dw_sum += b_dy * b_xhat
        b_g = b_dy * b_w
        b_dx = (b_g - b_xhat * (tl.sum(tl.sum(b_g * b_xhat, axis=1), axis=0) / C)) * b_rstd
        tl.store(dx_ptr + i_row * C + o_c, b_dx.to(dx_ptr.dtype.element_ty), mask=m_c)
    o_part = (i_b * G + i_g) * C + o_c
    tl.store(dw_ptr + o_part, b_dw_sum, mask=m_c)


# -- launch helpers --------------------------------------------------------------------------------


def _num_warps(block: int) -> int:
    return min(max(block // 256, 1), 8)


def _programs_per_batch_row(tokens: int, batch: int, device: torch.device) -> int:
    """G of the backward kernels: enough programs to fill the GPU (4 a multiprocessor), few
    enough that the [B, G, C] partials stay small. Under the interpreter 3, so that a test's
    dozen tokens already run each program's token loop several times."""
    if device.type != "cuda":
        return min(tokens, 3)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(tokens, 4 * sms // batch))


def _modulation_strides(mod: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(mod with unit channel stride, batch stride, token stride) of a [B, 1 | N, C] modulation
    tensor; the token stride of a broadcast [B, 1, C] tensor is 0."""
    B, N, C = x.shape
    if mod.dim() != 3 or mod.shape[0] != B or mod.shape[1] not in (1, N) or mod.shape[2] != C:
        raise ValueError(
            f"modulation must be [B, 1, C] or [B, N, C] = [{B}, 1 or {N}, {C}] for x of shape "
            f"{tuple(x.shape)}, got {tuple(mod.shape)}"
        )
    if mod.stride(2) != 1:
        mod = mod.contiguous()
    return mod, mod.stride(0), mod.stride(1) if mod.shape[1] == N and N > 1 else 0


def _summed_over_tokens(partials: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[B, G, C] partial sums -> the gradient of a broadcast [B, 1, C] tensor, in its dtype."""
    return partials.sum(dim=1, keepdim=True).to(like.dtype)


def _check_rows(x: torch.Tensor) -> None:
    if x.dim() != 3:
        raise ValueError(f"x must be [B, N, C], got shape {tuple(x.shape)}")


def _backend(backend: str, x: torch.Tensor) -> str:
    """``resolve_backend``; ``"auto"`` also picks the reference while ``torch.compile`` traces
    (inductor fuses it) and for float64 inputs (the kernels compute in fp32)."""
    if backend == "auto" and (torch.compiler.is_compiling() or x.dtype == torch.float64):
        return "torch"
    return resolve_backend(backend, x)


# -- modulated LayerNorm ---------------------------------------------------------------------------


class _ModulatedLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shift, scale, eps):
        B, N, C = x.shape
        x = x.contiguous()
        shift, stride_mb, stride_mn = _modulation_strides(shift, x)
        scale, *scale_strides = _modulation_strides(scale, x)
        if scale_strides != [stride_mb, stride_mn]:
            shift, scale = shift.contiguous(), scale.contiguous()
            _, stride_mb, stride_mn = _modulation_strides(shift, x)
        y = torch.empty_like(x)
        mean = x.new_empty((B, N), dtype=torch.float32)
        rstd = torch.empty_like(mean)
        BC = triton.next_power_of_2(C)
        _modulated_ln_fwd_kernel[(N, B)](
            x, shift, scale, y, mean, rstd, stride_mb, stride_mn, N, C, eps,
            BC=BC, num_warps=_num_warps(BC),
        )  # fmt: skip
        ctx.save_for_backward(x, scale, mean, rstd)
        ctx.strides = (stride_mb, stride_mn)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, scale, mean, rstd = ctx.saved_tensors
        B, N, C = x.shape
        per_token = scale.shape[1] == N and N > 1
        G = N if per_token else _programs_per_batch_row(N, B, x.device)
        dx = torch.empty_like(x)
        rows = (B, N, C) if per_token else (B, G, C)
        dshift = x.new_empty(rows, dtype=torch.float32)
        dscale = torch.empty_like(dshift)
        BC = triton.next_power_of_2(C)
        _modulated_ln_bwd_kernel[(G, B)](
            x, scale, dy.contiguous(), mean, rstd, dx, dshift, dscale, *ctx.strides, N, C, G,
            BC=BC, PER_TOKEN=per_token, num_warps=_num_warps(BC),
        )  # fmt: skip
        if not per_token:
            dshift, dscale = (_summed_over_tokens(d, scale) for d in (dshift, dscale))
        # shift and scale share shape and strides (the forward made them so)
        return dx, dshift.to(scale.dtype), dscale.to(scale.dtype), None


def modulated_layer_norm_torch(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """Reference of :func:`modulated_layer_norm`: diffusers' ``norm1`` / ``norm3`` with adaLN."""
    normed = F.layer_norm(x.float(), (x.shape[-1],), eps=eps)
    return (normed * (1 + scale) + shift).type_as(x)


def modulated_layer_norm(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float = 1e-6,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """``LayerNorm(x) * (1 + scale) + shift`` in fp32 (no affine), returned in ``x``'s dtype.

    Args:
        x: ``[B, N, C]``, bf16 / fp16 / fp32.
        shift, scale: ``[B, 1, C]`` (one per sample) or ``[B, N, C]`` (one per token), float32,
            any batch / token strides.
        backend: ``"triton"``, ``"torch"`` (:func:`modulated_layer_norm_torch`) or ``"auto"``
            (module docstring).

    Differentiable w.r.t. ``x``, ``shift`` and ``scale``.
    """
    _check_rows(x)
    if _backend(backend, x) == "torch":
        return modulated_layer_norm_torch(x, shift, scale, eps)
    if shift.shape != scale.shape:
        raise ValueError(f"shift and scale must share a shape, got {shift.shape}, {scale.shape}")
    return _ModulatedLayerNorm.apply(x, shift, scale, float(eps))


# -- gated residual (+ affine LayerNorm) -----------------------------------------------------------


class _GatedResidualNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, gate, weight, bias, eps):
        B, N, C = x.shape
        norm = weight is not None
        x, y = x.contiguous(), y.contiguous()
        gate, stride_gb, stride_gn = _modulation_strides(gate, x)
        h = torch.empty_like(x)
        n = torch.empty_like(x) if norm else None
        mean = x.new_empty((B, N), dtype=torch.float32) if norm else None
        rstd = torch.empty_like(mean) if norm else None
        BC = triton.next_power_of_2(C)
        _gated_residual_fwd_kernel[(N, B)](
            x, y, gate, weight, bias, h, n, mean, rstd, stride_gb, stride_gn, N, C, eps,
            BC=BC, NORM=norm, num_warps=_num_warps(BC),
        )  # fmt: skip
        ctx.save_for_backward(h, y, gate, weight, mean, rstd)
        ctx.meta = (x.dtype, bias.dtype if norm else None, stride_gb, stride_gn)
        return (h, n) if norm else h

    @staticmethod
    def backward(ctx, dh, dn=None):
        h, y, gate, weight, mean, rstd = ctx.saved_tensors
        x_dtype, bias_dtype, stride_gb, stride_gn = ctx.meta
        B, N, C = h.shape
        norm = weight is not None
        per_token = stride_gn != 0
        G = N if per_token and not norm else _programs_per_batch_row(N, B, h.device)
        dx = torch.empty_like(h, dtype=x_dtype)
        dy = torch.empty_like(y)
        partials = (B, G, C)
        dgate = h.new_empty((B, N, C) if per_token else partials, dtype=torch.float32)
        dw = h.new_empty(partials, dtype=torch.float32) if norm else None
        db = torch.empty_like(dw) if norm else None
        BC = triton.next_power_of_2(C)
        _gated_residual_bwd_kernel[(G, B)](
            dh.contiguous(), dn.contiguous() if norm else None, h, y, gate, weight, mean, rstd,
            dx, dy, dgate, dw, db, stride_gb, stride_gn, N, C, G,
            BC=BC, NORM=norm, PER_TOKEN=per_token, num_warps=_num_warps(BC),
        )  # fmt: skip
        dgate = dgate.to(gate.dtype) if per_token else _summed_over_tokens(dgate, gate)
        if norm:
            dw, db = dw.sum(dim=(0, 1)).to(weight.dtype), db.sum(dim=(0, 1)).to(bias_dtype)
        return dx, dy, dgate, dw, db, None


def gated_residual_torch(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Reference of :func:`gated_residual`: the Wan block's feed-forward residual."""
    return (x.float() + y.float() * gate).type_as(x)


def gated_residual_layer_norm_torch(
    x: torch.Tensor,
    y: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`gated_residual_layer_norm`: attn1's residual, then ``norm2``."""
    h = gated_residual_torch(x, y, gate)
    normed = F.layer_norm(h.float(), (h.shape[-1],), weight.float(), bias.float(), eps)
    return h, normed.type_as(h)


def gated_residual(
    x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, *, backend: str = "auto"
) -> torch.Tensor:
    """``x + y * gate`` in fp32, returned in ``x``'s dtype.

    Args:
        x, y: ``[B, N, C]`` (``y`` in any float dtype).
        gate: float32 ``[B, 1, C]`` or ``[B, N, C]``.

    Differentiable w.r.t. all three.
    """
    _check_rows(x)
    if _backend(backend, x) == "torch":
        return gated_residual_torch(x, y, gate)
    return _GatedResidualNorm.apply(x, y, gate, None, None, 0.0)


def gated_residual_layer_norm(
    x: torch.Tensor,
    y: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float = 1e-6,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + y * gate`` and ``n = LayerNorm(h) * weight + bias``, both in ``x``'s dtype.

    ``h`` is rounded to ``x``'s dtype before the norm reads it, as in diffusers' block.

    Args:
        x, y: ``[B, N, C]`` (``y`` in any float dtype).
        gate: float32 ``[B, 1, C]`` or ``[B, N, C]``.
        weight, bias: ``[C]``, the affine of the LayerNorm (any float dtype; gradients in it).

    Differentiable w.r.t. ``x``, ``y``, ``gate``, ``weight``, ``bias``.
    """
    _check_rows(x)
    if _backend(backend, x) == "torch":
        return gated_residual_layer_norm_torch(x, y, gate, weight, bias, eps)
    return _GatedResidualNorm.apply(x, y, gate, weight, bias, float(eps))


# -- RMSNorm + RoPE --------------------------------------------------------------------------------


class _RMSNormRoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, freqs_cos, freqs_sin, head_dim, eps):
        B, N, C = x.shape
        x = x.contiguous()
        out = torch.empty_like(x)
        rstd = x.new_empty((B, N), dtype=torch.float32)
        # [1, N, 1, D] tables: token and channel strides (a sequence-parallel slice is a view)
        strides = (freqs_cos.stride(1), freqs_cos.stride(3))
        if (freqs_sin.stride(1), freqs_sin.stride(3)) != strides:
            freqs_cos, freqs_sin = freqs_cos.contiguous(), freqs_sin.contiguous()
            strides = (freqs_cos.stride(1), freqs_cos.stride(3))
        BP = triton.next_power_of_2(C // 2)
        _rms_rope_fwd_kernel[(N, B)](
            x, weight, freqs_cos, freqs_sin, out, rstd, *strides, N, C, eps,
            HALF_D=head_dim // 2, BP=BP, num_warps=_num_warps(2 * BP),
        )  # fmt: skip
        ctx.save_for_backward(x, weight, freqs_cos, freqs_sin, rstd)
        ctx.meta = (head_dim, strides)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, weight, freqs_cos, freqs_sin, rstd = ctx.saved_tensors
        head_dim, strides = ctx.meta
        B, N, C = x.shape
        G = _programs_per_batch_row(N, B, x.device)
        dx = torch.empty_like(x)
        dw = x.new_empty((B, G, C), dtype=torch.float32)
        BP = triton.next_power_of_2(C // 2)
        # half the forward's warps: 0.13 ms against 0.14-0.17 ms with 8 (H100, 1.3B at 480p)
        _rms_rope_bwd_kernel[(G, B)](
            x, weight, freqs_cos, freqs_sin, dout.contiguous(), rstd, dx, dw, *strides, N, C, G,
            HALF_D=head_dim // 2, BP=BP, num_warps=_num_warps(BP),
        )  # fmt: skip
        return dx, dw.sum(dim=(0, 1)).to(weight.dtype), None, None, None, None


def _rotate_pairs(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor):
    """Wan's RoPE on [B, N, H, D]: pair (x[2j], x[2j+1]) turned by (cos[2j], sin[2j + 1])."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def rms_norm_rope_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    freqs_cos: torch.Tensor,
    freqs_sin: torch.Tensor,
    heads: int,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Reference of :func:`rms_norm_rope`, in fp32 like the Triton path."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps)
    return _rotate_pairs(normed.unflatten(2, (heads, -1)), freqs_cos, freqs_sin).type_as(x)


def rms_norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    freqs_cos: torch.Tensor,
    freqs_sin: torch.Tensor,
    heads: int,
    eps: float = 1e-6,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """RMSNorm over the last dim (all heads) with ``weight``, then Wan's interleaved RoPE.

    Args:
        x: ``[B, N, C]`` projected queries or keys, ``C = heads * D`` with D even.
        weight: ``[C]`` (``attn.norm_q.weight``); its gradient comes back in its dtype.
        freqs_cos, freqs_sin: ``[1, N, 1, D]`` (diffusers' ``WanRotaryPosEmbed`` output, any
            float dtype, any strides); read at ``cos[2j]`` and ``sin[2j + 1]`` for pair j.
        heads: H.

    Returns:
        ``[B, N, H, D]`` in ``x``'s dtype (a view of a ``[B, N, C]`` tensor). Differentiable
        w.r.t. ``x`` and ``weight`` (not the tables).
    """
    _check_rows(x)
    _, N, C = x.shape
    head_dim = C // heads
    if heads * head_dim != C or head_dim % 2:
        raise ValueError(f"C={C} must be heads={heads} times an even head dim")
    want = (1, N, 1, head_dim)
    if tuple(freqs_cos.shape) != want or tuple(freqs_sin.shape) != want:
        raise ValueError(
            f"freqs_cos, freqs_sin must be {list(want)}, got {list(freqs_cos.shape)}, "
            f"{list(freqs_sin.shape)}"
        )
    if _backend(backend, x) == "torch":
        return rms_norm_rope_torch(x, weight, freqs_cos, freqs_sin, heads, eps)
    out = _RMSNormRoPE.apply(x, weight, freqs_cos, freqs_sin, head_dim, float(eps))
    return out.unflatten(2, (heads, head_dim))
