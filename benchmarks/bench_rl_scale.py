"""GPU benchmark: what one RL iteration of the Wan-1.3B (or ``--model 14b``: Wan-14B) shape costs
as videos grow, dense against VSA2 at several sparsities, built from measured parts.

For each video size (``--grids``, e.g. ``720p:81`` = 81 frames at 720 x 1280) and each attention
setting (sparsity 0 is the stock dense model, cuDNN / FlashAttention SDPA; others run VSA2 with
top-p 0.9 at the recipe's kv_block, 16 for 1.3B and 64 for 14B, or at each of ``--kv-blocks``)
it times, on one model with random bf16 weights (``--compile``: its blocks under torch.compile,
as ``model.compile_blocks=true`` in training; ``--fused``: through the fused Triton kernels, as
``model.fused_kernels=true``):

- ``forward``: one no-grad denoising forward of one video (a rollout step; also the KL
  reference's forward);
- ``train``: one forward+backward of one video with gradient checkpointing, for LoRA rank 32 on
  the attention projections (the recipe) and, with ``--full``, for every weight;
- the AdamW step of each.

One iteration of ``configs/wan2_1_1.3b_vsa2_grpo.yaml`` on one GPU is then, per video,
``steps x cfg x forward`` (rollout) plus ``trained x cfg x (train + forward)`` (the policy pass
and the KL reference's pass of each trained step), times ``--videos``, plus one optimizer step;
classifier-free guidance runs the conditional and unconditional passes as a batch of two, timed
as twice one video. Left out, the same for dense and VSA2: VAE decoding, text encoding, rewards,
host work between passes. ``--check`` also times ``bench_rl_step``'s whole iteration (real SDE
sampling, PPO loss, AdamW) at the first grid, dense and VSA2, next to the sum of its parts.

Each part is the median of ``--reps`` after one warm-up; rows are appended to ``--out`` as they
finish, so a cut-off run keeps what it measured. A setting that runs out of GPU memory gets an
``out of memory`` row (what one GPU cannot hold is a result too); the peak memory of each
setting is listed under the table.

    python benchmarks/bench_rl_scale.py --grids 480p:33 720p:81 --sparsities 0 0.5 0.75 0.9
    python benchmarks/bench_rl_scale.py --model 14b --grids 720p:81 --sparsities 0 0.9 --reps 1
    python benchmarks/bench_rl_scale.py --grids 720p:81 --sparsities 0 0.9 0.95 --kv-blocks 16 64 \\
        --compile

A row's setting reads ``dense``, the sparsity (the recipe's kv_block), or the sparsity and its
kv_block (``0.95 kv64``); rows of compiled or fused blocks end in ``compiled`` or ``fused``, and
their ``x dense`` is against the dense row run the same way.
    python benchmarks/bench_rl_scale.py --plot scale.png --tables benchmarks/results/rl_scale/*.md

``--plot`` draws seconds per iteration (LoRA) against tokens per video from written tables, one
line per sparsity measured at two sizes or more (no GPU needed).
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import time

import torch
from bench_e2e import WAN_1_3B, WAN_14B
from torch.nn.attention import SDPBackend, sdpa_kernel

SIZES = {"480p": (480, 832), "720p": (720, 1280)}
# --model: (name in the title, transformer shape, the recipe's kv_block)
MODELS = {"1.3b": ("Wan-1.3B", WAN_1_3B, 16), "14b": ("Wan-14B", WAN_14B, 64)}
HEADER = (
    "| grid | tokens | sparsity | forward s | LoRA train s | full train s | "
    "iteration s (LoRA) | x dense | iteration s (full) | x dense |\n"
    "|---|---|---|---|---|---|---|---|---|---|\n"
)


def latent_shape(grid: str) -> tuple[int, int, int]:
    """(frames, height, width) of the latents of ``'720p:81'``: Wan's VAE is 4x in time, 8x in
    space."""
    resolution, frames = grid.split(":")
    height, width = SIZES[resolution]
    return (int(frames) - 1) // 4 + 1, height // 8, width // 8


def vsa2_config(kv_block: int, mode: str = "topp"):
    """The benchmark's VSA2 router at ``kv_block``: top-p 0.9 (``mode="topk"``: VSA's fixed
    count), Triton kernels."""
    from vsa2_rl.config import VSA2Config

    return VSA2Config(kv_block=kv_block, mode=mode, top_p=0.9, backend="triton")


def build(state, lora: bool, model_name: str, blocks: str = "eager"):
    """The ``model_name``-shaped model (:data:`MODELS`) with VSA2 layers sharing ``state``
    (sparsity 0 = dense) at its recipe's kv_block, gradient checkpointing, either LoRA rank
    32 (+ VSA2's router and gates) or every weight trained, and its blocks run ``blocks``:
    ``eager``, ``compiled`` (torch.compile) or ``fused`` (the fused Triton kernels)."""
    from diffusers import WanTransformer3DModel
    from peft import LoraConfig

    from vsa2_rl.models.wan import compile_blocks, enable_vsa2, fuse_block_kernels

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # made in bf16 on the GPU: no fp32 copy
    try:
        with torch.device("cuda"):
            model = WanTransformer3DModel(**MODELS[model_name][1])
    finally:
        torch.set_default_dtype(default)
    enable_vsa2(model, vsa2_config(MODELS[model_name][2]), state)
    model.enable_gradient_checkpointing()
    if lora:
        model.requires_grad_(False)
        model.add_adapter(
            LoraConfig(r=32, lora_alpha=32, target_modules=["to_q", "to_k", "to_v", "to_out.0"])
        )
        for name, parameter in model.named_parameters():
            if "lora_" in name or ".vsa2." in name:
                parameter.requires_grad_(True)
    if blocks == "compiled":
        return compile_blocks(model)
    return fuse_block_kernels(model) if blocks == "fused" else model


def timed(fn, reps: int) -> tuple[float, float]:
    """(median seconds of ``fn`` over ``reps`` calls, seconds of the warm-up call before them:
    with compiled blocks its compilation included)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), first


def part_times(model, grid: str, reps: int, with_forward: bool = True) -> dict[str, float]:
    """Seconds of one video at ``grid``: ``forward`` (no grad) and ``train`` (forward+backward)
    medians, ``first forward`` and ``first train`` their warm-up calls; the forward is not
    timed (nan) unless ``with_forward``."""
    frames, height, width = latent_shape(grid)
    x = torch.randn(1, 16, frames, height, width, device="cuda", dtype=torch.bfloat16)
    timestep = torch.tensor([500.0], device="cuda")
    text = torch.randn(1, 512, 4096, device="cuda", dtype=torch.bfloat16)

    def forward():
        with torch.no_grad():
            model(x, timestep, text, return_dict=False)

    def train():
        out = model(x, timestep, text, return_dict=False)[0]
        out.float().square().mean().backward()

    model.eval()
    forward_s, first_forward_s = timed(forward, reps) if with_forward else (math.nan, math.nan)
    model.train()
    train_s, first_train_s = timed(train, reps)
    model.zero_grad(set_to_none=True)
    return {
        "forward": forward_s,
        "first forward": first_forward_s,
        "train": train_s,
        "first train": first_train_s,
    }


def optimizer_seconds(model, reps: int) -> float:
    """Seconds of one AdamW step over the model's trained parameters (gradients filled)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    for parameter in trained:
        parameter.grad = torch.randn_like(parameter)
    optimizer = torch.optim.AdamW(trained, lr=1e-6)
    seconds, _ = timed(optimizer.step, reps)
    model.zero_grad(set_to_none=True)
    del optimizer
    return seconds


def iteration_seconds(forward: float, train: float, optimizer: float, args) -> float:
    """The recipe's iteration on one GPU from its parts (module docstring); ``args.kl`` adds the
    reference's forward to each trained step."""
    trained_pass = train + (forward if args.kl else 0.0)
    per_video = args.steps * args.cfg * forward + args.trained * args.cfg * trained_pass
    return args.videos * per_video + optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="1.3b")
    parser.add_argument("--grids", nargs="+", default=["480p:33", "720p:81"])
    parser.add_argument("--sparsities", nargs="+", type=float, default=[0.0, 0.5, 0.75, 0.9])
    parser.add_argument(
        "--kv-blocks", nargs="+", type=int, default=None,
        help="kv_block of the VSA2 rows, each at every sparsity (default: the model's recipe's)",
    )  # fmt: skip
    parser.add_argument(
        "--router-modes", nargs="+", choices=("topp", "topk"), default=["topp"],
        help="router of each --kv-blocks entry, in the same order (one: for all of them)",
    )  # fmt: skip
    blocks = parser.add_mutually_exclusive_group()
    blocks.add_argument("--compile", action="store_true", help="torch.compile the blocks")
    blocks.add_argument("--fused", action="store_true", help="the blocks' fused Triton kernels")
    parser.add_argument("--full", action="store_true", help="also time full fine-tuning")
    parser.add_argument("--steps", type=int, default=16, help="sampler steps (recipe: 16)")
    parser.add_argument("--trained", type=int, default=4, help="trained steps a video (recipe)")
    parser.add_argument("--cfg", type=int, default=2, help="2 with guidance (recipe), else 1")
    parser.add_argument("--videos", type=int, default=32, help="videos an iteration (recipe)")
    parser.add_argument("--no-kl", dest="kl", action="store_false", help="no reference pass")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--check", action="store_true", help="whole iteration at the 1st grid")
    parser.add_argument("--out", default="rl_scale.md")
    parser.add_argument("--plot", default=None, help="draw --tables into this PNG and stop")
    parser.add_argument("--tables", nargs="*", default=[], help="tables written by --out")
    args = parser.parse_args()
    if args.plot:
        plot(read_rows(args.tables), args.plot)
        return

    from vsa2_rl.attention import SparsityState

    name, _, recipe_kv_block = MODELS[args.model]
    args.kv_blocks = args.kv_blocks or [recipe_kv_block]
    if len(args.router_modes) not in (1, len(args.kv_blocks)):
        parser.error("--router-modes: give one mode, or one per --kv-blocks entry")
    if args.compile:  # every sparsity, grad mode and model recompiles the shared block code;
        # past the limit torch.compile would fall back to eager without a word: fail instead
        torch._dynamo.config.recompile_limit = 64
        torch._dynamo.config.fail_on_recompile_limit_hit = True
    state = SparsityState(sparsity=0.0)
    modes = [("lora", True)] + ([("full", False)] if args.full else [])
    models = {mode: build(state, lora, args.model, blocks_of(args)) for mode, lora in modes}
    optimizer = {mode: optimizer_seconds(model, args.reps) for mode, model in models.items()}
    routers = ", ".join(
        dict.fromkeys(
            f"kv{kv_block} {'top-p 0.9' if mode == 'topp' else 'top-k'}"
            for _, kv_block, mode in settings(args)
            if kv_block
        )
    )
    title = (
        f"RL iteration of the {name} shape from its parts: {args.videos} videos x "
        f"{args.steps} steps, {args.trained} trained, cfg x{args.cfg}, KL reference pass; "
        f"VSA2 {routers}; blocks {BLOCKS[blocks_of(args)]}; "
        f"AdamW step LoRA {optimizer['lora']:.3f} s"
        + (f", full {optimizer['full']:.3f} s" if args.full else "")
        + f"; median of {args.reps}; {torch.cuda.get_device_name()}, {datetime.date.today()}\n\n"
    )
    with open(args.out, "w", encoding="utf-8") as handle:
        handle.write(title + HEADER)
    print(title + HEADER, end="", flush=True)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
        peaks, first_calls = measure_grids(models, optimizer, state, args)
        if args.check:
            check_iteration(models["lora"], state, args)
    with open(args.out, "a", encoding="utf-8") as handle:
        handle.write(f"\nPeak GPU memory, GiB (the models of every training mode held): {peaks}\n")
        handle.write(f"\nFirst call of each part, s (compiled: with compiling): {first_calls}\n")


def settings(args) -> list[tuple[float, int | None, str]]:
    """(sparsity, kv_block, router mode) of each row of a grid in order: dense (kv_block None)
    first if asked, then each ``--kv-blocks`` entry with its router at every nonzero sparsity."""
    dense = [(0.0, None, "topp")] if 0.0 in args.sparsities else []
    sparse = [s for s in args.sparsities if s > 0.0]
    modes = args.router_modes * (len(args.kv_blocks) // len(args.router_modes))
    return dense + [
        (s, kv_block, mode)
        for kv_block, mode in zip(args.kv_blocks, modes, strict=True)
        for s in sparse
    ]


def setting_label(sparsity: float, kv_block: int | None, mode: str, args) -> str:
    """A row's setting: ``dense``, ``0.9`` (the recipe's kv_block) or ``0.95 kv64``, with
    `` top-k`` after it for VSA's router and `` compiled`` for compiled blocks (module
    docstring)."""
    label = "dense" if sparsity == 0 else f"{sparsity}"
    if kv_block is not None and kv_block != MODELS[args.model][2]:
        label += f" kv{kv_block}"
    if sparsity and mode == "topk":
        label += " top-k"
    return label + {"eager": "", "compiled": " compiled", "fused": " fused"}[blocks_of(args)]


BLOCKS = {"eager": "uncompiled", "compiled": "compiled", "fused": "fused kernels, uncompiled"}


def blocks_of(args) -> str:
    """How the blocks run: ``compiled`` (--compile), ``fused`` (--fused) or ``eager``."""
    return "compiled" if args.compile else "fused" if args.fused else "eager"


def measure_grids(models, optimizer, state, args) -> str:
    """Every grid and setting's row written to ``args.out`` (an ``out of memory`` row where
    the GPU cannot hold it); returns each measured setting's peak GPU memory and the seconds
    of its parts' first calls (with compiled blocks: what compiling them cost, plus one call)."""
    from vsa2_rl.models.wan import enable_vsa2

    peaks, first_calls, router_now = [], [], (MODELS[args.model][2], "topp")  # build()'s
    for grid in args.grids:
        dense: dict[str, float] = {}
        for sparsity, kv_block, mode in settings(args):
            label = setting_label(sparsity, kv_block, mode, args)
            state.sparsity = sparsity
            if kv_block is not None and (kv_block, mode) != router_now:  # keeps the VSA2 weights
                for model in models.values():
                    enable_vsa2(model, vsa2_config(kv_block, mode), state)
                router_now = (kv_block, mode)
            torch.cuda.reset_peak_memory_stats()
            try:
                row = measure_row(models, optimizer, grid, args)
            except torch.OutOfMemoryError:
                row = None  # the failed pass's tensors are freed once this block ends
            if row is None:
                torch.cuda.empty_cache()
                write_out_of_memory(grid, label, args.out)
                continue
            peaks.append(f"{grid} {label} {torch.cuda.max_memory_allocated() / 2**30:.1f}")
            first_calls.append(
                f"{grid} {label}: forward {row['first forward']:.1f}, "
                + ", ".join(f"{mode} train {row[f'{mode} first train']:.1f}" for mode in models)
            )
            if sparsity == 0:
                dense = row
            write_row(grid, label, row, dense, args.out)
        torch.cuda.empty_cache()
    return ", ".join(peaks), "; ".join(first_calls)


def measure_row(models, optimizer, grid: str, args) -> dict[str, float]:
    """Forward, train and iteration seconds at the current sparsity, per training mode."""
    row: dict[str, float] = {}
    for mode, model in models.items():  # LoRA first: its forward is the recipe's
        parts = part_times(model, grid, args.reps, with_forward="forward" not in row)
        row.setdefault("forward", parts["forward"])
        row.setdefault("first forward", parts["first forward"])
        row[f"{mode}_train"], row[f"{mode} first train"] = parts["train"], parts["first train"]
        row[mode] = iteration_seconds(row["forward"], parts["train"], optimizer[mode], args)
    return row


def _tokens(grid: str) -> int:
    frames, height, width = latent_shape(grid)
    return frames * height * width // 4


def write_out_of_memory(grid: str, label: str, out: str) -> None:
    """The row of a setting one GPU cannot hold."""
    line = f"| {grid} | {_tokens(grid)} | {label} |" + " out of memory |" * 7 + "\n"
    print(line, end="", flush=True)
    with open(out, "a", encoding="utf-8") as handle:
        handle.write(line)


def write_row(grid: str, label: str, row: dict, dense: dict, out: str) -> None:
    cells = [grid, str(_tokens(grid)), label]
    cells.append(f"{row['forward']:.3f}")
    cells += [f"{row[key]:.3f}" if key in row else "-" for key in ("lora_train", "full_train")]
    for mode in ("lora", "full"):
        cells += (
            [f"{row[mode]:.0f}", f"{dense[mode] / row[mode]:.2f}" if mode in dense else "-"]
            if mode in row
            else ["-", "-"]
        )
    line = "| " + " | ".join(cells) + " |\n"
    print(line, end="", flush=True)
    with open(out, "a", encoding="utf-8") as handle:
        handle.write(line)


def check_iteration(model, state, args) -> None:
    """bench_rl_step's whole iteration (1 video, 8 SDE steps, 4 trained, no guidance, no KL) at
    the first grid, against the same sum of parts, dense and at the last sparsity."""
    import bench_rl_step

    from vsa2_rl.models.wan import wan_velocity

    grid = args.grids[0]
    frames, height, width = latent_shape(grid)
    bench_rl_step.LATENTS[grid] = (frames, height, width)
    run = argparse.Namespace(resolution=grid, samples=1, steps=8, train_steps=4)
    sum_args = argparse.Namespace(steps=8, trained=4, cfg=1, videos=1, kl=False)
    optimizer = optimizer_seconds(model, args.reps)
    lines = []

    def velocity(x, sigma, text):
        return wan_velocity(model, x, sigma, text)

    for sparsity in (0.0, args.sparsities[-1]):
        state.sparsity = sparsity
        bench_rl_step.iteration(model, velocity, run)  # warm-up
        whole = statistics.median(
            sum(bench_rl_step.iteration(model, velocity, run)) for _ in range(args.reps)
        )
        times = part_times(model, grid, args.reps)
        parts = iteration_seconds(times["forward"], times["train"], optimizer, sum_args)
        lines.append(
            f"check {grid} sparsity {sparsity} kv{args.kv_blocks[-1]}: whole iteration "
            f"{whole:.2f} s, sum of parts {parts:.2f} s\n"
        )
    with open(args.out, "a", encoding="utf-8") as handle:
        handle.write("\n" + "".join(lines))
    print("".join(lines), end="")


def read_rows(paths: list[str]) -> dict[str, dict[int, tuple[str, float]]]:
    """{sparsity label: {tokens: (grid, LoRA iteration s)}} from tables written by ``--out``
    (a later table's row replaces an earlier one's)."""
    series: dict[str, dict[int, tuple[str, float]]] = {}
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
                if len(cells) == 10 and cells[1].isdigit() and cells[6] != "out of memory":
                    series.setdefault(cells[2], {})[int(cells[1])] = (cells[0], float(cells[6]))
    return series


def plot(series: dict[str, dict[int, tuple[str, float]]], out: str) -> None:
    """Seconds per iteration against tokens per video, one line per sparsity, points named by
    grid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for label, points in sorted(series.items(), key=lambda item: item[0] != "dense"):
        if len(points) < 2:
            continue
        tokens = sorted(points)
        seconds = [points[t][1] / 60 for t in tokens]
        name = label.replace("dense", "dense (cuDNN)") if "dense" in label else f"VSA2 {label}"
        axes.plot([t / 1000 for t in tokens], seconds, marker="o", label=name)
        if label == "dense":
            for index, (t, minutes) in enumerate(zip(tokens, seconds, strict=True)):
                offset = (4, -10) if index % 2 == 0 else (-40, 6)  # neighbours on both sides
                axes.annotate(points[t][0], (t / 1000, minutes), fontsize=7, xytext=offset,
                              textcoords="offset points")  # fmt: skip
    axes.set_xlabel("tokens per video (thousands)")
    axes.set_ylabel("minutes per RL iteration (32 videos, 1 GPU)")
    axes.set_title("Wan-1.3B shape, LoRA, the 1.3B recipe's iteration, H100")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
