"""``vsa2-rl export``: a trained run's weights in the formats other tools load.

From the newest checkpoint of ``run_dir=`` (or ``checkpoint=``), with its EMA weights where the
run kept an EMA, into ``out_dir``:

- a LoRA run: ``adapter_config.json`` + ``adapter_model.safetensors``, a peft adapter folder
  (``LoraConfig.from_pretrained`` and ``set_peft_model_state_dict`` load it, and
  ``model.lora.init_from`` starts a new run from it);
- a full fine-tuning run: ``transformer/``, a diffusers ``from_pretrained`` folder of the model
  without its VSA2 layers;
- always ``vsa2.safetensors``, the VSA2 router and gate parameters (Wan's
  ``blocks.{i}.attn1.vsa2.*``, HunyuanVideo-1.5's and MiniMax-H3's
  ``transformer_blocks.{i}.attn.vsa2.*``, LTX-2's ``transformer_blocks.{i}.attn1.vsa2.*``,
  loaded after the family's ``enable_vsa2``), and ``vsa2_attention.json``, the attention and
  sparsity settings they were trained with and where they came from.

A Wan2.2 A14B run exports each trained expert into the folder the diffusers pipeline names it
by (``transformer/`` for high noise, ``transformer_2/`` for low noise): its adapter files or its
diffusers files, and its ``vsa2.safetensors``; ``vsa2_attention.json`` lists the experts.

Nothing is written unless every file is: the folder is assembled next to ``out_dir`` (next to
the folder it links to, where it is a symbolic link) and renamed into place, with the
permissions the umask gives (0755 folders, 0644 files under umask 022). An ``out_dir`` inside
a run's ``checkpoints/`` is refused. The assembly folder, ``.export-<name>.<host>.<pid>-*``, is
removed on any failure and on SIGTERM (a scheduler's stop); one left by an export that was
killed outright (SIGKILL, a power loss) is removed by the next export to the same ``out_dir``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading

import torch
from safetensors.torch import save_file

from vsa2_rl.config import ConfigError, EvalTargets, RunConfig
from vsa2_rl.runtime import ADAPTER_WEIGHTS, VSA2_WEIGHTS, check_output_dir, load_model

VSA2_SETTINGS = "vsa2_attention.json"


def _vsa2_state(transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: value.detach().to("cpu", torch.float32).contiguous()
        for name, value in transformer.state_dict().items()
        if ".vsa2." in f".{name}"
    }


def _write_adapter(transformer: torch.nn.Module, folder: str) -> None:
    from peft.utils import get_peft_model_state_dict

    weights = get_peft_model_state_dict(transformer)
    save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()},
              os.path.join(folder, ADAPTER_WEIGHTS))  # fmt: skip
    transformer.peft_config["default"].save_pretrained(folder)


def _write_transformer(transformer: torch.nn.Module, folder: str) -> None:
    """The model without its VSA2 layers, as a diffusers folder (a fresh instance of its class
    holds the trained base weights, so no VSA2 module or hook is saved)."""
    plain = type(transformer).from_config(transformer.config)
    base = {k: v for k, v in transformer.state_dict().items() if ".vsa2." not in f".{k}"}
    plain.load_state_dict(base)
    plain.save_pretrained(folder)


def _write_model(transformer: torch.nn.Module, folder: str, lora: bool) -> list[str]:
    """The trained weights of ``transformer`` into ``folder`` (see the module docstring);
    returns the experts written."""
    from vsa2_rl.models.experts import EXPERT_FOLDERS, WanExperts

    if not isinstance(transformer, WanExperts):
        if lora:
            _write_adapter(transformer, folder)
        else:
            _write_transformer(transformer, os.path.join(folder, "transformer"))
        save_file(_vsa2_state(transformer), os.path.join(folder, VSA2_WEIGHTS))
        return []
    for name in transformer.train_experts:
        expert, place = getattr(transformer, name), os.path.join(folder, EXPERT_FOLDERS[name])
        os.makedirs(place)
        if lora:
            _write_adapter(expert, place)
        else:
            _write_transformer(expert, place)
        save_file(_vsa2_state(expert), os.path.join(place, VSA2_WEIGHTS))
    return list(transformer.train_experts)


def _give_usual_permissions(folder: str) -> None:
    """The modes the umask gives a folder made by hand (0755 folders, 0644 files under umask
    022), so that other users of a shared server can read the export: ``mkdtemp`` makes the
    staging folder owner-only, and safetensors writes its files owner-only."""
    umask = os.umask(0)
    os.umask(umask)
    for root, _, files in os.walk(folder):
        os.chmod(root, 0o777 & ~umask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~umask)


def _check_out_dir(out_dir: str) -> None:
    """A new or empty folder that can be made (outside any run's checkpoints), and a parent to
    assemble it in and rename it from (checked before the model loads)."""
    check_output_dir(out_dir)
    check_output_dir(os.path.dirname(os.path.realpath(out_dir)))
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise ConfigError(f"out_dir: {out_dir} is not empty; export into a new folder")


def _staging_prefix(place: str) -> str:
    """The name start of ``place``'s assembly folders: the target, this host and process."""
    return f".export-{os.path.basename(place)}.{socket.gethostname()}.{os.getpid()}-"


def _remove_stale_staging(place: str) -> None:
    """Removes the assembly folders of ``place`` whose export (on this host) is gone."""
    parent, host = os.path.dirname(place), socket.gethostname()
    pattern = re.compile(
        re.escape(f".export-{os.path.basename(place)}.{host}.") + r"(\d+)-[A-Za-z0-9_]{8}"
    )
    for name in os.listdir(parent):
        match = pattern.fullmatch(name)
        if match and not _is_running(int(match.group(1))):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
            print(f"removed {os.path.join(parent, name)}, left by an export that was killed")


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@contextlib.contextmanager
def _stop_on_sigterm():
    """SIGTERM raises SystemExit(143) while the block runs, so that its cleanup runs (the
    default action ends the process on the spot); a no-op outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        print("vsa2-rl export: stopped (SIGTERM); nothing was written to out_dir", file=sys.stderr)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def export(config: RunConfig, targets: EvalTargets) -> str:
    """Writes the export of the one run ``targets`` names (see the module docstring) into
    ``config.out_dir``; returns the folder."""
    from vsa2_rl.eval.sweep import resolve_targets
    from vsa2_rl.preflight import model_facts

    if targets.run_dirs or bool(targets.run_dir) + bool(targets.checkpoint) != 1:
        raise ConfigError("run_dir: export takes one run (run_dir=DIR or checkpoint=DIR)")
    _check_out_dir(config.out_dir)
    (target,) = resolve_targets(config, targets)
    trained = target.config
    model_facts(trained)  # the pre-flight of its model folder, before the weights load
    bundle = load_model(trained, torch.device("cpu"), torch.float32, checkpoint=target.checkpoint)
    place = os.path.realpath(config.out_dir)  # a link to an empty folder: the folder it names
    parent = os.path.dirname(place)
    os.makedirs(parent, exist_ok=True)
    _remove_stale_staging(place)
    with _stop_on_sigterm():
        _assemble(bundle, trained, target.checkpoint, place)
    return config.out_dir


def _assemble(bundle, trained: RunConfig, checkpoint: str, place: str) -> None:
    """The export of ``bundle`` (trained with ``trained``, from ``checkpoint``) assembled next
    to ``place`` and renamed to it; the assembly folder is removed when anything fails."""
    staging = tempfile.mkdtemp(prefix=_staging_prefix(place), dir=os.path.dirname(place))
    try:
        experts = _write_model(bundle.transformer, staging, trained.model.lora.enabled)
        settings = {
            "attention": dataclasses.asdict(trained.attention),
            "sparsity": dataclasses.asdict(trained.sparsity),
            "checkpoint": os.path.abspath(checkpoint),
            "lora": trained.model.lora.enabled,
            **({"experts": experts} if experts else {}),
        }
        with open(os.path.join(staging, VSA2_SETTINGS), "w", encoding="utf-8") as handle:
            json.dump(settings, handle, indent=2)
        _give_usual_permissions(staging)
        if os.path.isdir(place):
            os.rmdir(place)  # empty (checked above)
        os.rename(staging, place)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
