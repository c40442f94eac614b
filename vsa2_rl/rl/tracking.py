"""Metric sinks of a run: ``out_dir/metrics.jsonl`` always (one JSON object per step), plus
wandb (offline by default) and tensorboard when ``logging.report_to`` asks for them (the whole
resolved config, the metrics, and each evaluation's videos with their rewards in the caption),
and the reward-curve figure written at the end of a run."""

from __future__ import annotations

import json
import math
import os
import uuid
import warnings
from typing import Any

from vsa2_rl.config import RunConfig, config_tree, to_yaml
from vsa2_rl.rl.checkpoint import space_for


class MetricsLogger:
    """Writes one line per step to metrics.jsonl and mirrors it to the configured trackers.

    On resume the file is cut back to the steps <= the checkpoint's step, so a run killed after
    logging a step but before checkpointing it does not log that step twice. A line that is not
    a step's row (blank, garbled, torn by a crash) is never dropped: it is moved, with a
    warning, to ``metrics.jsonl.unreadable`` beside it, and every row around it is kept.
    """

    def __init__(self, config: RunConfig, resume_step: int = 0, enabled: bool = True):
        self.enabled = enabled
        self.path = os.path.join(config.out_dir, "metrics.jsonl")
        self._wandb = None
        self._tensorboard = None
        if not enabled:
            return
        self._truncate(resume_step)
        if "wandb" in config.logging.report_to:
            import wandb

            self._wandb = wandb.init(
                project=config.logging.project,
                dir=config.out_dir,
                mode=config.logging.wandb_mode,
                config=config_tree(config),
                id=_wandb_run_id(config.out_dir),
                resume="allow",
            )
        if "tensorboard" in config.logging.report_to:
            from torch.utils.tensorboard import SummaryWriter

            # a resume drops the events logged after its checkpoint, as metrics.jsonl does
            self._tensorboard = SummaryWriter(
                os.path.join(config.out_dir, "tensorboard"), purge_step=resume_step + 1
            )
            self._tensorboard.add_text("config", f"```\n{to_yaml(config)}```", 0)

    def _truncate(self, resume_step: int) -> None:
        if not os.path.exists(self.path):
            return
        kept, unreadable = [], []
        with open(self.path, encoding="utf-8", errors="surrogateescape") as handle:
            for line in handle:
                row = _row(line)
                if row is None:
                    unreadable.append(line if line.endswith("\n") else line + "\n")
                elif row["step"] <= resume_step:
                    kept.append(line)
        if unreadable:
            self._quarantine(unreadable)
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8", errors="surrogateescape") as handle:
            handle.writelines(kept)
        os.replace(tmp, self.path)

    def _quarantine(self, lines: list[str]) -> None:
        """Appends ``lines`` to metrics.jsonl.unreadable (fsynced before the log is rewritten)."""
        aside = self.path + ".unreadable"
        with open(aside, "a", encoding="utf-8", errors="surrogateescape") as handle:
            handle.writelines(lines)
            handle.flush()
            os.fsync(handle.fileno())
        warnings.warn(
            f"{self.path}: {len(lines)} line(s) that are no metrics row moved to {aside}; the "
            "other rows are kept",
            stacklevel=3,
        )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{key: _plain(value) for key, value in metrics.items()}}
        line = json.dumps(row) + "\n"
        with (
            space_for(self.path, len(line), "metrics"),
            open(self.path, "a", encoding="utf-8") as f,
        ):
            f.write(line)
        if self._wandb is not None:
            self._wandb.log(row, step=step)
        if self._tensorboard is not None:
            for key, value in row.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._tensorboard.add_scalar(key, value, step)

    def log_videos(self, step: int, tag: str, gif: str, png: str, captions: list[str]) -> None:
        """An evaluation's videos for the trackers: wandb gets the GIF as a video, tensorboard
        (whose video encoder needs moviepy) the PNG contact sheet; both with one caption line
        per video (prompt and rewards)."""
        if not self.enabled:
            return
        caption = "\n".join(f"{i}: {text}" for i, text in enumerate(captions))
        if self._wandb is not None:
            import wandb

            self._wandb.log({tag: wandb.Video(gif, caption=caption, format="gif")}, step=step)
        if self._tensorboard is not None:
            import numpy as np
            from PIL import Image

            sheet = np.asarray(Image.open(png).convert("RGB"))
            self._tensorboard.add_image(tag, sheet, step, dataformats="HWC")
            self._tensorboard.add_text(tag, caption.replace("\n", "  \n"), step)

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
        if self._tensorboard is not None:
            self._tensorboard.close()


def _wandb_run_id(out_dir: str) -> str:
    """The wandb run id of the run in ``out_dir``, made at its first start and kept in
    ``out_dir/.wandb_id``: every resume logs into the same wandb run (``resume="allow"``
    without an id started a new one each time, splitting the run's curves)."""
    path = os.path.join(out_dir, ".wandb_id")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as handle:
            saved = handle.read().strip()
        if saved:
            return saved
    run_id = uuid.uuid4().hex[:16]
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(run_id + "\n")
    return run_id


def _plain(value: Any) -> Any:
    """JSON-safe scalars: tensors become floats; NaN/inf are kept as strings JSON can hold."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _row(line: str) -> dict[str, Any] | None:
    """The metrics row a line of metrics.jsonl holds, or None for anything else."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    if not isinstance(row, dict) or not isinstance(row.get("step"), int):
        return None
    return row


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl file; lines that are no row (a torn last line from a crash,
    a garbled one) are skipped, and the rows after them still read."""
    with open(path, encoding="utf-8", errors="surrogateescape") as handle:
        rows = [_row(line) for line in handle]
    return [row for row in rows if row is not None]


# the velocity agreement with dense attention an evaluation logs (vsa2_rl.eval.agreement)
AGREEMENT_LABELS = {
    "eval/velocity_rel_error": "at the eval sparsity",
    "eval/rollout_velocity_rel_error": "at the rollout sparsity",
}


def plot_reward_curve(rows: list[dict[str, Any]], path: str) -> None:
    """Rollout reward per step (mean with a +-std band) and the evaluation reward, then a panel
    each for what the evaluations logged of: the guard metrics (``eval/guard/*``, their spreads
    left out) and the relative velocity error against dense attention (``AGREEMENT_LABELS``),
    from metrics.jsonl rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [row for row in rows if isinstance(row.get("reward/mean"), (int, float))]
    evals = [row for row in rows if "eval/reward" in row]
    guards = sorted(
        {k for row in evals for k in row if k.startswith("eval/guard/") and not k.endswith("_std")}
    )
    agreement = [key for key in AGREEMENT_LABELS if any(key in row for row in evals)]
    panels = [
        ("guard metrics (eval, never trained on)", guards),
        ("relative velocity error vs dense attention (eval prompts)", agreement),
    ]
    panels = [(title, keys) for title, keys in panels if keys]
    fig, (axes,) = plt.subplots(
        1, 1 + len(panels), figsize=(6 + 5 * len(panels), 3.5), squeeze=False
    )
    ax = axes[0]
    steps = [row["step"] for row in train]
    mean = [row["reward/mean"] for row in train]
    std = [row.get("reward/std", 0.0) for row in train]
    ax.plot(steps, mean, marker="o", ms=3, label="rollout reward (rollout sparsity)")
    ax.fill_between(
        steps,
        [m - s for m, s in zip(mean, std, strict=True)],
        [m + s for m, s in zip(mean, std, strict=True)],
        alpha=0.2,
    )
    if evals:
        ax.plot(
            [row["step"] for row in evals],
            [row["eval/reward"] for row in evals],
            marker="s",
            color="C3",
            label="eval reward (ODE, eval sparsity, eval prompts)",
        )
    ax.set_title("trained reward", fontsize=10)
    for panel, (title, keys) in zip(axes[1:], panels, strict=True):
        for key in keys:
            points = [(row["step"], row[key]) for row in evals if key in row]
            label = AGREEMENT_LABELS.get(key, key.removeprefix("eval/"))
            panel.plot(*zip(*points, strict=True), marker="s", label=label)
        panel.set_title(title, fontsize=10)
    for panel in axes:
        panel.set_xlabel("RL step")
        panel.grid(alpha=0.3)
        panel.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
