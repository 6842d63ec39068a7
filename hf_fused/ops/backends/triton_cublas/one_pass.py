"""The one pass (6·M·H·V FLOPs): token rows outside, whole vocabulary rows per tile, gradients in the same pass.

Per full-vocabulary row block: the logits tile (cuBLAS, then the statistics kernel; or QuACK's matmul with the
statistics in its epilogue; or, where QuACK is installed and the fp32 statistics are asked, its scaled-exp matmul,
which stores each logit's exponential shifted by a power of two per row and column tile and reduces the statistics
from the fp32 accumulator; or, where the plan takes the logits from the fp32 accumulator, :mod:`.fused_matmul`'s
matmul, which folds the statistics from the accumulator, fp32-faithful log-probs and entropy, and stores the tile
shifted: each 64 columns' logits minus their row maximum in bf16, the maxima in fp32 beside it), the per-row
gradients of the token loss from the block's statistics, the gradient kernel turning the same tile into ``dz`` (the
shifted tile's, :func:`~.shifted_tile.shifted_gradient_`: as accurate as ``dz`` from the accumulator, each likely
logit stored near 0 where bf16 is fine-grained, the label's from its fp32 logit; QuACK's exponential tile under a
loss of the log-probs alone is left as ``dz``'s row-scaled form instead, :func:`~.shifted_tile.exp_tile_row_factors_`),
then the hidden gradient (complete within the tile, kept until backward as :mod:`.one_pass_hidden` says) and the
weight gradient's accumulation (:class:`TileGradients`).
What varies per call is chosen once, before the loop:
where each tile's statistics come from (:class:`TileStatistics`) and how the weight gradient adds up over tiles
(:func:`weight_accumulator`: an fp32 buffer, the split fp32 accumulator, or the compensated pair).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ...grads import HeadGrads, split_accumulator
from ...head_inputs import HeadInputs, NeededGrads
from ..protocol import HeadPass, TileGrads
from . import fp32_logits_rule, fused_matmul, logits_epilogues, quack_bridge, shifted_tile
from .compensated import RESIDUAL_DTYPE, one_pass_config
from .compensated_pair import compensated_scale_
from .one_pass_hidden import HiddenGradient
from .one_pass_rule import OnePassPlan
from .operands import gather_rows, new_rows_buffer, one_pass_rows
from .plan import fp32_logits, plan_one_pass
from .scaled_round import mul_into
from .tiles import finish_row_stats, gradient_tile, kernel_scalars, new_row_stats, row_slice, statistics_tile


#: Whether an exponential tile's gradients are taken row-scaled (:func:`~.shifted_tile.exp_tile_row_factors_`: no
#: pass writes ``dz``) where the loss has no entropy gradient and the logits no soft-cap and no bias; else the
#: gradient kernel turns the tile into ``dz`` first.
FACTORED_EXP_TILE = True


class Fp32WeightAccumulator:
    """An fp32 ``[V, H]`` buffer (``"fp32"`` for a gradient that is not 2-byte; ``"none"``: an fp32 gradient, which
    the buffer is): each tile's ``dzᵀ·h`` added by :func:`~.quack_bridge.matmul_f32_` (QuACK's matmul where it runs,
    else cuBLAS), the first tile writing it."""

    def __init__(self, weight: torch.Tensor, new) -> None:
        self.acc = new(weight.shape, dtype=torch.float32, device=weight.device)

    def add(self, r0: int, dz: torch.Tensor, h: torch.Tensor) -> None:
        quack_bridge.matmul_f32_(self.acc, dz.t(), h, accumulate=r0 > 0)

    def finish(self, grads: HeadGrads) -> None:
        grads.weight = self.acc


class SplitWeightAccumulator:
    """The fp32 accumulator of a 2-byte gradient: its first ``V // 2`` rows in the gradient's own bytes, the rest
    in a buffer (:func:`~hf_fused.ops.grads.split_accumulator`): ``2·V·H`` bytes beside the gradient, each tile's
    ``dW`` in two matmuls."""

    def __init__(self, weight: torch.Tensor, grad_dtype: torch.dtype, new, grads: HeadGrads, zero: bool) -> None:
        grads.weight = new(weight.shape, dtype=grad_dtype, device=weight.device)
        self.head, grads.weight_tail = split_accumulator(grads.weight, zero=zero)
        self.tail, self.v_split = grads.weight_tail, self.head.shape[0]

    def add(self, r0: int, dz: torch.Tensor, h: torch.Tensor) -> None:
        quack_bridge.matmul_f32_(self.head, dz[:, : self.v_split].t(), h, accumulate=r0 > 0)
        quack_bridge.matmul_f32_(self.tail, dz[:, self.v_split :].t(), h, accumulate=r0 > 0)

    def finish(self, grads: HeadGrads) -> None:
        pass  # the gradient and its tail are in grads already


class PairWeightAccumulator:
    """The compensated pair: the bf16 gradient itself plus an int8 residual, each tile folded in
    (:func:`~.quack_bridge.pair_addmm_`: in QuACK's matmul where it runs, else
    :func:`~.compensated.compensated_addmm_`), scaled by the upstream gradient in backward. Starts at zero: the
    fold reads what it adds to."""

    def __init__(self, weight: torch.Tensor, grads: HeadGrads) -> None:
        grads.weight = torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device)
        grads.weight_residual = torch.zeros(weight.shape, dtype=RESIDUAL_DTYPE, device=weight.device)
        grads.scale_pair = compensated_scale_
        self.grads = grads
        self.config = one_pass_config(weight.shape[0], weight.shape[1], weight.device)

    def add(self, r0: int, dz: torch.Tensor, h: torch.Tensor) -> None:
        quack_bridge.pair_addmm_(self.grads.weight, self.grads.weight_residual, dz.t(), h, config=self.config)

    def finish(self, grads: HeadGrads) -> None:
        pass


def weight_accumulator(plan: OnePassPlan, head: HeadInputs, need: NeededGrads, grads: HeadGrads):
    """The weight gradient's accumulator for ``plan`` (``None`` without a weight gradient). The first tile writes
    an fp32 accumulator (no fill, no read of zeros), unless no row is kept."""
    if not need.weight:
        return None
    weight, m_rows = head.weight, head.rows.numel()
    new = torch.empty if m_rows else torch.zeros
    grad_dtype = head.weight_gradient_dtype
    if plan.accumulator == "pair":
        return PairWeightAccumulator(weight, grads)
    if plan.accumulator == "fp32" and grad_dtype.itemsize == 2:
        return SplitWeightAccumulator(weight, grad_dtype, new, grads, zero=not m_rows)
    return Fp32WeightAccumulator(weight, new)


class TileStatistics:
    """Each tile's logits and statistics: with ``scaled_tile_n`` from QuACK's scaled-exp matmul
    (:func:`~.quack_bridge.scaled_exp_tile_n`: the statistics from the fp32 accumulator, the tile stored as
    ``exp(z − offset)`` with a power-of-two offset per row and ``scaled_tile_n`` columns; a tile it cannot take turns
    it off for the rest of the call); with ``fp32`` from :mod:`.fused_matmul`'s matmul (the statistics from the
    fp32 accumulator; with ``store_tile`` the tile stored shifted, its shifts in :attr:`offsets`, and the stored
    tile's own normalizer); else from QuACK's matmul epilogue while it runs (:attr:`fused`: only the log-sum-exp and
    label logit asked, :func:`~.quack_bridge.fuses_statistics`; a tile it cannot take turns it off for the rest of
    the call), else cuBLAS's tile and the statistics kernel. After each call :attr:`tile_offsets` holds the tile's
    shifts (None for a tile of raw logits) and :attr:`log_tile` whether it holds exponentials."""

    def __init__(self, fused: bool, weight: torch.Tensor, bias: Optional[torch.Tensor], scalars: dict,
                 return_entropy: bool, fp32: bool = False, tile_rows: int = 0, store_tile: bool = True,
                 scaled_tile_n: Optional[int] = None, logits_scale: float = 1.0) -> None:
        self.scaled_tile_n, self.tile_rows, self.store_tile = scaled_tile_n, tile_rows, store_tile
        self.logits_scale = logits_scale  # the scaled-exp matmul's z = acc·logits_scale (quack_bridge.logits_scale)
        self.fp32_after_scaled = fp32 and scaled_tile_n is not None  # where QuACK turns itself off mid-call
        fp32 = fp32 and scaled_tile_n is None
        # the scaled-exp matmul reduces the entropy's Σ p·z too: its statistics are complete, not "fused"
        self.fused, self.weight, self.bias, self.scalars, self.return_entropy = (
            fused and not fp32 and scaled_tile_n is None, weight, bias, scalars, return_entropy)
        self.fp32 = False
        self.tile_offsets: Optional[torch.Tensor] = None
        self.log_tile = False
        self.rounded_sum = self.offsets = None
        if fp32:
            self._use_fp32()
        if scaled_tile_n is not None:
            partials = (tile_rows, weight.shape[0] // scaled_tile_n)
            self.sum_exp, self.max_log2, self.shifts, self.sum_ez = (
                torch.empty(partials, dtype=torch.float32, device=weight.device) if i < 3 or return_entropy
                else None for i in range(4))

    def _use_fp32(self) -> None:
        self.fp32 = True
        stored = self.store_tile
        device = self.weight.device
        self.rounded_sum = torch.empty(self.tile_rows, dtype=torch.float32, device=device) if stored else None
        #: The shifts of the stored tile (fp32 ``[tile_rows, ⌈V / c⌉]``, :func:`~.fused_matmul.new_offsets`) or None.
        self.offsets = fused_matmul.new_offsets(self.tile_rows, self.weight.shape[0], device) if stored else None

    def _scaled_exp_tile(self, h: torch.Tensor, y: torch.Tensor, dz: torch.Tensor, row_stats) -> bool:
        """The tile from QuACK's scaled-exp matmul, its statistics from the partials; ``False`` where QuACK did not
        take it (then off for the rest of the call: the fused matmul where the fp32 statistics were asked, else
        cuBLAS)."""
        rows = h.shape[0]
        run_max, run_sum, run_zp, label_logit = row_stats[:4]
        sum_exp, max_log2, offsets = self.sum_exp[:rows], self.max_log2[:rows], self.shifts[:rows]
        sum_ez = None if self.sum_ez is None else self.sum_ez[:rows]
        if quack_bridge.scaled_exp_logits(h, self.weight, y, dz, sum_exp, max_log2, label_logit, self.scaled_tile_n,
                                          sum_ez, self.logits_scale):
            quack_bridge.scaled_exp_statistics_(sum_exp, max_log2, run_max, offsets, sum_ez, run_zp)
            run_sum.fill_(1.0)  # the log-sum-exp as (running max, Σexp) = (lse, 1), Σ p·z normalized
            self.tile_offsets, self.log_tile = offsets, True
            return True
        self.scaled_tile_n = None
        if self.fp32_after_scaled:
            self._use_fp32()
        return False

    def __call__(self, h: torch.Tensor, y: torch.Tensor, dz: torch.Tensor, row_stats) -> Optional[torch.Tensor]:
        """Fills ``dz`` with the tile's logits (but with ``fp32`` and no ``store_tile``; shifted with them, the
        rows' shifts in :attr:`offsets`; their exponentials with ``scaled_tile_n``) and ``row_stats`` with their
        statistics; returns the log-sum-exp that normalizes the stored tile's probabilities where it is not the
        statistics' own (``fp32`` with ``store_tile``), else None."""
        rows = h.shape[0]
        self.tile_offsets, self.log_tile = None, False
        if self.scaled_tile_n is not None and self._scaled_exp_tile(h, y, dz, row_stats):
            return None
        if self.fp32 and self.rounded_sum is None:  # dz from the accumulator later (TileGradients' recompute)
            fused_matmul.logits_statistics_(h, self.weight, y, row_stats, self.scalars,
                                            return_entropy=self.return_entropy, bias=self.bias)
            return None
        if self.rounded_sum is not None:
            self.tile_offsets = self.offsets[:rows]
            rounded_sum = self.rounded_sum[:rows].zero_()
            fused_matmul.logits_statistics_(h, self.weight, y, row_stats, self.scalars,
                                            return_entropy=self.return_entropy, bias=self.bias, tile=dz,
                                            rounded_sum=rounded_sum, offsets=self.offsets[:rows])
            # p = exp(z̃ − lse) sums to 1 over the stored logits z̃ with their own normalizer: dz's row sums stay 0
            # (with the statistics' own lse only to its logits' bf16 rounding: 2.5e-4 in test_fused_matmul's case)
            return row_stats[0] + rounded_sum.log()
        run_max, run_sum, _, label_logit = row_stats[:4]
        self.fused = self.fused and quack_bridge.logits_with_statistics(h, self.weight, y, dz, run_max, label_logit)
        if self.fused:
            run_sum.fill_(1.0)  # the log-sum-exp as (running max, Σexp) = (lse, 1)
        else:
            torch.mm(h, self.weight.t(), out=dz)
            statistics_tile(dz, 0, self.bias, y, row_stats, self.scalars, self.return_entropy)


class TileGradients:
    """Each tile's gradients once its statistics are in: ``tile_grads(r0, r1, logp, entropy) -> (g_lp, g_ent or
    None)`` on the tile's rows, the gradient kernel turning the same tile into ``dz`` (a shifted tile's,
    :func:`~.shifted_tile.shifted_gradient_`, where it comes with its shifts; or, with ``recompute``, the logits
    matmul again with ``dz`` from its fp32 accumulator, :func:`~.logits_epilogues.logits_grad_`), then ``dh``
    (complete within the tile), the weight accumulator's ``dW`` (:func:`weight_accumulator`) and the bias's. An
    exponential tile (QuACK's scaled-exp matmul) under a loss of the log-probs alone is not turned into ``dz``: it
    becomes ``dz``'s row-scaled form (:func:`~.shifted_tile.exp_tile_row_factors_`, :data:`FACTORED_EXP_TILE`),
    the row scale applied to ``dh`` after its matmul and to ``h`` before ``dW``'s."""

    def __init__(self, head: HeadInputs, plan: OnePassPlan, need: NeededGrads, tile_grads: TileGrads,
                 grads: HeadGrads, scalars: dict, return_entropy: bool, entropy_in_grads: bool,
                 recompute: bool = False) -> None:
        weight, bias = head.weight, head.bias
        self.weight, self.bias, self.scalars, self.grads, self.tile_grads = weight, bias, scalars, grads, tile_grads
        self.return_entropy, self.entropy_in_grads, self.recompute = return_entropy, entropy_in_grads, recompute
        self.d_weight = weight_accumulator(plan, head, need, grads)
        self.scaled_h: Optional[torch.Tensor] = None  # s·h of a row-scaled tile's rows (FACTORED_EXP_TILE)
        self.d_hidden = HiddenGradient(head) if need.hidden else None
        if need.bias and bias is not None:
            grads.bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)

    def __call__(self, r0: int, r1: int, h: torch.Tensor, y: torch.Tensor, dz: torch.Tensor, row_stats,
                 fused: bool, tile_lse: Optional[torch.Tensor] = None,
                 offsets: Optional[torch.Tensor] = None, log_tile: bool = False) -> None:
        """``tile_lse``: the log-sum-exp of the stored tile's logits where it is not the statistics' own (which the
        loss's gradients read), for the probabilities of ``dz``; ``offsets``: the shifts of a shifted tile
        (:class:`TileStatistics`), or None for a tile of raw logits; ``log_tile``: the shifted tile holds
        ``exp(z − offset)`` (QuACK's scaled-exp matmul). ``fused``: the statistics came from QuACK's bf16 epilogue
        without the entropy's Σ p·z (the gradient kernel adds it up where the entropy is returned)."""
        run_max, run_sum, run_zp, label_logit = row_stats[:4]
        lse = run_max + run_sum.log()
        ent = lse - run_zp / run_sum if self.entropy_in_grads and self.return_entropy and not fused else None
        g_lp, g_ent = self.tile_grads(r0, r1, label_logit - lse, ent)
        lse = lse if tile_lse is None else tile_lse
        row_scale = None  # dz = row_scale[:, None]·tile where the tile is left as it is
        if self.recompute:
            zeros = torch.zeros_like(lse)
            logits_epilogues.logits_grad_(
                h, self.weight, dz, y, lse, zeros if ent is None else ent, g_lp.float().contiguous(),
                zeros if g_ent is None else g_ent.float().contiguous(), has_g_lp=True, has_g_ent=g_ent is not None,
                col_offset=0, bias=self.bias, scalars=self.scalars, round_logits=False)
        elif (log_tile and g_ent is None and not self.scalars["SOFTCAP"] and self.grads.bias is None
              and FACTORED_EXP_TILE):
            # dz = s·E is never written: dh = s·(E @ W) and dW += Eᵀ·(s·h) (s·h rounded once to the operands' dtype)
            row_scale = shifted_tile.exp_tile_row_factors_(dz, offsets, dz.shape[1] // offsets.shape[1], lse, g_lp,
                                                           self.scalars, y, label_logit)
        elif offsets is not None:
            block = dz.shape[1] // offsets.shape[1] if log_tile else fused_matmul.shift_columns(dz.device)
            shifted_tile.shifted_gradient_(dz, offsets, block, lse, lse if ent is None else ent, g_lp, g_ent,
                                           self.scalars, labels=y, label_logit=label_logit, log_tile=log_tile)
        else:
            # fused statistics with an entropy asked for: Σ p·z into run_zp (run_sum is 1), for finish_row_stats
            gradient_tile(dz, 0, self.bias, y, lse, lse if ent is None else ent, g_lp,
                          lse if g_ent is None else g_ent, self.scalars, True, g_ent is not None,
                          sum_pz=run_zp if self.return_entropy and fused else None)
        if self.d_hidden is not None:
            self.d_hidden.add(r0, r1, dz, self.weight, row_scale)
        if self.d_weight is not None:
            if row_scale is not None:
                if self.scaled_h is None or self.scaled_h.shape[0] < h.shape[0]:  # one buffer for the call's tiles
                    self.scaled_h = torch.empty(h.shape, dtype=h.dtype, device=h.device)
                h = shifted_tile.scaled_rows_(self.scaled_h[: h.shape[0]], h, row_scale)
            self.d_weight.add(r0, dz, h)
        if self.grads.bias is not None:
            self.grads.bias += dz.float().sum(0)

    def finish(self) -> HeadGrads:
        if self.d_hidden is not None:
            self.d_hidden.finish(self.grads)
        if self.d_weight is not None:
            self.d_weight.finish(self.grads)
        return self.grads


def run_one_pass(head: HeadInputs, tile_grads: Optional[TileGrads], need: NeededGrads, return_entropy: bool,
                 statistics: Sequence[str], *, entropy_in_grads: bool = True) -> Optional[HeadPass]:
    """The one pass behind :meth:`~.backend.TritonCublasBackend.logprobs_with_grads` and
    :meth:`~.backend.TritonCublasBackend.token_loss_with_grads`: per full-vocabulary row block, the statistics
    (:class:`TileStatistics`), then, when ``tile_grads`` is given, the gradients (:class:`TileGradients`). ``None``
    when the planner chooses two passes; ``grads`` is ``None`` without ``tile_grads``. ``tile_grads`` is passed the
    entropy only with ``entropy_in_grads`` (its loss reads it); without, where QuACK's epilogue gives the
    statistics, a returned entropy comes from the gradient kernel's Σ p·z.

    Where the count of kept rows is still unread (:class:`~hf_fused.ops.kept_rows.KeptRows`) and more rows than one
    tile's are given, the first tile's statistics are launched on the first kept rows before the count is read
    (:data:`LEAD_TILE`): the host sync then waits for the queue while the device already has the tile's matmul,
    instead of leaving the device idle through the pass's set-up. Where fewer rows are kept than that tile holds,
    the tile is dropped and the pass starts over on the rows there are."""
    plan = plan_one_pass(head, need, fused_statistics=True)
    if plan is None:
        return None
    # Every tile reads the whole weight: under autocast one cast copy for the pass (the plan counted it)
    head = head.computed()
    weight, vocab_size = head.weight, head.weight.shape[0]
    scalars = kernel_scalars(head.transform, head.bias)
    kept = head.kept_rows
    lead = None
    if LEAD_TILE and not kept.known and kept.bound > plan.rows:
        lead = _lead_tile(head, plan, tile_grads, return_entropy, entropy_in_grads, statistics, scalars)
        if head.rows.numel() < plan.rows:  # the count read: fewer kept rows than the lead tile's
            lead = None
    if lead is None:
        m_rows = head.rows.numel()
        y, rows_operand, blocks = one_pass_rows(head, plan.rows)
        stats = new_row_stats(m_rows, weight.device, statistics)
        tile_statistics, tile_buf, recompute = _tile_statistics(head, plan, rows_operand, tile_grads, return_entropy,
                                                                entropy_in_grads, statistics, scalars)
    else:
        (tile_statistics, tile_buf, recompute), lead_stats, lead_h, stats, lead_state = lead
        stats = row_slice(stats, 0, head.rows.numel())
        # the later tiles' rows gathered into the lead tile's buffer: its gradients are queued before the next gather
        y, _, blocks = one_pass_rows(head, plan.rows, start=plan.rows, buf=lead_h)
    gradients = TileGradients(head, plan, need, tile_grads, HeadGrads(mul_into=mul_into), scalars, return_entropy,
                              entropy_in_grads, recompute)
    if lead is not None and tile_grads is not None:
        gradients(0, plan.rows, lead_h, y[: plan.rows], tile_buf[: plan.rows], lead_stats, *lead_state)
    for r0, r1, h in blocks:  # h: the tile's kept hidden rows [r1 − r0, H], in weight's dtype
        dz, row_stats = tile_buf[: r1 - r0], row_slice(stats, r0, r1)
        tile_lse = tile_statistics(h, y[r0:r1], dz, row_stats)
        if tile_grads is not None:
            gradients(r0, r1, h, y[r0:r1], dz, row_stats, tile_statistics.fused, tile_lse,
                      tile_statistics.tile_offsets, tile_statistics.log_tile)
    grads = gradients.finish()
    logp, entropy, lse, token_stats = finish_row_stats(stats, y, vocab_size, return_entropy, statistics)
    return HeadPass(logp, entropy, lse, grads if tile_grads is not None else None, token_stats)


#: Whether :func:`run_one_pass` launches its first tile before reading the count of kept rows (where it is unread
#: and more rows than a tile's are given); off, the count is read before the pass's set-up.
LEAD_TILE = True


def _tile_statistics(head: HeadInputs, plan: OnePassPlan, rows_operand: torch.Tensor,
                     tile_grads: Optional[TileGrads], return_entropy: bool, entropy_in_grads: bool,
                     statistics: Sequence[str], scalars: dict) -> tuple[TileStatistics, torch.Tensor, bool]:
    """``(the pass's TileStatistics, its [rows, V] tile buffer, whether dz is recomputed from the accumulator)``
    for the rows operand the tiles are read from."""
    weight = head.weight
    tile_rows = min(plan.rows, max(head.kept_rows.bound, 1))
    late_entropy = return_entropy and tile_grads is not None and not entropy_in_grads
    fused = quack_bridge.fuses_statistics(head, rows_operand, return_entropy and not late_entropy, statistics)
    fp32 = fp32_logits(head, "one_pass") and fp32_logits_rule.readable(rows_operand, weight)
    recompute = fp32 and fp32_logits_rule.one_pass_dz() == "recompute"
    scaled_tile_n = (quack_bridge.scaled_exp_tile_n(head, rows_operand, statistics)
                     if head.kept_rows.bound and not recompute else None)
    tile_statistics = TileStatistics(fused, weight, head.bias, scalars, return_entropy, fp32, tile_rows,
                                     store_tile=not recompute, scaled_tile_n=scaled_tile_n,
                                     logits_scale=quack_bridge.logits_scale(head) if scaled_tile_n else 1.0)
    return tile_statistics, torch.empty((tile_rows, weight.shape[0]), dtype=weight.dtype, device=weight.device), recompute


def _lead_tile(head: HeadInputs, plan: OnePassPlan, tile_grads: Optional[TileGrads], return_entropy: bool,
               entropy_in_grads: bool, statistics: Sequence[str], scalars: dict):
    """The first tile's statistics launched on the first ``plan.rows`` kept rows, their count unread
    (:meth:`~hf_fused.ops.kept_rows.KeptRows.leading`): ``(_tile_statistics' triple, the tile's row statistics, its
    hidden rows, the per-row accumulators of all N rows, (fused, tile_lse, offsets, log_tile))`` for
    :class:`TileGradients`. Its labels are clamped into ``[0, V)`` for the launch: the labels' range is checked
    with the count, and a row missing where fewer rows are kept is row 0, whatever its label."""
    rows, kept = plan.rows, head.kept_rows
    index = kept.leading(rows)
    h = gather_rows(head, index, new_rows_buffer(head, rows))
    y = head.labels.index_select(0, index).clamp_(0, head.weight.shape[0] - 1)
    stats = new_row_stats(kept.bound, head.weight.device, statistics)
    chosen = _tile_statistics(head, plan, h, tile_grads, return_entropy, entropy_in_grads, statistics, scalars)
    tile_statistics, tile_buf, _ = chosen
    row_stats = row_slice(stats, 0, rows)
    tile_lse = tile_statistics(h, y, tile_buf[:rows], row_stats)
    state = (tile_statistics.fused, tile_lse, tile_statistics.tile_offsets, tile_statistics.log_tile)
    return chosen, row_stats, h, stats, state
