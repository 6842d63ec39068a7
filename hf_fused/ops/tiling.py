"""Tile planning: every memory decision of the ops, in one place.

The torch reference: a tile's working set is the fp32 logits plus the temporaries made from them
(probabilities, the soft-cap's tanh, the logits-gradient): ``TILE_BUFFERS`` fp32 arrays of ``[rows, V]``,
kept inside ``tile_budget_bytes`` (:func:`rows_per_tile`).

The GPU backend has two schedules (:mod:`hf_fused.ops.backends.triton_cublas`):

- one pass (6·N·H·V FLOPs): token rows outside, whole vocabulary rows per tile, gradients right after each
  row block's log-sum-exp; it holds an fp32 ``[V, H]`` weight-gradient accumulator (none for a frozen
  lm_head) plus a ``[rows, V]`` tile in the weight's dtype (:func:`one_pass_rows`);
- two passes (8·N·H·V): vocabulary chunks outside, one ``[rows, cols]`` tile; the memory-lean path. Its
  gradient pass also accumulates the hidden-state gradient across vocabulary chunks (:func:`hidden_accumulator`):
  under the default rule in an fp32 ``[M, H]`` buffer beside a ``DEFAULT_TILE_BUDGET_BYTES`` tile (cuBLAS
  writes it: the fastest two passes); under an explicit budget, for a bf16 gradient, as a compensated pair
  (the gradient itself plus a bf16 residual of ``2·M·H`` bytes, no less accurate than the fp32 buffer,
  :mod:`hf_fused.ops.backends.compensated`; ~10% slower), and the budget then covers the tile and that
  accumulator together (:func:`two_pass_plan`). An fp32 gradient is its own accumulator.

**The default rule** (``tile_budget_bytes=None``) on a CUDA device: the one pass with
``ONE_PASS_TILE_ROWS`` rows per tile whenever its working set fits in ``ONE_PASS_FREE_SHARE`` of the memory
free on the device at the call (the driver's free memory plus what PyTorch's allocator holds unused);
otherwise two passes with a ``DEFAULT_TILE_BUDGET_BYTES`` tile. An explicit ``tile_budget_bytes`` is a hard
bound instead: the one pass only if the budget holds its working set with at least ``MIN_ONE_PASS_ROWS``
rows, otherwise two passes within the budget. On other devices the default is that bound at
``DEFAULT_TILE_BUDGET_BYTES``. :func:`describe_plan` says which schedule a call would take.
"""

from __future__ import annotations

from typing import Iterator, Optional

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
#: GPU default rule: the one pass's working set may take at most this share of the device's free memory.
ONE_PASS_FREE_SHARE = 0.25
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


def one_pass_working_set(vocab_size: int, hidden_size: int, elem_bytes: int, need_weight: bool, rows: int) -> int:
    """Bytes the GPU one pass holds beyond inputs and outputs: the fp32 ``[V, H]`` accumulator (when the
    weight needs a gradient) and a ``[rows, V]`` tile in the weight's dtype."""
    return (vocab_size * hidden_size * 4 if need_weight else 0) + rows * vocab_size * elem_bytes


def free_device_bytes(device: torch.device) -> Optional[int]:
    """Memory a new allocation can take on a CUDA ``device`` (driver-free plus the caching allocator's reserved
    but unallocated bytes); ``None`` elsewhere."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def one_pass_rows(
    vocab_size: int,
    hidden_size: int,
    elem_bytes: int,
    need_weight: bool,
    tile_budget_bytes: Optional[int],
    device: torch.device,
) -> int:
    """Rows per full-vocabulary tile of the GPU one pass, or 0 for the two passes (module docstring's rule).

    Raises:
        ValueError: if an explicit budget is not a positive integer.
    """
    if tile_budget_bytes is None:
        free = free_device_bytes(device)
        if free is not None:
            needed = one_pass_working_set(vocab_size, hidden_size, elem_bytes, need_weight, ONE_PASS_TILE_ROWS)
            return ONE_PASS_TILE_ROWS if needed <= ONE_PASS_FREE_SHARE * free else 0
    budget = check_tile_budget(tile_budget_bytes)
    rows = (budget - one_pass_working_set(vocab_size, hidden_size, elem_bytes, need_weight, 0)) // (
        vocab_size * elem_bytes
    )
    return rows if rows >= MIN_ONE_PASS_ROWS else 0


def hidden_accumulator(
    n_rows: int, hidden_size: int, grad_dtype: torch.dtype, tile_budget_bytes: Optional[int]
) -> tuple[str, int]:
    """How the GPU gradient pass accumulates the hidden-state gradient of ``n_rows`` kept tokens over vocabulary
    chunks, and the bytes that holds beyond the gradient itself (module docstring): ``("none", 0)`` for an fp32
    gradient (it is the accumulator), ``("pair", 2·M·H)`` for bf16 under an explicit budget (the compensated
    pair's residual), else ``("fp32", 4·M·H)``."""
    if grad_dtype == torch.float32:
        return "none", 0
    if grad_dtype == torch.bfloat16 and tile_budget_bytes is not None:
        return "pair", n_rows * hidden_size * 2
    return "fp32", n_rows * hidden_size * 4


def two_pass_plan(
    n_rows: int, vocab_size: int, elem_bytes: int, tile_budget_bytes: Optional[int], reserved_bytes: int = 0
) -> tuple[int, int]:
    """``(rows per block, columns per chunk)`` of the GPU two passes: one ``[rows, cols]`` tile in the weight's
    dtype within the budget (``DEFAULT_TILE_BUDGET_BYTES`` by default) less ``reserved_bytes`` (under an explicit
    budget, the gradient pass's hidden accumulator, :func:`hidden_accumulator`) but at least
    ``MIN_TWO_PASS_TILE_BYTES``, chunks at least ``MIN_CHUNK_COLS`` wide.

    Raises:
        ValueError: if the budget is not a positive integer.
    """
    budget = check_tile_budget(tile_budget_bytes)
    if tile_budget_bytes is not None:  # the default rule bounds the tile alone
        budget = max(budget - reserved_bytes, min(budget, MIN_TWO_PASS_TILE_BYTES))
    cols = budget // (max(n_rows, 1) * elem_bytes)
    if cols >= min(vocab_size, MIN_CHUNK_COLS):
        cols = min(vocab_size, max(CHUNK_COL_ALIGN, cols // CHUNK_COL_ALIGN * CHUNK_COL_ALIGN))
        return max(n_rows, 1), cols
    cols = min(vocab_size, MIN_CHUNK_COLS)
    return max(1, min(n_rows, budget // (cols * elem_bytes))), cols


def describe_plan(
    weight: torch.Tensor, *, n_rows: int, tile_budget_bytes: Optional[int] = None, need_weight: Optional[bool] = None
) -> str:
    """One line saying which GPU schedule a call with ``weight`` (``[V, H]``, on its device) and ``n_rows``
    non-ignored tokens would take now, and its working set, e.g. for a log line. The torch reference
    backend (CPU) always runs its one pass within ``rows_per_tile``."""
    vocab_size, hidden_size = weight.shape
    need_weight = weight.requires_grad if need_weight is None else need_weight
    elem = weight.element_size()
    rows = one_pass_rows(vocab_size, hidden_size, elem, need_weight, tile_budget_bytes, weight.device)
    if rows:
        size = one_pass_working_set(vocab_size, hidden_size, elem, need_weight, min(rows, max(n_rows, 1)))
        return f"one pass (6·N·H·V): {rows} rows per tile, {size / 2**30:.2f} GiB working set"
    kind, extra = hidden_accumulator(n_rows, hidden_size, weight.dtype, tile_budget_bytes)
    block_rows, cols = two_pass_plan(n_rows, vocab_size, elem, tile_budget_bytes, extra)
    return (f"two passes (8·N·H·V): {block_rows}×{cols} tile, {(block_rows * cols * elem + extra) / 2**30:.2f} "
            f"GiB working set with the hidden-state gradient's accumulator ({kind}, for {weight.dtype} hidden states)")
