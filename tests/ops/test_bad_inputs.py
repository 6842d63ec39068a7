"""Inputs that used to give a wrong result or an error from deep inside torch: each gets a clear error or
the documented result, and no op writes into the caller's tensors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_fused.ops import LogitTransform, linear_cross_entropy, linear_logprobs

N, H, V = 10, 8, 32
#: fp32 against float64 (a few fp32 roundings of O(1) terms).
RTOL = 1e-5


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


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("head_grads", [True, False], ids=["with_head_grads", "weights_only"])
@pytest.mark.parametrize("reduction", ["mean", "sum_num_items", "none"])
def test_learned_token_weights_get_their_gradient(reduction, head_grads):
    """``token_weights`` that require grad get ``∂loss/∂w_t``, each token's loss term divided as the loss is, as
    float64 autograd on dense logits gives it: a zero weight included (its token is then not skipped), 0 at ignored
    positions whatever they hold; hidden's and weight's gradients stay float64's too. Both schedules of the op: the
    one pass (head gradients asked) and statistics + recompute (only the weights learn)."""
    hidden, weight, labels = _inputs(seed=3)
    hidden.requires_grad_(head_grads)
    weight.requires_grad_(head_grads)
    token_weights = torch.rand(N, generator=torch.Generator().manual_seed(4))
    token_weights[2] = 0.0
    token_weights[labels == -100] = float("nan")  # ignored positions may hold anything
    assert labels[2] != -100
    token_weights.requires_grad_()
    kwargs = {"reduction": "none"} if reduction == "none" else (
        {"reduction": "sum", "num_items_in_batch": 7} if reduction == "sum_num_items" else {"reduction": "mean"})
    upstream = torch.rand(N, generator=torch.Generator().manual_seed(5)) if reduction == "none" else 0.37
    (linear_cross_entropy(hidden, weight, labels, token_weights=token_weights, **kwargs) * upstream).sum().backward()

    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    tw64 = token_weights.detach().double().nan_to_num(0.0).requires_grad_()
    per_token = F.cross_entropy(h64 @ w64.t(), labels, reduction="none", ignore_index=-100) * tw64
    if reduction == "mean":
        ref = per_token.sum() / (labels != -100).sum()
    elif reduction == "sum_num_items":
        ref = per_token.sum() / 7
    else:
        ref = per_token
    (ref * (upstream.double() if reduction == "none" else upstream)).sum().backward()
    assert torch.isfinite(token_weights.grad).all()
    assert bool((token_weights.grad[labels == -100] == 0).all())
    assert token_weights.grad[2] != 0
    assert _rel_err(token_weights.grad, tw64.grad) <= RTOL, _rel_err(token_weights.grad, tw64.grad)
    if head_grads:
        assert _rel_err(hidden.grad, h64.grad) <= RTOL
        assert _rel_err(weight.grad, w64.grad) <= RTOL
    else:
        assert hidden.grad is None and weight.grad is None


def test_head_without_hidden_features_is_a_value_error():
    """A ``[V, 0]`` weight (H = 0) used to fail in a reshape inside torch."""
    with pytest.raises(ValueError, match=r"H = 0 hidden features.*pass lm_head.weight as \[V, H\] with H > 0"):
        linear_cross_entropy(torch.randn(N, 0), torch.randn(V, 0), torch.zeros(N, dtype=torch.long))


@pytest.mark.parametrize("name", ["temperature", "softcap", "logit_scale"])
def test_transform_value_given_as_several_numbers_is_a_value_error(name):
    """A 2-element tensor ``temperature`` (or soft-cap, scale) used to fail inside torch's scalar conversion."""
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match=f"{name} must be one number, got a tensor of shape \\(2,\\).*pass a float"):
        linear_logprobs(hidden, weight, labels, **{name: torch.tensor([1.0, 2.0])})


def test_meta_tensors_are_a_value_error():
    """Tensors on the meta device (a model built under ``torch.device("meta")``) used to fail copying out of them."""
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match="hidden, weight and labels are on the meta device.*materialize the model"):
        linear_cross_entropy(hidden.detach().to("meta"), weight.detach().to("meta"), labels.to("meta"))


def test_ignore_index_that_is_not_an_integer_is_a_type_error():
    """``ignore_index=None`` used to fail with an AttributeError on a bool."""
    hidden, weight, labels = _inputs()
    with pytest.raises(TypeError, match="ignore_index must be an integer label value"):
        linear_cross_entropy(hidden, weight, labels, ignore_index=None)


def test_sparse_hidden_states_are_a_type_error():
    """A sparse tensor used to fail in a reshape inside torch."""
    hidden, weight, labels = _inputs()
    with pytest.raises(TypeError, match=r"hidden must be a dense tensor.*hidden.to_dense\(\)"):
        linear_cross_entropy(hidden.detach().to_sparse(), weight, labels)


@pytest.mark.parametrize("value, error, match", [
    ("2", TypeError, "temperature must be a number, got '2'"),
    (torch.tensor(2.0, requires_grad=True), ValueError, "temperature requires grad.*do not differentiate"),
], ids=["string", "requires_grad"])
def test_temperature_that_is_not_a_constant_number_is_an_error(value, error, match):
    """A string used to fail in ``math.isfinite``; a tensor requiring grad silently got no gradient."""
    hidden, weight, labels = _inputs()
    with pytest.raises(error, match=match):
        linear_cross_entropy(hidden, weight, labels, temperature=value)


def test_transform_together_with_a_transform_keyword_is_a_value_error():
    """Which of the two would win is a guess: the error names ``dataclasses.replace``."""
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match=r"either whole \(transform=\) or as temperature.*dataclasses.replace"):
        linear_logprobs(hidden, weight, labels, transform=LogitTransform(softcap=3.0), temperature=0.7)


def test_tensors_on_several_devices_say_where_to_move_them():
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match=r"must be on one device.*labels.to\(weight.device\)"):
        linear_cross_entropy(hidden, weight, labels.to("meta"))


@pytest.mark.parametrize("field", ["clip_lower", "clip_higher", "beta"])
@pytest.mark.parametrize("value", ["0.2", True, None], ids=["string", "bool", "none"])
def test_grpo_objective_numbers_of_another_type_are_a_type_error(field, value):
    """``"0.2" < 0`` used to fail inside the range check with Python's own comparison error."""
    from hf_fused.ops import GRPOObjective

    with pytest.raises(TypeError, match=rf"GRPOObjective.{field} must be a real number"):
        GRPOObjective(**{field: value})


@pytest.mark.parametrize("per_token", [[torch.zeros(3)], torch.zeros(3), {}], ids=["list", "tensor", "empty"])
def test_token_loss_hint_per_token_not_a_dict_of_tensors_is_a_type_error(per_token):
    """A list used to raise ``AttributeError`` and a bare tensor an ambiguous-truth ``RuntimeError``."""
    from hf_fused.ops import TokenLossHint

    with pytest.raises(TypeError, match="per_token must be a non-empty dict of tensors"):
        TokenLossHint(lambda logp, h, **c: -logp, per_token)


def test_get_backend_takes_a_device_name():
    from hf_fused.ops import get_backend
    from hf_fused.ops.backends.torch_reference import TorchReferenceBackend

    assert isinstance(get_backend("cpu", "torch"), TorchReferenceBackend)
    assert get_backend("cpu", "torch") is get_backend(torch.device("cpu"), "torch")


@pytest.mark.parametrize("name, factory", [(123, object), ("", object), ("mine", None)], ids=["int", "empty", "factory"])
def test_register_backend_checks_its_arguments(name, factory):
    from hf_fused.ops import available_backends, register_backend

    before = available_backends()
    with pytest.raises(TypeError, match="register_backend"):
        register_backend(name, factory)
    assert available_backends() == before


@pytest.mark.parametrize("statistics", [None, 3], ids=["none", "int"])
def test_token_statistics_not_a_sequence_is_a_type_error(statistics):
    from hf_fused.ops import linear_token_statistics

    hidden, weight, labels = _inputs()
    with pytest.raises(TypeError, match="statistics must be a sequence of names"):
        linear_token_statistics(hidden, weight, labels, statistics=statistics)
