"""Trainers: thin subclasses that route the loss through :mod:`hf_fused.model`; no tile math here.

``FusedGRPOTrainer`` and ``FusedAsyncGRPOTrainer`` need ``trl`` (``pip install hf_fused[trl]``) and are imported
on first use.
"""

from .sft import FusedTrainer


def __getattr__(name):
    if name == "FusedGRPOTrainer":
        from .grpo import FusedGRPOTrainer

        return FusedGRPOTrainer
    if name == "FusedAsyncGRPOTrainer":
        from .async_grpo import FusedAsyncGRPOTrainer

        return FusedAsyncGRPOTrainer
    raise AttributeError(f"module 'hf_fused.trainers' has no attribute {name!r}")


__all__ = ["FusedAsyncGRPOTrainer", "FusedGRPOTrainer", "FusedTrainer"]
