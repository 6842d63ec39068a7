"""linear_token_loss against a float64 dense reference: the summed loss of several token-separable objectives,
its gradients w.r.t. hidden, weight and bias, and the returned log-probs / entropies, across tile layouts,
ignore patterns, logit transforms, upstream factors, frozen inputs, both schedules (one pass; statistics +
recompute) and both backends (the torch reference; the triton backend's kernels under the interpreter).

The reference materializes the ``[N, V]`` logits in float64 and runs the same ``token_loss`` on
``[B, T]`` float64 tensors with ordinary autograd. Accuracy contract (fp32 inputs): ``‖a − b‖ / ‖b‖ ≤ 1e-5``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from references import H, RTOL, TILE_LAYOUTS, TRANSFORMS, assert_head_grads, budget_for, dense_logprobs, leaf64
from references import bf16_cuda_head, make_head_inputs, rel_err
from hf_fused.ops import get_backend, linear_cross_entropy, linear_token_loss

_HAS_TRITON = importlib.util.find_spec("triton") is not None


# -- token losses (elementwise, plain PyTorch) ------------------------------------------------------------


def nll(logprobs, entropy):
    return -logprobs


def ppo_clip(logprobs, entropy, *, advantages, old, mask):
    """DAPO/GRPO's clipped surrogate per token, masked by a bool mask (a per-token tensor of another dtype)."""
    ratio = torch.exp(logprobs - old)
    pg = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.28))
    return torch.where(mask, pg, 0.0)


def kl_and_entropy(logprobs, entropy, *, ref, weight):
    """A k3 KL term to a reference plus an entropy bonus, weighted per token (e.g. 1/num_items)."""
    d = ref - logprobs
    return weight * (torch.exp(d) - d - 1.0 - 0.05 * entropy)


def cispo_like(logprobs, entropy, *, advantages, old):
    """A detached clamped ratio times logp: the gradient is a constant per token."""
    return -advantages * torch.exp(logprobs - old).clamp(max=1.3).detach() * logprobs


LOSSES = {
    "nll": (nll, False),
    "ppo_clip": (ppo_clip, False),
    "kl_and_entropy": (kl_and_entropy, True),
    "cispo_like": (cispo_like, False),
}


def per_token_inputs(shape, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return dict(
        advantages=torch.randn(shape, generator=g),
        # old/ref log-probs a few tenths off the current ones, so ratios cross the clip range both ways
        old=-4.0 + 0.5 * torch.randn(shape, generator=g),
        ref=-4.0 + 0.5 * torch.randn(shape, generator=g),
        mask=torch.rand(shape, generator=g) < 0.8,
        weight=torch.rand(shape, generator=g) + 0.5,
    )


def consts_for(token_loss, consts):
    names = token_loss.__code__.co_varnames[2 : 2 + token_loss.__code__.co_kwonlyargcount]
    return {k: consts[k] for k in names}


def dense_token_loss(token_loss, hidden, weight, bias, labels, consts, need_entropy, ignore_index=-100, **kw):
    """Float64 ``(loss, logprobs, entropy)``: the same ``token_loss`` on the dense log-probs of kept tokens."""
    logp, ent = dense_logprobs(hidden, weight, labels, bias, ignore_index=ignore_index, **kw)
    kept = labels != ignore_index
    rows = {k: v[kept].double() if v.is_floating_point() else v[kept] for k, v in consts.items()}
    losses = token_loss(logp[kept], ent[kept] if need_entropy else None, **rows)
    return losses.sum(), logp, ent


def check_token_loss(hidden, weight, bias, labels, loss_name, *, factor=1.0, seed=0, grad_tol=RTOL, **kwargs):
    """Fused vs dense: loss, returned log-probs/entropy and every gradient of ``factor · loss``."""
    token_loss, need_entropy = LOSSES[loss_name]
    consts = consts_for(token_loss, per_token_inputs(labels.shape, seed))
    h64, w64, b64 = leaf64(hidden), leaf64(weight), leaf64(bias)
    out = linear_token_loss(hidden, weight, labels, token_loss, bias, per_token=consts, need_entropy=need_entropy,
                            **kwargs)
    dense_kw = {k: v for k, v in kwargs.items() if k not in ("tile_budget_bytes", "backend")}
    ref_loss, ref_logp, ref_ent = dense_token_loss(token_loss, h64, w64, b64, labels, consts, need_entropy,
                                                   **dense_kw)
    assert out.loss.dtype == torch.float32 and out.loss.shape == ()
    assert rel_err(out.loss, ref_loss) <= RTOL
    assert out.logprobs.shape == labels.shape and not out.logprobs.requires_grad
    assert rel_err(out.logprobs, ref_logp) <= RTOL
    if need_entropy:
        assert not out.entropy.requires_grad and rel_err(out.entropy, ref_ent) <= RTOL
    else:
        assert out.entropy is None
    if any(t is not None and t.requires_grad for t in (hidden, weight, bias)):
        (out.loss * factor).backward()
        (ref_loss * factor).backward()
        assert_head_grads((hidden, weight, bias), (h64, w64, b64), grad_tol)
    return out


# -- values and gradients ----------------------------------------------------------------------------------


@pytest.mark.parametrize("transform", ["identity", "temperature", "softcap", "combined"])
@pytest.mark.parametrize("loss_name", list(LOSSES))
def test_loss_grads_and_outputs_match_dense(loss_name, transform):
    hidden, weight, bias, labels = make_head_inputs((3, 7), H, 97, ignore="some", seed=1)
    check_token_loss(hidden, weight, bias, labels, loss_name, tile_budget_bytes=budget_for(4, 97),
                     **TRANSFORMS[transform])


@pytest.mark.parametrize("layout", list(TILE_LAYOUTS))
@pytest.mark.parametrize("loss_name", ["ppo_clip", "kl_and_entropy"])
def test_every_tile_layout(loss_name, layout):
    shape, tile_rows = TILE_LAYOUTS[layout]
    hidden, weight, bias, labels = make_head_inputs(shape, H, 50, ignore="edges", seed=2)
    check_token_loss(hidden, weight, bias, labels, loss_name, tile_budget_bytes=budget_for(tile_rows, 50))


@pytest.mark.parametrize("factor", [0.37, -2.5, 0.0])
@pytest.mark.parametrize("loss_name", ["ppo_clip", "kl_and_entropy"])
def test_any_upstream_factor_is_exact(loss_name, factor):
    """The gradients stored by the forward are scaled by the upstream gradient (accumulation, loss scaling)."""
    hidden, weight, bias, labels = make_head_inputs((2, 6), H, 50, ignore="some", seed=3)
    if factor == 0.0:
        out = linear_token_loss(hidden, weight, labels, LOSSES[loss_name][0], bias,
                                per_token=consts_for(LOSSES[loss_name][0], per_token_inputs(labels.shape, 0)),
                                need_entropy=LOSSES[loss_name][1])
        (out.loss * 0.0).backward()
        assert all((t.grad == 0).all() for t in (hidden, weight, bias))
        return
    check_token_loss(hidden, weight, bias, labels, loss_name, factor=factor, softcap=3.0)


def test_gradient_accumulation_over_two_calls():
    hidden, weight, bias, labels = make_head_inputs((2, 6), H, 50, ignore="some", seed=4)
    h64, w64, b64 = leaf64(hidden), leaf64(weight), leaf64(bias)
    for seed in (0, 1):
        consts = consts_for(ppo_clip, per_token_inputs(labels.shape, seed))
        out = linear_token_loss(hidden, weight, labels, ppo_clip, bias, per_token=consts, temperature=0.7)
        (out.loss / 3).backward()
        ref, _, _ = dense_token_loss(ppo_clip, h64, w64, b64, labels, consts, False, temperature=0.7)
        (ref / 3).backward()
    assert_head_grads((hidden, weight, bias), (h64, w64, b64), RTOL)


@pytest.mark.parametrize("ignore", ["some", "all"])
def test_ignored_rows_get_no_loss_and_no_gradient(ignore):
    hidden, weight, bias, labels = make_head_inputs((3, 5), H, 50, ignore=ignore, seed=5)
    out = check_token_loss(hidden, weight, bias, labels, "kl_and_entropy", tile_budget_bytes=budget_for(2, 50))
    ignored = labels == -100
    assert (out.logprobs[ignored] == 0).all() and (out.entropy[ignored] == 0).all()
    assert (hidden.grad[ignored] == 0).all()
    if ignore == "all":
        assert out.loss.item() == 0.0 and (weight.grad == 0).all() and (bias.grad == 0).all()


def test_token_loss_sees_only_kept_rows_with_their_constants():
    """Each tile's call gets the per-token rows of exactly its kept tokens, in order, dtypes kept."""
    hidden, weight, bias, labels = make_head_inputs((2, 7), H, 50, ignore="some", seed=6)
    positions = torch.arange(labels.numel()).view(labels.shape)
    seen = []

    def spy(logprobs, entropy, *, pos, mask):
        assert pos.dtype == torch.int64 and mask.dtype == torch.bool and pos.shape == logprobs.shape
        seen.append(pos.clone())
        return -logprobs * mask

    linear_token_loss(hidden, weight, labels, spy, bias, per_token=dict(pos=positions, mask=labels > 10),
                      tile_budget_bytes=budget_for(3, 50))
    assert len(seen) > 1  # several tiles
    torch.testing.assert_close(torch.cat(seen), positions[labels != -100])


@pytest.mark.parametrize("frozen", ["weight", "hidden", "bias"])
def test_frozen_inputs_get_no_gradient(frozen):
    hidden, weight, bias, labels = make_head_inputs((2, 6), H, 50, ignore="some", seed=7)
    dict(hidden=hidden, weight=weight, bias=bias)[frozen].requires_grad_(False)
    check_token_loss(hidden, weight, bias, labels, "kl_and_entropy", softcap=3.0)


def test_no_grad_call_gives_the_same_values():
    hidden, weight, bias, labels = make_head_inputs((2, 7), H, 97, ignore="some", seed=8)
    consts = consts_for(kl_and_entropy, per_token_inputs(labels.shape, 0))
    kwargs = dict(per_token=consts, need_entropy=True, softcap=4.0, tile_budget_bytes=budget_for(3, 97))
    with torch.no_grad():
        a = linear_token_loss(hidden, weight, labels, kl_and_entropy, bias, **kwargs)
    b = linear_token_loss(hidden, weight, labels, kl_and_entropy, bias, **kwargs)
    assert not a.loss.requires_grad and b.loss.requires_grad
    torch.testing.assert_close(a.loss, b.loss.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(a.entropy, b.entropy, rtol=1e-6, atol=0)


def test_nll_equals_linear_cross_entropy_sum():
    hidden, weight, bias, labels = make_head_inputs((3, 5), H, 50, ignore="some", seed=9)
    out = linear_token_loss(hidden, weight, labels, nll, bias, softcap=3.0)
    ce = linear_cross_entropy(hidden, weight, labels, bias, reduction="sum", softcap=3.0)
    torch.testing.assert_close(out.loss, ce, rtol=1e-6, atol=0)


def test_loss_independent_of_logprobs_gives_zero_gradients():
    hidden, weight, bias, labels = make_head_inputs((2, 5), H, 50, seed=10)
    out = linear_token_loss(hidden, weight, labels, lambda lp, ent, *, a: a * 2.0, bias,
                            per_token=dict(a=torch.ones(labels.shape)))
    assert out.loss.item() == 2.0 * labels.numel()
    out.loss.backward()
    assert all((t.grad == 0).all() for t in (hidden, weight, bias))


# -- the statistics + recompute schedule (a GPU budget too small for the one pass) ----------------------------


@pytest.mark.parametrize("loss_name", ["ppo_clip", "kl_and_entropy"])
def test_two_pass_fallback_gives_the_same_result(loss_name, monkeypatch):
    """When the backend declines the one pass (returns None), forward keeps statistics and the per-row loss
    gradients and backward recomputes: same loss, outputs and gradients under an upstream factor."""
    backend = get_backend(torch.device("cpu"), "torch")
    calls = []

    def decline(*args, **kwargs):
        calls.append(1)
        return None

    monkeypatch.setattr(backend, "token_loss_with_grads", decline)
    hidden, weight, bias, labels = make_head_inputs((3, 6), H, 97, ignore="some", seed=11)
    check_token_loss(hidden, weight, bias, labels, loss_name, factor=0.3, tile_budget_bytes=budget_for(4, 97),
                     temperature=0.7)
    assert calls


def test_one_pass_runs_no_backward_recompute(monkeypatch):
    backend = get_backend(torch.device("cpu"), "torch")
    monkeypatch.setattr(backend, "logprobs_backward", lambda *a, **k: pytest.fail("recomputed in backward"))
    hidden, weight, bias, labels = make_head_inputs((2, 6), H, 50, seed=12)
    check_token_loss(hidden, weight, bias, labels, "ppo_clip", factor=2.0)


# -- the triton backend (kernels under the interpreter on CPU) ------------------------------------------------


@pytest.mark.skipif(not _HAS_TRITON, reason="triton not installed")
@pytest.mark.parametrize("schedule", ["one_pass", "two_passes"])
@pytest.mark.parametrize("loss_name", ["ppo_clip", "kl_and_entropy"])
@pytest.mark.parametrize("transform", ["identity", "combined"])
def test_triton_backend_matches_dense(transform, loss_name, schedule):
    vocab = 300
    hidden, weight, bias, labels = make_head_inputs((4, 9), H, vocab, ignore="some", seed=13)
    # one pass: the fp32 [V, H] accumulator, ≥ 512 rows of [V] and the 36 rows' fp32 hidden gradient and compact
    # copy fit; two passes: a budget far below that
    budget = vocab * H * 4 + 512 * vocab * 4 + 36 * H * 8 if schedule == "one_pass" else 8 * vocab * 4
    check_token_loss(hidden, weight, bias, labels, loss_name, factor=0.5, backend="triton",
                     tile_budget_bytes=budget, **TRANSFORMS[transform])


@pytest.mark.skipif(not _HAS_TRITON, reason="triton not installed")
def test_triton_one_pass_is_taken_with_room(monkeypatch):
    backend = get_backend(torch.device("cpu"), "triton")
    monkeypatch.setattr(backend, "logprobs_backward", lambda *a, **k: pytest.fail("recomputed in backward"))
    hidden, weight, bias, labels = make_head_inputs((2, 6), H, 300, seed=14)
    check_token_loss(hidden, weight, bias, labels, "kl_and_entropy", backend="triton",
                     # 512 rows of a tile and of the fp32 buffer the hidden gradient passes through
                     tile_budget_bytes=300 * H * 4 + 512 * (300 + H) * 4 + 12 * H * 8)


# -- mixed precision ---------------------------------------------------------------------------------------

# Under autocast the op casts hidden/weight/bias to bf16 once (as F.linear would) and computes in fp32 from
# those exact bf16 values, so against float64 on the bf16-rounded operands the loss and log-probs carry
# fp32-level error only (RTOL). The gradients reach the bf16 operands rounded once to bf16 (|fl(x) − x| ≤
# 2^-8·|x| per element) before autograd's cast node hands them to the fp32 leaves: bound 2^-8 + RTOL in norm.
BF16_GRAD_TOL = 2**-8 + RTOL


@pytest.mark.parametrize("loss_name", ["ppo_clip", "kl_and_entropy"])
def test_autocast_bf16_matches_float64_of_the_bf16_operands(loss_name):
    hidden, weight, bias, labels = make_head_inputs((3, 6), H, 97, ignore="some", seed=15)
    token_loss, need_entropy = LOSSES[loss_name]
    consts = consts_for(token_loss, per_token_inputs(labels.shape, 0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_token_loss(hidden, weight, labels, token_loss, bias, per_token=consts,
                                need_entropy=need_entropy, temperature=0.7)
    assert out.loss.dtype == torch.float32 and out.logprobs.dtype == torch.float32
    rounded = [leaf64(t.detach().bfloat16(), requires_grad=True) for t in (hidden, weight, bias)]
    ref, ref_logp, _ = dense_token_loss(token_loss, *rounded, labels, consts, need_entropy, temperature=0.7)
    assert rel_err(out.loss, ref) <= RTOL and rel_err(out.logprobs, ref_logp) <= RTOL
    out.loss.backward()
    ref.backward()
    for t, r in zip((hidden, weight, bias), rounded):
        assert t.grad.dtype == torch.float32
        assert rel_err(t.grad, r.grad) <= BF16_GRAD_TOL


# -- bad input ----------------------------------------------------------------------------------------------


def _inputs():
    return make_head_inputs((2, 4), H, 50, seed=16)


def test_token_loss_returning_a_reduction_raises():
    hidden, weight, bias, labels = _inputs()
    with pytest.raises(ValueError, match="one loss per token"):
        linear_token_loss(hidden, weight, labels, lambda lp, ent: -lp.mean(), bias)


def test_non_callable_token_loss_raises():
    hidden, weight, bias, labels = _inputs()
    with pytest.raises(TypeError, match="callable"):
        linear_token_loss(hidden, weight, labels, "grpo", bias)


@pytest.mark.parametrize(
    "per_token, error, match",
    [
        (dict(a=torch.ones(3)), ValueError, "labels' shape"),
        (dict(a=1.0), TypeError, "tensor shaped like labels"),
        (dict(a=torch.ones(2, 4, requires_grad=True)), ValueError, "requires grad"),
        (dict(logprobs=torch.ones(2, 4)), ValueError, "clashes"),
        ([torch.ones(2, 4)], TypeError, "dict"),
    ],
    ids=["shape", "scalar", "requires_grad", "reserved_name", "not_a_dict"],
)
def test_bad_per_token_raises(per_token, error, match):
    hidden, weight, bias, labels = _inputs()
    with pytest.raises(error, match=match):
        linear_token_loss(hidden, weight, labels, lambda lp, ent, **kw: -lp, bias, per_token=per_token)


def test_second_order_and_second_backward_raise():
    hidden, weight, bias, labels = _inputs()
    out = linear_token_loss(hidden, weight, labels, nll, bias)
    with pytest.raises(RuntimeError, match="second-order"):
        torch.autograd.grad(out.loss, hidden, create_graph=True)
    out = linear_token_loss(hidden, weight, labels, nll, bias)
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="call linear_token_loss again"):
        out.loss.backward()


# -- a token loss as linear_logprobs' gradient hint ----------------------------------------------------------------

from hf_fused.ops import HintMissedWarning, TokenLossHint, linear_logprobs  # noqa: E402


def _hinted_step(loss_name, *, scale=1.0, perturb=0.0, backend="torch", budget=None, seed=17):
    """``linear_logprobs(grad_hint=TokenLossHint(...))``, then the caller's own loss on the ``[B, T]`` outputs
    (``scale ×`` the hint's loss, plus ``perturb ×`` a term the hint does not know), against float64 dense."""
    hidden, weight, bias, labels = make_head_inputs((3, 6), H, 97, ignore="some", seed=seed)
    token_loss, need_entropy = LOSSES[loss_name]
    consts = consts_for(token_loss, per_token_inputs(labels.shape, 0))
    kept = labels != -100
    h64, w64, b64 = leaf64(hidden), leaf64(weight), leaf64(bias)
    logp, ent = linear_logprobs(hidden, weight, labels, bias, return_entropy=True, temperature=0.7, backend=backend,
                                tile_budget_bytes=budget,
                                grad_hint=TokenLossHint(token_loss, consts, need_entropy=need_entropy))
    ref_logp, ref_ent = dense_logprobs(h64, w64, labels, b64, temperature=0.7)

    def caller_loss(lp, en, cast):
        rows = {k: cast(v[kept]) if v.is_floating_point() else v[kept] for k, v in consts.items()}
        return scale * token_loss(lp[kept], en[kept] if need_entropy else None, **rows).sum() + perturb * lp.square().sum()

    assert rel_err(logp, ref_logp) <= RTOL and rel_err(ent, ref_ent) <= RTOL
    caller_loss(logp, ent, lambda v: v).backward()
    caller_loss(ref_logp, ref_ent, torch.Tensor.double).backward()
    assert_head_grads((hidden, weight, bias), (h64, w64, b64), RTOL)


@pytest.mark.parametrize("scale", [1.0, -0.25])
@pytest.mark.parametrize("loss_name", ["ppo_clip", "kl_and_entropy", "cispo_like"])
def test_token_loss_hint_gives_the_gradients_in_the_forward(loss_name, scale, monkeypatch):
    backend = get_backend(torch.device("cpu"), "torch")
    monkeypatch.setattr(backend, "logprobs_backward", lambda *a, **k: pytest.fail("recomputed in backward"))
    _hinted_step(loss_name, scale=scale)


def test_token_loss_hint_that_misses_warns_and_recomputes_exactly():
    with pytest.warns(HintMissedWarning, match="TokenLossHint"):
        _hinted_step("ppo_clip", perturb=0.1)


def test_token_loss_hint_ignoring_the_entropy_the_loss_uses_warns_and_recomputes_exactly():
    # the caller's loss adds an entropy term the hint does not know
    hidden, weight, bias, labels = make_head_inputs((2, 5), H, 50, seed=18)
    consts = consts_for(ppo_clip, per_token_inputs(labels.shape, 0))
    h64, w64, b64 = leaf64(hidden), leaf64(weight), leaf64(bias)
    logp, ent = linear_logprobs(hidden, weight, labels, bias, return_entropy=True,
                                grad_hint=TokenLossHint(ppo_clip, consts))
    with pytest.warns(HintMissedWarning):
        (ppo_clip(logp, None, **consts).sum() + 0.1 * ent.sum()).backward()
    ref_logp, ref_ent = dense_logprobs(h64, w64, labels, b64)
    rows = {k: v.double() if v.is_floating_point() else v for k, v in consts.items()}
    (ppo_clip(ref_logp, None, **rows).sum() + 0.1 * ref_ent.sum()).backward()
    assert_head_grads((hidden, weight, bias), (h64, w64, b64), RTOL)


@pytest.mark.skipif(not _HAS_TRITON, reason="triton not installed")
@pytest.mark.parametrize("schedule", ["one_pass", "two_passes"])
def test_token_loss_hint_on_the_triton_backend(schedule):
    # one pass: the accumulator, 512 rows of [V] and the rows' fp32 hidden gradient + compact copy (< 1024 rows)
    budget = 97 * H * 4 + 512 * 97 * 4 + 1024 * H * 8 if schedule == "one_pass" else 8 * 97 * 4
    _hinted_step("kl_and_entropy", scale=0.5, backend="triton", budget=budget)


def test_token_loss_hint_pads_and_slices_like_a_tensor_hint():
    hint = TokenLossHint(nll, dict(a=torch.ones(2, 3), b=torch.zeros(2, 3, dtype=torch.bool)))
    padded = hint[1:].pad(2, 1)
    assert padded.shape == (1, 6) and padded.size(1) == 6
    torch.testing.assert_close(padded.per_token["a"], torch.tensor([[0.0, 0.0, 1.0, 1.0, 1.0, 0.0]]))
    assert padded.per_token["b"].dtype == torch.bool
    with pytest.raises(ValueError, match="one shape"):
        TokenLossHint(nll, dict(a=torch.ones(2), b=torch.ones(3)))


def clipped_terms(logprobs, entropy, *, advantages, old, weight):
    """Several clipped-ratio terms per token (``[r, K]`` constants, padded terms of zero weight), summed."""
    ratio = torch.exp(logprobs.unsqueeze(-1) - old)
    return (-torch.min(ratio * advantages, ratio.clamp(0.8, 1.28) * advantages) * weight).sum(-1)


def _terms_inputs(shape, terms, seed):
    """``clipped_terms``' constants: each token has 1 to ``terms`` terms (the rest zero-weight padding)."""
    g = torch.Generator().manual_seed(seed)
    full = (*shape, terms)
    count = torch.randint(1, terms + 1, (*shape, 1), generator=g)
    weight = (torch.arange(terms) < count).float() * (torch.rand(full, generator=g) + 0.5)
    return dict(advantages=torch.randn(full, generator=g), old=-4.0 + 0.5 * torch.randn(full, generator=g),
                weight=weight)


@pytest.mark.parametrize("backend, budget", [("torch", None), pytest.param("triton", 97 * H * 4 + 512 * 97 * 4 + 1024 * H * 8, marks=pytest.mark.skipif(not _HAS_TRITON, reason="triton not installed"))], ids=["torch", "triton"])
def test_token_loss_hint_with_several_terms_per_token(backend, budget, monkeypatch):
    """``TokenLossHint(terms=True)``: ``[B, T, K]`` constants (a position scoring several sequences' terms, as in
    TRL's packed trees): the forward's gradients are handed over and equal float64 dense autograd of the caller's
    loss, which gathers each term's log-prob as TRL does (``logp.flatten()[token_index]``)."""
    monkeypatch.setattr(get_backend(torch.device("cpu"), backend), "logprobs_backward",
                        lambda *a, **k: pytest.fail("recomputed in backward"))
    hidden, weight, bias, labels = make_head_inputs((2, 7), H, 97, ignore="some", seed=23)
    consts = _terms_inputs(labels.shape, 3, seed=24)
    consts["weight"] = consts["weight"] * (labels != -100).unsqueeze(-1)  # terms only where a label is kept
    h64, w64, b64 = leaf64(hidden), leaf64(weight), leaf64(bias)
    logp, _ = linear_logprobs(hidden, weight, labels, bias, backend=backend, tile_budget_bytes=budget,
                              grad_hint=TokenLossHint(clipped_terms, consts, terms=True))
    ref_logp, _ = dense_logprobs(h64, w64, labels, b64)
    # the caller's loss: one entry per (token, term) with a weight, each term reading its token's log-prob
    token, term = (consts["weight"] != 0).reshape(-1, 3).nonzero(as_tuple=True)
    assert (token.bincount() > 1).any()  # some token carries several terms

    def caller_loss(lp, cast):
        rows = {k: cast(v.reshape(-1, 3)[token, term]) for k, v in consts.items()}
        ratio = torch.exp(lp.flatten()[token] - rows["old"])
        adv = rows["advantages"]
        return (-torch.min(ratio * adv, ratio.clamp(0.8, 1.28) * adv) * rows["weight"]).sum()

    assert rel_err(logp, ref_logp) <= RTOL
    caller_loss(logp, lambda v: v).backward()
    caller_loss(ref_logp, torch.Tensor.double).backward()
    assert_head_grads((hidden, weight, bias), (h64, w64, b64), RTOL)


def test_token_loss_hint_with_terms_pads_the_tokens_dimension():
    hint = TokenLossHint(clipped_terms, dict(a=torch.ones(2, 3, 4)), terms=True)
    padded = hint[1:].pad(2, 1)
    assert padded.shape == (1, 6) and padded.size(1) == 6 and padded.per_token["a"].shape == (1, 6, 4)
    torch.testing.assert_close(padded.per_token["a"][0, :, 0], torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0, 0.0]))
    with pytest.raises(ValueError, match="trailing dimension of terms"):
        TokenLossHint(clipped_terms, dict(a=torch.ones(3)), terms=True)
    hidden, weight, _, labels = make_head_inputs((2, 3), H, 50, bias=False, seed=25)
    for bad in (torch.ones(2, 3), torch.ones(2, 4, 2)):  # no terms dimension; another token shape
        with pytest.raises(ValueError, match=r"labels' shape \(2, 3\) plus a trailing dimension of terms"):
            linear_logprobs(hidden, weight, labels, grad_hint=TokenLossHint(clipped_terms, dict(
                advantages=bad, old=bad, weight=bad), terms=True))


@pytest.mark.gpu
@pytest.mark.parametrize("budget", [None, 8 * 2**20], ids=["default_rule", "two_passes"])
@pytest.mark.parametrize("loss_name", ["ppo_clip", "kl_and_entropy"])
def test_triton_bf16_on_gpu_no_worse_than_eager(loss_name, budget):
    """bf16 weights on CUDA: the triton backend rounds each logits tile to bf16 as eager's lm_head does and works in
    fp32 after; its loss-gradient error against float64 is at most 1.25× eager bf16's (the mixed-precision bound of
    tests/test_ops_mixed_precision.py), on the one pass (default rule) and on statistics + recompute."""
    n, h, v = 2048, 512, 32000
    hidden, weight, labels = bf16_cuda_head(n, h, v, seed=0, ignore_every=7)
    token_loss, need_entropy = LOSSES[loss_name]
    consts = {k: t.cuda() for k, t in consts_for(token_loss, per_token_inputs((n,), 1)).items()}
    kept = labels != -100
    rows = {k: t[kept] for k, t in consts.items()}

    def eager_loss(hid, w, dtype):
        logp_all = torch.log_softmax(F.linear(hid, w).to(dtype) / 0.7, -1)[kept]
        logp = logp_all.gather(1, labels[kept, None])[:, 0]
        ent = -(logp_all.exp() * logp_all).sum(-1)
        return token_loss(logp, ent if need_entropy else None,
                          **{k: t.to(dtype) if t.is_floating_point() else t for k, t in rows.items()}).sum()

    ref = [t.detach().double().requires_grad_() for t in (hidden, weight)]
    eager = [t.detach().clone().requires_grad_() for t in (hidden, weight)]
    g_ref = torch.autograd.grad(eager_loss(*ref, torch.float64), ref)
    g_eager = torch.autograd.grad(eager_loss(*eager, torch.float32), eager)
    out = linear_token_loss(hidden, weight, labels, token_loss, per_token=consts, need_entropy=need_entropy,
                            temperature=0.7, backend="triton", tile_budget_bytes=budget)
    g_ours = torch.autograd.grad(out.loss, (hidden, weight))
    for ours, theirs, exact in zip(g_ours, g_eager, g_ref):
        assert rel_err(ours, exact) <= 1.25 * rel_err(theirs, exact) + 1e-6, (rel_err(ours, exact),
                                                                              rel_err(theirs, exact))
