"""The support loss's one pass on the GPU backend (:func:`run_support_pass`): the cross-entropy one pass
(:mod:`.one_pass`) with ``K`` candidate columns per row instead of one label column, its tile rows and tile bytes, and
fp32-faithful statistics.

Per full-vocabulary row block (the plan's rows, a ``[rows, V]`` tile in the operands' dtype as the cross-entropy's):
the logits in vocabulary chunks of :func:`chunk_cols` columns, cuBLAS writing each chunk's fp32 accumulator (into a
``[rows, chunk]`` fp32 scratch for 2-byte operands, about a tenth of the tile's bytes; into the fp32 tile's own
columns otherwise) and one kernel reading it once (:func:`~.shifted_tile.logits_chunk_`): the rows' running
statistics, the raw logits of the candidates in the chunk, and the chunk stored in the tile shifted by each block's
maximum (a likely token's stored logit near 0: the gradients as accurate as from an fp32 tile, :mod:`.shifted_tile`).
With :data:`SCRATCHES` ≥ 2 on CUDA the chunk kernels run on a side stream while cuBLAS writes the next chunks into
the other scratch buffers (:class:`ChunkRing`): the kernels' memory traffic beside the matmuls' arithmetic.
No logit is rounded before the statistics and the candidates' log-probs (:func:`~.support_kernels.support_logprobs_`)
read it: bf16's ``|z|·2⁻⁸`` would dominate a divergence of a few hundredths of a nat. Then the loss's per-row
gradients ``g_k = ∂L/∂s_k``, ``g_H = ∂L/∂H`` (the op's :class:`~hf_fused.ops.support_loss.SupportTileLoss` on
``[rows, K]`` tensors, or the recompute's given gradients), the tile turned in place into
``−p·Σ_k g_k − g_H·p·(log p + H)`` rounded once to its dtype (:func:`~.shifted_tile.shifted_gradient_`), the candidate
columns set whole from their fp32 logits (:func:`~.support_kernels.scatter_support_grad_`), then ``dh``, ``dW`` (the
cross-entropy's accumulators, over as many tiles) and ``db`` (the sum of the rounded ``dz``). 6·N·H·V FLOPs.

Bytes per logit: the fp32 chunk written (4) and read (4), the tile written (2), read and written by the gradient
(2 + 2): the cross-entropy's 2 + 2 + 2 + 2 plus 6, at its memory plus the scratch.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import triton

from ...grads import HeadGrads
from ...head_inputs import HeadInputs, NeededGrads
from .matmul import mm_f32_
from .one_pass import weight_accumulator
from .one_pass_rule import ONE_PASS_ROW_ALIGN, OnePassPlan
from .operands import one_pass_rows
from .plan import one_pass_is_forced, plan_one_pass
from .scaled_round import mul_into
from .shifted_tile import BLOCK_V, chunk_block, logits_chunk_, shifted_gradient_
from .support_kernels import scatter_support_grad_, support_logprobs_
from .tiles import kernel_scalars, new_row_stats, row_slice

_NO_GRADS = NeededGrads(False, False, False)
#: Vocabulary chunks of a 2-byte operand's tile row block: the fp32 scratch ``[rows, ⌈V / CHUNKS⌉]`` (whole blocks of
#: :data:`~.shifted_tile.BLOCK_V`) is about a tenth of the tile's bytes. The fastest of 8 to 48 chunks within 1.1× the
#: fused cross-entropy's memory at 16k × 2048 × 151,936 bf16 on an H200 (docs/performance.md, 2026-11-29): 54.7 ms
#: and 1.05× its memory at K = 8, where 8 chunks took 53.7 ms at 1.12× and 16 took 55.8 ms.
CHUNKS = 24
#: fp32 scratch buffers of a 2-byte operand's pass on CUDA, used in turn: 1, every kernel in order on the caller's
#: stream; ``n ≥ 2``, each chunk's kernel on a side stream while cuBLAS writes the next chunks on the caller's (at
#: most ``n − 1`` ahead of the kernel that reads them). The same bits either way; off CUDA always one, in order.
SCRATCHES = 1
#: The side stream's priority (CUDA's: lower is higher; 0 the default, −1 ahead of the caller's stream's kernels).
SIDE_PRIORITY = 0
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


def tile_rows(plan: OnePassPlan, head: HeadInputs, cols: int, block: int, scratches: int) -> int:
    """Rows per tile: the plan's (the cross-entropy's) under the default rule on a CUDA device and in a
    :func:`~.plan.forced_plans` block; under a budget (explicit, or the default's off CUDA) as many as fit in the
    bytes the plan counted for its tile with the ``scratches`` fp32 scratch buffers of ``cols`` columns
    (:func:`scratch_count`) and the block maxima beside each row."""
    weight = head.weight
    if one_pass_is_forced() or (head.tile_budget_bytes is None and weight.device.type == "cuda"):
        return plan.rows
    vocab_size, elem = weight.shape[0], weight.element_size()
    row_bytes = vocab_size * elem + 4 * scratches * cols + 4 * triton.cdiv(vocab_size, block)
    rows = plan.rows * vocab_size * elem // row_bytes
    return max(ONE_PASS_ROW_ALIGN, rows - rows % ONE_PASS_ROW_ALIGN)


def scratch_count(weight: torch.Tensor) -> int:
    """fp32 scratch buffers of a pass over ``weight``: none for fp32 operands (cuBLAS writes the fp32 tile's own
    columns), :data:`SCRATCHES` for 2-byte ones on CUDA, one elsewhere (no streams: the interpreter runs in order)."""
    if weight.element_size() >= 4:
        return 0
    return max(1, int(SCRATCHES)) if weight.is_cuda else 1


_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device, priority: int):
    """One side stream per device and priority, kept for the process (a stream costs a driver call to create)."""
    key = (device.index if device.index is not None else torch.cuda.current_device(), int(priority))
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=key[0], priority=key[1])
    return _SIDE_STREAMS[key]


class ChunkRing:
    """The fp32 scratch buffers of a pass's vocabulary chunks, used in turn, and the order between cuBLAS writing
    chunk ``i`` and the chunk kernel reading it.

    With one buffer (or none: fp32 operands) everything runs in order on the caller's stream and :meth:`reading` is a
    null context. With ``n ≥ 2`` (CUDA) the kernels run on a side stream: chunk ``i``'s kernel waits for the event
    recorded after its matmul, and the matmul of chunk ``i + n`` (into the same buffer) waits for the event recorded
    after that kernel, so a matmul never overwrites a buffer a kernel still reads. :meth:`join` makes the caller's
    stream wait for every kernel queued so far: call it before anything reads what the kernels wrote (the row
    statistics, the candidates' raw logits, the tile). Every buffer the kernels touch was allocated on the caller's
    stream and is only freed or reused there after a :meth:`join` (the pass joins in ``finally``), so the caching
    allocator needs no ``record_stream``."""

    def __init__(self, count: int, numel: int, device: torch.device) -> None:
        self.buffers = [torch.empty(numel, dtype=torch.float32, device=device) for _ in range(count)]
        self.side = _side_stream(device, SIDE_PRIORITY) if count >= 2 else None
        if self.side is not None:
            self.main = torch.cuda.current_stream(device)
            self.written = [torch.cuda.Event() for _ in range(count)]
            self.read = [torch.cuda.Event() for _ in range(count)]
        self.count = 0  # chunks handed out so far

    def scratch(self, rows: int, cols: int) -> Optional[torch.Tensor]:
        """The next chunk's ``[rows, cols]`` buffer (``None`` without buffers), once the kernel that last read it
        is done."""
        if not self.buffers:
            return None
        i = self.count % len(self.buffers)
        if self.side is not None and self.count >= len(self.buffers):
            self.main.wait_event(self.read[i])
        self.count += 1
        return self.buffers[i][: rows * cols].view(rows, cols)

    @contextlib.contextmanager
    def reading(self):
        """The context of the kernel reading the chunk :meth:`scratch` handed out last, after its matmul: the side
        stream, waiting for that matmul (a null context in order)."""
        if self.side is None:
            yield
            return
        i = (self.count - 1) % len(self.buffers)
        self.written[i].record(self.main)
        with torch.cuda.stream(self.side):
            self.side.wait_event(self.written[i])
            yield
            self.read[i].record(self.side)

    def join(self) -> None:
        """The caller's stream waits for every kernel queued on the side stream so far."""
        if self.side is not None:
            self.main.wait_stream(self.side)


def run_support_pass(head: HeadInputs, support, *, tile_loss=None, row_grads=None, need: NeededGrads = _NO_GRADS,
                     return_entropy: bool = False):
    """:func:`hf_fused.ops.support_loss.support_loss_pass`'s contract on the GPU backend's one pass: its
    ``(support_logprobs, entropy, grads)`` as a plain tuple (backends sit below the op's module), or ``None`` where
    the planner chooses two passes (the op then runs the plain-PyTorch pass)."""
    differentiates = (tile_loss is not None and tile_loss.differentiate) or row_grads is not None
    need = need if differentiates else _NO_GRADS
    plan = plan_one_pass(head, need)
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
    scratches = scratch_count(weight)
    rows_per_tile = tile_rows(plan, head, cols, block, scratches)
    _, _, blocks = one_pass_rows(head, rows_per_tile)
    scalars = kernel_scalars(head.transform, bias)
    stats = new_row_stats(m_rows, device)
    buf_rows = min(rows_per_tile, max(m_rows, 1))
    # the tile in the operands' dtype, as the cross-entropy's; fp32 logits chunks in a scratch beside a 2-byte one
    tile = torch.empty((buf_rows, vocab_size), dtype=weight.dtype, device=device)
    ring = ChunkRing(scratches, buf_rows * cols, device)
    offsets = torch.empty((buf_rows, triton.cdiv(vocab_size, block)), dtype=torch.float32, device=device)
    raw_buf = torch.zeros((buf_rows, k), dtype=torch.float32, device=device)
    support_logprobs = torch.empty((m_rows, k), dtype=torch.float32, device=device)
    entropy = torch.empty(m_rows, dtype=torch.float32, device=device) if want_entropy else None
    grads = HeadGrads(mul_into=mul_into) if need.any else None
    d_weight = weight_accumulator(plan, head, need, grads) if need.any else None
    d_hidden = (torch.empty((m_rows, weight.shape[1]), dtype=torch.float32, device=device)
                if need.hidden else None)
    if need.bias and bias is not None:
        grads.bias = torch.zeros(bias.shape, dtype=torch.float32, device=device)
    ids_all, valid_all = support.ids.contiguous(), support.valid.contiguous()
    try:
        for r0, r1, h in blocks:  # h: the tile's kept hidden rows [r1 − r0, H], in weight's dtype
            rows = r1 - r0
            dz, row_stats, off = tile[:rows], row_slice(stats, r0, r1), offsets[:rows]
            ids, valid, raw, s = ids_all[r0:r1], valid_all[r0:r1], raw_buf[:rows], support_logprobs[r0:r1]
            for c0 in range(0, vocab_size, cols):
                c1 = min(c0 + cols, vocab_size)
                x = ring.scratch(rows, c1 - c0)
                x = dz[:, c0:c1] if x is None else x
                mm_f32_(x, h, weight[c0:c1].t())
                with ring.reading():
                    logits_chunk_(x, dz[:, c0:c1], off, c0, block, bias, ids, row_stats, raw, scalars, want_entropy)
            ring.join()  # the statistics, candidates and tile complete before anything reads them
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
            shifted_gradient_(dz, off, block, lse, ent_arg, g_s.sum(1), g_ent, scalars)
            scatter_support_grad_(dz, ids, valid, raw, g_s, lse, ent_arg, g_ent, scalars)
            if d_hidden is not None:  # each row's dh is complete within its tile
                mm_f32_(d_hidden[r0:r1], dz, weight)
            if d_weight is not None:
                d_weight.add(r0, dz, h)
            if grads.bias is not None:
                grads.bias += dz.float().sum(0)
    finally:
        ring.join()  # nothing the kernels touch is freed while they may run (an exception from the loss included)
    if grads is not None:
        grads.hidden = d_hidden
        if d_weight is not None:
            d_weight.finish(grads)
    return support_logprobs, entropy, grads


__all__ = ["CHUNKS", "SCRATCHES", "SIDE_PRIORITY", "ChunkRing", "chunk_cols", "forced_chunk_cols",
           "run_support_pass", "scratch_count", "tile_rows"]
