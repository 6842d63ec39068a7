"""A token-separable loss evaluated tile by tile: :class:`TileLoss` runs the user's per-token ``token_loss`` on a
tile's rows and differentiates it there (the per-row gradients a backend's one pass turns into the head's), and
:func:`token_loss_one_pass` asks the backend for that pass."""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from .backends import Backend, HeadPass
from .head_inputs import HeadInputs, NeededGrads
from .kept_rows import KeptRows

#: ``token_loss(logprobs [r], entropy [r] or None, **per_token_rows) -> losses [r]``
TokenLossFn = Callable[..., torch.Tensor]


class TileLoss:
    """Evaluates ``token_loss`` on a run of the kept rows and returns its per-row gradients; accumulates the
    summed loss. Called by the backend between a tile's statistics and its gradient (one pass), or once on
    all rows (statistics + recompute)."""

    def __init__(self, token_loss: TokenLossFn, per_token: dict[str, torch.Tensor],
                 rows: Union[torch.Tensor, KeptRows], differentiate: bool, keep_row_grads: bool = False):
        self.token_loss = token_loss
        self.per_token = per_token  # name -> flat [N]
        self._rows = rows if isinstance(rows, KeptRows) else KeptRows.of(rows)  # read at the first tile's call
        self.differentiate = differentiate
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=self._rows.device)
        # With keep_row_grads, every call's (g_lp, g_ent) in row order (a TokenLossHint checks them in backward).
        self.row_grads: Optional[list] = [] if keep_row_grads else None

    @property
    def rows(self) -> torch.Tensor:
        """The kept rows ``[M]`` the per-token constants are gathered at."""
        return self._rows.rows()

    def __call__(self, start: int, stop: int, logp: torch.Tensor, entropy: Optional[torch.Tensor]):
        """``(g_lp [r], g_H [r] or None)`` fp32 for kept rows ``start:stop`` with fp32 ``logp``/``entropy [r]``;
        ``(None, None)`` when not differentiating. ``g_H`` is ``None`` when the loss ignores the entropy."""
        idx = self.rows[start:stop]
        consts = {name: values.index_select(0, idx) for name, values in self.per_token.items()}
        if not self.differentiate:
            with torch.no_grad():
                self.loss_sum += self._losses(logp, entropy, consts).sum()
            return None, None
        with torch.enable_grad():
            lp = logp.detach().requires_grad_()
            ent = None if entropy is None else entropy.detach().requires_grad_()
            losses = self._losses(lp, ent, consts)
            inputs = (lp,) if ent is None else (lp, ent)
            if losses.requires_grad:
                grads = torch.autograd.grad(losses.sum(), inputs, allow_unused=True)
            else:  # the loss does not depend on the log-probs (e.g. every row masked out)
                grads = (None,) * len(inputs)
        self.loss_sum += losses.detach().sum()
        g_lp = (torch.zeros_like(logp) if grads[0] is None else grads[0].float()).contiguous()
        g_ent = None if ent is None or grads[1] is None else grads[1].float().contiguous()
        if self.row_grads is not None:
            self.row_grads.append((g_lp, g_ent))
        return g_lp, g_ent

    def stacked_row_grads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every kept row's ``(g_lp [M], g_ent [M])`` so far (zeros where the loss ignored the entropy)."""
        g_lp = [g for g, _ in self.row_grads]
        g_ent = [torch.zeros_like(g) if h is None else h for g, h in self.row_grads]
        empty = torch.zeros(0, dtype=torch.float32, device=self.rows.device)
        return (torch.cat(g_lp) if g_lp else empty), (torch.cat(g_ent) if g_ent else empty)

    def _losses(self, logp, entropy, consts) -> torch.Tensor:
        losses = self.token_loss(logp, entropy, **consts)
        if not isinstance(losses, torch.Tensor) or losses.shape != logp.shape:
            got = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
            raise ValueError(
                f"token_loss must return one loss per token, a tensor shaped like its logprobs argument "
                f"{tuple(logp.shape)}, got {got}; reduce after the op (it returns the sum), not inside token_loss"
            )
        if not losses.is_floating_point():
            raise TypeError(f"token_loss must return floating-point losses, got {losses.dtype}")
        return losses.float()


def token_loss_one_pass(backend: Backend, head: HeadInputs, tile_loss: TileLoss, need: NeededGrads, *,
                        return_entropy: bool, need_entropy: bool) -> Optional[HeadPass]:
    """The backend's one pass of ``tile_loss`` (statistics, per-row loss gradients and the head's gradients tile
    by tile), or ``None``: nothing to differentiate, a backend without ``token_loss_with_grads``, or the planner
    chose two passes. The entropy is computed when returned or read by the loss (``need_entropy``)."""
    if not need.any or not hasattr(backend, "token_loss_with_grads"):
        return None
    return backend.token_loss_with_grads(
        head, tile_loss, need=need, return_entropy=return_entropy or need_entropy, grads_read_entropy=need_entropy,
    )
