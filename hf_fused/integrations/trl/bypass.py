"""When a TRL trainer's call builds a patched model's full logits after all: a subclass that overrides what hf_fused
answers (:func:`subclass_defines`), and the one-time warning that says so (:func:`warn_full_logits_once`)."""

from __future__ import annotations

import warnings

import torch.nn as nn

from ...model import FusedLossBypassedWarning, find_causal_lm


def warn_full_logits_once(model: nn.Module, message: str, stacklevel: int = 3) -> None:
    """Say ``"hf_fused: " + message`` once per patched model as a
    :class:`~hf_fused.model.FusedLossBypassedWarning` (and keep the patched forward's own "called without labels"
    warning from repeating it). ``stacklevel`` as ``warnings.warn`` counts it from the caller of this function."""
    state = find_causal_lm(model)._hf_fused
    if state.warned_without_labels:
        return
    state.warned_without_labels = True
    warnings.warn(f"hf_fused: {message}", FusedLossBypassedWarning, stacklevel=stacklevel + 1)


def subclass_defines(cls: type, trainer_cls: type, name: str) -> bool:
    """Whether ``cls`` takes ``name`` from a subclass of ``trainer_cls`` (not from TRL's class itself)."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return klass is not trainer_cls and issubclass(klass, trainer_cls)
    return False
