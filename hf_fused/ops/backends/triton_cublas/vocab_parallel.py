"""The GPU backend's schedules on a vocabulary-sharded head: cuBLAS tiles and the Triton kernels over this rank's
rows of lm_head, the running per-row statistics merged over the tensor-parallel group.

Each rank runs the GPU backend's loops on its own rows with its labels shifted to them (``y − start``: a label
outside the rank's slice matches no column, so its logit and its ``1[j = y]`` term come from the rank that holds
it). The kernels' running statistics (:data:`~.tiles.RowStats`: running max ``m``, ``Σexp(z − m)``,
``Σexp(z − m)·z``, the label logit, ``Σz``, the first arg-max, ``Σexp(2(z − m))``) are sums after rescaling to a
common maximum, so one all-reduce MAX of ``[rows]`` and one all-reduce SUM of ``[k, rows]`` merge them
(:func:`merge_row_stats_`, the formulas of :mod:`hf_fused.ops.vocab_parallel`):

* the two passes: the statistics pass over the rank's rows (from cuBLAS's tiles, or from the matmul's fp32
  accumulator where the GPU backend takes them from there: :func:`~.plan.fp32_logits`), merged once per call; the
  gradient pass is local (the merged log-sum-exp and entropy are all it reads);
* the one pass: every tile's statistics merged before its gradient kernel runs, so every rank of the group runs the
  same tiles: the tile rows are agreed once per call (the smallest any rank's plan allows; two passes if any rank's
  plan has no one pass; the two passes also where the one pass would take fp32-accumulator statistics).

The weight gradient of a rank's rows stays on the rank; the hidden states' gradient is the rank's part, summed over
the group in fp32 by the op (:func:`~hf_fused.ops.vocab_parallel.sum_gradient_over`). Used for every rank holding
at least one row (:func:`~hf_fused.ops.backends.vocab_parallel.vocab_parallel_backend`); QuACK's fused statistics
are not used here (they hold no running maximum to merge).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional, Sequence, Union

import torch

from ...grads import HeadGrads
from ...head_inputs import HeadInputs, NeededGrads
from ...vocab_parallel import VocabLayout, all_reduce_
from ..protocol import HeadPass, TileGrads, logprob_tile_grads
from .one_pass import TileGradients
from .one_pass_rule import OnePassPlan
from .operands import one_pass_rows, operand_bias, row_blocks, rows_source, weight_chunk_buffer
from . import fp32_logits_rule, fused_matmul
from .plan import fp32_logits, plan_fp32_statistics_pass, plan_one_pass, plan_statistics_pass
from .scaled_round import mul_into
from .tiles import RowStats, finish_row_stats, kernel_scalars, new_row_stats, row_slice, statistics_tile
from .two_passes import run_gradient_pass


class TritonVocabParallelBackend:
    """The GPU backend's one pass and two passes over this rank's rows ``[layout.shard.start, layout.shard.stop)``
    of lm_head (``head.weight``, ``head.bias``), ``head.labels`` global ids; the per-row statistics merged over the
    group (module docstring). Meets :class:`~hf_fused.ops.backends.protocol.TokenLossBackend`."""

    name = "triton_vocab_parallel"

    def __init__(self, layout: VocabLayout):
        self.layout = layout

    def logprobs_with_grads(
        self, head: HeadInputs, grad_logprobs: Union[None, torch.Tensor, Callable[[], torch.Tensor]], *,
        need: NeededGrads, return_entropy: bool = False, statistics: Sequence[str] = (),
    ) -> Optional[HeadPass]:
        """As :meth:`~.backend.TritonCublasBackend.logprobs_with_grads`, over this rank's slice."""
        tile_grads = logprob_tile_grads(grad_logprobs) if need.any else None
        return self._one_pass(head, tile_grads, need, return_entropy, statistics, entropy_in_grads=False)

    def token_loss_with_grads(
        self, head: HeadInputs, tile_grads: TileGrads, *, need: NeededGrads, return_entropy: bool = False,
        statistics: Sequence[str] = (), grads_read_entropy: bool = True,
    ) -> Optional[HeadPass]:
        """As :meth:`~.backend.TritonCublasBackend.token_loss_with_grads`: ``tile_grads`` gets each tile's merged
        log-probs (and entropies), the same on every rank."""
        return self._one_pass(head, tile_grads, need, return_entropy, statistics, entropy_in_grads=grads_read_entropy)

    def logprobs_forward(self, head: HeadInputs, *, return_entropy: bool = False,
                         statistics: Sequence[str] = ()) -> HeadPass:
        """The statistics pass over this rank's rows, merged once over the group: from cuBLAS's tiles (vocabulary
        chunks outside), or from the logits matmul's fp32 accumulator where the GPU backend's two passes take them
        from there (:func:`~.plan.fp32_logits`: the gradient pass then computes ``dz`` from it too)."""
        local = local_head(head, self.layout)
        stats, y = _local_statistics(local, return_entropy, statistics)
        top1 = merge_row_stats_(stats, y, self.layout, return_entropy)
        return _finish(stats, y, self.layout, return_entropy, statistics, top1)

    def logprobs_backward(
        self, head: HeadInputs, lse: torch.Tensor, entropy: Optional[torch.Tensor],
        grad_logprobs: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor], *, need: NeededGrads,
    ) -> HeadGrads:
        """The GPU backend's gradient pass over this rank's rows from the merged ``lse`` / ``entropy``: local, no
        collective."""
        return run_gradient_pass(local_head(head, self.layout), lse, entropy, grad_logprobs, grad_entropy, need)

    def _one_pass(self, head: HeadInputs, tile_grads: Optional[TileGrads], need: NeededGrads, return_entropy: bool,
                  statistics: Sequence[str], *, entropy_in_grads: bool) -> Optional[HeadPass]:
        local = local_head(head, self.layout)
        # Where the one pass would take its statistics from the fp32 accumulator, the two passes do (the merge of
        # the stored tile's own normalizer is not implemented); every rank decides alike, from the same settings.
        plan = None if fp32_logits(local, "one_pass") else plan_one_pass(local, need)
        plan = agreed_one_pass(plan, self.layout, local.weight.device)
        if plan is None:
            return None
        local = local.computed()  # every tile reads the whole weight: one cast copy under autocast (planned)
        weight, bias = local.weight, local.bias
        m_rows = local.rows.numel()
        y, _, blocks = one_pass_rows(local, plan.rows)
        scalars = kernel_scalars(local.transform, bias)
        gradients = TileGradients(local, plan, need, tile_grads, HeadGrads(mul_into=mul_into), scalars,
                                  return_entropy, entropy_in_grads)
        stats = new_row_stats(m_rows, weight.device, statistics)
        top1 = torch.zeros(m_rows, dtype=torch.bool, device=weight.device) if "is_top1" in statistics else None
        tile_buf = torch.empty((min(plan.rows, max(m_rows, 1)), weight.shape[0]), dtype=weight.dtype,
                               device=weight.device)
        for r0, r1, h in blocks:  # h: the tile's kept hidden rows [r1 − r0, H], in weight's dtype
            dz, row_stats = tile_buf[: r1 - r0], row_slice(stats, r0, r1)
            torch.mm(h, weight.t(), out=dz)
            statistics_tile(dz, 0, bias, y[r0:r1], row_stats, scalars, return_entropy)
            tile_top1 = merge_row_stats_(row_stats, y[r0:r1], self.layout, return_entropy)
            if top1 is not None:
                top1[r0:r1] = tile_top1
            if tile_grads is not None:
                gradients(r0, r1, h, y[r0:r1], dz, row_stats, False)
        grads = gradients.finish()
        out = _finish(stats, y, self.layout, return_entropy, statistics, top1)
        out.grads = grads if tile_grads is not None else None
        return out


def _local_statistics(local: HeadInputs, return_entropy: bool, statistics: Sequence[str]):
    """``(running statistics, kept rows' local labels)`` of this rank's rows (:data:`~.tiles.RowStats`, before the
    merge): the two passes' statistics pass without its finish (:func:`~.two_passes.run_statistics_pass`,
    :func:`~.two_passes.run_fp32_statistics_pass`)."""
    weight, bias, dtype = local.weight, operand_bias(local), local.operand_dtype
    stats = new_row_stats(local.rows.numel(), weight.device, statistics)
    scalars = kernel_scalars(local.transform, bias)
    if fp32_logits(local, "two_passes"):
        plan = plan_fp32_statistics_pass(local, 2 + return_entropy + len(statistics))
        h, buf, y = rows_source(local, plan)
        if h is not None and not fp32_logits_rule.readable(h, weight):
            h = h.clone(memory_format=torch.contiguous_format)
        for r0, r1, h_rows in row_blocks(local, plan, h, buf):
            fused_matmul.logits_statistics_(h_rows, weight, y[r0:r1], row_slice(stats, r0, r1), scalars,
                                            return_entropy=return_entropy, bias=bias)
        return stats, y
    plan = plan_statistics_pass(local)
    h, buf, y = rows_source(local, plan)
    tile_buf = torch.empty((plan.block_rows, plan.cols), dtype=dtype, device=weight.device)
    w_buf = weight_chunk_buffer(local, plan.cols)
    width = weight.shape[0]
    for v0 in range(0, width, plan.cols):
        w_chunk = local.weight_rows(v0, min(v0 + plan.cols, width), w_buf)
        for r0, r1, h_rows in row_blocks(local, plan, h, buf):
            z = torch.mm(h_rows, w_chunk.t(), out=tile_buf[: r1 - r0, : w_chunk.shape[0]])
            statistics_tile(z, v0, bias, y[r0:r1], row_slice(stats, r0, r1), scalars, return_entropy)
    return stats, y


def local_head(head: HeadInputs, layout: VocabLayout) -> HeadInputs:
    """``head`` with its labels shifted to this rank's rows (``y − start``): a label outside them falls outside
    ``[0, width)``, where no kernel matches a column (ignored rows are never read)."""
    return replace(head, labels=head.labels - layout.shard.start)


def agreed_one_pass(plan: Optional[OnePassPlan], layout: VocabLayout,
                    device: torch.device) -> Optional[OnePassPlan]:
    """``plan`` with the tile rows every rank of the group can take (the smallest of the ranks' plans: a smaller
    tile stays within each rank's budget), or ``None`` (two passes on every rank) if any rank's plan is the two
    passes: the one pass merges each tile's statistics, so every rank must run the same tiles. One all-reduce of
    one value and a host sync."""
    rows = torch.tensor([-(plan.rows if plan is not None else 0)], dtype=torch.float32, device=device)
    agreed = -int(all_reduce_(rows, "max", layout.group).item())  # the smallest, as a MAX of negatives
    if plan is None or agreed <= 0:
        return None
    return replace(plan, rows=agreed)


def merge_row_stats_(stats: RowStats, labels: torch.Tensor, layout: VocabLayout,
                     entropy: bool) -> Optional[torch.Tensor]:
    """Merge rows' running statistics (:data:`~.tiles.RowStats` over this rank's columns, ``labels`` shifted to
    them) over the group, in place: afterwards they are the whole vocabulary's (the running max the global one, the
    sums rescaled to it and added, the label logit the owner's). One all-reduce MAX of ``[rows]``, one all-reduce
    SUM of ``[k, rows]``. Returns the rows' ``is_top1`` (bool ``[rows]``: the label holds the first maximum of the
    whole row) when the arg-max is tracked, else ``None``.

    ``is_top1`` from two sums (the rule of :func:`~hf_fused.ops.vocab_parallel.merged_tile_statistics`): the
    label's rank sees its logit at the global maximum, and no rank holds that maximum at a column before the
    label (a rank's first arg-max ``a`` is before the label when ``a < y − start``)."""
    run_max, run_sum, run_zp, label_logit, z_sum, arg, sum_sq = stats
    width = layout.shard.width
    m = all_reduce_(run_max.clone(), "max", layout.group)
    scale = torch.exp(run_max - m)
    columns = [run_sum * scale, label_logit]
    if entropy:
        columns.append(run_zp * scale)
    if z_sum is not None:
        columns.append(z_sum)
    if sum_sq is not None:
        columns.append(sum_sq * (scale * scale))
    if arg is not None:
        own = (labels >= 0) & (labels < width)
        columns.append((own & (label_logit == m)).float())
        columns.append(((run_max == m) & (arg < labels)).float())
    sums = all_reduce_(torch.stack(columns), "sum", layout.group)
    run_max.copy_(m)
    run_sum.copy_(sums[0])
    label_logit.copy_(sums[1])
    k = 2
    if entropy:
        run_zp.copy_(sums[k])
        k += 1
    if z_sum is not None:
        z_sum.copy_(sums[k])
        k += 1
    if sum_sq is not None:
        sum_sq.copy_(sums[k])
        k += 1
    if arg is None:
        return None
    return (sums[k] > 0) & (sums[k + 1] == 0)


def _finish(stats: RowStats, labels: torch.Tensor, layout: VocabLayout, return_entropy: bool,
            statistics: Sequence[str], top1: Optional[torch.Tensor]) -> HeadPass:
    """The :class:`HeadPass` of merged statistics: :func:`~.tiles.finish_row_stats` over the whole vocabulary,
    ``is_top1`` from the merge."""
    logp, entropy, lse, token_stats = finish_row_stats(stats, labels, layout.vocab_size, return_entropy,
                                                       [name for name in statistics if name != "is_top1"])
    if "is_top1" in statistics:
        token_stats["is_top1"] = top1
    return HeadPass(logp, entropy, lse, None, {name: token_stats[name] for name in statistics})
