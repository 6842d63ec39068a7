"""The teacher's side of sparse distillation: each token's ``k`` most likely next tokens and their log-probs
(:func:`linear_topk_logprobs`), from hidden states and lm_head tile by tile, never materializing ``[N, V]``
logits."""

from __future__ import annotations

import operator
from typing import NamedTuple, Optional

import torch

from .logit_transform import LogitTransform
from .precision import autocast_off
from .prepare import prepare
from .tiling import rows_per_tile


class TopKLogprobs(NamedTuple):
    """What :func:`linear_topk_logprobs` returns (detached).

    ids: int64 ``[..., k]``, each token's ``k`` most likely next-token ids, most likely first.
    logprobs: fp32 ``[..., k]``, their log-probs under the full-vocabulary distribution (not renormalized over
        the ``k``).
    label_logprobs: fp32 ``[...]``, the log-prob of each token's label (0 where it is ``ignore_index``), or ``None``
        without ``labels``.
    """

    ids: torch.Tensor
    logprobs: torch.Tensor
    label_logprobs: Optional[torch.Tensor]


def _check_k(k, vocab_size: int) -> int:
    try:
        index = operator.index(k)
    except TypeError:
        raise TypeError(f"k must be an int (candidates per token), got {k!r}") from None
    if isinstance(k, bool) or not 1 <= index <= vocab_size:
        raise ValueError(f"k must be in [1, V = {vocab_size}] (candidates per token), got {k!r}")
    return index


@torch.no_grad()
def linear_topk_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    bias: Optional[torch.Tensor] = None,
    *,
    labels: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    transform: Optional[LogitTransform] = None,
    temperature: float = 1.0,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    tile_budget_bytes: Optional[int] = None,
    backend: Optional[str] = None,
) -> TopKLogprobs:
    """Each token's ``k`` most likely next tokens and their log-probs under the logits of
    ``hidden @ weight.T + bias``, computed tile by tile (each tile's full-vocabulary rows: log-sum-exp, then
    ``topk``), never materializing the ``[N, V]`` logits: what a teacher writes for offline top-k distillation
    (``examples/topk_dataset.py``) and what :func:`~hf_fused.ops.sparse_distillation_loss` reads.

    Logits as in :func:`~hf_fused.ops.linear_logprobs`: ``z = (h·Wᵀ + b)·logit_scale``, then
    ``softcap·tanh(z/softcap)``, then ``/temperature``, in fp32 from the operands ``F.linear`` would use (autocast's
    casts apply); ``logprobs = topk(z) − logsumexp(z)``, from ``z − max z`` as ``log_softmax`` computes them (a
    log-prob near 0 keeps its fp32 digits). Ties between logits are ordered as ``torch.topk`` orders them. No
    gradient (a teacher's output).

    Args:
        hidden: ``[..., H]`` hidden states (fp32/bf16/fp16).  weight: ``[V, H]``.  bias: optional ``[V]``.
        k: candidates per token, in ``[1, V]``.
        labels: optional ``[...]`` ids in ``[0, V)`` or ``ignore_index``: also return each label's log-prob (the
            sampled token's, which TRL's trainers add to the support when it is not among the top k).
        ignore_index: the label value with no log-prob.
        transform, temperature, softcap, logit_scale, tile_budget_bytes, backend: as in
            :func:`~hf_fused.ops.linear_cross_entropy` (``rows_per_tile`` rows per tile within the budget; every
            backend runs this plain-PyTorch pass).

    Returns:
        :class:`TopKLogprobs` ``(ids, logprobs, label_logprobs)``.

    Raises:
        TypeError: a non-integer ``k``; as :func:`~hf_fused.ops.linear_cross_entropy` for the tensors.
        ValueError: ``k`` outside ``[1, V]``; as :func:`~hf_fused.ops.linear_cross_entropy` (shapes, devices,
            labels out of range, transform, tile budget, backend).
    """
    token_labels = labels
    if labels is None and isinstance(hidden, torch.Tensor) and hidden.dim() >= 1:
        token_labels = torch.zeros(hidden.shape[:-1], dtype=torch.long, device=hidden.device)
    prepared = prepare(hidden, weight, token_labels, bias, ignore_index=ignore_index, transform=transform,
                       temperature=temperature, softcap=softcap, logit_scale=logit_scale,
                       tile_budget_bytes=tile_budget_bytes, backend=backend)
    head = prepared.head
    vocab_size = head.weight.shape[0]
    k = _check_k(k, vocab_size)
    n = head.hidden.shape[0]
    device = head.hidden.device
    ids = torch.empty((n, k), dtype=torch.long, device=device)
    logprobs = torch.empty((n, k), dtype=torch.float32, device=device)
    label_logprobs = torch.zeros(n, dtype=torch.float32, device=device) if labels is not None else None
    with autocast_off(device.type):
        head = head.computed()  # the operands F.linear would compute from (autocast's casts)
        weight32 = head.weight.float()
        bias32 = None if head.bias is None else head.bias.float()
        step = rows_per_tile(vocab_size, head.tile_budget_bytes)
        for start in range(0, n, step):
            stop = min(start + step, n)
            raw = head.hidden[start:stop].float() @ weight32.t()
            if bias32 is not None:
                raw += bias32
            z, _ = head.transform.forward(raw)
            # (z − max) − log Σ exp(z − max), as log_softmax: the likely tokens' log-probs near 0 keep their digits
            shifted = z.sub_(z.amax(dim=1, keepdim=True))
            log_sum = shifted.exp().sum(dim=1, keepdim=True).log_()
            top = torch.topk(shifted, k, dim=1)  # sorted, most likely first
            ids[start:stop] = top.indices
            logprobs[start:stop] = top.values - log_sum
            if label_logprobs is not None:
                y = head.labels[start:stop]
                kept = y != ignore_index
                picked = shifted.gather(1, torch.where(kept, y, 0).unsqueeze(1)).squeeze(1) - log_sum.squeeze(1)
                label_logprobs[start:stop] = torch.where(kept, picked, 0.0)
            del raw, z, shifted, log_sum, top
    batch_shape = prepared.batch_shape
    return TopKLogprobs(
        ids.view(*batch_shape, k),
        logprobs.view(*batch_shape, k),
        None if label_logprobs is None else label_logprobs.view(batch_shape),
    )
