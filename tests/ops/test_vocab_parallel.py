"""Vocabulary-parallel ops (``vocab_parallel=``, :mod:`hf_fused.ops.vocab_parallel`): every rank holds a slice of
lm_head's rows, the tiles' per-row statistics are merged over the group, each rank gets its rows' weight gradient
and the whole hidden states' gradient.

The ranks run as threads of this process over an in-process group (:class:`ThreadGroup`: the collectives the ops
call, recorded), and, in :func:`test_gloo_ranks_match_float64`, as processes over gloo (``torch.multiprocessing``,
2 and 3 ranks, and a 2 × 2 mesh whose data-parallel rows hold different batches). Every result is compared with the
float64 dense reference (``references.py``) and with the unsharded op on the same inputs: loss or per-token outputs,
the hidden states' gradient, each rank's rows of the weight and bias gradients; fp32, bf16 and autocast inputs.
"""

from __future__ import annotations

import os
import re
import tempfile
import threading
from typing import Callable, Optional

import pytest
import torch

from hf_fused.ops import (
    TokenLossHint,
    linear_cross_entropy,
    linear_logprobs,
    linear_token_loss,
    linear_token_statistics,
)
from hf_fused.ops.vocab_parallel import VocabShard
from references import RTOL, budget_for, dense_logits, rel_err

B, T, H = 2, 7, 8
TRANSFORM = dict(logit_scale=1.5, softcap=3.0, temperature=0.8)
BF16_GRAD_TOL = 2.0**-8 + RTOL  # one bf16 rounding of each gradient element (tests/ops/test_logprobs.py)
STATISTICS = ("mean_logits", "is_top1", "log_sum_sq_probs")


# -- an in-process group: ranks as threads -----------------------------------------------------------------------


class ThreadGroup:
    """``size`` ranks as threads meeting at every collective; :meth:`rank` gives rank ``r``'s view of the group (what
    a :class:`VocabShard` takes as ``group``). Every collective's kind and shape is recorded per rank."""

    def __init__(self, size: int):
        self.size_, self.barrier = size, threading.Barrier(size, timeout=120)
        self.slots: list = [None] * size
        self.calls: list[list[tuple[str, tuple]]] = [[] for _ in range(size)]

    def rank(self, r: int) -> "_Rank":
        return _Rank(self, r)


class _Rank:
    def __init__(self, group: ThreadGroup, r: int):
        self.group, self.r = group, r

    def size(self) -> int:
        return self.group.size_

    def rank(self) -> int:
        return self.r

    def _exchange(self, tensor: torch.Tensor, kind: str) -> list[torch.Tensor]:
        group = self.group
        group.calls[self.r].append((kind, tuple(tensor.shape)))
        group.slots[self.r] = tensor.clone()
        group.barrier.wait()
        values = list(group.slots)
        group.barrier.wait()  # every rank has read the slots before any writes the next
        return values

    def all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        values = self._exchange(tensor, op)
        out = values[0].clone()
        for v in values[1:]:  # in rank order on every rank: the same bits everywhere, as gloo and NCCL give
            out = out + v if op == "sum" else torch.maximum(out, v)
        tensor.copy_(out)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return self._exchange(tensor, "gather")


def run_ranks(size: int, fn: Callable[[int, "_Rank"], object]) -> tuple[list, ThreadGroup]:
    """``[fn(r, group view)]`` for ``r < size``, each in its own thread; the first failure is raised (the others
    are released from their barrier)."""
    group, out, errors = ThreadGroup(size), [None] * size, []

    def target(r):
        try:
            out[r] = fn(r, group.rank(r))
        except BaseException as e:  # noqa: BLE001 (re-raised below)
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real or errors:
        raise (real or errors)[0]
    return out, group


def chunk_bounds(vocab: int, ranks: int) -> list[tuple[int, int]]:
    """DTensor's ``Shard(0)`` rows per rank (``torch.chunk``: ceil-sized, a short or empty last rank)."""
    width = -(-vocab // ranks)
    return [(min(r * width, vocab), min((r + 1) * width, vocab)) for r in range(ranks)]


# -- the ops under test and their float64 references --------------------------------------------------------------


def make_inputs(vocab: int, seed: int = 0, integer: bool = False):
    """``(hidden [B, T, H], weight [V, H], bias [V], labels [B, T])``; ``integer``: small integers (exact fp32
    logits, with ties between the ranks' slices)."""
    g = torch.Generator().manual_seed(seed)
    if integer:
        hidden = torch.randint(-2, 3, (B, T, H), generator=g).float()
        weight = torch.randint(-2, 3, (vocab, H), generator=g).float()
        bias = torch.zeros(vocab)
    else:
        hidden = torch.randn(B, T, H, generator=g)
        weight = torch.randn(vocab, H, generator=g) * (2.0 / H**0.5)
        bias = torch.randn(vocab, generator=g) * 0.5
    labels = torch.randint(0, vocab, (B, T), generator=g)
    labels[0, :2] = -100
    labels[1, -1] = -100
    return hidden, weight, bias, labels


def _upstream(seed: int) -> torch.Tensor:
    return torch.randn(B, T, generator=torch.Generator().manual_seed(seed))


def _token_loss(logprobs, entropy, *, advantages):
    return -advantages * torch.exp(logprobs - logprobs.detach()) * logprobs - 0.05 * entropy


#: op name → (fused call, dense float64 call): each returns ``(outputs {name: tensor}, scalar to backpropagate)``.
#: The fused calls take ``vocab_parallel`` and ``tile_budget_bytes`` keywords.
def _fused_ops():
    adv = _upstream(3)

    def cross_entropy(h, w, b, y, **kw):
        loss = linear_cross_entropy(h, w, y, b, **TRANSFORM, **kw)
        return {"loss": loss}, loss

    def cross_entropy_sum(h, w, b, y, **kw):
        loss = linear_cross_entropy(h, w, y, b, reduction="sum", num_items_in_batch=5,
                                    token_weights=_upstream(4).abs(), **kw)
        return {"loss": loss}, 3.0 * loss  # an upstream factor on the forward's gradients

    def cross_entropy_none(h, w, b, y, **kw):
        losses = linear_cross_entropy(h, w, y, b, reduction="none", **TRANSFORM, **kw)
        return {"losses": losses}, (losses * _upstream(5)).sum()

    def logprobs(h, w, b, y, **kw):
        lp, ent, stats = linear_logprobs(h, w, y, b, return_entropy=True, statistics=STATISTICS, **TRANSFORM, **kw)
        return {"logprobs": lp, "entropy": ent, **stats}, (lp * _upstream(6) + ent * _upstream(7)).sum()

    def logprobs_hint(h, w, b, y, **kw):
        lp, _ = linear_logprobs(h, w, y, b, grad_hint=adv, **kw)
        return {"logprobs": lp}, -(2.0 * adv * lp).sum()  # the hint times 2: handed over, not recomputed

    def token_loss(h, w, b, y, **kw):
        out = linear_token_loss(h, w, y, _token_loss, b, per_token={"advantages": adv}, need_entropy=True,
                                **TRANSFORM, **kw)
        return {"loss": out.loss, "logprobs": out.logprobs, "entropy": out.entropy}, out.loss

    def token_loss_hint(h, w, b, y, **kw):
        hint = TokenLossHint(_token_loss, {"advantages": adv}, need_entropy=True)
        lp, ent = linear_logprobs(h, w, y, b, return_entropy=True, grad_hint=hint, **kw)
        loss = (_token_loss(lp, ent, advantages=adv) * (y != -100)).sum()
        return {"logprobs": lp, "entropy": ent}, loss

    def statistics(h, w, b, y, **kw):
        return linear_token_statistics(h, w, y, b, **TRANSFORM, **kw), None

    return {f.__name__: f for f in (cross_entropy, cross_entropy_sum, cross_entropy_none, logprobs, logprobs_hint,
                                    token_loss, token_loss_hint, statistics)}


FUSED = _fused_ops()


def dense(op: str, h, w, b, y):
    """The float64 reference of ``FUSED[op]`` on float64 leaves (full ``[N, V]`` logits, ordinary autograd)."""
    transform = {} if op in ("cross_entropy_sum", "logprobs_hint", "token_loss_hint") else TRANSFORM
    z = dense_logits(h, w, b, **transform)
    mask = y != -100
    safe = torch.where(mask, y, 0)
    logp_all = torch.log_softmax(z, -1)
    lp = torch.where(mask, logp_all.gather(-1, safe[..., None]).squeeze(-1), 0.0)
    ent = torch.where(mask, -(logp_all.exp() * logp_all).sum(-1), 0.0)
    adv = _upstream(3).double()
    if op == "cross_entropy":
        loss = -lp.sum() / mask.sum()
        return {"loss": loss}, loss
    if op == "cross_entropy_sum":
        loss = -(lp * _upstream(4).abs().double()).sum() / 5
        return {"loss": loss}, 3.0 * loss
    if op == "cross_entropy_none":
        return {"losses": -lp}, (-lp * _upstream(5).double()).sum()
    if op == "logprobs":
        stats = {
            "mean_logits": torch.where(mask, z.mean(-1), 0.0),
            "is_top1": mask & (z.argmax(-1) == y),
            "log_sum_sq_probs": torch.where(mask, torch.logsumexp(2 * logp_all, -1), 0.0),
        }
        upstream = lp * _upstream(6).double() + ent * _upstream(7).double()
        return {"logprobs": lp, "entropy": ent, **stats}, upstream.sum()
    if op == "logprobs_hint":
        return {"logprobs": lp}, -(2.0 * adv * lp).sum()
    if op in ("token_loss", "token_loss_hint"):
        loss = (_token_loss(lp, ent, advantages=adv) * mask).sum()
        outputs = {"logprobs": lp.detach(), "entropy": ent.detach()}
        return ({"loss": loss, **outputs} if op == "token_loss" else outputs), loss
    if op == "statistics":
        return {"mean_logits": torch.where(mask, z.mean(-1), 0.0), "is_top1": mask & (z.argmax(-1) == y),
                "log_sum_sq_probs": torch.where(mask, torch.logsumexp(2 * logp_all, -1), 0.0)}, None
    raise KeyError(op)


def run_op(op: str, inputs, bounds: Optional[tuple[int, int]] = None, group=None, *, dtype=torch.float32,
           autocast: bool = False, tile_rows: int = 4, max_width: Optional[int] = None) -> dict:
    """One rank's ``{output name: value, "grad_hidden", "grad_weight", "grad_bias"}`` of ``FUSED[op]`` on its rows
    ``bounds`` of ``inputs`` (the whole head without ``bounds``), in ``dtype`` (or fp32 under bf16 autocast), with
    tiles of ``tile_rows`` rows of the widest rank's ``max_width`` rows."""
    hidden, weight, bias, labels = inputs
    start, stop = bounds if bounds is not None else (0, weight.shape[0])
    h, w, b = (t.to(dtype).clone().requires_grad_() for t in (hidden, weight[start:stop], bias[start:stop]))
    kw = dict(tile_budget_bytes=budget_for(tile_rows, max_width or weight.shape[0]))
    if bounds is not None:
        kw["vocab_parallel"] = VocabShard(start, stop, group)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        outputs, scalar = FUSED[op](h, w, b, labels, **kw)
    if scalar is not None:
        scalar.backward()
    got = {k: v.detach() for k, v in outputs.items() if v is not None}
    got.update(grad_hidden=h.grad, grad_weight=w.grad, grad_bias=b.grad)
    return got


def dense_op(op: str, inputs, dtype=torch.float32) -> dict:
    """``run_op``'s dict from :func:`dense` on the inputs rounded to ``dtype`` (float64 leaves)."""
    hidden, weight, bias, labels = inputs
    h, w, b = (t.to(dtype).double().requires_grad_() for t in (hidden, weight, bias))
    outputs, scalar = dense(op, h, w, b, labels)
    if scalar is not None:
        scalar.backward()
    return {**{k: v.detach() for k, v in outputs.items()}, "grad_hidden": h.grad, "grad_weight": w.grad,
            "grad_bias": b.grad}


def assert_rank_matches(got: dict, ref: dict, bounds: tuple[int, int], what: str, *, value_tol=RTOL,
                        grad_tol=RTOL) -> None:
    """One rank's results against a whole-head reference (float64, or the unsharded op): every output and the
    hidden gradient whole, the weight and bias gradients at the rank's rows."""
    start, stop = bounds
    assert got.keys() == ref.keys(), (what, got.keys() ^ ref.keys())
    for name, r in ref.items():
        g = got[name]
        if r is None:
            assert g is None, f"{what}: {name} has a gradient the reference lacks"
            continue
        if name in ("grad_weight", "grad_bias"):
            r = r[start:stop]
        assert g is not None and g.shape == r.shape, (what, name, None if g is None else g.shape, r.shape)
        if r.dtype == torch.bool:
            assert torch.equal(g, r), f"{what}: {name} differs at {(g != r).nonzero().tolist()}"
            continue
        tol = grad_tol if name.startswith("grad_") else value_tol
        assert torch.isfinite(g).all(), f"{what}: {name} not finite"
        err = rel_err(g, r)
        assert err <= tol, f"{what}: {name} relative error {err:.3g} > {tol:.3g}"


# -- in-process ranks ---------------------------------------------------------------------------------------------


def sharded(op: str, inputs, bounds: list[tuple[int, int]], **kw) -> tuple[list[dict], ThreadGroup]:
    max_width = max(stop - start for start, stop in bounds)
    return run_ranks(len(bounds), lambda r, group: run_op(op, inputs, bounds[r], group, max_width=max_width, **kw))


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("op", sorted(FUSED))
def test_ranks_match_float64_and_the_unsharded_op(op, ranks):
    """Each op with its head split over 2-4 ranks (a vocabulary of 29: shards 15/14, 10/10/9, 8/8/8/5), several
    tiles per call: the outputs, the hidden states' gradient and each rank's rows of the weight and bias gradients
    match float64 and the unsharded op; statistics (``is_top1`` included) exactly where boolean."""
    inputs = make_inputs(29, seed=ranks)
    bounds = chunk_bounds(29, ranks)
    ref = dense_op(op, inputs)
    whole = run_op(op, inputs)
    got, _ = sharded(op, inputs, bounds)
    for r, (rank_result, rank_bounds) in enumerate(zip(got, bounds)):
        assert_rank_matches(rank_result, ref, rank_bounds, f"{op}, rank {r}/{ranks} vs float64")
        assert_rank_matches(rank_result, whole, rank_bounds, f"{op}, rank {r}/{ranks} vs unsharded")


@pytest.mark.parametrize("op", ["cross_entropy", "logprobs", "token_loss"])
@pytest.mark.parametrize("precision", ["bf16", "autocast"])
def test_half_precision_twins(op, precision):
    """bf16 operands (bf16 tensors, or fp32 ones under bf16 autocast, cast as ``F.linear`` would): against float64
    on the rounded operands within one bf16 rounding of each gradient (fp32 gradients of fp32 leaves under
    autocast: within fp32's), and no further from it than the unsharded op in the same precision."""
    inputs = make_inputs(29, seed=11)
    bounds = chunk_bounds(29, 3)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    kw = dict(dtype=dtype, autocast=precision == "autocast")
    ref = dense_op(op, inputs, torch.bfloat16)
    whole = run_op(op, inputs, **kw)
    got, _ = sharded(op, inputs, bounds, **kw)
    grad_tol = BF16_GRAD_TOL if precision == "bf16" else RTOL
    for r, (rank_result, rank_bounds) in enumerate(zip(got, bounds)):
        assert rank_result["grad_weight"].dtype == dtype
        assert_rank_matches(rank_result, ref, rank_bounds, f"{op} {precision}, rank {r}", grad_tol=grad_tol)
        start, stop = rank_bounds
        for name in ("grad_hidden", "grad_weight", "grad_bias"):
            theirs = whole[name] if name == "grad_hidden" else whole[name][start:stop]
            exact = ref[name] if name == "grad_hidden" else ref[name][start:stop]
            assert rel_err(rank_result[name], exact) <= 1.05 * rel_err(theirs, exact) + RTOL, (op, precision, name)


def test_ties_across_slices_keep_the_first_maximum():
    """Integer logits with ties between the ranks' slices: ``is_top1`` is TRL's ``argmax == label`` (the first
    maximum wins, wherever it lies), bit for bit with the unsharded op; the other statistics match float64."""
    inputs = make_inputs(12, seed=5, integer=True)
    hidden, weight, bias, labels = inputs
    weight[7] = weight[2]  # a tie between rank 0's row 2 and rank 1's row 7 (4 ranks of 3 rows)
    weight[10] = weight[4]
    labels[0, 2:] = torch.tensor([2, 7, 4, 10, 7])
    logits = hidden @ weight.t()
    ref = dense_op("statistics", inputs)
    whole = run_op("statistics", inputs)
    got, _ = sharded("statistics", inputs, chunk_bounds(12, 4))
    at_max = (logits.gather(-1, labels.clamp_min(0)[..., None]).squeeze(-1) == logits.max(-1).values) & (labels >= 0)
    first = logits.argmax(-1) == labels
    # the inputs hold a label at a tied maximum that comes first (is_top1) and one that does not
    assert bool((at_max & first).any()) and bool((at_max & ~first).any())
    for r, rank_result in enumerate(got):
        assert torch.equal(rank_result["is_top1"], whole["is_top1"]), r
        assert_rank_matches(rank_result, ref, chunk_bounds(12, 4)[r], f"statistics, rank {r}")


#: A vocabulary wide enough that fp32's rounding of the shifted sum shows (a mean 1e-5, a maximum 40).
V_WIDE = 3000


def test_mean_logits_near_zero_beside_a_large_maximum():
    """A row of 3000 logits whose largest is 40 and whose mean is near 0 (what a DPO step logs as ``logits/chosen``, no
    transform): over 3 ranks ``mean_logits`` is within fp32's rounding of the logits themselves (``4·eps·mean|z|``)
    of float64's mean, as the unsharded op is: summed from the logits, not from their distances to the maximum,
    whose fp32 sum carries the maximum's rounding into a mean it cancels down to."""
    hidden, weight, bias, labels = make_inputs(V_WIDE, seed=6)
    row = hidden[0, 2]
    others = torch.arange(V_WIDE) != 3
    bias[3] = 40.0 - float(row @ weight[3])
    bias[others] -= float((row @ weight[others].t() + bias[others]).sum() + 40.0 - 0.03) / (V_WIDE - 1)
    z = dense_logits(hidden.double(), weight.double(), bias.double())[0, 2]
    exact = float(z.mean())
    assert z.max() > 39 and abs(exact) < 0.01
    bounds = chunk_bounds(V_WIDE, 3)

    def call(group=None, shard=(0, V_WIDE)):
        start, stop = shard
        kw = dict(tile_budget_bytes=budget_for(4, V_WIDE // 3 + 1))
        if group is not None:
            kw["vocab_parallel"] = VocabShard(start, stop, group)
        stats = linear_token_statistics(hidden, weight[start:stop], labels, bias[start:stop], **kw)
        return float(stats["mean_logits"][0, 2])

    bound = 4 * torch.finfo(torch.float32).eps * float(z.abs().mean())
    assert abs(call() - exact) <= bound
    got, _ = run_ranks(3, lambda r, group: call(group, bounds[r]))
    for value in got:
        assert abs(value - exact) <= bound, (value, exact)


def test_empty_shard_and_any_rank_order():
    """A vocabulary smaller than ranks × ceil-width leaves the last rank no rows (9 over 4: 3/3/3/0), and shards
    may be held in any rank order (here rank 0 holds the top rows): the results are the same."""
    inputs = make_inputs(9, seed=2)
    ref = dense_op("logprobs", inputs)
    for bounds in (chunk_bounds(9, 4), [(6, 9), (0, 2), (2, 6)]):
        got, _ = sharded("logprobs", inputs, bounds)
        for r, rank_result in enumerate(got):
            assert_rank_matches(rank_result, ref, bounds[r], f"shards {bounds}, rank {r}")
        assert got[-1]["grad_weight"].shape[0] == bounds[-1][1] - bounds[-1][0]


def test_one_rank_is_the_plain_op_bit_for_bit():
    """A group of one rank holds the whole vocabulary: the call is the ordinary one (no collective), same bits."""
    inputs = make_inputs(29, seed=4)
    whole = run_op("token_loss", inputs)
    (got,), group = run_ranks(1, lambda r, g: run_op("token_loss", inputs, (0, 29), g))
    assert group.calls == [[]]
    for name, value in whole.items():
        assert torch.equal(got[name], value), name


@pytest.mark.parametrize("op", ["cross_entropy", "logprobs", "token_loss"])
def test_collectives_are_per_row_statistics_and_one_hidden_gradient(op):
    """What the ranks exchange: one gather of five numbers per rank (the layout check); per tile one MAX of
    ``[rows]`` and one SUM of ``[k ≤ 7, rows]``; in backward one SUM of the ``[N, H]`` hidden gradient. Nothing the
    size of the weight or of a logits tile ``[rows, V/tp]``."""
    inputs = make_inputs(29, seed=8)
    bounds = chunk_bounds(29, 2)
    tile_rows = 4
    _, group = sharded(op, inputs, bounds, tile_rows=tile_rows)
    kept = int((inputs[3] != -100).sum())
    tiles = -(-kept // tile_rows)
    for calls in group.calls:
        assert calls[0] == ("gather", (5,))
        forward = calls[1: 1 + 2 * tiles]
        for i in range(tiles):
            rows = min(tile_rows, kept - i * tile_rows)
            (max_kind, max_shape), (sum_kind, sum_shape) = forward[2 * i], forward[2 * i + 1]
            assert (max_kind, max_shape) == ("max", (rows,))
            assert sum_kind == "sum" and sum_shape[1:] == (rows,) and 2 <= sum_shape[0] <= 7
        assert calls[1 + 2 * tiles:] == [("sum", (B * T, H))]


def test_bad_shards_are_refused_on_every_rank():
    """Shards with a gap or an overlap or not starting at 0, one rank's weight of another width than its shard, ranks
    scoring different numbers of tokens or as many but different labels, labels outside the whole vocabulary, a
    backend without a vocabulary-parallel schedule: every rank raises the same error (each sees every rank's layout:
    none is left waiting at a collective)."""
    hidden, weight, _, labels = make_inputs(10, seed=1)
    bad = labels.clone()
    bad[0, 4] = 10
    fewer = labels.clone()
    fewer[0, 3] = -100
    other = labels.clone()  # as many tokens, one label another id
    other[0, 3] = (other[0, 3] + 1) % 10

    def errors(bounds, labels_of=lambda r: labels, rows_of=lambda r, bounds: bounds, **kw) -> list:
        def rank(r, group):
            start, stop = bounds[r]
            try:
                linear_cross_entropy(hidden, weight[slice(*rows_of(r, bounds[r]))], labels_of(r),
                                     vocab_parallel=(start, stop, group), **kw)
            except ValueError as e:
                return e
        return run_ranks(len(bounds), rank)[0]

    cases = {
        "a gap at row 4": errors([(0, 4), (5, 10)]),
        "an overlap at row 4": errors([(0, 5), (4, 10)]),
        "a gap at row 0": errors([(1, 5), (5, 10)]),
        r"rank 0's weight has 4 rows but its VocabShard is \[0, 5\)": errors(
            [(0, 5), (5, 10)], rows_of=lambda r, rows: (0, 4) if r == 0 else rows),
        "different numbers of tokens": errors([(0, 5), (5, 10)], labels_of=lambda r: fewer if r else labels),
        "score different labels": errors([(0, 5), (5, 10)], labels_of=lambda r: other if r else labels),
        "labels contain 10, outside \\[0, 10\\)": errors([(0, 5), (5, 10)], labels_of=lambda r: bad),
        "backend='quack' has no vocabulary-parallel schedule": errors([(0, 5), (5, 10)], backend="quack"),
    }
    for message, raised in cases.items():
        assert all(isinstance(e, ValueError) for e in raised), (message, raised)
        for e in raised:
            assert re.search(message, str(e)), (message, str(e))
    with pytest.raises(TypeError, match="VocabShard or a"):
        linear_cross_entropy(hidden, weight, labels, vocab_parallel=(0, 10))
    with pytest.raises(ValueError, match="start <= stop"):
        VocabShard(5, 4)
    with pytest.raises(TypeError, match="VocabShard.group must be a torch.distributed process group"):
        linear_cross_entropy(hidden, weight, labels, vocab_parallel=(0, 10, "tp"))  # was AttributeError in size()


# -- gloo ranks ---------------------------------------------------------------------------------------------------


def _gloo_rank(rank: int, world: int, init_file: str, mesh_shape: tuple[int, int], dtensor: bool) -> None:
    """A spawned process: rank ``rank`` of ``world`` over gloo, the ranks laid out as a ``mesh_shape`` = (data
    parallel, tensor parallel) grid; each data-parallel row has its own batch and shards its vocabulary over its
    tensor-parallel group. Checks every op, fp32 and bf16, against float64 and the unsharded op, and, with
    ``dtensor``, that a DTensor weight given to an op is refused with the way to pass it."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        dp, tp = mesh_shape
        groups = [dist.new_group([row * tp + c for c in range(tp)]) for row in range(dp)]  # every rank makes each
        row, col = divmod(rank, tp)
        vocab = 31
        bounds = chunk_bounds(vocab, tp)
        inputs = make_inputs(vocab, seed=20 + row)
        for op in ("cross_entropy", "cross_entropy_none", "logprobs", "logprobs_hint", "token_loss"):
            for dtype in (torch.float32, torch.bfloat16):
                got = run_op(op, inputs, bounds[col], groups[row], dtype=dtype, max_width=bounds[0][1])
                what = f"{op} {dtype} rank {rank} (dp {row}, tp {col} of {tp})"
                grad_tol = RTOL if dtype == torch.float32 else BF16_GRAD_TOL
                assert_rank_matches(got, dense_op(op, inputs, dtype), bounds[col], what + " vs float64",
                                    grad_tol=grad_tol)
                if dtype == torch.float32:
                    assert_rank_matches(got, run_op(op, inputs, dtype=dtype), bounds[col], what + " vs unsharded")
        if not dtensor:
            return
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        weight = distribute_tensor(inputs[1], mesh, [Shard(0)])
        try:
            linear_cross_entropy(inputs[0], weight, inputs[3])
        except TypeError as e:
            assert "vocab_parallel=VocabShard" in str(e) and "DTensor" in str(e), e
        else:
            raise AssertionError("a DTensor weight was not refused")
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.parametrize("mesh_shape", [(1, 2), (1, 3), (2, 2)], ids=["tp2", "tp3", "dp2xtp2"])
def test_gloo_ranks_match_float64(mesh_shape):
    """The ops on real ranks (processes over gloo): 2 and 3 tensor-parallel ranks (a vocabulary of 31: shards
    16/15 and 11/11/9), and a 2 × 2 mesh whose two data-parallel rows hold different batches (only the
    tensor-parallel dimension splits the vocabulary). Every op, fp32 and bf16, against float64 and the unsharded op
    on each rank; with 2 ranks, a DTensor weight is refused."""
    import torch.multiprocessing as mp

    world = mesh_shape[0] * mesh_shape[1]
    # The refusal reads the weight's placements before anything else (hf_fused.ops.prepare._refuse_dtensors): the
    # same path on any mesh, checked once (DTensor's import and a device mesh cost each rank about 2 s).
    dtensor = mesh_shape == (1, 2)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_gloo_rank, args=(world, os.path.join(tmp, "init"), mesh_shape, dtensor), nprocs=world, join=True)
