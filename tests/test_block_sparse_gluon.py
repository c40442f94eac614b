"""GPU tests of the Hopper Gluon fine-stage kernels (forward, dQ pass) against the float64 torch
reference and the dQ pass against the Triton one: every kernel setting offered, rows with 0, 1
and KMAX slots, a bias, partial and empty segments, and q/k/v/dO given as the transposed views a
DiT passes ([B, S, H, D] memory)."""

import pytest
import torch

from vsa2_rl.kernels import block_sparse
from vsa2_rl.kernels.block_sparse import LOG2E, _gluon_wanted, bsa_backward, bsa_forward
from vsa2_rl.kernels.naive import block_sparse_attention_torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
        reason="needs a Hopper GPU",
    ),
]


def _case(with_lengths, strided, dtype=torch.bfloat16, D=128, kv_block=64):
    """A selection with rows of 0, 1 and KMAX slots (KMAX not a multiple of 64 // kv_block: the
    gathered kernels see partial groups), a bias, and lengths with partial and empty segments."""
    torch.manual_seed(0)
    B, H, S = 1, 4, 64 * 96
    nq, nseg = S // 64, S // kv_block
    kmax = 9 * (64 // kv_block) + (1 if kv_block < 64 else 0)

    def rand():
        x = torch.randn(B, S, H, D, device="cuda", dtype=dtype)
        return x.transpose(1, 2) if strided else x.transpose(1, 2).contiguous()

    q, k, v = rand(), rand(), rand()
    ids = torch.rand(B, H, nq, nseg, device="cuda").topk(kmax, dim=-1).indices.to(torch.int32)
    counts = torch.randint(0, kmax + 1, (B, H, nq), device="cuda", dtype=torch.int32)
    counts[0, 0, :3] = torch.tensor([0, 1, kmax], dtype=torch.int32)
    bias = 0.5 * torch.randn(B, H, nq, kmax, device="cuda")
    lengths = None
    if with_lengths:
        lengths = torch.full((nseg,), kv_block, device="cuda", dtype=torch.int32)
        partial = lengths[::5]
        lengths[::5] = torch.randint(0, kv_block, partial.shape, device="cuda", dtype=torch.int32)
    return q, k, v, ids, counts, bias, lengths, D**-0.5, rand()


def _rel_rms(got: torch.Tensor, ref: torch.Tensor) -> float:
    """RMS of the error over the RMS of the float64 reference."""
    got, ref = got.double(), ref.double()
    return ((got - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def _check_forward(out, lse, ref_out, ref_lse, counts):
    assert _rel_rms(out, ref_out) <= 1e-2, f"out: relative RMS {_rel_rms(out, ref_out):.2e}"
    assert torch.equal(lse.isinf(), ref_lse.isinf())
    finite = ref_lse.isfinite()
    assert _rel_rms(lse[finite], ref_lse[finite]) <= 1e-3, "lse"
    assert counts[0, 0, 0] == 0 and (out[0, 0, :64] == 0).all(), "no segments must give 0"


@pytest.mark.parametrize("k_stages,v_stages", [(1, 2), (2, 2)])
@pytest.mark.parametrize("with_lengths", [False, True])
@pytest.mark.parametrize("kv_block", [64, 32, 16])
def test_gluon_forward_settings_match_reference(k_stages, v_stages, with_lengths, kv_block):
    from vsa2_rl.kernels.block_sparse_gluon import bsa_forward_gluon

    q, k, v, ids, counts, bias, lengths, scale, _ = _case(
        with_lengths, strided=True, kv_block=kv_block
    )
    # contiguous outputs, as bsa_forward allocates them (q is a transposed view here)
    out = torch.empty(q.shape, device="cuda", dtype=q.dtype)
    lse = torch.empty(q.shape[:3], device="cuda")
    no_lengths = torch.zeros(1, device="cuda", dtype=torch.int32)
    bsa_forward_gluon(
        q, k, v, ids, counts, bias, lengths if with_lengths else no_lengths, out, lse,
        kv_block=kv_block, qk_scale=scale * LOG2E, has_bias=True, has_len=with_lengths,
        k_stages=k_stages, v_stages=v_stages,
    )  # fmt: skip
    ref = block_sparse_attention_torch(
        q.double(), k.double(), v.double(), ids, counts, bias.double(), lengths, 64, kv_block,
        scale,
    )  # fmt: skip
    _check_forward(out, lse, *ref, counts)


@pytest.mark.parametrize("with_lengths", [False, True])
@pytest.mark.parametrize("kv_block", [64, 32, 16])
def test_gluon_dq_pass_matches_triton_pass_and_float64(monkeypatch, with_lengths, kv_block):
    """The Gluon dQ pass at every kv_block, whichever ``_dq_pass`` routes to: dq against float64
    autograd, and all four outputs (dq, delta, raw d(bias), pair mass) against the Triton pass
    (checked against float64 by the CPU tests)."""
    from vsa2_rl.kernels.block_sparse_gluon import bsa_backward_dq_gluon

    q, k, v, ids, counts, bias, lengths, scale, dout = _case(
        with_lengths, strided=True, kv_block=kv_block
    )
    out, lse = bsa_forward(q, k, v, ids, counts, bias, lengths, 64, kv_block, scale)
    dlse = torch.where(lse.isfinite(), torch.randn_like(lse), 0.0)
    lens = lengths if with_lengths else torch.zeros(1, device="cuda", dtype=torch.int32)
    flags = dict(scale=scale, has_bias=True, has_len=with_lengths, has_dlse=True)
    args = (dout, q, k, v, out, lse, dlse, ids, counts, bias, lens)
    gluon = block_sparse._dq_pass_outputs(q, bias, has_bias=True)
    bsa_backward_dq_gluon(*args, gluon, qk_scale=scale * LOG2E, kv_block=kv_block, **flags)
    monkeypatch.setenv("VSA2_RL_GLUON", "0")
    triton_ = block_sparse._dq_pass_outputs(q, bias, has_bias=True)
    block_sparse._dq_pass(*args, triton_, q_tile=64, kv_block=kv_block, **flags)
    for name, got, ref in zip(("dq", "delta", "dbias", "mass"), gluon, triton_, strict=True):
        assert _rel_rms(got, ref) <= 1e-2, f"{name}: relative RMS {_rel_rms(got, ref):.2e}"

    leaf = q.double().requires_grad_()
    ref_out, ref_lse = block_sparse_attention_torch(
        leaf, k.double(), v.double(), ids, counts, bias.double(), lengths, 64, kv_block, scale
    )
    loss = (ref_out * dout.double()).sum() + torch.where(
        ref_lse.isfinite(), ref_lse * dlse.double(), 0.0
    ).sum()
    (ref_dq,) = torch.autograd.grad(loss, leaf)
    assert _rel_rms(gluon[0], ref_dq) <= 2e-2, f"dq: relative RMS {_rel_rms(gluon[0], ref_dq):.2e}"


@pytest.mark.parametrize("kv_block", [64, 32, 16])
@pytest.mark.parametrize("dtype,D", [(torch.bfloat16, 128), (torch.float16, 64)])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("with_lengths", [False, True])
def test_routed_forward_and_backward_match_float64_autograd(
    with_lengths, strided, dtype, D, kv_block
):
    """``bsa_forward`` / ``bsa_backward`` as the autograd op calls them: Gluon forward and dQ
    pass, Triton dK/dV pass; gradients of a loss through out and lse against float64 autograd."""
    q, k, v, ids, counts, bias, lengths, scale, dout = _case(
        with_lengths, strided, dtype, D, kv_block
    )
    assert _gluon_wanted(64, kv_block, q, k, v, dout)
    out, lse = bsa_forward(q, k, v, ids, counts, bias, lengths, 64, kv_block, scale)
    leaves = [x.double().requires_grad_() for x in (q, k, v, bias)]
    ref_out, ref_lse = block_sparse_attention_torch(
        *leaves[:3], ids, counts, leaves[3], lengths, 64, kv_block, scale
    )
    _check_forward(out, lse, ref_out.detach(), ref_lse.detach(), counts)

    dlse = torch.where(ref_lse.isfinite(), torch.randn_like(lse), 0.0)
    dq, dk, dv, dbias = bsa_backward(
        dout, dlse, q, k, v, out, lse, ids, counts, bias, lengths, 64, kv_block, scale
    )
    loss = (ref_out * dout.double()).sum() + torch.where(
        ref_lse.isfinite(), ref_lse * dlse.double(), 0.0
    ).sum()
    refs = torch.autograd.grad(loss, leaves)
    names, tolerances = ("dq", "dk", "dv", "dbias"), (2e-2, 2e-2, 2e-2, 1e-2)
    for name, got, ref, tol in zip(names, (dq, dk, dv, dbias), refs, tolerances, strict=True):
        assert _rel_rms(got, ref) <= tol, f"{name}: relative RMS {_rel_rms(got, ref):.2e}"
