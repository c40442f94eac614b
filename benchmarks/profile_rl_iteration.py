"""Where one RL iteration's time goes, by part: the trainer (``vsa2-rl train``, in-process) runs
``--steps`` steps of a config and torch.profiler records the last one; the table splits that
step by the trainer's phases (its ``vsa2_rl/<phase>`` record_function ranges: rollout text
encoding, sampling and VAE decode, rewards, the update's forward+backward and optimizer,
evaluation, checkpoint) and, within each, the device time by kernel class.

    python benchmarks/profile_rl_iteration.py --config configs/wan2_1_1.3b_vsa2_grpo.yaml \\
        model.path=/tmp/wan1.3b rl.prompts_per_step=1 --steps 2 --out profile.md --trace t.json

How the numbers are made:

- wall: host time of the phase's ranges on the thread that ran them, less the ranges of other
  phases nested in them (so the rows add up); "outside any phase" is the rest of the step (the
  loop's own work, logging, ...). The step's wall is time.perf_counter around the whole step.
- device time (CUDA): each kernel's duration, charged to the CPU op that launched it (the
  profiler's correlation), that op to its innermost enclosing phase range. On CPU the columns
  hold the operators' self time instead (aten ops, classified by op name) and host gap is n/a.
- which phase an op belongs to: its ``cpu_parent`` chain on its own thread; an op whose thread
  holds no phase range (CUDA's autograd engine runs the backward on a thread of its own) goes
  to the innermost phase range of any thread whose [start, end] holds the op's start.
- kernel class: the first entry of :data:`KERNEL_CLASSES` whose substring the kernel's name
  holds (lower case); a name that matches none is tried with its launching op's name, then that
  op's parents' up to the phase. Attention counts as backward when the name says so (bwd,
  backward) or the op runs under the autograd engine. The largest names left in "other" are
  listed under the table, to extend the classes.
- host gap: the phase's wall less its device time; negative where the host queued kernels that
  ran after its range ended (the next phase then waits for them).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import datetime
import functools
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from vsa2_rl.config import load_config
from vsa2_rl.rl.trainer import RLTrainer

PHASE_PREFIX = "vsa2_rl/"
STEP_RANGE = "profile_rl_iteration/step"
OUTSIDE = "outside any phase"
ATTENTION = "attention"
CLASSES = (
    "attention fwd",
    "attention bwd",
    "matrix products",
    "convolutions",
    "norms, elementwise",
    "optimizer",
    "other",
)
# (class, substrings of lower-cased kernel or op names), first match wins. Attention: the SDPA
# backends (FlashAttention, cuDNN, memory-efficient fmha, CPU flash) and the VSA2 kernels
# (kernels/*.py: block-sparse fine stage, Gluon variants, pooling, router top-k, fusion).
# Convolutions before products: cuDNN's implicit-GEMM convolutions say gemm too. NCCL's
# collectives (all-reduce) stay in "other", before "reduce" would call them elementwise.
KERNEL_CLASSES = (
    ("other", ("nccl",)),
    (ATTENTION, ("flash", "fmha", "sdpa", "scaled_dot_product", "_attn", "attention",
                 "_bsa_", "_pool_fwd", "_pool_bwd", "_pool_qkv", "_topk_log_softmax",
                 "_dense_score_grad", "_fusion_fwd", "_fusion_bwd", "_toplogprobs",
                 "_permutetokens", "_pooltiles", "_poolqkv", "_gatedfusion")),
    ("optimizer", ("adam", "multi_tensor", "_foreach", "optimizer.")),
    ("convolutions", ("conv", "fprop", "dgrad", "wgrad", "implicit_gemm")),
    ("matrix products", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "triton_tem",
                         "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
                         "aten::linear", "aten::matmul", "aten::einsum")),
    ("norms, elementwise", ("norm", "elementwise", "vectorized", "unrolled", "reduce",
                            "softmax", "fill", "index", "gather", "scatter", "cat",
                            "triton_", "aten::")),
)  # fmt: skip


@functools.cache  # a step holds a few thousand distinct names among up to millions of events
def _match(name: str) -> str | None:
    lowered = name.lower()
    for kind, substrings in KERNEL_CLASSES:
        if any(s in lowered for s in substrings):
            return kind
    return None


def classify(names: list[str], backward: bool) -> str:
    """The class of a kernel (or CPU op) from ``names``: its own name, then its launching op's
    and that op's parents'. Any of them naming attention makes it attention (a copy inside the
    attention op is the op's cost); else the first name that matches a class decides.
    ``backward``: it runs under the autograd engine."""
    kinds = [_match(name) for name in names]
    if ATTENTION in kinds:
        said = " ".join(names).lower()
        is_bwd = backward or "bwd" in said or "backward" in said
        return "attention bwd" if is_bwd else "attention fwd"
    return next((kind for kind in kinds if kind is not None), "other")


@dataclass
class PhaseTimes:
    """One row: a phase's calls, wall (us, less nested phases) and device/self time by class."""

    calls: int = 0
    wall_us: float = 0.0
    by_class: Counter = field(default_factory=Counter)

    @property
    def busy_us(self) -> float:
        return sum(self.by_class.values())


@dataclass
class StepProfile:
    """The profiled step split by phase, with the largest unclassified names."""

    phases: dict[str, PhaseTimes]
    other_names: Counter
    step_wall_us: float
    on_device: bool


def _phase_name(event) -> str | None:
    return event.name[len(PHASE_PREFIX) :] if event.name.startswith(PHASE_PREFIX) else None


class _RangeIndex:
    """The phase ranges of all threads, for an op whose thread holds none: the innermost range
    holding a time (the latest-starting one that still runs then)."""

    def __init__(self, ranges: list):
        self.ranges = sorted(ranges, key=lambda e: e.time_range.start)
        self.starts = [e.time_range.start for e in self.ranges]

    def innermost(self, time_us: float):
        for index in range(bisect.bisect_right(self.starts, time_us) - 1, -1, -1):
            event = self.ranges[index]
            if event.time_range.end >= time_us:
                return event
        return None


def _in_step(event, step) -> bool:
    return step.time_range.start <= event.time_range.start <= step.time_range.end


def _ancestor_range(event):
    """The innermost phase range or step range above ``event`` on its thread, or None."""
    parent = event.cpu_parent
    while parent is not None and not (_phase_name(parent) or parent.name == STEP_RANGE):
        parent = parent.cpu_parent
    return parent


def _op_context(event, stop) -> tuple[list[str], bool]:
    """``event``'s name and its parents' up to ``stop`` (the phase range), and whether it runs
    under the autograd engine (a backward)."""
    names, node, backward = [], event, False
    while node is not None and node is not stop:
        names.append(node.name)
        backward = backward or node.name.startswith("autograd::engine")
        node = node.cpu_parent
    return names, backward


def attribute(events, step_wall_us: float, on_device: bool) -> StepProfile:
    """Splits the profiled step (the events under :data:`STEP_RANGE`) by phase and class."""
    step = next((e for e in events if e.name == STEP_RANGE), None)
    if step is None:
        raise ValueError(f"the profile holds no {STEP_RANGE!r} range: no step was profiled")
    cpu = [e for e in events if e.device_type == DeviceType.CPU and _in_step(e, step)]
    ranges = [e for e in cpu if _phase_name(e)]
    index = _RangeIndex(ranges)
    phases: dict[str, PhaseTimes] = {OUTSIDE: PhaseTimes()}
    for event in ranges:
        row = phases.setdefault(_phase_name(event), PhaseTimes())
        row.calls += 1
        row.wall_us += event.time_range.elapsed_us()
        parent = _ancestor_range(event)
        if parent is not None and _phase_name(parent):
            outer = phases.setdefault(_phase_name(parent), PhaseTimes())
            outer.wall_us -= event.time_range.elapsed_us()
    nested_wall = sum(e.time_range.elapsed_us() for e in ranges if _ancestor_range(e) is step)
    phases[OUTSIDE].wall_us = max(0.0, step_wall_us - nested_wall)
    other_names: Counter = Counter()
    for event in cpu:
        owner = _owner(event, step, index)
        names, backward = _op_context(event, owner)
        row = phases[_phase_name(owner) if owner is not None and _phase_name(owner) else OUTSIDE]
        for name, duration in _timed_names(event, on_device):
            kind = classify([name, *names], backward)
            row.by_class[kind] += duration
            if kind == "other":
                other_names[name] += duration
    return StepProfile(phases, other_names, step_wall_us, on_device)


def _owner(event, step, index: _RangeIndex):
    """The range ``event``'s time goes to: itself for a range (kernels launched in no op),
    else its innermost range on its thread or, on a thread without phase ranges (the CUDA
    autograd engine's), the innermost phase range of any thread at its start."""
    if event is step or _phase_name(event):
        return event
    return _ancestor_range(event) or index.innermost(event.time_range.start)


def _timed_names(event, on_device: bool) -> list[tuple[str, float]]:
    """What ``event`` adds to its phase: its kernels (name, us) on a device, its self time on
    the CPU (user ranges such as Optimizer.step add none: their self time is Python's)."""
    if on_device:
        return [(kernel.name, kernel.duration) for kernel in event.kernels]
    if event.is_user_annotation or event.is_python_function:
        return []
    return [(event.name, event.self_cpu_time_total)]


def format_table(result: StepProfile, header: str, top_other: int = 10) -> str:
    """The markdown report: header, one row per phase (largest wall first), totals, shares of
    the step, and the largest names in "other"."""
    busy = "device" if result.on_device else "CPU op self"
    columns = ["phase", "calls", "wall ms", "% step", *CLASSES, f"{busy} ms", "host gap ms"]
    lines = [header, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    rows = sorted(result.phases.items(), key=lambda item: -item[1].wall_us)
    step_us = result.step_wall_us
    for name, times in rows:
        lines.append(_row(name, times.calls, times.wall_us, times.by_class, step_us, result))
    totals: Counter = Counter()
    for times in result.phases.values():
        totals.update(times.by_class)
    calls = sum(t.calls for t in result.phases.values())
    lines.append(_row("**step**", calls, step_us, totals, step_us, result))
    all_busy = sum(totals.values()) or 1.0
    shares = [f"{100 * totals[kind] / all_busy:.1f}%" for kind in CLASSES]
    lines.append("| share of " + busy + " time | | | | " + " | ".join(shares) + " | 100% | |")
    lines += ["", attention_bound(totals, step_us, busy)]
    lines += ["", f'Largest names in "other" ({busy} ms):', ""]
    for name, us in result.other_names.most_common(top_other):
        lines.append(f"- {us / 1e3:.1f} `{name[:160]}`")
    return "\n".join(lines) + "\n"


def attention_bound(totals: Counter, step_us: float, busy: str) -> str:
    """The most any attention speed-up can give this step (Amdahl): its wall against the wall
    less every attention kernel's time, as if attention took none and nothing else changed."""
    attention_us = totals["attention fwd"] + totals["attention bwd"]
    said = f"Attention: {attention_us / 1e3:.1f} ms {busy} time"
    rest_us = step_us - attention_us
    if rest_us <= 0:  # CPU self times of threads running side by side can exceed the wall
        return f"{said}, not less than the step's wall: no bound."
    return (
        f"{said}, {100 * attention_us / step_us:.1f}% of the step's wall; were it free, the "
        f"step would be at most {step_us / rest_us:.2f}x faster."
    )


def _row(name, calls, wall_us, by_class, step_us, result) -> str:
    busy_us = sum(by_class.values())
    gap = f"{(wall_us - busy_us) / 1e3:.1f}" if result.on_device else "n/a"
    cells = [
        name,
        str(calls) if calls else "",
        f"{wall_us / 1e3:.1f}",
        f"{100 * wall_us / step_us:.1f}" if step_us else "",
        *(f"{by_class[kind] / 1e3:.1f}" for kind in CLASSES),
        f"{busy_us / 1e3:.1f}",
        gap,
    ]
    return "| " + " | ".join(cells) + " |"


class ProfiledTrainer(RLTrainer):
    """The trainer, recording its last step with torch.profiler (``self.profiler``) and timing
    it with time.perf_counter (``self.step_seconds``)."""

    profiler: profile | None = None
    step_seconds: float = 0.0

    @contextlib.contextmanager
    def step_scope(self, step: int):
        if step != self.config.train.num_steps:
            yield
            return
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        _synchronize(self.device)  # earlier steps' queued kernels stay out of this one
        with profile(activities=activities) as self.profiler, record_function(STEP_RANGE):
            start = time.perf_counter()
            try:
                yield
            finally:
                _synchronize(self.device)
                self.step_seconds = time.perf_counter() - start


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_profiled(config_path: str | None, overrides: list[str], steps: int) -> ProfiledTrainer:
    """``vsa2-rl train`` of ``config_path`` with ``overrides`` and ``train.num_steps=steps``
    (a fresh temporary out_dir unless ``overrides`` name one), its last step profiled."""
    from vsa2_rl.check import before_loading

    keys = {item.split("=", 1)[0].strip() for item in overrides}
    if "train.num_steps" in keys:
        raise SystemExit("error: train.num_steps: give the number of steps as --steps")
    if steps < 1:
        raise SystemExit(f"error: --steps must be at least 1, got {steps}")
    extra = [f"train.num_steps={steps}"]
    if "out_dir" not in keys:
        extra.append(f"out_dir={tempfile.mkdtemp(prefix='profile_rl_')}/run")
    config = load_config(config_path, [*overrides, *extra], check_files=False)
    report = before_loading(config)
    if report.problems:
        raise SystemExit("\n".join(f"error: {problem}" for problem in report.problems))
    trainer = ProfiledTrainer(config, report.facts)
    trainer.train()
    return trainer


def _header(config_path: str | None, overrides: list[str], trainer: ProfiledTrainer) -> str:
    device = trainer.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    date = datetime.date.today().isoformat()
    step = trainer.config.train.num_steps
    return (
        f"Profile of RL step {step} (of {step}): {name}, torch {torch.__version__}, {date}; "
        f"config {config_path or '(defaults)'}, overrides: {' '.join(overrides) or 'none'}; "
        f"step wall {trainer.step_seconds:.2f} s (perf_counter)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="the run's YAML config (vsa2-rl train --config)")
    parser.add_argument("--steps", type=int, default=2, help="steps to run; the last is profiled")
    parser.add_argument("--out", help="also write the markdown table here")
    parser.add_argument("--trace", help="also export the profiled step's chrome trace here")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE overrides, as vsa2-rl train's")
    args = parser.parse_intermixed_args(argv)
    trainer = run_profiled(args.config, args.overrides, args.steps)
    started = time.perf_counter()  # the analysis of a large step takes minutes: say where it is
    print("reading the profiled step's events ...", flush=True)
    events = trainer.profiler.events()
    print(
        f"{len(events)} events in {time.perf_counter() - started:.0f} s; attributing ...",
        flush=True,
    )
    result = attribute(events, trainer.step_seconds * 1e6, trainer.device.type == "cuda")
    print(f"attributed in {time.perf_counter() - started:.0f} s", flush=True)
    table = format_table(result, _header(args.config, args.overrides, trainer))
    print(table)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(table)
    if args.trace:
        trainer.profiler.export_chrome_trace(args.trace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
