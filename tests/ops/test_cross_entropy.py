"""linear_cross_entropy against the float64 dense reference: loss values and gradients w.r.t. hidden,
weight and bias, across tile layouts, batch shapes, reductions, ignore patterns, logit transforms,
frozen inputs, upstream gradient scaling and bf16 inputs.

Accuracy contract (fp32 inputs): relative error ≤ 1e-5 — ``|a − b| / |b|`` for the loss,
``‖a − b‖ / ‖b‖`` for per-token losses and every gradient.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.nn.functional as F

from references import assert_head_grads, assert_rounded_like, dense_cross_entropy, leaf64, make_head_inputs, rel_err
from references import H, RTOL, TILE_LAYOUTS, TRANSFORMS, budget_for
from hf_fused.ops import linear_cross_entropy, linear_logprobs



def check_ce(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    labels: torch.Tensor,
    *,
    upstream=None,
    loss_tol: float = RTOL,
    grad_tol: float = RTOL,
    **kwargs,
) -> torch.Tensor:
    """Run the fused op and the dense reference with the same upstream gradient; assert the loss and
    every requested gradient match; return the fused loss.

    ``upstream``: None (plain backward), a float (``(loss * upstream).backward()``) or a tensor of
    per-token weights for ``reduction="none"`` (``(loss * upstream).sum().backward()``).
    """
    h64, w64, b64 = leaf64(hidden), leaf64(weight), leaf64(bias)
    loss = linear_cross_entropy(hidden, weight, labels, bias, **kwargs)
    dense_kwargs = {k: v for k, v in kwargs.items() if k not in ("tile_budget_bytes", "backend")}
    ref = dense_cross_entropy(h64, w64, labels, b64, **dense_kwargs)

    assert loss.dtype == torch.float32
    assert loss.shape == ref.shape
    assert rel_err(loss, ref) <= loss_tol, f"loss {loss} vs dense {ref}"

    def backward(out, up):
        if up is None:
            up = 1.0
        if isinstance(up, torch.Tensor):
            out = out * up.to(out.dtype)
        else:
            out = out * up
        out.sum().backward()

    if any(t is not None and t.requires_grad for t in (hidden, weight, bias)):
        backward(loss, upstream)
        backward(ref, upstream)
        assert_head_grads((hidden, weight, bias), (h64, w64, b64), grad_tol)
    return loss


def test_dense_reference_agrees_with_torch_cross_entropy():
    """The ground truth itself: float64 F.cross_entropy on materialized logits, every reduction."""
    hidden, weight, bias, labels = make_head_inputs((3, 5), H, 50, ignore="some", seed=1)
    logits = (hidden.double() @ weight.double().t() + bias.double()).view(-1, 50)
    for reduction in ("mean", "sum", "none"):
        expected = F.cross_entropy(logits, labels.view(-1), reduction=reduction, ignore_index=-100)
        got = dense_cross_entropy(hidden, weight, labels, bias, reduction=reduction)
        torch.testing.assert_close(got.reshape(expected.shape), expected, rtol=1e-12, atol=1e-12)


# -- tile layouts and batch shapes -----------------------------------------------------------------

@pytest.mark.parametrize("vocab_size", [50, 97, 257], ids=lambda v: f"V{v}")
@pytest.mark.parametrize("layout", list(TILE_LAYOUTS), ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_loss_and_grads_match_dense_for_every_tile_layout(layout, vocab_size, reduction):
    batch_shape, tile_rows = TILE_LAYOUTS[layout]
    hidden, weight, bias, labels = make_head_inputs(batch_shape, H, vocab_size, seed=vocab_size)
    check_ce(
        hidden, weight, bias, labels, reduction=reduction, tile_budget_bytes=budget_for(tile_rows, vocab_size)
    )


def test_unbatched_hidden_vector_and_scalar_label():
    hidden, weight, bias, labels = make_head_inputs((), H, 50)
    loss = check_ce(hidden, weight, bias, labels)
    assert loss.shape == ()
    per_token = check_ce(*make_head_inputs((), H, 50), reduction="none")
    assert per_token.shape == ()


def test_default_tile_budget_matches_dense():
    hidden, weight, bias, labels = make_head_inputs((2, 9), H, 97, ignore="some")
    check_ce(hidden, weight, bias, labels)


# -- reductions, num_items_in_batch, ignore patterns -------------------------------------------------

NUM_ITEMS = {
    "none": None,
    "int": 11,
    "float": 7.5,
    "tensor": torch.tensor(11),
    "tensor_float": torch.tensor(5.0),
}


# num_items_in_batch with reduction="none" is an error (tests/test_ops_inputs.py).
REDUCTION_NUM_ITEMS = [(r, n) for r in ("mean", "sum") for n in NUM_ITEMS] + [("none", "none")]


@pytest.mark.parametrize("ignore", ["none", "some", "edges"])
@pytest.mark.parametrize("reduction,num_items", REDUCTION_NUM_ITEMS, ids="-".join)
def test_every_reduction_and_num_items_matches_dense(reduction, num_items, ignore):
    hidden, weight, bias, labels = make_head_inputs((2, 7), H, 97, ignore=ignore, seed=3)
    loss = check_ce(
        hidden, weight, bias, labels,
        reduction=reduction, num_items_in_batch=NUM_ITEMS[num_items], tile_budget_bytes=budget_for(3, 97),
    )
    if reduction == "none":
        assert loss.shape == labels.shape
        assert (loss[labels == -100] == 0).all()


def test_mean_divides_by_non_ignored_tokens_not_all_tokens():
    hidden, weight, bias, labels = make_head_inputs((4, 5), H, 50, ignore="some", seed=5)
    n_valid = int((labels != -100).sum())
    assert 0 < n_valid < labels.numel()
    with torch.no_grad():
        mean = linear_cross_entropy(hidden, weight, labels, bias)
        total = linear_cross_entropy(hidden, weight, labels, bias, reduction="sum")
    torch.testing.assert_close(mean, total / n_valid, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "reduction,num_items",
    [("mean", None), ("sum", None), ("none", None), ("mean", 4), ("sum", torch.tensor(4))],
)
def test_all_ignored_gives_zero_loss_and_finite_zero_grads(reduction, num_items):
    hidden, weight, bias, labels = make_head_inputs((2, 3), H, 50, ignore="all")
    loss = linear_cross_entropy(
        hidden, weight, labels, bias, reduction=reduction, num_items_in_batch=num_items,
        tile_budget_bytes=budget_for(2, 50),
    )
    assert torch.isfinite(loss).all() and (loss == 0).all()
    loss.sum().backward()
    for t in (hidden, weight, bias):
        assert t.grad is not None and torch.isfinite(t.grad).all() and (t.grad == 0).all()


@pytest.mark.parametrize("ignore_index", [-1, 7], ids=["negative", "in_vocab_id"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_custom_ignore_index_excludes_exactly_those_tokens(ignore_index, reduction):
    hidden, weight, bias, labels = make_head_inputs(
        (3, 5), H, 50, ignore="some", ignore_index=ignore_index, seed=11
    )
    labels_default = labels.clone()
    labels_default[labels == ignore_index] = -100
    assert (labels == -100).sum() == 0
    loss = check_ce(hidden, weight, bias, labels, ignore_index=ignore_index, reduction=reduction,
                    tile_budget_bytes=budget_for(4, 50))
    with torch.no_grad():  # same tokens ignored through the default index: same loss
        default = linear_cross_entropy(hidden, weight, labels_default, bias, reduction=reduction)
    torch.testing.assert_close(loss.detach(), default, rtol=1e-6, atol=1e-7)


def test_ignored_positions_get_exactly_zero_hidden_grad():
    hidden, weight, bias, labels = make_head_inputs((3, 6), H, 50, ignore="some", seed=2)
    linear_cross_entropy(hidden, weight, labels, bias, tile_budget_bytes=budget_for(4, 50)).backward()
    assert (hidden.grad[labels == -100] == 0).all()
    assert (hidden.grad[labels != -100].abs().sum(-1) > 0).all()


# -- logit transforms, bias ------------------------------------------------------------------------


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("transform", list(TRANSFORMS), ids=str)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_logit_transform_matches_dense(transform, with_bias, reduction):
    hidden, weight, bias, labels = make_head_inputs((2, 6), H, 97, bias=with_bias, ignore="some", seed=4)
    check_ce(hidden, weight, bias, labels, reduction=reduction, tile_budget_bytes=budget_for(5, 97),
             **TRANSFORMS[transform])


def test_softcap_actually_changes_the_loss():
    """Guards the transform tests against inputs too small for the soft-cap to matter."""
    hidden, weight, bias, labels = make_head_inputs((2, 6), H, 97, seed=4)
    with torch.no_grad():
        plain = linear_cross_entropy(hidden, weight, labels, bias)
        capped = linear_cross_entropy(hidden, weight, labels, bias, softcap=3.0)
    assert abs(float(plain - capped)) > 0.05 * abs(float(plain))


def test_negative_logit_scale_matches_dense():
    hidden, weight, bias, labels = make_head_inputs((9,), H, 50, seed=6)
    check_ce(hidden, weight, bias, labels, logit_scale=-0.5, softcap=2.0, tile_budget_bytes=budget_for(2, 50))


# -- frozen inputs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("frozen", ["weight", "hidden", "bias", "weight_and_bias"])
def test_frozen_inputs_get_no_grad_and_others_stay_exact(frozen, reduction):
    hidden, weight, bias, labels = make_head_inputs((2, 5), H, 50, ignore="some", seed=8)
    for name, t in (("hidden", hidden), ("weight", weight), ("bias", bias)):
        if name in frozen.split("_and_"):
            t.requires_grad_(False)
    check_ce(hidden, weight, bias, labels, reduction=reduction, softcap=3.0,
             tile_budget_bytes=budget_for(3, 50))
    assert (hidden.grad is None) == (frozen == "hidden")
    assert (weight.grad is None) == ("weight" in frozen)


def test_frozen_weight_without_bias_gives_hidden_grad_only():
    hidden, weight, _, labels = make_head_inputs((7,), H, 50, bias=False)
    weight.requires_grad_(False)
    check_ce(hidden, weight, None, labels, tile_budget_bytes=budget_for(2, 50))
    assert weight.grad is None and hidden.grad is not None


def test_nothing_requires_grad_gives_a_plain_loss():
    hidden, weight, bias, labels = make_head_inputs((7,), H, 50)
    for t in (hidden, weight, bias):
        t.requires_grad_(False)
    loss = check_ce(hidden, weight, bias, labels)
    assert not loss.requires_grad


# -- upstream gradient scaling -------------------------------------------------------------------


@pytest.mark.parametrize("num_items", [None, 6, torch.tensor(6)], ids=["no_num_items", "int", "tensor"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("factor", [0.25, 1024.0, -3.0], ids=["grad_accum_div4", "fp16_loss_scale", "negative"])
def test_upstream_gradient_scales_grads_computed_in_forward(factor, reduction, num_items):
    hidden, weight, bias, labels = make_head_inputs((2, 6), H, 97, ignore="some", seed=9)
    check_ce(hidden, weight, bias, labels, reduction=reduction, num_items_in_batch=num_items,
             upstream=factor, tile_budget_bytes=budget_for(4, 97), softcap=4.0)


def test_loss_used_twice_in_the_graph_sums_upstream_grads():
    hidden, weight, bias, labels = make_head_inputs((2, 6), H, 50, seed=10)
    loss = linear_cross_entropy(hidden, weight, labels, bias)
    (loss * 0.25 + loss * 0.5 + loss.detach()).backward()
    h64, w64, b64 = leaf64(hidden), leaf64(weight), leaf64(bias)
    (dense_cross_entropy(h64, w64, labels, b64) * 0.75).backward()
    for fused, dense in ((hidden, h64), (weight, w64), (bias, b64)):
        assert rel_err(fused.grad, dense.grad) <= RTOL


@pytest.mark.parametrize("transform", ["identity", "combined"])
def test_reduction_none_with_random_per_token_weights(transform):
    hidden, weight, bias, labels = make_head_inputs((3, 5), H, 97, ignore="some", seed=12)
    per_token_weights = torch.randn(labels.shape, generator=torch.Generator().manual_seed(0))
    check_ce(hidden, weight, bias, labels, reduction="none", upstream=per_token_weights,
             tile_budget_bytes=budget_for(4, 97), **TRANSFORMS[transform])


def test_grads_accumulate_across_two_calls_like_gradient_accumulation():
    """Two micro-batches, each loss divided by 2 before backward, accumulate into .grad exactly."""
    h1, weight, bias, y1 = make_head_inputs((2, 5), H, 50, ignore="some", seed=13)
    h2, _, _, y2 = make_head_inputs((2, 5), H, 50, ignore="some", seed=14)
    w64, b64 = leaf64(weight), leaf64(bias)
    for h, y in ((h1, y1), (h2, y2)):
        (linear_cross_entropy(h, weight, y, bias, num_items_in_batch=12) / 2).backward()
        (dense_cross_entropy(leaf64(h), w64, y, b64, num_items_in_batch=12) / 2).backward()
    assert rel_err(weight.grad, w64.grad) <= RTOL
    assert rel_err(bias.grad, b64.grad) <= RTOL


# -- grad mode ---------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_no_grad_call_gives_the_same_loss(reduction):
    hidden, weight, bias, labels = make_head_inputs((2, 7), H, 97, ignore="some", seed=15)
    kwargs = dict(reduction=reduction, softcap=4.0, tile_budget_bytes=budget_for(3, 97))
    with torch.no_grad():
        no_grad = linear_cross_entropy(hidden, weight, labels, bias, **kwargs)
    with_grad = linear_cross_entropy(hidden, weight, labels, bias, **kwargs)
    assert not no_grad.requires_grad and with_grad.requires_grad
    torch.testing.assert_close(no_grad, with_grad.detach(), rtol=1e-6, atol=0)


def test_second_backward_through_a_retained_graph_is_exact_or_raises():
    """Gradients computed in the forward must not silently vanish on a second backward.

    ``loss.backward(retain_graph=True); loss.backward()`` must either accumulate the gradient twice (as
    the dense loss does) or raise; it must never leave the first gradient unchanged without a word.
    """
    hidden, weight, bias, labels = make_head_inputs((2, 5), H, 50, seed=16)
    loss = linear_cross_entropy(hidden, weight, labels, bias)
    loss.backward(retain_graph=True)
    first = weight.grad.clone()
    try:
        loss.backward()
    except RuntimeError:
        return  # a clear refusal is acceptable
    torch.testing.assert_close(weight.grad, 2 * first, rtol=1e-6, atol=1e-8)


# -- bf16 -------------------------------------------------------------------------------------------

# bf16 bound. The reference is computed in float64 from the *bf16-rounded* inputs, so input rounding is
# not part of the error. The op upcasts those exact bf16 values to fp32 and does the tile math and all
# accumulation in fp32, so the loss (an fp32 output) carries fp32-level error only: the same 1e-5 bound.
# Each gradient comes back in the leaf dtype, bf16, i.e. one final rounding of an fp32 value that is
# within ~1e-5 of exact. Round-to-nearest with bf16's 8-bit significand gives |fl(x) − x| ≤ 2^-8·|x| per
# element, hence ‖error‖ ≤ 2^-8·‖exact‖ in norm: bound 2^-8 + 1e-5. (Observed ≈ 1.5e-3–2e-3; computing
# the logits in bf16 instead would already put the *loss* ~4e-4 off, 40× over its bound.)
BF16_LOSS_TOL = RTOL
BF16_GRAD_TOL = 2.0**-8 + RTOL


@pytest.mark.parametrize(
    "reduction,upstream",
    # upstream factors are powers of two here (exact in bf16); see the next test for the others
    [("mean", None), ("sum", 0.25), ("mean", 1024.0), ("none", "random")],
)
@pytest.mark.parametrize("transform", ["identity", "combined"])
def test_bf16_inputs_match_dense_on_the_rounded_inputs(reduction, upstream, transform):
    hidden, weight, bias, labels = make_head_inputs(
        (3, 5), H, 97, ignore="some", dtype=torch.bfloat16, seed=17
    )
    if upstream == "random":
        upstream = torch.randn(labels.shape, generator=torch.Generator().manual_seed(1))
    check_ce(hidden, weight, bias, labels, reduction=reduction, upstream=upstream,
             loss_tol=BF16_LOSS_TOL, grad_tol=BF16_GRAD_TOL, tile_budget_bytes=budget_for(4, 97),
             **TRANSFORMS[transform])


@pytest.mark.parametrize("upstream", [1 / 3, 0.3], ids=["grad_accum_div3", "factor0.3"])
def test_bf16_hidden_grad_is_not_biased_by_rounding_the_upstream_factor(upstream):
    """An upstream factor that bf16 cannot represent (1/3 from 3 gradient-accumulation steps) must
    scale the bf16 gradients as exactly as fp32 allows.

    Rounding errors are unbiased, so the least-squares scale between the fused gradient and the exact
    one is 1 within a few 2^-8/√numel (≈ 3e-4 here); rounding the factor itself to bf16 first
    (1/3 → 0.33398, +0.2%; 0.3 → 0.30078, +0.26%) scales the whole gradient systematically. Bound 2^-10.
    """
    hidden, weight, bias, labels = make_head_inputs((3, 5), H, 97, dtype=torch.bfloat16, seed=17)
    check_ce(hidden, weight, bias, labels, upstream=upstream, grad_tol=2 * BF16_GRAD_TOL)
    h64, w64, b64 = leaf64(hidden), leaf64(weight), leaf64(bias)
    (dense_cross_entropy(h64, w64, labels, b64) * upstream).backward()
    for name, fused, exact in (("hidden", hidden.grad, h64.grad), ("weight", weight.grad, w64.grad)):
        a, b = fused.double().flatten(), exact.flatten()
        scale = float(a @ b / (b @ b))
        assert abs(scale - 1) <= 2.0**-10, f"d{name} is scaled by {scale:.5f} instead of 1"


@pytest.mark.parametrize("backend, budget", [("torch", None), ("triton", None), ("triton", 97 * 4 * 64)],
                         ids=["torch", "triton-one-pass", "triton-two-passes"])
def test_bf16_gradients_under_an_upstream_factor_are_rounded_once(backend, budget):
    """Gradient accumulation sends ``1/k``: the gradients are scaled before their one rounding to bf16.
    Torch backend: bit-for-bit the rounding of log-probs backpropagated with that factor from the start.
    Triton backend (bf16 logits-gradient tile): error against float64 no worse than that path's (the
    two-pass path folds the factor in before the tile, so it is that path)."""
    if backend == "triton":
        pytest.importorskip("triton")
    hidden, weight, _, labels = make_head_inputs((8, 16), 64, 97, bias=False, ignore="some", seed=31,
                                                 dtype=torch.bfloat16)
    h64, w64 = leaf64(hidden), leaf64(weight)
    (dense_cross_entropy(h64, w64, labels, reduction="sum") / 3).backward()
    results = []
    for use_ce in (True, False):
        hidden.grad = weight.grad = None
        if use_ce:
            loss = linear_cross_entropy(hidden, weight, labels, reduction="sum", backend=backend,
                                        tile_budget_bytes=budget)
        else:
            logp, _ = linear_logprobs(hidden, weight, labels, backend=backend, tile_budget_bytes=budget)
            loss = -logp.sum()
        (loss / 3).backward()
        results.append((hidden.grad.clone(), weight.grad.clone()))
    for ours, theirs, exact in zip(*results, (h64.grad, w64.grad)):
        assert_rounded_like(ours, theirs, exact, fp32_logits_grad=backend == "torch")
