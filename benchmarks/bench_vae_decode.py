"""GPU benchmark: the Wan VAE decode in float32 and in bfloat16 (``model.vae_decode_dtype``).

The VAE is Wan2.1's architecture (diffusers' ``AutoencoderKLWan`` defaults) with random weights,
or the one of ``--vae`` (a diffusers Wan folder or its ``vae/``). It runs as the trainer runs it
(:func:`vsa2_rl.models.wan_bundle.prepare_vae`: 256-pixel tiles, one video at a time) and decodes
through the trainer's path (:func:`~vsa2_rl.models.wan_bundle.decode_latents`, bfloat16 through
:func:`~vsa2_rl.models.wan_bundle.decoding_vae`). For each video size (480p x 81 and 480p x 33
frames by default) the report gives the median seconds of ``--repeats`` decodes after a warm-up
in each dtype and their ratio; then how far the bfloat16 frames are from the float32 ones, as
PSNR and as the weight-free rewards' scores of both, for two kinds of latents:

- ``noise``: standard normal latents (the sampler's start; the timed decodes);
- ``shapes``: a synthetic smooth video (a circle moving right, :mod:`vsa2_rl.toy.data`) encoded
  by the same VAE.

With random weights no latents decode to natural videos: the figures then bound the numerical
error of decoding in bfloat16, not its effect on a trained VAE's videos (``--vae`` gives that).
The yardstick beside them is 8-bit rounding of the float32 frames, which every saved video
undergoes and the flow rewards apply to their luma input: 58.9 dB PSNR (an error uniform over
one level of 1/255) and the reward changes it causes, scored the same way. float32 on CUDA runs
its convolutions as cuDNN is set (TF32 by torch's default); the report says which.

    python benchmarks/bench_vae_decode.py --out vae_decode.md
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from vsa2_rl.models.conditioning import vae_scale_factors
from vsa2_rl.models.wan_bundle import decode_latents, decoding_vae, prepare_vae
from vsa2_rl.rewards import get_reward, list_rewards
from vsa2_rl.toy.data import ShapeSpec, render_batch

# The registered rewards that score a video without weights, a server or a condition image
# (motion_quality is the Wan recipes' reward; the others are its terms and image_quality).
REWARDS = (
    "motion_quality",
    "dynamic_degree",
    "motion_smoothness",
    "temporal_flicker",
    "image_quality",
)
EIGHT_BIT_PSNR = -20 * math.log10(1 / (255 * math.sqrt(12)))  # 58.9 dB


def parse_size(text: str) -> tuple[int, int, int]:
    """'480x832x81' -> (height, width, frames)."""
    height, width, frames = (int(part) for part in text.split("x"))
    return height, width, frames


def load_vae(path: str | None, device: torch.device):
    from diffusers import AutoencoderKLWan

    if path is None:
        torch.manual_seed(0)
        with torch.device(device):  # initialised where it runs: seconds, not a minute on CPU
            return AutoencoderKLWan()
    folder = os.path.join(path, "vae") if os.path.isdir(os.path.join(path, "vae")) else path
    return AutoencoderKLWan.from_pretrained(folder, torch_dtype=torch.float32)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_decode(vae, latents: torch.Tensor, repeats: int) -> tuple[float, torch.Tensor]:
    """Median seconds of ``repeats`` decodes after one warm-up, and the last video (on CPU)."""
    decode_latents(vae, latents)
    seconds = []
    for _ in range(repeats):
        synchronize(latents.device)
        start = time.perf_counter()
        video = decode_latents(vae, latents)
        synchronize(latents.device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), video.cpu()


def shapes_latents(vae, size: tuple[int, int, int], device: torch.device) -> torch.Tensor:
    """A circle moving right at ``size``, encoded by ``vae`` (float32, its mode), normalised
    with ``latents_mean`` / ``latents_std`` as the sampler's latents are."""
    height, width, frames = size
    spec = ShapeSpec("red", "circle", "right", "slowly")
    video = render_batch([spec], [0], frames, height, width, device=device)  # (1, T, 3, H, W)
    pixels = video.permute(0, 2, 1, 3, 4) * 2.0 - 1.0  # (1, 3, T, H, W) in [-1, 1]
    shape = (1, -1, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean, device=device).view(shape)
    std = torch.tensor(vae.config.latents_std, device=device).view(shape)
    with torch.no_grad():
        latent = vae.encode(pixels).latent_dist.mode().float()
    return (latent - mean) / std


def psnr(video: torch.Tensor, reference: torch.Tensor) -> float:
    """PSNR in dB of frames in [0, 1] (peak 1); inf where they are equal."""
    mse = float((video.double() - reference.double()).pow(2).mean())
    return math.inf if mse == 0 else -10 * math.log10(mse)


def clamped_share(video: torch.Tensor) -> float:
    """Share of pixels at 0 or 1: the VAE's clamp makes them equal in both dtypes."""
    return float(((video == 0) | (video == 1)).float().mean())


def score(rewards: dict, video: torch.Tensor) -> dict[str, float]:
    batch = video[None]
    return {name: float(fn(batch, [""], [{}])[0]) for name, fn in rewards.items()}


def submit_scores(pool, rewards: dict, key, video32: torch.Tensor, video16: torch.Tensor) -> dict:
    """Reward jobs for a video decoded in float32 and bfloat16, and for the float32 one rounded
    to 8 bits (the yardstick)."""
    versions = {"float32": video32, "bfloat16": video16, "8-bit": (video32 * 255).round() / 255}
    return {(key, name): pool.submit(score, rewards, video) for name, video in versions.items()}


def measure(args, device: torch.device) -> tuple[list, dict, dict, object]:
    """Timings per size, the (float32, bfloat16) videos per (size, latents) and their scores."""
    vae = prepare_vae(load_vae(args.vae, device), device)
    bf16 = decoding_vae(vae, torch.bfloat16)
    sizes = [parse_size(text) for text in args.sizes.split(",")]
    rewards = {name: get_reward(name) for name in REWARDS}
    t_scale, s_scale = vae_scale_factors(vae.config)
    timings, videos = [], {}
    for height, width, frames in sizes:
        generator = torch.Generator(device).manual_seed(0)
        shape = (1, vae.config.z_dim, (frames - 1) // t_scale + 1, height // s_scale,
                 width // s_scale)  # fmt: skip
        noise = torch.randn(shape, generator=generator, device=device)
        seconds32, video32 = timed_decode(vae, noise, args.repeats)
        seconds16, video16 = timed_decode(bf16, noise, args.repeats)
        timings.append(((height, width, frames), seconds32, seconds16))
        videos[(height, width, frames), "noise"] = (video32[0], video16[0])
    # the flow rewards run OpenCV on the CPU, which releases the GIL: videos are scored in
    # threads, from here on, while the untimed encodes and decodes run
    jobs = {}
    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        for key, pair in videos.items():
            jobs.update(submit_scores(pool, rewards, key, *pair))
        for size in sizes:
            latents = shapes_latents(vae, size, device)
            pair = (decode_latents(vae, latents)[0].cpu(), decode_latents(bf16, latents)[0].cpu())
            videos[size, "shapes"] = pair
            jobs.update(submit_scores(pool, rewards, (size, "shapes"), *pair))
        scores = {job_key: job.result() for job_key, job in jobs.items()}
    return timings, videos, scores, vae


def report(args, device: torch.device, timings, videos, scores, vae, seconds: float) -> str:
    """The markdown report (see the module docstring)."""
    if device.type == "cuda":
        cudnn = getattr(getattr(torch.backends.cudnn, "conv", None), "fp32_precision", None)
        cudnn = cudnn or ("tf32" if torch.backends.cudnn.allow_tf32 else "ieee")
        where = f"{torch.cuda.get_device_name(device)}; float32 convolutions in cuDNN: {cudnn}"
    else:
        where = str(device)
    lines = [
        f"# Wan VAE decode: float32 vs bfloat16 ({datetime.date.today()})",
        "",
        f"Device: {where}; torch {torch.__version__}.",
        f"VAE: {args.vae or 'Wan2.1 architecture, RANDOM weights'}; tiles of "
        f"{vae.tile_sample_min_height} pixels at a stride of {vae.tile_sample_stride_height}, "
        "one video at a time (the trainer's settings).",
    ]
    if args.vae is None:
        lines.append(
            "Random weights: no latents decode to natural videos, so PSNR and reward changes "
            "below bound the numerical error of bfloat16 decoding only; run with --vae on a "
            "trained VAE for its effect on real videos."
        )
    lines += [
        "",
        f"Median seconds of {args.repeats} decodes after a warm-up, standard normal latents:",
        "",
        "| video | float32 s | bfloat16 s | float32 / bfloat16 |",
        "|---|---:|---:|---:|",
    ]
    for (height, width, frames), seconds32, seconds16 in timings:
        lines.append(
            f"| {height}x{width} x {frames} | {seconds32:.3f} | {seconds16:.3f} | "
            f"{seconds32 / seconds16:.2f} |"
        )
    lines += [
        "",
        f"bfloat16 frames against float32 frames (yardstick: 8-bit rounding, "
        f"{EIGHT_BIT_PSNR:.1f} dB; clamped: share of pixels at 0 or 1 in float32, equal in "
        "both):",
        "",
        "| video | latents | clamped | PSNR dB |",
        "|---|---|---:|---:|",
    ]
    for ((height, width, frames), kind), (video32, video16) in videos.items():
        lines.append(
            f"| {height}x{width} x {frames} | {kind} | {clamped_share(video32):.3f} | "
            f"{psnr(video16, video32):.1f} |"
        )
    lines += [
        "",
        "Rewards of the same videos: float32, and the change from it of bfloat16 and of 8-bit "
        "rounding:",
        "",
        "| video | latents | reward | float32 | bfloat16 - float32 | 8-bit - float32 |",
        "|---|---|---|---:|---:|---:|",
    ]
    for key in videos:
        (height, width, frames), kind = key
        base = scores[key, "float32"]
        for name in REWARDS:
            lines.append(
                f"| {height}x{width} x {frames} | {kind} | {name} | {base[name]:.5f} | "
                f"{scores[key, 'bfloat16'][name] - base[name]:+.2e} | "
                f"{scores[key, '8-bit'][name] - base[name]:+.2e} |"
            )
    others = ", ".join(name for name in list_rewards() if name not in REWARDS)
    lines += [
        "",
        f"Not scored (they need weights, a server or a condition image, or score the toy "
        f"task): {others}.",
        f"Total {seconds:.0f} s.",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vae", help="a diffusers Wan folder or its vae/ (default: random)")
    parser.add_argument(
        "--sizes", default="480x832x81,480x832x33", help="videos HxWxFRAMES, comma-separated"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed decodes after a warm-up")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", help="also write the report to this markdown file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    started = time.perf_counter()
    timings, videos, scores, vae = measure(args, device)
    text = report(args, device, timings, videos, scores, vae, time.perf_counter() - started)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text)


if __name__ == "__main__":
    main()
