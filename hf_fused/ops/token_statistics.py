"""Per-token statistics of the next-token distribution that carry no gradient (TRL's fused-head metrics): their
names, the checks of a request, and :func:`linear_token_statistics`, the gradient-free op that computes them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional, Sequence

import torch

from .logit_transform import LogitTransform
from .precision import autocast_off
from .prepare import prepare
from .vocab_parallel import VocabParallel

#: The token statistics the ops compute, by name (TRL's ``FusedCausalLMOutput`` field names).
TOKEN_STATISTICS = ("mean_logits", "is_top1", "log_sum_sq_probs")


def check_statistics(statistics: Sequence[str]) -> tuple[str, ...]:
    """``statistics`` as a tuple of distinct names, in the order given.

    Raises:
        TypeError: a single string instead of a sequence of names, or no sequence at all.
        ValueError: a name not in :data:`TOKEN_STATISTICS`.
    """
    if isinstance(statistics, str):
        raise TypeError(f"statistics must be a sequence of names, e.g. ({statistics!r},), not a string")
    if not isinstance(statistics, Iterable):
        raise TypeError(f"statistics must be a sequence of names among {TOKEN_STATISTICS}, got {statistics!r}")
    names = tuple(dict.fromkeys(statistics))
    unknown = [s for s in names if s not in TOKEN_STATISTICS]
    if unknown:
        raise ValueError(f"unknown token statistics {unknown}; choose among {TOKEN_STATISTICS}")
    return names


def per_token_statistics(row_stats: dict[str, torch.Tensor], rows: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
    """``{name: [N]}`` from the kept rows' ``{name: [M]}`` (in the order of ``rows``): 0 / ``False`` at ignored rows."""
    return {name: value.new_zeros(n).index_copy_(0, rows, value) for name, value in row_stats.items()}


def linear_token_statistics(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    statistics: Sequence[str] = TOKEN_STATISTICS,
    ignore_index: int = -100,
    transform: Optional[LogitTransform] = None,
    temperature: float = 1.0,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    tile_budget_bytes: Optional[int] = None,
    backend: Optional[str] = None,
    vocab_parallel: Optional[VocabParallel] = None,
) -> dict[str, torch.Tensor]:
    """The requested per-token statistics under the logits of ``hidden @ weight.T + bias``, never materializing
    the ``[N, V]`` logits, for metrics only: the statistics forward of :func:`~hf_fused.ops.linear_logprobs`
    without gradients (one pass, 2·N·H·V FLOPs). When the log-probs are needed too, call
    ``linear_logprobs(..., statistics=...)`` instead: one pass gives both.

    TRL's trainers log them from its fused head (``trl.trainer.utils.FusedCausalLMOutput``): the mean logit
    (DPO/KTO ``logits/*``), whether the label is the arg-max (``mean_token_accuracy``) and ``log Σ_v p_v²``
    (DPO's WPO weighting). Per token with logits ``z`` (after the logit transform, see
    :class:`~hf_fused.ops.LogitTransform`) over a vocabulary of size ``V`` and label ``y``::

        mean_logits      = (1/V) Σ_v z_v
        is_top1          = z_y ≥ max_v z_v  and  z_y > max_{v<y} z_v     # arg-max returns the first maximum
        log_sum_sq_probs = log Σ_v exp(2 z_v − 2 lse) = logsumexp(2z) − 2·logsumexp(z)

    None of them can be recovered from ``logsumexp``, the label's log-probability and the entropy, but each is
    an online reduction over the same logits tiles, which every backend computes in its forward passes when asked
    (:mod:`~hf_fused.ops.backends.protocol`).

    Args:
        hidden: ``[..., H]`` hidden states (fp32/bf16/fp16) aligned with ``labels``.
        weight: ``[V, H]`` lm_head weight on ``hidden``'s device.  bias: optional ``[V]``, floating point.
        labels: ``[...]`` ids in ``[0, V)`` or ``ignore_index`` (only ``is_top1`` reads them; every statistic is
            computed only on non-ignored positions).
        statistics: names among :data:`TOKEN_STATISTICS`.
        transform, temperature, softcap, logit_scale, tile_budget_bytes, backend, vocab_parallel: as in
            :func:`~hf_fused.ops.linear_logprobs`.

    Returns:
        ``{name: [...] tensor}``: ``mean_logits`` and ``log_sum_sq_probs`` fp32, ``is_top1`` bool; 0 / False at
        ignored positions. No gradient flows through them.

    Mixed precision: as :func:`~hf_fused.ops.linear_logprobs` (the same logits as its log-probs).

    Raises:
        ValueError / TypeError: an unknown statistic name, a string instead of a sequence of names; and as
            :func:`~hf_fused.ops.linear_logprobs` for bad inputs.
    """
    names = check_statistics(statistics)
    with torch.no_grad():
        prepared = prepare(hidden, weight, labels, bias, ignore_index=ignore_index, transform=transform,
                           temperature=temperature, softcap=softcap, logit_scale=logit_scale,
                           tile_budget_bytes=tile_budget_bytes, backend=backend, vocab_parallel=vocab_parallel)
        head = prepared.head
        with autocast_off(head.hidden.device.type):
            row_stats = prepared.backend.logprobs_forward(head, statistics=names).statistics
        stats = per_token_statistics(row_stats, prepared.rows, prepared.labels.numel())
    return {name: prepared.shaped(stats[name]) for name in names}
