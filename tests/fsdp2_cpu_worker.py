"""Run by tests/test_distributed.py under ``accelerate launch --config_file
configs/accelerate/fsdp2.yaml``: the trainer (``train_rl.py ARGS``) under accelerate's FSDP2 on
CPU processes (gloo).

accelerate turns the config file into its FSDP_* variables and starts the processes, but it
enables FSDP for GPU-like devices only: CPU processes would get plain DDP (``MULTI_CPU``, which
the trainer refuses). Here the Accelerator that the trainer creates sets its state as accelerate
does on GPUs (distributed type FSDP, the plugin read from those variables); preparing the model,
clipping, state dicts and ``save_state`` / ``load_state`` are then accelerate's and torch's
FSDP2 code, which runs on CPU with gloo.

With ``NAN_LOSS_ON_RANK=r`` in the environment, rank r's policy loss is NaN (the other ranks'
stay finite), for the test of the finite check before the optimizer step.
"""

import os
import sys
from pathlib import Path

import accelerate
from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin


class CpuFsdp2Accelerator(accelerate.Accelerator):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        self.state.distributed_type = DistributedType.FSDP
        self.state.fsdp_plugin = FullyShardedDataParallelPlugin()  # from the FSDP_* variables


def poison_policy_loss() -> None:
    from vsa2_rl.rl import flow_grpo as update

    real_loss = update.grpo_loss

    def nan_loss(*args, **kwargs):
        loss, stats = real_loss(*args, **kwargs)
        return loss * float("nan"), stats

    update.grpo_loss = nan_loss


if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # imports as from train_rl.py
    accelerate.Accelerator = CpuFsdp2Accelerator
    if os.environ.get("NAN_LOSS_ON_RANK") == os.environ["RANK"]:
        poison_policy_loss()
    from vsa2_rl.cli import main

    sys.exit(main(["train", *sys.argv[1:]]))
