"""The Triton kernels of the support loss's one pass (:mod:`.support_pass`): the ``K`` candidate columns of a tile.

A support loss (:func:`hf_fused.ops.linear_support_loss`) reads each row's log-probs at ``K`` candidate ids and has
the logits gradient ``dz_j = Σ_k g_k·1[j = id_k] − p_j·Σ_k g_k − g_H·p_j·(log p_j + H)``: the cross-entropy
gradient's shape with ``K`` scattered label columns. So the tile's bulk is the gradient kernel's (with
``g_lp = Σ_k g_k`` and no label column; :func:`gradient_into_` runs it from the pass's fp32 logits tile into a bf16
``dz`` written in the tile's own bytes), and only the ``K`` columns need kernels of their own, which touch
``[rows, K]`` elements, never ``[rows, V]``:

* :func:`gather_support_`: before the gradient overwrites the tile, each candidate's raw logit (plus bias) and its
  log-prob ``s_k = (z − max) − log Σ exp(z − max)`` from the row's running statistics (``-inf`` at invalid slots).
* :func:`scatter_support_grad_`: after it, each valid candidate column's ``dz`` recomputed whole in fp32 from the
  gathered logit (``G_k − p·Σ_k g_k − g_H·p·(log p + H)``, ``G_k`` the sum of ``g`` over the slots with the same id,
  so duplicate ids add up), through the transform's derivative, rounded once into ``dz``. Duplicates store the
  same value.

One program per row; the ``K`` slots in one block (compiled for sm_90 without spills up to ``K = 1024``). Run on CPU
tensors under ``TRITON_INTERPRET=1`` (CI).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .matmul import round_bf16
from .tiles import GRAD_BLOCK_V, GRAD_WARPS
from .triton_kernels import apply_transform, grad_kernel

#: Slots compared at once when summing ``g`` over duplicate ids: a ``[K, DUP_BLOCK]`` block per step.
DUP_BLOCK = 32


def _scatter_launch(block_k: int) -> tuple[int, int]:
    """``(DUP, num_warps)`` of the gradient-columns kernel for ``block_k`` slots: compiled for sm_90 (Triton 3.9)
    without spills up to 1024 slots (4 warps to 256: at most 167 registers; 8 above, 16-slot steps at 1024)."""
    if block_k <= 256:
        return min(DUP_BLOCK, block_k), 4
    return (DUP_BLOCK if block_k <= 512 else 16), 8


@triton.jit
def _gather_support_kernel(
    Z, stride_z, Ids, Valid, stride_ids, Bias, RunMax, RunSum, RAW, S, K,
    logit_scale, softcap, inv_temperature,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, SCALED: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    in_k = ks < K
    ids = tl.load(Ids + row * stride_ids + ks, mask=in_k, other=0)
    valid = tl.load(Valid + row * stride_ids + ks, mask=in_k, other=0) != 0
    raw = tl.load(Z + row * stride_z + ids, mask=in_k, other=0.0).to(tl.float32)
    if HAS_BIAS:
        raw += tl.load(Bias + ids, mask=in_k, other=0.0).to(tl.float32)
    z, _ = apply_transform(raw, logit_scale, softcap, inv_temperature, SOFTCAP, SCALED)
    # (z − max) − log Σ exp(z − max), as log_softmax: a likely candidate's log-prob near 0 keeps its digits
    s = (z - tl.load(RunMax + row)) - tl.log(tl.load(RunSum + row))
    s = tl.where(valid, s, float("-inf"))
    tl.store(RAW + row * K + ks, raw, mask=in_k)
    tl.store(S + row * K + ks, s, mask=in_k)


@triton.jit
def _scatter_support_grad_kernel(
    DZ, stride_dz, Ids, Valid, stride_ids, RAW, G, LSE, ENT, G_ENT, K,
    logit_scale, softcap, inv_temperature,
    SOFTCAP: tl.constexpr, SCALED: tl.constexpr, HAS_G_ENT: tl.constexpr, ROUND: tl.constexpr,
    BLOCK_K: tl.constexpr, DUP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    in_k = ks < K
    ids = tl.load(Ids + row * stride_ids + ks, mask=in_k, other=-1)
    valid = (tl.load(Valid + row * stride_ids + ks, mask=in_k, other=0) != 0) & in_k
    g = tl.where(valid, tl.load(G + row * K + ks, mask=in_k, other=0.0), 0.0)
    g_total = tl.sum(g, axis=0)
    # G_k = Σ_{k' valid, id_k' = id_k} g_k': a duplicate id's column gets every slot's share
    g_same = tl.zeros([BLOCK_K], tl.float32)
    for j0 in range(0, K, DUP):
        js = j0 + tl.arange(0, DUP)
        in_j = js < K
        ids_j = tl.load(Ids + row * stride_ids + js, mask=in_j, other=-1)
        valid_j = (tl.load(Valid + row * stride_ids + js, mask=in_j, other=0) != 0) & in_j
        g_j = tl.where(valid_j, tl.load(G + row * K + js, mask=in_j, other=0.0), 0.0)
        same = (ids[:, None] == ids_j[None, :]) & valid_j[None, :]
        g_same += tl.sum(tl.where(same, g_j[None, :], 0.0), axis=1)
    raw = tl.load(RAW + row * K + ks, mask=in_k, other=0.0)
    z, th = apply_transform(raw, logit_scale, softcap, inv_temperature, SOFTCAP, SCALED)
    logp = z - tl.load(LSE + row)
    p = tl.exp(logp)
    dz = g_same - p * g_total
    if HAS_G_ENT:
        dz -= tl.load(G_ENT + row) * p * (logp + tl.load(ENT + row))
    if SCALED:
        dz = dz * inv_temperature
    if SOFTCAP:
        dz = dz * (1.0 - th * th)
    if SCALED:
        dz = dz * logit_scale
    if ROUND == 1:  # the interpreter's fp32 → bf16 conversion truncates: round on the bit pattern
        dz, _ = round_bf16(dz)
    tl.store(DZ + row * stride_dz + ids, dz.to(DZ.dtype.element_ty), mask=valid)


def _block_k(k: int) -> int:
    return max(triton.next_power_of_2(k), 16)


def gradient_into_(z: torch.Tensor, dz: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor,
                   g_lp: torch.Tensor, g_ent, bias, scalars: dict) -> None:
    """``dz [rows, V]`` ← the gradient kernel's ``g_lp·(1[c = label] − p) − g_ent·p·(log p + H)`` (through the
    transform's derivative) of the fp32 raw logits ``z [rows, V]``, rounded once to ``dz``'s dtype
    (:func:`~.triton_kernels.grad_kernel` with its own output). ``dz`` may be a bf16 view of ``z``'s own bytes whose
    row ``r`` is the first half of ``z``'s row ``r`` (row stride ``2·V`` elements): each program reads a column block
    before it stores that block, and its stores land on columns of its own row it has read already.

    Args:
        z: fp32 ``[rows, V]``, unit column stride.  dz: ``[rows, V]``, unit column stride.
        labels: int64 ``[rows]`` (``-1``: no label column).  lse, ent, g_lp: fp32 ``[rows]``.
        g_ent: fp32 ``[rows]`` or None.  bias: the whole ``[V]`` bias or None.  scalars: :func:`~.tiles.kernel_scalars`.
    """
    rows, vocab_size = z.shape
    if rows == 0:
        return
    with torch.cuda.device(z.device) if z.is_cuda else contextlib.nullcontext():
        grad_kernel[(rows,)](
            z, z.stride(0), dz, dz.stride(0), vocab_size, 0, bias if bias is not None else lse, labels, lse, ent,
            g_lp, lse if g_ent is None else g_ent, lse, HAS_G_LP=True, HAS_G_ENT=g_ent is not None, SUM_PZ=False,
            BLOCK_V=GRAD_BLOCK_V, num_warps=GRAD_WARPS, **scalars,
        )


def gather_support_(z: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, bias, run_max: torch.Tensor,
                    run_sum: torch.Tensor, raw: torch.Tensor, s: torch.Tensor, scalars: dict) -> None:
    """Fill ``raw`` (fp32 ``[rows, K]``: each candidate's raw logit from the tile ``z [rows, V]``, plus the bias) and
    ``s`` (fp32 ``[rows, K]``: its log-prob ``(z − max) − log Σexp`` after the logit transform, from the rows'
    ``run_max`` and ``run_sum``; ``-inf`` at invalid slots).

    Args:
        z: ``[rows, V]`` raw logits (the one pass's tile, unit column stride).
        ids: int64 ``[rows, K]`` in ``[0, V)`` (clamped: invalid slots are read, never used).
        valid: bool ``[rows, K]`` with ``ids``' strides.  bias: the whole ``[V]`` bias or None.
        run_max, run_sum: fp32 ``[rows]``, the statistics kernel's running max and Σexp(z − max).
        scalars: :func:`~.tiles.kernel_scalars`.
    """
    rows, k = ids.shape
    if rows == 0:
        return
    with torch.cuda.device(z.device) if z.is_cuda else contextlib.nullcontext():
        _gather_support_kernel[(rows,)](
            z, z.stride(0), ids, valid.view(torch.uint8), ids.stride(0), bias if bias is not None else run_max,
            run_max, run_sum, raw, s, k, BLOCK_K=_block_k(k), num_warps=4, **scalars,
        )


def scatter_support_grad_(dz: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, raw: torch.Tensor,
                          g: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor, g_ent, scalars: dict) -> None:
    """Set each valid candidate column of ``dz [rows, V]`` (which holds ``−p·Σ_k g_k − g_H·p·(log p + H)``, through
    the transform's derivative, from the gradient kernel) to its whole logits gradient
    ``G_k − p·Σ_k g_k − g_H·p·(log p + H)`` computed in fp32 from the gathered ``raw`` logit and rounded once.

    Args:
        dz: ``[rows, V]``, unit column stride, in the tile's dtype.
        ids, valid: as :func:`gather_support_`.  raw: fp32 ``[rows, K]`` from it.
        g: fp32 ``[rows, K]`` contiguous, ``∂L/∂s_k`` (read at valid slots only).
        lse, ent: fp32 ``[rows]`` (``ent`` read only with ``g_ent``).  g_ent: fp32 ``[rows]`` ``∂L/∂H`` or None.
        scalars: :func:`~.tiles.kernel_scalars` (the bias flag is not read: the bias is in ``raw``).
    """
    rows, k = ids.shape
    if rows == 0:
        return
    kernel_scalars = {name: value for name, value in scalars.items() if name != "HAS_BIAS"}
    dup, warps = _scatter_launch(_block_k(k))
    with torch.cuda.device(dz.device) if dz.is_cuda else contextlib.nullcontext():
        _scatter_support_grad_kernel[(rows,)](
            dz, dz.stride(0), ids, valid.view(torch.uint8), ids.stride(0), raw, g, lse, ent,
            lse if g_ent is None else g_ent, k, HAS_G_ENT=g_ent is not None,
            ROUND=1 if (dz.dtype == torch.bfloat16 and not dz.is_cuda) else 0, BLOCK_K=_block_k(k), DUP=dup,
            num_warps=warps, **kernel_scalars,
        )


__all__ = ["gather_support_", "gradient_into_", "scatter_support_grad_"]
