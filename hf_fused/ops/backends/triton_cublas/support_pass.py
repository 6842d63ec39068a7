"""The support loss's one pass on the GPU backend (:func:`run_support_pass`): the cross-entropy one pass
(:mod:`.one_pass`) with ``K`` candidate columns per row instead of one label column, and fp32-faithful logits.

Per full-vocabulary row block: the logits tile in fp32 (cuBLAS writes its fp32 accumulator from the operands, bf16
included: no logit is rounded to bf16, whose ``|z|·2⁻⁸`` would dominate a divergence of a few hundredths of a nat)
and its statistics (the statistics kernel), the candidates' logits and log-probs gathered from it
(:func:`~.support_kernels.gather_support_`), the loss's per-row gradients ``g_k = ∂L/∂s_k``, ``g_H = ∂L/∂H`` (the
op's :class:`~hf_fused.ops.support_loss.SupportTileLoss` on ``[rows, K]`` tensors, or the recompute's given
gradients), the gradient kernel turning the tile into ``−p·Σ_k g_k − g_H·p·(log p + H)`` (no label column) rounded
once to the operands' dtype (:func:`~.support_kernels.gradient_into_`: for bf16 operands into the tile's own bytes,
so the pass holds one fp32 tile and nothing else of its size), the candidate columns set whole
(:func:`~.support_kernels.scatter_support_grad_`), then ``dh``, ``dW`` (the cross-entropy's accumulators) and
``db`` (the sum of the rounded ``dz``). 6·N·H·V FLOPs. The plan counts a tile in the operands' dtype, so a 2-byte
operand's fp32 tile has half the plan's rows (the cross-entropy one pass's bytes: under the default rule 1,024 rows
of fp32 where the cross-entropy holds 2,048 of bf16); a :func:`~.plan.forced_plans` block's rows are taken as given.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...grads import HeadGrads
from ...head_inputs import HeadInputs, NeededGrads
from .matmul import mm_f32_
from .one_pass import weight_accumulator
from .one_pass_rule import ONE_PASS_ROW_ALIGN
from .operands import one_pass_rows
from .plan import one_pass_is_forced, plan_one_pass
from .scaled_round import mul_into
from .support_kernels import gather_support_, gradient_into_, scatter_support_grad_
from .tiles import kernel_scalars, new_row_stats, row_slice, statistics_tile

_NO_GRADS = NeededGrads(False, False, False)


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
    rows_per_tile = plan.rows
    if weight.element_size() < 4 and not one_pass_is_forced():
        # the plan counted a tile in the operands' dtype; this one is fp32: as many bytes in half the rows
        half = plan.rows * weight.element_size() // 4
        rows_per_tile = max(ONE_PASS_ROW_ALIGN, half // ONE_PASS_ROW_ALIGN * ONE_PASS_ROW_ALIGN)
    _, _, blocks = one_pass_rows(head, rows_per_tile)
    scalars = kernel_scalars(head.transform, bias)
    stats = new_row_stats(m_rows, device)
    tile_rows = min(rows_per_tile, max(m_rows, 1))
    # The logits tile in fp32 (cuBLAS writes its fp32 accumulator: no bf16 rounding of a logit); dz in the operands'
    # dtype for the gradient matmuls, for 2-byte operands in the tile's own bytes (row r: the first half of row r)
    tile = torch.empty((tile_rows, vocab_size), dtype=torch.float32, device=device)
    dz_tile = tile if weight.dtype == torch.float32 else tile.view(weight.dtype)[:, :vocab_size]
    # the statistics' label (its logit is not read) and the gradient kernel's (none: the candidate columns are set
    # afterwards)
    stats_label = torch.zeros(tile_rows, dtype=torch.long, device=device)
    no_label = torch.full((tile_rows,), -1, dtype=torch.long, device=device)
    raw_buf = torch.empty((tile_rows, k), dtype=torch.float32, device=device)
    support_logprobs = torch.empty((m_rows, k), dtype=torch.float32, device=device)
    entropy = torch.empty(m_rows, dtype=torch.float32, device=device) if want_entropy else None
    grads = HeadGrads(mul_into=mul_into) if need.any else None
    d_weight = weight_accumulator(plan, head, need, grads) if need.any else None
    d_hidden = (torch.empty((m_rows, weight.shape[1]), dtype=torch.float32, device=device)
                if need.hidden else None)
    if need.bias and bias is not None:
        grads.bias = torch.zeros(bias.shape, dtype=torch.float32, device=device)
    ids_all, valid_all = support.ids.contiguous(), support.valid.contiguous()
    for r0, r1, h in blocks:  # h: the tile's kept hidden rows [r1 − r0, H], in weight's dtype
        rows = r1 - r0
        z, dz, row_stats = tile[:rows], dz_tile[:rows], row_slice(stats, r0, r1)
        mm_f32_(z, h, weight.t())
        statistics_tile(z, 0, bias, stats_label[:rows], row_stats, scalars, want_entropy)
        run_max, run_sum, run_zp = row_stats[:3]
        ids, valid, raw, s = ids_all[r0:r1], valid_all[r0:r1], raw_buf[:rows], support_logprobs[r0:r1]
        gather_support_(z, ids, valid, bias, run_max, run_sum, raw, s, scalars)
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
        gradient_into_(z, dz, no_label[:rows], lse, ent_arg, g_s.sum(1), g_ent, bias, scalars)
        scatter_support_grad_(dz, ids, valid, raw, g_s, lse, ent_arg, g_ent, scalars)
        if d_hidden is not None:  # each row's dh is complete within its tile
            mm_f32_(d_hidden[r0:r1], dz, weight)
        if d_weight is not None:
            d_weight.add(r0, dz, h)
        if grads.bias is not None:
            grads.bias += dz.float().sum(0)
    if grads is not None:
        grads.hidden = d_hidden
        if d_weight is not None:
            d_weight.finish(grads)
    return support_logprobs, entropy, grads


__all__ = ["run_support_pass"]
