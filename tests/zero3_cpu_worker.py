"""Run by tests/test_distributed.py under ``accelerate launch --config_file
configs/accelerate/zero3.yaml``: the trainer (``train_rl.py ARGS``) under accelerate's DeepSpeed
ZeRO-3 on CPU processes (gloo).

accelerate turns the config file into its ACCELERATE_DEEPSPEED_* variables and starts the
processes through torchrun, but it enables DeepSpeed for accelerator devices only: the trainer's
Accelerator is made with ``cpu=True`` on a CPU device, which turns DeepSpeed off, and with
``cpu=False`` accelerate finds no backend for CPU processes and runs each as a world of one.
Here the Accelerator is made with ``cpu=False`` and the backend of CPU processes (gloo): accelerate
then starts DeepSpeed's distributed backend over gloo and prepares the model with a DeepSpeed
engine, as on GPUs; the engine, its ZeRO-3 partitioning and its checkpoints are DeepSpeed's code,
which runs on CPU.

Tensors of fewer than PERSISTENCE_THRESHOLD elements (the toy's biases, norms and gates) stay
gathered on every rank, the others are partitioned: the runs hold both of ZeRO-3's kinds of
parameter (DeepSpeed's default threshold would leave most of the toy's whole).
"""

import sys
from pathlib import Path

import accelerate
from accelerate.state import PartialState
from accelerate.utils import DistributedType

PERSISTENCE_THRESHOLD = 1000


def _gloo_backend(state, cpu=False, sagemaker_dp=False, backend=None):
    return "gloo", DistributedType.MULTI_CPU


class CpuDeepSpeedAccelerator(accelerate.Accelerator):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "cpu": False})
        zero = self.state.deepspeed_plugin.deepspeed_config["zero_optimization"]
        zero["stage3_param_persistence_threshold"] = PERSISTENCE_THRESHOLD


if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # imports as from train_rl.py
    PartialState._prepare_backend = _gloo_backend
    accelerate.Accelerator = CpuDeepSpeedAccelerator
    from vsa2_rl.cli import main

    sys.exit(main(["train", *sys.argv[1:]]))
