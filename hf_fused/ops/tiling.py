"""The tiling rule every backend shares: the tile budget, and the torch reference's rows per tile.

``tile_budget_bytes`` bounds the memory a call's tiles may use: ``None`` means each backend's default rule (the
torch reference: ``DEFAULT_TILE_BUDGET_BYTES``; the GPU backend plans its own schedules within it or within the
free device memory, :mod:`hf_fused.ops.backends.triton_cublas.plan`). The torch reference's tile is ``TILE_BUFFERS``
fp32 ``[rows, V]`` arrays (the logits and the temporaries made from them: probabilities, the soft-cap's tanh, the
logits-gradient), kept inside the budget (:func:`rows_per_tile`). :func:`hf_fused.ops.describe_plan` says what a
call would run on the backend its tensors get.
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
