"""GPU benchmark: per-GPU memory of Wan-14B-shaped blocks at 720p x 81 frames (75,600 tokens) under
Ulysses sequence parallelism of size P = 1, 2, 4, 8, measured on one GPU and extrapolated to the
model's 40 layers.

One GPU plays rank 0 of a group of P (``OneRankOfGroup``): its exchanges keep the shapes a rank
holds (its own slice stands in for the other ranks' data), so the activations, the attention's
whole-sequence buffers for ``40 / P`` heads and the compute are a rank's; the communication and
its transient buffers are left out.

Each setting builds ``--layers`` blocks (random bf16 weights, VSA2 at the 14B recipe's settings:
sparsity 0.9, kv_block 64, top-p 0.9, gradient checkpointing) and measures the peak activation
memory of a rollout forward (no grad) and of a training forward + backward of one video (weights
frozen, the gradient flowing to the input: no weight gradients). Two block counts give the cost
per layer (the slope) and the rest (the intercept); 40 layers = intercept + 40 x slope.

The weight, gradient and optimizer memory is arithmetic on the parameter count (the trainer's
AdamW keeps its two moments in the parameters' bf16): full fine-tuning holds weights 2 B,
gradients 2 B and moments 4 B per parameter, FSDP2 divides all of it by the number of GPUs; LoRA
(rank 32 on the attention and FFN projections) trains about 1% of them, so only the frozen bf16
weights stay (whole, or divided by the GPUs under FSDP2). The KL reference of full fine-tuning
is a second frozen bf16 copy; with LoRA it is the same weights with the adapters off.

    python benchmarks/sp_memory.py --layers 2 4 --sizes 1 2 4 8 --out sp_memory.md
"""

from __future__ import annotations

import argparse
import datetime

import torch
from bench_e2e import WAN_14B

from vsa2_rl.parallel.ulysses import SequenceParallel

LATENT_720P_81 = (21, 90, 160)  # (frames, height, width) of the VAE latents: 75,600 tokens
GIB = 2**30


class OneRankOfGroup(SequenceParallel):
    """Rank 0 of a sequence-parallel group of ``size`` on one GPU, with no other rank: each
    exchange returns a tensor of the shape rank 0 would receive, filled from its own slice."""

    def __init__(self, size: int) -> None:  # no process group: nothing is exchanged
        self.group, self.size, self.rank = None, size, 0

    def tokens_to_heads(self, x: torch.Tensor, num_tokens: int) -> torch.Tensor:
        mine = x[:, :, self.head_slice(x.shape[2])]
        return mine.repeat(1, self.size, 1, 1)[:, :num_tokens].contiguous()

    def heads_to_tokens(self, x: torch.Tensor) -> torch.Tensor:
        mine = self.token_slice(x.shape[1])
        return x[:, mine].repeat(1, 1, self.size, 1).contiguous()

    def gather_tokens(self, x: torch.Tensor, num_tokens: int) -> torch.Tensor:
        return x.repeat(1, self.size, *([1] * (x.dim() - 2)))[:, :num_tokens].contiguous()


def _model(layers: int, size: int):
    from diffusers import WanTransformer3DModel

    from vsa2_rl.attention import SparsityState
    from vsa2_rl.config import VSA2Config
    from vsa2_rl.models.wan import enable_sequence_parallel, enable_vsa2

    torch.manual_seed(0)
    model = WanTransformer3DModel(**{**WAN_14B, "num_layers": layers})
    model = model.to("cuda", torch.bfloat16)
    model.enable_gradient_checkpointing()
    vsa2 = VSA2Config(kv_block=64, mode="topp", top_p=0.9, backend="triton")
    enable_vsa2(model, vsa2, SparsityState(sparsity=0.9))
    if size > 1:
        enable_sequence_parallel(model, OneRankOfGroup(size))
    return model


def _peaks(model) -> tuple[float, float]:
    """Peak GiB of activations: a no-grad forward, and a forward + backward. The weights are
    frozen and the gradient flows to the input, so no weight gradient is counted here (the
    states arithmetic adds them)."""
    frames, height, width = LATENT_720P_81
    latents = torch.randn(1, 16, frames, height, width, device="cuda", dtype=torch.bfloat16)
    latents.requires_grad_(True)
    timestep = torch.tensor([500.0], device="cuda")
    text = torch.randn(1, 512, 4096, device="cuda", dtype=torch.bfloat16)
    model.requires_grad_(False)
    results = []
    for grad in (False, True):
        latents.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.set_grad_enabled(grad):
            out = model(latents, timestep, text, return_dict=False)[0]
            if grad:
                out.float().square().mean().backward()
        del out
        torch.cuda.synchronize()
        results.append((torch.cuda.max_memory_allocated() - base) / GIB)
    return results[0], results[1]


def _states_gib(params: float, gpus: int, lora: bool, fsdp2: bool) -> float:
    """Weights, gradients, AdamW moments and the KL reference, bf16, per GPU."""
    shard = gpus if fsdp2 else 1
    if lora:  # frozen weights; the ~1% trained adapter's state is left out (< 1 GiB)
        return 2 * params / shard / GIB
    return (2 + 2 + 4 + 2) * params / shard / GIB


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, nargs=2, default=[2, 4])
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--gpus", type=int, default=8, help="GPUs of the host in the verdict")
    p.add_argument("--gpu-gib", type=float, default=139.0, help="usable memory of one GPU")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    low, high = args.layers
    rows = []
    for size in args.sizes:
        peaks = {}
        for layers in (low, high):
            model = _model(layers, size)
            peaks[layers] = _peaks(model)
            del model
            torch.cuda.empty_cache()
        per_layer = [(peaks[high][i] - peaks[low][i]) / (high - low) for i in range(2)]
        at_40 = [peaks[low][i] + (40 - low) * per_layer[i] for i in range(2)]
        rows.append((size, peaks[low], peaks[high], per_layer, at_40))
        print(f"P={size}: rollout {at_40[0]:.1f} GiB, training {at_40[1]:.1f} GiB above weights")
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        params = sum(x.numel() for x in WanTransformer3DModel(**WAN_14B).parameters())
    lines = [
        f"# Wan-14B-shaped blocks at 720p x 81 frames, {datetime.date.today()}, "
        f"{torch.cuda.get_device_name()}",
        f"`python benchmarks/sp_memory.py --layers {low} {high} --sizes "
        f"{' '.join(map(str, args.sizes))}`; {params / 1e9:.2f}B parameters",
        "",
        f"| P | rollout GiB ({low} / {high} layers) | train GiB ({low} / {high} layers) | "
        "per layer rollout / train | 40 layers rollout / train |",
        "|---|---|---|---|---|",
    ]
    for size, lo, hi, per_layer, at_40 in rows:
        lines.append(
            f"| {size} | {lo[0]:.2f} / {hi[0]:.2f} | {lo[1]:.2f} / {hi[1]:.2f} | "
            f"{per_layer[0]:.3f} / {per_layer[1]:.3f} | {at_40[0]:.1f} / {at_40[1]:.1f} |"
        )
    lines += [
        "",
        f"Per GPU on {args.gpus} GPUs: training activations (40 layers) + weights, gradients, "
        f"AdamW moments, KL reference (bf16); fits = below {args.gpu_gib:.0f} GiB.",
        "",
        "| P | setup | states GiB | total GiB | fits |",
        "|---|---|---|---|---|",
    ]
    for size, *_, at_40 in rows:
        for lora in (True, False):
            for fsdp2 in (False, True):
                states = _states_gib(params, args.gpus, lora, fsdp2)
                total = states + at_40[1]
                setup = ("LoRA" if lora else "full") + (" + FSDP2" if fsdp2 else "")
                fits = "yes" if total < args.gpu_gib else "no"
                lines.append(f"| {size} | {setup} | {states:.1f} | {total:.1f} | {fits} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
