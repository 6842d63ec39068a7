"""The two passes (8·M·H·V FLOPs): vocabulary chunks outside, one ``[rows, cols]`` tile; the memory-lean path.

The statistics pass (``2·M·H·V``) folds each chunk's logits into running per-row statistics; the gradient pass
recomputes each tile and turns it into ``dz`` (``2·M·H·V``), then ``dX`` and ``dW`` (``2·M·H·V`` each), on the
kept rows only. Each chunk's weight gradient is complete after its chunk (:mod:`.weight_chunks`); the hidden
gradient adds up across chunks. Where the plan takes the logits from the fp32 accumulator
(:func:`~.plan.fp32_logits`), the statistics pass is the matmul with the statistics in its epilogue
(:mod:`.fused_matmul`, whole vocabulary rows, no tile) and ``dz`` is computed from the accumulator, unrounded. What
varies per call is chosen once, before the loop: who writes each ``dz`` tile
(:func:`dz_writer`: QuACK's or the Triton matmul's epilogue, or cuBLAS and the gradient kernel), how the hidden
gradient accumulates (:func:`hidden_accumulator`: an fp32 buffer or the compensated pair) and where each chunk's
weight gradient adds up (:class:`WeightChunkGradient`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ...grads import HeadGrads
from ...head_inputs import HeadInputs, NeededGrads
from ..protocol import HeadPass
from . import fp32_logits_rule, fused_matmul, logits_epilogues, quack_bridge
from .compensated import RESIDUAL_DTYPE, compensated_addmm_
from .matmul import mm_f32_
from .operands import operand_bias, row_blocks, rows_source, weight_chunk_buffer
from .plan import GradientPassPlan, fp32_logits, plan_fp32_statistics_pass, plan_gradient_pass, plan_statistics_pass
from .scaled_round import mul_into
from .tiles import finish_row_stats, gradient_tile, kernel_scalars, new_row_stats, row_slice, statistics_tile
from .weight_chunks import WeightChunk, chunk_buffers, round_chunk_into_, weight_gradient_chunks


def run_statistics_pass(head: HeadInputs, return_entropy: bool, statistics: Sequence[str]) -> HeadPass:
    """:meth:`~.backend.TritonCublasBackend.logprobs_forward`: per vocabulary chunk and row block, cuBLAS's logits
    tile folded into the rows' running statistics (the token statistics are online reductions across chunks like
    the log-sum-exp); or, where :func:`~.plan.fp32_logits`, :func:`run_fp32_statistics_pass`."""
    if fp32_logits(head, "two_passes"):
        return run_fp32_statistics_pass(head, return_entropy, statistics)
    weight, bias, dtype = head.weight, operand_bias(head), head.operand_dtype
    plan = plan_statistics_pass(head)
    h, buf, y = rows_source(head, plan)
    m_rows, vocab_size = head.rows.numel(), weight.shape[0]
    stats = new_row_stats(m_rows, weight.device, statistics)
    scalars = kernel_scalars(head.transform, bias)
    tile_buf = torch.empty((plan.block_rows, plan.cols), dtype=dtype, device=weight.device)
    w_buf = weight_chunk_buffer(head, plan.cols)
    for v0 in range(0, vocab_size, plan.cols):
        w_chunk = head.weight_rows(v0, min(v0 + plan.cols, vocab_size), w_buf)
        for r0, r1, h_rows in row_blocks(head, plan, h, buf):
            z = torch.mm(h_rows, w_chunk.t(), out=tile_buf[: r1 - r0, : w_chunk.shape[0]])
            statistics_tile(z, v0, bias, y[r0:r1], row_slice(stats, r0, r1), scalars, return_entropy)
    logp, entropy, lse, token_stats = finish_row_stats(stats, y, vocab_size, return_entropy, statistics)
    return HeadPass(logp, entropy, lse, None, token_stats)


def run_fp32_statistics_pass(head: HeadInputs, return_entropy: bool, statistics: Sequence[str]) -> HeadPass:
    """The statistics pass from the logits matmul's fp32 accumulator: per row block of
    :func:`~.plan.plan_fp32_statistics_pass` (whole vocabulary rows), QuACK's scaled-exp matmul with nothing stored
    (:func:`~.quack_bridge.scaled_exp_row_stats_`, where :func:`~.quack_bridge.scaled_exp_tile_n` gives its column
    tile) or :func:`~.fused_matmul.logits_statistics_` gives the rows' statistics; no logits tile is stored."""
    weight, bias = head.weight, operand_bias(head)
    m_rows, vocab_size = head.rows.numel(), weight.shape[0]
    plan = plan_fp32_statistics_pass(head, 2 + return_entropy + len(statistics), return_entropy)
    h, buf, y = rows_source(head, plan)
    if h is not None and not fp32_logits_rule.readable(h, weight):  # hidden itself, strided or off 16-byte alignment
        h = h.clone(memory_format=torch.contiguous_format)
    stats = new_row_stats(m_rows, weight.device, statistics)
    scalars = kernel_scalars(head.transform, bias)
    tile_n = quack_bridge.scaled_exp_tile_n(head, h if buf is None else buf, statistics, "two_passes_quack")
    scale = quack_bridge.logits_scale(head) if tile_n else 1.0
    for r0, r1, h_rows in row_blocks(head, plan, h, buf):
        block = row_slice(stats, r0, r1)
        if tile_n is None or not quack_bridge.scaled_exp_row_stats_(h_rows, weight, y[r0:r1], block, tile_n,
                                                                    return_entropy, scale):
            fused_matmul.logits_statistics_(h_rows, weight, y[r0:r1], block, scalars, return_entropy=return_entropy,
                                            bias=bias)
    logp, entropy, lse, token_stats = finish_row_stats(stats, y, vocab_size, return_entropy, statistics)
    return HeadPass(logp, entropy, lse, None, token_stats)


# -- the hidden-state gradient across vocabulary chunks -------------------------------------------------------


class Fp32HiddenAccumulator:
    """An fp32 ``[M, H]`` buffer in the order of the kept rows, written by the first chunk and added to by the others
    (:func:`~.quack_bridge.matmul_f32_`: QuACK's matmul where it runs, else cuBLAS)."""

    def __init__(self, m_rows: int, hidden_size: int, device: torch.device) -> None:
        self.acc = torch.empty((m_rows, hidden_size), dtype=torch.float32, device=device)

    def add(self, v0: int, r0: int, r1: int, dz: torch.Tensor, w_chunk: torch.Tensor) -> None:
        quack_bridge.matmul_f32_(self.acc[r0:r1], dz, w_chunk, accumulate=v0 > 0)

    def finish(self, grads: HeadGrads) -> None:
        grads.hidden = self.acc


class PairHiddenAccumulator:
    """The compensated pair whose ``hi`` is hidden's whole bf16 gradient and whose int8 residual covers the kept rows:
    only the residual is extra (:mod:`.compensated`). Where some rows are ignored, the Triton fold writes the kept rows
    where they belong (``hi_rows``); where QuACK folds (:func:`~.quack_bridge.folds_pairs`: its tile loads cannot
    gather rows), the kept rows' sums sit compact in ``hi``'s first rows, moved where they belong at the end
    (:func:`move_compact_rows_`)."""

    def __init__(self, head: HeadInputs) -> None:
        hidden, m_rows = head.hidden, head.rows.numel()
        self.hi = torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device)
        self.lo = torch.zeros((m_rows, hidden.shape[1]), dtype=RESIDUAL_DTYPE, device=hidden.device)
        self.rows = head.rows if m_rows != hidden.shape[0] else None
        self.compact = self.rows is None or quack_bridge.folds_pairs(hidden.device)

    def add(self, v0: int, r0: int, r1: int, dz: torch.Tensor, w_chunk: torch.Tensor) -> None:
        if not self.compact:
            compensated_addmm_(self.hi, self.lo[r0:r1], dz, w_chunk, hi_rows=self.rows[r0:r1])
        else:
            quack_bridge.pair_addmm_(self.hi[r0:r1], self.lo[r0:r1], dz, w_chunk)

    def finish(self, grads: HeadGrads) -> None:
        if self.compact and self.rows is not None:
            move_compact_rows_(self.hi, self.rows, self.lo)
        grads.hidden, grads.hidden_scattered = self.hi, True


def move_compact_rows_(out: torch.Tensor, rows: torch.Tensor, scratch: torch.Tensor) -> None:
    """Row ``i`` of ``out`` to row ``rows[i]`` for every ``i < len(rows)``, the other rows of ``out`` zeroed, in place.

    ``rows`` ascending and distinct, so ``rows[i] ≥ i``: blocks of rows are moved from the last down, each copied out
    first (into ``scratch``'s bytes, which must not be needed any more: the pair's residual; one row allocated where
    they hold none), so that no block overwrites a row not yet moved.

    Args:
        out: ``[N, H]``, contiguous; its first ``M = len(rows)`` rows are moved.  rows: ``[M]`` int64, ascending.
        scratch: a contiguous tensor on ``out``'s device, overwritten.
    """
    m, row_bytes = rows.numel(), out.shape[1] * out.element_size()
    spare = scratch.view(-1).view(torch.uint8)
    block = spare.numel() // row_bytes
    if block:
        temp = spare[: block * row_bytes].view(out.dtype).view(block, out.shape[1])
    else:  # a residual of one int8 row holds no bf16 row
        block, temp = 1, out.new_empty((1, out.shape[1]))
    for end in range(m, 0, -block):
        start = max(0, end - block)
        temp[: end - start].copy_(out[start:end])
        out.index_copy_(0, rows[start:end], temp[: end - start])
    kept = torch.zeros(out.shape[0], dtype=torch.bool, device=out.device)
    kept[rows] = True
    out.masked_fill_(~kept[:, None], 0)


def hidden_accumulator(head: HeadInputs, plan: GradientPassPlan, need: NeededGrads):
    """The hidden gradient's accumulator for ``plan`` (``None`` without a hidden gradient)."""
    if plan.pair:
        return PairHiddenAccumulator(head)
    if need.hidden:
        return Fp32HiddenAccumulator(head.rows.numel(), head.hidden.shape[1], head.hidden.device)
    return None


# -- who writes each dz tile ----------------------------------------------------------------------------------


class CublasDz:
    """cuBLAS writes the logits tile (rounded to the operands' dtype, as eager's), then the gradient kernel
    overwrites it with ``dz``."""

    def __init__(self, bias, y, lse, ent, g_lp, g_ent, scalars: dict, has_g_lp: bool, has_g_ent: bool) -> None:
        self.bias, self.y, self.lse, self.ent, self.g_lp, self.g_ent = bias, y, lse, ent, g_lp, g_ent
        self.scalars, self.has_g_lp, self.has_g_ent = scalars, has_g_lp, has_g_ent

    def __call__(self, h_rows, w_chunk, dz, v0: int, r0: int, r1: int) -> None:
        torch.mm(h_rows, w_chunk.t(), out=dz)
        gradient_tile(dz, v0, self.bias, self.y[r0:r1], self.lse[r0:r1], self.ent[r0:r1], self.g_lp[r0:r1],
                      self.g_ent[r0:r1], self.scalars, self.has_g_lp, self.has_g_ent)


class EpilogueDz(CublasDz):
    """``dz`` from the Triton logits matmul's epilogue (:func:`~.logits_epilogues.logits_grad_`): the logits are
    never stored. ``round_logits``: from each logit rounded as cuBLAS's tile holds it (statistics from such tiles),
    or ``False``, from the fp32 accumulator (statistics from it)."""

    round_logits = True

    def __call__(self, h_rows, w_chunk, dz, v0: int, r0: int, r1: int) -> None:
        logits_epilogues.logits_grad_(
            h_rows, w_chunk, dz, self.y[r0:r1], self.lse[r0:r1], self.ent[r0:r1], self.g_lp[r0:r1],
            self.g_ent[r0:r1], has_g_lp=self.has_g_lp, has_g_ent=self.has_g_ent, col_offset=v0, bias=self.bias,
            scalars=self.scalars, round_logits=self.round_logits,
        )


class QuackDz:
    """``dz`` from QuACK's matmul epilogue (``−g_lp·p``), the label column set afterwards
    (:func:`~.logits_epilogues.label_grad_`): the Triton epilogue's bits in 16 % less time per tile on an H200, of
    the bf16 logits or the fp32 accumulator as ``fallback.round_logits`` says; a tile QuACK does not take goes to
    ``fallback``. Logits ``z = acc·logit_scale`` (from the accumulator only): ``dz`` is the matmul output's,
    ``logit_scale·g_lp·(onehot − p)``."""

    def __init__(self, fallback: EpilogueDz, block_rows: int, logit_scale: float = 1.0) -> None:
        self.fallback, self.logit_scale = fallback, logit_scale
        # z = acc·logit_scale: its chain factor in the per-row factor, dz = −g_lp·logit_scale·p off the label
        self.g_lp = fallback.g_lp if logit_scale == 1.0 else fallback.g_lp * logit_scale
        self.neg_g_lp = self.g_lp.neg()
        self.label_logit = torch.empty(block_rows, dtype=torch.float32, device=fallback.g_lp.device)

    def __call__(self, h_rows, w_chunk, dz, v0: int, r0: int, r1: int) -> None:
        f = self.fallback
        if quack_bridge.softmax_grad(h_rows, w_chunk, f.y[r0:r1] - v0, f.lse[r0:r1], self.neg_g_lp[r0:r1], dz,
                                     self.label_logit[: r1 - r0], round_logits=f.round_logits,
                                     logit_scale=self.logit_scale):
            logits_epilogues.label_grad_(dz, f.y[r0:r1], self.label_logit, f.lse[r0:r1], self.g_lp[r0:r1],
                                         col_offset=v0)
        else:
            f(h_rows, w_chunk, dz, v0, r0, r1)


def dz_writer(head: HeadInputs, rows_operand, w_like, tile_buf, cublas: CublasDz):
    """Who writes the call's ``dz`` tiles: where the statistics came from the fp32 accumulator
    (:func:`~.plan.fp32_logits`), from the unrounded accumulator, QuACK's epilogue where it runs, is asked for
    (``"two_passes_quack"``) and the gradient is the log-probs' alone, else the Triton matmul's epilogue; otherwise
    QuACK's epilogue of the bf16 logits where it runs and the gradient is the log-probs' alone, else the Triton
    matmul's epilogue where it applies (:func:`~.logits_epilogues.applies`), else ``cublas``."""
    epilogue = EpilogueDz(cublas.bias, cublas.y, cublas.lse, cublas.ent, cublas.g_lp, cublas.g_ent, cublas.scalars,
                          cublas.has_g_lp, cublas.has_g_ent)
    if (fp32_logits(head, "two_passes") and fp32_logits_rule.readable(rows_operand, w_like)
            and tile_buf.dtype == w_like.dtype and tile_buf.stride(-1) == 1):
        epilogue.round_logits = False
        if quack_bridge.fuses_softmax_grad(head, rows_operand, w_like, cublas.has_g_lp, cublas.has_g_ent,
                                           from_accumulator=True):
            return QuackDz(epilogue, tile_buf.shape[0], quack_bridge.logits_scale(head))
        return epilogue
    if not logits_epilogues.applies(rows_operand, w_like, tile_buf):
        return cublas
    if quack_bridge.fuses_softmax_grad(head, rows_operand, w_like, cublas.has_g_lp, cublas.has_g_ent):
        return QuackDz(epilogue, tile_buf.shape[0])
    return epilogue


# -- where each chunk's weight gradient adds up ---------------------------------------------------------------


class WeightChunkGradient:
    """Each vocabulary chunk's weight gradient over the row blocks: into its fp32 accumulator (in the gradient's
    unwritten rows, the tile, or a buffer: :func:`~.weight_chunks.chunk_buffers`), rounded once at the chunk's
    end; or, with one row block, one matmul straight into the gradient's rows (fp32 from cuBLAS for an fp32
    gradient)."""

    def __init__(self, grads: HeadGrads, need_weight: bool, operand_dtype: torch.dtype, tile_buf: torch.Tensor,
                 hidden_size: int, several_blocks: bool) -> None:
        self.grads, self.need_weight, self.dtype, self.tile_buf = grads, need_weight, operand_dtype, tile_buf
        self.hidden_size, self.several_blocks = hidden_size, several_blocks

    def start(self, chunk: WeightChunk) -> torch.Tensor:
        """The chunk's tile view (where its ``dz`` goes); sets up its accumulator."""
        self.chunk = chunk
        tile, self.acc = chunk_buffers(chunk, self.tile_buf, self.grads.weight, self.hidden_size, self.several_blocks)
        return tile

    def add(self, r0: int, dz: torch.Tensor, h_rows: torch.Tensor) -> None:
        if self.acc is not None:
            quack_bridge.matmul_f32_(self.acc, dz.t(), h_rows, accumulate=r0 > 0)
        elif self.need_weight:
            out = self.grads.weight[self.chunk.v0 : self.chunk.v1]
            if out.dtype == self.dtype:
                torch.mm(dz.t(), h_rows, out=out)
            else:
                mm_f32_(out, dz.t(), h_rows)

    def finish_chunk(self) -> None:
        if self.acc is not None:
            round_chunk_into_(self.grads.weight, self.chunk, self.acc, self.tile_buf)


def run_gradient_pass(head: HeadInputs, lse: torch.Tensor, entropy: Optional[torch.Tensor],
                      grad_logprobs: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor],
                      need: NeededGrads) -> HeadGrads:
    """:meth:`~.backend.TritonCublasBackend.logprobs_backward`: per vocabulary chunk (:mod:`.weight_chunks`) and
    row block, ``dz`` of the recomputed tile, added into the hidden gradient and the chunk's weight gradient."""
    weight, bias = head.weight, operand_bias(head)
    dtype = head.operand_dtype  # the matmuls' operands: a weight in another dtype is cast chunk by chunk
    m_rows, (vocab_size, hidden_size) = head.rows.numel(), weight.shape
    grads = HeadGrads(mul_into=mul_into)
    gradient_plan = plan_gradient_pass(head, need)
    plan = gradient_plan.tile
    h, buf, y = rows_source(head, plan)
    if fp32_logits(head, "two_passes") and h is not None and not fp32_logits_rule.readable(h, weight):
        h = h.clone(memory_format=torch.contiguous_format)  # as the statistics pass read it: dz from the accumulator
    d_hidden = hidden_accumulator(head, gradient_plan, need)
    if need.weight:
        # In the given weight's dtype: fp32 for an fp32 weight under autocast (cuBLAS writes fp32 from the bf16
        # operands), the compute dtype otherwise (one rounding, as eager's). Every chunk writes its rows (no fill),
        # unless no row is kept.
        new = torch.empty if m_rows else torch.zeros
        grads.weight = new(weight.shape, dtype=head.weight_gradient_dtype, device=weight.device)
    if need.bias and bias is not None:
        grads.bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
    zeros = torch.zeros(m_rows, dtype=torch.float32, device=weight.device)
    g_lp = zeros if grad_logprobs is None else grad_logprobs.to(torch.float32).contiguous()
    g_ent = zeros if grad_entropy is None else grad_entropy.to(torch.float32).contiguous()
    ent = zeros if entropy is None else entropy
    scalars = kernel_scalars(head.transform, bias)
    tile_buf = torch.empty((plan.block_rows, plan.cols), dtype=dtype, device=weight.device)
    w_buf = weight_chunk_buffer(head, plan.cols)
    w_like = weight if w_buf is None else w_buf  # what the chunks' operands look like, for the checks below
    write_dz = dz_writer(head, h if buf is None else buf, w_like, tile_buf,
                         CublasDz(bias, y, lse, ent, g_lp, g_ent, scalars, grad_logprobs is not None,
                                  grad_entropy is not None))
    weight_grad = WeightChunkGradient(grads, need.weight, dtype, tile_buf, hidden_size, plan.block_rows < m_rows)
    chunks = weight_gradient_chunks(vocab_size, hidden_size, plan, m_rows, dtype.itemsize,
                                    grads.weight.element_size() if need.weight else 4)
    for chunk in chunks:
        v0, v1 = chunk.v0, chunk.v1
        w_chunk = head.weight_rows(v0, v1, w_buf)
        tile = weight_grad.start(chunk)
        for r0, r1, h_rows in row_blocks(head, plan, h, buf):
            dz = tile[: r1 - r0]
            write_dz(h_rows, w_chunk, dz, v0, r0, r1)
            if d_hidden is not None:
                d_hidden.add(v0, r0, r1, dz, w_chunk)
            weight_grad.add(r0, dz, h_rows)
            if grads.bias is not None:
                grads.bias[v0:v1] += dz.float().sum(0)
        weight_grad.finish_chunk()
    if d_hidden is not None:  # fp32 [M, H] in the order of ``rows``, or (the pair) hidden's whole bf16 gradient
        d_hidden.finish(grads)
    return grads
