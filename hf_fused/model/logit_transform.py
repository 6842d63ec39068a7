"""Read an architecture's lm_head logit transform from its config.

transformers' causal LMs change the lm_head output in their forward in a few known ways; each rule
names the config attribute and the models that use it. Whatever is read here is checked against the
original forward when the patch is applied (:func:`hf_fused.model.patch.verify_patch`).
"""

from __future__ import annotations

import torch.nn as nn

from ..ops import LogitTransform


def logit_transform_for(causal_lm: nn.Module) -> LogitTransform:
    """The :class:`~hf_fused.ops.LogitTransform` that ``causal_lm``'s forward applies to lm_head outputs.

    - ``final_logit_softcapping`` (Gemma 2/3/4, nanochat): ``softcap · tanh(z / softcap)``.
    - ``logit_scale`` (Cohere, Cohere2): ``z · logit_scale`` (the model keeps it as an attribute).
    - ``logits_scaling`` (Granite, GraniteMoE): ``z / logits_scaling``.
    - ``lm_head_multiplier`` (Falcon-H1): ``z · lm_head_multiplier``.
    """
    config = causal_lm.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    scale = 1.0
    logit_scale = getattr(causal_lm, "logit_scale", getattr(text_config, "logit_scale", None))
    if isinstance(logit_scale, (int, float)):
        scale *= float(logit_scale)
    logits_scaling = getattr(text_config, "logits_scaling", None)
    if isinstance(logits_scaling, (int, float)):
        scale /= float(logits_scaling)
    multiplier = getattr(text_config, "lm_head_multiplier", None)
    if isinstance(multiplier, (int, float)):
        scale *= float(multiplier)
    softcap = getattr(text_config, "final_logit_softcapping", None)
    return LogitTransform(logit_scale=scale, softcap=float(softcap) if softcap else None)
