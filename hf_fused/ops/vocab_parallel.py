"""Vocabulary-parallel heads: the shard a rank holds (:class:`VocabShard`), its check against the other ranks'
(:func:`resolve_vocab_shard`), the O(rows) merge of a tile's per-row statistics over the tensor-parallel group
(:func:`merged_tile_statistics`) and the autograd boundary that sums the hidden states' gradient over it
(:func:`sum_gradient_over`).

Under tensor parallelism lm_head's weight is split over the vocabulary: rank ``r`` holds rows ``[start, stop)``
of the ``[V, H]`` weight (transformers' ``colwise_gather_output``, torch's ``ColwiseParallel``: a ``Shard(0)``
DTensor). Each rank computes the logits of its slice only; per token tile the ranks exchange, for each row, the
values every statistic of the full row is a sum or a maximum of (Megatron-LM's vocab-parallel cross-entropy,
``megatron/core/tensor_parallel/cross_entropy.py``, does the same for the loss alone). With ``z`` a row's
logits, ``m`` their maximum over all ranks, ``t = z − m`` and ``e = exp(t)`` on this rank's slice ``S``::

    MAX over ranks:  m = max_r max_{j∈S_r} z_j
    SUM over ranks:  s = Σ_S e_j                      lse = m + log s
                     a = t_y if y ∈ S else 0          logp_y = a − log s
                     b = Σ_S e_j t_j                  H = log s − b / s           (H = lse − Σ p z)
                     c = Σ_S z_j                      mean_logits = c / V
                     d = Σ_S e_j²                     log Σ p² = log d − 2 log s
                     u = 1[y ∈ S and t_y = 0]         is_top1 = u > 0 and w = 0 (arg-max returns the first maximum)
                     w = 1[max_S z = m and first arg-max of S < y]

so a tile costs one all-reduce MAX of ``[rows]`` and one all-reduce SUM of ``[k, rows]`` (``k`` ≤ 7), nothing of
size ``[rows, V]``. Once ``lse`` (and ``H``) are known, the logits gradient of every rank's slice is local
(``dz_j = g_lp·(1[j = y] − p_j) − g_H·p_j·(log p_j + H)``): the weight gradient of a rank is its own rows, and
the hidden states' gradient is a sum of every rank's part, which :func:`sum_gradient_over` all-reduces once per
backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Sequence, Union

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class VocabShard:
    """The vocabulary rows ``[start, stop)`` of lm_head that this rank holds, and the group of ranks that hold the
    rest (each rank passes its own).

    start, stop: ints with ``0 ≤ start ≤ stop``; ``stop − start`` is the number of rows of the weight the op is
        given (an empty slice is allowed: ``torch.chunk`` leaves the last ranks of a small vocabulary none).
    group: the tensor-parallel ``torch.distributed`` process group (``None``: the default group), or an object
        with ``size()``, ``rank()``, ``all_reduce(tensor, op)`` (``op`` ``"sum"`` or ``"max"``, in place) and
        ``all_gather(tensor) -> list`` (an in-process group of threads, for tests).

    The slices of the group's ranks must tile ``[0, V)`` without gap or overlap, in any rank order; the ops check
    it (:func:`resolve_vocab_shard`). :func:`hf_fused.model.tensor_parallel.vocab_parallel_head` builds the shard
    of a ``Shard(0)`` DTensor weight from its own layout.

    Raises:
        TypeError: ``start`` or ``stop`` not an int; ``group`` neither ``None``, a process group nor an object with
            the four methods above.
        ValueError: ``start < 0`` or ``stop < start``.
    """

    start: int
    stop: int
    group: Any = None

    def __post_init__(self) -> None:
        for name in ("start", "stop"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"VocabShard.{name} must be an int (a vocabulary row), got {value!r}")
        if self.start < 0 or self.stop < self.start:
            raise ValueError(f"VocabShard needs 0 <= start <= stop, got start={self.start}, stop={self.stop}")
        if not _is_process_group(self.group) and not all(
                callable(getattr(self.group, m, None)) for m in ("size", "rank", "all_reduce", "all_gather")):
            raise TypeError(f"VocabShard.group must be a torch.distributed process group (None: the default one) or "
                            f"an object with size(), rank(), all_reduce() and all_gather(), got {self.group!r}")

    @property
    def width(self) -> int:
        """``stop − start``: the rows of the weight this rank holds."""
        return self.stop - self.start


#: What the ops' ``vocab_parallel=`` takes: a :class:`VocabShard` or a ``(start, stop, group)`` tuple.
VocabParallel = Union[VocabShard, tuple]


def as_vocab_shard(vocab_parallel) -> VocabShard:
    """``vocab_parallel`` as a :class:`VocabShard`: one already, or a ``(start, stop, group)`` tuple.

    Raises:
        TypeError: anything else.
    """
    if isinstance(vocab_parallel, VocabShard):
        return vocab_parallel
    if isinstance(vocab_parallel, tuple) and len(vocab_parallel) == 3:
        return VocabShard(*vocab_parallel)
    raise TypeError(
        f"vocab_parallel must be a VocabShard or a (start, stop, group) tuple, got {vocab_parallel!r}"
    )


# -- the group's collectives -------------------------------------------------------------------------------------

def _is_process_group(group) -> bool:
    return group is None or (dist.is_available() and isinstance(group, dist.ProcessGroup))


def group_size(group) -> int:
    """The number of ranks in ``group`` (a process group, ``None`` for the default one, or an in-process group)."""
    return dist.get_world_size(group) if _is_process_group(group) else group.size()


def all_reduce_(tensor: torch.Tensor, op: str, group) -> torch.Tensor:
    """``tensor`` reduced in place over ``group`` (``op``: ``"sum"`` or ``"max"``), returned."""
    if _is_process_group(group):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
    else:
        group.all_reduce(tensor, op)
    return tensor


def _all_gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    if _is_process_group(group):
        out = [torch.empty_like(tensor) for _ in range(group_size(group))]
        dist.all_gather(out, tensor, group=group)
        return out
    return group.all_gather(tensor)


# -- the layout of every rank's slice ----------------------------------------------------------------------------

@dataclass(frozen=True)
class VocabLayout:
    """A :class:`VocabShard` checked against the group's other shards: what the vocabulary-parallel tile loop needs.

    shard: this rank's.  vocab_size: ``V``, the whole vocabulary.  max_width: the widest rank's rows (every rank
    tiles its rows by it, so that all run the same tiles and meet at the same collectives).  ranks: the group's size.
    min_width: the narrowest rank's rows (0 where ``torch.chunk`` leaves a rank none; every rank chooses its
    schedule from the same layout).
    """

    shard: VocabShard
    vocab_size: int
    max_width: int
    ranks: int
    min_width: int = 0

    @property
    def group(self):
        return self.shard.group

    @property
    def sharded(self) -> bool:
        """Whether more than one rank holds the vocabulary (else the op is the ordinary one on this rank's head)."""
        return self.ranks > 1


def resolve_vocab_shard(shard: VocabShard, weight: torch.Tensor, kept: torch.Tensor,
                        labels: Optional[torch.Tensor] = None) -> VocabLayout:
    """Check ``shard`` against ``weight`` (``[stop − start, H]``) and the group's other shards, and return the
    layout. Every rank of the group must call it with its own shard (a collective: one all-gather of five ints per
    rank and one host sync): each rank's weight must have its shard's rows, the shards must tile ``[0, V)``, and
    every rank must score the same tokens (``kept``: the ``[N]`` bool mask of non-ignored labels, whose count is
    compared; ``labels``: the ``[N]`` int64 labels, whose position-weighted sum is compared), or the tile loops would
    pair unrelated collectives or merge unrelated rows. Every rank sees every rank's numbers, so a bad layout raises
    on all of them (none is left waiting at a collective). A group of one rank needs no collective.

    Raises:
        ValueError: a rank's weight rows differ from its shard's width; the group's shards leave a gap or overlap
            or do not start at 0; the ranks score different numbers of tokens or different labels (the
            tensor-parallel ranks of one data-parallel replica see the same batch: a rank of another replica is in
            the group, or a trainer handed the ranks different rows).
    """
    ranks = group_size(shard.group)
    if ranks == 1:
        bounds = [(shard.start, shard.stop, 0, weight.shape[0], 0)]
    else:
        mine = torch.tensor([shard.start, shard.stop, 0, weight.shape[0], 0], dtype=torch.int64, device=kept.device)
        mine[2] = kept.sum()
        if labels is not None:
            mine[4] = _labels_fingerprint(labels, kept)
        bounds = torch.stack(_all_gather(mine, shard.group)).tolist()  # the one host sync
    return _layout(shard, bounds, ranks)


def _labels_fingerprint(labels: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``Σ_i y_i·(i mod 1021 + 1)`` over the ``[N]`` labels (−1 where ignored), int64: equal on ranks holding the
    same labels, and it differs where one label moves or changes (< 2^63 for N·V < 2^53)."""
    weights = torch.arange(labels.numel(), device=labels.device).remainder_(1021).add_(1)
    return (torch.where(kept, labels, -1) * weights).sum()


def _layout(shard: VocabShard, bounds: Sequence[Sequence[int]], ranks: int) -> VocabLayout:
    """The layout from every rank's ``(start, stop, kept tokens, weight rows, labels' fingerprint)``; raises as
    :func:`resolve_vocab_shard`."""
    fingerprints = [b[4] for b in bounds]
    bounds = [tuple(b[:4]) for b in bounds]
    wrong = [(r, start, stop, rows) for r, (start, stop, _, rows) in enumerate(bounds) if rows != stop - start]
    if wrong:
        r, start, stop, rows = wrong[0]
        raise ValueError(
            f"vocab_parallel: rank {r}'s weight has {rows} rows but its VocabShard is [{start}, {stop}) "
            f"({stop - start} rows); pass each rank's local shard of lm_head.weight (DTensor.to_local()) with the "
            "slice it holds"
        )
    counts = sorted({kept for _, _, kept, _ in bounds})
    if len(counts) > 1:
        raise ValueError(
            f"vocab_parallel: the ranks of the tensor-parallel group score different numbers of tokens {counts}; "
            "every rank of a vocabulary-sharded head must get the same hidden states and labels (pass the "
            "tensor-parallel group, not one spanning data-parallel replicas)"
        )
    if len(set(fingerprints)) > 1:
        raise ValueError(
            "vocab_parallel: the ranks of the tensor-parallel group score different labels (as many tokens, other "
            "ids or positions); every rank of a vocabulary-sharded head must get the same hidden states and labels "
            "(pass the tensor-parallel group, not one spanning data-parallel replicas, and give its ranks one batch)"
        )
    position = 0
    for start, stop in sorted((start, stop) for start, stop, _, _ in bounds):
        if start != position:
            raise ValueError(
                f"vocab_parallel: the group's vocabulary shards {[(a, b) for a, b, _, _ in bounds]} (by rank) do not "
                f"tile [0, V): {'a gap' if start > position else 'an overlap'} at row {min(start, position)}"
            )
        position = stop
    widths = [stop - start for start, stop, _, _ in bounds]
    return VocabLayout(shard, position, max(widths), ranks, min(widths))


# -- the hidden states' gradient ---------------------------------------------------------------------------------

class _SumGradient(torch.autograd.Function):
    """Forward: ``hidden`` in fp32 (a view when it is fp32 already); backward: the fp32 gradient summed over the
    group, then rounded once to hidden's dtype. Each rank's head computes the hidden states' gradient of its own
    vocabulary slice, and the hidden states (replicated over the group) need the sum (Megatron-LM's
    ``copy_to_tensor_model_parallel_region``); handing the op fp32 states (the same values: the op computes its
    logits in fp32 from whatever operands it gets) lets the partial gradients be summed before their rounding,
    instead of rounding each rank's part to bf16 first."""

    @staticmethod
    def forward(ctx, hidden, group):
        ctx.group, ctx.dtype = group, hidden.dtype
        return hidden.float() if hidden.dtype != torch.float32 else hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        summed = all_reduce_(grad.to(torch.float32, memory_format=torch.contiguous_format, copy=True), "sum",
                             ctx.group)
        return summed.to(ctx.dtype), None


def sum_gradient_over(hidden: torch.Tensor, layout: Optional[VocabLayout]) -> torch.Tensor:
    """``hidden`` whose gradient is summed over ``layout``'s group in backward, in fp32 (``hidden`` itself when the
    head is not sharded or no gradient is recorded)."""
    if layout is None or not layout.sharded or not (hidden.requires_grad and torch.is_grad_enabled()):
        return hidden
    return _SumGradient.apply(hidden, layout.group)


# -- a tile's statistics, merged over the group ------------------------------------------------------------------

#: The token statistics :func:`merged_tile_statistics` merges (``hf_fused.ops.token_statistics.TOKEN_STATISTICS``).
MERGED_STATISTICS = ("mean_logits", "is_top1", "log_sum_sq_probs")


class TileStatistics(NamedTuple):
    """A tile's per-row statistics over the whole vocabulary (fp32 ``[r]``), and this rank's slice of the tile
    ready for the gradient.

    lse, logprobs: ``logsumexp(z)`` and ``z_y − lse``.  entropy: ``−Σ p log p`` or ``None`` unless asked.
    statistics: ``{name: [r]}`` for the names asked (``is_top1`` bool).
    log_probs: the tile's ``[r, width]`` ``log p_j`` on this rank's slice (in the logits' storage).
    probs: ``[r, width]`` ``p_j``, or ``None`` unless asked.
    """

    lse: torch.Tensor
    logprobs: torch.Tensor
    entropy: Optional[torch.Tensor]
    statistics: dict
    log_probs: torch.Tensor
    probs: Optional[torch.Tensor]


def merged_tile_statistics(z: torch.Tensor, labels: torch.Tensor, layout: VocabLayout, *, entropy: bool = False,
                           statistics: Sequence[str] = (), probs: bool = False) -> TileStatistics:
    """The statistics of a tile's rows over the whole vocabulary, from this rank's slice ``z`` (fp32
    ``[r, width]`` logits after the logit transform, overwritten) and the rows' global ``labels`` (``[r]`` int64 in
    ``[0, V)``): one all-reduce MAX of ``[r]`` and one all-reduce SUM of ``[k, r]`` over the group (the formulas in
    the module docstring). Every rank of the group calls it for the same rows.

    ``entropy``: compute the entropy.  ``statistics``: names among :data:`MERGED_STATISTICS`.  ``probs``: also leave
    ``p`` (for a gradient; its tile is the sum-exp's, divided in place)."""
    shard = layout.shard
    rows, width = z.shape
    if width:
        local_max, first = z.max(1)  # max returns the first maximum's index, as argmax does
    else:
        local_max = z.new_full((rows,), -math.inf)
        first = torch.zeros(rows, dtype=torch.int64, device=z.device)
    m = all_reduce_(local_max.clone(), "max", layout.group)
    # the logits' own sum, before the shift: Σ (z − m) carries fp32's rounding of |S|·m into a mean that cancels near
    # 0 (TRL's logged logits/rejected 1.1e-5 off under tensor parallelism: tests/distributed/test_tensor_parallel.py)
    raw_sum = z.sum(1) if "mean_logits" in statistics else None
    t = z.sub_(m.unsqueeze(1))  # ≤ 0, the row maximum 0 exactly
    e = t.exp()
    own = (labels >= shard.start) & (labels < shard.stop)
    local_label = (labels - shard.start).clamp_(0, max(width - 1, 0)).unsqueeze(1)
    zero = t.new_zeros(())
    label_t = torch.where(own, t.gather(1, local_label).squeeze(1), zero) if width else t.new_zeros(rows)
    columns = [e.sum(1), label_t]
    if entropy:
        columns.append(_row_dot(e, t))
    if raw_sum is not None:
        columns.append(raw_sum)
    if "log_sum_sq_probs" in statistics:
        columns.append(_row_dot(e, e))
    if "is_top1" in statistics:
        columns.append((own & (label_t == 0)).float())
        columns.append(((local_max == m) & (first + shard.start < labels)).float())
    sums = all_reduce_(torch.stack(columns), "sum", layout.group)
    s, log_s = sums[0], sums[0].log()
    lse, logprobs = m + log_s, sums[1] - log_s
    k = 2
    ent = None
    if entropy:
        ent, k = log_s - sums[k] / s, k + 1
    merged = {}
    if "mean_logits" in statistics:
        merged["mean_logits"], k = sums[k] / layout.vocab_size, k + 1
    if "log_sum_sq_probs" in statistics:
        merged["log_sum_sq_probs"], k = sums[k].log() - 2 * log_s, k + 1
    if "is_top1" in statistics:
        merged["is_top1"] = (sums[k] > 0) & (sums[k + 1] == 0)
    log_probs = t.sub_(log_s.unsqueeze(1))
    p = e.div_(s.unsqueeze(1)) if probs else None
    return TileStatistics(lse, logprobs, ent, {name: merged[name] for name in statistics}, log_probs, p)


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``Σ_j a_ij b_ij`` per row, without an ``[r, width]`` temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(a.shape[0])


def label_gradient_(dz: torch.Tensor, labels: torch.Tensor, shard: VocabShard, g_lp: torch.Tensor) -> torch.Tensor:
    """``dz[i, y_i − start] += g_lp[i]`` for the rows whose label ``y_i`` is in this rank's slice (the ``1[j = y]``
    term of ``∂logp_y/∂z_j``), in place."""
    if dz.shape[1]:
        own = (labels >= shard.start) & (labels < shard.stop)
        local_label = (labels - shard.start).clamp_(0, dz.shape[1] - 1).unsqueeze(1)
        dz.scatter_add_(1, local_label, torch.where(own, g_lp, g_lp.new_zeros(())).unsqueeze(1))
    return dz

