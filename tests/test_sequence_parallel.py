"""Ulysses sequence parallelism around VSA2 on 2 and 4 CPU processes (torchrun, gloo): a VSA2
layer, and the whole toy Wan model, whose ranks each hold a token slice of an odd grid give the
single-process output and gradients (q, k, v, hidden states, and every parameter's gradient:
summed over the ranks for the layer, averaged over them, as DDP does, for the model)."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # every test starts a torch.distributed.run of several processes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "sequence_parallel_worker.py")


def _errors(tmp_path, processes: int, what: str, sparsity: float) -> list[dict]:
    out = tmp_path / "errors.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
    result = subprocess.run(
        [*command, WORKER, str(out), what, str(sparsity)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    per_rank = json.loads(out.read_text())
    assert len(per_rank) == processes
    return per_rank


@pytest.mark.parametrize("processes", [2, 4])
@pytest.mark.parametrize("sparsity", [0.75, 0.0])
def test_sequence_parallel_vsa2_layer_equals_one_process(tmp_path, processes, sparsity):
    per_rank = _errors(tmp_path, processes, "layer", sparsity)
    expected = {"out", "dq", "dk", "dv"} | ({"alpha", "dhidden"} if sparsity else set())
    for rank, errors in enumerate(per_rank):
        assert expected <= set(errors), (rank, sorted(errors))
        worst = max(errors.items(), key=lambda item: item[1])
        assert worst[1] <= 1e-5, (rank, worst)


@pytest.mark.parametrize("processes", [2, 4])
def test_sequence_parallel_toy_model_equals_one_process(tmp_path, processes):
    per_rank = _errors(tmp_path, processes, "model", 0.75)
    for rank, errors in enumerate(per_rank):
        assert "out" in errors and any(".vsa2." in name for name in errors)
        assert any("attn2" in name for name in errors) and any("ffn" in name for name in errors)
        worst = max(errors.items(), key=lambda item: item[1])
        assert worst[1] <= 1e-5, (rank, worst)
