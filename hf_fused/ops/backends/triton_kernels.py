"""Triton epilogues for one ``[rows, V_chunk]`` tile of raw logits written by cuBLAS.

``stats_kernel`` folds a chunk into running per-row statistics (online log-sum-exp, the label logit,
Σ p·z for the entropy and, when asked, the gradient-free token statistics of
:mod:`hf_fused.ops.token_statistics`: Σ z, the first arg-max, Σ exp(2(z − m))); ``grad_kernel`` turns a
chunk into the logits-gradient ``dz`` that the two gradient matmuls consume. Both apply the logit transform (bias, scale, soft-cap, temperature) on the
fly, so raw matmul output is read once per kernel. One program per row, streaming the row in
``BLOCK_V`` column blocks. Runs on CPU tensors under ``TRITON_INTERPRET=1`` (used by CI).

Measured on an H200 (docs/gpu_results.md): these kernels are bound by instructions per logit, not by
memory. A statistics kernel with a reduction per column block, or one program per block followed by a
combine, read 1.1–1.5 TB/s; keeping the online log-sum-exp per lane with one exponential per logit
(below) reads 2.0–2.3 TB/s. Fusing the two for whole-vocabulary rows (statistics, then ``dz`` from a
second read of the row, in one persistent launch meant to find that row still in L2) was no faster on
an H100 in any launch shape tried (10.8 ms for the two kernels vs 11.0–23.5 ms fused, docs/gpu_results.md).
"""

from __future__ import annotations

import triton
import triton.language as tl

# Below every finite fp32 value: a lane's max before its first column, and the value of masked-out
# columns. Finite (unlike −inf) so that ``exp(−|z − m|)`` is never ``exp(nan)``.
_NO_MAX = tl.constexpr(-3.4028234663852886e38)


@triton.jit
def _transform(raw, logit_scale, softcap, inv_temperature, SOFTCAP: tl.constexpr, SCALED: tl.constexpr):
    z = raw
    if SCALED:  # logit_scale or temperature ≠ 1 (two multiplies per logit saved otherwise)
        z = z * logit_scale
    th = z  # placeholder when no soft-cap
    if SOFTCAP:
        # tanh(x) = 2·sigmoid(2x) − 1 (portable across Triton versions and the interpreter)
        th = 2.0 * tl.sigmoid(2.0 * z / softcap) - 1.0
        z = softcap * th
    if SCALED:
        z = z * inv_temperature
    return z, th


@triton.jit
def _load_logits(z_row, cols, mask, Bias, col_offset, logit_scale, softcap, inv_temperature,
                 HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, SCALED: tl.constexpr):
    """One column block of a row: raw matmul output (+ bias) in fp32, through the logit transform."""
    raw = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        raw += tl.load(Bias + col_offset + cols, mask=mask, other=0.0).to(tl.float32)
    return _transform(raw, logit_scale, softcap, inv_temperature, SOFTCAP, SCALED)


@triton.jit
def _row_lanes(z_row, n_cols, col_offset, Bias, logit_scale, softcap, inv_temperature,
               HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, SCALED: tl.constexpr, ENTROPY: tl.constexpr,
               SUM_Z: tl.constexpr, ARGMAX: tl.constexpr, SUM_SQ: tl.constexpr, BLOCK_V: tl.constexpr):
    """One row's columns folded into per-lane (running max, Σexp(z−m), Σexp(z−m)·z, Σz, first column of the max,
    Σexp(2(z−m))), ``[BLOCK_V]`` each; the last four only under their flags (zeros otherwise, so a launch that
    asks for none of them compiles to the kernel without them).

    Each lane keeps its own running max ``m`` and sums and rescales only when its max grows: with
    ``e = exp(−|z − m|)``, ``s ← s·e + 1`` if ``z > m`` else ``s + e`` (one exponential per logit, no
    cross-lane reduction until the end), and ``s2 ← s2·e² + 1`` or ``s2 + e²`` with the same ``e``. A lane
    visits its columns in increasing order, so recording the column only when the max grows strictly keeps
    the first maximum (``torch.argmax``'s tie rule). Full column blocks are read without masks."""
    m_lane = tl.full([BLOCK_V], _NO_MAX, tl.float32)
    s_lane = tl.zeros([BLOCK_V], tl.float32)
    t_lane = tl.zeros([BLOCK_V], tl.float32)
    zsum_lane = tl.zeros([BLOCK_V], tl.float32)
    arg_lane = tl.zeros([BLOCK_V], tl.int32)
    s2_lane = tl.zeros([BLOCK_V], tl.float32)
    n_full = n_cols // BLOCK_V * BLOCK_V
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        if start < n_full:
            raw = tl.load(z_row + cols).to(tl.float32)
            if HAS_BIAS:
                raw += tl.load(Bias + col_offset + cols).to(tl.float32)
            z, _ = _transform(raw, logit_scale, softcap, inv_temperature, SOFTCAP, SCALED)
            if SUM_Z:
                zsum_lane += z
        else:
            z, _ = _load_logits(z_row, cols, cols < n_cols, Bias, col_offset, logit_scale, softcap,
                                inv_temperature, HAS_BIAS, SOFTCAP, SCALED)
            if SUM_Z:  # masked columns load as 0 and every logit transform maps 0 to 0
                zsum_lane += z
            z = tl.where(cols < n_cols, z, _NO_MAX)
        grows = z > m_lane
        e = tl.exp(-tl.abs(z - m_lane))  # exp(m − z) where the max grows, else exp(z − m)
        s_lane = tl.where(grows, s_lane * e + 1.0, s_lane + e)
        if ENTROPY:  # Σ exp(z − m)·z; masked columns add e·_NO_MAX with e = 0
            t_lane = tl.where(grows, t_lane * e + z, t_lane + tl.where(e > 0.0, e * z, 0.0))
        if ARGMAX:
            arg_lane = tl.where(grows, cols, arg_lane)
        if SUM_SQ:  # Σ exp(2(z − m)) = Σ (exp(z − m))²: rescaled by e² when the max grows
            e2 = e * e
            s2_lane = tl.where(grows, s2_lane * e2 + 1.0, s2_lane + e2)
        m_lane = tl.maximum(m_lane, z)
    return m_lane, s_lane, t_lane, zsum_lane, arg_lane, s2_lane


@triton.jit
def _label_logit(z_row, label, col_offset, Bias, logit_scale, softcap, inv_temperature,
                 HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, SCALED: tl.constexpr):
    """The transformed logit of column ``label`` (one scalar load instead of a compare per logit)."""
    raw_y = tl.load(z_row + (label - col_offset)).to(tl.float32)
    if HAS_BIAS:
        raw_y += tl.load(Bias + label).to(tl.float32)
    z_y, _ = _transform(raw_y, logit_scale, softcap, inv_temperature, SOFTCAP, SCALED)
    return z_y


@triton.jit
def _logit_grad(z, th, is_label, lse, ent, g_lp, g_ent, logit_scale, inv_temperature, SOFTCAP: tl.constexpr,
                SCALED: tl.constexpr, HAS_G_LP: tl.constexpr, HAS_G_ENT: tl.constexpr):
    """``(dz, p)`` of transformed logits ``z`` (``th``: their soft-cap's tanh) given the row's ``lse``, entropy
    and upstream gradients (scalars or broadcastable blocks): with ``logp = z − lse``, ``p = exp(logp)``,
    ``∂L/∂z = g_lp·(1[is_label] − p) − g_ent·p·(logp + H)``, then × 1/temperature, × (1 − tanh²) for the
    soft-cap, × logit_scale: ``∂L/∂raw``."""
    logp = z - lse
    p = tl.exp(logp)
    dz = tl.zeros_like(p)
    if HAS_G_LP:
        dz = g_lp * (tl.where(is_label, 1.0, 0.0) - p)
    if HAS_G_ENT:
        dz -= g_ent * p * (logp + ent)
    if SCALED:
        dz = dz * inv_temperature
    if SOFTCAP:
        dz = dz * (1.0 - th * th)
    if SCALED:
        dz = dz * logit_scale
    return dz, p


@triton.jit
def _row_grad(z_row, dz_row, n_cols, col_offset, Bias, label, lse, ent, g_lp, g_ent,
              logit_scale, softcap, inv_temperature,
              HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, SCALED: tl.constexpr, HAS_G_LP: tl.constexpr,
              HAS_G_ENT: tl.constexpr, SUM_PZ: tl.constexpr, BLOCK_V: tl.constexpr):
    """One row's ``dz = ∂L/∂raw``: with ``logp = z − lse``, ``p = exp(logp)``:
    ``∂L/∂z_c = g_lp·(1[c=y] − p_c) − g_ent·p_c·(logp_c + H)``, then × 1/temperature, × (1 − tanh²) for the
    soft-cap, × logit_scale. ``dz_row`` may alias ``z_row``. With ``SUM_PZ``, returns the row's ``Σ_c p_c·z_c``
    over the chunk (fp32; ``lse − Σ p·z`` is the entropy when the chunk is the whole vocabulary), else 0."""
    pz = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < n_cols
        z, th = _load_logits(z_row, cols, mask, Bias, col_offset, logit_scale, softcap, inv_temperature,
                             HAS_BIAS, SOFTCAP, SCALED)
        dz, p = _logit_grad(z, th, (cols + col_offset) == label, lse, ent, g_lp, g_ent, logit_scale,
                            inv_temperature, SOFTCAP, SCALED, HAS_G_LP, HAS_G_ENT)
        if SUM_PZ:
            pz += tl.where(mask, p * z, 0.0)
        tl.store(dz_row + cols, dz.to(dz_row.dtype.element_ty), mask=mask)
    return tl.sum(pz, axis=0)


@triton.jit
def stats_kernel(
    Z, stride_z, n_cols, col_offset,
    Bias, Labels, M, S, T, ZY, ZSUM, ARG, S2,
    logit_scale, softcap, inv_temperature,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, SCALED: tl.constexpr, ENTROPY: tl.constexpr,
    SUM_Z: tl.constexpr, ARGMAX: tl.constexpr, SUM_SQ: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Per row r (one program each): update the running max ``M[r]`` (starts at −inf), Σexp(z−M) ``S[r]``
    and Σexp(z−M)·z ``T[r]`` (start at 0); set ``ZY[r]`` to the transformed logit of ``Labels[r]`` if it
    falls in this chunk's columns ``[col_offset, col_offset + n_cols)``. Under their flags: Σz ``ZSUM[r]``
    (starts at 0), the first column of the maximum ``ARG[r]`` (int64; chunks must come in increasing column
    order, and a later chunk takes over only with a strictly larger maximum) and Σexp(2(z−M)) ``S2[r]`` (starts
    at 0). Pointers of statistics not asked for are never read."""
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    m_lane, s_lane, t_lane, zsum_lane, arg_lane, s2_lane = _row_lanes(
        z_row, n_cols, col_offset, Bias, logit_scale, softcap, inv_temperature,
        HAS_BIAS, SOFTCAP, SCALED, ENTROPY, SUM_Z, ARGMAX, SUM_SQ, BLOCK_V,
    )
    m_old = tl.load(M + row)
    m_chunk = tl.max(m_lane, axis=0)
    m = tl.maximum(m_old, m_chunk)
    w = tl.exp(m_lane - m)
    alpha = tl.exp(m_old - m)
    tl.store(M + row, m)
    tl.store(S + row, tl.load(S + row) * alpha + tl.sum(s_lane * w, axis=0))
    if ENTROPY:
        tl.store(T + row, tl.load(T + row) * alpha + tl.sum(t_lane * w, axis=0))
    if SUM_Z:
        tl.store(ZSUM + row, tl.load(ZSUM + row) + tl.sum(zsum_lane, axis=0))
    if ARGMAX:
        # the smallest column among the lanes holding the chunk's maximum: the chunk's first maximum
        first = tl.min(tl.where(m_lane == m_chunk, arg_lane, n_cols), axis=0)
        if m_chunk > m_old:
            tl.store(ARG + row, (first + col_offset).to(tl.int64))
    if SUM_SQ:
        tl.store(S2 + row, tl.load(S2 + row) * (alpha * alpha) + tl.sum(s2_lane * (w * w), axis=0))
    label = tl.load(Labels + row)
    if (label >= col_offset) & (label < col_offset + n_cols):
        tl.store(ZY + row, _label_logit(z_row, label, col_offset, Bias, logit_scale, softcap, inv_temperature,
                                        HAS_BIAS, SOFTCAP, SCALED))


@triton.jit
def grad_kernel(
    Z, stride_z, DZ, stride_dz, n_cols, col_offset,
    Bias, Labels, LSE, ENT, G_LP, G_ENT, PZ,
    logit_scale, softcap, inv_temperature,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, SCALED: tl.constexpr, HAS_G_LP: tl.constexpr,
    HAS_G_ENT: tl.constexpr, SUM_PZ: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """``dz`` for one chunk (see ``_row_grad``), one program per row. ``DZ`` may alias ``Z``.
    G_LP, G_ENT and ENT are always valid pointers (zeros when a gradient is absent). With ``SUM_PZ``,
    ``PZ[row]`` is set to the row's Σ p·z over the chunk (the one pass's entropy when the statistics came from
    a matmul epilogue that has no entropy reduction); ``PZ`` is otherwise never written."""
    row = tl.program_id(0).to(tl.int64)
    pz = _row_grad(Z + row * stride_z, DZ + row * stride_dz, n_cols, col_offset, Bias, tl.load(Labels + row),
                   tl.load(LSE + row), tl.load(ENT + row), tl.load(G_LP + row), tl.load(G_ENT + row),
                   logit_scale, softcap, inv_temperature, HAS_BIAS, SOFTCAP, SCALED, HAS_G_LP, HAS_G_ENT, SUM_PZ,
                   BLOCK_V)
    if SUM_PZ:
        tl.store(PZ + row, pz)
