"""Whether a call takes the logits' statistics from the matmul's fp32 accumulator (:mod:`.fused_matmul`): asked for
(per schedule, :data:`DEFAULT_ENABLED`; the environment's :data:`ENV`; a :func:`forced` block) and possible (the
device, the dtypes and the operands' layout). :func:`~.plan.fp32_logits` decides with it for each call.
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch

from ...devices import capability
from .matmul import tma_operand

#: The environment variable that turns the fp32 statistics on (``1``) or off (``0``) for the process, in every
#: schedule; unset, the plan's default (:data:`DEFAULT_ENABLED`) holds.
ENV = "HF_FUSED_FP32_LOGITS"

#: Whether the GPU backend takes its statistics from the fused matmul by default where it runs (on a CUDA device; CPU
#: tensors only when asked), per schedule:
#:
#: * ``"two_passes"`` (the statistics pass, and ``dz`` from the accumulator in the gradient pass): on; per-token
#:   log-probs within 3e-6 nats of an fp32-accumulated matmul where cuBLAS's bf16 tiles are 6e-2 off, the forward
#:   −0.8 to +1.0 ms and forward + backward −0.3 to +2.5 ms of theirs at 8192–32768 × 2048–4096 × 128256–151936,
#:   H200, 2026-11-29.
#: * ``"one_pass_logprobs"``, the one pass of a call that returns per-token log-probs (log-probs with a gradient
#:   hint, token losses, the RL objectives: ``HeadInputs.returns_logprobs``; statistics and the stored tile from one
#:   matmul): on, so that they are the statistics pass's (a trainer's old log-probs and its loss's agree at the same
#:   weights: an off-policy ratio of exactly 1 there, where bf16 tiles put them 2.4e-2 nats RMS, 7.9e-2 at most
#:   apart, ``python -m benchmarks.rl_parity``, H200, 2026-11-29), and their gradients 2.3e-3 from float64 where
#:   cuBLAS's tiles give 6.7e-3; with the tile stored through a TMA descriptor the cross-entropy's one pass runs 3–6 %
#:   slower this way than with cuBLAS's tiles and the statistics kernel (8192–32768 × 2048–4096 × 128256–151936:
#:   25.1 / 99.8 / 80.1 ms against 23.9 / 96.8 / 75.7, loss 1.5–2.9e-6 from float64 against 7.5–8.9e-6, gradients
#:   2.3e-3 against 6.8e-3; H200, 2026-11-29, docs/performance.md).
#: * ``"one_pass"``, the cross-entropy's one pass (its reduced loss alone leaves the op): off, at that cost (QuACK,
#:   which never rounds the logits, takes 24.3 / 97.8 / 85.0 ms there: the default is 0.90–0.99× its time).
#: * ``"one_pass_quack"``: the one pass of a call whose statistics QuACK's matmul epilogue can give (the log-sum-exp
#:   and label logit alone, :func:`~.quack_bridge.scaled_exp_tile_n`), where QuACK is installed: on; its scaled-exp
#:   matmul stores ``2^(z·log2 e − k)`` in bf16 (``k`` a power-of-two shift per row and column tile) and reduces the
#:   statistics from the fp32 accumulator, in place of either of the two above: the cross-entropy at QuACK's
#:   accuracy (loss 1.5–2.9e-6 from float64, gradients 2.3–2.4e-3) in 1.02–1.04× the bf16 tiles' time, GRPO's one pass
#:   2–3 % faster than on the fused matmul; its log-probs agree with the statistics pass's to fp32 summation order
#:   (1.9e-6 nats at most) rather than bit for bit (H200, 2026-11-30, docs/performance.md).
#: * ``"two_passes_quack"``: the two passes' statistics and ``dz`` from QuACK's matmul epilogues where it is installed:
#:   the statistics pass as the scaled-exp matmul with nothing stored (:func:`~.quack_bridge.scaled_exp_row_stats_`;
#:   logits that are the matmul's times a constant: raw, a logit scale, a temperature), ``dz`` as
#:   ``scale·exp(z − lse)`` of the accumulator (:func:`~.quack_bridge.softmax_grad`; the same logits, and a gradient
#:   that reaches the log-probs alone, else the fused matmul's epilogue), both from the fp32 accumulator
#:   like the fused matmul's in place of which they run: on; the lean cross-entropy (256 MiB) 29.6 / 118.3 / 109.6 ms
#:   against 31.6 / 123.3 / 106.6 on the fused matmul at 8192–32768 × 2048–4096 × 128256–151936, GRPO's lean path
#:   117.8 / 233.1 / 117.9 against 121.5 / 236.1 / 124.9 (H200, 2026-11-30, docs/performance.md).
DEFAULT_ENABLED = {"two_passes": True, "one_pass_logprobs": True, "one_pass": False, "one_pass_quack": True,
                   "two_passes_quack": True}

#: How the one pass with the fp32 statistics makes ``dz``: ``"tile"``, the fused matmul also stores the bf16 tile,
#: shifted by each 64 columns' row maximum (the shifts and its own normalizer beside it), and the gradient kernel
#: turns it into ``dz`` (6·N·H·V; as accurate as ``dz`` from the accumulator, :mod:`.fused_matmul`); or
#: ``"recompute"``, the statistics alone, then the logits matmul again with ``dz`` from its fp32 accumulator
#: (:func:`~.logits_epilogues.logits_grad_`; 8·N·H·V, no bf16 logits anywhere). :data:`DZ_ENV` overrides it.
ONE_PASS_DZ = "tile"
DZ_ENV = "HF_FUSED_FP32_ONE_PASS_DZ"
_DZ_MODES = ("tile", "recompute")

# What a ``forced`` block set: None (the rule of :func:`enabled`), True or False.
_FORCED: dict = {}


@contextlib.contextmanager
def forced(enabled: bool, one_pass_dz: Optional[str] = None):
    """Within the block the plan's ``fp32_logits`` choice is ``enabled`` for every call whose operands the kernel
    can read (tests: True runs the kernel under Triton's interpreter on CPU; benchmarks: True or False to time
    either), and the one pass's ``dz`` is made as ``one_pass_dz`` says (:data:`ONE_PASS_DZ`'s values; None: the
    rule of :func:`one_pass_dz`). Process-wide, not per thread.

    Raises:
        ValueError: for another ``one_pass_dz``.
    """
    if one_pass_dz is not None and one_pass_dz not in _DZ_MODES:
        raise ValueError(f"one_pass_dz must be one of {_DZ_MODES} or None, got {one_pass_dz!r}")
    previous = dict(_FORCED)
    _FORCED["enabled"] = bool(enabled)
    if one_pass_dz is not None:
        _FORCED["one_pass_dz"] = one_pass_dz
    try:
        yield
    finally:
        _FORCED.clear()
        _FORCED.update(previous)


def enabled(schedule: str = "two_passes", device: Optional[torch.device] = None) -> bool:
    """Whether the fp32 statistics are asked for in ``schedule`` (a key of :data:`DEFAULT_ENABLED`) on ``device``: a
    :func:`forced` block's answer, else the environment's (:data:`ENV` ``=1`` or ``=0``), else
    :data:`DEFAULT_ENABLED`'s on a CUDA device (``device`` None: the default's as on one), off elsewhere (CPU results
    stay the stored tiles' path's, bit for bit).

    Raises:
        ValueError: for another ``schedule``, or a value of :data:`ENV` other than ``0`` or ``1``.
    """
    if schedule not in DEFAULT_ENABLED:
        raise ValueError(f"schedule must be one of {sorted(DEFAULT_ENABLED)}, got {schedule!r}")
    if "enabled" in _FORCED:
        return _FORCED["enabled"]
    value = os.environ.get(ENV)
    if value is None or value == "":
        return DEFAULT_ENABLED[schedule] and (device is None or device.type == "cuda")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1 (the fp32 log-prob statistics off or on), got {value!r}")
    return value == "1"


def one_pass_dz() -> str:
    """How the one pass with the fp32 statistics makes ``dz`` (:data:`ONE_PASS_DZ`): a :func:`forced` block's
    answer, else the environment's (:data:`DZ_ENV`), else :data:`ONE_PASS_DZ`.

    Raises:
        ValueError: for a value of :data:`DZ_ENV` other than ``tile`` or ``recompute``.
    """
    if "one_pass_dz" in _FORCED:
        return _FORCED["one_pass_dz"]
    value = os.environ.get(DZ_ENV) or ONE_PASS_DZ
    if value not in _DZ_MODES:
        raise ValueError(f"{DZ_ENV} must be tile or recompute (how the one pass makes the logits gradient from the "
                         f"fp32 statistics), got {value!r}")
    return value


def runs_on(weight: torch.Tensor, schedule: str = "two_passes") -> bool:
    """Whether the fused matmul runs with ``weight`` (``[N, H]``, the matmul's operand) for a call in ``schedule``:
    :func:`enabled` there, row-major with TMA-aligned rows (base address and row stride multiples of 16 bytes), and
    bf16 on a CUDA device of compute capability ≥ 9.0 (an fp32 matmul stays cuBLAS's: Triton's fp32 ``tl.dot`` is
    TF32 or slow) or, on CPU (Triton's interpreter, tests), bf16 or fp32. The rows operand must then be
    :func:`readable` beside it."""
    if not enabled(schedule, weight.device) or weight.dim() != 2:
        return False
    if weight.is_cuda:
        if weight.dtype != torch.bfloat16 or capability(weight.device) < (9, 0):
            return False
    elif weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32):
        return False
    return readable(weight, weight)


def readable(h: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the fused matmul can read ``h [M, H]`` beside ``weight``: its dtype and device, row-major,
    TMA-aligned."""
    return (h.dim() == 2 and h.dtype == weight.dtype and h.device == weight.device and h.stride(-1) == 1
            and tma_operand(h) is None)


def applies(h: torch.Tensor, weight: torch.Tensor, schedule: str = "two_passes") -> bool:
    """Whether :func:`~.fused_matmul.logits_statistics_` runs on ``h [M, H]`` and ``weight [N, H]`` for a call in
    ``schedule`` (:func:`runs_on` and :func:`readable`)."""
    return runs_on(weight, schedule) and readable(h, weight)


__all__ = ["DEFAULT_ENABLED", "DZ_ENV", "ENV", "ONE_PASS_DZ", "applies", "enabled", "forced", "one_pass_dz", "readable",
           "runs_on"]
