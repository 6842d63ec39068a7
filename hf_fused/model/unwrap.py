"""Find the ``*ForCausalLM`` inside the wrappers training stacks put around it."""

from __future__ import annotations

import torch.nn as nn


def find_causal_lm(model: nn.Module) -> nn.Module:
    """The innermost causal LM of ``model``: through ``torch.compile`` (``_orig_mod``), DDP / DeepSpeed /
    accelerate (``.module``) and PEFT (``get_base_model()``) wrappers, in any nesting.

    Returns the module that owns ``get_output_embeddings()`` (the lm_head) and the forward to patch.

    Raises:
        TypeError: if no module with a ``forward`` and an lm_head is found.
    """
    seen = set()
    current = model
    while id(current) not in seen:
        seen.add(id(current))
        if hasattr(current, "_orig_mod") and isinstance(current._orig_mod, nn.Module):
            current = current._orig_mod
        elif _is_peft_model(current):
            current = current.get_base_model()
        elif isinstance(getattr(current, "module", None), nn.Module) and not _has_lm_head(current):
            current = current.module
        else:
            break
    if not _has_lm_head(current):
        raise TypeError(
            f"hf_fused could not find a causal LM with an lm_head inside {type(model).__name__} "
            f"(stopped at {type(current).__name__}). Pass a transformers *ForCausalLM model, optionally "
            "wrapped by PEFT, DDP/DeepSpeed, accelerate or torch.compile."
        )
    return current


def _is_peft_model(module: nn.Module) -> bool:
    return hasattr(module, "get_base_model") and hasattr(module, "peft_config")


def _has_lm_head(module: nn.Module) -> bool:
    get = getattr(module, "get_output_embeddings", None)
    if get is None:
        return False
    try:
        return isinstance(get(), nn.Module)
    except (NotImplementedError, AttributeError):
        return False
