"""The compensated pair element by element (the format: :mod:`.compensated`, docs/design/numerics.md): a pair made
from an fp32 block (:func:`compensated_store_`, what a fold into a zero pair leaves) and a pair's value scaled by the
upstream gradient and rounded once (:func:`compensated_scale_`), each optionally on rows of a taller ``hi`` (the
kept tokens' rows of a whole hidden-state gradient)."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ...devices import kernel_device
from .compensated import PAIR_DTYPE, RESIDUAL_DTYPE, decode_residual, encode_residual
from .matmul import round_bf16, to_fp32


def compensated_scale_(hi: torch.Tensor, lo: torch.Tensor, factor, *,
                       hi_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``hi ← round_bf16(factor·(hi + lo·ulp(hi)/254))`` in place, and ``hi`` returned: a pair's value scaled
    by the upstream gradient and rounded once, as an fp32 accumulator's ``(acc·factor).to(bf16)`` would be.

    The sum ``hi + lo·ulp/254`` and the product each round once in fp32 (``≤ 2⁻²⁴`` relative each); the
    bf16 rounding is to nearest, ties to even. A ``factor`` equal to 1.0 (a Python float, or a tensor on the
    device: the same bits either way) leaves ``hi`` as it is: it already is the round-to-nearest of the best sum
    the pair held (docs/design/numerics.md, "No finalize step").

    Args:
        hi: bf16, contiguous (e.g. the one pass's ``[V, H]`` weight gradient; with ``hi_rows``, the whole
            ``[N, H]`` hidden-state gradient whose rows ``hi_rows`` the pair covers).
        lo: :data:`RESIDUAL_DTYPE` (int8), contiguous: its residual, of ``hi``'s shape, or ``[M, H]`` with
            ``hi_rows``.
        factor: a Python float, or a 0-d fp32 tensor on ``hi``'s device (the upstream gradient: read by the
            kernel, no host sync).
        hi_rows: optional int64 ``[M]`` rows of ``hi`` that ``lo``'s rows belong to (the other rows of ``hi``
            are left as they are).

    Raises:
        ValueError: on shapes that do not match, or ``hi``/``lo`` not contiguous.
        TypeError: on ``hi`` not bf16 or ``lo`` not int8.
    """
    _check_pair(hi, lo, hi_rows, "compensated_scale_")
    if isinstance(factor, float) and factor == 1.0:
        return hi
    factor = torch.as_tensor(factor, dtype=torch.float32, device=hi.device).reshape(())
    n = lo.numel()
    if n:
        with kernel_device(hi):
            _scale_pair_kernel[_row_grid(lo)](hi, lo, factor, lo if hi_rows is None else hi_rows, lo.shape[-1],
                                              GATHER_HI=hi_rows is not None, BLOCK=_row_block(lo))
    return hi


def compensated_store_(hi: torch.Tensor, lo: torch.Tensor, acc: torch.Tensor, *,
                       hi_rows: Optional[torch.Tensor] = None,
                       row_scale: Optional[torch.Tensor] = None) -> None:
    """The pair ``(hi, lo)`` of an fp32 block ``acc [M, H]`` (times ``row_scale[:, None]`` where given, in fp32):
    ``hi`` its round-to-nearest bf16, ``lo`` the residual, as :func:`compensated_addmm_` leaves a pair that starts
    at zero after folding ``acc`` in (the same bits). For a sum that is complete in one product (the one pass's
    hidden-state gradient, whose rows each come from one tile) but is still to be scaled by the upstream gradient
    (:func:`compensated_scale_`): 3 bytes an element instead of an fp32 buffer's 4, ``hi`` being the gradient.

    Args:
        hi: bf16, contiguous: ``[M, H]``, or with ``hi_rows`` a taller ``[R, H]`` whose rows ``hi_rows`` are written.
        lo: :data:`RESIDUAL_DTYPE` (int8) ``[M, H]``, contiguous.
        acc: fp32 ``[M, H]``, contiguous.
        hi_rows: optional int64 ``[M]`` row indices into ``hi``.
        row_scale: optional fp32 ``[M]``: each row's factor, applied in fp32 before the rounding.

    Raises:
        ValueError: on shapes that do not match, or tensors not contiguous or on different devices.
        TypeError: on ``hi`` not bf16, ``lo`` not int8, or ``acc`` / ``row_scale`` not fp32.
    """
    _check_pair(hi, lo, hi_rows, "compensated_store_")
    if acc.shape != lo.shape or not acc.is_contiguous() or (row_scale is not None and
                                                          row_scale.shape != lo.shape[:1]):
        raise ValueError(f"compensated_store_ needs a contiguous acc of lo's shape {tuple(lo.shape)} and a row_scale "
                         f"of [{lo.shape[0]}]; got acc {tuple(acc.shape)} {acc.stride()}, row_scale "
                         f"{None if row_scale is None else tuple(row_scale.shape)}")
    if acc.dtype != torch.float32 or (row_scale is not None and row_scale.dtype != torch.float32):
        raise TypeError(f"compensated_store_ needs fp32 acc and row_scale; got {acc.dtype}, "
                        f"{None if row_scale is None else row_scale.dtype}")
    if len({t.device for t in (hi, lo, acc) + ((row_scale,) if row_scale is not None else ())}) != 1:
        raise ValueError("compensated_store_ needs hi, lo, acc and row_scale on one device")
    n = lo.numel()
    if n:
        with kernel_device(hi):
            _store_pair_kernel[_row_grid(lo)](
                acc, acc if row_scale is None else row_scale, hi, lo, lo if hi_rows is None else hi_rows, lo.shape[1],
                HAS_SCALE=row_scale is not None, GATHER_HI=hi_rows is not None, BLOCK=_row_block(lo))


def _check_pair(hi: torch.Tensor, lo: torch.Tensor, hi_rows: Optional[torch.Tensor], name: str) -> None:
    """The checks :func:`compensated_scale_` and :func:`compensated_store_` share (their Raises)."""
    if (hi_rows is None and hi.shape != lo.shape) or not (hi.is_contiguous() and lo.is_contiguous()):
        raise ValueError(f"{name} needs contiguous hi and lo of one shape (without hi_rows); got hi "
                         f"{tuple(hi.shape)} {hi.stride()}, lo {tuple(lo.shape)} {lo.stride()}")
    if hi_rows is not None and (hi.dim() != 2 or lo.dim() != 2 or hi.shape[1] != lo.shape[1] or hi_rows.dim() != 1
                                or hi_rows.dtype != torch.int64 or hi_rows.numel() != lo.shape[0]
                                or hi_rows.device != hi.device):
        raise ValueError(f"{name} with hi_rows needs hi [R, H], lo [M, H] and int64 hi_rows [M] on hi's device; "
                         f"got hi {tuple(hi.shape)}, lo {tuple(lo.shape)}, hi_rows {hi_rows.dtype} "
                         f"{tuple(hi_rows.shape)} on {hi_rows.device}")
    if hi.dtype != PAIR_DTYPE or lo.dtype != RESIDUAL_DTYPE:
        raise TypeError(f"{name} needs a bf16 hi and an int8 lo; got {hi.dtype}, {lo.dtype}")


#: Elements of a row per program of the elementwise pair kernels (a whole row up to this width).
_ROW_BLOCK = 2048


def _row_block(lo: torch.Tensor) -> int:
    return min(_ROW_BLOCK, triton.next_power_of_2(lo.shape[-1]))


def _row_grid(lo: torch.Tensor) -> tuple[int, int]:
    """One program per row of ``lo`` (seen as ``[numel / width, width]``) and block of its columns: a row's index
    into ``hi`` and its scale are read once per program, not per element."""
    width = lo.shape[-1]
    return lo.numel() // width, triton.cdiv(width, _row_block(lo))


@triton.jit
def _row_offsets(HI_ROWS, width, GATHER_HI: tl.constexpr, BLOCK: tl.constexpr):
    """This program's ``(row, column mask, lo's offsets, hi's offsets)``: ``lo`` row-major
    ``[rows, width]``, ``hi``'s row ``HI_ROWS[row]`` with ``GATHER_HI`` (int64 offsets: a ``[V, H]`` pair can pass
    2³¹ elements)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    hi_row = row
    if GATHER_HI:
        hi_row = tl.load(HI_ROWS + row)
    return row, cols < width, row * width + cols, hi_row * width + cols


@triton.jit
def _scale_pair_kernel(HI, LO, FACTOR, HI_ROWS, width, GATHER_HI: tl.constexpr, BLOCK: tl.constexpr):
    """One row block of :func:`compensated_scale_`; a factor of 1 keeps ``hi``'s bits (``hi + lo`` rounded again
    could move a tie)."""
    _, mask, lo_offs, hi_offs = _row_offsets(HI_ROWS, width, GATHER_HI, BLOCK)
    stored = tl.load(HI + hi_offs, mask=mask, other=0.0)
    h = to_fp32(stored)
    factor = tl.load(FACTOR)
    t = (h + decode_residual(tl.load(LO + lo_offs, mask=mask, other=0), h)) * factor
    scaled, _ = round_bf16(t)
    tl.store(HI + hi_offs, tl.where(factor == 1.0, stored, scaled), mask=mask)


@triton.jit
def _store_pair_kernel(ACC, SCALE, HI, LO, HI_ROWS, width, HAS_SCALE: tl.constexpr, GATHER_HI: tl.constexpr,
                       BLOCK: tl.constexpr):
    """One row block of :func:`compensated_store_`: what :mod:`.compensated`'s fold leaves in a zero pair."""
    row, mask, lo_offs, hi_offs = _row_offsets(HI_ROWS, width, GATHER_HI, BLOCK)
    t = tl.load(ACC + lo_offs, mask=mask, other=0.0)
    if HAS_SCALE:
        t = t * tl.load(SCALE + row)
    hi_new, hi32 = round_bf16(t)
    tl.store(HI + hi_offs, hi_new, mask=mask)
    tl.store(LO + lo_offs, encode_residual(t - hi32, hi32), mask=mask)


__all__ = ["compensated_scale_", "compensated_store_"]
