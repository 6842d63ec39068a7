"""The gradients a backend returns, and their one rounding to the inputs' dtypes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch


@dataclass
class HeadGrads:
    """Gradients of the head's inputs; ``None`` for those not requested. fp32, so that the op can
    scale them by the upstream gradient before their one rounding to the inputs' dtypes
    (:meth:`input_grads`); except a gradient a backend accumulated already rounded to its input's dtype
    (the GPU two-pass hidden gradient in bf16), which only a factor of 1 may reach, and a bf16 ``weight`` with
    its ``weight_residual`` (a compensated pair: scaled as its exact value, then rounded once).

    hidden: ``[M, H]``, the gradients of the token rows ``rows`` the backend was given, in that order (or the
    whole ``[N, H]`` gradient when ``hidden_scattered``).
    weight: ``[V, H]``.  bias: ``[V]``.
    """

    hidden: Optional[torch.Tensor] = None
    weight: Optional[torch.Tensor] = None
    bias: Optional[torch.Tensor] = None
    #: ``hidden`` is already hidden's whole ``[N, H]`` gradient (ignored rows 0), not the ``[M, H]`` kept rows.
    hidden_scattered: bool = False
    #: With ``weight`` in bf16: the int8 residual of the compensated pair ``(weight, weight_residual)``
    #: (:mod:`hf_fused.ops.backends.compensated`) that the GPU one pass accumulated instead of an fp32 buffer;
    #: :meth:`input_grads` scales the pair's value and rounds it once.
    weight_residual: Optional[torch.Tensor] = None

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
            if name == "weight" and self.weight_residual is not None:
                scaled = _scaled_pair(grad, self.weight_residual, factor, like.dtype)
                self.weight_residual = None
            else:
                scaled = _scaled(grad, factor, hidden.dtype if name == "hidden" else like.dtype)
            scatter = name == "hidden" and not self.hidden_scattered
            out.append(_scatter_rows(scaled, hidden, rows) if scatter else scaled)
            del grad, scaled
        return tuple(out)


def _scaled(grad: torch.Tensor, factor, dtype: torch.dtype) -> torch.Tensor:
    """``grad · factor`` (fp32 arithmetic) in ``dtype``: in place when ``dtype`` is fp32, else one fused pass."""
    if isinstance(factor, float) and factor == 1.0:
        return grad.to(dtype)
    if grad.dtype != torch.float32:
        raise RuntimeError("hf_fused internal error: a gradient rounded by the backend cannot be scaled again")
    if dtype == grad.dtype:
        return grad.mul_(factor)
    return torch.mul(grad, factor, out=torch.empty(grad.shape, dtype=dtype, device=grad.device))


def _scaled_pair(hi: torch.Tensor, lo: torch.Tensor, factor, dtype: torch.dtype) -> torch.Tensor:
    """``(hi + lo)·factor`` rounded once to bf16 (:func:`~hf_fused.ops.backends.compensated.compensated_scale_`,
    in place in ``hi``), then in ``dtype`` (the weight's: bf16, the only gradient dtype a pair is made for)."""
    from .backends.compensated import compensated_scale_  # Triton: only the GPU backend makes pairs

    return compensated_scale_(hi, lo, factor).to(dtype)


def _scatter_rows(d_rows: torch.Tensor, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The gradients of ``rows`` (``[M, H]``, already in hidden's dtype) as hidden's gradient ``[N, H]`` (0 on
    the rows not in ``rows``: ignored tokens)."""
    if rows.numel() == hidden.shape[0]:  # every row, in order (rows come from nonzero(): sorted)
        return d_rows
    return torch.zeros_like(hidden).index_copy_(0, rows, d_rows)
