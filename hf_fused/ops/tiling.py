"""Tile planning: how many token rows one tile of ``[rows, V]`` fp32 logits may hold.

A tile's working set is the fp32 logits plus the temporaries made from them (probabilities, the
soft-cap's tanh, the logits-gradient): ``TILE_BUFFERS`` fp32 arrays of ``[rows, V]``. The planner keeps
that working set inside ``tile_budget_bytes`` so the memory above inputs and gradients is bounded
whatever the number of tokens.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch

#: Default bound on the memory one tile may use (bytes).
DEFAULT_TILE_BUDGET_BYTES = 256 * 1024**2

#: fp32 ``[rows, V]`` arrays alive at once inside one tile of the reference backend.
TILE_BUFFERS = 3


def check_tile_budget(tile_budget_bytes: Optional[int]) -> int:
    """The budget in bytes (the default for ``None``).

    Raises:
        ValueError: if the budget is not a positive integer.
    """
    budget = DEFAULT_TILE_BUDGET_BYTES if tile_budget_bytes is None else tile_budget_bytes
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise ValueError(f"tile_budget_bytes must be a positive int (bytes), got {budget!r}")
    return budget


def rows_per_tile(vocab_size: int, tile_budget_bytes: Optional[int] = None) -> int:
    """Token rows per tile so that ``TILE_BUFFERS`` fp32 ``[rows, vocab_size]`` arrays fit the budget.

    Raises:
        ValueError: if the budget is not a positive integer.
    """
    return max(1, check_tile_budget(tile_budget_bytes) // (TILE_BUFFERS * 4 * max(1, vocab_size)))


def valid_rows(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Indices ``[M]`` (int64) of the rows of flat ``labels [N]`` that are not ``ignore_index``.

    Ignored rows are compacted out here, before any matmul touches them.
    """
    return (labels != ignore_index).nonzero().squeeze(1)


def tiles(rows: torch.Tensor, tile_rows: int) -> Iterator[torch.Tensor]:
    """Consecutive slices of the row index vector ``rows``, ``tile_rows`` at a time."""
    for start in range(0, rows.numel(), tile_rows):
        yield rows[start : start + tile_rows]
