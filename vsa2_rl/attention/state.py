"""Shared sparsity state of all VSA2 layers of a model (docs/concepts.md, "The model bundle").

One mutable object is shared by every VSA2 attention layer of a transformer (and by a frozen
reference copy of it). The trainer sets the scheduled ``sparsity`` for a phase of its step with
``with state.at(sparsity): ...``; each layer reads ``sparsity`` at every forward and adds the
density it achieved. The densities stay on the device (no host sync per layer) until
:meth:`SparsityState.pop_density`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class SparsityState:
    """Scheduled sparsity + achieved-density accumulator shared by all VSA2 layers.

    ``sparsity`` is 1 - density target in [0, 1): 0 means every key segment may be attended to
    (with ``VSA2Config.dense_threshold`` <= 1 that is the exact dense fallback).
    """

    def __init__(self, sparsity: float = 0.0) -> None:
        self.sparsity = sparsity
        self._density_sum: torch.Tensor | float = 0.0
        self._density_count = 0

    @property
    def sparsity(self) -> float:
        return self._sparsity

    @sparsity.setter
    def sparsity(self, value: float) -> None:
        value = float(value)
        if not 0.0 <= value < 1.0:
            raise ValueError(f"sparsity must be in [0, 1), got {value}")
        self._sparsity = value

    @contextlib.contextmanager
    def at(self, sparsity: float) -> Iterator[SparsityState]:
        """Runs the block at ``sparsity`` and restores the previous value after it, also when
        the block raises."""
        previous = self.sparsity
        self.sparsity = sparsity
        try:
            yield self
        finally:
            self.sparsity = previous

    # Bookkeeping outside any compiled graph: traced, the growing count would be a guarded
    # constant and every layer call would recompile (torch.compile of the blocks fell back to
    # eager after 8 recompiles at Wan 720p).
    @torch.compiler.disable
    def record_density(self, density: torch.Tensor | float) -> None:
        """Add one layer's achieved density (a scalar tensor or float); no host sync."""
        if isinstance(density, torch.Tensor):
            density = density.detach().float()
        self._density_sum = self._density_sum + density
        self._density_count += 1

    @contextlib.contextmanager
    def unrecorded(self) -> Iterator[SparsityState]:
        """Runs the block without counting its forwards' densities: a reference forward beside
        the measured ones (vsa2_rl.eval.agreement's dense velocity) leaves the accumulator as
        it found it, also when the block raises."""
        saved = self._density_sum, self._density_count
        try:
            yield self
        finally:
            self._density_sum, self._density_count = saved

    def pop_density(self) -> float | None:
        """Mean density recorded since the last pop (None if nothing was recorded); resets."""
        if self._density_count == 0:
            return None
        mean = float(self._density_sum) / self._density_count  # the one host sync
        self._density_sum = 0.0
        self._density_count = 0
        return mean

    def __deepcopy__(self, memo: dict) -> SparsityState:
        # A deep copy of a model (e.g. a frozen reference policy for full fine-tuning) must keep
        # following the trainer's schedule, so the state is shared, not copied.
        return self

    def __repr__(self) -> str:
        return f"SparsityState(sparsity={self.sparsity})"
