"""The Triton kernels of the support loss's one pass (:mod:`.support_pass`): the ``K`` candidate columns of a tile.

A support loss (:func:`hf_fused.ops.linear_support_loss`) reads each row's log-probs at ``K`` candidate ids and has
the logits gradient ``dz_j = Σ_k g_k·1[j = id_k] − p_j·Σ_k g_k − g_H·p_j·(log p_j + H)``: the cross-entropy
gradient's shape with ``K`` scattered label columns. So the tile's bulk is a gradient kernel's (with
``g_lp = Σ_k g_k`` and no label column; :func:`~.shifted_tile.shifted_gradient_`), the candidates' raw logits are
gathered while the tile is written (:func:`~.shifted_tile.logits_chunk_`), and only the ``K`` columns need kernels of
their own, which touch ``[rows, K]`` elements, never ``[rows, V]``:

* :func:`candidate_logits_`: where the logits come from the fused matmul (:mod:`.fused_matmul`, which keeps no fp32
  copy of them), each candidate's fp32 logit ``h·W[id_k]`` computed as that matmul's accumulator computes it: the
  same tensor-core products over the same ``BLOCK_H`` steps of the hidden size, so that the statistics and the
  candidates read one value of each logit (two fp32 computations differ by ~1e-6, which ``1 − Σ_k p_k`` of a
  confident token, divided by in a tail bucket, would carry). Each step is a ``[64, BLOCK_H] × [BLOCK_H, C]`` tensor-
  core product whose 64 rows all hold the row's hidden state (a warpgroup's ``wgmma`` on Hopper, the instruction of
  the matmul's own products): ``K·H`` gathered weight elements per row.
* :func:`support_logprobs_`: once a row's statistics are complete, each candidate's log-prob
  ``s_k = (z − max) − log Σ exp(z − max)`` from its gathered fp32 logit (``-inf`` at invalid slots).
* :func:`scatter_support_grad_`: after the gradient kernel, each valid candidate column's ``dz`` recomputed whole in
  fp32 from the gathered logit (``G_k − p·Σ_k g_k − g_H·p·(log p + H)``, ``G_k`` the sum of ``g`` over the slots with
  the same id, so duplicate ids add up), through the transform's derivative, rounded once into ``dz``. Duplicates
  store the same value.

One program per row; the ``K`` slots in one block (compiled for sm_90 without spills up to ``K = 1024``). Run on CPU
tensors under ``TRITON_INTERPRET=1`` (CI).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...devices import kernel_device
from .fused_matmul_launch import CONFIGS
from .matmul import round_bf16, to_fp32
from .tiles import rounds_to_bf16, without_bias_flag
from .triton_kernels import apply_transform

#: Slots compared at once when summing ``g`` over duplicate ids: a ``[K, DUP_BLOCK]`` block per step.
DUP_BLOCK = 32
#: :func:`candidate_logits_`'s program: one row's ``GATHER_BLOCK_K`` candidate slots, over the hidden size in steps
#: of ``GATHER_BLOCK_H``, the fused matmul's own K step (every launch shape of :data:`~.fused_matmul.CONFIGS` has the
#: same ``block_k``; a test checks it), ``GATHER_STAGES`` steps' loads in flight. One row per program: the steps of a
#: row are a chain of dependent products, so rows in parallel hide their latency.
GATHER_BLOCK_K, GATHER_BLOCK_H, GATHER_STAGES = 64, CONFIGS[0].block_k, 3


def _scatter_launch(block_k: int) -> tuple[int, int]:
    """``(DUP, num_warps)`` of the gradient-columns kernel for ``block_k`` slots: compiled for sm_90 (Triton 3.9)
    without spills up to 1024 slots (4 warps to 256: at most 167 registers; 8 above, 16-slot steps at 1024)."""
    if block_k <= 256:
        return min(DUP_BLOCK, block_k), 4
    return (DUP_BLOCK if block_k <= 512 else 16), 8


@triton.jit
def _candidate_logits_kernel(
    H, stride_h, W, stride_w, Ids, Valid, stride_ids, Bias, RAW, K, n_hidden,
    HAS_BIAS: tl.constexpr, WIDEN_DOT: tl.constexpr, COPIES: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr, STAGES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    in_k = ks < K
    valid = (tl.load(Valid + row * stride_ids + ks, mask=in_k, other=0) != 0) & in_k
    ids = tl.load(Ids + row * stride_ids + ks, mask=valid, other=0)
    acc = tl.zeros([COPIES, BLOCK_K], tl.float32)
    for h0 in tl.range(0, n_hidden, BLOCK_H, num_stages=STAGES):
        hs = h0 + tl.arange(0, BLOCK_H)
        in_h = hs < n_hidden
        # COPIES copies of the row: a tensor-core product whose every row is the fused matmul's own
        x = tl.broadcast_to(tl.load(H + row * stride_h + hs, mask=in_h, other=0.0)[None, :], (COPIES, BLOCK_H))
        w = tl.load(W + ids[:, None] * stride_w + hs[None, :], mask=valid[:, None] & in_h[None, :], other=0.0)
        if WIDEN_DOT:
            acc = tl.dot(to_fp32(x), tl.trans(to_fp32(w)), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    z = tl.max(acc, axis=0)  # equal rows
    if HAS_BIAS:
        z += tl.load(Bias + ids, mask=valid, other=0.0).to(tl.float32)
    tl.store(RAW + row * K + ks, tl.where(valid, z, 0.0), mask=in_k)


@triton.jit
def _support_logprobs_kernel(
    RAW, Valid, stride_valid, RunMax, RunSum, S, K, logit_scale, softcap, inv_temperature,
    SOFTCAP: tl.constexpr, SCALED: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    in_k = ks < K
    valid = tl.load(Valid + row * stride_valid + ks, mask=in_k, other=0) != 0
    raw = tl.load(RAW + row * K + ks, mask=in_k, other=0.0)
    z, _ = apply_transform(raw, logit_scale, softcap, inv_temperature, SOFTCAP, SCALED)
    # (z − max) − log Σ exp(z − max), as log_softmax: a likely candidate's log-prob near 0 keeps its digits
    s = (z - tl.load(RunMax + row)) - tl.log(tl.load(RunSum + row))
    tl.store(S + row * K + ks, tl.where(valid, s, float("-inf")), mask=in_k)


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


def candidate_block(k: int) -> int:
    """``BLOCK_K`` of a kernel holding a row's ``k`` candidate slots in one block."""
    return max(triton.next_power_of_2(k), 16)


def candidate_logits_(h: torch.Tensor, weight: torch.Tensor, bias, ids: torch.Tensor, valid: torch.Tensor,
                      raw: torch.Tensor) -> None:
    """Fill ``raw`` (fp32 ``[rows, K]``) with each valid candidate's raw logit plus bias, ``h[r]·weight[ids[r, k]]
    (+ bias[ids[r, k]])``, the products accumulated in fp32 over ``GATHER_BLOCK_H`` steps of the hidden size, as
    :func:`~.fused_matmul.logits_statistics_`'s accumulator has them (invalid slots: 0, never read).

    Args:
        h: ``[rows, H]``, unit column stride.  weight: ``[V, H]`` in ``h``'s dtype, unit column stride.
        bias: ``[V]`` or None.  ids: int64 ``[rows, K]`` (in ``[0, V)`` at valid slots).
        valid: bool ``[rows, K]`` with ``ids``' strides.  raw: fp32 ``[rows, K]`` contiguous.
    """
    rows, k = ids.shape
    if rows == 0 or k == 0:
        return
    block_k = min(GATHER_BLOCK_K, candidate_block(k))
    with kernel_device(raw):
        _candidate_logits_kernel[(rows, triton.cdiv(k, block_k))](
            h, h.stride(0), weight, weight.stride(0), ids, valid.view(torch.uint8), ids.stride(0),
            raw if bias is None else bias, raw, k, h.shape[1], HAS_BIAS=bias is not None,
            WIDEN_DOT=not h.is_cuda and h.dtype == torch.bfloat16, COPIES=64 if h.is_cuda else 16,
            BLOCK_K=block_k, BLOCK_H=GATHER_BLOCK_H, STAGES=GATHER_STAGES, num_warps=4,
        )


def support_logprobs_(raw: torch.Tensor, valid: torch.Tensor, run_max: torch.Tensor, run_sum: torch.Tensor,
                      s: torch.Tensor, scalars: dict) -> None:
    """Fill ``s`` (fp32 ``[rows, K]``) with each candidate's log-prob ``(z − max) − log Σexp`` after the logit
    transform, from its raw logit plus bias ``raw`` and the rows' complete ``run_max`` and ``run_sum``; ``-inf`` at
    invalid slots.

    Args:
        raw: fp32 ``[rows, K]`` contiguous (:func:`~.shifted_tile.logits_chunk_` gathers it).
        valid: bool ``[rows, K]``, unit column stride.  run_max, run_sum: fp32 ``[rows]``.
        s: fp32 ``[rows, K]`` contiguous.  scalars: :func:`~.tiles.kernel_scalars` (the bias flag is not read).
    """
    rows, k = raw.shape
    if rows == 0:
        return
    with kernel_device(raw):
        _support_logprobs_kernel[(rows,)](
            raw, valid.view(torch.uint8), valid.stride(0), run_max, run_sum, s, k, BLOCK_K=candidate_block(k), num_warps=4,
            **without_bias_flag(scalars),
        )


def scatter_support_grad_(dz: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, raw: torch.Tensor,
                          g: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor, g_ent, scalars: dict) -> None:
    """Set each valid candidate column of ``dz [rows, V]`` (which holds ``−p·Σ_k g_k − g_H·p·(log p + H)``, through
    the transform's derivative, from the gradient kernel) to its whole logits gradient
    ``G_k − p·Σ_k g_k − g_H·p·(log p + H)`` computed in fp32 from the gathered ``raw`` logit and rounded once.

    Args:
        dz: ``[rows, V]``, unit column stride, in the tile's dtype.
        ids: int64 ``[rows, K]`` in ``[0, V)``.  valid: bool ``[rows, K]`` with ``ids``' strides.
        raw: fp32 ``[rows, K]`` contiguous, each candidate's raw logit plus bias.
        g: fp32 ``[rows, K]`` contiguous, ``∂L/∂s_k`` (read at valid slots only).
        lse, ent: fp32 ``[rows]`` (``ent`` read only with ``g_ent``).  g_ent: fp32 ``[rows]`` ``∂L/∂H`` or None.
        scalars: :func:`~.tiles.kernel_scalars` (the bias flag is not read: the bias is in ``raw``).
    """
    rows, k = ids.shape
    if rows == 0:
        return
    dup, warps = _scatter_launch(candidate_block(k))
    with kernel_device(dz):
        _scatter_support_grad_kernel[(rows,)](
            dz, dz.stride(0), ids, valid.view(torch.uint8), ids.stride(0), raw, g, lse, ent,
            lse if g_ent is None else g_ent, k, HAS_G_ENT=g_ent is not None,
            ROUND=int(rounds_to_bf16(dz)), BLOCK_K=candidate_block(k), DUP=dup,
            num_warps=warps, **without_bias_flag(scalars),
        )


__all__ = ["GATHER_BLOCK_H", "GATHER_BLOCK_K", "GATHER_STAGES", "candidate_block", "candidate_logits_",
           "scatter_support_grad_", "support_logprobs_"]
