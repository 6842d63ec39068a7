"""Per-row partial statistics of a row's output tiles, and their merge into the running statistics of :mod:`.tiles`.

The logits matmul with the statistics in its epilogue (:mod:`.fused_matmul`) writes, for each row and each of its
output tiles ``j``, the tile's max ``m_j``, ``S_j = Σ exp(z − m_j)`` and, as asked, ``Σ exp(z − m_j)·z`` (the
entropy's), ``Σ z``, the first arg-max, ``Σ exp(2(z − m_j))`` and ``Σ exp(z̃ − m_j)`` of the logits of a stored
bf16 tile, into ``[rows, n_part]`` buffers
(:func:`new_partials`); :func:`merge_partials_` folds them with the log-sum-exp rule, ``m = max_j m_j``,
``S = Σ_j S_j·exp(m_j − m)`` (the squared factor for ``Σ exp(2(z − m))``), into the running statistics as
``triton_kernels.stats_kernel`` folds a stored chunk, so :func:`~.tiles.finish_row_stats` reads them alike.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

_NO_MAX = tl.constexpr(-3.4028234663852886e38)  # below every finite fp32 value (the statistics kernel's)
_NO_COLUMN = tl.constexpr(2**31 - 1)

#: Partials per merge program (rows × tiles): 4096 keeps a program's loads in registers on a GPU; the interpreter
#: takes all the tests' rows in one program.
MERGE_ELEMENTS = 4096

#: ``(max, Σexp, Σexp·z, Σz, arg-max, Σexp(2(z − m)), Σexp(z̃ − m))``, ``[rows, n_part]`` each (fp32, the arg-max
#: int32 columns of the launch); one not asked for is the max's buffer (never written or read: its flag compiles it
#: out).
Partials = tuple


def partials_bytes(n_part: int, statistics: int) -> int:
    """Bytes per row of partials over ``n_part`` tiles with ``statistics`` of them per tile (max and Σexp, plus the
    ones asked)."""
    return n_part * 4 * statistics


def new_partials(m_rows: int, n_part: int, device: torch.device, entropy: bool, sum_z: bool, argmax: bool,
                 sum_sq: bool, rounded_sum: bool) -> Partials:
    """Empty :data:`Partials` for ``m_rows`` rows of ``n_part`` tiles (every one the kernel is asked for)."""
    new = lambda dtype=torch.float32: torch.empty((m_rows, n_part), dtype=dtype, device=device)  # noqa: E731
    p_max = new()
    return (p_max, new(), new() if entropy else p_max, new() if sum_z else p_max,
            new(torch.int32) if argmax else p_max, new() if sum_sq else p_max, new() if rounded_sum else p_max)


@triton.jit(do_not_specialize=["n_part", "n_tiles", "n_rows", "col_offset"])
def _merge_kernel(
    P_MAX, P_SUM, P_ZP, P_ZSUM, P_ARG, P_SQ, P_SR, n_part, n_tiles, n_rows, col_offset,
    RUN_MAX, RUN_SUM, RUN_ZP, ZSUM, ARG, S2, RUN_SR,
    ENTROPY: tl.constexpr, SUM_Z: tl.constexpr, ARGMAX: tl.constexpr, SUM_SQ: tl.constexpr, ROUNDED: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Rows ``r``'s ``n_tiles`` partials folded into their running statistics (``BLOCK_R`` rows per program), as
    ``triton_kernels.stats_kernel`` folds a chunk: ``m = max(m_old, max_j m_j)``, each sum rescaled by
    ``exp(m_j − m)`` (its square for Σexp(2(z−m))), the arg-max taken over only by a strictly larger maximum."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    j = tl.arange(0, BLOCK_T)
    ok = row_ok[:, None] & (j < n_tiles)[None, :]
    at = rows[:, None] * n_part + j[None, :]
    p_max = tl.load(P_MAX + at, mask=ok, other=_NO_MAX)
    m_chunk = tl.max(p_max, axis=1)
    m_old = tl.load(RUN_MAX + rows, mask=row_ok, other=0.0)
    m = tl.maximum(m_old, m_chunk)
    w = tl.where(ok, tl.exp(p_max - m[:, None]), 0.0)
    alpha = tl.exp(m_old - m)  # 0 from the initial −inf
    tl.store(RUN_MAX + rows, m, mask=row_ok)
    s = tl.sum(tl.load(P_SUM + at, mask=ok, other=0.0) * w, axis=1)
    tl.store(RUN_SUM + rows, tl.load(RUN_SUM + rows, mask=row_ok, other=0.0) * alpha + s, mask=row_ok)
    if ENTROPY:
        t = tl.sum(tl.load(P_ZP + at, mask=ok, other=0.0) * w, axis=1)
        tl.store(RUN_ZP + rows, tl.load(RUN_ZP + rows, mask=row_ok, other=0.0) * alpha + t, mask=row_ok)
    if SUM_Z:
        zsum = tl.sum(tl.load(P_ZSUM + at, mask=ok, other=0.0), axis=1)
        tl.store(ZSUM + rows, tl.load(ZSUM + rows, mask=row_ok, other=0.0) + zsum, mask=row_ok)
    if ARGMAX:
        # the tiles' columns increase with j: the smallest column among the tiles holding the maximum is the first
        cols = tl.load(P_ARG + at, mask=ok, other=_NO_COLUMN)
        first = tl.min(tl.where(ok & (p_max == m_chunk[:, None]), cols, _NO_COLUMN), axis=1)
        tl.store(ARG + rows, (first + col_offset).to(tl.int64), mask=row_ok & (m_chunk > m_old))
    if SUM_SQ:
        s2 = tl.sum(tl.load(P_SQ + at, mask=ok, other=0.0) * (w * w), axis=1)
        tl.store(S2 + rows, tl.load(S2 + rows, mask=row_ok, other=0.0) * (alpha * alpha) + s2, mask=row_ok)
    if ROUNDED:
        sr = tl.sum(tl.load(P_SR + at, mask=ok, other=0.0) * w, axis=1)
        tl.store(RUN_SR + rows, tl.load(RUN_SR + rows, mask=row_ok, other=0.0) * alpha + sr, mask=row_ok)


def merge_partials_(parts: Partials, n_tiles: int, col_offset: int, stats: tuple, entropy: bool,
                    rounded_sum: Optional[torch.Tensor] = None) -> None:
    """Fold the first ``n_tiles`` columns of ``parts`` (tiles of columns ``col_offset …``) into ``stats``
    (:data:`~.tiles.RowStats`: running max, Σexp, Σexp·z, label logit, Σz, arg-max, Σexp(2(z − m)); the token
    statistics as ``stats`` holds them, Σexp·z with ``entropy``) and, where given, the stored tile's Σexp(z̃ − m)
    into ``rounded_sum`` (fp32 ``[rows]``, relative to the same running max)."""
    run_max, run_sum, run_zp, _, z_sum, arg, sum_sq = stats
    m_rows, n_part = parts[0].shape
    block_t = triton.next_power_of_2(n_tiles)
    block_r = max(1, min(triton.next_power_of_2(m_rows), MERGE_ELEMENTS // block_t))
    _merge_kernel[(triton.cdiv(m_rows, block_r),)](
        *parts, n_part, n_tiles, m_rows, col_offset, run_max, run_sum, run_zp, run_max if z_sum is None else z_sum,
        run_max if arg is None else arg, run_max if sum_sq is None else sum_sq,
        run_max if rounded_sum is None else rounded_sum, ENTROPY=entropy, SUM_Z=z_sum is not None,
        ARGMAX=arg is not None, SUM_SQ=sum_sq is not None, ROUNDED=rounded_sum is not None, BLOCK_R=block_r,
        BLOCK_T=block_t, num_warps=4,
    )


__all__ = ["MERGE_ELEMENTS", "Partials", "merge_partials_", "new_partials", "partials_bytes"]
