"""hf_fused: causal-LM losses from hidden states and lm_head, tile by tile, so the ``[tokens, vocab]``
logits never exist.

Layers: :mod:`hf_fused.ops` (the math on tensors) → :mod:`hf_fused.model` (patch a transformers model)
→ :mod:`hf_fused.trainers` (Trainer / GRPOTrainer subclasses, imported lazily so ``import hf_fused``
needs neither trl nor a Trainer).
"""

from .model import FusedLossVerificationError, apply_fused_loss, is_fused, remove_fused_loss
from .ops import linear_cross_entropy, linear_logprobs

__version__ = "0.1.0"

_TRAINERS = {"FusedTrainer": "sft", "FusedGRPOTrainer": "grpo"}


def __getattr__(name):
    if name in _TRAINERS:
        import importlib

        return getattr(importlib.import_module(f"hf_fused.trainers.{_TRAINERS[name]}"), name)
    raise AttributeError(f"module 'hf_fused' has no attribute {name!r}")


__all__ = [
    "FusedGRPOTrainer",
    "FusedLossVerificationError",
    "FusedTrainer",
    "apply_fused_loss",
    "is_fused",
    "linear_cross_entropy",
    "linear_logprobs",
    "remove_fused_loss",
]
