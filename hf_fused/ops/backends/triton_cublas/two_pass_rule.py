"""The two passes' rule: the ``[rows, cols]`` tile and the hidden-gradient accumulator, from sizes and budget.

The two passes (8·N·H·V FLOPs, :mod:`.two_passes`) run vocabulary chunks outside and one ``[rows, cols]`` tile in
the weight's dtype; the gradient pass accumulates the hidden-state gradient across chunks
(:func:`hidden_accumulator`): under the default rule in an fp32 ``[M, H]`` buffer beside a
``DEFAULT_TILE_BUDGET_BYTES`` tile (cuBLAS writes it: the fastest two passes); under an explicit budget, for a
bf16 gradient, as a compensated pair (the gradient plus an int8 residual of ``M·H`` bytes, :mod:`.compensated`;
~10% slower). An fp32 gradient is its own accumulator. Under an explicit budget the budget covers the whole
working set (:func:`lean_two_pass_plan`): that residual, the kept hidden rows (one compact copy, or each row
block gathered again for every vocabulary chunk when the copy would leave too little) and the tile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ...tiling import check_tile_budget
from .one_pass_rule import PAIR_RESIDUAL_BYTES

#: Bytes per kept row of the per-row vectors a pass holds beside its buffers (row index and label, int64; the
#: log-sum-exp, entropy, upstream gradients: fp32), counted inside an explicit budget (measured 28 on an H100).
ROW_VECTOR_BYTES = 32
#: Vocabulary chunks are at least this wide (more row blocks instead), multiples of the align.
MIN_CHUNK_COLS = 2048
CHUNK_COL_ALIGN = 128
#: The tile keeps at least this much when the hidden-gradient accumulator takes the rest of the budget (thinner
#: matmuls waste the GPU); the working set then exceeds a budget below accumulator + this.
MIN_TWO_PASS_TILE_BYTES = 32 * 1024**2
#: The lean plan splits the rows into 1, 2, 4, ... blocks down to this many rows per block: smaller blocks make
#: the fp32 weight-gradient chunk accumulate more often than narrower chunks cost.
MIN_LEAN_BLOCK_ROWS = 1024


@dataclass(frozen=True)
class LeanPlan:
    """The two passes under an explicit ``tile_budget_bytes`` (:func:`lean_two_pass_plan`).

    block_rows, cols: the ``[block_rows, cols]`` tile. gather_rows: the kept hidden rows are gathered block by
    block into a ``[block_rows, H]`` buffer for every vocabulary chunk, instead of one compact copy of all of
    them. bytes: the working set the plan holds (at most the budget, but for the floor of
    ``MIN_TWO_PASS_TILE_BYTES`` when the budget cannot hold even that)."""

    block_rows: int
    cols: int
    gather_rows: bool
    bytes: int


def hidden_accumulator(
    n_rows: int, hidden_size: int, grad_dtype: torch.dtype, tile_budget_bytes: Optional[int]
) -> tuple[str, int]:
    """How the gradient pass accumulates the hidden-state gradient of ``n_rows`` kept tokens over vocabulary
    chunks, and the bytes that holds beyond the gradient itself (module docstring): ``("none", 0)`` for an fp32
    gradient (it is the accumulator), ``("pair", PAIR_RESIDUAL_BYTES·M·H)`` for bf16 under an explicit budget
    (the compensated pair's residual), else ``("fp32", 4·M·H)``."""
    if grad_dtype == torch.float32:
        return "none", 0
    if grad_dtype == torch.bfloat16 and tile_budget_bytes is not None:
        return "pair", n_rows * hidden_size * PAIR_RESIDUAL_BYTES
    return "fp32", n_rows * hidden_size * 4


def accumulation_row_bytes(kind: str, hidden_size: int, grad_elem_bytes: int) -> int:
    """Bytes the hidden-gradient accumulation of :func:`hidden_accumulator`'s ``kind`` reads and writes per kept
    row and vocabulary chunk (the lean plan's cost model): the pair's gradient and residual, or an fp32 buffer
    (``"fp32"``, or ``"none"``: an fp32 gradient accumulated in place)."""
    if kind == "pair":
        return 2 * hidden_size * (grad_elem_bytes + PAIR_RESIDUAL_BYTES)
    return 8 * hidden_size


def two_pass_plan(
    n_rows: int, vocab_size: int, elem_bytes: int, tile_budget_bytes: Optional[int], reserved_bytes: int = 0
) -> tuple[int, int]:
    """``(rows per block, columns per chunk)`` of one ``[rows, cols]`` tile in the weight's dtype within the budget
    (``DEFAULT_TILE_BUDGET_BYTES`` by default) less ``reserved_bytes`` but at least ``MIN_TWO_PASS_TILE_BYTES``,
    chunks at least ``MIN_CHUNK_COLS`` wide: the tile of the two passes under the default rule (where the
    budget bounds the tile alone); :func:`lean_two_pass_plan` plans an explicit budget's whole working set.

    Raises:
        ValueError: if the budget is not a positive integer.
    """
    budget = check_tile_budget(tile_budget_bytes)
    if tile_budget_bytes is not None:
        budget = max(budget - reserved_bytes, min(budget, MIN_TWO_PASS_TILE_BYTES))
    cols = budget // (max(n_rows, 1) * elem_bytes)
    if cols >= min(vocab_size, MIN_CHUNK_COLS):
        return max(n_rows, 1), _aligned_cols(cols, vocab_size)
    cols = min(vocab_size, MIN_CHUNK_COLS)
    return max(1, min(n_rows, budget // (cols * elem_bytes))), cols


def _aligned_cols(cols: int, vocab_size: int) -> int:
    return min(vocab_size, max(CHUNK_COL_ALIGN, cols // CHUNK_COL_ALIGN * CHUNK_COL_ALIGN))


def lean_two_pass_options(
    n_rows: int, hidden_size: int, vocab_size: int, elem_bytes: int, tile_budget_bytes: int, *,
    reserved_bytes: int = 0, copy_bytes: int = 0, gather_row_bytes: int = 0, accumulator_row_bytes: int = 0,
    weight_chunk: bool = False, row_quantum: int = 1, col_bytes: int = 0,
) -> list[tuple[bool, int, LeanPlan]]:
    """The plans :func:`lean_two_pass_plan` weighs (its arguments), each as ``(unquantized, moved, plan)``: whether
    its blocks are equal ones despite a ``row_quantum``, the bytes its cost model counts, the plan; empty where
    nothing fits. ``benchmarks.lean_breakdown`` times each.

    Raises:
        ValueError: if the budget is not a positive integer.
    """
    budget = check_tile_budget(tile_budget_bytes)
    m = max(n_rows, 1)
    reserved_bytes += m * ROW_VECTOR_BYTES
    hidden_ways = [(False, copy_bytes, 0)] + ([(True, 0, gather_row_bytes)] if copy_bytes else [])
    options = []  # (equal blocks despite a quantum, bytes moved, plan): whole quanta first, then fewest bytes
    for gather, fixed, row_bytes in hidden_ways:
        avail = budget - reserved_bytes - fixed
        narrow = min(vocab_size, MIN_CHUNK_COLS)
        # the most rows beside the narrowest chunk, then all rows and halvings with their widest chunks
        most = (avail - narrow * col_bytes) // (narrow * elem_bytes + row_bytes)
        equal = {-(-m // -(-m // most))} if most >= 1 else set()  # in equal blocks
        blocks = 1  # m split evenly into 1, 2, 4, ... blocks (m // 2 rows would leave a block of one row)
        while blocks == 1 or -(-m // blocks) >= MIN_LEAN_BLOCK_ROWS:
            equal.add(-(-m // blocks))
            blocks *= 2
        # equal blocks only where no block of whole quanta fits (fewer rows than a quantum, say)
        sizes = [(False, q) for q in _quantized(equal, m, row_quantum)] if row_quantum > 1 else []
        sizes += [(row_quantum > 1, q) for q in equal]
        for unquantized, block_rows in sorted(sizes, key=lambda size: (size[0], -size[1])):
            split = block_rows < m and weight_chunk
            # the tile, its rows and the chunk's cast weight fit
            cols = (avail - block_rows * row_bytes) // (block_rows * elem_bytes + col_bytes)
            if cols < narrow:
                continue
            cols = _aligned_cols(cols, vocab_size)
            chunks, n_blocks = -(-vocab_size // cols), -(-m // block_rows)
            moved = chunks * m * (accumulator_row_bytes + 2 * row_bytes)
            moved += chunks * n_blocks * cols * hidden_size * 8 if split else 0
            used = fixed + reserved_bytes + block_rows * (cols * elem_bytes + row_bytes) + cols * col_bytes
            options.append((unquantized, moved, LeanPlan(block_rows, cols, gather, used)))
    return options


def lean_two_pass_plan(
    n_rows: int, hidden_size: int, vocab_size: int, elem_bytes: int, tile_budget_bytes: int, *,
    reserved_bytes: int = 0, copy_bytes: int = 0, gather_row_bytes: int = 0, accumulator_row_bytes: int = 0,
    weight_chunk: bool = False, row_quantum: int = 1, col_bytes: int = 0,
) -> LeanPlan:
    """The tile of the two passes when ``tile_budget_bytes`` is given: a hard bound on everything the pass
    holds beyond its inputs and outputs, not on the tile alone.

    The working set: ``reserved_bytes`` (the hidden gradient's accumulator, :func:`hidden_accumulator`);
    ``ROW_VECTOR_BYTES`` per row; the kept hidden rows in the weight's dtype, either one compact copy
    (``copy_bytes``, 0 when every row is kept) or a ``[block_rows, H]`` gather buffer (``gather_row_bytes`` per
    row); the ``[block_rows, cols]`` tile; and ``col_bytes`` per chunk column (the ``[cols, H]`` buffer a weight in
    another dtype than the operands' is cast into, chunk by chunk). When several row blocks add into one
    vocabulary chunk's weight gradient (``weight_chunk``), its fp32 ``[cols, H]`` accumulator costs no budget (it
    lives in the weight gradient's unwritten rows or the tile's unused part,
    :func:`~.weight_chunks.weight_gradient_chunks`) but its traffic counts. Among the plans that fit (the rows in 1,
    2, 4, ... equal blocks of at least ``MIN_LEAN_BLOCK_ROWS``, or in the fewest equal blocks beside a ``MIN_CHUNK_COLS``
    chunk; each with its widest chunk), the one that moves the fewest bytes in what it repeats: per vocabulary
    chunk, the accumulator's read and write (``accumulator_row_bytes`` per row) and the gather; per row block and
    chunk, the fp32 weight-gradient chunk's read and write (ties go to the compact copy). With ``row_quantum``
    > 1 a split makes blocks of a whole number of quanta (rounded down and up from the candidates above; the last
    block takes the rest) instead of equal ones, and equal blocks only where none of those fits: the backend
    passes the rows whose accumulation tiles fill whole waves of the GPU's multiprocessors
    (:func:`~.matmul.wave_rows`), because a persistent matmul's last, partly filled wave
    costs a whole one. When nothing fits, the plan of
    :func:`two_pass_plan` with a ``MIN_TWO_PASS_TILE_BYTES`` floor (its ``bytes`` then exceeds the budget).

    Raises:
        ValueError: if the budget is not a positive integer.
    """
    options = lean_two_pass_options(
        n_rows, hidden_size, vocab_size, elem_bytes, tile_budget_bytes, reserved_bytes=reserved_bytes,
        copy_bytes=copy_bytes, gather_row_bytes=gather_row_bytes, accumulator_row_bytes=accumulator_row_bytes,
        weight_chunk=weight_chunk, row_quantum=row_quantum, col_bytes=col_bytes)
    if options:  # the first of the cheapest: the compact copy, then larger blocks, win ties
        return min(options, key=lambda option: option[:2])[2]
    m = max(n_rows, 1)
    reserved_bytes += m * ROW_VECTOR_BYTES
    block_rows, cols = two_pass_plan(n_rows, vocab_size, elem_bytes, tile_budget_bytes, reserved_bytes + copy_bytes)
    block_rows = -(-m // -(-m // block_rows))  # the same number of blocks, equal
    return LeanPlan(block_rows, cols, False,
                    reserved_bytes + copy_bytes + block_rows * cols * elem_bytes + cols * col_bytes)


def _quantized(candidates: set[int], m: int, quantum: int) -> set[int]:
    """The block sizes of ``candidates`` as whole numbers of ``quantum`` rows, each rounded down and up; ``m``
    where that reaches all ``m`` rows (one block)."""
    return {min(q, m) for rows in candidates for q in (rows // quantum * quantum, -(-rows // quantum) * quantum)
            if q > 0}


def two_pass_tile_plan(
    n_rows: int, hidden_size: int, vocab_size: int, elem_bytes: int, tile_budget_bytes: Optional[int], *,
    copy_bytes: int = 0, gather_row_bytes: int = 0, reserved_bytes: int = 0, accumulator_row_bytes: int = 0,
    weight_chunk: bool = False, row_quantum: int = 1, col_bytes: int = 0,
) -> LeanPlan:
    """The two passes' tile for ``n_rows`` kept rows: under the default rule (``tile_budget_bytes=None``)
    :func:`two_pass_plan`'s, the tile alone within ``DEFAULT_TILE_BUDGET_BYTES`` beside one compact copy of the
    kept rows (and the cast weight chunk, ``col_bytes`` per column); under an explicit budget
    :func:`lean_two_pass_plan`'s, with every keyword as there.

    Raises:
        ValueError: if an explicit budget is not a positive integer.
    """
    if tile_budget_bytes is None:
        block_rows, cols = two_pass_plan(n_rows, vocab_size, elem_bytes, None)
        return LeanPlan(block_rows, cols, False, block_rows * cols * elem_bytes)
    return lean_two_pass_plan(
        n_rows, hidden_size, vocab_size, elem_bytes, tile_budget_bytes, reserved_bytes=reserved_bytes,
        copy_bytes=copy_bytes, gather_row_bytes=gather_row_bytes, accumulator_row_bytes=accumulator_row_bytes,
        weight_chunk=weight_chunk, row_quantum=row_quantum, col_bytes=col_bytes,
    )
