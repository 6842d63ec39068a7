"""linear_topk_logprobs against a float64 dense reference (the full logits, ``log_softmax``, ``topk``): the ids, their
log-probs and the labels' log-probs, for every logit transform, tile layout, precision, and bad inputs.

Tolerance: ``RTOL = 1e-5`` for the fp32 log-probs against float64 (fp32 logits and an fp32 log-softmax over V = 97
columns). Ids are compared exactly: the test logits have no near ties (checked: adjacent float64 top-k values
differ by far more than fp32 rounding).
"""

from __future__ import annotations

import pytest
import torch

from references import TILE_LAYOUTS, TRANSFORMS, budget_for, dense_logits, rel_err
from hf_fused.ops.topk_logprobs import linear_topk_logprobs

RTOL = 1e-5
V, H = 97, 16


def _inputs(batch_shape=(3, 7), *, seed=0, dtype=torch.float32, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*batch_shape, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * (3 / H**0.5)).to(dtype)
    b = (torch.randn(V, generator=g) * 0.5).to(dtype) if bias else None
    labels = torch.randint(0, V, batch_shape, generator=g)
    return hidden, weight, b, labels


def _dense(hidden, weight, bias, k, labels=None, **transform):
    """Float64 ``(ids, logprobs, label logprobs)`` from the full logits."""
    logp = dense_logits(hidden, weight, bias, **transform).log_softmax(-1)
    top = logp.topk(k, dim=-1)
    gaps = (top.values[..., :-1] - top.values[..., 1:]).abs()
    assert k == 1 or gaps.min() > 1e-4, "near tie: ids would be ambiguous in fp32"
    label_lp = None if labels is None else logp.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return top.indices, top.values, label_lp


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
@pytest.mark.parametrize("k", [1, 5, 20])
def test_topk_ids_and_logprobs_match_float64(k, transform):
    hidden, weight, bias, labels = _inputs(seed=k)
    out = linear_topk_logprobs(hidden, weight, k, bias, labels=labels, **TRANSFORMS[transform])
    ids, lp, label_lp = _dense(hidden, weight, bias, k, labels, **TRANSFORMS[transform])
    assert out.ids.dtype == torch.int64 and out.logprobs.dtype == out.label_logprobs.dtype == torch.float32
    assert out.ids.shape == out.logprobs.shape == (3, 7, k) and out.label_logprobs.shape == (3, 7)
    assert torch.equal(out.ids, ids)
    assert rel_err(out.logprobs, lp) <= RTOL
    assert rel_err(out.label_logprobs, label_lp) <= RTOL
    assert (out.logprobs[..., :-1] >= out.logprobs[..., 1:]).all()  # most likely first


def test_whole_vocabulary_is_the_sorted_log_softmax():
    hidden, weight, bias, _ = _inputs((5,), seed=1)
    out = linear_topk_logprobs(hidden, weight, V, bias, temperature=0.7)
    logp = dense_logits(hidden, weight, bias, temperature=0.7).log_softmax(-1)
    assert torch.equal(out.ids.sort(-1).values, torch.arange(V).expand(5, V))
    assert rel_err(out.logprobs, logp.gather(-1, out.ids)) <= RTOL
    assert torch.allclose(out.logprobs.double().exp().sum(-1), torch.ones(5, dtype=torch.float64), atol=1e-5)


@pytest.mark.parametrize("layout", sorted(TILE_LAYOUTS))
def test_tile_layouts_give_the_same_result(layout):
    batch_shape, tile_rows = TILE_LAYOUTS[layout]
    hidden, weight, bias, labels = _inputs(batch_shape, seed=2)
    out = linear_topk_logprobs(hidden, weight, 4, bias, labels=labels, tile_budget_bytes=budget_for(tile_rows, V))
    ids, lp, label_lp = _dense(hidden, weight, bias, 4, labels)
    assert torch.equal(out.ids, ids) and out.ids.shape == (*batch_shape, 4)
    assert rel_err(out.logprobs, lp) <= RTOL and rel_err(out.label_logprobs, label_lp) <= RTOL


def test_ignored_labels_get_zero_and_no_labels_gives_none():
    hidden, weight, bias, labels = _inputs(seed=3)
    labels[0, :3] = -100
    out = linear_topk_logprobs(hidden, weight, 3, bias, labels=labels)
    assert (out.label_logprobs[0, :3] == 0).all() and (out.label_logprobs[0, 3:] < 0).all()
    plain = linear_topk_logprobs(hidden, weight, 3, bias)
    assert plain.label_logprobs is None and torch.equal(plain.ids, out.ids)
    labels[1, :2] = 5  # another ignore_index: its tokens get 0, the -100 ones become label 0
    other = linear_topk_logprobs(hidden, weight, 3, bias, labels=labels.clamp_min(0), ignore_index=5)
    assert (other.label_logprobs[1, :2] == 0).all() and (other.label_logprobs[0, :3] < 0).all()
    assert torch.equal(other.ids, out.ids)


@pytest.mark.parametrize("dtype,autocast", [(torch.bfloat16, None), (torch.float32, torch.bfloat16),
                                            (torch.bfloat16, torch.bfloat16)],
                         ids=["bf16_weights", "autocast_bf16_fp32_weights", "bf16_weights_autocast_bf16"])
def test_logprobs_are_fp32_of_the_operands_f_linear_would_use(dtype, autocast):
    """Under autocast the operands are the bf16 casts ``F.linear`` would make; the logits are their fp32 products,
    so the log-probs are within ``RTOL`` of float64 on those operands (eager ``F.linear`` would round the logits to
    bf16 first)."""
    hidden, weight, bias, labels = _inputs(seed=4, dtype=dtype)
    region = torch.autocast("cpu", dtype=autocast) if autocast is not None else torch.autocast("cpu", enabled=False)
    with region:
        out = linear_topk_logprobs(hidden, weight, 5, bias, labels=labels, softcap=4.0)
    operands = [t.bfloat16() for t in (hidden, weight, bias)]
    ids, lp, label_lp = _dense(*operands, 5, labels, softcap=4.0)
    assert out.logprobs.dtype == torch.float32
    assert torch.equal(out.ids, ids)
    assert rel_err(out.logprobs, lp) <= RTOL and rel_err(out.label_logprobs, label_lp) <= RTOL


def test_no_gradient_and_inputs_untouched():
    hidden, weight, bias, _ = _inputs(seed=5)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    out = linear_topk_logprobs(*leaves[:2], 2, leaves[2], logit_scale=0.5, softcap=3.0)
    assert not out.logprobs.requires_grad and not out.ids.requires_grad
    assert all(torch.equal(a.detach(), b) for a, b in zip(leaves, (hidden, weight, bias)))


@pytest.mark.parametrize("k,error,match", [
    (0, ValueError, r"k must be in \[1, V = 97\]"),
    (V + 1, ValueError, r"k must be in \[1, V = 97\]"),
    (2.0, TypeError, "k must be an int"),
    (True, ValueError, "k must be in"),
])
def test_bad_k(k, error, match):
    hidden, weight, bias, _ = _inputs(seed=6)
    with pytest.raises(error, match=match):
        linear_topk_logprobs(hidden, weight, k, bias)


@pytest.mark.parametrize("changes,error,match", [
    (dict(labels=torch.full((3, 7), V)), ValueError, "labels contain 97"),
    (dict(labels=torch.zeros(3, 7)), TypeError, "labels must be an integer"),
    (dict(weight=torch.randn(V, H + 1)), ValueError, "hidden must be"),
    (dict(temperature=0.0), ValueError, "temperature"),
    (dict(tile_budget_bytes=-1), ValueError, "tile_budget_bytes"),
])
def test_bad_inputs_raise_clear_errors(changes, error, match):
    hidden, weight, bias, _ = _inputs(seed=7)
    args = dict(hidden=hidden, weight=weight, k=3, bias=bias)
    args.update(changes)
    with pytest.raises(error, match=match):
        linear_topk_logprobs(**args)
