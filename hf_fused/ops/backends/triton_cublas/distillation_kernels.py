"""The distillation tile epilogue in Triton: per token row, from both models' raw fp32 logits rows (cuBLAS's
fp32-output products), the divergence, the student's entropy and the student's raw-logits gradient ``dz``.

The math is :mod:`hf_fused.ops.distillation_math`'s (TRL 1.16's conventions); each kernel applies each model's
logit transform on the fly (bias, scale, soft-cap, ``1/T``: :func:`~.triton_kernels.apply_transform`) and never
writes a transformed logit. With ``s = z_s − lse_s``, ``t = z_t − lse_t``, ``p = exp``:

- :func:`stats_kernel` (every β, one read of both tiles): online (rescaled) per-row ``lse_s``, ``lse_t``, the
  entropy ``H = lse_s − Σ p_s z_s`` and, for the KLs, the divergence itself:
  forward KL ``Σ p_t (t − s) = Σ e^{z_t − m_t}(z_t − z_s) / Σ e^{z_t − m_t} − lse_t + lse_s``,
  reverse KL ``Σ p_s (s − t) = Σ e^{z_s − m_s}(z_s − z_t) / Σ e^{z_s − m_s} − lse_s + lse_t``;
- :func:`jsd_sums_kernel` (the JSD only: ``log m`` needs both log-sum-exps first): ``KL(p_t ‖ m)``, ``KL(p_s ‖ m)``
  and ``D = β·KL(p_t ‖ m) + (1 − β)·KL(p_s ‖ m)``, with ``log m = logaddexp(s + log(1 − β), t + log β)``;
- :func:`grad_kernel` (with gradients): ``dz = g · ∂D/∂z_s`` through the transform's chain rule (``× 1/T``,
  ``× (1 − tanh²)``, ``× scale``), written in ``DZ``'s dtype (bf16 for the gradient matmuls, or fp32), where
  ``∂D/∂z_s`` is ``p_s − p_t`` (forward KL), ``p_s ∘ (s − t − D)`` (reverse KL) or
  ``(1 − β)·p_s ∘ (s − log m − KL(p_s ‖ m))`` (JSD).

So a KL costs two reads of the two fp32 tiles and one write of ``dz``; the JSD three reads. One program per row,
streaming it in column blocks. ``MODE``: 0 forward KL, 1 reverse KL, 2 JSD. Runs on CPU tensors under
``TRITON_INTERPRET=1`` (the CPU tests).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .matmul import round_bf16
from .triton_kernels import apply_transform

# Below every finite fp32 value (finite, so a lane's rescale exp(m_old − m_new) is never exp(−inf + inf)).
_NO_MAX = tl.constexpr(-3.4028234663852886e38)
_LOG2E = tl.constexpr(1.4426950408889634)
# fp32 columns of one lane of the statistics kernel: one 16-byte load per thread and tile.
_VEC = tl.constexpr(4)

FORWARD_KL, REVERSE_KL, JSD = 0, 1, 2


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
def stats_kernel(
    S, stride_s, T, stride_t, n_cols, BiasS, BiasT, LSE_S, LSE_T, DIV, ENT,
    s_scale, s_cap, s_inv_t, t_scale, t_cap, t_inv_t,
    HAS_BIAS_S: tl.constexpr, SOFTCAP_S: tl.constexpr, SCALED_S: tl.constexpr,
    HAS_BIAS_T: tl.constexpr, SOFTCAP_T: tl.constexpr, SCALED_T: tl.constexpr,
    MODE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Per row (one program each): ``LSE_S``, ``LSE_T``, the student's entropy ``ENT`` and, for ``MODE`` 0 or 1,
    the divergence ``DIV`` (module docstring). Each lane (``_VEC`` adjacent columns of each block, one vector load)
    keeps its own running maxima; its sums are rescaled once per block, so a logit costs one exponential per model
    (as :func:`~.triton_kernels.stats_kernel`). Full blocks are read without masks."""
    row = tl.program_id(0).to(tl.int64)
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
    n_full = n_cols // BLOCK_V * BLOCK_V
    for start in range(0, n_cols, BLOCK_V):
        cols = start + lane_cols
        if start < n_full:
            zs, _, zt = _pair(S_row, T_row, cols, cols < n_cols, BiasS, BiasT, s_scale, s_cap, s_inv_t, t_scale,
                              t_cap, t_inv_t, False, HAS_BIAS_S, SOFTCAP_S, SCALED_S, HAS_BIAS_T, SOFTCAP_T, SCALED_T)
            ms_new = tl.maximum(ms, tl.max(zs, axis=1))
            mt_new = tl.maximum(mt, tl.max(zt, axis=1))
            es_b = tl.exp2(zs * _LOG2E - (ms_new * _LOG2E)[:, None])
            et_b = tl.exp2(zt * _LOG2E - (mt_new * _LOG2E)[:, None])
        else:
            valid = cols < n_cols
            zs, _, zt = _pair(S_row, T_row, cols, valid, BiasS, BiasT, s_scale, s_cap, s_inv_t, t_scale, t_cap,
                              t_inv_t, True, HAS_BIAS_S, SOFTCAP_S, SCALED_S, HAS_BIAS_T, SOFTCAP_T, SCALED_T)
            ms_new = tl.maximum(ms, tl.max(tl.where(valid, zs, _NO_MAX), axis=1))
            mt_new = tl.maximum(mt, tl.max(tl.where(valid, zt, _NO_MAX), axis=1))
            # a lane with no valid column yet keeps _NO_MAX, whose product with log2e would overflow
            ms_l2 = tl.where(ms_new > _NO_MAX, ms_new, 0.0) * _LOG2E
            mt_l2 = tl.where(mt_new > _NO_MAX, mt_new, 0.0) * _LOG2E
            es_b = tl.exp2(tl.where(valid, zs * _LOG2E - ms_l2[:, None], float("-inf")))
            et_b = tl.exp2(tl.where(valid, zt * _LOG2E - mt_l2[:, None], float("-inf")))
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
    sum_s = tl.sum(ss * ws, axis=0)
    sum_t = tl.sum(st * wt, axis=0)
    lse_s = m_s + tl.log(sum_s)
    lse_t = m_t + tl.log(sum_t)
    tl.store(LSE_S + row, lse_s)
    tl.store(LSE_T + row, lse_t)
    tl.store(ENT + row, lse_s - tl.sum(es * ws, axis=0) / sum_s)
    if MODE == 0:
        tl.store(DIV + row, tl.sum(acc * wt, axis=0) / sum_t - lse_t + lse_s)
    elif MODE == 1:
        tl.store(DIV + row, tl.sum(acc * ws, axis=0) / sum_s - lse_s + lse_t)


@triton.jit
def _log_mixture(s, t, log_1m_beta, log_beta):
    """``log m = log((1 − β)·e^s + β·e^t)`` as a logaddexp (one exponential and one logarithm)."""
    a = s + log_1m_beta
    b = t + log_beta
    hi = tl.maximum(a, b)
    return hi + tl.log(1.0 + tl.exp(-tl.abs(a - b)))


@triton.jit
def jsd_sums_kernel(
    S, stride_s, T, stride_t, n_cols, BiasS, BiasT, LSE_S, LSE_T, DIV, KL_S,
    s_scale, s_cap, s_inv_t, t_scale, t_cap, t_inv_t, beta, log_1m_beta, log_beta,
    HAS_BIAS_S: tl.constexpr, SOFTCAP_S: tl.constexpr, SCALED_S: tl.constexpr,
    HAS_BIAS_T: tl.constexpr, SOFTCAP_T: tl.constexpr, SCALED_T: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Per row: ``KL_S = KL(p_s ‖ m)`` and ``DIV = β·KL(p_t ‖ m) + (1 − β)·KL(p_s ‖ m)`` from the rows'
    log-sum-exps (:func:`stats_kernel`)."""
    row = tl.program_id(0).to(tl.int64)
    S_row, T_row = S + row * stride_s, T + row * stride_t
    lse_s = tl.load(LSE_S + row)
    lse_t = tl.load(LSE_T + row)
    kl_t = tl.zeros([BLOCK_V], tl.float32)
    kl_s = tl.zeros([BLOCK_V], tl.float32)
    n_full = n_cols // BLOCK_V * BLOCK_V
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        valid = cols < n_cols
        if start < n_full:  # full blocks without masks
            zs, _, zt = _pair(S_row, T_row, cols, valid, BiasS, BiasT, s_scale, s_cap, s_inv_t, t_scale, t_cap,
                              t_inv_t, False, HAS_BIAS_S, SOFTCAP_S, SCALED_S, HAS_BIAS_T, SOFTCAP_T, SCALED_T)
            s = zs - lse_s
            t = zt - lse_t
            log_m = _log_mixture(s, t, log_1m_beta, log_beta)
            kl_t += tl.exp(t) * (t - log_m)
            kl_s += tl.exp(s) * (s - log_m)
        else:
            zs, _, zt = _pair(S_row, T_row, cols, valid, BiasS, BiasT, s_scale, s_cap, s_inv_t, t_scale, t_cap,
                              t_inv_t, True, HAS_BIAS_S, SOFTCAP_S, SCALED_S, HAS_BIAS_T, SOFTCAP_T, SCALED_T)
            s = zs - lse_s
            t = zt - lse_t
            log_m = _log_mixture(s, t, log_1m_beta, log_beta)
            kl_t += tl.where(valid, tl.exp(t) * (t - log_m), 0.0)
            kl_s += tl.where(valid, tl.exp(s) * (s - log_m), 0.0)
    kl_student = tl.sum(kl_s, axis=0)
    tl.store(KL_S + row, kl_student)
    tl.store(DIV + row, beta * tl.sum(kl_t, axis=0) + (1.0 - beta) * kl_student)


@triton.jit
def grad_kernel(
    S, stride_s, T, stride_t, DZ, stride_dz, n_cols, BiasS, BiasT, LSE_S, LSE_T, KL, G, stride_g,
    s_scale, s_cap, s_inv_t, t_scale, t_cap, t_inv_t, beta, log_1m_beta, log_beta,
    HAS_BIAS_S: tl.constexpr, SOFTCAP_S: tl.constexpr, SCALED_S: tl.constexpr,
    HAS_BIAS_T: tl.constexpr, SOFTCAP_T: tl.constexpr, SCALED_T: tl.constexpr,
    MODE: tl.constexpr, DZ_BF16: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Per row: ``DZ = G[row] · ∂D/∂raw_s`` (module docstring) in ``DZ``'s dtype (``DZ_BF16``: bf16, rounded to
    nearest even by :func:`~.matmul.round_bf16`, as ``torch``'s cast rounds, in the interpreter too). ``KL``: the
    reverse KL (``MODE`` 1) or ``KL(p_s ‖ m)`` (``MODE`` 2), unread for ``MODE`` 0; ``G``: per-row upstream
    gradients (``stride_g`` 0 for one value for every row). ``DZ`` may be ``S`` itself (same dtype and strides): each
    element is read before it is written, by the same thread."""
    row = tl.program_id(0).to(tl.int64)
    S_row, T_row, DZ_row = S + row * stride_s, T + row * stride_t, DZ + row * stride_dz
    lse_s = tl.load(LSE_S + row)
    lse_t = tl.load(LSE_T + row)
    kl = tl.load(KL + row)
    g = tl.load(G + row * stride_g)  # times the transform's constant factors, once per row
    if MODE == 2:
        g = g * (1.0 - beta)
    if SCALED_S:
        g = g * s_inv_t * s_scale
    n_full = n_cols // BLOCK_V * BLOCK_V
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        if start < n_full:  # full blocks without masks
            zs, th, zt = _pair(S_row, T_row, cols, cols < n_cols, BiasS, BiasT, s_scale, s_cap, s_inv_t, t_scale,
                               t_cap, t_inv_t, False, HAS_BIAS_S, SOFTCAP_S, SCALED_S, HAS_BIAS_T, SOFTCAP_T,
                               SCALED_T)
            dz = _student_grad(zs, th, zt, lse_s, lse_t, kl, g, log_1m_beta, log_beta, SOFTCAP_S, MODE)
            _store(DZ_row + cols, dz, cols < n_cols, False, DZ_BF16)
        else:
            valid = cols < n_cols
            zs, th, zt = _pair(S_row, T_row, cols, valid, BiasS, BiasT, s_scale, s_cap, s_inv_t, t_scale, t_cap,
                               t_inv_t, True, HAS_BIAS_S, SOFTCAP_S, SCALED_S, HAS_BIAS_T, SOFTCAP_T, SCALED_T)
            dz = _student_grad(zs, th, zt, lse_s, lse_t, kl, g, log_1m_beta, log_beta, SOFTCAP_S, MODE)
            _store(DZ_row + cols, dz, valid, True, DZ_BF16)


@triton.jit
def _student_grad(zs, th, zt, lse_s, lse_t, kl, g, log_1m_beta, log_beta, SOFTCAP_S: tl.constexpr,
                  MODE: tl.constexpr):
    """``g · ∂D/∂z_s`` times the soft-cap's ``1 − tanh²`` (``g`` carries the rest of the chain rule)."""
    s = zs - lse_s
    t = zt - lse_t
    ps = tl.exp(s)
    if MODE == 0:  # p_s − p_t
        dz = ps - tl.exp(t)
    elif MODE == 1:  # p_s ∘ (s − t − KL(p_s ‖ p_t))
        dz = ps * (s - t - kl)
    else:  # (1 − β)·p_s ∘ (s − log m − KL(p_s ‖ m)); the (1 − β) is in g
        dz = ps * (s - _log_mixture(s, t, log_1m_beta, log_beta) - kl)
    dz = dz * g
    if SOFTCAP_S:
        dz = dz * (1.0 - th * th)
    return dz


@triton.jit
def _store(ptr, dz, valid, MASKED: tl.constexpr, DZ_BF16: tl.constexpr):
    """Store ``dz`` in ``ptr``'s dtype (bf16: rounded to nearest even on the bit pattern)."""
    if DZ_BF16:
        value, _ = round_bf16(dz)
    else:
        value = dz.to(ptr.dtype.element_ty)
    if MASKED:
        tl.store(ptr, value, mask=valid)
    else:
        tl.store(ptr, value)
