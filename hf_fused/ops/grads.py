"""The gradients a backend returns, and their one rounding to the inputs' dtypes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch


def torch_mul_into(out: torch.Tensor, src: torch.Tensor, factor) -> None:
    """``out ← src · factor``: one fp32 product, rounded once to ``out``'s dtype (``out`` may be ``src``)."""
    torch.mul(src, factor, out=out)


@dataclass
class HeadGrads:
    """Gradients of the head's inputs; ``None`` for those not requested. fp32, so that the op can
    scale them by the upstream gradient before their one rounding to the inputs' dtypes
    (:meth:`input_grads`); except a gradient a backend accumulated already rounded to its input's dtype
    (the GPU two-pass hidden gradient in bf16), which only a factor of 1 may reach, and a bf16 ``weight`` or
    ``hidden`` with its ``weight_residual`` / ``hidden_residual`` (a compensated pair: scaled as its exact value,
    then rounded once).

    hidden: ``[M, H]``, the gradients of the token rows ``rows`` the backend was given, in that order (or the
    whole ``[N, H]`` gradient when ``hidden_scattered``).
    weight: ``[V, H]``.  bias: ``[V]``.
    """

    hidden: Optional[torch.Tensor] = None
    weight: Optional[torch.Tensor] = None
    bias: Optional[torch.Tensor] = None
    #: ``hidden`` is already hidden's whole ``[N, H]`` gradient (ignored rows 0), not the ``[M, H]`` kept rows.
    hidden_scattered: bool = False
    #: With ``weight`` in bf16: the int8 residual of the compensated pair ``(weight, weight_residual)`` that the GPU
    #: one pass accumulated instead of an fp32 buffer; :meth:`input_grads` scales the pair's value and rounds it
    #: once with :attr:`scale_pair`.
    weight_residual: Optional[torch.Tensor] = None
    #: With ``hidden`` bf16 and ``hidden_scattered``: the int8 residual ``[M, H]`` of the compensated pair whose
    #: ``hi`` is ``hidden`` (the kept rows' gradients, each complete in one product, held as a pair instead of an
    #: fp32 ``[M, H]`` buffer until the upstream gradient scales them), its rows ``hidden_rows`` of ``hidden``.
    hidden_residual: Optional[torch.Tensor] = None
    #: With ``hidden_residual``: int64 ``[M]``, the rows of ``hidden`` the residual's rows belong to (``None``: all
    #: rows, in order).
    hidden_rows: Optional[torch.Tensor] = None
    #: With a residual: ``scale_pair(hi, lo, factor, hi_rows=None) -> hi``, the pair's value times ``factor``
    #: rounded once to bf16 in place (given by the backend that made the pair).
    scale_pair: Optional[Callable] = None
    #: With ``weight`` a 2-byte gradient: its own bytes hold the fp32 accumulator of its first ``V − T`` rows
    #: (:func:`split_accumulator`) and this fp32 ``[T, H]`` buffer the last ``T``; :meth:`input_grads` scales both
    #: and rounds them once into ``weight``'s rows.
    weight_tail: Optional[torch.Tensor] = None
    #: ``mul_into(out, src, factor)``: every rounding of an fp32 buffer times ``factor`` to its input's dtype
    #: (:func:`torch_mul_into`, or a faster kernel with the same bits that the backend lends).
    mul_into: Callable = torch_mul_into

    def input_grads(self, hidden, weight, bias, rows, factor: Union[float, torch.Tensor] = 1.0):
        """``(d_hidden [N, H], d_weight, d_bias)`` in the inputs' dtypes (``None`` where not computed):
        each times ``factor`` in fp32, then rounded once; hidden's rows scattered to ``rows`` (0 elsewhere).

        ``factor``: a Python float, or an fp32 0-d tensor on the gradients' device (the upstream gradient, kept
        on the device so that backward needs no host sync; the product is fp32, so the factor is never rounded
        to bf16). The product and the rounding are one pass when the dtype changes. Consumes the fp32
        buffers: each is released as soon as its result exists, so the fp32 ``[M, H]`` is gone before the
        ``[V, H]`` one is cast."""
        out = []
        for name, like in (("hidden", hidden), ("weight", weight), ("bias", bias)):
            grad = getattr(self, name)
            setattr(self, name, None)
            if grad is None:
                out.append(None)
                continue
            if name == "hidden" and self.hidden_residual is not None:
                scaled = self.scale_pair(grad, self.hidden_residual, factor, hi_rows=self.hidden_rows)
                self.hidden_residual = self.hidden_rows = None
            elif name == "weight" and self.weight_residual is not None:
                scaled = self.scale_pair(grad, self.weight_residual, factor).to(like.dtype)
                self.weight_residual = None
            elif name == "weight" and self.weight_tail is not None:
                scaled = _scaled_split(grad, self.weight_tail, factor, self.mul_into)
                self.weight_tail = None
            else:
                scaled = _scaled(grad, factor, hidden.dtype if name == "hidden" else like.dtype, self.mul_into)
            scatter = name == "hidden" and not self.hidden_scattered
            out.append(_scatter_rows(scaled, hidden, rows) if scatter else scaled)
            del grad, scaled
        return tuple(out)


def _scaled(grad: torch.Tensor, factor, dtype: torch.dtype, mul_into: Callable) -> torch.Tensor:
    """``grad · factor`` (fp32 arithmetic) in ``dtype``: in place when ``dtype`` is fp32, else one fused pass."""
    if isinstance(factor, float) and factor == 1.0:
        return grad.to(dtype)
    if grad.dtype != torch.float32:
        raise RuntimeError("hf_fused internal error: a gradient rounded by the backend cannot be scaled again")
    out = grad if dtype == grad.dtype else torch.empty(grad.shape, dtype=dtype, device=grad.device)
    mul_into(out, grad, factor)
    return out


def split_accumulator(grad: torch.Tensor, zero: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 view of a 2-byte ``[V, H]`` gradient's own bytes as the accumulator of its first ``V // 2`` rows
    (``[V // 2, H]``), and a new fp32 ``[V − V // 2, H]`` buffer for the rest: an fp32 ``[V, H]`` accumulator that
    costs ``2·V·H`` bytes beside the gradient instead of ``4·V·H`` (for :meth:`HeadGrads.input_grads`: the
    gradient as ``weight``, the buffer as ``weight_tail``). ``zero``: the buffer starts at 0 (else uninitialized;
    the head is whatever ``grad`` holds)."""
    rows, hidden_size = grad.shape[0] // 2, grad.shape[1]
    new = torch.zeros if zero else torch.empty
    tail = new((grad.shape[0] - rows, hidden_size), dtype=torch.float32, device=grad.device)
    return fp32_view(grad.view(-1)[: 2 * rows * hidden_size], rows), tail


def fp32_view(flat: torch.Tensor, rows: int) -> Optional[torch.Tensor]:
    """The 2-byte elements of the flat tensor ``flat`` seen as an fp32 ``[rows, H]`` matrix (its bytes, no copy), or
    ``None`` where they cannot be (not 2-byte, or a start that is not 4-byte aligned)."""
    if flat.element_size() != 2 or flat.storage_offset() % 2:
        return None
    return flat.view(torch.float32).view(rows, -1)


def round_rows_in_place_(out: torch.Tensor, acc: torch.Tensor, temp: torch.Tensor, factor=1.0,
                         mul_into: Callable = torch_mul_into) -> None:
    """``out = acc · factor`` rounded once to ``out``'s dtype, where ``acc`` is an fp32 view of bytes that start
    where ``out``'s do (the 2-byte rows ``out`` and the next as many: :func:`split_accumulator`, the two passes'
    weight-gradient chunks): in ascending blocks of ``temp``'s rows (``temp``: flat, ``out``'s dtype), each read
    whole into ``temp`` before it is written. A block's writes land on the fp32 rows below half its end, all read
    by then, so no fp32 row is overwritten before it is read. ``mul_into``: as :attr:`HeadGrads.mul_into`."""
    width, hidden_size = acc.shape
    step = max(1, temp.numel() // hidden_size)
    for a in range(0, width, step):
        b = min(a + step, width)
        block = temp[: (b - a) * hidden_size].view(b - a, hidden_size)
        mul_into(block, acc[a:b], factor)
        out[a:b].copy_(block)


#: Rows rounded per step where a split accumulator's head is rounded into its own bytes (the temporary: 1/8).
_NARROW_STEPS = 8


def _scaled_split(grad: torch.Tensor, tail: torch.Tensor, factor, mul_into: Callable) -> torch.Tensor:
    """``grad`` holding ``(accumulator · factor)`` rounded once, for the split accumulator of
    :func:`split_accumulator` (``grad``'s bytes the fp32 head, ``tail`` the rest). The head is rounded into rows
    ``[0, V // 2)`` in place (:func:`round_rows_in_place_`, through a temporary of 1/``_NARROW_STEPS`` of them)."""
    rows, hidden_size = grad.shape[0] - tail.shape[0], grad.shape[1]
    step = max(1, -(-rows // _NARROW_STEPS))
    temp = torch.empty(min(step, rows) * hidden_size, dtype=grad.dtype, device=grad.device)
    round_rows_in_place_(grad[:rows], fp32_view(grad.view(-1)[: 2 * rows * hidden_size], rows), temp, factor,
                         mul_into)
    del temp
    mul_into(grad[rows:], tail, factor)
    return grad


def _scatter_rows(d_rows: torch.Tensor, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The gradients of ``rows`` (``[M, H]``, already in hidden's dtype) as hidden's gradient ``[N, H]`` (0 on
    the rows not in ``rows``: ignored tokens)."""
    if rows.numel() == hidden.shape[0]:  # every row, in order (rows come from nonzero(): sorted)
        return d_rows
    return torch.zeros_like(hidden).index_copy_(0, rows, d_rows)
