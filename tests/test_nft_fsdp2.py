"""DiffusionNFT's old policy, EMA reference and trust region on FSDP2-sharded parameters (2 CPU
processes over gloo, started by torchrun running this file): the old policy's soft update, swap
and forward and its checkpoint state, the EMA reference's update, swap and state, and a step
scaled back by :func:`vsa2_rl.rl.nft.limit_step`, against the same on an unsharded copy of the
model.

The model's root module holds trained weights of its own: after a forward under ``no_grad``
FSDP2 keeps the root's gathered copy registered, which a later forward would reuse had the
swap or the scaling not resharded it first. The whole trainer runs DiffusionNFT under FSDP2 in
tests/test_distributed.py.
"""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow  # starts processes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# float32 on one core, the same inputs on each rank: an all-reduce of two equal gradients and
# the shards' own arithmetic leave a few ulps
TOLERANCE = {"rtol": 1e-6, "atol": 1e-7}


class _Model(torch.nn.Module):
    """A trained root layer (not its own FSDP unit), a trained block and a frozen one."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(3, 6)
        self.block = torch.nn.Linear(6, 6)
        self.frozen = torch.nn.Linear(6, 5)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.frozen(self.block(self.inp(x)).tanh())


def _train_step(model, optimizer, x) -> None:
    optimizer.zero_grad()
    model(x).square().mean().backward()
    optimizer.step()


def _check_on_each_rank() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from vsa2_rl.rl.nft import OldPolicy

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    plain, sharded = _Model(), _Model()
    sharded.load_state_dict(plain.state_dict())
    mesh = init_device_mesh("cpu", (2,))
    fully_shard(sharded.block, mesh=mesh)
    fully_shard(sharded.frozen, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    models = (plain, sharded)
    olds = [OldPolicy(model, model, copy_model=False) for model in models]
    optimizers = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5)
                  for m in models]  # fmt: skip
    x = torch.randn(4, 3)
    for eta in (0.3, 0.5):
        outputs = []
        for model, old, optimizer in zip(models, olds, optimizers, strict=True):
            _train_step(model, optimizer, x)
            old.soft_update(eta)
            with torch.no_grad(), old.active() as old_model:
                outputs.append(old_model(x))
            with torch.no_grad():
                outputs.append(model(x))  # the trained weights again, in the root's forward too
        torch.testing.assert_close(outputs[2], outputs[0], **TOLERANCE)
        torch.testing.assert_close(outputs[3], outputs[1], **TOLERANCE)
        assert not torch.allclose(outputs[0], outputs[1])  # theta_old is not theta
    whole = olds[1].state_dict(keep=dist.get_rank() == 0)  # every rank gathers
    expected = olds[0].state_dict()
    assert whole.keys() == (expected.keys() if dist.get_rank() == 0 else set())
    for name, value in whole.items():
        torch.testing.assert_close(value, expected[name], **TOLERANCE)
    fresh = OldPolicy(sharded, sharded, copy_model=False)
    fresh.load_state_dict(expected)
    for name, weight in fresh.weights.items():
        assert weight.placements == olds[1].weights[name].placements
        torch.testing.assert_close(weight.full_tensor(), expected[name], rtol=0, atol=0)
    _check_ema_reference(models, optimizers, x)
    _check_limited_step(models, optimizers, x)
    dist.barrier()  # no rank tears gloo down while the other still runs work on it
    dist.destroy_process_group()


def _check_ema_reference(models, optimizers, x) -> None:
    """The EMA reference of the sharded model (full fine-tuning: its shards are swapped in)
    gives the unsharded one's outputs, the trained weights come back after it, and its state
    is whole tensors that load back into shards."""
    import torch.distributed as dist

    from vsa2_rl.rl.nft import EMAReference

    plain, sharded = models
    # the unsharded model swaps too (as a LoRA run does): a bundle view needs a real bundle
    references = [EMAReference(m, m, decay=0.5, lora=m is plain) for m in models]
    outputs = []
    for model, reference, optimizer in zip(models, references, optimizers, strict=True):
        _train_step(model, optimizer, x)
        reference.update()
        with torch.no_grad():
            model(x)  # leaves the root's gathered trained weights registered
            with reference.active() as reference_model:
                outputs.append(reference_model(x))
            outputs.append(model(x))
    torch.testing.assert_close(outputs[2], outputs[0], **TOLERANCE)
    torch.testing.assert_close(outputs[3], outputs[1], **TOLERANCE)
    assert not torch.allclose(outputs[0], outputs[1])  # the EMA is not theta
    expected = references[0].state_dict()
    whole = references[1].state_dict(keep=dist.get_rank() == 0)  # every rank gathers
    assert whole.keys() == (expected.keys() if dist.get_rank() == 0 else set())
    for name, value in whole.get("shadow", {}).items():
        torch.testing.assert_close(value, expected["shadow"][name], **TOLERANCE)
    fresh = EMAReference(sharded, sharded, decay=0.9, lora=False)
    fresh.load_state_dict(expected)
    assert fresh.ema.decay == 0.5 and fresh.ema.num_calls == 1
    for name, shadow in fresh.ema.shadow.items():
        assert shadow.placements == references[1].ema.shadow[name].placements
        torch.testing.assert_close(shadow.full_tensor(), expected["shadow"][name], rtol=0, atol=0)


def _check_limited_step(models, optimizers, x) -> None:
    """A step scaled back to half after a forward under ``no_grad`` (as nft.trust_region
    measures it) is the step the next forward runs, sharded as unsharded."""
    from vsa2_rl.rl.nft import limit_step

    outputs = []
    for model, optimizer in zip(models, optimizers, strict=True):
        params = optimizer.param_groups[0]["params"]  # the shards, not a gathered copy
        before = [p.detach().clone() for p in params]
        _train_step(model, optimizer, x)
        with torch.no_grad():
            outputs.append(model(x))  # the whole step; the root stays gathered
            assert limit_step(params, before, 4.0, 1.0, model) == 0.5
            outputs.append(model(x))
    torch.testing.assert_close(outputs[2], outputs[0], **TOLERANCE)
    torch.testing.assert_close(outputs[3], outputs[1], **TOLERANCE)
    assert not torch.allclose(outputs[0], outputs[1])  # the scaled step is not the whole one


def test_nft_states_of_fsdp2_sharded_parameters_act_as_of_whole_ones():
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", __file__]
    result = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]


if __name__ == "__main__":
    _check_on_each_rank()
