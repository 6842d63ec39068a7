"""The support loss's one pass on the GPU backend (:func:`run_support_pass`): the cross-entropy one pass
(:mod:`.one_pass`) with ``K`` candidate columns per row instead of one label column, its tile rows and tile bytes, and
fp32-faithful statistics.

Per full-vocabulary row block (the plan's rows, a ``[rows, V]`` tile in the operands' dtype as the cross-entropy's),
the logits come one of two ways (:class:`FusedLogits` where the fused matmul runs, :class:`ChunkedLogits` elsewhere):

* **Fused** (bf16 operands on a Hopper GPU, :func:`~.plan.fp32_logits`): :mod:`.fused_matmul`'s matmul folds the
  rows' statistics from its fp32 accumulator and stores the tile shifted by each epilogue slice's row maximum (the
  one pass's tile of the log-prob ops); each candidate's fp32 logit ``h·W[id_k]`` as that matmul's accumulator
  computes it (:func:`~.support_kernels.candidate_logits_`), so that the statistics and the candidates read one value
  of each logit. No fp32 copy of the logits: bytes per logit as the cross-entropy's.
* **Chunked**: the logits in vocabulary chunks of :func:`chunk_cols` columns, cuBLAS writing each chunk's fp32
  accumulator (into a ``[rows, chunk]`` fp32 scratch for 2-byte operands, about a tenth of the tile's bytes; into the
  fp32 tile's own columns otherwise) and one kernel reading it once (:func:`~.shifted_tile.logits_chunk_`): the
  statistics, the candidates' raw logits, and the chunk stored shifted by each block's maximum.

Either way a likely token's stored logit is near 0 (the gradients as accurate as from an fp32 tile,
:mod:`.shifted_tile`) and no logit is rounded before the statistics and the candidates' log-probs
(:func:`~.support_kernels.support_logprobs_`) read it: bf16's ``|z|·2⁻⁸`` would dominate a divergence of a few
hundredths of a nat. Then the loss's per-row gradients ``g_k = ∂L/∂s_k``, ``g_H = ∂L/∂H`` (the op's
:class:`~hf_fused.ops.support_loss.SupportTileLoss` on ``[rows, K]`` tensors, or the recompute's given gradients), the
tile turned in place into ``−p·Σ_k g_k − g_H·p·(log p + H)`` rounded once to its dtype
(:func:`~.shifted_tile.shifted_gradient_`), the candidate columns set whole from their fp32 logits
(:func:`~.support_kernels.scatter_support_grad_`), then ``dh``, ``dW`` (the cross-entropy's accumulators, over as
many tiles) and ``db`` (the sum of the rounded ``dz``). 6·N·H·V FLOPs.
"""

from __future__ import annotations

import contextlib

import torch
import triton

from ...grads import HeadGrads
from ...head_inputs import HeadInputs, NeededGrads
from .matmul import mm_f32_
from .one_pass import weight_accumulator
from .one_pass_hidden import HiddenGradient
from .one_pass_rule import ONE_PASS_ROW_ALIGN, OnePassPlan
from .operands import one_pass_rows
from . import fp32_logits_rule, fused_matmul
from .plan import fp32_logits, one_pass_is_forced, plan_one_pass
from .scaled_round import mul_into
from .shifted_tile import BLOCK_V, chunk_block, logits_chunk_, shifted_gradient_
from .support_kernels import candidate_logits_, scatter_support_grad_, support_logprobs_
from .tiles import kernel_scalars, new_row_stats, row_slice

_NO_GRADS = NeededGrads(False, False, False)
#: Vocabulary chunks of a 2-byte operand's tile row block in the chunked path (where the fused matmul does not run; on
#: a Hopper GPU :class:`FusedLogits` takes 1.08–1.09× the cross-entropy's time there, docs/performance.md): the fp32
#: scratch ``[rows, ⌈V / CHUNKS⌉]`` (whole blocks of :data:`~.shifted_tile.BLOCK_V`) is about a tenth of the tile's
#: bytes. The fastest of 8 to 32 chunks within 1.1× the
#: fused cross-entropy's memory at 16k × 2048 × 151,936 bf16 on an H200 (docs/performance.md, 2026-11-29): 53.5 ms
#: at K = 8 and 64 (1.05× / 1.07× its memory), where 8 chunks took 53.2 ms at 1.13× and 16 took 53.9 ms. Two fp32
#: scratches with the chunk kernels on a side stream (overlapping the next chunk's matmul) measured slower within the
#: same memory: 54.1–88.3 ms at 32 to 48 chunks (the host's launches set the pace there, not the GPU).
CHUNKS = 24
#: What :func:`forced_chunk_cols` put in place of :func:`chunk_cols`'s rule (None outside such a block).
_FORCED_COLS: list = [None]


@contextlib.contextmanager
def forced_chunk_cols(cols: int):
    """Within the block every pass takes vocabulary chunks of ``cols`` columns (the last one narrower), for every
    operand dtype: for tests (chunk boundaries inside a row on small vocabularies) and sweeps of the width.

    Raises:
        ValueError: ``cols`` below 1.
    """
    if int(cols) < 1:
        raise ValueError(f"forced_chunk_cols: cols must be at least 1, got {cols}")
    previous, _FORCED_COLS[0] = _FORCED_COLS[0], int(cols)
    try:
        yield
    finally:
        _FORCED_COLS[0] = previous


def chunk_cols(vocab_size: int, elem_bytes: int) -> int:
    """Columns of each vocabulary chunk: :func:`forced_chunk_cols`'s; else the whole vocabulary for 4-byte operands
    (cuBLAS writes the fp32 tile itself); else ``⌈V / CHUNKS⌉`` rounded up to whole blocks of
    :data:`~.shifted_tile.BLOCK_V` (151,936 columns: 21 chunks of 7,168 and one of 1,408)."""
    if _FORCED_COLS[0] is not None:
        return min(_FORCED_COLS[0], vocab_size)
    if elem_bytes >= 4:
        return vocab_size
    return min(vocab_size, triton.cdiv(triton.cdiv(vocab_size, CHUNKS), BLOCK_V) * BLOCK_V)


def tile_rows(plan: OnePassPlan, head: HeadInputs, cols: int, block: int) -> int:
    """Rows per tile of the chunked logits: the plan's (the cross-entropy's) under the default rule on a CUDA device
    and in a :func:`~.plan.forced_plans` block; under a budget (explicit, or the default's off CUDA) as many as fit
    in the bytes the plan counted for its tile with the scratch (2-byte operands) and the block maxima beside each
    row."""
    weight = head.weight
    if one_pass_is_forced() or (head.tile_budget_bytes is None and weight.device.type == "cuda"):
        return plan.rows
    vocab_size, elem = weight.shape[0], weight.element_size()
    row_bytes = vocab_size * elem + 4 * (cols if elem < 4 else 0) + 4 * triton.cdiv(vocab_size, block)
    rows = plan.rows * vocab_size * elem // row_bytes
    return max(ONE_PASS_ROW_ALIGN, rows - rows % ONE_PASS_ROW_ALIGN)


class FusedLogits:
    """A tile's logits from :mod:`.fused_matmul`: the statistics from the fp32 accumulator, the tile stored shifted
    per epilogue slice (its shifts in :attr:`offsets`, :attr:`block` columns each), the candidates' fp32 logits as
    that accumulator computes them (:func:`~.support_kernels.candidate_logits_`: the same bits on an H200). Returns
    the stored tile's own log-sum-exp, which normalizes its probabilities (as in :class:`~.one_pass.TileStatistics`)."""

    def __init__(self, head: HeadInputs, rows: int, scalars: dict, entropy: bool) -> None:
        self.weight, self.bias, self.scalars, self.entropy = head.weight, head.bias, scalars, entropy
        device = head.weight.device
        self.block = fused_matmul.shift_columns(device)
        self.offsets = fused_matmul.new_offsets(rows, head.weight.shape[0], device)
        self.rounded_sum = torch.empty(rows, dtype=torch.float32, device=device)
        self.no_labels = torch.full((rows,), -1, dtype=torch.int64, device=device)

    def __call__(self, h, dz, row_stats, ids, valid, raw) -> torch.Tensor:
        rows = h.shape[0]
        rounded_sum = self.rounded_sum[:rows].zero_()
        fused_matmul.logits_statistics_(h, self.weight, self.no_labels[:rows], row_stats, self.scalars,
                                        return_entropy=self.entropy, bias=self.bias, tile=dz,
                                        rounded_sum=rounded_sum, offsets=self.offsets[:rows])
        candidate_logits_(h, self.weight, self.bias, ids, valid, raw)
        return row_stats[0] + rounded_sum.log()


class ChunkedLogits:
    """A tile's logits in vocabulary chunks (:func:`chunk_cols`): cuBLAS's fp32 accumulator per chunk, read once by
    :func:`~.shifted_tile.logits_chunk_` (statistics, candidates' raw logits, the chunk stored shifted per
    :attr:`block` columns). Returns None: the statistics' own log-sum-exp normalizes the stored tile."""

    def __init__(self, head: HeadInputs, rows: int, scalars: dict, entropy: bool, cols: int, block: int) -> None:
        weight = head.weight
        self.weight, self.bias, self.scalars, self.entropy, self.cols, self.block = (
            weight, head.bias, scalars, entropy, cols, block)
        device, vocab_size = weight.device, weight.shape[0]
        self.scratch = (None if weight.dtype == torch.float32 else
                        torch.empty(rows * cols, dtype=torch.float32, device=device))
        self.offsets = torch.empty((rows, triton.cdiv(vocab_size, block)), dtype=torch.float32, device=device)

    def __call__(self, h, dz, row_stats, ids, valid, raw) -> None:
        rows, vocab_size, cols = h.shape[0], self.weight.shape[0], self.cols
        for c0 in range(0, vocab_size, cols):
            c1 = min(c0 + cols, vocab_size)
            x = dz[:, c0:c1] if self.scratch is None else self.scratch[: rows * (c1 - c0)].view(rows, c1 - c0)
            mm_f32_(x, h, self.weight[c0:c1].t())
            logits_chunk_(x, dz[:, c0:c1], self.offsets[:rows], c0, self.block, self.bias, ids, row_stats, raw,
                          self.scalars, self.entropy)
        return None


def run_support_pass(head: HeadInputs, support, *, tile_loss=None, row_grads=None, need: NeededGrads = _NO_GRADS,
                     return_entropy: bool = False):
    """:func:`hf_fused.ops.support_loss.support_loss_pass`'s contract on the GPU backend's one pass: its
    ``(support_logprobs, entropy, grads)`` as a plain tuple (backends sit below the op's module), or ``None`` where
    the planner chooses two passes (the op then runs the plain-PyTorch pass)."""
    differentiates = (tile_loss is not None and tile_loss.differentiate) or row_grads is not None
    need = need if differentiates else _NO_GRADS
    fused = fp32_logits(head, "one_pass")
    plan = plan_one_pass(head, need, fused_statistics=True)
    if plan is None:
        return None
    head = head.computed()  # every tile reads the whole weight: one cast copy under autocast (the plan counted it)
    weight, bias = head.weight, head.bias
    m_rows, vocab_size = head.rows.numel(), weight.shape[0]
    device = weight.device
    k = support.ids.shape[1]
    loss_reads_entropy = tile_loss is not None and tile_loss.need_entropy
    grads_read_entropy = need.any and row_grads is not None and row_grads.entropy is not None
    want_entropy = return_entropy or loss_reads_entropy or grads_read_entropy
    cols = chunk_cols(vocab_size, weight.element_size())
    block = chunk_block(cols, vocab_size)
    # the plan's rows for the fused logits; they hold the chunked path's buffers too, should the rows operand turn
    # out unreadable for the fused matmul (the plan counted the fused matmul's larger bytes per row)
    rows_per_tile = plan.rows if fused else tile_rows(plan, head, cols, block)
    _, rows_operand, blocks = one_pass_rows(head, rows_per_tile)
    fused = fused and fp32_logits_rule.readable(rows_operand, weight)
    scalars = kernel_scalars(head.transform, bias)
    stats = new_row_stats(m_rows, device)
    buf_rows = min(rows_per_tile, max(m_rows, 1))
    # the tile in the operands' dtype, as the cross-entropy's
    tile = torch.empty((buf_rows, vocab_size), dtype=weight.dtype, device=device)
    if fused:
        logits = FusedLogits(head, buf_rows, scalars, want_entropy)
    else:
        logits = ChunkedLogits(head, buf_rows, scalars, want_entropy, cols, block)
    raw_buf = torch.zeros((buf_rows, k), dtype=torch.float32, device=device)  # invalid slots: 0, never read
    support_logprobs = torch.empty((m_rows, k), dtype=torch.float32, device=device)
    entropy = torch.empty(m_rows, dtype=torch.float32, device=device) if want_entropy else None
    grads = HeadGrads(mul_into=mul_into) if need.any else None
    d_weight = weight_accumulator(plan, head, need, grads) if need.any else None
    d_hidden = HiddenGradient(head) if need.hidden else None
    if need.bias and bias is not None:
        grads.bias = torch.zeros(bias.shape, dtype=torch.float32, device=device)
    ids_all, valid_all = support.ids.contiguous(), support.valid.contiguous()
    for r0, r1, h in blocks:  # h: the tile's kept hidden rows [r1 − r0, H], in weight's dtype
        rows = r1 - r0
        dz, row_stats = tile[:rows], row_slice(stats, r0, r1)
        ids, valid, raw, s = ids_all[r0:r1], valid_all[r0:r1], raw_buf[:rows], support_logprobs[r0:r1]
        tile_lse = logits(h, dz, row_stats, ids, valid, raw)
        run_max, run_sum, run_zp = row_stats[:3]
        support_logprobs_(raw, valid, run_max, run_sum, s, scalars)
        lse = run_max + run_sum.log()
        ent = None
        if entropy is not None:
            ent = entropy[r0:r1]
            torch.sub(lse, run_zp / run_sum, out=ent)
        g_s = g_ent = None
        if tile_loss is not None:
            g_s, g_ent = tile_loss(r0, r1, s, ent if loss_reads_entropy else None)
        elif row_grads is not None:
            g_s = row_grads.logprobs[r0:r1]
            g_ent = None if row_grads.entropy is None else row_grads.entropy[r0:r1]
        if grads is None:
            continue
        g_s = g_s.float().contiguous()
        g_ent = None if g_ent is None else g_ent.float().contiguous()
        ent_arg = lse if ent is None else ent
        # the stored tile's probabilities with its own normalizer (dz's row sums stay 0), as the one pass's
        lse = lse if tile_lse is None else tile_lse
        shifted_gradient_(dz, logits.offsets[:rows], logits.block, lse, ent_arg, g_s.sum(1), g_ent, scalars)
        scatter_support_grad_(dz, ids, valid, raw, g_s, lse, ent_arg, g_ent, scalars)
        if d_hidden is not None:
            d_hidden.add(r0, r1, dz, weight)
        if d_weight is not None:
            d_weight.add(r0, dz, h)
        if grads.bias is not None:
            grads.bias += dz.float().sum(0)
    if grads is not None:
        if d_hidden is not None:
            d_hidden.finish(grads)
        if d_weight is not None:
            d_weight.finish(grads)
    return support_logprobs, entropy, grads


__all__ = ["CHUNKS", "ChunkedLogits", "FusedLogits", "chunk_cols", "forced_chunk_cols", "run_support_pass", "tile_rows"]
