"""linear_logprobs(grad_hint=...): the forward computes the gradients of ``Σ hint·logp`` in one pass and
backward hands them over when the upstream gradient is a multiple of the hint, else recomputes.

Both branches against the float64 dense reference (values and every gradient, fp32 ≤ 1e-5), on the
torch backend and on the Triton backend (its kernels under the interpreter on CPU, real ones under
the ``gpu`` marker). Which branch ran is pinned by making the other one fail.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from references import assert_head_grads, assert_rounded_like, dense_logprobs, leaf64, make_head_inputs, rel_err
from references import H, RTOL, TRANSFORMS
from hf_fused.ops import HintMissedWarning, get_backend, linear_logprobs

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    __import__("importlib").util.find_spec("triton") is None, reason="needs triton"))]
V = 97


def _forbid(monkeypatch, backend: str, method: str):
    def fail(*args, **kwargs):
        raise AssertionError(f"{method} ran")

    monkeypatch.setattr(get_backend(torch.device("cpu"), backend), method, fail)


def _grpo_like_hint(labels, seed):
    """``A·mask``: a per-sequence advantage on a ``[B, T]`` batch, 0 on ignored tokens and on a
    zero-advantage sequence (a GRPO group whose rewards were all equal)."""
    gen = torch.Generator().manual_seed(seed)
    adv = torch.randn(labels.shape[0], 1, generator=gen)
    adv[0] = 0.0
    return adv * (labels != -100)


def _check(backend, hidden, weight, bias, labels, hint, upstream, *, entropy_grad=False, **kw):
    h64, w64, b64 = leaf64(hidden), leaf64(weight), leaf64(bias)
    logp, ent = linear_logprobs(hidden, weight, labels, bias, return_entropy=True, grad_hint=hint,
                                backend=backend, **kw)
    ref_logp, ref_ent = dense_logprobs(h64, w64, labels, b64, **{k: v for k, v in kw.items() if k != "tile_budget_bytes"})
    assert rel_err(logp, ref_logp) <= RTOL and rel_err(ent, ref_ent) <= RTOL
    loss = (logp * upstream).sum() + (ent.sum() * 0.3 if entropy_grad else ent.detach().sum() * 0.0)
    ref = (ref_logp * upstream.double()).sum() + (ref_ent.sum() * 0.3 if entropy_grad else 0.0)
    loss.backward()
    ref.backward()
    assert_head_grads((hidden, weight, bias), (h64, w64, b64), RTOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("transform", ["identity", "softcap", "combined"])
@pytest.mark.parametrize("factor", [1.0, -0.37, 0.0])
def test_matching_hint_uses_the_forward_gradients(monkeypatch, backend, transform, factor):
    hidden, weight, bias, labels = make_head_inputs((3, 5), H, V, ignore="some", seed=1)
    hint = _grpo_like_hint(labels, seed=2)
    _forbid(monkeypatch, backend, "logprobs_backward")  # the recompute must not run
    with warnings.catch_warnings():
        warnings.simplefilter("error", HintMissedWarning)
        _check(backend, hidden, weight, bias, labels, hint, factor * hint, **TRANSFORMS[transform])


@pytest.mark.parametrize("backend", BACKENDS)
def test_on_policy_clipped_surrogate_sends_a_multiple_of_the_hint(monkeypatch, backend):
    """TRL's DAPO loss at ratio 1 (old log-probs = the detached current ones): its gradient is
    ``−A·mask / Σmask``, so ``A·mask`` is a valid hint and no recompute runs."""
    hidden, weight, _, labels = make_head_inputs((4, 6), H, V, bias=False, ignore="some", seed=3)
    adv_mask = _grpo_like_hint(labels, seed=4)
    mask = (labels != -100).float()
    _forbid(monkeypatch, backend, "logprobs_backward")
    h64, w64 = leaf64(hidden), leaf64(weight)

    def dapo(logp, adv):
        ratio = torch.exp(logp - logp.detach())
        per_token = -torch.min(ratio * adv, ratio.clamp(0.8, 1.28) * adv)
        return (per_token * mask.to(logp.dtype)).sum() / mask.sum()

    adv = adv_mask.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp_min(1)
    logp, _ = linear_logprobs(hidden, weight, labels, grad_hint=adv_mask, backend=backend)
    dapo(logp, adv).backward()
    ref_logp, _ = dense_logprobs(h64, w64, labels)
    dapo(ref_logp, adv.double()).backward()
    assert_head_grads((hidden, weight, None), (h64, w64, None), RTOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mismatched_hint_recomputes_exactly_and_warns(backend):
    hidden, weight, bias, labels = make_head_inputs((2, 7), H, V, ignore="edges", seed=5)
    hint = _grpo_like_hint(labels, seed=6)
    upstream = torch.randn(labels.shape, generator=torch.Generator().manual_seed(7))
    with pytest.warns(HintMissedWarning, match="not a multiple of the hint"):
        _check(backend, hidden, weight, bias, labels, hint, upstream, softcap=3.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_entropy_gradient_recomputes_exactly_and_warns(backend):
    hidden, weight, bias, labels = make_head_inputs((2, 6), H, V, ignore="some", seed=8)
    hint = _grpo_like_hint(labels, seed=9)
    with pytest.warns(HintMissedWarning, match="entropy"):
        _check(backend, hidden, weight, bias, labels, hint, 2.0 * hint, entropy_grad=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_second_backward_recomputes(backend):
    hidden, weight, _, labels = make_head_inputs((9,), H, V, bias=False, seed=10)
    hint = torch.randn(9, generator=torch.Generator().manual_seed(11))
    logp, _ = linear_logprobs(hidden, weight, labels, grad_hint=hint, backend=backend)
    (logp * hint).sum().backward(retain_graph=True)
    first = [hidden.grad.clone(), weight.grad.clone()]
    hidden.grad = weight.grad = None
    (logp * hint).sum().backward()  # the forward's gradients were handed over once: this one recomputes
    assert rel_err(hidden.grad, first[0]) <= RTOL and rel_err(weight.grad, first[1]) <= RTOL


def test_all_ignored_tokens_give_zero_gradients():
    hidden, weight, _, labels = make_head_inputs((5,), H, V, bias=False, ignore="all", seed=12)
    logp, _ = linear_logprobs(hidden, weight, labels, grad_hint=torch.ones(5), backend="torch")
    (logp * 3.0).sum().backward()
    assert hidden.grad.abs().sum() == 0 and weight.grad.abs().sum() == 0


def test_small_gpu_budget_ignores_the_hint(monkeypatch):
    """Without room for the fp32 ``[V, H]`` accumulator the Triton backend declines the one pass: forward
    keeps statistics only and backward recomputes, exactly."""
    pytest.importorskip("triton")
    hidden, weight, bias, labels = make_head_inputs((3, 4), H, V, ignore="some", seed=13)
    hint = _grpo_like_hint(labels, seed=14)
    from hf_fused.ops.backends.triton_cublas.one_pass_rule import one_pass_accumulators, one_pass_plan

    accumulators = one_pass_accumulators(True, weight.dtype, weight.dtype)
    assert one_pass_plan(V, H, weight.element_size(), accumulators, V * H * 4, weight.device) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error", HintMissedWarning)  # declined up front: nothing to warn about
        _check("triton", hidden, weight, bias, labels, hint, hint, tile_budget_bytes=V * H * 4)


def test_no_grad_forward_computes_no_gradients(monkeypatch):
    hidden, weight, _, labels = make_head_inputs((6,), H, V, bias=False, seed=15)
    backend = get_backend(torch.device("cpu"), "torch")
    one_pass = backend.logprobs_with_grads

    def statistics_only(*args, **kwargs):
        assert not kwargs["need"].any, "gradients requested under no_grad"
        return one_pass(*args, **kwargs)

    monkeypatch.setattr(backend, "logprobs_with_grads", statistics_only)
    with torch.no_grad():
        logp, _ = linear_logprobs(hidden, weight, labels, grad_hint=torch.ones(6), backend="torch")
    assert not logp.requires_grad


def test_bad_hints_raise_clear_errors():
    hidden, weight, _, labels = make_head_inputs((2, 3), H, V, bias=False, seed=16)
    with pytest.raises(ValueError, match="grad_hint must have labels' shape"):
        linear_logprobs(hidden, weight, labels, grad_hint=torch.ones(6))
    with pytest.raises(TypeError, match="grad_hint must be a floating-point tensor"):
        linear_logprobs(hidden, weight, labels, grad_hint=torch.ones(2, 3, dtype=torch.long))


def _gpu_inputs(n, h, v, seed, ignore_every):
    """bf16 hidden ``[n, h]`` and lm_head ``[v, h]`` (leaves) and labels with every ``ignore_every``-th ignored, on
    CUDA, drawn from a CPU generator that is returned for the test's further draws."""
    gen = torch.Generator().manual_seed(seed)
    hid = torch.randn(n, h, generator=gen).cuda().bfloat16().requires_grad_()
    w = (torch.randn(v, h, generator=gen) / h**0.25).cuda().bfloat16().requires_grad_()
    y = torch.randint(0, v, (n,), generator=gen).cuda()
    y[::ignore_every] = -100
    return hid, w, y, gen


def _one_pass_budget(h, v):
    """A budget that holds the one pass's fp32 ``[V, H]`` accumulator and 1024 full-vocabulary bf16 rows."""
    return v * h * 4 + 1024 * v * 2


@pytest.mark.gpu
def test_hint_on_gpu_bf16_matches_the_recompute_path():
    """bf16 on the GPU: the one-pass path (hint) against the recompute path on the same inputs, both
    against float64. Their logits tiles have different shapes (whole vocabulary rows vs vocabulary
    chunks), so cuBLAS may round a logit to bf16 differently: each output's error is pinned to the
    recompute path's own, not bit-equality (measured: entropy differed by more than 1e-6 relative). The one pass's
    weight gradient where QuACK is installed comes from the stored exponentials and ``s·h`` rounded to bf16 (two
    roundings, the row-scaled tile: one_pass.FACTORED_EXP_TILE) where the recompute rounds ``dz`` once: up to
    √2 × 1.1 of the recompute's error."""
    n, h, v = 4096, 1024, 32000
    hid, w, y, gen = _gpu_inputs(n, h, v, seed=0, ignore_every=9)
    hint = torch.randn(n, generator=gen).cuda()
    budget = _one_pass_budget(h, v)
    results = []
    for grad_hint in (hint, None):
        hid.grad = w.grad = None
        lp, ent = linear_logprobs(hid, w, y, grad_hint=grad_hint, tile_budget_bytes=budget, return_entropy=True)
        (lp * hint * 0.5).sum().backward()
        results.append((lp.detach(), ent.detach(), hid.grad.clone(), w.grad.clone()))
    h64, w64 = hid.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref_lp, ref_ent = dense_logprobs(h64, w64, y)
    (ref_lp * hint.double() * 0.5).sum().backward()
    (lp1, ent1, dh1, dw1), (lp2, ent2, dh2, dw2) = results
    for ours, theirs, ref, bound in ((lp1, lp2, ref_lp, 1.1), (ent1, ent2, ref_ent, 1.1), (dh1, dh2, h64.grad, 1.1),
                                     (dw1, dw2, w64.grad, 1.1 * 2**0.5)):
        assert rel_err(ours, ref) <= bound * rel_err(theirs, ref) + 1e-6, (rel_err(ours, ref), rel_err(theirs, ref))


@pytest.mark.gpu
@pytest.mark.parametrize("scale", [0.5, 1.0])
def test_hint_check_behind_the_queued_gradients_gives_the_same_bits(monkeypatch, scale):
    """On CUDA the backward reads ``c`` and the multiple-of-the-hint check through an event recorded before the
    gradients' scaling kernels are queued (``backward._DEFER_HOST_CHECK``): the same gradients, bit for bit, as
    reading them first and scaling by the host's ``c`` (one-pass accumulator "fp32", the split one); and an upstream
    that is not a multiple still warns and recomputes, to the recompute path's accuracy."""
    from hf_fused.ops import backward as backward_module

    n, h, v = 2048, 512, 16000
    hid, w, y, gen = _gpu_inputs(n, h, v, seed=1, ignore_every=7)
    hint = torch.randn(n, generator=gen).cuda()
    other = torch.randn(n, generator=gen).cuda()
    budget = _one_pass_budget(h, v)

    def grads(upstream, defer, grad_hint=hint):
        monkeypatch.setattr(backward_module, "_DEFER_HOST_CHECK", defer)
        hid.grad = w.grad = None
        lp, _ = linear_logprobs(hid, w, y, grad_hint=grad_hint, tile_budget_bytes=budget, return_entropy=True)
        (lp * upstream).sum().backward()
        return hid.grad.clone(), w.grad.clone()

    deferred, first = grads(hint * scale, True), grads(hint * scale, False)
    for got, want in zip(deferred, first):
        assert torch.equal(got, want)
    with pytest.warns(HintMissedWarning):
        missed = grads(other, True)
    recomputed = grads(other, True, grad_hint=None)
    for got, want in zip(missed, recomputed):
        assert rel_err(got, want) <= 2**-8, rel_err(got, want)  # bf16: the two forwards' lse round apart


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_gradients_are_rounded_once_whatever_the_factor(backend):
    """The forward's gradients stay fp32 until backward has scaled them by ``c`` (here 0.37), then round
    once. Torch backend (fp32 logits-gradient): bit-for-bit the recompute path's rounding, which sees
    ``c·hint`` from the start; scaling bf16 gradients would change a third of the elements by one bf16
    step. Triton backend (its logits-gradient tile is bf16, rounded at a different scale on each path):
    error against float64 no worse than the recompute path's (measured 0.98×; 1.08× when rounded twice)."""
    hidden, weight, _, labels = make_head_inputs((8, 16), 64, V, bias=False, ignore="some", seed=21,
                                                 dtype=torch.bfloat16)
    hint = torch.randn(labels.shape, generator=torch.Generator().manual_seed(22)) * (labels != -100)
    h64, w64 = leaf64(hidden), leaf64(weight)
    ref, _ = dense_logprobs(h64, w64, labels)
    (ref * (0.37 * hint.double())).sum().backward()
    results = []
    for grad_hint in (hint, None):
        hidden.grad = weight.grad = None
        logp, _ = linear_logprobs(hidden, weight, labels, grad_hint=grad_hint, backend=backend)
        (logp * (0.37 * hint)).sum().backward()
        results.append((hidden.grad.clone(), weight.grad.clone()))
    for ours, theirs, exact in zip(*results, (h64.grad, w64.grad)):
        assert_rounded_like(ours, theirs, exact, fp32_logits_grad=backend == "torch")
