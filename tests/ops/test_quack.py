"""QuACK's logits matmul with the statistics in its epilogue (hf_fused.ops.backends.triton_cublas.quack_epilogues)
in the GPU backend's one pass: which calls use it, that the one pass reads its results right, what happens when QuACK is
missing or fails (CPU: Triton's interpreter, a stand-in launcher), and its results on a GPU that has it."""

import builtins
import sys
import warnings

import pytest
import torch

pytest.importorskip("triton")

from hf_fused.ops import LogitTransform, linear_cross_entropy, linear_logprobs, linear_token_loss  # noqa: E402
from hf_fused.ops.backends.triton_cublas import logits_epilogues, one_pass, quack_bridge  # noqa: E402
from hf_fused.ops.head_inputs import HeadInputs  # noqa: E402
from hf_fused.ops.token_loss import TokenLossHint  # noqa: E402
from quack_stand_in import StandIn, assert_turned_off_once  # noqa: E402


def _head(**kw):
    n, h, v = 8, 16, 64
    fields = dict(hidden=torch.zeros(n, h, dtype=torch.bfloat16), weight=torch.zeros(v, h, dtype=torch.bfloat16),
                  bias=None, labels=torch.zeros(n, dtype=torch.long), kept_rows=torch.arange(n),
                  transform=LogitTransform(), tile_budget_bytes=None)
    fields.update(kw)
    return HeadInputs(**fields)


@pytest.mark.parametrize("case, fused", [
    ("plain", True), ("entropy", False), ("statistics", False), ("bias", False), ("softcap", False),
    ("temperature", False), ("logit_scale", False),
])
def test_only_the_plain_log_sum_exp_is_fused(monkeypatch, case, fused):
    monkeypatch.setattr(quack_bridge, "runs_on", lambda h, weight: True)
    head = _head(
        bias=torch.zeros(64, dtype=torch.bfloat16) if case == "bias" else None,
        transform=LogitTransform(**{"softcap": {"softcap": 5.0}, "temperature": {"temperature": 0.7},
                                    "logit_scale": {"logit_scale": 0.5}}.get(case, {})),
    )
    entropy, statistics = case == "entropy", ("is_top1",) if case == "statistics" else ()
    assert quack_bridge.fuses_statistics(head, head.hidden, entropy, statistics) is fused


def test_off_cuda_nothing_is_fused():
    head = _head()
    assert not quack_bridge.runs_on(head.hidden, head.weight)
    assert not quack_bridge.fuses_statistics(head, head.hidden, False, ())


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    n, h, v = 40, 32, 4300
    hidden = torch.randn(n, h, generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.5).bfloat16().requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::5] = -100
    return hidden, weight, labels


def _ce(hidden, weight, labels, budget=2**30):
    loss = linear_cross_entropy(hidden, weight, labels, backend="triton", tile_budget_bytes=budget)
    return (loss, *torch.autograd.grad(loss, (hidden, weight)))


def _close_to(got, want):
    """The loss to fp32 rounding (the log-sum-exp summed in another order); gradients as :func:`_grads_close_to`."""
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=0)
    _grads_close_to(got[1:], want[1:])


def _grads_close_to(got, want):
    """Within one bf16 ulp (dz from a log-sum-exp summed in another order, rounded to bf16) for all but a handful
    of elements."""
    for g, w in zip(got, want):
        ulp = (w.float().abs() * 2.0**-7).clamp(min=2.0**-126)
        assert ((g.float() - w.float()).abs() <= ulp).float().mean() > 0.999


def _same_hinted_pass(got, want):
    """``(logprobs, entropy, dX, dW)``: log-probs to fp32 rounding, the entropy up to fp32 summation order (Σ p·z in
    the gradient kernel instead of the statistics kernel), gradients as :func:`_grads_close_to`."""
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    _grads_close_to(got[2:], want[2:])


def test_the_one_pass_reads_the_fused_statistics(monkeypatch):
    """With the stand-in, the one pass takes the log-sum-exp and label logit from the fused matmul and skips the
    statistics kernel; loss and gradients are the unfused pass's."""
    hidden, weight, labels = _inputs()
    plain = _ce(hidden, weight, labels)
    quack, stats_calls = StandIn(), []
    monkeypatch.setattr(quack_bridge, "_QUACK", {"module": quack})
    monkeypatch.setattr(quack_bridge, "runs_on", lambda h, w: True)
    stats = one_pass.statistics_tile
    monkeypatch.setattr(one_pass, "statistics_tile", lambda *a: stats_calls.append(1) or stats(*a))
    fused = _ce(hidden, weight, labels)
    assert quack.calls == ["tile"] and stats_calls == []  # one tile of the 32 kept rows
    _close_to(fused, plain)


def test_with_a_fixed_hint_the_entropy_comes_from_the_gradient_kernel(monkeypatch):
    """FusedGRPOTrainer's on-policy one pass (log-probs and entropy, ``grad_hint`` a fixed weight per token): the
    statistics come from the fused matmul and the entropy from the gradient kernel's Σ p·z (its gradient does not
    read the entropy); log-probs, entropy and gradients are the unfused pass's (the entropy up to fp32 summation
    order)."""
    hidden, weight, labels = _inputs(3)
    hint = torch.randn(labels.shape, generator=torch.Generator().manual_seed(4)) * (labels != -100)

    def run():
        lp, ent = linear_logprobs(hidden, weight, labels, return_entropy=True, grad_hint=hint, backend="triton",
                                  tile_budget_bytes=2**30)
        return (lp.detach(), ent.detach(), *torch.autograd.grad((lp * hint).sum(), (hidden, weight)))

    plain = run()
    quack = StandIn()
    monkeypatch.setattr(quack_bridge, "_QUACK", {"module": quack})
    monkeypatch.setattr(quack_bridge, "runs_on", lambda h, w: True)
    fused = run()
    assert quack.calls == ["tile"]
    _same_hinted_pass(fused, plain)


def _clipped_ratio_loss(logprobs, entropy, old, advantages):
    """An off-policy DAPO-like token loss: its gradient depends on the log-prob (the ratio), not on the entropy."""
    assert entropy is None  # the hint says it does not read it: it must not be handed one
    ratio = torch.exp(logprobs - old)
    return torch.maximum(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.28))


def _off_policy_hint(labels, seed):
    g = torch.Generator().manual_seed(seed)
    kept = (labels != -100).float()
    per_token = dict(old=-8.0 + torch.randn(labels.shape, generator=g),
                     advantages=torch.randn(labels.shape, generator=g) * kept)
    return TokenLossHint(_clipped_ratio_loss, per_token, need_entropy=False)


def _hinted_run(hidden, weight, labels, hint):
    lp, ent = linear_logprobs(hidden, weight, labels, return_entropy=True, grad_hint=hint, backend="triton",
                              tile_budget_bytes=2**30)
    loss = _clipped_ratio_loss(lp, None, **hint.per_token).sum()
    return (lp.detach(), ent.detach(), *torch.autograd.grad(loss, (hidden, weight)))


def test_an_off_policy_hint_takes_the_fused_statistics_and_the_late_entropy(monkeypatch):
    """FusedGRPOTrainer's off-policy one pass (a TokenLossHint whose loss reads the log-prob, not the entropy, with
    the entropy returned as a metric): the statistics come from the fused matmul, the token loss is not handed an
    entropy, the entropy comes from the gradient kernel's Σ p·z; all equal the unfused pass's (the entropy up to
    fp32 summation order, gradients within one bf16 ulp as above)."""
    hidden, weight, labels = _inputs(6)
    hint = _off_policy_hint(labels, 7)
    plain = _hinted_run(hidden, weight, labels, hint)
    quack = StandIn()
    monkeypatch.setattr(quack_bridge, "_QUACK", {"module": quack})
    monkeypatch.setattr(quack_bridge, "runs_on", lambda h, w: True)
    fused = _hinted_run(hidden, weight, labels, hint)
    assert quack.calls == ["tile"]
    _same_hinted_pass(fused, plain)


def test_a_token_loss_that_reads_the_entropy_keeps_the_statistics_kernel(monkeypatch):
    """``linear_token_loss(..., need_entropy=True)``: the per-token loss may read the entropy before the
    gradient kernel runs, so the statistics kernel computes it and nothing is fused."""
    hidden, weight, labels = _inputs(5)
    quack = StandIn()
    monkeypatch.setattr(quack_bridge, "_QUACK", {"module": quack})
    monkeypatch.setattr(quack_bridge, "runs_on", lambda h, w: True)
    loss, _lp, _ent = linear_token_loss(hidden, weight, labels, lambda logprobs, entropy: -logprobs + 0.1 * entropy,
                                        need_entropy=True, backend="triton", tile_budget_bytes=2**30)
    loss.backward()
    assert quack.calls == []


def test_a_quack_call_that_fails_is_turned_off_with_one_warning(monkeypatch):
    hidden, weight, labels = _inputs(1)
    plain = _ce(hidden, weight, labels)
    monkeypatch.setattr(quack_bridge, "runs_on", lambda h, w: True)
    assert_turned_off_once(monkeypatch, "logits_with_statistics", lambda: _ce(hidden, weight, labels), plain)


def test_a_tile_whose_row_vectors_are_not_16_byte_aligned_is_not_sent_to_quack(monkeypatch):
    """QuACK's TMA needs 16-byte aligned operands and raises otherwise (seen on the H100); a tile with a per-row
    vector sliced at an odd row, or a weight that starts mid-way in a flat buffer, runs cuBLAS and the statistics
    kernel, and QuACK stays on for the next ones."""
    quack = StandIn()
    monkeypatch.setattr(quack_bridge, "_QUACK", {"module": quack})
    h, w = torch.zeros(16, 8, dtype=torch.bfloat16), torch.zeros(64, 8, dtype=torch.bfloat16)
    labels, out = torch.zeros(16, dtype=torch.long), torch.empty(16, 64, dtype=torch.bfloat16)
    lse, label_logit = torch.empty(16), torch.empty(16)
    assert not quack_bridge.logits_with_statistics(h[1:], w, labels[1:], out[1:], lse[1:], label_logit[1:])
    assert quack.calls == [] and quack_bridge._QUACK["module"] is quack
    flat = torch.zeros(1 + w.numel(), dtype=w.dtype)  # a weight in a flat buffer, one element in (as ZeRO-3 gathers)
    assert not quack_bridge.logits_with_statistics(h[8:], flat[1:].view_as(w), labels[8:], out[8:], lse[8:],
                                               label_logit[8:])
    assert quack.calls == []
    assert quack_bridge.logits_with_statistics(h[8:], w, labels[8:], out[8:], lse[8:], label_logit[8:])
    assert quack.calls == ["tile"]


def test_quack_that_cannot_be_imported_is_said_once(monkeypatch):
    monkeypatch.setattr(quack_bridge, "_QUACK", {})
    monkeypatch.setattr(quack_bridge.importlib.util, "find_spec", lambda name: object())
    real_import = builtins.__import__

    def failing_import(name, *args, **kwargs):
        if name.split(".")[0] in ("cutlass", "quack"):
            raise ImportError(f"stand-in: {name} cannot be imported")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", failing_import)
    monkeypatch.delitem(sys.modules, "hf_fused.ops.backends.triton_cublas.quack_epilogues", raising=False)
    with pytest.warns(UserWarning, match="unavailable"):
        assert quack_bridge.load() is None
    assert quack_bridge.load() is None and quack_bridge._QUACK == {"module": None}


def test_without_quack_installed_nothing_is_imported(monkeypatch):
    monkeypatch.setattr(quack_bridge, "_QUACK", {})
    monkeypatch.setattr(quack_bridge.importlib.util, "find_spec", lambda name: None)
    assert quack_bridge.load() is None


def test_hf_fused_quack_0_keeps_an_installed_quack_off(monkeypatch):
    """``HF_FUSED_QUACK=0``: QuACK installed but never imported, silently (the user's choice, not a failure);
    ``1`` or unset: used; another value: a clear error."""
    monkeypatch.setattr(quack_bridge, "_QUACK", {})
    monkeypatch.setattr(quack_bridge.importlib.util, "find_spec", lambda name: object())  # as if installed
    # what an import would find: load() would return it
    monkeypatch.setitem(sys.modules, "hf_fused.ops.backends.triton_cublas.quack_epilogues", type(sys)("stand-in"))
    monkeypatch.setenv(quack_bridge.ENV, "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not quack_bridge.installed() and quack_bridge.load() is None
    for value in ("1", ""):
        monkeypatch.setenv(quack_bridge.ENV, value)
        assert quack_bridge.installed()
    monkeypatch.setattr(quack_bridge, "_QUACK", {})
    assert quack_bridge.load() is sys.modules["hf_fused.ops.backends.triton_cublas.quack_epilogues"]
    monkeypatch.setenv(quack_bridge.ENV, "off")
    with pytest.raises(ValueError, match="HF_FUSED_QUACK must be 0 or 1"):
        quack_bridge.installed()


def test_label_grad_sets_only_the_labels_in_the_chunk():
    """logits_epilogues.label_grad_ (after QuACK's gradient epilogue): ``g·(1 − exp(z_y − lse))`` rounded to nearest
    bf16 at each row's label column where it falls in the chunk; every other element untouched."""
    g = torch.Generator().manual_seed(3)
    m, n, v0 = 37, 50, 100
    dz = torch.randn(m, 64, generator=g).bfloat16()[:, :n]  # a strided chunk view
    labels = torch.randint(80, 170, (m,), generator=g)
    zy, lse, g_lp = torch.randn(m, generator=g), torch.randn(m, generator=g) + 3, torch.randn(m, generator=g)
    want = dz.clone()
    inside = (labels >= v0) & (labels < v0 + n)
    rows = inside.nonzero()[:, 0]
    want[rows, labels[rows] - v0] = (g_lp[rows] * (1.0 - torch.exp(zy[rows] - lse[rows]))).bfloat16()
    logits_epilogues.label_grad_(dz, labels, zy, lse, g_lp, col_offset=v0)
    assert 0 < rows.numel() < m
    torch.testing.assert_close(dz, want, rtol=2.0**-8, atol=0)  # exp in the interpreter vs torch: one bf16 step


@pytest.mark.parametrize("entropy_gradient", [False, True])
def test_the_gradient_pass_takes_dz_from_quack(monkeypatch, entropy_gradient):
    """The two passes' gradient pass (log-probs without a hint, an explicit budget) takes each tile's ``dz`` from
    QuACK's epilogue plus the label fix (the stand-in on CPU; the Triton fused kernel forced on under the interpreter
    as on a Hopper GPU) where the gradient is the log-probs' alone, and its gradients are the Triton kernel's;
    with an entropy gradient it keeps the Triton kernel."""
    hidden, weight, labels = _inputs(2)
    w = torch.linspace(-1, 1, labels.numel())

    def run():
        h, wt = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        lp, ent = linear_logprobs(h, wt, labels, backend="triton", return_entropy=True, tile_budget_bytes=2**30)
        loss = (lp * w).sum() + (0.5 * ent.sum() if entropy_gradient else 0.0)
        return torch.autograd.grad(loss, (h, wt))

    with logits_epilogues.forced(True):
        plain = run()
        quack = StandIn()
        monkeypatch.setattr(quack_bridge, "_QUACK", {"module": quack})
        monkeypatch.setattr(quack_bridge, "runs_on", lambda h, w: True)
        fused = run()
    assert (quack.calls.count("grad") > 0) is not entropy_gradient
    # Not the same bits on CPU: the interpreter's fp32 → bf16 store truncates the Triton kernel's dz, where the GPU
    # (and the stand-in, and the label fix) rounds to nearest. So both against float64: no worse than the kernel's.
    # (The GPU test below checks that the real kernels give the same bits.)
    ref_params = [t.detach().double().requires_grad_() for t in (hidden, weight)]
    logp = torch.log_softmax(ref_params[0] @ ref_params[1].T, -1)
    ent = -(logp.exp() * logp).sum(-1)
    mask = labels != -100
    ref = ((logp.gather(1, labels.clamp_min(0)[:, None])[:, 0] * w
            + (0.5 * ent if entropy_gradient else 0.0)) * mask).sum()
    for got, want, exact in zip(fused, plain, torch.autograd.grad(ref, ref_params)):
        err = lambda t: ((t.double() - exact).norm() / exact.norm()).item()  # noqa: E731
        assert err(got) <= 1.1 * err(want) + 1e-6, (err(got), err(want))


def _hopper_inputs(n, scale_weight, ignore_every, h=1024, v=32000):
    """``(hidden [n, h], weight [v, h] scaled by scale_weight, labels, the generator)`` in bf16 on a GPU where
    QuACK's SM90 epilogues run; skips the test elsewhere."""
    pytest.importorskip("quack")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("QuACK's SM90 epilogue needs a GPU of compute capability 9.x")
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).cuda().bfloat16().requires_grad_()
    weight = scale_weight(torch.randn(v, h, generator=g)).cuda().bfloat16().requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g).cuda()
    labels[::ignore_every] = -100
    return hidden, weight, labels, g


def _only_the_spied_epilogue(monkeypatch):
    """QuACK's fp32 accumulations and pair folds off, so that a spy holding one epilogue is the only QuACK kernel a
    run asks for (another would fail on the spy and turn QuACK off mid-run) and both runs of a comparison take the
    same cuBLAS / Triton kernels for everything else."""
    monkeypatch.setattr(quack_bridge, "MATMUL_F32", False)
    monkeypatch.setattr(quack_bridge, "PAIR_FOLD", False)


@pytest.mark.gpu
def test_quack_gradient_epilogue_on_gpu_is_the_triton_kernels_bits():
    """On a Hopper GPU with QuACK, the two passes' gradient pass with QuACK's ``dz`` epilogue gives the same bits
    as with the Triton fused-``dz`` kernel (the same bf16-rounded logit, ``exp`` and rounding), for cross-entropy
    and hint-less log-probs at an explicit budget."""
    n = 8192
    hidden, weight, labels, g = _hopper_inputs(n, lambda w: w * 4 / w.shape[1] ** 0.5, ignore_every=10)
    upstream = torch.randn(n, generator=g).cuda()

    def run():
        loss = linear_cross_entropy(hidden, weight, labels, backend="triton", tile_budget_bytes=64 * 2**20)
        lp, _ = linear_logprobs(hidden, weight, labels, backend="triton", tile_budget_bytes=64 * 2**20)
        return (*torch.autograd.grad(loss, (hidden, weight)), *torch.autograd.grad((lp * upstream).sum(),
                                                                                  (hidden, weight)))

    quack = quack_bridge.load()
    assert quack is not None, f"QuACK was turned off in this process: {quack_bridge.last_error()}"
    calls = []
    spy = type("Spy", (), {"softmax_grad": staticmethod(
        lambda *a, **k: calls.append(1) or quack.softmax_grad(*a, **k))})()
    monkeypatch = pytest.MonkeyPatch()
    try:
        monkeypatch.setenv("HF_FUSED_FP32_LOGITS", "0")  # the stored tiles' statistics, whose dz QuACK's epilogue takes
        monkeypatch.setattr(quack_bridge, "_QUACK", {"module": spy})
        _only_the_spied_epilogue(monkeypatch)
        fused = run()
        assert calls and quack_bridge.load() is spy, quack_bridge.last_error()  # not turned off mid-run
        monkeypatch.setattr(quack_bridge, "_QUACK", {"module": None})
        plain = run()
    finally:
        monkeypatch.undo()
    for got, want in zip(fused, plain):
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["cross_entropy", "logprobs_entropy_hint", "off_policy_hint"])
def test_quack_statistics_on_gpu_match_cublas_and_the_statistics_kernel(monkeypatch, case):
    """On a Hopper GPU with QuACK, the bf16 one pass takes the fused statistics — plain cross-entropy, and
    FusedGRPOTrainer's on-policy log-probs with entropy and a fixed ``grad_hint``, and its off-policy token-loss hint
    (the entropy then from the gradient kernel) — and its results are those of cuBLAS and the statistics kernel up
    to fp32 summation order (log-sum-exp, entropy) and the matmuls' own accumulation order (a logit whose fp32 sum
    lands on the other side of a bf16 rounding boundary): relative error norms of at most 2⁻⁸ between the two, far
    below bf16's own rounding of the logits. Accuracy against float64 on the cross-entropy path:
    tests/ops/test_triton_backend.py::test_triton_backend_bf16_on_gpu_no_worse_than_eager (kw={}, budget=None)."""
    # The stored tiles' one pass, whose statistics QuACK's epilogue takes (log-probs' default: the fp32 accumulator's)
    monkeypatch.setenv("HF_FUSED_FP32_LOGITS", "0")
    n = 4096
    hidden, weight, labels, g = _hopper_inputs(n, lambda w: w / w.shape[1] ** 0.25, ignore_every=5)
    hint = (torch.randn(n, generator=g).cuda() * (labels != -100)).float()

    def run():
        if case == "cross_entropy":
            loss = linear_cross_entropy(hidden, weight, labels, backend="triton")
            return (loss, *torch.autograd.grad(loss, (hidden, weight)))
        if case == "off_policy_hint":
            lp, ent = linear_logprobs(hidden, weight, labels, return_entropy=True, grad_hint=off_policy,
                                      backend="triton")
            loss = _clipped_ratio_loss(lp, None, **off_policy.per_token).sum()
            return (lp.detach(), ent.detach(), *torch.autograd.grad(loss, (hidden, weight)))
        lp, ent = linear_logprobs(hidden, weight, labels, return_entropy=True, grad_hint=hint, backend="triton")
        return (lp.detach(), ent.detach(), *torch.autograd.grad((lp * hint).sum(), (hidden, weight)))

    off_policy = _off_policy_hint(labels.cpu(), 1)
    off_policy = TokenLossHint(off_policy.token_loss, {k: v.cuda() for k, v in off_policy.per_token.items()},
                               need_entropy=False)
    quack = quack_bridge.load()
    assert quack is not None, f"QuACK was turned off in this process: {quack_bridge.last_error()}"
    calls = []
    spy = type("Spy", (), {"logits_with_statistics": staticmethod(
        lambda *a, **k: calls.append(1) or quack.logits_with_statistics(*a, **k))})()
    monkeypatch.setattr(quack_bridge, "_QUACK", {"module": spy})
    _only_the_spied_epilogue(monkeypatch)
    fused = run()
    assert calls and quack_bridge.load() is spy, quack_bridge.last_error()  # not turned off mid-run
    monkeypatch.setattr(quack_bridge, "_QUACK", {"module": None})
    plain = run()
    for got, want in zip(fused, plain):
        rel = ((got.double() - want.double()).norm() / want.double().norm()).item()
        assert rel <= 2.0**-8, (rel, got.shape)
