"""Launching the tile kernels (:mod:`.triton_kernels`) on one ``[rows, cols]`` tile, and the per-row statistics.

:func:`statistics_tile` folds a tile of raw logits into running per-row statistics (:func:`new_row_stats`, read
out by :func:`finish_row_stats`); :func:`gradient_tile` overwrites a tile with its logits-gradient ``dz``. Both
take the logit transform as :func:`kernel_scalars`. Launch shapes measured on an H100 and an H200: the statistics
kernel with 1024 columns per block on 4 warps for whole-vocabulary rows (0.232 ms per 2048 × 151936 tile, 2.7 TB/s,
with or without the entropy), on one warp for rows of at most ``STATS_NARROW_COLS`` columns (the two passes'
narrow chunks: 0.078 ms at 29,491 × 2432).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ...logit_transform import LogitTransform
from . import triton_kernels

STATS_BLOCK_V, STATS_WARPS = 1024, 4
STATS_NARROW_COLS, STATS_NARROW_WARPS = 4096, 1
GRAD_BLOCK_V, GRAD_WARPS = 2048, 8

#: ``(running max, Σexp(z−m), Σexp(z−m)·z, label logit, Σz, first arg-max, Σexp(2(z−m)))``, fp32 ``[M]`` each (the
#: arg-max int64), the last three ``None`` unless a token statistic needs them.
RowStats = tuple


def kernel_scalars(transform: LogitTransform, bias: Optional[torch.Tensor]) -> dict:
    """The logit transform as the kernels' scalar arguments and compile-time flags."""
    return dict(
        logit_scale=float(transform.logit_scale),
        softcap=float(transform.softcap or 1.0),
        inv_temperature=1.0 / float(transform.temperature),
        HAS_BIAS=bias is not None,
        SOFTCAP=transform.softcap is not None,
        SCALED=float(transform.logit_scale) != 1.0 or float(transform.temperature) != 1.0,
    )


def without_bias_flag(scalars: dict) -> dict:
    """:func:`kernel_scalars` for a kernel whose inputs already hold the bias (it takes no ``HAS_BIAS`` flag)."""
    return {name: value for name, value in scalars.items() if name != "HAS_BIAS"}


def rounds_to_bf16(out: torch.Tensor) -> bool:
    """Whether a kernel storing into ``out`` rounds to bf16 itself (``round_bf16`` on the bit pattern): under Triton's
    interpreter, whose conversion truncates; compiled code's conversion rounds to nearest even already."""
    return out.dtype == torch.bfloat16 and not out.is_cuda


def new_row_stats(m_rows: int, device: torch.device, statistics: Sequence[str] = ()) -> RowStats:
    """Per-row accumulators ``[M]`` (:data:`RowStats`) for the statistics in ``statistics``."""
    f32 = dict(dtype=torch.float32, device=device)
    zeros = lambda dtype=torch.float32: torch.zeros(m_rows, dtype=dtype, device=device)  # noqa: E731
    return (
        torch.full((m_rows,), float("-inf"), **f32), zeros(), zeros(), zeros(),
        zeros() if "mean_logits" in statistics else None,
        zeros(torch.int64) if "is_top1" in statistics else None,
        zeros() if "log_sum_sq_probs" in statistics else None,
    )


def row_slice(stats: RowStats, r0: int, r1: int) -> RowStats:
    """Rows ``r0:r1`` of every accumulator (views)."""
    return tuple(None if t is None else t[r0:r1] for t in stats)


def finish_row_stats(stats: RowStats, labels: torch.Tensor, vocab_size: int, return_entropy: bool,
                     statistics: Sequence[str]):
    """``(logprobs, entropy or None, lse, token statistics)`` of the rows from their accumulators (the formulas of
    :mod:`hf_fused.ops.token_statistics`)."""
    run_max, run_sum, run_zp, label_logit, z_sum, arg, sum_sq = stats
    log_sum = run_sum.log()
    lse = run_max + log_sum
    entropy = lse - run_zp / run_sum if return_entropy else None
    values = {
        "mean_logits": lambda: z_sum / vocab_size,
        "is_top1": lambda: arg == labels,
        # log Σ exp(2z − 2·lse) = log Σexp(2(z − m)) − 2·log Σexp(z − m): the running max cancels
        "log_sum_sq_probs": lambda: sum_sq.log() - 2 * log_sum,
    }
    return label_logit - lse, entropy, lse, {name: values[name]() for name in statistics}


def statistics_tile(z: torch.Tensor, col_offset: int, bias: Optional[torch.Tensor], labels: torch.Tensor,
                    stats: RowStats, scalars: dict, return_entropy: bool) -> None:
    """Fold the raw logits ``z [rows, cols]`` (columns from ``col_offset``) into ``stats`` (:func:`new_row_stats`):
    the running max, Σexp, Σexp·z and label logit, and those of the token statistics it holds."""
    run_max, run_sum, run_zp, label_logit, z_sum, arg, sum_sq = stats
    warps = STATS_NARROW_WARPS if z.shape[1] <= STATS_NARROW_COLS else STATS_WARPS
    triton_kernels.stats_kernel[(z.shape[0],)](
        z, z.stride(0), z.shape[1], col_offset, bias if bias is not None else labels, labels,
        run_max, run_sum, run_zp, label_logit,
        # statistics not asked for: any valid pointer, never read (their flags compile them out)
        run_max if z_sum is None else z_sum, labels if arg is None else arg, run_max if sum_sq is None else sum_sq,
        ENTROPY=return_entropy, SUM_Z=z_sum is not None, ARGMAX=arg is not None, SUM_SQ=sum_sq is not None,
        BLOCK_V=STATS_BLOCK_V, num_warps=warps, **scalars,
    )


def gradient_tile(z: torch.Tensor, col_offset: int, bias: Optional[torch.Tensor], labels: torch.Tensor,
                  lse: torch.Tensor, ent: torch.Tensor, g_lp: torch.Tensor, g_ent: torch.Tensor, scalars: dict,
                  has_g_lp: bool, has_g_ent: bool, sum_pz: Optional[torch.Tensor] = None) -> None:
    """Overwrite the raw logits ``z [rows, cols]`` with ``dz`` (``triton_kernels.grad_kernel``); with ``sum_pz``
    (fp32 ``[rows]``), write each row's Σ p·z over the columns into it."""
    triton_kernels.grad_kernel[(z.shape[0],)](
        z, z.stride(0), z, z.stride(0), z.shape[1], col_offset, bias if bias is not None else lse, labels,
        lse, ent, g_lp, g_ent, lse if sum_pz is None else sum_pz, HAS_G_LP=has_g_lp, HAS_G_ENT=has_g_ent,
        SUM_PZ=sum_pz is not None, BLOCK_V=GRAD_BLOCK_V, num_warps=GRAD_WARPS, **scalars,
    )
