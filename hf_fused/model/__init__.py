"""The model layer: find backbone and lm_head through wrappers and patch one generic forward."""

from .forward import FUSED_OUTPUTS, FusedLossBypassedWarning, fused_forward
from .lm_head import head_tensors
from .patch import apply_fused_loss, is_fused, original_forward_only, remove_fused_loss, verify_patch
from .transform_probe import FusedLossVerificationError, config_logit_transform, probe_logit_transform
from .unwrap import find_causal_lm

__all__ = [
    "FUSED_OUTPUTS",
    "FusedLossBypassedWarning",
    "FusedLossVerificationError",
    "apply_fused_loss",
    "config_logit_transform",
    "find_causal_lm",
    "fused_forward",
    "head_tensors",
    "is_fused",
    "original_forward_only",
    "probe_logit_transform",
    "remove_fused_loss",
    "verify_patch",
]
