"""Toy video DiT of the embedded default: a tiny WanTransformer3DModel on pixel-space latents.

The model is diffusers' ``WanTransformer3DModel`` at about 0.25 M parameters per block
(4 blocks, width 128, 4 heads of 32) with ``in_channels = out_channels = 3``: the "latents" are
the RGB pixels mapped to [-1, 1], so decoding is an affine map and no VAE is needed. Prompts go
through the built-in word-level text encoder (:mod:`vsa2_rl.models.text`). The bundle's velocity
is the transformer output plus a fixed linear estimate of the velocity
(:func:`linear_velocity`, a skip preconditioning), so the transformer learns a residual.

It is trained by :func:`build_toy_model` (``scripts/build_toy_model.py``) with rectified-flow
matching (Liu et al. 2022; the velocity is noise - data and the timestep sigma * 1000, as in
Wan2.1) from DiT's adaLN-Zero initialisation on synthetic moving-shape videos
(:mod:`vsa2_rl.data.synthetic`), progressively: dense attention at 16x16 px; sparse rebasing to
VSA2 (:mod:`vsa2_rl.models.rebase`) with the sparsity annealed from 0 to the target, then drawn
from the range used for RL and evaluation; finally 32x32 px at the RL training sparsity. The
checkpoint (safetensors + json) ships in ``assets/toy/``; :func:`load_toy_bundle` loads it as a
``VideoDiTBundle``.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from vsa2_rl.attention import SparsityState
from vsa2_rl.config import VSA2Config
from vsa2_rl.data.synthetic import random_specs, render_batch
from vsa2_rl.models.rebase import RebaseSchedule, rebase_to_vsa2
from vsa2_rl.models.text import ToyTextEncoder, WordTokenizer, toy_vocabulary
from vsa2_rl.models.wan import enable_vsa2, resolve_dtype, wan_velocity

ASSET_DIR = Path(__file__).resolve().parents[2] / "assets" / "toy"
CACHE_DIR = Path(os.path.expanduser("~/.cache/vsa2_rl/toy"))
WEIGHTS_FILE = "toy.safetensors"
CONFIG_FILE = "config.json"

TOY_TRANSFORMER = {
    "patch_size": [1, 2, 2],
    "num_attention_heads": 4,
    "attention_head_dim": 32,
    "in_channels": 3,
    "out_channels": 3,
    "text_dim": 64,
    "freq_dim": 64,
    "ffn_dim": 256,
    "num_layers": 4,
    "rope_max_seq_len": 64,
}
TOY_TEXT = {"dim": 64, "max_length": 8}


def make_toy_transformer(config: dict | None = None) -> nn.Module:
    """A randomly initialised toy ``WanTransformer3DModel`` (``TOY_TRANSFORMER`` by default)."""
    from diffusers import WanTransformer3DModel

    config = dict(TOY_TRANSFORMER if config is None else config)
    config["patch_size"] = tuple(config["patch_size"])
    return WanTransformer3DModel(**config)


@torch.no_grad()
def adaln_zero_init(transformer: nn.Module) -> nn.Module:
    """DiT's adaLN-Zero start (Peebles & Xie, 2023): every block and the output are zero.

    Zeroes the timestep projection that produces all shift/scale/gate modulations, the blocks'
    and the output's modulation tables and the output projection, so the untrained network is
    the identity on its residual stream and predicts 0; training from scratch is faster and
    steadier than from diffusers' random modulation tables.
    """
    for param in (
        transformer.condition_embedder.time_proj.weight,
        transformer.condition_embedder.time_proj.bias,
        transformer.scale_shift_table,
        transformer.proj_out.weight,
        transformer.proj_out.bias,
    ):
        param.zero_()
    for block in transformer.blocks:
        block.scale_shift_table.zero_()
    return transformer


def make_toy_text_encoder(config: dict | None = None) -> tuple[WordTokenizer, ToyTextEncoder]:
    config = TOY_TEXT if config is None else config
    vocabulary = toy_vocabulary()
    tokenizer = WordTokenizer(vocabulary, config["max_length"])
    return tokenizer, ToyTextEncoder(len(vocabulary), config["dim"], config["max_length"])


def pixels_to_latents(videos: torch.Tensor) -> torch.Tensor:
    """Videos [B, T, C, H, W] in [0, 1] -> toy latents [B, C, T, H, W] in [-1, 1]."""
    return videos.permute(0, 2, 1, 3, 4) * 2.0 - 1.0


def latents_to_pixels(latents: torch.Tensor) -> torch.Tensor:
    """Toy latents [B, C, T, H, W] -> videos [B, T, C, H, W] in [0, 1], float32."""
    return (latents.float() * 0.5 + 0.5).clamp(0.0, 1.0).permute(0, 2, 1, 3, 4).contiguous()


# Per-pixel mean and variance of the synthetic videos in latent units (measured on the training
# distribution: black background at -1, one coloured shape covering about 10 % of the frame).
DATA_MEAN = -0.92
DATA_VAR = 0.11


def linear_velocity(latents: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Best linear estimate of the velocity noise - data from ``latents`` at noise level sigma.

    For data of mean m and variance s2 per pixel and x = (1 - sigma) data + sigma noise, the
    linear MMSE estimate of v = noise - data is ``c(sigma) (x - (1 - sigma) m) - m`` with
    ``c = (sigma - (1 - sigma) s2) / ((1 - sigma)^2 s2 + sigma^2)``. The toy transformer predicts
    the residual over it, the rectified-flow analogue of EDM's skip preconditioning (Karras et
    al., 2022): reproducing the noise at high sigma no longer has to be learnt, which a tiny DiT
    trained for a few hundred steps does badly (speckled samples).
    """
    s = sigma.float().view(-1, 1, 1, 1, 1)
    c = (s - (1.0 - s) * DATA_VAR) / ((1.0 - s) ** 2 * DATA_VAR + s**2)
    return c * (latents.float() - (1.0 - s) * DATA_MEAN) - DATA_MEAN


def toy_velocity(
    transformer: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, text_emb: torch.Tensor
) -> torch.Tensor:
    """Toy model velocity: transformer residual + :func:`linear_velocity`, float32."""
    sigma = sigma.reshape(-1).expand(latents.shape[0])
    residual = wan_velocity(transformer, latents, sigma, text_emb)
    return residual + linear_velocity(latents, sigma)


@dataclass
class ToyBundle:
    """The toy model as a ``VideoDiTBundle`` (docs/CONTRACTS.md)."""

    transformer: nn.Module
    sparsity_state: SparsityState
    text_encoder: ToyTextEncoder
    tokenizer: WordTokenizer
    latent_channels: int = 3
    info: dict = field(default_factory=dict)  # training record from the checkpoint's json

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.transformer.parameters()).dtype

    def latent_shape(self, num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        _, p_h, p_w = self.transformer.config.patch_size
        if num_frames < 1 or height % p_h or width % p_w or min(height, width) < 1:
            raise ValueError(
                f"height and width must be positive multiples of the patch ({p_h}, {p_w}), "
                f"got {num_frames}x{height}x{width}"
            )
        return self.latent_channels, num_frames, height, width

    def encode_prompts(self, prompts: list[str]) -> torch.Tensor:
        """[B, max_length, text_dim] embeddings (zero past each prompt)."""
        device = next(self.text_encoder.parameters()).device
        ids, mask = self.tokenizer(list(prompts))
        with torch.no_grad():
            emb = self.text_encoder(ids.to(device), mask.to(device))
        return emb.to(device=self.device, dtype=self.dtype)

    def velocity(
        self, latents: torch.Tensor, sigma: torch.Tensor, text_emb: torch.Tensor
    ) -> torch.Tensor:
        """Velocity = transformer output + the fixed linear estimate (see ``linear_velocity``)."""
        return toy_velocity(self.transformer, latents, sigma, text_emb)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return latents_to_pixels(latents)


# --------------------------------------------------------------------------------------------
# Checkpoint


def save_toy_checkpoint(
    path: str | Path,
    transformer: nn.Module,
    text_encoder: ToyTextEncoder,
    info: dict,
) -> None:
    """Write ``toy.safetensors`` (transformer.* incl. VSA2 params, text_encoder.*) + config."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {f"transformer.{k}": v for k, v in transformer.state_dict().items()}
    tensors.update({f"text_encoder.{k}": v for k, v in text_encoder.state_dict().items()})
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in tensors.items()}
    save_file(tensors, str(path / WEIGHTS_FILE))
    config = {"transformer": TOY_TRANSFORMER, "text_encoder": TOY_TEXT, "training": info}
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def _split(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


def load_toy_bundle(
    vsa2: VSA2Config,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str = torch.float32,
    path: str | Path | None = None,
) -> ToyBundle:
    """Load the toy model as a ``VideoDiTBundle`` with VSA2 per ``vsa2``.

    ``dtype`` is a torch dtype or "auto" (bf16 on CUDA, fp32 on CPU); the text encoder stays fp32.

    ``path`` None: the shipped ``assets/toy`` checkpoint, else ``~/.cache/vsa2_rl/toy``, built
    there with :func:`build_toy_model` (a few minutes on CPU) if missing. With
    ``vsa2.enabled = False`` the checkpoint's VSA2 parameters are not used (plain dense model).
    """
    if path is None:
        path = ASSET_DIR if (ASSET_DIR / WEIGHTS_FILE).exists() else CACHE_DIR
        if not (Path(path) / WEIGHTS_FILE).exists():
            build_toy_model(path)
    path = Path(path)
    if not (path / WEIGHTS_FILE).exists() or not (path / CONFIG_FILE).exists():
        raise ValueError(
            f"model.path={str(path)!r} has no toy checkpoint ({WEIGHTS_FILE} + {CONFIG_FILE}); "
            "leave model.path empty for the shipped toy model or run scripts/build_toy_model.py"
        )
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    config = json.loads((path / CONFIG_FILE).read_text())
    tensors = load_file(str(path / WEIGHTS_FILE))
    transformer = make_toy_transformer(config["transformer"])
    state = SparsityState()
    transformer_state = _split(tensors, "transformer.")
    base_state = {k: v for k, v in transformer_state.items() if ".vsa2." not in k}
    transformer.load_state_dict(base_state)
    if vsa2.enabled:
        enable_vsa2(transformer, vsa2, state)
        if len(base_state) < len(transformer_state):
            transformer.load_state_dict(transformer_state)
    tokenizer, text_encoder = make_toy_text_encoder(config["text_encoder"])
    text_encoder.load_state_dict(_split(tensors, "text_encoder."))
    text_encoder = text_encoder.to(device).eval().requires_grad_(False)
    return ToyBundle(
        transformer=transformer.to(device=device, dtype=dtype),
        sparsity_state=state,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        info=config.get("training", {}),
    )


# --------------------------------------------------------------------------------------------
# Training


@dataclass
class ToyStage:
    """One resolution stage of the progressive training."""

    size: int  # height = width in pixels
    num_frames: int
    steps: int
    batch_size: int
    vsa2: bool  # False = dense attention; True = VSA2 (rebased at the first such stage)
    # VSA2 sparsity per step, drawn uniformly from this range (after the rebasing ramp).
    sparsity_range: tuple[float, float] = (0.0, 0.0)
    lr_scale: float = 1.0  # peak learning rate = ToyBuildConfig.lr * lr_scale


@dataclass
class ToyBuildConfig:
    """Recipe of the shipped toy checkpoint (see the module docstring)."""

    seed: int = 0
    stages: list[ToyStage] = field(
        default_factory=lambda: [
            ToyStage(16, 8, steps=450, batch_size=8, vsa2=False),
            # Gentler learning rate after the switch: the fresh optimizer must not undo stage 0.
            ToyStage(16, 8, 30, 8, vsa2=True, sparsity_range=(0.5, 0.9), lr_scale=0.3),
            # 32 px at the RL training sparsity only: the CPU torch reference of the fine
            # stage gets slow at low sparsity on 2048-token sequences.
            ToyStage(32, 8, 150, 4, vsa2=True, sparsity_range=(0.9, 0.9), lr_scale=0.5),
        ]
    )
    lr: float = 3e-3
    # Noise levels of training samples: "uniform" in (0, 1), or "logit_normal" (SD3).
    sigma_sampling: str = "uniform"
    adaln_zero: bool = True  # start from DiT's adaLN-Zero init (see adaln_zero_init)
    warmup_lr_steps: int = 20
    target_sparsity: float = 0.9
    rebase_steps: int = 30  # density 1 -> 1 - target_sparsity at the first VSA2 stage's start
    vsa2: VSA2Config = field(default_factory=lambda: VSA2Config(backend="torch"))
    val_videos: int = 16
    eval_sparsities: tuple[float, ...] = (0.0, 0.5, 0.75, 0.9)


def flow_matching_loss(
    transformer: nn.Module,
    latents: torch.Tensor,
    text_emb: torch.Tensor,
    sigma: torch.Tensor,
    noise: torch.Tensor,
) -> torch.Tensor:
    """MSE between predicted and true velocity (noise - data) at noise levels ``sigma`` [B]."""
    s = sigma.view(-1, 1, 1, 1, 1)
    noisy = (1.0 - s) * latents + s * noise
    pred = toy_velocity(transformer, noisy, sigma, text_emb)
    return (pred - (noise - latents)).pow(2).mean()


def _validation_set(config: ToyBuildConfig, stage: ToyStage):
    generator = torch.Generator().manual_seed(config.seed + 10_000)
    specs = random_specs(config.val_videos, generator)
    seeds = torch.randint(1 << 30, (config.val_videos,), generator=generator).tolist()
    videos = render_batch(specs, seeds, stage.num_frames, stage.size, stage.size)
    latents = pixels_to_latents(videos)
    noise = torch.randn(latents.shape, generator=generator)
    # Evenly spread noise levels so the loss covers the whole trajectory.
    sigma = (torch.arange(config.val_videos) + 0.5) / config.val_videos
    return [s.prompt for s in specs], latents, noise, sigma


@torch.no_grad()
def validation_losses(
    transformer: nn.Module,
    text_encoder: ToyTextEncoder,
    tokenizer: WordTokenizer,
    state: SparsityState | None,
    config: ToyBuildConfig,
    stage: ToyStage,
) -> dict[str, float]:
    """Flow-matching loss on a fixed validation batch, dense and (if enabled) per sparsity."""
    prompts, latents, noise, sigma = _validation_set(config, stage)
    text_emb = text_encoder(*tokenizer(prompts))
    if state is None:
        return {"dense": flow_matching_loss(transformer, latents, text_emb, sigma, noise).item()}
    losses = {}
    saved = state.sparsity
    for sparsity in config.eval_sparsities:
        state.sparsity = sparsity
        loss = flow_matching_loss(transformer, latents, text_emb, sigma, noise).item()
        losses[f"vsa2@{sparsity}"] = loss
        losses[f"density@{sparsity}"] = state.pop_density()
    state.sparsity = saved
    return losses


def build_toy_model(
    out_dir: str | Path,
    config: ToyBuildConfig | None = None,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Train the toy model per ``config`` and save it to ``out_dir``; returns the training info.

    ``log`` receives progress lines (default: print, flushed).
    """
    log = log or functools.partial(print, flush=True)
    config = config or ToyBuildConfig()
    torch.manual_seed(config.seed)
    generator = torch.Generator().manual_seed(config.seed)
    transformer = make_toy_transformer()
    if config.adaln_zero:
        adaln_zero_init(transformer)
    tokenizer, text_encoder = make_toy_text_encoder()
    state: SparsityState | None = None
    info: dict = {"recipe": asdict(config), "stages": []}
    start = time.time()
    for index, stage in enumerate(config.stages):
        schedule = None
        if stage.vsa2 and state is None:
            state = SparsityState()
            rebase_to_vsa2(transformer, config.vsa2, state)
            schedule = RebaseSchedule(config.target_sparsity, config.rebase_steps)
            log(f"stage {index}: rebased to VSA2, sparsity 0 -> {config.target_sparsity}")
        params = list(transformer.parameters()) + list(text_encoder.parameters())
        optimizer = torch.optim.AdamW(params, lr=config.lr * stage.lr_scale, weight_decay=0.0)
        warmup = config.warmup_lr_steps

        def lr_factor(step: int, steps: int = stage.steps, warmup: int = warmup) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

        lr_schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
        for step in range(stage.steps):
            if state is not None:
                if schedule is not None and step < schedule.steps:
                    schedule.apply(state, step)
                else:
                    low, high = stage.sparsity_range
                    draw = torch.rand((), generator=generator).item()
                    state.sparsity = low + (high - low) * draw
            specs = random_specs(stage.batch_size, generator)
            seeds = torch.randint(1 << 30, (stage.batch_size,), generator=generator).tolist()
            videos = render_batch(specs, seeds, stage.num_frames, stage.size, stage.size)
            latents = pixels_to_latents(videos)
            noise = torch.randn(latents.shape, generator=generator)
            if config.sigma_sampling == "uniform":
                sigma = torch.rand(stage.batch_size, generator=generator)
            else:
                sigma = torch.sigmoid(torch.randn(stage.batch_size, generator=generator))
            text_emb = text_encoder(*tokenizer([s.prompt for s in specs]))
            loss = flow_matching_loss(transformer, latents, text_emb, sigma, noise)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            lr_schedule.step()
            if state is not None:
                state.pop_density()
            if step % 50 == 0 or step == stage.steps - 1:
                sparsity = f" sparsity {state.sparsity:.2f}" if state is not None else ""
                log(
                    f"stage {index} step {step:4d} loss {loss.item():.4f}{sparsity} "
                    f"({time.time() - start:.0f}s)"
                )
        losses = validation_losses(transformer, text_encoder, tokenizer, state, config, stage)
        log(f"stage {index} ({stage.size}px, {stage.num_frames} frames) validation: {losses}")
        info["stages"].append({"stage": asdict(stage), "validation": losses})
    # The dense reference at the final resolution: the same weights without the VSA2 layers.
    final = config.stages[-1]
    dense = make_toy_transformer()
    dense.load_state_dict({k: v for k, v in transformer.state_dict().items() if ".vsa2." not in k})
    info["final_dense_without_vsa2"] = validation_losses(
        dense, text_encoder, tokenizer, None, config, final
    )["dense"]
    info["build_seconds"] = round(time.time() - start, 1)
    log(f"dense attention (VSA2 layers removed): {info['final_dense_without_vsa2']:.4f}")
    save_toy_checkpoint(out_dir, transformer, text_encoder, info)
    log(f"saved to {out_dir} after {info['build_seconds']}s")
    return info
