"""The contract every backend meets: three methods (and an optional fourth) over one flattened head,
:class:`~hf_fused.ops.head_inputs.HeadInputs` (``[N, H]`` hidden states, ``[V, H]`` weight, optional ``[V]`` bias,
``[N]`` labels, the kept rows ``[M]``, the logit transform, the tile budget), each working tile by tile within the
tile budget (:mod:`hf_fused.ops.tiling`; the GPU backend plans its own schedules within it). Per-row tensors are
fp32 ``[M]``, in the order of ``head.rows``; gradients come back as fp32 :class:`~hf_fused.ops.grads.HeadGrads`
that the op scales and rounds once (with the rounding kernels the backend lends them, ``HeadGrads.mul_into``).

Every method takes the head first, then only its own per-call arguments, its flags by keyword only: a call that
spreads the head's operands positionally (``hidden, weight, bias, labels, rows, ...``) fails with a ``TypeError``.
The forward methods (the one passes and ``logprobs_forward``) return one :class:`HeadPass`, which also holds, when
``statistics`` names any, the gradient-free token statistics of :mod:`hf_fused.ops.token_statistics`, computed from
the same logits tiles (no second pass over the vocabulary)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence, Union, runtime_checkable

import torch

from ..grads import HeadGrads
from ..head_inputs import HeadInputs, NeededGrads

#: ``{name: [M]}`` for the requested names among ``TOKEN_STATISTICS``: ``mean_logits`` and ``log_sum_sq_probs``
#: fp32, ``is_top1`` bool, in the order of ``rows``.
RowStatistics = dict[str, torch.Tensor]

#: ``tile_grads(start, stop, logp [r], entropy [r] or None) -> (g_lp [r], g_ent [r] or None)``: the per-row
#: gradients of a token loss for kept rows ``start:stop`` (:meth:`TokenLossBackend.token_loss_with_grads`).
TileGrads = Callable[[int, int, torch.Tensor, Optional[torch.Tensor]], tuple]


def logprob_tile_grads(grad_logprobs: Union[torch.Tensor, Callable[[], torch.Tensor]]) -> TileGrads:
    """The :data:`TileGrads` of ``Σ grad_logprobs·logprobs``: each tile's rows of ``grad_logprobs`` (fp32 ``[M]``, or
    a callable building it, called at the first tile's gradients), no entropy gradient."""
    built = []

    def tile_grads(start: int, stop: int, logp: torch.Tensor, entropy: Optional[torch.Tensor]):
        if not built:
            values = grad_logprobs() if callable(grad_logprobs) else grad_logprobs
            built.append(values.to(torch.float32).contiguous())
        return built[0][start:stop], None

    return tile_grads


@dataclass
class HeadPass:
    """What a forward pass over the head computes, per kept row (fp32 ``[M]`` in the order of ``head.rows``).

    logprobs: ``z_y − lse``.  entropy: ``−Σ_j p_j log p_j``, or ``None`` unless asked.  lse: ``logsumexp(z)``.
    grads: the gradients the pass computed from the same logits (one pass), or ``None`` (statistics only).
    statistics: :data:`RowStatistics` of the names asked for (empty when none).
    """

    logprobs: torch.Tensor
    entropy: Optional[torch.Tensor]
    lse: torch.Tensor
    grads: Optional[HeadGrads] = None
    statistics: RowStatistics = field(default_factory=dict)


@runtime_checkable
class Backend(Protocol):
    """``logprobs_with_grads`` (one pass, with the gradients of a known upstream), ``logprobs_forward``
    (statistics) and ``logprobs_backward`` (recompute). Optionally ``token_loss_with_grads`` (the one pass of
    :func:`~hf_fused.ops.linear_token_loss` and of a ``TokenLossHint``; without it those run statistics +
    recompute), with the signature of :meth:`TokenLossBackend.token_loss_with_grads`. Every method takes the head
    as the op was given it: under autocast (:attr:`HeadInputs.compute_dtype`) it computes from operands in
    :attr:`HeadInputs.operand_dtype`, cast whole (:meth:`HeadInputs.computed`) or chunk by chunk
    (:meth:`HeadInputs.weight_rows`), and returns gradients in the given tensors' dtypes' precision (fp32 for fp32
    inputs)."""

    name: str

    def logprobs_with_grads(
        self, head: HeadInputs, grad_logprobs: Union[None, torch.Tensor, Callable[[], torch.Tensor]], *,
        need: NeededGrads, return_entropy: bool = False, statistics: Sequence[str] = (),
    ) -> Optional[HeadPass]:
        """One pass: the statistics and, when ``need.any``, the gradients of ``Σ grad_logprobs·logprobs``
        (``grad_logprobs`` fp32 ``[M]``, or a callable returning it, called once where the pass first needs it:
        the ops build it late because its size is the count of kept rows, :mod:`hf_fused.ops.kept_rows`; may be
        ``None`` without ``need``) in :attr:`HeadPass.grads`; or ``None`` when the planner chooses two passes (the
        op then calls the two methods below)."""

    def logprobs_forward(
        self, head: HeadInputs, *, return_entropy: bool = False, statistics: Sequence[str] = (),
    ) -> HeadPass:
        """Statistics only (``grads`` ``None``)."""

    def logprobs_backward(
        self, head: HeadInputs, lse: torch.Tensor, entropy: Optional[torch.Tensor],
        grad_logprobs: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor], *, need: NeededGrads,
    ) -> HeadGrads:
        """Recompute: the gradients of ``Σ grad_logprobs·logprobs + Σ grad_entropy·entropy`` (upstream fp32
        ``[M]``, either may be ``None``; ``entropy`` the forward's, needed with ``grad_entropy``)."""


@runtime_checkable
class TokenLossBackend(Backend, Protocol):
    """A :class:`Backend` with the optional fourth method (both backends here have it)."""

    def token_loss_with_grads(
        self, head: HeadInputs, tile_grads: TileGrads, *, need: NeededGrads, return_entropy: bool = False,
        statistics: Sequence[str] = (), grads_read_entropy: bool = True,
    ) -> Optional[HeadPass]:
        """Like :meth:`Backend.logprobs_with_grads`, but each tile's per-row gradients come from ``tile_grads``
        (:data:`TileGrads`), called right after the tile's statistics; then
        ``dz_j = g_lp·(1[j = y] − p_j) − g_ent·p_j·(log p_j + H)`` from the same logits. ``None`` when the
        planner chooses two passes. With ``grads_read_entropy`` False, ``tile_grads`` is passed ``None`` for the
        entropy (its loss does not read it), so a returned entropy may be reduced after the gradient."""
