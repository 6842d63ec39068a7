"""tests/distributed: multi-process runs behind the ``distributed`` marker, 2 CPU ranks over gloo, or 2 GPU
ranks over NCCL with ``HF_FUSED_TEST_DEVICE=cuda`` (ranks.py). The workers and these tests import the shared
helpers in tests/ (tiny_models)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ranks import CUDA  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "distributed: 2-process runs, CPU over gloo or (HF_FUSED_TEST_DEVICE=cuda) 2 GPUs over NCCL "
                   "(DeepSpeed ZeRO-2/3, DDP, FSDP1, FSDP2, context parallelism on GPUs, pipeline)"
    )


def pytest_collection_modifyitems(config, items):
    if not CUDA or torch.cuda.device_count() >= 2:
        return
    skip = pytest.mark.skip(reason=f"HF_FUSED_TEST_DEVICE=cuda runs each rank on its own GPU: needs 2, found "
                                   f"{torch.cuda.device_count()}")
    here = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        if str(item.fspath).startswith(here) and "test_zero3_single_gpu" not in str(item.fspath):
            item.add_marker(skip)
