"""The Triton tile kernels: per-row epilogues for one ``[rows, cols]`` tile of raw logits written by cuBLAS.

``stats_kernel`` folds a chunk into running per-row statistics (online log-sum-exp, the label logit, Σ p·z for
the entropy and, when asked, the token statistics of :mod:`hf_fused.ops.token_statistics`: Σ z, the first
arg-max, Σ exp(2(z − m))); ``grad_kernel`` turns a chunk into the logits-gradient ``dz`` that the gradient
matmuls consume. Both apply the logit transform (bias, scale, soft-cap, temperature) on the fly
(:func:`apply_transform`, :func:`logit_grad`: also used by :mod:`.logits_epilogues`). One program per row,
streaming it in ``BLOCK_V`` column blocks. Runs on CPU tensors under ``TRITON_INTERPRET=1`` (CI). What bounds
their speed and the layouts measured: docs/design/numerics.md ("Tile kernels").
"""

from __future__ import annotations

import triton
import triton.language as tl

# Below every finite fp32 value: a lane's max before its first column, and the value of masked-out
# columns. Finite (unlike −inf) so that a lane's rescale ``exp(m_old − m_new)`` is never ``exp(−inf + inf)``.
_NO_MAX = tl.constexpr(-3.4028234663852886e38)
#: log2(e): exp(x) = exp2(x·LOG2E), the form the kernels take exponentials in (one multiply and the fast exp2)
LOG2E = tl.constexpr(1.4426950408889634)
# Columns of one lane of the statistics kernel: one 16-byte load of bf16 logits per thread.
_VEC = tl.constexpr(8)


@triton.jit
def apply_transform(raw, logit_scale, softcap, inv_temperature, SOFTCAP: tl.constexpr, SCALED: tl.constexpr):
    """``(z, tanh)``: raw logits through the logit transform (× logit_scale, soft-cap, × 1/temperature), and the
    soft-cap's tanh (``raw`` scaled where there is none) for the gradient."""
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
    return apply_transform(raw, logit_scale, softcap, inv_temperature, SOFTCAP, SCALED)


@triton.jit
def _row_lanes(z_row, n_cols, col_offset, Bias, logit_scale, softcap, inv_temperature,
               HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, SCALED: tl.constexpr, ENTROPY: tl.constexpr,
               SUM_Z: tl.constexpr, ARGMAX: tl.constexpr, SUM_SQ: tl.constexpr, BLOCK_V: tl.constexpr):
    """One row's columns folded into per-lane (running max, Σexp(z−m), Σexp(z−m)·z, Σz, first column of the max,
    Σexp(2(z−m))), ``[BLOCK_V // _VEC]`` each; the last four only under their flags (zeros otherwise, so a launch
    that asks for none of them compiles to the kernel without them).

    A lane is ``_VEC`` adjacent columns of each column block, which one thread loads with one vector load, so the
    lane's max over them is a reduction inside the thread. The lane's sums are rescaled once per block by
    ``exp(m_old − m_new)`` and each logit then costs one fused multiply-add and one exponential,
    ``exp2(z·log2e − m·log2e)``, instead of a compare, two selects and a rescale per logit for a running max
    per column (0.298 → 0.257 ms per 2048 × 151936 tile at the same launch shape on an H100, 0.232 at the
    best one).
    A lane visits its column groups in increasing order and takes a group's first maximum
    (``tl.argmax``'s left tie-break) only when it is strictly larger, which keeps the first maximum
    (``torch.argmax``'s tie rule). Full column blocks are read without masks."""
    LANES: tl.constexpr = BLOCK_V // _VEC
    m_lane = tl.full([LANES], _NO_MAX, tl.float32)
    s_lane = tl.zeros([LANES], tl.float32)
    t_lane = tl.zeros([LANES], tl.float32)
    zsum_lane = tl.zeros([LANES], tl.float32)
    arg_lane = tl.zeros([LANES], tl.int32)
    s2_lane = tl.zeros([LANES], tl.float32)
    lane_cols = tl.arange(0, LANES)[:, None] * _VEC + tl.arange(0, _VEC)[None, :]
    n_full = n_cols // BLOCK_V * BLOCK_V
    for start in range(0, n_cols, BLOCK_V):
        cols = start + lane_cols
        if start < n_full:
            raw = tl.load(z_row + cols).to(tl.float32)
            if HAS_BIAS:
                raw += tl.load(Bias + col_offset + cols).to(tl.float32)
            z, _ = apply_transform(raw, logit_scale, softcap, inv_temperature, SOFTCAP, SCALED)
            z_max = z
            m_new = tl.maximum(m_lane, tl.max(z, axis=1))
            e = tl.exp2(z * LOG2E - (m_new * LOG2E)[:, None])
        else:
            valid = cols < n_cols
            # masked columns load as 0, which every logit transform maps to 0: nothing added to Σz or Σe·z
            z, _ = _load_logits(z_row, cols, valid, Bias, col_offset, logit_scale, softcap, inv_temperature,
                                HAS_BIAS, SOFTCAP, SCALED)
            z_max = tl.where(valid, z, _NO_MAX)
            m_new = tl.maximum(m_lane, tl.max(z_max, axis=1))
            # a lane with no valid column yet keeps m_new = _NO_MAX, whose product with log2e would overflow
            m_scaled = tl.where(m_new > _NO_MAX, m_new, 0.0) * LOG2E
            e = tl.exp2(tl.where(valid, z * LOG2E - m_scaled[:, None], float("-inf")))
        if SUM_Z:
            zsum_lane += tl.sum(z, axis=1)
        alpha = tl.exp(m_lane - m_new)  # 0 on a lane's first valid block, 1 while its max holds
        s_lane = s_lane * alpha + tl.sum(e, axis=1)
        if ENTROPY:
            t_lane = t_lane * alpha + tl.sum(e * z, axis=1)
        if ARGMAX:
            first = start + tl.arange(0, LANES) * _VEC + tl.argmax(z_max, axis=1, tie_break_left=True)
            arg_lane = tl.where(m_new > m_lane, first, arg_lane)
        if SUM_SQ:  # Σ exp(2(z − m)) = Σ (exp(z − m))²
            s2_lane = s2_lane * (alpha * alpha) + tl.sum(e * e, axis=1)
        m_lane = m_new
    return m_lane, s_lane, t_lane, zsum_lane, arg_lane, s2_lane


@triton.jit
def _label_logit(z_row, label, col_offset, Bias, logit_scale, softcap, inv_temperature,
                 HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, SCALED: tl.constexpr):
    """The transformed logit of column ``label`` (one scalar load instead of a compare per logit)."""
    raw_y = tl.load(z_row + (label - col_offset)).to(tl.float32)
    if HAS_BIAS:
        raw_y += tl.load(Bias + label).to(tl.float32)
    z_y, _ = apply_transform(raw_y, logit_scale, softcap, inv_temperature, SOFTCAP, SCALED)
    return z_y


@triton.jit
def logit_grad(z, th, is_label, lse, ent, g_lp, g_ent, logit_scale, inv_temperature, SOFTCAP: tl.constexpr,
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
        dz, p = logit_grad(z, th, (cols + col_offset) == label, lse, ent, g_lp, g_ent, logit_scale,
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
