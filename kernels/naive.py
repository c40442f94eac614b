"""Pure-torch reference of VSA2 fine-stage block-sparse attention (the ``backend="torch"`` path).

Gathers, for every query tile, the keys and values of its selected segments, adds the per-pair
logit bias, masks padded keys and unused slots (one row of additive key terms a tile, shared by
its queries), and runs a softmax that gives zero output and gradients for a tile without a
valid key. Plain torch
autograd gives the gradients w.r.t. q, k, v and block_bias, so this is also what
``torch.autograd.gradcheck`` checks in float64. Memory grows with NQ * KMAX * kv_block * D per
head; query tiles are processed in chunks to bound it.
"""

from __future__ import annotations

import torch

# Upper bound on the number of gathered key elements (per chunk of query tiles) held at once.
_CHUNK_ELEMENTS = 1 << 26


def block_sparse_attention_torch(
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
    """Reference forward; same contract as ``block_sparse_attention``. Returns (out, lse)."""
    B, H, S, D = q.shape
    NQ, KMAX = kv_indices.shape[2], kv_indices.shape[3]
    NSEG = S // kv_block
    L = KMAX * kv_block
    per_tile = B * H * L * D
    chunk = max(1, min(NQ, _CHUNK_ELEMENTS // max(per_tile, 1)))

    o_slot = torch.arange(KMAX, device=q.device)
    o_w = torch.arange(kv_block, device=q.device)
    if kv_lengths is None:
        seg_len = torch.full((NSEG,), kv_block, device=q.device, dtype=torch.long)
    else:
        seg_len = kv_lengths.to(torch.long)

    # half-precision inputs are computed in float32, like the Triton kernels' accumulators
    cdtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    outs, lses = [], []
    for t0 in range(0, NQ, chunk):
        t1 = min(NQ, t0 + chunk)
        # (B, H, C, KMAX): padding slots are clamped to segment 0 and masked below
        b_used = o_slot < kv_counts[:, :, t0:t1, None]
        b_seg = torch.where(b_used, kv_indices[:, :, t0:t1].to(torch.long), 0)
        # (B, H, C, KMAX, kv_block)
        m_key = b_used[..., None] & (o_w < seg_len[b_seg][..., None])
        b_tok = (b_seg[..., None] * kv_block + o_w).flatten(-2)  # (B, H, C, L)
        C = t1 - t0
        k_g = torch.gather(k, 2, b_tok.reshape(B, H, C * L, 1).expand(-1, -1, -1, D))
        v_g = torch.gather(v, 2, b_tok.reshape(B, H, C * L, 1).expand(-1, -1, -1, D))
        k_g = k_g.view(B, H, C, L, D).to(cdtype)
        v_g = v_g.view(B, H, C, L, D).to(cdtype)
        q_c = q[:, :, t0 * q_tile : t1 * q_tile].reshape(B, H, C, q_tile, D).to(cdtype)
        # the tile's queries share its keys, so the bias and the masks are one row of additive
        # key terms (B, H, C, 1, L): the per-pair bias, -inf on padded keys and unused slots
        m_tile = m_key.flatten(-2).any(-1)[..., None, None]  # (B, H, C, 1, 1): any valid key
        key_terms = torch.zeros(m_key.shape, dtype=cdtype, device=q.device)
        if block_bias is not None:
            key_terms = key_terms + block_bias[:, :, t0:t1, :, None].to(cdtype)
        key_terms = key_terms.masked_fill(~m_key, float("-inf")).flatten(-2)[:, :, :, None, :]
        # a tile without any valid key gets finite logits here and zero output and gradients
        key_terms = torch.where(m_tile, key_terms, 0.0)
        # (B, H, C, q_tile, L)
        logits = torch.einsum("bhcqd,bhcld->bhcql", q_c * scale, k_g) + key_terms
        p = torch.softmax(logits, dim=-1)
        out_c = torch.einsum("bhcql,bhcld->bhcqd", p, v_g) * m_tile
        lse_c = torch.where(m_tile[..., 0], torch.logsumexp(logits, dim=-1), float("-inf"))
        outs.append(out_c.reshape(B, H, C * q_tile, D))
        lses.append(lse_c.reshape(B, H, C * q_tile))
    out = torch.cat(outs, dim=2).to(q.dtype)
    lse = torch.cat(lses, dim=2).float()
    return out, lse
