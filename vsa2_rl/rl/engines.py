"""What the training loop does differently under DeepSpeed ZeRO and FSDP2 than under DDP / one
process.

accelerate hides most of the difference; what it leaves to the loop is gathered here:

* the update: with DDP the loop accumulates gradients over (chunk, timestep) pairs under
  ``no_sync``, clips, checks that loss and gradient norm are finite on every rank and only then
  steps. Under DeepSpeed the engine owns accumulation, clipping and the step: the loop marks the
  last backward of an update as the accumulation boundary, the engine steps inside it, and the
  bf16 overflow check (``bf16.check_grad_overflow``, switched on here) makes the engine skip the
  step and clear the gradients when any rank's gradient is not finite, so a NaN never reaches
  the weights there either. Under FSDP2 (``fully_shard``) every backward reduce-scatters, so
  that each rank accumulates only its shard of the gradient (``no_sync`` would keep whole
  gradients on every rank); clipping goes through accelerate, which takes the global norm of
  the sharded gradients, and the finite check and the step are DDP's;
* the DeepSpeed config entries a run needs without a dataloader (micro-batch size) and the
  clipping threshold, taken from ``train.max_grad_norm`` so that one key sets it;
* states: under ZeRO-3 and FSDP2 parameters are sharded, so weights are gathered onto the main
  process for checkpoints, every rank takes part in evaluation (its forward gathers them) and
  options that need whole parameters on one rank are refused. DiffusionNFT's old policy and its
  EMA reference are held, soft-updated and swapped in shard by shard under both (FSDP2's
  DTensors, ZeRO-3's partitions; vsa2_rl.rl.nft.OldPolicy), and so is its trust region's scaled
  step under FSDP2 (DeepSpeed refuses ``nft.trust_region``: its master copy would undo it). The
  optimizer state of every rank
  (and the weight shards) is saved and restored with the engine's own files (``accelerate``'s
  ``save_state`` / ``load_state``: DeepSpeed's checkpoint, torch.distributed.checkpoint for
  FSDP2) inside the atomic checkpoint directory;
* launchers: accelerate enables FSDP on GPUs only, and only FSDP2 is supported; a launch that
  asks for it where it cannot be had is refused rather than run as DDP.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from vsa2_rl.config import ConfigError, RunConfig
from vsa2_rl.models.experts import trained_modules
from vsa2_rl.runtime import trained_state

# a checkpoint folder holding an engine's own files of the optimizer and weight shards: its engine
ENGINE_DIRS = {"deepspeed": "DeepSpeed", "fsdp2": "FSDP2"}


def uses_deepspeed(acc) -> bool:
    return getattr(acc.state, "deepspeed_plugin", None) is not None


def uses_fsdp2(acc) -> bool:
    """Whether accelerate runs this process under FSDP2 (its FSDP plugin at ``fsdp_version`` 2)."""
    plugin = getattr(acc.state, "fsdp_plugin", None)
    return plugin is not None and plugin.fsdp_version == 2


def zero_stage(acc) -> int:
    """The DeepSpeed ZeRO stage of this run, 0 when DeepSpeed is not used."""
    return int(acc.state.deepspeed_plugin.zero_stage) if uses_deepspeed(acc) else 0


def shards_parameters(acc) -> bool:
    """Whether each rank holds a shard of every parameter (ZeRO-3, FSDP2): a forward and a
    checkpoint gather them, collectives that every rank must join."""
    return zero_stage(acc) >= 3 or uses_fsdp2(acc)


def shards_optimizer_state(acc) -> bool:
    """Whether the optimizer state is split over the ranks (DeepSpeed, FSDP2) and checkpointed
    by :func:`save_engine_state` rather than as one ``optimizer`` entry."""
    return uses_deepspeed(acc) or uses_fsdp2(acc)


def _engine_dir(acc) -> str:
    return "deepspeed" if uses_deepspeed(acc) else "fsdp2"


def check_options(acc, config: RunConfig) -> None:
    """Launchers and options that cannot work, refused before any work."""
    fsdp_plugin = getattr(acc.state, "fsdp_plugin", None)
    if fsdp_plugin is not None and fsdp_plugin.fsdp_version != 2:
        raise ConfigError(
            f"launcher: fsdp_config.fsdp_version is {fsdp_plugin.fsdp_version}; only FSDP2 is "
            "supported, launch with configs/accelerate/fsdp2.yaml (fsdp_version: 2)"
        )
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and fsdp_plugin is None:
        raise ConfigError(
            f"device: accelerate runs FSDP on GPUs only, and these processes are on "
            f"{acc.device.type} (device={config.device!r}), where the FSDP launcher would train "
            "as plain DDP; use device=cuda, or launch without configs/accelerate/fsdp2.yaml"
        )
    if not shards_parameters(acc):
        return
    engine = "FSDP2" if uses_fsdp2(acc) else "ZeRO-3"
    whole = "configs/accelerate/ddp_2gpu.yaml or zero2.yaml"
    if config.rl.algorithm == "nft" and engine == "ZeRO-3":
        _check_nft_zero3(acc.state.deepspeed_plugin.deepspeed_config)
    if config.train.ema_decay > 0:
        raise ConfigError(
            f"train.ema_decay: an EMA of {engine}-sharded parameters is not supported; set "
            f"train.ema_decay=0 or use {whole}"
        )
    frozen_reference = config.rl.kl_reference == "base"  # nft's EMA reference is swapped in
    if config.rl.kl_beta > 0 and not config.model.lora.enabled and frozen_reference:
        raise ConfigError(
            "rl.kl_beta: the KL reference of full fine-tuning is a frozen copy of the model, "
            f"which {engine} cannot make from sharded parameters; set rl.kl_beta=0, enable "
            "model.lora (the reference is then the model with adapters off), with "
            "rl.algorithm=nft set rl.kl_reference=ema, or use " + whole
        )


def _check_nft_zero3(ds_config: dict) -> None:
    """DiffusionNFT under ZeRO-3 holds and swaps the old policy (and the EMA reference) in each
    rank's partitions ``ds_tensor`` (vsa2_rl.rl.nft); ZeRO-3 variants that keep the weights
    elsewhere too are refused: parameters offloaded to NVMe, ZeRO++'s secondary partitions
    (hpZ) and quantized weights."""
    zero = ds_config.get("zero_optimization", {})
    offload = zero.get("offload_param") or {}
    hpz = int(zero.get("zero_hpz_partition_size") or 1)
    where = {
        "zero_optimization.offload_param.device=nvme": offload.get("device") == "nvme",
        "zero_optimization.zero_hpz_partition_size > 1": hpz > 1,
        "zero_optimization.zero_quantized_weights": bool(zero.get("zero_quantized_weights")),
    }
    for key, found in where.items():
        if found:
            raise ConfigError(
                f"rl.algorithm: nft swaps its old-policy weights into ZeRO-3's partitions, which "
                f"the DeepSpeed config's {key} keeps elsewhere too; drop it from the config, or "
                "launch with configs/accelerate/zero3.yaml or fsdp2.yaml"
            )


def check_trained_experts(acc, model, config: RunConfig) -> None:
    """DeepSpeed with both experts of a Wan2.2 A14B in training, refused where its engine
    would step an expert differently from the update rule (a run of one expert is fine).

    An expert that saw no noise level of an update still moves under DeepSpeed (it steps every
    parameter; Adam's momentum and, as measured, the gradients of its last update), where the
    update rule leaves it untouched: Flow-GRPO draws its timesteps per expert so that this does
    not happen, DiffusionNFT's noise levels cannot promise it. Under ZeRO-3 an update whose experts
    receive their gradients in different backward passes departs from the plain one (measured
    on one GPU: the second update's gradient norm is 0.138 against 0.110; ZeRO-2 matches)."""
    if not uses_deepspeed(acc) or len(trained_modules(model)) < 2:
        return
    one_expert = "set model.train_experts=[high_noise] or [low_noise]"
    if shards_parameters(acc):
        raise ConfigError(
            f"model.train_experts: ZeRO-3 trains one expert per run; {one_expert}, or launch "
            "with configs/accelerate/zero2.yaml, ddp_2gpu.yaml or fsdp2.yaml"
        )
    if config.rl.algorithm == "nft":
        raise ConfigError(
            f"model.train_experts: rl.algorithm=nft under DeepSpeed trains one expert per "
            f"run; {one_expert}, or launch with configs/accelerate/ddp_2gpu.yaml or fsdp2.yaml"
        )


@contextlib.contextmanager
def whole_model_loading(acc):
    """Load models whole, even under ZeRO-3.

    With ZeRO-3 on, accelerate registers its DeepSpeed config with transformers, whose
    ``from_pretrained`` then shards every model it loads (``deepspeed.zero.Init``), including
    the frozen text encoder that each rank runs on its own. Inside this context models load
    whole; the DiT is sharded later by ``accelerator.prepare``.
    """
    if zero_stage(acc) < 3:
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        acc.state.deepspeed_plugin.set_deepspeed_weakref()


def configure(acc, config: RunConfig) -> None:
    """Fill the DeepSpeed config before ``accelerator.prepare`` (no-op without DeepSpeed)."""
    if not uses_deepspeed(acc):
        return
    ds = acc.state.deepspeed_plugin.deepspeed_config
    # the loop feeds one chunk per backward and no dataloader tells accelerate the batch size
    if ds.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        ds["train_micro_batch_size_per_gpu"] = config.rl.train_batch_size
    ds["gradient_clipping"] = float(config.train.max_grad_norm or 0.0)
    if acc.mixed_precision == "bf16":
        bf16 = ds.setdefault("bf16", {})
        bf16["enabled"] = True
        bf16["check_grad_overflow"] = True  # skip the step on a non-finite gradient, as DDP does


def accumulation_context(acc, model, last: bool):
    """DDP: no gradient all-reduce until the last backward of an update. DeepSpeed: none (the
    engine reduces as it needs). FSDP2: none either, every backward reduce-scatters, so that a
    rank accumulates its gradient shard only."""
    if last or uses_deepspeed(acc) or uses_fsdp2(acc):
        return contextlib.nullcontext()
    return acc.no_sync(model)


def backward(acc, loss: torch.Tensor, last: bool) -> None:
    """One accumulated backward; under DeepSpeed the last one of an update also steps."""
    if uses_deepspeed(acc):
        acc.deepspeed_engine_wrapped.backward(loss, sync_gradients=last)
    else:
        acc.backward(loss)


def finish_update(acc, optimizer, params, max_grad_norm: float, losses) -> tuple[bool, float]:
    """Apply the accumulated gradients unless something is not finite on some rank.

    Returns ``(stepped, grad_norm)``; ``grad_norm`` is the pre-clipping global norm (nan when
    DeepSpeed skipped the step before computing it).
    """
    if uses_deepspeed(acc):
        # the engine already stepped (or skipped) inside the boundary backward
        norm = acc.deepspeed_engine_wrapped.get_global_grad_norm()
        skipped = bool(getattr(optimizer, "step_was_skipped", False))
        return not skipped, float(norm) if norm is not None else math.nan
    grad_norm = acc.clip_grad_norm_(params, max_grad_norm or math.inf)
    if isinstance(grad_norm, DTensor):  # FSDP2: the global norm, replicated on every rank
        grad_norm = grad_norm.full_tensor()
    loss_sum = torch.stack(losses).sum() if losses else torch.zeros((), device=grad_norm.device)
    finite = torch.isfinite(loss_sum) & torch.isfinite(grad_norm)
    stepped = bool(acc.gather(finite.float().reshape(1)).min() > 0)
    if stepped:
        optimizer.step()
    return stepped, float(grad_norm)


def model_state(acc, model, config: RunConfig) -> dict:
    """The checkpointed weights (see ``runtime.trained_state``); a collective under ZeRO-3 and
    FSDP2, where every rank must call it and only the main process gets the weights."""
    if not shards_parameters(acc):
        return trained_state(acc.unwrap_model(model), config)
    # ZeRO-3: the 16-bit weights; FSDP2: the full state dict, offloaded to the main process's CPU
    full = acc.get_state_dict(model)
    if not acc.is_main_process:
        return {}
    if not config.model.lora.enabled:
        return full
    names = {n for n, p in acc.unwrap_model(model).named_parameters() if p.requires_grad}
    return {k: v for k, v in full.items() if k in names}


def save_engine_state(acc, staged: Path) -> None:
    """Every rank writes its model/optimizer shards (DeepSpeed's files, or FSDP2's through
    torch.distributed.checkpoint) into a checkpoint being staged."""
    acc.save_state(str(staged / _engine_dir(acc)))


def load_engine_state(acc, checkpoint: Path) -> None:
    """Restore what :func:`save_engine_state` wrote (same engine, same number of ranks)."""
    name = _engine_dir(acc)
    engine_dir = Path(checkpoint) / name
    if not engine_dir.is_dir():
        raise ConfigError(
            f"train.resume: {checkpoint} has no {name}/ folder: it was not written by a "
            f"{ENGINE_DIRS[name]} run, so its optimizer state cannot be loaded into one; resume "
            "it with the launcher that wrote it"
        )
    acc.load_state(str(engine_dir))
