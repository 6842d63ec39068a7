"""The gradient-free token statistics of TRL's fused head (mean logit, arg-max hit, ``log Σ p²``), computed by
``linear_logprobs(..., statistics=...)`` in its forward's own pass over the logits: against float64 statistics of
the dense logits on both backends (Triton under its interpreter on CPU), on both schedules (statistics pass /
one pass with a ``grad_hint``), with the log-probs, entropies and gradients of the same call; arg-max ties
(the first maximum wins, across lanes and vocabulary chunks); bf16 against stock TRL's head; TRL's head answer
in one pass."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from references import assert_head_grads, dense_logits, dense_logprobs, leaf64, make_head_inputs, rel_err
from references import H, RTOL, budget_for
from hf_fused.ops import TokenLossHint, available_backends, get_backend, linear_logprobs
from hf_fused.ops.backends.triton_cublas.two_pass_rule import two_pass_plan
from hf_fused.ops.token_statistics import TOKEN_STATISTICS, linear_token_statistics

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    "triton" not in available_backends(), reason="triton not importable"))]

# Triton's two passes chunk the vocabulary at MIN_CHUNK_COLS = 2048 columns: 2100 = 2048 + 52 gives two chunks
# when the budget holds fewer than 2100 columns of the rows, here 2-row blocks (checked in the tie test), so every
# online reduction crosses a chunk boundary.
TRITON_V, TRITON_CHUNKED_BUDGET = 2100, 2048 * 4 * 2
TORCH_V = 97

CASES = {  # (bias, logit transform)
    "identity": (False, {}),
    "softcap_temperature": (False, {"softcap": 3.0, "temperature": 0.7}),
    "bias": (True, {}),
    "combined": (True, {"logit_scale": 1.5, "softcap": 4.0, "temperature": 0.8}),
}


def dense_statistics(hidden, weight, bias, labels, ignore_index=-100, **transform):
    """Float64 reference, computed the way TRL's docstring defines the fields; 0 / False where ignored."""
    z = dense_logits(hidden.double(), weight.double(), None if bias is None else bias.double(), **transform)
    mask = labels != ignore_index
    return {
        "mean_logits": z.mean(-1) * mask,
        "is_top1": (z.argmax(-1) == labels) & mask,  # argmax returns the first maximum
        "log_sum_sq_probs": torch.log((z.softmax(-1) ** 2).sum(-1)) * mask,
    }


def _spy(backend_name, monkeypatch):
    """Counts of the passes that ran: ``logprobs_with_grads`` answering with gradients (one pass; the torch
    reference's statistics pass calls it without), ``logprobs_forward`` (statistics pass) and ``logprobs_backward``
    (recompute)."""
    impl = get_backend(torch.device("cpu"), backend_name)
    calls = {"one_pass": 0, "statistics_pass": 0, "recompute": 0}
    one_pass, forward, backward = impl.logprobs_with_grads, impl.logprobs_forward, impl.logprobs_backward

    def logprobs_with_grads(*a, **k):
        out = one_pass(*a, **k)
        calls["one_pass"] += out is not None and out.grads is not None
        return out

    def logprobs_forward(*a, **k):
        calls["statistics_pass"] += 1
        return forward(*a, **k)

    def logprobs_backward(*a, **k):
        calls["recompute"] += 1
        return backward(*a, **k)

    monkeypatch.setattr(impl, "logprobs_with_grads", logprobs_with_grads)
    monkeypatch.setattr(impl, "logprobs_forward", logprobs_forward)
    monkeypatch.setattr(impl, "logprobs_backward", logprobs_backward)
    return calls


def _labels_half_on_the_argmax(hidden, weight, bias, labels, transform):
    """Labels on the float64 arg-max for every other row, so that is_top1 is True somewhere and False elsewhere."""
    with torch.no_grad():
        z = dense_logits(hidden.double(), weight.double(), None if bias is None else bias.double(), **transform)
    on_top = (labels != -100) & (torch.arange(labels.shape[-1]) % 2 == 0)
    return torch.where(on_top, z.argmax(-1), labels)


@pytest.mark.parametrize("ignore", ["none", "some", "all"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("path", ["statistics_pass", "one_pass"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_statistics_logprobs_and_grads_match_float64(backend, path, case, ignore, monkeypatch):
    """Every statistic, the log-probs, the entropy and the head gradients of one call against float64; the schedule
    asked for is the one that ran (a grad_hint and room: the one pass, its gradients used by backward)."""
    with_bias, transform = CASES[case]
    vocab = TORCH_V if backend == "torch" else TRITON_V
    hidden, weight, bias, labels = make_head_inputs((3, 7), H, vocab, bias=with_bias, ignore=ignore, seed=len(case))
    labels = _labels_half_on_the_argmax(hidden, weight, bias, labels, transform)
    if backend == "torch":
        budget = budget_for(4, vocab)  # row tiles of 4: several tiles, a partial last one
    else:  # the one pass needs room for whole vocabulary rows; the statistics pass gets two vocabulary chunks
        budget = None if path == "one_pass" else TRITON_CHUNKED_BUDGET
    hint = torch.randn(labels.shape, generator=torch.Generator().manual_seed(1)) if path == "one_pass" else None
    calls = _spy(backend, monkeypatch)
    h64, w64, b64 = leaf64(hidden), leaf64(weight), leaf64(bias)

    logp, ent, stats = linear_logprobs(hidden, weight, labels, bias, return_entropy=True, backend=backend,
                                       tile_budget_bytes=budget, grad_hint=hint, statistics=TOKEN_STATISTICS,
                                       **transform)
    ref = dense_statistics(hidden, weight, bias, labels, **transform)
    assert list(stats) == list(TOKEN_STATISTICS)
    assert stats["is_top1"].dtype == torch.bool and torch.equal(stats["is_top1"], ref["is_top1"])
    if ignore != "all":
        assert stats["is_top1"].any() and not stats["is_top1"][labels != -100].all()
    for name in ("mean_logits", "log_sum_sq_probs"):
        assert stats[name].dtype == torch.float32 and stats[name].shape == labels.shape
        assert not stats[name].requires_grad
        assert rel_err(stats[name], ref[name]) <= RTOL, name

    ref_logp, ref_ent = dense_logprobs(h64, w64, labels, b64, **transform)
    assert rel_err(logp, ref_logp) <= RTOL and rel_err(ent, ref_ent) <= RTOL
    if path == "one_pass":  # the upstream gradient the hint announced: backward hands over the forward's gradients
        (logp * hint).sum().backward()
        (ref_logp * hint.double()).sum().backward()
    else:
        g = torch.randn((2,) + labels.shape, generator=torch.Generator().manual_seed(2))
        ((logp * g[0]).sum() + (ent * g[1]).sum()).backward()
        ((ref_logp * g[0].double()).sum() + (ref_ent * g[1].double()).sum()).backward()
    assert_head_grads((hidden, weight, bias), (h64, w64, b64), RTOL)
    if path == "one_pass":
        assert calls == {"one_pass": 1, "statistics_pass": 0, "recompute": 0}
    else:
        assert calls["one_pass"] == 0 and calls["statistics_pass"] == 1


@pytest.mark.parametrize("path", ["statistics_pass", "one_pass"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_asking_for_statistics_changes_nothing_else(backend, path):
    """The log-probs, the entropy and the gradients are bit for bit those of the same call without statistics."""
    hidden, weight, bias, labels = make_head_inputs((2, 5), H, TORCH_V, ignore="some", seed=3)
    hint = torch.randn(labels.shape, generator=torch.Generator().manual_seed(4)) if path == "one_pass" else None
    results = []
    for statistics in (None, TOKEN_STATISTICS):
        for t in (hidden, weight, bias):
            t.grad = None
        out = linear_logprobs(hidden, weight, labels, bias, return_entropy=True, softcap=3.0, backend=backend,
                              grad_hint=hint, statistics=statistics)
        assert len(out) == (2 if statistics is None else 3)
        loss = (out[0] * (hint if hint is not None else 1.0)).sum() + (0.0 if hint is not None else out[1].sum())
        loss.backward()
        results.append([out[0], out[1], hidden.grad, weight.grad, bias.grad])
    for without, with_stats in zip(*results):
        assert torch.equal(without, with_stats)


# -- the first maximum wins a tie ----------------------------------------------------------------------------------

# Pairs of columns with the same logit. The Triton statistics kernel keeps a running max per lane (column % 512):
# (1, 2) in two lanes, (1, 513) in one lane, (10, 515) the later column in the lower lane, (5, 2050) in two
# vocabulary chunks (2048 columns each on the Triton statistics pass).
TIES = [(1, 2), (1, 513), (10, 515), (5, 2050)]


@pytest.mark.parametrize("tied", TIES, ids=str)
@pytest.mark.parametrize("path", ["statistics_pass", "one_pass"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_first_maximum_wins_a_tie(backend, path, tied):
    """TRL counts a label as top-1 only if no earlier token has the same logit (``argmax`` returns the first
    maximum); the float64 reference agrees. A row of all-equal logits has its arg-max at column 0."""
    weight = torch.zeros(TRITON_V, 2)
    weight[list(tied), 0] = 1.0
    weight[7, 0] = 0.5  # a smaller logit before the tie, so the maximum moves in its lane
    weight = weight.requires_grad_(path == "one_pass")
    hidden = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    labels = torch.tensor([tied[0], tied[1], 0, 5])
    budget = TRITON_CHUNKED_BUDGET if (backend == "triton" and path == "statistics_pass") else None
    if budget is not None:  # as many rows as any test here: the tie (5, 2050) falls in two vocabulary chunks
        assert two_pass_plan(4, TRITON_V, 4, budget) == (2, 2048)
    hint = torch.ones(4) if path == "one_pass" else None
    _, _, stats = linear_logprobs(hidden, weight, labels, backend=backend, tile_budget_bytes=budget, grad_hint=hint,
                                  statistics=("is_top1",))
    assert stats["is_top1"].tolist() == [True, False, True, False]
    assert torch.equal(stats["is_top1"], dense_statistics(hidden, weight, None, labels)["is_top1"])


# -- the API ---------------------------------------------------------------------------------------------------------


def test_only_requested_statistics_in_the_order_asked():
    hidden, weight, bias, labels = make_head_inputs((4,), H, 37)
    _, _, stats = linear_logprobs(hidden, weight, labels, bias, statistics=("log_sum_sq_probs", "mean_logits"))
    assert list(stats) == ["log_sum_sq_probs", "mean_logits"]
    assert linear_logprobs(hidden, weight, labels, bias, statistics=())[2] == {}
    assert set(linear_token_statistics(hidden, weight, labels, bias, statistics=("is_top1",))) == {"is_top1"}


def test_bad_requests_raise():
    hidden, weight, bias, labels = make_head_inputs((4,), H, 37)
    with pytest.raises(ValueError, match="unknown token statistics"):
        linear_logprobs(hidden, weight, labels, bias, statistics=("entropy",))
    with pytest.raises(TypeError, match="sequence of names"):
        linear_logprobs(hidden, weight, labels, bias, statistics="is_top1")
    hint = TokenLossHint(lambda logp, entropy, a: -a * logp, {"a": torch.ones(4)})
    with pytest.raises(ValueError, match="TokenLossHint"):
        linear_logprobs(hidden, weight, labels, bias, grad_hint=hint, statistics=("is_top1",))
    assert linear_logprobs(hidden, weight, labels, bias, grad_hint=hint, statistics=())[2] == {}  # none asked: fine


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_token_statistics_is_the_statistics_pass(backend):
    """The metrics-only entry point: the statistics of ``linear_logprobs``, bit for bit, with no gradient."""
    hidden, weight, bias, labels = make_head_inputs((3, 7), H, TORCH_V, ignore="some", seed=5)
    kwargs = dict(softcap=3.0, temperature=0.7, backend=backend)
    got = linear_token_statistics(hidden, weight, labels, bias, **kwargs)
    with torch.no_grad():
        _, _, want = linear_logprobs(hidden, weight, labels, bias, statistics=TOKEN_STATISTICS, **kwargs)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    assert not any(v.requires_grad for v in got.values())


# -- bf16 ------------------------------------------------------------------------------------------------------------


def _trl_statistics(hidden, weight, labels):
    """Stock TRL's fused head (``trl/kernels/chunked_logprob.py``; its torch tiles on CPU): bf16 logits tiles."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    outputs = ("log_sum_sq_probs", "mean_logits", "is_top1")
    logp, _, log_sum_sq, mean, top1 = ChunkedLogProbFunction.apply(
        hidden, weight, None, labels, 1.0, 2048, None, 1.0, outputs
    )
    mask = labels != -100
    return logp * mask, {"mean_logits": mean * mask, "is_top1": top1 & mask, "log_sum_sq_probs": log_sum_sq * mask}


def test_autocast_torch_backend_reads_the_bf16_operands():
    """Under autocast the torch backend rounds the operands to bf16 as F.linear's would and computes fp32 logits
    from them (as its log-probs): its statistics are the float64 ones of the rounded operands (fp32 accumulation
    the only error)."""
    hidden, weight, bias, labels = make_head_inputs((2, 6), H, TORCH_V, ignore="some")
    labels = _labels_half_on_the_argmax(hidden, weight, bias, labels, {})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, _, got = linear_logprobs(hidden, weight, labels, bias, backend="torch", statistics=TOKEN_STATISTICS)
    ref = dense_statistics(*[t.detach().bfloat16() for t in (hidden, weight, bias)], labels)
    assert torch.equal(got["is_top1"], ref["is_top1"]) and got["is_top1"].any()
    for name in ("mean_logits", "log_sum_sq_probs"):
        assert rel_err(got[name], ref[name]) <= RTOL, name


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_against_stock_trl(backend):
    """bf16 operands. The Triton backend's logits tile is bf16, rounded by the matmul as TRL's tiles (and eager
    transformers' logits) are: it reproduces stock TRL's statistics up to fp32 summation order, is_top1 exactly.
    The torch backend computes fp32 logits from the bf16 operands: float64-accurate on those operands, so its
    error is fp32's while TRL's carries the logits' bf16 rounding; its is_top1 equals TRL's wherever TRL's bf16
    maximum is unique (rounding is monotone, so a unique rounded maximum is the unrounded one)."""
    g = torch.Generator().manual_seed(6)
    n, vocab = 24, TRITON_V
    hidden = torch.randn(n, 64, generator=g).bfloat16()
    weight = (torch.randn(vocab, 64, generator=g) * 0.5).bfloat16()
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[::5] = -100
    eager = F.linear(hidden, weight).float()  # the bf16 logits transformers' lm_head returns
    labels = torch.where((labels != -100) & (torch.arange(n) % 2 == 0), eager.argmax(-1), labels)
    trl_logp, trl = _trl_statistics(hidden, weight, labels)
    logp, _, got = linear_logprobs(hidden, weight, labels, backend=backend, statistics=TOKEN_STATISTICS)
    assert got["is_top1"].any() and not got["is_top1"][labels != -100].all()
    if backend == "triton":
        assert torch.equal(got["is_top1"], trl["is_top1"])
        for name in ("mean_logits", "log_sum_sq_probs"):  # the same bf16 logits, summed in another order
            assert rel_err(got[name], trl[name]) <= RTOL, name
        assert rel_err(logp, trl_logp) <= RTOL
        return
    ref = dense_statistics(hidden, weight, None, labels)
    assert torch.equal(got["is_top1"], ref["is_top1"])
    top2 = eager.topk(2, dim=-1).values
    unique = top2[:, 0] > top2[:, 1]
    assert torch.equal(got["is_top1"][unique], trl["is_top1"][unique])
    for name in ("mean_logits", "log_sum_sq_probs"):
        assert rel_err(got[name], ref[name]) <= RTOL < rel_err(trl[name], ref[name]), name


def test_bf16_tie_of_rounded_logits():
    """Two logits 4 and 4 + 2⁻¹⁰ (exact in fp32) round to one bf16 value. TRL and eager transformers see a tie, so
    a label on the later, larger one is not top-1 for them; the torch backend (fp32 logits of the bf16 operands,
    float64's answer) counts it, the Triton backend (bf16 logits tile, TRL's answer) does not."""
    hidden = torch.tensor([[1.0, 2.0**-10]] * 2).bfloat16()
    weight = torch.zeros(TRITON_V, 2)
    weight[3] = torch.tensor([4.0, 0.0])
    weight[600] = torch.tensor([4.0, 1.0])
    weight = weight.bfloat16()
    labels = torch.tensor([3, 600])
    assert F.linear(hidden, weight)[0, 3] == F.linear(hidden, weight)[0, 600]  # the tie eager sees
    _, trl = _trl_statistics(hidden, weight, labels)
    assert trl["is_top1"].tolist() == [True, False]
    expected = {"torch": [False, True], "triton": [True, False]}
    for backend in [b for b in ("torch", "triton") if b in available_backends()]:
        _, _, got = linear_logprobs(hidden, weight, labels, backend=backend, statistics=("is_top1",))
        assert got["is_top1"].tolist() == expected[backend], backend
    assert dense_statistics(hidden, weight, None, labels)["is_top1"].tolist() == expected["torch"]


# -- TRL's head answer -------------------------------------------------------------------------------------------


def test_trl_head_answers_statistics_in_one_pass(monkeypatch):
    """``model(..., fused_lm_head=True)`` with every statistic requested: one pass over the logits in the forward
    (no second, gradient-free pass), the fields equal to stock TRL's head on an unpatched copy."""
    import hf_fused
    import trl.trainer.utils as trl_utils
    from models import make_word_model as make_model

    outputs = ("log_probs", "entropy", *TOKEN_STATISTICS)
    stock, patched = make_model(), make_model()
    trl_utils.add_fused_lm_head(stock, outputs=outputs)
    hf_fused.apply_fused_loss(patched)
    trl_utils.add_fused_lm_head(patched, outputs=outputs)
    ids = torch.randint(3, 40, (2, 9), generator=torch.Generator().manual_seed(7))
    labels = ids.clone()
    with torch.no_grad():  # some next tokens on the model's own arg-max, so that is_top1 is True somewhere
        top = stock(input_ids=ids).logits.argmax(-1)
    labels[:, 1::2] = top[:, :-1:2]
    labels[:, :3] = -100
    calls = _spy("torch", monkeypatch)
    want = stock(input_ids=ids, labels=labels, fused_lm_head=True)
    got = patched(input_ids=ids, labels=labels, fused_lm_head=True)
    assert calls == {"one_pass": 0, "statistics_pass": 1, "recompute": 0}
    assert got.is_top1.any() and not got.is_top1[got.label_mask].all()
    for field in outputs:
        a, b = getattr(got, field), getattr(want, field)
        if b.dtype == torch.bool:
            assert torch.equal(a, b), field
        else:
            assert torch.allclose(a, b, rtol=RTOL, atol=1e-6), field
