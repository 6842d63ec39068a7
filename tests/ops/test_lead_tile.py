"""The count of kept rows read at its first use (hf_fused.ops.kept_rows) and the GPU backend's one pass launching its
first tile before reading it (one_pass.LEAD_TILE): on a GPU the count read waits for the device's queue, so the op's
set-up and the first tile's launch go before it. On CPU (Triton's interpreter, QuACK's stand-in where asked) with the
count deferred as on a GPU: the pass reads the count after the first tile's statistics; its results are those of the
pass that reads the count first, bit for bit, whether the tile held only kept rows or more than there are; bad
labels and a bad ``num_items_in_batch`` still raise from the op; an explicit tile budget reads the count first."""

import pytest
import torch

pytest.importorskip("triton")

from hf_fused.ops import linear_cross_entropy, linear_logprobs, prepare as prepare_module  # noqa: E402
from hf_fused.ops.backends.triton_cublas import one_pass, plan as plan_module  # noqa: E402
from hf_fused.ops.backends.triton_cublas.one_pass_rule import OnePassPlan  # noqa: E402
from hf_fused.ops.kept_rows import KeptRows  # noqa: E402
from hf_fused.ops.token_loss import TokenLossHint  # noqa: E402
from quack_stand_in import quack_fixture, trained_head_inputs  # noqa: E402, F401

quack = quack_fixture  # the shared fixture "quack", in this module for pytest to find

TILE = 16  # rows per tile: 48 rows of which 40 kept make three tiles, the last one partial


@pytest.fixture
def deferred(monkeypatch):
    """The count read at its first use on CPU too, as on a GPU; the events of the call in order: ``"count"`` when
    the count is read, ``"tile"`` when a tile's statistics are launched."""
    monkeypatch.setattr(prepare_module, "DEFERRED_COUNT_DEVICES", frozenset({"cuda", "cpu"}))
    events = []
    read = KeptRows.rows

    def rows(self):
        if not self.known:
            events.append("count")
        return read(self)

    monkeypatch.setattr(KeptRows, "rows", rows)
    statistics = one_pass.TileStatistics.__call__
    monkeypatch.setattr(one_pass.TileStatistics, "__call__",
                        lambda self, *a: events.append("tile") or statistics(self, *a))
    return events


def _plan(rows=TILE):
    return plan_module.forced_plans(one_pass=OnePassPlan(rows, "fp32", 0))


def _cross_entropy(hidden, weight, labels, **options):
    loss = linear_cross_entropy(hidden, weight, labels, backend="triton", **options)
    return (loss.detach(), *torch.autograd.grad(loss, (hidden, weight)))


def _both(monkeypatch, run, rows=TILE):
    """``run()`` with the lead tile and then with the count read before the pass's set-up."""
    with _plan(rows):
        lead = run()
        monkeypatch.setattr(one_pass, "LEAD_TILE", False)
        first = run()
        monkeypatch.setattr(one_pass, "LEAD_TILE", True)
    return lead, first


def _assert_equal(got, want):
    for g, w in zip(got, want):
        assert torch.equal(g, w), (g - w).abs().max()


@pytest.mark.parametrize("stand_in", [False, True], ids=["cuBLAS-tile", "quack-scaled-tile"])
def test_the_first_tile_is_launched_before_the_count_is_read(deferred, monkeypatch, request, stand_in):
    """Cross-entropy (the mean over the kept rows, whose count is its normalizer): the first tile's statistics go
    before the count, the other tiles after; loss and gradients equal the pass that reads the count first."""
    if stand_in:
        request.getfixturevalue("quack")
    hidden, weight, labels = trained_head_inputs(n=48)
    lead, first = _both(monkeypatch, lambda: _cross_entropy(hidden, weight, labels))
    # three tiles (40 kept rows): with the lead tile, then with the count read first
    assert deferred == ["tile", "count", "tile", "tile"] + ["count", "tile", "tile", "tile"], deferred
    _assert_equal(lead, first)
    kept = labels != -100
    logp = torch.log_softmax(hidden.double() @ weight.double().T, -1).gather(1, labels.clamp_min(0)[:, None])[:, 0]
    exact = -(logp * kept).sum() / kept.sum()
    # the scaled tile's statistics come from the fp32 accumulator; the cuBLAS tile's from bf16 logits (2⁻⁹ relative)
    assert abs(lead[0].double() - exact) / exact < (1e-6 if stand_in else 2.0**-9)


def _clipped_ratio_loss(logprobs, entropy, old, advantages):
    ratio = torch.exp(logprobs - old)
    return torch.maximum(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.28))


@pytest.mark.parametrize("kind", ["tensor", "token_loss"])
def test_grpo_hints_take_the_lead_tile(deferred, monkeypatch, kind):
    """FusedGRPOTrainer's calls (log-probs and entropy): on-policy a tensor grad_hint, off-policy a TokenLossHint,
    each gathered at the kept rows only when the pass first needs it: the lead tile before the count; log-probs,
    entropy and gradients as the other order's."""
    hidden, weight, labels = trained_head_inputs(seed=3, n=48)
    g = torch.Generator().manual_seed(1)
    kept = labels != -100
    if kind == "tensor":
        hint = torch.randn(labels.shape, generator=g) * kept
        loss_of = lambda lp: (lp * hint).sum()  # noqa: E731
    else:
        per_token = dict(old=-8.0 + torch.randn(labels.shape, generator=g),
                         advantages=torch.randn(labels.shape, generator=g) * kept)
        hint = TokenLossHint(_clipped_ratio_loss, per_token)
        loss_of = lambda lp: _clipped_ratio_loss(lp, None, **per_token).sum()  # noqa: E731

    def run():
        lp, ent = linear_logprobs(hidden, weight, labels, return_entropy=True, grad_hint=hint, backend="triton")
        return (lp.detach(), ent.detach(), *torch.autograd.grad(loss_of(lp), (hidden, weight)))

    lead, first = _both(monkeypatch, run)
    assert deferred[:2] == ["tile", "count"], deferred
    _assert_equal(lead, first)


@pytest.mark.parametrize("kept_rows", [0, 5, TILE - 1])
def test_fewer_kept_rows_than_the_tile_drop_it(deferred, monkeypatch, kept_rows):
    """48 rows given, fewer than one tile's kept (none among them): the lead tile (launched on the kept rows and row
    0 for the missing ones) is dropped and the pass starts over: the results are the other order's."""
    hidden, weight, labels = trained_head_inputs(seed=5, n=48)
    labels[kept_rows:] = -100
    lead, first = _both(monkeypatch, lambda: _cross_entropy(hidden, weight, labels))
    assert deferred[:2] == ["tile", "count"], deferred
    _assert_equal(lead, first)
    if kept_rows == 0:
        assert lead[0] == 0 and lead[1].abs().sum() == 0 and lead[2].abs().sum() == 0


def test_bad_labels_and_num_items_raise_from_the_op(deferred):
    """A label out of range (launched clamped in the lead tile, never read out of bounds) and a tensor
    ``num_items_in_batch`` of 0 raise the errors prepare gives where the count is read at once."""
    hidden, weight, labels = trained_head_inputs(seed=2, n=48)
    bad = labels.clone()
    bad[7] = weight.shape[0] + 3
    with _plan(), pytest.raises(ValueError, match=f"labels contain {weight.shape[0] + 3}, outside"):
        _cross_entropy(hidden, weight, bad)
    assert deferred[:2] == ["tile", "count"]
    with _plan(), pytest.raises(ValueError, match="num_items_in_batch must be a finite number > 0"):
        _cross_entropy(hidden, weight, labels, num_items_in_batch=torch.tensor(0.0))


def test_a_call_of_one_tile_or_an_explicit_budget_reads_the_count_first(deferred):
    """No lead tile where every row fits one tile (there is nothing to overlap) or under an explicit tile budget (the
    plan tiles the call's own count)."""
    hidden, weight, labels = trained_head_inputs(seed=4, n=48)
    with _plan(rows=64):
        _cross_entropy(hidden, weight, labels)
    assert deferred[:2] == ["count", "tile"], deferred
    deferred.clear()
    _cross_entropy(hidden, weight, labels, tile_budget_bytes=2**30)
    assert deferred[:2] == ["count", "tile"], deferred


def test_the_count_is_read_once_and_kept():
    """KeptRows: the count read once (later uses take the rows read then), the leading rows without reading it
    (padded with row 0 where fewer are kept), the bound before and after."""
    kept = torch.tensor([False, True, True, False, True])
    reads = []
    rows = KeptRows(kept, torch.stack([kept.sum()]), lambda host: reads.append(host))
    assert not rows.known and rows.bound == 5
    assert rows.leading(2).tolist() == [1, 2] and rows.leading(4).tolist() == [1, 2, 4, 0]
    assert not rows.known
    assert rows.rows().tolist() == [1, 2, 4] and rows.rows().tolist() == [1, 2, 4]
    assert reads == [[3]] and rows.known and rows.bound == 3 and rows.leading(2).tolist() == [1, 2]


@pytest.mark.gpu
@pytest.mark.parametrize("kept_rows", [None, 700], ids=["a-tenth-ignored", "fewer-than-a-tile"])
def test_on_gpu_the_lead_tile_gives_the_count_first_results(deferred, monkeypatch, kept_rows):
    """On a GPU with the library's defaults (QuACK's scaled tile where it is installed): cross-entropy and the GRPO
    hint's log-probs, entropy and gradients with the lead tile equal, bit for bit, the pass that reads the count
    first (1024-row tiles over 4096 rows; or 700 kept rows, fewer than a tile, where the lead tile is dropped)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(4096, 1024, device="cuda", generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(32000, 1024, device="cuda", generator=g) * 4 / 32).bfloat16().requires_grad_()
    labels = torch.randint(0, 32000, (4096,), device="cuda", generator=g)
    labels[::10] = -100
    if kept_rows is not None:
        labels[kept_rows:] = -100
    hint = torch.randn(4096, device="cuda", generator=g) * (labels != -100)

    def run():
        loss = linear_cross_entropy(hidden, weight, labels)
        lp, ent = linear_logprobs(hidden, weight, labels, return_entropy=True, grad_hint=hint)
        return (loss.detach(), *torch.autograd.grad(loss, (hidden, weight)), lp.detach(), ent.detach(),
                *torch.autograd.grad((lp * hint).sum(), (hidden, weight)))

    with _plan(1024):
        run()  # compilation
    deferred.clear()
    lead, first = _both(monkeypatch, run, rows=1024)
    assert deferred[:2] == ["tile", "count"], deferred
    _assert_equal(lead, first)


def test_only_the_ops_that_ask_defer_the_count(deferred):
    """prepare reads the count at once unless the op asks (defer_count=True: the cross-entropy and log-prob ops, which
    read the labels only through the rows): an op that reads the labels itself (top-k log-probs, distillation) gets
    the label check before it does, as before."""
    hidden, weight, labels = trained_head_inputs(seed=6, n=48)
    assert prepare_module.prepare(hidden, weight, labels).head.kept_rows.known
    assert not prepare_module.prepare(hidden, weight, labels, defer_count=True).head.kept_rows.known
