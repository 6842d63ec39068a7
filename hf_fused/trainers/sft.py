"""``FusedTrainer``: transformers.Trainer with the causal-LM loss computed by hf_fused."""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch.nn as nn
from transformers import Trainer

from ..model import apply_fused_loss, original_forward_only


def resolve_fused_options(fused_options: Optional[dict], fused_loss_kwargs: Optional[dict]) -> dict:
    """The trainers' one name for :func:`hf_fused.apply_fused_loss` options is ``fused_options``;
    ``fused_loss_kwargs`` (FusedTrainer's former name) is accepted with a ``FutureWarning``.

    Raises:
        ValueError: both given.
    """
    if fused_loss_kwargs is not None:
        if fused_options is not None:
            raise ValueError("pass fused_options only (fused_loss_kwargs is its deprecated former name)")
        warnings.warn("fused_loss_kwargs is deprecated and will be removed; pass fused_options instead",
                      FutureWarning, stacklevel=3)
        fused_options = fused_loss_kwargs
    return dict(fused_options or {})


class FusedTrainer(Trainer):
    """A drop-in :class:`transformers.Trainer` whose model computes its loss from hidden states.

    The model is patched with :func:`hf_fused.apply_fused_loss` (keyword ``fused_options`` is passed to it,
    e.g. ``{"tile_budget_bytes": 64 * 2**20}``; the same name as in :class:`~hf_fused.FusedGRPOTrainer`, and
    ``fused_loss_kwargs``, its former name, still works with a ``FutureWarning``). Everything else is Trainer's own code, so its
    semantics hold unchanged: gradient accumulation normalized by ``num_items_in_batch``,
    ``average_tokens_across_devices``, eval loss, ``prediction_loss_only``. Whenever Trainer gathers
    predictions (``prediction_loss_only`` off: ``evaluate()`` with ``compute_metrics``, ``predict()``) it runs
    the original forward, so predictions are the logits; ``evaluate()`` without ``compute_metrics`` (which
    Trainer runs with ``prediction_loss_only=True``) keeps the fused, logit-free loss. ``use_liger_kernel=True``
    applies Liger's layer kernels (RoPE, RMSNorm, SwiGLU, ...) with hf_fused's loss, not Liger's fused
    cross-entropy (:mod:`hf_fused.integrations.transformers_trainer`).

    Raises:
        ValueError: with ``label_smoothing_factor > 0`` or ``compute_loss_func``: each needs the logits (or
            replaces the loss) that the fused path never builds; with both ``fused_options`` and
            ``fused_loss_kwargs``; at ``train()``, with ``liger_kernel_config={"fused_linear_cross_entropy":
            True}`` (Liger's loss would replace hf_fused's); a bad ``tile_budget_bytes`` or ``backend`` in
            ``fused_options``.
        TypeError, NotImplementedError, FusedLossVerificationError: from :func:`hf_fused.apply_fused_loss`, for a
            model it cannot patch or whose patched forward disagrees with the original on its probe (an unknown
            key in ``fused_options`` is a ``TypeError``).
        RuntimeError: at ``train()``, if Liger replaced the patched forward anyway.
    """

    def __init__(self, *args, fused_options: Optional[dict[str, Any]] = None,
                 fused_loss_kwargs: Optional[dict[str, Any]] = None, **kwargs):
        self._fused_loss_kwargs = resolve_fused_options(fused_options, fused_loss_kwargs)
        super().__init__(*args, **kwargs)
        if self.args.label_smoothing_factor > 0:
            raise ValueError(
                "FusedTrainer computes the loss without logits, so label_smoothing_factor > 0 is not supported; "
                "set it to 0 or use transformers.Trainer."
            )
        if self.compute_loss_func is not None:
            raise ValueError(
                "FusedTrainer computes the loss inside the model; compute_loss_func would receive no logits. "
                "Use transformers.Trainer for a custom loss on logits, or hf_fused.ops in your own loss."
            )
        if self.model is not None:
            apply_fused_loss(self.model, **self._fused_loss_kwargs)

    def call_model_init(self, trial=None) -> nn.Module:
        return apply_fused_loss(super().call_model_init(trial), **self._fused_loss_kwargs)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        # Not `or self.compute_metrics is None`: predict() needs the logits without compute_metrics too.
        if prediction_loss_only:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        with original_forward_only(model):
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
