"""A logits tile in the operands' dtype that keeps fp32's accuracy where it matters: each row's columns in blocks of
``BLOCK_V``, each block stored as ``z − m_b``, its transformed logits minus the block's own maximum ``m_b`` (kept in
fp32 beside the tile, ``[rows, ⌈V / BLOCK_V⌉]``).

A bf16 logit carries an absolute error up to ``|z|·2⁻⁸``, so a probability read back from it is off by that relative
amount: ``2⁻⁴`` at the ``z ≈ 16`` of a trained head's likely tokens, where the gradient's mass is. Shifted by its
block's maximum, a likely token's stored value is near 0 and its error near 0 too; the values far below the maximum
that keep large absolute errors have probabilities too small to matter (``p·|z − m|·2⁻⁸ ≤ 2⁻⁸/e``).
The gradients from such a tile are as close to float64 as those from an fp32 tile rounded once to bf16.

* :func:`logits_chunk_`: one vocabulary chunk of fp32 logits (cuBLAS's fp32 accumulator, in a scratch buffer or in
  an fp32 tile's own columns) read once: folded into the rows' running statistics (max, ``Σexp``, ``Σexp·z``), the
  raw logits of the candidate ids that fall in the chunk gathered, and the chunk written shifted into the tile.
* :func:`shifted_gradient_`: the tile turned in place into the logits gradient ``dz`` of a row-wise loss of the
  log-probs (the gradient kernel's ``g·(1[label] − p) − g_H·p·(log p + H)``; the support pass's has no label
  column, the one pass's takes the label's fp32 logit) through the transform's derivative; it also reads the
  one pass's tile, which :mod:`.fused_matmul` stores shifted per epilogue slice.
* :func:`exp_tile_row_factors_`: an exponential tile (QuACK's scaled-exp matmul) left in place as ``dz``'s row-scaled
  form, ``dz = s·tile``, for a loss of the log-probs alone; :func:`scaled_rows_` forms the ``s·h`` its weight
  gradient reads.

Rounding to bf16 is to nearest, ties to even, on the GPU and under the interpreter (:func:`~.matmul.round_bf16`).
One program per row. Run on CPU tensors under ``TRITON_INTERPRET=1`` (CI).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ...devices import kernel_device
from .matmul import round_bf16
from .support_kernels import candidate_block
from .tiles import GRAD_BLOCK_V, GRAD_WARPS, rounds_to_bf16, without_bias_flag
from .triton_kernels import LOG2E, apply_transform, logit_grad

#: Columns of a block with one shift (and of one step of :func:`logits_chunk_`'s loop): 8 per thread of 4 warps.
BLOCK_V, CHUNK_WARPS = 1024, 4
#: Columns of an exponential tile read with one shift (every shift block is a multiple: 64 to 256 columns).
_EXP_RUN = 8
#: Below every finite fp32 value: the masked columns' value in a block's maximum.
_NO_MAX = tl.constexpr(-3.4028234663852886e38)


@triton.jit
def _store(ptr, x, mask, ROUND: tl.constexpr):
    """Store fp32 ``x`` in ``ptr``'s dtype; ``ROUND``: to bf16 on the bit pattern (the interpreter truncates)."""
    if ROUND:
        x, _ = round_bf16(x)
    tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _logits_chunk_kernel(
    X, stride_x, T, stride_t, Off, stride_off, n_cols, col_offset, Bias, M, S, ZP,
    Ids, stride_ids, RAW, K, logit_scale, softcap, inv_temperature,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, SCALED: tl.constexpr, ENTROPY: tl.constexpr,
    ROUND: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row, t_row = X + row * stride_x, T + row * stride_t
    off_row = Off + row * stride_off + col_offset // BLOCK
    # the candidates in this chunk's columns: their raw logits (plus bias) before the chunk is overwritten
    ks = tl.arange(0, BLOCK_K)
    ids = tl.load(Ids + row * stride_ids + ks, mask=ks < K, other=-1) - col_offset
    hit = (ks < K) & (ids >= 0) & (ids < n_cols)
    raw_k = tl.load(x_row + ids, mask=hit, other=0.0).to(tl.float32)
    if HAS_BIAS:
        raw_k += tl.load(Bias + col_offset + ids, mask=hit, other=0.0).to(tl.float32)
    tl.store(RAW + row * K + ks, raw_k, mask=hit)
    # every warp's candidates read before any warp overwrites an fp32 tile's columns in place
    tl.debug_barrier()
    # online log-sum-exp with one maximum per row: each block's maximum is needed anyway, for its shift
    m_start = tl.load(M + row)
    m = m_start
    s_acc = tl.zeros([BLOCK], tl.float32)
    zp_acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        raw = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            raw += tl.load(Bias + col_offset + cols, mask=mask, other=0.0).to(tl.float32)
        z, _ = apply_transform(raw, logit_scale, softcap, inv_temperature, SOFTCAP, SCALED)
        m_block = tl.max(tl.where(mask, z, _NO_MAX), axis=0)
        m_new = tl.maximum(m, m_block)
        alpha = tl.exp(m - m_new)  # 0 on the row's first block (m = −inf), 1 while its maximum holds
        e = tl.where(mask, tl.exp(z - m_new), 0.0)
        s_acc = s_acc * alpha + e
        if ENTROPY:
            zp_acc = zp_acc * alpha + e * z
        m = m_new
        _store(t_row + cols, z - m_block, mask, ROUND)
        tl.store(off_row + start // BLOCK, m_block)
    alpha = tl.exp(m_start - m)
    tl.store(M + row, m)
    tl.store(S + row, tl.load(S + row) * alpha + tl.sum(s_acc, axis=0))
    if ENTROPY:
        tl.store(ZP + row, tl.load(ZP + row) * alpha + tl.sum(zp_acc, axis=0))


@triton.jit
def _shifted_grad_kernel(
    T, stride_t, Off, stride_off, n_cols, LSE, ENT, G_LP, G_ENT, Labels, ZY, logit_scale, softcap, inv_temperature,
    SOFTCAP: tl.constexpr, SCALED: tl.constexpr, HAS_G_ENT: tl.constexpr, LABEL: tl.constexpr, ROUND: tl.constexpr,
    LOG_TILE: tl.constexpr, BLOCK_V: tl.constexpr, OFF_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    t_row, off_row = T + row * stride_t, Off + row * stride_off
    lse, ent, g_lp, g_ent = tl.load(LSE + row), tl.load(ENT + row), tl.load(G_LP + row), tl.load(G_ENT + row)
    label, zy = -1, 0.0
    if LABEL:
        label, zy = tl.load(Labels + row), tl.load(ZY + row)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < n_cols
        z = tl.load(t_row + cols, mask=mask, other=1.0).to(tl.float32)
        if LOG_TILE:  # a stored exp(z − offset): 0 only far below the row's maximum, kept finite (p·(log p + H) = 0)
            z = tl.maximum(tl.log(z), _NO_MAX)
        z += tl.load(off_row + cols // OFF_BLOCK, mask=mask, other=0.0)
        is_label = cols == label
        if LABEL:  # the label's logit whole, in fp32
            z = tl.where(is_label, zy, z)
        # the soft-cap's tanh from the transformed logit z = softcap·tanh·(1/T)
        th = z / (softcap * inv_temperature)
        dz, _ = logit_grad(z, th, is_label, lse, ent, g_lp, g_ent, logit_scale, inv_temperature, SOFTCAP, SCALED,
                           True, HAS_G_ENT)
        _store(t_row + cols, dz, mask, ROUND)


@triton.jit
def _exp_tile_grad_kernel(
    T, stride_t, Off, stride_off, n_cols, LSE, G_LP, Labels, ZY, chain,
    LABEL: tl.constexpr, ROUND: tl.constexpr, BLOCK_V: tl.constexpr, OFF_BLOCK: tl.constexpr, VEC: tl.constexpr,
):
    # _shifted_grad_kernel's LOG_TILE case without entropy gradient or soft-cap, where p = E·exp(offset − lse) needs
    # no logarithm: one exp per VEC columns (a run within one shift's block) instead of a log and an exp per column
    row = tl.program_id(0).to(tl.int64)
    t_row, off_row = T + row * stride_t, Off + row * stride_off
    lse, g = tl.load(LSE + row), tl.load(G_LP + row) * chain
    label, dz_label = -1, 0.0
    if LABEL:  # the label's p from its fp32 logit
        label = tl.load(Labels + row)
        dz_label = g * (1.0 - tl.exp(tl.load(ZY + row) - lse))
    for start in range(0, n_cols, BLOCK_V):
        runs = start + tl.arange(0, BLOCK_V // VEC) * VEC
        factor = -g * tl.exp(tl.load(off_row + runs // OFF_BLOCK, mask=runs < n_cols, other=0.0) - lse)
        cols = runs[:, None] + tl.arange(0, VEC)[None, :]
        mask = cols < n_cols
        dz = tl.load(t_row + cols, mask=mask, other=0.0).to(tl.float32) * factor[:, None]
        if LABEL:
            dz = tl.where(cols == label, dz_label, dz)
        _store(t_row + cols, dz, mask, ROUND)


@triton.jit
def _exp_tile_row_factors_kernel(
    T, stride_t, Off, stride_off, n_cols, n_blocks, LSE, G_LP, Labels, ZY, S, chain,
    ROUND: tl.constexpr, OFF_BLOCK: tl.constexpr, BLOCK_COLS: tl.constexpr, BLOCK_T: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    t_row, off_row = T + row * stride_t, Off + row * stride_off
    m = _NO_MAX
    for start in range(0, n_blocks, BLOCK_T):
        b = start + tl.arange(0, BLOCK_T)
        m = tl.maximum(m, tl.max(tl.load(off_row + b, mask=b < n_blocks, other=_NO_MAX), axis=0))
    # blocks shifted less than the row's largest shift: rescaled to it by exact powers of two (none where every
    # block of the row kept its logits unshifted, as the windowed shifts do for logits within ±44 nats)
    for start in range(0, n_blocks, BLOCK_T):
        b = start + tl.arange(0, BLOCK_T)
        below = tl.sum((tl.load(off_row + b, mask=b < n_blocks, other=m) < m).to(tl.int32), axis=0)
        if below > 0:
            for j in range(0, BLOCK_T):
                blk = start + j
                if blk < n_blocks:
                    off = tl.load(off_row + blk)
                    if off < m:
                        k = tl.floor((off - m) * LOG2E + 0.5).to(tl.int32)  # an integer in exact math
                        factor = ((tl.maximum(k, -126) + 127) << 23).to(tl.float32, bitcast=True)
                        factor = tl.where(k < -126, 0.0, factor)  # below fp32's normal range of the row's maximum
                        cols = blk * OFF_BLOCK + tl.arange(0, BLOCK_COLS)
                        mask = tl.arange(0, BLOCK_COLS) < OFF_BLOCK
                        e = tl.load(t_row + cols, mask=mask, other=0.0).to(tl.float32)
                        _store(t_row + cols, e * factor, mask, ROUND)
                        tl.store(off_row + blk, m)
    g = tl.load(G_LP + row) * chain
    lse = tl.load(LSE + row)
    s = -g * tl.exp(m - lse)
    tl.store(S + row, s)
    label = tl.load(Labels + row)
    dz_label = g * (1.0 - tl.exp(tl.load(ZY + row) - lse))  # the label's p from its fp32 logit
    # every warp's rescaled values stored before the label's column is overwritten
    tl.debug_barrier()
    inside = (label >= 0) & (label < n_cols)
    _store(t_row + tl.where(inside, label, 0), tl.where(s != 0.0, dz_label / tl.where(s != 0.0, s, 1.0), 0.0),
           inside, ROUND)


def _chain(scalars: dict) -> float:
    """``∂z/∂raw`` of a transform without a soft-cap (:func:`~.tiles.kernel_scalars`): the logit scale over the
    temperature, a constant per call."""
    return scalars["inv_temperature"] * scalars["logit_scale"] if scalars["SCALED"] else 1.0


def exp_tile_row_factors_(tile: torch.Tensor, offsets: torch.Tensor, block: int, lse: torch.Tensor,
                          g_lp: torch.Tensor, scalars: dict, labels: torch.Tensor,
                          label_logit: torch.Tensor) -> torch.Tensor:
    """Make an exponential tile (``tile = exp(z − offsets)``, QuACK's scaled-exp matmul) a row-scaled logits
    gradient: afterwards ``dz = s[:, None]·tile`` (returned ``s``, fp32 ``[rows]``), so the hidden gradient is
    ``s·(tile @ W)`` and the weight gradient's update ``tileᵀ·(s·h)``: no pass over the tile writes ``dz``.

    Per row, with ``m`` its largest shift: blocks shifted less are rescaled to ``m`` by exact powers of two (and
    their ``offsets`` set to ``m``: the tile stays an exponential tile); ``s = −g·exp(m − lse)`` (``g`` =
    ``g_lp`` times the transform's chain factor: :func:`shifted_gradient_`'s ``∂L/∂z = g·(1[c = label] − p)``
    with ``p = tile·exp(m − lse)``); the label's column set to ``g·(1 − exp(label_logit − lse)) / s`` (its ``p`` from
    the fp32 logit; 0 where ``s`` is), rounded to the tile's dtype as ``dz`` would be. For a loss of the log-probs
    alone (no entropy gradient) and no soft-cap: ``shifted_gradient_``'s ``log_tile`` case otherwise.

    Args:
        tile: ``[rows, V]``, unit column stride, written.  offsets: fp32 ``[rows, V // block]``, written.
        block: the columns of one shift.  lse, g_lp, label_logit: fp32 ``[rows]``.  labels: int64 ``[rows]`` (a
            value outside ``[0, V)``: no label column).  scalars: :func:`~.tiles.kernel_scalars` (no soft-cap).

    Raises:
        ValueError: a soft-cap in ``scalars``, or ``block`` not dividing ``V``.
    """
    rows, vocab_size = tile.shape
    if scalars["SOFTCAP"]:
        raise ValueError("exp_tile_row_factors_: a soft-cap's derivative is per logit, not per row")
    if vocab_size != block * offsets.shape[1]:
        raise ValueError(f"exp_tile_row_factors_: {offsets.shape[1]} blocks of {block} columns are not V = {vocab_size}")
    s = torch.empty(rows, dtype=torch.float32, device=tile.device)
    if rows == 0:
        return s
    chain = _chain(scalars)
    n_blocks = offsets.shape[1]
    with kernel_device(tile):
        _exp_tile_row_factors_kernel[(rows,)](
            tile, tile.stride(0), offsets, offsets.stride(0), vocab_size, n_blocks, lse, g_lp, labels, label_logit,
            s, chain, ROUND=int(rounds_to_bf16(tile)), OFF_BLOCK=block, BLOCK_COLS=triton.next_power_of_2(block),
            BLOCK_T=min(2048, triton.next_power_of_2(n_blocks)), num_warps=4,
        )
    return s


@triton.jit
def _scaled_rows_kernel(X, stride_x, S, OUT, stride_out, n_cols, ROUND: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32) * tl.load(S + row)
    _store(OUT + row * stride_out + cols, x, mask, ROUND)


def scaled_rows_(out: torch.Tensor, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``out ← x · s[:, None]``, each product in fp32 rounded once to ``out``'s dtype (no fp32 copy of ``x``: the
    weight gradient's ``s·h`` beside :func:`exp_tile_row_factors_`); returns ``out``.

    Args:
        out: ``[rows, H]``, unit column stride, written.  x: ``[rows, H]``.  s: fp32 ``[rows]``.
    """
    rows, n_cols = x.shape
    x = x if x.stride(1) == 1 else x.contiguous()
    if rows and n_cols:
        block = min(1024, triton.next_power_of_2(n_cols))
        with kernel_device(x):
            _scaled_rows_kernel[(rows, triton.cdiv(n_cols, block))](
                x, x.stride(0), s, out, out.stride(0), n_cols, ROUND=int(rounds_to_bf16(out)), BLOCK=block,
                num_warps=4,
            )
    return out


def chunk_block(cols: int, vocab_size: int) -> int:
    """The shifts' block for vocabulary chunks of ``cols`` columns: ``BLOCK_V``, or, where the vocabulary has several
    chunks, the largest power of two dividing ``cols`` if that is smaller (chunks start on block boundaries)."""
    return BLOCK_V if cols >= vocab_size else min(BLOCK_V, cols & -cols)


def logits_chunk_(x: torch.Tensor, tile: torch.Tensor, offsets: torch.Tensor, col_offset: int, block: int,
                  bias: Optional[torch.Tensor], ids: torch.Tensor, row_stats, raw: torch.Tensor, scalars: dict,
                  entropy: bool) -> None:
    """Read the fp32 logits chunk ``x [rows, c]`` (columns ``[col_offset, col_offset + c)`` of the vocabulary, before
    bias and transform) once: fold it into ``row_stats``' running max, ``Σexp(z − max)`` and (``entropy``)
    ``Σexp(z − max)·z`` of the transformed logits ``z``; set ``raw[r, k]`` to the raw logit plus bias of each
    candidate ``ids[r, k]`` in the chunk (slots outside it untouched); write ``tile[r, j] = z − m_b`` in ``tile``'s
    dtype and ``offsets[r, b] = m_b``, ``m_b`` the maximum of the row's ``z`` over block ``b`` (``block`` columns of the
    whole vocabulary). ``tile`` may be ``x`` itself (an fp32 tile's columns): each block is read before it is written.

    Args:
        x: fp32 ``[rows, c]``, unit column stride.  tile: ``[rows, c]``, unit column stride (the tile's columns).
        offsets: fp32 ``[rows, ⌈V / block⌉]``.  col_offset: a multiple of ``block``.  bias: the whole ``[V]`` or None.
        ids: int64 ``[rows, K]`` in ``[0, V)``.  row_stats: :func:`~.tiles.new_row_stats` rows (the first three read).
        raw: fp32 ``[rows, K]`` contiguous.  scalars: :func:`~.tiles.kernel_scalars`.
    """
    rows, n_cols = x.shape
    if col_offset % block:
        raise ValueError(f"logits_chunk_: col_offset {col_offset} is not a multiple of the block {block}")
    if rows == 0 or n_cols == 0:
        return
    k = ids.shape[1]
    run_max, run_sum, run_zp = row_stats[:3]
    with kernel_device(x):
        _logits_chunk_kernel[(rows,)](
            x, x.stride(0), tile, tile.stride(0), offsets, offsets.stride(0), n_cols, col_offset,
            bias if bias is not None else run_max, run_max, run_sum, run_zp, ids, ids.stride(0), raw, k,
            ENTROPY=entropy, ROUND=int(rounds_to_bf16(tile)), BLOCK=block, BLOCK_K=candidate_block(k),
            num_warps=CHUNK_WARPS, **scalars,
        )


def shifted_gradient_(tile: torch.Tensor, offsets: torch.Tensor, block: int, lse: torch.Tensor, ent: torch.Tensor,
                      g_lp: torch.Tensor, g_ent: Optional[torch.Tensor], scalars: dict, *,
                      labels: Optional[torch.Tensor] = None, label_logit: Optional[torch.Tensor] = None,
                      log_tile: bool = False) -> None:
    """``tile [rows, V]`` (written shifted: :func:`logits_chunk_`, :func:`~.fused_matmul.logits_statistics_`) ←
    ``dz = ∂L/∂raw``: with ``z = tile + offsets`` the transformed logits (``log_tile``: ``z = log(tile) + offsets``,
    the tile a stored ``exp(z − offset)``: QuACK's scaled-exp matmul, :func:`~.quack_bridge.scaled_exp_tile_n`),
    ``log p = z − lse``, ``∂L/∂z = g_lp·(1[c = label] − p) − g_ent·p·(log p + H)``, then × 1/temperature,
    × (1 − tanh²) for the soft-cap, × logit_scale (:func:`~.triton_kernels.logit_grad`), rounded once to the tile's
    dtype. Without ``labels`` no column is the label's (the support pass sets its candidate columns afterwards,
    :func:`~.support_kernels.scatter_support_grad_`); with them, the label column's ``z`` is ``label_logit``, the
    fp32 logit itself.

    Args:
        tile: ``[rows, V]``, unit column stride.  offsets: fp32 ``[rows, ⌈V / block⌉]``.
        lse, ent, g_lp: fp32 ``[rows]`` (``ent`` read only with ``g_ent``).  g_ent: fp32 ``[rows]`` or None.
        scalars: :func:`~.tiles.kernel_scalars` (the bias flag is not read: the bias is in the tile).
        labels: int64 ``[rows]`` (any value outside ``[0, V)``: no label column) or None.
        label_logit: fp32 ``[rows]``, the transformed label logits (read where the label is a column), with
            ``labels``.
        log_tile: the tile holds ``exp(z − offsets)`` (a 0 there is a probability below fp32's range: no gradient);
            without ``g_ent`` or a soft-cap ``p = tile·exp(offsets − lse)``, one exponential per run of columns and
            no logarithm (the same fp32 value up to its last bits).
    """
    rows, vocab_size = tile.shape
    if rows == 0:
        return
    if (labels is None) != (label_logit is None):
        raise ValueError("shifted_gradient_: labels and label_logit come together; pass both or neither")
    if log_tile and g_ent is None and not scalars["SOFTCAP"] and block % _EXP_RUN == 0:
        chain = _chain(scalars)
        with kernel_device(tile):
            _exp_tile_grad_kernel[(rows,)](
                tile, tile.stride(0), offsets, offsets.stride(0), vocab_size, lse, g_lp,
                lse if labels is None else labels, lse if label_logit is None else label_logit, chain,
                LABEL=labels is not None, ROUND=int(rounds_to_bf16(tile)), BLOCK_V=GRAD_BLOCK_V, OFF_BLOCK=block,
                VEC=_EXP_RUN, num_warps=GRAD_WARPS,
            )
        return
    with kernel_device(tile):
        _shifted_grad_kernel[(rows,)](
            tile, tile.stride(0), offsets, offsets.stride(0), vocab_size, lse, ent, g_lp,
            lse if g_ent is None else g_ent, lse if labels is None else labels,
            lse if label_logit is None else label_logit, HAS_G_ENT=g_ent is not None, LABEL=labels is not None,
            ROUND=int(rounds_to_bf16(tile)), LOG_TILE=log_tile, BLOCK_V=GRAD_BLOCK_V, OFF_BLOCK=block,
            num_warps=GRAD_WARPS, **without_bias_flag(scalars),
        )


__all__ = ["BLOCK_V", "chunk_block", "exp_tile_row_factors_", "logits_chunk_", "scaled_rows_", "shifted_gradient_"]
