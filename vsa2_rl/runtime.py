"""Run-time plumbing shared by training and evaluation: the model bundle (toy or local Wan
directory) with VSA2 attached, the trained weights (LoRA adapters, a checkpoint's state), the
prompt sets and the output-folder checks. Device and dtype resolution lives in
:mod:`vsa2_rl.device`, below the model loaders, and is re-exported here."""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING

import torch

from vsa2_rl.config import ConfigError, ModelConfig, RunConfig
from vsa2_rl.data.prompts import PromptRecord, read_prompt_records

# resolved in vsa2_rl.device, below the model loaders; the trainer and users import them here
from vsa2_rl.device import resolve_device as resolve_device
from vsa2_rl.device import resolve_dtype as resolve_dtype
from vsa2_rl.device import resolve_reward_device as resolve_reward_device
from vsa2_rl.toy.prompts import toy_prompts

if TYPE_CHECKING:
    from vsa2_rl.preflight import ModelFacts

# the file names of an exported adapter folder (vsa2_rl.export writes it, model.lora.init_from
# reads it back)
ADAPTER_WEIGHTS = "adapter_model.safetensors"
VSA2_WEIGHTS = "vsa2.safetensors"


def _checkpoint_holding(folder: str) -> str | None:
    """The checkpoint, or the checkpoints folder of a run, that ``folder`` would lie in."""
    from vsa2_rl.rl.checkpoint import COMPLETE_MARKER
    from vsa2_rl.rl.run_folder import LOCK_FILE

    path = os.path.realpath(folder)
    while True:
        parent = os.path.dirname(path)
        is_run_checkpoints = os.path.basename(path) == "checkpoints" and all(
            os.path.isfile(os.path.join(parent, name)) for name in ("config.yaml", LOCK_FILE)
        )  # a training run's folder holds both
        if is_run_checkpoints or os.path.isfile(os.path.join(path, COMPLETE_MARKER)):
            return path
        if parent == path:
            return None
        path = parent


def check_output_dir(path: str, key: str = "out_dir") -> None:
    """Refuses, before any work, an output folder that cannot be made or written into: a file,
    a dangling symbolic link, a path under a file, one whose nearest existing folder (where
    the rest would be made) this user cannot write into, or one inside a run's checkpoints (a
    file there breaks a checkpoint's checksums, and a resume deletes it with the checkpoint)."""
    holder = _checkpoint_holding(path)
    if holder is not None:
        raise ConfigError(
            f"{key}: {path} lies inside {holder}, a run's checkpoints (writing there would "
            "damage them, and a resume delete it); give a folder outside the run's checkpoints/"
        )
    if os.path.lexists(path) and not os.path.isdir(path):
        what = "a file" if os.path.exists(path) else "a symbolic link to a missing target"
        raise ConfigError(f"{key}: {path} is {what}, not a folder; give a new or existing folder")
    existing = _nearest_existing(path)
    if not os.path.isdir(existing):
        raise ConfigError(
            f"{key}: {path} cannot be made: {existing} is not a folder; give a path outside it"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{key}: {path} cannot be written: no write permission on {existing}; give a "
            "folder you can write into"
        )


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    return path


def build_bundle(
    config: RunConfig, device: torch.device, dtype: torch.dtype, facts: ModelFacts | None = None
):
    """The VideoDiTBundle of ``config.model`` (docs/concepts.md), VSA2 per ``config.attention``;
    a video size the model cannot make (``bundle.latent_shape``) is a config error. ``facts``:
    the model folder's, where the caller read them already (else the loader reads them)."""
    model: ModelConfig = config.model
    if model.allow_tf32 and device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    from vsa2_rl.models.family import family_of

    bundle = family_of(model.kind).load_bundle(config, device, dtype, facts)
    try:
        bundle.latent_shape(model.num_frames, model.height, model.width)
    except ValueError as error:
        raise ConfigError(f"model.num_frames / model.height / model.width: {error}") from None
    return bundle


def read_prompt_file(path: str, key: str) -> list[str]:
    """The prompt texts of a prompt file (:func:`vsa2_rl.data.prompts.read_prompt_records`); an
    empty file is rejected naming ``key``."""
    return [record.text for record in read_prompt_records(path, key)]


def load_prompts(config: RunConfig, split: str = "train") -> list[str]:
    """Training prompts (``prompts.file``) or evaluation prompts (``prompts.eval_file``)."""
    return [record.text for record in load_prompt_records(config, split)]


def load_prompt_records(config: RunConfig, split: str = "train") -> list[PromptRecord]:
    """Training or evaluation prompts with their condition images where a ``.jsonl`` prompt file
    gives them: the evaluation split reads ``prompts.eval_file`` where set, else ``prompts.file``;
    without a file (which only ``model.kind=toy`` may leave out), the toy's built-in prompts."""
    if split == "eval" and config.prompts.eval_file:
        return read_prompt_records(config.prompts.eval_file, "prompts.eval_file")
    if config.prompts.file:
        return read_prompt_records(config.prompts.file, "prompts.file")
    return [PromptRecord(text) for text in toy_prompts(split)]


def prompt_file_key(config: RunConfig, split: str) -> str:
    """The config key of the file ``split``'s prompts come from (for error messages)."""
    return "prompts.eval_file" if split == "eval" and config.prompts.eval_file else "prompts.file"


def image_scheme(config: RunConfig, facts: ModelFacts) -> str | None:
    """How ``config.model`` (whose folder says ``facts``, :func:`vsa2_rl.preflight.model_facts`)
    takes a condition image (``vsa2_rl.models.conditioning``), read from its configuration files
    before any weight loads: None for text-to-video models."""
    if facts.variant is None:
        return None
    from vsa2_rl.models.wan_bundle import read_image_scheme

    return read_image_scheme(config.model.path, facts.variant)


def check_condition_images(scheme: str | None, images: list[str | None], key: str) -> None:
    """Refuses prompts whose condition images the model (taking them by ``scheme``, see
    :func:`image_scheme`) cannot take, or lacks: an image for a text-to-video model, none for
    a model that needs one (``key`` names the prompt file)."""
    given = any(image is not None for image in images)
    if given and scheme is None:
        raise ConfigError(
            f"{key}: its prompts carry condition images but the model (model.path) is "
            "text-to-video; give a plain prompt file or an image-to-video model"
        )
    if not given and scheme == "channels":
        raise ConfigError(
            f"{key}: the model (model.path) is image-to-video and needs an image per prompt: "
            'give a .jsonl prompt file with {"prompt": ..., "image": ...} lines'
        )


def trainable_parameters(transformer: torch.nn.Module, config: RunConfig) -> list:
    """Marks what RL trains and returns it: with ``model.lora.enabled`` LoRA adapters (peft,
    added here) plus the VSA2 router/gate parameters; otherwise every weight. Only the experts
    ``model.train_experts`` names train in a two-expert model."""
    from vsa2_rl.models.experts import trained_modules

    transformer.requires_grad_(False)
    if not config.model.lora.enabled:
        for module in trained_modules(transformer):
            module.requires_grad_(True)
        return [p for p in transformer.parameters() if p.requires_grad]
    from peft import LoraConfig

    # the adapters' random start, a function of the run's seed: the same on every rank (FSDP2
    # shards it as it is, where DDP would broadcast rank 0's) and in every run
    device = next(transformer.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(config.seed)  # the generator of the device the adapters are made on
        for module in trained_modules(transformer):
            module.add_adapter(
                LoraConfig(
                    r=config.model.lora.rank,
                    lora_alpha=config.model.lora.alpha,
                    target_modules=list(config.model.lora.target_modules),
                )
            )
    if config.model.lora.init_from:
        _load_adapters(transformer, config)
    for module in trained_modules(transformer):
        for name, parameter in module.named_parameters():
            if "lora_" in name or ".vsa2." in name:
                parameter.requires_grad_(True)
    return [p for p in transformer.parameters() if p.requires_grad]


def _load_adapters(transformer: torch.nn.Module, config: RunConfig) -> None:
    """Starts the run's adapters from ``model.lora.init_from``: a peft adapter folder, or for
    two experts one per expert (``transformer/``, ``transformer_2/``, as exported)."""
    from vsa2_rl.models.experts import EXPERT_FOLDERS, WanExperts

    model = getattr(transformer, "module", transformer)
    if not isinstance(model, WanExperts):
        _load_adapter(model, config.model.lora.init_from, config)
        return
    for name in model.train_experts:
        folder = os.path.join(config.model.lora.init_from, EXPERT_FOLDERS[name])
        if not os.path.isfile(os.path.join(folder, "adapter_config.json")):
            raise ConfigError(
                f"model.lora.init_from: {folder} holds no adapter for the {name} expert; give "
                "a two-expert export (transformer/ and transformer_2/ adapter folders)"
            )
        _load_adapter(getattr(model, name), folder, config)


def _load_adapter(transformer: torch.nn.Module, folder: str, config: RunConfig) -> None:
    """Loads the peft adapter in ``folder`` (whose shape must be the run's) into
    ``transformer``'s adapters."""
    from peft import LoraConfig
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    lora = config.model.lora
    saved = LoraConfig.from_pretrained(folder)
    ours = {"rank": lora.rank, "alpha": lora.alpha, "target_modules": sorted(lora.target_modules)}
    theirs = {
        "rank": saved.r,
        "alpha": saved.lora_alpha,
        "target_modules": sorted(saved.target_modules),
    }
    for key, value in ours.items():
        if theirs[key] != value:
            raise ConfigError(
                f"model.lora.{key}: {value!r} differs from the adapter in "
                f"model.lora.init_from ({theirs[key]!r}); set it to the adapter's"
            )
    weights = load_file(os.path.join(folder, ADAPTER_WEIGHTS))
    result = set_peft_model_state_dict(transformer, weights)
    if result.unexpected_keys:
        raise ConfigError(
            f"model.lora.init_from: {folder} holds weights this model has no place for "
            f"({result.unexpected_keys[:3]}); was it trained on another model?"
        )
    _load_vsa2(transformer, folder)


def _load_vsa2(transformer: torch.nn.Module, folder: str) -> None:
    """The VSA2 router and gate parameters an export wrote beside its adapter
    (``vsa2.safetensors``), trained with it; a plain peft folder without them leaves the base
    model's, with a warning."""
    from safetensors.torch import load_file

    path = os.path.join(folder, VSA2_WEIGHTS)
    if not os.path.isfile(path):
        warnings.warn(
            f"model.lora.init_from: {folder} has no {VSA2_WEIGHTS}; the VSA2 routers and gates "
            "start from the base model's, only the adapters from the folder",
            stacklevel=2,
        )
        return
    weights = load_file(path)
    state = transformer.state_dict()
    ours = {name: state[name].shape for name in state if ".vsa2." in f".{name}"}
    theirs = {name: value.shape for name, value in weights.items()}
    if theirs != ours:
        odd = sorted(name for name in {*ours, *theirs} if ours.get(name) != theirs.get(name))[:3]
        raise ConfigError(
            f"model.lora.init_from: {path} does not fit this model's VSA2 layers ({odd} differ);"
            " start from an export of a run with these model and attention settings"
        )
    transformer.load_state_dict(weights, strict=False)


def trained_state(transformer: torch.nn.Module, config: RunConfig) -> dict:
    """Weights a checkpoint holds: the trainable ones (LoRA runs) or all those of the trained
    experts (full fine-tuning; a frozen expert is the base model's and is not saved)."""
    from vsa2_rl.models.experts import trained_prefixes

    state = transformer.state_dict()
    if not config.model.lora.enabled:
        prefixes = trained_prefixes(transformer)
        return {k: v for k, v in state.items() if k.startswith(prefixes)}
    names = {n for n, p in transformer.named_parameters() if p.requires_grad}
    return {k: v for k, v in state.items() if k in names}


def load_trained_state(model: torch.nn.Module, weights: dict, config: RunConfig, source: str):
    """Loads a checkpoint's weights into ``model`` (structured as in its run: LoRA adapters
    added by :func:`trainable_parameters` for a LoRA run) and refuses any mismatch: a weight
    the run trains that the checkpoint lacks, or one the model does not have."""
    expected = set(trained_state(model, config))
    missing = sorted(expected - set(weights))
    unexpected = sorted(set(weights) - set(model.state_dict()))
    if missing or unexpected:
        raise ConfigError(
            f"checkpoint: {source} does not match the model of this run (missing "
            f"{missing[:3]}, unexpected {unexpected[:3]}, of {len(missing)} and "
            f"{len(unexpected)}); was it written with other model or model.lora settings?"
        )
    model.load_state_dict(weights, strict=False)  # a LoRA run's checkpoint holds its adapters


def load_model(
    config: RunConfig, device, dtype, checkpoint: str | None = None, use_ema: bool = True
):
    """The bundle of a trained run: base model, LoRA structure if the run used it, and the
    checkpoint's weights (its EMA weights when the run kept an EMA and ``use_ema``)."""
    bundle = build_bundle(config, device, dtype)
    if checkpoint is None:
        return bundle
    from vsa2_rl.rl.checkpoint import load_checkpoint

    trainable_parameters(bundle.transformer, config)
    try:
        restored = load_checkpoint(checkpoint)
    except ValueError as error:
        raise ConfigError(f"checkpoint: {error}") from None
    weights = dict(restored["model"])
    shadow = (restored.get("ema") or {}).get("shadow", {}) if use_ema else {}
    weights.update({name: value for name, value in shadow.items() if name in weights})
    load_trained_state(bundle.transformer, weights, config, checkpoint)
    bundle.transformer.requires_grad_(False)
    return bundle
