"""DiffusionNFT's old policy and EMA reference on DeepSpeed ZeRO-3-partitioned parameters (2 CPU
processes over gloo, started by torchrun running this file): the old policy's soft update, swap
and forward and its checkpoint state, and the EMA reference's update, swap and state, against
the same on an unsharded copy of the model.

The model has trained parameters of both of ZeRO-3's kinds: weights partitioned over the ranks
(one of an odd size, so that the last partition is padded) and biases below
``stage3_param_persistence_threshold``, which DeepSpeed keeps gathered whole on every rank
besides their partitions: a swap that wrote the partitions only would leave their forward on
the trained values. Every swap is checked against the unsharded model's output, which differs
from the trained one, so a skipped swap fails. The whole trainer runs DiffusionNFT under ZeRO-3
in tests/test_distributed.py (on a GPU).
"""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow  # starts processes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# float32 on one core, the same inputs on each rank: DeepSpeed averages two equal gradients
TOLERANCE = {"rtol": 1e-6, "atol": 1e-7}
# biases (5 and 6 elements) stay gathered, weights (15 and 30) are partitioned
PERSISTENCE_THRESHOLD = 10


class _Model(torch.nn.Module):
    """Two trained layers and a frozen one."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(3, 5)
        self.block = torch.nn.Linear(5, 6)
        self.frozen = torch.nn.Linear(6, 5)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.frozen(self.block(self.inp(x)).tanh())


def _train_step(model, optimizer, x) -> None:
    """One SGD step on both kinds of model (``optimizer`` None: ``model`` is a DeepSpeed
    engine, which owns its optimizer)."""
    loss = model(x).square().mean()
    if optimizer is None:
        model.backward(loss)
        model.step()
        return
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def _zero3_engine(plain: torch.nn.Module):
    """A ZeRO-3 engine of a copy of ``plain`` (SGD, as the plain model's)."""
    import deepspeed

    model = _Model()
    model.load_state_dict(plain.state_dict())
    trained = [p for p in model.parameters() if p.requires_grad]
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_allow_untested_optimizer": True,  # plain SGD, the plain model's
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": PERSISTENCE_THRESHOLD,
        },
    }
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(trained, lr=0.5), config=config
    )
    return engine


def _check_partitioning(module) -> None:
    """The model holds what the module docstring says: partitioned and persistent parameters."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    params = dict(module.named_parameters())
    assert params["inp.weight"].ds_tensor.numel() == 8  # 15 elements, padded to 2 x 8
    assert not params["inp.weight"].ds_persist
    assert params["block.bias"].ds_persist
    assert params["block.bias"].ds_status == ZeroParamStatus.AVAILABLE


def _check_on_each_rank() -> None:
    import deepspeed
    import torch.distributed as dist

    from vsa2_rl.rl.nft import OldPolicy

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    plain = _Model()
    engine = _zero3_engine(plain)
    bundles = (plain, engine)  # what runs a forward
    models = (plain, engine.module)  # what holds the parameters
    olds = [OldPolicy(b, m, copy_model=False) for b, m in zip(bundles, models, strict=True)]
    trained = [p for p in plain.parameters() if p.requires_grad]
    optimizers = (torch.optim.SGD(trained, lr=0.5), None)
    x = torch.randn(4, 3)
    for eta in (0.3, 0.5):
        outputs = []
        for bundle, old, optimizer in zip(bundles, olds, optimizers, strict=True):
            _train_step(bundle, optimizer, x)
            old.soft_update(eta)
            with torch.no_grad(), old.active() as old_model:
                outputs.append(old_model(x))
            with torch.no_grad():
                outputs.append(bundle(x))  # the trained weights again
        torch.testing.assert_close(outputs[2], outputs[0], **TOLERANCE)
        torch.testing.assert_close(outputs[3], outputs[1], **TOLERANCE)
        assert not torch.allclose(outputs[0], outputs[1])  # theta_old is not theta
        _check_partitioning(engine.module)
    _check_old_state(olds, engine)
    _check_ema_reference(bundles, models, optimizers, x)
    dist.barrier()  # no rank tears gloo down while the other still runs work on it
    dist.destroy_process_group()


def _check_old_state(olds, engine) -> None:
    """The old policy's state is whole tensors, the unsharded ones, and loads back into each
    rank's partitions."""
    import torch.distributed as dist

    from vsa2_rl.rl.ema import whole_tensor
    from vsa2_rl.rl.nft import OldPolicy

    expected = olds[0].state_dict()
    whole = olds[1].state_dict(keep=dist.get_rank() == 0)  # every rank gathers
    assert whole.keys() == (expected.keys() if dist.get_rank() == 0 else set())
    for name, value in whole.items():
        assert value.shape == expected[name].shape
        torch.testing.assert_close(value, expected[name], **TOLERANCE)
    fresh = OldPolicy(engine, engine.module, copy_model=False)
    fresh.load_state_dict(expected)
    for name, weight in fresh.weights.items():
        assert weight.shape == olds[1].weights[name].shape  # this rank's partition
        restored = whole_tensor(weight, fresh.live[name])
        torch.testing.assert_close(restored, expected[name], rtol=0, atol=0)


def _check_ema_reference(bundles, models, optimizers, x) -> None:
    """The EMA reference of the partitioned model (full fine-tuning: its partitions are swapped
    in) gives the unsharded one's outputs, the trained weights come back after it, and its state
    is whole tensors that load back into partitions."""
    import torch.distributed as dist

    from vsa2_rl.rl.ema import whole_tensor
    from vsa2_rl.rl.nft import EMAReference

    plain, module = models
    # the unsharded model swaps too (as a LoRA run does): a bundle view needs a real bundle
    references = [
        EMAReference(b, m, decay=0.5, lora=m is plain) for b, m in zip(bundles, models, strict=True)
    ]
    assert references[1].frozen is None  # no copy of a partitioned model
    outputs = []
    for bundle, reference, optimizer in zip(bundles, references, optimizers, strict=True):
        _train_step(bundle, optimizer, x)
        reference.update()
        with torch.no_grad():
            bundle(x)
            with reference.active() as reference_model:
                outputs.append(reference_model(x))
            outputs.append(bundle(x))
    torch.testing.assert_close(outputs[2], outputs[0], **TOLERANCE)
    torch.testing.assert_close(outputs[3], outputs[1], **TOLERANCE)
    assert not torch.allclose(outputs[0], outputs[1])  # the EMA is not theta
    expected = references[0].state_dict()
    whole = references[1].state_dict(keep=dist.get_rank() == 0)  # every rank gathers
    assert whole.keys() == (expected.keys() if dist.get_rank() == 0 else set())
    for name, value in whole.get("shadow", {}).items():
        torch.testing.assert_close(value, expected["shadow"][name], **TOLERANCE)
    fresh = EMAReference(bundles[1], module, decay=0.9, lora=False)
    fresh.load_state_dict(expected)
    assert fresh.ema.decay == 0.5 and fresh.ema.num_calls == 1
    for name, shadow in fresh.ema.shadow.items():
        restored = whole_tensor(shadow, fresh.ema.params[name])
        torch.testing.assert_close(restored, expected["shadow"][name], rtol=0, atol=0)


def test_nft_states_of_zero3_partitioned_parameters_act_as_of_whole_ones():
    pytest.importorskip("deepspeed")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", __file__]
    result = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]


if __name__ == "__main__":
    _check_on_each_rank()
