"""The contract every backend meets: three methods over one flattened head (``[N, H]`` hidden states, ``[V, H]``
weight, optional ``[V]`` bias, ``[N]`` labels, the kept rows ``[M]``), each working tile by tile within the
planner's decisions (:mod:`hf_fused.ops.tiling`). Per-row tensors are fp32 ``[M]``, in the order of ``rows``;
gradients come back as fp32 :class:`~hf_fused.ops.grads.HeadGrads` that the op scales and rounds once.

The two forward methods also compute, when ``statistics`` names any, the gradient-free token statistics of
:mod:`hf_fused.ops.token_statistics` from the same logits tiles (no second pass over the vocabulary), and then
return one more element: :data:`RowStatistics`. Without ``statistics`` the returns are as before it existed, and
the ops pass the keyword only when it names something (a backend without it serves every other call)."""

from __future__ import annotations

from typing import Optional, Protocol, Sequence, Union, runtime_checkable

import torch

from ..grads import HeadGrads
from ..logit_transform import LogitTransform

#: ``{name: [M]}`` for the requested names among ``TOKEN_STATISTICS``: ``mean_logits`` and ``log_sum_sq_probs``
#: fp32, ``is_top1`` bool, in the order of ``rows``.
RowStatistics = dict[str, torch.Tensor]

_Logprobs = tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]  # logprobs, entropy or None, lse


@runtime_checkable
class Backend(Protocol):
    name: str

    def logprobs_with_grads(
        self, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
        rows: torch.Tensor, grad_logprobs: Optional[torch.Tensor], transform: LogitTransform,
        tile_budget_bytes: Optional[int], return_entropy: bool, need_hidden: bool, need_weight: bool,
        need_bias: bool, statistics: Sequence[str] = (),
    ) -> Optional[Union[
        tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, Optional[HeadGrads]],
        tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, Optional[HeadGrads], RowStatistics],
    ]]:
        """One pass: ``(logprobs, entropy or None, lse, grads of Σ grad_logprobs·logprobs or None)`` plus the
        :data:`RowStatistics` when ``statistics`` is non-empty, or ``None`` when the planner chooses two passes
        (the op then calls the two methods below)."""

    def logprobs_forward(
        self, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
        rows: torch.Tensor, transform: LogitTransform, tile_budget_bytes: Optional[int], return_entropy: bool,
        statistics: Sequence[str] = (),
    ) -> Union[_Logprobs, tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, RowStatistics]]:
        """Statistics: ``(logprobs, entropy or None, lse)``, plus the :data:`RowStatistics` when ``statistics`` is
        non-empty."""

    def logprobs_backward(
        self, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
        rows: torch.Tensor, lse: torch.Tensor, entropy: Optional[torch.Tensor],
        grad_logprobs: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor], transform: LogitTransform,
        tile_budget_bytes: Optional[int], need_hidden: bool, need_weight: bool, need_bias: bool,
    ) -> HeadGrads:
        """Recompute: the gradients of ``Σ grad_logprobs·logprobs + Σ grad_entropy·entropy``."""
