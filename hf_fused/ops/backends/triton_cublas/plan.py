"""The GPU backend's plan for a call: which schedule runs, its tile and its accumulators, decided once per call.

**The default rule** (``tile_budget_bytes=None``) on a CUDA device: the one pass (:mod:`.one_pass_rule`) with
``ONE_PASS_TILE_ROWS`` rows per tile whenever its working set fits in ``ONE_PASS_FREE_SHARE`` of the memory free
at the call, with the fp32 weight-gradient accumulator, or else (bf16 weight gradient) with the compensated pair;
otherwise the two passes (:mod:`.two_pass_rule`) with a ``DEFAULT_TILE_BUDGET_BYTES`` tile. An explicit
``tile_budget_bytes`` is a hard bound instead, on everything the pass holds. On other devices the default is that
bound at ``DEFAULT_TILE_BUDGET_BYTES``.

**Where the logits' statistics come from** (:func:`fp32_logits`, per schedule): cuBLAS's bf16 tiles read back by
the Triton kernels, or, where :mod:`.fused_matmul` runs and is enabled (``HF_FUSED_FP32_LOGITS=1``; off by default
until its H200 measurement), the logits matmul's fp32 accumulator: fp32-faithful log-probs, and in the two passes
``dz`` from the accumulator too.

The loops ask :func:`plan_one_pass`, :func:`plan_statistics_pass` (:func:`plan_fp32_statistics_pass`) and
:func:`plan_gradient_pass`;
:func:`describe` says in one line what they would answer for a call; :func:`forced_plans` replaces the rule inside
a block (tile sweeps, tests).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional, Union

import torch

from ...head_inputs import HeadInputs, NeededGrads
from ...logit_transform import LogitTransform
from ...tiling import DEFAULT_TILE_BUDGET_BYTES
from . import fp32_logits_rule, fused_matmul, quack_bridge
from .matmul import wave_rows
from .one_pass_rule import (
    OnePassPlan, hidden_gradient_bytes, hidden_gradient_row_bytes, one_pass_accumulators, one_pass_plan,
    one_pass_working_set,
)
from .operands import compact_bytes, one_pass_gather_row_bytes
from .two_pass_rule import LeanPlan, accumulation_row_bytes, hidden_accumulator, two_pass_tile_plan

#: What :func:`forced_plans` put in place of the rule (empty outside such a block).
_FORCED: dict = {}


@contextlib.contextmanager
def forced_plans(*, one_pass: Union[None, bool, OnePassPlan] = None, two_pass: Optional[LeanPlan] = None):
    """Within the block the GPU backend takes these plans instead of the rule's, for every call: ``one_pass`` an
    :class:`~.one_pass_rule.OnePassPlan` (its ``rows`` per tile, and its ``accumulator`` where the call can use it,
    else the call's first choice: ``"none"`` for a frozen head or an fp32 weight gradient, ``"fp32"`` for fp16), or
    ``False`` for the two passes, or ``None`` (the rule decides); ``two_pass`` a :class:`~.two_pass_rule.LeanPlan`
    for the two passes' tile (``gather_rows`` included), or ``None``. For tile sweeps and tests: budgets are not
    checked, and the setting is process-wide, not per thread.

    Raises:
        TypeError: on a ``one_pass`` or ``two_pass`` of another type.
    """
    if not (one_pass is None or one_pass is False or isinstance(one_pass, OnePassPlan)):
        raise TypeError(f"forced_plans: one_pass must be a OnePassPlan, False or None, got {one_pass!r}")
    if not (two_pass is None or isinstance(two_pass, LeanPlan)):
        raise TypeError(f"forced_plans: two_pass must be a LeanPlan or None, got {two_pass!r}")
    previous = dict(_FORCED)
    _FORCED.update({k: v for k, v in (("one_pass", one_pass), ("two_pass", two_pass)) if v is not None})
    try:
        yield
    finally:
        _FORCED.clear()
        _FORCED.update(previous)


def one_pass_is_forced() -> bool:
    """Whether a :func:`forced_plans` block put a one-pass plan in place (its rows are then taken as given)."""
    return isinstance(_FORCED.get("one_pass"), OnePassPlan)


def forced_two_pass_plan() -> Optional[LeanPlan]:
    """The two passes' tile a :func:`forced_plans` block put in place (``None`` outside one)."""
    return _FORCED.get("two_pass")


# -- the one pass -------------------------------------------------------------------------------------------


def one_pass_extra_bytes(head: HeadInputs, need: NeededGrads) -> int:
    """What the one pass holds beyond its accumulator and tile that depends on the call's rows: the hidden-state
    gradient, held until backward (:func:`~.one_pass_rule.hidden_gradient_bytes`; the kept rows counted before
    their count is read by the bound :class:`~hf_fused.ops.kept_rows.KeptRows` gives without a host sync) and,
    under autocast, the whole casts the pass makes (:meth:`~hf_fused.ops.head_inputs.HeadInputs.cast_bytes`)."""
    gradient = hidden_gradient_bytes(head.hidden_gradient_dtype, head.hidden.shape[0], head.kept_rows.bound,
                                     head.weight.shape[1]) if need.hidden else 0
    return gradient + head.cast_bytes()


def one_pass_row_bytes(head: HeadInputs, need: NeededGrads, fused_statistics: bool = True) -> int:
    """What the one pass holds per tile row beside the ``[rows, V]`` tile: where rows are gathered, each tile's
    gathered hidden rows (:func:`~.operands.one_pass_gather_row_bytes`), with ``need.hidden`` the buffer the
    hidden-state gradient passes through (:func:`~.one_pass_rule.hidden_gradient_row_bytes`) and, with
    ``fused_statistics`` where the
    statistics come from the fp32 accumulator (:func:`fp32_logits`), the fused matmul's partials, the stored tile's
    shifts and normalizer (:func:`~.fused_matmul.stored_tile_row_bytes`: 42,736 bytes a row beside a 303,872-byte
    bf16 row at V = 151,936 on a GPU), or, where QuACK's scaled-exp matmul may give them instead, its per-tile
    partials (:func:`~.quack_bridge.scaled_exp_row_bytes`: 18,992 bytes a row at V = 151,936)."""
    row_bytes = one_pass_gather_row_bytes(head.computed(meta=True))
    if need.hidden:
        row_bytes += hidden_gradient_row_bytes(head.hidden_gradient_dtype, head.weight.shape[1])
    if fused_statistics and fp32_logits(head, "one_pass"):
        row_bytes += fused_matmul.stored_tile_row_bytes(head.weight.shape[0], head.weight.device)
    elif fused_statistics:
        row_bytes += quack_bridge.scaled_exp_row_bytes(head)
    return row_bytes


def plan_one_pass(head: HeadInputs, need: NeededGrads, *, fused_statistics: bool = False) -> Optional[OnePassPlan]:
    """The call's one pass (tile rows and weight-gradient accumulator), or ``None`` for the two passes: a
    :func:`forced_plans` block's, else :func:`~.one_pass_rule.one_pass_plan`'s, counting
    :func:`one_pass_extra_bytes` and each tile row's :func:`one_pass_row_bytes` (``fused_statistics``: the caller
    takes the statistics from the fused matmul where :func:`fp32_logits` says so, as :mod:`.one_pass`'s loop does;
    other passes that borrow the one pass's plan count their own buffers)."""
    if head.tile_budget_bytes is not None:
        head.rows  # an explicit budget is tiled by the call's own count of kept rows: read it first
    view = head.computed(meta=True)
    weight = view.weight
    vocab_size, hidden_size = weight.shape
    accumulators = one_pass_accumulators(need.weight, view.weight_gradient_dtype, weight.dtype)
    forced = _FORCED.get("one_pass")
    if forced is False:
        return None
    if forced is not None:
        return forced if forced.accumulator in accumulators else OnePassPlan(forced.rows, accumulators[0], forced.bytes)
    return one_pass_plan(vocab_size, hidden_size, weight.element_size(), accumulators, head.tile_budget_bytes,
                         head.weight.device, one_pass_extra_bytes(head, need),
                         one_pass_row_bytes(head, need, fused_statistics))


# -- the two passes -----------------------------------------------------------------------------------------


def plan_two_passes(head: HeadInputs, *, reserved_bytes: int = 0, accumulator_row_bytes: int = 0,
                    weight_chunk: bool = False, row_quantum: int = 1) -> LeanPlan:
    """The two passes' tile for ``head``: a :func:`forced_plans` block's, else
    :func:`~.two_pass_rule.two_pass_tile_plan`'s (under the default rule the tile alone within
    ``DEFAULT_TILE_BUDGET_BYTES`` beside one compact copy of the kept hidden rows; under an explicit budget
    :func:`~.two_pass_rule.lean_two_pass_plan`, which counts the accumulator (``reserved_bytes``, moving
    ``accumulator_row_bytes`` per row and chunk), the kept rows (a compact copy or a per-block gather) and the fp32
    weight-gradient chunk (``weight_chunk``) inside the budget, row blocks in whole ``row_quantum``s)."""
    forced = forced_two_pass_plan()
    if forced is not None:
        return forced
    hidden, weight = head.hidden, head.weight
    m_rows, (vocab_size, hidden_size), elem = head.rows.numel(), weight.shape, head.operand_dtype.itemsize
    cast = hidden.dtype != head.operand_dtype  # gathered rows pass through hidden's dtype before the cast
    return two_pass_tile_plan(
        m_rows, hidden_size, vocab_size, elem, head.tile_budget_bytes, reserved_bytes=reserved_bytes,
        copy_bytes=compact_bytes(head),
        gather_row_bytes=hidden_size * (elem + (hidden.element_size() if cast else 0)),
        accumulator_row_bytes=accumulator_row_bytes, weight_chunk=weight_chunk, row_quantum=row_quantum,
        # an fp32 weight under autocast: each vocabulary chunk cast into a [cols, H] buffer (no whole copy)
        col_bytes=hidden_size * elem if head.casts_weight() else 0,
    )


def plan_statistics_pass(head: HeadInputs) -> LeanPlan:
    """The statistics pass's tile: :func:`plan_two_passes` with nothing reserved beside it."""
    return plan_two_passes(head)


def fp32_logits(head: HeadInputs, schedule: str) -> bool:
    """Whether the call's logits matmuls in ``schedule`` (``"two_passes"`` or ``"one_pass"``) take the statistics
    (and, in the gradient pass, ``dz``) from their fp32 accumulator (:mod:`.fused_matmul`) rather than from cuBLAS's
    tiles rounded to bf16: where that kernel :func:`~.fp32_logits_rule.runs_on` the weight as the matmuls read it
    (not cast chunk by chunk under autocast) and is enabled for the schedule (its ``DEFAULT_ENABLED``, or
    ``HF_FUSED_FP32_LOGITS``): the one pass of a call that returns its log-probs (``head.returns_logprobs``) asks
    for ``"one_pass_logprobs"``, the cross-entropy's for ``"one_pass"``."""
    weight = head.weight
    if head.casts_weight() or head.hidden.shape[-1] != weight.shape[1]:
        return False
    if schedule == "one_pass" and head.returns_logprobs:
        schedule = "one_pass_logprobs"
    return fp32_logits_rule.runs_on(weight, schedule)


#: Row blocks of the fp32 statistics pass come in multiples of this many rows (below all of them): each block's
#: label slice then starts 16-byte aligned, as QuACK's TMA needs (:func:`~.quack_bridge.aligned16`).
STATISTICS_ROW_QUANTUM = 8


def plan_fp32_statistics_pass(head: HeadInputs, statistics: int, return_entropy: bool = False) -> LeanPlan:
    """The fp32 statistics pass's row blocks (whole vocabulary rows, no tile): as many rows as fit in the tile
    budget (``DEFAULT_TILE_BUDGET_BYTES`` by default) at their partials' bytes (``statistics`` per output tile,
    :func:`~.fused_matmul.partial_row_bytes`, or QuACK's where it may take the pass and holds more:
    :func:`~.quack_bridge.statistics_row_bytes`) and, where the statistics pass would gather its rows
    (:func:`plan_statistics_pass`), their gathered hidden rows; in whole ``STATISTICS_ROW_QUANTUM``s where there
    are several blocks and room for one."""
    vocab_size, hidden_size = head.weight.shape
    gather = plan_statistics_pass(head).gather_rows
    row_bytes = fused_matmul.partial_row_bytes(vocab_size, statistics, head.weight.device)
    if quack_bridge.scaled_exp_row_bytes(head):
        tile_n = quack_bridge.tile_n_for(vocab_size)
        row_bytes = max(row_bytes, quack_bridge.statistics_row_bytes(vocab_size, tile_n, return_entropy))
    row_bytes += hidden_size * head.operand_dtype.itemsize if gather else 0
    budget = DEFAULT_TILE_BUDGET_BYTES if head.tile_budget_bytes is None else head.tile_budget_bytes
    rows = max(1, min(head.rows.numel(), budget // row_bytes))
    if rows < head.rows.numel() and rows >= STATISTICS_ROW_QUANTUM:
        rows -= rows % STATISTICS_ROW_QUANTUM
    return LeanPlan(rows, vocab_size, gather, rows * row_bytes)


@dataclass(frozen=True)
class GradientPassPlan:
    """The gradient pass of a call: its ``tile``, how the hidden-state gradient adds up over vocabulary chunks
    (``hidden_accumulator``: ``"pair"``, ``"fp32"`` or ``"none"`` for an fp32 gradient, as
    :func:`~.two_pass_rule.hidden_accumulator` says) and whether the call accumulates it as the compensated
    ``pair`` (a bf16 gradient of bf16 operands that needs it), and the accumulator's bytes beside the gradient."""

    tile: LeanPlan
    hidden_accumulator: str
    pair: bool
    accumulator_bytes: int


def plan_gradient_pass(head: HeadInputs, need: NeededGrads) -> GradientPassPlan:
    """The gradient pass's plan: the hidden-gradient accumulator (fp32 under the default rule, cuBLAS writes it;
    under an explicit budget, for bf16, the compensated pair, whose residual the budget then covers) and the
    tile that fits beside it, in row blocks that fill whole waves of the pair's persistent matmul
    (:func:`~.matmul.wave_rows`)."""
    hidden, hidden_size = head.hidden, head.weight.shape[1]
    kind, extra = hidden_accumulator(head.rows.numel(), hidden_size, hidden.dtype, head.tile_budget_bytes)
    pair = need.hidden and kind == "pair" and head.operand_dtype == torch.bfloat16
    moved = accumulation_row_bytes("pair" if pair else "fp32", hidden_size, hidden.element_size()) if (
        need.hidden) else 0
    tile = plan_two_passes(head, reserved_bytes=extra if need.hidden else 0, accumulator_row_bytes=moved,
                           weight_chunk=need.weight,
                           row_quantum=wave_rows(hidden_size, head.weight.device) if pair else 1)
    return GradientPassPlan(tile, kind, pair, extra)


# -- what a call would run ----------------------------------------------------------------------------------


def describe(weight: torch.Tensor, *, n_rows: int, tile_budget_bytes: Optional[int] = None,
             need_weight: Optional[bool] = None, n_tokens: Optional[int] = None) -> str:
    """One line saying which schedule a call with ``weight`` (``[V, H]``, on its device), ``n_rows`` kept tokens
    out of ``n_tokens`` (default: all kept) and hidden states in the weight's dtype that need a gradient would take
    now, its working set, and where the statistics come from when it is the fp32 accumulator: the answers of
    :func:`plan_one_pass`, :func:`plan_gradient_pass` and :func:`fp32_logits` for such a call (a call that can take
    the one pass: cross-entropy, a token loss, hinted log-probs)."""
    vocab_size, hidden_size = weight.shape
    n_tokens = n_rows if n_tokens is None else n_tokens
    need = NeededGrads(True, weight.requires_grad if need_weight is None else need_weight, False)

    def meta(*shape, dtype):  # the planner reads shapes and dtypes only (the weight's device: the real one)
        return torch.empty(shape, dtype=dtype, device="meta")

    head = HeadInputs(meta(n_tokens, hidden_size, dtype=weight.dtype), weight, None,
                      meta(n_tokens, dtype=torch.long), meta(n_rows, dtype=torch.long), LogitTransform(),
                      tile_budget_bytes)
    plan = plan_one_pass(head, need, fused_statistics=True)
    if plan:
        size = one_pass_working_set(vocab_size, hidden_size, weight.element_size(), plan.accumulator,
                                    min(plan.rows, max(n_rows, 1)), one_pass_extra_bytes(head, need),
                                    one_pass_row_bytes(head, need))
        return (f"one pass (6·N·H·V): {plan.rows} rows per tile, {size / 2**30:.2f} GiB working set with the "
                f"weight-gradient accumulator {plan.accumulator!r}" + _one_pass_statistics_source(head))
    gradient = plan_gradient_pass(head, need)
    tile, copy = gradient.tile, compact_bytes(head)
    size = tile.bytes
    if tile_budget_bytes is None:  # the default's tile is its own budget: the accumulator and copy come beside it
        size += gradient.accumulator_bytes + copy
    rows_how = "gathered per block" if tile.gather_rows else "a compact copy" if copy else "in place"
    return (f"two passes (8·N·H·V): {tile.block_rows}×{tile.cols} tile, {size / 2**30:.2f} GiB working set with the "
            f"hidden-state gradient's accumulator ({gradient.hidden_accumulator}, for {weight.dtype} hidden states), "
            f"kept rows {rows_how}" + _two_passes_statistics_source(head))


def _statistics_source(weight: torch.Tensor, schedule: str) -> str:
    """What :func:`describe` adds where the schedule takes the statistics from the fp32 accumulator."""
    if not fp32_logits_rule.runs_on(weight, schedule):
        return ""
    return "; log-prob statistics from the matmul's fp32 accumulator"


def _takes_quack(head: HeadInputs, schedule: str) -> bool:
    """Whether a call like ``head``'s would take QuACK's scaled-exp matmul in ``schedule`` (``"one_pass_quack"`` or
    ``"two_passes_quack"``, :func:`~.quack_bridge.scaled_exp_tile_n`'s rule without the rows operand)."""
    return (quack_bridge.scaled_exp_row_bytes(head) > 0 and fp32_logits_rule.enabled(schedule, head.weight.device)
            and quack_bridge.load() is not None)


def _two_passes_statistics_source(head: HeadInputs) -> str:
    """:func:`_statistics_source` of the two passes, which take QuACK's epilogues where it is installed and asked
    for (``"two_passes_quack"``)."""
    source = _statistics_source(head.weight, "two_passes")
    if source and _takes_quack(head, "two_passes_quack"):
        return "; log-prob statistics from the fp32 accumulator of QuACK's matmul epilogues"
    return source


def _one_pass_statistics_source(head: HeadInputs) -> str:
    """:func:`_statistics_source` of the one pass, whose default differs for the cross-entropy's loss and where QuACK
    is installed (``"one_pass_quack"``)."""
    weight = head.weight
    if _takes_quack(head, "one_pass_quack"):
        return "; statistics from the fp32 accumulator of QuACK's scaled-exp matmul"
    source = _statistics_source(weight, "one_pass_logprobs")
    if source and not fp32_logits_rule.runs_on(weight, "one_pass"):
        source += " (the cross-entropy's: from its bf16 tiles)"
    return source
