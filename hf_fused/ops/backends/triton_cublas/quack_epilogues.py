"""QuACK's Hopper GEMM (``quack-kernels``) with hf_fused's epilogues: the optional QuACK kernels of the GPU backend.

- :func:`logits_with_statistics`: the one pass's logits tile with each row's log-sum-exp and label logit reduced
  in the matmul's epilogue (the statistics kernel's read of the tile gone: 3–6 % less time per step).
- :func:`softmax_grad`: the two passes' ``dz`` tile ``−g·exp(z − lse)`` and the gathered label logit, from which
  :func:`.logits_epilogues.label_grad_` sets the label column (the Triton fused-``dz`` kernel's bits, 16–22 % less
  time per tile on an H200).

Both round the fp32 accumulator to bf16 first, as the matmul's store does, so every statistic is that of the
rounded tile (docs/design/numerics.md, "Epilogues"). This module imports QuACK and the CuTe DSL at import time;
:mod:`.quack_bridge` imports it only where ``quack`` is installed and a call can use it, and turns it off for the
process, with one warning, when importing or running it raises. Measured with quack-kernels 0.6.4 and
nvidia-cutlass-dsl 4.6.2 (QuACK 0.6.5 with the DSL 4.7 and 4.8 could not build any epilogue).
"""

from __future__ import annotations

import cutlass
import torch
from cutlass import Float32
from quack.epilogue.frontend import gemm_epilogue
from quack.epilogue.math import pexp
from quack.epilogue.ops import ColVecLoad, ColVecSelect, OnlineLSEReduce

_LABELS = ColVecLoad("target")


@gemm_epilogue(
    outs={"lse": OnlineLSEReduce("lse"), "target_logit": ColVecSelect("target_logit", idx_op=_LABELS)},
    extra_ops=(_LABELS,),
)
def bf16_logits_statistics(acc):
    """The bf16 logit (as fp32) is stored, reduced into the row's online log-sum-exp, and gathered at the
    row's label column."""
    z = Float32(cutlass.BFloat16(acc))
    return {"D": z, "lse": z, "target_logit": z}


def logits_with_statistics(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, out: torch.Tensor, *, lse: torch.Tensor,
    label_logit: torch.Tensor,
) -> None:
    """``out = hidden @ weight.T`` rounded to bf16, and per row the log-sum-exp and label logit of ``out``.

    Args:
        hidden: ``[M, H]`` bf16, contiguous, ``H`` a multiple of 8 (16-byte rows for the TMA loads).
        weight: ``[V, H]`` bf16, contiguous, ``V`` a multiple of 8.
        labels: ``[M]`` int64 in ``[0, V)`` (the kept rows' labels).
        out: ``[M, V]`` bf16, contiguous: the logits tile, written.
        lse, label_logit: fp32 ``[M]``, contiguous: written.
    """
    res = bf16_logits_statistics(hidden, weight.mT, out={"D": out}, target=labels, target_logit=label_logit,
                                 tuned=False)
    lse.copy_(res["lse"])


@gemm_epilogue(
    ops={"lse": ColVecLoad("lse"), "scale": ColVecLoad("scale")},
    outs={"target_logit": ColVecSelect("target_logit", idx_op=_LABELS)},
    extra_ops=(_LABELS,),
)
def bf16_softmax_grad(acc, lse, scale):
    """The tile stores ``scale·p`` with ``p = exp(z − lse)`` of the bf16 logit ``z`` (the logits gradient but at the
    label column, fixed afterwards from the gathered label logit)."""
    z = Float32(cutlass.BFloat16(acc))
    return {"D": scale * pexp(z - lse), "target_logit": z}


def softmax_grad(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor,
    out: torch.Tensor, label_logit: torch.Tensor,
) -> None:
    """``out = scale[:, None]·exp(z − lse[:, None])`` rounded to bf16, ``z = bf16(hidden @ weight.T)``, and the
    label logit of ``z`` where the label falls in the tile's columns (``label_logit`` left as it is elsewhere).

    Args:
        hidden: ``[M, H]`` bf16, contiguous, ``H`` a multiple of 8.  weight: ``[N, H]`` bf16, contiguous, ``N`` a
            multiple of 8 (a row slice of the lm_head).
        labels: ``[M]`` int64, each row's label column relative to the slice (out of ``[0, N)``: none here).
        lse, scale: fp32 ``[M]``, contiguous (the row's log-sum-exp over the whole vocabulary; ``−∂L/∂logp``).
        out: ``[M, N]`` bf16, contiguous: written.  label_logit: fp32 ``[M]``: written where the label is inside.
    Every tensor must start 16-byte aligned (QuACK's TMA)."""
    bf16_softmax_grad(hidden, weight.mT, out={"D": out}, lse=lse, scale=scale, target=labels,
                      target_logit=label_logit, tuned=False)
