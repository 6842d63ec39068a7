"""``transformers.Trainer`` with a patched model: predictions are real logits.

``Trainer.prediction_step`` gathers ``outputs.logits`` whenever it is not asked for the loss only
(``evaluate()`` with ``compute_metrics``, ``predict()``, ``preprocess_logits_for_metrics``). A patched model
returns no logits with labels, so the metric function would see empty predictions. hf_fused wraps
``Trainer.prediction_step`` once (class level, idempotent): for a model patched by
:func:`hf_fused.apply_fused_loss` those calls run its original forward, logits and all
(:func:`hf_fused.original_forward_only`); every other call, and every unpatched model, is untouched.
Loss-only evaluation keeps the fused, logit-free loss.
"""

from __future__ import annotations

import functools

from ..model.patch import is_fused, original_forward_only


def install_prediction_step_hook() -> None:
    """Wrap ``transformers.Trainer.prediction_step`` (once) as described in the module docstring."""
    try:
        from transformers import Trainer
    except ImportError:  # pragma: no cover - transformers is a dependency
        return
    current = Trainer.prediction_step
    if getattr(current, "__hf_fused__", False):
        return

    @functools.wraps(current)
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        if prediction_loss_only or not is_fused(model):
            return current(self, model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        with original_forward_only(model):
            return current(self, model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    prediction_step.__hf_fused__ = True
    Trainer.prediction_step = prediction_step
