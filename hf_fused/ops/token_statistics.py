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
    with autocast_off(hidden2d.device.type):
        weight32 = weight.float()
        bias32 = None if bias is None else bias.float()
        for idx in tiles(rows, rows_per_tile(vocab, tile_budget_bytes)):
            raw = hidden2d.index_select(0, idx).float() @ weight32.t()
            if bias32 is not None:
                raw += bias32
            z, _ = transform.forward(raw)
            if "mean_logits" in out:
                out["mean_logits"][idx] = z.mean(-1)
            if "log_sum_sq_probs" in out:
                out["log_sum_sq_probs"][idx] = torch.logsumexp(2 * z, -1) - 2 * torch.logsumexp(z, -1)
            if "is_top1" in out:
                out["is_top1"][idx] = _label_is_first_argmax(z, flat.labels.index_select(0, idx))
    return {name: value.view(flat.batch_shape) for name, value in out.items()}


def _label_is_first_argmax(z: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # ``argmax`` returns the first maximum, so a tie with an earlier token does not count (TRL's convention).
    return z.argmax(-1) == labels

