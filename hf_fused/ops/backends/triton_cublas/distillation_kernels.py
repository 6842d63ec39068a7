"""The distillation tile epilogue in Triton: per token row, from both models' raw fp32 logits rows (cuBLAS's
fp32-output products), the divergence, the student's entropy and the student's raw-logits gradient ``dz``.

The math is :mod:`hf_fused.ops.distillation_math`'s (TRL 1.16's conventions); each kernel applies each model's
logit transform on the fly (bias, scale, soft-cap, ``1/T``: :func:`~.triton_kernels.apply_transform`) and never
writes a transformed logit. With ``s = z_s − lse_s``, ``t = z_t − lse_t``, ``p = exp``:

- :func:`stats_kernel` (every β, one read of both tiles): per row and column chunk, online (rescaled) sums under
  the chunk's running maxima ``m_s``, ``m_t``: ``Σ e^{z_s − m_s}``, ``Σ e^{z_s − m_s} z_s``, ``Σ e^{z_t − m_t}`` and,
  for the KLs, ``Σ e^{z_t − m_t}(z_t − z_s)`` (forward) or ``Σ e^{z_s − m_s}(z_s − z_t)`` (reverse). A row's chunks
  combine (:func:`_row_stats`, rescaled to the row's maxima) into ``lse_s``, ``lse_t``, the entropy
  ``H = lse_s − Σ p_s z_s`` and, for the KLs, the divergence itself:
  forward KL ``Σ p_t (t − s) = Σ e^{z_t − m_t}(z_t − z_s) / Σ e^{z_t − m_t} − lse_t + lse_s``,
  reverse KL ``Σ p_s (s − t) = Σ e^{z_s − m_s}(z_s − z_t) / Σ e^{z_s − m_s} − lse_s + lse_t``;
- :func:`jsd_sums_kernel` (the JSD only: ``log m`` needs both log-sum-exps first): per row and column chunk
  ``Σ p_s (s − log m)`` and ``Σ p_t (t − log m)`` in base 2, with ``m = (1 − β)·p_s + β·p_t`` formed from the two
  exponentials the sums weigh by anyway (three transcendentals per column, each one hardware instruction in GPU
  code: ``2^x`` twice and the ``log2`` of :func:`_log2`);
  ``KL(p_s ‖ m)`` and ``D = β·KL(p_t ‖ m) + (1 − β)·KL(p_s ‖ m)`` are their row sums times ``ln 2``;
- :func:`grad_kernel` (with gradients): ``dz = g · ∂D/∂z_s`` through the transform's chain rule (``× 1/T``,
  ``× (1 − tanh²)``, ``× scale``), written in ``DZ``'s dtype (bf16 for the gradient matmuls, or fp32), where
  ``∂D/∂z_s`` is ``p_s − p_t`` (forward KL), ``p_s ∘ (s − t − D)`` (reverse KL) or
  ``(1 − β)·p_s ∘ (s − log m − KL(p_s ‖ m))`` (JSD);
- :func:`finish_kernel`: each row's divergence and entropy from its chunks' sums.

So a KL costs two reads of the two fp32 tiles and one write of ``dz``; the JSD three reads (``log m`` needs both
normalizers, and the gradient needs ``KL(p_s ‖ m)``, a sum over the whole row: no pass can start before the one
before it has seen every column). The kernels run on (row, column chunk) grids: a row's chunks are independent
programs, their per-row sums meet in small fp32 ``[rows, chunks, fields]`` buffers that the next kernel reads.
``MODE``: 0 forward KL, 1 reverse KL, 2 JSD. Runs on CPU tensors under ``TRITON_INTERPRET=1`` (the CPU tests).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .matmul import round_bf16
from .triton_kernels import LOG2E, apply_transform

# Below every finite fp32 value (finite, so a lane's rescale exp(m_old − m_new) is never exp(−inf + inf)).
_NO_MAX = tl.constexpr(-3.4028234663852886e38)
_LN2 = tl.constexpr(0.6931471805599453)
# The smallest normal fp32: a floor for the mixture m, whose two exponentials may both underflow far in a row's
# tail (log2(0) would give 0·inf where the weights are 0; a subnormal m may be flushed by a fast logarithm).
_TINY = tl.constexpr(1.1754943508222875e-38)
# fp32 columns of one lane of the statistics kernel: one 16-byte load per thread and tile.
_VEC = tl.constexpr(4)

FORWARD_KL, REVERSE_KL, JSD = 0, 1, 2
#: fp32 fields per row and column chunk: the statistics kernel's (m_s, Σe^{z_s−m_s}, Σe^{z_s−m_s}z_s, m_t,
#: Σe^{z_t−m_t}, the KL's sum) and the JSD sums kernel's (Σ p_s(s − log m), Σ p_t(t − log m), base 2).
STATS_FIELDS, SUMS_FIELDS = 6, 2
_STATS_FIELDS, _SUMS_FIELDS = tl.constexpr(STATS_FIELDS), tl.constexpr(SUMS_FIELDS)


@triton.jit
def _pair(S_row, T_row, cols, valid, BiasS, BiasT, s_scale, s_cap, s_inv_t, t_scale, t_cap, t_inv_t,
          MASKED: tl.constexpr, HAS_BIAS_S: tl.constexpr, SOFTCAP_S: tl.constexpr, SCALED_S: tl.constexpr,
          HAS_BIAS_T: tl.constexpr, SOFTCAP_T: tl.constexpr, SCALED_T: tl.constexpr):
    """``(z_s, tanh_s, z_t)``: both models' transformed logits at ``cols`` (masked columns load as raw 0, which
    every transform maps to 0), and the student's soft-cap tanh for the chain rule."""
    if MASKED:
        raw_s = tl.load(S_row + cols, mask=valid, other=0.0)
        raw_t = tl.load(T_row + cols, mask=valid, other=0.0)
        if HAS_BIAS_S:
            raw_s += tl.load(BiasS + cols, mask=valid, other=0.0)
        if HAS_BIAS_T:
            raw_t += tl.load(BiasT + cols, mask=valid, other=0.0)
    else:
        raw_s = tl.load(S_row + cols)
        raw_t = tl.load(T_row + cols)
        if HAS_BIAS_S:
            raw_s += tl.load(BiasS + cols)
        if HAS_BIAS_T:
            raw_t += tl.load(BiasT + cols)
    zs, th = apply_transform(raw_s.to(tl.float32), s_scale, s_cap, s_inv_t, SOFTCAP_S, SCALED_S)
    zt, _ = apply_transform(raw_t.to(tl.float32), t_scale, t_cap, t_inv_t, SOFTCAP_T, SCALED_T)
    return zs, th, zt


@triton.jit
def _chunk_field(P_row, n_chunks, FIELD: tl.constexpr, FIELDS: tl.constexpr, CHUNKS: tl.constexpr, other):
    """One field of a row's ``n_chunks`` chunk records (``CHUNKS``: a power of two ≥ ``n_chunks``; the rest
    read as ``other``)."""
    i = tl.arange(0, CHUNKS)
    return tl.load(P_row + i * FIELDS + FIELD, mask=i < n_chunks, other=other)


@triton.jit
def _row_stats(P_row, n_chunks, MODE: tl.constexpr, CHUNKS: tl.constexpr):
    """``(lse_s, lse_t, entropy, KL)`` of a row from its statistics chunks (module docstring; ``KL`` is 0 for the
    JSD). Each chunk's sums are rescaled to the row's maxima, as a chunk rescales its lanes'."""
    ms = _chunk_field(P_row, n_chunks, 0, _STATS_FIELDS, CHUNKS, _NO_MAX)
    mt = _chunk_field(P_row, n_chunks, 3, _STATS_FIELDS, CHUNKS, _NO_MAX)
    m_s = tl.max(ms, axis=0)
    m_t = tl.max(mt, axis=0)
    ws = tl.exp(ms - m_s)  # 0 past n_chunks
    wt = tl.exp(mt - m_t)
    sum_s = tl.sum(_chunk_field(P_row, n_chunks, 1, _STATS_FIELDS, CHUNKS, 0.0) * ws, axis=0)
    sum_t = tl.sum(_chunk_field(P_row, n_chunks, 4, _STATS_FIELDS, CHUNKS, 0.0) * wt, axis=0)
    lse_s = m_s + tl.log(sum_s)
    lse_t = m_t + tl.log(sum_t)
    entropy = lse_s - tl.sum(_chunk_field(P_row, n_chunks, 2, _STATS_FIELDS, CHUNKS, 0.0) * ws, axis=0) / sum_s
    acc = _chunk_field(P_row, n_chunks, 5, _STATS_FIELDS, CHUNKS, 0.0)
    if MODE == 0:
        kl = tl.sum(acc * wt, axis=0) / sum_t - lse_t + lse_s
    elif MODE == 1:
        kl = tl.sum(acc * ws, axis=0) / sum_s - lse_s + lse_t
    else:
        kl = lse_s * 0.0
    return lse_s, lse_t, entropy, kl


@triton.jit
def stats_kernel(
    S, stride_s, T, stride_t, n_cols, chunk_cols, BiasS, BiasT, PART, stride_part,
    s_scale, s_cap, s_inv_t, t_scale, t_cap, t_inv_t,
    HAS_BIAS_S: tl.constexpr, SOFTCAP_S: tl.constexpr, SCALED_S: tl.constexpr,
    HAS_BIAS_T: tl.constexpr, SOFTCAP_T: tl.constexpr, SCALED_T: tl.constexpr,
    MODE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Per (row, column chunk of ``chunk_cols``, a multiple of ``BLOCK_V``): the chunk's ``STATS_FIELDS`` record
    in ``PART[row, chunk]`` (module docstring). Each lane (``_VEC`` adjacent columns of each block, one vector
    load) keeps its own running maxima; its sums are rescaled once per block, so a logit costs one exponential
    per model (as :func:`~.triton_kernels.stats_kernel`). Full blocks are read without masks."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    S_row, T_row = S + row * stride_s, T + row * stride_t
    LANES: tl.constexpr = BLOCK_V // _VEC
    ms = tl.full([LANES], _NO_MAX, tl.float32)
    mt = tl.full([LANES], _NO_MAX, tl.float32)
    ss = tl.zeros([LANES], tl.float32)  # Σ e^{z_s − m_s}
    st = tl.zeros([LANES], tl.float32)  # Σ e^{z_t − m_t}
    es = tl.zeros([LANES], tl.float32)  # Σ e^{z_s − m_s} z_s
    # forward KL: Σ e^{z_t − m_t}(z_t − z_s); reverse KL: Σ e^{z_s − m_s}(z_s − z_t)
    acc = tl.zeros([LANES], tl.float32)
    lane_cols = tl.arange(0, LANES)[:, None] * _VEC + tl.arange(0, _VEC)[None, :]
    first = chunk * chunk_cols
    for start in range(first, tl.minimum(first + chunk_cols, n_cols), BLOCK_V):
        cols = start + lane_cols
        if start + BLOCK_V <= n_cols:
            zs, _, zt = _pair(S_row, T_row, cols, cols < n_cols, BiasS, BiasT, s_scale, s_cap, s_inv_t, t_scale,
                              t_cap, t_inv_t, False, HAS_BIAS_S, SOFTCAP_S, SCALED_S, HAS_BIAS_T, SOFTCAP_T, SCALED_T)
            ms_new = tl.maximum(ms, tl.max(zs, axis=1))
            mt_new = tl.maximum(mt, tl.max(zt, axis=1))
            es_b = tl.exp2(zs * LOG2E - (ms_new * LOG2E)[:, None])
            et_b = tl.exp2(zt * LOG2E - (mt_new * LOG2E)[:, None])
        else:
            valid = cols < n_cols
            zs, _, zt = _pair(S_row, T_row, cols, valid, BiasS, BiasT, s_scale, s_cap, s_inv_t, t_scale, t_cap,
                              t_inv_t, True, HAS_BIAS_S, SOFTCAP_S, SCALED_S, HAS_BIAS_T, SOFTCAP_T, SCALED_T)
            ms_new = tl.maximum(ms, tl.max(tl.where(valid, zs, _NO_MAX), axis=1))
            mt_new = tl.maximum(mt, tl.max(tl.where(valid, zt, _NO_MAX), axis=1))
            # a lane with no valid column yet keeps _NO_MAX, whose product with log2e would overflow
            ms_l2 = tl.where(ms_new > _NO_MAX, ms_new, 0.0) * LOG2E
            mt_l2 = tl.where(mt_new > _NO_MAX, mt_new, 0.0) * LOG2E
            es_b = tl.exp2(tl.where(valid, zs * LOG2E - ms_l2[:, None], float("-inf")))
            et_b = tl.exp2(tl.where(valid, zt * LOG2E - mt_l2[:, None], float("-inf")))
        alpha_s = tl.exp(ms - ms_new)  # 0 on a lane's first valid block, 1 while its max holds
        alpha_t = tl.exp(mt - mt_new)
        ss = ss * alpha_s + tl.sum(es_b, axis=1)
        st = st * alpha_t + tl.sum(et_b, axis=1)
        es = es * alpha_s + tl.sum(es_b * zs, axis=1)
        if MODE == 0:
            acc = acc * alpha_t + tl.sum(et_b * (zt - zs), axis=1)
        elif MODE == 1:
            acc = acc * alpha_s + tl.sum(es_b * (zs - zt), axis=1)
        ms, mt = ms_new, mt_new
    m_s = tl.max(ms, axis=0)
    m_t = tl.max(mt, axis=0)
    ws = tl.exp(ms - m_s)
    wt = tl.exp(mt - m_t)
    P = PART + row * stride_part + chunk * _STATS_FIELDS
    tl.store(P, m_s)
    tl.store(P + 1, tl.sum(ss * ws, axis=0))
    tl.store(P + 2, tl.sum(es * ws, axis=0))
    tl.store(P + 3, m_t)
    tl.store(P + 4, tl.sum(st * wt, axis=0))
    if MODE == 0:
        tl.store(P + 5, tl.sum(acc * wt, axis=0))
    elif MODE == 1:
        tl.store(P + 5, tl.sum(acc * ws, axis=0))
    else:
        tl.store(P + 5, 0.0)


@triton.jit
def _log2(x, COMPILED: tl.constexpr):
    """``log2 x`` of positive normal fp32 values. ``COMPILED`` (GPU code): the exponent read from the bit pattern
    plus the hardware's approximate ``log2`` (one MUFU instruction) of the mantissa in ``[1, 2)``, where its absolute
    error is below 2⁻²² (CUDA's ``__log2f``), where libdevice's ``log2f`` takes some twenty instructions; else
    ``tl.log2`` (the interpreter's numpy)."""
    if COMPILED:
        bits = x.to(tl.int32, bitcast=True)
        mantissa = ((bits & 0x007FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
        # the biased exponent E in the low bits of 2^23's pattern is the float 2^23 + E, exactly
        exponent = ((bits >> 23) | 0x4B000000).to(tl.float32, bitcast=True) - 8388735.0  # 2^23 + 127
        return exponent + tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=f,f", [mantissa],
                                                    dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.log2(x)


@triton.jit
def _mixture(zs, zt, lse_s, lse_t, one_m_beta, beta, COMPILED: tl.constexpr):
    """``(p_s, p_t, log2 p_s − log2 m, log2 p_t − log2 m)`` with ``m = (1 − β)·p_s + β·p_t``: each log-probability
    is formed in nats (``z − lse``, exact where it matters: near 0, where the weights are large) before its change
    of base."""
    s2 = (zs - lse_s) * LOG2E
    t2 = (zt - lse_t) * LOG2E
    ps = tl.exp2(s2)
    pt = tl.exp2(t2)
    log2_m = _log2(tl.maximum(one_m_beta * ps + beta * pt, _TINY), COMPILED)
    return ps, pt, s2 - log2_m, t2 - log2_m


@triton.jit
def jsd_sums_kernel(
    S, stride_s, T, stride_t, n_cols, chunk_cols, BiasS, BiasT, PART, stride_part, n_stats, SUMS, stride_sums,
    s_scale, s_cap, s_inv_t, t_scale, t_cap, t_inv_t, beta, one_m_beta,
    HAS_BIAS_S: tl.constexpr, SOFTCAP_S: tl.constexpr, SCALED_S: tl.constexpr,
    HAS_BIAS_T: tl.constexpr, SOFTCAP_T: tl.constexpr, SCALED_T: tl.constexpr,
    COMPILED: tl.constexpr, STATS_CHUNKS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Per (row, column chunk): ``SUMS[row, chunk] = (Σ p_s (s − log m), Σ p_t (t − log m))`` in base 2 over the
    chunk, from the row's log-sum-exps (its ``n_stats`` statistics chunks in ``PART``)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    S_row, T_row = S + row * stride_s, T + row * stride_t
    lse_s, lse_t, _entropy, _kl = _row_stats(PART + row * stride_part, n_stats, 2, STATS_CHUNKS)
    kl_s = tl.zeros([BLOCK_V], tl.float32)
    kl_t = tl.zeros([BLOCK_V], tl.float32)
    first = chunk * chunk_cols
    for start in range(first, tl.minimum(first + chunk_cols, n_cols), BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        if start + BLOCK_V <= n_cols:  # full blocks without masks
            zs, _, zt = _pair(S_row, T_row, cols, cols < n_cols, BiasS, BiasT, s_scale, s_cap, s_inv_t, t_scale,
                              t_cap, t_inv_t, False, HAS_BIAS_S, SOFTCAP_S, SCALED_S, HAS_BIAS_T, SOFTCAP_T, SCALED_T)
            ps, pt, ds, dt = _mixture(zs, zt, lse_s, lse_t, one_m_beta, beta, COMPILED)
            kl_s += ps * ds
            kl_t += pt * dt
        else:
            valid = cols < n_cols
            zs, _, zt = _pair(S_row, T_row, cols, valid, BiasS, BiasT, s_scale, s_cap, s_inv_t, t_scale, t_cap,
                              t_inv_t, True, HAS_BIAS_S, SOFTCAP_S, SCALED_S, HAS_BIAS_T, SOFTCAP_T, SCALED_T)
            ps, pt, ds, dt = _mixture(zs, zt, lse_s, lse_t, one_m_beta, beta, COMPILED)
            kl_s += tl.where(valid, ps * ds, 0.0)
            kl_t += tl.where(valid, pt * dt, 0.0)
    P = SUMS + row * stride_sums + chunk * _SUMS_FIELDS
    tl.store(P, tl.sum(kl_s, axis=0))
    tl.store(P + 1, tl.sum(kl_t, axis=0))


@triton.jit
def grad_kernel(
    S, stride_s, T, stride_t, DZ, stride_dz, n_cols, chunk_cols, BiasS, BiasT, PART, stride_part, n_stats,
    SUMS, stride_sums, n_sums, G, stride_g,
    s_scale, s_cap, s_inv_t, t_scale, t_cap, t_inv_t, beta, one_m_beta,
    HAS_BIAS_S: tl.constexpr, SOFTCAP_S: tl.constexpr, SCALED_S: tl.constexpr,
    HAS_BIAS_T: tl.constexpr, SOFTCAP_T: tl.constexpr, SCALED_T: tl.constexpr,
    MODE: tl.constexpr, DZ_BF16: tl.constexpr, COMPILED: tl.constexpr, STATS_CHUNKS: tl.constexpr,
    SUMS_CHUNKS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Per (row, column chunk): ``DZ = G[row] · ∂D/∂raw_s`` (module docstring) in ``DZ``'s dtype, from the row's
    statistics chunks (``PART``) and, for the JSD, its sums chunks (``SUMS``: ``KL(p_s ‖ m)``). ``DZ_BF16``: bf16,
    rounded to nearest even (``COMPILED``, GPU code: the hardware's conversion; else :func:`~.matmul.round_bf16` on
    the bit pattern, as ``torch``'s cast rounds: the interpreter's cast truncates). ``G``:
    per-row upstream gradients (``stride_g`` 0 for one value for every row). ``DZ`` may be ``S`` itself (same
    dtype and strides): each element is read before it is written, by the same thread."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    S_row, T_row, DZ_row = S + row * stride_s, T + row * stride_t, DZ + row * stride_dz
    lse_s, lse_t, _entropy, kl = _row_stats(PART + row * stride_part, n_stats, MODE, STATS_CHUNKS)
    g = tl.load(G + row * stride_g)  # times the transform's constant factors, once per row
    if MODE == 2:  # KL(p_s ‖ m) in base 2; (1 − β)·ln 2 (the sums' base) into g
        kl = tl.sum(_chunk_field(SUMS + row * stride_sums, n_sums, 0, _SUMS_FIELDS, SUMS_CHUNKS, 0.0), axis=0)
        g = g * (one_m_beta * _LN2)
    if SCALED_S:
        g = g * s_inv_t * s_scale
    first = chunk * chunk_cols
    for start in range(first, tl.minimum(first + chunk_cols, n_cols), BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        if start + BLOCK_V <= n_cols:  # full blocks without masks
            zs, th, zt = _pair(S_row, T_row, cols, cols < n_cols, BiasS, BiasT, s_scale, s_cap, s_inv_t, t_scale,
                               t_cap, t_inv_t, False, HAS_BIAS_S, SOFTCAP_S, SCALED_S, HAS_BIAS_T, SOFTCAP_T,
                               SCALED_T)
            dz = _student_grad(zs, th, zt, lse_s, lse_t, kl, g, beta, one_m_beta, SOFTCAP_S, MODE, COMPILED)
            _store(DZ_row + cols, dz, cols < n_cols, False, DZ_BF16, COMPILED)
        else:
            valid = cols < n_cols
            zs, th, zt = _pair(S_row, T_row, cols, valid, BiasS, BiasT, s_scale, s_cap, s_inv_t, t_scale, t_cap,
                               t_inv_t, True, HAS_BIAS_S, SOFTCAP_S, SCALED_S, HAS_BIAS_T, SOFTCAP_T, SCALED_T)
            dz = _student_grad(zs, th, zt, lse_s, lse_t, kl, g, beta, one_m_beta, SOFTCAP_S, MODE, COMPILED)
            _store(DZ_row + cols, dz, valid, True, DZ_BF16, COMPILED)


@triton.jit
def _student_grad(zs, th, zt, lse_s, lse_t, kl, g, beta, one_m_beta, SOFTCAP_S: tl.constexpr, MODE: tl.constexpr,
                  COMPILED: tl.constexpr):
    """``g · ∂D/∂z_s`` times the soft-cap's ``1 − tanh²`` (``g`` carries the rest of the chain rule)."""
    if MODE == 0:  # p_s − p_t
        dz = tl.exp(zs - lse_s) - tl.exp(zt - lse_t)
    elif MODE == 1:  # p_s ∘ (s − t − KL(p_s ‖ p_t))
        s = zs - lse_s
        dz = tl.exp(s) * (s - (zt - lse_t) - kl)
    else:  # (1 − β)·p_s ∘ (s − log m − KL(p_s ‖ m)), in base 2; (1 − β)·ln 2 is in g
        ps, _pt, ds, _dt = _mixture(zs, zt, lse_s, lse_t, one_m_beta, beta, COMPILED)
        dz = ps * (ds - kl)
    dz = dz * g
    if SOFTCAP_S:
        dz = dz * (1.0 - th * th)
    return dz


@triton.jit
def _store(ptr, dz, valid, MASKED: tl.constexpr, DZ_BF16: tl.constexpr, COMPILED: tl.constexpr):
    """Store ``dz`` in ``ptr``'s dtype (bf16: rounded to nearest even)."""
    if DZ_BF16:
        if COMPILED:
            value = dz.to(tl.bfloat16)  # cvt.rn: round to nearest even
        else:
            value, _ = round_bf16(dz)
    else:
        value = dz.to(ptr.dtype.element_ty)
    if MASKED:
        tl.store(ptr, value, mask=valid)
    else:
        tl.store(ptr, value)


@triton.jit
def finish_kernel(PART, stride_part, n_stats, SUMS, stride_sums, n_sums, DIV, ENT, beta, one_m_beta,
                  MODE: tl.constexpr, STATS_CHUNKS: tl.constexpr, SUMS_CHUNKS: tl.constexpr):
    """Per row: ``DIV`` (the divergence) and ``ENT`` (the student's entropy) from its chunks' records."""
    row = tl.program_id(0).to(tl.int64)
    _lse_s, _lse_t, entropy, div = _row_stats(PART + row * stride_part, n_stats, MODE, STATS_CHUNKS)
    if MODE == 2:
        P_row = SUMS + row * stride_sums
        kl_s = tl.sum(_chunk_field(P_row, n_sums, 0, _SUMS_FIELDS, SUMS_CHUNKS, 0.0), axis=0)
        kl_t = tl.sum(_chunk_field(P_row, n_sums, 1, _SUMS_FIELDS, SUMS_CHUNKS, 0.0), axis=0)
        div = (beta * kl_t + one_m_beta * kl_s) * _LN2
    tl.store(DIV + row, div)
    tl.store(ENT + row, entropy)
