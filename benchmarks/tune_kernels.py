"""GPU tuning aid for the VSA2 kernels: where the full op spends its time, and which launch
configuration each fine-stage kernel runs best with.

Three parts, at the Wan2.1-14B 720p shape (B=1, H=40, S=75264, D=128, bf16) unless ``--host``
is given another one:

* ``--profile``: per-kernel device time (torch profiler) of one ``vsa2_attention`` forward +
  backward with the coarse stage on, so the router / pooling / fusion overhead around the fine
  stage can be read kernel by kernel, then summed by part of the op (``PARTS``): at the
  recipes' settings (kv_block 16 top-p at 0.95 and 0.875, kv_block 64 top-p), then kv_block 64
  top-k;
* ``--host``: at a chosen shape (``--shape``, 480p = Wan2.1-1.3B: H=12, S=32768), kv_block and
  router mode, the forward alone and forward + backward of ``vsa2_attention``: wall time per
  call (``do_bench``), the host time of issuing one call (no synchronisation), and the device
  time summed by part. Where the host time exceeds the device time, the op is launch-bound and
  the wall time is host time;
* ``--sweep``: each fine-stage kernel (forward, dQ pass, dK/dV pass) pinned in turn to every
  candidate ``triton.Config`` (the others keep their autotuned choice), timed with
  ``triton.testing.do_bench`` medians; prints one line per configuration, best first;
* ``--topk``: the router's row-wise top-k (``topk_log_softmax``) at the 720p rows of kv_block
  64, 32 and 16 (1176 query tiles x 40 heads, 1176 / 2352 / 4704 segments, 5% kept), in
  "topk" and "topp" mode, for each number of warps per row, against ``torch.topk`` alone; then
  at kv_block 16 with the budgets of sparsity 0.875 and 0.75;
* ``--gather-bound``: how close the fine-stage kernels run to the cost of their loads alone.
  A load-only kernel gathers the same 64-row blocks by TMA in the same order (K and V per
  selected segment, query-major, as the forward and dQ pass do; Q and dO per selecting tile,
  key-major, as the dK/dV pass does) and only adds them up; its time and bytes per second set
  against the real kernels' on the same selection, kv_block 64.

    python benchmarks/tune_kernels.py --profile --sweep --gather-bound
    python benchmarks/tune_kernels.py --host --shape 480p --kv-block 16 --mode topp
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import itertools
import pstats
import sys
import time

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

B, D = 1, 128
# (heads, tokens) of the Wan shapes: Wan2.1-1.3B at 480p, Wan2.1-14B at 720p
SHAPES = {"480p": (12, 32768), "720p": (40, 75264)}


def inputs(kv_block: int, sparsity: float, shape: str = "720p"):
    H, S = SHAPES[shape]
    q, k, v = (
        torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    nq, nseg = S // 64, S // kv_block
    keep = max(1, round((1 - sparsity) * nseg))
    ids = torch.rand(B, H, nq, nseg, device="cuda").topk(keep, dim=-1).indices.to(torch.int32)
    counts = torch.full((B, H, nq), keep, device="cuda", dtype=torch.int32)
    bias = (0.1 * torch.randn(B, H, nq, keep, device="cuda")).requires_grad_()
    return q, k, v, ids, counts, bias


# kernel-name fragment -> part of the op (first match wins); kernels matching none (elementwise
# work of the router, the kv-major index sort of the dK/dV pass) count as "other"
PARTS = (
    ("_bsa_", "fine stage"),
    ("_pool_", "pooling"),
    ("_fusion_", "gated fusion"),
    ("_topk_", "router top-k"),
    ("sdpa", "coarse stage (SDPA)"),
    ("fmha", "coarse stage (SDPA)"),
    ("flash", "coarse stage (SDPA)"),
    ("gemm", "router GEMMs"),
    ("nvjet", "router GEMMs"),
    ("xmma", "router GEMMs"),
    ("cutlass", "router GEMMs"),
)


def _device_ms_by_part(prof) -> dict[str, float]:
    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.name.lower()
        part = next((p for fragment, p in PARTS if fragment in name), "other")
        totals[part] = totals.get(part, 0.0) + event.device_time_total / 1e3
    return totals


def _print_parts(totals: dict[str, float]) -> None:
    """Device time per part and the share of everything but the fine-stage kernels."""
    whole = sum(totals.values())
    for part, ms in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {part:24s} {ms:8.2f} ms  {100 * ms / whole:5.1f}%")
    outside = whole - totals.get("fine stage", 0.0)
    router_coarse = outside - totals.get("gated fusion", 0.0)
    print(
        f"  device time {whole:.2f} ms; outside the fine-stage kernels {outside:.2f} ms = "
        f"{100 * outside / whole:.1f}%; router + coarse stage (all of it but the gated fusion, "
        f"'other' included) {router_coarse:.2f} ms = {100 * router_coarse / whole:.1f}%"
    )


def full_op_calls(kv_block: int, sparsity: float, mode: str, shape: str = "720p"):
    """(forward, forward + backward) of ``vsa2_attention`` with the coarse stage on, at a Wan
    shape, device-resident lengths (no host sync), per-element gates and alpha 0.5."""
    from vsa2_rl.kernels import vsa2_attention

    H, S = SHAPES[shape]
    q, k, v, *_ = inputs(kv_block, sparsity, shape)
    go = torch.randn_like(q)
    # the attention config's defaults but for the segment size and the router mode
    settings = {
        "q_tile": 64, "kv_block": kv_block, "mode": mode, "top_p": 0.9, "min_kv": 1,
        "dense_threshold": 0.99,
    }  # fmt: skip
    tile_len = torch.full((S // 64,), 64, device="cuda", dtype=torch.int32)
    seg_len = torch.full((S // kv_block,), kv_block, device="cuda", dtype=torch.int32)
    # as in the model (and bench_attention.py): a non-zero router-bias scale and per-element
    # gates, the Linear outputs of the hidden states
    alpha = torch.full((H,), 0.5, device="cuda", requires_grad=True)
    gate_c = (0.1 * torch.randn_like(q)).detach().requires_grad_()
    gate_f = (1 + 0.1 * torch.randn_like(q)).detach().requires_grad_()

    def forward():
        out, _ = vsa2_attention(
            q, k, v, tile_lengths=tile_len, seg_lengths=seg_len, sparsity=sparsity,
            alpha=alpha, gate_coarse=gate_c, gate_fine=gate_f,
            num_valid_segments=S // kv_block, **settings,
        )  # fmt: skip
        return out

    def step():
        torch.autograd.grad(forward(), (q, k, v, alpha, gate_c, gate_f), go)

    return forward, step


def _host_ms(fn, calls: int = 20) -> float:
    """Mean host time of issuing ``fn`` (no synchronisation inside the timed span)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e3
    torch.cuda.synchronize()
    return host


def _profiled(fn):
    """The torch profiler's record (device kernels) of one call of ``fn``."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return prof


def host_vs_device(kv_block: int, sparsity: float, mode: str, shape: str) -> None:
    """Wall, host-issue and device time of the full op, forward alone and forward + backward."""
    forward, step = full_op_calls(kv_block, sparsity, mode, shape)
    H, S = SHAPES[shape]

    def forward_no_grad():
        with torch.no_grad():
            forward()

    print(f"\n-- full op at {shape} (H={H} S={S}), kv{kv_block}, sparsity {sparsity}, {mode} --")
    print("| call | wall ms | host-issue ms | device ms | device ms by part |")
    print("|---|---|---|---|---|")
    for label, fn in (("forward (no grad)", forward_no_grad), ("forward + backward", step)):
        fn()
        fn()
        wall = do_bench(fn, warmup=5, rep=50, return_mode="median")
        host = _host_ms(fn)
        parts = _device_ms_by_part(_profiled(fn))
        by_part = ", ".join(f"{p} {ms:.3f}" for p, ms in sorted(parts.items(), key=lambda x: -x[1]))
        print(f"| {label} | {wall:.3f} | {host:.3f} | {sum(parts.values()):.3f} | {by_part} |")
    # where the host time of the forward goes: Python functions by own time, 20 calls
    profiler = cProfile.Profile()
    profiler.runcall(_host_ms, forward_no_grad)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


def profile_full_op(kv_block: int, sparsity: float, rows: int, mode: str = "topk") -> None:
    _, step = full_op_calls(kv_block, sparsity, mode)

    step()
    step()
    torch.cuda.synchronize()
    ms = do_bench(step, warmup=3, rep=20, return_mode="median")
    prof = _profiled(step)
    print(
        f"\n-- full op fwd+bwd, kv{kv_block}, sparsity {sparsity}, {mode}: {ms:.2f} ms (median) --"
    )
    print(
        prof.key_averages().table(
            sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70
        )
    )
    _print_parts(_device_ms_by_part(prof))


def sweep(kv_block: int, sparsity: float, which: str, configs) -> None:
    from vsa2_rl.kernels import block_sparse

    q, k, v, ids, counts, bias = inputs(kv_block, sparsity)
    with torch.no_grad():
        out, lse = block_sparse.bsa_forward(q, k, v, ids, counts, bias, None, 64, kv_block, D**-0.5)
    go = torch.randn_like(q)
    kernel = {
        "fwd": block_sparse._bsa_fwd_kernel,
        "dq": block_sparse._bsa_bwd_dq_kernel,
        "dkv": block_sparse._bsa_bwd_dkv_kernel,
    }[which]
    original = list(kernel.configs)

    def call():
        if which == "fwd":
            block_sparse.bsa_forward(q, k, v, ids, counts, bias, None, 64, kv_block, D**-0.5)
        else:
            block_sparse.bsa_backward(
                go, None, q, k, v, out, lse, ids, counts, bias, None, 64, kv_block, D**-0.5
            )

    results = []
    for cfg in configs:
        kernel.configs = [cfg]
        kernel.cache.clear()
        try:
            call()
            torch.cuda.synchronize()
            results.append((do_bench(call, warmup=25, rep=150, return_mode="median"), cfg))
        except Exception as e:  # out of shared memory / registers: report, go on
            print(f"  {which} kv{kv_block} {cfg}: failed ({type(e).__name__}: {str(e)[:80]})")
    kernel.configs = original
    kernel.cache.clear()
    print(f"\n-- sweep {which}, kv{kv_block}, sparsity {sparsity} ("
          f"{'fwd' if which == 'fwd' else 'whole backward'} ms) --")  # fmt: skip
    for ms, cfg in sorted(results, key=lambda r: r[0]):
        print(f"  {ms:8.3f} ms  {cfg}")


@triton.jit
def _gather_only_kernel(
    DESC_A, DESC_B, OFFSETS, BLOCKS, OUT, NPROG, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr
):
    """Load-only twin of a fine-stage kernel (B = 1): program (i, head) walks the CSR list
    ``BLOCKS[OFFSETS[j]:OFFSETS[j + 1]]``, j = head * NPROG + i, of block ids, loads the
    [ROWS, HEAD_DIM] blocks of A and B there and keeps their sum (so no load is dropped)."""
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    i_csr = i_h * NPROG + i_p
    b_acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    for i in range(tl.load(OFFSETS + i_csr), tl.load(OFFSETS + i_csr + 1)):
        at = [0, i_h, tl.load(BLOCKS + i) * ROWS, 0]
        b_a = DESC_A.load(at).reshape(ROWS, HEAD_DIM)
        b_b = DESC_B.load(at).reshape(ROWS, HEAD_DIM)
        b_acc += b_a.to(tl.float32) + b_b.to(tl.float32)
    tl.store(OUT + i_csr, tl.sum(tl.sum(b_acc, 1), 0))


def gather_bound(sparsity: float) -> None:
    """Fine-stage kernels at kv_block 64 against load-only kernels of the same gathers."""
    from vsa2_rl.kernels import block_sparse

    q, k, v, ids, counts, bias = inputs(64, sparsity)
    H, S = q.shape[1], q.shape[2]
    nq, keep = ids.shape[2], ids.shape[3]
    scale = D**-0.5
    go = torch.randn_like(q)
    with torch.no_grad():
        out, lse = block_sparse.bsa_forward(q, k, v, ids, counts, bias, None, 64, 64, scale)

    # query-major: every row's segments (all rows hold `keep`); key-major: the dK/dV index
    q_major = (torch.arange(H * nq + 1, device="cuda", dtype=torch.int32) * keep, ids.flatten())
    offsets, pairs = block_sparse.build_kv_major_index(ids, counts, S // 64)
    k_major = (offsets, ((pairs // keep) % nq).to(torch.int32))
    sink = torch.empty(H * nq, device="cuda")

    def load_only(a, b, csr):
        (desc_a, desc_b), _ = block_sparse._tma_descriptors(64, a, b)
        _gather_only_kernel[(nq, H)](desc_a, desc_b, *csr, sink, nq, ROWS=64, HEAD_DIM=D)

    # no lengths, no dLSE: placeholders, as bsa_backward passes them
    dq_grads = block_sparse._dq_pass_outputs(q, bias, has_bias=True)
    no_dlse, no_lens = (block_sparse._dummy(q.device, t) for t in (torch.float32, torch.int32))
    dq_args = (go, q, k, v, out, lse, no_dlse, ids, counts, bias, no_lens)

    def dq_pass():
        block_sparse._dq_pass(
            *dq_args, dq_grads, q_tile=64, kv_block=64, scale=scale, has_bias=True,
            has_len=False, has_dlse=False,
        )  # fmt: skip

    def forward():
        block_sparse.bsa_forward(q, k, v, ids, counts, bias, None, 64, 64, scale)

    def backward():
        block_sparse.bsa_backward(
            go, None, q, k, v, out, lse, ids, counts, bias, None, 64, 64, scale
        )

    def timed(fn):
        fn()
        torch.cuda.synchronize()
        return do_bench(fn, warmup=10, rep=50, return_mode="median")

    gathered_gb = H * nq * keep * 2 * 64 * D * q.element_size() / 1e9
    fwd_ms, dq_ms, bwd_ms = timed(forward), timed(dq_pass), timed(backward)
    rows = [
        ("K, V by slot (query-major)", "load only", timed(lambda: load_only(k, v, q_major))),
        ("", "forward", fwd_ms),
        ("", "dQ pass", dq_ms),
        ("Q, dO by pair (key-major)", "load only", timed(lambda: load_only(q, go, k_major))),
        ("", "backward - dQ pass (dK/dV pass, index)", bwd_ms - dq_ms),
    ]
    print(f"\n-- gather bound, kv64, sparsity {sparsity}: {gathered_gb:.1f} GB per pass --")
    print("| blocks gathered | kernel | ms | TB/s of gathered blocks |")
    print("|---|---|---|---|")
    for pattern, kernel, ms in rows:
        print(f"| {pattern} | {kernel} | {ms:.2f} | {gathered_gb / ms:.2f} |")


def topk_warps() -> None:
    """Router top-k per row width and warps per row; ids must not depend on the warps."""
    from vsa2_rl.kernels.router import max_kv_for
    from vsa2_rl.kernels.topk import NUM_WARPS, topk_log_softmax

    H, S = SHAPES["720p"]
    nq = S // 64
    print("\n-- router top-k, 720p rows (40 x 1176), 5% kept --")
    print("| segments | mode | warps | ms |")
    print("|---|---|---|---|")
    for kv_block in (64, 32, 16):
        nseg = S // kv_block
        kmax = max_kv_for(0.95, nseg)
        scores = torch.randn(B, H, nq, nseg, device="cuda")
        ms = do_bench(functools.partial(torch.topk, scores, kmax, dim=-1), return_mode="median")
        print(f"| {nseg} | torch.topk alone | - | {ms:.3f} |")
        for top_p in (None, 0.9):
            mode = "topk" if top_p is None else "topp"
            ref = topk_log_softmax(scores, kmax, top_p)[1]
            for warps in (2, 4, 8):
                call = functools.partial(topk_log_softmax, scores, kmax, top_p, num_warps=warps)
                if not torch.equal(call()[1], ref):
                    sys.exit(f"top-k ids at {warps} warps differ from the default's")
                ms = do_bench(call, return_mode="median")
                tag = " (default)" if warps == NUM_WARPS else ""
                print(f"| {nseg} | {mode} | {warps}{tag} | {ms:.3f} |")
    print("\n-- kv_block 16 rows at the budgets of lower sparsities (recipes' eval: 0.75) --")
    print("| sparsity | kept | mode | ms |")
    print("|---|---|---|---|")
    nseg = S // 16
    scores = torch.randn(B, H, nq, nseg, device="cuda") * 4  # peaked: top-p sets below the budget
    for sparsity in (0.875, 0.75):
        kmax = max_kv_for(sparsity, nseg)
        for top_p in (None, 0.9):
            ms = do_bench(
                functools.partial(topk_log_softmax, scores, kmax, top_p), return_mode="median"
            )
            print(f"| {sparsity} | {kmax} | {'topk' if top_p is None else 'topp'} | {ms:.3f} |")


def fwd_like_configs():
    return [
        triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s)
        for bn, w, s in itertools.product((64, 128), (4, 8), (2, 3, 4))
    ]


def dkv_configs():
    return [
        triton.Config({"QG": qg}, num_warps=w, num_stages=s)
        for qg, w, s in itertools.product((1, 2), (4, 8), (2, 3, 4))
    ]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--gather-bound", action="store_true", help="kernels vs their loads alone")
    p.add_argument("--rows", type=int, default=28, help="kernels listed per profile")
    p.add_argument("--host", action="store_true", help="host vs device time of the full op")
    p.add_argument("--topk", action="store_true", help="router top-k by warps per row")
    p.add_argument("--shape", choices=sorted(SHAPES), default="720p", help="for --host")
    p.add_argument("--kv-block", type=int, default=16, help="for --host")
    p.add_argument("--mode", choices=("topk", "topp"), default="topp", help="for --host")
    p.add_argument("--sparsity", type=float, default=0.95, help="for --host")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("tune_kernels.py needs a CUDA device")
    torch.manual_seed(0)
    if args.host:
        host_vs_device(args.kv_block, args.sparsity, args.mode, args.shape)
    if args.profile:
        # the recipes' settings first (1.3B: kv16 top-p; 14B: kv64 top-p), then VSA's top-k
        profile_full_op(16, 0.95, args.rows, mode="topp")
        profile_full_op(16, 0.875, args.rows, mode="topp")
        profile_full_op(64, 0.95, args.rows, mode="topp")
        profile_full_op(64, 0.95, args.rows)
    if args.topk:
        topk_warps()
    if args.gather_bound:
        gather_bound(0.95)
        gather_bound(0.875)
    if args.sweep:
        sweep(64, 0.95, "fwd", fwd_like_configs())
        sweep(64, 0.95, "dq", fwd_like_configs())
        sweep(64, 0.95, "dkv", dkv_configs())
        sweep(16, 0.95, "dkv", dkv_configs())


if __name__ == "__main__":
    main()
