"""The trained policy and the weights it is measured against (a part of ``vsa2_rl.rl.trainer``).

:class:`Policy` owns what training changes: the transformer as the distributed engine wraps it,
its trainable parameters, the optimizer and learning-rate schedule, and the EMA of the weights.
The other weights a run needs are explicit objects, each a bundle view
(:func:`vsa2_rl.models.with_transformer`) that the caller runs, never a swap of a shared
attribute: :class:`ReferencePolicy` (the start of training, for the KL term) and the evaluation
policy (:meth:`Policy.evaluation`: the unwrapped model with its EMA weights).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from torch.profiler import record_function

from vsa2_rl.config import ConfigError, RunConfig
from vsa2_rl.models.experts import frozen_copy
from vsa2_rl.models.family import family_of
from vsa2_rl.models.wan_bundle import with_transformer
from vsa2_rl.rl import engines
from vsa2_rl.rl.ema import EMA
from vsa2_rl.runtime import load_trained_state, trainable_parameters


class ReferencePolicy:
    """The policy at the start of training, for the KL term: for LoRA the model with its
    adapters disabled (no second copy of the weights), for full fine-tuning a frozen copy of the
    start weights run through a view of the bundle."""

    def __init__(self, bundle, model: torch.nn.Module, *, lora: bool):
        self.bundle, self.model = bundle, model
        self.frozen = None if lora else with_transformer(bundle, frozen_copy(model))

    @contextlib.contextmanager
    def active(self) -> Iterator:
        """Yields the bundle that computes the reference's velocity (call it under no_grad)."""
        if self.frozen is not None:
            yield self.frozen
            return
        self.model.disable_adapters()
        try:
            yield self.bundle
        finally:
            self.model.enable_adapters()


class Policy:
    """The trained transformer under the run's engine, with its optimizer, learning-rate
    schedule (linear warm-up over ``train.warmup_steps``), EMA (``train.ema_decay``) and, with
    ``rl.kl_beta > 0`` and ``rl.kl_reference=base``, its :class:`ReferencePolicy`.

    ``bundle`` runs the engine's wrapper (rollouts and training forwards); ``unwrapped`` is the
    bare model (shapes, evaluation, checkpoints).
    """

    def __init__(self, bundle, acc, config: RunConfig):
        self.acc, self.config = acc, config
        family = family_of(config.model.kind)
        transformer = bundle.transformer
        if config.model.gradient_checkpointing:
            transformer.enable_gradient_checkpointing()
        params = trainable_parameters(transformer, config)
        if config.model.compile_blocks:  # after LoRA adapters are in place; compiles on first use
            family.compile_blocks(transformer)
        elif config.model.fused_kernels:  # compiled blocks leave the fusion to inductor
            family.fuse_block_kernels(transformer)
        train = config.train
        optimizer = torch.optim.AdamW(
            params, lr=train.learning_rate, weight_decay=train.weight_decay
        )
        warmup = train.warmup_steps
        self.lr_schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
        )
        engines.configure(acc, config)
        self.model, self.optimizer = acc.prepare(transformer, optimizer)
        # FSDP2 replaces every parameter by its shard: clipping and the finite check need those
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.bundle = with_transformer(bundle, self.model)
        self.unwrapped = acc.unwrap_model(self.model)
        self.evaluation_bundle = with_transformer(bundle, self.unwrapped)
        self.reference = (  # nft's rl.kl_reference=ema builds its own (vsa2_rl.rl.nft)
            ReferencePolicy(self.bundle, self.unwrapped, lora=config.model.lora.enabled)
            if config.rl.kl_beta > 0 and config.rl.kl_reference == "base"
            else None
        )
        self.ema = EMA(self.unwrapped, decay=train.ema_decay) if train.ema_decay > 0 else None

    @contextlib.contextmanager
    def evaluation(self) -> Iterator:
        """Yields the bundle that evaluations run: the unwrapped model, with the EMA weights
        while the block runs when the run keeps an EMA."""
        with self.ema.swapped() if self.ema is not None else contextlib.nullcontext():
            yield self.evaluation_bundle

    def optimizer_step(self, losses: list) -> tuple[bool, float]:
        """Applies the accumulated gradients unless a loss in ``losses`` or a gradient is not
        finite on some rank (the weights then stay untouched); updates the EMA after a step.
        Returns ``(stepped, grad_norm)``; runs in the profiler range
        ``vsa2_rl/update/optimizer``."""
        with record_function("vsa2_rl/update/optimizer"):
            stepped, grad_norm = engines.finish_update(
                self.acc, self.optimizer, self.params, self.config.train.max_grad_norm, losses
            )
            if stepped and self.ema is not None:
                self.ema.update()
            self.optimizer.zero_grad(set_to_none=True)
        return stepped, grad_norm

    def advance_lr_schedule(self) -> None:
        """One RL step of the learning-rate schedule. It counts RL steps, including those that
        updated nothing (every group without reward variance, or a skipped update), so PyTorch's
        warning about a scheduler step before any optimizer step does not apply."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)`")
            self.lr_schedule.step()

    def state_entries(self) -> dict:
        """The checkpoint's entries of the policy (a collective under ZeRO-3 and FSDP2); the
        optimizer's is added by the caller where the engine does not shard it."""
        return {
            "model": engines.model_state(self.acc, self.model, self.config),
            "lr_schedule": self.lr_schedule.state_dict(),
            "ema": self.ema.state_dict() if self.ema is not None else {},
        }

    def load_state(self, restored: dict, checkpoint: str) -> None:
        """Restores :meth:`state_entries` (and the optimizer) from the checkpoint folder
        ``checkpoint`` whose ``checkpoint.pt`` entries are ``restored``."""
        if engines.shards_optimizer_state(self.acc):  # weight and optimizer shards, the engine's
            engines.load_engine_state(self.acc, checkpoint)
        elif "optimizer" not in restored:
            raise ConfigError(
                f"train.resume: {checkpoint} was written by a DeepSpeed or FSDP2 run (its "
                "optimizer state is in the engine's shards); resume it with the same launcher"
            )
        else:
            load_trained_state(self.unwrapped, restored["model"], self.config, checkpoint)
            self.optimizer.load_state_dict(restored["optimizer"])
        self.lr_schedule.load_state_dict(restored["lr_schedule"])
        if self.ema is not None:
            self.ema.load_state_dict(restored["ema"])


__all__ = ["Policy", "ReferencePolicy"]
