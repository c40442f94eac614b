"""GPU tests of the experimental Gluon kernels (branch gluon-fwd) against the Triton ones."""

import pytest
import torch

from vsa2_rl.kernels.block_sparse import _restore_softmax_identity, bsa_backward, bsa_forward

pytestmark = pytest.mark.gpu


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def _case(with_lengths: bool, kmax: int = 9):
    """bf16 inputs, a random selection with rows of 0, 1 and KMAX slots, a bias, lengths."""
    torch.manual_seed(0)
    B, H, S, D = 1, 4, 64 * 96, 128
    nq = nseg = S // 64
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ids = torch.rand(B, H, nq, nseg, device="cuda").topk(kmax, dim=-1).indices.to(torch.int32)
    counts = torch.randint(0, kmax + 1, (B, H, nq), device="cuda", dtype=torch.int32)
    counts[0, 0, :3] = torch.tensor([0, 1, kmax], dtype=torch.int32)
    bias = 0.5 * torch.randn(B, H, nq, kmax, device="cuda")
    lengths = None
    if with_lengths:
        lengths = torch.full((nseg,), 64, device="cuda", dtype=torch.int32)
        lengths[::5] = torch.randint(1, 64, lengths[::5].shape, device="cuda", dtype=torch.int32)
    return q, k, v, ids, counts, bias, lengths, D**-0.5


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("stages", [(1, 2), (2, 2)])
@pytest.mark.parametrize("with_lengths", [False, True])
def test_gluon_forward_matches_triton_kernel(stages, with_lengths):
    from vsa2_rl.kernels.block_sparse_gluon import bsa_forward_gluon

    q, k, v, ids, counts, bias, lengths, scale = _case(with_lengths)
    out, lse = bsa_forward_gluon(q, k, v, ids, counts, bias, lengths, scale, *stages)
    ref_out, ref_lse = bsa_forward(q, k, v, ids, counts, bias, lengths, 64, 64, scale)
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(lse.isinf(), ref_lse.isinf())
    finite = ref_lse.isfinite()
    torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=1e-3, atol=1e-3)
    assert (out[0, 0, :64] == 0).all(), "a row without segments must give 0"


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("stages", [(3, 1), (2, 1)])
@pytest.mark.parametrize("with_lengths", [False, True])
def test_gluon_dq_pass_matches_triton_kernel(stages, with_lengths):
    from vsa2_rl.kernels.block_sparse_gluon import bsa_backward_dq_gluon

    q, k, v, ids, counts, bias, lengths, scale = _case(with_lengths)
    out, lse = bsa_forward(q, k, v, ids, counts, bias, lengths, 64, 64, scale)
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse)
    dq, delta, dbias_raw, mass = bsa_backward_dq_gluon(
        dout, dlse, q, k, v, out, lse, ids, counts, bias, lengths, scale, *stages
    )
    ref_dq, _, _, ref_dbias = bsa_backward(
        dout, dlse, q, k, v, out, lse, ids, counts, bias, lengths, 64, 64, scale
    )
    torch.testing.assert_close(dq.float(), ref_dq.float(), rtol=2e-2, atol=2e-2)
    ref_delta = (dout.float() * out.float()).sum(-1) - dlse
    torch.testing.assert_close(delta, ref_delta, rtol=1e-4, atol=1e-4)
    dbias = _restore_softmax_identity(dbias_raw, mass, lse, dlse, 64)
    torch.testing.assert_close(dbias, ref_dbias, rtol=1e-3, atol=1e-3)


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("q_stages,warps", [(3, 4), (2, 4), (2, 8)])
@pytest.mark.parametrize("with_lengths", [False, True])
def test_gluon_dkv_pass_matches_triton_kernel(q_stages, warps, with_lengths):
    from vsa2_rl.kernels.block_sparse import build_kv_major_index
    from vsa2_rl.kernels.block_sparse_gluon import bsa_backward_dkv_gluon

    q, k, v, ids, counts, bias, lengths, scale = _case(with_lengths)
    out, lse = bsa_forward(q, k, v, ids, counts, bias, lengths, 64, 64, scale)
    dout = torch.randn_like(out)
    _, ref_dk, ref_dv, _ = bsa_backward(
        dout, None, q, k, v, out, lse, ids, counts, bias, lengths, 64, 64, scale
    )
    delta = (dout.float() * out.float()).sum(-1)
    offsets, pairs = build_kv_major_index(ids, counts, q.shape[2] // 64)
    dk, dv = bsa_backward_dkv_gluon(
        dout, q, k, v, lse, delta, offsets, pairs, ids.shape[-1], bias, lengths, scale, q_stages,
        warps,
    )  # fmt: skip
    torch.testing.assert_close(dk.float(), ref_dk.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dv.float(), ref_dv.float(), rtol=2e-2, atol=2e-2)
