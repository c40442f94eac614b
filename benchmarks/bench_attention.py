"""GPU benchmark of VSA2 attention against dense cuDNN SDPA, FlexAttention and FastVideo VSA.

Times the forward and forward+backward (``torch.autograd.grad`` w.r.t. q, k, v, so no gradient
accumulation is timed) with ``triton.testing.do_bench`` medians at Wan2.1 shapes, bf16, D=128:

* dense SDPA forced onto cuDNN (the 1x reference of every speed-up);
* FlexAttention (compiled) with a block mask of the same sparsity at 128-token blocks (the
  ANCHORS.md note: this torch rejects 64-token BlockMasks);
* FastVideo VSA (``fastvideo_kernel.video_sparse_attn``) if it imports;
* our fine stage ``block_sparse_attention`` alone at kv_block 16/32/64, with a per-pair bias;
* our full VSA2 op ``vsa2_attention`` (coarse + router + fine) if it imports, in router mode
  ``topk`` and, with ``--router-modes topk,topp``, ``topp`` at top_p 0.9 (the recipes' mode;
  on random scores it keeps the whole budget, so the two rows differ only in the router).

``--bwd two_pass,fused`` times our rows once per backward path of the fine stage:
``two_pass`` (the default, deterministic) keeps the plain names, other paths add a suffix
(``ours-fine-kv16-fused``) and skip the forward-only row (the forward is the same kernel).
``fused:R`` forces R key ranges of the fused backward (``VSA2_RL_BWD_KEY_RANGES``; without it the
launcher picks R from the L2 size).

Selections are random by default: each query tile keeps ``round((1 - s) * NSEG)`` distinct
segments (the anchors' setting, and the worst case for the L2 cache: every tile gathers blocks
no neighbour shares). ``--selection local`` keeps the same number of segments nearest to each
tile in token order instead (neighbouring tiles share most of theirs, as real video selections
tend to), for the fine-stage rows and FlexAttention; the full op's router picks its own.
Effective TFLOP/s count only kept blocks (4*B*H*S*keys*D forward, 3.5x that for fwd+bwd).
Prints a markdown table and writes it to ``--out``.

    python benchmarks/bench_attention.py --out bench.md            # full run
    python benchmarks/bench_attention.py --quick --out quick.md    # 480p, fewer kernels
    python benchmarks/bench_attention.py --shapes 720p --kv-blocks 16,64 --sparsities 0.95 \
        --no-flex --no-fastvideo --router-modes topp --bwd two_pass,fused   # backward A/B
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys
import traceback

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

SHAPES = {"480p": (1, 12, 32768, 128), "720p": (1, 40, 75264, 128)}


class Table:
    def __init__(self) -> None:
        self.rows: list[tuple] = []
        self.dense: dict[tuple[str, str], float] = {}

    def add(self, shape, method, sparsity, mode, ms, flops):
        if method == "sdpa-cudnn":
            self.dense[(shape, mode)] = ms
        base = self.dense.get((shape, mode))
        speedup = f"{base / ms:.2f}" if base else "-"
        tflops = flops / (ms * 1e-3) / 1e12
        self.rows.append((shape, method, sparsity, mode, f"{ms:.3f}", speedup, f"{tflops:.0f}"))
        line = f"{shape:5s} {method:20s} {sparsity:6s} {mode:8s} {ms:9.3f} ms  x{speedup:>6s}"
        print(f"{line}  {tflops:5.0f} TFLOP/s", flush=True)

    def markdown(self) -> str:
        head = "| shape | method | sparsity | mode | ms | x cuDNN | eff. TFLOP/s |\n"
        head += "|---|---|---|---|---|---|---|\n"
        return head + "\n".join("| " + " | ".join(r) + " |" for r in self.rows)


def bench(fn, heavy: bool) -> float:
    warmup, rep = (10, 50) if heavy else (25, 100)
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def time_fwd_bwd(table, shape, method, sparsity, fwd, inputs, go, flops, with_fwd=True):
    """fwd() -> out; times fwd alone (unless not ``with_fwd``) and fwd + grad w.r.t. ``inputs``."""
    if with_fwd:
        with torch.no_grad():
            table.add(shape, method, sparsity, "fwd", bench(fwd, False), flops)

    def fwd_bwd():
        torch.autograd.grad(fwd(), inputs, go)

    table.add(shape, method, sparsity, "fwd+bwd", bench(fwd_bwd, True), flops * 3.5)


def select_segments(kind, B, H, NQ, NSEG, keep, device):
    """``keep`` distinct segments per query tile: ``random`` ones (unsorted, as a router emits)
    or the ``local`` band of segments nearest to the tile's centre in token order (clipped at
    the sequence ends, ascending)."""
    if kind == "random":
        ids = torch.rand(B, H, NQ, NSEG, device=device).topk(keep, dim=-1).indices
    else:
        centre = (torch.arange(NQ, device=device) * 2 + 1) * NSEG // (2 * NQ)
        start = (centre - keep // 2).clamp(0, NSEG - keep)
        ids = (start[:, None] + torch.arange(keep, device=device)).expand(B, H, NQ, keep)
    counts = torch.full((B, H, NQ), keep, device=device, dtype=torch.int32)
    return ids.to(torch.int32).contiguous(), counts


def run_shape(args, table, tag):
    B, H, S, D = SHAPES[tag]
    dev = "cuda"
    q, k, v = (
        torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    go = torch.randn_like(q)
    dense_flops = 4 * B * H * S * S * D
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        time_fwd_bwd(
            table,
            tag,
            "sdpa-cudnn",
            "dense",
            lambda: F.scaled_dot_product_attention(q, k, v),
            (q, k, v),
            go,
            dense_flops,
        )

    for s in args.sparsities:
        if not args.no_flex:
            run_flex(table, tag, s, q, k, v, go, args.selection)
        if args.fastvideo and args.selection == "random":
            run_fastvideo(table, tag, s, q, k, v, go)
        for kvb in args.kv_blocks:
            run_ours(args, table, tag, s, kvb, q, k, v, go)


def run_flex(table, tag, s, q, k, v, go, selection):
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention
    except ImportError as e:
        print(f"skip FlexAttention: {e}")
        return
    B, H, S, D = q.shape
    blk = 128
    nb = S // blk
    keep = max(1, round((1 - s) * nb))
    ids, counts = select_segments(selection, B, H, nb, nb, keep, q.device)
    full_ids = torch.zeros(B, H, nb, nb, device=q.device, dtype=torch.int32)
    full_ids[..., :keep] = ids.sort(-1).values
    # every kept block is a "full" block: no mask_mod is evaluated inside it
    bm = BlockMask.from_kv_blocks(
        torch.zeros_like(counts),
        full_ids.clone(),
        counts,
        full_ids,
        BLOCK_SIZE=blk,
        seq_lengths=(S, S),
    )
    flex = torch.compile(flex_attention, dynamic=False)
    flops = 4 * B * H * S * keep * blk * D
    time_fwd_bwd(
        table,
        tag,
        "flex-blk128" + ("-local" if selection == "local" else ""),
        f"{s}",
        lambda: flex(q, k, v, block_mask=bm),
        (q, k, v),
        go,
        flops,
    )


def run_fastvideo(table, tag, s, q, k, v, go):
    try:
        from fastvideo_kernel import video_sparse_attn
    except ImportError as e:
        print(f"skip FastVideo VSA (not importable: {e})")
        return
    B, H, S, D = q.shape
    nb = S // 64
    keep = max(1, round(nb * (1 - s)))
    vbs = torch.full((nb,), 64, device=q.device, dtype=torch.int32)
    flops = 4 * B * H * S * keep * 64 * D
    fwd = lambda: video_sparse_attn(q, k, v, vbs, vbs, keep, block_size=(4, 4, 4))
    time_fwd_bwd(table, tag, "fastvideo-vsa", f"{s}", fwd, (q, k, v), go, flops)


@contextlib.contextmanager
def backward_path(entry):
    """``(bwd, name suffix)`` of a ``--bwd`` entry, ``path`` or ``fused:R``; sets
    ``VSA2_RL_BWD_KEY_RANGES`` to R meanwhile."""
    bwd, _, ranges = entry.partition(":")
    old = os.environ.pop("VSA2_RL_BWD_KEY_RANGES", None)
    if ranges:
        os.environ["VSA2_RL_BWD_KEY_RANGES"] = ranges
    try:
        yield bwd, ("" if bwd == "two_pass" else f"-{bwd}") + (f"-r{ranges}" if ranges else "")
    finally:
        os.environ.pop("VSA2_RL_BWD_KEY_RANGES", None)
        if old is not None:
            os.environ["VSA2_RL_BWD_KEY_RANGES"] = old


def run_ours(args, table, tag, s, kvb, q, k, v, go):
    """Our rows at sparsity s and kv_block kvb, once per ``--bwd`` entry, one selection."""
    B, H, S, D = q.shape
    NQ, NSEG = S // 64, S // kvb
    keep = max(1, round((1 - s) * NSEG))
    ids, counts = select_segments(args.selection, B, H, NQ, NSEG, keep, q.device)
    bias = (0.1 * torch.randn(B, H, NQ, keep, device=q.device)).requires_grad_()
    selection = (ids, counts, bias, 4 * B * H * S * keep * kvb * D)
    for i, entry in enumerate(args.bwd):
        with backward_path(entry) as (bwd, suffix):
            run_ours_path(args, table, tag, s, kvb, q, k, v, go, selection, bwd, suffix, i == 0)


def run_ours_path(args, table, tag, s, kvb, q, k, v, go, selection, bwd, suffix, with_fwd):
    from vsa2_rl.kernels.ops import block_sparse_attention

    ids, counts, bias, flops = selection
    fwd = lambda: block_sparse_attention(q, k, v, ids, counts, bias, kv_block=kvb, bwd=bwd)[0]
    method = f"ours-fine-kv{kvb}" + ("-local" if args.selection == "local" else "") + suffix
    time_fwd_bwd(table, tag, method, f"{s}", fwd, (q, k, v, bias), go, flops, with_fwd)
    if args.profile:
        profile_kernels(
            lambda: torch.autograd.grad(fwd(), (q, k, v, bias), go), f"{tag} s={s} {method}"
        )
    if args.full:
        for router_mode in args.router_modes:
            run_full(table, tag, s, kvb, router_mode, q, k, v, go, flops, bwd, suffix, with_fwd)


def run_full(table, tag, s, kvb, router_mode, q, k, v, go, flops, bwd, suffix, with_fwd):
    try:
        from vsa2_rl.kernels import vsa2_attention
    except ImportError as e:
        print(f"skip full VSA2 op (vsa2_attention not importable: {e})")
        return
    H, S = q.shape[1], q.shape[2]
    # the attention config's defaults but for the segment size and the router mode
    settings = {
        "q_tile": 64, "kv_block": kvb, "mode": router_mode, "top_p": 0.9, "min_kv": 1,
        "dense_threshold": 0.99,
    }  # fmt: skip
    method = f"ours-full-kv{kvb}" if router_mode == "topk" else f"ours-full-{router_mode}-kv{kvb}"
    method += suffix
    tile_len = torch.full((S // 64,), 64, device=q.device, dtype=torch.int32)
    seg_len = torch.full((S // kvb,), kvb, device=q.device, dtype=torch.int32)
    # as in the model: a non-zero router-bias scale and per-element gates (Linear outputs of
    # the hidden states, so they take gradients too)
    alpha = torch.full((H,), 0.5, device=q.device, requires_grad=True)
    gen = torch.Generator(device=q.device).manual_seed(1)
    gate_c = (0.1 * torch.randn(q.shape, device=q.device, generator=gen)).to(q.dtype)
    gate_f = (1 + 0.1 * torch.randn(q.shape, device=q.device, generator=gen)).to(q.dtype)
    gate_c.requires_grad_(True)
    gate_f.requires_grad_(True)

    def fwd():
        out, _ = vsa2_attention(
            q, k, v, tile_lengths=tile_len, seg_lengths=seg_len, sparsity=s, alpha=alpha,
            gate_coarse=gate_c, gate_fine=gate_f, num_valid_segments=S // kvb, bwd=bwd, **settings,
        )  # fmt: skip
        return out

    try:
        inputs = (q, k, v, alpha, gate_c, gate_f)
        time_fwd_bwd(table, tag, method, f"{s}", fwd, inputs, go, flops, with_fwd)
    except Exception:
        print(f"full VSA2 op failed at {tag} s={s} kv{kvb} {router_mode}:")
        traceback.print_exc()


def profile_kernels(fn, label):
    """Per-kernel device time of one call (after warm-up), largest first."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    from vsa2_rl.kernels import block_sparse, block_sparse_fused

    print(f"-- kernels of {label} --")
    for module, name in (
        (block_sparse, "_bsa_fwd_kernel"),
        (block_sparse, "_bsa_bwd_dq_kernel"),
        (block_sparse, "_bsa_bwd_dkv_kernel"),
        (block_sparse_fused, "_bsa_bwd_fused_kernel"),
    ):
        print(f"{name} best config: {getattr(getattr(module, name), 'best_config', None)}")
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=60)
    )


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shapes", default="480p,720p", help="comma list of " + ",".join(SHAPES))
    p.add_argument("--sparsities", default="0.875,0.95")
    p.add_argument("--kv-blocks", default="16,32,64")
    p.add_argument(
        "--quick", action="store_true", help="480p, kv_block 16 and 64, no FlexAttention"
    )
    p.add_argument(
        "--no-flex", action="store_true", help="skip FlexAttention (its compile is slow)"
    )
    p.add_argument("--no-full", action="store_true", help="skip the full vsa2_attention op")
    p.add_argument("--no-fastvideo", action="store_true", help="skip FastVideo's VSA kernel")
    p.add_argument("--router-modes", default="topk", help="comma list of topk,topp for the full op")
    p.add_argument(
        "--selection",
        choices=("random", "local"),
        default="random",
        help="segments each query tile keeps in the fine-stage and FlexAttention rows",
    )
    p.add_argument(
        "--bwd",
        default="two_pass",
        help="comma list of fine-stage backward paths for our rows: two_pass, fused, fused:R "
        "(R key ranges forced)",
    )
    p.add_argument("--profile", action="store_true", help="print per-kernel times of our fwd+bwd")
    p.add_argument("--out", default=None, help="write the markdown table here")
    p.add_argument("--dry-run", action="store_true", help="parse the arguments and stop (CPU)")
    args = p.parse_args(argv)
    args.bwd = args.bwd.split(",")
    from vsa2_rl.kernels.block_sparse import BWD_PATHS

    bad = [e for e in args.bwd if e.partition(":")[0] not in BWD_PATHS]
    if bad:
        p.error(f"--bwd entries must be one of {BWD_PATHS} (or fused:R), got {bad}")
    if args.dry_run:
        print(f"arguments parsed: {vars(args)}")
        return
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs a CUDA device")
    if args.quick:
        args.shapes, args.kv_blocks, args.no_flex = "480p", "16,64", True
    args.sparsities = [float(x) for x in args.sparsities.split(",")]
    args.kv_blocks = [int(x) for x in args.kv_blocks.split(",")]
    args.router_modes = args.router_modes.split(",")
    args.full = not args.no_full
    args.fastvideo = not args.no_fastvideo
    torch.manual_seed(0)

    table = Table()
    for tag in args.shapes.split(","):
        run_shape(args, table, tag)
        torch.cuda.empty_cache()
    header = (
        f"date {datetime.date.today()}, device {torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}, command: python {' '.join(sys.argv)}\n\n"
    )
    text = header + table.markdown() + "\n"
    print("\n" + text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
