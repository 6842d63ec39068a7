"""``transformers.Trainer`` with a patched model: predictions are real logits; Liger's layer kernels, not its loss.

Predictions. ``Trainer.prediction_step`` gathers ``outputs.logits`` whenever it is not asked for the loss only
(``evaluate()`` with ``compute_metrics``, ``predict()``, ``preprocess_logits_for_metrics``). A patched model
returns no logits with labels, so the metric function would see empty predictions. hf_fused wraps
``Trainer.prediction_step`` once (class level, idempotent): for a model patched by
:func:`hf_fused.apply_fused_loss` those calls run its original forward, logits and all
(:func:`hf_fused.original_forward_only`); every other call, and every unpatched model, is untouched.
Loss-only evaluation keeps the fused, logit-free loss.

Liger. ``Trainer(args=TrainingArguments(use_liger_kernel=True))`` calls ``apply_liger_kernel(model,
liger_kernel_config)`` when training starts; Liger's default configuration includes its fused linear
cross-entropy, which replaces the model instance's ``forward`` (``liger_kernel.transformers.monkey_patch``) and so
would silently drop hf_fused's. For a patched model hf_fused wraps that call (once, module level, idempotent) to
apply Liger's layer kernels (RoPE, RMSNorm, SwiGLU, ...) without its fused cross-entropy, as TRL 1.16's trainers
do for their own fused head, and says so once; an explicit ``{"fused_linear_cross_entropy": True}`` is refused.
Every unpatched model gets Liger's call unchanged.
"""

from __future__ import annotations

import functools
import warnings

from ..model.forward import PatchedForward
from ..model.patch import is_fused, original_forward_only
from ..model.unwrap import find_causal_lm

_SAID: set = set()  # what was said once per process


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


def install_liger_kernel_hook() -> None:
    """Wrap ``transformers.trainer.apply_liger_kernel`` (once) as described in the module docstring.

    The wrapper raises ``ValueError`` for a patched model whose ``liger_kernel_config`` asks for
    ``fused_linear_cross_entropy=True`` (both would compute the loss), and ``RuntimeError`` if Liger replaced the
    patched forward anyway (a Liger that patches the forward under another option)."""
    try:
        import transformers.trainer as trainer_module
    except ImportError:  # pragma: no cover - transformers is a dependency
        return
    current = getattr(trainer_module, "apply_liger_kernel", None)
    if current is None or getattr(current, "__hf_fused__", False):
        return

    @functools.wraps(current)
    def apply_liger_kernel(model, kernel_config):
        if not is_fused(model):
            return current(model, kernel_config)
        config = dict(kernel_config or {})
        if config.get("fused_linear_cross_entropy"):
            raise ValueError(
                "liger_kernel_config={'fused_linear_cross_entropy': True} on a model patched by hf_fused: Liger's "
                "fused linear cross-entropy replaces the model's forward, and hf_fused already computes the loss "
                "without logits. Drop that key (Liger's layer kernels still apply, with hf_fused's loss), or call "
                "hf_fused.remove_fused_loss(model) to train with Liger's loss instead."
            )
        if "fused_linear_cross_entropy" not in config and "liger" not in _SAID:
            _SAID.add("liger")
            warnings.warn(
                "use_liger_kernel=True on a model patched by hf_fused: Liger's layer kernels are applied, its fused "
                "linear cross-entropy is not (hf_fused computes the loss). Pass liger_kernel_config="
                "{'fused_linear_cross_entropy': False} to say so and silence this.",
                UserWarning,
                stacklevel=2,
            )
        result = current(model, {**config, "fused_linear_cross_entropy": False})
        if not isinstance(find_causal_lm(model).__dict__.get("forward"), PatchedForward):
            raise RuntimeError(
                "Liger's apply_liger_kernel replaced the forward of a model patched by hf_fused, although "
                "fused_linear_cross_entropy=False was passed; this Liger version is not supported with "
                "apply_fused_loss. Set use_liger_kernel=False, or call hf_fused.remove_fused_loss(model)."
            )
        return result

    apply_liger_kernel.__hf_fused__ = True
    trainer_module.apply_liger_kernel = apply_liger_kernel
