"""tests/distributed: multi-process runs (2 CPU ranks over gloo) behind the ``distributed`` marker.
The workers and these tests import the shared helpers in tests/ (tiny_models)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "distributed: 2-process runs on CPU over gloo (DeepSpeed ZeRO-2/3, DDP, FSDP2, pipeline)"
    )
