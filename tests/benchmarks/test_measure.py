"""track_peak_memory on CPU: counts new tensors, autograd-saved tensors and the backward."""

import pytest
import torch
import torch.nn.functional as F

from benchmarks.measure import track_peak_memory


def test_allocation_is_counted():
    with track_peak_memory("cpu") as mem:
        x = torch.zeros(1000, 1000)
    assert mem.peak_bytes >= 4_000_000
    del x


def test_nothing_allocated_is_zero():
    x = torch.ones(1000, 1000)
    with track_peak_memory("cpu") as mem:
        x.view(-1)[:10].mul_(2)  # views and in-place ops allocate nothing
        _ = x.shape
    assert mem.peak_bytes < 1024


def test_freed_memory_is_released():
    with track_peak_memory("cpu") as mem:
        for _ in range(5):
            y = torch.empty(1000, 1000)  # each replaces (frees) the previous one
            del y
    assert 4_000_000 <= mem.peak_bytes < 8_000_000


def test_saved_activations_and_backward_are_counted():
    n, v, h = 64, 4000, 32
    a = torch.randn(n, h, requires_grad=True)
    w = torch.randn(v, h, requires_grad=True)
    y = torch.randint(0, v, (n,))
    logits_bytes = n * v * 4
    with track_peak_memory("cpu") as fwd:
        loss = F.cross_entropy(a @ w.T, y)
    # logits and log-softmax are both alive (saved for backward).
    assert fwd.peak_bytes >= 2 * logits_bytes
    with track_peak_memory("cpu") as bwd:
        loss.backward()
    # gradient of the logits plus the new weight gradient.
    assert bwd.peak_bytes >= logits_bytes + w.numel() * 4


def test_unknown_device():
    with pytest.raises(ValueError, match="cpu and cuda"):
        with track_peak_memory("meta"):
            pass
