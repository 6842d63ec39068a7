"""The ops' prologue (:mod:`hf_fused.ops.prepare`): the causal shift, the logit transform given whole, and the
flattened head every op computes from."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

from hf_fused.ops import (
    GRPOObjective,
    LogitTransform,
    causal_shift,
    linear_cross_entropy,
    linear_grpo_loss,
    linear_logprobs,
    linear_token_loss,
    linear_token_statistics,
)
from hf_fused.ops.prepare import PreparedHead, prepare

B, T, H, V = 2, 5, 8, 29


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    bias = torch.randn(V, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, :2] = -100
    return hidden, weight, bias, labels


def test_causal_shift_is_transformers_shift():
    """Position ``t`` scores ``labels[t + 1]`` and the last position nothing, as transformers' ``ForCausalLMLoss``
    pads and shifts; the loss on shifted labels is the causal-LM loss on the logits."""
    hidden, weight, bias, labels = _inputs()
    shifted = causal_shift(labels)
    assert torch.equal(shifted[:, :-1], labels[:, 1:])
    assert bool((shifted[:, -1] == -100).all())
    assert torch.equal(causal_shift(labels, ignore_index=-1)[:, -1], torch.full((B,), -1))
    logits = (hidden @ weight.t() + bias).double()
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), ignore_index=-100)
    got = linear_cross_entropy(hidden, weight, shifted, bias)
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=0)


def _token_loss(logprobs, entropy, *, advantages):
    return -advantages * logprobs - 0.01 * entropy


OPS = {
    "cross_entropy": lambda h, w, b, y, **kw: (linear_cross_entropy(h, w, y, b, **kw),),
    "cross_entropy_none": lambda h, w, b, y, **kw: (linear_cross_entropy(h, w, y, b, reduction="none", **kw),),
    "logprobs": lambda h, w, b, y, **kw: linear_logprobs(h, w, y, b, return_entropy=True, **kw),
    "token_loss": lambda h, w, b, y, **kw: linear_token_loss(
        h, w, y, _token_loss, b, per_token={"advantages": torch.linspace(-1, 1, B * T).view(B, T)},
        need_entropy=True, **kw),
    "grpo": lambda h, w, b, y, **kw: (linear_grpo_loss(
        h, w, y.clamp_min(0), advantages=torch.ones(B, 1), response_mask=y != -100, loss_denominator=3,
        objective=GRPOObjective(beta=0.0), bias=b, **kw).loss,),
    "statistics": lambda h, w, b, y, **kw: tuple(linear_token_statistics(h, w, y, b, **kw).values()),
}


@pytest.mark.parametrize("op", OPS)
def test_transform_given_whole_is_the_keywords(op):
    """``transform=LogitTransform(...)`` gives the outputs and gradients of the same three keywords, bit for bit."""
    keywords = dict(logit_scale=1.5, softcap=3.0, temperature=0.7)
    results = []
    for kwargs in (keywords, {"transform": LogitTransform(**keywords)}):
        hidden, weight, bias, labels = _inputs(seed=1)
        outputs = [o for o in OPS[op](hidden, weight, bias, labels, **kwargs) if o is not None]
        differentiable = [o for o in outputs if o.requires_grad]
        if differentiable:
            sum(o.float().sum() for o in differentiable).backward()
        results.append(outputs + [t.grad for t in (hidden, weight, bias)])
    assert len(results[0]) == len(results[1])
    for ours, theirs in zip(*results):
        assert (ours is None and theirs is None) or torch.equal(ours, theirs)


def test_prepared_head_is_the_flattened_kept_rows():
    """``prepare``: ``[B, T, H]`` flattened to ``[N, H]`` (a view of the caller's tensor), the kept rows ascending,
    the transform built from the keywords, per-token tensors at the kept rows, outputs back in the labels' shape."""
    hidden, weight, bias, labels = _inputs()
    prepared = prepare(hidden, weight, labels, bias, softcap=2.0, backend="torch")
    head = prepared.head
    assert head.hidden.shape == (B * T, H) and head.hidden.data_ptr() == hidden.data_ptr()
    assert head.weight is weight and head.bias is bias
    assert torch.equal(head.rows, (labels.reshape(-1) != -100).nonzero().squeeze(1))
    assert head.transform == LogitTransform(softcap=2.0)
    assert prepared.backend.name == "torch" and prepared.batch_shape == (B, T) and prepared.grad_enabled
    weights = torch.arange(B * T, dtype=torch.float32).view(B, T)
    assert torch.equal(prepared.per_token_rows(weights, "w"), weights.reshape(-1)[head.rows])
    scattered = prepared.scatter(torch.ones(head.rows.numel()), hidden)
    assert torch.equal(prepared.shaped(scattered), (labels != -100).float())
    with torch.no_grad():
        assert not prepare(hidden, weight, labels).grad_enabled


def test_prepare_docstring_recipe_makes_an_op():
    """The docstring's recipe for a new op (one Function, one call to ``prepare``) runs as written: here a weighted
    negative log-likelihood whose Function recomputes in backward, against autograd on dense logits."""
    from hf_fused.ops.backward import recompute_grads, upstream_rows
    from hf_fused.ops.head_inputs import HeadInputs, NeededGrads
    from hf_fused.ops.precision import autocast_off

    class Call(NamedTuple):
        prepared: PreparedHead
        weights: torch.Tensor  # [M] fp32 at the kept rows

    class WeightedNLL(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight, bias, call):
            prepared, weights = call.prepared, call.weights
            given = prepared.given(hidden, weight, bias)
            with autocast_off(hidden.device.type):
                stats = prepared.backend.logprobs_forward(given)
            given.save_for_backward(ctx, stats.lse, weights)
            ctx.backend, ctx.need = prepared.backend, NeededGrads.of(ctx, bias, prepared.grad_enabled)
            per_token = prepared.scatter(-stats.logprobs * weights, hidden)
            return per_token.sum(), per_token

        @staticmethod
        def backward(ctx, grad_loss, grad_per_token):
            given, (lse, weights) = HeadInputs.saved(ctx)
            g_lp = -weights * (grad_loss + upstream_rows(grad_per_token, given.rows))
            grads, rows = recompute_grads(ctx.backend, given, lse, None, g_lp, None, ctx.need)
            return grads.input_grads(given.hidden, given.weight, given.bias, rows) + (None,)

    def linear_weighted_nll(hidden, weight, labels, bias=None, *, token_weights, **head_options):
        prepared = prepare(hidden, weight, labels, bias, **head_options)
        weights = prepared.per_token_rows(token_weights, "token_weights")
        loss, per_token = prepared.apply(WeightedNLL, Call(prepared, weights))
        return loss, prepared.shaped(per_token)

    hidden, weight, bias, labels = _inputs(seed=2)
    token_weights = torch.rand(B, T, generator=torch.Generator().manual_seed(3))
    loss, per_token = linear_weighted_nll(hidden, weight, labels, bias, token_weights=token_weights, temperature=0.8)
    loss.backward()
    h64, w64, b64 = (t.detach().double().requires_grad_() for t in (hidden, weight, bias))
    dense = F.cross_entropy((h64 @ w64.t() + b64).view(-1, V) / 0.8, labels.view(-1), reduction="none")
    ref = dense.view(B, T) * token_weights.double()
    ref.sum().backward()
    torch.testing.assert_close(per_token.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    for ours, exact in ((hidden.grad, h64.grad), (weight.grad, w64.grad), (bias.grad, b64.grad)):
        assert ((ours.double() - exact).norm() / exact.norm()).item() <= 1e-5
