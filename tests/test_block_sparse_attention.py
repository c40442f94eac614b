"""Tests of the VSA2 fine stage ``block_sparse_attention`` (vsa2_rl.kernels.ops).

Every backend is compared with an independent dense reference: explicit per-token masks and a
dense bias matrix built from the selection, softmax in float64 (float32 chunks on the GPU), and
gradients from autograd. The Triton kernels run under ``TRITON_INTERPRET=1`` on CPU (fp32 and
fp16; the interpreter has no bf16 dot) and natively in the ``gpu`` tests.
"""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path

import pytest
import torch

import vsa2_rl.kernels
import vsa2_rl.kernels.ops
from vsa2_rl.kernels.block_sparse import BWD_PATHS, build_kv_major_index
from vsa2_rl.kernels.block_sparse_fused import key_range_bounds
from vsa2_rl.kernels.ops import block_sparse_attention


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def make_selection(B, H, NQ, NSEG, KMAX, device="cpu", *, full_rows=True, empty_rows=True):
    """Random distinct ids per row, counts in [0, KMAX] with at least one empty and one full row."""
    ids = torch.rand(B, H, NQ, NSEG, device=device).argsort(-1)[..., :KMAX].to(torch.int32)
    counts = torch.randint(0, KMAX + 1, (B, H, NQ), device=device, dtype=torch.int32)
    if full_rows:
        counts[0, 0, -1] = KMAX
    if empty_rows:
        counts[-1, -1, 0] = 0
    # unused slots hold garbage the kernel must never read
    m_unused = torch.arange(KMAX, device=device) >= counts.unsqueeze(-1)
    ids = torch.where(m_unused, torch.full_like(ids, -7), ids)
    return ids, counts


def dense_reference(q, k, v, ids, counts, bias, lens, q_tile, kv_block, scale, t0=0, t1=None):
    """out, lse of query tiles [t0, t1) from explicit token masks (differentiable, no gathers)."""
    B, H, S, _ = q.shape
    NQ, KMAX = ids.shape[2], ids.shape[3]
    t1 = NQ if t1 is None else t1
    NSEG = S // kv_block
    device = q.device
    # slot_of[b, h, t, seg] = slot that selected seg, or -1; unused slots scatter to a spare column
    m_used = torch.arange(KMAX, device=device) < counts[:, :, t0:t1, None]
    tgt = torch.where(m_used, ids[:, :, t0:t1].long(), NSEG)
    slot_of = torch.full((B, H, t1 - t0, NSEG + 1), -1, dtype=torch.long, device=device)
    slot_of.scatter_(3, tgt, torch.arange(KMAX, device=device).expand_as(tgt).clone())
    slot_of = slot_of[..., :NSEG]
    # token level: rows of tiles [t0, t1), all keys
    slot_tok = slot_of.repeat_interleave(q_tile, 2).repeat_interleave(kv_block, 3)
    seg_len = torch.full((NSEG,), kv_block, device=device) if lens is None else lens.long()
    key_ok = torch.arange(S, device=device) % kv_block < seg_len.repeat_interleave(kv_block)
    mask = (slot_tok >= 0) & key_ok
    q_rows = q[:, :, t0 * q_tile : t1 * q_tile]
    logits = torch.einsum("bhqd,bhkd->bhqk", q_rows, k) * scale
    if bias is not None:
        bias_rows = bias[:, :, t0:t1].repeat_interleave(q_tile, 2).to(logits.dtype)
        logits = logits + torch.where(mask, bias_rows.gather(3, slot_tok.clamp_min(0)), 0.0)
    logits = logits.masked_fill(~mask, float("-inf"))
    m_row = mask.any(-1, keepdim=True)
    safe = torch.where(m_row, logits, 0.0)
    # a finite floor instead of -inf keeps logsumexp's gradient finite on empty rows
    floor = torch.finfo(logits.dtype).min
    lse = torch.where(m_row, torch.logsumexp(torch.where(mask, safe, floor), -1, keepdim=True), 0.0)
    p = torch.where(mask, torch.exp(safe - lse), 0.0)
    out = p @ v
    lse = torch.where(m_row, lse, float("-inf")).squeeze(-1)
    return out, lse


def loss_of(out, lse, g_out, g_lse):
    """A scalar using out and the finite lse entries, so the backward also carries dLSE."""
    return (out.double() * g_out).sum() + torch.where(
        torch.isfinite(lse), lse.double() * g_lse, 0.0
    ).sum()


def run_case(
    B, H, S, D, q_tile, kv_block, KMAX, dtype, backend, *, bias=True, lens=True, device="cpu",
    bwd="two_pass",
):  # fmt: skip
    NQ, NSEG = S // q_tile, S // kv_block
    qkv = [torch.randn(B, H, S, D, device=device).to(dtype) for _ in range(3)]
    ids, counts = make_selection(B, H, NQ, NSEG, KMAX, device)
    b_bias = torch.randn(B, H, NQ, KMAX, device=device) if bias else None
    seg_len = None
    if lens:
        seg_len = torch.randint(0, kv_block + 1, (NSEG,), device=device, dtype=torch.int32)
        seg_len[:3] = torch.tensor(
            [1, 0, kv_block], dtype=torch.int32
        )  # one-token and empty segments
    scale = 1.0 / math.sqrt(D)
    g_out = torch.randn(B, H, S, D, device=device, dtype=torch.float64)
    g_lse = torch.randn(B, H, S, device=device, dtype=torch.float64)

    # -- kernel under test ----
    leaves = [x.clone().requires_grad_() for x in qkv]
    b_leaf = b_bias.clone().requires_grad_() if bias else None
    out, lse = block_sparse_attention(
        *leaves,
        ids,
        counts,
        b_leaf,
        q_tile=q_tile,
        kv_block=kv_block,
        kv_lengths=seg_len,
        backend=backend,
        bwd=bwd,
    )
    assert out.dtype == dtype and lse.dtype == torch.float32
    grads = torch.autograd.grad(
        loss_of(out, lse, g_out, g_lse), [*leaves, *([b_leaf] if bias else [])]
    )

    # -- float64 reference from the same (rounded) inputs ----
    ref_leaves = [x.double().requires_grad_() for x in qkv]
    ref_bias = b_bias.double().requires_grad_() if bias else None
    ref_out, ref_lse = dense_reference(
        *ref_leaves, ids, counts, ref_bias, seg_len, q_tile, kv_block, scale
    )
    ref_grads = torch.autograd.grad(
        loss_of(ref_out, ref_lse, g_out, g_lse), [*ref_leaves, *([ref_bias] if bias else [])]
    )
    return (out, lse, grads), (ref_out, ref_lse, ref_grads), counts


def check(got, ref, counts, tol, q_tile):
    out, lse, grads = got
    ref_out, ref_lse, ref_grads = ref
    for name, x in zip(("out", "dq", "dk", "dv", "dbias"), (out, *grads), strict=False):
        assert torch.isfinite(x).all(), f"{name} has non-finite entries"
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "lse -inf pattern differs"
    fin = torch.isfinite(ref_lse)
    assert rel_rms(lse[fin], ref_lse[fin]) < tol, "lse"
    assert rel_rms(out, ref_out) < tol, f"out {rel_rms(out, ref_out)}"
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads, strict=False):
        assert rel_rms(g, r) < tol, f"{name} rel-rms {rel_rms(g, r):.2e}"
    # empty rows: exactly zero output and zero query gradient
    m_empty = (counts == 0).repeat_interleave(q_tile, 2)
    assert (out[m_empty] == 0).all() and (grads[0][m_empty] == 0).all()
    if len(grads) == 4:
        m_unused = torch.arange(grads[3].shape[-1]) >= counts.unsqueeze(-1)
        assert (grads[3][m_unused] == 0).all(), "unused slots got a bias gradient"


CPU_CASES = [
    # B, H, S, D, q_tile, kv_block, KMAX, dtype, bias, lens
    pytest.param(1, 2, 192, 64, 64, 16, 5, torch.float32, True, True, id="nq3-kv16-f32"),
    pytest.param(2, 1, 320, 64, 64, 32, 4, torch.float32, True, True, id="nq5-kv32-f32"),
    pytest.param(1, 1, 256, 64, 64, 64, 4, torch.float32, True, False, id="kv64-kmax=nseg-f32"),
    pytest.param(1, 2, 320, 64, 64, 64, 3, torch.float16, True, True, id="kv64-lens-f16"),
    pytest.param(1, 2, 256, 64, 64, 16, 7, torch.float16, True, True, id="kv16-f16"),
    pytest.param(2, 1, 192, 32, 64, 32, 3, torch.float16, False, False, id="nobias-d32-f16"),
]


@pytest.mark.nan_empty
@pytest.mark.parametrize("B,H,S,D,q_tile,kv_block,KMAX,dtype,bias,lens", CPU_CASES)
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_matches_float64_reference(B, H, S, D, q_tile, kv_block, KMAX, dtype, bias, lens, backend):
    got, ref, counts = run_case(
        B, H, S, D, q_tile, kv_block, KMAX, dtype, backend, bias=bias, lens=lens
    )
    check(got, ref, counts, 1e-5 if dtype == torch.float32 else 4e-3, q_tile)


@pytest.mark.nan_empty
@pytest.mark.parametrize("kv_block", [16, 64])
def test_pointer_gather_path_without_tma_matches_float64_reference(kv_block, monkeypatch):
    # GPUs before Hopper and unaligned strides load rows by pointers instead of TMA copies
    import vsa2_rl.kernels.block_sparse as block_sparse

    monkeypatch.setattr(block_sparse, "_tma_descriptors", lambda rows, *tensors: (tensors, False))
    got, ref, counts = run_case(1, 2, 320, 64, 64, kv_block, 5, torch.float32, "triton")
    check(got, ref, counts, 1e-5, 64)


@pytest.mark.nan_empty
@pytest.mark.parametrize("kv_block", [16, 64])
def test_dkv_pass_gathering_two_query_tiles_matches_float64_reference(kv_block, monkeypatch):
    # the GPU autotuner may gather QG = 2 selecting tiles per step of the dK/dV pass (pointer
    # gathers instead of TMA copies); the interpreter's own config is QG = 1
    import triton

    import vsa2_rl.kernels.block_sparse as block_sparse

    kernel = block_sparse._bsa_bwd_dkv_kernel
    monkeypatch.setattr(kernel, "configs", [triton.Config({"QG": 2}, num_warps=4, num_stages=1)])
    kernel.cache.clear()
    try:
        got, ref, counts = run_case(1, 2, 320, 64, 64, kv_block, 5, torch.float32, "triton")
    finally:
        kernel.cache.clear()  # the next test must autotune among its own configs again
    check(got, ref, counts, 1e-5, 64)


# -- the fused backward (bwd="fused"): one query-major pass, dK/dV by float32 atomic adds -------


@pytest.mark.nan_empty
@pytest.mark.parametrize("B,H,S,D,q_tile,kv_block,KMAX,dtype,bias,lens", CPU_CASES)
def test_fused_backward_matches_float64_reference(
    B, H, S, D, q_tile, kv_block, KMAX, dtype, bias, lens
):
    got, ref, counts = run_case(
        B, H, S, D, q_tile, kv_block, KMAX, dtype, "triton", bias=bias, lens=lens, bwd="fused"
    )
    check(got, ref, counts, 1e-5 if dtype == torch.float32 else 4e-3, q_tile)


@pytest.mark.nan_empty
@pytest.mark.parametrize(
    "kv_block,ranges,dtype",
    [
        (16, 3, torch.float32),
        (32, 2, torch.float32),
        (64, 4, torch.float32),
        (16, 5, torch.float16),
    ],
)
def test_fused_backward_over_key_ranges_matches_float64_reference(
    kv_block, ranges, dtype, monkeypatch
):
    # on the GPU the launcher splits the keys into ranges that fit L2: rows sorted by segment id,
    # dQ added atomically over the ranges, d(bias) scattered back to the given slot order; the
    # selection is unsorted, with variable counts, an empty row and a full one
    monkeypatch.setenv("VSA2_RL_BWD_KEY_RANGES", str(ranges))
    KMAX = 6 if kv_block < 64 else 4
    got, ref, counts = run_case(2, 2, 384, 64, 64, kv_block, KMAX, dtype, "triton", bwd="fused")
    check(got, ref, counts, 1e-5 if dtype == torch.float32 else 4e-3, 64)


@pytest.mark.nan_empty
def test_fused_backward_pointer_gather_path_without_tma(monkeypatch):
    # kv_block 64 loads each segment by TMA where it can; pointer gathers elsewhere
    import vsa2_rl.kernels.block_sparse as block_sparse

    monkeypatch.setattr(block_sparse, "_tma_descriptors", lambda rows, *tensors: (tensors, False))
    got, ref, counts = run_case(1, 2, 320, 64, 64, 64, 5, torch.float32, "triton", bwd="fused")
    check(got, ref, counts, 1e-5, 64)


def test_key_range_bounds_split_each_sorted_row_by_segment_id():
    B, H, NQ, NSEG, KMAX, R = 2, 2, 5, 13, 6, 3
    ids, counts = make_selection(B, H, NQ, NSEG, KMAX)
    got_ids, order, bounds = key_range_bounds(ids, counts, NSEG, R)
    assert bounds.shape == (R + 1, B * H * NQ) and bounds.dtype == torch.int32
    edges = [r * NSEG // R for r in range(R + 1)]
    for i, (row, n) in enumerate(zip(ids.reshape(-1, KMAX), counts.reshape(-1), strict=True)):
        used = sorted(row[:n].tolist())
        assert got_ids.reshape(-1, KMAX)[i, :n].tolist() == used
        # order maps each sorted slot to the given slot holding the same id
        assert row[order.reshape(-1, KMAX)[i, :n]].tolist() == used
        assert bounds[:, i].tolist() == [sum(x < e for x in used) for e in edges]
    # one range: the selection as given, slots [0, count)
    same_ids, no_order, one = key_range_bounds(ids, counts, NSEG, 1)
    assert same_ids is ids and no_order is None
    assert torch.equal(one, torch.stack([torch.zeros_like(counts), counts]).reshape(2, -1))


@pytest.mark.nan_empty
@pytest.mark.parametrize("bwd", BWD_PATHS)
def test_all_rows_empty_gives_zeros(bwd):
    B, H, S, D = 1, 1, 128, 16
    q, k, v = (torch.randn(B, H, S, D, requires_grad=True) for _ in range(3))
    ids = torch.zeros(B, H, 2, 3, dtype=torch.int32)
    counts = torch.zeros(B, H, 2, dtype=torch.int32)
    bias = torch.randn(B, H, 2, 3, requires_grad=True)
    out, lse = block_sparse_attention(q, k, v, ids, counts, bias, backend="triton", bwd=bwd)
    assert (out == 0).all() and torch.isneginf(lse).all()
    grads = torch.autograd.grad(out.sum(), (q, k, v, bias))
    assert all((g == 0).all() for g in grads)


def test_torch_backend_gradcheck_float64():
    B, H, S, D, q_tile, kv_block, KMAX = 1, 2, 64, 8, 16, 16, 3
    NQ, NSEG = S // q_tile, S // kv_block
    ids, counts = make_selection(B, H, NQ, NSEG, KMAX)
    lens = torch.tensor([16, 1, 0, 9], dtype=torch.int32)
    inputs = [torch.randn(B, H, S, D, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    bias = torch.randn(B, H, NQ, KMAX, dtype=torch.float64, requires_grad=True)

    # lse is float32 by contract, too coarse for finite differences; dLSE is covered above
    def fn(q, k, v, b):
        out, _ = block_sparse_attention(
            q,
            k,
            v,
            ids,
            counts,
            b,
            q_tile=q_tile,
            kv_block=kv_block,
            kv_lengths=lens,
            backend="torch",
        )
        return out

    assert torch.autograd.gradcheck(fn, (*inputs, bias), eps=1e-6, atol=1e-5)


def test_kv_major_index_lists_selecting_pairs_in_order():
    B, H, NQ, NSEG, KMAX = 2, 3, 5, 7, 4
    ids, counts = make_selection(B, H, NQ, NSEG, KMAX)
    offsets, pairs = build_kv_major_index(ids, counts, NSEG)
    assert offsets.dtype == torch.int32 and pairs.dtype == torch.int32
    assert pairs.shape == (B * H * NQ * KMAX,) and offsets.shape == (B * H * NSEG + 1,)
    for bh in range(B * H):
        b, h = divmod(bh, H)
        for seg in range(NSEG):
            i = bh * NSEG + seg
            got = pairs[offsets[i] : offsets[i + 1]].tolist()
            want = [
                (bh * NQ + t) * KMAX + j
                for t in range(NQ)
                for j in range(int(counts[b, h, t]))
                if int(ids[b, h, t, j]) == seg
            ]
            assert got == want
    assert int(offsets[-1]) == int(counts.sum())


def test_custom_op_registration_opcheck():
    B, H, S, D = 1, 1, 64, 16
    NQ, NSEG, KMAX = 4, 4, 2
    q, k, v = (torch.randn(B, H, S, D, requires_grad=True) for _ in range(3))
    ids, counts = make_selection(B, H, NQ, NSEG, KMAX, empty_rows=False)
    bias = torch.randn(B, H, NQ, KMAX, requires_grad=True)
    args = (q, k, v, ids, counts, bias, None, 16, 16, 0.25)
    torch.library.opcheck(
        torch.ops.vsa2_rl.block_sparse_attention_fwd.default,
        args,
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )


def _import_kernels_by_its_top_level_name(monkeypatch, search_path: list[str]):
    """import_module("kernels") with ``search_path`` as sys.path, the repository root first (as
    under ``python -m pytest`` or ``python train_rl.py``); vsa2_rl.kernels' modules unchanged."""
    root = str(Path(vsa2_rl.kernels.__file__).resolve().parents[1])
    monkeypatch.setattr(sys, "path", [root, *search_path])
    for name in [n for n in sys.modules if n == "kernels" or n.startswith("kernels.")]:
        monkeypatch.delitem(sys.modules, name)
    ours = {n: m for n, m in sys.modules.items() if n.startswith("vsa2_rl.kernels")}
    try:
        return importlib.import_module("kernels")
    finally:
        after = {n: m for n, m in sys.modules.items() if n.startswith("vsa2_rl.kernels")}
        assert after == ours  # ops.py not run again: the custom ops' handles stay valid


def test_top_level_kernels_import_gets_the_package_the_repository_shadows(monkeypatch, tmp_path):
    # transformers imports HuggingFace's `kernels` when it is installed; with the repository root
    # on sys.path that name would find this repository's kernels directory first
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("CUDAProperties = 'the hub package'\n")
    hub = _import_kernels_by_its_top_level_name(monkeypatch, [str(tmp_path)])
    assert hub.CUDAProperties == "the hub package"
    assert sys.modules["kernels"] is hub
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("kernels.ops")


def test_top_level_kernels_import_without_another_package_fails_as_if_absent(monkeypatch):
    with pytest.raises(ModuleNotFoundError, match="kernels"):
        _import_kernels_by_its_top_level_name(monkeypatch, [])
    assert "kernels" not in sys.modules


@pytest.mark.slow
def test_torch_compile_traces_without_graph_break():
    B, H, S, D = 1, 1, 64, 16
    ids, counts = make_selection(1, 1, 4, 4, 2, empty_rows=False)
    q, k, v = (torch.randn(B, H, S, D, requires_grad=True) for _ in range(3))

    def fn(q, k, v):
        out, _ = block_sparse_attention(
            q, k, v, ids, counts, q_tile=16, kv_block=16, backend="triton"
        )
        return out.sum()

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    loss = compiled(q, k, v)
    (dq,) = torch.autograd.grad(loss, (q,))
    ref_q = q.detach().requires_grad_()
    ref_loss = fn(ref_q, k, v)
    (ref_dq,) = torch.autograd.grad(ref_loss, (ref_q,))
    assert torch.allclose(loss, ref_loss) and torch.allclose(dq, ref_dq)


def _valid_args():
    B, H, S, D = 1, 2, 128, 16
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    ids = torch.rand(B, H, 2, 8).argsort(-1)[..., :3].to(torch.int32)
    counts = torch.full((B, H, 2), 3, dtype=torch.int32)
    return dict(q=q, k=k, v=v, kv_indices=ids, kv_counts=counts)


@pytest.mark.parametrize(
    "change,kwargs,match",
    [
        ("q", dict(), r"q, k, v must have one shape"),
        ("kv_indices_dtype", dict(), r"kv_indices must be an int32"),
        ("kv_indices_range", dict(), r"kv_indices entries .* found 8"),
        ("kv_indices_dup", dict(), r"distinct"),
        ("kv_counts_range", dict(), r"kv_counts must lie in \[0, KMAX=3\], found 4"),
        ("bias_shape", dict(), r"block_bias must have kv_indices' shape"),
        (None, dict(kv_block=24), r"kv_block must be one of .* got 24"),
        (None, dict(q_tile=48), r"q_tile must be one of .* got 48"),
        (
            None,
            dict(kv_lengths=torch.full((8,), 17, dtype=torch.int32)),
            r"kv_lengths must lie in \[0, kv_block=16\], found 17",
        ),
        (
            None,
            dict(kv_lengths=torch.full((7,), 16, dtype=torch.int32)),
            r"kv_lengths must have shape",
        ),
        (None, dict(backend="cuda"), r"backend must be .* got 'cuda'"),
        (None, dict(bwd="atomic"), r"bwd must be one of .* got 'atomic'"),
        ("seq", dict(), r"S=120 must be a multiple of q_tile=64"),
    ],
)
def test_bad_inputs_raise_value_error_naming_argument(change, kwargs, match):
    a = _valid_args()
    if change == "q":
        a["q"] = a["q"][..., :8]
    elif change == "kv_indices_dtype":
        a["kv_indices"] = a["kv_indices"].long()
    elif change == "kv_indices_range":
        a["kv_indices"][0, 0, 0, 0] = 8
    elif change == "kv_indices_dup":
        a["kv_indices"][0, 0, 0, 1] = a["kv_indices"][0, 0, 0, 0]
    elif change == "kv_counts_range":
        a["kv_counts"][0, 1, 1] = 4
    elif change == "bias_shape":
        kwargs = dict(block_bias=torch.zeros(1, 2, 2, 4))
    elif change == "seq":
        a.update({n: a[n][:, :, :120] for n in ("q", "k", "v")})
    with pytest.raises(ValueError, match=match):
        block_sparse_attention(**a, **kwargs)


# -- GPU: real sizes, bf16, float32 reference in chunks ------------------------------------------


def chunked_reference(
    q, k, v, ids, counts, bias, lens, q_tile, kv_block, g_out, g_lse, chunk_tiles=16,
    dtype=torch.float32,
):  # fmt: skip
    """Dense reference in ``dtype``, query tiles in chunks; returns out, lse, dq, dk, dv, dbias."""
    leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    b_leaf = bias.to(dtype).requires_grad_() if bias is not None else None
    scale = 1.0 / math.sqrt(q.shape[-1])
    NQ = ids.shape[2]
    outs, lses = [], []
    for t0 in range(0, NQ, chunk_tiles):
        t1 = min(NQ, t0 + chunk_tiles)
        o, l = dense_reference(*leaves, ids, counts, b_leaf, lens, q_tile, kv_block, scale, t0, t1)
        rows = slice(t0 * q_tile, t1 * q_tile)
        loss = (o * g_out[:, :, rows].to(dtype)).sum() + torch.where(
            torch.isfinite(l), l * g_lse[:, :, rows].to(dtype), 0.0
        ).sum()
        loss.backward()
        outs.append(o.detach())
        lses.append(l.detach())
    grads = [x.grad for x in leaves] + ([b_leaf.grad] if b_leaf is not None else [])
    return torch.cat(outs, 2), torch.cat(lses, 2), grads


def _gpu_bf16_case(kv_block, S, density, bwd, ref_dtype):
    """The op in bf16 at a real size (B=1, H=4, D=128) with a per-pair bias, partial segments
    and empty rows, against the chunked dense reference in ``ref_dtype``. Returns (got, ref,
    counts, grads_again): ``grads_again()`` reruns the op's backward on the same inputs."""
    B, H, D, q_tile = 1, 4, 128, 64
    dev = "cuda"
    NQ, NSEG = S // q_tile, S // kv_block
    KMAX = max(1, round(density * NSEG))
    q, k, v = (torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    ids, counts = make_selection(B, H, NQ, NSEG, KMAX, dev)
    bias = torch.randn(B, H, NQ, KMAX, device=dev)
    lens = torch.randint(1, kv_block + 1, (NSEG,), device=dev, dtype=torch.int32)
    lens[-4:] = torch.tensor([0, 1, kv_block // 2, kv_block], device=dev, dtype=torch.int32)
    g_out = torch.randn(B, H, S, D, device=dev)
    g_lse = torch.randn(B, H, S, device=dev)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    b_leaf = bias.clone().requires_grad_()

    def run():
        out, lse = block_sparse_attention(
            *leaves, ids, counts, b_leaf, kv_block=kv_block, kv_lengths=lens, bwd=bwd
        )
        lse_term = torch.where(torch.isfinite(lse), lse * g_lse, 0.0).sum()
        loss = (out.float() * g_out).sum() + lse_term
        return out, lse, torch.autograd.grad(loss, [*leaves, b_leaf])

    ref = chunked_reference(
        q, k, v, ids, counts, bias, lens, q_tile, kv_block, g_out, g_lse, dtype=ref_dtype
    )
    return run(), ref, counts.cpu(), lambda: run()[2]


@pytest.mark.gpu
@pytest.mark.nan_empty
@pytest.mark.parametrize(
    "kv_block,S,density", [(16, 4096, 0.1), (32, 8192, 0.05), (64, 8192, 0.125)]
)
def test_gpu_bf16_real_size(kv_block, S, density):
    got, ref, counts, grads_again = _gpu_bf16_case(kv_block, S, density, "two_pass", torch.float32)
    check(got, ref, counts, 2e-2, 64)
    # run-to-run determinism of the backward (the kv-major pass has no atomics)
    assert all(torch.equal(a, b) for a, b in zip(got[2], grads_again(), strict=True))


@pytest.mark.gpu
@pytest.mark.nan_empty
@pytest.mark.parametrize(
    "kv_block,S,density,ranges",
    [(16, 8192, 0.05, None), (16, 4096, 0.1, 3), (32, 8192, 0.05, None), (64, 8192, 0.125, 2)],
)
def test_gpu_fused_backward_bf16_real_size_matches_float64(
    kv_block, S, density, ranges, monkeypatch
):
    # ranges: the key ranges forced (sorted rows, atomic dQ); None lets the L2 size decide
    if ranges is not None:
        monkeypatch.setenv("VSA2_RL_BWD_KEY_RANGES", str(ranges))
    got, ref, counts, grads_again = _gpu_bf16_case(kv_block, S, density, "fused", torch.float64)
    check(got, ref, counts, 2e-2, 64)
    # atomic adds land in run-dependent order: a rerun agrees to float32 rounding, not bitwise
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), got[2], grads_again(), strict=True):
        assert rel_rms(a, b) < 1e-3, name


@pytest.mark.gpu
@pytest.mark.parametrize("bwd", BWD_PATHS)
@pytest.mark.parametrize("kv_block", [16, 64])  # on Hopper: Gluon forward, kv64 also its dQ
def test_gpu_cuda_graph_capture_has_no_host_sync(kv_block, bwd):
    B, H, S, D = 1, 2, 2048, 128
    dev = "cuda"
    NQ, NSEG, KMAX = S // 64, S // kv_block, 12
    q, k, v = (
        torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    bias = torch.randn(B, H, NQ, KMAX, device=dev, requires_grad=True)
    ids, counts = make_selection(B, H, NQ, NSEG, KMAX, dev)
    g = torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16)

    def step():
        out, _ = block_sparse_attention(q, k, v, ids, counts, bias, kv_block=kv_block, bwd=bwd)
        return (out, *torch.autograd.grad(out, (q, k, v, bias), g))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    # a new selection written in place must be honoured by the replay: nothing was baked in
    new_ids, new_counts = make_selection(B, H, NQ, NSEG, KMAX, dev)
    ids.copy_(new_ids)
    counts.copy_(new_counts)
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    for a, b in zip(captured, eager, strict=True):
        # the fused backward's atomic adds make its sums' last bits run-dependent
        assert torch.equal(a, b) if bwd == "two_pass" else rel_rms(a, b) < 1e-3


@pytest.mark.parametrize("bwd", BWD_PATHS)
@pytest.mark.parametrize("kv_block", [16, 64])
def test_bias_gradient_matches_float64_per_pair_and_its_fixup_mends_the_tile_sums(
    kv_block, bwd, monkeypatch
):
    """Per-pair d(bias) of fp16 inputs against the float64 reference, with and without the
    backward's fix-up (``_restore_softmax_identity``). Without it, rounding of O breaks each
    tile's sum (sum_j dS_ij = dLSE_i per row) by ~1e-3 relative; d(alpha) = sum d(bias) * log p
    weighs those sums by the mean log-probability (about -ln NSEG), so the fix-up must bring
    that weighted sum, and the tile sums, close to float64 without hurting the pairs."""
    import vsa2_rl.kernels.block_sparse as block_sparse

    def bias_grads(fixup: bool):
        torch.manual_seed(0)
        with monkeypatch.context() as patch:
            if not fixup:
                patch.setattr(block_sparse, "_restore_softmax_identity", lambda d, *a: d)
            got, ref, _ = run_case(2, 2, 256, 32, 64, kv_block, 128 // kv_block, torch.float16,
                                   "triton", bwd=bwd)  # fmt: skip
        return got[2][3].double(), ref[2][3]

    (fixed, ref), (raw, ref_raw) = bias_grads(True), bias_grads(False)
    assert torch.equal(ref, ref_raw)  # the same inputs both times
    weights = -math.log(256 // kv_block) + 0.1 * torch.randn(
        ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)
    )
    errors = {}
    for name, d in (("fixed", fixed), ("raw", raw)):
        errors[name] = (
            rel_rms(d, ref),
            rel_rms(d.sum(-1), ref.sum(-1)),
            rel_rms((d * weights).sum(-1), (ref * weights).sum(-1)),
        )
    (pair_fixed, sums_fixed, alpha_fixed), (pair_raw, sums_raw, alpha_raw) = errors.values()
    assert pair_raw < 2e-3 and pair_fixed < 1e-3, errors
    assert sums_raw > 1e-4 and sums_fixed < sums_raw / 100, errors
    assert alpha_fixed < alpha_raw / 10, errors


def test_float32_products_are_exact_unless_torch_allows_tf32_matmuls():
    from vsa2_rl.kernels.block_sparse import _dot_precision

    flags = torch.backends.cuda.matmul
    before = flags.allow_tf32
    try:
        flags.allow_tf32 = False
        assert _dot_precision(torch.float32) == "ieee"
        assert _dot_precision(torch.bfloat16) == "tf32"  # bf16 operands: exact in either mode
        flags.allow_tf32 = True  # model.allow_tf32: the run chose TF32 for its float32 products
        assert _dot_precision(torch.float32) == "tf32"
    finally:
        flags.allow_tf32 = before
