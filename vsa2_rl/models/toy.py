"""Toy video DiT of the embedded default: a tiny WanTransformer3DModel on pixel-space latents.

The model is diffusers' ``WanTransformer3DModel`` at about 0.25 M parameters per block
(4 blocks, width 128, 4 heads of 32) with ``out_channels = 3``: the "latents" are the RGB pixels
mapped to [-1, 1], so decoding is an affine map and no VAE is needed. Prompts go through the
built-in word-level text encoder (:mod:`vsa2_rl.models.text`). The bundle's velocity is the
transformer output plus a fixed linear estimate of the velocity (:func:`linear_velocity`, a skip
preconditioning), so the transformer learns a residual.

The input has one channel more than the latents: the frame's position in the clip, -1 at the
first frame to 1 at the last (:func:`with_frame_positions`), concatenated as Wan's image-to-video
models concatenate their mask channels. Wan's only time signal is its 3D RoPE, which is
relative: a network that sees noise at high noise levels cannot tell the first frame from the
last, so its posterior mean is the same in every frame and which way a shape moves is left to the
sampling noise (measured: the earlier model, trained without this channel, moved "right" shapes
left as often as right). Real Wan latents carry absolute time anyway (the causal VAE's first
latent frame encodes one frame, the others four); the toy's pixels do not, so it gets a channel.

It is trained by :func:`build_toy_model` (``scripts/build_toy_model.py``) with rectified-flow
matching (Liu et al. 2022; the velocity is noise - data and the timestep sigma * 1000, as in
Wan2.1) from DiT's adaLN-Zero initialisation on synthetic moving-shape videos
(:mod:`vsa2_rl.data.synthetic`), half of which move opposite to their caption
(``mirrored_captions``), in stages: dense attention at 16x16 px; sparse rebasing to VSA2
(:mod:`vsa2_rl.models.rebase`) with the sparsity annealed from 0 to the target, then drawn from
the RL range; finally every sparsity from dense to the rollouts'. Each stage ends on the EMA of
its weights; :func:`sample_report` scores what the model draws after each (the toy task's shape
detector on ODE samples of held-out prompts). The checkpoint (safetensors + json with the recipe
and every stage's figures) ships in ``assets/toy/``; :func:`load_toy_bundle` loads it as a
``VideoDiTBundle``.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from vsa2_rl.attention import SparsityState
from vsa2_rl.config import ConfigError, VSA2Config
from vsa2_rl.data.synthetic import pretraining_batch, render_batch
from vsa2_rl.models.rebase import RebaseSchedule, rebase_to_vsa2
from vsa2_rl.models.text import ToyTextEncoder, WordTokenizer, toy_vocabulary
from vsa2_rl.models.wan import enable_vsa2, wan_velocity
from vsa2_rl.rl.ema import EMA
from vsa2_rl.runtime import resolve_dtype

ASSET_DIR = Path(__file__).resolve().parents[2] / "assets" / "toy"
WEIGHTS_FILE = "toy.safetensors"
CONFIG_FILE = "config.json"

TOY_TRANSFORMER = {
    "patch_size": [1, 2, 2],
    "num_attention_heads": 4,
    "attention_head_dim": 32,
    "in_channels": 4,  # RGB + the frame-position channel (with_frame_positions)
    "out_channels": 3,
    "text_dim": 64,
    "freq_dim": 64,
    "ffn_dim": 256,
    "num_layers": 4,
    "rope_max_seq_len": 64,
}
TOY_TEXT = {"dim": 64, "max_length": 8}


def toy_transformer_config(frame_positions: bool = True) -> dict:
    """``TOY_TRANSFORMER``, or its variant without the frame-position input channel."""
    config = dict(TOY_TRANSFORMER)
    config["in_channels"] = config["out_channels"] + int(frame_positions)
    return config


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


def with_frame_positions(latents: torch.Tensor) -> torch.Tensor:
    """Latents [B, C, T, H, W] with a channel appended holding each frame's position in the
    clip, from -1 (first frame) to 1 (last): [B, C + 1, T, H, W]."""
    batch, _, frames, height, width = latents.shape
    positions = torch.linspace(-1.0, 1.0, frames, device=latents.device, dtype=latents.dtype)
    channel = positions.view(1, 1, frames, 1, 1).expand(batch, 1, frames, height, width)
    return torch.cat([latents, channel], dim=1)


def toy_velocity(
    transformer: nn.Module,
    latents: torch.Tensor,
    sigma: torch.Tensor,
    text_emb: torch.Tensor,
    frame_positions: bool = True,
) -> torch.Tensor:
    """Toy model velocity: transformer residual + :func:`linear_velocity`, float32.

    ``frame_positions``: the transformer takes :func:`with_frame_positions`' extra channel
    (models built before it existed do not)."""
    sigma = sigma.reshape(-1).expand(latents.shape[0])
    inputs = with_frame_positions(latents) if frame_positions else latents
    residual = wan_velocity(transformer, inputs, sigma, text_emb)
    return residual + linear_velocity(latents, sigma)


@dataclass
class ToyBundle:
    """The toy model as a ``VideoDiTBundle`` (docs/concepts.md, "The model bundle")."""

    transformer: nn.Module
    sparsity_state: SparsityState
    text_encoder: ToyTextEncoder
    tokenizer: WordTokenizer
    latent_channels: int = 3
    info: dict = field(default_factory=dict)  # training record from the checkpoint's json
    frame_positions: bool = True  # the input carries the frame-position channel

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
        return toy_velocity(self.transformer, latents, sigma, text_emb, self.frame_positions)

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
    architecture = {key: transformer.config[key] for key in TOY_TRANSFORMER}
    architecture["patch_size"] = list(architecture["patch_size"])
    config = {"transformer": architecture, "text_encoder": TOY_TEXT, "training": info}
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

    ``path`` None: the shipped ``assets/toy`` checkpoint of a source checkout. A missing
    checkpoint is an error that says how to build one (minutes on a GPU, hours on a CPU: never
    started silently). With ``vsa2.enabled = False`` the checkpoint's VSA2 parameters are not
    used (plain dense model).
    """
    path = Path(ASSET_DIR if path is None else path)
    if not (path / WEIGHTS_FILE).exists() or not (path / CONFIG_FILE).exists():
        raise ConfigError(
            f"model.path={str(path)!r} has no toy checkpoint ({WEIGHTS_FILE} + {CONFIG_FILE}); "
            "leave model.path empty in a source checkout (assets/toy), point it at a folder "
            "written by scripts/build_toy_model.py, or build one there with "
            "`python scripts/build_toy_model.py --device cuda --out DIR`"
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
    architecture = config["transformer"]
    return ToyBundle(
        transformer=transformer.to(device=device, dtype=dtype),
        sparsity_state=state,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        latent_channels=architecture["out_channels"],
        info=config.get("training", {}),
        frame_positions=architecture["in_channels"] > architecture["out_channels"],
    )


# --------------------------------------------------------------------------------------------
# Training


@dataclass
class ToyStage:
    """One stage of the progressive training."""

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
            ToyStage(16, 8, steps=5000, batch_size=64, vsa2=False),
            # Sparse rebasing: the ramp to the target sparsity, then the RL rollout range;
            # a gentler learning rate so the fresh optimizer does not undo stage 0.
            ToyStage(16, 8, 600, 64, vsa2=True, sparsity_range=(0.5, 0.9), lr_scale=0.3),
            # Every sparsity that RL and evaluation use, from dense (0) to the rollouts' 0.9.
            ToyStage(16, 8, 400, 64, vsa2=True, sparsity_range=(0.0, 0.9), lr_scale=0.1),
        ]
    )
    lr: float = 1e-3
    # Noise levels of training samples: "uniform" in (0, 1), or "logit_normal" (SD3: more of the
    # middle noise levels, where a sample's layout is decided).
    sigma_sampling: str = "logit_normal"
    adaln_zero: bool = True  # start from DiT's adaLN-Zero init (see adaln_zero_init)
    # the input's frame-position channel (module docstring); False = RoPE's relative time only
    frame_positions: bool = True
    warmup_lr_steps: int = 100
    ema_decay: float = 0.999  # each stage ends on the EMA of its weights (DiT's sampling weights)
    # Share of pretraining videos moving opposite to their caption (synthetic.pretraining_batch):
    # the base model knows a motion word's axis but picks its sign by chance, which RL is to fix.
    mirrored_captions: float = 0.5
    # Colours whose videos always move as captioned: the base learns to follow direction words
    # for these and not for the others (a skill RL can carry over to every colour).
    faithful_colors: tuple[str, ...] = ()
    target_sparsity: float = 0.9
    rebase_steps: int = 300  # density 1 -> 1 - target_sparsity at the first VSA2 stage's start
    vsa2: VSA2Config = field(default_factory=lambda: VSA2Config(backend="torch"))
    val_videos: int = 64
    eval_sparsities: tuple[float, ...] = (0.0, 0.5, 0.75, 0.9)
    # Detector figures (sample_report) after each stage: eval prompts x seeds, dense ODE steps.
    report_seeds: int = 4
    report_steps: int = 10


def flow_matching_loss(
    transformer: nn.Module,
    latents: torch.Tensor,
    text_emb: torch.Tensor,
    sigma: torch.Tensor,
    noise: torch.Tensor,
    frame_positions: bool,
) -> torch.Tensor:
    """MSE between predicted and true velocity (noise - data) at noise levels ``sigma`` [B]."""
    s = sigma.view(-1, 1, 1, 1, 1)
    noisy = (1.0 - s) * latents + s * noise
    pred = toy_velocity(transformer, noisy, sigma, text_emb, frame_positions)
    return (pred - (noise - latents)).pow(2).mean()


def _training_videos(
    config: ToyBuildConfig, stage: ToyStage, count: int, generator: torch.Generator, device
) -> tuple[list[str], torch.Tensor]:
    """Captions and latents [B, C, T, H, W] of pretraining videos (with caption noise)."""
    specs, seeds, moves = pretraining_batch(
        count, generator, config.mirrored_captions, config.faithful_colors
    )
    videos = render_batch(specs, seeds, stage.num_frames, stage.size, stage.size, moves, device)
    return [s.prompt for s in specs], pixels_to_latents(videos)


def _validation_set(config: ToyBuildConfig, stage: ToyStage, device):
    generator = torch.Generator().manual_seed(config.seed + 10_000)
    prompts, latents = _training_videos(config, stage, config.val_videos, generator, "cpu")
    latents = latents.to(device)
    noise = torch.randn(latents.shape, generator=generator).to(device)
    # Evenly spread noise levels so the loss covers the whole trajectory.
    sigma = ((torch.arange(config.val_videos) + 0.5) / config.val_videos).to(device)
    return prompts, latents, noise, sigma


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
    device = next(transformer.parameters()).device
    prompts, latents, noise, sigma = _validation_set(config, stage, device)
    ids, mask = tokenizer(prompts)
    text_emb = text_encoder(ids.to(device), mask.to(device))
    inputs = (latents, text_emb, sigma, noise, config.frame_positions)
    if state is None:
        return {"dense": flow_matching_loss(transformer, *inputs).item()}
    losses = {}
    for sparsity in config.eval_sparsities:
        with state.at(sparsity):
            losses[f"vsa2@{sparsity}"] = flow_matching_loss(transformer, *inputs).item()
        losses[f"density@{sparsity}"] = state.pop_density()
    return losses


@torch.no_grad()
def draw_samples(
    bundle: ToyBundle,
    prompts: list[str],
    *,
    seeds_per_prompt: int,
    num_steps: int,
    num_frames: int,
    size: int,
    kind: str = "ode",
    noise_level: float = 0.0,
    sde_window: tuple[int, int] | None = None,
    seed: int = 0,
) -> torch.Tensor:
    """Videos [len(prompts) * seeds_per_prompt, T, 3, H, W] of each prompt repeated
    ``seeds_per_prompt`` times (prompt-major), at the bundle's current sparsity: the ODE by
    default, or the SDE steps of the RL rollouts (``kind``, ``noise_level``, ``sde_window``).
    Video i starts from ``seeded_noise`` of ``seed * len(videos) + i``; the SDE noise is drawn
    from ``seed``."""
    from vsa2_rl.sampling import sample, seeded_noise, sigma_schedule

    repeated = [p for p in prompts for _ in range(seeds_per_prompt)]
    first = seed * len(repeated)
    seeds = list(range(first, first + len(repeated)))
    noise = seeded_noise(bundle.latent_shape(num_frames, size, size), seeds)
    text_emb = bundle.encode_prompts(repeated)
    sigmas = sigma_schedule(num_steps)
    generator = torch.Generator(bundle.device).manual_seed(seed)
    videos = []
    for start in range(0, len(repeated), 64):
        emb = text_emb[start : start + 64]
        trajectory = sample(
            lambda x, sigma, emb=emb: bundle.velocity(x.to(bundle.dtype), sigma, emb),
            noise[start : start + 64].to(bundle.device),
            sigmas,
            kind=kind,
            noise_level=noise_level,
            sde_window=sde_window,
            generator=generator,
        )
        videos.append(bundle.decode(trajectory.latents[-1]).float().cpu())
    return torch.cat(videos)


def score_samples(videos: torch.Tensor, prompts: list[str], seeds_per_prompt: int) -> dict:
    """The toy task's detector figures (:mod:`vsa2_rl.rewards.shapes`) of :func:`draw_samples`'
    videos of ``prompts``.

    ``shape_fidelity``: share of frames with one blob of the prompted colour and about the
    prompted shape's area; ``prompt_motion``: mean motion score; ``motion_match``: share of
    videos whose motion scores >= 0.9 (right direction, about the right speed);
    ``direction_match``: share of videos whose shape moves the prompted way
    (``prompt_direction``); ``direction_mixed``: share of prompts whose videos include both one
    moving the prompted way and one that does not (a group GRPO can learn from);
    ``group_std``: standard deviation of the motion score among a prompt's videos, averaged over
    prompts (the spread GRPO's group advantages feed on).
    """
    from vsa2_rl.rewards import get_reward

    repeated = [p for p in prompts for _ in range(seeds_per_prompt)]
    fidelity = get_reward("shape_fidelity")(videos, repeated)
    motion = get_reward("prompt_motion")(videos, repeated)
    direction = get_reward("prompt_direction")(videos, repeated).view(len(prompts), -1)
    mixed = (direction.amax(dim=1) > 0.5) & (direction.amin(dim=1) < 0.5)
    return {
        "shape_fidelity": fidelity.mean().item(),
        "prompt_motion": motion.mean().item(),
        "motion_match": (motion >= 0.9).float().mean().item(),
        "direction_match": direction.mean().item(),
        "direction_mixed": mixed.float().mean().item(),
        "group_std": motion.view(len(prompts), -1).std(dim=1).mean().item(),
    }


def sample_report(
    bundle: ToyBundle,
    prompts: list[str],
    *,
    seeds_per_prompt: int,
    num_steps: int,
    num_frames: int,
    size: int,
) -> dict[str, float]:
    """:func:`score_samples` of deterministic ODE samples of ``prompts`` x ``seeds_per_prompt``
    at the bundle's current sparsity."""
    videos = draw_samples(
        bundle,
        prompts,
        seeds_per_prompt=seeds_per_prompt,
        num_steps=num_steps,
        num_frames=num_frames,
        size=size,
    )
    return score_samples(videos, prompts, seeds_per_prompt)


def _stage_report(
    transformer: nn.Module,
    text_encoder: ToyTextEncoder,
    tokenizer: WordTokenizer,
    state: SparsityState | None,
    config: ToyBuildConfig,
    stage: ToyStage,
) -> dict[str, dict[str, float]]:
    """:func:`sample_report` on the held-out eval prompts, dense and at each eval sparsity."""
    from vsa2_rl.data.prompts import toy_prompts

    bundle = ToyBundle(
        transformer,
        state or SparsityState(),
        text_encoder,
        tokenizer,
        frame_positions=config.frame_positions,
    )
    settings = [None] if state is None else list(config.eval_sparsities)
    report = {}
    for sparsity in settings:
        if state is not None:
            state.sparsity = sparsity
        label = "dense" if sparsity is None else f"vsa2@{sparsity}"
        report[label] = sample_report(
            bundle,
            toy_prompts("eval"),
            seeds_per_prompt=config.report_seeds,
            num_steps=config.report_steps,
            num_frames=stage.num_frames,
            size=stage.size,
        )
        if state is not None:
            state.pop_density()
    return report


def _draw_sigma(config: ToyBuildConfig, count: int, generator: torch.Generator) -> torch.Tensor:
    if config.sigma_sampling == "uniform":
        return torch.rand(count, generator=generator)
    return torch.sigmoid(torch.randn(count, generator=generator))


def _train_stage(
    index: int,
    stage: ToyStage,
    modules: tuple[nn.Module, ToyTextEncoder, WordTokenizer],
    state: SparsityState | None,
    schedule: RebaseSchedule | None,
    config: ToyBuildConfig,
    generator: torch.Generator,
    log: Callable[[str], None],
) -> None:
    """One stage of flow matching (AdamW, warm-up + cosine); ends on the stage's EMA weights."""
    transformer, text_encoder, tokenizer = modules
    device = next(transformer.parameters()).device
    params = list(transformer.parameters()) + list(text_encoder.parameters())
    optimizer = torch.optim.AdamW(params, lr=config.lr * stage.lr_scale, weight_decay=0.0)
    warmup = config.warmup_lr_steps

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, stage.steps - warmup)))

    lr_schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    ema = EMA(params, config.ema_decay, warmup=True)
    start = time.time()
    for step in range(stage.steps):
        if state is not None:
            if schedule is not None and step < schedule.steps:
                schedule.apply(state, step)
            else:
                low, high = stage.sparsity_range
                state.sparsity = low + (high - low) * torch.rand((), generator=generator).item()
        prompts, latents = _training_videos(config, stage, stage.batch_size, generator, device)
        noise = torch.randn(latents.shape, generator=generator).to(device)
        sigma = _draw_sigma(config, stage.batch_size, generator).to(device)
        ids, mask = tokenizer(prompts)
        text_emb = text_encoder(ids.to(device), mask.to(device))
        # bf16 autocast on CUDA (float32 weights and optimizer); plain float32 on the CPU
        with torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda"):
            loss = flow_matching_loss(
                transformer, latents, text_emb, sigma, noise, config.frame_positions
            )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        lr_schedule.step()
        ema.update()
        if state is not None:
            state.pop_density()
        if step % 250 == 0 or step == stage.steps - 1:
            sparsity = f" sparsity {state.sparsity:.2f}" if state is not None else ""
            log(
                f"stage {index} step {step:5d} loss {loss.item():.4f}{sparsity} "
                f"({time.time() - start:.0f}s)"
            )
    ema.copy_to_params()


def _resume_build(
    path: Path, config: ToyBuildConfig, transformer: nn.Module, text_encoder: ToyTextEncoder
) -> tuple[dict, SparsityState | None]:
    """Weights and info of a partial build in ``path`` whose finished stages are ``config``'s
    first stages; returns (info, sparsity state or None when no VSA2 stage ran yet)."""
    saved = json.loads((path / CONFIG_FILE).read_text())["training"]
    done = [entry["stage"] for entry in saved["stages"]]
    expected = json.loads(json.dumps([asdict(stage) for stage in config.stages[: len(done)]]))
    if not done or done != expected:
        raise ValueError(
            f"resume_from={str(path)!r}: its finished stages {done} are not the first stages "
            f"of this recipe {expected}; build from scratch or use the recipe it was built with"
        )
    state = None
    if any(stage["vsa2"] for stage in done):
        state = SparsityState()
        rebase_to_vsa2(transformer, config.vsa2, state)
    tensors = load_file(str(path / WEIGHTS_FILE))
    transformer.load_state_dict(_split(tensors, "transformer."))
    text_encoder.load_state_dict(_split(tensors, "text_encoder."))
    info = {"recipe": asdict(config), "stages": saved["stages"]}
    info["resumed_after_seconds"] = saved.get("build_seconds", saved.get("resumed_after_seconds"))
    return info, state


def build_toy_model(
    out_dir: str | Path,
    config: ToyBuildConfig | None = None,
    log: Callable[[str], None] | None = None,
    device: torch.device | str = "cpu",
    resume_from: str | Path | None = None,
) -> dict:
    """Train the toy model per ``config`` on ``device`` and save it to ``out_dir`` (after every
    stage); returns the training info (per stage: validation losses and the detector's report).

    Stage i draws its data and initialises what it adds from seed ``config.seed + 1000 * i``, so
    ``resume_from`` (a folder this function wrote, with the first stages of ``config`` done)
    continues as the uninterrupted build would. ``log`` receives progress lines (default: print,
    flushed). Weights train in float32 (bf16 autocast and TF32 products on CUDA).
    """
    log = log or functools.partial(print, flush=True)
    config = config or ToyBuildConfig()
    device = torch.device(device)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(config.seed)
    transformer = make_toy_transformer(toy_transformer_config(config.frame_positions))
    if config.adaln_zero:
        adaln_zero_init(transformer)
    tokenizer, text_encoder = make_toy_text_encoder()
    state: SparsityState | None = None
    info: dict = {"recipe": asdict(config), "stages": []}
    if resume_from is not None:
        info, state = _resume_build(Path(resume_from), config, transformer, text_encoder)
        log(f"resumed from {resume_from} after stage {len(info['stages']) - 1}")
    transformer.to(device)
    text_encoder.to(device)
    start = time.time()
    for index, stage in enumerate(config.stages):
        if index < len(info["stages"]):
            continue
        torch.manual_seed(config.seed + 1000 * index)
        generator = torch.Generator().manual_seed(config.seed + 1000 * index)
        schedule = None
        if stage.vsa2 and state is None:
            state = SparsityState()
            rebase_to_vsa2(transformer, config.vsa2, state)
            transformer.to(device)
            schedule = RebaseSchedule(config.target_sparsity, config.rebase_steps)
            log(f"stage {index}: rebased to VSA2, sparsity 0 -> {config.target_sparsity}")
        modules = (transformer, text_encoder, tokenizer)
        _train_stage(index, stage, modules, state, schedule, config, generator, log)
        transformer.eval()
        losses = validation_losses(transformer, text_encoder, tokenizer, state, config, stage)
        report = _stage_report(transformer, text_encoder, tokenizer, state, config, stage)
        transformer.train()
        log(f"stage {index} ({stage.size}px, {stage.num_frames} frames) validation: {losses}")
        log(f"stage {index} samples (eval prompts, ODE): {json.dumps(report)}")
        info["stages"].append({"stage": asdict(stage), "validation": losses, "samples": report})
        info["build_seconds"] = round(time.time() - start, 1)
        save_toy_checkpoint(out_dir, transformer, text_encoder, info)  # kept if a later stage dies
    # The dense reference at the final resolution: the same weights without the VSA2 layers.
    final = config.stages[-1]
    dense = make_toy_transformer(toy_transformer_config(config.frame_positions)).to(device).eval()
    dense.load_state_dict({k: v for k, v in transformer.state_dict().items() if ".vsa2." not in k})
    info["final_dense_without_vsa2"] = validation_losses(
        dense, text_encoder, tokenizer, None, config, final
    )["dense"]
    info["final_dense_samples"] = _stage_report(dense, text_encoder, tokenizer, None, config, final)
    info["build_seconds"] = round(time.time() - start, 1)
    info["build_device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    log(f"dense attention (VSA2 layers removed): {info['final_dense_without_vsa2']:.4f}")
    log(f"dense samples: {json.dumps(info['final_dense_samples'])}")
    save_toy_checkpoint(out_dir, transformer, text_encoder, info)
    log(f"saved to {out_dir} after {info['build_seconds']}s")
    return info
