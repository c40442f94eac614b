"""A training run's hold on its ``out_dir``: one run writes a folder at a time, and a start that
fails leaves no half-made folder behind.

The main process takes an exclusive ``fcntl.flock`` on ``out_dir/.lock`` before anything of the
run is written there, and holds it for the run's life: a second run on the folder stops at once
with one ``error: out_dir: ...`` line, instead of logging every step twice and overwriting the
first run's checkpoints. The OS drops the lock with its process however that ends, so a killed
run leaves nothing stuck (the empty ``.lock`` file stays; it is no lock by itself). Under a
multi-process launch only the main process writes the folder, so it alone locks; the others
learn its verdict through a broadcast and stop with it.

A start that fails (set-up and resume: a config error found after the folder was made, a
tracker that cannot start) removes the folders this run made, so no ``config.yaml`` is left alone
in a fresh folder. A folder that was there before is never cleaned, and once the run is under
way (:meth:`RunFolder.keep`) a failure leaves its checkpoints and metrics for
``train.resume=auto``.
"""

from __future__ import annotations

import fcntl
import os
import shutil

from vsa2_rl.config import ConfigError

LOCK_FILE = ".lock"


def _outermost_missing(path: str) -> str | None:
    """The outermost folder on ``path`` that does not exist yet (None when ``path`` exists)."""
    path, missing = os.path.abspath(path), None
    while not os.path.lexists(path):
        path, missing = os.path.dirname(path), path
    return missing


class RunFolder:
    """``with RunFolder(out_dir) as folder:`` around a run; :meth:`claim` locks the folder,
    leaving the block releases it (and removes what the claim made if the start failed)."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self._lock = None  # the open lock file (main process only)
        self._made: str | None = None  # the outermost folder the claim made
        self._started = False

    def claim(self, accelerator) -> None:
        """Makes and locks the folder on the main process; ConfigError on every process when
        another run holds it."""
        from accelerate.utils import broadcast_object_list

        verdict = [self._lock_folder() if accelerator.is_main_process else None]
        broadcast_object_list(verdict)
        if verdict[0] is not None:
            raise ConfigError(verdict[0])

    def keep(self) -> None:
        """The start is over: from here on the folder holds the run, whatever happens."""
        self._started = True

    def _lock_folder(self) -> str | None:
        """None once the folder is locked, else the one line that stops the run."""
        made = _outermost_missing(self.out_dir)
        os.makedirs(self.out_dir, exist_ok=True)
        handle = open(os.path.join(self.out_dir, LOCK_FILE), "a")  # noqa: SIM115 (held)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            return (
                f"out_dir: {self.out_dir} is in use by another training run; wait for it to "
                "end, or give another out_dir"
            )
        self._lock, self._made = handle, made
        return None

    def __enter__(self) -> RunFolder:
        return self

    def __exit__(self, kind, error, trace) -> None:
        if error is not None and not self._started and self._made is not None:
            shutil.rmtree(self._made, ignore_errors=True)  # still locked: no run writes there
        if self._lock is not None:
            self._lock.close()  # releases the lock
