"""Exponential moving average of trainable parameters, swapped in for evaluation.

``shadow <- decay * shadow + (1 - decay) * param`` every ``update_every`` optimizer steps, as
flow_grpo keeps an EMA of its LoRA weights for evaluation. Only parameters with
``requires_grad`` are tracked (LoRA adapters, VSA2 router/gate parameters), so the EMA of a LoRA
run costs a few MB. The shadow is float32 whatever the parameter dtype: with bf16 parameters and
decay 0.999 the update ``(1 - decay) * (param - shadow)`` would round to zero.

With updates every k steps the averaging horizon is about ``k / (1 - decay)`` optimizer steps.
``warmup=True`` uses the usual warm-up of the decay, ``min(decay, (1 + n) / (10 + n))`` at the
n-th update (n from 0), so that a short run averages its own steps rather than its start (the toy
model build, :func:`vsa2_rl.toy.build.build_toy_model`, ends each stage on such an EMA).
Sharded parameters are averaged shard by shard, each rank its own (:func:`local_tensor`): under
FSDP2 the parameters are DTensors, and so is their shadow (same placement); under DeepSpeed
ZeRO-3 the shadow is a copy of the rank's flat partition ``ds_tensor``. :meth:`EMA.state_dict`
holds those shards (vsa2_rl.rl.nft.EMAReference gathers them whole, :func:`whole_tensor`) and
:meth:`EMA.load_state_dict` takes whole tensors (:func:`as_shard_of`). :meth:`EMA.swapped` and
:meth:`EMA.copy_to_params` write whole parameters, so not ZeRO-3's partitions.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch import distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor


def is_zero3(param: Tensor) -> bool:
    """Whether ``param`` is partitioned by DeepSpeed ZeRO-3 (it then carries ``ds_tensor``)."""
    return getattr(param, "ds_tensor", None) is not None


def local_tensor(param: Tensor) -> Tensor:
    """The tensor that stores this rank's weights of ``param``: under ZeRO-3 its flat partition
    ``ds_tensor`` (``param.data`` is empty there unless gathered), else the parameter itself
    (under FSDP2 a DTensor, whose arithmetic stays on the rank's shard)."""
    return param.ds_tensor if is_zero3(param) else param


def whole_shape(param: Tensor) -> torch.Size:
    """The shape of ``param``'s whole tensor, partitioned by ZeRO-3 or not."""
    return param.ds_shape if is_zero3(param) else param.shape


def as_shard_of(value: Tensor, weight: Tensor, param: Tensor) -> Tensor:
    """The whole tensor ``value`` in ``weight``'s dtype and device, as the part that this rank
    holds of ``param``: its ZeRO-3 partition, or where ``weight`` is an FSDP2 DTensor its shard
    (each rank slices its own part: no communication)."""
    value = value.to(weight.device, weight.dtype)
    if is_zero3(param):
        return _zero3_partition(value, param)
    if not isinstance(weight, DTensor):
        return value
    return distribute_tensor(value, weight.device_mesh, weight.placements, src_data_rank=None)


def _zero3_partition(value: Tensor, param: Tensor) -> Tensor:
    """This rank's slice of the flattened ``value``, zero-padded to ZeRO-3's partition size."""
    size = param.ds_tensor.numel()
    start = dist.get_rank(param.ds_process_group) * size
    flat = value.reshape(-1)[start : start + size]
    return torch.cat([flat, flat.new_zeros(size - flat.numel())])


def whole_tensor(tensor: Tensor, param: Tensor) -> Tensor:
    """``tensor``, this rank's part of ``param``'s weights (:func:`local_tensor`), whole on the
    CPU: ZeRO-3 partitions and FSDP2 DTensors are gathered from every rank (a collective that
    every rank joins); other tensors are returned as they are."""
    if is_zero3(param):
        group = param.ds_process_group
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts)[: param.ds_numel].view(param.ds_shape).cpu()
    if isinstance(tensor, DTensor):
        return tensor.full_tensor().cpu()
    return tensor.detach()


class EMA:
    """EMA of trainable parameters, captured at construction.

    ``parameters`` is a module (its ``named_parameters()`` with ``requires_grad``; the names key
    the state dict) or an iterable of parameters (keyed by position, so the same list order is
    needed to load a state dict). ``warmup``: warm the decay up (module docstring).
    """

    def __init__(
        self,
        parameters: nn.Module | Iterable[nn.Parameter],
        decay: float = 0.999,
        update_every: int = 1,
        warmup: bool = False,
    ):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay!r}")
        if isinstance(update_every, bool) or not isinstance(update_every, int) or update_every < 1:
            raise ValueError(f"update_every must be a positive int, got {update_every!r}")
        self.decay = decay
        self.update_every = update_every
        self.warmup = warmup
        if isinstance(parameters, nn.Module):
            named = parameters.named_parameters()
        else:
            named = ((str(i), p) for i, p in enumerate(parameters))
        self.params = {n: p for n, p in named if p.requires_grad}
        if not self.params:
            raise ValueError("parameters holds no trainable (requires_grad=True) parameter")
        self.shadow = {n: local_tensor(p).detach().float().clone() for n, p in self.params.items()}
        self.num_calls = 0

    @torch.no_grad()
    def update(self) -> bool:
        """Call once per optimizer step; averages on every ``update_every``-th call.

        Returns whether the shadow changed.
        """
        self.num_calls += 1
        if self.num_calls % self.update_every:
            return False
        decay = self.decay
        if self.warmup:
            updates = self.num_calls // self.update_every - 1  # the shadow updates before this one
            decay = min(decay, (1 + updates) / (10 + updates))
        for name, param in self.params.items():
            self.shadow[name].lerp_(local_tensor(param).detach().float(), 1.0 - decay)
        return True

    @torch.no_grad()
    def copy_to_params(self) -> None:
        """Overwrite the live parameters with the EMA (e.g. before exporting final weights)."""
        for name, param in self.params.items():
            param.copy_(self.shadow[name])

    @contextmanager
    def swapped(self) -> Iterator[None]:
        """Run the block with EMA weights in the module; the trained weights come back after."""
        backup = {n: p.detach().clone() for n, p in self.params.items()}
        self.copy_to_params()
        try:
            yield
        finally:
            with torch.no_grad():
                for name, param in self.params.items():
                    param.copy_(backup[name])

    def state_dict(self) -> dict[str, Any]:
        return {
            "decay": self.decay,
            "update_every": self.update_every,
            "warmup": self.warmup,
            "num_calls": self.num_calls,
            "shadow": dict(self.shadow),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`; the tracked parameter names must match."""
        shadow = state["shadow"]
        if set(shadow) != set(self.params):
            missing = sorted(set(self.params) - set(shadow))
            extra = sorted(set(shadow) - set(self.params))
            raise ValueError(
                f"EMA state does not match the trainable parameters: missing {missing[:5]}, "
                f"unexpected {extra[:5]}"
            )
        for name, value in shadow.items():
            shape = whole_shape(self.params[name])
            if value.shape != shape:
                raise ValueError(
                    f"EMA shadow {name!r} has shape {tuple(value.shape)}, parameter has "
                    f"{tuple(shape)}"
                )
            self.shadow[name].copy_(as_shard_of(value, self.shadow[name], self.params[name]))
        self.decay = float(state["decay"])
        self.update_every = int(state["update_every"])
        self.warmup = bool(state.get("warmup", False))  # absent in checkpoints before it existed
        self.num_calls = int(state["num_calls"])
