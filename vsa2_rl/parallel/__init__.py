"""Parallelism beyond data parallelism: Ulysses sequence parallelism around VSA2."""

from vsa2_rl.parallel.ulysses import SequenceParallel

__all__ = ["SequenceParallel"]
