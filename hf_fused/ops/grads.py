"""The gradients a backend returns, and their one rounding to the inputs' dtypes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class HeadGrads:
    """Gradients of the head's inputs; ``None`` for those not requested. All fp32, so that the op can
    scale them by the upstream gradient before their one rounding to the inputs' dtypes
    (:meth:`input_grads`).

    hidden: ``[M, H]``, the gradients of the token rows ``rows`` the backend was given, in that order.
    weight: ``[V, H]``.  bias: ``[V]``.
    """

    hidden: Optional[torch.Tensor] = None
    weight: Optional[torch.Tensor] = None
    bias: Optional[torch.Tensor] = None

    def input_grads(self, hidden, weight, bias, rows, factor: float = 1.0):
        """``(d_hidden [N, H], d_weight, d_bias)`` in the inputs' dtypes (``None`` where not computed):
        each times ``factor`` in fp32 (in place), then rounded once; hidden's rows scattered to ``rows``
        (0 elsewhere). Consumes the fp32 buffers: each is released as soon as its result exists, so
        the fp32 ``[M, H]`` is gone before the ``[V, H]`` one is cast."""
        out = []
        for name, like in (("hidden", hidden), ("weight", weight), ("bias", bias)):
            grad = getattr(self, name)
            setattr(self, name, None)
            if grad is None:
                out.append(None)
                continue
            if factor != 1.0:
                grad.mul_(factor)
            out.append(_scatter_rows(grad, hidden, rows) if name == "hidden" else grad.to(like.dtype))
            del grad
        return tuple(out)


def _scatter_rows(d_rows: torch.Tensor, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The gradients of ``rows`` (``[M, H]``) as hidden's gradient ``[N, H]`` in hidden's dtype (0 on the
    rows not in ``rows``: ignored tokens)."""
    if rows.numel() == hidden.shape[0]:  # every row, in order (rows come from nonzero(): sorted)
        return d_rows.to(hidden.dtype)
    return torch.zeros_like(hidden).index_copy_(0, rows, d_rows.to(hidden.dtype))
