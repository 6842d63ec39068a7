"""``transformers.Trainer`` with a patched model: predictions are real logits; Liger's layer kernels, not its loss.

Predictions. ``Trainer.prediction_step`` gathers ``outputs.logits`` whenever it is not asked for the loss only
(``evaluate()`` with ``compute_metrics``, ``predict()``, ``preprocess_logits_for_metrics``). A patched model
returns no logits with labels, so the metric function would see empty predictions. hf_fused wraps
``Trainer.prediction_step`` once (class level, idempotent; :data:`PREDICTION_STEP`): for a model patched by
:func:`hf_fused.apply_fused_loss` those calls run its original forward, logits and all
(:func:`hf_fused.original_forward_only`); every other call, and every unpatched model, is untouched. Loss-only
evaluation keeps the fused, logit-free loss.

Liger. ``Trainer(args=TrainingArguments(use_liger_kernel=True))`` calls ``apply_liger_kernel(model,
liger_kernel_config)`` when training starts; Liger's default configuration includes its fused linear
cross-entropy, which replaces the model instance's ``forward`` (``liger_kernel.transformers.monkey_patch``) and so
would silently drop hf_fused's. For a patched model hf_fused wraps that call (once, module level, idempotent;
:data:`LIGER_KERNEL`) to apply Liger's layer kernels (RoPE, RMSNorm, SwiGLU, ...) without its fused
cross-entropy, as TRL 1.16's trainers do for their own fused head, and says so once; an explicit
``{"fused_linear_cross_entropy": True}`` is refused. Every unpatched model gets Liger's call unchanged.

Both are entries of the inventory of process-wide patches (:mod:`hf_fused.integrations`), undone by
``uninstall()``.
"""

from __future__ import annotations

import functools
import warnings

from ..model import PatchedForward, find_causal_lm, is_fused, original_forward_only
from .patching import ThirdPartyPatch

_SAID: set = set()  # what was said once per process


def _wrap_prediction_step(trainer_module, patch: ThirdPartyPatch) -> None:
    Trainer = trainer_module.Trainer
    current = Trainer.prediction_step
    live = patch.liveness()

    @functools.wraps(current)
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        if not live() or prediction_loss_only or not is_fused(model):
            return current(self, model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        with original_forward_only(model):
            return current(self, model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    prediction_step.__hf_fused__ = True
    patch.rebind(Trainer, "prediction_step", prediction_step)


PREDICTION_STEP = ThirdPartyPatch(
    name="prediction_step",
    module="transformers.trainer",
    target="transformers.Trainer.prediction_step",
    trigger="first apply_fused_loss (transformers.trainer imported then, or when it is)",
    versions="transformers >= 5.0 (prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None))",
    why="Trainer gathers outputs.logits for compute_metrics / predict(); a patched model returns none with labels",
    passes_through="loss-only steps and unpatched models: Trainer's own prediction_step, unchanged",
    apply=_wrap_prediction_step,
)


def _wrap_apply_liger_kernel(trainer_module, patch: ThirdPartyPatch) -> None:
    """Wrap ``transformers.trainer.apply_liger_kernel`` as described in the module docstring.

    The wrapper raises ``ValueError`` for a patched model whose ``liger_kernel_config`` asks for
    ``fused_linear_cross_entropy=True`` (both would compute the loss), and ``RuntimeError`` if Liger replaced the
    patched forward anyway (a Liger that patches the forward under another option)."""
    current = getattr(trainer_module, "apply_liger_kernel", None)
    if current is None:  # a transformers without Liger support: nothing to adjust
        return
    live = patch.liveness()

    @functools.wraps(current)
    def apply_liger_kernel(model, kernel_config):
        if not live() or not is_fused(model):
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
    patch.rebind(trainer_module, "apply_liger_kernel", apply_liger_kernel)


LIGER_KERNEL = ThirdPartyPatch(
    name="apply_liger_kernel",
    module="transformers.trainer",
    target="transformers.trainer.apply_liger_kernel (the name Trainer.train calls)",
    trigger="first apply_fused_loss (transformers.trainer imported then, or when it is)",
    versions="transformers >= 5.0 (apply_liger_kernel(model, kernel_config)); Liger >= 0.8",
    why="Liger's fused linear cross-entropy replaces the instance's forward and would drop hf_fused's",
    passes_through="unpatched models: Liger's call unchanged; patched ones get its layer kernels only",
    apply=_wrap_apply_liger_kernel,
)
