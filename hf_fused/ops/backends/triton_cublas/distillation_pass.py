"""The GPU backend's distillation pass: the contract of :func:`hf_fused.ops.distillation.distillation_pass` with
the per-tile elementwise work in Triton (:mod:`.distillation_kernels`) instead of PyTorch over fp32 ``[rows, V]``
buffers.

Per tile of kept token rows: both models' raw logits written in fp32 by cuBLAS from their operands (no fp32 copy
of a bf16 weight: :class:`~hf_fused.ops.distillation_tiles.TileHead`, the teacher's on its own device, then moved), the
kernels' two passes over both tiles for a KL (three for the JSD) giving each row's divergence and student entropy
and writing the student's logits gradient ``dz`` in the products' operand dtype (bf16 from bf16 products, fp32 from
the fp32 products of CPU or fp32 operands), then ``dh = dz·W_s`` and the weight gradient's accumulation (the one
pass's accumulators, :func:`~.one_pass.weight_accumulator`: for a bf16 gradient the fp32 accumulator split over the
gradient's own bytes and a buffer). A student bias's gradient sums the fp32 ``dz`` (a bf16 ``dz`` is then written in
fp32 over the student's logits first, and rounded after the sum).

The gradient matmuls take ``DZ_GROUP`` tiles' ``dz`` at once (their rows are the weight-gradient accumulation's K:
the fewer the calls, the fewer reads and writes of its fp32 ``[V, H]`` accumulator). Tile rows
(:func:`distillation_tile_rows`): per row the two fp32 logits rows and ``DZ_GROUP`` ``dz`` rows (12 bytes per
vocabulary column in bf16, against the plain-PyTorch pass's 24). Under the default rule on CUDA
``DISTILLATION_TILE_ROWS`` rows when the working set fits in ``ONE_PASS_FREE_SHARE`` of the free memory; an explicit
``tile_budget_bytes`` bounds the tile arrays, as for the plain-PyTorch pass.

fp16 operands run the plain-PyTorch pass (:func:`runs_triton_pass`): its fp32-copy products keep ``dz`` in fp32
(:mod:`hf_fused.ops.distillation`'s module docstring).
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional, Union

import torch

from ...distillation_tiles import DistillationPass, TileHead
from ...grads import HeadGrads
from ...head_inputs import HeadInputs, NeededGrads
from ...logit_transform import LogitTransform
from ...tiling import DEFAULT_TILE_BUDGET_BYTES, check_tile_budget
from . import distillation_kernels as kernels
from .one_pass import weight_accumulator
from .one_pass_hidden import HiddenGradient
from .one_pass_rule import (ACCUMULATOR_BYTES, ONE_PASS_FREE_SHARE, OnePassPlan, free_device_bytes,
                            hidden_gradient_bytes, hidden_gradient_row_bytes,
                            one_pass_accumulators)
from .scaled_round import mul_into

#: Rows per tile under the default rule on CUDA (balanced: :func:`balanced_rows`).
DISTILLATION_TILE_ROWS = 1024
#: Tiles whose bf16 ``dz`` the gradient matmuls take at once: the weight gradient's accumulation GEMM has
#: K = their rows, and reads and writes the fp32 ``[V, H]`` accumulator once per group (0.44 ms of the 1.29 ms a
#: 1024-row, 151,936 × 2048 accumulation took on an H200, docs/performance.md, 2026-11-29). Per row and vocabulary
#: column, the tiles hold 8 bytes of fp32 logits and the group ``DZ_GROUP`` elements of ``dz``.
DZ_GROUP = 2


class KernelLaunch(NamedTuple):
    """One epilogue kernel's launch shape: ``block_v`` columns per block (a multiple of 4), ``warps`` per program,
    and each row split into ``chunks`` column chunks of whole blocks (programs per row; fewer where the vocabulary
    has fewer blocks)."""

    block_v: int
    warps: int
    chunks: int = 1


class EpilogueLaunch(NamedTuple):
    """The tile epilogue's launch shapes (:func:`distillation_tile`): its statistics, JSD sums and gradient
    kernels', and ``rows``: token rows per launch group, each group's kernels launched in turn (0: the whole tile
    at once). Groups small enough for the GPU's L2 cache let the second and third passes over a row read it there,
    at the cost of more, smaller launches."""

    stats: KernelLaunch
    sums: KernelLaunch
    grad: KernelLaunch
    rows: int = 0


#: The launch shapes :func:`distillation_tile` takes unless given others: the statistics kernel one program per row
#: (lanes of 4 fp32 columns, 1024 columns per block), the JSD sums 8 and the gradient kernel 16 column chunks per
#: row. On an H200 (2026-11-29), per 1024-row tile of the distill benchmark with a bf16 ``dz``: the JSD's epilogue
#: 0.96 ms against 1.07 ms with one program per row for every kernel, the KLs' 0.67 ms either way; each kernel
#: reads its tiles at 4.0–4.2 TB/s (the JSD's three reads of two fp32 tiles: its floor).
EPILOGUE_LAUNCH = EpilogueLaunch(KernelLaunch(1024, 4), KernelLaunch(1024, 4, 8), KernelLaunch(2048, 4, 16))

_NO_GRADS = NeededGrads(False, False, False)


def runs_triton_pass(student: HeadInputs) -> bool:
    """Whether :func:`run_distillation_pass` takes this call (else the plain-PyTorch pass): every operand dtype but
    fp16, whose ``dz`` stays fp32 there anyway (no bf16 products to feed)."""
    return student.operand_dtype != torch.float16


class TileStats(NamedTuple):
    """What :func:`distillation_tile` computes for ``r`` rows: fp32 ``[r]`` divergence and student entropy."""

    divergence: torch.Tensor
    entropy: torch.Tensor


def _scalars(student: LogitTransform, teacher: LogitTransform, student_bias, teacher_bias) -> dict:
    """Both models' logit transforms as the kernels' scalar arguments and compile-time flags."""
    out = {}
    for tag, transform, bias in (("S", student, student_bias), ("T", teacher, teacher_bias)):
        scale, temperature = float(transform.logit_scale), float(transform.temperature)
        low = tag.lower()
        out.update({
            f"{low}_scale": scale, f"{low}_cap": float(transform.softcap or 1.0), f"{low}_inv_t": 1.0 / temperature,
            f"HAS_BIAS_{tag}": bias is not None, f"SOFTCAP_{tag}": transform.softcap is not None,
            f"SCALED_{tag}": scale != 1.0 or temperature != 1.0,
        })
    return out


def _mode(beta: float) -> int:
    return kernels.FORWARD_KL if beta == 0.0 else kernels.REVERSE_KL if beta == 1.0 else kernels.JSD


def _row_values(values: Union[float, torch.Tensor], rows: int, device: torch.device) -> torch.Tensor:
    """fp32 ``[rows]`` on ``device`` (any stride) from a number (filled on the device: a Python number copied from
    the host would wait for the queue), a 0-d tensor (expanded) or ``[rows]`` values."""
    if not isinstance(values, torch.Tensor):
        return torch.full((rows,), float(values), dtype=torch.float32, device=device)
    values = values.to(device=device, dtype=torch.float32)
    return values.expand(rows) if values.dim() == 0 else values


def _chunking(n_cols: int, launch: KernelLaunch) -> tuple:
    """``(columns per chunk, chunks, the power of two ≥ chunks that the readers' loads span)`` of a row of
    ``n_cols`` columns under ``launch``: chunks of whole blocks, none empty."""
    per_chunk = -(-n_cols // max(1, launch.chunks))
    chunk_cols = -(-per_chunk // launch.block_v) * launch.block_v
    chunks = -(-n_cols // chunk_cols)
    return chunk_cols, chunks, max(2, 1 << (chunks - 1).bit_length())


def distillation_tile(
    zs: torch.Tensor, zt: torch.Tensor, beta: float, student: LogitTransform, teacher: LogitTransform, *,
    student_bias: Optional[torch.Tensor] = None, teacher_bias: Optional[torch.Tensor] = None,
    dz: Optional[torch.Tensor] = None, row_grads: Union[None, float, torch.Tensor] = None,
    out: Optional[TileStats] = None, launch: Optional[EpilogueLaunch] = None,
) -> TileStats:
    """The distillation epilogue of one tile (:mod:`.distillation_kernels`).

    Args:
        zs, zt: fp32 ``[r, V]`` raw logits rows of the student and the teacher (matmul outputs without bias), on one
            device (CUDA, or CPU under ``TRITON_INTERPRET=1``), unit column stride; read only, unless ``dz`` is
            ``zs``.
        beta: in ``[0, 1]`` (0 forward KL, 1 reverse KL, else the generalized JSD).
        student, teacher: each model's logit transform (scale, soft-cap, temperature).
        student_bias, teacher_bias: fp32 ``[V]`` or ``None``, added to the raw logits in the kernels.
        dz: ``[r, V]`` (bf16 or fp32, unit column stride, may be ``zs`` itself) to receive
            ``row_grads · ∂D/∂(raw student logits)``; ``None``: the divergence and entropy only.
        row_grads: with ``dz``: a number or 0-d tensor for every row, or fp32 ``[r]``.
        out: fp32 ``[r]`` buffers to write the result into (else new ones).
        launch: the kernels' launch shapes (default :data:`EPILOGUE_LAUNCH`); the same results up to the fp32
            rounding of sums taken in another order.

    Returns:
        :class:`TileStats` (``out`` when given).
    """
    rows, n_cols = zs.shape
    device = zs.device
    f32 = dict(dtype=torch.float32, device=device)
    if out is None:
        out = TileStats(torch.empty(rows, **f32), torch.empty(rows, **f32))
    if rows == 0:
        return out
    launch = EPILOGUE_LAUNCH if launch is None else launch
    scal = _scalars(student, teacher, student_bias, teacher_bias)
    mode = _mode(beta)
    mixture = dict(beta=float(beta), one_m_beta=1.0 - float(beta))
    s_cols, s_chunks, s_pow = _chunking(n_cols, launch.stats)
    part = torch.empty((rows, s_chunks, kernels.STATS_FIELDS), **f32)
    jsd = mode == kernels.JSD
    j_cols, j_chunks, j_pow = _chunking(n_cols, launch.sums) if jsd else (n_cols, 1, 2)
    sums = torch.empty((rows, j_chunks, kernels.SUMS_FIELDS), **f32) if jsd else part  # else never read
    g_cols, g_chunks, _ = _chunking(n_cols, launch.grad)
    bias_s = student_bias if student_bias is not None else part  # any valid pointer, never read
    bias_t = teacher_bias if teacher_bias is not None else part
    compiled = zs.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"  # else Triton's interpreter
    if dz is not None:
        g = _row_values(1.0 if row_grads is None else row_grads, rows, device)
    group = launch.rows if launch.rows > 0 else rows
    for r0 in range(0, rows, group):
        r1 = min(r0 + group, rows)
        r = r1 - r0
        tiles = (zs[r0:r1], zs.stride(0), zt[r0:r1], zt.stride(0))
        stats = (part[r0:r1], part.stride(0), s_chunks)
        kernels.stats_kernel[(r, s_chunks)](*tiles, n_cols, s_cols, bias_s, bias_t, *stats[:2], MODE=mode,
                                            BLOCK_V=launch.stats.block_v, num_warps=launch.stats.warps, **scal)
        if jsd:
            kernels.jsd_sums_kernel[(r, j_chunks)](*tiles, n_cols, j_cols, bias_s, bias_t, *stats, sums[r0:r1],
                                                   sums.stride(0), COMPILED=compiled, STATS_CHUNKS=s_pow,
                                                   BLOCK_V=launch.sums.block_v,
                                                   num_warps=launch.sums.warps, **mixture, **scal)
        if dz is not None:
            kernels.grad_kernel[(r, g_chunks)](*tiles, dz[r0:r1], dz.stride(0), n_cols, g_cols, bias_s, bias_t,
                                               *stats, sums[r0:r1], sums.stride(0), j_chunks, g[r0:r1],
                                               g.stride(0), MODE=mode, STATS_CHUNKS=s_pow, SUMS_CHUNKS=j_pow,
                                               BLOCK_V=launch.grad.block_v, num_warps=launch.grad.warps,
                                               DZ_BF16=dz.dtype == torch.bfloat16, COMPILED=compiled, **mixture,
                                               **scal)
    kernels.finish_kernel[(rows,)](part, part.stride(0), s_chunks, sums, sums.stride(0), j_chunks, out.divergence,
                                   out.entropy, MODE=mode, STATS_CHUNKS=s_pow, SUMS_CHUNKS=j_pow, **mixture)
    return out


def distillation_tile_rows(student: TileHead, need: NeededGrads, dz_bytes: int) -> int:
    """Token rows per tile (module docstring): per row two fp32 logits rows and a ``dz_bytes``-byte ``dz`` row
    of ``V`` columns.

    Raises:
        ValueError: if an explicit budget is not a positive integer.
    """
    head = student.head
    vocab_size, hidden_size = head.weight.shape
    col_bytes = 8 + dz_bytes
    if head.tile_budget_bytes is None:
        free = free_device_bytes(head.weight.device)
        if free is not None:
            accumulator = one_pass_accumulators(need.weight, head.weight_gradient_dtype,
                                                head.weight.dtype)[0]
            working = (vocab_size * hidden_size * ACCUMULATOR_BYTES[accumulator]
                       + DISTILLATION_TILE_ROWS * vocab_size * col_bytes
                       + (_hidden_gradient_bytes(head) if need.hidden else 0))
            if working <= ONE_PASS_FREE_SHARE * free:
                return DISTILLATION_TILE_ROWS
    budget = DEFAULT_TILE_BUDGET_BYTES if head.tile_budget_bytes is None else check_tile_budget(head.tile_budget_bytes)
    return max(1, budget // (vocab_size * col_bytes))


def _hidden_gradient_bytes(head: HeadInputs) -> int:
    """What the hidden-state gradient holds (:class:`~.one_pass_hidden.HiddenGradient`): the gradient and, beside
    each tile group's rows, the fp32 buffer its product passes through."""
    dtype, hidden_size = head.hidden_gradient_dtype, head.weight.shape[1]
    return (hidden_gradient_bytes(dtype, head.hidden.shape[0], head.rows.numel(), hidden_size)
            + DZ_GROUP * DISTILLATION_TILE_ROWS * hidden_gradient_row_bytes(dtype, hidden_size))


def balanced_rows(m: int, rows: int) -> int:
    """Rows per tile for ``m`` rows in tiles of at most ``rows``: as many tiles as ``rows`` needs, of equal size (a
    multiple of 8 where that stays within ``rows``), so that the last tile is not a small remainder whose matmuls
    run at a fraction of their speed."""
    if m <= rows:
        return max(rows if m == 0 else m, 1)
    even = -(-m // -(-m // rows))
    aligned = -(-even // 8) * 8
    return aligned if aligned <= rows else even


def run_distillation_pass(
    student: HeadInputs,
    teacher: HeadInputs,
    beta: float,
    *,
    row_grads: Union[None, float, torch.Tensor] = None,
    need: NeededGrads = _NO_GRADS,
) -> DistillationPass:
    """:func:`hf_fused.ops.distillation.distillation_pass`'s contract (same arguments, same results up to fp32
    rounding) with the tile epilogue in Triton (module docstring)."""
    s, t = TileHead.of(student), TileHead.of(teacher)
    head = s.head
    device = head.hidden.device
    m, vocab_size = head.rows.numel(), s.weight.shape[0]
    with_grads = row_grads is not None and need.any
    # dz in the products' operand dtype (bf16 from bf16 products, else fp32), DZ_GROUP tiles of it for the gradient
    # matmuls; a bf16 dz whose bias gradient sums the fp32 values is first written over the student's logits
    dz_dtype = s.weight.dtype if s.half else torch.float32
    dz_bytes = DZ_GROUP * dz_dtype.itemsize if with_grads else 0
    step = balanced_rows(m, distillation_tile_rows(s, need if with_grads else _NO_GRADS, dz_bytes))
    cap = min(step, max(m, 1))
    f32 = dict(dtype=torch.float32, device=device)
    divergence, entropy = torch.empty(m, **f32), torch.empty(m, **f32)
    zs_buf, zt_buf = torch.empty((cap, vocab_size), **f32), torch.empty((cap, vocab_size), **f32)
    t_device = t.weight.device
    zt_far = None if t_device == device else torch.empty((cap, vocab_size), dtype=torch.float32, device=t_device)
    dz_buf = torch.empty((DZ_GROUP * cap, vocab_size), dtype=dz_dtype, device=device) if with_grads else None
    t_bias = None if t.bias is None else t.bias.to(device)

    grads = d_weight = d_hidden = None
    g_rows = None
    if with_grads:
        grads = HeadGrads(mul_into=mul_into)
        d_weight = weight_accumulator(OnePassPlan(step, "fp32", 0), head, need, grads)
        d_hidden = HiddenGradient(head) if need.hidden else None
        if need.bias:
            grads.bias = torch.zeros(vocab_size, **f32)
        g_rows = _row_values(row_grads, m, device)
    block = start_of_block = 0  # tiles whose dz waits in dz_buf, from row start_of_block
    for start in range(0, m, step):
        stop = min(start + step, m)
        r = stop - start
        zs = zs_buf[:r]
        h = s.raw_into(start, stop, zs)
        with torch.no_grad():  # the teacher gets no gradient; only its logits' values travel
            if zt_far is None:
                t.raw_into(start, stop, zt_buf[:r])
            else:
                t.raw_into(start, stop, zt_far[:r])
                zt_buf[:r].copy_(zt_far[:r])
        dz = slot = None
        if with_grads:
            slot = dz_buf[start - start_of_block : stop - start_of_block]
            dz = zs if need.bias and dz_dtype != torch.float32 else slot
        distillation_tile(zs, zt_buf[:r], beta, head.transform, t.head.transform, student_bias=s.bias,
                          teacher_bias=t_bias, dz=dz, row_grads=None if g_rows is None else g_rows[start:stop],
                          out=TileStats(divergence[start:stop], entropy[start:stop]))
        if not with_grads:
            continue
        if need.bias:
            grads.bias += dz.sum(0)  # the fp32 dz, before its rounding
            if dz is not slot:
                slot.copy_(dz)
        block += 1
        if block < DZ_GROUP and stop < m:
            continue  # the gradient matmuls wait for the group's next tile
        dz = dz_buf[: stop - start_of_block]
        if d_hidden is not None:  # each row's dh is complete within its group
            d_hidden.add(start_of_block, stop, dz, s.weight)
        if d_weight is not None:
            d_weight.add(start_of_block, dz, h if block == 1 else s.rows(start_of_block, stop))
        block, start_of_block = 0, stop
    if grads is not None:
        if d_hidden is not None:
            d_hidden.finish(grads)
        if d_weight is not None:
            d_weight.finish(grads)
    return DistillationPass(divergence, entropy, grads)
