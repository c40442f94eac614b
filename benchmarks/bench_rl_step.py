"""GPU benchmark: one Flow-GRPO iteration of a Wan-1.3B-shaped DiT at 480p, dense vs VSA2.

The iteration is the trainer's (vsa2_rl.rl.trainer): an SDE rollout of ``--samples`` videos with
``--steps`` denoising steps (vsa2_rl.sampling, per-step log-probs), then a policy update that
recomputes the log-prob of ``--train-steps`` transitions per sample with gradients (PPO-clip
loss, vsa2_rl.rl.grpo), full fine-tuning with AdamW and gradient checkpointing of the blocks.
Random weights (bf16), random text embeddings and a random reward: the timing does not depend on
them. VAE decoding and reward models are outside the measured loop (they do not change with the
attention). Reports rollout and train seconds, the iteration speed-up of VSA2 over dense cuDNN
attention in the same run, and peak GPU memory.

    python benchmarks/bench_rl_step.py --out rl_step.md
"""

from __future__ import annotations

import argparse
import datetime
import gc
import time

import torch
from bench_e2e import LATENTS, WAN_1_3B
from torch.nn.attention import SDPBackend, sdpa_kernel

from vsa2_rl.rl.grpo import group_advantages, grpo_loss
from vsa2_rl.sampling import sample, sigma_schedule, step_log_prob


def _model(sparsity: float | None, compile_blocks: bool = False):
    from diffusers import WanTransformer3DModel

    from vsa2_rl.attention import SparsityState
    from vsa2_rl.config import VSA2Config
    from vsa2_rl.models.wan import compile_blocks, enable_vsa2, wan_velocity

    torch.manual_seed(0)
    model = WanTransformer3DModel(**WAN_1_3B).to("cuda", torch.bfloat16)
    model.enable_gradient_checkpointing()
    if sparsity is not None:
        state = SparsityState(sparsity=sparsity)
        enable_vsa2(model, VSA2Config(kv_block=64, mode="topk", backend="triton"), state)
    if compile_blocks:  # as model.compile_blocks=true in the trainer; the warm-up compiles
        compile_blocks(model)
    return model, lambda x, s, e: wan_velocity(model, x, s, e)


def iteration(model, velocity, args) -> tuple[float, float]:
    """One rollout + update; returns (rollout seconds, train seconds)."""
    frames, height, width = LATENTS[args.resolution]
    n = args.samples
    generator = torch.Generator("cuda").manual_seed(0)
    noise = torch.randn(n, 16, frames, height, width, device="cuda", generator=generator)
    text = torch.randn(n, 512, 4096, device="cuda", dtype=torch.bfloat16, generator=generator)
    sigmas = sigma_schedule(args.steps, shift=3.0)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)

    torch.cuda.synchronize()
    start = time.perf_counter()
    model.eval()
    latents, log_probs = [], []
    for i in range(n):  # one video per forward, as at Wan scale
        trajectory = sample(
            lambda x, s, i=i: velocity(x, s, text[i : i + 1]),
            noise[i : i + 1],
            sigmas,
            kind="sde",
            noise_level=0.7,
            generator=generator,
        )
        latents.append(trajectory.latents)
        log_probs.append(trajectory.log_probs)
    torch.cuda.synchronize()
    rollout = time.perf_counter() - start

    rewards = torch.randn(n, device="cuda")
    advantages, _ = group_advantages(rewards, torch.zeros(n, dtype=torch.long, device="cuda"))
    start = time.perf_counter()
    model.train()
    optimizer.zero_grad(set_to_none=True)
    trained = torch.linspace(0, args.steps - 1, args.train_steps).round().long().tolist()
    for i in range(n):
        for j in trained:
            x, x_next = latents[i][j], latents[i][j + 1]
            sigma = torch.full((1,), float(sigmas[j]), device="cuda")
            v = velocity(x, sigma, text[i : i + 1])
            log_prob, _, _ = step_log_prob(
                v, x, x_next, float(sigmas[j]), float(sigmas[j + 1]), "sde", 0.7
            )
            loss, _ = grpo_loss(log_prob, log_probs[i][j], advantages[i : i + 1])
            (loss / (n * len(trained))).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    torch.cuda.synchronize()
    return rollout, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--resolution", default="480p", choices=sorted(LATENTS))
    parser.add_argument("--samples", type=int, default=2, help="videos per iteration")
    parser.add_argument("--steps", type=int, default=10, help="denoising steps per rollout")
    parser.add_argument("--train-steps", type=int, default=5, help="trained steps per video")
    parser.add_argument("--sparsity", type=float, default=0.9)
    parser.add_argument("--compile", action="store_true", help="torch.compile the blocks")
    parser.add_argument("--out", default=None, help="also write the table to this file")
    args = parser.parse_args()

    rows = []
    for label, sparsity in (("dense cuDNN", None), (f"VSA2 {args.sparsity} kv64", args.sparsity)):
        model, velocity = _model(sparsity, args.compile)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
            iteration(model, velocity, argparse.Namespace(**{**vars(args), "samples": 1}))
            torch.cuda.reset_peak_memory_stats()
            rollout, train = iteration(model, velocity, args)
        peak = torch.cuda.max_memory_allocated() / 2**30
        rows.append((label, rollout, train, peak))
        print(f"{label}: rollout {rollout:.2f} s, train {train:.2f} s, peak {peak:.1f} GiB")
        del model, velocity
        gc.collect()
        torch.cuda.empty_cache()

    dense_total = rows[0][1] + rows[0][2]
    lines = [
        f"RL iteration, Wan-1.3B shape, {args.resolution}, {args.samples} videos x "
        f"{args.steps} SDE steps, {args.train_steps} trained steps per video, full fine-tuning "
        f"(AdamW, gradient checkpointing{', compiled blocks' if args.compile else ''}), bf16, "
        f"{torch.cuda.get_device_name()}, "
        f"{datetime.date.today()}",
        "",
        "| attention | rollout s | train s | iteration s | x dense | peak GiB |",
        "|---|---|---|---|---|---|",
    ]
    for label, rollout, train, peak in rows:
        total = rollout + train
        lines.append(
            f"| {label} | {rollout:.2f} | {train:.2f} | {total:.2f} | "
            f"{dense_total / total:.2f} | {peak:.1f} |"
        )
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(table)


if __name__ == "__main__":
    main()
