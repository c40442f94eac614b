"""The Hopper Gluon fine-stage forward and dQ pass against the Triton kernels at the
Wan2.1-14B 720p shape (H=40, S=75264, D=128, bf16), kv_block 64, sparsity 0.95 and 0.875, for
every kernel setting offered (ring stages, Q in registers, register cap).

    python benchmarks/bench_gluon.py
"""

import os

import torch
from triton.testing import do_bench

from vsa2_rl.kernels import block_sparse as bs
from vsa2_rl.kernels.block_sparse import bsa_forward
from vsa2_rl.kernels.block_sparse_gluon import bsa_backward_dq_gluon, bsa_forward_gluon

os.environ["VSA2_RL_GLUON"] = "0"  # bsa_forward below is the Triton kernel


def time_sparsity(q, k, v, sparsity: float) -> None:
    B, H, S, D = q.shape
    nq = nseg = S // 64
    keep = round((1 - sparsity) * nseg)
    ids = torch.rand(B, H, nq, nseg, device="cuda").topk(keep, dim=-1).indices.int()
    counts = torch.full((B, H, nq), keep, device="cuda", dtype=torch.int32)
    bias = 0.1 * torch.randn(B, H, nq, keep, device="cuda")
    flops = 4.0 * B * H * S * keep * 64 * D
    ref, _ = bsa_forward(q, k, v, ids, counts, bias, None, 64, 64, D**-0.5)
    # every segment full: the kernels' length masks cost what they cost in the model, no more
    lens = torch.full((nseg,), 64, device="cuda", dtype=torch.int32)
    runs = {"fwd triton": lambda: bsa_forward(q, k, v, ids, counts, bias, None, 64, 64, D**-0.5)}
    runs["fwd triton, lengths"] = lambda: bsa_forward(
        q, k, v, ids, counts, bias, lens, 64, 64, D**-0.5
    )
    for k_stages, v_stages in ((1, 2), (2, 2)):
        for lengths in (None, lens):
            tag = f"fwd gluon ({k_stages}, {v_stages}){', lengths' if lengths is not None else ''}"
            runs[tag] = lambda st=(k_stages, v_stages), ln=lengths: bsa_forward_gluon(
                q, k, v, ids, counts, bias, ln, D**-0.5, *st
            )
    report(runs, ref, flops, sparsity)
    # dQ pass: the Triton kernel launched as bsa_backward does, without the dK/dV pass
    out, lse = bsa_forward(q, k, v, ids, counts, bias, None, 64, 64, D**-0.5)
    dout = torch.randn_like(out)
    ref_dq = triton_dq(dout, q, k, v, out, lse, ids, counts, bias)[0]
    runs = {"dq triton": lambda: triton_dq(dout, q, k, v, out, lse, ids, counts, bias)}
    for stages in ((3, 1), (2, 1)):
        for lengths in (None, lens):
            tag = f"dq gluon {stages}{', lengths' if lengths is not None else ''}"
            runs[tag] = lambda st=stages, ln=lengths: gluon_dq(
                dout, q, k, v, out, lse, ids, counts, bias, ln, *st
            )
    report(runs, ref_dq, 1.5 * flops, sparsity)


def gluon_dq(dout, q, k, v, out, lse, ids, counts, bias, lengths, k_stages, v_stages):
    B, H, S, D = q.shape
    grads = (
        torch.empty_like(q),
        torch.empty((B, H, S), device=q.device),
        torch.zeros_like(bias),
        torch.zeros_like(bias),
    )
    bsa_backward_dq_gluon(
        dout, None, q, k, v, out, lse, ids, counts, bias, lengths, D**-0.5, grads, k_stages,
        v_stages,
    )  # fmt: skip
    return grads


def triton_dq(dout, q, k, v, out, lse, ids, counts, bias):
    B, H, S, D = q.shape
    NQ, KMAX = ids.shape[2], ids.shape[3]
    dq = torch.empty_like(q)
    delta = torch.empty((B, H, S), device=q.device)
    dbias, mass = torch.zeros_like(bias), torch.zeros_like(bias)
    (desc_k, desc_v), tma = bs._tma_descriptors(64, k, v)
    lens = bs._dummy(q.device, torch.int32)
    bs._bsa_bwd_dq_kernel[(NQ, B * H)](
        q, k, v, desc_k, desc_v, out, dout, lse, bs._dummy(q.device, torch.float32), delta, dq,
        dbias, mass, ids, counts, bias, lens,
        *bs._bhs_strides(q), *bs._bhs_strides(k), *bs._bhs_strides(v), *bs._bhs_strides(out),
        *bs._bhs_strides(dout), D**-0.5 * bs.LOG2E, D**-0.5,
        H=H, S=S, NQ=NQ, KMAX=KMAX, Q_TILE=64, KV_BLOCK=64, HEAD_DIM=D,
        HAS_BIAS=True, HAS_LEN=False, HAS_DLSE=False, DOT_PREC="ieee", TMA=tma,
    )  # fmt: skip
    return dq, delta


def report(runs, ref, flops, sparsity) -> None:
    for name, fn in runs.items():
        diff = (fn()[0].float() - ref.float()).abs().max().item()
        ms = do_bench(fn, warmup=10, rep=50, return_mode="median")
        print(f"| {sparsity} | {name} | {ms:.3f} | {flops / ms / 1e9:.0f} | {diff:.2e} |")


def main() -> None:
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(1, 40, 75264, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)
    )
    print("| sparsity | kernel | ms | TFLOP/s | max abs diff vs the reference |")
    print("|---|---|---|---|---|")
    for sparsity in (0.95, 0.875):
        time_sparsity(q, k, v, sparsity)


if __name__ == "__main__":
    main()
