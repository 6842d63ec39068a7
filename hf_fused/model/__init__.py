"""The model layer: find backbone and lm_head through wrappers and patch one generic forward.

Its extension point for the integrations (:mod:`hf_fused.integrations`): :class:`ModelExtension`, registered with
:func:`register_extension`, answers a library's own calls of a patched model and hears of each patch and removal;
a call's instructions to the lm_head intercept are a :class:`FusedRequest` run under :func:`intercept_lm_head`
(the original forward around it: :func:`run_intercepted`), with the model's :class:`FusedLossState`
(``model._hf_fused``).
"""

from .extensions import ModelExtension, patched_models, register_extension, registered_extensions, unregister_extension
from .forward import (
    FUSED_OUTPUTS,
    FusedLossBypassedWarning,
    FusedLossState,
    FusedRequest,
    PatchedForward,
    as_kwargs,
    fused_forward,
    head_operands,
    intercept_lm_head,
    op_options,
    run_intercepted,
)
from .lm_head import head_tensors
from .patch import apply_fused_loss, is_fused, original_forward_only, remove_fused_loss, verify_patch
from .transform_probe import FusedLossVerificationError, config_logit_transform, probe_logit_transform
from .unwrap import find_causal_lm

# The layer's public names for users. The other names imported above are its interface to the layers above it
# (hf_fused.integrations, hf_fused.trainers), not part of the package's public surface.
__all__ = [
    "FusedLossBypassedWarning",
    "FusedLossVerificationError",
    "apply_fused_loss",
    "is_fused",
    "original_forward_only",
    "remove_fused_loss",
]
