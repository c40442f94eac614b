"""GPU benchmark: HunyuanVideo-1.5, MiniMax-H3 and LTX-2 at their native video shapes with random
bf16 weights, dense (each model's stock attention) against VSA2 (the recipes' router: kv_block
64, top-k, at ``--sparsity``), one model at a time.

For each family it times, median of ``--reps`` after one warm-up:

- ``forward``: one no-grad denoising forward of one video (a rollout step);
- ``train``: one forward+backward with gradient checkpointing, LoRA rank 32 on the attention
  projections (VSA2's router and gates train too);

and composes the DiffusionNFT recipes' RL iteration from them (32 videos x 16 guidance-free ODE
steps; 4 trained noise levels a video, each a training pass and two no-grad forwards, the old
policy's and the KL reference's; VAE, text encoders and rewards left out, the same for dense and
VSA2). The shapes (``Family.latents``):
720p, about 5 s, each model's VAE compression and patch: HunyuanVideo-1.5 121 frames -> 31 x 45 x
80 latents (111,600 tokens), MiniMax-H3 124 frames -> 37 x 45 x 80 latents, 2 x 2 patches (32,560
video rows beside 512 text and 128 audio rows), LTX-2 121 frames at 704 x 1280 -> 16 x 22 x 40
latents (14,080 tokens). The transformers hold 8.3B, 33.1B and 18.9B parameters: MiniMax-H3's 66
GB of bf16 weights leave an 80 GB H100 little room (an H200 holds it). Rows are appended to
``--out`` as each family finishes; a family that runs out of memory gets its row saying so, with
the phase (dense or VSA2, forward or train) and the request that failed. ``--latents`` sets a
family's grid instead, e.g. ``hunyuan_video15=31x30x53`` for the HunyuanVideo-1.5 recipe's 480p.
``--tiny`` runs tiny configurations on the CPU (reference attention) to check the script, not to
time anything.

    python benchmarks/bench_model_families.py --out families.md
    python benchmarks/bench_model_families.py --tiny --reps 1 --out /tmp/families.md
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
HEADER = (
    "| model | latents (T x H x W) | video tokens | forward s, dense / VSA2 | x | train s, "
    "dense / VSA2 | x | iteration s, dense / VSA2 | x | VSA2 density | peak GiB, dense / VSA2 |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|\n"
)


@dataclass(frozen=True)
class Family:
    """How to build one family's transformer and the inputs of one denoising call."""

    name: str
    model_class: str  # the diffusers class
    native: dict  # config changes against the class defaults (none: the released model)
    tiny: dict  # a configuration small enough for the CPU
    latents: tuple[int, int, int]  # (T, H, W) at the native shape
    tiny_latents: tuple[int, int, int]
    inputs: Callable  # (config, latents, device, dtype, tiny) -> kwargs of one call
    enable_vsa2: str  # module whose enable_vsa2 swaps the attention


def _randn(*shape, device, dtype):
    return torch.randn(*shape, device=device, dtype=dtype)


def hunyuan_inputs(config, latents, device, dtype, tiny: bool) -> dict:
    """Text-to-video: 256 MLLM and 64 ByT5 text tokens, the image tokens masked (zeros)."""
    frames, height, width = latents
    mask = torch.ones(1, 256, dtype=torch.long, device=device)
    return {
        "hidden_states": _randn(
            1, config.in_channels, frames, height, width, device=device, dtype=dtype
        ),
        "timestep": torch.tensor([500.0], device=device, dtype=dtype),
        "encoder_hidden_states": _randn(1, 256, config.text_embed_dim, device=device, dtype=dtype),
        "encoder_attention_mask": mask,
        "encoder_hidden_states_2": _randn(
            1, 64, config.text_embed_2_dim, device=device, dtype=dtype
        ),
        "encoder_attention_mask_2": mask[:, :64],
        "image_embeds": torch.zeros(1, 729, config.image_embed_dim, device=device, dtype=dtype),
    }


def minimax_inputs(config, latents, device, dtype, tiny: bool) -> dict:
    """The packed [text | audio | video] sequence of a text-to-video-and-audio request: 512
    text rows, 128 audio rows (tiny: 8, 4), the video rows in raster order (integer rotary
    coordinates)."""
    frames, height, width = latents
    patch = config.patch_size
    grid = (frames // patch[0], height // patch[1], width // patch[2])
    text, audio = (8, 4) if tiny else (512, 128)
    video = grid[0] * grid[1] * grid[2]
    axes = [torch.arange(n, dtype=torch.float64) for n in grid]
    positions = torch.zeros(text + audio + video, 3, dtype=torch.float64)
    positions[: text + audio, 0] = torch.arange(text + audio)
    video_positions = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3)
    positions[text + audio :] = video_positions + torch.tensor([text + audio, 0.0, 0.0])
    tags = torch.zeros(text + audio + video, dtype=torch.long)
    tags[:text], tags[text : text + audio] = 1, 2
    rows = torch.arange(text + audio + video, device=device)
    return {
        "hidden_states": _randn(
            1,
            video,
            config.in_channels * patch[0] * patch[1] * patch[2],
            device=device,
            dtype=dtype,
        ),
        "audio_hidden_states": _randn(
            1, audio, config.audio_in_channels, device=device, dtype=dtype
        ),
        "encoder_hidden_states": _randn(1, text, config.text_dim, device=device, dtype=dtype),
        "timestep": torch.tensor([0.5], device=device, dtype=dtype),
        "timestep_indices": torch.zeros(len(rows), dtype=torch.long, device=device),
        "token_tags": tags.to(device),
        "position_ids": positions.to(device),
        "video_indices": rows[text + audio :],
        "audio_indices": rows[text : text + audio],
        "text_indices": rows[:text],
    }


def ltx2_inputs(config, latents, device, dtype, tiny: bool) -> dict:
    """A video with 126 audio latents (5 s; tiny: 5) and 256 text tokens for each of its two
    streams."""
    frames, height, width = latents
    audio = 5 if tiny else 126
    return {
        "hidden_states": _randn(
            1, frames * height * width, config.in_channels, device=device, dtype=dtype
        ),
        "audio_hidden_states": _randn(
            1, audio, config.audio_in_channels, device=device, dtype=dtype
        ),
        "encoder_hidden_states": _randn(
            1, 256, config.caption_channels, device=device, dtype=dtype
        ),
        "audio_encoder_hidden_states": _randn(
            1, 256, config.caption_channels, device=device, dtype=dtype
        ),
        "timestep": torch.tensor([500.0], device=device, dtype=dtype),
        "num_frames": frames,
        "height": height,
        "width": width,
        "audio_num_frames": audio,
    }


FAMILIES = {
    "hunyuan_video15": Family(
        "HunyuanVideo-1.5 (8.3B)", "HunyuanVideo15Transformer3DModel", {"task_type": "t2v"},
        {"in_channels": 4, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 16,
         "num_layers": 1, "num_refiner_layers": 1, "mlp_ratio": 2.0, "text_embed_dim": 16,
         "text_embed_2_dim": 8, "image_embed_dim": 8, "rope_axes_dim": (4, 6, 6)},
        (31, 45, 80), (2, 4, 16), hunyuan_inputs, "vsa2_rl.models.hunyuan_video15",
    ),
    "minimax_h3": Family(
        "MiniMax-H3 (33.1B)", "MiniMaxH3Transformer3DModel", {},
        {"num_attention_heads": 2, "attention_head_dim": 16, "hidden_size": 32, "num_layers": 1,
         "num_refiner_layers": 1, "ffn_dim": 64, "in_channels": 4, "audio_in_channels": 4,
         "text_dim": 8, "freq_dim": 16, "time_embed_hidden_dim": 32, "time_embed_dim": 16,
         "rope_freq_dim": 2},
        (37, 45, 80), (2, 8, 32), minimax_inputs, "vsa2_rl.models.minimax_h3",
    ),
    "ltx2": Family(
        "LTX-2 (18.9B)", "LTX2VideoTransformer3DModel", {},
        {"in_channels": 4, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 16,
         "cross_attention_dim": 32, "audio_in_channels": 4, "audio_out_channels": 4,
         "audio_num_attention_heads": 2, "audio_attention_head_dim": 8,
         "audio_cross_attention_dim": 16, "num_layers": 1, "caption_channels": 8},
        (16, 22, 40), (2, 4, 16), ltx2_inputs, "vsa2_rl.models.ltx2",
    ),
}  # fmt: skip


def build(family: Family, args, device, dtype):
    """The family's transformer (random weights in ``dtype`` on ``device``) with LoRA rank 32,
    gradient checkpointing and VSA2 layers (sparsity 0 = the stock attention), and its
    SparsityState."""
    import importlib

    import diffusers
    from peft import LoraConfig, inject_adapter_in_model

    from vsa2_rl.attention import SparsityState
    from vsa2_rl.config import VSA2Config

    model_class = getattr(diffusers, family.model_class)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in dtype on the device: no float32 copy
    try:
        with torch.device(device):
            model = model_class(**(family.tiny if args.tiny else family.native))
    finally:
        torch.set_default_dtype(default)
    state = SparsityState(sparsity=0.0)
    backend = "torch" if args.tiny else "triton"
    vsa2 = VSA2Config(kv_block=64, mode="topk", backend=backend)
    importlib.import_module(family.enable_vsa2).enable_vsa2(model, vsa2, state)
    model.enable_gradient_checkpointing()
    model.requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=32, lora_alpha=32, target_modules=LORA_TARGETS), model)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_("lora_" in name or ".vsa2." in name)
    return model, state


class PhaseOutOfMemory(RuntimeError):
    """A family ran out of GPU memory; the message names the phase and the failed request."""


@contextlib.contextmanager
def phase(name: str):
    """Re-raises an out-of-memory error inside as :class:`PhaseOutOfMemory` naming ``name``."""
    try:
        yield
    except torch.OutOfMemoryError as error:
        tried = re.search(r"Tried to allocate [\d.]+ [KMG]iB", str(error))
        raise PhaseOutOfMemory(name + (f", t{tried.group(0)[1:]}" if tried else "")) from error


def timed(fn, reps: int, device) -> float:
    """Median seconds of ``fn`` over ``reps`` calls after one warm-up call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def pass_seconds(model, inputs: dict, reps: int, device, label: str) -> dict[str, float]:
    """Seconds of one no-grad forward and one forward+backward, and the peak GiB; ``label``
    (dense or VSA2) names the phase that runs out of memory."""

    def forward():
        with torch.no_grad():
            model(**inputs, return_dict=False)

    def train():
        out = model(**inputs, return_dict=False)[0]
        out.float().square().mean().backward()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model.eval()
    with phase(f"{label} forward"):
        forward_s = timed(forward, reps, device)
    model.train()
    with phase(f"{label} train"):
        train_s = timed(train, reps, device)
    model.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return {"forward": forward_s, "train": train_s, "peak": peak}


def iteration_seconds(forward: float, train: float) -> float:
    """The DiffusionNFT recipes' RL iteration from its parts (module docstring)."""
    videos, steps, trained, no_grad_forwards = 32, 16, 4, 2
    return videos * (steps * forward + trained * (train + no_grad_forwards * forward))


def measure(name: str, args, device, dtype) -> str:
    """The family's table row: dense and VSA2 on the same model and inputs."""
    family = FAMILIES[name]
    with phase("building the model"):
        model, state = build(family, args, device, dtype)
    latents = family.tiny_latents if args.tiny else args.latents.get(name, family.latents)
    inputs = family.inputs(model.config, latents, device, dtype, args.tiny)
    state.sparsity = 0.0
    dense = pass_seconds(model, inputs, args.reps, device, "dense")
    state.pop_density()
    state.sparsity = args.sparsity
    sparse = pass_seconds(model, inputs, args.reps, device, "VSA2")
    density = state.pop_density()  # the mean over the VSA2 calls: the router's actual keep
    tokens = video_tokens(family, model.config, latents)
    its = [iteration_seconds(t["forward"], t["train"]) for t in (dense, sparse)]
    cells = [
        family.name, " x ".join(map(str, latents)), f"{tokens:,}",
        f"{dense['forward']:.3f} / {sparse['forward']:.3f}",
        f"{dense['forward'] / sparse['forward']:.2f}",
        f"{dense['train']:.3f} / {sparse['train']:.3f}", f"{dense['train'] / sparse['train']:.2f}",
        f"{its[0]:,.0f} / {its[1]:,.0f}", f"{its[0] / its[1]:.2f}", f"{density:.3f}",
        f"{dense['peak']:.1f} / {sparse['peak']:.1f}",
    ]  # fmt: skip
    return "| " + " | ".join(cells) + " |\n"


def video_tokens(family: Family, config, latents) -> int:
    """Tokens of the video grid after the family's patch embedding."""
    frames, height, width = latents
    if family.model_class == "MiniMaxH3Transformer3DModel":
        patch_t, patch_h, patch_w = config.patch_size
    else:
        patch_t, patch_h, patch_w = config.patch_size_t, config.patch_size, config.patch_size
    return (frames // patch_t) * (height // patch_h) * (width // patch_w)


def parse_latents(text: str) -> tuple[str, tuple[int, int, int]]:
    """``FAMILY=TxHxW`` as (family, (T, H, W))."""
    name, _, grid = text.partition("=")
    sizes = grid.split("x")
    if name not in FAMILIES or len(sizes) != 3 or not all(x.isdigit() for x in sizes):
        raise argparse.ArgumentTypeError(
            f"--latents {text!r}: want FAMILY=TxHxW with FAMILY one of {', '.join(FAMILIES)}"
        )
    return name, tuple(int(x) for x in sizes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    parser.add_argument("--sparsity", type=float, default=0.875)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--latents", nargs="*", default=[], type=parse_latents, metavar="FAMILY=TxHxW",
        help="a family's latent grid instead of its 720p one, e.g. hunyuan_video15=31x30x53 "
        "(480p x 121 frames, the HunyuanVideo-1.5 recipe's)",
    )  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="tiny configs on the CPU (a check)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    args.latents = dict(args.latents)
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    where = "CPU, tiny configs" if args.tiny else torch.cuda.get_device_name()
    title = (
        f"Model families at their native shapes, random {dtype} weights, LoRA rank 32: dense "
        f"against VSA2 kv64 top-k at {args.sparsity}; median of {args.reps}; {where}, "
        f"{datetime.date.today()}\n\n"
    )
    with open(args.out, "w", encoding="utf-8") as handle:
        handle.write(title + HEADER)
    print(title + HEADER, end="", flush=True)
    for name in args.families:
        try:
            row = measure(name, args, device, dtype)
        except PhaseOutOfMemory as error:
            row = f"| {FAMILIES[name].name} | out of memory in {error} ||||||||||\n"
        if device.type == "cuda":
            torch.cuda.empty_cache()
        with open(args.out, "a", encoding="utf-8") as handle:
            handle.write(row)
        print(row, end="", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
