"""GPU benchmark: one Flow-GRPO iteration of Wan2.2 at the real shapes (random weights), dense vs
VSA2 at the attention settings of the recipes, and what one GPU holds.

Models, built in memory on the GPU in bf16 with the diffusers architecture of the released
checkpoints (``WanTransformer3DModel``; no weights are read):

- ``a14b_i2v``: Wan2.2-I2V-A14B, two 14B experts (``vsa2_rl.models.experts.WanExperts``, the
  boundary at sigma 0.9), image through 20 extra input channels; settings of
  ``configs/wan2_2_a14b_i2v_vsa2_grpo.yaml`` (LoRA rank 32 on both experts, kv_block 64 top-p).
- ``ti2v_5b``: Wan2.2-TI2V-5B, one 5B transformer on the 16x VAE's latents, per-token timesteps
  and the image as first latent frame; settings of ``configs/wan2_2_ti2v_5b_vsa2_grpo.yaml``
  (LoRA rank 32, kv_block 16 top-p).

The iteration is the trainer's (vsa2_rl.rl.trainer) with the library's own pieces, as
``bench_rl_step.py`` times it: an SDE rollout of ``--samples`` videos of ``--steps`` steps, then
``--train-steps`` transitions per video recomputed with gradients (PPO-clip loss), AdamW on the
adapters, gradient checkpointing. Left out, dense and sparse alike: classifier-free guidance,
the VAE, text and image encoders, rewards. Dense is the same model at sparsity 0 (stock SDPA,
cuDNN or FlashAttention). Each setting runs a warm-up iteration, then ``--reps`` timed ones;
the table gives the median, the speed-up over dense and the peak memory.

    python benchmarks/bench_wan22.py --model ti2v_5b --out ti2v.md
    python benchmarks/bench_wan22.py --model a14b_i2v --resolution 480p --out a14b.md
"""

from __future__ import annotations

import argparse
import datetime
import time

import torch
from bench_rl_step import write_table
from torch.nn.attention import SDPBackend, sdpa_kernel

from vsa2_rl.rl.grpo import group_advantages, grpo_loss
from vsa2_rl.sampling import sample, sigma_schedule, step_log_prob

WAN22_A14B = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 40,
    "attention_head_dim": 128,
    "in_channels": 36,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 13824,
    "num_layers": 40,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
}
WAN22_5B = {
    **WAN22_A14B,
    "num_attention_heads": 24,
    "in_channels": 48,
    "out_channels": 48,
    "ffn_dim": 14336,
    "num_layers": 30,
}
# (frames, height, width) of the latents: Wan2.1/2.2 VAE 4x time, 8x space; TI2V's 16x space
LATENTS = {
    ("a14b_i2v", "480p"): (21, 60, 104),  # 81 x 480 x 832
    ("a14b_i2v", "720p"): (21, 90, 160),  # 81 x 720 x 1280
    ("ti2v_5b", "720p"): (31, 44, 80),  # 121 x 704 x 1280
}
DEVICE = "cuda"
SETTINGS = {  # the recipes' attention
    "a14b_i2v": {"kv_block": 64, "mode": "topp", "top_p": 0.9, "sparsity": 0.9},
    "ti2v_5b": {"kv_block": 16, "mode": "topp", "top_p": 0.9, "sparsity": 0.9},
}


def build(args):
    """The model with VSA2 and LoRA (rank 32 on the attention projections), its sparsity
    state, the condition and the velocity function."""
    from diffusers import WanTransformer3DModel
    from peft import LoraConfig

    from vsa2_rl.attention import SparsityState
    from vsa2_rl.config import VSA2Config
    from vsa2_rl.models.conditioning import WanCondition
    from vsa2_rl.models.experts import WanExperts, trained_modules
    from vsa2_rl.models.wan import compile_blocks, enable_vsa2, wan_velocity

    settings = SETTINGS[args.model]
    state = SparsityState()
    vsa2 = VSA2Config(
        kv_block=settings["kv_block"], mode=settings["mode"], top_p=settings["top_p"],
        backend="triton",
    )  # fmt: skip
    torch.manual_seed(0)
    config = WAN22_A14B if args.model == "a14b_i2v" else WAN22_5B

    def expert():
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # made in bf16 on the GPU: no fp32 copy
        try:
            with torch.device(DEVICE):
                model = WanTransformer3DModel(**config)
        finally:
            torch.set_default_dtype(default)
        return enable_vsa2(model, vsa2, state)

    model = WanExperts(expert(), expert(), 0.9) if args.model == "a14b_i2v" else expert()
    model.requires_grad_(False)
    for part in trained_modules(model):
        part.enable_gradient_checkpointing()
        part.add_adapter(LoraConfig(r=32, lora_alpha=32, target_modules=["to_q", "to_k", "to_v",
                                                                         "to_out.0"]))  # fmt: skip
        for name, parameter in part.named_parameters():
            if "lora_" in name or ".vsa2." in name:
                parameter.requires_grad_(True)
    if args.compile:
        compile_blocks(model)
    frames, height, width = LATENTS[(args.model, args.resolution)]
    generator = torch.Generator(DEVICE).manual_seed(1)
    if args.model == "a14b_i2v":  # 4 mask channels + the image's 16-channel latent
        image = torch.randn(1, 20, frames, height, width, device=DEVICE, generator=generator)
        condition = WanCondition(None, "channels", image)
    else:
        image = torch.randn(1, 48, 1, height, width, device=DEVICE, generator=generator)
        condition = WanCondition(None, "first_frame", image)
    condition.text = torch.randn(1, 512, 4096, device=DEVICE, generator=generator)
    expand = args.model == "ti2v_5b"

    def velocity(x, sigma):
        return wan_velocity(model, x, sigma, condition, expand_timesteps=expand)

    return model, state, velocity, (config["out_channels"], frames, height, width)


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def iteration(model, velocity, shape, args) -> tuple[float, float]:
    """One rollout + update; returns (rollout seconds, train seconds)."""
    n = args.samples
    generator = torch.Generator(DEVICE).manual_seed(0)
    sigmas = sigma_schedule(args.steps, shift=args.shift)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-6)
    _synchronize()
    start = time.perf_counter()
    model.eval()
    trajectories = []
    with torch.no_grad():
        for _ in range(n):  # one video per forward, as at Wan scale
            noise = torch.randn(1, *shape, device=DEVICE, generator=generator)
            trajectories.append(
                sample(velocity, noise, sigmas, kind="sde", noise_level=0.7, generator=generator)
            )
    _synchronize()
    rollout = time.perf_counter() - start

    advantages, _ = group_advantages(
        torch.randn(n, device=DEVICE), torch.zeros(n, dtype=torch.long, device=DEVICE)
    )
    start = time.perf_counter()
    model.train()
    optimizer.zero_grad(set_to_none=True)
    # trained steps spread over the rollout: both experts of A14B train
    trained = torch.linspace(0, args.steps - 1, args.train_steps).round().long().tolist()
    for i, trajectory in enumerate(trajectories):
        for j in trained:
            x, x_next = trajectory.latents[j], trajectory.latents[j + 1]
            sigma = torch.full((1,), float(sigmas[j]), device=DEVICE)
            log_prob, _, _ = step_log_prob(
                velocity(x, sigma), x, x_next, float(sigmas[j]), float(sigmas[j + 1]), "sde", 0.7
            )
            loss, _ = grpo_loss(log_prob, trajectory.log_probs[j], advantages[i : i + 1])
            (loss / (n * len(trained))).backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    _synchronize()
    return rollout, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, choices=sorted(SETTINGS))
    parser.add_argument("--resolution", default="720p", choices=("480p", "720p"))
    parser.add_argument("--samples", type=int, default=1, help="videos per iteration")
    parser.add_argument("--steps", type=int, default=8, help="denoising steps per rollout")
    parser.add_argument("--train-steps", type=int, default=2, help="trained steps per video")
    parser.add_argument("--shift", type=float, default=5.0)
    parser.add_argument("--reps", type=int, default=3, help="timed iterations (median)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the blocks")
    parser.add_argument("--only-sparse", action="store_true", help="skip dense (memory probes)")
    parser.add_argument("--out", default=None, help="also write the table to this file")
    args = parser.parse_args()
    if (args.model, args.resolution) not in LATENTS:
        parser.error(f"--resolution {args.resolution} is not measured for {args.model}")

    model, state, velocity, shape = build(args)
    sparsity = SETTINGS[args.model]["sparsity"]
    settings = SETTINGS[args.model]
    vsa2_label = f"VSA2 {sparsity} kv{settings['kv_block']} {settings['mode']}"
    runs = [("dense", 0.0), (vsa2_label, sparsity)]
    if args.only_sparse:
        runs = runs[1:]
    rows = []
    for label, value in runs:
        state.sparsity = value
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
            iteration(model, velocity, shape, argparse.Namespace(**{**vars(args), "samples": 1}))
            torch.cuda.reset_peak_memory_stats()
            times = sorted((iteration(model, velocity, shape, args) for _ in range(args.reps)),
                           key=sum)  # fmt: skip
        rollout, train = times[len(times) // 2]
        peak = torch.cuda.max_memory_allocated() / 2**30
        rows.append((label, rollout, train, peak))
        spread = ", ".join(f"{r + t:.1f}" for r, t in times)
        print(f"{label}: rollout {rollout:.2f} s, train {train:.2f} s (iterations {spread} s)",
              flush=True)  # fmt: skip

    frames, height, width = shape[1:]
    tokens = frames * (height // 2) * (width // 2)
    title = (
        f"RL iteration, {args.model} ({args.resolution}, latents {frames}x{height}x{width}, "
        f"{tokens} tokens), {args.samples} video(s) x {args.steps} SDE steps, "
        f"{args.train_steps} trained steps per video, median of {args.reps} after a warm-up, "
        f"LoRA r32 (AdamW, gradient checkpointing{', compiled blocks' if args.compile else ''}), "
        f"bf16, {torch.cuda.get_device_name()}, {datetime.date.today()}"
    )
    write_table(title, rows, args.out, dense_first=not args.only_sparse)


if __name__ == "__main__":
    main()
