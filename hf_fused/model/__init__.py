"""The model layer: find backbone and lm_head through wrappers and patch one generic forward."""

from .forward import FUSED_OUTPUTS, fused_forward
from .lm_head import head_tensors
from .logit_transform import logit_transform_for
from .patch import FusedLossVerificationError, apply_fused_loss, is_fused, original_forward_only, remove_fused_loss, verify_patch
from .unwrap import find_causal_lm

__all__ = [
    "FUSED_OUTPUTS",
    "FusedLossVerificationError",
    "apply_fused_loss",
    "find_causal_lm",
    "fused_forward",
    "head_tensors",
    "is_fused",
    "logit_transform_for",
    "original_forward_only",
    "remove_fused_loss",
    "verify_patch",
]
