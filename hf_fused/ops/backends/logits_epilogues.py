"""The logits matmul with the softmax statistics, or the logits-gradient, in its epilogue (Triton, Hopper).

Why: the two passes of :mod:`.triton_cublas` write every ``[rows, cols]`` logits tile with cuBLAS and read it
back in a Triton kernel: the statistics pass (log-sum-exp, label logit, Σ p·z) only to reduce it, the gradient
pass to overwrite it with ``dz``. At 32768×2048×151936 that is 9 GB written and read again per pass (the
statistics and gradient kernels took 10.9 ms of a 126.6 ms lean step on an H100, beside 51.0 ms of logits
matmuls; docs/gpu_results.md, fifth session). Here one persistent Triton matmul (TMA loads, one program per
multiprocessor, the loop nest flattened as in :func:`.compensated._compensated_addmm_tma_kernel`) hands each
fp32 output tile to an epilogue while it is still in registers:

- :func:`logits_statistics_`: per row and output tile, the (max, Σexp(z − max), Σexp(z − max)·z) of the tile's
  columns into ``[column tiles, rows]`` partials, merged into the running statistics by a second small kernel
  (:func:`_merge_kernel`), and the label logit stored by the one tile that holds the label. Nothing of the
  logits is written, so a pass of statistics needs no tile buffer at all: it runs over the whole vocabulary
  per row block.
- :func:`logits_grad_`: ``dz`` from the log-sum-exp, entropy and per-row upstream gradients, stored in the
  weight's dtype: the tile the gradient matmuls read, without the logits ever written.

Numerics: each fp32 accumulator element is first rounded to the operands' dtype (bf16, to nearest, ties to even,
on the bit pattern as :func:`.compensated._round` does), the value cuBLAS would have stored in the tile, and the
statistics and ``dz`` are computed from that rounded logit with the formulas of :mod:`.triton_kernels`
(``_transform``, ``_row_grad``): what eager transformers computes from its bf16 logits. The fp32 accumulation
order of the matmul differs from cuBLAS's, so a logit can differ from the cuBLAS tile's by one bf16 rounding
step where the exact sum lies near a rounding boundary; the statistics add in another order (per tile, then
across tiles) than the statistics kernel's per-lane running sums, at fp32 rounding level.

Runs on CUDA tensors of compute capability ≥ 9.0, or on CPU tensors under ``TRITON_INTERPRET=1`` (CI, where
the operands may also be fp32: no rounding then). :func:`applies` says whether a call can use it.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import triton
import triton.language as tl

from .compensated import GemmConfig, _multiprocessors, _round, _tile, _tma_operand, _to_fp32, _halves
from .triton_kernels import _NO_MAX, _transform

#: The launch shape of both epilogues: 128×256 output tiles on 8 warps, the epilogue on four 64-column slices
#: (the fp32 accumulator alone is 128 registers per thread).
CONFIG = GemmConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=4, epilogue_split=4, tma=True)
#: Partial statistics per row and output tile: max, Σexp and (for the entropy) Σexp·z, fp32.
PARTIAL_BYTES_PER_TILE_ROW = 12
_MERGE_BLOCK = 256

# What a ``forced`` block set: None (the rule of :func:`applies`), True or False.
_FORCED: dict = {}


@contextlib.contextmanager
def forced(enabled: bool):
    """Within the block :func:`applies` answers ``enabled`` for every call whose operands the kernel can read
    (tests: True runs the kernels under Triton's interpreter on CPU; benchmarks: False times the cuBLAS tiles
    beside them). Process-wide, not per thread."""
    previous = dict(_FORCED)
    _FORCED["enabled"] = bool(enabled)
    try:
        yield
    finally:
        _FORCED.clear()
        _FORCED.update(previous)


def applies(h: torch.Tensor, weight: torch.Tensor, *, config: GemmConfig = CONFIG) -> bool:
    """Whether the fused epilogues can compute ``h @ weight.T``'s tiles: by default on a CUDA device of compute
    capability ≥ 9.0 with bf16 operands (fp32 logits matmuls stay cuBLAS's: Triton's fp32 ``tl.dot`` is TF32 or
    slow), inside a :func:`forced` block as it says where the operands are bf16 or (CPU, interpreter) fp32;
    always with both operands row-major and TMA-aligned (base address and row stride multiples of 16 bytes)."""
    enabled = _FORCED.get("enabled")
    if enabled is False or h.dtype != weight.dtype:
        return False
    if enabled is None:
        if not (weight.is_cuda and weight.dtype == torch.bfloat16):
            return False
        if torch.cuda.get_device_capability(weight.device) < (9, 0):
            return False
    elif weight.dtype not in (torch.bfloat16, torch.float32) or (weight.is_cuda and weight.dtype != torch.bfloat16):
        return False
    return all(t.stride(-1) == 1 and _tma_operand(t) is None for t in (h, weight))


def column_tiles(n_cols: int, config: GemmConfig = CONFIG) -> int:
    """Output tiles across ``n_cols`` columns: the partial statistics' rows per token row."""
    return triton.cdiv(n_cols, config.block_n)


@triton.jit
def _raw(acc, rn, N, col_offset, Bias, ROUND: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The tile's logits as the statistics and gradient kernels read them from a stored tile: rounded to the
    operands' dtype (``ROUND`` 1 or 2: bf16, to nearest, ties to even; 0: fp32 operands), plus the bias in fp32."""
    raw = acc
    if ROUND == 1:  # on the bit pattern: the interpreter's fp32 → bf16 conversion truncates
        _, raw = _round(acc)
    elif ROUND == 2:  # cvt.rn: the same rounding, one instruction per pair on the GPU
        raw = acc.to(tl.bfloat16).to(tl.float32)
    if HAS_BIAS:
        raw += tl.load(Bias + col_offset + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    return raw


@triton.jit
def _stats_slice(acc, rn, N, col_offset, Bias, labels, logit_scale, softcap, inv_temperature,
                 ROUND: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, SCALED: tl.constexpr,
                 ENTROPY: tl.constexpr, LABEL: tl.constexpr):
    """Per row of one column slice: (max, Σexp(z − max), Σexp(z − max)·z, the label's logit or 0)."""
    z, _ = _transform(_raw(acc, rn, N, col_offset, Bias, ROUND, HAS_BIAS), logit_scale, softcap,
                      inv_temperature, SOFTCAP, SCALED)
    n_ok = (rn < N)[None, :]
    z = tl.where(n_ok, z, _NO_MAX)
    m = tl.max(z, axis=1)
    # masked columns add nothing, also in a slice wholly past N (its max is _NO_MAX, so exp(z − m) would be 1)
    e = tl.where(n_ok, tl.exp(z - m[:, None]), 0.0)
    s = tl.sum(e, axis=1)
    t = tl.zeros_like(s)
    if ENTROPY:
        t = tl.sum(tl.where(n_ok, e * z, 0.0), axis=1)
    zy = tl.zeros_like(s)
    if LABEL:
        zy = tl.sum(tl.where((rn + col_offset)[None, :] == labels[:, None], z, 0.0), axis=1)
    return m, s, t, zy


@triton.jit
def _merge(m, s, t, m2, s2, t2):
    """Two (max, Σexp, Σexp·z) triples of the same rows as one."""
    mm = tl.maximum(m, m2)
    a = tl.exp(m - mm)
    b = tl.exp(m2 - mm)
    return mm, s * a + s2 * b, t * a + t2 * b


@triton.jit
def _grad_slice(acc, rm, rn, M, N, col_offset, Bias, labels, lse, ent, g_lp, g_ent, DZ, stride_dz,
                logit_scale, softcap, inv_temperature, ROUND: tl.constexpr, HAS_BIAS: tl.constexpr,
                SOFTCAP: tl.constexpr, SCALED: tl.constexpr, HAS_G_LP: tl.constexpr, HAS_G_ENT: tl.constexpr):
    """``dz`` of one column slice, stored: ``triton_kernels._row_grad``'s formula, element for element."""
    z, th = _transform(_raw(acc, rn, N, col_offset, Bias, ROUND, HAS_BIAS), logit_scale, softcap,
                       inv_temperature, SOFTCAP, SCALED)
    logp = z - lse[:, None]
    p = tl.exp(logp)
    dz = tl.zeros_like(p)
    if HAS_G_LP:
        dz = g_lp[:, None] * (tl.where((rn + col_offset)[None, :] == labels[:, None], 1.0, 0.0) - p)
    if HAS_G_ENT:
        dz -= g_ent[:, None] * p * (logp + ent[:, None])
    if SCALED:
        dz = dz * inv_temperature
    if SOFTCAP:
        dz = dz * (1.0 - th * th)
    if SCALED:
        dz = dz * logit_scale
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    tl.store(DZ + rm[:, None].to(tl.int64) * stride_dz + rn[None, :], dz.to(DZ.dtype.element_ty), mask=mask)


@triton.jit
def _epilogue(acc, pid_m, pid_n, M, N, col_offset, Bias, Labels,
              PART_M, PART_S, PART_T, ZY, stride_part,
              DZ, stride_dz, LSE, ENT, G_LP, G_ENT,
              logit_scale, softcap, inv_temperature,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GRAD: tl.constexpr, ROUND: tl.constexpr,
              HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, SCALED: tl.constexpr, ENTROPY: tl.constexpr,
              HAS_G_LP: tl.constexpr, HAS_G_ENT: tl.constexpr, LABEL: tl.constexpr):
    """One fp32 output tile's statistics (partials and label logit) or ``dz``, in four column slices of
    ``BLOCK_N // 4`` (the whole tile's temporaries beside its accumulator would spill)."""
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = rm < M
    labels = tl.load(Labels + rm, mask=m_ok, other=-1)
    left, right = _halves(acc, BLOCK_M, BLOCK_N // 2)
    q0, q1 = _halves(left, BLOCK_M, BLOCK_N // 4)
    q2, q3 = _halves(right, BLOCK_M, BLOCK_N // 4)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N // 4)
    if GRAD == 2:  # timing only (benchmarks.logits_epilogues): the matmul with a minimal epilogue
        if pid_n == 0:
            tl.store(PART_M + rm, tl.max(acc, axis=1), mask=m_ok)
    elif GRAD:
        lse = tl.load(LSE + rm, mask=m_ok, other=0.0)
        ent = tl.load(ENT + rm, mask=m_ok, other=0.0)
        g_lp = tl.load(G_LP + rm, mask=m_ok, other=0.0)
        g_ent = tl.load(G_ENT + rm, mask=m_ok, other=0.0)
        _grad_slice(q0, rm, rn, M, N, col_offset, Bias, labels, lse, ent, g_lp, g_ent, DZ, stride_dz,
                    logit_scale, softcap, inv_temperature, ROUND, HAS_BIAS, SOFTCAP, SCALED, HAS_G_LP, HAS_G_ENT)
        _grad_slice(q1, rm, rn + BLOCK_N // 4, M, N, col_offset, Bias, labels, lse, ent, g_lp, g_ent, DZ,
                    stride_dz, logit_scale, softcap, inv_temperature, ROUND, HAS_BIAS, SOFTCAP, SCALED, HAS_G_LP,
                    HAS_G_ENT)
        _grad_slice(q2, rm, rn + BLOCK_N // 2, M, N, col_offset, Bias, labels, lse, ent, g_lp, g_ent, DZ,
                    stride_dz, logit_scale, softcap, inv_temperature, ROUND, HAS_BIAS, SOFTCAP, SCALED, HAS_G_LP,
                    HAS_G_ENT)
        _grad_slice(q3, rm, rn + 3 * (BLOCK_N // 4), M, N, col_offset, Bias, labels, lse, ent, g_lp, g_ent, DZ,
                    stride_dz, logit_scale, softcap, inv_temperature, ROUND, HAS_BIAS, SOFTCAP, SCALED, HAS_G_LP,
                    HAS_G_ENT)
    else:
        m, s, t, zy = _stats_slice(q0, rn, N, col_offset, Bias, labels, logit_scale, softcap, inv_temperature,
                                   ROUND, HAS_BIAS, SOFTCAP, SCALED, ENTROPY, LABEL)
        m1, s1, t1, zy1 = _stats_slice(q1, rn + BLOCK_N // 4, N, col_offset, Bias, labels, logit_scale, softcap,
                                       inv_temperature, ROUND, HAS_BIAS, SOFTCAP, SCALED, ENTROPY, LABEL)
        m, s, t = _merge(m, s, t, m1, s1, t1)
        m1, s1, t1, zy2 = _stats_slice(q2, rn + BLOCK_N // 2, N, col_offset, Bias, labels, logit_scale, softcap,
                                       inv_temperature, ROUND, HAS_BIAS, SOFTCAP, SCALED, ENTROPY, LABEL)
        m, s, t = _merge(m, s, t, m1, s1, t1)
        m1, s1, t1, zy3 = _stats_slice(q3, rn + 3 * (BLOCK_N // 4), N, col_offset, Bias, labels, logit_scale,
                                       softcap, inv_temperature, ROUND, HAS_BIAS, SOFTCAP, SCALED, ENTROPY, LABEL)
        m, s, t = _merge(m, s, t, m1, s1, t1)
        part = pid_n.to(tl.int64) * stride_part + rm
        tl.store(PART_M + part, m, mask=m_ok)
        tl.store(PART_S + part, s, mask=m_ok)
        if ENTROPY:
            tl.store(PART_T + part, t, mask=m_ok)
        # the one slice holding the label added its logit; the others added zeros (exact)
        first = col_offset + pid_n * BLOCK_N
        holds = m_ok & (labels >= first) & (labels < first + BLOCK_N) & (labels < col_offset + N)
        tl.store(ZY + rm, (zy + zy1) + (zy2 + zy3), mask=holds)


@triton.jit
def _logits_epilogue_kernel(
    A_DESC, B_DESC, M, N, K, col_offset, Bias, Labels,
    PART_M, PART_S, PART_T, ZY, stride_part,
    DZ, stride_dz, LSE, ENT, G_LP, G_ENT,
    logit_scale, softcap, inv_temperature,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, WIDEN_DOT: tl.constexpr, GRAD: tl.constexpr, ROUND: tl.constexpr,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, SCALED: tl.constexpr, ENTROPY: tl.constexpr,
    HAS_G_LP: tl.constexpr, HAS_G_ENT: tl.constexpr, LABEL: tl.constexpr,
):
    """Tiles ``pid, pid + NUM_PROGRAMS, …`` of ``h [M, K] @ w [N, K]ᵀ`` (``A_DESC`` over ``h`` in
    ``[BLOCK_M, BLOCK_K]`` boxes, ``B_DESC`` over ``w`` in ``[BLOCK_N, BLOCK_K]`` boxes; the zero fill past
    their shapes stands in for masks) in :func:`.compensated._tile`'s grouped order, each handed to
    :func:`_epilogue`."""
    start = tl.program_id(0)
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    # a separate tile counter for the epilogue, so that the flattened loop issues the next tile's loads while
    # this tile's epilogue runs (as in Triton's persistent matmul tutorial)
    tile_c = start - NUM_PROGRAMS
    for tile in tl.range(start, num_tiles, NUM_PROGRAMS, flatten=True):
        pid_m, pid_n = _tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_tiles):
            off_k = k * BLOCK_K
            a = A_DESC.load([off_m, off_k])
            b = B_DESC.load([off_n, off_k]).T
            if WIDEN_DOT:
                acc = tl.dot(_to_fp32(a), _to_fp32(b), acc)
            else:
                acc = tl.dot(a, b, acc)
        tile_c += NUM_PROGRAMS
        pid_m_c, pid_n_c = _tile(tile_c, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        _epilogue(acc, pid_m_c, pid_n_c, M, N, col_offset, Bias, Labels, PART_M, PART_S, PART_T, ZY, stride_part,
                  DZ, stride_dz, LSE, ENT, G_LP, G_ENT, logit_scale, softcap, inv_temperature,
                  BLOCK_M, BLOCK_N, GRAD, ROUND, HAS_BIAS, SOFTCAP, SCALED, ENTROPY, HAS_G_LP, HAS_G_ENT, LABEL)


@triton.jit
def _merge_kernel(PART_M, PART_S, PART_T, stride_part, n_parts, M, RUN_M, RUN_S, RUN_T,
                  ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
    """Rows ``[pid·BLOCK, (pid + 1)·BLOCK)``: the running (max, Σexp, Σexp·z) merged with each of the
    ``n_parts`` column tiles' partials, in column order."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < M
    m = tl.load(RUN_M + rows, mask=ok, other=0.0)
    s = tl.load(RUN_S + rows, mask=ok, other=0.0)
    t = tl.zeros_like(s)
    if ENTROPY:
        t = tl.load(RUN_T + rows, mask=ok, other=0.0)
    for j in range(n_parts):
        part = j * stride_part + rows
        m2 = tl.load(PART_M + part, mask=ok, other=0.0)
        s2 = tl.load(PART_S + part, mask=ok, other=0.0)
        t2 = tl.zeros_like(s2)
        if ENTROPY:
            t2 = tl.load(PART_T + part, mask=ok, other=0.0)
        m, s, t = _merge(m, s, t, m2, s2, t2)
    tl.store(RUN_M + rows, m, mask=ok)
    tl.store(RUN_S + rows, s, mask=ok)
    if ENTROPY:
        tl.store(RUN_T + rows, t, mask=ok)


def _launch(h: torch.Tensor, w: torch.Tensor, col_offset: int, bias: Optional[torch.Tensor], labels: torch.Tensor,
            scalars: dict, config: GemmConfig, **kernel_args) -> None:
    """One launch of :func:`_logits_epilogue_kernel` over ``h @ w.T`` (``kernel_args``: its epilogue's pointers
    and flags; ``ROUND`` may be given to override the operands' default)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = h.shape
    n = w.shape[0]
    a_desc = TensorDescriptor(h, [m, k], [h.stride(0), 1], [config.block_m, config.block_k])
    b_desc = TensorDescriptor(w, [n, k], [w.stride(0), 1], [config.block_n, config.block_k])
    programs = _multiprocessors(h.device)
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    with torch.cuda.device(h.device) if h.is_cuda else contextlib.nullcontext():
        _logits_epilogue_kernel[(min(tiles, programs),)](
            a_desc, b_desc, m, n, k, col_offset, bias if bias is not None else labels, labels,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
            NUM_PROGRAMS=programs, WIDEN_DOT=not h.is_cuda and h.dtype == torch.bfloat16,
            num_warps=config.num_warps, num_stages=config.num_stages,
            **{"ROUND": (2 if h.is_cuda else 1) if h.dtype == torch.bfloat16 else 0, **scalars, **kernel_args},
        )


def logits_statistics_(
    h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, run_max: torch.Tensor, run_sum: torch.Tensor,
    run_zp: Optional[torch.Tensor], label_logit: torch.Tensor, *, col_offset: int, bias: Optional[torch.Tensor],
    scalars: dict, config: GemmConfig = CONFIG,
) -> None:
    """Fold the logits ``h @ w.T`` (columns ``col_offset …`` of the vocabulary) into running per-row statistics,
    in place, as ``triton_kernels.stats_kernel`` does from a stored tile: ``run_max`` (starts at −inf),
    ``run_sum`` = Σexp(z − run_max) and, when given, ``run_zp`` = Σexp(z − run_max)·z (the entropy's; start at
    0); ``label_logit`` set for the rows whose label falls in these columns.

    Args:
        h: ``[M, H]`` row-major (the kept hidden rows), bf16 (fp32 under the interpreter).
        w: ``[N, H]`` row-major, ``h``'s dtype (a row slice of the lm_head weight).
        labels: ``[M]`` int64, each in ``[0, V)``.
        run_max, run_sum, run_zp, label_logit: fp32 ``[M]``, contiguous.
        bias: the whole ``[V]`` bias or None; scalars: ``TritonCublasBackend._scalars`` (logit transform flags).

    Holds ``PARTIAL_BYTES_PER_TILE_ROW`` bytes per row and output tile of ``w``'s columns (2 or 3 fp32 partials)
    until the merge.
    """
    m, n = h.shape[0], w.shape[0]
    if m == 0 or n == 0:
        return
    entropy = run_zp is not None
    parts = column_tiles(n, config)
    part = torch.empty((3 if entropy else 2, parts, m), dtype=torch.float32, device=h.device)
    part_t = part[2] if entropy else part[0]
    _launch(h, w, col_offset, bias, labels, scalars, config,
            PART_M=part[0], PART_S=part[1], PART_T=part_t, ZY=label_logit, stride_part=m,
            DZ=label_logit, stride_dz=0, LSE=run_max, ENT=run_max, G_LP=run_max, G_ENT=run_max,
            GRAD=0, ENTROPY=entropy, HAS_G_LP=False, HAS_G_ENT=False, LABEL=True)
    with torch.cuda.device(h.device) if h.is_cuda else contextlib.nullcontext():
        _merge_kernel[(triton.cdiv(m, _MERGE_BLOCK),)](
            part[0], part[1], part_t, m, parts, m, run_max, run_sum, run_zp if entropy else run_sum,
            ENTROPY=entropy, BLOCK=_MERGE_BLOCK,
        )


def logits_grad_(
    h: torch.Tensor, w: torch.Tensor, dz: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor,
    g_lp: torch.Tensor, g_ent: torch.Tensor, *, has_g_lp: bool, has_g_ent: bool, col_offset: int,
    bias: Optional[torch.Tensor], scalars: dict, config: GemmConfig = CONFIG,
) -> None:
    """``dz [M, N]`` ← the logits-gradient of ``h @ w.T`` (columns ``col_offset …``), as
    ``triton_kernels.grad_kernel`` computes it from a stored tile: with ``logp = z − lse`` and ``p = exp(logp)``,
    ``g_lp·(1[c = label] − p) − g_ent·p·(logp + ent)``, through the logit transform's derivative.

    Args:
        h, w, labels, bias, scalars: as in :func:`logits_statistics_`.
        dz: ``[M, N]`` in ``h``'s dtype, last stride 1: written (the tile the gradient matmuls read).
        lse, ent, g_lp, g_ent: fp32 ``[M]``, contiguous (zeros where a gradient is absent; ``has_g_lp`` and
            ``has_g_ent`` say which are).
    """
    m, n = h.shape[0], w.shape[0]
    if m == 0 or n == 0:
        return
    _launch(h, w, col_offset, bias, labels, scalars, config,
            PART_M=lse, PART_S=lse, PART_T=lse, ZY=lse, stride_part=0,
            DZ=dz, stride_dz=dz.stride(0), LSE=lse, ENT=ent, G_LP=g_lp, G_ENT=g_ent,
            GRAD=1, ENTROPY=False, HAS_G_LP=has_g_lp, HAS_G_ENT=has_g_ent, LABEL=True)


__all__ = ["CONFIG", "PARTIAL_BYTES_PER_TILE_ROW", "applies", "column_tiles", "forced", "logits_grad_",
           "logits_statistics_"]
