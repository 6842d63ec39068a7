"""The one pass's rule: rows per full-vocabulary tile and the weight-gradient accumulator, from sizes and memory.

The one pass (6·N·H·V FLOPs, :mod:`.one_pass`) holds a ``[rows, V]`` tile in the weight's dtype (and per row what
comes beside it: gathered hidden rows, the fp32 statistics' partials and shifts) and a ``[V, H]``
weight-gradient accumulator beside the gradient (:data:`ACCUMULATOR_BYTES`): ``"fp32"``, the fastest (for a
2-byte gradient half of it in the gradient's own bytes, :func:`hf_fused.ops.grads.split_accumulator`); ``"pair"``,
the gradient itself plus an int8 residual (:mod:`.compensated`: as accurate, half the fp32 one's bytes; folded in
QuACK's matmul epilogue where it runs, else by the Triton kernel, 1.17× and 1.4× QuACK's fp32 accumulation at
``[151936, 2048]``: the one pass 3–6 % slower than with ``"fp32"`` at 22–30 % less memory, docs/performance.md,
H200, 2026-11-30); ``"none"`` for a frozen lm_head or an fp32 gradient, which is its own accumulator.

Under the default rule (no ``tile_budget_bytes``) on a CUDA device it runs with ``ONE_PASS_TILE_ROWS`` rows
whenever its working set fits in ``ONE_PASS_FREE_SHARE`` of the memory free at the call, with the first
accumulator that fits; under an explicit budget (or off CUDA, at ``DEFAULT_TILE_BUDGET_BYTES``), only if the
budget holds at least ``MIN_ONE_PASS_ROWS`` rows, with the fp32 accumulator when it leaves full tiles, else with
the accumulator that leaves the most rows. :func:`one_pass_plan` returns ``None`` where the two passes run instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ...tiling import check_tile_budget

#: Rows per full-vocabulary tile under the default rule (1024-row tiles measured 11 ms slower at
#: 32768×2048×151936 on an H100: the dW accumulation GEMM's K dimension is the tile's rows).
ONE_PASS_TILE_ROWS = 2048
#: With an explicit budget: fewer rows than this and the one pass is not worth it (two passes instead).
MIN_ONE_PASS_ROWS = 512
#: Rows per tile are a multiple of this, so that every tile's slices of the per-row vectors (fp32, int64) start
#: 16-byte aligned, as QuACK's TMA loads and stores of them require.
ONE_PASS_ROW_ALIGN = 8
#: The default rule: the one pass's working set may take at most this share of the device's free memory.
ONE_PASS_FREE_SHARE = 0.25
#: Bytes per element of the compensated pair's residual (``compensated.RESIDUAL_DTYPE``, int8 fixed point; kept
#: here so that planning needs no Triton import; a test checks that the two agree).
PAIR_RESIDUAL_BYTES = 1
#: Bytes per ``[V, H]`` element of each weight-gradient accumulator beyond the gradient itself.
ACCUMULATOR_BYTES = {"none": 0, "fp32": 2, "pair": PAIR_RESIDUAL_BYTES}


@dataclass(frozen=True)
class OnePassPlan:
    """The one pass of a call: ``rows`` per full-vocabulary tile, the weight-gradient ``accumulator`` (``"none"``,
    ``"fp32"`` or ``"pair"``) and the working set in ``bytes`` at those rows."""

    rows: int
    accumulator: str
    bytes: int


def one_pass_working_set(
    vocab_size: int, hidden_size: int, elem_bytes: int, accumulator: str, rows: int, extra_bytes: int = 0,
    row_bytes: int = 0,
) -> int:
    """Bytes the one pass holds beyond inputs and outputs: the ``accumulator``'s (:data:`ACCUMULATOR_BYTES` per
    ``[V, H]`` element), a ``[rows, V]`` tile in the weight's dtype, ``row_bytes`` per tile row beside it (where
    ignored tokens are dropped, each tile's kept hidden rows gathered into a ``[rows, H]`` buffer, through hidden's
    dtype when it differs; with the statistics from the fp32 accumulator, the fused matmul's partials and the
    stored tile's shifts: :func:`~.plan.one_pass_row_bytes`), and ``extra_bytes`` (what depends on the call's token
    rows: the kept rows' fp32 hidden-state gradient, held until backward).

    Raises:
        ValueError: on an ``accumulator`` not in :data:`ACCUMULATOR_BYTES`.
    """
    if accumulator not in ACCUMULATOR_BYTES:
        raise ValueError(f"accumulator must be one of {sorted(ACCUMULATOR_BYTES)}, got {accumulator!r}")
    return (vocab_size * hidden_size * ACCUMULATOR_BYTES[accumulator]
            + rows * (vocab_size * elem_bytes + row_bytes) + extra_bytes)


def free_device_bytes(device: torch.device) -> Optional[int]:
    """Memory a new allocation can take on a CUDA ``device`` (driver-free plus the caching allocator's reserved
    but unallocated bytes); ``None`` elsewhere."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    # the allocator's nested statistics read once: memory_reserved() and memory_allocated() each flatten the
    # whole dict in Python (~0.3 ms apiece on an H200, right after the call's host sync, with the GPU idle)
    stats = torch.cuda.memory_stats_as_nested_dict(device)
    current = lambda key: stats.get(key, {}).get("all", {}).get("current", 0)  # noqa: E731
    return free + current("reserved_bytes") - current("allocated_bytes")


def hidden_gradient_kind(hidden_dtype: torch.dtype) -> str:
    """Where the one pass keeps the kept rows' hidden-state gradients until backward (:mod:`.one_pass_hidden`):
    ``"pair"`` for bf16 hidden states (the gradient itself plus an int8 residual), ``"scattered"`` for fp32 ones
    (the gradient itself), ``"rows"`` otherwise (an fp32 ``[M, H]`` buffer)."""
    return {torch.bfloat16: "pair", torch.float32: "scattered"}.get(hidden_dtype, "rows")


def hidden_gradient_bytes(grad_dtype: torch.dtype, tokens: int, kept_rows: int, hidden_size: int) -> int:
    """Bytes the one pass holds from the forward for a hidden-state gradient in ``grad_dtype``, by its
    :func:`hidden_gradient_kind`: the whole gradient (``tokens`` rows) for ``"pair"`` and ``"scattered"``, with the
    pair's residual (:data:`PAIR_RESIDUAL_BYTES` per kept element); ``"rows"``: fp32 ``[kept_rows, H]``. What a
    tile adds beside it is :func:`hidden_gradient_row_bytes`."""
    kind = hidden_gradient_kind(grad_dtype)
    if kind == "rows":
        return kept_rows * hidden_size * 4
    whole = tokens * hidden_size * grad_dtype.itemsize
    return whole + (kept_rows * hidden_size * PAIR_RESIDUAL_BYTES if kind == "pair" else 0)


def hidden_gradient_row_bytes(grad_dtype: torch.dtype, hidden_size: int) -> int:
    """Bytes per tile row for a hidden-state gradient in ``grad_dtype``: the fp32 ``[rows, H]`` buffer each tile's
    product passes through on its way into the gradient's rows (kinds ``"pair"`` and ``"scattered"``)."""
    return 0 if hidden_gradient_kind(grad_dtype) == "rows" else hidden_size * 4


def one_pass_accumulators(need_weight: bool, grad_dtype: torch.dtype, operand_dtype: torch.dtype) -> tuple[str, ...]:
    """The weight-gradient accumulators a call can use, fastest first (:func:`one_pass_plan`): none without a
    weight gradient or for an fp32 one (it is the accumulator), ``"fp32"`` or the compensated ``"pair"`` for a
    bf16 gradient of bf16 operands (the pair's matmul takes bf16 only), ``"fp32"`` otherwise."""
    if not need_weight or grad_dtype == torch.float32:
        return ("none",)
    if grad_dtype == operand_dtype == torch.bfloat16:
        return ("fp32", "pair")
    return ("fp32",)


def one_pass_rows(
    vocab_size: int,
    hidden_size: int,
    elem_bytes: int,
    accumulator: str,
    tile_budget_bytes: Optional[int],
    device: torch.device,
    extra_bytes: int = 0,
    row_bytes: int = 0,
) -> int:
    """Rows per full-vocabulary tile with this ``accumulator``, or 0 where it does not fit (module docstring's
    rule); ``extra_bytes`` and ``row_bytes`` as in :func:`one_pass_working_set`.

    Raises:
        ValueError: if an explicit budget is not a positive integer.
    """
    if tile_budget_bytes is None:
        free = free_device_bytes(device)
        if free is not None:
            needed = one_pass_working_set(vocab_size, hidden_size, elem_bytes, accumulator, ONE_PASS_TILE_ROWS,
                                          extra_bytes, row_bytes)
            return ONE_PASS_TILE_ROWS if needed <= ONE_PASS_FREE_SHARE * free else 0
    budget = check_tile_budget(tile_budget_bytes)
    rows = (budget - one_pass_working_set(vocab_size, hidden_size, elem_bytes, accumulator, 0, extra_bytes)) // (
        vocab_size * elem_bytes + row_bytes
    )
    rows -= rows % ONE_PASS_ROW_ALIGN
    return rows if rows >= MIN_ONE_PASS_ROWS else 0


def one_pass_plan(
    vocab_size: int,
    hidden_size: int,
    elem_bytes: int,
    accumulators: tuple[str, ...],
    tile_budget_bytes: Optional[int],
    device: torch.device,
    extra_bytes: int = 0,
    row_bytes: int = 0,
) -> Optional[OnePassPlan]:
    """The one pass the module docstring's rule picks, or ``None`` for the two passes.

    Args:
        accumulators: the weight-gradient accumulators the call can use, fastest first
            (:func:`one_pass_accumulators`).
        extra_bytes, row_bytes: as in :func:`one_pass_working_set`.

    Raises:
        ValueError: if an explicit budget is not a positive integer, or ``accumulators`` is empty.
    """
    if not accumulators:
        raise ValueError("one_pass_plan needs at least one accumulator kind")
    # the fastest accumulator while it keeps full-size tiles (fewer rows per tile cost more than its speed gives),
    # else the one leaving the most rows; the next kind is asked only when the faster one falls short (the default
    # rule reads free memory per ask)
    best_rows, best_kind = 0, None
    for kind in accumulators:
        rows = one_pass_rows(vocab_size, hidden_size, elem_bytes, kind, tile_budget_bytes, device, extra_bytes,
                             row_bytes)
        if rows >= ONE_PASS_TILE_ROWS:
            best_rows, best_kind = rows, kind
            break
        if rows > best_rows:
            best_rows, best_kind = rows, kind
    if best_kind is None:
        return None
    size = one_pass_working_set(vocab_size, hidden_size, elem_bytes, best_kind, best_rows, extra_bytes,
                                row_bytes)
    return OnePassPlan(best_rows, best_kind, size)
