"""Atomic full-state checkpoints and RNG capture, for exact ``resume: auto``.

Layout under a checkpoints directory::

    step_120/
        model.safetensors      # an entry that is a flat {name: tensor} dict (weights, LoRA)
        optimizer.pt           # any other entry (optimizer / LR scheduler states, RNG, python)
        meta.json              # step, the file format of every entry, size + sha256 of every file
        deepspeed/             # DeepSpeed runs only: the engine's per-rank shards (engines.py)
        fsdp2/                 # FSDP2 runs only: the per-rank shards (torch.distributed.checkpoint)
        COMPLETE               # written last (with meta.json's sha256): without it, no checkpoint
    .tmp-step_130-x1y2/        # a save in progress (or killed mid-way): ignored, then removed

A save writes everything into a temporary directory next to the final one, fsyncs every file and
the directory, and then renames it to ``step_N`` (``rename`` within one filesystem is atomic on
POSIX), so a crash at any point leaves the previous checkpoints untouched and at worst a temporary
directory that :func:`find_latest` ignores. One process commits a checkpoint (the main process);
other ranks may add files to it while it is staged (:func:`stage_checkpoint`); every rank may
read.

Weights go to safetensors (no pickle, mmap-able); other states go through ``torch.save`` and are
loaded with ``weights_only=True`` by default, which covers tensors, numbers, strings and
containers of them: optimizer and LR-scheduler ``state_dict()``s and :func:`capture_rng_state`.

Every file's size and sha256 are recorded at save time and checked before anything is read
(:func:`verify_checkpoint`): a truncated or overwritten file (a disk filling up, a copy cut short)
is reported by name, and :func:`find_latest` falls back to the newest checkpoint that verifies,
with a warning naming the bad ones, so one damaged checkpoint never blocks a resume. A checksum
only proves a file unchanged since meta.json was written, so meta.json's own records are checked
too (its step must be the one a ``step_N`` folder is named by: a copied or renamed folder never
passes for a newer step), and :func:`load_latest` (what ``train.resume=auto`` uses) also falls
back past a checkpoint whose files verify but do not load (a pickle that ``weights_only``
refuses, planted with recomputed checksums).

Resuming an older checkpoint than the newest one starts a new branch of the run:
:func:`set_aside_branch` moves the later checkpoints and their metrics rows into
``abandoned/after_step_N-<time>-*/`` of the run folder, so that neither a later
``resume=auto`` nor ``train.keep_last`` mixes the two branches, and nothing of the old one is
deleted.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import re
import shutil
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from safetensors.torch import load_file, save_file

from vsa2_rl.config.checks import ConfigError

COMPLETE_MARKER = "COMPLETE"
META_FILE = "meta.json"
_STEP_DIR = re.compile(r"step_(\d+)")
_ENTRY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_TEMP_PREFIXES = (".tmp-", ".trash-")


def _fsync_path(path: Path) -> None:
    """fsync a file or directory so its contents/entries survive a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_tensor_dict(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and len(value) > 0
        and all(isinstance(k, str) for k in value)
        and all(isinstance(v, torch.Tensor) for v in value.values())
    )


def _safetensors_ready(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, no shared storage (safetensors refuses aliases such as tied weights)."""
    out = {}
    seen: set[int] = set()
    for key, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen and t.numel() > 0:
            t = t.clone()
        seen.add(ptr)
        out[key] = t
    return out


def _remove_dir(path: Path) -> None:
    """Delete a directory, renaming it first so a crash mid-delete leaves no step_N lookalike."""
    trash = path.with_name(f".trash-{path.name}-{uuid.uuid4().hex[:8]}")
    os.rename(path, trash)
    shutil.rmtree(trash)


def list_checkpoints(checkpoints_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``checkpoints_dir`` as ``(step, path)``, oldest first."""
    root = Path(checkpoints_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.fullmatch(entry.name)
        if match and entry.is_dir() and (entry / COMPLETE_MARKER).is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _read_meta(path: Path) -> tuple[dict[str, Any], str | None]:
    """meta.json of the checkpoint at ``path`` and None, or ``{}`` and what is wrong with it:
    a checksum proves only that meta.json was not changed after the marker was written, not
    that whoever wrote both wrote what a save writes."""
    where = path / META_FILE
    try:
        meta = json.loads(where.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        return {}, f"{where} is not valid JSON ({error})"
    records = meta.get("files") if isinstance(meta, dict) else None
    if not isinstance(records, dict) or not all(
        isinstance(r, dict) and {"size", "sha256"} <= set(r) for r in records.values()
    ):
        return {}, f"{where} has no valid 'files' record (size and sha256 of each file)"
    outside = [name for name in records if Path(name).is_absolute() or ".." in Path(name).parts]
    if outside:
        return {}, f"{where} records a file outside the checkpoint folder: {outside[0]}"
    step, entries = meta.get("step"), meta.get("entries")
    if isinstance(step, bool) or not isinstance(step, int) or not isinstance(entries, dict):
        return {}, f"{where} has no valid 'step' and 'entries' records"
    unrecorded = [name for name, fmt in entries.items() if _entry_file(name, fmt) not in records]
    if unrecorded:
        return {}, f"{where} lists an entry {unrecorded[0]!r} whose file it does not record"
    return meta, None


def _entry_file(name: str, fmt: str) -> str:
    return f"{name}.safetensors" if fmt == "safetensors" else f"{name}.pt"


def verify_checkpoint(path: str | os.PathLike) -> str | None:
    """None if the checkpoint at ``path`` is whole, else what is wrong with it (one line).

    Checks the completion marker and the meta.json checksum it carries, that meta.json holds
    the records a save writes and, for a ``step_N`` folder, records step N (a copied or renamed
    folder must not pass for another step), every file against the size and sha256 that
    meta.json recorded, and that the folder holds no file meta.json does not record: only the
    files the run wrote reach a loader (DeepSpeed unpickles its shards).
    """
    path = Path(path)
    marker = path / COMPLETE_MARKER
    if not path.is_dir():  # e.g. removed by a running train's keep_last since it was found
        return "the folder is gone (a training run's train.keep_last may have removed it)"
    if not marker.is_file():
        return f"no {COMPLETE_MARKER} marker (a save that did not finish)"
    fields = marker.read_text().split()
    if "sha256" not in fields[:-1]:
        return (
            f"{COMPLETE_MARKER} carries no {META_FILE} checksum (edited, or not written by vsa2_rl)"
        )
    expected = fields[fields.index("sha256") + 1]
    if not (path / META_FILE).is_file() or _sha256(path / META_FILE) != expected:
        return f"{META_FILE} is missing or does not match the checksum in {COMPLETE_MARKER}"
    meta, problem = _read_meta(path)
    if problem is not None:
        return problem
    named = _STEP_DIR.fullmatch(path.name)
    if named and int(named.group(1)) != meta["step"]:
        return (
            f"{META_FILE} records step {meta['step']} but the folder is named {path.name} "
            "(copied or renamed?)"
        )
    recorded = meta["files"]
    for name, record in recorded.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != record["size"]:
            return f"{name} has {file.stat().st_size} bytes, {record['size']} were written"
        if _sha256(file) != record["sha256"]:
            return f"{name} does not match the checksum recorded when it was written"
    present = {str(f.relative_to(path)) for f in path.rglob("*") if not f.is_dir()}
    added = sorted(present - set(recorded) - {META_FILE, COMPLETE_MARKER})
    if added:
        return f"{added[0]} was not written with the checkpoint ({META_FILE} does not record it)"
    return None


def _newest_usable(checkpoints_dir: str | os.PathLike, use: Callable[[Path], Any]) -> Any:
    """``use(path)`` of the newest complete checkpoint for which it raises no ValueError (whose
    message says what is wrong), or None when there is no checkpoint at all.

    Newer checkpoints it fails on are skipped with a warning naming them; if checkpoints exist
    but it fails on all, raises ValueError listing what is wrong with each (resuming from
    scratch would silently discard the run).
    """
    problems = []
    for _, path in reversed(list_checkpoints(checkpoints_dir)):
        try:
            result = use(path)
        except ValueError as error:
            problems.append(f"{path.name}: {error}")
            continue
        if problems:
            warnings.warn(
                f"skipping damaged checkpoints ({'; '.join(problems)}); using {path}",
                stacklevel=3,
            )
        return result
    if problems:
        raise ValueError(
            f"no checkpoint under {checkpoints_dir} verifies ({'; '.join(problems)}); start a "
            "new out_dir or point train.resume at a checkpoint folder copied from elsewhere"
        )
    return None


def _verified(path: Path) -> Path:
    problem = verify_checkpoint(path)
    if problem is not None:
        raise ValueError(problem)
    return path


def find_latest(checkpoints_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint that verifies (:func:`verify_checkpoint`), or None when
    there is none at all; damaged ones are skipped with a warning naming them, and ValueError
    lists them all when none verifies."""
    return _newest_usable(checkpoints_dir, _verified)


def load_latest(
    checkpoints_dir: str | os.PathLike, **load_options: Any
) -> tuple[Path, dict[str, Any]] | None:
    """``(path, state)`` of the newest checkpoint that verifies *and loads*
    (:func:`load_checkpoint` with ``load_options``), or None when there is none; the others are
    skipped like :func:`find_latest`'s (a file whose checksum was recomputed after it was
    tampered with verifies, and is refused only when it is read)."""

    def load(path: Path) -> tuple[Path, dict[str, Any]]:
        try:
            return path, load_checkpoint(path, **load_options)
        except UnusableCheckpoint as error:
            raise ValueError(error.problem) from None

    return _newest_usable(checkpoints_dir, load)


def _check_step(step: Any) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")


def stage_checkpoint(checkpoints_dir: str | os.PathLike, step: int) -> Path:
    """Create the temporary directory of a save in progress and return it.

    Leftovers of crashed saves are removed first. Other processes may write their own files
    (e.g. DeepSpeed's per-rank shards) into it before the main process commits it with
    ``save_checkpoint(..., staged=path)``; until then it is not a checkpoint.
    """
    _check_step(step)
    root = Path(checkpoints_dir)
    root.mkdir(parents=True, exist_ok=True)
    for entry in root.iterdir():
        if entry.is_dir() and entry.name.startswith(_TEMP_PREFIXES):
            shutil.rmtree(entry, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-step_{step}-", dir=root))
    os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; checkpoints are shared read-only
    return tmp


class DiskFull(OSError):
    """A checkpoint file that could not be written because its disk is full or a file-size
    limit (``ulimit -f``) was hit: one line naming the file and the space it needed."""


_OUT_OF_SPACE = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
# how torch and safetensors report a failed write: their errors carry no errno
_OUT_OF_SPACE_TEXT = (
    "os error 28",
    "os error 27",
    "os error 122",
    "unexpected pos",
    "write failed",
)


def _tensor_bytes(value: Any) -> int:
    """The bytes of the tensors in ``value`` (containers walked): what writing it needs."""
    if isinstance(value, torch.Tensor):
        return value.nelement() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(item) for item in value)
    return 0


@contextlib.contextmanager
def space_for(path: Path, needed: int, what: str = "checkpoint"):
    """Turns a write of ``path`` (part of ``what``) that ran out of space into :class:`DiskFull`,
    whose one line names the file, the space it needed and the space left."""
    try:
        yield
    except Exception as error:
        text = str(error).lower()
        if getattr(error, "errno", None) not in _OUT_OF_SPACE and not any(
            mark in text for mark in _OUT_OF_SPACE_TEXT
        ):
            raise
        free = shutil.disk_usage(Path(path).parent).free
        raise DiskFull(
            errno.ENOSPC,
            f"{what}: writing {path} failed: its disk is full or a file-size limit "
            f"(ulimit -f) was hit; it needs about {needed / 2**20:.1f} MiB, "
            f"{free / 2**20:.1f} MiB are free there. The earlier checkpoints are whole: free "
            "space (or lower train.keep_last) and continue with train.resume=auto",
        ) from None


def _file_mode() -> int:
    """The mode the umask gives a new file (0644 under umask 022)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _write_entry(folder: Path, name: str, value: Any) -> str:
    """Writes one state entry into ``folder`` and fsyncs it; returns its format."""
    fmt = "safetensors" if _is_tensor_dict(value) else "torch"
    path = folder / _entry_file(name, fmt)
    with space_for(path, _tensor_bytes(value)):
        if fmt == "safetensors":
            save_file(_safetensors_ready(value), str(path), metadata={"format": "pt"})
            os.chmod(path, _file_mode())  # safetensors makes it owner-only, unlike the rest
        else:
            with open(path, "wb") as f:
                torch.save(value, f)
        _fsync_path(path)
    return fmt


def _write_state(tmp: Path, step: int, state: dict[str, Any]) -> None:
    """Every entry, then meta.json, then the COMPLETE marker, all fsynced, into ``tmp``."""
    formats = {name: _write_entry(tmp, name, value) for name, value in state.items()}
    files = {
        str(file.relative_to(tmp)): {"size": file.stat().st_size, "sha256": _sha256(file)}
        for file in sorted(tmp.rglob("*"))
        if file.is_file()
    }
    meta = json.dumps({"step": step, "entries": formats, "files": files}, indent=1)
    for file_name, text in ((META_FILE, meta), (COMPLETE_MARKER, None)):
        if text is None:  # the marker carries meta.json's checksum: written last
            text = f"step {step}\n{META_FILE} sha256 {_sha256(tmp / META_FILE)}\n"
        with space_for(tmp / file_name, len(text)), open(tmp / file_name, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    _fsync_path(tmp)


def save_checkpoint(
    checkpoints_dir: str | os.PathLike,
    step: int,
    state: dict[str, Any],
    *,
    keep_last: int | None = None,
    staged: Path | None = None,
) -> Path:
    """Atomically write ``state`` as ``checkpoints_dir/step_{step}`` and return its path.

    ``state`` maps entry names (file-name safe: letters, digits, ``_.-``) to values: a flat
    ``{str: Tensor}`` dict goes to ``<name>.safetensors``, anything else to ``<name>.pt``.
    An existing ``step_{step}`` is replaced. Leftovers of crashed saves are removed first. A
    disk that fills up mid-save raises :class:`DiskFull` (one line: the file, the space it
    needed and the space left) after removing the partial save. Files get the mode the umask
    gives (0644 under umask 022), safetensors' included.
    ``keep_last=N`` then deletes all but the N highest-step complete checkpoints (the one just
    written is always kept; a folder whose meta.json records another step than its name is left
    alone and not counted). ``staged``: a directory from :func:`stage_checkpoint` that other
    files were written into; it is committed with them (every file in it is fsynced).
    """
    _check_step(step)
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last must be a positive int or None, got {keep_last!r}")
    if not isinstance(state, dict) or not state:
        raise ValueError("state must be a non-empty dict of entry name -> value")
    for name in state:
        if not isinstance(name, str) or not _ENTRY_NAME.fullmatch(name) or name == "meta":
            raise ValueError(
                f"state entry name {name!r} must match {_ENTRY_NAME.pattern} (used as a file "
                "name) and not be 'meta'"
            )
    root = Path(checkpoints_dir)
    if staged is None:
        tmp = stage_checkpoint(root, step)
    else:
        tmp = Path(staged)
        if tmp.parent.resolve() != root.resolve() or not tmp.is_dir():
            raise ValueError(f"staged={staged} is not a directory staged under {root}")
        for path in sorted(tmp.rglob("*")):
            _fsync_path(path)
    try:
        _write_state(tmp, step, state)
    except DiskFull:
        shutil.rmtree(tmp, ignore_errors=True)  # the space it took goes back; nothing else moved
        raise

    final = root / f"step_{step}"
    if final.exists():
        _remove_dir(final)
    os.rename(tmp, final)
    _fsync_path(root)

    if keep_last is not None:
        others = [
            path
            for step_of_name, path in list_checkpoints(root)
            if path != final and _read_meta(path)[0].get("step") == step_of_name
        ]  # a folder whose name is not its step (a copy?) is neither counted nor deleted
        for path in others[: max(0, len(others) - (keep_last - 1))]:
            _remove_dir(path)
    return final


class UnusableCheckpoint(ValueError):
    """A checkpoint that fails verification or whose files cannot be read; ``problem`` is what
    is wrong, naming the file."""

    def __init__(self, path: Path, problem: str):
        super().__init__(f"{path} is not a usable checkpoint: {problem}")
        self.problem = problem


def _load_entry(path: Path, name: str, fmt: str, map_location: Any, weights_only: bool) -> Any:
    file = path / _entry_file(name, fmt)
    try:
        if fmt == "safetensors":
            return load_file(file, device=str(map_location))
        return torch.load(file, map_location=map_location, weights_only=weights_only)
    except Exception as error:  # torch and safetensors raise many kinds for a bad file
        reason = " ".join(str(error).split())[:200]
        raise UnusableCheckpoint(path, f"{file.name} cannot be loaded ({reason})") from None


def load_checkpoint(
    path: str | os.PathLike,
    *,
    map_location: str | torch.device = "cpu",
    weights_only: bool = True,
) -> dict[str, Any]:
    """Read the ``state`` dict given to :func:`save_checkpoint` (see :func:`checkpoint_step`).

    Raises :class:`UnusableCheckpoint` (a ValueError) naming the file when the checkpoint does
    not verify or an entry cannot be read, e.g. a pickle that ``weights_only`` refuses.
    ``weights_only=False`` allows arbitrary pickled python objects in ``.pt`` entries (only for
    checkpoints you wrote yourself: unpickling runs code).
    """
    path = Path(path)
    problem = verify_checkpoint(path)
    if problem is not None:
        raise UnusableCheckpoint(path, problem)
    meta = json.loads((path / META_FILE).read_text())
    return {
        name: _load_entry(path, name, fmt, map_location, weights_only)
        for name, fmt in meta["entries"].items()
    }


def checkpoint_step(path: str | os.PathLike) -> int:
    """The step a checkpoint directory was saved at (from its ``meta.json``)."""
    return int(json.loads((Path(path) / META_FILE).read_text())["step"])


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG states: python, numpy (global), torch CPU and every visible CUDA device.

    Stored as tensors / python scalars so it loads with ``weights_only=True``. In distributed runs
    each rank has its own state: save one entry per rank (e.g. ``rng_rank3``).
    """
    _, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`."""
    missing = {"python", "numpy", "torch"} - set(state)
    if missing:
        raise ValueError(f"RNG state lacks {sorted(missing)}; expect capture_rng_state() output")
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"].cpu())
    cuda_states = state.get("cuda")
    if cuda_states is None:
        return
    if not torch.cuda.is_available():
        warnings.warn(
            "checkpoint has CUDA RNG states but CUDA is unavailable; they are not restored",
            stacklevel=2,
        )
        return
    if len(cuda_states) != torch.cuda.device_count():
        warnings.warn(
            f"checkpoint has {len(cuda_states)} CUDA RNG states, this process sees "
            f"{torch.cuda.device_count()} devices; restoring the first "
            f"{min(len(cuda_states), torch.cuda.device_count())}",
            stacklevel=2,
        )
    for device, cuda_state in enumerate(cuda_states[: torch.cuda.device_count()]):
        torch.cuda.set_rng_state(cuda_state.cpu(), device)


def restore_point(resume: str, checkpoints_dir: str) -> tuple[str | None, dict | None]:
    """``(checkpoint, state)`` that ``train.resume`` (``auto``, ``none`` or a checkpoint folder)
    names, ``(None, None)`` when there is none; a checkpoint that does not verify or load is
    one ConfigError line (``auto`` skips damaged newer ones with a warning)."""
    try:
        if resume == "auto":
            return load_latest(checkpoints_dir) or (None, None)
        if resume != "none":
            return resume, load_checkpoint(resume)
    except ValueError as error:
        raise ConfigError(f"train.resume: {error}") from None
    return None, None


def recorded_config(path: str | os.PathLike) -> dict[str, Any]:
    """``{"config": tree}`` of the checkpoint at ``path`` where it records the config it was
    trained with, else ``{}``, reading no other entry; raises :class:`UnusableCheckpoint` (a
    ValueError) naming the file when the checkpoint does not verify or the entry does not load."""
    path = Path(path)
    problem = verify_checkpoint(path)
    if problem is not None:
        raise UnusableCheckpoint(path, problem)
    fmt = json.loads((path / META_FILE).read_text())["entries"].get("config")
    return {} if fmt is None else {"config": _load_entry(path, "config", fmt, "cpu", True)}


def trained_with(restored: dict, checkpoint: str | os.PathLike) -> dict:
    """The config tree a checkpoint was trained with: its own record, or (checkpoints written
    before it had one) the config.yaml of the run folder that holds it."""
    if "config" in restored:
        return restored["config"]
    run_config = Path(checkpoint).parent.parent / "config.yaml"
    if not run_config.is_file():
        raise ConfigError(
            f"train.resume: {checkpoint} records no config and its run folder has no "
            "config.yaml, so what it was trained with cannot be checked; resume it from its "
            "run folder"
        )
    return yaml.safe_load(run_config.read_text(encoding="utf-8"))


def set_learning_rate(optimizer: torch.optim.Optimizer, schedule: Any, lr: float) -> None:
    """Gives a restored optimizer and its ``LambdaLR`` schedule the base learning rate ``lr``;
    the schedule keeps its place (a warm-up goes on from where it was)."""
    for group, base in zip(optimizer.param_groups, schedule.base_lrs, strict=True):
        group["lr"] *= lr / base
        group["initial_lr"] = lr
    schedule.base_lrs = [lr] * len(schedule.base_lrs)
    schedule._last_lr = [group["lr"] for group in optimizer.param_groups]


def _metrics_after(path: Path, step: int) -> tuple[list[str], list[str]]:
    """The lines of metrics.jsonl at ``path`` that are rows of steps after ``step``, and the
    others (rows up to it, and any line that is no row: the logger's to sort out)."""
    later, kept = [], []
    with open(path, encoding="utf-8", errors="surrogateescape") as handle:
        for line in handle:
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            is_later = isinstance(row, dict) and isinstance(row.get("step"), int)
            (later if is_later and row["step"] > step else kept).append(line)
    return later, kept


def _write_lines(path: Path, lines: list[str]) -> None:
    """``lines`` into ``path``, replacing it whole (fsynced first)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8", errors="surrogateescape") as handle:
        handle.writelines(lines)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def set_aside_branch(out_dir: str | os.PathLike, step: int) -> Path | None:
    """Moves the checkpoints after ``step`` under ``out_dir/checkpoints`` (a branch abandoned by
    resuming an older checkpoint, or damaged ones ``resume=auto`` skipped) with the metrics rows
    after ``step`` into a new ``out_dir/abandoned/after_step_<step>-<time>-*/``; returns it, or
    None when there is no later checkpoint. The rows are copied before any checkpoint moves and
    leave metrics.jsonl last, so a crash midway loses nothing."""
    root = Path(out_dir)
    later = [path for found, path in list_checkpoints(root / "checkpoints") if found > step]
    if not later:
        return None
    if os.path.lexists(root / "abandoned") and not (root / "abandoned").is_dir():
        raise ConfigError(
            f"out_dir: {root / 'abandoned'} is not a folder, and resuming step {step} sets the "
            "later checkpoints aside there; move it away"
        )
    (root / "abandoned").mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = Path(tempfile.mkdtemp(prefix=f"after_step_{step}-{stamp}-", dir=root / "abandoned"))
    os.chmod(aside, 0o755)  # mkdtemp makes it owner-only
    (aside / "checkpoints").mkdir()
    metrics = root / "metrics.jsonl"
    rows, kept = _metrics_after(metrics, step) if metrics.is_file() else ([], [])
    if rows:
        _write_lines(aside / "metrics.jsonl", rows)
    for path in later:
        os.rename(path, aside / "checkpoints" / path.name)
    _fsync_path(root / "checkpoints")
    if rows:
        _write_lines(metrics, kept)
    return aside
