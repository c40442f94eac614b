"""Reward registry: the reward-function contract, name/plug-in resolution and output checks.

A reward function is ``fn(videos, prompts, metadata) -> Tensor[B]`` with ``videos`` a float
tensor [B, T, C, H, W] in [0, 1], ``prompts`` a list of B strings and ``metadata`` a list of B
dicts; higher is better. Rewards are *built* by factories, so that weights are loaded once:

- ``register_reward(name)`` registers a factory ``factory(**kwargs) -> reward function``.
- ``get_reward(spec, **kwargs)`` resolves ``spec`` in this order: a registered name; an entry
  point of group ``vsa2_rl.rewards`` with that name (installed plug-ins; the entry point names a
  factory); ``"package.module:callable"``. It returns a :class:`Reward` that checks its input
  and its output.

A ``"module:callable"`` target (or a callable passed directly) is treated as a **factory** when
it is a class, was decorated with ``register_reward``, kwargs are given, or it cannot be called
with the three positional arguments ``(videos, prompts, metadata)`` (e.g. a zero-argument
factory); otherwise it is the reward function itself.

Output contract (enforced by :class:`Reward`): a float32 tensor of shape [B] with finite values,
on the videos' device (one on another real device is moved there; a ``meta`` tensor is an error).
A factory failing with an error other than ValueError, TypeError or OSError (a KeyError on a
damaged file, a RuntimeError, an ImportError) raises :class:`RewardBuildError` naming the reward.
A reward that raises (``SystemExit`` included; not ``KeyboardInterrupt``), changes its input
videos in place, or breaks the contract raises :class:`RewardError` (a ``ValueError``) whose
message names the reward. Bad *input* (videos of the wrong rank, fewer than 2 frames,
values outside [0, 1]) raises a plain ``ValueError`` before any reward runs.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import Any

import torch

from .videos import check_videos

RewardFn = Callable[[torch.Tensor, list[str], list[dict]], torch.Tensor]
RewardFactory = Callable[..., RewardFn]

ENTRY_POINT_GROUP = "vsa2_rl.rewards"

_REGISTRY: dict[str, RewardFactory] = {}
_FACTORY_MARK = "__vsa2_reward_factory__"


class RewardError(ValueError):
    """A reward raised, or returned a value that breaks the contract; ``name`` says which."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"reward {name!r}: {message}")
        self.name = name
        self.detail = message


class RewardBuildError(ValueError):
    """A reward's factory (or its plug-in's import) failed with an error that is not already
    a ValueError, TypeError or OSError: one line naming the reward and the original error."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"reward {name!r} could not be built: {message}")
        self.name = name


class RewardSkip(RewardError):
    """Raised by the mixer with ``on_error='skip'``: the trainer catches it and skips the step."""


def register_reward(name: str, *, overwrite: bool = False) -> Callable[[RewardFactory], Any]:
    """Decorator registering ``factory(**kwargs) -> reward function`` under ``name``.

    Re-registering a name raises unless ``overwrite=True`` (so two plug-ins cannot silently
    shadow each other); re-registering the same factory object is a no-op (module reloads).
    """
    if not name or ":" in name or name != name.strip():
        raise ValueError(
            f"register_reward: name must be non-empty without ':' or surrounding spaces, "
            f"got {name!r}"
        )

    def decorator(factory: RewardFactory) -> RewardFactory:
        if not callable(factory):
            raise ValueError(f"register_reward({name!r}): expected a callable, got {factory!r}")
        current = _REGISTRY.get(name)
        if current is not None and current is not factory and not overwrite:
            raise ValueError(
                f"register_reward: {name!r} is already registered to "
                f"{current.__module__}.{current.__qualname__}; pick another name or pass "
                f"overwrite=True"
            )
        _REGISTRY[name] = factory
        setattr(factory, _FACTORY_MARK, True)
        return factory

    return decorator


def list_rewards() -> list[str]:
    """Registered reward names (built-ins and those registered by imported modules)."""
    return sorted(_REGISTRY)


class Reward:
    """A reward function wrapped with input and output checks; call as ``reward(v, p, m)``."""

    def __init__(self, name: str, fn: RewardFn) -> None:
        self.name = name
        self.fn = fn

    def __repr__(self) -> str:
        return f"Reward({self.name!r}, {self.fn!r})"

    def __call__(
        self,
        videos: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[dict] | None = None,
    ) -> torch.Tensor:
        return self.evaluate(videos, prompts, metadata)

    def evaluate(
        self,
        videos: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[dict] | None = None,
        *,
        allow_nonfinite: bool = False,
        checked_input: bool = False,
    ) -> torch.Tensor:
        """Run the reward and check its output.

        ``allow_nonfinite=True`` returns NaN/inf values instead of raising (the mixer's
        ``drop_sample`` policy masks them); ``checked_input=True`` skips the input check when the
        caller already ran :func:`check_videos` on the same batch.
        """
        try:
            batch = len(videos) if checked_input else check_videos(videos, prompts, metadata)
        except ValueError as error:  # bad input, not a reward failure: still says which reward
            raise ValueError(f"reward {self.name!r}: {error}") from None
        if metadata is None:
            metadata = [{} for _ in range(batch)]
        version = videos._version  # bumped by any in-place edit of videos or a view of it
        try:
            out = self.fn(videos, list(prompts), list(metadata))
        except RewardError:  # already names a reward
            raise
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # SystemExit included: a reward failure, with its name
            raise RewardError(self.name, f"raised {type(exc).__name__}: {exc}") from exc
        if videos._version != version:
            raise RewardError(
                self.name,
                "changed the videos in place (the rewards after it would score the edited "
                "pixels); work on a copy: videos = videos.clone()",
            )
        if not isinstance(out, torch.Tensor):
            raise RewardError(self.name, f"must return a torch.Tensor [B], got {type(out)}")
        out = self._on_device(out, videos.device)
        if tuple(out.shape) != (batch,):
            raise RewardError(
                self.name,
                f"must return shape [{batch}] (one value per video), got {tuple(out.shape)}",
            )
        if out.dtype != torch.float32:
            raise RewardError(
                self.name, f"must return float32, got {out.dtype}; return `values.float()`"
            )
        if not allow_nonfinite:
            bad = ~torch.isfinite(out)
            if bool(bad.any()):
                index = bad.nonzero().flatten().tolist()
                raise RewardError(
                    self.name,
                    f"returned non-finite values {out[bad].tolist()} at samples {index}",
                )
        return out

    def _on_device(self, out: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``out`` on the videos' ``device``; a tensor without data (``meta``) is an error."""
        if out.device.type == "meta":
            raise RewardError(
                self.name, "returned a tensor on the meta device (no values); return real scores"
            )
        try:
            return out if out.device == device else out.to(device)
        except RuntimeError as error:
            detail = f"its {out.device} scores cannot move to {device}: {error}"
            raise RewardError(self.name, detail) from error


def _import_target(spec: str) -> Any:
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise ValueError(
            f"reward spec {spec!r}: expected 'package.module:callable' with both parts non-empty"
        )
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or whatever the module raises while importing
        raise ValueError(
            f"reward spec {spec!r}: cannot import module {module_name!r}: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    for part in attr_path.split("."):
        if not hasattr(target, part):
            raise ValueError(
                f"reward spec {spec!r}: {module_name!r} has no attribute {attr_path!r}"
            )
        target = getattr(target, part)
    return target


def _entry_point(name: str) -> Any | None:
    matches = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not matches:
        return None
    try:
        return matches[0].load()
    except Exception as exc:  # the plug-in's module fails to import
        detail = f"its plug-in failed to load: {type(exc).__name__}: {exc}"
        raise RewardBuildError(name, detail) from exc


def _is_factory(target: Any, kwargs: dict) -> bool:
    if inspect.isclass(target) or getattr(target, _FACTORY_MARK, False) or kwargs:
        return True
    try:
        inspect.signature(target).bind(None, None, None)
    except TypeError:
        return True
    except ValueError:  # no signature (some builtins): assume a reward function
        return False
    return False


def _build(name: str, factory: Any, kwargs: dict) -> RewardFn:
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as exc:
        raise ValueError(f"reward {name!r}: bad kwargs {sorted(kwargs)}: {exc}") from exc
    except ValueError:  # no introspectable signature: let the call decide
        pass
    try:
        fn = factory(**kwargs)
    except (ValueError, TypeError, OSError):  # the callers name these with their kwarg
        raise
    except (Exception, SystemExit) as exc:  # KeyError, RuntimeError, ImportError, ...
        raise RewardBuildError(name, f"{type(exc).__name__}: {exc}") from exc
    if not callable(fn):
        raise ValueError(
            f"reward {name!r}: the factory returned {type(fn)}, expected a callable "
            f"fn(videos, prompts, metadata) -> Tensor[B]"
        )
    return fn


def get_reward(spec: str | Callable, **kwargs: Any) -> Reward:
    """Build the reward ``spec`` (registered name, entry point, ``'module:callable'`` or a
    callable) with factory ``kwargs`` and wrap it in a checking :class:`Reward`."""
    if isinstance(spec, Reward) and not kwargs:
        return spec
    if callable(spec) and not isinstance(spec, str):
        name = getattr(spec, "__name__", type(spec).__name__)
        target = spec
    elif isinstance(spec, str) and spec:
        if spec.startswith("remote:"):
            from .remote import RemoteReward

            client = RemoteReward(spec.removeprefix("remote:"), **kwargs)
            try:
                served = client.name()
            except RuntimeError as error:
                raise ValueError(f"reward {spec!r}: cannot reach the server: {error}") from None
            return Reward(f"remote_{served}", client)
        if spec in _REGISTRY:
            return Reward(spec, _build(spec, _REGISTRY[spec], kwargs))
        plugin = _entry_point(spec) if ":" not in spec else None
        if plugin is not None:
            return Reward(spec, _build(spec, plugin, kwargs))
        if ":" not in spec:
            raise ValueError(
                f"unknown reward {spec!r}: not registered (known: {', '.join(list_rewards())}), "
                f"not an entry point of group {ENTRY_POINT_GROUP!r}, and not "
                f"'package.module:callable'"
            )
        target = _import_target(spec)
        name = spec.rpartition(":")[2]
    else:
        raise ValueError(f"reward spec: expected a non-empty string or a callable, got {spec!r}")
    if _is_factory(target, kwargs):
        return Reward(name, _build(name, target, kwargs))
    if not callable(target):
        raise ValueError(f"reward {name!r}: {target!r} is not callable")
    return Reward(name, target)
