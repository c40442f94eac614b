"""Build the toy task's base model: progressive flow-matching pretraining and sparse rebasing.

:func:`build_toy_model` trains the toy model (:mod:`vsa2_rl.toy.model`) with rectified-flow
matching (Liu et al. 2022; the velocity is noise - data and the timestep sigma * 1000, as in
Wan2.1) from DiT's adaLN-Zero initialisation (:func:`adaln_zero_init`) on synthetic
moving-shape videos (:mod:`vsa2_rl.toy.data`) whose captions tell the truth (a share of them
dropped to the empty prompt with ``caption_dropout``, for guidance), in stages
(:class:`ToyBuildConfig`), short enough that the base ends with part of the motion skill (it
moves the shape the prompted way in about half of its held-out samples and still learns from
perfect data: :mod:`vsa2_rl.toy.gate`), as a real base has part of what RL is to sharpen:
dense attention at 16x16 px; sparse rebasing to VSA2 (:mod:`vsa2_rl.models.rebase`) with the
sparsity annealed from 0 to the target, then drawn from a range around RL's; finally every
sparsity from dense to 0.9. Each stage ends on the EMA of its weights and is saved, so a build
cut short can be resumed; a build asked to stop (``stop_requested``, e.g. on SIGTERM) also saves
its stage's training state at the next step and continues from that step when built again into
its folder. After each stage the validation flow-matching loss (float32; on CUDA also under the
training's bf16 autocast, ``validation_bf16``) and the detector's figures of ODE samples of the
held-out prompts (:func:`vsa2_rl.toy.report.score_samples`: shape fidelity, motion score, share
of videos with the prompted motion and direction, share of prompts whose samples both follow and
miss the direction, spread within a prompt's group) are logged and kept in the checkpoint's
json; grids of the last stage's samples (the first seed of the first prompts, PNG and GIF) go to
the folder's ``samples/``, one per setting. The shipped ``assets/toy/`` was built on one H100
GPU (``--device cuda``, 114 s); on 2 CPU cores it takes far longer (not measured).

:func:`main` is the command line (``scripts/build_toy_model.py`` runs it)::

    python scripts/build_toy_model.py [--out assets/toy] [--seed 0] [--device cuda]
    python scripts/build_toy_model.py --steps-scale 0.01 --out /tmp/toy   # a quick smoke run
    python scripts/build_toy_model.py --resume-from DIR ...   # continue a build cut short
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from vsa2_rl.attention import SparsityState
from vsa2_rl.config import VSA2Config
from vsa2_rl.eval.media import save_video_grid
from vsa2_rl.models.rebase import RebaseSchedule, rebase_to_vsa2
from vsa2_rl.rl.ema import EMA
from vsa2_rl.toy.data import COLORS, pretraining_batch, render_batch
from vsa2_rl.toy.model import (
    ASSET_DIR,
    CONFIG_FILE,
    WEIGHTS_FILE,
    ToyBundle,
    make_toy_text_encoder,
    make_toy_transformer,
    pixels_to_latents,
    save_toy_checkpoint,
    split_state,
    toy_transformer_config,
    toy_velocity,
)
from vsa2_rl.toy.prompts import toy_prompts
from vsa2_rl.toy.report import draw_samples, score_samples
from vsa2_rl.toy.text import ToyTextEncoder, WordTokenizer

SAMPLES_DIR = "samples"  # under the output folder: the last stage's sample grids
GRID_PROMPTS = 8  # eval prompts per sample grid (their first seed)
# The running build's stop request, which the sample measurements between stages poll too.
_STOP: list[Callable[[], bool]] = [lambda: False]
PARTIAL_FILE = "partial_stage.pt"  # under the output folder: a stopped stage's training state


class BuildStopped(Exception):
    """A build stopped on request between two steps; its stage's state is in ``PARTIAL_FILE``."""


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
            # A quarter of the recipe that learns the whole skill (5,000 / 600 / 400 steps,
            # ramp 300, warm-up 100: direction followed 97% with truthful captions): stopped
            # while the direction words are partly learnt.
            ToyStage(16, 8, steps=1250, batch_size=64, vsa2=False),
            # Sparse rebasing: the ramp to the target sparsity, then a range around RL's;
            # a gentler learning rate so the fresh optimizer does not undo stage 0.
            ToyStage(16, 8, 150, 64, vsa2=True, sparsity_range=(0.5, 0.9), lr_scale=0.3),
            # Every sparsity that RL and evaluation use, from dense (0) to 0.9.
            ToyStage(16, 8, 100, 64, vsa2=True, sparsity_range=(0.0, 0.9), lr_scale=0.1),
        ]
    )
    lr: float = 1e-3
    # Noise levels of training samples: "uniform" in (0, 1), or "logit_normal" (SD3: more of the
    # middle noise levels, where a sample's layout is decided).
    sigma_sampling: str = "logit_normal"
    adaln_zero: bool = True  # start from DiT's adaLN-Zero init (see adaln_zero_init)
    # the input's frame-position channel (see vsa2_rl.toy.model); False = RoPE's relative time only
    frame_positions: bool = True
    warmup_lr_steps: int = 25
    ema_decay: float = 0.999  # each stage ends on the EMA of its weights (DiT's sampling weights)
    # Share of pretraining videos moving opposite to their caption (data.pretraining_batch).
    # 0: captions tell the truth. At 0.5 the base picks a motion's sign by chance and cannot
    # learn it even from perfect data (benchmarks/toy_ceiling.py): no reward can teach it.
    mirrored_captions: float = 0.0
    # Colours whose videos always move as captioned: the base learns to follow direction words
    # for these and not for the others (a skill RL can carry over to every colour).
    faithful_colors: tuple[str, ...] = ()
    # Share of pretraining captions replaced by the empty prompt, so that the base also learns
    # the unconditional velocity that classifier-free guidance needs (sampler.guidance_scale;
    # the empty prompt is sampler.negative_prompt's default). 0: every video keeps its caption,
    # and the build draws the same random numbers as before this setting existed.
    caption_dropout: float = 0.0
    # TOY_TRANSFORMER keys to change (a larger model of the family, e.g. vsa2_rl.toy.testbed)
    architecture: dict = field(default_factory=dict)
    target_sparsity: float = 0.9
    rebase_steps: int = 75  # density 1 -> 1 - target_sparsity at the first VSA2 stage's start
    vsa2: VSA2Config = field(default_factory=lambda: VSA2Config(backend="torch"))
    val_videos: int = 64
    eval_sparsities: tuple[float, ...] = (0.0, 0.5, 0.75, 0.9)
    # Detector figures (score_samples) after each stage: eval prompts x seeds (0: none), ODE
    # steps.
    report_seeds: int = 4
    report_steps: int = 10
    val_every: int = 0  # validation losses every this many steps of a stage (0: at its end only)


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


def drop_captions(prompts: list[str], share: float, generator: torch.Generator) -> list[str]:
    """``prompts`` with each replaced by the empty prompt with probability ``share`` (one
    uniform draw per prompt from ``generator``; none at all when ``share`` is 0)."""
    if share <= 0:
        return prompts
    dropped = torch.rand(len(prompts), generator=generator) < share
    return ["" if drop else prompt for prompt, drop in zip(prompts, dropped.tolist(), strict=True)]


def _validation_set(config: ToyBuildConfig, stage: ToyStage, device) -> tuple:
    """The stage's fixed validation batch: captions, latents, noise and evenly spread sigmas."""
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
    batch: tuple,
    sparsities: tuple[float, ...],
    frame_positions: bool,
) -> dict[str, float]:
    """Flow-matching loss on the validation ``batch`` (:func:`_validation_set`): dense without
    VSA2 layers (``state`` None), else at each of ``sparsities`` with the density kept."""
    device = next(transformer.parameters()).device
    prompts, latents, noise, sigma = batch
    ids, mask = tokenizer(prompts)
    text_emb = text_encoder(ids.to(device), mask.to(device))
    inputs = (latents, text_emb, sigma, noise, frame_positions)
    if state is None:
        return {"dense": flow_matching_loss(transformer, *inputs).item()}
    losses = {}
    for sparsity in sparsities:
        with state.at(sparsity):
            losses[f"vsa2@{sparsity}"] = flow_matching_loss(transformer, *inputs).item()
        losses[f"density@{sparsity}"] = state.pop_density()
    return losses


def _stage_report(
    modules: tuple[nn.Module, ToyTextEncoder, WordTokenizer],
    state: SparsityState | None,
    config: ToyBuildConfig,
    stage: ToyStage,
    samples_dir: Path | None = None,
) -> dict[str, dict[str, float]]:
    """:func:`score_samples` of ODE samples of the held-out eval prompts, dense and at each eval
    sparsity, drawn under bf16 autocast on CUDA (as the training steps run); with
    ``samples_dir``, a grid of the first seed's videos of the first ``GRID_PROMPTS`` prompts per
    setting there (``<label>.png`` / ``.gif``). The running build's stop request, true between
    two settings, raises :class:`BuildStopped` (the stage's trained state is saved already)."""
    transformer, text_encoder, tokenizer = modules
    bundle = ToyBundle(
        transformer,
        state or SparsityState(),
        text_encoder,
        tokenizer,
        frame_positions=config.frame_positions,
    )
    settings = [None] if state is None else list(config.eval_sparsities)
    report: dict[str, dict[str, float]] = {}
    if not config.report_seeds:
        return report
    prompts = toy_prompts("eval")
    for number, sparsity in enumerate(settings):
        if number and _STOP[0]():
            raise BuildStopped(f"stopped while the {stage.size}px stage's samples were measured")
        if state is not None:
            state.sparsity = sparsity
        label = "dense" if sparsity is None else f"vsa2@{sparsity}"
        with torch.autocast("cuda", torch.bfloat16, enabled=bundle.device.type == "cuda"):
            videos = draw_samples(
                bundle,
                prompts,
                seeds_per_prompt=config.report_seeds,
                num_steps=config.report_steps,
                num_frames=stage.num_frames,
                size=stage.size,
            )
        report[label] = score_samples(videos, prompts, config.report_seeds)
        if samples_dir is not None:
            first_seeds = videos[:: config.report_seeds][:GRID_PROMPTS]
            scale = max(1, 64 // stage.size)
            titles = prompts[:GRID_PROMPTS]
            save_video_grid(first_seeds, str(samples_dir / label), titles=titles, scale=scale)
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
    partial: Path,
    stop_requested: Callable[[], bool],
) -> list[dict]:
    """One stage of flow matching (AdamW, warm-up + cosine); ends on the stage's EMA weights.
    Returns the validation curve: every ``config.val_every`` steps, the live weights' loss at
    the target sparsity, under the training's autocast (at the stage's end the loss is measured
    in float32 at every eval sparsity).

    Continues from ``partial`` when it holds this stage's state; when ``stop_requested()`` turns
    true, saves the state there before the next step and raises :class:`BuildStopped`. The
    state after the last step is saved there too, for the caller to delete once the stage's end
    is measured and saved."""
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
    training = {"transformer": transformer, "text_encoder": text_encoder, "optimizer": optimizer,
                "lr_schedule": lr_schedule, "ema": ema}  # fmt: skip
    curve, first_step = [], 0
    checks = _validation_set(config, stage, device) if config.val_every else None
    identity = _stage_identity(index, stage, config)
    if partial.exists():
        first_step, curve = _load_partial(partial, identity, training, generator)
        log(f"stage {index}: continuing at step {first_step} from {partial}")
    start = time.time()
    for step in range(first_step, stage.steps):
        if stop_requested():
            _save_partial(partial, identity, training, generator, step, curve)
            raise BuildStopped(f"stage {index} stopped before step {step}, saved to {partial}")
        if state is not None:
            if schedule is not None and step < schedule.steps:
                schedule.apply(state, step)
            else:
                low, high = stage.sparsity_range
                state.sparsity = low + (high - low) * torch.rand((), generator=generator).item()
        prompts, latents = _training_videos(config, stage, stage.batch_size, generator, device)
        noise = torch.randn(latents.shape, generator=generator).to(device)
        sigma = _draw_sigma(config, stage.batch_size, generator).to(device)
        ids, mask = tokenizer(drop_captions(prompts, config.caption_dropout, generator))
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
        if config.val_every and (step + 1) % config.val_every == 0:
            curve.append(_curve_point(modules, state, checks, config, step + 1))
        if step % 250 == 0 or step == stage.steps - 1:
            sparsity = f" sparsity {state.sparsity:.2f}" if state is not None else ""
            log(
                f"stage {index} step {step:5d} loss {loss.item():.4f}{sparsity} "
                f"({time.time() - start:.0f}s)"
            )
    # kept until the stage's end is measured and saved: a build killed meanwhile continues here
    _save_partial(partial, identity, training, generator, stage.steps, curve)
    ema.copy_to_params()
    return curve


def _curve_point(
    modules: tuple[nn.Module, ToyTextEncoder, WordTokenizer],
    state: SparsityState | None,
    checks: tuple,
    config: ToyBuildConfig,
    step: int,
) -> dict:
    """The validation curve's point after ``step`` steps: the loss on ``checks`` at the target
    sparsity (dense before VSA2), under bf16 autocast on CUDA as the training steps run."""
    transformer, text_encoder, tokenizer = modules
    sparsity = state.sparsity if state is not None else 0.0
    cuda = next(transformer.parameters()).device.type == "cuda"
    with torch.autocast("cuda", torch.bfloat16, enabled=cuda):
        losses = validation_losses(transformer, text_encoder, tokenizer, state, checks,
                                   (config.target_sparsity,), config.frame_positions)  # fmt: skip
    return {"step": step, "sparsity": sparsity, **losses}


def _stage_identity(index: int, stage: ToyStage, config: ToyBuildConfig) -> dict:
    """What a stage's saved state must match to be continued: the stage and its recipe."""
    identity = {"index": index, "stage": asdict(stage), "recipe": asdict(config)}
    return json.loads(json.dumps(identity))


def _save_partial(
    path: Path, identity: dict, training: dict, generator: torch.Generator, step: int, curve: list
) -> None:
    """The state of the stage ``identity`` (:func:`_stage_identity`) before ``step`` (weights,
    optimizer, schedule, EMA, random generators, validation curve) in ``path``, written whole or
    not at all."""
    state = {name: part.state_dict() for name, part in training.items()}
    state.update(
        identity=identity,
        step=step,
        curve=curve,
        generator=generator.get_state(),
        torch_rng=torch.get_rng_state(),
        cuda_rng=torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    written = path.with_suffix(".tmp")
    torch.save(state, written)
    os.replace(written, path)


def read_partial(path: Path) -> dict:
    """The saved state of a stopped stage (:func:`_save_partial`); ValueError naming ``path``
    where it is garbled, cut short or not such a state."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # pickle, zip and EOF errors of a damaged file
        first = (str(error).strip().splitlines() or [""])[0]
        raise ValueError(
            f"{path}: not a readable partial stage ({type(error).__name__}: {first}); delete it "
            "to build that stage from its start"
        ) from None
    identity = state.get("identity") if isinstance(state, dict) else None
    if not isinstance(identity, dict) or not {"index", "stage", "recipe"} <= set(identity):
        raise ValueError(
            f"{path}: not a partial stage of a toy build; delete it to build that stage from "
            "its start"
        )
    return state


def _finished_stages(folder: Path) -> list[dict]:
    """The stages a built (or partly built) toy folder's ``config.json`` records as finished."""
    try:
        saved = json.loads((folder / CONFIG_FILE).read_text())["training"]
        return [entry["stage"] for entry in saved["stages"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"{folder / CONFIG_FILE}: not a toy build's record ({type(error).__name__}: {error})"
        ) from None


def check_resumable(out: Path, config: ToyBuildConfig, resume_from: Path | None) -> None:
    """Before any work: ValueError where ``resume_from``'s finished stages are not ``config``'s
    first stages, or where ``out``'s partial stage is unreadable or of another recipe."""
    if resume_from is not None:
        done = _finished_stages(resume_from)
        expected = json.loads(json.dumps([asdict(s) for s in config.stages[: len(done)]]))
        if not done or done != expected:
            raise ValueError(
                f"{resume_from}: its finished stages are not the first stages of this recipe "
                f"({len(done)} done); resume with the options it was built with, or choose "
                "another --out"
            )
    partial = out / PARTIAL_FILE
    if partial.is_file():
        saved = read_partial(partial)["identity"]
        index = saved["index"]
        mine = index < len(config.stages) and _stage_identity(index, config.stages[index], config)
        if saved != mine:
            raise ValueError(
                f"{partial} holds stage {index} of another recipe; resume with the options "
                "that wrote it, or delete it to build that stage from its start"
            )


def _load_partial(
    path: Path, identity: dict, training: dict, generator: torch.Generator
) -> tuple[int, list[dict]]:
    """Restores :func:`_save_partial`'s state of the stage ``identity`` into ``training`` and
    ``generator``; returns the step to continue at and the validation curve so far."""
    state = read_partial(path)
    if state["identity"] != identity:
        saved = state["identity"]
        raise ValueError(
            f"{path} holds the state of another stage or recipe (stage {saved['index']} of "
            f"{saved['recipe']['stages']}); delete it to build stage {identity['index']} from "
            "its start, or build with the recipe that wrote it"
        )
    for name, part in training.items():
        part.load_state_dict(state[name])
    generator.set_state(state["generator"])
    torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"] is not None:
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return state["step"], state["curve"]


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
    transformer.load_state_dict(split_state(tensors, "transformer."))
    text_encoder.load_state_dict(split_state(tensors, "text_encoder."))
    info = {"recipe": asdict(config), "stages": saved["stages"]}
    info["resumed_after_seconds"] = saved.get("build_seconds", saved.get("resumed_after_seconds"))
    return info, state


def build_toy_model(
    out_dir: str | Path,
    config: ToyBuildConfig | None = None,
    log: Callable[[str], None] | None = None,
    device: torch.device | str = "cpu",
    resume_from: str | Path | None = None,
    stop_requested: Callable[[], bool] = lambda: False,
) -> dict:
    """Train the toy model per ``config`` on ``device`` and save it to ``out_dir`` (after every
    stage); returns the training info (per stage: validation losses and the detector's report).

    Stage i draws its data and initialises what it adds from seed ``config.seed + 1000 * i``, so
    ``resume_from`` (a folder this function wrote, with the first stages of ``config`` done)
    continues as the uninterrupted build would. Checked between steps, ``stop_requested()``
    true saves the stage's state to ``out_dir/PARTIAL_FILE`` and raises :class:`BuildStopped`;
    the next build into ``out_dir`` (resumed from its last finished stage) continues from it
    as the uninterrupted build would, as it does after a build killed while a stage's end was
    measured. ``log`` receives progress lines (default: print,
    flushed). Weights train in float32 (bf16 autocast and TF32 products on CUDA).
    """
    _STOP[0] = stop_requested  # polled between the sample measurements' settings too
    try:
        return _run_build(out_dir, config, log, device, resume_from, stop_requested)
    finally:
        _STOP[0] = lambda: False


def _run_build(
    out_dir: str | Path,
    config: ToyBuildConfig | None = None,
    log: Callable[[str], None] | None = None,
    device: torch.device | str = "cpu",
    resume_from: str | Path | None = None,
    stop_requested: Callable[[], bool] = lambda: False,
) -> dict:
    """:func:`build_toy_model`'s work."""
    log = log or functools.partial(print, flush=True)
    config = config or ToyBuildConfig()
    device = torch.device(device)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    if device.type == "cuda":  # the peak reported is this build's, not an earlier one's
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(config.seed)
    architecture = toy_transformer_config(config.frame_positions, config.architecture)
    transformer = make_toy_transformer(architecture)
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
    partial = Path(out_dir) / PARTIAL_FILE
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
        curve = _train_stage(index, stage, modules, state, schedule, config, generator, log,
                             partial, stop_requested)  # fmt: skip
        transformer.eval()
        measured = time.time()
        checks = _validation_set(config, stage, device)
        losses = validation_losses(transformer, text_encoder, tokenizer, state, checks,
                                   config.eval_sparsities, config.frame_positions)  # fmt: skip
        log(f"stage {index} ({stage.size}px, {stage.num_frames} frames) validation: {losses} "
            f"({time.time() - measured:.0f}s)")  # fmt: skip
        entry = {"stage": asdict(stage), "validation": losses}
        if device.type == "cuda":  # under the training's autocast: its kernels (bf16 on Hopper)
            with torch.autocast("cuda", torch.bfloat16):
                entry["validation_bf16"] = validation_losses(
                    transformer, text_encoder, tokenizer, state, checks,
                    config.eval_sparsities, config.frame_positions,
                )  # fmt: skip
            log(f"stage {index} validation under bf16 autocast: {entry['validation_bf16']}")
        last = index == len(config.stages) - 1
        samples_dir = Path(out_dir) / SAMPLES_DIR if last else None
        measured = time.time()
        report = _stage_report(modules, state, config, stage, samples_dir)
        transformer.train()
        log(f"stage {index} samples (eval prompts, ODE): {json.dumps(report)} "
            f"({time.time() - measured:.0f}s)")  # fmt: skip
        entry["samples"] = report
        info["stages"].append({**entry, "curve": curve} if config.val_every else entry)
        info["build_seconds"] = round(time.time() - start, 1)
        save_toy_checkpoint(out_dir, transformer, text_encoder, info)  # kept if a later stage dies
        partial.unlink(missing_ok=True)
    # The dense reference at the final resolution: the same weights without the VSA2 layers.
    final = config.stages[-1]
    dense = make_toy_transformer(architecture).to(device).eval()
    dense.load_state_dict({k: v for k, v in transformer.state_dict().items() if ".vsa2." not in k})
    checks = _validation_set(config, final, device)
    info["final_dense_without_vsa2"] = validation_losses(
        dense, text_encoder, tokenizer, None, checks, (), config.frame_positions
    )["dense"]
    info["final_dense_samples"] = _stage_report(
        (dense, text_encoder, tokenizer), None, config, final
    )
    info["build_seconds"] = round(time.time() - start, 1)
    info["build_device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if device.type == "cuda":  # of this build (a resumed build: of its last part)
        info["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    log(f"dense attention (VSA2 layers removed): {info['final_dense_without_vsa2']:.4f}")
    log(f"dense samples: {json.dumps(info['final_dense_samples'])}")
    save_toy_checkpoint(out_dir, transformer, text_encoder, info)
    peak = f", peak GPU memory {info['peak_gpu_gib']} GiB" if "peak_gpu_gib" in info else ""
    log(f"saved to {out_dir} after {info['build_seconds']}s{peak}")
    return info


# --------------------------------------------------------------------------------------------
# Command line


def device_arg(text: str) -> str:
    """argparse type of ``--device``: ``cpu``, or ``cuda[:N]`` of a GPU this machine has."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; use cpu or cuda[:N]") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: use cpu or cuda[:N]")
    count = torch.cuda.device_count() if device.type == "cuda" else 1
    if device.type == "cuda" and (device.index or 0) >= count:
        raise argparse.ArgumentTypeError(
            f"{text!r}: this machine has {count} CUDA device(s); use cpu or cuda:0..{count - 1}"
            if count
            else f"{text!r}: this machine has no CUDA device; use cpu"
        )
    return text


def int_at_least(low: int) -> Callable[[str], int]:
    """argparse type: a whole number >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def number_in(low: float, high: float, *, high_open: bool = False) -> Callable[[str], float]:
    """argparse type: a number in [low, high] (``high_open``: [low, high)); ``high`` inf: any
    finite number >= ``low`` (> ``low`` where ``high_open`` and ``low`` is 0)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        upper_ok = value < high if high_open else value <= high
        if not (math.isfinite(value) and value >= low and upper_ok):
            closing = ")" if high_open else "]"
            raise argparse.ArgumentTypeError(f"must be in [{low:g}, {high:g}{closing}, got {text}")
        return value

    return parse


def positive_number(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = number_in(0.0, math.inf, high_open=True)(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


SPARSITY = number_in(0.0, 1.0, high_open=True)
BACKENDS = ("auto", "triton", "torch")  # VSA2 kernels (VSA2Config.backend)
SHARE = number_in(0.0, 1.0)


def out_folder(text: str) -> Path:
    """argparse type of ``--out``: a folder, or a path one can be made at (no file on the way)."""
    path = Path(text).expanduser()
    for part in (path, *path.parents):
        if part.exists():
            if not part.is_dir():
                what = "is a file" if part == path else f"lies under the file {part}"
                raise argparse.ArgumentTypeError(f"{text}: {what}; choose a folder")
            if not os.access(part, os.W_OK | os.X_OK):
                raise argparse.ArgumentTypeError(f"{text}: {part} is not writable")
            return path
    return path


def _table(info: dict) -> str:
    """Markdown: per stage, the validation loss and the detector's figures per attention."""
    rows = ["| stage | attention | val. loss | shape fidelity | motion score | motion match "
            "| direction match | direction mixed | group sd |",
            "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    stages = [(str(i), s["validation"], s["samples"]) for i, s in enumerate(info["stages"])]
    final = {"dense": info["final_dense_without_vsa2"]}
    stages.append(("final, VSA2 layers removed", final, info["final_dense_samples"]))
    for name, losses, samples in stages:
        for attention, figures in samples.items():
            loss = losses.get(attention, losses.get("dense", float("nan")))
            rows.append(
                f"| {name} | {attention} | {loss:.4f} | {figures['shape_fidelity']:.3f} | "
                f"{figures['prompt_motion']:.3f} | {figures['motion_match']:.3f} | "
                f"{figures['direction_match']:.3f} | {figures['direction_mixed']:.3f} | "
                f"{figures['group_std']:.3f} |"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    """The build's command line (module docstring): train, then print the per-stage table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=out_folder, default=ASSET_DIR, help="output folder")
    parser.add_argument("--seed", type=int_at_least(0), default=0, help="training seed")
    parser.add_argument("--device", type=device_arg, default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--threads", type=int_at_least(1), default=2, help="torch CPU threads")
    parser.add_argument(
        "--resume-from",
        type=Path,
        default=None,
        help="a partial build's folder (its first stages done): continue with the next stage",
    )
    parser.add_argument(
        "--steps-scale",
        type=positive_number,
        default=1.0,
        help="multiply every stage's steps (and the rebasing ramp) by this; 1 = the recipe",
    )
    parser.add_argument(
        "--mirrored-captions",
        type=SHARE,
        default=None,
        help="share of pretraining videos moving opposite to their caption (default: recipe's)",
    )
    parser.add_argument(
        "--faithful-colors",
        default=None,
        help="comma-separated colours whose videos always move as captioned (default: none)",
    )
    parser.add_argument(
        "--caption-dropout",
        type=SHARE,
        default=0.0,
        help="share of pretraining captions replaced by the empty prompt, for guidance "
        "(default: 0, the shipped base's recipe)",
    )
    parser.add_argument(
        "--size",
        type=int_at_least(1),
        default=None,
        help="frame height = width of every stage (px)",
    )
    parser.add_argument(
        "--no-frame-positions",
        action="store_true",
        help="ablation: no frame-position input channel (time only from the relative RoPE)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = ToyBuildConfig(
        seed=args.seed,
        frame_positions=not args.no_frame_positions,
        caption_dropout=args.caption_dropout,
    )
    if args.mirrored_captions is not None:
        config.mirrored_captions = args.mirrored_captions
    if args.faithful_colors:
        config.faithful_colors = tuple(args.faithful_colors.split(","))
        unknown = sorted(set(config.faithful_colors) - set(COLORS))
        if unknown:
            parser.error(f"--faithful-colors: unknown {unknown}; known: {','.join(COLORS)}")
    if args.size is not None:
        config.stages = [dataclasses.replace(s, size=args.size) for s in config.stages]
    if args.steps_scale != 1.0:

        def scaled(steps: int) -> int:
            return max(1, round(steps * args.steps_scale))

        config.stages = [dataclasses.replace(s, steps=scaled(s.steps)) for s in config.stages]
        config.rebase_steps = scaled(config.rebase_steps)
        config.warmup_lr_steps = scaled(config.warmup_lr_steps)
    try:
        check_resumable(args.out, config, args.resume_from)
    except ValueError as error:
        parser.error(f"--resume-from/--out: {error}")
    info = build_toy_model(args.out, config, device=args.device, resume_from=args.resume_from)
    print(_table(info))
    print(json.dumps({"build_seconds": info["build_seconds"], "device": info["build_device"]}))


if __name__ == "__main__":
    main()
