"""What a training run builds before it writes a file: :class:`RunSetup` (accelerator, prompts,
rewards, guards, the model bundle, the sequence-parallel group), and the run folder's config.yaml
and its refusal of an abandoned run, which ``vsa2-rl check`` reports too."""

from __future__ import annotations

import os

from vsa2_rl.config import ConfigError, RunConfig, to_yaml
from vsa2_rl.eval.sweep import GUARD_PREFIX, reward_fns
from vsa2_rl.models.family import family_of
from vsa2_rl.preflight import (
    ModelFacts,
    check_data_parallel,
    check_prompt_count,
    check_second_guidance,
    model_facts,
)
from vsa2_rl.rewards import RewardMixer
from vsa2_rl.rl import engines
from vsa2_rl.rl.run_folder import RunFolder
from vsa2_rl.runtime import (
    build_bundle,
    check_condition_images,
    check_output_dir,
    image_scheme,
    load_prompt_records,
    prompt_file_key,
    resolve_device,
    resolve_dtype,
    resolve_reward_device,
)


def write_config(config: RunConfig) -> None:
    """out_dir/config.yaml, replaced whole: a run stopped while writing it (Ctrl-C, a full disk)
    leaves the previous one, which eval and export read, never an empty or cut one."""
    path = os.path.join(config.out_dir, "config.yaml")
    text = to_yaml(config)
    with open(path + ".tmp", "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(path + ".tmp", path)


def refuse_abandoned_run(config: RunConfig) -> None:
    """A fresh run (``train.resume=none``) must not share its folder with an earlier run: a later
    ``resume=auto`` would continue from the abandoned run's checkpoints and metrics. Either,
    where it exists, must be what the run writes there (a folder, a file): found at the first
    save, a file named checkpoints would stop the run after its first steps."""
    for name, kind, is_kind in (("checkpoints", "folder", os.path.isdir),
                                ("metrics.jsonl", "file", os.path.isfile)):  # fmt: skip
        path = os.path.join(config.out_dir, name)
        if os.path.lexists(path) and not is_kind(path):
            raise ConfigError(
                f"out_dir: {path} is not a {kind}, and the run writes its {name} there; move "
                "it away or give another out_dir"
            )
    held = [
        name
        for name in ("checkpoints", "metrics.jsonl")
        if os.path.exists(os.path.join(config.out_dir, name))
        and (name != "checkpoints" or os.listdir(os.path.join(config.out_dir, name)))
    ]
    if config.train.resume == "none" and held:
        raise ConfigError(
            f"out_dir: {config.out_dir} holds a run ({' and '.join(held)}); use "
            "train.resume=auto to continue it, or a new out_dir for a fresh run"
        )


class RunSetup:
    """Everything the loop needs, built before any file of the run is written (``folder`` is
    locked first, so that no other run writes there meanwhile). ``facts``: the model folder's,
    where the caller read them already (``vsa2-rl train``'s pre-flight)."""

    def __init__(self, config: RunConfig, folder: RunFolder, facts: ModelFacts | None):
        from accelerate import Accelerator

        check_output_dir(config.out_dir)
        self.config = config
        facts = facts or model_facts(config)  # the model folder's model_index.json, read once
        self.accelerator = Accelerator(
            cpu=resolve_device(config.device).type == "cpu",
            kwargs_handlers=_ddp_options(config, facts),
        )
        engines.check_options(self.accelerator, config)
        folder.claim(self.accelerator)
        refuse_abandoned_run(config)  # under the lock: no other run adds to the folder
        self.device = self.accelerator.device
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        records = load_prompt_records(config, "train")
        self.prompts, self.images = [r.text for r in records], [r.image for r in records]
        records = config.eval.select_prompts(load_prompt_records(config, "eval"))
        self.eval_prompts, self.eval_images = [r.text for r in records], [r.image for r in records]
        scheme = image_scheme(config, facts)  # before any weight loads
        check_second_guidance(config, facts)
        check_condition_images(scheme, self.images, prompt_file_key(config, "train"))
        check_condition_images(scheme, self.eval_images, prompt_file_key(config, "eval"))
        self.sequence_parallel = _sequence_parallel_group(self.accelerator, config)
        sp_size = config.parallel.sequence_parallel_size
        # data-parallel ranks: sequence-parallel groups share their samples
        self.dp_world = self.accelerator.num_processes // sp_size
        self.dp_rank = self.accelerator.process_index // sp_size
        check_prompt_count(config, len(self.prompts))
        check_data_parallel(config, self.dp_world)
        try:
            self.rewards = RewardMixer.from_config(config.rewards)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        self.reward_device = resolve_reward_device(config, self.device)
        self.guards = reward_fns(config.eval.guard_rewards, "eval.guard_rewards", GUARD_PREFIX)
        with engines.whole_model_loading(self.accelerator):
            self.bundle = build_bundle(config, self.device, self.dtype, facts)
        engines.check_trained_experts(self.accelerator, self.bundle.transformer, config)
        if self.sequence_parallel is not None:
            family = family_of(config.model.kind)
            try:
                family.enable_sequence_parallel(self.bundle.transformer, self.sequence_parallel)
            except ValueError as error:
                raise ConfigError(f"parallel.sequence_parallel_size: {error}") from None


def _ddp_options(config: RunConfig, facts: ModelFacts) -> list:
    """DDP's settings: a Wan2.2 A14B run that trains both experts leaves one of them without
    gradients in every Flow-GRPO backward (a chunk's transition is one noise level), which DDP
    must be told to expect."""
    from accelerate.utils import DistributedDataParallelKwargs

    if not facts.two_experts or len(config.model.train_experts) == 1:
        return []
    return [DistributedDataParallelKwargs(find_unused_parameters=True)]


def _sequence_parallel_group(acc, config: RunConfig):
    """This rank's :class:`SequenceParallel` group (consecutive ranks), or None when off."""
    size = config.parallel.sequence_parallel_size
    if size == 1:
        return None
    key = "parallel.sequence_parallel_size"
    if acc.num_processes % size:
        raise ConfigError(
            f"{key}: {size} must divide the number of processes ({acc.num_processes})"
        )
    if engines.uses_deepspeed(acc):
        raise ConfigError(f"{key}: sequence parallelism runs under DDP or FSDP2, not DeepSpeed")
    if not config.attention.enabled:
        raise ConfigError(f"{key}: sequence parallelism runs through VSA2 (attention.enabled)")
    import torch.distributed as dist

    from vsa2_rl.parallel import SequenceParallel

    groups = [
        dist.new_group(list(range(start, start + size)))  # every rank creates every group
        for start in range(0, acc.num_processes, size)
    ]
    return SequenceParallel(groups[acc.process_index // size])


__all__ = ["RunSetup", "refuse_abandoned_run", "write_config"]
