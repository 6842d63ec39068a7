"""What the GPU backend's matmuls read: the kept hidden rows, the bias and the weight in the operands' dtype.

The kept rows (ignored tokens compacted out before any matmul) come either as one compact copy or gathered block
by block into one ``[block_rows, H]`` buffer (:func:`rows_source`, :func:`row_blocks`); the one pass gathers each
tile's rows when some are ignored or hidden's dtype is not the weight's (:func:`one_pass_gathers`). The byte
counts here are what the plan (:mod:`.plan`) counts for these buffers.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch

from ...head_inputs import HeadInputs
from .two_pass_rule import LeanPlan


def compact_bytes(head: HeadInputs) -> int:
    """Bytes of the copy :func:`compact_rows` makes: none when every row is kept in the operands' dtype."""
    hidden, m_rows, dtype = head.hidden, head.rows.numel(), head.operand_dtype
    if m_rows == hidden.shape[0] and hidden.dtype == dtype:
        return 0
    return m_rows * hidden.shape[1] * dtype.itemsize


def compact_rows(head: HeadInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept rows' hidden states (in the operands' dtype) and labels."""
    hidden, labels, rows = head.hidden.to(head.operand_dtype), head.labels, head.rows
    if rows.numel() == hidden.shape[0]:
        return hidden, labels
    return hidden.index_select(0, rows), labels.index_select(0, rows)


def rows_source(head: HeadInputs, plan: LeanPlan):
    """``(compact hidden rows or None, gather buffer or None, the kept rows' labels)`` for :func:`row_blocks`."""
    if plan.gather_rows:
        hidden, rows = head.hidden, head.rows
        buf = torch.empty((min(plan.block_rows, rows.numel()), hidden.shape[1]), dtype=head.operand_dtype,
                          device=hidden.device)
        return None, buf, head.labels.index_select(0, rows)
    h, y = compact_rows(head)
    return h, None, y


def row_blocks(head: HeadInputs, plan: LeanPlan, compact: Optional[torch.Tensor],
               buf: Optional[torch.Tensor], start: int = 0) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``(r0, r1, hidden rows [r1 − r0, H] in the operands' dtype)`` for each row block of ``plan`` from row
    ``start`` on: slices of the ``compact`` copy, or (``plan.gather_rows``) the block gathered into ``buf``
    (``[block_rows, H]``, one buffer for the whole pass: a block still referenced when the next chunk starts must
    not hold a second one). Iterate once per vocabulary chunk."""
    m_rows = head.rows.numel()
    if compact is not None:
        for r0 in range(start, m_rows, plan.block_rows):
            yield r0, min(r0 + plan.block_rows, m_rows), compact[r0 : r0 + plan.block_rows]
        return
    for r0 in range(start, m_rows, plan.block_rows):
        r1 = min(r0 + plan.block_rows, m_rows)
        yield r0, r1, gather_rows(head, head.rows[r0:r1], buf)


def gather_rows(head: HeadInputs, index: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """Hidden's rows ``index`` in the operands' dtype, into the first ``len(index)`` rows of ``buf`` (that view)."""
    hidden, out = head.hidden, buf[: index.numel()]
    if hidden.dtype == head.operand_dtype:
        return torch.index_select(hidden, 0, index, out=out)
    return out.copy_(hidden.index_select(0, index))


def one_pass_gathers(head: HeadInputs) -> bool:
    """Whether the one pass gathers each tile's kept hidden rows into a ``[rows, H]`` buffer (some rows are
    ignored, or hidden's dtype is not the weight's) instead of slicing hidden itself: a buffer the size of one
    tile's rows rather than a compact copy of every kept row (0.11 GiB at 29,491 × 2048 in bf16). Before the count
    of kept rows is read (:mod:`hf_fused.ops.kept_rows`): True, the bound a plan counts."""
    if head.hidden.dtype != head.weight.dtype or not head.kept_rows.known:
        return True
    return head.rows.numel() != head.hidden.shape[0]


def new_rows_buffer(head: HeadInputs, tile_rows: int) -> torch.Tensor:
    """The one pass's ``[tile_rows, H]`` buffer of gathered hidden rows, in the weight's dtype."""
    return torch.empty((tile_rows, head.weight.shape[1]), dtype=head.weight.dtype, device=head.weight.device)


def one_pass_rows(head: HeadInputs, tile_rows: int, *, start: int = 0, buf: Optional[torch.Tensor] = None):
    """``(the kept rows' labels, the rows operand, row blocks from row start)`` of the one pass's ``tile_rows``-row
    tiles: slices of hidden itself where every row is kept in the weight's dtype, else each tile's rows gathered
    into one ``[tile_rows, H]`` buffer (:func:`one_pass_gathers`), which is then the rows operand. With ``buf``
    (the buffer of tiles gathered before the count was read) the rows are gathered into it whatever the count."""
    m_rows, vocab_size = head.rows.numel(), head.weight.shape[0]
    gathers = buf is not None or one_pass_gathers(head)
    if gathers:
        y = head.labels.index_select(0, head.rows)
        rows_buf = new_rows_buffer(head, min(tile_rows, max(m_rows, 1))) if buf is None else buf
    else:
        y, rows_buf = head.labels, head.hidden
    compact, gather_buf = (None, rows_buf) if gathers else (rows_buf, None)
    return y, rows_buf, row_blocks(head, LeanPlan(tile_rows, vocab_size, gathers, 0), compact, gather_buf, start)


def one_pass_gather_row_bytes(head: HeadInputs) -> int:
    """Bytes per tile row of the one pass's gathered rows (the buffer, and hidden's dtype on the way when it
    differs)."""
    if not one_pass_gathers(head):
        return 0
    hidden, weight = head.hidden, head.weight
    cast = hidden.element_size() if hidden.dtype != weight.dtype else 0
    return hidden.shape[1] * (weight.element_size() + cast)


def operand_bias(head: HeadInputs) -> Optional[torch.Tensor]:
    """The bias in the operands' dtype, as ``F.linear`` under autocast adds it (``[V]``: cast whole)."""
    bias = head.bias
    return None if bias is None else bias.to(head.operand_dtype)


def weight_chunk_buffer(head: HeadInputs, cols: int) -> Optional[torch.Tensor]:
    """The ``[cols, H]`` buffer each vocabulary chunk of a weight in another dtype is cast into
    (:meth:`~hf_fused.ops.head_inputs.HeadInputs.weight_rows`, counted by the plan's ``col_bytes``); ``None``
    when the weight is in the operands' dtype (its slices are the operands)."""
    if not head.casts_weight():
        return None
    return torch.empty((min(cols, head.weight.shape[0]), head.weight.shape[1]), dtype=head.operand_dtype,
                       device=head.weight.device)
