"""GPU benchmark: one denoising step of a Wan-1.3B-shaped DiT with dense attention vs VSA2.

Builds diffusers' ``WanTransformer3DModel`` with Wan2.1-T2V-1.3B's shape (30 layers, width 1536,
12 heads of 128, FFN 8960, text_dim 4096, patch (1, 2, 2), 16 latent channels) from random
weights in bf16 and times, at 480p (latent 21x60x104 -> token grid 21x30x52) and 720p
(21x90x160 -> 21x45x80):

* one denoising forward (no grad), and
* one forward + backward (loss = mean square of the output; gradient checkpointing of the
  blocks on, as a training run at these lengths needs it, so the backward includes a second
  forward of every block),

for dense attention (diffusers' processor, SDPA forced onto cuDNN then flash) and VSA2
(``vsa2_rl.models.wan.enable_vsa2``, Triton backend, topk router) at sparsity 0.875 and 0.95 with
key segments of 64 and 16 tokens, each with and without ``torch.compile`` of the transformer
blocks (``vsa2_rl.models.wan.compile_blocks``, as ``model.compile_blocks=true`` in training).
Times are medians over ``--reps`` runs after warm-up; speed-ups are against dense attention with
the same compile setting. Prints a markdown table and writes it to ``--out``.

    python benchmarks/bench_e2e.py --out benchmarks/e2e.md       # full run (about 10 minutes)
    python benchmarks/bench_e2e.py --quick --out quick.md        # 480p, no compile, fewer reps
"""

from __future__ import annotations

import argparse
import datetime
import gc
import statistics
import time
import traceback

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

WAN_1_3B = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 12,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 8960,
    "num_layers": 30,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
}
# Wan2.1-T2V-14B's transformer: the 1.3B's block design, wider (40 heads of 128) and deeper
WAN_14B = {**WAN_1_3B, "num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40}
LATENTS = {"480p": (21, 60, 104), "720p": (21, 90, 160)}
# (label, sparsity, kv_block); None = dense attention
ATTENTION = [
    ("dense cuDNN", None, None),
    ("VSA2 0.875 kv64", 0.875, 64),
    ("VSA2 0.875 kv16", 0.875, 16),
    ("VSA2 0.95 kv64", 0.95, 64),
    ("VSA2 0.95 kv16", 0.95, 16),
]


def _timed(fn, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _build(sparsity: float | None, kv_block: int | None, compile_blocks: bool):
    from diffusers import WanTransformer3DModel

    from vsa2_rl.attention import SparsityState
    from vsa2_rl.config import VSA2Config
    from vsa2_rl.models.wan import compile_blocks as compile_wan_blocks
    from vsa2_rl.models.wan import enable_vsa2

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = WanTransformer3DModel(**WAN_1_3B).to(torch.bfloat16)
    if sparsity is not None:
        config = VSA2Config(mode="topk", kv_block=kv_block, backend="triton")
        enable_vsa2(model, config, SparsityState(sparsity=sparsity))
    model.enable_gradient_checkpointing()  # only acts in the forward+backward runs
    if compile_blocks:
        compile_wan_blocks(model)
    return model


def _measure(
    model, grid: str, warmup: int, reps: int, forward_only: bool = False
) -> tuple[float, float]:
    frames, height, width = LATENTS[grid]
    latents = torch.randn(1, 16, frames, height, width, device="cuda", dtype=torch.bfloat16)
    timestep = torch.tensor([500.0], device="cuda")
    text = torch.randn(1, 512, 4096, device="cuda", dtype=torch.bfloat16)

    def forward():
        with torch.no_grad():
            model(latents, timestep, text, return_dict=False)

    def forward_backward():
        out = model(latents, timestep, text, return_dict=False)[0]
        out.float().square().mean().backward()
        model.zero_grad(set_to_none=True)

    model.eval()
    fwd = _timed(forward, warmup, reps)
    if forward_only:
        return fwd, float("nan")
    model.train()
    fwd_bwd = _timed(forward_backward, warmup, reps)
    return fwd, fwd_bwd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the markdown table here")
    parser.add_argument("--quick", action="store_true", help="480p only, no compile, 2 reps")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed repetitions first")
    parser.add_argument("--grids", nargs="+", default=["480p", "720p"], choices=sorted(LATENTS))
    parser.add_argument(
        "--compile", choices=("off", "on", "both"), default="both", help="torch.compile blocks"
    )
    parser.add_argument(
        "--only", nargs="+", default=None, help="attention rows to run, by label (dense always)"
    )
    parser.add_argument("--forward-only", action="store_true", help="skip forward+backward")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_e2e.py needs a CUDA GPU")
    grids = ["480p"] if args.quick else args.grids
    compile_settings = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    if args.quick:
        compile_settings = [False]
    reps, warmup = (2, 1) if args.quick else (args.reps, args.warmup)
    attention = [
        row for row in ATTENTION if row[1] is None or args.only is None or row[0] in args.only
    ]

    lines = [
        "Wan-1.3B-shaped WanTransformer3DModel, random weights, bf16, "
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {datetime.date.today()}; "
        f"median of {reps} after {warmup} warm-up; fwd+bwd with gradient checkpointing of the "
        "blocks.",
        "",
        "| grid | tokens | attention | compiled | fwd s | x fwd | fwd+bwd s | x fwd+bwd |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for grid in grids:
        frames, height, width = LATENTS[grid]
        tokens = frames * (height // 2) * (width // 2)
        for compile_blocks in compile_settings:
            dense = None
            for label, sparsity, kv_block in attention:
                try:
                    model = _build(sparsity, kv_block, compile_blocks)
                    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
                        fwd, fwd_bwd = _measure(model, grid, warmup, reps, args.forward_only)
                except Exception:  # one failing configuration must not lose the others
                    traceback.print_exc()
                    row = f"| {grid} | {tokens} | {label} | {compile_blocks} | failed | | | |"
                else:
                    if sparsity is None:
                        dense = (fwd, fwd_bwd)
                    speedup = (
                        (f"{dense[0] / fwd:.2f}", f"{dense[1] / fwd_bwd:.2f}")
                        if dense
                        else ("", "")
                    )
                    row = (
                        f"| {grid} | {tokens} | {label} | {compile_blocks} | {fwd:.3f} | "
                        f"{speedup[0]} | {fwd_bwd:.3f} | {speedup[1]} |"
                    )
                print(row, flush=True)
                lines.append(row)
                model = None
                gc.collect()
                torch.cuda.empty_cache()
                torch._dynamo.reset()
    table = "\n".join(lines)
    print("\n" + table)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(table + "\n")


if __name__ == "__main__":
    main()
