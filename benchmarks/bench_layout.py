"""GPU benchmark: the tile layout's token permutation (``TileLayout.tile`` then ``untile``, forward
and backward) against the same permutation written as ``index_select``, whose gradient autograd
computes as a scatter-add (``index_add_``).

VSA2 attention reorders q, k, v (and the gates) from raster order into 4x4x4 cubes and its output
back, in every layer, forward and backward. Each shape runs one bf16 tensor [B, tokens, heads,
head_dim] through tile, a multiply, untile and a sum's backward; the table gives the median of
``--repeats`` CUDA-event timings of each side, and checks first that both give the same output
and the same gradient.

    python benchmarks/bench_layout.py --out layout.md
"""

from __future__ import annotations

import argparse
import datetime
import statistics

import torch

from vsa2_rl.attention.layout import TileLayout

SHAPES = {  # name: (batch, latent grid (T, H, W), heads, head_dim)
    "toy testbed 64 px": (16, (16, 16, 16), 6, 64),
    "Wan-1.3B 480p": (1, (21, 30, 52), 12, 128),
    "Wan-1.3B 720p": (1, (21, 45, 80), 12, 128),
    "Wan-14B 720p": (1, (21, 45, 80), 40, 128),
}


def index_select_tile(layout: TileLayout, x: torch.Tensor) -> torch.Tensor:
    out = x.index_select(1, layout.perm.to(x.device))
    padding = x.new_zeros((x.shape[0], layout.num_padding, *x.shape[2:]))
    return torch.cat([out, padding], dim=1)


def index_select_untile(layout: TileLayout, y: torch.Tensor) -> torch.Tensor:
    return y.index_select(1, layout.inv_perm.to(y.device))


def layout_tile(layout: TileLayout, x: torch.Tensor) -> torch.Tensor:
    return layout.tile(x)


def layout_untile(layout: TileLayout, y: torch.Tensor) -> torch.Tensor:
    return layout.untile(y)


def round_trip(tile, untile, layout: TileLayout, x: torch.Tensor, weight: torch.Tensor):
    """Output and gradient of sum(untile(tile(x) * weight) * weight[:num_tokens])."""
    x.grad = None
    out = untile(layout, tile(layout, x) * weight)
    (out * weight[:, : layout.num_tokens]).sum().backward()
    return out, x.grad


def median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(name: str, repeats: int) -> str:
    batch, grid, heads, head_dim = SHAPES[name]
    layout = TileLayout.from_grid(grid).prepare(torch.device("cuda"))
    x = torch.randn(batch, layout.num_tokens, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    x.requires_grad_(True)
    weight = torch.randn(batch, layout.padded_len, heads, head_dim, device="cuda").to(x.dtype)
    reference = [
        t.clone() for t in round_trip(index_select_tile, index_select_untile, layout, x, weight)
    ]
    result = round_trip(layout_tile, layout_untile, layout, x, weight)
    for got, want in zip(result, reference, strict=True):
        if not torch.equal(got, want):
            raise AssertionError(f"{name}: the layout's permutation differs from index_select's")
    ms_index_select = median_ms(
        lambda: round_trip(index_select_tile, index_select_untile, layout, x, weight), repeats
    )
    ms_layout = median_ms(
        lambda: round_trip(layout_tile, layout_untile, layout, x, weight), repeats
    )
    mib = x.numel() * x.element_size() / 2**20
    return (
        f"| {name} | {grid} | {mib:.0f} | {ms_index_select:.3f} | {ms_layout:.3f} "
        f"| {ms_index_select / ms_layout:.2f}x |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=30, help="timed runs a side (median)")
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_layout.py needs a CUDA GPU")
    lines = [
        f"{datetime.date.today()}, {torch.cuda.get_device_name()}, torch {torch.__version__}; "
        f"tile, multiply, untile, backward; bf16; median of {args.repeats}",
        "",
        "| shape | grid | MiB a tensor | index_select (ms) | layout (ms) | speed-up |",
        "|---|---|---|---|---|---|",
    ]
    for name in args.shapes:
        lines.append(measure(name, args.repeats))
        print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
