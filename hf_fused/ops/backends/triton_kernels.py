"""Triton epilogues for one ``[rows, V_chunk]`` fp32 logits tile written by cuBLAS.

``stats_kernel`` folds a chunk into running per-row statistics (online log-sum-exp, the label logit,
and Σ p·z for the entropy); ``grad_kernel`` turns a chunk into the bf16 logits-gradient ``dz`` that the
two gradient matmuls consume. Both apply the logit transform (bias, scale, soft-cap, temperature) on the
fly, so raw matmul output is read once per kernel and never rewritten. One program per row; the row is
streamed in ``BLOCK_V`` column blocks. Runs on CPU tensors under ``TRITON_INTERPRET=1`` (used by CI).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _transform(raw, logit_scale, softcap, inv_temperature, SOFTCAP: tl.constexpr):
    z = raw * logit_scale
    th = z  # placeholder when no soft-cap
    if SOFTCAP:
        # tanh(x) = 2·sigmoid(2x) − 1 (portable across Triton versions and the interpreter)
        th = 2.0 * tl.sigmoid(2.0 * z / softcap) - 1.0
        z = softcap * th
    return z * inv_temperature, th


@triton.jit
def _load_logits(z_row, cols, mask, Bias, col_offset, logit_scale, softcap, inv_temperature,
                 HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr):
    """One column block of a row: raw matmul output (+ bias) in fp32, through the logit transform."""
    raw = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        raw += tl.load(Bias + col_offset + cols, mask=mask, other=0.0).to(tl.float32)
    return _transform(raw, logit_scale, softcap, inv_temperature, SOFTCAP)


@triton.jit
def stats_kernel(
    Z, stride_z, n_cols, col_offset,
    Bias, Labels, M, S, T, ZY,
    logit_scale, softcap, inv_temperature,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Per row r: update running max ``M[r]``, Σexp(z−M) ``S[r]``, Σexp(z−M)·z ``T[r]``; set ``ZY[r]`` to the
    transformed logit of ``Labels[r]`` if it falls in this chunk's columns ``[col_offset, col_offset+n_cols)``."""
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    m = tl.load(M + row)
    s = tl.load(S + row)
    t = tl.load(T + row)  # always allocated; only updated with ENTROPY
    label = tl.load(Labels + row)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < n_cols
        z, _ = _load_logits(z_row, cols, mask, Bias, col_offset, logit_scale, softcap, inv_temperature,
                             HAS_BIAS, SOFTCAP)
        z = tl.where(mask, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        alpha = tl.exp(m - m_new)
        e = tl.where(mask, tl.exp(z - m_new), 0.0)
        s = s * alpha + tl.sum(e, axis=0)
        if ENTROPY:
            t = t * alpha + tl.sum(e * tl.where(mask, z, 0.0), axis=0)
        m = m_new
        # at most one lane holds the label; only that lane stores
        hit = ((cols + col_offset) == label) & mask
        tl.store(ZY + row + tl.zeros_like(cols), z, mask=hit)
    tl.store(M + row, m)
    tl.store(S + row, s)
    tl.store(T + row, t)


@triton.jit
def grad_kernel(
    Z, stride_z, DZ, stride_dz, n_cols, col_offset,
    Bias, Labels, LSE, ENT, G_LP, G_ENT,
    logit_scale, softcap, inv_temperature,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, HAS_G_LP: tl.constexpr, HAS_G_ENT: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """``dz = ∂L/∂raw`` for one chunk: with ``logp = z − lse``, ``p = exp(logp)``:
    ``∂L/∂z_j = g_lp·(1[j=y] − p_j) − g_ent·p_j·(logp_j + H)``, then × 1/temperature, × (1 − tanh²)
    for the soft-cap, × logit_scale."""
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    dz_row = DZ + row * stride_dz
    lse = tl.load(LSE + row)
    label = tl.load(Labels + row)
    # G_LP, G_ENT and ENT are always valid pointers (zeros when a gradient is absent)
    g_lp = tl.load(G_LP + row)
    g_ent = tl.load(G_ENT + row)
    ent = tl.load(ENT + row)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < n_cols
        z, th = _load_logits(z_row, cols, mask, Bias, col_offset, logit_scale, softcap, inv_temperature,
                             HAS_BIAS, SOFTCAP)
        logp = z - lse
        p = tl.exp(logp)
        dz = tl.zeros_like(p)
        if HAS_G_LP:
            dz = g_lp * (tl.where((cols + col_offset) == label, 1.0, 0.0) - p)
        if HAS_G_ENT:
            dz -= g_ent * p * (logp + ent)
        dz = dz * inv_temperature
        if SOFTCAP:
            dz = dz * (1.0 - th * th)
        dz = dz * logit_scale
        tl.store(dz_row + cols, dz.to(DZ.dtype.element_ty), mask=mask)


@triton.jit
def ce_row_kernel(
    Z, stride_z, n_cols, Bias, Labels, LOSS, GRAD_SCALE,
    logit_scale, softcap, inv_temperature,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One full-vocabulary row of raw logits → its loss ``lse − z[y]`` and, in place of the logits,
    ``dz = grad_scale·(softmax(z) − onehot(y))`` through the transform's derivative (gradients in the
    forward: the cross-entropy one-pass path)."""
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    label = tl.load(Labels + row)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.full([], 0.0, tl.float32)
    zy = tl.full([], 0.0, tl.float32)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < n_cols
        z, _ = _load_logits(z_row, cols, mask, Bias, 0, logit_scale, softcap, inv_temperature,
                             HAS_BIAS, SOFTCAP)
        z = tl.where(mask, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.where(mask, tl.exp(z - m_new), 0.0), axis=0)
        m = m_new
        zy += tl.sum(tl.where((cols == label) & mask, z, 0.0), axis=0)
    lse = m + tl.log(s)
    tl.store(LOSS + row, lse - zy)
    if WRITE_GRAD:
        g = tl.load(GRAD_SCALE)
        for start in range(0, n_cols, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = cols < n_cols
            z, th = _load_logits(z_row, cols, mask, Bias, 0, logit_scale, softcap, inv_temperature,
                                 HAS_BIAS, SOFTCAP)
            dz = g * (tl.exp(z - lse) - tl.where(cols == label, 1.0, 0.0)) * inv_temperature
            if SOFTCAP:
                dz = dz * (1.0 - th * th)
            dz = dz * logit_scale
            tl.store(z_row + cols, dz.to(Z.dtype.element_ty), mask=mask)
