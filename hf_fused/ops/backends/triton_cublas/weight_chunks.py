"""Where the two passes' weight gradient adds up over row blocks, with no memory beyond the gradient and the tile.

Each vocabulary chunk's weight gradient ``dW[v0:v1]`` is complete after its chunk: cuBLAS reduces over all rows in
fp32 and rounds once. When several row blocks add into one chunk, its fp32 ``[cols, H]`` accumulator lives in the
bf16 gradient's own rows that no chunk has written yet, or, near the vocabulary's end, in the tile buffer's unused
part (:func:`weight_gradient_chunks`), so the ``[V, H]`` gradient is never held in fp32 and the accumulator takes
no memory of its own. :func:`chunk_buffers` gives a chunk its views, :func:`round_chunk_into_` its one rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ...grads import fp32_view, round_rows_in_place_
from .scaled_round import mul_into
from .two_pass_rule import LeanPlan


@dataclass(frozen=True)
class WeightChunk:
    """One vocabulary chunk ``[v0, v1)`` of the two passes' gradient pass, and where its weight gradient adds up
    over the row blocks (``accumulator``, :func:`weight_gradient_chunks`):

    - ``"direct"``: written by one matmul per row block into the gradient itself: one row block, or an fp32
      gradient that is its own accumulator;
    - ``"gradient"``: an fp32 ``[v1 − v0, H]`` accumulator in the 2-byte gradient's rows
      ``[v0, v0 + 2·(v1 − v0))``, which no chunk has written yet, rounded into rows ``[v0, v1)`` at the chunk's end;
    - ``"tile"``: the accumulator in the tile buffer's bytes from :func:`tile_accumulator_offset`, the chunk's
      ``dz`` packed before it;
    - ``"buffer"``: an fp32 buffer of its own (the last fewer than ``2·TILE_ACCUMULATOR_ALIGN`` columns, which
      neither holds: one chunk, or several no wider than the tile where a forced plan's tile is narrower).
    """

    v0: int
    v1: int
    accumulator: str


#: Columns of a chunk whose weight-gradient accumulator shares the tile buffer are packed in rows of a multiple
#: of this many elements (16-byte rows for TMA) and the accumulator starts 16-byte aligned after them.
TILE_ACCUMULATOR_ALIGN = 8


def tile_accumulator_offset(block_rows: int, cols: int, elem_bytes: int) -> int:
    """Byte offset in the tile buffer of a ``"tile"`` chunk's fp32 accumulator: after its ``[block_rows, cols]``
    ``dz`` packed in rows of ``cols`` rounded up to ``TILE_ACCUMULATOR_ALIGN`` elements, 16-byte aligned."""
    row = -(-cols // TILE_ACCUMULATOR_ALIGN) * TILE_ACCUMULATOR_ALIGN
    return -(-block_rows * row * elem_bytes // 16) * 16


def weight_gradient_chunks(
    vocab_size: int, hidden_size: int, plan: LeanPlan, n_rows: int, elem_bytes: int, grad_elem_bytes: int,
) -> list[WeightChunk]:
    """The gradient pass's vocabulary chunks under ``plan`` for ``n_rows`` kept rows, and where each chunk's
    weight gradient accumulates (:class:`WeightChunk`) so that it needs no memory beyond the gradient and the
    tile: ``plan.cols`` wide while the fp32 accumulator fits in the gradient's unwritten rows (twice the chunk's),
    then, for the vocabulary's last ``2·cols``, the widest of half the rest (in the gradient again) and what the
    tile buffer holds beside the chunk's ``dz``. No chunk is wider than ``plan.cols`` (its ``dz`` is a view of the
    ``[block_rows, cols]`` tile). ``elem_bytes``: the tile's element size; ``grad_elem_bytes``: the weight
    gradient's (4: it is its own accumulator). With one row block, or an fp32 gradient, every chunk is
    ``"direct"`` and ``plan.cols`` wide."""
    cols, block_rows = plan.cols, plan.block_rows
    if block_rows >= n_rows or grad_elem_bytes >= 4:
        return [WeightChunk(v0, min(v0 + cols, vocab_size), "direct") for v0 in range(0, vocab_size, cols)]
    align = TILE_ACCUMULATOR_ALIGN
    # the widest multiple of `align` whose packed dz and fp32 accumulator fit in the tile buffer together
    tile_cols = max(0, (block_rows * cols * elem_bytes - 16) // (block_rows * elem_bytes + 4 * hidden_size))
    tile_cols = tile_cols // align * align
    chunks, v0 = [], 0
    while v0 < vocab_size:
        rest = vocab_size - v0
        width, where = min(cols, rest), "gradient"
        if 2 * width > rest:
            half, fit = rest // 2 // align * align, min(width, tile_cols)
            if fit and fit >= half:  # the rest in one tile chunk, or in two of about equal width
                even = min(fit, -(-((rest + 1) // 2) // align) * align)  # half the rest, rounded up to `align`
                width, where = (rest if rest <= fit else fit if rest > 2 * fit else even), "tile"
            elif half:
                width = half
            else:  # fewer than 2·align columns left and no room in the tile; a forced tile may be narrower still
                width, where = min(rest, cols), "buffer"
        chunks.append(WeightChunk(v0, v0 + width, where))
        v0 += width
    return chunks


def chunk_buffers(chunk: WeightChunk, tile_buf: torch.Tensor, grad_weight: Optional[torch.Tensor],
                   hidden_size: int, several_blocks: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(the [block_rows, v1 − v0] view of tile_buf that the chunk's dz goes to, its fp32 [v1 − v0, H]
    weight-gradient accumulator or None)`` where ``chunk.accumulator`` says (:class:`~hf_fused.ops.tiling.
    WeightChunk`): for ``"direct"``, ``None`` (one row block writes the gradient itself) or, over
    ``several_blocks``, an fp32 gradient's own rows; the gradient's unwritten rows seen as fp32; the tile buffer
    behind a packed dz; or a new buffer."""
    width, block_rows = chunk.v1 - chunk.v0, tile_buf.shape[0]
    if grad_weight is None or chunk.accumulator == "direct":
        in_place = several_blocks and grad_weight is not None and grad_weight.dtype == torch.float32
        return tile_buf[:, :width], (grad_weight[chunk.v0 : chunk.v1] if in_place else None)
    acc = None
    if chunk.accumulator == "tile":
        flat, row = tile_buf.view(-1), -(-width // TILE_ACCUMULATOR_ALIGN) * TILE_ACCUMULATOR_ALIGN
        offset = tile_accumulator_offset(block_rows, width, tile_buf.element_size()) // tile_buf.element_size()
        tile = flat[: block_rows * row].view(block_rows, row)[:, :width]
        acc = fp32_view(flat[offset : offset + 4 * width * hidden_size // tile_buf.element_size()], width)
    else:
        tile = tile_buf[:, :width]
        if chunk.accumulator == "gradient":
            acc = fp32_view(grad_weight[chunk.v0 : chunk.v0 + 2 * width].view(-1), width)
    if acc is None:  # "buffer", or a view whose start is not 4-byte aligned (an odd H)
        acc = torch.empty((width, hidden_size), dtype=torch.float32, device=tile_buf.device)
    return tile, acc


def round_chunk_into_(grad_weight: torch.Tensor, chunk: WeightChunk, acc: torch.Tensor, tile_buf: torch.Tensor) -> None:
    """``grad_weight[v0:v1] = acc`` rounded once (the chunk's fp32 accumulator, :func:`chunk_buffers`). For a
    ``"gradient"`` chunk ``acc`` is the gradient's own rows ``[v0, v0 + 2·width)``: rounded in place
    (:func:`~hf_fused.ops.grads.round_rows_in_place_`) through the now free tile buffer."""
    out = grad_weight[chunk.v0 : chunk.v1]
    if chunk.accumulator == "direct":  # an fp32 gradient, its own accumulator
        return
    if chunk.accumulator != "gradient" or acc.data_ptr() != out.data_ptr():  # "tile", "buffer" or a fallback
        out.copy_(acc)
        return
    round_rows_in_place_(out, acc, tile_buf.view(-1).view(grad_weight.dtype), mul_into=mul_into)
