"""linear_cross_entropy(token_weights=...) against the float64 dense reference on both backends (the
Triton one through its CPU interpreter), on each GPU path (one pass, vocabulary-outer two passes), and
against the on-policy DAPO loss it stands for in GRPO.

Accuracy contract (fp32 inputs): relative error ≤ 1e-5 for the loss and every gradient.
"""

from __future__ import annotations

import pytest
import torch

from references import assert_head_grads, dense_cross_entropy, dense_logprobs, leaf64, make_head_inputs, rel_err
from references import H, RTOL, TRANSFORMS, budget_for
from benchmarks.losses import GRPO_LOSS_TYPES, grpo_loss, token_weights_at_ratio_one
from hf_fused.ops import available_backends, get_backend, linear_cross_entropy, linear_logprobs

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    "triton" not in available_backends(), reason="triton not importable"))]
V = 50


def weights_like(labels, seed, zero_every=0):
    w = torch.randn(labels.shape, generator=torch.Generator().manual_seed(seed))
    if zero_every:
        w.view(-1)[::zero_every] = 0.0
    return w


def check_weighted(hidden, weight, bias, labels, token_weights, **kwargs):
    h64, w64, b64 = leaf64(hidden), leaf64(weight), leaf64(bias)
    loss = linear_cross_entropy(hidden, weight, labels, bias, token_weights=token_weights, **kwargs)
    dense_kwargs = {k: v for k, v in kwargs.items() if k not in ("tile_budget_bytes", "backend")}
    ref = dense_cross_entropy(h64, w64, labels, b64, token_weights=token_weights, **dense_kwargs)
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    assert rel_err(loss, ref) <= RTOL
    up = torch.randn(loss.shape, generator=torch.Generator().manual_seed(7)) if loss.dim() else 0.37
    (loss * up).sum().backward()
    (ref * (up.double() if torch.is_tensor(up) else up)).sum().backward()
    assert_head_grads((hidden, weight, bias), (h64, w64, b64), RTOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction, num_items", [("mean", None), ("sum", None), ("sum", 7), ("none", None)])
@pytest.mark.parametrize("budget", [None, "small"], ids=["default", "small-tiles"])
@pytest.mark.parametrize("transform", ["identity", "combined"])
def test_token_weights_match_float64(backend, reduction, num_items, budget, transform):
    # With the triton backend the default budget takes the one-pass path (small head), the small budget
    # the vocabulary-outer two-pass path.
    hidden, weight, bias, labels = make_head_inputs((3, 7), H, V, ignore="some", seed=50)
    check_weighted(
        hidden, weight, bias, labels, weights_like(labels, 51, zero_every=4), reduction=reduction,
        num_items_in_batch=num_items, backend=backend,
        tile_budget_bytes=None if budget is None else budget_for(2, V), **TRANSFORMS[transform],
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_weight_tokens_are_skipped(backend, monkeypatch):
    hidden, weight, bias, labels = make_head_inputs((4, 5), H, V, ignore="some", seed=52)
    token_weights = weights_like(labels, 53, zero_every=3)
    impl = get_backend(hidden.device, backend)
    seen, original = [], impl.logprobs_with_grads
    monkeypatch.setattr(impl, "logprobs_with_grads",
                        lambda head, *a, **k: seen.append(head.rows.numel()) or original(head, *a, **k))
    check_weighted(hidden, weight, bias, labels, token_weights, backend=backend)
    assert seen == [int(((labels != -100) & (token_weights != 0)).sum())]


def test_all_zero_weights_give_zero_loss_and_grads():
    hidden, weight, bias, labels = make_head_inputs((2, 5), H, V, seed=54)
    loss = linear_cross_entropy(hidden, weight, labels, bias, token_weights=torch.zeros(labels.shape))
    loss.backward()
    assert loss.item() == 0.0
    assert all(torch.count_nonzero(t.grad) == 0 for t in (hidden, weight, bias))


def test_unit_weights_equal_unweighted():
    hidden, weight, bias, labels = make_head_inputs((3, 5), H, V, ignore="some", seed=55)
    with torch.no_grad():
        a = linear_cross_entropy(hidden, weight, labels, bias, token_weights=torch.ones(labels.shape))
        b = linear_cross_entropy(hidden, weight, labels, bias)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_type", GRPO_LOSS_TYPES)
def test_weighted_sum_has_the_on_policy_grpo_gradient(backend, loss_type):
    """TRL's clipped-ratio losses on-policy (ratio 1, no KL): their value is −Σ w and their gradient that of
    Σ w·CE, with w = A·mask / the loss type's normalizer."""
    hidden, weight, _, labels = make_head_inputs((4, 6), H, V, seed=56)
    mask = torch.ones(labels.shape, dtype=torch.bool)
    mask[:, 4:] = False
    mask[1, 2:] = False  # sequences of different lengths: "grpo" normalizes per sequence
    advantages = torch.randn(4, generator=torch.Generator().manual_seed(57))
    h64, w64 = leaf64(hidden), leaf64(weight)
    logp, _ = dense_logprobs(h64, w64, labels.masked_fill(~mask, -100))
    ref = grpo_loss(logp, mask, advantages.double(), loss_type)
    ref.backward()
    token_weights = token_weights_at_ratio_one(mask, advantages, loss_type)
    assert abs(-token_weights.sum().item() - ref.item()) <= RTOL * abs(ref.item())
    linear_cross_entropy(
        hidden, weight, labels.masked_fill(~mask, -100), token_weights=token_weights, reduction="sum",
        backend=backend,
    ).backward()
    assert_head_grads((hidden, weight, None), (h64, w64, None), RTOL)


def test_token_weights_errors_say_what_was_wrong():
    hidden, weight, bias, labels = make_head_inputs((2, 3), H, V, seed=58)
    with pytest.raises(ValueError, match="token_weights must have labels' shape"):
        linear_cross_entropy(hidden, weight, labels, bias, token_weights=torch.ones(6))
    with pytest.raises(TypeError, match="token_weights must be a floating-point tensor"):
        linear_cross_entropy(hidden, weight, labels, bias, token_weights=torch.ones(labels.shape, dtype=torch.long))
