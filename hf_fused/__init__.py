"""hf_fused: causal-LM losses from hidden states and lm_head, tile by tile, so the ``[tokens, vocab]``
logits never exist.

What users call, all importable from here:

* the model switch: :func:`apply_fused_loss` (patch one model instance), :func:`remove_fused_loss`,
  :func:`original_forward_only` (a block with the original forward, logits and all), :func:`is_fused`;
* the ops on plain tensors: :func:`linear_cross_entropy`, :func:`linear_logprobs`, :func:`linear_token_loss`
  (a token-separable loss in one pass), :func:`linear_grpo_loss` (open-instruct's GRPO objective on it) and
  :func:`linear_distillation_loss` (a student's divergence from a teacher, TRL's conventions),
  :func:`sparse_distillation_loss` (from a teacher's top-k log-probs) on :func:`linear_support_loss` (any loss of
  the log-probs at K candidate ids), and :func:`linear_topk_logprobs` (a teacher's top-k);
* a loss module that owns the output layer (pipeline schedules, custom loops): :class:`LinearCrossEntropyLoss`;
* the trainers: :class:`FusedTrainer` (``transformers.Trainer``), :class:`FusedGRPOTrainer`
  (``trl.GRPOTrainer``) and :class:`FusedAsyncGRPOTrainer` (TRL's experimental ``AsyncGRPOTrainer``), imported on
  first use so ``import hf_fused`` needs neither trl nor a Trainer;
* what they raise or warn, for ``except`` and ``warnings.filterwarnings``: :class:`FusedLossVerificationError`
  (the patch-time check against the original forward failed), :class:`FusedLossBypassedWarning` (a call
  ran without the fused loss), :class:`HintMissedWarning` (a ``grad_hint`` did not match the upstream
  gradient: exact but slower).

Layers, each importing only the ones below it (a checked contract: ``.importlinter``): :mod:`hf_fused.ops` (the
math) ← :mod:`hf_fused.model` (patch a transformers model) ← :mod:`hf_fused.integrations` (serve TRL's and
transformers' own calls on a patched model; every process-wide patch they make is listed there, with its undo)
← :mod:`hf_fused.trainers`. The integrations plug into the model layer's extension point
(:mod:`hf_fused.model.extensions`) when this package is imported. Names not listed in ``__all__`` are internals.
"""

from .model import (
    FusedLossBypassedWarning,
    FusedLossVerificationError,
    apply_fused_loss,
    is_fused,
    original_forward_only,
    remove_fused_loss,
)
from .model.head_loss import LinearCrossEntropyLoss
from . import integrations  # noqa: F401  (registers TRL's and transformers' integrations with the model layer)
from .ops import HintMissedWarning, linear_cross_entropy, linear_grpo_loss, linear_logprobs, linear_token_loss
from .ops import linear_distillation_loss, linear_support_loss, linear_topk_logprobs, sparse_distillation_loss

__version__ = "0.1.0"

_TRAINERS = {"FusedTrainer": "sft", "FusedGRPOTrainer": "grpo", "FusedAsyncGRPOTrainer": "async_grpo"}


def __getattr__(name):
    if name in _TRAINERS:
        import importlib

        return getattr(importlib.import_module(f"hf_fused.trainers.{_TRAINERS[name]}"), name)
    raise AttributeError(f"module 'hf_fused' has no attribute {name!r}")


__all__ = [
    "FusedAsyncGRPOTrainer",
    "FusedGRPOTrainer",
    "FusedLossBypassedWarning",
    "FusedLossVerificationError",
    "FusedTrainer",
    "HintMissedWarning",
    "LinearCrossEntropyLoss",
    "apply_fused_loss",
    "is_fused",
    "linear_cross_entropy",
    "linear_distillation_loss",
    "linear_grpo_loss",
    "linear_logprobs",
    "linear_support_loss",
    "linear_token_loss",
    "linear_topk_logprobs",
    "original_forward_only",
    "remove_fused_loss",
    "sparse_distillation_loss",
]
