"""The operands every backend method takes (:class:`HeadInputs`, :mod:`hf_fused.ops.backends.protocol`) and which
of their gradients a call needs (:class:`NeededGrads`). The ops build them in :func:`hf_fused.ops.prepare.prepare`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple, Optional, Union

import torch

from .kept_rows import KeptRows
from .logit_transform import LogitTransform


@dataclass(frozen=True, eq=False)
class HeadInputs:
    """The operands a backend computes from: one flattened head and how to tile it.

    hidden: ``[N, H]``.  weight: ``[V, H]``.  bias: ``[V]`` or ``None``.  labels: ``[N]`` int64.
    kept_rows: the rows to compute: ``[M]`` int64 ascending, or a :class:`~hf_fused.ops.kept_rows.KeptRows` whose
        count is read at the first use of :attr:`rows`; every per-row tensor of the contract is ``[M]`` in this
        order.
    transform: the logit transform.  tile_budget_bytes: the working-set bound the planner
        (:mod:`hf_fused.ops.tiling`, and the GPU backend's own plan) tiles within; ``None``: its default rule.
    compute_dtype: the dtype ``F.linear`` would compute in under autocast (``None`` outside it). Backends take
        the head as the op was given it and compute from operands in :attr:`operand_dtype`: the one passes from
        a :meth:`computed` head (hidden, weight and bias cast whole), the GPU two passes casting one vocabulary
        chunk of the weight at a time (:meth:`weight_rows`), so that an fp32 weight (fp32 master weights under
        ``Trainer(bf16=True)``, TRL's GRPOTrainer default) costs no whole half-precision copy there. The ops'
        autograd Functions keep the tensors as given, so that an fp32 parameter's gradient comes back in fp32
        straight from the fp32 accumulators (never rounded to bf16 on the way, as eager autocast's is) and no
        half-precision copy of the weight is held from forward to backward.
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    labels: torch.Tensor
    kept_rows: Union[torch.Tensor, KeptRows]
    transform: LogitTransform
    tile_budget_bytes: Optional[int]
    compute_dtype: Optional[torch.dtype] = None
    #: In a :meth:`computed` head: the given weight's dtype, which its gradient comes back in (an fp32 weight under
    #: autocast gets an fp32 gradient: backends write it in fp32 instead of the compute dtype).
    weight_grad_dtype: Optional[torch.dtype] = None
    #: In a :meth:`computed` head: the given hidden states' dtype, which their gradient comes back in (as the
    #: weight's: fp32 hidden states under autocast get an fp32 gradient).
    hidden_grad_dtype: Optional[torch.dtype] = None
    #: Whether the call hands its per-token log-probs to the caller: every op but the cross-entropy's reduced loss.
    #: Log-probs a caller may compare with another call's (an RL trainer's old and new ones) come from the same
    #: statistics on every schedule: the GPU backend's one pass takes them from the matmul's fp32 accumulator by
    #: default where this is True (:mod:`~hf_fused.ops.backends.triton_cublas.fp32_logits_rule`).
    returns_logprobs: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.kept_rows, torch.Tensor):
            object.__setattr__(self, "kept_rows", KeptRows.of(self.kept_rows))

    @property
    def rows(self) -> torch.Tensor:
        """The rows to compute, ``[M]`` int64 ascending (the first use may read their count: a host sync)."""
        return self.kept_rows.rows()

    @property
    def operand_dtype(self) -> torch.dtype:
        """The dtype the matmuls' operands are in: :attr:`compute_dtype` under autocast, else the weight's."""
        return self.compute_dtype or self.weight.dtype

    def casts_weight(self) -> bool:
        """Whether the weight is not in :attr:`operand_dtype` (an fp32 weight under bf16 autocast)."""
        return self.weight.dtype != self.operand_dtype

    def weight_rows(self, v0: int, v1: int, buf: Optional[torch.Tensor]) -> torch.Tensor:
        """``weight[v0:v1]`` in :attr:`operand_dtype`: the slice itself when no cast is needed, else cast into the
        first ``v1 − v0`` rows of ``buf`` (``[≥ v1 − v0, H]``, contiguous) and that view returned."""
        rows = self.weight[v0:v1]
        if not self.casts_weight():
            return rows
        return buf[: v1 - v0].copy_(rows)

    def computed(self, *, meta: bool = False) -> "HeadInputs":
        """This head with hidden, weight and bias cast to :attr:`compute_dtype` as autocast casts ``F.linear``'s
        operands (itself when there is none). ``meta``: tensors of those shapes and dtypes on the meta device
        instead, no copy made (what a planner reads before deciding to make them; :meth:`cast_bytes` is their
        size)."""
        dtype = self.compute_dtype
        if dtype is None:
            return self
        cast = (lambda t: torch.empty(t.shape, dtype=dtype, device="meta")) if meta else (lambda t: t.to(dtype))
        bias = None if self.bias is None else cast(self.bias)
        return replace(self, hidden=cast(self.hidden), weight=cast(self.weight), bias=bias,
                       compute_dtype=None, weight_grad_dtype=self.weight.dtype, hidden_grad_dtype=self.hidden.dtype)

    @property
    def weight_gradient_dtype(self) -> torch.dtype:
        """The dtype the weight's gradient comes back in: the given weight's (:attr:`weight_grad_dtype` in a
        :meth:`computed` head)."""
        return self.weight_grad_dtype or self.weight.dtype

    @property
    def hidden_gradient_dtype(self) -> torch.dtype:
        """The dtype the hidden states' gradient comes back in: the given hidden states' (:attr:`hidden_grad_dtype`
        in a :meth:`computed` head)."""
        return self.hidden_grad_dtype or self.hidden.dtype

    def cast_bytes(self) -> int:
        """Bytes the copies :meth:`computed` makes hold: hidden, weight and bias where not already in
        :attr:`compute_dtype` (0 outside autocast)."""
        dtype = self.compute_dtype
        if dtype is None:
            return 0
        return sum(t.numel() * dtype.itemsize for t in (self.hidden, self.weight, self.bias)
                   if t is not None and t.dtype != dtype)

    def with_rows(self, rows: torch.Tensor) -> "HeadInputs":
        """The same head restricted to ``rows`` (a subset of :attr:`rows`, ascending)."""
        return replace(self, kept_rows=rows)

    def save_for_backward(self, ctx, *tensors: Optional[torch.Tensor]) -> None:
        """Save this head (its tensors through ``ctx.save_for_backward``, so that they are freed after backward
        and checked for in-place changes) and ``tensors`` after them, for :meth:`saved`."""
        ctx.save_for_backward(self.hidden, self.weight, self.bias, self.labels, self.rows, *tensors)
        ctx.head_settings = (self.transform, self.tile_budget_bytes, self.compute_dtype)

    @staticmethod
    def saved(ctx) -> tuple["HeadInputs", list]:
        """``(head, [tensors])`` as :meth:`save_for_backward` saved them."""
        hidden, weight, bias, labels, rows, *tensors = ctx.saved_tensors
        return HeadInputs(hidden, weight, bias, labels, rows, *ctx.head_settings), tensors


class NeededGrads(NamedTuple):
    """Which of the head's inputs a gradient is requested for."""

    hidden: bool
    weight: bool
    bias: bool

    @classmethod
    def of(cls, ctx, bias: Optional[torch.Tensor], enabled: bool = True) -> "NeededGrads":
        """What an autograd Function taking ``(hidden, weight, bias, ...)`` must compute: its
        ``ctx.needs_input_grad`` for the three, none when ``enabled`` is False (the op was called with grad mode
        off) and none for an absent bias."""
        need = ctx.needs_input_grad
        return cls(enabled and need[0], enabled and need[1], enabled and bias is not None and need[2])

    @property
    def any(self) -> bool:
        return self.hidden or self.weight or self.bias
