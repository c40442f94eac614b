"""Benchmark for several GPUs: a Wan-shaped DiT forward under Ulysses sequence
parallelism over all the processes of ``torchrun``, against the same forward on one process.

Each process builds the same transformer (random bf16 weights, VSA2 at the recipe's settings,
gradient checkpointing), and with more than one process the group of all of them shares every
video (``vsa2_rl.models.wan.enable_sequence_parallel``). Timed, median of ``--reps`` after a
warm-up: one denoising forward of a rollout (no grad) and one training forward + backward, both
of one video; then the torch profiler's record of one rollout forward gives the share of device
time in NCCL kernels (the all-to-alls and the final gather). Rank 0 prints one markdown row and
appends it to ``--out``; run once per process count and compare the rows (the issue's target:
a 720p rollout forward >= 1.7x faster on 2 GPUs than on 1).

    torchrun --nproc_per_node 1 benchmarks/bench_sp.py --model 14b --layers 8 --out sp.md
    torchrun --nproc_per_node 2 benchmarks/bench_sp.py --model 14b --layers 8 --out sp.md

``--smoke`` runs a two-layer, narrow model at a tiny grid in float32 on CPU processes (gloo), to
check the script where there is no GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from bench_e2e import LATENTS, WAN_1_3B, WAN_14B

SMOKE = {**WAN_1_3B, "num_attention_heads": 4, "attention_head_dim": 16, "ffn_dim": 64,
         "text_dim": 32, "freq_dim": 16, "num_layers": 2}  # fmt: skip
RECIPES = {"14b": (WAN_14B, 64), "1.3b": (WAN_1_3B, 16)}  # (shape, the recipe's kv_block)


def _model(shape: dict, layers: int, kv_block: int, device, dtype):
    from diffusers import WanTransformer3DModel

    from vsa2_rl.attention import SparsityState
    from vsa2_rl.config import VSA2Config
    from vsa2_rl.models.wan import enable_sequence_parallel, enable_vsa2
    from vsa2_rl.parallel import SequenceParallel

    torch.manual_seed(0)  # the same weights on every rank
    model = WanTransformer3DModel(**{**shape, "num_layers": layers}).to(device, dtype)
    model.enable_gradient_checkpointing()
    backend = "triton" if device.type == "cuda" else "torch"
    vsa2 = VSA2Config(kv_block=kv_block, mode="topp", top_p=0.9, backend=backend)
    enable_vsa2(model, vsa2, SparsityState(sparsity=0.9))
    if dist.get_world_size() > 1:
        enable_sequence_parallel(model, SequenceParallel())
    return model


def _median_seconds(fn, reps: int, device) -> float:
    fn()  # warm-up: Triton autotuning, allocator
    times = []
    for _ in range(reps):
        _synchronize(device)
        start = time.perf_counter()
        fn()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def _nccl_share(fn) -> float:
    """Share of one call's device time spent in NCCL kernels (CUDA only)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    total = nccl = 0.0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total += event.device_time_total
            nccl += event.device_time_total if "nccl" in event.name.lower() else 0.0
    return nccl / total if total else float("nan")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", choices=sorted(RECIPES), default="14b")
    p.add_argument("--layers", type=int, default=8, help="transformer blocks built")
    p.add_argument("--grid", choices=sorted(LATENTS), default="720p")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="tiny float32 model on CPU (gloo)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else None
    device = device or torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    shape, kv_block = RECIPES[args.model]
    frames, height, width = LATENTS[args.grid]
    if args.smoke:
        shape, (frames, height, width) = SMOKE, (4, 16, 16)
    model = _model(shape, args.layers, kv_block, device, dtype)
    latents = torch.randn(1, 16, frames, height, width, device=device, dtype=dtype)
    timestep = torch.tensor([500.0], device=device)
    text = torch.randn(1, 512, shape["text_dim"], device=device, dtype=dtype)

    def rollout():
        with torch.no_grad():
            model(latents, timestep, text, return_dict=False)

    def training():
        model(latents, timestep, text, return_dict=False)[0].float().square().mean().backward()

    rollout_s = _median_seconds(rollout, args.reps, device)
    train_s = _median_seconds(training, args.reps, device)
    nccl = _nccl_share(rollout) if cuda and world > 1 else 0.0
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")
    if rank == 0:
        tokens = frames * (height // 2) * (width // 2)
        label = "smoke" if args.smoke else args.model
        grid = "smoke" if args.smoke else args.grid
        row = (f"| {label} x {args.layers} layers | {grid} ({tokens} tokens) | {world} | "
               f"{rollout_s:.3f} | {train_s:.3f} | {100 * nccl:.1f}% | {peak:.1f} |")  # fmt: skip
        header = (
            "| model | grid | GPUs (sequence-parallel) | rollout forward s | train fwd+bwd s "
            "| NCCL share of the rollout forward | peak GiB per GPU |\n" + "|---" * 7 + "|"
        )
        print(header + "\n" + row)
        if args.out:
            new = not os.path.exists(args.out)
            with open(args.out, "a", encoding="utf-8") as handle:
                handle.write((header + "\n" if new else "") + row + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
