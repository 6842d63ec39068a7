"""The fused statistics matmul's launch shapes and the layout of what it stores (:mod:`.fused_matmul`): the autotuning
candidates (:data:`CONFIGS`), the interpreter's shape, the rows' bucket of the autotuner's key, whether a stored tile
is written through a TMA descriptor (:func:`tma_tile_store`), and the bytes and shifts a launch holds per row — what
the plan counts (:mod:`.plan`) and the one pass allocates (:mod:`.one_pass`) without importing the kernel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Optional

import torch
import triton

from .matmul import tma_operand
from .statistics_partials import partials_bytes


@dataclasses.dataclass(frozen=True)
class StatsConfig:
    """One launch shape: ``block_m × block_n`` output tiles, ``block_k`` deep K steps, grouped ``group_m``
    row-blocks at a time (:func:`~.matmul.tile_order`), the epilogue on ``split`` (1, 2 or 4) column slices of the
    tile one after another (the whole tile's temporaries beside its accumulator would spill), ``num_warps`` warps,
    ``num_stages`` pipelined loads."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    split: int = 4
    num_warps: int = 8
    num_stages: int = 4

    def kwargs(self) -> dict:
        return dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_K=self.block_k, GROUP_M=self.group_m,
                    SPLIT=self.split)


#: The GPU's autotuning candidates: the gradient epilogue's shape (:data:`.logits_epilogues.CONFIG`) with 4 and 3
#: stages, and 128 × 128 tiles; every ``block_n`` a multiple of :data:`MIN_BLOCK_N`, which sizes the partials.
#: Spilled stack bytes for sm_90 with the entropy (Triton 3.9), statistics alone / tile stored by pointers / through
#: a TMA descriptor: 128 × 256 24 / 328–344 / 40, 128 × 128 0 / 24 / 0 (docs/design/numerics.md). 128 × 256 with
#: ``group_m`` 16 compiles to the same registers and spills as with 8, so it stays out of the candidates.
CONFIGS = (
    StatsConfig(128, 256, 64, split=4, num_warps=8, num_stages=4),
    StatsConfig(128, 256, 64, split=4, num_warps=8, num_stages=3),
    StatsConfig(128, 128, 64, split=2, num_warps=8, num_stages=4),
    StatsConfig(128, 128, 64, split=2, num_warps=8, num_stages=3),
)
MIN_BLOCK_N = min(c.block_n for c in CONFIGS)

#: Under the interpreter (whose cost is per program and per call of a jitted function, not per element): tiles
#: that cover the tests' shapes in few programs, yet several column tiles with ragged edges.
INTERPRETER_CONFIG = StatsConfig(64, 128, 32, group_m=2, split=4, num_warps=4, num_stages=1)

#: Whether a stored tile is written through a TMA tensor descriptor (an asynchronous bulk copy of each epilogue
#: slice from shared memory) rather than by ``tl.store`` from registers; the same bits either way. On by default: on
#: an H200 it takes the stored tile's epilogue from 12.6 to 9.6 ms at 8192 × 151936 × 2048 (cuBLAS's bf16 product
#: 7.3, the statistics alone 9.2; docs/performance.md, 2026-11-29); :data:`TMA_TILE_STORE_ENV` (``1``/``0``) or a
#: :func:`tma_tile_store_forced` block overrides it.
TMA_TILE_STORE = True
TMA_TILE_STORE_ENV = "HF_FUSED_TMA_TILE_STORE"
_tma_forced: Optional[bool] = None


@contextlib.contextmanager
def tma_tile_store_forced(enabled: Optional[bool]):
    """Within the block a stored tile is written through a TMA descriptor (``True``), by pointers (``False``), or as
    the environment and :data:`TMA_TILE_STORE` say (``None``): for tests and benchmarks."""
    global _tma_forced
    before, _tma_forced = _tma_forced, enabled
    try:
        yield
    finally:
        _tma_forced = before


def tma_tile_store(tile: torch.Tensor) -> bool:
    """Whether the launch storing ``tile`` writes it through a TMA descriptor: asked for (a
    :func:`tma_tile_store_forced` block, else :data:`TMA_TILE_STORE_ENV`, else :data:`TMA_TILE_STORE`) and possible.
    A tile whose base address or row stride is not a multiple of 16 bytes (a column slice of a wider buffer at an
    odd column, say) cannot be described (:func:`~.matmul.tma_operand`): it is stored by pointers, the same bits.

    Raises:
        ValueError: for a value of :data:`TMA_TILE_STORE_ENV` other than ``0`` or ``1``.
    """
    asked = _tma_forced
    if asked is None:
        value = os.environ.get(TMA_TILE_STORE_ENV) or ""
        if value not in ("", "0", "1"):
            raise ValueError(f"{TMA_TILE_STORE_ENV} must be 1 (store the tile through a TMA descriptor) or 0, got "
                             f"{value!r}")
        asked = TMA_TILE_STORE if value == "" else value == "1"
    return asked and tile.stride(1) == 1 and tma_operand(tile) is None


def rows_bucket(rows: int) -> int:
    """The autotuner's key for a launch of ``rows`` rows: the power of two at or above it, from 1024 on (the best
    launch shape depends on how many waves of tiles the rows make; one tuning per bucket, not per row count)."""
    return max(1024, 1 << max(0, rows - 1).bit_length())


def partial_row_bytes(vocab_size: int, statistics: int, device: torch.device) -> int:
    """Bytes per row of the partials one launch over ``vocab_size`` columns on ``device`` holds, with ``statistics``
    partials per tile (:func:`~.statistics_partials.partials_bytes`): what the plan counts per row."""
    block_n = MIN_BLOCK_N if device.type == "cuda" else INTERPRETER_CONFIG.block_n
    return partials_bytes(triton.cdiv(vocab_size, block_n), statistics)


def shift_columns(device: torch.device, config: Optional[StatsConfig] = None) -> int:
    """Columns per shift of a stored tile (one epilogue slice, ``block_n / split``): ``config``'s, else the launch's
    on ``device`` (on a GPU every autotuning candidate's, :data:`CONFIGS`; else :data:`INTERPRETER_CONFIG`'s)."""
    config = config or (CONFIGS[0] if device.type == "cuda" else INTERPRETER_CONFIG)
    return config.block_n // config.split


def new_offsets(rows: int, vocab_size: int, device: torch.device, config: Optional[StatsConfig] = None
                ) -> torch.Tensor:
    """The fp32 ``[rows, ⌈V / c⌉]`` shifts of a stored tile of ``vocab_size`` columns, ``c`` =
    :func:`shift_columns` (uninitialized: the launch writes every one)."""
    cols = triton.cdiv(vocab_size, shift_columns(device, config))
    return torch.empty((rows, cols), dtype=torch.float32, device=device)


def stored_tile_row_bytes(vocab_size: int, device: torch.device) -> int:
    """Bytes per row that a launch storing its tile holds beside the tile: the fp32 shifts (4 per
    :func:`shift_columns` columns: 1/32 of a bf16 tile's bytes at 64 columns) and the partials of every statistic
    with the stored tile's Σexp (7 per output tile, :func:`partial_row_bytes`), and the stored tile's fp32
    normalizer: what the one pass's plan counts per tile row (151,936 columns on a GPU: 9,496 + 33,236 + 4)."""
    shifts = triton.cdiv(vocab_size, shift_columns(device)) * 4
    return shifts + partial_row_bytes(vocab_size, 7, device) + 4


__all__ = ["CONFIGS", "INTERPRETER_CONFIG", "MIN_BLOCK_N", "TMA_TILE_STORE", "TMA_TILE_STORE_ENV", "StatsConfig",
           "new_offsets", "partial_row_bytes", "rows_bucket", "shift_columns", "stored_tile_row_bytes",
           "tma_tile_store", "tma_tile_store_forced"]
