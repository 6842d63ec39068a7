"""Inputs that used to give a wrong result or an error from deep inside torch: each gets a clear error or
the documented result, and no op writes into the caller's tensors."""

from __future__ import annotations

import pytest
import torch

from hf_fused.ops import linear_cross_entropy, linear_logprobs

N, H, V = 10, 8, 32


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::3] = -100
    return hidden, weight, labels


@pytest.mark.parametrize("value", [float("nan"), float("inf"), torch.tensor(float("nan")), torch.tensor(float("inf"))],
                         ids=["nan", "inf", "nan_tensor", "inf_tensor"])
def test_num_items_in_batch_not_finite_is_a_value_error(value):
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match="num_items_in_batch must be a finite number > 0"):
        linear_cross_entropy(hidden, weight, labels, num_items_in_batch=value)


def test_num_items_in_batch_with_several_elements_is_a_value_error():
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match="one number"):
        linear_cross_entropy(hidden, weight, labels, num_items_in_batch=torch.tensor([3.0, 4.0]))


def test_num_items_in_batch_of_another_type_is_a_type_error():
    hidden, weight, labels = _inputs()
    with pytest.raises(TypeError, match="num_items_in_batch"):
        linear_cross_entropy(hidden, weight, labels, num_items_in_batch="7")


def test_nan_token_weights_at_ignored_positions_give_zero_loss_there():
    hidden, weight, labels = _inputs()
    weights = torch.ones(N)
    weights[labels == -100] = float("nan")  # anything may sit where the label is ignored
    per_token = linear_cross_entropy(hidden, weight, labels, reduction="none", token_weights=weights)
    assert bool(torch.isfinite(per_token).all())
    assert bool((per_token[labels == -100] == 0).all())
    plain = linear_cross_entropy(hidden, weight, labels, reduction="none")
    torch.testing.assert_close(per_token, plain)
    mean = linear_cross_entropy(hidden, weight, labels, token_weights=weights)
    torch.testing.assert_close(mean, linear_cross_entropy(hidden, weight, labels))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_nan_token_weight_at_a_kept_position_is_a_value_error(reduction):
    hidden, weight, labels = _inputs()
    weights = torch.ones(N)
    weights[1] = float("nan")
    assert labels[1] != -100
    with pytest.raises(ValueError, match="token_weights must be finite"):
        linear_cross_entropy(hidden, weight, labels, reduction=reduction, token_weights=weights)


@pytest.mark.parametrize("op", ["cross_entropy", "logprobs"])
def test_second_order_gradients_raise(op):
    hidden, weight, labels = _inputs()
    if op == "cross_entropy":
        loss = linear_cross_entropy(hidden, weight, labels)
    else:
        loss = linear_logprobs(hidden, weight, labels)[0].sum()
    with pytest.raises(RuntimeError, match="second-order gradients"):
        torch.autograd.grad(loss, hidden, create_graph=True)


def test_triton_backend_on_cpu_without_interpreter_is_a_value_error(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match="'triton' runs on CUDA tensors"):
        linear_cross_entropy(hidden, weight, labels, backend="triton")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("options", [
    {}, {"softcap": 2.0, "temperature": 0.5}, {"token_weights": True}, {"grad_hint": True}, {"reduction": "none"},
], ids=["plain", "transform", "token_weights", "grad_hint", "none"])
def test_ops_never_write_into_the_callers_tensors(backend, options):
    if backend == "triton":
        pytest.importorskip("triton")
    hidden, weight, labels = _inputs()
    bias = torch.randn(V, requires_grad=True)
    per_token = torch.rand(N)
    kwargs = {k: v for k, v in options.items() if k in ("softcap", "temperature", "reduction")}
    before = [t.detach().clone() for t in (hidden, weight, bias, labels, per_token)]
    if "grad_hint" in options:
        logp, _ = linear_logprobs(hidden, weight, labels, bias, grad_hint=per_token, backend=backend)
        (logp * per_token).sum().backward()
    else:
        if "token_weights" in options:
            kwargs["token_weights"] = per_token
        loss = linear_cross_entropy(hidden, weight, labels, bias, backend=backend, **kwargs)
        (loss.sum() if loss.dim() else loss).backward()
    for name, b, a in zip(("hidden", "weight", "bias", "labels", "per-token tensor"), before,
                          (hidden, weight, bias, labels, per_token)):
        assert torch.equal(a.detach(), b), f"{name} was modified"
