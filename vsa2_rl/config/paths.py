"""File-system checks of a config: the folders and files its keys name are there and are what
the key needs.

The config dataclasses check values alone, so that a config constructs the same on any machine
(a recorded one included, whose model folder may live elsewhere now). These functions look at
the disk; the loaders call them (``load_config``, ``load_eval_config``) and so do the commands'
entry points where a config may come from code, each before anything loads or is written. Every
failure is a :class:`ConfigError` naming the key and the fix.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from vsa2_rl.config.checks import _check

if TYPE_CHECKING:
    from vsa2_rl.config.run import RunConfig
    from vsa2_rl.config.targets import EvalTargets

# The file a complete checkpoint folder holds (vsa2_rl.rl.checkpoint writes it last).
COMPLETE_MARKER = "COMPLETE"
# What training and evaluation write into out_dir besides checkpoints/ and metrics.jsonl (the
# trainer checks those two itself): folders, then files. One of another kind found there would
# stop the command at its first save, or after a whole evaluation.
OUT_DIR_FOLDERS = ("samples", "text_cache", "tensorboard")
OUT_DIR_FILES = ("config.yaml", "reward_curve.png", "eval.json", "eval.md", "eval.png")


def _is_checkpoint(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, COMPLETE_MARKER))


def _is_adapter_folder(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, "adapter_config.json")) and os.path.isfile(
        os.path.join(folder, "adapter_model.safetensors")
    )


def _not_a_file(path: str, wanted: str) -> str:
    """Why ``path`` is no regular file: missing, a folder, or something else (a device)."""
    if not os.path.exists(path):
        return f"file not found: {path}"
    what = "a folder" if os.path.isdir(path) else "not a regular file"
    return f"{path} is {what}; give {wanted}"


def check_model_paths(config: RunConfig) -> None:
    """What loading ``config``'s model reads: ``model.path``, ``model.text_cache_dir`` and
    ``model.lora.init_from``."""
    model = config.model
    if model.path:
        hint = {
            "wan": "put a local diffusers Wan folder there, e.g. Wan2.1-T2V-1.3B-Diffusers or "
            "Wan2.2-TI2V-5B-Diffusers",
            "hunyuan_video15": "put a local diffusers HunyuanVideo-1.5 text-to-video folder "
            "there, e.g. HunyuanVideo-1.5-480p_t2v",
            "minimax_h3": "put a local diffusers MiniMax-H3 folder there (the modular "
            "pipeline's components: transformer/, vae/, text_encoder/, tokenizer/)",
            "ltx2": "put a local diffusers LTX-2 folder there (transformer/, vae/, audio_vae/, "
            "text_encoder/, tokenizer/, connectors/)",
        }.get(model.kind, "leave empty for the shipped toy model")
        _check(
            os.path.isdir(model.path), "model.path", f"directory not found: {model.path} ({hint})"
        )
        _check(
            bool(os.listdir(model.path)),
            "model.path",
            f"{model.path} is an empty folder; point it at the model's files",
        )
    cache = model.text_cache_dir
    _check(
        not cache or not os.path.lexists(cache) or os.path.isdir(cache),
        "model.text_cache_dir",
        f"{cache} is not a folder; give a folder for the cached prompt embeddings, or leave it "
        "empty for out_dir/text_cache",
    )
    init_from = model.lora.init_from
    if init_from:
        # one adapter folder, or a two-expert export with one per expert (Wan2.2 A14B)
        folders = [init_from] + [
            os.path.join(init_from, expert) for expert in ("transformer", "transformer_2")
        ]
        _check(
            any(_is_adapter_folder(folder) for folder in folders),
            "model.lora.init_from",
            f"{init_from} is not a peft adapter folder (adapter_config.json + "
            "adapter_model.safetensors, as vsa2-rl export writes)",
        )


def check_paths(config: RunConfig) -> None:
    """Every file and folder ``config`` names: the model's (:func:`check_model_paths`), the
    prompt files (:func:`check_prompt_path`), the checkpoint ``train.resume`` names
    (:func:`check_resume_path`) and what is written into out_dir
    (:func:`check_out_dir_children`)."""
    check_model_paths(config)
    for key in ("file", "eval_file"):
        check_prompt_path(config, key)
    check_resume_path(config)
    check_out_dir_children(config.out_dir)


def check_out_dir_children(out_dir: str) -> None:
    """The entries of ``out_dir`` that training and evaluation write (``OUT_DIR_FOLDERS``,
    ``OUT_DIR_FILES``) are, where they exist already, of the kind written there."""
    for names, kind, is_kind in ((OUT_DIR_FOLDERS, "folder", os.path.isdir),
                                 (OUT_DIR_FILES, "file", os.path.isfile)):  # fmt: skip
        for name in names:
            path = os.path.join(out_dir, name)
            _check(
                not os.path.lexists(path) or is_kind(path),
                "out_dir",
                f"{path} is not a {kind}, and runs write their {name} there; move it away or "
                "give another out_dir",
            )


def check_prompt_path(config: RunConfig, key: str) -> None:
    """The prompt file ``prompts.<key>`` names, if any, is a regular file."""
    path = getattr(config.prompts, key)
    if not path or os.path.isfile(path):
        return
    reason = _not_a_file(path, "a prompt file")
    if not os.path.exists(path) and not os.path.isabs(path):
        reason += (
            f" (read from the current folder, {os.getcwd()}); run from the folder the path is "
            "relative to (the repository root for the shipped recipes) or give it whole"
        )
    _check(False, f"prompts.{key}", reason)


def check_resume_path(config: RunConfig) -> None:
    """``train.resume`` is auto, none or a complete checkpoint folder."""
    resume = config.train.resume
    if resume not in ("auto", "none"):
        _check(
            os.path.isdir(resume),
            "train.resume",
            f"checkpoint folder not found: {resume} (use auto, none or a folder)",
        )
        _check(
            _is_checkpoint(resume),
            "train.resume",
            f"{resume} is not a checkpoint (no COMPLETE marker); give a checkpoints/step_N "
            "folder of a run, or auto",
        )


def check_target_paths(targets: EvalTargets) -> None:
    """The checkpoint folder ``targets`` names is one (the run folders are read, and checked,
    by ``vsa2_rl.eval.sweep.resolve_targets``, which finds their newest checkpoints)."""
    checkpoint = targets.checkpoint
    if checkpoint:
        _check(os.path.isdir(checkpoint), "checkpoint", f"folder not found: {checkpoint}")
        _check(
            _is_checkpoint(checkpoint),
            "checkpoint",
            f"{checkpoint} is not a checkpoint folder (no COMPLETE marker); give a run's "
            "checkpoints/step_N folder, or run_dir= for its newest",
        )
