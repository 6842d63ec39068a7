"""The one-time warning of a TRL trainer's call that builds a patched model's full logits after all."""

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
