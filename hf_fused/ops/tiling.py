"""Tile planning: every memory decision of the ops, in one place.

The torch reference: a tile's working set is the fp32 logits plus the temporaries made from them
(probabilities, the soft-cap's tanh, the logits-gradient): ``TILE_BUFFERS`` fp32 arrays of ``[rows, V]``,
kept inside ``tile_budget_bytes`` (:func:`rows_per_tile`).

The GPU backend has two schedules (:mod:`hf_fused.ops.backends.triton_cublas`):

- one pass (6·N·H·V FLOPs): token rows outside, whole vocabulary rows per tile, gradients right after each
  row block's log-sum-exp; it holds a ``[rows, V]`` tile in the weight's dtype and a ``[V, H]`` weight-gradient
  accumulator (:func:`one_pass_plan`): ``"fp32"``, the fastest: for the 2-byte (bf16, fp16) gradient it is
  made for, the fp32 sums of its first V/2 rows in the gradient's own bytes and the rest in a buffer
  (:func:`hf_fused.ops.grads.split_accumulator`), 2·V·H bytes beside the gradient; ``"pair"`` for a bf16 weight
  gradient, the gradient itself plus an int8 residual of V·H bytes (:mod:`hf_fused.ops.backends.compensated`,
  as accurate as the fp32 buffer, its fold ~20% slower than cuBLAS's fp32 accumulation); ``"none"`` for a
  frozen lm_head, or for an fp32 weight gradient (fp32 master weights), which is its own accumulator;
- two passes (8·N·H·V): vocabulary chunks outside, one ``[rows, cols]`` tile; the memory-lean path. Its
  gradient pass also accumulates the hidden-state gradient across vocabulary chunks (:func:`hidden_accumulator`):
  under the default rule in an fp32 ``[M, H]`` buffer beside a ``DEFAULT_TILE_BUDGET_BYTES`` tile (cuBLAS
  writes it: the fastest two passes); under an explicit budget, for a bf16 gradient, as a compensated pair
  (the gradient itself plus an int8 residual of ``M·H`` bytes, no less accurate than the fp32 buffer,
  :mod:`hf_fused.ops.backends.compensated`; ~10% slower). An fp32 gradient is its own accumulator. Under an
  explicit budget the budget covers the whole working set (:func:`lean_two_pass_plan`): that residual, the kept
  hidden rows (one compact copy, or each row block gathered again for every vocabulary chunk when the copy
  would leave too little) and the tile. When several row blocks add into one vocabulary chunk's weight gradient,
  its fp32 accumulator takes no memory beyond the gradient: it lives in the bf16 gradient's own rows that are
  not written yet, or, near the vocabulary's end, in the tile's unused part (:func:`weight_gradient_chunks`).

**The default rule** (``tile_budget_bytes=None``) on a CUDA device: the one pass with
``ONE_PASS_TILE_ROWS`` rows per tile whenever its working set fits in ``ONE_PASS_FREE_SHARE`` of the memory
free on the device at the call (the driver's free memory plus what PyTorch's allocator holds unused), with the
fp32 accumulator, or else (bf16 weight gradient) with the pair; otherwise two passes with a
``DEFAULT_TILE_BUDGET_BYTES`` tile. An explicit ``tile_budget_bytes`` is a hard bound instead: the one pass only
if the budget holds its working set (the accumulator, the kept rows' fp32 hidden gradient, each tile's gathered rows, and a
tile of at least ``MIN_ONE_PASS_ROWS`` rows; rows per tile in multiples of ``ONE_PASS_ROW_ALIGN``) — with the fp32
accumulator when that leaves ``ONE_PASS_TILE_ROWS`` rows, else with whichever accumulator leaves more rows —
otherwise two passes within the budget. On other devices the default is that bound at
``DEFAULT_TILE_BUDGET_BYTES``. :func:`describe_plan` says which schedule a call would take; :func:`forced_plans`
replaces the rule inside a block (tile sweeps in ``benchmarks.plan_sweep``, tests).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional, Union

import torch

#: Default bound on the memory one tile may use (bytes).
DEFAULT_TILE_BUDGET_BYTES = 256 * 1024**2

#: fp32 ``[rows, V]`` arrays alive at once inside one tile of the reference backend.
TILE_BUFFERS = 3

#: GPU one pass: rows per full-vocabulary tile under the default rule (1024-row tiles measured 11 ms slower
#: at 32768×2048×151936 on an H100: the dW accumulation GEMM's K dimension is the tile's rows).
ONE_PASS_TILE_ROWS = 2048
#: GPU one pass with an explicit budget: fewer rows than this and it is not worth it (two passes instead).
MIN_ONE_PASS_ROWS = 512
#: GPU one pass: rows per tile are a multiple of this, so that every tile's slices of the per-row vectors (fp32,
#: int64) start 16-byte aligned, as QuACK's TMA loads and stores of them require.
ONE_PASS_ROW_ALIGN = 8
#: GPU default rule: the one pass's working set may take at most this share of the device's free memory.
ONE_PASS_FREE_SHARE = 0.25
#: Bytes per kept row of the per-row vectors a pass holds beside its buffers (row index and label, int64; the
#: log-sum-exp, entropy, upstream gradients: fp32), counted inside an explicit budget (measured 28 on an H100).
ROW_VECTOR_BYTES = 32
#: Bytes per element of the compensated pair's residual (``compensated.RESIDUAL_DTYPE``, int8 fixed point; kept
#: here because this module must import without Triton; a test checks that the two agree).
PAIR_RESIDUAL_BYTES = 1
#: GPU two passes: vocabulary chunks are at least this wide (more row blocks instead), multiples of the align.
MIN_CHUNK_COLS = 2048
CHUNK_COL_ALIGN = 128
#: GPU two passes: the tile keeps at least this much when the hidden-gradient accumulator takes the rest of the
#: budget (thinner matmuls waste the GPU); the working set then exceeds a budget below accumulator + this.
MIN_TWO_PASS_TILE_BYTES = 32 * 1024**2


def check_tile_budget(tile_budget_bytes: Optional[int]) -> int:
    """The budget in bytes (the default for ``None``).

    Raises:
        ValueError: if the budget is not a positive integer.
    """
    budget = DEFAULT_TILE_BUDGET_BYTES if tile_budget_bytes is None else tile_budget_bytes
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise ValueError(f"tile_budget_bytes must be a positive int (bytes), got {budget!r}")
    return budget


def validate_tile_budget(tile_budget_bytes: Optional[int]) -> Optional[int]:
    """``tile_budget_bytes`` unchanged after checking it; ``None`` stays ``None`` (the default rule decides).

    Raises:
        ValueError: if the budget is not ``None`` or a positive integer.
    """
    return None if tile_budget_bytes is None else check_tile_budget(tile_budget_bytes)


def rows_per_tile(vocab_size: int, tile_budget_bytes: Optional[int] = None) -> int:
    """Token rows per tile so that ``TILE_BUFFERS`` fp32 ``[rows, vocab_size]`` arrays fit the budget.

    Raises:
        ValueError: if the budget is not a positive integer.
    """
    return max(1, check_tile_budget(tile_budget_bytes) // (TILE_BUFFERS * 4 * max(1, vocab_size)))


def tiles(rows: torch.Tensor, tile_rows: int) -> Iterator[torch.Tensor]:
    """Consecutive slices of the row index vector ``rows``, ``tile_rows`` at a time."""
    for start in range(0, rows.numel(), tile_rows):
        yield rows[start : start + tile_rows]


# -- the GPU backend's schedules ------------------------------------------------------------------------


#: Bytes per ``[V, H]`` element of each one-pass weight-gradient accumulator beyond the gradient itself.
ACCUMULATOR_BYTES = {"none": 0, "fp32": 2, "pair": PAIR_RESIDUAL_BYTES}


def one_pass_working_set(
    vocab_size: int, hidden_size: int, elem_bytes: int, accumulator: str, rows: int, extra_bytes: int = 0,
    gather_row_bytes: int = 0,
) -> int:
    """Bytes the GPU one pass holds beyond inputs and outputs: the ``accumulator``'s (:data:`ACCUMULATOR_BYTES`
    per ``[V, H]`` element), a ``[rows, V]`` tile in the weight's dtype, ``gather_row_bytes`` per tile row (where
    ignored tokens are dropped, each tile's kept hidden rows are gathered into a ``[rows, H]`` buffer, through
    hidden's dtype when it differs), and ``extra_bytes`` (what depends on the call's token rows: the kept rows'
    fp32 hidden-state gradient, held until backward).

    Raises:
        ValueError: on an ``accumulator`` not in :data:`ACCUMULATOR_BYTES`.
    """
    if accumulator not in ACCUMULATOR_BYTES:
        raise ValueError(f"accumulator must be one of {sorted(ACCUMULATOR_BYTES)}, got {accumulator!r}")
    return (vocab_size * hidden_size * ACCUMULATOR_BYTES[accumulator] + rows * (vocab_size * elem_bytes + gather_row_bytes)
            + extra_bytes)


def free_device_bytes(device: torch.device) -> Optional[int]:
    """Memory a new allocation can take on a CUDA ``device`` (driver-free plus the caching allocator's reserved
    but unallocated bytes); ``None`` elsewhere."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    # the allocator's nested statistics read once: memory_reserved() and memory_allocated() each flatten the
    # whole dict in Python (~0.3 ms apiece on an H200, right after the call's host sync, with the GPU idle)
    stats = torch.cuda.memory_stats_as_nested_dict(device)
    current = lambda key: stats.get(key, {}).get("all", {}).get("current", 0)  # noqa: E731
    return free + current("reserved_bytes") - current("allocated_bytes")


@dataclass(frozen=True)
class OnePassPlan:
    """The GPU one pass of a call: ``rows`` per full-vocabulary tile, the weight-gradient ``accumulator``
    (``"none"``, ``"fp32"`` or ``"pair"``, module docstring) and the working set in ``bytes`` at those rows."""

    rows: int
    accumulator: str
    bytes: int


#: What :func:`forced_plans` put in place of the rule (empty outside such a block).
_FORCED: dict = {}


@contextlib.contextmanager
def forced_plans(*, one_pass: Union[None, bool, "OnePassPlan"] = None, two_pass: Optional["LeanPlan"] = None):
    """Within the block the GPU backend takes these plans instead of the rule's, for every call: ``one_pass`` an
    :class:`OnePassPlan` (its ``rows`` per tile, and its ``accumulator`` where the call can use it, else the call's
    first choice: ``"none"`` for a frozen head or an fp32 weight gradient, ``"fp32"`` for fp16), or ``False`` for
    the two passes, or ``None`` (the rule decides); ``two_pass`` a
    :class:`LeanPlan` for the two passes' tile (``gather_rows`` included), or ``None``. For developers' tile
    sweeps (``python -m benchmarks.plan_sweep``) and tests: budgets are not checked, and the setting is
    process-wide, not per thread.

    Raises:
        TypeError: on a ``one_pass`` or ``two_pass`` of another type.
    """
    if not (one_pass is None or one_pass is False or isinstance(one_pass, OnePassPlan)):
        raise TypeError(f"forced_plans: one_pass must be a OnePassPlan, False or None, got {one_pass!r}")
    if not (two_pass is None or isinstance(two_pass, LeanPlan)):
        raise TypeError(f"forced_plans: two_pass must be a LeanPlan or None, got {two_pass!r}")
    previous = dict(_FORCED)
    _FORCED.update({k: v for k, v in (("one_pass", one_pass), ("two_pass", two_pass)) if v is not None})
    try:
        yield
    finally:
        _FORCED.clear()
        _FORCED.update(previous)


def forced_two_pass_plan() -> Optional["LeanPlan"]:
    """The two passes' tile a :func:`forced_plans` block put in place (``None`` outside one)."""
    return _FORCED.get("two_pass")


def one_pass_plan(
    vocab_size: int,
    hidden_size: int,
    elem_bytes: int,
    accumulators: tuple[str, ...],
    tile_budget_bytes: Optional[int],
    device: torch.device,
    extra_bytes: int = 0,
    gather_row_bytes: int = 0,
) -> Optional[OnePassPlan]:
    """The one pass the module docstring's rule picks, or ``None`` for the two passes.

    Args:
        accumulators: the weight-gradient accumulators the call can use, fastest first: ``("none",)`` when it
            needs none (frozen lm_head, fp32 weight gradient), ``("fp32", "pair")`` for a bf16 one on the GPU
            backend, ``("fp32",)`` otherwise.
        extra_bytes, gather_row_bytes: as in :func:`one_pass_working_set`.

    Raises:
        ValueError: if an explicit budget is not a positive integer, or ``accumulators`` is empty.
    """
    if not accumulators:
        raise ValueError("one_pass_plan needs at least one accumulator kind")
    forced = _FORCED.get("one_pass")
    if forced is not None:
        if forced is False:
            return None
        return forced if forced.accumulator in accumulators else OnePassPlan(forced.rows, accumulators[0], forced.bytes)
    # the fastest accumulator while it keeps full-size tiles (fewer rows per tile cost more than its speed gives:
    # 1024-row tiles were 11 ms slower at 32768×2048×151936 on an H100), else the one leaving the most rows; the
    # next kind is asked only when the faster one falls short (the default rule reads free memory per ask)
    best_rows, best_kind = 0, None
    for kind in accumulators:
        rows = one_pass_rows(vocab_size, hidden_size, elem_bytes, kind, tile_budget_bytes, device, extra_bytes,
                             gather_row_bytes)
        if rows >= ONE_PASS_TILE_ROWS:
            best_rows, best_kind = rows, kind
            break
        if rows > best_rows:
            best_rows, best_kind = rows, kind
    if best_kind is None:
        return None
    size = one_pass_working_set(vocab_size, hidden_size, elem_bytes, best_kind, best_rows, extra_bytes,
                                gather_row_bytes)
    return OnePassPlan(best_rows, best_kind, size)


def one_pass_rows(
    vocab_size: int,
    hidden_size: int,
    elem_bytes: int,
    accumulator: str,
    tile_budget_bytes: Optional[int],
    device: torch.device,
    extra_bytes: int = 0,
    gather_row_bytes: int = 0,
) -> int:
    """Rows per full-vocabulary tile of the GPU one pass with this ``accumulator``, or 0 where it does not fit
    (module docstring's rule); ``extra_bytes`` and ``gather_row_bytes`` as in :func:`one_pass_working_set`.

    Raises:
        ValueError: if an explicit budget is not a positive integer.
    """
    if tile_budget_bytes is None:
        free = free_device_bytes(device)
        if free is not None:
            needed = one_pass_working_set(vocab_size, hidden_size, elem_bytes, accumulator, ONE_PASS_TILE_ROWS,
                                          extra_bytes, gather_row_bytes)
            return ONE_PASS_TILE_ROWS if needed <= ONE_PASS_FREE_SHARE * free else 0
    budget = check_tile_budget(tile_budget_bytes)
    rows = (budget - one_pass_working_set(vocab_size, hidden_size, elem_bytes, accumulator, 0, extra_bytes)) // (
        vocab_size * elem_bytes + gather_row_bytes
    )
    rows -= rows % ONE_PASS_ROW_ALIGN
    return rows if rows >= MIN_ONE_PASS_ROWS else 0


def one_pass_accumulators(need_weight: bool, grad_dtype: torch.dtype, operand_dtype: torch.dtype) -> tuple[str, ...]:
    """The one pass's weight-gradient accumulators for a call, fastest first (:func:`one_pass_plan`): none
    without a weight gradient or for an fp32 one (it is the accumulator), ``"fp32"`` or the compensated
    ``"pair"`` for a bf16 gradient of bf16 operands (the pair's matmul takes bf16 only), ``"fp32"`` otherwise."""
    if not need_weight or grad_dtype == torch.float32:
        return ("none",)
    if grad_dtype == operand_dtype == torch.bfloat16:
        return ("fp32", "pair")
    return ("fp32",)


def hidden_accumulator(
    n_rows: int, hidden_size: int, grad_dtype: torch.dtype, tile_budget_bytes: Optional[int]
) -> tuple[str, int]:
    """How the GPU gradient pass accumulates the hidden-state gradient of ``n_rows`` kept tokens over vocabulary
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
    chunks at least ``MIN_CHUNK_COLS`` wide: the tile of the GPU two passes under the default rule (where the
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


@dataclass(frozen=True)
class LeanPlan:
    """The GPU two passes under an explicit ``tile_budget_bytes`` (:func:`lean_two_pass_plan`).

    block_rows, cols: the ``[block_rows, cols]`` tile. gather_rows: the kept hidden rows are gathered block by
    block into a ``[block_rows, H]`` buffer for every vocabulary chunk, instead of one compact copy of all of
    them. bytes: the working set the plan holds (at most the budget, but for the floor of
    ``MIN_TWO_PASS_TILE_BYTES`` when the budget cannot hold even that)."""

    block_rows: int
    cols: int
    gather_rows: bool
    bytes: int


#: The lean plan splits the rows into 1, 2, 4, ... blocks down to this many rows per block: smaller blocks make
#: the fp32 weight-gradient chunk accumulate more often than narrower chunks cost.
MIN_LEAN_BLOCK_ROWS = 1024


def lean_two_pass_plan(
    n_rows: int, hidden_size: int, vocab_size: int, elem_bytes: int, tile_budget_bytes: int, *,
    reserved_bytes: int = 0, copy_bytes: int = 0, gather_row_bytes: int = 0, accumulator_row_bytes: int = 0,
    weight_chunk: bool = False, row_quantum: int = 1, col_bytes: int = 0,
) -> LeanPlan:
    """The tile of the GPU two passes when ``tile_budget_bytes`` is given: a hard bound on everything the pass
    holds beyond its inputs and outputs, not on the tile alone.

    The working set: ``reserved_bytes`` (the hidden gradient's accumulator, :func:`hidden_accumulator`);
    ``ROW_VECTOR_BYTES`` per row; the kept hidden rows in the weight's dtype, either one compact copy
    (``copy_bytes``, 0 when every row is kept) or a ``[block_rows, H]`` gather buffer (``gather_row_bytes`` per
    row); the ``[block_rows, cols]`` tile; and ``col_bytes`` per chunk column (the ``[cols, H]`` buffer a weight in
    another dtype than the operands' is cast into, chunk by chunk). When several row blocks add into one
    vocabulary chunk's weight gradient (``weight_chunk``), its fp32 ``[cols, H]`` accumulator costs no budget (it
    lives in the weight gradient's unwritten rows or the tile's unused part, :func:`weight_gradient_chunks`) but
    its traffic counts.
    Among the plans that fit (the rows in 1, 2, 4, ...
    equal blocks of at least ``MIN_LEAN_BLOCK_ROWS``, or in the fewest equal blocks beside a ``MIN_CHUNK_COLS``
    chunk; each with its widest chunk), the one that moves the fewest bytes in what it repeats: per vocabulary
    chunk, the accumulator's read and write (``accumulator_row_bytes`` per row) and the gather; per row block and
    chunk, the fp32 weight-gradient chunk's read and write (ties go to the compact copy). With ``row_quantum``
    > 1 a split makes blocks of a whole number of quanta (rounded down and up from the candidates above; the last
    block takes the rest) instead of equal ones, and equal blocks only where none of those fits: the backend
    passes the rows whose accumulation tiles fill whole waves of the GPU's multiprocessors
    (:func:`~hf_fused.ops.backends.compensated.wave_rows`), because a persistent matmul's last, partly filled wave
    costs a whole one. When nothing fits, the plan of
    :func:`two_pass_plan` with a ``MIN_TWO_PASS_TILE_BYTES`` floor (its ``bytes`` then exceeds the budget).

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
    if options:  # the first of the cheapest: the compact copy, then larger blocks, win ties
        return min(options, key=lambda option: option[:2])[2]
    block_rows, cols = two_pass_plan(n_rows, vocab_size, elem_bytes, tile_budget_bytes, reserved_bytes + copy_bytes)
    block_rows = -(-m // -(-m // block_rows))  # the same number of blocks, equal
    return LeanPlan(block_rows, cols, False,
                    reserved_bytes + copy_bytes + block_rows * cols * elem_bytes + cols * col_bytes)


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
    - ``"buffer"``: an fp32 buffer of its own (a last chunk of fewer than ``TILE_ACCUMULATOR_ALIGN`` columns
      that neither holds).
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
    vocab_size: int, hidden_size: int, plan: "LeanPlan", n_rows: int, elem_bytes: int, grad_elem_bytes: int,
) -> list[WeightChunk]:
    """The gradient pass's vocabulary chunks under ``plan`` for ``n_rows`` kept rows, and where each chunk's
    weight gradient accumulates (:class:`WeightChunk`) so that it needs no memory beyond the gradient and the
    tile: ``plan.cols`` wide while the fp32 accumulator fits in the gradient's unwritten rows (twice the chunk's),
    then, for the vocabulary's last ``2·cols``, the widest of half the rest (in the gradient again) and what the
    tile buffer holds beside the chunk's ``dz``. ``elem_bytes``: the tile's element size; ``grad_elem_bytes``:
    the weight gradient's (4: it is its own accumulator). With one row block, or an fp32 gradient, every chunk
    is ``"direct"`` and ``plan.cols`` wide."""
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
            else:  # fewer than 2·align columns left and no room in the tile
                width, where = rest, "buffer"
        chunks.append(WeightChunk(v0, v0 + width, where))
        v0 += width
    return chunks


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
    """The GPU two passes' tile for ``n_rows`` kept rows: the one a :func:`forced_plans` block set; under the
    default rule (``tile_budget_bytes=None``) :func:`two_pass_plan`'s, the tile alone within
    ``DEFAULT_TILE_BUDGET_BYTES`` beside one compact copy of the kept rows (and the cast weight chunk,
    ``col_bytes`` per column); under an explicit budget
    :func:`lean_two_pass_plan`'s, with every keyword as there.

    Raises:
        ValueError: if an explicit budget is not a positive integer.
    """
    forced = forced_two_pass_plan()
    if forced is not None:
        return forced
    if tile_budget_bytes is None:
        block_rows, cols = two_pass_plan(n_rows, vocab_size, elem_bytes, None)
        return LeanPlan(block_rows, cols, False, block_rows * cols * elem_bytes)
    return lean_two_pass_plan(
        n_rows, hidden_size, vocab_size, elem_bytes, tile_budget_bytes, reserved_bytes=reserved_bytes,
        copy_bytes=copy_bytes, gather_row_bytes=gather_row_bytes, accumulator_row_bytes=accumulator_row_bytes,
        weight_chunk=weight_chunk, row_quantum=row_quantum, col_bytes=col_bytes,
    )


def describe_plan(
    weight: torch.Tensor, *, n_rows: int, tile_budget_bytes: Optional[int] = None, need_weight: Optional[bool] = None,
    n_tokens: Optional[int] = None,
) -> str:
    """One line saying which GPU schedule a call with ``weight`` (``[V, H]``, on its device), ``n_rows``
    non-ignored tokens out of ``n_tokens`` (default: all kept) and hidden states in the weight's dtype that need a
    gradient would take now, and its working set, e.g. for a log line. The torch reference backend (CPU)
    always runs its one pass within ``rows_per_tile``."""
    vocab_size, hidden_size = weight.shape
    need_weight = weight.requires_grad if need_weight is None else need_weight
    elem = weight.element_size()
    copy = 0 if n_tokens is None or n_tokens == n_rows else n_rows * hidden_size * elem
    extra, gather = n_rows * hidden_size * 4, hidden_size * elem if copy else 0
    plan = one_pass_plan(vocab_size, hidden_size, elem, one_pass_accumulators(need_weight, weight.dtype, weight.dtype),
                         tile_budget_bytes, weight.device, extra, gather)
    if plan:
        size = one_pass_working_set(vocab_size, hidden_size, elem, plan.accumulator, min(plan.rows, max(n_rows, 1)),
                                    extra, gather)
        return (f"one pass (6·N·H·V): {plan.rows} rows per tile, {size / 2**30:.2f} GiB working set with the "
                f"weight-gradient accumulator {plan.accumulator!r}")
    kind, acc = hidden_accumulator(n_rows, hidden_size, weight.dtype, tile_budget_bytes)
    quantum = 1
    if kind == "pair" and weight.is_cuda:  # the backend's row blocks for the pair's persistent matmul
        from .backends.compensated import wave_rows

        quantum = wave_rows(hidden_size, weight.device)
    plan = two_pass_tile_plan(n_rows, hidden_size, vocab_size, elem, tile_budget_bytes, reserved_bytes=acc,
                              copy_bytes=copy, gather_row_bytes=hidden_size * elem,
                              accumulator_row_bytes=accumulation_row_bytes(kind, hidden_size, elem),
                              weight_chunk=need_weight, row_quantum=quantum)
    block_rows, cols, size = plan.block_rows, plan.cols, plan.bytes
    if tile_budget_bytes is None:  # the default's tile is its own budget: the accumulator and copy come beside it
        size += acc + copy
    rows_how = "gathered per block" if plan.gather_rows else "a compact copy" if copy else "in place"
    return (f"two passes (8·N·H·V): {block_rows}×{cols} tile, {size / 2**30:.2f} GiB working set with the "
            f"hidden-state gradient's accumulator ({kind}, for {weight.dtype} hidden states), kept rows {rows_how}")
