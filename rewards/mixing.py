"""Computing several rewards at once and combining them with weights.

``RewardMixer`` builds every reward of a list of ``(spec, weight, kwargs)`` entries and computes
them concurrently in threads, so CPU rewards (OpenCV flow, image statistics) overlap with
GPU rewards (CLIP, RAFT); OpenCV and torch release the GIL in their kernels.

Two aggregation levels (``aggregation``), as in multi-reward Flow-GRPO / DanceGRPO recipes:

- ``"reward"``: the trainer computes advantages of ``output.total``, the weighted sum of the raw
  rewards (:meth:`RewardMixer.weighted_total`, which evaluation uses on mean rewards too):
  ``adv = advantage_fn(output.total)``.
- ``"advantage"``: the trainer computes advantages of each reward separately and combines them,
  so rewards on different scales count by their weights only:
  ``adv = mixer.combine_advantages({n: advantage_fn(r) for n, r in output.rewards.items()})``.

Failure policy (``on_error``): a reward that raises, returns the wrong shape/dtype or non-finite
values, or runs longer than ``timeout_s``, is reported by name through :class:`RewardError`.

- ``"stop"``: the first failing reward's ``RewardError`` propagates (the run stops).
- ``"skip"``: a :class:`RewardSkip` (a ``RewardError``) is raised; the trainer catches it and
  skips the step.
- ``"drop_sample"``: non-finite values are kept as they are (never zeroed) and the samples are
  marked invalid in ``output.valid``; ``output.total`` is NaN there. The trainer computes
  advantages on the valid samples only. Failures that concern the whole batch (the reward
  raised, wrong shape or dtype) cannot be attributed to samples and propagate as with "stop".

A weighted sum that overflows although every reward is finite is such a failure too, reported
as the reward ``"weighted sum"``.

Evaluations (trained rewards and ``eval.guard_rewards``) apply ``on_error`` through
:func:`evaluation_scores`: under "skip" or "drop_sample" a non-finite value of one evaluation video
is logged and left out of that metric's mean (:func:`finite_mean_std`); "stop" raises.

Per-reward means are logged as ``reward/<name>`` (see :meth:`RewardOutput.metrics`); a name
used twice gets a suffix ``_2``, ``_3``, ...
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .registry import Reward, RewardError, RewardSkip, get_reward
from .videos import check_videos

logger = logging.getLogger(__name__)

AGGREGATIONS = ("reward", "advantage")
ON_ERROR = ("skip", "stop", "drop_sample")


@dataclass(frozen=True)
class RewardOutput:
    """Rewards of one batch.

    rewards: name -> float32 [B] raw values (non-finite where a sample was dropped).
    total: float32 [B] weighted sum of the rewards; NaN where ``valid`` is False.
    valid: bool [B]; False only for samples dropped under ``on_error="drop_sample"``.
    dropped: name -> indices of the samples where that reward was non-finite.
    """

    rewards: dict[str, torch.Tensor]
    total: torch.Tensor
    valid: torch.Tensor
    dropped: dict[str, list[int]]

    @classmethod
    def concat(cls, outputs: Sequence[RewardOutput]) -> RewardOutput:
        """One output of consecutive batches (a step's chunks, scored as each was decoded)."""
        rewards = {
            name: torch.cat([o.rewards[name] for o in outputs]) for name in outputs[0].rewards
        }
        dropped: dict[str, list[int]] = {}
        offset = 0
        for output in outputs:
            for name, indices in output.dropped.items():
                dropped.setdefault(name, []).extend(i + offset for i in indices)
            offset += output.valid.numel()
        total = torch.cat([o.total for o in outputs])
        return cls(rewards, total, torch.cat([o.valid for o in outputs]), dropped)

    def metrics(self) -> dict[str, float]:
        """``reward/<name>`` and ``reward/total`` means over valid samples, plus the valid share."""
        out: dict[str, float] = {}
        count = int(self.valid.sum())
        for name, values in [*self.rewards.items(), ("total", self.total)]:
            out[f"reward/{name}"] = float(values[self.valid].mean()) if count else math.nan
        out["reward/valid_fraction"] = count / self.valid.numel()
        return out


def combine_advantages(
    per_reward_adv: Mapping[str, torch.Tensor], weights: Mapping[str, float]
) -> torch.Tensor:
    """Advantage-level aggregation: ``sum_name weights[name] * per_reward_adv[name]``.

    Both mappings must name the same rewards; all advantage tensors must share one shape.
    """
    if set(per_reward_adv) != set(weights):
        raise ValueError(
            f"combine_advantages: advantages given for {sorted(per_reward_adv)} but weights for "
            f"{sorted(weights)}; pass one advantage tensor per weighted reward"
        )
    if not per_reward_adv:
        raise ValueError("combine_advantages: needs at least one reward")
    shapes = {name: tuple(adv.shape) for name, adv in per_reward_adv.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"combine_advantages: advantage shapes differ: {shapes}")
    return sum(weights[name] * adv for name, adv in per_reward_adv.items())


def evaluation_scores(
    reward: Reward,
    videos: torch.Tensor,
    prompts: Sequence[str],
    metadata: Sequence[dict] | None,
    on_error: str,
) -> torch.Tensor:
    """``reward``'s values [B] for an evaluation (a trained reward or a guard metric) under the
    ``rewards.on_error`` policy: with ``"stop"`` non-finite values raise its RewardError; with
    ``"skip"`` or ``"drop_sample"`` they are logged with the reward's name and kept, for
    :func:`finite_mean_std` to leave out, so one bad evaluation video does not end the run."""
    if on_error not in ON_ERROR:
        raise ValueError(f"rewards.on_error: got {on_error!r}, expected one of {ON_ERROR}")
    values = reward.evaluate(videos, prompts, metadata, allow_nonfinite=on_error != "stop")
    bad = (~torch.isfinite(values)).nonzero().flatten().tolist()
    if bad:
        logger.warning(
            "reward %r: non-finite at evaluation samples %s; left out of its mean (on_error=%s)",
            reward.name, bad, on_error,
        )  # fmt: skip
    return values


def finite_mean_std(values: torch.Tensor) -> tuple[float, float]:
    """Mean and population std of the finite entries of ``values``; NaN when none is finite."""
    kept = values[torch.isfinite(values)]
    if not kept.numel():
        return math.nan, math.nan
    return kept.mean().item(), kept.std(correction=0).item()


def _parse_entry(index: int, entry: Any) -> tuple[Any, float, dict]:
    """(spec, weight, kwargs) from a tuple, a mapping or a config object (RewardEntry)."""
    if isinstance(entry, (tuple, list)) and 1 <= len(entry) <= 3:
        spec = entry[0]
        weight = entry[1] if len(entry) > 1 else 1.0
        kwargs = entry[2] if len(entry) > 2 else {}
    elif isinstance(entry, Mapping):
        spec = entry.get("name", entry.get("spec"))
        weight, kwargs = entry.get("weight", 1.0), entry.get("kwargs") or {}
    elif hasattr(entry, "name") and hasattr(entry, "weight"):
        spec, weight, kwargs = entry.name, entry.weight, getattr(entry, "kwargs", None) or {}
    else:
        raise ValueError(
            f"rewards.functions[{index}]: expected (spec, weight, kwargs), a mapping "
            f"{{name, weight, kwargs}} or a RewardEntry, got {entry!r}"
        )
    if (
        isinstance(weight, bool)
        or not isinstance(weight, (int, float))
        or not math.isfinite(weight)
    ):
        raise ValueError(
            f"rewards.functions[{index}].weight: must be a finite number, got {weight!r}"
        )
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"rewards.functions[{index}].kwargs: must be a mapping, got {kwargs!r}")
    return spec, float(weight), dict(kwargs)


def _call_into(run: Callable[[Reward], torch.Tensor], reward: Reward, box: list) -> None:
    """``box.append`` of ``run(reward)``, or of what it raised (a reward thread's target)."""
    try:
        box.append(run(reward))
    except BaseException as error:  # handed to the caller, which raises it
        box.append(error)


class RewardMixer:
    """Computes weighted rewards concurrently; see the module docstring for the policies."""

    def __init__(
        self,
        entries: Iterable[Any],
        *,
        aggregation: str = "reward",
        on_error: str = "stop",
        num_workers: int = 2,
        timeout_s: float | None = None,
    ) -> None:
        if aggregation not in AGGREGATIONS:
            raise ValueError(
                f"rewards.aggregation: got {aggregation!r}, expected one of {AGGREGATIONS}"
            )
        if on_error not in ON_ERROR:
            raise ValueError(f"rewards.on_error: got {on_error!r}, expected one of {ON_ERROR}")
        if num_workers < 1:
            raise ValueError(f"rewards.num_workers: must be >= 1, got {num_workers}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"rewards.timeout_s: must be > 0 or empty, got {timeout_s}")
        self.timeout_s = timeout_s
        self.aggregation = aggregation
        self.on_error = on_error
        self.num_workers = num_workers
        self.rewards: dict[str, Reward] = {}
        self.weights: dict[str, float] = {}
        for index, entry in enumerate(entries):
            spec, weight, kwargs = _parse_entry(index, entry)
            try:
                reward = get_reward(spec, **kwargs)
            except Exception as exc:
                raise ValueError(f"rewards.functions[{index}] ({spec}): {exc}") from exc
            name, suffix = reward.name, 2
            while name in self.rewards:
                name, suffix = f"{reward.name}_{suffix}", suffix + 1
            self.rewards[name] = reward if name == reward.name else Reward(name, reward.fn)
            self.weights[name] = weight
        if not self.rewards:
            raise ValueError("rewards.functions: needs at least one reward")

    @classmethod
    def from_config(cls, config: Any) -> RewardMixer:
        """From a ``RewardsConfig`` (functions, aggregation, on_error, num_workers, timeout_s)."""
        return cls(
            config.functions,
            aggregation=config.aggregation,
            on_error=config.on_error,
            num_workers=config.num_workers,
            timeout_s=config.timeout_s,
        )

    @property
    def names(self) -> list[str]:
        return list(self.rewards)

    def weighted_total(self, values: Mapping[str, Any]) -> Any:
        """``sum_name weights[name] * values[name]`` over this mixer's rewards, in their order:
        the combined reward of ``aggregation="reward"``, of per-sample tensors or of numbers
        (an evaluation's mean rewards). ``values`` must hold every reward; others are ignored."""
        missing = [name for name in self.weights if name not in values]
        if missing:
            raise ValueError(f"weighted_total: no value for the reward(s) {missing}")
        return sum(weight * values[name] for name, weight in self.weights.items())

    def combine_advantages(self, per_reward_adv: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """:func:`combine_advantages` with this mixer's weights."""
        return combine_advantages(per_reward_adv, self.weights)

    def _run_all(
        self, run: Callable[[Reward], torch.Tensor]
    ) -> dict[str, torch.Tensor | RewardError]:
        """Every reward's value or RewardError, ``num_workers`` at a time, each in a daemon
        thread: one still running ``timeout_s`` after its start becomes a RewardError and is left
        behind (a thread cannot be stopped, but it holds up neither the run nor its exit, and
        Ctrl-C interrupts the wait). One at a time and without a timeout they run in the
        calling thread."""
        names, results = list(self.rewards), {}
        if self.timeout_s is None and (self.num_workers == 1 or len(names) == 1):
            for name in names:
                box = []
                _call_into(run, self.rewards[name], box)
                results[name] = box[0]
            return self._raise_foreign_errors(results)
        for start in range(0, len(names), self.num_workers):
            boxes = {name: [] for name in names[start : start + self.num_workers]}
            threads = [
                threading.Thread(
                    target=_call_into, args=(run, self.rewards[name], boxes[name]),
                    name=f"reward-{name}", daemon=True,
                )
                for name in boxes
            ]  # fmt: skip
            for thread in threads:
                thread.start()
            deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
            for thread, (name, box) in zip(threads, boxes.items(), strict=True):
                thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
                results[name] = box[0] if box else self._timed_out(name)
        return self._raise_foreign_errors(results)

    @staticmethod
    def _raise_foreign_errors(results: dict) -> dict:
        """``results``, after raising any exception in it that is not a reward's failure."""
        for result in results.values():
            if isinstance(result, BaseException) and not isinstance(result, RewardError):
                raise result
        return results

    def _timed_out(self, name: str) -> RewardError:
        return RewardError(
            name, f"did not finish within rewards.timeout_s={self.timeout_s:g} s (left running)"
        )

    def __call__(
        self,
        videos: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[dict] | None = None,
    ) -> RewardOutput:
        batch = check_videos(videos, prompts, metadata)
        if metadata is None:
            metadata = [{} for _ in range(batch)]
        allow_nonfinite = self.on_error == "drop_sample"
        results = self._run_all(
            lambda reward: reward.evaluate(
                videos, prompts, metadata, allow_nonfinite=allow_nonfinite, checked_input=True
            )
        )
        failures = [result for result in results.values() if isinstance(result, RewardError)]
        if failures:
            for extra in failures[1:]:
                logger.error("%s", extra)
            first = failures[0]
            if self.on_error == "skip":
                raise RewardSkip(first.name, f"step skipped: {first.detail}") from first
            raise first
        rewards = {name: value.to(videos.device) for name, value in results.items()}
        valid = torch.ones(batch, dtype=torch.bool, device=videos.device)
        dropped: dict[str, list[int]] = {}
        for name, values in rewards.items():
            finite = torch.isfinite(values)
            if not bool(finite.all()):
                dropped[name] = (~finite).nonzero().flatten().tolist()
                logger.warning("reward %r: non-finite at samples %s; dropped", name, dropped[name])
                valid &= finite
        total = self.weighted_total(rewards)
        valid = self._check_total(total, valid, dropped)
        total = torch.where(valid, total, torch.full_like(total, math.nan))
        return RewardOutput(rewards=rewards, total=total, valid=valid, dropped=dropped)

    def _check_total(
        self, total: torch.Tensor, valid: torch.Tensor, dropped: dict[str, list[int]]
    ) -> torch.Tensor:
        """``valid`` less the samples whose weighted sum overflowed though every reward was
        finite (e.g. 3e38 x weight 2), handled by ``on_error`` like a reward's failure (reported
        as the reward ``"weighted sum"``)."""
        overflow = valid & ~torch.isfinite(total)
        if not bool(overflow.any()):
            return valid
        samples = overflow.nonzero().flatten().tolist()
        detail = (
            f"overflows at samples {samples} although every reward is finite (weights "
            f"{self.weights}); rescale the rewards or their weights"
        )
        if self.on_error == "skip":
            raise RewardSkip("weighted sum", f"step skipped: {detail}")
        if self.on_error == "stop":
            raise RewardError("weighted sum", detail)
        logger.warning("reward 'weighted sum': %s; dropped", detail)
        dropped["weighted sum"] = samples
        return valid & ~overflow
