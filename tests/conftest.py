"""Test conventions for vsa2_rl.

- Triton kernels run under ``TRITON_INTERPRET=1`` on CPU when no CUDA device is present (set
  before triton is imported anywhere), which is how CI proves kernel correctness.
- Every test starts from the same seeds (python, numpy, torch).
- Tests marked ``nan_empty`` see ``torch.empty`` / ``torch.empty_like`` results filled with NaN,
  so an output element a kernel forgot to write shows up as NaN instead of stale memory.
- Tests marked ``gpu`` are skipped when CUDA is not available.
"""

import os
import random

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "nan_empty: fill torch.empty results with NaN")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed_everything():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


def _nan_filled(factory):
    def wrapper(*args, **kwargs):
        out = factory(*args, **kwargs)
        if out.dtype.is_floating_point:
            out.fill_(float("nan"))
        return out

    return wrapper


@pytest.fixture(autouse=True)
def _nan_empty(request, monkeypatch):
    if request.node.get_closest_marker("nan_empty") is not None:
        monkeypatch.setattr(torch, "empty", _nan_filled(torch.empty))
        monkeypatch.setattr(torch, "empty_like", _nan_filled(torch.empty_like))
    yield
