"""The logits matmul with the loss statistics in its epilogue: log-probs from the fp32 accumulator (Triton, Hopper).

cuBLAS writes each logits tile in bf16 and the statistics kernel (:mod:`.triton_kernels`) reads it back, so the
log-sum-exp, the label logit and the entropy come from logits rounded to bf16, each off by up to ``|z|·2⁻⁸``.
Here one persistent Triton matmul (TMA loads, bf16 operands, fp32 accumulator) reduces each ``[BLOCK_M, BLOCK_N]``
output tile of ``h @ wᵀ`` straight from its accumulator, through the bias and the logit transform
(:func:`~.triton_kernels.apply_transform`), to the tile's per-row partial statistics: the max ``m``,
``Σ exp(z − m)``, ``Σ exp(z − m)·z`` (the entropy's), and under their flags ``Σ z``, the first arg-max and
``Σ exp(2(z − m))`` (:mod:`hf_fused.ops.token_statistics`), into ``[rows, ⌈V / BLOCK_N⌉]`` partials; the tile
that holds a row's label stores its logit. A second kernel then folds each row's partials into the running
statistics of :mod:`.tiles` with the log-sum-exp rule (:mod:`.statistics_partials`), so
:func:`~.tiles.finish_row_stats` reads them as it reads the statistics kernel's. No ``[rows, V]`` tile is written,
unless asked (``tile``: the one pass, whose gradient kernel reads it), and then shifted as :mod:`.shifted_tile`'s:
each epilogue slice's transformed logits minus the slice's row maximum, ``z − m_s``, rounded once to bf16, and the
shifts ``m_s`` in fp32 beside it (``[rows, ⌈V / 64⌉]`` on a GPU, 1/32 of the tile's bytes). A likely token's stored
value is then near 0 and carries a rounding error of ``|z − m_s|·2⁻⁸``, not the ``|z|·2⁻⁸`` of cuBLAS's bf16 tile,
so the gradient computed from it is as accurate as from the accumulator rounded once; the stored logits' own
normalizer comes beside them (the gradient kernel's probabilities from the stored tile then sum to 1).

The per-token log-probs are then those of an fp32-accumulated matmul of the same bf16 operands, not of its bf16
rounding: the statistics pass and the one pass's statistics run it where the plan chooses it
(:func:`~.plan.fp32_logits`, :mod:`.fp32_logits_rule`).

On a GPU the launch shape is autotuned over :data:`~.fused_matmul_launch.CONFIGS` (keyed on ``V``, ``H``, the rows' power-of-two bucket,
whether the tile is stored and how: :func:`tma_tile_store`);
under Triton's interpreter (CPU, tests) it runs :data:`INTERPRETER_CONFIG` or the one given.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch
import triton
import triton.language as tl

from ...devices import kernel_device, multiprocessors
from .fused_matmul_launch import (
    CONFIGS,
    INTERPRETER_CONFIG,
    MIN_BLOCK_N,
    TMA_TILE_STORE,
    TMA_TILE_STORE_ENV,
    StatsConfig,
    new_offsets,
    partial_row_bytes,
    rows_bucket,
    shift_columns,
    stored_tile_row_bytes,
    tma_tile_store,
    tma_tile_store_forced,
)
from .matmul import halves, round_bf16, tile_order, tma_tile_product
from .statistics_partials import merge_partials_, new_partials
from .triton_kernels import LOG2E, apply_transform

_NO_MAX = tl.constexpr(-3.4028234663852886e38)  # below every finite fp32 value (the statistics kernel's)

@triton.jit
def _fold_slice(raw, n0, M, N, col_offset, off_m, rm, Bias, labels, m, s, t, zy, zsum, arg, s2, sr, Z,
                stride_z, Z_DESC, Off, stride_off, logit_scale, softcap, inv_temperature, SLICE: tl.constexpr,
                ROUND: tl.constexpr, STORE_TILE: tl.constexpr, TMA_STORE: tl.constexpr, HAS_BIAS: tl.constexpr,
                SOFTCAP: tl.constexpr, SCALED: tl.constexpr, ENTROPY: tl.constexpr, SUM_Z: tl.constexpr,
                ARGMAX: tl.constexpr, SUM_SQ: tl.constexpr):
    """One column slice ``raw [len(rm), SLICE]`` of the accumulator (columns ``n0 …`` of this launch) folded into
    the rows' running (max, Σexp(z−m), Σexp(z−m)·z, label logit, Σz, first arg-max, Σexp(2(z−m))); with
    ``STORE_TILE`` the transformed logits ``z`` are also stored into ``Z`` shifted by the slice's row maximum,
    ``z − m_slice`` rounded to ``Z``'s dtype (``ROUND``: 1 on the bit pattern, for the interpreter, whose
    conversion truncates; 2 the GPU's conversion; ``TMA_STORE``: through the descriptor ``Z_DESC`` over ``Z``, whose
    box is one slice, else by pointers), ``m_slice`` into column ``n0 / SLICE`` of ``Off``, and ``sr`` is
    the running Σexp(z̃ − m) of the stored logits ``z̃ = round(z − m_slice) + m_slice``: the normalizer of the
    probabilities that the gradient kernel computes from the stored tile (they sum to 1 with it, not with the
    accumulator's)."""
    rn = n0 + tl.arange(0, SLICE)
    col_ok = rn < N
    raw_b = raw
    if HAS_BIAS:
        raw_b = raw + tl.load(Bias + col_offset + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    z, _ = apply_transform(raw_b, logit_scale, softcap, inv_temperature, SOFTCAP, SCALED)
    valid = col_ok[None, :]
    # past the last column −inf: below every logit, and exp2(−inf) = 0 adds nothing (no mask on e: fewer registers)
    z = tl.where(valid, z, float("-inf"))
    m_slice = tl.max(z, axis=1)  # −inf for a slice wholly past the last column
    m_new = tl.maximum(m, m_slice)  # finite: every tile's first slice holds a valid column
    alpha = tl.exp(m - m_new)  # 0 before the first slice (m = _NO_MAX: no overflow), 1 while the max holds
    e = tl.exp2((z - m_new[:, None]) * LOG2E)
    s = s * alpha + tl.sum(e, axis=1)
    if ENTROPY:
        t = t * alpha + tl.sum(e * tl.where(valid, z, 0.0), axis=1)  # 0·(−inf) would be NaN
    # the label's logit: at most one column of the row matches (a column past N is never stored as it)
    zy += tl.sum(tl.where((rn + col_offset)[None, :] == labels[:, None], z, 0.0), axis=1)
    if SUM_Z:
        zsum += tl.sum(tl.where(valid, z, 0.0), axis=1)
    if ARGMAX:
        # the slice's first maximum, taken over only by a strictly larger one: the row's first maximum (torch's)
        first = n0 + tl.argmax(z, axis=1, tie_break_left=True)
        arg = tl.where(m_slice > m, first, arg)
    if SUM_SQ:
        s2 = s2 * (alpha * alpha) + tl.sum(e * e, axis=1)
    if STORE_TILE:
        # shifted by the slice's maximum, a likely token's stored value is near 0: its rounding error is
        # |z − m_slice|·2⁻⁸ at most, not |z|·2⁻⁸ (shifted_tile's rule, per slice)
        # past the last column −inf − m_shift = −inf: stored nowhere, adds nothing to sr (finite m_shift in a slice
        # wholly past it: no −inf − (−inf))
        m_shift = tl.maximum(m_slice, _NO_MAX)
        shifted = z - m_shift[:, None]
        stored = shifted
        rounded = shifted
        if ROUND == 1:
            stored, rounded = round_bf16(shifted)
        elif ROUND == 2:
            rounded = shifted.to(tl.bfloat16).to(tl.float32)
        row_ok = rm < M
        if TMA_STORE:
            # an asynchronous bulk copy from shared memory; the descriptor's bounds ([M, N]) clip the ragged edges
            Z_DESC.store([off_m, n0], stored.to(Z.dtype.element_ty))
        else:
            # 32-bit offsets from the tile's first row (a [BLOCK_M, SLICE] block of 64-bit addresses spills)
            tile_rows = Z + off_m.to(tl.int64) * stride_z
            local = (rm - off_m)[:, None] * stride_z + rn[None, :]
            tl.store(tile_rows + local, stored.to(Z.dtype.element_ty), mask=row_ok[:, None] & valid)
        # a slice wholly past the last column has no shift
        shift_rows = Off + off_m.to(tl.int64) * stride_off
        tl.store(shift_rows + (rm - off_m) * stride_off + n0 // SLICE, m_shift, mask=row_ok & (rm * 0 + n0 < N))
        sr = sr * alpha + tl.sum(tl.exp2((rounded + (m_shift - m_new)[:, None]) * LOG2E), axis=1)
    return m_new, s, t, zy, zsum, arg, s2, sr


# Sizes are not specialized (Triton would compile again for each divisibility by 16 of a row count): one binary per
# launch shape and flags, whose autotuning for one (V, H) then costs no compilation for another.
@triton.jit(do_not_specialize=["M", "N", "K", "col_offset", "n_part", "M_BUCKET"])
def _statistics_kernel(
    A_DESC, B_DESC, M, N, K, col_offset, Bias, Labels, ZY,
    P_MAX, P_SUM, P_ZP, P_ZSUM, P_ARG, P_SQ, P_SR, n_part, Z, stride_z, Z_DESC, Off, stride_off,
    logit_scale, softcap, inv_temperature, M_BUCKET,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT: tl.constexpr, NUM_PROGRAMS: tl.constexpr, WIDEN_DOT: tl.constexpr, ROUND: tl.constexpr,
    STORE_TILE: tl.constexpr, TMA_STORE: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
    SCALED: tl.constexpr, ENTROPY: tl.constexpr, SUM_Z: tl.constexpr, ARGMAX: tl.constexpr, SUM_SQ: tl.constexpr,
):
    """Tiles ``pid, pid + NUM_PROGRAMS, …`` of ``h [M, K] @ w [N, K]ᵀ`` (``A_DESC``/``B_DESC``: TMA descriptors
    whose zero fill past the shapes stands in for masks) in :func:`~.matmul.tile_order`'s order; each tile's
    per-row partials go to column ``pid_n`` of the ``[M, n_part]`` partials, its rows' label logits (where the
    label is one of its columns, ``col_offset`` added) to ``ZY``; with ``STORE_TILE`` its shifted logits to ``Z``
    (with ``TMA_STORE`` through ``Z_DESC``, a descriptor over ``Z`` whose box is one epilogue slice) and their shifts
    to ``Off`` (``[M, ⌈N / slice⌉]``, one per ``BLOCK_N / SPLIT`` columns). ``M_BUCKET`` is read by the autotuner
    only (its key: :func:`_rows_bucket`)."""
    start = tl.program_id(0)
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    # a separate tile counter for the epilogue, so that the flattened loop issues the next tile's loads while
    # this tile's epilogue runs (as in Triton's persistent matmul tutorial and .logits_epilogues)
    tile_c = start - NUM_PROGRAMS
    for tile in tl.range(start, num_tiles, NUM_PROGRAMS, flatten=True):
        pid_m, pid_n = tile_order(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tma_tile_product(A_DESC, B_DESC, pid_m * BLOCK_M, pid_n * BLOCK_N, k_tiles, BLOCK_M, BLOCK_N,
                               BLOCK_K, False, True, WIDEN_DOT)
        tile_c += NUM_PROGRAMS
        pid_m_c, pid_n_c = tile_order(tile_c, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m_c * BLOCK_M
        off_n = pid_n_c * BLOCK_N
        rm = off_m + tl.arange(0, BLOCK_M)
        m_ok = rm < M
        labels = tl.load(Labels + rm, mask=m_ok, other=-1)
        m = tl.full([BLOCK_M], _NO_MAX, tl.float32)
        s = tl.zeros([BLOCK_M], tl.float32)
        t = tl.zeros([BLOCK_M], tl.float32)
        zy = tl.zeros([BLOCK_M], tl.float32)
        zsum = tl.zeros([BLOCK_M], tl.float32)
        arg = tl.zeros([BLOCK_M], tl.int32)
        s2 = tl.zeros([BLOCK_M], tl.float32)
        sr = tl.zeros([BLOCK_M], tl.float32)
        # the epilogue's state: (max, Σexp, Σexp·z, label logit, Σz, arg-max, Σexp(2(z−m)), Σexp(z̃−m)) per row
        if SPLIT == 1:
            m, s, t, zy, zsum, arg, s2, sr = _fold_slice(
                acc, off_n, M, N, col_offset, off_m, rm, Bias, labels, m, s, t, zy, zsum, arg, s2, sr,
                Z, stride_z, Z_DESC, Off, stride_off, logit_scale, softcap, inv_temperature, BLOCK_N, ROUND,
                STORE_TILE, TMA_STORE, HAS_BIAS, SOFTCAP, SCALED, ENTROPY, SUM_Z, ARGMAX, SUM_SQ)
        elif SPLIT == 2:
            HALF: tl.constexpr = BLOCK_N // 2
            left, right = halves(acc, BLOCK_M, HALF)
            m, s, t, zy, zsum, arg, s2, sr = _fold_slice(
                left, off_n, M, N, col_offset, off_m, rm, Bias, labels, m, s, t, zy, zsum, arg, s2, sr,
                Z, stride_z, Z_DESC, Off, stride_off, logit_scale, softcap, inv_temperature, HALF, ROUND,
                STORE_TILE, TMA_STORE, HAS_BIAS, SOFTCAP, SCALED, ENTROPY, SUM_Z, ARGMAX, SUM_SQ)
            m, s, t, zy, zsum, arg, s2, sr = _fold_slice(
                right, off_n + HALF, M, N, col_offset, off_m, rm, Bias, labels, m, s, t, zy, zsum, arg, s2, sr,
                Z, stride_z, Z_DESC, Off, stride_off, logit_scale, softcap, inv_temperature, HALF, ROUND,
                STORE_TILE, TMA_STORE, HAS_BIAS, SOFTCAP, SCALED, ENTROPY, SUM_Z, ARGMAX, SUM_SQ)
        else:
            QUARTER: tl.constexpr = BLOCK_N // 4
            left, right = halves(acc, BLOCK_M, BLOCK_N // 2)
            q0, q1 = halves(left, BLOCK_M, QUARTER)
            q2, q3 = halves(right, BLOCK_M, QUARTER)
            m, s, t, zy, zsum, arg, s2, sr = _fold_slice(
                q0, off_n, M, N, col_offset, off_m, rm, Bias, labels, m, s, t, zy, zsum, arg, s2, sr,
                Z, stride_z, Z_DESC, Off, stride_off, logit_scale, softcap, inv_temperature, QUARTER, ROUND,
                STORE_TILE, TMA_STORE, HAS_BIAS, SOFTCAP, SCALED, ENTROPY, SUM_Z, ARGMAX, SUM_SQ)
            m, s, t, zy, zsum, arg, s2, sr = _fold_slice(
                q1, off_n + QUARTER, M, N, col_offset, off_m, rm, Bias, labels, m, s, t, zy, zsum, arg, s2, sr,
                Z, stride_z, Z_DESC, Off, stride_off, logit_scale, softcap, inv_temperature, QUARTER, ROUND,
                STORE_TILE, TMA_STORE, HAS_BIAS, SOFTCAP, SCALED, ENTROPY, SUM_Z, ARGMAX, SUM_SQ)
            m, s, t, zy, zsum, arg, s2, sr = _fold_slice(
                q2, off_n + 2 * QUARTER, M, N, col_offset, off_m, rm, Bias, labels, m, s, t, zy, zsum, arg, s2, sr,
                Z, stride_z, Z_DESC, Off, stride_off, logit_scale, softcap, inv_temperature, QUARTER, ROUND,
                STORE_TILE, TMA_STORE, HAS_BIAS, SOFTCAP, SCALED, ENTROPY, SUM_Z, ARGMAX, SUM_SQ)
            m, s, t, zy, zsum, arg, s2, sr = _fold_slice(
                q3, off_n + 3 * QUARTER, M, N, col_offset, off_m, rm, Bias, labels, m, s, t, zy, zsum, arg, s2, sr,
                Z, stride_z, Z_DESC, Off, stride_off, logit_scale, softcap, inv_temperature, QUARTER, ROUND,
                STORE_TILE, TMA_STORE, HAS_BIAS, SOFTCAP, SCALED, ENTROPY, SUM_Z, ARGMAX, SUM_SQ)
        part = rm.to(tl.int64) * n_part + pid_n_c
        tl.store(P_MAX + part, m, mask=m_ok)
        tl.store(P_SUM + part, s, mask=m_ok)
        if ENTROPY:
            tl.store(P_ZP + part, t, mask=m_ok)
        if SUM_Z:
            tl.store(P_ZSUM + part, zsum, mask=m_ok)
        if ARGMAX:
            tl.store(P_ARG + part, arg, mask=m_ok)
        if SUM_SQ:
            tl.store(P_SQ + part, s2, mask=m_ok)
        if STORE_TILE:
            tl.store(P_SR + part, sr, mask=m_ok)
        in_tile = m_ok & (labels >= col_offset + off_n) & (labels < col_offset + tl.minimum(off_n + BLOCK_N, N))
        tl.store(ZY + rm, zy, mask=in_tile)


def _set_block_shapes(nargs: dict) -> None:
    """Autotuning pre-hook: the TMA descriptors' boxes for the config being run (the stored tile's: one slice)."""
    nargs["A_DESC"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]
    nargs["B_DESC"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_K"]]
    if nargs["Z_DESC"] is not None:
        nargs["Z_DESC"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_N"] // nargs["SPLIT"]]


def _tuning_bench(fn, quantiles):
    """The autotuner's timing of one config (see its ``do_bench`` below)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=100, rep=300, quantiles=quantiles)


#: Held over a launch of the autotuned kernel and the read of its chosen shape. Triton's autotuner keeps a call's
#: arguments (whose TMA boxes its pre-hook sets for each config) and its last choice on the shared kernel object, so
#: two threads launching at once (ranks as threads on one GPU, ``nn.DataParallel``'s replicas) could run a config
#: on the other call's descriptors or fold partials at the other call's width (triton-lang/triton#11494).
_TUNED_LAUNCH = threading.Lock()

_tuned_statistics_kernel = triton.autotune(
    configs=[triton.Config(c.kwargs(), num_warps=c.num_warps, num_stages=c.num_stages, pre_hook=_set_block_shapes)
             for c in CONFIGS],
    # the stored tile's epilogue takes many more registers (its best shape is another), and so may its TMA store;
    # the row count decides the waves (keyed on its bucket: otherwise the first call's rows choose for every other)
    key=["N", "K", "M_BUCKET", "STORE_TILE", "TMA_STORE"],
    # Triton's default timing (25 ms warm-up, 100 ms) is 10 launches at 8192 x 151,936 x 2048, too few to rank
    # candidates a few percent apart: 0.4 s a candidate, once per key
    do_bench=_tuning_bench,
)(_statistics_kernel)


def logits_statistics_(
    h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, stats: tuple, scalars: dict, *, return_entropy: bool,
    col_offset: int = 0, bias: Optional[torch.Tensor] = None, tile: Optional[torch.Tensor] = None,
    rounded_sum: Optional[torch.Tensor] = None, offsets: Optional[torch.Tensor] = None,
    config: Optional[StatsConfig] = None,
) -> None:
    """Fold the statistics of the logits ``h @ w.T`` (columns ``col_offset …`` of the vocabulary), computed from the
    matmul's fp32 accumulator, into ``stats`` as ``triton_kernels.stats_kernel`` folds a stored tile's: the running
    max, Σexp(z − m), Σexp(z − m)·z (with ``return_entropy``), the label logit where the label is one of these
    columns, and the token statistics ``stats`` holds (:func:`~.tiles.new_row_stats`). The bias (whole ``[V]``)
    and the logit transform (``scalars``: :func:`~.tiles.kernel_scalars`) are applied to the accumulator.

    Args:
        h: ``[M, H]`` row-major, bf16 (bf16 or fp32 under the interpreter); w: ``[N, H]`` row-major, ``h``'s dtype.
            Both must be :func:`~.fp32_logits_rule.readable` (row-major, TMA-aligned rows).
        labels: ``[M]`` int64. stats: :data:`~.tiles.RowStats` of ``M`` rows.
        tile: ``[M, N]`` in ``h``'s dtype, unit column stride, or None: where given, the transformed logits ``z``
            (bias and transform applied) are stored into it shifted, ``z − m_s`` rounded once to its dtype, ``m_s``
            the row's maximum over each slice of :func:`shift_columns` columns, written to ``offsets`` (fp32
            ``[M, ⌈N / c⌉]``, :func:`new_offsets`; column ``j`` the shift of columns ``j·c …`` of this launch);
            ``rounded_sum`` (fp32 ``[M]``, running like the statistics: 0 before the first launch) folds
            Σexp(z̃ − m) of the stored logits ``z̃ = tile + offset``, so that ``m + log(rounded_sum)`` normalizes the
            probabilities of the stored tile. It is written through a TMA descriptor where :func:`tma_tile_store`
            says so, else by pointers (the same bits).
        config: the launch shape (default: autotuned over :data:`CONFIGS` on a GPU, :data:`INTERPRETER_CONFIG`
            under the interpreter).

    Raises:
        ValueError: for a ``config`` whose ``split`` is not 1, 2 or 4 or does not divide ``block_n``; for a
            ``tile`` without ``rounded_sum`` and ``offsets`` or the reverse, or ``offsets`` of another shape.
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    m_rows, k = h.shape
    n = w.shape[0]
    if m_rows == 0 or n == 0:
        return
    if config is not None and (config.split not in (1, 2, 4) or config.block_n % config.split):
        raise ValueError(f"logits_statistics_: split must be 1, 2 or 4 and divide block_n, got {config}")
    if not (tile is None) == (rounded_sum is None) == (offsets is None):
        raise ValueError("logits_statistics_: a stored tile, its rounded_sum and its offsets come together; pass all "
                         "three or none")
    if offsets is not None:
        shape = (m_rows, triton.cdiv(n, shift_columns(h.device, config)))
        if tuple(offsets.shape) != shape or offsets.dtype != torch.float32 or offsets.stride(-1) != 1:
            raise ValueError(f"logits_statistics_: offsets must be fp32 {list(shape)} with unit column stride (one "
                             f"shift per {shift_columns(h.device, config)} columns), got {offsets.dtype} "
                             f"{list(offsets.shape)}")
    run_max, run_sum, run_zp, label_logit, z_sum, arg, sum_sq = stats
    if config is None and not h.is_cuda:
        config = INTERPRETER_CONFIG
    min_block_n = MIN_BLOCK_N if config is None else config.block_n
    n_part = triton.cdiv(n, min_block_n)
    parts = new_partials(m_rows, n_part, h.device, return_entropy, z_sum is not None, arg is not None,
                         sum_sq is not None, tile is not None)
    box = config or CONFIGS[0]
    a_desc = TensorDescriptor(h, [m_rows, k], [h.stride(0), 1], [box.block_m, box.block_k])
    b_desc = TensorDescriptor(w, [n, k], [w.stride(0), 1], [box.block_n, box.block_k])
    # the stored tile's box is one epilogue slice
    z_desc = (TensorDescriptor(tile, [m_rows, n], [tile.stride(0), 1], [box.block_m, box.block_n // box.split])
              if tile is not None and tma_tile_store(tile) else None)
    programs = multiprocessors(h.device)
    flags = dict(
        WIDEN_DOT=not h.is_cuda and h.dtype == torch.bfloat16,
        ROUND=(2 if h.is_cuda else 1) if (tile is not None and tile.dtype == torch.bfloat16) else 0,
        STORE_TILE=tile is not None, TMA_STORE=z_desc is not None, ENTROPY=return_entropy, SUM_Z=z_sum is not None, ARGMAX=arg is not None,
        SUM_SQ=sum_sq is not None, M_BUCKET=rows_bucket(m_rows), **scalars,
    )
    args = (a_desc, b_desc, m_rows, n, k, col_offset, bias if bias is not None else run_max, labels, label_logit,
            *parts, n_part, tile if tile is not None else run_max, tile.stride(0) if tile is not None else 0, z_desc,
            offsets if offsets is not None else run_max, offsets.stride(0) if offsets is not None else 0)
    with kernel_device(h):
        if config is None:
            def grid(meta):
                return (min(programs, triton.cdiv(m_rows, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"])),)

            with _TUNED_LAUNCH:
                _tuned_statistics_kernel[grid](*args, NUM_PROGRAMS=programs, **flags)
                block_n = _tuned_statistics_kernel.best_config.kwargs["BLOCK_N"]
        else:
            tiles = triton.cdiv(m_rows, config.block_m) * triton.cdiv(n, config.block_n)
            _statistics_kernel[(min(tiles, programs),)](*args, NUM_PROGRAMS=programs, num_warps=config.num_warps,
                                                         num_stages=config.num_stages, **config.kwargs(), **flags)
            block_n = config.block_n
        merge_partials_(parts, triton.cdiv(n, block_n), col_offset, stats, return_entropy, rounded_sum)


__all__ = ["CONFIGS", "INTERPRETER_CONFIG", "MIN_BLOCK_N", "TMA_TILE_STORE", "TMA_TILE_STORE_ENV", "StatsConfig",
           "logits_statistics_", "new_offsets", "partial_row_bytes", "shift_columns", "stored_tile_row_bytes",
           "tma_tile_store", "tma_tile_store_forced"]
