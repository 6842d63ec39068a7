"""linear_logprobs against the float64 dense reference: per-token log-probabilities and entropy, their
values and their gradients w.r.t. hidden, weight and bias under random upstream weights on both
outputs and on each alone, across tile layouts, batch shapes, ignore patterns and logit transforms.

Accuracy contract (fp32 inputs): ``‖a − b‖ / ‖b‖ ≤ 1e-5`` for values and every gradient.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from references import assert_head_grads, dense_logprobs, leaf64, make_head_inputs, rel_err
from references import H, RTOL, TILE_LAYOUTS, TRANSFORMS, budget_for
from hf_fused.ops import linear_cross_entropy, linear_logprobs



def upstream_weights(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def check_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    labels: torch.Tensor,
    *,
    on: str = "both",
    return_entropy: bool = True,
    value_tol: float = RTOL,
    grad_tol: float = RTOL,
    seed: int = 0,
    **kwargs,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Fused vs dense values, then gradients of ``Σ g_lp·logp + Σ g_H·entropy`` with random ``g``
    (``on``: ``"both"``, ``"logprobs"``, ``"entropy"`` picks which outputs the loss uses)."""
    h64, w64, b64 = leaf64(hidden), leaf64(weight), leaf64(bias)
    logp, ent = linear_logprobs(hidden, weight, labels, bias, return_entropy=return_entropy, **kwargs)
    dense_kwargs = {k: v for k, v in kwargs.items() if k not in ("tile_budget_bytes", "backend")}
    ref_logp, ref_ent = dense_logprobs(h64, w64, labels, b64, **dense_kwargs)

    assert logp.dtype == torch.float32 and logp.shape == labels.shape
    assert rel_err(logp, ref_logp) <= value_tol
    if return_entropy:
        assert ent.dtype == torch.float32 and ent.shape == labels.shape
        assert rel_err(ent, ref_ent) <= value_tol
    else:
        assert ent is None

    if not any(t is not None and t.requires_grad for t in (hidden, weight, bias)):
        return logp, ent
    g_lp = upstream_weights(labels.shape, seed)
    g_h = upstream_weights(labels.shape, seed + 1000)
    loss = torch.zeros(())
    ref = torch.zeros((), dtype=torch.float64)
    if on in ("both", "logprobs"):
        loss = loss + (logp * g_lp).sum()
        ref = ref + (ref_logp * g_lp.double()).sum()
    if on in ("both", "entropy"):
        loss = loss + (ent * g_h).sum()
        ref = ref + (ref_ent * g_h.double()).sum()
    loss.backward()
    ref.backward()
    assert_head_grads((hidden, weight, bias), (h64, w64, b64), grad_tol)
    return logp, ent


@pytest.mark.parametrize("vocab_size", [50, 257], ids=lambda v: f"V{v}")
@pytest.mark.parametrize("layout", list(TILE_LAYOUTS), ids=str)
def test_values_and_grads_match_dense_for_every_tile_layout(layout, vocab_size):
    batch_shape, tile_rows = TILE_LAYOUTS[layout]
    hidden, weight, bias, labels = make_head_inputs(batch_shape, H, vocab_size, seed=vocab_size)
    check_logprobs(hidden, weight, bias, labels, tile_budget_bytes=budget_for(tile_rows, vocab_size))


@pytest.mark.parametrize("on", ["both", "logprobs", "entropy"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("transform", list(TRANSFORMS), ids=str)
def test_grads_for_random_upstream_on_each_output_match_dense(transform, with_bias, on):
    hidden, weight, bias, labels = make_head_inputs((2, 7), H, 97, bias=with_bias, ignore="some", seed=21)
    check_logprobs(hidden, weight, bias, labels, on=on, tile_budget_bytes=budget_for(3, 97),
                   **TRANSFORMS[transform])


@pytest.mark.parametrize("transform", ["identity", "combined"])
def test_without_entropy_returns_none_and_exact_logprob_grads(transform):
    hidden, weight, bias, labels = make_head_inputs((3, 5), H, 97, ignore="some", seed=22)
    check_logprobs(hidden, weight, bias, labels, on="logprobs", return_entropy=False,
                   tile_budget_bytes=budget_for(4, 97), **TRANSFORMS[transform])


def test_unbatched_hidden_vector_gives_scalar_outputs():
    hidden, weight, bias, labels = make_head_inputs((), H, 50)
    logp, ent = check_logprobs(hidden, weight, bias, labels)
    assert logp.shape == () and ent.shape == ()


def test_entropy_is_between_zero_and_log_vocab():
    hidden, weight, bias, labels = make_head_inputs((4, 6), H, 97, seed=23)
    with torch.no_grad():
        logp, ent = linear_logprobs(hidden, weight, labels, bias, return_entropy=True, temperature=3.0)
    assert (logp <= 0).all()
    assert (ent >= 0).all() and (ent <= torch.log(torch.tensor(97.0)) + 1e-5).all()


# -- ignored positions -------------------------------------------------------------------------------


@pytest.mark.parametrize("ignore", ["some", "edges", "all"])
@pytest.mark.parametrize("transform", ["identity", "combined"])
def test_ignored_positions_are_zero_with_zero_gradient(ignore, transform):
    """Upstream gradients at ignored positions are nonzero on purpose; they must not leak anywhere."""
    hidden, weight, bias, labels = make_head_inputs((3, 5), H, 50, ignore=ignore, seed=24)
    logp, ent = check_logprobs(hidden, weight, bias, labels, tile_budget_bytes=budget_for(2, 50),
                               **TRANSFORMS[transform])
    ignored = labels == -100
    assert (logp[ignored] == 0).all() and (ent[ignored] == 0).all()
    assert (hidden.grad[ignored] == 0).all()
    if ignore == "all":
        assert (weight.grad == 0).all() and (bias.grad == 0).all()
    else:
        assert (logp[~ignored] < 0).all() and (ent[~ignored] > 0).all()


@pytest.mark.parametrize("ignore_index", [-1, 7], ids=["negative", "in_vocab_id"])
def test_custom_ignore_index(ignore_index):
    hidden, weight, bias, labels = make_head_inputs(
        (3, 5), H, 50, ignore="some", ignore_index=ignore_index, seed=25
    )
    logp, ent = check_logprobs(hidden, weight, bias, labels, ignore_index=ignore_index,
                               tile_budget_bytes=budget_for(4, 50))
    ignored = labels == ignore_index
    assert ignored.any() and (logp[ignored] == 0).all() and (hidden.grad[ignored] == 0).all()


# -- frozen inputs, grad mode, consistency with cross-entropy -------------------------------------------


@pytest.mark.parametrize("frozen", ["weight", "hidden", "bias"])
@pytest.mark.parametrize("on", ["both", "entropy"])
def test_frozen_inputs_get_no_grad_and_others_stay_exact(frozen, on):
    hidden, weight, bias, labels = make_head_inputs((2, 6), H, 50, ignore="some", seed=26)
    dict(hidden=hidden, weight=weight, bias=bias)[frozen].requires_grad_(False)
    check_logprobs(hidden, weight, bias, labels, on=on, softcap=3.0, tile_budget_bytes=budget_for(3, 50))


def test_no_grad_call_gives_the_same_values():
    hidden, weight, bias, labels = make_head_inputs((2, 7), H, 97, ignore="some", seed=27)
    kwargs = dict(return_entropy=True, softcap=4.0, tile_budget_bytes=budget_for(3, 97))
    with torch.no_grad():
        lp0, ent0 = linear_logprobs(hidden, weight, labels, bias, **kwargs)
    lp1, ent1 = linear_logprobs(hidden, weight, labels, bias, **kwargs)
    assert not lp0.requires_grad and lp1.requires_grad and ent1.requires_grad
    torch.testing.assert_close(lp0, lp1.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(ent0, ent1.detach(), rtol=1e-6, atol=0)


def test_cross_entropy_none_is_negative_logprobs():
    hidden, weight, bias, labels = make_head_inputs((3, 5), H, 50, ignore="some", seed=28)
    with torch.no_grad():
        logp, _ = linear_logprobs(hidden, weight, labels, bias, softcap=3.0)
        ce = linear_cross_entropy(hidden, weight, labels, bias, reduction="none", softcap=3.0)
    torch.testing.assert_close(ce, -logp, rtol=0, atol=0)


def test_repeated_backward_with_retained_graph_accumulates():
    """Backward recomputes from saved inputs, so a retained graph can be differentiated twice."""
    hidden, weight, bias, labels = make_head_inputs((2, 5), H, 50, seed=29)
    logp, ent = linear_logprobs(hidden, weight, labels, bias, return_entropy=True)
    loss = (logp.sum() + ent.sum())
    loss.backward(retain_graph=True)
    first = weight.grad.clone()
    loss.backward()
    torch.testing.assert_close(weight.grad, 2 * first, rtol=1e-6, atol=1e-8)


# -- bf16 -------------------------------------------------------------------------------------------

# bf16 bound. The reference is computed in float64 from the *bf16-rounded* inputs, so input rounding is
# not part of the error. The op upcasts those exact bf16 values to fp32 and does the tile math and all
# accumulation in fp32, and returns log-probs and entropy in fp32: values carry fp32-level error only,
# the same 1e-5 bound. Gradients come back in the leaf dtype, bf16: one final rounding of an fp32 value
# within ~1e-5 of exact. Round-to-nearest with bf16's 8-bit significand gives |fl(x) − x| ≤ 2^-8·|x| per
# element, hence ‖error‖ ≤ 2^-8·‖exact‖ in norm: bound 2^-8 + 1e-5 (observed ≈ 1.5e-3–2e-3).
BF16_GRAD_TOL = 2.0**-8 + RTOL


@pytest.mark.parametrize("on", ["both", "logprobs", "entropy"])
@pytest.mark.parametrize("transform", ["identity", "combined"])
def test_bf16_inputs_match_dense_on_the_rounded_inputs(transform, on):
    hidden, weight, bias, labels = make_head_inputs(
        (3, 5), H, 97, ignore="some", dtype=torch.bfloat16, seed=30
    )
    check_logprobs(hidden, weight, bias, labels, on=on, grad_tol=BF16_GRAD_TOL,
                   tile_budget_bytes=budget_for(4, 97), **TRANSFORMS[transform])


# -- rows with no upstream gradient -----------------------------------------------------------------

@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    "triton" not in __import__("hf_fused.ops", fromlist=["available_backends"]).available_backends(),
    reason="triton not importable"))])
def test_rows_without_upstream_gradient_are_skipped_and_grads_exact(backend, monkeypatch):
    """A GRPO completion's padding: logp and entropy both get 0 upstream on some rows. Backward must skip
    exactly those rows (one output's 0 alone is not enough) and still match float64."""
    from hf_fused.ops import get_backend

    hidden, weight, bias, labels = make_head_inputs((4, 6), H, 50, ignore="some", seed=40)
    h64, w64, b64 = leaf64(hidden), leaf64(weight), leaf64(bias)
    logp, ent = linear_logprobs(hidden, weight, labels, bias, return_entropy=True, backend=backend)
    ref_logp, ref_ent = dense_logprobs(h64, w64, labels, b64)
    g_lp, g_h = upstream_weights(labels.shape, 41), upstream_weights(labels.shape, 42)
    g_lp[:, 4:] = 0.0  # padding: no gradient on either output
    g_h[:, 4:] = 0.0
    g_lp[0, :2] = 0.0  # entropy-only rows still count
    g_h[1, :2] = 0.0  # logprob-only rows still count
    seen = []
    impl = get_backend(hidden.device, backend)
    original = impl.logprobs_backward
    monkeypatch.setattr(impl, "logprobs_backward",
                        lambda head, *a, **k: seen.append(head.rows.numel()) or original(head, *a, **k))
    ((logp * g_lp).sum() + (ent * g_h).sum()).backward()
    ((ref_logp * g_lp.double()).sum() + (ref_ent * g_h.double()).sum()).backward()
    assert_head_grads((hidden, weight, bias), (h64, w64, b64), RTOL)
    expected = int(((labels != -100) & ((g_lp != 0) | (g_h != 0))).sum())
    assert seen == [expected] and expected < int((labels != -100).sum())


def test_all_rows_without_upstream_gradient_give_zero_grads():
    hidden, weight, bias, labels = make_head_inputs((2, 5), H, 50, seed=43)
    logp, ent = linear_logprobs(hidden, weight, labels, bias, return_entropy=True)
    ((logp * 0.0).sum() + (ent * 0.0).sum()).backward()
    for t in (hidden, weight, bias):
        assert t.grad is not None and torch.count_nonzero(t.grad) == 0
