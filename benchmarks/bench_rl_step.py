"""GPU benchmark: one Flow-GRPO iteration of a Wan-1.3B-shaped DiT at 480p x 81, dense vs VSA2, at
the attention settings of ``configs/wan2_1_1.3b_vsa2_grpo.yaml`` (kv_block 16, top-p 0.9) unless
told otherwise.

The iteration follows the trainer's (vsa2_rl.rl.trainer) with the library's own pieces: an SDE
rollout of ``--samples`` videos with ``--steps`` denoising steps (vsa2_rl.sampling, per-step
log-probs), then a policy update that recomputes the log-prob of ``--train-steps`` transitions
per sample with gradients (PPO-clip loss, vsa2_rl.rl.grpo), AdamW, gradient checkpointing of the
blocks. What it leaves out of the trainer's step, and of the 1.3B recipe: LoRA (it fine-tunes
every weight), classifier-free guidance (the recipe's guidance 5 doubles every forward, dense
and sparse alike), the KL reference forward, VAE decoding, rewards, EMA and logging. Random
weights (bf16), random text embeddings and a random reward: the timing does not depend on them.
Each setting runs a warm-up iteration of one video (which compiles, with ``--compile``), then
``--reps`` timed ones; the table gives the median iteration, its speed-up over dense cuDNN
attention in the same run, and peak GPU memory.

    python benchmarks/bench_rl_step.py --compile --out rl_step.md
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


def _model(sparsity: float | None, args):
    from diffusers import WanTransformer3DModel

    from vsa2_rl.attention import SparsityState
    from vsa2_rl.config import VSA2Config
    from vsa2_rl.models.wan import compile_blocks, enable_vsa2, wan_velocity

    torch.manual_seed(0)
    model = WanTransformer3DModel(**WAN_1_3B).to("cuda", torch.bfloat16)
    model.enable_gradient_checkpointing()
    if sparsity is not None:
        state = SparsityState(sparsity=sparsity)
        vsa2 = VSA2Config(
            kv_block=args.kv_block, mode=args.mode, top_p=args.top_p, backend="triton"
        )
        enable_vsa2(model, vsa2, state)
    if args.compile:  # as model.compile_blocks=true in the trainer; the warm-up compiles
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
    parser.add_argument("--kv-block", type=int, default=16, choices=(16, 32, 64))
    parser.add_argument("--mode", default="topp", choices=("topp", "topk"))
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--reps", type=int, default=3, help="timed iterations (median)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the blocks")
    parser.add_argument("--out", default=None, help="also write the table to this file")
    args = parser.parse_args()

    rows = []
    vsa2_label = f"VSA2 {args.sparsity} kv{args.kv_block} {args.mode}"
    for label, sparsity in (("dense cuDNN", None), (vsa2_label, args.sparsity)):
        model, velocity = _model(sparsity, args)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
            # warm-up (and compilation) on one video: every forward holds one video anyway
            iteration(model, velocity, argparse.Namespace(**{**vars(args), "samples": 1}))
            torch.cuda.reset_peak_memory_stats()
            times = sorted((iteration(model, velocity, args) for _ in range(args.reps)), key=sum)
        rollout, train = times[len(times) // 2]  # the iteration of median total time
        peak = torch.cuda.max_memory_allocated() / 2**30
        rows.append((label, rollout, train, peak))
        spread = ", ".join(f"{r + t:.2f}" for r, t in times)
        print(f"{label}: rollout {rollout:.2f} s, train {train:.2f} s (iterations {spread} s)")
        del model, velocity
        gc.collect()
        torch.cuda.empty_cache()

    title = (
        f"RL iteration, Wan-1.3B shape, {args.resolution}, {args.samples} videos x "
        f"{args.steps} SDE steps, {args.train_steps} trained steps per video, median of "
        f"{args.reps} iterations after a warm-up, full fine-tuning "
        f"(AdamW, gradient checkpointing{', compiled blocks' if args.compile else ''}), bf16, "
        f"{torch.cuda.get_device_name()}, {datetime.date.today()}"
    )
    write_table(title, rows, args.out)


def write_table(title: str, rows: list[tuple], out: str | None, dense_first: bool = True) -> None:
    """Prints (and writes to ``out``) the markdown table of ``rows`` (label, rollout s, train s,
    peak GiB), each iteration's speed-up over the first row's when ``dense_first``."""
    lines = [
        title,
        "",
        "| attention | rollout s | train s | iteration s | x dense | peak GiB |",
        "|---|---|---|---|---|---|",
    ]
    dense_total = rows[0][1] + rows[0][2]
    for label, rollout, train, peak in rows:
        total = rollout + train
        ratio = f"{dense_total / total:.2f}" if dense_first else "-"
        lines.append(
            f"| {label} | {rollout:.2f} | {train:.2f} | {total:.2f} | {ratio} | {peak:.1f} |"
        )
    table = "\n".join(lines) + "\n"
    print(table)
    if out:
        with open(out, "w", encoding="utf-8") as handle:
            handle.write(table)


if __name__ == "__main__":
    main()
