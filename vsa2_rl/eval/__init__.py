"""Evaluation of rewards and latency at several inference sparsities (``vsa2-rl eval``)."""

from vsa2_rl.eval.media import save_video_grid
from vsa2_rl.eval.sweep import evaluate, plot_sweep, sweep_model

__all__ = ["evaluate", "plot_sweep", "save_video_grid", "sweep_model"]
