"""The Hopper Gluon fine-stage forward and dQ pass (kv_block 64, 32, 16) against the Triton
kernels at the Wan2.1-14B 720p shape (H=40, S=75264, D=128, bf16), sparsity 0.95 and 0.875,
random selections with a bias and every segment's length given (as the op passes them).

    python benchmarks/bench_gluon.py
"""

import os

import torch
from triton.testing import do_bench

from vsa2_rl.kernels import block_sparse as bs
from vsa2_rl.kernels.block_sparse import bsa_forward
from vsa2_rl.kernels.block_sparse_gluon import bsa_backward_dq_gluon, bsa_forward_gluon

os.environ["VSA2_RL_GLUON"] = "0"  # bsa_forward and _dq_pass below run the Triton kernels


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
        "fwd gluon": lambda: gluon_forward(q, k, v, *sel, kv_block),
    }
    report(tag, fwd, flops)
    out, lse = fwd["fwd triton"]()
    dout = torch.randn_like(out)
    dq = {
        "dq triton": lambda: dq_pass(dout, q, k, v, out, lse, *sel, kv_block, gluon=False),
        "dq gluon": lambda: dq_pass(dout, q, k, v, out, lse, *sel, kv_block, gluon=True),
    }
    report(tag, dq, 1.5 * flops)


def gluon_forward(q, k, v, ids, counts, bias, lens, kv_block):
    B, H, S, D = q.shape
    out = torch.empty((B, H, S, D), device=q.device, dtype=q.dtype)
    lse = torch.empty((B, H, S), device=q.device)
    bsa_forward_gluon(
        q, k, v, ids, counts, bias, lens, out, lse, kv_block=kv_block,
        qk_scale=D**-0.5 * bs.LOG2E, has_bias=True, has_len=True,
    )  # fmt: skip
    return out, lse


def dq_pass(dout, q, k, v, out, lse, ids, counts, bias, lens, kv_block, gluon: bool):
    """The dQ pass alone, as ``bsa_backward`` launches it: the Triton kernel through
    ``_dq_pass`` (VSA2_RL_GLUON=0 here) or the Gluon one."""
    D = q.shape[-1]
    grads = bs._dq_pass_outputs(q, bias, has_bias=True)
    no_dlse = bs._dummy(q.device, torch.float32)
    args = (dout, q, k, v, out, lse, no_dlse, ids, counts, bias, lens, grads)
    flags = dict(scale=D**-0.5, has_bias=True, has_len=True, has_dlse=False)
    if gluon:
        bsa_backward_dq_gluon(*args, qk_scale=D**-0.5 * bs.LOG2E, kv_block=kv_block, **flags)
    else:
        bs._dq_pass(*args, q_tile=64, kv_block=kv_block, **flags)
    return grads


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
