"""The model layer: find backbone and lm_head through wrappers and patch one generic forward."""

from .forward import FUSED_OUTPUTS, FusedLossBypassedWarning, fused_forward
from .lm_head import head_tensors
from .patch import apply_fused_loss, is_fused, original_forward_only, remove_fused_loss, verify_patch
from .transform_probe import FusedLossVerificationError, config_logit_transform, probe_logit_transform
from .unwrap import find_causal_lm

# The layer's public names. The other names imported above are its interface to the trainers and
# integrations (hf_fused.trainers, hf_fused.integrations), not part of the public surface.
__all__ = [
    "FusedLossBypassedWarning",
    "FusedLossVerificationError",
    "apply_fused_loss",
    "is_fused",
    "original_forward_only",
    "remove_fused_loss",
]
