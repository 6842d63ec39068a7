"""Host syncs of the fused ops on CUDA: each one drains the GPU queue, so a patched training step should cost
no more of them than it must. One forward+backward of the cross-entropy or token-loss op needs exactly one
(labels checked, kept rows counted and a tensor ``num_items_in_batch`` read together); the upstream gradient
stays on the device. CUDA only (``torch.cuda.set_sync_debug_mode`` counts them); run on the device machine."""

from __future__ import annotations

import warnings

import pytest
import torch

from hf_fused.ops import linear_cross_entropy, linear_token_loss

pytestmark = pytest.mark.gpu


def _syncs(fn, monkeypatch) -> int:
    """Host syncs of ``fn()``: what the sync debug mode reports, and the waits for an event (the count of kept rows
    is copied behind its kernels and waited for by its event, which the debug mode does not report)."""
    events = []
    wait = torch.cuda.Event.synchronize
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda self: events.append(1) or wait(self))
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            monkeypatch.undo()
    return sum("called a synchronizing" in str(w.message) for w in caught) + len(events)


def _inputs(n=512, h=64, v=1000):
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, h, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, h, device="cuda", generator=g) * 0.05).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    labels[::7] = -100
    return hidden, weight, labels


@pytest.mark.parametrize("tile_budget_bytes", [None, 1 << 20], ids=["default", "two-pass"])
@pytest.mark.parametrize("num_items", [None, "tensor"])
def test_cross_entropy_one_sync(tile_budget_bytes, num_items, monkeypatch):
    hidden, weight, labels = _inputs()
    items = None if num_items is None else (labels != -100).sum()  # a 0-d device tensor, as Trainer passes

    def step():
        loss = linear_cross_entropy(hidden, weight, labels, num_items_in_batch=items,
                                    tile_budget_bytes=tile_budget_bytes)
        loss.backward()

    step()  # warm-up (Triton compilation)
    assert _syncs(step, monkeypatch) == 1


def test_token_loss_one_sync(monkeypatch):
    hidden, weight, labels = _inputs()
    adv = torch.randn(labels.shape, device="cuda")

    def step():
        loss, _, _ = linear_token_loss(hidden, weight, labels, lambda lp, ent, a: -a * lp, per_token={"a": adv})
        loss.backward()

    step()
    assert _syncs(step, monkeypatch) == 1
