"""The two kinds of ``grad_hint`` :func:`~hf_fused.ops.linear_logprobs` takes: a tensor (the gradient the loss will
send to the log-probs, up to one factor) or a :class:`TokenLossHint` (the loss as a per-token function). Either lets
the forward compute the head's gradients in its one pass; backward hands them over only if the upstream gradient
matches (:class:`Handover`), and otherwise recomputes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

from .backends import Backend, HeadGrads, HeadPass
from .backward import hinted_input_grads, warn_hint_missed
from .head_inputs import HeadInputs, NeededGrads
from .prepare import PreparedHead, check_per_token
from .tile_loss import TileLoss, TokenLossFn, token_loss_one_pass


@dataclass
class TokenLossHint:
    """``linear_logprobs(grad_hint=TokenLossHint(token_loss, per_token))``: the loss the caller will compute from
    the returned log-probs (and entropies) is ``Σ_t token_loss(logp_t, H_t; per_token_t)`` up to one scalar factor,
    so the op can compute its gradients in the forward's single pass (6·N·H·V) like
    :func:`~hf_fused.ops.linear_token_loss`, while the caller's own code computes the loss and metrics from the
    returned tensors.

    Backward receives the gradients the caller's loss really sends to the log-probs and entropies and uses the
    forward's head gradients, times ``c``, only when they equal ``c·(∂Σ token_loss/∂logp, ∂/∂H)`` to
    :data:`~hf_fused.ops.backward.HINT_RTOL` of their largest entry; otherwise it recomputes (exact either way;
    :class:`~hf_fused.ops.backward.HintMissedWarning` says so).

    token_loss: as in :func:`~hf_fused.ops.linear_token_loss`.
    per_token: tensors shaped like the labels of the call, constants (rows whose label is ignored are never used).
    need_entropy: ``token_loss`` uses the entropy (it is then computed even if the call does not return it).
    terms: every ``per_token`` tensor has one trailing dimension more than the labels (``labels.shape + (K,)``):
        ``K`` loss terms per token, padded where a token has fewer (give those terms a zero weight). ``token_loss``
        then gets ``[r, K]`` constants beside the ``[r]`` log-probs and returns ``[r]`` (its terms summed). For
        packed rows where one position serves several sequences, each with its own constants (TRL's
        ``AsyncGRPOTrainer`` packs samples that share a prefix into one tree: :mod:`hf_fused.trainers.async_grpo`).

    Raises:
        TypeError: ``token_loss`` not callable; ``per_token`` empty or not all tensors.
        ValueError: ``per_token`` tensors of different shapes; with ``terms``, one without a trailing dimension.
    """

    token_loss: TokenLossFn
    per_token: dict
    need_entropy: bool = False
    terms: bool = False

    def __post_init__(self) -> None:
        if not callable(self.token_loss):
            raise TypeError(f"TokenLossHint.token_loss must be callable, got {self.token_loss!r}")
        if (not isinstance(self.per_token, dict) or not self.per_token
                or not all(isinstance(v, torch.Tensor) for v in self.per_token.values())):
            raise TypeError("TokenLossHint.per_token must be a non-empty dict of tensors shaped like labels "
                            f"(name -> tensor, the names token_loss takes), got {type(self.per_token).__name__}")
        shapes = {tuple(v.shape) for v in self.per_token.values()}
        if len(shapes) != 1:
            raise ValueError(f"TokenLossHint.per_token tensors must share one shape (labels'), got {sorted(shapes)}")
        if self.terms and len(next(iter(shapes))) < 2:
            raise ValueError("TokenLossHint(terms=True): per_token tensors must be shaped like the labels plus a "
                             f"trailing dimension of terms, got {next(iter(shapes))}")

    @property
    def shape(self) -> torch.Size:
        """The labels' shape (without the trailing dimension of ``terms``)."""
        shape = next(iter(self.per_token.values())).shape
        return shape[:-1] if self.terms else shape

    def size(self, dim: int) -> int:
        return self.shape[dim]

    def _map(self, fn) -> "TokenLossHint":
        return TokenLossHint(self.token_loss, {k: fn(v) for k, v in self.per_token.items()}, self.need_entropy,
                             self.terms)

    def to(self, device) -> "TokenLossHint":
        return self._map(lambda v: v.to(device))

    def __getitem__(self, index) -> "TokenLossHint":
        return self._map(lambda v: v[index])

    def pad(self, left: int, right: int) -> "TokenLossHint":
        """Zeros added on the labels' last dimension (positions the call ignores: their values are never used)."""
        return self._map(lambda v: F.pad(v, (0, 0, left, right) if self.terms else (left, right)))


def pad_hint(hint, left: int, right: int):
    """A ``grad_hint`` (tensor or :class:`TokenLossHint`) padded with zeros on its last dimension."""
    return hint.pad(left, right) if isinstance(hint, TokenLossHint) else F.pad(hint, (left, right))


@dataclass
class Handover:
    """The head's gradients a hinted one pass computed in the forward, and what the upstream gradient must be a
    multiple of for backward to use them: ``hint_lp`` on the log-probs (``[M]``) and ``hint_ent`` on the entropies
    (``[M]``; ``None``: the entropy must receive no gradient)."""

    grads: HeadGrads
    hint_lp: torch.Tensor
    hint_ent: Optional[torch.Tensor]
    #: What :class:`~hf_fused.ops.backward.HintMissedWarning` says when the upstream does not match.
    missed: str

    def input_grads(self, g_lp: Optional[torch.Tensor], g_h: Optional[torch.Tensor], given: HeadInputs):
        """The inputs' gradients (``grads`` times ``c``, rounded once) if the upstream ``(g_lp, g_h)`` (fp32 ``[M]``
        or ``None``) is ``c·(hint_lp, hint_ent)``; else ``None`` after warning (the caller recomputes). One host
        sync."""
        if self.hint_ent is None:
            if g_h is not None and bool(g_h.ne(0).any()):
                warn_hint_missed(self.missed.format(why="the entropy receives a gradient"))
                return None
            hint, upstream = self.hint_lp, torch.zeros_like(self.hint_lp) if g_lp is None else g_lp
        else:
            hint = torch.cat([self.hint_lp, self.hint_ent])
            upstream = torch.cat([torch.zeros_like(self.hint_lp) if g_lp is None else g_lp,
                                  torch.zeros_like(self.hint_ent) if g_h is None else g_h])
        out = hinted_input_grads(self.grads, hint, upstream, given)
        if out is None:
            warn_hint_missed(self.missed.format(why="the upstream gradient is not a multiple of the hint"))
        return out


_TENSOR_MISSED = (
    "linear_logprobs(grad_hint=...): {why}, so the gradients computed in the forward were dropped and recomputed "
    "(8·N·H·V FLOPs instead of 6). The gradients are exact; pass no grad_hint for this loss."
)
_TOKEN_LOSS_MISSED = (
    "linear_logprobs(grad_hint=TokenLossHint(...)): the gradient the loss sent to the log-probs/entropies is not "
    "a multiple of the hint's token loss gradient, so the gradients computed in the forward were dropped and "
    "recomputed (8·N·H·V FLOPs instead of 6). The gradients are exact; check the hint's token_loss against the "
    "loss (or pass no grad_hint)."
)


class TensorHintRows:
    """A tensor ``grad_hint`` at the kept rows (fp32 ``[M]``, :attr:`rows`): the one pass computes the gradients of
    ``Σ hint·logprobs``. Gathered at its first use: the pass asks for it after launching its first tile, so that
    reading the count of kept rows does not wait on the op's set-up (:mod:`hf_fused.ops.kept_rows`)."""

    def __init__(self, grad_hint: torch.Tensor, prepared: PreparedHead):
        self._values = check_per_token(grad_hint, prepared.labels, "grad_hint").reshape(-1)
        self._prepared, self._rows = prepared, None

    @property
    def rows(self) -> torch.Tensor:
        if self._rows is None:
            self._rows = self._values.index_select(0, self._prepared.rows)
            self._values = self._prepared = None
        return self._rows

    def one_pass(self, backend: Backend, head: HeadInputs, need: NeededGrads, *, return_entropy: bool,
                 statistics: Sequence[str]) -> Optional[HeadPass]:
        return backend.logprobs_with_grads(head, lambda: self.rows, need=need, return_entropy=return_entropy,
                                           statistics=statistics)

    def handover(self, one_pass: HeadPass) -> Handover:
        return Handover(one_pass.grads, self.rows, None, _TENSOR_MISSED)


class TokenLossHintRows:
    """A :class:`TokenLossHint` on one call's kept rows: the one pass evaluates and differentiates its token loss
    tile by tile (:class:`~hf_fused.ops.tile_loss.TileLoss`), keeping each row's gradients for the check."""

    def __init__(self, hint: TokenLossHint, prepared: PreparedHead):
        consts = prepared.per_token_constants(hint.per_token, terms=hint.terms)
        # the kept rows read at the first tile's gradients, after the pass has launched that tile
        self.tile_loss = TileLoss(hint.token_loss, consts, prepared.head.kept_rows, differentiate=True,
                                  keep_row_grads=True)
        self.need_entropy = bool(hint.need_entropy)

    def one_pass(self, backend: Backend, head: HeadInputs, need: NeededGrads, *, return_entropy: bool,
                 statistics: Sequence[str]) -> Optional[HeadPass]:
        return token_loss_one_pass(backend, head, self.tile_loss, need, return_entropy=return_entropy,
                                   need_entropy=self.need_entropy)

    def handover(self, one_pass: HeadPass) -> Handover:
        hint_lp, hint_ent = self.tile_loss.stacked_row_grads()
        return Handover(one_pass.grads, hint_lp, hint_ent, _TOKEN_LOSS_MISSED)


HintRows = Union[TensorHintRows, TokenLossHintRows]


def hint_rows(grad_hint, prepared: PreparedHead) -> Optional[HintRows]:
    """``grad_hint`` (``None``, a tensor shaped like the labels, or a :class:`TokenLossHint`) on ``prepared``'s kept
    rows.

    Raises:
        TypeError / ValueError: a tensor hint that is not floating point or not shaped like the labels on their
            device; a ``TokenLossHint`` whose ``per_token`` tensors are not (:meth:`PreparedHead.per_token_constants`).
    """
    if grad_hint is None:
        return None
    if isinstance(grad_hint, TokenLossHint):
        return TokenLossHintRows(grad_hint, prepared)
    return TensorHintRows(grad_hint, prepared)
