"""The contract every backend meets: three methods over one flattened head (``[N, H]`` hidden states, ``[V, H]``
weight, optional ``[V]`` bias, ``[N]`` labels, the kept rows ``[M]``), each working tile by tile within the
planner's decisions (:mod:`hf_fused.ops.tiling`). Per-row tensors are fp32 ``[M]``, in the order of ``rows``;
gradients come back as fp32 :class:`~hf_fused.ops.grads.HeadGrads` that the op scales and rounds once."""

from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import torch

from ..grads import HeadGrads
from ..logit_transform import LogitTransform


@runtime_checkable
class Backend(Protocol):
    name: str

    def logprobs_with_grads(
        self, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
        rows: torch.Tensor, grad_logprobs: Optional[torch.Tensor], transform: LogitTransform,
        tile_budget_bytes: Optional[int], return_entropy: bool, need_hidden: bool, need_weight: bool,
        need_bias: bool,
    ) -> Optional[tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, Optional[HeadGrads]]]:
        """One pass: ``(logprobs, entropy or None, lse, grads of Σ grad_logprobs·logprobs or None)``, or ``None``
        when the planner chooses two passes (the op then calls the two methods below)."""

    def logprobs_forward(
        self, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
        rows: torch.Tensor, transform: LogitTransform, tile_budget_bytes: Optional[int], return_entropy: bool,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
        """Statistics: ``(logprobs, entropy or None, lse)``."""

    def logprobs_backward(
        self, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
        rows: torch.Tensor, lse: torch.Tensor, entropy: Optional[torch.Tensor],
        grad_logprobs: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor], transform: LogitTransform,
        tile_budget_bytes: Optional[int], need_hidden: bool, need_weight: bool, need_bias: bool,
    ) -> HeadGrads:
        """Recompute: the gradients of ``Σ grad_logprobs·logprobs + Σ grad_entropy·entropy``."""
