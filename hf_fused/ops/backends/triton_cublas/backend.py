"""The GPU backend's class: the backend contract (:mod:`hf_fused.ops.backends.protocol`) over its two schedules.

``logprobs_with_grads`` and ``token_loss_with_grads`` run the one pass (:mod:`.one_pass`) when the plan
(:mod:`.plan`) allows it and return ``None`` otherwise; ``logprobs_forward`` and ``logprobs_backward`` are the two
passes' statistics and gradient passes (:mod:`.two_passes`); ``distillation_pass`` is the distillation op's pass
(:mod:`.distillation_pass`); ``describe_plan`` says which a call would take.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch

from ...grads import HeadGrads
from ...head_inputs import HeadInputs, NeededGrads
from ..protocol import HeadPass, TileGrads, logprob_tile_grads
from .one_pass import run_one_pass
from .plan import describe
from .two_passes import run_gradient_pass, run_statistics_pass


class TritonCublasBackend:
    """cuBLAS matmuls for the tiles, Triton kernels between them: the same interface as
    :class:`~hf_fused.ops.backends.torch_reference.TorchReferenceBackend`
    (:class:`~hf_fused.ops.backends.protocol.TokenLossBackend`)."""

    name = "triton"

    def logprobs_with_grads(
        self, head: HeadInputs, grad_logprobs: Union[None, torch.Tensor, Callable[[], torch.Tensor]], *,
        need: NeededGrads, return_entropy: bool = False, statistics: Sequence[str] = (),
    ) -> Optional[HeadPass]:
        """Like :meth:`TorchReferenceBackend.logprobs_with_grads`: one pass (6·M·H·V), token rows outside
        and whole vocabulary rows per tile, or ``None`` when the plan chooses the two passes."""
        tile_grads = logprob_tile_grads(grad_logprobs) if need.any else None
        return run_one_pass(head, tile_grads, need, return_entropy, statistics, entropy_in_grads=False)

    def token_loss_with_grads(
        self, head: HeadInputs, tile_grads: TileGrads, *, need: NeededGrads, return_entropy: bool = False,
        statistics: Sequence[str] = (), grads_read_entropy: bool = True,
    ) -> Optional[HeadPass]:
        """Like :meth:`TorchReferenceBackend.token_loss_with_grads` on the one pass of :meth:`logprobs_with_grads`:
        per full-vocabulary row block, the statistics kernel (or QuACK's epilogue), then
        ``tile_grads(r0, r1, logp, entropy)`` on the block's ``[rows]`` statistics for the per-row
        ``(g_lp, g_ent)``, then the gradient kernel on the same logits. ``None`` when the plan chooses two passes
        (the op then runs statistics + recompute)."""
        return run_one_pass(head, tile_grads, need, return_entropy, statistics, entropy_in_grads=grads_read_entropy)

    def logprobs_forward(
        self, head: HeadInputs, *, return_entropy: bool = False, statistics: Sequence[str] = (),
    ) -> HeadPass:
        """Like :meth:`TorchReferenceBackend.logprobs_forward`, vocabulary chunks outside."""
        return run_statistics_pass(head, return_entropy, statistics)

    def logprobs_backward(
        self, head: HeadInputs, lse: torch.Tensor, entropy: Optional[torch.Tensor],
        grad_logprobs: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor], *, need: NeededGrads,
    ) -> HeadGrads:
        """Like :meth:`TorchReferenceBackend.logprobs_backward`, vocabulary chunks outside."""
        return run_gradient_pass(head, lse, entropy, grad_logprobs, grad_entropy, need)

    def support_loss_pass(self, head: HeadInputs, support, *, tile_loss=None, row_grads=None,
                          need: NeededGrads = NeededGrads(False, False, False), return_entropy: bool = False):
        """:func:`hf_fused.ops.support_loss.support_loss_pass`'s contract on the one pass, candidate columns set by
        their own kernels (:mod:`.support_pass`); ``None`` when the plan chooses two passes."""
        from .support_pass import run_support_pass

        return run_support_pass(head, support, tile_loss=tile_loss, row_grads=row_grads, need=need,
                                return_entropy=return_entropy)

    def distillation_pass(self, student: HeadInputs, teacher: HeadInputs, beta: float, *,
                          row_grads: Union[None, float, torch.Tensor] = None,
                          need: NeededGrads = NeededGrads(False, False, False)):
        """:func:`hf_fused.ops.distillation.distillation_pass` with the tile epilogue in Triton
        (:mod:`.distillation_pass`); ``None`` for fp16 operands, which the op then runs through its plain-PyTorch
        pass."""
        from .distillation_pass import run_distillation_pass, runs_triton_pass

        if not runs_triton_pass(student):
            return None
        return run_distillation_pass(student, teacher, beta, row_grads=row_grads, need=need)

    def describe_plan(self, weight: torch.Tensor, *, n_rows: int, tile_budget_bytes: Optional[int] = None,
                      need_weight: Optional[bool] = None, n_tokens: Optional[int] = None) -> str:
        """Which schedule a call would take and its working set (:func:`~.plan.describe`)."""
        return describe(weight, n_rows=n_rows, tile_budget_bytes=tile_budget_bytes, need_weight=need_weight,
                        n_tokens=n_tokens)
