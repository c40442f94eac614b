"""metrics.jsonl across a resume: rows are cut back to the checkpoint's step, and a line that is
no row is set aside, never taken as the end of the file."""

import importlib.machinery
import json

import pytest

from vsa2_rl.config import RunConfig
from vsa2_rl.rl.tracking import MetricsLogger, read_metrics


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def test_resume_keeps_the_rows_after_a_blank_or_garbled_line(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": step, "loss": step / 10}) for step in (1, 2, 3, 4)]
    _write(metrics, [rows[0], "", rows[1], '{"step": 3, "lo', rows[2], rows[3]])
    with pytest.warns(UserWarning, match="2 line"):
        logger = MetricsLogger(RunConfig(out_dir=str(tmp_path)), resume_step=4)
    logger.log(5, {"loss": 0.5})
    assert [row["step"] for row in read_metrics(str(metrics))] == [1, 2, 3, 4, 5]
    aside = (tmp_path / "metrics.jsonl.unreadable").read_text(encoding="utf-8")
    assert aside == '\n{"step": 3, "lo\n'


def test_resume_drops_only_rows_past_the_checkpoint(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    _write(metrics, [json.dumps({"step": step}) for step in (1, 2, 3)])
    MetricsLogger(RunConfig(out_dir=str(tmp_path)), resume_step=2)
    assert [row["step"] for row in read_metrics(str(metrics))] == [1, 2]
    assert not (tmp_path / "metrics.jsonl.unreadable").exists()


@pytest.mark.slow
def test_a_full_disk_while_logging_is_one_line_naming_metrics_jsonl(tmp_path):
    import subprocess
    import sys

    script = (
        "import resource, sys\n"
        "from vsa2_rl.config import RunConfig\n"
        "from vsa2_rl.rl.checkpoint import DiskFull\n"
        "from vsa2_rl.rl.tracking import MetricsLogger\n"
        "logger = MetricsLogger(RunConfig(out_dir=sys.argv[1]))\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.RLIM_INFINITY))\n"
        "try:\n"
        "    logger.log(1, {'note': 'x' * 5000})\n"
        "except DiskFull as error:\n"
        "    print(error.strerror)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"metrics: writing {tmp_path}/metrics.jsonl failed: its disk")


def test_a_resumed_run_logs_into_the_same_wandb_run(tmp_path, monkeypatch):
    import sys

    from vsa2_rl.config import LoggingConfig

    started = []
    fake = type(sys)("wandb")
    fake.init = lambda **kwargs: started.append(kwargs)
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # find_spec("wandb") works
    monkeypatch.setitem(sys.modules, "wandb", fake)
    config = RunConfig(out_dir=str(tmp_path), logging=LoggingConfig(report_to=["wandb"]))
    MetricsLogger(config)  # the first start
    MetricsLogger(config, resume_step=3)  # a resume
    (tmp_path / "other").mkdir()
    MetricsLogger(RunConfig(out_dir=str(tmp_path / "other"), logging=config.logging))
    first, resumed, other = (kwargs["id"] for kwargs in started)
    assert first == resumed and other != first and len(first) == 16
    assert all(kwargs["resume"] == "allow" for kwargs in started)


def test_a_resume_purges_the_tensorboard_events_logged_after_its_checkpoint(tmp_path, monkeypatch):
    import torch.utils.tensorboard

    from vsa2_rl.config import LoggingConfig

    opened = []

    class Writer:
        def __init__(self, log_dir, **kwargs):
            opened.append(kwargs)

        def add_text(self, *args):
            pass

    monkeypatch.setattr(torch.utils.tensorboard, "SummaryWriter", Writer)
    config = RunConfig(out_dir=str(tmp_path), logging=LoggingConfig(report_to=["tensorboard"]))
    MetricsLogger(config, resume_step=3)
    assert opened == [{"purge_step": 4}]  # steps 4.. were logged by the run that was cut


def test_the_reward_curve_plots_each_guard_once_and_not_its_spread(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    from vsa2_rl.rl.tracking import plot_reward_curve

    labels = []
    plot = Axes.plot

    def recording_plot(self, *args, **kwargs):
        labels.append(kwargs.get("label"))
        return plot(self, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", recording_plot)
    evaluation = {"eval/reward": 0.5, "eval/guard/shape_fidelity": 0.9}
    evaluation["eval/guard/shape_fidelity_std"] = 0.1
    rows = [{"step": 0, **evaluation}, {"step": 1, "reward/mean": 0.4, "reward/std": 0.1}]
    plot_reward_curve(rows, str(tmp_path / "curve.png"))
    assert (tmp_path / "curve.png").exists()
    assert labels == [
        "rollout reward (rollout sparsity)",
        "eval reward (ODE, eval sparsity, eval prompts)",
        "guard/shape_fidelity",
    ]
