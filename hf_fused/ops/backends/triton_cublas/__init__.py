"""The GPU backend: cuBLAS matmuls for the tiles, Triton kernels between them, and its own planning.

Where each piece lives:

- ``backend.py``: :class:`TritonCublasBackend`, the backend contract over the two schedules.
- Planning, decided once per call: ``plan.py`` (the call's plan, the default rule, :func:`~.plan.forced_plans`,
  ``describe_plan``'s line), from ``one_pass_rule.py`` and ``two_pass_rule.py`` (the rules' arithmetic) and
  ``weight_chunks.py`` (where the two passes' weight gradient adds up with no memory of its own).
- The loops: ``one_pass.py`` (6·N·H·V, gradients in the forward) and ``two_passes.py`` (8·N·H·V, the lean
  path), each choosing its per-call variants once as small strategy objects; ``operands.py`` (the kept rows, the
  bias and weight chunks in the operands' dtype); ``tiles.py`` (launching the tile kernels).
- Kernels: ``triton_kernels.py`` (statistics and gradient epilogues), ``logits_epilogues.py`` (``dz`` in the
  logits matmul's epilogue), ``scaled_round.py`` (the gradients' one rounding), ``compensated.py`` (the
  compensated accumulator, a bf16 gradient plus an int8 residual), ``matmul.py`` (the matmul toolkit:
  fp32-output cuBLAS products, launch shapes, Triton building blocks), ``fused_matmul.py`` (the logits matmul with
  the statistics in its epilogue, from the fp32 accumulator) and ``statistics_partials.py`` (its per-tile partials
  and their merge), chosen per call by ``fp32_logits_rule.py``.
- The optional QuACK kernels: ``quack_epilogues.py`` (the epilogues) and ``quack_bridge.py`` (whether a call runs
  them).

Importing this package imports Triton; the registry (:mod:`hf_fused.ops.backends`) does so only where Triton is
installed. Numerics: docs/design/numerics.md.
"""

from .backend import TritonCublasBackend

__all__ = ["TritonCublasBackend"]
