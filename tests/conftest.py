"""Pytest setup: CPU runs use the Triton interpreter; GPU tests carry the ``gpu`` marker and skip without CUDA."""

import os

import pytest

try:  # decide before any tritonep kernel module is imported (triton reads the flag at decoration time)
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA GPUs (run on the device machine)")
    config.addinivalue_line("markers", "soak: long soak tests, not run in CI by default")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not _HAS_CUDA:
            item.add_marker(skip_gpu)
