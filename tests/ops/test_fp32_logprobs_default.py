"""Which one pass takes its statistics from the logits matmul's fp32 accumulator by default on a CUDA device
(``fp32_logits_rule.DEFAULT_ENABLED``): every call that returns per-token log-probs (log-probs with a gradient hint,
token losses), so that they are the statistics pass's — an RL trainer's old log-probs and its loss's agree at the
same weights —, and not the cross-entropy, whose loss alone leaves the op.

The GPU backend's kernels run under Triton's interpreter on CPU tensors, with the rule's answer for a CUDA device
standing in for the device (``runs_on`` patched: the rule as on CUDA, then the operands' layout); on real CPU
tensors the default is off everywhere (the stored tiles' results, bit for bit)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from hf_fused.ops import linear_cross_entropy, linear_logprobs, linear_token_loss  # noqa: E402
from hf_fused.ops.backends.triton_cublas import fp32_logits_rule as R  # noqa: E402
from hf_fused.ops.backends.triton_cublas import fused_matmul  # noqa: E402

FP32_NOISE = 1e-5  # nats: fp32 statistics of log-probs of a few nats


def _inputs(n=24, h=16, v=300, seed=0):
    """bf16 operands whose logits have standard deviation ~4, a few labels ignored."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).bfloat16()
    weight = (torch.randn(v, h, generator=g) * (4 / h**0.5)).bfloat16()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::5] = -100
    return hidden, weight, labels


def _exact(hidden, weight, labels):
    logp = torch.log_softmax(hidden.double() @ weight.double().t(), -1).gather(1, labels.clamp_min(0)[:, None])[:, 0]
    return logp * (labels != -100)


@pytest.fixture
def as_on_cuda(monkeypatch):
    """The rule's default for a CUDA device on CPU tensors; the calls of the fused statistics kernel, counted."""
    monkeypatch.delenv(R.ENV, raising=False)
    monkeypatch.setattr(R, "runs_on", lambda weight, schedule="two_passes": (
        R.enabled(schedule, torch.device("cuda")) and R.readable(weight, weight)))
    calls = []
    kernel = fused_matmul.logits_statistics_
    monkeypatch.setattr(fused_matmul, "logits_statistics_", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    return calls


def test_hinted_logprobs_one_pass_takes_fp32_statistics_like_the_statistics_pass(as_on_cuda):
    hidden, weight, labels = _inputs()
    exact = _exact(hidden, weight, labels)
    with torch.no_grad():  # the old log-probs: the statistics pass
        old, _ = linear_logprobs(hidden, weight, labels, backend="triton")
    assert as_on_cuda and (old.double() - exact).abs().max() < FP32_NOISE
    as_on_cuda.clear()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    hint = torch.randn(labels.shape, generator=torch.Generator().manual_seed(1))
    lp, _ = linear_logprobs(h, w, labels, backend="triton", grad_hint=hint)  # the loss's: the one pass
    (lp * hint).sum().backward()
    assert as_on_cuda, "the one pass did not take the fused statistics"
    assert torch.equal(lp.detach(), old)  # the log-ratio at the same weights is 0
    assert h.grad is not None and w.grad is not None


def test_token_loss_one_pass_takes_fp32_statistics(as_on_cuda):
    hidden, weight, labels = _inputs(seed=2)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = linear_token_loss(h, w, labels, lambda logp, entropy, *, a: -(a * logp), backend="triton",
                            per_token={"a": torch.ones(labels.shape)})
    out.loss.backward()
    assert as_on_cuda and (out.logprobs.double() - _exact(hidden, weight, labels)).abs().max() < FP32_NOISE


def test_cross_entropy_one_pass_keeps_its_bf16_tiles(as_on_cuda):
    hidden, weight, labels = _inputs(seed=3)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    linear_cross_entropy(h, w, labels, backend="triton").backward()
    assert not as_on_cuda  # neither its one pass nor a statistics pass ran the fused kernel
    assert h.grad is not None and w.grad is not None


def test_cpu_tensors_keep_the_stored_tiles(monkeypatch):
    monkeypatch.delenv(R.ENV, raising=False)
    hidden, weight, labels = _inputs()
    assert not any(R.enabled(schedule, torch.device("cpu")) for schedule in R.DEFAULT_ENABLED)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    hint = torch.randn(labels.shape, generator=torch.Generator().manual_seed(1))
    lp, _ = linear_logprobs(h, w, labels, backend="triton", grad_hint=hint)
    assert (lp.detach().double() - _exact(hidden, weight, labels)).abs().max() > 1e-3  # bf16 logits
