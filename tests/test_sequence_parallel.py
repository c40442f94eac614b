"""Ulysses sequence parallelism around VSA2 on 2 and 4 CPU processes (torchrun, gloo): a VSA2
layer whose ranks each hold a token slice of an odd grid gives the single-process output and
gradients (q, k, v, hidden states, and the router and gate parameters summed over the ranks)."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "sequence_parallel_worker.py")


@pytest.mark.parametrize("processes", [2, 4])
@pytest.mark.parametrize("sparsity", [0.75, 0.0])
def test_sequence_parallel_vsa2_layer_equals_one_process(tmp_path, processes, sparsity):
    out = tmp_path / "errors.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
    result = subprocess.run(
        [*command, WORKER, str(out), str(sparsity)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    per_rank = json.loads(out.read_text())
    assert len(per_rank) == processes
    expected = {"out", "dq", "dk", "dv"} | ({"alpha", "dhidden"} if sparsity else set())
    for rank, errors in enumerate(per_rank):
        assert expected <= set(errors), (rank, sorted(errors))
        worst = max(errors.items(), key=lambda item: item[1])
        assert worst[1] <= 1e-5, (rank, worst)
