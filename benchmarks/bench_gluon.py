"""The Hopper Gluon fine-stage forward (kv_block 64, 32, 16) and dQ pass (kv_block 64) against
the Triton kernels at the Wan2.1-14B 720p shape (H=40, S=75264, D=128, bf16), sparsity 0.95 and
0.875, random selections with a bias and every segment's length given (as the op passes them).

    python benchmarks/bench_gluon.py
"""

import os

import torch
from triton.testing import do_bench

from vsa2_rl.kernels import block_sparse as bs
from vsa2_rl.kernels.block_sparse import bsa_forward
from vsa2_rl.kernels.block_sparse_gluon import bsa_backward_dq_gluon, bsa_forward_gluon

os.environ["VSA2_RL_GLUON"] = "0"  # bsa_forward below is the Triton kernel


def time_sparsity(q, k, v, kv_block: int, sparsity: float) -> None:
    B, H, S, D = q.shape
    nq, nseg = S // 64, S // kv_block
    keep = round((1 - sparsity) * nseg)
    ids = torch.rand(B, H, nq, nseg, device="cuda").topk(keep, dim=-1).indices.int()
    counts = torch.full((B, H, nq), keep, device="cuda", dtype=torch.int32)
    bias = 0.1 * torch.randn(B, H, nq, keep, device="cuda")
    lens = torch.full((nseg,), kv_block, device="cuda", dtype=torch.int32)
    flops = 4.0 * B * H * S * keep * kv_block * D
    sel = (ids, counts, bias, lens)
    tag = f"{sparsity} | kv{kv_block}"
    fwd = {
        "fwd triton": lambda: bsa_forward(q, k, v, *sel, 64, kv_block, D**-0.5),
        "fwd gluon": lambda: bsa_forward_gluon(q, k, v, *sel, kv_block, D**-0.5),
    }
    report(tag, fwd, flops)
    out, lse = fwd["fwd triton"]()
    dout = torch.randn_like(out)
    dq = {"dq triton": lambda: triton_dq(dout, q, k, v, out, lse, *sel, kv_block)}
    if kv_block == 64:  # the Gluon dQ pass exists for kv_block 64 only
        dq["dq gluon"] = lambda: gluon_dq(dout, q, k, v, out, lse, *sel)
    report(tag, dq, 1.5 * flops)


def gluon_dq(dout, q, k, v, out, lse, ids, counts, bias, lens):
    B, H, S, D = q.shape
    grads = (
        torch.empty_like(q),
        torch.empty((B, H, S), device=q.device),
        torch.zeros_like(bias),
        torch.zeros_like(bias),
    )
    bsa_backward_dq_gluon(dout, None, q, k, v, out, lse, ids, counts, bias, lens, D**-0.5, grads)
    return grads


def triton_dq(dout, q, k, v, out, lse, ids, counts, bias, lens, kv_block):
    """The Triton dQ pass launched as ``bsa_backward`` does, without the dK/dV pass."""
    B, H, S, D = q.shape
    NQ, KMAX = ids.shape[2], ids.shape[3]
    dq = torch.empty_like(q)
    delta = torch.empty((B, H, S), device=q.device)
    dbias, mass = torch.zeros_like(bias), torch.zeros_like(bias)
    (desc_k, desc_v), tma = bs._tma_descriptors(kv_block, k, v)
    bs._bsa_bwd_dq_kernel[(NQ, B * H)](
        q, k, v, desc_k, desc_v, out, dout, lse, bs._dummy(q.device, torch.float32), delta, dq,
        dbias, mass, ids, counts, bias, lens,
        *bs._bhs_strides(q), *bs._bhs_strides(k), *bs._bhs_strides(v), *bs._bhs_strides(out),
        *bs._bhs_strides(dout), D**-0.5 * bs.LOG2E, D**-0.5,
        H=H, S=S, NQ=NQ, KMAX=KMAX, Q_TILE=64, KV_BLOCK=kv_block, HEAD_DIM=D,
        HAS_BIAS=True, HAS_LEN=True, HAS_DLSE=False, DOT_PREC="ieee", TMA=tma,
    )  # fmt: skip
    return dq, delta, dbias, mass


def report(tag: str, runs: dict, flops: float) -> None:
    """Times each run; the first is the reference of the others (its max abs difference)."""
    ref = None
    for name, fn in runs.items():
        first = fn()[0].float()
        ref = first if ref is None else ref
        diff = (first - ref).abs().max().item()
        ms = do_bench(fn, warmup=10, rep=50, return_mode="median")
        print(f"| {tag} | {name} | {ms:.3f} | {flops / ms / 1e9:.0f} | {diff:.2e} |", flush=True)


def main() -> None:
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(1, 40, 75264, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)
    )
    print("| sparsity | kv_block | kernel | ms | TFLOP/s | max abs diff vs Triton |")
    print("|---|---|---|---|---|---|")
    for kv_block in (64, 32, 16):
        for sparsity in (0.95, 0.875):
            time_sparsity(q, k, v, kv_block, sparsity)


if __name__ == "__main__":
    main()
