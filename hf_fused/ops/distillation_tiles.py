"""What the distillation op's tile loops share: the pass's result (:class:`DistillationPass`) and each model's
operands for its logits tiles (:class:`TileHead`: bf16 operands with fp32 products on CUDA, :func:`half_products`,
else fp32 copies). Below the backends, so that the GPU backend's pass and the op's plain-PyTorch pass
(:mod:`hf_fused.ops.distillation`) build on the same types without the backend importing the op."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .grads import HeadGrads
from .head_inputs import HeadInputs


class DistillationPass(NamedTuple):
    """Per kept row (fp32 ``[M]``, in the order of the heads' ``rows``): ``divergence`` and student ``entropy``;
    ``grads``: the student's fp32 :class:`~hf_fused.ops.grads.HeadGrads` (hidden ``[M, H_s]``), or ``None`` when none
    was asked."""

    divergence: torch.Tensor
    entropy: torch.Tensor
    grads: Optional[HeadGrads]


def half_products(head: HeadInputs) -> bool:
    """Whether the pass computes ``head``'s (a :meth:`~hf_fused.ops.head_inputs.HeadInputs.computed` head's) products
    from its bf16 operands with fp32 output: CUDA, hidden and weight both bf16, and a torch with ``aten::mm.dtype``
    (2.8 and later; CUDA only). Otherwise (fp16 included: module docstring) the pass computes from fp32 copies."""
    return (head.hidden.is_cuda and head.weight.is_cuda and head.weight.dtype == torch.bfloat16
            and head.hidden.dtype == torch.bfloat16 and hasattr(torch.ops.aten.mm, "dtype")
            and hasattr(torch.ops.aten.addmm, "dtype_out"))


class TileHead(NamedTuple):
    """A :meth:`~hf_fused.ops.head_inputs.HeadInputs.computed` head and the operands of its products: on the
    :func:`half_products` path the bf16 weight itself, else an fp32 copy of it; the bias in fp32 either way."""

    head: HeadInputs
    weight: torch.Tensor  # [V, H]: the bf16 operand (half) or its fp32 copy
    bias: Optional[torch.Tensor]  # [V] fp32
    half: bool

    @classmethod
    def of(cls, head: HeadInputs) -> "TileHead":
        head = head.computed()  # the operands F.linear would compute from (autocast's casts)
        half = half_products(head)
        weight = head.weight if half else head.weight.float()
        return cls(head, weight, None if head.bias is None else head.bias.float(), half)

    def logits(self, start: int, stop: int):
        """``(h, z, tanh)`` for kept rows ``start:stop``: the rows in the products' operand dtype, tempered fp32
        logits (fp32 products of the operands), the soft-cap's tanh or ``None``."""
        h = self.head.hidden.index_select(0, self.head.rows[start:stop])
        if self.half:
            raw = torch.mm(h, self.weight.t(), out_dtype=torch.float32)
        else:
            h = h.float()
            raw = h @ self.weight.t()
        if self.bias is not None:
            raw += self.bias
        z, tanh = self.head.transform.forward(raw)
        return h, z, tanh

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Kept rows ``start:stop`` of the hidden states in the products' operand dtype."""
        h = self.head.hidden.index_select(0, self.head.rows[start:stop])
        return h if self.half else h.float()

    def raw_into(self, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        """Write the raw products (no bias, no transform) of kept rows ``start:stop`` into the fp32 ``[r, V]``
        ``out`` on this head's device; return the rows (:meth:`rows`, for the weight gradient)."""
        h = self.rows(start, stop)
        if self.half:
            torch.addmm(out, h, self.weight.t(), beta=0, out_dtype=torch.float32, out=out)
        else:
            torch.mm(h, self.weight.t(), out=out)
        return h

    def add_grads(self, grads: HeadGrads, dz: torch.Tensor, h: torch.Tensor, start: int, stop: int) -> None:
        """Add the gradients of rows ``start:stop`` (``dz``: their fp32 ``[r, V]`` raw-logits gradient, ``h``: the
        rows :meth:`logits` returned) to ``grads``' fp32 buffers."""
        if self.half:
            dz_op = dz.to(self.weight.dtype)  # the one rounding of dz, for both matmuls
            if grads.hidden is not None:  # its rows are zero: the sum is the product, written in fp32
                rows = grads.hidden[start:stop]
                torch.addmm(rows, dz_op, self.weight, out_dtype=torch.float32, out=rows)
            if grads.weight is not None:
                torch.addmm(grads.weight, dz_op.t(), h, out_dtype=torch.float32, out=grads.weight)
            del dz_op
        else:
            if grads.hidden is not None:
                torch.mm(dz, self.weight, out=grads.hidden[start:stop])
            if grads.weight is not None:
                grads.weight.addmm_(dz.t(), h)
        if grads.bias is not None:
            grads.bias += dz.sum(0)
