"""``vsa2-rl check``: a training config's pre-flight, before tens of gigabytes load.

It reads what a run would read except the weights: the config, the model folder's
``model_index.json`` and configuration files (the transformer is built on PyTorch's ``meta``
device, which holds shapes and no data), the prompt files and their condition images; it builds
every reward and guard (so their weight files load) and checks that ``out_dir`` can be written.
It prints one plan (the model and its experts, what trains, tokens per video, the sparsity
schedule with the key segments each query tile keeps, the videos of a step) and every problem
found, one line each naming the key, instead of stopping at the first.

For Wan models it adds per-GPU memory and minutes a step on one GPU, estimated from the shapes
by :mod:`vsa2_rl.plan` (calibrated against the measured runs of docs/results.md; the toy is not
estimated). A config that does not
load (an unknown key, a wrong type, a contradiction) is one problem: nothing after it can be
checked. ``vsa2-rl train`` runs the same checks, rewards aside (:func:`before_loading`),
before it loads anything; those that need the processes (engines, number of ranks) run when its
processes start. The checks themselves, shared with the trainer, ``eval`` and ``export``, are
:mod:`vsa2_rl.preflight`'s; the model folder's ``model_index.json`` is read once, into its
:class:`~vsa2_rl.preflight.ModelFacts`, which ``vsa2-rl train`` hands on to the trainer.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from vsa2_rl.config import ConfigError, RunConfig, load_config
from vsa2_rl.config.paths import (
    check_model_paths,
    check_out_dir_children,
    check_prompt_path,
    check_resume_path,
)
from vsa2_rl.data.prompts import PromptRecord
from vsa2_rl.preflight import ModelFacts, check_prompt_count, check_second_guidance, model_facts

if TYPE_CHECKING:
    from vsa2_rl.models.wan_bundle import WanVariant

MAX_TOKENS = 2**22  # tokens a video: beyond it a size is a typo (Wan 720p x 81 is 75,600)
TOY_MEMORY_AND_TIME = "not estimated for the toy (make demo: about 5 minutes on 2 CPU cores)"


@dataclass
class Report:
    """The plan (label, text) rows and the problems, each one line naming its key."""

    plan: list[tuple[str, str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    tokens: int = 0  # tokens per video, once the model's shapes are known
    facts: ModelFacts | None = None  # the model folder's, once read (None: unreadable)

    @contextmanager
    def checking(self) -> Iterator[None]:
        """Records a ConfigError raised inside as a problem and carries on after the block."""
        try:
            yield
        except ConfigError as error:
            self.add(str(error))

    def add(self, problem: str) -> None:
        """Lists ``problem`` unless it is listed already (two checks reading one file)."""
        if problem not in self.problems:
            self.problems.append(problem)

    def text(self) -> str:
        width = max((len(label) for label, _ in self.plan), default=0)
        lines = ["plan:"] + [f"  {label:<{width}}  {text}" for label, text in self.plan]
        if not self.problems:
            return "\n".join([*lines, "no problems found"])
        count = len(self.problems)
        problems = [f"  {problem}" for problem in self.problems]
        return "\n".join([*lines, f"{count} problem{'s' * (count > 1)}:", *problems])


def check(path: str | None, overrides: list[str] | None) -> Report:
    """The :class:`Report` of the config file ``path`` with ``overrides`` (see the module)."""
    report = Report()
    try:
        config = load_config(path, overrides, check_files=False)
    except ConfigError as error:
        report.problems.append(str(error))
        return report
    _inspect(config, report, rewards=True)
    return report


def before_loading(config: RunConfig) -> Report:
    """What ``vsa2-rl train`` checks of a loaded config before it loads anything: the problems
    :func:`check` finds, rewards aside (training builds them next, before the model), and the
    model folder's facts, for the trainer to take over."""
    report = Report()
    _inspect(config, report, rewards=False)
    return report


def _inspect(config: RunConfig, report: Report, rewards: bool) -> None:
    _check_paths(config, report)
    if not any(problem.startswith("model.path") for problem in report.problems):
        with report.checking():
            report.facts = model_facts(config)
    if report.facts is not None:
        _plan_model(config, report.facts, report)
        with report.checking():
            check_second_guidance(config, report.facts)
    _plan_schedule(config, report)
    _plan_step(config, report)
    sets = _plan_prompts(config, report)
    if rewards:
        _plan_rewards(config, report, sets)


def _check_paths(config: RunConfig, report: Report) -> None:
    from vsa2_rl.runtime import check_output_dir

    for checked in (check_model_paths, check_resume_path):
        with report.checking():
            checked(config)
    with report.checking():
        check_output_dir(config.out_dir)
        check_out_dir_children(config.out_dir)
    _check_run_start(config, report)


def _check_run_start(config: RunConfig, report: Report) -> None:
    """What the trainer refuses when it starts, by its own checks: a device this machine lacks,
    a fresh run in a folder holding one, a resume whose checkpoint was trained otherwise."""
    from vsa2_rl.device import resolve_device
    from vsa2_rl.rl.setup import refuse_abandoned_run

    with report.checking():
        resolve_device(config.device)
    if not os.path.isdir(config.out_dir):
        return
    with report.checking():
        refuse_abandoned_run(config)
    with report.checking():
        _check_resumed_settings(config)


def _check_resumed_settings(config: RunConfig) -> None:
    """``check_resume`` of the checkpoint ``train.resume`` would continue, with the config it
    records (read alone: the weights stay on disk)."""
    from vsa2_rl.config import check_resume
    from vsa2_rl.rl import checkpoint

    resume = config.train.resume
    if resume == "none" or (resume != "auto" and not os.path.isdir(resume)):
        return  # nothing to resume, or a path check_resume_path refused already
    try:
        path = checkpoint.find_latest(os.path.join(config.out_dir, "checkpoints"))
        path = path if resume == "auto" else Path(resume)
        recorded = checkpoint.recorded_config(path) if path is not None else None
    except ValueError as error:
        raise ConfigError(f"train.resume: {error}") from None
    if path is not None:
        check_resume(checkpoint.trained_with(recorded or {}, path), config, str(path))


# ---- model -----------------------------------------------------------------------------------


def _plan_model(config: RunConfig, facts: ModelFacts, report: Report) -> None:
    """Model, experts, what trains and tokens per video, from the folder's configuration."""
    with report.checking():
        transformer, latent_shape, what = _shapes(config, facts)
        base_params = sum(p.numel() for p in transformer.parameters())  # before any LoRA
        report.plan.append(("model", what))
        trains, trained_params = _trained(transformer, config)
        report.plan.append(("trains", trains))
        _plan_tokens(config, latent_shape, transformer, report)
        if config.model.kind == "toy":
            report.plan.append(("memory, time", TOY_MEMORY_AND_TIME))
        else:
            _plan_estimates(config, transformer, base_params, trained_params, report)


def _shapes(config: RunConfig, facts: ModelFacts):
    """(transformer without weights, the bundle's ``latent_shape``, a description)."""
    if config.model.kind == "hunyuan_video15":
        return _hunyuan_shapes(config)
    if config.model.kind == "minimax_h3":
        return _minimax_shapes(config)
    if config.model.kind == "ltx2":
        return _ltx2_shapes(config)
    if facts.variant is None:
        return _toy_shapes(config)
    return _wan_shapes(config, facts.variant)


def _toy_shapes(config: RunConfig):
    from vsa2_rl.attention import SparsityState
    from vsa2_rl.models.wan import enable_vsa2
    from vsa2_rl.toy.model import ToyBundle, make_toy_transformer, read_toy_config

    architecture = read_toy_config(config.model.path)["transformer"]
    with torch.device("meta"):  # shapes only: no memory, no weights read
        transformer = make_toy_transformer(architecture)
        enable_vsa2(transformer, config.attention, SparsityState())
    shapes = ToyBundle(
        transformer, SparsityState(), None, None, latent_channels=architecture["out_channels"]
    )
    return transformer, shapes.latent_shape, f"toy ({config.model.path or 'shipped'})"


def _wan_shapes(config: RunConfig, variant: WanVariant):
    from diffusers import WanTransformer3DModel

    from vsa2_rl.attention import SparsityState
    from vsa2_rl.models.conditioning import vae_scale_factors
    from vsa2_rl.models.experts import experts_of
    from vsa2_rl.models.wan import enable_vsa2
    from vsa2_rl.models.wan_bundle import (
        WanBundle,
        assemble_experts,
        check_channels,
        missing_component,
        needed_folders,
        read_transformer_config,
        read_vae_config,
    )

    path = config.model.path
    missing = ", ".join(f"{name}/" for name in needed_folders(variant) if not _is_dir(path, name))
    if missing:
        raise missing_component(path, missing, f"has no {missing}.")

    def load(folder: str):
        settings = read_transformer_config(path, folder)
        try:
            with torch.device("meta"):  # shapes only: no memory, no weights read
                model = WanTransformer3DModel.from_config(settings)
        except (ValueError, TypeError, RuntimeError, ZeroDivisionError) as error:
            raise ConfigError(
                f"model.path: {os.path.join(path, folder, 'config.json')} describes no "
                f"transformer diffusers can build ({error}); restore it from the model's download"
            ) from None
        return enable_vsa2(model, config.attention, SparsityState())

    transformer = assemble_experts(path, variant, tuple(config.model.train_experts), load)
    first = experts_of(transformer)[0]
    vae_config = read_vae_config(path)
    check_channels(path, dict(first.config), vae_config)
    shapes = WanBundle(
        transformer=transformer,
        sparsity_state=SparsityState(),
        latent_channels=int(first.config.out_channels),
        vae_scale=vae_scale_factors(vae_config),
    )
    return transformer, shapes.latent_shape, _describe(variant, first, transformer)


def _meta_models(path: str, classes: dict) -> dict:
    """The diffusers models of ``path``'s subfolders (``{folder: class}``) built from their
    config.json on the meta device: shapes only, no memory, no weights read."""
    from vsa2_rl.models.wan_bundle import read_json_object

    models = {}
    for folder, model_class in classes.items():
        file = os.path.join(path, folder, "config.json")
        try:
            with torch.device("meta"):
                models[folder] = model_class.from_config(read_json_object(file))
        except (ValueError, TypeError, RuntimeError, ZeroDivisionError) as error:
            raise ConfigError(
                f"model.path: {file} describes no {folder} diffusers can build ({error}); "
                "restore it from the model's download"
            ) from None
    return models


def _hunyuan_shapes(config: RunConfig):
    from diffusers import AutoencoderKLHunyuanVideo15, HunyuanVideo15Transformer3DModel

    from vsa2_rl.attention import SparsityState
    from vsa2_rl.models.hunyuan_bundle import HunyuanBundle, check_folder
    from vsa2_rl.models.hunyuan_video15 import enable_vsa2

    check_folder(config.model.path)
    models = _meta_models(
        config.model.path,
        {"transformer": HunyuanVideo15Transformer3DModel, "vae": AutoencoderKLHunyuanVideo15},
    )
    transformer = enable_vsa2(models["transformer"], config.attention, SparsityState())
    shapes = HunyuanBundle(
        transformer, SparsityState(), int(transformer.config.out_channels), text_encoder=None,
        tokenizer=None, glyph_encoder=None, glyph_tokenizer=None, vae=models["vae"],
    )  # fmt: skip
    size = _count(_base_count(transformer))
    return transformer, shapes.latent_shape, f"HunyuanVideo-1.5, text-to-video: {size} parameters"


def _minimax_shapes(config: RunConfig):
    from diffusers import AutoencoderKLMiniMaxH3, MiniMaxH3Transformer3DModel

    from vsa2_rl.attention import SparsityState
    from vsa2_rl.models.minimax_bundle import MiniMaxBundle, check_folder
    from vsa2_rl.models.minimax_h3 import enable_vsa2

    check_folder(config.model.path)
    models = _meta_models(
        config.model.path,
        {"transformer": MiniMaxH3Transformer3DModel, "vae": AutoencoderKLMiniMaxH3},
    )
    transformer = enable_vsa2(models["transformer"], config.attention, SparsityState())
    shapes = MiniMaxBundle(
        transformer, SparsityState(), int(transformer.config.in_channels), text_encoder=None,
        tokenizer=None, vae=models["vae"],
    )  # fmt: skip
    size = _count(_base_count(transformer))
    what = f"MiniMax-H3, text-to-video (its soundtrack's rows held as noise): {size} parameters"
    return transformer, shapes.latent_shape, what


def _ltx2_shapes(config: RunConfig):
    from diffusers import AutoencoderKLLTX2Video, LTX2VideoTransformer3DModel

    from vsa2_rl.attention import SparsityState
    from vsa2_rl.models.ltx2 import enable_vsa2
    from vsa2_rl.models.ltx2_bundle import LTX2Bundle, check_folder

    check_folder(config.model.path)
    models = _meta_models(
        config.model.path,
        {"transformer": LTX2VideoTransformer3DModel, "vae": AutoencoderKLLTX2Video},
    )
    transformer = enable_vsa2(models["transformer"], config.attention, SparsityState())
    shapes = LTX2Bundle(
        transformer, SparsityState(), int(transformer.config.in_channels), text_encoder=None,
        tokenizer=None, connectors=None, vae=models["vae"], audio_vae_config={},
        text_widths=(0, 0),
    )  # fmt: skip
    size = _count(_base_count(transformer))
    what = f"LTX-2, text-to-video (its soundtrack's latents held as noise): {size} parameters"
    return transformer, shapes.latent_shape, what


def _is_dir(path: str, name: str) -> bool:
    return os.path.isdir(os.path.join(path, name))


def _describe(variant, first, transformer) -> str:
    """E.g. "Wan2.1, text-to-video: one transformer of 1.42B parameters"."""
    from vsa2_rl.models.experts import experts_of

    family = "Wan2.1"
    if variant.boundary_ratio is not None:
        family = "Wan2.2 A14B"
    elif variant.expand_timesteps:
        family = "Wan2.2 TI2V"
    conditioning = "text-to-video"
    if variant.expand_timesteps:
        conditioning = "text- or image-to-video (image as the first latent frame)"
    elif first.config.in_channels != first.config.out_channels:
        conditioning = "image-to-video (image channels)"
    experts = experts_of(transformer)
    size = _count(sum(_base_count(e) for e in experts) / len(experts))
    if len(experts) == 1:
        return f"{family}, {conditioning}: one transformer of {size} parameters"
    return (
        f"{family}, {conditioning}: 2 experts of {size} parameters, high_noise (transformer/) "
        f"above the boundary {variant.boundary_ratio}, low_noise (transformer_2/) below"
    )


def _base_count(model: torch.nn.Module) -> int:
    """Parameters of the diffusers model itself (without VSA2's)."""
    return sum(p.numel() for name, p in model.named_parameters() if ".vsa2." not in f".{name}")


def _count(count: float) -> str:
    """A parameter count: exact below a million, else in millions or billions."""
    if count >= 1e9:
        return f"{count / 1e9:.2f}B"
    return f"{count / 1e6:.1f}M" if count >= 1e6 else f"{count:,.0f}"


def _trained(transformer: torch.nn.Module, config: RunConfig) -> tuple[str, int]:
    """What RL trains and how many parameters, counted by marking it as training does (LoRA
    adapters added) on the weightless model; adapters to start from are read when training
    starts."""
    from vsa2_rl.models.experts import WanExperts
    from vsa2_rl.runtime import trainable_parameters

    lora = dataclasses.replace(config.model.lora, init_from=None)
    counting = dataclasses.replace(config, model=dataclasses.replace(config.model, lora=lora))
    try:
        with torch.device("meta"):
            params = trainable_parameters(transformer, counting)
    except ValueError as error:  # peft: no module of the model matches
        raise ConfigError(
            f"model.lora.target_modules: {error} Name linear layers of the transformer, e.g. "
            "[to_q,to_k,to_v,to_out.0]"
        ) from None
    named = {id(p): n for n, p in transformer.named_parameters()}
    vsa2 = sum(p.numel() for p in params if ".vsa2." in f".{named[id(p)]}")
    where = ""
    if isinstance(transformer, WanExperts):
        where = f" of {' and '.join(transformer.train_experts)}"
    total = sum(p.numel() for p in params)
    if not config.model.lora.enabled:
        return f"every weight{where} (full fine-tuning): {_count(total)}", total
    return (
        f"LoRA rank {lora.rank}, alpha {lora.alpha:g} on {', '.join(lora.target_modules)}{where}: "
        f"{_count(total - vsa2)}, and the VSA2 router and gates: {_count(vsa2)}"
    ), total


def _plan_tokens(config: RunConfig, latent_shape, transformer, report: Report) -> None:
    from vsa2_rl.attention import TileLayout
    from vsa2_rl.models.experts import token_grid

    model = config.model
    try:
        channels, frames, height, width = latent_shape(model.num_frames, model.height, model.width)
    except ValueError as error:
        raise ConfigError(f"model.num_frames / model.height / model.width: {error}") from None
    grid = token_grid(transformer, (frames, height, width))
    if math.prod(grid) > MAX_TOKENS:  # counted before the layout's index tensors are made
        raise ConfigError(
            f"model.num_frames / model.height / model.width: {math.prod(grid):,} tokens a video "
            f"({'x'.join(map(str, grid))}), more than {MAX_TOKENS:,} (720p x 81 frames of Wan "
            "is 75,600); make the videos smaller"
        )
    layout = TileLayout.from_grid(grid)
    report.plan.append((
        "video",
        f"{model.num_frames} frames of {model.height}x{model.width} -> latents "
        f"{channels}x{frames}x{height}x{width} -> {layout.num_tokens:,} tokens "
        f"({'x'.join(map(str, grid))}), {layout.num_tiles} query tiles of 64",
    ))  # fmt: skip
    report.tokens = layout.num_tokens


def _plan_estimates(
    config: RunConfig, transformer, base_params: int, trained_params: int, report: Report
) -> None:
    """Per-GPU memory and time a step on one GPU (DDP; vsa2_rl.plan says what is counted)."""
    from vsa2_rl.models.experts import experts_of
    from vsa2_rl.models.family import family_of
    from vsa2_rl.plan import (
        H200_GIB,
        ModelShape,
        describe,
        describe_engines,
        memory_gib,
        seconds_per_step,
        smallest_peak,
        step_shape,
    )

    first = experts_of(transformer)[0].config
    hidden = first.num_attention_heads * first.attention_head_dim
    model = ModelShape(
        params=base_params,
        trained_params=trained_params,
        layers=first.num_layers,
        hidden=hidden,
        ffn=_ffn_width(first, hidden),
        text_tokens=family_of(config.model.kind).conditioning_tokens,
    )
    step = step_shape(config, report.tokens)
    memory, time = describe(memory_gib(model, step), seconds_per_step(model, step), step)
    engines, checkpointing = describe_engines(model, step)
    report.plan += [
        ("memory", memory),
        ("engines", engines),
        ("checkpointing", checkpointing),
        ("time", time),
    ]
    least = smallest_peak(model, step)
    if least > H200_GIB:
        raise ConfigError(
            f"model.num_frames / model.height / model.width: a step needs at least {least:,.1f} "
            f"GiB per GPU under every engine on up to 8 GPUs with gradient checkpointing, more "
            f"than any GPU holds (an H200: {H200_GIB} GiB); make the videos smaller, lower "
            "rl.train_batch_size, enable model.lora, or raise parallel.sequence_parallel_size"
        )


def _ffn_width(transformer_config, hidden: int) -> int:
    """The inner width of a block's feed-forward: Wan's and MiniMax-H3's ``ffn_dim``,
    HunyuanVideo-1.5's ``mlp_ratio``, or LTX-2's (diffusers' ``FeedForward`` default, 4 x)."""
    if hasattr(transformer_config, "ffn_dim"):
        return transformer_config.ffn_dim
    return int(hidden * getattr(transformer_config, "mlp_ratio", 4))


# ---- schedule, step, prompts, rewards ---------------------------------------------------------


def _plan_schedule(config: RunConfig, report: Report) -> None:
    from vsa2_rl.kernels.router import max_kv_for
    from vsa2_rl.rl.schedule import SparsitySchedule

    attention, sparsity = config.attention, config.sparsity
    if not attention.enabled:
        report.plan.append(("attention", "dense (attention.enabled=false): no sparsity schedule"))
        return
    segments = -(-report.tokens // attention.kv_block)
    mode = f"top-p {attention.top_p}" if attention.mode == "topp" else "top-k"

    def level(value: float) -> str:
        if 1.0 - value >= attention.dense_threshold:
            return f"{value:g} (dense)"
        if not segments:  # the model's shapes are unknown
            return f"{value:g}"
        return f"{value:g}: at most {max_kv_for(value, segments)} of {segments} key segments"

    schedule = SparsitySchedule.from_config(sparsity, config.train.num_steps)
    last = config.train.num_steps - 1
    steps = sorted({0, min(sparsity.warmup_steps, last), last})
    train = "; ".join(f"step {s} {level(schedule.train_at(s))}" for s in steps)
    if not sparsity.warmup_steps and sparsity.train_end is None:  # constant
        train = f"{level(sparsity.train)} at every step"
    report.plan.append((
        "attention",
        f"VSA2 {mode}, key segments of {attention.kv_block} tokens",
    ))  # fmt: skip
    report.plan.append(("sparsity", f"rollout = train: {train}; eval {level(sparsity.eval)}"))


def _stochastic_steps(sampler) -> str:
    """Which rollout steps are stochastic, as the sampler section says."""
    kind = sampler.kind.upper()
    if sampler.kind == "ode":
        return "ODE"
    if sampler.sde_window_size is not None:
        low, high = sampler.sde_window_range or [0, sampler.num_steps]
        return f"{kind} on {sampler.sde_window_size} steps drawn in [{low}, {high})"
    low, high = sampler.sde_window or [0, sampler.num_steps]
    return f"{kind} on steps [{low}, {high})"


def _plan_step(config: RunConfig, report: Report) -> None:
    rl, sampler = config.rl, config.sampler
    stochastic = _stochastic_steps(sampler)
    report.plan.append((
        "step",
        f"{rl.prompts_per_step} prompts x {rl.group_size} samples = "
        f"{rl.prompts_per_step * rl.group_size} videos of {sampler.num_steps} sampler steps "
        f"({stochastic}, guidance {sampler.guidance_scale:g}); {rl.algorithm}; "
        f"{config.train.num_steps} steps, a checkpoint every {config.train.checkpoint_every}",
    ))  # fmt: skip


def _plan_prompts(config: RunConfig, report: Report) -> dict:
    """The prompts line; returns each split's records (None where unreadable)."""
    from vsa2_rl.runtime import check_condition_images, image_scheme, prompt_file_key

    sets = {split: _prompt_set(config, split, report) for split in ("train", "eval")}
    # what the model takes is read from its model_index.json and transformer/config.json:
    # without them, unknown
    facts = report.facts or ModelFacts(variant=None)
    readable = config.model.kind != "wan" or (
        report.facts is not None and _is_dir(config.model.path, "transformer")
    )
    texts, checked, scheme = [], set(), None
    if readable:  # read once for both prompt sets; unreadable, the images go unchecked
        try:
            scheme = image_scheme(config, facts)
        except ConfigError as error:  # a damaged settings file: the plan named it already
            report.add(str(error))
            readable = False
    for split, records in sets.items():
        if records is None:  # unreadable: a problem already
            continue
        key = prompt_file_key(config, split)
        source = getattr(config.prompts, key.split(".")[1]) or "the toy's built-in prompts"
        images = sum(r.image is not None for r in records)
        texts.append(f"{split} {len(records)} ({source}{f', {images} with images' * bool(images)})")
        if readable and key not in checked:  # evaluation may read the training file
            checked.add(key)
            with report.checking():
                check_condition_images(scheme, [r.image for r in records], key)
    report.plan.append(("prompts", "; ".join(texts) or "none readable"))
    if sets["train"] is not None:
        with report.checking():
            check_prompt_count(config, len(sets["train"]))
    return sets


def _prompt_set(config: RunConfig, split: str, report: Report) -> list[PromptRecord] | None:
    """The records ``split`` trains or evaluates on; None (a problem recorded) if unreadable."""
    from vsa2_rl.runtime import load_prompt_records, prompt_file_key

    with report.checking():
        check_prompt_path(config, prompt_file_key(config, split).split(".")[1])
        return load_prompt_records(config, split)
    return None


def _plan_rewards(config: RunConfig, report: Report, sets: dict) -> None:
    """Builds every reward and guard, and has each read the prompts it will score (rewards the
    training set, guards the evaluation set): one it cannot read fails every step."""
    from vsa2_rl.eval.sweep import build_reward

    for label, key, entries, split in (
        ("rewards", "rewards.functions", config.rewards.functions, "train"),
        ("guards", "eval.guard_rewards", config.eval.guard_rewards, "eval"),
    ):
        built = []
        for index, entry in enumerate(entries):
            with report.checking():
                build_reward(entry, f"{key}[{index}]")
                built.append(entry)
                _check_reward_reads(entry.name, sets[split], f"{key}[{index}]")
        names = [f"{e.name} (weight {e.weight:g})" if label == "rewards" else e.name for e in built]
        failed = len(entries) - len(built)
        text = ", ".join(names) or "none"
        report.plan.append((label, text + f"; {failed} failed to build" * bool(failed)))


def _check_reward_reads(name: str, records: list[PromptRecord] | None, where: str) -> None:
    """ConfigError naming ``where`` when the reward ``name`` cannot read ``records`` (None:
    unreadable, a problem already), by the reward's own reading of prompts and images."""
    from vsa2_rl.rewards.image_consistency import _image_paths
    from vsa2_rl.toy.rewards import parse_prompts

    if records is None:
        return
    readers = {
        "image_consistency": lambda: _image_paths([_metadata(r) for r in records]),
        **dict.fromkeys(
            ("prompt_motion", "prompt_direction", "prompt_speed", "shape_fidelity"),
            lambda: parse_prompts(name, [r.text for r in records]),
        ),
    }
    try:
        readers.get(name, lambda: None)()
    except ValueError as error:  # RewardError is one
        raise ConfigError(
            f"{where} ({name}): cannot score this prompt set (every step would be skipped): "
            f"{error}; give it prompts it reads, or another reward"
        ) from None


def _metadata(record: PromptRecord) -> dict:
    """A sample's metadata as the trainer gives it to rewards (its condition image)."""
    return {"image": record.image} if record.image else {}
