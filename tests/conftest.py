"""Shared pytest setup: GPU tests are skipped without CUDA; CPU threads kept to the CI machine's cores."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run in its interpreter on CPU tensors; must be set before triton_kernels is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine; see docs/gpu_results.md)")
    for item in items:
        if "gpu" in item.keywords or "multigpu" in item.keywords:
            item.add_marker(skip)
