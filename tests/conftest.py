"""Shared pytest setup: GPU tests are skipped without CUDA (multigpu ones without 2 GPUs); CPU threads kept to the CI machine's cores."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run in its interpreter on CPU tensors; must be set before triton_kernels is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (python -m pytest -m gpu on a GPU machine)")
    skip_multigpu = pytest.mark.skip(reason=f"needs 2 CUDA GPUs, found {gpus} (docs/distributed.md)")
    for item in items:
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(skip_multigpu)
        elif "gpu" in item.keywords and gpus < 1:
            item.add_marker(skip_gpu)
