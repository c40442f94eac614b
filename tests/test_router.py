"""Pooling kernel and VSA2 router against brute-force float64 references."""

import math

import pytest
import torch

from vsa2_rl.kernels import max_kv_for, pool_tiles, route
from vsa2_rl.kernels.pooling import pool_qkv

# -- pool_tiles ---------------------------------------------------------------------------------


def _pool_reference(x: torch.Tensor, lengths: list[int], block: int) -> torch.Tensor:
    """Explicit float64 mean of each block's first lengths[i] tokens (0 for an empty block)."""
    B, H, _, D = x.shape
    rows = []
    for i, n in enumerate(lengths):
        if n == 0:
            rows.append(torch.zeros(B, H, D, dtype=torch.float64))
        else:
            rows.append(x[:, :, i * block : i * block + n].double().mean(dim=2))
    return torch.stack(rows, dim=2)


def _lengths(block: int, num_blocks: int) -> list[int]:
    # awkward mix: empty, single-token, full and partial blocks
    pattern = [block, 0, 1, block - 1, 3, block]
    return [pattern[i % len(pattern)] for i in range(num_blocks)]


@pytest.mark.nan_empty
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(("block", "D"), [(16, 24), (64, 32)])
def test_pool_tiles_matches_float64_means(backend, block, D):
    S = 6 * block if block == 16 else 3 * block
    dtype = torch.float64 if backend == "torch" else torch.float32
    # a transposed view: the kernel must honour strides
    x = torch.randn(2, S, 2, D, dtype=dtype).transpose(1, 2)
    lengths = _lengths(block, S // block)
    out = pool_tiles(x, torch.tensor(lengths, dtype=torch.int32), block, backend=backend)
    assert out.shape == (2, 2, S // block, D) and out.dtype == dtype
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(out.double(), _pool_reference(x, lengths, block), rtol=tol, atol=tol)


def test_pool_tiles_gradcheck_torch():
    x = torch.randn(1, 2, 64, 8, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([16, 0, 1, 9], dtype=torch.int32)
    assert torch.autograd.gradcheck(lambda t: pool_tiles(t, lengths, 16, backend="torch"), (x,))


@pytest.mark.nan_empty
def test_pool_tiles_triton_gradient_matches_torch():
    block, D = 16, 24
    x = torch.randn(2, 2, 6 * block, D, requires_grad=True)
    lengths = torch.tensor(_lengths(block, 6), dtype=torch.int32)
    grad_out = torch.randn(2, 2, 6, D)
    (g_triton,) = torch.autograd.grad(pool_tiles(x, lengths, block, backend="triton"), x, grad_out)
    (g_torch,) = torch.autograd.grad(pool_tiles(x, lengths, block, backend="torch"), x, grad_out)
    torch.testing.assert_close(g_triton, g_torch, rtol=1e-6, atol=1e-7)
    # padded tokens get exactly zero gradient, valid ones dy / n
    assert g_triton[:, :, block : 2 * block].abs().max() == 0
    torch.testing.assert_close(g_triton[:, :, 2 * block], grad_out[:, :, 2])


@pytest.mark.nan_empty
@pytest.mark.parametrize(("q_tile", "kv_block"), [(64, 16), (32, 32)])
def test_pool_qkv_matches_pool_tiles_and_adds_gradients(q_tile, kv_block):
    """Fused pass: pool_tiles' means; d(input) = the consumer's grad + the pooling grads."""
    tile_lengths = [q_tile, 0, q_tile - 7, 3]
    segs = [
        min(max(n - j * kv_block, 0), kv_block)
        for n in tile_lengths
        for j in range(q_tile // kv_block)
    ]
    tlen, slen = (
        torch.tensor(tile_lengths, dtype=torch.int32),
        torch.tensor(segs, dtype=torch.int32),
    )
    S, D = len(tile_lengths) * q_tile, 24
    # transposed views with their own strides each
    q, k, v = (torch.randn(2, S, 3, D).transpose(1, 2).requires_grad_(True) for _ in range(3))
    pooled = pool_qkv(
        q, k, v, tlen, slen, q_tile=q_tile, kv_block=kv_block, segments=True, kv_tiles=True
    )
    assert torch.equal(pooled.q_tiles, pool_tiles(q, tlen, q_tile, backend="triton"))
    torch.testing.assert_close(
        pooled.k_segs, pool_tiles(k, slen, kv_block, backend="triton"), rtol=1e-6, atol=1e-7
    )
    ref_means = [
        _pool_reference(x.detach(), lens, block)
        for x, lens, block in (
            (q, tile_lengths, q_tile),
            (k, segs, kv_block),
            (k, tile_lengths, q_tile),
            (v, tile_lengths, q_tile),
        )
    ]
    means = [pooled.q_tiles, pooled.k_segs, pooled.k_tiles, pooled.v_tiles]
    for got, ref in zip(means, ref_means, strict=True):
        torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6)

    # a consumer of the aliases (as the fine stage) plus a loss on every mean
    w_in = [torch.randn(2, 3, S, D) for _ in range(3)]
    w_mean = [torch.randn_like(m) for m in means]
    loss = sum((x * w).sum() for x, w in zip((pooled.q, pooled.k, pooled.v), w_in, strict=True))
    loss = loss + sum((m * w).sum() for m, w in zip(means, w_mean, strict=True))
    grads = torch.autograd.grad(loss, (q, k, v))
    torch_means = [
        pool_tiles(x, lens, block, backend="torch")
        for x, lens, block in (
            (q, tlen, q_tile),
            (k, slen, kv_block),
            (k, tlen, q_tile),
            (v, tlen, q_tile),
        )
    ]
    ref_loss = sum((x * w).sum() for x, w in zip((q, k, v), w_in, strict=True))
    ref_loss = ref_loss + sum((m * w).sum() for m, w in zip(torch_means, w_mean, strict=True))
    for got, ref in zip(grads, torch.autograd.grad(ref_loss, (q, k, v)), strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def test_pool_tiles_rejects_bad_input():
    x = torch.randn(1, 1, 32, 8)
    with pytest.raises(ValueError, match="lengths"):
        pool_tiles(x, torch.tensor([16, 17], dtype=torch.int32), 16)
    with pytest.raises(ValueError, match="lengths"):
        pool_tiles(x, torch.tensor([16], dtype=torch.int32), 16)
    with pytest.raises(ValueError, match="block"):
        pool_tiles(x, torch.tensor([16], dtype=torch.int32), 24)
    with pytest.raises(ValueError, match="backend"):
        pool_tiles(x, torch.tensor([16, 16], dtype=torch.int32), 16, backend="cuda")


# -- route --------------------------------------------------------------------------------------


def _router_case(nseg: int = 24, nq: int = 5, D: int = 16):
    q = torch.randn(2, 2, nq, D, dtype=torch.float64) * 2
    k = torch.randn(2, 2, nseg, D, dtype=torch.float64) * 2
    seg_lengths = torch.randint(1, 17, (nseg,), dtype=torch.int32)
    seg_lengths[[3, 10, nseg - 1]] = 0  # empty segments must never be picked
    return q, k, seg_lengths


def _log_softmax_reference(q, k, seg_lengths):
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])
    return torch.log_softmax(scores.masked_fill(seg_lengths == 0, float("-inf")), dim=-1)


@pytest.mark.parametrize("max_kv_case", [(0.7, 10, 3), (0.5, 8, 4), (0.95, 10, 1), (0.0, 7, 7)])
def test_max_kv_for_rounds_up_without_float_noise(max_kv_case):
    sparsity, n, expected = max_kv_case
    assert max_kv_for(sparsity, n) == expected


@pytest.mark.parametrize(
    ("sparsity", "top_p", "min_kv"), [(0.0, 0.9, 1), (0.5, 0.5, 3), (0.8, 0.95, 2), (0.3, 1.0, 1)]
)
def test_topp_selection_properties(sparsity, top_p, min_kv):
    q, k, seg_lengths = _router_case()
    out = route(q, k, seg_lengths, sparsity=sparsity, mode="topp", top_p=top_p, min_kv=min_kv)
    log_p = _log_softmax_reference(q, k, seg_lengths)
    valid = (seg_lengths > 0).tolist()
    kmax = max_kv_for(sparsity, sum(valid))
    assert out.kv_indices.shape == (2, 2, 5, kmax) and out.kv_indices.dtype == torch.int32
    assert out.kv_counts.dtype == torch.int32 and out.log_probs.dtype == torch.float32
    seen_counts = set()
    for b, h, t in torch.cartesian_prod(torch.arange(2), torch.arange(2), torch.arange(5)):
        row = out.kv_indices[b, h, t].tolist()
        n = int(out.kv_counts[b, h, t])
        seen_counts.add(n)
        ids = row[:n]
        assert min(min_kv, kmax) <= n <= kmax
        assert row[n:] == [-1] * (kmax - n)
        assert len(set(ids)) == n and all(valid[i] for i in ids)
        probs = log_p[b, h, t].exp()
        # the selected ids are the n most probable segments, in ascending id order
        assert ids == sorted(probs.argsort(descending=True)[:n].tolist())
        mass = float(probs[ids].sum())
        if n < kmax:
            assert mass >= top_p - 1e-6
        if n > min_kv:  # minimal: without its least probable segment the set is short of top_p
            assert mass - float(probs[ids].min()) < top_p + 1e-6
        torch.testing.assert_close(
            out.log_probs[b, h, t, :n].double(), log_p[b, h, t, ids], rtol=1e-5, atol=1e-5
        )
        assert (out.log_probs[b, h, t, n:] == 0).all()
    if sparsity == 0.0 and top_p < 1.0:
        assert len(seen_counts) > 1, "top-p should give a variable number of segments"


@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9])
def test_topk_count_is_exact_and_picks_best(sparsity):
    q, k, seg_lengths = _router_case()
    out = route(q, k, seg_lengths, sparsity=sparsity, mode="topk", top_p=0.5, min_kv=1)
    kmax = max_kv_for(sparsity, int((seg_lengths > 0).sum()))
    assert (out.kv_counts == kmax).all()
    best = _log_softmax_reference(q, k, seg_lengths).argsort(dim=-1, descending=True)[..., :kmax]
    # top-k leaves the order of the chosen segments open: compare them as sets
    assert torch.equal(out.kv_indices.long().sort(dim=-1).values, best.sort(dim=-1).values)


@pytest.mark.parametrize("mode", ["topk", "topp"])
def test_density_equals_brute_force_count(mode):
    q, k, seg_lengths = _router_case()
    out = route(q, k, seg_lengths, sparsity=0.6, mode=mode, top_p=0.7, min_kv=1)
    total = int(seg_lengths.sum())
    per_row = [
        sum(int(seg_lengths[i]) for i in row if i >= 0) / total
        for row in out.kv_indices.reshape(-1, out.kv_indices.shape[-1]).tolist()
    ]
    assert out.density.dtype == torch.float32 and out.density.dim() == 0
    assert abs(float(out.density) - sum(per_row) / len(per_row)) < 1e-6


@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
def test_scores_stay_float32_under_autocast(input_dtype):
    """Under a bf16 autocast (as a training step runs) the router's scores and log-softmax stay
    float32: the selection and log-probabilities equal the float64 reference's on the same
    values, and the gradients reach the pooled inputs."""
    q, k, seg_lengths = _router_case(D=64)
    q, k = q.to(input_dtype), k.to(input_dtype)
    leaves = [x.detach().requires_grad_(True) for x in (q, k)]
    with torch.autocast("cpu", torch.bfloat16):
        out = route(*leaves, seg_lengths, sparsity=0.5, mode="topp", top_p=0.8, min_kv=1,
                    backend="torch")  # fmt: skip
        out.log_probs.sum().backward()
    assert out.log_probs.dtype == torch.float32
    log_p = _log_softmax_reference(q.double(), k.double(), seg_lengths)
    used = out.kv_indices >= 0
    ref = torch.where(used, log_p.gather(-1, out.kv_indices.long().clamp(min=0)), 0.0)
    torch.testing.assert_close(out.log_probs.double(), ref, rtol=1e-5, atol=1e-5)
    best = log_p.argsort(dim=-1, descending=True)
    rows = zip(out.kv_indices.flatten(0, 2), out.kv_counts.flatten(), best.flatten(0, 2),
               strict=True)  # fmt: skip
    for ids, count, ranked in rows:
        assert set(ids[:count].tolist()) == set(ranked[:count].tolist())
    assert all(leaf.grad is not None and leaf.grad.abs().max() > 0 for leaf in leaves)


def test_log_probs_gradient_matches_float64_reference():
    q, k, seg_lengths = _router_case()
    q.requires_grad_(True)
    k.requires_grad_(True)
    out = route(q, k, seg_lengths, sparsity=0.5, mode="topp", top_p=0.8, min_kv=1)
    weights = torch.randn(out.log_probs.shape, dtype=torch.float64)
    used = out.kv_indices >= 0
    gq, gk = torch.autograd.grad((out.log_probs.double() * weights).sum(), (q, k))
    log_p = _log_softmax_reference(q, k, seg_lengths)
    ref = torch.where(used, log_p.gather(-1, out.kv_indices.long().clamp(min=0)), 0.0)
    rq, rk = torch.autograd.grad((ref * weights).sum(), (q, k))
    assert rq.abs().max() > 0 and rk.abs().max() > 0
    torch.testing.assert_close(gq, rq, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gk, rk, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("top_p", [None, 0.6])
def test_top_log_probs_gradcheck(top_p):
    """The memory-lean autograd Function behind log_probs, in float64 (it recomputes scores)."""
    from vsa2_rl.kernels.router import _TopLogProbs

    q, k, seg_lengths = _router_case(nseg=12, nq=3, D=4)
    q.requires_grad_(True)
    k.requires_grad_(True)
    fn = lambda a, b: _TopLogProbs.apply(a, b, seg_lengths == 0, 4, 0.5, top_p, 1, False)[0]
    assert torch.autograd.gradcheck(fn, (q, k))


# -- Triton top-k (topk mode) --------------------------------------------------------------------


@pytest.mark.nan_empty
@pytest.mark.parametrize("kmax", [1, 5, 40])
def test_triton_topk_keeps_exactly_the_k_largest_with_ties(kmax):
    from vsa2_rl.kernels.topk import topk_log_softmax

    scores = torch.randn(2, 3, 4, 45)
    scores[0, 0, 0, :5] = float("-inf")  # masked segments (40 valid remain)
    scores[0, 1, 2] = 0.25  # a row of ties only
    scores[1, 2, 3, ::3] = 2.0  # 15 ties at the top
    log_p, ids, lse, counts = topk_log_softmax(scores, kmax)
    assert counts is None
    ref_lse = torch.logsumexp(scores.double(), dim=-1, keepdim=True)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)
    assert ids.shape == (2, 3, 4, kmax) and (ids.diff(dim=-1) > 0).all(), "distinct, ascending"
    picked = scores.gather(-1, ids)
    kth = scores.double().topk(kmax, dim=-1).values[..., -1:]
    assert (picked.double() >= kth).all(), "a kept score below the k-th largest"
    torch.testing.assert_close(log_p.double(), picked.double() - ref_lse, rtol=1e-6, atol=1e-6)
    # ties at the threshold are filled in id order: the all-ties row keeps ids 0 .. kmax - 1
    assert ids[0, 1, 2].tolist() == list(range(kmax))
    unique_rows = (scores.sort(dim=-1).values.diff(dim=-1) != 0).all(dim=-1)
    ref_ids = scores.topk(kmax, dim=-1).indices.sort(dim=-1).values
    assert torch.equal(ids[unique_rows], ref_ids[unique_rows])


def _top_p_reference(scores, kmax, top_p, min_kv):
    """float64 top-p among the kmax best (ties in id order): expected ids (kept ascending, then
    the other winners ascending), counts, and the rows whose boundary lies within 1e-5 of
    top_p (where float32 sums may round either way)."""
    s64 = scores.double()
    order = torch.sort(-s64, dim=-1, stable=True).indices[..., :kmax]  # best first, ties by id
    probs = (s64.gather(-1, order) - torch.logsumexp(s64, dim=-1, keepdim=True)).exp()
    mass_before = probs.cumsum(dim=-1) - probs
    counts = (mass_before < top_p).sum(dim=-1).clamp(min(min_kv, kmax), kmax)
    kept = torch.arange(kmax) < counts[..., None].cpu()
    ranked = torch.where(kept.to(order.device), order, order + scores.shape[-1]).sort().values
    ids = torch.where(ranked >= scores.shape[-1], ranked - scores.shape[-1], ranked)
    near = ((mass_before - top_p).abs() < 1e-5).any(dim=-1)
    return ids, counts, near


@pytest.fixture(params=["sort", "search"])
def nucleus(request, monkeypatch):
    """Both ways the Triton top-k finds the nucleus: sorting the winners (up to
    ``SORTED_NUCLEUS_MAX`` of them) or searching a mass threshold (forced here with 0)."""
    from vsa2_rl.kernels import topk

    if request.param == "search":
        monkeypatch.setattr(topk, "SORTED_NUCLEUS_MAX", 0)
    return request.param


@pytest.mark.nan_empty
@pytest.mark.parametrize(
    "kmax,top_p,min_kv", [(8, 0.5, 1), (8, 0.999, 1), (8, 1e-3, 3), (1, 0.9, 2), (40, 0.9, 30)]
)
def test_triton_top_p_keeps_the_smallest_best_set_reaching_top_p(kmax, top_p, min_kv, nucleus):
    from vsa2_rl.kernels.topk import topk_log_softmax

    scores = torch.randn(2, 3, 4, 45) * 2
    scores[0, 0, 0, :5] = float("-inf")  # masked segments
    scores[0, 1, 2] = 0.25  # a row of ties only
    scores[1, 2, 3, ::3] = 2.0  # ties at the top
    log_p, ids, _, counts = topk_log_softmax(scores, kmax, top_p, min_kv)
    ref_ids, ref_counts, near = _top_p_reference(scores, kmax, top_p, min_kv)
    assert near.float().mean() < 0.1
    assert torch.equal(counts[~near], ref_counts[~near].to(torch.int32))
    assert torch.equal(ids[~near], ref_ids[~near])
    ref_lse = torch.logsumexp(scores.double(), dim=-1, keepdim=True)
    torch.testing.assert_close(
        log_p.double(), scores.gather(-1, ids) - ref_lse, rtol=1e-6, atol=1e-6
    )
    # the all-ties row: equal probabilities 1/45 each, so top_p is reached after ceil(45 * p)
    assert ids[0, 1, 2, : int(counts[0, 1, 2])].tolist() == list(range(int(counts[0, 1, 2])))


@pytest.mark.nan_empty
@pytest.mark.parametrize("top_p", [None, 0.6])
def test_triton_topk_applies_scale_and_mask_as_it_loads_the_raw_scores(top_p, nucleus):
    """The router hands the kernel ``q . k`` unscaled and unmasked: the selection and
    log-probabilities equal those of the float64 scores ``scale * raw + mask``."""
    from vsa2_rl.kernels.topk import topk_log_softmax

    raw = torch.randn(2, 3, 4, 45) * 6
    mask_bias = torch.zeros(45).index_fill_(0, torch.tensor([0, 7, 44]), float("-inf"))
    scale, kmax = 0.3, 8
    scores = raw.double() * scale + mask_bias.double()
    log_p, ids, lse, counts = topk_log_softmax(
        raw, kmax, top_p, 2, scale=scale, mask_bias=mask_bias
    )
    ref_lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        log_p.double(), scores.gather(-1, ids) - ref_lse, rtol=1e-6, atol=1e-6
    )
    assert not mask_bias[ids].isinf().any(), "a masked segment was selected"
    if top_p is None:
        ref_ids = scores.topk(kmax, dim=-1).indices.sort(dim=-1).values
        assert torch.equal(ids, ref_ids)
    else:
        ref_ids, ref_counts, near = _top_p_reference(scores, kmax, top_p, 2)
        assert near.float().mean() < 0.1 and ref_counts.float().mean() < kmax
        assert torch.equal(counts[~near], ref_counts[~near].to(torch.int32))
        assert torch.equal(ids[~near], ref_ids[~near])


@pytest.mark.gpu
@pytest.mark.parametrize("nseg,kmax", [(1181, 59), (4725, 237), (4725, 1182)])
def test_gpu_triton_topk_at_wan_720p_sizes(nseg, kmax):
    """The rows of Wan 720p at kv_block 64 and 16, budgets of sparsity 0.95 and (kv16) 0.75,
    the recipes' eval sparsity."""
    from vsa2_rl.kernels.topk import topk_log_softmax

    scores = torch.randn(1, 40, 1181, nseg, device="cuda")
    log_p, ids, lse, _ = topk_log_softmax(scores, kmax)
    ref_ids = scores.topk(kmax, dim=-1).indices
    assert torch.equal(ids, ref_ids.sort(dim=-1).values)
    ref_lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(log_p, scores.gather(-1, ids) - ref_lse, rtol=1e-5, atol=1e-5)
    scores = scores[:, :8] * 4  # peaked rows: top-p sets smaller than the budget
    log_p, ids, lse, counts = topk_log_softmax(scores, kmax, 0.9, 2)
    ref_ids, ref_counts, near = _top_p_reference(scores, kmax, 0.9, 2)
    assert near.float().mean() < 0.05 and ref_counts.float().mean() < kmax
    assert torch.equal(counts[~near], ref_counts[~near].to(torch.int32))
    assert torch.equal(ids[~near], ref_ids[~near])


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["topk", "topp"])
def test_gpu_route_of_bf16_pooled_inputs_matches_float64(mode):
    """On CUDA, bf16 pooled inputs score on the tensor cores into float32 (``out_dtype``):
    the same selection, log-probabilities and gradients as float64 scores of the same values."""
    q, k, seg_lengths = _router_case(nseg=300, nq=40, D=128)
    q, k = q.bfloat16().cuda(), k.bfloat16().cuda()
    outs = []
    for qx, kx in ((q, k), (q.double().cpu(), k.double().cpu())):
        qx, kx = qx.clone().requires_grad_(), kx.clone().requires_grad_()
        out = route(qx, kx, seg_lengths, sparsity=0.9, mode=mode, top_p=0.6, min_kv=2)
        order = out.kv_indices.argsort(dim=-1)  # torch.topk: no set order
        log_p = out.log_probs.gather(-1, order)
        weights = torch.linspace(-1, 1, log_p.shape[-1], dtype=log_p.dtype, device=qx.device)
        grads = torch.autograd.grad((log_p * weights).sum(), (qx, kx))
        outs.append([x.cpu().double() for x in (out.kv_indices.gather(-1, order), log_p,
                     out.kv_counts, *grads)])  # fmt: skip
    got, want = outs
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    for g, w in zip(got[3:], want[3:], strict=True):  # bf16 gradients: 8-bit mantissas
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2 * float(w.abs().max()))


@pytest.mark.parametrize("mode", ["topk", "topp"])
@pytest.mark.parametrize("sparsity", [0.5, 0.9])
def test_route_triton_selection_equals_torch(sparsity, mode):
    q, k, seg_lengths = _router_case()
    q, k = q.float(), k.float()  # float64 scores always take the torch path
    outs = []
    for backend in ("triton", "torch"):
        qb, kb = q.clone().requires_grad_(), k.clone().requires_grad_()
        out = route(qb, kb, seg_lengths, sparsity=sparsity, mode=mode, top_p=0.6, min_kv=2,
                    backend=backend)  # fmt: skip
        if mode == "topp":  # ascending ids on both paths: the same slots, in the same order
            order = torch.arange(out.kv_indices.shape[-1]).expand_as(out.kv_indices)
        else:  # in no set order: compare in id order
            order = out.kv_indices.argsort(dim=-1)
        log_p = out.log_probs.gather(-1, order)
        grads = torch.autograd.grad(
            (log_p * torch.linspace(-1, 1, log_p.shape[-1])).sum(), (qb, kb)
        )
        outs.append((out.kv_indices.gather(-1, order), log_p, out.density, grads, out.kv_counts))
    (ids_t, lp_t, d_t, g_t, n_t), (ids_r, lp_r, d_r, g_r, n_r) = outs
    assert torch.equal(ids_t, ids_r)
    assert torch.equal(n_t, n_r)
    if mode == "topp":  # a real top-p case: the counts vary between rows
        assert n_r.min() < n_r.max()
    torch.testing.assert_close(lp_t, lp_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(d_t, d_r)
    for a, b in zip(g_t, g_r, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_route_rejects_bad_arguments():
    q, k, seg_lengths = _router_case()
    ok = {"sparsity": 0.5, "mode": "topp", "top_p": 0.9, "min_kv": 1}
    for bad, name in [
        ({"mode": "nucleus"}, "mode"),
        ({"sparsity": 1.0}, "sparsity"),
        ({"sparsity": -0.1}, "sparsity"),
        ({"top_p": 0.0}, "top_p"),
        ({"min_kv": 0}, "min_kv"),
        ({"backend": "cuda"}, "backend"),
    ]:
        with pytest.raises(ValueError, match=name):
            route(q, k, seg_lengths, **{**ok, **bad})
    with pytest.raises(ValueError, match="num_valid_segments"):
        route(q, k, torch.zeros_like(seg_lengths), **ok)
    with pytest.raises(ValueError, match="seg_lengths"):
        route(q, k, seg_lengths[:-1], **ok)
