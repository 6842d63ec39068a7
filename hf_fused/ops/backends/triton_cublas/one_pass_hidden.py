"""The one pass's hidden-state gradient: each kept row's ``dh = dz·W`` is complete within its tile (the tile holds
the whole vocabulary) and waits only for the upstream gradient's factor, which backward applies
(:meth:`~hf_fused.ops.grads.HeadGrads.input_grads`). Where it waits depends on the dtype of hidden's gradient, the
given hidden states' (fp32 under autocast), :func:`~.one_pass_rule.hidden_gradient_kind`:

* ``"pair"`` (bf16): the compensated pair whose ``hi`` is hidden's whole bf16 gradient (the kept rows written
  where they are, the ignored ones 0) and whose int8 residual covers the kept rows (:mod:`.compensated`):
  ``hi`` is the gradient backward returns, so beside it the pass holds 1 byte a kept element instead of an fp32
  ``[M, H]`` buffer's 4 (and backward makes no scattered copy). The bits are the fp32 buffer's: at a factor of 1
  ``hi`` is its round-to-nearest; at another, the pair's value (the fp32 sum to ``ulp/508``) times the factor,
  rounded once.
* ``"scattered"`` (fp32, e.g. an fp32 model under autocast or a vocabulary-parallel head): hidden's whole fp32
  gradient itself, scaled in place in backward.
* ``"rows"`` (fp16, which the pair does not take): an fp32 ``[M, H]`` buffer in the order of the kept rows.

Each tile's ``dh`` comes from cuBLAS in fp32, straight into the gradient's rows where they are the tile's (every
row kept, fp32), else through one ``[rows, H]`` fp32 buffer; times the tile's row scale where the tile was taken
row-scaled (:func:`~.shifted_tile.exp_tile_row_factors_`), in fp32 before any rounding.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...grads import HeadGrads
from ...head_inputs import HeadInputs
from .compensated import RESIDUAL_DTYPE
from .compensated_pair import compensated_scale_, compensated_store_
from .matmul import mm_f32_
from .one_pass_rule import hidden_gradient_kind


class HiddenGradient:
    """The kept rows' hidden-state gradient of one pass: :meth:`add` a tile's rows, :meth:`finish` into the
    :class:`~hf_fused.ops.grads.HeadGrads`."""

    def __init__(self, head: HeadInputs) -> None:
        hidden, weight = head.hidden, head.weight
        m_rows, hidden_size = head.rows.numel(), weight.shape[1]
        # the given hidden states' dtype (fp32 under autocast: an fp32 gradient), not the cast operand's
        grad_dtype = head.hidden_gradient_dtype
        self.kind = hidden_gradient_kind(grad_dtype)
        every_row = m_rows == hidden.shape[0]  # kept rows are sorted (nonzero()): then row i is token i
        self.rows = None if every_row else head.rows
        if self.kind == "rows":
            self.grad = torch.empty((m_rows, hidden_size), dtype=torch.float32, device=weight.device)
        else:
            new = torch.empty if every_row else torch.zeros  # the ignored rows' gradient is 0
            self.grad = new(hidden.shape, dtype=grad_dtype, device=hidden.device)
        self.residual = (torch.empty((m_rows, hidden_size), dtype=RESIDUAL_DTYPE, device=hidden.device)
                         if self.kind == "pair" else None)
        # fp32 products land in the gradient itself where its rows are the tile's, else in this buffer first
        self.direct = self.kind == "rows" or (self.kind == "scattered" and every_row)
        self.buf: Optional[torch.Tensor] = None

    def add(self, r0: int, r1: int, dz: torch.Tensor, weight: torch.Tensor,
            row_scale: Optional[torch.Tensor] = None) -> None:
        """Tile rows ``[r0, r1)`` of the kept rows: ``dz [r1 − r0, V] @ weight [V, H]`` (times ``row_scale``)."""
        if self.direct:
            out = self.grad[r0:r1]
            mm_f32_(out, dz, weight)
            if row_scale is not None:
                out.mul_(row_scale[:, None])
            return
        if self.buf is None or self.buf.shape[0] < r1 - r0:  # one buffer for the call's tiles (the first is largest)
            self.buf = torch.empty((r1 - r0, weight.shape[1]), dtype=torch.float32, device=weight.device)
        out = self.buf[: r1 - r0]
        mm_f32_(out, dz, weight)
        rows = None if self.rows is None else self.rows[r0:r1]
        if self.kind == "pair":
            compensated_store_(self.grad if rows is not None else self.grad[r0:r1], self.residual[r0:r1], out,
                               hi_rows=rows, row_scale=row_scale)
            return
        if row_scale is not None:
            out.mul_(row_scale[:, None])
        self.grad.index_copy_(0, rows, out)

    def finish(self, grads: HeadGrads) -> None:
        self.buf = None
        grads.hidden, grads.hidden_scattered = self.grad, self.kind != "rows"
        if self.kind == "pair":
            grads.hidden_residual, grads.hidden_rows, grads.scale_pair = self.residual, self.rows, compensated_scale_
