"""Per-token statistics of the next-token distribution that carry no gradient (metrics), tile by tile.

TRL's trainers log them from its fused head (``trl.trainer.utils.FusedCausalLMOutput``): the mean logit
(DPO/KTO ``logits/*``), whether the label is the arg-max (``mean_token_accuracy``) and ``log Σ_v p_v²``
(DPO's WPO weighting). Per token with logits ``z`` (after the logit transform, see
:class:`~hf_fused.ops.LogitTransform`) over a vocabulary of size ``V`` and label ``y``::

    mean_logits      = (1/V) Σ_v z_v
    is_top1          = z_y ≥ max_v z_v  and  z_y > max_{v<y} z_v     # arg-max returns the first maximum
    log_sum_sq_probs = log Σ_v exp(2 z_v − 2 lse) = logsumexp(2z) − 2·logsumexp(z)

None of them can be recovered from ``logsumexp``, the label's log-probability and the entropy, so they
cost one more pass over the logits (2·N·H·V FLOPs), and only when asked for.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .head_inputs import flatten_head_inputs
from .logit_transform import LogitTransform
from .precision import autocast_off, cast_like_linear
from .tiling import rows_per_tile, tiles, valid_rows

#: The statistics :func:`linear_token_statistics` computes, by name.
TOKEN_STATISTICS = ("mean_logits", "is_top1", "log_sum_sq_probs")

#: Vocabulary columns per matmul: the fp32 copy of lm_head's weight exists one chunk at a time (TRL's width).
VOCAB_CHUNK = 32768


@torch.no_grad()
def linear_token_statistics(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    statistics: Sequence[str] = TOKEN_STATISTICS,
    ignore_index: int = -100,
    temperature: float = 1.0,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    tile_budget_bytes: Optional[int] = None,
) -> dict[str, torch.Tensor]:
    """The requested per-token statistics (module docstring) under the logits of ``hidden @ weight.T + bias``,
    never materializing the ``[N, V]`` logits. No gradient flows through them.

    Args:
        hidden: ``[..., H]`` hidden states aligned with ``labels``.  weight: ``[V, H]``.  bias: optional ``[V]``.
        labels: ``[...]`` ids in ``[0, V)`` or ``ignore_index`` (only ``is_top1`` reads them; every statistic is
            computed only on non-ignored positions).
        statistics: names among :data:`TOKEN_STATISTICS`.
        temperature, softcap, logit_scale, tile_budget_bytes: as in :func:`~hf_fused.ops.linear_logprobs`.

    Returns:
        ``{name: [...] tensor}``: ``mean_logits`` and ``log_sum_sq_probs`` fp32, ``is_top1`` bool; 0 / False at
        ignored positions.

    Mixed precision: operands cast as ``F.linear`` would be under autocast, logits computed in fp32 from them
    (as :func:`~hf_fused.ops.linear_logprobs`).

    Raises:
        ValueError: an unknown statistic name; and as :func:`~hf_fused.ops.linear_logprobs` for bad inputs.
    """
    unknown = [s for s in statistics if s not in TOKEN_STATISTICS]
    if unknown:
        raise ValueError(f"unknown token statistics {unknown}; choose among {TOKEN_STATISTICS}")
    transform = LogitTransform(logit_scale=logit_scale, softcap=softcap, temperature=temperature)
    flat = flatten_head_inputs(hidden, weight, labels, bias, ignore_index)
    rows = valid_rows(flat.labels, ignore_index)
    hidden2d, weight, bias = cast_like_linear(flat.hidden, flat.weight, flat.bias)
    n, vocab = flat.labels.numel(), weight.shape[0]
    out = {
        name: hidden2d.new_zeros(n, dtype=torch.bool if name == "is_top1" else torch.float32)
        for name in statistics
    }
    chunk = min(vocab, VOCAB_CHUNK)
    with autocast_off(hidden2d.device.type):
        for idx in tiles(rows, rows_per_tile(chunk, tile_budget_bytes)):
            stats = _RowStatistics(hidden2d.index_select(0, idx).float(), flat.labels.index_select(0, idx))
            for start in range(0, vocab, chunk):
                # fp32 logits from the (possibly bf16) operands, one vocabulary chunk at a time: no fp32 [V, H] copy.
                raw = stats.hidden @ weight[start : start + chunk].float().t()
                if bias is not None:
                    raw += bias[start : start + chunk].float()
                stats.add(transform.forward(raw)[0], start)
            for name in statistics:
                out[name][idx] = stats.result(name, vocab)
    return {name: value.view(flat.batch_shape) for name, value in out.items()}


class _RowStatistics:
    """Online reductions over vocabulary chunks for one tile of rows: ``Σ z``, the first arg-max, and the
    log-sum-exp of ``z`` and of ``2z`` (each a running maximum plus a rescaled sum, as in any online softmax)."""

    def __init__(self, hidden32: torch.Tensor, labels: torch.Tensor):
        self.hidden, self.labels = hidden32, labels
        rows = labels.numel()
        self.sum = hidden32.new_zeros(rows)
        self.max = hidden32.new_full((rows,), -float("inf"))
        self.argmax = torch.zeros_like(labels)
        self.lse = hidden32.new_full((rows,), -float("inf"))
        self.lse2 = hidden32.new_full((rows,), -float("inf"))

    def add(self, z: torch.Tensor, start: int) -> None:
        self.sum += z.sum(-1)
        chunk_max, chunk_arg = z.max(-1)  # the first maximum within the chunk
        better = chunk_max > self.max  # strictly: an earlier chunk keeps a tie (arg-max returns the first)
        self.argmax = torch.where(better, chunk_arg + start, self.argmax)
        self.max = torch.maximum(self.max, chunk_max)
        self.lse = torch.logaddexp(self.lse, torch.logsumexp(z, -1))
        self.lse2 = torch.logaddexp(self.lse2, torch.logsumexp(2 * z, -1))

    def result(self, name: str, vocab: int) -> torch.Tensor:
        if name == "mean_logits":
            return self.sum / vocab
        if name == "log_sum_sq_probs":
            return self.lse2 - 2 * self.lse
        return self.argmax == self.labels  # is_top1
